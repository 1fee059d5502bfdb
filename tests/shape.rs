//! GPU tests of slicing and joining (`narrow`, `split`, `chunk`, `cat`, `stack`, `arange`):
//! against the same index arithmetic on the host, for ranks 1 to 4, every dimension, every
//! dtype, sizes of 0 and 1 and primes; the copies are exact, so the comparison is bit for bit.
//! Outputs start NaN-filled under `KERNELS_POISON_ALLOC=1`, as in every suite run, so an element
//! the copy missed shows.

mod common;

use common::*;
use kernels::{DType, Device, Error, Tensor};
use std::process::ExitCode;

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// The multi-index of flat index `i`.
fn unflat(i: usize, shape: &[usize]) -> Vec<usize> {
    strides(shape).iter().zip(shape).map(|(&st, &n)| (i / st) % n.max(1)).collect()
}

fn flat(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(strides(shape)).map(|(a, s)| a * s).sum()
}

fn random_shape(rng: &mut TestRng) -> Vec<usize> {
    let rank = 1 + rng.below(4);
    let sizes = [0, 1, 2, 3, 5, 7, 13, 31];
    (0..rank).map(|_| if rng.below(8) == 0 { sizes[rng.below(2)] } else { sizes[2 + rng.below(6)] }).collect()
}

/// Distinct values exact in every dtype: small integers.
fn values(rng: &mut TestRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.below(255) as f32 - 127.0).collect()
}

fn same(what: &str, got: &Tensor, shape: &[usize], want: &[f32]) -> Result<(), String> {
    if got.shape() != shape {
        return Err(format!("{what}: shape {:?}, expected {shape:?}", got.shape()));
    }
    let g = got.to_f32_vec().map_err(e)?;
    match g.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits()) {
        None if g.len() == want.len() => Ok(()),
        None => Err(format!("{what}: {} elements, expected {}", g.len(), want.len())),
        Some(i) => Err(format!("{what}: [{i}] = {}, expected {} (shape {shape:?})", g[i], want[i])),
    }
}

fn narrow_split_chunk(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(11);
    for case in 0..cases(60) {
        let dt = DType::ALL[case as usize % 3];
        let shape = random_shape(&mut rng);
        let n: usize = shape.iter().product();
        let v = values(&mut rng, n);
        let x = Tensor::from_f32(dev, &v, &shape, dt).map_err(e)?;
        for dim in 0..shape.len() {
            let size = shape[dim];
            let start = rng.below(size + 1);
            let len = rng.below(size - start + 1);
            let mut oshape = shape.clone();
            oshape[dim] = len;
            let want: Vec<f32> = (0..oshape.iter().product())
                .map(|i| {
                    let mut idx = unflat(i, &oshape);
                    idx[dim] += start;
                    v[flat(&idx, &shape)]
                })
                .collect();
            let what = format!("narrow({dim}, {start}, {len}) of {shape:?} {dt:?}");
            same(&what, &x.narrow(dim, start, len).map_err(e)?, &oshape, &want)?;
            // split then cat gives the tensor back; chunk likewise.
            let cut = rng.below(size + 1);
            let parts = x.split(dim, &[cut, size - cut]).map_err(e)?;
            let back = Tensor::cat(&parts.iter().collect::<Vec<_>>(), dim).map_err(e)?;
            same(&format!("cat(split({dim}, [{cut}, ..])) of {shape:?}"), &back, &shape, &v)?;
            let k = 1 + rng.below(4);
            let chunks = x.chunk(k, dim).map_err(e)?;
            let each = size.div_ceil(k).max(1);
            let want_sizes: Vec<usize> =
                if size == 0 { vec![0] } else { (0..size.div_ceil(each)).map(|i| each.min(size - i * each)).collect() };
            let got_sizes: Vec<usize> = chunks.iter().map(|c| c.shape()[dim]).collect();
            if got_sizes != want_sizes {
                return Err(format!("chunk({k}, {dim}) of {shape:?}: sizes {got_sizes:?}, expected {want_sizes:?}"));
            }
            let back = Tensor::cat(&chunks.iter().collect::<Vec<_>>(), dim).map_err(e)?;
            same(&format!("cat(chunk({k}, {dim})) of {shape:?}"), &back, &shape, &v)?;
        }
    }
    Ok(())
}

fn cat_stack(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(12);
    for case in 0..cases(40) {
        let dt = DType::ALL[case as usize % 3];
        let base = random_shape(&mut rng);
        let dim = rng.below(base.len());
        let count = 1 + rng.below(4);
        let mut shapes = Vec::new();
        let mut vals = Vec::new();
        let mut ts = Vec::new();
        for _ in 0..count {
            let mut s = base.clone();
            s[dim] = [0, 1, 2, 5, 11][rng.below(5)];
            let v = values(&mut rng, s.iter().product());
            ts.push(Tensor::from_f32(dev, &v, &s, dt).map_err(e)?);
            shapes.push(s);
            vals.push(v);
        }
        let total: usize = shapes.iter().map(|s| s[dim]).sum();
        let mut oshape = base.clone();
        oshape[dim] = total;
        let want: Vec<f32> = (0..oshape.iter().product())
            .map(|i| {
                let mut idx = unflat(i, &oshape);
                let mut k = 0;
                while idx[dim] >= shapes[k][dim] {
                    idx[dim] -= shapes[k][dim];
                    k += 1;
                }
                vals[k][flat(&idx, &shapes[k])]
            })
            .collect();
        let refs: Vec<&Tensor> = ts.iter().collect();
        same(&format!("cat of {shapes:?} along {dim} ({dt:?})"), &Tensor::cat(&refs, dim).map_err(e)?, &oshape, &want)?;

        // stack: copies of one shape along a new dimension, anywhere in 0..=rank.
        let sdim = rng.below(base.len() + 1);
        let v0 = values(&mut rng, base.iter().product());
        let v1 = values(&mut rng, base.iter().product());
        let (a, b) =
            (Tensor::from_f32(dev, &v0, &base, dt).map_err(e)?, Tensor::from_f32(dev, &v1, &base, dt).map_err(e)?);
        let mut sshape = base.clone();
        sshape.insert(sdim, 2);
        let want: Vec<f32> = (0..sshape.iter().product())
            .map(|i| {
                let mut idx = unflat(i, &sshape);
                let which = idx.remove(sdim);
                [&v0, &v1][which][flat(&idx, &base)]
            })
            .collect();
        same(&format!("stack of {base:?} at {sdim}"), &Tensor::stack(&[&a, &b], sdim).map_err(e)?, &sshape, &want)?;
    }
    Ok(())
}

fn arange(dev: &Device) -> Result<(), String> {
    for (start, end, step, want) in [
        (0.0, 5.0, 1.0, vec![0.0, 1.0, 2.0, 3.0, 4.0]),
        (1.0, 2.0, 0.25, vec![1.0, 1.25, 1.5, 1.75]),
        (3.0, -1.0, -1.5, vec![3.0, 1.5, 0.0]),
        (3.0, -1.5, -1.5, vec![3.0, 1.5, 0.0]),
        (2.0, 2.0, 1.0, vec![]),
        (5.0, 0.0, 1.0, vec![]),
    ] {
        let t = Tensor::arange(dev, start, end, step, DType::F32).map_err(e)?;
        same(&format!("arange({start}, {end}, {step})"), &t, &[want.len()], &want)?;
    }
    let r = Tensor::arange(dev, 0.0, 1.0, 0.0, DType::F32);
    if !matches!(r, Err(Error::InvalidArgument { .. })) {
        return Err(format!("arange with step 0: {:?}", r.map(|t| t.shape().to_vec())));
    }
    Ok(())
}

fn errors(dev: &Device) -> Result<(), String> {
    let x = Tensor::zeros(dev, &[2, 3], DType::F32).map_err(e)?;
    let y = Tensor::zeros(dev, &[2, 4], DType::F32).map_err(e)?;
    let h = Tensor::zeros(dev, &[2, 3], DType::F16).map_err(e)?;
    let bad = |r: Result<Tensor, Error>, what: &str, ok: &dyn Fn(&Error) -> bool| match r {
        Err(err) if ok(&err) => Ok(()),
        other => Err(format!("{what}: {:?}", other.map(|t| t.shape().to_vec()))),
    };
    let inv = |e: &Error| matches!(e, Error::InvalidArgument { .. });
    bad(x.narrow(2, 0, 1), "narrow past the rank", &inv)?;
    bad(x.narrow(1, 2, 2), "narrow past the end", &inv)?;
    bad(x.narrow(1, usize::MAX, 2), "narrow start overflowing", &inv)?;
    bad(x.split(1, &[1, 1]).map(|_| x.clone()), "split sizes short", &inv)?;
    bad(x.chunk(0, 0).map(|_| x.clone()), "0 chunks", &inv)?;
    bad(Tensor::cat(&[], 0), "cat of nothing", &inv)?;
    bad(Tensor::cat(&[&x, &y], 0), "cat disagreeing off the dimension", &|e| matches!(e, Error::ShapeMismatch { .. }))?;
    bad(Tensor::cat(&[&x, &h], 0), "cat of two dtypes", &|e| matches!(e, Error::DTypeMismatch { .. }))?;
    bad(Tensor::stack(&[&x, &y], 0), "stack of two shapes", &|e| matches!(e, Error::ShapeMismatch { .. }))?;
    bad(Tensor::stack(&[&x], 3), "stack past the rank", &inv)?;
    // Joined along 1 they agree: [2, 7].
    let j = Tensor::cat(&[&x, &y], 1).map_err(e)?;
    if j.shape() != [2, 7] {
        return Err(format!("cat along 1: {:?}", j.shape()));
    }
    Ok(())
}

fn main() -> ExitCode {
    run(vec![
        test("shape/narrow_split_chunk", narrow_split_chunk),
        test("shape/cat_stack", cat_stack),
        test("shape/arange", arange),
        test("shape/errors", errors),
    ])
}
