//! Accurate `f32` elementary functions, written once for the GPU and the CPU.
//!
//! Kernels call these instead of CUDA's libdevice (unavailable: there is no CUDA toolkit in the
//! build) and the host tests call the very same code, so a CPU reference run reproduces the GPU
//! bit for bit: every operation here is an IEEE `f32` add, multiply, fused multiply-add,
//! correctly rounded divide or an integer bit manipulation, all of which the two machines round
//! identically (rustc does not flush denormals to zero on nvptx).
//!
//! Design rules, all for the GPU:
//! - no `f64`: double precision runs at 1/64 of the f32 rate on consumer GPUs. Where a function
//!   needs more than 24 bits (pow, and the last rounding step of most others) it carries a
//!   double-`f32` value (hi + lo) built with `fma`, which gives the exact product error. (The
//!   CPU build of `rsqrt` is f64, rounded once: its GPU build is MUFU.RSQ and a Newton step,
//!   which no f32 CPU code reproduces, and which matches the f64 result but for 4 of 70M inputs);
//! - no lookup tables: a table costs a memory (or constant cache) access per lane, and divergent
//!   indices serialise. Only polynomial coefficients, as literals that become immediates;
//! - special inputs are fixed up at the end with selects instead of early returns, so a warp
//!   never diverges on data and the common path is straight-line code;
//! - no loops, no panics (integer arithmetic on exponents stays in range, `as i32` casts
//!   saturate), no `unsafe`.
//!
//! Coefficients: every polynomial below was fitted for this file with a weighted Remez exchange
//! (a script on mpmath at 60 digits). The weight is the error measure that matters for the
//! caller (the relative error of the final function value, not of the polynomial alone); after
//! the fit the coefficients were rounded to `f32`, one at a time with the remaining ones refitted
//! where that did better than plain rounding. The "fit error" quoted is that of the rounded
//! coefficients in exact arithmetic; the f32 evaluation adds its own rounding on top.
//!
//! Accuracy: the "max error" quoted for each function is measured in units in the last place
//! (ulp) of the correctly rounded `f32` result, against `f64` libm, exhaustively over all 2^32
//! inputs for the one-argument functions, and over 2^26 random pairs plus a dense grid for
//! `pow` (`tests/math_accuracy.rs` re-checks a dense subset and every special value). Denormal
//! inputs and results are handled (no flush to zero); the special values (NaN, infinities,
//! signed zeros, overflow, underflow) follow C99 Annex F, as CUDA's math library and therefore
//! PyTorch do. For comparison, CUDA documents 2 ulp for expf and erff, 1 ulp for logf and
//! log1pf, 2 for tanhf and 4 for powf (with -ftz=false, -prec-div=true).
//!
//! | function     | max error (ulp)                        | PTX instructions (sm_90)      |
//! |--------------|----------------------------------------|-------------------------------|
//! | exp          | 0.57 (0.75 where the result is denormal) | 35                          |
//! | expm1        | 0.77                                   | 47                            |
//! | log          | 0.82                                   | 42                            |
//! | log1p        | 0.83                                   | 63                            |
//! | tanh         | 0.75                                   | 57 and a divide (`div.rn`)    |
//! | erf          | 0.92                                   | 58                            |
//! | sinpi, cospi | 0.69 (sinpi: 0.75 for denormal results) | 43                           |
//! | pow          | 0.59 (0.76 where the result is denormal) | 161, its reciprocal by `recip` |
//! | rsqrt        | 0.50 (GPU sweep, 70M inputs)           | 16                            |
//!
//! pow is the expensive one (a double-f32 log2 and exp2): for a fixed integer exponent, multiply;
//! for 1/2, use `sqrt` (which differs only at -0 and -inf). Everything else is a few dozen
//! instructions, far below the cost of the memory access around it in an elementwise kernel.
//! Both branches of erf are computed and one is selected (no divergence, no savings either);
//! tanh's become a branch on the GPU (see `tanh`), and the special-input fix-ups may become short
//! branches that skip the main path.

/// `a * b + c` with a single rounding: `fma.rn.f32` on the GPU, a correctly rounded fma on the
/// CPU (the hardware instruction where the target has one, a soft fma otherwise).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        core::f32::math::mul_add(a, b, c)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        a.mul_add(b, c)
    }
}

/// `1 / d` for `d >= 2^-62` (including `+inf`; NaN gives NaN), as `div.rn` gives it, without a
/// branch: bit for bit where the result is normal (`d <= 2^126`), and within one ulp of a
/// denormal result beyond (rounded twice).
///
/// Why: `1.0 / d` is `rcp.rn.f32`, which ptxas expands into MUFU.RCP, one Newton step and a
/// range check that branches to a slow path for denormal results. The branch splits each
/// element's code into its own region, so the elements a thread holds (4 to 16) are computed
/// one after another instead of interleaved; at small sizes, where one warp an SM sub-partition
/// runs, that latency is the kernel's time. Here `d` is scaled by 2^-64 (exact), which keeps it
/// and its reciprocal in the fast path's range, and `+inf` is clamped to 2^127, whose flushed
/// reciprocal rounds to the 0 that `1 / inf` is. The Newton step is ptxas's own.
#[inline(always)]
pub fn recip(d: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        const TWO_M64: f32 = f32::from_bits(0x1f80_0000); // 2^-64
        const TWO_127: f32 = f32::from_bits(0x7f00_0000); // 2^127
        let ds = crate::prim::min_nan(d * TWO_M64, TWO_127);
        let r = crate::prim::rcp_approx_ftz(ds);
        fma(r, fma(-ds, r, 1.0), r) * TWO_M64
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        1.0 / d
    }
}

/// `1 / sqrt(x)`, within 0.5 ulp plus about 2^-44 relative (so correctly rounded but for inputs
/// within that of a rounding boundary), for every `x` including denormals, zeros (`1/sqrt(-0)`
/// is `-inf`, as IEEE `1 / sqrt(-0)`), `+inf` and negatives (NaN); without a branch.
///
/// Why: `1.0 / sqrt(x)` is two IEEE operations, `sqrt.rn` and `rcp.rn`, each of which ptxas
/// expands with a range check and a branch to a slow path, so a thread's elements are computed
/// one after another (see `recip`). Here: MUFU.RSQ's estimate `r` (relative error about
/// 2^-23), then one Newton step `r + r e / 2` with `e = 1 - x r^2` computed to about 2^-46:
/// `x r` split into its rounded value and the exact remainder of that rounding (an fma), each
/// taken off 1 by an fma. The step's own error is about `e^2`, 2^-45. A denormal `x` is scaled
/// by 2^24 first (exact) and the result by 2^12. At `x = 0` and `+inf` the estimate is exact and
/// the step would give NaN (0 times inf), so the estimate is kept there.
#[inline(always)]
pub fn rsqrt(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        const TWO_24: f32 = 16_777_216.0;
        const TWO_12: f32 = 4096.0;
        let tiny = x < f32::MIN_POSITIVE;
        let xs = if tiny { x * TWO_24 } else { x };
        let r = crate::prim::rsqrt_approx_ftz(xs);
        let h = xs * r;
        let hl = fma(xs, r, -h);
        let e = fma(-hl, r, fma(-h, r, 1.0));
        let r1 = fma(0.5 * r, e, r);
        let r1 = if r1.is_nan() { r } else { r1 };
        if tiny { r1 * TWO_12 } else { r1 }
    }
    // The CPU: in f64, then rounded once. Of a square root and a division in f64, the error is
    // about 2^-52, far inside the GPU's half ulp plus 2^-44 of f32, so both builds round to the
    // same f32 but for inputs within 2^-44 of a rounding boundary.
    #[cfg(not(target_arch = "nvptx64"))]
    {
        (1.0 / (x as f64).sqrt()) as f32
    }
}

/// Correctly rounded square root (`sqrt.rn.f32` on the GPU).
#[inline(always)]
pub fn sqrt(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        core::f32::math::sqrt(x)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        x.sqrt()
    }
}

// ---------------------------------------------------------------------------------------------
// Shared pieces.

/// Adding then subtracting 1.5 * 2^23 rounds any |v| <= 2^22 to the nearest integer (ties to
/// even) in two adds, with no libm call on the CPU; the sum v + SHIFT holds that integer in its
/// low bits (its bits are SHIFT_BITS + round(v)), which saves a float-to-int conversion.
const SHIFT: f32 = 12582912.0;
const SHIFT_BITS: i32 = 0x4b40_0000;
const LOG2E: f32 = core::f32::consts::LOG2_E; // 0x3fb8aa3b
/// ln 2 as the f32 nearest (24 bits) plus the rest: enough for the Cody-Waite reduction of exp.
const LN2: f32 = core::f32::consts::LN_2; // 0x3f317218
const LN2_LO: f32 = -1.9046542e-9; // ln 2 - LN2
/// ln 2 cut to 16 bits, so that e * LN2_HI16 is exact for any binary exponent |e| <= 255.
const LN2_HI16: f32 = 0.69314575; // 0x3f317200
const LN2_LO16: f32 = 1.4286068e-6; // ln 2 - LN2_HI16
const MIN_NORMAL: f32 = 1.1754944e-38; // 2^-126
const TWO23: f32 = 8388608.0;

/// 2^k for k in [-126, 127] (garbage, but no panic, outside).
#[inline(always)]
fn pow2i(k: i32) -> f32 {
    f32::from_bits((k.wrapping_add(127) as u32) << 23)
}

/// s + e = a + b exactly, given |a| >= |b| (or a = 0).
#[inline(always)]
fn fast_two_sum(a: f32, b: f32) -> (f32, f32) {
    let s = a + b;
    (s, b - (s - a))
}

/// s + e = a + b exactly, for any a, b.
#[inline(always)]
fn two_sum(a: f32, b: f32) -> (f32, f32) {
    let s = a + b;
    let bb = s - a;
    (s, (a - (s - bb)) + (b - bb))
}

// ---------------------------------------------------------------------------------------------
// The exponential core, shared by exp, expm1, pow, tanh and erf.
//
// e^r = 1 + r + r^2 Q(r) on |r| <= ln2/2 (+6e-6 slack for the rounded quotient), Q of degree 5,
// fitted with weight r^2 / (e^r - 1): that is the relative error of expm1(r) itself, which also
// bounds the relative error of e^r. Fit error 5.8e-10 = 2^-30.7 (relative, of expm1(r)).

/// e^(rh + c) = 1 + rh + tail, for |rh| <= 0.34658 and a small correction |c| <= 2^-16 (the
/// part of the reduced argument that does not fit in rh). Keeping rh apart (it is exact) lets
/// the callers round only once at the end.
#[inline(always)]
pub(crate) fn exp_tail(rh: f32, c: f32) -> f32 {
    let mut p = 0.00019654063;
    p = fma(p, rh, 0.0013932014);
    p = fma(p, rh, 0.008333674);
    p = fma(p, rh, 0.041666493);
    p = fma(p, rh, 0.16666666);
    p = fma(p, rh, 0.5);
    let r2 = rh * rh;
    // e^c = 1 + c up to c^2/2 < 2^-33, so e^(rh+c) - 1 - rh = r^2 p + c (1 + rh + r^2 p); the
    // rounding error of r^2 and the c term join the addend of the last fma.
    let q = fma(r2, p, rh);
    fma(r2, p, fma(fma(rh, rh, -r2), p, fma(c, q, c)))
}

/// x = n ln2 + rh + c with rh exact, |rh| <= 0.34658 and |c| <= 3e-7, for |x| <= 150.
#[inline(always)]
pub(crate) fn exp_reduce(x: f32) -> (i32, f32, f32) {
    let t = fma(x, LOG2E, SHIFT);
    let kf = t - SHIFT;
    // x - kf*LN2 is exact: both are multiples of 2^-25 (|x| >= 1/4 when kf != 0) and the
    // difference is below 1/2 in magnitude, so it fits in 24 bits; fma skips the product rounding.
    let rh = fma(kf, -LN2, x);
    ((t.to_bits() as i32).wrapping_sub(SHIFT_BITS), rh, kf * -LN2_LO)
}

/// 2^n (s + w) for n in [-200, 200], |w| small: one rounding when the result is normal. Two
/// scale factors, each a normal power of two, reach the whole range; denormal results are
/// rounded twice, to 24 bits and then to the denormal spacing (hence the 0.75 ulp of exp and
/// pow there, against 0.57 for normal results).
#[inline(always)]
fn scale(n: i32, s: f32, w: f32) -> f32 {
    let n1 = n.clamp(-100, 127);
    let a = pow2i(n1);
    fma(s, a, w * a) * pow2i(n - n1)
}

/// e^x.
///
/// Method: x = n ln2 + r, |r| <= ln2/2, Cody-Waite with the f32 ln2 (the first step is exact
/// with fma) and the remainder kept as a separate correction; e^r = 1 + r + r^2 Q(r), Q of
/// degree 5 (Remez, see above); 1 + r is split exactly into s + e so that the only rounding of
/// size 1/2 ulp is the final `fma` that also applies 2^n. Overflow to +inf from 88.7228394
/// (the f32 nearest 128 ln2), gradual underflow below -87.3365448, +0 below -103.972077.
///
/// Max error (exhaustive): 0.567 ulp, 0.752 ulp where the result is denormal.
#[inline]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(-104.0, 89.0); // NaN passes through
    let (n, rh, c) = exp_reduce(xc);
    let tail = exp_tail(rh, c);
    let (s, e) = fast_two_sum(1.0, rh);
    scale(n, s, e + tail)
}

/// e^x - 1, accurate for small |x|.
///
/// Method: as `exp`: x = n ln2 + r, e^r - 1 = r + tail; then 2^n (1 + r + tail) - 1 is summed
/// as a double-f32: (2^n - 1) + 2^n r is formed exactly with `two_sum` (2^n - 1 is exact for
/// |n| <= 24; beyond that the -1 or the 2^n moves to the small part), so again only the last
/// add rounds. x is clamped to [-18, 89]: below -18 the result rounds to -1.
///
/// Max error (exhaustive): 0.762 ulp, near x = 0.35 where 2^n - 1 and 2^n r cancel (n = 1).
#[inline]
pub fn expm1(x: f32) -> f32 {
    let xc = x.clamp(-18.0, 89.0);
    let (n, rh, c) = exp_reduce(xc); // n in [-26, 128]
    let tail = exp_tail(rh, c);
    let n1 = if n > 127 { 127 } else { n };
    let t = pow2i(n1);
    let (a, m1) = if n > 24 {
        (t, -1.0)
    } else if n < -24 {
        (-1.0, t)
    } else {
        (t - 1.0, 0.0)
    };
    let (s, e) = two_sum(a, t * rh);
    let r = (s + (e + fma(t, tail, m1))) * pow2i(n - n1);
    if x == 0.0 { x } else { r } // keeps the sign of zero
}

// ---------------------------------------------------------------------------------------------
// The logarithm core, shared by log and log1p.
//
// log(1 + f) = f + f^2 R(f) on |f| <= 1/3 (+2^-22), R of degree 8 with R(0) = -1/2 exactly,
// fitted with weight f^2 / log1p(f) (relative error of log1p(f)), coefficients rounded plainly.
// Fit error 5.7e-9 = 2^-27.4.

/// log(1 + f) - f = f2 r + l for |f| <= 1/3, as (f2, r, l): f2 = f*f rounded and l the (small)
/// share of its rounding error. The caller adds the last product with one fma.
#[inline(always)]
fn log1p_tail(f: f32) -> (f32, f32, f32) {
    let mut r = -0.12891692;
    r = fma(r, f, 0.13984442);
    r = fma(r, f, -0.1218426);
    r = fma(r, f, 0.14005868);
    r = fma(r, f, -0.16680488);
    r = fma(r, f, 0.20010406);
    r = fma(r, f, -0.24999797);
    r = fma(r, f, 0.33333215);
    r = fma(r, f, -0.5);
    let f2 = f * f;
    (f2, r, fma(f, f, -f2) * r)
}

/// e ln2 + f + f2 r + small, rounded almost once: e ln2 is split so that e * LN2_HI16 and its
/// sum with f are exact (a fast two-sum: either e = 0 or |e ln2| > |f|); the low part of that
/// sum and the other small terms are added first, then f2 r in one fma, then the high part.
/// Only the last two operations round at more than 2^-40 relative.
#[inline(always)]
fn log_finish(e: f32, f: f32, (f2, r, small): (f32, f32, f32)) -> f32 {
    let (hi, lo) = fast_two_sum(e * LN2_HI16, f);
    hi + fma(f2, r, lo + fma(e, LN2_LO16, small))
}

/// m in [2/3, 4/3) and the binary exponent e with v = m 2^e, for v > 0 normal.
#[inline(always)]
fn split_2_3(v: f32) -> (f32, i32) {
    let iv = v.to_bits() as i32;
    let e = iv.wrapping_sub(0x3f2a_aaab) >> 23; // 0x3f2aaaab = 2/3 rounded up
    (f32::from_bits(iv.wrapping_sub(e << 23) as u32), e)
}

/// Natural logarithm.
///
/// Method: x = 2^e m with m in [2/3, 4/3) by integer operations on the bits (denormals are
/// first scaled by 2^23), f = m - 1 exact; log x = e ln2 + f + f^2 R(f) (see above), summed as
/// a double-f32 so that the result is rounded once, also where e ln2 and log(m) nearly cancel.
///
/// Max error (exhaustive): 0.811 ulp, near x = 2/3 and 4/3 where |f| is largest.
/// log(+-0) = -inf, log(x < 0) = NaN, log(+inf) = +inf.
#[inline]
pub fn log(x: f32) -> f32 {
    let tiny = x < MIN_NORMAL;
    let (m, e) = split_2_3(if tiny { x * TWO23 } else { x });
    let f = m - 1.0;
    let ef = e as f32 - if tiny { 23.0 } else { 0.0 };
    let r = log_finish(ef, f, log1p_tail(f));
    // Independent selects, the last one taking precedence: as a chained `if / else if`, LLVM
    // computed `r` inside a branch, and on the GPU each element's branch kept the elements a
    // thread holds from being computed together (the same result either way).
    let r = if x == f32::INFINITY || x.is_nan() { x } else { r };
    let r = if x < 0.0 { f32::NAN } else { r };
    if x == 0.0 { f32::NEG_INFINITY } else { r }
}

/// log(1 + x), accurate for small |x|.
///
/// Method: u = 1 + x rounded and its exact rounding error d (two-sum); u = 2^e m with m in
/// [2/3, 4/3), f = m - 1 exact (f = x itself when e = 0), and the error c = d 2^-e is added back
/// to first order through log(1 + f + c) = log(1 + f) + c / (1 + f) (c is below 2^-24
/// relative, so c^2 is far below the rounding). Then as `log`.
///
/// Max error (exhaustive): 0.827 ulp, near x = -1/3 and 1/3 as for `log`.
/// log1p(-1) = -inf, log1p(x < -1) = NaN, log1p(+-0) = +-0.
#[inline]
pub fn log1p(x: f32) -> f32 {
    let u = 1.0 + x;
    let d = if x.abs() <= 1.0 { (1.0 - u) + x } else { (x - u) + 1.0 };
    let (m, e) = split_2_3(u);
    // With e = 0, 1 + x is already in [2/3, 4/3) and x itself is the exact f.
    let f = if e == 0 { x } else { m - 1.0 };
    // 2^-e: e is in [-24, 128]; past 126 the correction is far below the result's ulp.
    let c = if e == 0 { 0.0 } else { d * pow2i(-(if e > 126 { 126 } else { e })) };
    // log(1 + f + c) - f = log1p_tail(f) + c / (1 + f), 1 / (1 + f) = 1 - f + f^2 - f^3 up to
    // 1/81 relative error of a term below 1/2 ulp; the c^2 term is below 2^-48.
    let (f2, r, l) = log1p_tail(f);
    let inv = fma(-f, fma(-f, 1.0 - f, 1.0), 1.0);
    let r = log_finish(e as f32, f, (f2, r, fma(c, inv, l)));
    if x == 0.0 || x == f32::INFINITY || x.is_nan() {
        x
    } else if x == -1.0 {
        f32::NEG_INFINITY
    } else if x < -1.0 {
        f32::NAN
    } else {
        r
    }
}

// ---------------------------------------------------------------------------------------------

/// Hyperbolic tangent.
///
/// Method: for |x| < 0.55, tanh x = x + x^3 P(x^2), P of degree 4 fitted with weight
/// x^3 / tanh x (relative error of tanh), fit error 3.3e-9 = 2^-28.2. Above, tanh |x| =
/// 1 - 2 / (e^2|x| + 1) with e^2|x| = 2^n (1 + r + tail) from the exp core, so that
/// (e^2|x| + 1) / 2^n = (1 + 2^-n) + r + tail is formed as a double-f32 (1 + 2^-n is exact),
/// the quotient gets a correction for the low part and for the divide's own remainder, and
/// 1 - quotient is summed exactly but for the last add. The switch sits at 0.55, just above
/// atanh(1/2) = 0.5493: below that the result's ulp halves and the subtraction would cost more.
/// |x| is clamped to 10 (tanh rounds to 1 from 9.01).
///
/// Max error (exhaustive): 0.745 ulp, in the polynomial range near 0.55 (0.52 above it).
/// tanh(+-inf) = +-1, tanh(+-0) = +-0.
///
/// The kernels call `fastmath::tanh` instead (1.47 ulp, shorter and without a branch); this one
/// is the CPU's.
#[inline]
pub fn tanh(x: f32) -> f32 {
    let ax = x.abs();
    let small = tanh_small(x);
    // Large |x|.
    let a2 = 2.0 * if ax > 10.0 { 10.0 } else { ax };
    let (n, rh, c) = exp_reduce(a2); // n in [0, 29]
    let tail = exp_tail(rh, c);
    let (s, e) = fast_two_sum(1.0 + pow2i(n.wrapping_neg()), rh);
    let (uh, ul) = fast_two_sum(s, e + tail);
    // 2 / (2^n (uh + ul)) = q + (rem - q ul) / uh, with q = num / uh rounded, rem its exact
    // remainder and 1/uh = q 2^(n-1) to first order.
    let num = pow2i(1i32.wrapping_sub(n));
    // num is a power of two: num / uh = num * (1 / uh) exactly, without the division's branch.
    let q = num * recip(uh);
    let dq = (fma(-q, uh, num) - q * ul) * (q * pow2i(n.wrapping_sub(1)));
    let (h, l) = fast_two_sum(1.0, -q);
    let large = h + (l - dq);
    // NaN takes the large path, which yields NaN. tanh is odd: copysign also gives tanh(-0) = -0,
    // which x + x^3 P would round to +0.
    (if ax < 0.55 { small } else { large }).copysign(x)
}

/// tanh for |x| < 0.55: x + x^3 P(x^2), P of degree 4 (see [`tanh`]).
#[inline(always)]
pub(crate) fn tanh_small(x: f32) -> f32 {
    let z = x * x;
    let mut p = -0.0062278705;
    p = fma(p, z, 0.021046555);
    p = fma(p, z, -0.053847548);
    p = fma(p, z, 0.13332544);
    p = fma(p, z, -0.33333316);
    fma(x, z * p, x)
}

/// Error function.
///
/// Method: for |x| < 1, erf x = x + x P(x^2), P of degree 6 fitted with weight x / erf x,
/// fit error 1.4e-9 = 2^-29.4; P is evaluated as c0 + c1 z + z (z P2(z)) rather than by plain
/// Horner, whose partial sum c1 + z P2 ~ -0.29 would be rounded at 2^-26.
/// For |x| >= 1, erf |x| = 1 - e^-g(|x|) with g(t) = -log(erfc t) ~ t^2 + log(t sqrt(pi)), smooth
/// and polynomial-friendly: g(1 + u) = g(1) + u G(u), G of degree 6 on u in [0, 2.95], fitted with
/// weight u erfc / erf (the error of g reaches erf scaled by erfc), fit error 1.5e-10 = 2^-32.7;
/// past 3.95 erf rounds to 1. g is summed as a double-f32 (g(1) itself is one) and fed to the
/// exp core with its low part as the correction term, so that only G's rounding, damped by
/// u erfc, reaches the result. e^-g = 2^n (1 + q) and 1 - 2^n (1 + q) = (1 - 2^n) - 2^n q with
/// 1 - 2^n exact: one rounding.
///
/// Max error (exhaustive): 0.916 ulp, just below |x| = 1 (0.71 for |x| >= 1, at the point
/// erf(x) ~ 1 - 2^-25 where 1 - 2^n is no longer exact). erf(+-inf) = +-1, erf(+-0) = +-0.
#[inline]
pub fn erf(x: f32) -> f32 {
    let t = x.abs();
    // Small |x|.
    let z = x * x;
    let mut p = 7.806904e-5;
    p = fma(p, z, -0.0007997853);
    p = fma(p, z, 0.005187162);
    p = fma(p, z, -0.026853347);
    p = fma(p, z, 0.11283579);
    let p = fma(z, -0.37612626, fma(z, z * p, 0.12837917));
    let small = fma(x, p, x);
    // Large |x|.
    const G1H: f32 = 1.8496056; // g(1) = -log(erfc(1)), as a double-f32
    const G1L: f32 = -5.0369486e-8;
    let u = (if t > 3.95 { 3.95 } else { t }) - 1.0; // exact
    let mut g = 2.1576463e-5;
    g = fma(g, u, -0.00028981242);
    g = fma(g, u, 0.002012317);
    g = fma(g, u, -0.010046519);
    g = fma(g, u, 0.04156341);
    g = fma(g, u, 0.8431071);
    g = fma(g, u, 2.6389675);
    let gu = u * g;
    let (gh, gl) = two_sum(G1H, gu);
    let gl = gl + (fma(u, g, -gu) + G1L);
    let (n, rh, c) = exp_reduce(-gh); // n in [-26, 2]
    let q = rh + exp_tail(rh, c - gl);
    let s = pow2i(n);
    let large = fma(-s, q, 1.0 - s);
    // NaN takes the small path, which yields NaN. erf is odd: copysign also gives erf(-0) = -0.
    (if t >= 1.0 { large } else { small }).copysign(x)
}

// ---------------------------------------------------------------------------------------------
// sin(pi x) and cos(pi x).
//
// x is reduced exactly: first modulo 4 (rounding x to a multiple of 4 with a shifter constant,
// exact for |x| < 2^24; above that x is an even integer), then x = k/2 + r, |r| <= 1/4, k mod 4
// picks the quadrant. On |r| <= 1/4:
//   sin(pi r) = r (pi + r^2 S(r^2)), S of degree 3, weight r^3 / sin(pi r), fit error 1.3e-10;
//   pi is applied as a double-f32 so its rounding (2^-25 relative) does not show;
//   cos(pi r) = 1 + r^2 C(r^2), C of degree 3, weight r^2 / cos(pi r), fit error 5.0e-10.
// Box-Muller calls them on [0, 2); their accuracy is the same over the whole f32 range.

const PI_HI: f32 = core::f32::consts::PI; // 0x40490fdb
const PI_LO: f32 = -8.742278e-8; // pi - PI_HI

/// (sin(pi r), cos(pi r), k mod 4) with x = k/2 + r (mod 2).
#[inline(always)]
fn sincospi_core(x: f32) -> (f32, f32, i32) {
    const SHIFT4: f32 = 50331648.0; // 1.5 * 2^25: rounds |x| < 2^24 to a multiple of 4
    let xr = if x.abs() < 16777216.0 {
        x - ((x + SHIFT4) - SHIFT4)
    } else {
        x * 0.0 // an even integer, or NaN for +-inf
    };
    let t = fma(xr, 2.0, SHIFT);
    let kf = t - SHIFT;
    let r = fma(kf, -0.5, xr); // exact, |r| <= 1/4
    let z = r * r;
    let mut s = 0.0791732;
    s = fma(s, z, -0.5989812);
    s = fma(s, z, 2.5501547);
    s = fma(s, z, -5.1677127);
    // Scaled by 2^64 so that the small product r (PI_LO + z S) cannot fall into the denormal
    // range (and lose bits) while the result is still normal; the scaling back is exact then.
    let rs = r * 18446744073709551616.0; // 2^64
    let sin = fma(rs, PI_HI, rs * fma(z, s, PI_LO)) * 5.421011e-20; // 2^-64
    // cos: 1 + C0 z + z (z C'(z)). A plain Horner rounds C(z) ~ -4.7 to 2^-22, a quarter ulp
    // of the result; instead C0 z is formed exactly (with the rounding error of z = r^2 too)
    // and only the final 1 + p + q rounds.
    const C0: f32 = -4.934802;
    let mut c = 0.228994;
    c = fma(c, z, -1.3347582);
    c = fma(c, z, 4.0586967);
    let p = z * C0;
    let q = fma(z, z * c, fma(fma(r, r, -z), C0, fma(z, C0, -p)));
    let (h, l) = fast_two_sum(1.0, p);
    let cos = h + (l + q);
    (sin, cos, (t.to_bits() as i32).wrapping_sub(SHIFT_BITS) & 3)
}

/// sin(pi x).
///
/// Method: exact reduction and two short polynomials, see above. No loss of accuracy for large
/// |x| (unlike sin(PI * x), whose argument is already wrong by up to 2^-24 |pi x|).
///
/// Max error (exhaustive): 0.691 ulp, 0.750 where the result is denormal (|x| < 3.8e-39).
/// sinpi(+-0) = +-0, sinpi(n) = +0 for integers n > 0 and -0 for n < 0 (IEEE 754 sinPi),
/// sinpi(+-inf) = NaN.
#[inline]
pub fn sinpi(x: f32) -> f32 {
    let (s, c, j) = sincospi_core(x);
    // Quadrants 0..3: s, c, -s, -c (selects and a sign flip; a `match` becomes a jump table).
    let r = f32::from_bits((if j & 1 == 0 { s } else { c }).to_bits() ^ (((j & 2) as u32) << 30));
    if r == 0.0 { 0.0f32.copysign(x) } else { r }
}

/// cos(pi x).
///
/// Method: as `sinpi`. Max error (exhaustive): 0.689 ulp.
/// cospi(n + 1/2) = +0 for every integer n, cospi(+-inf) = NaN.
#[inline]
pub fn cospi(x: f32) -> f32 {
    let (s, c, j) = sincospi_core(x);
    // Quadrants 0..3: c, -s, -c, s.
    let r = f32::from_bits((if j & 1 == 0 { c } else { s }).to_bits() ^ ((((j + 1) & 2) as u32) << 30));
    if r == 0.0 { 0.0 } else { r }
}

// ---------------------------------------------------------------------------------------------
// pow.

/// log2(a) as hi + lo with relative error about 2^-36, for a > 0 finite (normal or denormal).
///
/// a = 2^e m, m in [sqrt(1/2), sqrt(2)), f = m - 1 exact, s = f / (2 + f) as a double-f32
/// (the remainder f - s(2+f) is exact with fma), then log2(1+f) = (2/ln2) atanh(s) =
/// s (K1 + s^2 (K3 + s^2 R(s^2))), |s| <= 0.1716. K1 = 2/ln2 and K3 = 2/(3 ln2) are double-f32
/// constants and the sums and products are done in double-f32; R, of degree 3 in s^2, only has to
/// be good to 2^-24 relative since s^4 R is below 2^-12 of the total (fit with weight s^4 / K1,
/// fit error 6.5e-14 = 2^-43.8, rounding in its evaluation adds about 2^-36).
#[inline(always)]
fn log2_ext(a: f32) -> (f32, f32) {
    const K1H: f32 = 2.88539;
    const K1L: f32 = 3.851926e-8;
    const K3H: f32 = 0.9617967;
    const K3L: f32 = -7.028462e-9;
    let tiny = a < MIN_NORMAL;
    let v = if tiny { a * TWO23 } else { a };
    let iv = v.to_bits() as i32;
    let e = iv.wrapping_sub(0x3f35_04f3) >> 23; // 0x3f3504f3 = sqrt(1/2)
    let m = f32::from_bits(iv.wrapping_sub(e << 23) as u32);
    let f = m - 1.0;
    // m + 1 is in [1.7, 2.5]: `recip` gives `1 / (m + 1)`'s bits without the division's branch.
    let rcp = recip(m + 1.0);
    let sh = f * rcp;
    // f - 2 sh is exact (Sterbenz), so the fma gives the remainder f - sh (2 + f) to 24 bits.
    let sl = rcp * fma(-sh, f, fma(-2.0, sh, f));
    let z = sh * sh;
    let zl = fma(sh, sh, -z) + 2.0 * sh * sl;
    let mut r = 0.2817104;
    r = fma(r, z, 0.3200118);
    r = fma(r, z, 0.41220593);
    r = fma(r, z, 0.577078);
    // u = K3 + z r
    let t = z * r;
    let uh = K3H + t;
    let ul = ((K3H - uh) + t) + K3L;
    // v = (z + zl) u
    let vh = z * uh;
    let vl = fma(z, uh, -vh) + fma(z, ul, zl * uh);
    // w = K1 + v
    let wh = K1H + vh;
    let wl = ((K1H - wh) + vh) + (K1L + vl);
    // l = (sh + sl) w
    let lh = sh * wh;
    let ll = fma(sh, wh, -lh) + fma(sh, wl, sl * wh);
    // + e: either e = 0 or |e| >= 1 > |lh|.
    let ef = e as f32 - if tiny { 23.0 } else { 0.0 };
    let (hi, lo) = fast_two_sum(ef, lh);
    fast_two_sum(hi, lo + ll)
}

/// 2^(ph + pl), |pl| <= 2^-16 |ph| or so.
#[inline(always)]
fn exp2_ext(ph: f32, pl: f32) -> f32 {
    // Beyond +-200 the result is inf or 0 either way. Two selects, where the `if` chain this was
    // became two branches on the GPU (see `recip` on what a branch costs there). A NaN `ph`
    // stays NaN.
    let phc = ph.clamp(-200.0, 200.0);
    let pl = if phc == ph { pl } else { 0.0 };
    let ph = phc;
    let t = ph + SHIFT;
    let kf = t - SHIFT;
    let r = ph - kf; // exact, |r| <= 1/2
    // (r + pl) ln2 = rh + c, rh = r * LN2 rounded.
    let rh = r * LN2;
    let c = fma(r, LN2, -rh) + fma(r, LN2_LO, pl * LN2);
    let tail = exp_tail(rh, c);
    let (s, e) = fast_two_sum(1.0, rh);
    scale((t.to_bits() as i32).wrapping_sub(SHIFT_BITS), s, e + tail)
}

/// x^y, with every special case of C99 Annex F.
///
/// Method: |x|^y = 2^(y log2|x|), with log2|x| as a double-f32 of relative error about 2^-36
/// (`log2_ext`), the product y log2|x| as a double-f32 (exact product error with fma) and
/// 2^(hi + lo) through the exp core with the low part folded into its correction term. The
/// extended precision keeps the error flat even when |y log2 x| is near 128 or 149, where a
/// plain f32 log would lose up to 8 bits (the relative error of log2 x is multiplied by
/// |y log2 x|). The sign is (-1)^y for negative x and integer y.
///
/// Max error: 0.585 ulp over 2^26 random pairs (y log2 x spread over the whole result range,
/// x near 1 with huge y, negative x with integer y) and the test grid; 0.757 ulp where the
/// result is denormal.
///
/// Special values: pow(x, +-0) = 1 and pow(1, y) = 1 for any x, y, even NaN; otherwise NaN in
/// gives NaN; pow(x < 0, non-integer finite y) = NaN; pow(+-0, y < 0) = +-inf for odd integer
/// y, +inf otherwise; pow(+-0, y > 0) = +-0 for odd integer y, +0 otherwise; pow(-1, +-inf) = 1;
/// pow(x, -inf) = +inf for |x| < 1, +0 for |x| > 1; pow(x, +inf) = +0 for |x| < 1, +inf for
/// |x| > 1; pow(-inf, y) = pow(-0, -y); pow(+inf, y) = +inf for y > 0, +0 for y < 0.
#[inline]
pub fn pow(x: f32, y: f32) -> f32 {
    let (lh, ll) = log2_ext(x.abs());
    let ph = y * lh;
    let pl = fma(y, lh, -ph) + y * ll;
    let r = exp2_ext(ph, pl);
    pow_special_y(x, y, pow_special_x(x, y, r))
}

/// pow's result for finite `y != 0`, given `r`, |x|^y as the main path computes it for finite
/// nonzero `x`: the sign ((-1)^y for negative x and odd integer y), NaN for negative x and
/// non-integer y, the table's values at `x = +-0` and `+-inf`, NaN for NaN `x`. Shared with
/// `fastmath::pow`. Every test on `y` alone is the same for a whole kernel launch when `y` is a
/// kernel parameter, so the compiler hoists it out of the element loop.
#[inline(always)]
pub(crate) fn pow_special_x(x: f32, y: f32, r: f32) -> f32 {
    let ax = x.abs();
    let ay = y.abs();
    // Every f32 of magnitude >= 2^24 is an even integer; below, `as i32` is exact on integers.
    let yi = y as i32;
    let y_int = ay >= 16777216.0 || yi as f32 == y;
    let y_odd = ay < 16777216.0 && y_int && (yi & 1) != 0;
    let neg = x.is_sign_negative();

    let mut res = if neg && y_odd { -r } else { r };
    if x < 0.0 && !y_int {
        res = f32::NAN;
    }
    if ax == 0.0 || ax == f32::INFINITY {
        let mag = if (ax == 0.0) == (y < 0.0) { f32::INFINITY } else { 0.0 };
        res = if neg && y_odd { -mag } else { mag };
    }
    if x.is_nan() {
        res = x + y;
    }
    res
}

/// pow's special values of `y` (`+-0`, `+-inf`, NaN) and `pow(1, y) = 1`, applied over
/// [`pow_special_x`]'s result `res`.
#[inline(always)]
pub(crate) fn pow_special_y(x: f32, y: f32, mut res: f32) -> f32 {
    let ax = x.abs();
    if y.abs() == f32::INFINITY {
        res = if ax == 1.0 {
            1.0
        } else if (ax < 1.0) == (y < 0.0) {
            f32::INFINITY
        } else {
            0.0
        };
    }
    if x.is_nan() || y.is_nan() {
        res = x + y;
    }
    if y == 0.0 || x == 1.0 {
        res = 1.0;
    }
    res
}
