//! The linear layer in bf16 and f16: an f64 reference of the rounded inputs, and each output's
//! error bound, derived from the roundings on the layer's path (host/ops/linear.rs). Pure: shared
//! by the GPU tests (tests/linear_tc.rs) and the CPU test of the bounds themselves (tests/cpu.rs).
//!
//! # Derivation
//! Write `u_d` for the dtype's unit roundoff (2^-8 bf16, 2^-11 f16) and `tiny_d` for half its
//! smallest denormal: storing an f32 value `v` in the dtype moves it by at most `u_d |v| +
//! tiny_d`. A value known to `e` before the rounding is known to `e + u_d (|exact| + e) + tiny_d`
//! after it ([`stored`]).
//! - `z = x @ W^T + b`: the tensor-core GEMM's f32 value errs by at most `Tz = tc_bound_terms(in,
//!   s) 2^-23 S`, `S = sum |x w| + |b|` (tests/common/reference.rs; `s <= in / 256` slices).
//! - Fused forward (`linear` with a fusable activation, `linear_train` with identity or relu):
//!   the activation runs on the f32 value, `lip * Tz + act_tol`, then one rounding. `lip` = 1.2
//!   bounds |act'| (GELU 1.13, SiLU 1.1, Mish 1.09).
//! - Stored forward (`linear_train` with GELU, GELU-tanh, SiLU; Mish on both paths): `z` is
//!   stored (`ez = stored(Tz)`), the activation runs on it: `lip * ez + act_tol`, one rounding.
//! - `dz = act'(z) dy`: identity passes dy; relu reads the sign of y, which flips only where
//!   `|z| <= Tz + tiny_d` (then all of |dy|); the others read the stored z: `0.8 |dy| ez +
//!   act_bwd_tol`, one rounding (0.8 bounds |act''| everywhere: GELU's and GELU-tanh's 0.80,
//!   Mish's 0.65, SiLU's 0.5, so it is a Lipschitz bound of act', not a linearisation).
//! - `dx = dz @ W`, `dW = dz^T @ x`: dz's errors pass through `|W|`, `|x|`, and the GEMM adds
//!   `tc_bound_terms(K, s) 2^-23 sum |dz| |.|` (K = out, rows), one rounding.
//! - `db`: an f32 column sum of depth at most `depth` (the library's
//!   `reduce_leading_dims_sum_depth`): `depth 2^-24 sum |dz|` plus dz's errors, one rounding.
//!
//! Every product and sum of the reference is of values with at most 11 significant bits, in f64:
//! exact to far below these bounds.

use super::reference::{U, act_bwd, act_bwd_tol, act_fwd, act_fwd_tol, tc_bound_terms};
use kernels::DType;
use kernels::ops::Activation;

/// The dtype's unit roundoff and half its smallest denormal.
pub fn unit(dt: DType) -> (f64, f64) {
    match dt {
        DType::BF16 => (2f64.powi(-8), 2f64.powi(-134)),
        DType::F16 => (2f64.powi(-11), 2f64.powi(-25)),
        DType::F32 => (2f64.powi(-24), 2f64.powi(-150)),
    }
}

/// The bound on a value of exact magnitude `exact` known to `e` in f32, after it is stored in `dt`.
pub fn stored(dt: DType, exact: f64, e: f64) -> f64 {
    let (u, tiny) = unit(dt);
    e + u * (exact.abs() + e) + tiny
}

/// K slices of a tensor-core product at most: none shorter than 256.
pub fn splits(k: usize) -> usize {
    (k / 256).max(1)
}

/// Whether the GEMM applies `act` in its store.
pub fn fusable(act: Activation) -> bool {
    matches!(act, Activation::Identity | Activation::Relu | Activation::Gelu | Activation::GeluTanh | Activation::Silu)
}

/// The layer's inputs, as f32 values already rounded to the dtype; `x [rows, inp]`, `w [out,
/// inp]`, `b [out]`, `dy [rows, out]`.
pub struct Inputs<'a> {
    pub x: &'a [f32],
    pub w: &'a [f32],
    pub b: Option<&'a [f32]>,
    pub dy: &'a [f32],
    pub rows: usize,
    pub inp: usize,
    pub out: usize,
}

/// Exact values and their bounds (absolute, everything included).
pub struct Expect {
    pub want: Vec<f64>,
    pub tol: Vec<f64>,
}

/// What the layer must give.
pub struct LinearExpect {
    /// `linear`'s output.
    pub y_inference: Expect,
    /// `linear_train`'s output.
    pub y_train: Expect,
    pub dx: Expect,
    pub dw: Expect,
    pub db: Option<Expect>,
}

/// The reference and bounds of the module notes for dtype `dt`; `depth` bounds the depth of
/// the f32 column sum of db.
pub fn expect(dt: DType, p: &Inputs, act: Activation, depth: u64) -> LinearExpect {
    let (rows, inp, out) = (p.rows, p.inp, p.out);
    let (_, tiny) = unit(dt);
    let lip = 1.2;
    let n = rows * out;
    let (mut z, mut tz) = (vec![0.0; n], vec![0.0; n]);
    let zterms = tc_bound_terms(inp, splits(inp)) * U;
    for r in 0..rows {
        for o in 0..out {
            let bias = p.b.map_or(0.0, |b| b[o] as f64);
            let (mut s, mut a) = (bias, bias.abs());
            for i in 0..inp {
                let prod = p.x[r * inp + i] as f64 * p.w[o * inp + i] as f64;
                s += prod;
                a += prod.abs();
            }
            z[r * out + o] = s;
            tz[r * out + o] = zterms * a;
        }
    }
    let ez: Vec<f64> = z.iter().zip(&tz).map(|(&zz, &t)| stored(dt, zz, t)).collect();
    let y_from = |errs: &[f64]| {
        let want: Vec<f64> = z.iter().map(|&zz| act_fwd(act, zz)).collect();
        let tol = (0..n)
            .map(|i| {
                let t = act_fwd_tol(act, z[i]);
                let e = lip * errs[i] + t.rtol * want[i].abs() + t.atol;
                stored(dt, want[i], e)
            })
            .collect();
        Expect { want, tol }
    };
    let fused = y_from(&tz);
    let y_inference = if fusable(act) { fused } else { y_from(&ez) };
    let y_train = if matches!(act, Activation::Identity | Activation::Relu) { y_from(&tz) } else { y_from(&ez) };

    let (mut dz, mut edz) = (vec![0.0; n], vec![0.0; n]);
    for i in 0..n {
        let g = p.dy[i] as f64;
        dz[i] = act_bwd(act, z[i], g);
        edz[i] = match act {
            Activation::Identity => 0.0,
            Activation::Relu if z[i].abs() <= tz[i] + tiny => g.abs(),
            Activation::Relu => 0.0,
            _ => {
                let t = act_bwd_tol(act, z[i], g);
                stored(dt, dz[i], 0.8 * g.abs() * ez[i] + t.rtol * dz[i].abs() + t.atol)
            }
        };
    }
    let (xterms, wterms) = (tc_bound_terms(out, splits(out)) * U, tc_bound_terms(rows, splits(rows)) * U);
    let (mut dx, mut tdx) = (vec![0.0; rows * inp], vec![0.0; rows * inp]);
    let (mut dw, mut tdw) = (vec![0.0; out * inp], vec![0.0; out * inp]);
    let (mut db, mut tdb) = (vec![0.0; out], vec![0.0; out]);
    let sum_u = depth as f64 * U / 2.0;
    for r in 0..rows {
        for o in 0..out {
            let (d, e) = (dz[r * out + o], edz[r * out + o]);
            let da = d.abs() + e;
            db[o] += d;
            tdb[o] += e + sum_u * da;
            for i in 0..inp {
                let (w, x) = (p.w[o * inp + i] as f64, p.x[r * inp + i] as f64);
                dx[r * inp + i] += d * w;
                tdx[r * inp + i] += (e + xterms * da) * w.abs();
                dw[o * inp + i] += d * x;
                tdw[o * inp + i] += (e + wterms * da) * x.abs();
            }
        }
    }
    let finish = |want: Vec<f64>, tol: Vec<f64>| {
        let tol = want.iter().zip(tol).map(|(&v, t)| stored(dt, v, t)).collect();
        Expect { want, tol }
    };
    LinearExpect { y_inference, y_train, dx: finish(dx, tdx), dw: finish(dw, tdw), db: p.b.map(|_| finish(db, tdb)) }
}

/// Every value of `got` within its bound of the exact one (NaN, an unwritten element of a
/// poisoned output, fails); the largest error as a fraction of its bound otherwise.
pub fn check(what: &str, got: &[f32], e: &Expect) -> Result<f64, String> {
    if got.len() != e.want.len() {
        return Err(format!("{what}: {} values, expected {}", got.len(), e.want.len()));
    }
    let mut worst: f64 = 0.0;
    for (i, ((&g, &w), &t)) in got.iter().zip(&e.want).zip(&e.tol).enumerate() {
        let err = (g as f64 - w).abs();
        if err.is_nan() || err > t {
            return Err(format!("{what}[{i}] = {g}, expected {w}, bound {t:e}"));
        }
        if t > 0.0 {
            worst = worst.max(err / t);
        }
    }
    Ok(worst)
}
