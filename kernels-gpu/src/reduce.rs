//! Reductions: sum, mean, max, min and argmax, over a whole tensor or along the last dimension.
//! Storage in f32, f16 or bf16; accumulation in f32; argmax returns i64 indices.
//!
//! Whole tensor, two stages, deterministic (no atomics; the grid depends only on `n` and the
//! device, and every combination happens in a fixed order):
//! - `reduce_<op>_all`: a grid of about one wave of resident blocks. Each thread folds a
//!   grid-stride share of the tensor, [`UNROLL`] 16-byte vectors per round with all loads issued
//!   before any is used (64 bytes in flight per thread), then the block reduces its threads with
//!   `rows::group_reduce` (the group is the whole block) into one f32 partial per block. A grid of
//!   one block (small tensors) writes the finished result itself: one launch.
//! - `reduce_<op>_final`: one block combines the partials, always in the same order. It is a
//!   programmatic dependent launch on sm_90 (scheduled while stage 1 runs, waiting in
//!   `griddepcontrol.wait`), which hides its launch latency: faster at 2^28 and 2^16 on the H100
//!   (docs/worklog.md, 2026-11-25b).
//!
//! Along the last dimension (`reduce_<op>_rows`): one group of threads per row, streaming over
//! the row with `rows::fold_row` (any length, any alignment), one group reduction per row; short
//! rows pack several groups into a block (see `rows.rs`).
//!
//! Over the leading dimensions (`reduce_sum_cols`: a `[rows, cols]` view to `cols` sums, e.g. a
//! bias gradient), two stages, deterministic, as the element-wise column sums
//! (`elementwise.rs`) but with 16-byte loads: a block is `TX x TY = 256` threads, `TX` (a power
//! of two up to 32) adjacent 16-byte column vectors by `TY` row lanes, so a warp reads up to 512
//! contiguous bytes of a row and narrow matrices still fill their warps (rows of 4 f32 put 32
//! rows in a warp). `gridDim.x` tiles the columns, `gridDim.y` splits the rows into chunks
//! (lane `ty` of chunk `k` takes rows `k * TY + ty`, then every `gridDim.y * TY`-th); each
//! thread keeps `VEC` column sums, folding [`UNROLL`] rows per round as a tree; the block adds
//! its row lanes as a tree in shared memory and writes one partial row per chunk, which
//! `norm_colsum` (norm.rs, the same finishing sum the norms' weight gradients use) adds in a
//! fixed order. A grid of one chunk writes the result itself. Rows whose length is not a
//! multiple of `VEC` are not 16-byte aligned: there each thread loads its `VEC` columns one by
//! one (the warp's loads still cover contiguous bytes, through L1).
//!
//! Sums fold each round as a balanced tree (lanes, then vectors) before adding it to the
//! thread's running sum, which keeps the depth of the summation short (the error bound is
//! proportional to it). Mean is the sum times `scale = 1/n`, computed on the host in f64 and
//! rounded to f32 (PyTorch's `MeanOps` factor).
//!
//! IEEE cases follow PyTorch: max, min and argmax propagate NaN (argmax: the index of the first
//! NaN); argmax ties give the smallest index; a sum of `+inf` and `-inf` is NaN.
//!
//! Argmax state is a value and a u64 index; through the group reductions the index travels as
//! the bits of two f32 slots. In-thread folds visit indices in increasing order, so a later
//! element replaces the best only when strictly greater (or the first NaN); across threads the
//! combination compares values, then indices, which makes it order-independent. The best starts
//! as `(-inf, NONE)`: a range of only `-inf` leaves `NONE`, which the finishing thread turns
//! into the range's first index.

use crate::kernel::Kernel;

/// Stage 1 over a whole tensor: `(x, n, partial, out, scale)`. Block `b` writes the reduction of
/// its share of `x[..n]` to `partial[b]`; a grid of one block instead writes the finished result
/// `out[0] = op_finish(r, scale)` (then `partial` is unused and may be null).
pub type ReducePartArgs<T> = (*const T, u64, *mut f32, *mut T, f32);
/// Stage 2: `(partial, parts, out, scale)`: one block combines `partial[..parts]` in a fixed
/// order and writes `out[0]`.
pub type ReduceFinalArgs<T> = (*const f32, u64, *mut T, f32);
/// Along the last dimension: `(x, out, rows, cols, scale)`: `out[r]` is the reduction of row `r`
/// of `x` (`rows x cols`, `cols >= 1`).
pub type ReduceRowsArgs<T> = (*const T, *mut T, u64, u64, f32);
/// Over the leading dimensions, stage 1: `(x, partial, out, rows, cols, scale)`: the block at
/// `(bx, k)` sums its chunk `k` of the rows of `x` (`rows x cols`) for its columns, times
/// `scale` (the mean's `1/rows`), into `partial[k * cols + c]` (f32, `gridDim.y * cols`); a grid
/// of one chunk writes `out[c]` (`cols` elements of `T`) instead, and `partial` may be null.
/// Blocks of [`COLS_BLOCK`] threads as `(TX, COLS_BLOCK / TX)`, `TX` a power of two up to 32;
/// dynamic shared memory [`cols_smem_bytes`].
pub type ReduceColsArgs<T> = (*const T, *mut f32, *mut T, u64, u64, f32);
/// Argmax stage 1: `(x, n, part_val, part_idx, out)`: block `b` writes its best value and index
/// (`u64::MAX` for "none yet") to `part_val[b]`, `part_idx[b]`; a grid of one block writes the
/// finished index to `out[0]`.
pub type ArgmaxPartArgs<T> = (*const T, u64, *mut f32, *mut u64, *mut i64);
/// Argmax stage 2: `(part_val, part_idx, parts, out)`.
pub type ArgmaxFinalArgs = (*const f32, *const u64, u64, *mut i64);
/// Argmax along the last dimension: `(x, out, rows, cols)`, `cols >= 1`.
pub type ArgmaxRowsArgs<T> = (*const T, *mut i64, u64, u64);

/// 16-byte vectors each thread of stage 1 loads per round before it uses any of them. Four keep
/// 64 bytes in flight per thread (with 1024 resident threads per SM, 64 KiB, about three times
/// what Little's law asks for at 3 TB/s) in 16 registers of raw data, whatever the dtype.
pub const UNROLL: usize = 4;
/// Threads per block of stage 1 when the grid has more than one block.
pub const PART_BLOCK: u32 = 256;
/// Threads per block of `reduce_sum_cols`.
pub const COLS_BLOCK: u32 = 256;

/// Dynamic shared memory of `reduce_sum_cols` for `vec` elements per 16-byte vector: `VEC`
/// floats per thread, for the tree over the row lanes.
pub const fn cols_smem_bytes(vec: u32) -> u32 {
    COLS_BLOCK * vec * 4
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::{Elem, for_lanes};
    use crate::prim::*;
    use crate::rows::*;

    /// A reduction to one f32 value.
    pub trait ValueOp {
        /// The identity: what a thread with nothing to fold contributes.
        const ID: f32;
        fn op(a: f32, b: f32) -> f32;
        /// The stored result of the reduction `r` (`scale`: the mean's `1/n`).
        fn finish(r: f32, scale: f32) -> f32;
    }
    pub struct Sum;
    pub struct Max;
    pub struct Min;
    impl ValueOp for Sum {
        const ID: f32 = 0.0;
        #[inline(always)]
        fn op(a: f32, b: f32) -> f32 {
            a + b
        }
        #[inline(always)]
        fn finish(r: f32, scale: f32) -> f32 {
            r * scale
        }
    }
    impl ValueOp for Max {
        const ID: f32 = f32::NEG_INFINITY;
        #[inline(always)]
        fn op(a: f32, b: f32) -> f32 {
            nan_max(a, b)
        }
        #[inline(always)]
        fn finish(r: f32, _: f32) -> f32 {
            r
        }
    }
    impl ValueOp for Min {
        const ID: f32 = f32::INFINITY;
        #[inline(always)]
        fn op(a: f32, b: f32) -> f32 {
            nan_min(a, b)
        }
        #[inline(always)]
        fn finish(r: f32, _: f32) -> f32 {
            r
        }
    }

    #[inline(always)]
    fn combine1<O: ValueOp>(a: [f32; 1], b: [f32; 1]) -> [f32; 1] {
        [O::op(a[0], b[0])]
    }

    /// The `VEC` lanes of a vector as a balanced tree (depth 2 for f32, 3 for f16/bf16).
    #[inline(always)]
    fn lanes<T: Elem, O: ValueOp>(v: &[f32; 8]) -> f32 {
        let a = O::op(O::op(v[0], v[1]), O::op(v[2], v[3]));
        if T::VEC == 8 { O::op(a, O::op(O::op(v[4], v[5]), O::op(v[6], v[7]))) } else { a }
    }

    /// Folds this thread's grid-stride share of `x[..n]`, in increasing index order:
    /// `round(acc, i0, step, raw)` for each full round of [`UNROLL`] vectors (vector `s` starts
    /// at element `i0 + s * step`; all four loaded before the call), `vector(acc, i, raw)` for
    /// the leftover whole vectors, `scalar(acc, i)` for the elements past the last whole vector
    /// (one per thread, on the first threads of the grid).
    ///
    /// # Safety
    /// `x` must hold `n` elements, be 16-byte aligned and not be written by this launch.
    #[inline(always)]
    unsafe fn grid_fold<T: Elem, A>(
        x: *const T,
        n: u64,
        mut acc: A,
        round: impl Fn(A, u64, u64, [[u32; 4]; UNROLL]) -> A,
        vector: impl Fn(A, u64, [u32; 4]) -> A,
        scalar: impl Fn(A, u64) -> A,
    ) -> A {
        let w = T::VEC as u64;
        let nv = n / w;
        let stride = grid_threads_x();
        let first = global_thread_x();
        let mut i = first;
        // SAFETY: callers pass vector indices below nv, so the 16 bytes lie inside x.
        let ld = #[inline(always)]
        |j: u64| unsafe { ld_global_nc_v4(x.add((j * w) as usize) as *const u32) };
        // Written out rather than as a loop over an array: an array indexed in a loop the
        // compiler does not fully unroll lands in local memory.
        while i + 3 * stride < nv {
            let raw = [ld(i), ld(i + stride), ld(i + 2 * stride), ld(i + 3 * stride)];
            acc = round(acc, i * w, stride * w, raw);
            i += UNROLL as u64 * stride;
        }
        while i < nv {
            acc = vector(acc, i * w, ld(i));
            i += stride;
        }
        let t = nv * w + first;
        if t < n {
            acc = scalar(acc, t);
        }
        acc
    }

    pub unsafe fn reduce_part<T: Elem, O: ValueOp>(x: *const T, n: u64, partial: *mut f32, out: *mut T, scale: f32) {
        // Stage 2 (`reduce_final`, a dependent launch) may be scheduled now: it waits for this grid.
        launch_dependents();
        let g = Group::this();
        // SAFETY: the host passes x with n elements (a whole allocation: 16-byte aligned).
        let acc = unsafe {
            grid_fold::<T, f32>(
                x,
                n,
                O::ID,
                #[inline(always)]
                |acc, _, _, r| {
                    let s = #[inline(always)]
                    |k: usize| lanes::<T, O>(&T::unpack(r[k]));
                    O::op(acc, O::op(O::op(s(0), s(1)), O::op(s(2), s(3))))
                },
                #[inline(always)]
                |acc, _, r| O::op(acc, lanes::<T, O>(&T::unpack(r))),
                // SAFETY: i < n.
                #[inline(always)]
                |acc, i| O::op(acc, (*x.add(i as usize)).to_f32()),
            )
        };
        let [r] = group_reduce(&g, [acc], [O::ID], combine1::<O>);
        if g.t == 0 {
            // SAFETY: out holds one element; with more than one block, partial holds one float
            // per block (host-allocated from the same grid).
            unsafe {
                if grid_dim_x() == 1 {
                    *out = T::from_f32(O::finish(r, scale));
                } else {
                    *partial.add(block_idx_x() as usize) = r;
                }
            }
        }
    }

    pub unsafe fn reduce_final<T: Elem, O: ValueOp>(partial: *const f32, parts: u64, out: *mut T, scale: f32) {
        // Launched as a dependent of stage 1: its partials are complete and visible after this.
        grid_dependency_wait();
        let g = Group::this();
        let mut acc = O::ID;
        let mut k = g.t as u64;
        while k < parts {
            // SAFETY: k < parts, the length of partial.
            acc = O::op(acc, unsafe { *partial.add(k as usize) });
            k += g.size as u64;
        }
        let [r] = group_reduce(&g, [acc], [O::ID], combine1::<O>);
        if g.t == 0 {
            // SAFETY: out holds one element.
            unsafe { *out = T::from_f32(O::finish(r, scale)) };
        }
    }

    pub unsafe fn reduce_rows<T: Elem, O: ValueOp>(x: *const T, out: *mut T, rows: u64, cols: u64, scale: f32) {
        let g = Group::this();
        g.for_each_row(
            rows,
            #[inline(always)]
            |row| {
                let ok = row < rows;
                // SAFETY: row < rows, so the row's `cols` elements lie inside x.
                let xr = unsafe { x.add(if ok { (row * cols) as usize } else { 0 }) };
                let sp = if ok { RowSplit::of(xr, cols) } else { RowSplit { head: 0, nvec: 0, cols: 0 } };
                let acc = fold_row(
                    sp,
                    T::VEC as u64,
                    &g,
                    O::ID,
                    // SAFETY (both): fold_row hands out aligned whole vectors and scalar columns
                    // inside the row.
                    #[inline(always)]
                    |c| unsafe { ld_global_nc_v4(xr.add(c as usize) as *const u32) },
                    #[inline(always)]
                    |acc, _, r| O::op(acc, lanes::<T, O>(&T::unpack(r))),
                    #[inline(always)]
                    |acc, c| O::op(acc, unsafe { (*xr.add(c as usize)).to_f32() }),
                );
                let [r] = group_reduce(&g, [acc], [O::ID], combine1::<O>);
                if ok && g.t == 0 {
                    // SAFETY: out holds `rows` elements.
                    unsafe { *out.add(row as usize) = T::from_f32(O::finish(r, scale)) };
                }
            },
        );
    }

    /// Rows `r, r + step, ...` of this thread's row lane (chunk `blockIdx.y`, lane `ty`) into
    /// `acc`, `ld(r)` loading row r's VEC columns: loads first, then a tree per round (see
    /// `grid_fold`). Written out, not an array of rows: an array indexed in a loop lands in local
    /// memory.
    #[inline(always)]
    fn fold_rows<T: Elem>(acc: &mut [f32; 8], rows: u64, ld: impl Fn(u64) -> [f32; 8]) {
        const { assert!(UNROLL == 4, "the round below is written out for four rows") };
        let by = block_dim_y() as u64;
        let step = grid_dim_y() as u64 * by;
        let mut r = block_idx_y() as u64 * by + thread_idx_y() as u64;
        while r + 3 * step < rows {
            let (a, b, c, d) = (ld(r), ld(r + step), ld(r + 2 * step), ld(r + 3 * step));
            for_lanes::<T>(
                #[inline(always)]
                |k| acc[k] += (a[k] + b[k]) + (c[k] + d[k]),
            );
            r += UNROLL as u64 * step;
        }
        while r < rows {
            let a = ld(r);
            for_lanes::<T>(
                #[inline(always)]
                |k| acc[k] += a[k],
            );
            r += step;
        }
    }

    /// Stage 1 of the sums over the leading dimensions (see the module comment).
    ///
    /// `ALIGNED`: rows of whole 16-byte vectors (`cols % VEC == 0`, host-checked), one vector
    /// load a row; otherwise `VEC` scalar loads. Two kernels rather than a test in the loop:
    /// ptxas sizes a kernel's registers for its hungriest path, and with both loops in one kernel
    /// the scalar one (32 loads in flight) gave f16/bf16 70 registers, three 256-thread blocks
    /// an SM and 48 KB of loads in flight, and ran slower; apart, the bf16 kernel over whole vectors
    /// takes 48 registers (five blocks) and runs faster (docs/worklog.md, 2026-11-23c).
    pub unsafe fn reduce_cols<T: Elem, const ALIGNED: bool>(
        x: *const T,
        partial: *mut f32,
        out: *mut T,
        rows: u64,
        cols: u64,
        scale: f32,
    ) {
        let (tx, ty, bx, by) = (thread_idx_x(), thread_idx_y(), block_dim_x(), block_dim_y());
        let w = T::VEC as u64;
        // The first of this thread's VEC columns.
        let c0 = (block_idx_x() as u64 * bx as u64 + tx as u64) * w;
        let mut acc = [0.0f32; 8];
        if c0 < cols {
            // SAFETY (both loaders): callers pass r < rows; columns c0 + k < cols are read, so
            // every element lies inside x (rows * cols elements).
            if ALIGNED {
                // Rows of whole vectors start 16-byte aligned (x is a whole allocation) and c0 is a
                // multiple of VEC: one aligned 16-byte vector.
                fold_rows::<T>(&mut acc, rows, |r| unsafe {
                    T::unpack(ld_global_nc_v4(x.add((r * cols + c0) as usize) as *const u32))
                });
            } else {
                fold_rows::<T>(&mut acc, rows, |r| unsafe {
                    let p = x.add((r * cols + c0) as usize);
                    let mut v = [0.0f32; 8];
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| {
                            if c0 + (k as u64) < cols {
                                v[k] = (*p.add(k)).to_f32();
                            }
                        },
                    );
                    v
                });
            }
        }
        // The row lanes as a tree over shared memory ([ty][tx][VEC]); `by` is a power of two and
        // the same for every thread, so every thread reaches every barrier.
        let smem = dyn_smem::<f32>();
        let me = ((ty * bx + tx) as usize) * T::VEC;
        // SAFETY (all shared accesses): indices below COLS_BLOCK * VEC, the launch's
        // `cols_smem_bytes`.
        for_lanes::<T>(
            #[inline(always)]
            |k| unsafe { *smem.add(me + k) = acc[k] },
        );
        sync_threads();
        let mut half = by / 2;
        while half > 0 {
            if ty < half {
                let other = me + (half * bx) as usize * T::VEC;
                for_lanes::<T>(
                    #[inline(always)]
                    |k| unsafe { *smem.add(me + k) += *smem.add(other + k) },
                );
            }
            sync_threads();
            half /= 2;
        }
        if ty == 0 && c0 < cols {
            let chunk = block_idx_y() as u64;
            let single = grid_dim_y() == 1;
            for_lanes::<T>(
                #[inline(always)]
                |k| {
                    let c = c0 + k as u64;
                    if c < cols {
                        // SAFETY: c < cols; out holds cols elements, partial gridDim.y * cols
                        // floats (host-allocated from the same grid) when there is more than one
                        // chunk.
                        unsafe {
                            let s = *smem.add(me + k) * scale;
                            if single {
                                *out.add(c as usize) = T::from_f32(s);
                            } else {
                                *partial.add((chunk * cols + c) as usize) = s;
                            }
                        }
                    }
                },
            );
        }
    }

    // --- argmax --------------------------------------------------------------------------------

    /// "No index yet": larger than every index, so it loses every tie.
    const NONE: u64 = u64::MAX;

    /// In-order fold: element `i` comes after every element already folded, so it wins only when
    /// strictly greater, or when it is the first NaN.
    #[inline(always)]
    fn take(best: (f32, u64), v: f32, i: u64) -> (f32, u64) {
        if v > best.0 || (v != v && best.0 == best.0) { (v, i) } else { best }
    }

    #[inline(always)]
    fn pack(b: (f32, u64)) -> [f32; 3] {
        [b.0, f32::from_bits(b.1 as u32), f32::from_bits((b.1 >> 32) as u32)]
    }

    #[inline(always)]
    fn index(s: [f32; 3]) -> u64 {
        s[1].to_bits() as u64 | (s[2].to_bits() as u64) << 32
    }

    /// Combines two partial results of any two disjoint ranges: NaN first (the smaller index
    /// among NaNs), then the greater value, then the smaller index. A total preference, so the
    /// result does not depend on the order of combination.
    #[inline(always)]
    fn arg_combine(a: [f32; 3], b: [f32; 3]) -> [f32; 3] {
        let (an, bn) = (a[0] != a[0], b[0] != b[0]);
        let earlier = index(b) < index(a);
        let take_b = if an || bn { bn && (!an || earlier) } else { b[0] > a[0] || (b[0] == a[0] && earlier) };
        if take_b { b } else { a }
    }

    /// The finished index: `NONE` means every element was `-inf` (nothing is greater than the
    /// start), and then the first one is the answer.
    #[inline(always)]
    fn finished(i: u64) -> i64 {
        if i == NONE { 0 } else { i as i64 }
    }

    #[inline(always)]
    fn take_vector<T: Elem>(mut best: (f32, u64), i: u64, raw: [u32; 4]) -> (f32, u64) {
        let v = T::unpack(raw);
        for_lanes::<T>(
            #[inline(always)]
            |k| best = take(best, v[k], i + k as u64),
        );
        best
    }

    pub unsafe fn argmax_part<T: Elem>(x: *const T, n: u64, part_val: *mut f32, part_idx: *mut u64, out: *mut i64) {
        // As `reduce_part`: `argmax_final` waits for this grid.
        launch_dependents();
        let g = Group::this();
        // SAFETY: as `reduce_part`.
        let best = unsafe {
            grid_fold::<T, (f32, u64)>(
                x,
                n,
                (f32::NEG_INFINITY, NONE),
                #[inline(always)]
                |b, i, step, r| {
                    let b = take_vector::<T>(b, i, r[0]);
                    let b = take_vector::<T>(b, i + step, r[1]);
                    let b = take_vector::<T>(b, i + 2 * step, r[2]);
                    take_vector::<T>(b, i + 3 * step, r[3])
                },
                #[inline(always)]
                |b, i, r| take_vector::<T>(b, i, r),
                // SAFETY: i < n.
                #[inline(always)]
                |b, i| take(b, (*x.add(i as usize)).to_f32(), i),
            )
        };
        let r = group_reduce(&g, pack(best), pack((f32::NEG_INFINITY, NONE)), arg_combine);
        if g.t == 0 {
            // SAFETY: as `reduce_part`: out holds one index; part_val and part_idx one entry per block.
            unsafe {
                if grid_dim_x() == 1 {
                    *out = finished(index(r));
                } else {
                    *part_val.add(block_idx_x() as usize) = r[0];
                    *part_idx.add(block_idx_x() as usize) = index(r);
                }
            }
        }
    }

    pub unsafe fn argmax_final(part_val: *const f32, part_idx: *const u64, parts: u64, out: *mut i64) {
        // As `reduce_final`.
        grid_dependency_wait();
        let g = Group::this();
        let mut acc = pack((f32::NEG_INFINITY, NONE));
        let mut k = g.t as u64;
        while k < parts {
            // SAFETY: k < parts, the length of both partial arrays.
            let p = unsafe { (*part_val.add(k as usize), *part_idx.add(k as usize)) };
            acc = arg_combine(acc, pack(p));
            k += g.size as u64;
        }
        let r = group_reduce(&g, acc, pack((f32::NEG_INFINITY, NONE)), arg_combine);
        if g.t == 0 {
            // SAFETY: out holds one index.
            unsafe { *out = finished(index(r)) };
        }
    }

    pub unsafe fn argmax_rows<T: Elem>(x: *const T, out: *mut i64, rows: u64, cols: u64) {
        let g = Group::this();
        g.for_each_row(
            rows,
            #[inline(always)]
            |row| {
                let ok = row < rows;
                // SAFETY: row < rows, so the row's `cols` elements lie inside x.
                let xr = unsafe { x.add(if ok { (row * cols) as usize } else { 0 }) };
                let sp = if ok { RowSplit::of(xr, cols) } else { RowSplit { head: 0, nvec: 0, cols: 0 } };
                // fold_row visits this thread's head, vectors and tail in increasing column order,
                // which `take` relies on.
                let best = fold_row(
                    sp,
                    T::VEC as u64,
                    &g,
                    (f32::NEG_INFINITY, NONE),
                    // SAFETY (both): whole aligned vectors and scalar columns inside the row.
                    #[inline(always)]
                    |c| unsafe { ld_global_nc_v4(xr.add(c as usize) as *const u32) },
                    #[inline(always)]
                    |b, c, r| take_vector::<T>(b, c, r),
                    #[inline(always)]
                    |b, c| take(b, unsafe { (*xr.add(c as usize)).to_f32() }, c),
                );
                let r = group_reduce(&g, pack(best), pack((f32::NEG_INFINITY, NONE)), arg_combine);
                if ok && g.t == 0 {
                    // SAFETY: out holds `rows` indices.
                    unsafe { *out.add(row as usize) = finished(index(r)) };
                }
            },
        );
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

// --- the kernels: `reduce_<sum|max|min|argmax>_<all|final|rows>_<dtype>`, `reduce_argmax_final`,
// `reduce_sum_cols_[unaligned_]<dtype>` -----------------------------------------------------------

macro_rules! reduce_kernels {
    ($T:ty, $sfx:ident) => {
        reduce_kernels!(@op $T, $sfx, sum, Sum);
        reduce_kernels!(@op $T, $sfx, max, Max);
        reduce_kernels!(@op $T, $sfx, min, Min);
        paste::paste! {
            $crate::kernel!([<reduce_argmax_all_ $sfx>]: ArgmaxPartArgs<$T> = |x, n, part_val, part_idx, out|
                argmax_part::<$T>(x, n, part_val, part_idx, out));
            $crate::kernel!([<reduce_argmax_rows_ $sfx>]: ArgmaxRowsArgs<$T> = |x, out, rows, cols|
                argmax_rows::<$T>(x, out, rows, cols));
            $crate::kernel!([<reduce_sum_cols_ $sfx>]: ReduceColsArgs<$T> = |x, partial, out, rows, cols, scale|
                reduce_cols::<$T, true>(x, partial, out, rows, cols, scale));
            $crate::kernel!([<reduce_sum_cols_unaligned_ $sfx>]: ReduceColsArgs<$T> =
                |x, partial, out, rows, cols, scale| reduce_cols::<$T, false>(x, partial, out, rows, cols, scale));
            #[cfg(not(target_arch = "nvptx64"))]
            impl ReduceElem for $T {
                const REDUCE: ReduceKernels<$T> = ReduceKernels {
                    sum: reduce_kernels!(@table $sfx, sum),
                    max: reduce_kernels!(@table $sfx, max),
                    min: reduce_kernels!(@table $sfx, min),
                    argmax_all: [<reduce_argmax_all_ $sfx>],
                    argmax_rows: [<reduce_argmax_rows_ $sfx>],
                    sum_cols: [<reduce_sum_cols_ $sfx>],
                    sum_cols_unaligned: [<reduce_sum_cols_unaligned_ $sfx>],
                };
            }
        }
    };
    (@table $sfx:ident, $op:ident) => {
        paste::paste! {
            ReduceOpKernels {
                all: [<reduce_ $op _all_ $sfx>],
                fin: [<reduce_ $op _final_ $sfx>],
                rows: [<reduce_ $op _rows_ $sfx>],
            }
        }
    };
    (@op $T:ty, $sfx:ident, $op:ident, $O:ident) => {
        paste::paste! {
            $crate::kernel!([<reduce_ $op _all_ $sfx>]: ReducePartArgs<$T> = |x, n, partial, out, scale|
                reduce_part::<$T, $O>(x, n, partial, out, scale));
            $crate::kernel!([<reduce_ $op _final_ $sfx>]: ReduceFinalArgs<$T> = |partial, parts, out, scale|
                reduce_final::<$T, $O>(partial, parts, out, scale));
            $crate::kernel!([<reduce_ $op _rows_ $sfx>]: ReduceRowsArgs<$T> = |x, out, rows, cols, scale|
                reduce_rows::<$T, $O>(x, out, rows, cols, scale));
        }
    };
}
crate::for_each_elem!(reduce_kernels);
// The partials are f32 whatever the input's dtype: one finishing kernel serves all three.
crate::kernel!(reduce_argmax_final: ArgmaxFinalArgs = |part_val, part_idx, parts, out|
    argmax_final(part_val, part_idx, parts, out));

/// The kernels of one value reduction (`reduce_<op>_<all|final|rows>_<dt>`) of one storage type
/// `T`, typed.
pub struct ReduceOpKernels<T: 'static> {
    /// Stage 1 over a whole tensor.
    pub all: Kernel<ReducePartArgs<T>>,
    /// Stage 2 over a whole tensor.
    pub fin: Kernel<ReduceFinalArgs<T>>,
    /// Along the last dimension.
    pub rows: Kernel<ReduceRowsArgs<T>>,
}

/// The family's kernels of one storage type `T`, typed; `reduce_argmax_final` serves every type.
pub struct ReduceKernels<T: 'static> {
    /// `reduce_sum_*` (the mean too, scaled).
    pub sum: ReduceOpKernels<T>,
    /// `reduce_max_*`.
    pub max: ReduceOpKernels<T>,
    /// `reduce_min_*`.
    pub min: ReduceOpKernels<T>,
    /// `reduce_argmax_all_<dt>`.
    pub argmax_all: Kernel<ArgmaxPartArgs<T>>,
    /// `reduce_argmax_rows_<dt>`.
    pub argmax_rows: Kernel<ArgmaxRowsArgs<T>>,
    /// `reduce_sum_cols_<dt>`: rows of whole 16-byte vectors.
    pub sum_cols: Kernel<ReduceColsArgs<T>>,
    /// `reduce_sum_cols_unaligned_<dt>`.
    pub sum_cols_unaligned: Kernel<ReduceColsArgs<T>>,
}

/// A storage type's reduction kernels (set by the declaration above).
pub trait ReduceElem: crate::Elem {
    /// The kernels of `Self`.
    const REDUCE: ReduceKernels<Self>;
}

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
    use crate::dtype::{BF16, F16};
    use crate::kernel::{KernelEntry, Params};
    fn entries<T: ReduceElem>() -> [KernelEntry; 13]
    where
        ReducePartArgs<T>: Params,
        ReduceFinalArgs<T>: Params,
        ReduceRowsArgs<T>: Params,
        ArgmaxPartArgs<T>: Params,
        ArgmaxRowsArgs<T>: Params,
        ReduceColsArgs<T>: Params,
    {
        let k = T::REDUCE;
        let op = |o: &ReduceOpKernels<T>| [o.all.entry(), o.fin.entry(), o.rows.entry()];
        let ([s0, s1, s2], [x0, x1, x2], [n0, n1, n2]) = (op(&k.sum), op(&k.max), op(&k.min));
        [
            s0,
            s1,
            s2,
            x0,
            x1,
            x2,
            n0,
            n1,
            n2,
            k.argmax_all.entry(),
            k.argmax_rows.entry(),
            k.sum_cols.entry(),
            k.sum_cols_unaligned.entry(),
        ]
    }
    [entries::<f32>(), entries::<F16>(), entries::<BF16>()]
        .into_iter()
        .flatten()
        .chain(core::iter::once(reduce_argmax_final.entry()))
}
