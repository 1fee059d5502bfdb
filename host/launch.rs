//! Launch geometry: pure functions of the problem size and the GPU, tested on the CPU. Internal
//! to the crate; each is total (no input panics: `no_input_panics` below checks them all).

use crate::device::LaunchConfig;
use crate::error::{Error, Result};
use kernels_gpu::elementwise::{BLOCK, CHUNK_BLOCK, COL_BLOCK_X, COL_BLOCK_Y, half_vectors, small_block};
use kernels_gpu::glu::GLU_BLOCK;

/// Grid for an element-wise kernel over `n` elements moved `vec` at a time, `unroll` vectors
/// per thread per round of its grid-stride loop, on a GPU with `sm_count` SMs holding
/// `blocks_per_sm` resident blocks of the kernel each. `None` when there is nothing to do.
///
/// Large tensors: one round per thread (`nv / unroll` threads). Measured on the H100 (see
/// docs/worklog.md, 2026-11-22), this reaches PyTorch's bandwidth where a single wave of resident
/// blocks looping over the tensor stays below it. Tensors smaller than one wave: one vector per
/// thread instead, spreading the few loads over as many SMs as possible, since there the time
/// is the latency of one pass, not bandwidth. Never fewer threads than tail elements. A `vec`
/// or `unroll` of 0 counts as 1.
pub fn elementwise(n: u64, vec: u64, unroll: u64, sm_count: u32, blocks_per_sm: u32) -> Option<LaunchConfig> {
    if n == 0 {
        return None;
    }
    let (vec, unroll) = (vec.max(1), unroll.max(1));
    let nv = n / vec;
    let sms = sm_count.max(1) as u64;
    let wave = sms.saturating_mul(blocks_per_sm.max(1) as u64).saturating_mul(BLOCK as u64);
    let threads = if nv.div_ceil(unroll) >= wave { nv.div_ceil(unroll) } else { nv.min(wave) };
    let threads = threads.max(n % vec).max(1);
    // Below a wave, smaller blocks (down to one warp) put the work on every SM rather than on
    // a few full ones: 2^16 f32 elements are 128 blocks of 128 threads instead of 64 of 256.
    // (Capped before rounding up to a warp, which BLOCK is a multiple of: no overflow.)
    let block = if threads >= wave {
        BLOCK as u64
    } else {
        threads.div_ceil(sms).min(BLOCK as u64).next_multiple_of(32).max(32)
    };
    let grid = threads.div_ceil(block).min(i32::MAX as u64) as u32;
    Some(LaunchConfig { grid: (grid, 1, 1), block: (block as u32, 1, 1), shared_bytes: 0 })
}

/// Grid of a small launch of the unary and binary ops on `dt` (their `_small` entries: one 8-byte
/// half vector a thread, no loop), where even one half vector a thread stays within one wave of
/// their other kernels' `resident` threads (SMs times resident [`CHUNK_BLOCK`]-thread blocks times
/// `CHUNK_BLOCK`); `None` above that, and for `n = 0`. A thread for every half vector and every
/// tail element, in blocks of [`small_block`] threads (a constant of those kernels). At this size
/// a launch is the latency of one pass, which twice the threads with half the math each shorten
/// (2^16 f32: 64 blocks of 512 threads, two elements each; bf16: 128 blocks of 128, four each).
/// Also `None` past the grid's 2^31 - 1 blocks (a `resident` no GPU has).
pub fn elementwise_small(n: u64, dt: kernels_gpu::DType, resident: u64) -> Option<LaunchConfig> {
    let vec = (16 / dt.size()) as u64;
    let halves = half_vectors(n, vec);
    if n == 0 || halves > resident {
        return None;
    }
    let threads = halves.max(n - halves * (vec / 2));
    let block = small_block(dt);
    let grid = u32::try_from(threads.div_ceil(block as u64)).ok().filter(|&g| g <= i32::MAX as u32)?;
    Some(LaunchConfig { grid: (grid, 1, 1), block: (block, 1, 1), shared_bytes: 0 })
}

/// Grid of the unary and binary kernels above the small launches (`per_thread` vectors of `vec`
/// elements a thread, no loop; `kernels_gpu::elementwise::chunk`): a [`CHUNK_BLOCK`]-thread block
/// for every `per_thread * CHUNK_BLOCK` vectors, and at least one for the tail. `None` for
/// `n = 0`; an error (naming `op`) where that would pass the grid's 2^31 - 1 blocks (2^40 f32
/// elements, more than any GPU holds). A `vec` of 0 counts as 1.
pub fn elementwise_chunks(op: &'static str, n: u64, vec: u64, per_thread: u64) -> Result<Option<LaunchConfig>> {
    if n == 0 {
        return Ok(None);
    }
    let (b, vec) = (CHUNK_BLOCK as u64, vec.max(1));
    let blocks = (n / vec).div_ceil(per_thread.max(1).saturating_mul(b)).max((n % vec).div_ceil(b));
    let grid = u32::try_from(blocks).ok().filter(|&g| g <= i32::MAX as u32).ok_or_else(|| Error::InvalidArgument {
        op,
        message: format!("{n} elements need {blocks} blocks of {per_thread} x {b} vectors, past the grid's 2^31 - 1"),
    })?;
    Ok(Some(LaunchConfig { grid: (grid, 1, 1), block: (CHUNK_BLOCK, 1, 1), shared_bytes: 0 }))
}

/// Grid of a column-reduction kernel over a `rows x cols` matrix: `32 x 8` blocks, `grid.x`
/// tiles of 32 columns, `grid.y` chunks of rows, each chunk summed into its own row of the
/// partial-sum buffer. Chunks are chosen to fill four waves of resident blocks, and never more
/// than there are 8-row groups. Returns the config and the number of chunks; `None` if `rows` or
/// `cols` is 0.
pub fn col_reduce(rows: u64, cols: u64, sm_count: u32, blocks_per_sm: u32) -> Option<(LaunchConfig, u32)> {
    if rows == 0 || cols == 0 {
        return None;
    }
    let gx = cols.div_ceil(COL_BLOCK_X as u64);
    // Four waves of resident blocks: each thread's loop over its rows is a chain of dependent
    // loads and adds, so more, shorter chains keep more bytes in flight.
    let blocks = (4 * sm_count.max(1) as u64).saturating_mul(blocks_per_sm.max(1) as u64);
    let chunks = blocks.div_ceil(gx).clamp(1, rows.div_ceil(COL_BLOCK_Y as u64)).min(65_535) as u32;
    let smem = 2 * COL_BLOCK_X * COL_BLOCK_Y * 4;
    Some((
        LaunchConfig { grid: (gx as u32, chunks, 1), block: (COL_BLOCK_X, COL_BLOCK_Y, 1), shared_bytes: smem },
        chunks,
    ))
}

/// Grid of the gated kernels over `rows` rows of `cols` outputs, `vec` elements a 16-byte vector
/// (`kernels_gpu::glu`): [`GLU_BLOCK`]-thread blocks of `bx` vectors of a row by `GLU_BLOCK / bx`
/// rows, `bx` a power of two from 32 (or the row's vectors, if fewer) to 256 leaving the fewest
/// threads past the row's end; a thread for every vector of a row in x, and in y one for every row
/// up to 65535 blocks (the kernel loops over the rest). `None` where there is nothing to do; an
/// error (naming `op`) past the grid's 2^31 - 1 blocks in x. A `vec` of 0 counts as 1.
pub fn glu(op: &'static str, rows: u64, cols: u64, vec: u64) -> Result<Option<LaunchConfig>> {
    if rows == 0 || cols == 0 {
        return Ok(None);
    }
    let q = cols.div_ceil(vec.max(1));
    let smallest = q.min(32).next_power_of_two();
    let waste = |bx: u64| (bx - q % bx) % bx;
    let mut bx = smallest;
    let mut cand = smallest;
    while cand <= GLU_BLOCK as u64 {
        if waste(cand) <= waste(bx) {
            bx = cand;
        }
        cand *= 2;
    }
    let gx = q.div_ceil(bx);
    let gx = u32::try_from(gx).ok().filter(|&g| g <= i32::MAX as u32).ok_or_else(|| Error::InvalidArgument {
        op,
        message: format!("rows of {cols} elements need {gx} blocks of {bx} vectors, past the grid's 2^31 - 1"),
    })?;
    let by = GLU_BLOCK as u64 / bx;
    let gy = rows.div_ceil(by).min(65_535) as u32;
    Ok(Some(LaunchConfig { grid: (gx, gy, 1), block: (bx as u32, by as u32, 1), shared_bytes: 0 }))
}

/// One thread per item, 256-thread blocks (for the small finishing kernels).
pub fn one_per_thread(n: u64) -> Option<LaunchConfig> {
    if n == 0 {
        return None;
    }
    Some(LaunchConfig { grid: (n.div_ceil(BLOCK as u64) as u32, 1, 1), block: (BLOCK, 1, 1), shared_bytes: 0 })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Any u64, with the edges (0, 1, the maximum) and small values drawn often.
    pub(crate) fn any_u64() -> impl Strategy<Value = u64> {
        prop_oneof![Just(0u64), Just(1), Just(u64::MAX), 0..1u64 << 12, any::<u64>()]
    }
    /// Any u32, as [`any_u64`].
    pub(crate) fn any_u32() -> impl Strategy<Value = u32> {
        prop_oneof![Just(0u32), Just(1), Just(u32::MAX), 0..1u32 << 12, any::<u32>()]
    }

    proptest! {
        /// Every planning function is total: no input overflows or divides by zero (the tests
        /// build with overflow checks). Where a launch comes back, it covers its elements.
        #[test]
        fn no_input_panics(
            n in any_u64(),
            a in any_u64(),
            b in any_u64(),
            s in any_u32(),
            t in any_u32(),
        ) {
            if let Some(c) = elementwise(n, a, b, s, t) {
                prop_assert!(c.grid.0 >= 1 && (32..=BLOCK).contains(&c.block.0));
            }
            for dt in kernels_gpu::DType::ALL {
                let _ = elementwise_small(n, dt, a);
            }
            let _ = elementwise_chunks("t", n, a, b);
            let _ = col_reduce(n, a, s, t);
            let _ = one_per_thread(n);
            if let Ok(Some(c)) = glu("t", n, a, b) {
                prop_assert!(c.block.0 * c.block.1 == GLU_BLOCK && c.grid.0 >= 1 && (1..=65_535).contains(&c.grid.1));
            }
        }
    }

    #[test]
    fn glu_covers_every_row_and_vector() {
        assert_eq!(glu("t", 0, 8, 8).unwrap(), None);
        assert_eq!(glu("t", 8, 0, 8).unwrap(), None);
        for rows in [1u64, 3, 8, 255, 4096, 1 << 20] {
            for cols in [1u64, 3, 7, 8, 9, 31, 64, 1000, 5504, 11008, 14336, 1 << 24] {
                for vec in [4u64, 8] {
                    let c = glu("t", rows, cols, vec).unwrap().unwrap();
                    let (bx, by) = (c.block.0 as u64, c.block.1 as u64);
                    assert_eq!(bx * by, GLU_BLOCK as u64);
                    let q = cols.div_ceil(vec);
                    assert!(c.grid.0 as u64 * bx >= q && (c.grid.0 as u64 - 1) * bx < q, "rows={rows} cols={cols}");
                    assert!(c.grid.1 as u64 * by >= rows || c.grid.1 == 65_535, "rows={rows} cols={cols}");
                    // A warp reads whole vectors of one row where the row has 32 of them.
                    assert!(bx >= q.min(32), "rows={rows} cols={cols}: {bx}");
                }
            }
        }
        // LLM shapes leave no thread idle: 11008 bf16 columns are 1376 vectors, 43 warps.
        assert_eq!(glu("t", 8192, 11008, 8).unwrap().unwrap().block, (32, 8, 1));
    }

    #[test]
    fn degenerate_inputs_are_no_launch() {
        // A vector or unroll of 0 is taken as 1, not divided by.
        assert_eq!(elementwise(5, 0, 0, 132, 8), elementwise(5, 1, 1, 132, 8));
    }

    #[test]
    fn elementwise_covers_every_element() {
        assert_eq!(elementwise(0, 4, 4, 132, 8), None);
        let wave = 132 * 8 * 256;
        for n in [1u64, 3, 4, 5, 1023, 1024, 1025, 1 << 16, 1 << 20, 1 << 28, (1 << 31) + 7, 1 << 36] {
            for vec in [1u64, 4, 8] {
                for unroll in [1u64, 4] {
                    let c = elementwise(n, vec, unroll, 132, 8).unwrap();
                    let threads = c.grid.0 as u64 * c.block.0 as u64;
                    let nv = n / vec;
                    // Every tail element has a thread; one round covers every vector unless the
                    // grid hit its limit (then the grid-stride loop does).
                    assert!(threads >= n % vec, "n={n} vec={vec}");
                    assert!(threads * unroll >= nv || c.grid.0 == i32::MAX as u32, "n={n} vec={vec} unroll={unroll}");
                    // Small tensors: one vector per thread, up to a wave, in blocks of at least
                    // a warp that spread over the SMs.
                    if nv <= wave {
                        assert!(threads >= nv && threads < nv.max(n % vec).max(1) + 256);
                        assert!(c.block.0.is_multiple_of(32) && (32..=256).contains(&c.block.0));
                        assert!(c.grid.0 as u64 >= (nv / 256).min(132), "n={n} vec={vec}: grid {:?}", c.grid);
                    }
                }
            }
        }
    }

    #[test]
    fn elementwise_small_below_a_wave() {
        let wave = 132 * 16 * 128;
        assert_eq!(elementwise_small(0, kernels_gpu::DType::F32, wave), None);
        for n in [
            1u64,
            2,
            3,
            5,
            7,
            8,
            9,
            1023,
            1 << 16,
            (1 << 16) + 3,
            2 * wave - 1,
            2 * wave,
            2 * wave + 2,
            1 << 20,
            1 << 28,
        ] {
            for dt in kernels_gpu::DType::ALL {
                let vec = (16 / dt.size()) as u64;
                let halves = n / (vec / 2);
                match elementwise_small(n, dt, wave) {
                    Some(c) => {
                        // A thread for every half vector and every tail element, none idle past
                        // the last block's rounding.
                        let threads = c.grid.0 as u64 * c.block.0 as u64;
                        let need = halves.max(n % (vec / 2));
                        assert!(halves <= wave, "n={n} {dt:?}");
                        assert!(threads >= need && threads < need + small_block(dt) as u64, "n={n} {dt:?}");
                        assert_eq!(c.block, (small_block(dt), 1, 1));
                    }
                    // Larger: the chunk kernel.
                    None => assert!(halves > wave, "n={n} {dt:?}"),
                }
            }
        }
        // 2^16 on an H100: f32 64 blocks of 512 threads, two elements each; bf16 128 of 128, four.
        assert_eq!(elementwise_small(1 << 16, kernels_gpu::DType::F32, wave).unwrap().grid, (64, 1, 1));
        assert_eq!(elementwise_small(1 << 16, kernels_gpu::DType::BF16, wave).unwrap().grid, (128, 1, 1));
    }

    #[test]
    fn elementwise_chunks_cover_every_element() {
        assert_eq!(elementwise_chunks("t", 0, 4, 1).unwrap(), None);
        let b = CHUNK_BLOCK as u64;
        for n in
            [1u64, 3, 4, 5, 7, 8, 9, 511, 512, 513, 2047, 2048, 2049, 1 << 20, (1 << 20) + 7, (1 << 31) + 7, 1 << 36]
        {
            for vec in [4u64, 8] {
                for k in [1u64, 2, 4] {
                    let c = elementwise_chunks("t", n, vec, k).unwrap().unwrap();
                    assert_eq!(c.block, (CHUNK_BLOCK, 1, 1));
                    let threads = c.grid.0 as u64 * b;
                    // `k` vectors for every thread and a thread for every tail element, less
                    // than a block idle.
                    let nv = n / vec;
                    assert!(threads * k >= nv && threads >= n % vec, "n={n} vec={vec} k={k}");
                    assert!(threads < (nv.div_ceil(k)).max(n % vec) + b, "n={n} vec={vec} k={k}");
                }
            }
        }
        // Past the grid's limit: an error that names the call, not a launch that skips elements.
        let e = elementwise_chunks("unary_out", 1 << 41, 4, 1).unwrap_err();
        assert!(e.to_string().starts_with("unary_out: "), "{e}");
        assert!(elementwise_chunks("t", (i32::MAX as u64) * b * 4, 4, 1).is_ok());
    }

    #[test]
    fn col_reduce_shapes() {
        assert_eq!(col_reduce(0, 5, 132, 8), None);
        assert_eq!(col_reduce(5, 0, 132, 8), None);
        let (c, chunks) = col_reduce(1, 1, 132, 8).unwrap();
        assert_eq!((c.grid, chunks), ((1, 1, 1), 1));
        let (c, chunks) = col_reduce(1 << 20, 4096, 132, 8).unwrap();
        assert_eq!(c.grid.0, 128);
        assert_eq!(c.grid.1, chunks);
        assert!(chunks as u64 * 128 >= 4 * 132 * 8);
        let (_, chunks) = col_reduce(17, 3, 132, 8).unwrap();
        assert_eq!(chunks, 3); // ceil(17 / 8) row groups at most
    }
}
