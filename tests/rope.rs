//! GPU tests of RoPE (`ops::rope`, `rope_inplace`, `rope_backward`, `rope_backward_inplace`,
//! `rope_tables`) in f32, f16 and bf16, against the f64 reference (`common::rope_ref`, whose
//! error model gives the bound: the f32 rotation's two roundings, then one of the output), on
//! both layouts and both pair conventions, head dimensions 2 to 256 (vector and scalar paths),
//! partial rotary dimensions, position offsets, odd and empty sizes, and values with NaN,
//! infinities, denormals and the dtype's largest. Outputs come from poisoned (NaN-filled)
//! allocations, so an unwritten element fails; the pass-through part must keep its bits, the
//! in-place and `_out` ops must give the others' bits. (The backward reference is checked against
//! finite differences in tests/cpu.rs.)

mod common;

use common::rope_ref::{Pair, pairs, rope_ref, row_positions, tol};
use common::*;
use kernels::ops::{self, Layout, RopeOpts, RopeStyle};
use kernels::{DType, Device, Error, Tensor};
use kernels_gpu::rope::vector_path;
use proptest::prelude::*;
use std::process::ExitCode;

/// Head dimensions: the LLM ones, and odd multiples of 2 that miss the vector widths.
const HEAD_DIMS: [usize; 10] = [2, 8, 64, 128, 80, 96, 256, 6, 34, 12];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The same bits, or both NaN (the host's f16/bf16 conversions need not keep a NaN's payload).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn read(t: &Tensor) -> Result<Vec<f32>, String> {
    t.to_f32_vec().map_err(e)
}

/// One problem: x's shape in `opts.layout`, tables for `max_pos` positions.
#[derive(Clone, Copy, Debug)]
struct Case {
    shape: [usize; 4],
    dt: DType,
    opts: RopeOpts,
    max_pos: usize,
}

/// Checks `got` against the reference of `x` rotated by `sign`: the rotated part within the
/// bound (at extreme inputs the kernel's own f32 formula, bit for bit), the rest bit for bit.
fn check(what: &str, c: &Case, xs: &[f32], got: &[f32], cs: &[f32], ss: &[f32], sign: f32) -> Result<(), String> {
    let (want, inputs) = rope_ref(xs, c.shape, &c.opts, cs, ss, sign);
    let what = format!("{what} {c:?}");
    let emul = |i: usize| inputs[i].and_then(|p: Pair| at_extremes(&[p.a, p.b], || p.f32()));
    let show = |i: usize| match inputs[i] {
        Some(p) => format!("element {i}: {p:?}"),
        None => format!("element {i}, passed through: {:e}", xs[i]),
    };
    compare(&what, c.dt, got, &want, |i| tol(inputs[i]), emul, show)?;
    if let Some(i) = (0..xs.len()).find(|&i| inputs[i].is_none() && !same(got[i], xs[i])) {
        return Err(format!("{what}: element {i} must pass through as {:e}, got {:e}", xs[i], got[i]));
    }
    Ok(())
}

/// The forward and backward, out of place and in place, of one case with random values.
fn rope_case(dev: &Device, c: Case, seed: u64) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let n: usize = c.shape.iter().product();
    let d = c.shape[3];
    let rot = c.opts.rotary_dim.unwrap_or(d);
    let xs = draw(&mut rng, n, c.dt, Draw { scale: 3.0, positive: false, special: 0.02 });
    let gs = draw(&mut rng, n, c.dt, Draw { scale: 1.0, positive: false, special: 0.02 });
    let (cos, sin) = ops::rope_tables(dev, c.max_pos, rot, 10000.0).map_err(e)?;
    let (cs, ss) = (read(&cos)?, read(&sin)?);
    let x = tensor(dev, &xs, &c.shape, c.dt)?;
    let g = tensor(dev, &gs, &c.shape, c.dt)?;

    let y = ops::rope(&x, &cos, &sin, &c.opts).map_err(e)?;
    if y.shape() != x.shape() || y.dtype() != c.dt {
        return Err(format!("{c:?}: output {:?} {:?}", y.shape(), y.dtype()));
    }
    let ys = read(&y)?;
    check("rope", &c, &xs, &ys, &cs, &ss, 1.0)?;
    let gx = read(&ops::rope_backward(&g, &cos, &sin, &c.opts).map_err(e)?)?;
    check("rope_backward", &c, &gs, &gx, &cs, &ss, -1.0)?;

    // In place on a clone: the clone's memory is copied first, x keeps its values.
    let mut xi = x.clone();
    ops::rope_inplace(&mut xi, &cos, &sin, &c.opts).map_err(e)?;
    if bits(&read(&xi)?) != bits(&ys) {
        return Err(format!("{c:?}: rope_inplace differs from rope"));
    }
    if read(&x)?.iter().zip(&xs).any(|(&a, &b)| !same(a, b)) {
        return Err(format!("{c:?}: rope_inplace on a clone changed the original"));
    }
    let mut out = nan_tensor(dev, &c.shape, c.dt)?;
    ops::rope_out(&x, &cos, &sin, &c.opts, &mut out).map_err(e)?;
    if bits(&read(&out)?) != bits(&ys) {
        return Err(format!("{c:?}: rope_out differs from rope"));
    }
    ops::rope_backward_out(&g, &cos, &sin, &c.opts, &mut out).map_err(e)?;
    if bits(&read(&out)?) != bits(&gx) {
        return Err(format!("{c:?}: rope_backward_out differs from rope_backward"));
    }
    let mut gi = g.try_clone().map_err(e)?;
    ops::rope_backward_inplace(&mut gi, &cos, &sin, &c.opts).map_err(e)?;
    if bits(&read(&gi)?) != bits(&gx) {
        return Err(format!("{c:?}: rope_backward_inplace differs from rope_backward"));
    }
    Ok(())
}

fn opts(layout: Layout, style: RopeStyle, offset: usize, rotary_dim: Option<usize>) -> RopeOpts {
    RopeOpts { layout, style, offset, rotary_dim }
}

/// x's shape in `layout` for `b` sequences of `s` rows of `h` heads of `d`.
fn shape(layout: Layout, b: usize, s: usize, h: usize, d: usize) -> [usize; 4] {
    match layout {
        Layout::Bhsd => [b, h, s, d],
        Layout::Bshd => [b, s, h, d],
    }
}

const LAYOUTS: [Layout; 2] = [Layout::Bhsd, Layout::Bshd];
const STYLES: [RopeStyle; 2] = [RopeStyle::Half, RopeStyle::Interleaved];

/// A random case: any head dimension of [`HEAD_DIMS`] with a rotary dimension of all of it, half
/// of it or 2; batch, sequence and heads from 1 to 9 (odd ones included); an offset.
fn cases() -> impl Strategy<Value = (Case, u64)> {
    (
        (0..HEAD_DIMS.len(), 0..3usize, 0..2usize, 0..2usize),
        prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)],
        (1..4usize, 1..10usize, 1..10usize, prop_oneof![Just(0usize), 0..100usize]),
        any::<u64>(),
    )
        .prop_map(|((di, ri, li, si), dt, (b, s, h, offset), seed)| {
            let d = HEAD_DIMS[di];
            let rotary_dim = [None, Some((d / 2).next_multiple_of(2).max(2)), Some(2)][ri];
            let (layout, style) = (LAYOUTS[li], STYLES[si]);
            let c = Case {
                shape: shape(layout, b, s, h, d),
                dt,
                opts: opts(layout, style, offset, rotary_dim),
                max_pos: offset + s + (seed % 3) as usize,
            };
            (c, seed)
        })
}

/// A NaN or an infinity reaches only its pair's two outputs.
fn specials_stay_in_their_pair(dev: &Device, dt: DType, layout: Layout, style: RopeStyle) -> Result<(), String> {
    let (b, s, h, d) = (1, 3, 2, 64);
    let sh = shape(layout, b, s, h, d);
    let n = b * s * h * d;
    let o = opts(layout, style, 1, None);
    let (cos, sin) = ops::rope_tables(dev, 8, d, 10000.0).map_err(e)?;
    for (k, v) in [(5usize, f32::NAN), (d + 40, f32::INFINITY), (3 * d + 1, f32::NEG_INFINITY)] {
        let mut xs: Vec<f32> = (0..n).map(|i| round_to(dt, ((i as f32) * 0.37).sin())).collect();
        xs[k] = v;
        let x = tensor(dev, &xs, &sh, dt)?;
        let ys = read(&ops::rope(&x, &cos, &sin, &o).map_err(e)?)?;
        let (r, i) = (k / d, k % d);
        let (p, q, _) = pairs(style, d).into_iter().find(|&(p, q, _)| p == i || q == i).ok_or("no pair")?;
        let touched = [r * d + p, r * d + q];
        for (j, y) in ys.iter().enumerate() {
            if touched.contains(&j) == y.is_finite() {
                return Err(format!(
                    "{dt:?} {layout:?} {style:?}: {v} at {k} gives {y} at {j} (its pair: {touched:?})"
                ));
            }
        }
    }
    Ok(())
}

/// The typed errors: rank, odd or out-of-range rotary dimensions, tables too short, of the wrong
/// width or dtype, unlike each other.
fn errors(dev: &Device) -> Result<(), String> {
    let x = Tensor::zeros(dev, &[1, 2, 5, 64], DType::BF16).map_err(e)?;
    let (cos, sin) = ops::rope_tables(dev, 5, 64, 10000.0).map_err(e)?;
    let o = RopeOpts::default();
    let expect = |what: &str, r: Result<Tensor, Error>, ok: fn(&Error) -> bool| match r {
        Err(err) if ok(&err) && err.to_string().starts_with("rope") => Ok(()),
        Err(err) => Err(format!("{what}: wrong error {err}")),
        Ok(_) => Err(format!("{what}: no error")),
    };
    let invalid = |e: &Error| matches!(e, Error::InvalidArgument { .. });
    let mismatch = |e: &Error| matches!(e, Error::ShapeMismatch { .. });
    let x3 = Tensor::zeros(dev, &[2, 5, 64], DType::BF16).map_err(e)?;
    expect("rank 3", ops::rope(&x3, &cos, &sin, &o), invalid)?;
    let odd = Tensor::zeros(dev, &[1, 2, 5, 7], DType::BF16).map_err(e)?;
    expect("odd head dim", ops::rope(&odd, &cos, &sin, &o), invalid)?;
    for r in [0, 3, 66] {
        let o = RopeOpts { rotary_dim: Some(r), ..o };
        expect("rotary dim", ops::rope(&x, &cos, &sin, &o), invalid)?;
    }
    let o6 = RopeOpts { offset: 1, ..o };
    expect("table too short", ops::rope(&x, &cos, &sin, &o6), invalid)?;
    let bshd = RopeOpts { layout: Layout::Bshd, ..o };
    let xb = Tensor::zeros(dev, &[1, 6, 2, 64], DType::BF16).map_err(e)?;
    expect("table too short (bshd)", ops::rope(&xb, &cos, &sin, &bshd), invalid)?;
    let (c32, s32) = ops::rope_tables(dev, 5, 32, 10000.0).map_err(e)?;
    expect("table width", ops::rope(&x, &c32, &s32, &o), mismatch)?;
    expect("tables unlike", ops::rope(&x, &cos, &s32, &o), mismatch)?;
    let cb = cos.to_dtype(DType::BF16).map_err(e)?;
    expect("bf16 table", ops::rope(&x, &cb, &sin, &o), |e| matches!(e, Error::DTypeMismatch { .. }))?;
    expect("bf16 table (backward)", ops::rope_backward(&x, &cos, &cb, &o), |e| {
        matches!(e, Error::DTypeMismatch { .. })
    })?;
    let mut xm = x.clone();
    match ops::rope_inplace(&mut xm, &cos, &sin, &o6) {
        Err(Error::InvalidArgument { .. }) => {}
        other => return Err(format!("rope_inplace with a short table: {:?}", other.err())),
    }
    for (p, r, b) in [(4, 0, 1e4), (4, 3, 1e4), (4, 8, 0.0), (4, 8, f64::NAN)] {
        if !matches!(ops::rope_tables(dev, p, r, b), Err(Error::InvalidArgument { .. })) {
            return Err(format!("rope_tables({p}, {r}, {b}) must be an error"));
        }
    }
    Ok(())
}

/// Empty tensors (any of B, S, H zero) give empty outputs, without a launch.
fn empty(dev: &Device) -> Result<(), String> {
    let (cos, sin) = ops::rope_tables(dev, 4, 8, 10000.0).map_err(e)?;
    for layout in LAYOUTS {
        for (b, s, h) in [(0, 3, 2), (2, 0, 2), (2, 3, 0)] {
            let sh = shape(layout, b, s, h, 8);
            let x = Tensor::zeros(dev, &sh, DType::F16).map_err(e)?;
            let o = opts(layout, RopeStyle::Half, 1, None);
            let y = ops::rope(&x, &cos, &sin, &o).map_err(e)?;
            if y.shape() != sh || y.numel() != 0 {
                return Err(format!("{sh:?}: output of shape {:?}", y.shape()));
            }
            let mut xi = x.clone();
            ops::rope_inplace(&mut xi, &cos, &sin, &o).map_err(e)?;
            ops::rope_backward(&x, &cos, &sin, &o).map_err(e)?;
        }
    }
    Ok(())
}

/// The tables against their definition, and the positions each row of both layouts reads.
fn tables(dev: &Device) -> Result<(), String> {
    let (max_pos, rot, base) = (4096usize, 128usize, 500000.0f64);
    let (cos, sin) = ops::rope_tables(dev, max_pos, rot, base).map_err(e)?;
    if cos.shape() != [max_pos, rot / 2] || sin.shape() != [max_pos, rot / 2] || cos.dtype() != DType::F32 {
        return Err(format!("tables of shape {:?}, {:?}", cos.shape(), sin.shape()));
    }
    let (cs, ss) = (read(&cos)?, read(&sin)?);
    for p in [0, 1, 17, 4095] {
        for i in [0, 1, 31, 63] {
            let a = p as f64 * base.powf(-2.0 * i as f64 / rot as f64);
            let (c, s) = (cs[p * rot / 2 + i], ss[p * rot / 2 + i]);
            if c != a.cos() as f32 || s != a.sin() as f32 {
                return Err(format!("position {p}, pair {i}: ({c}, {s}), want the angle {a}'s"));
            }
        }
    }
    // Row positions as the reference reads them: [B, H, S, D] walks S fastest, [B, S, H, D] H.
    if row_positions([1, 2, 3, 4], Layout::Bhsd, 5) != [5, 6, 7, 5, 6, 7]
        || row_positions([1, 2, 3, 4], Layout::Bshd, 5) != [5, 5, 5, 6, 6, 6]
    {
        return Err("row positions".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    tests.push(test("rope/random_cases", |dev: &Device| prop(200, cases(), |(c, seed)| rope_case(dev, c, seed))));
    // Every head dimension, dtype, layout and convention, whole and partial rotary dimensions,
    // odd sizes and an offset: each path of the kernel (vector and scalar, with and without a
    // pass-through part).
    for d in HEAD_DIMS {
        tests.push(test(format!("rope/head_dim/{d}"), move |dev: &Device| {
            let mut paths = std::collections::BTreeSet::new();
            for dt in DType::ALL {
                for layout in LAYOUTS {
                    for style in STYLES {
                        for rotary_dim in [None, Some(2), Some((d / 2).next_multiple_of(2).max(2))] {
                            let o = opts(layout, style, 3, rotary_dim);
                            let c = Case { shape: shape(layout, 2, 5, 3, d), dt, opts: o, max_pos: 9 };
                            let rot = rotary_dim.unwrap_or(d) as u64;
                            paths.insert(vector_path(dt, d as u64, rot, style == RopeStyle::Interleaved));
                            rope_case(dev, c, (d * 31 + rot as usize) as u64)?;
                        }
                    }
                }
            }
            // Head dimensions of whole f32 vectors have a vector case (at least f32 interleaved);
            // all have scalar ones (at least a rotary dimension of 2).
            if paths.contains(&true) != d.is_multiple_of(4) || !paths.contains(&false) {
                return Err(format!("D = {d}: paths {paths:?}"));
            }
            Ok(())
        }));
    }
    tests.push(test("rope/llm_shapes", |dev: &Device| {
        let big = !sanitizer();
        let seq = if big { 512 } else { 16 };
        for (layout, style, dt, h, d, offset) in [
            (Layout::Bshd, RopeStyle::Half, DType::BF16, 8, 128, 0),
            (Layout::Bhsd, RopeStyle::Half, DType::F16, 4, 128, 1000),
            (Layout::Bhsd, RopeStyle::Interleaved, DType::F32, 4, 64, 7),
            (Layout::Bshd, RopeStyle::Interleaved, DType::BF16, 2, 256, 3),
        ] {
            let c = Case {
                shape: shape(layout, 2, seq, h, d),
                dt,
                opts: opts(layout, style, offset, None),
                max_pos: offset + seq,
            };
            rope_case(dev, c, d as u64)?;
        }
        Ok(())
    }));
    tests.push(test("rope/specials_stay_in_their_pair", |dev: &Device| {
        for dt in DType::ALL {
            for layout in LAYOUTS {
                for style in STYLES {
                    specials_stay_in_their_pair(dev, dt, layout, style)?;
                }
            }
        }
        Ok(())
    }));
    tests.push(test("rope/errors", errors));
    tests.push(test("rope/empty", empty));
    tests.push(test("rope/tables", tables));
    run(tests)
}
