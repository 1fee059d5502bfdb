//! Dtype conversion (host side of `kernels-gpu/src/cast.rs`).

use super::check::with_elem;
use crate::error::Result;
use crate::launch;
use crate::tensor::Tensor;
use kernels_gpu::DType;

impl Tensor {
    /// The tensor converted to `dtype` on the device, as PyTorch's `.to(dtype)`: rounded to
    /// nearest even, infinities and signed zeros kept, NaN a NaN; widening is exact. To its own
    /// dtype it is [`clone`](Clone::clone): the memory is shared, nothing is copied.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        use kernels_gpu::cast::{CastArgs, GROUP, cast_kernel};
        let op = "Tensor::to_dtype";
        let Some(kernel) = cast_kernel(self.dtype(), dtype) else { return Ok(self.clone()) };
        let dev = self.device();
        let mut y = Tensor::alloc(op, dev, self.shape(), dtype)?;
        let n = self.numel() as u64;
        let Some(cfg) = launch::elementwise(n, GROUP, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel)?) else {
            return Ok(y);
        };
        with_elem!(self.dtype(), |S| with_elem!(dtype, |D| {
            let args: CastArgs<S, D> = (self.dev_ptr(), y.dev_ptr_mut()?, n);
            // SAFETY: self holds n elements of S, y (a new allocation) n of D.
            unsafe { dev.launch(kernel, cfg, args) }
        }))?;
        Ok(y)
    }
}
