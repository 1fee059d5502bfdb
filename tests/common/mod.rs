//! Shared harness of the GPU test binaries.
//!
//! Each GPU test binary has `harness = false` and hands its tests to [`run`], which uses
//! libtest-mimic (same command line and output as `cargo test`). With a GPU, every test runs.
//! Without one, every test is reported as *ignored* (counted as skipped, never as passed),
//! unless `KERNELS_REQUIRE_GPU=1`, which turns the missing GPU into a failure of every test (the
//! GPU machine's suite sets it). Allocations are poisoned with NaN (`KERNELS_POISON_ALLOC=1`) so an
//! element a kernel forgets to write shows up as NaN.
#![allow(dead_code)]

pub mod attention_bwd_ref;
pub mod attention_ref;
pub mod linear_ref;
pub mod reference;
pub mod rope_ref;
pub mod rows;

pub use reference::Tol;

use kernels::ops::{Activation, UnaryOp};
use kernels::{DType, Device, Tensor};
use kernels_gpu::ops::OutputGrad;
use libtest_mimic::{Arguments, Failed, Trial};
use std::process::ExitCode;
use std::sync::OnceLock;

/// The GPU, or why there is none.
pub fn gpu() -> Result<Device, String> {
    static DEV: OnceLock<Result<Device, String>> = OnceLock::new();
    DEV.get_or_init(|| {
        // SAFETY: set before any other thread exists (the first call comes from `run`, before
        // the trials are started) and before the device reads it.
        unsafe { std::env::set_var("KERNELS_POISON_ALLOC", "1") };
        Device::cuda(0).map_err(|e| e.to_string())
    })
    .clone()
}

/// Under compute-sanitizer (`KERNELS_SANITIZER=1`, set by the bundle's sanitizer script) the
/// tests shrink their sizes and case counts: every kernel still runs, 100x slower.
pub fn sanitizer() -> bool {
    std::env::var("KERNELS_SANITIZER").is_ok_and(|v| v == "1")
}

/// Number of proptest cases: `n` normally, a few under the sanitizer.
pub fn cases(n: u32) -> u32 {
    if sanitizer() { n.min(3) } else { n }
}

pub type TestFn = Box<dyn FnOnce(&Device) -> Result<(), String> + Send>;

/// Runs the binary's GPU tests.
pub fn run(tests: Vec<(String, TestFn)>) -> ExitCode {
    run_with(tests, false)
}

/// As [`run`]; `skip_under_sanitizer` reports the tests as ignored under compute-sanitizer
/// (for tests whose size is the point, e.g. more than 2^31 elements).
pub fn run_with(tests: Vec<(String, TestFn)>, skip_under_sanitizer: bool) -> ExitCode {
    let args = Arguments::from_args();
    let dev = gpu();
    let require = std::env::var("KERNELS_REQUIRE_GPU").is_ok_and(|v| v == "1");
    if let Err(e) = &dev {
        if require {
            eprintln!("KERNELS_REQUIRE_GPU=1 and no GPU: {e}");
        } else {
            eprintln!("no GPU ({e}): {} GPU tests reported as ignored (skipped)", tests.len());
        }
    }
    let trials = tests
        .into_iter()
        .map(|(name, f)| {
            let dev = dev.clone();
            let skip = (dev.is_err() && !require) || (skip_under_sanitizer && sanitizer());
            Trial::test(name, move || match dev {
                Ok(d) => f(&d).map_err(Failed::from),
                Err(e) => Err(Failed::from(format!("no GPU: {e}"))),
            })
            .with_ignored_flag(skip)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

/// Boxes a test function with its name.
pub fn test<F>(name: impl Into<String>, f: F) -> (String, TestFn)
where
    F: FnOnce(&Device) -> Result<(), String> + Send + 'static,
{
    (name.into(), Box::new(f))
}

/// Turns a library error into a test failure message.
pub fn e<E: std::fmt::Display>(err: E) -> String {
    err.to_string()
}

// --- input generation -----------------------------------------------------------------------------

/// A small, fast, seedable generator (SplitMix64) for test inputs.
pub struct TestRng(u64);
impl TestRng {
    pub fn new(seed: u64) -> TestRng {
        TestRng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform on [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (1.0 - self.unit(), self.unit());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Largest finite value, smallest positive normal and smallest denormal of a storage type.
pub fn limits(dt: DType) -> (f32, f32, f32) {
    match dt {
        DType::F32 => (f32::MAX, f32::MIN_POSITIVE, f32::from_bits(1)),
        DType::F16 => (65504.0, 6.103_515_6e-5, 5.960_464_5e-8),
        DType::BF16 => (half::bf16::MAX.to_f32(), half::bf16::MIN_POSITIVE.to_f32(), half::bf16::from_bits(1).to_f32()),
    }
}

/// Rounds to the storage type (round to nearest even), returned as f32.
pub fn round_to(dt: DType, x: f32) -> f32 {
    match dt {
        DType::F32 => x,
        DType::F16 => half::f16::from_f32(x).to_f32(),
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
    }
}

/// How inputs are drawn.
#[derive(Clone, Copy, Debug)]
pub struct Draw {
    /// Standard deviation of the bulk (normal) values.
    pub scale: f64,
    /// Draw |x| (for ops whose interesting domain is positive); specials keep their sign.
    pub positive: bool,
    /// Fraction of special values (±0, ±inf, NaN, denormals, huge, ±1).
    pub special: f64,
}

impl Draw {
    pub const NORMAL: Draw = Draw { scale: 3.0, positive: false, special: 0.05 };
    pub const POSITIVE: Draw = Draw { scale: 3.0, positive: true, special: 0.05 };
    pub const FINITE: Draw = Draw { scale: 3.0, positive: false, special: 0.0 };
}

/// `n` random values, already rounded to `dt` (so the reference sees exactly what the GPU sees).
pub fn draw(rng: &mut TestRng, n: usize, dt: DType, d: Draw) -> Vec<f32> {
    let (max, min_normal, min_denormal) = limits(dt);
    let specials = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        min_denormal,
        -min_denormal,
        min_normal * 0.5,
        -min_normal * 0.25,
        max,
        -max,
        max * 0.5,
        1.0,
        -1.0,
        1e4f32.min(max),
        -30.0,
        30.0,
    ];
    (0..n)
        .map(|_| {
            let x = if rng.unit() < d.special {
                specials[rng.below(specials.len())]
            } else {
                let v = rng.normal() * d.scale;
                (if d.positive { v.abs() } else { v }) as f32
            };
            round_to(dt, x)
        })
        .collect()
}

/// A tensor of `dt` holding `vals` (exactly representable in `dt`).
pub fn tensor(dev: &Device, vals: &[f32], shape: &[usize], dt: DType) -> Result<Tensor, String> {
    Tensor::from_f32(dev, vals, shape, dt).map_err(e)
}

/// A tensor of `dt` filled with NaN, for `_out` variants.
pub fn nan_tensor(dev: &Device, shape: &[usize], dt: DType) -> Result<Tensor, String> {
    Tensor::full(dev, shape, dt, f32::NAN).map_err(e)
}

// --- comparison -------------------------------------------------------------------------------

/// Unit in the last place of `dt` at magnitude `r` (for normal numbers; the denormal spacing
/// below).
pub fn ulp(dt: DType, r: f64) -> f64 {
    let (mant_bits, min_exp) = match dt {
        DType::F32 => (23, -126),
        DType::F16 => (10, -14),
        DType::BF16 => (7, -126),
    };
    let e = if r == 0.0 || !r.is_finite() { min_exp } else { (r.abs().log2().floor() as i32).max(min_exp) };
    2f64.powi(e - mant_bits)
}

/// Checks `got` (as stored on the GPU) against the exact `want`. NaN must match NaN, an
/// infinity must match the same infinity (after rounding `want` to the storage type, so an f16
/// overflow to inf is expected), everything else within the tolerance.
pub fn close(dt: DType, got: f32, want: f64, tol: Tol) -> bool {
    if want.is_nan() {
        return got.is_nan();
    }
    if got as f64 == want {
        return true;
    }
    let allowed = tol.rtol * want.abs() + tol.atol + ulp(dt, want) + f32::MIN_POSITIVE as f64;
    let want_rounded = round_to(dt, want as f32);
    if want_rounded.is_infinite() || got.is_infinite() || got.is_nan() {
        // A finite exact value that rounds to an infinity must give that infinity. Near the
        // overflow threshold (max + half an ulp) the f32 error may push the result either way.
        if got.is_nan() {
            return false;
        }
        if got == want_rounded {
            return true;
        }
        let (max, _, _) = limits(dt);
        let threshold = max as f64 + ulp(dt, max as f64) / 2.0;
        let near = (want.abs() - threshold).abs() <= allowed;
        let same_sign = got.is_sign_negative() == want.is_sign_negative();
        return near && same_sign && (got.is_infinite() || got.abs() == max);
    }
    ((got as f64) - want).abs() <= allowed
}

/// The kernel's own f32 formula at extreme inputs, for [`compare`]: `Some(v)` when an input is
/// non-finite, beyond 1e30 in magnitude or a non-zero below 1e-30, `None` otherwise.
pub fn at_extremes(inputs: &[f32], formula: impl FnOnce() -> f32) -> Option<f32> {
    let extreme = |x: &f32| !x.is_finite() || x.abs() > 1e30 || (*x != 0.0 && x.abs() < 1e-30);
    inputs.iter().any(extreme).then(formula)
}

/// Compares a whole output; reports the first few mismatches with their inputs.
///
/// `emul(i)` is the kernel's own f32 formula run on the CPU, given only at extreme inputs (see
/// [`at_extremes`]). There an f32 intermediate of the formula can overflow or underflow where
/// the f64 evaluation does not (e.g. `-g * ((x / y) / y)` with y = 1.7e38 and g = inf: the
/// quotient underflows to 0 and the f32 result is NaN, the f64 one -inf; or `g * exp(-x * x)`
/// with g = 1.7e38, x = -10.4: exp underflows and the result is 0, not 9e-10). PyTorch's
/// formulas, which the kernels follow, do the same. At such inputs the GPU must give the f32
/// formula's result bit for bit (the GPU and CPU builds agree bitwise: tests/math_gpu.rs).
/// Everywhere else the exact value and the tolerance decide.
pub fn compare(
    what: &str,
    dt: DType,
    got: &[f32],
    want: &[f64],
    tol: impl Fn(usize) -> Tol,
    emul: impl Fn(usize) -> Option<f32>,
    inputs: impl Fn(usize) -> String,
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} results, expected {}", got.len(), want.len()));
    }
    let ok = |i: usize| {
        if close(dt, got[i], want[i], tol(i)) {
            return true;
        }
        let Some(m) = emul(i).map(|m| round_to(dt, m)) else { return false };
        got[i].to_bits() == m.to_bits() || (got[i].is_nan() && m.is_nan())
    };
    let bad: Vec<usize> = (0..got.len()).filter(|&i| !ok(i)).collect();
    if bad.is_empty() {
        return Ok(());
    }
    let mut msg = format!("{what} ({dt:?}): {} of {} elements wrong", bad.len(), got.len());
    for &i in bad.iter().take(8) {
        msg += &format!(
            "\n  [{i}] {}: got {:e}, want {:e} (tol {:?}, f32 formula {:?})",
            inputs(i),
            got[i],
            want[i],
            tol(i),
            emul(i)
        );
    }
    Err(msg)
}

/// Runs a proptest property with `cases` cases and fresh random inputs; the failure message
/// carries the minimal failing input.
pub fn prop<S>(cases_n: u32, strategy: S, f: impl Fn(S::Value) -> Result<(), String>) -> Result<(), String>
where
    S: proptest::strategy::Strategy,
    S::Value: std::fmt::Debug,
{
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let config = Config { cases: cases(cases_n), failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new(config);
    runner.run(&strategy, |v| f(v).map_err(TestCaseError::fail)).map_err(|e| e.to_string())
}

/// Element counts that exercise the edges: empty, single, primes, around the vector widths (4
/// and 8 elements) and block size, and large ones that need the grid-stride loop's tail.
pub fn sizes() -> impl proptest::strategy::Strategy<Value = usize> {
    use proptest::prelude::*;
    let edge = prop_oneof![
        Just(0usize),
        Just(1),
        Just(2),
        Just(3),
        Just(4),
        Just(5),
        Just(7),
        Just(8),
        Just(9),
        Just(31),
        Just(97),
        Just(255),
        Just(257),
        Just(1021),
        Just(4097),
        Just(65537),
        Just(100_003),
    ];
    let big = if sanitizer() { 1usize..2000 } else { 1usize..300_000 };
    prop_oneof![3 => edge, 1 => 1usize..2000, 1 => big]
}

/// (rows, cols) for the row-broadcast ops: a last dimension of 1, primes, multiples and
/// non-multiples of the vector width; rows from 0.
pub fn matrix_shapes() -> impl proptest::strategy::Strategy<Value = (usize, usize)> {
    use proptest::prelude::*;
    let cols = prop_oneof![
        Just(1usize),
        Just(3),
        Just(4),
        Just(8),
        Just(31),
        Just(33),
        Just(64),
        Just(1000),
        Just(1024),
        Just(4097),
        1usize..600
    ];
    let rows = prop_oneof![Just(0usize), Just(1), Just(2), Just(5), Just(8), Just(9), Just(33), 1usize..300];
    (rows, cols)
}

/// The activations under test: each of the table's with PyTorch's defaults, then some with
/// other parameters.
pub fn activations() -> Vec<Activation> {
    let mut v = Activation::ALL.to_vec();
    v.extend([
        Activation::LeakyRelu { negative_slope: -0.3 },
        Activation::Softplus { beta: 2.0, threshold: 10.0 },
        Activation::Elu { alpha: 0.5 },
        Activation::Celu { alpha: 2.5 },
    ]);
    v
}

/// The input distribution of an op of the table (positive for the ops defined there alone).
pub fn draw_for(op: UnaryOp) -> Draw {
    let info = kernels::ops::UNARY_OPS.iter().find(|i| i.name == op.name()).expect("every op is in the table");
    if info.positive { Draw::POSITIVE } else { Draw::NORMAL }
}

/// The unary ops under test, each with the input distribution that exercises it: the table's
/// math ops with their parameters, more cases of some, and [`activations`].
pub fn unary_ops() -> Vec<(UnaryOp, Draw)> {
    let mut v: Vec<(UnaryOp, Draw)> =
        UnaryOp::all().into_iter().filter(|op| !matches!(op, UnaryOp::Act(_))).map(|op| (op, draw_for(op))).collect();
    v.extend([
        (UnaryOp::Log1p, Draw { scale: 0.6, positive: false, special: 0.05 }),
        (UnaryOp::Pow(3.0), Draw::NORMAL),
        (UnaryOp::Pow(2.0), Draw::NORMAL),
        (UnaryOp::Pow(0.5), Draw::POSITIVE),
        (UnaryOp::Pow(-1.5), Draw::POSITIVE),
        (UnaryOp::Pow(0.0), Draw::NORMAL),
        // Every form of the pow kernel (`ops::Pow`): 3, 2, 1 and -1 by multiplication or
        // division, 0.5, -1.5, 2.5, -3 and 4 by the general path (negative bases: NaN, or the
        // sign of an odd power), 0, +inf and NaN by the full pow. The backward takes the form of
        // p - 1 (4's is the cube). The small launches of 3, 2, 1 and -1, and the backwards of 4,
        // 3, 2 and 0, run on their form's own entries (`ops::PowForm`).
        (UnaryOp::Pow(1.0), Draw::NORMAL),
        (UnaryOp::Pow(-1.0), Draw::NORMAL),
        (UnaryOp::Pow(2.5), Draw::NORMAL),
        (UnaryOp::Pow(-3.0), Draw::NORMAL),
        (UnaryOp::Pow(4.0), Draw::NORMAL),
        (UnaryOp::Pow(f32::INFINITY), Draw::POSITIVE),
        (UnaryOp::Pow(f32::NAN), Draw::NORMAL),
        (UnaryOp::Clamp { min: -0.5, max: 0.75 }, Draw::NORMAL),
        (UnaryOp::SubScalar(-2.25), Draw::NORMAL),
        (UnaryOp::MulScalar(0.1), Draw::NORMAL),
        (UnaryOp::DivScalar(3.0), Draw::NORMAL),
    ]);
    v.extend(activations().into_iter().map(|a| (UnaryOp::Act(a), Draw::NORMAL)));
    v
}

/// The ops with a backward from their output (`ops::unary_backward_from_output`), each with its
/// input distribution; `Some` kernel for those with a kernel of their own, `None` for those that
/// reuse their backward from `x` (a constant derivative, relu's sign) or pass the gradient on.
pub fn output_grad_ops() -> Vec<(UnaryOp, Draw, Option<OutputGrad>)> {
    vec![
        (UnaryOp::Exp, Draw::NORMAL, Some(OutputGrad::Exp)),
        (UnaryOp::Sqrt, Draw::POSITIVE, Some(OutputGrad::Sqrt)),
        (UnaryOp::Rsqrt, Draw::POSITIVE, Some(OutputGrad::Rsqrt)),
        (Activation::Sigmoid.into(), Draw::NORMAL, Some(OutputGrad::Sigmoid)),
        (Activation::Tanh.into(), Draw::NORMAL, Some(OutputGrad::Tanh)),
        (Activation::Relu.into(), Draw::NORMAL, None),
        (Activation::LeakyRelu { negative_slope: 0.01 }.into(), Draw::NORMAL, None),
        (Activation::LeakyRelu { negative_slope: 0.0 }.into(), Draw::NORMAL, None),
        (UnaryOp::Neg, Draw::NORMAL, None),
        (UnaryOp::MulScalar(0.1), Draw::NORMAL, None),
        (UnaryOp::DivScalar(3.0), Draw::NORMAL, None),
        (UnaryOp::AddScalar(1.5), Draw::NORMAL, None),
        (Activation::Identity.into(), Draw::NORMAL, None),
    ]
}

/// The kernel's f32 backward from the output at `(y, g)`, run on the CPU: its own formula, or the
/// backward from `x` read at `y`.
pub fn bwd_y_f32(op: UnaryOp, kernel: Option<OutputGrad>, y: f32, g: f32) -> f32 {
    match kernel {
        Some(k) => k.bwd_y_f32(y, g),
        None => {
            let (k, a, b) = op.kernel();
            k.bwd_f32(y, g, a, b)
        }
    }
}

/// Checks a backward from the output, `got[i]` at `(ys[i], gs[i])` with `ys[i]` the stored
/// forward of `xs[i]`: against the formula in `y` evaluated in f64 at the same `y`, and for the
/// ops with a kernel of their own against the exact derivative at `x`, within what `y`'s own
/// error carries (the formula's slope in `y` times `|y - f(x)|`, twice, plus the second order).
pub fn check_bwd_y(
    op: UnaryOp,
    kernel: Option<OutputGrad>,
    dt: DType,
    xs: &[f32],
    ys: &[f32],
    gs: &[f32],
    got: &[f32],
) -> Result<(), String> {
    use reference as r;
    let want: Vec<f64> = (0..xs.len())
        .map(|i| r::unary_bwd_y(op, ys[i] as f64, gs[i] as f64).ok_or(format!("{op:?} has no backward from y")))
        .collect::<Result<_, _>>()?;
    let show = |i: usize| format!("y = {:e}, g = {:e} (x = {:e})", ys[i], gs[i], xs[i]);
    let emul = |i: usize| at_extremes(&[ys[i], gs[i]], || bwd_y_f32(op, kernel, ys[i], gs[i]));
    let tol = |i: usize| r::unary_bwd_y_tol(op, ys[i] as f64, gs[i] as f64);
    compare(&format!("{op:?} backward from the output"), dt, got, &want, tol, emul, show)?;
    if kernel.is_none() {
        return Ok(());
    }
    for i in 0..xs.len() {
        let (xv, yv, gv) = (xs[i] as f64, ys[i] as f64, gs[i] as f64);
        let exact = r::unary_bwd(op, xv, gv);
        if at_extremes(&[xs[i], ys[i], gs[i]], || 0.0).is_some() || !exact.is_finite() || !got[i].is_finite() {
            continue;
        }
        let err_y = (yv - r::unary_fwd(op, xv)).abs();
        let t = r::unary_bwd_y_tol(op, yv, gv);
        let carried =
            2.0 * r::unary_bwd_y_slope(op, yv, gv) * err_y + 3.0 * gv.abs() * (1.0 + yv.abs()) * err_y * err_y;
        if !close(dt, got[i], exact, Tol { rtol: t.rtol, atol: t.atol + carried }) {
            return Err(format!(
                "{op:?}: gradient from y {:e} != the derivative at x {exact:e} (y's error {err_y:e}) at {}",
                got[i],
                show(i)
            ));
        }
    }
    Ok(())
}
