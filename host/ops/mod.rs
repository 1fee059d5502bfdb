//! The operations. One file per kernel family, named as its device-side counterpart in
//! `kernels-gpu/src/` (`shape`, slicing and joining, runs the driver's copies and no kernel). Every op validates devices, dtypes and shapes before it launches, and
//! returns an error naming itself and the offending shapes otherwise.

pub mod attention;
pub mod batchnorm;
pub mod broadcast;
pub mod cast;
pub mod conv;
pub mod cross_entropy;
pub mod elementwise;
pub mod embedding;
pub mod gemm;
pub mod gemm_tc;
pub(crate) mod gemm_wgmma;
pub mod glu;
pub mod index;
pub mod init;
pub mod linear;
pub mod linear_cross_entropy;
pub mod mathprobe;
pub mod norm;
pub mod optim;
pub mod pool;
pub mod reduce;
pub mod rope;
pub mod shape;
pub mod softmax;
pub mod transpose;

pub use attention::{
    AttentionOpts, Causal, Layout, attention, attention_backward, attention_backward_out, attention_out,
};
pub use batchnorm::{
    BATCH_NORM_EPS, BATCH_NORM_MOMENTUM, BatchNormGrads, BatchNormOpts, BatchNormStats, Layout2d, batch_norm,
    batch_norm_backward, batch_norm_backward_out, batch_norm_out,
};
pub use broadcast::{broadcast_shape, broadcast_to, permute, sum_to};
pub use conv::{Conv2dGrads, Conv2dOpts, ConvNeeds, conv2d, conv2d_backward, conv2d_backward_out, conv2d_out};
pub use cross_entropy::*;
pub use elementwise::*;
pub use embedding::{
    MAX_BACKWARD_INDICES, embedding, embedding_backward, embedding_backward_out, embedding_checked, embedding_out,
};
pub use gemm::*;
pub use gemm_tc::{Epilogue, gemm_fused};
pub use glu::*;
pub use index::{
    gather, gather_backward, gather_out, index_add, index_add_, index_select, index_select_backward, index_select_out,
    scatter_add, scatter_add_,
};
pub use linear::*;
pub use linear_cross_entropy::{LinearCrossEntropy, LinearCrossEntropyOpts, linear_cross_entropy};
pub use norm::*;
pub use optim::*;
pub use pool::{
    Pool2dOpts, avg_pool2d, avg_pool2d_backward, avg_pool2d_backward_out, avg_pool2d_out, global_avg_pool2d,
    global_avg_pool2d_backward, global_avg_pool2d_backward_out, global_avg_pool2d_out, max_pool2d, max_pool2d_backward,
    max_pool2d_backward_out, max_pool2d_out,
};
pub use reduce::*;
pub use rope::*;
pub use softmax::*;
pub use transpose::*;

/// Every kernel the library launches (the element-wise ops, the gated activations, softmax,
/// norms, cross-entropy, reductions, transpose, the GEMM, attention, RoPE, the embedding, the
/// index ops, the convolution, batch norm, pooling, init, the optimizer, the casts and the math probe), with the
/// parameter count of the signature the host launches it
/// with; checked against the PTX by the crate's unit tests (`host/ptx_tests.rs`). Each family
/// derives its list from its declaration's typed handles.
pub fn all_kernels() -> Vec<(String, usize)> {
    let mut v: Vec<(String, usize)> =
        kernels_gpu::elementwise::all_kernels().map(|k| (k.name.to_string(), k.arity)).collect();
    v.extend(kernels_gpu::softmax::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::norm::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::cross_entropy::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::reduce::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::transpose::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::broadcast::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::gemm::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::gemm_tf32x3::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::gemm_wgmma::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::gemm_tc::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::attention::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::glu::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::init::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::optim::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::rope::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::embedding::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::index::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::batchnorm::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::pool::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::conv::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::cast::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v.extend(kernels_gpu::mathprobe::all_kernels().map(|k| (k.name.to_string(), k.arity)));
    v
}

// The checks and `with_elem` the families share, re-exported for the families that still
// import them from here.
mod check;
pub(crate) use check::{check_same_device, check_same_dtype, check_same_shape, row_matches, with_elem};

use crate::error::Result;
use crate::tensor::Tensor;

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

/// The binary ops as methods (the unary ops' come from their table: `ops::elementwise`).
impl Tensor {
    binary_methods! {
        add, add_row => BinaryOp::Add; sub, sub_row => BinaryOp::Sub;
        mul, mul_row => BinaryOp::Mul; div, div_row => BinaryOp::Div;
    }
}

#[cfg(test)]
mod tests {
    use crate::error::Error;

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
