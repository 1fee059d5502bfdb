//! Broadcasting by NumPy's (and PyTorch's) rules, and permutes: [`broadcast_to`] materialises a
//! tensor at a larger shape, [`sum_to`] is its gradient (sums over the broadcast dimensions),
//! [`permute`] reorders dimensions; the general path of [`binary`](super::binary) and
//! [`binary_backward`](super::binary_backward) for operands of different shapes. All on the
//! strided kernels (`kernels-gpu/src/broadcast.rs`): one element a thread, correct for every shape
//! up to rank 8; the common cases keep their own kernels (same shapes: `binary`; a row along the
//! last dimension: `binary_row`).

use super::check::with_elem;
use crate::device::LaunchConfig;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use kernels_gpu::broadcast::{MAX_RANK, StridedArgs, StridedElem, StridedGeom, SumToArgs, SumToGeom};

/// The shape `a` and `b` broadcast to: aligned at their last dimensions, each pair equal or one
/// of them 1 (a missing leading dimension counts as 1); `None` where they do not broadcast.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let at = |s: &[usize], d: usize| if d + s.len() >= r { s[d + s.len() - r] } else { 1 };
    (0..r)
        .map(|d| match (at(a, d), at(b, d)) {
            (x, y) if x == y => Some(x),
            (1, y) => Some(y),
            (x, 1) => Some(x),
            _ => None,
        })
        .collect()
}

fn rank_error(op: &'static str, shape: &[usize]) -> Error {
    Error::InvalidArgument { op, message: format!("rank {} is above the strided kernels' {MAX_RANK}", shape.len()) }
}

/// The launch of one element a thread over `n`, grid-stride beyond a few waves.
fn config(x: &Tensor, n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(256).min(x.device().sm_count() as u64 * 16).max(1);
    LaunchConfig { grid: (blocks as u32, 1, 1), block: (256, 1, 1), shared_bytes: 0 }
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// A new contiguous tensor of `shape` whose element at index `i` is `x`'s at `src_strides . i`.
fn strided_copy(op: &'static str, x: &Tensor, shape: &[usize], src_strides: &[usize]) -> Result<Tensor> {
    if shape.len() > MAX_RANK {
        return Err(rank_error(op, shape));
    }
    let mut out = Tensor::alloc(op, x.device(), shape, x.dtype())?;
    let n = out.numel() as u64;
    if n == 0 {
        return Ok(out);
    }
    let mut g = StridedGeom { rank: shape.len() as u32, pad: 0, shape: [1; MAX_RANK], strides: [0; MAX_RANK] };
    for d in 0..shape.len() {
        g.shape[d] = shape[d] as u64;
        g.strides[d] = src_strides[d] as u64;
    }
    let cfg = config(x, n);
    with_elem!(x.dtype(), |T| {
        let args: StridedArgs<T> = (x.dev_ptr(), out.dev_ptr_mut()?, g, n);
        // SAFETY: every offset the geometry gives is inside x (the callers derive the strides
        // from x's own shape, 0 on broadcast dimensions); out holds n elements of T.
        unsafe { x.device().launch(T::COPY, cfg, args) }
    })?;
    Ok(out)
}

/// `x` repeated along the dimensions where it is 1 (or missing at the front) into `shape`, as a
/// new contiguous tensor (PyTorch's `x.expand(shape).contiguous()`). An error unless `x`'s
/// shape broadcasts to `shape`.
pub fn broadcast_to(x: &Tensor, shape: &[usize]) -> Result<Tensor> {
    let op = "broadcast_to";
    let s = x.shape();
    if s.len() > shape.len() || broadcast_shape(s, shape).as_deref() != Some(shape) {
        return Err(Error::ShapeMismatch {
            op,
            expected: shape.to_vec(),
            got: s.to_vec(),
            detail: "x broadcasts to the shape (each of its dimensions equal, or 1)",
        });
    }
    let lead = shape.len() - s.len();
    let xs = strides(s);
    let src: Vec<usize> =
        (0..shape.len()).map(|d| if d < lead || s[d - lead] == 1 { 0 } else { xs[d - lead] }).collect();
    strided_copy(op, x, shape, &src)
}

/// `x` summed over the dimensions where `shape` is 1 (or missing at the front): the gradient of
/// [`broadcast_to`]. f32 sums in the same order every run, rounded once to the dtype. An error
/// unless `shape` broadcasts to `x`'s shape.
pub fn sum_to(x: &Tensor, shape: &[usize]) -> Result<Tensor> {
    let op = "sum_to";
    let full = x.shape();
    if shape.len() > full.len() || broadcast_shape(shape, full).as_deref() != Some(full) {
        return Err(Error::ShapeMismatch {
            op,
            expected: full.to_vec(),
            got: shape.to_vec(),
            detail: "the shape broadcasts to x's (each of its dimensions equal, or 1)",
        });
    }
    if full.len() > MAX_RANK {
        return Err(rank_error(op, full));
    }
    if x.numel() == 0 {
        // Sums of nothing (or nothing to sum into).
        return Tensor::zeros(x.device(), shape, x.dtype());
    }
    let mut out = Tensor::alloc(op, x.device(), shape, x.dtype())?;
    let n = out.numel() as u64;
    let lead = full.len() - shape.len();
    let fs = strides(full);
    let mut g = SumToGeom {
        rank: full.len() as u32,
        pad: 0,
        kept: [1; MAX_RANK],
        summed: [1; MAX_RANK],
        strides: [0; MAX_RANK],
    };
    for d in 0..full.len() {
        let kept = d >= lead && shape[d - lead] != 1;
        g.kept[d] = if kept { full[d] as u64 } else { 1 };
        g.summed[d] = if kept { 1 } else { full[d] as u64 };
        g.strides[d] = fs[d] as u64;
    }
    let cfg = config(x, n);
    with_elem!(x.dtype(), |T| {
        let args: SumToArgs<T> = (x.dev_ptr(), out.dev_ptr_mut()?, g, n);
        // SAFETY: kept * summed is x's shape and the strides are its own, so every offset is
        // inside x; out holds the n elements of `kept`.
        unsafe { x.device().launch(T::SUM_TO, cfg, args) }
    })?;
    Ok(out)
}

/// `x` with its dimensions reordered, as a new contiguous tensor: dimension `d` of the result is
/// dimension `dims[d]` of `x` (PyTorch's `x.permute(dims).contiguous()`). An error unless `dims`
/// is a permutation of `0..rank`.
pub fn permute(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let op = "permute";
    let s = x.shape();
    let mut seen = vec![false; s.len()];
    let ok = dims.len() == s.len() && dims.iter().all(|&d| d < s.len() && !std::mem::replace(&mut seen[d], true));
    if !ok {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{dims:?} is not a permutation of the {} dimensions of {s:?}", s.len()),
        });
    }
    let xs = strides(s);
    let shape: Vec<usize> = dims.iter().map(|&d| s[d]).collect();
    let src: Vec<usize> = dims.iter().map(|&d| xs[d]).collect();
    strided_copy(op, x, &shape, &src)
}

impl Tensor {
    /// [`broadcast_to`]: this tensor repeated into `shape`.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        broadcast_to(self, shape)
    }
    /// [`sum_to`]: this tensor summed down to `shape`.
    pub fn sum_to(&self, shape: &[usize]) -> Result<Tensor> {
        sum_to(self, shape)
    }
    /// [`permute`]: this tensor's dimensions reordered.
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor> {
        permute(self, dims)
    }
}

/// `t` at `shape`: itself (shared) where it has that shape, else [`broadcast_to`].
pub(crate) fn expanded(t: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if t.shape() == shape { Ok(t.clone()) } else { broadcast_to(t, shape) }
}

/// `g` down to `shape`: itself where it has that shape, else [`sum_to`].
pub(crate) fn reduced(g: Tensor, shape: &[usize]) -> Result<Tensor> {
    if g.shape() == shape { Ok(g) } else { sum_to(&g, shape) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_broadcast_by_numpy_rules() {
        assert_eq!(broadcast_shape(&[2, 3], &[3]), Some(vec![2, 3]));
        assert_eq!(broadcast_shape(&[4, 1, 5], &[3, 1]), Some(vec![4, 3, 5]));
        assert_eq!(broadcast_shape(&[], &[2, 2]), Some(vec![2, 2]));
        assert_eq!(broadcast_shape(&[0, 1], &[1, 7]), Some(vec![0, 7]));
        assert_eq!(broadcast_shape(&[2, 3], &[3, 2]), None);
        assert_eq!(broadcast_shape(&[0], &[2]), None);
    }

    #[test]
    fn row_major_strides() {
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(strides(&[]), Vec::<usize>::new());
        assert_eq!(strides(&[5]), vec![1]);
    }
}
