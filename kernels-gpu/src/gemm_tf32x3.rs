//! SGEMM on the tensor cores: the same product, operands and epilogue as [`crate::gemm`], in
//! two precisions, one kernel body generic over which (`SPLIT`):
//! - "3xTF32" (`gemm_tf32x3_*`, `SPLIT = true`), f32 accuracy, for callers who choose
//!   `Precision::Tf32x3` on the host;
//! - plain TF32 (`gemm_tf32_*`, `SPLIT = false`), PyTorch's `"high"`, for `Precision::Tf32`:
//!   each operand rounded once to TF32 ([`round_tf32`]) and one tensor-core product per pair of
//!   fragments, about 3x fewer tensor-core instructions for an error of about 2^-10 per product.
//!
//! # The arithmetic
//! A tensor core multiplies TF32 values (f32 with 10 mantissa bits instead of 23) exactly and
//! adds in f32. Each f32 operand is split as `x = hi + lo` ([`split_tf32`]), which holds `x` to
//! 2^-21 of its magnitude. Then `a * b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi`: three tensor-core
//! products (the dropped `a_lo b_lo` is below 2^-22 of `a b`). That is a few times the rounding
//! of one f32 FMA (2^-24), and below the error of f32 accumulation over a long K, which both
//! this and the FFMA kernel have; benches/gemm.rs measures both, and cuBLAS, against f64. Plain
//! TF32 keeps `hi` alone, rounded to nearest as cuBLAS and PyTorch round: `a_hi b_hi` is within
//! `2 * 2^-11 + 2^-22` of `a b`.
//!
//! The tensor core's own additions truncate (round toward zero) rather than round to nearest,
//! a bias that grows with K: summed on the tensor core throughout, the relative error of a
//! 4096-long product of uniform [0, 1) values was 2.3e-6, against 8.0e-8 for f32 FMAs
//! (docs/worklog.md, 2026-11-24b-gemm). So each stage's products (32 steps of K) are summed on the
//! tensor core from zero and then added to the f32 accumulators with ordinary rounded adds: 2.2e-7
//! there, and 2.7e-7 against the FMAs' 3.0e-7 on normal values. Plain TF32 keeps these adds too:
//! one FADD per tensor-core product of a stage, against the bias growing past the operands'
//! rounding error (which averages out as `1 / sqrt(K)`) at K of a few thousand.
//!
//! Infinities and NaN give what IEEE arithmetic gives; the limits at the ends of the range
//! (above 3.4024e38, below 2^-115) are in [`split_tf32`] and [`round_tf32`].
//!
//! # The design
//! - 128 x 128 tiles of C per block of 256 threads (8 warps, 2 x 4, each a 64 x 32 block of C:
//!   4 x 4 tensor-core tiles of 16 x 8, 64 accumulators a thread).
//! - Stages of `BK = 32` along K copied with `cp.async` (no staging registers) into a ring of
//!   `STAGES` slots, one barrier per stage. Each operand is kept in shared memory as it is
//!   stored: rows along K (`[r][k]`, rows of `BK + 8` floats) or along M/N (`[k][r]`, rows of
//!   `128 + 4` floats), so the copies write whole 128-byte rows.
//! - Within each 8 steps of K, the tensor core's K slot `t` (lane `t` of a quad) is given K index
//!   `2t` and slot `t + 4` index `2t + 1` (any order of K gives the same sum, as long as A and B
//!   agree). A lane's two values of a fragment row are then adjacent in an operand stored along
//!   K: one 8-byte load instead of two. With the paddings above, these loads (8 rows x 4 lanes
//!   x 8 bytes) and the single ones of the other layout (lane `(g, t)` reads row `2t` or `2t + 1`,
//!   column `g`) hit 32 distinct banks.
//! - Every warp splits the fragments it loads, although a fragment is read by 2 or 4 warps:
//!   splitting each element once into shared memory (hi and lo, then a second barrier a stage)
//!   measured slower, as the warps of the one block an SM then wait for each other twice a
//!   stage (docs/worklog.md, 2026-11-24b-gemm, t3).
//! - Edges: a 16-byte chunk is copied with a source size of 0-16 bytes, the rest zero-filled, so
//!   any M, N, K work; operands whose rows or batches are not 16-byte aligned are copied 4 bytes
//!   at a time.

use crate::gemm::GemmArgs;

/// Rows (M) of C per block.
pub const BM: u32 = 128;
/// Columns (N) of C per block.
pub const BN: u32 = 128;
/// K steps per stage.
pub const BK: u32 = 32;
/// Threads per block: 8 warps.
pub const THREADS: u32 = 256;
/// Slots in the shared-memory ring (stages in flight).
pub const STAGES: u32 = 3;
/// Floats per shared-memory row of an operand whose rows run along K (`BK + 8`: a warp's
/// 8-byte fragment loads, 8 rows x 4 lanes, then fall in 32 distinct banks).
pub const SK: u32 = BK + 8;
/// Floats per shared-memory row of an operand whose rows run along M or N (`128 + 4`: a warp's
/// loads of rows `2t` (or `2t + 1`) by 8 columns fall in 32 distinct banks).
pub const SR: u32 = BM + 4;
/// Bytes of one operand's slot: the larger of the two layouts.
pub const OPERAND_BYTES: u32 = 4 * if BM * SK > BK * SR { BM * SK } else { BK * SR };
/// Bytes of one ring slot (A, then B).
pub const STAGE_BYTES: u32 = 2 * OPERAND_BYTES;
/// Dynamic shared memory of a block.
pub const SMEM_BYTES: u32 = STAGES * STAGE_BYTES;

/// The 3xTF32 kernel for the transposes of A and B.
#[cfg(not(target_arch = "nvptx64"))]
pub const fn tf32x3_kernel(trans_a: bool, trans_b: bool) -> crate::kernel::Kernel<GemmArgs> {
    TF32X3.of(trans_a, trans_b)
}

/// The plain TF32 kernel for the transposes of A and B.
#[cfg(not(target_arch = "nvptx64"))]
pub const fn tf32_kernel(trans_a: bool, trans_b: bool) -> crate::kernel::Kernel<GemmArgs> {
    TF32.of(trans_a, trans_b)
}

/// Every kernel of this family (3xTF32, then plain TF32): its name and arity (for the test
/// against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
    TF32X3.0.into_iter().chain(TF32.0).map(|k| k.entry())
}

/// `x = hi + lo` as the tensor cores take them (TF32 in the bits of an f32). `hi` is `x` rounded
/// to TF32, to nearest with ties away from zero (`cvt.rna.tf32.f32`, written as integer
/// arithmetic: two instructions against the four ptxas makes of the `cvt`); `lo = x - hi` is
/// exact, and the tensor core truncates it to TF32 as it reads it (it ignores an operand's low 13
/// bits), so its error is below 2^-10 of `lo`, i.e. 2^-21 of `x`.
///
/// - `x = ±inf`: `hi = x`, `lo = 0` (not `inf - inf`, which would turn every product into NaN).
/// - `x = NaN`: `lo` is NaN, whatever the addition did to `hi`'s bits, so the products are NaN.
/// - A finite `x` above 3.4024e38 in magnitude (within half a TF32 step of `f32::MAX`) has `hi =
///   ±inf`.
/// - Below 2^-115 in magnitude (where `lo` is subnormal) `x` is held to 2^-136 absolute rather
///   than 2^-21 relative: TF32 has no bits below 2^-136 (an f32 subnormal's low 13 bits).
#[inline(always)]
pub fn split_tf32(x: f32) -> (u32, u32) {
    let hi = x.to_bits().wrapping_add(0x1000) & 0xffff_e000;
    let lo = if x.is_infinite() { 0.0 } else { x - f32::from_bits(hi) };
    (hi, lo.to_bits())
}

/// `x` rounded to TF32 for plain TF32: to nearest, ties away from zero, as `cvt.rna.tf32.f32`
/// (cuBLAS's and PyTorch's rounding), so within `2^-11 |x|` of `x` (2^-137 absolute below
/// 2^-126).
/// Written as integer arithmetic, like [`split_tf32`]'s `hi` but unmasked: adding half a TF32
/// step carries into the kept bits exactly when the dropped ones reach half a step, and the
/// tensor core ignores the low 13 bits as it reads the operand (as it does `lo`'s above).
///
/// - `x = ±inf` stays `±inf`; a finite `x` above 3.4024e38 in magnitude rounds to `±inf`, as
///   `cvt.rna` does.
/// - `x = NaN` gives a NaN (`0x7fff_ffff`): the carry would turn a NaN whose top 10 mantissa bits
///   are set (the GPU's own `0x7fff_ffff` among them) into ±0, and one with only the low 13 bits
///   set reads as ±inf.
#[inline(always)]
pub fn round_tf32(x: f32) -> u32 {
    if x.is_nan() { 0x7fff_ffff } else { x.to_bits().wrapping_add(0x1000) }
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::gemm::epilogue;
    use crate::prim;

    /// An element's TF32 parts as the tensor core takes them: [`split_tf32`] for 3xTF32, else
    /// [`round_tf32`] and no `lo` (unused, compiled away).
    #[inline(always)]
    fn tf32_parts<const SPLIT: bool>(bits: u32) -> (u32, u32) {
        let x = f32::from_bits(bits);
        if SPLIT { split_tf32(x) } else { (round_tf32(x), 0) }
    }

    /// Chunks (16 bytes) of one operand a thread copies per stage: 128 x 32 floats / 4 / 256
    /// (the loops over them are written out for 4: `unroll!`).
    const CH: usize = 4;

    /// One operand's copies for one thread. `KC`: the operand's rows run along K (`x[r * ld +
    /// k]`): chunk `c` is row `c / 8`, K offset `4 * (c % 8)`; otherwise `x[k * ld + r]`: chunk
    /// `c` is K row `c / 32`, columns `4 * (c % 32)`. Consecutive threads copy consecutive
    /// chunks, i.e. whole 128-byte rows, in global and in shared memory.
    struct Loader<const KC: bool> {
        /// Global address of each chunk in the next stage to copy.
        ptr: [*const f32; CH],
        /// A valid address to name when a chunk copies nothing (the tile's origin).
        origin: *const f32,
        /// KC: whether the chunk's row is inside the matrix (0 or 4); else how many of its 4
        /// columns are.
        r_in: [u32; CH],
        /// Each chunk's K offset in a stage.
        kk: [u32; CH],
        /// Each chunk's byte offset in the operand's slot.
        soff: [u32; CH],
        /// Advance of `ptr` per stage, in floats.
        step: usize,
        /// Rows (and batches) 16-byte aligned: chunks are copied whole.
        aligned: bool,
    }

    impl<const KC: bool> Loader<KC> {
        /// `x` is the tile's origin (first row along R, K = 0), `r_left` rows of the operand
        /// remain from there.
        #[inline(always)]
        unsafe fn new(x: *const f32, ld: u64, r_left: u32, aligned: bool, tid: u32) -> Self {
            let mut l = Loader {
                ptr: [x; CH],
                origin: x,
                r_in: [0; CH],
                kk: [0; CH],
                soff: [0; CH],
                step: if KC { BK as usize } else { (BK as u64 * ld) as usize },
                aligned,
            };
            unroll!(I: usize; 0 1 2 3 => {
                let i = I;
                let c = tid + i as u32 * THREADS;
                let (r, kk) = if KC { (c / (BK / 4), 4 * (c % (BK / 4))) } else { (4 * (c % (BM / 4)), c / (BM / 4)) };
                let off = if KC { r as u64 * ld + kk as u64 } else { kk as u64 * ld + r as u64 };
                // SAFETY: address arithmetic; copies check the bounds.
                l.ptr[i] = unsafe { x.add(off as usize) };
                l.kk[i] = kk;
                l.soff[i] = 4 * if KC { r * SK + kk } else { kk * SR + r };
                l.r_in[i] = if KC { if r < r_left { 4 } else { 0 } } else { r_left.saturating_sub(r).min(4) };
            });
            l
        }

        /// Starts the copies of the next stage into the slot at `slot`; `k_left` = K minus the
        /// stage's first K index (> 0).
        #[inline(always)]
        unsafe fn copy(&mut self, k_left: u32, slot: u32) {
            unroll!(I: usize; 0 1 2 3 => {
                let i = I;
                let n_in = if KC {
                    if self.r_in[i] > 0 { k_left.saturating_sub(self.kk[i]).min(4) } else { 0 }
                } else if self.kk[i] < k_left {
                    self.r_in[i]
                } else {
                    0
                };
                let src = if n_in > 0 { self.ptr[i] } else { self.origin };
                let dst = slot + self.soff[i];
                if self.aligned {
                    // SAFETY: `n_in` elements from `src` lie inside the operand, 16-byte aligned
                    // (`aligned`, and K offsets are multiples of 4); `dst` is the chunk's slot.
                    unsafe { prim::cp_async_16(dst, src, 4 * n_in) };
                } else {
                    for j in 0..4u32 {
                        let inside = j < n_in;
                        // SAFETY: as above, element by element.
                        unsafe {
                            prim::cp_async_4(
                                dst + 4 * j,
                                if inside { src.add(j as usize) } else { self.origin },
                                if inside { 4 } else { 0 },
                            )
                        };
                    }
                }
                // SAFETY: address arithmetic; the next copy checks the bounds again.
                self.ptr[i] = unsafe { self.ptr[i].add(self.step) };
            });
        }
    }

    /// The GEMM of one 128 x 128 tile of C, in 3xTF32 (`SPLIT`) or plain TF32. `KA = !TA` (A's
    /// rows run along K unless it is transposed); B's rows run along K when it is transposed.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm<const TA: bool, const KA: bool, const TB: bool, const SPLIT: bool>(
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
        let tid = prim::thread_idx_x();
        let (warp, lane) = (tid / 32, tid % 32);
        let (wm, wn) = (warp / 4, warp % 4);
        let (g, t) = (lane / 4, lane % 4);
        let z = prim::block_idx_z() as u64;
        let m0 = prim::block_idx_y() * BM;
        let n0 = prim::block_idx_x() * BN;
        // SAFETY (all pointer arithmetic below): the host sized the grid to the matrices; rows
        // and columns outside them are never dereferenced.
        let (a, b, c) =
            unsafe { (a.add((z * stride_a) as usize), b.add((z * stride_b) as usize), c.add((z * stride_c) as usize)) };
        let al = |p: *const f32, ld: u64, s: u64| (p as u64 | (ld * 4) | (s * 4)) & 15 == 0;
        let a_tile = unsafe { if TA { a.add(m0 as usize) } else { a.add(m0 as usize * lda as usize) } };
        let b_tile = unsafe { if TB { b.add(n0 as usize * ldb as usize) } else { b.add(n0 as usize) } };
        let mut la = unsafe { Loader::<KA>::new(a_tile, lda, m - m0, al(a, lda, stride_a), tid) };
        let mut lb = unsafe { Loader::<TB>::new(b_tile, ldb, n - n0, al(b, ldb, stride_b), tid) };

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

        // Byte offset in an operand's slot of element (r, k) (k the K index in the stage), and
        // of the thread's first fragment element: row g, K index 2t (slot t, see the notes).
        let elem = |kc: bool, r: u32, kq: u32| 4 * if kc { r * SK + kq } else { kq * SR + r };
        let a_frag = elem(KA, wm * 64 + g, 2 * t);
        let b_frag = OPERAND_BYTES + elem(TB, wn * 32 + g, 2 * t);
        // A fragment row's two values, slots t and t + 4 of K step `ks`: K indices 2t and 2t + 1.
        // SAFETY (callers): `p` is the thread's fragment address in slot `cur`, inside the ring.
        let pair = |kc: bool, p: u32, r: u32, ks: u32| -> [u32; 2] {
            unsafe {
                if kc {
                    prim::ld_shared_v2_b32(p + elem(true, r, 8 * ks))
                } else {
                    [
                        prim::ld_shared_b32(p + elem(false, r, 8 * ks)),
                        prim::ld_shared_b32(p + elem(false, r, 8 * ks + 1)),
                    ]
                }
            }
        };

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
            let (pa, pb) = (base + a_frag, base + b_frag);
            let mut part = [[[0.0f32; 4]; 4]; 4];
            unroll!(KS: u32; 0 1 2 3 => {
                let mut bh = [[0u32; 2]; 4];
                let mut bl = [[0u32; 2]; 4];
                unroll!(NI: u32; 0 1 2 3 => {
                    // b = [B(t, g), B(t + 4, g)] (prim.rs).
                    let v = pair(TB, pb, NI * 8, KS);
                    unroll!(Q: usize; 0 1 => {
                        let (h, l) = tf32_parts::<SPLIT>(v[Q]);
                        bh[NI as usize][Q] = h;
                        bl[NI as usize][Q] = l;
                    });
                });
                unroll!(MI: u32; 0 1 2 3 => {
                    // a = [A(g, t), A(g + 8, t), A(g, t + 4), A(g + 8, t + 4)] (prim.rs).
                    let (top, bottom) = (pair(KA, pa, MI * 16, KS), pair(KA, pa, MI * 16 + 8, KS));
                    let mut ah = [0u32; 4];
                    let mut al = [0u32; 4];
                    unroll!(J: usize; 0 1 2 3 => {
                        let v = if J % 2 == 0 { top[J / 2] } else { bottom[J / 2] };
                        let (h, l) = tf32_parts::<SPLIT>(v);
                        ah[J] = h;
                        al[J] = l;
                    });
                    unroll!(NI: usize; 0 1 2 3 => {
                        let d = &mut part[MI as usize][NI];
                        // The small terms first, while the sum is small.
                        if SPLIT {
                            *d = prim::mma_tf32_16x8x8(al, bh[NI], *d);
                            *d = prim::mma_tf32_16x8x8(ah, bl[NI], *d);
                        }
                        *d = prim::mma_tf32_16x8x8(ah, bh[NI], *d);
                    });
                });
            });
            // The stage's sums into the f32 accumulators, rounded to nearest (see the notes).
            for i in 0..4 {
                for j in 0..4 {
                    for e in 0..4 {
                        acc[i][j][e] += part[i][j][e];
                    }
                }
            }
            cur = if cur + 1 == STAGES { 0 } else { cur + 1 };
            next = if next + 1 == STAGES { 0 } else { next + 1 };
        }
        // No copy is left in flight (the last groups were empty), so shared memory may be left.

        // The epilogue: accumulator e of tile (mi, ni) is row g + 8 (e / 2), column 2 t + e % 2.
        // Unrolled, so that every accumulator index is a constant and `acc` stays in registers.
        unroll!(MI: u32; 0 1 2 3 => {
            unroll!(H: u32; 0 1 => {
                let row = m0 + wm * 64 + MI * 16 + g + 8 * H;
                if row < m {
                    // SAFETY: row < m, so the row start is inside C.
                    let crow = unsafe { c.add(row as usize * ldc as usize) };
                    unroll!(NI: u32; 0 1 2 3 => {
                        unroll!(E: u32; 0 1 => {
                            let cj = n0 + wn * 32 + NI * 8 + 2 * t + E;
                            if cj < n {
                                // SAFETY: inside C and bias.
                                unsafe {
                                    let p = crow.add(cj as usize);
                                    let bv = if bias.is_null() { 0.0 } else { *bias.add(cj as usize) };
                                    let v = acc[MI as usize][NI as usize][(2 * H + E) as usize];
                                    *p = epilogue(v, alpha, beta, || *p, bv, epi);
                                }
                            }
                        });
                    });
                }
            });
        });
    }
}

// The instances, in the order of `Layouts`: `$split` chooses 3xTF32 or plain TF32.
macro_rules! tf32_kernels {
    ($family:ident, $split:literal, [$nn:ident, $nt:ident, $tn:ident, $tt:ident]) => {
        tf32_kernels!(@one $nn: false, false, $split);
        tf32_kernels!(@one $nt: false, true, $split);
        tf32_kernels!(@one $tn: true, false, $split);
        tf32_kernels!(@one $tt: true, true, $split);
        /// The family's kernels by layout.
        #[cfg(not(target_arch = "nvptx64"))]
        pub const $family: crate::gemm::Layouts = crate::gemm::Layouts([$nn, $nt, $tn, $tt]);
    };
    (@one $name:ident: $ta:literal, $tb:literal, $split:literal) => {
        crate::kernel!($name: GemmArgs = |a, b, c, bias, m, n, k, lda, ldb, ldc, alpha, beta, sa, sb, sc, epi|
            device::gemm::<$ta, { !$ta }, $tb, $split>(a, b, c, bias, m, n, k, lda, ldb, ldc, alpha, beta, sa, sb, sc, epi));
    };
}

tf32_kernels!(TF32X3, true, [gemm_tf32x3_nn, gemm_tf32x3_nt, gemm_tf32x3_tn, gemm_tf32x3_tt]);
tf32_kernels!(TF32, false, [gemm_tf32_nn, gemm_tf32_nt, gemm_tf32_tn, gemm_tf32_tt]);
