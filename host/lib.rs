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
//! [`ops`] the operations (one file per kernel family, as in `kernels-gpu/src/`), [`launch`] the
//! launch geometry, [`rows`] the row kernels' launch planning, [`error`] the error type, [`interop`] borrowed memory and foreign streams
//! (PyTorch).

// Every public item says what it is: CI's clippy turns a missing doc into an error.
#![warn(missing_docs)]

pub mod device;
pub mod error;
pub mod interop;
pub mod launch;
pub mod ops;
pub mod rows;
pub mod tensor;

pub use device::{Device, Event, device_count};
pub use error::{Error, Result};
pub use kernels_gpu::DType;
pub use tensor::{Element, IndexTensor, Tensor};
