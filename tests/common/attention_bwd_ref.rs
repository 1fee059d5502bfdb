//! Attention backward in bf16 and f16: the f64 reference gradients of one (batch, key/value head)
//! problem over the rounded inputs, and the error bound of each gradient element, derived from
//! the roundings on the kernels' path (`ops::attention_backward`). Pure: shared by the GPU tests
//! (tests/attention.rs) and the CPU tests of the reference and of the bound (tests/cpu.rs: the
//! reference against finite differences of the f64 forward; an f32 emulation of the kernels'
//! path admitted, wrong computations rejected).
//!
//! # The exact gradients
//! For a query row `i` (of any of the `group` query heads sharing the key/value head) and a key
//! `j` it sees, with `c` the scale (the f32 value the kernels use): `s_ij = q_i . k_j`, `p_ij =
//! exp(c s_ij - lse_i)` (the exact `lse`), `o_i = sum_j p_ij v_j`, `delta_i = dO_i . o_i`, `dp_ij
//! = dO_i . v_j`, `g_ij = dp_ij - delta_i`, `ds_ij = p_ij g_ij`; then `dv_j = sum_i p_ij dO_i`,
//! `dk_j = c sum_i ds_ij q_i`, `dq_i = c sum_j ds_ij k_j`, every sum over the seen pairs only (a
//! row that sees no key, and a key no row sees, have zero gradients).
//!
//! # Derivation of the bound
//! Notation: `u = 2^-24` (f32 rounding), `U = 2^-23`; `u_d` the dtype's unit roundoff (2^-8
//! bf16, 2^-11 f16) and `tiny_d` half its smallest denormal (storing an f32 `x` moves it by at
//! most `u_d |x| + tiny_d`); `T(D) = tc_bound_terms(D, 1) U` the tensor-core dot product's
//! relative bound (tests/common/reference.rs); `S_ij = sum_d |q_id k_jd|`, `DP_ij = sum_d |dO_id
//! v_jd|`. Error terms are first order; the products of relative errors they leave out (all below
//! 2^-7) are covered by a factor `1 + 2^-6` on each final bound, as in the forward's derivation.
//!
//! The forward's output enters through [`FwdErr`]: `eo_i`, a bound of `|dO_i . (O_i - o_i)|`
//! with `O` the stored output, `ao_i`, a bound of `sum_d |dO_id O_id|`, and `el_i`, a bound of
//! `|LSE_i - lse_i|`. From the forward's bounds (`RowRef`'s `o_tol`, `lse_tol`, plus what the
//! forward's comparison admits on top: an ulp of the dtype and of f32): `eo_i = sum_d |dO_id|
//! e_id`, `e_id = o_tol_id + ulp_d(o_id) + 2^-126`; or, given the output the forward returned,
//! its measured error (exact in f64, hence as worst case as the bound it meets).
//!
//! 1. `delta_i`: each of 32 lanes sums at most `ceil(D / 32)` products (exact in f32) by fma,
//!    then a tree of 5 shuffle-adds: every product passes at most `ceil(D / 32) + 5` roundings,
//!    so `ed_i = eo_i + (ceil(D / 32) + 5) u ao_i`.
//! 2. The exponent of `P_ij = ex2(fl(fl(S sl2) - fl(LSE log2e)))`, compared with `(c s_ij -
//!    lse_i) log2(e)` and taken back to natural units (times ln 2): the score's sum, `|c| T(D)
//!    S_ij`; `sl2 = fl(c log2(e))` (the constant and the product) and `fl(S sl2)`, `3 u |x_ij|`
//!    (`x_ij = c s_ij`); `lse2 = fl(LSE log2(e))` (the constant and the product) and the
//!    forward's error, `2 u |lse_i| + el_i`; the subtraction, `u |x_ij - lse_i|`. With `eta_ij`
//!    their sum, and `ex2.approx`'s 2 ulp, `P = p (1 + r)` with `|r| <= rho_ij = expm1(eta_ij)
//!    (1 + 2^-22) + 2^-22` (the relative error of the forward's lse, `exp(el) - 1`, enters here),
//!    and the flush to zero of results below 2^-126: `|P - p| <= ep = rho p + 2^-126`.
//! 3. `dP_ij` on the tensor cores: `T(D) DP_ij`. With `delta`, and the f32 subtraction: `|G - g|
//!    <= eg = T(D) DP + ed + u (|g| + T(D) DP + ed)`.
//! 4. `dS = fl(P G)`: `eds = ep (|g| + eg) + p eg + u (p + ep) (|g| + eg)`; rounded to the dtype
//!    before the tensor cores: `eds~ = eds + u_d (|ds| + eds) + tiny_d`. `P` rounded to the dtype
//!    for dV: `ep~ = ep + u_d (p + ep) + tiny_d`.
//! 5. `dV_j = sum_i P~_ij dO_i`: the inputs' errors `sum_i ep~_ij |dO_id|`, and the f32
//!    accumulation on the tensor cores in `n_kv = group ceil(Sq / 16)` steps of 16 queries (a
//!    step of 16 exact zeros, for rows past `Sq`, leaves the accumulator as it is), `18 n_kv U`
//!    of `A_jd = sum_i (p + ep~) |dO_id|` (the per-step bound of `tc_bound_terms`).
//! 6. `dK_j = c sum_i dS~_ij q_i`: `|c| (sum_i eds~_ij |q_id| + (18 n_kv U + u) A_jd)`, `A_jd =
//!    sum_i (|ds| + eds~) |q_id|`, the `u` for the product by `c`.
//! 7. `dQ_i = c sum_j dS~_ij k_j`: the same over keys, `n_q = ceil(Sk / 16)` steps.
//!
//! The rounding of each gradient to the dtype on store is the comparison's own ulp (`close`).
//! The bound is a sum of absolute values: a worst case over the signs of every rounding, not a
//! fit to observed errors.

use super::attention_ref::unit;
use super::reference::{U, tc_bound_terms};
use kernels::DType;

/// One (batch, key/value head) problem, in f64: the `group` query heads that share the key/value
/// head, row `r = g * seq_q + i` of q and dout being row `i` of head `g` of the group.
#[derive(Clone, Copy)]
pub struct Problem<'a> {
    pub group: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub d: usize,
    /// The scale as the kernels use it (an f32 value).
    pub scale: f64,
    /// The keys query row `i` sees, `first..end` (every mask is a band); `seq_q` entries.
    pub keys: &'a [(usize, usize)],
    /// `[group][seq_q][d]`.
    pub q: &'a [f64],
    /// `[seq_k][d]`.
    pub k: &'a [f64],
    /// `[seq_k][d]`.
    pub v: &'a [f64],
    /// `[group][seq_q][d]`.
    pub dout: &'a [f64],
}

impl Problem<'_> {
    fn rows(&self) -> usize {
        self.group * self.seq_q
    }
    fn row<'b>(&self, x: &'b [f64], r: usize) -> &'b [f64] {
        &x[r * self.d..(r + 1) * self.d]
    }
    fn seen(&self, r: usize) -> std::ops::Range<usize> {
        let (first, end) = self.keys[r % self.seq_q];
        first..end.max(first)
    }
}

/// The keys each of `seq_q` query rows sees under the rule `sees(i, j)`, as `first..end`
/// (panics if some row's keys are not contiguous: every mask of `AttentionOpts` is a band).
pub fn key_ranges(seq_q: usize, seq_k: usize, sees: impl Fn(usize, usize) -> bool) -> Vec<(usize, usize)> {
    (0..seq_q)
        .map(|i| {
            let first = (0..seq_k).find(|&j| sees(i, j)).unwrap_or(seq_k);
            let end = (first..seq_k).find(|&j| !sees(i, j)).unwrap_or(seq_k);
            assert!((end..seq_k).all(|j| !sees(i, j)), "row {i}: its keys are not one band");
            (first, end)
        })
        .collect()
}

/// `f(0), ..., f(n - 1)` on the machine's threads (interleaved, so that the rows of a causal
/// mask, of growing cost, spread evenly).
pub fn par_map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(n).max(1);
    let parts: Vec<Vec<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let f = &f;
                s.spawn(move || (t..n).step_by(threads).map(f).collect::<Vec<T>>())
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a reference thread panicked")).collect()
    });
    let mut its: Vec<_> = parts.into_iter().map(|p| p.into_iter()).collect();
    (0..n).map(|i| its[i % threads].next().expect("each thread computed its share")).collect()
}

/// NaN if either is, else the larger.
fn max_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) }
}

/// `(sum a_d b_d, sum |a_d b_d|)`.
fn dot(a: &[f64], b: &[f64]) -> (f64, f64) {
    a.iter().zip(b).fold((0.0, 0.0), |(s, m), (&x, &y)| (s + x * y, m + (x * y).abs()))
}

/// The exact forward of every row `r` of a problem: `o` (`[group][seq_q][d]`) and `lse`; a row
/// that sees no key has zeros and `-inf`.
#[derive(Clone, Debug)]
pub struct Forward {
    pub o: Vec<f64>,
    pub lse: Vec<f64>,
}

pub fn forward(p: &Problem) -> Forward {
    let c = p.scale;
    let rows = par_map(p.rows(), |r| {
        let q = p.row(p.q, r);
        let x: Vec<f64> = p.seen(r).map(|j| c * dot(q, p.row(p.k, j)).0).collect();
        let m = x.iter().fold(f64::NEG_INFINITY, |a, &b| max_nan(a, b));
        if x.is_empty() || m == f64::NEG_INFINITY {
            return (vec![0.0; p.d], f64::NEG_INFINITY);
        }
        let w: Vec<f64> = x.iter().map(|&x| (x - m).exp()).collect();
        let l: f64 = w.iter().sum();
        let mut o = vec![0.0; p.d];
        for (j, &w) in p.seen(r).zip(&w) {
            for (o, &v) in o.iter_mut().zip(p.row(p.v, j)) {
                *o += w * v;
            }
        }
        o.iter_mut().for_each(|o| *o /= l);
        (o, m + l.ln())
    });
    let (o, lse): (Vec<Vec<f64>>, Vec<f64>) = rows.into_iter().unzip();
    Forward { o: o.concat(), lse }
}

/// `sum_r dout_r . o_r`: the loss whose gradients [`backward`] gives.
pub fn loss(p: &Problem, f: &Forward) -> f64 {
    (0..p.rows()).map(|r| dot(p.row(p.dout, r), p.row(&f.o, r)).0).sum()
}

/// Bounds of what the forward's stored output brings into the backward, per row (module notes).
#[derive(Clone, Debug)]
pub struct FwdErr {
    /// A bound of `|dO_r . (O_r - o_r)|`.
    pub delta: Vec<f64>,
    /// A bound of `sum_d |dO_rd O_rd|`.
    pub delta_abs: Vec<f64>,
    /// A bound of `|LSE_r - lse_r|`.
    pub lse: Vec<f64>,
}

/// One ulp of `dt` at `r` (the spacing of the denormals below the normal range).
pub fn ulp(dt: DType, r: f64) -> f64 {
    let (mant, min_exp) = match dt {
        DType::F32 => (23, -126),
        DType::F16 => (10, -14),
        DType::BF16 => (7, -126),
    };
    let e = if r == 0.0 || !r.is_finite() { min_exp } else { (r.abs().log2().floor() as i32).max(min_exp) };
    2f64.powi(e - mant)
}

impl FwdErr {
    /// No error: the exact forward (for the finite differences, where only the gradients count).
    pub fn exact(p: &Problem, f: &Forward) -> FwdErr {
        let delta_abs = (0..p.rows()).map(|r| dot(p.row(p.dout, r), p.row(&f.o, r)).1).collect();
        FwdErr { delta: vec![0.0; p.rows()], delta_abs, lse: vec![0.0; p.rows()] }
    }

    /// The measured error of the output the forward returned: `o` as `Forward::o`, `lse` per row.
    pub fn measured(p: &Problem, f: &Forward, o: &[f64], lse: &[f64]) -> FwdErr {
        let rows = 0..p.rows();
        let diff = |r: usize| -> Vec<f64> { p.row(o, r).iter().zip(p.row(&f.o, r)).map(|(a, b)| a - b).collect() };
        let lse_err = |r: usize| if lse[r] == f.lse[r] { 0.0 } else { (lse[r] - f.lse[r]).abs() };
        FwdErr {
            delta: rows.clone().map(|r| dot(p.row(p.dout, r), &diff(r)).0.abs()).collect(),
            delta_abs: rows.clone().map(|r| dot(p.row(p.dout, r), p.row(o, r)).1).collect(),
            lse: rows.map(lse_err).collect(),
        }
    }

    /// From the forward's bounds (`RowRef::o_tol` as `Forward::o`, `lse_tol` per row) and what
    /// its comparison admits on top (one ulp of the dtype for `O`, of f32 for `lse`).
    pub fn bounded(dt: DType, p: &Problem, f: &Forward, o_tol: &[f64], lse_tol: &[f64]) -> FwdErr {
        let e = |r: usize, c: usize| o_tol[r * p.d + c] + ulp(dt, f.o[r * p.d + c]) + 2f64.powi(-126);
        let dout = |r: usize, c: usize| p.dout[r * p.d + c].abs();
        let rows = 0..p.rows();
        FwdErr {
            delta: rows.clone().map(|r| (0..p.d).map(|c| dout(r, c) * e(r, c)).sum()).collect(),
            delta_abs: rows
                .clone()
                .map(|r| (0..p.d).map(|c| dout(r, c) * (f.o[r * p.d + c].abs() + e(r, c))).sum())
                .collect(),
            lse: rows.map(|r| lse_tol[r] + ulp(DType::F32, f.lse[r]) + 2f64.powi(-126)).collect(),
        }
    }
}

/// The reference gradients of a problem and their bounds (0 where the value is not finite: there
/// the value itself must match). `dq`, `dq_tol`: `[group][seq_q][d]`; the others `[seq_k][d]`.
/// `row_sees[i]`: whether query row `i` sees a key; `key_seen[j]`: whether a row sees key `j`.
/// Where not, the gradient is exactly zero.
#[derive(Clone, Debug)]
pub struct Grads {
    pub dq: Vec<f64>,
    pub dq_tol: Vec<f64>,
    pub dk: Vec<f64>,
    pub dk_tol: Vec<f64>,
    pub dv: Vec<f64>,
    pub dv_tol: Vec<f64>,
    pub row_sees: Vec<bool>,
    pub key_seen: Vec<bool>,
}

/// What one seen pair `(r, j)` contributes: `p`, its bound once rounded to the dtype, `ds`, its
/// bound once rounded.
struct Pair {
    p: f64,
    ep: f64,
    ds: f64,
    eds: f64,
}

/// Per row: `lse`, its error, `delta`, its error.
#[derive(Clone, Copy)]
struct RowIn {
    lse: f64,
    el: f64,
    delta: f64,
    ed: f64,
}

/// The exact gradients of `p` (whose exact forward is `f`) and their bounds for the kernels in
/// `dt`, given the forward's errors `e` (module notes).
pub fn backward(dt: DType, p: &Problem, f: &Forward, e: &FwdErr) -> Grads {
    let (u_d, tiny_d) = unit(dt);
    let (u, d) = (2f64.powi(-24), p.d);
    let c = p.scale;
    let td = tc_bound_terms(d, 1) * U;
    let rows_in: Vec<RowIn> = (0..p.rows())
        .map(|r| RowIn {
            lse: f.lse[r],
            el: e.lse[r],
            delta: dot(p.row(p.dout, r), p.row(&f.o, r)).0,
            ed: e.delta[r] + (d.div_ceil(32) + 5) as f64 * u * e.delta_abs[r],
        })
        .collect();
    let pair = |r: usize, j: usize| -> Pair {
        let RowIn { lse, el, delta, ed } = rows_in[r];
        if lse == f64::NEG_INFINITY {
            // Every score -inf: weights of 0 (the kernels' lse2 = +inf).
            return Pair { p: 0.0, ep: 0.0, ds: 0.0, eds: 0.0 };
        }
        let (s, sabs) = dot(p.row(p.q, r), p.row(p.k, j));
        let (dp, dpabs) = dot(p.row(p.dout, r), p.row(p.v, j));
        let x = c * s;
        let pv = (x - lse).exp();
        let eta = c.abs() * td * sabs + el + u * (3.0 * x.abs() + 2.0 * lse.abs() + (x - lse).abs());
        let rho = eta.exp_m1() * (1.0 + 2f64.powi(-22)) + 2f64.powi(-22);
        let ep = rho * pv + 2f64.powi(-126);
        let g = dp - delta;
        let eg = td * dpabs + ed + u * (g.abs() + td * dpabs + ed);
        let ds = pv * g;
        let eds = ep * (g.abs() + eg) + pv * eg + u * (pv + ep) * (g.abs() + eg);
        Pair { p: pv, ep: ep + u_d * (pv + ep) + tiny_d, ds, eds: eds + u_d * (ds.abs() + eds) + tiny_d }
    };
    let second = 1.0 + 2f64.powi(-6);
    let fin = |x: f64, tol: f64| if x.is_finite() { tol } else { 0.0 };

    // dq, a row at a time: its keys in steps of 16.
    let n_q = p.seq_k.div_ceil(16) as f64;
    let dq_rows = par_map(p.rows(), |r| {
        let (mut sum, mut err, mut abs) = (vec![0.0; d], vec![0.0; d], vec![0.0; d]);
        for j in p.seen(r) {
            let pr = pair(r, j);
            for (x, &k) in p.row(p.k, j).iter().enumerate() {
                sum[x] += pr.ds * k;
                err[x] += pr.eds * k.abs();
                abs[x] += (pr.ds.abs() + pr.eds) * k.abs();
            }
        }
        (0..d)
            .map(|x| {
                let v = c * sum[x];
                (v, fin(v, second * c.abs() * (err[x] + (18.0 * n_q * U + u) * abs[x])))
            })
            .collect::<Vec<_>>()
    });

    // dk and dv, a key at a time: every row of every head of the group that sees it.
    let n_kv = (p.group * p.seq_q.div_ceil(16)) as f64;
    let key_cols = par_map(p.seq_k, |j| {
        let mut acc = vec![[0.0f64; 6]; d];
        let mut seen = false;
        for r in (0..p.rows()).filter(|&r| p.seen(r).contains(&j)) {
            seen = true;
            let pr = pair(r, j);
            for (x, (&q, &g)) in p.row(p.q, r).iter().zip(p.row(p.dout, r)).enumerate() {
                let a = &mut acc[x];
                a[0] += pr.ds * q;
                a[1] += pr.eds * q.abs();
                a[2] += (pr.ds.abs() + pr.eds) * q.abs();
                a[3] += pr.p * g;
                a[4] += pr.ep * g.abs();
                a[5] += (pr.p + pr.ep) * g.abs();
            }
        }
        let cols: Vec<[f64; 4]> = acc
            .iter()
            .map(|a| {
                let (dk, dv) = (c * a[0], a[3]);
                let dk_tol = second * c.abs() * (a[1] + (18.0 * n_kv * U + u) * a[2]);
                let dv_tol = second * (a[4] + 18.0 * n_kv * U * a[5]);
                [dk, fin(dk, dk_tol), dv, fin(dv, dv_tol)]
            })
            .collect();
        (cols, seen)
    });

    let dq_flat: Vec<(f64, f64)> = dq_rows.into_iter().flatten().collect();
    let (dq, dq_tol) = dq_flat.into_iter().unzip();
    let mut g = Grads {
        dq,
        dq_tol,
        dk: Vec::with_capacity(p.seq_k * d),
        dk_tol: Vec::with_capacity(p.seq_k * d),
        dv: Vec::with_capacity(p.seq_k * d),
        dv_tol: Vec::with_capacity(p.seq_k * d),
        row_sees: p.keys.iter().map(|&(a, b)| b > a).collect(),
        key_seen: Vec::with_capacity(p.seq_k),
    };
    for (cols, seen) in key_cols {
        for [dk, dk_tol, dv, dv_tol] in cols {
            g.dk.push(dk);
            g.dk_tol.push(dk_tol);
            g.dv.push(dv);
            g.dv_tol.push(dv_tol);
        }
        g.key_seen.push(seen);
    }
    g
}
