//! Device memory: the per-device cache of blocks, stream-ordered allocation on foreign
//! streams, and the buffers that tensors hold.

use super::*;
use crate::error::{Error, Result, driver};
use cudarc::driver::{result, sys};

/// A snapshot of a device's memory counters, modelled on `torch.cuda.memory_stats` (the
/// PyTorch key each field corresponds to is named). Counts the memory of tensors this library
/// allocated, by the device's cache or on a foreign stream inside [`Device::with_stream`];
/// borrowed memory (PyTorch's tensors wrapped by [`crate::interop`]) is not counted.
///
/// Sizes in bytes. "Block" bytes are what the allocator set aside for a tensor: its size rounded
/// up to the cache's bins (512-byte steps up to 1 MiB, 2 MiB steps above), as PyTorch's
/// `allocated_bytes` counts its rounded blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryStats {
    /// Block bytes held by live tensors now (`allocated_bytes.all.current`, what
    /// `torch.cuda.memory_allocated` returns).
    pub allocated_bytes: usize,
    /// The most `allocated_bytes` has been since the device was created or
    /// [`Device::reset_peak_memory_stats`] was called (`allocated_bytes.all.peak`,
    /// `torch.cuda.max_memory_allocated`).
    pub peak_allocated_bytes: usize,
    /// Bytes the live tensors asked for, before rounding to blocks
    /// (`requested_bytes.all.current`).
    pub requested_bytes: usize,
    /// The most `requested_bytes` has been since the last reset (`requested_bytes.all.peak`).
    pub peak_requested_bytes: usize,
    /// Bytes obtained from the driver and not yet given back: the live tensors' blocks and the
    /// free blocks in the cache (`reserved_bytes.all.current`, `torch.cuda.memory_reserved`).
    pub reserved_bytes: usize,
    /// The most `reserved_bytes` has been since the last reset (`reserved_bytes.all.peak`).
    pub peak_reserved_bytes: usize,
    /// Free blocks held by the cache for reuse: `reserved_bytes - allocated_bytes` (PyTorch's
    /// `inactive_split_bytes` without splitting). [`Device::empty_cache`] returns them.
    pub cached_bytes: usize,
    /// Tensor allocations of one byte or more since the device was created
    /// (`allocation.all.allocated`).
    pub num_allocs: u64,
    /// Of those, how many have been freed (`allocation.all.freed`).
    pub num_frees: u64,
    /// Allocations the driver served (`cuMemAllocAsync`): those the cache could not
    /// (`num_device_alloc`).
    pub num_device_allocs: u64,
    /// Blocks given back to the driver (`num_device_free`).
    pub num_device_frees: u64,
    /// Allocations that failed at first, emptied the cache and tried again (`num_alloc_retries`).
    pub num_alloc_retries: u64,
    /// Allocations that failed for want of memory, returned as [`Error::OutOfMemory`]
    /// (`num_ooms`).
    pub num_ooms: u64,
}

impl MemoryStats {
    fn allocated(&mut self, capacity: usize, bytes: usize) {
        self.allocated_bytes += capacity;
        self.requested_bytes += bytes;
        self.cached_bytes = self.reserved_bytes - self.allocated_bytes;
        self.peak_allocated_bytes = self.peak_allocated_bytes.max(self.allocated_bytes);
        self.peak_requested_bytes = self.peak_requested_bytes.max(self.requested_bytes);
        self.num_allocs += 1;
    }
    fn freed(&mut self, capacity: usize, bytes: usize) {
        self.allocated_bytes -= capacity;
        self.requested_bytes -= bytes;
        self.cached_bytes = self.reserved_bytes - self.allocated_bytes;
        self.num_frees += 1;
    }
    fn reserved(&mut self, capacity: usize) {
        self.reserved_bytes += capacity;
        self.cached_bytes = self.reserved_bytes - self.allocated_bytes;
        self.peak_reserved_bytes = self.peak_reserved_bytes.max(self.reserved_bytes);
        self.num_device_allocs += 1;
    }
    fn released(&mut self, capacity: usize) {
        self.reserved_bytes -= capacity;
        self.cached_bytes = self.reserved_bytes - self.allocated_bytes;
        self.num_device_frees += 1;
    }
}

/// The device's cache of free blocks by capacity, and its counters, under one lock so that a
/// snapshot is consistent.
#[derive(Default)]
pub(super) struct Pool {
    pub(super) blocks: HashMap<usize, Vec<sys::CUdeviceptr>>,
    stats: MemoryStats,
}

impl Device {
    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.0.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Allocates `bytes` of device memory. Zero bytes give a null buffer.
    ///
    /// Freed buffers go back to a per-device cache of blocks by capacity and are handed out again
    /// without a driver call, as PyTorch's caching allocator does: an op on a small tensor then
    /// costs one launch, not a launch and a `cuMemAllocAsync`. Reuse is safe because all work of
    /// a device is ordered on its one stream: a kernel that writes a reused block runs after
    /// every kernel that used it before. When the driver reports out-of-memory, the cache is
    /// released and the allocation tried once more; should that fail too, the error says what
    /// was asked for, allocated and cached, and the device stays usable.
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
        let cached = {
            let mut pool = self.pool();
            let p = pool.blocks.get_mut(&capacity).and_then(Vec::pop);
            if p.is_some() {
                pool.stats.allocated(capacity, bytes);
            }
            p
        };
        let ptr = match cached {
            Some(p) => p,
            None => {
                self.bind()?;
                let stream = self.0.stream;
                // SAFETY: the stream belongs to the bound context; the memory is only used on it.
                let p = self.driver_alloc(op, bytes, capacity, || unsafe { result::malloc_async(stream, capacity) })?;
                self.pool().stats.allocated(capacity, bytes);
                p
            }
        };
        let mut buf = DeviceBuffer { ptr, bytes, capacity, dev: self.clone(), origin: Origin::Cache };
        if self.0.poison_alloc {
            buf.memset(0xFF)?;
        }
        Ok(buf)
    }

    /// `capacity` bytes from the driver by `malloc` (for a request of `bytes`), counted as
    /// reserved; on out-of-memory the cache is emptied and `malloc` tried once more.
    fn driver_alloc(
        &self,
        op: &'static str,
        bytes: usize,
        capacity: usize,
        malloc: impl Fn() -> Result<sys::CUdeviceptr, cudarc::driver::DriverError>,
    ) -> Result<sys::CUdeviceptr> {
        let oom = |e: &cudarc::driver::DriverError| e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        let p = match malloc() {
            Ok(p) => p,
            Err(e) if oom(&e) => {
                self.pool().stats.num_alloc_retries += 1;
                // The cache may hold the memory; `empty_cache` waits for the device's stream.
                self.empty_cache()?;
                match malloc() {
                    Ok(p) => p,
                    Err(e) if oom(&e) => return Err(self.out_of_memory(op, bytes)),
                    Err(e) => return Err(driver(op, e)),
                }
            }
            Err(e) => return Err(driver(op, e)),
        };
        self.pool().stats.reserved(capacity);
        Ok(p)
    }

    /// The error for a failed allocation of `bytes`, with the allocator's state and the
    /// driver's view of the device (counted in `num_ooms`).
    fn out_of_memory(&self, op: &'static str, bytes: usize) -> Error {
        let s = {
            let mut pool = self.pool();
            pool.stats.num_ooms += 1;
            pool.stats
        };
        // Zeros should the query fail: the error is about the allocation, not this.
        let (device_free, device_total) = result::mem_get_info().unwrap_or((0, 0));
        Error::OutOfMemory {
            op,
            bytes,
            allocated: s.allocated_bytes,
            cached: s.cached_bytes,
            device_free,
            device_total,
        }
    }

    /// `bytes` (> 0) from the driver's pool, ordered on the foreign `stream` and returned to it
    /// on drop, stream-ordered on `stream`.
    pub(super) fn alloc_on(&self, op: &'static str, bytes: usize, stream: sys::CUstream) -> Result<DeviceBuffer> {
        self.bind()?;
        // SAFETY: `stream` belongs to the bound context (the contract of `with_stream`).
        let ptr = self.driver_alloc(op, bytes, bytes, || unsafe { result::malloc_async(stream, bytes) })?;
        self.pool().stats.allocated(bytes, bytes);
        let mut buf =
            DeviceBuffer { ptr, bytes, capacity: bytes, dev: self.clone(), origin: Origin::Stream(stream as usize) };
        if self.0.poison_alloc {
            buf.memset(0xFF)?;
        }
        Ok(buf)
    }

    /// Returns the cached free blocks to the driver (after the work that used them), as
    /// `torch.cuda.empty_cache` does. Live tensors keep theirs. The driver's pool keeps the
    /// memory for the process (its release threshold is unlimited) until this process or
    /// another needs it: `reserved_bytes` of [`Device::memory_stats`] drops, the device's
    /// free memory as other processes see it does once the driver trims its pool.
    pub fn empty_cache(&self) -> Result<()> {
        let blocks = {
            let mut pool = self.pool();
            let blocks = std::mem::take(&mut pool.blocks);
            for (&capacity, ptrs) in &blocks {
                for _ in ptrs {
                    pool.stats.released(capacity);
                }
            }
            blocks
        };
        self.bind()?;
        for p in blocks.into_values().flatten() {
            // SAFETY: cached blocks are owned by the cache and referenced by nothing else; they
            // were used on the device's own stream only.
            unsafe { result::free_async(p, self.0.stream) }.map_err(|e| driver("empty_cache", e))?;
        }
        // SAFETY: the device's own stream, in the bound context.
        unsafe { result::stream::synchronize(self.0.stream) }.map_err(|e| self.kernel_fault(e))?;
        // Give the freed memory back to the device, so other processes and the driver's own
        // allocations (NCCL's buffers, cuBLAS's workspaces) can have it.
        let dev = result::device::get(self.0.ordinal as i32).map_err(|e| driver("empty_cache", e))?;
        // SAFETY: the device's default pool; trimming to 0 frees only memory no allocation holds.
        unsafe {
            let pool = result::device::get_default_mem_pool(dev).map_err(|e| driver("empty_cache", e))?;
            sys::cuMemPoolTrimTo(pool, 0).result().map_err(|e| driver("empty_cache", e))
        }
    }

    /// The device's memory counters now (see [`MemoryStats`]), like `torch.cuda.memory_stats`.
    pub fn memory_stats(&self) -> MemoryStats {
        self.pool().stats
    }

    /// Starts the peaks of [`MemoryStats`] again from the current values, like
    /// `torch.cuda.reset_peak_memory_stats`: the peak of what a piece of code allocates is then
    /// `memory_stats().peak_allocated_bytes` after it.
    #[doc(alias = "reset_peak")]
    pub fn reset_peak_memory_stats(&self) {
        let s = &mut self.pool().stats;
        s.peak_allocated_bytes = s.allocated_bytes;
        s.peak_requested_bytes = s.requested_bytes;
        s.peak_reserved_bytes = s.reserved_bytes;
    }

    /// Free and total device memory in bytes as the driver sees it (`cuMemGetInfo`, like
    /// `torch.cuda.mem_get_info`): all processes' allocations count, and so does memory the
    /// driver's pool keeps for this one.
    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        result::mem_get_info().map_err(|e| driver("mem_get_info", e))
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
    /// small blocks that the work issued next reads. Not for work a CUDA graph may record: the
    /// graph keeps the address of `src`, not its contents.
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

    /// Copies `height` rows of `width` bytes from this buffer (row `r` at `src_offset + r *
    /// src_pitch`) into `dst` (row `r` at `dst_offset + r * dst_pitch`), stream-ordered: the
    /// gather and scatter of `narrow` and `cat`. An error if a row falls outside either buffer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy_rows_to(
        &self,
        src_offset: usize,
        src_pitch: usize,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
        dst_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<()> {
        if width == 0 || height == 0 {
            return Ok(());
        }
        let end = |offset: usize, pitch: usize| {
            (height - 1).checked_mul(pitch).and_then(|a| a.checked_add(offset)).and_then(|a| a.checked_add(width))
        };
        let fits = |e: Option<usize>, bytes: usize| e.is_some_and(|e| e <= bytes);
        if (height > 1 && width > src_pitch.min(dst_pitch))
            || !fits(end(src_offset, src_pitch), self.bytes)
            || !fits(end(dst_offset, dst_pitch), dst.bytes)
        {
            return Err(Error::InvalidArgument {
                op: "copy_rows",
                message: format!(
                    "{height} rows of {width} bytes (pitches {src_pitch}, {dst_pitch}; offsets {src_offset}, \
                     {dst_offset}) outside buffers of {} and {} bytes",
                    self.bytes, dst.bytes
                ),
            });
        }
        self.dev.bind()?;
        let stream = self.dev.stream();
        let contiguous = height == 1 || (src_pitch == width && dst_pitch == width);
        if contiguous {
            // SAFETY: both ranges were checked against the buffers above.
            return unsafe {
                result::memcpy_dtod_async(
                    dst.ptr + dst_offset as u64,
                    self.ptr + src_offset as u64,
                    width * height,
                    stream,
                )
            }
            .map_err(|e| driver("copy_rows", e));
        }
        // The driver's 2-D copy takes pitches up to a limit (2^31 - 1 bytes on current GPUs):
        // beyond it, one copy a row.
        const MAX_PITCH: usize = (1 << 31) - 1;
        if src_pitch.max(dst_pitch) > MAX_PITCH {
            for r in 0..height {
                // SAFETY: row r of each side lies inside the ranges checked above.
                unsafe {
                    result::memcpy_dtod_async(
                        dst.ptr + (dst_offset + r * dst_pitch) as u64,
                        self.ptr + (src_offset + r * src_pitch) as u64,
                        width,
                        stream,
                    )
                }
                .map_err(|e| driver("copy_rows", e))?;
            }
            return Ok(());
        }
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: self.ptr + src_offset as u64,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst.ptr + dst_offset as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width,
            Height: height,
        };
        // SAFETY: a plain description of two device ranges checked above, read during the call.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream).result() }.map_err(|e| driver("copy_rows", e))
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
                let mut pool = self.dev.pool();
                pool.blocks.entry(self.capacity).or_default().push(self.ptr);
                pool.stats.freed(self.capacity, self.bytes);
            }
            Origin::Stream(stream) => {
                {
                    let stats = &mut self.dev.pool().stats;
                    stats.freed(self.capacity, self.bytes);
                    stats.released(self.capacity);
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The counters of a block's life: reserved from the driver, allocated, freed to the cache,
    /// reused, released by `empty_cache`.
    #[test]
    fn counters_follow_a_block() {
        let mut s = MemoryStats::default();
        s.reserved(4096);
        s.allocated(4096, 4000);
        assert_eq!((s.allocated_bytes, s.requested_bytes, s.reserved_bytes, s.cached_bytes), (4096, 4000, 4096, 0));
        s.freed(4096, 4000);
        assert_eq!((s.allocated_bytes, s.requested_bytes, s.cached_bytes), (0, 0, 4096));
        s.allocated(4096, 3900);
        s.freed(4096, 3900);
        s.released(4096);
        assert_eq!((s.reserved_bytes, s.cached_bytes), (0, 0));
        assert_eq!((s.peak_allocated_bytes, s.peak_requested_bytes, s.peak_reserved_bytes), (4096, 4000, 4096));
        assert_eq!((s.num_allocs, s.num_frees, s.num_device_allocs, s.num_device_frees), (2, 2, 1, 1));
    }

    #[test]
    fn blocks_round_to_the_bins() {
        assert_eq!(block_capacity(1), 512);
        assert_eq!(block_capacity(4000), 4096);
        assert_eq!(block_capacity(1 << 20), 1 << 20);
        assert_eq!(block_capacity((1 << 20) + 1), 2 << 20);
        assert_eq!(block_capacity(3 << 20), 4 << 20);
    }
}
