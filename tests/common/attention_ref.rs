//! Attention in bf16 and f16: an f64 reference of one query row over the rounded inputs, and the
//! error bound of the kernel's output and log-sum-exp, derived from the roundings on its path
//! (kernels-gpu/src/attention.rs). Pure: shared by the GPU tests (tests/attention.rs) and the CPU
//! test of the bound itself (tests/cpu.rs), which runs an f32 emulation of the kernel's path
//! through it and checks that it rejects wrong computations.
//!
//! # Derivation
//! Notation, for one query row and the keys `j` it sees: `s_j = q . k_j` (exact), `S_j = sum_d
//! |q_d k_jd|`, `x_j = scale s_j`, `m = max_j x_j`, `p_j = exp(x_j - m)`, `l = sum_j p_j`, `o =
//! sum_j p_j v_j / l`, `lse = m + ln l`; `A_d = sum_j p_j |v_jd| / l` (so `|o_d| <= A_d`);
//! `u = 2^-23`; `nb = ceil(Sk / 32)` bounds the key blocks the kernel walks (64 or 32 keys).
//!
//! Errors that perturb a weight `p_j` by a relative `delta_j` in both the numerator and the
//! denominator of `o` (they are applied before `l` and `o` part ways):
//! - the score, an f32 sum on the tensor cores: `|scale| tc_bound_terms(D, 1) u S_j`
//!   (tests/common/reference.rs; one exponent error `e` is a relative `e` of `p_j` to first
//!   order);
//! - `scale log2(e)` rounded to f32, `x_j` rounded in log2 units, `x_j - m` rounded: `ln 2 *
//!   2^-24 (3 X_j + M)` with `X_j = |x_j| log2(e)`, `M = |m| log2(e)`;
//! - `ex2.approx`: 2 ulp, `2^-22`;
//! - each rescale by `2^(m_old - m_new)` (at most `nb`): `2^-22 + ln 2 * 2^-23 Xmax`, applied
//!   to earlier keys only.
//!
//! A relative perturbation `delta_j` of each weight moves `o_d` by at most `sum_j p_j delta_j
//! (|v_jd| + |o_d|) / (l (1 - max delta))`.
//!
//! Errors of the numerator alone:
//! - P rounded to the dtype before `P V` (as FlashAttention; `l` sums the unrounded f32
//!   weights): `u_d A_d`, `u_d` the unit roundoff (2^-8 bf16, 2^-11 f16), and below the normal
//!   range half the smallest denormal (`2^-25` for f16) per key, plus the flush to zero of
//!   `ex2.approx.ftz` below 2^-126: `(tiny_d + 2^-126) sum_j |v_jd| / l`;
//! - the f32 accumulation of `P V` on the tensor cores, at most `4 ceil(Sk / 64)` steps of 16
//!   keys: `18 * 4 ceil(Sk / 64) u` of `A_d`, and the rescales' roundings, `nb 2^-24`.
//!
//! Errors of the denominator and the end: `l`, an f32 sum of positive terms in at most `20
//! ceil(Sk / 64) + 2` operations a row (a thread's share of each block, the rescale, two
//! shuffles): relative `(20 ceil(Sk / 64) + 2) 2^-24`; `1/l` and the product, `3 * 2^-24`; both
//! of `|o_d|`. The output's rounding to the dtype is the comparison's own ulp (`close`).
//!
//! Second-order terms (products of the relative errors above, all below 2^-7) are covered by a
//! factor `1 + 2^-6` on the sum.
//!
//! The log-sum-exp: score errors move it by at most their maximum, `max_j |scale|
//! tc_bound_terms(D, 1) u S_j` (it is 1-Lipschitz in the scores); the other per-weight errors by
//! `sum_j p_j delta'_j / l` (`delta'` without the score term); `l`'s sum as above; the rounding
//! of the running maximum cancels (it scales `l` by the inverse), and the final `m ln 2 + ln l`
//! (the constant, the product, `math::log`'s 0.82 ulp, the sum) by `2^-22 (2 |m| + |ln l| +
//! |lse|)`.
//!
//! Semantics, as documented by `ops::attention`: a row that sees no key, or whose every score
//! is `-inf`, gives zeros and `lse = -inf`; otherwise the naive formula in f64 (NaN and
//! infinities propagate as IEEE arithmetic has them).

use super::reference::{U, tc_bound_terms};
use kernels::DType;

/// One query row's exact output and log-sum-exp with their bounds (module notes). The bounds
/// are 0 where the value is not finite: there the value itself must match.
#[derive(Clone, Debug)]
pub struct RowRef {
    pub o: Vec<f64>,
    pub o_tol: Vec<f64>,
    pub lse: f64,
    pub lse_tol: f64,
}

/// The dtype's unit roundoff and half its smallest denormal.
pub fn unit(dt: DType) -> (f64, f64) {
    match dt {
        DType::BF16 => (2f64.powi(-8), 2f64.powi(-134)),
        DType::F16 => (2f64.powi(-11), 2f64.powi(-25)),
        DType::F32 => (2f64.powi(-24), 2f64.powi(-150)),
    }
}

/// The scale the kernel uses: the given one, or `1 / sqrt(D)` in f32.
pub fn scale_of(scale: Option<f32>, d: usize) -> f32 {
    scale.unwrap_or(1.0 / (d as f32).sqrt())
}

/// NaN if either is, else the larger.
fn max_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) }
}

/// The reference of one query row `q` (D values) over the keys it sees, `(k_j, v_j)` (D values
/// each), in a problem of `seq_k` keys and dtype `dt`.
pub fn row_ref(dt: DType, scale: f32, q: &[f32], keys: &[(&[f32], &[f32])], seq_k: usize) -> RowRef {
    let d = q.len();
    let zeros = RowRef { o: vec![0.0; d], o_tol: vec![0.0; d], lse: f64::NEG_INFINITY, lse_tol: 0.0 };
    if keys.is_empty() {
        return zeros;
    }
    let sc = scale as f64;
    let (s, sabs): (Vec<f64>, Vec<f64>) = keys
        .iter()
        .map(|(k, _)| {
            q.iter().zip(k.iter()).fold((0.0, 0.0), |(s, a), (&x, &y)| {
                let p = x as f64 * y as f64;
                (s + p, a + p.abs())
            })
        })
        .unzip();
    let x: Vec<f64> = s.iter().map(|&s| sc * s).collect();
    let m = x.iter().fold(f64::NEG_INFINITY, |a, &b| max_nan(a, b));
    if m == f64::NEG_INFINITY {
        return zeros;
    }
    let p: Vec<f64> = x.iter().map(|&x| (x - m).exp()).collect();
    let l: f64 = p.iter().sum();
    let o: Vec<f64> =
        (0..d).map(|c| keys.iter().zip(&p).map(|((_, v), &p)| p * v[c] as f64).sum::<f64>() / l).collect();
    let lse = m + l.ln();
    if !(m.is_finite() && l.is_finite()) {
        return RowRef { o_tol: vec![0.0; d], lse_tol: 0.0, o, lse };
    }

    let (ln2, log2e) = (std::f64::consts::LN_2, std::f64::consts::LOG2_E);
    let (u_d, tiny_d) = unit(dt);
    let cd = tc_bound_terms(d, 1);
    let nb = seq_k.div_ceil(32) as f64;
    let blocks64 = seq_k.div_ceil(64) as f64;
    let mm = m.abs() * log2e;
    let xmax = x.iter().filter(|x| x.is_finite()).fold(0.0f64, |a, &x| a.max(x.abs() * log2e));
    // Per-weight relative errors: the score's, and the rest (delta').
    let score_err: Vec<f64> = sabs.iter().map(|&a| sc.abs() * cd * U * a).collect();
    let other_err: Vec<f64> = x
        .iter()
        .map(|&x| {
            ln2 * 2f64.powi(-24) * (3.0 * x.abs() * log2e + mm)
                + 2f64.powi(-22)
                + nb * (2f64.powi(-22) + ln2 * 2f64.powi(-23) * xmax)
        })
        .collect();
    // Weights that are 0 (a score of -inf) carry no error (and their S_j may be infinite).
    let live: Vec<usize> = (0..keys.len()).filter(|&j| p[j] > 0.0).collect();
    let delta = |j: usize| score_err[j] + other_err[j];
    let dmax = live.iter().fold(0.0f64, |a, &j| a.max(delta(j)));
    let pv = 18.0 * 4.0 * blocks64 * U + nb * 2f64.powi(-24);
    let eps_l = (20.0 * blocks64 + 2.0) * 2f64.powi(-24);
    let second = 1.0 + 2f64.powi(-6);
    let o_tol = (0..d)
        .map(|c| {
            if !o[c].is_finite() {
                return 0.0;
            }
            let vabs = |j: usize| (keys[j].1[c] as f64).abs();
            let common = live.iter().map(|&j| p[j] * delta(j) * (vabs(j) + o[c].abs())).sum::<f64>() / l / (1.0 - dmax);
            let a = live.iter().map(|&j| p[j] * vabs(j)).sum::<f64>() / l;
            let all = (0..keys.len()).map(vabs).sum::<f64>() / l;
            second
                * (common
                    + (u_d + pv) * a * (1.0 + dmax)
                    + (tiny_d + 2f64.powi(-126)) * all
                    + (eps_l + 3.0 * 2f64.powi(-24)) * o[c].abs())
        })
        .collect();
    let max_score = live.iter().fold(0.0f64, |a, &j| a.max(score_err[j]));
    let weighted = live.iter().map(|&j| p[j] * other_err[j]).sum::<f64>() / l;
    let lse_tol = second * (max_score + weighted + eps_l + 2f64.powi(-22) * (2.0 * m.abs() + l.ln().abs() + lse.abs()));
    RowRef { o, o_tol, lse, lse_tol }
}
