//! GPU tests of the one-pass cross-entropy (`ops::cross_entropy_one_pass`, its in-place and
//! `_out` forms): the loss and the logits' gradient from one kernel, with every reduction,
//! `ignore_index`, label smoothing and z-loss, in f32, f16 and bf16, against an f64 reference on
//! random shapes (row lengths that are primes and not multiples of the vector width, so rows
//! start unaligned and have heads and tails), awkward sizes (no rows, one row, one class) and
//! extreme values (-inf, +inf, NaN, huge logits). Outputs come from poisoned (NaN-filled)
//! allocations, and the three forms must agree bit for bit.
//!
//! Tolerances: the error model of tests/cross_entropy.rs (`K E` times the magnitudes entering
//! each result, `k_of` in tests/common/rows.rs), with the z-loss's terms added: `z lse^2` has
//! error `|z| (2 |lse| (1 + |lse|) + lse^2) K E` (lse's error, doubled by the square, and the
//! products' rounding), and its gradient factor `1 + 2 z lse` an error `2 |z| (1 + |lse|) K E`.

mod common;

use common::rows::*;
use common::*;
use kernels::ops::{self, CrossEntropyOnePassOpts, CrossEntropyOpts, Reduction};
use kernels::{DType, Device, Error, IndexTensor, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

/// One case's inputs.
struct Case {
    rows: usize,
    cols: usize,
    dt: DType,
    xs: Vec<f32>,
    ts: Vec<i64>,
    opts: CrossEntropyOnePassOpts,
    /// Per-row loss gradients (reduction none), as stored.
    grow: Option<Vec<f32>>,
}

/// The f64 reference: per-row losses and their error magnitudes, the gradient and its
/// tolerance, as the kernel defines them (a term whose factor is 0 is left out, so a -inf logit
/// gives no NaN through `0 * inf`; a row whose loss gradient is 0 gets a gradient of 0).
struct Want {
    loss: Vec<f64>,
    mags: Vec<f64>,
    grad: Vec<f64>,
    gtol: Vec<f64>,
    count: usize,
}

fn reference(c: &Case) -> Want {
    let (rows, cols) = (c.rows, c.cols);
    let ce = c.opts.ce;
    let (eps, z) = (ce.label_smoothing as f64, c.opts.z_loss as f64);
    let k = k_of(cols) * E;
    let count = c.ts.iter().filter(|&&t| t != ce.ignore_index).count();
    let mut w = Want {
        loss: vec![0.0; rows],
        mags: vec![0.0; rows],
        grad: vec![0.0; rows * cols],
        gtol: vec![0.0; rows * cols],
        count,
    };
    for r in 0..rows {
        let t = c.ts[r];
        if t == ce.ignore_index {
            continue;
        }
        let xr: Vec<f64> = c.xs[r * cols..(r + 1) * cols].iter().map(|&v| v as f64).collect();
        let lse = if xr.iter().any(|v| v.is_nan()) {
            f64::NAN
        } else {
            let m = xr.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            m + xr.iter().map(|v| (v - m).exp()).sum::<f64>().ln()
        };
        let xt = xr[t as usize];
        let hot = if eps == 1.0 { 0.0 } else { (1.0 - eps) * xt };
        let spread = if eps == 0.0 { 0.0 } else { eps / cols as f64 * xr.iter().sum::<f64>() };
        let zl = if z == 0.0 { 0.0 } else { z * lse * lse };
        w.loss[r] = lse - hot - spread + zl;
        // Terms that are off (eps or z of 0) add nothing, even beside an infinite logit (0 * inf
        // would make the bound NaN).
        let smooth_mag = if eps == 0.0 { 0.0 } else { eps * xr.iter().map(|v| v.abs()).sum::<f64>() / cols as f64 };
        let z_mag = if z == 0.0 { 0.0 } else { z.abs() * (lse * lse + 2.0 * lse.abs() * (1.0 + lse.abs())) };
        w.mags[r] = lse.abs() + xt.abs() + smooth_mag + z_mag;
        let gs = c.opts.grad_scale as f64;
        let gn = match ce.reduction {
            Reduction::None => gs * c.grow.as_ref().map_or(1.0, |g| g[r] as f64),
            Reduction::Sum => gs,
            Reduction::Mean => gs / count as f64,
        };
        if gn == 0.0 {
            continue;
        }
        let pz = if z == 0.0 { 1.0 } else { 1.0 + 2.0 * z * lse };
        for (j, &x) in xr.iter().enumerate() {
            let p = (x - lse).exp();
            let h = if j as i64 == t { 1.0 - eps } else { 0.0 };
            w.grad[r * cols + j] = gn * (p * pz - eps / cols as f64 - h);
            // A class of probability exactly 0 (an -inf logit) adds no error: p * |x| would be
            // 0 * inf.
            let px = if p == 0.0 { 0.0 } else { p * (2.0 + lse.abs() + x.abs()) };
            w.gtol[r * cols + j] = gn.abs()
                * (px * pz.abs() * k + p * 2.0 * z.abs() * k * (1.0 + lse.abs()) + 4.0 * E * (1.0 + p * pz.abs()));
        }
    }
    w
}

/// Runs the three forms, checks they agree bit for bit and against the reference.
fn check_case(dev: &Device, c: &Case) -> Result<(), String> {
    let (rows, cols, dt) = (c.rows, c.cols, c.dt);
    let x = tensor(dev, &c.xs, &[rows, cols], dt)?;
    let t = IndexTensor::from_slice(dev, &c.ts, &[rows]).map_err(e)?;
    let g = match &c.grow {
        Some(v) => Some(tensor(dev, v, &[rows], dt)?),
        None => None,
    };
    let (loss, gx) = ops::cross_entropy_one_pass(&x, &t, c.opts, g.as_ref()).map_err(e)?;
    let mut xi = tensor(dev, &c.xs, &[rows, cols], dt)?;
    let loss_i = ops::cross_entropy_one_pass_(&mut xi, &t, c.opts, g.as_ref()).map_err(e)?;
    let lshape: &[usize] = if c.opts.ce.reduction == Reduction::None { &[rows] } else { &[] };
    let mut loss_o = nan_tensor(dev, lshape, dt)?;
    let mut gx_o = nan_tensor(dev, &[rows, cols], dt)?;
    ops::cross_entropy_one_pass_out(&x, &t, c.opts, g.as_ref(), &mut loss_o, &mut gx_o).map_err(e)?;
    let what = format!("{rows}x{cols} {dt:?} {:?}", c.opts);
    for (name, a, b) in [
        ("loss in place", &loss, &loss_i),
        ("gradient in place", &gx, &xi),
        ("loss _out", &loss, &loss_o),
        ("gradient _out", &gx, &gx_o),
    ] {
        if bits(a)? != bits(b)? {
            return Err(format!("{what}: {name} differs from the out-of-place result"));
        }
    }
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    if !x.to_f32_vec().map_err(e)?.iter().zip(&c.xs).all(|(&a, &b)| same(a, b)) {
        return Err(format!("{what}: the out-of-place form wrote its input"));
    }
    let w = reference(c);
    let k = k_of(cols) * E;
    let got = loss.to_f32_vec().map_err(e)?;
    let red = c.opts.ce.reduction;
    match red {
        Reduction::None => compare(
            &format!("one-pass loss {what}"),
            dt,
            &got,
            &w.loss,
            |i| tol(0.0, k * (1.0 + w.mags[i])),
            |_| None,
            |i| format!("row {i}, target {}", c.ts[i]),
        )?,
        Reduction::Sum | Reduction::Mean => {
            let s: f64 = w.loss.iter().sum();
            let mag: f64 = w.mags.iter().sum::<f64>() + w.count as f64;
            let n = w.count as f64;
            let (want, m) = if red == Reduction::Sum { (s, mag) } else { (s / n, mag / n) };
            let kr = k + (rows as f64 + 16.0) * E;
            compare(
                &format!("one-pass loss {what}"),
                dt,
                &got,
                &[want],
                |_| tol(0.0, kr * m),
                |_| None,
                |_| String::new(),
            )?
        }
    }
    let gv = gx.to_f32_vec().map_err(e)?;
    compare(
        &format!("one-pass gradient {what}"),
        dt,
        &gv,
        &w.grad,
        |i| tol(0.0, w.gtol[i]),
        |_| None,
        |i| format!("row {}, col {}, target {}, x {}", i / cols, i % cols, c.ts[i / cols], c.xs[i]),
    )
}

#[allow(clippy::too_many_arguments)]
fn random_case(rows: usize, cols: usize, dt: DType, red: Reduction, eps: f32, z: f32, seed: u64) -> Case {
    let mut rng = TestRng::new(seed);
    let xs = values(&mut rng, rows * cols, dt);
    // Half the cases ignore a class index that also occurs as a target.
    let ignore = if rng.unit() < 0.5 { -100 } else { rng.below(cols) as i64 };
    let ts: Vec<i64> = (0..rows).map(|_| if rng.unit() < 0.1 { ignore } else { rng.below(cols) as i64 }).collect();
    let grow = (red == Reduction::None && rng.unit() < 0.5)
        .then(|| (0..rows).map(|_| round_to(dt, rng.normal() as f32)).collect());
    let grad_scale = if rng.unit() < 0.5 { 1.0 } else { 0.75 };
    let opts = CrossEntropyOnePassOpts {
        ce: CrossEntropyOpts { reduction: red, ignore_index: ignore, label_smoothing: eps },
        z_loss: z,
        grad_scale,
    };
    Case { rows, cols, dt, xs, ts, opts, grow }
}

/// Row lengths: [`COLS`] and primes, none a multiple of 8 but the powers of two.
fn ce_shapes() -> impl Strategy<Value = (usize, usize)> {
    let primes = [7usize, 13, 257, 1009, 4099, 32003];
    prop_oneof![shapes(), (0..primes.len(), 1usize..70).prop_map(move |(c, r)| (r, primes[c]))]
}

/// Rows of extreme logits, each beside an ordinary row: masked classes (-inf), a -inf target,
/// all -inf, +inf, NaN (in a row that counts, and in an ignored one), and logits near the
/// largest finite value (without smoothing or z-loss, whose f32 sum and square would overflow
/// where the f64 reference does not).
fn extremes(dt: DType, eps: f32, z: f32, huge: bool) -> Case {
    let cols = 37;
    let ignore = -1;
    let (max, _, _) = limits(dt);
    let mut rng = TestRng::new(7);
    let mut xs = Vec::new();
    let mut ts = Vec::new();
    let mut push = |f: &dyn Fn(usize, f32) -> f32, t: i64, rng: &mut TestRng| {
        let row: Vec<f32> = (0..cols).map(|j| round_to(dt, f(j, rng.normal() as f32))).collect();
        xs.extend(row);
        ts.push(t);
    };
    push(&|_, v| v, 3, &mut rng);
    push(&|j, v| if j % 3 == 0 { f32::NEG_INFINITY } else { v }, 4, &mut rng);
    push(&|j, v| if j == 5 { f32::NEG_INFINITY } else { v }, 5, &mut rng);
    push(&|_, _| f32::NEG_INFINITY, 6, &mut rng);
    push(&|j, v| if j == 7 { f32::INFINITY } else { v }, 1, &mut rng);
    push(&|j, v| if j == 8 { f32::NAN } else { v }, 2, &mut rng);
    push(&|j, v| if j == 9 { f32::NAN } else { v }, ignore, &mut rng);
    if huge {
        push(&|_, v| max * (0.5 + 0.1 * v.clamp(-2.0, 2.0)), 10, &mut rng);
        push(&|j, v| if j == 11 { max } else { v }, 11, &mut rng);
    }
    push(&|_, v| 30.0 * v, 0, &mut rng);
    let rows = ts.len();
    let opts = CrossEntropyOnePassOpts {
        ce: CrossEntropyOpts { reduction: Reduction::None, ignore_index: ignore, label_smoothing: eps },
        z_loss: z,
        grad_scale: 1.0,
    };
    Case { rows, cols, dt, xs, ts, opts, grow: None }
}

fn errors(dev: &Device) -> Result<(), String> {
    let x = Tensor::rand_normal(dev, &[4, 10], DType::F32, 0.0, 1.0, 1).map_err(e)?;
    let t = IndexTensor::from_slice(dev, &[1, 2, 10, 3], &[4]).map_err(e)?;
    let opts = CrossEntropyOnePassOpts::default();
    match ops::cross_entropy_one_pass(&x, &t, opts, None) {
        Err(Error::InvalidArgument { message, .. }) if message.contains("row 2") => {}
        other => return Err(format!("an out-of-range target must be an error naming its row, got {other:?}")),
    }
    let t = IndexTensor::from_slice(dev, &[1, 2, 3], &[3]).map_err(e)?;
    if !matches!(ops::cross_entropy_one_pass(&x, &t, opts, None), Err(Error::ShapeMismatch { .. })) {
        return Err("a target of the wrong length must be a shape error".into());
    }
    let t = IndexTensor::from_slice(dev, &[1, 2, 3, 4], &[4]).map_err(e)?;
    let g = Tensor::zeros(dev, &[4], DType::F32).map_err(e)?;
    if !matches!(ops::cross_entropy_one_pass(&x, &t, opts, Some(&g)), Err(Error::InvalidArgument { .. })) {
        return Err("per-row loss gradients with a reduced loss must be refused".into());
    }
    for bad in [
        CrossEntropyOnePassOpts { z_loss: f32::NAN, ..opts },
        CrossEntropyOnePassOpts { grad_scale: f32::INFINITY, ..opts },
        CrossEntropyOnePassOpts { ce: CrossEntropyOpts { label_smoothing: 1.5, ..opts.ce }, ..opts },
    ] {
        if !matches!(ops::cross_entropy_one_pass(&x, &t, bad, None), Err(Error::InvalidArgument { .. })) {
            return Err(format!("{bad:?} must be refused"));
        }
    }
    Ok(())
}

/// No rows (with and without classes): an empty gradient, a loss of 0 (sum), NaN (mean, as
/// PyTorch's) or `[0]` (none).
fn empty(dev: &Device) -> Result<(), String> {
    for cols in [0, 5] {
        let x = Tensor::zeros(dev, &[0, cols], DType::BF16).map_err(e)?;
        let t = IndexTensor::from_slice(dev, &[], &[0]).map_err(e)?;
        for red in [Reduction::None, Reduction::Sum, Reduction::Mean] {
            let opts = CrossEntropyOnePassOpts {
                ce: CrossEntropyOpts { reduction: red, ..Default::default() },
                ..Default::default()
            };
            let (l, g) = ops::cross_entropy_one_pass(&x, &t, opts, None).map_err(e)?;
            let lv = l.to_f32_vec().map_err(e)?;
            let ok = match red {
                Reduction::None => lv.is_empty(),
                Reduction::Sum => lv == [0.0],
                Reduction::Mean => lv.len() == 1 && lv[0].is_nan(),
            };
            if !ok || g.shape() != [0, cols] {
                return Err(format!("0x{cols} {red:?}: loss {lv:?}, gradient {:?}", g.shape()));
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for red in [Reduction::None, Reduction::Sum, Reduction::Mean] {
        tests.push(test(format!("cross_entropy_one_pass/{red:?}/random_shapes"), move |dev: &Device| {
            let smooth = prop_oneof![Just(0.0f32), Just(0.1f32), 0.0f32..=1.0];
            let z = prop_oneof![Just(0.0f32), Just(1e-4f32), 0.0f32..0.1];
            prop(24, (ce_shapes(), dtype(), smooth, z, any::<u64>()), |((r, c), dt, s, z, seed)| {
                check_case(dev, &random_case(r, c, dt, red, s, z, seed))
            })
        }));
    }
    tests.push(test("cross_entropy_one_pass/awkward_sizes", |dev: &Device| {
        for dt in DType::ALL {
            for (r, c) in [(1, 1), (5, 1), (1, 2), (1, 7), (3, 9), (2, 17), (1, 128256), (3, 50257)] {
                for red in [Reduction::None, Reduction::Mean] {
                    check_case(dev, &random_case(r, c, dt, red, 0.1, 1e-4, (r * 31 + c) as u64))?;
                }
            }
        }
        Ok(())
    }));
    tests.push(test("cross_entropy_one_pass/extreme_values", |dev: &Device| {
        for dt in DType::ALL {
            check_case(dev, &extremes(dt, 0.0, 0.0, true))?;
            check_case(dev, &extremes(dt, 0.2, 1e-3, false))?;
        }
        Ok(())
    }));
    tests.push(test("cross_entropy_one_pass/errors", errors));
    tests.push(test("cross_entropy_one_pass/empty", empty));
    run(tests)
}
