//! GPU tests of cross-entropy, forward and backward, with every reduction and label smoothing,
//! in f32, f16 and bf16, against an f64 reference on random shapes (row lengths chosen to hit
//! every kernel path) and random values with outliers. Outputs come from poisoned (NaN-filled)
//! allocations, so an unwritten element fails.
//!
//! Tolerances. With `E = 2^-24` (f32 rounding) and `K = L + log2(n) + 16`, where `L` bounds the
//! values one thread adds in sequence (64 in registers; `8 * ceil(n / 1024)` streaming) and
//! `log2(n)` the depth of the group reduction: a sum of `n` terms has error at most `K E` times
//! the sum of their magnitudes (the 16 covers `exp`'s 2 ulp, the rescalings of the online
//! softmax and the final products). Each check below scales `K E` by the magnitudes that enter
//! the result; `close` adds one ulp of the storage type for f16/bf16 outputs.

mod common;

use common::rows::*;
use common::*;
use kernels::ops::{self, CrossEntropyOpts, Reduction};
use kernels::{DType, Device, Error, IndexTensor, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

fn ce_case(
    dev: &Device,
    rows: usize,
    cols: usize,
    dt: DType,
    red: Reduction,
    smoothing: f32,
    seed: u64,
) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let xs = values(&mut rng, rows * cols, dt);
    let ignore = -100i64;
    let ts: Vec<i64> = (0..rows).map(|_| if rng.unit() < 0.1 { ignore } else { rng.below(cols) as i64 }).collect();
    let x = tensor(dev, &xs, &[rows, cols], dt)?;
    let t = IndexTensor::from_slice(dev, &ts, &[rows]).map_err(e)?;
    let opts = CrossEntropyOpts { reduction: red, ignore_index: ignore, label_smoothing: smoothing };
    let (loss, saved) = ops::cross_entropy(&x, &t, opts).map_err(e)?;
    let eps = smoothing as f64;
    let k = k_of(cols) * E;
    let mut losses = vec![0.0f64; rows];
    let mut mags = vec![0.0f64; rows];
    let mut lses = vec![0.0f64; rows];
    for r in 0..rows {
        let xr: Vec<f64> = xs[r * cols..(r + 1) * cols].iter().map(|&v| v as f64).collect();
        let m = xr.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + xr.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        lses[r] = lse;
        if ts[r] != ignore {
            let sx: f64 = xr.iter().sum();
            losses[r] = lse - (1.0 - eps) * xr[ts[r] as usize] - eps / cols as f64 * sx;
            mags[r] =
                lse.abs() + xr[ts[r] as usize].abs() + eps * xr.iter().map(|v| v.abs()).sum::<f64>() / cols as f64;
        }
    }
    let count = ts.iter().filter(|&&v| v != ignore).count();
    let got = loss.to_f32_vec().map_err(e)?;
    match red {
        Reduction::None => {
            compare(
                "cross_entropy none",
                dt,
                &got,
                &losses,
                |i| tol(0.0, k * (1.0 + mags[i])),
                |_| None,
                |i| format!("row {i}, target {}", ts[i]),
            )?;
        }
        Reduction::Sum | Reduction::Mean => {
            let s: f64 = losses.iter().sum();
            let mag: f64 = mags.iter().sum::<f64>() + count as f64;
            let (want, m) = if red == Reduction::Sum { (s, mag) } else { (s / count as f64, mag / count as f64) };
            let kr = k + (rows as f64 + 16.0) * E;
            compare(
                &format!("cross_entropy {red:?}"),
                dt,
                &got,
                &[want],
                |_| tol(0.0, kr * m),
                |_| None,
                |_| format!("{rows}x{cols}"),
            )?;
        }
    }
    // Backward with a non-trivial upstream gradient.
    let gl: Vec<f32> = match red {
        Reduction::None => (0..rows).map(|_| round_to(dt, rng.normal() as f32)).collect(),
        _ => vec![round_to(dt, 0.75)],
    };
    let gshape: &[usize] = if red == Reduction::None { &[rows] } else { &[] };
    let gt = tensor(dev, &gl, gshape, dt)?;
    let gx = ops::cross_entropy_backward(&x, &t, &saved, &gt).map_err(e)?.to_f32_vec().map_err(e)?;
    let mut want = vec![0.0f64; rows * cols];
    for r in 0..rows {
        if ts[r] == ignore {
            continue;
        }
        let gn = match red {
            Reduction::None => gl[r] as f64,
            Reduction::Sum => gl[0] as f64,
            Reduction::Mean => gl[0] as f64 / count as f64,
        };
        for c in 0..cols {
            let p = (xs[r * cols + c] as f64 - lses[r]).exp();
            let hot = if c as i64 == ts[r] { 1.0 - eps } else { 0.0 };
            want[r * cols + c] = gn * (p - eps / cols as f64 - hot);
        }
    }
    let gmag = |i: usize| {
        let r = i / cols;
        let gn = match red {
            Reduction::None => gl[r].abs() as f64,
            Reduction::Sum => gl[0].abs() as f64,
            Reduction::Mean => gl[0].abs() as f64 / count.max(1) as f64,
        };
        // exp(x - lse) with lse's error K E (1 + |lse|) relative, plus the subtraction.
        gn * ((xs[i] as f64 - lses[r]).exp() * k * (2.0 + lses[r].abs() + (xs[i] as f64).abs()) + 4.0 * E)
    };
    compare(
        &format!("cross_entropy {red:?} backward {rows}x{cols}"),
        dt,
        &gx,
        &want,
        |i| tol(0.0, gmag(i)),
        |_| None,
        |i| format!("row {}, col {}, target {}", i / cols, i % cols, ts[i / cols]),
    )?;
    Ok(())
}

fn ce_errors(dev: &Device) -> Result<(), String> {
    let x = Tensor::rand_normal(dev, &[4, 10], DType::F32, 0.0, 1.0, 1).map_err(e)?;
    let t = IndexTensor::from_slice(dev, &[1, 2, 10, 3], &[4]).map_err(e)?;
    match ops::cross_entropy(&x, &t, CrossEntropyOpts::default()) {
        Err(Error::InvalidArgument { message, .. }) if message.contains("row 2") => {}
        other => return Err(format!("an out-of-range target must be an error naming its row, got {other:?}")),
    }
    let t = IndexTensor::from_slice(dev, &[1, 2, 3], &[3]).map_err(e)?;
    if !matches!(ops::cross_entropy(&x, &t, CrossEntropyOpts::default()), Err(Error::ShapeMismatch { .. })) {
        return Err("a target of the wrong length must be a shape error".into());
    }
    let t = IndexTensor::from_slice(dev, &[-100; 4], &[4]).map_err(e)?;
    let (l, _) = ops::cross_entropy(&x, &t, CrossEntropyOpts::default()).map_err(e)?;
    if !l.to_f32_vec().map_err(e)?[0].is_nan() {
        return Err("the mean over no rows (all ignored) must be NaN, as in PyTorch".into());
    }
    Ok(())
}

/// Masked classes (logits of -inf, as attention-style masks and vocabulary padding give) without
/// label smoothing: the loss is finite, as in PyTorch, and their gradient is exactly 0.
fn ce_masked(dev: &Device) -> Result<(), String> {
    let (rows, cols) = (6usize, 37usize);
    for dt in DType::ALL {
        let mut rng = TestRng::new(11);
        let mut xs: Vec<f32> = (0..rows * cols).map(|_| round_to(dt, rng.normal() as f32)).collect();
        let ts: Vec<i64> = (0..rows).map(|r| (r * 5 % cols) as i64).collect();
        for r in 0..rows {
            for c in 0..cols {
                if c as i64 != ts[r] && (c + r) % 3 == 0 {
                    xs[r * cols + c] = f32::NEG_INFINITY;
                }
            }
        }
        let x = tensor(dev, &xs, &[rows, cols], dt)?;
        let t = IndexTensor::from_slice(dev, &ts, &[rows]).map_err(e)?;
        let opts = CrossEntropyOpts { reduction: Reduction::None, ..Default::default() };
        let (loss, saved) = ops::cross_entropy(&x, &t, opts).map_err(e)?;
        let got = loss.to_f32_vec().map_err(e)?;
        let k = k_of(cols) * E;
        let mut lses = vec![0.0f64; rows];
        let mut want = vec![0.0f64; rows];
        for r in 0..rows {
            let xr: Vec<f64> = xs[r * cols..(r + 1) * cols].iter().map(|&v| v as f64).collect();
            let m = xr.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            lses[r] = m + xr.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            want[r] = lses[r] - xr[ts[r] as usize];
        }
        compare(
            "cross_entropy masked",
            dt,
            &got,
            &want,
            |i| tol(0.0, k * (1.0 + lses[i].abs() + want[i].abs())),
            |_| None,
            |i| format!("row {i}"),
        )?;
        let ones = tensor(dev, &vec![1.0; rows], &[rows], dt)?;
        let gx = ops::cross_entropy_backward(&x, &t, &saved, &ones).map_err(e)?.to_f32_vec().map_err(e)?;
        for (i, &g) in gx.iter().enumerate() {
            let (r, c) = (i / cols, i % cols);
            let p = (xs[i] as f64 - lses[r]).exp();
            let w = p - if c as i64 == ts[r] { 1.0 } else { 0.0 };
            let bound = p * k * (2.0 + lses[r].abs() + (xs[i] as f64).abs()) + 4.0 * E + ulp(dt, w);
            // NaN is bad: it compares as no ordering.
            let within = (g as f64 - w).abs().partial_cmp(&bound).is_some_and(|o| o.is_le());
            let bad = if xs[i] == f32::NEG_INFINITY { g != 0.0 } else { !within };
            if bad {
                return Err(format!("{dt:?} masked backward at row {r}, col {c}: got {g}, want {w}"));
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for red in [Reduction::None, Reduction::Sum, Reduction::Mean] {
        tests.push(test(format!("cross_entropy/{red:?}/random_shapes"), move |dev: &Device| {
            let smooth = prop_oneof![Just(0.0f32), Just(0.1f32), 0.0f32..1.0];
            prop(24, (shapes(), dtype(), smooth, any::<u64>()), |((r, c), dt, s, seed)| {
                ce_case(dev, r, c.max(2), dt, red, s, seed)
            })
        }));
    }
    tests.push(test("cross_entropy/32000_classes", |dev: &Device| {
        for dt in DType::ALL {
            ce_case(dev, 16, 32000, dt, Reduction::Mean, 0.1, 3)?;
            ce_case(dev, 5, 32001, dt, Reduction::None, 0.0, 4)?;
        }
        Ok(())
    }));
    tests.push(test("cross_entropy/masked_classes", ce_masked));
    tests.push(test("cross_entropy/errors", ce_errors));
    run(tests)
}
