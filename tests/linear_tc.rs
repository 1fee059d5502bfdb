//! GPU tests of the linear layer in bf16 and f16 (`ops::linear`, `ops::linear_train`,
//! `ops::linear_backward` given bf16 or f16 tensors), against an f64 reference of the rounded
//! inputs, within the bounds derived in tests/common/linear_ref.rs (worst cases, none widened to
//! pass). The harness poisons allocations with NaN, so an output element the layer does not
//! write fails the check.

mod common;

use common::linear_ref::{Inputs, check, expect};
use common::*;
use kernels::ops::{self, Activation};
use kernels::{DType, Device, Error, Tensor};
use std::process::ExitCode;

/// One layer: leading dimensions of x, in, out, activation, dtype, bias.
type Shape = (&'static [usize], usize, usize, Activation, DType, bool);

/// Primes and ones, a 3-D input, every activation path (fused, stored pre-activation, Mish's
/// separate pass), split-K in the forward (one 128-wide tile of output, K = 2048) and in dW
/// (K = rows = 1024 over a 64 x 64 gradient), an output wider than one tile.
const SHAPES: [Shape; 9] = [
    (&[7], 33, 65, Activation::Relu, DType::BF16, true),
    (&[130], 64, 200, Activation::Gelu, DType::F16, true),
    (&[2, 32], 129, 31, Activation::Silu, DType::BF16, true),
    (&[1], 1, 1, Activation::Identity, DType::F16, true),
    (&[300], 17, 10, Activation::Mish, DType::BF16, true),
    (&[3, 5], 40, 7, Activation::GeluTanh, DType::F16, false),
    (&[64], 2048, 96, Activation::Gelu, DType::BF16, true),
    (&[1024], 64, 64, Activation::Relu, DType::F16, true),
    (&[5, 13], 24, 1031, Activation::Identity, DType::BF16, true),
];

fn layer(dev: &Device, case: usize, &(lead, inp, out, act, dt, with_bias): &Shape) -> Result<f64, String> {
    let rows: usize = lead.iter().product();
    let mut rng = TestRng::new(900 + case as u64);
    let mut draw = |n: usize, scale: f64| (0..n).map(|_| round_to(dt, (rng.normal() * scale) as f32)).collect();
    let x: Vec<f32> = draw(rows * inp, 1.0);
    let w: Vec<f32> = draw(out * inp, 1.0 / (inp as f64).sqrt());
    let b: Vec<f32> = draw(out, 1.0);
    let dy: Vec<f32> = draw(rows * out, 1.0);
    let xs: Vec<usize> = lead.iter().copied().chain([inp]).collect();
    let ys: Vec<usize> = lead.iter().copied().chain([out]).collect();
    let tx = tensor(dev, &x, &xs, dt)?;
    let tw = tensor(dev, &w, &[out, inp], dt)?;
    let tb = tensor(dev, &b, &[out], dt)?;
    let tdy = tensor(dev, &dy, &ys, dt)?;
    let bias = with_bias.then_some(&tb);
    let depth = ops::reduce_leading_dims_sum_depth(&tdy).map_err(e)?;
    let p = Inputs { x: &x, w: &w, b: with_bias.then_some(&b[..]), dy: &dy, rows, inp, out };
    let r = expect(dt, &p, act, depth);
    let what = |s: &str| format!("{dt:?} {lead:?} x {inp} -> {out} {act:?}: {s}");

    let y_inf = ops::linear(&tx, &tw, bias, act).map_err(e)?;
    let (y, saved) = ops::linear_train(&tx, &tw, bias, act).map_err(e)?;
    for t in [&y_inf, &y] {
        if t.shape() != ys || t.dtype() != dt {
            return Err(what(&format!("y is {:?} {:?}", t.dtype(), t.shape())));
        }
    }
    let mut worst = check(&what("linear y"), &y_inf.to_f32_vec().map_err(e)?, &r.y_inference)?;
    worst = worst.max(check(&what("linear_train y"), &y.to_f32_vec().map_err(e)?, &r.y_train)?);
    let g = ops::linear_backward(&tx, &tw, &y, &saved, &tdy, bias).map_err(e)?;
    for (name, t, shape) in [("dx", &g.x, &xs[..]), ("dW", &g.weight, &[out, inp][..])] {
        if t.shape() != shape || t.dtype() != dt {
            return Err(what(&format!("{name} is {:?} {:?}", t.dtype(), t.shape())));
        }
    }
    worst = worst.max(check(&what("dx"), &g.x.to_f32_vec().map_err(e)?, &r.dx)?);
    worst = worst.max(check(&what("dW"), &g.weight.to_f32_vec().map_err(e)?, &r.dw)?);
    match (&g.bias, &r.db) {
        (Some(gb), Some(db)) => {
            if gb.dtype() != dt {
                return Err(what(&format!("db is {:?}", gb.dtype())));
            }
            worst = worst.max(check(&what("db"), &gb.to_f32_vec().map_err(e)?, db)?);
        }
        (None, None) => {}
        _ => return Err(what("a bias gradient where there is no bias, or none where there is")),
    }
    Ok(worst)
}

fn forward_backward(dev: &Device) -> Result<(), String> {
    let mut worst: f64 = 0.0;
    for (case, s) in SHAPES.iter().enumerate() {
        worst = worst.max(layer(dev, case, s)?);
    }
    eprintln!("linear bf16/f16: largest error {worst:.3} of its bound");
    Ok(())
}

/// Both dtypes on every activation the layer takes, on one awkward shape.
fn every_activation(dev: &Device) -> Result<(), String> {
    let acts = [
        Activation::Identity,
        Activation::Relu,
        Activation::Gelu,
        Activation::GeluTanh,
        Activation::Silu,
        Activation::Mish,
        Activation::Sigmoid,
        Activation::Tanh,
    ];
    for (n, act) in acts.into_iter().enumerate() {
        for dt in [DType::BF16, DType::F16] {
            let shape: Shape = (&[3, 11], 45, 19, act, dt, true);
            layer(dev, 100 + n, &shape)?;
        }
    }
    Ok(())
}

/// No rows: empty outputs, zero weight and bias gradients; no inputs (in = 0): act(bias).
fn empty_shapes(dev: &Device) -> Result<(), String> {
    for dt in [DType::BF16, DType::F16] {
        let w = tensor(dev, &[0.5; 8 * 16], &[8, 16], dt)?;
        let b = tensor(dev, &[0.25; 8], &[8], dt)?;
        let x = tensor(dev, &[], &[0, 16], dt)?;
        let (y, saved) = ops::linear_train(&x, &w, Some(&b), Activation::Silu).map_err(e)?;
        if y.shape() != [0, 8] {
            return Err(format!("{dt:?}: y of 0 rows is {:?}", y.shape()));
        }
        let dy = tensor(dev, &[], &[0, 8], dt)?;
        let g = ops::linear_backward(&x, &w, &y, &saved, &dy, Some(&b)).map_err(e)?;
        let (gw, gb) = (g.weight.to_f32_vec().map_err(e)?, g.bias.ok_or("no db")?.to_f32_vec().map_err(e)?);
        if g.x.shape() != [0, 16] || gw.iter().chain(&gb).any(|&v| v != 0.0) {
            return Err(format!("{dt:?}: gradients of 0 rows: dW {gw:?}, db {gb:?}"));
        }
        let x0 = tensor(dev, &[], &[5, 0], dt)?;
        let w0 = tensor(dev, &[], &[3, 0], dt)?;
        let b0 = tensor(dev, &[1.0, -2.0, 0.5], &[3], dt)?;
        let y0 = ops::linear(&x0, &w0, Some(&b0), Activation::Relu).map_err(e)?.to_f32_vec().map_err(e)?;
        if y0 != [1.0, 0.0, 0.5].repeat(5) {
            return Err(format!("{dt:?}: in = 0 gave {y0:?}, expected relu(bias) per row"));
        }
    }
    Ok(())
}

/// The same inputs give the same bits (no atomics anywhere on the path), split-K included.
fn deterministic(dev: &Device) -> Result<(), String> {
    let (rows, inp, out, dt) = (1024, 512, 64, DType::BF16);
    let mut rng = TestRng::new(77);
    let mut draw = |n: usize| (0..n).map(|_| round_to(dt, rng.normal() as f32)).collect::<Vec<f32>>();
    let (x, w, b, dy) = (draw(rows * inp), draw(out * inp), draw(out), draw(rows * out));
    let tx = tensor(dev, &x, &[rows, inp], dt)?;
    let tw = tensor(dev, &w, &[out, inp], dt)?;
    let tb = tensor(dev, &b, &[out], dt)?;
    let tdy = tensor(dev, &dy, &[rows, out], dt)?;
    let run = || -> Result<Vec<Vec<f32>>, String> {
        let (y, saved) = ops::linear_train(&tx, &tw, Some(&tb), Activation::Gelu).map_err(e)?;
        let g = ops::linear_backward(&tx, &tw, &y, &saved, &tdy, Some(&tb)).map_err(e)?;
        [&y, &g.x, &g.weight, g.bias.as_ref().ok_or("no db")?].iter().map(|t| t.to_f32_vec().map_err(e)).collect()
    };
    let first = run()?;
    for _ in 0..3 {
        let again = run()?;
        for (i, (a, b)) in first.iter().zip(&again).enumerate() {
            if a.iter().zip(b).any(|(p, q)| p.to_bits() != q.to_bits()) {
                return Err(format!("output {i} differs between two runs on the same inputs"));
            }
        }
    }
    Ok(())
}

/// Mixed dtypes are a typed error naming the parts, never a panic or a silent cast.
fn errors(dev: &Device) -> Result<(), String> {
    let x = tensor(dev, &[1.0; 12], &[3, 4], DType::BF16)?;
    let w = tensor(dev, &[1.0; 8], &[2, 4], DType::BF16)?;
    let wf16 = tensor(dev, &[1.0; 8], &[2, 4], DType::F16)?;
    let wf32 = tensor(dev, &[1.0; 8], &[2, 4], DType::F32)?;
    let bf32 = tensor(dev, &[1.0; 2], &[2], DType::F32)?;
    let invalid = |r: Result<Tensor, Error>, want: &str| match r {
        Err(Error::InvalidArgument { message, .. }) if message.contains(want) => Ok(()),
        other => Err(format!("expected an InvalidArgument containing {want:?}, got {:?}", other.map(|t| t.dtype()))),
    };
    invalid(ops::linear(&x, &wf16, None, Activation::Relu), "x is BF16 but weight is F16")?;
    invalid(ops::linear(&x, &wf32, None, Activation::Identity), "x is BF16 but weight is F32")?;
    invalid(ops::linear(&x, &w, Some(&bf32), Activation::Gelu), "x is BF16 but bias is F32")?;
    invalid(ops::linear_train(&x, &w, Some(&bf32), Activation::Gelu).map(|r| r.0), "bias is F32")?;
    let (y, saved) = ops::linear_train(&x, &w, None, Activation::Gelu).map_err(e)?;
    let dy32 = tensor(dev, &[1.0; 6], &[3, 2], DType::F32)?;
    invalid(ops::linear_backward(&x, &w, &y, &saved, &dy32, None).map(|g| g.x), "dy must be BF16")?;
    Ok(())
}

fn main() -> ExitCode {
    let tests = vec![
        test("linear_tc/forward_backward", forward_backward),
        test("linear_tc/every_activation", every_activation),
        test("linear_tc/empty_shapes", empty_shapes),
        test("linear_tc/deterministic", deterministic),
        test("linear_tc/errors", errors),
    ];
    run(tests)
}
