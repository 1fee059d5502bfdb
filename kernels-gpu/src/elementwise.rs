//! Element-wise kernels: unary ops and activations (forward and backward), binary ops on two
//! tensors, and ops against a row broadcast along the last dimension (bias, per-channel scale),
//! including the fused `act(x * scale + bias)`.
//!
//! Memory pattern: these are bound by HBM bandwidth (a few flops per 4-12 bytes moved), so each
//! thread moves 16 bytes per access (`ld.global.nc.v4` / `st.global.v4`) and consecutive threads
//! touch consecutive vectors (a warp moves 512 contiguous bytes per instruction). The elements
//! past the last whole vector are done one per thread. Pointers come from whole allocations, so
//! 16-byte alignment holds.
//!
//! The unary and binary kernels (`<op>_<kind>_<dtype>`) take one vector a thread with no loop, a
//! block of [`CHUNK_BLOCK`] threads a chunk of as many vectors, as many blocks as chunks: every
//! load of the launch is issued at once and blocks retiring make room for the next, from 2^20
//! elements to 2^31 and beyond (`chunk`). Small launches (where one 8-byte half vector a thread
//! fits in one wave of resident blocks: 2^16 f32 elements, for instance) go to entries of their
//! own, `<op>_<kind>_small_<dtype>`: each thread one half vector (and one tail element),
//! [`small_block`] threads a block, a constant, so the kernel reads neither `%ntid` nor
//! `%nctaid`. At that size a launch is the latency of one pass, not bandwidth: twice the threads
//! of 8-byte half vectors halve each thread's chain of math, the work before the first load is
//! the thread index alone, and the loads take the coherent path with no in-place test
//! (docs/worklog.md, 2026-11-26c, 2026-11-26d, 2026-11-26f and 2026-11-26h).
//!
//! The row-broadcast kernels and the optimizers keep a grid-stride loop sized by the host to a
//! few waves of resident blocks, `unroll(T)` vectors in flight a thread a round (`grid_stride`):
//! their parameters per column are loaded once a thread where the stride is whole rows.
//!
//! Column reductions (the bias gradient) are two-stage and deterministic: a 2-D grid of
//! `32 x 8`-thread blocks, each summing a strip of rows for 32 adjacent columns into
//! `partial[chunk, col]` in a fixed order, then `colsum_finish` adds the chunks in order.

use crate::dtype::Elem;
#[cfg(target_arch = "nvptx64")]
use crate::dtype::for_lanes;
#[cfg(target_arch = "nvptx64")]
use crate::ops::FromOutput;
#[cfg(target_arch = "nvptx64")]
use crate::ops::{BinaryFn, UnaryFn, bwd_for, bwd_form_for, fwd_for, fwd_form_for};

/// `y[i] = op(x[i]; a, b)` for `i < n`. `y == x` is allowed (in place).
pub type UnaryFwdArgs<T> = (*const T, *mut T, u64, f32, f32);
/// `gx[i] = op'(x[i]; a, b) * g[i]` for `i < n`. `gx` may alias `g`.
pub type UnaryBwdArgs<T> = (*const T, *const T, *mut T, u64, f32, f32);
/// `out[i] = x[i] op y[i]`. `out` may alias `x` or `y`.
pub type BinaryFwdArgs<T> = (*const T, *const T, *mut T, u64);
/// `(gx[i], gy[i]) = op'(x[i], y[i]) * g[i]`.
pub type BinaryBwdArgs<T> = (*const T, *const T, *const T, *mut T, *mut T, u64);
/// Row-broadcast forward over a `[n / cols, cols]` matrix: `(x, p0, p1, y, n, cols, a, b)`.
/// Binary ops: `y = x op p0[col]` (`p1` unused, may be null). Fused:
/// `y = act(x * p0[col] + p1[col]; a, b)`. `y` may alias `x`.
pub type RowFwdArgs<T> = (*const T, *const T, *const T, *mut T, u64, u64, f32, f32);
/// Row-broadcast backward: `(x, p0, p1, g, gx, partial, rows, cols, a, b)`. Writes `gx` and the
/// per-chunk column sums of the parameter gradients into `partial` (f32,
/// `[n_acc][grid.y][cols]`, `n_acc` = 1 for binary ops (d/dp0), 2 for fused (d/dscale, d/dbias)).
pub type RowBwdArgs<T> = (*const T, *const T, *const T, *const T, *mut T, *mut f32, u64, u64, f32, f32);
/// `out[c] = sum over k < chunks of partial[k * cols + c]`, in order of k.
pub type ColsumFinishArgs<T> = (*const f32, *mut T, u64, u64);

// The host names these kernels by typed handles, per op and storage type (`UnaryKernels`,
// `BinaryKernels`, ..., through `ElementwiseElem`), declared after the device code beside the
// kernels and from the same op lists (`unary_list!`, ...), so that no kernel is named by a
// string built at run time.

/// Threads per block of the 1-D element-wise kernels.
pub const BLOCK: u32 = 256;
/// Vectors each thread loads before it computes (see `grid_stride`): 16 elements per thread,
/// i.e. four f32 vectors or two of f16/bf16 (four of those need twice the registers, and GELU's
/// backward then ran at 1 block of 256 threads per SM).
pub const fn unroll(dt: crate::DType) -> usize {
    match dt {
        crate::DType::F32 => 4,
        crate::DType::F16 | crate::DType::BF16 => 2,
    }
}
/// Block shape of the column-reduction kernels: 32 columns by `ROWS_PER_BLOCK` row lanes.
pub const COL_BLOCK_X: u32 = 32;
/// The row lanes of [`COL_BLOCK_X`]'s block.
pub const COL_BLOCK_Y: u32 = 8;

/// Elements per 16-byte vector of `T`, for the host's grid sizing.
pub const fn vec_width<T: Elem>() -> u64 {
    T::VEC as u64
}

/// Half vectors (8 bytes, `vec / 2` elements) of an `n`-element tensor whose 16-byte vectors hold
/// `vec` elements: the threads of a small launch, one each. The elements past the last half
/// vector are the tail.
pub const fn half_vectors(n: u64, vec: u64) -> u64 {
    n / (vec / 2)
}

/// Threads (and vectors) a block of the unary and binary kernels above the small launches
/// (`<op>_<kind>_<dtype>`, one vector a thread): a constant of those kernels, which the host must
/// launch them with.
pub const CHUNK_BLOCK: u32 = 128;

/// Vectors a thread of a chunk kernel whose op asks for `elements` a thread
/// (`ops::UnaryFn::CHUNK`), in vectors of `vec` elements: one where `elements` is at most a
/// vector, else `elements / vec` (1, 2 or 4 for the ops' values).
pub const fn chunk_vectors(elements: usize, vec: usize) -> usize {
    if elements <= vec { 1 } else { elements / vec }
}

/// Threads a block of the small-launch entries (`<op>_<kind>_small_<dtype>`) of `dt`: a constant
/// of the kernels, which the host must launch them with.
///
/// f32: 512 (2^16 elements: 64 blocks, each on an SM of its own, as PyTorch's 64 blocks of 128
/// threads with eight elements each). Against 128 on the H100 (the 2^16 cases, two processes
/// each): shorter under ncu and faster paired with CUDA events, none slower than PyTorch's where
/// 128 left a few light f32 kernels behind; level at 2^14 and 2^18; 256 gained about half as
/// much. f16/bf16: 128. In 512-thread blocks their 2^16 launch is 32 blocks, and the heavier
/// math lost: `log` and `log1p` behind PyTorch's paired, GELU longer under ncu
/// (docs/worklog.md, 2026-11-26h).
pub const fn small_block(dt: crate::DType) -> u32 {
    match dt {
        crate::DType::F32 => 512,
        crate::DType::F16 | crate::DType::BF16 => 128,
    }
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::prim::*;

    /// Grid-stride loop over the whole 16-byte vectors of an `n`-element tensor, `unroll(T)`
    /// vectors per thread per round: `load(off)` for all of them first, then `finish(off, data)`
    /// for each (`off` = the vector's first element). Issuing the loads together keeps
    /// `unroll * 16` bytes per thread in flight instead of 16, which is what it takes to cover
    /// HBM latency at full bandwidth. Then `one(i)` for each element of the tail, one per thread.
    #[inline(always)]
    unsafe fn grid_stride<T: Elem, L: Copy>(
        n: u64,
        load: impl Fn(usize) -> L,
        finish: impl FnMut(usize, L),
        one: impl FnMut(usize),
    ) {
        // SAFETY: the caller's contract.
        unsafe { grid_stride_by::<T, L>(n, unroll(T::DTYPE), load, finish, one) }
    }

    /// [`grid_stride`] with `rounds` (1, 2 or 4, a constant at the call site) vectors per thread
    /// per round, for kernels whose vectors are larger than these (the optimizer's four tensors).
    #[inline(always)]
    pub(crate) unsafe fn grid_stride_by<T: Elem, L: Copy>(
        n: u64,
        rounds: usize,
        load: impl Fn(usize) -> L,
        mut finish: impl FnMut(usize, L),
        mut one: impl FnMut(usize),
    ) {
        let w = T::VEC as u64;
        let nv = n / w;
        let stride = grid_threads_x();
        let mut i = global_thread_x();
        // Written out rather than as an array of `L`: an array indexed in a loop the compiler does
        // not fully unroll lands in local memory (a stack frame in the ptxas report).
        if rounds == 4 {
            while i + 3 * stride < nv {
                let o = [i * w, (i + stride) * w, (i + 2 * stride) * w, (i + 3 * stride) * w];
                let (d0, d1, d2, d3) =
                    (load(o[0] as usize), load(o[1] as usize), load(o[2] as usize), load(o[3] as usize));
                finish(o[0] as usize, d0);
                finish(o[1] as usize, d1);
                finish(o[2] as usize, d2);
                finish(o[3] as usize, d3);
                i += 4 * stride;
            }
        } else if rounds == 2 {
            while i + stride < nv {
                let o = [i * w, (i + stride) * w];
                let (d0, d1) = (load(o[0] as usize), load(o[1] as usize));
                finish(o[0] as usize, d0);
                finish(o[1] as usize, d1);
                i += 2 * stride;
            }
        }
        while i < nv {
            finish((i * w) as usize, load((i * w) as usize));
            i += stride;
        }
        let t = nv * w + global_thread_x();
        if t < n {
            one(t as usize);
        }
    }

    /// `k` vectors a thread (1, 2 or 4, a constant where the kernel is compiled), no loop: block
    /// `b` takes the `k * CHUNK_BLOCK` vectors from `b * k * CHUNK_BLOCK`, thread `t` those at
    /// `t`, `t + CHUNK_BLOCK`, ... in it (a warp's load is 512 contiguous bytes). `at_once`:
    /// `load(off)` for all of them, then `finish(off, data)` for each; otherwise load and finish
    /// one vector after another. Thread `i` of the grid also takes tail element `i` (`one`). The
    /// host launches a block for every `k * CHUNK_BLOCK` vectors, and at least one.
    ///
    /// Measured against the grid-stride loop (H100, docs/worklog.md, 2026-11-26f): from 2^20 to
    /// 2^25 elements the loop left each thread two to four serial round trips (load, math, store,
    /// load, ...) and fell behind PyTorch; here every load of the launch is issued at once, blocks
    /// retiring make room for the next, and the time is one round trip plus the bandwidth. One
    /// vector a thread was also the fastest at 2^28 f32, ahead of PyTorch's kernel and of the loop;
    /// two or four vectors a thread were slower there, and slower for the heavy f16/bf16 backwards
    /// at mid sizes. Ops whose math sets the pace take more (`UnaryFn::CHUNK`).
    #[inline(always)]
    unsafe fn chunk<T: Elem, L: Copy>(
        n: u64,
        (k, at_once): (usize, bool),
        load: impl Fn(usize) -> L,
        mut finish: impl FnMut(usize, L),
        one: impl FnOnce(usize),
    ) {
        let w = T::VEC as u64;
        let b = CHUNK_BLOCK as u64;
        let nv = n / w;
        let g = block_idx_x() as u64 * b + thread_idx_x() as u64;
        let i = block_idx_x() as u64 * (k as u64 * b) + thread_idx_x() as u64;
        let o = |j: u64| ((i + j * b) * w) as usize;
        if at_once && k > 1 && i + (k as u64 - 1) * b < nv {
            // Written out rather than as an array of `L`: an array indexed in a loop the compiler
            // does not fully unroll lands in local memory.
            if k == 4 {
                let (d0, d1, d2, d3) = (load(o(0)), load(o(1)), load(o(2)), load(o(3)));
                finish(o(0), d0);
                finish(o(1), d1);
                finish(o(2), d2);
                finish(o(3), d3);
            } else {
                let (d0, d1) = (load(o(0)), load(o(1)));
                finish(o(0), d0);
                finish(o(1), d1);
            }
        } else {
            // One vector, one after another, or the last chunk (past the end).
            for j in 0..k as u64 {
                if i + j * b < nv {
                    finish(o(j), load(o(j)));
                }
            }
        }
        let t = nv * w + g;
        if t < n {
            one(t as usize);
        }
    }

    /// `O`'s chunk for form `F` in dtype `T` (`UnaryFn::CHUNK`): vectors a thread, and whether
    /// loaded at once. A constant; one other than 1, 2 or 4 vectors fails the build.
    #[inline(always)]
    fn chunk_of<T: Elem, O: UnaryFn, const F: u32>() -> (usize, bool) {
        const {
            let (e, at_once) = O::CHUNK[F as usize];
            let k = chunk_vectors(e, T::VEC);
            assert!(k == 1 || k == 2 || k == 4, "a chunk of 1, 2 or 4 vectors");
            (k, at_once)
        }
    }

    #[inline(always)]
    unsafe fn load<T: Elem>(p: *const T, in_place: bool) -> [f32; 8] {
        // SAFETY: callers pass a whole vector inside the tensor; allocations are 16-byte aligned.
        // In place, the coherent path: `.nc` must not read memory the launch writes.
        unsafe {
            let raw = if in_place { ld_global_v4(p as *const u32) } else { ld_global_nc_v4(p as *const u32) };
            T::unpack(raw)
        }
    }

    #[inline(always)]
    unsafe fn store<T: Elem>(p: *mut T, v: &[f32; 8]) {
        // SAFETY: as `load`.
        unsafe { st_global_v4(p as *mut u32, T::pack(v)) }
    }

    // SAFETY (all four kernels below): the host passes tensors of `n` elements and a grid of
    // `CHUNK_BLOCK`-thread blocks sized for the op's chunk (`launch::elementwise_chunks`);
    // `chunk` hands out offsets of whole vectors below `n` and tail indices below `n`.

    /// One body per form of the op (`UnaryFn::FORMS`): the launch's form is one uniform branch
    /// here, not one per element; each form's [`chunk`] is its own (`UnaryFn::CHUNK`).
    pub unsafe fn unary_fwd<T: Elem, O: UnaryFn>(x: *const T, y: *mut T, n: u64, a: f32, b: f32) {
        const { assert!(O::FORMS <= crate::ops::MAX_FORMS) };
        // SAFETY (both): the caller's contract. An op of one form instantiates one body.
        if O::FORMS == 1 {
            unsafe { unary_fwd_in::<T, O, 0>(x, y, n, a, b) }
        } else {
            crate::by_form!(O::fwd_form(a, b), F => unsafe { unary_fwd_in::<T, O, F>(x, y, n, a, b) })
        }
    }

    #[inline(always)]
    unsafe fn unary_fwd_in<T: Elem, O: UnaryFn, const F: u32>(x: *const T, y: *mut T, n: u64, a: f32, b: f32) {
        let in_place = x as u64 == y as u64;
        unsafe {
            chunk::<T, _>(
                n,
                chunk_of::<T, O, F>(),
                #[inline(always)]
                |o| load(x.add(o), in_place),
                #[inline(always)]
                |o, mut v| {
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| v[k] = fwd_form_for::<O, T, F>(v[k], a, b),
                    );
                    store(y.add(o), &v);
                },
                #[inline(always)]
                |i| *y.add(i) = T::from_f32(fwd_form_for::<O, T, F>((*x.add(i)).to_f32(), a, b)),
            )
        }
    }

    /// As [`unary_fwd`], with the backward's form.
    pub unsafe fn unary_bwd<T: Elem, O: UnaryFn>(x: *const T, g: *const T, gx: *mut T, n: u64, a: f32, b: f32) {
        const { assert!(O::FORMS <= crate::ops::MAX_FORMS) };
        // SAFETY (both): the caller's contract.
        if O::FORMS == 1 {
            unsafe { unary_bwd_in::<T, O, 0>(x, g, gx, n, a, b) }
        } else {
            crate::by_form!(O::bwd_form(a, b), F => unsafe { unary_bwd_in::<T, O, F>(x, g, gx, n, a, b) })
        }
    }

    #[inline(always)]
    unsafe fn unary_bwd_in<T: Elem, O: UnaryFn, const F: u32>(
        x: *const T,
        g: *const T,
        gx: *mut T,
        n: u64,
        a: f32,
        b: f32,
    ) {
        let in_place = g as u64 == gx as u64;
        unsafe {
            chunk::<T, _>(
                n,
                chunk_of::<T, O, F>(),
                #[inline(always)]
                |o| (load(x.add(o), false), load(g.add(o), in_place)),
                #[inline(always)]
                |o, (vx, mut vg)| {
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| vg[k] = bwd_form_for::<O, T, F>(vx[k], vg[k], a, b),
                    );
                    store(gx.add(o), &vg);
                },
                #[inline(always)]
                |i| *gx.add(i) = T::from_f32(bwd_form_for::<O, T, F>((*x.add(i)).to_f32(), (*g.add(i)).to_f32(), a, b)),
            )
        }
    }

    pub unsafe fn binary_fwd<T: Elem, O: BinaryFn>(x: *const T, y: *const T, out: *mut T, n: u64) {
        let in_place = x as u64 == out as u64 || y as u64 == out as u64;
        unsafe {
            chunk::<T, _>(
                n,
                (1, true),
                #[inline(always)]
                |o| (load(x.add(o), in_place), load(y.add(o), in_place)),
                #[inline(always)]
                |o, (mut vx, vy)| {
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| vx[k] = O::fwd(vx[k], vy[k]),
                    );
                    store(out.add(o), &vx);
                },
                #[inline(always)]
                |i| binary_fwd_one::<T, O>(x, y, out, i),
            )
        }
    }

    /// Element `i` of [`binary_fwd`] (a tail element, in the grid-stride and the small kernels).
    ///
    /// # Safety
    /// `i` is below the tensors' length.
    #[inline(always)]
    unsafe fn binary_fwd_one<T: Elem, O: BinaryFn>(x: *const T, y: *const T, out: *mut T, i: usize) {
        // SAFETY: the caller's contract.
        unsafe { *out.add(i) = T::from_f32(O::fwd((*x.add(i)).to_f32(), (*y.add(i)).to_f32())) }
    }

    /// Element `i` of [`binary_bwd`], as [`binary_fwd_one`].
    ///
    /// # Safety
    /// `i` is below the tensors' length.
    #[inline(always)]
    unsafe fn binary_bwd_one<T: Elem, O: BinaryFn>(
        x: *const T,
        y: *const T,
        g: *const T,
        gx: *mut T,
        gy: *mut T,
        i: usize,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            let (a, b) = O::bwd((*x.add(i)).to_f32(), (*y.add(i)).to_f32(), (*g.add(i)).to_f32());
            *gx.add(i) = T::from_f32(a);
            *gy.add(i) = T::from_f32(b);
        }
    }

    pub unsafe fn binary_bwd<T: Elem, O: BinaryFn>(
        x: *const T,
        y: *const T,
        g: *const T,
        gx: *mut T,
        gy: *mut T,
        n: u64,
    ) {
        unsafe {
            chunk::<T, _>(
                n,
                (1, true),
                #[inline(always)]
                |o| (load(x.add(o), false), load(y.add(o), false), load(g.add(o), false)),
                #[inline(always)]
                |o, (vx, vy, vg)| {
                    let (mut rx, mut ry) = ([0.0; 8], [0.0; 8]);
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| (rx[k], ry[k]) = O::bwd(vx[k], vy[k], vg[k]),
                    );
                    store(gx.add(o), &rx);
                    store(gy.add(o), &ry);
                },
                #[inline(always)]
                |i| binary_bwd_one::<T, O>(x, y, g, gx, gy, i),
            )
        }
    }

    // --- small launches -------------------------------------------------------------------------

    /// Loads half a vector (8 bytes, `T::VEC / 2` elements) at `p`, unpacked into the first lanes,
    /// through the coherent path whether or not the launch is in place. The non-coherent load
    /// needed the in-place test (the output pointer, a second constant-bank load, compared with
    /// the input's, and a branch) before it could issue, and a launch of one load a thread gains
    /// nothing from the read-only path. At 2^16 on the H100 the kernels were shorter under ncu and
    /// paired with CUDA events, and the light ones that trailed PyTorch's came level or closer
    /// (docs/worklog.md, 2026-11-26h).
    ///
    /// # Safety
    /// `p` points at a half vector inside the tensor, 8-byte aligned (offsets are multiples of
    /// `T::VEC / 2` from a 16-byte aligned allocation).
    #[inline(always)]
    unsafe fn load_half<T: Elem>(p: *const T) -> [f32; 8] {
        // SAFETY: the caller's contract.
        unsafe {
            let r = ld_global_v2(p as *const u32);
            T::unpack([r[0], r[1], 0, 0])
        }
    }

    /// Stores the first `T::VEC / 2` lanes of `v` as half a vector at `p`.
    ///
    /// # Safety
    /// As [`load_half`].
    #[inline(always)]
    unsafe fn store_half<T: Elem>(p: *mut T, v: &[f32; 8]) {
        let r = T::pack(v);
        // SAFETY: the caller's contract.
        unsafe { st_global_v2(p as *mut u32, [r[0], r[1]]) }
    }

    /// Calls `f(k)` for each lane of half a vector.
    #[inline(always)]
    fn half_lanes<T: Elem>(mut f: impl FnMut(usize)) {
        for_lanes::<T>(
            #[inline(always)]
            |k| {
                if 2 * k < T::VEC {
                    f(k)
                }
            },
        )
    }

    /// A small launch of [`small_block`]-thread blocks: thread `i` takes the half vector at element
    /// `i * VEC / 2` (`half(offset)`) if there is one, and tail element `i` past the last half
    /// vector (`one(index)`) if there is one. The host gives every half vector and every tail
    /// element a thread (`launch::elementwise_small`).
    #[inline(always)]
    unsafe fn small<T: Elem>(n: u64, half: impl FnOnce(usize), one: impl FnOnce(usize)) {
        let i = (block_idx_x() * const { small_block(T::DTYPE) } + thread_idx_x()) as u64;
        let h = (T::VEC / 2) as u64;
        let nh = half_vectors(n, T::VEC as u64);
        if i < nh {
            half((i * h) as usize);
        }
        let t = nh * h + i;
        if t < n {
            one(t as usize);
        }
    }

    // SAFETY (the small kernels below): the host passes tensors of `n` elements and a grid of
    // `small_block`-thread blocks; `small` hands out offsets of whole half vectors below `n` and
    // tail indices below `n`.

    /// [`unary_fwd`] for a small launch. The load comes first and the op's form
    /// (`UnaryFn::FORMS`: pow's exponent) after it, so that the branch on the form runs while the
    /// load is in flight (the grid-stride kernels choose it once, before their loop).
    pub unsafe fn unary_fwd_small<T: Elem, O: UnaryFn>(x: *const T, y: *mut T, n: u64, a: f32, b: f32) {
        const { assert!(O::FORMS <= crate::ops::MAX_FORMS) };
        unsafe {
            small::<T>(
                n,
                #[inline(always)]
                |o| {
                    let v = load_half(x.add(o));
                    if O::FORMS == 1 {
                        fwd_half::<T, O, 0>(v, y.add(o), a, b)
                    } else {
                        crate::by_form!(O::fwd_form(a, b), F => fwd_half::<T, O, F>(v, y.add(o), a, b))
                    }
                },
                #[inline(always)]
                |i| {
                    let v = (*x.add(i)).to_f32();
                    let r = if O::FORMS == 1 {
                        fwd_form_for::<O, T, 0>(v, a, b)
                    } else {
                        crate::by_form!(O::fwd_form(a, b), F => fwd_form_for::<O, T, F>(v, a, b))
                    };
                    *y.add(i) = T::from_f32(r);
                },
            )
        }
    }

    /// `O` in form `F` on the lanes of half a vector, stored at `p` (as [`store_half`]).
    #[inline(always)]
    unsafe fn fwd_half<T: Elem, O: UnaryFn, const F: u32>(mut v: [f32; 8], p: *mut T, a: f32, b: f32) {
        half_lanes::<T>(
            #[inline(always)]
            |k| v[k] = fwd_form_for::<O, T, F>(v[k], a, b),
        );
        // SAFETY: the caller's contract.
        unsafe { store_half(p, &v) }
    }

    /// [`unary_bwd`] for a small launch; loads, then the form, as [`unary_fwd_small`].
    pub unsafe fn unary_bwd_small<T: Elem, O: UnaryFn>(x: *const T, g: *const T, gx: *mut T, n: u64, a: f32, b: f32) {
        const { assert!(O::FORMS <= crate::ops::MAX_FORMS) };
        unsafe {
            small::<T>(
                n,
                #[inline(always)]
                |o| {
                    let (vx, vg) = (load_half(x.add(o)), load_half(g.add(o)));
                    if O::FORMS == 1 {
                        bwd_half::<T, O, 0>(vx, vg, gx.add(o), a, b)
                    } else {
                        crate::by_form!(O::bwd_form(a, b), F => bwd_half::<T, O, F>(vx, vg, gx.add(o), a, b))
                    }
                },
                #[inline(always)]
                |i| {
                    let (v, w) = ((*x.add(i)).to_f32(), (*g.add(i)).to_f32());
                    let r = if O::FORMS == 1 {
                        bwd_form_for::<O, T, 0>(v, w, a, b)
                    } else {
                        crate::by_form!(O::bwd_form(a, b), F => bwd_form_for::<O, T, F>(v, w, a, b))
                    };
                    *gx.add(i) = T::from_f32(r);
                },
            )
        }
    }

    /// `O`'s backward in form `F` on the lanes of half a vector (`vx`, incoming `vg`), stored at
    /// `p` (as [`store_half`]).
    #[inline(always)]
    unsafe fn bwd_half<T: Elem, O: UnaryFn, const F: u32>(vx: [f32; 8], mut vg: [f32; 8], p: *mut T, a: f32, b: f32) {
        half_lanes::<T>(
            #[inline(always)]
            |k| vg[k] = bwd_form_for::<O, T, F>(vx[k], vg[k], a, b),
        );
        // SAFETY: the caller's contract.
        unsafe { store_half(p, &vg) }
    }

    /// [`binary_fwd`] for a small launch.
    pub unsafe fn binary_fwd_small<T: Elem, O: BinaryFn>(x: *const T, y: *const T, out: *mut T, n: u64) {
        unsafe {
            small::<T>(
                n,
                #[inline(always)]
                |o| {
                    let (mut vx, vy) = (load_half(x.add(o)), load_half(y.add(o)));
                    half_lanes::<T>(
                        #[inline(always)]
                        |k| vx[k] = O::fwd(vx[k], vy[k]),
                    );
                    store_half(out.add(o), &vx);
                },
                #[inline(always)]
                |i| binary_fwd_one::<T, O>(x, y, out, i),
            )
        }
    }

    /// [`binary_bwd`] for a small launch.
    pub unsafe fn binary_bwd_small<T: Elem, O: BinaryFn>(
        x: *const T,
        y: *const T,
        g: *const T,
        gx: *mut T,
        gy: *mut T,
        n: u64,
    ) {
        unsafe {
            small::<T>(
                n,
                #[inline(always)]
                |o| {
                    let (vx, vy, vg) = (load_half(x.add(o)), load_half(y.add(o)), load_half(g.add(o)));
                    let (mut rx, mut ry) = ([0.0; 8], [0.0; 8]);
                    half_lanes::<T>(
                        #[inline(always)]
                        |k| (rx[k], ry[k]) = O::bwd(vx[k], vy[k], vg[k]),
                    );
                    store_half(gx.add(o), &rx);
                    store_half(gy.add(o), &ry);
                },
                #[inline(always)]
                |i| binary_bwd_one::<T, O>(x, y, g, gx, gy, i),
            )
        }
    }

    /// How a row-broadcast op uses its per-column parameters.
    pub trait RowOp {
        fn fwd<T: Elem>(x: f32, p0: f32, p1: f32, a: f32, b: f32) -> f32;
        /// (dL/dx, first accumulator, second accumulator).
        fn bwd<T: Elem>(x: f32, p0: f32, p1: f32, g: f32, a: f32, b: f32) -> (f32, f32, f32);
        /// Whether `p1` is read (null for binary ops).
        const USES_P1: bool;
        /// Accumulators written to `partial`.
        const N_ACC: usize;
    }

    /// `x op p0[col]`.
    pub struct BiasBinary<O>(core::marker::PhantomData<O>);
    impl<O: BinaryFn> RowOp for BiasBinary<O> {
        #[inline(always)]
        fn fwd<T: Elem>(x: f32, p0: f32, _: f32, _: f32, _: f32) -> f32 {
            O::fwd(x, p0)
        }
        #[inline(always)]
        fn bwd<T: Elem>(x: f32, p0: f32, _: f32, g: f32, _: f32, _: f32) -> (f32, f32, f32) {
            let (gx, gp) = O::bwd(x, p0, g);
            (gx, gp, 0.0)
        }
        const USES_P1: bool = false;
        const N_ACC: usize = 1;
    }

    /// `act(x * p0[col] + p1[col])`; accumulates d/dscale = dz * x and d/dbias = dz.
    pub struct ScaleBiasAct<A>(core::marker::PhantomData<A>);
    impl<A: UnaryFn> RowOp for ScaleBiasAct<A> {
        #[inline(always)]
        fn fwd<T: Elem>(x: f32, s: f32, t: f32, a: f32, b: f32) -> f32 {
            fwd_for::<A, T>(crate::math::fma(x, s, t), a, b)
        }
        #[inline(always)]
        fn bwd<T: Elem>(x: f32, s: f32, t: f32, g: f32, a: f32, b: f32) -> (f32, f32, f32) {
            let dz = bwd_for::<A, T>(crate::math::fma(x, s, t), g, a, b);
            (dz * s, dz * x, dz)
        }
        const USES_P1: bool = true;
        const N_ACC: usize = 2;
    }

    #[inline(always)]
    unsafe fn param<T: Elem>(p: *const T, c: u64, used: bool) -> f32 {
        // SAFETY: `c < cols`, the parameter vectors' length; `used` is false only for null `p`.
        if used { unsafe { (*p.add(c as usize)).to_f32() } } else { 0.0 }
    }

    /// Loads the `VEC` parameters of columns `c .. c + VEC` (contiguous, `c` a multiple of
    /// `VEC`) with one 16-byte load; zeros when `used` is false (null pointer).
    #[inline(always)]
    unsafe fn param_vec<T: Elem>(p: *const T, c: u64, used: bool) -> [f32; 8] {
        // SAFETY: c + VEC <= cols and c is a multiple of VEC, so the vector is inside the
        // (16-byte aligned) parameter buffer.
        if used { unsafe { load(p.add(c as usize), false) } } else { [0.0; 8] }
    }

    pub unsafe fn row_fwd<T: Elem, R: RowOp>(
        x: *const T,
        p0: *const T,
        p1: *const T,
        y: *mut T,
        n: u64,
        cols: u64,
        a: f32,
        b: f32,
    ) {
        let in_place = x as u64 == y as u64;
        let w = T::VEC as u64;
        let nv = n / w;
        let stride = grid_threads_x();
        let mut i = global_thread_x();
        // The column of each vector's first element, advanced incrementally: a 64-bit remainder
        // costs tens of instructions, too many per 16 bytes at full bandwidth.
        let step = (stride * w) % cols.max(1);
        let mut c0 = if cols == 0 { 0 } else { (i * w) % cols };
        // When rows are whole vectors, a vector's columns are contiguous and its parameters are
        // two 16-byte loads (the common case: a last dimension that is a multiple of 4 or 8).
        let aligned = cols % w == 0;
        if aligned && step == 0 {
            // The grid's stride is a whole number of rows (the host sizes the grid so where it
            // can): every vector this thread visits starts at column c0, so its parameters are
            // loaded once and the loop is `grid_stride`'s, `unroll(T)` loads in flight. (For the bf16
            // fused SiLU on the H100 it beat one or two vectors a thread each loading its parameters
            // after the row's loads: docs/worklog.md, 2026-11-23d.)
            // SAFETY: c0 + VEC <= cols (aligned); vectors and tail as `grid_stride` hands out.
            unsafe {
                let (s, t) = (param_vec(p0, c0, true), param_vec(p1, c0, R::USES_P1));
                grid_stride::<T, _>(
                    n,
                    #[inline(always)]
                    |o| load(x.add(o), in_place),
                    #[inline(always)]
                    |o, mut v| {
                        for_lanes::<T>(
                            #[inline(always)]
                            |k| v[k] = R::fwd::<T>(v[k], s[k], t[k], a, b),
                        );
                        store(y.add(o), &v);
                    },
                    #[inline(always)]
                    |i| {
                        let c = i as u64 % cols;
                        let (s, t) = (param(p0, c, true), param(p1, c, R::USES_P1));
                        *y.add(i) = T::from_f32(R::fwd::<T>((*x.add(i)).to_f32(), s, t, a, b));
                    },
                );
            }
            return;
        }
        while i < nv {
            let o = (i * w) as usize;
            // SAFETY: vector i lies inside x and y; parameters are indexed below cols.
            unsafe {
                let mut v = load(x.add(o), in_place);
                if aligned {
                    let (s, t) = (param_vec(p0, c0, true), param_vec(p1, c0, R::USES_P1));
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| v[k] = R::fwd::<T>(v[k], s[k], t[k], a, b),
                    );
                } else {
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| {
                            let c = c0 + k as u64;
                            let c = if c < cols { c } else { c % cols };
                            let (s, t) = (param(p0, c, true), param(p1, c, R::USES_P1));
                            v[k] = R::fwd::<T>(v[k], s, t, a, b);
                        },
                    );
                }
                store(y.add(o), &v);
            }
            i += stride;
            c0 += step;
            if c0 >= cols {
                c0 -= cols;
            }
        }
        let t = nv * w + global_thread_x();
        if t < n {
            let c = t % cols;
            // SAFETY: t < n; c < cols.
            unsafe {
                let (s, tt) = (param(p0, c, true), param(p1, c, R::USES_P1));
                let t = t as usize;
                *y.add(t) = T::from_f32(R::fwd::<T>((*x.add(t)).to_f32(), s, tt, a, b));
            }
        }
    }

    pub unsafe fn row_bwd<T: Elem, R: RowOp>(
        x: *const T,
        p0: *const T,
        p1: *const T,
        g: *const T,
        gx: *mut T,
        partial: *mut f32,
        rows: u64,
        cols: u64,
        a: f32,
        b: f32,
    ) {
        let (tx, ty) = (thread_idx_x(), thread_idx_y());
        let col = block_idx_x() as u64 * COL_BLOCK_X as u64 + tx as u64;
        let chunks = grid_dim_y() as u64;
        let (mut acc0, mut acc1) = (0.0f32, 0.0f32);
        if col < cols {
            let (s, t) = unsafe { (param(p0, col, true), param(p1, col, R::USES_P1)) };
            let step = chunks * COL_BLOCK_Y as u64;
            let mut r = block_idx_y() as u64 * COL_BLOCK_Y as u64 + ty as u64;
            let mut one = #[inline(always)]
            |i: usize, xv: f32, gv: f32| {
                let (dx, d0, d1) = R::bwd::<T>(xv, s, t, gv, a, b);
                // SAFETY: i < rows * cols, gx's length (callers index rows below `rows`).
                unsafe { *gx.add(i) = T::from_f32(dx) };
                acc0 += d0;
                acc1 += d1;
            };
            // Four rows per round, loads first: four independent loads of x and of g in flight
            // per thread instead of one (the same reason as `grid_stride`'s unrolling).
            while r + 3 * step < rows {
                let i = [r, r + step, r + 2 * step, r + 3 * step].map(|r| (r * cols + col) as usize);
                // SAFETY: every row index is below rows and col < cols.
                let (x0, x1, x2, x3, g0, g1, g2, g3) = unsafe {
                    (
                        (*x.add(i[0])).to_f32(),
                        (*x.add(i[1])).to_f32(),
                        (*x.add(i[2])).to_f32(),
                        (*x.add(i[3])).to_f32(),
                        (*g.add(i[0])).to_f32(),
                        (*g.add(i[1])).to_f32(),
                        (*g.add(i[2])).to_f32(),
                        (*g.add(i[3])).to_f32(),
                    )
                };
                one(i[0], x0, g0);
                one(i[1], x1, g1);
                one(i[2], x2, g2);
                one(i[3], x3, g3);
                r += 4 * step;
            }
            while r < rows {
                let i = (r * cols + col) as usize;
                // SAFETY: r < rows and col < cols, so i < rows * cols, the tensors' length.
                let (xv, gv) = unsafe { ((*x.add(i)).to_f32(), (*g.add(i)).to_f32()) };
                one(i, xv, gv);
                r += step;
            }
        }
        // SAFETY: partial holds N_ACC * chunks * cols floats (host-checked); 2 * 256 floats of
        // shared memory.
        unsafe { col_block_store([acc0, acc1], R::N_ACC, partial, cols, col) };
    }

    /// The end of a column-reduction block (`COL_BLOCK_X` columns by `COL_BLOCK_Y` row lanes):
    /// adds the row lanes' sums of each column through shared memory, in a fixed order, and
    /// writes accumulator `a < n_acc` of column `col` to `partial[a][blockIdx.y][col]`. Every
    /// thread of the block must call it.
    ///
    /// # Safety
    /// `partial` holds `n_acc * gridDim.y * cols` floats; the launch has `2 * 256` floats of
    /// dynamic shared memory.
    pub unsafe fn col_block_store(acc: [f32; 2], n_acc: usize, partial: *mut f32, cols: u64, col: u64) {
        let (tx, ty) = (thread_idx_x(), thread_idx_y());
        let chunks = grid_dim_y() as u64;
        let smem = dyn_smem::<f32>();
        let lanes = (COL_BLOCK_X * COL_BLOCK_Y) as usize;
        let me = (ty * COL_BLOCK_X + tx) as usize;
        // SAFETY: me < lanes; shared memory holds 2 * lanes floats.
        unsafe {
            *smem.add(me) = acc[0];
            *smem.add(lanes + me) = acc[1];
        }
        sync_threads();
        if ty == 0 && col < cols {
            let (mut s0, mut s1) = (0.0f32, 0.0f32);
            for l in 0..COL_BLOCK_Y {
                let j = (l * COL_BLOCK_X + tx) as usize;
                // SAFETY: j < lanes.
                unsafe {
                    s0 += *smem.add(j);
                    s1 += *smem.add(lanes + j);
                }
            }
            let k = block_idx_y() as u64;
            // SAFETY: per the function contract.
            unsafe {
                *partial.add((k * cols + col) as usize) = s0;
                if n_acc > 1 {
                    *partial.add(((chunks + k) * cols + col) as usize) = s1;
                }
            }
        }
    }

    pub unsafe fn colsum_finish<T: Elem>(partial: *const f32, out: *mut T, chunks: u64, cols: u64) {
        let c = global_thread_x();
        if c < cols {
            let mut s = 0.0f32;
            for k in 0..chunks {
                // SAFETY: k < chunks, c < cols.
                s += unsafe { *partial.add((k * cols + c) as usize) };
            }
            // SAFETY: c < cols = out's length.
            unsafe { *out.add(c as usize) = T::from_f32(s) };
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

// --- the host's handles: each op's kernels per storage type ----------------------------------

use crate::kernel::Kernel;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::KernelEntry;
#[cfg(not(target_arch = "nvptx64"))]
use crate::ops::{Activation, Binary, OutputGrad, PowForm, Unary};

/// A unary op's kernels of storage type `T` ([`crate::ops::Unary::kernels`]).
#[derive(Clone, Copy, Debug)]
pub struct UnaryKernels<T> {
    /// `<op>_fwd_<dtype>`, above the small launches.
    pub fwd: Kernel<UnaryFwdArgs<T>>,
    /// `<op>_bwd_<dtype>`.
    pub bwd: Kernel<UnaryBwdArgs<T>>,
    /// `<op>_fwd_small_<dtype>`, for small launches.
    pub fwd_small: Kernel<UnaryFwdArgs<T>>,
    /// `<op>_bwd_small_<dtype>`.
    pub bwd_small: Kernel<UnaryBwdArgs<T>>,
}

/// The small-launch entries of one of pow's forms ([`crate::ops::PowForm::kernels`]).
#[derive(Clone, Copy, Debug)]
pub struct PowFormKernels<T> {
    /// `<form>_fwd_small_<dtype>`.
    pub fwd_small: Kernel<UnaryFwdArgs<T>>,
    /// `<form>_bwd_small_<dtype>`.
    pub bwd_small: Kernel<UnaryBwdArgs<T>>,
}

/// An op's backward from its output ([`crate::ops::OutputGrad::kernels`]): the first argument
/// is the output `y`.
#[derive(Clone, Copy, Debug)]
pub struct OutputGradKernels<T> {
    /// `<op>_bwd_y_<dtype>`.
    pub bwd_y: Kernel<UnaryBwdArgs<T>>,
    /// `<op>_bwd_y_small_<dtype>`.
    pub bwd_y_small: Kernel<UnaryBwdArgs<T>>,
}

/// A binary op's kernels ([`crate::ops::Binary::kernels`]).
#[derive(Clone, Copy, Debug)]
pub struct BinaryKernels<T> {
    /// `<op>_fwd_<dtype>`, above the small launches.
    pub fwd: Kernel<BinaryFwdArgs<T>>,
    /// `<op>_bwd_<dtype>`.
    pub bwd: Kernel<BinaryBwdArgs<T>>,
    /// `<op>_fwd_small_<dtype>`, for small launches.
    pub fwd_small: Kernel<BinaryFwdArgs<T>>,
    /// `<op>_bwd_small_<dtype>`.
    pub bwd_small: Kernel<BinaryBwdArgs<T>>,
    /// `<op>_row_fwd_<dtype>`: against a row broadcast along the last dimension.
    pub row_fwd: Kernel<RowFwdArgs<T>>,
    /// `<op>_row_bwd_<dtype>`.
    pub row_bwd: Kernel<RowBwdArgs<T>>,
}

/// An activation's fused `act(x * scale + bias)` ([`crate::ops::Activation::kernels`]).
#[derive(Clone, Copy, Debug)]
pub struct ScaleBiasKernels<T> {
    /// `scale_bias_<act>_fwd_<dtype>`.
    pub fwd: Kernel<RowFwdArgs<T>>,
    /// `scale_bias_<act>_bwd_<dtype>`.
    pub bwd: Kernel<RowBwdArgs<T>>,
}

/// A storage type's element-wise kernels, by op: set by the declarations below, from the op
/// lists of [`crate::ops`]. The host reaches them through the ops' `kernels` methods.
#[cfg(not(target_arch = "nvptx64"))]
pub trait ElementwiseElem: Elem {
    /// The kernels of the unary op `op`.
    fn unary(op: Unary) -> UnaryKernels<Self>;
    /// The small-launch entries of pow's form `f`.
    fn pow_form(f: PowForm) -> PowFormKernels<Self>;
    /// The backward from the output of `op`.
    fn output_grad(op: OutputGrad) -> OutputGradKernels<Self>;
    /// The kernels of the binary op `op`.
    fn binary(op: Binary) -> BinaryKernels<Self>;
    /// The fused kernels of the activation `act`.
    fn scale_bias(act: Activation) -> ScaleBiasKernels<Self>;
    /// `colsum_finish_<dtype>`: the end of the row-broadcast backwards' column sums.
    const COLSUM_FINISH: Kernel<ColsumFinishArgs<Self>>;
}

#[cfg(not(target_arch = "nvptx64"))]
impl Unary {
    /// The op's kernels in storage type `T`.
    pub fn kernels<T: ElementwiseElem>(self) -> UnaryKernels<T> {
        T::unary(self)
    }
}

#[cfg(not(target_arch = "nvptx64"))]
impl PowForm {
    /// The form's small-launch entries in storage type `T`.
    pub fn kernels<T: ElementwiseElem>(self) -> PowFormKernels<T> {
        T::pow_form(self)
    }
}

#[cfg(not(target_arch = "nvptx64"))]
impl OutputGrad {
    /// The op's backward from its output in storage type `T`.
    pub fn kernels<T: ElementwiseElem>(self) -> OutputGradKernels<T> {
        T::output_grad(self)
    }
}

#[cfg(not(target_arch = "nvptx64"))]
impl Binary {
    /// The op's kernels in storage type `T`.
    pub fn kernels<T: ElementwiseElem>(self) -> BinaryKernels<T> {
        T::binary(self)
    }
}

#[cfg(not(target_arch = "nvptx64"))]
impl Activation {
    /// The fused `act(x * scale + bias)` kernels of the activation in storage type `T`.
    pub fn kernels<T: ElementwiseElem>(self) -> ScaleBiasKernels<T> {
        T::scale_bias(self)
    }
}

/// Every kernel of the family: its name and arity (for the test against the PTX), from the
/// tables of every op of every list.
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    fn of<T: ElementwiseElem>() -> impl Iterator<Item = KernelEntry> {
        let unary = Unary::ALL.iter().flat_map(|&o| {
            let k = o.kernels::<T>();
            [k.fwd.entry(), k.bwd.entry(), k.fwd_small.entry(), k.bwd_small.entry()]
        });
        let pow = PowForm::ALL.iter().flat_map(|&f| {
            let k = f.kernels::<T>();
            [k.fwd_small.entry(), k.bwd_small.entry()]
        });
        let output = OutputGrad::ALL.iter().flat_map(|&o| {
            let k = o.kernels::<T>();
            [k.bwd_y.entry(), k.bwd_y_small.entry()]
        });
        let binary = Binary::ALL.iter().flat_map(|&o| {
            let k = o.kernels::<T>();
            [
                k.fwd.entry(),
                k.bwd.entry(),
                k.fwd_small.entry(),
                k.bwd_small.entry(),
                k.row_fwd.entry(),
                k.row_bwd.entry(),
            ]
        });
        let fused = Activation::ALL.iter().flat_map(|&a| {
            let k = a.kernels::<T>();
            [k.fwd.entry(), k.bwd.entry()]
        });
        unary.chain(pow).chain(output).chain(binary).chain(fused).chain(core::iter::once(T::COLSUM_FINISH.entry()))
    }
    of::<f32>().chain(of::<crate::F16>()).chain(of::<crate::BF16>())
}

// --- the kernels: one per (op, dtype), named `<op>_<kind>_<dtype>` -----------------------------

// The small-launch entries `<op>_fwd_small_<dtype>` and `<op>_bwd_small_<dtype>`: every unary
// op's (from `unary_kernels`), and pow's forms by multiplication or division alone (`ops::PowIn`).
macro_rules! small_kernels {
    ($($op:ident $O:ident),* $(,)?) => { $( $crate::for_each_elem!(small_kernels, $op, $O); )* };
    ($T:ty, $sfx:ident, $op:ident, $O:ident) => {
        paste::paste! {
            $crate::kernel!([<$op _fwd_small_ $sfx>]: UnaryFwdArgs<$T> = |x, y, n, a, b|
                unary_fwd_small::<$T, crate::ops::$O>(x, y, n, a, b));
            $crate::kernel!([<$op _bwd_small_ $sfx>]: UnaryBwdArgs<$T> = |x, g, gx, n, a, b|
                unary_bwd_small::<$T, crate::ops::$O>(x, g, gx, n, a, b));
        }
    };
}

macro_rules! unary_kernels {
    ($($op:ident $O:ident),* $(,)?) => {
        $( $crate::for_each_elem!(unary_kernels, $op, $O); )*
        $crate::for_each_elem!(unary_handles, [$($op $O)*]);
    };
    ($T:ty, $sfx:ident, $op:ident, $O:ident) => {
        paste::paste! {
            $crate::kernel!([<$op _fwd_ $sfx>]: UnaryFwdArgs<$T> = |x, y, n, a, b|
                unary_fwd::<$T, crate::ops::$O>(x, y, n, a, b));
            $crate::kernel!([<$op _bwd_ $sfx>]: UnaryBwdArgs<$T> = |x, g, gx, n, a, b|
                unary_bwd::<$T, crate::ops::$O>(x, g, gx, n, a, b));
        }
        small_kernels!($T, $sfx, $op, $O);
    };
}
// Per storage type, each op's handles (`ElementwiseElem::unary`).
macro_rules! unary_handles {
    ($T:ty, $sfx:ident, [$($op:ident $O:ident)*]) => {
        paste::paste! {
            #[cfg(not(target_arch = "nvptx64"))]
            fn [<unary_table_ $sfx>](op: Unary) -> UnaryKernels<$T> {
                match op {
                    $(Unary::$O => UnaryKernels {
                        fwd: [<$op _fwd_ $sfx>],
                        bwd: [<$op _bwd_ $sfx>],
                        fwd_small: [<$op _fwd_small_ $sfx>],
                        bwd_small: [<$op _bwd_small_ $sfx>],
                    },)*
                }
            }
        }
    };
}
crate::unary_list!(unary_kernels);

macro_rules! output_grad_kernels {
    ($($op:ident $O:ident),* $(,)?) => {
        $( $crate::for_each_elem!(output_grad_kernels, $op, $O); )*
        $crate::for_each_elem!(output_grad_kernels, [$($op $O)*]);
    };
    ($T:ty, $sfx:ident, [$($op:ident $O:ident)*]) => {
        paste::paste! {
            #[cfg(not(target_arch = "nvptx64"))]
            fn [<output_grad_table_ $sfx>](op: OutputGrad) -> OutputGradKernels<$T> {
                match op {
                    $(OutputGrad::$O => OutputGradKernels {
                        bwd_y: [<$op _bwd_y_ $sfx>],
                        bwd_y_small: [<$op _bwd_y_small_ $sfx>],
                    },)*
                }
            }
        }
    };
    ($T:ty, $sfx:ident, $op:ident, $O:ident) => {
        paste::paste! {
            $crate::kernel!([<$op _bwd_y_ $sfx>]: UnaryBwdArgs<$T> = |y, g, gx, n, a, b|
                unary_bwd::<$T, FromOutput<crate::ops::$O>>(y, g, gx, n, a, b));
            $crate::kernel!([<$op _bwd_y_small_ $sfx>]: UnaryBwdArgs<$T> = |y, g, gx, n, a, b|
                unary_bwd_small::<$T, FromOutput<crate::ops::$O>>(y, g, gx, n, a, b));
        }
    };
}
crate::output_grad_list!(output_grad_kernels);

crate::pow_form_list!(small_kernels);

// Per storage type, the handles of pow's forms (`ElementwiseElem::pow_form`).
macro_rules! pow_form_table {
    ($($op:ident $O:ident),* $(,)?) => { $crate::for_each_elem!(pow_form_table, [$($op $O)*]); };
    ($T:ty, $sfx:ident, [$($op:ident $O:ident)*]) => {
        paste::paste! {
            #[cfg(not(target_arch = "nvptx64"))]
            fn [<pow_form_table_ $sfx>](f: PowForm) -> PowFormKernels<$T> {
                match f {
                    $(PowForm::$O => PowFormKernels {
                        fwd_small: [<$op _fwd_small_ $sfx>],
                        bwd_small: [<$op _bwd_small_ $sfx>],
                    },)*
                }
            }
        }
    };
}
crate::pow_form_list!(pow_form_table);

macro_rules! binary_kernels {
    ($($op:ident $O:ident),* $(,)?) => {
        $( $crate::for_each_elem!(binary_kernels, $op, $O); )*
        $crate::for_each_elem!(binary_kernels, [$($op $O)*]);
    };
    ($T:ty, $sfx:ident, [$($op:ident $O:ident)*]) => {
        paste::paste! {
            #[cfg(not(target_arch = "nvptx64"))]
            fn [<binary_table_ $sfx>](op: Binary) -> BinaryKernels<$T> {
                match op {
                    $(Binary::$O => BinaryKernels {
                        fwd: [<$op _fwd_ $sfx>],
                        bwd: [<$op _bwd_ $sfx>],
                        fwd_small: [<$op _fwd_small_ $sfx>],
                        bwd_small: [<$op _bwd_small_ $sfx>],
                        row_fwd: [<$op _row_fwd_ $sfx>],
                        row_bwd: [<$op _row_bwd_ $sfx>],
                    },)*
                }
            }
        }
    };
    ($T:ty, $sfx:ident, $op:ident, $O:ident) => {
        paste::paste! {
            $crate::kernel!([<$op _fwd_ $sfx>]: BinaryFwdArgs<$T> = |x, y, out, n|
                binary_fwd::<$T, crate::ops::$O>(x, y, out, n));
            $crate::kernel!([<$op _bwd_ $sfx>]: BinaryBwdArgs<$T> = |x, y, g, gx, gy, n|
                binary_bwd::<$T, crate::ops::$O>(x, y, g, gx, gy, n));
            $crate::kernel!([<$op _fwd_small_ $sfx>]: BinaryFwdArgs<$T> = |x, y, out, n|
                binary_fwd_small::<$T, crate::ops::$O>(x, y, out, n));
            $crate::kernel!([<$op _bwd_small_ $sfx>]: BinaryBwdArgs<$T> = |x, y, g, gx, gy, n|
                binary_bwd_small::<$T, crate::ops::$O>(x, y, g, gx, gy, n));
            $crate::kernel!([<$op _row_fwd_ $sfx>]: RowFwdArgs<$T> = |x, p0, p1, y, n, cols, a, b|
                row_fwd::<$T, BiasBinary<crate::ops::$O>>(x, p0, p1, y, n, cols, a, b));
            $crate::kernel!([<$op _row_bwd_ $sfx>]: RowBwdArgs<$T> =
                |x, p0, p1, g, gx, partial, rows, cols, a, b|
                row_bwd::<$T, BiasBinary<crate::ops::$O>>(x, p0, p1, g, gx, partial, rows, cols, a, b));
        }
    };
}
crate::binary_list!(binary_kernels);

macro_rules! fused_kernels {
    ($($op:ident $O:ident),* $(,)?) => {
        $( $crate::for_each_elem!(fused_kernels, $op, $O); )*
        $crate::for_each_elem!(fused_kernels, [$($op $O)*]);
    };
    ($T:ty, $sfx:ident, [$($op:ident $O:ident)*]) => {
        paste::paste! {
            #[cfg(not(target_arch = "nvptx64"))]
            fn [<scale_bias_table_ $sfx>](act: Activation) -> ScaleBiasKernels<$T> {
                match act {
                    $(Activation::$O => ScaleBiasKernels {
                        fwd: [<scale_bias_ $op _fwd_ $sfx>],
                        bwd: [<scale_bias_ $op _bwd_ $sfx>],
                    },)*
                }
            }
        }
    };
    ($T:ty, $sfx:ident, $op:ident, $O:ident) => {
        paste::paste! {
            $crate::kernel!([<scale_bias_ $op _fwd_ $sfx>]: RowFwdArgs<$T> = |x, p0, p1, y, n, cols, a, b|
                row_fwd::<$T, ScaleBiasAct<crate::ops::$O>>(x, p0, p1, y, n, cols, a, b));
            $crate::kernel!([<scale_bias_ $op _bwd_ $sfx>]: RowBwdArgs<$T> =
                |x, p0, p1, g, gx, partial, rows, cols, a, b|
                row_bwd::<$T, ScaleBiasAct<crate::ops::$O>>(x, p0, p1, g, gx, partial, rows, cols, a, b));
        }
    };
}
crate::activation_list!(fused_kernels);

macro_rules! colsum_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<colsum_finish_ $sfx>]: ColsumFinishArgs<$T> = |partial, out, chunks, cols|
                colsum_finish::<$T>(partial, out, chunks, cols));
        }
    };
}
crate::for_each_elem!(colsum_kernels);

// Each storage type's tables, from the lists' declarations above.
macro_rules! elementwise_elem {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            #[cfg(not(target_arch = "nvptx64"))]
            impl ElementwiseElem for $T {
                fn unary(op: Unary) -> UnaryKernels<$T> {
                    [<unary_table_ $sfx>](op)
                }
                fn pow_form(f: PowForm) -> PowFormKernels<$T> {
                    [<pow_form_table_ $sfx>](f)
                }
                fn output_grad(op: OutputGrad) -> OutputGradKernels<$T> {
                    [<output_grad_table_ $sfx>](op)
                }
                fn binary(op: Binary) -> BinaryKernels<$T> {
                    [<binary_table_ $sfx>](op)
                }
                fn scale_bias(act: Activation) -> ScaleBiasKernels<$T> {
                    [<scale_bias_table_ $sfx>](act)
                }
                const COLSUM_FINISH: Kernel<ColsumFinishArgs<$T>> = [<colsum_finish_ $sfx>];
            }
        }
    };
}
crate::for_each_elem!(elementwise_elem);
