//! The library's ops inside [candle](https://github.com/huggingface/candle) (cargo feature
//! `candle`, off by default; built against candle-core 0.11.1, which uses cudarc 0.19 as this
//! crate does).
//!
//! Each op is a candle custom op (`CustomOp1/2/3`): [`candle_core::Tensor::apply_op1`] and its
//! siblings run it, and candle's autograd backpropagates through it with the library's backward
//! kernel (itself a custom op, without a second derivative). The functions below are the ops as
//! candle users call them:
//!
//! ```no_run
//! use candle_core::{Device, Tensor};
//! use kernels::ops::Activation;
//! # fn main() -> candle_core::Result<()> {
//! let x = candle_core::Var::from_tensor(&Tensor::randn(0f32, 1., (64, 1000), &Device::new_cuda(0)?)?)?;
//! let y = kernels::candle::log_softmax(&kernels::candle::activation(&x, Activation::Gelu)?)?;
//! let grads = y.sum_all()?.backward()?;
//! let dx = grads.get(&x).expect("x takes part in y");
//! # let _ = dx; Ok(()) }
//! ```
//!
//! Zero copies: the kernels read candle's device buffers where they are and write outputs that
//! candle allocated, on candle's stream (the library's foreign-stream path,
//! [`crate::interop`]), with candle's own stream-synchronisation events honoured. An input that
//! is not contiguous, or whose first element is not 16-byte aligned (a narrowed view), is first
//! copied to a fresh contiguous buffer by candle. f32, f16 and bf16 (attention: bf16 and f16);
//! other dtypes are refused with an error naming the op. On the CPU the ops return an error:
//! use candle's own ops there. The gradients follow PyTorch's conventions: ReLU's derivative at
//! exactly 0 is 0, where candle's own `relu` takes 1.
//!
//! Build: candle's CUDA backend compiles its kernels with nvcc and links the CUDA libraries
//! (driver, cuBLAS, cuRAND, NVRTC) at build time, and so does a build with this feature; the
//! default build needs neither (README, section candle).

use crate::ops::{
    self, Activation, AttentionOpts, Causal, CrossEntropyOpts, CrossEntropySaved, Gemm, NormGrads, NormStats, ReduceOp,
    ScaleBiasActGrads, UnaryOp,
};
use crate::{DType, Device, IndexTensor, Tensor};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape};
use std::sync::Mutex;

type CResult<T> = candle_core::Result<T>;

/// A library error as candle's, naming the op.
fn err(op: &str, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("kernels::candle::{op}: {e}"))
}

/// The CPU path of every op: candle's own ops serve there.
fn no_cpu<T>(op: &str) -> CResult<T> {
    Err(err(op, "runs on CUDA devices only; on the CPU use candle's own op"))
}

fn kernel_dtype(op: &str, dt: candle_core::DType) -> CResult<DType> {
    match dt {
        candle_core::DType::F32 => Ok(DType::F32),
        candle_core::DType::F16 => Ok(DType::F16),
        candle_core::DType::BF16 => Ok(DType::BF16),
        d => Err(err(op, format!("dtype {d:?} is not supported (f32, f16, bf16)"))),
    }
}

/// The raw address of a storage's buffer, with cudarc's guard that orders candle's other
/// streams around the use (alive until the work on `stream` is issued).
fn read_ptr<'a>(op: &str, s: &'a CudaStorage, stream: &'a CudaStream) -> CResult<(u64, SyncOnDrop<'a>)> {
    Ok(match &s.slice {
        CudaStorageSlice::F32(v) => v.device_ptr(stream),
        CudaStorageSlice::F16(v) => v.device_ptr(stream),
        CudaStorageSlice::BF16(v) => v.device_ptr(stream),
        CudaStorageSlice::I64(v) => v.device_ptr(stream),
        _ => return Err(err(op, format!("dtype {:?} is not supported", s.dtype()))),
    })
}

fn write_ptr<'a>(op: &str, s: &'a mut CudaStorage, stream: &'a CudaStream) -> CResult<(u64, SyncOnDrop<'a>)> {
    let dt = s.dtype();
    Ok(match &mut s.slice {
        CudaStorageSlice::F32(v) => v.device_ptr_mut(stream),
        CudaStorageSlice::F16(v) => v.device_ptr_mut(stream),
        CudaStorageSlice::BF16(v) => v.device_ptr_mut(stream),
        _ => return Err(err(op, format!("dtype {dt:?} is not supported"))),
    })
}

/// A fresh, uninitialised candle buffer of `n` elements.
fn alloc(op: &str, dev: &CudaDevice, dt: candle_core::DType, n: usize) -> CResult<CudaStorage> {
    // At least one element: a zero-sized allocation is not a valid buffer for every driver call.
    let n = n.max(1);
    // SAFETY: every output is written whole by the op before candle reads it; the scratch copies
    // are written whole by `copy_strided_src`.
    let slice = unsafe {
        match dt {
            candle_core::DType::F32 => CudaStorageSlice::F32(dev.alloc::<f32>(n)?),
            candle_core::DType::F16 => CudaStorageSlice::F16(dev.alloc::<half::f16>(n)?),
            candle_core::DType::BF16 => CudaStorageSlice::BF16(dev.alloc::<half::bf16>(n)?),
            candle_core::DType::I64 => CudaStorageSlice::I64(dev.alloc::<i64>(n)?),
            d => return Err(err(op, format!("dtype {d:?} is not supported"))),
        }
    };
    Ok(CudaStorage { slice, device: dev.clone() })
}

/// One input of an op: candle's storage and layout, and the shape the kernel sees it as.
struct In<'a> {
    s: &'a CudaStorage,
    l: &'a Layout,
    shape: Vec<usize>,
}

fn input<'a>(s: &'a CudaStorage, l: &'a Layout, shape: &[usize]) -> In<'a> {
    In { s, l, shape: shape.to_vec() }
}

/// What an op's closure gets: the float inputs, the index inputs (i64), in order, and the
/// output regions.
struct Views {
    t: Vec<Tensor>,
    idx: Vec<IndexTensor>,
    out: Vec<Tensor>,
}

/// Where each output region of `sizes` starts in the one buffer of all of them, in elements of
/// `elem` bytes, each on a 16-byte boundary (the kernels load whole vectors), and the buffer's
/// length.
fn region_starts(sizes: &[usize], elem: usize) -> (Vec<usize>, usize) {
    let per = (crate::interop::ALIGNMENT as usize / elem).max(1);
    let mut starts = Vec::with_capacity(sizes.len());
    let (mut at, mut end) = (0, 0);
    for &n in sizes {
        starts.push(at);
        end = at + n;
        at += n.div_ceil(per) * per;
    }
    (starts, end)
}

/// Runs `f` on candle's stream over borrowed views of `ins` (each copied first where its layout
/// is not contiguous from an aligned start) and of one fresh candle buffer of dtype `out_dt`
/// holding the output regions `outs` (shapes, each region 16-byte aligned), which it returns.
fn run(
    op: &'static str,
    ins: &[In<'_>],
    out_dt: candle_core::DType,
    outs: &[&[usize]],
    f: impl FnOnce(&mut Views) -> crate::Result<()>,
) -> CResult<CudaStorage> {
    let Some(first) = ins.first() else { return Err(err(op, "no inputs")) };
    let cdev = first.s.device.clone();
    let stream = cdev.cuda_stream();
    let dev = Device::cuda(stream.context().ordinal()).map_err(|e| err(op, e))?;
    // Copies of the inputs the kernels cannot read in place.
    let mut copies = Vec::with_capacity(ins.len());
    for i in ins {
        // The views below span exactly the elements candle's layout holds.
        if i.l.shape().elem_count() != i.shape.iter().product::<usize>() {
            return Err(err(op, format!("an input of shape {:?} where {:?} is expected", i.l.shape(), i.shape)));
        }
        let elem = i.s.dtype().size_in_bytes();
        let aligned = (i.l.start_offset() * elem).is_multiple_of(crate::interop::ALIGNMENT as usize);
        if i.l.is_contiguous() && aligned {
            copies.push(None);
        } else {
            let mut c = alloc(op, &cdev, i.s.dtype(), i.l.shape().elem_count())?;
            i.s.copy_strided_src(&mut c, 0, i.l)?;
            copies.push(Some(c));
        }
    }
    let elem = out_dt.size_in_bytes();
    let sizes: Vec<usize> = outs.iter().map(|s| s.iter().product()).collect();
    let (starts, total) = region_starts(&sizes, elem);
    let mut out = alloc(op, &cdev, out_dt, total)?;
    let out_kdt = kernel_dtype(op, out_dt)?;
    let mut guards = Vec::with_capacity(ins.len() + 1);
    let mut views = Views { t: vec![], idx: vec![], out: vec![] };
    for (i, c) in ins.iter().zip(&copies) {
        let (s, offset) = match c {
            Some(c) => (c, 0),
            None => (i.s, i.l.start_offset()),
        };
        let (ptr, g) = read_ptr(op, s, &stream)?;
        guards.push(g);
        let ptr = ptr + (offset * s.dtype().size_in_bytes()) as u64;
        // SAFETY: `ptr` is the first element of `i`'s contiguous elements in a live candle buffer
        // of this device's primary context (candle's contexts are the primary ones), which
        // `i.s` (or the copy) keeps alive past the call; candle orders its use on its stream,
        // where the work below runs; nothing writes it during the op (candle's inputs are
        // immutable, and the output is a fresh buffer).
        unsafe {
            if s.dtype() == candle_core::DType::I64 {
                views.idx.push(IndexTensor::from_device_ptr(&dev, ptr, &i.shape).map_err(|e| err(op, e))?);
            } else {
                let dt = kernel_dtype(op, s.dtype())?;
                views.t.push(Tensor::from_device_ptr(&dev, ptr, &i.shape, dt).map_err(|e| err(op, e))?);
            }
        }
    }
    let (base, g) = write_ptr(op, &mut out, &stream)?;
    for (shape, start) in outs.iter().zip(&starts) {
        // SAFETY: region `start..start + numel(shape)` of the fresh output buffer (`total`
        // elements), 16-byte aligned (`region_starts`), written only by this op.
        let t = unsafe { Tensor::from_device_ptr(&dev, base + (start * elem) as u64, shape, out_kdt) };
        views.out.push(t.map_err(|e| err(op, e))?);
    }
    // SAFETY: candle's stream of this device (its primary context), alive while `cdev` is; every
    // tensor `f` sees is borrowed from candle and ordered on that stream (cudarc's guards make it
    // wait for other streams' writes). What the library allocates inside `f` is dropped inside
    // it, except the norms' and the cross-entropy's saved statistics, which are used only by
    // their backward, on candle's stream again.
    let r = unsafe { dev.with_stream(stream.cu_stream() as *mut std::ffi::c_void, || f(&mut views)) };
    r.and_then(|r| r).map_err(|e| err(op, e))?;
    drop(views);
    drop(g);
    drop(guards);
    Ok(out)
}

/// The shape as `[rows, cols]` over its last dimension, for the row ops.
fn rows_cols(op: &str, l: &Layout) -> CResult<[usize; 2]> {
    let dims = l.shape().dims();
    let Some(&cols) = dims.last() else { return Err(err(op, "needs at least one dimension")) };
    let rows = dims[..dims.len() - 1].iter().product();
    Ok([rows, cols])
}

fn same_shape(op: &str, a: &Layout, b: &Layout) -> CResult<()> {
    if a.shape() != b.shape() {
        return Err(err(op, format!("shapes {:?} and {:?} differ", a.shape(), b.shape())));
    }
    Ok(())
}

// --- element-wise -----------------------------------------------------------------------------

/// `op(x)` element-wise ([`ops::unary`]); its backward is [`ops::unary_backward`].
#[derive(Clone, Copy, Debug)]
pub struct Unary(pub UnaryOp);

impl CustomOp1 for Unary {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> CResult<(CudaStorage, Shape)> {
        let n = [l.shape().elem_count()];
        let op = self.0;
        let out =
            run(self.name(), &[input(s, l, &n)], s.dtype(), &[&n], |v| ops::unary_out(&v.t[0], op, &mut v.out[0]))?;
        Ok((out, l.shape().clone()))
    }
    fn bwd(
        &self,
        x: &candle_core::Tensor,
        _: &candle_core::Tensor,
        g: &candle_core::Tensor,
    ) -> CResult<Option<candle_core::Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(g, &UnaryBackward(self.0))?))
    }
}

/// `op'(x) * g` ([`ops::unary_backward`]): [`Unary`]'s backward.
#[derive(Clone, Copy, Debug)]
pub struct UnaryBackward(pub UnaryOp);

impl CustomOp2 for UnaryBackward {
    fn name(&self) -> &'static str {
        "unary_backward"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, x: &CudaStorage, lx: &Layout, g: &CudaStorage, lg: &Layout) -> CResult<(CudaStorage, Shape)> {
        same_shape(self.name(), lx, lg)?;
        let n = [lx.shape().elem_count()];
        let op = self.0;
        let ins = [input(x, lx, &n), input(g, lg, &n)];
        let out =
            run(self.name(), &ins, x.dtype(), &[&n], |v| ops::unary_backward_out(&v.t[0], &v.t[1], op, &mut v.out[0]))?;
        Ok((out, lx.shape().clone()))
    }
}

/// `act(x)` element-wise, with candle's autograd through the library's backward.
pub fn activation(x: &candle_core::Tensor, act: Activation) -> CResult<candle_core::Tensor> {
    x.apply_op1(Unary(act.into()))
}

/// Any unary op of the library's table ([`ops::UNARY_OPS`]), as [`activation`].
pub fn unary(x: &candle_core::Tensor, op: UnaryOp) -> CResult<candle_core::Tensor> {
    x.apply_op1(Unary(op))
}

/// `act(x * scale + bias)` with `scale` and `bias` over the last dimension, one pass
/// ([`ops::scale_bias_act`]); its backward is [`ops::scale_bias_act_backward`] (the three
/// gradients in one pass).
#[derive(Clone, Copy, Debug)]
pub struct ScaleBiasAct(pub Activation);

impl CustomOp3 for ScaleBiasAct {
    fn name(&self) -> &'static str {
        "scale_bias_act"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        s: &CudaStorage,
        ls: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let rc = rows_cols(self.name(), lx)?;
        let cols = [rc[1]];
        let act = self.0;
        let ins = [input(x, lx, &rc), input(s, ls, &cols), input(b, lb, &cols)];
        let out = run(self.name(), &ins, x.dtype(), &[&rc], |v| {
            ops::scale_bias_act_out(&v.t[0], &v.t[1], &v.t[2], act, &mut v.out[0])
        })?;
        Ok((out, lx.shape().clone()))
    }
    #[allow(clippy::type_complexity)]
    fn bwd(
        &self,
        x: &candle_core::Tensor,
        s: &candle_core::Tensor,
        b: &candle_core::Tensor,
        _: &candle_core::Tensor,
        g: &candle_core::Tensor,
    ) -> CResult<(Option<candle_core::Tensor>, Option<candle_core::Tensor>, Option<candle_core::Tensor>)> {
        let op = ScaleBiasActBackward { act: self.0, bias: b.clone() };
        let flat = x.apply_op3_no_bwd(s, g, &op)?;
        let sizes = [x.elem_count(), s.elem_count(), b.elem_count()];
        let (starts, _) = region_starts(&sizes, x.dtype().size_in_bytes());
        let part = |i: usize, dims: &[usize]| flat.narrow(0, starts[i], sizes[i])?.reshape(dims);
        Ok((Some(part(0, x.dims())?), Some(part(1, s.dims())?), Some(part(2, b.dims())?)))
    }
}

/// [`ScaleBiasAct`]'s backward on `(x, scale, grad)`, the bias (a fourth input) held by the op:
/// the gradients of x, scale and bias in one buffer.
struct ScaleBiasActBackward {
    act: Activation,
    bias: candle_core::Tensor,
}

impl CustomOp3 for ScaleBiasActBackward {
    fn name(&self) -> &'static str {
        "scale_bias_act_backward"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        s: &CudaStorage,
        ls: &Layout,
        g: &CudaStorage,
        lg: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let op = self.name();
        same_shape(op, lx, lg)?;
        let rc = rows_cols(op, lx)?;
        let cols = [rc[1]];
        let (bias, lb) = self.bias.storage_and_layout();
        let candle_core::Storage::Cuda(b) = &*bias else {
            return Err(err(op, "the bias is not on a CUDA device"));
        };
        let ins = [input(x, lx, &rc), input(s, ls, &cols), input(b, lb, &cols), input(g, lg, &rc)];
        let act = self.act;
        let out = run(op, &ins, x.dtype(), &[&rc, &cols, &cols], |v| {
            let mut o = std::mem::take(&mut v.out).into_iter();
            let (Some(gx), Some(gs), Some(gb)) = (o.next(), o.next(), o.next()) else {
                return Err(crate::Error::InvalidArgument { op, message: "three output regions expected".into() });
            };
            let mut grads = ScaleBiasActGrads { x: gx, scale: gs, bias: gb };
            ops::scale_bias_act_backward_out(&v.t[0], &v.t[1], &v.t[2], &v.t[3], act, &mut grads)
        })?;
        let n = out_len(&out);
        Ok((out, Shape::from(n)))
    }
}

/// `act(x * scale + bias)`, `scale` and `bias` of the last dimension's size, in one kernel each
/// way.
pub fn scale_bias_act(
    x: &candle_core::Tensor,
    scale: &candle_core::Tensor,
    bias: &candle_core::Tensor,
    act: Activation,
) -> CResult<candle_core::Tensor> {
    x.apply_op3(scale, bias, ScaleBiasAct(act))
}

// --- softmax ----------------------------------------------------------------------------------

/// Softmax (or log-softmax) over the last dimension ([`ops::softmax`]).
#[derive(Clone, Copy, Debug)]
pub struct Softmax {
    /// Log-softmax rather than softmax.
    pub log: bool,
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        if self.log { "log_softmax" } else { "softmax" }
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> CResult<(CudaStorage, Shape)> {
        let rc = rows_cols(self.name(), l)?;
        let log = self.log;
        let out = run(self.name(), &[input(s, l, &rc)], s.dtype(), &[&rc], |v| {
            if log { ops::log_softmax_out(&v.t[0], &mut v.out[0]) } else { ops::softmax_out(&v.t[0], &mut v.out[0]) }
        })?;
        Ok((out, l.shape().clone()))
    }
    fn bwd(
        &self,
        _: &candle_core::Tensor,
        y: &candle_core::Tensor,
        g: &candle_core::Tensor,
    ) -> CResult<Option<candle_core::Tensor>> {
        Ok(Some(y.apply_op2_no_bwd(g, &SoftmaxBackward { log: self.log })?))
    }
}

/// The gradient of [`Softmax`] from its output and the output's gradient.
#[derive(Clone, Copy, Debug)]
pub struct SoftmaxBackward {
    /// Of log-softmax rather than softmax.
    pub log: bool,
}

impl CustomOp2 for SoftmaxBackward {
    fn name(&self) -> &'static str {
        if self.log { "log_softmax_backward" } else { "softmax_backward" }
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, y: &CudaStorage, ly: &Layout, g: &CudaStorage, lg: &Layout) -> CResult<(CudaStorage, Shape)> {
        same_shape(self.name(), ly, lg)?;
        let rc = rows_cols(self.name(), ly)?;
        let log = self.log;
        let ins = [input(y, ly, &rc), input(g, lg, &rc)];
        let out = run(self.name(), &ins, y.dtype(), &[&rc], |v| {
            if log {
                ops::log_softmax_backward_out(&v.t[0], &v.t[1], &mut v.out[0])
            } else {
                ops::softmax_backward_out(&v.t[0], &v.t[1], &mut v.out[0])
            }
        })?;
        Ok((out, ly.shape().clone()))
    }
}

/// Softmax over the last dimension.
pub fn softmax(x: &candle_core::Tensor) -> CResult<candle_core::Tensor> {
    x.apply_op1(Softmax { log: false })
}

/// Log-softmax over the last dimension.
pub fn log_softmax(x: &candle_core::Tensor) -> CResult<candle_core::Tensor> {
    x.apply_op1(Softmax { log: true })
}

// --- norms ------------------------------------------------------------------------------------

/// Layer norm (with a bias) or RMS norm over the last dimension, with a weight
/// ([`ops::layer_norm`], [`ops::rms_norm`]). The forward keeps the per-row statistics for the
/// backward, as PyTorch's autograd does; apply a fresh op to each forward (the functions
/// [`layer_norm`] and [`rms_norm`] do).
#[derive(Debug)]
pub struct Norm {
    rms: bool,
    eps: f32,
    stats: Mutex<Option<NormStats>>,
}

impl Norm {
    fn new(rms: bool, eps: f32) -> Norm {
        Norm { rms, eps, stats: Mutex::new(None) }
    }

    fn name(&self) -> &'static str {
        if self.rms { "rms_norm" } else { "layer_norm" }
    }

    fn forward(&self, ins: &[In<'_>], x: &CudaStorage, lx: &Layout) -> CResult<(CudaStorage, Shape)> {
        let op = self.name();
        let [rows, _] = rows_cols(op, lx)?;
        let (rms, eps) = (self.rms, self.eps);
        let mut saved = None;
        let out = run(op, ins, x.dtype(), &[&ins[0].shape], |v| {
            let dev = v.t[0].device().clone();
            let mut stats = NormStats {
                mean: if rms { None } else { Some(Tensor::empty(&dev, &[rows], DType::F32)?) },
                rstd: Tensor::empty(&dev, &[rows], DType::F32)?,
            };
            if rms {
                ops::rms_norm_out(&v.t[0], Some(&v.t[1]), eps, &mut v.out[0], &mut stats)?;
            } else {
                ops::layer_norm_out(&v.t[0], Some(&v.t[1]), Some(&v.t[2]), eps, &mut v.out[0], &mut stats)?;
            }
            saved = Some(stats);
            Ok(())
        })?;
        *self.stats.lock().unwrap_or_else(|p| p.into_inner()) = saved;
        Ok((out, lx.shape().clone()))
    }

    /// `[gx, gw, gb]` (no `gb` for RMS norm) from the saved statistics.
    fn backward(
        &self,
        x: &candle_core::Tensor,
        w: &candle_core::Tensor,
        g: &candle_core::Tensor,
    ) -> CResult<Vec<candle_core::Tensor>> {
        let stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let Some(stats) = stats.as_ref() else {
            return Err(err(self.name(), "backward before forward: the statistics are missing"));
        };
        let op = NormBackward { rms: self.rms, stats };
        let flat = x.apply_op3_no_bwd(w, g, &op)?;
        let cols = w.elem_count();
        let shapes = [x.dims(), w.dims(), w.dims()];
        let k = if self.rms { 2 } else { 3 };
        let sizes = [x.elem_count(), cols, cols];
        let (starts, _) = region_starts(&sizes[..k], x.dtype().size_in_bytes());
        (0..k).map(|i| flat.narrow(0, starts[i], sizes[i])?.reshape(shapes[i])).collect()
    }
}

struct NormBackward<'a> {
    rms: bool,
    stats: &'a NormStats,
}

impl CustomOp3 for NormBackward<'_> {
    fn name(&self) -> &'static str {
        if self.rms { "rms_norm_backward" } else { "layer_norm_backward" }
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        g: &CudaStorage,
        lg: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let op = self.name();
        same_shape(op, lx, lg)?;
        let rc = rows_cols(op, lx)?;
        let cols = [rc[1]];
        let ins = [input(x, lx, &rc), input(w, lw, &cols), input(g, lg, &rc)];
        let rms = self.rms;
        let outs: &[&[usize]] = if rms { &[&rc, &cols] } else { &[&rc, &cols, &cols] };
        let stats = self.stats;
        let out = run(op, &ins, x.dtype(), outs, |v| {
            let mut o = std::mem::take(&mut v.out).into_iter();
            let (Some(gx), Some(gw)) = (o.next(), o.next()) else {
                return Err(crate::Error::InvalidArgument {
                    op,
                    message: "two or three output regions expected".into(),
                });
            };
            let mut grads = NormGrads { x: gx, weight: Some(gw), bias: o.next() };
            if rms {
                ops::rms_norm_backward_out(&v.t[0], Some(&v.t[1]), stats, &v.t[2], &mut grads)
            } else {
                ops::layer_norm_backward_out(&v.t[0], Some(&v.t[1]), stats, &v.t[2], &mut grads)
            }
        })?;
        let n = out_len(&out);
        Ok((out, Shape::from(n)))
    }
}

fn out_len(s: &CudaStorage) -> usize {
    match &s.slice {
        CudaStorageSlice::F32(v) => v.len(),
        CudaStorageSlice::F16(v) => v.len(),
        CudaStorageSlice::BF16(v) => v.len(),
        CudaStorageSlice::I64(v) => v.len(),
        _ => 0,
    }
}

/// [`Norm`] as layer norm: `(x, weight, bias)`.
#[derive(Debug)]
pub struct LayerNorm(Norm);

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let rc = rows_cols(self.name(), lx)?;
        let cols = [rc[1]];
        self.0.forward(&[input(x, lx, &rc), input(w, lw, &cols), input(b, lb, &cols)], x, lx)
    }
    #[allow(clippy::type_complexity)]
    fn bwd(
        &self,
        x: &candle_core::Tensor,
        w: &candle_core::Tensor,
        _: &candle_core::Tensor,
        _: &candle_core::Tensor,
        g: &candle_core::Tensor,
    ) -> CResult<(Option<candle_core::Tensor>, Option<candle_core::Tensor>, Option<candle_core::Tensor>)> {
        let mut v = self.0.backward(x, w, g)?.into_iter();
        Ok((v.next(), v.next(), v.next()))
    }
}

/// [`Norm`] as RMS norm: `(x, weight)`.
#[derive(Debug)]
pub struct RmsNorm(Norm);

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, x: &CudaStorage, lx: &Layout, w: &CudaStorage, lw: &Layout) -> CResult<(CudaStorage, Shape)> {
        let rc = rows_cols(self.name(), lx)?;
        let cols = [rc[1]];
        self.0.forward(&[input(x, lx, &rc), input(w, lw, &cols)], x, lx)
    }
    fn bwd(
        &self,
        x: &candle_core::Tensor,
        w: &candle_core::Tensor,
        _: &candle_core::Tensor,
        g: &candle_core::Tensor,
    ) -> CResult<(Option<candle_core::Tensor>, Option<candle_core::Tensor>)> {
        let mut v = self.0.backward(x, w, g)?.into_iter();
        Ok((v.next(), v.next()))
    }
}

/// Layer norm over the last dimension (biased variance, as PyTorch's), `weight` and `bias` of
/// the last dimension's size.
pub fn layer_norm(
    x: &candle_core::Tensor,
    weight: &candle_core::Tensor,
    bias: &candle_core::Tensor,
    eps: f32,
) -> CResult<candle_core::Tensor> {
    x.apply_op3(weight, bias, LayerNorm(Norm::new(false, eps)))
}

/// RMS norm over the last dimension: `x / sqrt(mean(x^2) + eps) * weight`.
pub fn rms_norm(x: &candle_core::Tensor, weight: &candle_core::Tensor, eps: f32) -> CResult<candle_core::Tensor> {
    x.apply_op2(weight, RmsNorm(Norm::new(true, eps)))
}

// --- cross-entropy ----------------------------------------------------------------------------

/// The mean cross-entropy of `logits` (`[N, C]`) against class indices (`[N]`, i64)
/// ([`ops::cross_entropy`] with its default options: mean, no ignored index, no smoothing).
/// Keeps the per-row log-sum-exp for the backward; apply a fresh op to each forward.
#[derive(Debug, Default)]
pub struct CrossEntropy {
    saved: Mutex<Option<CrossEntropySaved>>,
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, x: &CudaStorage, lx: &Layout, t: &CudaStorage, lt: &Layout) -> CResult<(CudaStorage, Shape)> {
        let op = self.name();
        let [rows, cols] = match lx.shape().dims() {
            &[r, c] => [r, c],
            d => return Err(err(op, format!("logits must be [N, C], got {d:?}"))),
        };
        if t.dtype() != candle_core::DType::I64 || lt.shape().dims() != [rows] {
            return Err(err(
                op,
                format!("targets must be i64 of shape [{rows}], got {:?} {:?}", t.dtype(), lt.shape()),
            ));
        }
        let ins = [input(x, lx, &[rows, cols]), input(t, lt, &[rows])];
        let mut saved = None;
        let out = run(op, &ins, x.dtype(), &[&[]], |v| {
            let dev = v.t[0].device().clone();
            let opts = CrossEntropyOpts::default();
            let mut s = CrossEntropySaved::from_parts(
                Tensor::empty(&dev, &[rows], DType::F32)?,
                Tensor::empty(&dev, &[1], DType::F32)?,
                opts,
            )?;
            ops::cross_entropy_out(&v.t[0], &v.idx[0], opts, &mut v.out[0], &mut s)?;
            saved = Some(s);
            Ok(())
        })?;
        *self.saved.lock().unwrap_or_else(|p| p.into_inner()) = saved;
        Ok((out, Shape::from(())))
    }
    fn bwd(
        &self,
        x: &candle_core::Tensor,
        t: &candle_core::Tensor,
        _: &candle_core::Tensor,
        g: &candle_core::Tensor,
    ) -> CResult<(Option<candle_core::Tensor>, Option<candle_core::Tensor>)> {
        let saved = self.saved.lock().unwrap_or_else(|p| p.into_inner());
        let Some(saved) = saved.as_ref() else {
            return Err(err(self.name(), "backward before forward: the saved statistics are missing"));
        };
        let gx = x.apply_op3_no_bwd(t, g, &CrossEntropyBackward { saved })?;
        Ok((Some(gx), None))
    }
}

struct CrossEntropyBackward<'a> {
    saved: &'a CrossEntropySaved,
}

impl CustomOp3 for CrossEntropyBackward<'_> {
    fn name(&self) -> &'static str {
        "cross_entropy_backward"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        t: &CudaStorage,
        lt: &Layout,
        g: &CudaStorage,
        lg: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let op = self.name();
        let rc = rows_cols(op, lx)?;
        let ins = [input(x, lx, &rc), input(t, lt, &rc[..1]), input(g, lg, &[])];
        let saved = self.saved;
        let out = run(op, &ins, x.dtype(), &[&rc], |v| {
            ops::cross_entropy_backward_out(&v.t[0], &v.idx[0], saved, &v.t[1], &mut v.out[0])
        })?;
        Ok((out, lx.shape().clone()))
    }
}

/// The mean cross-entropy of `logits` (`[N, C]`) against `targets` (`[N]`, i64 or u32 class
/// indices; u32 is widened first), a scalar of the logits' dtype.
pub fn cross_entropy(logits: &candle_core::Tensor, targets: &candle_core::Tensor) -> CResult<candle_core::Tensor> {
    let t = if targets.dtype() == candle_core::DType::I64 {
        targets.clone()
    } else {
        targets.to_dtype(candle_core::DType::I64)?
    };
    logits.apply_op2(&t, CrossEntropy::default())
}

// --- linear -----------------------------------------------------------------------------------

/// A held candle tensor's CUDA storage (the backward ops' fourth and fifth inputs).
fn held_storage<'a>(op: &str, g: &'a candle_core::StorageRef<'_>) -> CResult<&'a CudaStorage> {
    match &**g {
        candle_core::Storage::Cuda(s) => Ok(s),
        _ => Err(err(op, "an input saved for the backward is not on a CUDA device")),
    }
}

/// `(rows, inp, out)` of `x [..., inp] @ w^T`, `w` `[out, inp]`, and the bias `[out]` if any.
fn linear_dims(op: &str, lx: &Layout, lw: &Layout, lb: Option<&Layout>) -> CResult<[usize; 3]> {
    let [rows, inp] = rows_cols(op, lx)?;
    let out = match lw.shape().dims() {
        &[o, i] if i == inp => o,
        d => return Err(err(op, format!("the weight has shape {d:?}; expected [out, {inp}] (x's last dimension)"))),
    };
    if let Some(lb) = lb
        && lb.shape().dims() != [out]
    {
        return Err(err(op, format!("the bias has shape {:?}; expected [{out}]", lb.shape())));
    }
    Ok([rows, inp, out])
}

/// `x @ w^T (+ b)`: one GEMM ([`ops::gemm_ex`]) writing candle's output, the bias added in its
/// store.
fn linear_fwd(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    b: Option<(&CudaStorage, &Layout)>,
) -> CResult<(CudaStorage, Shape)> {
    let op = "linear";
    let [rows, inp, out] = linear_dims(op, lx, lw, b.map(|b| b.1))?;
    let mut ins = vec![input(x, lx, &[rows, inp]), input(w, lw, &[out, inp])];
    if let Some((b, lb)) = b {
        ins.push(input(b, lb, &[out]));
    }
    let y = run(op, &ins, x.dtype(), &[&[rows, out]], |v| {
        ops::gemm_ex(&v.t[0], &v.t[1], &mut v.out[0], Gemm::new(false, true), v.t.get(2), Activation::Identity)
    })?;
    let mut dims = lx.shape().dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = out;
    }
    Ok((y, Shape::from(dims)))
}

/// `[dx, dw, db]` (no `db` without a bias) of a linear layer from the output's gradient `g`.
fn linear_bwd(
    x: &candle_core::Tensor,
    w: &candle_core::Tensor,
    g: &candle_core::Tensor,
    bias: bool,
) -> CResult<Vec<candle_core::Tensor>> {
    let flat = x.apply_op3_no_bwd(w, g, &LinearBackward { bias })?;
    let out = w.dim(0)?;
    let k = 2 + usize::from(bias);
    let sizes = [x.elem_count(), w.elem_count(), out];
    let (starts, _) = region_starts(&sizes[..k], x.dtype().size_in_bytes());
    let ob = [out];
    let shapes = [x.dims(), w.dims(), &ob[..]];
    (0..k).map(|i| flat.narrow(0, starts[i], sizes[i])?.reshape(shapes[i])).collect()
}

/// The linear layer without a bias, `(x, weight)`: `x @ weight^T`.
#[derive(Clone, Copy, Debug)]
pub struct Linear;

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, x: &CudaStorage, lx: &Layout, w: &CudaStorage, lw: &Layout) -> CResult<(CudaStorage, Shape)> {
        linear_fwd(x, lx, w, lw, None)
    }
    fn bwd(
        &self,
        x: &candle_core::Tensor,
        w: &candle_core::Tensor,
        _: &candle_core::Tensor,
        g: &candle_core::Tensor,
    ) -> CResult<(Option<candle_core::Tensor>, Option<candle_core::Tensor>)> {
        let mut v = linear_bwd(x, w, g, false)?.into_iter();
        Ok((v.next(), v.next()))
    }
}

/// The linear layer with a bias, `(x, weight, bias)`: `x @ weight^T + bias`.
#[derive(Clone, Copy, Debug)]
pub struct LinearBias;

impl CustomOp3 for LinearBias {
    fn name(&self) -> &'static str {
        "linear"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        linear_fwd(x, lx, w, lw, Some((b, lb)))
    }
    #[allow(clippy::type_complexity)]
    fn bwd(
        &self,
        x: &candle_core::Tensor,
        w: &candle_core::Tensor,
        _: &candle_core::Tensor,
        _: &candle_core::Tensor,
        g: &candle_core::Tensor,
    ) -> CResult<(Option<candle_core::Tensor>, Option<candle_core::Tensor>, Option<candle_core::Tensor>)> {
        let mut v = linear_bwd(x, w, g, true)?.into_iter();
        Ok((v.next(), v.next(), v.next()))
    }
}

/// The linear layer's backward on `(x, weight, grad)`: `dx = g @ weight`, `dw = g^T @ x` (two
/// GEMMs, g read transposed in place) and `db` = the column sums of g, in one buffer.
struct LinearBackward {
    bias: bool,
}

impl CustomOp3 for LinearBackward {
    fn name(&self) -> &'static str {
        "linear_backward"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        g: &CudaStorage,
        lg: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let op = self.name();
        let [rows, inp, out] = linear_dims(op, lx, lw, None)?;
        if rows_cols(op, lg)? != [rows, out] {
            return Err(err(op, format!("the gradient has shape {:?}; expected [.., {out}]", lg.shape())));
        }
        let (xs, ws, gs) = ([rows, inp], [out, inp], [rows, out]);
        let ins = [input(x, lx, &xs), input(w, lw, &ws), input(g, lg, &gs)];
        let outs: &[&[usize]] = if self.bias { &[&xs, &ws, &[out]] } else { &[&xs, &ws] };
        let out = run(op, &ins, x.dtype(), outs, |v| {
            let mut o = std::mem::take(&mut v.out).into_iter();
            let (Some(mut gx), Some(mut gw)) = (o.next(), o.next()) else {
                return Err(crate::Error::InvalidArgument {
                    op,
                    message: "two or three output regions expected".into(),
                });
            };
            let id = Activation::Identity;
            ops::gemm_ex(&v.t[2], &v.t[1], &mut gx, Gemm::default(), None, id)?;
            ops::gemm_ex(&v.t[2], &v.t[0], &mut gw, Gemm::new(true, false), None, id)?;
            if let Some(mut gb) = o.next() {
                ops::reduce_leading_dims_out(&v.t[2], ReduceOp::Sum, &mut gb)?;
            }
            Ok(())
        })?;
        let n = out_len(&out);
        Ok((out, Shape::from(n)))
    }
}

/// The linear layer `x @ weight^T (+ bias)` (PyTorch's `F.linear`): x `[..., in]`, weight
/// `[out, in]`, bias `[out]`; f32 (FMAs), or bf16 or f16 (tensor cores, f32 accumulation). One
/// GEMM forward (the bias added in its store), two GEMMs and a column sum backward, each
/// writing candle's buffer.
pub fn linear(
    x: &candle_core::Tensor,
    weight: &candle_core::Tensor,
    bias: Option<&candle_core::Tensor>,
) -> CResult<candle_core::Tensor> {
    match bias {
        Some(b) => x.apply_op3(weight, b, LinearBias),
        None => x.apply_op2(weight, Linear),
    }
}

// --- attention --------------------------------------------------------------------------------

/// Scaled dot-product attention ([`ops::attention_out`]) on `(q, k, v)`, bf16 or f16, rank 4
/// in the options' layout. The forward keeps the f32 log-sum-exp of each query row for the
/// backward ([`ops::attention_backward_out`]); apply a fresh op to each forward (the functions
/// [`attention`] and [`scaled_dot_product_attention`] do).
#[derive(Debug)]
pub struct Attention {
    opts: AttentionOpts,
    lse: Mutex<Option<Tensor>>,
}

impl Attention {
    /// The op for these options.
    pub fn new(opts: AttentionOpts) -> Attention {
        Attention { opts, lse: Mutex::new(None) }
    }
}

fn rank4(op: &str, what: &str, l: &Layout) -> CResult<[usize; 4]> {
    <[usize; 4]>::try_from(l.shape().dims())
        .map_err(|_| err(op, format!("{what} has shape {:?}; expected rank 4", l.shape())))
}

/// `[q, k, v]`'s shapes, checked for rank and dtype (f32 refused: the kernels are bf16 and f16).
fn attention_shapes(op: &str, q: &CudaStorage, ls: [&Layout; 3]) -> CResult<[[usize; 4]; 3]> {
    if q.dtype() == candle_core::DType::F32 {
        return Err(err(op, "takes bf16 or f16 tensors, got F32 (convert with to_dtype first)"));
    }
    Ok([rank4(op, "q", ls[0])?, rank4(op, "k", ls[1])?, rank4(op, "v", ls[2])?])
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        lq: &Layout,
        k: &CudaStorage,
        lk: &Layout,
        v: &CudaStorage,
        lv: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let op = self.name();
        let [qs, ks, vs] = attention_shapes(op, q, [lq, lk, lv])?;
        let ls = match self.opts.layout {
            ops::Layout::Bhsd => [qs[0], qs[1], qs[2]],
            ops::Layout::Bshd => [qs[0], qs[2], qs[1]],
        };
        let opts = self.opts;
        let mut saved = None;
        let ins = [input(q, lq, &qs), input(k, lk, &ks), input(v, lv, &vs)];
        let out = run(op, &ins, q.dtype(), &[&qs], |t| {
            let mut lse = Tensor::empty(t.t[0].device(), &ls, DType::F32)?;
            ops::attention_out(&t.t[0], &t.t[1], &t.t[2], &opts, &mut t.out[0], &mut lse)?;
            saved = Some(lse);
            Ok(())
        })?;
        *self.lse.lock().unwrap_or_else(|p| p.into_inner()) = saved;
        Ok((out, lq.shape().clone()))
    }
    #[allow(clippy::type_complexity)]
    fn bwd(
        &self,
        q: &candle_core::Tensor,
        k: &candle_core::Tensor,
        v: &candle_core::Tensor,
        out: &candle_core::Tensor,
        g: &candle_core::Tensor,
    ) -> CResult<(Option<candle_core::Tensor>, Option<candle_core::Tensor>, Option<candle_core::Tensor>)> {
        let lse = self.lse.lock().unwrap_or_else(|p| p.into_inner());
        let Some(lse) = lse.as_ref() else {
            return Err(err(self.name(), "backward before forward: the log-sum-exp is missing"));
        };
        let op = AttentionBackward { opts: self.opts, lse, v: v.clone(), out: out.clone() };
        let flat = q.apply_op3_no_bwd(k, g, &op)?;
        let sizes = [q.elem_count(), k.elem_count(), v.elem_count()];
        let (starts, _) = region_starts(&sizes, q.dtype().size_in_bytes());
        let part = |i: usize, dims: &[usize]| flat.narrow(0, starts[i], sizes[i])?.reshape(dims);
        Ok((Some(part(0, q.dims())?), Some(part(1, k.dims())?), Some(part(2, v.dims())?)))
    }
}

/// [`Attention`]'s backward on `(q, k, dout)`, v and the output (a fourth and fifth input) held
/// by the op: dq, dk and dv in one buffer.
struct AttentionBackward<'a> {
    opts: AttentionOpts,
    lse: &'a Tensor,
    v: candle_core::Tensor,
    out: candle_core::Tensor,
}

impl CustomOp3 for AttentionBackward<'_> {
    fn name(&self) -> &'static str {
        "attention_backward"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        lq: &Layout,
        k: &CudaStorage,
        lk: &Layout,
        g: &CudaStorage,
        lg: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let op = self.name();
        let (vg, lv) = self.v.storage_and_layout();
        let (og, lo) = self.out.storage_and_layout();
        let (v, o) = (held_storage(op, &vg)?, held_storage(op, &og)?);
        let [qs, ks, vs] = attention_shapes(op, q, [lq, lk, lv])?;
        same_shape(op, lq, lo)?;
        same_shape(op, lq, lg)?;
        let ins = [input(q, lq, &qs), input(k, lk, &ks), input(v, lv, &vs), input(o, lo, &qs), input(g, lg, &qs)];
        let (opts, lse) = (self.opts, self.lse);
        let out = run(op, &ins, q.dtype(), &[&qs, &ks, &vs], |t| {
            let mut o = std::mem::take(&mut t.out).into_iter();
            let (Some(mut dq), Some(mut dk), Some(mut dv)) = (o.next(), o.next(), o.next()) else {
                return Err(crate::Error::InvalidArgument { op, message: "three output regions expected".into() });
            };
            let [q, k, v, out, dout] = &t.t[..] else {
                return Err(crate::Error::InvalidArgument { op, message: "five inputs expected".into() });
            };
            ops::attention_backward_out(q, k, v, out, lse, dout, &opts, (&mut dq, &mut dk, &mut dv))
        })?;
        let n = out_len(&out);
        Ok((out, Shape::from(n)))
    }
}

/// Attention with every option of [`AttentionOpts`] (causal masks, a sliding window, the scale,
/// the layout `[B, H, S, D]` or `[B, S, H, D]`; grouped-query heads when k and v have fewer
/// heads than q), bf16 or f16; f32 is refused.
pub fn attention(
    q: &candle_core::Tensor,
    k: &candle_core::Tensor,
    v: &candle_core::Tensor,
    opts: &AttentionOpts,
) -> CResult<candle_core::Tensor> {
    q.apply_op3(k, v, Attention::new(*opts))
}

/// `softmax(q k^T * scale) v` on `[B, H, S, D]` tensors, as PyTorch's
/// `scaled_dot_product_attention`: `causal` masks keys after the query (top left), `scale`
/// `None` is `1/sqrt(D)`. bf16 or f16; f32 is refused.
pub fn scaled_dot_product_attention(
    q: &candle_core::Tensor,
    k: &candle_core::Tensor,
    v: &candle_core::Tensor,
    causal: bool,
    scale: Option<f32>,
) -> CResult<candle_core::Tensor> {
    let causal = if causal { Causal::TopLeft } else { Causal::None };
    attention(q, k, v, &AttentionOpts { causal, scale, ..AttentionOpts::default() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_regions_start_on_16_bytes() {
        assert_eq!(region_starts(&[3, 5, 5], 4), (vec![0, 4, 12], 17));
        assert_eq!(region_starts(&[8, 1], 2), (vec![0, 8], 9));
        assert_eq!(region_starts(&[7], 2), (vec![0], 7));
        assert_eq!(region_starts(&[], 4), (vec![], 0));
    }
}
