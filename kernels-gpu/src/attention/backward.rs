//! Attention backward in bf16 and f16 on `mma.sync`, FlashAttention-2 style, deterministic: no
//! atomics, every gradient element summed in one fixed order by one thread.
//!
//! With `P = softmax(scale Q K^T + mask)` recomputed from the forward's log-sum-exp,
//! `dV = P^T dO`, `dP = dO V^T`, `dS = P * (dP - delta)` with `delta_i = dO_i . O_i`,
//! `dQ = scale dS K` and `dK = scale dS^T Q`. Three kernels, in this order:
//! - `prep`: per query row, `delta` and `lse * log2(e)` (the exponent base the
//!   other two use; `-inf`, a row that saw no key, becomes `+inf`, so its weights are 0) into an
//!   f32 workspace whose rows are padded to whole query blocks (padding: `+inf` and 0, so that
//!   padded queries weigh nothing without a mask).
//! - `dq`: the forward's structure (64 query rows a block, K and V blocks through a
//!   double-buffered `cp.async` ring) with two more products: `dP` and `dQ += dS K`.
//! - `dkdv`: the transposed structure: 64 keys a block, 16 a warp, K and V
//!   loaded once, and the query blocks that see them (of every query head of the group, for
//!   GQA) streamed through the ring with their `lse` and `delta`. `S^T = K Q^T` is computed
//!   directly in the layout whose accumulators are the `A` fragments of `dV += P^T dO` and
//!   `dK += dS^T Q`. For the head dim of 256 the accumulators of dK and dV (128 registers each)
//!   do not fit together: two launches, one for each.
//!
//! Computing dQ in its own kernel costs the recomputation of `S` and `dP` (7 products instead
//! of FlashAttention-2's 5) and buys determinism without a f32 dQ workspace.

use super::BM;

/// Keys per block of the dK/dV kernels.
pub const BN_KV: u32 = 64;

/// Query rows per step of the dK/dV kernel for the padded head dim `dp`: the accumulators of
/// dK and dV (`dp / 2` registers each a thread) leave room for 32 queries' `S` and `dP` from
/// 128 on.
pub const fn block_q(dp: u32) -> u32 {
    if dp > 64 { 32 } else { 64 }
}

/// Dynamic shared memory of the dQ kernel: Q and dO, then two stages of K and V.
pub const fn smem_dq(dp: u32) -> u32 {
    2 * (dp + 8) * (2 * BM + 4 * super::block_n(dp))
}

/// Dynamic shared memory of the dK/dV kernels: K and V, then two stages of Q, dO and the
/// queries' `lse` and `delta`.
pub const fn smem_dkdv(dp: u32) -> u32 {
    let bq = block_q(dp);
    2 * (dp + 8) * 2 * BN_KV + 2 * (2 * 2 * (dp + 8) * bq + 2 * 4 * bq)
}

/// What a dK/dV kernel accumulates.
pub mod mode {
    /// dV only.
    pub const DV: u32 = 1;
    /// dK only.
    pub const DK: u32 = 2;
    /// Both.
    pub const BOTH: u32 = 3;
}

/// Everything the backward kernels need (one kernel parameter, `#[repr(C)]`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttnBwdParams {
    /// Q, `[batch][head][row][d]` through `q_stride`.
    pub q: *const u16,
    /// K, with `heads_q / group` heads, through `kv_stride`.
    pub k: *const u16,
    /// V, K's shape.
    pub v: *const u16,
    /// The forward's output, Q's shape.
    pub o: *const u16,
    /// The gradient of the output, Q's shape.
    pub dout: *const u16,
    /// dQ, Q's shape, written by the dQ kernel.
    pub dq: *mut u16,
    /// dK, K's shape, written by the dK/dV kernels.
    pub dk: *mut u16,
    /// dV, K's shape, written by the dK/dV kernels.
    pub dv: *mut u16,
    /// The forward's log-sum-exp, `[batch][heads_q][seq_q]` f32.
    pub lse: *const f32,
    /// Workspace `[batch][heads_q][q_blocks * 64]` f32: `lse * log2(e)`, written by `prep`.
    pub lse2: *mut f32,
    /// Workspace of `lse2`'s shape: `delta`, written by `prep`.
    pub delta: *mut f32,
    /// Element strides of Q, O, dO and dQ between batches, heads and rows.
    pub q_stride: [u64; 3],
    /// Element strides of K, V, dK and dV.
    pub kv_stride: [u64; 3],
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
    /// Query heads per key/value head.
    pub group: u32,
    /// Query blocks per head: `ceil(seq_q / 64)`; the grid of `prep` and `dq` is `q_blocks *
    /// heads_q * batches`.
    pub q_blocks: u32,
    /// Key blocks per head: `ceil(seq_k / 64)`; the grid of `dkdv` is `k_blocks * (heads_q /
    /// group) * batches`.
    pub k_blocks: u32,
    /// The scale of the scores.
    pub scale: f32,
    /// `scale * log2(e)`.
    pub scale_log2: f32,
    /// Padding to 8 bytes.
    pub pad: u32,
}

/// A kernel parameter: a plain `#[repr(C)]` value of pointers and integers.
impl crate::kernel::Param for AttnBwdParams {}

/// The backward kernels' parameters.
pub type AttentionBwdArgs = (AttnBwdParams,);

/// The backward kernels of one dtype and padded head dim, in launch order: `prep`, `dq`, then
/// one or two dK/dV kernels.
#[cfg(not(target_arch = "nvptx64"))]
#[derive(Clone, Copy, Debug)]
pub struct BwdKernels {
    /// `delta` and `lse * log2(e)`.
    pub prep: crate::kernel::Kernel<AttentionBwdArgs>,
    /// dQ.
    pub dq: crate::kernel::Kernel<AttentionBwdArgs>,
    /// dK and dV: one kernel for both, or (head dim 256) one for each.
    pub dkdv: [Option<crate::kernel::Kernel<AttentionBwdArgs>>; 2],
}

/// The backward kernels for `dtype` (bf16 or f16) and padded head dim `dp`; `None` for f32 or
/// another `dp`.
#[cfg(not(target_arch = "nvptx64"))]
pub const fn bwd_kernels(dtype: crate::DType, dp: u32) -> Option<BwdKernels> {
    use crate::DType::{BF16, F16, F32};
    Some(match (dtype, dp) {
        (BF16, 64) => BwdKernels {
            prep: attention_bwd_prep_bf16,
            dq: attention_bwd_dq_d64_bf16,
            dkdv: [Some(attention_bwd_dkdv_d64_bf16), None],
        },
        (BF16, 128) => BwdKernels {
            prep: attention_bwd_prep_bf16,
            dq: attention_bwd_dq_d128_bf16,
            dkdv: [Some(attention_bwd_dkdv_d128_bf16), None],
        },
        (BF16, 256) => BwdKernels {
            prep: attention_bwd_prep_bf16,
            dq: attention_bwd_dq_d256_bf16,
            dkdv: [Some(attention_bwd_dk_d256_bf16), Some(attention_bwd_dv_d256_bf16)],
        },
        (F16, 64) => BwdKernels {
            prep: attention_bwd_prep_f16,
            dq: attention_bwd_dq_d64_f16,
            dkdv: [Some(attention_bwd_dkdv_d64_f16), None],
        },
        (F16, 128) => BwdKernels {
            prep: attention_bwd_prep_f16,
            dq: attention_bwd_dq_d128_f16,
            dkdv: [Some(attention_bwd_dkdv_d128_f16), None],
        },
        (F16, 256) => BwdKernels {
            prep: attention_bwd_prep_f16,
            dq: attention_bwd_dq_d256_f16,
            dkdv: [Some(attention_bwd_dk_d256_f16), Some(attention_bwd_dv_d256_f16)],
        },
        (F32, _) | (_, _) => return None,
    })
}

/// Every backward kernel: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
    [
        attention_bwd_prep_bf16,
        attention_bwd_prep_f16,
        attention_bwd_dq_d64_bf16,
        attention_bwd_dq_d128_bf16,
        attention_bwd_dq_d256_bf16,
        attention_bwd_dq_d64_f16,
        attention_bwd_dq_d128_f16,
        attention_bwd_dq_d256_f16,
        attention_bwd_dkdv_d64_bf16,
        attention_bwd_dkdv_d128_bf16,
        attention_bwd_dk_d256_bf16,
        attention_bwd_dv_d256_bf16,
        attention_bwd_dkdv_d64_f16,
        attention_bwd_dkdv_d128_f16,
        attention_bwd_dk_d256_f16,
        attention_bwd_dv_d256_f16,
    ]
    .into_iter()
    .map(|k| k.entry())
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::super::device::copy_tile;
    use super::super::{AttnType, key_range};
    use super::*;
    use crate::prim;

    /// The (batch, head, block) of block `bid` of a grid of `blocks` blocks per head; with
    /// `last_first`, the last block of a head first (under a causal mask the heaviest query
    /// block is the last, the heaviest key block the first).
    #[inline(always)]
    fn place(bid: u32, blocks: u32, heads: u32, last_first: bool) -> (u32, u32, u32) {
        let (blocks, heads) = (blocks.max(1), heads.max(1));
        let blk = if last_first { blocks - 1 - bid % blocks } else { bid % blocks };
        let zh = bid / blocks;
        (zh / heads, zh % heads, blk)
    }

    /// `delta_i = dO_i . O_i` and `lse_i log2(e)` for the 64 query rows of this block (16 a
    /// warp, a row at a time, 8 columns a lane); rows past `seq_q` get 0 and `+inf`.
    #[inline(always)]
    pub unsafe fn prep<I: AttnType>(p: AttnBwdParams) {
        let tid = prim::thread_idx_x();
        let (warp, lane) = (tid / 32, tid % 32);
        let (b, h, qb) = place(prim::block_idx_x(), p.q_blocks, p.heads_q, true);
        let bh = b as u64 * p.heads_q as u64 + h as u64;
        let pad = p.q_blocks as u64 * BM as u64;
        let col = 8 * lane;
        let row_of = |i: u32| b as u64 * p.q_stride[0] + h as u64 * p.q_stride[1] + i as u64 * p.q_stride[2];
        unroll!(R: u32; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
            let i = qb * BM + warp * 16 + R;
            let mut dot = 0.0f32;
            if i < p.seq_q && col < p.d {
                let at = (row_of(i) + col as u64) as usize;
                // SAFETY: row i < seq_q, columns col..col + 8 <= d of O and dO (Q's shape),
                // 16-byte aligned (d and the strides are multiples of 8, the bases aligned).
                let (o, g) = unsafe {
                    (prim::ld_global_nc_v4(p.o.add(at) as *const u32), prim::ld_global_nc_v4(p.dout.add(at) as *const u32))
                };
                let (o, g) = (I::unpack(o), I::unpack(g));
                unroll!(E: usize; 0 1 2 3 4 5 6 7 => { dot = crate::math::fma(o[E], g[E], dot); });
            }
            let dot = prim::warp_sum(dot);
            if lane == 0 {
                let at = (bh * pad + i as u64) as usize;
                let (lse2, delta) = if i < p.seq_q {
                    // SAFETY: the forward's lse holds batches * heads_q * seq_q values.
                    let lse = unsafe { *p.lse.add((bh * p.seq_q as u64 + i as u64) as usize) };
                    (prim::select_f32(lse == f32::NEG_INFINITY, f32::INFINITY, lse * core::f32::consts::LOG2_E), dot)
                } else {
                    (f32::INFINITY, 0.0)
                };
                // SAFETY: the workspaces hold batches * heads_q * q_blocks * 64 values.
                unsafe {
                    *p.lse2.add(at) = lse2;
                    *p.delta.add(at) = delta;
                }
            }
        });
    }

    /// Element offset of row `row` of head `h` of batch `b` through `stride`.
    #[inline(always)]
    fn head_row(stride: [u64; 3], b: u32, h: u32, row: u32) -> usize {
        (b as u64 * stride[0] + h as u64 * stride[1] + row as u64 * stride[2]) as usize
    }

    /// dQ of 64 query rows of one (batch, head): for every key block they see, `S = Q K^T`,
    /// `P = 2^(S scale log2(e) - lse2)`, `dP = dO V^T`, `dS = P (dP - delta)`, `dQ += dS K`;
    /// then `dQ *= scale`.
    #[inline(always)]
    pub unsafe fn dq<I: AttnType, const DP: u32>(p: AttnBwdParams) {
        let bn = super::super::block_n(DP);
        let rs = DP + 8;
        // For DP = 64 the fragments of Q and dO stay in registers.
        let frag_regs = DP <= 64;
        let tid = prim::thread_idx_x();
        let (warp, lane) = (tid / 32, tid % 32);
        let (g, t) = (lane / 4, lane % 4);
        let (b, h, qb) = place(prim::block_idx_x(), p.q_blocks, p.heads_q, true);
        let hk = h / p.group.max(1);
        let q0 = qb * BM;
        let (sq, sk, d) = (p.seq_q, p.seq_k, p.d);
        // SAFETY (pointer arithmetic): the host sized the grid to the tensors; rows and columns
        // outside them are never dereferenced.
        let (qh, doh, kh, vh) = unsafe {
            (
                p.q.add(head_row(p.q_stride, b, h, 0)),
                p.dout.add(head_row(p.q_stride, b, h, 0)),
                p.k.add(head_row(p.kv_stride, b, hk, 0)),
                p.v.add(head_row(p.kv_stride, b, hk, 0)),
            )
        };
        let smem = prim::dyn_smem_addr();
        let q_s = smem;
        let do_s = smem + 2 * BM * rs;
        let ring = smem + 4 * BM * rs;
        let stage = 2 * 2 * bn * rs;
        let v_off = 2 * bn * rs;

        let q_last = (q0 + BM - 1).min(sq.saturating_sub(1));
        let (nb0, nb1) = super::super::block_range(q0, q_last, p.lo, p.hi, sk, bn);
        let (all_from, _) = key_range(q_last, p.lo, p.hi, sk);
        let (_, all_to) = key_range(q0, p.lo, p.hi, sk);
        let rows = [q0 + warp * 16 + g, q0 + warp * 16 + g + 8];
        let seen = [key_range(rows[0], p.lo, p.hi, sk), key_range(rows[1], p.lo, p.hi, sk)];
        let bh = b as u64 * p.heads_q as u64 + h as u64;
        let pad = p.q_blocks as u64 * BM as u64;
        // SAFETY: rows < q_blocks * 64: inside the workspaces, written by `prep` before.
        let (lse2, delta) = unsafe {
            (
                [*p.lse2.add((bh * pad + rows[0] as u64) as usize), *p.lse2.add((bh * pad + rows[1] as u64) as usize)],
                [
                    *p.delta.add((bh * pad + rows[0] as u64) as usize),
                    *p.delta.add((bh * pad + rows[1] as u64) as usize),
                ],
            )
        };

        // Groups: Q and dO, then key block nb0 (empty when none), then one per iteration.
        // SAFETY: rows from q0 on; the regions are disjoint parts of `smem_dq(DP)`.
        unsafe {
            let at = (q0 as u64 * p.q_stride[2]) as usize;
            copy_tile::<DP, BM>(q_s, qh.add(at), qh, p.q_stride[2], sq.saturating_sub(q0), d, tid);
            copy_tile::<DP, BM>(do_s, doh.add(at), doh, p.q_stride[2], sq.saturating_sub(q0), d, tid);
        }
        prim::cp_async_commit();
        if nb0 < nb1 {
            // SAFETY: as above, keys from nb0 * bn on.
            unsafe { copy_kv::<DP>(ring, kh, vh, &p, nb0 * bn, v_off, bn, tid) };
        }
        prim::cp_async_commit();

        let (i4, j8) = (lane / 8, lane % 8);
        // ldmatrix rows as the forward's: `a_lane` for Q and dO (the `a` of 16 rows), `k_lane`
        // for K and V as stored (the `b` of two 8-key tiles), `t_lane` for K transposed (the `b`
        // of two 8-column tiles of dQ).
        let a_lane = 2 * ((warp * 16 + 8 * (i4 % 2) + j8) * rs + 8 * (i4 / 2));
        let k_lane = 2 * ((8 * (i4 / 2) + j8) * rs + 8 * (i4 % 2));
        let t_lane = 2 * ((8 * (i4 % 2) + j8) * rs + 8 * (i4 / 2));

        let mut qf = [[0u32; 4]; 4];
        let mut df = [[0u32; 4]; 4];
        if frag_regs {
            prim::cp_async_wait::<1>();
            prim::sync_threads();
            unroll!(KS: u32; 0 1 2 3 => {
                // SAFETY: Q's and dO's tiles, complete for every thread since the barrier.
                unsafe {
                    qf[KS as usize] = prim::ldmatrix_x4(q_s + a_lane + 32 * KS);
                    df[KS as usize] = prim::ldmatrix_x4(do_s + a_lane + 32 * KS);
                }
            });
        }

        let mut acc = [[0.0f32; 4]; 32];
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
            prim::cp_async_wait::<1>();
            prim::sync_threads();
            let kb = ring + slot * stage;
            let vb = kb + v_off;
            let k0 = nb * bn;

            // S = Q K^T and dP = dO V^T for this warp's 16 rows and the block's keys.
            let mut s = [[0.0f32; 4]; 8];
            let mut dp = [[0.0f32; 4]; 8];
            unroll!(KS: u32; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
                if KS < DP / 16 && KS * 16 < d {
                    // SAFETY: Q's and dO's tiles, complete since the first barrier.
                    let (a, ad) = if frag_regs {
                        (qf[(KS % 4) as usize], df[(KS % 4) as usize])
                    } else {
                        unsafe { (prim::ldmatrix_x4(q_s + a_lane + 32 * KS), prim::ldmatrix_x4(do_s + a_lane + 32 * KS)) }
                    };
                    unroll!(NP: u32; 0 1 2 3 => {
                        if NP < bn / 16 {
                            // SAFETY: slot `slot`, complete for every thread since the barrier.
                            let (kf, vf) = unsafe {
                                (
                                    prim::ldmatrix_x4(kb + k_lane + 2 * 16 * rs * NP + 32 * KS),
                                    prim::ldmatrix_x4(vb + k_lane + 2 * 16 * rs * NP + 32 * KS),
                                )
                            };
                            let n = 2 * NP as usize;
                            s[n] = I::mma(a, [kf[0], kf[1]], s[n]);
                            s[n + 1] = I::mma(a, [kf[2], kf[3]], s[n + 1]);
                            dp[n] = I::mma(ad, [vf[0], vf[1]], dp[n]);
                            dp[n + 1] = I::mma(ad, [vf[2], vf[3]], dp[n + 1]);
                        }
                    });
                }
            });

            // dS = P (dP - delta), P = 2^(S sl2 - lse2), 0 where masked; into `s`.
            let masked = k0 < all_from || k0 + bn > all_to;
            unroll!(J: u32; 0 1 2 3 4 5 6 7 => {
                if J < bn / 8 {
                    unroll!(E: u32; 0 1 2 3 => {
                        let (r, e) = ((E / 2) as usize, E as usize);
                        let key = k0 + 8 * J + 2 * t + E % 2;
                        let (from, to) = seen[r];
                        let hidden = masked && !(from <= key && key < to);
                        let x = prim::select_f32(hidden, f32::NEG_INFINITY, s[J as usize][e] * sl2);
                        let pv = prim::ex2_approx_ftz(x - lse2[r]);
                        s[J as usize][e] = pv * (dp[J as usize][e] - delta[r]);
                    });
                }
            });

            // dQ += dS K: dS rounded to the dtype in the A layout, K read transposed.
            unroll!(KK: usize; 0 1 2 3 => {
                if (KK as u32) < bn / 16 {
                    let (lo8, hi8) = (s[2 * KK], s[2 * KK + 1]);
                    let a = [I::pack2(lo8[0], lo8[1]), I::pack2(lo8[2], lo8[3]), I::pack2(hi8[0], hi8[1]), I::pack2(hi8[2], hi8[3])];
                    unroll!(DP2: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
                        if (DP2 as u32) < DP / 16 && (DP2 as u32) * 16 < d {
                            // SAFETY: as K's above.
                            let kf = unsafe { prim::ldmatrix_x4_trans(kb + t_lane + 2 * 16 * rs * KK as u32 + 32 * DP2 as u32) };
                            acc[2 * DP2] = I::mma(a, [kf[0], kf[1]], acc[2 * DP2]);
                            acc[2 * DP2 + 1] = I::mma(a, [kf[2], kf[3]], acc[2 * DP2 + 1]);
                        }
                    });
                }
            });
            // Every warp is done with slot `slot` before the next iteration copies into it.
            prim::sync_threads();
            nb += 1;
        }
        prim::cp_async_wait::<0>();

        let scale = p.scale;
        unroll!(R: usize; 0 1 => {
            let row = rows[R];
            if row < sq {
                let at = head_row(p.q_stride, b, h, row);
                unroll!(DT: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 => {
                    if (DT as u32) < DP / 8 && (DT as u32) * 8 < d {
                        let v = I::pack2(acc[DT][2 * R] * scale, acc[DT][2 * R + 1] * scale);
                        let col = DT * 8 + 2 * t as usize;
                        // SAFETY: row < seq_q and col + 1 < d: inside dQ; 4-byte aligned.
                        unsafe { *(p.dq.add(at + col) as *mut u32) = v };
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
        p: &AttnBwdParams,
        k0: u32,
        v_off: u32,
        bn: u32,
        tid: u32,
    ) {
        let left = p.seq_k.saturating_sub(k0);
        let ld = p.kv_stride[2];
        // SAFETY: per the contract.
        unsafe {
            let (kt, vt) = (kh.add((k0 as u64 * ld) as usize), vh.add((k0 as u64 * ld) as usize));
            if bn == 64 {
                copy_tile::<DP, 64>(slot, kt, kh, ld, left, p.d, tid);
                copy_tile::<DP, 64>(slot + v_off, vt, vh, ld, left, p.d, tid);
            } else {
                copy_tile::<DP, 32>(slot, kt, kh, ld, left, p.d, tid);
                copy_tile::<DP, 32>(slot + v_off, vt, vh, ld, left, p.d, tid);
            }
        }
    }

    /// Starts the copies of query block `i0..i0 + bq` of head `h`: Q and dO (rows past
    /// `seq_q` zero-filled) and 64 values of each workspace, into the stage at `slot`.
    ///
    /// # Safety
    /// As [`copy_tile`]; `h` is a query head of batch `b`, `i0` a multiple of `bq` below
    /// `q_blocks * 64`.
    #[inline(always)]
    unsafe fn copy_q<const DP: u32>(slot: u32, p: &AttnBwdParams, b: u32, h: u32, i0: u32, tid: u32) {
        let bq = block_q(DP);
        let rs = DP + 8;
        let ld = p.q_stride[2];
        let left = p.seq_q.saturating_sub(i0);
        let head = head_row(p.q_stride, b, h, 0);
        // SAFETY: per the contract.
        unsafe {
            let (qh, doh) = (p.q.add(head), p.dout.add(head));
            let (qt, dot) = (qh.add((i0 as u64 * ld) as usize), doh.add((i0 as u64 * ld) as usize));
            if bq == 64 {
                copy_tile::<DP, 64>(slot, qt, qh, ld, left, p.d, tid);
                copy_tile::<DP, 64>(slot + 2 * bq * rs, dot, doh, ld, left, p.d, tid);
            } else {
                copy_tile::<DP, 32>(slot, qt, qh, ld, left, p.d, tid);
                copy_tile::<DP, 32>(slot + 2 * bq * rs, dot, doh, ld, left, p.d, tid);
            }
            // bq / 4 chunks of 16 bytes each of lse2 and delta (rows padded to whole blocks, the
            // offset a multiple of 16 bytes).
            let w = (b as u64 * p.heads_q as u64 + h as u64) * p.q_blocks as u64 * BM as u64 + i0 as u64;
            let stats = slot + 4 * bq * rs;
            if tid < bq / 4 {
                prim::cp_async_16(stats + 16 * tid, p.lse2.add(w as usize + 4 * tid as usize) as *const f32, 16);
            } else if tid < bq / 2 {
                let c = tid - bq / 4;
                prim::cp_async_16(stats + 4 * bq + 16 * c, p.delta.add(w as usize + 4 * c as usize) as *const f32, 16);
            }
        }
    }

    /// dK and/or dV (per `MODE`) of 64 keys of one (batch, key/value head): for every query
    /// block of every query head of the group that sees them, `S^T = K Q^T`, `P^T = 2^(S^T
    /// scale log2(e) - lse2)`, `dV += P^T dO`, `dP^T = V dO^T`, `dS^T = P^T (dP^T - delta)`,
    /// `dK += dS^T Q`; then `dK *= scale`.
    #[inline(always)]
    pub unsafe fn dkdv<I: AttnType, const DP: u32, const MODE: u32>(p: AttnBwdParams) {
        let want_dk = MODE & mode::DK != 0;
        let want_dv = MODE & mode::DV != 0;
        let bq = block_q(DP);
        let rs = DP + 8;
        let tid = prim::thread_idx_x();
        let (warp, lane) = (tid / 32, tid % 32);
        let (g, t) = (lane / 4, lane % 4);
        let group = p.group.max(1);
        let (b, hk, kb) = place(prim::block_idx_x(), p.k_blocks, p.heads_q / group, false);
        let k0 = kb * BN_KV;
        let (sq, sk, d) = (p.seq_q, p.seq_k, p.d);

        let smem = prim::dyn_smem_addr();
        let k_s = smem;
        let v_s = smem + 2 * BN_KV * rs;
        let ring = smem + 4 * BN_KV * rs;
        let stage = 2 * 2 * bq * rs + 8 * bq;

        // The queries that see the block's keys: key j is seen by i iff j - hi <= i <= j - lo.
        let k_last = (k0 + BN_KV - 1).min(sk.saturating_sub(1));
        let (qb0, qb1) = super::super::block_range(k0, k_last, -p.hi, -p.lo, sq, bq);
        let (all_from, _) = key_range(k_last, -p.hi, -p.lo, sq);
        let (_, all_to) = key_range(k0, -p.hi, -p.lo, sq);
        let keys = [k0 + warp * 16 + g, k0 + warp * 16 + g + 8];
        let seen_by = [key_range(keys[0], -p.hi, -p.lo, sq), key_range(keys[1], -p.hi, -p.lo, sq)];
        let nqb = qb1 - qb0;
        let steps = nqb * group;

        // Groups: K and V with the first query block (when any), then one per step.
        let kvh = head_row(p.kv_stride, b, hk, k0);
        let ld = p.kv_stride[2];
        // SAFETY: keys from k0 on of K and V; the regions are disjoint parts of
        // `smem_dkdv(DP)`.
        unsafe {
            let (kh, vh) = (p.k.add(head_row(p.kv_stride, b, hk, 0)), p.v.add(head_row(p.kv_stride, b, hk, 0)));
            copy_tile::<DP, 64>(k_s, p.k.add(kvh), kh, ld, sk.saturating_sub(k0), d, tid);
            if want_dk {
                copy_tile::<DP, 64>(v_s, p.v.add(kvh), vh, ld, sk.saturating_sub(k0), d, tid);
            }
            if steps > 0 {
                copy_q::<DP>(ring, &p, b, hk * group, qb0 * bq, tid);
            }
        }
        prim::cp_async_commit();

        let (i4, j8) = (lane / 8, lane % 8);
        // `a_lane`: K's and V's 16 rows of this warp as `a`; `k_lane`: Q and dO as stored, the
        // `b` of two 8-query tiles; `t_lane`: Q and dO transposed, the `b` of two 8-column tiles.
        let a_lane = 2 * ((warp * 16 + 8 * (i4 % 2) + j8) * rs + 8 * (i4 / 2));
        let k_lane = 2 * ((8 * (i4 / 2) + j8) * rs + 8 * (i4 % 2));
        let t_lane = 2 * ((8 * (i4 % 2) + j8) * rs + 8 * (i4 / 2));

        let mut dk = [[0.0f32; 4]; 32];
        let mut dv = [[0.0f32; 4]; 32];
        let sl2 = p.scale_log2;
        let mut step = 0;
        while step < steps {
            let slot = step % 2;
            if step + 1 < steps {
                let (h1, qb1s) = (hk * group + (step + 1) / nqb, qb0 + (step + 1) % nqb);
                // SAFETY: the other slot, last read before the barrier that ended the previous
                // step.
                unsafe { copy_q::<DP>(ring + (1 - slot) * stage, &p, b, h1, qb1s * bq, tid) };
            }
            prim::cp_async_commit();
            prim::cp_async_wait::<1>();
            prim::sync_threads();
            let qs = ring + slot * stage;
            let dos = qs + 2 * bq * rs;
            let stats = qs + 4 * bq * rs;
            let i0 = (qb0 + step % nqb) * bq;

            // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys and the block's queries.
            let mut s = [[0.0f32; 4]; 8];
            let mut dp = [[0.0f32; 4]; 8];
            unroll!(KS: u32; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
                if KS < DP / 16 && KS * 16 < d {
                    // SAFETY: K's and V's tiles and slot `slot`, complete for every thread since
                    // the barrier.
                    let ka = unsafe { prim::ldmatrix_x4(k_s + a_lane + 32 * KS) };
                    let va = if want_dk { unsafe { prim::ldmatrix_x4(v_s + a_lane + 32 * KS) } } else { [0; 4] };
                    unroll!(NP: u32; 0 1 2 3 => {
                        if NP < bq / 16 {
                            let n = 2 * NP as usize;
                            // SAFETY: as above.
                            let qf = unsafe { prim::ldmatrix_x4(qs + k_lane + 2 * 16 * rs * NP + 32 * KS) };
                            s[n] = I::mma(ka, [qf[0], qf[1]], s[n]);
                            s[n + 1] = I::mma(ka, [qf[2], qf[3]], s[n + 1]);
                            if want_dk {
                                // SAFETY: as above.
                                let df = unsafe { prim::ldmatrix_x4(dos + k_lane + 2 * 16 * rs * NP + 32 * KS) };
                                dp[n] = I::mma(va, [df[0], df[1]], dp[n]);
                                dp[n + 1] = I::mma(va, [df[2], df[3]], dp[n + 1]);
                            }
                        }
                    });
                }
            });

            // P^T into `s` (0 where masked), dS^T into `dp`.
            let masked = i0 < all_from || i0 + bq > all_to;
            unroll!(J: u32; 0 1 2 3 4 5 6 7 => {
                if J < bq / 8 {
                    let c = 8 * J + 2 * t;
                    // SAFETY: the stage's lse2 and delta, 8-byte aligned (c even).
                    let (l2, dl) = unsafe {
                        (prim::ld_shared_v2_b32(stats + 4 * c), prim::ld_shared_v2_b32(stats + 4 * bq + 4 * c))
                    };
                    unroll!(E: u32; 0 1 2 3 => {
                        let (r, e, c1) = ((E / 2) as usize, E as usize, (E % 2) as usize);
                        let query = i0 + c + E % 2;
                        let (from, to) = seen_by[r];
                        let hidden = masked && !(from <= query && query < to);
                        let x = prim::select_f32(hidden, f32::NEG_INFINITY, s[J as usize][e] * sl2);
                        let pv = prim::ex2_approx_ftz(x - f32::from_bits(l2[c1]));
                        s[J as usize][e] = pv;
                        dp[J as usize][e] = pv * (dp[J as usize][e] - f32::from_bits(dl[c1]));
                    });
                }
            });

            // dV += P^T dO and dK += dS^T Q: the weights rounded to the dtype in the A layout,
            // dO and Q read transposed.
            unroll!(KK: usize; 0 1 2 3 => {
                if (KK as u32) < bq / 16 {
                    let pa = [
                        I::pack2(s[2 * KK][0], s[2 * KK][1]),
                        I::pack2(s[2 * KK][2], s[2 * KK][3]),
                        I::pack2(s[2 * KK + 1][0], s[2 * KK + 1][1]),
                        I::pack2(s[2 * KK + 1][2], s[2 * KK + 1][3]),
                    ];
                    let da = [
                        I::pack2(dp[2 * KK][0], dp[2 * KK][1]),
                        I::pack2(dp[2 * KK][2], dp[2 * KK][3]),
                        I::pack2(dp[2 * KK + 1][0], dp[2 * KK + 1][1]),
                        I::pack2(dp[2 * KK + 1][2], dp[2 * KK + 1][3]),
                    ];
                    unroll!(DP2: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 => {
                        if (DP2 as u32) < DP / 16 && (DP2 as u32) * 16 < d {
                            let off = t_lane + 2 * 16 * rs * KK as u32 + 32 * DP2 as u32;
                            if want_dv {
                                // SAFETY: as above.
                                let f = unsafe { prim::ldmatrix_x4_trans(dos + off) };
                                dv[2 * DP2] = I::mma(pa, [f[0], f[1]], dv[2 * DP2]);
                                dv[2 * DP2 + 1] = I::mma(pa, [f[2], f[3]], dv[2 * DP2 + 1]);
                            }
                            if want_dk {
                                // SAFETY: as above.
                                let f = unsafe { prim::ldmatrix_x4_trans(qs + off) };
                                dk[2 * DP2] = I::mma(da, [f[0], f[1]], dk[2 * DP2]);
                                dk[2 * DP2 + 1] = I::mma(da, [f[2], f[3]], dk[2 * DP2 + 1]);
                            }
                        }
                    });
                }
            });
            // Every warp is done with slot `slot` before the next step copies into it.
            prim::sync_threads();
            step += 1;
        }
        prim::cp_async_wait::<0>();

        let scale = p.scale;
        unroll!(R: usize; 0 1 => {
            let key = keys[R];
            if key < sk {
                let at = head_row(p.kv_stride, b, hk, key);
                unroll!(DT: usize; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 => {
                    if (DT as u32) < DP / 8 && (DT as u32) * 8 < d {
                        let col = DT * 8 + 2 * t as usize;
                        // SAFETY: key < seq_k and col + 1 < d: inside dK and dV; 4-byte aligned.
                        unsafe {
                            if want_dk {
                                *(p.dk.add(at + col) as *mut u32) = I::pack2(dk[DT][2 * R] * scale, dk[DT][2 * R + 1] * scale);
                            }
                            if want_dv {
                                *(p.dv.add(at + col) as *mut u32) = I::pack2(dv[DT][2 * R], dv[DT][2 * R + 1]);
                            }
                        }
                    }
                });
            }
        });
    }
}

macro_rules! attention_bwd_kernels {
    (prep { $($pname:ident: $pty:ty;)* } dq { $($qname:ident: $qty:ty, $qdp:literal;)* }
     dkdv { $($kname:ident: $kty:ty, $kdp:literal, $mode:expr;)* }) => {
        $( crate::kernel!($pname: AttentionBwdArgs = |p| device::prep::<$pty>(p)); )*
        $( crate::kernel!($qname: AttentionBwdArgs = |p| device::dq::<$qty, $qdp>(p)); )*
        $( crate::kernel!($kname: AttentionBwdArgs = |p| device::dkdv::<$kty, $kdp, { $mode }>(p)); )*
    };
}

attention_bwd_kernels! {
    prep {
        attention_bwd_prep_bf16: crate::dtype::BF16;
        attention_bwd_prep_f16: crate::dtype::F16;
    }
    dq {
    attention_bwd_dq_d64_bf16: crate::dtype::BF16, 64;
    attention_bwd_dq_d128_bf16: crate::dtype::BF16, 128;
    attention_bwd_dq_d256_bf16: crate::dtype::BF16, 256;
    attention_bwd_dq_d64_f16: crate::dtype::F16, 64;
    attention_bwd_dq_d128_f16: crate::dtype::F16, 128;
    attention_bwd_dq_d256_f16: crate::dtype::F16, 256;
    }
    dkdv {
    attention_bwd_dkdv_d64_bf16: crate::dtype::BF16, 64, mode::BOTH;
    attention_bwd_dkdv_d128_bf16: crate::dtype::BF16, 128, mode::BOTH;
    attention_bwd_dk_d256_bf16: crate::dtype::BF16, 256, mode::DK;
    attention_bwd_dv_d256_bf16: crate::dtype::BF16, 256, mode::DV;
    attention_bwd_dkdv_d64_f16: crate::dtype::F16, 64, mode::BOTH;
    attention_bwd_dkdv_d128_f16: crate::dtype::F16, 128, mode::BOTH;
    attention_bwd_dk_d256_f16: crate::dtype::F16, 256, mode::DK;
    attention_bwd_dv_d256_f16: crate::dtype::F16, 256, mode::DV;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_fits_an_a100_block() {
        for dp in [64, 128, 256] {
            assert!(smem_dq(dp) <= 163 * 1024, "dq {dp}: {}", smem_dq(dp));
            assert!(smem_dkdv(dp) <= 163 * 1024, "dkdv {dp}: {}", smem_dkdv(dp));
        }
        assert_eq!([smem_dkdv(64), smem_dkdv(128), smem_dkdv(256)], [56320, 70144, 135680]);
        assert_eq!(core::mem::size_of::<AttnBwdParams>(), 192);
    }

    #[test]
    fn the_kernels_cover_every_dtype_and_dim() {
        for dt in [crate::DType::BF16, crate::DType::F16] {
            for dp in [64, 128, 256] {
                let k = bwd_kernels(dt, dp).unwrap();
                assert_eq!(k.dkdv.iter().flatten().count(), if dp == 256 { 2 } else { 1 });
            }
            assert!(bwd_kernels(dt, 96).is_none());
        }
        assert!(bwd_kernels(crate::DType::F32, 64).is_none());
    }
}
