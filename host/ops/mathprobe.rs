//! Runs one function of the device math library over f32 inputs (host side of
//! `kernels-gpu/src/mathprobe.rs`), to measure its accuracy on the GPU.

use crate::DType;
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::Tensor;
pub use kernels_gpu::mathprobe::MathFn;
use kernels_gpu::mathprobe::MathProbeArgs;

/// `f(x)` for an f32 tensor, computed on the GPU by the library's own math.
pub fn math_probe(x: &Tensor, f: MathFn) -> Result<Tensor> {
    let op = "math_probe";
    if x.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch { op, expected: DType::F32, got: x.dtype() });
    }
    let mut y = x.alloc_like(op)?;
    let kernel = "math_probe_f32";
    let dev = x.device();
    let n = x.numel() as u64;
    let Some(cfg) = launch::elementwise(n, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel)?) else {
        return Ok(y);
    };
    let args: MathProbeArgs = (x.dev_ptr(), y.dev_ptr_mut()?, n, f as u32);
    // SAFETY: x and y hold n f32 values.
    unsafe { dev.launch(kernel, cfg, args) }?;
    Ok(y)
}
