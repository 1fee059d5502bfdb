//! The math of each element-wise op: forward and exact backward, in f32, one zero-sized type per
//! op. Kernels are generic over these; the host tests run the same functions on the CPU.
//!
//! Conventions follow PyTorch, including at NaN, infinities and kinks (relu'(0) = 0, clamp's
//! gradient passes at the bounds, GELU's derivative is PyTorch's formula, so it is NaN at ±inf
//! exactly like PyTorch's).

use crate::fastmath as math;

/// An element-wise op with up to two scalar parameters `a`, `b`.
pub trait UnaryFn {
    /// The op at `x`, in f32.
    fn fwd(x: f32, a: f32, b: f32) -> f32;
    /// d/dx of `fwd`, times the incoming gradient `g`.
    fn bwd(x: f32, g: f32, a: f32, b: f32) -> f32;
    /// `fwd` for f16/bf16 storage, where an op may use cheaper math whose error stays far below
    /// the storage type's ulp (see `fastmath::exp_for`). The same as `fwd` unless overridden.
    #[inline(always)]
    fn fwd_half(x: f32, a: f32, b: f32) -> f32 {
        Self::fwd(x, a, b)
    }
    /// `bwd` for f16/bf16 storage.
    #[inline(always)]
    fn bwd_half(x: f32, g: f32, a: f32, b: f32) -> f32 {
        Self::bwd(x, g, a, b)
    }
    /// Forms: an op whose formula depends on its scalar parameters alone (pow's exponent: a
    /// multiplication for 2 and 3, the general path otherwise), which are the same for a whole
    /// launch, names that formula once per launch with `fwd_form` / `bwd_form` (a number below
    /// `FORMS`), and the kernel runs one loop per form with `fwd_in::<F>` / `bwd_in::<F>`, so
    /// no element branches on the parameters (a branch splits a thread's elements apart: see
    /// `math::recip`). `fwd` must equal `fwd_in::<fwd_form(a, b)>` (likewise `bwd`), and an op
    /// with forms computes f16/bf16 storage with them too (`fwd_half` is not called).
    const FORMS: u32 = 1;
    /// The forward's form for the parameters `a`, `b`.
    #[inline(always)]
    fn fwd_form(_a: f32, _b: f32) -> u32 {
        0
    }
    /// The backward's form for the parameters `a`, `b`.
    #[inline(always)]
    fn bwd_form(_a: f32, _b: f32) -> u32 {
        0
    }
    /// `fwd` in form `F`.
    #[inline(always)]
    fn fwd_in<const F: u32>(x: f32, a: f32, b: f32) -> f32 {
        Self::fwd(x, a, b)
    }
    /// `bwd` in form `F`.
    #[inline(always)]
    fn bwd_in<const F: u32>(x: f32, g: f32, a: f32, b: f32) -> f32 {
        Self::bwd(x, g, a, b)
    }
    /// Elements a thread of the op's forward and backward kernels above the small launches, in
    /// whole 16-byte vectors (0: one vector, whatever its width), and whether a thread loads them
    /// all before its math (`elementwise::chunk`, `elementwise::chunk_vectors`), for each form
    /// (`FORMS`; the backward's form is `bwd_form`'s). One vector gives the most loads in flight,
    /// and memory-bound ops run fastest so (see docs/worklog.md, 2026-11-26f).
    /// Where the math sets the pace, more elements share a thread's work outside them (the index,
    /// the form's dispatch, a setup from the parameters).
    const CHUNK: [(usize, bool); MAX_FORMS as usize] = [(0, true); MAX_FORMS as usize];
    /// The kernel's `(a, b)` from the op's parameters as the user gives them (in the order of its
    /// row in [`unary_table`], 0 past them), computed once on the host: where an op wants a
    /// derived value (a reciprocal) rounded once per launch instead of once per element.
    ///
    /// [`unary_table`]: crate::unary_table
    #[inline(always)]
    fn params(p: [f32; 2]) -> [f32; 2] {
        p
    }
    /// Why the user's parameters are refused, if they are (checked on the host before a launch).
    #[inline(always)]
    fn check(_p: [f32; 2]) -> Result<(), &'static str> {
        Ok(())
    }
    /// For the ops marked `yx` in [`unary_table`]: whether, with these parameters, the backward
    /// from `x` read at `y = f(x)` is still the gradient (leaky relu's slope must keep the sign).
    ///
    /// [`unary_table`]: crate::unary_table
    #[inline(always)]
    fn bwd_reads_y(_p: [f32; 2]) -> bool {
        true
    }
}

/// The most forms an op may have ([`UnaryFn::FORMS`]): [`by_form!`](crate::by_form) spells out
/// this many arms.
pub const MAX_FORMS: u32 = 6;

/// Evaluates `$body` with the constant `$F` equal to the form `$f` (below [`MAX_FORMS`]): the
/// one runtime branch that turns a launch's form into a type-level constant.
#[macro_export]
macro_rules! by_form {
    ($f:expr, $F:ident => $body:expr) => {
        match $f {
            0 => {
                const $F: u32 = 0;
                $body
            }
            1 => {
                const $F: u32 = 1;
                $body
            }
            2 => {
                const $F: u32 = 2;
                $body
            }
            3 => {
                const $F: u32 = 3;
                $body
            }
            4 => {
                const $F: u32 = 4;
                $body
            }
            _ => {
                const $F: u32 = 5;
                $body
            }
        }
    };
}

/// `O::fwd` for storage type `T`: `fwd_half` for f16 and bf16.
#[inline(always)]
pub fn fwd_for<O: UnaryFn, T: crate::Elem>(x: f32, a: f32, b: f32) -> f32 {
    if T::DTYPE == crate::DType::F32 { O::fwd(x, a, b) } else { O::fwd_half(x, a, b) }
}

/// `O::bwd` for storage type `T`: `bwd_half` for f16 and bf16.
#[inline(always)]
pub fn bwd_for<O: UnaryFn, T: crate::Elem>(x: f32, g: f32, a: f32, b: f32) -> f32 {
    if T::DTYPE == crate::DType::F32 { O::bwd(x, g, a, b) } else { O::bwd_half(x, g, a, b) }
}

/// [`fwd_for`] in form `F` (see [`UnaryFn::FORMS`]).
#[inline(always)]
pub fn fwd_form_for<O: UnaryFn, T: crate::Elem, const F: u32>(x: f32, a: f32, b: f32) -> f32 {
    if O::FORMS > 1 { O::fwd_in::<F>(x, a, b) } else { fwd_for::<O, T>(x, a, b) }
}

/// [`bwd_for`] in form `F`.
#[inline(always)]
pub fn bwd_form_for<O: UnaryFn, T: crate::Elem, const F: u32>(x: f32, g: f32, a: f32, b: f32) -> f32 {
    if O::FORMS > 1 { O::bwd_in::<F>(x, g, a, b) } else { bwd_for::<O, T>(x, g, a, b) }
}

/// A binary op on two tensors of one shape (or a tensor and a broadcast row).
pub trait BinaryFn {
    /// The op at `(x, y)`, in f32.
    fn fwd(x: f32, y: f32) -> f32;
    /// (dL/dx, dL/dy) given dL/dout = g.
    fn bwd(x: f32, y: f32, g: f32) -> (f32, f32);
}

#[inline(always)]
fn abs(x: f32) -> f32 {
    f32::from_bits(x.to_bits() & 0x7fff_ffff)
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    math::recip(1.0 + math::exp(-x))
}

// An op without doc comments is documented by its two formulas.
macro_rules! unary {
    ($name:ident, |$x:ident, $a:ident, $b:ident| $fwd:expr, |$gx:ident, $g:ident, $ga:ident, $gb:ident| $bwd:expr) => {
        unary!(
            #[doc = concat!("`", stringify!($fwd), "`; backward `", stringify!($bwd), "` (`g`: the incoming gradient).")]
            $name, |$x, $a, $b| $fwd, |$gx, $g, $ga, $gb| $bwd
        );
    };
    ($(#[$m:meta])* $name:ident, |$x:ident, $a:ident, $b:ident| $fwd:expr, |$gx:ident, $g:ident, $ga:ident, $gb:ident| $bwd:expr
        $(; params: |$pp:ident| $params:expr)?
        $(; check: |$cp:ident| $check:expr)?
    ) => {
        $(#[$m])*
        pub struct $name;
        impl UnaryFn for $name {
            #[inline(always)]
            #[allow(unused_variables)]
            fn fwd($x: f32, $a: f32, $b: f32) -> f32 {
                $fwd
            }
            #[inline(always)]
            #[allow(unused_variables)]
            fn bwd($gx: f32, $g: f32, $ga: f32, $gb: f32) -> f32 {
                $bwd
            }
            $(
                fn params($pp: [f32; 2]) -> [f32; 2] {
                    $params
                }
            )?
            $(
                fn check($cp: [f32; 2]) -> Result<(), &'static str> {
                    $check
                }
            )?
        }
    };
}

// --- arithmetic with a scalar -----------------------------------------------------------------
unary!(Neg, |x, a, b| -x, |x, g, a, b| -g);
unary!(AddScalar, |x, a, b| x + a, |x, g, a, b| g);
unary!(SubScalar, |x, a, b| x - a, |x, g, a, b| g);
unary!(MulScalar, |x, a, b| x * a, |x, g, a, b| g * a);
unary!(
    /// `x / a` as PyTorch divides by a scalar: `x * b` with `b = 1 / a` rounded once, which the
    /// host passes (PyTorch's `div_true_kernel_cuda` multiplies by the reciprocal when the divisor
    /// is a scalar, and autograd's backward, `g / a`, is the same op). Within one rounding of
    /// `1 / a` of the quotient, and PyTorch's bits; a multiplication, where an IEEE division has
    /// a slow-path branch per element (see docs/worklog.md, 2026-11-26d).
    DivScalar,
    |x, a, b| x * b,
    |x, g, a, b| g * b;
    params: |p| [p[0], 1.0 / p[0]]
);

// --- math ---------------------------------------------------------------------------------------
// d|x|/dx = sgn(x), with sgn(0) = 0 and sgn(NaN) = NaN, as torch.sgn.
unary!(
    /// `|x|`; backward `g * sgn(x)`.
    Abs,
    |x, a, b| abs(x),
    |x, g, a, b| {
        let s = if x > 0.0 {
            1.0
        } else if x < 0.0 {
            -1.0
        } else if x == 0.0 {
            0.0
        } else {
            x
        };
        g * s
    }
);
/// e^x. For f16/bf16 storage the special function unit's 2^x alone (`fastmath::exp_for`, error
/// under 1/60 of an f16 ulp): the f32 exp's exactly reduced argument is accuracy an f16/bf16
/// output cannot show, and its instructions, not the memory, set the bf16 forward's pace (see
/// docs/worklog.md, 2026-11-23c).
pub struct Exp;
impl UnaryFn for Exp {
    #[inline(always)]
    fn fwd(x: f32, _: f32, _: f32) -> f32 {
        math::exp(x)
    }
    #[inline(always)]
    fn bwd(x: f32, g: f32, _: f32, _: f32) -> f32 {
        g * math::exp(x)
    }
    #[inline(always)]
    fn fwd_half(x: f32, _: f32, _: f32) -> f32 {
        math::exp_for::<crate::F16>(x)
    }
    #[inline(always)]
    fn bwd_half(x: f32, g: f32, _: f32, _: f32) -> f32 {
        g * math::exp_for::<crate::F16>(x)
    }
}
unary!(Log, |x, a, b| math::log(x), |x, g, a, b| g / x);
unary!(Expm1, |x, a, b| math::expm1(x), |x, g, a, b| g * math::exp(x));
unary!(Log1p, |x, a, b| math::log1p(x), |x, g, a, b| g / (1.0 + x));
// d erf/dx = 2/sqrt(pi) exp(-x^2)
unary!(Erf, |x, a, b| math::erf(x), |x, g, a, b| g * FRAC_2_SQRT_PI * math::exp(-x * x));
const FRAC_2_SQRT_PI: f32 = core::f32::consts::FRAC_2_SQRT_PI;
unary!(Sqrt, |x, a, b| math::sqrt(x), |x, g, a, b| g / (2.0 * math::sqrt(x)));
// 1/sqrt(x) to 0.5 ulp and a hair (`math::rsqrt`: MUFU.RSQ and a Newton step, no branch), where
// `1.0 / sqrt(x)` is two IEEE operations with a slow-path branch each (see docs/worklog.md,
// 2026-11-24d). d/dx x^-1/2 = -1/2 r^3. Multiplied into g one factor of r at a time: the
// intermediates then stay in range wherever the result is (r^3 alone overflows f32 for x < 2e-26).
unary!(
    /// `1 / sqrt(x)`; backward `-g r^3 / 2` with `r = rsqrt(x)`.
    Rsqrt,
    |x, a, b| math::rsqrt(x),
    |x, g, a, b| {
        let r = math::rsqrt(x);
        -0.5 * (((g * r) * r) * r)
    }
);
/// x^p for a scalar p, in six forms chosen once per launch ([`UnaryFn::FORMS`]): the exponents
/// PyTorch also special-cases by multiplication (x x and (x x) x, within 1 ulp and C99's pow at
/// zeros, infinities and NaN; x; 1 / x), the general path `fastmath::pow_finite_y` for any other
/// finite nonzero p (<= 2 ulp), and the full `fastmath::pow` for p = +-0, +-inf and NaN, whose
/// special values it alone handles. Backward: PyTorch's pow_backward, grad * (p * x^(p - 1)), in
/// its order, with the form of p - 1; exponent 0 gives a zero gradient even where x^-1 is
/// infinite.
pub struct Pow;

const POW_GENERAL: u32 = 0;
const POW_SQUARE: u32 = 1;
const POW_CUBE: u32 = 2;
const POW_ONE: u32 = 3;
const POW_RECIPROCAL: u32 = 4;
const POW_SPECIAL: u32 = 5;

/// pow's form for exponent `p`.
#[inline(always)]
fn pow_form(p: f32) -> u32 {
    if p == 2.0 {
        POW_SQUARE
    } else if p == 3.0 {
        POW_CUBE
    } else if p == 1.0 {
        POW_ONE
    } else if p == -1.0 {
        POW_RECIPROCAL
    } else if p.is_finite() && p != 0.0 {
        POW_GENERAL
    } else {
        POW_SPECIAL
    }
}

/// x^p in form `F`, which must be `pow_form(p)`.
#[inline(always)]
fn pow_in<const F: u32>(x: f32, p: f32) -> f32 {
    match F {
        POW_SQUARE => x * x,
        POW_CUBE => (x * x) * x,
        POW_ONE => x,
        POW_RECIPROCAL => 1.0 / x,
        POW_GENERAL => math::pow_finite_y(x, p),
        _ => math::pow(x, p),
    }
}

impl UnaryFn for Pow {
    const FORMS: u32 = 6;
    #[inline(always)]
    fn fwd_form(a: f32, _: f32) -> u32 {
        pow_form(a)
    }
    #[inline(always)]
    fn bwd_form(a: f32, _: f32) -> u32 {
        pow_form(a - 1.0)
    }
    #[inline(always)]
    fn fwd_in<const F: u32>(x: f32, a: f32, _: f32) -> f32 {
        pow_in::<F>(x, a)
    }
    #[inline(always)]
    fn bwd_in<const F: u32>(x: f32, g: f32, a: f32, _: f32) -> f32 {
        if a == 0.0 { 0.0 } else { g * (a * pow_in::<F>(x, a - 1.0)) }
    }
    /// The general forms' math (log2 and exp2 in double-f32 steps, about 75 instructions an
    /// element) sets the pace, and the dispatch on the form and the exponent's tests before it are
    /// about 40 a thread: 16 elements a thread share that overhead, a vector after another
    /// without the registers of four loaded at once (see docs/worklog.md, 2026-11-26f). The
    /// forms by multiplication or division are memory-bound: one vector.
    const CHUNK: [(usize, bool); MAX_FORMS as usize] = {
        let mut c = [(0, true); MAX_FORMS as usize];
        c[POW_GENERAL as usize] = (16, false);
        c[POW_SPECIAL as usize] = (16, false);
        c
    };
    #[inline(always)]
    fn fwd(x: f32, a: f32, b: f32) -> f32 {
        crate::by_form!(pow_form(a), F => Self::fwd_in::<F>(x, a, b))
    }
    #[inline(always)]
    fn bwd(x: f32, g: f32, a: f32, b: f32) -> f32 {
        crate::by_form!(pow_form(a - 1.0), F => Self::bwd_in::<F>(x, g, a, b))
    }
}

/// [`Pow`] in the one form `F` alone, for the small launches' entries of the forms that are a
/// multiplication or a division (`pow_square_fwd_small_f32`, ...: [`PowForm`], chosen by the host
/// from the exponent). At 2^16 elements a launch's time is its latency, and `Pow`'s small entry
/// reached its form through four compares and an indirect branch (`BRX`) laid out past the
/// general path's code, where PyTorch launches a kernel of its own for such an exponent (see
/// docs/worklog.md, 2026-11-26e). The math is `Pow`'s `fwd_in::<F>` /
/// `bwd_in::<F>`, so the bits are those of the all-forms kernels.
pub struct PowIn<const F: u32>;

impl<const F: u32> UnaryFn for PowIn<F> {
    #[inline(always)]
    fn fwd(x: f32, a: f32, b: f32) -> f32 {
        Pow::fwd_in::<F>(x, a, b)
    }
    #[inline(always)]
    fn bwd(x: f32, g: f32, a: f32, b: f32) -> f32 {
        Pow::bwd_in::<F>(x, g, a, b)
    }
}

/// `x x` (pow's form for p = 2).
pub type PowSquare = PowIn<POW_SQUARE>;
/// `(x x) x` (p = 3).
pub type PowCube = PowIn<POW_CUBE>;
/// `x` (p = 1).
pub type PowOne = PowIn<POW_ONE>;
/// `1 / x` (p = -1).
pub type PowRecip = PowIn<POW_RECIPROCAL>;

impl PowForm {
    /// The entry of `pow` to the exponent `p` where it has one ([`PowIn`]); the backward's is that
    /// of `p - 1`, as [`Pow`]'s backward form.
    pub fn of(p: f32) -> Option<PowForm> {
        match pow_form(p) {
            POW_SQUARE => Some(PowForm::PowSquare),
            POW_CUBE => Some(PowForm::PowCube),
            POW_ONE => Some(PowForm::PowOne),
            POW_RECIPROCAL => Some(PowForm::PowRecip),
            _ => None,
        }
    }
}

// min(max(x, lo), hi) with NaN propagated; gradient passes on [lo, hi], bounds included.
unary!(
    /// `min(max(x, a), b)`, NaN propagated; the gradient passes on `[a, b]`.
    Clamp,
    |x, a, b| {
        let y = if x < a { a } else { x };
        if y > b { b } else { y }
    },
    |x, g, a, b| if x >= a && x <= b { g } else { 0.0 }
);

// --- activations ----------------------------------------------------------------------------------
// relu(NaN) = NaN (the comparison is false); the gradient at 0 is 0, as threshold_backward.
unary!(Relu, |x, a, b| if x <= 0.0 { 0.0 } else { x }, |x, g, a, b| if x <= 0.0 { 0.0 } else { g });
/// `x` where `x > 0`, else `a x`; backward `g` or `g a`. From the output where `a >= 0` (or NaN):
/// then `y > 0` exactly where `x > 0`.
pub struct LeakyRelu;
impl UnaryFn for LeakyRelu {
    #[inline(always)]
    fn fwd(x: f32, a: f32, _: f32) -> f32 {
        if x > 0.0 { x } else { x * a }
    }
    #[inline(always)]
    fn bwd(x: f32, g: f32, a: f32, _: f32) -> f32 {
        if x > 0.0 { g } else { g * a }
    }
    fn bwd_reads_y(p: [f32; 2]) -> bool {
        p[0] >= 0.0 || p[0].is_nan()
    }
}
/// The logistic function: `1 / (1 + e^-x)` with the f32 exp and an IEEE division for f32
/// storage; for f16/bf16 `fastmath::sigmoid_half` (the special function unit's 2^x and
/// reciprocal), six instructions instead of about thirty.
pub struct Sigmoid;
impl UnaryFn for Sigmoid {
    #[inline(always)]
    fn fwd(x: f32, _: f32, _: f32) -> f32 {
        sigmoid(x)
    }
    #[inline(always)]
    fn bwd(x: f32, g: f32, _: f32, _: f32) -> f32 {
        let s = sigmoid(x);
        g * s * (1.0 - s)
    }
    #[inline(always)]
    fn fwd_half(x: f32, _: f32, _: f32) -> f32 {
        math::sigmoid_half(x)
    }
    #[inline(always)]
    fn bwd_half(x: f32, g: f32, _: f32, _: f32) -> f32 {
        let s = math::sigmoid_half(x);
        g * s * (1.0 - s)
    }
}
// tanh' = 1 - t^2 = 4 e / (1 + e)^2 with e = e^-2|x|: a product of one exp and one reciprocal,
// no cancellation for any x (the accurate tanh's range split and compensated steps, then
// 1 - t^2, made the f32 backward compute-bound: see docs/worklog.md, 2026-11-23b). At
// x = +-inf, e = 0 and the result is g * 0 (NaN for infinite g), as PyTorch's g (1 - 1).
/// `tanh(x)`; backward `g (1 - tanh(x)^2)`, as `4 e / (1 + e)^2` with `e = exp(-2|x|)`; for
/// f16/bf16 `fastmath::tanh_half` and the special function unit's exp.
pub struct Tanh;
impl UnaryFn for Tanh {
    #[inline(always)]
    fn fwd(x: f32, _: f32, _: f32) -> f32 {
        math::tanh(x)
    }
    #[inline(always)]
    fn bwd(x: f32, g: f32, _: f32, _: f32) -> f32 {
        let e = math::exp(-2.0 * abs(x));
        let s = math::recip(1.0 + e);
        g * (4.0 * e * s * s)
    }
    #[inline(always)]
    fn fwd_half(x: f32, _: f32, _: f32) -> f32 {
        math::tanh_half(x)
    }
    // e = e^-2|x| in (0, 1], so 1 + e is in [1, 2] and MUFU.EX2 alone is 2^-22 relative.
    #[inline(always)]
    fn bwd_half(x: f32, g: f32, _: f32, _: f32) -> f32 {
        let e = math::exp_for::<crate::F16>(-2.0 * abs(x));
        let s = math::recip(1.0 + e);
        g * (4.0 * e * s * s)
    }
}
const FRAC_1_SQRT_2: f32 = core::f32::consts::FRAC_1_SQRT_2;
/// GELU, erf form: `x Phi(x)`.
///
/// The f32 forward keeps the accurate erf (`0.5 x (1 + erf(x / sqrt 2))`, PyTorch's formula,
/// within 4 ulp). Everything else takes `fastmath::normal_cdf` (one polynomial and one MUFU.EX2,
/// 2^-18 relative on the negative side, 2^-23 absolute) and `normal_pdf`:
/// - f16/bf16 forward: the error is 1/128 of an f16 ulp. The erf (two polynomials, a select
///   and an exp) made it compute-bound, with two elements per four bytes moved (see
///   docs/worklog.md, 2026-11-23c).
/// - backward, every dtype: `g (Phi + x phi)`; the bound the tests hold it to is absolute at
///   the scale `|g| (2 + |x|) 8 ulp` (PyTorch's `cdf + x pdf` cancels there), and Phi's 2^-23 and
///   phi's 2^-22 relative stay under a quarter of it. Erf and the f32 exp made the f32
///   backward compute-bound (2026-11-23c).
pub struct Gelu;
impl UnaryFn for Gelu {
    #[inline(always)]
    fn fwd(x: f32, _: f32, _: f32) -> f32 {
        0.5 * x * (1.0 + math::erf(x * FRAC_1_SQRT_2))
    }
    #[inline(always)]
    fn bwd(x: f32, g: f32, _: f32, _: f32) -> f32 {
        g * math::fma(x, math::normal_pdf(x), math::normal_cdf(x))
    }
    #[inline(always)]
    fn fwd_half(x: f32, _: f32, _: f32) -> f32 {
        x * math::normal_cdf(x)
    }
}
/// sqrt(2/pi), as PyTorch's `kBeta` in the tanh approximation of GELU.
pub const GELU_BETA: f32 = 0.797_884_6;
/// The cubic coefficient of the tanh approximation, as PyTorch's `kKappa`.
pub const GELU_KAPPA: f32 = 0.044_715;
/// PyTorch's `gelu(x, approximate="tanh")`: `x / (1 + exp(-2u))` with
/// `u = GELU_BETA (x + GELU_KAPPA x^3)`; for f16/bf16 with [`Sigmoid`]'s fast form.
pub struct GeluTanh;
impl UnaryFn for GeluTanh {
    // 0.5 x (1 + tanh(u)) = x sigmoid(2u) = x / (1 + e^-2u): one exp and a reciprocal instead
    // of the accurate tanh's range split and double-f32 steps, which made the forward
    // compute-bound (see docs/worklog.md, 2026-11-23, GELU tanh form). The reciprocal is
    // `math::recip` (MUFU.RCP and a Newton step, the bits of `div.rn`, no branch) times x: an
    // IEEE division's range checks and slow-path calls made the kernel's instructions set its
    // pace (2026-11-26f). The error: e^-2u's 2 ulp enter scaled by e / (1 + e) <= 1, plus three
    // roundings; u's own rounding enters as in the tanh form. At x = -inf, x sigmoid(-inf) would
    // be -inf / e^89 (the exp clamps) where PyTorch's 0.5 x (1 + tanh) gives -inf * 0 = NaN.
    #[inline(always)]
    fn fwd(x: f32, _: f32, _: f32) -> f32 {
        let inner = GELU_BETA * (x + GELU_KAPPA * x * x * x);
        let y = x * math::recip(1.0 + math::exp(-2.0 * inner));
        if x == f32::NEG_INFINITY { f32::NAN } else { y }
    }
    // The backward in the same terms: with s = sigmoid(2u) = 1 / (1 + e), e = e^-2u, PyTorch's
    // 0.5 (1 + t) + 0.5 x (1 - t^2) u' is s + 2 x e s^2 u' = s (1 + 2 x (e s) u'): one exp and
    // a reciprocal, and no cancellation (1 - s = e s exactly). Below u = -44 (-2u > 88) e would
    // overflow (inf * 0 = NaN in `e s`): -2u is clamped at 88, which leaves a value under
    // 1e-35 |g| where the true one is smaller still (s < e^-88 times a cubic of x), far inside
    // the tolerance. x = -inf gives NaN as PyTorch's `-inf * 0`; x = +inf gives NaN by itself
    // (inf * 0 in `x e s`), as PyTorch. The accurate-tanh form made the f32 backward
    // compute-bound (see docs/worklog.md, 2026-11-23b).
    #[inline(always)]
    fn bwd(x: f32, g: f32, _: f32, _: f32) -> f32 {
        let x2 = x * x;
        let m = -2.0 * GELU_BETA * (x + GELU_KAPPA * x2 * x);
        // min, not a branch: a select costs less than a divergent branch in a stream of
        // random signs. NaN x passes through `x` below.
        let e = math::exp(if m > 88.0 { 88.0 } else { m });
        let s = math::recip(1.0 + e);
        let du = GELU_BETA * (1.0 + 3.0 * GELU_KAPPA * x2);
        let d = g * s * (1.0 + 2.0 * x * (e * s) * du);
        if x == f32::NEG_INFINITY { f32::NAN } else { d }
    }
    // f16/bf16: sigmoid(2u) by `fastmath::sigmoid_half` (MUFU.EX2 and MUFU.RCP, 2^-21 relative,
    // 1/1000 of an f16 ulp) instead of the f32 exp and an IEEE division, each with its range
    // checks: at small sizes the math after the loads is the launch's length (see
    // docs/worklog.md, 2026-11-26e).
    #[inline(always)]
    fn fwd_half(x: f32, _: f32, _: f32) -> f32 {
        let inner = GELU_BETA * (x + GELU_KAPPA * x * x * x);
        let y = x * math::sigmoid_half(2.0 * inner);
        if x == f32::NEG_INFINITY { f32::NAN } else { y }
    }
    // s = sigmoid(2u) by `sigmoid_half`, which saturates to exactly 0 and 1 (no e^-2u is formed,
    // so no clamp), and e s = 1 - s: one MUFU.EX2 and one MUFU.RCP an element instead of two
    // each (with sigmoid_half(-2u) for e s the special function unit set the bf16 backward's
    // pace: see docs/worklog.md, 2026-11-26f). For x < 0, s < 1/2 and 1 - s is
    // within s's error of e s. For x > 0, 1 - s is exact but takes s's absolute error (about
    // 2^-23 near 1), which enters the result as 2^-23 |2 x u'| against 1 + 2 x (e s) u' >= 1:
    // under 2^-15 relative up to x = 10, past which s is 1 and e s is 0 (the true e s is under
    // 1e-37).
    //
    // Past |x| = 20, s is exactly 0 or 1 (e s 1 or 0), so the term 2 x (e s) u' is taken at x
    // clamped to +-20 (two FMNMX, no branch): the same value inside, and no `0 * inf` past
    // |x| = 1.8e19 (in bf16's range), where x^2 and u' are infinite and would give NaN where the
    // derivative is 0 (x -> -inf side, here -0 or +0) or 1 (x -> +inf side). Guards for s = 0
    // and e s = 0 would be two branches an element (2026-11-26f). u and u' with fmas (Rust does
    // not contract `a * b + c`): u = beta x (1 + kappa x^2). At x = +-inf NaN, as
    // PyTorch's `bwd` (`-inf * 0`, `inf * 0`); NaN x gives NaN through s.
    #[inline(always)]
    fn bwd_half(x: f32, g: f32, _: f32, _: f32) -> f32 {
        let u2 = (2.0 * GELU_BETA) * (x * math::fma(GELU_KAPPA, x * x, 1.0));
        let s = math::sigmoid_half(u2);
        let es = 1.0 - s;
        // max/min are FMNMX; `clamp` keeps NaN with compares and selects, which s does here.
        #[allow(clippy::manual_clamp)]
        let xc = x.max(-20.0).min(20.0);
        let du = math::fma(3.0 * GELU_KAPPA * GELU_BETA, xc * xc, GELU_BETA);
        let d = g * s * math::fma((xc + xc) * es, du, 1.0);
        if abs(x) == f32::INFINITY { f32::NAN } else { d }
    }
}
/// `x sigmoid(x)`; for f16/bf16 with [`Sigmoid`]'s fast form.
pub struct Silu;
impl UnaryFn for Silu {
    #[inline(always)]
    fn fwd(x: f32, _: f32, _: f32) -> f32 {
        x * sigmoid(x)
    }
    #[inline(always)]
    fn bwd(x: f32, g: f32, _: f32, _: f32) -> f32 {
        let s = sigmoid(x);
        g * s * (1.0 + x * (1.0 - s))
    }
    #[inline(always)]
    fn fwd_half(x: f32, _: f32, _: f32) -> f32 {
        x * math::sigmoid_half(x)
    }
    #[inline(always)]
    fn bwd_half(x: f32, g: f32, _: f32, _: f32) -> f32 {
        let s = math::sigmoid_half(x);
        g * s * (1.0 + x * (1.0 - s))
    }
}
// Mish: x tanh(softplus(x)), with tanh(log(1 + e)) = n / (n + 2), n = e (e + 2), e = e^x: one exp
// and a division instead of exp, log1p and tanh. From x = 20, tanh(softplus(x)) and sigmoid(x)
// are 1 in f32 (and n would overflow from 44); the backward there is g (1 + x * 0), which keeps
// PyTorch's NaN at x = +inf (x sigmoid(x) (1 - t^2) = inf * 0).
#[inline(always)]
fn mish_t(x: f32) -> f32 {
    let e = math::exp(x);
    let n = e * (e + 2.0);
    n / (n + 2.0)
}
/// `(tanh(softplus(x)), sigmoid(x))`, for the backward.
#[inline(always)]
fn mish_parts(x: f32) -> (f32, f32) {
    let e = math::exp(x);
    let n = e * (e + 2.0);
    // Both quotients from one reciprocal of the product of their denominators (under e^60
    // below x = 20, no overflow): a division costs about as much as the exp, and two of them
    // slowed the backward (see docs/worklog.md, 2026-11-23b).
    let (dt, ds) = (n + 2.0, 1.0 + e);
    let r = math::recip(dt * ds);
    (n * ds * r, e * dt * r)
}
unary!(
    /// `x tanh(softplus(x))` (`x` from 20 on).
    Mish,
    |x, a, b| if x >= 20.0 { x } else { x * mish_t(x) },
    |x, g, a, b| {
        if x >= 20.0 {
            g * (1.0 + x * 0.0)
        } else {
            let (t, s) = mish_parts(x);
            g * (t + x * s * (1.0 - t * t))
        }
    }
);
// softplus(x; beta = a, threshold = b): linear above the threshold, as PyTorch.
/// `log(1 + e^z)` for finite or infinite `z` (NaN passes): `max(z, 0) + log1p(t)` with
/// `t = e^-|z|` in `(0, 1]`, so that the log1p is of a bounded argument and needs no general
/// range reduction: `log1p(t) = 2 atanh(s)`, `s = t / (2 + t)` in `(0, 1/3]`, and the odd series
/// `2 s (1 + s^2/3 + ... + s^12/13)` stops at a remainder of `(1/9)^7 / 15 = 1.4e-8` relative,
/// under half an ulp. Written `t r (1 + q)` with `r = 2 / (2 + t)` (about 1), so that a
/// denormal `t` (z below -87) is scaled by a normal number and keeps its bits. Error: `t`'s
/// (the exp, 2 ulp) passes with a factor below 1, the division and the polynomial add about 2
/// ulp, the final add one rounding. About half the instructions of the general
/// `log1p(exp(z))`, whose range reduction and special cases made the f32 forward compute-bound
/// (see docs/worklog.md, 2026-11-23, softplus).
#[inline(always)]
fn softplus_unit(z: f32) -> f32 {
    let t = math::exp(-abs(z));
    let tr = t * (2.0 * math::recip(2.0 + t));
    let s = tr * 0.5;
    let s2 = s * s;
    let q = math::fma(
        s2,
        math::fma(
            s2,
            math::fma(s2, math::fma(s2, math::fma(s2, 1.0 / 13.0, 1.0 / 11.0), 1.0 / 9.0), 1.0 / 7.0),
            1.0 / 5.0,
        ),
        1.0 / 3.0,
    ) * s2;
    (if z > 0.0 { z } else { 0.0 }) + math::fma(tr, q, tr)
}

unary!(
    /// `log(1 + exp(a x)) / a`, and `x` where `a x > b` (PyTorch's `beta`, `threshold`).
    Softplus,
    |x, a, b| {
        let z = x * a;
        // `a` is a kernel parameter: the test is uniform, and spares PyTorch's default beta = 1
        // the division.
        if z > b {
            x
        } else if a == 1.0 {
            softplus_unit(z)
        } else {
            softplus_unit(z) / a
        }
    },
    |x, g, a, b| {
        let z = x * a;
        if z > b {
            g
        } else {
            let e = math::exp(z);
            g * e / (e + 1.0)
        }
    };
    check: |p| if p[0] == 0.0 || !p[0].is_finite() || p[1].is_nan() {
        Err("softplus needs a finite non-zero beta and a threshold that is not NaN")
    } else {
        Ok(())
    }
);
unary!(Identity, |x, a, b| x, |x, g, a, b| g);

// --- the exponential linear units and the hard and soft saturating activations --------------------
// PyTorch's ELU family (`elu`, `selu`, `celu` are one kernel there): `x` above 0, else
// `s a expm1(x c)`, with the derivative `g s a c exp(x c)` at and below 0 (its `x <= 0` test, so a
// NaN takes the linear branch). Both sides are computed and one selected (random signs would
// split a warp at a branch); `expm1_elu` keeps the relative accuracy near 0 where `exp - 1`
// cancels, and f16/bf16 storage takes its shorter polynomial and the special function unit's exp.
#[inline(always)]
fn elu_fwd<T: crate::Elem>(x: f32, scale: f32, alpha: f32, c: f32) -> f32 {
    let m = math::expm1_elu::<T>(x.min(0.0) * c) * (alpha * scale);
    if x <= 0.0 { m } else { x * scale }
}
#[inline(always)]
fn elu_bwd<T: crate::Elem>(x: f32, g: f32, scale: f32, alpha: f32, c: f32) -> f32 {
    let d = g * (c * (alpha * scale)) * math::exp_for::<T>(x.min(0.0) * c);
    if x <= 0.0 { d } else { g * scale }
}
/// An ELU-family op: `$name` with `(scale, alpha, c)` from the kernel's parameters `a`, `b`.
macro_rules! elu_op {
    ($(#[$m:meta])* $name:ident, |$a:ident, $b:ident| ($scale:expr, $alpha:expr, $c:expr) $(, $extra:item)*) => {
        $(#[$m])*
        pub struct $name;
        impl UnaryFn for $name {
            #[inline(always)]
            #[allow(unused_variables)]
            fn fwd(x: f32, $a: f32, $b: f32) -> f32 {
                elu_fwd::<f32>(x, $scale, $alpha, $c)
            }
            #[inline(always)]
            #[allow(unused_variables)]
            fn bwd(x: f32, g: f32, $a: f32, $b: f32) -> f32 {
                elu_bwd::<f32>(x, g, $scale, $alpha, $c)
            }
            #[inline(always)]
            #[allow(unused_variables)]
            fn fwd_half(x: f32, $a: f32, $b: f32) -> f32 {
                elu_fwd::<crate::F16>(x, $scale, $alpha, $c)
            }
            #[inline(always)]
            #[allow(unused_variables)]
            fn bwd_half(x: f32, g: f32, $a: f32, $b: f32) -> f32 {
                elu_bwd::<crate::F16>(x, g, $scale, $alpha, $c)
            }
            $($extra)*
        }
    };
}
elu_op!(
    /// `x` for `x > 0`, else `alpha (e^x - 1)` (PyTorch's `elu`); backward `g alpha e^x` at and
    /// below 0.
    Elu,
    |a, b| (1.0, a, 1.0)
);
/// SELU's `alpha` and `scale` (Klambauer et al.), PyTorch's `SELU_ALPHA` and `SELU_SCALE`.
pub const SELU_ALPHA: f32 = 1.673_263_2;
/// See [`SELU_ALPHA`].
pub const SELU_SCALE: f32 = 1.050_701;
elu_op!(
    /// `scale x` for `x > 0`, else `scale alpha (e^x - 1)`, with [`SELU_SCALE`] and [`SELU_ALPHA`].
    Selu,
    |a, b| (SELU_SCALE, SELU_ALPHA, 1.0)
);
elu_op!(
    /// `x` for `x > 0`, else `alpha (e^(x / alpha) - 1)` (PyTorch's `celu`). The kernel's
    /// parameters are `alpha` and `1 / alpha`, rounded once on the host, as PyTorch passes them
    /// to its ELU kernel (`UnaryFn::params`): the quotient is a product, as there.
    Celu,
    |a, b| (1.0, a, b),
    fn params(p: [f32; 2]) -> [f32; 2] {
        [p[0], 1.0 / p[0]]
    },
    fn check(p: [f32; 2]) -> Result<(), &'static str> {
        if p[0] == 0.0 { Err("celu's alpha must not be 0") } else { Ok(()) }
    }
);
/// `min(max(x + 3, 0), 6)`, NaN propagated (PyTorch's `std::min(std::max(..))` order).
#[inline(always)]
fn relu6_shift3(x: f32) -> f32 {
    let t = x + 3.0;
    let t = if t < 0.0 { 0.0 } else { t };
    if 6.0 < t { 6.0 } else { t }
}
/// PyTorch's `one_sixth`: `1/6` rounded to f32, by which its hard activations multiply.
const ONE_SIXTH: f32 = 1.0 / 6.0;
unary!(
    /// `x min(max(x + 3, 0), 6) / 6` as PyTorch computes it (times `1/6` rounded, for its bits);
    /// backward `g (x / 3 + 1/2)` strictly inside `(-3, 3)`, 0 at and below -3, `g` at and above
    /// 3 (a NaN `x` gives `g`, as PyTorch's chain of comparisons).
    Hardswish,
    |x, a, b| x * relu6_shift3(x) * ONE_SIXTH,
    |x, g, a, b| if x <= -3.0 {
        0.0
    } else if x < 3.0 {
        g * (x / 3.0 + 0.5)
    } else {
        g
    }
);
unary!(
    /// `min(max(x + 3, 0), 6) / 6` (PyTorch's `hardsigmoid`, times `1/6` rounded); backward
    /// `g / 6` strictly inside `(-3, 3)`, else 0.
    Hardsigmoid,
    |x, a, b| relu6_shift3(x) * ONE_SIXTH,
    |x, g, a, b| if x > -3.0 && x < 3.0 { g * ONE_SIXTH } else { 0.0 }
);
unary!(
    /// `x / (1 + |x|)` (PyTorch's `softsign`, which it composes from three kernels); backward
    /// `g / (1 + |x|)^2`, exactly 0 at `x = +-inf` where PyTorch's autograd of the composition
    /// gives NaN.
    Softsign,
    |x, a, b| x / (1.0 + abs(x)),
    |x, g, a, b| {
        let d = 1.0 + abs(x);
        g / (d * d)
    }
);

// --- binary -------------------------------------------------------------------------------------
macro_rules! binary {
    ($name:ident, |$x:ident, $y:ident| $fwd:expr, |$bx:ident, $by:ident, $g:ident| $bwd:expr) => {
        #[doc = concat!("`", stringify!($fwd), "`; backward `", stringify!($bwd), "` (`g`: the incoming gradient).")]
        pub struct $name;
        impl BinaryFn for $name {
            #[inline(always)]
            fn fwd($x: f32, $y: f32) -> f32 {
                $fwd
            }
            #[inline(always)]
            #[allow(unused_variables)]
            fn bwd($bx: f32, $by: f32, $g: f32) -> (f32, f32) {
                $bwd
            }
        }
    };
}
binary!(Add, |x, y| x + y, |x, y, g| (g, g));
binary!(Sub, |x, y| x - y, |x, y, g| (g, -g));
binary!(Mul, |x, y| x * y, |x, y, g| (g * y, g * x));
// d/dy as PyTorch orders it, -g * ((x / y) / y), so intermediates overflow where PyTorch's do.
binary!(Div, |x, y| x / y, |x, y, g| (g / y, -g * ((x / y) / y)));

// --- backward from the output -------------------------------------------------------------------
/// An op whose derivative is a function of its output, so that its backward can read the saved
/// output `y = f(x)` instead of `x`, as PyTorch's autograd does for these ops
/// (`sigmoid_backward(grad, result)`, `tanh_backward`, `grad * result` for exp, ...): a caller
/// may then keep `y` alone, and the math after the two loads is a few multiplications instead
/// of the op again (sigmoid's and tanh's backwards from `x` recompute an exp and a reciprocal).
/// The formulas are PyTorch's, in its order.
pub trait OutputGradFn: UnaryFn {
    /// `f'(x) g`, written in `y = f(x)`.
    fn bwd_y(y: f32, g: f32) -> f32;
}

/// `O`'s backward from its output, as a [`UnaryFn`] for the unary backward kernel: the kernel's
/// first input is `y` where `O`'s is `x`. Its forward is `O`'s (no kernel launches it: only the
/// backward kernels `<op>_bwd_y_<dtype>` and their `_small` entries exist).
pub struct FromOutput<O>(core::marker::PhantomData<O>);
impl<O: OutputGradFn> UnaryFn for FromOutput<O> {
    #[inline(always)]
    fn fwd(x: f32, a: f32, b: f32) -> f32 {
        O::fwd(x, a, b)
    }
    #[inline(always)]
    fn bwd(y: f32, g: f32, _: f32, _: f32) -> f32 {
        O::bwd_y(y, g)
    }
}

impl OutputGradFn for Exp {
    #[inline(always)]
    fn bwd_y(y: f32, g: f32) -> f32 {
        g * y
    }
}
impl OutputGradFn for Sqrt {
    #[inline(always)]
    fn bwd_y(y: f32, g: f32) -> f32 {
        g / (2.0 * y)
    }
}
// Left to right, one factor of y at a time (as `Rsqrt::bwd`): the intermediates stay between
// g / 2 and the result, so none overflows where the result does not.
impl OutputGradFn for Rsqrt {
    #[inline(always)]
    fn bwd_y(y: f32, g: f32) -> f32 {
        -0.5 * g * y * y * y
    }
}
impl OutputGradFn for Sigmoid {
    #[inline(always)]
    fn bwd_y(y: f32, g: f32) -> f32 {
        g * (1.0 - y) * y
    }
}
impl OutputGradFn for Tanh {
    #[inline(always)]
    fn bwd_y(y: f32, g: f32) -> f32 {
        g * (1.0 - y * y)
    }
}

/// The element-wise op table: every unary op and activation, one row each, declared once.
///
/// A row is `kind stem Type params y domain torch module doc;`:
/// - `kind`: `math` (a variant of the host's `kernels::ops::UnaryOp`) or `act`
///   (an activation, also usable in the fused `act(x * scale + bias)` and, where the GEMM has it,
///   in the matrix products' epilogue);
/// - `stem`: the name everywhere (kernels `<stem>_fwd_<dtype>`, ..., the `Tensor` method, the
///   Python function, the benches);
/// - `Type`: the formula's type in this module ([`UnaryFn`]) and the public enum variant's name;
/// - `params`: `{}`, `(name = value)` or `{name = value, ...}` (at most two, f32): the variant's
///   form and fields; the values are PyTorch's defaults for activations and the value the tests
///   and benches use for the math ops;
/// - `y`: how the gradient follows from the output `y = f(x)` (PyTorch's autograd keeps `y`
///   for these): `y` by a kernel of its own ([`OutputGradFn`]), `yx` by the backward from `x`
///   read at `y` (a constant derivative, or one that depends on the sign alone, which the op
///   keeps; see [`UnaryFn::bwd_reads_y`]), `y1` the derivative is 1 (the gradient passes), `-`
///   not at all;
/// - `domain`: `normal` or `positive`, the inputs the tests and benches draw;
/// - `torch`: PyTorch's version, a Python callable of `(x, *params)` (with `torch` and
///   `F = torch.nn.functional` in scope), for the baselines and the Python tests;
/// - `module`: the `torch.nn` module it replaces (`""`: none);
/// - `doc`: one line for the enum variant and the method.
///
/// The macro passes `[args] rows` to `$m!`: the device side instantiates its kernels from it, the
/// host generates its enums, `Tensor` methods and the list the Python package exports. Adding a
/// row (with the formula's type above it, and its f64 reference in the tests) is all it takes to
/// add an op.
#[macro_export]
macro_rules! unary_table {
    ($($m:ident)::+ $(! $($args:tt)*)?) => {
        $($m)::+! { [$($($args)*)?]
            math neg         Neg         {}                             yx normal   "torch.neg"                               ""            "`-x`.";
            math add_scalar  AddScalar   (s = 1.5)                      y1 normal   "torch.add"                               ""            "`x + s`.";
            math sub_scalar  SubScalar   (s = 1.5)                      y1 normal   "torch.sub"                               ""            "`x - s`.";
            math mul_scalar  MulScalar   (s = 1.5)                      yx normal   "torch.mul"                               ""            "`x * s`.";
            math div_scalar  DivScalar   (s = 1.5)                      yx normal   "torch.div"                               ""            "`x / s`, as PyTorch divides by a scalar: `x * (1 / s)`, the reciprocal rounded once.";
            math abs         Abs         {}                             -  normal   "torch.abs"                               ""            "`|x|` (derivative `sign(x)`, 0 at 0, as PyTorch).";
            math exp         Exp         {}                             y  normal   "torch.exp"                               ""            "`e^x`.";
            math log         Log         {}                             -  positive "torch.log"                               ""            "The natural logarithm (NaN below 0, `-inf` at 0).";
            math expm1       Expm1       {}                             -  normal   "torch.expm1"                             ""            "`e^x - 1`, accurate near 0.";
            math log1p       Log1p       {}                             -  positive "torch.log1p"                             ""            "`log(1 + x)`, accurate near 0.";
            math erf         Erf         {}                             -  normal   "torch.erf"                               ""            "The error function.";
            math sqrt        Sqrt        {}                             y  positive "torch.sqrt"                              ""            "`sqrt(x)` (NaN below 0).";
            math rsqrt       Rsqrt       {}                             y  positive "torch.rsqrt"                             ""            "`1 / sqrt(x)`.";
            math pow         Pow         (p = 2.5)                      -  positive "torch.pow"                               ""            "`x ^ p`.";
            math clamp       Clamp       {min = -0.5, max = 0.5}        -  normal   "torch.clamp"                             ""            "`min(max(x, min), max)`, NaN propagated.";
            act  identity    Identity    {}                             y1 normal   "lambda x: x"                             ""            "`x`.";
            act  relu        Relu        {}                             yx normal   "F.relu"                                  "ReLU"        "`max(x, 0)`; NaN stays NaN.";
            act  leaky_relu  LeakyRelu   {negative_slope = 0.01}        yx normal   "F.leaky_relu"                            "LeakyReLU"   "`x` where `x > 0`, else `negative_slope * x`.";
            act  sigmoid     Sigmoid     {}                             y  normal   "torch.sigmoid"                           "Sigmoid"     "`1 / (1 + e^-x)`.";
            act  tanh        Tanh        {}                             y  normal   "torch.tanh"                              "Tanh"        "`tanh(x)`.";
            act  gelu        Gelu        {}                             -  normal   "F.gelu"                                  ""            "GELU, `x Phi(x)` with the exact normal CDF (erf form, PyTorch's default).";
            act  gelu_tanh   GeluTanh    {}                             -  normal   "lambda x: F.gelu(x, approximate='tanh')" ""            "PyTorch's `gelu(x, approximate=\"tanh\")`.";
            act  silu        Silu        {}                             -  normal   "F.silu"                                  "SiLU"        "`x * sigmoid(x)`, also called Swish.";
            act  mish        Mish        {}                             -  normal   "F.mish"                                  "Mish"        "`x * tanh(softplus(x))`.";
            act  softplus    Softplus    {beta = 1.0, threshold = 20.0} -  normal   "F.softplus"                              "Softplus"    "`log(1 + exp(beta x)) / beta`, and `x` where `beta x > threshold`.";
            act  elu         Elu         {alpha = 1.0}                  -  normal   "F.elu"                                   "ELU"         "`x` for `x > 0`, else `alpha (e^x - 1)`.";
            act  selu        Selu        {}                             -  normal   "F.selu"                                  "SELU"        "`scale x` for `x > 0`, else `scale alpha (e^x - 1)` (self-normalising constants).";
            act  celu        Celu        {alpha = 1.0}                  -  normal   "F.celu"                                  "CELU"        "`x` for `x > 0`, else `alpha (e^(x / alpha) - 1)`; `alpha` must not be 0.";
            act  hardswish   Hardswish   {}                             -  normal   "F.hardswish"                             "Hardswish"   "`x min(max(x + 3, 0), 6) / 6`.";
            act  hardsigmoid Hardsigmoid {}                             -  normal   "F.hardsigmoid"                           "Hardsigmoid" "`min(max(x + 3, 0), 6) / 6`.";
            act  softsign    Softsign    {}                             -  normal   "F.softsign"                              "Softsign"    "`x / (1 + |x|)`.";
        }
    };
}

/// Selects rows of [`unary_table`] and passes them to `$m!` as `stem Type,` pairs: `all` rows,
/// the `act` rows, or the rows with `y`. For the lists below.
#[doc(hidden)]
#[macro_export]
macro_rules! __unary_select {
    ([$($m:ident)::+ $which:ident [$($acc:tt)*]]) => { $($m)::+! { $($acc)* } };
    ([$($m:ident)::+ all [$($acc:tt)*]] $k:ident $stem:ident $Ty:ident $p:tt $y:tt $d:ident $t:literal $mo:literal $doc:literal; $($rest:tt)*) => {
        $crate::__unary_select!([$($m)::+ all [$($acc)* $stem $Ty,]] $($rest)*);
    };
    ([$($m:ident)::+ act [$($acc:tt)*]] act $stem:ident $Ty:ident $p:tt $y:tt $d:ident $t:literal $mo:literal $doc:literal; $($rest:tt)*) => {
        $crate::__unary_select!([$($m)::+ act [$($acc)* $stem $Ty,]] $($rest)*);
    };
    ([$($m:ident)::+ y [$($acc:tt)*]] $k:ident $stem:ident $Ty:ident $p:tt y $d:ident $t:literal $mo:literal $doc:literal; $($rest:tt)*) => {
        $crate::__unary_select!([$($m)::+ y [$($acc)* $stem $Ty,]] $($rest)*);
    };
    ([$($m:ident)::+ $which:ident [$($acc:tt)*]] $k:ident $stem:ident $Ty:ident $p:tt $y:tt $d:ident $t:literal $mo:literal $doc:literal; $($rest:tt)*) => {
        $crate::__unary_select!([$($m)::+ $which [$($acc)*]] $($rest)*);
    };
}

/// Every row of [`unary_table`] as `stem Type,` pairs passed to `$m!` in one invocation: the
/// device side instantiates kernels named `<stem>_<kind>_<dtype>` from it, and the enums below
/// and their kernels' typed handles (`elementwise`) come from the same list: they cannot differ.
///
/// [`unary_table`]: crate::unary_table
#[macro_export]
macro_rules! unary_list {
    ($m:ident) => {
        $crate::unary_table!($crate::__unary_select! $m all []);
    };
}

/// The activations (`act` rows of [`unary_table`]), as [`unary_list`]: usable alone and inside
/// the fused `act(x * scale + bias)`.
///
/// [`unary_table`]: crate::unary_table
#[macro_export]
macro_rules! activation_list {
    ($m:ident) => {
        $crate::unary_table!($crate::__unary_select! $m act []);
    };
}

/// The ops with a kernel of their own for the backward from the output (the rows of
/// [`unary_table`] with `y`, [`OutputGradFn`]), as [`unary_list`].
///
/// [`unary_table`]: crate::unary_table
#[macro_export]
macro_rules! output_grad_list {
    ($m:ident) => {
        $crate::unary_table!($crate::__unary_select! $m y []);
    };
}

/// pow's forms with small-launch entries of their own ([`PowIn`]), as [`unary_list`].
#[macro_export]
macro_rules! pow_form_list {
    ($m:ident) => {
        $m! { pow_square PowSquare, pow_cube PowCube, pow_one PowOne, pow_recip PowRecip, }
    };
}

/// The binary ops, as [`unary_list`].
#[macro_export]
macro_rules! binary_list {
    ($m:ident) => {
        $m! { add Add, sub Sub, mul Mul, div Div, }
    };
}

// The enums of the lists above. Their kernels' typed handles, per storage type, are
// `elementwise`'s (e.g. `Unary::kernels`), from the same lists.
macro_rules! op_enum {
    ($(#[$m:meta])* $Enum:ident; [$($op:ident $O:ident),* $(,)?]) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $Enum { $(#[doc = concat!("`", stringify!($op), "`.")] $O),* }
        impl $Enum {
            /// Every op of the list, in its order.
            pub const ALL: &'static [$Enum] = &[$($Enum::$O),*];
            /// The op's stem, as in the kernel names.
            pub const fn stem(self) -> &'static str {
                match self { $($Enum::$O => stringify!($op)),* }
            }
        }
        op_enum!(@eval $Enum; $($O)*);
    };
    (@eval Binary; $($O:ident)*) => {
        impl Binary {
            /// The kernels' f32 forward, run here (the CPU tests use it).
            pub fn fwd_f32(self, x: f32, y: f32) -> f32 {
                match self { $(Binary::$O => <$O as BinaryFn>::fwd(x, y)),* }
            }
            /// The kernels' f32 backward, run here.
            pub fn bwd_f32(self, x: f32, y: f32, g: f32) -> (f32, f32) {
                match self { $(Binary::$O => <$O as BinaryFn>::bwd(x, y, g)),* }
            }
        }
    };
    (@eval OutputGrad; $($O:ident)*) => {
        impl OutputGrad {
            /// The kernels' f32 backward from the output, run here.
            pub fn bwd_y_f32(self, y: f32, g: f32) -> f32 {
                match self { $(OutputGrad::$O => <$O as OutputGradFn>::bwd_y(y, g)),* }
            }
        }
    };
    (@eval $Enum:ident; $($O:ident)*) => {
        impl $Enum {
            /// The kernels' f32 forward, run here (the CPU tests use it).
            pub fn fwd_f32(self, x: f32, a: f32, b: f32) -> f32 {
                match self { $($Enum::$O => <$O as UnaryFn>::fwd(x, a, b)),* }
            }
            /// The kernels' f32 backward, run here.
            pub fn bwd_f32(self, x: f32, g: f32, a: f32, b: f32) -> f32 {
                match self { $($Enum::$O => <$O as UnaryFn>::bwd(x, g, a, b)),* }
            }
        }
    };
}

macro_rules! unary_enum {
    ($($t:tt)*) => { op_enum!(
        /// Every unary op (math and activations), as the kernels know it (parameters apart); the
        /// `_small` kernels are for small launches (see `elementwise`).
        Unary; [$($t)*]); };
}
unary_list!(unary_enum);

macro_rules! unary_chunk {
    ($($op:ident $O:ident),* $(,)?) => {
        impl Unary {
            /// The op's form for the forward's parameters ([`UnaryFn::fwd_form`]).
            pub fn fwd_form(self, a: f32, b: f32) -> u32 {
                match self { $(Unary::$O => <$O as UnaryFn>::fwd_form(a, b)),* }
            }
            /// The op's form for the backward's parameters ([`UnaryFn::bwd_form`]).
            pub fn bwd_form(self, a: f32, b: f32) -> u32 {
                match self { $(Unary::$O => <$O as UnaryFn>::bwd_form(a, b)),* }
            }
            /// The kernel's `(a, b)` from the user's parameters ([`UnaryFn::params`]).
            pub fn params(self, p: [f32; 2]) -> [f32; 2] {
                match self { $(Unary::$O => <$O as UnaryFn>::params(p)),* }
            }
            /// Why the user's parameters are refused, if they are ([`UnaryFn::check`]).
            pub fn check(self, p: [f32; 2]) -> Result<(), &'static str> {
                match self { $(Unary::$O => <$O as UnaryFn>::check(p)),* }
            }
            /// [`UnaryFn::bwd_reads_y`] of the op.
            pub fn bwd_reads_y(self, p: [f32; 2]) -> bool {
                match self { $(Unary::$O => <$O as UnaryFn>::bwd_reads_y(p)),* }
            }
            /// Vectors a thread of the op's kernels above the small launches in `form`, for `dt`
            /// ([`UnaryFn::CHUNK`]): the host sizes their grid with it.
            pub const fn chunk(self, form: u32, dt: crate::DType) -> u64 {
                let c = match self { $(Unary::$O => <$O as UnaryFn>::CHUNK),* };
                crate::elementwise::chunk_vectors(c[form as usize].0, 16 / dt.size()) as u64
            }
        }
    };
}
unary_list!(unary_chunk);

macro_rules! pow_form_enum {
    ($($t:tt)*) => { op_enum!(
        /// pow's forms with small-launch entries of their own (`<form>_fwd_small_<dtype>`,
        /// `<form>_bwd_small_<dtype>`; [`PowForm::of`] picks one from the exponent).
        PowForm; [$($t)*]); };
}
pow_form_list!(pow_form_enum);

macro_rules! activation_enum {
    ($($t:tt)*) => { op_enum!(
        /// The activations of the fused `act(x * scale + bias)` kernels (`scale_bias_<act>_*`).
        Activation; [$($t)*]); };
}
activation_list!(activation_enum);

macro_rules! binary_enum {
    ($($t:tt)*) => { op_enum!(
        /// The binary ops, on two tensors (`fwd`, `bwd`, and `fwd_small`, `bwd_small` for small
        /// launches) or against a row (`row_fwd`, `row_bwd`).
        Binary; [$($t)*]); };
}
binary_list!(binary_enum);

macro_rules! output_grad_enum {
    ($($t:tt)*) => { op_enum!(
        /// The ops with a backward from their output (`<op>_bwd_y_<dtype>`, [`OutputGradFn`];
        /// `bwd_y_small` for small launches).
        OutputGrad; [$($t)*]); };
}
output_grad_list!(output_grad_enum);
