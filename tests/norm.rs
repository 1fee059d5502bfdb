//! GPU tests of layer norm and RMS norm, forward and backward, in f32, f16 and bf16, against
//! f64 references (`common::reference`) on random shapes (row lengths chosen to hit every kernel:
//! register-resident, persistent, cluster, slices and streaming) and random values with
//! outliers. The f64 backward reference is itself checked against central finite differences of
//! the f64 forward. Outputs come from poisoned (NaN-filled) allocations, so an unwritten element
//! fails; determinism is checked by running twice and comparing bits.
//!
//! Tolerances. With `E = 2^-24` (f32 rounding) and `K = L + log2(n) + 16`, where `L` bounds the
//! values one thread adds in sequence (64 in registers; `8 * ceil(n / 1024)` streaming) and
//! `log2(n)` the depth of the group reduction: a sum of `n` terms has error at most `K E` times
//! the sum of their magnitudes (the 16 covers `exp`'s 2 ulp, the rescalings of the online
//! softmax and the final products). Each check below scales `K E` by the magnitudes that enter
//! the result; `close` adds one ulp of the storage type for f16/bf16 outputs.

mod common;

use common::reference::{norm_bwd_ref, norm_ref};
use common::rows::*;
use common::*;
use kernels::ops;
use kernels::{DType, Device, Error, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

/// What a norm's forward and backward gave, read back (f32).
struct Got {
    y: Vec<f32>,
    gx: Vec<f32>,
    rstd: Vec<f32>,
    mean: Option<Vec<f32>>,
    gw: Option<Vec<f32>>,
    gb: Option<Vec<f32>>,
}

impl Got {
    fn read(y: &Tensor, stats: &ops::NormStats, grads: &ops::NormGrads) -> Result<Got, String> {
        let opt = |t: Option<&Tensor>| t.map(|t| t.to_f32_vec()).transpose().map_err(e);
        Ok(Got {
            y: y.to_f32_vec().map_err(e)?,
            gx: grads.x.to_f32_vec().map_err(e)?,
            rstd: stats.rstd.to_f32_vec().map_err(e)?,
            mean: opt(stats.mean.as_ref())?,
            gw: opt(grads.weight.as_ref())?,
            gb: opt(grads.bias.as_ref())?,
        })
    }
}

/// The inputs of a norm case, as the GPU holds them (rounded to the dtype): the rows normalised
/// `xs`, the output's gradient `gs`, the weight and bias (used where `affine`), and for the fused
/// add the gradient `dh` flowing into `h = xs`, which the input's gradient carries on top.
struct Inputs<'a> {
    rows: usize,
    cols: usize,
    dt: DType,
    layer: bool,
    affine: bool,
    xs: &'a [f32],
    gs: &'a [f32],
    ws: &'a [f32],
    bs: &'a [f32],
    dh: Option<&'a [f32]>,
}

/// Checks what a norm gave (`got`, named `name`) against the f64 references of `inp`.
fn check_norm(name: &str, inp: &Inputs, got: &Got) -> Result<(), String> {
    let Inputs { rows, cols, dt, layer, affine, xs, gs, ws, bs, dh } = *inp;
    let eps = 1e-5f32;
    let k = k_of(cols) * E;
    let w64: Vec<f64> = ws.iter().map(|&v| v as f64).collect();
    let b64: Vec<f64> = bs.iter().map(|&v| v as f64).collect();
    let (w_opt, b_opt) =
        if affine { (Some(&w64[..]), if layer { Some(&b64[..]) } else { None }) } else { (None, None) };
    let (mut dw, mut db) = (vec![0.0f64; cols], vec![0.0f64; cols]);
    let (mut dw_mag, mut db_mag) = (vec![0.0f64; cols], vec![0.0f64; cols]);
    // The weight gradient's error from each row's xh (see dxh below).
    let mut dw_err = vec![0.0f64; cols];
    for r in 0..rows {
        let row = r * cols..(r + 1) * cols;
        let xr: Vec<f64> = xs[row.clone()].iter().map(|&v| v as f64).collect();
        let gr: Vec<f64> = gs[row.clone()].iter().map(|&v| v as f64).collect();
        let dr: Vec<f64> = dh.map_or(vec![0.0; cols], |d| d[row.clone()].iter().map(|&v| v as f64).collect());
        let (want, m, rs) = norm_ref(&xr, w_opt, b_opt, eps as f64, layer);
        let mean_abs = xr.iter().map(|v| v.abs()).sum::<f64>() / cols as f64;
        if !close(DType::F32, got.rstd[r], rs, tol(k * (1.0 + mean_abs * mean_abs * rs * rs), 0.0)) {
            return Err(format!("{name} {rows}x{cols} row {r}: rstd {} want {rs}", got.rstd[r]));
        }
        if let Some(mv) = &got.mean
            && !close(DType::F32, mv[r], m, tol(0.0, k * mean_abs))
        {
            return Err(format!("{name} {rows}x{cols} row {r}: mean {} want {m}", mv[r]));
        }
        // Error of y: of the mean (K E mean|x|) and of rstd (relative K E (1 + mean^2 rstd^2)),
        // times rstd and the weight, plus the roundings of the products.
        let rel_rstd = k * (1.0 + mean_abs * mean_abs * rs * rs);
        let t = |i: usize| {
            let wv = w_opt.map_or(1.0, |w| w[i]).abs();
            tol(
                4.0 * E,
                wv * rs * (k * mean_abs + rel_rstd * (xr[i] - m).abs()) + 4.0 * E * b_opt.map_or(0.0, |b| b[i].abs()),
            )
        };
        compare(
            &format!("{name} forward row {r} of {rows}x{cols}"),
            dt,
            &got.y[row.clone()],
            &want,
            t,
            |_| None,
            |i| format!("x = {:e}", xr[i]),
        )?;
        let nb = norm_bwd_ref(&xr, w_opt, &gr, eps as f64, layer);
        let want: Vec<f64> = (0..cols).map(|i| nb[i] + dr[i]).collect();
        let xh: Vec<f64> = xr.iter().map(|&v| (v - m) * rs).collect();
        let gw: Vec<f64> = (0..cols).map(|i| gr[i] * w_opt.map_or(1.0, |w| w[i])).collect();
        let s_gw = gw.iter().map(|v| v.abs()).sum::<f64>() / cols as f64;
        let s_gwxh = gw.iter().zip(&xh).map(|(a, b)| (a * b).abs()).sum::<f64>() / cols as f64;
        // xh = (x - mean) * rstd on the GPU carries the mean's error times rstd (absolute) and
        // rstd's (relative): |dxh| <= (k + rel_rstd) (mean|x| rstd + |xh|); it enters gx directly
        // and through the row sums of gw and gw * xh. With dh (the fused add), the norm's part
        // keeps its bound, 4 E relative to itself rather than to the sum (which may cancel), and
        // the f32 sum with dh rounds once more, 4 E relative to the sum.
        let dxh = |i: usize| (k + rel_rstd) * (mean_abs * rs + xh[i].abs());
        let t = |i: usize| {
            let sums = (k + rel_rstd) * (gw[i].abs() + s_gw + (1.0 + xh[i].abs()) * (s_gwxh + s_gw));
            tol(4.0 * E, rs * (sums * (1.0 + mean_abs * rs) + dxh(i) * s_gwxh) + 4.0 * E * nb[i].abs())
        };
        compare(
            &format!("{name} backward row {r} of {rows}x{cols}"),
            dt,
            &got.gx[row.clone()],
            &want,
            t,
            |_| None,
            |i| format!("x = {:e}, g = {:e}, dh = {:e}", xr[i], gr[i], dr[i]),
        )?;
        if r == 0 && cols <= 4096 {
            // The f64 reference against central differences of sum(y g) + sum(h dh) (the loss
            // through the norm and through the residual stream), in the rows' input.
            let f = |x: &[f64]| {
                let y = norm_ref(x, w_opt, b_opt, eps as f64, layer).0;
                (0..cols).map(|i| y[i] * gr[i] + x[i] * dr[i]).sum::<f64>()
            };
            let dmax = dr.iter().fold(0.0f64, |a, v| a.max(v.abs()));
            for i in [0, cols / 2, cols - 1] {
                check_fd(&format!("{name} d/dx[{i}]"), want[i], fd(&xr, i, f), rs * s_gw * cols as f64 + dmax)?;
            }
        }
        for i in 0..cols {
            dw[i] += gr[i] * xh[i];
            db[i] += gr[i];
            dw_mag[i] += (gr[i] * xh[i]).abs();
            dw_err[i] += gr[i].abs() * dxh(i);
            db_mag[i] += gr[i].abs();
        }
    }
    // Parameter gradients: column sums over the rows (sequential chains of at most `rows`).
    let kc = (rows as f64 + 16.0) * E + k;
    if let Some(got_w) = &got.gw {
        compare(
            &format!("{name} weight gradient {rows}x{cols}"),
            dt,
            got_w,
            &dw,
            |i| tol(0.0, kc * 2.0 * dw_mag[i] + dw_err[i]),
            |_| None,
            |i| format!("column {i}"),
        )?;
    } else if affine {
        return Err(format!("{name}: no weight gradient"));
    }
    if let Some(got_b) = &got.gb {
        compare(
            &format!("{name} bias gradient {rows}x{cols}"),
            dt,
            got_b,
            &db,
            |i| tol(0.0, kc * db_mag[i]),
            |_| None,
            |i| format!("column {i}"),
        )?;
    }
    if affine != got.gw.is_some() || (affine && layer) != got.gb.is_some() {
        return Err(format!("{name}: parameter gradients returned for parameters not given (or missing)"));
    }
    Ok(())
}

/// A norm case: `rows` rows of `values` moved by `shift` (2: a mean far from zero, so that
/// centring matters; 0: rows centred near zero, as transformer activations mostly are).
#[allow(clippy::too_many_arguments)]
fn norm_case(
    dev: &Device,
    rows: usize,
    cols: usize,
    dt: DType,
    layer: bool,
    affine: bool,
    seed: u64,
    shift: f32,
) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let n = rows * cols;
    let xs: Vec<f32> = values(&mut rng, n, dt).into_iter().map(|v| round_to(dt, v + shift)).collect();
    let gs = draw(&mut rng, n, dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let (ws, bs) = params(&mut rng, cols, dt);
    let x = tensor(dev, &xs, &[rows, cols], dt)?;
    let g = tensor(dev, &gs, &[rows, cols], dt)?;
    let w = tensor(dev, &ws, &[cols], dt)?;
    let b = tensor(dev, &bs, &[cols], dt)?;
    let eps = 1e-5f32;
    let name = if layer { "layer_norm" } else { "rms_norm" };
    let (wo, bo) = if affine { (Some(&w), if layer { Some(&b) } else { None }) } else { (None, None) };
    let (y, stats) = if layer { ops::layer_norm(&x, wo, bo, eps) } else { ops::rms_norm(&x, wo, eps) }.map_err(e)?;
    let grads = if layer {
        ops::layer_norm_backward(&x, wo, bo, &stats, &g)
    } else {
        ops::rms_norm_backward(&x, wo, &stats, &g)
    }
    .map_err(e)?;
    let inp = Inputs { rows, cols, dt, layer, affine, xs: &xs, gs: &gs, ws: &ws, bs: &bs, dh: None };
    check_norm(name, &inp, &Got::read(&y, &stats, &grads)?)?;
    // Determinism of the forward and of the column sums.
    let (y2, _) = if layer { ops::layer_norm(&x, wo, bo, eps) } else { ops::rms_norm(&x, wo, eps) }.map_err(e)?;
    if bits(&y2)? != bits(&y)? {
        return Err(format!("{name}: two forward runs differ"));
    }
    if let Some(gw) = &grads.weight {
        let again = if layer {
            ops::layer_norm_backward(&x, wo, bo, &stats, &g)
        } else {
            ops::rms_norm_backward(&x, wo, &stats, &g)
        }
        .map_err(e)?;
        if bits(again.weight.as_ref().unwrap())? != bits(gw)? {
            return Err(format!("{name}: two weight gradients differ"));
        }
    }
    Ok(())
}

/// A weight near 1 and a bias of `cols` values of `dt`.
fn params(rng: &mut TestRng, cols: usize, dt: DType) -> (Vec<f32>, Vec<f32>) {
    let ws: Vec<f32> = (0..cols).map(|_| round_to(dt, (1.0 + 0.5 * rng.normal()) as f32)).collect();
    let bs: Vec<f32> = (0..cols).map(|_| round_to(dt, rng.normal() as f32)).collect();
    (ws, bs)
}

/// `h = x + residual` as PyTorch's eager add computes it, and the kernels must (bit for bit): the
/// f32 sum of the two, rounded once to the dtype.
fn add_rounded(dt: DType, xs: &[f32], rs: &[f32]) -> Vec<f32> {
    xs.iter().zip(rs).map(|(&a, &r)| round_to(dt, a + r)).collect()
}

/// `h` as the GPU wrote it against [`add_rounded`]: the same bits (any NaN for a NaN).
fn check_h(what: &str, dt: DType, got: &[f32], want: &[f32], xs: &[f32], rs: &[f32]) -> Result<(), String> {
    let bad: Vec<usize> = (0..want.len())
        .filter(|&i| !(got[i].to_bits() == want[i].to_bits() || (got[i].is_nan() && want[i].is_nan())))
        .collect();
    if let Some(&i) = bad.first() {
        return Err(format!(
            "{what} ({dt:?}): h differs from x + residual at {} of {} elements; [{i}]: {:e} + {:e} gave {:e}, want {:e}",
            bad.len(),
            want.len(),
            xs[i],
            rs[i],
            got[i],
            want[i]
        ));
    }
    Ok(())
}

/// The fused residual add and norm, forward and backward: `x` of `values`, the residual of
/// `values` moved by `shift` (so that `h` has the plain case's mean), `h` bit for bit as
/// PyTorch's `x + residual`, `y` and the gradients checked as the norm of `h` ([`check_norm`])
/// with `dh` added to the input's gradient where `with_dh`; the in-place forward and `_out`
/// into NaN-filled tensors give the same bits, and so do two runs.
#[allow(clippy::too_many_arguments)]
fn add_norm_case(
    dev: &Device,
    rows: usize,
    cols: usize,
    dt: DType,
    layer: bool,
    affine: bool,
    with_dh: bool,
    seed: u64,
    shift: f32,
) -> Result<(), String> {
    let mut rng = TestRng::new(seed ^ 0xadd);
    let n = rows * cols;
    let xs = values(&mut rng, n, dt);
    let rs: Vec<f32> = values(&mut rng, n, dt).into_iter().map(|v| round_to(dt, v + shift)).collect();
    let gs = draw(&mut rng, n, dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let dhs = draw(&mut rng, n, dt, Draw { scale: 2.0, positive: false, special: 0.0 });
    let (ws, bs) = params(&mut rng, cols, dt);
    let shape = [rows, cols];
    let (x, res, g, dh) = (
        tensor(dev, &xs, &shape, dt)?,
        tensor(dev, &rs, &shape, dt)?,
        tensor(dev, &gs, &shape, dt)?,
        tensor(dev, &dhs, &shape, dt)?,
    );
    let (w, b) = (tensor(dev, &ws, &[cols], dt)?, tensor(dev, &bs, &[cols], dt)?);
    let eps = 1e-5f32;
    let name = if layer { "add_layer_norm" } else { "add_rms_norm" };
    let (wo, bo) = if affine { (Some(&w), if layer { Some(&b) } else { None }) } else { (None, None) };
    let fwd = |x: &Tensor, r: &Tensor| {
        if layer { ops::add_layer_norm(x, r, wo, bo, eps) } else { ops::add_rms_norm(x, r, wo, eps) }.map_err(e)
    };
    let dho = with_dh.then_some(&dh);
    let bwd = |out: &ops::AddNorm| {
        if layer {
            ops::add_layer_norm_backward(&out.h, wo, bo, &out.stats, &g, dho)
        } else {
            ops::add_rms_norm_backward(&out.h, wo, &out.stats, &g, dho)
        }
        .map_err(e)
    };
    let out = fwd(&x, &res)?;
    let grads = bwd(&out)?;
    let hs = add_rounded(dt, &xs, &rs);
    check_h(&format!("{name} {rows}x{cols}"), dt, &out.h.to_f32_vec().map_err(e)?, &hs, &xs, &rs)?;
    let inp =
        Inputs { rows, cols, dt, layer, affine, xs: &hs, gs: &gs, ws: &ws, bs: &bs, dh: with_dh.then_some(&dhs[..]) };
    check_norm(name, &inp, &Got::read(&out.y, &out.stats, &grads)?)?;
    // The same bits: a second run; `_out` into NaN-filled tensors; in place, over a copy of the
    // residual, while a clone sharing its memory keeps the old values.
    let again = fwd(&x, &res)?;
    let g2 = bwd(&again)?;
    let mut outs = ops::AddNorm {
        y: nan_tensor(dev, &shape, dt)?,
        h: nan_tensor(dev, &shape, dt)?,
        stats: ops::NormStats {
            mean: if layer { Some(nan_tensor(dev, &[rows], DType::F32)?) } else { None },
            rstd: nan_tensor(dev, &[rows], DType::F32)?,
        },
    };
    if layer {
        ops::add_layer_norm_out(&x, &res, wo, bo, eps, &mut outs)
    } else {
        ops::add_rms_norm_out(&x, &res, wo, eps, &mut outs)
    }
    .map_err(e)?;
    let mut inplace = res.clone();
    let (y3, st3) = if layer {
        ops::add_layer_norm_(&x, &mut inplace, wo, bo, eps)
    } else {
        ops::add_rms_norm_(&x, &mut inplace, wo, eps)
    }
    .map_err(e)?;
    let same = |what: &str, a: &Tensor, b: &Tensor| -> Result<(), String> {
        if bits(a)? != bits(b)? {
            return Err(format!("{name} {rows}x{cols} {dt:?}: {what} differs"));
        }
        Ok(())
    };
    same("y of a second run", &again.y, &out.y)?;
    same("the input's gradient of a second run", &g2.x, &grads.x)?;
    if let (Some(a), Some(b)) = (&g2.weight, &grads.weight) {
        same("the weight gradient of a second run", a, b)?;
    }
    same("_out's y", &outs.y, &out.y)?;
    same("_out's h", &outs.h, &out.h)?;
    same("_out's rstd", &outs.stats.rstd, &out.stats.rstd)?;
    same("the in-place y", &y3, &out.y)?;
    same("the in-place h", &inplace, &out.h)?;
    same("the in-place rstd", &st3.rstd, &out.stats.rstd)?;
    same("the residual, read by the in-place op through a clone", &res, &tensor(dev, &rs, &shape, dt)?)?;
    if !with_dh {
        // Without dh, the fused op's backward is the norm's of h.
        let plain = if layer {
            ops::layer_norm_backward(&out.h, wo, bo, &out.stats, &g)
        } else {
            ops::rms_norm_backward(&out.h, wo, &out.stats, &g)
        }
        .map_err(e)?;
        same("the backward without dh against the norm's", &plain.x, &grads.x)?;
    }
    Ok(())
}

/// Special values in `x` and the residual (±0, ±inf, NaN, denormals, the largest finite values,
/// whose sums overflow): `h` bit for bit; `y` non-finite wherever `h` is; each row whose `h` is
/// finite and moderate (squares within f32) checked as [`check_norm`] does, forward and backward
/// with `dh`. No weight: its gradient sums over every row, special ones included.
fn add_norm_specials(dev: &Device, dt: DType, layer: bool) -> Result<(), String> {
    let (rows, cols) = (64, 264);
    let mut rng = TestRng::new(99 + layer as u64);
    let n = rows * cols;
    // Every other row with 10% specials, the others without, so both kinds of row are seen.
    let draw_rows = |rng: &mut TestRng| -> Vec<f32> {
        (0..rows)
            .flat_map(|r| {
                let special = if r % 2 == 0 { 0.1 } else { 0.0 };
                draw(rng, cols, dt, Draw { scale: 3.0, positive: false, special })
            })
            .collect()
    };
    let xs = draw_rows(&mut rng);
    let rs = draw_rows(&mut rng);
    let gs = draw(&mut rng, n, dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let dhs = draw(&mut rng, n, dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let shape = [rows, cols];
    let (x, res) = (tensor(dev, &xs, &shape, dt)?, tensor(dev, &rs, &shape, dt)?);
    let (g, dh) = (tensor(dev, &gs, &shape, dt)?, tensor(dev, &dhs, &shape, dt)?);
    let name = if layer { "add_layer_norm" } else { "add_rms_norm" };
    let out =
        if layer { ops::add_layer_norm(&x, &res, None, None, 1e-5) } else { ops::add_rms_norm(&x, &res, None, 1e-5) }
            .map_err(e)?;
    let grads = if layer {
        ops::add_layer_norm_backward(&out.h, None, None, &out.stats, &g, Some(&dh))
    } else {
        ops::add_rms_norm_backward(&out.h, None, &out.stats, &g, Some(&dh))
    }
    .map_err(e)?;
    let hs = add_rounded(dt, &xs, &rs);
    check_h(&format!("{name} specials"), dt, &out.h.to_f32_vec().map_err(e)?, &hs, &xs, &rs)?;
    let got = Got::read(&out.y, &out.stats, &grads)?;
    let moderate = |v: &f32| v.is_finite() && v.abs() < 1e15;
    let mut checked = 0;
    for r in 0..rows {
        let row = r * cols..(r + 1) * cols;
        for i in row.clone() {
            if !hs[i].is_finite() && got.y[i].is_finite() {
                return Err(format!("{name} {dt:?} row {r}: h = {:e} but y = {:e}", hs[i], got.y[i]));
            }
        }
        if !hs[row.clone()].iter().all(moderate) {
            continue;
        }
        let one = |v: &[f32]| v[row.clone()].to_vec();
        let got_row = Got {
            y: one(&got.y),
            gx: one(&got.gx),
            rstd: vec![got.rstd[r]],
            mean: got.mean.as_ref().map(|m| vec![m[r]]),
            gw: None,
            gb: None,
        };
        let (hr, gr, dr) = (one(&hs), one(&gs), one(&dhs));
        let inp = Inputs { rows: 1, cols, dt, layer, affine: false, xs: &hr, gs: &gr, ws: &[], bs: &[], dh: Some(&dr) };
        check_norm(&format!("{name} {dt:?} specials row {r}"), &inp, &got_row)?;
        checked += 1;
    }
    if checked < rows / 2 {
        return Err(format!("{name} {dt:?}: only {checked} rows of moderate values were checked"));
    }
    Ok(())
}

fn norm_errors(dev: &Device) -> Result<(), String> {
    let x = Tensor::rand_normal(dev, &[4, 10], DType::F32, 0.0, 1.0, 1).map_err(e)?;
    let w = Tensor::full(dev, &[9], DType::F32, 1.0).map_err(e)?;
    if !matches!(ops::layer_norm(&x, Some(&w), None, 1e-5), Err(Error::ShapeMismatch { .. })) {
        return Err("a weight of the wrong length must be a shape error".into());
    }
    if !matches!(ops::rms_norm(&x, None, f32::NAN), Err(Error::InvalidArgument { .. })) {
        return Err("a NaN eps must be rejected".into());
    }
    let s = Tensor::full(dev, &[], DType::F32, 1.0).map_err(e)?;
    if !matches!(ops::softmax(&s), Err(Error::InvalidArgument { .. })) {
        return Err("softmax of a scalar (no last dimension) must be an error".into());
    }
    // Empty: no rows.
    let z = Tensor::zeros(dev, &[0, 7], DType::BF16).map_err(e)?;
    if ops::softmax(&z).map_err(e)?.shape() != [0, 7] {
        return Err("softmax of [0, 7] must be [0, 7]".into());
    }
    Ok(())
}

fn add_norm_errors(dev: &Device) -> Result<(), String> {
    let t = |shape: &[usize], dt: DType| Tensor::rand_normal(dev, shape, dt, 0.0, 1.0, 3).map_err(e);
    let x = t(&[4, 16], DType::F32)?;
    let w = t(&[16], DType::F32)?;
    if !matches!(ops::add_rms_norm(&x, &t(&[4, 8], DType::F32)?, Some(&w), 1e-5), Err(Error::ShapeMismatch { .. })) {
        return Err("a residual of another shape must be a shape error".into());
    }
    if !matches!(
        ops::add_layer_norm(&x, &t(&[4, 16], DType::BF16)?, None, None, 1e-5),
        Err(Error::DTypeMismatch { .. })
    ) {
        return Err("a residual of another dtype must be a dtype error".into());
    }
    let mut r = t(&[16, 4], DType::F32)?;
    if !matches!(ops::add_rms_norm_(&x, &mut r, None, 1e-5), Err(Error::ShapeMismatch { .. })) {
        return Err("an in-place residual of another shape must be a shape error".into());
    }
    if !matches!(ops::add_layer_norm(&x, &x, Some(&w), None, -1.0), Err(Error::InvalidArgument { .. })) {
        return Err("a negative eps must be rejected".into());
    }
    let out = ops::add_rms_norm(&x, &x, Some(&w), 1e-5).map_err(e)?;
    let bad_dh = t(&[4, 15], DType::F32)?;
    let r = ops::add_rms_norm_backward(&out.h, Some(&w), &out.stats, &x, Some(&bad_dh));
    if !matches!(r, Err(Error::ShapeMismatch { .. })) {
        return Err("a residual gradient of another shape must be a shape error".into());
    }
    let mut grads = ops::NormGrads { x: t(&[4, 16], DType::F32)?, weight: None, bias: Some(t(&[16], DType::F32)?) };
    let r = ops::add_rms_norm_backward_out(&out.h, Some(&w), &out.stats, &x, None, &mut grads);
    if !matches!(r, Err(Error::InvalidArgument { .. })) {
        return Err("a bias gradient of RMS norm must be rejected".into());
    }
    let r = ops::add_layer_norm_backward(&out.h, Some(&w), None, &out.stats, &x, None);
    if !matches!(r, Err(Error::InvalidArgument { .. })) {
        return Err("RMS norm statistics given to layer norm's backward must be rejected".into());
    }
    let empty_rows = t(&[3, 0], DType::F32)?;
    if !matches!(ops::add_rms_norm(&empty_rows, &empty_rows, None, 1e-5), Err(Error::InvalidArgument { .. })) {
        return Err("rows of length 0 must be an error, as for the norms".into());
    }
    // No rows: empty outputs, and zero parameter gradients (sums over nothing).
    for dt in DType::ALL {
        let z = Tensor::zeros(dev, &[0, 24], dt).map_err(e)?;
        let (w, b) = (t(&[24], dt)?, t(&[24], dt)?);
        let out = ops::add_layer_norm(&z, &z, Some(&w), Some(&b), 1e-5).map_err(e)?;
        if out.y.shape() != [0, 24] || out.h.shape() != [0, 24] {
            return Err(format!("{dt:?}: the fused norm of [0, 24] must give [0, 24]"));
        }
        let g = ops::add_layer_norm_backward(&out.h, Some(&w), Some(&b), &out.stats, &z, Some(&z)).map_err(e)?;
        for p in [g.weight, g.bias] {
            if p.ok_or("a parameter gradient is missing")?.to_f32_vec().map_err(e)?.iter().any(|&v| v != 0.0) {
                return Err(format!("{dt:?}: parameter gradients over no rows must be 0"));
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for (rows, cols) in paths() {
        tests.push(test(format!("norms/paths/{rows}x{cols}"), move |dev: &Device| {
            for dt in DType::ALL {
                for layer in [true, false] {
                    norm_case(dev, rows, cols, dt, layer, true, (rows + cols) as u64, 2.0)?;
                }
                norm_case(dev, rows, cols, dt, true, true, (rows * cols) as u64, 0.0)?;
            }
            Ok(())
        }));
    }
    tests.push(test("norms/few_rows_forward_vectors", |dev: &Device| {
        for (rows, cols, dt, want) in FEW_ROWS_FORWARD {
            for layer in [true, false] {
                let [k, _] = ops::norm_kernels(dev, layer, dt, rows as u64, cols as u64, true).map_err(e)?;
                if !k.contains(want) {
                    return Err(format!("{rows}x{cols} {dt:?} runs {k}, not {want}"));
                }
                norm_case(dev, rows, cols, dt, layer, true, (rows * cols) as u64, 2.0)?;
            }
        }
        Ok(())
    }));
    for layer in [true, false] {
        let name = if layer { "layer_norm" } else { "rms_norm" };
        tests.push(test(format!("{name}/random_shapes"), move |dev: &Device| {
            prop(
                40,
                (shapes(), dtype(), any::<bool>(), any::<u64>(), any::<bool>()),
                |((r, c), dt, affine, seed, far)| {
                    norm_case(dev, r, c, dt, layer, affine, seed, if far { 2.0 } else { 0.0 })
                },
            )
        }));
    }
    tests.push(test("layer_norm/large_mean", |dev: &Device| {
        // A mean far from zero against a unit spread: E[x^2] - mean^2 would lose every digit
        // of the variance here (x^2 ~ 1e8, its f32 rounding ~ 4), so this checks that the
        // variance is computed stably, in every path (registers at 1, 2, 4 and 8 vectors a
        // thread, and streaming: 1001 and 100003 columns are not whole vectors). It tells the
        // two apart in f32 only: f16/bf16 cannot store such a ratio (their spacing at 1e4 is
        // 8 and 64), so there the offset is 100 and the paths are checked at a modest one.
        let mut rng = TestRng::new(17);
        for dt in DType::ALL {
            for cols in [8usize, 64, 1000, 1001, 4096, 32768, 100003] {
                let rows = 3;
                let offset = if dt == DType::F32 { 1e4 } else { 100.0 };
                let xs: Vec<f32> = (0..rows * cols).map(|_| round_to(dt, (offset + rng.normal()) as f32)).collect();
                let x = tensor(dev, &xs, &[rows, cols], dt)?;
                let (_, stats) = ops::layer_norm(&x, None, None, 1e-5).map_err(e)?;
                let rstd = stats.rstd.to_f32_vec().map_err(e)?;
                let mean = stats.mean.as_ref().expect("layer norm saves the mean").to_f32_vec().map_err(e)?;
                for r in 0..rows {
                    let xr: Vec<f64> = xs[r * cols..(r + 1) * cols].iter().map(|&v| v as f64).collect();
                    let (_, m, rs) = norm_ref(&xr, None, None, 1e-5, true);
                    // The mean to 1e-5 of the offset (sums of 1e4-sized values). rstd: the
                    // two-pass variance is off by the square of the mean's error relative to
                    // the spread, (1e-7 x 1e4 x a few tens)^2 ~ 1e-4 at worst; E[x^2] - mean^2
                    // would be off by ~ f32 eps x 1e8 = 6 times the variance itself.
                    let rel = (rstd[r] as f64 - rs).abs() / rs;
                    if (mean[r] as f64 - m).abs() > 1e-5 * offset || rel > 1e-2 {
                        return Err(format!(
                            "{dt:?} {rows}x{cols} row {r}: mean {} rstd {} want {m} {rs} (relative {rel:e})",
                            mean[r], rstd[r]
                        ));
                    }
                }
            }
        }
        Ok(())
    }));
    tests.push(test("norms/many_rows_persistent", |dev: &Device| {
        // More rows than a wave of blocks: the persistent backward's loop and its partial sums.
        let rows = if sanitizer() { 300 } else { 20000 };
        for dt in DType::ALL {
            norm_case(dev, rows, 64, dt, true, true, 5, 2.0)?;
            norm_case(dev, rows, 128, dt, false, true, 6, 2.0)?;
        }
        Ok(())
    }));
    tests.push(test("norms/thin_half_backward", |dev: &Device| {
        // Rows of 8192 (launch rule in host/ops/norm.rs, `backward_plan`): f16/bf16 layer norm
        // and f16 RMS norm would fit one 512-thread block an SM (two vectors a thread, 72-80
        // registers), so on sm_90 more than eight rows an SM take a cluster of 4 instead; fewer
        // rows, f32 (one block an SM too) and bf16 RMS norm (64 registers, two blocks an SM) stay
        // in one block. When the kernels' registers change, this rule needs measuring again.
        // Under the sanitizer, 72 rows: past the slices kernel's 64 (`norms/slices_backward`).
        let many = 8 * dev.sm_count() as usize + 144;
        let all_rows = if sanitizer() { vec![72] } else { vec![600, many] };
        for rows in all_rows {
            for dt in DType::ALL {
                for layer in [true, false] {
                    let [_, k] = ops::norm_kernels(dev, layer, dt, rows as u64, 8192, true).map_err(e)?;
                    let thin = dt != DType::F32 && (layer || dt == DType::F16);
                    let want = if thin && rows == many { "_bwd_c4_" } else { "_bwd_v" };
                    if dev.compute_capability().0 >= 9 && !k.contains(want) {
                        return Err(format!("{rows}x8192 {dt:?} runs {k}, not {want}"));
                    }
                    norm_case(dev, rows, 8192, dt, layer, true, 8192 + rows as u64, 2.0)?;
                }
            }
        }
        Ok(())
    }));
    tests.push(test("norms/slices_backward", |dev: &Device| {
        // At most 64 rows with parameter gradients: on sm_90 one cluster of eight blocks
        // (sixteen over 2^16 elements where the device can schedule them, as every H100 SXM
        // and H200 can), each a slice of the columns of every row (host: `slices_plan`). Slices
        // narrower than a warp (8, 200 and 1000 columns: several rows a warp; at 8, blocks with
        // no columns at all), wider than one (1032, 2048, 4000, 4096, 8192, 16384: several warps
        // across; 1032 and 4000 in slices of unequal length), one to eight rows a thread, rows
        // not filling the last row slot; the same bits on a second run; without parameter
        // gradients, or with 128 rows (where the persistent plan is faster), the other kernels.
        for (rows, cols) in [
            (64usize, 1024usize),
            (9, 1024),
            (8, 1024),
            (2, 4000),
            (24, 4096),
            (16, 8192),
            (64, 2048),
            (8, 16384),
            (3, 8),
            (60, 200),
            (1, 1000),
            (40, 1032),
            (128, 1024),
            (128, 128),
        ] {
            for dt in DType::ALL {
                for layer in [true, false] {
                    let [_, k] = ops::norm_kernels(dev, layer, dt, rows as u64, cols as u64, true).map_err(e)?;
                    let sm90 = dev.compute_capability().0 >= 9;
                    if k.contains("_bwd_slices_") != (sm90 && rows <= 64) {
                        return Err(format!("{rows}x{cols} {dt:?} runs {k}"));
                    }
                    let sixteen = rows * cols > 1 << 16;
                    if k.contains("_slices_") && dev.sm_count() >= 132 && k.contains("_k16_") != sixteen {
                        return Err(format!(
                            "{rows}x{cols} {dt:?} runs {k} ({} blocks expected)",
                            if sixteen { 16 } else { 8 }
                        ));
                    }
                    let [_, k] = ops::norm_kernels(dev, layer, dt, rows as u64, cols as u64, false).map_err(e)?;
                    if k.contains("_slices_") {
                        return Err(format!("{rows}x{cols} {dt:?} without parameter gradients runs {k}"));
                    }
                    for affine in [true, false] {
                        norm_case(dev, rows, cols, dt, layer, affine, (5 * rows + cols) as u64, 2.0)?;
                    }
                }
                let mut rng = TestRng::new(rows as u64 + 1);
                let x = tensor(dev, &values(&mut rng, rows * cols, dt), &[rows, cols], dt)?;
                let g = tensor(dev, &values(&mut rng, rows * cols, dt), &[rows, cols], dt)?;
                let w = tensor(dev, &values(&mut rng, cols, dt), &[cols], dt)?;
                let (_, st) = ops::rms_norm(&x, Some(&w), 1e-5).map_err(e)?;
                let run = || -> Result<Vec<Vec<u32>>, String> {
                    let gr = ops::rms_norm_backward(&x, Some(&w), &st, &g).map_err(e)?;
                    Ok(vec![bits(&gr.x)?, bits(gr.weight.as_ref().expect("asked for"))?])
                };
                if run()? != run()? {
                    return Err(format!("rms norm backward {rows}x{cols} {dt:?}: two runs differ"));
                }
            }
        }
        Ok(())
    }));
    tests.push(test("norms/cluster_backward", |dev: &Device| {
        // Rows too long for one block's registers, held by clusters of 4 or 8 blocks on sm_90
        // (two vectors a thread, up to 1024 threads a block): more rows than resident clusters
        // (each walks several), runs of unequal length (16392 f32 is 4098 vectors over four
        // blocks), with and without parameters.
        let rows = if sanitizer() { 9 } else { 70 };
        for (cols, c_f32, c_half) in [(32768usize, 4, 4), (16392, 4, 4), (40000, 8, 4), (65536, 8, 4), (65544, 0, 8)] {
            for dt in DType::ALL {
                let c = if dt == DType::F32 { c_f32 } else { c_half };
                for layer in [true, false] {
                    for affine in [true, false] {
                        let [_, k] = ops::norm_kernels(dev, layer, dt, rows as u64, cols as u64, affine).map_err(e)?;
                        // (c = 0: too long for a cluster, streamed.)
                        let want = if c == 0 { "_bwd_stream_".to_string() } else { format!("_bwd_c{c}_") };
                        if dev.compute_capability().0 >= 9 && !k.contains(&want) {
                            return Err(format!("{rows}x{cols} {dt:?} runs {k}, not {want}"));
                        }
                        norm_case(dev, rows, cols, dt, layer, affine, (cols + rows) as u64, 2.0)?;
                    }
                }
            }
        }
        Ok(())
    }));
    tests.push(test("norms/errors", norm_errors));
    for (rows, cols) in paths() {
        tests.push(test(format!("add_norms/paths/{rows}x{cols}"), move |dev: &Device| {
            // Each forward and backward path of the fused kernels, with dh; the backward without
            // dh is the norm's (checked against it bit for bit in the case).
            let seed = (3 * rows + cols) as u64;
            for dt in DType::ALL {
                for layer in [true, false] {
                    add_norm_case(dev, rows, cols, dt, layer, true, true, seed, 2.0)?;
                }
                add_norm_case(dev, rows, cols, dt, false, false, false, seed + 1, 0.0)?;
            }
            Ok(())
        }));
    }
    for layer in [true, false] {
        let name = if layer { "add_layer_norm" } else { "add_rms_norm" };
        tests.push(test(format!("{name}/random_shapes"), move |dev: &Device| {
            prop(
                30,
                (shapes(), dtype(), any::<bool>(), any::<bool>(), any::<u64>(), any::<bool>()),
                |((r, c), dt, affine, with_dh, seed, far)| {
                    add_norm_case(dev, r, c, dt, layer, affine, with_dh, seed, if far { 2.0 } else { 0.0 })
                },
            )
        }));
        tests.push(test(format!("{name}/specials"), move |dev: &Device| {
            DType::ALL.into_iter().try_for_each(|dt| add_norm_specials(dev, dt, layer))
        }));
    }
    tests.push(test("add_norms/backward_plans", |dev: &Device| {
        // The fused backward's kernels where the norms' take their other plans (sm_90): few rows
        // with parameter gradients in column slices, rows too long for one block in clusters,
        // many rows persistent; and always the fused kernels where dh is given. LLM widths too.
        let sm90 = dev.compute_capability().0 >= 9;
        let rows_long = if sanitizer() { 9 } else { 70 };
        let cases: &[(usize, usize, &str)] = &[
            (1, 4096, "_bwd_slices_"),
            (16, 5120, "_bwd_slices_"),
            (64, 1024, "_bwd_slices_"),
            (rows_long, 32768, "_bwd_c"),
            (600, 4096, "_bwd_"),
            (300, 5120, "_bwd_"),
        ];
        for &(rows, cols, want) in cases {
            for dt in DType::ALL {
                for layer in [true, false] {
                    let [f, b] = ops::add_norm_kernels(dev, layer, dt, rows as u64, cols as u64, true).map_err(e)?;
                    if !f.starts_with("add_") || !b.starts_with("add_") || (sm90 && !b.contains(want)) {
                        return Err(format!("{rows}x{cols} {dt:?}: the fused norm runs {f} and {b}"));
                    }
                    add_norm_case(dev, rows, cols, dt, layer, true, true, (rows + 7 * cols) as u64, 2.0)?;
                }
            }
        }
        Ok(())
    }));
    tests.push(test("add_norms/errors", add_norm_errors));
    run(tests)
}
