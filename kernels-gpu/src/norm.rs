//! Layer norm and RMS norm over the last dimension, forward and backward.
//!
//! ```text
//! layer norm:  y = (x - mean) * rstd * w + b      rstd = 1 / sqrt(var + eps), var biased
//! rms norm:    y = x * rstd * w                   rstd = 1 / sqrt(mean(x^2) + eps)
//! backward, with xh = (x - mean) * rstd (layer) or x * rstd (rms) and gw = g * w:
//!   gx = rstd * (gw - mean(gw) - xh * mean(gw * xh))     (rms: without the mean(gw) term)
//!   dw = sum over rows of g * xh,  db = sum over rows of g
//! ```
//!
//! Memory pattern, as softmax (see `rows.rs`): the forward holds its row in registers where it
//! fits and streams it otherwise. The variance is the exact two-pass one: the row's sum gives the
//! mean, then the sum of squared deviations from that mean (over registers, or over the row
//! again, which then mostly comes from L2). Two sum reductions cost less than one reduction of
//! Welford/Chan `(count, mean, M2)` triples, whose merge divides. The forward saves `mean` and
//! `rstd` (f32, one per row) for the backward.
//!
//! The backward's row sums and `gx` are one row pass; `dw` and `db` are column sums over all
//! rows. The register-resident backward is *persistent*: a grid of about one wave of blocks,
//! each group walking rows with the grid's stride and keeping its columns' `dw`, `db` in shared
//! memory, so the column sums cost no extra pass over memory; each block writes one partial
//! row, and `norm_colsum` adds the partials in a fixed order. On sm_90 a launch of at most 64
//! rows is instead one cluster of eight or sixteen blocks, each a slice of the columns of every
//! row, which
//! add the rows' sums through distributed shared memory and write `dw`, `db` themselves: one
//! launch, one round trip to memory (`bwd_slices`). Rows too long for registers use a
//! streaming row kernel and a separate column kernel (`*_colgrad`) for `dw`, `db`: two more reads
//! of `x` and `g`, the price of rows over 8192 elements.
//!
//! The fused residual add (`add_layer_norm_*`, `add_rms_norm_*`): the same kernels with `ADD`
//! set. The forward reads `x` and `residual`, writes `h = x + residual` (an f32 sum rounded once
//! to the storage type, as PyTorch's eager `x + residual`) and normalises `h` from its registers:
//! one read of each input, one write of each output. The backward of `y = norm(h)` given also
//! the gradient `dh` flowing into `h` from later layers is the norm's backward over `h` with `dh`
//! added to the input's gradient as it is stored: `dx = dresidual = dh + norm_backward(dy)`, the
//! weight and bias gradients unchanged. Without `dh` the plain norm's backward kernels serve.

use crate::kernel::{Kernel, KernelEntry, Params};
use crate::rows::RowKernels;
#[cfg(not(target_arch = "nvptx64"))]
use crate::rows::RowVariant;

/// `(x, w, b, y, mean, rstd, rows, cols, eps, residual, h)`. `w`, `b` may be null (no affine
/// part); `mean` is null for RMS norm. `mean` and `rstd` are f32, one per row. `residual` and
/// `h` (`x`'s shape) are read and written by the fused add's kernels (`add_<op>_fwd_*`: `h = x +
/// residual`, normalised; `h` may be `residual`, in place) and ignored by the plain norms' (null).
pub type NormFwdArgs<T> = (*const T, *const T, *const T, *mut T, *mut f32, *mut f32, u64, u64, f32, *const T, *mut T);
/// `(x, w, g, mean, rstd, gx, partial, rows, cols, dh)`. `w` may be null; `mean` is null for RMS
/// norm; `partial` (f32, `[2][gridDim.x][cols]`: dw then db) is null when neither is wanted.
/// `dh` (`x`'s shape) is added to `gx` by the fused add's kernels (`add_<op>_bwd_*`, where `x` is
/// the forward's `h`) and ignored by the plain norms' (null).
pub type NormBwdArgs<T> = (*const T, *const T, *const T, *const f32, *const f32, *mut T, *mut f32, u64, u64, *const T);
/// `(x, w, g, mean, rstd, gx, dw, db, rows, cols, dh)`: the backward of a grid that is one
/// cluster of `K` blocks (`<op>_bwd_slices_k<K>_v<V>_<dtype>`, sm_90, `K` 8 or 16), which writes
/// `dw`, `db` itself (either may be null: not wanted); `dh` as in [`NormBwdArgs`].
pub type NormBwdOneArgs<T> =
    (*const T, *const T, *const T, *const f32, *const f32, *mut T, *mut T, *mut T, u64, u64, *const T);
/// Blocks of the single-cluster backward: its whole grid (portable cluster size; the wide
/// instances take 16, Hopper's non-portable maximum, which the host opts each into at load).
pub const ONE_CLUSTER: u32 = 8;
/// Threads a block of the slices backward (`<op>_bwd_slices_k<K>_v<V>_<dtype>`, sm_90) may have
/// at most: `.maxntid 512` (build_ptx.rs, for `_k<K>_` kernels), so 128 registers.
pub const SLICES_THREADS: u32 = 512;

/// Offsets in floats of the slices backward's shared memory, and its size, for `rows` rows and
/// blocks of `bx` x `by` threads, `vec` elements a vector: `[totals, columns, size]`. At 0 the
/// row sums of each warp across the slice, `[rows][ceil(bx / 32)][2]` (read by the whole cluster);
/// then the rows' totals `[rows][2]`; then, 16-byte aligned, each row slot's column sums
/// `[by][2][bx * vec]` (dw, then db).
pub const fn slices_smem_floats(rows: u64, bx: u32, by: u32, vec: u32) -> [usize; 3] {
    let part = rows as usize * bx.div_ceil(32) as usize * 2;
    let totals = part;
    let columns = (totals + rows as usize * 2).next_multiple_of(4);
    [totals, columns, columns + by as usize * 2 * (bx * vec) as usize]
}

/// `(x, g, mean, rstd, partial, rows, cols)`: the column sums of `g * xh` and `g` for rows too
/// long for the register-resident backward, into `partial[2][gridDim.y][cols]` (32 x 8 blocks
/// as the element-wise column reductions).
pub type NormColGradArgs<T> = (*const T, *const T, *const f32, *const f32, *mut f32, u64, u64);
/// `(partial, dw, db, chunks, cols)`: `dw[c] = sum over k of partial[0][k][c]` and `db[c]` from
/// `partial[1]`, in order of k; `blockIdx.y` picks which; a null output is skipped.
pub type NormColsumArgs<T> = (*const f32, *mut T, *mut T, u64, u64);

/// Floats of one column-sum array of the register-resident backward in shared memory: `cols`
/// plus a pad word per 32 columns (bank-conflict-free, see `bwd_reg`).
pub const fn padded(cols: u64) -> usize {
    (cols + cols / 32 + 1) as usize
}

/// Chunk lanes of `norm_colsum`: a block is 32 columns by this many lanes over the chunks.
pub const COLSUM_LANES: u32 = 16;

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::{Elem, for_lanes};
    use crate::elementwise::{COL_BLOCK_X, COL_BLOCK_Y, col_block_store};
    use crate::math::{fma, recip, rsqrt};
    use crate::prim::*;
    use crate::rows::*;

    /// Layer norm (centred) or RMS norm.
    pub trait Norm {
        const CENTER: bool;
        /// L1 policies of the register-resident forward's loads of `x`, the weight and the bias,
        /// at `V` vectors a thread. Every block (one row each) reads the whole weight and bias
        /// after its reductions, from L2 unless L1 still has them from the SM's previous row.
        fn fwd_l1<const V: usize>() -> [L1; 3];
    }
    pub struct Layer;
    pub struct Rms;
    impl Norm for Layer {
        const CENTER: bool = true;
        /// At eight vectors a thread (f32 rows over 2048 columns, f16/bf16 over 16384): the row
        /// not kept in L1, weight and bias `evict_last`: faster on the H100 at every eight-vector
        /// shape measured, f32 and bf16. At four vectors (shorter rows) the same policies lost (f32 at
        /// 1024 and 128 columns, bf16 at 8192 and below), so those keep the defaults; with the row's
        /// loads normal and the parameters `evict_last`, f32 at 32768 lost, and so it did with the last
        /// quarter of the bias `no_allocate` (docs/worklog.md, 2026-11-25d).
        fn fwd_l1<const V: usize>() -> [L1; 3] {
            if V == 8 { [L1::NoAllocate, L1::EvictLast, L1::EvictLast] } else { [L1::Normal; 3] }
        }
    }
    impl Norm for Rms {
        const CENTER: bool = false;
        /// RMS norm's weight alone (128 KB at 32768 f32) fits beside the row's loads, and
        /// `evict_last` keeps it: faster at 4096 x 32768 f32, other shapes unchanged (docs/worklog.md,
        /// 2026-11-24f). (Layer norm's weight and bias, 256 KB, did not with the row's loads normal: the
        /// weight `evict_last` left it unchanged, and with the bias `no_allocate` it fell.)
        fn fwd_l1<const V: usize>() -> [L1; 3] {
            [L1::Normal, L1::EvictLast, L1::Normal]
        }
    }

    /// `(mean, rstd)` of a row from `(_, mean, sum of squared deviations)` (layer) or
    /// `(_, _, sum of squares)` (rms), with `inv_n = recip(cols)`.
    ///
    /// `rsqrt` rather than `1 / sqrt`: one rounding instead of two, and no branch. `sqrt.rn`,
    /// `rcp.rn` and the two divisions by `cols` each took a range check and a branch to a slow
    /// path, in every thread of the row's group. With the butterfly's remainder (`rows.rs`) they
    /// cost 64 instructions a thread a row, where the one-vector bf16 kernel's eight elements a
    /// thread take about 100 (ncu's instruction counts: docs/worklog.md, 2026-11-26g).
    #[inline(always)]
    fn finish<N: Norm>(st: [f32; 3], inv_n: f32, eps: f32) -> (f32, f32) {
        let mu = if N::CENTER { st[1] } else { 0.0 };
        (mu, rsqrt(st[2] * inv_n + eps))
    }

    /// Loads the `VEC` parameters of columns `c..c + VEC`; `1` (weight) or `0` (bias) when the
    /// pointer is null. With `vec` the columns start 16-byte aligned and load as one vector.
    #[inline(always)]
    unsafe fn params<T: Elem>(p: *const T, c: u64, vec: bool, absent: f32) -> [f32; 8] {
        // SAFETY: the same contract.
        unsafe { params_l1::<T>(p, c, vec, absent, L1::Normal) }
    }

    /// [`params`] with an L1 policy for the vector load.
    #[inline(always)]
    unsafe fn params_l1<T: Elem>(p: *const T, c: u64, vec: bool, absent: f32, policy: L1) -> [f32; 8] {
        if p.is_null() {
            return [absent; 8];
        }
        // SAFETY: c + VEC <= cols, the parameter's length; aligned when `vec`.
        unsafe {
            if vec {
                T::unpack(ld_global_nc_v4_l1(p.add(c as usize) as *const u32, policy))
            } else {
                let mut v = [absent; 8];
                for_lanes::<T>(
                    #[inline(always)]
                    |k| v[k] = (*p.add(c as usize + k)).to_f32(),
                );
                v
            }
        }
    }

    /// The vector of parameters at columns `c..c + VEC` (16-byte aligned) for the register-resident
    /// forward below eight vectors a thread: an absent parameter (`absent` 1.0 for the weight, 0.0
    /// for the bias) is the packed words of its default, chosen before the one unpack, where
    /// [`params_l1`] unpacks the load under a predicate beside the default's eight moves. Layer
    /// norm's two-vector f16/bf16 kernel holds 32 registers this way (40 with `params_l1`: full
    /// occupancy in 256-thread blocks), its four-vector one 58 (52; four such blocks an SM either
    /// way); f16/bf16 layer norm at 262144 x 128 and bf16 at 131072 x 256 gained a little. The
    /// eight-vector kernels keep `params_l1`: with this, bf16 layer norm at 4096 x 32768 lost (H100,
    /// docs/worklog.md, 2026-11-26h, three processes of each build alternated).
    #[inline(always)]
    unsafe fn params_packed_l1<T: Elem>(p: *const T, c: u64, absent: f32, policy: L1) -> [f32; 8] {
        let raw = if p.is_null() {
            [if absent == 0.0 { 0 } else { T::ONE_WORD }; 4]
        } else {
            // SAFETY: c + VEC <= cols, the parameter's length, and c is a multiple of VEC.
            unsafe { ld_global_nc_v4_l1(p.add(c as usize) as *const u32, policy) }
        };
        T::unpack(opaque(raw))
    }

    #[inline(always)]
    unsafe fn param<T: Elem>(p: *const T, c: u64, absent: f32) -> f32 {
        // SAFETY: c < cols.
        if p.is_null() { absent } else { unsafe { (*p.add(c as usize)).to_f32() } }
    }

    /// Writes the row's statistics (first thread of the group).
    #[inline(always)]
    unsafe fn save_stats(g: &Group, ok: bool, row: u64, mean: *mut f32, rstd: *mut f32, mu: f32, rs: f32) {
        if ok && g.t == 0 {
            // SAFETY: row < rows, the statistics' length; mean may be null (rms).
            unsafe {
                if !mean.is_null() {
                    *mean.add(row as usize) = mu;
                }
                *rstd.add(row as usize) = rs;
            }
        }
    }

    /// `h = x + residual` over this thread's slots of a row, `x` already in registers (`raw`):
    /// rounded to `T` as PyTorch's eager `x + residual` (an f32 sum, rounded once), stored to `h`
    /// and returned packed, for the norm to read in place of `x`.
    ///
    /// Every residual load is issued before the first store: in place (`h` is `residual`) a store
    /// may alias a later load, so neither compiler may move the loads above the stores, and
    /// interleaved they would wait one round trip each.
    ///
    /// # Safety
    /// `res` and `h` hold the row at `off` as `x` does (whole vectors, 16-byte aligned); `h` may
    /// be `res` (each element is read, by coherent loads, before the thread that reads it writes
    /// it) and aliases nothing else the launch reads.
    #[inline(always)]
    unsafe fn add_residual<T: Elem, const V: usize>(
        raw: [[u32; 4]; V],
        res: *const T,
        h: *mut T,
        off: usize,
        nvec: u64,
        g: &Group,
        ok: bool,
    ) -> [[u32; 4]; V] {
        // SAFETY: the function's contract.
        let rr = unsafe { load_row_coherent::<T, V>(res.add(off), nvec, g, ok) };
        let mut out = raw;
        for_slots::<V>(
            #[inline(always)]
            |s| {
                if slot_present(g, s, nvec, ok) {
                    let (a, r) = (T::unpack(raw[s]), T::unpack(rr[s]));
                    let mut v = [0.0f32; 8];
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| v[k] = a[k] + r[k],
                    );
                    out[s] = T::pack(&v);
                    // SAFETY: slot s is inside the row (the contract).
                    unsafe { st_global_v4(h.add(off + slot_col::<T>(g, s) as usize) as *mut u32, out[s]) };
                }
            },
        );
        out
    }

    /// The register-resident forward; with `ADD`, of `h = x + residual` (see the module).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn fwd_reg<T: Elem, N: Norm, const V: usize, const ADD: bool>(
        x: *const T,
        w: *const T,
        b: *const T,
        y: *mut T,
        mean: *mut f32,
        rstd: *mut f32,
        rows: u64,
        cols: u64,
        eps: f32,
        (res, h): (*const T, *mut T),
    ) {
        let g = Group::this();
        let row = g.first_row();
        let ok = row < rows;
        let nvec = cols / T::VEC as u64;
        let mut red = RowReducer::<1>::new(&g);
        let off = if ok { (row * cols) as usize } else { 0 };
        let [x_l1, w_l1, b_l1] = N::fwd_l1::<V>();
        // SAFETY: rows are whole vectors (host-checked), so every row starts 16-byte aligned.
        let raw = if x_l1 == L1::Normal {
            unsafe { load_row::<T, V>(x.add(off), nvec, &g, ok) }
        } else {
            // `load_row`'s loads with the policy, each addressed from its slot's column as the
            // output's stores are: written as `load_row` with a policy, ptxas allocated the
            // eight-vector f32 kernel differently and it ran slower at 4096 x 32768 (docs/worklog.md,
            // 2026-11-25d).
            let mut raw = [[0u32; 4]; V];
            for_slots::<V>(
                #[inline(always)]
                |s| {
                    if slot_present(&g, s, nvec, ok) {
                        // SAFETY: slot s is inside row `row` (whole vectors).
                        raw[s] = unsafe {
                            ld_global_nc_v4_l1(x.add(off + slot_col::<T>(&g, s) as usize) as *const u32, x_l1)
                        };
                    }
                },
            );
            raw
        };
        // SAFETY: residual and h are rows of x's shape (host-checked).
        let raw = if ADD { unsafe { add_residual::<T, V>(raw, res, h, off, nvec, &g, ok) } } else { raw };
        // The row is in registers: the exact two-pass variance, as two sum reductions (the mean,
        // then the squared deviations from it), cheaper than merging (count, mean, M2) triples,
        // whose merge divides.
        let mut sum = 0.0f32;
        for_slots::<V>(
            #[inline(always)]
            |s| {
                if slot_present(&g, s, nvec, ok) {
                    let v = T::unpack(raw[s]);
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| sum += if N::CENTER { v[k] } else { v[k] * v[k] },
                    );
                }
            },
        );
        let [sum] = red.reduce(&g, [sum], [0.0], add1);
        // The mean and variance as products, without a division's range check and branch
        // between the reductions.
        let inv_n = recip(cols as f32);
        let st = if N::CENTER {
            let m = sum * inv_n;
            let mut m2 = 0.0f32;
            for_slots::<V>(
                #[inline(always)]
                |s| {
                    if slot_present(&g, s, nvec, ok) {
                        let v = T::unpack(opaque(raw[s]));
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| m2 = fma(v[k] - m, v[k] - m, m2),
                        );
                    }
                },
            );
            let [m2] = red.reduce(&g, [m2], [0.0], add1);
            [cols as f32, m, m2]
        } else {
            [0.0, 0.0, sum]
        };
        let (mu, rs) = finish::<N>(st, inv_n, eps);
        unsafe { save_stats(&g, ok, row, mean, rstd, mu, rs) };
        for_slots::<V>(
            #[inline(always)]
            |s| {
                if slot_present(&g, s, nvec, ok) {
                    let c = slot_col::<T>(&g, s);
                    // SAFETY: c + VEC <= cols, aligned (cols is a multiple of VEC).
                    let (wv, bv) = unsafe {
                        if V < 8 {
                            (params_packed_l1(w, c, 1.0, w_l1), params_packed_l1(b, c, 0.0, b_l1))
                        } else {
                            (params_l1(w, c, true, 1.0, w_l1), params_l1(b, c, true, 0.0, b_l1))
                        }
                    };
                    // Unpacked again from the packed registers (see `prim::opaque`).
                    let mut v = T::unpack(opaque(raw[s]));
                    for_lanes::<T>(
                        #[inline(always)]
                        // Layer norm by an fma (one rounding fewer); RMS norm as a product, which
                        // kept its eight-vector kernel within 64 registers (the fma with a zero
                        // bias spilled 12 bytes there).
                        |k| v[k] = if N::CENTER { fma(v[k] - mu, rs * wv[k], bv[k]) } else { v[k] * rs * wv[k] },
                    );
                    // SAFETY: inside row `row` of y.
                    unsafe { st_global_v4(y.add(off + c as usize) as *mut u32, T::pack(&v)) };
                }
            },
        );
        red.finish();
    }

    /// The streaming forward; with `ADD`, of `h = x + residual` (see the module): the first pass
    /// reads `x` and `residual` and writes `h`, the later ones read `h` back (mostly from L2),
    /// each element by the thread that wrote it, through coherent loads.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn fwd_stream<T: Elem, N: Norm, const ADD: bool>(
        x: *const T,
        w: *const T,
        b: *const T,
        y: *mut T,
        mean: *mut f32,
        rstd: *mut f32,
        rows: u64,
        cols: u64,
        eps: f32,
        (res, h): (*const T, *mut T),
    ) {
        let g = Group::this();
        let wv = T::VEC as u64;
        let inv_n = recip(cols as f32);
        g.for_each_row(
            rows,
            #[inline(always)]
            |row| {
                let ok = row < rows;
                let off = if ok { (row * cols) as usize } else { 0 };
                // SAFETY: all element indices below are < cols within row `row`; residual and h
                // have x's shape (host-checked) where ADD.
                let (xr, yr) = unsafe { (x.add(off), y.add(off)) };
                let (rr, hr) = if ADD { unsafe { (res.add(off), h.add(off)) } } else { (res, h) };
                // The row the norm reads: x, or h once the first pass has written it.
                let src: *const T = if ADD { hr } else { xr };
                let sp = if ok { RowSplit::of(xr, cols) } else { RowSplit { head: 0, nvec: 0, cols: 0 } };
                let load = #[inline(always)]
                |c: u64| unsafe {
                    let p = src.add(c as usize) as *const u32;
                    T::unpack(if ADD { ld_global_v4(p) } else { ld_global_nc_v4(p) })
                };
                let one = #[inline(always)]
                |c: u64| unsafe { (*src.add(c as usize)).to_f32() };
                // The exact two-pass variance here too: the sum (from memory), then the squared
                // deviations from the mean (the row again, from L2 as a rule), then the output.
                let sum_of = |f: &dyn Fn(f32) -> f32| {
                    let s = fold_row(
                        sp,
                        wv,
                        &g,
                        0.0f32,
                        load,
                        #[inline(always)]
                        |mut acc, _, v| {
                            for_lanes::<T>(
                                #[inline(always)]
                                |k| acc += f(v[k]),
                            );
                            acc
                        },
                        #[inline(always)]
                        |acc, c| acc + f(one(c)),
                    );
                    group_reduce(&g, [s], [0.0], add1)[0]
                };
                // The fused add's first pass: over x + residual, writing h.
                let first = |f: &dyn Fn(f32) -> f32| {
                    let s = fold_row(
                        sp,
                        wv,
                        &g,
                        0.0f32,
                        #[inline(always)]
                        |c: u64| unsafe {
                            let c = c as usize;
                            (ld_global_nc_v4(xr.add(c) as *const u32), ld_global_v4(rr.add(c) as *const u32))
                        },
                        #[inline(always)]
                        |mut acc, c, (a, r): ([u32; 4], [u32; 4])| {
                            let (a, r) = (T::unpack(a), T::unpack(r));
                            let mut v = [0.0f32; 8];
                            for_lanes::<T>(
                                #[inline(always)]
                                |k| v[k] = a[k] + r[k],
                            );
                            let p = T::pack(&v);
                            // SAFETY: inside row `row` of h.
                            unsafe { st_global_v4(hr.add(c as usize) as *mut u32, p) };
                            let v = T::unpack(p);
                            for_lanes::<T>(
                                #[inline(always)]
                                |k| acc += f(v[k]),
                            );
                            acc
                        },
                        #[inline(always)]
                        |acc, c| unsafe {
                            let c = c as usize;
                            let v = T::from_f32((*xr.add(c)).to_f32() + (*rr.add(c)).to_f32());
                            *hr.add(c) = v;
                            acc + f(v.to_f32())
                        },
                    );
                    group_reduce(&g, [s], [0.0], add1)[0]
                };
                let st = if N::CENTER {
                    let m = if ADD { first(&|v| v) } else { sum_of(&|v| v) } * inv_n;
                    [cols as f32, m, sum_of(&|v| (v - m) * (v - m))]
                } else {
                    [0.0, 0.0, if ADD { first(&|v| v * v) } else { sum_of(&|v| v * v) }]
                };
                let (mu, rs) = finish::<N>(st, inv_n, eps);
                unsafe { save_stats(&g, ok, row, mean, rstd, mu, rs) };
                // Parameters are per column: vector loads when this row's vectors start at
                // multiples of VEC columns (aligned rows), scalar loads otherwise.
                let pvec = sp.head == 0;
                fold_row(
                    sp,
                    wv,
                    &g,
                    (),
                    load,
                    #[inline(always)]
                    |(), c, mut v| unsafe {
                        let (wp, bp) = (params(w, c, pvec, 1.0), params(b, c, pvec, 0.0));
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| v[k] = (v[k] - mu) * rs * wp[k] + bp[k],
                        );
                        st_global_v4(yr.add(c as usize) as *mut u32, T::pack(&v));
                    },
                    #[inline(always)]
                    |(), c| unsafe {
                        let v = one(c);
                        *yr.add(c as usize) = T::from_f32((v - mu) * rs * param(w, c, 1.0) + param(b, c, 0.0));
                    },
                );
            },
        );
    }

    #[inline(always)]
    fn add1(a: [f32; 1], b: [f32; 1]) -> [f32; 1] {
        [a[0] + b[0]]
    }

    #[inline(always)]
    fn add2(a: [f32; 2], b: [f32; 2]) -> [f32; 2] {
        [a[0] + b[0], a[1] + b[1]]
    }

    /// The row's `(mean, rstd)` saved by the forward (`ok` false: zeros, unused).
    #[inline(always)]
    unsafe fn stats(ok: bool, row: u64, mean: *const f32, rstd: *const f32) -> (f32, f32) {
        if !ok {
            return (0.0, 0.0);
        }
        // SAFETY: row < rows; mean is null for rms.
        unsafe { (if mean.is_null() { 0.0 } else { *mean.add(row as usize) }, *rstd.add(row as usize)) }
    }

    /// The row's constants of `gx` from the row sums `a = sum(gw)`, `b = sum(gw * xh)`: with
    /// `xh = (x - mean) rstd`, `gx = rstd (g w - a / n - xh b / n)` is
    /// `rstd (g w) - k x + c0`, `k = rstd^2 b / n`, `c0 = k mean - rstd a / n` (rms: no `a`
    /// term, mean 0). Per element that is a product and two FFMA (`grad_x`), where the form
    /// above took six operations: the bf16 backward issued about 46 instructions an element, and
    /// at 4096 x 32768 the SMs' issue slots were most of what it waited on (the FFMA of the sums
    /// helped, and this on top: docs/worklog.md, 2026-11-23d). `c0` carries the rounding of `k mean`,
    /// about `rstd |mean| 2^-24` relative to `k`: the size of the error the mean itself already
    /// brings to `xh`.
    #[inline(always)]
    fn grad_consts<N: Norm>(mu: f32, rs: f32, a: f32, b: f32, inv_n: f32) -> (f32, f32) {
        let k = rs * rs * (b * inv_n);
        let c0 = if N::CENTER { fma(k, mu, -(rs * (a * inv_n))) } else { 0.0 };
        (k, c0)
    }

    /// One element of `gx` (see [`grad_consts`]).
    #[inline(always)]
    fn grad_x(g: f32, w: f32, x: f32, rs: f32, (k, c0): (f32, f32)) -> f32 {
        fma(g * w, rs, fma(x, -k, c0))
    }

    /// With the fused add, `dh` (a vector as loaded) added to a vector of `gx` before it is
    /// rounded and stored: `dx = dh + norm_backward(dy)`, one rounding. Nothing without it.
    #[inline(always)]
    fn add_dh<T: Elem, const ADD: bool>(gx: &mut [f32; 8], dh: [u32; 4]) {
        if ADD {
            let d = T::unpack(dh);
            for_lanes::<T>(
                #[inline(always)]
                |k| gx[k] += d[k],
            );
        }
    }

    /// The part of each row a block of the register-resident backward owns, and its rows.
    struct Span {
        /// First column and whole vectors of the block's part of a row.
        col0: u64,
        nvec: u64,
        /// The block's (cluster's) first row and row stride.
        first: u64,
        step: u64,
        /// Which partial row of dw, db the block writes, of how many.
        chunk: u64,
        chunks: u64,
    }

    /// With `C = 1`, whole rows per group and a grid-stride walk. With `C > 1` (sm_90 only),
    /// each block of a cluster holds a run of every row (`rows::cluster_run`), and the cluster
    /// walks rows.
    #[inline(always)]
    fn span<T: Elem, const C: u32>(g: &Group, cols: u64) -> Span {
        let nvec = cols / T::VEC as u64;
        if C == 1 {
            let grid = grid_dim_x() as u64;
            return Span {
                col0: 0,
                nvec,
                first: g.first_row(),
                step: grid * g.per_block as u64,
                chunk: block_idx_x() as u64,
                chunks: grid,
            };
        }
        let (col0, nvec) = cluster_run::<T, C>(cols);
        let (cl, ncl) = (cluster_idx_x() as u64, cluster_count_x() as u64);
        Span { col0, nvec, first: cl, step: ncl, chunk: cl, chunks: ncl }
    }

    /// Register-resident backward. `C = 1`: one group of threads holds a whole row. `C > 1`:
    /// a cluster of `C` blocks (one group each) holds it, each block a run of its columns, and
    /// the row sums are combined over the cluster through distributed shared memory
    /// (`rows::RowReducer`): rows of 32768 f32 are 256 KB of `x` and `g`, more than one
    /// SM's registers, but 64 KB on each of four SMs. Without it those rows stream (five passes
    /// over memory instead of three).
    ///
    /// The column sums of `dw`, `db`: each block writes its partial row to `partial`
    /// (`norm_colsum` adds them).
    ///
    /// With `ADD`, `dh` (loaded with `x` and `g`) is added to each element of `gx` as it is
    /// stored (see the module).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn bwd_reg<T: Elem, N: Norm, const V: usize, const C: u32, const ADD: bool>(
        x: *const T,
        w: *const T,
        gr: *const T,
        mean: *const f32,
        rstd: *const f32,
        gx: *mut T,
        partial: *mut f32,
        rows: u64,
        cols: u64,
        dh: *const T,
    ) {
        // The column sums' kernel (`norm_colsum`) may be scheduled now: it waits for this grid.
        launch_dependents();
        let g = Group::this();
        let sp = span::<T, C>(&g, cols);
        let nvec = sp.nvec;
        // The block's part of every row, and of the weights, starts at column col0.
        // SAFETY: col0 + nvec * VEC <= cols (span).
        let (x, w, gr, gx, dh) = unsafe {
            let c0 = sp.col0 as usize;
            (
                x.add(c0),
                if w.is_null() { w } else { w.add(c0) },
                gr.add(c0),
                gx.add(c0),
                if ADD { dh.add(c0) } else { dh },
            )
        };
        let inv_n = 1.0 / cols as f32;
        // This thread's columns are the same in every row: their weights stay in registers
        // (packed: half the registers for f16/bf16; unpacked where used), and their dw, db sums
        // in this group's region of shared memory, `[2][cols]` f32 after the reduction's slots.
        // In registers, the sums took 2 * V * VEC more of them: 120-160 registers a thread, one
        // or two blocks per SM, and the bf16 backward ran slower (docs/worklog.md, 2026-11-23c).
        // In a cluster the weights are loaded where used instead (from L1: the block reads the
        // same columns every row), to keep x and g within 64 registers without spilling.
        let has_w = !w.is_null();
        // SAFETY: the weights are one whole-vector row of cols elements, 16-byte aligned.
        let wr = unsafe { load_row::<T, V>(w, nvec, &g, has_w && C == 1) };
        let weights = |s: usize| {
            if !has_w {
                [1.0f32; 8]
            } else if C == 1 {
                T::unpack(opaque(wr[s]))
            } else {
                // SAFETY: slot s is present (callers check), so its vector is inside the weights.
                T::unpack(unsafe { ld_global_nc_v4(w.add(slot_col::<T>(&g, s) as usize) as *const u32) })
            }
        };
        // Uniform over the launch (a kernel argument), as the cluster barriers below need.
        let sums_on = !partial.is_null();
        let smem = dyn_smem::<f32>();
        let slots = reduce_smem_bytes(g.size * g.per_block);
        let acc_base = (slots / 4 + cluster_slots(C)) as usize;
        let mut red = RowReducer::<C>::new(&g);
        // Each thread reads and writes only its own columns of its group's region until the
        // final barrier, so no barrier is needed before then. Column c (of the block's part of
        // the row) lives at `c + c / 32`: a warp's threads hold columns VEC apart, which
        // unpadded would put lanes 4 (f32) or 8 (bf16) apart on the same bank (an 8-way
        // conflict, which cost the bf16 backward most of its speed); one pad word per 32 columns spreads
        // them over all 32 banks, and a vector's lanes stay at constant offsets from its first
        // column. (A quad-major layout with 16-byte accesses, tried: faster for bf16 rows of 32768 in
        // clusters, but 80 -> 87-92 registers for the one-group kernels, one block an SM fewer, and
        // bf16 at 16384 x 4096 slower: docs/worklog.md, 2026-11-23b.)
        let region = padded(nvec * T::VEC as u64);
        let mine = acc_base + g.ty as usize * 2 * region;
        let acc = |c: u64, k: usize, which: usize| {
            // SAFETY: the host launches with reduce_smem_bytes + cluster_slots + R * 2 *
            // padded(columns of the block's part) * 4 bytes when `partial` is not null;
            // c + k < those columns.
            unsafe { smem.add(mine + which * region + (c + c / 32) as usize + k) }
        };
        // The same slots as shared-window addresses, for the row loop's read-modify-writes:
        // `ld.shared`/`st.shared` with the lane as an immediate offset (measured: the same
        // instruction count as through the generic pointer; the FFMA below are what cut it).
        // The zeroing above the loop still goes through `acc`: unifying it on these addresses
        // is a kernel change left for when the suite can be re-run on a GPU.
        let acc_base_addr = dyn_smem_addr() + 4 * mine as u32;
        let acc_addr = |c: u64, which: usize| acc_base_addr + 4 * (which * region + (c + c / 32) as usize) as u32;
        if sums_on {
            for_slots::<V>(
                #[inline(always)]
                |s| {
                    if slot_present(&g, s, nvec, true) {
                        let c = slot_col::<T>(&g, s);
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| unsafe {
                                *acc(c, k, 0) = 0.0;
                                *acc(c, k, 1) = 0.0;
                            },
                        );
                    }
                },
            );
        }
        // SAFETY: whole-vector rows (host-checked); gx aliases no input.
        let load = |row: u64| unsafe {
            let (ok, off) = (row < rows, (row * cols) as usize);
            (load_row::<T, V>(x.add(off), nvec, &g, ok), load_row::<T, V>(gr.add(off), nvec, &g, ok))
        };
        // With the fused add, the gradient flowing into h, added to gx.
        // SAFETY: as above; dh has x's shape where ADD.
        let load_dh = |row: u64| {
            if ADD {
                unsafe { load_row::<T, V>(dh.add((row * cols) as usize), nvec, &g, row < rows) }
            } else {
                [[0u32; 4]; V]
            }
        };
        g.for_each_row_from(
            rows,
            sp.first,
            sp.step,
            #[inline(always)]
            |row| {
                let ok = row < rows;
                let off = if ok { (row * cols) as usize } else { 0 };
                let (rx, rg) = load(row);
                let rd = load_dh(row);
                let (mu, rs) = unsafe { stats(ok, row, mean, rstd) };
                let mut sums = [0.0f32; 2];
                for_slots::<V>(
                    #[inline(always)]
                    |s| {
                        if slot_present(&g, s, nvec, ok) {
                            let (vx, vg, wv) = (T::unpack(rx[s]), T::unpack(rg[s]), weights(s));
                            let c = slot_col::<T>(&g, s);
                            let (a0, a1) = (acc_addr(c, 0), acc_addr(c, 1));
                            for_lanes::<T>(
                                #[inline(always)]
                                |k| {
                                    let xh = (vx[k] - mu) * rs;
                                    let gw = vg[k] * wv[k];
                                    sums[0] += gw;
                                    sums[1] = fma(gw, xh, sums[1]);
                                    if sums_on {
                                        // SAFETY: this thread's own columns (see `acc`).
                                        unsafe {
                                            let (p0, p1) = (a0 + 4 * k as u32, a1 + 4 * k as u32);
                                            st_shared_f32(p0, fma(vg[k], xh, ld_shared_f32(p0)));
                                            st_shared_f32(p1, ld_shared_f32(p1) + vg[k]);
                                        }
                                    }
                                },
                            );
                        }
                    },
                );
                let [a, b] = red.reduce(&g, sums, [0.0; 2], add2);
                let kc = grad_consts::<N>(mu, rs, a, b, inv_n);
                for_slots::<V>(
                    #[inline(always)]
                    |s| {
                        if slot_present(&g, s, nvec, ok) {
                            // Unpacked again from the packed registers (see `prim::opaque`).
                            let (vx, mut vg, wv) = (T::unpack(opaque(rx[s])), T::unpack(opaque(rg[s])), weights(s));
                            for_lanes::<T>(
                                #[inline(always)]
                                |k| vg[k] = grad_x(vg[k], wv[k], vx[k], rs, kc),
                            );
                            add_dh::<T, ADD>(&mut vg, rd[s]);
                            // SAFETY: inside row `row` of gx.
                            unsafe {
                                st_global_v4(gx.add(off + slot_col::<T>(&g, s) as usize) as *mut u32, T::pack(&vg))
                            };
                        }
                    },
                );
            },
        );
        red.finish();
        if !sums_on {
            return;
        }
        // The block's groups cover the same columns: add their regions in group order, and write
        // the block's partial row (its part of it, in a cluster). No other block touches this
        // block's shared memory after the exchange's final cluster barrier.
        sync_threads();
        // Recomputed rather than kept live through the row loop (in a cluster, 64 registers).
        let sp = span::<T, C>(&g, cols);
        let (chunks, blk) = (sp.chunks, sp.chunk);
        let threads = (g.size * g.per_block) as u64;
        let mut c = (g.ty * g.size + g.t) as u64;
        while c < nvec * T::VEC as u64 {
            for which in 0..2u64 {
                // SAFETY: column c of the block's part of the row, every group's sums written
                // (the barrier above).
                let v = unsafe { groups_sum(&g, acc_base + which as usize * region + (c + c / 32) as usize, region) };
                // SAFETY: partial holds 2 * chunks * cols floats (host-checked); c < cols.
                unsafe { *partial.add(((which * chunks + blk) * cols + sp.col0 + c) as usize) = v };
            }
            c += threads;
        }
    }

    /// The sum over the block's groups, in group order, of the float at `at` of the first
    /// group's column sums (each group's `[2][padded(cols)]` region `2 * region` floats after
    /// the last).
    ///
    /// # Safety
    /// `at` lies in the first group's region of the dynamic shared memory, every group's
    /// regions written and visible to this thread.
    #[inline(always)]
    unsafe fn groups_sum(g: &Group, at: usize, region: usize) -> f32 {
        let smem = dyn_smem::<f32>();
        let mut v = 0.0f32;
        for r in 0..g.per_block as usize {
            // SAFETY: inside the R regions of 2 * padded(cols) floats (the caller's contract).
            v += unsafe { *smem.add(at + r * 2 * region) };
        }
        v
    }

    /// Backward with parameter gradients for few rows, the grid one cluster of `K` blocks of
    /// `bx` x `by` threads. Block `k` owns a slice of the columns (vectors `k nvec / K` to
    /// `(k + 1) nvec / K`) of *every* row: thread `(tx, ty)` holds vector `tx` of the slice in
    /// rows `ty, ty + by, ...` (`V` of them), all loaded before any arithmetic, so the whole
    /// launch is one round trip to memory. A row's sums are shuffles over the `bx` lanes across
    /// the slice, then the cluster's `K` times `ceil(bx / 32)` warp partials added in a fixed
    /// order through distributed shared memory: one exchange for all rows, not one a row. `dw` and `db` of the slice's columns
    /// are the block's own sums over its rows: no partial rows, no column pass, no second
    /// launch.
    ///
    /// This is for launches of few rows, where the persistent plan is latency: a row a group
    /// over the whole grid, then partial rows of `dw`, `db` written and added by a dependent
    /// launch, whose cost this kernel removes. It replaced a single cluster of a row a block for at
    /// most eight rows (docs/worklog.md, 2026-11-26b). Host: `slices_plan` in host/ops/norm.rs.
    ///
    /// # Safety
    /// The grid is one cluster of `K` blocks (sm_90) of at most `SLICES_THREADS` threads, a
    /// multiple of 32; `bx` a power of two up to 32 or a multiple of 32, at least `nvec / K`
    /// rounded up; `by * V >= rows`; with
    /// [`slices_smem_floats`] of dynamic shared memory; `x`, `gr`, `gx` hold `rows * cols`
    /// elements, `cols` a multiple of `T::VEC`, rows 16-byte aligned; `w`, `dw`, `db` hold
    /// `cols` or are null; `mean` (null for RMS norm) and `rstd` hold `rows` floats; with `ADD`,
    /// `dh` holds `rows * cols` (added to `gx`, see the module).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn bwd_slices<T: Elem, N: Norm, const V: usize, const K: u32, const ADD: bool>(
        x: *const T,
        w: *const T,
        gr: *const T,
        mean: *const f32,
        rstd: *const f32,
        gx: *mut T,
        (dw, db): (*mut T, *mut T),
        rows: u64,
        cols: u64,
        dh: *const T,
    ) {
        let vec = T::VEC as u64;
        let nvec = cols / vec;
        let k = cluster_rank() as u64;
        let (v0, v1) = (k * nvec / K as u64, (k + 1) * nvec / K as u64);
        let (tx, ty, bx, by) = (thread_idx_x(), thread_idx_y(), block_dim_x(), block_dim_y());
        // `bx` threads across the slice: a power of two up to 32 (several rows a warp, each on
        // `bx` adjacent lanes) or a multiple of 32 (`warps` warps a row, one partial each).
        let (lane, warp, warps, width) = (tx % 32, tx / 32, bx.div_ceil(32), bx.min(32));
        let col_ok = (tx as u64) < v1 - v0;
        // This thread's first column; only dereferenced when col_ok.
        let c = (v0 + tx as u64) * vec;
        let [tot_off, col_off, _] = slices_smem_floats(rows, bx, by, T::VEC as u32);
        let base = dyn_smem_addr();
        let part_addr = |row: u64, q: u32, which: u32| base + 4 * ((row as u32 * warps + q) * 2 + which);
        let tot_addr = |row: u64, which: u32| base + 4 * (tot_off as u32 + row as u32 * 2 + which);
        // SAFETY (the loads): c + VEC <= cols when col_ok; rows below `rows`; 16-byte aligned.
        // The weights stay packed (half the registers for f16/bf16), unpacked where used.
        let has_w = !w.is_null();
        let wraw = if has_w && col_ok { unsafe { ld_global_nc_v4(w.add(c as usize) as *const u32) } } else { [0; 4] };
        let weights = || if has_w { T::unpack(opaque(wraw)) } else { [1.0f32; 8] };
        let row_of = |j: usize| ty as u64 + j as u64 * by as u64;
        let (mut rx, mut rg) = ([[0u32; 4]; V], [[0u32; 4]; V]);
        let mut st = [(0.0f32, 0.0f32); V];
        for_slots::<V>(
            #[inline(always)]
            |j| {
                let ok = row_of(j) < rows;
                if ok && col_ok {
                    let off = (row_of(j) * cols + c) as usize;
                    unsafe {
                        rx[j] = ld_global_nc_v4(x.add(off) as *const u32);
                        rg[j] = ld_global_nc_v4(gr.add(off) as *const u32);
                    }
                }
                st[j] = unsafe { stats(ok, row_of(j), mean, rstd) };
            },
        );
        // The row sums of this thread's part of each row, and its column sums over its rows (in
        // registers: one vector of columns).
        let (mut cw, mut cb) = ([0.0f32; 8], [0.0f32; 8]);
        let mut sums = [[0.0f32; 2]; V];
        for_slots::<V>(
            #[inline(always)]
            |j| {
                if row_of(j) < rows && col_ok {
                    let (mu, rs) = st[j];
                    let (vx, vg, wv) = (T::unpack(rx[j]), T::unpack(rg[j]), weights());
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| {
                            let xh = (vx[k] - mu) * rs;
                            let gw = vg[k] * wv[k];
                            sums[j][0] += gw;
                            sums[j][1] = fma(gw, xh, sums[j][1]);
                            cw[k] = fma(vg[k], xh, cw[k]);
                            cb[k] += vg[k];
                        },
                    );
                }
            },
        );
        // Over the lanes across the slice, every row's two sums at each step of one butterfly:
        // 2V independent shuffles a step instead of V reductions one after another (at eight
        // rows a thread those chains were most of the kernel).
        let mut m = 16;
        while m > 0 {
            if m < width {
                for_slots::<V>(
                    #[inline(always)]
                    |j| {
                        sums[j][0] += shfl_xor_f32(sums[j][0], m);
                        sums[j][1] += shfl_xor_f32(sums[j][1], m);
                    },
                );
            }
            m >>= 1;
        }
        if lane % width == 0 {
            for_slots::<V>(
                #[inline(always)]
                |j| {
                    if row_of(j) < rows {
                        // SAFETY: inside the row partials (slices_smem_floats), row < rows.
                        unsafe {
                            st_shared_f32(part_addr(row_of(j), warp, 0), sums[j][0]);
                            st_shared_f32(part_addr(row_of(j), warp, 1), sums[j][1]);
                        }
                    }
                },
            );
        }
        let cols_at = |slot: u32, which: u32| base + 4 * (col_off as u32 + (slot * 2 + which) * bx * T::VEC as u32);
        if col_ok {
            let at = 4 * tx * T::VEC as u32;
            // SAFETY: 16-byte aligned (col_off is a multiple of 4 floats, VEC of 4 or 8),
            // inside row slot ty's column sums. Written out: a loop over the halves left `cw`,
            // `cb` in a stack frame.
            unsafe {
                st_shared_v4_f32(cols_at(ty, 0) + at, [cw[0], cw[1], cw[2], cw[3]]);
                st_shared_v4_f32(cols_at(ty, 1) + at, [cb[0], cb[1], cb[2], cb[3]]);
                if T::VEC == 8 {
                    st_shared_v4_f32(cols_at(ty, 0) + at + 16, [cw[4], cw[5], cw[6], cw[7]]);
                    st_shared_v4_f32(cols_at(ty, 1) + at + 16, [cb[4], cb[5], cb[6], cb[7]]);
                }
            }
        }
        // With the fused add, dh: loaded here, where the column sums have left the registers, and
        // in flight while the cluster meets.
        let mut rd = [[0u32; 4]; V];
        if ADD {
            for_slots::<V>(
                #[inline(always)]
                |j| {
                    if row_of(j) < rows && col_ok {
                        // SAFETY: as x's loads above; dh has x's shape.
                        rd[j] = unsafe { ld_global_nc_v4(dh.add((row_of(j) * cols + c) as usize) as *const u32) };
                    }
                },
            );
        }
        // Every block's row partials and column sums written and visible; every block started.
        cluster_sync();
        let (tid, threads) = ((ty * bx + tx) as u64, (bx * by) as u64);
        // The rows' totals: the same sums in the same order in every block and on every run.
        let mut p = tid;
        while p < 2 * rows {
            let (row, which) = (p / 2, (p % 2) as u32);
            let mut v = 0.0f32;
            for q in 0..warps {
                for rank in 0..K {
                    // SAFETY: block `rank`'s row partials, written before the barrier above;
                    // every block runs until the barrier at the end.
                    v += unsafe { ld_shared_cluster_f32(part_addr(row, q, which), rank) };
                }
            }
            // SAFETY: inside the totals.
            unsafe { st_shared_f32(tot_addr(row, which), v) };
            p += threads;
        }
        // This block's columns of dw and db: its row slots' sums, in slot order.
        let bcols = (v1 - v0) * vec;
        let colsum = |out: *mut T, which: u32, cc: u64| {
            if !out.is_null() {
                let mut v = 0.0f32;
                for slot in 0..by {
                    // SAFETY: inside slot `slot`'s column sums, written before the barrier.
                    v += unsafe { ld_shared_f32(cols_at(slot, which) + 4 * cc as u32) };
                }
                // SAFETY: v0 * vec + cc < cols, the outputs' length.
                unsafe { *out.add((v0 * vec + cc) as usize) = T::from_f32(v) };
            }
        };
        let mut cc = tid;
        while cc < bcols {
            colsum(dw, 0, cc);
            colsum(db, 1, cc);
            cc += threads;
        }
        // Done with the other blocks' shared memory; they may exit once all have said so.
        cluster_arrive();
        sync_threads();
        let inv_n = 1.0 / cols as f32;
        for_slots::<V>(
            #[inline(always)]
            |j| {
                if row_of(j) < rows && col_ok {
                    let (mu, rs) = st[j];
                    // SAFETY: the totals, written before the barrier above.
                    let (a, b) =
                        unsafe { (ld_shared_f32(tot_addr(row_of(j), 0)), ld_shared_f32(tot_addr(row_of(j), 1))) };
                    let kc = grad_consts::<N>(mu, rs, a, b, inv_n);
                    let (vx, mut vg, wv) = (T::unpack(opaque(rx[j])), T::unpack(opaque(rg[j])), weights());
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| vg[k] = grad_x(vg[k], wv[k], vx[k], rs, kc),
                    );
                    add_dh::<T, ADD>(&mut vg, rd[j]);
                    // SAFETY: inside row row_of(j) of gx, which aliases no input.
                    unsafe { st_global_v4(gx.add((row_of(j) * cols + c) as usize) as *mut u32, T::pack(&vg)) };
                }
            },
        );
        cluster_wait();
    }

    #[allow(clippy::too_many_arguments)]
    pub unsafe fn bwd_stream<T: Elem, N: Norm, const ADD: bool>(
        x: *const T,
        w: *const T,
        gr: *const T,
        mean: *const f32,
        rstd: *const f32,
        gx: *mut T,
        rows: u64,
        cols: u64,
        dh: *const T,
    ) {
        let g = Group::this();
        let wv = T::VEC as u64;
        let inv_n = 1.0 / cols as f32;
        g.for_each_row(
            rows,
            #[inline(always)]
            |row| {
                let ok = row < rows;
                let off = if ok { (row * cols) as usize } else { 0 };
                // SAFETY: indices below are < cols within row `row`; dh has x's shape where ADD.
                let (xr, gr_, gxr) = unsafe { (x.add(off), gr.add(off), gx.add(off)) };
                let dhr = if ADD { unsafe { dh.add(off) } } else { dh };
                let sp = if ok { RowSplit::of(xr, cols) } else { RowSplit { head: 0, nvec: 0, cols: 0 } };
                let (mu, rs) = unsafe { stats(ok, row, mean, rstd) };
                let pvec = sp.head == 0;
                let load = #[inline(always)]
                |c: u64| unsafe {
                    let c_ = c as usize;
                    (
                        T::unpack(ld_global_nc_v4(xr.add(c_) as *const u32)),
                        T::unpack(ld_global_nc_v4(gr_.add(c_) as *const u32)),
                        params(w, c, pvec, 1.0),
                    )
                };
                let sums = fold_row(
                    sp,
                    wv,
                    &g,
                    [0.0f32; 2],
                    load,
                    #[inline(always)]
                    |mut acc, _, (vx, vg, wp): ([f32; 8], [f32; 8], [f32; 8])| {
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| {
                                let gw = vg[k] * wp[k];
                                acc[0] += gw;
                                acc[1] += gw * (vx[k] - mu) * rs;
                            },
                        );
                        acc
                    },
                    #[inline(always)]
                    |acc, c| unsafe {
                        let gw = (*gr_.add(c as usize)).to_f32() * param(w, c, 1.0);
                        [acc[0] + gw, acc[1] + gw * ((*xr.add(c as usize)).to_f32() - mu) * rs]
                    },
                );
                let [a, b] = group_reduce(&g, sums, [0.0; 2], add2);
                let kc = grad_consts::<N>(mu, rs, a, b, inv_n);
                fold_row(
                    sp,
                    wv,
                    &g,
                    (),
                    #[inline(always)]
                    |c: u64| {
                        let d =
                            if ADD { unsafe { ld_global_nc_v4(dhr.add(c as usize) as *const u32) } } else { [0; 4] };
                        (load(c), d)
                    },
                    #[inline(always)]
                    |(), c, ((vx, mut vg, wp), d): (([f32; 8], [f32; 8], [f32; 8]), [u32; 4])| {
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| vg[k] = grad_x(vg[k], wp[k], vx[k], rs, kc),
                        );
                        add_dh::<T, ADD>(&mut vg, d);
                        unsafe { st_global_v4(gxr.add(c as usize) as *mut u32, T::pack(&vg)) };
                    },
                    #[inline(always)]
                    |(), c| unsafe {
                        let c_ = c as usize;
                        let (gv, xv) = ((*gr_.add(c_)).to_f32(), (*xr.add(c_)).to_f32());
                        let d = if ADD { (*dhr.add(c_)).to_f32() } else { 0.0 };
                        let v = grad_x(gv, param(w, c, 1.0), xv, rs, kc);
                        *gxr.add(c_) = T::from_f32(if ADD { v + d } else { v });
                    },
                );
            },
        );
    }

    /// Column sums of `g * xh` and `g` for the streaming backward: 32 columns by 8 row lanes per
    /// block, `gridDim.y` chunks of rows, each into its own partial row (as `row_bwd` in
    /// elementwise.rs).
    pub unsafe fn colgrad<T: Elem, N: Norm>(
        x: *const T,
        gr: *const T,
        mean: *const f32,
        rstd: *const f32,
        partial: *mut f32,
        rows: u64,
        cols: u64,
    ) {
        let (tx, ty) = (thread_idx_x(), thread_idx_y());
        let col = block_idx_x() as u64 * COL_BLOCK_X as u64 + tx as u64;
        let chunks = grid_dim_y() as u64;
        let (mut dw, mut db) = (0.0f32, 0.0f32);
        if col < cols {
            let step = chunks * COL_BLOCK_Y as u64;
            let mut r = block_idx_y() as u64 * COL_BLOCK_Y as u64 + ty as u64;
            while r < rows {
                let i = (r * cols + col) as usize;
                // SAFETY: r < rows, col < cols.
                let (xv, gv, (mu, rs)) =
                    unsafe { ((*x.add(i)).to_f32(), (*gr.add(i)).to_f32(), stats(true, r, mean, rstd)) };
                dw += gv * (xv - mu) * rs;
                db += gv;
                r += step;
            }
        }
        // SAFETY: partial holds 2 * chunks * cols floats; the host launches with 2 * 256 floats
        // of shared memory.
        unsafe { col_block_store([dw, db], 2, partial, cols, col) };
    }

    /// `out[c] = sum_k partial[k * cols + c]`: 32 columns by `COLSUM_LANES` lanes per block;
    /// lane `l` adds chunks `l, l + LANES, ...`, then the lanes are added in order. Spreading the
    /// chunks over lanes matters when there are a thousand of them (one per block of a
    /// persistent backward) and few columns.
    pub unsafe fn colsum<T: Elem>(partial: *const f32, dw: *mut T, db: *mut T, chunks: u64, cols: u64) {
        // Launched as a dependent of the backward (host: `launch_dependent`): nothing it reads
        // or writes may be touched before that kernel is complete.
        grid_dependency_wait();
        // One launch for both sums: a small backward pays one launch less.
        let (out, partial) = if block_idx_y() == 0 {
            (dw, partial)
        } else {
            // SAFETY: partial holds 2 * chunks * cols floats (host-checked).
            (db, unsafe { partial.add((chunks * cols) as usize) })
        };
        if out.is_null() {
            return;
        }
        let (tx, ty) = (thread_idx_x(), thread_idx_y());
        let col = block_idx_x() as u64 * 32 + tx as u64;
        let mut s = 0.0f32;
        if col < cols {
            let mut k = ty as u64;
            while k < chunks {
                // SAFETY: k < chunks, col < cols.
                s += unsafe { *partial.add((k * cols + col) as usize) };
                k += COLSUM_LANES as u64;
            }
        }
        let smem = dyn_smem::<f32>();
        // SAFETY: the host launches with 32 * COLSUM_LANES floats of shared memory.
        unsafe { *smem.add((ty * 32 + tx) as usize) = s };
        sync_threads();
        if ty == 0 && col < cols {
            let mut acc = 0.0f32;
            for l in 0..COLSUM_LANES {
                // SAFETY: inside the shared array.
                acc += unsafe { *smem.add((l * 32 + tx) as usize) };
            }
            // SAFETY: col < cols, out's length.
            unsafe { *out.add(col as usize) = T::from_f32(acc) };
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

// --- the kernels: `<op>_<fwd|bwd>_<v1|v2|v4|v8|stream>_<dtype>`, `<op>_bwd_c<C>_v<V>_<dtype>`,
// `<op>_bwd_slices_k<K>_v<V>_<dtype>` for `<op>` of layer_norm, rms_norm and the fused
// add_layer_norm, add_rms_norm; `<layer_norm|rms_norm>_colgrad_<dtype>`, `norm_colsum_<dtype>` --

/// The norm family's kernels of one storage type `T`, typed (see [`RowKernels`]).
pub struct NormKernels<T: 'static> {
    /// Layer norm's.
    pub layer_norm: NormOp<T>,
    /// RMS norm's.
    pub rms_norm: NormOp<T>,
    /// The fused residual add and layer norm's (`ADD`; its backward with `dh`). Its `colgrad` is
    /// layer norm's: the column sums of `g * xh` and `g` do not see `dh`.
    pub add_layer_norm: NormOp<T>,
    /// The fused residual add and RMS norm's (`colgrad`: RMS norm's).
    pub add_rms_norm: NormOp<T>,
    /// `norm_colsum_<dtype>`: the parameter gradients from the backward's partial rows.
    pub colsum: Kernel<NormColsumArgs<T>>,
}

/// The kernels of layer norm or RMS norm for one storage type.
pub struct NormOp<T: 'static> {
    /// `<op>_fwd_*`.
    pub fwd: RowKernels<NormFwdArgs<T>>,
    /// `<op>_bwd_*`: register-resident, cluster and streaming.
    pub bwd: RowKernels<NormBwdArgs<T>>,
    /// `<op>_bwd_slices_k<K>_*`, one entry a cluster size `K` (sm_90).
    pub slices: &'static [SlicesKernels<T>],
    /// `<op>_colgrad_<dtype>`: the column sums behind the streaming backward.
    pub colgrad: Kernel<NormColGradArgs<T>>,
}

/// The slices backward's instances of one cluster size (`<op>_bwd_slices_k<K>_v<V>_<dtype>`).
pub struct SlicesKernels<T: 'static> {
    /// `K`: blocks of the cluster, the whole grid.
    pub blocks: u32,
    /// `(V, kernel)`: rows a thread holds, ascending.
    pub kernels: &'static [(usize, Kernel<NormBwdOneArgs<T>>)],
}

impl<T: 'static> NormKernels<T> {
    /// Layer norm's kernels if `layer`, else RMS norm's; the fused residual add's if `add`.
    pub const fn op(&self, layer: bool, add: bool) -> &NormOp<T> {
        match (layer, add) {
            (true, false) => &self.layer_norm,
            (false, false) => &self.rms_norm,
            (true, true) => &self.add_layer_norm,
            (false, true) => &self.add_rms_norm,
        }
    }
}

impl<T: 'static> NormOp<T> {
    /// The slices backward's instances of `blocks` blocks, if the family has them.
    pub fn slices(&self, blocks: u32) -> Option<&SlicesKernels<T>> {
        self.slices.iter().find(|s| s.blocks == blocks)
    }
}

impl<T: 'static> NormKernels<T>
where
    NormFwdArgs<T>: Params,
    NormBwdArgs<T>: Params,
    NormBwdOneArgs<T>: Params,
    NormColGradArgs<T>: Params,
    NormColsumArgs<T>: Params,
{
    /// Every kernel's name and arity (the fused ops' `colgrad`, the plain norms', once).
    pub fn entries(&self) -> impl Iterator<Item = KernelEntry> + '_ {
        let ops = [
            (&self.layer_norm, true),
            (&self.rms_norm, true),
            (&self.add_layer_norm, false),
            (&self.add_rms_norm, false),
        ]
        .into_iter()
        .flat_map(|(o, own_colgrad)| {
            let slices = o.slices.iter().flat_map(|s| s.kernels.iter().map(|(_, k)| k.entry()));
            let colgrad = own_colgrad.then(|| o.colgrad.entry());
            o.fwd.entries().chain(o.bwd.entries()).chain(slices).chain(colgrad)
        });
        ops.chain([self.colsum.entry()])
    }
}

/// A storage type's norm kernels.
pub trait NormElem: crate::Elem {
    /// The table of `Self`'s instances.
    const NORM: NormKernels<Self>;
}

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    NORM_F32.entries().chain(NORM_F16.entries()).chain(NORM_BF16.entries())
}

/// Declares, per storage type, every instance of the family from one list: the kernels (on the
/// device), their typed handles and the type's [`NormKernels`] table (on the host). The fused
/// ops (`add_`) are the plain ones' kernel bodies with `ADD` set, over their own lists of
/// forward and slices instances (the backward's others as the plain norms').
macro_rules! norm_family {
    ($($T:ty, $sfx:ident, $table:ident:
        fwd [$($f:literal)*] bwd [$($b:literal)*] bwd_clusters [$($c:literal)*] of $cv:literal
        slices [$($k:literal)*] of $s:tt; add: fwd [$($af:literal)*] slices of $as:tt;)*) => { $(
        norm_family!(@op $T, $sfx, layer_norm, Layer, false, [$($f)*], [$($b)*], [$($c)*], $cv, [$($k)*], $s);
        norm_family!(@op $T, $sfx, rms_norm, Rms, false, [$($f)*], [$($b)*], [$($c)*], $cv, [$($k)*], $s);
        norm_family!(@op $T, $sfx, add_layer_norm, Layer, true, [$($af)*], [$($b)*], [$($c)*], $cv, [$($k)*], $as);
        norm_family!(@op $T, $sfx, add_rms_norm, Rms, true, [$($af)*], [$($b)*], [$($c)*], $cv, [$($k)*], $as);
        paste::paste! {
            $crate::kernel!([<layer_norm_colgrad_ $sfx>]: NormColGradArgs<$T> =
                |x, g, mean, rstd, partial, rows, cols|
                colgrad::<$T, Layer>(x, g, mean, rstd, partial, rows, cols));
            $crate::kernel!([<rms_norm_colgrad_ $sfx>]: NormColGradArgs<$T> =
                |x, g, mean, rstd, partial, rows, cols|
                colgrad::<$T, Rms>(x, g, mean, rstd, partial, rows, cols));
            $crate::kernel!([<norm_colsum_ $sfx>]: NormColsumArgs<$T> = |partial, dw, db, chunks, cols|
                colsum::<$T>(partial, dw, db, chunks, cols));
            #[cfg(not(target_arch = "nvptx64"))]
            #[doc = concat!("The norm kernels of ", stringify!($sfx), ".")]
            pub const $table: NormKernels<$T> = NormKernels {
                layer_norm: norm_family!(@table $sfx, layer_norm, layer_norm, [$($f)*], [$($b)*], [$($c)*], $cv, [$($k)*], $s),
                rms_norm: norm_family!(@table $sfx, rms_norm, rms_norm, [$($f)*], [$($b)*], [$($c)*], $cv, [$($k)*], $s),
                add_layer_norm: norm_family!(@table $sfx, add_layer_norm, layer_norm, [$($af)*], [$($b)*], [$($c)*], $cv,
                    [$($k)*], $as),
                add_rms_norm: norm_family!(@table $sfx, add_rms_norm, rms_norm, [$($af)*], [$($b)*], [$($c)*], $cv,
                    [$($k)*], $as),
                colsum: [<norm_colsum_ $sfx>],
            };
        }
        #[cfg(not(target_arch = "nvptx64"))]
        impl NormElem for $T {
            const NORM: NormKernels<$T> = $table;
        }
    )* };
    (@op $T:ty, $sfx:ident, $op:ident, $N:ident, $add:literal, [$($f:literal)*], [$($b:literal)*], [$($c:literal)*],
        $cv:literal, [$($k:literal)*], $s:tt) => {
        paste::paste! {
            $( $crate::kernel!([<$op _fwd_v $f _ $sfx>]: NormFwdArgs<$T> =
                |x, w, b, y, mean, rstd, rows, cols, eps, res, h|
                fwd_reg::<$T, $N, $f, $add>(x, w, b, y, mean, rstd, rows, cols, eps, (res, h))); )*
            $( $crate::kernel!([<$op _bwd_v $b _ $sfx>]: NormBwdArgs<$T> =
                |x, w, g, mean, rstd, gx, partial, rows, cols, dh|
                bwd_reg::<$T, $N, $b, 1, $add>(x, w, g, mean, rstd, gx, partial, rows, cols, dh)); )*
            $crate::kernel!([<$op _fwd_stream_ $sfx>]: NormFwdArgs<$T> =
                |x, w, b, y, mean, rstd, rows, cols, eps, res, h|
                fwd_stream::<$T, $N, $add>(x, w, b, y, mean, rstd, rows, cols, eps, (res, h)));
            $crate::kernel!([<$op _bwd_stream_ $sfx>]: NormBwdArgs<$T> =
                |x, w, g, mean, rstd, gx, _partial, rows, cols, dh|
                bwd_stream::<$T, $N, $add>(x, w, g, mean, rstd, gx, rows, cols, dh));
            // Clusters of C blocks, V vectors a thread (sm_90 only; the host lists them for
            // every target and launches them where the device's module has them).
            $( #[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_90"))]
            $crate::kernel!([<$op _bwd_c $c _v $cv _ $sfx>]: NormBwdArgs<$T> =
                |x, w, g, mean, rstd, gx, partial, rows, cols, dh|
                bwd_reg::<$T, $N, $cv, $c, $add>(x, w, g, mean, rstd, gx, partial, rows, cols, dh)); )*
        }
        $( norm_family!(@slices $T, $sfx, $op, $N, $add, $k, $s); )*
    };
    // Few rows in column slices, the grid one cluster of K blocks (sm_90 only, as the clusters).
    (@slices $T:ty, $sfx:ident, $op:ident, $N:ident, $add:literal, $k:literal, [$($v:literal)*]) => { $( paste::paste! {
        #[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_90"))]
        $crate::kernel!([<$op _bwd_slices_k $k _v $v _ $sfx>]: NormBwdOneArgs<$T> =
            |x, w, g, mean, rstd, gx, dw, db, rows, cols, dh|
            bwd_slices::<$T, $N, $v, $k, $add>(x, w, g, mean, rstd, gx, (dw, db), rows, cols, dh));
    } )* };
    (@table $sfx:ident, $op:ident, $colgrad:ident, [$($f:literal)*], [$($b:literal)*], [$($c:literal)*], $cv:literal,
        [$($k:literal)*], $s:tt) => {
        paste::paste! {
            NormOp {
                fwd: RowKernels::new(&[
                    $( (RowVariant::Reg($f), [<$op _fwd_v $f _ $sfx>]), )*
                    (RowVariant::Stream, [<$op _fwd_stream_ $sfx>]),
                ]),
                bwd: RowKernels::new(&[
                    $( (RowVariant::Reg($b), [<$op _bwd_v $b _ $sfx>]), )*
                    $( (RowVariant::Cluster($c, $cv), [<$op _bwd_c $c _v $cv _ $sfx>]), )*
                    (RowVariant::Stream, [<$op _bwd_stream_ $sfx>]),
                ]),
                slices: &[ $( norm_family!(@slices_table $sfx, $op, $k, $s), )* ],
                colgrad: [<$colgrad _colgrad_ $sfx>],
            }
        }
    };
    (@slices_table $sfx:ident, $op:ident, $k:literal, [$($v:literal)*]) => {
        paste::paste! {
            SlicesKernels { blocks: $k, kernels: &[ $( ($v, [<$op _bwd_slices_k $k _v $v _ $sfx>]), )* ] }
        }
    };
}

// The instances, in one place.
//
// Forward: as softmax, eight vectors per thread for rows of up to 32768, f32 in a 1024-thread
// group, f16/bf16 rows of 16385 to 32768 in up to 512 threads, two blocks an SM (bf16 layer norm
// at 4096 x 32768 ran faster with eight than with four vectors in 1024 threads; at 8192 x 8192
// eight were slower than four, so the host offers them only to the long rows: docs/worklog.md,
// 2026-11-23c). The row, its second reduction, the weights and biases fit 64 registers since the
// changes of 2026-11-26g to `finish` and the output (8-24 bytes of spill before, on sm_80 and
// sm_90).
//
// Backward: it holds x, g and the weights in registers: four vectors of f32 (two of f16/bf16) at
// most. Rows of 16K-64K elements (32768 is the suite's long row) held by clusters of 4 or 8
// blocks of up to 1024 threads (sm_90 only; older GPUs stream them), two vectors of x and of g a
// thread (eight f32 or sixteen f16/bf16 elements each) within 64 registers. One vector of
// f16/bf16 a thread measured slower at 4096 x 32768 bf16 than two, which spread a row's fixed
// costs (two reductions, the exchange, index arithmetic) over twice the elements. Four of
// f16/bf16 spill 180-190 bytes at 64 registers.
//
// Launches of few rows with parameter gradients in column slices (`bwd_slices`): one cluster of
// eight or sixteen blocks of up to 512 threads, each thread one vector of its slice in up to
// eight rows (four of f16/bf16: eight spill 12 bytes at 128 registers).
//
// The fused add: the backward's instances as the plain norms', except the slices' eight rows a
// thread of f32 (spills at 128 registers with dh) and one row a thread of f32 (ptxas 12.9 and
// 13.0 gave the sixteen-block RMS norm kernel 40 registers and a stack frame; for few rows, two
// a thread serve as well). The forward holds x and the residual at once, twice the registers of
// the row, so not eight vectors a thread (64 registers at 1024 threads): f32 rows up to 16384 and
// f16/bf16 up to 32768 stay in registers at four.
norm_family! {
    f32, f32, NORM_F32:
        fwd [1 2 4 8] bwd [1 2 4] bwd_clusters [4 8] of 2 slices [8 16] of [1 2 4 8];
        add: fwd [1 2 4] slices of [2 4];
    crate::dtype::F16, f16, NORM_F16:
        fwd [1 2 4 8] bwd [1 2] bwd_clusters [4 8] of 2 slices [8 16] of [1 2 4];
        add: fwd [1 2 4] slices of [1 2 4];
    crate::dtype::BF16, bf16, NORM_BF16:
        fwd [1 2 4 8] bwd [1 2] bwd_clusters [4 8] of 2 slices [8 16] of [1 2 4];
        add: fwd [1 2 4] slices of [1 2 4];
}
