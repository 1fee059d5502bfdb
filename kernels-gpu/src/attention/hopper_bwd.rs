//! Attention backward on Hopper's warpgroup tensor cores (sm_90a): the results of
//! [`super::backward`]'s kernels (its `prep` writes the same workspaces first; deterministic, no
//! atomics) with `wgmma` and TMA, for padded head dims 64 and 128.
//!
//! # The design
//! Two kernels of one structure, FlashAttention-3's producer and consumers:
//! - A block of 384 threads owns [`BM`] = 128 resident rows of one (batch, head): query rows for
//!   dQ, keys for dK and dV. Warpgroup 0's one thread loads the resident pair of tiles once (Q and
//!   dO, or K and V) and streams the other pair (K and V, or Q and dO) [`BN`] = 64 rows a stage
//!   through a ring of [`STAGES`] stages with the copy engine (4-D tensor maps of boxes of 64 x
//!   64, 128-byte swizzle), each stage guarded by a "full" and an "empty" mbarrier.
//! - Warpgroups 1 and 2 own 64 resident rows each. Per stage, two products with both operands in
//!   shared memory (`wgmma.m64n64k16`, K-major): `X U^T` and `Y W^T`; on their accumulators the
//!   weights `P = 2^(S scale log2(e) - lse2)` (0 where masked) and `dS = P (dP - delta)`; then
//!   the products that accumulate, with A from registers (the accumulator layout of the first
//!   two is the A-fragment layout `wgmma` takes) and B the stage's tile read N-major:
//!   - dQ: `S = Q K^T`, `dP = dO V^T` (`lse2`, `delta` by row), `dQ += dS K`;
//!   - dK/dV: `S^T = K Q^T`, `dP^T = V dO^T` (by column), `dV += P^T dO`, `dK += dS^T Q`, over
//!     the query blocks of every query head of the group (GQA).
//!
//!   dQ and dK are scaled once at the end. The two consumers run independently: the warp
//!   schedulers interleave one's exponentials with the other's products.
//! - Out-of-range rows and head-dim columns are zeros from the copy engine; streamed rows beyond
//!   the sequence are masked like any unseen key or query.

/// Resident rows per block: two consumer warpgroups of 64.
pub const BM: u32 = 128;
/// Streamed rows per stage.
pub const BN: u32 = 64;
/// Stages of the ring.
pub const STAGES: u32 = 3;
/// Threads per block: a producer warpgroup and two consumers.
pub const THREADS: u32 = 384;

/// Bytes of a `rows x 64` box of 16-bit values: 128-byte rows.
const fn panel(rows: u32) -> u32 {
    rows * 128
}

/// Bytes of the resident `BM x dp` tile of one tensor.
const fn resident_bytes(dp: u32) -> u32 {
    (dp / 64) * panel(BM)
}

/// Bytes of one streamed `BN x dp` tile.
const fn tile_bytes(dp: u32) -> u32 {
    (dp / 64) * panel(BN)
}

/// Bytes of a stage's statistics: `lse2` and `delta` of its [`BN`] queries (dK/dV).
const STATS: u32 = 2 * 4 * BN;

/// Dynamic shared memory of a block for the padded head dim `dp` (64 or 128): up to 1 KiB to
/// align to the 1024 bytes of the swizzle, the two resident tiles, the ring of tile pairs, each
/// stage's statistics, the mbarriers (the resident tiles'; full and empty for each stage).
pub const fn smem_bytes(dp: u32) -> u32 {
    1024 + 2 * resident_bytes(dp) + STAGES * (2 * tile_bytes(dp) + STATS) + 8 * (1 + 2 * STAGES)
}

/// Everything one launch needs (one kernel parameter, `#[repr(C)]`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HopperBwdParams {
    /// The tensor maps of Q, K, V and dO, in this order (128 bytes each, in global memory,
    /// 64-byte aligned): 4-D, `(d, row, head, batch)` innermost first, boxes of 64 x [`BN`].
    pub maps: *const u64,
    /// dQ, Q's shape, through `q_stride` (batch 0's address); written by the dQ kernel.
    pub dq: *mut u16,
    /// dK, K's shape, through `kv_stride` (batch 0's address); written by the dK/dV kernel.
    pub dk: *mut u16,
    /// dV, K's shape; written by the dK/dV kernel.
    pub dv: *mut u16,
    /// `prep`'s `lse * log2(e)`, `[batch][heads_q][stat_pitch]` f32 (batch 0's address).
    pub lse2: *const f32,
    /// `prep`'s `delta`, `lse2`'s shape.
    pub delta: *const f32,
    /// Element strides of Q, dO and dQ between batches, heads and rows.
    pub q_stride: [u64; 3],
    /// Element strides of K, V, dK and dV.
    pub kv_stride: [u64; 3],
    /// Key `j` is seen by query row `i` iff `i + lo <= j <= i + hi` (and `j < seq_k`).
    pub lo: i64,
    /// See `lo`.
    pub hi: i64,
    /// Query rows (at least 1).
    pub seq_q: u32,
    /// Keys (at least 1).
    pub seq_k: u32,
    /// The head dim (a multiple of 8, at most the kernel's padded dim).
    pub d: u32,
    /// Query heads.
    pub heads_q: u32,
    /// Query heads per key/value head.
    pub group: u32,
    /// Resident blocks per head: `ceil(seq_q / BM)` (dQ) or `ceil(seq_k / BM)` (dK/dV). The
    /// grid is `blocks * heads * batches` with the query heads (dQ) or the key/value heads.
    pub blocks: u32,
    /// Values per (batch, head) of the workspaces: `seq_q` rounded up to a multiple of 64.
    pub stat_pitch: u32,
    /// The scale of the scores.
    pub scale: f32,
    /// `scale * log2(e)`.
    pub scale_log2: f32,
    /// The first batch of this launch.
    pub z0: u32,
}

/// A kernel parameter: a plain `#[repr(C)]` value of pointers and integers.
impl crate::kernel::Param for HopperBwdParams {}

/// The Hopper backward kernels' parameters.
pub type HopperBwdArgs = (HopperBwdParams,);

/// The Hopper backward kernels for `dtype` (bf16 or f16) and padded head dim `dp` (64 or 128):
/// `(dq, dkdv)`; `None` otherwise.
#[cfg(not(target_arch = "nvptx64"))]
pub const fn hopper_bwd_kernels(
    dtype: crate::DType,
    dp: u32,
) -> Option<(crate::kernel::Kernel<HopperBwdArgs>, crate::kernel::Kernel<HopperBwdArgs>)> {
    match (dtype, dp) {
        (crate::DType::BF16, 64) => Some((attention_bwd_wgmma_dq_d64_bf16, attention_bwd_wgmma_dkdv_d64_bf16)),
        (crate::DType::BF16, 128) => Some((attention_bwd_wgmma_dq_d128_bf16, attention_bwd_wgmma_dkdv_d128_bf16)),
        (crate::DType::F16, 64) => Some((attention_bwd_wgmma_dq_d64_f16, attention_bwd_wgmma_dkdv_d64_f16)),
        (crate::DType::F16, 128) => Some((attention_bwd_wgmma_dq_d128_f16, attention_bwd_wgmma_dkdv_d128_f16)),
        _ => None,
    }
}

/// Every kernel of this file (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
    [
        attention_bwd_wgmma_dq_d64_bf16,
        attention_bwd_wgmma_dq_d128_bf16,
        attention_bwd_wgmma_dq_d64_f16,
        attention_bwd_wgmma_dq_d128_f16,
        attention_bwd_wgmma_dkdv_d64_bf16,
        attention_bwd_wgmma_dkdv_d128_bf16,
        attention_bwd_wgmma_dkdv_d64_f16,
        attention_bwd_wgmma_dkdv_d128_f16,
    ]
    .into_iter()
    .map(|k| k.entry())
}

#[cfg(all(target_arch = "nvptx64", target_feature = "sm_90a"))]
mod device {
    use super::super::hopper::device::Dim;
    use super::super::{AttnType, block_range, key_range};
    use super::*;
    use crate::prim::*;

    /// Consumer threads: two warpgroups. Each releases a stage itself: dK/dV's read the stage's
    /// statistics with plain loads, which only their own arrive orders before the next copy.
    const CONSUMERS: u32 = 2 * 128;

    /// The shared-memory layout of a block: the resident tiles X and Y, the ring of streamed
    /// pairs (U, W), the barriers (the resident tiles'; then full, then empty, per stage).
    #[derive(Clone, Copy)]
    struct Smem {
        x: u32,
        y: u32,
        ring: u32,
        bars: u32,
        dp: u32,
    }

    impl Smem {
        fn new(dp: u32) -> Smem {
            let x = (dyn_smem_addr() + 1023) & !1023;
            let y = x + resident_bytes(dp);
            let ring = y + resident_bytes(dp);
            Smem { x, y, ring, bars: ring + STAGES * (2 * tile_bytes(dp) + STATS), dp }
        }
        fn resident_bar(self) -> u32 {
            self.bars
        }
        fn full(self, s: u32) -> u32 {
            self.bars + 8 * (1 + s)
        }
        fn empty(self, s: u32) -> u32 {
            self.bars + 8 * (1 + STAGES + s)
        }
        /// Stage `s`'s U tile (K for dQ, Q for dK/dV).
        fn u(self, s: u32) -> u32 {
            self.ring + 2 * s * tile_bytes(self.dp)
        }
        /// Stage `s`'s W tile (V for dQ, dO for dK/dV).
        fn w(self, s: u32) -> u32 {
            self.u(s) + tile_bytes(self.dp)
        }
        /// Stage `s`'s `lse2` (64 f32), then its `delta` (dK/dV only).
        fn stats(self, s: u32) -> u32 {
            self.ring + STAGES * 2 * tile_bytes(self.dp) + s * STATS
        }
    }

    /// The band of the resident rows against the streamed ones, `(lo, hi, rows, columns)`: row
    /// `r` sees column `c` iff `r + lo <= c <= r + hi` and `c < columns`. For dK/dV the rows are
    /// keys and the columns queries: key `j` is seen by `i` iff `j - hi <= i <= j - lo`.
    #[inline(always)]
    fn band<const DKDV: bool>(p: &HopperBwdParams) -> (i64, i64, u32, u32) {
        if DKDV { (-p.hi, -p.lo, p.seq_k, p.seq_q) } else { (p.lo, p.hi, p.seq_q, p.seq_k) }
    }

    /// What a block works on: the batch, the resident rows' head and first row, the streamed
    /// blocks they see per head (from `first`, `n` of them) and the stages in all.
    #[derive(Clone, Copy)]
    struct Work {
        b: u32,
        h: u32,
        r0: u32,
        first: u32,
        n: u32,
        steps: u32,
    }

    /// This block's [`Work`]. dQ takes the last query block of a head first (under a causal mask
    /// the heaviest), dK/dV the first key block.
    #[inline(always)]
    fn work<const DKDV: bool>(p: &HopperBwdParams) -> Work {
        let group = p.group.max(1);
        // At least 1, so that the divisions have no panic path (the host never launches less).
        let blocks = p.blocks.max(1);
        let heads = if DKDV { p.heads_q / group } else { p.heads_q }.max(1);
        let bid = block_idx_x();
        let blk = if DKDV { bid % blocks } else { blocks - 1 - bid % blocks };
        let zh = bid / blocks;
        let (h, b) = (zh % heads, zh / heads + p.z0);
        let r0 = blk * BM;
        let (lo, hi, rows, cols) = band::<DKDV>(p);
        let last = (r0 + BM - 1).min(rows.saturating_sub(1));
        let (c0, c1) = block_range(r0, last, lo, hi, cols, BN);
        let n = c1 - c0;
        Work { b, h, r0, first: c0, n, steps: if DKDV { n * group } else { n } }
    }

    /// The head and the streamed block of stage number `j`: dQ walks its key/value head's key
    /// blocks; dK/dV each query head of the group in turn.
    #[inline(always)]
    fn streamed<const DKDV: bool>(p: &HopperBwdParams, w: &Work, j: u32) -> (u32, u32) {
        let group = p.group.max(1);
        if DKDV {
            let n = w.n.max(1);
            (w.h * group + j / n, w.first + j % n)
        } else {
            (w.h / group, w.first + j)
        }
    }

    /// The backward kernel of one block: dQ of 128 query rows (`DKDV` false) or dK and dV of 128
    /// keys of one (batch, head).
    ///
    /// # Safety
    /// Launched with [`THREADS`] threads, [`smem_bytes`]`(D::DP)` of dynamic shared memory, after
    /// `prep` wrote the workspaces, with parameters whose maps and pointers describe the tensors
    /// as [`HopperBwdParams`] says.
    #[inline(always)]
    pub unsafe fn bwd<I: AttnType, D: Dim, const DKDV: bool>(p: HopperBwdParams) {
        let tid = thread_idx_x();
        let sm = Smem::new(D::DP);
        let w = work::<DKDV>(&p);
        // SAFETY: the barriers lie in the dynamic shared memory (smem_bytes covers them), are
        // initialised once by one thread, and used only after the block barrier.
        unsafe {
            if tid == 0 {
                mbarrier_init(sm.resident_bar(), 1);
                for s in 0..STAGES {
                    mbarrier_init(sm.full(s), 1);
                    mbarrier_init(sm.empty(s), CONSUMERS);
                }
                fence_mbarrier_init();
            }
        }
        sync_threads();
        if tid / 128 == 0 {
            // SAFETY: the whole warpgroup; the kernel's `.maxntid`/`.minnctapersm` cap it. 24 +
            // 2 x 240 is the 3 x 168 the block starts with; dK/dV of head dim 128 spills at 232.
            unsafe { setmaxnreg::<false, 24>() };
            if tid == 0 {
                // SAFETY: the host wrote the maps before the launch; each copy lands in the
                // resident tiles or in a stage both consumers released (the empty barrier's
                // phase) and is signalled to a barrier expecting exactly its bytes (the copy
                // engine counts the zero-filled elements outside the tensor too).
                unsafe { produce::<DKDV>(&p, sm, &w) };
            }
        } else {
            // SAFETY: the consumer warpgroups run this whole; the kernel's contract.
            unsafe { consume::<I, D, DKDV>(&p, sm, &w) };
        }
    }

    /// The producer thread: the resident tiles, then each stage's pair.
    ///
    /// # Safety
    /// As [`bwd`]'s, for its one thread.
    #[inline(always)]
    unsafe fn produce<const DKDV: bool>(p: &HopperBwdParams, sm: Smem, w: &Work) {
        let dp = sm.dp;
        // SAFETY: per the contract.
        unsafe {
            let maps = [p.maps, p.maps.add(16), p.maps.add(32), p.maps.add(48)];
            for m in maps {
                fence_tensormap(m);
            }
            // Q, K, V, dO: resident X, Y and streamed U, W.
            let (mx, my, mu, mw) =
                if DKDV { (maps[1], maps[2], maps[0], maps[3]) } else { (maps[0], maps[3], maps[1], maps[2]) };
            mbarrier_arrive_expect_tx(sm.resident_bar(), 2 * resident_bytes(dp));
            for (map, dst) in [(mx, sm.x), (my, sm.y)] {
                for c in 0..dp / 64 {
                    for half in 0..BM / BN {
                        let at = ((64 * c) as i32, (w.r0 + BN * half) as i32, w.h as i32, w.b as i32);
                        // Two boxes of 64 rows, 8 KiB apart: the layout of one box of 128.
                        tma_load_4d(dst + c * panel(BM) + half * panel(BN), map, sm.resident_bar(), at);
                    }
                }
            }
            for j in 0..w.steps {
                let (s, ph) = (j % STAGES, (j / STAGES) & 1);
                let (head, blk) = streamed::<DKDV>(p, w, j);
                mbarrier_wait_parity(sm.empty(s), ph ^ 1);
                mbarrier_arrive_expect_tx(sm.full(s), 2 * tile_bytes(dp) + if DKDV { STATS } else { 0 });
                for c in 0..dp / 64 {
                    let at = ((64 * c) as i32, (blk * BN) as i32, head as i32, w.b as i32);
                    tma_load_4d(sm.u(s) + c * panel(BN), mu, sm.full(s), at);
                    tma_load_4d(sm.w(s) + c * panel(BN), mw, sm.full(s), at);
                }
                if DKDV {
                    // The stage's queries' statistics: 64 values of each workspace, 256-byte
                    // aligned (stat_pitch and the block a multiple of 64), inside it (prep pads
                    // every head to stat_pitch).
                    let at = ((w.b as u64 * p.heads_q as u64 + head as u64) * p.stat_pitch as u64 + (blk * BN) as u64)
                        as usize;
                    bulk_load(sm.stats(s), p.lse2.add(at) as *const u8, STATS / 2, sm.full(s));
                    bulk_load(sm.stats(s) + STATS / 2, p.delta.add(at) as *const u8, STATS / 2, sm.full(s));
                }
            }
        }
    }

    /// `d = X U^T` for this warpgroup's 64 resident rows (64 rows into X's panels) and the
    /// streamed tile at `tile`, issued and committed: 16 columns of the head dim a step.
    ///
    /// # Safety
    /// The whole consumer warpgroup; both tiles complete (their barriers waited for).
    #[inline(always)]
    unsafe fn issue_ss<const BF16: bool>(d: &mut [f32; 32], res: u32, cw: u32, tile: u32, dp: u32) {
        // SAFETY: per the contract.
        unsafe {
            wgmma_fence(d);
            unroll!(KK: u32; 0 1 2 3 4 5 6 7 => {
                if KK < dp / 16 {
                    let da = wgmma_desc(res + (KK / 4) * panel(BM) + cw * panel(64) + (KK % 4) * 32, 16, 1024);
                    let db = wgmma_desc(tile + (KK / 4) * panel(BN) + (KK % 4) * 32, 16, 1024);
                    // The first step overwrites the accumulators (no zeroing pass).
                    if KK == 0 {
                        wgmma_m64n64k16_ss::<BF16, false>(d, da, db);
                    } else {
                        wgmma_m64n64k16_ss::<BF16, true>(d, da, db);
                    }
                }
            });
            wgmma_commit();
        }
    }

    /// `acc += A T` for A the fragments `a` (64 resident rows by the tile's 64 streamed rows)
    /// and T the streamed tile at `tile` read N-major, issued and committed: 16 streamed rows
    /// (2048 bytes) a step; the tile's 64-column panels lie `panel(BN)` apart.
    ///
    /// # Safety
    /// The whole consumer warpgroup; the tile complete; `a` and `acc` untouched until the wait.
    #[inline(always)]
    unsafe fn issue_rs<const BF16: bool, D: Dim>(acc: &mut D::Acc, a: &[[u32; 4]; 4], tile: u32) {
        // SAFETY: per the contract.
        unsafe {
            wgmma_fence(acc);
            unroll!(KK: u32; 0 1 2 3 => {
                D::pv::<BF16>(acc, a[KK as usize], wgmma_desc(tile + KK * 2048, panel(BN), 1024));
            });
            wgmma_commit();
        }
    }

    /// 32 accumulators (64 x 64) rounded to the dtype as the A fragments of 16 streamed rows
    /// each, passed through `opaque` so that their computation stays above the product's fence.
    #[inline(always)]
    fn fragments<I: AttnType>(x: &[f32; 32]) -> [[u32; 4]; 4] {
        let mut a = [[0u32; 4]; 4];
        unroll!(KK: usize; 0 1 2 3 => {
            let f = |i: usize| I::pack2(x[8 * KK + i], x[8 * KK + i + 1]);
            a[KK] = opaque([f(0), f(2), f(4), f(6)]);
        });
        a
    }

    /// Issues one of the resident pair's products for either dtype.
    ///
    /// # Safety
    /// As [`issue_ss`].
    #[inline(always)]
    unsafe fn ss(bf16: bool, d: &mut [f32; 32], res: u32, cw: u32, tile: u32, dp: u32) {
        // SAFETY: the caller's.
        unsafe { if bf16 { issue_ss::<true>(d, res, cw, tile, dp) } else { issue_ss::<false>(d, res, cw, tile, dp) } }
    }

    /// Issues one accumulating product for either dtype.
    ///
    /// # Safety
    /// As [`issue_rs`].
    #[inline(always)]
    unsafe fn rs<D: Dim>(bf16: bool, acc: &mut D::Acc, a: &[[u32; 4]; 4], tile: u32) {
        // SAFETY: the caller's.
        unsafe { if bf16 { issue_rs::<true, D>(acc, a, tile) } else { issue_rs::<false, D>(acc, a, tile) } }
    }

    /// A consumer warpgroup: its 64 resident rows against every streamed stage, then its
    /// gradients. The two products of a stage that read only shared memory are issued together;
    /// for dK/dV, `dV += P^T dO` runs while `dS^T` is computed.
    ///
    /// # Safety
    /// As [`bwd`]'s, for a whole consumer warpgroup.
    #[inline(always)]
    unsafe fn consume<I: AttnType, D: Dim, const DKDV: bool>(p: &HopperBwdParams, sm: Smem, w: &Work) {
        // SAFETY: the whole warpgroup.
        unsafe { setmaxnreg::<true, 240>() };
        let bf16 = I::DTYPE == crate::DType::BF16;
        let tid = thread_idx_x();
        let cw = tid / 128 - 1;
        let (warp, lane) = ((tid % 128) / 32, tid % 32);
        let (g, t) = (lane / 4, lane % 4);
        let (lo, hi, nrows, ncols) = band::<DKDV>(p);
        let row0 = w.r0 + 64 * cw;
        let rows = [row0 + 16 * warp + g, row0 + 16 * warp + g + 8];
        let seen = [key_range(rows[0], lo, hi, ncols), key_range(rows[1], lo, hi, ncols)];
        // The columns all rows of this warpgroup see (blocks inside need no mask).
        let wg_last = (row0 + 63).min(nrows.saturating_sub(1));
        let all = (key_range(wg_last, lo, hi, ncols).0, key_range(row0, lo, hi, ncols).1);
        let sl2 = p.scale_log2;
        let stats = |h: u32| (w.b as u64 * p.heads_q as u64 + h as u64) * p.stat_pitch as u64;

        // dQ's per-row statistics (rows past seq_q weigh nothing).
        let (mut row_l2, mut row_dl) = ([f32::INFINITY; 2], [0.0f32; 2]);
        if !DKDV {
            unroll!(R: usize; 0 1 => {
                if rows[R] < p.seq_q {
                    let at = (stats(w.h) + rows[R] as u64) as usize;
                    // SAFETY: row < seq_q <= stat_pitch: inside the workspaces, written by `prep`.
                    unsafe {
                        row_l2[R] = *p.lse2.add(at);
                        row_dl[R] = *p.delta.add(at);
                    }
                }
            });
        }

        let mut acc = D::zero();
        let mut dv = D::zero();
        // SAFETY: the resident tiles and a stage are read only after their barrier's phase
        // completed (the copies' bytes are visible to the tensor cores); a stage is released only
        // after every product reading it completed; fragments and accumulators are left alone
        // while a product reading them is in flight.
        unsafe {
            mbarrier_wait_parity(sm.resident_bar(), 0);
            for j in 0..w.steps {
                let (s, ph) = (j % STAGES, (j / STAGES) & 1);
                let (_, blk) = streamed::<DKDV>(p, w, j);
                let c0 = blk * BN;
                mbarrier_wait_parity(sm.full(s), ph);
                // All-zero bits are 0.0 (a repeat expression would be a loop).
                let mut sc: [f32; 32] = core::mem::zeroed();
                let mut dp: [f32; 32] = core::mem::zeroed();
                ss(bf16, &mut sc, sm.x, cw, sm.u(s), sm.dp);
                ss(bf16, &mut dp, sm.y, cw, sm.w(s), sm.dp);

                wgmma_wait::<1>(&mut sc);
                let masked = c0 < all.0 || c0 + BN > all.1;
                unroll!(J: usize; 0 1 2 3 4 5 6 7 => {
                    unroll!(E: usize; 0 1 2 3 => {
                        let (r, c) = (E / 2, E % 2);
                        // dK/dV: the stage's statistics of queries c0 + 8 J + 2 t.. (+inf past
                        // seq_q, from `prep`'s padding).
                        let l2 = if DKDV {
                            f32::from_bits(ld_shared_v2_b32(sm.stats(s) + 4 * (8 * J as u32 + 2 * t))[c])
                        } else {
                            row_l2[r]
                        };
                        let col = c0 + 8 * J as u32 + 2 * t + c as u32;
                        let hidden = masked && !(seen[r].0 <= col && col < seen[r].1);
                        let pv = ex2_approx_ftz(crate::math::fma(sc[4 * J + E], sl2, -l2));
                        sc[4 * J + E] = select_f32(hidden, 0.0, pv);
                    });
                });
                let pa = fragments::<I>(&sc);
                if DKDV {
                    rs::<D>(bf16, &mut dv, &pa, sm.w(s));
                    wgmma_wait::<1>(&mut dp);
                } else {
                    wgmma_wait::<0>(&mut dp);
                }
                unroll!(J: usize; 0 1 2 3 4 5 6 7 => {
                    unroll!(E: usize; 0 1 2 3 => {
                        let dl = if DKDV {
                            f32::from_bits(ld_shared_v2_b32(sm.stats(s) + STATS / 2 + 4 * (8 * J as u32 + 2 * t))[E % 2])
                        } else {
                            row_dl[E / 2]
                        };
                        dp[4 * J + E] = sc[4 * J + E] * (dp[4 * J + E] - dl);
                    });
                });
                let da = fragments::<I>(&dp);
                rs::<D>(bf16, &mut acc, &da, sm.u(s));
                wgmma_wait::<0>(&mut acc);
                if DKDV {
                    wgmma_wait::<0>(&mut dv);
                }
                mbarrier_arrive(sm.empty(s));
            }
        }

        let (ptr, st) = if DKDV { (p.dk, p.kv_stride) } else { (p.dq, p.q_stride) };
        let base = w.b as u64 * st[0] + w.h as u64 * st[1];
        let scale = p.scale;
        let (ga, gv) = (acc.as_ref(), dv.as_ref());
        unroll!(R: usize; 0 1 => {
            let row = rows[R];
            if row < nrows {
                let at = base + row as u64 * st[2];
                unroll!(J: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
                    if (J as u32) < D::DP / 8 && (J as u32) * 8 < p.d {
                        let i = 4 * J + 2 * R;
                        let col = J as u64 * 8 + 2 * t as u64;
                        // SAFETY: row < its sequence and col + 1 < d: inside dQ, or dK and dV
                        // (one shape and strides); 4-byte aligned (even column, strides
                        // multiples of 8, bases 16-byte aligned).
                        unsafe {
                            *(ptr.add((at + col) as usize) as *mut u32) = I::pack2(ga[i] * scale, ga[i + 1] * scale);
                            if DKDV {
                                *(p.dv.add((at + col) as usize) as *mut u32) = I::pack2(gv[i], gv[i + 1]);
                            }
                        }
                    }
                });
            }
        });
    }

    /// The dQ kernel.
    ///
    /// # Safety
    /// As [`bwd`].
    #[inline(always)]
    pub unsafe fn dq<I: AttnType, D: Dim>(p: HopperBwdParams) {
        // SAFETY: the caller's.
        unsafe { bwd::<I, D, false>(p) }
    }

    /// The dK/dV kernel.
    ///
    /// # Safety
    /// As [`bwd`].
    #[inline(always)]
    pub unsafe fn dkdv<I: AttnType, D: Dim>(p: HopperBwdParams) {
        // SAFETY: the caller's.
        unsafe { bwd::<I, D, true>(p) }
    }
}

macro_rules! hopper_bwd_kernels {
    ($($name:ident: $which:ident, $ty:ty, $dim:ident;)*) => {
        $(
            #[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_90a"))]
            crate::kernel!($name: HopperBwdArgs = |p| device::$which::<$ty, super::hopper::device::$dim>(p));
        )*
    };
}

hopper_bwd_kernels! {
    attention_bwd_wgmma_dq_d64_bf16: dq, crate::dtype::BF16, D64;
    attention_bwd_wgmma_dq_d128_bf16: dq, crate::dtype::BF16, D128;
    attention_bwd_wgmma_dq_d64_f16: dq, crate::dtype::F16, D64;
    attention_bwd_wgmma_dq_d128_f16: dq, crate::dtype::F16, D128;
    attention_bwd_wgmma_dkdv_d64_bf16: dkdv, crate::dtype::BF16, D64;
    attention_bwd_wgmma_dkdv_d128_bf16: dkdv, crate::dtype::BF16, D128;
    attention_bwd_wgmma_dkdv_d64_f16: dkdv, crate::dtype::F16, D64;
    attention_bwd_wgmma_dkdv_d128_f16: dkdv, crate::dtype::F16, D128;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_and_params() {
        // 1 KiB of alignment, the resident pair, three stages of pairs and statistics, seven
        // barriers: within an H100's 227 KiB.
        assert_eq!(smem_bytes(64), 1024 + 2 * 16384 + 3 * (2 * 8192 + 512) + 56);
        assert_eq!(smem_bytes(128), 1024 + 2 * 32768 + 3 * (2 * 16384 + 512) + 56);
        assert!(smem_bytes(128) <= 227 * 1024);
        assert_eq!(core::mem::size_of::<HopperBwdParams>(), 152);
    }
}
