//! 2-d pooling over `[N, C, H, W]` (NCHW) or `[N, H, W, C]` (NHWC): max and average pooling
//! with a kernel, stride and padding (PyTorch's `max_pool2d`, `avg_pool2d`), and the global
//! average pool (`adaptive_avg_pool2d` to 1 x 1), forward and backward, in f32 for every
//! storage type.
//!
//! Windows are PyTorch's: output `(oh, ow)` covers rows `oh sh - ph .. oh sh - ph + kh` (and the
//! same in columns), clipped to the input. Max pooling keeps the first largest element of a
//! window in row-major order, and a NaN wins: each NaN met replaces the maximum (`v > max ||
//! v is NaN`, as PyTorch's CUDA kernel, so the last NaN's index is saved). The saved index is
//! `h * W + w` within the plane, as PyTorch's `return_indices`. Average pooling divides the
//! window's f32 sum (row-major order) by its size: clipped to `H + ph` (and `W + pw`) with
//! `count_include_pad`, to the input without.
//!
//! The backward passes gather: a thread per input element walks the windows that contain it
//! (rows `oh` with `oh sh - ph <= h < oh sh - ph + kh`, in increasing order) and sums their
//! gradients in f32 (max: those whose saved index is this element), so no atomics and the same
//! bits on every run. The global average pool sums each plane in f32 (NCHW: a warp per plane,
//! lanes striding, then a butterfly; NHWC: a thread per `(n, c)` in increasing position) and
//! divides by `H W`; its backward is `dy / (H W)` for every element.
//!
//! Pairs of sizes travel packed in one `u64` (`(a << 32) | b`, each below 2^31).

use crate::batchnorm::{NHWC, divmod};
use crate::kernel::Kernel;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::KernelEntry;

/// `(x, y, idx, n, c, in_hw, out_hw, k, s, p, layout)`: the max of each window into `y`, its
/// plane index into `idx` (both of the output's `n c oh ow` elements). `in_hw = (H, W)`,
/// `out_hw = (OH, OW)`, `k`, `s`, `p` the kernel, stride and padding, packed.
pub type MaxFwdArgs<T> = (*const T, *mut T, *mut i64, u64, u64, u64, u64, u64, u64, u64, u32);

/// `(dy, idx, dx, n, c, in_hw, out_hw, k, s, p, layout)`: `dx` of every input element, the sum
/// of `dy` over the windows whose saved index it is.
pub type MaxBwdArgs<T> = (*const T, *const i64, *mut T, u64, u64, u64, u64, u64, u64, u64, u32);

/// `(x, y, n, c, in_hw, out_hw, k, s, p, flags)`: the average of each window; `flags` is the
/// layout, plus 2 for `count_include_pad`.
pub type AvgFwdArgs<T> = (*const T, *mut T, u64, u64, u64, u64, u64, u64, u64, u32);

/// `(dy, dx, n, c, in_hw, out_hw, k, s, p, flags)`: `dx` of every input element, the sum of
/// `dy / divisor` over the windows that contain it.
pub type AvgBwdArgs<T> = (*const T, *mut T, u64, u64, u64, u64, u64, u64, u64, u32);

/// `(x, y, n, c, hw, layout)`: `y[n c]` the mean of the plane's `hw` elements.
pub type GapFwdArgs<T> = (*const T, *mut T, u64, u64, u64, u32);

/// `(dy, dx, n, c, hw, layout)`: `dx = dy[n c] / hw`.
pub type GapBwdArgs<T> = (*const T, *mut T, u64, u64, u64, u32);

/// The flag of `count_include_pad` in [`AvgFwdArgs`]' flags.
pub const INCLUDE_PAD: u32 = 2;

/// `(a << 32) | b`.
pub const fn pack(a: u64, b: u64) -> u64 {
    (a << 32) | (b & 0xffff_ffff)
}

/// The pair [`pack`] made.
#[inline(always)]
pub const fn unpack(v: u64) -> (i64, i64) {
    ((v >> 32) as i64, (v & 0xffff_ffff) as i64)
}

/// Element `i` of a `[N, C, A, B]` tensor (NCHW) or `[N, A, B, C]` (NHWC) as `(n, c, a, b)`.
/// `c, a, b > 0`.
#[inline(always)]
pub fn decode(i: u64, c: u64, a: u64, b: u64, layout: u32) -> (u64, u64, u64, u64) {
    if layout == NHWC {
        let (r, ch) = divmod(i, c);
        let (r, bb) = divmod(r, b);
        let (n, aa) = divmod(r, a);
        (n, ch, aa, bb)
    } else {
        let (r, bb) = divmod(i, b);
        let (r, aa) = divmod(r, a);
        let (n, ch) = divmod(r, c);
        (n, ch, aa, bb)
    }
}

/// The offset of `(n, c, a, b)` in such a tensor.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub const fn encode(n: u64, ch: u64, a: u64, b: u64, c: u64, na: u64, nb: u64, layout: u32) -> u64 {
    if layout == NHWC { ((n * na + a) * nb + b) * c + ch } else { ((n * c + ch) * na + a) * nb + b }
}

/// The rows (or columns) of window `o`: `(start, end)` clipped to the input `0..len`, and its
/// size clipped only to `len + pad` (the divisor of `count_include_pad`).
#[inline(always)]
pub const fn window(o: i64, k: i64, s: i64, p: i64, len: i64) -> (i64, i64, i64) {
    let start = o * s - p;
    let end = if start + k < len + p { start + k } else { len + p };
    let size = end - start;
    (if start > 0 { start } else { 0 }, if end < len { end } else { len }, size)
}

/// The windows (outputs `lo..hi` of `out`) that contain input row `h`.
#[inline(always)]
pub const fn windows_of(h: i64, k: i64, s: i64, p: i64, out: i64) -> (i64, i64) {
    let lo = if h + p < k { 0 } else { (h + p - k) / s + 1 };
    let hi = (h + p) / s + 1;
    (lo, if hi < out { hi } else { out })
}

/// The divisor of an average window: its size with padding (`include_pad`), else its rows times
/// columns inside the input.
#[inline(always)]
pub const fn divisor(
    o: (i64, i64),
    k: (i64, i64),
    s: (i64, i64),
    p: (i64, i64),
    len: (i64, i64),
    include_pad: bool,
) -> i64 {
    let (h0, h1, sh) = window(o.0, k.0, s.0, p.0, len.0);
    let (w0, w1, sw) = window(o.1, k.1, s.1, p.1, len.1);
    if include_pad { sh * sw } else { (h1 - h0) * (w1 - w0) }
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::Elem;
    use crate::prim::*;

    /// See [`MaxFwdArgs`].
    #[inline(always)]
    pub unsafe fn max_fwd<T: Elem>(
        x: *const T,
        y: *mut T,
        idx: *mut i64,
        n: u64,
        c: u64,
        in_hw: u64,
        out_hw: u64,
        k: u64,
        s: u64,
        p: u64,
        layout: u32,
    ) {
        let ((h, w), (oh, ow)) = (unpack(in_hw), unpack(out_hw));
        let ((kh, kw), (sh, sw), (ph, pw)) = (unpack(k), unpack(s), unpack(p));
        let total = n * c * (oh * ow) as u64;
        let mut i = global_thread_x();
        while i < total {
            let (b, ch, a, bb) = decode(i, c, oh as u64, ow as u64, layout);
            let (h0, h1, _) = window(a as i64, kh, sh, ph, h);
            let (w0, w1, _) = window(bb as i64, kw, sw, pw, w);
            let mut best = h0 * w + w0;
            let mut max = f32::NEG_INFINITY;
            let mut r = h0;
            while r < h1 {
                let mut q = w0;
                while q < w1 {
                    let at = encode(b, ch, r as u64, q as u64, c, h as u64, w as u64, layout);
                    // SAFETY: (r, q) is inside the input plane, b < n, ch < c.
                    let v = unsafe { (*x.add(at as usize)).to_f32() };
                    if v > max || v.is_nan() {
                        max = v;
                        best = r * w + q;
                    }
                    q += 1;
                }
                r += 1;
            }
            // SAFETY: i < total, the output's elements.
            unsafe {
                *y.add(i as usize) = T::from_f32(max);
                *idx.add(i as usize) = best;
            }
            i += grid_threads_x();
        }
    }

    /// See [`MaxBwdArgs`].
    #[inline(always)]
    pub unsafe fn max_bwd<T: Elem>(
        dy: *const T,
        idx: *const i64,
        dx: *mut T,
        n: u64,
        c: u64,
        in_hw: u64,
        out_hw: u64,
        k: u64,
        s: u64,
        p: u64,
        layout: u32,
    ) {
        let ((h, w), (oh, ow)) = (unpack(in_hw), unpack(out_hw));
        let ((kh, kw), (sh, sw), (ph, pw)) = (unpack(k), unpack(s), unpack(p));
        let total = n * c * (h * w) as u64;
        let mut i = global_thread_x();
        while i < total {
            let (b, ch, a, bb) = decode(i, c, h as u64, w as u64, layout);
            let (r0, r1) = windows_of(a as i64, kh, sh, ph, oh);
            let (q0, q1) = windows_of(bb as i64, kw, sw, pw, ow);
            let me = a as i64 * w + bb as i64;
            let mut acc = 0.0f32;
            let mut r = r0;
            while r < r1 {
                let mut q = q0;
                while q < q1 {
                    let at = encode(b, ch, r as u64, q as u64, c, oh as u64, ow as u64, layout) as usize;
                    // SAFETY: (r, q) is inside the output plane, b < n, ch < c.
                    unsafe {
                        if *idx.add(at) == me {
                            acc += (*dy.add(at)).to_f32();
                        }
                    }
                    q += 1;
                }
                r += 1;
            }
            // SAFETY: i < total, the input's elements.
            unsafe { *dx.add(i as usize) = T::from_f32(acc) };
            i += grid_threads_x();
        }
    }

    /// See [`AvgFwdArgs`].
    #[inline(always)]
    pub unsafe fn avg_fwd<T: Elem>(
        x: *const T,
        y: *mut T,
        n: u64,
        c: u64,
        in_hw: u64,
        out_hw: u64,
        k: u64,
        s: u64,
        p: u64,
        flags: u32,
    ) {
        let ((h, w), (oh, ow)) = (unpack(in_hw), unpack(out_hw));
        let ((kh, kw), (sh, sw), (ph, pw)) = (unpack(k), unpack(s), unpack(p));
        let (layout, include_pad) = (flags & 1, flags & INCLUDE_PAD != 0);
        let total = n * c * (oh * ow) as u64;
        let mut i = global_thread_x();
        while i < total {
            let (b, ch, a, bb) = decode(i, c, oh as u64, ow as u64, layout);
            let (h0, h1, _) = window(a as i64, kh, sh, ph, h);
            let (w0, w1, _) = window(bb as i64, kw, sw, pw, w);
            let mut acc = 0.0f32;
            let mut r = h0;
            while r < h1 {
                let mut q = w0;
                while q < w1 {
                    let at = encode(b, ch, r as u64, q as u64, c, h as u64, w as u64, layout);
                    // SAFETY: (r, q) is inside the input plane, b < n, ch < c.
                    acc += unsafe { (*x.add(at as usize)).to_f32() };
                    q += 1;
                }
                r += 1;
            }
            let d = divisor((a as i64, bb as i64), (kh, kw), (sh, sw), (ph, pw), (h, w), include_pad);
            // SAFETY: i < total, the output's elements.
            unsafe { *y.add(i as usize) = T::from_f32(acc / d as f32) };
            i += grid_threads_x();
        }
    }

    /// See [`AvgBwdArgs`].
    #[inline(always)]
    pub unsafe fn avg_bwd<T: Elem>(
        dy: *const T,
        dx: *mut T,
        n: u64,
        c: u64,
        in_hw: u64,
        out_hw: u64,
        k: u64,
        s: u64,
        p: u64,
        flags: u32,
    ) {
        let ((h, w), (oh, ow)) = (unpack(in_hw), unpack(out_hw));
        let ((kh, kw), (sh, sw), (ph, pw)) = (unpack(k), unpack(s), unpack(p));
        let (layout, include_pad) = (flags & 1, flags & INCLUDE_PAD != 0);
        let total = n * c * (h * w) as u64;
        let mut i = global_thread_x();
        while i < total {
            let (b, ch, a, bb) = decode(i, c, h as u64, w as u64, layout);
            let (r0, r1) = windows_of(a as i64, kh, sh, ph, oh);
            let (q0, q1) = windows_of(bb as i64, kw, sw, pw, ow);
            let mut acc = 0.0f32;
            let mut r = r0;
            while r < r1 {
                let mut q = q0;
                while q < q1 {
                    let at = encode(b, ch, r as u64, q as u64, c, oh as u64, ow as u64, layout) as usize;
                    let d = divisor((r, q), (kh, kw), (sh, sw), (ph, pw), (h, w), include_pad);
                    // SAFETY: (r, q) is inside the output plane, b < n, ch < c.
                    acc += unsafe { (*dy.add(at)).to_f32() } / d as f32;
                    q += 1;
                }
                r += 1;
            }
            // SAFETY: i < total, the input's elements.
            unsafe { *dx.add(i as usize) = T::from_f32(acc) };
            i += grid_threads_x();
        }
    }

    /// See [`GapFwdArgs`].
    #[inline(always)]
    pub unsafe fn gap_fwd<T: Elem>(x: *const T, y: *mut T, n: u64, c: u64, hw: u64, layout: u32) {
        let planes = n * c;
        if layout == NHWC {
            let mut i = global_thread_x();
            while i < planes {
                let (b, ch) = divmod(i, c);
                let mut acc = 0.0f32;
                let mut s = 0;
                while s < hw {
                    // SAFETY: b < n, s < hw, ch < c.
                    acc += unsafe { (*x.add(((b * hw + s) * c + ch) as usize)).to_f32() };
                    s += 1;
                }
                // SAFETY: i < n c.
                unsafe { *y.add(i as usize) = T::from_f32(acc / hw as f32) };
                i += grid_threads_x();
            }
        } else {
            // A warp per plane; every lane of a warp takes the same planes (the loop is uniform).
            let lane = (thread_idx_x() % 32) as u64;
            let mut pl = global_thread_x() / 32;
            let warps = grid_threads_x() / 32;
            while pl < planes {
                let mut acc = 0.0f32;
                let mut s = lane;
                while s < hw {
                    // SAFETY: pl < n c, s < hw.
                    acc += unsafe { (*x.add((pl * hw + s) as usize)).to_f32() };
                    s += 32;
                }
                let sum = warp_sum(acc);
                if lane == 0 {
                    // SAFETY: pl < n c.
                    unsafe { *y.add(pl as usize) = T::from_f32(sum / hw as f32) };
                }
                pl += warps;
            }
        }
    }

    /// See [`GapBwdArgs`].
    #[inline(always)]
    pub unsafe fn gap_bwd<T: Elem>(dy: *const T, dx: *mut T, n: u64, c: u64, hw: u64, layout: u32) {
        let total = n * c * hw;
        let mut i = global_thread_x();
        while i < total {
            let plane = if layout == NHWC {
                let (b, r) = divmod(i, hw * c);
                b * c + divmod(r, c).1
            } else {
                divmod(i, hw).0
            };
            // SAFETY: plane < n c, i < total.
            unsafe { *dx.add(i as usize) = T::from_f32((*dy.add(plane as usize)).to_f32() / hw as f32) };
            i += grid_threads_x();
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

/// The storage types' kernels, typed.
pub trait PoolElem: crate::Elem {
    /// `max_pool2d_fwd_<dtype>`.
    const MAX_FWD: Kernel<MaxFwdArgs<Self>>;
    /// `max_pool2d_bwd_<dtype>`.
    const MAX_BWD: Kernel<MaxBwdArgs<Self>>;
    /// `avg_pool2d_fwd_<dtype>`.
    const AVG_FWD: Kernel<AvgFwdArgs<Self>>;
    /// `avg_pool2d_bwd_<dtype>`.
    const AVG_BWD: Kernel<AvgBwdArgs<Self>>;
    /// `global_avg_pool2d_fwd_<dtype>`.
    const GAP_FWD: Kernel<GapFwdArgs<Self>>;
    /// `global_avg_pool2d_bwd_<dtype>`.
    const GAP_BWD: Kernel<GapBwdArgs<Self>>;
}

macro_rules! pool_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<max_pool2d_fwd_ $sfx>]: MaxFwdArgs<$T> =
                |x, y, idx, n, c, in_hw, out_hw, k, s, p, layout|
                    max_fwd::<$T>(x, y, idx, n, c, in_hw, out_hw, k, s, p, layout));
            $crate::kernel!([<max_pool2d_bwd_ $sfx>]: MaxBwdArgs<$T> =
                |dy, idx, dx, n, c, in_hw, out_hw, k, s, p, layout|
                    max_bwd::<$T>(dy, idx, dx, n, c, in_hw, out_hw, k, s, p, layout));
            $crate::kernel!([<avg_pool2d_fwd_ $sfx>]: AvgFwdArgs<$T> =
                |x, y, n, c, in_hw, out_hw, k, s, p, flags|
                    avg_fwd::<$T>(x, y, n, c, in_hw, out_hw, k, s, p, flags));
            $crate::kernel!([<avg_pool2d_bwd_ $sfx>]: AvgBwdArgs<$T> =
                |dy, dx, n, c, in_hw, out_hw, k, s, p, flags|
                    avg_bwd::<$T>(dy, dx, n, c, in_hw, out_hw, k, s, p, flags));
            $crate::kernel!([<global_avg_pool2d_fwd_ $sfx>]: GapFwdArgs<$T> =
                |x, y, n, c, hw, layout| gap_fwd::<$T>(x, y, n, c, hw, layout));
            $crate::kernel!([<global_avg_pool2d_bwd_ $sfx>]: GapBwdArgs<$T> =
                |dy, dx, n, c, hw, layout| gap_bwd::<$T>(dy, dx, n, c, hw, layout));
            #[cfg(not(target_arch = "nvptx64"))]
            impl PoolElem for $T {
                const MAX_FWD: Kernel<MaxFwdArgs<$T>> = [<max_pool2d_fwd_ $sfx>];
                const MAX_BWD: Kernel<MaxBwdArgs<$T>> = [<max_pool2d_bwd_ $sfx>];
                const AVG_FWD: Kernel<AvgFwdArgs<$T>> = [<avg_pool2d_fwd_ $sfx>];
                const AVG_BWD: Kernel<AvgBwdArgs<$T>> = [<avg_pool2d_bwd_ $sfx>];
                const GAP_FWD: Kernel<GapFwdArgs<$T>> = [<global_avg_pool2d_fwd_ $sfx>];
                const GAP_BWD: Kernel<GapBwdArgs<$T>> = [<global_avg_pool2d_bwd_ $sfx>];
            }
        }
    };
}
crate::for_each_elem!(pool_kernels);

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    use crate::dtype::{BF16, F16};
    fn of<T: PoolElem>() -> [KernelEntry; 6] {
        [
            T::MAX_FWD.entry(),
            T::MAX_BWD.entry(),
            T::AVG_FWD.entry(),
            T::AVG_BWD.entry(),
            T::GAP_FWD.entry(),
            T::GAP_BWD.entry(),
        ]
    }
    of::<f32>().into_iter().chain(of::<F16>()).chain(of::<BF16>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batchnorm::NCHW;

    #[test]
    fn windows_and_their_inverse_agree() {
        // Every (row, window) pair: the row is in the clipped window iff the window is in the
        // row's range.
        for (k, s, p, len) in [(3i64, 2i64, 1i64, 7i64), (2, 2, 0, 5), (3, 1, 1, 1), (7, 3, 3, 11), (1, 3, 0, 4)] {
            for ceil in [false, true] {
                let span = len + 2 * p - k;
                let mut out = if ceil { (span + s - 1) / s + 1 } else { span / s + 1 };
                if ceil && (out - 1) * s >= len + p {
                    out -= 1;
                }
                for h in 0..len {
                    let (lo, hi) = windows_of(h, k, s, p, out);
                    for o in 0..out {
                        let (a, b, size) = window(o, k, s, p, len);
                        assert!(a < b && size >= b - a, "k {k} s {s} p {p} len {len} o {o}");
                        assert_eq!(
                            (a..b).contains(&h),
                            (lo..hi).contains(&o),
                            "k {k} s {s} p {p} len {len} h {h} o {o}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn divisors() {
        // 3x3, stride 2, padding 1 over 4x4: the corner window has 2x2 inside, 3x3 with padding
        // (its top and left are padding; its end is inside).
        let d = |o, inc| divisor(o, (3, 3), (2, 2), (1, 1), (4, 4), inc);
        assert_eq!((d((0, 0), false), d((0, 0), true)), (4, 9));
        assert_eq!((d((1, 1), false), d((1, 1), true)), (9, 9));
        // Past the end (ceil mode): clipped to len + pad.
        assert_eq!(divisor((2, 0), (3, 3), (2, 2), (1, 1), (4, 4), true), 2 * 3);
    }

    #[test]
    fn decode_inverts_encode() {
        let (n, c, a, b) = (2u64, 3u64, 5u64, 7u64);
        for layout in [NCHW, NHWC] {
            for i in 0..n * c * a * b {
                let (nn, cc, aa, bb) = decode(i, c, a, b, layout);
                assert_eq!(encode(nn, cc, aa, bb, c, a, b, layout), i);
            }
        }
        assert_eq!(unpack(pack(7, 11)), (7, 11));
    }
}
