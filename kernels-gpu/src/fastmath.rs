//! The math the kernels call: [`crate::math`], except where the GPU has a faster way to the
//! same accuracy bound (<= 2 ulp, measured on the GPU by `tests/math_gpu.rs`).
//!
//! Why: `math` reaches ~0.5-1 ulp with double-f32 tails, which costs instructions. In a kernel
//! that streams bf16 at 3 TB/s, each element may cost about 45 instructions before the SMs, not
//! memory, set the pace; GELU's backward spends that on erf and exp alone. The GPU's special
//! function unit computes 2^f (`ex2.approx`, MUFU.EX2) in one instruction with a relative error
//! near 2^-22; applied to an exactly reduced argument it gives e^x within 2 ulp, as CUDA's own
//! `expf` does. The CPU has no such instruction and keeps `math`'s versions, so on the host these
//! functions are exactly `math`'s (the CPU tests check formulas, the GPU tests the GPU).

pub use crate::math::{cospi, expm1, fma, log, log1p, pow, sinpi, sqrt, tanh};

/// e^x, <= 2 ulp.
#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    crate::math::exp(x)
}

/// log2(e) as a double-f32.
#[cfg(target_arch = "nvptx64")]
const LOG2E: f32 = 1.442_695; // 0x3fb8aa3b
#[cfg(target_arch = "nvptx64")]
const LOG2E_LO: f32 = 1.925_963e-8; // log2(e) - LOG2E

/// e^x, <= 2 ulp (measured: see the README's accuracy table).
///
/// Method: x log2(e) = h + l as a double-f32 (`fma` gives the product's rounding error), then
/// h = j + f with j an integer and |f| <= 1/2 exactly, so 2^(f + l) is the only approximate step:
/// `ex2.approx` on [-1/2, 1/2] (result in [0.70, 1.42], never denormal). 2^j is applied as two
/// powers of two, the first product exact. Overflow to +inf above 88.72, gradual underflow, +0
/// below -103.97; NaN stays NaN.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Two independent selects (NaN passes through both). A chained `if / else if` became a
    // branch around the clamp in SASS.
    let xc = if x > 89.0 { 89.0 } else { x };
    let xc = if xc < -104.0 { -104.0 } else { xc };
    let h = xc * LOG2E;
    let l = fma(xc, LOG2E, -h) + xc * LOG2E_LO;
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23: (v + SHIFT) - SHIFT rounds |v| < 2^22
    let t = h + SHIFT;
    let j = t - SHIFT;
    let f = (h - j) + l;
    let p = crate::prim::ex2_approx(f);
    // j as an integer, read from t's low mantissa bits (t is in [2^23, 2^24), where the ulp is
    // 1): an integer subtraction instead of F2I, which issues at a quarter of the FP rate. In
    // [-151, 129]; for a NaN x it is garbage, and p is NaN.
    let n = t.to_bits() as i32 - SHIFT.to_bits() as i32;
    // 2^n as two normal powers of two: p * 2^n1 is exact, so the second product is the only
    // rounding (to a denormal, or to infinity on overflow).
    let n1 = n >> 1;
    let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    (p * pow2(n1)) * pow2(n - n1)
}

/// erf(x), <= 2 ulp: `math::erf`'s method with the fast `exp` in its large branch.
///
/// For |x| < 1, erf x = x + x P(x^2) as in `math`. For |x| >= 1, erf |x| = 1 - e^-g(|x|) with
/// `math`'s polynomial for g, summed in plain f32: the result is in [0.84, 1), where an ulp is
/// 2^-24, and e^-g <= 0.16 scales both exp's 2 ulp and g's rounding down to about 1 ulp in all.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    erf_with(x, exp)
}

/// erf(x) for f16/bf16 results: [`erf`] with its `e^-g` from the special function unit alone
/// ([`exp_for`]'s half path). For |x| >= 1 the result is 1 - e^-g with e^-g <= 0.16 off by
/// 8e-6 relative: about 1.3e-6 absolute, 1/370 of an f16 ulp at 1 (and of a bf16 one, 1/3000).
#[inline(always)]
pub fn erf_half(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        erf_with(x, exp_for::<crate::F16>)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        erf(x)
    }
}

#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn erf_with(x: f32, exp: impl Fn(f32) -> f32) -> f32 {
    let t = x.abs();
    let z = x * x;
    let mut p = 7.806_904e-5;
    p = fma(p, z, -7.997_853e-4);
    p = fma(p, z, 5.187_162e-3);
    p = fma(p, z, -2.685_334_7e-2);
    p = fma(p, z, 1.128_357_9e-1);
    let p = fma(z, -3.761_262_6e-1, fma(z, z * p, 1.283_791_7e-1));
    let small = fma(x, p, x);
    const G1: f32 = 1.849_605_6; // g(1) = -log(erfc(1))
    let u = (if t > 3.95 { 3.95 } else { t }) - 1.0;
    let mut g = 2.157_646_3e-5;
    g = fma(g, u, -2.898_124_2e-4);
    g = fma(g, u, 2.012_317e-3);
    g = fma(g, u, -1.004_651_9e-2);
    g = fma(g, u, 4.156_341e-2);
    g = fma(g, u, 8.431_071e-1);
    g = fma(g, u, 2.638_967_5);
    let large = 1.0 - exp(-fma(u, g, G1));
    // NaN takes the small path, which yields NaN; erf is odd, copysign keeps erf(-0) = -0.
    (if t >= 1.0 { large } else { small }).copysign(x)
}

#[cfg(not(target_arch = "nvptx64"))]
pub use crate::math::erf;

/// e^x to the accuracy the storage type `T` can show: [`exp`] (<= 2 ulp of f32) for f32, and
/// for f16 and bf16 the special function unit alone, `ex2.approx(x * log2(e))`: relative error
/// below 2^-22 + |x| log2(e) 2^-24 (the product's rounding), under 8e-6 for |x| <= 88, which is
/// 1/60 of an f16 ulp (2^-11) and 1/500 of a bf16 one. Two instructions instead of about twenty
/// lets a softmax over bf16, which moves two elements per four bytes, keep up with memory.
#[inline(always)]
pub fn exp_for<T: crate::Elem>(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        if T::DTYPE != crate::DType::F32 {
            return crate::prim::ex2_approx(x * LOG2E);
        }
    }
    exp(x)
}
