//! What every op checks before it launches (devices, dtypes, shapes), and [`with_elem`], which
//! binds a dtype's storage type so one launch site serves all dtypes.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Runs `$body` with the type alias `$T` bound to the device storage type of `$dt`
/// (`f32`, `kernels_gpu::F16`, `kernels_gpu::BF16`), so one launch site serves all dtypes.
macro_rules! with_elem {
    ($dt:expr, |$T:ident| $body:expr) => {
        match $dt {
            kernels_gpu::DType::F32 => {
                type $T = f32;
                $body
            }
            kernels_gpu::DType::F16 => {
                type $T = kernels_gpu::F16;
                $body
            }
            kernels_gpu::DType::BF16 => {
                type $T = kernels_gpu::BF16;
                $body
            }
        }
    };
}
pub(crate) use with_elem;

/// `x` must have at least one dimension; returns `(rows, cols)` over the last one.
pub(crate) fn rows_cols(op: &'static str, x: &Tensor) -> Result<(u64, u64)> {
    let Some(&cols) = x.shape().last() else {
        return Err(Error::InvalidArgument {
            op,
            message: "needs a tensor with at least one dimension, got a scalar".into(),
        });
    };
    let rows = x.numel().checked_div(cols).unwrap_or(0);
    Ok((rows as u64, cols as u64))
}

pub(crate) fn check_same_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch { op, expected: a.device().ordinal(), got: b.device().ordinal() });
    }
    Ok(())
}

pub(crate) fn check_same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch { op, expected: a.dtype(), got: b.dtype() });
    }
    Ok(())
}

pub(crate) fn check_same_shape(op: &'static str, a: &Tensor, b: &Tensor, detail: &'static str) -> Result<()> {
    shapes_match(op, a.shape(), b.shape(), detail)
}

/// `got` must equal `expected`.
pub(crate) fn shapes_match(op: &'static str, expected: &[usize], got: &[usize], detail: &'static str) -> Result<()> {
    if expected != got {
        return Err(Error::ShapeMismatch { op, expected: expected.to_vec(), got: got.to_vec(), detail });
    }
    Ok(())
}

/// A row broadcast along the last dimension of `x_shape` must have shape `[last_dim]`.
pub(crate) fn row_matches(
    op: &'static str,
    x_shape: &[usize],
    row_shape: &[usize],
    detail: &'static str,
) -> Result<()> {
    shapes_match(op, &[x_shape.last().copied().unwrap_or(1)], row_shape, detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_checks_name_the_op_and_shapes() {
        assert!(shapes_match("add", &[2, 3], &[2, 3], "").is_ok());
        let err = shapes_match("add", &[2, 3], &[3, 2], "operands must have one shape").unwrap_err();
        assert_eq!(err.to_string(), "add: shape mismatch, expected [2, 3], got [3, 2] (operands must have one shape)");
        assert!(row_matches("bias", &[4, 5], &[5], "").is_ok());
        assert!(row_matches("bias", &[5], &[5], "").is_ok());
        assert!(row_matches("bias", &[], &[1], "").is_ok());
        assert!(matches!(row_matches("bias", &[4, 5], &[4], ""), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(row_matches("bias", &[4, 5], &[1, 5], ""), Err(Error::ShapeMismatch { .. })));
    }
}
