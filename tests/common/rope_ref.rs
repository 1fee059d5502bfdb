//! The f64 reference of RoPE (`ops::rope`, `ops::rope_backward`) and its error bound.
//!
//! Error model: the kernel computes each output of a pair `(a, b)` as `a c - b s` or `b c + a s`
//! in f32, two products and a sum each rounded once (`kernels_gpu::rope::rotate`), so it is
//! within `u (|p| + |q|) (2 + u)` of the exact value, `u = 2^-24`, `p` and `q` its two products:
//! [`tol`] allows `2^-23 (1 + 2^-20) (|p| + |q|)`. Then one rounding to the storage type, which `close`
//! adds (one ulp of the dtype). The reference uses the tables' f32 values, so their own rounding
//! is no error of the kernel.

use super::reference::Tol;
use kernels::ops::{Layout, RopeOpts, RopeStyle};

/// The inputs of one rotated output: its pair `(a, b)` (the output is `a c - b s` when `first`,
/// else `b c + a s`), and `c`, `s` (the sine already times the sign).
#[derive(Clone, Copy, Debug)]
pub struct Pair {
    pub a: f32,
    pub b: f32,
    pub c: f32,
    pub s: f32,
    pub first: bool,
}

impl Pair {
    /// The kernel's f32 result.
    pub fn f32(&self) -> f32 {
        let (p, q) = kernels_gpu::rope::rotate(self.a, self.b, self.c, self.s);
        if self.first { p } else { q }
    }
}

/// The index pairs of a row rotated over its first `rot` elements: `(i, j, k)`, elements `i` and
/// `j` rotated by the tables' column `k`.
pub fn pairs(style: RopeStyle, rot: usize) -> Vec<(usize, usize, usize)> {
    (0..rot / 2)
        .map(|k| match style {
            RopeStyle::Half => (k, k + rot / 2, k),
            RopeStyle::Interleaved => (2 * k, 2 * k + 1, k),
        })
        .collect()
}

/// The position of each row of a `shape` (rank 4 in `layout`) tensor, in memory order.
pub fn row_positions(shape: [usize; 4], layout: Layout, offset: usize) -> Vec<usize> {
    let [b, s1, s2, _] = shape;
    let mut v = Vec::with_capacity(b * s1 * s2);
    for _ in 0..b {
        for i in 0..s1 {
            for j in 0..s2 {
                v.push(offset + if layout == Layout::Bhsd { j } else { i });
            }
        }
    }
    v
}

/// RoPE of `x` (`shape` in `opts.layout`) in f64 by the angle times `sign` (1: forward; -1: the
/// backward, applied to the output's gradient), with the tables `cos`, `sin` (`[max_pos, R / 2]`
/// row-major); and for each output, the inputs of its pair (`None`: passed through).
pub fn rope_ref(
    x: &[f32],
    shape: [usize; 4],
    opts: &RopeOpts,
    cos: &[f32],
    sin: &[f32],
    sign: f32,
) -> (Vec<f64>, Vec<Option<Pair>>) {
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let y = rope_f64(&x64, shape, opts, cos, sin, sign);
    let mut inputs = vec![None; x.len()];
    each_pair(shape, opts, |r, (i, j), t| {
        let (c, s) = (cos[t], sign * sin[t]);
        inputs[r + i] = Some(Pair { a: x[r + i], b: x[r + j], c, s, first: true });
        inputs[r + j] = Some(Pair { a: x[r + i], b: x[r + j], c, s, first: false });
    });
    (y, inputs)
}

/// [`rope_ref`]'s values, of any f64 `x` (for finite differences).
pub fn rope_f64(x: &[f64], shape: [usize; 4], opts: &RopeOpts, cos: &[f32], sin: &[f32], sign: f32) -> Vec<f64> {
    let mut y = x.to_vec();
    each_pair(shape, opts, |r, (i, j), t| {
        let (c, s) = (cos[t] as f64, (sign * sin[t]) as f64);
        let (a, b) = (x[r + i], x[r + j]);
        y[r + i] = a * c - b * s;
        y[r + j] = b * c + a * s;
    });
    y
}

/// `f(row_start, (i, j), table_index)` for every rotated pair of every row.
fn each_pair(shape: [usize; 4], opts: &RopeOpts, mut f: impl FnMut(usize, (usize, usize), usize)) {
    let d = shape[3];
    let rot = opts.rotary_dim.unwrap_or(d);
    let prs = pairs(opts.style, rot);
    for (r, pos) in row_positions(shape, opts.layout, opts.offset).into_iter().enumerate() {
        for &(i, j, k) in &prs {
            f(r * d, (i, j), pos * (rot / 2) + k);
        }
    }
}

/// The f32 rotation's error bound for an output with inputs `p` (0 for one passed through); see
/// the module's documentation.
pub fn tol(p: Option<Pair>) -> Tol {
    let atol = p.map_or(0.0, |p| {
        let (a, b, c, s) = (p.a as f64, p.b as f64, p.c as f64, p.s as f64);
        // The output's two products: `a c`, `b s` for the first, `b c`, `a s` for the second.
        let mag = if p.first { (a * c).abs() + (b * s).abs() } else { (b * c).abs() + (a * s).abs() };
        (1.0 + 1.0 / (1u64 << 20) as f64) * mag / (1u64 << 23) as f64
    });
    Tol { rtol: 0.0, atol }
}
