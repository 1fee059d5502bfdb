//! Softmax and log-softmax along the last dimension, forward and backward.
//!
//! ```text
//! softmax:      y = exp(x - m) / s                 m = max(x), s = sum exp(x - m)
//! log_softmax:  y = (x - m) - log(s)
//! backward:     gx = y * (g - sum(g * y))          (softmax, from its output y)
//!               gx = g - exp(y) * sum(g)           (log_softmax, from its output y)
//! ```
//!
//! Memory pattern: one read and one write of the row, the minimum, when the row fits in the
//! registers of a group (`*_v{1,2,4,8}` kernels, and `*_u{1,2,4}` for rows of any length,
//! see `rows.rs`); otherwise a streaming kernel
//! that reads the row twice (the second time mostly from L2) with an *online* max and sum
//! (Milakov and Gimelshein, 2018), so a row of any length is one pass of reductions.
//!
//! Each thread first reduces its own values to a pair `(m, s)` (the sum taken relative to its
//! own max), and the group merges pairs once: `s = s1 e^(m1 - m) + s2 e^(m2 - m)`. One group
//! reduction per row instead of two (max, then sum) halves the barriers on long rows.
//!
//! IEEE cases follow PyTorch: a NaN anywhere in a row makes the row NaN (max propagates NaN);
//! a row of all `-inf` is NaN (`exp(-inf - -inf)`); `+inf` makes the row NaN.

use crate::kernel::{KernelEntry, Params};
use crate::rows::RowKernels;
#[cfg(not(target_arch = "nvptx64"))]
use crate::rows::RowVariant;

/// `(x, y, rows, cols)`: `y = softmax(x)` over rows of `cols` elements.
pub type SoftmaxFwdArgs<T> = (*const T, *mut T, u64, u64);
/// `(y, g, gx, rows, cols)`: the gradient of the input from the forward's output `y` and the
/// output's gradient `g`. `gx` aliases neither input.
pub type SoftmaxBwdArgs<T> = (*const T, *const T, *mut T, u64, u64);

#[cfg(target_arch = "nvptx64")]
mod device {
    use crate::dtype::{Elem, for_lanes};
    use crate::fastmath::{exp, exp_for, log};
    use crate::math::recip;
    use crate::prim::*;
    use crate::rows::*;

    /// Which of the two.
    pub trait Kind {
        const LOG: bool;
    }
    pub struct Softmax;
    pub struct LogSoftmax;
    impl Kind for Softmax {
        const LOG: bool = false;
    }
    impl Kind for LogSoftmax {
        const LOG: bool = true;
    }

    /// The max used as the exponent's offset: 0 for a max of `-inf` (an empty or all `-inf`
    /// part), so that its terms are `exp(-inf) = 0` and not `exp(NaN)`.
    #[inline(always)]
    fn offset(m: f32) -> f32 {
        if m == f32::NEG_INFINITY { 0.0 } else { m }
    }

    /// Merges two `(max, sum of exp(x - max))` pairs.
    #[inline(always)]
    fn merge(a: [f32; 2], b: [f32; 2]) -> [f32; 2] {
        let m = nan_max(a[0], b[0]);
        let o = offset(m);
        [m, a[1] * exp(a[0] - o) + b[1] * exp(b[0] - o)]
    }

    /// Adds a chunk of values (`v[..n]`, `n <= 8`) to a thread's running pair.
    #[inline(always)]
    fn add_chunk<T: Elem>(acc: [f32; 2], v: &[f32; 8], n: usize) -> [f32; 2] {
        let mut cm = f32::NEG_INFINITY;
        for_lanes::<T>(
            #[inline(always)]
            |k| {
                if k < n {
                    cm = nan_max(cm, v[k]);
                }
            },
        );
        let m = nan_max(acc[0], cm);
        let o = offset(m);
        let mut s = acc[1] * exp(acc[0] - o);
        for_lanes::<T>(
            #[inline(always)]
            |k| {
                if k < n {
                    s += exp_for::<T>(v[k] - o);
                }
            },
        );
        [m, s]
    }

    /// The output for `x` given the row's merged pair.
    #[inline(always)]
    fn out<T: Elem, S: Kind>(x: f32, o: f32, inv_s: f32, log_s: f32) -> f32 {
        if S::LOG { (x - o) - log_s } else { exp_for::<T>(x - o) * inv_s }
    }

    /// `(offset, 1/s, log s)` of a row's pair.
    #[inline(always)]
    fn finish(p: [f32; 2]) -> (f32, f32, f32) {
        // A NaN or +inf max must poison the row; `offset` keeps both. `recip` is `1 / s` bit
        // for bit (s >= 1: the max's own term), without `rcp.rn`'s branch to a slow path. A row
        // of all -inf has s = 0: recip gives NaN, and the outputs are NaN as `0 * (1 / 0)` were.
        (offset(p[0]), recip(p[1]), log(p[1]))
    }

    /// Register-resident forward; with `U`, over rows of any length (`rows::RowSpan`), the
    /// lanes outside the row loaded as `-inf` (no term of the max or the sum).
    pub unsafe fn fwd_reg<T: Elem, S: Kind, const V: usize, const U: bool>(
        x: *const T,
        y: *mut T,
        rows: u64,
        cols: u64,
    ) {
        let g = Group::this();
        let row = g.first_row();
        let ok = row < rows;
        let mut red = RowReducer::<1>::new(&g);
        let off = if ok { (row * cols) as usize } else { 0 };
        // SAFETY: inside the tensor (row < rows, or the first row).
        let sp = RowSpan::<U>::of(unsafe { x.add(off) }, cols, ok);
        let nvec = sp.nvec;
        // The aligned run's start: the row's, without `U` (rows of whole vectors, host-checked).
        let off = off - sp.lead as usize;
        let fill = if U { T::pack(&[f32::NEG_INFINITY; 8])[0] } else { 0 };
        // SAFETY: x.add(off) is 16-byte aligned (every tensor starts so) and the run holds the row.
        let raw = unsafe { load_span::<T, V, U>(x.add(off), sp, &g, fill) };
        // The row is in registers, so its max can come first: two cheap reductions (max, then
        // sum) and one `exp` per element, where a single reduction of (max, sum) pairs costs
        // two `exp` per merge and a rescaling per chunk.
        let mut m = f32::NEG_INFINITY;
        for_slots::<V>(
            #[inline(always)]
            |s| {
                if slot_present(&g, s, nvec, ok) {
                    let v = T::unpack(raw[s]);
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| m = nan_max(m, v[k]),
                    );
                }
            },
        );
        let [m] = red.reduce(&g, [m], [f32::NEG_INFINITY], max1);
        let o = offset(m);
        // f32 softmax keeps e = exp(x - o) where x was (the same registers; the output is then
        // e / s with e bit for bit what recomputing it gives). Recomputing the exp in the output
        // pass made this kernel compute-bound at 4096 x 32768: ncu counted more than twice RMS norm's
        // instructions issued per cycle and scheduler, and it ran behind RMS norm (docs/worklog.md).
        // Not for f16/bf16 (e would be rounded to the storage type) nor for log-softmax (whose output
        // needs x).
        let keep = T::DTYPE == crate::DType::F32 && !S::LOG;
        let mut raw = raw;
        let mut sum = 0.0f32;
        for_slots::<V>(
            #[inline(always)]
            |s| {
                if slot_present(&g, s, nvec, ok) {
                    let mut v = T::unpack(opaque(raw[s]));
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| {
                            v[k] = exp_for::<T>(v[k] - o);
                            sum += v[k];
                        },
                    );
                    if keep {
                        raw[s] = T::pack(&v);
                    }
                }
            },
        );
        let [sum] = red.reduce(&g, [sum], [0.0], add);
        // With m NaN or +inf, o keeps it and every output is NaN, as in PyTorch.
        let (o, inv_s, log_s) = (o, recip(sum), log(sum));
        for_slots::<V>(
            #[inline(always)]
            |s| {
                if slot_present(&g, s, nvec, ok) {
                    // Unpacked again from the packed registers (see `prim::opaque`).
                    let mut v = T::unpack(opaque(raw[s]));
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| v[k] = if keep { v[k] * inv_s } else { out::<T, S>(v[k], o, inv_s, log_s) },
                    );
                    let j = slot_col::<T>(&g, s) / T::VEC as u64;
                    // SAFETY: the slot's vector holds elements of row `row` of y (x's shape), and
                    // only those are stored.
                    unsafe { store_span::<T, U>(y.add(off + slot_col::<T>(&g, s) as usize), sp, j, T::pack(&v)) };
                }
            },
        );
        red.finish();
    }

    pub unsafe fn fwd_stream<T: Elem, S: Kind>(x: *const T, y: *mut T, rows: u64, cols: u64) {
        let g = Group::this();
        g.for_each_row(
            rows,
            #[inline(always)]
            |row| {
                let ok = row < rows;
                let off = if ok { (row * cols) as usize } else { 0 };
                // SAFETY: every element index below is below cols within row `row`.
                let (xr, yr) = unsafe { (x.add(off), y.add(off)) };
                let sp = if ok { RowSplit::of(xr, cols) } else { RowSplit { head: 0, nvec: 0, cols: 0 } };
                let w = T::VEC as u64;
                let acc = fold_row(
                    sp,
                    w,
                    &g,
                    [f32::NEG_INFINITY, 0.0],
                    #[inline(always)]
                    |c| unsafe { T::unpack(ld_global_nc_v4(xr.add(c as usize) as *const u32)) },
                    #[inline(always)]
                    |acc, _, v| add_chunk::<T>(acc, &v, T::VEC),
                    #[inline(always)]
                    |acc, c| {
                        let mut v = [0.0; 8];
                        v[0] = unsafe { (*xr.add(c as usize)).to_f32() };
                        add_chunk::<T>(acc, &v, 1)
                    },
                );
                let acc = group_reduce(&g, acc, [f32::NEG_INFINITY, 0.0], merge);
                let (o, inv_s, log_s) = finish(acc);
                fold_row(
                    sp,
                    w,
                    &g,
                    (),
                    #[inline(always)]
                    |c| unsafe { T::unpack(ld_global_nc_v4(xr.add(c as usize) as *const u32)) },
                    #[inline(always)]
                    |(), c, mut v| {
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| v[k] = out::<T, S>(v[k], o, inv_s, log_s),
                        );
                        unsafe { st_global_v4(yr.add(c as usize) as *mut u32, T::pack(&v)) };
                    },
                    #[inline(always)]
                    |(), c| unsafe {
                        let v = (*xr.add(c as usize)).to_f32();
                        *yr.add(c as usize) = T::from_f32(out::<T, S>(v, o, inv_s, log_s));
                    },
                );
            },
        );
    }

    /// The per-element term of the backward's row sum: `g * y` (softmax) or `g` (log).
    #[inline(always)]
    fn bwd_term<S: Kind>(y: f32, g: f32) -> f32 {
        if S::LOG { g } else { g * y }
    }

    #[inline(always)]
    fn bwd_out<T: Elem, S: Kind>(y: f32, g: f32, dot: f32) -> f32 {
        if S::LOG { g - exp_for::<T>(y) * dot } else { y * (g - dot) }
    }

    #[inline(always)]
    fn add(a: [f32; 1], b: [f32; 1]) -> [f32; 1] {
        [a[0] + b[0]]
    }

    #[inline(always)]
    fn max1(a: [f32; 1], b: [f32; 1]) -> [f32; 1] {
        [nan_max(a[0], b[0])]
    }

    /// Register-resident backward: one group per row (`C = 1`), or (sm_90) a cluster of `C`
    /// blocks per row, each holding a run of it (`rows::cluster_run`), the row's dot product
    /// combined over the cluster (`rows::ClusterExchange`). Rows of 32768 f32 (y and g: 256 KB)
    /// streamed slower; two blocks of 1024 threads hold them at four vectors a thread. With `U`
    /// (`C = 1` only), rows of any length (`rows::RowSpan`), the lanes outside the row loaded
    /// as 0 in both y and g (no term of the dot product).
    pub unsafe fn bwd_reg<T: Elem, S: Kind, const V: usize, const C: u32, const U: bool>(
        y: *const T,
        gr: *const T,
        gx: *mut T,
        rows: u64,
        cols: u64,
    ) {
        let g = Group::this();
        let row = launch_row::<C>(&g);
        let ok = row < rows;
        const { assert!(C == 1 || !U) };
        let (col0, nvec) = cluster_run::<T, C>(cols);
        // SAFETY: col0 + nvec * VEC <= cols.
        let (y, gr, gx) = unsafe { (y.add(col0 as usize), gr.add(col0 as usize), gx.add(col0 as usize)) };
        let mut red = RowReducer::<C>::new(&g);
        let off = if ok { (row * cols) as usize } else { 0 };
        // SAFETY: inside the tensor (row < rows, or the first row).
        let mut sp = RowSpan::<U>::of(unsafe { y.add(off) }, cols, ok);
        if !U && ok {
            // A cluster's block holds its run only.
            sp.nvec = nvec;
        }
        let nvec = sp.nvec;
        let off = off - sp.lead as usize;
        // SAFETY: as fwd_reg (the three tensors' rows share their alignment); gx aliases
        // neither input, so the `.nc` loads see no writes.
        let (ry, rg) =
            unsafe { (load_span::<T, V, U>(y.add(off), sp, &g, 0), load_span::<T, V, U>(gr.add(off), sp, &g, 0)) };
        let mut dot = 0.0f32;
        for_slots::<V>(
            #[inline(always)]
            |s| {
                if slot_present(&g, s, nvec, ok) {
                    let (vy, vg) = (T::unpack(ry[s]), T::unpack(rg[s]));
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| dot += bwd_term::<S>(vy[k], vg[k]),
                    );
                }
            },
        );
        let [dot] = red.reduce(&g, [dot], [0.0], add);
        for_slots::<V>(
            #[inline(always)]
            |s| {
                if slot_present(&g, s, nvec, ok) {
                    // Unpacked again from the packed registers (see `prim::opaque`).
                    let (vy, mut vg) = (T::unpack(opaque(ry[s])), T::unpack(opaque(rg[s])));
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| vg[k] = bwd_out::<T, S>(vy[k], vg[k], dot),
                    );
                    let j = slot_col::<T>(&g, s) / T::VEC as u64;
                    // SAFETY: the slot's vector holds elements of row `row` of gx, only those stored.
                    unsafe { store_span::<T, U>(gx.add(off + slot_col::<T>(&g, s) as usize), sp, j, T::pack(&vg)) };
                }
            },
        );
        red.finish();
    }

    pub unsafe fn bwd_stream<T: Elem, S: Kind>(y: *const T, gr: *const T, gx: *mut T, rows: u64, cols: u64) {
        let g = Group::this();
        g.for_each_row(
            rows,
            #[inline(always)]
            |row| {
                let ok = row < rows;
                let off = if ok { (row * cols) as usize } else { 0 };
                let (yr, gr_, gxr) = unsafe { (y.add(off), gr.add(off), gx.add(off)) };
                let sp = if ok { RowSplit::of(yr, cols) } else { RowSplit { head: 0, nvec: 0, cols: 0 } };
                let w = T::VEC as u64;
                let load = #[inline(always)]
                |c: u64| unsafe {
                    let c = c as usize;
                    (
                        T::unpack(ld_global_nc_v4(yr.add(c) as *const u32)),
                        T::unpack(ld_global_nc_v4(gr_.add(c) as *const u32)),
                    )
                };
                let dot = fold_row(
                    sp,
                    w,
                    &g,
                    0.0f32,
                    load,
                    #[inline(always)]
                    |mut dot, _, (vy, vg): ([f32; 8], [f32; 8])| {
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| dot += bwd_term::<S>(vy[k], vg[k]),
                        );
                        dot
                    },
                    #[inline(always)]
                    |dot, c| unsafe {
                        dot + bwd_term::<S>((*yr.add(c as usize)).to_f32(), (*gr_.add(c as usize)).to_f32())
                    },
                );
                let [dot] = group_reduce(&g, [dot], [0.0], add);
                fold_row(
                    sp,
                    w,
                    &g,
                    (),
                    load,
                    #[inline(always)]
                    |(), c, (vy, mut vg): ([f32; 8], [f32; 8])| {
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| vg[k] = bwd_out::<T, S>(vy[k], vg[k], dot),
                        );
                        unsafe { st_global_v4(gxr.add(c as usize) as *mut u32, T::pack(&vg)) };
                    },
                    #[inline(always)]
                    |(), c| unsafe {
                        let c = c as usize;
                        *gxr.add(c) = T::from_f32(bwd_out::<T, S>((*yr.add(c)).to_f32(), (*gr_.add(c)).to_f32(), dot));
                    },
                );
            },
        );
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

// --- the kernels: `<softmax|log_softmax>_<fwd|bwd>_<v1|v2|v4|v8|u1|u2|u4|stream|c<C>_v4>_<dtype>` ---

/// The softmax family's kernels of one storage type `T`, typed (see [`RowKernels`]).
pub struct SoftmaxKernels<T: 'static> {
    /// Softmax's.
    pub softmax: SoftmaxOp<T>,
    /// Log-softmax's.
    pub log_softmax: SoftmaxOp<T>,
}

/// The forward and backward instances of softmax or log-softmax for one storage type.
pub struct SoftmaxOp<T: 'static> {
    /// `<op>_fwd_*`.
    pub fwd: RowKernels<SoftmaxFwdArgs<T>>,
    /// `<op>_bwd_*`.
    pub bwd: RowKernels<SoftmaxBwdArgs<T>>,
}

impl<T: 'static> SoftmaxKernels<T> {
    /// Log-softmax's kernels if `log`, else softmax's.
    pub const fn op(&self, log: bool) -> &SoftmaxOp<T> {
        if log { &self.log_softmax } else { &self.softmax }
    }
}

impl<T: 'static> SoftmaxKernels<T>
where
    SoftmaxFwdArgs<T>: Params,
    SoftmaxBwdArgs<T>: Params,
{
    /// Every kernel's name and arity.
    pub fn entries(&self) -> impl Iterator<Item = KernelEntry> + '_ {
        [&self.softmax, &self.log_softmax].into_iter().flat_map(|o| o.fwd.entries().chain(o.bwd.entries()))
    }
}

/// A storage type's softmax kernels.
pub trait SoftmaxElem: crate::Elem {
    /// The table of `Self`'s instances.
    const SOFTMAX: SoftmaxKernels<Self>;
}

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    SOFTMAX_F32.entries().chain(SOFTMAX_F16.entries()).chain(SOFTMAX_BF16.entries())
}

/// Declares, per storage type, every instance of the family from one list: the kernels (on the
/// device), their typed handles and the type's [`SoftmaxKernels`] table (on the host).
macro_rules! softmax_family {
    ($($T:ty, $sfx:ident, $table:ident:
        fwd [$($f:literal)*] log_fwd [$($lf:literal)*] unaligned_fwd [$($uf:literal)*] bwd [$($b:literal)*]
        bwd_clusters [$($c:literal)*];)*) => { $(
        softmax_family!(@op $T, $sfx, softmax, Softmax, [$($f)*], [$($uf)*], [$($b)*], [$($c)*]);
        softmax_family!(@op $T, $sfx, log_softmax, LogSoftmax, [$($lf)*], [$($uf)*], [$($b)*], [$($c)*]);
        #[cfg(not(target_arch = "nvptx64"))]
        #[doc = concat!("The softmax kernels of ", stringify!($sfx), ".")]
        pub const $table: SoftmaxKernels<$T> = SoftmaxKernels {
            softmax: softmax_family!(@table $sfx, softmax, [$($f)*], [$($uf)*], [$($b)*], [$($c)*]),
            log_softmax: softmax_family!(@table $sfx, log_softmax, [$($lf)*], [$($uf)*], [$($b)*], [$($c)*]),
        };
        #[cfg(not(target_arch = "nvptx64"))]
        impl SoftmaxElem for $T {
            const SOFTMAX: SoftmaxKernels<$T> = $table;
        }
    )* };
    (@op $T:ty, $sfx:ident, $op:ident, $K:ident, [$($f:literal)*], [$($uf:literal)*], [$($b:literal)*],
        [$($c:literal)*]) => {
        paste::paste! {
            $( $crate::kernel!([<$op _fwd_v $f _ $sfx>]: SoftmaxFwdArgs<$T> = |x, y, rows, cols|
                fwd_reg::<$T, $K, $f, false>(x, y, rows, cols)); )*
            $( $crate::kernel!([<$op _bwd_v $b _ $sfx>]: SoftmaxBwdArgs<$T> = |y, g, gx, rows, cols|
                bwd_reg::<$T, $K, $b, 1, false>(y, g, gx, rows, cols)); )*
            // The same over rows of any length (`rows::RowSpan`).
            $( $crate::kernel!([<$op _fwd_u $uf _ $sfx>]: SoftmaxFwdArgs<$T> = |x, y, rows, cols|
                fwd_reg::<$T, $K, $uf, true>(x, y, rows, cols)); )*
            $( $crate::kernel!([<$op _bwd_u $b _ $sfx>]: SoftmaxBwdArgs<$T> = |y, g, gx, rows, cols|
                bwd_reg::<$T, $K, $b, 1, true>(y, g, gx, rows, cols)); )*
            $crate::kernel!([<$op _fwd_stream_ $sfx>]: SoftmaxFwdArgs<$T> = |x, y, rows, cols|
                fwd_stream::<$T, $K>(x, y, rows, cols));
            $crate::kernel!([<$op _bwd_stream_ $sfx>]: SoftmaxBwdArgs<$T> = |y, g, gx, rows, cols|
                bwd_stream::<$T, $K>(y, g, gx, rows, cols));
            // Clusters of C blocks, four vectors a thread (sm_90 only; the host lists them for
            // every target and launches them where the device's module has them).
            $( #[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_90"))]
            $crate::kernel!([<$op _bwd_c $c _v4_ $sfx>]: SoftmaxBwdArgs<$T> = |y, g, gx, rows, cols|
                bwd_reg::<$T, $K, 4, $c, false>(y, g, gx, rows, cols)); )*
        }
    };
    (@table $sfx:ident, $op:ident, [$($f:literal)*], [$($uf:literal)*], [$($b:literal)*], [$($c:literal)*]) => {
        paste::paste! {
            SoftmaxOp {
                fwd: RowKernels::new(&[
                    $( (RowVariant::Reg($f), [<$op _fwd_v $f _ $sfx>]), )*
                    $( (RowVariant::RegU($uf), [<$op _fwd_u $uf _ $sfx>]), )*
                    (RowVariant::Stream, [<$op _fwd_stream_ $sfx>]),
                ]),
                bwd: RowKernels::new(&[
                    $( (RowVariant::Reg($b), [<$op _bwd_v $b _ $sfx>]), )*
                    $( (RowVariant::RegU($b), [<$op _bwd_u $b _ $sfx>]), )*
                    $( (RowVariant::Cluster($c, 4), [<$op _bwd_c $c _v4_ $sfx>]), )*
                    (RowVariant::Stream, [<$op _bwd_stream_ $sfx>]),
                ]),
            }
        }
    };
}

// The instances, in one place. Forward: eight vectors a thread for f32 softmax's rows of 16385
// to 32768 in one 1024-thread block (f32 log-softmax spilled at 64 registers, its `log` on top
// of the row, so those rows stream), and f16/bf16 rows of 16385 to 32768 (the host offers eight
// only there: shorter rows were slower with it) in up to 512 threads within 64 registers, two
// such blocks an SM, one row's reductions and `exp` overlapping the other's loads, which ran
// faster than four vectors in 1024 threads, one block an SM (docs/worklog.md, 2026-11-23c).
// Backward: it holds two rows (y and g), and eight vectors of each would not fit 64
// registers. Rows too long for one block's registers in the backward (over 16384 f32 or 32768
// f16/bf16) are held by a cluster of 2, 4 or 8 blocks (sm_90; older GPUs stream them). The
// forward has no cluster kernels: one cluster per row at four vectors a thread, tried, ran
// slower than one block per row (f32 at 4096 x 32768; docs/worklog.md, 2026-11-25c).
// Rows that are not whole vectors (`_u`, both directions) go up to four vectors a thread: at
// eight, the forward's span bookkeeping on top of the row spilled within 64 registers (sm_90a,
// 2026-11-28-rows), so rows over 4096 vectors stream.
softmax_family! {
    f32, f32, SOFTMAX_F32: fwd [1 2 4 8] log_fwd [1 2 4] unaligned_fwd [1 2 4] bwd [1 2 4]
        bwd_clusters [2 4 8];
    crate::dtype::F16, f16, SOFTMAX_F16: fwd [1 2 4 8] log_fwd [1 2 4 8] unaligned_fwd [1 2 4] bwd [1 2 4]
        bwd_clusters [2 4 8];
    crate::dtype::BF16, bf16, SOFTMAX_BF16: fwd [1 2 4 8] log_fwd [1 2 4 8] unaligned_fwd [1 2 4] bwd [1 2 4]
        bwd_clusters [2 4 8];
}
