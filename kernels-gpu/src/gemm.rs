//! SGEMM: `C = epilogue(alpha * op(A) @ op(B) + beta * C)` in f32, row-major, on the CUDA cores
//! (FFMA; no tensor cores, no TF32), with the bias and activation of a linear layer fused into
//! the store. The same product on the tensor cores, with f32 accuracy: `gemm_tf32x3.rs`.
//!
//! # The bound
//! An H100 issues one warp-wide FFMA per clock on each of an SM's four schedulers: 128 lanes x 2
//! flops x 132 SMs x ~1.98 GHz = 67 TFLOP/s. Any other instruction takes an FFMA's issue slot,
//! so the kernel is shaped to make nearly every instruction an FFMA.
//!
//! # The design (versions g1-g3 and their measurements: docs/worklog.md, 2026-11-23-gemm)
//! - A block computes a `BM x BN` tile of C (128 x 128 with 256 threads), each
//!   thread an 8 x 8 block in 64 accumulators. Per step `k`, a thread reads 8 values of A's column
//!   and 8 of B's row from shared memory (four 16-byte `LDS.128`) and does 64 FFMA; with the
//!   stage's global loads, shared stores, barrier and loop, 90% of the stage loop's instructions
//!   are FFMA (566 for 512, read in the SASS).
//! - The thread's 8 rows are two groups of 4, `BM / 2` apart (likewise its columns): a warp then
//!   reads A's column as 2 distinct 16-byte words (a broadcast) and B's row as 16 consecutive
//!   ones (256 bytes, two shared-memory wavefronts), so the shared loads are conflict-free.
//! - `op(A)` is kept in shared memory as `As[k][m]` and `op(B)` as `Bs[k][n]`, `BK = 8` steps
//!   per stage. An operand whose rows run along K (A as stored, or B transposed) is read with
//!   16-byte global loads along K and written to shared memory transposed, four 4-byte stores;
//!   rows of `BM + 4` floats put the two K-halves of a warp's stores in different banks. An
//!   operand whose rows run along M or N is copied with 16-byte loads and stores as it is.
//! - Two stages in shared memory, the next one's global loads staged in registers: the loads of
//!   stage `s + 1` are issued before the 512 FFMA of stage `s` and land during them; one barrier
//!   per stage.
//! - Edges: a thread's 16-byte chunk is loaded whole when it lies inside the matrix and the
//!   operand is 16-byte aligned; otherwise element by element, zero outside (a zero that only
//!   ever meets other zeros or columns that are never stored). So any M, N, K and any leading
//!   dimension work. Tiles wholly inside both operands (and aligned) run a copy of the loop whose
//!   loads are straight-line, without the per-chunk tests (`main_loop::<FAST = true>`).
//! - The 64 FFMA of a step are written column by column: ptxas then allocates registers with few
//!   bank conflicts between an FFMA's sources (see the comment at the loop).
//!
//! # The epilogue
//! `v = alpha * acc + beta * C + bias[col]`, then the activation ([`EPI_RELU`] ...), then one
//! store. `beta == 0` never reads C (BLAS semantics: NaN in an output buffer does not leak into
//! the result), and `alpha == 0` does not multiply by the product (so `0 * inf` is not NaN).
//!
//! # Split-K
//! Where the tiles of C are too few to fill the GPU and K is long (128 x 8192 by 8192 x 8192 has
//! 64 tiles for 132 SMs), the host runs the same kernel on K-slices as a batch (the batch
//! strides step through K) with the plain epilogue into a workspace, and
//! the `gemm_splitk_reduce` kernel adds the slices in a fixed order and applies the epilogue:
//! deterministic, unlike atomics.

use crate::ops::{GELU_BETA, GELU_KAPPA, Relu, UnaryFn};

/// `(a, b, c, bias, m, n, k, lda, ldb, ldc, alpha, beta, stride_a, stride_b, stride_c,
/// epilogue)`: for batch `z = blockIdx.z`, `C_z = epi(alpha * op(A_z) @ op(B_z) + beta * C_z +
/// bias)` where `A_z = a + z * stride_a` (strides in elements) and so on. `op(A)` is `m x k`,
/// `op(B)` is `k x n`, C is `m x n` with row stride `ldc`; A is stored `m x k` (row stride `lda`)
/// or, for the `t` kernels, `k x m`; B is stored `k x n` or, transposed, `n x k`. `bias` is null
/// or `n` floats. `epilogue` is one of the `EPI_*` codes. `m` tiles beyond `gridDim.y * BM` and
/// batches beyond `gridDim.z` are not computed: the host splits larger problems into launches.
pub type GemmArgs =
    (*const f32, *const f32, *mut f32, *const f32, u32, u32, u32, u64, u64, u64, f32, f32, u64, u64, u64, u32);

/// `(ws, c, bias, m, n, ldc, splits, alpha, beta, epilogue)`: `c[i][j] = epi(alpha * sum_s
/// ws[s][i][j] + beta * c[i][j] + bias[j])`, the slices `ws[s]` contiguous `m x n`, summed in
/// order `s = 0, 1, ...`. One thread per 4 columns of a row.
pub type SplitKReduceArgs = (*const f32, *mut f32, *const f32, u32, u32, u64, u32, f32, f32, u32);

/// Epilogue codes.
pub const EPI_IDENTITY: u32 = 0;
/// `max(x, 0)`.
pub const EPI_RELU: u32 = 1;
/// GELU with the exact normal CDF (PyTorch's default `gelu`).
pub const EPI_GELU: u32 = 2;
/// PyTorch's `gelu(x, approximate="tanh")`.
pub const EPI_GELU_TANH: u32 = 3;
/// `x * sigmoid(x)`.
pub const EPI_SILU: u32 = 4;

/// K steps per shared-memory stage.
pub const BK: u32 = 8;
/// Padding of each shared-memory row, in floats (see the module notes).
pub const PAD: u32 = 4;

/// A tile configuration: `bm x bn` of C per block, 8 x 8 per thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    /// Rows of C a block.
    pub bm: u32,
    /// Columns of C a block.
    pub bn: u32,
}

impl Tile {
    /// Threads a block: one per 8 x 8 of the tile.
    pub const fn threads(self) -> u32 {
        self.bm * self.bn / 64
    }
    /// Dynamic shared memory: two stages of `As` and `Bs`.
    pub const fn smem_bytes(self) -> u32 {
        2 * BK * (self.bm + PAD + self.bn + PAD) * 4
    }
}

/// 128 x 128 tiles, 256 threads: the most reuse per loaded byte. Where C has too few of them to
/// fill the GPU, the host splits K instead. (A 64 x 64 tile with 64 threads, two staged chunks
/// per operand, spilled 264 bytes under ptxas for the `nn` and `tt` layouts; docs/worklog.md.)
pub const TILE_128: Tile = Tile { bm: 128, bn: 128 };
/// The four kernels of one family and tile, one per layout: `nn`, `nt`, `tn`, `tt` (`t`: the
/// operand, A then B, read as its transpose).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layouts(pub [crate::kernel::Kernel<GemmArgs>; 4]);

impl Layouts {
    /// The kernel for the transposes of A and B.
    pub const fn of(&self, trans_a: bool, trans_b: bool) -> crate::kernel::Kernel<GemmArgs> {
        self.0[2 * trans_a as usize + trans_b as usize]
    }
}

/// A tile built and its kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileKernels {
    /// The tile.
    pub tile: Tile,
    /// Its kernels by layout.
    pub layouts: Layouts,
}

/// The GEMM kernel for the transposes of A and B and a tile of [`GEMM_TILES`] (the only one
/// built is [`TILE_128`]; the parameter keeps the callers ready for others).
#[cfg(not(target_arch = "nvptx64"))]
pub fn gemm_kernel(trans_a: bool, trans_b: bool, tile: Tile) -> crate::kernel::Kernel<GemmArgs> {
    let built = GEMM_TILES.iter().find(|t| t.tile == tile);
    debug_assert!(built.is_some(), "only the tiles of GEMM_TILES are built");
    built.unwrap_or(&GEMM_TILES[0]).layouts.of(trans_a, trans_b)
}

/// Every kernel of the family (the tiles' layouts and `gemm_splitk_reduce`): its name and arity
/// (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
    GEMM_TILES.iter().flat_map(|t| t.layouts.0.map(|k| k.entry())).chain(core::iter::once(gemm_splitk_reduce.entry()))
}

/// Threads per block of the split-K reduction.
pub const SPLITK_THREADS: u32 = 256;

/// The epilogue's activation of `v`: the element-wise ops' formulas (`ops::{Relu, GeluErf,
/// GeluTanh, Silu}::fwd`), giving the same bits, but written here with the code those had
/// before 2026-11-24 (commit 2807a20): the exp's 2^f without `.ftz` and the logistic's
/// reciprocal as an IEEE division. Why: the FMA kernels' epilogue picks the activation per
/// element, and its path runs through all four activations' code (a 300 KB kernel whose code the
/// 256 MB of C evicts from L2 at 8192 x 8192 x 128). With the shorter forms of the element-wise
/// kernels, `sgemm_nn` at 8192 x 8192 x 128 and at 1024^3 ran slower (the 3xTF32 kernels gained
/// a little); hoisting the choice out of the element made ptxas spill in the main loop. So the
/// epilogue's code is pinned: these kernels' PTX is what it was when they were last measured
/// (`docs/results/2026-11-24b-gemm.json`; docs/worklog.md, 2026-11-24c).
#[inline(always)]
pub fn activate(epi: u32, v: f32) -> f32 {
    use crate::fastmath::{erf_with, exp_with};
    match epi {
        EPI_RELU => Relu::fwd(v, 0.0, 0.0),
        EPI_GELU => 0.5 * v * (1.0 + erf_with::<false>(v * core::f32::consts::FRAC_1_SQRT_2)),
        EPI_GELU_TANH => {
            let inner = GELU_BETA * (v + GELU_KAPPA * v * v * v);
            let y = v / (1.0 + exp_with::<false>(-2.0 * inner));
            if v == f32::NEG_INFINITY { f32::NAN } else { y }
        }
        EPI_SILU => v * (1.0 / (1.0 + exp_with::<false>(-v))),
        _ => v,
    }
}

/// The whole epilogue of one element, as the kernels compute it (the CPU tests use it too):
/// `c_old` is read only when `beta != 0`.
#[inline(always)]
pub fn epilogue(acc: f32, alpha: f32, beta: f32, c_old: impl FnOnce() -> f32, bias: f32, epi: u32) -> f32 {
    let mut v = if alpha == 0.0 { 0.0 } else { alpha * acc };
    if beta != 0.0 {
        v = crate::math::fma(beta, c_old(), v);
    }
    activate(epi, v + bias)
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::prim;

    /// One operand's share of a stage for one thread: `CH` 16-byte chunks of the `R x BK` tile
    /// of `op(X)` (`R` = BM or BN), loaded from global memory into registers, then stored to
    /// shared memory as `Xs[k][r]`.
    ///
    /// `KC`: the operand's rows run along K (`x[r * ld + k]`); chunk `c` is row `c / 2`, K offset
    /// `4 * (c % 2)`, and is stored transposed. Otherwise `x[k * ld + r]`: chunk `c` is K row
    /// `c / (R / 4)`, columns `4 * (c % (R / 4))`, stored as it is.
    struct Operand<const R: u32, const CH: usize, const KC: bool> {
        /// Global address of each chunk in the current stage (the stage advances it).
        ptr: [*const f32; CH],
        /// Whether each chunk's four elements lie inside the matrix along R (the K side is
        /// checked per stage) and may be read as one 16-byte load.
        whole: [bool; CH],
        /// How many of each chunk's elements lie inside along R (elementwise path).
        r_in: [u32; CH],
        /// Each chunk's K offset in the stage.
        kk: [u32; CH],
        /// Shared-window address of each chunk's slot in stage 0.
        smem: [u32; CH],
        /// Advance of `ptr` per stage, in floats.
        step: u64,
        regs: [[f32; 4]; CH],
    }

    impl<const R: u32, const CH: usize, const KC: bool> Operand<R, CH, KC> {
        /// `x` points at the tile's first row (along R), `r_left` rows of the matrix remain from
        /// there; `smem_base` is the shared-window address of `Xs` in stage 0.
        #[inline(always)]
        unsafe fn new(
            x: *const f32,
            ld: u64,
            r_left: u32,
            aligned: bool,
            tid: u32,
            threads: u32,
            smem_base: u32,
        ) -> Self {
            let mut o = Operand {
                ptr: [core::ptr::null(); CH],
                whole: [false; CH],
                r_in: [0; CH],
                kk: [0; CH],
                smem: [0; CH],
                step: if KC { BK as u64 } else { BK as u64 * ld },
                regs: [[0.0; 4]; CH],
            };
            let row = R + PAD;
            for i in 0..CH {
                let c = tid + i as u32 * threads;
                let (r, kk) = if KC { (c / (BK / 4), 4 * (c % (BK / 4))) } else { (4 * (c % (R / 4)), c / (R / 4)) };
                let off = if KC { r as u64 * ld + kk as u64 } else { kk as u64 * ld + r as u64 };
                // SAFETY: address arithmetic only; loads check the bounds below.
                o.ptr[i] = unsafe { x.add(off as usize) };
                o.kk[i] = kk;
                o.smem[i] = smem_base + 4 * (kk * row + r);
                if KC {
                    let inside = r < r_left;
                    o.r_in[i] = inside as u32;
                    o.whole[i] = inside && aligned;
                } else {
                    o.r_in[i] = r_left.saturating_sub(r).min(4);
                    o.whole[i] = o.r_in[i] == 4 && aligned;
                }
            }
            o
        }

        /// Loads the stage whose first K index is `k0`; `k_left` = K - k0 (> 0).
        #[inline(always)]
        unsafe fn load(&mut self, k_left: u32) {
            let k_whole = k_left >= BK;
            for i in 0..CH {
                let p = self.ptr[i];
                if k_whole && self.whole[i] {
                    // SAFETY: the chunk lies inside the matrix (`whole`, `k_whole`), 16-byte
                    // aligned (`aligned`: base, leading dimension and batch stride are multiples
                    // of 4 floats), and the kernel writes only C, which the host keeps apart.
                    let v = unsafe { prim::ld_global_nc_v4(p as *const u32) };
                    self.regs[i] =
                        [f32::from_bits(v[0]), f32::from_bits(v[1]), f32::from_bits(v[2]), f32::from_bits(v[3])];
                } else {
                    for j in 0..4u32 {
                        let (inside, off) = if KC {
                            (self.r_in[i] > 0 && self.kk[i] + j < k_left, j as u64)
                        } else {
                            (j < self.r_in[i] && self.kk[i] < k_left, j as u64)
                        };
                        // SAFETY: read only inside the matrix.
                        self.regs[i][j as usize] = if inside { unsafe { *p.add(off as usize) } } else { 0.0 };
                    }
                }
                // SAFETY: address arithmetic; the next load checks the bounds again.
                self.ptr[i] = unsafe { p.add(self.step as usize) };
            }
        }

        /// Loads a stage that lies wholly inside K, every chunk `whole` (the caller knows).
        #[inline(always)]
        unsafe fn load_vec(&mut self) {
            for i in 0..CH {
                let p = self.ptr[i];
                // SAFETY: per the caller, as in `load`'s vector branch.
                let v = unsafe { prim::ld_global_nc_v4(p as *const u32) };
                self.regs[i] = [f32::from_bits(v[0]), f32::from_bits(v[1]), f32::from_bits(v[2]), f32::from_bits(v[3])];
                // SAFETY: address arithmetic.
                self.ptr[i] = unsafe { p.add(self.step as usize) };
            }
        }

        /// Stores the staged chunks into stage `stage_off` (a byte offset: 0 or one stage).
        #[inline(always)]
        unsafe fn store(&self, stage_off: u32) {
            for i in 0..CH {
                let a = self.smem[i] + stage_off;
                if KC {
                    for j in 0..4u32 {
                        // SAFETY: `a` is this chunk's slot, inside the launch's shared memory.
                        unsafe { prim::st_shared_f32(a + 4 * j * (R + PAD), self.regs[i][j as usize]) };
                    }
                } else {
                    // SAFETY: as above; rows of `R + PAD` floats keep 16-byte slots aligned.
                    unsafe { prim::st_shared_v4_f32(a, self.regs[i]) };
                }
            }
        }
    }

    /// The GEMM of one `BM x BN` tile of C. `CHA`/`CHB`: 16-byte chunks per thread of a stage of
    /// A and B (`BM * BK / 4 / threads`). `TA`, `TB`: the transposes; `KA = !TA` (A's rows run
    /// along K unless it is transposed; stable Rust cannot negate a const parameter).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm<
        const BM: u32,
        const BN: u32,
        const CHA: usize,
        const CHB: usize,
        const TA: bool,
        const KA: bool,
        const TB: bool,
    >(
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        bias: *const f32,
        m: u32,
        n: u32,
        k: u32,
        lda: u64,
        ldb: u64,
        ldc: u64,
        alpha: f32,
        beta: f32,
        stride_a: u64,
        stride_b: u64,
        stride_c: u64,
        epi: u32,
    ) {
        let threads = BM * BN / 64;
        let tid = prim::thread_idx_x();
        let tx = tid % (BN / 8);
        let ty = tid / (BN / 8);
        let z = prim::block_idx_z() as u64;
        let m0 = prim::block_idx_y() * BM;
        let n0 = prim::block_idx_x() * BN;
        // SAFETY (all pointer arithmetic below): the host sized the grid to the matrices; rows
        // and columns outside them are never dereferenced.
        let (a, b, c) =
            unsafe { (a.add((z * stride_a) as usize), b.add((z * stride_b) as usize), c.add((z * stride_c) as usize)) };

        let as_bytes = BK * (BM + PAD) * 4;
        let stage_bytes = as_bytes + BK * (BN + PAD) * 4;
        let smem = prim::dyn_smem_addr();
        // 16-byte loads need every row (and every batch) of the operand to start 16-byte aligned.
        let al = |p: *const f32, ld: u64, s: u64| (p as u64 | (ld * 4) | (s * 4)) & 15 == 0;
        let (a_al, b_al) = (al(a, lda, stride_a), al(b, ldb, stride_b));
        // op(A): KC unless transposed; op(B): KC when transposed.
        let a_tile = unsafe { if TA { a.add(m0 as usize) } else { a.add(m0 as usize * lda as usize) } };
        let b_tile = unsafe { if TB { b.add(n0 as usize * ldb as usize) } else { b.add(n0 as usize) } };
        let mut la = unsafe { Operand::<BM, CHA, KA>::new(a_tile, lda, m - m0, a_al, tid, threads, smem) };
        let mut lb =
            unsafe { Operand::<BN, CHB, TB>::new(b_tile, ldb, n - n0.min(n), b_al, tid, threads, smem + as_bytes) };

        // Fragment addresses in stage 0: the thread's two groups of 4 rows (columns), half a
        // tile apart.
        let frags = (smem + 4 * ty * 4, smem + as_bytes + 4 * tx * 4);
        // A block whose tile lies inside both operands, read with 16-byte loads, runs the loop
        // without the per-chunk bounds tests (most blocks of a large product).
        let interior = a_al && b_al && m0 + BM <= m && n0 + BN <= n;
        let acc = unsafe {
            if interior {
                main_loop::<BM, BN, CHA, CHB, KA, TB, true>(&mut la, &mut lb, k, frags, stage_bytes)
            } else {
                main_loop::<BM, BN, CHA, CHB, KA, TB, false>(&mut la, &mut lb, k, frags, stage_bytes)
            }
        };

        // The epilogue: rows m0 + 4 ty + {0..3} and + BM/2; columns likewise with tx, BN/2.
        // Unrolled, so that every accumulator index is a constant and `acc` stays in registers.
        let c_al = (c as u64 | (ldc * 4) | (stride_c * 4)) & 15 == 0 && (bias as u64) & 15 == 0;
        let (col0, col1) = (n0 + 4 * tx, n0 + 4 * tx + BN / 2);
        unroll!(I: u32; 0 1 2 3 4 5 6 7 => {
            let row = m0 + 4 * ty + (I % 4) + (I / 4) * (BM / 2);
            if row < m {
                let r = &acc[I as usize];
                let ep = Epilogue { c, ldc, bias, n, alpha, beta, epi, aligned: c_al };
                // SAFETY: row < m; `store4` checks the columns.
                unsafe {
                    ep.store4(row, col0, [r[0], r[1], r[2], r[3]]);
                    ep.store4(row, col1, [r[4], r[5], r[6], r[7]]);
                }
            }
        });
    }

    /// The K loop of one tile: two shared-memory stages, the next stage's global loads issued
    /// before this stage's 512 FFMA and stored after them, one barrier per stage. `FAST`: every
    /// chunk lies inside its operand and is 16-byte aligned (only the last, partial stage of K
    /// is then loaded element by element).
    #[inline(always)]
    unsafe fn main_loop<
        const BM: u32,
        const BN: u32,
        const CHA: usize,
        const CHB: usize,
        const KA: bool,
        const KB: bool,
        const FAST: bool,
    >(
        la: &mut Operand<BM, CHA, KA>,
        lb: &mut Operand<BN, CHB, KB>,
        k: u32,
        (a_frag, b_frag): (u32, u32),
        stage_bytes: u32,
    ) -> [[f32; 8]; 8] {
        let mut acc = [[0.0f32; 8]; 8];
        let stages = k.div_ceil(BK);
        let full = k / BK;
        if stages > 0 {
            unsafe {
                la.load(k);
                lb.load(k);
                la.store(0);
                lb.store(0);
            }
        }
        prim::sync_threads();
        let mut cur = 0u32;
        let mut s = 0u32;
        // One stage: the next one's loads (`$load`), this one's FFMA, the next one's stores.
        macro_rules! stage {
            ($more:expr, $load:block) => {{
                let more = $more;
                if more $load
                let (pa, pb) = (a_frag + cur, b_frag + cur);
                unroll!(KS: u32; 0 1 2 3 4 5 6 7 => {
                    // SAFETY: inside stage `cur` of the shared memory the host sized.
                    let (a0, a1, b0, b1) = unsafe {
                        (
                            prim::ld_shared_v4_f32(pa + 4 * KS * (BM + PAD)),
                            prim::ld_shared_v4_f32(pa + 4 * (KS * (BM + PAD) + BM / 2)),
                            prim::ld_shared_v4_f32(pb + 4 * KS * (BN + PAD)),
                            prim::ld_shared_v4_f32(pb + 4 * (KS * (BN + PAD) + BN / 2)),
                        )
                    };
                    let af = [a0[0], a0[1], a0[2], a0[3], a1[0], a1[1], a1[2], a1[3]];
                    let bf = [b0[0], b0[1], b0[2], b0[3], b1[0], b1[1], b1[2], b1[3]];
                    // Column by column: with this order ptxas allocates the accumulators so
                    // that an FFMA's three sources rarely share a register bank (46-74
                    // conflicts in the 512 FFMA of a stage, against 177-197 for row by row in
                    // the `nt` and `tn` kernels, whose ncu "dispatch stall" was twice nn's).
                    for j in 0..8 {
                        for i in 0..8 {
                            acc[i][j] = crate::math::fma(af[i], bf[j], acc[i][j]);
                        }
                    }
                });
                if more {
                    let next = cur ^ stage_bytes;
                    unsafe {
                        la.store(next);
                        lb.store(next);
                    }
                    cur = next;
                }
                // Stage `cur` (written above) is complete for everyone, and nobody still reads
                // the other one when the next iteration overwrites it.
                prim::sync_threads();
                s += 1;
            }};
        }
        if FAST {
            // While the next stage lies wholly inside K: straight-line loads, no tests.
            while s + 1 < full {
                stage!(true, {
                    unsafe {
                        la.load_vec();
                        lb.load_vec();
                    }
                });
            }
        }
        while s < stages {
            stage!(s + 1 < stages, {
                let k_left = k - (s + 1) * BK;
                unsafe {
                    la.load(k_left);
                    lb.load(k_left);
                }
            });
        }
        acc
    }

    /// Where and how a tile's results are written.
    struct Epilogue {
        c: *mut f32,
        ldc: u64,
        bias: *const f32,
        n: u32,
        alpha: f32,
        beta: f32,
        epi: u32,
        /// C (rows, batches) and bias 16-byte aligned.
        aligned: bool,
    }

    impl Epilogue {
        /// Writes `vals` to columns `col..col + 4` of row `row` (< m), those that are < n.
        #[inline(always)]
        unsafe fn store4(&self, row: u32, col: u32, vals: [f32; 4]) {
            let Epilogue { c, ldc, bias, n, alpha, beta, epi, aligned } = *self;
            // SAFETY: row < m (the caller), so the row start is inside C.
            let crow = unsafe { c.add(row as usize * ldc as usize) };
            if aligned && col + 4 <= n {
                // SAFETY: the 4 columns are inside C (and bias), 16-byte aligned.
                unsafe {
                    let p = crow.add(col as usize);
                    let old = if beta != 0.0 { prim::ld_global_v4(p as *const u32) } else { [0; 4] };
                    let bv = if bias.is_null() {
                        [0; 4]
                    } else {
                        prim::ld_global_nc_v4(bias.add(col as usize) as *const u32)
                    };
                    let mut out = [0u32; 4];
                    unroll!(J: usize; 0 1 2 3 => {
                        out[J] = epilogue(vals[J], alpha, beta, || f32::from_bits(old[J]), f32::from_bits(bv[J]), epi).to_bits();
                    });
                    prim::st_global_v4(p as *mut u32, out);
                }
            } else {
                unroll!(J: usize; 0 1 2 3 => {
                    let cj = col + J as u32;
                    if cj < n {
                        // SAFETY: inside C and bias.
                        unsafe {
                            let p = crow.add(cj as usize);
                            let bv = if bias.is_null() { 0.0 } else { *bias.add(cj as usize) };
                            *p = epilogue(vals[J], alpha, beta, || *p, bv, epi);
                        }
                    }
                });
            }
        }
    }

    /// The split-K reduction: one thread per 4 consecutive elements of a row of C.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn splitk_reduce(
        ws: *const f32,
        c: *mut f32,
        bias: *const f32,
        m: u32,
        n: u32,
        ldc: u64,
        splits: u32,
        alpha: f32,
        beta: f32,
        epi: u32,
    ) {
        let groups = n.div_ceil(4) as u64;
        let g = prim::global_thread_x();
        if g >= m as u64 * groups {
            return;
        }
        let (row, col) = ((g / groups) as u32, (4 * (g % groups)) as u32);
        let slice = m as u64 * n as u64;
        for j in 0..4u32 {
            let cj = col + j;
            if cj >= n {
                break;
            }
            let mut acc = 0.0f32;
            let mut p = row as u64 * n as u64 + cj as u64;
            for _ in 0..splits {
                // SAFETY: inside slice s of the workspace (`splits * m * n` floats).
                acc += unsafe { *ws.add(p as usize) };
                p += slice;
            }
            // SAFETY: inside C and bias.
            unsafe {
                let q = c.add(row as usize * ldc as usize + cj as usize);
                let bv = if bias.is_null() { 0.0 } else { *bias.add(cj as usize) };
                *q = epilogue(acc, alpha, beta, || *q, bv, epi);
            }
        }
    }
}

// The instances: per tile, its kernels in the order of `Layouts`. The names carry the tile: the
// PTX build reads the launch bounds from them (`gemm_launch_bounds`).
macro_rules! gemm_kernels {
    ($($tile:ident: $bm:literal x $bn:literal, $cha:literal, $chb:literal =>
        [$nn:ident, $nt:ident, $tn:ident, $tt:ident];)*) => {
        $(
            const _: () = assert!($tile.bm == $bm && $tile.bn == $bn);
            gemm_kernels!(@one $nn: $bm x $bn, $cha, $chb, false, false);
            gemm_kernels!(@one $nt: $bm x $bn, $cha, $chb, false, true);
            gemm_kernels!(@one $tn: $bm x $bn, $cha, $chb, true, false);
            gemm_kernels!(@one $tt: $bm x $bn, $cha, $chb, true, true);
        )*
        /// The tiles built, with their kernels.
        #[cfg(not(target_arch = "nvptx64"))]
        pub const GEMM_TILES: &[TileKernels] =
            &[$(TileKernels { tile: $tile, layouts: Layouts([$nn, $nt, $tn, $tt]) }),*];
    };
    (@one $name:ident: $bm:literal x $bn:literal, $cha:literal, $chb:literal, $ta:literal, $tb:literal) => {
        crate::kernel!($name: GemmArgs = |a, b, c, bias, m, n, k, lda, ldb, ldc, alpha, beta, sa, sb, sc, epi|
            device::gemm::<$bm, $bn, $cha, $chb, $ta, { !$ta }, $tb>(a, b, c, bias, m, n, k, lda, ldb, ldc, alpha, beta, sa, sb, sc, epi));
    };
}

gemm_kernels! {
    TILE_128: 128 x 128, 1, 1 => [gemm_nn_128x128, gemm_nt_128x128, gemm_tn_128x128, gemm_tt_128x128];
}

crate::kernel!(gemm_splitk_reduce: SplitKReduceArgs = |ws, c, bias, m, n, ldc, splits, alpha, beta, epi|
    device::splitk_reduce(ws, c, bias, m, n, ldc, splits, alpha, beta, epi));
