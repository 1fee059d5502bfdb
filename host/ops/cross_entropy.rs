//! Cross-entropy over class indices, fused with the log-softmax (host side of
//! `kernels-gpu/src/cross_entropy.rs`), forward and backward, as PyTorch's `F.cross_entropy`.

use super::check::{check_same_device, check_same_dtype, with_elem};
use crate::device::LaunchConfig;
use crate::error::{Error, Result};
use crate::rows;
use crate::tensor::{IndexTensor, Tensor};
use kernels_gpu::DType;
use kernels_gpu::cross_entropy::{
    CrossEntropyBwdArgs, CrossEntropyElem, CrossEntropyFwdArgs, CrossEntropyReduceArgs, MODE_MEAN, MODE_NONE, MODE_SUM,
    REDUCE_THREADS,
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
/// [`Error::InvalidArgument`] naming its row (checking costs a synchronisation with the device).
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
    let bad_row = bad.to_vec()?[0];
    if bad_row != 0 {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "target of row {} is outside [0, {cols}) and is not ignore_index ({})",
                bad_row - 1,
                opts.ignore_index
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
