//! Slicing and joining along a dimension: `narrow`, `split`, `chunk`, `cat`, `stack`. Tensors
//! are contiguous, so each result is a copy (one strided 2-D copy by the driver per input, no
//! kernel): the part of a row-major tensor along dimension `d` is `outer` rows of a contiguous
//! run, where `outer` is the product of the dimensions before `d`.

use crate::error::{Error, Result};
use crate::tensor::numel;
use crate::{Device, Tensor};

/// `(outer, dim, inner)`: the products of the dimensions before `d`, `d` itself, and after.
fn split_at(op: &'static str, shape: &[usize], d: usize) -> Result<(usize, usize, usize)> {
    if d >= shape.len() {
        return Err(Error::InvalidArgument {
            op,
            message: format!("dimension {d} of a tensor of rank {} (shape {shape:?})", shape.len()),
        });
    }
    Ok((numel(op, &shape[..d])?, shape[d], numel(op, &shape[d + 1..])?))
}

impl Tensor {
    /// The elements `start..start + len` along dimension `dim`, as PyTorch's `narrow` (a copy:
    /// tensors here are contiguous).
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let op = "Tensor::narrow";
        let (outer, n, inner) = split_at(op, self.shape(), dim)?;
        if start.checked_add(len).is_none_or(|end| end > n) {
            return Err(Error::InvalidArgument {
                op,
                message: format!("{start}..{start}+{len} along dimension {dim} of size {n}"),
            });
        }
        let mut shape = self.shape().to_vec();
        shape[dim] = len;
        let mut out = Tensor::alloc(op, self.device(), &shape, self.dtype())?;
        let e = self.dtype().size();
        let src = self.buffer();
        src.copy_rows_to(
            start * inner * e,
            n * inner * e,
            out.buf_mut(op)?,
            0,
            len * inner * e,
            len * inner * e,
            outer,
        )?;
        Ok(out)
    }

    /// Pieces of the given sizes along `dim`, which must add up to its size (PyTorch's `split`
    /// with a list).
    pub fn split(&self, dim: usize, sizes: &[usize]) -> Result<Vec<Tensor>> {
        let op = "Tensor::split";
        let (_, n, _) = split_at(op, self.shape(), dim)?;
        let total = sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s));
        if total != Some(n) {
            return Err(Error::InvalidArgument {
                op,
                message: format!("sizes {sizes:?} do not add up to {n}, the size of dimension {dim}"),
            });
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&len| {
                let t = self.narrow(dim, start, len);
                start += len;
                t
            })
            .collect()
    }

    /// `chunks` pieces along `dim` of `ceil(size / chunks)` each, the last smaller (or fewer
    /// pieces when the size is small), as PyTorch's `chunk`.
    pub fn chunk(&self, chunks: usize, dim: usize) -> Result<Vec<Tensor>> {
        let op = "Tensor::chunk";
        let (_, n, _) = split_at(op, self.shape(), dim)?;
        if chunks == 0 {
            return Err(Error::InvalidArgument { op, message: "0 chunks".into() });
        }
        let each = n.div_ceil(chunks).max(1);
        let sizes: Vec<usize> = (0..n.div_ceil(each)).map(|i| each.min(n - i * each)).collect();
        if sizes.is_empty() {
            // A dimension of size 0: one empty piece, as PyTorch returns.
            return Ok(vec![self.narrow(dim, 0, 0)?]);
        }
        self.split(dim, &sizes)
    }

    /// The tensors joined along `dim` (PyTorch's `cat`): every one on the same device, of the
    /// same dtype and rank, equal in every other dimension.
    pub fn cat(tensors: &[&Tensor], dim: usize) -> Result<Tensor> {
        let op = "Tensor::cat";
        let first = tensors.first().ok_or(Error::InvalidArgument { op, message: "no tensors".into() })?;
        let (outer, _, inner) = split_at(op, first.shape(), dim)?;
        let mut total = 0usize;
        for t in tensors {
            check_like(op, first, t)?;
            let same_rank = t.shape().len() == first.shape().len();
            let same_rest =
                same_rank && t.shape().iter().zip(first.shape()).enumerate().all(|(i, (a, b))| i == dim || a == b);
            if !same_rest {
                return Err(Error::ShapeMismatch {
                    op,
                    expected: first.shape().to_vec(),
                    got: t.shape().to_vec(),
                    detail: "tensors joined must agree in every dimension but the one joined along",
                });
            }
            total = total
                .checked_add(t.shape()[dim])
                .ok_or(Error::InvalidArgument { op, message: "the joined dimension overflows".into() })?;
        }
        let mut shape = first.shape().to_vec();
        shape[dim] = total;
        let mut out = Tensor::alloc(op, first.device(), &shape, first.dtype())?;
        let e = first.dtype().size();
        let mut at = 0;
        let dst = out.buf_mut(op)?;
        for t in tensors {
            let n = t.shape()[dim];
            let src = t.buffer();
            src.copy_rows_to(0, n * inner * e, dst, at * inner * e, total * inner * e, n * inner * e, outer)?;
            at += n;
        }
        Ok(out)
    }

    /// The tensors, all of one shape, stacked along a new dimension `dim` (`0..=rank`), as
    /// PyTorch's `stack`.
    pub fn stack(tensors: &[&Tensor], dim: usize) -> Result<Tensor> {
        let op = "Tensor::stack";
        let first = tensors.first().ok_or(Error::InvalidArgument { op, message: "no tensors".into() })?;
        if dim > first.shape().len() {
            return Err(Error::InvalidArgument {
                op,
                message: format!("new dimension {dim} of a tensor of rank {}", first.shape().len()),
            });
        }
        for t in tensors {
            check_like(op, first, t)?;
            if t.shape() != first.shape() {
                return Err(Error::ShapeMismatch {
                    op,
                    expected: first.shape().to_vec(),
                    got: t.shape().to_vec(),
                    detail: "tensors stacked must have one shape",
                });
            }
        }
        // Each one with a dimension of 1 inserted at `dim`, joined along it. The reshape of a
        // clone shares the memory: nothing is copied but by `cat`.
        let mut shape = first.shape().to_vec();
        shape.insert(dim, 1);
        let lifted = tensors.iter().map(|t| Tensor::clone(t).reshape(&shape)).collect::<Result<Vec<_>>>()?;
        Tensor::cat(&lifted.iter().collect::<Vec<_>>(), dim)
    }

    /// `start, start + step, ...` below `end` (above it for a negative step), as PyTorch's
    /// `arange`: computed in f64 on the host, rounded to `dtype`, copied to the device.
    pub fn arange(dev: &Device, start: f64, end: f64, step: f64, dtype: crate::DType) -> Result<Tensor> {
        let op = "Tensor::arange";
        let n = ((end - start) / step).ceil();
        if step == 0.0 || !n.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::InvalidArgument { op, message: format!("arange({start}, {end}, {step})") });
        }
        let n = n.max(0.0) as usize;
        let v: Vec<f32> = (0..n).map(|i| (start + i as f64 * step) as f32).collect();
        Tensor::from_f32(dev, &v, &[n], dtype)
    }
}

fn check_like(op: &'static str, first: &Tensor, t: &Tensor) -> Result<()> {
    if t.device() != first.device() {
        return Err(Error::DeviceMismatch { op, expected: first.device().ordinal(), got: t.device().ordinal() });
    }
    if t.dtype() != first.dtype() {
        return Err(Error::DTypeMismatch { op, expected: first.dtype(), got: t.dtype() });
    }
    Ok(())
}
