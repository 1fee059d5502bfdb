//! Transpose of the last two dimensions into a new contiguous tensor:
//! `y[b, c, r] = x[b, r, c]` for a `[batch, rows, cols]` input.
//!
//! Bits move, values are never converted: f32 moves as `u32`, f16 and bf16 as `u16`, so NaN
//! payloads, signed zeros and denormals come out as they went in.
//!
//! Memory pattern: a transpose reads rows and writes columns, so one of the two global sides is
//! strided unless a tile is staged in shared memory: a block reads a tile along the input's rows
//! and writes it along the output's rows (the input's columns), both coalesced. Three tilings
//! ([`Tiling`]), chosen per launch by the host ([`tiling`]); the kernel follows the launch's
//! block shape:
//!
//! - *Vector* (both `rows` and `cols` multiples of the 16-byte vector width `V`, 4 for f32 and 8
//!   for 16-bit types, so that every input row and every output row starts 16-byte aligned):
//!   tiles of `S V x S V` elements, `S x S` threads, `S` = 16 (64 x 64 f32, 128 x 128 f16/bf16,
//!   256 threads) or, for grids too small to reach every SM, 8 (32 x 32 f32, 64 x 64 f16/bf16,
//!   64 threads: four times the blocks). Thread `t` loads the `V x V` micro-block at micro-row
//!   `t / S`, micro-column `t % S` with `V` 16-byte loads (a warp reads `32 / S` row segments of
//!   `16 S` bytes per instruction, whole 128-byte lines; 64 or 128 bytes per thread in flight),
//!   transposes it in registers (free for f32; two 16-bit halves per word for f16/bf16), and
//!   writes its `V` output vectors to shared memory as whole 16-byte slots. After a barrier, each
//!   thread reads `V` slots along output rows and stores them with 16-byte stores. Every
//!   shared-memory access is 16 bytes, served a quarter-warp (8 threads, 128 bytes) at a time,
//!   conflict-free when the 8 slots fall in 8 different 16-byte bank groups (slot mod 8). Output
//!   row `c` of the tile, micro-row `rb` lives in slot `S c + rb + c / V` ([`vec_slot`]): rows of
//!   `S` slots, each group of `V` rows (one micro-column) shifted by one slot more than the last.
//!   On the write side a quarter-warp holds 8 consecutive micro-columns `cb` (`c = V cb + k`,
//!   `rb` equal): slots `S V cb + S k + rb + cb`, distinct mod 8 through the `+ cb` (`S V` is a
//!   multiple of 8). On the read side it holds 8 consecutive `rb` with `c` equal: consecutive
//!   slots. And both sides step by a constant per unrolled index, so each thread's addresses are
//!   one base plus immediate offsets.
//! - *Scalar* (any shape): the classic `32 x 32` tile, `32 x 8` threads, four elements per
//!   thread, one element per access. The tile's row stride is 33 words for f32 and 17 words (34
//!   halves) for 16-bit types: odd, so the 32 elements of a tile column read by a warp lie in 32
//!   different banks (for 16-bit types a warp's row write covers 16 consecutive words).
//!
//! Grid: `grid.x` walks column tiles, `grid.y` the (batch, row tile) pairs folded into one index
//! (a batch over the leading dimensions needs no `grid.z`); both are capped by the host (2^31 - 1
//! and 65535) and the blocks loop over the tiles beyond. Indices are 64-bit throughout.

use crate::DType;

// Each dtype's typed handle (`TransposeElem`), and its entry for the host's list of kernels.
use crate::kernel::Kernel;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::KernelEntry;

/// `(x, y, batch, rows, cols)`: `y[b, c, r] = x[b, r, c]`, both contiguous, `batch * rows *
/// cols` elements each, 16-byte aligned (whole allocations), not overlapping.
pub type TransposeArgs<T> = (*const T, *mut T, u64, u64, u64);

/// Elements of `dt` in one 16-byte vector.
pub const fn vec_width(dt: DType) -> u64 {
    16 / dt.size() as u64
}

/// Whether a `rows x cols` transpose of `dt` takes the vector path: every input and output row
/// then starts on a 16-byte boundary.
pub const fn vector_path(dt: DType, rows: u64, cols: u64) -> bool {
    let v = vec_width(dt);
    rows.is_multiple_of(v) && cols.is_multiple_of(v)
}

/// How a launch tiles the matrices; the host picks it ([`tiling`]), the kernel follows the
/// block shape ([`block`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiling {
    /// `S x S` micro-blocks of `V x V` elements a tile, one thread each; `slots` is `S`, 16 or
    /// [`SMALL_VEC_SLOTS`]. Needs `vector_path`.
    Vector {
        /// `S`: micro-blocks a tile side.
        slots: u32,
    },
    /// `32 x 32` elements a tile, `32 x 8` threads; any shape.
    Scalar,
}

/// Micro-blocks along each side of a vector tile (and 16-byte slots per shared-memory row).
pub const VEC_SLOTS: u32 = 16;
/// The same for grids too small to reach every SM at [`VEC_SLOTS`]: a quarter of the tile, four
/// times the blocks.
pub const SMALL_VEC_SLOTS: u32 = 8;
/// Side of a scalar tile.
pub const SCALAR_TILE: u64 = 32;
/// Thread rows of a scalar block (`32 x 8` threads, four tile rows each).
pub const SCALAR_ROWS: u32 = 8;

/// The tiling of a `batch x rows x cols` transpose of `dt` on a GPU of `sm_count` SMs: scalar
/// unless `vector_path`; vector tiles of 16 x 16 micro-blocks unless they would make fewer
/// blocks than `sm_count`, in which case 8 x 8 (a quarter of the bytes a block, four times the
/// blocks: at 64 x 1024 f32, 64 blocks of 4 KB instead of 16 of 16 KB).
pub const fn tiling(dt: DType, batch: u64, rows: u64, cols: u64, sm_count: u32) -> Tiling {
    if !vector_path(dt, rows, cols) {
        return Tiling::Scalar;
    }
    let t = VEC_SLOTS as u64 * vec_width(dt);
    let tiles = batch.saturating_mul(rows.div_ceil(t)).saturating_mul(cols.div_ceil(t));
    if tiles < sm_count as u64 {
        Tiling::Vector { slots: SMALL_VEC_SLOTS }
    } else {
        Tiling::Vector { slots: VEC_SLOTS }
    }
}

/// Side of the square tile, in elements.
pub const fn tile(dt: DType, tiling: Tiling) -> u64 {
    match tiling {
        Tiling::Vector { slots } => slots as u64 * vec_width(dt),
        Tiling::Scalar => SCALAR_TILE,
    }
}

/// Block shape: `S * S` threads for vector tiles (the kernel reads `S` back from it).
pub const fn block(tiling: Tiling) -> (u32, u32, u32) {
    match tiling {
        Tiling::Vector { slots } => (slots * slots, 1, 1),
        Tiling::Scalar => (SCALAR_TILE as u32, SCALAR_ROWS, 1),
    }
}

/// Row stride of a scalar tile in shared memory, in elements: an odd number of 32-bit words.
pub const fn scalar_stride(dt: DType) -> u64 {
    match dt.size() {
        4 => SCALAR_TILE + 1,
        _ => SCALAR_TILE + 2,
    }
}

/// Shared-memory slot (16 bytes) of a vector tile of `s x s` micro-blocks holding output row `c`
/// of the tile (input column), micro-row `rb` (input rows `V rb .. V rb + V`), for vector width
/// `v`: rows of `s` slots, each group of `v` rows shifted by one more slot. See the module
/// documentation.
pub const fn vec_slot(v: u32, s: u32, c: u32, rb: u32) -> u32 {
    c * s + rb + c / v
}

/// Slots of a vector tile's shared memory: the `S V x S` tile plus the shift of the last group
/// of rows.
pub const fn vec_smem_slots(dt: DType, slots: u32) -> u64 {
    (slots as u64 * vec_width(dt) + 1) * slots as u64
}

/// Dynamic shared memory of a block, in bytes: 16.3 or 32.3 KiB (vector, 16 slots), 4.1 or 8.1
/// KiB (vector, 8 slots), 4.1 or 2.1 KiB (scalar).
pub const fn smem_bytes(dt: DType, tiling: Tiling) -> u32 {
    let b = match tiling {
        Tiling::Vector { slots } => vec_smem_slots(dt, slots) * 16,
        Tiling::Scalar => SCALAR_TILE * scalar_stride(dt) * dt.size() as u64,
    };
    b as u32
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::Elem;
    use crate::prim::*;

    /// A 16-byte shared-memory slot: the alignment makes a slot one `ld`/`st.v4` instruction.
    #[repr(C, align(16))]
    #[derive(Clone, Copy)]
    struct Slot([u32; 4]);

    /// Calls `f(i)` for `i < N` with every index a constant (an array indexed by a loop the
    /// compiler does not unroll would live in local memory).
    #[inline(always)]
    fn unrolled<const N: usize>(mut f: impl FnMut(usize)) {
        macro_rules! each {
            ($($i:literal)*) => { $( if $i < N { f($i); } )* };
        }
        each!(0 1 2 3 4 5 6 7);
    }

    /// The tiles of this block: `f(b, r0, c0)` for each, with the block's threads in lockstep
    /// (the loop bounds depend on the block index only, so barriers inside `f` are convergent).
    #[inline(always)]
    fn for_tiles(batch: u64, rows: u64, cols: u64, tile: u64, mut f: impl FnMut(u64, u64, u64)) {
        let row_tiles = rows.div_ceil(tile);
        let col_tiles = cols.div_ceil(tile);
        let mut yt = block_idx_y() as u64;
        while yt < batch * row_tiles {
            let b = yt / row_tiles;
            let r0 = (yt - b * row_tiles) * tile;
            let mut ct = block_idx_x() as u64;
            while ct < col_tiles {
                f(b, r0, ct * tile);
                ct += grid_dim_x() as u64;
            }
            yt += grid_dim_y() as u64;
        }
    }

    /// Output vector `k` of a transposed `V x V` micro-block held as `V` input row vectors:
    /// `[m[0][k], m[1][k], ..., m[V-1][k]]`, packed as 16 bytes. Only moves bits.
    #[inline(always)]
    fn column<const V: usize>(m: &[[u32; 4]; V], k: usize) -> [u32; 4] {
        if V == 4 {
            [m[0][k], m[1][k], m[2][k], m[3][k]]
        } else {
            // 16-bit elements: element (j, k) is half `k % 2` of word `k / 2` of row j; output
            // word w holds rows 2w (low half) and 2w + 1 (high half). One `prmt` each.
            let (h, odd) = (k / 2, k % 2 == 1);
            let mut o = [0u32; 4];
            unrolled::<4>(
                #[inline(always)]
                |w| {
                    let (a, b) = (m[2 * w][h], m[2 * w + 1][h]);
                    o[w] = if odd { (a >> 16) | (b & 0xffff_0000) } else { (a & 0xffff) | (b << 16) };
                },
            );
            o
        }
    }

    /// The vector path; `V` = `T::VEC`, tiles of `S x S` micro-blocks. See the module
    /// documentation for the layout.
    ///
    /// # Safety
    /// As [`TransposeArgs`], with `rows % V == 0 && cols % V == 0`, launched with
    /// `block(Tiling::Vector { slots: S })` and `smem_bytes(T::DTYPE, Tiling::Vector { slots: S })`.
    #[inline(always)]
    unsafe fn vector_tiles<T: Elem, const V: usize, const S: u32>(
        x: *const T,
        y: *mut T,
        batch: u64,
        rows: u64,
        cols: u64,
    ) {
        let v = V as u64;
        // Load side: this thread's micro-block (micro-row rb, micro-column cb). Store side:
        // vector q of output rows p + S i of the tile. Both pairs are (t / S, t % S).
        let t = thread_idx_x();
        let (rb, cb) = (t / S, t % S);
        let (p, q) = (rb, cb);
        let smem = dyn_smem::<Slot>();
        // Slot of output row c (of the tile), micro-row rb: `c * S + rb + c / V`. Both sides
        // step by a constant per unrolled index, so the addresses are one base plus offsets.
        let write_base = vec_slot(V as u32, S, V as u32 * cb, rb);
        let read_base = vec_slot(V as u32, S, p, q);
        for_tiles(
            batch,
            rows,
            cols,
            S as u64 * v,
            #[inline(always)]
            |b, r0, c0| {
                let (r, c) = (r0 + v * rb as u64, c0 + v * cb as u64);
                // cols % V == 0 and c % V == 0: the micro-block is wholly inside or wholly outside.
                let live = r < rows && c < cols;
                let mut m = [[0u32; 4]; V];
                if live {
                    // Each row's address from the previous one: one stride register, where
                    // `src + j * cols` for each j would keep V - 1 hoisted 64-bit multiples live.
                    // SAFETY: (r, c) is inside x (live), and so are the V - 1 rows below it.
                    let mut a = unsafe { x.add(((b * rows + r) * cols + c) as usize) };
                    unrolled::<V>(
                        #[inline(always)]
                        |j| {
                            // SAFETY: row r + j < rows (rows % V == 0) and columns c .. c + V <=
                            // cols: a whole vector inside x, 16-byte aligned since cols % V ==
                            // c % V == 0; x is not written by this launch.
                            m[j] = unsafe { ld_global_nc_v4(a as *const u32) };
                            a = a.wrapping_add(cols as usize);
                        },
                    );
                }
                // The previous tile's readers are done with the slots (the loads above are already
                // in flight).
                sync_threads();
                if live {
                    unrolled::<V>(
                        #[inline(always)]
                        |k| {
                            // SAFETY: vec_slot(V, S, V cb + k, rb) < vec_smem_slots, the launch's
                            // shared memory in slots.
                            unsafe { *smem.add(write_base as usize + k * S as usize) = Slot(column::<V>(&m, k)) };
                        },
                    );
                }
                sync_threads();
                // All V slots first (shared-memory reads in flight together), then the stores.
                let mut o = [[0u32; 4]; V];
                unrolled::<V>(
                    #[inline(always)]
                    |i| {
                        // SAFETY: vec_slot(V, S, p + S i, q) = read_base + i * vec_slot(V, S, S, 0),
                        // inside the shared memory as above.
                        o[i] = unsafe { (*smem.add(read_base as usize + i * vec_slot(V as u32, S, S, 0) as usize)).0 };
                    },
                );
                let orow = r0 + v * q as u64;
                // Output rows p + S i of the tile: one base, S output rows apart.
                let d = y.wrapping_add(((b * cols + c0 + p as u64) * rows + orow) as usize);
                unrolled::<V>(
                    #[inline(always)]
                    |i| {
                        // Slot (p + S i, q) was written above by the thread with
                        // cb = (p + S i) / V, rb = q, which was live exactly when this holds.
                        if c0 + p as u64 + S as u64 * (i as u64) < cols && orow < rows {
                            // SAFETY: d points at output row c0 + p + S i < cols, columns
                            // orow .. orow + V <= rows: a whole 16-byte aligned vector of y.
                            unsafe { st_global_v4(d.wrapping_add(i * (S as u64 * rows) as usize) as *mut u32, o[i]) };
                        }
                    },
                );
            },
        );
    }

    /// The scalar path over bits of type `B` (`u32` or `u16`); `S` is the tile's row stride.
    ///
    /// # Safety
    /// As [`TransposeArgs`], launched with `block(false)` and `smem_bytes(dtype, false)`.
    #[inline(always)]
    unsafe fn scalar_tiles<B: Copy + Default, const S: usize>(
        x: *const B,
        y: *mut B,
        batch: u64,
        rows: u64,
        cols: u64,
    ) {
        const R: u64 = SCALAR_ROWS as u64;
        let (tx, ty) = (thread_idx_x() as u64, thread_idx_y() as u64);
        let smem = dyn_smem::<B>();
        let s = S as u64;
        for_tiles(
            batch,
            rows,
            cols,
            SCALAR_TILE,
            #[inline(always)]
            |b, r0, c0| {
                // Load rows r0 + ty + 8j, column c0 + tx: a warp reads 32 consecutive elements of a
                // row per instruction; the four loads are issued before anything waits.
                let c = c0 + tx;
                let mut v = [B::default(); 4];
                unrolled::<4>(
                    #[inline(always)]
                    |j| {
                        let r = r0 + ty + R * j as u64;
                        if r < rows && c < cols {
                            // SAFETY: r < rows, c < cols: inside x.
                            v[j] = unsafe { *x.add(((b * rows + r) * cols + c) as usize) };
                        }
                    },
                );
                sync_threads();
                unrolled::<4>(
                    #[inline(always)]
                    |j| {
                        // Row write: a warp covers consecutive elements of one tile row.
                        // SAFETY: (ty + 8j) * S + tx < 32 * S, the launch's shared memory.
                        unsafe { *smem.add(((ty + R * j as u64) * s + tx) as usize) = v[j] };
                    },
                );
                sync_threads();
                // Store output row c0 + ty + 8j (input column), output column r0 + tx (input row):
                // the warp reads a tile column and writes 32 consecutive elements of an output
                // row. The four shared-memory reads first, then the stores.
                let mut w = [B::default(); 4];
                unrolled::<4>(
                    #[inline(always)]
                    |j| {
                        // A tile column: stride S, an odd number of words, so the warp's 32
                        // reads hit 32 different banks.
                        // SAFETY: tx * S + ty + 8j < 32 * S, the launch's shared memory.
                        w[j] = unsafe { *smem.add((tx * s + ty + R * j as u64) as usize) };
                    },
                );
                let orow = r0 + tx;
                let dst = (b * cols + c0 + ty) * rows + orow;
                unrolled::<4>(
                    #[inline(always)]
                    |j| {
                        // Element (ty + 8j, tx) of the transposed tile was loaded above by thread
                        // (ty + 8j, tx) of the load side, in bounds exactly when this holds.
                        if c0 + ty + R * (j as u64) < cols && orow < rows {
                            // SAFETY: output row c0 + ty + 8j < cols, column orow < rows: inside y.
                            unsafe { *y.add((dst + R * j as u64 * rows) as usize) = w[j] };
                        }
                    },
                );
            },
        );
    }

    /// The kernel body: the path of `vector_path`, the vector tile of the launch's block shape.
    ///
    /// # Safety
    /// As [`TransposeArgs`], launched with the block and shared memory of a [`Tiling`] that
    /// [`tiling`] can return for these sizes (scalar exactly when not `vector_path`).
    pub unsafe fn transpose<T: Elem>(x: *const T, y: *mut T, batch: u64, rows: u64, cols: u64) {
        // SAFETY: per the contract; f32, F16 and BF16 are plain 4- and 2-byte values, so their
        // memory may be moved as u32 / u16.
        unsafe {
            if vector_path(T::DTYPE, rows, cols) {
                // The tile's micro-blocks a side from the block's threads (`block`): uniform
                // over the launch.
                let small = block_dim_x() == SMALL_VEC_SLOTS * SMALL_VEC_SLOTS;
                match (T::VEC == 4, small) {
                    (true, false) => vector_tiles::<T, 4, VEC_SLOTS>(x, y, batch, rows, cols),
                    (true, true) => vector_tiles::<T, 4, SMALL_VEC_SLOTS>(x, y, batch, rows, cols),
                    (false, false) => vector_tiles::<T, 8, VEC_SLOTS>(x, y, batch, rows, cols),
                    (false, true) => vector_tiles::<T, 8, SMALL_VEC_SLOTS>(x, y, batch, rows, cols),
                }
            } else if core::mem::size_of::<T>() == 4 {
                scalar_tiles::<u32, { scalar_stride(DType::F32) as usize }>(
                    x as *const u32,
                    y as *mut u32,
                    batch,
                    rows,
                    cols,
                )
            } else {
                scalar_tiles::<u16, { scalar_stride(DType::F16) as usize }>(
                    x as *const u16,
                    y as *mut u16,
                    batch,
                    rows,
                    cols,
                )
            }
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

macro_rules! transpose_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<transpose_ $sfx>]: TransposeArgs<$T> = |x, y, batch, rows, cols|
                transpose::<$T>(x, y, batch, rows, cols));
            #[cfg(not(target_arch = "nvptx64"))]
            impl TransposeElem for $T {
                const TRANSPOSE: Kernel<TransposeArgs<$T>> = [<transpose_ $sfx>];
            }
        }
    };
}
crate::for_each_elem!(transpose_kernels);

/// A storage type's transpose kernel, typed.
pub trait TransposeElem: crate::Elem {
    /// `transpose_<dt>` for `Self`.
    const TRANSPOSE: Kernel<TransposeArgs<Self>>;
}

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    use crate::dtype::{BF16, F16};
    [f32::TRANSPOSE.entry(), F16::TRANSPOSE.entry(), BF16::TRANSPOSE.entry()].into_iter()
}
