//! The math the kernels call: [`crate::math`], except where the GPU has a faster way to the
//! same accuracy bound (<= 2 ulp, measured on the GPU by `tests/math_gpu.rs`).
//!
//! Why: `math` reaches ~0.5-1 ulp with double-f32 tails, which costs instructions. In a kernel
//! that streams bf16 at 3 TB/s, each element may cost about 45 instructions before the SMs, not
//! memory, set the pace; GELU's backward spends that on erf and exp alone. The GPU's special
//! function unit computes 2^f (`ex2.approx`, MUFU.EX2) in one instruction with a relative error
//! near 2^-22; applied to an exactly reduced argument it gives e^x within 2 ulp, as CUDA's own
//! `expf` does. The CPU has no such instruction and keeps `math`'s versions, so on the host these
//! functions are exactly `math`'s (the CPU tests check formulas, the GPU tests the GPU). The one
//! exception is [`pow`]: its algorithm is this file's own on both machines, with a correctly
//! rounded reciprocal on the CPU where the GPU takes MUFU.RCP's estimate, so that the CPU
//! accuracy test (`kernels-gpu/tests/math_accuracy.rs`) measures the method the GPU runs.

pub use crate::math::{cospi, expm1, fma, log, log1p, recip, rsqrt, sinpi, sqrt};

/// e^x, <= 2 ulp.
#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    crate::math::exp(x)
}

/// [`exp`]; `FTZ` picks the GPU's form of its last step, and the CPU has one.
#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
pub fn exp_with<const FTZ: bool>(x: f32) -> f32 {
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
    exp_with::<true>(x)
}

/// [`exp`] with the final 2^f by `ex2.approx.ftz` (`FTZ`, one MUFU.EX2) or by `ex2.approx`
/// (a compare and two predicated multiplies more). Both give the same bits here, since f is
/// within [-0.51, 0.51]; the second is the code the GEMM epilogue keeps (see `gemm::activate`).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn exp_with<const FTZ: bool>(x: f32) -> f32 {
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
    // f is within [-0.51, 0.51]: 2^f is never denormal, and the flush changes nothing.
    let p = if FTZ { crate::prim::ex2_approx_ftz(f) } else { crate::prim::ex2_approx(f) };
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
    erf_with::<true>(x)
}

/// [`erf`] with [`exp_with::<FTZ>`](exp_with) in its large branch.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn erf_with<const FTZ: bool>(x: f32) -> f32 {
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
    let large = 1.0 - exp_with::<FTZ>(-fma(u, g, G1));
    // NaN takes the small path, which yields NaN; erf is odd, copysign keeps erf(-0) = -0.
    (if t >= 1.0 { large } else { small }).copysign(x)
}

#[cfg(not(target_arch = "nvptx64"))]
pub use crate::math::erf;

/// [`erf`]; `FTZ` as in [`exp_with`].
#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
pub fn erf_with<const FTZ: bool>(x: f32) -> f32 {
    crate::math::erf(x)
}

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

/// `e^t - 1` for the ELU family's negative side (`t <= 0`), to the accuracy the storage type `T`
/// can show, in about a third of [`expm1`]'s instructions: on `[-1, 0]` a Taylor polynomial
/// (degree 10 for f32, remainder under `1/11! = 2^-25.3` relative; degree 7 for f16/bf16, under
/// `1/8! = 2^-15.3`), below -1 `exp_for::<T>(t) - 1`, which does not cancel there (`e^t <= 1/e`:
/// the exp's error enters scaled by `e^t / (1 - e^t) < 0.6`). Both are computed and one
/// selected, so a warp of mixed inputs does not branch. `t > 0` (CELU with a negative alpha)
/// takes the accurate [`expm1`]. `-0` stays `-0`, `-inf` gives -1, NaN gives NaN.
#[inline(always)]
pub fn expm1_elu<T: crate::Elem>(t: f32) -> f32 {
    if t > 0.0 {
        return expm1(t);
    }
    let e = exp_for::<T>(t) - 1.0;
    // The coefficients 1/(k+1)! from the highest, by Horner's rule; f16/bf16 start at t^6.
    let mut q = 1.0 / 5_040.0;
    if T::DTYPE == crate::DType::F32 {
        q = fma(fma(fma(1.0 / 3_628_800.0, t, 1.0 / 362_880.0), t, 1.0 / 40_320.0), t, 1.0 / 5_040.0);
    }
    q = fma(q, t, 1.0 / 720.0);
    q = fma(q, t, 1.0 / 120.0);
    q = fma(q, t, 1.0 / 24.0);
    q = fma(q, t, 1.0 / 6.0);
    q = fma(fma(q, t, 0.5), t, 1.0);
    let p = t * q;
    if t < -1.0 { e } else { p }
}

/// The logistic function `1 / (1 + e^-x)` to the accuracy f16 and bf16 can show (relative error
/// about 2^-21), in six instructions around MUFU.EX2 and MUFU.RCP, both with `.ftz`: the forms
/// that keep denormals took about seven more per element (the SASS of the bf16 fused
/// `silu(x * scale + bias)`: 296 instructions per 16 elements against 183). Neither flush
/// changes a result:
/// - e^-x is denormal only for x > 87.3, where 1 + e^-x rounds to 1 anyway;
/// - the reciprocal is taken of y 2^-32 (y = 1 + e^-x >= 1, so y 2^-32 is normal and its
///   reciprocal at least 2^-96), then scaled by 2^-32 exactly, rounding gradually into the
///   denormals that bf16 holds (sigmoid(-88) = 6e-39 stays 6e-39).
///
/// 0 at x = -inf, 1 at +inf, NaN for NaN. On the CPU, `1 / (1 + exp(-x))`.
#[inline(always)]
pub fn sigmoid_half(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        const TWO_M32: f32 = f32::from_bits(0x2f80_0000); // 2^-32
        let y = 1.0 + crate::prim::ex2_approx_ftz(-x * LOG2E);
        crate::prim::rcp_approx_ftz(y * TWO_M32) * TWO_M32
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        1.0 / (1.0 + exp(-x))
    }
}

/// `tanh(x)` to the accuracy f16 and bf16 can show (relative error below 2^-20): `(1 - e) / (1 +
/// e)` with `e = e^-2|x|` from MUFU.EX2 and the quotient by MUFU.RCP, the sign put back; below
/// |x| = 1/8, where `1 - e` would cancel (its absolute error 2^-22 is 2^-22 / 2|x| relative), the
/// odd series `x (1 - x^2/3 + 2 x^4/15)`, whose remainder is under 2^-21 relative there. The
/// accurate [`tanh`] (range split, double-f32 steps: about twice the instructions in the bf16
/// small entry) left the bf16 forward behind PyTorch's at 2^22 elements (docs/worklog.md,
/// 2026-11-26e); this gives the same bits as PyTorch's there. +-1 at +-inf (e flushes to 0), -0 at
/// -0, NaN for NaN. On the CPU, [`tanh`].
#[inline(always)]
pub fn tanh_half(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let a = x.abs();
        let e = crate::prim::ex2_approx_ftz(-2.0 * LOG2E * a);
        let large = (1.0 - e) * crate::prim::rcp_approx_ftz(1.0 + e);
        let a2 = a * a;
        let small = a * fma(a2, fma(a2, 2.0 / 15.0, -1.0 / 3.0), 1.0);
        // NaN fails `a < 0.125` and stays NaN through `large`.
        (if a < 0.125 { small } else { large }).copysign(x)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        tanh(x)
    }
}

/// 2^x by the special function unit, denormal results flushed to zero (`ex2.approx.ftz`, one
/// instruction; relative error about 2^-22). On the CPU, `math::pow(2, x)` flushed likewise.
#[inline(always)]
pub fn exp2_ftz(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        crate::prim::ex2_approx_ftz(x)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        let r = crate::math::pow(2.0, x);
        if r < f32::MIN_POSITIVE { 0.0 } else { r }
    }
}

// The standard normal tail Phi(-s) = 2^P(s) on 0 <= s < 6, P of degree 10 with P(0) = -1
// exactly: a weighted least-squares fit (Lawson's iteration) of log2 Phi(-s), weighted so that
// both the relative error of Phi(-s) (what GELU's negative side shows) and its absolute error
// near s = 0 (what 1 - Phi(-s) shows) are small. Evaluated as here, in f32 Horner, over 10^4
// points against mpmath: |P - log2 Phi(-s)| <= 2^-17.7, so Phi(-s) is within 2^-18.2 relative,
// and within 2^-24.7 absolute. MUFU.EX2 adds about 2^-22 relative, which dominates the absolute
// error near s = 0 (Phi(-s) up to 1/2): measured on the H100 over 70M inputs
// (`tests/math_gpu.rs`), at most 2^-23 absolute.
const NORMAL_TAIL: [f32; 10] = [
    -1.151_105_9,
    -0.459_202_74,
    -5.250_545e-2,
    7.052_842_5e-3,
    -9.398_526e-5,
    -2.316_090_8e-4,
    6.190_374_6e-5,
    -8.395_325e-6,
    6.141_071e-7,
    -1.915_742_6e-8,
];

/// Phi(x), the standard normal CDF, in about seventeen instructions: one polynomial and one
/// MUFU.EX2 for the tail Phi(-|x|), where `0.5 (1 + erf(x / sqrt 2))` costs two polynomials, a
/// range select and an exp. Error bound (checked on the GPU by `tests/math_gpu.rs`): 2^-17.5
/// relative on the lower tail (x < 0; the fit alone is 2^-18.2), so GELU's negative side keeps
/// its relative accuracy instead of cancelling in 1 + erf; 2^-22.5 absolute everywhere. For |x| >= 6 the tail is 0: Phi(-6) = 1e-9, and x Phi(x) = x * 0 keeps PyTorch's
/// GELU(-inf) = NaN. NaN gives NaN.
#[inline(always)]
pub fn normal_cdf(x: f32) -> f32 {
    let s = x.abs();
    let c = &NORMAL_TAIL;
    let mut p = c[9];
    p = fma(p, s, c[8]);
    p = fma(p, s, c[7]);
    p = fma(p, s, c[6]);
    p = fma(p, s, c[5]);
    p = fma(p, s, c[4]);
    p = fma(p, s, c[3]);
    p = fma(p, s, c[2]);
    p = fma(p, s, c[1]);
    p = fma(p, s, c[0]);
    p = fma(p, s, -1.0);
    // The select is on the argument (2^-inf = 0; a select on the result became a branch
    // around the MUFU), and written so that NaN keeps p (NaN) and gives NaN.
    let tail = exp2_ftz(if s >= 6.0 { f32::NEG_INFINITY } else { p });
    if x < 0.0 { tail } else { 1.0 - tail }
}

/// phi(x) = e^(-x^2 / 2) / sqrt(2 pi), as 2^(x^2 (-log2(e) / 2) - log2(sqrt(2 pi))) by MUFU.EX2.
/// The rounding of x^2 enters the exponent as 0.72 x^2 2^-24, so the relative error is about
/// 2^-22 + x^2 2^-24.5 (1e-6 at |x| = 6, where phi is 6e-9); zero beyond |x| = 13.2 (flushed
/// denormals). Infinite x gives 0, NaN gives NaN.
#[inline(always)]
pub fn normal_pdf(x: f32) -> f32 {
    const HALF_LOG2E: f32 = 0.721_347_5; // log2(e) / 2
    const LOG2_SQRT_2PI: f32 = 1.325_748_1; // log2(sqrt(2 pi))
    exp2_ftz(fma(x * x, -HALF_LOG2E, -LOG2_SQRT_2PI))
}

// ---------------------------------------------------------------------------------------------
// pow.
//
// `math::pow` carries log2 x to 2^-36 so that x^y is within 0.6 ulp; at 153 SASS instructions an
// element the pow kernel was compute-bound, well behind PyTorch's (the H100 issues about 90 an
// element at the copy's pace; docs/worklog.md, 2026-11-24e). The library's bound is 2 ulp, which
// needs much less: an error d in y log2 x changes x^y by d ln 2 relative, and |y log2 x| <= 150
// wherever the result is finite and nonzero, so log2 x within 2^-30.5 relative costs at most 150
// 2^-30.5 ln2 2^24 = 1.1 ulp (a relative error e is e 2^24 ulp at worst). With an exp2 of 0.8 ulp
// that is under 2 ulp everywhere, and most of the time far under (measured: see `pow`).

/// A reciprocal estimate for `d` in [1.7, 2.42]: MUFU.RCP alone on the GPU (relative error about
/// 2^-23, no Newton step: [`log2_split`] corrects its quotient with an exact remainder anyway), the
/// correctly rounded `1 / d` on the CPU.
#[inline(always)]
fn rcp_estimate(d: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        crate::prim::rcp_approx_ftz(d)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        1.0 / d
    }
}

/// 2^k for k in [-126, 127] (garbage, but no panic, outside).
#[inline(always)]
fn pow2i(k: i32) -> f32 {
    f32::from_bits((k.wrapping_add(127) as u32) << 23)
}

/// log2(a) as hi + lo, relative error under 2^-31 (estimated: the terms below), for finite
/// a > 0, denormals included; hi = -inf at a = 0 and +inf at +inf; garbage, but no panic, for NaN.
///
/// `math::log2_ext`'s method with a shorter tail: a = 2^e m, m in [sqrt(1/2), sqrt(2)),
/// f = m - 1, s = f / (m + 1) as sh + sl, log2 m = s (K1 + c), c = s^2 (K3 + s^2 R(s^2)) below
/// 0.029 (R: `math::log2_ext`'s fit). K1 + c and the last product are double-f32 (they carry
/// the result); c itself is f32, with sl's part of s^2 taken in at first order: its rounding, and
/// that of sh^2, are each 2^-25 of 0.029, 2^-31.6 of K1. `math::log2_ext` carried c, K3 and
/// s^2 as double-f32 too. Measured: pow within 1.28 ulp on the CPU (the pairs of
/// `tests/math_accuracy.rs`), the same as with sh^2's rounding and K3's low part taken in (three
/// instructions more an element).
#[inline(always)]
fn log2_split(a: f32) -> (f32, f32) {
    const K1H: f32 = 2.88539; // 2 / ln 2 = K1H + K1L
    const K1L: f32 = 3.851926e-8;
    // 2 / (3 ln 2), rounded: its error, 2^-27 of K3 and so 2^-33.6 of K1 (c <= 0.029), is left.
    const K3H: f32 = 0.9617967;
    const TWO23: f32 = 8_388_608.0;
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23: SHIFT's bits + k are those of SHIFT + k
    let tiny = a < f32::MIN_POSITIVE;
    let v = if tiny { a * TWO23 } else { a };
    let iv = v.to_bits() as i32;
    let e = iv.wrapping_sub(0x3f35_04f3) >> 23; // 0x3f3504f3 = sqrt(1/2)
    let m = f32::from_bits(iv.wrapping_sub(e.wrapping_shl(23)) as u32);
    let f = m - 1.0;
    let g = rcp_estimate(m + 1.0);
    let sh = f * g;
    // f - 2 sh is exact (Sterbenz), so the fmas give f - sh (2 + f), the remainder of
    // s = f / (m + 1), to 24 bits whatever g's error: sh + sl is within 2^-44 of s.
    let sl = g * fma(-sh, f, fma(-2.0, sh, f));
    let z = sh * sh;
    let mut r = 0.2817104;
    r = fma(r, z, 0.3200118);
    r = fma(r, z, 0.41220593);
    r = fma(r, z, 0.577078);
    let p = fma(z, r, K3H);
    // c + K1L, with s^2 = z + 2 sh sl taken in at first order (its K3 term; z's own rounding,
    // 2^-25 of c, is left) and K1L added before c's rounding, which is then the only one.
    let c = fma(z, p, fma(sh, sl * (2.0 * K3H), K1L));
    // K1H + c as wh + wl: K1H - wh is exact.
    let wh = K1H + c;
    let wl = (K1H - wh) + c;
    let lh = sh * wh;
    let ll = fma(sh, wh, -lh) + fma(sh, wl, sl * wh);
    // + e, as f32 from an integer add to SHIFT's bits and one subtraction (no I2F, which issues
    // at a quarter of the rate); 23 less for a denormal `a`. Then e + lh exactly: e = 0 or
    // |e| >= 1 > |lh|.
    let ef = f32::from_bits(0x4b40_0000i32.wrapping_add(e) as u32) - if tiny { SHIFT + 23.0 } else { SHIFT };
    let hi = ef + lh;
    // At a = 0 and +inf the bits above give m = 1 and hi = -150 and 128: times +inf, the -inf and
    // +inf that log2 is there, with which pow's main path gives the right 0 or inf by itself.
    // (NaN gives garbage or NaN; pow tests x for NaN.)
    let zero_or_inf = a.to_bits().wrapping_sub(1) >= 0x7f7f_ffff;
    (if zero_or_inf { hi * f32::INFINITY } else { hi }, ((ef - hi) + lh) + ll)
}

/// 2^(ph + pl), |pl| <= 2^-16 |ph| or so: within 0.8 ulp (0.5 for the last rounding, 2^-28.1 for
/// the fit, the rest the rounding of q); +inf from ph = 128, gradual underflow, +0 below -150
/// (ph clamped to +-200, where the result is inf or 0 either way, and pl then dropped); NaN for
/// NaN.
///
/// ph = k + r with k an integer and r exactly ph - k in [-1/2, 1/2]; 2^r - 1 = r P(r), P of
/// degree 5 (weighted least squares on the relative error of 2^r, each coefficient rounded to
/// f32 and the rest refitted: 2^-28.1 relative); 2^pl = 1 + pl ln2 to 2^-34, folded in as
/// q = (1 + q0) (1 + c) - 1. Then 2^k (1 + q) as `math::exp`'s final step: one rounding where
/// the result is normal, two where it is denormal.
#[inline(always)]
fn exp2_split(ph: f32, pl: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    const LN2: f32 = core::f32::consts::LN_2;
    // Selects, not branches (see `math::recip` on what a branch costs a kernel).
    let phc = ph.clamp(-200.0, 200.0);
    let pl = if phc == ph { pl } else { 0.0 };
    let t = phc + SHIFT;
    let r = phc - (t - SHIFT);
    let mut p = 1.538_388_5e-4;
    p = fma(p, r, 1.339_108_1e-3);
    p = fma(p, r, 9.618_312e-3);
    p = fma(p, r, 5.550_359_6e-2);
    p = fma(p, r, 2.402_264_9e-1);
    p = fma(p, r, 6.931_472e-1);
    let c = pl * LN2;
    let q0 = fma(r, p, c);
    let q = fma(q0, c, q0);
    // k as an integer from t's low bits (see `exp`), in [-200, 200]: two normal powers of two,
    // the first product exact.
    let k = (t.to_bits() as i32).wrapping_sub(SHIFT.to_bits() as i32);
    let k1 = k >> 1;
    let a1 = pow2i(k1);
    fma(q, a1, a1) * pow2i(k.wrapping_sub(k1))
}

/// x^y for finite `y != 0` and any `x` (zeros, infinities, NaN and negatives as [`pow`]):
/// what the pow kernel runs when its exponent is such a number, so that no element pays for the
/// special values of `y`. Within 2 ulp: see [`pow`].
///
/// Zeros and infinities need no case of their own: log2 is -inf or +inf there, and 2^(y log2|x|)
/// the table's 0 or inf. What is left costs about four instructions an element, since every
/// test on `y` alone is the same for a whole launch (the compiler hoists it out of the loop).
#[inline(always)]
pub fn pow_finite_y(x: f32, y: f32) -> f32 {
    let (lh, ll) = log2_split(x.abs());
    let ph = y * lh;
    let pl = fma(y, lh, -ph) + y * ll;
    let r = exp2_split(ph, pl);
    // Every f32 of magnitude >= 2^24 is an even integer; below, `as i32` is exact on integers.
    let ay = y.abs();
    let yi = y as i32;
    let y_int = ay >= 16_777_216.0 || yi as f32 == y;
    let y_odd = ay < 16_777_216.0 && y_int && (yi & 1) != 0;
    // NaN for NaN x and, with a non-integer y, for x < 0 but -inf (whose power is the table's
    // +0 or +inf): one comparison against a bound the launch shares, and one for -inf.
    let lowest = if y_int { f32::NEG_INFINITY } else { 0.0 };
    let r = if x >= lowest || x == f32::NEG_INFINITY { r } else { f32::NAN };
    // (-1)^y: x's sign bit onto the result for odd y (-0 and -inf included).
    let sign = if y_odd { 0x8000_0000 } else { 0 };
    f32::from_bits(r.to_bits() | (x.to_bits() & sign))
}

/// x^y, within 2 ulp of the correctly rounded result (measured on the GPU and on the CPU, over
/// the pairs of `math::pow`'s test: see the README's accuracy table), with every special value
/// of C99 Annex F, as [`crate::math::pow`] (0.6 ulp, 2.3x the instructions): |x|^y =
/// 2^(y log2|x|) with `log2_split` and `exp2_split`, about 75 instructions and no branch.
#[inline(always)]
pub fn pow(x: f32, y: f32) -> f32 {
    crate::math::pow_special_y(x, y, pow_finite_y(x, y))
}

/// tanh, <= 2 ulp, without a branch.
///
/// Why: `math::tanh` (0.75 ulp) computes its large range as a double-f32 and picks the range with
/// a branch, so each of a thread's elements is computed after the previous one; at 2^16 elements,
/// where a launch's time is one thread's chain of dependent instructions, `tanh_fwd_f32` took
/// longer than PyTorch's kernel under ncu (docs/worklog.md, 2026-11-24f).
///
/// Method: |x| < 0.55: `math::tanh`'s odd polynomial (0.75 ulp). Otherwise, with
/// e = e^(-2|x|) <= 1/3: tanh |x| = 1 - 2e / (1 + e), as fma(-2e, r, 1) with r = 1 / (1 + e).
/// e from `math::exp`'s reduction and polynomial with one rounding (about 0.6 ulp; -2|x| in
/// [-20, -1.1], so 2^n is normal), 1 + e rounded (0.5 ulp), r within about 0.5 ulp of its
/// value (MUFU.RCP and one Newton step on the GPU; the division on the CPU): 2e r <= 1/2 carries
/// about 1.6 of its ulps, at most 0.8 of the result's, and the fma rounds once more. Both
/// ranges are computed and one is selected. |x| is clamped to 10 (tanh rounds to 1 from 9.01);
/// NaN passes to the large range and gives NaN; tanh(+-0) = +-0 and tanh(+-inf) = +-1.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    use crate::math::{exp_reduce, exp_tail, tanh_small};
    let ax = x.abs();
    let small = tanh_small(x);
    let a = if ax > 10.0 { 10.0 } else { ax }; // NaN passes through
    let (n, rh, c) = exp_reduce(-2.0 * a); // n in [-29, -1]
    let t = pow2i(n);
    let e = fma(t, rh + exp_tail(rh, c), t);
    let d = 1.0 + e;
    let r = recip_near_one(d);
    let large = fma(-2.0 * e, r, 1.0);
    select(ax < 0.55, small, large).copysign(x)
}

/// 1 / d for d in [1, 2] within about 0.5 ulp: MUFU.RCP and one Newton step on the GPU (no range
/// scaling, which `math::recip` needs for any d), the division on the CPU.
#[inline(always)]
fn recip_near_one(d: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r = crate::prim::rcp_approx_ftz(d);
        fma(r, fma(-d, r, 1.0), r)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        1.0 / d
    }
}

/// `if c { a } else { b }` with both computed: one `selp` on the GPU (`prim::select_f32`).
#[inline(always)]
fn select(c: bool, a: f32, b: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        crate::prim::select_f32(c, a, b)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        if c { a } else { b }
    }
}
