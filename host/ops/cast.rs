//! Dtype conversion (host side of `kernels-gpu/src/cast.rs`).

use super::check::with_elem;
use crate::error::Result;
use crate::launch;
use crate::tensor::Tensor;
use kernels_gpu::DType;
use kernels_gpu::cast::{CastArgs, CastKernel, GROUP};
use kernels_gpu::kernel::{Kernel, KernelArgs};

impl Tensor {
    /// The tensor converted to `dtype` on the device, as PyTorch's `.to(dtype)`: rounded to
    /// nearest even, infinities and signed zeros kept, NaN a NaN; widening is exact. To its own
    /// dtype it is [`clone`](Clone::clone): the memory is shared, nothing is copied.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        with_elem!(self.dtype(), |S| with_elem!(dtype, |D| cast(self, <S as CastKernel<D>>::KERNEL, dtype)))
    }
}

/// `x` (of `S`) converted to `dtype` (`D`) by `kernel`; `x` itself, shared, without one (`S = D`).
fn cast<S, D>(x: &Tensor, kernel: Option<Kernel<CastArgs<S, D>>>, dtype: DType) -> Result<Tensor>
where
    CastArgs<S, D>: KernelArgs,
{
    let op = "Tensor::to_dtype";
    let Some(kernel) = kernel else { return Ok(x.clone()) };
    let dev = x.device();
    let mut y = Tensor::alloc(op, dev, x.shape(), dtype)?;
    let n = x.numel() as u64;
    let Some(cfg) = launch::elementwise(n, GROUP, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?) else {
        return Ok(y);
    };
    let args: CastArgs<S, D> = (x.dev_ptr(), y.dev_ptr_mut()?, n);
    // SAFETY: x holds n elements of S (its dtype, as the caller dispatched), y (a new allocation)
    // n of D.
    unsafe { dev.launch(kernel, cfg, args) }?;
    Ok(y)
}
