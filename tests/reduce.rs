//! GPU tests of the reductions: sum, mean, max, min and argmax, over the whole tensor and along
//! the last dimension, and sum and mean over the leading dimensions (`reduce_leading_dims`, per
//! column), in f32, f16 and bf16, against f64 references.
//!
//! Tolerances. Max, min and argmax are exact: they select one of the stored values, so the
//! result must be that value (and index) bit for bit, NaN propagated as PyTorch does (the first
//! NaN for argmax; the first index on ties). A sum is a tree of f32 additions whose depth `d`
//! (the most roundings any one term passes through) the library reports (`reduce_sum_depth`, from
//! the launch geometry: per-thread chain + the block reductions + the second stage). Each
//! rounding multiplies by `(1 + delta)`, `|delta| <= u = 2^-24`, so the f32 result `s` satisfies
//! `|s - exact| <= gamma_d * sum |x|`, `gamma_d = d u / (1 - d u) <= 1.01 d u` for `d u < 0.01`
//! (Higham, Accuracy and Stability of Numerical Algorithms, 4.2). A mean is the sum times the f32
//! rounding of `1/n` (two more roundings, counted in `d`), so the bound is divided by `n`.
//! `close` then adds one ulp of the output dtype for the final rounding to it.
//!
//! Column sums have the same bound with the depth of their own tree
//! (`reduce_leading_dims_sum_depth`: the rows a thread folds, the block's tree over its row
//! lanes, the sum of the chunks' partial rows).
//!
//! Outputs start as NaN (poisoned allocations), so an element a kernel fails to write fails
//! (an unwritten i64 index reads back as -1).

mod common;

use common::*;
use kernels::ops::{self, ReduceOp};
use kernels::{DType, Device, Error, IndexTensor, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

/// Unit roundoff of f32.
const U: f64 = 1.0 / 16_777_216.0;
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];

/// The exact reductions of one range, in f64.
#[derive(Debug)]
struct Exact {
    sum: f64,
    abs: f64,
    max: f64,
    min: f64,
    argmax: i64,
    n: usize,
}

/// Exact reductions of `xs` (non-empty). Sum: Neumaier's compensated f64 summation (its error,
/// about 2^-53 relative, is far below the f32 bounds); specials as IEEE (`inf - inf` = NaN).
/// Max and min: NaN if any NaN. Argmax: PyTorch's: the first NaN, else the first maximum.
fn exact(xs: &[f32]) -> Exact {
    let (mut s, mut c, mut abs) = (0.0f64, 0.0f64, 0.0f64);
    let mut special = None::<f64>;
    let (mut max, mut min) = (f64::NEG_INFINITY, f64::INFINITY);
    let mut nan = false;
    for &x in xs {
        let x = x as f64;
        if x.is_finite() {
            let t = s + x;
            c += if s.abs() >= x.abs() { (s - t) + x } else { (x - t) + s };
            s = t;
            abs += x.abs();
        } else {
            special = Some(special.map_or(x, |v| v + x));
        }
        nan |= x.is_nan();
        max = max.max(x);
        min = min.min(x);
    }
    let (mut bi, mut bv) = (0usize, xs[0]);
    for (i, &x) in xs.iter().enumerate().skip(1) {
        if bv.is_nan() {
            break;
        }
        if x.is_nan() || x > bv {
            (bi, bv) = (i, x);
        }
    }
    let sum = special.map_or(s + c, |v| v + (s + c));
    let (max, min) = if nan { (f64::NAN, f64::NAN) } else { (max, min) };
    Exact { sum, abs, max, min, argmax: bi as i64, n: xs.len() }
}

/// How sums are checked.
#[derive(Clone, Copy, Debug, PartialEq)]
enum SumCheck {
    /// Finite values, NaN and infinities only: NaN and infinities exactly, finite results
    /// within the bound.
    Full,
    /// Any values, e.g. 3.4e38, whose f32 sum overflows where the f64 one does not: only a NaN
    /// of the exact sum (a NaN input, or +inf and -inf) must come out NaN.
    NanOnly,
}

/// Checks one value result of `op` against `e`; `depth` as in the module comment.
fn check_value(dt: DType, op: ReduceOp, got: f32, e: &Exact, depth: u64, sums: SumCheck) -> Result<(), String> {
    let ok = match op {
        ReduceOp::Max | ReduceOp::Min => {
            let want = if op == ReduceOp::Max { e.max } else { e.min };
            // The result is one of the stored values: exact (-0 and +0 compare equal).
            (want.is_nan() && got.is_nan()) || got as f64 == want
        }
        ReduceOp::Sum | ReduceOp::Mean => {
            let scale = if op == ReduceOp::Mean { 1.0 / e.n as f64 } else { 1.0 };
            let want = e.sum * scale;
            if want.is_nan() {
                got.is_nan()
            } else if sums == SumCheck::NanOnly {
                true
            } else if want.is_infinite() {
                got as f64 == want
            } else {
                let atol = 1.01 * depth as f64 * U * e.abs * scale;
                close(dt, got, want, Tol { rtol: 0.0, atol })
            }
        }
    };
    if ok { Ok(()) } else { Err(format!("{op:?}: got {got:e}, exact {e:?} (summation depth {depth})")) }
}

/// Runs every reduction of `x` (values `xs`, shape `shape`), whole and along the last
/// dimension, and checks each result.
fn check_all(dev: &Device, dt: DType, shape: &[usize], xs: &[f32], sums: SumCheck) -> Result<(), String> {
    let x = tensor(dev, xs, shape, dt)?;
    let cols = shape.last().copied().unwrap_or(1);
    let rows = xs.len() / cols;
    let what = |w: &str| format!("{w} of {dt:?} {shape:?}");
    let ctx = |w: &str, err: String| format!("{}: {err}", what(w));

    let whole = exact(xs);
    let depth = ops::reduce_sum_depth(&x, false).map_err(e)?;
    for op in OPS {
        let r = ops::reduce(&x, op).map_err(e)?;
        if !r.shape().is_empty() {
            return Err(ctx(&format!("{op:?}"), format!("result shape {:?}, want []", r.shape())));
        }
        let got = r.to_f32_vec().map_err(e)?[0];
        check_value(dt, op, got, &whole, depth, sums).map_err(|m| ctx("whole", m))?;
    }
    let a = ops::argmax(&x).map_err(e)?;
    let got = (a.shape().to_vec(), a.to_vec().map_err(e)?);
    if got != (vec![], vec![whole.argmax]) {
        return Err(ctx("argmax", format!("got {got:?}, want index {}", whole.argmax)));
    }

    let out_shape = &shape[..shape.len().saturating_sub(1)];
    let per_row: Vec<Exact> = xs.chunks(cols).map(exact).collect();
    let depth = ops::reduce_sum_depth(&x, true).map_err(e)?;
    for op in OPS {
        let r = ops::reduce_last_dim(&x, op).map_err(e)?;
        if r.shape() != out_shape {
            return Err(ctx(&format!("{op:?}_last_dim"), format!("shape {:?}, want {out_shape:?}", r.shape())));
        }
        let got = r.to_f32_vec().map_err(e)?;
        for (i, (g, ex)) in got.iter().zip(&per_row).enumerate() {
            check_value(dt, op, *g, ex, depth, sums).map_err(|m| ctx(&format!("last dim, row {i} of {rows}"), m))?;
        }
    }
    let a = ops::argmax_last_dim(&x).map_err(e)?;
    if a.shape() != out_shape {
        return Err(ctx("argmax_last_dim", format!("shape {:?}, want {out_shape:?}", a.shape())));
    }
    let got = a.to_vec().map_err(e)?;
    if let Some(i) = (0..rows).find(|&i| got[i] != per_row[i].argmax) {
        return Err(ctx("argmax_last_dim", format!("row {i}: got {}, want {}", got[i], per_row[i].argmax)));
    }
    Ok(())
}

// --- inputs -----------------------------------------------------------------------------------------

/// Kinds of input values.
#[derive(Clone, Copy, Debug)]
enum Data {
    /// Normal (sd 3) with 2% outliers of magnitude 100 to 10^4.
    Finite,
    /// As `Finite`, with NaN, +inf and -inf sprinkled in (about one per three rows).
    Ieee,
    /// `draw`'s specials: ±0, ±inf, NaN, denormals, the largest finite values.
    Specials,
    /// Few distinct values (-2..=2, -0): many ties.
    Ties,
}

fn values(rng: &mut TestRng, n: usize, cols: usize, dt: DType, data: Data) -> Vec<f32> {
    let finite = |rng: &mut TestRng| {
        if rng.unit() < 0.02 {
            let m = 100.0 * 100f64.powf(rng.unit());
            (if rng.unit() < 0.5 { -m } else { m }) as f32
        } else {
            (rng.normal() * 3.0) as f32
        }
    };
    let v: Vec<f32> = match data {
        Data::Finite => (0..n).map(|_| finite(rng)).collect(),
        Data::Ieee => (0..n)
            .map(|_| {
                if rng.unit() < 0.3 / cols as f64 {
                    [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.below(3)]
                } else {
                    finite(rng)
                }
            })
            .collect(),
        Data::Specials => draw(rng, n, dt, Draw { scale: 3.0, positive: false, special: 0.1 }),
        Data::Ties => (0..n).map(|_| [-2.0, -1.0, -0.0, 0.0, 1.0, 2.0][rng.below(6)]).collect(),
    };
    v.into_iter().map(|x| round_to(dt, x)).collect()
}

fn sum_check(data: Data) -> SumCheck {
    match data {
        Data::Specials => SumCheck::NanOnly,
        _ => SumCheck::Full,
    }
}

/// (rows, cols): row lengths at the vector widths and their neighbours, primes, one longer than
/// a group's reach, and random; row counts from 1 (the whole-tensor path) to ~300. The total is
/// capped (the references run on the CPU).
fn shapes() -> impl Strategy<Value = (usize, usize)> {
    let cols = prop_oneof![
        Just(1usize),
        Just(2),
        Just(3),
        Just(4),
        Just(7),
        Just(8),
        Just(9),
        Just(31),
        Just(32),
        Just(33),
        Just(127),
        Just(1024),
        Just(4097),
        Just(100_003),
        1usize..3000
    ];
    let rows = prop_oneof![Just(1usize), Just(2), Just(3), Just(31), Just(33), Just(257), 1usize..300];
    let cap = if sanitizer() { 1 << 13 } else { 1 << 18 };
    (rows, cols).prop_map(move |(r, c)| (r.min((cap / c).max(1)), c))
}

fn data_kind() -> impl Strategy<Value = Data> {
    prop_oneof![Just(Data::Finite), Just(Data::Ieee), Just(Data::Specials), Just(Data::Ties)]
}

/// The shape of `rows x cols` values: 1-D for one row, 3-D when the rows split in two.
fn shape_of(rows: usize, cols: usize) -> Vec<usize> {
    match rows {
        1 => vec![cols],
        r if r % 2 == 0 => vec![2, r / 2, cols],
        r => vec![r, cols],
    }
}

fn prop_case(dev: &Device, dt: DType) -> Result<(), String> {
    prop(24, (shapes(), data_kind(), any::<u64>()), |((rows, cols), data, seed)| {
        let mut rng = TestRng::new(seed);
        let xs = values(&mut rng, rows * cols, cols, dt, data);
        check_all(dev, dt, &shape_of(rows, cols), &xs, sum_check(data)).map_err(|m| format!("{data:?}: {m}"))
    })
}

// --- over the leading dimensions -------------------------------------------------------------------

/// Sum and mean over the leading dimensions of `x` (values `xs`, shape `shape`), per column.
fn check_cols(dev: &Device, dt: DType, shape: &[usize], xs: &[f32], sums: SumCheck) -> Result<(), String> {
    let x = tensor(dev, xs, shape, dt)?;
    let cols = *shape.last().expect("at least one dimension");
    let rows = xs.len().checked_div(cols).unwrap_or(0);
    let depth = ops::reduce_leading_dims_sum_depth(&x).map_err(e)?;
    let per_col: Vec<Exact> = (0..cols)
        .map(|c| {
            let col: Vec<f32> = (0..rows).map(|r| xs[r * cols + c]).collect();
            if rows == 0 { Exact { sum: 0.0, abs: 0.0, max: 0.0, min: 0.0, argmax: 0, n: 0 } } else { exact(&col) }
        })
        .collect();
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let ctx = |m: String| format!("{op:?} over the leading dims of {dt:?} {shape:?}: {m}");
        let r = ops::reduce_leading_dims(&x, op).map_err(e)?;
        if r.shape() != [cols] {
            return Err(ctx(format!("result shape {:?}, want [{cols}]", r.shape())));
        }
        let got = r.to_f32_vec().map_err(e)?;
        // The `_out` variant, into a NaN-filled output: the same bits.
        let mut o = Tensor::full(dev, &[cols], dt, f32::NAN).map_err(e)?;
        ops::reduce_leading_dims_out(&x, op, &mut o).map_err(e)?;
        if o.to_f32_vec().map_err(e)?.iter().map(|v| v.to_bits()).ne(got.iter().map(|v| v.to_bits())) {
            return Err(ctx("reduce_leading_dims_out differs from reduce_leading_dims".into()));
        }
        for (c, (g, ex)) in got.iter().zip(&per_col).enumerate() {
            if rows == 0 {
                // The sum of nothing is 0, the mean NaN.
                let ok = if op == ReduceOp::Sum { *g == 0.0 } else { g.is_nan() };
                if !ok {
                    return Err(ctx(format!("column {c} of no rows: {g}")));
                }
                continue;
            }
            check_value(dt, op, *g, ex, depth, sums).map_err(|m| ctx(format!("column {c} of {cols}: {m}")))?;
        }
    }
    Ok(())
}

/// (rows, cols) for the column sums: one column (the whole-tensor path), narrow matrices (several
/// rows per warp), unaligned widths, one tile and more, primes, tall ones.
fn col_shapes() -> impl Strategy<Value = (usize, usize)> {
    let cols = prop_oneof![
        Just(1usize),
        Just(2),
        Just(3),
        Just(4),
        Just(5),
        Just(7),
        Just(8),
        Just(9),
        Just(31),
        Just(33),
        Just(127),
        Just(128),
        Just(129),
        Just(256),
        Just(1000),
        Just(4097),
        1usize..3000
    ];
    let rows = prop_oneof![Just(0usize), Just(1), Just(2), Just(7), Just(33), Just(257), Just(4099), 1usize..2000];
    let cap = if sanitizer() { 1 << 13 } else { 1 << 19 };
    (rows, cols).prop_map(move |(r, c)| (r.min(cap / c), c))
}

fn cols_prop_case(dev: &Device, dt: DType) -> Result<(), String> {
    prop(32, (col_shapes(), data_kind(), any::<u64>()), |((rows, cols), data, seed)| {
        let mut rng = TestRng::new(seed);
        let xs = values(&mut rng, rows * cols, cols, dt, data);
        // `shape_of` gives a 1-D tensor for one row: still one row of `cols`.
        check_cols(dev, dt, &shape_of(rows, cols), &xs, sum_check(data)).map_err(|m| format!("{data:?}: {m}"))
    })
}

/// Tall matrices (every chunk loops over many rounds; 8192 x 4096 is the bench's shape),
/// against f64 sums; and the same input twice gives the same bits.
fn cols_tall(dev: &Device) -> Result<(), String> {
    let shapes: &[(usize, usize)] =
        if sanitizer() { &[(1024, 64), (4099, 3)] } else { &[(8192, 4096), (100_003, 33), (1 << 20, 4), (1 << 20, 3)] };
    for dt in DType::ALL {
        for &(rows, cols) in shapes {
            let x = Tensor::rand_normal(dev, &[rows, cols], dt, 0.5, 2.0, rows as u64 ^ cols as u64).map_err(e)?;
            let xs = x.to_f32_vec().map_err(e)?;
            check_cols(dev, dt, &[rows, cols], &xs, SumCheck::Full)?;
            let bits = |t: Tensor| -> Result<Vec<u32>, String> {
                Ok(t.to_f32_vec().map_err(e)?.into_iter().map(f32::to_bits).collect())
            };
            let (a, b) = (bits(x.sum_leading_dims().map_err(e)?)?, bits(x.sum_leading_dims().map_err(e)?)?);
            if a != b {
                return Err(format!("{dt:?} [{rows}, {cols}]: two column sums differ"));
            }
        }
    }
    Ok(())
}

/// Shapes at the edges and the errors.
fn cols_edges(dev: &Device) -> Result<(), String> {
    for dt in DType::ALL {
        // A 1-D tensor is one row: its sum is itself, added to the sum's identity +0.0 (so
        // -0.0 comes back +0.0, as from PyTorch's sum).
        let v = [1.5f32, -2.0, 0.25, 8.0, -0.0];
        let x = tensor(dev, &v, &[5], dt)?;
        let got = x.sum_leading_dims().map_err(e)?;
        if got.shape() != [5]
            || got.to_f32_vec().map_err(e)?.iter().map(|g| g.to_bits()).ne(v.iter().map(|g| (0.0 + g).to_bits()))
        {
            return Err(format!("{dt:?}: the column sums of a 1-D tensor are not the tensor"));
        }
        // No rows: zeros and NaN of shape [C]; no columns: shape [0].
        for (shape, cols) in [(vec![0usize, 7], 7usize), (vec![2, 0, 3], 3), (vec![4, 0], 0), (vec![0], 0)] {
            let x = Tensor::zeros(dev, &shape, dt).map_err(e)?;
            check_cols(dev, dt, &shape, &[], SumCheck::Full)?;
            if x.sum_leading_dims().map_err(e)?.shape() != [cols] {
                return Err(format!("{dt:?}: the column sums of {shape:?} do not have shape [{cols}]"));
            }
        }
        let invalid = |what: &str, r: kernels::Result<Tensor>| match r {
            Err(Error::InvalidArgument { op: "reduce_leading_dims", .. }) => Ok(()),
            other => Err(format!("{dt:?}: {what} gave {:?}, want InvalidArgument", other.map(|t| t.shape().to_vec()))),
        };
        let s = tensor(dev, &[1.0], &[], dt)?;
        invalid("a scalar", ops::reduce_leading_dims(&s, ReduceOp::Sum))?;
        let m = Tensor::zeros(dev, &[3, 4], dt).map_err(e)?;
        invalid("max", ops::reduce_leading_dims(&m, ReduceOp::Max))?;
        invalid("min", ops::reduce_leading_dims(&m, ReduceOp::Min))?;
        // The `_out` variant refuses an output of another shape or dtype.
        let other = if dt == DType::F32 { DType::BF16 } else { DType::F32 };
        for (shape, odt) in [(vec![3usize], dt), (vec![1, 4], dt), (vec![4], other)] {
            let mut o = Tensor::zeros(dev, &shape, odt).map_err(e)?;
            if ops::reduce_leading_dims_out(&m, ReduceOp::Sum, &mut o).is_ok() {
                return Err(format!("{dt:?}: reduce_leading_dims_out of [3, 4] into {odt:?} {shape:?} succeeded"));
            }
        }
    }
    Ok(())
}

// --- fixed cases ----------------------------------------------------------------------------------

/// Specials planted at known places in finite data, in long rows and across rows, blocks and
/// threads: propagation and first-index rules.
fn ieee_propagation(dev: &Device) -> Result<(), String> {
    let n = if sanitizer() { 4099 } else { 100_003 };
    let base = |seed| {
        let mut rng = TestRng::new(seed);
        (0..n).map(|_| (rng.normal() * 2.0) as f32).collect::<Vec<f32>>()
    };
    let plant = |mut v: Vec<f32>, at: &[(usize, f32)]| {
        for &(i, x) in at {
            v[i % n] = x;
        }
        v
    };
    let cases: Vec<(&str, Vec<f32>)> = vec![
        // +inf and -inf: the sum and mean are NaN, max +inf, min -inf, argmax the +inf.
        ("inf and -inf", plant(base(1), &[(5000, f32::INFINITY), (90_000, f32::NEG_INFINITY)])),
        // Only +inf: +inf.
        ("+inf", plant(base(2), &[(77, f32::INFINITY), (250_001, f32::INFINITY)])),
        // NaN anywhere poisons every value result; argmax is the first NaN.
        ("NaNs", plant(base(3), &[(10, f32::INFINITY), (77_777, f32::NAN), (88_888, f32::NAN), (3, f32::NAN)])),
        ("one late NaN", plant(base(4), &[(n - 1, f32::NAN)])),
        // Ties of the maximum: the first index, wherever the copies are.
        ("tied maxima", plant(base(5), &[(200_000, 50.0), (40_001, 50.0), (40_000, 50.0), (299_999, 50.0)])),
        ("all -inf", vec![f32::NEG_INFINITY; n]),
        ("-inf but one", plant(vec![f32::NEG_INFINITY; n], &[(123_457, -5.0)])),
        ("signed zeros", (0..n).map(|i| if i % 3 == 0 { -0.0 } else { 0.0 }).collect()),
    ];
    for dt in DType::ALL {
        for (what, xs) in &cases {
            let xs: Vec<f32> = xs.iter().map(|&x| round_to(dt, x)).collect();
            // One long row, then rows of every length's flavour: 1, unaligned, aligned.
            for cols in [n, 1, 7, 1024, 4099] {
                let rows = n / cols;
                let v = &xs[..rows * cols];
                check_all(dev, dt, &shape_of(rows, cols), v, SumCheck::Full).map_err(|m| format!("{what}: {m}"))?;
            }
        }
    }
    Ok(())
}

/// Scalars, empty tensors and shapes: PyTorch's results and errors.
fn edges(dev: &Device) -> Result<(), String> {
    for dt in DType::ALL {
        // A scalar is one row of one element.
        let s = tensor(dev, &[round_to(dt, -2.5)], &[], dt)?;
        for op in OPS {
            for r in [ops::reduce(&s, op), ops::reduce_last_dim(&s, op)] {
                let r = r.map_err(e)?;
                let got = (r.shape().to_vec(), r.to_f32_vec().map_err(e)?);
                if got != (vec![], vec![round_to(dt, -2.5)]) {
                    return Err(format!("{op:?} of a {dt:?} scalar: {got:?}"));
                }
            }
        }
        for a in [ops::argmax(&s), ops::argmax_last_dim(&s)] {
            let a = a.map_err(e)?;
            if (a.shape().to_vec(), a.to_vec().map_err(e)?) != (vec![], vec![0]) {
                return Err(format!("argmax of a {dt:?} scalar"));
            }
        }

        // Empty ranges: sums are 0, means NaN, the others errors.
        let empty = Tensor::zeros(dev, &[0], dt).map_err(e)?;
        let val = |r: kernels::Result<Tensor>| -> Result<(Vec<usize>, Vec<f32>), String> {
            let r = r.map_err(e)?;
            Ok((r.shape().to_vec(), r.to_f32_vec().map_err(e)?))
        };
        if val(empty.sum())? != (vec![], vec![0.0]) {
            return Err(format!("{dt:?}: sum of nothing is not 0"));
        }
        let m = val(empty.mean())?;
        if m.0 != Vec::<usize>::new() || !m.1[0].is_nan() {
            return Err(format!("{dt:?}: mean of nothing is {m:?}, not NaN"));
        }
        let invalid = |what: &str, r: Result<(), Error>| match r {
            Err(Error::InvalidArgument { .. }) => Ok(()),
            other => Err(format!("{dt:?}: {what} gave {other:?}, want InvalidArgument")),
        };
        let r2 = Tensor::zeros(dev, &[3, 0], dt).map_err(e)?;
        invalid("argmax of [0]", empty.argmax().map(drop))?;
        invalid("max of [0]", empty.max().map(drop))?;
        invalid("min of [0]", empty.min().map(drop))?;
        invalid("max of [3, 0]", r2.max().map(drop))?;
        invalid("argmax of [3, 0]", r2.argmax().map(drop))?;
        invalid("max_last_dim of [3, 0]", r2.max_last_dim().map(drop))?;
        invalid("min_last_dim of [3, 0]", r2.min_last_dim().map(drop))?;
        invalid("argmax_last_dim of [3, 0]", r2.argmax_last_dim().map(drop))?;
        invalid("max_last_dim of [0]", empty.max_last_dim().map(drop))?;
        if val(r2.sum_last_dim())? != (vec![3], vec![0.0; 3]) {
            return Err(format!("{dt:?}: sum_last_dim of [3, 0]"));
        }
        let m = val(r2.mean_last_dim())?;
        if m.0 != [3] || !m.1.iter().all(|v| v.is_nan()) {
            return Err(format!("{dt:?}: mean_last_dim of [3, 0] is {m:?}"));
        }
        // No rows: empty results of the right shape, for every op.
        let r0 = Tensor::zeros(dev, &[0, 4, 5], dt).map_err(e)?;
        for op in OPS {
            if val(ops::reduce_last_dim(&r0, op))? != (vec![0, 4], vec![]) {
                return Err(format!("{dt:?}: {op:?}_last_dim of [0, 4, 5]"));
            }
        }
        let a: IndexTensor = r0.argmax_last_dim().map_err(e)?;
        if a.shape() != [0, 4] || a.numel() != 0 {
            return Err(format!("{dt:?}: argmax_last_dim of [0, 4, 5] has shape {:?}", a.shape()));
        }
    }
    Ok(())
}

/// The same input twice gives the same bits, whole and along rows (2^24 elements: every stage-1
/// block loops and stage 2 combines a full wave of partials).
fn determinism(dev: &Device) -> Result<(), String> {
    let (rows, cols) = if sanitizer() { (16, 1024) } else { (4096, 4096) };
    for dt in [DType::F32, DType::BF16] {
        let x = Tensor::rand_normal(dev, &[rows, cols], dt, 0.1, 2.0, 5).map_err(e)?;
        let bits = |t: Tensor| -> Result<Vec<u32>, String> {
            Ok(t.to_f32_vec().map_err(e)?.into_iter().map(f32::to_bits).collect())
        };
        for op in OPS {
            let (a, b) = (bits(ops::reduce(&x, op).map_err(e)?)?, bits(ops::reduce(&x, op).map_err(e)?)?);
            if a != b {
                return Err(format!("{dt:?} {op:?}: {a:x?} then {b:x?}"));
            }
            let (a, b) =
                (bits(ops::reduce_last_dim(&x, op).map_err(e)?)?, bits(ops::reduce_last_dim(&x, op).map_err(e)?)?);
            if a != b {
                return Err(format!("{dt:?} {op:?}_last_dim differs between two runs"));
            }
        }
        let (a, b) = (x.argmax().map_err(e)?.to_vec().map_err(e)?, x.argmax().map_err(e)?.to_vec().map_err(e)?);
        if a != b {
            return Err(format!("{dt:?} argmax: {a:?} then {b:?}"));
        }
    }
    Ok(())
}

/// 2^26 elements against the f64 sum: the bound holds where the per-thread chains are longest.
fn large_sum(dev: &Device) -> Result<(), String> {
    let n = if sanitizer() { 1 << 16 } else { 1 << 26 };
    let x = Tensor::rand_normal(dev, &[n], DType::F32, 0.25, 1.0, 11).map_err(e)?;
    let xs = x.to_f32_vec().map_err(e)?;
    let ex = exact(&xs);
    let depth = ops::reduce_sum_depth(&x, false).map_err(e)?;
    for op in OPS {
        let got = ops::reduce(&x, op).map_err(e)?.to_f32_vec().map_err(e)?[0];
        check_value(DType::F32, op, got, &ex, depth, SumCheck::Full).map_err(|m| format!("2^26 f32: {m}"))?;
    }
    let a = x.argmax().map_err(e)?.to_vec().map_err(e)?;
    if a != [ex.argmax] {
        return Err(format!("2^26 f32 argmax: {a:?}, want {}", ex.argmax));
    }
    Ok(())
}

/// More than 2^31 elements (u64 indices everywhere): a constant bf16 tensor, whose sum is its
/// length, whole and as two rows of 2^30 + 2049.
fn beyond_2_31(dev: &Device) -> Result<(), String> {
    let n: usize = if sanitizer() { (1 << 20) + 4098 } else { (1 << 31) + 4098 };
    let x = Tensor::full(dev, &[n], DType::BF16, 1.0).map_err(e)?;
    let ex = Exact { sum: n as f64, abs: n as f64, max: 1.0, min: 1.0, argmax: 0, n };
    let depth = ops::reduce_sum_depth(&x, false).map_err(e)?;
    for op in OPS {
        let got = ops::reduce(&x, op).map_err(e)?.to_f32_vec().map_err(e)?[0];
        check_value(DType::BF16, op, got, &ex, depth, SumCheck::Full).map_err(|m| format!("{n} ones: {m}"))?;
    }
    if x.argmax().map_err(e)?.to_vec().map_err(e)? != [0] {
        return Err(format!("argmax of {n} ones is not 0"));
    }
    let x = x.reshape(&[2, n / 2]).map_err(e)?;
    let half = Exact { sum: (n / 2) as f64, abs: (n / 2) as f64, n: n / 2, ..ex };
    let depth = ops::reduce_sum_depth(&x, true).map_err(e)?;
    let got = x.sum_last_dim().map_err(e)?.to_f32_vec().map_err(e)?;
    for g in got {
        check_value(DType::BF16, ReduceOp::Sum, g, &half, depth, SumCheck::Full)
            .map_err(|m| format!("rows of {} ones: {m}", n / 2))?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for dt in DType::ALL {
        tests.push(test(format!("reduce/proptest_{}", dt.suffix()), move |dev| prop_case(dev, dt)));
    }
    for dt in DType::ALL {
        tests.push(test(format!("reduce/leading_dims_proptest_{}", dt.suffix()), move |dev| cols_prop_case(dev, dt)));
    }
    tests.push(test("reduce/leading_dims_tall", cols_tall));
    tests.push(test("reduce/leading_dims_edges", cols_edges));
    tests.push(test("reduce/ieee_propagation", ieee_propagation));
    tests.push(test("reduce/edges", edges));
    tests.push(test("reduce/determinism", determinism));
    tests.push(test("reduce/large_sum_2^26", large_sum));
    tests.push(test("reduce/beyond_2^31", beyond_2_31));
    run(tests)
}
