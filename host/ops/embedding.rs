//! Embedding lookup (host side of `kernels-gpu/src/embedding.rs`): [`embedding`] (also
//! [`embedding_out`], [`embedding_checked`]) and its deterministic backward
//! [`embedding_backward`] (also [`embedding_backward_out`]), as PyTorch's `F.embedding`.
//!
//! Indices outside `[0, V)`: PyTorch stops with a device-side assertion, which a kernel of this
//! library cannot raise without ending the context. Here the forward writes zeros for such a
//! row and reads nothing out of bounds; [`embedding_checked`] also reports the first such
//! position it saw as an error, at the cost of a synchronisation. The backward drops them (no
//! row receives their gradient).

use super::check::{check_same_device, check_same_dtype, shapes_match, with_elem};
use crate::device::{Device, LaunchConfig};
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::{IndexTensor, Tensor};
use kernels_gpu::embedding::{
    EmbeddingBwdArgs, EmbeddingElem, EmbeddingFwdArgs, SortMergeArgs, SortStepArgs, SortTilesArgs, StartsArgs, TILE,
    embedding_bwd_sort_merge, embedding_bwd_sort_step, embedding_bwd_sort_tiles, embedding_bwd_starts, row_items,
};

/// The most indices of a backward: positions must fit the keys' 32 bits, and the sort's length
/// (the next power of two) a grid.
pub const MAX_BACKWARD_INDICES: usize = 1 << 31;

/// The most rows of a weight: rows are the keys' upper 32 bits, below the dropped key.
pub const MAX_ROWS: usize = u32::MAX as usize;

/// `padding_idx` as the kernels take it: in `[0, v)`, or -1 for none. A negative one counts from
/// the end, as PyTorch's (`-1` is the last row); outside `[-v, v)` it is an error.
fn padding_row(op: &'static str, padding_idx: Option<i64>, v: usize) -> Result<i64> {
    let Some(p) = padding_idx else { return Ok(-1) };
    let vi = v as i64;
    if p < -vi || p >= vi {
        return Err(Error::InvalidArgument { op, message: format!("padding_idx must be in [-{v}, {v}), got {p}") });
    }
    Ok(if p < 0 { p + vi } else { p })
}

/// The weight's `(V, D)`: rank 2, at most [`MAX_ROWS`] rows.
fn weight_dims(op: &'static str, shape: &[usize]) -> Result<(usize, usize)> {
    let &[v, d] = shape else {
        return Err(Error::InvalidArgument { op, message: format!("the weight must be [V, D], got shape {shape:?}") });
    };
    if v > MAX_ROWS {
        return Err(Error::InvalidArgument { op, message: format!("the weight has {v} rows, more than {MAX_ROWS}") });
    }
    Ok((v, d))
}

/// `idx`'s shape followed by `d`: the forward's output, the backward's incoming gradient.
fn rows_shape(idx: &[usize], d: usize) -> Vec<usize> {
    let mut s = idx.to_vec();
    s.push(d);
    s
}

/// Checks the forward's operands; returns `(V, D)`.
fn check_fwd(op: &'static str, weight: &Tensor, idx: &IndexTensor, padding_idx: Option<i64>) -> Result<(usize, usize)> {
    let (v, d) = weight_dims(op, weight.shape())?;
    if idx.device() != weight.device() {
        return Err(Error::DeviceMismatch { op, expected: weight.device().ordinal(), got: idx.device().ordinal() });
    }
    padding_row(op, padding_idx, v)?;
    if v == 0 && idx.numel() > 0 {
        return Err(Error::InvalidArgument {
            op,
            message: format!("the weight has no rows, so none of the {} indices can be looked up", idx.numel()),
        });
    }
    Ok((v, d))
}

/// Launches the gather (operands checked); `bad` receives a bad position plus one, if not null.
fn gather(weight: &Tensor, idx: &IndexTensor, out: &mut Tensor, bad: *mut u64, v: usize, d: usize) -> Result<()> {
    let (dt, dev) = (weight.dtype(), weight.device().clone());
    let n = idx.numel() as u64;
    let total = n.saturating_mul(row_items(dt, d as u64));
    if total == 0 {
        return Ok(());
    }
    with_elem!(dt, |T| {
        let kernel = <T as EmbeddingElem>::FWD;
        let Some(cfg) = launch::elementwise(total, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?) else {
            return Ok(());
        };
        let args: EmbeddingFwdArgs<T> =
            (weight.dev_ptr(), idx.dev_ptr(), out.dev_ptr_mut()?, bad, n, v as u64, d as u64);
        // SAFETY: the weight holds v * d elements of T, idx n indices and out n * d elements
        // (its shape, checked), whole allocations (16-byte aligned); `bad` is null or one u64.
        // out's memory is its own (`dev_ptr_mut` copies memory shared with a clone first), so
        // the launch writes nothing it reads.
        unsafe { dev.launch(kernel, cfg, args) }
    })
}

/// Embedding lookup, as `F.embedding(idx, weight, padding_idx)`: row `idx[..]` of `weight` for
/// each index, shape `idx.shape + [D]`, bit for bit (a copy).
///
/// - `weight`: `[V, D]`, f32, f16 or bf16. `idx`: int64 of any shape, on the weight's device.
/// - `padding_idx` (in `[-V, V)`, negative from the end) changes only the backward, as in
///   PyTorch: that row gets no gradient.
/// - An index outside `[0, V)` gives a row of zeros (see the module's note;
///   [`embedding_checked`] reports it). With `V = 0` any index is an error.
pub fn embedding(weight: &Tensor, idx: &IndexTensor, padding_idx: Option<i64>) -> Result<Tensor> {
    let op = "embedding";
    let (v, d) = check_fwd(op, weight, idx, padding_idx)?;
    let mut out = Tensor::alloc(op, weight.device(), &rows_shape(idx.shape(), d), weight.dtype())?;
    gather(weight, idx, &mut out, std::ptr::null_mut(), v, d)?;
    Ok(out)
}

/// [`embedding`] into `out`, which must have shape `idx.shape + [D]` and the weight's dtype
/// and device.
pub fn embedding_out(weight: &Tensor, idx: &IndexTensor, padding_idx: Option<i64>, out: &mut Tensor) -> Result<()> {
    let op = "embedding_out";
    let (v, d) = check_fwd(op, weight, idx, padding_idx)?;
    check_same_device(op, weight, out)?;
    check_same_dtype(op, weight, out)?;
    shapes_match(op, &rows_shape(idx.shape(), d), out.shape(), "out must be the indices' shape followed by D")?;
    gather(weight, idx, out, std::ptr::null_mut(), v, d)
}

/// [`embedding`], then an [`Error::InvalidArgument`] naming a position whose index is outside
/// `[0, V)` if there is one (any one of them when there are several). Waits for the device.
pub fn embedding_checked(weight: &Tensor, idx: &IndexTensor, padding_idx: Option<i64>) -> Result<Tensor> {
    let op = "embedding_checked";
    let (v, d) = check_fwd(op, weight, idx, padding_idx)?;
    let mut out = Tensor::alloc(op, weight.device(), &rows_shape(idx.shape(), d), weight.dtype())?;
    let mut bad = IndexTensor::zeros(weight.device(), &[1])?;
    gather(weight, idx, &mut out, bad.dev_ptr_mut() as *mut u64, v, d)?;
    // With D = 0 (or no indices) nothing is launched or read, and nothing is reported.
    let at = bad.to_vec()?.first().copied().unwrap_or(0);
    if at != 0 {
        return Err(Error::InvalidArgument {
            op,
            message: format!("the index at flat position {} is outside [0, {v})", at - 1),
        });
    }
    Ok(out)
}

/// One launch of the backward's sort (see `kernels_gpu::embedding`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SortPass {
    /// Keys built and sorted in tiles of `tile` keys, a block each.
    Tiles { tile: u64 },
    /// The step of merge size `k` at stride `j` over all keys.
    Step { k: u64, j: u64 },
    /// The steps of merge size `k` below the tile, in shared memory.
    Merge { k: u64 },
}

/// The sort's length for `n` indices: the next power of two, at least 2.
pub(crate) fn sort_len(n: u64) -> u64 {
    n.max(2).next_power_of_two()
}

/// The launches of the bitonic sort of `m` keys (a power of two, at least 2), in order.
pub(crate) fn sort_plan(m: u64) -> Vec<SortPass> {
    let tile = m.min(TILE);
    let mut plan = vec![SortPass::Tiles { tile }];
    let mut k = 2 * tile;
    while k <= m {
        let mut j = k / 2;
        while j >= tile {
            plan.push(SortPass::Step { k, j });
            j /= 2;
        }
        plan.push(SortPass::Merge { k });
        k *= 2;
    }
    plan
}

/// The sorted keys of `idx` (`n > 0` indices, at most [`MAX_BACKWARD_INDICES`]) against `v`
/// rows, `padding` dropped (or -1): `sort_len(n)` keys, by row, then position (see
/// `kernels_gpu::embedding`). `line` is `(k, b)` of indices seen as `[.., k, b]`, whose lines
/// number their rows apart (`line_of`; `(n, 1)` for one line), `lines * v` at most [`MAX_ROWS`];
/// `bad`, if not null, receives a position of an index outside `[0, v)` plus one.
pub(crate) fn sort_keys(
    op: &'static str,
    dev: &Device,
    idx: &IndexTensor,
    v: u64,
    padding: i64,
    line: (u64, u64),
    bad: *mut u64,
) -> Result<IndexTensor> {
    let n = idx.numel() as u64;
    let m = sort_len(n);
    let mut keys = IndexTensor::alloc(op, dev, &[m as usize])?;
    let kp = keys.dev_ptr_mut() as *mut u64;
    for pass in sort_plan(m) {
        match pass {
            SortPass::Tiles { tile } => {
                let cfg = tile_grid(m, tile);
                let args: SortTilesArgs = (idx.dev_ptr(), kp, bad, n, v, padding, line.0, line.1);
                // SAFETY: idx holds n indices and keys m = grid * tile keys; the block's shared
                // memory holds its tile; `bad` is null or one u64 (the caller's).
                unsafe { dev.launch(embedding_bwd_sort_tiles, cfg, args) }?;
            }
            SortPass::Step { k, j } => {
                let bps = dev.blocks_per_sm_256(embedding_bwd_sort_step.name())?;
                let Some(cfg) = launch::elementwise(m / 2, 1, 1, dev.sm_count(), bps) else { continue };
                let args: SortStepArgs = (kp, m, k, j);
                // SAFETY: keys holds m keys; the step's pairs are below m.
                unsafe { dev.launch(embedding_bwd_sort_step, cfg, args) }?;
            }
            SortPass::Merge { k } => {
                let args: SortMergeArgs = (kp, k);
                // SAFETY: as for the tiles (m is a multiple of TILE here).
                unsafe { dev.launch(embedding_bwd_sort_merge, tile_grid(m, TILE), args) }?;
            }
        }
    }
    Ok(keys)
}

/// `starts[r]` for `r <= rows`: the first of the sorted `keys` at or above row `r * step` (the
/// embedding's rows with `step` 1, the scatter's lines of `step` rows).
pub(crate) fn row_starts(
    op: &'static str,
    dev: &Device,
    keys: &IndexTensor,
    rows: u64,
    step: u64,
) -> Result<IndexTensor> {
    let mut starts = IndexTensor::alloc(op, dev, &[rows as usize + 1])?;
    let bps = dev.blocks_per_sm_256(embedding_bwd_starts.name())?;
    if let Some(cfg) = launch::elementwise(rows + 1, 1, 1, dev.sm_count(), bps) {
        let m = keys.numel() as u64;
        let args: StartsArgs = (keys.dev_ptr() as *const u64, starts.dev_ptr_mut() as *mut u64, m, rows, step);
        // SAFETY: keys holds m sorted keys, starts rows + 1 entries.
        unsafe { dev.launch(embedding_bwd_starts, cfg, args) }?;
    }
    Ok(starts)
}

/// A block per tile of `tile` keys (a power of two, at least 2) of `m`, half as many threads.
fn tile_grid(m: u64, tile: u64) -> LaunchConfig {
    LaunchConfig { grid: ((m / tile) as u32, 1, 1), block: ((tile / 2) as u32, 1, 1), shared_bytes: (tile * 8) as u32 }
}

/// Checks the backward's operands against a weight of `v` rows; returns `D`.
fn check_bwd(op: &'static str, grad: &Tensor, idx: &IndexTensor, v: usize) -> Result<usize> {
    if idx.device() != grad.device() {
        return Err(Error::DeviceMismatch { op, expected: grad.device().ordinal(), got: idx.device().ordinal() });
    }
    if v > MAX_ROWS {
        return Err(Error::InvalidArgument { op, message: format!("num_weights is {v}, more than {MAX_ROWS}") });
    }
    if idx.numel() > MAX_BACKWARD_INDICES {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{} indices, more than the backward's {MAX_BACKWARD_INDICES}", idx.numel()),
        });
    }
    let d = grad.shape().last().copied().unwrap_or(0);
    if grad.shape().is_empty() || grad.shape()[..grad.shape().len() - 1] != *idx.shape() {
        return Err(Error::ShapeMismatch {
            op,
            expected: rows_shape(idx.shape(), d),
            got: grad.shape().to_vec(),
            detail: "grad_out must be the indices' shape followed by D",
        });
    }
    Ok(d)
}

/// Runs the backward into `gw` (`[v, d]`, operands checked).
fn backward(op: &'static str, grad: &Tensor, idx: &IndexTensor, padding: i64, gw: &mut Tensor) -> Result<()> {
    let (dt, dev) = (grad.dtype(), grad.device().clone());
    let (v, d) = (gw.shape()[0] as u64, gw.shape()[1] as u64);
    let total = v.saturating_mul(row_items(dt, d));
    if total == 0 {
        return Ok(());
    }
    // No indices: every row's range is empty (and the keys are never read).
    let (keys, starts) = if idx.numel() == 0 {
        let z = IndexTensor::zeros(&dev, &[v as usize + 1])?;
        (z.clone(), z)
    } else {
        let n = idx.numel() as u64;
        let keys = sort_keys(op, &dev, idx, v, padding, (n, 1), std::ptr::null_mut())?;
        let starts = row_starts(op, &dev, &keys, v, 1)?;
        (keys, starts)
    };
    with_elem!(dt, |T| {
        let kernel = <T as EmbeddingElem>::BWD;
        let Some(cfg) = launch::elementwise(total, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?) else {
            return Ok(());
        };
        let args: EmbeddingBwdArgs<T> =
            (grad.dev_ptr(), keys.dev_ptr() as *const u64, starts.dev_ptr() as *const u64, gw.dev_ptr_mut()?, v, d);
        // SAFETY: starts holds v + 1 bounds of sorted keys whose positions are below the
        // gradient's n rows of d elements; gw holds v * d elements; whole allocations. gw's
        // memory is its own (`dev_ptr_mut`).
        unsafe { dev.launch(kernel, cfg, args) }
    })
}

/// The gradient of [`embedding`]'s weight, `[num_weights, D]` in `grad_out`'s dtype:
/// `grad_weight[v] = sum of grad_out[i]` over the positions `i` (flat, in `idx`'s row-major
/// order) with `idx[i] == v`, and zero for a row never indexed, for `padding_idx` (in
/// `[-V, V)`) and for indices outside `[0, V)`.
///
/// Deterministic: the same inputs give the same bits. Each sum is taken in f32, one addition at
/// a time from +0.0 in increasing position `i`, and rounded once to the dtype (so its error is
/// within `(c - 1) 2^-24 sum |g|` for `c` occurrences, plus the final rounding).
///
/// `grad_out`: `idx.shape + [D]`, f32, f16 or bf16; `idx` int64, at most
/// [`MAX_BACKWARD_INDICES`], on its device. The work: a sort of the indices (a few launches)
/// and one pass writing every row of the result.
pub fn embedding_backward(
    grad_out: &Tensor,
    idx: &IndexTensor,
    num_weights: usize,
    padding_idx: Option<i64>,
) -> Result<Tensor> {
    let op = "embedding_backward";
    let d = check_bwd(op, grad_out, idx, num_weights)?;
    let padding = padding_row(op, padding_idx, num_weights)?;
    let mut gw = Tensor::alloc(op, grad_out.device(), &[num_weights, d], grad_out.dtype())?;
    backward(op, grad_out, idx, padding, &mut gw)?;
    Ok(gw)
}

/// [`embedding_backward`] into `grad_weight` (`[V, D]`, `grad_out`'s dtype and device), every
/// element of which is written.
pub fn embedding_backward_out(
    grad_out: &Tensor,
    idx: &IndexTensor,
    padding_idx: Option<i64>,
    grad_weight: &mut Tensor,
) -> Result<()> {
    let op = "embedding_backward_out";
    let (v, d) = weight_dims(op, grad_weight.shape())?;
    let dg = check_bwd(op, grad_out, idx, v)?;
    check_same_device(op, grad_out, grad_weight)?;
    check_same_dtype(op, grad_out, grad_weight)?;
    shapes_match(op, &[v, dg], &[v, d], "grad_weight's D must be grad_out's last dimension")?;
    let padding = padding_row(op, padding_idx, v)?;
    backward(op, grad_out, idx, padding, grad_weight)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels_gpu::embedding::{DROPPED, ascending, key, pair};

    /// Runs the plan's launches on the CPU as the kernels do, block by block.
    fn sort_on_cpu(idx: &[i64], v: u64, padding: i64) -> Vec<u64> {
        let n = idx.len() as u64;
        let m = sort_len(n);
        let mut keys = vec![0u64; m as usize];
        let exchange = |s: &mut [u64], i: u64, l: u64, asc: bool| {
            if (s[i as usize] > s[l as usize]) == asc {
                s.swap(i as usize, l as usize);
            }
        };
        for pass in sort_plan(m) {
            match pass {
                SortPass::Tiles { tile } => {
                    for (b, s) in keys.chunks_mut(tile as usize).enumerate() {
                        let base = b as u64 * tile;
                        for (e, k) in s.iter_mut().enumerate() {
                            let i = base + e as u64;
                            *k = if i < n { key(idx[i as usize], 0, i, v, padding) } else { DROPPED };
                        }
                        let mut k = 2;
                        while k <= tile {
                            let mut j = k / 2;
                            while j > 0 {
                                for t in 0..tile / 2 {
                                    let (i, l) = pair(t, j);
                                    exchange(s, i, l, ascending(base + i, k));
                                }
                                j /= 2;
                            }
                            k *= 2;
                        }
                    }
                }
                SortPass::Step { k, j } => {
                    for t in 0..m / 2 {
                        let (i, l) = pair(t, j);
                        exchange(&mut keys, i, l, ascending(i, k));
                    }
                }
                SortPass::Merge { k } => {
                    for (b, s) in keys.chunks_mut(TILE as usize).enumerate() {
                        let base = b as u64 * TILE;
                        let mut j = TILE / 2;
                        while j > 0 {
                            for t in 0..TILE / 2 {
                                let (i, l) = pair(t, j);
                                exchange(s, i, l, ascending(base + i, k));
                            }
                            j /= 2;
                        }
                    }
                }
            }
        }
        keys
    }

    #[test]
    fn the_plan_sorts_by_row_then_position() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |below: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % below
        };
        for (n, v) in [(0, 5), (1, 1), (2, 3), (3, 1), (7, 2), (2047, 100), (2048, 9), (2049, 50_000), (5000, 7)] {
            let idx: Vec<i64> = (0..n).map(|_| rnd(v + 3) as i64 - 1).collect();
            let padding = if v > 2 { 1 } else { -1 };
            let got = sort_on_cpu(&idx, v, padding);
            let mut want: Vec<u64> = (0..sort_len(n))
                .map(|i| if i < n { key(idx[i as usize], 0, i, v, padding) } else { DROPPED })
                .collect();
            want.sort_unstable();
            assert_eq!(got, want, "n {n} v {v}");
        }
    }

    #[test]
    fn plan_shapes() {
        assert_eq!(sort_len(0), 2);
        assert_eq!(sort_len(3), 4);
        assert_eq!(sort_len(8192), 8192);
        assert_eq!(sort_plan(8), vec![SortPass::Tiles { tile: 8 }]);
        let t = TILE;
        assert_eq!(
            sort_plan(4 * t),
            vec![
                SortPass::Tiles { tile: t },
                SortPass::Step { k: 2 * t, j: t },
                SortPass::Merge { k: 2 * t },
                SortPass::Step { k: 4 * t, j: 2 * t },
                SortPass::Step { k: 4 * t, j: t },
                SortPass::Merge { k: 4 * t },
            ]
        );
        let c = tile_grid(4 * t, t);
        assert_eq!((c.grid.0, c.block.0, c.shared_bytes), (4, 1024, 16384));
    }

    #[test]
    fn argument_errors() {
        assert_eq!(padding_row("e", None, 0).unwrap(), -1);
        assert_eq!(padding_row("e", Some(-1), 10).unwrap(), 9);
        assert_eq!(padding_row("e", Some(-10), 10).unwrap(), 0);
        assert_eq!(padding_row("e", Some(9), 10).unwrap(), 9);
        for p in [10, -11, i64::MIN, i64::MAX] {
            assert!(matches!(padding_row("e", Some(p), 10), Err(Error::InvalidArgument { .. })));
        }
        assert!(matches!(padding_row("e", Some(0), 0), Err(Error::InvalidArgument { .. })));
        assert_eq!(weight_dims("e", &[5, 3]).unwrap(), (5, 3));
        for s in [&[5][..], &[], &[1, 2, 3], &[MAX_ROWS + 1, 1]] {
            assert!(matches!(weight_dims("e", s), Err(Error::InvalidArgument { .. })));
        }
        assert_eq!(rows_shape(&[2, 3], 7), vec![2, 3, 7]);
        assert_eq!(rows_shape(&[], 7), vec![7]);
    }
}
