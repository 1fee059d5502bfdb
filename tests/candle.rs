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
//! which the ops copy first. The linear layer's results are sums of many products, so they are
//! held to the componentwise bound of such sums instead (`gemm_close`), and attention, whose
//! kernels round intermediate values to bf16 or f16, to a norm-wise bound (`attention_case`).
//! A small MLP trained with the ops follows candle's own loss curve.
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

/// The output and the gradients of every input of `f` for the output gradient `g`, by candle's
/// autograd.
fn all_grads(inputs: &[&Tensor], g: &Tensor, f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>) -> R<Vec<Tensor>> {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t)).collect::<Result<_, _>>().map_err(e)?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts).map_err(e)?;
    let grads = y.mul(g).and_then(|p| p.sum_all()).and_then(|l| l.backward()).map_err(e)?;
    let mut out = vec![y];
    for t in &ts {
        out.push(grads.get(t).ok_or("an input got no gradient")?.clone());
    }
    Ok(out)
}

/// A product's result against its f32 reference, by the componentwise bound of a sum of `k`
/// products: each side errs by at most `k` f32 roundings of `|a| |b|` (the sums of the products'
/// magnitudes, `absprod`, one more rounding for the store), and a bf16 result by one rounding of
/// its value more (2^-9 relative, a factor two of margin). A wrong transpose or operand errs by
/// the values themselves.
fn gemm_close(what: &str, dt: DType, got: &Tensor, want: &Tensor, absprod: &Tensor, k: usize) -> R<()> {
    if got.dims() != want.dims() {
        return Err(format!("{what}: shape {:?}, want {:?}", got.dims(), want.dims()));
    }
    let (g, w, a) = (f32s(got)?, f32s(want)?, f32s(absprod)?);
    let r = if dt == DType::F32 { 0.0 } else { 1.0 / 256.0 };
    let acc = 2.0 * (k as f32 + 1.0) * f32::EPSILON / 2.0;
    for (i, ((x, y), m)) in g.iter().zip(&w).zip(&a).enumerate() {
        let within = (x - y).abs() <= r * y.abs() + acc * m;
        if !within {
            return Err(format!("{what} ({dt:?}): element {i} is {x}, want {y} (sum of |products| {m}, k {k})"));
        }
    }
    Ok(())
}

/// candle's matmul refuses a strided left operand (a narrowed view): the reference copies it.
fn linear_ref(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let y = x.contiguous()?.broadcast_matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// `x @ w^T (+ b)` and its three gradients against candle's matmul and broadcast add, x as given,
/// transposed, narrowed and 3-d, the weight also as a transposed view.
fn linear_case(bias: bool, dt: DType) -> R<()> {
    let dev = cuda()?;
    let (inp, out) = (33, 40);
    let mut cases: Vec<(View, Tensor, bool)> =
        layouts(&dev, 71, 7, inp, dt)?.into_iter().map(|(v, x)| (v, x, false)).collect();
    cases.push((View::Plain, tensor(&dev, 74, &[2, 3, inp], dt)?, false));
    cases.push((View::Plain, tensor(&dev, 75, &[130, inp], dt)?, true));
    for (view, x, w_t) in cases {
        let shape = seen(view, &x)?;
        let rows: usize = shape[..shape.len() - 1].iter().product();
        // The transposed weight is a view taken inside the op's function (a variable is stored
        // contiguous).
        let w = if w_t { tensor(&dev, 76, &[inp, out], dt)? } else { tensor(&dev, 77, &[out, inp], dt)? };
        let wv = |w: &Tensor| if w_t { w.t() } else { Ok(w.clone()) };
        let b = tensor(&dev, 78, &[out], dt)?;
        let mut gshape = shape.clone();
        *gshape.last_mut().ok_or("no dims")? = out;
        let g = tensor(&dev, 79, &gshape, dt)?;
        let ins: Vec<&Tensor> = if bias { vec![&x, &w, &b] } else { vec![&x, &w] };
        let ours = all_grads(&ins, &g, |t| kernels::candle::linear(&view.of(&t[0])?, &wv(&t[1])?, t.get(2)))?;
        let up = |t: &Tensor| t.to_dtype(DType::F32).map_err(e);
        let ins32: Vec<Tensor> = ins.iter().copied().map(up).collect::<R<_>>()?;
        let refs: Vec<&Tensor> = ins32.iter().collect();
        let g32 = up(&g)?;
        let want = all_grads(&refs, &g32, |t| linear_ref(&view.of(&t[0])?, &wv(&t[1])?, t.get(2)))?;
        let b32 = up(&b)?;
        // The sums of the products' magnitudes of each result (in the shapes the op sees).
        let bounds = (|| {
            let (xa, wa, ga) = (view.of(&ins32[0])?.abs()?, wv(&ins32[1])?.abs()?, g32.abs()?);
            let y = linear_ref(&xa, &wa, Some(&b32.abs()?))?;
            let g2 = ga.reshape((rows, out))?;
            let dx = g2.matmul(&wa)?.reshape(shape.clone())?;
            let dw = g2.t()?.matmul(&xa.contiguous()?.reshape((rows, inp))?)?;
            let db = g2.sum(0)?;
            Ok::<_, candle_core::Error>(vec![y, dx, dw, db])
        })()
        .map_err(e)?;
        let what =
            format!("linear{} {view:?} {shape:?}{}", if bias { "+bias" } else { "" }, if w_t { " w^T" } else { "" });
        gemm_close(&format!("{what} forward"), dt, &ours[0], &want[0], &bounds[0], inp)?;
        // The gradients of the variables, seen as the op sees them.
        let seen_as = |i: usize, t: &Tensor| {
            if i == 1 {
                view.of(t)
            } else if i == 2 {
                wv(t)
            } else {
                Ok(t.clone())
            }
        };
        for (i, (part, k)) in [("dx", out), ("dw", rows), ("db", rows)].into_iter().enumerate().take(ins.len()) {
            let (got, want) = (seen_as(i + 1, &ours[i + 1]).map_err(e)?, seen_as(i + 1, &want[i + 1]).map_err(e)?);
            gemm_close(&format!("{what} {part}"), dt, &got, &want, &bounds[i + 1], k)?;
        }
    }
    Ok(())
}

fn attention_ref(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> candle_core::Result<Tensor> {
    let s = q.contiguous()?.matmul(&k.t()?.contiguous()?)?.affine(scale, 0.0)?;
    let s = if causal {
        let (sq, sk) = (q.dim(2)?, k.dim(2)?);
        let mask: Vec<f32> = (0..sq * sk).map(|i| if i % sk > i / sk { f32::NEG_INFINITY } else { 0.0 }).collect();
        s.broadcast_add(&Tensor::from_vec(mask, (sq, sk), q.device())?)?
    } else {
        s
    };
    softmax_ref(&s, false)?.matmul(&v.contiguous()?)
}

/// The norm-wise error `||got - want|| / ||want||`.
fn rel_err(got: &Tensor, want: &Tensor) -> R<f64> {
    let (g, w) = (f32s(got)?, f32s(want)?);
    let (mut d, mut n) = (0f64, 0f64);
    for (a, b) in g.iter().zip(&w) {
        d += (*a as f64 - *b as f64).powi(2);
        n += (*b as f64).powi(2);
    }
    // Written so that NaN fails.
    if d.is_nan() { Ok(f64::INFINITY) } else { Ok((d / n).sqrt()) }
}

/// Attention and its gradients against softmax(q k^T * scale) v in candle's f32 ops on the same
/// rounded inputs, norm-wise: `||ours - ref|| <= C u ||ref||`, u the dtype's unit roundoff
/// (2^-8 bf16, 2^-11 f16), C 4 forward and 8 backward (the kernels round the softmax weights
/// before `P V` and, backward, `dS` and `P` before their products, independent errors of zero
/// mean; a wrong mask, scale or layout errs by tens of percent). `[B, H, S, D]` as given and
/// as a transposed view of `[B, S, H, D]` (copied), and the `[B, S, H, D]` layout in place.
fn attention_case(dt: DType) -> R<()> {
    let dev = cuda()?;
    let u = if dt == DType::BF16 { 2f64.powi(-8) } else { 2f64.powi(-11) };
    let (b, h, sq, sk, d) = (2, 3, 65, 80, 64);
    for (causal, scale, bshd_view, bshd_layout) in [
        (false, None, false, false),
        (true, Some(0.3), false, false),
        (true, None, true, false),
        (false, None, false, true),
    ] {
        let stored = |s| if bshd_view || bshd_layout { [b, s, h, d] } else { [b, h, s, d] };
        let (q, k, v) = (
            tensor(&dev, 81, &stored(sq), dt)?,
            tensor(&dev, 82, &stored(sk), dt)?,
            tensor(&dev, 83, &stored(sk), dt)?,
        );
        let g = tensor(&dev, 84, &stored(sq), dt)?;
        // What each side computes on: `[B, H, S, D]` views for the reference.
        let bhsd = |t: &Tensor| if bshd_view || bshd_layout { t.transpose(1, 2) } else { Ok(t.clone()) };
        let ours = all_grads(&[&q, &k, &v], &g, |t| {
            if bshd_layout {
                let causal = if causal { kernels::ops::Causal::TopLeft } else { kernels::ops::Causal::None };
                let opts = kernels::ops::AttentionOpts {
                    causal,
                    scale,
                    layout: kernels::ops::Layout::Bshd,
                    ..Default::default()
                };
                kernels::candle::attention(&t[0], &t[1], &t[2], &opts)
            } else {
                let v = |i: usize| bhsd(&t[i]);
                let y = kernels::candle::scaled_dot_product_attention(&v(0)?, &v(1)?, &v(2)?, causal, scale)?;
                if bshd_view { y.transpose(1, 2) } else { Ok(y) }
            }
        })?;
        let up = |t: &Tensor| t.to_dtype(DType::F32).map_err(e);
        let sc = scale.map_or(1.0 / (d as f64).sqrt(), f64::from);
        let want = all_grads(&[&up(&q)?, &up(&k)?, &up(&v)?], &up(&g)?, |t| {
            bhsd(&attention_ref(&bhsd(&t[0])?, &bhsd(&t[1])?, &bhsd(&t[2])?, causal, sc)?)
        })?;
        for (i, (part, c)) in [("forward", 4.0), ("dq", 8.0), ("dk", 8.0), ("dv", 8.0)].into_iter().enumerate() {
            let r = rel_err(&ours[i], &want[i])?;
            let ok = ours[i].dims() == want[i].dims() && r <= c * u;
            if !ok {
                return Err(format!(
                    "attention {part} ({dt:?}, causal {causal}, scale {scale:?}, bshd view {bshd_view}, \
                     bshd layout {bshd_layout}): norm-wise error {r:.3e} > {c} u = {:.3e}",
                    c * u
                ));
            }
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
    let w = tensor(&dev, 43, &[5, 7], DType::F32)?;
    let msg =
        kernels::candle::linear(&x, &w, None).err().ok_or("linear with a [5, 7] weight for 8 inputs did not fail")?;
    if !msg.to_string().contains("linear") {
        return Err(format!("linear's error does not name the op: {msg}"));
    }
    let q = tensor(&dev, 44, &[1, 2, 8, 16], DType::F32)?;
    let msg = kernels::candle::scaled_dot_product_attention(&q, &q, &q, false, None)
        .err()
        .ok_or("attention in f32 did not fail")?;
    if !msg.to_string().contains("F32") {
        return Err(format!("attention's f32 error does not say why: {msg}"));
    }
    let q = tensor(&dev, 45, &[2, 8, 16], DType::BF16)?;
    if kernels::candle::scaled_dot_product_attention(&q, &q, &q, false, None).is_ok() {
        return Err("attention of rank-3 tensors did not fail".into());
    }
    Ok(())
}

/// A two-layer MLP (linear, layer norm, GELU, linear, cross-entropy) trained by SGD twice from
/// the same weights: with candle's own ops and with ours for the linear layers, the norm, the
/// activation and the loss. The curves agree to f32 rounding carried through the steps (1e-4
/// relative), and the loss falls.
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
                // The weights are stored `[in, out]`: ours take their transposed views.
                let logits = if ours {
                    let z = kernels::candle::linear(&x, &t(0).t()?, Some(t(1)))?;
                    let a = kernels::candle::layer_norm(&z, t(2), t(3), EPS)?;
                    kernels::candle::linear(
                        &kernels::candle::activation(&a, Activation::Gelu)?,
                        &t(4).t()?,
                        Some(t(5)),
                    )?
                } else {
                    let z = x.matmul(t(0))?.broadcast_add(t(1))?;
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
        tests.push(test(format!("linear_{s}"), move |_| linear_case(false, dt)));
        tests.push(test(format!("linear_bias_{s}"), move |_| linear_case(true, dt)));
    }
    for dt in [DType::BF16, DType::F16] {
        let s = format!("{dt:?}").to_lowercase();
        tests.push(test(format!("attention_{s}"), move |_| attention_case(dt)));
    }
    tests.push(test("errors_name_the_op", |_| errors()));
    tests.push(test("mlp_follows_candles_loss_curve", |_| mlp()));
    common::run(tests)
}
