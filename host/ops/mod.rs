//! The operations. One file per kernel family, named as its device-side counterpart in
//! `kernels-gpu/src/`. Every op validates devices, dtypes and shapes before it launches, and
//! returns an error naming itself and the offending shapes otherwise.

pub mod cross_entropy;
pub mod elementwise;
pub mod gemm;
pub mod init;
pub mod linear;
pub mod mathprobe;
pub mod norm;
pub mod optim;
pub mod reduce;
pub mod softmax;
pub mod transpose;

pub use cross_entropy::*;
pub use elementwise::*;
pub use gemm::*;
pub use linear::*;
pub use norm::*;
pub use optim::*;
pub use reduce::*;
pub use softmax::*;
pub use transpose::*;

/// Every kernel the row-operation families launch (softmax, norms, cross-entropy, reductions,
/// transpose), the GEMM and the optimizer, with the parameter count of the signature the host launches it
/// with; checked against the PTX by `tests/cpu.rs`.
pub fn row_family_kernels() -> Vec<(String, usize)> {
    let mut v = softmax::launched_kernels();
    v.extend(norm::launched_kernels());
    v.extend(cross_entropy::launched_kernels());
    v.extend(reduce::launched_kernels());
    v.extend(transpose::launched_kernels());
    v.extend(gemm::launched_kernels());
    v.extend(optim::launched_kernels());
    v
}

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

macro_rules! unary_methods {
    ($($(#[$m:meta])* $name:ident => $op:expr;)*) => {
        $( $(#[$m])* pub fn $name(&self) -> Result<Tensor> { unary(self, $op) } )*
    };
}

macro_rules! unary_scalar_methods {
    ($($(#[$m:meta])* $name:ident => $op:path;)*) => {
        $( $(#[$m])* pub fn $name(&self, s: f32) -> Result<Tensor> { unary(self, $op(s)) } )*
    };
}

macro_rules! binary_methods {
    ($($name:ident, $row:ident => $op:expr;)*) => {
        $(
            /// Element-wise with a tensor of the same shape.
            pub fn $name(&self, other: &Tensor) -> Result<Tensor> { binary(self, other, $op) }
            /// With `row` (shape `[last_dim]`) broadcast over the other dimensions.
            pub fn $row(&self, row: &Tensor) -> Result<Tensor> { binary_row(self, row, $op) }
        )*
    };
}

/// Shorthands for the ops, as methods.
impl Tensor {
    unary_methods! {
        /// `-x`.
        neg => UnaryOp::Neg;
        /// `|x|`.
        abs => UnaryOp::Abs;
        /// `e^x`.
        exp => UnaryOp::Exp;
        /// The natural logarithm.
        log => UnaryOp::Log;
        /// `e^x - 1`.
        expm1 => UnaryOp::Expm1;
        /// `log(1 + x)`.
        log1p => UnaryOp::Log1p;
        /// The error function.
        erf => UnaryOp::Erf;
        /// `sqrt(x)`.
        sqrt => UnaryOp::Sqrt;
        /// `1 / sqrt(x)`.
        rsqrt => UnaryOp::Rsqrt;
        /// `max(x, 0)`.
        relu => Activation::Relu;
        /// `1 / (1 + e^-x)`.
        sigmoid => Activation::Sigmoid;
        /// `tanh(x)`.
        tanh => Activation::Tanh;
        /// GELU, erf form (PyTorch's default).
        gelu => Activation::Gelu;
        /// GELU, tanh approximation.
        gelu_tanh => Activation::GeluTanh;
        /// SiLU, also called Swish.
        silu => Activation::Silu;
        /// `x * tanh(softplus(x))`.
        mish => Activation::Mish;
        /// Softplus with PyTorch's defaults (beta 1, threshold 20).
        softplus => Activation::SOFTPLUS;
    }
    unary_scalar_methods! {
        /// `x + s`.
        add_scalar => UnaryOp::AddScalar;
        /// `x - s`.
        sub_scalar => UnaryOp::SubScalar;
        /// `x * s`.
        mul_scalar => UnaryOp::MulScalar;
        /// `x / s`.
        div_scalar => UnaryOp::DivScalar;
        /// `x ^ p`.
        pow_scalar => UnaryOp::Pow;
    }
    binary_methods! {
        add, add_row => BinaryOp::Add; sub, sub_row => BinaryOp::Sub;
        mul, mul_row => BinaryOp::Mul; div, div_row => BinaryOp::Div;
    }

    /// `x` where `x > 0`, else `negative_slope * x`.
    pub fn leaky_relu(&self, negative_slope: f32) -> Result<Tensor> {
        unary(self, Activation::LeakyRelu { negative_slope })
    }
    /// `min(max(x, min), max)`, NaN propagated.
    pub fn clamp(&self, min: f32, max: f32) -> Result<Tensor> {
        unary(self, UnaryOp::Clamp { min, max })
    }
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

    #[test]
    fn element_counts_overflow_is_an_error() {
        assert_eq!(crate::tensor::numel("t", &[2, 3, 4]).unwrap(), 24);
        assert_eq!(crate::tensor::numel("t", &[]).unwrap(), 1);
        assert_eq!(crate::tensor::numel("t", &[0, usize::MAX]).unwrap(), 0);
        assert!(matches!(crate::tensor::numel("t", &[usize::MAX, 2]), Err(Error::InvalidArgument { .. })));
    }

    #[test]
    fn errors_display_what_failed() {
        let e = Error::DTypeMismatch { op: "binary", expected: crate::DType::F32, got: crate::DType::BF16 };
        assert_eq!(e.to_string(), "binary: dtype mismatch, expected F32, got BF16");
        let e = Error::Kernel { kernel: "relu_fwd_f32".into(), message: "CUDA_ERROR_ILLEGAL_ADDRESS".into() };
        assert!(e.to_string().contains("relu_fwd_f32"));
        let e = Error::NoDriver { detail: "libcuda.so.1 was not found".into() };
        assert!(e.to_string().starts_with("no CUDA driver"));
    }
}
