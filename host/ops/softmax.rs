//! Softmax and log-softmax along the last dimension (host side of
//! `kernels-gpu/src/softmax.rs`), forward and backward.

use super::check::{check_same_device, check_same_dtype, check_same_shape, rows_cols, with_elem};
use crate::error::Result;
use crate::rows::{ROW_CLUSTERS, RowPlan, Spread, cluster_row_plan, eight_vectors_fwd, fwd_row_plan, row_plan};
use crate::tensor::Tensor;
use kernels_gpu::DType;
use kernels_gpu::kernel::Params;
use kernels_gpu::softmax::{SoftmaxBwdArgs, SoftmaxFwdArgs};

/// Vectors per thread of the register-resident forward instances for rows of `cols` (see the
/// kernel file for why f32 log-softmax's forward has no eight, and [`eight_vectors_fwd`]);
/// `u64::MAX` gives every instance.
fn fwd_vectors(log: bool, dt: DType, cols: u64) -> &'static [usize] {
    let eight = eight_vectors_fwd(dt, cols) && !(log && dt == DType::F32);
    if eight { &[1, 2, 4, 8] } else { &[1, 2, 4] }
}
const BWD_VECTORS: &[usize] = &[1, 2, 4];

fn stem(log: bool, dir: &str) -> String {
    format!("{}_{dir}", if log { "log_softmax" } else { "softmax" })
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
    let dt = x.dtype();
    let Some(p) = fwd_row_plan(x.device(), &stem(log, "fwd"), dt, rows, cols, fwd_vectors(log, dt, cols), Spread::Two)?
    else {
        return Ok(());
    };
    with_elem!(dt, |T| {
        let args: SoftmaxFwdArgs<T> = (x.dev_ptr(), y.dev_ptr_mut()?, rows, cols);
        // SAFETY: x and y hold rows * cols elements of T on this device (checked above); the
        // plan picked a register-resident kernel only for whole-vector rows.
        unsafe { x.device().launch(&p.kernel, p.cfg, args) }
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
    let Some(p) = backward_plan(y.device(), log, y.dtype(), rows, cols)? else { return Ok(()) };
    with_elem!(y.dtype(), |T| {
        let args: SoftmaxBwdArgs<T> = (y.dev_ptr(), grad.dev_ptr(), gx.dev_ptr_mut()?, rows, cols);
        // SAFETY: all three hold rows * cols elements of T; gx is borrowed mutably, so it
        // aliases neither input.
        unsafe { y.device().launch(&p.kernel, p.cfg, args) }
    })
}

/// The backward's kernel and launch: one group per row where the row fits a block's registers
/// (as many threads a row as it takes at the fewest vectors a thread: `Spread::Fewest`), else
/// (sm_90, rows of whole vectors) a cluster of blocks per row, else streaming.
fn backward_plan(dev: &crate::Device, log: bool, dt: DType, rows: u64, cols: u64) -> Result<Option<RowPlan>> {
    let stem = stem(log, "bwd");
    let Some(p) = row_plan(dev, &stem, dt, rows, cols, BWD_VECTORS, Spread::Fewest)? else { return Ok(None) };
    if p.v.is_some() {
        return Ok(Some(p));
    }
    Ok(Some(cluster_row_plan(dev, &stem, dt, rows, cols, 1024)?.unwrap_or(p)))
}

/// The kernels that the forward and the backward of softmax (or `log`-softmax) run on `dev`
/// for rows x cols of `dt` (for tests: which path a shape takes).
#[doc(hidden)]
pub fn softmax_kernels(dev: &crate::Device, log: bool, dt: DType, rows: u64, cols: u64) -> Result<[String; 2]> {
    let fwd = fwd_row_plan(dev, &stem(log, "fwd"), dt, rows, cols, fwd_vectors(log, dt, cols), Spread::Two)?;
    let bwd = backward_plan(dev, log, dt, rows, cols)?;
    Ok([fwd.map(|p| p.kernel).unwrap_or_default(), bwd.map(|p| p.kernel).unwrap_or_default()])
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

pub(crate) fn launched_kernels() -> Vec<(String, usize)> {
    let mut v = Vec::new();
    for dt in DType::ALL {
        let (f, b) = with_elem!(dt, |T| (<SoftmaxFwdArgs<T> as Params>::ARITY, <SoftmaxBwdArgs<T> as Params>::ARITY));
        for log in [false, true] {
            for &n in fwd_vectors(log, dt, u64::MAX) {
                v.push((format!("{}_v{n}_{}", stem(log, "fwd"), dt.suffix()), f));
            }
            for &n in BWD_VECTORS {
                v.push((format!("{}_v{n}_{}", stem(log, "bwd"), dt.suffix()), b));
            }
            for c in ROW_CLUSTERS {
                v.push((format!("{}_c{c}_v4_{}", stem(log, "bwd"), dt.suffix()), b));
            }
            v.push((format!("{}_stream_{}", stem(log, "fwd"), dt.suffix()), f));
            v.push((format!("{}_stream_{}", stem(log, "bwd"), dt.suffix()), b));
        }
    }
    v
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
