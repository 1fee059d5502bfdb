//! GPU tests of the gated activations `act(a) * b` (SwiGLU, GeGLU, GLU, ReGLU and every other
//! activation): the fused input `[.., 2F]` (`ops::glu`) and two tensors (`ops::glu2`), forward
//! and backward, in f32, f16 and bf16, against f64 references (tests/common/reference.rs) on
//! random shapes (rows from 0, F from 0, primes, multiples and not of the vector width, long
//! rows) and values that include ±0, ±inf, NaN, denormals and huge magnitudes. Gradients are also
//! checked against finite differences of the f64 forward. Outputs start as NaN (poisoned
//! allocations or NaN-filled `out` tensors), so an unwritten element fails.

mod common;

use common::reference as r;
use common::*;
use kernels::ops::{self, Activation};
use kernels::{DType, Device, Error, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

fn same_bits(x: &[f32], y: &[f32]) -> bool {
    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()))
}

/// Finite differences checked per case, at most (each is a few dozen f64 evaluations).
const FD_MAX: usize = 2000;

/// One case: `lead` leading dimensions of `rows` rows in total and `f` outputs a row.
fn case(dev: &Device, act: Activation, dt: DType, lead: &[usize], f: usize, seed: u64) -> Result<(), String> {
    let rows: usize = lead.iter().product();
    let n = rows * f;
    let mut rng = TestRng::new(seed);
    let xs = draw(&mut rng, 2 * n, dt, Draw::NORMAL);
    let gs = draw(&mut rng, n, dt, Draw { scale: 1.0, positive: false, special: 0.02 });
    // Element i = (row, col) of the output: a and b at (row, col) and (row, f + col) of x.
    let ia = |i: usize| (i / f.max(1)) * 2 * f + i % f.max(1);
    let (av, bv) = (|i: usize| xs[ia(i)], |i: usize| xs[ia(i) + f]);
    let (a64, b64, g64) = (|i: usize| av(i) as f64, |i: usize| bv(i) as f64, |i: usize| gs[i] as f64);
    let shape_x = [lead, &[2 * f]].concat();
    let shape_y = [lead, &[f]].concat();
    let x = tensor(dev, &xs, &shape_x, dt)?;
    let g = tensor(dev, &gs, &shape_y, dt)?;
    let (ah, bh): (Vec<f32>, Vec<f32>) = (0..n).map(|i| (av(i), bv(i))).unzip();
    let (at, bt) = (tensor(dev, &ah, &shape_y, dt)?, tensor(dev, &bh, &shape_y, dt)?);
    let show = |i: usize| format!("[{i}] of {shape_y:?}: a = {:e}, b = {:e}, g = {:e}", av(i), bv(i), gs[i]);
    let (k, p0, p1) = act.kernel();

    // Forward: the fused input, into a NaN-filled `out`, and two tensors: the same bits.
    let yt = ops::glu(&x, act).map_err(e)?;
    if yt.shape() != shape_y.as_slice() {
        return Err(format!("glu({act:?}): shape {:?} of x {shape_x:?}, expected {shape_y:?}", yt.shape()));
    }
    let y = yt.to_f32_vec().map_err(e)?;
    let want: Vec<f64> = (0..n).map(|i| r::glu_fwd(act, a64(i), b64(i))).collect();
    let tol = |i: usize| r::glu_fwd_tol(act, a64(i), b64(i));
    let emul = |i: usize| at_extremes(&[av(i), bv(i)], || k.glu_fwd_f32(av(i), bv(i), p0, p1));
    compare(&format!("glu({act:?}) forward {shape_x:?}"), dt, &y, &want, tol, emul, show)?;
    let mut out = nan_tensor(dev, &shape_y, dt)?;
    ops::glu_out(&x, act, &mut out).map_err(e)?;
    let y2 = ops::glu2(&at, &bt, act).map_err(e)?;
    let mut out2 = nan_tensor(dev, &shape_y, dt)?;
    ops::glu2_out(&at, &bt, act, &mut out2).map_err(e)?;
    for (what, t) in [("glu_out", &out), ("glu2", &y2), ("glu2_out", &out2)] {
        if !same_bits(&t.to_f32_vec().map_err(e)?, &y) {
            return Err(format!("glu({act:?}) {shape_x:?}: {what} differs from glu"));
        }
    }

    // Backward: d/da in the first half of each row of dx, d/db in the second.
    let dx = ops::glu_backward(&x, &g, act).map_err(e)?;
    if dx.shape() != shape_x.as_slice() {
        return Err(format!("glu_backward({act:?}): shape {:?}, expected {shape_x:?}", dx.shape()));
    }
    let dx = dx.to_f32_vec().map_err(e)?;
    let (da, db): (Vec<f32>, Vec<f32>) = (0..n).map(|i| (dx[ia(i)], dx[ia(i) + f])).unzip();
    let refs: Vec<(f64, f64)> = (0..n).map(|i| r::glu_bwd(act, a64(i), b64(i), g64(i))).collect();
    let tols = |i: usize| r::glu_bwd_tol(act, a64(i), b64(i), g64(i));
    let em = |i: usize| at_extremes(&[av(i), bv(i), gs[i]], || 0.0).map(|_| k.glu_bwd_f32(av(i), bv(i), gs[i], p0, p1));
    let want_a: Vec<f64> = refs.iter().map(|p| p.0).collect();
    let want_b: Vec<f64> = refs.iter().map(|p| p.1).collect();
    compare(&format!("glu({act:?}) d/da {shape_x:?}"), dt, &da, &want_a, |i| tols(i).0, |i| em(i).map(|p| p.0), show)?;
    compare(&format!("glu({act:?}) d/db {shape_x:?}"), dt, &db, &want_b, |i| tols(i).1, |i| em(i).map(|p| p.1), show)?;
    let mut dx_out = nan_tensor(dev, &shape_x, dt)?;
    ops::glu_backward_out(&x, &g, act, &mut dx_out).map_err(e)?;
    if !same_bits(&dx_out.to_f32_vec().map_err(e)?, &dx) {
        return Err(format!("glu({act:?}) {shape_x:?}: glu_backward_out differs from glu_backward"));
    }
    let (ga, gb) = ops::glu2_backward(&at, &bt, &g, act).map_err(e)?;
    let (mut oa, mut ob) = (nan_tensor(dev, &shape_y, dt)?, nan_tensor(dev, &shape_y, dt)?);
    ops::glu2_backward_out(&at, &bt, &g, act, &mut oa, &mut ob).map_err(e)?;
    for (what, t, w) in
        [("glu2_backward da", &ga, &da), ("glu2_backward db", &gb, &db), ("da out", &oa, &da), ("db out", &ob, &db)]
    {
        if !same_bits(&t.to_f32_vec().map_err(e)?, w) {
            return Err(format!("glu({act:?}) {shape_x:?}: {what} differs from glu_backward"));
        }
    }

    // Central finite differences of the f64 forward: the analytic reference must agree with
    // them, and so must the GPU's gradients (within their own tolerance plus the FD error).
    for i in (0..n).take(FD_MAX) {
        let Some((fa, fb)) = r::glu_finite_difference(act, a64(i), b64(i)) else { continue };
        let gv = g64(i);
        if !gv.is_finite() {
            continue;
        }
        let (ra, rb) = r::glu_bwd(act, a64(i), b64(i), 1.0);
        let (err_a, err_b) = (1e-5 * (1.0 + fa.abs()) * b64(i).abs().max(1.0), 1e-5 * (1.0 + fb.abs()));
        if (ra - fa).abs() > err_a || (rb - fb).abs() > err_b {
            return Err(format!(
                "glu({act:?}): reference derivatives ({ra:e}, {rb:e}) != finite differences ({fa:e}, {fb:e}) at {}",
                show(i)
            ));
        }
        let (ta, tb) = tols(i);
        let widen = |t: Tol, err: f64| Tol { rtol: t.rtol, atol: t.atol + err * gv.abs() };
        let blown = em(i).is_some_and(|(p, q)| !p.is_finite() || !q.is_finite());
        if !blown && !(close(dt, da[i], gv * fa, widen(ta, err_a)) && close(dt, db[i], gv * fb, widen(tb, err_b))) {
            return Err(format!(
                "glu({act:?}): GPU gradients ({:e}, {:e}) != g * finite differences ({:e}, {:e}) at {}",
                da[i],
                db[i],
                gv * fa,
                gv * fb,
                show(i)
            ));
        }
    }
    Ok(())
}

/// Row counts and F: empty, single, primes, multiples of the vector widths (4 and 8 elements)
/// and not, and long rows.
fn glu_shapes() -> impl Strategy<Value = (usize, usize)> {
    let f = prop_oneof![
        Just(0usize),
        Just(1),
        Just(2),
        Just(3),
        Just(4),
        Just(7),
        Just(8),
        Just(9),
        Just(16),
        Just(31),
        Just(64),
        Just(97),
        Just(1000),
        Just(1024),
        Just(4097),
        1usize..600
    ];
    let rows = prop_oneof![Just(0usize), Just(1), Just(2), Just(5), Just(8), Just(9), Just(33), 1usize..300];
    (rows, f)
}

/// Bad arguments are errors naming the op, not panics or launches.
fn argument_errors(dev: &Device) -> Result<(), String> {
    let x = Tensor::zeros(dev, &[4, 6], DType::F32).map_err(e)?;
    let odd = Tensor::zeros(dev, &[4, 5], DType::F32).map_err(e)?;
    let scalar = Tensor::zeros(dev, &[], DType::F32).map_err(e)?;
    let a = Tensor::zeros(dev, &[4, 3], DType::F32).map_err(e)?;
    let at = Tensor::zeros(dev, &[3, 4], DType::F32).map_err(e)?;
    let ah = Tensor::zeros(dev, &[4, 3], DType::BF16).map_err(e)?;
    let act = Activation::Silu;
    let expect = |r: Result<(), Error>, what: &str, pat: fn(&Error) -> bool| match r {
        Err(err) if pat(&err) => {
            let msg = err.to_string();
            if msg.is_empty() { Err(format!("{what}: empty message")) } else { Ok(()) }
        }
        other => Err(format!("{what}: expected an error, got {other:?}")),
    };
    let invalid = |e: &Error| matches!(e, Error::InvalidArgument { .. });
    let shape = |e: &Error| matches!(e, Error::ShapeMismatch { .. });
    let dtype = |e: &Error| matches!(e, Error::DTypeMismatch { .. });
    expect(ops::glu(&odd, act).map(drop), "odd last dimension", invalid)?;
    expect(ops::glu(&scalar, act).map(drop), "scalar", invalid)?;
    expect(ops::glu_backward(&odd, &a, act).map(drop), "odd last dimension (backward)", invalid)?;
    expect(ops::glu_backward(&x, &at, act).map(drop), "gradient shape", shape)?;
    expect(ops::glu_backward(&x, &x, act).map(drop), "gradient of x's shape", shape)?;
    expect(ops::glu_backward(&x, &ah, act).map(drop), "gradient dtype", dtype)?;
    let mut wrong = Tensor::zeros(dev, &[4, 6], DType::F32).map_err(e)?;
    expect(ops::glu_out(&x, act, &mut wrong), "output shape", shape)?;
    let mut wrong_dt = Tensor::zeros(dev, &[4, 3], DType::F16).map_err(e)?;
    expect(ops::glu_out(&x, act, &mut wrong_dt), "output dtype", dtype)?;
    expect(ops::glu2(&a, &at, act).map(drop), "glu2 shapes", shape)?;
    expect(ops::glu2(&a, &ah, act).map(drop), "glu2 dtypes", dtype)?;
    expect(ops::glu2_backward(&a, &a, &at, act).map(drop), "glu2 gradient shape", shape)?;
    expect(ops::glu2_backward(&a, &ah, &a, act).map(drop), "glu2_backward dtypes", dtype)?;
    let soft0 = Activation::Softplus { beta: 0.0, threshold: 20.0 };
    expect(ops::glu(&x, soft0).map(drop), "softplus beta 0", invalid)?;
    expect(ops::glu2_backward(&a, &a, &a, soft0).map(drop), "softplus beta 0 (backward)", invalid)?;
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for dt in DType::ALL {
        for act in activations() {
            tests.push(test(format!("glu/{dt:?}/{act:?}"), move |dev: &Device| {
                prop(16, (glu_shapes(), any::<u64>()), |((rows, f), seed)| case(dev, act, dt, &[rows], f, seed))
            }));
        }
    }
    tests.push(test("glu/shapes", |dev: &Device| {
        // Leading dimensions, and rows long against a block (the grid's x covers a row in
        // several blocks) in every dtype, aligned (a multiple of 8) and not; LLM widths with a
        // few rows. Under compute-sanitizer, the small ones.
        let big: &[(&[usize], usize)] = &[(&[3, 5], 11008), (&[2], 14336), (&[1], 65_536 + 3), (&[7], 5504)];
        let small: &[(&[usize], usize)] = &[(&[3, 5], 8), (&[2, 1, 3], 13), (&[0, 4], 8), (&[4, 0], 3)];
        for dt in DType::ALL {
            for act in [Activation::Silu, Activation::Gelu, Activation::GeluTanh, Activation::Sigmoid, Activation::Relu]
            {
                for (i, &(lead, f)) in small.iter().chain(if sanitizer() { &[][..] } else { big }).enumerate() {
                    case(dev, act, dt, lead, f, (i * 31 + f) as u64)?;
                }
            }
        }
        Ok(())
    }));
    if !sanitizer() {
        tests.push(test("glu/many_rows", |dev: &Device| {
            // More rows than the grid's 65535 blocks in y cover: rows of 256 vectors (f32) take
            // blocks of one row, so 65540 rows are the kernels' loop over rows, in the vector
            // path (1024 columns) and the element path (1021).
            case(dev, Activation::Silu, DType::F32, &[65_540], 1024, 5)?;
            case(dev, Activation::Gelu, DType::F32, &[65_540], 1021, 6)
        }));
    }
    tests.push(test("glu/errors", argument_errors));
    run(tests)
}
