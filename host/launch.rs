//! Launch geometry: pure functions of the problem size and the GPU, tested on the CPU.

use crate::device::LaunchConfig;
use kernels_gpu::elementwise::{BLOCK, COL_BLOCK_X, COL_BLOCK_Y};

/// Grid for an element-wise kernel over `n` elements moved `vec` at a time, `unroll` vectors
/// per thread per round of its grid-stride loop, on a GPU with `sm_count` SMs holding
/// `blocks_per_sm` resident blocks of the kernel each. `None` when there is nothing to do.
///
/// Large tensors: one round per thread (`nv / unroll` threads). Measured on the H100 (see
/// benches/NOTES.md), this reaches PyTorch's bandwidth where a single wave of resident blocks
/// looping over the tensor stays ~5% below it. Tensors smaller than one wave: one vector per
/// thread instead, spreading the few loads over as many SMs as possible, since there the time
/// is the latency of one pass, not bandwidth. Never fewer threads than tail elements.
pub fn elementwise(n: u64, vec: u64, unroll: u64, sm_count: u32, blocks_per_sm: u32) -> Option<LaunchConfig> {
    if n == 0 {
        return None;
    }
    let nv = n / vec;
    let sms = sm_count.max(1) as u64;
    let wave = sms * blocks_per_sm.max(1) as u64 * BLOCK as u64;
    let threads = if nv.div_ceil(unroll) >= wave { nv.div_ceil(unroll) } else { nv.min(wave) };
    let threads = threads.max(n % vec).max(1);
    // Below a wave, smaller blocks (down to one warp) put the work on every SM rather than on
    // a few full ones: 2^16 f32 elements are 128 blocks of 128 threads instead of 64 of 256.
    let block =
        if threads >= wave { BLOCK as u64 } else { threads.div_ceil(sms).next_multiple_of(32).clamp(32, BLOCK as u64) };
    let grid = threads.div_ceil(block).min(i32::MAX as u64) as u32;
    Some(LaunchConfig { grid: (grid, 1, 1), block: (block as u32, 1, 1), shared_bytes: 0 })
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
    let blocks = 4 * sm_count.max(1) as u64 * blocks_per_sm.max(1) as u64;
    let chunks = blocks.div_ceil(gx).clamp(1, rows.div_ceil(COL_BLOCK_Y as u64)).min(65_535) as u32;
    let smem = 2 * COL_BLOCK_X * COL_BLOCK_Y * 4;
    Some((
        LaunchConfig { grid: (gx as u32, chunks, 1), block: (COL_BLOCK_X, COL_BLOCK_Y, 1), shared_bytes: smem },
        chunks,
    ))
}

/// One thread per item, 256-thread blocks (for the small finishing kernels).
pub fn one_per_thread(n: u64) -> Option<LaunchConfig> {
    if n == 0 {
        return None;
    }
    Some(LaunchConfig { grid: (n.div_ceil(BLOCK as u64) as u32, 1, 1), block: (BLOCK, 1, 1), shared_bytes: 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

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
