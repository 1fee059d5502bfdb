//! GPU kernels for machine learning, written in Rust.
//!
//! Every kernel is `no_std` Rust in the `kernels-gpu` crate, compiled to PTX by rustc's
//! `nvptx64-nvidia-cuda` target when this crate builds, and embedded; no CUDA toolkit is needed to
//! build, only an NVIDIA driver to run. Without one, [`Device::cuda`] returns
//! [`Error::NoDriver`] and nothing panics.
//!
//! ```no_run
//! use kernels::{Device, DType, Tensor, ops::{self, Activation}};
//! # fn main() -> kernels::Result<()> {
//! let dev = Device::cuda(0)?;
//! let x = Tensor::rand_normal(&dev, &[4096, 1024], DType::BF16, 0.0, 1.0, 42)?;
//! let y = x.gelu()?;                                     // one kernel
//! let (scale, bias) = (Tensor::full(&dev, &[1024], DType::BF16, 0.5)?,
//!                      Tensor::zeros(&dev, &[1024], DType::BF16)?);
//! let z = ops::scale_bias_act(&x, &scale, &bias, Activation::Silu)?;  // silu(x*scale+bias), one pass
//! let dy = Tensor::rand_normal(&dev, &[4096, 1024], DType::BF16, 0.0, 1.0, 7)?;
//! let dx = ops::unary_backward(&x, &dy, Activation::Gelu)?;           // exact gelu'(x) * dy
//! println!("{:?}", &z.to_f32_vec()?[..4]);
//! # let _ = (y, dx); Ok(()) }
//! ```
//!
//! Layout: [`device`] is the runtime (the only code that calls the driver), [`tensor`] the tensor,
//! [`ops`] the operations (one file per kernel family, as in `kernels-gpu/src/`); inside the
//! crate, `launch` the launch geometry and `rows` the row kernels' launch planning; [`dist`] the
//! collectives across GPUs (NCCL), [`error`] the error type, [`interop`] borrowed memory and foreign streams (PyTorch),
//! [`safetensors`] checkpoints.
//!
//! The cargo feature `candle` (off by default) adds the module `candle`: the ops as candle custom ops, with
//! candle's autograd through the backward kernels. It needs nvcc to build (candle's kernels).
//!
//! The cargo feature `internals` (off by default) adds `ops::mathprobe`, which runs the device
//! math library's functions one by one for the project's own accuracy tests. It is not part of
//! the stable API: it may change or go in any release.

// Every public item says what it is: CI's clippy turns a missing doc into an error.
#![warn(missing_docs)]

#[cfg(feature = "candle")]
pub mod candle;
pub mod device;
pub mod dist;
pub mod error;
pub mod interop;
pub(crate) mod launch;
pub mod ops;
pub(crate) mod rows;
pub mod safetensors;
pub mod tensor;

#[cfg(test)]
mod ptx_tests;

#[doc(hidden)]
pub use device::TensorMapCacheStats;
pub use device::{Device, Event, MemoryStats, Trace, device_count};
pub use error::{Error, Result};
pub use kernels_gpu::DType;
pub use tensor::{Element, IndexTensor, Tensor};

/// The GPU architectures whose PTX this build embeds (`"sm_80"`, `"sm_90"`, `"sm_90a"`), oldest first. A
/// device runs the newest its compute capability allows ([`Device::ptx_arch`]), as PyTorch's
/// `torch.cuda.get_arch_list()` lists what a build supports.
pub fn ptx_arches() -> &'static [&'static str] {
    &device::PTX_ARCHES
}
