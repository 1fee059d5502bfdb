//! bf16 and f16 matrix products on Hopper's warpgroup tensor cores (sm_90a):
//! `D = epilogue(op(A) @ op(B))` with f32 accumulation, D in f32, bf16 or f16
//! ([`crate::gemm_epilogue`]).
//!
//! The design (docs/design.md, "bf16 and f16 on Hopper"):
//! - A block of 384 threads owns a 128 x 256 tile of D at a time: warpgroup 0 is the producer,
//!   one thread of which streams 64-deep K slices of A and B into a ring of [`STAGES`]
//!   shared-memory stages with the copy engine (TMA, 128-byte swizzle), each stage guarded by a
//!   "full" mbarrier (the copy's bytes landed) and an "empty" one (both consumers are done with
//!   it). Warpgroups 1 and 2 are the consumers: each multiplies its 64 rows of the tile by the
//!   256 columns with `wgmma.m64n256k16` straight from shared memory, holding 128 accumulators
//!   a thread, and keeps one group of products in flight while it waits for the next stage.
//! - The producer hands its registers to the consumers (`setmaxnreg`: 40 against 232).
//! - Clusters of [`CLUSTER`] blocks take vertically adjacent tiles and share B's slice: each
//!   block loads half of it into both (TMA multicast); a stage is refilled once the consumers of
//!   both blocks released it.
//! - Persistent: as many clusters as fit at once, cluster `c` taking cluster tiles `c`,
//!   `c + clusters`, ... in an order that walks [`GROUP_M`] tile rows together, so that the tiles
//!   in flight share their A and B slices in L2. While the consumers store one tile, the producer
//!   already loads the next one's stages. Few tiles and a long K: split-K ([`SPLIT_K`]). A
//!   product of at most [`BM`] rows pairs the blocks of a cluster on one tile, each taking a K
//!   slice ([`PAIR_K`]), and a consumer whose 64 rows lie outside D issues no products.
//! - Layouts: A is read K-major (stored `m x k`) or M-major (stored `k x m`, `trans_a`), B
//!   K-major (stored `n x k`, `trans_b`) or N-major (stored `k x n`); both are what `wgmma`
//!   reads directly, so every transpose runs at the same speed. Out-of-range rows and K columns
//!   of a tile are zeros from the copy engine, so any `m`, `n` and `k >= 1` work; what the copy
//!   engine needs is 16-byte aligned rows (the host sends other operands, and `k = 0`, to
//!   `gemm_tc`).

use crate::gemm_epilogue::Epilogue;

/// Rows of D per tile.
pub const BM: u32 = 128;
/// Columns of D per tile.
pub const BN: u32 = 256;
/// K per stage: 64 16-bit values, one 128-byte swizzle row.
pub const BK: u32 = 64;
/// Stages of the ring.
pub const STAGES: u32 = 4;
/// Threads per block: a producer warpgroup and two consumers.
pub const THREADS: u32 = 384;
/// Blocks per cluster: the two blocks of a cluster take vertically adjacent tiles, which share
/// their slice of B: each block loads half of it and the copy engine writes it into both
/// (multicast), which halves B's traffic from L2.
pub const CLUSTER: u32 = 2;
/// Cluster tile rows (of `CLUSTER * BM` rows) walked together ([`tile_coords`]).
pub const GROUP_M: u32 = 8;

const A_STAGE: u32 = BM * BK * 2;
const B_STAGE: u32 = BN * BK * 2;

/// Dynamic shared memory a block: the ring, its mbarriers, and up to 1 KiB to align the ring
/// to the 1024 bytes that 128-byte swizzling needs.
pub const SMEM_BYTES: u32 = 1024 + STAGES * (A_STAGE + B_STAGE) + 2 * STAGES * 8;

/// Bit of the flags parameter: A is a batch (its tensor map's third coordinate is the batch
/// index); without it every product reads the same A.
pub const A_BATCHED: u32 = 1;
/// As [`A_BATCHED`], for B.
pub const B_BATCHED: u32 = 2;
/// Bit of the flags parameter: split-K. The batch index is the slice of K, `[b * k_chunk,
/// (b + 1) * k_chunk)`, of a single product (A and B not batched); D's batch `b` is that slice's
/// partial product (an f32 workspace that a reduction sums).
pub const SPLIT_K: u32 = 4;
/// Bit of the flags parameter, with [`SPLIT_K`]: the two blocks of a cluster take the same tile,
/// block `r` of batch `b` the K slice `CLUSTER * b + r` (D's batch of that index), each loading
/// its own B. For products of at most [`BM`] rows, where the vertically adjacent tile of the
/// other block would lie outside D.
pub const PAIR_K: u32 = 8;

/// Parameters: the two tensor maps (A's at the address, B's 128 bytes after it; in global
/// memory, 64-byte aligned), the epilogue (its `m`, `n` the product's), `k`, the batch count,
/// the flags ([`A_BATCHED`], [`B_BATCHED`], [`SPLIT_K`], [`PAIR_K`]) and, with `SPLIT_K`, the
/// slices' length (a multiple of [`BK`]; a slice that starts at or beyond `k` is zeros).
pub type WgmmaArgs = (*const u64, Epilogue, u32, u32, u32, u32);

/// The most words of tensor maps one buffer holds: four 128-byte `CUtensorMap`s (the attention
/// backward's Q, K, V and dO; the GEMM's A and B take two).
pub const MAP_WORDS: usize = 64;

/// Tensor maps as one kernel parameter (`#[repr(C)]`, 512 bytes): what [`MapsArgs`]' kernel
/// writes to the global memory the GEMM and attention kernels read them from.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TensorMaps {
    /// The maps, 16 words each, in order; zeros after the last.
    pub words: [u64; MAP_WORDS],
}

/// A kernel parameter: a plain `#[repr(C)]` array of integers.
impl crate::kernel::Param for TensorMaps {}

/// `(dst, maps)` of `store_tensor_maps`: `dst` ([`MAP_WORDS`] words of global memory, 64-byte
/// aligned) gets `maps`, from one thread. The maps travel in the launch's parameters, which a CUDA
/// graph that records the launch keeps by value; a copy from host memory would keep the host
/// address instead, of a buffer gone before the graph is replayed.
pub type MapsArgs = (*mut u64, TensorMaps);

#[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_90a"))]
crate::kernel!(store_tensor_maps: MapsArgs = |dst, maps| device::store_maps(dst, maps));

/// Tile `t` of a persistent walk over `batch x tiles_m x tiles_n` tiles (here the tiles of a
/// cluster, `CLUSTER * BM x BN`): `(batch, tile row, tile column)`. Within a batch, groups of
/// [`GROUP_M`] tile rows are walked column by column, so consecutive tiles share B's columns and
/// a group's A rows stay in L2.
pub const fn tile_coords(t: u32, tiles_m: u32, tiles_n: u32) -> (u32, u32, u32) {
    let per_batch = tiles_m * tiles_n;
    let b = t / per_batch;
    let r = t % per_batch;
    let in_group = GROUP_M * tiles_n;
    let first_m = r / in_group * GROUP_M;
    let rows = if tiles_m - first_m < GROUP_M { tiles_m - first_m } else { GROUP_M };
    let q = r % in_group;
    (b, first_m + q % rows, q / rows)
}

#[cfg(all(target_arch = "nvptx64", target_feature = "sm_90a"))]
mod device {
    use super::*;
    use crate::gemm::{EPI_GELU, EPI_GELU_TANH, EPI_IDENTITY, EPI_RELU, EPI_SILU};
    use crate::gemm_epilogue::{OutType, QUAD, is_plain, store_pair, store_pair_plain};
    use crate::prim::*;

    /// Consumer warpgroups.
    const CONSUMERS: u32 = 2;

    /// [`MapsArgs`]: every word, with constant indices (a run-time index into the parameter
    /// would copy it to local memory).
    ///
    /// # Safety
    /// `dst` holds [`MAP_WORDS`] words of global memory.
    pub unsafe fn store_maps(dst: *mut u64, maps: TensorMaps) {
        unroll!(W: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
            32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63 => {
            // SAFETY: W < MAP_WORDS, which dst holds (the function's contract).
            unsafe { *dst.add(W) = maps.words[W] };
        });
    }

    /// The whole epilogue of a consumer thread's accumulators (laid out as
    /// [`WgmmaAcc`] says, from `(row, col)`). Not inlined, and a rolled loop: written
    /// out 64 times, each activation's code made a kernel of hundreds of kilobytes, and a call
    /// per pair made ptxas save the live accumulators around each call.
    #[inline(never)]
    unsafe fn store_tile<O: OutType>(e: &Epilogue, b: u32, row: u32, col: u32, acc: &[f32; 128]) {
        for j in 0..32 {
            // SAFETY: the caller's (store_pair checks rows and columns).
            unsafe {
                store_pair::<O>(e, b, row, col + 8 * j as u32, [acc[4 * j], acc[4 * j + 1]]);
                store_pair::<O>(e, b, row + 8, col + 8 * j as u32, [acc[4 * j + 2], acc[4 * j + 3]]);
            }
        }
    }

    /// Stores a consumer thread's accumulators (as [`store_tile`]) where the epilogue is
    /// `act(alpha * acc + bias_col[col]) (+ residual)` ([`is_simple`]; the residual read as pairs
    /// where the thread holds them, before the exchange) into a 16-bit D with 16-byte aligned
    /// rows and the tile lies inside D's columns, in straight-line code (the linear layer's
    /// bias and activation without the general path's rolled loop). The four threads of a quad
    /// exchange their pairs (a 4 x 4 transpose of 32-bit words by shuffles) so that each stores 8
    /// consecutive columns, 16 bytes, where it held four pairs 16 bytes apart: a warp's store
    /// covers whole 32-byte sectors, a quarter of the instructions of the pair stores. `ACT` is
    /// the activation code, so that each kernel holds one copy of this per activation, not one
    /// with all of them per element.
    ///
    /// # Safety
    /// As [`store_tile`]; the whole warp calls it (shuffles); [`is_simple`] holds.
    #[inline(always)]
    unsafe fn store_tile_quad<O: OutType, const ACT: u32>(
        e: &Epilogue,
        b: u32,
        row: u32,
        col_tile: u32,
        acc: &[f32; 128],
    ) {
        // A copy in registers: read through the reference, every field would be loaded again
        // from the kernel's stack copy of the parameter after each store (an `asm!` store may
        // write any memory).
        let e = *e;
        let t = thread_idx_x() % 4;
        let pack = |lo: f32, hi: f32| {
            if O::DTYPE == crate::DType::BF16 { f32x2_to_bf16x2(lo, hi) } else { f32x2_to_f16x2(lo, hi) }
        };
        // As `gemm::epilogue` with beta = 0, so both paths give the same bits.
        let value = |a: f32, bias: f32| {
            let v = if e.alpha == 0.0 { 0.0 } else { e.alpha * a };
            crate::gemm::activate(ACT, v + bias)
        };
        unroll!(G: usize; 0 1 2 3 4 5 6 7 => {
            // This thread's columns of the group: 8 (4 G + j) + 2 t and the next, j < 4.
            // SAFETY: all-zero bits are 0.0 (a repeat expression would be a loop).
            let mut bias: [f32; 8] = unsafe { core::mem::zeroed() };
            if !e.bias_col.is_null() {
                unroll!(J: usize; 0 1 2 3 => {
                    let c = (col_tile + 8 * (4 * G as u32 + J as u32) + 2 * t) as usize;
                    let size = O::DTYPE.size();
                    // SAFETY: the tile lies inside D's columns, and the bias has n elements.
                    unsafe {
                        bias[2 * J] = O::load1(e.bias_col.add(c * size));
                        bias[2 * J + 1] = O::load1(e.bias_col.add((c + 1) * size));
                    }
                });
            }
            unroll!(H: usize; 0 1 => {
                let r = row + 8 * H as u32;
                // w[j]: this thread's pair of columns 8 (4 G + j) + 2 t of row r.
                let mut w = [0u32; 4];
                unroll!(J: usize; 0 1 2 3 => {
                    let i = 4 * (4 * G + J) + 2 * H;
                    let (lo, hi) = (value(acc[i], bias[2 * J]), value(acc[i + 1], bias[2 * J + 1]));
                    w[J] = if !e.residual.is_null() && r < e.m {
                        let c = col_tile + 8 * (4 * G as u32 + J as u32) + 2 * t;
                        let idx = b as u64 * e.stride_d + r as u64 * e.ldd + c as u64;
                        // SAFETY: the row is inside D and the pair inside its columns; the
                        // residual has D's layout, its pairs aligned (QUAD implies PAIR).
                        let res = unsafe { O::load2(e.residual.add(idx as usize * O::DTYPE.size())) };
                        pack(lo + res[0], hi + res[1])
                    } else {
                        pack(lo, hi)
                    };
                });
                // Transpose within the quad: afterwards w[j] is thread j's pair of columns
                // 8 (4 G + t) + 2 j.
                unroll!(M: u32; 2 1 => {
                    unroll!(J: usize; 0 1 2 3 => {
                        if J as u32 & M == 0 {
                            let hi = J | M as usize;
                            let keep_low = t & M == 0;
                            let got = shfl_xor_u32(if keep_low { w[hi] } else { w[J] }, M);
                            if keep_low { w[hi] = got } else { w[J] = got }
                        }
                    });
                });
                if r < e.m {
                    let i = b as u64 * e.stride_d + r as u64 * e.ldd + (col_tile + 8 * (4 * G as u32 + t)) as u64;
                    // SAFETY: the row is inside D, the tile's columns too (the caller's), and
                    // rows are 16-byte aligned (QUAD).
                    unsafe { st_global_v4((e.d as *mut u32).add(i as usize / 2), w) };
                }
            });
        });
    }

    /// [`store_tile_quad`] where the epilogue is a plain store ([`is_plain`]): the values
    /// rounded and stored, nothing computed per element, as the plain products were measured
    /// at their fastest (docs/worklog.md, 2026-11-27-wgmma-epilogue).
    ///
    /// # Safety
    /// As [`store_tile`]; the whole warp calls it (shuffles).
    #[inline(always)]
    unsafe fn store_tile_quad_plain<O: OutType>(e: &Epilogue, b: u32, row: u32, col_tile: u32, acc: &[f32; 128]) {
        // As in store_tile_quad: the fields in registers across the stores.
        let e = *e;
        let t = thread_idx_x() % 4;
        let pack = |lo: f32, hi: f32| {
            if O::DTYPE == crate::DType::BF16 { f32x2_to_bf16x2(lo, hi) } else { f32x2_to_f16x2(lo, hi) }
        };
        unroll!(H: usize; 0 1 => {
            let r = row + 8 * H as u32;
            unroll!(G: usize; 0 1 2 3 4 5 6 7 => {
                // w[j]: this thread's pair of columns 8 (4 G + j) + 2 t of row r.
                let mut w = [0u32; 4];
                unroll!(J: usize; 0 1 2 3 => {
                    let i = 4 * (4 * G + J) + 2 * H;
                    w[J] = pack(acc[i], acc[i + 1]);
                });
                // Transpose within the quad: afterwards w[j] is thread j's pair of columns
                // 8 (4 G + t) + 2 j.
                unroll!(M: u32; 2 1 => {
                    unroll!(J: usize; 0 1 2 3 => {
                        if J as u32 & M == 0 {
                            let hi = J | M as usize;
                            let keep_low = t & M == 0;
                            let got = shfl_xor_u32(if keep_low { w[hi] } else { w[J] }, M);
                            if keep_low { w[hi] = got } else { w[J] = got }
                        }
                    });
                });
                if r < e.m {
                    let i = b as u64 * e.stride_d + r as u64 * e.ldd + (col_tile + 8 * (4 * G as u32 + t)) as u64;
                    // SAFETY: the row is inside D, the tile's columns too (the caller's), and
                    // rows are 16-byte aligned (QUAD).
                    unsafe { st_global_v4((e.d as *mut u32).add(i as usize / 2), w) };
                }
            });
        });
    }

    /// Whether [`store_tile_quad`] computes the epilogue: no C or row bias.
    #[inline(always)]
    fn is_simple(e: &Epilogue) -> bool {
        e.beta == 0.0 && e.bias_row.is_null()
    }

    /// The kernel. `A_MN`/`B_MN` (0 or 1): A is M-major (`trans_a`), B is N-major (`!trans_b`).
    ///
    /// # Safety
    /// Launched with [`THREADS`] threads, [`SMEM_BYTES`] of dynamic shared memory, and maps and
    /// an epilogue that describe the operands as [`WgmmaArgs`] says.
    #[inline(always)]
    pub unsafe fn gemm<const BF16: bool, O: OutType, const A_MN: u32, const B_MN: u32>(
        maps: *const u64,
        e: Epilogue,
        k: u32,
        batch: u32,
        flags: u32,
        k_chunk: u32,
    ) {
        let tid = thread_idx_x();
        let wg = tid / 128;
        let rank = cluster_rank();
        let paired = flags & PAIR_K != 0;
        let base = (dyn_smem_addr() + 1023) & !1023;
        let a_s = base;
        let b_s = base + STAGES * A_STAGE;
        let bars = b_s + STAGES * B_STAGE;
        let full = |s: u32| bars + 8 * s;
        let empty = |s: u32| bars + 8 * (STAGES + s);
        // SAFETY: the barriers lie in the dynamic shared memory (SMEM_BYTES covers them), are
        // initialised once by one thread, and used only after the block barrier.
        unsafe {
            if tid == 0 {
                for s in 0..STAGES {
                    mbarrier_init(full(s), 1);
                    // A stage holds B rows that both blocks loaded: both blocks' consumers
                    // release it (paired: each block loads its own).
                    mbarrier_init(empty(s), if paired { CONSUMERS } else { CONSUMERS * CLUSTER });
                }
                fence_mbarrier_init();
            }
        }
        // The other block's barriers are initialised before anything signals them.
        cluster_sync();
        let tiles_m = e.m.div_ceil(if paired { BM } else { BM * CLUSTER });
        let tiles_n = e.n.div_ceil(BN);
        let total = tiles_m * tiles_n * batch;
        // This block's batch of D for the walk's batch `b` (paired: its K slice), and the first
        // K and the stages of that batch: all of K, or its slice.
        let slice = move |b: u32| if paired { b * CLUSTER + rank } else { b };
        let k_range = move |b: u32| {
            if flags & SPLIT_K != 0 {
                let k0 = slice(b) * k_chunk;
                (k0, if k0 < k { (k - k0).min(k_chunk).div_ceil(BK) } else { 0 })
            } else {
                (0, k.div_ceil(BK))
            }
        };
        // The first row of tile row `tm`, for this block.
        let row0 = move |tm: u32| if paired { tm * BM } else { (tm * CLUSTER + rank) * BM };

        if wg == 0 {
            // SAFETY: the whole warpgroup; the kernel's `.maxntid`/`.minnctapersm` cap it.
            unsafe { setmaxnreg::<false, 40>() };
            // SAFETY: the host wrote both maps before the launch; each copy lands in its stage
            // of the ring (in both blocks, for B), which the consumers of both blocks released
            // (the empty barrier's phase), and is signalled to that stage's full barrier, which
            // expects exactly the stage's bytes (the copy engine counts the zero-filled
            // elements outside the tensor too).
            if tid == 0 {
                unsafe {
                    let map_a = maps;
                    let map_b = maps.add(16);
                    fence_tensormap(map_a);
                    fence_tensormap(map_b);
                    let (mut s, mut ph) = (0u32, 0u32);
                    let mut t = cluster_idx_x();
                    while t < total {
                        let (b, tm, tn) = tile_coords(t, tiles_m, tiles_n);
                        let za = if flags & A_BATCHED != 0 { b as i32 } else { 0 };
                        let zb = if flags & B_BATCHED != 0 { b as i32 } else { 0 };
                        let (m0, n0) = (row0(tm) as i32, (tn * BN) as i32);
                        let (k0, k_tiles) = k_range(b);
                        for kt in 0..k_tiles {
                            mbarrier_wait_parity(empty(s), ph ^ 1);
                            mbarrier_arrive_expect_tx(full(s), A_STAGE + B_STAGE);
                            let kc = (k0 + kt * BK) as i32;
                            let (a_dst, b_dst) = (a_s + s * A_STAGE, b_s + s * B_STAGE);
                            if A_MN == 1 {
                                // Two boxes of 64 rows of M by 64 of K, each 64 K rows of 128 bytes.
                                tma_load_3d(a_dst, map_a, full(s), m0, kc, za);
                                tma_load_3d(a_dst + A_STAGE / 2, map_a, full(s), m0 + 64, kc, za);
                            } else {
                                tma_load_3d(a_dst, map_a, full(s), kc, m0, za);
                            }
                            if paired {
                                // All of B, for this block alone.
                                if B_MN == 1 {
                                    for j in 0..4 {
                                        let c = (n0 + 64 * j as i32, kc, zb);
                                        tma_load_3d(b_dst + j * (B_STAGE / 4), map_b, full(s), c.0, c.1, c.2);
                                    }
                                } else {
                                    for h in 0..2 {
                                        let n = n0 + (BN / 2 * h) as i32;
                                        tma_load_3d(b_dst + h * (B_STAGE / 2), map_b, full(s), kc, n, zb);
                                    }
                                }
                            } else if B_MN == 1 {
                                // This block's half of B, into both blocks.
                                for j in 2 * rank..2 * rank + 2 {
                                    let c = (n0 + 64 * j as i32, kc, zb);
                                    tma_load_3d_multicast(b_dst + j * (B_STAGE / 4), map_b, full(s), c, 0b11);
                                }
                            } else {
                                let c = (kc, n0 + (BN / 2 * rank) as i32, zb);
                                tma_load_3d_multicast(b_dst + rank * (B_STAGE / 2), map_b, full(s), c, 0b11);
                            }
                            s += 1;
                            if s == STAGES {
                                s = 0;
                                ph ^= 1;
                            }
                        }
                        t += cluster_count_x();
                    }
                }
            }
        } else {
            consume::<BF16, O, A_MN, B_MN>(
                &e,
                (a_s, b_s, bars),
                (tiles_m, tiles_n, total),
                paired,
                (row0, slice, k_range),
            );
        }
        // No block exits while the other may still signal its barriers or write its ring.
        cluster_sync();
    }

    /// The consumer warpgroups' part of [`gemm`]: `(a_s, b_s, bars)` the ring and its barriers,
    /// `tiles` the walk's `(tiles_m, tiles_n, total)`, `paired` as [`PAIR_K`], and for a tile
    /// row or a batch of the walk: this block's first row, its batch of D, and the batch's first
    /// K and stages.
    #[inline(always)]
    fn consume<const BF16: bool, O: OutType, const A_MN: u32, const B_MN: u32>(
        e: &Epilogue,
        (a_s, b_s, bars): (u32, u32, u32),
        (tiles_m, tiles_n, total): (u32, u32, u32),
        paired: bool,
        (row0, slice, k_range): (impl Fn(u32) -> u32, impl Fn(u32) -> u32, impl Fn(u32) -> (u32, u32)),
    ) {
        let full = |s: u32| bars + 8 * s;
        let empty = |s: u32| bars + 8 * (STAGES + s);
        let tid = thread_idx_x();
        let rank = cluster_rank();
        // SAFETY: the whole warpgroup (both consumers run this branch whole).
        unsafe { setmaxnreg::<true, 232>() };
        let cw = tid / 128 - 1;
        let lane = tid % 32;
        let warp = (tid % 128) / 32;
        // One thread of the warpgroup releases its stages locally, one of another warp remotely
        // (unless paired), so that neither waits on the other's arrive.
        let (local, remote) = (tid % 128 == 0, tid % 128 == 32 && !paired);
        let (mut s, mut ph) = (0u32, 0u32);
        let mut t = cluster_idx_x();
        while t < total {
            let (b, tm, tn) = tile_coords(t, tiles_m, tiles_n);
            let k_tiles = k_range(b).1;
            // A warpgroup whose 64 rows lie outside D waits for the stages and releases them,
            // without products (a product of up to 64 rows then takes half the tensor-core time).
            let active = row0(tm) + cw * 64 < e.m;
            // Zeroed, not `[0.0; 128]`: rustc writes a repeat as a loop with a variable index,
            // which keeps the array out of registers.
            // SAFETY: all-zero bits are 0.0.
            let mut acc: [f32; 128] = unsafe { core::mem::zeroed() };
            let mut prev = STAGES;
            // SAFETY: the warpgroup runs these together; a stage is read only after its full
            // barrier's phase completed (the copy's bytes are visible to the tensor cores), and
            // released to the producer only after the products reading it completed.
            unsafe {
                for _ in 0..k_tiles {
                    mbarrier_wait_parity(full(s), ph);
                    if active {
                        wgmma_fence(&mut acc);
                        let (a_st, b_st) = (a_s + s * A_STAGE + cw * (A_STAGE / 2), b_s + s * B_STAGE);
                        unroll!(KK: u32; 0 1 2 3 => {
                            // K-major: the next 16 values of K are 32 bytes on in each swizzled
                            // row; M/N-major: two 8-row K groups (2048 bytes) on.
                            let da = if A_MN == 1 { wgmma_desc(a_st + KK * 2048, 8192, 1024) } else { wgmma_desc(a_st + KK * 32, 16, 1024) };
                            let db = if B_MN == 1 { wgmma_desc(b_st + KK * 2048, 8192, 1024) } else { wgmma_desc(b_st + KK * 32, 16, 1024) };
                            wgmma_m64n256k16::<BF16, A_MN, B_MN>(&mut acc, da, db);
                        });
                        wgmma_commit();
                        wgmma_wait::<1>(&mut acc);
                    }
                    if prev != STAGES {
                        if local {
                            mbarrier_arrive(empty(prev));
                        } else if remote {
                            mbarrier_arrive_cluster(empty(prev), rank ^ 1);
                        }
                    }
                    prev = s;
                    s += 1;
                    if s == STAGES {
                        s = 0;
                        ph ^= 1;
                    }
                }
                wgmma_wait::<0>(&mut acc);
                if prev != STAGES {
                    if local {
                        mbarrier_arrive(empty(prev));
                    } else if remote {
                        mbarrier_arrive_cluster(empty(prev), rank ^ 1);
                    }
                }
            }
            // D's batch: the product's, or with SPLIT_K this block's slice.
            let zb = slice(b);
            let row = row0(tm) + cw * 64 + warp * 16 + lane / 4;
            let col = tn * BN + 2 * (lane % 4);
            let quad = O::DTYPE != crate::DType::F32 && e.flags & QUAD != 0 && (tn + 1) * BN <= e.n;
            // SAFETY: the stores check rows and columns against the epilogue's m and n.
            unsafe {
                if quad && is_plain(e) {
                    store_tile_quad_plain::<O>(e, zb, row, tn * BN, &acc);
                } else if quad && is_simple(e) && e.act <= EPI_SILU {
                    match e.act {
                        EPI_RELU => store_tile_quad::<O, EPI_RELU>(e, zb, row, tn * BN, &acc),
                        EPI_GELU => store_tile_quad::<O, EPI_GELU>(e, zb, row, tn * BN, &acc),
                        EPI_GELU_TANH => store_tile_quad::<O, EPI_GELU_TANH>(e, zb, row, tn * BN, &acc),
                        EPI_SILU => store_tile_quad::<O, EPI_SILU>(e, zb, row, tn * BN, &acc),
                        _ => store_tile_quad::<O, EPI_IDENTITY>(e, zb, row, tn * BN, &acc),
                    }
                } else if is_plain(e) {
                    unroll!(J: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 => {
                        store_pair_plain::<O>(e, zb, row, col + 8 * J as u32, [acc[4 * J], acc[4 * J + 1]]);
                        store_pair_plain::<O>(e, zb, row + 8, col + 8 * J as u32, [acc[4 * J + 2], acc[4 * J + 3]]);
                    });
                } else {
                    // A copy, so that only it (not the accumulators) lives in local memory.
                    // SAFETY: all-zero bits are 0.0.
                    let mut out: [f32; 128] = core::mem::zeroed();
                    unroll!(J: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 => {
                        out[4 * J] = acc[4 * J];
                        out[4 * J + 1] = acc[4 * J + 1];
                        out[4 * J + 2] = acc[4 * J + 2];
                        out[4 * J + 3] = acc[4 * J + 3];
                    });
                    store_tile::<O>(e, zb, row, col, &out);
                }
            }
            t += cluster_count_x();
        }
    }
}

/// Declares the kernel for each (transposes, input type, output type): `gemm_wgmma_<ab>_<in>_<out>`,
/// `<ab>` the transposes of A and B (`n` or `t`), and [`wgmma_kernel`] to pick one.
macro_rules! wgmma_kernels {
    ($( $ta:literal $tb:literal $ab:ident: $( $name:ident $bf16:literal $out:ty ),* ; )*) => {
        $( $(
            #[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_90a"))]
            crate::kernel!($name: WgmmaArgs = |maps, e, k, batch, flags, k_chunk|
                device::gemm::<$bf16, $out, { $ta as u32 }, { !$tb as u32 }>(maps, e, k, batch, flags, k_chunk));
        )* )*

        /// The kernel for transposes `trans_a`, `trans_b`, bf16 (`bf16`) or f16 inputs, and
        /// output type `out` (f32, bf16 or f16; `None` for others).
        #[cfg(not(target_arch = "nvptx64"))]
        pub fn wgmma_kernel(trans_a: bool, trans_b: bool, bf16: bool, out: crate::DType) -> Option<crate::kernel::Kernel<WgmmaArgs>> {
            $( $(
                if (trans_a, trans_b, bf16, out) == ($ta, $tb, $bf16, <$out as crate::dtype::Elem>::DTYPE) {
                    return Some($name);
                }
            )* )*
            None
        }

        /// Every kernel of the family.
        #[cfg(not(target_arch = "nvptx64"))]
        pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
            [$( $( $name.entry(), )* )* store_tensor_maps.entry()].into_iter()
        }
    };
}

wgmma_kernels! {
    false false nn: gemm_wgmma_nn_bf16_f32 true f32, gemm_wgmma_nn_bf16_bf16 true crate::BF16, gemm_wgmma_nn_bf16_f16 true crate::F16,
        gemm_wgmma_nn_f16_f32 false f32, gemm_wgmma_nn_f16_bf16 false crate::BF16, gemm_wgmma_nn_f16_f16 false crate::F16;
    false true nt: gemm_wgmma_nt_bf16_f32 true f32, gemm_wgmma_nt_bf16_bf16 true crate::BF16, gemm_wgmma_nt_bf16_f16 true crate::F16,
        gemm_wgmma_nt_f16_f32 false f32, gemm_wgmma_nt_f16_bf16 false crate::BF16, gemm_wgmma_nt_f16_f16 false crate::F16;
    true false tn: gemm_wgmma_tn_bf16_f32 true f32, gemm_wgmma_tn_bf16_bf16 true crate::BF16, gemm_wgmma_tn_bf16_f16 true crate::F16,
        gemm_wgmma_tn_f16_f32 false f32, gemm_wgmma_tn_f16_bf16 false crate::BF16, gemm_wgmma_tn_f16_f16 false crate::F16;
    true true tt: gemm_wgmma_tt_bf16_f32 true f32, gemm_wgmma_tt_bf16_bf16 true crate::BF16, gemm_wgmma_tt_bf16_f16 true crate::F16,
        gemm_wgmma_tt_f16_f32 false f32, gemm_wgmma_tt_f16_bf16 false crate::BF16, gemm_wgmma_tt_f16_f16 false crate::F16;
}
