//! Batch norm 2d over `[N, C, H, W]` (NCHW) or `[N, H, W, C]` (NHWC, channels last): per-channel
//! statistics over the `M = N * H * W` elements of each channel, in f32 for every storage type.
//!
//! Training forward, in three launches, deterministic (no atomics; a fixed order of merges that
//! depends only on the shape):
//! 1. `batch_norm_fwd_stats_<dtype>`: block `(gx, p)` takes chunk `p` (`chunk` consecutive
//!    positions `j` of the channel's `M`) of one channel (NCHW, a block of 1 x 256 threads) or of
//!    32 channels (NHWC, 32 x 8 threads: a warp reads 32 neighbouring channels). Each thread
//!    takes every `by`-th position of the chunk and sums `d = x - k` and `d^2`, `k` its own first
//!    element (a shifted sum: as `k` is one of its values, `(mean - k)^2 <= M2`, so the
//!    cancellation in `M2 = sum d^2 - (sum d)^2 / n` costs at most about `n` roundings relative
//!    to `M2`, `n <=` [`PER_THREAD`] times the multiplier of [`plan`]), giving its [`Moments`].
//!    The block merges its threads' moments in a fixed binary tree ([`merge`], Chan et al.'s
//!    pairwise formula, on offsets from a shift) and writes the moments of its chunk.
//! 2. `batch_norm_fwd_finalize`: a block of [`FINAL_THREADS`] per channel merges the chunks
//!    (thread `t` those `t, t + 256, ...` in order, then a tree), and writes the saved `mean` and
//!    `invstd = rsqrt(M2 / M + eps)`, and the running statistics as PyTorch updates them:
//!    `r = (1 - momentum) r + momentum s`, with the unbiased variance `M2 / (M - 1)`.
//!    In evaluation it only computes `mean = running_mean`, `invstd = rsqrt(running_var + eps)`.
//! 3. `batch_norm_fwd_<dtype>`: `y = ((x - mean) invstd) weight + bias`, an element a thread.
//!
//! The backward is the same shape: per-chunk sums of `dy` and `dy (x - mean)`
//! (`batch_norm_bwd_reduce_<dtype>`), the per-channel totals with `dweight = sum dy (x - mean)
//! invstd` and `dbias = sum dy` (`batch_norm_bwd_finalize`), then `dx` (`batch_norm_bwd_<dtype>`)
//! with PyTorch's formula: `(dy - sum dy / M - (x - mean) invstd^2 sum dy (x - mean) / M)
//! invstd weight` in training, `dy invstd weight` in evaluation.

use crate::kernel::Kernel;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::KernelEntry;

/// The `layout` parameter: `[N, C, H, W]`.
pub const NCHW: u32 = 0;
/// The `layout` parameter: `[N, H, W, C]`.
pub const NHWC: u32 = 1;

/// Threads of a statistics block (`bx * by`).
pub const STATS_THREADS: u32 = 256;
/// Channels of an NHWC statistics block (its `bx`).
pub const NHWC_CHANNELS: u32 = 32;
/// Positions a thread takes in a chunk, before [`plan`] widens the chunks to fit the grid.
pub const PER_THREAD: u64 = 16;
/// The most chunks of a channel (the grid's y).
pub const MAX_CHUNKS: u64 = 65_535;
/// Threads of a finalize block (one channel).
pub const FINAL_THREADS: u32 = 256;

/// `(x, partial, c, hw, m, chunk, layout)`: for the channels `ch` of the block and chunk `p =
/// block y` (of `gridDim.y` chunks), `partial[(ch * chunks + p) * 4 ..][..4]` the [`Moments`]
/// `(n, k, q, M2)` of the positions `p * chunk .. min((p + 1) * chunk, m)`.
pub type StatsArgs<T> = (*const T, *mut f32, u64, u64, u64, u64, u32);

/// `(partial, chunks, c, m, mean, invstd, running_mean, running_var, momentum, eps, train)`: a
/// block per channel; see the module's step 2. The running statistics may be null (not
/// updated); in evaluation (`train == 0`) they are read and `partial` is not.
pub type FinalizeArgs = (*const f32, u64, u64, u64, *mut f32, *mut f32, *mut f32, *mut f32, f32, f32, u32);

/// `(x, y, mean, invstd, weight, bias, total, c, hw, layout)`: `y = ((x - mean) invstd) weight +
/// bias` per channel; `weight`, `bias` may be null (1 and 0).
pub type ApplyArgs<T> = (*const T, *mut T, *const f32, *const f32, *const f32, *const f32, u64, u64, u64, u32);

/// `(x, dy, mean, partial, c, hw, m, chunk, layout)`: as [`StatsArgs`], `partial[(ch * chunks +
/// p) * 2 ..][..2] = (sum dy, sum dy (x - mean))` of the chunk.
pub type ReduceArgs<T> = (*const T, *const T, *const f32, *mut f32, u64, u64, u64, u64, u32);

/// `(partial, chunks, c, invstd, sums, dweight, dbias)`: a block per channel: `sums[2 ch ..][..2]`
/// the totals of the chunks, `dweight[ch] = sums[2 ch + 1] invstd[ch]`, `dbias[ch] = sums[2 ch]`
/// (either may be null).
pub type BwdFinalizeArgs = (*const f32, u64, u64, *const f32, *mut f32, *mut f32, *mut f32);

/// `(x, dy, dx, mean, invstd, weight, sums, total, c, hw, m, layout, train)`: see the module's
/// backward; `weight` may be null (1).
pub type BwdArgs<T> =
    (*const T, *const T, *mut T, *const f32, *const f32, *const f32, *const f32, u64, u64, u64, u64, u32, u32);

/// Count, mean and sum of squared deviations (`M2`) of a set of values, the mean held as `k + q`:
/// `k` one of the values (or of an earlier set's), `q` the offset from it. Merges then work on
/// offsets of the data's spread, not on means rounded at the data's magnitude (with a mean of
/// 1e4 and a spread of 1e-2, an f32 mean alone is off by up to 5e-4, and `(mean_b - mean_a)^2`
/// by most of itself).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Moments {
    /// How many values.
    pub n: f32,
    /// The shift.
    pub k: f32,
    /// The mean minus the shift.
    pub q: f32,
    /// `sum (x - mean)^2`.
    pub m2: f32,
}

impl Moments {
    /// No values.
    pub const EMPTY: Moments = Moments { n: 0.0, k: 0.0, q: 0.0, m2: 0.0 };

    /// The moments of `n` values from their shifted sums `s1 = sum (x - k)`, `s2 = sum (x -
    /// k)^2`. A negative `M2` (rounding) is 0; a NaN stays.
    #[inline(always)]
    pub fn from_shifted(n: u32, k: f32, s1: f32, s2: f32) -> Moments {
        if n == 0 {
            return Moments::EMPTY;
        }
        let q = s1 / n as f32;
        let m2 = s2 - s1 * q;
        Moments { n: n as f32, k, q, m2: if m2 < 0.0 { 0.0 } else { m2 } }
    }

    /// The mean, rounded once.
    #[inline(always)]
    pub fn mean(self) -> f32 {
        self.k + self.q
    }
}

/// The moments of the union of two disjoint sets (Chan, Golub and LeVeque's pairwise update) on
/// the shift of `a`: `d = (b.k - a.k + b.q) - a.q`, `q = a.q + d nb / n`, `M2 = a.M2 + b.M2 +
/// d^2 na nb / n`. `b.k - a.k` is exact where the two are within a factor of 2 (Sterbenz).
#[inline(always)]
pub fn merge(a: Moments, b: Moments) -> Moments {
    if b.n == 0.0 {
        return a;
    }
    if a.n == 0.0 {
        return b;
    }
    let n = a.n + b.n;
    let d = ((b.k - a.k) + b.q) - a.q;
    let f = b.n / n;
    Moments { n, k: a.k, q: a.q + d * f, m2: a.m2 + b.m2 + d * d * (a.n * f) }
}

/// The statistics launches' shape for `c` channels of `m` positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Block `(bx, by)`.
    pub block: (u32, u32),
    /// Blocks in x (channel groups).
    pub gx: u64,
    /// Chunks of each channel (blocks in y); 0 when `m == 0`.
    pub chunks: u64,
    /// Positions a chunk.
    pub chunk: u64,
}

/// The statistics launches for `layout`: chunks of `by * PER_THREAD` positions, widened by the
/// smallest multiple that keeps them within [`MAX_CHUNKS`]. Depends only on the shape, so the
/// order of every sum is the same on every GPU.
pub const fn plan(layout: u32, c: u64, m: u64) -> Plan {
    let (bx, by) = if layout == NHWC { (NHWC_CHANNELS, STATS_THREADS / NHWC_CHANNELS) } else { (1, STATS_THREADS) };
    let base = by as u64 * PER_THREAD;
    let mult = m.div_ceil(base).div_ceil(MAX_CHUNKS);
    let chunk = base * if mult == 0 { 1 } else { mult };
    Plan { block: (bx, by), gx: c.div_ceil(bx as u64), chunks: m.div_ceil(chunk), chunk }
}

/// `(a / b, a % b)`, in 32 bits where both fit (a 64-bit division is a long routine).
#[inline(always)]
pub fn divmod(a: u64, b: u64) -> (u64, u64) {
    if a <= u32::MAX as u64 && b <= u32::MAX as u64 {
        let (a, b) = (a as u32, b as u32);
        let q = a / b;
        (q as u64, (a - q * b) as u64)
    } else {
        let q = a / b;
        (q, a - q * b)
    }
}

/// Where position `j` (`n * hw + s`) of channel `ch` is: `(n * c + ch) * hw + s` in NCHW, `j * c
/// + ch` in NHWC. `hw > 0`.
#[inline(always)]
pub fn offset(j: u64, ch: u64, c: u64, hw: u64, layout: u32) -> u64 {
    if layout == NHWC {
        j * c + ch
    } else {
        let (n, s) = divmod(j, hw);
        (n * c + ch) * hw + s
    }
}

/// The channel of element `i`: `(i / hw) % c` in NCHW, `i % c` in NHWC. `c, hw > 0`.
#[inline(always)]
pub fn channel(i: u64, c: u64, hw: u64, layout: u32) -> u64 {
    if layout == NHWC { divmod(i, c).1 } else { divmod(divmod(i, hw).0, c).1 }
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::Elem;
    use crate::math::{fma, rsqrt};
    use crate::prim::*;

    /// # Safety
    /// `s` holds at least `4 (i + 1)` floats.
    #[inline(always)]
    unsafe fn load4(s: *const f32, i: usize) -> Moments {
        // SAFETY: per the contract.
        unsafe { Moments { n: *s.add(4 * i), k: *s.add(4 * i + 1), q: *s.add(4 * i + 2), m2: *s.add(4 * i + 3) } }
    }

    /// # Safety
    /// `s` holds at least `4 (i + 1)` floats.
    #[inline(always)]
    unsafe fn store4(s: *mut f32, i: usize, v: Moments) {
        // SAFETY: per the contract.
        unsafe {
            *s.add(4 * i) = v.n;
            *s.add(4 * i + 1) = v.k;
            *s.add(4 * i + 2) = v.q;
            *s.add(4 * i + 3) = v.m2;
        }
    }

    /// Merges the moments of the block's rows (`by`, a power of two) into row 0 of `s`, a tree
    /// in a fixed order; `me = ty * bx + tx`.
    ///
    /// # Safety
    /// `s` holds `4 bx by` floats, every thread of the block calls it.
    #[inline(always)]
    unsafe fn tree_moments(s: *mut f32, mine: Moments, bx: u32, by: u32, tx: u32, ty: u32) {
        let me = (ty * bx + tx) as usize;
        // SAFETY: me < bx by; the partner below too; barriers between the levels.
        unsafe {
            store4(s, me, mine);
            sync_threads();
            let mut half = by / 2;
            while half > 0 {
                if ty < half {
                    let o = ((ty + half) * bx + tx) as usize;
                    store4(s, me, merge(load4(s, me), load4(s, o)));
                }
                sync_threads();
                half /= 2;
            }
        }
    }

    /// Sums the pairs of the block's rows into row 0 of `s` (`2 bx by` floats), as
    /// [`tree_moments`].
    ///
    /// # Safety
    /// As [`tree_moments`], with `2 bx by` floats.
    #[inline(always)]
    unsafe fn tree_sums(s: *mut f32, mine: (f32, f32), bx: u32, by: u32, tx: u32, ty: u32) {
        let me = (ty * bx + tx) as usize;
        // SAFETY: as in `tree_moments`.
        unsafe {
            *s.add(2 * me) = mine.0;
            *s.add(2 * me + 1) = mine.1;
            sync_threads();
            let mut half = by / 2;
            while half > 0 {
                if ty < half {
                    let o = ((ty + half) * bx + tx) as usize;
                    *s.add(2 * me) += *s.add(2 * o);
                    *s.add(2 * me + 1) += *s.add(2 * o + 1);
                }
                sync_threads();
                half /= 2;
            }
        }
    }

    /// See [`StatsArgs`].
    #[inline(always)]
    pub unsafe fn fwd_stats<T: Elem>(x: *const T, partial: *mut f32, c: u64, hw: u64, m: u64, chunk: u64, layout: u32) {
        let (bx, by, tx, ty) = (block_dim_x(), block_dim_y(), thread_idx_x(), thread_idx_y());
        let ch = block_idx_x() as u64 * bx as u64 + tx as u64;
        let (p, chunks) = (block_idx_y() as u64, grid_dim_y() as u64);
        let start = p * chunk;
        let end = if start + chunk < m { start + chunk } else { m };
        let (mut n, mut k, mut s1, mut s2) = (0u32, 0.0f32, 0.0f32, 0.0f32);
        if ch < c {
            let mut j = start + ty as u64;
            while j < end {
                // SAFETY: j < m and ch < c: the offset is inside x's n c hw elements.
                let v = unsafe { (*x.add(offset(j, ch, c, hw, layout) as usize)).to_f32() };
                if n == 0 {
                    k = v;
                }
                let d = v - k;
                s1 += d;
                s2 = fma(d, d, s2);
                n += 1;
                j += by as u64;
            }
        }
        let s = dyn_smem::<f32>();
        // SAFETY: the launch gives 4 bx by floats of shared memory; every thread gets here.
        unsafe { tree_moments(s, Moments::from_shifted(n, k, s1, s2), bx, by, tx, ty) };
        if ty == 0 && ch < c {
            // SAFETY: partial holds 4 c chunks floats; row 0 of s is the block's result.
            unsafe { store4(partial, (ch * chunks + p) as usize, load4(s, tx as usize)) };
        }
    }

    /// See [`FinalizeArgs`].
    #[inline(always)]
    pub unsafe fn fwd_finalize(
        partial: *const f32,
        chunks: u64,
        c: u64,
        m: u64,
        mean: *mut f32,
        invstd: *mut f32,
        rm: *mut f32,
        rv: *mut f32,
        momentum: f32,
        eps: f32,
        train: u32,
    ) {
        let ch = block_idx_x() as u64;
        let t = thread_idx_x();
        if ch >= c {
            return;
        }
        let chu = ch as usize;
        if train == 0 {
            if t == 0 {
                // SAFETY: the four per-channel arrays hold c floats; in evaluation rm, rv are not null.
                unsafe {
                    *mean.add(chu) = *rm.add(chu);
                    *invstd.add(chu) = rsqrt(*rv.add(chu) + eps);
                }
            }
            return;
        }
        let mut acc = Moments::EMPTY;
        let mut p = t as u64;
        while p < chunks {
            // SAFETY: partial holds 4 c chunks floats.
            acc = merge(acc, unsafe { load4(partial, (ch * chunks + p) as usize) });
            p += block_dim_x() as u64;
        }
        let s = dyn_smem::<f32>();
        // SAFETY: the launch gives 4 FINAL_THREADS floats of shared memory; a 1-D block is one
        // column of `by` rows.
        unsafe { tree_moments(s, acc, 1, block_dim_x(), 0, t) };
        if t != 0 {
            return;
        }
        // SAFETY: row 0 of s is the channel's; the per-channel arrays hold c floats.
        unsafe {
            let r = load4(s, 0);
            if m == 0 {
                *mean.add(chu) = 0.0;
                *invstd.add(chu) = 0.0;
                return;
            }
            let mu = r.mean();
            *mean.add(chu) = mu;
            *invstd.add(chu) = rsqrt(r.m2 / m as f32 + eps);
            if !rm.is_null() {
                *rm.add(chu) = (1.0 - momentum) * *rm.add(chu) + momentum * mu;
            }
            if !rv.is_null() {
                let unbiased = r.m2 / (m - 1) as f32;
                *rv.add(chu) = (1.0 - momentum) * *rv.add(chu) + momentum * unbiased;
            }
        }
    }

    /// See [`ApplyArgs`].
    #[inline(always)]
    pub unsafe fn fwd<T: Elem>(
        x: *const T,
        y: *mut T,
        mean: *const f32,
        invstd: *const f32,
        w: *const f32,
        b: *const f32,
        total: u64,
        c: u64,
        hw: u64,
        layout: u32,
    ) {
        let mut i = global_thread_x();
        while i < total {
            let ch = channel(i, c, hw, layout) as usize;
            // SAFETY: i < total elements of x and y; ch < c for the per-channel arrays.
            unsafe {
                let wv = if w.is_null() { 1.0 } else { *w.add(ch) };
                let bv = if b.is_null() { 0.0 } else { *b.add(ch) };
                let v = ((*x.add(i as usize)).to_f32() - *mean.add(ch)) * *invstd.add(ch);
                *y.add(i as usize) = T::from_f32(fma(v, wv, bv));
            }
            i += grid_threads_x();
        }
    }

    /// See [`ReduceArgs`].
    #[inline(always)]
    pub unsafe fn bwd_reduce<T: Elem>(
        x: *const T,
        dy: *const T,
        mean: *const f32,
        partial: *mut f32,
        c: u64,
        hw: u64,
        m: u64,
        chunk: u64,
        layout: u32,
    ) {
        let (bx, by, tx, ty) = (block_dim_x(), block_dim_y(), thread_idx_x(), thread_idx_y());
        let ch = block_idx_x() as u64 * bx as u64 + tx as u64;
        let (p, chunks) = (block_idx_y() as u64, grid_dim_y() as u64);
        let start = p * chunk;
        let end = if start + chunk < m { start + chunk } else { m };
        let (mut sg, mut sgx) = (0.0f32, 0.0f32);
        if ch < c {
            // SAFETY: ch < c.
            let mu = unsafe { *mean.add(ch as usize) };
            let mut j = start + ty as u64;
            while j < end {
                let o = offset(j, ch, c, hw, layout) as usize;
                // SAFETY: j < m and ch < c: inside x and dy.
                let (xv, g) = unsafe { ((*x.add(o)).to_f32(), (*dy.add(o)).to_f32()) };
                sg += g;
                sgx = fma(g, xv - mu, sgx);
                j += by as u64;
            }
        }
        let s = dyn_smem::<f32>();
        // SAFETY: the launch gives 2 bx by floats (it gives 4); every thread gets here.
        unsafe { tree_sums(s, (sg, sgx), bx, by, tx, ty) };
        if ty == 0 && ch < c {
            let at = 2 * (ch * chunks + p) as usize;
            // SAFETY: partial holds 2 c chunks floats.
            unsafe {
                *partial.add(at) = *s.add(2 * tx as usize);
                *partial.add(at + 1) = *s.add(2 * tx as usize + 1);
            }
        }
    }

    /// See [`BwdFinalizeArgs`].
    #[inline(always)]
    pub unsafe fn bwd_finalize(
        partial: *const f32,
        chunks: u64,
        c: u64,
        invstd: *const f32,
        sums: *mut f32,
        dw: *mut f32,
        db: *mut f32,
    ) {
        let ch = block_idx_x() as u64;
        let t = thread_idx_x();
        if ch >= c {
            return;
        }
        let (mut sg, mut sgx) = (0.0f32, 0.0f32);
        let mut p = t as u64;
        while p < chunks {
            let at = 2 * (ch * chunks + p) as usize;
            // SAFETY: partial holds 2 c chunks floats.
            unsafe {
                sg += *partial.add(at);
                sgx += *partial.add(at + 1);
            }
            p += block_dim_x() as u64;
        }
        let s = dyn_smem::<f32>();
        // SAFETY: the launch gives 2 FINAL_THREADS floats (it gives 4).
        unsafe { tree_sums(s, (sg, sgx), 1, block_dim_x(), 0, t) };
        if t == 0 {
            let chu = ch as usize;
            // SAFETY: sums holds 2 c floats, the others c (or are null).
            unsafe {
                let (g, gx) = (*s, *s.add(1));
                *sums.add(2 * chu) = g;
                *sums.add(2 * chu + 1) = gx;
                if !dw.is_null() {
                    *dw.add(chu) = gx * *invstd.add(chu);
                }
                if !db.is_null() {
                    *db.add(chu) = g;
                }
            }
        }
    }

    /// See [`BwdArgs`].
    #[inline(always)]
    pub unsafe fn bwd<T: Elem>(
        x: *const T,
        dy: *const T,
        dx: *mut T,
        mean: *const f32,
        invstd: *const f32,
        w: *const f32,
        sums: *const f32,
        total: u64,
        c: u64,
        hw: u64,
        m: u64,
        layout: u32,
        train: u32,
    ) {
        let mf = m as f32;
        let mut i = global_thread_x();
        while i < total {
            let ch = channel(i, c, hw, layout) as usize;
            // SAFETY: i < total elements of x, dy, dx; ch < c for the per-channel arrays, 2 c for sums.
            unsafe {
                let wv = if w.is_null() { 1.0 } else { *w.add(ch) };
                let is = *invstd.add(ch);
                let g = (*dy.add(i as usize)).to_f32();
                let v = if train != 0 {
                    let grad_mean = *sums.add(2 * ch) / mf;
                    let proj = *sums.add(2 * ch + 1) / mf * is * is;
                    let xm = (*x.add(i as usize)).to_f32() - *mean.add(ch);
                    (g - grad_mean - xm * proj) * (is * wv)
                } else {
                    g * (is * wv)
                };
                *dx.add(i as usize) = T::from_f32(v);
            }
            i += grid_threads_x();
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

/// The storage types' kernels, typed.
pub trait BatchNormElem: crate::Elem {
    /// `batch_norm_fwd_stats_<dtype>`.
    const STATS: Kernel<StatsArgs<Self>>;
    /// `batch_norm_fwd_<dtype>`.
    const FWD: Kernel<ApplyArgs<Self>>;
    /// `batch_norm_bwd_reduce_<dtype>`.
    const REDUCE: Kernel<ReduceArgs<Self>>;
    /// `batch_norm_bwd_<dtype>`.
    const BWD: Kernel<BwdArgs<Self>>;
}

macro_rules! batch_norm_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<batch_norm_fwd_stats_ $sfx>]: StatsArgs<$T> =
                |x, partial, c, hw, m, chunk, layout| fwd_stats::<$T>(x, partial, c, hw, m, chunk, layout));
            $crate::kernel!([<batch_norm_fwd_ $sfx>]: ApplyArgs<$T> =
                |x, y, mean, invstd, w, b, total, c, hw, layout|
                    fwd::<$T>(x, y, mean, invstd, w, b, total, c, hw, layout));
            $crate::kernel!([<batch_norm_bwd_reduce_ $sfx>]: ReduceArgs<$T> =
                |x, dy, mean, partial, c, hw, m, chunk, layout|
                    bwd_reduce::<$T>(x, dy, mean, partial, c, hw, m, chunk, layout));
            $crate::kernel!([<batch_norm_bwd_ $sfx>]: BwdArgs<$T> =
                |x, dy, dx, mean, invstd, w, sums, total, c, hw, m, layout, train|
                    bwd::<$T>(x, dy, dx, mean, invstd, w, sums, total, c, hw, m, layout, train));
            #[cfg(not(target_arch = "nvptx64"))]
            impl BatchNormElem for $T {
                const STATS: Kernel<StatsArgs<$T>> = [<batch_norm_fwd_stats_ $sfx>];
                const FWD: Kernel<ApplyArgs<$T>> = [<batch_norm_fwd_ $sfx>];
                const REDUCE: Kernel<ReduceArgs<$T>> = [<batch_norm_bwd_reduce_ $sfx>];
                const BWD: Kernel<BwdArgs<$T>> = [<batch_norm_bwd_ $sfx>];
            }
        }
    };
}
crate::for_each_elem!(batch_norm_kernels);

crate::kernel!(batch_norm_fwd_finalize: FinalizeArgs =
    |partial, chunks, c, m, mean, invstd, rm, rv, momentum, eps, train|
        fwd_finalize(partial, chunks, c, m, mean, invstd, rm, rv, momentum, eps, train));
crate::kernel!(batch_norm_bwd_finalize: BwdFinalizeArgs =
    |partial, chunks, c, invstd, sums, dw, db| bwd_finalize(partial, chunks, c, invstd, sums, dw, db));

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    use crate::dtype::{BF16, F16};
    [
        f32::STATS.entry(),
        F16::STATS.entry(),
        BF16::STATS.entry(),
        f32::FWD.entry(),
        F16::FWD.entry(),
        BF16::FWD.entry(),
        f32::REDUCE.entry(),
        F16::REDUCE.entry(),
        BF16::REDUCE.entry(),
        f32::BWD.entry(),
        F16::BWD.entry(),
        BF16::BWD.entry(),
        batch_norm_fwd_finalize.entry(),
        batch_norm_bwd_finalize.entry(),
    ]
    .into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    /// The kernels' merge order on the CPU: threads' shifted sums, then the tree.
    fn moments_like_kernel(xs: &[f32], threads: usize) -> Moments {
        let mut m: Vec<Moments> = (0..threads)
            .map(|t| {
                let (mut n, mut k, mut s1, mut s2) = (0u32, 0.0f32, 0.0f32, 0.0f32);
                for &v in xs.iter().skip(t).step_by(threads) {
                    if n == 0 {
                        k = v;
                    }
                    let d = v - k;
                    s1 += d;
                    s2 = d.mul_add(d, s2);
                    n += 1;
                }
                Moments::from_shifted(n, k, s1, s2)
            })
            .collect();
        let mut half = threads / 2;
        while half > 0 {
            for t in 0..half {
                m[t] = merge(m[t], m[t + half]);
            }
            half /= 2;
        }
        m[0]
    }

    #[test]
    fn moments_are_stable_at_large_means() {
        // 1e4 + 3.4e-2 z: the f64 variance against the kernels' order; a naive sum of squares
        // (4096 values of 1e8) would lose every digit of a 1e-4 variance.
        let mut state = 7u64;
        let mut z = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f64 / (1u64 << 24) as f64) - 0.5
        };
        let xs: Vec<f32> = (0..4096).map(|_| (1e4 + 3.4e-2 * z()) as f32).collect();
        let n = xs.len() as f64;
        let mean: f64 = xs.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var: f64 = xs.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let got = moments_like_kernel(&xs, 256);
        assert_eq!(got.n, 4096.0);
        // The mean: its rounding to f32 (half an ulp of 1e4, 2^-11) and the offsets' error.
        assert!((got.mean() as f64 - mean).abs() <= 2f64.powi(-11) + 1e-6, "{} {mean}", got.mean());
        // The variance: a few hundred roundings relative to itself (16 terms a thread, 8 levels
        // of merges), far inside 1e-4.
        assert!(((got.m2 as f64 / n) - var).abs() < 1e-4 * var, "{} {var}", got.m2 as f64 / n);
    }

    #[test]
    fn merges_of_empty_and_one() {
        let a = Moments::from_shifted(1, 3.0, 0.0, 0.0);
        assert_eq!(a, Moments { n: 1.0, k: 3.0, q: 0.0, m2: 0.0 });
        assert_eq!(merge(a, Moments::EMPTY), a);
        assert_eq!(merge(Moments::EMPTY, a), a);
        let b = Moments::from_shifted(1, 5.0, 0.0, 0.0);
        assert_eq!(merge(a, b), Moments { n: 2.0, k: 3.0, q: 1.0, m2: 2.0 });
        assert_eq!(merge(a, b).mean(), 4.0);
        assert_eq!(Moments::from_shifted(0, 1.0, 2.0, 3.0), Moments::EMPTY);
        assert!(Moments::from_shifted(2, f32::NAN, 0.0, 0.0).mean().is_nan());
    }

    #[test]
    fn plans_cover_every_position() {
        for layout in [NCHW, NHWC] {
            for c in [1u64, 3, 32, 33, 2048] {
                for m in [0u64, 1, 2, 255, 4096, 4097, 802_816, 1 << 32] {
                    let p = plan(layout, c, m);
                    assert_eq!(p.block.0 * p.block.1, STATS_THREADS);
                    assert!(p.block.1.is_power_of_two());
                    assert!(p.gx * p.block.0 as u64 >= c);
                    assert!(p.chunks <= MAX_CHUNKS);
                    assert!(p.chunks * p.chunk >= m && (p.chunks == 0 || (p.chunks - 1) * p.chunk < m));
                }
            }
        }
    }

    #[test]
    fn offsets_and_channels() {
        let (n, c, hw) = (3u64, 5u64, 7u64);
        for layout in [NCHW, NHWC] {
            let mut seen = std::vec![false; (n * c * hw) as usize];
            for ch in 0..c {
                for j in 0..n * hw {
                    let o = offset(j, ch, c, hw, layout);
                    assert_eq!(channel(o, c, hw, layout), ch);
                    assert!(!seen[o as usize]);
                    seen[o as usize] = true;
                }
            }
            assert!(seen.iter().all(|&s| s));
        }
        assert_eq!(divmod(1 << 40, 3), ((1 << 40) / 3, (1 << 40) % 3));
    }
}
