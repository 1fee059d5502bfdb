//! Cross-entropy over class indices, fused with the log-softmax, as PyTorch's `F.cross_entropy`
//! with `ignore_index` and `label_smoothing` (eps):
//!
//! ```text
//! lse = log sum_c exp(x_c)                      (with the max subtracted, online)
//! loss = lse - (1 - eps) x_t - (eps / C) sum_c x_c        (0 for a row whose target is ignored)
//! dloss/dx_c = exp(x_c - lse) - eps / C - (1 - eps) [c == t]
//! ```
//!
//! Memory pattern: the forward reads each row twice (its max and sum, then the sum of exp(x -
//! max)), the second time from L2 as a rule, and writes one float per row; it never
//! materialises the log-softmax, which is what PyTorch's two-kernel path writes and reads back.
//! The backward reads the logits once more and writes the gradient: three passes over `[N, C]`
//! from memory in all, against PyTorch's five. Rows reduce by `rows.rs`'s streaming pattern.
//!
//! A target outside `[0, C)` that is not `ignore_index` gives a NaN loss and records its row in
//! `bad` (`row + 1`; any one such row when there are several), which the host checks.

use crate::kernel::{Kernel, KernelEntry, Params};

/// `(logits, target, loss, loss_out, lse, bad, rows, cols, ignore_index, smoothing)`: per-row
/// `loss` (f32) and `lse` (f32), and `loss_out` (the logits' dtype; null unless the reduction is
/// `none`); `bad` a single u64.
pub type CrossEntropyFwdArgs<T> = (*const T, *const i64, *mut f32, *mut T, *mut f32, *mut u64, u64, u64, i64, f32);
/// `(logits, target, lse, grad, count, gx, rows, cols, ignore_index, smoothing, mode)`: `grad`
/// is the loss's gradient, one per row (`mode` [`MODE_NONE`]) or one for all (`MODE_SUM`,
/// `MODE_MEAN`, which divides it by `count[0]`, the number of rows not ignored).
pub type CrossEntropyBwdArgs<T> =
    (*const T, *const i64, *const f32, *const T, *const f32, *mut T, u64, u64, i64, f32, u32);
/// `(loss, target, out, count, rows, ignore_index, mode)`: one block adds the per-row losses of
/// the rows not ignored, in a fixed order, into `out[0]` (divided by their count for
/// `MODE_MEAN`) and writes the count (f32) to `count[0]`.
pub type CrossEntropyReduceArgs<T> = (*const f32, *const i64, *mut T, *mut f32, u64, i64, u32);
/// `(x, gx, target, grad, count, loss, loss_out, bad, rows, cols, ignore_index, smoothing, z_loss,
/// grad_scale, mode)` of the one-pass kernel: reads the logits `x` once from memory and writes
/// the per-row `loss` (f32, with `z_loss * lse^2` added; also in the logits' dtype to `loss_out`
/// unless it is null, for the reduction `none`) and the logits' gradient `gx` (which may be `x` itself: in place), already multiplied by the loss's
/// gradient: `grad_scale`, times `grad[row]` where `grad` is not null (reduction `none`), divided
/// by `count[0]` (the rows not ignored, from `cross_entropy_count`) for `MODE_MEAN`. `bad` as
/// the forward's.
pub type CrossEntropyOnePassArgs<T> =
    (*const T, *mut T, *const i64, *const T, *const f32, *mut f32, *mut T, *mut u64, u64, u64, i64, f32, f32, f32, u32);
/// `(target, count, rows, ignore_index)`: one block writes the number of rows not ignored (f32)
/// to `count[0]`, before the one-pass kernel needs it for the mean.
pub type CrossEntropyCountArgs = (*const i64, *mut f32, u64, i64);

/// `mode` of `cross_entropy_reduce`: no reduction (the kernel is not launched for it).
pub const MODE_NONE: u32 = 0;
/// `mode`: the sum of the rows' losses.
pub const MODE_SUM: u32 = 1;
/// `mode`: their mean over the rows not ignored.
pub const MODE_MEAN: u32 = 2;
/// Threads of the one block of `cross_entropy_reduce`.
pub const REDUCE_THREADS: u32 = 1024;

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::{Elem, for_lanes};
    use crate::fastmath::{exp, exp_for, log};
    use crate::prim::*;
    use crate::rows::*;

    #[inline(always)]
    fn offset(m: f32) -> f32 {
        if m == f32::NEG_INFINITY { 0.0 } else { m }
    }

    #[inline(always)]
    fn max_add(a: [f32; 2], b: [f32; 2]) -> [f32; 2] {
        [nan_max(a[0], b[0]), a[1] + b[1]]
    }

    #[inline(always)]
    fn add1(a: [f32; 1], b: [f32; 1]) -> [f32; 1] {
        [a[0] + b[0]]
    }

    #[allow(clippy::too_many_arguments)]
    pub unsafe fn fwd<T: Elem>(
        x: *const T,
        target: *const i64,
        loss: *mut f32,
        loss_out: *mut T,
        lse: *mut f32,
        bad: *mut u64,
        rows: u64,
        cols: u64,
        ignore: i64,
        eps: f32,
    ) {
        let g = Group::this();
        g.for_each_row(
            rows,
            #[inline(always)]
            |row| {
                let ok = row < rows;
                let off = if ok { (row * cols) as usize } else { 0 };
                // SAFETY: every index below is < cols within row `row`.
                let xr = unsafe { x.add(off) };
                let sp = if ok { RowSplit::of(xr, cols) } else { RowSplit { head: 0, nvec: 0, cols: 0 } };
                // Two passes: the max and the sum of the logits, then the sum of exp(x - max) (the
                // row again, from L2 as a rule: the group has just read it). One `exp` per element,
                // where a single online pass rescales its running sum at every chunk.
                let load = #[inline(always)]
                |c: u64| unsafe { T::unpack(ld_global_nc_v4(xr.add(c as usize) as *const u32)) };
                let one = #[inline(always)]
                |c: u64| unsafe { (*xr.add(c as usize)).to_f32() };
                let st = fold_row(
                    sp,
                    T::VEC as u64,
                    &g,
                    [f32::NEG_INFINITY, 0.0],
                    load,
                    #[inline(always)]
                    |mut acc, _, v| {
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| acc = [nan_max(acc[0], v[k]), acc[1] + v[k]],
                        );
                        acc
                    },
                    #[inline(always)]
                    |acc, c| [nan_max(acc[0], one(c)), acc[1] + one(c)],
                );
                let [m, sx] = group_reduce(&g, st, [f32::NEG_INFINITY, 0.0], max_add);
                let o = offset(m);
                let s = fold_row(
                    sp,
                    T::VEC as u64,
                    &g,
                    0.0f32,
                    load,
                    #[inline(always)]
                    |mut acc, _, v| {
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| acc += exp_for::<T>(v[k] - o),
                        );
                        acc
                    },
                    #[inline(always)]
                    |acc, c| acc + exp_for::<T>(one(c) - o),
                );
                let [s] = group_reduce(&g, [s], [0.0], add1);
                if ok && g.t == 0 {
                    let l = o + log(s);
                    // SAFETY: row < rows: target, loss, lse hold `rows` entries; the target is
                    // checked against [0, cols) before it indexes the row.
                    unsafe {
                        let t = *target.add(row as usize);
                        let v = if t == ignore {
                            0.0
                        } else if t < 0 || t as u64 >= cols {
                            *bad = row + 1;
                            f32::NAN
                        } else {
                            let xt = (*xr.add(t as usize)).to_f32();
                            // Without smoothing the spread term is left out, not multiplied
                            // by 0: a -inf logit (a masked class) makes `sx` -inf.
                            let spread = if eps == 0.0 { 0.0 } else { (eps / cols as f32) * sx };
                            l - (1.0 - eps) * xt - spread
                        };
                        *loss.add(row as usize) = v;
                        *lse.add(row as usize) = l;
                        if !loss_out.is_null() {
                            *loss_out.add(row as usize) = T::from_f32(v);
                        }
                    }
                }
            },
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub unsafe fn bwd<T: Elem>(
        x: *const T,
        target: *const i64,
        lse: *const f32,
        grad: *const T,
        count: *const f32,
        gx: *mut T,
        rows: u64,
        cols: u64,
        ignore: i64,
        eps: f32,
        mode: u32,
    ) {
        let g = Group::this();
        let smooth = eps / cols as f32;
        g.for_each_row(
            rows,
            #[inline(always)]
            |row| {
                if row < rows {
                    let off = (row * cols) as usize;
                    // SAFETY: row < rows; grad holds `rows` entries (none) or one; count one.
                    let (t, l, gn) = unsafe {
                        let t = *target.add(row as usize);
                        let gn = match mode {
                            MODE_NONE => (*grad.add(row as usize)).to_f32(),
                            MODE_SUM => (*grad).to_f32(),
                            _ => (*grad).to_f32() / *count,
                        };
                        (t, *lse.add(row as usize), if t == ignore { 0.0 } else { gn })
                    };
                    let d = |x: f32, c: u64| {
                        if gn == 0.0 {
                            return 0.0;
                        }
                        let hot = if c as i64 == t { 1.0 - eps } else { 0.0 };
                        gn * (exp_for::<T>(x - l) - smooth - hot)
                    };
                    // SAFETY: indices below are < cols within row `row`.
                    let (xr, gxr) = unsafe { (x.add(off), gx.add(off)) };
                    let sp = RowSplit::of(xr, cols);
                    fold_row(
                        sp,
                        T::VEC as u64,
                        &g,
                        (),
                        #[inline(always)]
                        |c| unsafe { T::unpack(ld_global_nc_v4(xr.add(c as usize) as *const u32)) },
                        #[inline(always)]
                        |(), c, mut v| {
                            for_lanes::<T>(
                                #[inline(always)]
                                |k| v[k] = d(v[k], c + k as u64),
                            );
                            unsafe { st_global_v4(gxr.add(c as usize) as *mut u32, T::pack(&v)) };
                        },
                        #[inline(always)]
                        |(), c| unsafe {
                            *gxr.add(c as usize) = T::from_f32(d((*xr.add(c as usize)).to_f32(), c));
                        },
                    );
                }
            },
        );
    }

    #[inline(always)]
    fn add2(a: [f32; 2], b: [f32; 2]) -> [f32; 2] {
        [a[0] + b[0], a[1] + b[1]]
    }

    pub unsafe fn reduce<T: Elem>(
        loss: *const f32,
        target: *const i64,
        out: *mut T,
        count: *mut f32,
        rows: u64,
        ignore: i64,
        mode: u32,
    ) {
        let g = Group::this();
        let mut acc = [0.0f32; 2];
        let mut r = g.t as u64;
        while r < rows {
            // SAFETY: r < rows.
            unsafe {
                if *target.add(r as usize) != ignore {
                    acc[0] += *loss.add(r as usize);
                    acc[1] += 1.0;
                }
            }
            r += g.size as u64;
        }
        let [s, n] = group_reduce(&g, acc, [0.0; 2], add2);
        if g.t == 0 {
            // SAFETY: out and count hold one element each. The mean of no rows is NaN (0 / 0), as
            // in PyTorch.
            unsafe {
                *out = T::from_f32(if mode == MODE_MEAN { s / n } else { s });
                *count = n;
            }
        }
    }

    /// Merges two `(max, sum of exp(x - max), sum of x, x_target)` partials of a row.
    #[inline(always)]
    fn merge4(a: [f32; 4], b: [f32; 4]) -> [f32; 4] {
        let m = nan_max(a[0], b[0]);
        let o = offset(m);
        [m, a[1] * exp(a[0] - o) + b[1] * exp(b[0] - o), a[2] + b[2], a[3] + b[3]]
    }

    /// Adds `n` values `v[..n]` (columns `c..c + n`) to a thread's running `(max, sum exp, sum,
    /// x_target)`: the sum is rescaled once per chunk, and only when the max moved (exactly 1
    /// otherwise), so a chunk costs one `exp` per value. The target's value is summed (it is
    /// in one thread's chunk, zero in every other's), so no thread reads another's element.
    #[inline(always)]
    fn add_chunk<T: Elem>(acc: [f32; 4], v: &[f32; 8], n: usize, c: u64, t: i64) -> [f32; 4] {
        let mut cm = f32::NEG_INFINITY;
        let mut sx = acc[2];
        for_lanes::<T>(
            #[inline(always)]
            |k| {
                if k < n {
                    cm = nan_max(cm, v[k]);
                    sx += v[k];
                }
            },
        );
        let m = nan_max(acc[0], cm);
        let o = offset(m);
        // A NaN max compares unequal and poisons the sum through exp(NaN).
        let mut s = if m == acc[0] { acc[1] } else { acc[1] * exp(acc[0] - o) };
        for_lanes::<T>(
            #[inline(always)]
            |k| {
                if k < n {
                    s += exp_for::<T>(v[k] - o);
                }
            },
        );
        let mut xt = acc[3];
        let k = t.wrapping_sub(c as i64);
        if k >= 0 && (k as usize) < n {
            // One lane of the chunk: the index is a variable, so pick it without indexing
            // `v` dynamically (which would spill it to local memory).
            for_lanes::<T>(
                #[inline(always)]
                |j| {
                    if j as i64 == k {
                        xt += v[j];
                    }
                },
            );
        }
        [m, s, sx, xt]
    }

    /// Visits the elements `fold_row` gives this thread, the vectors from the row's end back
    /// (two loads in flight): a second sweep then starts on what the first read last, the part
    /// of the row most likely still in L1.
    #[inline(always)]
    fn for_row_rev<L: Copy>(
        sp: RowSplit,
        vec_w: u64,
        g: &Group,
        load: impl Fn(u64) -> L,
        vector: impl Fn(u64, L),
        scalar: impl Fn(u64),
    ) {
        let t = g.t as u64;
        let step = g.size as u64;
        let mut tail = sp.head + sp.nvec * vec_w + t;
        while tail < sp.cols {
            scalar(tail);
            tail += step;
        }
        if t < sp.nvec {
            // This thread's last vector; every j below is t modulo step, so j >= t.
            let mut j = t + (sp.nvec - 1 - t) / step * step;
            loop {
                if j >= t + step {
                    let (c0, c1) = (sp.head + j * vec_w, sp.head + (j - step) * vec_w);
                    let (a, b) = (load(c0), load(c1));
                    vector(c0, a);
                    vector(c1, b);
                    if j < t + 2 * step {
                        break;
                    }
                    j -= 2 * step;
                } else {
                    let c = sp.head + j * vec_w;
                    vector(c, load(c));
                    break;
                }
            }
        }
        let mut h = t;
        while h < sp.head {
            scalar(h);
            h += step;
        }
    }

    /// The one-pass kernel: per row, one sweep that keeps `(max, sum exp, sum x, x_target)`
    /// online, one group reduction, then a second sweep over the same row, backwards (from L1
    /// and L2: the group has just read it, and the host bounds the rows in flight), that writes
    /// the gradient. Each element is read and written by the same thread in both sweeps, so `gx`
    /// may be `x` (loads are coherent, not `.nc`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn one_pass<T: Elem>(
        x: *const T,
        gx: *mut T,
        target: *const i64,
        grad: *const T,
        count: *const f32,
        loss: *mut f32,
        loss_out: *mut T,
        bad: *mut u64,
        rows: u64,
        cols: u64,
        ignore: i64,
        eps: f32,
        z: f32,
        gscale: f32,
        mode: u32,
    ) {
        let g = Group::this();
        let smooth = eps / cols as f32;
        g.for_each_row(
            rows,
            #[inline(always)]
            |row| {
                let ok = row < rows;
                let off = if ok { (row * cols) as usize } else { 0 };
                // SAFETY: row < rows where it is read; target holds `rows` entries.
                let t = if ok { unsafe { *target.add(row as usize) } } else { ignore };
                let valid = ok && t != ignore && t >= 0 && (t as u64) < cols;
                // The target's column, or none (-1) for an ignored or out-of-range target.
                let tc = if valid { t } else { -1 };
                // SAFETY: every index below is < cols within row `row`.
                let (xr, gxr) = unsafe { (x.add(off), gx.add(off)) };
                let sp = if ok { RowSplit::of(xr, cols) } else { RowSplit { head: 0, nvec: 0, cols: 0 } };
                let one = #[inline(always)]
                |c: u64| unsafe { (*xr.add(c as usize)).to_f32() };
                let st = fold_row(
                    sp,
                    T::VEC as u64,
                    &g,
                    [f32::NEG_INFINITY, 0.0, 0.0, 0.0],
                    #[inline(always)]
                    |c: u64| unsafe { T::unpack(ld_global_v4(xr.add(c as usize) as *const u32)) },
                    #[inline(always)]
                    |acc, c, v| add_chunk::<T>(acc, &v, T::VEC, c, tc),
                    #[inline(always)]
                    |acc, c| {
                        let mut v = [0.0f32; 8];
                        v[0] = one(c);
                        add_chunk::<T>(acc, &v, 1, c, tc)
                    },
                );
                let [m, s, sx, xt] = group_reduce(&g, st, [f32::NEG_INFINITY, 0.0, 0.0, 0.0], merge4);
                let l = offset(m) + log(s);
                // The loss's gradient for this row, 0 for an ignored (or out-of-range) one.
                // SAFETY: grad holds `rows` entries where it is not null; count one.
                let gn = if !valid {
                    0.0
                } else {
                    let per_row = if grad.is_null() { 1.0 } else { unsafe { (*grad.add(row as usize)).to_f32() } };
                    let gn = gscale * per_row;
                    if mode == MODE_MEAN { gn / unsafe { *count } } else { gn }
                };
                if ok && g.t == 0 {
                    let v = if t == ignore {
                        0.0
                    } else if !valid {
                        // SAFETY: bad holds one u64.
                        unsafe { *bad = row + 1 };
                        f32::NAN
                    } else {
                        // Terms whose factor is 0 are left out: 0 * inf would make a row with
                        // a -inf logit (a masked class) NaN.
                        let hot = if eps == 1.0 { 0.0 } else { (1.0 - eps) * xt };
                        let spread = if eps == 0.0 { 0.0 } else { smooth * sx };
                        let zl = if z == 0.0 { 0.0 } else { z * l * l };
                        l - hot - spread + zl
                    };
                    // SAFETY: row < rows; loss holds `rows` entries, loss_out too where not null.
                    unsafe {
                        *loss.add(row as usize) = v;
                        if !loss_out.is_null() {
                            *loss_out.add(row as usize) = T::from_f32(v);
                        }
                    }
                }
                // d/dx_c of lse + z lse^2 is p_c (1 + 2 z lse).
                let pz = if z == 0.0 { 1.0 } else { 1.0 + 2.0 * z * l };
                let d = #[inline(always)]
                |x: f32, c: u64| {
                    if gn == 0.0 {
                        return 0.0;
                    }
                    let hot = if c as i64 == tc { 1.0 - eps } else { 0.0 };
                    gn * (exp_for::<T>(x - l) * pz - smooth - hot)
                };
                for_row_rev(
                    sp,
                    T::VEC as u64,
                    &g,
                    #[inline(always)]
                    |c| unsafe { T::unpack(ld_global_v4(xr.add(c as usize) as *const u32)) },
                    #[inline(always)]
                    |c, mut v| {
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| v[k] = d(v[k], c + k as u64),
                        );
                        unsafe { st_global_v4(gxr.add(c as usize) as *mut u32, T::pack(&v)) };
                    },
                    #[inline(always)]
                    |c| unsafe {
                        *gxr.add(c as usize) = T::from_f32(d(one(c), c));
                    },
                );
            },
        );
    }

    /// The number of rows not ignored, as `reduce` counts them.
    pub unsafe fn count_rows(target: *const i64, count: *mut f32, rows: u64, ignore: i64) {
        let g = Group::this();
        let mut n = 0.0f32;
        let mut r = g.t as u64;
        while r < rows {
            // SAFETY: r < rows.
            if unsafe { *target.add(r as usize) } != ignore {
                n += 1.0;
            }
            r += g.size as u64;
        }
        let [n] = group_reduce(&g, [n], [0.0], add1);
        if g.t == 0 {
            // SAFETY: count holds one element.
            unsafe { *count = n };
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

macro_rules! ce_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<cross_entropy_fwd_ $sfx>]: CrossEntropyFwdArgs<$T> =
                |x, target, loss, loss_out, lse, bad, rows, cols, ignore, eps|
                fwd::<$T>(x, target, loss, loss_out, lse, bad, rows, cols, ignore, eps));
            $crate::kernel!([<cross_entropy_bwd_ $sfx>]: CrossEntropyBwdArgs<$T> =
                |x, target, lse, grad, count, gx, rows, cols, ignore, eps, mode|
                bwd::<$T>(x, target, lse, grad, count, gx, rows, cols, ignore, eps, mode));
            $crate::kernel!([<cross_entropy_reduce_ $sfx>]: CrossEntropyReduceArgs<$T> =
                |loss, target, out, count, rows, ignore, mode|
                reduce::<$T>(loss, target, out, count, rows, ignore, mode));
            $crate::kernel!([<cross_entropy_one_pass_ $sfx>]: CrossEntropyOnePassArgs<$T> =
                |x, gx, target, grad, count, loss, loss_out, bad, rows, cols, ignore, eps, z, gscale, mode|
                one_pass::<$T>(x, gx, target, grad, count, loss, loss_out, bad, rows, cols, ignore, eps, z, gscale, mode));
            #[cfg(not(target_arch = "nvptx64"))]
            impl CrossEntropyElem for $T {
                const CROSS_ENTROPY: CrossEntropyKernels<$T> = CrossEntropyKernels {
                    fwd: [<cross_entropy_fwd_ $sfx>],
                    bwd: [<cross_entropy_bwd_ $sfx>],
                    reduce: [<cross_entropy_reduce_ $sfx>],
                    one_pass: [<cross_entropy_one_pass_ $sfx>],
                };
            }
        }
    };
}
crate::for_each_elem!(ce_kernels);
crate::kernel!(cross_entropy_count: CrossEntropyCountArgs = |target, count, rows, ignore| count_rows(target, count, rows, ignore));

/// The family's kernels of one storage type `T`, typed.
pub struct CrossEntropyKernels<T: 'static> {
    /// `cross_entropy_fwd_<dt>`.
    pub fwd: Kernel<CrossEntropyFwdArgs<T>>,
    /// `cross_entropy_bwd_<dt>`.
    pub bwd: Kernel<CrossEntropyBwdArgs<T>>,
    /// `cross_entropy_reduce_<dt>`.
    pub reduce: Kernel<CrossEntropyReduceArgs<T>>,
    /// `cross_entropy_one_pass_<dt>`.
    pub one_pass: Kernel<CrossEntropyOnePassArgs<T>>,
}

impl<T: 'static> CrossEntropyKernels<T>
where
    CrossEntropyFwdArgs<T>: Params,
    CrossEntropyBwdArgs<T>: Params,
    CrossEntropyReduceArgs<T>: Params,
    CrossEntropyOnePassArgs<T>: Params,
{
    /// Every kernel's name and arity.
    pub fn entries(&self) -> [KernelEntry; 4] {
        [self.fwd.entry(), self.bwd.entry(), self.reduce.entry(), self.one_pass.entry()]
    }
}

/// A storage type's cross-entropy kernels.
pub trait CrossEntropyElem: crate::Elem {
    /// The kernels of `Self`.
    const CROSS_ENTROPY: CrossEntropyKernels<Self>;
}

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    use crate::dtype::{BF16, F16};
    [f32::CROSS_ENTROPY.entries(), F16::CROSS_ENTROPY.entries(), BF16::CROSS_ENTROPY.entries()]
        .into_iter()
        .flatten()
        .chain([cross_entropy_count.entry()])
}
