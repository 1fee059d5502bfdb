//! GPU tests of batch norm 2d (`ops::batch_norm`, `ops::batch_norm_backward`) in f32, f16 and
//! bf16, NCHW and NHWC, training and evaluation, against f64 references on awkward shapes (1,
//! primes, a channel of 2 values, more chunks than a finalize block has threads, chunks widened
//! to fit the grid), per-channel means and spreads, and a mean of 1e4 with a variance of 1e-4
//! (f32: the case a sum of squares gets wrong). Outputs come from NaN-poisoned allocations; two
//! runs must agree bit for bit.
//!
//! Error bounds, with `u = 2^-24` and per channel `S = max |x - mean|`, `M = N H W`. A thread
//! adds `t` values in sequence; then come `L = 8 + ceil(chunks / 256) + 8` levels of merges or
//! sums (the block's tree, a finalize thread's chunks in sequence, the finalize block's tree), so
//! a sum's path has `D = t + L` steps. To first order in `u`:
//! - the offset `q` of a thread's mean from its shift (one of its values, so `|x - k| <= 2 S`):
//!   `(2 t + 1) u S`; a merge is a weighted average of two offsets (each error weighted by at
//!   most 1) plus four roundings of offsets up to `2 S`, `10 u S`: after `L` levels
//!   `e_q = (2 t + 1 + 10 L) u S`, and the mean within `u |mean| + e_q`;
//! - the difference `d` of two means in a merge: `e_d = 2 e_q + 6 u S`;
//! - biased variance: the thread's shifted sum costs `(t^2 + 2 t) u var` (`sum d^2 <= t M2_t`),
//!   each level `3 u var` for its own roundings, and what `e_d` carries into `d^2 na nb / n`,
//!   `2 |d| e_d na nb / n`, over one level at most `sqrt(2) e_d M sqrt(var)` (Cauchy-Schwarz with
//!   `d^2 na nb / n <= M2`): `(t^2 + 2 t + 3 L) u var + 1.5 L e_d sqrt(var)`;
//! - invstd: half the relative error of `var + eps`, plus the division by `M` and `rsqrt` (3 u);
//! - y: `|w| invstd (e_mean + 2 u |x - mean|) + |w| |x - mean| e_invstd + 2 u |y|`;
//! - backward, from the saved statistics (read back, so the forward's errors do not enter): a
//!   sum of `D` steps is within `D u sum |terms|`, each term of `dweight` rounded twice more;
//!   `dx`'s longest path rounds nine times (`sum / M`, two products by invstd, `x - mean`, the
//!   product, two subtractions, `invstd weight` and the last product): `9 u` of each magnitude
//!   that enters it.
//!
//! `close` adds one ulp of the storage type for f16 and bf16 results.

mod common;

use common::*;
use kernels::ops::{self, BatchNormOpts, Layout2d};
use kernels::{DType, Device, Error, Tensor};
use kernels_gpu::batchnorm::{FINAL_THREADS, NHWC, channel, plan};
use std::process::ExitCode;

const U: f64 = 1.0 / (1u64 << 24) as f64;

/// A case's shape: `(N, C, H, W)`.
type Dims = (usize, usize, usize, usize);

fn layout_code(l: Layout2d) -> u32 {
    if l == Layout2d::Nhwc { NHWC } else { 0 }
}

/// `D` of the module's bounds, and `t`.
fn depth(l: Layout2d, c: usize, m: usize) -> (f64, f64) {
    let p = plan(layout_code(l), c as u64, m as u64);
    let t = (p.chunk / p.block.1 as u64) as f64;
    (t + 16.0 + p.chunks.div_ceil(FINAL_THREADS as u64) as f64, t)
}

/// Per-channel f64 statistics of `xs` (physical layout `l`): mean, biased variance, `S`.
fn channel_stats(xs: &[f32], (_, c, h, w): Dims, l: Layout2d) -> Vec<(f64, f64, f64)> {
    let hw = (h * w) as u64;
    let mut sum = vec![0.0f64; c];
    let mut cnt = vec![0usize; c];
    let ch = |i: usize| channel(i as u64, c as u64, hw, layout_code(l)) as usize;
    for (i, &x) in xs.iter().enumerate() {
        sum[ch(i)] += x as f64;
        cnt[ch(i)] += 1;
    }
    let mean: Vec<f64> = (0..c).map(|k| if cnt[k] > 0 { sum[k] / cnt[k] as f64 } else { 0.0 }).collect();
    let mut m2 = vec![0.0f64; c];
    let mut s = vec![0.0f64; c];
    for (i, &x) in xs.iter().enumerate() {
        let d = x as f64 - mean[ch(i)];
        m2[ch(i)] += d * d;
        s[ch(i)] = s[ch(i)].max(d.abs());
    }
    (0..c).map(|k| (mean[k], if cnt[k] > 0 { m2[k] / cnt[k] as f64 } else { 0.0 }, s[k])).collect()
}

/// `n` values of channel-dependent mean and spread, in layout `l`, rounded to `dt`.
fn values(rng: &mut TestRng, (n, c, h, w): Dims, l: Layout2d, dt: DType, big_mean: bool) -> Vec<f32> {
    let per: Vec<(f64, f64)> = (0..c)
        .map(|_| {
            if big_mean { (1e4 * (1.0 + 0.1 * rng.unit()), 1e-2) } else { (3.0 * rng.normal(), 0.1 + 2.0 * rng.unit()) }
        })
        .collect();
    let hw = (h * w) as u64;
    (0..n * c * h * w)
        .map(|i| {
            let (mu, sd) = per[channel(i as u64, c as u64, hw, layout_code(l)) as usize];
            round_to(dt, (mu + sd * rng.normal()) as f32)
        })
        .collect()
}

fn f32s(t: &Tensor) -> Result<Vec<f32>, String> {
    t.to_f32_vec().map_err(e)
}

fn bits(t: &Tensor) -> Result<Vec<u32>, String> {
    Ok(f32s(t)?.into_iter().map(f32::to_bits).collect())
}

/// One training forward and backward (and an evaluation forward and backward with the updated
/// running statistics), checked against the f64 references.
fn case(
    dev: &Device,
    dims: Dims,
    l: Layout2d,
    dt: DType,
    affine: bool,
    big_mean: bool,
    seed: u64,
) -> Result<(), String> {
    let (n, c, h, w) = dims;
    let what = format!("{dt:?} {l:?} N {n} C {c} H {h} W {w} affine {affine} big mean {big_mean}");
    let mut rng = TestRng::new(seed);
    let shape = l.shape(n, c, h, w);
    let xs = values(&mut rng, dims, l, dt, big_mean);
    let gs = draw(&mut rng, xs.len(), dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let ws: Vec<f32> = (0..c).map(|_| (1.0 + 0.5 * rng.normal()) as f32).collect();
    let bs: Vec<f32> = (0..c).map(|_| rng.normal() as f32).collect();
    let rm0: Vec<f32> = (0..c).map(|_| rng.normal() as f32).collect();
    let rv0: Vec<f32> = (0..c).map(|_| (0.5 + rng.unit()) as f32).collect();
    let x = tensor(dev, &xs, &shape, dt)?;
    let g = tensor(dev, &gs, &shape, dt)?;
    let wt = tensor(dev, &ws, &[c], DType::F32)?;
    let bt = tensor(dev, &bs, &[c], DType::F32)?;
    let mut rm = tensor(dev, &rm0, &[c], DType::F32)?;
    let mut rv = tensor(dev, &rv0, &[c], DType::F32)?;
    let (eps, momentum) = (1e-5f32, 0.1f32);
    let opts = BatchNormOpts { training: true, momentum, eps, layout: l };
    let (wo, bo) = if affine { (Some(&wt), Some(&bt)) } else { (None, None) };
    let (y, stats) =
        ops::batch_norm(&x, wo, bo, Some(&mut rm), Some(&mut rv), &opts).map_err(|err| format!("{what}: {err}"))?;
    let m = n * h * w;
    let (dd, t) = depth(l, c, m);
    let st = channel_stats(&xs, dims, l);
    let (mean_g, invstd_g) = (f32s(&stats.mean)?, f32s(&stats.invstd)?);
    let wv = |k: usize| if affine { (ws[k] as f64, bs[k] as f64) } else { (1.0, 0.0) };
    let hw = (h * w) as u64;
    let chan = |i: usize| channel(i as u64, c as u64, hw, layout_code(l)) as usize;
    // Statistics.
    let mut e_mean = vec![0.0; c];
    let mut e_inv = vec![0.0; c];
    let lv = dd - t;
    let e_q = |s: f64| (2.0 * t + 1.0 + 10.0 * lv) * U * s;
    let e_var = |var: f64, s: f64| {
        (t * t + 2.0 * t + 3.0 * lv) * U * var + 1.5 * lv * (2.0 * e_q(s) + 6.0 * U * s) * var.sqrt()
    };
    for k in 0..c {
        let (mu, var, s) = st[k];
        e_mean[k] = U * mu.abs() + e_q(s);
        let e_var = e_var(var, s);
        let inv = 1.0 / (var + eps as f64).sqrt();
        e_inv[k] = inv * (0.5 * e_var / (var + eps as f64) + 3.0 * U);
        if (mean_g[k] as f64 - mu).abs() > e_mean[k] {
            return Err(format!("{what}: channel {k} mean {} against {mu} (bound {:e})", mean_g[k], e_mean[k]));
        }
        if (invstd_g[k] as f64 - inv).abs() > e_inv[k] {
            return Err(format!(
                "{what}: channel {k} invstd {} against {inv} (var {var:e}, bound {:e})",
                invstd_g[k], e_inv[k]
            ));
        }
    }
    // Running statistics: (1 - m) r + m s, the unbiased variance.
    let (rm1, rv1) = (f32s(&rm)?, f32s(&rv)?);
    let mo = momentum as f64;
    for k in 0..c {
        let (mu, var, s) = st[k];
        let unb = var * m as f64 / (m - 1) as f64;
        // The biased variance's error, then the division by M - 1 (2 u).
        let e_var = e_var(var, s) + 2.0 * U * var;
        let want_m = (1.0 - mo) * rm0[k] as f64 + mo * mu;
        let want_v = (1.0 - mo) * rv0[k] as f64 + mo * unb;
        let tol_m = mo * e_mean[k] + 4.0 * U * (rm0[k].abs() as f64 + mo * mu.abs());
        let tol_v = mo * e_var * m as f64 / (m - 1) as f64 + 4.0 * U * (rv0[k] as f64 + mo * unb);
        if (rm1[k] as f64 - want_m).abs() > tol_m || (rv1[k] as f64 - want_v).abs() > tol_v {
            return Err(format!(
                "{what}: channel {k} running ({}, {}) against ({want_m}, {want_v}) (bounds {tol_m:e}, {tol_v:e})",
                rm1[k], rv1[k]
            ));
        }
    }
    // y.
    let yg = f32s(&y)?;
    let want: Vec<f64> = (0..xs.len())
        .map(|i| {
            let k = chan(i);
            let (wk, bk) = wv(k);
            (xs[i] as f64 - st[k].0) / (st[k].1 + eps as f64).sqrt() * wk + bk
        })
        .collect();
    let tol = |i: usize| {
        let k = chan(i);
        let inv = 1.0 / (st[k].1 + eps as f64).sqrt();
        let xm = (xs[i] as f64 - st[k].0).abs();
        let wk = wv(k).0.abs();
        Tol {
            rtol: 2.0 * U,
            atol: wk * inv * (e_mean[k] + 2.0 * U * xm) + wk * xm * e_inv[k] + 2.0 * U * wv(k).1.abs(),
        }
    };
    compare(&format!("{what}: y"), dt, &yg, &want, tol, |_| None, |i| format!("x = {}", xs[i]))?;
    // Determinism: a second run gives the same bits.
    let (y2, stats2) = ops::batch_norm(&x, wo, bo, None, None, &opts).map_err(e)?;
    if bits(&y2)? != bits(&y)?
        || bits(&stats2.mean)? != bits(&stats.mean)?
        || bits(&stats2.invstd)? != bits(&stats.invstd)?
    {
        return Err(format!("{what}: two runs differ"));
    }
    backward_check(&what, dt, dims, l, &x, &xs, &g, &gs, (wo, bo, &ws), &stats, &opts)?;

    // Evaluation with the updated running statistics: they stay as they are.
    let eopts = BatchNormOpts { training: false, ..opts };
    let (ye, se) = ops::batch_norm(&x, wo, bo, Some(&mut rm), Some(&mut rv), &eopts).map_err(e)?;
    if f32s(&rm)? != rm1 || f32s(&rv)? != rv1 {
        return Err(format!("{what}: evaluation changed the running statistics"));
    }
    let want: Vec<f64> = (0..xs.len())
        .map(|i| {
            let k = chan(i);
            let (wk, bk) = wv(k);
            (xs[i] as f64 - rm1[k] as f64) / (rv1[k] as f64 + eps as f64).sqrt() * wk + bk
        })
        .collect();
    // The same path with exact statistics: invstd within 3 u (sum, rsqrt), y's roundings.
    let tol = |i: usize| {
        let k = chan(i);
        let inv = 1.0 / (rv1[k] as f64 + eps as f64).sqrt();
        let xm = (xs[i] as f64 - rm1[k] as f64).abs();
        Tol { rtol: 2.0 * U, atol: wv(k).0.abs() * inv * xm * 6.0 * U + 2.0 * U * wv(k).1.abs() }
    };
    compare(&format!("{what}: evaluation y"), dt, &f32s(&ye)?, &want, tol, |_| None, |i| format!("x = {}", xs[i]))?;
    backward_check(&format!("{what} (evaluation)"), dt, dims, l, &x, &xs, &g, &gs, (wo, bo, &ws), &se, &eopts)
}

/// The backward from the saved statistics against its f64 reference (on those statistics).
#[allow(clippy::too_many_arguments)]
fn backward_check(
    what: &str,
    dt: DType,
    (n, c, h, w): Dims,
    l: Layout2d,
    x: &Tensor,
    xs: &[f32],
    g: &Tensor,
    gs: &[f32],
    (wo, bo, ws): (Option<&Tensor>, Option<&Tensor>, &[f32]),
    stats: &ops::BatchNormStats,
    opts: &BatchNormOpts,
) -> Result<(), String> {
    let grads =
        ops::batch_norm_backward(x, wo, bo, stats, g, opts).map_err(|err| format!("{what}: backward: {err}"))?;
    let m = n * h * w;
    let (dd, _) = depth(l, c, m);
    let (mu, inv) = (f32s(&stats.mean)?, f32s(&stats.invstd)?);
    let hw = (h * w) as u64;
    let chan = |i: usize| channel(i as u64, c as u64, hw, layout_code(l)) as usize;
    let wk = |k: usize| if wo.is_some() { ws[k] as f64 } else { 1.0 };
    let (mut s1, mut s2, mut a1, mut a2) = (vec![0.0f64; c], vec![0.0f64; c], vec![0.0f64; c], vec![0.0f64; c]);
    for i in 0..xs.len() {
        let k = chan(i);
        let (gv, xm) = (gs[i] as f64, xs[i] as f64 - mu[k] as f64);
        s1[k] += gv;
        s2[k] += gv * xm;
        a1[k] += gv.abs();
        a2[k] += (gv * xm).abs();
    }
    if let Some(dw) = &grads.weight {
        let got = f32s(dw)?;
        let want: Vec<f64> = (0..c).map(|k| s2[k] * inv[k] as f64).collect();
        let tol = |k: usize| Tol { rtol: U, atol: (dd + 2.0) * U * a2[k] * inv[k] as f64 };
        compare(&format!("{what}: dweight"), DType::F32, &got, &want, tol, |_| None, |k| format!("channel {k}"))?;
    }
    if let Some(db) = &grads.bias {
        let got = f32s(db)?;
        let tol = |k: usize| Tol { rtol: 0.0, atol: dd * U * a1[k] };
        compare(&format!("{what}: dbias"), DType::F32, &got, &s1, tol, |_| None, |k| format!("channel {k}"))?;
    }
    if wo.is_some() != grads.weight.is_some() || bo.is_some() != grads.bias.is_some() {
        return Err(format!("{what}: gradients of parameters the forward did not have, or missing"));
    }
    let mf = m as f64;
    let want: Vec<f64> = (0..xs.len())
        .map(|i| {
            let k = chan(i);
            let (gv, xm, iv) = (gs[i] as f64, xs[i] as f64 - mu[k] as f64, inv[k] as f64);
            if opts.training { (gv - s1[k] / mf - xm * iv * iv * s2[k] / mf) * iv * wk(k) } else { gv * iv * wk(k) }
        })
        .collect();
    let tol = |i: usize| {
        let k = chan(i);
        let (gv, xm, iv) = (gs[i] as f64, (xs[i] as f64 - mu[k] as f64).abs(), inv[k] as f64);
        let scale = iv * wk(k).abs();
        let atol = if opts.training {
            scale
                * (dd * U * a1[k] / mf
                    + xm * iv * iv * (dd + 2.0) * U * a2[k] / mf
                    + 9.0 * U * (gv.abs() + s1[k].abs() / mf + xm * iv * iv * s2[k].abs() / mf))
        } else {
            scale * 3.0 * U * gv.abs()
        };
        Tol { rtol: 0.0, atol }
    };
    compare(
        &format!("{what}: dx"),
        dt,
        &f32s(&grads.x)?,
        &want,
        tol,
        |_| None,
        |i| format!("x = {}, dy = {}", xs[i], gs[i]),
    )?;
    // Determinism.
    let again = ops::batch_norm_backward(x, wo, bo, stats, g, opts).map_err(e)?;
    if bits(&again.x)? != bits(&grads.x)? {
        return Err(format!("{what}: two backward runs differ"));
    }
    Ok(())
}

fn shapes() -> Vec<Dims> {
    let mut v = vec![
        (1, 1, 1, 2),
        (2, 1, 1, 1),
        (2, 3, 1, 1),
        (1, 1, 7, 7),
        (3, 5, 7, 11),
        (1, 33, 5, 5),
        (4, 1, 97, 3),
        (8, 3, 31, 17),
        (2, 64, 14, 14),
    ];
    if !sanitizer() {
        // More chunks than a finalize block has threads (NHWC), and in both layouts.
        v.extend([(64, 2, 56, 56), (16, 1, 256, 300)]);
    }
    v
}

fn training_matches_f64(dev: &Device) -> Result<(), String> {
    let mut seed = 1;
    for dt in DType::ALL {
        for l in [Layout2d::Nchw, Layout2d::Nhwc] {
            for dims in shapes() {
                for affine in [true, false] {
                    seed += 1;
                    case(dev, dims, l, dt, affine, false, seed)?;
                }
            }
        }
    }
    Ok(())
}

/// A mean of 1e4 and a variance of 1e-4 (f32; f16 and bf16 cannot hold such a spread at 1e4).
fn large_mean_small_variance(dev: &Device) -> Result<(), String> {
    for l in [Layout2d::Nchw, Layout2d::Nhwc] {
        for dims in [(2, 3, 7, 11), (8, 4, 32, 32), (1, 1, 1, 2)] {
            case(dev, dims, l, DType::F32, true, true, 77)?;
        }
    }
    Ok(())
}

/// Chunks widened past the grid's 65535: 8.4M positions in one channel.
fn widened_chunks(dev: &Device) -> Result<(), String> {
    if sanitizer() {
        return Ok(());
    }
    let dims = (2, 1, 2050, 2050);
    for l in [Layout2d::Nhwc, Layout2d::Nchw] {
        case(dev, dims, l, DType::BF16, true, false, 5)?;
    }
    Ok(())
}

/// `sum(y * g)`'s gradient by central differences of the f64 forward, against the f64 backward
/// formula that the other tests hold the GPU to, and the GPU's backward on the same tiny case.
fn finite_differences(dev: &Device) -> Result<(), String> {
    let dims @ (n, c, h, w) = (2, 2, 2, 3);
    let l = Layout2d::Nchw;
    let mut rng = TestRng::new(9);
    let xs: Vec<f64> = (0..n * c * h * w).map(|_| rng.normal()).collect();
    let gs: Vec<f64> = (0..xs.len()).map(|_| rng.normal()).collect();
    let ws = [1.5f64, -0.7];
    let eps = 1e-5;
    let hw = (h * w) as u64;
    let chan = |i: usize| channel(i as u64, c as u64, hw, 0) as usize;
    let loss = |xs: &[f64]| {
        let (mut mean, mut var) = ([0.0; 2], [0.0; 2]);
        let m = (n * h * w) as f64;
        for (i, &x) in xs.iter().enumerate() {
            mean[chan(i)] += x / m;
        }
        for (i, &x) in xs.iter().enumerate() {
            var[chan(i)] += (x - mean[chan(i)]).powi(2) / m;
        }
        xs.iter()
            .enumerate()
            .map(|(i, &x)| (x - mean[chan(i)]) / (var[chan(i)] + eps).sqrt() * ws[chan(i)] * gs[i])
            .sum::<f64>()
    };
    // The formula, in f64 on exact statistics.
    let m = (n * h * w) as f64;
    let mut mean = [0.0; 2];
    let mut var = [0.0; 2];
    for (i, &x) in xs.iter().enumerate() {
        mean[chan(i)] += x / m;
    }
    for (i, &x) in xs.iter().enumerate() {
        var[chan(i)] += (x - mean[chan(i)]).powi(2) / m;
    }
    let inv = [1.0 / (var[0] + eps).sqrt(), 1.0 / (var[1] + eps).sqrt()];
    let (mut s1, mut s2) = ([0.0; 2], [0.0; 2]);
    for i in 0..xs.len() {
        s1[chan(i)] += gs[i];
        s2[chan(i)] += gs[i] * (xs[i] - mean[chan(i)]);
    }
    let formula: Vec<f64> = (0..xs.len())
        .map(|i| {
            let k = chan(i);
            (gs[i] - s1[k] / m - (xs[i] - mean[k]) * inv[k] * inv[k] * s2[k] / m) * inv[k] * ws[k]
        })
        .collect();
    let step = 1e-6;
    for i in 0..xs.len() {
        let (mut a, mut b) = (xs.clone(), xs.clone());
        a[i] += step;
        b[i] -= step;
        let fd = (loss(&a) - loss(&b)) / (2.0 * step);
        // Central differences: truncation O(step^2 f''') and cancellation 1e-16 |loss| / step.
        if (fd - formula[i]).abs() > 1e-6 * (1.0 + formula[i].abs()) {
            return Err(format!("element {i}: finite difference {fd} against the formula {}", formula[i]));
        }
    }
    // The GPU on the same case (f32 inputs) against the same formula.
    let x32: Vec<f32> = xs.iter().map(|&v| v as f32).collect();
    let g32: Vec<f32> = gs.iter().map(|&v| v as f32).collect();
    let shape = l.shape(n, c, h, w);
    let x = tensor(dev, &x32, &shape, DType::F32)?;
    let g = tensor(dev, &g32, &shape, DType::F32)?;
    let wt = tensor(dev, &[ws[0] as f32, ws[1] as f32], &[2], DType::F32)?;
    let opts = BatchNormOpts { layout: l, eps: eps as f32, ..BatchNormOpts::default() };
    let (_, stats) = ops::batch_norm(&x, Some(&wt), None, None, None, &opts).map_err(e)?;
    backward_check(
        "finite differences",
        DType::F32,
        dims,
        l,
        &x,
        &x32,
        &g,
        &g32,
        (Some(&wt), None, &[ws[0] as f32, ws[1] as f32]),
        &stats,
        &opts,
    )
}

fn edge_cases_and_errors(dev: &Device) -> Result<(), String> {
    let opts = BatchNormOpts::default();
    let x = tensor(dev, &[1.0, 2.0, 3.0], &[1, 3, 1, 1], DType::F32)?;
    let w3 = tensor(dev, &[1.0; 3], &[3], DType::F32)?;
    let invalid = |r: kernels::Result<(Tensor, ops::BatchNormStats)>, what: &str| match r {
        Err(Error::InvalidArgument { op: "batch_norm", .. }) => Ok(()),
        other => Err(format!("{what}: want InvalidArgument, got {:?}", other.map(|_| ()))),
    };
    // One value per channel in training: PyTorch's error.
    invalid(ops::batch_norm(&x, None, None, None, None, &opts), "N H W = 1 in training")?;
    let mut rm = tensor(dev, &[0.5; 3], &[3], DType::F32)?;
    let mut rv = tensor(dev, &[2.0; 3], &[3], DType::F32)?;
    invalid(ops::batch_norm(&x, None, None, Some(&mut rm), None, &opts), "running_mean alone")?;
    let eval = BatchNormOpts { training: false, ..opts };
    invalid(ops::batch_norm(&x, None, None, None, None, &eval), "evaluation without running statistics")?;
    invalid(ops::batch_norm(&x.clone().reshape(&[3, 1, 1]).map_err(e)?, None, None, None, None, &opts), "rank 3")?;
    // ... but evaluation of one value works.
    let (y, _) = ops::batch_norm(&x, Some(&w3), None, Some(&mut rm), Some(&mut rv), &eval).map_err(e)?;
    let want: Vec<f32> =
        [1.0f32, 2.0, 3.0].iter().map(|v| ((v - 0.5) as f64 / (2.0f64 + 1e-5).sqrt()) as f32).collect();
    let got = f32s(&y)?;
    if got.iter().zip(&want).any(|(a, b)| (a - b).abs() > 1e-6) {
        return Err(format!("evaluation of one value: {got:?}, want {want:?}"));
    }
    match ops::batch_norm(&x, Some(&tensor(dev, &[1.0; 3], &[3], DType::F16)?), None, None, None, &eval) {
        Err(Error::DTypeMismatch { .. }) => {}
        other => return Err(format!("f16 weight: {:?}", other.map(|_| ()))),
    }
    match ops::batch_norm(
        &x,
        Some(&tensor(dev, &[1.0; 4], &[4], DType::F32)?),
        None,
        Some(&mut rm),
        Some(&mut rv),
        &eval,
    ) {
        Err(Error::ShapeMismatch { .. }) => {}
        other => return Err(format!("weight [4] for C = 3: {:?}", other.map(|_| ()))),
    }
    // No positions (N = 0): an empty output, statistics 0, running statistics untouched.
    let x0 = Tensor::zeros(dev, &[0, 3, 4, 4], DType::BF16).map_err(e)?;
    let before = (bits(&rm)?, bits(&rv)?);
    let (y0, s0) = ops::batch_norm(&x0, Some(&w3), None, Some(&mut rm), Some(&mut rv), &opts).map_err(e)?;
    if y0.shape() != [0, 3, 4, 4] || f32s(&s0.mean)? != [0.0; 3] || f32s(&s0.invstd)? != [0.0; 3] {
        return Err(format!("N = 0: {:?} {:?} {:?}", y0.shape(), f32s(&s0.mean)?, f32s(&s0.invstd)?));
    }
    if (bits(&rm)?, bits(&rv)?) != before {
        return Err("N = 0 changed the running statistics".into());
    }
    let g0 = ops::batch_norm_backward(&x0, Some(&w3), Some(&w3), &s0, &y0, &opts).map_err(e)?;
    if f32s(g0.weight.as_ref().ok_or("no dweight")?)? != [0.0; 3]
        || f32s(g0.bias.as_ref().ok_or("no dbias")?)? != [0.0; 3]
    {
        return Err("N = 0: parameter gradients not zero".into());
    }
    // The backward's checks.
    let (_, s) = ops::batch_norm(&tensor(dev, &[1.0, 2.0], &[2, 1, 1, 1], DType::F32)?, None, None, None, None, &opts)
        .map_err(e)?;
    let x2 = tensor(dev, &[1.0, 2.0], &[2, 1, 1, 1], DType::F32)?;
    match ops::batch_norm_backward(&x2, None, None, &s, &tensor(dev, &[1.0, 2.0], &[1, 2, 1, 1], DType::F32)?, &opts) {
        Err(Error::ShapeMismatch { .. }) => {}
        other => return Err(format!("grad of another shape: {:?}", other.map(|_| ()))),
    }
    match ops::batch_norm_backward(&x2, None, None, &s, &tensor(dev, &[1.0, 2.0], &[2, 1, 1, 1], DType::BF16)?, &opts) {
        Err(Error::DTypeMismatch { .. }) => Ok(()),
        other => Err(format!("grad of another dtype: {:?}", other.map(|_| ()))),
    }
}

fn main() -> ExitCode {
    run(vec![
        test("training_matches_f64", training_matches_f64),
        test("large_mean_small_variance", large_mean_small_variance),
        test("widened_chunks", widened_chunks),
        test("finite_differences", finite_differences),
        test("edge_cases_and_errors", edge_cases_and_errors),
    ])
}
