//! Cross-entropy over class indices, fused with the log-softmax (host side of
//! `kernels-gpu/src/cross_entropy.rs`), forward and backward, as PyTorch's `F.cross_entropy`.

use super::check::{check_same_device, check_same_dtype, with_elem};
use crate::device::LaunchConfig;
use crate::error::{Error, Result};
use crate::rows;
use crate::tensor::{IndexTensor, Tensor};
use kernels_gpu::DType;
use kernels_gpu::cross_entropy::{
    CrossEntropyBwdArgs, CrossEntropyCountArgs, CrossEntropyElem, CrossEntropyFwdArgs, CrossEntropyOnePassArgs,
    CrossEntropyReduceArgs, MODE_MEAN, MODE_NONE, MODE_SUM, REDUCE_THREADS, cross_entropy_count,
};
use kernels_gpu::rows::reduce_smem_bytes;

/// How the per-row losses are combined, as PyTorch's `reduction`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// One loss per row.
    None,
    /// Their sum.
    Sum,
    /// Their mean over the rows whose target is not ignored (NaN when all are).
    Mean,
}

/// The options of [`cross_entropy`], with PyTorch's defaults: mean, `ignore_index = -100`, no
/// label smoothing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOpts {
    /// How the rows' losses are combined.
    pub reduction: Reduction,
    /// Rows whose target is this class contribute no loss and get a zero gradient.
    pub ignore_index: i64,
    /// In `[0, 1]`: the target distribution is `(1 - s)` on the class plus `s / C` everywhere.
    pub label_smoothing: f32,
}

impl Default for CrossEntropyOpts {
    fn default() -> Self {
        CrossEntropyOpts { reduction: Reduction::Mean, ignore_index: -100, label_smoothing: 0.0 }
    }
}

impl Reduction {
    fn mode(self) -> u32 {
        match self {
            Reduction::None => MODE_NONE,
            Reduction::Sum => MODE_SUM,
            Reduction::Mean => MODE_MEAN,
        }
    }
}

/// What the forward keeps for the backward: each row's log-sum-exp (f32 `[N]`) and the number
/// of rows not ignored (f32 `[1]`), both on the device.
#[derive(Debug)]
pub struct CrossEntropySaved {
    lse: Tensor,
    count: Tensor,
    opts: CrossEntropyOpts,
}

impl CrossEntropySaved {
    /// What [`cross_entropy_out`] writes into and [`cross_entropy_backward`] reads, over given
    /// tensors: `lse` f32 `[N]` and `count` f32 `[1]` (e.g. memory of another library's
    /// allocator, see [`crate::interop`]).
    pub fn from_parts(lse: Tensor, count: Tensor, opts: CrossEntropyOpts) -> Result<CrossEntropySaved> {
        let op = "CrossEntropySaved::from_parts";
        for (t, what) in [(&lse, "lse"), (&count, "count")] {
            if t.dtype() != DType::F32 {
                return Err(Error::InvalidArgument { op, message: format!("{what} must be f32, got {:?}", t.dtype()) });
            }
        }
        check_same_device(op, &lse, &count)?;
        if lse.shape().len() != 1 {
            return Err(Error::InvalidArgument { op, message: format!("lse must be [N], got {:?}", lse.shape()) });
        }
        super::check::shapes_match(op, &[1], count.shape(), "count holds one number")?;
        Ok(CrossEntropySaved { lse, count, opts })
    }
}

fn check(op: &'static str, logits: &Tensor, target: &IndexTensor, opts: &CrossEntropyOpts) -> Result<(u64, u64)> {
    if logits.shape().len() != 2 {
        return Err(Error::InvalidArgument {
            op,
            message: format!("logits must be [N, C], got shape {:?}", logits.shape()),
        });
    }
    let (n, c) = (logits.shape()[0], logits.shape()[1]);
    if target.shape() != [n] {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![n],
            got: target.shape().to_vec(),
            detail: "one target class index per row of the logits",
        });
    }
    if target.device() != logits.device() {
        return Err(Error::DeviceMismatch { op, expected: logits.device().ordinal(), got: target.device().ordinal() });
    }
    if c == 0 && n > 0 {
        return Err(Error::InvalidArgument { op, message: "logits have no classes (C = 0)".into() });
    }
    let s = opts.label_smoothing;
    if !(0.0..=1.0).contains(&s) {
        return Err(Error::InvalidArgument { op, message: format!("label_smoothing must be in [0, 1], got {s}") });
    }
    Ok((n as u64, c as u64))
}

/// Launch of the row kernel `kernel`: a group per row, four vectors per thread per pass, at
/// most as many threads as the kernel's registers allow in one block (the f16 backward takes
/// 70 registers on sm_90, over the 64 of a 1024-thread block).
fn plan(dev: &crate::Device, kernel: &str, dt: DType, rows: u64, cols: u64) -> Result<Option<LaunchConfig>> {
    let vec = with_elem!(dt, |T| <T as kernels_gpu::Elem>::VEC as u64);
    let g = rows::group_size(cols.div_ceil(vec), 4);
    let g = if g <= 32 { g } else { g.min((dev.max_threads(kernel)? / 32 * 32).max(32)) };
    Ok(rows::grid(rows, g))
}

/// Cross-entropy of `logits` (`[N, C]`) against class indices `target` (`[N]`), as
/// `F.cross_entropy(logits, target, reduction=, ignore_index=, label_smoothing=)`. Returns the
/// loss (shape `[]`, or `[N]` for [`Reduction::None`], in the logits' dtype) and what the
/// backward needs. A target outside `[0, C)` that is not `ignore_index` is an
/// [`Error::InvalidArgument`] naming its row (checking costs a synchronisation with the device),
/// except on a stream capturing a CUDA graph ([`crate::Device::is_capturing`]): nothing may wait
/// for it, and such a target's loss is NaN.
pub fn cross_entropy(
    logits: &Tensor,
    target: &IndexTensor,
    opts: CrossEntropyOpts,
) -> Result<(Tensor, CrossEntropySaved)> {
    let op = "cross_entropy";
    let (rows, _) = check(op, logits, target, &opts)?;
    let dev = logits.device();
    let dt = logits.dtype();
    let mut saved = CrossEntropySaved {
        lse: Tensor::alloc(op, dev, &[rows as usize], DType::F32)?,
        count: Tensor::alloc(op, dev, &[1], DType::F32)?,
        opts,
    };
    let mut out = if opts.reduction == Reduction::None {
        Tensor::alloc(op, dev, &[rows as usize], dt)?
    } else {
        Tensor::alloc(op, dev, &[], dt)?
    };
    cross_entropy_out(logits, target, opts, &mut out, &mut saved)?;
    Ok((out, saved))
}

/// [`cross_entropy`] into `out` (shape `[]`, or `[N]` for [`Reduction::None`], the logits' dtype)
/// and `saved` (from [`CrossEntropySaved::from_parts`] over `[N]` and `[1]`, or an earlier
/// forward's), which remembers `opts` for the backward.
pub fn cross_entropy_out(
    logits: &Tensor,
    target: &IndexTensor,
    opts: CrossEntropyOpts,
    out: &mut Tensor,
    saved: &mut CrossEntropySaved,
) -> Result<()> {
    let op = "cross_entropy";
    let (rows, cols) = check(op, logits, target, &opts)?;
    let dev = logits.device();
    let dt = logits.dtype();
    check_same_device(op, logits, out)?;
    check_same_dtype(op, logits, out)?;
    let want: &[usize] = if opts.reduction == Reduction::None { &[rows as usize] } else { &[] };
    super::check::shapes_match(op, want, out.shape(), "the loss has one entry per row, or none when reduced")?;
    check_same_device(op, logits, &saved.lse)?;
    super::check::shapes_match(op, &[rows as usize], saved.lse.shape(), "lse has one entry per row")?;
    saved.opts = opts;
    let CrossEntropySaved { lse, count, .. } = saved;
    let mut loss_f32 = Tensor::alloc(op, dev, &[rows as usize], DType::F32)?;
    let mut bad = IndexTensor::zeros(dev, &[1])?;
    let kernel = with_elem!(dt, |T| T::CROSS_ENTROPY.fwd.name());
    if let Some(cfg) = plan(dev, kernel, dt, rows, cols)? {
        let loss_out = if opts.reduction == Reduction::None { out.dev_ptr_mut::<u8>()? } else { std::ptr::null_mut() };
        with_elem!(dt, |T| {
            let args: CrossEntropyFwdArgs<T> = (
                logits.dev_ptr(),
                target.dev_ptr(),
                loss_f32.dev_ptr_mut()?,
                loss_out as *mut T,
                lse.dev_ptr_mut()?,
                bad.dev_ptr_mut() as *mut u64,
                rows,
                cols,
                opts.ignore_index,
                opts.label_smoothing,
            );
            // SAFETY: logits hold rows * cols elements of T; target, loss, lse and (for `none`)
            // out hold rows; bad holds one u64.
            unsafe { dev.launch(T::CROSS_ENTROPY.fwd, cfg, args) }
        })?;
    }
    // The count of rows not ignored is needed by the mean's backward whatever the reduction.
    let cfg = LaunchConfig {
        grid: (1, 1, 1),
        block: (REDUCE_THREADS, 1, 1),
        shared_bytes: reduce_smem_bytes(REDUCE_THREADS),
    };
    let mode = opts.reduction.mode();
    let mut scratch;
    let red_out: *mut u8 = if opts.reduction == Reduction::None {
        scratch = Tensor::alloc(op, dev, &[], dt)?;
        scratch.dev_ptr_mut()?
    } else {
        out.dev_ptr_mut()?
    };
    with_elem!(dt, |T| {
        let args: CrossEntropyReduceArgs<T> = (
            loss_f32.dev_ptr(),
            target.dev_ptr(),
            red_out as *mut T,
            count.dev_ptr_mut()?,
            rows,
            opts.ignore_index,
            mode,
        );
        // SAFETY: loss and target hold rows entries; the output and count one each.
        unsafe { dev.launch(T::CROSS_ENTROPY.reduce, cfg, args) }
    })?;
    check_targets(op, &bad, &opts, cols)
}

/// The forwards' check of the targets: the error naming the row of one outside `[0, cols)` that
/// is not `ignore_index`, read back from the kernel's flag `bad` (a synchronisation). Skipped on
/// a stream that is capturing a CUDA graph ([`crate::Device::is_capturing`]), which may not be
/// waited for and whose replays' targets are not there yet: such a target then shows only as
/// a NaN loss.
fn check_targets(op: &'static str, bad: &IndexTensor, ce: &CrossEntropyOpts, cols: u64) -> Result<()> {
    if bad.device().is_capturing()? {
        return Ok(());
    }
    let bad_row = bad.to_vec()?[0];
    if bad_row != 0 {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "target of row {} is outside [0, {cols}) and is not ignore_index ({})",
                bad_row - 1,
                ce.ignore_index
            ),
        });
    }
    Ok(())
}

/// Gradient of the logits of [`cross_entropy`], given the gradient of its loss (shape `[]`,
/// or `[N]` for [`Reduction::None`]): `(softmax(x) - smoothed one-hot) * grad`, zero on ignored
/// rows, divided by the number of rows not ignored for the mean.
pub fn cross_entropy_backward(
    logits: &Tensor,
    target: &IndexTensor,
    saved: &CrossEntropySaved,
    grad: &Tensor,
) -> Result<Tensor> {
    let mut gx = logits.alloc_like("cross_entropy_backward")?;
    cross_entropy_backward_out(logits, target, saved, grad, &mut gx)?;
    Ok(gx)
}

/// [`cross_entropy_backward`] into `gx` (the logits' shape and dtype).
pub fn cross_entropy_backward_out(
    logits: &Tensor,
    target: &IndexTensor,
    saved: &CrossEntropySaved,
    grad: &Tensor,
    gx: &mut Tensor,
) -> Result<()> {
    let op = "cross_entropy_backward";
    let opts = saved.opts;
    let (rows, cols) = check(op, logits, target, &opts)?;
    check_same_device(op, logits, grad)?;
    check_same_dtype(op, logits, grad)?;
    let want: &[usize] = if opts.reduction == Reduction::None { &[rows as usize] } else { &[] };
    super::check::shapes_match(op, want, grad.shape(), "the loss's gradient has the loss's shape")?;
    check_same_device(op, logits, &saved.lse)?;
    super::check::shapes_match(op, &[rows as usize], saved.lse.shape(), "saved by a forward over other logits")?;
    check_same_device(op, logits, gx)?;
    check_same_dtype(op, logits, gx)?;
    super::check::check_same_shape(op, logits, gx, "the logits' gradient has the logits' shape")?;
    let dev = logits.device();
    let dt = logits.dtype();
    let kernel = with_elem!(dt, |T| T::CROSS_ENTROPY.bwd.name());
    let Some(cfg) = plan(dev, kernel, dt, rows, cols)? else { return Ok(()) };
    with_elem!(dt, |T| {
        let args: CrossEntropyBwdArgs<T> = (
            logits.dev_ptr(),
            target.dev_ptr(),
            saved.lse.dev_ptr(),
            grad.dev_ptr(),
            saved.count.dev_ptr(),
            gx.dev_ptr_mut()?,
            rows,
            cols,
            opts.ignore_index,
            opts.label_smoothing,
            opts.reduction.mode(),
        );
        // SAFETY: logits and gx hold rows * cols elements of T; target and lse rows; grad rows
        // (none) or one; count one.
        unsafe { dev.launch(T::CROSS_ENTROPY.bwd, cfg, args) }
    })
}

/// The options of [`cross_entropy_one_pass`]: those of [`cross_entropy`], a z-loss, and the
/// loss's gradient, which the one pass needs before it writes the logits' gradient.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOnePassOpts {
    /// Reduction, `ignore_index`, label smoothing, as for [`cross_entropy`].
    pub ce: CrossEntropyOpts,
    /// The z-loss coefficient: each row not ignored adds `z_loss * lse^2` to its loss (PaLM's
    /// auxiliary loss, which keeps the log-normaliser near 0); 0 adds nothing.
    pub z_loss: f32,
    /// The gradient of the (reduced) loss by which the logits' gradient is multiplied: 1 for a
    /// loss that is the objective itself. For [`Reduction::None`], the per-row gradients, if
    /// given, are multiplied by it too.
    pub grad_scale: f32,
}

impl Default for CrossEntropyOnePassOpts {
    fn default() -> Self {
        CrossEntropyOnePassOpts { ce: CrossEntropyOpts::default(), z_loss: 0.0, grad_scale: 1.0 }
    }
}

/// Bytes of rows that the one-pass kernel keeps in flight, so that its second sweep over a row
/// finds the row in L2 (50 MB on the H100, 40 MB on the A100): the grid is capped at this many
/// bytes of rows, and at no fewer blocks than SMs.
const ONE_PASS_L2_BYTES: u64 = 24 << 20;

/// Device addresses of one launch of the one-pass kernel (a whole tensor's rows, or a chunk of
/// them for [`linear_cross_entropy`](super::linear_cross_entropy())).
pub(crate) struct OnePassPtrs {
    pub x: u64,
    pub gx: u64,
    pub target: u64,
    /// Per-row loss gradients (the logits' dtype), or 0.
    pub grad: u64,
    /// The count of rows not ignored (one f32), from [`launch_count`].
    pub count: u64,
    /// Per-row losses, f32.
    pub loss: u64,
    /// Per-row losses in the logits' dtype (reduction `none`), or 0.
    pub loss_out: u64,
    /// One u64: 1 + the row of an out-of-range target.
    pub bad: u64,
}

/// Launches `cross_entropy_one_pass_<dt>` over `rows` rows of `cols` classes.
///
/// # Safety
/// `p` addresses device memory of `dev`: `x` and `gx` `rows * cols` elements of `dt` (they may
/// be equal, nothing else may overlap them), `target` and `loss` `rows` entries, `grad` and
/// `loss_out` `rows` of `dt` where not 0, `count` one f32, `bad` one u64.
pub(crate) unsafe fn launch_one_pass(
    dev: &crate::Device,
    dt: DType,
    p: &OnePassPtrs,
    rows: u64,
    cols: u64,
    opts: &CrossEntropyOnePassOpts,
) -> Result<()> {
    let kernel = with_elem!(dt, |T| T::CROSS_ENTROPY.one_pass.name());
    let Some(mut cfg) = plan(dev, kernel, dt, rows, cols)? else { return Ok(()) };
    let row_bytes = (cols * dt.size() as u64).max(1);
    let per_block = cfg.block.1 as u64;
    let cap = (ONE_PASS_L2_BYTES / row_bytes / per_block).max(dev.sm_count() as u64);
    cfg.grid.0 = (cfg.grid.0 as u64).min(cap) as u32;
    let ce = opts.ce;
    with_elem!(dt, |T| {
        let args: CrossEntropyOnePassArgs<T> = (
            p.x as *const T,
            p.gx as *mut T,
            p.target as *const i64,
            p.grad as *const T,
            p.count as *const f32,
            p.loss as *mut f32,
            p.loss_out as *mut T,
            p.bad as *mut u64,
            rows,
            cols,
            ce.ignore_index,
            ce.label_smoothing,
            opts.z_loss,
            opts.grad_scale,
            ce.reduction.mode(),
        );
        // SAFETY: the caller's contract; the kernel's rows are covered by the grid-stride loop.
        unsafe { dev.launch(T::CROSS_ENTROPY.one_pass, cfg, args) }
    })
}

/// Writes the number of targets of `rows` at `target` that are not `ignore` to `count` (f32).
///
/// # Safety
/// `target` addresses `rows` i64 and `count` one f32 on `dev`.
pub(crate) unsafe fn launch_count(dev: &crate::Device, target: u64, count: u64, rows: u64, ignore: i64) -> Result<()> {
    let cfg = LaunchConfig {
        grid: (1, 1, 1),
        block: (REDUCE_THREADS, 1, 1),
        shared_bytes: reduce_smem_bytes(REDUCE_THREADS),
    };
    let args: CrossEntropyCountArgs = (target as *const i64, count as *mut f32, rows, ignore);
    // SAFETY: the caller's contract; one block strides over the rows.
    unsafe { dev.launch(cross_entropy_count, cfg, args) }
}

/// The reduced loss (`[]`, `dt`) of the per-row losses `loss` (f32 `[rows]`) into `out`, for sum
/// and mean; then the out-of-range target check (a synchronisation, except under CUDA graph
/// capture: see [`check_targets`]).
pub(crate) fn finish_loss(
    op: &'static str,
    target: &IndexTensor,
    loss: &Tensor,
    bad: &IndexTensor,
    ce: &CrossEntropyOpts,
    out: &mut Tensor,
    cols: u64,
) -> Result<()> {
    let dev = loss.device();
    let rows = loss.numel() as u64;
    if ce.reduction != Reduction::None {
        let cfg = LaunchConfig {
            grid: (1, 1, 1),
            block: (REDUCE_THREADS, 1, 1),
            shared_bytes: reduce_smem_bytes(REDUCE_THREADS),
        };
        let mut count = Tensor::alloc(op, dev, &[1], DType::F32)?;
        let dt = out.dtype();
        with_elem!(dt, |T| {
            let args: CrossEntropyReduceArgs<T> = (
                loss.dev_ptr(),
                target.dev_ptr(),
                out.dev_ptr_mut()?,
                count.dev_ptr_mut()?,
                rows,
                ce.ignore_index,
                ce.reduction.mode(),
            );
            // SAFETY: loss and target hold rows entries; out and count one each.
            unsafe { dev.launch(T::CROSS_ENTROPY.reduce, cfg, args) }
        })?;
    }
    check_targets(op, bad, ce, cols)
}

fn check_one_pass(
    op: &'static str,
    logits: &Tensor,
    target: &IndexTensor,
    opts: &CrossEntropyOnePassOpts,
    grad: Option<&Tensor>,
) -> Result<(u64, u64)> {
    let (rows, cols) = check(op, logits, target, &opts.ce)?;
    for (v, what) in [(opts.z_loss, "z_loss"), (opts.grad_scale, "grad_scale")] {
        if !v.is_finite() {
            return Err(Error::InvalidArgument { op, message: format!("{what} must be finite, got {v}") });
        }
    }
    if let Some(g) = grad {
        if opts.ce.reduction != Reduction::None {
            return Err(Error::InvalidArgument {
                op,
                message: "per-row loss gradients are for reduction none; a reduced loss's gradient is grad_scale"
                    .into(),
            });
        }
        check_same_device(op, logits, g)?;
        check_same_dtype(op, logits, g)?;
        super::check::shapes_match(op, &[rows as usize], g.shape(), "one loss gradient per row")?;
    }
    Ok((rows, cols))
}

/// The loss's tensor of [`cross_entropy_one_pass`]: `[]`, or `[N]` for [`Reduction::None`].
fn loss_shape(opts: &CrossEntropyOnePassOpts, rows: u64) -> Vec<usize> {
    if opts.ce.reduction == Reduction::None { vec![rows as usize] } else { vec![] }
}

/// Cross-entropy and the gradient of its logits in one pass over them: the loss of
/// [`cross_entropy`] (plus the z-loss, see [`CrossEntropyOnePassOpts`]) and, in the same kernel,
/// the gradient that [`cross_entropy_backward`] would give for a loss gradient of
/// `opts.grad_scale` (times `grad[row]` for [`Reduction::None`] where `grad` is given; 1 a row
/// otherwise). Returns `(loss, gradient)`.
///
/// The logits are read once from memory and the gradient written once; the second sweep over a
/// row comes from L2. The mean's division by the rows not ignored needs their count before the
/// gradient is written: a small kernel counts the targets first (one read of `[N]` indices), so
/// the caller passes only the upstream gradient, not the count. For training, where the loss is
/// the objective, `grad_scale = 1`; a gradient that arrives later (autograd) multiplies the
/// returned gradient as PyTorch's own fused losses do. Targets are checked as by
/// [`cross_entropy`] (a synchronisation, skipped under CUDA graph capture).
pub fn cross_entropy_one_pass(
    logits: &Tensor,
    target: &IndexTensor,
    opts: CrossEntropyOnePassOpts,
    grad: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let op = "cross_entropy_one_pass";
    let (rows, _) = check_one_pass(op, logits, target, &opts, grad)?;
    let mut gx = logits.alloc_like(op)?;
    let mut loss = Tensor::alloc(op, logits.device(), &loss_shape(&opts, rows), logits.dtype())?;
    cross_entropy_one_pass_out(logits, target, opts, grad, &mut loss, &mut gx)?;
    Ok((loss, gx))
}

/// [`cross_entropy_one_pass`] with the gradient written over the logits (no second `[N, C]`
/// buffer). Returns the loss.
pub fn cross_entropy_one_pass_(
    logits: &mut Tensor,
    target: &IndexTensor,
    opts: CrossEntropyOnePassOpts,
    grad: Option<&Tensor>,
) -> Result<Tensor> {
    let op = "cross_entropy_one_pass_";
    let (rows, cols) = check_one_pass(op, logits, target, &opts, grad)?;
    let mut loss = Tensor::alloc(op, logits.device(), &loss_shape(&opts, rows), logits.dtype())?;
    let x = logits.dev_ptr_mut::<u8>()? as u64;
    one_pass_run(op, (x, x), logits, target, &opts, grad, &mut loss, rows, cols)?;
    Ok(loss)
}

/// [`cross_entropy_one_pass`] into `loss` (`[]`, or `[N]` for [`Reduction::None`]; the
/// logits' dtype) and `gx` (the logits' shape and dtype).
pub fn cross_entropy_one_pass_out(
    logits: &Tensor,
    target: &IndexTensor,
    opts: CrossEntropyOnePassOpts,
    grad: Option<&Tensor>,
    loss: &mut Tensor,
    gx: &mut Tensor,
) -> Result<()> {
    let op = "cross_entropy_one_pass";
    let (rows, cols) = check_one_pass(op, logits, target, &opts, grad)?;
    check_same_device(op, logits, gx)?;
    check_same_dtype(op, logits, gx)?;
    super::check::check_same_shape(op, logits, gx, "the logits' gradient has the logits' shape")?;
    let gx_ptr = gx.dev_ptr_mut::<u8>()? as u64;
    one_pass_run(op, (logits.dev_ptr_u64(), gx_ptr), logits, target, &opts, grad, loss, rows, cols)
}

#[allow(clippy::too_many_arguments)]
fn one_pass_run(
    op: &'static str,
    (x, gx): (u64, u64),
    logits: &Tensor,
    target: &IndexTensor,
    opts: &CrossEntropyOnePassOpts,
    grad: Option<&Tensor>,
    loss: &mut Tensor,
    rows: u64,
    cols: u64,
) -> Result<()> {
    let dev = logits.device();
    let dt = logits.dtype();
    check_same_device(op, logits, loss)?;
    check_same_dtype(op, logits, loss)?;
    super::check::shapes_match(op, &loss_shape(opts, rows), loss.shape(), "the loss is [N] for none, else []")?;
    let mut loss_f32 = Tensor::alloc(op, dev, &[rows as usize], DType::F32)?;
    let mut count = Tensor::alloc(op, dev, &[1], DType::F32)?;
    let mut bad = IndexTensor::zeros(dev, &[1])?;
    let loss_out = if opts.ce.reduction == Reduction::None { loss.dev_ptr_mut::<u8>()? as u64 } else { 0 };
    let p = OnePassPtrs {
        x,
        gx,
        target: target.dev_ptr() as u64,
        grad: grad.map_or(0, |g| g.dev_ptr_u64()),
        count: count.dev_ptr_mut::<f32>()? as u64,
        loss: loss_f32.dev_ptr_mut::<f32>()? as u64,
        loss_out,
        bad: bad.dev_ptr_mut() as u64,
    };
    // SAFETY: checked above: x and gx hold rows * cols of dt (the same memory in place, or gx a
    // tensor borrowed mutably, so distinct); target, loss_f32 and (none) loss and grad rows; count
    // one f32; bad one u64.
    unsafe {
        if opts.ce.reduction == Reduction::Mean {
            launch_count(dev, p.target, p.count, rows, opts.ce.ignore_index)?;
        }
        launch_one_pass(dev, dt, &p, rows, cols, opts)?;
    }
    finish_loss(op, target, &loss_f32, &bad, &opts.ce, loss, cols)
}
