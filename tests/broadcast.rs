//! GPU tests of broadcasting and permutes (`broadcast_to`, `sum_to`, `permute`, and `binary` /
//! `binary_backward` on operands of different shapes), every dtype, ranks 0 to 4, sizes of 0 and
//! 1 and primes:
//! - copies (`broadcast_to`, `permute`) against the host's index arithmetic, bit for bit;
//! - `sum_to` against the f64 sum of the same stored values, within `gamma(n) sum |x|` (f32
//!   adding `n` terms in order) plus half an ulp of the dtype (the one rounding at the end);
//! - a broadcast `binary` bit for bit against `binary` on operands expanded on the host (the
//!   same-shape kernel, itself checked against f64 in `tests/elementwise.rs`); its backward
//!   against the f64 sums of that kernel's same-shape gradients, within the same bound.

mod common;

use common::*;
use kernels::ops::{self, BinaryOp};
use kernels::{DType, Device, Error, Tensor};
use std::process::ExitCode;

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

fn unflat(i: usize, shape: &[usize]) -> Vec<usize> {
    strides(shape).iter().zip(shape).map(|(&st, &n)| (i / st) % n.max(1)).collect()
}

/// The flat index in `small` (right-aligned, broadcast) of the multi-index `idx` of the larger
/// shape.
fn source(idx: &[usize], small: &[usize]) -> usize {
    let lead = idx.len() - small.len();
    small.iter().zip(strides(small)).enumerate().map(|(d, (&n, s))| if n == 1 { 0 } else { idx[lead + d] * s }).sum()
}

/// A full shape and two operand shapes that broadcast to it: leading dimensions dropped and
/// dimensions set to 1 at random.
fn shapes(rng: &mut TestRng) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let rank = rng.below(5);
    let sizes = [0, 1, 2, 3, 5, 7, 13];
    let full: Vec<usize> =
        (0..rank).map(|_| if rng.below(10) == 0 { sizes[rng.below(2)] } else { sizes[2 + rng.below(5)] }).collect();
    let op = |rng: &mut TestRng| -> Vec<usize> {
        let drop = rng.below(rank + 1);
        full[drop..].iter().map(|&n| if rng.below(3) == 0 { 1 } else { n }).collect()
    };
    let (a, b) = (op(rng), op(rng));
    // The broadcast of the two may be smaller than `full` (both dropped dimensions or set 1).
    let full = ops::broadcast_shape(&a, &b).unwrap_or(full);
    (full, a, b)
}

fn values(rng: &mut TestRng, n: usize, dt: DType) -> Vec<f32> {
    (0..n).map(|_| round_to(dt, rng.normal() as f32)).collect()
}

fn bits_equal(what: &str, got: &Tensor, shape: &[usize], want: &[f32]) -> Result<(), String> {
    if got.shape() != shape {
        return Err(format!("{what}: shape {:?}, expected {shape:?}", got.shape()));
    }
    let g = got.to_f32_vec().map_err(e)?;
    match g.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits()) {
        None if g.len() == want.len() => Ok(()),
        None => Err(format!("{what}: {} elements, expected {}", g.len(), want.len())),
        Some(i) => Err(format!("{what}: [{i}] = {}, expected {}", g[i], want[i])),
    }
}

/// The sums of `v` (shape `full`) down to `small`, in f64, with each sum's absolute terms.
fn sums(v: &[f32], full: &[usize], small: &[usize]) -> (Vec<f64>, Vec<f64>, usize) {
    let m: usize = small.iter().product();
    let (mut s, mut a) = (vec![0.0; m], vec![0.0; m]);
    for (i, &x) in v.iter().enumerate() {
        let j = source(&unflat(i, full), small);
        s[j] += x as f64;
        a[j] += (x as f64).abs();
    }
    let per = v.len().checked_div(m).unwrap_or(0);
    (s, a, per)
}

/// `got` against the f64 sums `want` of `terms` terms each (absolute sums `abs`): f32 addition in
/// order errs by at most `gamma(terms) abs`, then one rounding to the dtype.
fn sums_close(what: &str, dt: DType, got: &Tensor, want: &[f64], abs: &[f64], terms: usize) -> Result<(), String> {
    let g = got.to_f32_vec().map_err(e)?;
    if g.len() != want.len() {
        return Err(format!("{what}: {} elements, expected {}", g.len(), want.len()));
    }
    let u = 2f64.powi(-24);
    let gamma = terms as f64 * u / (1.0 - terms as f64 * u);
    for i in 0..g.len() {
        let bound = gamma * abs[i] + ulp(dt, want[i].abs() + gamma * abs[i]) / 2.0;
        // Written so that NaN fails.
        let within = (g[i] as f64 - want[i]).abs() <= bound;
        if !within {
            return Err(format!("{what}: [{i}] = {}, expected {} (bound {bound:e})", g[i], want[i]));
        }
    }
    Ok(())
}

fn copies(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(21);
    for case in 0..cases(60) {
        let dt = DType::ALL[case as usize % 3];
        let (full, a, _) = shapes(&mut rng);
        let v = values(&mut rng, a.iter().product(), dt);
        let x = tensor(dev, &v, &a, dt)?;
        let want: Vec<f32> = (0..full.iter().product()).map(|i| v[source(&unflat(i, &full), &a)]).collect();
        bits_equal(
            &format!("broadcast_to {a:?} -> {full:?} ({dt:?})"),
            &x.broadcast_to(&full).map_err(e)?,
            &full,
            &want,
        )?;

        // A random permutation of `a`'s dimensions.
        let mut dims: Vec<usize> = (0..a.len()).collect();
        for i in (1..dims.len()).rev() {
            dims.swap(i, rng.below(i + 1));
        }
        let ps: Vec<usize> = dims.iter().map(|&d| a[d]).collect();
        let st = strides(&a);
        let want: Vec<f32> = (0..ps.iter().product())
            .map(|i| unflat(i, &ps).iter().zip(&dims).map(|(&k, &d)| k * st[d]).sum::<usize>())
            .map(|j| v[j])
            .collect();
        bits_equal(&format!("permute {dims:?} of {a:?}"), &x.permute(&dims).map_err(e)?, &ps, &want)?;
    }
    Ok(())
}

fn sum_to(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(22);
    for case in 0..cases(60) {
        let dt = DType::ALL[case as usize % 3];
        let (full, a, _) = shapes(&mut rng);
        let v = values(&mut rng, full.iter().product(), dt);
        let x = tensor(dev, &v, &full, dt)?;
        let got = x.sum_to(&a).map_err(e)?;
        if got.shape() != a {
            return Err(format!("sum_to {full:?} -> {a:?}: shape {:?}", got.shape()));
        }
        let (want, abs, per) = sums(&v, &full, &a);
        sums_close(&format!("sum_to {full:?} -> {a:?} ({dt:?})"), dt, &got, &want, &abs, per)?;
    }
    // Many terms into one: the whole tensor.
    let v = values(&mut rng, 100_003, DType::F32);
    let (want, abs, per) = sums(&v, &[100_003], &[1]);
    let got = tensor(dev, &v, &[100_003], DType::F32)?.sum_to(&[1]).map_err(e)?;
    sums_close("sum_to of 100003 into 1", DType::F32, &got, &want, &abs, per)
}

fn binary(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(23);
    for case in 0..cases(80) {
        let dt = DType::ALL[case as usize % 3];
        let op = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div][(case as usize / 3) % 4];
        let (full, sa, sb) = shapes(&mut rng);
        let va = values(&mut rng, sa.iter().product(), dt);
        let mut vb = values(&mut rng, sb.iter().product(), dt);
        if op == BinaryOp::Div {
            // Divisors away from 0: finite quotients and gradients.
            vb.iter_mut().for_each(|v| *v = round_to(dt, v.signum() * (0.5 + v.abs())));
        }
        let vg = values(&mut rng, full.iter().product(), dt);
        let (a, b, g) = (tensor(dev, &va, &sa, dt)?, tensor(dev, &vb, &sb, dt)?, tensor(dev, &vg, &full, dt)?);
        let expand = |v: &[f32], s: &[usize]| -> Vec<f32> {
            (0..full.iter().product()).map(|i| v[source(&unflat(i, &full), s)]).collect()
        };
        let (fa, fb) = (tensor(dev, &expand(&va, &sa), &full, dt)?, tensor(dev, &expand(&vb, &sb), &full, dt)?);
        let what = format!("{op:?} {sa:?} with {sb:?} ({dt:?})");

        let want = ops::binary(&fa, &fb, op).map_err(e)?.to_f32_vec().map_err(e)?;
        bits_equal(&format!("{what} forward"), &ops::binary(&a, &b, op).map_err(e)?, &full, &want)?;
        let mut out = nan_tensor(dev, &full, dt)?;
        ops::binary_out(&a, &b, op, &mut out).map_err(e)?;
        bits_equal(&format!("{what} binary_out"), &out, &full, &want)?;
        if sa == full {
            let mut x = a.try_clone().map_err(e)?;
            ops::binary_(&mut x, &b, op).map_err(e)?;
            bits_equal(&format!("{what} binary_"), &x, &full, &want)?;
        }

        let (ga, gb) = ops::binary_backward(&a, &b, &g, op).map_err(e)?;
        let (fga, fgb) = ops::binary_backward(&fa, &fb, &g, op).map_err(e)?;
        for (name, got, terms, s) in [("d/da", &ga, &fga, &sa), ("d/db", &gb, &fgb, &sb)] {
            if got.shape() != s.as_slice() {
                return Err(format!("{what} {name}: shape {:?}, expected {s:?}", got.shape()));
            }
            let t = terms.to_f32_vec().map_err(e)?;
            let (want, abs, per) = sums(&t, &full, s);
            sums_close(&format!("{what} {name}"), dt, got, &want, &abs, per)?;
        }
    }
    Ok(())
}

fn errors(dev: &Device) -> Result<(), String> {
    let x = Tensor::zeros(dev, &[2, 3], DType::F32).map_err(e)?;
    let y = Tensor::zeros(dev, &[3, 2], DType::F32).map_err(e)?;
    let row = Tensor::zeros(dev, &[3], DType::F32).map_err(e)?;
    let bad = |r: Result<Tensor, Error>, what: &str, ok: &dyn Fn(&Error) -> bool| match r {
        Err(err) if ok(&err) => Ok(()),
        other => Err(format!("{what}: {:?}", other.map(|t| t.shape().to_vec()))),
    };
    let shape = |e: &Error| matches!(e, Error::ShapeMismatch { .. });
    let inv = |e: &Error| matches!(e, Error::InvalidArgument { .. });
    bad(ops::binary(&x, &y, BinaryOp::Add), "[2, 3] + [3, 2]", &shape)?;
    bad(x.broadcast_to(&[3, 3]), "[2, 3] to [3, 3]", &shape)?;
    bad(x.broadcast_to(&[3]), "to a lower rank", &shape)?;
    bad(row.sum_to(&[2, 3]), "sum_to a larger shape", &shape)?;
    bad(x.permute(&[0, 0]), "permute repeating a dimension", &inv)?;
    bad(x.permute(&[1]), "permute of the wrong length", &inv)?;
    bad(Tensor::zeros(dev, &[1; 9], DType::F32).map_err(e)?.broadcast_to(&[2; 9]), "rank 9", &inv)?;
    let mut r = row.try_clone().map_err(e)?;
    if !matches!(ops::binary_(&mut r, &x, BinaryOp::Add), Err(Error::ShapeMismatch { .. })) {
        return Err("binary_ into an operand smaller than the broadcast shape".into());
    }
    let h = Tensor::zeros(dev, &[3], DType::F16).map_err(e)?;
    bad(ops::binary(&x, &h, BinaryOp::Mul), "two dtypes", &|e| matches!(e, Error::DTypeMismatch { .. }))?;
    Ok(())
}

fn main() -> ExitCode {
    run(vec![
        test("broadcast/copies", copies),
        test("broadcast/sum_to", sum_to),
        test("broadcast/binary", binary),
        test("broadcast/errors", errors),
    ])
}
