//! GPU tests of the 2-d convolution (`ops::conv2d`, `conv2d_out`, `conv2d_backward`) in f32,
//! f16 and bf16, NHWC and NCHW.
//!
//! Reference: a direct convolution in f64 of the inputs as stored (already rounded to the
//! dtype), padding contributing nothing. Error bound, derived and not tuned: each result is a
//! sum of `L` terms (products of stored values, and the bias), accumulated in f32 in some order,
//! then rounded once to the dtype. With `u = 2^-24`, the accumulation's error is at most
//! `gamma(L) * M`, `gamma(L) = L u / (1 - L u)` and `M` the sum of the terms' magnitudes
//! (`|x| |w|`, `|b|`), whatever the order (each product's rounding counts as one more term's
//! worth, hence `L` and not `L - 1`); the final rounding to the dtype adds half an ulp of the
//! dtype at the accumulated value's magnitude, `|want| + gamma(L) M`. `L` per result:
//! the forward `C/g * R * S` (+1 with a bias), backward-data `K/g * R * S`, backward-weight and
//! bias `N * P * Q` (the chunked sum is one more order of the same terms). The forward of bf16
//! and f16 in NHWC with one group and `C % 8 == 0` runs on the tensor cores, whose adds
//! truncate: there the accumulation's bound is the tensor-core GEMM's,
//! `tc_bound_terms(R S C, 1) * 2^-23 * M` (its derivation is in tests/common/reference.rs).
//! Where also `K % 8 == 0`, the
//! input's and the filter's gradients run on the tensor cores too: backward-data is a GEMM over
//! `R S K` (`tc_bound_terms(R S K, 1)`; the taps that read no output are zeros, which add no
//! error), backward-weight one over each chunk of the `N P Q` terms, whose `chunks` f32 partials
//! are then added in order with rounding to nearest: at most `18 ceil(N P Q / 16) 2^-23 M` for
//! the chunks (each chunk's terms are at most `N P Q`, their magnitudes sum to `M`) plus `chunks
//! 2^-24 M` for the adds, i.e. `tc_bound_terms(N P Q, chunks) * 2^-23 * M`, with `chunks` at
//! most `ceil(N P Q / 32)` (chunk lengths are multiples of 32, `ops::conv::tc_wgrad_chunking`).
//!
//! Shapes: a deterministic sweep over sizes 1 and primes, odd spatial sizes the stride does not
//! divide, strides 1-3, paddings 0-3, dilations 1-2, groups 1, 2 and depthwise, filters 1x1 to
//! 7x7 and non-square, both layouts, all dtypes, with and without bias. Also: a finite-difference
//! check of the backward against the forward in f32, NaN propagation, empty sizes, the errors,
//! and the backward's determinism. Every allocation is poisoned with NaN (the harness), so an
//! element a kernel does not write fails.

mod common;

use common::*;
use kernels::ops::{self, Conv2dOpts, ConvNeeds, Layout2d};
use kernels::{DType, Device, Error, Tensor};
use std::process::ExitCode;

/// One problem: sizes and options.
#[derive(Clone, Copy, Debug)]
struct Case {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    k: usize,
    r: usize,
    s: usize,
    stride: (usize, usize),
    pad: (usize, usize),
    dil: (usize, usize),
    groups: usize,
    nhwc: bool,
    bias: bool,
}

fn out_len(h: usize, r: usize, stride: usize, pad: usize, dil: usize) -> usize {
    let span = dil * (r - 1) + 1;
    if h + 2 * pad < span { 0 } else { (h + 2 * pad - span) / stride + 1 }
}

impl Case {
    fn p(&self) -> usize {
        out_len(self.h, self.r, self.stride.0, self.pad.0, self.dil.0)
    }
    fn q(&self) -> usize {
        out_len(self.w, self.s, self.stride.1, self.pad.1, self.dil.1)
    }
    fn cg(&self) -> usize {
        self.c / self.groups
    }
    fn kg(&self) -> usize {
        self.k / self.groups
    }
    fn opts(&self) -> Conv2dOpts {
        Conv2dOpts {
            stride: self.stride,
            padding: self.pad,
            dilation: self.dil,
            groups: self.groups,
            layout: if self.nhwc { Layout2d::Nhwc } else { Layout2d::Nchw },
        }
    }
    fn x_shape(&self) -> Vec<usize> {
        act_shape(self.nhwc, self.n, self.c, self.h, self.w)
    }
    fn y_shape(&self) -> Vec<usize> {
        act_shape(self.nhwc, self.n, self.k, self.p(), self.q())
    }
    fn w_shape(&self) -> Vec<usize> {
        if self.nhwc { vec![self.k, self.r, self.s, self.cg()] } else { vec![self.k, self.cg(), self.r, self.s] }
    }
    /// Flat index of activation element `(n, c, h, w)` of `ch` channels, `a` x `b`.
    fn at(&self, (n, c, h, w): (usize, usize, usize, usize), ch: usize, a: usize, b: usize) -> usize {
        if self.nhwc { ((n * a + h) * b + w) * ch + c } else { ((n * ch + c) * a + h) * b + w }
    }
    fn xi(&self, i: (usize, usize, usize, usize)) -> usize {
        self.at(i, self.c, self.h, self.w)
    }
    fn yi(&self, i: (usize, usize, usize, usize)) -> usize {
        self.at(i, self.k, self.p(), self.q())
    }
    fn wi(&self, k: usize, c: usize, r: usize, s: usize) -> usize {
        if self.nhwc {
            ((k * self.r + r) * self.s + s) * self.cg() + c
        } else {
            ((k * self.cg() + c) * self.r + r) * self.s + s
        }
    }
    /// The input row read by output `p` at tap `r`, if inside the input.
    fn src(p: usize, r: usize, stride: usize, pad: usize, dil: usize, h: usize) -> Option<usize> {
        let v = (p * stride + r * dil) as i64 - pad as i64;
        (v >= 0 && (v as usize) < h).then_some(v as usize)
    }
    /// Every `(n, k, p, q, c_in, r, s, h, w)` term of the convolution (padding excluded), in a
    /// fixed order.
    fn terms(&self, mut f: impl FnMut([usize; 9])) {
        for n in 0..self.n {
            for k in 0..self.k {
                let c0 = (k / self.kg().max(1)) * self.cg();
                for p in 0..self.p() {
                    for q in 0..self.q() {
                        for r in 0..self.r {
                            let Some(h) = Self::src(p, r, self.stride.0, self.pad.0, self.dil.0, self.h) else {
                                continue;
                            };
                            for s in 0..self.s {
                                let Some(w) = Self::src(q, s, self.stride.1, self.pad.1, self.dil.1, self.w) else {
                                    continue;
                                };
                                for ci in 0..self.cg() {
                                    f([n, k, p, q, c0 + ci, r, s, h, w]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    fn macs(&self) -> usize {
        self.n * self.k * self.p() * self.q() * self.cg() * self.r * self.s
    }
}

fn act_shape(nhwc: bool, n: usize, c: usize, h: usize, w: usize) -> Vec<usize> {
    if nhwc { vec![n, h, w, c] } else { vec![n, c, h, w] }
}

/// Exact values, the magnitudes of their terms, and the accumulation's bound per unit of
/// magnitude (`gamma(L)`, or the tensor cores' bound).
struct Want {
    v: Vec<f64>,
    mag: Vec<f64>,
    unit: f64,
}

/// Whether the forward of `c` in `dt` runs on the tensor cores (`ops::conv::uses_tensor_cores`,
/// for tensors allocated by the library, which are aligned).
fn tensor_cores(c: &Case, dt: DType) -> bool {
    dt != DType::F32 && c.nhwc && c.groups == 1 && c.c.is_multiple_of(8) && c.c > 0
}

/// Whether the backward of `c` in `dt` computes dx and dw on the tensor cores
/// (`ops::conv::uses_tensor_cores_backward`, for aligned tensors).
fn tensor_cores_bwd(c: &Case, dt: DType) -> bool {
    tensor_cores(c, dt) && c.k.is_multiple_of(8) && c.k > 0
}

fn gamma(l: usize) -> f64 {
    let lu = l as f64 * 2f64.powi(-24);
    lu / (1.0 - lu)
}

/// Checks `got` against `want` within the module's bound; NaN must give NaN.
fn check(what: &str, dt: DType, got: &[f32], want: &Want) -> Result<(), String> {
    if got.len() != want.v.len() {
        return Err(format!("{what}: {} results, expected {}", got.len(), want.v.len()));
    }
    let g = want.unit;
    let mut bad = Vec::new();
    for (i, (&y, &v)) in got.iter().zip(&want.v).enumerate() {
        let ok = if v.is_nan() {
            y.is_nan()
        } else {
            let acc = g * want.mag[i];
            let allowed = acc + ulp(dt, v.abs() + acc) / 2.0;
            y.is_finite() && ((y as f64) - v).abs() <= allowed
        };
        if !ok {
            bad.push(i);
        }
    }
    if bad.is_empty() {
        return Ok(());
    }
    let mut msg = format!("{what} ({dt:?}): {} of {} wrong", bad.len(), got.len());
    for &i in bad.iter().take(6) {
        msg += &format!(
            "\n  [{i}] got {:e}, want {:e} (bound {:e} x magnitude {:e})",
            got[i], want.v[i], want.unit, want.mag[i]
        );
    }
    Err(msg)
}

/// The forward's exact values. On the tensor cores (`dt`, see [`tensor_cores`]) the bound is
/// the tensor-core GEMM's (tests/common/reference.rs, `tc_bound_terms`) over its `K = R S C`,
/// the bias added in its epilogue; else `gamma(L)`.
fn fwd_ref(c: &Case, dt: DType, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Want {
    let len = c.n * c.k * c.p() * c.q();
    let (mut v, mut mag) = (vec![0.0; len], vec![0.0; len]);
    if let Some(b) = b {
        for n in 0..c.n {
            for (k, &bk) in b.iter().enumerate().take(c.k) {
                for p in 0..c.p() {
                    for q in 0..c.q() {
                        let i = c.yi((n, k, p, q));
                        v[i] = bk as f64;
                        mag[i] = (bk as f64).abs();
                    }
                }
            }
        }
    }
    c.terms(|[n, k, p, q, ch, r, s, h, wc]| {
        let t = x[c.xi((n, ch, h, wc))] as f64 * w[c.wi(k, ch % c.cg().max(1), r, s)] as f64;
        let i = c.yi((n, k, p, q));
        v[i] += t;
        mag[i] += t.abs();
    });
    // The tensor cores multiply the padding as zeros: a non-finite filter value gives NaN at
    // every output whose window puts that tap on the padding, too (0 * NaN, 0 * inf).
    if tensor_cores(c, dt) {
        for (e, _) in w.iter().enumerate().filter(|(_, v)| !v.is_finite()) {
            // NHWC filter [K, R, S, C]: e = ((k R + r) S + s) C + ci.
            let (k, r, s) = (e / (c.c * c.s * c.r), (e / (c.c * c.s)) % c.r, (e / c.c) % c.s);
            for n in 0..c.n {
                for p in 0..c.p() {
                    for q in 0..c.q() {
                        let h = Case::src(p, r, c.stride.0, c.pad.0, c.dil.0, c.h);
                        let wc = Case::src(q, s, c.stride.1, c.pad.1, c.dil.1, c.w);
                        if h.is_none() || wc.is_none() {
                            v[c.yi((n, k, p, q))] = f64::NAN;
                        }
                    }
                }
            }
        }
    }
    let unit = if tensor_cores(c, dt) {
        common::reference::tc_bound_terms(c.c * c.r * c.s, 1) * common::reference::U
    } else {
        gamma(c.cg() * c.r * c.s + b.is_some() as usize)
    };
    Want { v, mag, unit }
}

/// `(dx, dw, db)`, with the bounds of `dt`'s path (see the module). On the tensor cores the
/// zeros of the taps that read no output (dx) and of the padding (dw) are multiplied too: a
/// non-finite filter value `w[k, r, s, c]` makes NaN all of `dx[.., c]`, a non-finite `dy[n, p,
/// q, k]` all of `dw[k, ..]`.
fn bwd_ref(c: &Case, dt: DType, x: &[f32], w: &[f32], dy: &[f32]) -> (Want, Want, Want) {
    let (mut dx, mut dxm) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    let (mut dw, mut dwm) = (vec![0.0; w.len()], vec![0.0; w.len()]);
    let (mut db, mut dbm) = (vec![0.0; c.k], vec![0.0; c.k]);
    c.terms(|[n, k, p, q, ch, r, s, h, wc]| {
        let (xi, wi) = (c.xi((n, ch, h, wc)), c.wi(k, ch % c.cg().max(1), r, s));
        let g = dy[c.yi((n, k, p, q))] as f64;
        let tx = g * w[wi] as f64;
        dx[xi] += tx;
        dxm[xi] += tx.abs();
        let tw = g * x[xi] as f64;
        dw[wi] += tw;
        dwm[wi] += tw.abs();
    });
    for n in 0..c.n {
        for k in 0..c.k {
            for p in 0..c.p() {
                for q in 0..c.q() {
                    let g = dy[c.yi((n, k, p, q))] as f64;
                    db[k] += g;
                    dbm[k] += g.abs();
                }
            }
        }
    }
    let npq = c.n * c.p() * c.q();
    let tc = tensor_cores_bwd(c, dt);
    if tc {
        // NHWC filter [K, R, S, C]: the channel is the flat index mod C.
        for (e, _) in w.iter().enumerate().filter(|(_, v)| !v.is_finite()) {
            dx.iter_mut().skip(e % c.c).step_by(c.c).for_each(|v| *v = f64::NAN);
        }
        // NHWC dy [N, P, Q, K]: the filter is the flat index mod K.
        for (i, _) in dy.iter().enumerate().filter(|(_, v)| !v.is_finite()) {
            let per = c.cg() * c.r * c.s;
            dw[(i % c.k) * per..(i % c.k + 1) * per].iter_mut().for_each(|v| *v = f64::NAN);
        }
    }
    let (ux, uw) = if tc {
        let u = common::reference::U;
        let tb = common::reference::tc_bound_terms;
        (tb(c.k * c.r * c.s, 1) * u, tb(npq, npq.div_ceil(32)) * u)
    } else {
        (gamma(c.kg() * c.r * c.s), gamma(npq))
    };
    (Want { v: dx, mag: dxm, unit: ux }, Want { v: dw, mag: dwm, unit: uw }, Want { v: db, mag: dbm, unit: gamma(npq) })
}

/// Inputs of a case: `(x, w, bias, dy)`, rounded to `dt`, standard normal (no overflow in f16 at
/// these sizes).
fn inputs(c: &Case, dt: DType, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = TestRng::new(seed);
    let d = Draw { scale: 1.0, positive: false, special: 0.0 };
    let x = draw(&mut rng, c.n * c.c * c.h * c.w, dt, d);
    let w = draw(&mut rng, c.k * c.cg() * c.r * c.s, dt, d);
    let b = draw(&mut rng, c.k, dt, d);
    let dy = draw(&mut rng, c.n * c.k * c.p() * c.q(), dt, d);
    (x, w, b, dy)
}

/// Runs the forward and the backward of `c` on the given inputs and checks them.
fn run_case(dev: &Device, c: &Case, dt: DType, x: &[f32], w: &[f32], b: &[f32], dy: &[f32]) -> Result<(), String> {
    let what = format!("{c:?} {dt:?}");
    let xt = tensor(dev, x, &c.x_shape(), dt)?;
    let wt = tensor(dev, w, &c.w_shape(), dt)?;
    let bt = tensor(dev, b, &[c.k], dt)?;
    let bias = c.bias.then_some(&bt);
    let y = ops::conv2d(&xt, &wt, bias, &c.opts()).map_err(|err| format!("{what}: {err}"))?;
    if y.shape() != c.y_shape() || y.dtype() != dt {
        return Err(format!("{what}: output {:?} {:?}, want {:?}", y.shape(), y.dtype(), c.y_shape()));
    }
    let want = fwd_ref(c, dt, x, w, c.bias.then_some(b));
    check(&format!("{what} forward"), dt, &y.to_f32_vec().map_err(e)?, &want)?;

    let dyt = tensor(dev, dy, &c.y_shape(), dt)?;
    let g = ops::conv2d_backward(&xt, &wt, &dyt, &c.opts(), ConvNeeds::ALL).map_err(|err| format!("{what}: {err}"))?;
    let (dx, dw, db) = (g.input.ok_or("no dx")?, g.weight.ok_or("no dw")?, g.bias.ok_or("no db")?);
    if dx.shape() != c.x_shape() || dw.shape() != c.w_shape() || db.shape() != [c.k] {
        return Err(format!("{what}: gradient shapes {:?} {:?} {:?}", dx.shape(), dw.shape(), db.shape()));
    }
    let (wx, ww, wb) = bwd_ref(c, dt, x, w, dy);
    check(&format!("{what} dx"), dt, &dx.to_f32_vec().map_err(e)?, &wx)?;
    check(&format!("{what} dw"), dt, &dw.to_f32_vec().map_err(e)?, &ww)?;
    check(&format!("{what} db"), dt, &db.to_f32_vec().map_err(e)?, &wb)?;
    Ok(())
}

/// The sweep: fixed cases (ResNet's shapes, scaled down), then random ones.
fn sweep() -> Vec<Case> {
    let base = Case {
        n: 2,
        c: 8,
        h: 9,
        w: 9,
        k: 8,
        r: 3,
        s: 3,
        stride: (1, 1),
        pad: (1, 1),
        dil: (1, 1),
        groups: 1,
        nhwc: true,
        bias: true,
    };
    let mut v = vec![
        base,
        Case { r: 1, s: 1, pad: (0, 0), k: 32, ..base },
        Case { c: 3, k: 16, h: 23, w: 21, r: 7, s: 7, stride: (2, 2), pad: (3, 3), ..base },
        Case { c: 16, k: 16, groups: 16, ..base },
        Case { c: 16, k: 32, groups: 16, stride: (2, 2), ..base },
        Case { r: 5, s: 5, pad: (2, 2), dil: (2, 2), ..base },
        Case { n: 1, c: 1, h: 1, w: 1, k: 1, r: 1, s: 1, pad: (0, 0), ..base },
        Case { h: 2, w: 3, r: 5, s: 5, pad: (0, 0), ..base },
        Case { h: 1, w: 1, r: 3, s: 3, pad: (3, 3), stride: (3, 3), ..base },
        Case { r: 3, s: 1, pad: (1, 0), stride: (2, 1), ..base },
    ];
    let nchw: Vec<Case> = v.iter().enumerate().map(|(i, c)| Case { nhwc: false, bias: i % 2 == 0, ..*c }).collect();
    v.extend(nchw);
    let mut rng = TestRng::new(36);
    let pick = |rng: &mut TestRng, xs: &[usize]| xs[rng.below(xs.len())];
    while v.len() < 160 {
        let groups = pick(&mut rng, &[1, 1, 2, 3, 0]);
        let per = pick(&mut rng, &[1, 2, 3, 5, 8]);
        let c = if groups == 0 { per * pick(&mut rng, &[1, 2, 3]) } else { per * groups };
        let groups = if groups == 0 { c } else { groups };
        let k = groups * pick(&mut rng, &[1, 2, 3, 7]);
        let r = pick(&mut rng, &[1, 3, 5, 7, 2]);
        let s = if rng.below(4) == 0 { pick(&mut rng, &[1, 3, 5]) } else { r };
        let case = Case {
            n: pick(&mut rng, &[1, 2, 3]),
            c,
            h: pick(&mut rng, &[1, 2, 5, 7, 11, 13, 16]),
            w: pick(&mut rng, &[1, 3, 5, 7, 11, 17]),
            k,
            r,
            s,
            stride: (1 + rng.below(3), 1 + rng.below(3)),
            pad: (rng.below(4), rng.below(4)),
            dil: (1 + rng.below(2), 1 + rng.below(2)),
            groups,
            nhwc: rng.below(2) == 0,
            bias: rng.below(2) == 0,
        };
        if case.macs() <= 150_000 {
            v.push(case);
        }
    }
    v
}

fn forward_and_backward_match_f64(dev: &Device) -> Result<(), String> {
    let cases = sweep();
    let every = if sanitizer() { 16 } else { 1 };
    for (i, c) in cases.iter().enumerate().step_by(every) {
        for dt in DType::ALL {
            let (x, w, b, dy) = inputs(c, dt, i as u64);
            run_case(dev, c, dt, &x, &w, &b, &dy)?;
        }
    }
    Ok(())
}

/// `conv2d_out` into a NaN tensor gives `conv2d`'s bits; the backward twice gives the same bits;
/// a subset of the gradients matches its part of the full set.
fn out_determinism_and_subsets(dev: &Device) -> Result<(), String> {
    for (i, c) in sweep().iter().enumerate().take(20) {
        let dt = DType::ALL[i % 3];
        let (x, w, b, dy) = inputs(c, dt, 100 + i as u64);
        let (xt, wt, bt) =
            (tensor(dev, &x, &c.x_shape(), dt)?, tensor(dev, &w, &c.w_shape(), dt)?, tensor(dev, &b, &[c.k], dt)?);
        let dyt = tensor(dev, &dy, &c.y_shape(), dt)?;
        let y = ops::conv2d(&xt, &wt, Some(&bt), &c.opts()).map_err(e)?;
        let mut out = nan_tensor(dev, &c.y_shape(), dt)?;
        ops::conv2d_out(&xt, &wt, Some(&bt), &c.opts(), &mut out).map_err(e)?;
        let bits = |t: &Tensor| -> Result<Vec<u32>, String> {
            Ok(t.to_f32_vec().map_err(e)?.into_iter().map(f32::to_bits).collect())
        };
        if bits(&y)? != bits(&out)? {
            return Err(format!("{c:?} {dt:?}: conv2d_out differs from conv2d"));
        }
        let g1 = ops::conv2d_backward(&xt, &wt, &dyt, &c.opts(), ConvNeeds::ALL).map_err(e)?;
        let g2 = ops::conv2d_backward(&xt, &wt, &dyt, &c.opts(), ConvNeeds::ALL).map_err(e)?;
        for (a, b) in [(&g1.input, &g2.input), (&g1.weight, &g2.weight), (&g1.bias, &g2.bias)] {
            let (a, b) = (a.as_ref().ok_or("missing")?, b.as_ref().ok_or("missing")?);
            if bits(a)? != bits(b)? {
                return Err(format!("{c:?} {dt:?}: two backward runs differ"));
            }
        }
        let (wx, ww, wb) = bwd_ref(c, dt, &x, &w, &dy);
        for needs in [
            ConvNeeds { input: true, weight: false, bias: false },
            ConvNeeds { input: false, weight: true, bias: false },
            ConvNeeds { input: false, weight: false, bias: true },
        ] {
            let g = ops::conv2d_backward(&xt, &wt, &dyt, &c.opts(), needs).map_err(e)?;
            if g.input.is_some() != needs.input || g.weight.is_some() != needs.weight || g.bias.is_some() != needs.bias
            {
                return Err(format!("{c:?}: {needs:?} gave other gradients"));
            }
            for (t, want, name) in [(&g.input, &wx, "dx"), (&g.weight, &ww, "dw"), (&g.bias, &wb, "db")] {
                if let Some(t) = t {
                    check(&format!("{c:?} {needs:?} {name}"), dt, &t.to_f32_vec().map_err(e)?, want)?;
                }
            }
        }
    }
    Ok(())
}

/// The backward against central differences of the forward, in f32, on a tiny shape. The loss
/// `L = sum(g * y)` (in f64 on the host) is linear in each input, so the difference quotient
/// has no truncation error: it differs from the true derivative by at most the forward's error
/// at the two points, `2 sum |g| bound(y)`, over the step `xp - xm`. Adding the gradient's own
/// bound gives the tolerance.
fn finite_differences(dev: &Device) -> Result<(), String> {
    let dt = DType::F32;
    for nhwc in [true, false] {
        let c = Case {
            n: 2,
            c: 4,
            h: 5,
            w: 6,
            k: 4,
            r: 3,
            s: 2,
            stride: (2, 1),
            pad: (1, 1),
            dil: (1, 2),
            groups: 2,
            nhwc,
            bias: true,
        };
        let (x, w, b, g) = inputs(&c, dt, 7);
        let bt = tensor(dev, &b, &[c.k], dt)?;
        // The loss and the sum of |g| times the forward's bound at each output.
        let loss = |x: &[f32], w: &[f32]| -> Result<(f64, f64), String> {
            let y = ops::conv2d(
                &tensor(dev, x, &c.x_shape(), dt)?,
                &tensor(dev, w, &c.w_shape(), dt)?,
                Some(&bt),
                &c.opts(),
            )
            .map_err(e)?
            .to_f32_vec()
            .map_err(e)?;
            let want = fwd_ref(&c, dt, x, w, Some(&b));
            let gm = want.unit;
            let l = y.iter().zip(&g).map(|(&y, &g)| y as f64 * g as f64).sum();
            let err = want
                .mag
                .iter()
                .zip(&want.v)
                .zip(&g)
                .map(|((&m, &v), &g)| (g as f64).abs() * (gm * m + ulp(dt, v.abs() + gm * m) / 2.0))
                .sum::<f64>();
            Ok((l, err))
        };
        let grads = ops::conv2d_backward(
            &tensor(dev, &x, &c.x_shape(), dt)?,
            &tensor(dev, &w, &c.w_shape(), dt)?,
            &tensor(dev, &g, &c.y_shape(), dt)?,
            &c.opts(),
            ConvNeeds::ALL,
        )
        .map_err(e)?;
        let dx = grads.input.ok_or("no dx")?.to_f32_vec().map_err(e)?;
        let dw = grads.weight.ok_or("no dw")?.to_f32_vec().map_err(e)?;
        let (wx, ww, _) = bwd_ref(&c, dt, &x, &w, &g);
        let step = 0.5f32;
        for (which, len) in [(0, x.len()), (1, w.len())] {
            for i in (0..len).step_by(7) {
                let (mut xp, mut xm, mut wp, mut wm) = (x.clone(), x.clone(), w.clone(), w.clone());
                let (hp, hm) = if which == 0 {
                    xp[i] += step;
                    xm[i] -= step;
                    (xp[i], xm[i])
                } else {
                    wp[i] += step;
                    wm[i] -= step;
                    (wp[i], wm[i])
                };
                let ((lp, ep), (lm, em)) = (loss(&xp, &wp)?, loss(&xm, &wm)?);
                let fd = (lp - lm) / (hp as f64 - hm as f64);
                let (got, want) = if which == 0 { (dx[i], &wx) } else { (dw[i], &ww) };
                let acc = want.unit * want.mag[i];
                let own = acc + ulp(dt, want.v[i].abs() + acc) / 2.0;
                // The loss's own sum in f64: relative 2^-50 of its magnitude, far below these.
                let tol = (ep + em) / (hp as f64 - hm as f64) + own + 1e-12 * (lp.abs() + lm.abs());
                if ((got as f64) - fd).abs() > tol {
                    let name = if which == 0 { "dx" } else { "dw" };
                    return Err(format!("{c:?}: {name}[{i}] = {got:e}, finite difference {fd:e} (tol {tol:e})"));
                }
            }
        }
    }
    Ok(())
}

/// A NaN in x, in the filter or in dy reaches exactly the results whose sums include it (the
/// reference's NaNs), and no other; on the tensor cores, a filter's NaN also reaches the outputs
/// where its tap falls on the padding (multiplied as zeros there).
fn nan_propagates(dev: &Device) -> Result<(), String> {
    for (i, c) in sweep().iter().enumerate().take(12) {
        for dt in DType::ALL {
            let (mut x, mut w, b, mut dy) = inputs(c, dt, 200 + i as u64);
            let mut rng = TestRng::new(i as u64);
            let (i, j) = (rng.below(x.len()), rng.below(w.len()));
            x[i] = f32::NAN;
            w[j] = f32::NAN;
            if !dy.is_empty() {
                let l = rng.below(dy.len());
                dy[l] = f32::NAN;
            }
            run_case(dev, c, dt, &x, &w, &b, &dy)?;
        }
    }
    Ok(())
}

/// Zero-sized dimensions give empty (or zero) results.
fn empty_sizes(dev: &Device) -> Result<(), String> {
    let base = Case {
        n: 2,
        c: 4,
        h: 5,
        w: 5,
        k: 4,
        r: 3,
        s: 3,
        stride: (1, 1),
        pad: (0, 0),
        dil: (1, 1),
        groups: 1,
        nhwc: true,
        bias: true,
    };
    for nhwc in [true, false] {
        for c in [
            Case { n: 0, ..base },
            Case { k: 0, ..base },
            Case { c: 0, ..base },
            Case { h: 2, ..base },
            Case { h: 0, w: 0, ..base },
            Case { h: 0, w: 0, pad: (1, 1), r: 1, s: 1, ..base },
            // The tensor-core backward's conditions: no terms (dx zeros on the tensor cores).
            Case { c: 8, k: 8, h: 2, ..base },
            Case { c: 8, k: 8, n: 0, ..base },
        ] {
            let c = Case { nhwc, ..c };
            let dt = DType::BF16;
            let (x, w, b, dy) = inputs(&c, dt, 3);
            run_case(dev, &c, dt, &x, &w, &b, &dy)?;
        }
    }
    Ok(())
}

/// Bad arguments are typed errors naming the op.
fn errors(dev: &Device) -> Result<(), String> {
    let t = |shape: &[usize], dt: DType| Tensor::zeros(dev, shape, dt).map_err(e);
    let x = t(&[1, 5, 5, 4], DType::F32)?;
    let w = t(&[2, 3, 3, 4], DType::F32)?;
    let o = Conv2dOpts::default();
    let bad = |r: Result<Tensor, Error>, want: &str| -> Result<(), String> {
        match r {
            Err(err @ (Error::InvalidArgument { .. } | Error::ShapeMismatch { .. } | Error::DTypeMismatch { .. })) => {
                if err.to_string().starts_with("conv2d") {
                    Ok(())
                } else {
                    Err(format!("{want}: the error does not name the op: {err}"))
                }
            }
            other => Err(format!("{want}: expected a typed error, got {:?}", other.map(|t| t.shape().to_vec()))),
        }
    };
    bad(ops::conv2d(&x, &w, None, &Conv2dOpts { stride: (0, 1), ..o }), "stride 0")?;
    bad(ops::conv2d(&x, &w, None, &Conv2dOpts { dilation: (1, 0), ..o }), "dilation 0")?;
    bad(ops::conv2d(&x, &w, None, &Conv2dOpts { groups: 0, ..o }), "groups 0")?;
    bad(ops::conv2d(&x, &w, None, &Conv2dOpts { groups: 3, ..o }), "groups not dividing")?;
    bad(ops::conv2d(&x, &t(&[2, 3, 3, 3], DType::F32)?, None, &o), "channel mismatch")?;
    bad(ops::conv2d(&x, &t(&[2, 3, 3, 4], DType::BF16)?, None, &o), "dtypes differ")?;
    bad(ops::conv2d(&x, &t(&[2, 3, 4], DType::F32)?, None, &o), "rank 3 filter")?;
    bad(ops::conv2d(&x, &t(&[2, 0, 3, 4], DType::F32)?, None, &o), "empty filter")?;
    bad(ops::conv2d(&x, &w, Some(&t(&[3], DType::F32)?), &o), "bias shape")?;
    bad(ops::conv2d(&x, &w, Some(&t(&[2], DType::F16)?), &o), "bias dtype")?;
    bad(ops::conv2d(&x, &w, None, &Conv2dOpts { padding: (usize::MAX, 0), ..o }), "huge padding")?;
    let wrong_dy = t(&[1, 3, 3, 3], DType::F32)?;
    match ops::conv2d_backward(&x, &w, &wrong_dy, &o, ConvNeeds::ALL) {
        Err(Error::ShapeMismatch { op: "conv2d_backward", .. }) => {}
        other => return Err(format!("dy shape: {:?}", other.map(|_| ()))),
    }
    let mut out = t(&[1, 3, 3, 3], DType::F32)?;
    match ops::conv2d_out(&x, &w, None, &o, &mut out) {
        Err(Error::ShapeMismatch { op: "conv2d_out", .. }) => {}
        other => return Err(format!("out shape: {other:?}")),
    }
    Ok(())
}

/// Shapes of several tensor-core tiles (rows, columns and K stages), K odd (no pair stores),
/// a 7x7 stride-2 filter on 8 channels, a strided 1x1.
fn tensor_core_tiles(dev: &Device) -> Result<(), String> {
    let base = Case {
        n: 2,
        c: 64,
        h: 12,
        w: 12,
        k: 136,
        r: 3,
        s: 3,
        stride: (1, 1),
        pad: (1, 1),
        dil: (1, 1),
        groups: 1,
        nhwc: true,
        bias: true,
    };
    let cases = [
        base,
        Case { k: 131, bias: false, ..base },
        Case { n: 3, c: 8, h: 17, w: 17, k: 8, r: 7, s: 7, stride: (2, 2), pad: (3, 3), ..base },
        Case { c: 24, h: 13, w: 13, k: 200, r: 1, s: 1, stride: (2, 2), pad: (0, 0), ..base },
        Case { n: 1, c: 16, h: 30, w: 9, k: 16, dil: (2, 1), pad: (2, 0), ..base },
    ];
    for (i, c) in cases.iter().enumerate() {
        for dt in [DType::BF16, DType::F16] {
            if !tensor_cores(c, dt) {
                return Err(format!("{c:?} {dt:?} would not run on the tensor cores"));
            }
            let (x, w, b, dy) = inputs(c, dt, 300 + i as u64);
            run_case(dev, c, dt, &x, &w, &b, &dy)?;
        }
    }
    Ok(())
}

/// The backward on the tensor cores: several tiles of rows, columns and reduction (K and C not
/// multiples of the tile, `N H W` and `N P Q` neither), strides 1 and 2 (and 1 x 2), padding,
/// dilation, 1x1, 3x3 and 7x7 filters, one and many chunks of the weight gradient's terms, taps
/// that read only padding; then, into NaN-filled gradients (`conv2d_backward_out`), a second run
/// bit for bit equal to the first.
fn tensor_core_backward(dev: &Device) -> Result<(), String> {
    let base = Case {
        n: 2,
        c: 64,
        h: 12,
        w: 12,
        k: 136,
        r: 3,
        s: 3,
        stride: (1, 1),
        pad: (1, 1),
        dil: (1, 1),
        groups: 1,
        nhwc: true,
        bias: true,
    };
    let cases = [
        base,
        Case { c: 136, k: 64, h: 11, w: 13, stride: (2, 2), ..base },
        Case { n: 3, c: 8, h: 17, w: 17, k: 16, r: 7, s: 7, stride: (2, 2), pad: (3, 3), ..base },
        Case { c: 24, h: 13, w: 13, k: 200, r: 1, s: 1, stride: (2, 2), pad: (0, 0), ..base },
        Case { c: 40, h: 9, w: 9, k: 24, r: 1, s: 1, pad: (0, 0), bias: false, ..base },
        Case { n: 1, c: 16, h: 30, w: 9, k: 16, dil: (2, 1), pad: (2, 0), ..base },
        Case { n: 4, c: 8, h: 32, w: 32, k: 8, ..base },
        Case { c: 16, k: 24, h: 10, w: 15, r: 1, s: 3, stride: (1, 2), pad: (0, 1), ..base },
        Case { n: 3, c: 8, h: 1, w: 1, k: 8, stride: (3, 3), pad: (3, 3), ..base },
    ];
    let bits = |t: &Tensor| -> Result<Vec<u32>, String> {
        Ok(t.to_f32_vec().map_err(e)?.into_iter().map(f32::to_bits).collect())
    };
    for (i, c) in cases.iter().enumerate() {
        for dt in [DType::BF16, DType::F16] {
            if !tensor_cores_bwd(c, dt) {
                return Err(format!("{c:?} {dt:?}: the backward would not run on the tensor cores"));
            }
            let (x, w, b, dy) = inputs(c, dt, 400 + i as u64);
            run_case(dev, c, dt, &x, &w, &b, &dy)?;
            let (xt, wt, dyt) = (
                tensor(dev, &x, &c.x_shape(), dt)?,
                tensor(dev, &w, &c.w_shape(), dt)?,
                tensor(dev, &dy, &c.y_shape(), dt)?,
            );
            let g1 = ops::conv2d_backward(&xt, &wt, &dyt, &c.opts(), ConvNeeds::ALL).map_err(e)?;
            let mut g2 = ops::Conv2dGrads {
                input: Some(nan_tensor(dev, &c.x_shape(), dt)?),
                weight: Some(nan_tensor(dev, &c.w_shape(), dt)?),
                bias: Some(nan_tensor(dev, &[c.k], dt)?),
            };
            ops::conv2d_backward_out(&xt, &wt, &dyt, &c.opts(), &mut g2).map_err(e)?;
            for (a, b, name) in
                [(&g1.input, &g2.input, "dx"), (&g1.weight, &g2.weight, "dw"), (&g1.bias, &g2.bias, "db")]
            {
                let (a, b) = (a.as_ref().ok_or("missing")?, b.as_ref().ok_or("missing")?);
                if bits(a)? != bits(b)? {
                    return Err(format!("{c:?} {dt:?}: two backward runs differ in {name}"));
                }
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    run(vec![
        test("tensor_core_tiles", tensor_core_tiles),
        test("tensor_core_backward", tensor_core_backward),
        test("forward_and_backward_match_f64", forward_and_backward_match_f64),
        test("out_determinism_and_subsets", out_determinism_and_subsets),
        test("finite_differences", finite_differences),
        test("nan_propagates", nan_propagates),
        test("empty_sizes", empty_sizes),
        test("errors", errors),
    ])
}
