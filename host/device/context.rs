//! The driver, the devices and their contexts and streams: `Device::cuda`, binding the context
//! to a thread, the foreign streams of `Device::with_stream`, synchronisation.

use super::*;
use crate::error::{Error, Result, driver};
use cudarc::driver::{result, sys};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

thread_local! {
    pub(super) static CURRENT_CTX: Cell<sys::CUcontext> = const { Cell::new(std::ptr::null_mut()) };
    /// The stream set by [`Device::with_stream`] on this thread: the address of the overriding
    /// device's `Inner` and the stream handle (as integers, so that buffers recording the stream
    /// stay `Send`).
    pub(super) static STREAM_OVERRIDE: Cell<Option<(usize, usize)>> = const { Cell::new(None) };
}

pub(super) static DEVICES: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();

/// Loads and initialises the driver library; an error, never a panic, when it is missing.
pub(super) fn init_driver() -> Result<()> {
    pub(super) static INIT: OnceLock<Result<(), Error>> = OnceLock::new();
    INIT.get_or_init(|| {
        if !driver_library_present() {
            return Err(Error::NoDriver { detail: "the NVIDIA driver library libcuda.so.1 was not found".into() });
        }
        result::init().map_err(|e| Error::NoDriver { detail: format!("cuInit failed: {e:?}") })
    })
    .clone()
}

/// Whether the driver library can be opened. cudarc panics on the first driver call if it cannot
/// (when it loads the driver at run time), which this check is here to prevent. Probed here rather
/// than with cudarc's `is_culib_present`, which exists only in cudarc's loading mode: a build with
/// candle links the driver instead (see Cargo.toml).
fn driver_library_present() -> bool {
    ["libcuda.so.1", "libcuda.so", "nvcuda.dll"].iter().any(|name| {
        // SAFETY: opening the NVIDIA driver library runs only its own initialisers, which have no
        // preconditions; the handle is closed at once.
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

/// Forgets which context is current on this thread, so that the next `bind` sets it: for
/// after a library (NCCL) that may change the current context behind the cache.
pub(crate) fn forget_current_context() {
    CURRENT_CTX.with(|c| c.set(std::ptr::null_mut()));
}

/// Number of CUDA devices; an error when there is no driver.
pub fn device_count() -> Result<usize> {
    init_driver()?;
    result::device::get_count().map(|n| n as usize).map_err(|e| driver("device_count", e))
}

impl Device {
    /// GPU `ordinal`, initialised on first use (context, stream, the choice of PTX); later calls
    /// return the same device. Each op's kernels are loaded on the op's first use: with an empty
    /// JIT cache the driver compiles them then (a second or two; the GEMM tiles a few seconds).
    pub fn cuda(ordinal: usize) -> Result<Device> {
        let map = DEVICES.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Device(Arc::new(Inner::new(ordinal)?));
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// The device's index, as given to [`Device::cuda`].
    pub fn ordinal(&self) -> usize {
        self.0.ordinal
    }
    /// The GPU's name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> &str {
        &self.0.name
    }
    /// The compute capability (major, minor): `(9, 0)` for an H100.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.0.compute_capability
    }
    /// The architecture of the PTX this device loaded: [`ptx_arch_for`] its compute capability,
    /// or an older one if the driver refused that (too old for its PTX ISA version) or the
    /// environment variable `KERNELS_PTX_ARCH` names it.
    pub fn ptx_arch(&self) -> &'static str {
        self.0.ptx_arch
    }

    /// The number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.0.sm_count
    }

    /// Makes this device's context current on the calling thread (cached per thread).
    pub(crate) fn bind(&self) -> Result<()> {
        let ctx = self.0.ctx;
        if CURRENT_CTX.with(|c| c.get()) != ctx {
            // SAFETY: ctx is the retained primary context of this device, alive while self is.
            unsafe { result::ctx::set_current(ctx) }.map_err(|e| driver("bind", e))?;
            CURRENT_CTX.with(|c| c.set(ctx));
        }
        Ok(())
    }

    /// Waits for all work issued on this device (inside [`Device::with_stream`]: on that
    /// stream). Reports a kernel fault with the name of the last kernel launched (exact with
    /// `KERNELS_SYNC=1`, which synchronises after every launch).
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the stream belongs to this device's context, bound above (a foreign one by the
        // contract of `with_stream`).
        unsafe { result::stream::synchronize(self.stream()) }.map_err(|e| self.kernel_fault(e))
    }

    /// Whether this thread's stream on the device (inside [`Device::with_stream`]: that stream)
    /// is capturing a CUDA graph (`cuStreamIsCapturing`; a capture already invalidated by an
    /// error counts): its work is then recorded for the graph's replays, not run, so nothing may
    /// wait for it, and the ops that would read a flag back (the cross-entropy's target check)
    /// skip the check.
    pub fn is_capturing(&self) -> Result<bool> {
        self.bind()?;
        // SAFETY: the stream belongs to this device's context, bound above (a foreign one by the
        // contract of `with_stream`).
        let status = unsafe { result::stream::is_capturing(self.stream()) }.map_err(|e| driver("is_capturing", e))?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// The foreign stream of [`Device::with_stream`], if this thread is inside it for this device.
    pub(super) fn foreign_stream(&self) -> Option<sys::CUstream> {
        match STREAM_OVERRIDE.with(Cell::get) {
            Some((dev, s)) if dev == Arc::as_ptr(&self.0) as usize => Some(s as sys::CUstream),
            _ => None,
        }
    }

    /// The stream this thread's work on the device goes to.
    pub(super) fn stream(&self) -> sys::CUstream {
        self.foreign_stream().unwrap_or(self.0.stream)
    }

    /// Runs `f` with every launch, copy and memset this thread issues on this device going to
    /// `stream` (a `CUstream`, e.g. PyTorch's `torch.cuda.current_stream().cuda_stream`; 0 is
    /// the legacy default stream) instead of the device's own stream, so that the work is
    /// ordered with whatever else runs on `stream`. Nests; restores the previous stream and the
    /// thread's previous current context on return, also when `f` panics.
    ///
    /// Allocation inside `f` bypasses the device's cache: the cache's reuse is sound only
    /// because all of its blocks are used on the one device stream, and a block used on
    /// `stream` could be handed out again while a kernel on `stream` still reads it. Instead,
    /// memory is allocated with `cuMemAllocAsync` on `stream` and freed with `cuMemFreeAsync` on
    /// `stream` when the tensor drops, which the driver orders after the work on that stream
    /// (the memory comes from the device's default pool, which keeps it for reuse: no
    /// allocation reaches the OS on the hot path).
    ///
    /// `stream` may be capturing a CUDA graph (PyTorch's `torch.cuda.graph`): the ops then issue
    /// only what a graph records (launches, memsets, device copies, and those allocations and
    /// frees, which become the graph's own memory nodes) and wait for nothing; see
    /// [`Device::is_capturing`]. Call each op once outside the capture first (its kernels load
    /// on first use).
    ///
    /// # Safety
    /// - `stream` is a valid stream of this device's primary context (PyTorch's streams of this
    ///   device are), and stays valid until every tensor allocated inside `f` has been dropped.
    /// - Tensors allocated inside `f` are used only on `stream` (inside this or another
    ///   `with_stream` call on the same stream), not on the device's own stream.
    /// - Tensors that `f` uses but that were allocated outside it (by the device's cache or
    ///   borrowed from foreign memory) are ready for `stream`: work that wrote them on another
    ///   stream has completed or is ordered before `stream`'s current position, and no other
    ///   stream writes them while `f`'s work runs; `f` does not drop such cached tensors (their
    ///   blocks would go back to the cache while `stream` may still read them).
    pub unsafe fn with_stream<R>(&self, stream: *mut std::ffi::c_void, f: impl FnOnce() -> R) -> Result<R> {
        struct Restore {
            stream: Option<(usize, usize)>,
            ctx: Option<sys::CUcontext>,
        }
        impl Drop for Restore {
            fn drop(&mut self) {
                STREAM_OVERRIDE.with(|c| c.set(self.stream));
                if let Some(ctx) = self.ctx {
                    // SAFETY: the context was current on entry, so it is alive (the caller's).
                    if unsafe { result::ctx::set_current(ctx) }.is_ok() {
                        CURRENT_CTX.with(|c| c.set(ctx));
                    }
                }
            }
        }
        // Foreign code (PyTorch's runtime) may have changed the current context behind the
        // per-thread cache of `bind`: ask the driver, make ours current, and give theirs back.
        let prev_ctx = result::ctx::get_current().map_err(|e| driver("with_stream", e))?;
        if prev_ctx != Some(self.0.ctx) {
            // SAFETY: the retained primary context of this device, alive while self is.
            unsafe { result::ctx::set_current(self.0.ctx) }.map_err(|e| driver("with_stream", e))?;
        }
        CURRENT_CTX.with(|c| c.set(self.0.ctx));
        let key = Some((Arc::as_ptr(&self.0) as usize, stream as usize));
        let _restore = Restore {
            stream: STREAM_OVERRIDE.with(|c| c.replace(key)),
            ctx: prev_ctx.filter(|&c| c != self.0.ctx && !c.is_null()),
        };
        Ok(f())
    }

    pub(super) fn kernel_fault(&self, e: cudarc::driver::DriverError) -> Error {
        let i = self.0.last_launch.load(Ordering::Relaxed);
        let kernel = self.0.kernels.get(i).map_or("<none>".to_string(), |k| k.name.clone());
        let message = match e.error_string() {
            Ok(s) => format!("{:?}: {}", e.0, s.to_string_lossy()),
            Err(_) => format!("{:?}", e.0),
        };
        Error::Kernel { kernel, message }
    }

    /// The `CUstream` this thread's work on the device goes to (the device's own stream, or the
    /// one of [`Device::with_stream`]), for ordering another CUDA library's work with the
    /// library's (the GEMM bench runs cuBLAS on it).
    pub fn cu_stream(&self) -> *mut std::ffi::c_void {
        self.stream() as *mut std::ffi::c_void
    }
}

impl Inner {
    pub(super) fn new(ordinal: usize) -> Result<Inner> {
        init_driver()?;
        let available = result::device::get_count().map_err(|e| driver("Device::cuda", e))? as usize;
        if ordinal >= available {
            return Err(Error::NoDevice { ordinal, available });
        }
        let op = "Device::cuda";
        let dev = result::device::get(ordinal as i32).map_err(|e| driver(op, e))?;
        let name = result::device::get_name(dev).map_err(|e| driver(op, e))?;
        let attr = |a| {
            // SAFETY: dev is a valid device handle.
            unsafe { result::device::get_attribute(dev, a) }.map_err(|e| driver(op, e))
        };
        use sys::CUdevice_attribute::*;
        let compute_capability =
            (attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?);
        if compute_capability.0 < 8 {
            return Err(Error::InvalidArgument {
                op,
                message: format!(
                    "{name} has compute capability {}.{}; the kernels need 8.0 or newer \
                     (bf16 conversions)",
                    compute_capability.0, compute_capability.1
                ),
            });
        }
        let sm_count = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_shared = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0) as u32;
        // SAFETY: retaining the primary context of a valid device; released in Drop.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(|e| driver(op, e))?;
        // SAFETY: ctx was just retained.
        unsafe { result::ctx::set_current(ctx) }.map_err(|e| driver(op, e))?;
        CURRENT_CTX.with(|c| c.set(ctx));
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| driver(op, e))?;
        // Keep freed memory in the pool instead of returning it to the OS after every
        // synchronisation: allocation then costs microseconds, like PyTorch's caching allocator.
        // SAFETY: dev is valid; the attribute takes a u64.
        unsafe {
            let pool = result::device::get_default_mem_pool(dev).map_err(|e| driver(op, e))?;
            let mut threshold: u64 = u64::MAX;
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            )
            .result()
            .map_err(|e| driver(op, e))?;
        }
        // The newest PTX the GPU runs; should the driver refuse it (a driver older than the PTX
        // ISA version: sm_90's is 8.1, CUDA 12.1), the next older one, down to sm_80. The
        // version is the same in every module of a PTX, so its smallest module decides, and
        // stays loaded.
        let mut newest = PTX_ARCHES.iter().position(|&a| a == ptx_arch_for(compute_capability)).unwrap_or(0);
        // KERNELS_PTX_ARCH=sm_80 runs the portable kernels on a newer GPU (how the tests check
        // the Ampere kernels on an H100).
        if let Some(forced) = std::env::var("KERNELS_PTX_ARCH").ok().filter(|v| !v.is_empty()) {
            match PTX_ARCHES.iter().position(|&a| a == forced) {
                Some(i) if i <= newest => newest = i,
                _ => {
                    return Err(Error::Driver {
                        op: "choosing the PTX (KERNELS_PTX_ARCH)",
                        message: format!(
                            "`{forced}` is not one of the embedded {:?} that compute capability {}.{} runs",
                            &PTX_ARCHES[..=newest],
                            compute_capability.0,
                            compute_capability.1
                        ),
                    });
                }
            }
        }
        let mut loaded = None;
        let mut refused = Vec::new();
        for &arch in PTX_ARCHES[..=newest].iter().rev() {
            let modules = modules_for(arch).expect("an embedded architecture");
            let (probe, m) = modules.iter().enumerate().min_by_key(|(_, m)| m.text.as_bytes().len()).expect("kernels");
            // SAFETY: a NUL-terminated PTX string; the driver copies what it needs.
            match unsafe { result::module::load_data(m.text.as_ptr() as *const _) } {
                Ok(h) => {
                    loaded = Some((arch, modules, probe, h));
                    break;
                }
                Err(e) => refused.push(format!("{arch}: {e:?}")),
            }
        }
        let Some((ptx_arch, ptx_modules, probe, probe_handle)) = loaded else {
            return Err(Error::Driver { op: "loading the kernel module", message: refused.join("; ") });
        };
        let mut modules = Vec::with_capacity(ptx_modules.len());
        let mut kernels = Vec::new();
        let mut by_name = HashMap::new();
        for (mi, m) in ptx_modules.iter().enumerate() {
            modules.push(Module { ptx: m, handle: OnceLock::new(), loading: Mutex::new(()) });
            for name in &m.entries {
                by_name.insert(name.clone(), kernels.len());
                kernels.push(Kernel { name: name.clone(), module: mi, func: OnceLock::new() });
            }
        }
        let inner = Inner {
            ordinal,
            name,
            compute_capability,
            ptx_arch,
            sm_count,
            max_shared,
            ctx,
            stream,
            modules,
            kernels,
            by_name,
            last_launch: AtomicUsize::new(usize::MAX),
            sync_each_launch: std::env::var("KERNELS_SYNC").is_ok_and(|v| v == "1"),
            poison_alloc: std::env::var("KERNELS_POISON_ALLOC").is_ok_and(|v| v == "1"),
            pool: Mutex::new(memory::Pool::default()),
            occupancy: Mutex::new(HashMap::new()),
            cluster_occupancy: Mutex::new(HashMap::new()),
            tracing: AtomicBool::new(false),
            trace: Mutex::new(None),
            map_cache: Mutex::new(map_cache::MapCache::default()),
        };
        inner.install(&inner.modules[probe], probe_handle)?;
        Ok(inner)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: nothing uses these handles after the last Device clone is gone.
        unsafe {
            if result::ctx::set_current(self.ctx).is_ok() {
                let pool = std::mem::take(&mut self.pool.get_mut().unwrap_or_else(|p| p.into_inner()).blocks);
                for p in pool.into_values().flatten() {
                    let _ = result::free_async(p, self.stream);
                }
                let _ = result::stream::synchronize(self.stream);
                // The stream has finished, and with the last clone gone no graph of the library's
                // is replayed (a graph still holding a slot's address is the caller's to drop first).
                let chunks = std::mem::take(&mut self.map_cache.get_mut().unwrap_or_else(|p| p.into_inner()).chunks);
                for p in chunks {
                    let _ = result::free_sync(p);
                }
                let _ = result::stream::destroy(self.stream);
                for m in &self.modules {
                    if let Some(&h) = m.handle.get() {
                        let _ = result::module::unload(h);
                    }
                }
                if let Ok(dev) = result::device::get(self.ordinal as i32) {
                    let _ = result::primary_ctx::release(dev);
                }
            }
        }
    }
}
