//! Embedding lookup: the forward gathers rows, `out[i, :] = weight[idx[i], :]` for a weight
//! `[V, D]` and `N` int64 indices; the backward sums the gradient rows of each index,
//! `grad_weight[v, :] = sum over i with idx[i] == v of grad_out[i, :]`, deterministically.
//!
//! Forward: a copy. A thread moves one 16-byte vector of a row where `D` is a multiple of the
//! vector width (every row then starts 16-byte aligned), one element otherwise; the items of all
//! rows are one index space walked by a grid-stride loop. An index outside `[0, V)` reads
//! nothing: its output row is written with zeros and, if the `bad` pointer is not null, `i + 1`
//! is stored there (any one such row when there are several), for the host to check on request.
//!
//! Backward, without float atomics, in four steps:
//! 1. Keys: `(idx[i] << 32) | i` for each valid index (in `[0, V)` and not `padding_idx`),
//!    `u64::MAX` for the others and for the padding up to `M`, the next power of two. Each key is
//!    unique, so any correct sort gives the same order: by row, then by position.
//!    (The index ops of `index.rs` sort with the same kernels: their keys put a line number above
//!    the index, [`line_of`], and they ask for a position of an index out of range, `bad`.)
//! 2. A bitonic sort of the `M` keys: tiles of up to [`TILE`] keys sorted in shared memory
//!    ([`SortTilesArgs`]), then for each merge size `k` above the tile the strides `j >= TILE`
//!    in global memory ([`SortStepArgs`]) and the rest in shared memory ([`SortMergeArgs`]).
//! 3. `starts[v]`: the first sorted key of row `v` (a binary search per row, `v <= V`), so row
//!    `v`'s occurrences are the keys `starts[v]..starts[v + 1]`.
//! 4. One thread per 16-byte vector (or element) of each of the `V` rows sums that row's
//!    gradient rows in f32 in ascending position order (`i` increasing), one addition at a time
//!    from +0.0, and writes the sum rounded once to the dtype; a row with no occurrence gets
//!    +0.0. Every output element is written exactly once, so no zero-fill is needed.

use crate::DType;
use crate::kernel::Kernel;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::KernelEntry;

/// `(weight, idx, out, bad, n, v, d)`: `out[i * d ..][..d] = weight[idx[i] * d ..][..d]` for
/// `i < n`, zeros where `idx[i]` is outside `[0, v)` (then `*bad = i + 1` unless `bad` is null).
/// `weight` holds `v * d` elements, `out` `n * d`, `idx` `n`; all 16-byte aligned.
pub type EmbeddingFwdArgs<T> = (*const T, *const i64, *mut T, *mut u64, u64, u64, u64);

/// `(idx, keys, bad, n, v, padding, k, b)`: builds the keys of positions `tile * c .. tile * (c +
/// 1)` (block `c`, `tile` twice the block's threads, a power of two) and sorts each tile ascending
/// or descending as the bitonic network's first `log2(tile)` merge sizes leave it. Position `i`'s
/// key is [`key`]`(idx[i], line_of(i, k, b) * v, i, v, padding)`; `padding` is the row whose
/// occurrences are dropped, or -1; an index outside `[0, v)` stores `i + 1` at `bad` unless it is
/// null. The embedding passes `k = n`, `b = 1` (one line). `idx` holds `n` indices, `keys` the
/// grid's tiles.
pub type SortTilesArgs = (*const i64, *mut u64, *mut u64, u64, u64, i64, u64, u64);

/// `(keys, m, k, j)`: one compare-exchange step of the bitonic network over all `m` keys (merge
/// size `k`, stride `j`), a thread per pair.
pub type SortStepArgs = (*mut u64, u64, u64, u64);

/// `(keys, k)`: the steps of merge size `k` with strides below the tile (`tile / 2` down to 1),
/// in shared memory, a block per tile (`tile` twice the block's threads).
pub type SortMergeArgs = (*mut u64, u64);

/// `(keys, starts, m, v, step)`: `starts[r]` for `r <= v`: the number of sorted keys below
/// `(r * step) << 32` (the embedding's rows: `step` 1; the scatter's lines of `step` rows each).
pub type StartsArgs = (*const u64, *mut u64, u64, u64, u64);

/// `(grad_out, keys, starts, grad_weight, v, d)`: `grad_weight[r * d + c]` for `r < v`, `c < d`:
/// the sum of `grad_out[(key & 0xffff_ffff) * d + c]` over the keys `starts[r]..starts[r + 1]`, in
/// that order, in f32.
pub type EmbeddingBwdArgs<T> = (*const T, *const u64, *const u64, *mut T, u64, u64);

/// The most keys a block sorts in shared memory (16 KiB), with half as many threads.
pub const TILE: u64 = 2048;

/// Gradient rows the backward loads before adding them (in order): the loads of a row's
/// occurrences overlap in batches of this many.
pub const BATCH: usize = 8;

/// The key marking an index that no row receives (out of range, padding) and the padding past
/// `n`: above every valid key, since rows are below `2^32 - 1`.
pub const DROPPED: u64 = u64::MAX;

/// Elements of `dt` in one 16-byte vector.
pub const fn vec_width(dt: DType) -> u64 {
    16 / dt.size() as u64
}

/// The work items of one row of `d` elements: 16-byte vectors where `d` is a multiple of the
/// vector width, else elements.
pub const fn row_items(dt: DType, d: u64) -> u64 {
    let v = vec_width(dt);
    if d.is_multiple_of(v) { d / v } else { d }
}

/// The sort key of index `r` at position `i` (`i < 2^32`) in the line whose first row is `base`:
/// `((base + r) << 32) | i`, or [`DROPPED`] for an index outside `[0, v)` or equal to `padding`.
/// The caller keeps `base + v` below `2^32`.
#[inline(always)]
pub fn key(r: i64, base: u64, i: u64, v: u64, padding: i64) -> u64 {
    if !in_range(r, v) || r == padding { DROPPED } else { ((base + r as u64) << 32) | i }
}

/// Whether index `r` lies in `[0, v)`.
#[inline(always)]
pub fn in_range(r: i64, v: u64) -> bool {
    r >= 0 && (r as u64) < v
}

/// The line of position `i` of indices of shape `[.., k, b]` (row-major): the positions that
/// differ only along the `k` dimension share a line, numbered row-major over the other
/// dimensions, `(i / (k b)) b + i % b`. One line (0) for `k b` = every index. Positions, `k` and
/// `b` are below `2^32` (the backward's limit), so the divisions are 32-bit.
#[inline(always)]
pub fn line_of(i: u64, k: u64, b: u64) -> u64 {
    let (i, kb, b) = (i as u32, (k * b) as u32, b as u32);
    ((i / kb) * b + i % b) as u64
}

/// The pair of compare-exchange `t` at stride `j` (a power of two): `(i, i + j)` with bit `j` of
/// `i` clear.
#[inline(always)]
pub const fn pair(t: u64, j: u64) -> (u64, u64) {
    let i = ((t & !(j - 1)) << 1) | (t & (j - 1));
    (i, i + j)
}

/// Whether the pair at global index `i` sorts ascending in the merge of size `k`.
#[inline(always)]
pub const fn ascending(i: u64, k: u64) -> bool {
    i & k == 0
}

/// The first position in `0..len` whose key (`get`) is not below `target`, for keys ascending.
#[inline(always)]
pub fn lower_bound(len: u64, target: u64, get: impl Fn(u64) -> u64) -> u64 {
    let (mut lo, mut hi) = (0, len);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if get(mid) < target { lo = mid + 1 } else { hi = mid }
    }
    lo
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::{Elem, for_lanes};
    use crate::prim::*;

    /// The gather of rows, also `index_select`'s (`index.rs`): `x` is `[outer, v, d]`, `out`
    /// `[outer, n, d]`, `out[a, i, ..] = x[a, idx[i], ..]`, zeros where `idx[i]` is outside
    /// `[0, v)` (then `*bad = i + 1` unless `bad` is null). The embedding is `outer = 1`.
    ///
    /// # Safety
    /// `x`, `idx` and `out` hold those shapes' elements, 16-byte aligned; `x` is not written by
    /// the launch; `bad` is null or one u64.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gather_rows<T: Elem>(
        x: *const T,
        idx: *const i64,
        out: *mut T,
        bad: *mut u64,
        outer: u64,
        n: u64,
        v: u64,
        d: u64,
    ) {
        let vw = T::VEC as u64;
        let vector = d.is_multiple_of(vw);
        let per_row = row_items(T::DTYPE, d);
        if per_row == 0 {
            return;
        }
        let total = outer * n * per_row;
        let mut t = global_thread_x();
        // 32-bit divisions where the indices fit (a 64-bit one is a long software routine).
        let narrow = total <= u32::MAX as u64;
        while t < total {
            let (row, k) = if narrow {
                let (t, p) = (t as u32, per_row as u32);
                let r = t / p;
                (r as u64, (t - r * p) as u64)
            } else {
                (t / per_row, t % per_row)
            };
            // The embedding's `outer` is the constant 1: no division.
            let (a, i) = if outer == 1 {
                (0, row)
            } else if narrow {
                let (row, n) = (row as u32, n as u32);
                ((row / n) as u64, (row % n) as u64)
            } else {
                (row / n, row % n)
            };
            // SAFETY: i < n indices, a < outer; row `r < v` of x's slab `a` and row `row` of
            // out hold d elements; on the vector path the offsets are multiples of the vector
            // width from 16-byte aligned allocations. x is not written by this launch.
            unsafe {
                let r = *idx.add(i as usize);
                let ok = in_range(r, v);
                let src = if ok { (a * v + r as u64) as usize * d as usize } else { 0 };
                if vector {
                    let at = (row * d + k * vw) as usize;
                    let val = if ok { ld_global_nc_v4(x.add(src + (k * vw) as usize) as *const u32) } else { [0; 4] };
                    st_global_v4(out.add(at) as *mut u32, val);
                } else {
                    let at = (row * d + k) as usize;
                    *out.add(at) = if ok { *x.add(src + k as usize) } else { T::from_f32(0.0) };
                }
                if !ok && k == 0 && !bad.is_null() {
                    *bad = i + 1;
                }
            }
            t += grid_threads_x();
        }
    }

    /// See [`EmbeddingFwdArgs`].
    #[inline(always)]
    pub unsafe fn fwd<T: Elem>(weight: *const T, idx: *const i64, out: *mut T, bad: *mut u64, n: u64, v: u64, d: u64) {
        // SAFETY: the same contract, with one slab.
        unsafe { gather_rows(weight, idx, out, bad, 1, n, v, d) }
    }

    /// One compare-exchange of the pair `(i, l)` of `s` (ascending if `asc`).
    ///
    /// # Safety
    /// `s` holds at least `l + 1` keys, which no other thread accesses during the call.
    #[inline(always)]
    unsafe fn exchange(s: *mut u64, i: u64, l: u64, asc: bool) {
        // SAFETY: per the function contract.
        unsafe {
            let (a, b) = (*s.add(i as usize), *s.add(l as usize));
            if (a > b) == asc {
                *s.add(i as usize) = b;
                *s.add(l as usize) = a;
            }
        }
    }

    /// See [`SortTilesArgs`].
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sort_tiles(
        idx: *const i64,
        keys: *mut u64,
        bad: *mut u64,
        n: u64,
        v: u64,
        padding: i64,
        lk: u64,
        lb: u64,
    ) {
        let s = dyn_smem::<u64>();
        let half = block_dim_x() as u64;
        let tile = 2 * half;
        let base = block_idx_x() as u64 * tile;
        let t = thread_idx_x() as u64;
        for e in [t, t + half] {
            let i = base + e;
            // SAFETY: i < n indices; `bad` is null or one u64; the block's shared memory holds
            // `tile` keys (the launch's).
            unsafe {
                let mut k = DROPPED;
                if i < n {
                    let r = *idx.add(i as usize);
                    k = key(r, line_of(i, lk, lb) * v, i, v, padding);
                    if !in_range(r, v) && !bad.is_null() {
                        *bad = i + 1;
                    }
                }
                *s.add(e as usize) = k;
            }
        }
        sync_threads();
        let mut k = 2;
        while k <= tile {
            let mut j = k / 2;
            while j > 0 {
                let (i, l) = pair(t, j);
                // SAFETY: l < tile; each key is one pair's this step (barriers between steps).
                unsafe { exchange(s, i, l, ascending(base + i, k)) };
                sync_threads();
                j /= 2;
            }
            k *= 2;
        }
        for e in [t, t + half] {
            // SAFETY: the grid's tiles are the keys' length; the element is this thread's.
            unsafe { *keys.add((base + e) as usize) = *s.add(e as usize) };
        }
    }

    /// See [`SortStepArgs`].
    #[inline(always)]
    pub unsafe fn sort_step(keys: *mut u64, m: u64, k: u64, j: u64) {
        let mut t = global_thread_x();
        while t < m / 2 {
            let (i, l) = pair(t, j);
            // SAFETY: l < m; each key belongs to one pair of the step.
            unsafe { exchange(keys, i, l, ascending(i, k)) };
            t += grid_threads_x();
        }
    }

    /// See [`SortMergeArgs`].
    #[inline(always)]
    pub unsafe fn sort_merge(keys: *mut u64, k: u64) {
        let s = dyn_smem::<u64>();
        let half = block_dim_x() as u64;
        let tile = 2 * half;
        let base = block_idx_x() as u64 * tile;
        let t = thread_idx_x() as u64;
        for e in [t, t + half] {
            // SAFETY: the grid's tiles are the keys' length; shared memory holds `tile` keys.
            unsafe { *s.add(e as usize) = *keys.add((base + e) as usize) };
        }
        sync_threads();
        let mut j = half;
        while j > 0 {
            let (i, l) = pair(t, j);
            // SAFETY: as in `sort_tiles`.
            unsafe { exchange(s, i, l, ascending(base + i, k)) };
            sync_threads();
            j /= 2;
        }
        for e in [t, t + half] {
            // SAFETY: as above.
            unsafe { *keys.add((base + e) as usize) = *s.add(e as usize) };
        }
    }

    /// See [`StartsArgs`].
    #[inline(always)]
    pub unsafe fn starts(keys: *const u64, starts: *mut u64, m: u64, v: u64, step: u64) {
        let mut r = global_thread_x();
        while r <= v {
            // SAFETY: the search reads keys below m; starts holds v + 1 entries.
            unsafe { *starts.add(r as usize) = lower_bound(m, (r * step) << 32, |p| *keys.add(p as usize)) };
            r += grid_threads_x();
        }
    }

    /// The sums of rows, also `index_add`'s (`index.rs`): `src` is `[outer, k, d]`, `out` and
    /// `dst` `[outer, v, d]`; `out[a, r, ..]` = `dst[a, r, ..]` (+0.0 where `dst` is null) plus
    /// `src[a, key & 0xffff_ffff, ..]` over the keys `starts[r]..starts[r + 1]` in that order, in
    /// f32, rounded once. The embedding's backward is `outer = 1`, `dst` null.
    ///
    /// # Safety
    /// The tensors hold those shapes' elements, 16-byte aligned; `starts` holds `v + 1` bounds of
    /// sorted keys whose positions are below `k`. `out` may be `dst` (each element is read and
    /// written by one thread); `src`, `keys` and `starts` are not written by the launch.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sum_rows<T: Elem>(
        src: *const T,
        keys: *const u64,
        starts: *const u64,
        dst: *const T,
        out: *mut T,
        outer: u64,
        v: u64,
        k: u64,
        d: u64,
    ) {
        let vw = T::VEC as u64;
        let vector = d.is_multiple_of(vw);
        let per_row = row_items(T::DTYPE, d);
        if per_row == 0 {
            return;
        }
        let total = outer * v * per_row;
        let mut t = global_thread_x();
        let narrow = total <= u32::MAX as u64;
        let pos = |p: u64| (p & 0xffff_ffff) as usize;
        while t < total {
            let (row, c) = if narrow {
                let (t, p) = (t as u32, per_row as u32);
                let r = t / p;
                (r as u64, (t - r * p) as u64)
            } else {
                (t / per_row, t % per_row)
            };
            // The embedding's `outer` is the constant 1: no division.
            let (a, r) = if outer == 1 {
                (0, row)
            } else if narrow {
                let (row, v) = (row as u32, v as u32);
                ((row / v) as u64, (row % v) as u64)
            } else {
                (row / v, row % v)
            };
            // SAFETY: per the function contract: r < v, a < outer; row `a * k + p` of src (p a
            // key's position, below k) and row `row` of dst and out hold d elements; on the
            // vector path the offsets are multiples of the vector width from 16-byte aligned
            // allocations. src, keys and starts are not written by this launch; dst is read
            // with a coherent load, as out may be dst.
            unsafe {
                let (s0, s1) = (*starts.add(r as usize), *starts.add(r as usize + 1));
                let du = d as usize;
                let slab = (a * k) as usize;
                if vector {
                    let col = (c * vw) as usize;
                    let at = row as usize * du + col;
                    let load = |p: usize| T::unpack(ld_global_nc_v4(src.add((slab + p) * du + col) as *const u32));
                    let mut acc =
                        if dst.is_null() { [0.0f32; 8] } else { T::unpack(ld_global_v4(dst.add(at) as *const u32)) };
                    let mut q = s0;
                    // BATCH rows in flight (a frequent token's row sums hundreds), added in order.
                    while q + BATCH as u64 <= s1 {
                        let ps: [usize; BATCH] = core::array::from_fn(|o| pos(*keys.add(q as usize + o)));
                        let rows = ps.map(load);
                        for row in &rows {
                            for_lanes::<T>(
                                #[inline(always)]
                                |l| acc[l] += row[l],
                            );
                        }
                        q += BATCH as u64;
                    }
                    while q < s1 {
                        let row = load(pos(*keys.add(q as usize)));
                        for_lanes::<T>(
                            #[inline(always)]
                            |l| acc[l] += row[l],
                        );
                        q += 1;
                    }
                    st_global_v4(out.add(at) as *mut u32, T::pack(&acc));
                } else {
                    let at = row as usize * du + c as usize;
                    let mut acc = if dst.is_null() { 0.0f32 } else { (*dst.add(at)).to_f32() };
                    let mut q = s0;
                    while q < s1 {
                        acc += (*src.add((slab + pos(*keys.add(q as usize))) * du + c as usize)).to_f32();
                        q += 1;
                    }
                    *out.add(at) = T::from_f32(acc);
                }
            }
            t += grid_threads_x();
        }
    }

    /// See [`EmbeddingBwdArgs`].
    #[inline(always)]
    pub unsafe fn bwd<T: Elem>(g: *const T, keys: *const u64, starts: *const u64, gw: *mut T, v: u64, d: u64) {
        // SAFETY: the same contract, with one slab and no dst.
        unsafe { sum_rows(g, keys, starts, core::ptr::null(), gw, 1, v, 0, d) }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

/// The storage types' kernels, typed.
pub trait EmbeddingElem: crate::Elem {
    /// `embedding_fwd_<dtype>`.
    const FWD: Kernel<EmbeddingFwdArgs<Self>>;
    /// `embedding_bwd_<dtype>`: the sums of step 4.
    const BWD: Kernel<EmbeddingBwdArgs<Self>>;
}

macro_rules! embedding_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<embedding_fwd_ $sfx>]: EmbeddingFwdArgs<$T> =
                |weight, idx, out, bad, n, v, d| fwd::<$T>(weight, idx, out, bad, n, v, d));
            $crate::kernel!([<embedding_bwd_ $sfx>]: EmbeddingBwdArgs<$T> =
                |g, keys, starts, gw, v, d| bwd::<$T>(g, keys, starts, gw, v, d));
            #[cfg(not(target_arch = "nvptx64"))]
            impl EmbeddingElem for $T {
                const FWD: Kernel<EmbeddingFwdArgs<$T>> = [<embedding_fwd_ $sfx>];
                const BWD: Kernel<EmbeddingBwdArgs<$T>> = [<embedding_bwd_ $sfx>];
            }
        }
    };
}
crate::for_each_elem!(embedding_kernels);

crate::kernel!(embedding_bwd_sort_tiles: SortTilesArgs =
    |idx, keys, bad, n, v, padding, k, b| sort_tiles(idx, keys, bad, n, v, padding, k, b));
crate::kernel!(embedding_bwd_sort_step: SortStepArgs = |keys, m, k, j| sort_step(keys, m, k, j));
crate::kernel!(embedding_bwd_sort_merge: SortMergeArgs = |keys, k| sort_merge(keys, k));
crate::kernel!(embedding_bwd_starts: StartsArgs =
    |keys, starts_out, m, v, step| starts(keys, starts_out, m, v, step));

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    use crate::dtype::{BF16, F16};
    [
        f32::FWD.entry(),
        F16::FWD.entry(),
        BF16::FWD.entry(),
        f32::BWD.entry(),
        F16::BWD.entry(),
        BF16::BWD.entry(),
        embedding_bwd_sort_tiles.entry(),
        embedding_bwd_sort_step.entry(),
        embedding_bwd_sort_merge.entry(),
        embedding_bwd_starts.entry(),
    ]
    .into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_and_keys() {
        assert_eq!(row_items(DType::BF16, 4096), 512);
        assert_eq!(row_items(DType::F32, 768), 192);
        assert_eq!(row_items(DType::F16, 9), 9);
        assert_eq!(row_items(DType::F32, 0), 0);
        assert_eq!(key(3, 0, 7, 10, -1), (3 << 32) | 7);
        assert_eq!(key(3, 20, 7, 10, -1), (23 << 32) | 7);
        assert_eq!(key(0, 0, 0, 10, -1), 0);
        for (r, p) in [(-1, -1), (10, -1), (11, -1), (i64::MIN, -1), (4, 4)] {
            assert_eq!(key(r, 0, 7, 10, p), DROPPED);
        }
        // The largest row and position allowed stay below DROPPED.
        assert!(key(u32::MAX as i64 - 1, 0, u32::MAX as u64, u32::MAX as u64, -1) < DROPPED);
        assert!(key(0, u32::MAX as u64 - 1, u32::MAX as u64, 1, -1) < DROPPED);
    }

    #[test]
    fn lines_group_positions_that_differ_along_k() {
        // Indices [2, 3, 4]: positions (a, j, b) with a < 2, j < 3, b < 4 lie on line a * 4 + b.
        for i in 0..24u64 {
            let (a, b) = (i / 12, i % 4);
            assert_eq!(line_of(i, 3, 4), a * 4 + b, "position {i}");
        }
        // One line: the embedding's (k = n, b = 1).
        assert!((0..100).all(|i| line_of(i, 100, 1) == 0));
    }

    #[test]
    fn pairs_cover_each_key_once() {
        for j in [1u64, 2, 4, 1024] {
            let m = 4 * j.max(2);
            let mut seen = [false; 8192];
            for t in 0..m / 2 {
                let (i, l) = pair(t, j);
                assert_eq!(l - i, j);
                assert_eq!(i & j, 0);
                assert!(!seen[i as usize] && !seen[l as usize]);
                seen[i as usize] = true;
                seen[l as usize] = true;
            }
            assert!(seen[..m as usize].iter().all(|&s| s));
        }
    }

    #[test]
    fn lower_bound_finds_the_first_not_below() {
        let keys = [1u64, 3, 3, 3, 7, DROPPED];
        let f = |t| lower_bound(keys.len() as u64, t, |p| keys[p as usize]);
        assert_eq!([f(0), f(1), f(2), f(3), f(4), f(7), f(8), f(DROPPED)], [0, 0, 1, 1, 4, 4, 5, 5]);
        assert_eq!(lower_bound(0, 5, |_| 0), 0);
    }
}
