//! Indexing along one dimension, as PyTorch's `index_select`, `index_add`, `gather` and
//! `scatter_add`. Tensors are contiguous and row-major; indices are int64.
//!
//! - `index_select` and `index_add` see their tensors as `[outer, rows, inner]` around the
//!   indexed dimension, with a 1-d index: they are the embedding's gather and sums of rows
//!   (`embedding.rs`, `gather_rows`, `sum_rows`) with `outer` slabs, one 16-byte vector of a
//!   row a thread where `inner` allows.
//! - `gather` takes an index of the input's rank: one output element a thread, its source found
//!   through the strided geometry of `broadcast.rs` ([`StridedGeom`]: the input's strides on the
//!   index's shape, 0 along the indexed dimension) plus `idx * dim_stride`.
//! - `scatter_add` and `index_add` are deterministic without float atomics: the indices are
//!   sorted by the embedding's bitonic sort, into keys `(row << 32) | position` where a row is an
//!   index plus its line's first row (`embedding::line_of`: the positions of the index that
//!   differ only along the indexed dimension form a line, and each line owns `dim_size` rows).
//!   Each output element then adds, in f32 from its own value, the sources of its row's keys in
//!   increasing position, and rounds once.
//!
//! An index outside `[0, dim_size)` (negative ones included, as in PyTorch) makes a kernel store
//! its position plus one at `bad` (any one of them when there are several), which the host reads
//! back and reports; the gathers write zeros for it, the sums drop it.

use crate::broadcast::{MAX_RANK, StridedGeom};
use crate::kernel::Kernel;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::KernelEntry;

#[cfg(target_arch = "nvptx64")]
use crate::embedding::{gather_rows, sum_rows};

/// `(x, idx, out, bad, outer, n, v, d)`: `index_select`: `x` is `[outer, v, d]`, `out`
/// `[outer, n, d]`, `out[a, i, ..] = x[a, idx[i], ..]` (see `embedding::gather_rows`).
pub type IndexSelectArgs<T> = (*const T, *const i64, *mut T, *mut u64, u64, u64, u64, u64);

/// `(dst, src, keys, starts, out, outer, v, k, d)`: `index_add`: `dst` and `out` are `[outer, v,
/// d]` (`out` may be `dst`; `dst` null reads as zeros), `src` `[outer, k, d]`, the keys of the `k`
/// indices sorted, `starts` their `v + 1` row bounds (see `embedding::sum_rows`).
pub type IndexAddArgs<T> = (*const T, *const T, *const u64, *const u64, *mut T, u64, u64, u64, u64);

/// `(x, idx, out, bad, geom, dim_stride, dim_size, n)`: `gather`: for the `n` elements of the
/// index (and output) shape `geom.shape`, `out[p] = x[offset(p) + idx[p] * dim_stride]` with
/// `offset` reading `geom.strides` (the input's, 0 along the indexed dimension); zeros where
/// `idx[p]` is outside `[0, dim_size)`, and then `*bad = p + 1` unless `bad` is null.
pub type GatherArgs<T> = (*const T, *const i64, *mut T, *mut u64, StridedGeom, u64, u64, u64);

/// `(dst, src, keys, line_starts, out, geom, n)`: `scatter_add` over the `n` elements of
/// `geom.shape` (see [`ScatterGeom`]): `out[q]` = `dst[q]` (+0.0 where `dst` is null) plus, in
/// increasing position, the `src` element of every sorted key of `q`'s row; `line_starts` holds
/// the lines' first keys (`lines + 1`). `out` may be `dst`.
pub type ScatterAddArgs<T> = (*const T, *const T, *const u64, *const u64, *mut T, ScatterGeom, u64);

/// `(idx, bad, n, v)`: `*bad = i + 1` for an index `idx[i]` outside `[0, v)` (any one), for the
/// ops that have indices to check and no element to compute.
pub type IndexCheckArgs = (*const i64, *mut u64, u64, u64);

/// The geometry of a `scatter_add` (output `dst`, index `idx`, source `src`, all of one rank, the
/// indexed dimension `dim`). Unused dimensions (past `rank`) are 1 with strides 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScatterGeom {
    /// Dimensions in use.
    pub rank: u32,
    /// The indexed dimension.
    pub dim: u32,
    /// The output's shape (`dst`'s).
    pub shape: [u64; MAX_RANK],
    /// The index's shape, `u64::MAX` at `dim`: an output element whose other coordinates reach
    /// past it receives nothing.
    pub limit: [u64; MAX_RANK],
    /// The row-major strides of the index's shape without `dim` (0 at `dim`): an output
    /// element's line.
    pub line_strides: [u64; MAX_RANK],
    /// The source's element strides, 0 at `dim`.
    pub src_strides: [u64; MAX_RANK],
    /// The source's stride along `dim`.
    pub src_dim_stride: u64,
    /// The index's size along `dim`.
    pub k: u64,
    /// The product of the index's sizes after `dim`.
    pub b: u64,
    /// The output's size along `dim`: the rows of a line.
    pub v: u64,
}

/// A kernel parameter: a plain `#[repr(C)]` value of integers, 8-byte aligned.
impl crate::kernel::Param for ScatterGeom {}

/// Where output element `q` of a scatter stands: whether it lies on a line of the index (its
/// coordinates other than `dim` within the index's shape), that line, the source offset of the
/// line's first element, and its coordinate along `dim`. The dimensions are walked with constant
/// indices (unrolled), as `broadcast::offset`.
#[inline(always)]
#[allow(unused_assignments)] // the last dimension's `i /= n`
pub fn scatter_site(mut i: u64, g: &ScatterGeom) -> (bool, u64, u64, u64) {
    let (mut inside, mut line, mut sbase, mut c) = (true, 0, 0, 0);
    macro_rules! dim {
        ($d:expr) => {
            if ($d as u32) < g.rank {
                let n = g.shape[$d];
                let x = i % n;
                i /= n;
                inside &= x < g.limit[$d];
                line += x * g.line_strides[$d];
                sbase += x * g.src_strides[$d];
                if $d as u32 == g.dim {
                    c = x;
                }
            }
        };
    }
    dim!(7);
    dim!(6);
    dim!(5);
    dim!(4);
    dim!(3);
    dim!(2);
    dim!(1);
    dim!(0);
    (inside, line, sbase, c)
}

/// The coordinate along `dim` of index position `p` (below `2^32`) of an index `[.., k, b]`.
#[inline(always)]
pub fn along(p: u64, k: u64, b: u64) -> u64 {
    ((p as u32 / b as u32) % k as u32) as u64
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::broadcast::offset;
    use crate::dtype::Elem;
    use crate::embedding::{in_range, lower_bound};
    use crate::prim::*;

    /// See [`GatherArgs`].
    ///
    /// # Safety
    /// `x` holds every offset the geometry gives for an index in `[0, dim_size)`; `idx` and
    /// `out` hold `n` elements; `bad` is null or one u64.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gather<T: Elem>(
        x: *const T,
        idx: *const i64,
        out: *mut T,
        bad: *mut u64,
        g: StridedGeom,
        dim_stride: u64,
        dim_size: u64,
        n: u64,
    ) {
        let mut p = global_thread_x();
        while p < n {
            // SAFETY: the function contract; x is read only where the index is in range.
            unsafe {
                let r = *idx.add(p as usize);
                let ok = in_range(r, dim_size);
                *out.add(p as usize) = if ok {
                    *x.add((offset(p, g.rank, &g.shape, &g.strides) + r as u64 * dim_stride) as usize)
                } else {
                    T::from_f32(0.0)
                };
                if !ok && !bad.is_null() {
                    *bad = p + 1;
                }
            }
            p += grid_threads_x();
        }
    }

    /// See [`ScatterAddArgs`].
    ///
    /// # Safety
    /// `dst` (unless null) and `out` hold the `n` elements of `g.shape`; `src` holds every offset
    /// the geometry gives; `keys` are sorted and `line_starts` holds their lines' bounds; `out`
    /// may be `dst` (each element is read and written by one thread).
    #[inline(always)]
    pub unsafe fn scatter_add<T: Elem>(
        dst: *const T,
        src: *const T,
        keys: *const u64,
        line_starts: *const u64,
        out: *mut T,
        g: ScatterGeom,
        n: u64,
    ) {
        let mut q = global_thread_x();
        while q < n {
            let (inside, line, sbase, c) = scatter_site(q, &g);
            // SAFETY: the function contract: q < n; a line below the index's has bounds in
            // line_starts, whose keys hold positions of the index, each of which gives a source
            // offset inside src.
            unsafe {
                let mut acc = if dst.is_null() { 0.0f32 } else { (*dst.add(q as usize)).to_f32() };
                if inside {
                    let row = line * g.v + c;
                    let (l0, l1) = (*line_starts.add(line as usize), *line_starts.add(line as usize + 1));
                    let mut p = l0 + lower_bound(l1 - l0, row << 32, |o| *keys.add((l0 + o) as usize));
                    while p < l1 {
                        let key = *keys.add(p as usize);
                        if key >> 32 != row {
                            break;
                        }
                        let j = along(key & 0xffff_ffff, g.k, g.b);
                        acc += (*src.add((sbase + j * g.src_dim_stride) as usize)).to_f32();
                        p += 1;
                    }
                }
                *out.add(q as usize) = T::from_f32(acc);
            }
            q += grid_threads_x();
        }
    }

    /// See [`IndexCheckArgs`].
    ///
    /// # Safety
    /// `idx` holds `n` indices, `bad` one u64.
    #[inline(always)]
    pub unsafe fn check_range(idx: *const i64, bad: *mut u64, n: u64, v: u64) {
        let mut i = global_thread_x();
        while i < n {
            // SAFETY: the function contract.
            unsafe {
                if !in_range(*idx.add(i as usize), v) {
                    *bad = i + 1;
                }
            }
            i += grid_threads_x();
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

/// A storage type's index kernels, typed.
pub trait IndexElem: crate::Elem {
    /// `index_select_<dtype>`.
    const SELECT: Kernel<IndexSelectArgs<Self>>;
    /// `index_add_<dtype>`.
    const ADD: Kernel<IndexAddArgs<Self>>;
    /// `gather_<dtype>`.
    const GATHER: Kernel<GatherArgs<Self>>;
    /// `scatter_add_<dtype>`.
    const SCATTER_ADD: Kernel<ScatterAddArgs<Self>>;
}

macro_rules! index_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<index_select_ $sfx>]: IndexSelectArgs<$T> =
                |x, idx, out, bad, outer, n, v, d| gather_rows::<$T>(x, idx, out, bad, outer, n, v, d));
            $crate::kernel!([<index_add_ $sfx>]: IndexAddArgs<$T> =
                |dst, src, keys, starts, out, outer, v, k, d|
                    sum_rows::<$T>(src, keys, starts, dst, out, outer, v, k, d));
            $crate::kernel!([<gather_ $sfx>]: GatherArgs<$T> =
                |x, idx, out, bad, g, dim_stride, dim_size, n|
                    gather::<$T>(x, idx, out, bad, g, dim_stride, dim_size, n));
            $crate::kernel!([<scatter_add_ $sfx>]: ScatterAddArgs<$T> =
                |dst, src, keys, line_starts, out, g, n| scatter_add::<$T>(dst, src, keys, line_starts, out, g, n));
            #[cfg(not(target_arch = "nvptx64"))]
            impl IndexElem for $T {
                const SELECT: Kernel<IndexSelectArgs<$T>> = [<index_select_ $sfx>];
                const ADD: Kernel<IndexAddArgs<$T>> = [<index_add_ $sfx>];
                const GATHER: Kernel<GatherArgs<$T>> = [<gather_ $sfx>];
                const SCATTER_ADD: Kernel<ScatterAddArgs<$T>> = [<scatter_add_ $sfx>];
            }
        }
    };
}
crate::for_each_elem!(index_kernels);

crate::kernel!(index_check: IndexCheckArgs = |idx, bad, n, v| check_range(idx, bad, n, v));

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    use crate::dtype::{BF16, F16};
    fn entries<T: IndexElem>() -> [KernelEntry; 4]
    where
        IndexSelectArgs<T>: crate::kernel::Params,
        IndexAddArgs<T>: crate::kernel::Params,
        GatherArgs<T>: crate::kernel::Params,
        ScatterAddArgs<T>: crate::kernel::Params,
    {
        [T::SELECT.entry(), T::ADD.entry(), T::GATHER.entry(), T::SCATTER_ADD.entry()]
    }
    [entries::<f32>(), entries::<F16>(), entries::<BF16>()].into_iter().flatten().chain([index_check.entry()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedding::line_of;
    use std::vec::Vec;

    fn pad(v: &[u64], fill: u64) -> [u64; MAX_RANK] {
        let mut a = [fill; MAX_RANK];
        a[..v.len()].copy_from_slice(v);
        a
    }

    /// Every index position's line and coordinate, as the keys see them, against the site
    /// the scatter gives each output element: the output element at the position's
    /// coordinates (the index along `dim`) is on the same line, and the source offset is the
    /// position's in the source.
    #[test]
    fn sites_match_the_lines_of_the_keys() {
        // dst [4, 5, 6], idx [3, 2, 4] along dim 1 (K = 2, B = 4), src [3, 7, 5].
        let (dst, idx, src) = ([4u64, 5, 6], [3u64, 2, 4], [3u64, 7, 5]);
        let dim = 1;
        let g = ScatterGeom {
            rank: 3,
            dim: dim as u32,
            shape: pad(&dst, 1),
            limit: pad(&[3, u64::MAX, 4], 1),
            line_strides: pad(&[4, 0, 1], 0),
            src_strides: pad(&[src[1] * src[2], 0, 1], 0),
            src_dim_stride: src[2],
            k: 2,
            b: 4,
            v: 5,
        };
        let mut seen = 0;
        for p in 0..idx.iter().product::<u64>() {
            let (a, j, b) = (p / 8, (p / 4) % 2, p % 4);
            assert_eq!(along(p, 2, 4), j);
            for r in 0..dst[dim] {
                let q = (a * 5 + r) * 6 + b;
                let (inside, line, sbase, c) = scatter_site(q, &g);
                assert!(inside);
                assert_eq!(line, line_of(p, 2, 4), "position {p}");
                assert_eq!(c, r);
                assert_eq!(sbase + j * g.src_dim_stride, (a * src[1] + j) * src[2] + b);
                seen += 1;
            }
        }
        assert_eq!(seen, 24 * 5);
        // Elements past the index's shape receive nothing.
        let outside: Vec<u64> = (0..dst.iter().product()).filter(|&q| !scatter_site(q, &g).0).collect();
        assert_eq!(outside.len() as u64, 4 * 5 * 6 - 3 * 5 * 4);
        assert!(outside.iter().all(|&q| q / 30 >= 3 || q % 6 >= 4));
    }
}
