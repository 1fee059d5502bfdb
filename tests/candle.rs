//! GPU tests of the candle custom ops (`kernels::candle`, cargo feature `candle`) against
//! candle's own ops, forward and backward through candle's autograd (`Var`, `backward`).
//!
//! Each op runs on a candle CUDA tensor and is compared with the same function written with
//! candle's own ops in f32, on the same input values (for bf16, the bf16 inputs widened): so the
//! f32 check measures the two implementations' f32 rounding (tolerance `1e-4` relative plus
//! `1e-5` of the largest reference value: a few ulp of each step of a composite reference), and
//! the bf16 check the one rounding of each bf16 output (2^-8 relative) with a factor two of
//! margin, plus 2^-8 of the largest value for the cancellations of the row ops' backward.
//! Shapes are awkward on purpose (rows of 1, 7, 33, 1000, 1025 and 4097 elements, 3-d), and
//! inputs are also passed transposed and narrowed (not contiguous, or not 16-byte aligned),
//! which the ops copy first. A small MLP trained with the ops follows candle's own loss curve.
//!
//! Without a GPU the tests are reported as ignored (skipped), as the other GPU tests.

mod common;

use candle_core::{D, DType, Device, Tensor, Var};
use common::{TestRng, e, test};
use kernels::ops::Activation;
use std::process::ExitCode;

type R<T> = Result<T, String>;

fn cuda() -> R<Device> {
    Device::new_cuda(0).map_err(e)
}

/// `n` values from a standard normal, away from the kinks of the piecewise activations (0 and
/// ±3), where the two sides' one-sided derivatives may differ.
fn normal(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = TestRng::new(seed);
    (0..n)
        .map(|_| {
            let v = rng.normal() as f32;
            if (v.abs() - 3.0).abs() < 0.05 || v.abs() < 1e-3 { v + 0.1 } else { v }
        })
        .collect()
}

fn tensor(dev: &Device, seed: u64, shape: &[usize], dt: DType) -> R<Tensor> {
    let n = shape.iter().product();
    Tensor::from_vec(normal(seed, n), shape, dev).and_then(|t| t.to_dtype(dt)).map_err(e)
}

fn f32s(t: &Tensor) -> R<Vec<f32>> {
    t.flatten_all().and_then(|t| t.to_dtype(DType::F32)).and_then(|t| t.to_vec1::<f32>()).map_err(e)
}

/// `got` (any dtype) against the f32 reference `want`, at `dt`'s tolerance (module docs).
fn close(what: &str, dt: DType, got: &Tensor, want: &Tensor) -> R<()> {
    if got.dims() != want.dims() {
        return Err(format!("{what}: shape {:?}, want {:?}", got.dims(), want.dims()));
    }
    let (g, w) = (f32s(got)?, f32s(want)?);
    let (rtol, atol) = match dt {
        DType::F32 => (1e-4, 1e-5),
        _ => (1.0 / 128.0, 1.0 / 256.0),
    };
    let max = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        // Written so that NaN fails.
        let within = (a - b).abs() <= rtol * b.abs() + atol * max;
        if !within {
            return Err(format!("{what} ({dt:?}): element {i} is {a}, want {b} (largest |want| {max})"));
        }
    }
    Ok(())
}

/// How an op sees its input: the variable itself, its transpose, or its last dimension narrowed
/// by its first element (not contiguous, and not starting on a 16-byte boundary).
#[derive(Clone, Copy, Debug)]
enum View {
    Plain,
    Transposed,
    Narrowed,
}

impl View {
    fn of(self, t: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            View::Plain => Ok(t.clone()),
            View::Transposed => t.t(),
            View::Narrowed => t.narrow(D::Minus1, 1, t.dim(D::Minus1)? - 1),
        }
    }
}

/// `f(view(x))` and the gradient at `x` for the output gradient `g`, by candle's autograd.
fn fwd_bwd(
    x: &Tensor,
    view: View,
    g: &Tensor,
    f: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> R<(Tensor, Tensor)> {
    let v = Var::from_tensor(x).map_err(e)?;
    let y = view.of(v.as_tensor()).and_then(|x| f(&x)).map_err(e)?;
    let grads = y.mul(g).and_then(|p| p.sum_all()).and_then(|l| l.backward()).map_err(e)?;
    let gx = grads.get(v.as_tensor()).ok_or("no gradient reached x")?.clone();
    Ok((y, gx))
}

/// Candle's own version of each activation, in candle ops with autograd.
fn reference(act: Activation, x: &Tensor) -> candle_core::Result<Tensor> {
    let softplus = |x: &Tensor| x.exp()?.affine(1.0, 1.0)?.log();
    match act {
        Activation::Identity => x.affine(1.0, 0.0),
        // PyTorch's derivative at 0, which the kernels follow: 0 (candle's own `relu` takes 1).
        Activation::Relu => x * x.gt(&x.zeros_like()?)?.to_dtype(x.dtype())?,
        Activation::LeakyRelu { negative_slope } => x.relu()? - x.neg()?.relu()?.affine(negative_slope as f64, 0.0)?,
        Activation::Sigmoid => x.neg()?.exp()?.affine(1.0, 1.0)?.recip(),
        Activation::Tanh => x.tanh(),
        Activation::Gelu => x.gelu_erf(),
        Activation::GeluTanh => x.gelu(),
        Activation::Silu => x.silu(),
        Activation::Mish => x * softplus(x)?.tanh()?,
        Activation::Softplus { .. } => softplus(x),
        Activation::Elu { alpha } => x.elu(alpha as f64),
        Activation::Selu => x.elu(1.673_263_242_354_377_3)?.affine(1.050_700_987_355_480_5, 0.0),
        Activation::Celu { alpha } => x.elu(alpha as f64),
        Activation::Hardswish => (x * x.affine(1.0, 3.0)?.relu()?.minimum(6.0)?)?.affine(1.0 / 6.0, 0.0),
        Activation::Hardsigmoid => x.affine(1.0 / 6.0, 0.5)?.relu()?.minimum(1.0),
        Activation::Softsign => x / x.abs()?.affine(1.0, 1.0)?,
    }
}

/// Inputs that the op sees as `[rows, cols]` in the three layouts: as given, as the transpose of
/// `[cols, rows]`, and narrowed from `[rows, cols + 1]`.
fn layouts(dev: &Device, seed: u64, rows: usize, cols: usize, dt: DType) -> R<Vec<(View, Tensor)>> {
    Ok(vec![
        (View::Plain, tensor(dev, seed, &[rows, cols], dt)?),
        (View::Transposed, tensor(dev, seed + 1, &[cols, rows], dt)?),
        (View::Narrowed, tensor(dev, seed + 2, &[rows, cols + 1], dt)?),
    ])
}

/// The shape the op sees.
fn seen(view: View, x: &Tensor) -> R<Vec<usize>> {
    Ok(view.of(x).map_err(e)?.dims().to_vec())
}

fn activation_case(act: Activation, dt: DType) -> R<()> {
    let dev = cuda()?;
    let mut cases = layouts(&dev, 1, 7, 33, dt)?;
    cases.push((View::Plain, tensor(&dev, 4, &[2, 3, 1025], dt)?));
    cases.push((View::Plain, tensor(&dev, 5, &[1], dt)?));
    for (view, x) in cases {
        let shape = seen(view, &x)?;
        let g = tensor(&dev, 9, &shape, dt)?;
        let (y, gx) = fwd_bwd(&x, view, &g, |x| kernels::candle::activation(x, act))?;
        let x32 = x.to_dtype(DType::F32).map_err(e)?;
        let g32 = g.to_dtype(DType::F32).map_err(e)?;
        let (yr, gxr) = fwd_bwd(&x32, view, &g32, |x| reference(act, x))?;
        let name = act.name();
        close(&format!("{name} forward, {view:?} {shape:?}"), dt, &y, &yr)?;
        close(&format!("{name} backward, {view:?} {shape:?}"), dt, &gx, &gxr)?;
    }
    Ok(())
}

/// `act(x * scale + bias)` against candle's ops, for the activations the fused op serves most.
fn scale_bias_act_case(dt: DType) -> R<()> {
    let dev = cuda()?;
    let mut cases = layouts(&dev, 61, 7, 33, dt)?;
    cases.push((View::Plain, tensor(&dev, 64, &[2, 3, 1025], dt)?));
    for act in [Activation::Silu, Activation::Gelu, Activation::GeluTanh, Activation::Relu, Activation::Sigmoid] {
        for (view, x) in &cases {
            let shape = seen(*view, x)?;
            let cols = *shape.last().ok_or("no dims")?;
            let (s, b) = (tensor(&dev, 65, &[cols], dt)?, tensor(&dev, 66, &[cols], dt)?);
            let g = tensor(&dev, 69, &shape, dt)?;
            let f = |x: &Tensor, s: &Tensor, b: Option<&Tensor>| match b {
                Some(b) => kernels::candle::scale_bias_act(x, s, b, act),
                None => Err(candle_core::Error::Msg("no bias".into())),
            };
            let ours = norm_grads(x, *view, &s, Some(&b), &g, f)?;
            let up = |t: &Tensor| t.to_dtype(DType::F32).map_err(e);
            let r = |x: &Tensor, s: &Tensor, b: Option<&Tensor>| match b {
                Some(b) => reference(act, &x.broadcast_mul(s)?.broadcast_add(b)?),
                None => Err(candle_core::Error::Msg("no bias".into())),
            };
            let want = norm_grads(&up(x)?, *view, &up(&s)?, Some(&up(&b)?), &up(&g)?, r)?;
            for (i, part) in ["forward", "dx", "dscale", "dbias"].iter().enumerate() {
                close(&format!("scale_bias_act {} {part}, {view:?} {shape:?}", act.name()), dt, &ours[i], &want[i])?;
            }
        }
    }
    Ok(())
}

fn softmax_ref(x: &Tensor, log: bool) -> candle_core::Result<Tensor> {
    let s = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?;
    if log {
        s.broadcast_sub(&s.exp()?.sum_keepdim(D::Minus1)?.log()?)
    } else {
        let p = s.exp()?;
        p.broadcast_div(&p.sum_keepdim(D::Minus1)?)
    }
}

fn softmax_case(log: bool, dt: DType) -> R<()> {
    let dev = cuda()?;
    let mut cases = layouts(&dev, 11, 7, 33, dt)?;
    cases.push((View::Plain, tensor(&dev, 14, &[3, 2], dt)?));
    cases.push((View::Plain, tensor(&dev, 15, &[65, 1000], dt)?));
    cases.push((View::Plain, tensor(&dev, 16, &[2, 3, 4097], dt)?));
    for (view, x) in cases {
        let shape = seen(view, &x)?;
        let g = tensor(&dev, 19, &shape, dt)?;
        let f = |x: &Tensor| if log { kernels::candle::log_softmax(x) } else { kernels::candle::softmax(x) };
        let (y, gx) = fwd_bwd(&x, view, &g, f)?;
        let (x32, g32) = (x.to_dtype(DType::F32).map_err(e)?, g.to_dtype(DType::F32).map_err(e)?);
        let (yr, gxr) = fwd_bwd(&x32, view, &g32, |x| softmax_ref(x, log))?;
        let name = if log { "log_softmax" } else { "softmax" };
        close(&format!("{name} forward, {view:?} {shape:?}"), dt, &y, &yr)?;
        close(&format!("{name} backward, {view:?} {shape:?}"), dt, &gx, &gxr)?;
    }
    Ok(())
}

const EPS: f32 = 1e-5;

fn norm_ref(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    match b {
        Some(b) => {
            let xc = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
            let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
            xc.broadcast_div(&var.affine(1.0, EPS as f64)?.sqrt()?)?.broadcast_mul(w)?.broadcast_add(b)
        }
        None => {
            let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
            x.broadcast_div(&ms.affine(1.0, EPS as f64)?.sqrt()?)?.broadcast_mul(w)
        }
    }
}

/// Output and the gradients of x, weight (and bias) of a norm (or of the fused
/// `act(x * scale + bias)`), by candle's autograd.
fn norm_grads(
    x: &Tensor,
    view: View,
    w: &Tensor,
    b: Option<&Tensor>,
    g: &Tensor,
    f: impl Fn(&Tensor, &Tensor, Option<&Tensor>) -> candle_core::Result<Tensor>,
) -> R<Vec<Tensor>> {
    let vars: Vec<Var> =
        [Some(x), Some(w), b].into_iter().flatten().map(Var::from_tensor).collect::<Result<_, _>>().map_err(e)?;
    let x = view.of(vars[0].as_tensor()).map_err(e)?;
    let y = f(&x, vars[1].as_tensor(), vars.get(2).map(|v| v.as_tensor())).map_err(e)?;
    let grads = y.mul(g).and_then(|p| p.sum_all()).and_then(|l| l.backward()).map_err(e)?;
    let mut out = vec![y];
    for v in &vars {
        out.push(grads.get(v.as_tensor()).ok_or("a norm input got no gradient")?.clone());
    }
    Ok(out)
}

fn norm_case(rms: bool, dt: DType) -> R<()> {
    let dev = cuda()?;
    let mut cases = layouts(&dev, 21, 7, 33, dt)?;
    cases.push((View::Plain, tensor(&dev, 24, &[65, 1000], dt)?));
    cases.push((View::Plain, tensor(&dev, 25, &[2, 3, 7], dt)?));
    for (view, x) in cases {
        let shape = seen(view, &x)?;
        let cols = *shape.last().ok_or("no dims")?;
        let w = tensor(&dev, 26, &[cols], dt)?;
        let b = tensor(&dev, 27, &[cols], dt)?;
        let b = (!rms).then_some(&b);
        let g = tensor(&dev, 29, &shape, dt)?;
        let ours = norm_grads(&x, view, &w, b, &g, |x, w, b| match b {
            Some(b) => kernels::candle::layer_norm(x, w, b, EPS),
            None => kernels::candle::rms_norm(x, w, EPS),
        })?;
        let up = |t: &Tensor| t.to_dtype(DType::F32).map_err(e);
        let b32 = b.map(up).transpose()?;
        let want = norm_grads(&up(&x)?, view, &up(&w)?, b32.as_ref(), &up(&g)?, norm_ref)?;
        let name = if rms { "rms_norm" } else { "layer_norm" };
        for (i, part) in ["forward", "dx", "dweight", "dbias"].iter().enumerate().take(ours.len()) {
            close(&format!("{name} {part}, {view:?} {shape:?}"), dt, &ours[i], &want[i])?;
        }
    }
    Ok(())
}

fn cross_entropy_ref(logits: &Tensor, t: &Tensor) -> candle_core::Result<Tensor> {
    softmax_ref(logits, true)?.gather(&t.unsqueeze(1)?, 1)?.neg()?.mean_all()
}

fn cross_entropy_case(dt: DType) -> R<()> {
    let dev = cuda()?;
    for (seed, rows, cols, idx) in [(31, 7, 33, DType::I64), (32, 64, 1000, DType::U32), (33, 1, 2, DType::I64)] {
        let mut rng = TestRng::new(seed);
        let t: Vec<i64> = (0..rows).map(|_| rng.below(cols) as i64).collect();
        let t = Tensor::from_vec(t, rows, &Device::Cpu).and_then(|t| t.to_dtype(idx)?.to_device(&dev)).map_err(e)?;
        for (view, x) in layouts(&dev, seed, rows, cols, dt)? {
            let what = format!("{view:?}");
            let g = Tensor::new(1.5f32, &dev).and_then(|g| g.to_dtype(dt)).map_err(e)?;
            let (loss, gx) = fwd_bwd(&x, view, &g, |x| kernels::candle::cross_entropy(x, &t))?;
            let t64 = t.to_dtype(DType::I64).map_err(e)?;
            let (x32, g32) = (x.to_dtype(DType::F32).map_err(e)?, g.to_dtype(DType::F32).map_err(e)?);
            let (lr, gxr) = fwd_bwd(&x32, view, &g32, |x| cross_entropy_ref(x, &t64))?;
            close(&format!("cross_entropy loss, {what} [{rows}, {cols}] {idx:?}"), dt, &loss, &lr)?;
            close(&format!("cross_entropy dlogits, {what} [{rows}, {cols}] {idx:?}"), dt, &gx, &gxr)?;
        }
    }
    Ok(())
}

/// Misuse is an error naming the op, never a panic: the CPU, an integer dtype, mismatched shapes.
fn errors() -> R<()> {
    let dev = cuda()?;
    let cpu = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).map_err(e)?;
    let msg = kernels::candle::activation(&cpu, Activation::Gelu).err().ok_or("gelu on the CPU did not fail")?;
    if !msg.to_string().contains("CUDA") {
        return Err(format!("CPU error does not say why: {msg}"));
    }
    let ints = Tensor::zeros((2, 3), DType::U32, &dev).map_err(e)?;
    let msg = kernels::candle::softmax(&ints).err().ok_or("softmax of u32 did not fail")?;
    if !msg.to_string().contains("U32") {
        return Err(format!("dtype error does not name the dtype: {msg}"));
    }
    let x = tensor(&dev, 41, &[4, 8], DType::F32)?;
    let w = tensor(&dev, 42, &[7], DType::F32)?;
    if kernels::candle::rms_norm(&x, &w, EPS).is_ok() {
        return Err("rms_norm with a weight of the wrong size did not fail".into());
    }
    let t = Tensor::zeros(3, DType::I64, &dev).map_err(e)?;
    if kernels::candle::cross_entropy(&x, &t).is_ok() {
        return Err("cross_entropy with 3 targets for 4 rows did not fail".into());
    }
    Ok(())
}

/// A two-layer MLP (linear, layer norm, GELU, linear, cross-entropy) trained by SGD twice from
/// the same weights: with candle's own ops and with ours for the norm, the activation and the
/// loss. The curves agree to f32 rounding carried through the steps (1e-4 relative), and the loss
/// falls.
fn mlp() -> R<()> {
    let dev = cuda()?;
    let (n, d, h, c, steps, lr) = (256, 16, 64, 10, 60, 0.3);
    let x = tensor(&dev, 51, &[n, d], DType::F32)?;
    // Labels from a random linear teacher: learnable.
    let teacher = tensor(&dev, 52, &[d, c], DType::F32)?;
    let labels = x.matmul(&teacher).and_then(|l| l.argmax(1)).and_then(|l| l.to_dtype(DType::I64)).map_err(e)?;
    let init = |seed, shape: &[usize], scale: f64| tensor(&dev, seed, shape, DType::F32)?.affine(scale, 0.0).map_err(e);
    let params0 = [
        init(53, &[d, h], 1.0 / (d as f64).sqrt())?,
        init(54, &[h], 0.0)?,
        init(55, &[h], 0.1)?.affine(1.0, 1.0).map_err(e)?,
        init(56, &[h], 0.1)?,
        init(57, &[h, c], 1.0 / (h as f64).sqrt())?,
        init(58, &[c], 0.0)?,
    ];
    let train = |ours: bool| -> R<Vec<f32>> {
        let p: Vec<Var> = params0.iter().map(Var::from_tensor).collect::<Result<_, _>>().map_err(e)?;
        let mut curve = vec![];
        for _ in 0..steps {
            let t = |i: usize| p[i].as_tensor();
            let loss = (|| {
                let z = x.matmul(t(0))?.broadcast_add(t(1))?;
                let logits = if ours {
                    let a = kernels::candle::layer_norm(&z, t(2), t(3), EPS)?;
                    kernels::candle::activation(&a, Activation::Gelu)?.matmul(t(4))?.broadcast_add(t(5))?
                } else {
                    norm_ref(&z, t(2), Some(t(3)))?.gelu_erf()?.matmul(t(4))?.broadcast_add(t(5))?
                };
                if ours {
                    kernels::candle::cross_entropy(&logits, &labels)
                } else {
                    cross_entropy_ref(&logits, &labels)
                }
            })()
            .map_err(e)?;
            curve.push(loss.to_vec0::<f32>().map_err(e)?);
            let grads = loss.backward().map_err(e)?;
            for v in &p {
                let g = grads.get(v.as_tensor()).ok_or("a parameter got no gradient")?;
                let step = g.affine(lr, 0.0).and_then(|s| v.as_tensor() - s).map_err(e)?;
                v.set(&step).map_err(e)?;
            }
        }
        Ok(curve)
    };
    let (want, got) = (train(false)?, train(true)?);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        let within = (a - b).abs() <= 1e-4 * b.abs().max(1.0);
        if !within {
            return Err(format!("step {i}: loss {a} with our ops, {b} with candle's (curves {got:?} vs {want:?})"));
        }
    }
    let (first, last) = (want[0], want[want.len() - 1]);
    let fell = last < 0.7 * first;
    if !fell {
        return Err(format!("the loss did not fall: {first} -> {last}"));
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = vec![];
    for dt in [DType::F32, DType::BF16] {
        let s = format!("{dt:?}").to_lowercase();
        for &act in Activation::ALL {
            tests.push(test(format!("activation_{}_{s}", act.name()), move |_| activation_case(act, dt)));
        }
        tests.push(test(format!("scale_bias_act_{s}"), move |_| scale_bias_act_case(dt)));
        tests.push(test(format!("softmax_{s}"), move |_| softmax_case(false, dt)));
        tests.push(test(format!("log_softmax_{s}"), move |_| softmax_case(true, dt)));
        tests.push(test(format!("layer_norm_{s}"), move |_| norm_case(false, dt)));
        tests.push(test(format!("rms_norm_{s}"), move |_| norm_case(true, dt)));
        tests.push(test(format!("cross_entropy_{s}"), move |_| cross_entropy_case(dt)));
    }
    tests.push(test("errors_name_the_op", |_| errors()));
    tests.push(test("mlp_follows_candles_loss_curve", |_| mlp()));
    common::run(tests)
}
