//! CPU references in f64, and the error each op's f32 computation is allowed.
//!
//! Each formula has PyTorch's structure (so NaN and infinities come out as PyTorch's do: e.g.
//! `gelu'(inf)` is NaN because PyTorch computes `x * pdf(x)` = inf * 0), evaluated in f64.
//! Tolerances are relative to U = 2^-23 (one f32 ulp at 1) and are derived from the number of
//! f32 roundings on the GPU's path, noted beside each op; the tests' `close` adds one ulp of the
//! storage type on top.
//!
//! Shared by the tests (`tests/common`), the examples and the benches (through `#[path]`), so it
//! needs nothing from the test harness.

use kernels::ops::{Activation, BinaryOp, UnaryOp};

/// Error allowed between a GPU result and the exact (f64) value `r` of the op at the given
/// inputs: `rtol * |r| + atol` from the f32 computation (per op, written beside each op in
/// this file), plus one ulp of the storage type (rounding the f32 result to f16/bf16; one
/// whole ulp because the f32 error can push a value across a rounding boundary), plus a floor of
/// the smallest normal f32: where f64 still has a denormal result the f32 formula has
/// underflowed to 0, as PyTorch's does.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub rtol: f64,
    pub atol: f64,
}

pub const U: f64 = 1.0 / 8_388_608.0; // 2^-23

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const KAPPA: f64 = 0.044715;

/// The exact value of `op` at `x` (parameters as the GPU sees them, i.e. as f32).
pub fn unary_fwd(op: UnaryOp, x: f64) -> f64 {
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Abs => x.abs(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Expm1 => libm::expm1(x),
        UnaryOp::Log1p => libm::log1p(x),
        UnaryOp::Erf => libm::erf(x),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Pow(p) => libm::pow(x, p as f64),
        UnaryOp::Clamp { min, max } => {
            let y = if x < min as f64 { min as f64 } else { x };
            if y > max as f64 { max as f64 } else { y }
        }
        UnaryOp::AddScalar(s) => x + s as f64,
        UnaryOp::SubScalar(s) => x - s as f64,
        UnaryOp::MulScalar(s) => x * s as f64,
        UnaryOp::DivScalar(s) => x / s as f64,
        UnaryOp::Act(a) => act_fwd(a, x),
    }
}

pub fn act_fwd(a: Activation, x: f64) -> f64 {
    match a {
        Activation::Identity => x,
        Activation::Relu => {
            if x <= 0.0 {
                0.0
            } else {
                x
            }
        }
        Activation::LeakyRelu { negative_slope } => {
            if x > 0.0 {
                x
            } else {
                x * negative_slope as f64
            }
        }
        Activation::Sigmoid => sigmoid(x),
        Activation::Tanh => x.tanh(),
        Activation::Gelu => 0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2)),
        Activation::GeluTanh => 0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + KAPPA * x * x * x)).tanh()),
        Activation::Silu => x * sigmoid(x),
        Activation::Mish => x * libm::log1p(x.exp()).tanh(),
        Activation::Softplus { beta, threshold } => {
            let z = x * beta as f64;
            if z > threshold as f64 { x } else { libm::log1p(z.exp()) / beta as f64 }
        }
        Activation::Elu { alpha } => elu(x, 1.0, alpha as f64, 1.0),
        Activation::Selu => elu(x, SELU_SCALE, SELU_ALPHA, 1.0),
        Activation::Celu { alpha } => elu(x, 1.0, alpha as f64, 1.0 / alpha as f64),
        Activation::Hardswish => x * relu6(x + 3.0) / 6.0,
        Activation::Hardsigmoid => relu6(x + 3.0) / 6.0,
        Activation::Softsign => x / (1.0 + x.abs()),
    }
}

const SELU_ALPHA: f64 = 1.673_263_242_354_377_3;
const SELU_SCALE: f64 = 1.050_700_987_355_480_5;

/// PyTorch's ELU family: `scale x` above 0, `scale alpha expm1(x c)` at and below (NaN: the first).
fn elu(x: f64, scale: f64, alpha: f64, c: f64) -> f64 {
    if x <= 0.0 { scale * alpha * libm::expm1(x * c) } else { scale * x }
}

/// The derivative of [`elu`] times `g`.
fn elu_grad(x: f64, g: f64, scale: f64, alpha: f64, c: f64) -> f64 {
    if x <= 0.0 { g * scale * alpha * c * (x * c).exp() } else { g * scale }
}

/// `min(max(t, 0), 6)` by comparisons, so that NaN propagates (`f64::max` would drop it).
fn relu6(t: f64) -> f64 {
    let t = if t < 0.0 { 0.0 } else { t };
    if t > 6.0 { 6.0 } else { t }
}

/// The exact derivative times `g`.
pub fn unary_bwd(op: UnaryOp, x: f64, g: f64) -> f64 {
    match op {
        UnaryOp::Neg => -g,
        UnaryOp::Abs => {
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
        UnaryOp::Exp | UnaryOp::Expm1 => g * x.exp(),
        UnaryOp::Log => g / x,
        UnaryOp::Log1p => g / (1.0 + x),
        UnaryOp::Erf => g * std::f64::consts::FRAC_2_SQRT_PI * (-x * x).exp(),
        UnaryOp::Sqrt => g / (2.0 * x.sqrt()),
        UnaryOp::Rsqrt => {
            let r = 1.0 / x.sqrt();
            -0.5 * g * r * r * r
        }
        UnaryOp::Pow(p) => {
            if p == 0.0 {
                0.0
            } else {
                g * p as f64 * libm::pow(x, p as f64 - 1.0)
            }
        }
        UnaryOp::Clamp { min, max } => {
            if x >= min as f64 && x <= max as f64 {
                g
            } else {
                0.0
            }
        }
        UnaryOp::AddScalar(_) | UnaryOp::SubScalar(_) => g,
        UnaryOp::MulScalar(s) => g * s as f64,
        UnaryOp::DivScalar(s) => g / s as f64,
        UnaryOp::Act(a) => act_bwd(a, x, g),
    }
}

pub fn act_bwd(a: Activation, x: f64, g: f64) -> f64 {
    match a {
        Activation::Identity => g,
        Activation::Relu => {
            if x <= 0.0 {
                0.0
            } else {
                g
            }
        }
        Activation::LeakyRelu { negative_slope } => {
            if x > 0.0 {
                g
            } else {
                g * negative_slope as f64
            }
        }
        Activation::Sigmoid => {
            let s = sigmoid(x);
            g * s * (1.0 - s)
        }
        Activation::Tanh => {
            let t = x.tanh();
            g * (1.0 - t * t)
        }
        Activation::Gelu => {
            let cdf = 0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2));
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            g * (cdf + x * pdf)
        }
        Activation::GeluTanh => {
            let x2 = x * x;
            let t = (SQRT_2_OVER_PI * (x + KAPPA * x2 * x)).tanh();
            let d_right = 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * KAPPA * x2);
            g * (0.5 * (1.0 + t) + d_right)
        }
        Activation::Silu => {
            let s = sigmoid(x);
            g * s * (1.0 + x * (1.0 - s))
        }
        Activation::Mish => {
            let t = libm::log1p(x.exp()).tanh();
            g * (t + x * sigmoid(x) * (1.0 - t * t))
        }
        Activation::Softplus { beta, threshold } => {
            let z = x * beta as f64;
            if z > threshold as f64 {
                g
            } else {
                let e = z.exp();
                g * e / (e + 1.0)
            }
        }
        Activation::Elu { alpha } => elu_grad(x, g, 1.0, alpha as f64, 1.0),
        Activation::Selu => elu_grad(x, g, SELU_SCALE, SELU_ALPHA, 1.0),
        Activation::Celu { alpha } => elu_grad(x, g, 1.0, alpha as f64, 1.0 / alpha as f64),
        // PyTorch's: 0 at and below -3, g at and above 3.
        Activation::Hardswish => {
            if x <= -3.0 {
                0.0
            } else if x < 3.0 {
                g * (x / 3.0 + 0.5)
            } else {
                g
            }
        }
        Activation::Hardsigmoid => {
            if x > -3.0 && x < 3.0 {
                g / 6.0
            } else {
                0.0
            }
        }
        Activation::Softsign => g / ((1.0 + x.abs()) * (1.0 + x.abs())),
    }
}

/// Error bound of the GPU's f32 forward of `op` at `x` (exact result `r`).
pub fn unary_fwd_tol(op: UnaryOp, x: f64) -> Tol {
    let ax = x.abs();
    let (rtol, atol) = match op {
        // One correctly rounded operation (or none).
        UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sqrt => (0.0, 0.0),
        UnaryOp::Clamp { .. } | UnaryOp::AddScalar(_) | UnaryOp::SubScalar(_) => (0.0, 0.0),
        UnaryOp::MulScalar(_) => (0.0, 0.0),
        // Two correctly rounded operations: 1 / s (on the host), then x times it.
        UnaryOp::DivScalar(_) => (U, 0.0),
        // Two correctly rounded operations (1/sqrt).
        UnaryOp::Rsqrt => (U, 0.0),
        // The math library's bound, <= 2 ulp (measured; see README), with margin.
        UnaryOp::Exp | UnaryOp::Log | UnaryOp::Expm1 | UnaryOp::Log1p | UnaryOp::Erf => (3.0 * U, 0.0),
        UnaryOp::Pow(_) => (3.0 * U, 0.0),
        UnaryOp::Act(a) => return act_fwd_tol(a, x),
    };
    let _ = ax;
    Tol { rtol, atol }
}

pub fn act_fwd_tol(a: Activation, x: f64) -> Tol {
    let ax = x.abs();
    let (rtol, atol) = match a {
        Activation::Identity | Activation::Relu => (0.0, 0.0),
        Activation::LeakyRelu { .. } => (0.0, 0.0),
        // exp (2 ulp), 1 + e, 1 / (.): the error of e enters scaled by e / (1 + e) <= 1.
        Activation::Sigmoid => (4.0 * U, 0.0),
        Activation::Tanh => (3.0 * U, 0.0),
        // x * sigmoid(x): one more rounding. Below x = -88.7, exp(-x) overflows f32 and the
        // result is 0 (as PyTorch's), where the exact |x| e^x is below 3e-37.
        Activation::Silu => (5.0 * U, 3e-37),
        // 0.5 x (1 + erf): 1 + erf cancels for x << 0; its rounding (and erf's 2 ulp of a value
        // <= 1) is absolute at scale 1, times 0.5 |x|.
        Activation::Gelu => (4.0 * U, 2.0 * ax * U),
        // As GELU, with the cubic's roundings entering through tanh' <= 1.
        Activation::GeluTanh => (6.0 * U, 4.0 * ax * U),
        // exp, log1p, tanh (2 ulp each, errors propagated with factors <= 1), one product.
        Activation::Mish => (10.0 * U, 0.0),
        // z = x * beta (exact for beta = 2^k), exp, log1p, / beta.
        Activation::Softplus { .. } => (8.0 * U, 0.0),
        // expm1 (`fastmath::expm1_elu`: a polynomial's roundings, or the exp's 2 ulp scaled by
        // e^t / (1 - e^t) < 0.6 and one subtraction) times alpha: one rounding. CELU's x / alpha
        // is a product with 1 / alpha (two roundings in the argument t), which moves expm1(t) by
        // |t| e^t / |expm1(t)| <= 1 times that, relative.
        Activation::Elu { .. } => (4.0 * U, 0.0),
        Activation::Celu { .. } => (6.0 * U, 0.0),
        // SELU's constants rounded to f32 (U/2 each), their product, expm1, the last product.
        Activation::Selu => (6.0 * U, 0.0),
        // x + 3, the products (with 1/6 rounded to f32 as PyTorch's `one_sixth`): a rounding
        // each, and the constant's half of one.
        Activation::Hardswish => (2.5 * U, 0.0),
        Activation::Hardsigmoid => (2.0 * U, 0.0),
        // 1 + |x| and the quotient.
        Activation::Softsign => (U, 0.0),
    };
    Tol { rtol, atol }
}

/// Error bound of the GPU's f32 backward of `op` at `x` with incoming gradient `g`.
pub fn unary_bwd_tol(op: UnaryOp, x: f64, g: f64) -> Tol {
    let (ax, ag) = (x.abs(), g.abs());
    let (rtol, atol) = match op {
        UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Clamp { .. } => (0.0, 0.0),
        UnaryOp::AddScalar(_) | UnaryOp::SubScalar(_) | UnaryOp::MulScalar(_) => (0.0, 0.0),
        // g times the reciprocal, as the forward.
        UnaryOp::DivScalar(_) => (U, 0.0),
        UnaryOp::Log => (0.0, 0.0),
        UnaryOp::Sqrt => (U, 0.0),
        UnaryOp::Rsqrt => (6.0 * U, 0.0),
        UnaryOp::Exp | UnaryOp::Expm1 => (4.0 * U, 0.0),
        UnaryOp::Pow(_) => (5.0 * U, 0.0),
        // 1 + x rounds with an error relative to x, large against 1 + x near x = -1.
        UnaryOp::Log1p => (2.0 * U + if x.is_finite() { U * ax / (1.0 + x).abs() } else { 0.0 }, 0.0),
        // exp(-x*x): the rounding of x*x is an absolute error x^2 U in the exponent.
        UnaryOp::Erf => (4.0 * U + if x.is_finite() { x * x * U } else { 0.0 }, 0.0),
        UnaryOp::Act(a) => return act_bwd_tol(a, x, g),
    };
    let _ = ag;
    Tol { rtol, atol }
}

pub fn act_bwd_tol(a: Activation, x: f64, g: f64) -> Tol {
    let (ax, ag) = (x.abs(), g.abs());
    match a {
        Activation::Identity | Activation::Relu | Activation::LeakyRelu { .. } => Tol { rtol: 0.0, atol: 0.0 },
        Activation::Softplus { .. } => Tol { rtol: 8.0 * U, atol: 0.0 },
        // exp (2 ulp) and two products; CELU's argument x / alpha carries two roundings, an
        // absolute error |x / alpha| U in the exponent.
        Activation::Elu { .. } | Activation::Selu => Tol { rtol: 5.0 * U, atol: 0.0 },
        Activation::Celu { alpha } => Tol { rtol: 5.0 * U + (x / alpha as f64).abs() * U, atol: 0.0 },
        // x / 3 rounds with an error relative to x (absolute against x / 3 + 1/2, which cancels
        // at x = -1.5), then the sum and the product.
        Activation::Hardswish => Tol { rtol: 2.0 * U, atol: ag * ax * U },
        // g times 1/6 rounded to f32: the constant's rounding and the product's.
        Activation::Hardsigmoid => Tol { rtol: U, atol: 0.0 },
        // 1 + |x|, its square, the quotient.
        Activation::Softsign => Tol { rtol: 3.0 * U, atol: 0.0 },
        // Derivative formulas chain up to 8 roundings (16 U relative), and cancel in (1 - s),
        // (1 - t^2), (1 + erf) at an absolute scale of |g| (1 + |x|) U.
        _ => Tol { rtol: 16.0 * U, atol: ag * (2.0 + ax) * 8.0 * U + ag * x * x * U },
    }
}

// --- backward from the output ---------------------------------------------------------------

/// `op'(x) g` written in the output `y = op(x)`, PyTorch's formulas for the backward from the
/// result, in f64 at the given `y`; `None` where `op` has no such backward. The ops whose
/// derivative is a constant or relu's sign take their backward from `x`, read at `y`.
pub fn unary_bwd_y(op: UnaryOp, y: f64, g: f64) -> Option<f64> {
    Some(match op {
        UnaryOp::Exp => g * y,
        UnaryOp::Sqrt => g / (2.0 * y),
        UnaryOp::Rsqrt => -0.5 * g * y * y * y,
        UnaryOp::Act(Activation::Sigmoid) => g * (1.0 - y) * y,
        UnaryOp::Act(Activation::Tanh) => g * (1.0 - y * y),
        UnaryOp::Neg
        | UnaryOp::MulScalar(_)
        | UnaryOp::DivScalar(_)
        | UnaryOp::AddScalar(_)
        | UnaryOp::SubScalar(_) => unary_bwd(op, y, g),
        UnaryOp::Act(Activation::Identity | Activation::Relu) => unary_bwd(op, y, g),
        UnaryOp::Act(Activation::LeakyRelu { negative_slope }) if negative_slope >= 0.0 || negative_slope.is_nan() => {
            unary_bwd(op, y, g)
        }
        _ => return None,
    })
}

/// Error bound of the kernels' f32 backward from the output at the `y` it reads: products only
/// (relative: three roundings at most, 1.5 U), except tanh's `1 - y y`, whose rounding of `y y`
/// is absolute at the scale `y^2 U / 2` and cancels against 1 near `|y| = 1`.
pub fn unary_bwd_y_tol(op: UnaryOp, y: f64, g: f64) -> Tol {
    match op {
        UnaryOp::Rsqrt | UnaryOp::Act(Activation::Sigmoid) => Tol { rtol: 2.0 * U, atol: 0.0 },
        UnaryOp::Act(Activation::Tanh) => Tol { rtol: 2.0 * U, atol: g.abs() * y * y * U },
        UnaryOp::DivScalar(_) => Tol { rtol: U, atol: 0.0 },
        _ => Tol { rtol: 0.0, atol: 0.0 },
    }
}

/// `|d/dy|` of [`unary_bwd_y`]'s formula at `y` (for the kernel ops): how an error in `y` itself
/// moves the gradient, to first order.
pub fn unary_bwd_y_slope(op: UnaryOp, y: f64, g: f64) -> f64 {
    let ag = g.abs();
    match op {
        UnaryOp::Exp => ag,
        UnaryOp::Sqrt => ag / (2.0 * y * y),
        UnaryOp::Rsqrt => 1.5 * ag * y * y,
        UnaryOp::Act(Activation::Sigmoid) => ag * (1.0 - 2.0 * y).abs(),
        UnaryOp::Act(Activation::Tanh) => 2.0 * ag * y.abs(),
        _ => 0.0,
    }
}

/// Where the derivative is not smooth (finite differences are meaningless within `h`).
pub fn kinks(op: UnaryOp) -> Vec<f64> {
    match op {
        UnaryOp::Abs => vec![0.0],
        UnaryOp::Clamp { min, max } => vec![min as f64, max as f64],
        UnaryOp::Act(Activation::Relu) | UnaryOp::Act(Activation::LeakyRelu { .. }) => vec![0.0],
        UnaryOp::Act(Activation::Softplus { beta, threshold }) => vec![threshold as f64 / beta as f64],
        UnaryOp::Act(Activation::Elu { .. } | Activation::Selu | Activation::Celu { .. }) => vec![0.0],
        UnaryOp::Act(Activation::Hardswish | Activation::Hardsigmoid) => vec![-3.0, 3.0],
        _ => vec![],
    }
}

/// Derivative of the f64 forward at `x` by finite differences, or `None` where that is not
/// meaningful (non-finite, near a kink, outside the domain, or not converging).
///
/// Richardson extrapolation of two central differences (their h^2 error terms cancel), with the
/// step shrunk until two successive estimates agree: near a singularity (log1p close to x = -1)
/// a step that is small against |x| can still be large against the distance to it.
pub fn finite_difference(op: UnaryOp, x: f64) -> Option<f64> {
    if !x.is_finite() || x.abs() > 1e4 {
        return None;
    }
    // x^inf and x^NaN have no derivative to approximate: PyTorch's formula p x^(p - 1) gives NaN
    // (inf * 0, or NaN) where a difference quotient gives 0.
    if let UnaryOp::Pow(p) = op
        && !p.is_finite()
    {
        return None;
    }
    // Rounding error is about eps |f| / h: start with a step large against that, on the scale at
    // which these functions vary (1, or |x|), and shrink while the estimates disagree.
    let mut h = 1e-4 * x.abs().max(1.0);
    if kinks(op).iter().any(|k| (x - k).abs() < 1e3 * h) {
        return None;
    }
    let central = |h: f64| (unary_fwd(op, x + h) - unary_fwd(op, x - h)) / (2.0 * h);
    let richardson = |h: f64| (4.0 * central(h / 2.0) - central(h)) / 3.0;
    let mut prev: Option<f64> = None;
    for _ in 0..10 {
        let d = richardson(h);
        if !d.is_finite() {
            prev = None;
        } else if prev.is_some_and(|p| (d - p).abs() <= 1e-7 * (1.0 + d.abs())) {
            return Some(d);
        } else {
            prev = Some(d);
        }
        h /= 8.0;
    }
    None
}

// --- gated activations ------------------------------------------------------------------------

/// `act(a) * b` (SwiGLU, GeGLU, GLU, ReGLU, ... by `act`).
pub fn glu_fwd(act: Activation, a: f64, b: f64) -> f64 {
    act_fwd(act, a) * b
}

/// `(d/da, d/db)` of [`glu_fwd`] times `g`, as PyTorch's autograd of `act(a) * b` computes it:
/// the activation's backward of the product's gradient `g b`, and `g act(a)`.
pub fn glu_bwd(act: Activation, a: f64, b: f64, g: f64) -> (f64, f64) {
    (act_bwd(act, a, g * b), g * act_fwd(act, a))
}

/// `act(a)` within `t` of the exact value, times `b` in one more rounding: the relative errors
/// add (with their product), the absolute one scales by `|b|` and the product's rounding.
fn times_one_rounding(t: Tol, scale: f64) -> Tol {
    Tol { rtol: t.rtol + U + t.rtol * U, atol: t.atol * scale * (1.0 + U) }
}

/// Error bound of the GPU's f32 [`glu_fwd`]: the activation's, then the product with `b`.
pub fn glu_fwd_tol(act: Activation, a: f64, b: f64) -> Tol {
    times_one_rounding(act_fwd_tol(act, a), b.abs())
}

/// Error bounds of the GPU's f32 [`glu_bwd`]: d/da is the activation's backward of `g b`, which
/// is rounded once first (its relative error passes through the linear backward); d/db is the
/// activation's forward times `g`.
pub fn glu_bwd_tol(act: Activation, a: f64, b: f64, g: f64) -> (Tol, Tol) {
    (times_one_rounding(act_bwd_tol(act, a, g * b), 1.0), times_one_rounding(act_fwd_tol(act, a), g.abs()))
}

/// The derivatives of [`glu_fwd`] in `a` and in `b` at `(a, b)` by finite differences (`a`'s as
/// [`finite_difference`] of the activation, times `b`; `b`'s, a linear function, one central
/// difference), or `None` where the activation's is not meaningful.
pub fn glu_finite_difference(act: Activation, a: f64, b: f64) -> Option<(f64, f64)> {
    if !b.is_finite() || b.abs() > 1e4 {
        return None;
    }
    let da = finite_difference(UnaryOp::Act(act), a)?;
    let h = 1e-3 * b.abs().max(1.0);
    let db = (glu_fwd(act, a, b + h) - glu_fwd(act, a, b - h)) / (2.0 * h);
    Some((da * b, db))
}

// --- binary ---------------------------------------------------------------------------------------

pub fn binary_fwd(op: BinaryOp, x: f64, y: f64) -> f64 {
    match op {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x * y,
        BinaryOp::Div => x / y,
    }
}

/// (d/dx, d/dy) times g, with PyTorch's formulas (div: `-g * x / y^2` as `-(g / y) * x / y`).
pub fn binary_bwd(op: BinaryOp, x: f64, y: f64, g: f64) -> (f64, f64) {
    match op {
        BinaryOp::Add => (g, g),
        BinaryOp::Sub => (g, -g),
        BinaryOp::Mul => (g * y, g * x),
        BinaryOp::Div => {
            let gx = g / y;
            (gx, -gx * x / y)
        }
    }
}

/// Forward: one correctly rounded operation. Backward: one rounding, or three for d/dy of div,
/// whose intermediates `x / y` and `(x / y) / y` may be denormal or underflow to 0.
pub fn binary_bwd_tol(op: BinaryOp, y: f64, g: f64) -> (Tol, Tol) {
    let exact = Tol { rtol: 0.0, atol: 0.0 };
    match op {
        BinaryOp::Div => {
            let denormal = f32::from_bits(1) as f64;
            // x / y and then / y each round with an absolute error up to the denormal spacing
            // (the first also scaled by 1 / |y| in the second); the product with g scales both.
            let atol = if y != 0.0 { g.abs() * denormal * (1.0 + 1.0 / y.abs()) } else { 0.0 };
            (exact, Tol { rtol: 2.0 * U, atol: if atol.is_finite() { atol } else { 0.0 } })
        }
        _ => (exact, exact),
    }
}

// --- AdamW ----------------------------------------------------------------------------------

/// One AdamW step of one element, exact (f64), with the error the kernel's f32 computation may
/// make in each result (absolute; [`super::close`] adds the rounding to the storage type).
#[derive(Clone, Copy, Debug)]
pub struct AdamWStep {
    pub p: f64,
    pub m: f64,
    pub v: f64,
    pub tol_p: Tol,
    pub tol_m: Tol,
    pub tol_v: Tol,
}

/// AdamW at step `step` from the stored `p, g, m, v`, in PyTorch's form (not the kernel's
/// refolded one, so the refolding is checked too):
/// `p' = p (1 - lr wd) - lr / bc1 * m' / (sqrt(v') / sqrt(bc2) + eps)`. The tolerances are
/// derived in the header of `tests/optim.rs`.
pub fn adamw(p: f64, g: f64, m: f64, v: f64, cfg: &kernels::ops::AdamW, step: u64) -> AdamWStep {
    let u = U / 2.0; // unit roundoff of f32
    let (b1, b2, lr, wd) = (cfg.beta1, cfg.beta2, cfg.lr, cfg.weight_decay);
    let t = step as f64;
    let bc1 = 1.0 - b1.powf(t);
    let bc2_sqrt = (1.0 - b2.powf(t)).sqrt();
    let m1 = b1 * m + (1.0 - b1) * g;
    let v1 = b2 * v + (1.0 - b2) * g * g;
    let denom = v1.sqrt() / bc2_sqrt + cfg.eps;
    let upd = lr / bc1 * m1 / denom;
    let d = 1.0 - lr * wd;
    let p1 = p * d - upd;

    let e_m = 1.01 * u * (m1.abs() + b1 * m.abs() + 2.0 * (1.0 - b1) * g.abs());
    let e_v = 1.01 * u * (2.0 * b2 * v + 4.0 * (1.0 - b2) * g * g);
    let eps_v = if v1 > 0.0 { e_v / v1 } else { 0.0 };
    let eps_d = eps_v / 2.0 + 2.0 * u;
    // S / d' of the header: (lr bc2_sqrt / bc1) / (sqrt(v') + eps bc2_sqrt) = lr / bc1 / denom.
    let s_over_d = lr / bc1 / denom;
    let e_p =
        1.01 * (u * p1.abs() + u * p.abs() * (d.abs() + lr * wd) + s_over_d * e_m + upd.abs() * (eps_d + 2.0 * u));
    let tol = |atol: f64| Tol { rtol: 0.0, atol: if atol.is_finite() { atol } else { 0.0 } };
    AdamWStep { p: p1, m: m1, v: v1, tol_p: tol(e_p), tol_m: tol(e_m), tol_v: tol(e_v) }
}

// --- the row operations --------------------------------------------------------------------

/// Softmax (`log`: log-softmax) of one row.
pub fn softmax_ref(x: &[f32], log: bool) -> Vec<f64> {
    let m = x.iter().map(|&v| v as f64).fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
    x.iter().map(|&v| if log { v as f64 - m - s.ln() } else { (v as f64 - m).exp() / s }).collect()
}

/// The gradient of the input of one row of softmax (`log`: log-softmax), from its output `y`
/// and the output's gradient `g`.
pub fn softmax_bwd_ref(y: &[f32], g: &[f32], log: bool) -> Vec<f64> {
    if log {
        let sg: f64 = g.iter().map(|&v| v as f64).sum();
        y.iter().zip(g).map(|(&y, &g)| g as f64 - (y as f64).exp() * sg).collect()
    } else {
        let dot: f64 = y.iter().zip(g).map(|(&y, &g)| y as f64 * g as f64).sum();
        y.iter().zip(g).map(|(&y, &g)| y as f64 * (g as f64 - dot)).collect()
    }
}

/// `(y, mean, rstd)` of one row.
pub fn norm_ref(x: &[f64], w: Option<&[f64]>, b: Option<&[f64]>, eps: f64, layer: bool) -> (Vec<f64>, f64, f64) {
    let n = x.len() as f64;
    let mean = if layer { x.iter().sum::<f64>() / n } else { 0.0 };
    let var = x.iter().map(|&v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let rstd = 1.0 / (var + eps).sqrt();
    let y = (0..x.len()).map(|i| (x[i] - mean) * rstd * w.map_or(1.0, |w| w[i]) + b.map_or(0.0, |b| b[i])).collect();
    (y, mean, rstd)
}

/// Gradient of the input of one row of a norm.
pub fn norm_bwd_ref(x: &[f64], w: Option<&[f64]>, g: &[f64], eps: f64, layer: bool) -> Vec<f64> {
    let (_, mean, rstd) = norm_ref(x, None, None, eps, layer);
    let n = x.len() as f64;
    let gw: Vec<f64> = (0..x.len()).map(|i| g[i] * w.map_or(1.0, |w| w[i])).collect();
    let xh: Vec<f64> = x.iter().map(|&v| (v - mean) * rstd).collect();
    let a = if layer { gw.iter().sum::<f64>() / n } else { 0.0 };
    let bsum = gw.iter().zip(&xh).map(|(g, x)| g * x).sum::<f64>() / n;
    (0..x.len()).map(|i| rstd * (gw[i] - a - xh[i] * bsum)).collect()
}

// --- matrix products on the tensor cores (bf16, f16) -----------------------------------------

/// `(sum_k a(k) b(k), sum_k |a(k) b(k)|)` in f64: the exact dot product of bf16 or f16 values
/// (their products and sums of a few thousand are exact in f64 to far below f32's rounding), and
/// the scale its error bound is relative to.
pub fn dot_ref(k: usize, a: impl Fn(usize) -> f64, b: impl Fn(usize) -> f64) -> (f64, f64) {
    (0..k).fold((0.0, 0.0), |(s, abs), kk| {
        let p = a(kk) * b(kk);
        (s + p, abs + p.abs())
    })
}

/// The error bound of a tensor-core GEMM's f32 value before the activation (and before the
/// rounding to the output dtype), as a multiple of `2^-23 * scale`, where `scale = |alpha| S +
/// |beta C| + |bias| + |row bias|` and `S = sum_k |a_k b_k|`.
///
/// Derivation (kernels-gpu/src/gemm_tc.rs runs `mma.m16n8k16`):
/// - Products of two bf16 (8-bit significands) or two f16 (11-bit) are exact in f32 (16 and 22
///   bits), and the tensor core forms them exactly.
/// - One `mma` adds 16 products to the f32 accumulator `c`. The tensor cores align the 17
///   addends to the largest, keep 24 bits and truncate (no rounding to nearest, no guard bits;
///   Fasi et al., "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021): each addend
///   loses less than one unit of the 24th bit of the largest, `2^-23 M`, and the normalised sum
///   loses one more, so one step is off by at most `18 * 2^-23 * (|c| + sum |p|)`.
/// - K is covered in `ceil(K / 16)` such steps into one accumulator (per slice under split-K);
///   `|c| + sum |p|` never exceeds `S` (to first order), so the sum is off by at most
///   `18 ceil(K / 16) 2^-23 S` (for K = 4096 about `2^-12.8 S`: the classical `gamma_K` bound of
///   recursive f32 summation, `K 2^-24 S`, with the truncation's factor of 2 and the 17 terms a
///   step's factor of 18/16).
/// - `s` split-K slices are added in f32 with rounding to nearest: `s * 2^-24 S` at most, and
///   the epilogue's `alpha *`, `beta * C +`, `+ bias` (the two biases summed first) a rounding
///   each: 4 more half-units, `+ 4` covers them and the second-order terms.
///
/// The activation's own error and the final rounding to the output dtype come on top
/// (`act_fwd_tol` and one ulp of the dtype in the tests' `close`).
pub fn tc_bound_terms(k: usize, splits: usize) -> f64 {
    18.0 * k.div_ceil(16) as f64 + splits as f64 + 4.0
}
