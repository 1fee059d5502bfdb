//! Interop with other owners of GPU memory and streams, e.g. PyTorch (`python/` builds its
//! operators on this).
//!
//! Two pieces, both `unsafe` because the library cannot check what the other side promises:
//!
//! - [`Tensor::from_device_ptr`] / [`IndexTensor::from_device_ptr`] wrap memory someone else
//!   allocated (a `torch.Tensor`'s `data_ptr()`) as a borrowed tensor: ops read and write it like
//!   any tensor, and dropping it leaves the memory alone (neither freed nor cached).
//! - [`Device::with_stream`] runs a closure with the calling thread's work on the device issued
//!   to a foreign stream (PyTorch's current stream), so the kernels are ordered with the other
//!   library's work without any synchronisation or event. Ops that allocate temporaries (the
//!   cross-entropy's per-row losses, the column-sum partials of the backward passes) get them
//!   stream-ordered on that stream (`cuMemAllocAsync`/`cuMemFreeAsync`), never from the device's
//!   cache: the cache's reuse argument holds for one stream only.
//!
//! Outputs: the `*_out` variants of the ops write into given tensors, so the other library can
//! allocate every output (and every saved statistic) with its own allocator; nothing the library
//! allocated outlives the call.
//!
//! ```no_run
//! use kernels::{Device, DType, Tensor, ops::{self, Activation}};
//! # fn main() -> kernels::Result<()> {
//! # let (x_ptr, y_ptr, stream) = (0u64, 0u64, std::ptr::null_mut());
//! let dev = Device::cuda(0)?;
//! // SAFETY: x_ptr and y_ptr are two live, 16-byte aligned allocations of 1024 f32 on GPU 0 that
//! // stay alive and are not written by other streams until `stream`'s work below is done.
//! unsafe {
//!     let x = Tensor::from_device_ptr(&dev, x_ptr, &[1024], DType::F32)?;
//!     let mut y = Tensor::from_device_ptr(&dev, y_ptr, &[1024], DType::F32)?;
//!     dev.with_stream(stream, || ops::unary_out(&x, Activation::Gelu, &mut y))??;
//! }
//! # Ok(()) }
//! ```

use crate::DType;
use crate::device::{Device, DeviceBuffer};
use crate::error::{Error, Result};
use crate::tensor::{IndexTensor, Tensor, numel};

/// The kernels load and store whole 16-byte vectors from a tensor's first element.
pub const ALIGNMENT: u64 = 16;

fn checked_bytes(op: &'static str, ptr: u64, shape: &[usize], elem: usize) -> Result<usize> {
    let n = numel(op, shape)?;
    let bytes = n
        .checked_mul(elem)
        .ok_or_else(|| Error::InvalidArgument { op, message: format!("shape {shape:?} is too large") })?;
    if bytes > 0 && (ptr == 0 || !ptr.is_multiple_of(ALIGNMENT)) {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "device address {ptr:#x} is not {ALIGNMENT}-byte aligned (the kernels load 16-byte vectors from \
                 the first element; copy the tensor to a fresh allocation)"
            ),
        });
    }
    Ok(bytes)
}

impl Tensor {
    /// A tensor over memory owned by someone else: `shape`'s elements of `dtype` at device
    /// address `ptr`, contiguous and row-major. Dropping it leaves the memory alone. Errors if
    /// `ptr` is not 16-byte aligned (or null with elements).
    ///
    /// # Safety
    /// - `ptr` is a device address in the primary context of `dev`'s GPU (PyTorch's CUDA tensors
    ///   on that GPU are), valid for reads, and for writes if an op writes the tensor, of
    ///   `shape`'s element count of `dtype`, for as long as the tensor and the work issued on it
    ///   live (on the stream it is used on: see [`Device::with_stream`]).
    /// - While an op writes the tensor, no other tensor or foreign work reads or writes that
    ///   memory, except as that op's documentation allows (in-place variants).
    pub unsafe fn from_device_ptr(dev: &Device, ptr: u64, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let bytes = checked_bytes("Tensor::from_device_ptr", ptr, shape, dtype.size())?;
        // SAFETY: the caller's contract is DeviceBuffer::borrowed's.
        let buf = unsafe { DeviceBuffer::borrowed(dev, ptr, bytes) };
        Ok(Tensor::from_buffer(buf, shape.to_vec(), dtype))
    }
}

impl IndexTensor {
    /// Indices (`i64`, PyTorch's `int64`) over memory owned by someone else, as
    /// [`Tensor::from_device_ptr`].
    ///
    /// # Safety
    /// As [`Tensor::from_device_ptr`], for `shape`'s element count of `i64`.
    pub unsafe fn from_device_ptr(dev: &Device, ptr: u64, shape: &[usize]) -> Result<IndexTensor> {
        let bytes = checked_bytes("IndexTensor::from_device_ptr", ptr, shape, 8)?;
        // SAFETY: as above.
        let buf = unsafe { DeviceBuffer::borrowed(dev, ptr, bytes) };
        Ok(IndexTensor::from_buffer(buf, shape.to_vec()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misaligned_or_null_addresses_are_refused_before_any_device_work() {
        let op = "t";
        assert_eq!(checked_bytes(op, 0x1000, &[4, 4], 4).unwrap(), 64);
        assert_eq!(checked_bytes(op, 0, &[0, 4], 4).unwrap(), 0);
        assert_eq!(checked_bytes(op, 0x1002, &[0], 2).unwrap(), 0);
        let e = checked_bytes(op, 0x1004, &[4], 4).unwrap_err().to_string();
        assert!(e.contains("0x1004") && e.contains("16-byte aligned"), "{e}");
        assert!(checked_bytes(op, 0, &[1], 4).is_err());
        assert!(checked_bytes(op, 0x1000, &[usize::MAX, 2], 4).is_err());
    }
}
