//! GPU tests of the element-wise family: every unary op and activation, binary ops, row
//! broadcasts and the fused `act(x * scale + bias)`, forward and backward, in f32, f16 and bf16,
//! against f64 references (tests/common/reference.rs), on random shapes and values that include
//! ±0, ±inf, NaN, denormals and huge magnitudes. Backward passes are also checked against
//! central finite differences of the f64 forward. Outputs start as NaN (poisoned allocations or
//! NaN-filled `out` tensors), so an unwritten element fails.

mod common;

use common::reference::{self as r, U};
use common::*;
use kernels::ops::{self, Activation, BinaryOp, UnaryOp};
use kernels::{DType, Device, Error, Tensor};
use kernels_gpu::ops::OutputGrad;
use proptest::prelude::*;
use std::process::ExitCode;

fn fwd_case(dev: &Device, op: UnaryOp, draw_: Draw, dt: DType, n: usize, seed: u64) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let xs = draw(&mut rng, n, dt, draw_);
    let x = tensor(dev, &xs, &[n], dt)?;
    let want: Vec<f64> = xs.iter().map(|&v| r::unary_fwd(op, v as f64)).collect();
    let tol = |i: usize| r::unary_fwd_tol(op, xs[i] as f64);
    let show = |i: usize| format!("x = {:e}", xs[i]);

    // Out-of-place (poisoned allocation), into a NaN-filled `out`, and in place: the same bits.
    let y = ops::unary(&x, op).map_err(e)?.to_f32_vec().map_err(e)?;
    let (k, a, b) = op.kernel();
    let emul = |i: usize| at_extremes(&[xs[i]], || k.fwd_f32(xs[i], a, b));
    compare(&format!("{op:?} forward"), dt, &y, &want, tol, emul, show)?;
    let mut out = nan_tensor(dev, &[n], dt)?;
    ops::unary_out(&x, op, &mut out).map_err(e)?;
    let mut xi = x.try_clone().map_err(e)?;
    ops::unary_(&mut xi, op).map_err(e)?;
    for (what, t) in [("unary_out", &out), ("unary_ (in place)", &xi)] {
        let got = t.to_f32_vec().map_err(e)?;
        if got.iter().zip(&y).any(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(format!("{op:?}: {what} differs from unary"));
        }
    }
    Ok(())
}

fn bwd_case(dev: &Device, op: UnaryOp, draw_: Draw, dt: DType, n: usize, seed: u64) -> Result<(), String> {
    bwd_check(dev, op, draw_, dt, n, seed, true)
}

/// [`bwd_case`], with the finite differences (`fd`) or without (the analytic f64 derivative
/// alone, which they check; for sizes where a difference quotient per element is slow).
fn bwd_check(dev: &Device, op: UnaryOp, draw_: Draw, dt: DType, n: usize, seed: u64, fd: bool) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let xs = draw(&mut rng, n, dt, draw_);
    let gs = draw(&mut rng, n, dt, Draw { scale: 1.0, positive: false, special: 0.02 });
    let x = tensor(dev, &xs, &[n], dt)?;
    let g = tensor(dev, &gs, &[n], dt)?;
    let gx = ops::unary_backward(&x, &g, op).map_err(e)?.to_f32_vec().map_err(e)?;
    let want: Vec<f64> = (0..n).map(|i| r::unary_bwd(op, xs[i] as f64, gs[i] as f64)).collect();
    let tol = |i: usize| r::unary_bwd_tol(op, xs[i] as f64, gs[i] as f64);
    let show = |i: usize| format!("x = {:e}, g = {:e}", xs[i], gs[i]);
    let (k, a, b) = op.kernel();
    let emul = |i: usize| at_extremes(&[xs[i], gs[i]], || k.bwd_f32(xs[i], gs[i], a, b));
    compare(&format!("{op:?} backward"), dt, &gx, &want, tol, emul, show)?;

    // Central finite differences of the f64 forward: the analytic reference must agree with
    // them, and so must the GPU's gradient (within its own tolerance plus the FD error).
    for i in (0..n).filter(|_| fd) {
        let (xv, gv) = (xs[i] as f64, gs[i] as f64);
        let Some(fd) = r::finite_difference(op, xv) else { continue };
        if !gv.is_finite() {
            continue;
        }
        let analytic = r::unary_bwd(op, xv, 1.0);
        let fd_err = 1e-5 * (1.0 + fd.abs());
        if (analytic - fd).abs() > fd_err {
            return Err(format!("{op:?}: reference derivative {analytic:e} != finite difference {fd:e} at x = {xv:e}"));
        }
        let t = r::unary_bwd_tol(op, xv, gv);
        let t = Tol { rtol: t.rtol, atol: t.atol + fd_err * gv.abs() };
        if !close(dt, gx[i], gv * fd, t) && !emul(i).is_some_and(|v| !v.is_finite()) {
            return Err(format!(
                "{op:?}: GPU gradient {:e} != g * finite difference {:e} at x = {xv:e}, g = {gv:e}",
                gx[i],
                gv * fd
            ));
        }
    }
    Ok(())
}

/// The backward from the output (`unary_backward_from_output`), with `y` the GPU's forward of
/// drawn `x`, as a caller keeps it: [`check_bwd_y`], the `out` variant bit for bit, and for the
/// ops that reuse their backward kernel from `x`, bit for bit against `unary_backward`.
fn bwd_y_case(
    dev: &Device,
    (op, draw_, kernel): (UnaryOp, Draw, Option<OutputGrad>),
    dt: DType,
    n: usize,
    seed: u64,
) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let xs = draw(&mut rng, n, dt, draw_);
    let gs = draw(&mut rng, n, dt, Draw { scale: 1.0, positive: false, special: 0.02 });
    let x = tensor(dev, &xs, &[n], dt)?;
    let g = tensor(dev, &gs, &[n], dt)?;
    let y = ops::unary(&x, op).map_err(e)?;
    let ys = y.to_f32_vec().map_err(e)?;
    let gx = ops::unary_backward_from_output(&y, &g, op).map_err(e)?.to_f32_vec().map_err(e)?;
    let mut out = nan_tensor(dev, &[n], dt)?;
    ops::unary_backward_from_output_out(&y, &g, op, &mut out).map_err(e)?;
    // Bit for bit, NaN for NaN: where the gradient passes, the first is `grad` itself and the
    // second a kernel's f32 round trip, which may give an f16/bf16 NaN another payload.
    let same = |a: &f32, b: &f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    if !out.to_f32_vec().map_err(e)?.iter().zip(&gx).all(|(a, b)| same(a, b)) {
        return Err(format!("{op:?}: unary_backward_from_output_out differs from unary_backward_from_output"));
    }

    check_bwd_y(op, kernel, dt, &xs, &ys, &gs, &gx)?;
    if kernel.is_none() {
        let from_x = ops::unary_backward(&x, &g, op).map_err(e)?.to_f32_vec().map_err(e)?;
        if let Some(i) = (0..n).find(|&i| !same(&from_x[i], &gx[i])) {
            return Err(format!("{op:?}: from y {:e}, from x {:e} at x = {:e}", gx[i], from_x[i], xs[i]));
        }
    }
    Ok(())
}

fn binary_case(dev: &Device, op: BinaryOp, dt: DType, n: usize, seed: u64) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let (xs, ys) = (draw(&mut rng, n, dt, Draw::NORMAL), draw(&mut rng, n, dt, Draw::NORMAL));
    let gs = draw(&mut rng, n, dt, Draw { scale: 1.0, positive: false, special: 0.02 });
    let (x, y, g) = (tensor(dev, &xs, &[n], dt)?, tensor(dev, &ys, &[n], dt)?, tensor(dev, &gs, &[n], dt)?);
    let show = |i: usize| format!("x = {:e}, y = {:e}, g = {:e}", xs[i], ys[i], gs[i]);
    let exact = |_| Tol { rtol: 0.0, atol: 0.0 };

    let want: Vec<f64> = (0..n).map(|i| r::binary_fwd(op, xs[i] as f64, ys[i] as f64)).collect();
    let out = ops::binary(&x, &y, op).map_err(e)?.to_f32_vec().map_err(e)?;
    let k = op.kernel();
    compare(
        &format!("{op:?} forward"),
        dt,
        &out,
        &want,
        exact,
        |i| at_extremes(&[xs[i], ys[i]], || k.fwd_f32(xs[i], ys[i])),
        show,
    )?;
    let mut o = nan_tensor(dev, &[n], dt)?;
    ops::binary_out(&x, &y, op, &mut o).map_err(e)?;
    let mut xi = x.try_clone().map_err(e)?;
    ops::binary_(&mut xi, &y, op).map_err(e)?;
    for t in [&o, &xi] {
        let got = t.to_f32_vec().map_err(e)?;
        if got.iter().zip(&out).any(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(format!("{op:?}: binary_out / binary_ differ from binary"));
        }
    }

    let (gx, gy) = ops::binary_backward(&x, &y, &g, op).map_err(e)?;
    let (gx, gy) = (gx.to_f32_vec().map_err(e)?, gy.to_f32_vec().map_err(e)?);
    let refs: Vec<(f64, f64)> = (0..n).map(|i| r::binary_bwd(op, xs[i] as f64, ys[i] as f64, gs[i] as f64)).collect();
    let tol = |i: usize| r::binary_bwd_tol(op, ys[i] as f64, gs[i] as f64);
    let em = |i: usize| at_extremes(&[xs[i], ys[i], gs[i]], || 0.0).map(|_| k.bwd_f32(xs[i], ys[i], gs[i]));
    compare(
        &format!("{op:?} d/dx"),
        dt,
        &gx,
        &refs.iter().map(|p| p.0).collect::<Vec<_>>(),
        |i| tol(i).0,
        |i| em(i).map(|p| p.0),
        show,
    )?;
    compare(
        &format!("{op:?} d/dy"),
        dt,
        &gy,
        &refs.iter().map(|p| p.1).collect::<Vec<_>>(),
        |i| tol(i).1,
        |i| em(i).map(|p| p.1),
        show,
    )
}

/// Column sums of `terms` (rows x cols) in f64, with the bound of an f32 summation of `rows`
/// terms (rows * U * sum |t|) plus the terms' own errors. `None` (not checked) for columns with
/// an extreme input (`extreme(i)`, where the f32 terms themselves may overflow; the element-wise
/// gradient of those is checked), non-finite terms or sums that overflow f32, where summation
/// order decides the outcome.
fn column_sums(
    rows: usize,
    cols: usize,
    extreme: impl Fn(usize) -> bool,
    term: impl Fn(usize) -> (f64, f64),
) -> Vec<Option<(f64, Tol)>> {
    (0..cols)
        .map(|c| {
            let (mut s, mut abs, mut err) = (0.0f64, 0.0f64, 0.0f64);
            for row in 0..rows {
                if extreme(row * cols + c) {
                    return None;
                }
                let (t, e) = term(row * cols + c);
                if !t.is_finite() {
                    return None;
                }
                s += t;
                abs += t.abs();
                err += e;
            }
            (abs < 1e30).then_some((s, Tol { rtol: 0.0, atol: rows as f64 * U * abs + err }))
        })
        .collect()
}

fn check_columns(what: &str, dt: DType, got: &[f32], want: &[Option<(f64, Tol)>]) -> Result<(), String> {
    for (c, w) in want.iter().enumerate() {
        if let Some((v, tol)) = w
            && !close(dt, got[c], *v, *tol)
        {
            return Err(format!("{what}: column {c}: got {:e}, want {v:e} (tol {tol:?})", got[c]));
        }
    }
    Ok(())
}

fn row_case(dev: &Device, op: BinaryOp, dt: DType, rows: usize, cols: usize, seed: u64) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let n = rows * cols;
    let xs = draw(&mut rng, n, dt, Draw::NORMAL);
    let bs = draw(&mut rng, cols, dt, Draw { scale: 2.0, positive: false, special: 0.02 });
    let gs = draw(&mut rng, n, dt, Draw::FINITE);
    let (x, b, g) =
        (tensor(dev, &xs, &[rows, cols], dt)?, tensor(dev, &bs, &[cols], dt)?, tensor(dev, &gs, &[rows, cols], dt)?);
    let show = |i: usize| format!("x = {:e}, row = {:e}", xs[i], bs[i % cols]);
    let exact = |_| Tol { rtol: 0.0, atol: 0.0 };

    let want: Vec<f64> = (0..n).map(|i| r::binary_fwd(op, xs[i] as f64, bs[i % cols] as f64)).collect();
    let y = ops::binary_row(&x, &b, op).map_err(e)?.to_f32_vec().map_err(e)?;
    let k = op.kernel();
    compare(
        &format!("{op:?} row forward"),
        dt,
        &y,
        &want,
        exact,
        |i| at_extremes(&[xs[i], bs[i % cols]], || k.fwd_f32(xs[i], bs[i % cols])),
        show,
    )?;
    let mut xi = x.try_clone().map_err(e)?;
    ops::binary_row_(&mut xi, &b, op).map_err(e)?;
    let mut out = nan_tensor(dev, &[rows, cols], dt)?;
    ops::binary_row_out(&x, &b, op, &mut out).map_err(e)?;
    for (what, t) in [("binary_row_", &xi), ("binary_row_out", &out)] {
        if t.to_f32_vec().map_err(e)?.iter().zip(&y).any(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(format!("{op:?}: {what} differs from binary_row"));
        }
    }

    let (gx, gb) = ops::binary_row_backward(&x, &b, &g, op).map_err(e)?;
    let (gx, gb) = (gx.to_f32_vec().map_err(e)?, gb.to_f32_vec().map_err(e)?);
    let tol = |i: usize| r::binary_bwd_tol(op, bs[i % cols] as f64, gs[i] as f64);
    let refs: Vec<(f64, f64)> =
        (0..n).map(|i| r::binary_bwd(op, xs[i] as f64, bs[i % cols] as f64, gs[i] as f64)).collect();
    let em = |i: usize| at_extremes(&[xs[i], bs[i % cols], gs[i]], || k.bwd_f32(xs[i], bs[i % cols], gs[i]).0);
    compare(
        &format!("{op:?} row d/dx"),
        dt,
        &gx,
        &refs.iter().map(|p| p.0).collect::<Vec<_>>(),
        |i| tol(i).0,
        em,
        show,
    )?;
    let sums = column_sums(
        rows,
        cols,
        |i| at_extremes(&[xs[i], bs[i % cols], gs[i]], || 0.0).is_some(),
        |i| (refs[i].1, tol(i).1.rtol * refs[i].1.abs() + tol(i).1.atol),
    );
    check_columns(&format!("{op:?} row d/drow"), dt, &gb, &sums)
}

fn fused_case(dev: &Device, act: Activation, dt: DType, rows: usize, cols: usize, seed: u64) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let n = rows * cols;
    let xs = draw(&mut rng, n, dt, Draw::NORMAL);
    let ss = draw(&mut rng, cols, dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let bs = draw(&mut rng, cols, dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let gs = draw(&mut rng, n, dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let x = tensor(dev, &xs, &[rows, cols], dt)?;
    let (s, b, g) =
        (tensor(dev, &ss, &[cols], dt)?, tensor(dev, &bs, &[cols], dt)?, tensor(dev, &gs, &[rows, cols], dt)?);
    // z = fma(x, s, b) is rounded once in f32 before the activation, to a point of
    // [z - |z| U, z + |z| U]: f's largest change over that interval (one-sided, so that a jump
    // such as Hardswish's derivative at -3 counts whole) adds to the activation's own bound.
    let z = |i: usize| xs[i] as f64 * ss[i % cols] as f64 + bs[i % cols] as f64;
    let spread = |f: &dyn Fn(f64) -> f64, z: f64| {
        let d = z.abs() * U;
        let v = (f(z + d) - f(z)).abs().max((f(z - d) - f(z)).abs());
        if v.is_finite() { v } else { 0.0 }
    };
    let show =
        |i: usize| format!("x = {:e}, scale = {:e}, bias = {:e}, g = {:e}", xs[i], ss[i % cols], bs[i % cols], gs[i]);

    let want: Vec<f64> = (0..n).map(|i| r::act_fwd(act, z(i))).collect();
    let tol = |i: usize| {
        let t = r::act_fwd_tol(act, z(i));
        Tol { rtol: t.rtol, atol: t.atol + spread(&|v| r::act_fwd(act, v), z(i)) }
    };
    let y = ops::scale_bias_act(&x, &s, &b, act).map_err(e)?.to_f32_vec().map_err(e)?;
    let (k, pa, pb) = act.kernel();
    let zf = |i: usize| xs[i].mul_add(ss[i % cols], bs[i % cols]);
    compare(
        &format!("scale_bias_act({act:?}) forward"),
        dt,
        &y,
        &want,
        tol,
        |i| at_extremes(&[xs[i], ss[i % cols], bs[i % cols]], || k.fwd_f32(zf(i), pa, pb)),
        show,
    )?;
    let mut xi = x.try_clone().map_err(e)?;
    ops::scale_bias_act_(&mut xi, &s, &b, act).map_err(e)?;
    if xi.to_f32_vec().map_err(e)?.iter().zip(&y).any(|(a, b)| a.to_bits() != b.to_bits()) {
        return Err(format!("{act:?}: scale_bias_act_ differs from scale_bias_act"));
    }

    let grads = ops::scale_bias_act_backward(&x, &s, &b, &g, act).map_err(e)?;
    let gx = grads.x.to_f32_vec().map_err(e)?;
    let (gsc, gbi) = (grads.scale.to_f32_vec().map_err(e)?, grads.bias.to_f32_vec().map_err(e)?);
    let dz = |i: usize| r::act_bwd(act, z(i), gs[i] as f64);
    let dz_err = |i: usize| {
        let t = r::act_bwd_tol(act, z(i), gs[i] as f64);
        t.rtol * dz(i).abs() + t.atol + spread(&|v| r::act_bwd(act, v, gs[i] as f64), z(i))
    };
    let want: Vec<f64> = (0..n).map(|i| dz(i) * ss[i % cols] as f64).collect();
    let tol = |i: usize| Tol { rtol: U, atol: dz_err(i) * (ss[i % cols] as f64).abs() };
    let em = |i: usize| {
        at_extremes(&[xs[i], ss[i % cols], bs[i % cols], gs[i]], || k.bwd_f32(zf(i), gs[i], pa, pb) * ss[i % cols])
    };
    compare(&format!("scale_bias_act({act:?}) d/dx"), dt, &gx, &want, tol, em, show)?;
    let extreme = |i: usize| at_extremes(&[xs[i], ss[i % cols], bs[i % cols], gs[i]], || 0.0).is_some();
    let gscale = column_sums(rows, cols, extreme, |i| {
        (dz(i) * xs[i] as f64, dz_err(i) * (xs[i] as f64).abs() + U * (dz(i) * xs[i] as f64).abs())
    });
    check_columns(&format!("scale_bias_act({act:?}) d/dscale"), dt, &gsc, &gscale)?;
    let gbias = column_sums(rows, cols, extreme, |i| (dz(i), dz_err(i)));
    check_columns(&format!("scale_bias_act({act:?}) d/dbias"), dt, &gbi, &gbias)
}

/// The bias gradient is a reduction: the same inputs must give the same bits every time.
fn determinism(dev: &Device) -> Result<(), String> {
    let x = Tensor::rand_normal(dev, &[4099, 1031], DType::F32, 0.0, 1.0, 7).map_err(e)?;
    let (s, b) = (
        Tensor::rand_normal(dev, &[1031], DType::F32, 1.0, 0.5, 8).map_err(e)?,
        Tensor::rand_normal(dev, &[1031], DType::F32, 0.0, 1.0, 9).map_err(e)?,
    );
    let g = Tensor::rand_normal(dev, &[4099, 1031], DType::F32, 0.0, 1.0, 10).map_err(e)?;
    let run = || -> Result<(Vec<u32>, Vec<u32>), String> {
        let gr = ops::scale_bias_act_backward(&x, &s, &b, &g, Activation::Gelu).map_err(e)?;
        let bits = |t: &Tensor| t.to_f32_vec().map(|v| v.iter().map(|f| f.to_bits()).collect());
        Ok((bits(&gr.scale).map_err(e)?, bits(&gr.bias).map_err(e)?))
    };
    let first = run()?;
    for _ in 0..3 {
        if run()? != first {
            return Err("scale_bias_act_backward is not bit-for-bit reproducible".into());
        }
    }
    Ok(())
}

/// Bad arguments are errors naming the op and shapes, not panics or launches.
fn argument_errors(dev: &Device) -> Result<(), String> {
    let a = Tensor::zeros(dev, &[4, 5], DType::F32).map_err(e)?;
    let b = Tensor::zeros(dev, &[5, 4], DType::F32).map_err(e)?;
    let h = Tensor::zeros(dev, &[4, 5], DType::BF16).map_err(e)?;
    let row4 = Tensor::zeros(dev, &[4], DType::F32).map_err(e)?;
    let expect = |r: Result<(), Error>, what: &str, pat: fn(&Error) -> bool| match r {
        Err(err) if pat(&err) => {
            let msg = err.to_string();
            if msg.is_empty() { Err(format!("{what}: empty message")) } else { Ok(()) }
        }
        other => Err(format!("{what}: expected an error, got {other:?}")),
    };
    expect(ops::binary(&a, &b, BinaryOp::Add).map(drop), "shape mismatch", |e| {
        matches!(e, Error::ShapeMismatch { .. })
    })?;
    expect(ops::binary(&a, &h, BinaryOp::Add).map(drop), "dtype mismatch", |e| {
        matches!(e, Error::DTypeMismatch { .. })
    })?;
    expect(ops::binary_row(&a, &row4, BinaryOp::Add).map(drop), "row length", |e| {
        matches!(e, Error::ShapeMismatch { .. })
    })?;
    expect(ops::unary_backward(&a, &b, Activation::Relu).map(drop), "grad shape", |e| {
        matches!(e, Error::ShapeMismatch { .. })
    })?;
    expect(ops::unary(&a, Activation::Softplus { beta: 0.0, threshold: 20.0 }).map(drop), "softplus beta 0", |e| {
        matches!(e, Error::InvalidArgument { .. })
    })?;
    for op in
        [UnaryOp::Abs, UnaryOp::Log, Activation::Gelu.into(), Activation::LeakyRelu { negative_slope: -0.3 }.into()]
    {
        expect(ops::unary_backward_from_output(&a, &a, op).map(drop), "no backward from the output", |e| {
            matches!(e, Error::InvalidArgument { op: "unary_backward_from_output", .. })
        })?;
    }
    expect(ops::unary_backward_from_output(&a, &b, Activation::Sigmoid).map(drop), "grad shape from y", |e| {
        matches!(e, Error::ShapeMismatch { .. })
    })?;
    expect(ops::unary_backward_from_output(&a, &h, Activation::Tanh).map(drop), "grad dtype from y", |e| {
        matches!(e, Error::DTypeMismatch { .. })
    })?;
    expect(a.to_vec::<half::f16>().map(drop), "to_vec dtype", |e| matches!(e, Error::DTypeMismatch { .. }))?;
    expect(Tensor::from_slice(dev, &[1.0f32; 3], &[2, 2]).map(drop), "from_slice length", |e| {
        matches!(e, Error::InvalidArgument { .. })
    })?;
    expect(Tensor::zeros(dev, &[usize::MAX, 2], DType::F32).map(drop), "overflowing shape", |e| {
        matches!(e, Error::InvalidArgument { .. })
    })?;
    expect(Tensor::zeros(dev, &[1 << 50], DType::F32).map(drop), "allocation beyond memory", |e| {
        matches!(e, Error::OutOfMemory { .. })
    })?;
    Ok(())
}

/// Empty tensors and a zero-row matrix: no launch, correct empty or zero results.
fn empty_tensors(dev: &Device) -> Result<(), String> {
    for dt in DType::ALL {
        let x = Tensor::zeros(dev, &[0, 7], dt).map_err(e)?;
        let row = Tensor::rand_normal(dev, &[7], dt, 0.0, 1.0, 3).map_err(e)?;
        if ops::unary(&x, UnaryOp::Exp).map_err(e)?.numel() != 0 {
            return Err("exp of an empty tensor is not empty".into());
        }
        let (gx, gb) = ops::binary_row_backward(&x, &row, &x, BinaryOp::Mul).map_err(e)?;
        if gx.numel() != 0 || gb.to_f32_vec().map_err(e)? != vec![0.0; 7] {
            return Err("the row gradient over zero rows must be zeros".into());
        }
    }
    Ok(())
}

/// Gradients equal to the incoming one are that tensor, sharing its memory (as PyTorch's
/// autograd passes it on), and a write through either tensor copies first: the other keeps its
/// values (copy-on-write), whether the write is in place, into an `out` tensor or a fill.
fn shared_gradients(dev: &Device) -> Result<(), String> {
    let bits = |t: &Tensor| -> Result<Vec<u32>, String> {
        Ok(t.to_f32_vec().map_err(e)?.iter().map(|f| f.to_bits()).collect())
    };
    let scaled = |v: &[f32], k: f32| -> Vec<u32> { v.iter().map(|f| (f * k).to_bits()).collect() };
    for dt in DType::ALL {
        let n = 4097;
        let x = Tensor::rand_normal(dev, &[n], dt, 0.0, 1.0, 11).map_err(e)?;
        let y = Tensor::rand_normal(dev, &[n], dt, 0.0, 1.0, 12).map_err(e)?;
        let g = Tensor::rand_normal(dev, &[n], dt, 0.0, 1.0, 13).map_err(e)?;
        let (gv, g_bits) = (g.to_f32_vec().map_err(e)?, bits(&g)?);
        let unchanged = |what: &str| -> Result<(), String> {
            if bits(&g)? != g_bits { Err(format!("{dt:?}: {what} changed the incoming gradient")) } else { Ok(()) }
        };

        let (ga, gb) = ops::binary_backward(&x, &y, &g, BinaryOp::Add).map_err(e)?;
        let (mut sa, sb) = ops::binary_backward(&x, &y, &g, BinaryOp::Sub).map_err(e)?;
        let mut pa = ops::unary_backward(&x, &g, UnaryOp::AddScalar(1.5)).map_err(e)?;
        if !(ga.shares_memory(&g) && gb.shares_memory(&g) && sa.shares_memory(&g) && pa.shares_memory(&g)) {
            return Err(format!("{dt:?}: add / sub / add_scalar gradients do not share the incoming one"));
        }
        if sb.shares_memory(&g) || bits(&sb)? != scaled(&gv, -1.0) {
            return Err(format!("{dt:?}: sub's grad_b is not a new tensor holding -grad"));
        }
        // In place on a shared gradient.
        ops::unary_(&mut sa, UnaryOp::MulScalar(2.0)).map_err(e)?;
        unchanged("unary_ on sub's grad_a")?;
        if sa.shares_memory(&g) || bits(&sa)? != scaled(&gv, 2.0) {
            return Err(format!("{dt:?}: an in-place op on a shared gradient did not get its own copy"));
        }
        // Into a shared `out`, and a fill.
        ops::unary_out(&x, UnaryOp::Neg, &mut pa).map_err(e)?;
        unchanged("unary_out into add_scalar's gradient")?;
        if bits(&pa)? != scaled(&x.to_f32_vec().map_err(e)?, -1.0) {
            return Err(format!("{dt:?}: unary_out into a shared tensor wrote the wrong values"));
        }
        let mut h = ga.clone();
        h.fill_(3.0).map_err(e)?;
        unchanged("fill_ of a clone")?;
        if h.to_f32_vec().map_err(e)? != vec![3.0; n] || bits(&gb)? != g_bits {
            return Err(format!("{dt:?}: fill_ of a clone"));
        }
        // A write to the original leaves its clones.
        let mut g2 = g.clone();
        ops::unary_(&mut g2, UnaryOp::Neg).map_err(e)?;
        if bits(&ga)? != g_bits || bits(&g2)? != scaled(&gv, -1.0) {
            return Err(format!("{dt:?}: writing the original changed its clones"));
        }
        if g.try_clone().map_err(e)?.shares_memory(&g) {
            return Err("try_clone shares memory".into());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for dt in DType::ALL {
        for (op, d) in unary_ops() {
            tests.push(test(format!("unary/fwd/{dt:?}/{op:?}/{}", d.positive), move |dev: &Device| {
                prop(24, (sizes(), any::<u64>()), |(n, seed)| fwd_case(dev, op, d, dt, n, seed))
            }));
            tests.push(test(format!("unary/bwd/{dt:?}/{op:?}/{}", d.positive), move |dev: &Device| {
                prop(24, (sizes(), any::<u64>()), |(n, seed)| bwd_case(dev, op, d, dt, n, seed))
            }));
        }
        for case in output_grad_ops() {
            tests.push(test(format!("unary/bwd_y/{dt:?}/{:?}", case.0), move |dev: &Device| {
                prop(24, (sizes(), any::<u64>()), |(n, seed)| bwd_y_case(dev, case, dt, n, seed))
            }));
        }
        for op in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div] {
            tests.push(test(format!("binary/{dt:?}/{op:?}"), move |dev: &Device| {
                prop(24, (sizes(), any::<u64>()), |(n, seed)| binary_case(dev, op, dt, n, seed))
            }));
            tests.push(test(format!("binary_row/{dt:?}/{op:?}"), move |dev: &Device| {
                prop(16, (matrix_shapes(), any::<u64>()), |((rows, cols), seed)| {
                    row_case(dev, op, dt, rows, cols, seed)
                })
            }));
        }
        for act in activations() {
            tests.push(test(format!("scale_bias_act/{dt:?}/{act:?}"), move |dev: &Device| {
                prop(16, (matrix_shapes(), any::<u64>()), |((rows, cols), seed)| {
                    fused_case(dev, act, dt, rows, cols, seed)
                })
            }));
        }
    }
    tests.push(test("scale_bias_act/row_fwd_paths", |dev: &Device| {
        // The forward's three loops, each once in every dtype: rows of whole vectors with a
        // grid stride of whole rows (parameters loaded once a thread: 1024 columns), rows of
        // whole vectors whose grid cannot be made so (596 = 4 x 149 columns, a few rows), and
        // rows that are not whole vectors (33 columns).
        for dt in DType::ALL {
            for (rows, cols) in [(300usize, 1024usize), (3, 596), (5, 1192), (40, 33)] {
                for act in [Activation::Silu, Activation::Relu] {
                    fused_case(dev, act, dt, rows, cols, (rows * cols) as u64)?;
                }
                row_case(dev, BinaryOp::Add, dt, rows, cols, cols as u64)?;
            }
        }
        Ok(())
    }));
    // The random sizes (up to 300k elements) are small launches for most kernels, which run the
    // ops' `_small` entries: every op once more past the largest small launch, on its chunk
    // kernel (a vector a thread), in every dtype.
    if !sanitizer() {
        for dt in DType::ALL {
            tests.push(test(format!("unary_binary/chunks/{dt:?}"), move |dev: &Device| {
                // Half vectors of 8 bytes; small launches go up to one per thread of a wave of
                // at most 2048 resident threads an SM.
                let n = 8 / dt.size() * 8 * 256 * dev.sm_count() as usize + 13;
                for (i, (op, d)) in unary_ops().into_iter().enumerate() {
                    fwd_case(dev, op, d, dt, n, i as u64)?;
                    bwd_check(dev, op, d, dt, n, 100 + i as u64, false)?;
                }
                for (i, case) in output_grad_ops().into_iter().enumerate() {
                    bwd_y_case(dev, case, dt, n, 200 + i as u64)?;
                }
                for (i, op) in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div].into_iter().enumerate() {
                    binary_case(dev, op, dt, n, 300 + i as u64)?;
                }
                Ok(())
            }));
        }
    }
    tests.push(test("unary_binary/widths", |dev: &Device| {
        // The unary and binary launches' grids in every dtype: a small launch (the `_small`
        // entries, `launch::elementwise_small`: half vectors a thread, under one wave of resident
        // 128-thread blocks, at most 16 an SM), and the chunk kernels (`launch::elementwise_chunks`:
        // a vector a thread) past that in every dtype (16384 * sms elements are 4096 * sms f16/bf16
        // half vectors, twice the most resident threads) and at several waves. Odd sizes, so
        // every grid also has a tail. Under compute-sanitizer, the first two.
        let sms = dev.sm_count() as usize;
        let sizes = [100_003, 16384 * sms + 5, 65536 * sms + 13];
        for dt in DType::ALL {
            for &n in &sizes[..if sanitizer() { 2 } else { 3 }] {
                let seed = n as u64;
                fwd_case(dev, UnaryOp::Pow(2.5), Draw::NORMAL, dt, n, seed)?;
                fwd_case(dev, Activation::GeluTanh.into(), Draw::NORMAL, dt, n, seed + 1)?;
                bwd_case(dev, Activation::Silu.into(), Draw::NORMAL, dt, n, seed + 2)?;
                binary_case(dev, BinaryOp::Div, dt, n, seed + 3)?;
            }
        }
        Ok(())
    }));
    tests.push(test("determinism/scale_bias_act_backward", determinism));
    tests.push(test("errors/arguments", argument_errors));
    tests.push(test("errors/empty_tensors", empty_tensors));
    tests.push(test("backward/shared_gradients", shared_gradients));
    run(tests)
}
