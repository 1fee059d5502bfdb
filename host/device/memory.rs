//! Device memory: the per-device cache of blocks, stream-ordered allocation on foreign
//! streams, and the buffers that tensors hold.

use super::*;
use crate::error::{Error, Result, driver};
use cudarc::driver::{result, sys};

impl Device {
    /// Allocates `bytes` of device memory. Zero bytes give a null buffer.
    ///
    /// Freed buffers go back to a per-device cache of blocks by capacity and are handed out again
    /// without a driver call, as PyTorch's caching allocator does: an op on a small tensor then
    /// costs one launch, not a launch and a `cuMemAllocAsync`. Reuse is safe because all work of
    /// a device is ordered on its one stream: a kernel that writes a reused block runs after
    /// every kernel that used it before. When the driver reports out-of-memory, the cache is
    /// released and the allocation tried once more.
    ///
    /// Inside [`Device::with_stream`], memory is allocated and freed stream-ordered on the
    /// foreign stream instead, bypassing the cache (see there for why).
    pub(crate) fn alloc(&self, op: &'static str, bytes: usize) -> Result<DeviceBuffer> {
        if bytes == 0 {
            return Ok(DeviceBuffer { ptr: 0, bytes: 0, capacity: 0, dev: self.clone(), origin: Origin::Cache });
        }
        if let Some(stream) = self.foreign_stream() {
            return self.alloc_on(op, bytes, stream);
        }
        let capacity = block_capacity(bytes);
        let cached = self.0.pool.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&capacity).and_then(Vec::pop);
        let ptr = match cached {
            Some(p) => p,
            None => {
                self.bind()?;
                // SAFETY: the stream belongs to the bound context; the memory is only used on it.
                let first = unsafe { result::malloc_async(self.0.stream, capacity) };
                match first {
                    Ok(p) => p,
                    Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                        self.empty_cache()?;
                        // SAFETY: as above.
                        unsafe { result::malloc_async(self.0.stream, capacity) }.map_err(|e| match driver(op, e) {
                            Error::OutOfMemory { op, .. } => Error::OutOfMemory { op, bytes },
                            other => other,
                        })?
                    }
                    Err(e) => return Err(driver(op, e)),
                }
            }
        };
        let mut buf = DeviceBuffer { ptr, bytes, capacity, dev: self.clone(), origin: Origin::Cache };
        if self.0.poison_alloc {
            buf.memset(0xFF)?;
        }
        Ok(buf)
    }

    /// `bytes` (> 0) from the driver's pool, ordered on the foreign `stream` and returned to it
    /// on drop, stream-ordered on `stream`.
    pub(super) fn alloc_on(&self, op: &'static str, bytes: usize, stream: sys::CUstream) -> Result<DeviceBuffer> {
        self.bind()?;
        // SAFETY: `stream` belongs to the bound context (the contract of `with_stream`).
        let ptr = match unsafe { result::malloc_async(stream, bytes) } {
            Ok(p) => p,
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                // The device's own cache may hold the memory; `empty_cache` waits for its stream.
                self.empty_cache()?;
                // SAFETY: as above.
                unsafe { result::malloc_async(stream, bytes) }.map_err(|e| match driver(op, e) {
                    Error::OutOfMemory { op, .. } => Error::OutOfMemory { op, bytes },
                    other => other,
                })?
            }
            Err(e) => return Err(driver(op, e)),
        };
        let mut buf =
            DeviceBuffer { ptr, bytes, capacity: bytes, dev: self.clone(), origin: Origin::Stream(stream as usize) };
        if self.0.poison_alloc {
            buf.memset(0xFF)?;
        }
        Ok(buf)
    }

    /// Returns the cached free blocks to the driver (after the work that used them).
    pub fn empty_cache(&self) -> Result<()> {
        let blocks = std::mem::take(&mut *self.0.pool.lock().unwrap_or_else(|p| p.into_inner()));
        self.bind()?;
        for p in blocks.into_values().flatten() {
            // SAFETY: cached blocks are owned by the cache and referenced by nothing else; they
            // were used on the device's own stream only.
            unsafe { result::free_async(p, self.0.stream) }.map_err(|e| driver("empty_cache", e))?;
        }
        // SAFETY: the device's own stream, in the bound context.
        unsafe { result::stream::synchronize(self.0.stream) }.map_err(|e| self.kernel_fault(e))
    }
}

/// Capacity of the block that serves a request of `bytes`: 512-byte steps up to 1 MiB, 2 MiB
/// steps above, so that blocks are reused across nearby sizes and the cache has few bins.
pub(crate) fn block_capacity(bytes: usize) -> usize {
    const SMALL: usize = 512;
    const LARGE: usize = 2 << 20;
    if bytes <= 1 << 20 { bytes.div_ceil(SMALL) * SMALL } else { bytes.div_ceil(LARGE) * LARGE }
}

/// Where a buffer's memory came from, which decides what its drop does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Origin {
    /// The device's cache (`Device::alloc`): returned to it.
    Cache,
    /// `cuMemAllocAsync` on a foreign stream (the `CUstream` as an integer) inside
    /// `Device::with_stream`: freed with `cuMemFreeAsync` on that stream.
    Stream(usize),
    /// Memory owned by someone else (PyTorch): left alone.
    Borrowed,
}

/// Device memory of one tensor: owned (returned to the device's cache, or freed on its stream,
/// on drop) or borrowed from its owner.
pub(crate) struct DeviceBuffer {
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) bytes: usize,
    pub(super) capacity: usize,
    pub(super) dev: Device,
    pub(super) origin: Origin,
}

impl DeviceBuffer {
    /// Wraps `bytes` of device memory at `ptr` owned by someone else; dropping the buffer leaves
    /// the memory alone.
    ///
    /// # Safety
    /// `ptr` is an address in `dev`'s primary context, valid for reads and writes of `bytes`
    /// bytes for as long as the buffer (and whatever tensor holds it) lives.
    pub(crate) unsafe fn borrowed(dev: &Device, ptr: u64, bytes: usize) -> DeviceBuffer {
        DeviceBuffer { ptr, bytes, capacity: bytes, dev: dev.clone(), origin: Origin::Borrowed }
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
    pub(crate) fn device(&self) -> &Device {
        &self.dev
    }

    /// Copies `src` (exactly `bytes` long) into the buffer and waits for the copy.
    pub(crate) fn copy_from_host<T: Copy>(&mut self, src: &[T]) -> Result<()> {
        assert_eq!(std::mem::size_of_val(src), self.bytes);
        if self.bytes == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: the buffer holds `bytes` = size_of_val(src); the synchronisation keeps `src`
        // borrowed until the copy is done.
        unsafe {
            result::memcpy_htod_async(self.ptr, src, self.dev.stream()).map_err(|e| driver("copy_from_host", e))?;
        }
        self.dev.synchronize()
    }

    /// Copies `src` (exactly `bytes` long) into the buffer, stream-ordered, without waiting:
    /// the driver stages pageable host memory before it returns, so `src` may go at once. For
    /// small parameter blocks (tensor maps) that a kernel launched next reads.
    pub(crate) fn copy_from_host_async<T: Copy>(&mut self, src: &[T]) -> Result<()> {
        assert_eq!(std::mem::size_of_val(src), self.bytes);
        if self.bytes == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: the buffer holds `bytes` = size_of_val(src) bytes; a host-to-device copy from
        // pageable memory returns once the driver has staged the source.
        unsafe { result::memcpy_htod_async(self.ptr, src, self.dev.stream()) }.map_err(|e| driver("copy_from_host", e))
    }

    /// Copies the buffer into `dst` (exactly `bytes` long), after all earlier work.
    pub(crate) fn copy_to_host<T: Copy>(&self, dst: &mut [T]) -> Result<()> {
        assert_eq!(std::mem::size_of_val(dst), self.bytes);
        if self.bytes == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: sizes match; the synchronisation completes the copy before `dst` is released.
        unsafe {
            result::memcpy_dtoh_async(dst, self.ptr, self.dev.stream()).map_err(|e| driver("copy_to_host", e))?;
        }
        self.dev.synchronize()
    }

    /// Device-to-device copy of the whole buffer into `dst` (same size), stream-ordered.
    pub(crate) fn copy_to(&self, dst: &mut DeviceBuffer) -> Result<()> {
        assert_eq!(self.bytes, dst.bytes);
        if self.bytes == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: both buffers hold `bytes` bytes on this device.
        unsafe { result::memcpy_dtod_async(dst.ptr, self.ptr, self.bytes, self.dev.stream()) }
            .map_err(|e| driver("copy", e))
    }

    /// Sets every byte to `value`, stream-ordered.
    pub(crate) fn memset(&mut self, value: u8) -> Result<()> {
        if self.bytes == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: the buffer holds `bytes` bytes.
        unsafe { result::memset_d8_async(self.ptr, value, self.bytes, self.dev.stream()) }
            .map_err(|e| driver("memset", e))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        match self.origin {
            Origin::Cache => {
                let mut pool = self.dev.0.pool.lock().unwrap_or_else(|p| p.into_inner());
                pool.entry(self.capacity).or_default().push(self.ptr);
            }
            Origin::Stream(stream) => {
                if self.dev.bind().is_ok() {
                    // SAFETY: allocated on `stream`, which by the contract of `with_stream` is
                    // alive and the only stream that used the buffer: the driver frees it after
                    // that stream's work. Nothing refers to the buffer after this.
                    let _ = unsafe { result::free_async(self.ptr, stream as sys::CUstream) };
                }
            }
            Origin::Borrowed => {}
        }
    }
}
