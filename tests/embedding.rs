//! GPU tests of the embedding lookup (`ops::embedding`, `embedding_out`, `embedding_checked`) and
//! its backward (`ops::embedding_backward`, `embedding_backward_out`) in f32, f16 and bf16.
//!
//! The forward is a copy: its output must hold the weight's bits (NaN and infinities included),
//! and zeros for an index outside `[0, V)`. The backward is checked twice: bit for bit against
//! the documented order (f32 additions from +0.0 in increasing position, one rounding to the
//! dtype), emulated on the CPU, and against the f64 sum within the bound of any f32 summation
//! order, `gamma(c - 1) sum |g|` for `c` terms, plus half an ulp of the dtype. Sizes: no
//! indices, one, primes; D from 1 to 4096 + 3 (vector and scalar paths); V from 1 to 200000; all
//! indices equal (the backward's longest sum); `padding_idx`; two backward runs must agree bit
//! for bit. Every allocation is poisoned with NaN (and the `_out` targets are NaN tensors), so an
//! element a kernel does not write fails.

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

/// Whether raw bits of `dt` are a NaN.
fn is_nan(dt: DType, b: u32) -> bool {
    match dt {
        DType::F32 => f32::from_bits(b).is_nan(),
        DType::F16 => half::f16::from_bits(b as u16).is_nan(),
        DType::BF16 => half::bf16::from_bits(b as u16).is_nan(),
    }
}

/// The same bits, or both NaN (the host's conversions need not keep a NaN's payload).
fn same(dt: DType, a: u32, b: u32) -> bool {
    a == b || (is_nan(dt, a) && is_nan(dt, b))
}

/// `n` indices: mostly in `[0, v)`, with a fraction `bad` outside it (negative, `v`, far off).
fn indices(rng: &mut TestRng, n: usize, v: usize, bad: f64) -> Vec<i64> {
    (0..n)
        .map(|_| {
            if v == 0 || rng.unit() < bad {
                [-1, -7, v as i64, v as i64 + 3, i64::MIN, i64::MAX][rng.below(6)]
            } else {
                rng.below(v) as i64
            }
        })
        .collect()
}

/// The forward of one case, checked bit for bit; `idx_shape` flattens to `idx.len()`.
fn fwd_case(dev: &Device, dt: DType, v: usize, d: usize, idx: &[i64], idx_shape: &[usize]) -> Result<(), String> {
    let mut rng = TestRng::new((v * 131 + d * 7 + idx.len()) as u64);
    let ws = draw(&mut rng, v * d, dt, Draw::NORMAL);
    let w = tensor(dev, &ws, &[v, d], dt)?;
    let wb = raw(&w)?;
    let it = IndexTensor::from_slice(dev, idx, idx_shape).map_err(e)?;
    let what = format!("{dt:?} V {v} D {d} idx {idx_shape:?}");
    let y = ops::embedding(&w, &it, None).map_err(|err| format!("{what}: {err}"))?;
    let mut want_shape = idx_shape.to_vec();
    want_shape.push(d);
    if y.shape() != want_shape || y.dtype() != dt {
        return Err(format!("{what}: output {:?} {:?}", y.shape(), y.dtype()));
    }
    let mut want = Vec::with_capacity(idx.len() * d);
    for &r in idx {
        if r >= 0 && (r as usize) < v {
            want.extend_from_slice(&wb[r as usize * d..][..d]);
        } else {
            want.extend(std::iter::repeat_n(0u32, d));
        }
    }
    let got = raw(&y)?;
    if let Some(k) = (0..want.len()).find(|&k| got[k] != want[k]) {
        return Err(format!("{what}: element {k} (index {}): want {:#x}, got {:#x}", idx[k / d], want[k], got[k]));
    }
    // `_out` into a NaN tensor: the same bits.
    let mut out = nan_tensor(dev, &want_shape, dt)?;
    ops::embedding_out(&w, &it, None, &mut out).map_err(e)?;
    if raw(&out)? != got {
        return Err(format!("{what}: embedding_out differs from embedding"));
    }
    Ok(())
}

fn forward_matches_the_gather(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(1);
    for dt in DType::ALL {
        for d in [1, 3, 7, 8, 9, 16, 64, 768, 4099] {
            for (v, n) in [(1, 1), (5, 13), (1000, 127), (97, 1031), (1, 0)] {
                if sanitizer() && d * n > 10_000 {
                    continue;
                }
                let idx = indices(&mut rng, n, v, 0.0);
                fwd_case(dev, dt, v, d, &idx, &[n])?;
            }
        }
        // Indices of rank 0 and 2, and a large vocabulary.
        fwd_case(dev, dt, 10, 8, &[4], &[])?;
        let idx = indices(&mut rng, 6 * 7, 50, 0.0);
        fwd_case(dev, dt, 50, 9, &idx, &[6, 7])?;
        let idx = indices(&mut rng, 257, 200_000, 0.0);
        fwd_case(dev, dt, 200_000, 8, &idx, &[257])?;
    }
    Ok(())
}

fn out_of_range_indices_give_zeros(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(2);
    for dt in DType::ALL {
        for d in [3, 8] {
            let idx = indices(&mut rng, 61, 20, 0.3);
            fwd_case(dev, dt, 20, d, &idx, &[61])?;
            let w = tensor(dev, &draw(&mut rng, 20 * d, dt, Draw::FINITE), &[20, d], dt)?;
            // embedding_checked names a bad position; with none it is embedding.
            let it = IndexTensor::from_slice(dev, &idx, &[61]).map_err(e)?;
            let bad: Vec<usize> = (0..61).filter(|&i| !(0..20).contains(&idx[i])).collect();
            match ops::embedding_checked(&w, &it, None) {
                Err(Error::InvalidArgument { message, .. }) => {
                    if !bad.iter().any(|p| message.contains(&format!("position {p} "))) {
                        return Err(format!("embedding_checked names no bad position: {message} (bad: {bad:?})"));
                    }
                }
                other => return Err(format!("embedding_checked with bad indices {bad:?}: {other:?}")),
            }
            let good = IndexTensor::from_slice(dev, &[0, 19, 5], &[3]).map_err(e)?;
            let y = ops::embedding_checked(&w, &good, None).map_err(e)?;
            if raw(&y)? != raw(&ops::embedding(&w, &good, None).map_err(e)?)? {
                return Err("embedding_checked differs from embedding".into());
            }
        }
    }
    Ok(())
}

fn forward_errors_and_empty_sizes(dev: &Device) -> Result<(), String> {
    let w = tensor(dev, &[1.0; 12], &[4, 3], DType::F32)?;
    let it = IndexTensor::from_slice(dev, &[0, 3], &[2]).map_err(e)?;
    let invalid = |r: kernels::Result<Tensor>, what: &str| match r {
        Err(Error::InvalidArgument { op, .. }) if op.starts_with("embedding") => Ok(()),
        other => Err(format!("{what}: want InvalidArgument, got {other:?}")),
    };
    invalid(ops::embedding(&w.clone().reshape(&[12]).map_err(e)?, &it, None), "rank-1 weight")?;
    invalid(ops::embedding(&w, &it, Some(4)), "padding_idx V")?;
    invalid(ops::embedding(&w, &it, Some(-5)), "padding_idx -V - 1")?;
    let empty_w = Tensor::zeros(dev, &[0, 3], DType::F32).map_err(e)?;
    invalid(ops::embedding(&empty_w, &it, None), "V = 0 with indices")?;
    let none = IndexTensor::from_slice(dev, &[], &[0]).map_err(e)?;
    let y = ops::embedding(&empty_w, &none, None).map_err(e)?;
    if y.shape() != [0, 3] {
        return Err(format!("V = 0, N = 0: shape {:?}", y.shape()));
    }
    let w0 = Tensor::zeros(dev, &[4, 0], DType::BF16).map_err(e)?;
    let y = ops::embedding(&w0, &it, Some(-1)).map_err(e)?;
    if y.shape() != [2, 0] {
        return Err(format!("D = 0: shape {:?}", y.shape()));
    }
    // `_out` of the wrong shape or dtype.
    let mut out = nan_tensor(dev, &[2, 4], DType::F32)?;
    match ops::embedding_out(&w, &it, None, &mut out) {
        Err(Error::ShapeMismatch { .. }) => {}
        other => return Err(format!("out [2, 4]: {other:?}")),
    }
    let mut out = nan_tensor(dev, &[2, 3], DType::F16)?;
    match ops::embedding_out(&w, &it, None, &mut out) {
        Err(Error::DTypeMismatch { .. }) => Ok(()),
        other => Err(format!("out f16: {other:?}")),
    }
}

/// The backward's reference for one output element: the f32 sum in the documented order,
/// rounded to `dt` (raw bits), and the f64 sum with the bound of any f32 order (`None` when the
/// f32 sums overflow or meet NaN or infinities: then only the order's bits are checked).
fn bwd_ref(dt: DType, terms: impl Iterator<Item = f32> + Clone) -> (u32, Option<(f64, f64)>) {
    let mut acc = 0.0f32;
    let (mut s, mut abs, mut c) = (0.0f64, 0.0f64, 0usize);
    let mut finite = true;
    for g in terms {
        acc += g;
        finite &= acc.is_finite();
        s += g as f64;
        abs += (g as f64).abs();
        c += 1;
    }
    let u = 2f64.powi(-24);
    let cm1 = c.saturating_sub(1) as f64;
    let gamma = cm1 * u / (1.0 - cm1 * u);
    (bits_of(dt, acc), finite.then_some((s, gamma * abs)))
}

/// The backward of one case, checked against both references; returns the result's bits.
#[allow(clippy::too_many_arguments)]
fn bwd_case(
    dev: &Device,
    dt: DType,
    v: usize,
    d: usize,
    idx: &[i64],
    idx_shape: &[usize],
    padding: Option<i64>,
    seed: u64,
) -> Result<Vec<u32>, String> {
    let mut rng = TestRng::new(seed);
    let n = idx.len();
    let gs = draw(&mut rng, n * d, dt, Draw { scale: 1.0, positive: false, special: 0.01 });
    let mut gshape = idx_shape.to_vec();
    gshape.push(d);
    let g = tensor(dev, &gs, &gshape, dt)?;
    let it = IndexTensor::from_slice(dev, idx, idx_shape).map_err(e)?;
    let what = format!("{dt:?} V {v} D {d} N {n} padding {padding:?}");
    let gw = ops::embedding_backward(&g, &it, v, padding).map_err(|err| format!("{what}: {err}"))?;
    if gw.shape() != [v, d] || gw.dtype() != dt {
        return Err(format!("{what}: grad_weight {:?} {:?}", gw.shape(), gw.dtype()));
    }
    let got = raw(&gw)?;
    let pad = padding.map(|p| if p < 0 { p + v as i64 } else { p });
    let mut rows: Vec<Vec<usize>> = vec![Vec::new(); v];
    for (i, &r) in idx.iter().enumerate() {
        if r >= 0 && (r as usize) < v && Some(r) != pad {
            rows[r as usize].push(i);
        }
    }
    // The final rounding to the dtype (none for f32).
    let ulp_half = |x: f64| if dt == DType::F32 { 0.0 } else { 0.5 * ulp(dt, x.abs()) };
    for (r, pos) in rows.iter().enumerate() {
        for c in 0..d {
            let (want, f64ref) = bwd_ref(dt, pos.iter().map(|&i| gs[i * d + c]));
            let k = r * d + c;
            if !same(dt, got[k], want) {
                return Err(format!(
                    "{what}: row {r} column {c} ({} terms): want {want:#x} (the documented order), got {:#x}",
                    pos.len(),
                    got[k]
                ));
            }
            // A finite f32 sum past the dtype's largest rounds to infinity: only its bits are
            // checked (above).
            let x = f32::from_bits(round_back(dt, got[k])) as f64;
            if let Some((s, bound)) = f64ref.filter(|_| x.is_finite())
                && (x - s).abs() > bound + ulp_half(s.abs() + bound)
            {
                return Err(format!(
                    "{what}: row {r} column {c}: {x:e} is off the f64 sum {s:e} by more than {bound:e}"
                ));
            }
        }
    }
    let mut out = nan_tensor(dev, &[v, d], dt)?;
    ops::embedding_backward_out(&g, &it, padding, &mut out).map_err(e)?;
    if raw(&out)? != got {
        return Err(format!("{what}: embedding_backward_out differs from embedding_backward"));
    }
    Ok(got)
}

/// Raw bits of `dt` back to f32 bits (exact).
fn round_back(dt: DType, b: u32) -> u32 {
    match dt {
        DType::F32 => b,
        DType::F16 => half::f16::from_bits(b as u16).to_f32().to_bits(),
        DType::BF16 => half::bf16::from_bits(b as u16).to_f32().to_bits(),
    }
}

fn backward_matches_the_sums(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(3);
    for dt in DType::ALL {
        for d in [1, 3, 7, 8, 9, 64, 4099] {
            for (v, n) in [(1, 1), (1, 13), (5, 0), (7, 127), (1000, 1031), (31, 2053)] {
                if sanitizer() && d * n > 10_000 {
                    continue;
                }
                let idx = indices(&mut rng, n, v, 0.05);
                bwd_case(dev, dt, v, d, &idx, &[n], None, rng.next_u64())?;
                if v > 1 {
                    bwd_case(dev, dt, v, d, &idx, &[n], Some(-1), rng.next_u64())?;
                }
            }
        }
        let idx = indices(&mut rng, 4 * 9, 12, 0.0);
        bwd_case(dev, dt, 12, 8, &idx, &[4, 9], Some(3), rng.next_u64())?;
        // A vocabulary larger than the indices: most rows zero.
        let idx = indices(&mut rng, 4099, 200_000, 0.0);
        bwd_case(dev, dt, 200_000, 8, &idx, &[4099], Some(0), rng.next_u64())?;
    }
    Ok(())
}

fn backward_of_one_repeated_index(dev: &Device) -> Result<(), String> {
    for dt in DType::ALL {
        for (n, d) in [(10_007, 9), (10_007, 64), (2048, 4096 + 3), (4096, 1)] {
            let n = if sanitizer() { n.min(300) } else { n };
            let idx = vec![3i64; n];
            bwd_case(dev, dt, 7, d, &idx, &[n], None, n as u64)?;
            // Padding the only index used: all zeros.
            let z = bwd_case(dev, dt, 7, d, &idx, &[n], Some(3), 5)?;
            if z.iter().any(|&b| b != 0) {
                return Err(format!("{dt:?}: padding the only index leaves non-zero gradients"));
            }
        }
    }
    Ok(())
}

fn backward_is_deterministic(dev: &Device) -> Result<(), String> {
    let mut rng = TestRng::new(4);
    for dt in DType::ALL {
        let (v, d, n) = (50, 64, if sanitizer() { 500 } else { 20_000 });
        let idx = indices(&mut rng, n, v, 0.0);
        let gs = draw(&mut rng, n * d, dt, Draw::FINITE);
        let g = tensor(dev, &gs, &[n, d], dt)?;
        let it = IndexTensor::from_slice(dev, &idx, &[n]).map_err(e)?;
        let a = raw(&ops::embedding_backward(&g, &it, v, None).map_err(e)?)?;
        for _ in 0..3 {
            let b = raw(&ops::embedding_backward(&g, &it, v, None).map_err(e)?)?;
            if a != b {
                return Err(format!("{dt:?}: two backward runs differ"));
            }
        }
    }
    Ok(())
}

fn backward_errors_and_empty_sizes(dev: &Device) -> Result<(), String> {
    let it = IndexTensor::from_slice(dev, &[0, 3], &[2]).map_err(e)?;
    let g = tensor(dev, &[1.0; 6], &[2, 3], DType::BF16)?;
    let shape_err = |r: kernels::Result<Tensor>, what: &str| match r {
        Err(Error::ShapeMismatch { .. }) => Ok(()),
        other => Err(format!("{what}: want ShapeMismatch, got {other:?}")),
    };
    shape_err(ops::embedding_backward(&g.clone().reshape(&[6]).map_err(e)?, &it, 4, None), "grad [6]")?;
    shape_err(ops::embedding_backward(&g.clone().reshape(&[3, 2]).map_err(e)?, &it, 4, None), "grad [3, 2]")?;
    match ops::embedding_backward(&g, &it, 4, Some(4)) {
        Err(Error::InvalidArgument { .. }) => {}
        other => return Err(format!("padding_idx 4 of 4: {other:?}")),
    }
    let mut out = nan_tensor(dev, &[4, 3], DType::F32)?;
    match ops::embedding_backward_out(&g, &it, None, &mut out) {
        Err(Error::DTypeMismatch { .. }) => {}
        other => return Err(format!("grad_weight f32 for bf16: {other:?}")),
    }
    let mut out = nan_tensor(dev, &[4, 2], DType::BF16)?;
    match ops::embedding_backward_out(&g, &it, None, &mut out) {
        Err(Error::ShapeMismatch { .. }) => {}
        other => return Err(format!("grad_weight [4, 2]: {other:?}")),
    }
    // No indices: zeros (+0.0) of [V, D], written over the poisoned memory.
    let none = IndexTensor::from_slice(dev, &[], &[0]).map_err(e)?;
    let g0 = Tensor::zeros(dev, &[0, 5], DType::F16).map_err(e)?;
    let gw = ops::embedding_backward(&g0, &none, 6, None).map_err(e)?;
    if gw.shape() != [6, 5] || raw(&gw)?.iter().any(|&b| b != 0) {
        return Err(format!("N = 0: {:?} {:?}", gw.shape(), raw(&gw)?));
    }
    // V = 0 and D = 0: empty results.
    let gw = ops::embedding_backward(&g0, &none, 0, None).map_err(e)?;
    let gd = ops::embedding_backward(&Tensor::zeros(dev, &[2, 0], DType::F32).map_err(e)?, &it, 4, None).map_err(e)?;
    if gw.shape() != [0, 5] || gd.shape() != [4, 0] {
        return Err(format!("V = 0: {:?}, D = 0: {:?}", gw.shape(), gd.shape()));
    }
    Ok(())
}

/// The forward, then the backward of `sum(out * g)`, on LLM-shaped sizes (GPT-2's D, a slice of
/// its vocabulary) with repeated tokens.
fn llm_shapes(dev: &Device) -> Result<(), String> {
    if sanitizer() {
        return Ok(());
    }
    let mut rng = TestRng::new(5);
    for dt in [DType::BF16, DType::F32] {
        let (v, d, n) = (5000, 768, 4096);
        // Zipf-like tokens: a few very frequent.
        let idx: Vec<i64> = (0..n).map(|_| ((rng.unit().powi(4) * v as f64) as i64).min(v as i64 - 1)).collect();
        fwd_case(dev, dt, v, d, &idx, &[2, n / 2])?;
        bwd_case(dev, dt, v, d, &idx, &[2, n / 2], None, 9)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    run(vec![
        test("forward_matches_the_gather", forward_matches_the_gather),
        test("out_of_range_indices_give_zeros", out_of_range_indices_give_zeros),
        test("forward_errors_and_empty_sizes", forward_errors_and_empty_sizes),
        test("backward_matches_the_sums", backward_matches_the_sums),
        test("backward_of_one_repeated_index", backward_of_one_repeated_index),
        test("backward_is_deterministic", backward_is_deterministic),
        test("backward_errors_and_empty_sizes", backward_errors_and_empty_sizes),
        test("llm_shapes", llm_shapes),
    ])
}
