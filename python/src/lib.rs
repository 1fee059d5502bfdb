//! `kernels_torch._native`: the `kernels` library's ops on memory and streams owned by PyTorch.
//!
//! Each function takes raw device addresses (`tensor.data_ptr()`), sizes, a dtype code, the CUDA
//! device index and the raw handle of PyTorch's current stream, and runs one op with the
//! library's interop (`kernels::interop`): every tensor is borrowed (PyTorch allocated all of
//! them, outputs and saved statistics included), and the work goes to PyTorch's stream inside
//! `Device::with_stream`, where the temporaries some ops need are allocated stream-ordered on
//! that stream rather than from the library's single-stream cache.
//!
//! The Python layer (`kernels_torch/_ops.py`) is what users call: it checks devices, dtypes and
//! layouts, makes inputs contiguous and 16-byte aligned, allocates the outputs with PyTorch and
//! passes only tensors that satisfy the contracts below. This layer re-checks what it can
//! (alignment, shapes against the op's own checks) and turns every library error into a Python
//! exception naming the op.

use kernels::ops::{
    self, Activation, AttentionOpts, BatchNormGrads, BatchNormOpts, BatchNormStats, BinaryOp, Causal, Conv2dGrads,
    Conv2dOpts, CrossEntropyOnePassOpts, CrossEntropyOpts, Gemm, Layout, Layout2d, NormGrads, NormStats, Pool2dOpts,
    Precision, ReduceOp, Reduction, RopeOpts, RopeStyle, ScaleBiasActGrads, UnaryOp,
};
use kernels::{DType, Device, Error, IndexTensor, Tensor};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::sync::OnceLock;

/// Devices by ordinal, so that a call costs no lock (`Device::cuda` takes one).
static DEVICES: [OnceLock<Device>; 64] = [const { OnceLock::new() }; 64];

fn device(ordinal: usize) -> kernels::Result<Device> {
    let Some(slot) = DEVICES.get(ordinal) else {
        return Device::cuda(ordinal);
    };
    if let Some(d) = slot.get() {
        return Ok(d.clone());
    }
    let d = Device::cuda(ordinal)?;
    Ok(slot.get_or_init(|| d).clone())
}

/// Library errors as Python exceptions: a bad argument is a `ValueError`, a dtype mismatch a
/// `TypeError`, no driver or device, a kernel fault and other driver errors `RuntimeError`.
fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::ShapeMismatch { .. } | Error::DeviceMismatch { .. } | Error::InvalidArgument { .. } => {
            PyValueError::new_err(msg)
        }
        Error::DTypeMismatch { .. } => PyTypeError::new_err(msg),
        Error::OutOfMemory { .. } => PyMemoryError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

fn dtype(code: u8) -> PyResult<DType> {
    match code {
        0 => Ok(DType::F32),
        1 => Ok(DType::F16),
        2 => Ok(DType::BF16),
        _ => Err(PyTypeError::new_err(format!("dtype code {code}: expected 0 (f32), 1 (f16) or 2 (bf16)"))),
    }
}

/// The op table's row `code` (its index in [`ops::UNARY_OPS`], which the module exports as
/// `UNARY_OPS`) with parameters `a`, `b` (those it has, in its row's order).
fn unary_op(code: u8, a: f32, b: f32) -> PyResult<UnaryOp> {
    ops::UNARY_OPS
        .get(code as usize)
        .and_then(|info| UnaryOp::from_name(info.name, [a, b]))
        .ok_or_else(|| PyValueError::new_err(format!("unknown unary op code {code}")))
}

/// As [`unary_op`], for a row that is an activation.
fn activation(code: u8, a: f32, b: f32) -> PyResult<Activation> {
    match unary_op(code, a, b)? {
        UnaryOp::Act(act) => Ok(act),
        op => Err(PyValueError::new_err(format!("{} (code {code}) is not an activation", op.name()))),
    }
}

/// The op table as Python data: one tuple a row, `(name, activation, ((param, default), ...),
/// from_output, positive, torch, module, doc)`, in the order of the codes.
type UnaryRow =
    (&'static str, bool, Vec<(&'static str, f32)>, &'static str, bool, &'static str, &'static str, &'static str);

fn unary_rows() -> Vec<UnaryRow> {
    ops::UNARY_OPS
        .iter()
        .map(|i| (i.name, i.activation, i.params.to_vec(), i.from_output, i.positive, i.torch, i.module, i.doc))
        .collect()
}

/// One call's device, stream and dtype.
struct Call {
    dev: Device,
    stream: usize,
    dt: DType,
}

impl Call {
    fn new(ordinal: usize, stream: usize, dt: u8) -> PyResult<Call> {
        Ok(Call { dev: device(ordinal).map_err(to_py)?, stream, dt: dtype(dt)? })
    }

    /// A borrowed tensor of the call's dtype.
    ///
    /// # Safety
    /// `ptr` is the data of a live CUDA tensor of PyTorch on this device, contiguous, holding
    /// `shape`'s elements of the dtype, alive until the call's work on its stream is done
    /// (PyTorch's caching allocator keeps a freed block for reuse on the stream it was allocated
    /// on, and the tensors are used on that stream, so this holds once the call returns while
    /// the tensors are referenced by the caller).
    unsafe fn t(&self, ptr: u64, shape: &[usize]) -> PyResult<Tensor> {
        // SAFETY: the caller's contract.
        unsafe { Tensor::from_device_ptr(&self.dev, ptr, shape, self.dt) }.map_err(to_py)
    }

    /// As `t`, but of f32 (the saved statistics).
    unsafe fn f32(&self, ptr: u64, shape: &[usize]) -> PyResult<Tensor> {
        // SAFETY: as `t`.
        unsafe { Tensor::from_device_ptr(&self.dev, ptr, shape, DType::F32) }.map_err(to_py)
    }

    /// As `t`, optional: 0 is "none".
    unsafe fn opt(&self, ptr: u64, shape: &[usize]) -> PyResult<Option<Tensor>> {
        // SAFETY: as `t`.
        if ptr == 0 { Ok(None) } else { unsafe { self.t(ptr, shape) }.map(Some) }
    }

    /// Runs `f` on PyTorch's stream, with the GIL released (a cross-entropy waits for the GPU).
    fn run<R: Send>(&self, py: Python<'_>, f: impl FnOnce() -> kernels::Result<R> + Send) -> PyResult<R> {
        py.detach(|| {
            // SAFETY: `stream` is PyTorch's current stream of this device (the Python layer
            // passes `torch.cuda.current_stream(device)`'s handle), alive as long as PyTorch is;
            // every tensor `f` touches is borrowed from PyTorch and ordered on that stream, and
            // everything the library allocates inside `f` is dropped inside it.
            unsafe { self.dev.with_stream(self.stream as *mut std::ffi::c_void, f) }
        })
        .and_then(|r| r)
        .map_err(to_py)
    }
}

/// `act(x)` into `y`, both of `n` elements.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn activation_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    act: u8,
    a: f32,
    b: f32,
    x: u64,
    y: u64,
    n: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    unary_fwd_with(py, &c, activation(act, a, b)?.into(), x, y, n)
}

/// `op(x)` into `y` (`activation_fwd`, `unary_fwd`).
fn unary_fwd_with(py: Python<'_>, c: &Call, op: UnaryOp, x: u64, y: u64, n: usize) -> PyResult<()> {
    // SAFETY (all borrowed tensors of this module): the Python layer passes live contiguous
    // CUDA tensors of this device, dtype and size, outputs freshly allocated (see `Call::t`).
    let (x, mut y) = unsafe { (c.t(x, &[n])?, c.t(y, &[n])?) };
    c.run(py, || ops::unary_out(&x, op, &mut y))
}

/// `act'(x) * g` into `gx`, all of `n` elements.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn activation_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    act: u8,
    a: f32,
    b: f32,
    x: u64,
    g: u64,
    gx: u64,
    n: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    unary_bwd_with(py, &c, activation(act, a, b)?.into(), x, g, gx, n, false)
}

/// `act'(x) * g` into `gx` from the output `y = act(x)` (`ops::unary_backward_from_output`: for
/// sigmoid and tanh, whose autograd keeps the output, as PyTorch's), all of `n` elements.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn activation_bwd_y(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    act: u8,
    a: f32,
    b: f32,
    y: u64,
    g: u64,
    gx: u64,
    n: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    unary_bwd_with(py, &c, activation(act, a, b)?.into(), y, g, gx, n, true)
}

/// `op'(x) * g` into `gx` (`activation_bwd`, `unary_bwd`), or from the output `y` in `x`'s place
/// (`activation_bwd_y`).
#[allow(clippy::too_many_arguments)]
fn unary_bwd_with(
    py: Python<'_>,
    c: &Call,
    op: UnaryOp,
    x: u64,
    g: u64,
    gx: u64,
    n: usize,
    from_output: bool,
) -> PyResult<()> {
    // SAFETY: see `unary_fwd_with`.
    let (x, g, mut gx) = unsafe { (c.t(x, &[n])?, c.t(g, &[n])?, c.t(gx, &[n])?) };
    if from_output {
        c.run(py, || ops::unary_backward_from_output_out(&x, &g, op, &mut gx))
    } else {
        c.run(py, || ops::unary_backward_out(&x, &g, op, &mut gx))
    }
}

/// `op(x)` into `y`, both of `n` elements (`op` a [`unary_op`] code).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn unary_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    op: u8,
    a: f32,
    b: f32,
    x: u64,
    y: u64,
    n: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    unary_fwd_with(py, &c, unary_op(op, a, b)?, x, y, n)
}

/// `op'(x) * g` into `gx`, all of `n` elements (`op` a [`unary_op`] code).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn unary_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    op: u8,
    a: f32,
    b: f32,
    x: u64,
    g: u64,
    gx: u64,
    n: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    unary_bwd_with(py, &c, unary_op(op, a, b)?, x, g, gx, n, false)
}

/// Binary op codes: 0 add, 1 sub, 2 mul, 3 div.
fn binary_op(code: u8) -> PyResult<BinaryOp> {
    Ok(match code {
        0 => BinaryOp::Add,
        1 => BinaryOp::Sub,
        2 => BinaryOp::Mul,
        3 => BinaryOp::Div,
        _ => return Err(PyValueError::new_err(format!("unknown binary op code {code}"))),
    })
}

/// `x op y` into `out`, all of `n` elements; `op`: 0 add, 1 sub, 2 mul, 3 div. As `unary_fwd`,
/// for the paired bench.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn binary_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    op: u8,
    x: u64,
    y: u64,
    out: u64,
    n: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let op = binary_op(op)?;
    // SAFETY: see `unary_fwd_with`.
    let (x, y, mut out) = unsafe { (c.t(x, &[n])?, c.t(y, &[n])?, c.t(out, &[n])?) };
    c.run(py, || ops::binary_out(&x, &y, op, &mut out))
}

/// `x op row` into `out`; x and out `[rows, cols]`, row `[cols]`; `op` as `binary_fwd`. Not
/// wrapped by the Python layer (PyTorch's `x + b` is the user's); for the paired bench.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn binary_row_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    op: u8,
    x: u64,
    row: u64,
    out: u64,
    rows: usize,
    cols: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let op = binary_op(op)?;
    // SAFETY: see `unary_fwd_with`.
    let (x, row, mut out) = unsafe { (c.t(x, &[rows, cols])?, c.t(row, &[cols])?, c.t(out, &[rows, cols])?) };
    c.run(py, || ops::binary_row_out(&x, &row, op, &mut out))
}

/// `x` (`[batch, rows, cols]`) with its last two dimensions swapped into `out` (`[batch, cols,
/// rows]`). Not wrapped by the Python layer (PyTorch's `x.mT.contiguous()` is the user's); for the
/// paired bench, as `unary_fwd`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn transpose(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    x: u64,
    out: u64,
    batch: usize,
    rows: usize,
    cols: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    // SAFETY: see `unary_fwd_with`.
    let (x, mut out) = unsafe { (c.t(x, &[batch, rows, cols])?, c.t(out, &[batch, cols, rows])?) };
    c.run(py, || ops::transpose_out(&x, &mut out))
}

/// `act(x * scale + bias)` into `y`; x and y `[rows, cols]`, scale and bias `[cols]`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn scale_bias_act_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    act: u8,
    a: f32,
    b: f32,
    x: u64,
    scale: u64,
    bias: u64,
    y: u64,
    rows: usize,
    cols: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let act = activation(act, a, b)?;
    let s = [rows, cols];
    // SAFETY: see `unary_fwd_with`.
    let (x, scale, bias, mut y) = unsafe { (c.t(x, &s)?, c.t(scale, &[cols])?, c.t(bias, &[cols])?, c.t(y, &s)?) };
    c.run(py, || ops::scale_bias_act_out(&x, &scale, &bias, act, &mut y))
}

/// Gradients of `act(x * scale + bias)` into `gx` (`[rows, cols]`), `gscale` and `gbias`
/// (`[cols]`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn scale_bias_act_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    act: u8,
    a: f32,
    b: f32,
    x: u64,
    scale: u64,
    bias: u64,
    g: u64,
    gx: u64,
    gscale: u64,
    gbias: u64,
    rows: usize,
    cols: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let act = activation(act, a, b)?;
    let s = [rows, cols];
    // SAFETY: see `unary_fwd_with`.
    let (x, scale, bias, g, mut grads) = unsafe {
        (
            c.t(x, &s)?,
            c.t(scale, &[cols])?,
            c.t(bias, &[cols])?,
            c.t(g, &s)?,
            ScaleBiasActGrads { x: c.t(gx, &s)?, scale: c.t(gscale, &[cols])?, bias: c.t(gbias, &[cols])? },
        )
    };
    c.run(py, || ops::scale_bias_act_backward_out(&x, &scale, &bias, &g, act, &mut grads))
}

/// `act(a) * b` into `y` (`[rows, f]`): from the fused `x` (`[rows, 2f]`, a and b its halves) when
/// `x2` is 0, else from `a = x` and `b = x2` (`[rows, f]` each).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn glu_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    act: u8,
    a: f32,
    b: f32,
    x: u64,
    x2: u64,
    y: u64,
    rows: usize,
    f: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let act = activation(act, a, b)?;
    let s = [rows, f];
    // SAFETY: see `unary_fwd_with`.
    let mut y = unsafe { c.t(y, &s)? };
    if x2 == 0 {
        // SAFETY: as above.
        let x = unsafe { c.t(x, &[rows, 2 * f])? };
        c.run(py, || ops::glu_out(&x, act, &mut y))
    } else {
        // SAFETY: as above.
        let (a, b) = unsafe { (c.t(x, &s)?, c.t(x2, &s)?) };
        c.run(py, || ops::glu2_out(&a, &b, act, &mut y))
    }
}

/// Gradients of `act(a) * b` from `g` (`[rows, f]`): of the fused `x` into `gx` (`[rows, 2f]`)
/// when `x2` is 0, else of `a = x` and `b = x2` into `gx` and `gx2` (`[rows, f]` each).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn glu_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    act: u8,
    a: f32,
    b: f32,
    x: u64,
    x2: u64,
    g: u64,
    gx: u64,
    gx2: u64,
    rows: usize,
    f: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let act = activation(act, a, b)?;
    let s = [rows, f];
    // SAFETY: see `unary_fwd_with`.
    let g = unsafe { c.t(g, &s)? };
    if x2 == 0 {
        // SAFETY: as above.
        let (x, mut gx) = unsafe { (c.t(x, &[rows, 2 * f])?, c.t(gx, &[rows, 2 * f])?) };
        c.run(py, || ops::glu_backward_out(&x, &g, act, &mut gx))
    } else {
        // SAFETY: as above.
        let (a, b, mut ga, mut gb) = unsafe { (c.t(x, &s)?, c.t(x2, &s)?, c.t(gx, &s)?, c.t(gx2, &s)?) };
        c.run(py, || ops::glu2_backward_out(&a, &b, &g, act, &mut ga, &mut gb))
    }
}

/// Softmax (or log-softmax if `log`) of `x` into `y`, rows of `cols`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn softmax_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    log: bool,
    x: u64,
    y: u64,
    rows: usize,
    cols: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let s = [rows, cols];
    // SAFETY: see `unary_fwd_with`.
    let (x, mut y) = unsafe { (c.t(x, &s)?, c.t(y, &s)?) };
    c.run(py, || if log { ops::log_softmax_out(&x, &mut y) } else { ops::softmax_out(&x, &mut y) })
}

/// Gradient of the input of softmax (log-softmax if `log`) from its output `y` and the output's
/// gradient `g`, into `gx`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn softmax_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    log: bool,
    y: u64,
    g: u64,
    gx: u64,
    rows: usize,
    cols: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let s = [rows, cols];
    // SAFETY: see `unary_fwd_with`.
    let (y, g, mut gx) = unsafe { (c.t(y, &s)?, c.t(g, &s)?, c.t(gx, &s)?) };
    c.run(py, || {
        if log { ops::log_softmax_backward_out(&y, &g, &mut gx) } else { ops::softmax_backward_out(&y, &g, &mut gx) }
    })
}

/// Layer norm (RMS norm if `mean` is 0) of `x` (`[rows, cols]`) with optional `weight`, `bias`
/// (0: none; RMS norm has no bias) into `y`, and the f32 statistics `mean`, `rstd` (`[rows]`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn norm_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    x: u64,
    weight: u64,
    bias: u64,
    y: u64,
    mean: u64,
    rstd: u64,
    rows: usize,
    cols: usize,
    eps: f32,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let s = [rows, cols];
    // SAFETY: see `unary_fwd_with`; mean and rstd are f32 tensors of `rows`.
    let (x, w, b, mut y, mut stats) = unsafe {
        (
            c.t(x, &s)?,
            c.opt(weight, &[cols])?,
            c.opt(bias, &[cols])?,
            c.t(y, &s)?,
            NormStats { mean: if mean == 0 { None } else { Some(c.f32(mean, &[rows])?) }, rstd: c.f32(rstd, &[rows])? },
        )
    };
    let layer = stats.mean.is_some();
    if !layer && b.is_some() {
        return Err(PyValueError::new_err("rms_norm: RMS norm has no bias"));
    }
    c.run(py, || {
        if layer {
            ops::layer_norm_out(&x, w.as_ref(), b.as_ref(), eps, &mut y, &mut stats)
        } else {
            ops::rms_norm_out(&x, w.as_ref(), eps, &mut y, &mut stats)
        }
    })
}

/// Backward of `norm_fwd`: the gradient of x into `gx`, and of the weight and bias into `gw`,
/// `gb` where given (not 0).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn norm_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    x: u64,
    weight: u64,
    mean: u64,
    rstd: u64,
    g: u64,
    gx: u64,
    gw: u64,
    gb: u64,
    rows: usize,
    cols: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let s = [rows, cols];
    // SAFETY: see `norm_fwd`.
    let (x, w, stats, g, mut grads) = unsafe {
        (
            c.t(x, &s)?,
            c.opt(weight, &[cols])?,
            NormStats { mean: if mean == 0 { None } else { Some(c.f32(mean, &[rows])?) }, rstd: c.f32(rstd, &[rows])? },
            c.t(g, &s)?,
            NormGrads { x: c.t(gx, &s)?, weight: c.opt(gw, &[cols])?, bias: c.opt(gb, &[cols])? },
        )
    };
    let layer = stats.mean.is_some();
    c.run(py, || {
        if layer {
            ops::layer_norm_backward_out(&x, w.as_ref(), &stats, &g, &mut grads)
        } else {
            ops::rms_norm_backward_out(&x, w.as_ref(), &stats, &g, &mut grads)
        }
    })
}

/// The residual add fused with layer norm (RMS norm if `mean` is 0): `h = x + residual` into `h`
/// and its norm into `y` (all `[rows, cols]`), with optional `weight`, `bias` (0: none; RMS norm
/// has no bias) and the f32 statistics `mean`, `rstd` (`[rows]`). `h` must be neither `x` nor
/// `residual` (the Python layer allocates it).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn add_norm_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    x: u64,
    residual: u64,
    weight: u64,
    bias: u64,
    y: u64,
    h: u64,
    mean: u64,
    rstd: u64,
    rows: usize,
    cols: usize,
    eps: f32,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let s = [rows, cols];
    if h == x || h == residual {
        return Err(PyValueError::new_err("add_norm: h must not be x or the residual"));
    }
    // SAFETY: see `unary_fwd_with`; mean and rstd are f32 tensors of `rows`.
    let (x, r, w, b, mut out) = unsafe {
        (
            c.t(x, &s)?,
            c.t(residual, &s)?,
            c.opt(weight, &[cols])?,
            c.opt(bias, &[cols])?,
            ops::AddNorm {
                y: c.t(y, &s)?,
                h: c.t(h, &s)?,
                stats: NormStats {
                    mean: if mean == 0 { None } else { Some(c.f32(mean, &[rows])?) },
                    rstd: c.f32(rstd, &[rows])?,
                },
            },
        )
    };
    let layer = out.stats.mean.is_some();
    if !layer && b.is_some() {
        return Err(PyValueError::new_err("add_rms_norm: RMS norm has no bias"));
    }
    c.run(py, || {
        if layer {
            ops::add_layer_norm_out(&x, &r, w.as_ref(), b.as_ref(), eps, &mut out)
        } else {
            ops::add_rms_norm_out(&x, &r, w.as_ref(), eps, &mut out)
        }
    })
}

/// Backward of `add_norm_fwd` from its `h` and statistics, the gradient `g` of `y` and `dh` of `h`
/// (0: none): the gradient of x and of the residual (one tensor) into `gx`, of the weight and bias
/// into `gw`, `gb` where given (not 0).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn add_norm_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    h: u64,
    weight: u64,
    mean: u64,
    rstd: u64,
    g: u64,
    dh: u64,
    gx: u64,
    gw: u64,
    gb: u64,
    rows: usize,
    cols: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let s = [rows, cols];
    // SAFETY: see `norm_fwd`.
    let (h, w, stats, g, dh, mut grads) = unsafe {
        (
            c.t(h, &s)?,
            c.opt(weight, &[cols])?,
            NormStats { mean: if mean == 0 { None } else { Some(c.f32(mean, &[rows])?) }, rstd: c.f32(rstd, &[rows])? },
            c.t(g, &s)?,
            c.opt(dh, &s)?,
            NormGrads { x: c.t(gx, &s)?, weight: c.opt(gw, &[cols])?, bias: c.opt(gb, &[cols])? },
        )
    };
    let layer = stats.mean.is_some();
    c.run(py, || {
        if layer {
            ops::add_layer_norm_backward_out(&h, w.as_ref(), &stats, &g, dh.as_ref(), &mut grads)
        } else {
            ops::add_rms_norm_backward_out(&h, w.as_ref(), &stats, &g, dh.as_ref(), &mut grads)
        }
    })
}

fn reduction(code: u8) -> PyResult<Reduction> {
    match code {
        0 => Ok(Reduction::None),
        1 => Ok(Reduction::Mean),
        2 => Ok(Reduction::Sum),
        _ => Err(PyValueError::new_err(format!("reduction code {code}: expected 0 (none), 1 (mean) or 2 (sum)"))),
    }
}

/// Cross-entropy of `logits` (`[rows, cols]`) against int64 `target` (`[rows]`) into `loss`
/// (`[rows]` for reduction none, else `[]`), saving f32 `lse` (`[rows]`) and `count` (`[1]`).
/// Synchronises with the stream to check the targets (an out-of-range one is a ValueError
/// naming its row), except while the stream captures a CUDA graph (then such a row's loss is
/// NaN, unreported).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cross_entropy_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    logits: u64,
    target: u64,
    loss: u64,
    lse: u64,
    count: u64,
    rows: usize,
    cols: usize,
    reduction_code: u8,
    ignore_index: i64,
    label_smoothing: f32,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let opts = CrossEntropyOpts { reduction: reduction(reduction_code)?, ignore_index, label_smoothing };
    let loss_shape: &[usize] = if opts.reduction == Reduction::None { &[rows] } else { &[] };
    // SAFETY: see `unary_fwd_with`; target holds `rows` int64, lse `rows` f32, count one f32.
    let (logits, target, mut loss, mut saved) = unsafe {
        (
            c.t(logits, &[rows, cols])?,
            IndexTensor::from_device_ptr(&c.dev, target, &[rows]).map_err(to_py)?,
            c.t(loss, loss_shape)?,
            ops::CrossEntropySaved::from_parts(c.f32(lse, &[rows])?, c.f32(count, &[1])?, opts).map_err(to_py)?,
        )
    };
    c.run(py, || ops::cross_entropy_out(&logits, &target, opts, &mut loss, &mut saved))
}

/// Gradient of the logits of `cross_entropy_fwd` from the loss's gradient `g` (the loss's
/// shape) and the saved `lse`, `count`, into `gx`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cross_entropy_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    logits: u64,
    target: u64,
    lse: u64,
    count: u64,
    g: u64,
    gx: u64,
    rows: usize,
    cols: usize,
    reduction_code: u8,
    ignore_index: i64,
    label_smoothing: f32,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let opts = CrossEntropyOpts { reduction: reduction(reduction_code)?, ignore_index, label_smoothing };
    let g_shape: &[usize] = if opts.reduction == Reduction::None { &[rows] } else { &[] };
    // SAFETY: see `cross_entropy_fwd`.
    let (logits, target, saved, g, mut gx) = unsafe {
        (
            c.t(logits, &[rows, cols])?,
            IndexTensor::from_device_ptr(&c.dev, target, &[rows]).map_err(to_py)?,
            ops::CrossEntropySaved::from_parts(c.f32(lse, &[rows])?, c.f32(count, &[1])?, opts).map_err(to_py)?,
            c.t(g, g_shape)?,
            c.t(gx, &[rows, cols])?,
        )
    };
    c.run(py, || ops::cross_entropy_backward_out(&logits, &target, &saved, &g, &mut gx))
}

/// The one-pass cross-entropy: the loss into `loss` (`[rows]` for reduction none, else `[]`)
/// and the logits' gradient for a loss gradient of 1 into `gx`. Synchronises with the stream to
/// check the targets, as `cross_entropy_fwd` (and not under CUDA graph capture either).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cross_entropy_one_pass_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    logits: u64,
    target: u64,
    loss: u64,
    gx: u64,
    rows: usize,
    cols: usize,
    reduction_code: u8,
    ignore_index: i64,
    label_smoothing: f32,
    z_loss: f32,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let ce = CrossEntropyOpts { reduction: reduction(reduction_code)?, ignore_index, label_smoothing };
    let opts = CrossEntropyOnePassOpts { ce, z_loss, grad_scale: 1.0 };
    let loss_shape: &[usize] = if ce.reduction == Reduction::None { &[rows] } else { &[] };
    // SAFETY: see `unary_fwd_with`; target holds `rows` int64, gx `rows * cols` (a buffer of
    // its own).
    let (x, target, mut loss, mut gx) = unsafe {
        (
            c.t(logits, &[rows, cols])?,
            IndexTensor::from_device_ptr(&c.dev, target, &[rows]).map_err(to_py)?,
            c.t(loss, loss_shape)?,
            c.t(gx, &[rows, cols])?,
        )
    };
    c.run(py, || ops::cross_entropy_one_pass_out(&x, &target, opts, None, &mut loss, &mut gx))
}

/// An activation the GEMM fuses into its store (identity, relu, GELU, GELU-tanh, SiLU), by its
/// code in `ACTIVATIONS`.
fn linear_activation(code: u8) -> PyResult<Activation> {
    let act = activation(code, 0.0, 0.0)?;
    if !Gemm::can_fuse(act) {
        return Err(PyValueError::new_err(format!(
            "linear: activation {act:?} is not fused into the GEMM (see LINEAR_ACTIVATIONS)"
        )));
    }
    Ok(act)
}

/// The linear layer's operands as matrices: `x [rows, inp]`, `weight [out, inp]`, `bias [out]`
/// (0: none); all of the call's dtype (f32, or bf16 or f16 on the tensor cores).
///
/// # Safety
/// As `Call::t`, for tensors of those sizes and the call's dtype.
unsafe fn linear_operands(
    c: &Call,
    x: u64,
    weight: u64,
    bias: u64,
    (rows, inp, out): (usize, usize, usize),
) -> PyResult<(Tensor, Tensor, Option<Tensor>)> {
    // SAFETY: the caller's contract.
    unsafe { Ok((c.t(x, &[rows, inp])?, c.t(weight, &[out, inp])?, c.opt(bias, &[out])?)) }
}

/// `act(x @ weight^T + bias)` into `y` (`[rows, out]`), one GEMM with the bias and activation
/// fused into its store. All tensors of dtype code `dt` (f32; bf16 or f16 accumulate in f32 on
/// the tensor cores and round once).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn linear_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dt: u8,
    act: u8,
    x: u64,
    weight: u64,
    bias: u64,
    y: u64,
    rows: usize,
    inp: usize,
    out: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dt)?;
    let act = linear_activation(act)?;
    // SAFETY: see `unary_fwd_with`; all four are of dtype `dt`.
    let ((x, w, b), mut y) =
        unsafe { (linear_operands(&c, x, weight, bias, (rows, inp, out))?, c.t(y, &[rows, out])?) };
    c.run(py, || ops::gemm_ex(&x, &w, &mut y, Gemm::new(false, true), b.as_ref(), act))
}

/// The training forward: the pre-activation `z = x @ weight^T + bias` into `pre` (one GEMM), then
/// `y = act(z)` (one element-wise pass), both `[rows, out]`; the backward of GELU and SiLU needs
/// `z`. All of dtype code `dt`, as `linear_fwd`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn linear_train_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dt: u8,
    act: u8,
    x: u64,
    weight: u64,
    bias: u64,
    y: u64,
    pre: u64,
    rows: usize,
    inp: usize,
    out: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dt)?;
    let act = linear_activation(act)?;
    let s = [rows, out];
    // SAFETY: see `linear_fwd`.
    let ((x, w, b), mut y, mut z) =
        unsafe { (linear_operands(&c, x, weight, bias, (rows, inp, out))?, c.t(y, &s)?, c.t(pre, &s)?) };
    c.run(py, || {
        ops::gemm_ex(&x, &w, &mut z, Gemm::new(false, true), b.as_ref(), Activation::Identity)?;
        ops::unary_out(&z, act, &mut y)
    })
}

/// Gradients of `y = act(x @ weight^T + bias)` from `g` (y's gradient, `[rows, out]`), each into
/// its output where given (not 0): `gx [rows, inp] = dz @ weight`, `gw [out, inp] = dz^T @ x`
/// (the GEMM reads dz transposed in place), `gb [out]` = the column sums of dz, where `dz =
/// act'(z) * g` is written into `dz` (`[rows, out]`, scratch) from `saved`: the output y for
/// relu, the pre-activation z for GELU, GELU-tanh and SiLU. Identity uses neither (dz is g).
/// All of dtype code `dt`, as `linear_fwd`; `gb` sums in f32 and rounds once.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn linear_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dt: u8,
    act: u8,
    x: u64,
    weight: u64,
    saved: u64,
    g: u64,
    dz: u64,
    gx: u64,
    gw: u64,
    gb: u64,
    rows: usize,
    inp: usize,
    out: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dt)?;
    let act = linear_activation(act)?;
    let s = [rows, out];
    let identity = matches!(act, Activation::Identity);
    // SAFETY: see `linear_fwd`; the optional ones are absent when 0.
    let ((x, w, _), g, saved, mut dz, mut gx, mut gw, mut gb) = unsafe {
        (
            linear_operands(&c, x, weight, 0, (rows, inp, out))?,
            c.t(g, &s)?,
            if identity { None } else { Some(c.t(saved, &s)?) },
            if identity { None } else { Some(c.t(dz, &s)?) },
            c.opt(gx, &[rows, inp])?,
            c.opt(gw, &[out, inp])?,
            c.opt(gb, &[out])?,
        )
    };
    c.run(py, || {
        let dz: &Tensor = match (saved, dz.as_mut()) {
            (Some(saved), Some(dz)) => {
                ops::unary_backward_out(&saved, &g, act, dz)?;
                dz
            }
            _ => &g,
        };
        if let Some(gx) = gx.as_mut() {
            ops::gemm_ex(dz, &w, gx, Gemm::default(), None, Activation::Identity)?;
        }
        if let Some(gw) = gw.as_mut() {
            ops::gemm_ex(dz, &x, gw, Gemm::new(true, false), None, Activation::Identity)?;
        }
        if let Some(gb) = gb.as_mut() {
            ops::reduce_leading_dims_out(dz, ReduceOp::Sum, gb)?;
        }
        Ok(())
    })
}

/// The options of an attention call: `layout` 0 Bhsd (`[B, H, S, D]`), 1 Bshd (`[B, S, H, D]`);
/// `causal` 0 none, 1 top left (PyTorch's `is_causal`), 2 bottom right; `scale` None for
/// `1/sqrt(D)`; a window `(left, right)` where a negative side is unbounded, and no window if both
/// are.
fn attention_opts(layout: u8, causal: u8, scale: Option<f32>, window: (i64, i64)) -> PyResult<AttentionOpts> {
    let layout = match layout {
        0 => Layout::Bhsd,
        1 => Layout::Bshd,
        _ => {
            return Err(PyValueError::new_err(format!(
                "attention layout code {layout}: expected 0 (Bhsd) or 1 (Bshd)"
            )));
        }
    };
    let causal = match causal {
        0 => Causal::None,
        1 => Causal::TopLeft,
        2 => Causal::BottomRight,
        _ => {
            return Err(PyValueError::new_err(format!(
                "attention causal code {causal}: expected 0 (none), 1 (top left) or 2 (bottom right)"
            )));
        }
    };
    let side = |x: i64| usize::try_from(x).unwrap_or(usize::MAX);
    let window = if window.0 < 0 && window.1 < 0 { None } else { Some((side(window.0), side(window.1))) };
    Ok(AttentionOpts { causal, scale, window, layout })
}

/// A rank-4 shape from Python.
fn shape4(what: &str, s: &[usize]) -> PyResult<[usize; 4]> {
    <[usize; 4]>::try_from(s)
        .map_err(|_| PyValueError::new_err(format!("attention: {what} must have rank 4, got {s:?}")))
}

/// Scaled dot-product attention, forward: q (`q_shape`, in `layout`'s order), k and v
/// (`kv_shape`), all of the call's dtype (bf16 or f16), into `out` (q's shape) and the f32 `lse`
/// (`[B, Hq, Sq]`). Options as [`attention_opts`].
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn attention_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    layout: u8,
    causal: u8,
    scale: Option<f32>,
    window: (i64, i64),
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    lse: u64,
    q_shape: Vec<usize>,
    kv_shape: Vec<usize>,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let opts = attention_opts(layout, causal, scale, window)?;
    let qs = shape4("q", &q_shape)?;
    let ks = shape4("k", &kv_shape)?;
    let (b, hq, sq) = match opts.layout {
        Layout::Bhsd => (qs[0], qs[1], qs[2]),
        Layout::Bshd => (qs[0], qs[2], qs[1]),
    };
    // SAFETY: see `unary_fwd_with`; lse holds `b * hq * sq` f32.
    let (q, k, v, mut out, mut lse) =
        unsafe { (c.t(q, &qs)?, c.t(k, &ks)?, c.t(v, &ks)?, c.t(out, &qs)?, c.f32(lse, &[b, hq, sq])?) };
    c.run(py, || ops::attention_out(&q, &k, &v, &opts, &mut out, &mut lse))
}

/// Scaled dot-product attention, backward: from the forward's inputs, its `out` and `lse`, and
/// `dout` (out's gradient), the gradients `dq` (q's shape), `dk` and `dv` (k's); shapes, dtype
/// and options as `attention_fwd`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn attention_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    layout: u8,
    causal: u8,
    scale: Option<f32>,
    window: (i64, i64),
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    lse: u64,
    dout: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    q_shape: Vec<usize>,
    kv_shape: Vec<usize>,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let opts = attention_opts(layout, causal, scale, window)?;
    let qs = shape4("q", &q_shape)?;
    let ks = shape4("k", &kv_shape)?;
    let (b, hq, sq) = match opts.layout {
        Layout::Bhsd => (qs[0], qs[1], qs[2]),
        Layout::Bshd => (qs[0], qs[2], qs[1]),
    };
    // SAFETY: see `attention_fwd`; dq has q's shape, dk and dv k's.
    let (q, k, v, out, lse, dout, mut dq, mut dk, mut dv) = unsafe {
        (
            c.t(q, &qs)?,
            c.t(k, &ks)?,
            c.t(v, &ks)?,
            c.t(out, &qs)?,
            c.f32(lse, &[b, hq, sq])?,
            c.t(dout, &qs)?,
            c.t(dq, &qs)?,
            c.t(dk, &ks)?,
            c.t(dv, &ks)?,
        )
    };
    c.run(py, || ops::attention_backward_out(&q, &k, &v, &out, &lse, &dout, &opts, (&mut dq, &mut dk, &mut dv)))
}

/// Rotary position embedding of `x` (`shape`, rank 4 in `layout`: 0 `[B, H, S, D]`, 1 `[B, S, H,
/// D]`) into `y`, by the f32 tables `cos`, `sin` (`[max_pos, half]`, rotating the first `2 half`
/// elements of each row); pairs `(2 i, 2 i + 1)` if `interleaved`, else `(i, i + half)`; row `s` at
/// position `offset + s`. `backward`: the rotation by the opposite angle (`x` is the output's
/// gradient, `y` the input's).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn rope(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    layout: u8,
    interleaved: bool,
    offset: usize,
    backward: bool,
    x: u64,
    y: u64,
    cos: u64,
    sin: u64,
    shape: Vec<usize>,
    max_pos: usize,
    half: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let layout = match layout {
        0 => Layout::Bhsd,
        1 => Layout::Bshd,
        _ => return Err(PyValueError::new_err(format!("rope: layout code {layout}: expected 0 (Bhsd) or 1 (Bshd)"))),
    };
    let shape = <[usize; 4]>::try_from(shape.as_slice())
        .map_err(|_| PyValueError::new_err(format!("rope: x must have rank 4, got {shape:?}")))?;
    let style = if interleaved { RopeStyle::Interleaved } else { RopeStyle::Half };
    let opts = RopeOpts { layout, style, offset, rotary_dim: Some(2 * half) };
    let table = [max_pos, half];
    // SAFETY: see `unary_fwd_with`; the tables are f32 `[max_pos, half]`.
    let (x, mut y, cos, sin) = unsafe { (c.t(x, &shape)?, c.t(y, &shape)?, c.f32(cos, &table)?, c.f32(sin, &table)?) };
    c.run(py, || {
        if backward {
            ops::rope_backward_out(&x, &cos, &sin, &opts, &mut y)
        } else {
            ops::rope_out(&x, &cos, &sin, &opts, &mut y)
        }
    })
}

/// Rows of `weight` (`[v, d]`) for the `n` int64 `idx` into `out` (`[n, d]`); an index outside
/// `[0, v)` gives a row of zeros.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn embedding_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    weight: u64,
    idx: u64,
    out: u64,
    v: usize,
    d: usize,
    n: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    // SAFETY: see `unary_fwd_with`; idx holds `n` int64.
    let (weight, idx, mut out) = unsafe {
        (c.t(weight, &[v, d])?, IndexTensor::from_device_ptr(&c.dev, idx, &[n]).map_err(to_py)?, c.t(out, &[n, d])?)
    };
    c.run(py, || ops::embedding_out(&weight, &idx, None, &mut out))
}

/// The weight's gradient `gw` (`[v, d]`) of `embedding_fwd` from the output's `grad` (`[n, d]`)
/// and the `n` int64 `idx`: the sum of the gradient rows of each index, deterministic; no
/// gradient for `padding_idx` (a row in `[0, v)`, or none).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn embedding_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    grad: u64,
    idx: u64,
    gw: u64,
    v: usize,
    d: usize,
    n: usize,
    padding_idx: Option<i64>,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    // SAFETY: see `embedding_fwd`.
    let (grad, idx, mut gw) = unsafe {
        (c.t(grad, &[n, d])?, IndexTensor::from_device_ptr(&c.dev, idx, &[n]).map_err(to_py)?, c.t(gw, &[v, d])?)
    };
    c.run(py, || ops::embedding_backward_out(&grad, &idx, padding_idx, &mut gw))
}

/// An image layout code: 0 NCHW (`[N, C, H, W]`), 1 NHWC (`[N, H, W, C]`, PyTorch's
/// `channels_last` memory).
fn layout2d(op: &str, code: u8) -> PyResult<Layout2d> {
    match code {
        0 => Ok(Layout2d::Nchw),
        1 => Ok(Layout2d::Nhwc),
        _ => Err(PyValueError::new_err(format!("{op}: layout code {code}: expected 0 (NCHW) or 1 (NHWC)"))),
    }
}

/// A rank-4 shape from Python.
fn dims4(op: &str, what: &str, s: &[usize]) -> PyResult<[usize; 4]> {
    <[usize; 4]>::try_from(s).map_err(|_| PyValueError::new_err(format!("{op}: {what} must have rank 4, got {s:?}")))
}

/// A convolution's options; pairs are `(height, width)`.
fn conv_opts(
    layout: u8,
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
    groups: usize,
) -> PyResult<Conv2dOpts> {
    Ok(Conv2dOpts { stride, padding, dilation, groups, layout: layout2d("conv2d", layout)? })
}

/// 2-d convolution: `x` (`x_shape`, rank 4 in `layout`: 0 NCHW with the filter `[K, C/groups,
/// R, S]`, 1 NHWC with the filter `[K, R, S, C/groups]`), the filter `w` (`w_shape`) and the
/// optional `bias` (`[K]`, 0: none), all of the call's dtype, into `y` (`y_shape`, the output's
/// shape in the layout).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn conv2d_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    layout: u8,
    x: u64,
    w: u64,
    bias: u64,
    y: u64,
    x_shape: Vec<usize>,
    w_shape: Vec<usize>,
    y_shape: Vec<usize>,
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
    groups: usize,
) -> PyResult<()> {
    let c = Call::new(device, stream, dtype)?;
    let opts = conv_opts(layout, stride, padding, dilation, groups)?;
    let (xs, ws, ys) =
        (dims4("conv2d", "x", &x_shape)?, dims4("conv2d", "w", &w_shape)?, dims4("conv2d", "y", &y_shape)?);
    let k = ws[0];
    // SAFETY: see `unary_fwd_with`; the bias holds K elements.
    let (x, w, b, mut y) = unsafe { (c.t(x, &xs)?, c.t(w, &ws)?, c.opt(bias, &[k])?, c.t(y, &ys)?) };
    c.run(py, || ops::conv2d_out(&x, &w, b.as_ref(), &opts, &mut y))
}

/// Gradients of `conv2d_fwd` from `dy` (`y_shape`), each into its output where given (not 0):
/// `dx` (x's shape), `dw` (the filter's), `db` (`[K]`). Arguments as `conv2d_fwd`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn conv2d_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    layout: u8,
    x: u64,
    w: u64,
    dy: u64,
    dx: u64,
    dw: u64,
    db: u64,
    x_shape: Vec<usize>,
    w_shape: Vec<usize>,
    y_shape: Vec<usize>,
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
    groups: usize,
) -> PyResult<()> {
    let op = "conv2d_backward";
    let c = Call::new(device, stream, dtype)?;
    let opts = conv_opts(layout, stride, padding, dilation, groups)?;
    let (xs, ws, ys) = (dims4(op, "x", &x_shape)?, dims4(op, "w", &w_shape)?, dims4(op, "dy", &y_shape)?);
    // SAFETY: see `unary_fwd_with`; the optional ones are absent when 0.
    let (x, w, dy, mut grads) = unsafe {
        (
            c.t(x, &xs)?,
            c.t(w, &ws)?,
            c.t(dy, &ys)?,
            Conv2dGrads { input: c.opt(dx, &xs)?, weight: c.opt(dw, &ws)?, bias: c.opt(db, &[ws[0]])? },
        )
    };
    c.run(py, || ops::conv2d_backward_out(&x, &w, &dy, &opts, &mut grads))
}

/// Batch norm 2d of `x` (`shape`, rank 4 in `layout`, as `conv2d_fwd`) into `y`, with the
/// optional f32 `weight`, `bias` (`[C]`, 0: none) and running statistics `running_mean`,
/// `running_var` (f32 `[C]`, both or neither; updated in place in training, read in
/// evaluation), saving the f32 `mean` and `invstd` (`[C]`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn batch_norm_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    layout: u8,
    training: bool,
    momentum: f32,
    eps: f32,
    x: u64,
    weight: u64,
    bias: u64,
    running_mean: u64,
    running_var: u64,
    y: u64,
    mean: u64,
    invstd: u64,
    shape: Vec<usize>,
) -> PyResult<()> {
    let op = "batch_norm";
    let c = Call::new(device, stream, dtype)?;
    let layout = layout2d(op, layout)?;
    let s = dims4(op, "x", &shape)?;
    let ch = [layout.dims(op, &s).map_err(to_py)?.1];
    let opt32 = |p: u64| -> PyResult<Option<Tensor>> {
        // SAFETY: a live f32 tensor of C elements, or 0 (see `Call::t`).
        if p == 0 { Ok(None) } else { unsafe { c.f32(p, &ch) }.map(Some) }
    };
    let (w, b, mut rm, mut rv) = (opt32(weight)?, opt32(bias)?, opt32(running_mean)?, opt32(running_var)?);
    // SAFETY: see `unary_fwd_with`; mean and invstd are f32 `[C]`.
    let (x, mut y, mut stats) =
        unsafe { (c.t(x, &s)?, c.t(y, &s)?, BatchNormStats { mean: c.f32(mean, &ch)?, invstd: c.f32(invstd, &ch)? }) };
    let opts = BatchNormOpts { training, momentum, eps, layout };
    c.run(py, || ops::batch_norm_out(&x, w.as_ref(), b.as_ref(), rm.as_mut(), rv.as_mut(), &opts, &mut y, &mut stats))
}

/// Gradients of `batch_norm_fwd` from `g` (x's shape) and the saved `mean`, `invstd`: of x into
/// `gx`, and of the weight and bias (f32 `[C]`) into `gw`, `gb` where given (not 0); `training`
/// as the forward's.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn batch_norm_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    layout: u8,
    training: bool,
    x: u64,
    weight: u64,
    mean: u64,
    invstd: u64,
    g: u64,
    gx: u64,
    gw: u64,
    gb: u64,
    shape: Vec<usize>,
) -> PyResult<()> {
    let op = "batch_norm_backward";
    let c = Call::new(device, stream, dtype)?;
    let layout = layout2d(op, layout)?;
    let s = dims4(op, "x", &shape)?;
    let ch = [layout.dims(op, &s).map_err(to_py)?.1];
    let opt32 = |p: u64| -> PyResult<Option<Tensor>> {
        // SAFETY: a live f32 tensor of C elements, or 0 (see `Call::t`).
        if p == 0 { Ok(None) } else { unsafe { c.f32(p, &ch) }.map(Some) }
    };
    let (w, dw, db) = (opt32(weight)?, opt32(gw)?, opt32(gb)?);
    // SAFETY: see `unary_fwd_with`; mean and invstd are f32 `[C]`.
    let (x, g, stats, dx) = unsafe {
        (
            c.t(x, &s)?,
            c.t(g, &s)?,
            BatchNormStats { mean: c.f32(mean, &ch)?, invstd: c.f32(invstd, &ch)? },
            c.t(gx, &s)?,
        )
    };
    let mut grads = BatchNormGrads { x: dx, weight: dw, bias: db };
    let opts = BatchNormOpts { training, layout, ..BatchNormOpts::default() };
    c.run(py, || ops::batch_norm_backward_out(&x, w.as_ref(), &stats, &g, &opts, &mut grads))
}

/// A pooling's options; pairs are `(height, width)`.
fn pool_opts(
    op: &str,
    layout: u8,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    ceil_mode: bool,
    count_include_pad: bool,
) -> PyResult<Pool2dOpts> {
    Ok(Pool2dOpts { kernel, stride, padding, ceil_mode, count_include_pad, layout: layout2d(op, layout)? })
}

/// Max pooling 2d of `x` (`x_shape`, rank 4 in `layout`) into `y` and the int64 `idx` (both
/// `y_shape`): each window's maximum and its index `h * W + w` in the plane, as PyTorch's.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn max_pool2d_fwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    layout: u8,
    x: u64,
    y: u64,
    idx: u64,
    x_shape: Vec<usize>,
    y_shape: Vec<usize>,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    ceil_mode: bool,
) -> PyResult<()> {
    let op = "max_pool2d";
    let c = Call::new(device, stream, dtype)?;
    let opts = pool_opts(op, layout, kernel, stride, padding, ceil_mode, true)?;
    let (xs, ys) = (dims4(op, "x", &x_shape)?, dims4(op, "y", &y_shape)?);
    // SAFETY: see `unary_fwd_with`; idx holds the output's count of int64.
    let (x, mut y, mut idx) =
        unsafe { (c.t(x, &xs)?, c.t(y, &ys)?, IndexTensor::from_device_ptr(&c.dev, idx, &ys).map_err(to_py)?) };
    c.run(py, || ops::max_pool2d_out(&x, &opts, &mut y, &mut idx))
}

/// The input's gradient `gx` (`x_shape`) of `max_pool2d_fwd` from `g` and the saved `idx`
/// (`y_shape`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn max_pool2d_bwd(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    layout: u8,
    g: u64,
    idx: u64,
    gx: u64,
    x_shape: Vec<usize>,
    y_shape: Vec<usize>,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    ceil_mode: bool,
) -> PyResult<()> {
    let op = "max_pool2d_backward";
    let c = Call::new(device, stream, dtype)?;
    let opts = pool_opts(op, layout, kernel, stride, padding, ceil_mode, true)?;
    let (xs, ys) = (dims4(op, "x", &x_shape)?, dims4(op, "grad", &y_shape)?);
    // SAFETY: see `max_pool2d_fwd`.
    let (g, idx, mut gx) =
        unsafe { (c.t(g, &ys)?, IndexTensor::from_device_ptr(&c.dev, idx, &ys).map_err(to_py)?, c.t(gx, &xs)?) };
    c.run(py, || ops::max_pool2d_backward_out(&g, &idx, &opts, &mut gx))
}

/// Average pooling 2d of `x` (`x_shape`) into `y` (`y_shape`), or, with `backward`, the input's
/// gradient into `y` (`x_shape`) from the output's gradient `x` (`y_shape`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn avg_pool2d(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    layout: u8,
    backward: bool,
    x: u64,
    y: u64,
    x_shape: Vec<usize>,
    y_shape: Vec<usize>,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    ceil_mode: bool,
    count_include_pad: bool,
) -> PyResult<()> {
    let op = "avg_pool2d";
    let c = Call::new(device, stream, dtype)?;
    let opts = pool_opts(op, layout, kernel, stride, padding, ceil_mode, count_include_pad)?;
    let (xs, ys) = (dims4(op, "x", &x_shape)?, dims4(op, "y", &y_shape)?);
    if backward {
        // SAFETY: see `unary_fwd_with`.
        let (g, mut gx) = unsafe { (c.t(x, &ys)?, c.t(y, &xs)?) };
        c.run(py, || ops::avg_pool2d_backward_out(&g, &opts, &mut gx))
    } else {
        // SAFETY: as above.
        let (x, mut y) = unsafe { (c.t(x, &xs)?, c.t(y, &ys)?) };
        c.run(py, || ops::avg_pool2d_out(&x, &opts, &mut y))
    }
}

/// Global average pooling of `x` (`x_shape`, rank 4 in `layout`) into `y` (`[N, C, 1, 1]` or
/// `[N, 1, 1, C]`), or, with `backward`, the input's gradient into `y` (`x_shape`) from the
/// output's gradient `x`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn global_avg_pool2d(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype: u8,
    layout: u8,
    backward: bool,
    x: u64,
    y: u64,
    x_shape: Vec<usize>,
) -> PyResult<()> {
    let op = "global_avg_pool2d";
    let c = Call::new(device, stream, dtype)?;
    let layout = layout2d(op, layout)?;
    let xs = dims4(op, "x", &x_shape)?;
    let (n, ch, _, _) = layout.dims(op, &xs).map_err(to_py)?;
    let ps = layout.shape(n, ch, 1, 1);
    if backward {
        // SAFETY: see `unary_fwd_with`.
        let (g, mut gx) = unsafe { (c.t(x, &ps)?, c.t(y, &xs)?) };
        c.run(py, || ops::global_avg_pool2d_backward_out(&g, layout, &mut gx))
    } else {
        // SAFETY: as above.
        let (x, mut y) = unsafe { (c.t(x, &xs)?, c.t(y, &ps)?) };
        c.run(py, || ops::global_avg_pool2d_out(&x, layout, &mut y))
    }
}

/// Whether the library can run kernels here, and if not why: `(True, "<GPU name>")` or
/// `(False, "<reason>")`. Initialises device 0 (context, stream, kernel module) when it can.
#[pyfunction]
fn cuda_status(py: Python<'_>) -> (bool, String) {
    py.detach(|| match kernels::device_count().and_then(|n| if n == 0 { Ok(None) } else { device(0).map(Some) }) {
        Err(e) => (false, e.to_string()),
        Ok(None) => (false, "no CUDA device: the driver reports 0 devices".to_string()),
        Ok(Some(d)) => (true, d.name().to_string()),
    })
}

/// Sets how device `ordinal`'s f32 products (the linear layer's) are computed: `"highest"` (f32
/// FMAs, the default), `"tf32x3"` (the tensor cores with f32 accuracy; `Precision::Tf32x3` of
/// the Rust API) or `"high"` (alias `"tf32"`: plain TF32, PyTorch's `"high"`, about 2^-10 per
/// product; `Precision::Tf32`). For every caller in the process, as
/// `torch.set_float32_matmul_precision`.
#[pyfunction]
fn set_f32_matmul_precision(py: Python<'_>, ordinal: usize, precision: &str) -> PyResult<()> {
    let p = match precision {
        "highest" => Precision::Highest,
        "tf32x3" => Precision::Tf32x3,
        "high" | "tf32" => Precision::Tf32,
        other => {
            return Err(PyValueError::new_err(format!(
                "set_f32_matmul_precision: {other:?} is not a precision (\"highest\", \"tf32x3\" or \"high\")"
            )));
        }
    };
    py.detach(|| device(ordinal).map(|d| d.set_f32_matmul_precision(p))).map_err(to_py)
}

/// The precision `set_f32_matmul_precision` set on device `ordinal`.
#[pyfunction]
fn f32_matmul_precision(py: Python<'_>, ordinal: usize) -> PyResult<&'static str> {
    let p = py.detach(|| device(ordinal).map(|d| d.f32_matmul_precision())).map_err(to_py)?;
    Ok(match p {
        Precision::Highest => "highest",
        Precision::Tf32 => "high",
        Precision::Tf32x3 | Precision::Tf32x3Always => "tf32x3",
    })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("PTX_ARCH", kernels::ptx_arches().join(","))?;
    m.add("ALIGNMENT", kernels::interop::ALIGNMENT)?;
    m.add("UNARY_OPS", unary_rows())?;
    let fused: Vec<&str> = Activation::ALL.iter().filter(|&&a| Gemm::can_fuse(a)).map(|a| a.name()).collect();
    m.add("LINEAR_ACTIVATIONS", fused)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(set_f32_matmul_precision, m)?)?;
    m.add_function(wrap_pyfunction!(f32_matmul_precision, m)?)?;
    m.add_function(wrap_pyfunction!(activation_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(activation_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(activation_bwd_y, m)?)?;
    m.add_function(wrap_pyfunction!(unary_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(unary_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(binary_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(transpose, m)?)?;
    m.add_function(wrap_pyfunction!(binary_row_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(scale_bias_act_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(scale_bias_act_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(glu_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(glu_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(softmax_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(softmax_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(norm_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(norm_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(add_norm_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(add_norm_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(cross_entropy_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(cross_entropy_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(cross_entropy_one_pass_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(linear_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(linear_train_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(linear_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(attention_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(attention_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(rope, m)?)?;
    m.add_function(wrap_pyfunction!(embedding_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(embedding_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(conv2d_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(conv2d_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(batch_norm_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(batch_norm_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(max_pool2d_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(max_pool2d_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(avg_pool2d, m)?)?;
    m.add_function(wrap_pyfunction!(global_avg_pool2d, m)?)?;
    Ok(())
}
