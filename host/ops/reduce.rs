//! Reductions (host side of `kernels-gpu/src/reduce.rs`): sum, mean, max, min and argmax over
//! the whole tensor or along the last dimension, and sum and mean over the leading dimensions
//! (`[..., C]` to `[C]`, e.g. a bias gradient), with PyTorch's semantics: values come back in
//! the input's dtype (rounded from the f32 accumulator), indices as i64; max, min and argmax
//! propagate NaN (argmax: the first NaN); ties give the first index; the sum of nothing is 0, the
//! mean of nothing NaN, and max, min or argmax of nothing an error.
//!
//! Results are deterministic: the launch geometry depends only on the shape and the device, and
//! the kernels combine in a fixed order without atomics, so the same input gives the same bits
//! on every run.

use super::check::{check_same_device, check_same_dtype, rows_cols, shapes_match, with_elem};
use crate::DType;
use crate::device::{Device, LaunchConfig};
use crate::error::{Error, Result};
use crate::rows;
use crate::tensor::{IndexTensor, Tensor};
use kernels_gpu::kernel::Kernel;
use kernels_gpu::norm::{COLSUM_LANES, NormColsumArgs};
use kernels_gpu::reduce::{
    ArgmaxFinalArgs, ArgmaxPartArgs, ArgmaxRowsArgs, COLS_BLOCK, PART_BLOCK, ReduceColsArgs, ReduceElem,
    ReduceFinalArgs, ReduceOpKernels, ReducePartArgs, ReduceRowsArgs, UNROLL, cols_smem_bytes, reduce_argmax_final,
};
use kernels_gpu::rows::{MAX_GROUP, reduce_smem_bytes};

/// A reduction to values of the input's dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum (0 over nothing).
    Sum,
    /// The mean (NaN over nothing).
    Mean,
    /// The largest element (NaN if any is NaN; an error over nothing).
    Max,
    /// The smallest element (NaN if any is NaN; an error over nothing).
    Min,
}

// --- launch geometry (pure) -------------------------------------------------------------------

/// Tensors of at most this many bytes are reduced by one block in one launch: one round of 64
/// bytes per thread for up to 1024 threads. Beyond it, spreading the loads over the SMs wins
/// over saving the second launch.
pub(crate) const REDUCE_ONE_BLOCK_BYTES: u64 = 64 << 10;
/// 16-byte vectors per thread the row kernels aim for: a group of `ceil(vectors / 8)` threads
/// per row (up to 1024), so a row of 1024 f32 is one warp's, with no shared-memory stage. With
/// two vectors per thread (128 threads for that row) the reduction's latency dominated: sums
/// along 1024-wide rows ran well behind the whole-tensor sum (H100, docs/worklog.md, 2026-11-23-rows).
pub(crate) const REDUCE_ROW_VECTORS: u64 = 8;

/// The launches of a whole-tensor reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReducePlan {
    /// Stage 1: `parts` blocks of `part.block.0` threads, one group (the block) each.
    pub part: LaunchConfig,
    /// Blocks of stage 1, hence partial results; 1: stage 1 writes the result itself.
    pub parts: u32,
    /// Stage 2 (one block), when `parts > 1`.
    pub finish: Option<LaunchConfig>,
}

/// Largest multiple of 32 not above `max_threads` (at least 32), capped at 1024: the block limit
/// of a kernel, from its registers.
fn block_limit(max_threads: u32) -> u32 {
    (max_threads / 32 * 32).clamp(32, MAX_GROUP)
}

/// Plan of a whole-tensor reduction of `n` elements of `elem_bytes` bytes on a GPU with
/// `sm_count` SMs, where stage 1 has `blocks_per_sm` resident blocks of 256 threads per SM and
/// the kernels accept blocks of `part_max` and `final_max` threads. `None` when `n` is 0.
///
/// Small tensors (up to [`REDUCE_ONE_BLOCK_BYTES`]): one block of 32 to 1024 threads, one round
/// of loads each, one launch. Otherwise stage 1 has enough 256-thread blocks for one round of
/// loads per thread, capped at one wave of resident blocks (beyond it each thread loops: the
/// partials stay at most a wave), and stage 2 has one block with a thread per partial (a
/// multiple of 32, up to 1024).
pub(crate) fn reduce_plan(
    n: u64,
    elem_bytes: u64,
    sm_count: u32,
    blocks_per_sm: u32,
    part_max: u32,
    final_max: u32,
) -> Option<ReducePlan> {
    if n == 0 {
        return None;
    }
    let round = (16 * UNROLL as u64) / elem_bytes; // elements a thread loads per round
    let smem = |threads: u32| reduce_smem_bytes(threads);
    let part_limit = block_limit(part_max);
    if n * elem_bytes <= REDUCE_ONE_BLOCK_BYTES {
        let threads = (n.div_ceil(round).next_multiple_of(32).min(part_limit as u64) as u32).max(32);
        let part = LaunchConfig { grid: (1, 1, 1), block: (threads, 1, 1), shared_bytes: smem(threads) };
        return Some(ReducePlan { part, parts: 1, finish: None });
    }
    let threads = PART_BLOCK.min(part_limit);
    let wave = sm_count.max(1) as u64 * blocks_per_sm.max(1) as u64;
    let parts = n.div_ceil(threads as u64 * round).min(wave) as u32;
    let part = LaunchConfig { grid: (parts, 1, 1), block: (threads, 1, 1), shared_bytes: smem(threads) };
    let finish = (parts > 1).then(|| {
        let t = parts.next_multiple_of(32).min(block_limit(final_max));
        LaunchConfig { grid: (1, 1, 1), block: (t, 1, 1), shared_bytes: smem(t) }
    });
    Some(ReducePlan { part, parts, finish })
}

/// Threads per row for rows of `cols` elements, `vec` per 16-byte vector, for a kernel that
/// accepts blocks of `max_threads`.
///
/// Short rows get a group of at most 32 threads (several rows per block), long rows up to the
/// kernel's block limit.
pub(crate) fn reduce_row_group(cols: u64, vec: u64, max_threads: u32) -> u32 {
    let g = rows::group_size(cols.div_ceil(vec), REDUCE_ROW_VECTORS);
    if g <= 32 { g } else { g.min(block_limit(max_threads)) }
}

/// Additions in a group reduction over `g` threads that one thread's value passes through: the
/// butterfly within a warp, then, for groups of several warps, the butterfly over the warps'
/// results (`rows::group_reduce`).
fn group_depth(g: u32) -> u64 {
    let width = g.min(32) as u64;
    width.trailing_zeros() as u64 + if g > 32 { 5 } else { 0 }
}

/// Depth of the summation of a whole-tensor sum under `plan` (see [`reduce_sum_depth`]).
pub(crate) fn whole_sum_depth(n: u64, vec: u64, plan: &ReducePlan) -> u64 {
    let threads = plan.parts as u64 * plan.part.block.0 as u64;
    let rounds = (n / vec).div_ceil(threads * UNROLL as u64);
    // A round's tree (lanes, then vectors), the round adds, up to UNROLL - 1 leftover vectors and
    // the tail element.
    let per_thread = rounds + vec.trailing_zeros() as u64 + UNROLL.trailing_zeros() as u64 + UNROLL as u64;
    let stage2 = plan.finish.map_or(0, |f| (plan.parts as u64).div_ceil(f.block.0 as u64) + group_depth(f.block.0));
    // + 2: the mean's product by 1/n and the rounding of 1/n to f32.
    per_thread + group_depth(plan.part.block.0) + stage2 + 2
}

/// Depth of the summation of a row of `cols` elements with groups of `g` threads.
pub(crate) fn rows_sum_depth(cols: u64, vec: u64, g: u32) -> u64 {
    // Head and tail scalars, one add per whole vector after its lanes' tree.
    let per_thread = cols.div_ceil(vec * g as u64) + vec.trailing_zeros() as u64 + 2;
    per_thread + group_depth(g) + 2
}

/// The launches of a reduction over the leading dimensions of a `rows x cols` view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ColsPlan {
    /// `reduce_sum_cols`: `(TX, COLS_BLOCK / TX)` blocks, `grid.y = chunks`.
    pub cfg: LaunchConfig,
    /// Chunks of rows, hence partial rows; 1: stage 1 writes the result itself.
    pub chunks: u32,
}

/// Plan of `reduce_sum_cols` over `rows x cols` elements, `vec` per 16-byte vector, on a GPU
/// with `sm_count` SMs holding `blocks_per_sm` of its blocks each. `None` if either is 0 or the
/// columns need more than 2^31 - 1 blocks.
///
/// `TX` is the power of two up to 32 that covers the row's vectors, so a narrow matrix puts
/// several rows in a warp. The chunks fill at most one wave of resident blocks: every block has
/// the same work, so a second, partial wave would take as long as the first; one wave with
/// four loads in flight per thread keeps several times what HBM's latency asks for in flight.
/// Never more chunks than row lanes have rows (each thread at least one row), nor more than
/// the grid allows (65535).
pub(crate) fn cols_plan(rows: u64, cols: u64, vec: u64, sm_count: u32, blocks_per_sm: u32) -> Option<ColsPlan> {
    if rows == 0 || cols == 0 {
        return None;
    }
    let nvec = cols.div_ceil(vec);
    let tx = nvec.next_power_of_two().min(32) as u32;
    let ty = COLS_BLOCK / tx;
    let gx = u32::try_from(nvec.div_ceil(tx as u64)).ok().filter(|&g| g <= i32::MAX as u32)?;
    let wave = sm_count.max(1) as u64 * blocks_per_sm.max(1) as u64;
    let chunks = (wave / gx as u64).clamp(1, rows.div_ceil(ty as u64)).min(65_535) as u32;
    let cfg = LaunchConfig { grid: (gx, chunks, 1), block: (tx, ty, 1), shared_bytes: cols_smem_bytes(vec as u32) };
    Some(ColsPlan { cfg, chunks })
}

/// Depth of the summation of one column under `plan` (see [`reduce_sum_depth`]).
pub(crate) fn cols_sum_depth(rows: u64, plan: &ColsPlan) -> u64 {
    let ty = plan.cfg.block.1 as u64;
    let per_lane = rows.div_ceil(plan.chunks as u64 * ty);
    // Rounds of UNROLL rows (a tree of depth 2, then the running sum), up to UNROLL - 1 more.
    let per_thread = per_lane.div_ceil(UNROLL as u64) + 2 + (UNROLL as u64 - 1);
    // `norm_colsum`: each lane's chunks in turn, then the lanes in turn.
    let lanes = COLSUM_LANES as u64;
    let finish = if plan.chunks > 1 { (plan.chunks as u64).div_ceil(lanes) + lanes } else { 0 };
    // + 2: the mean's product by 1/rows and the rounding of 1/rows.
    per_thread + ty.trailing_zeros() as u64 + finish + 2
}

// --- launches -----------------------------------------------------------------------------------

/// `T`'s kernels of `op` (stage 1, stage 2, rows); the mean is the scaled sum.
fn op_kernels<T: ReduceElem>(op: ReduceOp) -> ReduceOpKernels<T> {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => T::REDUCE.sum,
        ReduceOp::Max => T::REDUCE.max,
        ReduceOp::Min => T::REDUCE.min,
    }
}

/// The names of the two stages of `op` for `dt`, for the plan's occupancy queries.
fn stage_names(op: ReduceOp, dt: DType) -> [&'static str; 2] {
    with_elem!(dt, |T| {
        let k = op_kernels::<T>(op);
        [k.all.name(), k.fin.name()]
    })
}

/// The names of the two argmax stages for `dt`.
fn argmax_stage_names(dt: DType) -> [&'static str; 2] {
    with_elem!(dt, |T| [T::REDUCE.argmax_all.name(), reduce_argmax_final.name()])
}

/// `T`'s stage-1 kernel of the sums over the leading dimensions, for rows of whole 16-byte
/// vectors (`aligned`) or not; stage 2 is `norm_colsum` (listed by norm.rs).
fn cols_kernel<T: ReduceElem>(aligned: bool) -> Kernel<ReduceColsArgs<T>> {
    if aligned { T::REDUCE.sum_cols } else { T::REDUCE.sum_cols_unaligned }
}

fn plan_for(dev: &Device, n: u64, dt: DType, [part, finish]: [&str; 2]) -> Result<Option<ReducePlan>> {
    Ok(reduce_plan(
        n,
        dt.size() as u64,
        dev.sm_count(),
        dev.blocks_per_sm_256(part)?,
        dev.max_threads(part)?,
        dev.max_threads(finish)?,
    ))
}

fn vec_width(dt: DType) -> u64 {
    16 / dt.size() as u64
}

/// The factor that turns the sum into `op`'s result: `1/n` for the mean (PyTorch's `MeanOps`
/// factor, in f64 then rounded; `inf` for `n = 0`, so an empty mean is `0 * inf` = NaN).
fn scale(op: ReduceOp, n: u64) -> f32 {
    if op == ReduceOp::Mean { (1.0 / n as f64) as f32 } else { 1.0 }
}

/// Reduces the `n > 0` elements of `x` and writes the result (one element of x's dtype) at
/// device address `out`.
fn launch_whole(name: &'static str, x: &Tensor, op: ReduceOp, out: u64) -> Result<()> {
    let (dev, dt, n) = (x.device(), x.dtype(), x.numel() as u64);
    let plan = plan_for(dev, n, dt, stage_names(op, dt))?.expect("n > 0");
    let mut partial = match plan.finish {
        Some(_) => Some(Tensor::alloc(name, dev, &[plan.parts as usize], DType::F32)?),
        None => None,
    };
    let pp = partial.as_mut().map(|p| p.dev_ptr_mut::<f32>()).transpose()?.map_or(0, |p| p as u64);
    let s = scale(op, n);
    with_elem!(dt, |T| {
        let args: ReducePartArgs<T> = (x.dev_ptr(), n, pp as *mut f32, out as *mut T, s);
        // SAFETY: x holds n elements of T; out one; partial (when the grid has more than one
        // block) one f32 per block of plan.part.
        unsafe { dev.launch(op_kernels::<T>(op).all, plan.part, args) }
    })?;
    if let Some(cfg) = plan.finish {
        with_elem!(dt, |T| {
            let args: ReduceFinalArgs<T> = (pp as *const f32, plan.parts as u64, out as *mut T, s);
            // SAFETY: partial holds plan.parts floats, written by stage 1 (earlier on the stream);
            // `reduce_final` waits for stage 1 before its first access.
            unsafe { dev.launch_dependent(op_kernels::<T>(op).fin, cfg, args) }
        })?;
    }
    // The partials are freed stream-ordered, after stage 2.
    drop(partial);
    Ok(())
}

/// Argmax of the `n > 0` elements of `x`, written as one i64 at device address `out`.
fn launch_argmax_whole(name: &'static str, x: &Tensor, out: u64) -> Result<()> {
    let (dev, dt, n) = (x.device(), x.dtype(), x.numel() as u64);
    let plan = plan_for(dev, n, dt, argmax_stage_names(dt))?.expect("n > 0");
    let mut parts = match plan.finish {
        Some(_) => Some((
            Tensor::alloc(name, dev, &[plan.parts as usize], DType::F32)?,
            IndexTensor::alloc(name, dev, &[plan.parts as usize])?,
        )),
        None => None,
    };
    let (pv, pi) = match parts.as_mut() {
        Some((v, i)) => (v.dev_ptr_mut::<f32>()? as u64, i.dev_ptr_mut() as u64),
        None => (0, 0),
    };
    with_elem!(dt, |T| {
        let args: ArgmaxPartArgs<T> = (x.dev_ptr(), n, pv as *mut f32, pi as *mut u64, out as *mut i64);
        // SAFETY: x holds n elements of T; out one index; the partial arrays (when the grid has
        // more than one block) one entry per block.
        unsafe { dev.launch(T::REDUCE.argmax_all, plan.part, args) }
    })?;
    if let Some(cfg) = plan.finish {
        let args: ArgmaxFinalArgs = (pv as *const f32, pi as *const u64, plan.parts as u64, out as *mut i64);
        // SAFETY: both partial arrays hold plan.parts entries, written by stage 1; `argmax_final`
        // waits for stage 1 before its first access.
        unsafe { dev.launch_dependent(reduce_argmax_final, cfg, args) }?;
    }
    drop(parts);
    Ok(())
}

fn empty_error(name: &'static str, what: &str, shape: &[usize]) -> Error {
    Error::InvalidArgument {
        op: name,
        message: format!("{what} of an empty range has no value (shape {shape:?}); PyTorch raises too"),
    }
}

/// A tensor of `shape` whose every element is the reduction of nothing: 0 for a sum, NaN for a
/// mean, an error otherwise.
fn of_nothing(name: &'static str, x: &Tensor, op: ReduceOp, shape: &[usize]) -> Result<Tensor> {
    match op {
        ReduceOp::Sum => Tensor::zeros(x.device(), shape, x.dtype()),
        ReduceOp::Mean => Tensor::full(x.device(), shape, x.dtype(), f32::NAN),
        ReduceOp::Max | ReduceOp::Min => Err(empty_error(name, &format!("{op:?}"), x.shape())),
    }
}

/// `op` over every element of `x`; a tensor of shape `[]`.
pub fn reduce(x: &Tensor, op: ReduceOp) -> Result<Tensor> {
    let name = "reduce";
    if x.numel() == 0 {
        return of_nothing(name, x, op, &[]);
    }
    let mut out = Tensor::alloc(name, x.device(), &[], x.dtype())?;
    launch_whole(name, x, op, out.dev_ptr_mut::<u8>()? as u64)?;
    Ok(out)
}

/// The flat index of the largest element of `x` (the first one on ties, the first NaN if any);
/// shape `[]`.
pub fn argmax(x: &Tensor) -> Result<IndexTensor> {
    let name = "argmax";
    if x.numel() == 0 {
        return Err(empty_error(name, "argmax", x.shape()));
    }
    let mut out = IndexTensor::alloc(name, x.device(), &[])?;
    launch_argmax_whole(name, x, out.dev_ptr_mut() as u64)?;
    Ok(out)
}

/// `x` as `(rows, cols)` along its last dimension, and the shape of a reduction over it. A
/// scalar is one row of one element.
fn as_rows(name: &'static str, x: &Tensor) -> Result<(u64, u64, Vec<usize>)> {
    let out_shape = x.shape()[..x.shape().len().saturating_sub(1)].to_vec();
    // With a last dimension of 0 the other dimensions are not bounded by the tensor's size.
    let rows = crate::tensor::numel(name, &out_shape)? as u64;
    Ok((rows, x.last_dim() as u64, out_shape))
}

/// `op` along the last dimension of `x`; the shape of `x` without its last dimension.
pub fn reduce_last_dim(x: &Tensor, op: ReduceOp) -> Result<Tensor> {
    let name = "reduce_last_dim";
    let (dev, dt) = (x.device(), x.dtype());
    let (rows, cols, shape) = as_rows(name, x)?;
    if cols == 0 && rows > 0 {
        return of_nothing(name, x, op, &shape);
    }
    let mut out = Tensor::alloc(name, dev, &shape, dt)?;
    let op_ptr = out.dev_ptr_mut::<u8>()? as u64;
    match rows {
        0 => {}
        // One row is the whole tensor: its reduction spreads the row over every SM.
        1 => launch_whole(name, x, op, op_ptr)?,
        _ => {
            let k = with_elem!(dt, |T| op_kernels::<T>(op).rows.name());
            let g = reduce_row_group(cols, vec_width(dt), dev.max_threads(k)?);
            let cfg = rows::grid(rows, g).expect("rows > 0");
            let s = scale(op, cols);
            with_elem!(dt, |T| {
                let args: ReduceRowsArgs<T> = (x.dev_ptr(), op_ptr as *mut T, rows, cols, s);
                // SAFETY: x holds rows * cols elements of T, out rows.
                unsafe { dev.launch(op_kernels::<T>(op).rows, cfg, args) }
            })?;
        }
    }
    Ok(out)
}

/// The index along the last dimension of the largest element of each row (the first one on
/// ties, the first NaN if any); the shape of `x` without its last dimension.
pub fn argmax_last_dim(x: &Tensor) -> Result<IndexTensor> {
    let name = "argmax_last_dim";
    let (dev, dt) = (x.device(), x.dtype());
    let (rows, cols, shape) = as_rows(name, x)?;
    if cols == 0 && rows > 0 {
        return Err(empty_error(name, "argmax", x.shape()));
    }
    let mut out = IndexTensor::alloc(name, dev, &shape)?;
    let op_ptr = out.dev_ptr_mut() as u64;
    match rows {
        0 => {}
        1 => launch_argmax_whole(name, x, op_ptr)?,
        _ => {
            let k = with_elem!(dt, |T| T::REDUCE.argmax_rows.name());
            let g = reduce_row_group(cols, vec_width(dt), dev.max_threads(k)?);
            let cfg = rows::grid(rows, g).expect("rows > 0");
            with_elem!(dt, |T| {
                let args: ArgmaxRowsArgs<T> = (x.dev_ptr(), op_ptr as *mut i64, rows, cols);
                // SAFETY: x holds rows * cols elements of T, out rows indices.
                unsafe { dev.launch(T::REDUCE.argmax_rows, cfg, args) }
            })?;
        }
    }
    Ok(out)
}

fn cols_plan_for(dev: &Device, rows: u64, cols: u64, dt: DType) -> Result<Option<ColsPlan>> {
    let vec = vec_width(dt);
    let k = with_elem!(dt, |T| cols_kernel::<T>(cols.is_multiple_of(vec)).name());
    let bps = dev.blocks_per_sm(k, COLS_BLOCK, cols_smem_bytes(vec as u32))?;
    Ok(cols_plan(rows, cols, vec, dev.sm_count(), bps))
}

/// `op` over every dimension of `x` but the last: a `[..., C]` tensor to `[C]` (`x.sum(dim=0)`
/// of a matrix in PyTorch; the bias gradient of a linear layer is this sum of its output's
/// gradient). `Sum` and `Mean` (the mean of no rows is NaN, their sum 0); a 1-D tensor is one
/// row. Accumulates in f32, returns x's dtype, deterministic like every reduction here. An
/// error for a scalar (no last dimension) and for `Max` and `Min` (not implemented).
pub fn reduce_leading_dims(x: &Tensor, op: ReduceOp) -> Result<Tensor> {
    let name = "reduce_leading_dims";
    leading_dims_op(name, x, op)?;
    let (_, cols) = rows_cols(name, x)?;
    let mut out = Tensor::alloc(name, x.device(), &[cols as usize], x.dtype())?;
    leading_dims_into(name, x, op, &mut out)?;
    Ok(out)
}

/// [`reduce_leading_dims`] into `out` (shape `[C]`, x's last dimension, and x's dtype), e.g. a
/// bias gradient allocated by another library.
pub fn reduce_leading_dims_out(x: &Tensor, op: ReduceOp, out: &mut Tensor) -> Result<()> {
    let name = "reduce_leading_dims_out";
    leading_dims_op(name, x, op)?;
    leading_dims_into(name, x, op, out)
}

fn leading_dims_op(name: &'static str, x: &Tensor, op: ReduceOp) -> Result<()> {
    if !matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
        return Err(Error::InvalidArgument {
            op: name,
            message: format!("supports Sum and Mean, got {op:?} (shape {:?})", x.shape()),
        });
    }
    Ok(())
}

fn leading_dims_into(name: &'static str, x: &Tensor, op: ReduceOp, out: &mut Tensor) -> Result<()> {
    let (rows, cols) = rows_cols(name, x)?;
    check_same_device(name, x, out)?;
    check_same_dtype(name, x, out)?;
    shapes_match(name, &[cols as usize], out.shape(), "the output must be [C], x's last dimension")?;
    let (dev, dt) = (x.device(), x.dtype());
    if rows == 0 || cols == 0 {
        // The sum of nothing is 0, the mean NaN (as `of_nothing`).
        return out.fill_(if op == ReduceOp::Sum { 0.0 } else { f32::NAN });
    }
    let op_ptr = out.dev_ptr_mut::<u8>()? as u64;
    // One column is the whole tensor: its reduction spreads over every SM.
    if cols == 1 {
        return launch_whole(name, x, op, op_ptr);
    }
    let plan = cols_plan_for(dev, rows, cols, dt)?.ok_or_else(|| Error::InvalidArgument {
        op: name,
        message: format!("{cols} columns need more than 2^31 - 1 blocks (shape {:?})", x.shape()),
    })?;
    // The plan above sized its grid for this kernel's occupancy.
    let aligned = cols.is_multiple_of(vec_width(dt));
    let mut partial = match plan.chunks {
        1 => None,
        c => Some(Tensor::alloc(name, dev, &[c as usize, cols as usize], DType::F32)?),
    };
    let pp = partial.as_mut().map(|p| p.dev_ptr_mut::<f32>()).transpose()?.map_or(0, |p| p as u64);
    let s = scale(op, rows);
    with_elem!(dt, |T| {
        let args: ReduceColsArgs<T> = (x.dev_ptr(), pp as *mut f32, op_ptr as *mut T, rows, cols, s);
        // SAFETY: x holds rows * cols elements of T, out cols (checked above); partial (with more
        // than one chunk) chunks * cols floats, chunks = grid.y; the shared memory is the plan's.
        unsafe { dev.launch(cols_kernel::<T>(aligned), plan.cfg, args) }
    })?;
    if plan.chunks > 1 {
        let cfg = LaunchConfig {
            grid: (cols.div_ceil(32) as u32, 1, 1),
            block: (32, COLSUM_LANES, 1),
            shared_bytes: 32 * COLSUM_LANES * 4,
        };
        with_elem!(dt, |T| {
            let finish = <T as kernels_gpu::norm::NormElem>::NORM.colsum;
            // grid.y = 1: norm_colsum writes only its first output (the second is null).
            let args: NormColsumArgs<T> =
                (pp as *const f32, op_ptr as *mut T, std::ptr::null_mut(), plan.chunks as u64, cols);
            // SAFETY: partial holds chunks * cols floats, written by stage 1 earlier on the
            // stream; out holds cols elements; 32 * COLSUM_LANES floats of shared memory.
            unsafe { dev.launch(finish, cfg, args) }
        })?;
    }
    // The partials are freed stream-ordered, after stage 2.
    drop(partial);
    Ok(())
}

/// Upper bound on the depth of the summation of each column of `reduce_leading_dims(x, Sum |
/// Mean)` on `x`'s device, as [`reduce_sum_depth`].
pub fn reduce_leading_dims_sum_depth(x: &Tensor) -> Result<u64> {
    let (dev, dt) = (x.device(), x.dtype());
    let (rows, cols) = rows_cols("reduce_leading_dims_sum_depth", x)?;
    if cols == 1 {
        return Ok(plan_for(dev, rows, dt, stage_names(ReduceOp::Sum, dt))?
            .map_or(0, |p| whole_sum_depth(rows, vec_width(dt), &p)));
    }
    Ok(cols_plan_for(dev, rows, cols, dt)?.map_or(0, |p| cols_sum_depth(rows, &p)))
}

/// Upper bound on the depth of the summation tree of `reduce(x, Sum | Mean)` on `x`'s device
/// (`last_dim`: of `reduce_last_dim`, per row): the number of f32 roundings any one element's
/// contribution passes through, including the mean's product by `1/n` and the rounding of `1/n`.
/// To first order the f32 result `s` of a sum satisfies `|s - exact| <= depth * 2^-24 * sum |x|`
/// (and a mean the same divided by `n`), before rounding to the output dtype.
pub fn reduce_sum_depth(x: &Tensor, last_dim: bool) -> Result<u64> {
    let (dev, dt) = (x.device(), x.dtype());
    let (rows, cols, _) = as_rows("reduce_sum_depth", x)?;
    let vec = vec_width(dt);
    if last_dim && rows > 1 {
        let k = with_elem!(dt, |T| T::REDUCE.sum.rows.name());
        return Ok(rows_sum_depth(cols, vec, reduce_row_group(cols, vec, dev.max_threads(k)?)));
    }
    let n = if last_dim { cols } else { x.numel() as u64 };
    Ok(plan_for(dev, n, dt, stage_names(ReduceOp::Sum, dt))?.map_or(0, |p| whole_sum_depth(n, vec, &p)))
}

/// Reductions as methods.
impl Tensor {
    /// Sum of every element; shape `[]`.
    pub fn sum(&self) -> Result<Tensor> {
        reduce(self, ReduceOp::Sum)
    }
    /// Mean of every element (NaN for an empty tensor); shape `[]`.
    pub fn mean(&self) -> Result<Tensor> {
        reduce(self, ReduceOp::Mean)
    }
    /// Largest element (NaN if any is NaN); shape `[]`.
    pub fn max(&self) -> Result<Tensor> {
        reduce(self, ReduceOp::Max)
    }
    /// Smallest element (NaN if any is NaN); shape `[]`.
    pub fn min(&self) -> Result<Tensor> {
        reduce(self, ReduceOp::Min)
    }
    /// Flat index of the largest element; shape `[]`.
    pub fn argmax(&self) -> Result<IndexTensor> {
        argmax(self)
    }
    /// Sums along the last dimension.
    pub fn sum_last_dim(&self) -> Result<Tensor> {
        reduce_last_dim(self, ReduceOp::Sum)
    }
    /// Means along the last dimension.
    pub fn mean_last_dim(&self) -> Result<Tensor> {
        reduce_last_dim(self, ReduceOp::Mean)
    }
    /// Maxima along the last dimension.
    pub fn max_last_dim(&self) -> Result<Tensor> {
        reduce_last_dim(self, ReduceOp::Max)
    }
    /// Minima along the last dimension.
    pub fn min_last_dim(&self) -> Result<Tensor> {
        reduce_last_dim(self, ReduceOp::Min)
    }
    /// Indices of the maxima along the last dimension.
    pub fn argmax_last_dim(&self) -> Result<IndexTensor> {
        argmax_last_dim(self)
    }
    /// Sums over every dimension but the last (`[..., C]` to `[C]`).
    pub fn sum_leading_dims(&self) -> Result<Tensor> {
        reduce_leading_dims(self, ReduceOp::Sum)
    }
    /// Means over every dimension but the last.
    pub fn mean_leading_dims(&self) -> Result<Tensor> {
        reduce_leading_dims(self, ReduceOp::Mean)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100: (u32, u32) = (132, 8);

    fn plan(n: u64, elem: u64) -> ReducePlan {
        reduce_plan(n, elem, H100.0, H100.1, 1024, 1024).unwrap()
    }

    #[test]
    fn whole_plan_covers_and_bounds_the_grid() {
        assert_eq!(reduce_plan(0, 4, 132, 8, 1024, 1024), None);
        for elem in [4u64, 2] {
            let vec = 16 / elem;
            let round = 64 / elem;
            for n in [1u64, 7, 8, 9, 31, 1000, 16384, 16385, 32768, 32769, 1 << 20, 100_003, 1 << 28, (1 << 31) + 7] {
                let p = plan(n, elem);
                let threads = p.part.block.0;
                assert!(threads.is_multiple_of(32) && (32..=1024).contains(&threads), "n={n}: {p:?}");
                assert_eq!(p.part.grid, (p.parts, 1, 1));
                assert_eq!(p.part.shared_bytes, reduce_smem_bytes(threads));
                // Every tail element has a thread.
                assert!((p.parts * threads) as u64 >= n % vec);
                if n * elem <= REDUCE_ONE_BLOCK_BYTES {
                    // One launch, one round per thread.
                    assert_eq!((p.parts, p.finish), (1, None), "n={n}");
                    assert!(threads as u64 * round >= n && (threads == 32 || (threads as u64 - 32) * round < n));
                } else {
                    assert_eq!(threads, PART_BLOCK);
                    assert!(p.parts > 1 && p.parts <= H100.0 * H100.1, "n={n}: {p:?}");
                    // At least one round of loads per thread (no idle blocks).
                    assert!((p.parts as u64 - 1) * threads as u64 * round < n);
                    let f = p.finish.expect("two stages");
                    assert!(f.block.0.is_multiple_of(32) && f.block.0 >= p.parts.min(1024) && f.block.0 <= 1024);
                    assert_eq!(f.grid, (1, 1, 1));
                    assert_eq!(f.shared_bytes, reduce_smem_bytes(f.block.0));
                }
            }
        }
        // Large tensors: exactly one wave.
        assert_eq!(plan(1 << 28, 4).parts, 132 * 8);
        assert_eq!(plan(1 << 28, 4).finish.unwrap().block.0, 1024);
        // A kernel limited to 512 threads, a GPU of one block.
        let p = reduce_plan(10_000, 4, 132, 8, 520, 1024).unwrap();
        assert_eq!(p.part.block.0, 512);
        let p = reduce_plan(1 << 20, 4, 1, 1, 1024, 1024).unwrap();
        assert_eq!((p.parts, p.finish), (1, None));
    }

    #[test]
    fn row_groups() {
        for vec in [4u64, 8] {
            for cols in 1..2000 {
                let g = reduce_row_group(cols, vec, 1024) as u64;
                assert!(g.is_power_of_two() || g.is_multiple_of(32));
                assert!(g * REDUCE_ROW_VECTORS * vec >= cols.min(1024 * REDUCE_ROW_VECTORS * vec));
            }
        }
        assert_eq!(reduce_row_group(1, 4, 1024), 1);
        assert_eq!(reduce_row_group(33, 4, 1024), 2); // 9 vectors
        assert_eq!(reduce_row_group(1024, 4, 1024), 32); // a warp per row of 1024 f32
        assert_eq!(reduce_row_group(1024, 8, 1024), 16);
        assert_eq!(reduce_row_group(100_003, 4, 1024), 1024); // 3126 wanted, capped
        assert_eq!(reduce_row_group(1_000_003, 4, 640), 640);
        assert_eq!(reduce_row_group(1_000_003, 4, 100), 96);
    }

    #[test]
    fn column_plans_cover_the_matrix() {
        let (sms, bps) = H100;
        assert_eq!(cols_plan(0, 5, 4, sms, bps), None);
        assert_eq!(cols_plan(5, 0, 4, sms, bps), None);
        for vec in [4u64, 8] {
            for cols in [2u64, 3, 4, 5, 7, 8, 9, 31, 33, 127, 128, 129, 1000, 4096, 4097, 100_003, 1 << 20] {
                for rows in [1u64, 2, 7, 8, 255, 256, 257, 1000, 8192, 1 << 20] {
                    let p = cols_plan(rows, cols, vec, sms, bps).unwrap();
                    let (tx, ty) = (p.cfg.block.0 as u64, p.cfg.block.1 as u64);
                    let ctx = format!("{rows} x {cols}, vec {vec}: {p:?}");
                    assert!(tx.is_power_of_two() && tx <= 32 && tx * ty == COLS_BLOCK as u64, "{ctx}");
                    // Every column vector has a thread; no tile is empty.
                    let nvec = cols.div_ceil(vec);
                    assert!(p.cfg.grid.0 as u64 * tx >= nvec && (p.cfg.grid.0 as u64 - 1) * tx < nvec, "{ctx}");
                    assert!(tx >= nvec.min(32), "{ctx}");
                    // Chunks: grid.y, at least one row per row lane, at most a wave of blocks
                    // (unless the columns alone need more).
                    assert_eq!(p.cfg.grid.1, p.chunks, "{ctx}");
                    assert!(p.chunks >= 1 && (p.chunks as u64 - 1) * ty < rows, "{ctx}");
                    assert!(p.chunks == 1 || p.chunks as u64 * p.cfg.grid.0 as u64 <= (sms * bps) as u64, "{ctx}");
                    assert_eq!(p.cfg.shared_bytes, cols_smem_bytes(vec as u32));
                }
            }
        }
        // The bench's 8192 x 4096 f32: 32 tiles of 128 columns, 33 chunks of 248 rows: one wave.
        let p = cols_plan(8192, 4096, 4, sms, bps).unwrap();
        assert_eq!((p.cfg.grid, p.cfg.block), ((32, 33, 1), (32, 8, 1)));
        // Four f32 columns: a thread per row vector, 256 rows per block.
        let p = cols_plan(1 << 20, 4, 4, sms, bps).unwrap();
        assert_eq!((p.cfg.grid.0, p.cfg.block), (1, (1, 256, 1)));
        // One row of ten f32 columns: 3 vectors, blocks of 4 x 64, one chunk.
        assert_eq!(cols_sum_depth(1, &cols_plan(1, 10, 4, sms, bps).unwrap()), 1 + 2 + 3 + 6 + 2);
        // 8192 x 4096 f32: up to 32 rows per lane (8 rounds), a tree over 8 lanes, 33 chunks.
        assert_eq!(cols_sum_depth(8192, &p_bench()), 8 + 2 + 3 + 3 + (3 + 16) + 2);
    }

    fn p_bench() -> ColsPlan {
        cols_plan(8192, 4096, 4, H100.0, H100.1).unwrap()
    }

    #[test]
    fn summation_depths() {
        assert_eq!(group_depth(1), 0);
        assert_eq!(group_depth(8), 3);
        assert_eq!(group_depth(32), 5);
        assert_eq!(group_depth(256), 5 + 5);
        assert_eq!(group_depth(1024), 5 + 5);
        // 2^28 f32 on an H100 (one wave of 1056 blocks of 256 threads):
        let p = plan(1 << 28, 4);
        // 63 rounds + the round's tree (2 + 2) + 3 leftover vectors and the tail, block of 256
        // (5 + 5), stage 2 (2 partials per thread, then 5 + 5), the mean (2).
        assert_eq!(whole_sum_depth(1 << 28, 4, &p), 63 + 4 + 4 + 10 + 2 + 10 + 2);
        // One block: one round.
        let p = plan(1000, 4);
        assert_eq!(whole_sum_depth(1000, 4, &p), 1 + 2 + 2 + 4 + group_depth(64) + 2);
        assert_eq!(rows_sum_depth(1024, 4, 128), 2 + 2 + 2 + group_depth(128) + 2);
    }
}
