//! GPU tests of the fused linear + cross-entropy (`ops::linear_cross_entropy`) against the
//! composition of the existing ops: `ops::linear` for the logits, the two-pass cross-entropy
//! (forward and backward; the one-pass op where a z-loss is asked for, which the two-pass one
//! lacks) for their gradient, then the GEMMs `dh = dlogits @ W` and `dW = dlogits^T @ h` (f32).
//! Every case runs at several chunk sizes (one row-chunk, several, a ragged last one), each
//! checked against the same composition, with the weight's gradient in f32 and in the dtype.
//!
//! Tolerance, derived from what differs between the two computations:
//! - a logit: each side rounds its GEMM's f32 sum once to the dtype; the sums may differ in
//!   order (different row counts may take other tilings), each within `H E sum_k |h||w|` of the
//!   exact product, so `dx <= ulp(x) + 2 H E sum_k |h_ik| |w_vk|`;
//! - the row's log-sum-exp moves by at most `max_v dx` (it is 1-Lipschitz in the max norm), a
//!   softmax value by `p (dx + dlse)`; each side's cross-entropy has its own error (the bound of
//!   tests/cross_entropy.rs) and rounds the gradient once: `dg <= gn |pz| p (dx + dlse) +
//!   2 err + 2 ulp(g)`;
//! - `dh_ij` differs by `sum_v dg_iv |w_vj|` plus both GEMMs' f32 sums over V (`2 V E sum_v |g|
//!   |w|`) and two roundings; `dW_vj` likewise over the rows, plus one rounding per chunk when it
//!   accumulates in the dtype;
//! - the loss by `dlse + (1 - eps) dx_t + eps mean(dx)` a row and both sides' errors.

mod common;

use common::rows::*;
use common::*;
use kernels::ops::{
    self, Activation, CrossEntropyOnePassOpts, CrossEntropyOpts, Gemm, LinearCrossEntropyOpts, Reduction,
};
use kernels::{DType, Device, Error, IndexTensor, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

struct Composed {
    /// The logits, as stored.
    x: Vec<f32>,
    loss: Vec<f32>,
    /// The logits' gradient, as stored.
    g: Vec<f32>,
    dh: Vec<f32>,
    dw: Vec<f32>,
}

fn composed(
    dev: &Device,
    h: &Tensor,
    w: &Tensor,
    t: &IndexTensor,
    ce: CrossEntropyOnePassOpts,
) -> Result<Composed, String> {
    let logits = ops::linear(h, w, None, Activation::Identity).map_err(e)?;
    let dt = h.dtype();
    let (n, v) = (h.shape()[0], w.shape()[0]);
    let (loss, g) = if ce.z_loss == 0.0 {
        let (loss, saved) = ops::cross_entropy(&logits, t, ce.ce).map_err(e)?;
        let gl = if ce.ce.reduction == Reduction::None {
            tensor(dev, &vec![ce.grad_scale; n], &[n], dt)?
        } else {
            tensor(dev, &[ce.grad_scale], &[], dt)?
        };
        let g = ops::cross_entropy_backward(&logits, t, &saved, &gl).map_err(e)?;
        (loss, g)
    } else {
        ops::cross_entropy_one_pass(&logits, t, ce, None).map_err(e)?
    };
    let dh = ops::matmul(&g, w).map_err(e)?;
    let mut dw = nan_tensor(dev, &[v, h.shape()[1]], DType::F32)?;
    ops::gemm(&g, h, &mut dw, Gemm::new(true, false)).map_err(e)?;
    Ok(Composed {
        x: logits.to_f32_vec().map_err(e)?,
        loss: loss.to_f32_vec().map_err(e)?,
        g: g.to_f32_vec().map_err(e)?,
        dh: dh.to_f32_vec().map_err(e)?,
        dw: dw.to_f32_vec().map_err(e)?,
    })
}

#[allow(clippy::too_many_arguments)]
fn case(
    dev: &Device,
    n: usize,
    hd: usize,
    v: usize,
    dt: DType,
    red: Reduction,
    eps: f32,
    z: f32,
    seed: u64,
) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let hs: Vec<f32> = (0..n * hd).map(|_| round_to(dt, rng.normal() as f32)).collect();
    let ws: Vec<f32> = (0..v * hd).map(|_| round_to(dt, 0.3 * rng.normal() as f32)).collect();
    let ignore = -100i64;
    let ts: Vec<i64> = (0..n).map(|_| if rng.unit() < 0.1 { ignore } else { rng.below(v) as i64 }).collect();
    let h = tensor(dev, &hs, &[n, hd], dt)?;
    let w = tensor(dev, &ws, &[v, hd], dt)?;
    let t = IndexTensor::from_slice(dev, &ts, &[n]).map_err(e)?;
    let ce = CrossEntropyOnePassOpts {
        ce: CrossEntropyOpts { reduction: red, ignore_index: ignore, label_smoothing: eps },
        z_loss: z,
        grad_scale: 0.75,
    };
    let c = composed(dev, &h, &w, &t, ce)?;
    let (eps, zf) = (eps as f64, z as f64);
    let k = k_of(v) * E;
    let count = ts.iter().filter(|&&x| x != ignore).count();
    // Per-row: lse, the bound on its difference, the loss's bound; per element the gradient's.
    let mut dg = vec![0.0f64; n * v];
    let mut lrow = vec![0.0f64; n];
    let mut gabs = vec![0.0f64; n * v];
    let mut msum = 0.0f64;
    for r in 0..n {
        let xr: Vec<f64> = c.x[r * v..(r + 1) * v].iter().map(|&x| x as f64).collect();
        let dx: Vec<f64> = (0..v)
            .map(|j| {
                let s: f64 = (0..hd).map(|q| (hs[r * hd + q] as f64 * ws[j * hd + q] as f64).abs()).sum();
                ulp(dt, xr[j]) + 2.0 * hd as f64 * E * s
            })
            .collect();
        let dl =
            dx.iter().copied().fold(0.0, f64::max) + 2.0 * k * (1.0 + xr.iter().fold(0.0f64, |a, x| a.max(x.abs())));
        let m = xr.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + xr.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        if ts[r] == ignore {
            continue;
        }
        let t = ts[r] as usize;
        let mag = lse.abs()
            + xr[t].abs()
            + eps * xr.iter().map(|x| x.abs()).sum::<f64>() / v as f64
            + zf * (lse * lse + 2.0 * lse.abs() * (1.0 + lse.abs()));
        msum += 1.0 + mag;
        lrow[r] = dl * (1.0 + 2.0 * zf * lse.abs())
            + (1.0 - eps) * dx[t]
            + eps * dx.iter().sum::<f64>() / v as f64
            + 2.0 * k * (1.0 + mag);
        let gn = match red {
            Reduction::Mean => 0.75 / count as f64,
            _ => 0.75,
        };
        let pz = 1.0 + 2.0 * zf * lse;
        for j in 0..v {
            let p = (xr[j] - lse).exp();
            let err = gn
                * (p * pz.abs() * k * (2.0 + lse.abs() + xr[j].abs())
                    + p * 2.0 * zf * k * (1.0 + lse.abs())
                    + 4.0 * E * (1.0 + p * pz.abs()));
            let gi = c.g[r * v + j] as f64;
            dg[r * v + j] = gn * (pz.abs() * p * (dx[j] + dl) + 2.0 * zf * p * dl) + 2.0 * err + 2.0 * ulp(dt, gi);
            gabs[r * v + j] = gi.abs();
        }
    }
    let chunks = [Some(1), Some(8), Some(24), None];
    for chunk in chunks {
        for f32_dw in [true, false] {
            let opts = LinearCrossEntropyOpts { ce, chunk_rows: chunk, weight_grad_f32: f32_dw, ..Default::default() };
            let out = ops::linear_cross_entropy(&h, &w, &t, opts).map_err(e)?;
            let what = format!("{n}x{hd} -> {v} {dt:?} {red:?} eps {eps} z {z}, chunk {chunk:?}, f32 dW {f32_dw}");
            let nchunks = n.div_ceil(chunk.unwrap_or(n.max(1)).next_multiple_of(8)).max(1) as f64;
            // The loss.
            let got = out.loss.to_f32_vec().map_err(e)?;
            let want: Vec<f64> = c.loss.iter().map(|&x| x as f64).collect();
            match red {
                Reduction::None => compare(
                    &format!("loss {what}"),
                    dt,
                    &got,
                    &want,
                    |i| tol(0.0, lrow[i] + ulp(dt, want[i])),
                    |_| None,
                    |i| format!("row {i}"),
                )?,
                _ => {
                    let s: f64 = lrow.iter().sum::<f64>() + 2.0 * (n as f64 + 16.0) * E * msum;
                    let b = if red == Reduction::Mean { s / count as f64 } else { s };
                    compare(
                        &format!("loss {what}"),
                        dt,
                        &got,
                        &want,
                        |_| tol(0.0, b + ulp(dt, want[0])),
                        |_| None,
                        |_| String::new(),
                    )?
                }
            }
            // dh [n, hd].
            let got = out.hidden_grad.to_f32_vec().map_err(e)?;
            let want: Vec<f64> = c.dh.iter().map(|&x| x as f64).collect();
            compare(
                &format!("hidden gradient {what}"),
                dt,
                &got,
                &want,
                |i| {
                    let (r, q) = (i / hd, i % hd);
                    let (mut a, mut s) = (0.0, 0.0);
                    for j in 0..v {
                        let wv = (ws[j * hd + q] as f64).abs();
                        a += dg[r * v + j] * wv;
                        s += gabs[r * v + j] * wv;
                    }
                    tol(0.0, a + 2.0 * v as f64 * E * s + 2.0 * ulp(dt, want[i]))
                },
                |_| None,
                |i| format!("row {}, col {}", i / hd, i % hd),
            )?;
            // dW [v, hd].
            let wdt = if f32_dw { DType::F32 } else { dt };
            if out.weight_grad.dtype() != wdt || out.weight_grad.shape() != [v, hd] {
                return Err(format!(
                    "{what}: weight gradient {:?} {:?}",
                    out.weight_grad.dtype(),
                    out.weight_grad.shape()
                ));
            }
            let got = out.weight_grad.to_f32_vec().map_err(e)?;
            let want: Vec<f64> = c.dw.iter().map(|&x| x as f64).collect();
            compare(
                &format!("weight gradient {what}"),
                wdt,
                &got,
                &want,
                |i| {
                    let (j, q) = (i / hd, i % hd);
                    let (mut a, mut s) = (0.0, 0.0);
                    for r in 0..n {
                        let hv = (hs[r * hd + q] as f64).abs();
                        a += dg[r * v + j] * hv;
                        s += gabs[r * v + j] * hv;
                    }
                    let acc = if f32_dw { 0.0 } else { nchunks * ulp(dt, s) };
                    tol(0.0, a + 2.0 * n as f64 * E * s + acc + ulp(wdt, want[i]))
                },
                |_| None,
                |i| format!("class {}, col {}", i / hd, i % hd),
            )?;
        }
    }
    Ok(())
}

fn errors(dev: &Device) -> Result<(), String> {
    let h = Tensor::zeros(dev, &[4, 8], DType::BF16).map_err(e)?;
    let w = Tensor::zeros(dev, &[10, 8], DType::BF16).map_err(e)?;
    let t = IndexTensor::from_slice(dev, &[1, 2, 10, 3], &[4]).map_err(e)?;
    let opts = LinearCrossEntropyOpts::default();
    match ops::linear_cross_entropy(&h, &w, &t, opts) {
        Err(Error::InvalidArgument { message, .. }) if message.contains("row 2") => {}
        other => return Err(format!("an out-of-range target must be an error naming its row, got {other:?}")),
    }
    let t = IndexTensor::from_slice(dev, &[1, 2, 3, 4], &[4]).map_err(e)?;
    let w9 = Tensor::zeros(dev, &[10, 9], DType::BF16).map_err(e)?;
    let wf = Tensor::zeros(dev, &[10, 8], DType::F32).map_err(e)?;
    for (w, what) in [(&w9, "a weight of another width"), (&wf, "a weight of another dtype")] {
        if !matches!(ops::linear_cross_entropy(&h, w, &t, opts), Err(Error::InvalidArgument { .. })) {
            return Err(format!("{what} must be refused"));
        }
    }
    let t3 = IndexTensor::from_slice(dev, &[1, 2, 3], &[3]).map_err(e)?;
    if !matches!(ops::linear_cross_entropy(&h, &w, &t3, opts), Err(Error::ShapeMismatch { .. })) {
        return Err("a target of the wrong length must be a shape error".into());
    }
    // No rows: zero gradients of the right shapes, a NaN mean.
    let h0 = Tensor::zeros(dev, &[0, 8], DType::BF16).map_err(e)?;
    let t0 = IndexTensor::from_slice(dev, &[], &[0]).map_err(e)?;
    let out = ops::linear_cross_entropy(&h0, &w, &t0, opts).map_err(e)?;
    let dw = out.weight_grad.to_f32_vec().map_err(e)?;
    if out.hidden_grad.shape() != [0, 8] || dw.len() != 80 || dw.iter().any(|&x| x != 0.0) {
        return Err(format!("no rows: dh {:?}, dW {dw:?}", out.hidden_grad.shape()));
    }
    if !out.loss.to_f32_vec().map_err(e)?[0].is_nan() {
        return Err("the mean over no rows must be NaN".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for red in [Reduction::None, Reduction::Sum, Reduction::Mean] {
        tests.push(test(format!("linear_cross_entropy/{red:?}/random"), move |dev: &Device| {
            let sizes = (
                prop_oneof![Just(1usize), Just(7), Just(33), 1usize..70],
                prop_oneof![Just(1usize), Just(8), Just(24), 1usize..70],
                prop_oneof![Just(1usize), Just(7), Just(13), Just(1031), 2usize..600],
            );
            let dt = prop_oneof![Just(DType::BF16), Just(DType::F16), Just(DType::F32)];
            let smooth = prop_oneof![Just(0.0f32), Just(0.1f32)];
            let z = prop_oneof![Just(0.0f32), Just(1e-3f32)];
            prop(12, (sizes, dt, smooth, z, any::<u64>()), |((n, hd, v), dt, s, z, seed)| {
                case(dev, n, hd, v, dt, red, s, z, seed)
            })
        }));
    }
    tests.push(test("linear_cross_entropy/errors_and_empty", errors));
    run(tests)
}
