//! Runs one function of the device math library over f32 inputs (host side of
//! `kernels-gpu/src/mathprobe.rs`), to measure its accuracy on the GPU.
//!
//! Unstable (the `internals` feature): for the project's own accuracy tests, not part of the API.
#![cfg(feature = "internals")]

use crate::DType;
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::Tensor;
pub use kernels_gpu::mathprobe::MathFn;
use kernels_gpu::mathprobe::{MathProbeArgs, MathProbePowArgs, math_probe_f32, math_probe_pow_f32};

/// `f(x)` for an f32 tensor, computed on the GPU by the library's own math.
pub fn math_probe(x: &Tensor, f: MathFn) -> Result<Tensor> {
    let op = "math_probe";
    if x.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch { op, expected: DType::F32, got: x.dtype() });
    }
    let mut y = x.alloc_like(op)?;
    let dev = x.device();
    let n = x.numel() as u64;
    let Some(cfg) = launch::elementwise(n, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(math_probe_f32.name())?) else {
        return Ok(y);
    };
    let args: MathProbeArgs = (x.dev_ptr(), y.dev_ptr_mut()?, n, f as u32);
    // SAFETY: x and y hold n f32 values.
    unsafe { dev.launch(math_probe_f32, cfg, args) }?;
    Ok(y)
}

/// `x^y` elementwise for f32 tensors of one shape, computed on the GPU by the pow the kernels run
/// (`fastmath::pow`), with a per-element exponent (the `pow` op's is a scalar).
pub fn math_probe_pow(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let op = "math_probe_pow";
    for t in [x, y] {
        if t.dtype() != DType::F32 {
            return Err(Error::DTypeMismatch { op, expected: DType::F32, got: t.dtype() });
        }
    }
    super::check_same_device(op, x, y)?;
    super::check_same_shape(op, x, y, "one exponent per base")?;
    let mut out = x.alloc_like(op)?;
    let dev = x.device();
    let n = x.numel() as u64;
    let Some(cfg) = launch::elementwise(n, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(math_probe_pow_f32.name())?)
    else {
        return Ok(out);
    };
    let args: MathProbePowArgs = (x.dev_ptr(), y.dev_ptr(), out.dev_ptr_mut()?, n);
    // SAFETY: x, y and out hold n f32 values each.
    unsafe { dev.launch(math_probe_pow_f32, cfg, args) }?;
    Ok(out)
}
