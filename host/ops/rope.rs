//! Rotary position embedding (host side of `kernels-gpu/src/rope.rs`): [`rope`] (also
//! [`rope_out`], [`rope_inplace`]), its backward [`rope_backward`] (`_out`, `_inplace`), and the
//! tables, [`rope_tables`].

use super::attention::Layout;
use super::check::{check_same_device, check_same_dtype, check_same_shape, with_elem};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::Tensor;
use kernels_gpu::DType;
use kernels_gpu::rope::{RopeArgs, RopeElem, items};

/// Which elements of a row form the rotated pairs ([`RopeOpts::style`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RopeStyle {
    /// `(i, i + R / 2)` for `i < R / 2` (GPT-NeoX, LLaMA; Hugging Face's `rotate_half`).
    #[default]
    Half,
    /// `(2 i, 2 i + 1)` (GPT-J, Meta's original LLaMA code with complex numbers).
    Interleaved,
}

/// The options of [`rope`]. `RopeOpts::default()`: [`Layout::Bhsd`], [`RopeStyle::Half`], the
/// first row at position 0, the whole head dimension rotated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RopeOpts {
    /// The memory layout of `x` (and of the output).
    pub layout: Layout,
    /// The pairs.
    pub style: RopeStyle,
    /// The position of the first row of the sequence (a KV cache's length): row `s` is at
    /// position `offset + s`.
    pub offset: usize,
    /// `R`: the first `R` elements of each row are rotated, the rest pass through unchanged;
    /// `None`: all `D`. Even, from 2 to `D`.
    pub rotary_dim: Option<usize>,
}

/// What the kernel needs of the shapes, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dims {
    rows: u64,
    d: u64,
    rot: u64,
    seq: u64,
    inner: u64,
}

/// Checks `x`'s shape (rank 4 in `opts.layout`) against the tables' (`[max_pos, R / 2]` each,
/// `offset + S <= max_pos`).
fn dims(op: &'static str, x: &[usize], cos: &[usize], sin: &[usize], opts: &RopeOpts) -> Result<Dims> {
    let &[b, s1, s2, d] = x else {
        return Err(Error::InvalidArgument {
            op,
            message: format!("x must have rank 4 ({:?}), got shape {x:?}", opts.layout),
        });
    };
    let (h, s) = match opts.layout {
        Layout::Bhsd => (s1, s2),
        Layout::Bshd => (s2, s1),
    };
    let rot = opts.rotary_dim.unwrap_or(d);
    if rot < 2 || !rot.is_multiple_of(2) || rot > d {
        return Err(Error::InvalidArgument {
            op,
            message: format!("the rotary dimension must be even, from 2 to the head dimension {d}, got {rot}"),
        });
    }
    if cos.len() != 2 || cos[1] != rot / 2 {
        let max_pos = cos.first().copied().unwrap_or(0);
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![max_pos, rot / 2],
            got: cos.to_vec(),
            detail: "cos must be [max_pos, rotary_dim / 2]",
        });
    }
    if sin != cos {
        return Err(Error::ShapeMismatch {
            op,
            expected: cos.to_vec(),
            got: sin.to_vec(),
            detail: "sin must have the shape of cos",
        });
    }
    if s > 0 && opts.offset.checked_add(s).is_none_or(|end| end > cos[0]) {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "rows at positions {}..{} need tables of as many positions, got {}",
                opts.offset,
                opts.offset as u128 + s as u128,
                cos[0]
            ),
        });
    }
    let inner = match opts.layout {
        Layout::Bhsd => 1,
        Layout::Bshd => h,
    };
    // b * h * s * d is x's element count, which its allocation checked.
    Ok(Dims { rows: (b * h * s) as u64, d: d as u64, rot: rot as u64, seq: s as u64, inner: inner.max(1) as u64 })
}

/// Checks the operands: tables f32 on x's device, shapes as [`dims`] says.
fn check(op: &'static str, x: &Tensor, cos: &Tensor, sin: &Tensor, opts: &RopeOpts) -> Result<Dims> {
    check_same_device(op, x, cos)?;
    check_same_device(op, x, sin)?;
    for t in [cos, sin] {
        if t.dtype() != DType::F32 {
            return Err(Error::DTypeMismatch { op, expected: DType::F32, got: t.dtype() });
        }
    }
    dims(op, x.shape(), cos.shape(), sin.shape(), opts)
}

/// Where the kernel reads and writes.
enum Target<'a> {
    /// From `x` into `y`, a new tensor of its shape and dtype.
    Out(&'a Tensor, &'a mut Tensor),
    /// Over `x`.
    InPlace(&'a mut Tensor),
}

/// Launches the rotation by `sign` times the tables' angle (`dims` and the tables checked).
fn run(target: Target, cos: &Tensor, sin: &Tensor, opts: &RopeOpts, dims: Dims, sign: f32) -> Result<()> {
    let x = match &target {
        Target::Out(x, _) => *x,
        Target::InPlace(x) => &**x,
    };
    let Dims { rows, d, rot, seq, inner } = dims;
    let (dt, dev) = (x.dtype(), x.device().clone());
    let il = opts.style == RopeStyle::Interleaved;
    let (rot_items, pass_items) = items(dt, d, rot, il);
    let in_place = matches!(target, Target::InPlace(_));
    let n = rows * (rot_items + if in_place { 0 } else { pass_items });
    if n == 0 {
        return Ok(());
    }
    with_elem!(dt, |T| {
        let kernel = <T as RopeElem>::ROPE;
        let Some(cfg) = launch::elementwise(n, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?) else {
            return Ok(());
        };
        let (xp, yp): (*const T, *mut T) = match target {
            Target::Out(x, y) => (x.dev_ptr(), y.dev_ptr_mut()?),
            Target::InPlace(x) => {
                let p = x.dev_ptr_mut::<T>()?;
                (p.cast_const(), p)
            }
        };
        let args: RopeArgs<T> =
            (xp, yp, cos.dev_ptr(), sin.dev_ptr(), rows, d, rot, seq, inner, opts.offset as u64, il as u32, sign);
        // SAFETY: x and y (a new allocation of x's shape and dtype, or x itself in place) hold
        // `rows` rows of d elements of T, whole allocations (16-byte aligned); the tables are f32
        // on x's device and hold rot / 2 values for every position from offset to offset + seq
        // (`check`), and this launch does not write them (x's memory is its own: `dev_ptr_mut`
        // copies memory shared with a clone first).
        unsafe { dev.launch(kernel, cfg, args) }
    })
}

/// Rotary position embedding: `x` with each pair `(a, b)` of the first `R` elements of each row
/// rotated by its position's angle, `(a cos - b sin, b cos + a sin)`, the rest of the row as is.
///
/// - `x`: `[B, H, S, D]` ([`Layout::Bhsd`]) or `[B, S, H, D]` ([`Layout::Bshd`]); f32, bf16 or
///   f16 (the math in f32, the result rounded once to x's dtype).
/// - `cos`, `sin`: f32 `[max_pos, R / 2]`: entry `[p, i]` is the cosine and sine of pair `i`'s
///   angle at position `p` (e.g. [`rope_tables`]); row `s` of the sequence is at position
///   `offset + s`, which must be below `max_pos`.
/// - The pairs: [`RopeStyle`]. `R`: [`RopeOpts::rotary_dim`] (even, from 2 to `D`).
/// - A NaN or infinity reaches only the two outputs of its pair.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, opts: &RopeOpts) -> Result<Tensor> {
    rotate("rope", x, cos, sin, opts, 1.0)
}

/// [`rope`] into `out`, which must have `x`'s shape, dtype and device.
pub fn rope_out(x: &Tensor, cos: &Tensor, sin: &Tensor, opts: &RopeOpts, out: &mut Tensor) -> Result<()> {
    rotate_out("rope_out", x, cos, sin, opts, 1.0, out)
}

/// [`rope`] in place: `x` is overwritten (the pass-through part is not touched).
pub fn rope_inplace(x: &mut Tensor, cos: &Tensor, sin: &Tensor, opts: &RopeOpts) -> Result<()> {
    rotate_inplace("rope_inplace", x, cos, sin, opts, 1.0)
}

/// The gradient of [`rope`] with respect to `x`, given the gradient of its output `grad` (of
/// `x`'s shape): the rotation by the opposite angle, `(a cos + b sin, b cos - a sin)` a pair, the
/// pass-through part unchanged. The same arguments as [`rope`].
pub fn rope_backward(grad: &Tensor, cos: &Tensor, sin: &Tensor, opts: &RopeOpts) -> Result<Tensor> {
    rotate("rope_backward", grad, cos, sin, opts, -1.0)
}

/// [`rope_backward`] into `out`, which must have `grad`'s shape, dtype and device.
pub fn rope_backward_out(grad: &Tensor, cos: &Tensor, sin: &Tensor, opts: &RopeOpts, out: &mut Tensor) -> Result<()> {
    rotate_out("rope_backward_out", grad, cos, sin, opts, -1.0, out)
}

/// [`rope_backward`] in place: `grad` is overwritten with the gradient of `x`.
pub fn rope_backward_inplace(grad: &mut Tensor, cos: &Tensor, sin: &Tensor, opts: &RopeOpts) -> Result<()> {
    rotate_inplace("rope_backward_inplace", grad, cos, sin, opts, -1.0)
}

fn rotate(op: &'static str, x: &Tensor, cos: &Tensor, sin: &Tensor, opts: &RopeOpts, sign: f32) -> Result<Tensor> {
    let dims = check(op, x, cos, sin, opts)?;
    let mut y = x.alloc_like(op)?;
    run(Target::Out(x, &mut y), cos, sin, opts, dims, sign)?;
    Ok(y)
}

fn rotate_out(
    op: &'static str,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    opts: &RopeOpts,
    sign: f32,
    out: &mut Tensor,
) -> Result<()> {
    let dims = check(op, x, cos, sin, opts)?;
    check_same_device(op, x, out)?;
    check_same_dtype(op, x, out)?;
    check_same_shape(op, x, out, "out must have the input's shape")?;
    run(Target::Out(x, out), cos, sin, opts, dims, sign)
}

fn rotate_inplace(
    op: &'static str,
    x: &mut Tensor,
    cos: &Tensor,
    sin: &Tensor,
    opts: &RopeOpts,
    sign: f32,
) -> Result<()> {
    let dims = check(op, x, cos, sin, opts)?;
    run(Target::InPlace(x), cos, sin, opts, dims, sign)
}

/// The tables of [`rope`] for positions `0..max_pos` and a rotary dimension `R`
/// (`rotary_dim`, even and at least 2), as LLaMA's: pair `i` turns by `p * base^(-2 i / R)` at
/// position `p`. Computed in f64 on the host and rounded once to f32 (Hugging Face computes
/// the angle in f32, which at positions in the thousands is off by more than an f32 ulp of its
/// cosine). Returns `(cos, sin)`, each f32 `[max_pos, R / 2]`.
pub fn rope_tables(dev: &Device, max_pos: usize, rotary_dim: usize, base: f64) -> Result<(Tensor, Tensor)> {
    let op = "rope_tables";
    let (c, s) = rope_table_values(op, max_pos, rotary_dim, base)?;
    let shape = [max_pos, rotary_dim / 2];
    Ok((Tensor::from_slice(dev, &c, &shape)?, Tensor::from_slice(dev, &s, &shape)?))
}

/// The values of [`rope_tables`], row-major.
fn rope_table_values(op: &'static str, max_pos: usize, rot: usize, base: f64) -> Result<(Vec<f32>, Vec<f32>)> {
    if rot < 2 || !rot.is_multiple_of(2) {
        return Err(Error::InvalidArgument {
            op,
            message: format!("rotary_dim must be even and at least 2, got {rot}"),
        });
    }
    if !(base.is_finite() && base > 0.0) {
        return Err(Error::InvalidArgument { op, message: format!("base must be finite and positive, got {base}") });
    }
    let half = rot / 2;
    let n = max_pos.checked_mul(half).ok_or_else(|| Error::InvalidArgument {
        op,
        message: format!("{max_pos} positions of {half} pairs overflow usize"),
    })?;
    let inv_freq: Vec<f64> = (0..half).map(|i| base.powf(-2.0 * i as f64 / rot as f64)).collect();
    let (mut c, mut s) = (Vec::new(), Vec::new());
    for v in [&mut c, &mut s] {
        v.try_reserve_exact(n).map_err(|_| Error::InvalidArgument {
            op,
            message: format!("tables of {max_pos} positions of {half} pairs do not fit in host memory"),
        })?;
    }
    for p in 0..max_pos {
        for &f in &inv_freq {
            let a = p as f64 * f;
            c.push(a.cos() as f32);
            s.push(a.sin() as f32);
        }
    }
    Ok((c, s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(layout: Layout, rotary_dim: Option<usize>, offset: usize) -> RopeOpts {
        RopeOpts { layout, style: RopeStyle::Half, offset, rotary_dim }
    }

    #[test]
    fn dims_follow_the_layout() {
        let o = opts(Layout::Bhsd, None, 0);
        let d = dims("rope", &[2, 3, 5, 64], &[5, 32], &[5, 32], &o).unwrap();
        assert_eq!(d, Dims { rows: 30, d: 64, rot: 64, seq: 5, inner: 1 });
        let o = opts(Layout::Bshd, Some(16), 7);
        let d = dims("rope", &[2, 5, 3, 64], &[12, 8], &[12, 8], &o).unwrap();
        assert_eq!(d, Dims { rows: 30, d: 64, rot: 16, seq: 5, inner: 3 });
        // Empty tensors are fine, with tables of any length for S = 0.
        let o = opts(Layout::Bshd, None, 0);
        assert_eq!(dims("rope", &[0, 0, 0, 8], &[0, 4], &[0, 4], &o).unwrap().rows, 0);
    }

    #[test]
    fn bad_shapes_are_typed_errors() {
        let o = opts(Layout::Bhsd, None, 0);
        let bad = |x: &[usize], c: &[usize], s: &[usize], o: &RopeOpts| dims("rope", x, c, s, o).unwrap_err();
        assert!(matches!(bad(&[2, 3, 64], &[5, 32], &[5, 32], &o), Error::InvalidArgument { .. }));
        // An odd head dimension, a rotary dimension odd, 0 or beyond D.
        assert!(matches!(bad(&[1, 1, 5, 7], &[5, 3], &[5, 3], &o), Error::InvalidArgument { .. }));
        for r in [0, 1, 3, 66] {
            let err = bad(&[1, 1, 5, 64], &[5, 32], &[5, 32], &opts(Layout::Bhsd, Some(r), 0));
            assert!(matches!(err, Error::InvalidArgument { .. }) && err.to_string().starts_with("rope: "));
        }
        // Tables of the wrong width or rank, or unlike each other.
        assert!(matches!(bad(&[1, 1, 5, 64], &[5, 64], &[5, 64], &o), Error::ShapeMismatch { .. }));
        assert!(matches!(bad(&[1, 1, 5, 64], &[160], &[160], &o), Error::ShapeMismatch { .. }));
        assert!(matches!(bad(&[1, 1, 5, 64], &[5, 32], &[6, 32], &o), Error::ShapeMismatch { .. }));
        // Too short for the sequence at its offset, or an offset that overflows.
        assert!(matches!(bad(&[1, 1, 5, 64], &[4, 32], &[4, 32], &o), Error::InvalidArgument { .. }));
        let err = bad(&[1, 1, 5, 64], &[10, 32], &[10, 32], &opts(Layout::Bhsd, None, 6));
        assert!(err.to_string().contains("6..11"), "{err}");
        assert!(dims("rope", &[1, 1, 5, 64], &[10, 32], &[10, 32], &opts(Layout::Bhsd, None, 5)).is_ok());
        let err = bad(&[1, 1, 5, 64], &[10, 32], &[10, 32], &opts(Layout::Bhsd, None, usize::MAX));
        assert!(matches!(err, Error::InvalidArgument { .. }));
    }

    #[test]
    fn tables_are_llama_s() {
        let (c, s) = rope_table_values("t", 3, 4, 10000.0).unwrap();
        assert_eq!((c.len(), s.len()), (6, 6));
        // Position 0: angle 0. Position 2, pair 1: 2 * 10000^(-1/2) = 0.02.
        assert_eq!((&c[..2], &s[..2]), (&[1.0f32, 1.0][..], &[0.0f32, 0.0][..]));
        assert_eq!((c[5], s[5]), (0.02f64.cos() as f32, 0.02f64.sin() as f32));
        assert_eq!((c[4], s[4]), (2f64.cos() as f32, 2f64.sin() as f32));
        for (r, b) in [(0, 1e4), (3, 1e4), (4, 0.0), (4, f64::NAN), (4, -2.0)] {
            assert!(matches!(rope_table_values("t", 3, r, b), Err(Error::InvalidArgument { .. })));
        }
        assert!(matches!(rope_table_values("t", usize::MAX, 4, 1e4), Err(Error::InvalidArgument { .. })));
    }
}
