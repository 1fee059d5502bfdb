//! The device math library measured on the GPU: each function over a dense sweep of f32 bit
//! patterns against an f64 reference (libm), with the worst error in ulp printed and bounded.
//! `kernels-gpu/tests/math_accuracy.rs` measures the same code on the CPU; this shows that the
//! GPU build computes the same thing.
//!
//! `normal_cdf` and `normal_pdf` (GELU's Phi and phi on the special function unit) are not
//! ulp-accurate functions; they are bounded by what GELU needs, stated in `fastmath.rs`: Phi
//! within 2^-17.5 relative on the lower tail (down to Phi(-6) = 1e-9, below which it is 0) and
//! 2^-22.5 absolute everywhere (MUFU.EX2's 2^-22 relative error of a tail up to 1/2); phi within 2^-21 + x^2 2^-24 relative where phi(x) >= 2^-126, and
//! flushed to 0 below.

mod common;
#[path = "../kernels-gpu/tests/support/pow_pairs.rs"]
mod pow_pairs;

use common::*;
use kernels::ops::mathprobe::{MathFn, math_probe, math_probe_pow};
use kernels::{Device, Tensor};
use std::process::ExitCode;

/// Worst error allowed, in ulp of the correctly rounded result (the README states the measured
/// figures).
const MAX_ULP: f64 = 2.0;

/// `f`'s bound in ulp: [`MAX_ULP`], but 1 for `rsqrt`, whose Newton step leaves it within half
/// an ulp and 2^-44 (`math::rsqrt`), and which replaced two correctly rounded operations.
fn ulp_bound(f: MathFn) -> f64 {
    if f == MathFn::Rsqrt { 1.0 } else { MAX_ULP }
}

fn reference(f: MathFn, x: f32) -> f64 {
    let x = x as f64;
    match f {
        MathFn::Exp => x.exp(),
        MathFn::Expm1 => libm::expm1(x),
        MathFn::Log => x.ln(),
        MathFn::Log1p => libm::log1p(x),
        MathFn::Tanh => x.tanh(),
        MathFn::Erf => libm::erf(x),
        MathFn::Sqrt => x.sqrt(),
        MathFn::Rsqrt => 1.0 / x.sqrt(),
        MathFn::NormalCdf => 0.5 * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2),
        MathFn::NormalPdf => (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt(),
        MathFn::Sinpi | MathFn::Cospi => {
            if !x.is_finite() {
                return f64::NAN;
            }
            // x mod 2 is exact in f64 for an f32 x; then sin(pi r) loses nothing but pi's rounding,
            // except at the exact zeros (sinpi at integers, cospi at half-integers), where f64's
            // sin(pi) is 1.2e-16, not 0.
            let r = x - 2.0 * (x / 2.0).round();
            let a = std::f64::consts::PI * r;
            if f == MathFn::Sinpi {
                if r == r.round() { 0.0 } else { a.sin() }
            } else if r + 0.5 == (r + 0.5).round() {
                0.0
            } else {
                a.cos()
            }
        }
    }
}

/// Error of `got` in ulp of the f32 result nearest to `want` (denormal spacing below 2^-126).
fn ulp_error(got: f32, want: f64) -> f64 {
    if want.is_nan() || got.is_nan() {
        return if want.is_nan() && got.is_nan() { 0.0 } else { f64::INFINITY };
    }
    if want.is_infinite() || got.is_infinite() {
        let w = want as f32;
        return if got == w { 0.0 } else { f64::INFINITY };
    }
    let e = if want == 0.0 { -126 } else { (want.abs().log2().floor() as i32).max(-126) };
    let ulp = 2f64.powi(e - 23);
    ((got as f64) - want).abs() / ulp
}

/// Error of `got` at `x` as a fraction of `f`'s bound: at most 1 passes.
fn error(f: MathFn, x: f32, got: f32, want: f64) -> f64 {
    let x = x as f64;
    let rel = |got: f32, want: f64| if want == 0.0 { 0.0 } else { ((got as f64) - want).abs() / want.abs() };
    match f {
        MathFn::NormalCdf => {
            if want.is_nan() || got.is_nan() {
                return if want.is_nan() && got.is_nan() { 0.0 } else { f64::INFINITY };
            }
            let abs = ((got as f64) - want).abs() / 2f64.powf(-22.5);
            let tail = if x < 0.0 && x > -6.0 { rel(got, want) / 2f64.powf(-17.5) } else { 0.0 };
            abs.max(tail)
        }
        MathFn::NormalPdf => {
            if want.is_nan() || got.is_nan() {
                return if want.is_nan() && got.is_nan() { 0.0 } else { f64::INFINITY };
            }
            // Flushed to zero below 2^-126 (ex2.approx.ftz), give or take the rounding of the
            // exponent (2^-24 of 126, 2^-17 relative): the error there is absolute.
            let flush = f32::MIN_POSITIVE as f64 * (1.0 + 2f64.powi(-10));
            if want < flush {
                return ((got as f64) - want).abs() / flush;
            }
            rel(got, want) / (2f64.powi(-21) + x * x * 2f64.powi(-24))
        }
        _ => ulp_error(got, want) / ulp_bound(f),
    }
}

fn sweep(dev: &Device, f: MathFn) -> Result<(), String> {
    // Every `stride`-th bit pattern, offset so that both signs, all exponents and many
    // mantissas are covered; 2^32 / 61 = 70M inputs (fewer under the sanitizer).
    let stride: u64 = if sanitizer() { 1_000_003 } else { 61 };
    let chunk = 1usize << 24;
    let mut worst = (0.0f64, 0.0f32);
    let mut differ_from_cpu = 0usize;
    let mut start = 0u64;
    let mut count = 0usize;
    while start < (1u64 << 32) {
        let xs: Vec<f32> = (0..chunk as u64)
            .map(|k| start + k * stride)
            .take_while(|&b| b < (1u64 << 32))
            .map(|b| f32::from_bits(b as u32))
            .collect();
        if xs.is_empty() {
            break;
        }
        start += xs.len() as u64 * stride;
        count += xs.len();
        let x = Tensor::from_slice(dev, &xs, &[xs.len()]).map_err(e)?;
        let y = math_probe(&x, f).map_err(e)?.to_vec::<f32>().map_err(e)?;
        let (w, d) = compare_par(&xs, &y, |&x, y| {
            let c = f.eval(x);
            (error(f, x, y, reference(f, x)), c.to_bits() != y.to_bits() && !(c.is_nan() && y.is_nan()))
        });
        if w.0 > worst.0 {
            worst = w;
        }
        differ_from_cpu += d;
    }
    let unit = match f {
        MathFn::NormalCdf | MathFn::NormalPdf => "of its bound".to_string(),
        _ => format!("ulp (bound {})", ulp_bound(f)),
    };
    let shown = match f {
        MathFn::NormalCdf | MathFn::NormalPdf => worst.0,
        _ => worst.0 * ulp_bound(f),
    };
    println!(
        "{f:?}: {count} inputs, max error {shown:.3} {unit} at x = {:e}; {differ_from_cpu} results differ in bits from the CPU build",
        worst.1
    );
    if worst.0 > 1.0 {
        return Err(format!("{f:?}: {shown:.3} {unit} at x = {:e}", worst.1));
    }
    Ok(())
}

/// `judge(input, gpu_result) -> (error, differs from the CPU build)` over `inputs` and the GPU's
/// results, on every core: the largest error with its input, and how many results differ.
fn compare_par<I: Copy + Default + Send + Sync>(
    inputs: &[I],
    got: &[f32],
    judge: impl Fn(&I, f32) -> (f64, bool) + Sync,
) -> ((f64, I), usize) {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let per = inputs.len().div_ceil(threads).max(1);
    let judge = &judge;
    let parts: Vec<((f64, I), usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = inputs
            .chunks(per)
            .zip(got.chunks(per))
            .map(|(ic, gc)| {
                s.spawn(move || {
                    let mut w = (0.0f64, I::default());
                    let mut d = 0;
                    for (i, &g) in ic.iter().zip(gc) {
                        let (err, differs) = judge(i, g);
                        if err > w.0 {
                            w = (err, *i);
                        }
                        d += differs as usize;
                    }
                    (w, d)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut worst = (0.0f64, I::default());
    let mut differ = 0;
    for (w, d) in parts {
        if w.0 > worst.0 {
            worst = w;
        }
        differ += d;
    }
    (worst, differ)
}

/// The kernels' pow (`fastmath::pow`) over the (x, y) pairs of the CPU test (`pow_pairs.rs`:
/// dense x against a list of y, x near 1 with huge y, random pairs over the whole result range,
/// negative x with integer y, random bit patterns), against f64 libm, within [`MAX_ULP`]. The CPU
/// build of the same function takes a correctly rounded reciprocal where the GPU takes MUFU.RCP's
/// estimate; the count of results whose bits differ says how often that shows.
fn sweep_pow(dev: &Device) -> Result<(), String> {
    let mut pairs = pow_pairs::pow_pairs();
    if sanitizer() {
        pairs = pairs.into_iter().step_by(997).collect();
    }
    let mut worst = (0.0f64, 0.0f32, 0.0f32);
    let mut differ_from_cpu = 0usize;
    for chunk in pairs.chunks(1 << 24) {
        let (xs, ys): (Vec<f32>, Vec<f32>) = chunk.iter().copied().unzip();
        let x = Tensor::from_slice(dev, &xs, &[xs.len()]).map_err(e)?;
        let y = Tensor::from_slice(dev, &ys, &[ys.len()]).map_err(e)?;
        let got = math_probe_pow(&x, &y).map_err(e)?.to_vec::<f32>().map_err(e)?;
        let ((err, (x, y)), d) = compare_par(chunk, &got, |&(x, y), g| {
            let c = kernels_gpu::fastmath::pow(x, y);
            (ulp_error(g, libm::pow(x as f64, y as f64)), c.to_bits() != g.to_bits() && !(c.is_nan() && g.is_nan()))
        });
        if err > worst.0 {
            worst = (err, x, y);
        }
        differ_from_cpu += d;
    }
    let (err, x, y) = worst;
    println!(
        "Pow: {} pairs, max error {err:.3} ulp (bound {MAX_ULP}) at x = {x:e}, y = {y:e}; {differ_from_cpu} results differ in bits from the CPU build",
        pairs.len()
    );
    if err > MAX_ULP {
        return Err(format!("Pow: {err:.3} ulp at x = {x:e}, y = {y:e}"));
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests: Vec<_> =
        MathFn::ALL.iter().map(|&f| test(format!("math/{f:?}"), move |dev: &Device| sweep(dev, f))).collect();
    tests.push(test("math/Pow".to_string(), sweep_pow));
    run(tests)
}
