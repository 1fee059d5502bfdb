//! Transpose of the last two dimensions into a new contiguous tensor (host side of
//! `kernels-gpu/src/transpose.rs`): `[.., rows, cols]` becomes `[.., cols, rows]`, batched over
//! the leading dimensions. Exact: the kernels move bits.

use super::check::{check_same_device, check_same_dtype, shapes_match, with_elem};
use crate::device::LaunchConfig;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use kernels_gpu::DType;
use kernels_gpu::transpose::{TransposeArgs, TransposeElem, block, smem_bytes, tile, tiling};

/// The largest `grid.x` and `grid.y` of a launch; the kernel loops over the tiles beyond.
const MAX_GRID_X: u64 = i32::MAX as u64;
const MAX_GRID_Y: u64 = 65_535;

/// `(batch, rows, cols)` of `shape` (the leading dimensions folded into `batch`) and the
/// transposed shape; rank 0 and 1 are an error.
fn split(op: &'static str, shape: &[usize]) -> Result<((u64, u64, u64), Vec<usize>)> {
    let n = shape.len();
    if n < 2 {
        return Err(Error::InvalidArgument {
            op,
            message: format!("needs at least 2 dimensions (it swaps the last two), got shape {shape:?}"),
        });
    }
    // A prefix of the shape: its product is a prefix product of the element count, which the
    // tensor's allocation checked for overflow.
    let batch: usize = shape[..n - 2].iter().product();
    let (rows, cols) = (shape[n - 2], shape[n - 1]);
    let mut out = shape.to_vec();
    out.swap(n - 2, n - 1);
    Ok(((batch as u64, rows as u64, cols as u64), out))
}

/// Launch geometry of the transpose of `batch` matrices of `rows x cols` elements of `dt` on a
/// GPU of `sm_count` SMs; `None` when there is nothing to move. `grid.x` covers the column
/// tiles, `grid.y` the (batch, row tile) pairs, each capped (the kernel loops beyond); tile,
/// block and shared memory are those of the
/// [`Tiling`](kernels_gpu::transpose::Tiling) that [`tiling`] picks.
pub(crate) fn geometry(dt: DType, batch: u64, rows: u64, cols: u64, sm_count: u32) -> Option<LaunchConfig> {
    if batch == 0 || rows == 0 || cols == 0 {
        return None;
    }
    let tl = tiling(dt, batch, rows, cols, sm_count);
    let t = tile(dt, tl);
    let gx = cols.div_ceil(t).min(MAX_GRID_X);
    let gy = batch.saturating_mul(rows.div_ceil(t)).min(MAX_GRID_Y);
    Some(LaunchConfig { grid: (gx as u32, gy as u32, 1), block: block(tl), shared_bytes: smem_bytes(dt, tl) })
}

/// Launches the transpose of `x` (already checked) into `out` (the transposed shape, same dtype
/// and device).
fn launch(x: &Tensor, out: &mut Tensor, (batch, rows, cols): (u64, u64, u64)) -> Result<()> {
    let dt = x.dtype();
    let Some(cfg) = geometry(dt, batch, rows, cols, x.device().sm_count()) else { return Ok(()) };
    with_elem!(dt, |T| {
        let args: TransposeArgs<T> = (x.dev_ptr(), out.dev_ptr_mut()?, batch, rows, cols);
        // SAFETY: x and out hold batch * rows * cols elements of T on this device (the callers
        // checked shapes, dtypes and devices), each a whole allocation, so 16-byte aligned; out
        // is borrowed mutably while x is borrowed, so they do not overlap; the geometry is the
        // one the kernel expects for these sizes.
        unsafe { x.device().launch(T::TRANSPOSE, cfg, args) }
    })
}

/// `x` with its last two dimensions swapped, as a new contiguous tensor (PyTorch's
/// `x.transpose(-2, -1).contiguous()`): a plain transpose for rank 2, one per matrix over the
/// leading dimensions otherwise. Rank 0 and 1 are an error.
pub fn transpose(x: &Tensor) -> Result<Tensor> {
    let op = "transpose";
    let (dims, shape) = split(op, x.shape())?;
    let mut out = Tensor::alloc(op, x.device(), &shape, x.dtype())?;
    launch(x, &mut out, dims)?;
    Ok(out)
}

/// [`transpose`] into `out`, which must have `x`'s shape with the last two dimensions swapped,
/// its dtype and its device.
pub fn transpose_out(x: &Tensor, out: &mut Tensor) -> Result<()> {
    let op = "transpose_out";
    let (dims, shape) = split(op, x.shape())?;
    check_same_device(op, x, out)?;
    check_same_dtype(op, x, out)?;
    shapes_match(op, &shape, out.shape(), "out must have the input's shape with the last two dimensions swapped")?;
    launch(x, out, dims)
}

impl Tensor {
    /// [`transpose`]: the last two dimensions swapped, as a new contiguous tensor.
    pub fn transpose(&self) -> Result<Tensor> {
        transpose(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels_gpu::transpose::{
        SCALAR_TILE, SMALL_VEC_SLOTS, Tiling, VEC_SLOTS, scalar_stride, vec_slot, vec_smem_slots, vec_width,
    };

    /// The H100's SMs, for the launch rules' tests.
    const SMS: u32 = 132;

    #[test]
    fn shapes_split_and_swap() {
        assert_eq!(split("t", &[3, 5]).unwrap(), ((1, 3, 5), vec![5, 3]));
        assert_eq!(split("t", &[2, 4, 3, 5]).unwrap(), ((8, 3, 5), vec![2, 4, 5, 3]));
        assert_eq!(split("t", &[0, 3, 5]).unwrap(), ((0, 3, 5), vec![0, 5, 3]));
        for bad in [&[][..], &[7][..]] {
            let err = split("transpose", bad).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }));
            assert!(err.to_string().starts_with("transpose: ") && err.to_string().contains(&format!("{bad:?}")));
        }
    }

    #[test]
    fn geometry_covers_every_tile() {
        for dt in DType::ALL {
            assert_eq!(geometry(dt, 0, 5, 5, SMS), None);
            assert_eq!(geometry(dt, 3, 0, 5, SMS), None);
            assert_eq!(geometry(dt, 3, 5, 0, SMS), None);
            let v = vec_width(dt);
            // The vector path exactly when both sides are whole vectors.
            let c = geometry(dt, 1, 8192, 8192, SMS).unwrap();
            let big = Tiling::Vector { slots: VEC_SLOTS };
            assert_eq!(
                (c.block, c.grid),
                ((VEC_SLOTS * VEC_SLOTS, 1, 1), ((8192 / (16 * v)) as u32, (8192 / (16 * v)) as u32, 1))
            );
            assert_eq!(c.shared_bytes as u64, vec_smem_slots(dt, VEC_SLOTS) * 16);
            assert_eq!(c.shared_bytes, smem_bytes(dt, big));
            for slots in [VEC_SLOTS, SMALL_VEC_SLOTS] {
                let b = smem_bytes(dt, Tiling::Vector { slots });
                assert!(b <= 48 * 1024, "beyond the default dynamic shared memory limit");
            }
            let c = geometry(dt, 1, 8192, 8191, SMS).unwrap();
            assert_eq!((c.block, c.grid), ((32, 8, 1), (256, 256, 1)));
            assert_eq!(c.shared_bytes as u64, SCALAR_TILE * scalar_stride(dt) * dt.size() as u64);
            let c = geometry(dt, 1, v + 1, v, SMS).unwrap();
            assert_eq!(c.block, (32, 8, 1));
            for (batch, rows, cols) in [
                (1u64, 1u64, 1u64),
                (1, 1, 100_003),
                (1, 100_003, 1),
                (3, 257, 129),
                (3, 256, 128),
                (1, 64, 1024),
                (70_000, 2, 3),
                (70_000, 8, 8),
                (1, 4_200_000, 1),
                (1, 3 << 30, 8),
                (1, 8, 1 << 40),
            ] {
                let c = geometry(dt, batch, rows, cols, SMS).unwrap();
                let t = tile(dt, tiling(dt, batch, rows, cols, SMS));
                let (gx, gy) = (c.grid.0 as u64, c.grid.1 as u64);
                assert!((1..=MAX_GRID_X).contains(&gx) && (1..=MAX_GRID_Y).contains(&gy));
                // One block per tile unless a cap applies, in which case the loops cover the rest.
                assert!(gx == cols.div_ceil(t) || gx == MAX_GRID_X, "{batch} {rows} {cols}");
                assert!(gy == batch * rows.div_ceil(t) || gy == MAX_GRID_Y, "{batch} {rows} {cols}");
            }
        }
    }

    /// Small vector-path grids take the small tiles, which make four times the blocks, and only
    /// they: the rule's boundary is the SM count, in tiles of the large tiling.
    #[test]
    fn small_grids_take_small_tiles() {
        let small = Tiling::Vector { slots: SMALL_VEC_SLOTS };
        let big = Tiling::Vector { slots: VEC_SLOTS };
        // f32: 64 x 64 tiles; 64 x 1024 is 16 of them, 64 blocks of 32 x 32.
        assert_eq!(tiling(DType::F32, 1, 64, 1024, SMS), small);
        let c = geometry(DType::F32, 1, 64, 1024, SMS).unwrap();
        assert_eq!((c.grid, c.block), ((32, 2, 1), (64, 1, 1)));
        assert_eq!(c.shared_bytes as u64, vec_smem_slots(DType::F32, SMALL_VEC_SLOTS) * 16);
        // 131 tiles and 132 tiles on either side of the boundary (131 = 1 x 131, 132 = 2 x 66).
        assert_eq!(tiling(DType::F32, 1, 64, 64 * 131, SMS), small);
        assert_eq!(tiling(DType::F32, 1, 128, 64 * 66, SMS), big);
        // Batches count: 3 matrices of 64 x 64 bf16 (128 x 128 tiles) are 3 tiles.
        assert_eq!(tiling(DType::BF16, 3, 64, 64, SMS), small);
        assert_eq!(tiling(DType::BF16, 200, 64, 64, SMS), big);
        assert_eq!(tiling(DType::F32, 1, 8192, 8192, SMS), big);
        // The scalar path whatever the size.
        assert_eq!(tiling(DType::F16, 1, 63, 64, SMS), Tiling::Scalar);
        assert_eq!(tiling(DType::F16, 1, 8191, 8192, SMS), Tiling::Scalar);
    }

    /// The shared-memory layout of the vector path, as the kernel indexes it, for both tile
    /// sizes: every slot inside the allocation, no two micro-block vectors in one slot, and each
    /// quarter-warp's eight 16-byte accesses in eight different bank groups (slot mod 8), on both
    /// sides.
    #[test]
    fn vector_tile_layout_is_conflict_free() {
        for (dt, s) in [
            (DType::F32, VEC_SLOTS),
            (DType::F16, VEC_SLOTS),
            (DType::F32, SMALL_VEC_SLOTS),
            (DType::F16, SMALL_VEC_SLOTS),
        ] {
            let v = vec_width(dt) as u32;
            let slots = vec_smem_slots(dt, s) as u32;
            let mut used = vec![false; slots as usize];
            for c in 0..s * v {
                for rb in 0..s {
                    let slot = vec_slot(v, s, c, rb);
                    assert!(slot < slots && !used[slot as usize], "{dt:?} {s} c {c} rb {rb}");
                    used[slot as usize] = true;
                }
            }
            for quarter in 0..s * s / 8 {
                let lanes = (quarter * 8..quarter * 8 + 8).map(|t| (t / s, t % s));
                for k in 0..v {
                    // Write side: thread (rb, cb) writes output row V cb + k.
                    let mut groups: Vec<u32> =
                        lanes.clone().map(|(rb, cb)| vec_slot(v, s, v * cb + k, rb) % 8).collect();
                    groups.sort();
                    groups.dedup();
                    assert_eq!(groups.len(), 8, "{dt:?} {s} write conflict, quarter {quarter} k {k}");
                    // Read side: thread (p, q) reads output row p + S k, micro-row q.
                    let mut groups: Vec<u32> = lanes.clone().map(|(p, q)| vec_slot(v, s, p + s * k, q) % 8).collect();
                    groups.sort();
                    groups.dedup();
                    assert_eq!(groups.len(), 8, "{dt:?} {s} read conflict, quarter {quarter} k {k}");
                    // And the kernel's addressing: a base plus a constant per k.
                    let (p, q) = (quarter * 8 / s, quarter * 8 % s);
                    assert_eq!(vec_slot(v, s, p + s * k, q), vec_slot(v, s, p, q) + k * vec_slot(v, s, s, 0));
                    assert_eq!(vec_slot(v, s, v * q + k, p), vec_slot(v, s, v * q, p) + k * s);
                }
            }
        }
    }

    /// The scalar tile: a warp reading a tile column (32 rows, one element each) hits 32 banks.
    #[test]
    fn scalar_tile_columns_are_conflict_free() {
        for dt in [DType::F32, DType::F16] {
            let (stride, size) = (scalar_stride(dt), dt.size() as u64);
            for col in 0..SCALAR_TILE {
                let mut banks: Vec<u64> = (0..SCALAR_TILE).map(|r| ((r * stride + col) * size / 4) % 32).collect();
                banks.sort();
                banks.dedup();
                assert_eq!(banks.len(), 32, "{dt:?} column {col}");
            }
        }
    }

    #[test]
    fn kernels_listed() {
        let k: Vec<_> = kernels_gpu::transpose::all_kernels().collect();
        assert_eq!(k.len(), 3);
        assert!(k.iter().all(|k| k.name.starts_with("transpose_") && k.arity == 5));
    }
}
