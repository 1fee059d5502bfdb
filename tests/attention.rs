//! GPU tests of the attention forward (`ops::attention`, bf16 and f16) against an f64 reference
//! of the rounded inputs.
//!
//! # Tolerance
//! Derived in tests/common/attention_ref.rs, per output element: the score errors of the
//! tensor-core dot products (`tc_bound_terms(D) 2^-23 sum_d |q_d k_d|`, scaled), the rounding
//! and `ex2.approx` errors of each weight and of each rescale, all of which perturb a weight
//! `p_j` in the numerator and denominator alike (`sum_j p_j delta_j (|v_j| + |o|) / l`); P
//! rounded to the dtype before `P V` (`u_d sum_j p_j |v_j| / l`, `u_d` = 2^-8 for bf16 and 2^-11
//! for f16, the dominant term), the f32 accumulation of `P V` over at most `4 ceil(Sk / 64)`
//! tensor-core steps, the f32 sum `l` and the final division; then one ulp of the output dtype
//! (`close`). The log-sum-exp likewise. A worst-case bound, not a fitted one; tests/cpu.rs checks
//! that it admits an f32 emulation of the kernel's path and rejects wrong ones.
//!
//! The backward (`ops::attention_backward`) runs on the forward's own outputs, and its gradients
//! are compared element by element with the f64 reference gradients and the bound derived in
//! tests/common/attention_bwd_ref.rs, given the forward's measured error (the forward's own
//! tests hold that error to its bound): the score and `dout . v` dot products, `delta`'s f32
//! sum, the exponent's roundings and `ex2.approx`, P and dS rounded to the dtype (the dominant
//! terms), the tensor cores' f32 accumulations and the product by the scale; then one ulp of
//! the dtype (`close`). Rows that see no key and keys no row sees must give exact zeros.
//!
//! Outputs are poisoned (NaN) on allocation, so an element the kernel does not write fails.

mod common;

use common::attention_bwd_ref::{FwdErr, Grads, Problem, backward, forward, key_ranges};
use common::attention_ref::{RowRef, row_ref, scale_of};
use common::*;
use kernels::ops::{self, AttentionOpts, Causal, Layout};
use kernels::{DType, Device, Error, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

/// One attention problem and its data, each tensor in its layout's memory order.
#[derive(Clone, Debug)]
struct Case {
    dt: DType,
    layout: Layout,
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq_q: usize,
    seq_k: usize,
    d: usize,
    causal: Causal,
    window: Option<(usize, usize)>,
    scale: Option<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// The gradient of the forward's output, for the backward (q's shape).
    dout: Vec<f32>,
}

/// What the forward and then the backward returned, as f32.
struct BwdOut {
    o: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// `(batch, heads_q, heads_kv, seq_q, seq_k, d)`.
type Sizes = (usize, usize, usize, usize, usize, usize);

impl Case {
    fn new(seed: u64, dt: DType, layout: Layout, sizes: Sizes, causal: Causal) -> Case {
        let (batch, heads_q, heads_kv, seq_q, seq_k, d) = sizes;
        let mut rng = TestRng::new(seed);
        let mut draw = |n: usize| (0..n).map(|_| round_to(dt, rng.normal() as f32)).collect::<Vec<f32>>();
        let q = draw(batch * heads_q * seq_q * d);
        let k = draw(batch * heads_kv * seq_k * d);
        let v = draw(batch * heads_kv * seq_k * d);
        let dout = draw(batch * heads_q * seq_q * d);
        Case { dt, layout, batch, heads_q, heads_kv, seq_q, seq_k, d, causal, window: None, scale: None, q, k, v, dout }
    }

    fn shape(&self, heads: usize, seq: usize) -> Vec<usize> {
        match self.layout {
            Layout::Bhsd => vec![self.batch, heads, seq, self.d],
            Layout::Bshd => vec![self.batch, seq, heads, self.d],
        }
    }

    /// Offset of element 0 of row `s` of head `h` of batch `b` in a tensor of `heads` x `seq`.
    fn row_at(&self, heads: usize, seq: usize, b: usize, h: usize, s: usize) -> usize {
        let d = self.d;
        match self.layout {
            Layout::Bhsd => ((b * heads + h) * seq + s) * d,
            Layout::Bshd => ((b * seq + s) * heads + h) * d,
        }
    }

    fn q_row(&self, b: usize, h: usize, i: usize) -> &[f32] {
        let at = self.row_at(self.heads_q, self.seq_q, b, h, i);
        &self.q[at..at + self.d]
    }

    fn kv_row<'a>(&self, x: &'a [f32], b: usize, h: usize, j: usize) -> &'a [f32] {
        let at = self.row_at(self.heads_kv, self.seq_k, b, h, j);
        &x[at..at + self.d]
    }

    fn opts(&self) -> AttentionOpts {
        AttentionOpts { causal: self.causal, scale: self.scale, window: self.window, layout: self.layout }
    }

    /// Whether query `i` sees key `j`: the rule as `AttentionOpts` documents it.
    fn sees(&self, i: usize, j: usize) -> bool {
        let (i, j) = (i as i128, j as i128);
        let c = if self.causal == Causal::TopLeft { i } else { i + self.seq_k as i128 - self.seq_q as i128 };
        let causal_ok = self.causal == Causal::None || j <= c;
        let window_ok = self.window.is_none_or(|(l, r)| c - l as i128 <= j && j <= c + r as i128);
        j < self.seq_k as i128 && causal_ok && window_ok
    }

    /// The reference of query row `i` of head `h` of batch `b`.
    fn exact(&self, b: usize, h: usize, i: usize) -> RowRef {
        let hk = h / (self.heads_q / self.heads_kv);
        let keys: Vec<(&[f32], &[f32])> = (0..self.seq_k)
            .filter(|&j| self.sees(i, j))
            .map(|j| (self.kv_row(&self.k, b, hk, j), self.kv_row(&self.v, b, hk, j)))
            .collect();
        row_ref(self.dt, scale_of(self.scale, self.d), self.q_row(b, h, i), &keys, self.seq_k)
    }

    fn upload(&self, dev: &Device) -> Result<(Tensor, Tensor, Tensor), String> {
        Ok((
            tensor(dev, &self.q, &self.shape(self.heads_q, self.seq_q), self.dt)?,
            tensor(dev, &self.k, &self.shape(self.heads_kv, self.seq_k), self.dt)?,
            tensor(dev, &self.v, &self.shape(self.heads_kv, self.seq_k), self.dt)?,
        ))
    }

    /// Runs the case; returns the output and lse as f32.
    fn run(&self, dev: &Device) -> Result<(Vec<f32>, Vec<f32>), String> {
        let (q, k, v) = self.upload(dev)?;
        let (out, lse) = ops::attention(&q, &k, &v, &self.opts()).map_err(e)?;
        if out.dtype() != self.dt || out.shape() != self.shape(self.heads_q, self.seq_q) {
            return Err(format!("out became {:?} {:?}", out.dtype(), out.shape()));
        }
        if lse.dtype() != DType::F32 || lse.shape() != [self.batch, self.heads_q, self.seq_q] {
            return Err(format!("lse became {:?} {:?}", lse.dtype(), lse.shape()));
        }
        Ok((out.to_f32_vec().map_err(e)?, lse.to_f32_vec().map_err(e)?))
    }

    fn describe(&self) -> String {
        format!(
            "{:?} {:?} B {} Hq {} Hkv {} Sq {} Sk {} D {} {:?} window {:?} scale {:?}",
            self.dt,
            self.layout,
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seq_q,
            self.seq_k,
            self.d,
            self.causal,
            self.window,
            self.scale
        )
    }

    /// Checks query rows `rows` (all when `None`) of every batch and head, except those `skip`
    /// names.
    fn check_rows(&self, dev: &Device, rows: Option<&[usize]>, skip: impl Fn(usize) -> bool) -> Result<(), String> {
        let (out, lse) = self.run(dev)?;
        let all: Vec<usize> = (0..self.seq_q).collect();
        for b in 0..self.batch {
            for h in 0..self.heads_q {
                for &i in rows.unwrap_or(&all).iter().filter(|&&i| !skip(i)) {
                    let r = self.exact(b, h, i);
                    let at = self.row_at(self.heads_q, self.seq_q, b, h, i);
                    for c in 0..self.d {
                        let got = out[at + c];
                        if !close(self.dt, got, r.o[c], Tol { rtol: 0.0, atol: r.o_tol[c] }) {
                            return Err(format!(
                                "{}: out[{b}][{h}][{i}][{c}] = {got:e}, expected {:e} (tolerance {:e})",
                                self.describe(),
                                r.o[c],
                                r.o_tol[c]
                            ));
                        }
                    }
                    let got = lse[(b * self.heads_q + h) * self.seq_q + i];
                    if !close(DType::F32, got, r.lse, Tol { rtol: 0.0, atol: r.lse_tol }) {
                        return Err(format!(
                            "{}: lse[{b}][{h}][{i}] = {got:e}, expected {:e} (tolerance {:e})",
                            self.describe(),
                            r.lse,
                            r.lse_tol
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn check(&self, dev: &Device) -> Result<(), String> {
        self.check_rows(dev, None, |_| false)
    }

    /// Runs the forward, then the backward on its outputs; checks the gradients' dtypes and
    /// shapes.
    fn run_backward(&self, dev: &Device) -> Result<BwdOut, String> {
        let (q, k, v) = self.upload(dev)?;
        let opts = self.opts();
        let (out, lse) = ops::attention(&q, &k, &v, &opts).map_err(e)?;
        let dout = tensor(dev, &self.dout, &self.shape(self.heads_q, self.seq_q), self.dt)?;
        let (dq, dk, dv) = ops::attention_backward(&q, &k, &v, &out, &lse, &dout, &opts).map_err(e)?;
        for (what, g, x) in [("dq", &dq, &q), ("dk", &dk, &k), ("dv", &dv, &v)] {
            if g.dtype() != self.dt || g.shape() != x.shape() {
                return Err(format!("{}: {what} became {:?} {:?}", self.describe(), g.dtype(), g.shape()));
            }
        }
        let f = |t: &Tensor| t.to_f32_vec().map_err(e);
        Ok(BwdOut { o: f(&out)?, lse: f(&lse)?, dq: f(&dq)?, dk: f(&dk)?, dv: f(&dv)? })
    }

    /// The keys each query row sees, as ranges.
    fn key_ranges(&self) -> Vec<(usize, usize)> {
        key_ranges(self.seq_q, self.seq_k, |i, j| self.sees(i, j))
    }

    /// The reference gradients of batch `b`, key/value head `hk`, given the forward's output in
    /// `got` (its measured error enters the bound).
    fn grads_ref(&self, got: &BwdOut, keys: &[(usize, usize)], b: usize, hk: usize) -> Grads {
        let (group, sq, d) = (self.heads_q / self.heads_kv, self.seq_q, self.d);
        let heads = |x: &[f32]| -> Vec<f64> {
            let mut y = Vec::with_capacity(group * sq * d);
            for g in 0..group {
                for i in 0..sq {
                    let at = self.row_at(self.heads_q, sq, b, hk * group + g, i);
                    y.extend(x[at..at + d].iter().map(|&v| v as f64));
                }
            }
            y
        };
        let kv = |x: &[f32]| -> Vec<f64> {
            (0..self.seq_k).flat_map(|j| self.kv_row(x, b, hk, j).iter().map(|&v| v as f64)).collect()
        };
        let (q, dout, o, k, v) = (heads(&self.q), heads(&self.dout), heads(&got.o), kv(&self.k), kv(&self.v));
        let lse: Vec<f64> = (0..group)
            .flat_map(|g| (0..sq).map(move |i| got.lse[(b * self.heads_q + hk * group + g) * sq + i] as f64))
            .collect();
        let scale = scale_of(self.scale, d) as f64;
        let p = Problem { group, seq_q: sq, seq_k: self.seq_k, d, scale, keys, q: &q, k: &k, v: &v, dout: &dout };
        let f = forward(&p);
        backward(self.dt, &p, &f, &FwdErr::measured(&p, &f, &o, &lse))
    }

    /// Checks the gradients in `got` against the reference, except the rows of dq (`skip(false,
    /// b, h, i)`) and of dk and dv (`skip(true, b, hk, j)`) that `skip` names. Where no pair is
    /// seen (a row that sees no key, a key no row sees) the gradient must be exactly zero.
    fn check_grads(&self, got: &BwdOut, skip: impl Fn(bool, usize, usize, usize) -> bool) -> Result<(), String> {
        if self.heads_kv == 0 {
            return Ok(());
        }
        let (group, d) = (self.heads_q / self.heads_kv, self.d);
        let keys = self.key_ranges();
        let cmp = |what: String, got: &[f32], want: &[f64], tol: &[f64], zero: bool| -> Result<(), String> {
            for x in 0..d {
                let ok =
                    if zero { got[x] == 0.0 } else { close(self.dt, got[x], want[x], Tol { rtol: 0.0, atol: tol[x] }) };
                if !ok {
                    let (w, t) = if zero { (0.0, 0.0) } else { (want[x], tol[x]) };
                    return Err(format!(
                        "{}: {what}[{x}] = {:e}, expected {w:e} (tolerance {t:e}{})",
                        self.describe(),
                        got[x],
                        if zero { ", exactly: no pair seen" } else { "" }
                    ));
                }
            }
            Ok(())
        };
        for b in 0..self.batch {
            for hk in 0..self.heads_kv {
                let r = self.grads_ref(got, &keys, b, hk);
                for g in 0..group {
                    let h = hk * group + g;
                    for i in (0..self.seq_q).filter(|&i| !skip(false, b, h, i)) {
                        let at = self.row_at(self.heads_q, self.seq_q, b, h, i);
                        let x = (g * self.seq_q + i) * d;
                        let want = (&r.dq[x..x + d], &r.dq_tol[x..x + d]);
                        cmp(format!("dq[{b}][{h}][{i}]"), &got.dq[at..at + d], want.0, want.1, !r.row_sees[i])?;
                    }
                }
                for j in (0..self.seq_k).filter(|&j| !skip(true, b, hk, j)) {
                    let at = self.row_at(self.heads_kv, self.seq_k, b, hk, j);
                    let x = j * d;
                    let zero = !r.key_seen[j];
                    cmp(
                        format!("dk[{b}][{hk}][{j}]"),
                        &got.dk[at..at + d],
                        &r.dk[x..x + d],
                        &r.dk_tol[x..x + d],
                        zero,
                    )?;
                    cmp(
                        format!("dv[{b}][{hk}][{j}]"),
                        &got.dv[at..at + d],
                        &r.dv[x..x + d],
                        &r.dv_tol[x..x + d],
                        zero,
                    )?;
                }
            }
        }
        Ok(())
    }

    fn check_backward(&self, dev: &Device) -> Result<(), String> {
        let got = self.run_backward(dev)?;
        self.check_grads(&got, |_, _, _, _| false)
    }
}

const CAUSALS: [Causal; 3] = [Causal::None, Causal::TopLeft, Causal::BottomRight];

/// Every head dim the brief names, each mask, Sq above and below Sk, GQA and MQA, both layouts
/// and dtypes, the short and odd sequence lengths.
fn shapes(dev: &Device) -> Result<(), String> {
    let seqs = [(1usize, 1usize), (17, 17), (1, 100), (100, 1), (130, 257), (257, 130), (200, 200)];
    let heads = [(1usize, 1usize), (8, 2), (4, 1)];
    let mut n = 0u64;
    for (di, d) in [8usize, 64, 96, 128, 256].into_iter().enumerate() {
        for (si, &(sq, sk)) in seqs.iter().enumerate() {
            let causal = CAUSALS[(di + si) % 3];
            let (hq, hkv) = heads[(di + 2 * si) % 3];
            let dt = if (di + si) % 2 == 0 { DType::BF16 } else { DType::F16 };
            let layout = if si % 2 == 0 { Layout::Bhsd } else { Layout::Bshd };
            // Fewer heads where D and S are large: the f64 reference is the test's cost.
            let hq = if d * sq * sk > 64 * 200 * 200 { hq.min(4) } else { hq };
            let hkv = hkv.min(hq);
            let mut cs = Case::new(100 + n, dt, layout, (2, hq, hkv, sq, sk, d), causal);
            // Scales other than 1/sqrt(D): positive, negative and 0 (every weight equal).
            cs.scale = match si {
                3 => Some(0.3),
                4 => Some(-0.4),
                5 => Some(0.0),
                _ => None,
            };
            cs.check(dev)?;
            n += 1;
        }
    }
    Ok(())
}

fn seq() -> impl Strategy<Value = usize> {
    prop_oneof![Just(1usize), Just(2), Just(17), Just(63), Just(64), Just(65), Just(128), Just(129), 1usize..300]
}

fn random(dev: &Device) -> Result<(), String> {
    let strat = (
        (prop_oneof![Just(DType::BF16), Just(DType::F16)], prop_oneof![Just(Layout::Bhsd), Just(Layout::Bshd)]),
        ((1usize..=32).prop_map(|x| 8 * x), seq(), prop_oneof![3 => seq(), 1 => Just(0usize)]),
        (1usize..3, prop_oneof![Just((1usize, 1usize)), Just((2, 1)), Just((4, 2)), Just((3, 3))]),
        (0usize..3, prop_oneof![3 => Just(None), 1 => (0usize..80, 0usize..80).prop_map(Some)]),
        prop_oneof![3 => Just(None), 1 => (-1.0f32..1.0).prop_map(Some)],
        any::<u64>(),
    );
    prop(48, strat, |((dt, layout), (d, sq, sk), (batch, (hq, hkv)), (causal, window), scale, seed)| {
        let mut cs = Case::new(seed, dt, layout, (batch, hq, hkv, sq, sk, d), CAUSALS[causal]);
        cs.window = window;
        cs.scale = scale;
        cs.check(dev)
    })
}

/// A long sequence, its rows sampled (the f64 reference of every row would take minutes).
fn long_sampled_rows(dev: &Device) -> Result<(), String> {
    let s = if sanitizer() { 1000 } else { 4097 };
    let rows: Vec<usize> = [0usize, 1, 63, 64, 65, 2047, 2048, s - 2, s - 1].into_iter().filter(|&r| r < s).collect();
    for (i, (dt, d, causal, layout)) in [
        (DType::BF16, 128, Causal::TopLeft, Layout::Bhsd),
        (DType::F16, 64, Causal::None, Layout::Bshd),
        (DType::BF16, 256, Causal::BottomRight, Layout::Bshd),
    ]
    .into_iter()
    .enumerate()
    {
        let cs = Case::new(7 + i as u64, dt, layout, (1, 2, 1, s, s + 3 * i, d), causal);
        cs.check_rows(dev, Some(&rows), |_| false)?;
    }
    // A window on a long sequence: the blocks far from the diagonal are skipped.
    let mut cs = Case::new(9, DType::F16, Layout::Bhsd, (1, 2, 2, s, s, 64), Causal::TopLeft);
    cs.window = Some((100, 0));
    cs.check_rows(dev, Some(&rows), |_| false)
}

/// Rows that see no key give zeros and lse = -inf: bottom-right with Sq > Sk, a window past the
/// keys, Sk = 0.
fn fully_masked_rows(dev: &Device) -> Result<(), String> {
    for (i, dt) in [DType::BF16, DType::F16].into_iter().enumerate() {
        // Sq = 150 > Sk = 40: queries 0..110 see nothing.
        let cs = Case::new(20 + i as u64, dt, Layout::Bhsd, (2, 2, 1, 150, 40, 64), Causal::BottomRight);
        let (out, lse) = cs.run(dev)?;
        for b in 0..2 {
            for h in 0..2 {
                for q in 0..110 {
                    let at = cs.row_at(2, 150, b, h, q);
                    let l = lse[(b * 2 + h) * 150 + q];
                    if out[at..at + 64].iter().any(|&x| x != 0.0) || l != f32::NEG_INFINITY {
                        return Err(format!("{dt:?}: masked row {q} of [{b}][{h}] is not zeros with lse -inf ({l})"));
                    }
                }
            }
        }
        cs.check(dev)?;
        // A window that ends before the first key for the early queries (c(i) + right < 0).
        let mut cs = Case::new(30 + i as u64, dt, Layout::Bshd, (1, 3, 3, 100, 20, 32), Causal::None);
        cs.window = Some((5, 3));
        cs.check(dev)?;
        // No keys at all.
        let cs = Case::new(40 + i as u64, dt, Layout::Bhsd, (2, 4, 2, 70, 0, 128), Causal::None);
        let (out, lse) = cs.run(dev)?;
        if out.iter().any(|&x| x != 0.0) || lse.iter().any(|&l| l != f32::NEG_INFINITY) {
            return Err(format!("{dt:?}: Sk = 0 is not zeros with lse -inf"));
        }
    }
    Ok(())
}

/// NaN and infinities: a NaN query makes its row NaN; an infinite key makes scores of +inf
/// (NaN rows) or -inf (a weight of 0); a NaN in V reaches the rows that see it; every score
/// -inf gives zeros and lse -inf.
fn ieee(dev: &Device) -> Result<(), String> {
    for (n, dt) in [DType::BF16, DType::F16].into_iter().enumerate() {
        for d in [64usize, 256] {
            let mut cs = Case::new(50 + n as u64, dt, Layout::Bhsd, (1, 1, 1, 130, 130, d), Causal::TopLeft);
            cs.q[3 * d + 5] = f32::NAN;
            // Key 5: +inf in dim 0, so the score is +-inf by the sign of q's dim 0.
            cs.k[5 * d] = f32::INFINITY;
            // Value 70 NaN: rows 70 on see it; rows before it whose tile of keys holds it unseen
            // may get NaN (documented): rows 64-69 on the general kernels (blocks of 64 rows,
            // tiles of 64 or 32 keys), rows 0-69 on the Hopper ones (128 rows, 128 keys).
            cs.v[70 * d + 1] = f32::NAN;
            let first_unsure = if dev.ptx_arch() == "sm_90a" && d <= 128 { 0 } else { 64 };
            cs.check_rows(dev, None, |i| (first_unsure..70).contains(&i))?;
            let (out, _) = cs.run(dev)?;
            if !out[3 * d..4 * d].iter().all(|x| x.is_nan()) || !out[100 * d + 1].is_nan() {
                return Err(format!("{dt:?} D {d}: row 3 and out[100][1] should be NaN"));
            }
            // Every score -inf: k's dim 0 is -inf for every key and q's dim 0 positive.
            let mut cs = Case::new(60 + n as u64, dt, Layout::Bshd, (1, 2, 1, 70, 90, d), Causal::None);
            for j in 0..90 {
                cs.k[j * d] = f32::NEG_INFINITY;
            }
            for i in 0..70 * 2 {
                cs.q[i * d] = cs.q[i * d].abs().max(0.5);
            }
            let (out, lse) = cs.run(dev)?;
            if out.iter().any(|&x| x != 0.0) || lse.iter().any(|&l| l != f32::NEG_INFINITY) {
                return Err(format!("{dt:?} D {d}: all scores -inf is not zeros with lse -inf"));
            }
        }
    }
    Ok(())
}

/// The same data in both layouts gives the same bits (the strides are all that differ).
fn layouts_agree(dev: &Device) -> Result<(), String> {
    let (b, hq, hkv, sq, sk, d) = (2usize, 4usize, 2usize, 77usize, 150usize, 96usize);
    let a = Case::new(70, DType::BF16, Layout::Bhsd, (b, hq, hkv, sq, sk, d), Causal::BottomRight);
    let mut s = a.clone();
    s.layout = Layout::Bshd;
    let to_bshd = |x: &[f32], heads: usize, seq: usize| {
        let mut y = vec![0.0; x.len()];
        for bb in 0..b {
            for h in 0..heads {
                for r in 0..seq {
                    let from = ((bb * heads + h) * seq + r) * d;
                    let to = ((bb * seq + r) * heads + h) * d;
                    y[to..to + d].copy_from_slice(&x[from..from + d]);
                }
            }
        }
        y
    };
    s.q = to_bshd(&a.q, hq, sq);
    s.k = to_bshd(&a.k, hkv, sk);
    s.v = to_bshd(&a.v, hkv, sk);
    let (oa, la) = a.run(dev)?;
    let (os, ls) = s.run(dev)?;
    if to_bshd(&oa, hq, sq).iter().map(|x| x.to_bits()).ne(os.iter().map(|x| x.to_bits())) {
        return Err("the two layouts give different outputs".into());
    }
    if la.iter().map(|x| x.to_bits()).ne(ls.iter().map(|x| x.to_bits())) {
        return Err("the two layouts give different lse".into());
    }
    a.check(dev)
}

/// Empty batches and queries give empty outputs of the right shapes.
fn empty(dev: &Device) -> Result<(), String> {
    for (b, hq, sq, sk) in [(0usize, 2usize, 10usize, 10usize), (2, 2, 0, 10), (2, 2, 0, 0), (1, 0, 5, 5)] {
        let hkv = hq.min(1);
        let cs = Case::new(80, DType::F16, Layout::Bhsd, (b, hq, hkv, sq, sk, 64), Causal::TopLeft);
        let (q, k, v) = cs.upload(dev)?;
        let (out, lse) = ops::attention(&q, &k, &v, &cs.opts()).map_err(e)?;
        if out.shape() != q.shape() || lse.shape() != [b, hq, sq] || out.numel() != 0 || lse.numel() != 0 {
            return Err(format!("{b} {hq} {sq} {sk}: {out:?} {lse:?}"));
        }
    }
    Ok(())
}

fn errors(dev: &Device) -> Result<(), String> {
    let t = |s: &[usize], dt: DType| Tensor::zeros(dev, s, dt).map_err(e);
    let o = AttentionOpts::default();
    let invalid = |r: kernels::Result<(Tensor, Tensor)>, what: &str| match r {
        Err(Error::InvalidArgument { op: "attention", message }) if message.contains(what) => Ok(()),
        other => Err(format!("expected InvalidArgument about {what:?}, got {other:?}")),
    };
    let (q, k) = (t(&[1, 4, 10, 64], DType::BF16)?, t(&[1, 2, 12, 64], DType::BF16)?);
    let k16 = t(&[1, 2, 12, 64], DType::F16)?;
    match ops::attention(&q, &k16, &k, &o) {
        Err(Error::DTypeMismatch { op: "attention", .. }) => {}
        other => return Err(format!("expected DTypeMismatch, got {other:?}")),
    }
    let q32 = t(&[1, 4, 10, 64], DType::F32)?;
    invalid(ops::attention(&q32, &q32, &q32, &o), "bf16 or f16")?;
    let k_bad = t(&[1, 2, 13, 64], DType::BF16)?;
    match ops::attention(&q, &k, &k_bad, &o) {
        Err(Error::ShapeMismatch { op: "attention", .. }) => {}
        other => return Err(format!("expected ShapeMismatch, got {other:?}")),
    }
    let (q12, k12) = (t(&[1, 4, 10, 12], DType::BF16)?, t(&[1, 2, 12, 12], DType::BF16)?);
    invalid(ops::attention(&q12, &k12, &k12, &o), "multiple of 8 from 8 to 256")?;
    let (q264, k264) = (t(&[1, 4, 10, 264], DType::BF16)?, t(&[1, 2, 12, 264], DType::BF16)?);
    invalid(ops::attention(&q264, &k264, &k264, &o), "multiple of 8 from 8 to 256")?;
    let k3 = t(&[1, 3, 12, 64], DType::BF16)?;
    invalid(ops::attention(&q, &k3, &k3, &o), "multiple of k's")?;
    let q3 = t(&[4, 10, 64], DType::BF16)?;
    invalid(ops::attention(&q3, &k, &k, &o), "rank 4")?;
    invalid(ops::attention(&q, &k, &k, &AttentionOpts { scale: Some(f32::NAN), ..o }), "finite")?;
    // Bshd reads the same tensors with heads second to last: q [1, 4, 10, 64] is 10 heads, which
    // 12 k heads do not divide.
    invalid(ops::attention(&q, &k, &k, &AttentionOpts { layout: Layout::Bshd, ..o }), "multiple of k's")?;
    Ok(())
}

// --- the backward -------------------------------------------------------------------------------

/// Every head dim, each mask, Sq above and below Sk (1, 17, 100, 130, 200, 257), GQA and MQA, a
/// window, both layouts and dtypes: the backward against the reference on every element.
fn backward_shapes(dev: &Device) -> Result<(), String> {
    let seqs = [(1usize, 1usize), (17, 17), (1, 100), (100, 1), (130, 257), (257, 130), (200, 200)];
    let heads = [(1usize, 1usize), (8, 2), (4, 1)];
    let mut n = 0u64;
    for (di, d) in [8usize, 64, 96, 128, 256].into_iter().enumerate() {
        for (si, &(sq, sk)) in seqs.iter().enumerate() {
            // Each pair of the mask, heads, dtype and layout meets over the head dims.
            let causal = CAUSALS[(di + si + 1) % 3];
            let (hq, hkv) = heads[(di + 2 * si) % 3];
            let dt = if (di + si) % 2 == 0 { DType::F16 } else { DType::BF16 };
            let layout = if si % 2 == 0 { Layout::Bshd } else { Layout::Bhsd };
            // Fewer heads where D and S are large: the f64 reference is the test's cost.
            let hq = if d * sq * sk > 64 * 200 * 200 { hq.min(4) } else { hq };
            let hkv = hkv.min(hq);
            let mut cs = Case::new(200 + n, dt, layout, (2, hq, hkv, sq, sk, d), causal);
            match si {
                3 => cs.scale = Some(0.3),
                5 => cs.window = Some((40, 7)),
                6 => cs.scale = Some(-0.6),
                _ => {}
            }
            cs.check_backward(dev)?;
            n += 1;
        }
    }
    Ok(())
}

fn backward_random(dev: &Device) -> Result<(), String> {
    let strat = (
        (prop_oneof![Just(DType::BF16), Just(DType::F16)], prop_oneof![Just(Layout::Bhsd), Just(Layout::Bshd)]),
        ((1usize..=32).prop_map(|x| 8 * x), seq(), prop_oneof![3 => seq(), 1 => Just(0usize)]),
        (1usize..3, prop_oneof![Just((1usize, 1usize)), Just((2, 1)), Just((4, 2)), Just((3, 3)), Just((4, 1))]),
        (0usize..3, prop_oneof![3 => Just(None), 1 => (0usize..80, 0usize..80).prop_map(Some)]),
        prop_oneof![3 => Just(None), 1 => (-1.0f32..1.0).prop_map(Some)],
        any::<u64>(),
    );
    prop(24, strat, |((dt, layout), (d, sq, sk), (batch, (hq, hkv)), (causal, window), scale, seed)| {
        let mut cs = Case::new(seed, dt, layout, (batch, hq, hkv, sq, sk, d), CAUSALS[causal]);
        cs.window = window;
        cs.scale = scale;
        cs.check_backward(dev)
    })
}

/// Long sequences, every element: 1000 (MQA, GQA with a window) and 4097 (one head, D 64, the
/// f64 reference's limit) queries and keys.
fn backward_long(dev: &Device) -> Result<(), String> {
    let (s, m) = if sanitizer() { (300, 200) } else { (4097, 1000) };
    let cases = [
        (DType::BF16, Layout::Bshd, (1, 4, 1, m, m, 128), Causal::BottomRight, None),
        (DType::F16, Layout::Bhsd, (1, 4, 2, m, m + 3, 256), Causal::None, Some((300, 40))),
        (DType::F16, Layout::Bhsd, (1, 1, 1, s, s, 64), Causal::TopLeft, None),
        (DType::BF16, Layout::Bshd, (1, 2, 1, s, 300, 64), Causal::None, None),
    ];
    for (i, (dt, layout, sizes, causal, window)) in cases.into_iter().enumerate() {
        let mut cs = Case::new(500 + i as u64, dt, layout, sizes, causal);
        cs.window = window;
        cs.check_backward(dev)?;
    }
    Ok(())
}

/// Rows that see no key get zero gradients, keys no row sees exact zeros (checked by
/// `check_grads` wherever they occur; here they do): bottom-right with Sq > Sk, windows that
/// leave early rows, or most keys, unseen, top-left with Sk > Sq, no keys, no queries.
fn backward_masked(dev: &Device) -> Result<(), String> {
    for (n, dt) in [DType::BF16, DType::F16].into_iter().enumerate() {
        let n = 10 * n as u64;
        let mut cases = vec![
            Case::new(600 + n, dt, Layout::Bhsd, (2, 2, 1, 150, 40, 64), Causal::BottomRight),
            Case::new(601 + n, dt, Layout::Bhsd, (1, 3, 3, 50, 200, 128), Causal::TopLeft),
            Case::new(602 + n, dt, Layout::Bhsd, (2, 4, 2, 70, 0, 64), Causal::None),
            Case::new(603 + n, dt, Layout::Bshd, (2, 2, 1, 0, 90, 64), Causal::None),
        ];
        let mut w = Case::new(604 + n, dt, Layout::Bshd, (1, 3, 3, 100, 20, 32), Causal::None);
        w.window = Some((5, 3));
        cases.push(w);
        // Each row sees 3 keys at the bottom right: keys 0..88 are seen by none.
        let mut w = Case::new(605 + n, dt, Layout::Bhsd, (1, 2, 2, 10, 100, 96), Causal::BottomRight);
        w.window = Some((2, 0));
        cases.push(w);
        for cs in &cases {
            let keys = cs.key_ranges();
            let blind_row = keys.iter().any(|&(a, b)| b <= a);
            let blind_key = (0..cs.seq_k).any(|j| !keys.iter().any(|&(a, b)| a <= j && j < b));
            if !blind_row && !blind_key {
                return Err(format!("{}: every row sees a key and every key is seen", cs.describe()));
            }
            cs.check_backward(dev)?;
        }
    }
    Ok(())
}

/// Empty batches or heads give empty gradients of the right shapes.
fn backward_empty(dev: &Device) -> Result<(), String> {
    for (b, hq, sq, sk) in [(0usize, 2usize, 10usize, 10usize), (1, 0, 5, 5), (0, 0, 0, 0)] {
        let cs = Case::new(700, DType::BF16, Layout::Bshd, (b, hq, hq.min(1), sq, sk, 64), Causal::None);
        let got = cs.run_backward(dev)?;
        if !(got.dq.is_empty() && got.dk.is_empty() && got.dv.is_empty()) {
            return Err(format!("{}: gradients not empty", cs.describe()));
        }
    }
    Ok(())
}

/// A NaN in one query row: its own dq is NaN, and so are dk and dv of the keys it sees (as in
/// the naive formula); rows of dq outside its block of 64 rows, other heads, and keys that
/// share no tile with it (256 on: no block of up to 128 keys holds both them and a key the row
/// sees, and none of up to 128 rows holds the row and one that sees them) stay finite and
/// match.
fn backward_nan(dev: &Device) -> Result<(), String> {
    let (h, r, d, s) = (1usize, 3usize, 64usize, 300usize);
    for (n, dt) in [DType::BF16, DType::F16].into_iter().enumerate() {
        let mut cs = Case::new(800 + n as u64, dt, Layout::Bhsd, (1, 2, 1, s, s, d), Causal::TopLeft);
        let at = cs.row_at(2, s, 0, h, r);
        cs.q[at + 5] = f32::NAN;
        let got = cs.run_backward(dev)?;
        if !got.dq[at..at + d].iter().all(|x| x.is_nan()) {
            return Err(format!("{dt:?}: dq of the NaN row is not NaN"));
        }
        for j in 0..=r {
            let kt = cs.row_at(1, s, 0, 0, j);
            if !got.dk[kt..kt + d].iter().chain(&got.dv[kt..kt + d]).all(|x| x.is_nan()) {
                return Err(format!("{dt:?}: dk or dv of key {j}, which the NaN row sees, is not NaN"));
            }
        }
        cs.check_grads(&got, |key_side, _, head, row| if key_side { row < 256 } else { head == h && row < 64 })?;
    }
    Ok(())
}

/// Two runs on the same inputs give the same bits (no atomics): GQA with a causal mask, MQA over
/// many keys.
fn backward_deterministic(dev: &Device) -> Result<(), String> {
    let cases = [
        Case::new(900, DType::BF16, Layout::Bshd, (2, 4, 2, 300, 257, 96), Causal::BottomRight),
        Case::new(901, DType::F16, Layout::Bhsd, (1, 8, 1, 130, 700, 64), Causal::None),
    ];
    for cs in &cases {
        let (q, k, v) = cs.upload(dev)?;
        let opts = cs.opts();
        let (out, lse) = ops::attention(&q, &k, &v, &opts).map_err(e)?;
        let dout = tensor(dev, &cs.dout, &cs.shape(cs.heads_q, cs.seq_q), cs.dt)?;
        let run = || -> Result<Vec<Vec<u32>>, String> {
            let (dq, dk, dv) = ops::attention_backward(&q, &k, &v, &out, &lse, &dout, &opts).map_err(e)?;
            [dq, dk, dv]
                .iter()
                .map(|t| t.to_f32_vec().map(|x| x.iter().map(|v| v.to_bits()).collect()).map_err(e))
                .collect()
        };
        let (a, b) = (run()?, run()?);
        for (what, (x, y)) in ["dq", "dk", "dv"].iter().zip(a.iter().zip(&b)) {
            if x != y {
                return Err(format!("{}: {what} differs between two runs", cs.describe()));
            }
        }
    }
    Ok(())
}

/// Wrong shapes or dtypes of `out`, `lse` and `dout`, and the forward's own errors, are typed
/// errors of `attention_backward`.
fn backward_errors(dev: &Device) -> Result<(), String> {
    let t = |s: &[usize], dt: DType| Tensor::zeros(dev, s, dt).map_err(e);
    let o = AttentionOpts::default();
    let (q, k) = (t(&[1, 4, 10, 64], DType::BF16)?, t(&[1, 2, 12, 64], DType::BF16)?);
    let (out, lse, dout) =
        (t(&[1, 4, 10, 64], DType::BF16)?, t(&[1, 4, 10], DType::F32)?, t(&[1, 4, 10, 64], DType::BF16)?);
    // The right shapes and dtypes run.
    ops::attention_backward(&q, &k, &k, &out, &lse, &dout, &o).map_err(e)?;
    type Grads3 = kernels::Result<(Tensor, Tensor, Tensor)>;
    let shape_err = |r: Grads3, what: &str| match r {
        Err(
            Error::ShapeMismatch { op: "attention_backward", .. }
            | Error::InvalidArgument { op: "attention_backward", .. },
        ) => Ok(()),
        other => Err(format!("{what}: expected ShapeMismatch or InvalidArgument, got {other:?}")),
    };
    let dtype_err = |r: Grads3, what: &str| match r {
        Err(
            Error::DTypeMismatch { op: "attention_backward", .. }
            | Error::InvalidArgument { op: "attention_backward", .. },
        ) => Ok(()),
        other => Err(format!("{what}: expected DTypeMismatch or InvalidArgument, got {other:?}")),
    };
    let bwd = |out: &Tensor, lse: &Tensor, dout: &Tensor| ops::attention_backward(&q, &k, &k, out, lse, dout, &o);
    for s in [&[1usize, 4, 11, 64][..], &[1, 4, 10, 32], &[4, 10, 64], &[1, 2, 10, 64], &[1, 10, 4, 64]] {
        shape_err(bwd(&t(s, DType::BF16)?, &lse, &dout), &format!("out {s:?}"))?;
        shape_err(bwd(&out, &lse, &t(s, DType::BF16)?), &format!("dout {s:?}"))?;
    }
    for s in [&[1usize, 4, 11][..], &[1, 4, 10, 1], &[4, 10], &[1, 10, 4], &[40]] {
        shape_err(bwd(&out, &t(s, DType::F32)?, &dout), &format!("lse {s:?}"))?;
    }
    for dt in [DType::F16, DType::F32] {
        dtype_err(bwd(&t(&[1, 4, 10, 64], dt)?, &lse, &dout), &format!("out {dt:?}"))?;
        dtype_err(bwd(&out, &lse, &t(&[1, 4, 10, 64], dt)?), &format!("dout {dt:?}"))?;
    }
    for dt in [DType::BF16, DType::F16] {
        dtype_err(bwd(&out, &t(&[1, 4, 10], dt)?, &dout), &format!("lse {dt:?}"))?;
    }
    // The forward's checks of q, k, v and the options.
    let k16 = t(&[1, 2, 12, 64], DType::F16)?;
    dtype_err(ops::attention_backward(&q, &k16, &k, &out, &lse, &dout, &o), "k f16")?;
    let k_bad = t(&[1, 2, 13, 64], DType::BF16)?;
    shape_err(ops::attention_backward(&q, &k, &k_bad, &out, &lse, &dout, &o), "v of another shape")?;
    let q32 = t(&[1, 4, 10, 64], DType::F32)?;
    let o32 = t(&[1, 4, 10, 64], DType::F32)?;
    dtype_err(ops::attention_backward(&q32, &q32, &q32, &o32, &lse, &o32, &o), "f32 inputs")?;
    let k3 = t(&[1, 3, 12, 64], DType::BF16)?;
    shape_err(ops::attention_backward(&q, &k3, &k3, &out, &lse, &dout, &o), "3 key heads for 4")?;
    let nan = AttentionOpts { scale: Some(f32::NAN), ..o };
    match ops::attention_backward(&q, &k, &k, &out, &lse, &dout, &nan) {
        Err(Error::InvalidArgument { op: "attention_backward", message }) if message.contains("finite") => Ok(()),
        other => Err(format!("scale NaN: expected InvalidArgument about \"finite\", got {other:?}")),
    }
}

fn main() -> ExitCode {
    let tests = vec![
        test("attention/shapes", shapes),
        test("attention/random", random),
        test("attention/long_sampled_rows", long_sampled_rows),
        test("attention/fully_masked_rows", fully_masked_rows),
        test("attention/ieee", ieee),
        test("attention/layouts_agree", layouts_agree),
        test("attention/empty", empty),
        test("attention/errors", errors),
        test("attention/backward_shapes", backward_shapes),
        test("attention/backward_random", backward_random),
        test("attention/backward_long", backward_long),
        test("attention/backward_masked", backward_masked),
        test("attention/backward_empty", backward_empty),
        test("attention/backward_nan", backward_nan),
        test("attention/backward_deterministic", backward_deterministic),
        test("attention/backward_errors", backward_errors),
    ];
    run(tests)
}
