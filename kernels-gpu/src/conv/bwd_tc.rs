//! The tensor-core backward's device code (see the parent module for the design):
//! `gemm_tc`'s main loop over gathered operands, backward-data ([`dgrad_tc`]) and
//! backward-weight ([`wgrad_tc`]).

use super::{ConvGeom, Walk, dst_padded};
use crate::prim::*;

/// The warp's accumulators of a 128 x 128 tile: 4 x 4 tiles of 16 x 8, 4 values each.
type Acc = [[[f32; 4]; 4]; 4];

/// `gemm_tc`'s main loop for the backward kernels: `stages` stages of `BK` reduction steps,
/// `copy(k0, slot)` starting the copies of the stage whose first reduction index is `k0`
/// (A at `slot`, B at `slot + OPERAND_BYTES`). `KA` (`KB`): A's (B's) rows run along the
/// reduction (`[r][k]`, read as stored), else `[k][r]` (read transposed).
///
/// # Safety
/// `copy` must write only its stage's slot, 16-byte chunks at `gemm_tc`'s offsets; the block
/// has `SMEM_BYTES` of dynamic shared memory and `THREADS` threads.
#[inline(always)]
unsafe fn tc_loop<I: crate::gemm_tc::InType, const KA: bool, const KB: bool>(
    stages: u32,
    mut copy: impl FnMut(u32, u32),
) -> Acc {
    use crate::gemm_tc::device::{lane_offset, ldsm};
    use crate::gemm_tc::{BK, OPERAND_BYTES, SK, SR, STAGE_BYTES, STAGES};
    let lane = thread_idx_x() % 32;
    let (wm, wn) = (thread_idx_x() / 32 / 4, thread_idx_x() / 32 % 4);
    let smem = dyn_smem_addr();
    // One commit per slot even when empty, so that the wait counts the same groups.
    for s in 0..STAGES - 1 {
        if s < stages {
            copy(s * BK, smem + s * STAGE_BYTES);
        }
        cp_async_commit();
    }
    let (i, j) = (lane / 8, lane % 8);
    let a_lane = lane_offset::<KA>(wm * 64, 8 * (i % 2), 8 * (i / 2), j);
    let b_lane = OPERAND_BYTES + lane_offset::<KB>(wn * 32, 8 * (i / 2), 8 * (i % 2), j);
    let r16 = |kc: bool| 2 * if kc { 16 * SK } else { 16 };
    let k16 = |kc: bool| 2 * if kc { 16 } else { 16 * SR };

    let mut acc: Acc = [[[0.0f32; 4]; 4]; 4];
    let (mut cur, mut next) = (0u32, STAGES - 1);
    for s in 0..stages {
        cp_async_wait::<{ STAGES - 2 }>();
        sync_threads();
        let ls = s + STAGES - 1;
        if ls < stages {
            // Slot `next` was last read in stage s - 1, before the barrier.
            copy(ls * BK, smem + next * STAGE_BYTES);
        }
        cp_async_commit();

        let base = smem + cur * STAGE_BYTES;
        unroll!(KS: u32; 0 1 => {
            let mut bf = [[0u32; 2]; 4];
            unroll!(NP: u32; 0 1 => {
                // SAFETY: inside slot `cur`, complete for every thread since the barrier.
                let v = unsafe { ldsm::<KB>(base + b_lane + NP * r16(KB) + KS * k16(KB)) };
                bf[2 * NP as usize] = [v[0], v[1]];
                bf[2 * NP as usize + 1] = [v[2], v[3]];
            });
            unroll!(MI: u32; 0 1 2 3 => {
                // SAFETY: as above.
                let af = unsafe { ldsm::<KA>(base + a_lane + MI * r16(KA) + KS * k16(KA)) };
                unroll!(NI: usize; 0 1 2 3 => {
                    acc[MI as usize][NI] = I::mma(af, bf[NI], acc[MI as usize][NI]);
                });
            });
        });
        cur = if cur + 1 == STAGES { 0 } else { cur + 1 };
        next = if next + 1 == STAGES { 0 } else { next + 1 };
    }
    acc
}

/// Stores the block's tile `(m0, n0)` of D (`m x n`, row stride `ld`, `n` even, `d` aligned
/// to a pair) from the warps' accumulators, a pair of columns at a time.
///
/// # Safety
/// `d` holds `m x n` elements of `O` at row stride `ld`.
#[inline(always)]
unsafe fn tc_store<O: crate::gemm_epilogue::OutType>(acc: &Acc, d: *mut u8, ld: u64, m: u32, n: u32, m0: u32, n0: u32) {
    let (warp, lane) = (thread_idx_x() / 32, thread_idx_x() % 32);
    let (wm, wn, gr, t) = (warp / 4, warp % 4, lane / 4, lane % 4);
    unroll!(MI: u32; 0 1 2 3 => {
        unroll!(H: u32; 0 1 => {
            let row = m0 + wm * 64 + MI * 16 + gr + 8 * H;
            unroll!(NI: u32; 0 1 2 3 => {
                let col = n0 + wn * 32 + NI * 8 + 2 * t;
                let v = acc[MI as usize][NI as usize];
                if row < m && col < n {
                    // SAFETY: row < m and col + 1 < n (both even): inside D, pair-aligned.
                    unsafe {
                        let p = d.add((row as u64 * ld + col as u64) as usize * O::DTYPE.size());
                        O::store2(p, [v[2 * H as usize], v[2 * H as usize + 1]]);
                    }
                }
            });
        });
    });
}

/// Backward-data's A for one thread: 2 chunks a stage of the row `(n, h, w)` of dx, each 8
/// filters `k..k + 8` of one tap `(r, s)`, gathered from `dy[n, p, q, k..k + 8]` where the
/// tap reads `(h, w)` from an output position, zero-filled where it does not.
struct DyLoader {
    /// `dy[n]`, or null for a row past `N H W`.
    img: [*const u16; 2],
    /// The row's `h + pad_h`.
    hp: [u32; 2],
    /// The row's `w + pad_w`.
    wp: [u32; 2],
    /// The chunk's next tap and filter `(r, s, k)`.
    tap: [Walk; 2],
    /// The chunk's reduction offset in a stage.
    kk: [u32; 2],
    /// Byte offset in the operand's slot.
    soff: [u32; 2],
    /// A valid address for a copy of 0 bytes.
    origin: *const u16,
}

impl DyLoader {
    #[inline(always)]
    fn new(g: &ConvGeom, dy: *const u16, m0: u32, tid: u32) -> Self {
        use crate::gemm_tc::{BK, SK, THREADS};
        let mut l = DyLoader {
            img: [core::ptr::null(); 2],
            hp: [0; 2],
            wp: [0; 2],
            tap: [Walk::default(); 2],
            kk: [0; 2],
            soff: [0; 2],
            origin: dy,
        };
        let rows = g.n as u64 * g.h as u64 * g.w as u64;
        let img = g.p as u64 * g.q as u64 * g.k as u64;
        unroll!(I: usize; 0 1 => {
            let ch = tid + I as u32 * THREADS;
            let (row, kk) = (ch / (BK / 8), 8 * (ch % (BK / 8)));
            let m = m0 + row;
            if (m as u64) < rows {
                let pos = Walk::at(m, g.h, g.w);
                // SAFETY: address arithmetic inside dy (n < N).
                l.img[I] = unsafe { dy.add((pos.a as u64 * img) as usize) };
                l.hp[I] = pos.b + g.pad_h;
                l.wp[I] = pos.c + g.pad_w;
            }
            l.tap[I] = Walk::at(kk, g.s, g.k);
            l.kk[I] = kk;
            l.soff[I] = 2 * (row * SK + kk);
        });
        l
    }

    /// Starts the copies of the stage whose first reduction index is `k0` into `slot`, then
    /// moves every chunk on by a stage.
    #[inline(always)]
    unsafe fn copy(&mut self, g: &ConvGeom, k0: u32, slot: u32) {
        let red = g.r * g.s * g.k;
        unroll!(I: usize; 0 1 => {
            let t = self.tap[I];
            let mut src = self.origin;
            let mut bytes = 0;
            if !self.img[I].is_null() && k0 + self.kk[I] < red {
                let p = dst_padded(self.hp[I], t.a, g.stride_h, g.dil_h, g.p);
                let q = dst_padded(self.wp[I], t.b, g.stride_w, g.dil_w, g.q);
                if let (Some(p), Some(q)) = (p, q) {
                    let off = g.dy_offset(p, q, t.c);
                    // SAFETY: address arithmetic inside dy[n] (p < P, q < Q, k + 8 <= K).
                    src = unsafe { self.img[I].add(off as usize) };
                    bytes = 16;
                }
            }
            // SAFETY: `src` holds 16 readable bytes when `bytes` is 16 (K % 8 == 0 and k % 8
            // == 0: 8 filters of one pixel, 16-byte aligned as dy's base); the destination
            // is the chunk's 16 bytes of the slot, which no thread reads until the barrier
            // after this copy's group has been waited for.
            unsafe { cp_async_16(slot + self.soff[I], src as *const f32, bytes) };
            self.tap[I].advance(crate::gemm_tc::BK, g.s, g.k);
        });
    }
}

/// Backward-data's B for one thread: 2 chunks a stage, reduction rows `(r, s, k)` and 8
/// columns `c..c + 8` (the same for both), read from the filter's `w[k, r, s, c..c + 8]`.
struct WtLoader {
    /// `w + c`, the chunk's column.
    base: *const u16,
    /// Whether the columns are inside C.
    col_in: bool,
    /// The chunk's next reduction row `(r, s, k)`.
    tap: [Walk; 2],
    /// The chunk's reduction offset in a stage.
    kr: [u32; 2],
    /// Byte offset in the operand's slot.
    soff: [u32; 2],
    /// A valid address for a copy of 0 bytes.
    origin: *const u16,
}

impl WtLoader {
    #[inline(always)]
    fn new(g: &ConvGeom, w: *const u16, n0: u32, tid: u32) -> Self {
        use crate::gemm_tc::{BM, SR, THREADS};
        let col = 8 * (tid % (BM / 8));
        let mut l = WtLoader {
            // SAFETY: address arithmetic; copies check the column.
            base: unsafe { w.add((n0 + col) as usize) },
            col_in: n0 + col < g.c,
            tap: [Walk::default(); 2],
            kr: [0; 2],
            soff: [0; 2],
            origin: w,
        };
        unroll!(I: usize; 0 1 => {
            let kr = (tid + I as u32 * THREADS) / (BM / 8);
            l.tap[I] = Walk::at(kr, g.s, g.k);
            l.kr[I] = kr;
            l.soff[I] = 2 * (kr * SR + col);
        });
        l
    }

    /// As [`DyLoader::copy`].
    #[inline(always)]
    unsafe fn copy(&mut self, g: &ConvGeom, k0: u32, slot: u32) {
        let red = g.r * g.s * g.k;
        unroll!(I: usize; 0 1 => {
            let t = self.tap[I];
            let inside = self.col_in && k0 + self.kr[I] < red;
            let src = if inside {
                let off = g.dgrad_w_offset(t);
                // SAFETY: address arithmetic inside w (k < K, r < R, s < S, c + 8 <= C).
                unsafe { self.base.add(off as usize) }
            } else {
                self.origin
            };
            // SAFETY: as in `DyLoader::copy` (C % 8 == 0, c % 8 == 0: 16 aligned bytes of one
            // filter tap).
            unsafe { cp_async_16(slot + self.soff[I], src as *const f32, if inside { 16 } else { 0 }) };
            self.tap[I].advance(crate::gemm_tc::BK, g.s, g.k);
        });
    }
}

/// See [`super::ConvDgradTcArgs`]: `dX[N H W, C] = A[N H W, R S K] @ B[R S K, C]`, A gathered from
/// dy by [`DyLoader`] (rows along the reduction), B the filter by [`WtLoader`] (`[k][c]`).
#[inline(always)]
pub unsafe fn dgrad_tc<I: crate::gemm_tc::InType + crate::gemm_epilogue::OutType>(
    g: ConvGeom,
    dy: *const u16,
    w: *const u16,
    dx: *mut u16,
) {
    use crate::gemm_tc::{BK, BM, BN, OPERAND_BYTES};
    let tid = thread_idx_x();
    let (m0, n0) = (block_idx_x() * BM, block_idx_y() * BN);
    let mut la = DyLoader::new(&g, dy, m0, tid);
    let mut lb = WtLoader::new(&g, w, n0, tid);
    let stages = (g.r * g.s * g.k).div_ceil(BK);
    // SAFETY: the loaders write their chunks of the slot they are given (the contract of
    // `tc_loop`); the launch has its block size and shared memory.
    let acc = unsafe {
        tc_loop::<I, true, false>(stages, |k0, slot| {
            la.copy(&g, k0, slot);
            lb.copy(&g, k0, slot + OPERAND_BYTES);
        })
    };
    // The host keeps N H W (plus a tile) below 2^32.
    let m = (g.n as u64 * g.h as u64 * g.w as u64) as u32;
    // SAFETY: dx is [N, H, W, C], C even, 16-byte aligned.
    unsafe { tc_store::<I>(&acc, dx as *mut u8, g.c as u64, m, g.c, m0, n0) };
}

/// Backward-weight's B for one thread: 2 chunks a stage, rows `(n, p, q)` of the chunk of `N
/// P Q` and 8 columns `(r, s, c..c + 8)` (the same for both), read from `x[n, p stride - pad
/// + r dil, ..., c..c + 8]` where inside the input, zero-filled on the padding and past the
/// chunk's end.
struct XLoader {
    /// `x + c`, the columns' channel.
    base: *const u16,
    /// Whether the columns are inside `R S C`.
    col_in: bool,
    /// The columns' `r dil_h - pad_h` and `s dil_w - pad_w`.
    dh: i64,
    /// See `dh`.
    dw: i64,
    /// The chunk's next row `(n, p, q)`.
    pos: [Walk; 2],
    /// Its flat index.
    i: [u32; 2],
    /// The chunk of terms' end.
    end: u32,
    /// Byte offset in the operand's slot.
    soff: [u32; 2],
    /// A valid address for a copy of 0 bytes.
    origin: *const u16,
}

impl XLoader {
    #[inline(always)]
    fn new(g: &ConvGeom, x: *const u16, start: u32, end: u32, n0: u32, tid: u32) -> Self {
        use crate::gemm_tc::{BM, SR, THREADS};
        let col = 8 * (tid % (BM / 8));
        let j = n0 + col;
        let rsc = g.r * g.s * g.c;
        let tap = Walk::at(if j < rsc { j } else { 0 }, g.s, g.c);
        let mut l = XLoader {
            // SAFETY: address arithmetic; copies check the column.
            base: unsafe { x.add(tap.c as usize) },
            col_in: j < rsc,
            dh: tap.a as i64 * g.dil_h as i64 - g.pad_h as i64,
            dw: tap.b as i64 * g.dil_w as i64 - g.pad_w as i64,
            pos: [Walk::default(); 2],
            i: [0; 2],
            end,
            soff: [0; 2],
            origin: x,
        };
        unroll!(I: usize; 0 1 => {
            let kr = (tid + I as u32 * THREADS) / (BM / 8);
            l.i[I] = start + kr;
            l.pos[I] = Walk::at(start + kr, g.p, g.q);
            l.soff[I] = 2 * (kr * SR + col);
        });
        l
    }

    /// Starts the copies of the next stage into `slot`, then moves every chunk on by a stage.
    #[inline(always)]
    unsafe fn copy(&mut self, g: &ConvGeom, slot: u32) {
        unroll!(I: usize; 0 1 => {
            let off = if self.col_in && self.i[I] < self.end {
                g.wgrad_x_offset(self.pos[I], self.dh, self.dw)
            } else {
                None
            };
            let src = match off {
                // SAFETY: address arithmetic inside x (n < N as the row is below N P Q, h < H,
                // w < W, c + 8 <= C).
                Some(off) => unsafe { self.base.add(off as usize) },
                None => self.origin,
            };
            // SAFETY: as in `DyLoader::copy` (C % 8 == 0, c % 8 == 0: 16 aligned bytes of one
            // pixel).
            unsafe { cp_async_16(slot + self.soff[I], src as *const f32, if off.is_some() { 16 } else { 0 }) };
            self.i[I] += crate::gemm_tc::BK;
            self.pos[I].advance(crate::gemm_tc::BK, g.p, g.q);
        });
    }
}

/// See [`super::ConvWgradTcArgs`]: one chunk's `dW[K, R S C] = A[K, terms] @ B[terms, R S C]`, A
/// = dy read as the `[terms][K]` matrix (`gemm_tc`'s loader, rows along M), B gathered from
/// x by [`XLoader`].
#[inline(always)]
pub unsafe fn wgrad_tc<I: crate::gemm_tc::InType>(
    g: ConvGeom,
    x: *const u16,
    dy: *const u16,
    part: *mut f32,
    chunk_len: u32,
) {
    use crate::gemm_tc::device::Loader;
    use crate::gemm_tc::{BK, BM, BN, OPERAND_BYTES};
    let tid = thread_idx_x();
    let (m0, n0, j) = (block_idx_y() * BM, block_idx_x() * BN, block_idx_z());
    // The host keeps N P Q (plus a tile) below 2^32 and starts every chunk inside it.
    let npq = g.npq() as u32;
    let start = j * chunk_len;
    let len = if npq - start < chunk_len { npq - start } else { chunk_len };
    // SAFETY: address arithmetic inside dy (row `start` < N P Q, column m0 < K); the loader
    // checks the rows (K - m0 left) and the terms.
    let mut la = unsafe {
        Loader::<false>::new(dy.add(start as usize * g.k as usize + m0 as usize), g.k as u64, g.k - m0, true, tid)
    };
    let mut lb = XLoader::new(&g, x, start, start + len, n0, tid);
    // SAFETY: as in `dgrad_tc`.
    let acc = unsafe {
        tc_loop::<I, false, false>(len.div_ceil(BK), |k0, slot| {
            la.copy(len - k0, slot);
            lb.copy(&g, slot + OPERAND_BYTES);
        })
    };
    let rsc = g.r * g.s * g.c;
    // SAFETY: part holds `chunks` slices of K R S C floats (`R S C` even), chunk j < chunks.
    unsafe {
        let d = part.add(j as usize * g.k as usize * rsc as usize);
        tc_store::<f32>(&acc, d as *mut u8, rsc as u64, g.k, rsc, m0, n0);
    }
}
