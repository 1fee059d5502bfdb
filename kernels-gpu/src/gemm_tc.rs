//! GEMM on the tensor cores in bf16 and f16 ("tensor-core"): `D = epilogue(alpha * op(A) @
//! op(B) + beta * C)` with f32 accumulation, A and B both bf16 or both f16, D bf16, f16 or f32,
//! every transpose, batched. The general path: every GPU from sm_80 runs it, and on sm_90 it
//! serves what a Hopper-specific kernel does not take. The epilogue is `gemm_epilogue.rs`.
//!
//! # The arithmetic
//! `mma.sync.m16n8k16` multiplies bf16 (or f16) values exactly and adds in f32; the
//! accumulators are f32 for the whole of K, and D is rounded once, to its dtype, in the
//! epilogue.
//!
//! # The design
//! - 128 x 128 tiles of C per block of 256 threads (8 warps, 2 x 4, each a 64 x 32 block of C:
//!   4 x 4 tensor-core tiles of 16 x 8, 64 accumulators a thread). The tile of the 3xTF32 kernel;
//!   128 x 128 gives 64 flops per loaded byte, and 64 accumulators leave room under ptxas's 128
//!   registers for two blocks an SM (`build_ptx.rs`), 16 warps to hide the latency of `ldmatrix`
//!   and the tensor cores.
//! - Stages of `BK = 32` along K copied with `cp.async` (no staging registers) into a ring of
//!   `STAGES = 4` slots (80 KiB: two blocks fit in the 227 KiB of an H100 or A100 SM), one barrier
//!   per stage. Each operand is kept as it is stored: rows along K (`[r][k]`, `BK + 8` elements)
//!   or along M/N (`[k][r]`, `128 + 8` elements). The padding of 16 bytes a row puts the 8 rows
//!   that one `ldmatrix` phase reads into 8 distinct 16-byte bank groups.
//! - Fragments come from `ldmatrix.x4`: an operand stored with rows along K is read as it is,
//!   one stored with rows along M or N with `.trans` (the transposes cost nothing).
//! - Edges: a 16-byte chunk (8 elements) is copied with a source size of 0-16 bytes, the rest
//!   zero-filled, so any M, N, K work. An operand whose rows or batches are not 16-byte aligned
//!   (leading dimension not a multiple of 8, or a base off 16 bytes) is loaded element by element
//!   with ordinary loads stored into the slot: slower, never an error.

use crate::gemm_epilogue::Epilogue;

/// Rows (M) of C per block.
pub const BM: u32 = 128;
/// Columns (N) of C per block.
pub const BN: u32 = 128;
/// K steps per stage.
pub const BK: u32 = 32;
/// Threads per block: 8 warps.
pub const THREADS: u32 = 256;
/// Slots in the shared-memory ring.
pub const STAGES: u32 = 4;
/// Elements per shared-memory row of an operand whose rows run along K.
pub const SK: u32 = BK + 8;
/// Elements per shared-memory row of an operand whose rows run along M or N.
pub const SR: u32 = BM + 8;
/// Bytes of one operand's slot: the larger of the two layouts.
pub const OPERAND_BYTES: u32 = 2 * if BM * SK > BK * SR { BM * SK } else { BK * SR };
/// Bytes of one ring slot (A, then B).
pub const STAGE_BYTES: u32 = 2 * OPERAND_BYTES;
/// Dynamic shared memory of a block.
pub const SMEM_BYTES: u32 = STAGES * STAGE_BYTES;

/// `(a, b, lda, ldb, stride_a, stride_b, k, epilogue)`: for batch `z = blockIdx.z`, tile
/// `(blockIdx.y, blockIdx.x)` of `D_z = epilogue(op(A_z) @ op(B_z))`, `A_z = a + z * stride_a`
/// (strides in elements, 0: shared), `op(A)` `m x k` (stored `m x k` with row stride `lda`, or
/// `k x m` for the `t` kernels), `op(B)` `k x n` (stored `k x n`, or `n x k`); `m`, `n`, D and
/// the rest in the [`Epilogue`]. Element pointers are to bf16 or f16 values.
pub type GemmTcArgs = (*const u16, *const u16, u64, u64, u64, u64, u32, Epilogue);

/// `(ws, splits, epilogue)`: `D = epilogue(sum_s ws[s])`, the f32 slices `ws[s]` contiguous
/// `m x n`, summed in order `s = 0, 1, ...`. One thread per two columns of a row.
pub type SplitKReduceTcArgs = (*const f32, u32, Epilogue);

/// Threads per block of the split-K reduction.
pub const SPLITK_THREADS: u32 = 256;

/// The tensor-core kernel for inputs of `input` (bf16 or f16), output `output` and the
/// transposes; `None` for an input dtype without one (f32).
#[cfg(not(target_arch = "nvptx64"))]
pub const fn tc_kernel(
    input: crate::DType,
    output: crate::DType,
    trans_a: bool,
    trans_b: bool,
) -> Option<crate::kernel::Kernel<GemmTcArgs>> {
    let i = match input {
        crate::DType::BF16 => 0,
        crate::DType::F16 => 1,
        crate::DType::F32 => return None,
    };
    let o = match output {
        crate::DType::BF16 => 0,
        crate::DType::F16 => 1,
        crate::DType::F32 => 2,
    };
    Some(TC[i][o][2 * trans_a as usize + trans_b as usize])
}

/// The split-K reduction into D of dtype `output`.
#[cfg(not(target_arch = "nvptx64"))]
pub const fn splitk_reduce_kernel(output: crate::DType) -> crate::kernel::Kernel<SplitKReduceTcArgs> {
    match output {
        crate::DType::BF16 => gemm_tc_splitk_reduce_bf16,
        crate::DType::F16 => gemm_tc_splitk_reduce_f16,
        crate::DType::F32 => gemm_tc_splitk_reduce_f32,
    }
}

/// Every kernel of this family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
    TC.iter().flat_map(|by_out| by_out.iter().flat_map(|layouts| layouts.iter().map(|k| k.entry()))).chain([
        gemm_tc_splitk_reduce_bf16.entry(),
        gemm_tc_splitk_reduce_f16.entry(),
        gemm_tc_splitk_reduce_f32.entry(),
    ])
}

/// An input type of the tensor cores: its `mma`.
pub trait InType: crate::dtype::Elem {
    /// `d = a @ b + c`, one warp's m16n8k16 product (`prim::mma_bf16_16x8x16`).
    #[cfg(target_arch = "nvptx64")]
    fn mma(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4];
}

impl InType for crate::dtype::BF16 {
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn mma(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        crate::prim::mma_bf16_16x8x16(a, b, c)
    }
}

impl InType for crate::dtype::F16 {
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn mma(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        crate::prim::mma_f16_16x8x16(a, b, c)
    }
}

// The tile machinery is shared with the convolution's implicit GEMM (`conv/`).
#[cfg(target_arch = "nvptx64")]
pub(crate) mod device {
    use super::*;
    use crate::gemm_epilogue::{OutType, store_pair};
    use crate::prim;

    /// Chunks (16 bytes, 8 elements) of one operand a thread copies per stage: 128 x 32 / 8 / 256.
    const CH: usize = 2;

    /// One operand's copies for one thread. `KC`: the operand's rows run along K (`x[r * ld +
    /// k]`): chunk `c` is row `c / 4`, K offset `8 * (c % 4)`; otherwise `x[k * ld + r]`: chunk
    /// `c` is K row `c / 16`, columns `8 * (c % 16)`. Consecutive threads copy consecutive
    /// chunks, i.e. whole rows.
    pub(crate) struct Loader<const KC: bool> {
        /// Global address of each chunk in the next stage to copy.
        ptr: [*const u16; CH],
        /// A valid address to name when a chunk copies nothing (the tile's origin).
        origin: *const u16,
        /// KC: whether the chunk's row is inside the matrix (0 or 8); else how many of its 8
        /// columns are.
        r_in: [u32; CH],
        /// Each chunk's K offset in a stage.
        kk: [u32; CH],
        /// Each chunk's byte offset in the operand's slot.
        soff: [u32; CH],
        /// Advance of `ptr` per stage, in elements.
        step: usize,
        /// Rows (and batches) 16-byte aligned: chunks are copied whole by `cp.async`.
        aligned: bool,
    }

    impl<const KC: bool> Loader<KC> {
        /// `x` is the tile's origin (first row along R, K = 0), `r_left` rows of the operand
        /// remain from there.
        #[inline(always)]
        pub(crate) unsafe fn new(x: *const u16, ld: u64, r_left: u32, aligned: bool, tid: u32) -> Self {
            let mut l = Loader {
                ptr: [x; CH],
                origin: x,
                r_in: [0; CH],
                kk: [0; CH],
                soff: [0; CH],
                step: if KC { BK as usize } else { (BK as u64 * ld) as usize },
                aligned,
            };
            unroll!(I: usize; 0 1 => {
                let c = tid + I as u32 * THREADS;
                let (r, kk) = if KC { (c / (BK / 8), 8 * (c % (BK / 8))) } else { (8 * (c % (BM / 8)), c / (BM / 8)) };
                let off = if KC { r as u64 * ld + kk as u64 } else { kk as u64 * ld + r as u64 };
                // SAFETY: address arithmetic; copies check the bounds.
                l.ptr[I] = unsafe { x.add(off as usize) };
                l.kk[I] = kk;
                l.soff[I] = 2 * if KC { r * SK + kk } else { kk * SR + r };
                l.r_in[I] = if KC { if r < r_left { 8 } else { 0 } } else { r_left.saturating_sub(r).min(8) };
            });
            l
        }

        /// Starts the copies of the next stage into the slot at `slot`; `k_left` = K minus the
        /// stage's first K index (> 0).
        #[inline(always)]
        pub(crate) unsafe fn copy(&mut self, k_left: u32, slot: u32) {
            unroll!(I: usize; 0 1 => {
                let n_in = if KC {
                    if self.r_in[I] > 0 { k_left.saturating_sub(self.kk[I]).min(8) } else { 0 }
                } else if self.kk[I] < k_left {
                    self.r_in[I]
                } else {
                    0
                };
                let src = if n_in > 0 { self.ptr[I] } else { self.origin };
                let dst = slot + self.soff[I];
                if self.aligned {
                    // SAFETY: `n_in` elements from `src` lie inside the operand, 16-byte aligned
                    // (`aligned`, and chunk offsets are multiples of 8 elements); `dst` is the
                    // chunk's 16 bytes of the slot, which no thread reads until the barrier
                    // after this copy's group has been waited for.
                    unsafe { prim::cp_async_16(dst, src as *const f32, 2 * n_in) };
                } else {
                    let mut w = [0u32; 4];
                    unroll!(J: usize; 0 1 2 3 4 5 6 7 => {
                        if (J as u32) < n_in {
                            // SAFETY: element J of the chunk is inside the operand (`n_in`).
                            let v = unsafe { *src.add(J) } as u32;
                            w[J / 2] |= v << (16 * (J % 2));
                        }
                    });
                    // SAFETY: `dst` is 16-byte aligned inside the slot, which every thread
                    // finished reading before the barrier that preceded this copy.
                    unsafe { prim::st_shared_v4_f32(dst, w.map(f32::from_bits)) };
                }
                // SAFETY: address arithmetic; the next copy checks the bounds again.
                self.ptr[I] = unsafe { self.ptr[I].add(self.step) };
            });
        }
    }

    /// Byte offset, in an operand's slot, of the row this lane names to `ldmatrix` for the four
    /// 8 x 8 matrices of one fragment: matrix `i = lane / 8` is `dr` rows and `dk` K steps from
    /// the fragment's origin (`r0`, K = 0), row `lane % 8` of it. A `KC` operand is stored
    /// `[r][k]` (the lane names row `r`), the other `[k][r]` (row `k`, read transposed).
    #[inline(always)]
    pub(crate) fn lane_offset<const KC: bool>(r0: u32, dr: u32, dk: u32, j: u32) -> u32 {
        2 * if KC { (r0 + dr + j) * SK + dk } else { (dk + j) * SR + r0 + dr }
    }

    /// Four 8 x 8 matrices at `addr` (this lane's row), transposed unless the operand is `KC`.
    ///
    /// # Safety
    /// As `prim::ldmatrix_x4`.
    #[inline(always)]
    pub(crate) unsafe fn ldsm<const KC: bool>(addr: u32) -> [u32; 4] {
        // SAFETY: per the contract.
        unsafe { if KC { prim::ldmatrix_x4(addr) } else { prim::ldmatrix_x4_trans(addr) } }
    }

    /// The GEMM of one 128 x 128 tile of D. `KA = !TA` (A's rows run along K unless it is
    /// transposed); B's rows run along K when it is transposed.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm<I: InType, O: OutType, const TA: bool, const KA: bool, const TB: bool>(
        a: *const u16,
        b: *const u16,
        lda: u64,
        ldb: u64,
        stride_a: u64,
        stride_b: u64,
        k: u32,
        e: Epilogue,
    ) {
        let tid = prim::thread_idx_x();
        let (warp, lane) = (tid / 32, tid % 32);
        let (wm, wn) = (warp / 4, warp % 4);
        let (g, t) = (lane / 4, lane % 4);
        let z = prim::block_idx_z();
        let m0 = prim::block_idx_y() * BM;
        let n0 = prim::block_idx_x() * BN;
        // SAFETY (all pointer arithmetic below): the host sized the grid to the matrices; rows
        // and columns outside them are never dereferenced.
        let (a, b) = unsafe { (a.add((z as u64 * stride_a) as usize), b.add((z as u64 * stride_b) as usize)) };
        let al = |p: *const u16, ld: u64, s: u64| (p as u64 | (ld * 2) | (s * 2)) & 15 == 0;
        let a_tile = unsafe { if TA { a.add(m0 as usize) } else { a.add(m0 as usize * lda as usize) } };
        let b_tile = unsafe { if TB { b.add(n0 as usize * ldb as usize) } else { b.add(n0 as usize) } };
        let mut la = unsafe { Loader::<KA>::new(a_tile, lda, e.m - m0, al(a, lda, stride_a), tid) };
        let mut lb = unsafe { Loader::<TB>::new(b_tile, ldb, e.n - n0, al(b, ldb, stride_b), tid) };

        let smem = prim::dyn_smem_addr();
        let stages = k.div_ceil(BK);
        // The ring's first STAGES - 1 slots; one commit per slot even when empty, so that the
        // wait below always counts the same number of groups.
        for s in 0..STAGES - 1 {
            if s < stages {
                let slot = smem + s * STAGE_BYTES;
                unsafe {
                    la.copy(k - s * BK, slot);
                    lb.copy(k - s * BK, slot + OPERAND_BYTES);
                }
            }
            prim::cp_async_commit();
        }

        // This lane's ldmatrix rows: A's matrices are (rows 0-7, K 0-7), (rows 8-15, K 0-7),
        // (rows 0-7, K 8-15), (rows 8-15, K 8-15), the order of the mma's `a`; B's are (K 0-7,
        // cols 0-7), (K 8-15, cols 0-7), (K 0-7, cols 8-15), (K 8-15, cols 8-15): the `b` of two
        // adjacent 8-column tiles.
        let (i, j) = (lane / 8, lane % 8);
        let a_lane = lane_offset::<KA>(wm * 64, 8 * (i % 2), 8 * (i / 2), j);
        let b_lane = OPERAND_BYTES + lane_offset::<TB>(wn * 32, 8 * (i / 2), 8 * (i % 2), j);
        // Steps between fragments: 16 rows (A's MI, B's pairs of NI) and 16 K (KS).
        let r16 = |kc: bool| 2 * if kc { 16 * SK } else { 16 };
        let k16 = |kc: bool| 2 * if kc { 16 } else { 16 * SR };

        let mut acc = [[[0.0f32; 4]; 4]; 4];
        let (mut cur, mut next) = (0u32, STAGES - 1);
        for s in 0..stages {
            // This thread's copies of stage s have landed; the barrier makes everyone's visible
            // and guarantees that slot `next` (read in stage s - 1) is free.
            prim::cp_async_wait::<{ STAGES - 2 }>();
            prim::sync_threads();
            let ls = s + STAGES - 1;
            if ls < stages {
                let slot = smem + next * STAGE_BYTES;
                unsafe {
                    la.copy(k - ls * BK, slot);
                    lb.copy(k - ls * BK, slot + OPERAND_BYTES);
                }
            }
            prim::cp_async_commit();

            let base = smem + cur * STAGE_BYTES;
            unroll!(KS: u32; 0 1 => {
                let mut bf = [[0u32; 2]; 4];
                unroll!(NP: u32; 0 1 => {
                    // SAFETY: inside slot `cur`, complete for every thread since the barrier.
                    let v = unsafe { ldsm::<TB>(base + b_lane + NP * r16(TB) + KS * k16(TB)) };
                    bf[2 * NP as usize] = [v[0], v[1]];
                    bf[2 * NP as usize + 1] = [v[2], v[3]];
                });
                unroll!(MI: u32; 0 1 2 3 => {
                    // SAFETY: as above.
                    let af = unsafe { ldsm::<KA>(base + a_lane + MI * r16(KA) + KS * k16(KA)) };
                    unroll!(NI: usize; 0 1 2 3 => {
                        acc[MI as usize][NI] = I::mma(af, bf[NI], acc[MI as usize][NI]);
                    });
                });
            });
            cur = if cur + 1 == STAGES { 0 } else { cur + 1 };
            next = if next + 1 == STAGES { 0 } else { next + 1 };
        }
        // No copy is left in flight (the last groups were empty), so shared memory may be left.

        // Accumulator e of tile (mi, ni) is row g + 8 (e / 2), column 2 t + e % 2. Unrolled, so
        // that every accumulator index is a constant and `acc` stays in registers.
        unroll!(MI: u32; 0 1 2 3 => {
            unroll!(H: u32; 0 1 => {
                let row = m0 + wm * 64 + MI * 16 + g + 8 * H;
                unroll!(NI: u32; 0 1 2 3 => {
                    let col = n0 + wn * 32 + NI * 8 + 2 * t;
                    let v = acc[MI as usize][NI as usize];
                    // SAFETY: the host's epilogue describes D for this launch; `store_pair`
                    // checks the row and columns; `col` is even.
                    unsafe { store_pair::<O>(&e, z, row, col, [v[2 * H as usize], v[2 * H as usize + 1]]) };
                });
            });
        });
    }

    /// The split-K reduction: one thread per 2 consecutive elements of a row of D.
    #[inline(always)]
    pub unsafe fn splitk_reduce<O: OutType>(ws: *const f32, splits: u32, e: Epilogue) {
        let (m, n) = (e.m, e.n);
        // At least 1, so that the division below has no panic path (the host never launches
        // with n = 0).
        let groups = n.div_ceil(2).max(1) as u64;
        let gt = prim::global_thread_x();
        if gt >= m as u64 * groups {
            return;
        }
        let (row, col) = ((gt / groups) as u32, (2 * (gt % groups)) as u32);
        let slice = m as usize * n as usize;
        let mut acc = [0.0f32; 2];
        unroll!(J: u32; 0 1 => {
            if col + J < n {
                let mut p = row as usize * n as usize + (col + J) as usize;
                for _ in 0..splits {
                    // SAFETY: inside slice s of the workspace (`splits * m * n` floats).
                    acc[J as usize] += unsafe { *ws.add(p) };
                    p += slice;
                }
            }
        });
        // SAFETY: the host's epilogue describes D (m x n); `col` is even.
        unsafe { store_pair::<O>(&e, 0, row, col, acc) };
    }
}

// The instances: per input type, per output type, the layouts `nn`, `nt`, `tn`, `tt`.
macro_rules! tc_kernels {
    ($($in:ty, $out:ty => [$nn:ident, $nt:ident, $tn:ident, $tt:ident];)*) => {
        $(
            tc_kernels!(@one $nn: $in, $out, false, false);
            tc_kernels!(@one $nt: $in, $out, false, true);
            tc_kernels!(@one $tn: $in, $out, true, false);
            tc_kernels!(@one $tt: $in, $out, true, true);
        )*
        /// The kernels by input (bf16, f16), output (bf16, f16, f32) and layout.
        #[cfg(not(target_arch = "nvptx64"))]
        const TC: [[[crate::kernel::Kernel<GemmTcArgs>; 4]; 3]; 2] = {
            let all = [$([$nn, $nt, $tn, $tt]),*];
            [[all[0], all[1], all[2]], [all[3], all[4], all[5]]]
        };
    };
    (@one $name:ident: $in:ty, $out:ty, $ta:literal, $tb:literal) => {
        crate::kernel!($name: GemmTcArgs = |a, b, lda, ldb, sa, sb, k, e|
            device::gemm::<$in, $out, $ta, { !$ta }, $tb>(a, b, lda, ldb, sa, sb, k, e));
    };
}

tc_kernels! {
    crate::dtype::BF16, crate::dtype::BF16 => [gemm_tc_nn_bf16_bf16, gemm_tc_nt_bf16_bf16, gemm_tc_tn_bf16_bf16, gemm_tc_tt_bf16_bf16];
    crate::dtype::BF16, crate::dtype::F16 => [gemm_tc_nn_bf16_f16, gemm_tc_nt_bf16_f16, gemm_tc_tn_bf16_f16, gemm_tc_tt_bf16_f16];
    crate::dtype::BF16, f32 => [gemm_tc_nn_bf16_f32, gemm_tc_nt_bf16_f32, gemm_tc_tn_bf16_f32, gemm_tc_tt_bf16_f32];
    crate::dtype::F16, crate::dtype::BF16 => [gemm_tc_nn_f16_bf16, gemm_tc_nt_f16_bf16, gemm_tc_tn_f16_bf16, gemm_tc_tt_f16_bf16];
    crate::dtype::F16, crate::dtype::F16 => [gemm_tc_nn_f16_f16, gemm_tc_nt_f16_f16, gemm_tc_tn_f16_f16, gemm_tc_tt_f16_f16];
    crate::dtype::F16, f32 => [gemm_tc_nn_f16_f32, gemm_tc_nt_f16_f32, gemm_tc_tn_f16_f32, gemm_tc_tt_f16_f32];
}

crate::kernel!(gemm_tc_splitk_reduce_bf16: SplitKReduceTcArgs = |ws, splits, e|
    device::splitk_reduce::<crate::dtype::BF16>(ws, splits, e));
crate::kernel!(gemm_tc_splitk_reduce_f16: SplitKReduceTcArgs = |ws, splits, e|
    device::splitk_reduce::<crate::dtype::F16>(ws, splits, e));
crate::kernel!(gemm_tc_splitk_reduce_f32: SplitKReduceTcArgs = |ws, splits, e|
    device::splitk_reduce::<f32>(ws, splits, e));
