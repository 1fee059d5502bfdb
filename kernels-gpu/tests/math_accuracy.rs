//! Accuracy of `kernels_gpu::math` against `f64` libm, and its special values.
//!
//! Each one-argument function is swept over every f32 bit pattern with a stride (both signs,
//! denormals, infinities and NaNs included) plus a list of boundary inputs, and the largest
//! error in ulp of the correctly rounded result is asserted against a per-function bound. The
//! bounds are the measured maxima of an exhaustive run over all 2^32 inputs (quoted next to
//! each), rounded up a little; the assertion is 2 ulp at most for every function. Special values
//! (NaN, infinities, signed zeros, overflow, underflow, the C99 pow table) are asserted exactly.
//! `cargo test -p kernels-gpu --test math_accuracy -- --nocapture` prints the table.

use kernels_gpu::math;
#[path = "support/pow_pairs.rs"]
mod pow_pairs;
use pow_pairs::{Rng, around, pow_pairs};
use std::f64::consts::PI;

/// |got - reference| in units of the f32 ulp at `reference` (the spacing of the f32 values
/// around it; 2^-149 in the denormal range). Both NaN: 0; one NaN: infinity; `got` infinite:
/// 0 if `reference` rounds to that infinity, infinity otherwise.
fn ulp_error(got: f32, reference: f64) -> f64 {
    if got.is_nan() || reference.is_nan() {
        return if got.is_nan() && reference.is_nan() { 0.0 } else { f64::INFINITY };
    }
    if got.is_infinite() || reference.is_infinite() {
        // `as f32` rounds to nearest, overflowing to infinity past f32::MAX + ulp/2.
        return if reference as f32 == got { 0.0 } else { f64::INFINITY };
    }
    let a = reference.abs();
    let ulp = if a < f64::from(f32::MIN_POSITIVE) {
        2f64.powi(-149)
    } else {
        let e = ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023;
        2f64.powi(e.min(127) - 23)
    };
    (f64::from(got) - reference).abs() / ulp
}

/// sin(pi x) and cos(pi x) in f64, with x reduced exactly first: x = k/2 + r, |r| <= 1/4,
/// so that pi * r is accurate to 2^-53 relative and so are sin and cos of it.
fn sincospi_ref(x: f32) -> (f64, f64) {
    let x = f64::from(x);
    if !x.is_finite() {
        return (f64::NAN, f64::NAN);
    }
    let k = (2.0 * x).round(); // exact: 2x is exact in f64
    let r = x - 0.5 * k; // exact
    let (s, c) = (libm::sin(PI * r), libm::cos(PI * r));
    match k.rem_euclid(4.0) as i32 {
        0 => (s, c),
        1 => (c, -s),
        2 => (-s, -c),
        _ => (-c, s),
    }
}

/// One row of the printed table.
struct Row {
    name: String,
    tested: u64,
    max_ulp: f64,
    worst: String,
}

fn threads() -> u64 {
    std::thread::available_parallelism().map_or(2, |n| n.get()).min(8) as u64
}

/// Largest error of `f` against `reference` over every `stride`-th f32 bit pattern (starting at
/// `start`) and over `extra`.
fn sweep1(name: &str, f: fn(f32) -> f32, reference: fn(f32) -> f64, stride: u64, start: u64, extra: &[f32]) -> Row {
    let nt = threads();
    let parts: Vec<(f64, f32, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..nt)
            .map(|t| {
                s.spawn(move || {
                    let (mut max, mut at, mut n) = (0.0f64, 0.0f32, 0u64);
                    let mut i = start + t * stride;
                    while i < 1 << 32 {
                        let x = f32::from_bits(i as u32);
                        let e = ulp_error(f(x), reference(x));
                        if e > max {
                            (max, at) = (e, x);
                        }
                        n += 1;
                        i += stride * nt;
                    }
                    (max, at, n)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut worst = (0.0f64, 0.0f32);
    let mut tested = 0;
    for (e, x, n) in parts {
        tested += n;
        if e > worst.0 {
            worst = (e, x);
        }
    }
    for &x in extra {
        let e = ulp_error(f(x), reference(x));
        if e > worst.0 {
            worst = (e, x);
        }
        tested += 1;
    }
    let (x, got) = (worst.1, f(worst.1));
    Row {
        name: name.to_string(),
        tested,
        max_ulp: worst.0,
        worst: format!("x = {x:e} -> {got:e}, reference {:e}", reference(x)),
    }
}

/// Bit-exact comparison that also accepts any NaN for NaN and tells -0 from +0.
#[track_caller]
fn same(got: f32, want: f32, what: &str) {
    let ok = if want.is_nan() { got.is_nan() } else { got.to_bits() == want.to_bits() };
    assert!(ok, "{what}: got {got:e} ({:#010x}), want {want:e}", got.to_bits());
}

const NAN: f32 = f32::NAN;
const INF: f32 = f32::INFINITY;
const DEN: f32 = 1.0e-45; // smallest denormal, 2^-149
const MAXF: f32 = f32::MAX;

/// Boundary inputs shared by the one-argument sweeps: zeros, denormals, the largest values,
/// powers of two and their neighbours.
fn common_extra() -> Vec<f32> {
    let mut v = vec![0.0, -0.0, INF, -INF, NAN, DEN, -DEN, MAXF, -MAXF];
    v.extend([f32::MIN_POSITIVE, -f32::MIN_POSITIVE, f32::from_bits(0x007f_ffff)]);
    // Every power of two, normal and denormal, and its neighbours.
    for b in (0..23).map(|k| 1u32 << k).chain((1..255).map(|e| e << 23)) {
        for x in [b - 1, b, b + 1].map(f32::from_bits) {
            v.extend([x, -x]);
        }
    }
    v
}

// Stride through the 2^32 bit patterns: odd, so the sign bit and every residue of the low
// mantissa bits are hit (34 million inputs per function), and chosen so the whole file runs in
// about 15 s on two cores; a stride of 7 would take 18 times as long. The exhaustive figures
// quoted below came from the same sweep with stride 1.
const STRIDE: u64 = 127;

// Bounds asserted by `accuracy`, per function: the maximum measured over all 2^32 inputs while
// writing math.rs (quoted; the strided sweep here sees a subset, so it reports at most that),
// rounded up. The requirement is 2 ulp; these tighter bounds catch any regression.
const EXP_ULP: f64 = 0.76; // exhaustive 0.7517 (a denormal result; 0.5673 for normal ones)
const EXPM1_ULP: f64 = 0.77; // exhaustive 0.7622
const LOG_ULP: f64 = 0.82; // exhaustive 0.8114
const LOG1P_ULP: f64 = 0.83; // exhaustive 0.8271
const TANH_ULP: f64 = 0.75; // exhaustive 0.7454
const ERF_ULP: f64 = 0.92; // exhaustive 0.9161
const SINPI_ULP: f64 = 0.76; // exhaustive 0.7500 (a denormal result; 0.6908 for normal ones)
const COSPI_ULP: f64 = 0.70; // exhaustive 0.6888
const POW_ULP: f64 = 0.77; // 0.7568 over 2^26 random pairs (a denormal result; 0.585 normal)
/// `fastmath::pow`, the kernels' pow (its CPU build: a correctly rounded reciprocal where the GPU
/// takes MUFU.RCP): the library's bound.
const FAST_POW_ULP: f64 = 2.0;
/// `fastmath::tanh`, the kernels' tanh (its CPU build divides where the GPU takes MUFU.RCP and a
/// Newton step): the library's bound.
const FAST_TANH_ULP: f64 = 2.0;

fn quarters() -> Vec<f32> {
    (-16..=16).map(|k| k as f32 * 0.25).collect()
}

#[test]
fn accuracy() {
    let ex = |v: &[&[f32]]| -> Vec<f32> {
        let mut e = common_extra();
        for s in v {
            e.extend_from_slice(s);
        }
        e
    };
    let f = f32::from_bits;
    let mut rows = Vec::new();

    // exp: the overflow threshold (0x42b17217 is the largest x with a finite result), the first
    // denormal result (-87.33655), ln 2^-149, the last nonzero result (0xc2cff1b4), and odd
    // multiples of ln2/2 where the reduction's n changes.
    let extra = ex(&[
        &around(&[f(0x42b1_7217), -87.336_55, -103.278_93, f(0xc2cf_f1b4)], 64),
        &around(&[0.346_573_6, -0.346_573_6, 1.039_720_8, 10.397_208], 64),
    ]);
    rows.push((sweep1("exp", math::exp, |x| libm::exp(x.into()), STRIDE, 1, &extra), EXP_ULP));

    let extra = ex(&[
        &around(&[f(0x42b1_7217), 0.346_573_6, -0.346_573_6, 1.039_720_8, -1.039_720_8], 64),
        &around(&[16.635_532, -16.635_532, 17.328_68, -17.328_68, -18.0], 64),
    ]);
    rows.push((sweep1("expm1", math::expm1, |x| libm::expm1(x.into()), STRIDE, 2, &extra), EXPM1_ULP));

    let extra = ex(&[&around(&[1.0, 2.0 / 3.0, 4.0 / 3.0, 0.5, 2.0, std::f32::consts::E], 256)]);
    rows.push((sweep1("log", math::log, |x| libm::log(x.into()), STRIDE, 3, &extra), LOG_ULP));

    let extra = ex(&[
        &around(&[-1.0, -0.5, -1.0 / 3.0, 1.0 / 3.0, 1.0, 2.0 / 3.0, -0.25, 0.5], 256),
        &around(&[2f32.powi(-24), -(2f32.powi(-25)), 2f32.powi(24)], 64),
    ]);
    rows.push((sweep1("log1p", math::log1p, |x| libm::log1p(x.into()), STRIDE, 4, &extra), LOG1P_ULP));

    let extra = ex(&[&around(&[0.55, -0.55, 0.549_306_1, 9.010_913, 10.0, 0.173_286_8], 128)]);
    rows.push((sweep1("tanh", math::tanh, |x| libm::tanh(x.into()), STRIDE, 5, &extra), TANH_ULP));
    let fast_tanh = kernels_gpu::fastmath::tanh;
    rows.push((sweep1("fasttanh", fast_tanh, |x| libm::tanh(x.into()), STRIDE, 5, &extra), FAST_TANH_ULP));

    let extra = ex(&[&around(&[1.0, -1.0, 3.919_205_2, 3.95, 0.5, 2.0], 256)]);
    rows.push((sweep1("erf", math::erf, |x| libm::erf(x.into()), STRIDE, 6, &extra), ERF_ULP));

    let extra = ex(&[&around(&quarters(), 64)]);
    rows.push((sweep1("sinpi", math::sinpi, |x| sincospi_ref(x).0, STRIDE, 7, &extra), SINPI_ULP));
    rows.push((sweep1("cospi", math::cospi, |x| sincospi_ref(x).1, STRIDE, 8, &extra), COSPI_ULP));

    let pairs = pow_pairs();
    rows.push((pow_row("pow", math::pow, &pairs), POW_ULP));
    rows.push((pow_row("fastpow", kernels_gpu::fastmath::pow, &pairs), FAST_POW_ULP));

    println!("\n{:<8} {:>10} {:>8}   worst input", "function", "inputs", "max ulp");
    for (r, _) in &rows {
        println!("{:<8} {:>10} {:>8.4}   {}", r.name, r.tested, r.max_ulp, r.worst);
    }
    for (r, bound) in &rows {
        assert!(r.max_ulp <= *bound, "{}: max error {} ulp > {bound} at {}", r.name, r.max_ulp, r.worst);
    }
}

fn pow_ref(x: f32, y: f32) -> f64 {
    libm::pow(f64::from(x), f64::from(y))
}

/// Largest pow error over a list of (x, y) pairs, split over the threads.
fn pow_worst(pow: fn(f32, f32) -> f32, pairs: &[(f32, f32)]) -> (f64, f32, f32) {
    let nt = threads() as usize;
    let chunk = pairs.len().div_ceil(nt).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = pairs
            .chunks(chunk)
            .map(|c| {
                s.spawn(move || {
                    let mut w = (0.0f64, 0.0f32, 0.0f32);
                    for &(x, y) in c {
                        let e = ulp_error(pow(x, y), pow_ref(x, y));
                        if e > w.0 {
                            w = (e, x, y);
                        }
                    }
                    w
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).fold((0.0, 0.0, 0.0), |a, b| if b.0 > a.0 { b } else { a })
    })
}

fn pow_row(name: &str, pow: fn(f32, f32) -> f32, pairs: &[(f32, f32)]) -> Row {
    let (e, x, y) = pow_worst(pow, pairs);
    Row {
        name: name.to_string(),
        tested: pairs.len() as u64,
        max_ulp: e,
        worst: format!("x = {x:e}, y = {y:e} -> {:e}, reference {:e}", pow(x, y), pow_ref(x, y)),
    }
}

#[test]
fn exp_expm1_special_values() {
    let f = f32::from_bits;
    same(math::exp(NAN), NAN, "exp(NaN)");
    same(math::exp(INF), INF, "exp(inf)");
    same(math::exp(-INF), 0.0, "exp(-inf)");
    same(math::exp(0.0), 1.0, "exp(+0)");
    same(math::exp(-0.0), 1.0, "exp(-0)");
    same(math::exp(DEN), 1.0, "exp(denormal)");
    same(math::exp(1.0), std::f32::consts::E, "exp(1)");
    assert!(math::exp(f(0x42b1_7217)).is_finite(), "exp(88.7228317) is finite");
    same(math::exp(f(0x42b1_7218)), INF, "exp(88.7228394) overflows");
    same(math::exp(MAXF), INF, "exp(max)");
    same(math::exp(f(0xc2cf_f1b4)), DEN, "exp(-103.972076) = 2^-149");
    same(math::exp(f(0xc2cf_f1b5)), 0.0, "exp(-103.972084) underflows to +0");
    same(math::exp(-MAXF), 0.0, "exp(-max)");
    assert!(math::exp(-100.0) > 0.0 && math::exp(-100.0) < f32::MIN_POSITIVE, "gradual underflow");

    same(math::expm1(NAN), NAN, "expm1(NaN)");
    same(math::expm1(INF), INF, "expm1(inf)");
    same(math::expm1(-INF), -1.0, "expm1(-inf)");
    same(math::expm1(0.0), 0.0, "expm1(+0)");
    same(math::expm1(-0.0), -0.0, "expm1(-0)");
    same(math::expm1(DEN), DEN, "expm1(denormal)");
    same(math::expm1(-DEN), -DEN, "expm1(-denormal)");
    same(math::expm1(1e-30), 1e-30, "expm1(1e-30)");
    assert!(math::expm1(f(0x42b1_7217)).is_finite(), "expm1(88.7228317) is finite");
    same(math::expm1(f(0x42b1_7218)), INF, "expm1(88.7228394) overflows");
    same(math::expm1(-20.0), -1.0, "expm1(-20)");
    same(math::expm1(-MAXF), -1.0, "expm1(-max)");
}

#[test]
fn log_log1p_special_values() {
    same(math::log(NAN), NAN, "log(NaN)");
    same(math::log(0.0), -INF, "log(+0)");
    same(math::log(-0.0), -INF, "log(-0)");
    same(math::log(-1.0), NAN, "log(-1)");
    same(math::log(-DEN), NAN, "log(-denormal)");
    same(math::log(-INF), NAN, "log(-inf)");
    same(math::log(INF), INF, "log(inf)");
    same(math::log(1.0), 0.0, "log(1) = +0");
    same(math::log(DEN), -103.278_93, "log(2^-149)");
    same(math::log(MAXF), 88.722_84, "log(max)");

    same(math::log1p(NAN), NAN, "log1p(NaN)");
    same(math::log1p(-1.0), -INF, "log1p(-1)");
    same(math::log1p(-1.000_000_1), NAN, "log1p(x < -1)");
    same(math::log1p(-INF), NAN, "log1p(-inf)");
    same(math::log1p(INF), INF, "log1p(inf)");
    same(math::log1p(0.0), 0.0, "log1p(+0)");
    same(math::log1p(-0.0), -0.0, "log1p(-0)");
    same(math::log1p(DEN), DEN, "log1p(denormal)");
    same(math::log1p(-DEN), -DEN, "log1p(-denormal)");
    same(math::log1p(1e-30), 1e-30, "log1p(1e-30)");
    same(math::log1p(MAXF), 88.722_84, "log1p(max)");
}

#[test]
fn tanh_erf_special_values() {
    let fast_tanh = kernels_gpu::fastmath::tanh as fn(f32) -> f32;
    for (name, f) in [("tanh", math::tanh as fn(f32) -> f32), ("fastmath::tanh", fast_tanh), ("erf", math::erf)] {
        same(f(NAN), NAN, name);
        same(f(INF), 1.0, name);
        same(f(-INF), -1.0, name);
        same(f(0.0), 0.0, name);
        same(f(-0.0), -0.0, name);
        same(f(20.0), 1.0, name);
        same(f(-20.0), -1.0, name);
        same(f(MAXF), 1.0, name);
        same(f(-MAXF), -1.0, name);
    }
    same(math::tanh(DEN), DEN, "tanh(denormal)");
    same(math::tanh(-DEN), -DEN, "tanh(-denormal)");
    same(math::tanh(1e-30), 1e-30, "tanh(1e-30)");
    same(math::tanh(9.1), 1.0, "tanh(9.1) rounds to 1");
    for (x, what) in [(DEN, "denormal"), (-DEN, "-denormal"), (1e-30, "1e-30")] {
        same(fast_tanh(x), x, &format!("fastmath::tanh({what})"));
    }
    same(fast_tanh(9.1), 1.0, "fastmath::tanh(9.1) rounds to 1");
    same(math::erf(3.95), 1.0, "erf(3.95) rounds to 1");
    // Denormals: erf(x) = 1.128 x, rounded to the denormal grid.
    let d = f32::from_bits;
    same(math::erf(d(1)), d(1), "erf(2^-149) = 2^-149");
    same(math::erf(d(3)), d(3), "erf(3 * 2^-149): 3.39 rounds to 3");
    same(math::erf(d(4)), d(5), "erf(4 * 2^-149): 4.51 rounds to 5");
    same(math::erf(-d(4)), -d(5), "erf(-4 * 2^-149)");
}

#[test]
fn sinpi_cospi_special_values() {
    for (name, f) in [("sinpi", math::sinpi as fn(f32) -> f32), ("cospi", math::cospi)] {
        same(f(NAN), NAN, name);
        same(f(INF), NAN, name);
        same(f(-INF), NAN, name);
    }
    same(math::sinpi(0.0), 0.0, "sinpi(+0)");
    same(math::sinpi(-0.0), -0.0, "sinpi(-0)");
    same(math::sinpi(DEN), 4.0e-45, "sinpi(2^-149) = 3 * 2^-149");
    for n in [1.0f32, 2.0, 3.0, 7.0, 1e6, 8388609.0, 16777216.0, 1e30, MAXF] {
        same(math::sinpi(n), 0.0, "sinpi(positive integer) = +0");
        same(math::sinpi(-n), -0.0, "sinpi(negative integer) = -0");
    }
    same(math::sinpi(0.5), 1.0, "sinpi(1/2)");
    same(math::sinpi(1.5), -1.0, "sinpi(3/2)");
    same(math::sinpi(-0.5), -1.0, "sinpi(-1/2)");
    same(math::sinpi(2.5), 1.0, "sinpi(5/2)");
    same(math::sinpi(4194304.5), 1.0, "sinpi(2^22 + 1/2)");
    same(math::sinpi(0.25), std::f32::consts::FRAC_1_SQRT_2, "sinpi(1/4)");
    same(math::sinpi(1.0 / 6.0), 0.5, "sinpi(1/6)");

    same(math::cospi(0.0), 1.0, "cospi(+0)");
    same(math::cospi(-0.0), 1.0, "cospi(-0)");
    same(math::cospi(DEN), 1.0, "cospi(denormal)");
    for h in [0.5f32, 1.5, 2.5, 1e6 + 0.5, 4194303.5] {
        same(math::cospi(h), 0.0, "cospi(n + 1/2) = +0");
        same(math::cospi(-h), 0.0, "cospi(-(n + 1/2)) = +0");
    }
    same(math::cospi(1.0), -1.0, "cospi(1)");
    same(math::cospi(-3.0), -1.0, "cospi(-3)");
    same(math::cospi(2.0), 1.0, "cospi(2)");
    same(math::cospi(8388609.0), -1.0, "cospi(2^23 + 1)");
    same(math::cospi(16777216.0), 1.0, "cospi(2^24)");
    same(math::cospi(MAXF), 1.0, "cospi(max)");
    same(math::cospi(0.25), std::f32::consts::FRAC_1_SQRT_2, "cospi(1/4)");
}

#[test]
fn pow_special_values() {
    check_pow_special_values(math::pow);
}

#[test]
fn fastpow_special_values() {
    check_pow_special_values(kernels_gpu::fastmath::pow);
}

/// C99 Annex F's pow table, and a few exact cases, for `pow`.
fn check_pow_special_values(pow: fn(f32, f32) -> f32) {
    // C99 Annex F, F.10.4.4.
    for x in [NAN, -NAN, INF, -INF, 0.0, -0.0, -3.0, 2.0, DEN] {
        same(pow(x, 0.0), 1.0, "pow(x, +0) = 1 for any x");
        same(pow(x, -0.0), 1.0, "pow(x, -0) = 1 for any x");
    }
    for y in [NAN, INF, -INF, 0.5, -7.0, 1e30, DEN] {
        same(pow(1.0, y), 1.0, "pow(1, y) = 1 for any y");
    }
    same(pow(NAN, 2.0), NAN, "pow(NaN, 2)");
    same(pow(2.0, NAN), NAN, "pow(2, NaN)");
    same(pow(-1.0, NAN), NAN, "pow(-1, NaN)");
    same(pow(0.0, -3.0), INF, "pow(+0, odd y < 0)");
    same(pow(-0.0, -3.0), -INF, "pow(-0, odd y < 0)");
    same(pow(0.0, -2.0), INF, "pow(+0, even y < 0)");
    same(pow(-0.0, -2.0), INF, "pow(-0, even y < 0)");
    same(pow(-0.0, -0.5), INF, "pow(-0, non-integer y < 0)");
    same(pow(-0.0, -INF), INF, "pow(-0, -inf)");
    same(pow(0.0, 3.0), 0.0, "pow(+0, odd y > 0)");
    same(pow(-0.0, 3.0), -0.0, "pow(-0, odd y > 0)");
    same(pow(-0.0, 2.0), 0.0, "pow(-0, even y > 0)");
    same(pow(-0.0, 0.5), 0.0, "pow(-0, non-integer y > 0)");
    same(pow(-0.0, 1e30), 0.0, "pow(-0, huge y)");
    same(pow(-1.0, INF), 1.0, "pow(-1, inf)");
    same(pow(-1.0, -INF), 1.0, "pow(-1, -inf)");
    for x in [0.5f32, -0.5, 0.0, -0.0, DEN, 0.999_999_94] {
        same(pow(x, -INF), INF, "pow(|x| < 1, -inf)");
        same(pow(x, INF), 0.0, "pow(|x| < 1, inf)");
    }
    for x in [2.0f32, -2.0, INF, -INF, 1.000_000_1, MAXF] {
        same(pow(x, -INF), 0.0, "pow(|x| > 1, -inf)");
        same(pow(x, INF), INF, "pow(|x| > 1, inf)");
    }
    same(pow(-INF, -3.0), -0.0, "pow(-inf, odd y < 0)");
    same(pow(-INF, -2.0), 0.0, "pow(-inf, even y < 0)");
    same(pow(-INF, -0.5), 0.0, "pow(-inf, non-integer y < 0)");
    same(pow(-INF, 3.0), -INF, "pow(-inf, odd y > 0)");
    same(pow(-INF, 2.0), INF, "pow(-inf, even y > 0)");
    same(pow(-INF, 0.5), INF, "pow(-inf, non-integer y > 0)");
    same(pow(INF, -2.0), 0.0, "pow(inf, y < 0)");
    same(pow(INF, DEN), INF, "pow(inf, y > 0)");
    for x in [-2.0f32, -0.5, -1.0, -DEN, -MAXF] {
        same(pow(x, 0.5), NAN, "pow(x < 0, non-integer y)");
        same(pow(x, -2.5), NAN, "pow(x < 0, non-integer y)");
    }
    // Negative base, integer exponent: the sign follows the parity of y.
    same(pow(-2.0, 3.0), -8.0, "pow(-2, 3)");
    same(pow(-2.0, 2.0), 4.0, "pow(-2, 2)");
    same(pow(-2.0, -1.0), -0.5, "pow(-2, -1)");
    same(pow(-2.0, -2.0), 0.25, "pow(-2, -2)");
    same(pow(-1.0, 16777215.0), -1.0, "pow(-1, 2^24 - 1)");
    same(pow(-1.0, 16777216.0), 1.0, "pow(-1, 2^24)");
    same(pow(-1.0, 1e30), 1.0, "pow(-1, 1e30)");
    same(pow(-0.5, 3.0), -0.125, "pow(-0.5, 3)");
    same(pow(-10.0, 39.0), -INF, "pow(-10, 39) overflows with its sign");
    same(pow(-10.0, -47.0), -0.0, "pow(-10, -47) underflows with its sign");
    same(pow(-10.0, 40.0), INF, "pow(-10, 40)");
    same(pow(-2.0, -149.0), -DEN, "pow(-2, -149)");
    same(pow(2.0, -150.0), 0.0, "pow(2, -150) rounds to +0 (tie to even)");
    same(pow(2.0, 127.0), 2f32.powi(127), "pow(2, 127)");
    same(pow(2.0, 128.0), INF, "pow(2, 128)");
    // Exact cases.
    same(pow(2.0, 0.5), std::f32::consts::SQRT_2, "pow(2, 1/2)");
    same(pow(3.0, 4.0), 81.0, "pow(3, 4)");
    same(pow(10.0, 10.0), 1e10, "pow(10, 10)");
    same(pow(4.0, -0.5), 0.5, "pow(4, -1/2)");
    same(pow(1.0 + f32::EPSILON, 8388608.0), std::f32::consts::E, "(1 + 2^-23)^(2^23)");
}

#[test]
fn sqrt_and_fma_are_correctly_rounded() {
    let mut rng = Rng(7);
    for _ in 0..100_000 {
        let a = f32::from_bits(rng.next() as u32);
        let b = f32::from_bits(rng.next() as u32);
        let c = f32::from_bits(rng.next() as u32);
        same(math::sqrt(a), a.sqrt(), "sqrt");
        same(math::fma(a, b, c), a.mul_add(b, c), "fma");
    }
}
