//! GPU tests of the index ops (`ops::index_select`, `index_add`, `index_select_backward`,
//! `gather`, `scatter_add`, `gather_backward`, their `_out` and in-place forms and methods) in
//! f32, f16 and bf16, and of `IndexTensor::randint`.
//!
//! - The gathers (`index_select`, `gather`) are copies: the output must hold the input's bits
//!   (NaN and infinities included). `_out` forms write into NaN tensors.
//! - The sums (`index_add`, `scatter_add` and the backward passes) are checked twice: bit for
//!   bit against their documented order (f32 from the target's value, or +0.0, adding the
//!   contributions in increasing index position, one rounding to the dtype), emulated on the
//!   CPU; and against the f64 sum within the bound of any f32 summation order of `c` additions,
//!   `gamma(c) (|base| + sum |terms|)`, plus half an ulp of the dtype. Repeated indices (all
//!   equal, two values) and three runs that must agree bit for bit check the determinism.
//! - The backward passes against finite differences of the forward (f32, a few elements each).
//! - Shapes: every dimension of ranks 1 to 4 and 8, sizes 0, 1 and primes, inner sizes that are
//!   and are not multiples of the vector width. Every allocation is poisoned with NaN, so an
//!   element a kernel does not write fails.
//! - Indices outside `[0, size)`, negative ones included, are `Error::InvalidArgument` naming a
//!   bad position, also where the output is empty; in-place targets are then unchanged.
//! - `randint`: every element against the CPU's Philox (`kernels_gpu::init::randint_at`), its
//!   range, and the counts of a small range against the uniform law.

mod common;

use common::*;
use kernels::ops;
use kernels::{DType, Device, Error, IndexTensor, Tensor};
use std::process::ExitCode;

/// A tensor's elements as raw bits (f16 and bf16 widened), exactly as stored.
fn raw(t: &Tensor) -> Result<Vec<u32>, String> {
    Ok(match t.dtype() {
        DType::F32 => t.to_vec::<f32>().map_err(e)?.into_iter().map(f32::to_bits).collect(),
        DType::F16 => t.to_vec::<half::f16>().map_err(e)?.into_iter().map(|x| x.to_bits() as u32).collect(),
        DType::BF16 => t.to_vec::<half::bf16>().map_err(e)?.into_iter().map(|x| x.to_bits() as u32).collect(),
    })
}

/// `x` rounded to `dt` (round to nearest even, as the kernels' conversions), as raw bits.
fn bits_of(dt: DType, x: f32) -> u32 {
    match dt {
        DType::F32 => x.to_bits(),
        DType::F16 => half::f16::from_f32(x).to_bits() as u32,
        DType::BF16 => half::bf16::from_f32(x).to_bits() as u32,
    }
}

/// Raw bits of `dt` as the f32 value (exact).
fn value_of(dt: DType, b: u32) -> f32 {
    match dt {
        DType::F32 => f32::from_bits(b),
        DType::F16 => half::f16::from_bits(b as u16).to_f32(),
        DType::BF16 => half::bf16::from_bits(b as u16).to_f32(),
    }
}

/// The same bits, or both NaN (the host's conversions need not keep a NaN's payload).
fn same(dt: DType, a: u32, b: u32) -> bool {
    a == b || (value_of(dt, a).is_nan() && value_of(dt, b).is_nan())
}

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

fn flat(c: &[usize], shape: &[usize]) -> usize {
    c.iter().zip(strides(shape)).map(|(&x, s)| x * s).sum()
}

/// Sizes of a dimension: mostly small primes and 1, sometimes 0.
fn size(rng: &mut TestRng) -> usize {
    const SIZES: [usize; 8] = [1, 2, 3, 5, 7, 13, 1, 3];
    if rng.below(12) == 0 { 0 } else { SIZES[rng.below(SIZES.len())] }
}

/// `n` indices in `[0, v)`: uniform, or from a few values (repeats), or all one value.
fn indices(rng: &mut TestRng, n: usize, v: usize) -> Vec<i64> {
    if v == 0 {
        return vec![0; n];
    }
    let few = 1 + rng.below(v.min(3));
    let mode = rng.below(3);
    let one = rng.below(v) as i64;
    (0..n)
        .map(|_| match mode {
            0 => rng.below(v) as i64,
            1 => (rng.below(few) * (v / few)) as i64,
            _ => one,
        })
        .collect()
}

/// Random values of `dt` with a few specials (±0, ±inf, NaN, denormals, huge).
fn values(rng: &mut TestRng, n: usize, dt: DType) -> Vec<f32> {
    draw(rng, n, dt, Draw { scale: 2.0, positive: false, special: 0.02 })
}

fn idx_tensor(dev: &Device, idx: &[i64], shape: &[usize]) -> Result<IndexTensor, String> {
    IndexTensor::from_slice(dev, idx, shape).map_err(e)
}

/// Bits of `got` against `want`, the first difference reported.
fn same_bits(what: &str, dt: DType, got: &Tensor, shape: &[usize], want: &[u32]) -> Result<(), String> {
    if got.shape() != shape || got.dtype() != dt {
        return Err(format!("{what}: got {:?} {:?}, expected {shape:?} {dt:?}", got.shape(), got.dtype()));
    }
    let g = raw(got)?;
    if g.len() != want.len() {
        return Err(format!("{what}: {} elements, expected {}", g.len(), want.len()));
    }
    match (0..g.len()).find(|&k| !same(dt, g[k], want[k])) {
        None => Ok(()),
        Some(k) => Err(format!("{what}: element {k}: want {:#x}, got {:#x}", want[k], g[k])),
    }
}

/// The reference of a sum: for each output element its base (`None`: +0.0) and its terms in
/// the documented order.
struct Sums {
    base: Option<Vec<f32>>,
    terms: Vec<Vec<f32>>,
}

impl Sums {
    fn new(n: usize, base: Option<Vec<f32>>) -> Sums {
        Sums { base, terms: vec![Vec::new(); n] }
    }

    /// Checks `got` bit for bit against the documented order and within the f64 bound.
    fn check(&self, what: &str, dt: DType, got: &Tensor, shape: &[usize]) -> Result<(), String> {
        if got.shape() != shape || got.dtype() != dt {
            return Err(format!("{what}: got {:?} {:?}, expected {shape:?} {dt:?}", got.shape(), got.dtype()));
        }
        let g = raw(got)?;
        if g.len() != self.terms.len() {
            return Err(format!("{what}: {} elements, expected {}", g.len(), self.terms.len()));
        }
        let u = 2f64.powi(-24);
        for (q, terms) in self.terms.iter().enumerate() {
            let b = self.base.as_ref().map_or(0.0, |v| v[q]);
            // The documented order, in f32.
            let mut acc = b;
            for &t in terms {
                acc += t;
            }
            let want = bits_of(dt, acc);
            if !same(dt, g[q], want) {
                return Err(format!(
                    "{what}: element {q} ({} terms): want {want:#x} (the documented order), got {:#x}",
                    terms.len(),
                    g[q]
                ));
            }
            // Any f32 order: within gamma(c) of the exact sum for c additions, then one rounding.
            let all = std::iter::once(b).chain(terms.iter().copied());
            if all.clone().any(|t| !t.is_finite()) || !acc.is_finite() {
                continue;
            }
            let x = value_of(dt, g[q]) as f64;
            if !x.is_finite() {
                continue; // a finite f32 sum beyond the dtype's range: only its bits count (above)
            }
            let s: f64 = all.clone().map(|t| t as f64).sum();
            let abs: f64 = all.map(|t| (t as f64).abs()).sum();
            let c = terms.len() as f64;
            let bound = c * u / (1.0 - c * u) * abs;
            let half_ulp = if dt == DType::F32 { 0.0 } else { 0.5 * ulp(dt, s.abs() + bound) };
            if (x - s).abs() > bound + half_ulp {
                return Err(format!("{what}: element {q}: {x:e} is off the f64 sum {s:e} by more than {bound:e}"));
            }
        }
        Ok(())
    }
}

// --- index_select and index_add ---------------------------------------------------------------

/// A shape of rank 1 to 4 and a dimension in it; the inner product sometimes a multiple of
/// the vector widths.
fn shape_and_dim(rng: &mut TestRng) -> (Vec<usize>, usize) {
    let rank = 1 + rng.below(4);
    let mut s: Vec<usize> = (0..rank).map(|_| size(rng)).collect();
    let dim = rng.below(rank);
    if dim + 1 < rank && rng.below(3) == 0 {
        s[rank - 1] = [8, 16, 64, 4099][rng.below(4)];
    }
    (s, dim)
}

fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (shape[..dim].iter().product(), shape[dim], shape[dim + 1..].iter().product())
}

fn with_dim(shape: &[usize], dim: usize, n: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    s[dim] = n;
    s
}

fn index_select_case(dev: &Device, rng: &mut TestRng, dt: DType, shape: &[usize], dim: usize) -> Result<(), String> {
    let (outer, v, inner) = around(shape, dim);
    let n = if rng.below(8) == 0 { 0 } else { size(rng) * (1 + rng.below(3)) };
    let n = if v == 0 { 0 } else { n };
    let idx = indices(rng, n, v);
    let xs = values(rng, shape.iter().product(), dt);
    let x = tensor(dev, &xs, shape, dt)?;
    let xb = raw(&x)?;
    let it = idx_tensor(dev, &idx, &[n])?;
    let what = format!("index_select {dt:?} {shape:?} dim {dim} n {n}");
    let out_shape = with_dim(shape, dim, n);
    let mut want = Vec::with_capacity(outer * n * inner);
    for a in 0..outer {
        for &r in &idx {
            want.extend_from_slice(&xb[(a * v + r as usize) * inner..][..inner]);
        }
    }
    let y = ops::index_select(&x, dim, &it).map_err(|err| format!("{what}: {err}"))?;
    same_bits(&what, dt, &y, &out_shape, &want)?;
    let mut out = nan_tensor(dev, &out_shape, dt)?;
    ops::index_select_out(&x, dim, &it, &mut out).map_err(e)?;
    same_bits(&format!("{what} (_out)"), dt, &out, &out_shape, &want)?;
    same_bits(&format!("{what} (method)"), dt, &x.index_select(dim, &it).map_err(e)?, &out_shape, &want)?;
    // A 0-d index: one slice, the dimension kept at size 1.
    if v > 0 {
        let r = rng.below(v);
        let y = ops::index_select(&x, dim, &idx_tensor(dev, &[r as i64], &[])?).map_err(e)?;
        let want: Vec<u32> = (0..outer).flat_map(|a| xb[(a * v + r) * inner..][..inner].to_vec()).collect();
        same_bits(&format!("{what} (0-d index)"), dt, &y, &with_dim(shape, dim, 1), &want)?;
    }
    Ok(())
}

fn index_select_copies(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(1);
    for case in 0..cases(150) {
        let dt = DType::ALL[case as usize % 3];
        let (shape, dim) = shape_and_dim(&mut rng);
        index_select_case(dev, &mut rng, dt, &shape, dim)?;
    }
    // Every dimension of one rank-4 shape, and larger ones (many rows, the vector path).
    for dt in DType::ALL {
        for dim in 0..4 {
            index_select_case(dev, &mut rng, dt, &[3, 5, 7, 2], dim)?;
        }
        index_select_case(dev, &mut rng, dt, &[37, 1031, 8], 1)?;
        index_select_case(dev, &mut rng, dt, &[5000, 64], 0)?;
        index_select_case(dev, &mut rng, dt, &[64, 2053], 1)?;
    }
    Ok(())
}

/// `index_add`, `index_add_`, `index_select_backward` of one case against the documented
/// order; returns the backward's bits.
fn index_add_case(
    dev: &Device,
    rng: &mut TestRng,
    dt: DType,
    shape: &[usize],
    dim: usize,
    idx: &[i64],
) -> Result<Vec<u32>, String> {
    let (outer, v, inner) = around(shape, dim);
    let n = idx.len();
    let src_shape = with_dim(shape, dim, n);
    let ss = values(rng, src_shape.iter().product(), dt);
    let ds = values(rng, shape.iter().product(), dt);
    let (src, dst) = (tensor(dev, &ss, &src_shape, dt)?, tensor(dev, &ds, shape, dt)?);
    let it = idx_tensor(dev, idx, &[n])?;
    let what = format!("index_add {dt:?} {shape:?} dim {dim} n {n}");
    let sums = |base: Option<Vec<f32>>| {
        let mut s = Sums::new(outer * v * inner, base);
        for a in 0..outer {
            for (j, &r) in idx.iter().enumerate() {
                for c in 0..inner {
                    s.terms[(a * v + r as usize) * inner + c].push(ss[(a * n + j) * inner + c]);
                }
            }
        }
        s
    };
    let with_base = sums(Some(ds.clone()));
    let y = ops::index_add(&dst, dim, &it, &src).map_err(|err| format!("{what}: {err}"))?;
    with_base.check(&what, dt, &y, shape)?;
    let mut d2 = dst.try_clone().map_err(e)?;
    d2.index_add_(dim, &it, &src).map_err(e)?;
    with_base.check(&format!("{what} (in place)"), dt, &d2, shape)?;
    same_bits(&format!("{what} (method)"), dt, &dst.index_add(dim, &it, &src).map_err(e)?, shape, &raw(&y)?)?;
    let g = ops::index_select_backward(&src, dim, &it, v).map_err(|err| format!("{what} backward: {err}"))?;
    sums(None).check(&format!("{what} (index_select_backward)"), dt, &g, shape)?;
    raw(&g)
}

fn index_add_sums(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(2);
    for case in 0..cases(150) {
        let dt = DType::ALL[case as usize % 3];
        let (shape, dim) = shape_and_dim(&mut rng);
        let v = shape[dim];
        let n = if v == 0 { 0 } else { size(&mut rng) * (1 + rng.below(4)) };
        let idx = indices(&mut rng, n, v);
        index_add_case(dev, &mut rng, dt, &shape, dim, &idx)?;
    }
    for dt in DType::ALL {
        for dim in 0..4 {
            let idx = indices(&mut rng, 11, [3, 5, 7, 2][dim]);
            index_add_case(dev, &mut rng, dt, &[3, 5, 7, 2], dim, &idx)?;
        }
        // One index repeated many times: the longest sums; the vector path and the scalar one.
        index_add_case(dev, &mut rng, dt, &[3, 7, 64], 1, &vec![4; 3001])?;
        index_add_case(dev, &mut rng, dt, &[5, 7, 9], 1, &vec![6; 2049])?;
        let idx = indices(&mut rng, 4099, 1000);
        index_add_case(dev, &mut rng, dt, &[2, 1000, 8], 1, &idx)?;
    }
    Ok(())
}

// --- gather and scatter_add -------------------------------------------------------------------

/// The input's shape, a dimension, and an index shape of the same rank no larger in the other
/// dimensions (any size along `dim`).
fn gather_shapes(rng: &mut TestRng, rank: usize) -> (Vec<usize>, usize, Vec<usize>) {
    let x: Vec<usize> = (0..rank).map(|_| size(rng)).collect();
    let dim = rng.below(rank);
    let i = (0..rank).map(|d| if d == dim { size(rng) } else { x[d] - rng.below(x[d].min(2) + 1).min(x[d]) }).collect();
    (x, dim, i)
}

fn gather_case(
    dev: &Device,
    rng: &mut TestRng,
    dt: DType,
    xs: &[usize],
    dim: usize,
    is: &[usize],
) -> Result<(), String> {
    let v = xs[dim];
    let n: usize = is.iter().product();
    let idx = indices(rng, if v == 0 { 0 } else { n }, v);
    if idx.len() != n {
        return Ok(()); // no valid index into an empty dimension
    }
    let xv = values(rng, xs.iter().product(), dt);
    let x = tensor(dev, &xv, xs, dt)?;
    let xb = raw(&x)?;
    let it = idx_tensor(dev, &idx, is)?;
    let what = format!("gather {dt:?} x {xs:?} dim {dim} idx {is:?}");
    let want: Vec<u32> = (0..n)
        .map(|p| {
            let mut c = unflat(p, is);
            c[dim] = idx[p] as usize;
            xb[flat(&c, xs)]
        })
        .collect();
    let y = ops::gather(&x, dim, &it).map_err(|err| format!("{what}: {err}"))?;
    same_bits(&what, dt, &y, is, &want)?;
    let mut out = nan_tensor(dev, is, dt)?;
    ops::gather_out(&x, dim, &it, &mut out).map_err(e)?;
    same_bits(&format!("{what} (_out)"), dt, &out, is, &want)?;
    same_bits(&format!("{what} (method)"), dt, &x.gather(dim, &it).map_err(e)?, is, &want)
}

fn gather_copies(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(3);
    for case in 0..cases(200) {
        let dt = DType::ALL[case as usize % 3];
        let rank = 1 + rng.below(4);
        let (xs, dim, is) = gather_shapes(&mut rng, rank);
        gather_case(dev, &mut rng, dt, &xs, dim, &is)?;
    }
    for dt in DType::ALL {
        for dim in 0..4 {
            gather_case(dev, &mut rng, dt, &[3, 5, 7, 2], dim, &[3, 5, 7, 2])?;
            gather_case(dev, &mut rng, dt, &[3, 5, 7, 2], dim, &with_dim(&[2, 4, 7, 1], dim, 11))?;
        }
        // The rank limit, and a cross-entropy-like pick of one class per row.
        gather_case(dev, &mut rng, dt, &[2, 3, 1, 2, 3, 2, 1, 2], 4, &[2, 2, 1, 1, 5, 2, 1, 2])?;
        gather_case(dev, &mut rng, dt, &[1031, 509], 1, &[1031, 1])?;
    }
    Ok(())
}

/// `scatter_add`, `scatter_add_`, and (where `src` is the index's shape) `gather_backward` of
/// one case against the documented order; returns the first's bits.
#[allow(clippy::too_many_arguments)]
fn scatter_case(
    dev: &Device,
    rng: &mut TestRng,
    dt: DType,
    ds: &[usize],
    dim: usize,
    is: &[usize],
    ss: &[usize],
    idx: &[i64],
) -> Result<Vec<u32>, String> {
    let n: usize = is.iter().product();
    let sv = values(rng, ss.iter().product(), dt);
    let dv = values(rng, ds.iter().product(), dt);
    let (src, dst) = (tensor(dev, &sv, ss, dt)?, tensor(dev, &dv, ds, dt)?);
    let it = idx_tensor(dev, idx, is)?;
    let what = format!("scatter_add {dt:?} dst {ds:?} dim {dim} idx {is:?} src {ss:?}");
    let sums = |base: Option<Vec<f32>>, src_shape: &[usize], vals: &[f32]| {
        let mut s = Sums::new(ds.iter().product(), base);
        for (p, &r) in idx.iter().enumerate() {
            let c = unflat(p, is);
            let t = vals[flat(&c, src_shape)];
            let mut c = c;
            c[dim] = r as usize;
            s.terms[flat(&c, ds)].push(t);
        }
        s
    };
    let with_base = sums(Some(dv.clone()), ss, &sv);
    let y = ops::scatter_add(&dst, dim, &it, &src).map_err(|err| format!("{what}: {err}"))?;
    with_base.check(&what, dt, &y, ds)?;
    let mut d2 = dst.try_clone().map_err(e)?;
    d2.scatter_add_(dim, &it, &src).map_err(e)?;
    with_base.check(&format!("{what} (in place)"), dt, &d2, ds)?;
    same_bits(&format!("{what} (method)"), dt, &dst.scatter_add(dim, &it, &src).map_err(e)?, ds, &raw(&y)?)?;
    // gather's backward: the gradient has the index's shape.
    let gv = values(rng, n, dt);
    let g = tensor(dev, &gv, is, dt)?;
    let gx = ops::gather_backward(&g, dim, &it, ds).map_err(|err| format!("{what} backward: {err}"))?;
    sums(None, is, &gv).check(&format!("{what} (gather_backward)"), dt, &gx, ds)?;
    raw(&y)
}

/// Shapes for a scatter: the output, a dimension, an index no larger than the output in the
/// other dimensions, a source no smaller than the index.
fn scatter_shapes(rng: &mut TestRng, rank: usize) -> (Vec<usize>, usize, Vec<usize>, Vec<usize>) {
    let (ds, dim, is) = gather_shapes(rng, rank);
    let ss = is.iter().map(|&i| i + rng.below(3) * (rng.below(2))).collect();
    (ds, dim, is, ss)
}

fn scatter_add_sums(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(4);
    for case in 0..cases(200) {
        let dt = DType::ALL[case as usize % 3];
        let rank = 1 + rng.below(4);
        let (ds, dim, is, ss) = scatter_shapes(&mut rng, rank);
        let n: usize = is.iter().product();
        if ds[dim] == 0 && n > 0 {
            continue;
        }
        let idx = indices(&mut rng, n, ds[dim]);
        scatter_case(dev, &mut rng, dt, &ds, dim, &is, &ss, &idx)?;
    }
    for dt in DType::ALL {
        for dim in 0..4 {
            let (ds, is) = ([3, 5, 7, 2], with_dim(&[2, 5, 4, 2], dim, 9));
            let idx = indices(&mut rng, is.iter().product(), ds[dim]);
            scatter_case(dev, &mut rng, dt, &ds, dim, &is, &with_dim(&[3, 6, 7, 2], dim, 10), &idx)?;
        }
        // Rank 8.
        let (ds, is) = ([2, 3, 1, 2, 3, 2, 1, 2], [2, 2, 1, 1, 5, 2, 1, 2]);
        let idx = indices(&mut rng, is.iter().product(), 3);
        scatter_case(dev, &mut rng, dt, &ds, 4, &is, &is, &idx)?;
        // Every element of a long line to one target; the gradient of a class pick.
        scatter_case(dev, &mut rng, dt, &[3, 11], 1, &[3, 4099], &[3, 4099], &vec![5; 3 * 4099])?;
        let is = [1031, 1];
        let idx = indices(&mut rng, 1031, 509);
        scatter_case(dev, &mut rng, dt, &[1031, 509], 1, &is, &is, &idx)?;
        // Along dimension 0 of a matrix, many rows into few.
        let idx = indices(&mut rng, 2053 * 3, 5);
        scatter_case(dev, &mut rng, dt, &[5, 7], 0, &[2053, 3], &[2053, 4], &idx)?;
    }
    Ok(())
}

fn sums_are_deterministic(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(5);
    let n = if sanitizer() { 300 } else { 20_000 };
    for dt in DType::ALL {
        let idx: Vec<i64> = (0..n).map(|_| rng.below(3) as i64).collect();
        let (ss, gv) = (values(&mut rng, n * 4, dt), values(&mut rng, n * 4, dt));
        let src = tensor(dev, &ss, &[4, n], dt)?;
        let g = tensor(dev, &gv, &[n, 4], dt)?;
        let it1 = idx_tensor(dev, &idx, &[n])?;
        let it2 = idx_tensor(dev, &idx.repeat(4), &[4, n])?;
        let run = || -> Result<(Vec<u32>, Vec<u32>), String> {
            let a = ops::index_select_backward(&g, 0, &it1, 3).map_err(e)?;
            let b = ops::gather_backward(&src, 1, &it2, &[4, 3]).map_err(e)?;
            Ok((raw(&a)?, raw(&b)?))
        };
        let first = run()?;
        for _ in 0..3 {
            if run()? != first {
                return Err(format!("{dt:?}: two runs of the sums differ"));
            }
        }
    }
    Ok(())
}

// --- finite differences -----------------------------------------------------------------------

/// `sum(f(x) * w)` in f64.
fn dot(y: &Tensor, w: &[f32]) -> Result<f64, String> {
    Ok(y.to_f32_vec().map_err(e)?.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64).sum())
}

/// The gradient `grad` of `sum(f(x) * w)` at a few elements of `x` against central
/// differences: f is linear, so the difference quotient (over the steps as stored in f32) is
/// exact up to the f64 sums.
#[allow(clippy::too_many_arguments)]
fn finite_differences(
    what: &str,
    dev: &Device,
    rng: &mut TestRng,
    xv: &[f32],
    shape: &[usize],
    w: &[f32],
    grad: &Tensor,
    f: impl Fn(&Tensor) -> kernels::Result<Tensor>,
) -> Result<(), String> {
    let gv = grad.to_f32_vec().map_err(e)?;
    for _ in 0..6.min(xv.len()) {
        let k = rng.below(xv.len());
        let at = |h: f32| -> Result<(f64, f64), String> {
            let mut v = xv.to_vec();
            v[k] += h;
            Ok((dot(&f(&tensor(dev, &v, shape, DType::F32)?).map_err(e)?, w)?, v[k] as f64))
        };
        let ((lp, xp), (lm, xm)) = (at(1.0)?, at(-1.0)?);
        let fd = (lp - lm) / (xp - xm);
        let abs: f64 = w.iter().map(|&x| (x as f64).abs()).sum();
        // The gradient's f32 sum of at most w.len() terms, and the f64 dots' rounding.
        let tol = (w.len() as f64 * 2f64.powi(-24) + 1e-12) * abs;
        if (fd - gv[k] as f64).abs() > tol {
            return Err(format!("{what}: element {k}: gradient {}, central difference {fd}", gv[k]));
        }
    }
    Ok(())
}

fn backward_matches_finite_differences(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(6);
    let dt = DType::F32;
    for (shape, dim) in [(vec![3, 5, 7], 1), (vec![4, 6], 0), (vec![2, 3, 13], 2)] {
        let xv: Vec<f32> = (0..shape.iter().product()).map(|_| rng.normal() as f32).collect();
        // index_select, repeated indices.
        let idx = indices(&mut rng, 9, shape[dim]);
        let it = idx_tensor(dev, &idx, &[9])?;
        let out_shape = with_dim(&shape, dim, 9);
        let w: Vec<f32> = (0..out_shape.iter().product()).map(|_| rng.normal() as f32).collect();
        let g = ops::index_select_backward(&tensor(dev, &w, &out_shape, dt)?, dim, &it, shape[dim]).map_err(e)?;
        let what = format!("index_select {shape:?} dim {dim}");
        finite_differences(&what, dev, &mut rng, &xv, &shape, &w, &g, |x| ops::index_select(x, dim, &it))?;
        // gather, an index as large as x.
        let n: usize = shape.iter().product();
        let idx = indices(&mut rng, n, shape[dim]);
        let it = idx_tensor(dev, &idx, &shape)?;
        let w: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
        let g = ops::gather_backward(&tensor(dev, &w, &shape, dt)?, dim, &it, &shape).map_err(e)?;
        let what = format!("gather {shape:?} dim {dim}");
        finite_differences(&what, dev, &mut rng, &xv, &shape, &w, &g, |x| ops::gather(x, dim, &it))?;
    }
    Ok(())
}

// --- errors -----------------------------------------------------------------------------------

/// An `Error::InvalidArgument` of `op` naming one of the positions `bad`.
fn names_bad<T: std::fmt::Debug>(what: &str, r: kernels::Result<T>, bad: &[usize]) -> Result<(), String> {
    match r {
        Err(Error::InvalidArgument { message, .. })
            if bad.iter().any(|p| message.contains(&format!("position {p} "))) =>
        {
            Ok(())
        }
        other => Err(format!("{what}: want InvalidArgument naming one of {bad:?}, got {other:?}")),
    }
}

fn out_of_range_indices_are_errors(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(7);
    for dt in DType::ALL {
        for bad_value in [-1i64, -7, 5, 6, i64::MIN, i64::MAX] {
            // One bad index among good ones, at a random position.
            let (shape, dim) = ([4, 5, 3], 1);
            let mut idx = indices(&mut rng, 7, 5);
            let at = rng.below(7);
            idx[at] = bad_value;
            let what = format!("{dt:?} index {bad_value} at {at}");
            let x = tensor(dev, &values(&mut rng, 60, dt), &shape, dt)?;
            let it = idx_tensor(dev, &idx, &[7])?;
            names_bad(&format!("index_select {what}"), ops::index_select(&x, dim, &it), &[at])?;
            let src = tensor(dev, &values(&mut rng, 84, dt), &[4, 7, 3], dt)?;
            names_bad(&format!("index_add {what}"), ops::index_add(&x, dim, &it, &src), &[at])?;
            names_bad(&format!("index_select_backward {what}"), ops::index_select_backward(&src, dim, &it, 5), &[at])?;
            // In place: left unchanged.
            let mut d = x.try_clone().map_err(e)?;
            names_bad(&format!("index_add_ {what}"), d.index_add_(dim, &it, &src), &[at])?;
            if raw(&d)? != raw(&x)? {
                return Err(format!("index_add_ {what}: the target changed"));
            }

            // gather / scatter_add: an index [4, 2, 3] into dimension 1 of size 5.
            let mut gi = indices(&mut rng, 24, 5);
            let gat = rng.below(24);
            gi[gat] = bad_value;
            let git = idx_tensor(dev, &gi, &[4, 2, 3])?;
            names_bad(&format!("gather {what}"), ops::gather(&x, dim, &git), &[gat])?;
            let gsrc = tensor(dev, &values(&mut rng, 24, dt), &[4, 2, 3], dt)?;
            names_bad(&format!("scatter_add {what}"), ops::scatter_add(&x, dim, &git, &gsrc), &[gat])?;
            names_bad(&format!("gather_backward {what}"), ops::gather_backward(&gsrc, dim, &git, &shape), &[gat])?;
            let mut d = x.try_clone().map_err(e)?;
            names_bad(&format!("scatter_add_ {what}"), d.scatter_add_(dim, &git, &gsrc), &[gat])?;
            if raw(&d)? != raw(&x)? {
                return Err(format!("scatter_add_ {what}: the target changed"));
            }
        }
        // No element to compute, still an index to check: an empty outer or inner dimension.
        let it = idx_tensor(dev, &[0, 2, 9], &[3])?;
        let x0 = Tensor::zeros(dev, &[0, 4], dt).map_err(e)?;
        names_bad("index_select of [0, 4]", ops::index_select(&x0, 1, &it), &[2])?;
        let s0 = Tensor::zeros(dev, &[0, 3], dt).map_err(e)?;
        names_bad("index_add of [0, 4]", ops::index_add(&x0, 1, &it, &s0), &[2])?;
        let x1 = Tensor::zeros(dev, &[4, 0], dt).map_err(e)?;
        names_bad("index_select of [4, 0]", ops::index_select(&x1, 0, &it), &[2])?;
        // Any index into a dimension of size 0.
        let x2 = Tensor::zeros(dev, &[2, 0], dt).map_err(e)?;
        let it1 = idx_tensor(dev, &[0, 0], &[2, 1])?;
        names_bad("gather from size 0", ops::gather(&x2, 1, &it1), &[0, 1])?;
        // Good indices with nothing to compute: empty results.
        let y = ops::index_select(&x0, 1, &idx_tensor(dev, &[0, 3], &[2])?).map_err(e)?;
        if y.shape() != [0, 2] {
            return Err(format!("index_select of [0, 4]: shape {:?}", y.shape()));
        }
    }
    Ok(())
}

fn shape_errors(dev: &Device) -> Result<(), String> {
    let dt = DType::F32;
    let x = tensor(dev, &[1.0; 24], &[2, 3, 4], dt)?;
    let i1 = idx_tensor(dev, &[0, 1], &[2])?;
    let i2 = idx_tensor(dev, &[0; 4], &[2, 2])?;
    let invalid = |what: &str, r: kernels::Result<Tensor>| match r {
        Err(Error::InvalidArgument { .. }) => Ok(()),
        other => Err(format!("{what}: want InvalidArgument, got {other:?}")),
    };
    let mismatch = |what: &str, r: kernels::Result<Tensor>| match r {
        Err(Error::ShapeMismatch { .. }) => Ok(()),
        other => Err(format!("{what}: want ShapeMismatch, got {other:?}")),
    };
    invalid("index_select dim 3", ops::index_select(&x, 3, &i1))?;
    invalid("index_select index of rank 2", ops::index_select(&x, 0, &i2))?;
    let scalar = tensor(dev, &[1.0], &[], dt)?;
    invalid("index_select of a scalar", ops::index_select(&scalar, 0, &i1))?;
    mismatch("index_add src", ops::index_add(&x, 1, &i1, &x))?;
    mismatch("index_select_backward grad", ops::index_select_backward(&x, 1, &i1, 5))?;
    // gather: rank of the index, an index larger than x in another dimension.
    mismatch("gather rank", ops::gather(&x, 0, &i2))?;
    let big = idx_tensor(dev, &[0; 2 * 4 * 4], &[2, 4, 4])?;
    mismatch("gather larger", ops::gather(&x, 2, &big))?;
    // scatter: src smaller than the index.
    let src = tensor(dev, &[1.0; 2 * 3 * 3], &[2, 3, 3], dt)?;
    mismatch("scatter_add src", ops::scatter_add(&x, 1, &big, &src))?;
    let nine = vec![1usize; 9];
    let x9 = tensor(dev, &[1.0], &nine, dt)?;
    invalid("gather rank 9", ops::gather(&x9, 0, &idx_tensor(dev, &[0], &nine)?))?;
    // dtypes and _out shapes.
    let xb = tensor(dev, &[1.0; 24], &[2, 3, 4], DType::BF16)?;
    match ops::index_add(&x, 1, &i1, &xb.narrow(1, 0, 2).map_err(e)?) {
        Err(Error::DTypeMismatch { .. }) => {}
        other => return Err(format!("index_add bf16 src: {other:?}")),
    }
    let mut out = nan_tensor(dev, &[2, 3, 3], dt)?;
    match ops::index_select_out(&x, 2, &i1, &mut out) {
        Err(Error::ShapeMismatch { .. }) => {}
        other => return Err(format!("index_select_out [2, 3, 3]: {other:?}")),
    }
    let mut out = nan_tensor(dev, &[2, 2], DType::F16)?;
    match ops::gather_out(&x.narrow(2, 0, 1).map_err(e)?.reshape(&[2, 3]).map_err(e)?, 1, &i2, &mut out) {
        Err(Error::DTypeMismatch { .. }) => Ok(()),
        other => Err(format!("gather_out f16: {other:?}")),
    }
}

// --- randint ----------------------------------------------------------------------------------

fn randint_matches_the_cpu(dev: &Device) -> Result<(), String> {
    use kernels_gpu::init::randint_at;
    for (low, high) in
        [(0i64, 1i64), (-5, 3), (0, 1000), (i64::MIN, i64::MAX), (i64::MAX - 2, i64::MAX), (-1 << 40, 1 << 41)]
    {
        for (shape, seed) in [(vec![0], 1u64), (vec![1], 2), (vec![1031], 3), (vec![3, 5, 7], 1 << 40)] {
            let t = IndexTensor::randint(dev, low, high, &shape, seed).map_err(e)?;
            if t.shape() != shape {
                return Err(format!("randint shape {:?}, expected {shape:?}", t.shape()));
            }
            let span = (high as i128 - low as i128) as u64;
            for (i, &v) in t.to_vec().map_err(e)?.iter().enumerate() {
                let want = randint_at(seed, i as u64, low, span);
                if v != want || v < low || v >= high {
                    return Err(format!(
                        "randint [{low}, {high}) seed {seed}: element {i} is {v}, the CPU computes {want}"
                    ));
                }
            }
        }
    }
    // Counts of [0, 10) over 2^20 draws: each within 6 standard deviations of n / 10.
    let n = 1usize << 20;
    let v = IndexTensor::randint(dev, 0, 10, &[n], 77).map_err(e)?.to_vec().map_err(e)?;
    let mut counts = [0f64; 10];
    v.iter().for_each(|&x| counts[x as usize] += 1.0);
    let (mean, sd) = (n as f64 / 10.0, (n as f64 * 0.1 * 0.9).sqrt());
    if counts.iter().any(|&c| (c - mean).abs() > 6.0 * sd) {
        return Err(format!("randint counts of [0, 10): {counts:?}"));
    }
    // The same seed, the same indices; another, others.
    let a = IndexTensor::randint(dev, 0, 1 << 30, &[100], 9).map_err(e)?.to_vec().map_err(e)?;
    let b = IndexTensor::randint(dev, 0, 1 << 30, &[100], 9).map_err(e)?.to_vec().map_err(e)?;
    let c = IndexTensor::randint(dev, 0, 1 << 30, &[100], 10).map_err(e)?.to_vec().map_err(e)?;
    if a != b || a == c {
        return Err("randint: the same seed must give the same indices, another seed others".into());
    }
    for (low, high) in [(0, 0), (5, 4), (i64::MAX, i64::MIN)] {
        match IndexTensor::randint(dev, low, high, &[3], 1) {
            Err(Error::InvalidArgument { .. }) => {}
            other => return Err(format!("randint [{low}, {high}): {other:?}")),
        }
    }
    // Usable as indices at once.
    let x = tensor(dev, &(0..50).map(|i| i as f32).collect::<Vec<_>>(), &[50], DType::F32)?;
    let it = IndexTensor::randint(dev, 0, 50, &[20], 3).map_err(e)?;
    let y = ops::index_select(&x, 0, &it).map_err(e)?.to_f32_vec().map_err(e)?;
    if y.iter().zip(it.to_vec().map_err(e)?).any(|(&a, b)| a != b as f32) {
        return Err("index_select of randint indices".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    run(vec![
        test("index_select_copies", index_select_copies),
        test("index_add_sums", index_add_sums),
        test("gather_copies", gather_copies),
        test("scatter_add_sums", scatter_add_sums),
        test("sums_are_deterministic", sums_are_deterministic),
        test("backward_matches_finite_differences", backward_matches_finite_differences),
        test("out_of_range_indices_are_errors", out_of_range_indices_are_errors),
        test("shape_errors", shape_errors),
        test("randint_matches_the_cpu", randint_matches_the_cpu),
    ])
}
