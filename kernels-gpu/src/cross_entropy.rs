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
    use crate::fastmath::{exp_for, log};
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
                            l - (1.0 - eps) * xt - (eps / cols as f32) * sx
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
            #[cfg(not(target_arch = "nvptx64"))]
            impl CrossEntropyElem for $T {
                const CROSS_ENTROPY: CrossEntropyKernels<$T> = CrossEntropyKernels {
                    fwd: [<cross_entropy_fwd_ $sfx>],
                    bwd: [<cross_entropy_bwd_ $sfx>],
                    reduce: [<cross_entropy_reduce_ $sfx>],
                };
            }
        }
    };
}
crate::for_each_elem!(ce_kernels);

/// The family's kernels of one storage type `T`, typed.
pub struct CrossEntropyKernels<T: 'static> {
    /// `cross_entropy_fwd_<dt>`.
    pub fwd: Kernel<CrossEntropyFwdArgs<T>>,
    /// `cross_entropy_bwd_<dt>`.
    pub bwd: Kernel<CrossEntropyBwdArgs<T>>,
    /// `cross_entropy_reduce_<dt>`.
    pub reduce: Kernel<CrossEntropyReduceArgs<T>>,
}

impl<T: 'static> CrossEntropyKernels<T>
where
    CrossEntropyFwdArgs<T>: Params,
    CrossEntropyBwdArgs<T>: Params,
    CrossEntropyReduceArgs<T>: Params,
{
    /// Every kernel's name and arity.
    pub fn entries(&self) -> [KernelEntry; 3] {
        [self.fwd.entry(), self.bwd.entry(), self.reduce.entry()]
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
    [f32::CROSS_ENTROPY.entries(), F16::CROSS_ENTROPY.entries(), BF16::CROSS_ENTROPY.entries()].into_iter().flatten()
}
