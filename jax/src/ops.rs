//! The handlers: one `extern "C"` function per XLA custom-call target, from the table at the
//! bottom ([`TARGETS`]). Each decodes its call frame ([`Frame`]), checks the operands' dtypes and
//! shapes, and runs the library's op on XLA's buffers, on XLA's stream (`Device::with_stream`),
//! with the buffers borrowed (`Tensor::from_device_ptr`): no copy, no synchronisation.
//!
//! The Python layer (`kernels_jax/_ops.py`) declares the results' shapes and dtypes and passes
//! the attributes; this layer trusts none of it and turns every mismatch into an XLA error that
//! names the op (raised in Python as `XlaRuntimeError`), never a panic across the C boundary.

use crate::ffi::{self, CallFrame, Frame, Res, XlaError, invalid};
use kernels::ops::{
    self, Activation, AttentionOpts, Causal, CrossEntropyOpts, CrossEntropySaved, Gemm, Layout, NormGrads, NormStats,
    ReduceOp, Reduction, UnaryOp,
};
use kernels::{DType, Device, IndexTensor, Tensor};
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
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

/// The ordinal of the GPU that owns `stream`: its context's device, asked of the driver (XLA
/// runs one executable on any of its GPUs, so the ordinal is not known when tracing).
fn stream_device(stream: *mut c_void) -> Res<usize> {
    use cudarc::driver::sys;
    let fail = |what: &str, r: sys::CUresult| invalid(format!("{what} failed: {r:?}"));
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: XLA's live stream; the driver writes the context handle.
    let r = unsafe { sys::cuStreamGetCtx(stream as sys::CUstream, &mut ctx) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(fail("cuStreamGetCtx", r));
    }
    // SAFETY: XLA's context, alive while its stream is; pushed and popped around one query.
    unsafe {
        let r = sys::cuCtxPushCurrent_v2(ctx);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(fail("cuCtxPushCurrent", r));
        }
        let mut dev: sys::CUdevice = 0;
        let r = sys::cuCtxGetDevice(&mut dev);
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        let p = sys::cuCtxPopCurrent_v2(&mut popped);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(fail("cuCtxGetDevice", r));
        }
        if p != sys::CUresult::CUDA_SUCCESS {
            return Err(fail("cuCtxPopCurrent", p));
        }
        usize::try_from(dev).map_err(|_| invalid(format!("device ordinal {dev}")))
    }
}

fn dtype(code: std::ffi::c_int) -> Option<DType> {
    match code {
        ffi::DT_F32 => Some(DType::F32),
        ffi::DT_F16 => Some(DType::F16),
        ffi::DT_BF16 => Some(DType::BF16),
        _ => None,
    }
}

fn dtype_name(code: std::ffi::c_int) -> String {
    match code {
        ffi::DT_F32 => "float32".into(),
        ffi::DT_F16 => "float16".into(),
        ffi::DT_BF16 => "bfloat16".into(),
        ffi::DT_F64 => "float64".into(),
        ffi::DT_S32 => "int32".into(),
        ffi::DT_S64 => "int64".into(),
        c => format!("XLA dtype {c}"),
    }
}

/// One call's device and frame, with the checks every op makes.
struct Call<'a> {
    op: &'static str,
    f: &'a Frame,
    /// The stream and its device, found at the first tensor (after the checks that need none).
    dev: OnceLock<(usize, Device)>,
}

impl Call<'_> {
    fn dev(&self) -> Res<&(usize, Device)> {
        if let Some(d) = self.dev.get() {
            return Ok(d);
        }
        let stream = self.f.stream()?;
        let d = device(stream_device(stream)?)?;
        Ok(self.dev.get_or_init(|| (stream as usize, d)))
    }

    /// Runs `f` (the op) on XLA's stream.
    fn run(&self, f: impl FnOnce() -> kernels::Result<()>) -> Res<()> {
        // SAFETY: XLA's stream of this device, live for the call; every tensor the op touches
        // is XLA's buffer ordered on it, and whatever the library allocates inside (stream-
        // ordered temporaries) is freed inside.
        let (stream, dev) = self.dev()?;
        Ok(unsafe { dev.with_stream(*stream as *mut c_void, f) }??)
    }

    /// Operand `i`'s (or result `i - args`'s) buffer: what `t` and friends read.
    fn buf(&self, i: usize) -> &ffi::Buf {
        let n = self.f.args.len();
        if i < n { &self.f.args[i] } else { &self.f.rets[i - n] }
    }

    fn name(&self, i: usize) -> String {
        let n = self.f.args.len();
        if i < n { format!("operand {i}") } else { format!("result {}", i - n) }
    }

    /// The dtype of buffer `i`, one of the float types the kernels take.
    fn float_dtype(&self, i: usize) -> Res<DType> {
        let b = self.buf(i);
        dtype(b.dtype).ok_or_else(|| {
            invalid(format!(
                "{}: {} has dtype {}; expected float32, float16 or bfloat16",
                self.op,
                self.name(i),
                dtype_name(b.dtype)
            ))
        })
    }

    /// Checks that buffer `i` holds `shape`'s elements of `dt`.
    fn check(&self, i: usize, dt: DType, shape: &[usize]) -> Res<()> {
        let b = self.buf(i);
        if dtype(b.dtype) != Some(dt) {
            return Err(invalid(format!(
                "{}: {} has dtype {}; expected {dt:?}",
                self.op,
                self.name(i),
                dtype_name(b.dtype)
            )));
        }
        let want: usize = shape.iter().product();
        if b.numel() != want {
            return Err(invalid(format!(
                "{}: {} has shape {:?}; expected {want} elements ({shape:?})",
                self.op,
                self.name(i),
                b.dims
            )));
        }
        Ok(())
    }

    /// The buffers `(i, dtype, shape)` as tensors, in order, after checking all of them (so a
    /// bad call is refused before the device is looked up).
    fn tensors(&self, specs: &[(usize, DType, &[usize])]) -> Res<Vec<Tensor>> {
        for &(i, dt, shape) in specs {
            self.check(i, dt, shape)?;
        }
        let (_, dev) = self.dev()?;
        specs
            .iter()
            .map(|&(i, dt, shape)| {
                // SAFETY: XLA's buffer of this dtype and element count (checked above) on this
                // device, live for the call and ordered on the call's stream, where every op of
                // this call runs; results are written only by this call (XLA's contract for
                // custom-call results).
                unsafe { Tensor::from_device_ptr(dev, self.buf(i).data, shape, dt) }
                    .map_err(|e| invalid(format!("{}: {}: {e}", self.op, self.name(i))))
            })
            .collect()
    }

    /// As `tensors`, for a fixed number of them.
    fn fixed<const N: usize>(&self, specs: [(usize, DType, &[usize]); N]) -> Res<[Tensor; N]> {
        self.tensors(&specs)?.try_into().map_err(|_| invalid(format!("{}: internal: tensor count", self.op)))
    }

    /// Buffer `i` with the dims of buffer `like` (same shape, as XLA gives it).
    fn same_dims(&self, i: usize, like: usize) -> Res<()> {
        if self.buf(i).dims != self.buf(like).dims {
            return Err(invalid(format!(
                "{}: {} has shape {:?}; expected {:?} (that of {})",
                self.op,
                self.name(i),
                self.buf(i).dims,
                self.buf(like).dims,
                self.name(like)
            )));
        }
        Ok(())
    }

    fn int(&self, name: &str) -> Res<i64> {
        self.f.int(name).map_err(|e| invalid(format!("{}: {}", self.op, e.message)))
    }

    fn float(&self, name: &str) -> Res<f32> {
        self.f.float(name).map_err(|e| invalid(format!("{}: {}", self.op, e.message)))
    }

    fn flag(&self, name: &str) -> Res<bool> {
        Ok(self.int(name)? != 0)
    }
}

/// The table's row `op` (an index in `ops::UNARY_OPS`) with parameters `a`, `b`.
fn unary_op(c: &Call) -> Res<UnaryOp> {
    let code = c.int("op")?;
    unary_code(c, code, [c.float("a")?, c.float("b")?])
}

/// The table's row named by attribute `name`, without parameters (the GEMM's activations).
fn unary_op_named(c: &Call, name: &str) -> Res<UnaryOp> {
    unary_code(c, c.int(name)?, [0.0, 0.0])
}

fn unary_code(c: &Call, code: i64, [a, b]: [f32; 2]) -> Res<UnaryOp> {
    usize::try_from(code)
        .ok()
        .and_then(|i| ops::UNARY_OPS.get(i))
        .and_then(|info| UnaryOp::from_name(info.name, [a, b]))
        .ok_or_else(|| invalid(format!("{}: unknown unary op code {code}", c.op)))
}

/// `op(x)`: operand x, result y of x's shape and dtype.
fn unary_fwd(c: &Call) -> Res<()> {
    c.f.arity(c.op, 1, 1)?;
    let op = unary_op(c)?;
    let dt = c.float_dtype(0)?;
    c.same_dims(1, 0)?;
    let n = c.buf(0).numel();
    let [x, mut y] = c.fixed([(0, dt, &[n]), (1, dt, &[n])])?;
    c.run(|| ops::unary_out(&x, op, &mut y))
}

/// `op'(x) * g`: operands x, g, result gx, all of x's shape and dtype.
fn unary_bwd(c: &Call) -> Res<()> {
    c.f.arity(c.op, 2, 1)?;
    let op = unary_op(c)?;
    let dt = c.float_dtype(0)?;
    c.same_dims(1, 0)?;
    c.same_dims(2, 0)?;
    let n = c.buf(0).numel();
    let [x, g, mut gx] = c.fixed([(0, dt, &[n]), (1, dt, &[n]), (2, dt, &[n])])?;
    c.run(|| ops::unary_backward_out(&x, &g, op, &mut gx))
}

/// Softmax (log-softmax if attribute `log`) over the last dimension: operand x, result y.
fn softmax_fwd(c: &Call) -> Res<()> {
    c.f.arity(c.op, 1, 1)?;
    let log = c.flag("log")?;
    let dt = c.float_dtype(0)?;
    c.same_dims(1, 0)?;
    let (rows, cols) = c.buf(0).rows_cols(c.op)?;
    let s = [rows, cols];
    let [x, mut y] = c.fixed([(0, dt, &s), (1, dt, &s)])?;
    c.run(|| if log { ops::log_softmax_out(&x, &mut y) } else { ops::softmax_out(&x, &mut y) })
}

/// Its backward from the output: operands y, g, result gx.
fn softmax_bwd(c: &Call) -> Res<()> {
    c.f.arity(c.op, 2, 1)?;
    let log = c.flag("log")?;
    let dt = c.float_dtype(0)?;
    c.same_dims(1, 0)?;
    c.same_dims(2, 0)?;
    let (rows, cols) = c.buf(0).rows_cols(c.op)?;
    let s = [rows, cols];
    let [y, g, mut gx] = c.fixed([(0, dt, &s), (1, dt, &s), (2, dt, &s)])?;
    c.run(
        || {
            if log {
                ops::log_softmax_backward_out(&y, &g, &mut gx)
            } else {
                ops::softmax_backward_out(&y, &g, &mut gx)
            }
        },
    )
}

/// Layer norm (attribute `layer` 1) or RMS norm (0) over the last dimension, with attribute
/// `eps`. Operands: x, then the weight if attribute `weight`, then the bias if `bias` (layer
/// norm only), each `[cols]`. Results: y (x's shape), then the f32 statistics of each row: the
/// mean (layer norm only) and rstd.
fn norm_fwd(c: &Call) -> Res<()> {
    let (layer, has_w, has_b) = (c.flag("layer")?, c.flag("weight")?, c.flag("bias")?);
    if has_b && !layer {
        return Err(invalid(format!("{}: RMS norm has no bias", c.op)));
    }
    let n_in = 1 + usize::from(has_w) + usize::from(has_b);
    let n_out = 2 + usize::from(layer);
    c.f.arity(c.op, n_in, n_out)?;
    let dt = c.float_dtype(0)?;
    let (rows, cols) = c.buf(0).rows_cols(c.op)?;
    let s = [rows, cols];
    c.same_dims(n_in, 0)?;
    let (f32, row, vec) = (DType::F32, [rows], [cols]);
    let mut specs: Vec<(usize, DType, &[usize])> = vec![(0, dt, &s[..])];
    if has_w {
        specs.push((1, dt, &vec[..]));
    }
    if has_b {
        specs.push((2, dt, &vec[..]));
    }
    specs.push((n_in, dt, &s[..]));
    if layer {
        specs.push((n_in + 1, f32, &row[..]));
    }
    specs.push((n_in + n_out - 1, f32, &row[..]));
    let mut t = c.tensors(&specs)?.into_iter();
    let mut take = || t.next().ok_or_else(|| invalid(format!("{}: internal: tensor count", c.op)));
    let x = take()?;
    let w = if has_w { Some(take()?) } else { None };
    let b = if has_b { Some(take()?) } else { None };
    let mut y = take()?;
    let mean = if layer { Some(take()?) } else { None };
    let rstd = take()?;
    let mut stats = NormStats { mean, rstd };
    let eps = c.float("eps")?;
    c.run(|| {
        if layer {
            ops::layer_norm_out(&x, w.as_ref(), b.as_ref(), eps, &mut y, &mut stats)
        } else {
            ops::rms_norm_out(&x, w.as_ref(), eps, &mut y, &mut stats)
        }
    })
}

/// Backward of `norm_fwd`. Operands: x, the weight if `weight`, the mean (layer norm only), rstd,
/// g (y's gradient). Results: gx, then the weight's gradient if `weight`, then the bias's if
/// `bias`.
fn norm_bwd(c: &Call) -> Res<()> {
    let (layer, has_w, has_b) = (c.flag("layer")?, c.flag("weight")?, c.flag("bias")?);
    if has_b && !layer {
        return Err(invalid(format!("{}: RMS norm has no bias", c.op)));
    }
    let n_in = 3 + usize::from(has_w) + usize::from(layer);
    let n_out = 1 + usize::from(has_w) + usize::from(has_b);
    c.f.arity(c.op, n_in, n_out)?;
    let dt = c.float_dtype(0)?;
    let (rows, cols) = c.buf(0).rows_cols(c.op)?;
    let s = [rows, cols];
    let (f32, row, vec) = (DType::F32, [rows], [cols]);
    // Operands x, [w], [mean], rstd, g; results gx, [gw], [gb]: in call order.
    let mut specs: Vec<(usize, DType, &[usize])> = vec![(0, dt, &s[..])];
    if has_w {
        specs.push((specs.len(), dt, &vec[..]));
    }
    if layer {
        specs.push((specs.len(), f32, &row[..]));
    }
    specs.push((specs.len(), f32, &row[..]));
    let gi = specs.len();
    specs.push((gi, dt, &s[..]));
    specs.push((gi + 1, dt, &s[..]));
    if has_w {
        specs.push((specs.len(), dt, &vec[..]));
    }
    if has_b {
        specs.push((specs.len(), dt, &vec[..]));
    }
    c.same_dims(gi, 0)?;
    c.same_dims(gi + 1, 0)?;
    let mut t = c.tensors(&specs)?.into_iter();
    let mut take = || t.next().ok_or_else(|| invalid(format!("{}: internal: tensor count", c.op)));
    let x = take()?;
    let w = if has_w { Some(take()?) } else { None };
    let mean = if layer { Some(take()?) } else { None };
    let rstd = take()?;
    let g = take()?;
    let gx = take()?;
    let gw = if has_w { Some(take()?) } else { None };
    let gb = if has_b { Some(take()?) } else { None };
    let stats = NormStats { mean, rstd };
    let mut grads = NormGrads { x: gx, weight: gw, bias: gb };
    c.run(|| {
        if layer {
            ops::layer_norm_backward_out(&x, w.as_ref(), &stats, &g, &mut grads)
        } else {
            ops::rms_norm_backward_out(&x, w.as_ref(), &stats, &g, &mut grads)
        }
    })
}

/// The cross-entropy's options from the attributes `reduction` (0 none, 1 mean, 2 sum),
/// `ignore_index` and `label_smoothing`.
fn ce_opts(c: &Call) -> Res<CrossEntropyOpts> {
    let reduction = match c.int("reduction")? {
        0 => Reduction::None,
        1 => Reduction::Mean,
        2 => Reduction::Sum,
        r => return Err(invalid(format!("{}: reduction code {r}: expected 0 (none), 1 (mean) or 2 (sum)", c.op))),
    };
    Ok(CrossEntropyOpts {
        reduction,
        ignore_index: c.int("ignore_index")?,
        label_smoothing: c.float("label_smoothing")?,
    })
}

/// Checks that buffer `i` holds `rows` int64 class indices: int64 `[rows]`, or int32 `[rows, 2]`
/// holding each index's low and high words (JAX has no int64 without `jax_enable_x64`).
fn ce_target_check(c: &Call, i: usize, rows: usize) -> Res<()> {
    let b = c.buf(i);
    let ok = match b.dtype {
        ffi::DT_S64 => b.numel() == rows,
        ffi::DT_S32 => b.dims.last() == Some(&2) && b.numel() == 2 * rows,
        _ => false,
    };
    if !ok {
        return Err(invalid(format!(
            "{}: {} (the targets) has dtype {} and shape {:?}; expected int64 [{rows}] or int32 [{rows}, 2]",
            c.op,
            c.name(i),
            dtype_name(b.dtype),
            b.dims
        )));
    }
    Ok(())
}

/// Buffer `i` as the class indices, after [`ce_target_check`].
fn ce_target(c: &Call, i: usize, rows: usize) -> Res<IndexTensor> {
    let b = c.buf(i);
    let (_, dev) = c.dev()?;
    // SAFETY: XLA's buffer of `rows` 8-byte indices (checked above) on this device, read only,
    // live for the call and ordered on its stream.
    unsafe { IndexTensor::from_device_ptr(dev, b.data, &[rows]) }
        .map_err(|e| invalid(format!("{}: {}: {e}", c.op, c.name(i))))
}

/// Cross-entropy of logits `[..., C]` against class indices (see [`ce_target`]): results the
/// loss (`[...]` for reduction none, else a scalar), and for the backward the f32 log-sum-exp of
/// each row and the number of rows not ignored (`[1]`). Waits for the stream to check the
/// targets: an index outside `[0, C)` (other than `ignore_index`) is an error naming its row.
fn cross_entropy_fwd(c: &Call) -> Res<()> {
    c.f.arity(c.op, 2, 3)?;
    let opts = ce_opts(c)?;
    let dt = c.float_dtype(0)?;
    let (rows, cols) = c.buf(0).rows_cols(c.op)?;
    let (s, r, one) = ([rows, cols], [rows], [1]);
    let ls: &[usize] = if opts.reduction == Reduction::None { &r } else { &[] };
    ce_target_check(c, 1, rows)?;
    let [logits, mut loss, lse, count] =
        c.fixed([(0, dt, &s), (2, dt, ls), (3, DType::F32, &r), (4, DType::F32, &one)])?;
    let target = ce_target(c, 1, rows)?;
    let mut saved = CrossEntropySaved::from_parts(lse, count, opts)?;
    c.run(|| ops::cross_entropy_out(&logits, &target, opts, &mut loss, &mut saved))
}

/// Its backward: operands logits, target, lse, count, g (the loss's gradient); result the
/// logits' gradient.
fn cross_entropy_bwd(c: &Call) -> Res<()> {
    c.f.arity(c.op, 5, 1)?;
    let opts = ce_opts(c)?;
    let dt = c.float_dtype(0)?;
    let (rows, cols) = c.buf(0).rows_cols(c.op)?;
    c.same_dims(5, 0)?;
    let (s, r, one) = ([rows, cols], [rows], [1]);
    let gs: &[usize] = if opts.reduction == Reduction::None { &r } else { &[] };
    ce_target_check(c, 1, rows)?;
    let [logits, lse, count, g, mut gx] =
        c.fixed([(0, dt, &s), (2, DType::F32, &r), (3, DType::F32, &one), (4, dt, gs), (5, dt, &s)])?;
    let target = ce_target(c, 1, rows)?;
    let saved = CrossEntropySaved::from_parts(lse, count, opts)?;
    c.run(|| ops::cross_entropy_backward_out(&logits, &target, &saved, &g, &mut gx))
}

/// The linear layer's sizes `(rows, inp, out)`: x `[..., inp]`, the weight `[out, inp]`.
fn linear_dims(c: &Call) -> Res<(usize, usize, usize)> {
    let (rows, inp) = c.buf(0).rows_cols(c.op)?;
    match c.buf(1).dims[..] {
        [out, i] if i == inp => Ok((rows, inp, out)),
        _ => Err(invalid(format!(
            "{}: operand 1 (the weight) has shape {:?}; expected [out, {inp}] (x's last dimension)",
            c.op,
            c.buf(1).dims
        ))),
    }
}

/// `act(x @ weight^T + bias)`, one GEMM with the bias and the activation (attribute `act`, a
/// code of the unary table: identity, relu, gelu, gelu_tanh or silu) fused into its store.
/// Operands x `[..., inp]`, weight `[out, inp]`, then the bias `[out]` if attribute `bias`;
/// result y `[..., out]`. f32 (FMAs), or bf16 or f16 (tensor cores, f32 accumulation).
fn linear_fwd(c: &Call) -> Res<()> {
    let has_b = c.flag("bias")?;
    let n_in = 2 + usize::from(has_b);
    c.f.arity(c.op, n_in, 1)?;
    let act = match unary_op_named(c, "act")? {
        UnaryOp::Act(a) if Gemm::can_fuse(a) => a,
        op => return Err(invalid(format!("{}: activation {} is not fused into the GEMM", c.op, op.name()))),
    };
    let dt = c.float_dtype(0)?;
    let (rows, inp, out) = linear_dims(c)?;
    let (xs, ws, ys, bs) = ([rows, inp], [out, inp], [rows, out], [out]);
    let mut specs: Vec<(usize, DType, &[usize])> = vec![(0, dt, &xs[..]), (1, dt, &ws[..])];
    if has_b {
        specs.push((2, dt, &bs[..]));
    }
    specs.push((n_in, dt, &ys[..]));
    if c.buf(n_in).dims.last() != Some(&out) {
        return Err(invalid(format!("{}: result 0 has shape {:?}; expected [..., {out}]", c.op, c.buf(n_in).dims)));
    }
    let mut t = c.tensors(&specs)?.into_iter();
    let mut take = || t.next().ok_or_else(|| invalid(format!("{}: internal: tensor count", c.op)));
    let (x, w) = (take()?, take()?);
    let b = if has_b { Some(take()?) } else { None };
    let mut y = take()?;
    c.run(|| ops::gemm_ex(&x, &w, &mut y, Gemm::new(false, true), b.as_ref(), act))
}

/// Gradients of `x @ weight^T + bias` from `dz` (the output's gradient, `[..., out]`):
/// operands x, weight, dz; results `gx = dz @ weight` (x's shape), `gw = dz^T @ x` (`[out,
/// inp]`), then `gb` (the column sums of dz, `[out]`) if attribute `bias`.
fn linear_bwd(c: &Call) -> Res<()> {
    let has_b = c.flag("bias")?;
    c.f.arity(c.op, 3, 2 + usize::from(has_b))?;
    let dt = c.float_dtype(0)?;
    let (rows, inp, out) = linear_dims(c)?;
    c.same_dims(3, 0)?;
    c.same_dims(4, 1)?;
    let (xs, ws, ys, bs) = ([rows, inp], [out, inp], [rows, out], [out]);
    let mut specs: Vec<(usize, DType, &[usize])> =
        vec![(0, dt, &xs[..]), (1, dt, &ws[..]), (2, dt, &ys[..]), (3, dt, &xs[..]), (4, dt, &ws[..])];
    if has_b {
        specs.push((5, dt, &bs[..]));
    }
    let mut t = c.tensors(&specs)?.into_iter();
    let mut take = || t.next().ok_or_else(|| invalid(format!("{}: internal: tensor count", c.op)));
    let (x, w, dz, mut gx, mut gw) = (take()?, take()?, take()?, take()?, take()?);
    let mut gb = if has_b { Some(take()?) } else { None };
    c.run(|| {
        ops::gemm_ex(&dz, &w, &mut gx, Gemm::default(), None, Activation::Identity)?;
        ops::gemm_ex(&dz, &x, &mut gw, Gemm::new(true, false), None, Activation::Identity)?;
        if let Some(gb) = gb.as_mut() {
            ops::reduce_leading_dims_out(&dz, ReduceOp::Sum, gb)?;
        }
        Ok(())
    })
}

/// The attention options from the attributes: `layout` 0 `[B, H, S, D]`, 1 `[B, S, H, D]`;
/// `causal` 0 none, 1 top left, 2 bottom right; `scale` (0 or less: `1/sqrt(D)`); a window
/// `window_left`, `window_right` (a negative side unbounded; both negative: none).
fn attention_opts(c: &Call) -> Res<AttentionOpts> {
    let layout = match c.int("layout")? {
        0 => Layout::Bhsd,
        1 => Layout::Bshd,
        l => return Err(invalid(format!("{}: layout code {l}: expected 0 (BHSD) or 1 (BSHD)", c.op))),
    };
    let causal = match c.int("causal")? {
        0 => Causal::None,
        1 => Causal::TopLeft,
        2 => Causal::BottomRight,
        k => return Err(invalid(format!("{}: causal code {k}: expected 0, 1 or 2", c.op))),
    };
    let scale = c.float("scale")?;
    let scale = (scale > 0.0).then_some(scale);
    let (l, r) = (c.int("window_left")?, c.int("window_right")?);
    let side = |x: i64| usize::try_from(x).unwrap_or(usize::MAX);
    let window = if l < 0 && r < 0 { None } else { Some((side(l), side(r))) };
    Ok(AttentionOpts { causal, scale, window, layout })
}

fn rank4(c: &Call, i: usize) -> Res<[usize; 4]> {
    <[usize; 4]>::try_from(c.buf(i).dims.as_slice())
        .map_err(|_| invalid(format!("{}: {} has shape {:?}; expected rank 4", c.op, c.name(i), c.buf(i).dims)))
}

/// `(B, Hq, Sq)` of q's shape in the layout.
fn bhs(opts: &AttentionOpts, qs: [usize; 4]) -> [usize; 3] {
    match opts.layout {
        Layout::Bhsd => [qs[0], qs[1], qs[2]],
        Layout::Bshd => [qs[0], qs[2], qs[1]],
    }
}

/// Scaled dot-product attention: operands q, k, v (bf16 or f16, rank 4 in the layout), results
/// out (q's shape) and the f32 log-sum-exp of each query row (`[B, Hq, Sq]`).
fn attention_fwd(c: &Call) -> Res<()> {
    c.f.arity(c.op, 3, 2)?;
    let opts = attention_opts(c)?;
    let dt = c.float_dtype(0)?;
    let (qs, ks) = (rank4(c, 0)?, rank4(c, 1)?);
    c.same_dims(2, 1)?;
    c.same_dims(3, 0)?;
    let ls = bhs(&opts, qs);
    let [q, k, v, mut out, mut lse] =
        c.fixed([(0, dt, &qs), (1, dt, &ks), (2, dt, &ks), (3, dt, &qs), (4, DType::F32, &ls)])?;
    c.run(|| ops::attention_out(&q, &k, &v, &opts, &mut out, &mut lse))
}

/// Its backward: operands q, k, v, out, lse, dout; results dq, dk, dv.
fn attention_bwd(c: &Call) -> Res<()> {
    c.f.arity(c.op, 6, 3)?;
    let opts = attention_opts(c)?;
    let dt = c.float_dtype(0)?;
    let (qs, ks) = (rank4(c, 0)?, rank4(c, 1)?);
    for (i, like) in [(2, 1), (3, 0), (5, 0), (6, 0), (7, 1), (8, 1)] {
        c.same_dims(i, like)?;
    }
    let ls = bhs(&opts, qs);
    let [q, k, v, out, lse, dout, mut dq, mut dk, mut dv] = c.fixed([
        (0, dt, &qs),
        (1, dt, &ks),
        (2, dt, &ks),
        (3, dt, &qs),
        (4, DType::F32, &ls),
        (5, dt, &qs),
        (6, dt, &qs),
        (7, dt, &ks),
        (8, dt, &ks),
    ])?;
    c.run(|| ops::attention_backward_out(&q, &k, &v, &out, &lse, &dout, &opts, (&mut dq, &mut dk, &mut dv)))
}

type Op = fn(&Call) -> Res<()>;

/// Everything between XLA's call and the op: the metadata query, decoding, the device, the
/// stream; panics caught and reported as errors.
///
/// # Safety
/// `frame` is a call frame XLA passed to a handler.
unsafe fn entry(op: &'static str, f: Op, frame: *mut CallFrame) -> *mut XlaError {
    let mut api: *const ffi::Api = std::ptr::null();
    let r = catch_unwind(AssertUnwindSafe(|| -> Res<()> {
        if frame.is_null() {
            return Err(invalid("null call frame"));
        }
        // SAFETY: XLA's call frame.
        if unsafe { ffi::answer_metadata(frame)? } {
            return Ok(());
        }
        // SAFETY: XLA's call frame, not a metadata query.
        let fr = unsafe { Frame::decode(frame)? };
        api = fr.api;
        if fr.rets.iter().all(|b| b.numel() == 0) {
            return Ok(());
        }
        f(&Call { op, f: &fr, dev: OnceLock::new() })
    }));
    let failure = match r {
        Ok(Ok(())) => return std::ptr::null_mut(),
        Ok(Err(e)) => e,
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            ffi::Failure { code: ffi::Code::Internal, message: format!("{op}: internal error: {what}"), xla: 0 }
        }
    };
    if api.is_null() && !frame.is_null() {
        // SAFETY: XLA's frame; the api field is read only if the frame is large enough.
        unsafe {
            if (*frame).struct_size >= std::mem::offset_of!(CallFrame, ctx) {
                api = (*frame).api;
            }
        }
    }
    // SAFETY: XLA's API table or null.
    unsafe { ffi::make_error(api, failure) }
}

/// The targets: `name => function`, registered with XLA as `kernels_<name>`. A new op is one
/// function above and one row here (and its Python wrapper).
macro_rules! targets {
    ($($name:ident => $f:ident,)*) => {
        mod handlers {
            $(
                /// The XLA FFI handler of the target of this name.
                ///
                /// # Safety
                /// Called by XLA with its call frame.
                pub unsafe extern "C" fn $name(frame: *mut crate::ffi::CallFrame) -> *mut crate::ffi::XlaError {
                    // SAFETY: XLA's call frame.
                    unsafe { super::entry(stringify!($name), super::$f, frame) }
                }
            )*
        }

        /// Each target's name and handler.
        pub const TARGETS: &[(&str, unsafe extern "C" fn(*mut CallFrame) -> *mut XlaError)] =
            &[$((stringify!($name), handlers::$name),)*];
    };
}

targets! {
    unary_fwd => unary_fwd,
    unary_bwd => unary_bwd,
    softmax_fwd => softmax_fwd,
    softmax_bwd => softmax_bwd,
    norm_fwd => norm_fwd,
    norm_bwd => norm_bwd,
    cross_entropy_fwd => cross_entropy_fwd,
    cross_entropy_bwd => cross_entropy_bwd,
    linear_fwd => linear_fwd,
    linear_bwd => linear_bwd,
    attention_fwd => attention_fwd,
    attention_bwd => attention_bwd,
}
