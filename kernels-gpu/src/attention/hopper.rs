//! Attention forward on Hopper's warpgroup tensor cores (sm_90a), FlashAttention-3 style: the
//! same function as the `mma.sync` kernels of [`super`] (masks, GQA, both layouts, `lse`, the
//! rows that see no key), for padded head dims 64 and 128.
//!
//! # The design
//! - A block of 384 threads takes [`BM`] = 128 query rows of one (batch, head). Warpgroup 0 is
//!   the producer: one thread loads Q once and streams the key blocks ([`BN`] = 128 keys) into
//!   two rings of [`STAGES`] shared-memory stages, one of K tiles and one of V tiles, with the
//!   copy engine (TMA, 4-D tensor maps over `[batch][head][row][d]` in either layout, 128-byte
//!   swizzle, 64 columns of the head dim a box), each stage guarded by a "full" and an "empty"
//!   mbarrier. It hands its registers to the consumers (`setmaxnreg`).
//! - Warpgroups 1 and 2 are the consumers, 64 query rows each. Per key block: `S = Q K^T` by
//!   `wgmma.m64n128k16` with both operands in shared memory (K-major: Q's and K's rows hold
//!   their head dim contiguously), the mask and the online softmax on the 64 f32 accumulators of
//!   S as in [`super`], P rounded to the input dtype in registers (the accumulator layout of S is
//!   the A-fragment layout `wgmma` takes from registers), then `O += P V` by
//!   `wgmma.m64n{64,128}k16` with A from registers and V read N-major (transposed by the tensor
//!   cores, as stored). The softmax overlaps the products within a warpgroup (the next block's
//!   scores and the previous block's `P V` are in flight during it) and between the two (they
//!   take turns at the tensor cores): see `consume`.
//! - Out-of-range rows, keys and head-dim columns are zeros from the copy engine; keys beyond
//!   `Sk` are masked like any other unseen key.

/// Query rows per block: two consumer warpgroups of 64.
pub const BM: u32 = 128;
/// Keys per stage.
pub const BN: u32 = 128;
/// Stages of the key/value ring.
pub const STAGES: u32 = 2;
/// Threads per block: a producer warpgroup and two consumers.
pub const THREADS: u32 = 384;

/// Bytes of a `rows x 64` box of 16-bit values: 128-byte rows.
const fn panel(rows: u32) -> u32 {
    rows * 128
}

/// Dynamic shared memory of a block for the padded head dim `dp` (64 or 128): up to 1 KiB to
/// align to the 1024 bytes of the swizzle, Q, the rings of K and V, the mbarriers.
pub const fn smem_bytes(dp: u32) -> u32 {
    1024 + (dp / 64) * panel(BM) + STAGES * 2 * (dp / 64) * panel(BN) + 8 * (1 + 4 * STAGES)
}

/// Everything one launch needs (one kernel parameter, `#[repr(C)]`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HopperParams {
    /// The tensor maps of Q, K and V (128 bytes each, in global memory, 64-byte aligned): 4-D,
    /// `(d, row, head, batch)` innermost first, boxes of 64 columns by [`BM`] (Q) or [`BN`] rows.
    pub maps: *const u64,
    /// O, `[batch][head][row][d]` through `o_stride` (batch 0's address), written.
    pub o: *mut u16,
    /// `[batch][heads_q][seq_q]` f32, contiguous (batch 0's address), written.
    pub lse: *mut f32,
    /// Element strides of O between batches, heads and rows.
    pub o_stride: [u64; 3],
    /// Key `j` is seen by query row `i` iff `i + lo <= j <= i + hi` (and `j < seq_k`).
    pub lo: i64,
    /// See `lo`.
    pub hi: i64,
    /// Query rows.
    pub seq_q: u32,
    /// Keys (at least 1: the host sends `Sk = 0` to the general kernels).
    pub seq_k: u32,
    /// The head dim (a multiple of 8, at most the kernel's padded dim).
    pub d: u32,
    /// Query heads.
    pub heads_q: u32,
    /// Query heads per key/value head.
    pub group: u32,
    /// Query blocks per head: `ceil(seq_q / BM)`. The grid is `q_blocks * heads_q * batches`.
    pub q_blocks: u32,
    /// `scale * log2(e)`.
    pub scale_log2: f32,
    /// The first batch of this launch.
    pub z0: u32,
}

/// A kernel parameter: a plain `#[repr(C)]` value of pointers and integers.
impl crate::kernel::Param for HopperParams {}

/// The Hopper forward kernels' parameters.
pub type HopperArgs = (HopperParams,);

/// The Hopper forward kernel for `dtype` (bf16 or f16) and padded head dim `dp` (64 or 128);
/// `None` otherwise.
#[cfg(not(target_arch = "nvptx64"))]
pub const fn hopper_kernel(dtype: crate::DType, dp: u32) -> Option<crate::kernel::Kernel<HopperArgs>> {
    match (dtype, dp) {
        (crate::DType::BF16, 64) => Some(attention_fwd_wgmma_d64_bf16),
        (crate::DType::BF16, 128) => Some(attention_fwd_wgmma_d128_bf16),
        (crate::DType::F16, 64) => Some(attention_fwd_wgmma_d64_f16),
        (crate::DType::F16, 128) => Some(attention_fwd_wgmma_d128_f16),
        _ => None,
    }
}

/// Every kernel of this file (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
    [
        attention_fwd_wgmma_d64_bf16,
        attention_fwd_wgmma_d128_bf16,
        attention_fwd_wgmma_d64_f16,
        attention_fwd_wgmma_d128_f16,
    ]
    .into_iter()
    .map(|k| k.entry())
}

#[cfg(all(target_arch = "nvptx64", target_feature = "sm_90a"))]
pub(super) mod device {
    use super::super::{AttnType, block_range, key_range};
    use super::*;
    use crate::prim::*;

    /// Consumer warpgroups.
    const CONSUMERS: u32 = 2;

    /// A padded head dim: O's accumulators and its `O += P V` product.
    pub trait Dim {
        const DP: u32;
        /// Whether the consumers take turns at the tensor cores ([`consume`]'s ping-pong): for
        /// the head dim of 64, whose products are short against the softmax.
        const PING_PONG: bool;
        type Acc: WgmmaAcc + AsMut<[f32]> + AsRef<[f32]>;
        fn zero() -> Self::Acc;
        /// # Safety
        /// As [`wgmma_m64n64k16_rs`].
        unsafe fn pv<const BF16: bool>(o: &mut Self::Acc, a: [u32; 4], db: u64);
    }

    pub struct D64;
    pub struct D128;

    impl Dim for D64 {
        const DP: u32 = 64;
        const PING_PONG: bool = true;
        type Acc = [f32; 32];
        #[inline(always)]
        fn zero() -> [f32; 32] {
            // SAFETY: all-zero bits are 0.0 (a repeat expression would be a loop).
            unsafe { core::mem::zeroed() }
        }
        #[inline(always)]
        unsafe fn pv<const BF16: bool>(o: &mut [f32; 32], a: [u32; 4], db: u64) {
            // SAFETY: the caller's.
            unsafe { wgmma_m64n64k16_rs::<BF16>(o, a, db) }
        }
    }

    impl Dim for D128 {
        const DP: u32 = 128;
        const PING_PONG: bool = false;
        type Acc = [f32; 64];
        #[inline(always)]
        fn zero() -> [f32; 64] {
            // SAFETY: all-zero bits are 0.0.
            unsafe { core::mem::zeroed() }
        }
        #[inline(always)]
        unsafe fn pv<const BF16: bool>(o: &mut [f32; 64], a: [u32; 4], db: u64) {
            // SAFETY: the caller's.
            unsafe { wgmma_m64n128k16_rs::<BF16>(o, a, db) }
        }
    }

    /// The shared-memory layout of a block: Q's panels, the K ring, the V ring, the barriers
    /// (Q's; then full and empty for each stage of K, then of V).
    #[derive(Clone, Copy)]
    struct Smem {
        q: u32,
        k: u32,
        v: u32,
        bars: u32,
        dp: u32,
    }

    impl Smem {
        fn new(dp: u32) -> Smem {
            let q = (dyn_smem_addr() + 1023) & !1023;
            let k = q + (dp / 64) * panel(BM);
            let v = k + STAGES * tile_bytes(dp);
            Smem { q, k, v, bars: v + STAGES * tile_bytes(dp), dp }
        }
        fn q_bar(self) -> u32 {
            self.bars
        }
        /// `ring` 0: K, 1: V.
        fn full(self, ring: u32, s: u32) -> u32 {
            self.bars + 8 * (1 + 2 * STAGES * ring + s)
        }
        fn empty(self, ring: u32, s: u32) -> u32 {
            self.bars + 8 * (1 + 2 * STAGES * ring + STAGES + s)
        }
        /// Stage `s` of ring `ring`: `dp / 64` panels of `BN` rows.
        fn tile(self, ring: u32, s: u32) -> u32 {
            (if ring == 0 { self.k } else { self.v }) + s * tile_bytes(self.dp)
        }
    }

    /// Bytes of one `BN x dp` tile of K or V.
    const fn tile_bytes(dp: u32) -> u32 {
        (dp / 64) * panel(BN)
    }

    /// The stage and phase of key block `nb` in either ring (both advance one stage a block from
    /// the block's first, `nb0`).
    #[inline(always)]
    fn slot(nb: u32, nb0: u32) -> (u32, u32) {
        let i = nb - nb0;
        (i % STAGES, (i / STAGES) & 1)
    }

    /// The forward of one block: 128 query rows of one (batch, head).
    ///
    /// # Safety
    /// Launched with [`THREADS`] threads, [`smem_bytes`]`(D::DP)` of dynamic shared memory, and
    /// parameters whose maps and pointers describe the tensors as [`HopperParams`] says.
    #[inline(always)]
    pub unsafe fn fwd<I: AttnType, D: Dim>(p: HopperParams) {
        let dp = D::DP;
        let tid = thread_idx_x();
        let sm = Smem::new(dp);
        let bid = block_idx_x();
        // At least 1, so that the divisions have no panic path (the host never launches less).
        let (q_blocks, heads_q) = (p.q_blocks.max(1), p.heads_q.max(1));
        let qb = q_blocks - 1 - bid % q_blocks;
        let zh = bid / q_blocks;
        let (h, b) = (zh % heads_q, zh / heads_q + p.z0);
        let q0 = qb * BM;
        let q_last = (q0 + BM - 1).min(p.seq_q.saturating_sub(1));
        let (nb0, nb1) = block_range(q0, q_last, p.lo, p.hi, p.seq_k, BN);

        // SAFETY: the barriers lie in the dynamic shared memory (smem_bytes covers them), are
        // initialised once by one thread, and used only after the block barrier.
        unsafe {
            if tid == 0 {
                mbarrier_init(sm.q_bar(), 1);
                for ring in 0..2 {
                    for s in 0..STAGES {
                        mbarrier_init(sm.full(ring, s), 1);
                        mbarrier_init(sm.empty(ring, s), CONSUMERS);
                    }
                }
                fence_mbarrier_init();
            }
        }
        sync_threads();

        if tid / 128 == 0 {
            // SAFETY: the whole warpgroup; the kernel's `.maxntid`/`.minnctapersm` cap it.
            unsafe { setmaxnreg::<false, 40>() };
            if tid == 0 {
                // SAFETY: the host wrote the maps before the launch; each copy lands in Q's panels
                // or in a stage both consumers released (the empty barrier's phase), and is
                // signalled to a barrier that expects exactly its bytes (the copy engine counts the
                // zero-filled elements outside the tensor too).
                unsafe { produce(&p, sm, (h, b), q0, (nb0, nb1)) };
            }
        } else {
            // SAFETY: the consumer warpgroups run this whole; the kernel's contract.
            unsafe { consume::<I, D>(&p, sm, (h, b), q0, (nb0, nb1)) };
        }
    }

    /// The producer thread: Q's panels, then for each key block its K tile, then its V tile.
    ///
    /// # Safety
    /// As [`fwd`]'s, for its one thread.
    #[inline(always)]
    unsafe fn produce(p: &HopperParams, sm: Smem, (h, b): (u32, u32), q0: u32, (nb0, nb1): (u32, u32)) {
        let dp = sm.dp;
        let hk = h / p.group.max(1);
        // SAFETY: per the contract.
        unsafe {
            let maps = [p.maps, p.maps.add(16), p.maps.add(32)];
            for m in maps {
                fence_tensormap(m);
            }
            mbarrier_arrive_expect_tx(sm.q_bar(), (dp / 64) * panel(BM));
            for c in 0..dp / 64 {
                tma_load_4d(
                    sm.q + c * panel(BM),
                    maps[0],
                    sm.q_bar(),
                    ((64 * c) as i32, q0 as i32, h as i32, b as i32),
                );
            }
            for nb in nb0..nb1 {
                let (s, ph) = slot(nb, nb0);
                for ring in 0..2 {
                    mbarrier_wait_parity(sm.empty(ring, s), ph ^ 1);
                    mbarrier_arrive_expect_tx(sm.full(ring, s), tile_bytes(dp));
                    for c in 0..dp / 64 {
                        let at = ((64 * c) as i32, (nb * BN) as i32, hk as i32, b as i32);
                        tma_load_4d(sm.tile(ring, s) + c * panel(BN), maps[1 + ring as usize], sm.full(ring, s), at);
                    }
                }
            }
        }
    }

    /// What a consumer thread knows of its rows: their keys, the keys all rows of its warpgroup
    /// see, the lane's quad position, and the scale.
    struct Rows {
        seen: [(u32, u32); 2],
        all: (u32, u32),
        t: u32,
        sl2: f32,
    }

    /// `S = Q K^T` for this warpgroup's 64 rows and the key tile at `kb`, issued and committed
    /// (not waited for): 16 columns of the head dim a step, 64 a panel (32 bytes a step within a
    /// swizzled row); the warpgroup's rows start 64 rows into Q's panels.
    ///
    /// # Safety
    /// The whole consumer warpgroup; Q and the tile complete (their barriers waited for).
    #[inline(always)]
    unsafe fn issue_s<const BF16: bool>(sc: &mut [f32; 64], sm: Smem, cw: u32, kb: u32) {
        // SAFETY: per the contract.
        unsafe {
            wgmma_fence(sc);
            unroll!(KK: u32; 0 1 2 3 4 5 6 7 => {
                if KK < sm.dp / 16 {
                    let da = wgmma_desc(sm.q + (KK / 4) * panel(BM) + cw * panel(64) + (KK % 4) * 32, 16, 1024);
                    let db = wgmma_desc(kb + (KK / 4) * panel(BN) + (KK % 4) * 32, 16, 1024);
                    // The first step overwrites the accumulators (no zeroing pass).
                    if KK == 0 {
                        wgmma_m64n128k16_ss::<BF16, false>(sc, da, db);
                    } else {
                        wgmma_m64n128k16_ss::<BF16, true>(sc, da, db);
                    }
                }
            });
            wgmma_commit();
        }
    }

    /// `O += P V` for the value tile at `vb`, issued and committed: V's 16-key steps are 16 rows
    /// (2048 bytes) on in its panels, which lie `panel(BN)` apart along the head dim.
    ///
    /// # Safety
    /// The whole consumer warpgroup; the tile complete; `pa` and `o` untouched until the wait.
    #[inline(always)]
    unsafe fn issue_pv<const BF16: bool, D: Dim>(o: &mut D::Acc, pa: &[[u32; 4]; 8], vb: u32) {
        // SAFETY: per the contract.
        unsafe {
            wgmma_fence(o);
            unroll!(KK: u32; 0 1 2 3 4 5 6 7 => {
                D::pv::<BF16>(o, pa[KK as usize], wgmma_desc(vb + KK * 2048, panel(BN), 1024));
            });
            wgmma_commit();
        }
    }

    /// The scores of key block `k0` in `sc` (complete) to weights: masked where the block
    /// straddles an edge of some row's keys, in log2 units, the running max `m` and sum `l`
    /// updated (online softmax). Returns O's rescale factor per row (R = 0: row g, 1: g + 8)
    /// and P rounded to the dtype as the A fragments of 16 keys each (columns 16 KK + 2t.. of
    /// rows g and g + 8, then 16 KK + 8 + 2t..), passed through `opaque` so that their
    /// computation stays above the fence of the product that reads them.
    ///
    /// A positive scale is folded into the exponent's fma (`2^(s c - m)`, the max taken over the
    /// raw scores: `c > 0` keeps their order); blocks inside every row's keys skip the mask.
    #[inline(always)]
    fn softmax<I: AttnType>(
        sc: &mut [f32; 64],
        k0: u32,
        r: &Rows,
        m: &mut [f32; 2],
        l: &mut [f32; 2],
    ) -> ([f32; 2], [[u32; 4]; 8]) {
        let masked = k0 < r.all.0 || k0 + BN > r.all.1;
        let alpha = if r.sl2 > 0.0 {
            if masked {
                mask(sc, k0, r);
            }
            online::<true>(sc, r.sl2, m, l)
        } else {
            // A scale of 0 or below: scaled first, so that a masked score is -inf after it.
            unroll!(X: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
                32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63 => {
                sc[X] *= r.sl2;
            });
            if masked {
                mask(sc, k0, r);
            }
            online::<false>(sc, 1.0, m, l)
        };
        let mut pa = [[0u32; 4]; 8];
        unroll!(KK: usize; 0 1 2 3 4 5 6 7 => {
            let f = |i: usize| I::pack2(sc[8 * KK + i], sc[8 * KK + i + 1]);
            pa[KK] = opaque([f(0), f(2), f(4), f(6)]);
        });
        (alpha, pa)
    }

    /// The scores of keys a row does not see set to -inf.
    #[inline(always)]
    fn mask(sc: &mut [f32; 64], k0: u32, r: &Rows) {
        unroll!(J: u32; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
            unroll!(E: u32; 0 1 2 3 => {
                let i = (4 * J + E) as usize;
                let key = k0 + 8 * J + 2 * r.t + E % 2;
                let (from, to) = r.seen[(E / 2) as usize];
                sc[i] = select_f32(!(from <= key && key < to), f32::NEG_INFINITY, sc[i]);
            });
        });
    }

    /// The online softmax of [`softmax`] on scores to be multiplied by `c` (`FOLD`, `c > 0`) or
    /// already scaled (`c` unused): the weights `2^(s c - m)` replace the scores.
    #[inline(always)]
    fn online<const FOLD: bool>(sc: &mut [f32; 64], c: f32, m: &mut [f32; 2], l: &mut [f32; 2]) -> [f32; 2] {
        let mut alpha = [0.0f32; 2];
        unroll!(R: usize; 0 1 => {
            let mut mx = f32::NEG_INFINITY;
            unroll!(J: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
                mx = max_nan(mx, max_nan(sc[4 * J + 2 * R], sc[4 * J + 2 * R + 1]));
            });
            // The 4 lanes of a row (t = 0..3) are adjacent.
            mx = max_nan(mx, shfl_xor_f32(mx, 1));
            mx = max_nan(mx, shfl_xor_f32(mx, 2));
            let m_new = max_nan(m[R], if FOLD { mx * c } else { mx });
            // A row with no finite score yet subtracts 0: exp2(-inf - 0) = 0, never NaN.
            let base = select_f32(m_new == f32::NEG_INFINITY, 0.0, m_new);
            alpha[R] = ex2_approx_ftz(m[R] - base);
            m[R] = m_new;
            let mut sum = 0.0f32;
            unroll!(J: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
                unroll!(E: usize; 0 1 => {
                    let s = sc[4 * J + 2 * R + E];
                    let pv = ex2_approx_ftz(if FOLD { crate::math::fma(s, c, -base) } else { s - base });
                    sc[4 * J + 2 * R + E] = pv;
                    sum += pv;
                });
            });
            l[R] = l[R] * alpha[R] + sum;
        });
        alpha
    }

    /// O's rows scaled by `alpha` (per row, as [`softmax`] returns it).
    #[inline(always)]
    fn rescale<D: Dim>(o: &mut D::Acc, alpha: [f32; 2]) {
        let oa = o.as_mut();
        unroll!(J: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
            if (J as u32) < D::DP / 8 {
                unroll!(E: usize; 0 1 2 3 => {
                    oa[4 * J + E] *= alpha[E / 2];
                });
            }
        });
    }

    /// Gives the tensor cores to the other consumer warpgroup ([`consume`]'s ping-pong).
    ///
    /// # Safety
    /// Both consumer warpgroups, in the pattern `consume` keeps.
    #[inline(always)]
    unsafe fn hand_over<D: Dim>(cw: u32) {
        if !D::PING_PONG {
            return;
        }
        // SAFETY: per the contract: barrier 1 is consumer 0's turn, 2 consumer 1's.
        unsafe {
            if cw == 0 {
                named_barrier_arrive::<2>(256);
            } else {
                named_barrier_arrive::<1>(256);
            }
        }
    }

    /// Waits for this consumer warpgroup's turn at the tensor cores.
    ///
    /// # Safety
    /// As [`hand_over`].
    #[inline(always)]
    unsafe fn take_turn<D: Dim>(cw: u32) {
        if !D::PING_PONG {
            return;
        }
        // SAFETY: per the contract.
        unsafe {
            if cw == 0 {
                named_barrier_sync::<1>(256);
            } else {
                named_barrier_sync::<2>(256);
            }
        }
    }

    /// A consumer warpgroup: its 64 query rows against key blocks `nb0..nb1`, then O and `lse`.
    /// The products overlap the softmax twice over:
    /// - within the warpgroup, block `j`'s scores are issued, then the previous block's
    ///   `O += P V`, and the softmax of block `j` runs while that product does (FlashAttention-3's
    ///   intra-warpgroup pipelining); K's stage is released once its scores are done, V's once
    ///   its product is;
    /// - between the two warpgroups (ping-pong, where [`Dim::PING_PONG`]): each issues its
    ///   products only in its turn (named barriers 1 and 2, consumer 0 first) and hands the turn
    ///   over right after, so one's softmax runs while the other's products do. Both walk every
    ///   block of the tile (a row that sees none of a block's keys gets weights of 0), so that
    ///   their turns pair up.
    ///
    /// # Safety
    /// As [`fwd`]'s, for a whole consumer warpgroup.
    #[inline(always)]
    unsafe fn consume<I: AttnType, D: Dim>(
        p: &HopperParams,
        sm: Smem,
        (h, b): (u32, u32),
        q0: u32,
        (nb0, nb1): (u32, u32),
    ) {
        // SAFETY: the whole warpgroup.
        unsafe { setmaxnreg::<true, 232>() };
        let bf16 = I::DTYPE == crate::DType::BF16;
        let tid = thread_idx_x();
        let cw = tid / 128 - 1;
        let (warp, lane) = ((tid % 128) / 32, tid % 32);
        let (g, t) = (lane / 4, lane % 4);
        let (sq, sk) = (p.seq_q, p.seq_k);
        let row0 = q0 + 64 * cw;
        let rows = [row0 + 16 * warp + g, row0 + 16 * warp + g + 8];
        // The keys all rows of this warpgroup see (blocks inside need no mask).
        let wg_last = (row0 + 63).min(sq.saturating_sub(1));
        let r = Rows {
            seen: [key_range(rows[0], p.lo, p.hi, sk), key_range(rows[1], p.lo, p.hi, sk)],
            all: (key_range(wg_last, p.lo, p.hi, sk).0, key_range(row0, p.lo, p.hi, sk).1),
            t,
            sl2: p.scale_log2,
        };
        let leader = tid % 128 == 0;

        let mut o = D::zero();
        let mut m = [f32::NEG_INFINITY; 2];
        let mut l = [0.0f32; 2];
        // SAFETY: Q's panels and a tile are read only after their barrier's phase completed (the
        // copies' bytes are visible to the tensor cores); a tile is released only after the
        // products reading it completed; P's registers and O are left alone while a product
        // reading them is in flight. Each warpgroup takes its turn n + 1 times and hands it over
        // as often (consumer 1 once more, first, which leaves one hand-over unmatched at exit).
        unsafe {
            if cw == 1 {
                hand_over::<D>(cw);
            }
            mbarrier_wait_parity(sm.q_bar(), 0);
            if nb0 < nb1 {
                // SAFETY: all-zero bits are 0.0.
                let mut sc: [f32; 64] = core::mem::zeroed();
                let (s, ph) = slot(nb0, nb0);
                mbarrier_wait_parity(sm.full(0, s), ph);
                take_turn::<D>(cw);
                if bf16 {
                    issue_s::<true>(&mut sc, sm, cw, sm.tile(0, s))
                } else {
                    issue_s::<false>(&mut sc, sm, cw, sm.tile(0, s))
                }
                hand_over::<D>(cw);
                wgmma_wait::<0>(&mut sc);
                if leader {
                    mbarrier_arrive(sm.empty(0, s));
                }
                let (_, mut pa) = softmax::<I>(&mut sc, nb0 * BN, &r, &mut m, &mut l);
                for nb in nb0 + 1..nb1 {
                    let (s, ph) = slot(nb, nb0);
                    let (sv, phv) = slot(nb - 1, nb0);
                    mbarrier_wait_parity(sm.full(0, s), ph);
                    mbarrier_wait_parity(sm.full(1, sv), phv);
                    take_turn::<D>(cw);
                    if bf16 {
                        issue_s::<true>(&mut sc, sm, cw, sm.tile(0, s))
                    } else {
                        issue_s::<false>(&mut sc, sm, cw, sm.tile(0, s))
                    }
                    if bf16 {
                        issue_pv::<true, D>(&mut o, &pa, sm.tile(1, sv))
                    } else {
                        issue_pv::<false, D>(&mut o, &pa, sm.tile(1, sv))
                    }
                    hand_over::<D>(cw);
                    wgmma_wait::<1>(&mut sc);
                    if leader {
                        mbarrier_arrive(sm.empty(0, s));
                    }
                    let (alpha, next) = softmax::<I>(&mut sc, nb * BN, &r, &mut m, &mut l);
                    wgmma_wait::<0>(&mut o);
                    if leader {
                        mbarrier_arrive(sm.empty(1, sv));
                    }
                    rescale::<D>(&mut o, alpha);
                    pa = next;
                }
                let (sv, phv) = slot(nb1 - 1, nb0);
                mbarrier_wait_parity(sm.full(1, sv), phv);
                take_turn::<D>(cw);
                if bf16 {
                    issue_pv::<true, D>(&mut o, &pa, sm.tile(1, sv))
                } else {
                    issue_pv::<false, D>(&mut o, &pa, sm.tile(1, sv))
                }
                hand_over::<D>(cw);
                wgmma_wait::<0>(&mut o);
                if leader {
                    mbarrier_arrive(sm.empty(1, sv));
                }
            }
        }

        let (ob, lse_row) =
            (b as u64 * p.o_stride[0] + h as u64 * p.o_stride[1], (b as u64 * p.heads_q as u64 + h as u64) * sq as u64);
        let oa = o.as_ref();
        unroll!(R: usize; 0 1 => {
            let mut lt = l[R] + shfl_xor_f32(l[R], 1);
            lt += shfl_xor_f32(lt, 2);
            let row = rows[R];
            let none = lt == 0.0;
            let inv = if none { 0.0 } else { crate::math::recip(lt) };
            let base = select_f32(m[R] == f32::NEG_INFINITY, 0.0, m[R]);
            let lse = if none { f32::NEG_INFINITY } else { base * core::f32::consts::LN_2 + crate::math::log(lt) };
            if row < sq {
                if t == 0 {
                    // SAFETY: `lse` holds every batch's heads_q * seq_q values; this row's is inside.
                    unsafe { *p.lse.add((lse_row + row as u64) as usize) = lse };
                }
                let orow = ob + row as u64 * p.o_stride[2];
                unroll!(J: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
                    if (J as u32) < D::DP / 8 && (J as u32) * 8 < p.d {
                        let (x0, x1) = (oa[4 * J + 2 * R] * inv, oa[4 * J + 2 * R + 1] * inv);
                        // A row that sees no key is zeros even where 0 * inf made its sum NaN.
                        let v = I::pack2(select_f32(none, 0.0, x0), select_f32(none, 0.0, x1));
                        let col = J as u64 * 8 + 2 * t as u64;
                        // SAFETY: row < seq_q and col + 1 < d: inside O; 4-byte aligned (even
                        // column, strides multiples of 8, base 16-byte aligned).
                        unsafe { *(p.o.add((orow + col) as usize) as *mut u32) = v };
                    }
                });
            }
        });
    }
}

macro_rules! hopper_kernels {
    ($($name:ident: $ty:ty, $dim:ident;)*) => {
        $(
            #[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_90a"))]
            crate::kernel!($name: HopperArgs = |p| device::fwd::<$ty, device::$dim>(p));
        )*
    };
}

hopper_kernels! {
    attention_fwd_wgmma_d64_bf16: crate::dtype::BF16, D64;
    attention_fwd_wgmma_d128_bf16: crate::dtype::BF16, D128;
    attention_fwd_wgmma_d64_f16: crate::dtype::F16, D64;
    attention_fwd_wgmma_d128_f16: crate::dtype::F16, D128;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_and_params() {
        // 1 KiB of alignment, Q, two stages of K and of V, nine barriers: within an H100's 227 KiB.
        assert_eq!(smem_bytes(64), 1024 + 16384 + 2 * 32768 + 72);
        assert_eq!(smem_bytes(128), 1024 + 32768 + 2 * 65536 + 72);
        assert!(smem_bytes(128) <= 227 * 1024);
        assert_eq!(core::mem::size_of::<HopperParams>(), 96);
    }
}
