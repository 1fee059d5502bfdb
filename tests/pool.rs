//! GPU tests of 2-d pooling (`ops::max_pool2d`, `avg_pool2d`, `global_avg_pool2d` and their
//! backward passes) in f32, f16 and bf16, NCHW and NHWC, against f64 references with PyTorch's
//! windows: awkward shapes (1x1, primes, windows overlapping the padding, strides that do not
//! divide, `ceil_mode` with a last window in the padding, rectangular kernels), ResNet's stem
//! pool. Outputs come from NaN-poisoned allocations; the backward passes run twice and must
//! agree bit for bit.
//!
//! Error bounds, with `u = 2^-24`: the max and its index are exact (a comparison, no rounding),
//! NaN and infinities included. A sum of `k` terms in f32 is within `(k - 1) u sum |terms|`; the
//! average's division and each backward term's division add `u` of their result. `close` adds
//! one ulp of the storage type for f16 and bf16 results.

mod common;

use common::*;
use kernels::ops::{self, Layout2d, Pool2dOpts};
use kernels::{DType, Device, Error, IndexTensor, Tensor};
use std::process::ExitCode;

const U: f64 = 1.0 / (1u64 << 24) as f64;

/// `(N, C, H, W)`.
type Dims = (usize, usize, usize, usize);

/// Offset of `(n, c, h, w)` in a tensor of `(N, C, H, W)` in layout `l`.
fn at(l: Layout2d, (_, c, h, w): Dims, (nn, cc, hh, ww): Dims) -> usize {
    match l {
        Layout2d::Nchw => ((nn * c + cc) * h + hh) * w + ww,
        Layout2d::Nhwc => ((nn * h + hh) * w + ww) * c + cc,
    }
}

/// PyTorch's output length.
fn out_len(len: usize, k: usize, s: usize, p: usize, ceil: bool) -> usize {
    let span = (len + 2 * p - k) as i64;
    let s = s as i64;
    let mut o = if ceil { (span + s - 1) / s + 1 } else { span / s + 1 };
    if ceil && (o - 1) * s >= (len + p) as i64 {
        o -= 1;
    }
    o as usize
}

/// Window `o`'s rows: clipped to the input, and its size clipped to `len + p`.
fn window(o: usize, k: usize, s: usize, p: usize, len: usize) -> (usize, usize, usize) {
    let start = (o * s) as i64 - p as i64;
    let end = (start + k as i64).min((len + p) as i64);
    (start.max(0) as usize, end.min(len as i64) as usize, (end - start) as usize)
}

struct Case {
    dims: Dims,
    k: (usize, usize),
    s: (usize, usize),
    p: (usize, usize),
    ceil: bool,
}

fn cases() -> Vec<Case> {
    let c = |dims, k, s, p, ceil| Case { dims, k, s, p, ceil };
    let mut v = vec![
        c((1, 1, 1, 1), (1, 1), (1, 1), (0, 0), false),
        c((2, 3, 7, 7), (3, 3), (2, 2), (1, 1), false),
        c((1, 2, 5, 5), (2, 2), (2, 2), (0, 0), true),
        c((2, 5, 11, 13), (3, 2), (2, 3), (1, 1), true),
        c((3, 4, 9, 6), (5, 3), (1, 2), (2, 1), false),
        c((1, 3, 4, 4), (2, 2), (2, 2), (1, 1), true),
        c((2, 1, 1, 7), (1, 3), (1, 2), (0, 1), false),
        c((1, 17, 3, 5), (3, 3), (3, 3), (1, 1), true),
        c((2, 3, 8, 8), (2, 2), (2, 2), (0, 0), false),
        c((1, 2, 13, 13), (7, 7), (3, 3), (3, 3), true),
    ];
    if !sanitizer() {
        // ResNet's stem pool.
        v.push(c((4, 64, 112, 112), (3, 3), (2, 2), (1, 1), false));
    }
    v
}

fn opts_of(cs: &Case, l: Layout2d, include_pad: bool) -> Pool2dOpts {
    Pool2dOpts {
        kernel: cs.k,
        stride: cs.s,
        padding: cs.p,
        ceil_mode: cs.ceil,
        count_include_pad: include_pad,
        layout: l,
    }
}

fn shape(l: Layout2d, (n, c, h, w): Dims) -> Vec<usize> {
    match l {
        Layout2d::Nchw => vec![n, c, h, w],
        Layout2d::Nhwc => vec![n, h, w, c],
    }
}

fn f32s(t: &Tensor) -> Result<Vec<f32>, String> {
    t.to_f32_vec().map_err(e)
}

fn bits(t: &Tensor) -> Result<Vec<u32>, String> {
    Ok(f32s(t)?.into_iter().map(f32::to_bits).collect())
}

/// Every output position `(n, c, oh, ow)` with its offset, in the output's layout.
fn outputs(l: Layout2d, (n, c, _, _): Dims, oh: usize, ow: usize) -> Vec<(Dims, usize)> {
    let mut v = Vec::with_capacity(n * c * oh * ow);
    for nn in 0..n {
        for cc in 0..c {
            for a in 0..oh {
                for b in 0..ow {
                    v.push(((nn, cc, a, b), at(l, (n, c, oh, ow), (nn, cc, a, b))));
                }
            }
        }
    }
    v
}

fn max_pool_case(dev: &Device, cs: &Case, l: Layout2d, dt: DType, seed: u64) -> Result<(), String> {
    let dims @ (n, c, h, w) = cs.dims;
    let what = format!("max_pool2d {dt:?} {l:?} {dims:?} k {:?} s {:?} p {:?} ceil {}", cs.k, cs.s, cs.p, cs.ceil);
    let mut rng = TestRng::new(seed);
    let xs = draw(&mut rng, n * c * h * w, dt, Draw::NORMAL);
    let x = tensor(dev, &xs, &shape(l, dims), dt)?;
    let opts = opts_of(cs, l, true);
    let (y, idx) = ops::max_pool2d(&x, &opts).map_err(|err| format!("{what}: {err}"))?;
    let (oh, ow) = (out_len(h, cs.k.0, cs.s.0, cs.p.0, cs.ceil), out_len(w, cs.k.1, cs.s.1, cs.p.1, cs.ceil));
    if y.shape() != shape(l, (n, c, oh, ow)) || idx.shape() != y.shape() {
        return Err(format!("{what}: output {:?}, indices {:?}", y.shape(), idx.shape()));
    }
    let (yg, ig) = (f32s(&y)?, idx.to_vec().map_err(e)?);
    for ((nn, cc, a, b), o) in outputs(l, dims, oh, ow) {
        let (h0, h1, _) = window(a, cs.k.0, cs.s.0, cs.p.0, h);
        let (w0, w1, _) = window(b, cs.k.1, cs.s.1, cs.p.1, w);
        let (mut best, mut max) = (h0 * w + w0, f32::NEG_INFINITY);
        for r in h0..h1 {
            for q in w0..w1 {
                let v = xs[at(l, dims, (nn, cc, r, q))];
                if v > max || v.is_nan() {
                    max = v;
                    best = r * w + q;
                }
            }
        }
        let same = yg[o].to_bits() == max.to_bits() || (yg[o].is_nan() && max.is_nan());
        if !same || ig[o] != best as i64 {
            return Err(format!(
                "{what}: output ({nn}, {cc}, {a}, {b}): got {} at {}, want {max} at {best}",
                yg[o], ig[o]
            ));
        }
    }
    // Backward: the gather of the windows whose index is each element.
    let gs = draw(&mut rng, yg.len(), dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let g = tensor(dev, &gs, y.shape(), dt)?;
    let dx = ops::max_pool2d_backward(&g, &idx, x.shape(), &opts).map_err(|err| format!("{what}: backward: {err}"))?;
    let mut want = vec![0.0f64; xs.len()];
    let mut mag = vec![0.0f64; xs.len()];
    let mut cnt = vec![0usize; xs.len()];
    for ((nn, cc, _, _), o) in outputs(l, dims, oh, ow) {
        let i = ig[o] as usize;
        let e = at(l, dims, (nn, cc, i / w, i % w));
        want[e] += gs[o] as f64;
        mag[e] += (gs[o] as f64).abs();
        cnt[e] += 1;
    }
    let tol = |i: usize| Tol { rtol: 0.0, atol: cnt[i].saturating_sub(1) as f64 * U * mag[i] };
    compare(&format!("{what}: dx"), dt, &f32s(&dx)?, &want, tol, |_| None, |i| format!("element {i}"))?;
    let again = ops::max_pool2d_backward(&g, &idx, x.shape(), &opts).map_err(e)?;
    if bits(&again)? != bits(&dx)? {
        return Err(format!("{what}: two backward runs differ"));
    }
    Ok(())
}

fn avg_pool_case(dev: &Device, cs: &Case, l: Layout2d, dt: DType, include_pad: bool, seed: u64) -> Result<(), String> {
    let dims @ (n, c, h, w) = cs.dims;
    let what = format!(
        "avg_pool2d {dt:?} {l:?} {dims:?} k {:?} s {:?} p {:?} ceil {} include_pad {include_pad}",
        cs.k, cs.s, cs.p, cs.ceil
    );
    let mut rng = TestRng::new(seed);
    let xs = draw(&mut rng, n * c * h * w, dt, Draw::FINITE);
    let x = tensor(dev, &xs, &shape(l, dims), dt)?;
    let opts = opts_of(cs, l, include_pad);
    let y = ops::avg_pool2d(&x, &opts).map_err(|err| format!("{what}: {err}"))?;
    let (oh, ow) = (out_len(h, cs.k.0, cs.s.0, cs.p.0, cs.ceil), out_len(w, cs.k.1, cs.s.1, cs.p.1, cs.ceil));
    if y.shape() != shape(l, (n, c, oh, ow)) {
        return Err(format!("{what}: output {:?}", y.shape()));
    }
    let divisor = |a: usize, b: usize| {
        let (h0, h1, sh) = window(a, cs.k.0, cs.s.0, cs.p.0, h);
        let (w0, w1, sw) = window(b, cs.k.1, cs.s.1, cs.p.1, w);
        (if include_pad { sh * sw } else { (h1 - h0) * (w1 - w0) }) as f64
    };
    let outs = outputs(l, dims, oh, ow);
    let mut want = vec![0.0f64; outs.len()];
    let mut tols = vec![0.0f64; outs.len()];
    for &((nn, cc, a, b), o) in &outs {
        let (h0, h1, _) = window(a, cs.k.0, cs.s.0, cs.p.0, h);
        let (w0, w1, _) = window(b, cs.k.1, cs.s.1, cs.p.1, w);
        let (mut s, mut m) = (0.0, 0.0);
        for r in h0..h1 {
            for q in w0..w1 {
                let v = xs[at(l, dims, (nn, cc, r, q))] as f64;
                s += v;
                m += v.abs();
            }
        }
        let d = divisor(a, b);
        want[o] = s / d;
        tols[o] = ((h1 - h0) * (w1 - w0)).saturating_sub(1) as f64 * U * m / d;
    }
    let tol = |i: usize| Tol { rtol: U, atol: tols[i] };
    compare(&format!("{what}: y"), dt, &f32s(&y)?, &want, tol, |_| None, |i| format!("output {i}"))?;
    // Backward: each element gathers dy / divisor of the windows that contain it.
    let gs = draw(&mut rng, outs.len(), dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let g = tensor(dev, &gs, y.shape(), dt)?;
    let dx = ops::avg_pool2d_backward(&g, x.shape(), &opts).map_err(|err| format!("{what}: backward: {err}"))?;
    let mut want = vec![0.0f64; xs.len()];
    let mut mag = vec![0.0f64; xs.len()];
    let mut cnt = vec![0usize; xs.len()];
    for &((nn, cc, a, b), o) in &outs {
        let (h0, h1, _) = window(a, cs.k.0, cs.s.0, cs.p.0, h);
        let (w0, w1, _) = window(b, cs.k.1, cs.s.1, cs.p.1, w);
        let t = gs[o] as f64 / divisor(a, b);
        for r in h0..h1 {
            for q in w0..w1 {
                let e = at(l, dims, (nn, cc, r, q));
                want[e] += t;
                mag[e] += t.abs();
                cnt[e] += 1;
            }
        }
    }
    // Each term's division (u of it), then the sum.
    let tol = |i: usize| Tol { rtol: 0.0, atol: cnt[i] as f64 * U * mag[i] };
    compare(&format!("{what}: dx"), dt, &f32s(&dx)?, &want, tol, |_| None, |i| format!("element {i}"))?;
    let again = ops::avg_pool2d_backward(&g, x.shape(), &opts).map_err(e)?;
    if bits(&again)? != bits(&dx)? {
        return Err(format!("{what}: two backward runs differ"));
    }
    Ok(())
}

fn max_pool_matches_f64(dev: &Device) -> Result<(), String> {
    let mut seed = 1;
    for dt in DType::ALL {
        for l in [Layout2d::Nchw, Layout2d::Nhwc] {
            for cs in cases() {
                seed += 1;
                max_pool_case(dev, &cs, l, dt, seed)?;
            }
        }
    }
    Ok(())
}

fn avg_pool_matches_f64(dev: &Device) -> Result<(), String> {
    let mut seed = 1000;
    for dt in DType::ALL {
        for l in [Layout2d::Nchw, Layout2d::Nhwc] {
            for cs in cases() {
                for include_pad in [true, false] {
                    seed += 1;
                    avg_pool_case(dev, &cs, l, dt, include_pad, seed)?;
                }
            }
        }
    }
    Ok(())
}

/// A window of NaN among larger values gives NaN (with the last NaN's index); -inf everywhere
/// gives -inf at the window's first element.
fn max_pool_nan_wins(dev: &Device) -> Result<(), String> {
    let xs = [1.0, f32::NAN, 5.0, f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY];
    let x = tensor(dev, &xs, &[1, 2, 2, 2], DType::F32)?;
    let (y, idx) = ops::max_pool2d(&x, &Pool2dOpts::new(2)).map_err(e)?;
    let (yv, iv) = (f32s(&y)?, idx.to_vec().map_err(e)?);
    if !yv[0].is_nan() || iv[0] != 3 || yv[1] != f32::NEG_INFINITY || iv[1] != 0 {
        return Err(format!("got {yv:?} at {iv:?}, want [NaN, -inf] at [3, 0]"));
    }
    Ok(())
}

fn global_avg_pool_matches_f64(dev: &Device) -> Result<(), String> {
    let mut seed = 2000;
    let mut dims_list = vec![(1, 1, 1, 1), (2, 3, 7, 7), (2, 5, 33, 31), (3, 1, 1, 100), (4, 64, 7, 7)];
    if !sanitizer() {
        dims_list.extend([(8, 2048, 7, 7), (2, 64, 56, 56)]);
    }
    for dt in DType::ALL {
        for l in [Layout2d::Nchw, Layout2d::Nhwc] {
            for &dims in &dims_list {
                seed += 1;
                let (n, c, h, w) = dims;
                let what = format!("global_avg_pool2d {dt:?} {l:?} {dims:?}");
                let mut rng = TestRng::new(seed);
                let xs = draw(&mut rng, n * c * h * w, dt, Draw::FINITE);
                let x = tensor(dev, &xs, &shape(l, dims), dt)?;
                let y = ops::global_avg_pool2d(&x, l).map_err(|err| format!("{what}: {err}"))?;
                if y.shape() != shape(l, (n, c, 1, 1)) {
                    return Err(format!("{what}: output {:?}", y.shape()));
                }
                let hw = (h * w) as f64;
                let mut want = vec![0.0f64; n * c];
                let mut mag = vec![0.0f64; n * c];
                for nn in 0..n {
                    for cc in 0..c {
                        for r in 0..h {
                            for q in 0..w {
                                let v = xs[at(l, dims, (nn, cc, r, q))] as f64;
                                want[nn * c + cc] += v / hw;
                                mag[nn * c + cc] += v.abs() / hw;
                            }
                        }
                    }
                }
                // A sum of hw terms (in whatever order: lanes, then a butterfly), then the division.
                let tol = |i: usize| Tol { rtol: U, atol: (hw - 1.0) * U * mag[i] };
                compare(&what, dt, &f32s(&y)?, &want, tol, |_| None, |i| format!("plane {i}"))?;
                let gs = draw(&mut rng, n * c, dt, Draw { scale: 1.0, positive: false, special: 0.0 });
                let g = tensor(dev, &gs, y.shape(), dt)?;
                let dx = ops::global_avg_pool2d_backward(&g, x.shape(), l).map_err(e)?;
                let mut want = vec![0.0f64; xs.len()];
                for nn in 0..n {
                    for cc in 0..c {
                        for r in 0..h {
                            for q in 0..w {
                                want[at(l, dims, (nn, cc, r, q))] = gs[nn * c + cc] as f64 / hw;
                            }
                        }
                    }
                }
                let tol = |_| Tol { rtol: U, atol: 0.0 };
                compare(&format!("{what}: dx"), dt, &f32s(&dx)?, &want, tol, |_| None, |i| format!("element {i}"))?;
            }
        }
    }
    Ok(())
}

fn errors(dev: &Device) -> Result<(), String> {
    let x = tensor(dev, &[1.0; 2 * 3 * 5 * 5], &[2, 3, 5, 5], DType::F32)?;
    let invalid = |r: kernels::Result<Tensor>, what: &str| match r {
        Err(Error::InvalidArgument { .. }) => Ok(()),
        other => Err(format!("{what}: want InvalidArgument, got {:?}", other.map(|t| t.shape().to_vec()))),
    };
    let mut o = Pool2dOpts::new(3);
    o.padding = (2, 2);
    invalid(ops::avg_pool2d(&x, &o), "padding above half the kernel")?;
    invalid(ops::max_pool2d(&x, &o).map(|r| r.0), "max: padding above half the kernel")?;
    invalid(ops::avg_pool2d(&x, &Pool2dOpts::new(0)), "kernel 0")?;
    invalid(ops::avg_pool2d(&x, &Pool2dOpts::new(6)), "kernel larger than the input")?;
    invalid(ops::avg_pool2d(&x.clone().reshape(&[6, 5, 5]).map_err(e)?, &Pool2dOpts::new(2)), "rank 3")?;
    let mut s0 = Pool2dOpts::new(2);
    s0.stride = (0, 1);
    invalid(ops::avg_pool2d(&x, &s0), "stride 0")?;
    let o2 = Pool2dOpts::new(2);
    let g = tensor(dev, &[1.0; 2 * 3 * 3 * 3], &[2, 3, 3, 3], DType::F32)?;
    match ops::avg_pool2d_backward(&g, &[2, 3, 5, 5], &o2) {
        Err(Error::ShapeMismatch { .. }) => {}
        other => return Err(format!("avg grad of the wrong shape: {:?}", other.map(|t| t.shape().to_vec()))),
    }
    let idx = IndexTensor::zeros(dev, &[2, 3, 2, 2]).map_err(e)?;
    match ops::max_pool2d_backward(&g, &idx, &[2, 3, 5, 5], &o2) {
        Err(Error::ShapeMismatch { .. }) => {}
        other => return Err(format!("max grad of the wrong shape: {:?}", other.map(|t| t.shape().to_vec()))),
    }
    let g1 = tensor(dev, &[1.0; 6], &[2, 3, 1, 1], DType::F32)?;
    match ops::global_avg_pool2d_backward(&g1, &[2, 5, 5, 3], Layout2d::Nchw) {
        Err(Error::ShapeMismatch { .. }) => {}
        other => return Err(format!("global grad of the wrong shape: {:?}", other.map(|t| t.shape().to_vec()))),
    }
    // Empty batches give empty outputs.
    let x0 = Tensor::zeros(dev, &[0, 3, 5, 5], DType::BF16).map_err(e)?;
    let (y0, _) = ops::max_pool2d(&x0, &o2).map_err(e)?;
    let g0 = ops::global_avg_pool2d(&x0, Layout2d::Nchw).map_err(e)?;
    if y0.shape() != [0, 3, 2, 2] || g0.shape() != [0, 3, 1, 1] {
        return Err(format!("N = 0: {:?} {:?}", y0.shape(), g0.shape()));
    }
    Ok(())
}

fn main() -> ExitCode {
    run(vec![
        test("max_pool_matches_f64", max_pool_matches_f64),
        test("max_pool_nan_wins", max_pool_nan_wins),
        test("avg_pool_matches_f64", avg_pool_matches_f64),
        test("global_avg_pool_matches_f64", global_avg_pool_matches_f64),
        test("errors", errors),
    ])
}
