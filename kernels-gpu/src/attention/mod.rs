//! Attention forward in bf16 and f16 on the tensor cores, FlashAttention-2 style on `mma.sync`
//! (the general path, every GPU from sm_80): `O = softmax(scale Q K^T + mask) V` and the row
//! log-sum-exp, without ever forming the `Sq x Sk` matrix (memory O(S)).
//!
//! # The design
//! - A block of 4 warps takes [`BM`] = 64 query rows of one (batch, head), 16 rows a warp, and
//!   walks the key blocks that any of its rows sees ([`key_range`]): [`block_n`] keys at a time
//!   (64; 32 for the head dim of 256, to keep the ring within 100 KiB of shared memory).
//! - The head dim is padded to `DP` (64, 128 or 256: one instance each, 96 runs on 128); columns
//!   beyond the real `d` are zero-filled by the copies and the tensor-core steps past `d` are
//!   skipped (a warp-uniform branch).
//! - Q (64 x DP) is copied once; K and V tiles of each key block by `cp.async` into a
//!   double-buffered ring, the next block's copies in flight while the current one is computed.
//!   Rows of shared memory are padded by 16 bytes, so each `ldmatrix` phase hits 8 distinct bank
//!   groups. For DP <= 128 the Q fragments stay in registers; for 256 they are re-read from
//!   shared memory (128 f32 accumulators of O leave no room for 64 more registers).
//! - `S = Q K^T` by `mma.m16n8k16` (f32 accumulators, K read with `ldmatrix` as stored), scaled
//!   by `scale log2(e)` and masked (only in blocks that straddle a mask edge), then the online
//!   softmax: running row max `m` (in log2 units) and sum `l` in f32, `P = 2^(S - m)` by
//!   `ex2.approx`, O rescaled by `2^(m_old - m_new)` when the max grows.
//! - P is rounded to the input dtype in registers (the accumulator layout of `S` is the A
//!   fragment layout of the next product) and `O += P V` by `mma` with V read by `ldmatrix
//!   .trans`. O stays in f32 registers; at the end it is divided by `l` and stored in the input
//!   dtype, and `lse = m ln 2 + ln l` in f32.
//! - A row that sees no key (masked out, or `Sk = 0`), or whose every score is `-inf`, gets zeros
//!   and `lse = -inf`, as FlashAttention.
//! - Causal blocks are launched heaviest first (the last query block of a head first).

pub mod backward;
pub mod hopper;
pub mod hopper_bwd;

/// Query rows per block.
pub const BM: u32 = 64;
/// Threads per block: 4 warps of 16 query rows.
pub const THREADS: u32 = 128;

/// Keys per block of the loop for the padded head dim `dp`.
pub const fn block_n(dp: u32) -> u32 {
    if dp > 128 { 32 } else { 64 }
}

/// The padded head dim of a real head dim `d` (a multiple of 8 from 8 to 256), `None` outside.
pub const fn padded_dim(d: u32) -> Option<u32> {
    if d == 0 || !d.is_multiple_of(8) {
        return None;
    }
    match d {
        1..=64 => Some(64),
        65..=128 => Some(128),
        129..=256 => Some(256),
        _ => None,
    }
}

/// Dynamic shared memory of a block for the padded head dim `dp`: Q, then two stages of K and V,
/// every row `dp + 8` elements of 2 bytes.
pub const fn smem_bytes(dp: u32) -> u32 {
    2 * (dp + 8) * (BM + 4 * block_n(dp))
}

/// The keys query row `i` sees: `[first, end)`, the band `i + lo <= j <= i + hi` cut to
/// `[0, seq_k)`; empty (`first >= end`) when it sees none. The host keeps `|lo|, |hi| <= 2^33`.
#[inline(always)]
pub fn key_range(i: u32, lo: i64, hi: i64, seq_k: u32) -> (u32, u32) {
    let cut = |x: i64| {
        if x < 0 {
            0
        } else if x > seq_k as i64 {
            seq_k
        } else {
            x as u32
        }
    };
    (cut(i as i64 + lo), cut(i as i64 + hi + 1))
}

/// The key blocks (of `bn` keys) that query rows `[q0, q_last]` see: `[first, end)`.
#[inline(always)]
pub fn block_range(q0: u32, q_last: u32, lo: i64, hi: i64, seq_k: u32, bn: u32) -> (u32, u32) {
    let (first, _) = key_range(q0, lo, hi, seq_k);
    let (_, end) = key_range(q_last, lo, hi, seq_k);
    if end > first { (first / bn, end.div_ceil(bn)) } else { (0, 0) }
}

/// Everything one launch needs (one kernel parameter, `#[repr(C)]`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttnParams {
    /// Q, `[batch][head][row][d]` through `q_stride`.
    pub q: *const u16,
    /// K, with `heads_q / group` heads.
    pub k: *const u16,
    /// V, K's shape.
    pub v: *const u16,
    /// O, Q's shape, written.
    pub o: *mut u16,
    /// `[batch][heads_q][seq_q]` f32, contiguous, written.
    pub lse: *mut f32,
    /// Element strides of Q between batches, heads and rows (a row's `d` values are contiguous).
    pub q_stride: [u64; 3],
    /// K's strides.
    pub k_stride: [u64; 3],
    /// V's strides.
    pub v_stride: [u64; 3],
    /// O's strides.
    pub o_stride: [u64; 3],
    /// Key `j` is seen by query row `i` iff `i + lo <= j <= i + hi` (and `j < seq_k`).
    pub lo: i64,
    /// See `lo`.
    pub hi: i64,
    /// Query rows.
    pub seq_q: u32,
    /// Keys.
    pub seq_k: u32,
    /// The head dim (a multiple of 8, at most the kernel's padded dim).
    pub d: u32,
    /// Query heads.
    pub heads_q: u32,
    /// Query heads per key/value head (GQA; 1: MHA, `heads_q`: MQA).
    pub group: u32,
    /// Query blocks per head: `ceil(seq_q / BM)`. The grid is `q_blocks * heads_q * batches`.
    pub q_blocks: u32,
    /// `scale * log2(e)`.
    pub scale_log2: f32,
    /// Padding to 8 bytes.
    pub pad: u32,
}

/// A kernel parameter: a plain `#[repr(C)]` value of pointers and integers.
impl crate::kernel::Param for AttnParams {}

/// The forward kernels' parameters.
pub type AttentionArgs = (AttnParams,);

/// The forward kernel for `dtype` (bf16 or f16) and padded head dim `dp`; `None` for f32 or
/// another `dp`.
#[cfg(not(target_arch = "nvptx64"))]
pub const fn fwd_kernel(dtype: crate::DType, dp: u32) -> Option<crate::kernel::Kernel<AttentionArgs>> {
    let i = match dp {
        64 => 0,
        128 => 1,
        256 => 2,
        _ => return None,
    };
    match dtype {
        crate::DType::BF16 => Some([attention_fwd_d64_bf16, attention_fwd_d128_bf16, attention_fwd_d256_bf16][i]),
        crate::DType::F16 => Some([attention_fwd_d64_f16, attention_fwd_d128_f16, attention_fwd_d256_f16][i]),
        crate::DType::F32 => None,
    }
}

/// Every kernel of this family, forward and backward: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
    [
        attention_fwd_d64_bf16,
        attention_fwd_d128_bf16,
        attention_fwd_d256_bf16,
        attention_fwd_d64_f16,
        attention_fwd_d128_f16,
        attention_fwd_d256_f16,
    ]
    .into_iter()
    .map(|k| k.entry())
    .chain(backward::all_kernels())
    .chain(hopper::all_kernels())
    .chain(hopper_bwd::all_kernels())
}

/// An input type of the tensor cores: its `mma` and the rounding of P to it.
pub trait AttnType: crate::dtype::Elem {
    /// `d = a @ b + c`, one warp's m16n8k16 product.
    #[cfg(target_arch = "nvptx64")]
    fn mma(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4];
    /// Two f32 rounded to nearest even and packed, `lo` in the low half.
    #[cfg(target_arch = "nvptx64")]
    fn pack2(lo: f32, hi: f32) -> u32;
}

impl AttnType for crate::dtype::BF16 {
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn mma(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        crate::prim::mma_bf16_16x8x16(a, b, c)
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn pack2(lo: f32, hi: f32) -> u32 {
        crate::prim::f32x2_to_bf16x2(lo, hi)
    }
}

impl AttnType for crate::dtype::F16 {
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn mma(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        crate::prim::mma_f16_16x8x16(a, b, c)
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn pack2(lo: f32, hi: f32) -> u32 {
        crate::prim::f32x2_to_f16x2(lo, hi)
    }
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::prim;

    /// Starts the copies of a `rows x DP` tile whose first row is `src` (row stride `ld`
    /// elements) into shared memory at `dst`; rows from `rows_left` on and columns from `d` on are
    /// zero-filled. `origin` is any valid address (named by the copies of nothing).
    ///
    /// # Safety
    /// The tile's rows below `rows_left` and columns below `d` lie in global memory, 16-byte
    /// aligned (the host checks the bases; `d` and the strides are multiples of 8 elements);
    /// `dst` is a free region of `rows * (DP + 8) * 2` bytes of the dynamic shared memory.
    #[inline(always)]
    pub(super) unsafe fn copy_tile<const DP: u32, const ROWS: u32>(
        dst: u32,
        src: *const u16,
        origin: *const u16,
        ld: u64,
        rows_left: u32,
        d: u32,
        tid: u32,
    ) {
        let per_row = DP / 8;
        let chunks = ROWS * per_row / THREADS;
        unroll!(I: u32; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
            if I < chunks {
                let c = tid + I * THREADS;
                let (r, col) = (c / per_row, 8 * (c % per_row));
                let inside = r < rows_left && col < d;
                // SAFETY: address arithmetic; only a chunk `inside` is read.
                let from = if inside { unsafe { src.add((r as u64 * ld) as usize + col as usize) } } else { origin };
                // SAFETY: per the contract; a chunk outside copies 0 bytes and zero-fills.
                unsafe {
                    prim::cp_async_16(dst + 2 * (r * (DP + 8) + col), from as *const f32, if inside { 16 } else { 0 })
                };
            }
        });
    }

    /// The forward of one block: 64 query rows of one (batch, head).
    #[inline(always)]
    pub unsafe fn fwd<I: AttnType, const DP: u32>(p: AttnParams) {
        let bn = block_n(DP);
        let rs = DP + 8;
        // For DP <= 128 the Q fragments stay in registers.
        let q_regs = DP <= 128;
        let tid = prim::thread_idx_x();
        let (warp, lane) = (tid / 32, tid % 32);
        let (g, t) = (lane / 4, lane % 4);
        let bid = prim::block_idx_x();
        // At least 1, so that the divisions have no panic path (the host never launches less).
        let (q_blocks, heads_q, group) = (p.q_blocks.max(1), p.heads_q.max(1), p.group.max(1));
        let qb = q_blocks - 1 - bid % q_blocks;
        let zh = bid / q_blocks;
        let (h, b) = (zh % heads_q, zh / heads_q);
        let hk = h / group;
        let q0 = qb * BM;
        let (sq, sk, d) = (p.seq_q, p.seq_k, p.d);
        // SAFETY (all pointer arithmetic below): the host sized the grid to the tensors; rows and
        // columns outside them are never dereferenced.
        let (qh, kh, vh) = unsafe {
            (
                p.q.add((b as u64 * p.q_stride[0] + h as u64 * p.q_stride[1]) as usize),
                p.k.add((b as u64 * p.k_stride[0] + hk as u64 * p.k_stride[1]) as usize),
                p.v.add((b as u64 * p.v_stride[0] + hk as u64 * p.v_stride[1]) as usize),
            )
        };

        let smem = prim::dyn_smem_addr();
        let q_s = smem;
        let ring = smem + 2 * BM * rs;
        let stage = 2 * 2 * bn * rs;
        let v_off = 2 * bn * rs;

        let q_last = (q0 + BM - 1).min(sq.saturating_sub(1));
        let (nb0, nb1) = block_range(q0, q_last, p.lo, p.hi, sk, bn);
        // Keys every row of the block sees: blocks inside need no mask.
        let (all_from, _) = key_range(q_last, p.lo, p.hi, sk);
        let (_, all_to) = key_range(q0, p.lo, p.hi, sk);
        let rows = [q0 + warp * 16 + g, q0 + warp * 16 + g + 8];
        let seen = [key_range(rows[0], p.lo, p.hi, sk), key_range(rows[1], p.lo, p.hi, sk)];

        // Groups: Q, then key block nb0 (empty when none), then one per iteration.
        // SAFETY: Q's rows from q0 on; the regions are disjoint parts of the launch's
        // `smem_bytes(DP)`.
        unsafe {
            let qt = qh.add((q0 as u64 * p.q_stride[2]) as usize);
            copy_tile::<DP, BM>(q_s, qt, qh, p.q_stride[2], sq.saturating_sub(q0), d, tid);
        }
        prim::cp_async_commit();
        if nb0 < nb1 {
            let k0 = nb0 * bn;
            // SAFETY: as above, keys from k0 on.
            unsafe { copy_kv::<DP>(ring, kh, vh, &p, k0, v_off, bn, tid) };
        }
        prim::cp_async_commit();

        let (i4, j8) = (lane / 8, lane % 8);
        // This lane's ldmatrix rows: Q's matrices are (rows 0-7, d 0-7), (rows 8-15, d 0-7),
        // (rows 0-7, d 8-15), (rows 8-15, d 8-15), the order of the mma's `a`; K's (keys 0-7, d
        // 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15): the `b` of two
        // adjacent 8-key tiles; V's, transposed, (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys
        // 0-7, d 8-15), (keys 8-15, d 8-15): the `b` of two adjacent 8-column tiles of O.
        let a_lane = 2 * ((warp * 16 + 8 * (i4 % 2) + j8) * rs + 8 * (i4 / 2));
        let k_lane = 2 * ((8 * (i4 / 2) + j8) * rs + 8 * (i4 % 2));
        let v_lane = 2 * ((8 * (i4 % 2) + j8) * rs + 8 * (i4 / 2));

        let mut qf = [[0u32; 4]; 16];
        if q_regs {
            prim::cp_async_wait::<1>();
            prim::sync_threads();
            unroll!(KS: u32; 0 1 2 3 4 5 6 7 => {
                if KS < DP / 16 {
                    // SAFETY: Q's tile, complete for every thread since the barrier.
                    qf[KS as usize] = unsafe { prim::ldmatrix_x4(q_s + a_lane + 32 * KS) };
                }
            });
        }

        let mut o = [[0.0f32; 4]; 32];
        let mut m = [f32::NEG_INFINITY; 2];
        let mut l = [0.0f32; 2];
        let sl2 = p.scale_log2;
        let mut nb = nb0;
        while nb < nb1 {
            let slot = (nb - nb0) % 2;
            if nb + 1 < nb1 {
                // SAFETY: the other slot, last read before the barrier that ended the previous
                // iteration.
                unsafe { copy_kv::<DP>(ring + (1 - slot) * stage, kh, vh, &p, (nb + 1) * bn, v_off, bn, tid) };
            }
            prim::cp_async_commit();
            // Every group but the one just committed has landed: Q and key block nb.
            prim::cp_async_wait::<1>();
            prim::sync_threads();
            let kb = ring + slot * stage;
            let vb = kb + v_off;
            let k0 = nb * bn;

            // S = Q K^T for this warp's 16 rows and the block's keys.
            let mut s = [[0.0f32; 4]; 8];
            unroll!(KS: u32; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
                if KS < DP / 16 && KS * 16 < d {
                    // SAFETY: Q's tile in shared memory, complete since the first barrier.
                    let a = if q_regs { qf[KS as usize] } else { unsafe { prim::ldmatrix_x4(q_s + a_lane + 32 * KS) } };
                    unroll!(NP: u32; 0 1 2 3 => {
                        if NP < bn / 16 {
                            // SAFETY: slot `slot`, complete for every thread since the barrier.
                            let kf = unsafe { prim::ldmatrix_x4(kb + k_lane + 2 * 16 * rs * NP + 32 * KS) };
                            s[2 * NP as usize] = I::mma(a, [kf[0], kf[1]], s[2 * NP as usize]);
                            s[2 * NP as usize + 1] = I::mma(a, [kf[2], kf[3]], s[2 * NP as usize + 1]);
                        }
                    });
                }
            });

            // Scale to log2 units; mask where the block straddles an edge of some row's keys (a
            // uniform branch: the blocks inside skip the per-element compares).
            let masked = k0 < all_from || k0 + bn > all_to;
            unroll!(J: u32; 0 1 2 3 4 5 6 7 => {
                if J < bn / 8 {
                    unroll!(E: u32; 0 1 2 3 => {
                        s[J as usize][E as usize] *= sl2;
                    });
                }
            });
            if masked {
                unroll!(J: u32; 0 1 2 3 4 5 6 7 => {
                    if J < bn / 8 {
                        unroll!(E: u32; 0 1 2 3 => {
                            let key = k0 + 8 * J + 2 * t + E % 2;
                            let (from, to) = seen[(E / 2) as usize];
                            let x = s[J as usize][E as usize];
                            s[J as usize][E as usize] = prim::select_f32(!(from <= key && key < to), f32::NEG_INFINITY, x);
                        });
                    }
                });
            }

            // The online softmax, per row of this thread (R = 0: row g, 1: row g + 8).
            let mut alpha = [0.0f32; 2];
            unroll!(R: usize; 0 1 => {
                let mut mx = f32::NEG_INFINITY;
                unroll!(J: u32; 0 1 2 3 4 5 6 7 => {
                    if J < bn / 8 {
                        mx = prim::max_nan(mx, prim::max_nan(s[J as usize][2 * R], s[J as usize][2 * R + 1]));
                    }
                });
                // The 4 lanes of a row (t = 0..3) are adjacent.
                mx = prim::max_nan(mx, prim::shfl_xor_f32(mx, 1));
                mx = prim::max_nan(mx, prim::shfl_xor_f32(mx, 2));
                let m_new = prim::max_nan(m[R], mx);
                // A row with no finite score yet subtracts 0: exp2(-inf - 0) = 0, never NaN.
                let base = prim::select_f32(m_new == f32::NEG_INFINITY, 0.0, m_new);
                alpha[R] = prim::ex2_approx_ftz(m[R] - base);
                m[R] = m_new;
                let mut sum = 0.0f32;
                unroll!(J: u32; 0 1 2 3 4 5 6 7 => {
                    if J < bn / 8 {
                        unroll!(E: usize; 0 1 => {
                            let pv = prim::ex2_approx_ftz(s[J as usize][2 * R + E] - base);
                            s[J as usize][2 * R + E] = pv;
                            sum += pv;
                        });
                    }
                });
                l[R] = l[R] * alpha[R] + sum;
            });
            unroll!(DT: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 => {
                if (DT as u32) < DP / 8 {
                    o[DT] = [o[DT][0] * alpha[0], o[DT][1] * alpha[0], o[DT][2] * alpha[1], o[DT][3] * alpha[1]];
                }
            });

            // O += P V: P rounded to the dtype, in the A layout (keys 16 KK + 2t.. of rows g and
            // g + 8, then keys 16 KK + 8 + 2t..).
            unroll!(KK: usize; 0 1 2 3 => {
                if (KK as u32) < bn / 16 {
                    let (lo8, hi8) = (s[2 * KK], s[2 * KK + 1]);
                    let a = [I::pack2(lo8[0], lo8[1]), I::pack2(lo8[2], lo8[3]), I::pack2(hi8[0], hi8[1]), I::pack2(hi8[2], hi8[3])];
                    unroll!(DP2: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
                        if (DP2 as u32) < DP / 16 && (DP2 as u32) * 16 < d {
                            // SAFETY: as K's.
                            let vf = unsafe { prim::ldmatrix_x4_trans(vb + v_lane + 2 * 16 * rs * KK as u32 + 32 * DP2 as u32) };
                            o[2 * DP2] = I::mma(a, [vf[0], vf[1]], o[2 * DP2]);
                            o[2 * DP2 + 1] = I::mma(a, [vf[2], vf[3]], o[2 * DP2 + 1]);
                        }
                    });
                }
            });
            // Every warp is done with slot `slot` before the next iteration copies into it.
            prim::sync_threads();
            nb += 1;
        }
        // Only empty groups may still be pending (none when no key block ran: wait for Q's).
        prim::cp_async_wait::<0>();

        let (ob, lse_row) =
            (b as u64 * p.o_stride[0] + h as u64 * p.o_stride[1], (b as u64 * heads_q as u64 + h as u64) * sq as u64);
        unroll!(R: usize; 0 1 => {
            let mut lt = l[R] + prim::shfl_xor_f32(l[R], 1);
            lt += prim::shfl_xor_f32(lt, 2);
            let row = rows[R];
            let none = lt == 0.0;
            let inv = if none { 0.0 } else { crate::math::recip(lt) };
            let base = prim::select_f32(m[R] == f32::NEG_INFINITY, 0.0, m[R]);
            let lse = if none { f32::NEG_INFINITY } else { base * core::f32::consts::LN_2 + crate::math::log(lt) };
            if row < sq {
                if t == 0 {
                    // SAFETY: `lse` holds batches * heads_q * seq_q values; this row's is inside.
                    unsafe { *p.lse.add((lse_row + row as u64) as usize) = lse };
                }
                let orow = ob + row as u64 * p.o_stride[2];
                unroll!(DT: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 => {
                    if (DT as u32) < DP / 8 && (DT as u32) * 8 < d {
                        let (x0, x1) = (o[DT][2 * R] * inv, o[DT][2 * R + 1] * inv);
                        // A row that sees no key is zeros even where 0 * inf made its sum NaN.
                        let v = I::pack2(prim::select_f32(none, 0.0, x0), prim::select_f32(none, 0.0, x1));
                        let col = DT as u64 * 8 + 2 * t as u64;
                        // SAFETY: row < seq_q and col + 1 < d: inside O; 4-byte aligned (even
                        // column, strides multiples of 8, base 16-byte aligned).
                        unsafe { *(p.o.add((orow + col) as usize) as *mut u32) = v };
                    }
                });
            }
        });
    }

    /// Starts the copies of key block `k0..k0 + bn` of K and V into the stage at `slot`.
    ///
    /// # Safety
    /// As [`copy_tile`], for the stage's two tiles.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn copy_kv<const DP: u32>(
        slot: u32,
        kh: *const u16,
        vh: *const u16,
        p: &AttnParams,
        k0: u32,
        v_off: u32,
        bn: u32,
        tid: u32,
    ) {
        let left = p.seq_k.saturating_sub(k0);
        // SAFETY: per the contract.
        unsafe {
            let kt = kh.add((k0 as u64 * p.k_stride[2]) as usize);
            let vt = vh.add((k0 as u64 * p.v_stride[2]) as usize);
            if bn == 64 {
                copy_tile::<DP, 64>(slot, kt, kh, p.k_stride[2], left, p.d, tid);
                copy_tile::<DP, 64>(slot + v_off, vt, vh, p.v_stride[2], left, p.d, tid);
            } else {
                copy_tile::<DP, 32>(slot, kt, kh, p.k_stride[2], left, p.d, tid);
                copy_tile::<DP, 32>(slot + v_off, vt, vh, p.v_stride[2], left, p.d, tid);
            }
        }
    }
}

macro_rules! attention_kernels {
    ($($name:ident: $ty:ty, $dp:literal;)*) => {
        $(
            crate::kernel!($name: AttentionArgs = |p| device::fwd::<$ty, $dp>(p));
        )*
    };
}

attention_kernels! {
    attention_fwd_d64_bf16: crate::dtype::BF16, 64;
    attention_fwd_d128_bf16: crate::dtype::BF16, 128;
    attention_fwd_d256_bf16: crate::dtype::BF16, 256;
    attention_fwd_d64_f16: crate::dtype::F16, 64;
    attention_fwd_d128_f16: crate::dtype::F16, 128;
    attention_fwd_d256_f16: crate::dtype::F16, 256;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The naive rule: key `j` is seen by row `i` iff `j < seq_k` and `i + lo <= j <= i + hi`.
    fn sees(i: u32, j: u32, lo: i64, hi: i64, seq_k: u32) -> bool {
        j < seq_k && (i as i64 + lo) <= j as i64 && j as i64 <= i as i64 + hi
    }

    #[test]
    fn key_and_block_ranges_match_the_naive_rule() {
        let bands =
            [(-(1i64 << 33), 1i64 << 33), (-(1 << 33), 0), (-(1 << 33), 37), (-5, 0), (-3, 4), (2, 9), (-40, -30)];
        for seq_k in [0u32, 1, 17, 64, 100, 257] {
            for &(lo, hi) in &bands {
                for i in 0..300u32 {
                    let (f, e) = key_range(i, lo, hi, seq_k);
                    for j in 0..seq_k + 3 {
                        assert_eq!(
                            f <= j && j < e,
                            sees(i, j, lo, hi, seq_k),
                            "i {i} j {j} band {lo}..{hi} sk {seq_k}"
                        );
                    }
                }
                for bn in [32, 64] {
                    for q0 in (0..300u32).step_by(64) {
                        let last = (q0 + 63).min(299);
                        let (b0, b1) = block_range(q0, last, lo, hi, seq_k, bn);
                        // Every key any row sees lies in the blocks; no block is wholly unseen.
                        for j in 0..seq_k {
                            let any = (q0..=last).any(|i| sees(i, j, lo, hi, seq_k));
                            if any {
                                assert!(b0 * bn <= j && j < b1 * bn, "key {j} outside blocks {b0}..{b1}");
                            }
                        }
                        for blk in b0..b1 {
                            let any =
                                (blk * bn..(blk + 1) * bn).any(|j| (q0..=last).any(|i| sees(i, j, lo, hi, seq_k)));
                            assert!(any, "block {blk} of {b0}..{b1} is seen by no row (q0 {q0}, band {lo}..{hi})");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn padded_dims_and_shared_memory() {
        assert_eq!(padded_dim(0), None);
        assert_eq!(padded_dim(12), None);
        assert_eq!(padded_dim(264), None);
        for d in (8..=256).step_by(8) {
            let dp = padded_dim(d).unwrap();
            assert!(d <= dp && (dp == 64 || dp / 2 < d), "{d} -> {dp}");
        }
        assert_eq!(padded_dim(96), Some(128));
        assert_eq!([smem_bytes(64), smem_bytes(128), smem_bytes(256)], [46080, 87040, 101376]);
        // Within the 163 KiB an A100 block may opt into.
        assert!(smem_bytes(256) <= 163 * 1024);
        assert_eq!(core::mem::size_of::<AttnParams>(), 184);
    }
}
