//! GPU tests of the fused AdamW step (`ops::adamw_step`, `ops::AdamWState`) against PyTorch's
//! formula in f64 (`common::reference::adamw`), in f32, f16 and bf16, over several steps.
//!
//! Each step is checked from the state the GPU left (read back before the step), so every
//! comparison is one step's error, which the bound below covers, rather than a drift that grows
//! with the steps. The op writes in place, so the harness's NaN poisoning of allocations does not
//! reach its outputs; an element the kernel failed to write keeps its old value instead, which
//! the reference does not expect: the moments move with every non-zero gradient (the parameters
//! of f16/bf16 may not, when the update is below half an ulp).
//!
//! Tolerances. Notation: `u = 2^-24` (f32's unit roundoff), inputs `p, g, m, v` as stored, the
//! hyper-parameters as f64; `lw = lr * wd`, `d = 1 - lw`, `bc1 = 1 - b1^t`, `c = sqrt(1 - b2^t)`.
//! Exact step: `m' = b1 m + (1 - b1) g`, `v' = b2 v + (1 - b2) g^2`,
//! `U = (lr / bc1) m' / (sqrt(v') / c + eps)`, `p' = p d - U`. The kernel gets each constant
//! rounded once from f64 (relative error `u` each: `LW`, `B1`, `C1 = 1 - b1`, `B2`, `C2`,
//! `S = lr c / bc1`, `E = eps c`) and computes, every operation rounding once (`(1 + e)`,
//! `|e| <= u`):
//! 1. `P1 = fma(-LW, p, p)`: `|P1 - p d| <= u |p| (|d| + lw)` (the rounding of `LW`, then of the
//!    result).
//! 2. `M = fma(B1, m, C1 * g)`: the `b1 m` term carries `B1`'s rounding, the `(1 - b1) g` term
//!    `C1`'s and the product's, the result one more:
//!    `E_m = u (|m'| + b1 |m| + 2 (1 - b1) |g|)`.
//! 3. `V = fma(B2, v, (C2 * g) * g)`: all terms are non-negative, so relative errors add:
//!    `E_v = u (2 b2 v + 4 (1 - b2) g^2) <= 4 u v'`; `eps_v = E_v / v'`.
//! 4. `D = sqrt(V) + E`: `sqrt` halves `eps_v` and rounds once, `E` is rounded once, the sum
//!    once, both terms positive: relative error `eps_d = eps_v / 2 + 2u`.
//! 5. `Q = M / D`: `|Q - m'/D'| <= E_m / D' + |m' / D'| (eps_d + u)`, with `D' = sqrt(v') + eps c`.
//! 6. `P = fma(-S, Q, P1)`: `S`'s rounding and the result's:
//!    `|P - p'| <= u |p'| + u |p| (|d| + lw) + (S / D') E_m + |U| (eps_d + 2u)`,
//!    where `S / D' = lr / bc1 / (sqrt(v') / c + eps)`.
//!
//! Each bound is first order in `u`; a factor 1.01 covers the second-order terms. `close` then
//! adds one ulp of the storage type (rounding the f32 result to f16/bf16; for the f32 moments, one
//! f32 ulp) and the smallest normal f32 (`(1 - b2) g^2` underflows where f64 does not). The CPU
//! test `formulas_cpu::adamw_update_matches_the_f64_reference` runs the kernel's f32 formula
//! against the same bounds, where the largest error seen is 0.97 of the bound on `p` and 0.77 on
//! `m`, `v`. NaN must match NaN (a NaN or infinite gradient makes `p` NaN; `m` and `v` follow
//! IEEE arithmetic, as in PyTorch's kernel).

mod common;

use common::reference::{self as r, AdamWStep};
use common::*;
use kernels::ops::{self, AdamW, AdamWState};
use kernels::{DType, Device, Error, Tensor};
use std::process::ExitCode;

/// Host copies of the four tensors of one parameter.
struct Host {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

fn read(p: &Tensor, m: &Tensor, v: &Tensor) -> Result<Host, String> {
    Ok(Host { p: p.to_f32_vec().map_err(e)?, m: m.to_f32_vec().map_err(e)?, v: v.to_f32_vec().map_err(e)? })
}

/// Checks the state after one step against the reference from the state before it.
fn check_step(
    dt: DType,
    what: &str,
    before: &Host,
    g: &[f32],
    after: &Host,
    cfg: &AdamW,
    step: u64,
) -> Result<(), String> {
    let n = g.len();
    let want: Vec<AdamWStep> = (0..n)
        .map(|i| r::adamw(before.p[i] as f64, g[i] as f64, before.m[i] as f64, before.v[i] as f64, cfg, step))
        .collect();
    let show =
        |i: usize| format!("p = {:e}, g = {:e}, m = {:e}, v = {:e}", before.p[i], g[i], before.m[i], before.v[i]);
    let ctx = |x: &str| format!("{what}, {x}, step {step}, {cfg:?}");
    let none = |_| None;
    let col = |f: fn(&AdamWStep) -> f64| want.iter().map(f).collect::<Vec<f64>>();
    compare(&ctx("p"), dt, &after.p, &col(|w| w.p), |i| want[i].tol_p, none, show)?;
    compare(&ctx("m"), DType::F32, &after.m, &col(|w| w.m), |i| want[i].tol_m, none, show)?;
    compare(&ctx("v"), DType::F32, &after.v, &col(|w| w.v), |i| want[i].tol_v, none, show)
}

/// Gradients: normal of standard deviation `scale`, 3% exact zeros, and with `ieee` a few NaN
/// and infinities; rounded to `dt`.
fn grads(rng: &mut TestRng, n: usize, dt: DType, scale: f64, ieee: bool) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u = rng.unit();
            let x = if u < 0.03 {
                0.0
            } else if ieee && u < 0.045 {
                [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.below(3)]
            } else {
                (rng.normal() * scale) as f32
            };
            round_to(dt, x)
        })
        .collect()
}

/// Parameters: normal, standard deviation 1, never zero (a `-0` may come back `+0`).
fn params(rng: &mut TestRng, n: usize, dt: DType) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let x = round_to(dt, rng.normal() as f32);
            if x == 0.0 { round_to(dt, 0.5) } else { x }
        })
        .collect()
}

fn shape_of(n: usize) -> Vec<usize> {
    if n > 0 && n.is_multiple_of(3) { vec![3, n / 3] } else { vec![n] }
}

fn configs() -> Vec<AdamW> {
    let d = AdamW::default();
    vec![
        d,
        AdamW { lr: 0.1, beta1: 0.5, beta2: 0.9, eps: 1e-3, weight_decay: 0.3 },
        AdamW { lr: 1e-2, beta1: 0.0, beta2: 0.0, eps: 1e-6, weight_decay: 0.0 },
    ]
}

/// Runs `steps` (in order) on `n` random elements of `dt` with `cfg`, from zero moments through
/// `AdamWState` when `fresh`, else from random moments through `adamw_step`, checking each step.
#[allow(clippy::too_many_arguments)]
fn run_steps(
    dev: &Device,
    dt: DType,
    n: usize,
    cfg: &AdamW,
    steps: &[u64],
    fresh: bool,
    ieee: bool,
    seed: u64,
) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let shape = shape_of(n);
    let what = format!("{dt:?} {shape:?}{}", if fresh { ", fresh state" } else { "" });
    let mut p = tensor(dev, &params(&mut rng, n, dt), &shape, dt)?;
    let (mut m, mut v) = if fresh {
        let z = || Tensor::zeros(dev, &shape, DType::F32).map_err(e);
        (z()?, z()?)
    } else {
        let ms: Vec<f32> = (0..n).map(|_| (rng.normal() * 0.1) as f32).collect();
        let vs: Vec<f32> =
            (0..n).map(|_| if rng.unit() < 0.05 { 0.0 } else { (rng.normal() * 0.1).powi(2) as f32 }).collect();
        (tensor(dev, &ms, &shape, DType::F32)?, tensor(dev, &vs, &shape, DType::F32)?)
    };
    let mut state = if fresh { Some(AdamWState::new(&p).map_err(e)?) } else { None };
    for &step in steps {
        let scale = 10f64.powf(rng.unit() * 4.0 - 3.0);
        let gs = grads(&mut rng, n, dt, scale, ieee);
        let g = tensor(dev, &gs, &shape, dt)?;
        let before = match &state {
            Some(s) => read(&p, s.m(), s.v())?,
            None => read(&p, &m, &v)?,
        };
        let after = match &mut state {
            Some(s) => {
                if s.step() + 1 != step {
                    return Err(format!("{what}: the state is at step {}, the test expects {step}", s.step() + 1));
                }
                s.update(&mut p, &g, cfg).map_err(e)?;
                read(&p, s.m(), s.v())?
            }
            None => {
                ops::adamw_step(&mut p, &g, &mut m, &mut v, cfg, step).map_err(e)?;
                read(&p, &m, &v)?
            }
        };
        check_step(dt, &what, &before, &gs, &after, cfg, step)?;
    }
    Ok(())
}

/// Sizes: empty, one, around the vector widths (4 and 8) and a block, primes; the largest run
/// the unrolled rounds of the grid-stride loop (more vectors than a wave of threads).
fn sizes() -> Vec<usize> {
    let mut v = vec![0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 97, 255, 257, 1021, 4097, 65537, 100_003];
    if !sanitizer() {
        v.push(3_000_017);
    }
    v
}

fn steps_by_size(dev: &Device, dt: DType) -> Result<(), String> {
    for (ci, cfg) in configs().iter().enumerate() {
        for (si, &n) in sizes().iter().enumerate() {
            let seed = (ci * 100 + si) as u64 ^ (dt.size() as u64 * 7919);
            // Steps 1-4 from zero moments, then a late step (bias corrections near 1).
            run_steps(dev, dt, n, cfg, &[1, 2, 3, 4], true, false, seed)?;
            run_steps(dev, dt, n, cfg, &[1000, 1001], false, false, seed + 1)?;
        }
    }
    Ok(())
}

/// Random sizes and configurations, NaN and infinities in the gradients.
fn proptest_case(dev: &Device, dt: DType) -> Result<(), String> {
    use proptest::prelude::*;
    let cfg = (1e-5f64..0.3, 0.0f64..0.999, 0.0f64..0.9999, 1e-8f64..1e-2, 0.0f64..0.5)
        .prop_map(|(lr, beta1, beta2, eps, weight_decay)| AdamW { lr, beta1, beta2, eps, weight_decay });
    prop(16, (common::sizes(), cfg, 1u64..100, any::<u64>()), |(n, cfg, step, seed)| {
        run_steps(dev, dt, n, &cfg, &[step, step + 1], false, true, seed)
    })
}

/// `lr = 0`, `weight_decay = 0`: parameters unchanged bit for bit (the update is `0 * q`), the
/// moments still updated.
fn lr_zero(dev: &Device) -> Result<(), String> {
    let cfg = AdamW { lr: 0.0, weight_decay: 0.0, ..AdamW::default() };
    for dt in DType::ALL {
        for n in [1usize, 7, 4097, 100_003] {
            let mut rng = TestRng::new(n as u64);
            let ps = params(&mut rng, n, dt);
            let mut p = tensor(dev, &ps, &[n], dt)?;
            let mut state = AdamWState::new(&p).map_err(e)?;
            for step in 1..=3u64 {
                let gs = grads(&mut rng, n, dt, 1.0, false);
                let g = tensor(dev, &gs, &[n], dt)?;
                let before = read(&p, state.m(), state.v())?;
                state.update(&mut p, &g, &cfg).map_err(e)?;
                let after = read(&p, state.m(), state.v())?;
                if let Some(i) = (0..n).find(|&i| after.p[i].to_bits() != ps[i].to_bits()) {
                    return Err(format!(
                        "{dt:?} n = {n}, step {step}: p[{i}] moved from {:e} to {:e}",
                        ps[i], after.p[i]
                    ));
                }
                check_step(dt, "lr = 0", &before, &gs, &after, &cfg, step)?;
            }
        }
    }
    Ok(())
}

/// `AdamWState::update` is `adamw_step` at steps 1, 2, 3 from zero moments, bit for bit.
fn state_matches_steps(dev: &Device) -> Result<(), String> {
    let cfg = AdamW { lr: 0.05, ..AdamW::default() };
    let n = 10_007;
    for dt in DType::ALL {
        let mut rng = TestRng::new(5);
        let ps = params(&mut rng, n, dt);
        let (mut p1, mut p2) = (tensor(dev, &ps, &[n], dt)?, tensor(dev, &ps, &[n], dt)?);
        let mut state = AdamWState::new(&p1).map_err(e)?;
        let z = || Tensor::zeros(dev, &[n], DType::F32).map_err(e);
        let (mut m, mut v) = (z()?, z()?);
        for step in 1..=3 {
            let g = tensor(dev, &grads(&mut rng, n, dt, 0.1, false), &[n], dt)?;
            state.update(&mut p1, &g, &cfg).map_err(e)?;
            ops::adamw_step(&mut p2, &g, &mut m, &mut v, &cfg, step).map_err(e)?;
            let bits = |t: &Tensor| -> Result<Vec<u32>, String> {
                Ok(t.to_f32_vec().map_err(e)?.into_iter().map(f32::to_bits).collect())
            };
            if state.step() != step
                || bits(&p1)? != bits(&p2)?
                || bits(state.m())? != bits(&m)?
                || bits(state.v())? != bits(&v)?
            {
                return Err(format!("{dt:?} step {step}: AdamWState differs from adamw_step"));
            }
        }
    }
    Ok(())
}

/// Invalid arguments are errors that name the op, and leave every tensor (and the state's step)
/// as it was.
fn errors(dev: &Device) -> Result<(), String> {
    let d = AdamW::default();
    let t = |shape: &[usize], dt: DType| Tensor::full(dev, shape, dt, 0.25).map_err(e);
    let (mut p, g) = (t(&[4, 5], DType::BF16)?, t(&[4, 5], DType::BF16)?);
    let (mut m, mut v) = (t(&[4, 5], DType::F32)?, t(&[4, 5], DType::F32)?);
    let check = |what: &str, r: kernels::Result<()>, want: fn(&Error) -> bool| -> Result<(), String> {
        match r {
            Err(err) if want(&err) && err.to_string().starts_with("adamw_step:") => Ok(()),
            other => Err(format!("{what}: got {other:?}")),
        }
    };
    let shape = |e: &Error| matches!(e, Error::ShapeMismatch { .. });
    let dtype = |e: &Error| matches!(e, Error::DTypeMismatch { .. });
    let invalid = |e: &Error| matches!(e, Error::InvalidArgument { .. });
    let g_shape = t(&[5, 4], DType::BF16)?;
    check("grad shape", ops::adamw_step(&mut p, &g_shape, &mut m, &mut v, &d, 1), shape)?;
    let g_f16 = t(&[4, 5], DType::F16)?;
    check("grad dtype", ops::adamw_step(&mut p, &g_f16, &mut m, &mut v, &d, 1), dtype)?;
    let mut m_bf16 = t(&[4, 5], DType::BF16)?;
    check("m dtype", ops::adamw_step(&mut p, &g, &mut m_bf16, &mut v, &d, 1), invalid)?;
    let mut v_short = t(&[20], DType::F32)?;
    check("v shape", ops::adamw_step(&mut p, &g, &mut m, &mut v_short, &d, 1), shape)?;
    check("step 0", ops::adamw_step(&mut p, &g, &mut m, &mut v, &d, 0), invalid)?;
    for bad in [
        AdamW { lr: -1e-3, ..d },
        AdamW { lr: f64::NAN, ..d },
        AdamW { beta1: 1.0, ..d },
        AdamW { beta2: -0.5, ..d },
        AdamW { eps: 0.0, ..d },
        AdamW { weight_decay: -0.1, ..d },
    ] {
        check(&format!("{bad:?}"), ops::adamw_step(&mut p, &g, &mut m, &mut v, &bad, 1), invalid)?;
    }
    let mut state = AdamWState::new(&p).map_err(e)?;
    check("state, grad shape", state.update(&mut p, &g_shape, &d), shape)?;
    if state.step() != 0 {
        return Err(format!("a failed update advanced the state to step {}", state.step()));
    }
    let unchanged = |x: &Tensor, what: &str| -> Result<(), String> {
        let vals = x.to_f32_vec().map_err(e)?;
        if vals.iter().all(|&y| y == 0.25) { Ok(()) } else { Err(format!("a failed step changed {what}")) }
    };
    unchanged(&p, "p")?;
    unchanged(&m, "m")?;
    unchanged(&v, "v")?;
    // Empty tensors: nothing to do, no error.
    let (mut p0, g0) = (t(&[0, 3], DType::F16)?, t(&[0, 3], DType::F16)?);
    let (mut m0, mut v0) = (t(&[0, 3], DType::F32)?, t(&[0, 3], DType::F32)?);
    ops::adamw_step(&mut p0, &g0, &mut m0, &mut v0, &d, 1).map_err(e)
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for dt in DType::ALL {
        tests.push(test(format!("optim/adamw_steps_{}", dt.suffix()), move |dev| steps_by_size(dev, dt)));
        tests.push(test(format!("optim/adamw_proptest_{}", dt.suffix()), move |dev| proptest_case(dev, dt)));
    }
    tests.push(test("optim/adamw_lr_zero", lr_zero));
    tests.push(test("optim/adamw_state_matches_steps", state_matches_steps));
    tests.push(test("optim/adamw_errors", errors));
    run(tests)
}
