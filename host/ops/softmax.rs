//! Softmax and log-softmax along the last dimension (host side of
//! `kernels-gpu/src/softmax.rs`), forward and backward.

use super::check::{check_same_device, check_same_dtype, check_same_shape, rows_cols, with_elem};
use crate::error::Result;
use crate::rows::{RowPlan, Spread, cluster_row_plan, eight_vectors_fwd, fwd_row_plan, row_plan};
use crate::tensor::Tensor;
use kernels_gpu::DType;
use kernels_gpu::kernel::Kernel;
use kernels_gpu::softmax::{SoftmaxBwdArgs, SoftmaxElem, SoftmaxFwdArgs, SoftmaxOp};

/// The register-resident forward instances a launch over rows of `cols` may take: the op's
/// (f32 log-softmax's forward has no eight, see the kernel file), eight only where
/// [`eight_vectors_fwd`] says.
fn fwd_vectors<T>(op: &SoftmaxOp<T>, dt: DType, cols: u64) -> Vec<usize> {
    op.fwd.reg_vectors().filter(|&v| v < 8 || eight_vectors_fwd(dt, cols)).collect()
}

/// The forward's kernel and launch.
fn forward_plan<T: SoftmaxElem>(
    dev: &crate::Device,
    log: bool,
    rows: u64,
    cols: u64,
) -> Result<Option<RowPlan<Kernel<SoftmaxFwdArgs<T>>>>> {
    let op = T::SOFTMAX.op(log);
    fwd_row_plan(dev, &op.fwd, T::DTYPE, rows, cols, &fwd_vectors(op, T::DTYPE, cols), Spread::Two)
}

fn forward(op: &'static str, x: &Tensor, log: bool) -> Result<Tensor> {
    let mut y = x.alloc_like(op)?;
    forward_out(op, x, log, &mut y)?;
    Ok(y)
}

fn forward_out(op: &'static str, x: &Tensor, log: bool, y: &mut Tensor) -> Result<()> {
    check_same_device(op, x, y)?;
    check_same_dtype(op, x, y)?;
    check_same_shape(op, x, y, "the output must have the input's shape")?;
    let (rows, cols) = rows_cols(op, x)?;
    with_elem!(x.dtype(), |T| {
        let Some(p) = forward_plan::<T>(x.device(), log, rows, cols)? else { return Ok(()) };
        let args: SoftmaxFwdArgs<T> = (x.dev_ptr(), y.dev_ptr_mut()?, rows, cols);
        // SAFETY: x and y hold rows * cols elements of T on this device (checked above); the
        // plan picked an aligned register-resident kernel (`_v`) only for whole-vector rows, and
        // the others load rows from their aligned 16 bytes, every tensor starting 16-byte
        // aligned (`Tensor::from_device_ptr` refuses other addresses).
        unsafe { x.device().launch(p.kernel, p.cfg, args) }
    })
}

fn backward(op: &'static str, y: &Tensor, grad: &Tensor, log: bool) -> Result<Tensor> {
    let mut gx = y.alloc_like(op)?;
    backward_out(op, y, grad, log, &mut gx)?;
    Ok(gx)
}

fn backward_out(op: &'static str, y: &Tensor, grad: &Tensor, log: bool, gx: &mut Tensor) -> Result<()> {
    check_same_device(op, y, grad)?;
    check_same_dtype(op, y, grad)?;
    check_same_shape(op, y, grad, "grad must have the output's shape")?;
    check_same_device(op, y, gx)?;
    check_same_dtype(op, y, gx)?;
    check_same_shape(op, y, gx, "the input's gradient must have the output's shape")?;
    let (rows, cols) = rows_cols(op, y)?;
    with_elem!(y.dtype(), |T| {
        let Some(p) = backward_plan::<T>(y.device(), log, rows, cols)? else { return Ok(()) };
        let args: SoftmaxBwdArgs<T> = (y.dev_ptr(), grad.dev_ptr(), gx.dev_ptr_mut()?, rows, cols);
        // SAFETY: all three hold rows * cols elements of T; gx is borrowed mutably, so it
        // aliases neither input.
        unsafe { y.device().launch(p.kernel, p.cfg, args) }
    })
}

/// The backward's kernel and launch: one group per row where the row fits a block's registers
/// (as many threads a row as it takes at the fewest vectors a thread: `Spread::Fewest`), else
/// (sm_90, rows of whole vectors) a cluster of blocks per row, else streaming.
fn backward_plan<T: SoftmaxElem>(
    dev: &crate::Device,
    log: bool,
    rows: u64,
    cols: u64,
) -> Result<Option<RowPlan<Kernel<SoftmaxBwdArgs<T>>>>> {
    let bwd = &T::SOFTMAX.op(log).bwd;
    let avail: Vec<usize> = bwd.reg_vectors().collect();
    let Some(p) = row_plan(dev, bwd, T::DTYPE, rows, cols, &avail, Spread::Fewest)? else { return Ok(None) };
    if p.v.is_some() {
        return Ok(Some(p));
    }
    let clusters: Vec<u32> = bwd.cluster_sizes(4).collect();
    Ok(Some(cluster_row_plan(dev, bwd, T::DTYPE, rows, cols, &clusters, 1024)?.unwrap_or(p)))
}

/// The kernels that the forward and the backward of softmax (or `log`-softmax) run on `dev`
/// for rows x cols of `dt` (for tests: which path a shape takes).
#[doc(hidden)]
pub fn softmax_kernels(dev: &crate::Device, log: bool, dt: DType, rows: u64, cols: u64) -> Result<[String; 2]> {
    with_elem!(dt, |T| {
        let fwd = forward_plan::<T>(dev, log, rows, cols)?;
        let bwd = backward_plan::<T>(dev, log, rows, cols)?;
        let name = |k: Option<&str>| k.unwrap_or_default().to_string();
        Ok([name(fwd.map(|p| p.kernel.name())), name(bwd.map(|p| p.kernel.name()))])
    })
}

/// `softmax(x)` along the last dimension, as `torch.softmax(x, -1)`: numerically stable for
/// any row length; a row containing NaN or `+inf`, or of all `-inf`, comes out NaN.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    forward("softmax", x, false)
}

/// `log_softmax(x)` along the last dimension.
pub fn log_softmax(x: &Tensor) -> Result<Tensor> {
    forward("log_softmax", x, true)
}

/// Gradient of the input of `y = softmax(x)`, from `y` and the gradient of `y`:
/// `y * (grad - sum(grad * y))` per row.
pub fn softmax_backward(y: &Tensor, grad: &Tensor) -> Result<Tensor> {
    backward("softmax_backward", y, grad, false)
}

/// Gradient of the input of `y = log_softmax(x)`, from `y` and the gradient of `y`:
/// `grad - exp(y) * sum(grad)` per row.
pub fn log_softmax_backward(y: &Tensor, grad: &Tensor) -> Result<Tensor> {
    backward("log_softmax_backward", y, grad, true)
}

/// [`softmax`] into `y` (the shape and dtype of `x`).
pub fn softmax_out(x: &Tensor, y: &mut Tensor) -> Result<()> {
    forward_out("softmax", x, false, y)
}

/// [`log_softmax`] into `y` (the shape and dtype of `x`).
pub fn log_softmax_out(x: &Tensor, y: &mut Tensor) -> Result<()> {
    forward_out("log_softmax", x, true, y)
}

/// [`softmax_backward`] into `gx` (the shape and dtype of `y`).
pub fn softmax_backward_out(y: &Tensor, grad: &Tensor, gx: &mut Tensor) -> Result<()> {
    backward_out("softmax_backward", y, grad, false, gx)
}

/// [`log_softmax_backward`] into `gx` (the shape and dtype of `y`).
pub fn log_softmax_backward_out(y: &Tensor, grad: &Tensor, gx: &mut Tensor) -> Result<()> {
    backward_out("log_softmax_backward", y, grad, true, gx)
}

impl Tensor {
    /// [`softmax`] along the last dimension.
    pub fn softmax(&self) -> Result<Tensor> {
        softmax(self)
    }
    /// [`log_softmax`] along the last dimension.
    pub fn log_softmax(&self) -> Result<Tensor> {
        log_softmax(self)
    }
}
