//! Batch norm 2d (host side of `kernels-gpu/src/batchnorm.rs`): [`batch_norm`] (training or
//! evaluation forward) and [`batch_norm_backward`], as PyTorch's `F.batch_norm` and its
//! autograd, over `[N, C, H, W]` or `[N, H, W, C]` ([`Layout2d`]).
//!
//! The statistics, weight, bias and running statistics are f32 (`[C]`) for every dtype of `x`,
//! as cuDNN and PyTorch's mixed precision keep them. Deterministic: the order of every sum
//! depends only on the shape.
//!
//! Edge cases, as PyTorch: training with `N * H * W == 1` is an error (`F.batch_norm` raises
//! "Expected more than 1 value per channel when training"); with `N * H * W == 0` the output
//! is empty and the running statistics are left alone (the saved mean and invstd are then 0).

use super::check::{check_same_device, shapes_match, with_elem};
use crate::DType;
use crate::device::LaunchConfig;
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::Tensor;
use kernels_gpu::batchnorm::{
    ApplyArgs, BatchNormElem, BwdArgs, BwdFinalizeArgs, FINAL_THREADS, FinalizeArgs, NCHW, NHWC, ReduceArgs,
    STATS_THREADS, StatsArgs, batch_norm_bwd_finalize, batch_norm_fwd_finalize, plan,
};

/// How a 4-d image tensor is laid out in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout2d {
    /// `[N, C, H, W]`, PyTorch's default.
    #[default]
    Nchw,
    /// `[N, H, W, C]`: PyTorch's `channels_last` (a tensor of logical shape `[N, C, H, W]` whose
    /// memory is in this order); the tensor here has the physical shape `[N, H, W, C]`.
    Nhwc,
}

impl Layout2d {
    /// The kernels' `layout` parameter.
    pub(crate) fn code(self) -> u32 {
        match self {
            Layout2d::Nchw => NCHW,
            Layout2d::Nhwc => NHWC,
        }
    }

    /// `(N, C, H, W)` of a rank-4 shape in this layout (an error naming `op` for another rank).
    pub fn dims(self, op: &'static str, shape: &[usize]) -> Result<(usize, usize, usize, usize)> {
        let &[a, b, c, d] = shape else {
            return Err(Error::InvalidArgument {
                op,
                message: format!("needs a 4-d tensor ({self:?}), got shape {shape:?}"),
            });
        };
        Ok(match self {
            Layout2d::Nchw => (a, b, c, d),
            Layout2d::Nhwc => (a, d, b, c),
        })
    }

    /// The shape of `(N, C, H, W)` in this layout.
    pub fn shape(self, n: usize, c: usize, h: usize, w: usize) -> [usize; 4] {
        match self {
            Layout2d::Nchw => [n, c, h, w],
            Layout2d::Nhwc => [n, h, w, c],
        }
    }
}

/// PyTorch's defaults of `nn.BatchNorm2d`.
pub const BATCH_NORM_EPS: f32 = 1e-5;
/// PyTorch's default momentum of the running statistics.
pub const BATCH_NORM_MOMENTUM: f32 = 0.1;

/// Options of [`batch_norm`] and [`batch_norm_backward`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormOpts {
    /// Batch statistics (and the running statistics updated, if given); else the running ones.
    pub training: bool,
    /// `running = (1 - momentum) running + momentum batch`.
    pub momentum: f32,
    /// Added to the variance.
    pub eps: f32,
    /// The memory layout of `x` (and of the gradients).
    pub layout: Layout2d,
}

impl Default for BatchNormOpts {
    fn default() -> Self {
        BatchNormOpts { training: true, momentum: BATCH_NORM_MOMENTUM, eps: BATCH_NORM_EPS, layout: Layout2d::Nchw }
    }
}

/// What the forward saves for the backward: per channel, f32 `[C]`.
#[derive(Debug)]
pub struct BatchNormStats {
    /// The batch mean (training) or the running mean (evaluation).
    pub mean: Tensor,
    /// `1 / sqrt(var + eps)` of the biased batch variance (training) or the running variance.
    pub invstd: Tensor,
}

/// Gradients of a batch norm.
#[derive(Debug)]
pub struct BatchNormGrads {
    /// Of the input: its shape and dtype.
    pub x: Tensor,
    /// Of the weight (f32 `[C]`), where the forward had one.
    pub weight: Option<Tensor>,
    /// Of the bias (f32 `[C]`), where the forward had one.
    pub bias: Option<Tensor>,
}

/// A per-channel parameter: f32 `[c]` on `x`'s device.
fn check_param(op: &'static str, x: &Tensor, p: &Tensor, c: usize, what: &'static str) -> Result<()> {
    check_same_device(op, x, p)?;
    if p.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch { op, expected: DType::F32, got: p.dtype() });
    }
    shapes_match(op, &[c], p.shape(), what)
}

/// `(N, C, H, W)` of `x`, with the grid's limits.
fn dims(op: &'static str, x: &Tensor, layout: Layout2d) -> Result<(usize, usize, usize, usize)> {
    let (n, c, h, w) = layout.dims(op, x.shape())?;
    if c > i32::MAX as usize {
        return Err(Error::InvalidArgument { op, message: format!("{c} channels, more than the grid's 2^31 - 1") });
    }
    Ok((n, c, h, w))
}

/// The grid of a statistics launch over `c` channels of `m` positions, with its chunk length
/// and count; `None` when `m == 0`.
fn stats_grid(layout: u32, c: u64, m: u64) -> Option<(LaunchConfig, u64, u64)> {
    let p = plan(layout, c, m);
    (p.chunks > 0 && p.gx > 0).then_some((
        LaunchConfig {
            grid: (p.gx as u32, p.chunks as u32, 1),
            block: (p.block.0, p.block.1, 1),
            shared_bytes: 4 * STATS_THREADS * 4,
        },
        p.chunk,
        p.chunks,
    ))
}

/// A block of [`FINAL_THREADS`] per channel.
fn final_grid(c: u64) -> LaunchConfig {
    LaunchConfig { grid: (c as u32, 1, 1), block: (FINAL_THREADS, 1, 1), shared_bytes: 4 * FINAL_THREADS * 4 }
}

/// Batch norm 2d, as `F.batch_norm(x, running_mean, running_var, weight, bias, training,
/// momentum, eps)`: `y = (x - mean) / sqrt(var + eps) * weight + bias` per channel, in x's shape
/// and dtype, and the statistics the backward needs.
///
/// - `x`: `[N, C, H, W]` or `[N, H, W, C]` (`opts.layout`), f32, f16 or bf16.
/// - `weight`, `bias` (optional: 1 and 0), `running_mean`, `running_var`: f32 `[C]`.
/// - Training: the batch mean and biased variance over `N * H * W` (f32, a stable merge of
///   shifted sums); the running statistics, if given (both or neither), become
///   `(1 - momentum) r + momentum s` with the batch mean and the unbiased variance. Evaluation:
///   the running statistics normalise, and are required.
pub fn batch_norm(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    running_mean: Option<&mut Tensor>,
    running_var: Option<&mut Tensor>,
    opts: &BatchNormOpts,
) -> Result<(Tensor, BatchNormStats)> {
    let op = "batch_norm";
    let (_, c, _, _) = dims(op, x, opts.layout)?;
    let dev = x.device();
    let mut y = Tensor::alloc(op, dev, x.shape(), x.dtype())?;
    let mut stats = BatchNormStats {
        mean: Tensor::alloc(op, dev, &[c], DType::F32)?,
        invstd: Tensor::alloc(op, dev, &[c], DType::F32)?,
    };
    batch_norm_out(x, weight, bias, running_mean, running_var, opts, &mut y, &mut stats)?;
    Ok((y, stats))
}

/// [`batch_norm`] into `y` (x's shape, dtype and device) and `stats` (f32 `[C]` each).
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_out(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    running_mean: Option<&mut Tensor>,
    running_var: Option<&mut Tensor>,
    opts: &BatchNormOpts,
    y: &mut Tensor,
    stats: &mut BatchNormStats,
) -> Result<()> {
    let op = "batch_norm";
    let (n, c, h, w) = dims(op, x, opts.layout)?;
    check_same_device(op, x, y)?;
    if y.dtype() != x.dtype() {
        return Err(Error::DTypeMismatch { op, expected: x.dtype(), got: y.dtype() });
    }
    shapes_match(op, x.shape(), y.shape(), "y must have x's shape")?;
    check_param(op, x, &stats.mean, c, "the saved mean must be [C], f32")?;
    check_param(op, x, &stats.invstd, c, "the saved invstd must be [C], f32")?;
    for (p, what) in [(weight, "the weight must be [C], f32"), (bias, "the bias must be [C], f32")] {
        if let Some(p) = p {
            check_param(op, x, p, c, what)?;
        }
    }
    let (mut rm, mut rv) = (running_mean, running_var);
    match (&rm, &rv) {
        (Some(a), Some(b)) => {
            check_param(op, x, a, c, "running_mean must be [C], f32")?;
            check_param(op, x, b, c, "running_var must be [C], f32")?;
        }
        (None, None) if opts.training => {}
        _ => {
            return Err(Error::InvalidArgument {
                op,
                message: if opts.training {
                    "running_mean and running_var must be given together".into()
                } else {
                    "evaluation needs running_mean and running_var".into()
                },
            });
        }
    }
    let hw = h.saturating_mul(w);
    let m = n.saturating_mul(hw);
    if opts.training && m == 1 {
        return Err(Error::InvalidArgument {
            op,
            message: format!("expected more than 1 value per channel when training, got input shape {:?}", x.shape()),
        });
    }
    let dev = x.device().clone();
    let BatchNormStats { mean, invstd } = stats;
    if c == 0 {
        return Ok(());
    }
    let (layout, cu, hwu, mu) = (opts.layout.code(), c as u64, hw as u64, m as u64);
    let null = std::ptr::null_mut::<f32>();
    let rm_ptr = match rm.as_mut() {
        Some(t) => t.dev_ptr_mut::<f32>()?,
        None => null,
    };
    let rv_ptr = match rv.as_mut() {
        Some(t) => t.dev_ptr_mut::<f32>()?,
        None => null,
    };
    with_elem!(x.dtype(), |T| {
        let mut chunks = 0;
        let mut partial = None;
        if opts.training
            && let Some((cfg, chunk, nch)) = stats_grid(layout, cu, mu)
        {
            let mut part = Tensor::alloc(op, &dev, &[c * nch as usize * 4], DType::F32)?;
            let args: StatsArgs<T> = (x.dev_ptr(), part.dev_ptr_mut()?, cu, hwu, mu, chunk, layout);
            // SAFETY: x holds n c h w elements (its shape, checked), part 4 c chunks floats; the
            // block's shared memory holds 4 floats a thread.
            unsafe { dev.launch(<T as BatchNormElem>::STATS, cfg, args) }?;
            chunks = nch;
            partial = Some(part);
        }
        let pptr = partial.as_ref().map_or(std::ptr::null(), |p| p.dev_ptr::<f32>());
        let args: FinalizeArgs = (
            pptr,
            chunks,
            cu,
            mu,
            mean.dev_ptr_mut()?,
            invstd.dev_ptr_mut()?,
            rm_ptr,
            rv_ptr,
            opts.momentum,
            opts.eps,
            opts.training as u32,
        );
        // SAFETY: partial holds 4 c chunks floats (read only in training, where chunks is 0
        // without it); mean, invstd and the running statistics (checked [C], or null in
        // training) hold c floats, each its own memory (`dev_ptr_mut`).
        unsafe { dev.launch(batch_norm_fwd_finalize, final_grid(cu), args) }?;
        let total = x.numel() as u64;
        let kernel = <T as BatchNormElem>::FWD;
        if let Some(cfg) = launch::elementwise(total, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?) {
            let wp = weight.map_or(std::ptr::null(), |t| t.dev_ptr::<f32>());
            let bp = bias.map_or(std::ptr::null(), |t| t.dev_ptr::<f32>());
            let args: ApplyArgs<T> =
                (x.dev_ptr(), y.dev_ptr_mut()?, mean.dev_ptr(), invstd.dev_ptr(), wp, bp, total, cu, hwu, layout);
            // SAFETY: x and y hold `total` elements, the per-channel arrays c floats (or null);
            // y is new memory.
            unsafe { dev.launch(kernel, cfg, args) }?;
        }
        Ok::<(), Error>(())
    })?;
    Ok(())
}

/// The gradients of [`batch_norm`] from the incoming gradient `grad` (x's shape and dtype), with
/// PyTorch's formulas: `dbias = sum dy`, `dweight = sum dy (x - mean) invstd`, and
/// `dx = (dy - sum dy / M - (x - mean) invstd^2 sum dy (x - mean) / M) invstd weight` in training
/// (`M = N H W`), `dy invstd weight` in evaluation (`opts.training` must be the forward's).
/// `stats` is what the forward returned; `weight` and `bias` the forward's (the gradient of
/// each is returned where it was given). Sums in f32, deterministic.
pub fn batch_norm_backward(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    stats: &BatchNormStats,
    grad: &Tensor,
    opts: &BatchNormOpts,
) -> Result<BatchNormGrads> {
    let op = "batch_norm_backward";
    let (_, c, _, _) = dims(op, x, opts.layout)?;
    let dev = x.device();
    let mut grads = BatchNormGrads {
        x: Tensor::alloc(op, dev, x.shape(), x.dtype())?,
        weight: weight.map(|_| Tensor::alloc(op, dev, &[c], DType::F32)).transpose()?,
        bias: bias.map(|_| Tensor::alloc(op, dev, &[c], DType::F32)).transpose()?,
    };
    batch_norm_backward_out(x, weight, stats, grad, opts, &mut grads)?;
    Ok(grads)
}

/// [`batch_norm_backward`] into `grads`: `x` of x's shape and dtype, and the weight's and bias's
/// gradients (f32 `[C]`) where present (either may be asked for with or without a weight; the
/// weight only scales `dx`).
pub fn batch_norm_backward_out(
    x: &Tensor,
    weight: Option<&Tensor>,
    stats: &BatchNormStats,
    grad: &Tensor,
    opts: &BatchNormOpts,
    grads: &mut BatchNormGrads,
) -> Result<()> {
    let op = "batch_norm_backward";
    let (n, c, h, w) = dims(op, x, opts.layout)?;
    check_same_device(op, x, grad)?;
    if grad.dtype() != x.dtype() {
        return Err(Error::DTypeMismatch { op, expected: x.dtype(), got: grad.dtype() });
    }
    shapes_match(op, x.shape(), grad.shape(), "grad must have x's shape")?;
    for (p, what) in [
        (weight, "the weight must be [C], f32"),
        (Some(&stats.mean), "the saved mean must be [C], f32"),
        (Some(&stats.invstd), "the saved invstd must be [C], f32"),
        (grads.weight.as_ref(), "the weight's gradient must be [C], f32"),
        (grads.bias.as_ref(), "the bias's gradient must be [C], f32"),
    ] {
        if let Some(p) = p {
            check_param(op, x, p, c, what)?;
        }
    }
    check_same_device(op, x, &grads.x)?;
    if grads.x.dtype() != x.dtype() {
        return Err(Error::DTypeMismatch { op, expected: x.dtype(), got: grads.x.dtype() });
    }
    shapes_match(op, x.shape(), grads.x.shape(), "dx must have x's shape")?;
    let dev = x.device().clone();
    let BatchNormGrads { x: dx, weight: dw, bias: db } = grads;
    if c == 0 {
        return Ok(());
    }
    let hw = h * w;
    let m = n * hw;
    let (layout, cu, hwu, mu) = (opts.layout.code(), c as u64, hw as u64, m as u64);
    let mut sums = Tensor::alloc(op, &dev, &[2 * c], DType::F32)?;
    with_elem!(x.dtype(), |T| {
        let mut chunks = 0;
        let mut partial = None;
        if let Some((cfg, chunk, nch)) = stats_grid(layout, cu, mu) {
            let mut part = Tensor::alloc(op, &dev, &[c * nch as usize * 2], DType::F32)?;
            let args: ReduceArgs<T> =
                (x.dev_ptr(), grad.dev_ptr(), stats.mean.dev_ptr(), part.dev_ptr_mut()?, cu, hwu, mu, chunk, layout);
            // SAFETY: x and grad hold n c h w elements (checked shapes), the mean c floats, part
            // 2 c chunks floats; shared memory holds 4 floats a thread.
            unsafe { dev.launch(<T as BatchNormElem>::REDUCE, cfg, args) }?;
            chunks = nch;
            partial = Some(part);
        }
        let null = std::ptr::null_mut::<f32>();
        let dwp = match dw.as_mut() {
            Some(t) => t.dev_ptr_mut::<f32>()?,
            None => null,
        };
        let dbp = match db.as_mut() {
            Some(t) => t.dev_ptr_mut::<f32>()?,
            None => null,
        };
        let pptr = partial.as_ref().map_or(std::ptr::null(), |p| p.dev_ptr::<f32>());
        let args: BwdFinalizeArgs = (pptr, chunks, cu, stats.invstd.dev_ptr(), sums.dev_ptr_mut()?, dwp, dbp);
        // SAFETY: partial holds 2 c chunks floats (none read when chunks is 0); invstd, dw, db
        // hold c floats (or are null), sums 2 c; the outputs are new memory.
        unsafe { dev.launch(batch_norm_bwd_finalize, final_grid(cu), args) }?;
        let total = x.numel() as u64;
        let kernel = <T as BatchNormElem>::BWD;
        if let Some(cfg) = launch::elementwise(total, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?) {
            let wp = weight.map_or(std::ptr::null(), |t| t.dev_ptr::<f32>());
            let args: BwdArgs<T> = (
                x.dev_ptr(),
                grad.dev_ptr(),
                dx.dev_ptr_mut()?,
                stats.mean.dev_ptr(),
                stats.invstd.dev_ptr(),
                wp,
                sums.dev_ptr(),
                total,
                cu,
                hwu,
                mu,
                layout,
                opts.training as u32,
            );
            // SAFETY: x, grad and dx hold `total` elements, the per-channel arrays c floats (or
            // null), sums 2 c; dx is new memory.
            unsafe { dev.launch(kernel, cfg, args) }?;
        }
        Ok::<(), Error>(())
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_and_grids() {
        assert_eq!(Layout2d::Nchw.dims("t", &[2, 3, 4, 5]).unwrap(), (2, 3, 4, 5));
        assert_eq!(Layout2d::Nhwc.dims("t", &[2, 4, 5, 3]).unwrap(), (2, 3, 4, 5));
        assert_eq!(Layout2d::Nhwc.shape(2, 3, 4, 5), [2, 4, 5, 3]);
        assert!(matches!(Layout2d::Nchw.dims("t", &[2, 3, 4]), Err(Error::InvalidArgument { .. })));
        assert!(stats_grid(NCHW, 3, 0).is_none());
        let (cfg, chunk, chunks) = stats_grid(NHWC, 64, 802_816).unwrap();
        assert_eq!((cfg.grid.0, cfg.block.0 * cfg.block.1), (2, STATS_THREADS));
        assert!(chunk * chunks >= 802_816 && cfg.grid.1 as u64 == chunks);
    }
}
