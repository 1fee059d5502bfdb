//! 2-d convolution (`conv2d`): forward, the gradient of the input (backward-data), and the
//! gradients of the filter and bias (backward-weight), for NHWC (channels last) and NCHW.
//!
//! The general kernels: any size, stride, padding, dilation and groups (depthwise included),
//! f32 accumulation, one thread per output element and a fixed order of additions, so every
//! result is deterministic. They serve every shape the tensor-core path does not take.
//!
//! The tensor-core forward ([`ConvTcArgs`], bf16 and f16, NHWC, one group, `C % 8 == 0`): the
//! implicit GEMM `Y[N P Q, K] = im2col(x)[N P Q, R S C] @ W[K, R S C]^T` on `gemm_tc.rs`'s
//! tiles (128 x 128, `mma.sync.m16n8k16`, a 4-stage `cp.async` ring). Only A differs from that
//! GEMM: each 16-byte chunk of an A row (output `(n, p, q)`, 8 channels of one filter tap
//! `(r, s)`) is copied from `x[n, h, w, c..c + 8]` when `(h, w)` is inside the input and
//! zero-filled otherwise. The filter, `[K, R, S, C]`, is B stored `n x k` as it is. The
//! epilogue (bias, rounding) is the GEMM's.
//!
//! The tensor-core backward (bf16 and f16, NHWC, one group, `C % 8 == 0` and `K % 8 == 0`:
//! [`tc_bwd_applies`]), on the same tile and main loop:
//! - Backward-data ([`ConvDgradTcArgs`]): `dX[N H W, C] = A[N H W, R S K] @ B[R S K, C]`, the
//!   reduction ordered `(r, s, k)`. A's chunk for row `(n, h, w)` and 8 filters `k..k + 8` of
//!   tap `(r, s)` is `dy[n, p, q, k..k + 8]` where `p = (h + pad_h - r dil_h) / stride_h` is
//!   exact and below P (and `q` alike), zero-filled otherwise; B is the filter as stored,
//!   `w[k, r, s, c..c + 8]`, read with C as the output column. For stride `s > 1` the taps whose
//!   division is inexact are zero-filled rather than skipped: correct for every stride, at up to
//!   `s_h s_w` times the useful work (the cost of one kernel for all strides).
//! - Backward-weight ([`ConvWgradTcArgs`]): `dW[K, R S C] = dy^T[K, N P Q] @ im2col(x)[N P Q, R
//!   S C]`, the `N P Q` terms cut into chunks of a length the host derives from the shape alone;
//!   each chunk's tile is written in f32 to a workspace and [`ConvWSumArgs`]'s pass adds the
//!   chunks in order and rounds once, so the result is deterministic. A is dy read as the `N P Q
//!   x K` matrix it is (rows along M); B's chunk for term `(n, p, q)` and columns `(r, s,
//!   c..c + 8)` is `x[n, p stride_h - pad_h + r dil_h, .., c..c + 8]`, zero-filled on the padding.
//!   The bias gradient stays on the general kernels.
//!
//! Indexing is logical: `x[n, c, h, w]`, `w[k, c', r, s]` (`c'` the channel within the group),
//! `y[n, k, p, q]`, each tensor's memory order given by [`ConvGeom::nhwc`] (see [`Strides`]).
//! Output position `p` reads input row `p * stride_h - pad_h + r * dil_h` for filter row `r`;
//! rows outside `[0, H)` are the zero padding and add nothing.
//!
//! - Forward: `y[n, k, p, q] = bias[k] + sum over (r, s, c')` of `x * w`, in that loop order.
//! - Backward-data: each `dx[n, c, h, w]` gathers, over `(r, s)` and the group's filters `k`,
//!   the `dy[n, k, p, q]` whose window reads it (`p = (h + pad_h - r dil_h) / stride_h` where
//!   that division is exact and `p < P`), times `w[k, c', r, s]`. No atomics.
//! - Backward-weight: `dw[k, c', r, s] = sum over (n, p, q)` of `dy * x`, and
//!   `db[k] = sum over (n, p, q)` of `dy`. The `N P Q` terms are cut into `chunks` consecutive
//!   ranges of `chunk_len` ([`ConvWPartArgs`]), each summed in order into an f32 partial; a
//!   second pass ([`ConvWSumArgs`]) adds the partials in chunk order and rounds once.

use crate::kernel::Kernel;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::KernelEntry;

/// The problem, one kernel parameter (`#[repr(C)]`, 4-byte fields). Every value is at most
/// `i32::MAX` (the host checks), so the position arithmetic in i64 cannot overflow.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConvGeom {
    /// Batch.
    pub n: u32,
    /// Input channels (all groups).
    pub c: u32,
    /// Input height.
    pub h: u32,
    /// Input width.
    pub w: u32,
    /// Output channels (filters, all groups).
    pub k: u32,
    /// Filter height.
    pub r: u32,
    /// Filter width.
    pub s: u32,
    /// Output height.
    pub p: u32,
    /// Output width.
    pub q: u32,
    /// Groups: `c` and `k` are multiples of it.
    pub groups: u32,
    /// Vertical stride (at least 1).
    pub stride_h: u32,
    /// Horizontal stride (at least 1).
    pub stride_w: u32,
    /// Zero rows above and below.
    pub pad_h: u32,
    /// Zero columns left and right.
    pub pad_w: u32,
    /// Vertical dilation (at least 1).
    pub dil_h: u32,
    /// Horizontal dilation (at least 1).
    pub dil_w: u32,
    /// 1: NHWC activations and a `[K, R, S, C/groups]` filter; 0: NCHW and `[K, C/groups, R, S]`.
    pub nhwc: u32,
    /// Padding to 8 bytes.
    pub pad: u32,
}

/// A kernel parameter: a plain `#[repr(C)]` value of integers.
impl crate::kernel::Param for ConvGeom {}

/// Element strides of a 4-d activation `[n][c][h][w]` (logical) or of the filter
/// `[k][c'][r][s]` (logical), in the layout's memory order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strides {
    /// Between batches (filters for the weight).
    pub n: u64,
    /// Between channels.
    pub c: u64,
    /// Between rows.
    pub h: u64,
    /// Between columns.
    pub w: u64,
}

impl Strides {
    /// A dense activation of `c` channels, `h` x `w`: NHWC (`[n][h][w][c]`) or NCHW.
    #[inline(always)]
    pub const fn act(nhwc: bool, c: u32, h: u32, w: u32) -> Strides {
        let (c, h, w) = (c as u64, h as u64, w as u64);
        if nhwc {
            Strides { n: h * w * c, c: 1, h: w * c, w: c }
        } else {
            Strides { n: c * h * w, c: h * w, h: w, w: 1 }
        }
    }
}

impl ConvGeom {
    /// Input channels per group.
    #[inline(always)]
    pub const fn cg(&self) -> u32 {
        self.c / self.groups
    }
    /// Filters per group.
    #[inline(always)]
    pub const fn kg(&self) -> u32 {
        self.k / self.groups
    }
    /// The input's strides.
    #[inline(always)]
    pub const fn x_strides(&self) -> Strides {
        Strides::act(self.nhwc != 0, self.c, self.h, self.w)
    }
    /// The output's (and its gradient's) strides.
    #[inline(always)]
    pub const fn y_strides(&self) -> Strides {
        Strides::act(self.nhwc != 0, self.k, self.p, self.q)
    }
    /// The filter's strides as `[k][c'][r][s]`: `[K, R, S, C/g]` (NHWC) or `[K, C/g, R, S]`.
    #[inline(always)]
    pub const fn w_strides(&self) -> Strides {
        let (cg, r, s) = (self.cg() as u64, self.r as u64, self.s as u64);
        if self.nhwc != 0 {
            Strides { n: r * s * cg, c: 1, h: s * cg, w: cg }
        } else {
            Strides { n: cg * r * s, c: r * s, h: s, w: 1 }
        }
    }
    /// Elements of the filter, `K * C/g * R * S`.
    #[inline(always)]
    pub const fn w_len(&self) -> u64 {
        self.k as u64 * self.cg() as u64 * self.r as u64 * self.s as u64
    }
    /// Terms of each filter gradient's sum: `N * P * Q`.
    #[inline(always)]
    pub const fn npq(&self) -> u64 {
        self.n as u64 * self.p as u64 * self.q as u64
    }
    /// The element at flat position `t` of an activation `[n][ch][a][b]` stored in the
    /// layout's order (`ch` channels, `a` x `b` spatial): `(n, ch, a, b)`.
    #[inline(always)]
    pub const fn act_index(&self, t: u64, ch: u32, a: u32, b: u32) -> (u64, u64, u64, u64) {
        let (ch, a, b) = (ch as u64, a as u64, b as u64);
        if self.nhwc != 0 {
            let c = t % ch;
            let t = t / ch;
            let j = t % b;
            let t = t / b;
            (t / a, c, t % a, j)
        } else {
            let j = t % b;
            let t = t / b;
            let i = t % a;
            let t = t / a;
            (t / ch, t % ch, i, j)
        }
    }
    /// The filter element at flat position `e`: `(k, c', r, s)`.
    #[inline(always)]
    pub const fn w_index(&self, e: u64) -> (u64, u64, u64, u64) {
        let (cg, r, s) = (self.cg() as u64, self.r as u64, self.s as u64);
        if self.nhwc != 0 {
            let c = e % cg;
            let e = e / cg;
            let j = e % s;
            let e = e / s;
            (e / r, c, e % r, j)
        } else {
            let j = e % s;
            let e = e / s;
            let i = e % r;
            let e = e / r;
            (e / cg, e % cg, i, j)
        }
    }
    /// The input row (or column) read by output position `p` and filter tap `r`:
    /// `p * stride - pad + r * dil`, possibly outside the input.
    #[inline(always)]
    pub const fn src(p: u64, r: u64, stride: u32, pad: u32, dil: u32) -> i64 {
        p as i64 * stride as i64 - pad as i64 + r as i64 * dil as i64
    }
    /// The output position whose filter tap `r` reads input row `h`, if any: `(h + pad - r *
    /// dil) / stride` where exact and below `p`.
    #[inline(always)]
    pub const fn dst(h: u64, r: u64, stride: u32, pad: u32, dil: u32, p: u32) -> Option<u64> {
        let t = h as i64 + pad as i64 - r as i64 * dil as i64;
        if t < 0 || t % stride as i64 != 0 {
            return None;
        }
        let o = (t / stride as i64) as u64;
        if o < p as u64 { Some(o) } else { None }
    }
}

/// Output extent of one spatial dimension: `(h + 2 pad - dil (r - 1) - 1) / stride + 1`, or 0
/// where the padded input is smaller than the dilated filter (or `r` or `stride` is 0).
pub const fn out_size(h: u64, r: u64, stride: u64, pad: u64, dil: u64) -> u64 {
    if r == 0 || stride == 0 {
        return 0;
    }
    let span = dil * (r - 1) + 1;
    let padded = h + 2 * pad;
    if padded < span { 0 } else { (padded - span) / stride + 1 }
}

/// `(geom, x, w, bias, y, total)`: the forward for the first `total = N K P Q` outputs (in
/// `y`'s memory order); `bias` (K elements) may be null.
pub type ConvFwdArgs<T> = (ConvGeom, *const T, *const T, *const T, *mut T, u64);

/// `(geom, dy, w, dx, total)`: the input's gradient, `total = N C H W` elements.
pub type ConvBwdDataArgs<T> = (ConvGeom, *const T, *const T, *mut T, u64);

/// `(geom, x, dy, part, e_w, e_all, chunk_len, chunks)`: for item `e < e_all` and chunk `j <
/// chunks`, `part[j * e_all + e]` = the f32 sum over the flat `(n, p, q)` in `[j chunk_len, (j +
/// 1) chunk_len)` (cut to `N P Q`), in order, of `dy * x` for filter element `e < e_w` (flat, in
/// the filter's layout) or of `dy` for bias `e - e_w`.
pub type ConvWPartArgs<T> = (ConvGeom, *const T, *const T, *mut f32, u64, u64, u64, u64);

/// `(part, dw, db, e_w, e_all, chunks)`: item `e` summed over the chunks in order from +0.0,
/// rounded once, into `dw[e]` (`e < e_w`) or `db[e - e_w]`.
pub type ConvWSumArgs<T> = (*const f32, *mut T, *mut T, u64, u64, u64);

/// `(geom, x, w, epilogue)`: the tensor-core forward (see the module); tile `blockIdx.x` of
/// `N P Q` rows, `blockIdx.y` of K columns; `epilogue` describes `y` as the `N P Q x K` matrix D
/// (and the bias as its column bias). `x` and `w` are 16-byte aligned, `C % 8 == 0`, one group.
pub type ConvTcArgs = (ConvGeom, *const u16, *const u16, crate::gemm_epilogue::Epilogue);

/// Whether the tensor-core forward takes a problem of `dtype`: bf16 or f16, NHWC, one group,
/// channels a multiple of 8 (every A chunk is 16 contiguous bytes of one filter tap).
pub const fn tc_applies(dtype: crate::DType, g: &ConvGeom) -> bool {
    !matches!(dtype, crate::DType::F32) && g.nhwc != 0 && g.groups == 1 && g.c.is_multiple_of(8) && g.c > 0
}

/// `(geom, dy, w, dx)`: the tensor-core backward-data (see the module); tile `blockIdx.x` of
/// `N H W` rows, `blockIdx.y` of C columns. Conditions: [`tc_bwd_applies`], every pointer
/// 16-byte aligned, `N H W + 128` within u32.
pub type ConvDgradTcArgs = (ConvGeom, *const u16, *const u16, *mut u16);

/// `(geom, x, dy, part, chunk_len)`: the tensor-core backward-weight's partials (see the
/// module); tile `blockIdx.y` of K rows, `blockIdx.x` of `R S C` columns, chunk `j =
/// blockIdx.z` of the `N P Q` terms `[j chunk_len, (j + 1) chunk_len)` (cut to `N P Q`), written
/// in f32 to `part[j K R S C + e]`, `e` the filter's flat (`[K, R, S, C]`) index: the layout of
/// [`ConvWSumArgs`]'s partials. Conditions: [`tc_bwd_applies`], 16-byte aligned pointers, `N P
/// Q + 128` within u32.
pub type ConvWgradTcArgs = (ConvGeom, *const u16, *const u16, *mut f32, u32);

/// Whether the tensor-core backward (both kernels) takes a problem of `dtype`: the forward's
/// conditions ([`tc_applies`]) and `K % 8 == 0`, `K > 0`: every 16-byte chunk of dy (8 filters
/// of one pixel), of the filter read `[k][r][s][c..c + 8]` and of x (8 channels of one tap) is
/// contiguous and aligned. The host adds the grid's limits.
pub const fn tc_bwd_applies(dtype: crate::DType, g: &ConvGeom) -> bool {
    tc_applies(dtype, g) && g.k.is_multiple_of(8) && g.k > 0
}

/// A flat index `i` split as `(a, b, c) = (i / (nb nc), (i / nc) % nb, i % nc)` and carried
/// forward by steps without dividing: the tap `(r, s, k)` of a reduction index (`nb = S`, `nc =
/// K` or `C`), or the output position `(n, p, q)` of a row of `N P Q` (`nb = P`, `nc = Q`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Walk {
    /// The outer index (unbounded: it runs past its extent when the walk does).
    pub a: u32,
    /// The middle index, below `nb`.
    pub b: u32,
    /// The inner index, below `nc`.
    pub c: u32,
}

impl Walk {
    /// The split of `i` (`nb`, `nc` at least 1).
    #[inline(always)]
    pub const fn at(i: u32, nb: u32, nc: u32) -> Walk {
        Walk { a: i / nc / nb, b: (i / nc) % nb, c: i % nc }
    }
    /// `step` positions on: one loop turn per carry out of `c` (`step / nc` turns or one more).
    #[inline(always)]
    pub fn advance(&mut self, step: u32, nb: u32, nc: u32) {
        self.c += step;
        while self.c >= nc {
            self.c -= nc;
            self.b += 1;
            if self.b == nb {
                self.b = 0;
                self.a += 1;
            }
        }
    }
}

/// Backward-data's gather in u32 for the tensor cores: the output position `o < len` whose tap
/// `r` reads the input row `hp - pad` (`hp` = the row plus the padding), i.e. `o stride = hp -
/// r dil`, if exact and in range ([`ConvGeom::dst`] for `hp = h + pad`). The host keeps `hp`
/// below 2^31.
#[inline(always)]
pub const fn dst_padded(hp: u32, r: u32, stride: u32, dil: u32, len: u32) -> Option<u32> {
    let t = hp as i64 - r as i64 * dil as i64;
    if t < 0 {
        return None;
    }
    let t = t as u32;
    let o = if stride == 1 {
        t
    } else if !t.is_multiple_of(stride) {
        return None;
    } else {
        t / stride
    };
    if o < len { Some(o) } else { None }
}

impl ConvGeom {
    /// Backward-data's A on the tensor cores (NHWC, one group): the offset in `dy[n]` of the
    /// element for the dx row with `(hp, wp) = (h + pad_h, w + pad_w)` and the reduction index
    /// `tap = (r, s, k)`, i.e. of `dy[n, p, q, k]`, or `None` where the tap reads no output.
    #[inline(always)]
    pub const fn dgrad_dy_offset(&self, hp: u32, wp: u32, tap: Walk) -> Option<u64> {
        let (Some(p), Some(q)) = (
            dst_padded(hp, tap.a, self.stride_h, self.dil_h, self.p),
            dst_padded(wp, tap.b, self.stride_w, self.dil_w, self.q),
        ) else {
            return None;
        };
        Some(self.dy_offset(p, q, tap.c))
    }
    /// The offset of `dy[n, p, q, k]` in `dy[n]` (NHWC).
    #[inline(always)]
    pub const fn dy_offset(&self, p: u32, q: u32, k: u32) -> u64 {
        (p as u64 * self.q as u64 + q as u64) * self.k as u64 + k as u64
    }
    /// Backward-data's B on the tensor cores: the offset of `w[k, r, s, 0]` for the reduction
    /// index `tap = (r, s, k)` (the filter `[K, R, S, C]`).
    #[inline(always)]
    pub const fn dgrad_w_offset(&self, tap: Walk) -> u64 {
        let rsc = self.r as u64 * self.s as u64 * self.c as u64;
        tap.c as u64 * rsc + (tap.a as u64 * self.s as u64 + tap.b as u64) * self.c as u64
    }
    /// Backward-weight's B on the tensor cores (im2col of NHWC x): the offset of `x[n, h, w, 0]`
    /// read by the term `pos = (n, p, q)` for a column of tap `(r, s)`, given as `dh = r dil_h -
    /// pad_h`, `dw = s dil_w - pad_w`; `None` on the padding.
    #[inline(always)]
    pub const fn wgrad_x_offset(&self, pos: Walk, dh: i64, dw: i64) -> Option<u64> {
        let h = pos.b as i64 * self.stride_h as i64 + dh;
        let w = pos.c as i64 * self.stride_w as i64 + dw;
        if h < 0 || h >= self.h as i64 || w < 0 || w >= self.w as i64 {
            return None;
        }
        Some(((pos.a as u64 * self.h as u64 + h as u64) * self.w as u64 + w as u64) * self.c as u64)
    }
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::Elem;
    use crate::prim::*;

    /// See [`ConvFwdArgs`].
    #[inline(always)]
    pub unsafe fn fwd<T: Elem>(g: ConvGeom, x: *const T, w: *const T, bias: *const T, y: *mut T, total: u64) {
        let (xs, ws) = (g.x_strides(), g.w_strides());
        let (cg, kg) = (g.cg() as u64, g.kg() as u64);
        let mut t = global_thread_x();
        while t < total {
            let (n, k, p, q) = g.act_index(t, g.k, g.p, g.q);
            let c0 = (k / kg) * cg;
            // SAFETY: bias is null or holds K elements; every offset below is of an element
            // inside x (n < N, c0 + c' < C, rows and columns checked in range) or w (k < K,
            // c' < C/g, r < R, s < S); y holds `total` elements. Nothing read is written here.
            unsafe {
                let mut acc = if bias.is_null() { 0.0 } else { (*bias.add(k as usize)).to_f32() };
                let xb = x.add((n * xs.n + c0 * xs.c) as usize);
                let wb = w.add((k * ws.n) as usize);
                for r in 0..g.r as u64 {
                    let hi = ConvGeom::src(p, r, g.stride_h, g.pad_h, g.dil_h);
                    if hi < 0 || hi >= g.h as i64 {
                        continue;
                    }
                    for s in 0..g.s as u64 {
                        let wi = ConvGeom::src(q, s, g.stride_w, g.pad_w, g.dil_w);
                        if wi < 0 || wi >= g.w as i64 {
                            continue;
                        }
                        let xp = xb.add((hi as u64 * xs.h + wi as u64 * xs.w) as usize);
                        let wp = wb.add((r * ws.h + s * ws.w) as usize);
                        for c in 0..cg {
                            acc += (*xp.add((c * xs.c) as usize)).to_f32() * (*wp.add((c * ws.c) as usize)).to_f32();
                        }
                    }
                }
                *y.add(t as usize) = T::from_f32(acc);
            }
            t += grid_threads_x();
        }
    }

    /// See [`ConvBwdDataArgs`].
    #[inline(always)]
    pub unsafe fn bwd_data<T: Elem>(g: ConvGeom, dy: *const T, w: *const T, dx: *mut T, total: u64) {
        let (ys, ws) = (g.y_strides(), g.w_strides());
        let (cg, kg) = (g.cg() as u64, g.kg() as u64);
        let mut t = global_thread_x();
        while t < total {
            let (n, c, h, wc) = g.act_index(t, g.c, g.h, g.w);
            let (k0, ci) = ((c / cg) * kg, c % cg);
            // SAFETY: p < P and q < Q (`dst`), k0 + k < K, n < N: inside dy; k < K, ci < C/g,
            // r < R, s < S: inside w; dx holds `total` elements. Nothing read is written here.
            unsafe {
                let mut acc = 0.0f32;
                let yb = dy.add((n * ys.n + k0 * ys.c) as usize);
                let wb = w.add((k0 * ws.n + ci * ws.c) as usize);
                for r in 0..g.r as u64 {
                    let Some(p) = ConvGeom::dst(h, r, g.stride_h, g.pad_h, g.dil_h, g.p) else { continue };
                    for s in 0..g.s as u64 {
                        let Some(q) = ConvGeom::dst(wc, s, g.stride_w, g.pad_w, g.dil_w, g.q) else { continue };
                        let yp = yb.add((p * ys.h + q * ys.w) as usize);
                        let wp = wb.add((r * ws.h + s * ws.w) as usize);
                        for k in 0..kg {
                            acc += (*yp.add((k * ys.c) as usize)).to_f32() * (*wp.add((k * ws.n) as usize)).to_f32();
                        }
                    }
                }
                *dx.add(t as usize) = T::from_f32(acc);
            }
            t += grid_threads_x();
        }
    }

    /// See [`ConvWPartArgs`].
    #[inline(always)]
    pub unsafe fn bwd_wpart<T: Elem>(
        g: ConvGeom,
        x: *const T,
        dy: *const T,
        part: *mut f32,
        e_w: u64,
        e_all: u64,
        chunk_len: u64,
        chunks: u64,
    ) {
        let (xs, ys) = (g.x_strides(), g.y_strides());
        let (cg, kg) = (g.cg() as u64, g.kg() as u64);
        let (pp, qq, npq) = (g.p as u64, g.q as u64, g.npq());
        let mut t = global_thread_x();
        while t < e_all * chunks {
            let (j, e) = (t / e_all, t % e_all);
            let start = j * chunk_len;
            let end = if npq - start < chunk_len { npq } else { start + chunk_len };
            // The item: a filter element, or a bias (then the x factor is 1).
            let (k, xoff, r, s) = if e < e_w {
                let (k, ci, r, s) = g.w_index(e);
                (k, Some((k / kg) * cg + ci), r, s)
            } else {
                (e - e_w, None, 0, 0)
            };
            let (mut n, mut p, mut q) = (start / (pp * qq), (start / qq) % pp, start % qq);
            let mut acc = 0.0f32;
            let mut i = start;
            // SAFETY: n < N, p < P, q < Q and k < K index dy; for a filter element the channel
            // is below C and the row and column are checked inside x; part holds e_all * chunks
            // floats. Nothing read is written here.
            unsafe {
                while i < end {
                    let d = (*dy.add((n * ys.n + k * ys.c + p * ys.h + q * ys.w) as usize)).to_f32();
                    match xoff {
                        None => acc += d,
                        Some(c) => {
                            let hi = ConvGeom::src(p, r, g.stride_h, g.pad_h, g.dil_h);
                            let wi = ConvGeom::src(q, s, g.stride_w, g.pad_w, g.dil_w);
                            if hi >= 0 && hi < g.h as i64 && wi >= 0 && wi < g.w as i64 {
                                let xo = n * xs.n + c * xs.c + hi as u64 * xs.h + wi as u64 * xs.w;
                                acc += d * (*x.add(xo as usize)).to_f32();
                            }
                        }
                    }
                    i += 1;
                    q += 1;
                    if q == qq {
                        q = 0;
                        p += 1;
                        if p == pp {
                            p = 0;
                            n += 1;
                        }
                    }
                }
                *part.add((j * e_all + e) as usize) = acc;
            }
            t += grid_threads_x();
        }
    }

    /// See [`ConvWSumArgs`].
    #[inline(always)]
    pub unsafe fn bwd_wsum<T: Elem>(part: *const f32, dw: *mut T, db: *mut T, e_w: u64, e_all: u64, chunks: u64) {
        let mut e = global_thread_x();
        while e < e_all {
            // SAFETY: part holds e_all * chunks floats; dw holds e_w elements and db e_all - e_w
            // (the host passes a null pointer only for an empty range).
            unsafe {
                let mut acc = 0.0f32;
                for j in 0..chunks {
                    acc += *part.add((j * e_all + e) as usize);
                }
                if e < e_w {
                    *dw.add(e as usize) = T::from_f32(acc);
                } else {
                    *db.add((e - e_w) as usize) = T::from_f32(acc);
                }
            }
            e += grid_threads_x();
        }
    }

    /// The A operand of the tensor-core forward for one thread: its 2 chunks of a stage, each
    /// one 16-byte piece of an im2col row (rows along K, as `gemm_tc`'s `Loader<true>`).
    struct ImLoader {
        /// The row's image, `x[n]`, or null for a row past `N P Q`.
        img: [*const u16; 2],
        /// The row's first input row and column (`p stride - pad`, `q stride - pad`).
        h0: [i64; 2],
        /// See `h0`.
        w0: [i64; 2],
        /// The chunk's next K index: its filter tap `(r, s)` and channel `c`.
        r: [u32; 2],
        /// See `r`.
        s: [u32; 2],
        /// See `r`.
        c: [u32; 2],
        /// The chunk's K offset in a stage.
        kk: [u32; 2],
        /// Byte offset in the operand's slot.
        soff: [u32; 2],
        /// A valid address for a copy of 0 bytes.
        origin: *const u16,
    }

    impl ImLoader {
        #[inline(always)]
        fn new(g: &ConvGeom, x: *const u16, m0: u64, tid: u32) -> Self {
            use crate::gemm_tc::{BK, SK, THREADS};
            let mut l = ImLoader {
                img: [core::ptr::null(); 2],
                h0: [0; 2],
                w0: [0; 2],
                r: [0; 2],
                s: [0; 2],
                c: [0; 2],
                kk: [0; 2],
                soff: [0; 2],
                origin: x,
            };
            let (pq, q) = (g.p as u64 * g.q as u64, g.q as u64);
            let img = g.h as u64 * g.w as u64 * g.c as u64;
            unroll!(I: usize; 0 1 => {
                let ch = tid + I as u32 * THREADS;
                let (row, kk) = (ch / (BK / 8), 8 * (ch % (BK / 8)));
                let m = m0 + row as u64;
                if m < g.npq() {
                    let (n, p, qq) = (m / pq, (m / q) % g.p as u64, m % q);
                    // SAFETY: address arithmetic inside x (n < N).
                    l.img[I] = unsafe { x.add((n * img) as usize) };
                    l.h0[I] = ConvGeom::src(p, 0, g.stride_h, g.pad_h, g.dil_h);
                    l.w0[I] = ConvGeom::src(qq, 0, g.stride_w, g.pad_w, g.dil_w);
                }
                l.c[I] = kk % g.c;
                l.s[I] = (kk / g.c) % g.s;
                l.r[I] = kk / (g.c * g.s);
                l.kk[I] = kk;
                l.soff[I] = 2 * (row * SK + kk);
            });
            l
        }

        /// Starts the copies of the stage whose first K index is `k0` into the slot at `slot`,
        /// then moves every chunk on by one stage.
        #[inline(always)]
        unsafe fn copy(&mut self, g: &ConvGeom, k0: u32, slot: u32) {
            let kt = g.r * g.s * g.c;
            unroll!(I: usize; 0 1 => {
                let h = self.h0[I] + self.r[I] as i64 * g.dil_h as i64;
                let w = self.w0[I] + self.s[I] as i64 * g.dil_w as i64;
                let inside = !self.img[I].is_null()
                    && k0 + self.kk[I] < kt
                    && h >= 0
                    && h < g.h as i64
                    && w >= 0
                    && w < g.w as i64;
                let src = if inside {
                    let off = (h as u64 * g.w as u64 + w as u64) * g.c as u64 + self.c[I] as u64;
                    // SAFETY: address arithmetic inside image n (h < H, w < W, c + 8 <= C).
                    unsafe { self.img[I].add(off as usize) }
                } else {
                    self.origin
                };
                // SAFETY: `src` holds 16 readable bytes when `inside` (C % 8 == 0 and c % 8 == 0:
                // the chunk lies in one pixel, 16-byte aligned as x's base); `dst` is the chunk's
                // 16 bytes of the slot, which no thread reads until the barrier after this copy's
                // group has been waited for.
                unsafe { cp_async_16(slot + self.soff[I], src as *const f32, if inside { 16 } else { 0 }) };
                // The next stage's tap: BK = 32 channels on, carried over C and S.
                self.c[I] += crate::gemm_tc::BK;
                while self.c[I] >= g.c {
                    self.c[I] -= g.c;
                    self.s[I] += 1;
                    if self.s[I] == g.s {
                        self.s[I] = 0;
                        self.r[I] += 1;
                    }
                }
            });
        }
    }

    /// See [`ConvTcArgs`]: `gemm_tc`'s main loop with A gathered by [`ImLoader`].
    #[inline(always)]
    pub unsafe fn fwd_tc<I: crate::gemm_tc::InType + crate::gemm_epilogue::OutType>(
        g: ConvGeom,
        x: *const u16,
        w: *const u16,
        e: crate::gemm_epilogue::Epilogue,
    ) {
        use crate::gemm_epilogue::store_pair;
        use crate::gemm_tc::device::{Loader, lane_offset, ldsm};
        use crate::gemm_tc::{BK, BM, BN, OPERAND_BYTES, SK, STAGE_BYTES, STAGES};
        let tid = thread_idx_x();
        let (warp, lane) = (tid / 32, tid % 32);
        let (wm, wn) = (warp / 4, warp % 4);
        let (gr, t) = (lane / 4, lane % 4);
        let m0 = block_idx_x() as u64 * BM as u64;
        let n0 = block_idx_y() * BN;
        let k = g.r * g.s * g.c;
        let mut la = ImLoader::new(&g, x, m0, tid);
        // SAFETY: address arithmetic; the loader checks the rows (K - n0 left) and K.
        let mut lb = unsafe { Loader::<true>::new(w.add(n0 as usize * k as usize), k as u64, e.n - n0, true, tid) };

        let smem = dyn_smem_addr();
        let stages = k.div_ceil(BK);
        for s in 0..STAGES - 1 {
            if s < stages {
                let slot = smem + s * STAGE_BYTES;
                // SAFETY: as in `gemm_tc`: slots not yet read by anyone.
                unsafe {
                    la.copy(&g, s * BK, slot);
                    lb.copy(k - s * BK, slot + OPERAND_BYTES);
                }
            }
            cp_async_commit();
        }
        let (i, j) = (lane / 8, lane % 8);
        let a_lane = lane_offset::<true>(wm * 64, 8 * (i % 2), 8 * (i / 2), j);
        let b_lane = OPERAND_BYTES + lane_offset::<true>(wn * 32, 8 * (i / 2), 8 * (i % 2), j);
        let (r16, k16) = (2 * 16 * SK, 2 * 16);

        let mut acc = [[[0.0f32; 4]; 4]; 4];
        let (mut cur, mut next) = (0u32, STAGES - 1);
        for s in 0..stages {
            cp_async_wait::<{ STAGES - 2 }>();
            sync_threads();
            let ls = s + STAGES - 1;
            if ls < stages {
                let slot = smem + next * STAGE_BYTES;
                // SAFETY: slot `next` was last read in stage s - 1, before the barrier.
                unsafe {
                    la.copy(&g, ls * BK, slot);
                    lb.copy(k - ls * BK, slot + OPERAND_BYTES);
                }
            }
            cp_async_commit();

            let base = smem + cur * STAGE_BYTES;
            unroll!(KS: u32; 0 1 => {
                let mut bf = [[0u32; 2]; 4];
                unroll!(NP: u32; 0 1 => {
                    // SAFETY: inside slot `cur`, complete for every thread since the barrier.
                    let v = unsafe { ldsm::<true>(base + b_lane + NP * r16 + KS * k16) };
                    bf[2 * NP as usize] = [v[0], v[1]];
                    bf[2 * NP as usize + 1] = [v[2], v[3]];
                });
                unroll!(MI: u32; 0 1 2 3 => {
                    // SAFETY: as above.
                    let af = unsafe { ldsm::<true>(base + a_lane + MI * r16 + KS * k16) };
                    unroll!(NI: usize; 0 1 2 3 => {
                        acc[MI as usize][NI] = I::mma(af, bf[NI], acc[MI as usize][NI]);
                    });
                });
            });
            cur = if cur + 1 == STAGES { 0 } else { cur + 1 };
            next = if next + 1 == STAGES { 0 } else { next + 1 };
        }
        // The host keeps N P Q below 2^32 for this kernel, so rows fit the epilogue's u32.
        let m0 = m0 as u32;
        unroll!(MI: u32; 0 1 2 3 => {
            unroll!(H: u32; 0 1 => {
                let row = m0 + wm * 64 + MI * 16 + gr + 8 * H;
                unroll!(NI: u32; 0 1 2 3 => {
                    let col = n0 + wn * 32 + NI * 8 + 2 * t;
                    let v = acc[MI as usize][NI as usize];
                    // SAFETY: the host's epilogue describes y; `store_pair` checks the row and
                    // columns; `col` is even.
                    unsafe { store_pair::<I>(&e, 0, row, col, [v[2 * H as usize], v[2 * H as usize + 1]]) };
                });
            });
        });
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

#[cfg(target_arch = "nvptx64")]
mod bwd_tc;
#[cfg(target_arch = "nvptx64")]
pub use bwd_tc::{dgrad_tc, wgrad_tc};

/// The storage types' kernels, typed.
pub trait ConvElem: crate::Elem {
    /// `conv2d_fwd_<dtype>`.
    const FWD: Kernel<ConvFwdArgs<Self>>;
    /// `conv2d_bwd_data_<dtype>`.
    const BWD_DATA: Kernel<ConvBwdDataArgs<Self>>;
    /// `conv2d_bwd_wpart_<dtype>`: the weight and bias gradients' chunk sums.
    const BWD_WPART: Kernel<ConvWPartArgs<Self>>;
    /// `conv2d_bwd_wsum_<dtype>`: the chunks added and rounded.
    const BWD_WSUM: Kernel<ConvWSumArgs<Self>>;
}

macro_rules! conv_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<conv2d_fwd_ $sfx>]: ConvFwdArgs<$T> =
                |g, x, w, bias, y, total| fwd::<$T>(g, x, w, bias, y, total));
            $crate::kernel!([<conv2d_bwd_data_ $sfx>]: ConvBwdDataArgs<$T> =
                |g, dy, w, dx, total| bwd_data::<$T>(g, dy, w, dx, total));
            $crate::kernel!([<conv2d_bwd_wpart_ $sfx>]: ConvWPartArgs<$T> =
                |g, x, dy, part, e_w, e_all, chunk_len, chunks|
                    bwd_wpart::<$T>(g, x, dy, part, e_w, e_all, chunk_len, chunks));
            $crate::kernel!([<conv2d_bwd_wsum_ $sfx>]: ConvWSumArgs<$T> =
                |part, dw, db, e_w, e_all, chunks| bwd_wsum::<$T>(part, dw, db, e_w, e_all, chunks));
            #[cfg(not(target_arch = "nvptx64"))]
            impl ConvElem for $T {
                const FWD: Kernel<ConvFwdArgs<$T>> = [<conv2d_fwd_ $sfx>];
                const BWD_DATA: Kernel<ConvBwdDataArgs<$T>> = [<conv2d_bwd_data_ $sfx>];
                const BWD_WPART: Kernel<ConvWPartArgs<$T>> = [<conv2d_bwd_wpart_ $sfx>];
                const BWD_WSUM: Kernel<ConvWSumArgs<$T>> = [<conv2d_bwd_wsum_ $sfx>];
            }
        }
    };
}
crate::for_each_elem!(conv_kernels);

crate::kernel!(conv2d_fwd_tc_bf16: ConvTcArgs = |g, x, w, e| fwd_tc::<crate::dtype::BF16>(g, x, w, e));
crate::kernel!(conv2d_fwd_tc_f16: ConvTcArgs = |g, x, w, e| fwd_tc::<crate::dtype::F16>(g, x, w, e));

crate::kernel!(conv2d_bwd_data_tc_bf16: ConvDgradTcArgs = |g, dy, w, dx| dgrad_tc::<crate::dtype::BF16>(g, dy, w, dx));
crate::kernel!(conv2d_bwd_data_tc_f16: ConvDgradTcArgs = |g, dy, w, dx| dgrad_tc::<crate::dtype::F16>(g, dy, w, dx));
crate::kernel!(conv2d_bwd_wgrad_tc_bf16: ConvWgradTcArgs =
    |g, x, dy, part, len| wgrad_tc::<crate::dtype::BF16>(g, x, dy, part, len));
crate::kernel!(conv2d_bwd_wgrad_tc_f16: ConvWgradTcArgs =
    |g, x, dy, part, len| wgrad_tc::<crate::dtype::F16>(g, x, dy, part, len));

/// The tensor-core backward for `dtype`: backward-data and backward-weight; `None` for f32.
#[cfg(not(target_arch = "nvptx64"))]
pub const fn tc_bwd_kernels(dtype: crate::DType) -> Option<(Kernel<ConvDgradTcArgs>, Kernel<ConvWgradTcArgs>)> {
    match dtype {
        crate::DType::BF16 => Some((conv2d_bwd_data_tc_bf16, conv2d_bwd_wgrad_tc_bf16)),
        crate::DType::F16 => Some((conv2d_bwd_data_tc_f16, conv2d_bwd_wgrad_tc_f16)),
        crate::DType::F32 => None,
    }
}

/// The tensor-core forward for `dtype`; `None` for f32.
#[cfg(not(target_arch = "nvptx64"))]
pub const fn tc_kernel(dtype: crate::DType) -> Option<Kernel<ConvTcArgs>> {
    match dtype {
        crate::DType::BF16 => Some(conv2d_fwd_tc_bf16),
        crate::DType::F16 => Some(conv2d_fwd_tc_f16),
        crate::DType::F32 => None,
    }
}

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    use crate::dtype::{BF16, F16};
    fn of<T: ConvElem>() -> [KernelEntry; 4] {
        [T::FWD.entry(), T::BWD_DATA.entry(), T::BWD_WPART.entry(), T::BWD_WSUM.entry()]
    }
    [of::<f32>(), of::<F16>(), of::<BF16>()]
        .into_iter()
        .flatten()
        .chain([conv2d_fwd_tc_bf16.entry(), conv2d_fwd_tc_f16.entry()])
        .chain([conv2d_bwd_data_tc_bf16.entry(), conv2d_bwd_data_tc_f16.entry()])
        .chain([conv2d_bwd_wgrad_tc_bf16.entry(), conv2d_bwd_wgrad_tc_f16.entry()])
}

#[cfg(test)]
mod tests {
    extern crate alloc;
    use super::*;
    use alloc::vec;
    use alloc::vec::Vec;

    fn geom(nhwc: bool) -> ConvGeom {
        ConvGeom {
            n: 2,
            c: 6,
            h: 5,
            w: 7,
            k: 4,
            r: 3,
            s: 2,
            p: 3,
            q: 4,
            groups: 2,
            stride_h: 2,
            stride_w: 2,
            pad_h: 1,
            pad_w: 1,
            dil_h: 1,
            dil_w: 2,
            nhwc: nhwc as u32,
            pad: 0,
        }
    }

    #[test]
    fn output_sizes() {
        // PyTorch's formula, and 0 where the filter does not fit.
        assert_eq!(out_size(224, 7, 2, 3, 1), 112);
        assert_eq!(out_size(56, 3, 1, 1, 1), 56);
        assert_eq!(out_size(7, 3, 2, 0, 2), 2);
        assert_eq!(out_size(2, 3, 1, 0, 1), 0);
        assert_eq!(out_size(0, 1, 1, 0, 1), 0);
        assert_eq!(out_size(0, 3, 1, 1, 1), 0);
        assert_eq!(out_size(0, 1, 1, 1, 1), 2);
        assert_eq!(out_size(5, 0, 1, 0, 1), 0);
        assert_eq!(out_size(5, 1, 0, 0, 1), 0);
    }

    #[test]
    fn indices_walk_memory_order() {
        for nhwc in [true, false] {
            let g = geom(nhwc);
            let st = g.y_strides();
            let total = g.n as u64 * g.k as u64 * g.p as u64 * g.q as u64;
            for t in 0..total {
                let (n, k, p, q) = g.act_index(t, g.k, g.p, g.q);
                assert!(n < 2 && k < 4 && p < 3 && q < 4);
                assert_eq!(n * st.n + k * st.c + p * st.h + q * st.w, t);
            }
            let ws = g.w_strides();
            for e in 0..g.w_len() {
                let (k, c, r, s) = g.w_index(e);
                assert!(k < 4 && c < 3 && r < 3 && s < 2);
                assert_eq!(k * ws.n + c * ws.c + r * ws.h + s * ws.w, e);
            }
        }
    }

    #[test]
    fn src_and_dst_are_inverse() {
        for (stride, pad, dil) in [(1, 0, 1), (2, 1, 1), (3, 2, 2), (2, 3, 1)] {
            let p_len = 6;
            for p in 0..p_len as u64 {
                for r in 0..4 {
                    let h = ConvGeom::src(p, r, stride, pad, dil);
                    if h >= 0 {
                        assert_eq!(ConvGeom::dst(h as u64, r, stride, pad, dil, p_len), Some(p));
                    }
                }
            }
            for h in 0..12u64 {
                for r in 0..4 {
                    if let Some(p) = ConvGeom::dst(h, r, stride, pad, dil, p_len) {
                        assert_eq!(ConvGeom::src(p, r, stride, pad, dil), h as i64);
                    }
                }
            }
        }
    }

    #[test]
    fn walks_match_division() {
        for (nb, nc) in [(1, 1), (3, 8), (7, 7), (5, 32), (2, 40), (1, 136), (4, 3)] {
            for start in 0..40 {
                for step in [1, 8, 32] {
                    let mut w = Walk::at(start, nb, nc);
                    for i in 0..50 {
                        assert_eq!(w, Walk::at(start + i * step, nb, nc), "{nb} {nc} {start} {step} {i}");
                        w.advance(step, nb, nc);
                    }
                }
            }
        }
    }

    #[test]
    fn dst_padded_is_dst() {
        for (stride, pad, dil) in [(1, 0, 1), (1, 2, 1), (2, 1, 1), (3, 2, 2), (2, 3, 1), (2, 0, 3)] {
            for len in 0..8 {
                for h in 0..16u32 {
                    for r in 0..5u32 {
                        assert_eq!(
                            dst_padded(h + pad, r, stride, dil, len).map(u64::from),
                            ConvGeom::dst(h as u64, r as u64, stride, pad, dil, len)
                        );
                    }
                }
            }
        }
    }

    /// A small NHWC problem of one group.
    #[allow(clippy::too_many_arguments)]
    fn tc_geom(n: u32, c: u32, h: u32, w: u32, k: u32, rs: (u32, u32), stride: u32, pad: u32, dil: u32) -> ConvGeom {
        let (r, s) = rs;
        let out = |x: u32, f: u32| out_size(x as u64, f as u64, stride as u64, pad as u64, dil as u64) as u32;
        ConvGeom {
            n,
            c,
            h,
            w,
            k,
            r,
            s,
            p: out(h, r),
            q: out(w, s),
            groups: 1,
            stride_h: stride,
            stride_w: stride,
            pad_h: pad,
            pad_w: pad,
            dil_h: dil,
            dil_w: dil,
            nhwc: 1,
            pad: 0,
        }
    }

    /// The tensor-core backward's index maps, element by element: the implicit GEMMs they
    /// describe (A and B walked along the reduction as the loaders do) give exactly the
    /// gradients of the direct convolution, on small integers (every sum exact).
    #[test]
    fn tensor_core_backward_maps_give_the_gradients() {
        for g in [
            tc_geom(2, 3, 5, 6, 4, (3, 3), 1, 1, 1),
            tc_geom(1, 2, 9, 7, 3, (3, 2), 2, 1, 1),
            tc_geom(2, 4, 8, 8, 2, (3, 3), 3, 2, 2),
            tc_geom(1, 1, 11, 10, 2, (7, 7), 2, 3, 1),
            tc_geom(3, 2, 4, 5, 5, (1, 1), 2, 0, 1),
            tc_geom(1, 2, 6, 6, 2, (2, 3), 1, 0, 3),
            tc_geom(1, 2, 2, 2, 2, (3, 3), 1, 2, 1),
        ] {
            let (n, c, h, w, k, r, s, p, q) = (g.n, g.c, g.h, g.w, g.k, g.r, g.s, g.p, g.q);
            let val = |i: u32, salt: u32| ((i.wrapping_mul(2654435761) ^ salt) % 7) as i64 - 3;
            let x: Vec<i64> = (0..n * h * w * c).map(|i| val(i, 1)).collect();
            let wt: Vec<i64> = (0..k * r * s * c).map(|i| val(i, 2)).collect();
            let dy: Vec<i64> = (0..n * p * q * k).map(|i| val(i, 3)).collect();
            let (mut dx, mut dw) = (vec![0i64; x.len()], vec![0i64; wt.len()]);
            for (ni, pi, qi, ki, ri, si) in (0..n).flat_map(|a| {
                (0..p).flat_map(move |b| {
                    (0..q).flat_map(move |cc| {
                        (0..k).flat_map(move |d| (0..r).flat_map(move |e| (0..s).map(move |f| (a, b, cc, d, e, f))))
                    })
                })
            }) {
                let hi = ConvGeom::src(pi as u64, ri as u64, g.stride_h, g.pad_h, g.dil_h);
                let wi = ConvGeom::src(qi as u64, si as u64, g.stride_w, g.pad_w, g.dil_w);
                if hi < 0 || hi >= h as i64 || wi < 0 || wi >= w as i64 {
                    continue;
                }
                let d = dy[(((ni * p + pi) * q + qi) * k + ki) as usize];
                for ci in 0..c {
                    let xi = (((ni as i64 * h as i64 + hi) * w as i64 + wi) * c as i64 + ci as i64) as usize;
                    let wi = (((ki * r + ri) * s + si) * c + ci) as usize;
                    dx[xi] += d * wt[wi];
                    dw[wi] += d * x[xi];
                }
            }
            // Backward-data: rows (n, h, w), columns c, reduction (r, s, k).
            let img = (p * q * k) as usize;
            for m in 0..n * h * w {
                let pos = Walk::at(m, h, w);
                for ci in 0..c {
                    let mut tap = Walk::default();
                    let mut acc = 0;
                    for _ in 0..r * s * k {
                        if let Some(off) = g.dgrad_dy_offset(pos.b + g.pad_h, pos.c + g.pad_w, tap) {
                            acc += dy[pos.a as usize * img + off as usize]
                                * wt[(g.dgrad_w_offset(tap) + ci as u64) as usize];
                        }
                        tap.advance(1, s, k);
                    }
                    assert_eq!(acc, dx[(m * c + ci) as usize], "{g:?} dx row {m} channel {ci}");
                }
            }
            // Backward-weight: rows k, columns (r, s, c), reduction (n, p, q).
            for ki in 0..k {
                for j in 0..r * s * c {
                    let tap = Walk::at(j, s, c);
                    let dh = tap.a as i64 * g.dil_h as i64 - g.pad_h as i64;
                    let dwc = tap.b as i64 * g.dil_w as i64 - g.pad_w as i64;
                    let mut pos = Walk::default();
                    let mut acc = 0;
                    for i in 0..n * p * q {
                        if let Some(off) = g.wgrad_x_offset(pos, dh, dwc) {
                            acc += dy[(i * k + ki) as usize] * x[(off + tap.c as u64) as usize];
                        }
                        pos.advance(1, p, q);
                    }
                    assert_eq!(acc, dw[(ki * r * s * c + j) as usize], "{g:?} dw[{ki}, {j}]");
                }
            }
        }
    }
}
