//! The runtime: one [`Device`] per GPU, holding its context, its stream and the kernel modules.
//!
//! This is the only module that talks to the CUDA driver (through `cudarc`'s thin `result`/`sys`
//! layer). Everything unsafe about the driver is here, each call with the invariant it relies
//! on; the rest of the library uses the safe methods below.
//!
//! Ordering: every operation of a device runs on that device's one stream, in the order it was
//! issued, so results are ready for the next op without synchronisation; copies back to the host
//! synchronise. Memory comes from the driver's stream-ordered pool (`cuMemAllocAsync`), and freed
//! buffers are cached by the device and reused without a driver call (see `Device::alloc`).
//!
//! Foreign streams (PyTorch's): inside [`Device::with_stream`] the calling thread's work on the
//! device goes to the given stream instead, and allocations bypass the cache (see there).

use crate::error::{Error, Result, driver};
use cudarc::driver::{result, sys};
use kernels_gpu::kernel::KernelArgs;
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The PTX modules built from `kernels-gpu` by `build.rs`, stored deflated, oldest target
/// first: `sm_80` (every kernel; the driver compiles it for any GPU from Ampere on) and `sm_90`
/// (the same kernels plus those that need Hopper's thread-block clusters).
static PTX_DEFLATED: [(&str, &[u8]); 2] = [
    ("sm_80", include_bytes!(concat!(env!("OUT_DIR"), "/kernels-sm_80.ptx.deflate"))),
    ("sm_90", include_bytes!(concat!(env!("OUT_DIR"), "/kernels-sm_90.ptx.deflate"))),
];

/// The architectures whose PTX the library embeds, oldest first.
pub const PTX_ARCHES: [&str; 2] = [PTX_DEFLATED[0].0, PTX_DEFLATED[1].0];

/// The PTX built for `arch` (one of [`PTX_ARCHES`]; decompressed on first use), or `None`.
pub fn ptx_for(arch: &str) -> Option<&'static str> {
    static PTX: [OnceLock<String>; 2] = [OnceLock::new(), OnceLock::new()];
    let i = PTX_DEFLATED.iter().position(|(a, _)| *a == arch)?;
    Some(PTX[i].get_or_init(|| {
        let bytes =
            miniz_oxide::inflate::decompress_to_vec(PTX_DEFLATED[i].1).expect("the embedded PTX is valid deflate");
        String::from_utf8(bytes).expect("PTX is ASCII")
    }))
}

/// The PTX that a device of compute capability `cc` loads: the newest target it can run.
pub fn ptx_arch_for(cc: (i32, i32)) -> &'static str {
    if cc.0 >= 9 { "sm_90" } else { "sm_80" }
}

/// The portable PTX (`sm_80`), which every supported GPU can load.
pub fn ptx() -> &'static str {
    ptx_for(PTX_ARCHES[0]).expect("embedded")
}

/// One op's module of the PTX for `arch` (`kernels_gpu::ptx_modules`): its text for the driver
/// and its entries.
struct PtxModule {
    key: String,
    text: CString,
    entries: Vec<String>,
}

/// The PTX for `arch` cut into one module per op (split on first use, shared by the devices).
fn modules_for(arch: &str) -> Option<&'static [PtxModule]> {
    static MODULES: [OnceLock<Vec<PtxModule>>; 2] = [OnceLock::new(), OnceLock::new()];
    let i = PTX_DEFLATED.iter().position(|(a, _)| *a == arch)?;
    let ptx = ptx_for(arch)?;
    Some(MODULES[i].get_or_init(|| {
        kernels_gpu::ptx_modules::split(ptx)
            .into_iter()
            .map(|m| PtxModule {
                key: m.key,
                text: CString::new(m.text).expect("PTX has no NUL bytes"),
                entries: m.entries,
            })
            .collect()
    }))
}

/// Grid and block of a launch, plus its dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads a block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory a block, in bytes.
    pub shared_bytes: u32,
}

/// A kernel of the library: its name, its op's module, and its function once that is loaded.
struct Kernel {
    name: String,
    /// Index into `Inner::modules`.
    module: usize,
    func: OnceLock<Func>,
}

/// A loaded kernel function and what the launch logic asks of it.
#[derive(Clone, Copy)]
struct Func {
    func: sys::CUfunction,
    /// Resident blocks per SM at 256 threads: the grid-stride kernels launch one full wave.
    blocks_per_sm_256: u32,
    /// The largest block it can be launched with (`CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK`).
    max_threads: u32,
}

/// An op's module on this device, loaded (compiled by the driver) on first use of one of its
/// kernels: see `kernels_gpu::ptx_modules` for why not all at once.
struct Module {
    ptx: &'static PtxModule,
    handle: OnceLock<sys::CUmodule>,
    /// Held while the module loads, so that two threads do not load it twice.
    loading: Mutex<()>,
}

struct Inner {
    ordinal: usize,
    name: String,
    compute_capability: (i32, i32),
    /// The architecture of the loaded PTX (see [`Device::ptx_arch`]).
    ptx_arch: &'static str,
    sm_count: u32,
    /// Opt-in maximum of dynamic shared memory per block, in bytes.
    max_shared: u32,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    modules: Vec<Module>,
    kernels: Vec<Kernel>,
    by_name: HashMap<String, usize>,
    /// Index of the last kernel launched, to name it when a later synchronisation reports that a
    /// kernel faulted.
    last_launch: AtomicUsize,
    /// `KERNELS_SYNC=1`: synchronise after every launch, so a fault is pinned to its kernel.
    sync_each_launch: bool,
    /// `KERNELS_POISON_ALLOC=1`: fill every new allocation with 0xFF bytes (NaN in f32, f16 and
    /// bf16), so an element a kernel fails to write reads back as NaN. For tests; costs a memset.
    poison_alloc: bool,
    /// Freed blocks by capacity, reused without a driver call (see `alloc`).
    pool: Mutex<HashMap<usize, Vec<sys::CUdeviceptr>>>,
    /// `blocks_per_sm` answers by (kernel, threads, shared bytes): the driver's occupancy query
    /// costs microseconds, as much as a small kernel.
    occupancy: Mutex<HashMap<(usize, u32, u32), u32>>,
    /// Resident clusters by (kernel, cluster size, threads, shared bytes): `max_active_clusters`.
    cluster_occupancy: Mutex<HashMap<(usize, u32, u32, u32), u32>>,
}

// SAFETY: CUDA driver handles (context, stream, module, functions) may be used from any thread
// once the context is made current there, which `bind` does before every driver call.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

/// A CUDA GPU with the library's kernels loaded. Cheap to clone (shared); one per GPU per
/// process, created on first use by [`Device::cuda`].
#[derive(Clone)]
pub struct Device(Arc<Inner>);

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device(cuda:{} {})", self.0.ordinal, self.0.name)
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

thread_local! {
    static CURRENT_CTX: Cell<sys::CUcontext> = const { Cell::new(std::ptr::null_mut()) };
    /// The stream set by [`Device::with_stream`] on this thread: the address of the overriding
    /// device's `Inner` and the stream handle (as integers, so that buffers recording the stream
    /// stay `Send`).
    static STREAM_OVERRIDE: Cell<Option<(usize, usize)>> = const { Cell::new(None) };
}

static DEVICES: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();

/// Loads and initialises the driver library; an error, never a panic, when it is missing.
fn init_driver() -> Result<()> {
    static INIT: OnceLock<Result<(), Error>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only probes whether the shared library can be opened. cudarc panics on the
        // first driver call if it cannot, which this check is here to prevent.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoDriver { detail: "the NVIDIA driver library libcuda.so.1 was not found".into() });
        }
        result::init().map_err(|e| Error::NoDriver { detail: format!("cuInit failed: {e:?}") })
    })
    .clone()
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
    /// or an older one if the driver refused that (too old for its PTX ISA version).
    pub fn ptx_arch(&self) -> &'static str {
        self.0.ptx_arch
    }
    /// Whether the device's PTX has kernel `name` (the `sm_90` PTX has kernels that the `sm_80`
    /// one lacks). Loads nothing.
    pub(crate) fn has_kernel(&self, name: &str) -> bool {
        self.0.by_name.contains_key(name)
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

    /// The foreign stream of [`Device::with_stream`], if this thread is inside it for this device.
    fn foreign_stream(&self) -> Option<sys::CUstream> {
        match STREAM_OVERRIDE.with(Cell::get) {
            Some((dev, s)) if dev == Arc::as_ptr(&self.0) as usize => Some(s as sys::CUstream),
            _ => None,
        }
    }

    /// The stream this thread's work on the device goes to.
    fn stream(&self) -> sys::CUstream {
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

    fn kernel_fault(&self, e: cudarc::driver::DriverError) -> Error {
        let i = self.0.last_launch.load(Ordering::Relaxed);
        let kernel = self.0.kernels.get(i).map_or("<none>".to_string(), |k| k.name.clone());
        let message = match e.error_string() {
            Ok(s) => format!("{:?}: {}", e.0, s.to_string_lossy()),
            Err(_) => format!("{:?}", e.0),
        };
        Error::Kernel { kernel, message }
    }

    /// Resident 256-thread blocks per SM for `kernel`.
    pub(crate) fn blocks_per_sm_256(&self, kernel: &str) -> Result<u32> {
        Ok(self.func(self.kernel_index(kernel)?)?.blocks_per_sm_256)
    }

    /// Resident blocks per SM of `kernel` launched with `threads` threads and `smem` bytes of
    /// dynamic shared memory (at least 1).
    pub(crate) fn blocks_per_sm(&self, kernel: &str, threads: u32, smem: u32) -> Result<u32> {
        let i = self.kernel_index(kernel)?;
        let func = self.func(i)?.func;
        let key = (i, threads, smem);
        if let Some(&b) = self.0.occupancy.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(b);
        }
        self.bind()?;
        let mut blocks = 0i32;
        // SAFETY: the function belongs to this device's module; the out-pointer is a local.
        unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, func, threads as i32, smem as usize)
                .result()
                .map_err(|e| driver("occupancy", e))?;
        }
        let b = blocks.max(1) as u32;
        self.0.occupancy.lock().unwrap_or_else(|p| p.into_inner()).insert(key, b);
        Ok(b)
    }

    /// Clusters of `kernel` (a cluster kernel: its cluster size is fixed in its PTX) that can be
    /// resident on the device at once, with `threads` threads and `smem` bytes of dynamic shared
    /// memory per block; 0 when not one fits. Clusters must fit in one GPC each, so this is not
    /// simply SMs / cluster size: a persistent grid of more clusters than this runs in two waves.
    pub(crate) fn max_active_clusters(&self, kernel: &str, cluster: u32, threads: u32, smem: u32) -> Result<u32> {
        let i = self.kernel_index(kernel)?;
        let func = self.func(i)?.func;
        // Asked on every launch of the plans that use it: the driver's answer is kept.
        let key = (i, cluster, threads, smem);
        if let Some(&n) = self.0.cluster_occupancy.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(n);
        }
        self.bind()?;
        let config = sys::CUlaunchConfig {
            gridDimX: cluster,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: std::ptr::null_mut(),
            attrs: std::ptr::null_mut(),
            numAttrs: 0,
        };
        let mut n = 0i32;
        // SAFETY: the function belongs to this device's module; config and the out-pointer are
        // locals. No attributes: the kernel's compile-time cluster size applies.
        unsafe {
            sys::cuOccupancyMaxActiveClusters(&mut n, func, &config)
                .result()
                .map_err(|e| driver("cluster occupancy", e))?;
        }
        let n = n.max(0) as u32;
        self.0.cluster_occupancy.lock().unwrap_or_else(|p| p.into_inner()).insert(key, n);
        Ok(n)
    }

    /// Dynamic shared memory a block may use (the opt-in maximum, which every kernel is
    /// allowed at load).
    pub(crate) fn max_shared_bytes(&self) -> u32 {
        self.0.max_shared
    }

    /// The largest block `kernel` can be launched with.
    pub(crate) fn max_threads(&self, kernel: &str) -> Result<u32> {
        Ok(self.func(self.kernel_index(kernel)?)?.max_threads)
    }

    fn kernel_index(&self, name: &str) -> Result<usize> {
        self.0.by_name.get(name).copied().ok_or_else(|| Error::KernelNotFound { name: name.into() })
    }

    /// Kernel `i`'s function, loading its module first if this is the module's first use.
    fn func(&self, i: usize) -> Result<Func> {
        if let Some(f) = self.0.kernels[i].func.get() {
            return Ok(*f);
        }
        let m = &self.0.modules[self.0.kernels[i].module];
        let _loading = m.loading.lock().unwrap_or_else(|p| p.into_inner());
        if m.handle.get().is_none() {
            self.bind()?;
            // SAFETY: a NUL-terminated PTX string; the driver copies what it needs.
            let handle =
                unsafe { result::module::load_data(m.ptx.text.as_ptr() as *const _) }.map_err(|e| Error::Driver {
                    op: "loading a kernel module",
                    message: format!("{} ({}): {e:?}", m.ptx.key, self.0.ptx_arch),
                })?;
            self.0.install(m, handle)?;
        }
        Ok(*self.0.kernels[i].func.get().expect("installed with its module"))
    }

    /// Launches kernel `name` with `args`, whose type is the kernel's declared signature
    /// (`kernels_gpu::*::*Args`), so the parameter list cannot disagree with the device.
    ///
    /// # Safety
    /// Every pointer in `args` must be a device address on this device, valid for every element
    /// the kernel will touch given the other arguments, and no buffer the kernel writes may be
    /// read or written concurrently by other work. The op functions establish this by checking
    /// tensor lengths against the arguments before calling.
    pub(crate) unsafe fn launch<A: KernelArgs>(&self, name: &str, cfg: LaunchConfig, args: A) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_with(name, cfg, args, false) }
    }

    /// [`Device::launch`] as a programmatic dependent launch where the loaded module is `sm_90`:
    /// the kernel may start while the previous one on the stream is still running, and must
    /// wait for it (`prim::grid_dependency_wait`) before its first access to memory. What
    /// that saves is the launch's latency between a small kernel and the one that finishes its
    /// work (a norm's backward and its column sums: two launches of a few microseconds each).
    /// Elsewhere an ordinary launch.
    ///
    /// # Safety
    /// As [`Device::launch`], and the kernel must call `prim::grid_dependency_wait` before it
    /// reads or writes global memory.
    pub(crate) unsafe fn launch_dependent<A: KernelArgs>(&self, name: &str, cfg: LaunchConfig, args: A) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_with(name, cfg, args, self.0.ptx_arch == "sm_90") }
    }

    /// The launch behind [`Device::launch`] and [`Device::launch_dependent`] (`dependent`: with
    /// the programmatic-serialization attribute, through `cuLaunchKernelEx`).
    ///
    /// # Safety
    /// As [`Device::launch_dependent`] when `dependent`, else as [`Device::launch`].
    unsafe fn launch_with<A: KernelArgs>(&self, name: &str, cfg: LaunchConfig, args: A, dependent: bool) -> Result<()> {
        self.bind()?;
        let i = self.kernel_index(name)?;
        let func = self.func(i)?.func;
        let mut params = args.param_ptrs();
        self.0.last_launch.store(i, Ordering::Relaxed);
        let launched = if dependent {
            // SAFETY: plain C structs, all fields set below or zero.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: cfg.grid.0,
                gridDimY: cfg.grid.1,
                gridDimZ: cfg.grid.2,
                blockDimX: cfg.block.0,
                blockDimY: cfg.block.1,
                blockDimZ: cfg.block.2,
                sharedMemBytes: cfg.shared_bytes,
                hStream: self.stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as below; config and attr are locals alive for the call.
            unsafe { sys::cuLaunchKernelEx(&config, func, params.as_mut_ptr(), std::ptr::null_mut()).result() }
        } else {
            // SAFETY: the function belongs to this context; params point into `args`, alive for
            // the call (cuLaunchKernel copies the values); the caller upholds the memory contract.
            unsafe {
                result::launch_kernel(
                    func,
                    cfg.grid,
                    cfg.block,
                    cfg.shared_bytes,
                    self.stream(),
                    &mut params[..A::ARITY],
                )
            }
        };
        launched
            .map_err(|e| Error::Kernel { kernel: name.into(), message: format!("launch refused: {e:?} ({cfg:?})") })?;
        if self.0.sync_each_launch {
            self.synchronize()?;
        }
        Ok(())
    }

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
    fn alloc_on(&self, op: &'static str, bytes: usize, stream: sys::CUstream) -> Result<DeviceBuffer> {
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

    /// The `CUstream` this thread's work on the device goes to (the device's own stream, or the
    /// one of [`Device::with_stream`]), for ordering another CUDA library's work with the
    /// library's (the GEMM bench runs cuBLAS on it).
    pub fn cu_stream(&self) -> *mut std::ffi::c_void {
        self.stream() as *mut std::ffi::c_void
    }

    /// Records a timing event on this device's stream (inside [`Device::with_stream`]: on that
    /// stream).
    pub fn record_event(&self) -> Result<Event> {
        self.bind()?;
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| driver("record_event", e))?;
        let event = Event { ev, dev: self.clone() };
        // SAFETY: event and stream belong to the bound context.
        unsafe { result::event::record(event.ev, self.stream()) }.map_err(|e| driver("record_event", e))?;
        Ok(event)
    }
}

/// A CUDA event recorded on a device's stream, for timing with [`Event::elapsed_ms`].
pub struct Event {
    ev: sys::CUevent,
    dev: Device,
}

impl Event {
    /// Milliseconds of GPU time between `self` and the later event `end`; waits for `end`.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        self.dev.bind()?;
        // SAFETY: both events were recorded on this device's stream and are alive.
        unsafe {
            result::event::synchronize(end.ev).map_err(|e| self.dev.kernel_fault(e))?;
            result::event::elapsed(self.ev, end.ev).map_err(|e| driver("elapsed_ms", e))
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: the event is not used after this.
            let _ = unsafe { result::event::destroy(self.ev) };
        }
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
enum Origin {
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
    ptr: sys::CUdeviceptr,
    bytes: usize,
    capacity: usize,
    dev: Device,
    origin: Origin,
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

impl Inner {
    fn new(ordinal: usize) -> Result<Inner> {
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
        let newest = PTX_ARCHES.iter().position(|&a| a == ptx_arch_for(compute_capability)).unwrap_or(0);
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
            pool: Mutex::new(HashMap::new()),
            occupancy: Mutex::new(HashMap::new()),
            cluster_occupancy: Mutex::new(HashMap::new()),
        };
        inner.install(&inner.modules[probe], probe_handle)?;
        Ok(inner)
    }

    /// Looks up the kernels of `m`, just loaded as `handle` (with this device's context
    /// current), sets what every launch may need, and marks the module loaded. On an error the
    /// module is unloaded and stays unloaded.
    fn install(&self, m: &Module, handle: sys::CUmodule) -> Result<()> {
        let op = "loading a kernel module";
        let lookup = || -> Result<Vec<Func>> {
            m.ptx
                .entries
                .iter()
                .map(|name| {
                    let cname = CString::new(name.as_str()).expect("kernel names have no NUL bytes");
                    // SAFETY: the module is loaded; the name is an entry of its PTX.
                    let func = unsafe { result::module::get_function(handle, cname) }
                        .map_err(|_| Error::KernelNotFound { name: name.clone() })?;
                    let mut blocks = 0i32;
                    let mut max_threads = 0i32;
                    // SAFETY: func is valid; the out-pointers are locals.
                    unsafe {
                        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, func, 256, 0)
                            .result()
                            .map_err(|e| driver(op, e))?;
                        // Beyond 48 KiB of dynamic shared memory a kernel must opt in; all do,
                        // to the device's limit (the norms' backward keeps column sums there).
                        sys::cuFuncSetAttribute(
                            func,
                            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            self.max_shared as i32,
                        )
                        .result()
                        .map_err(|e| driver(op, e))?;
                        // A grid that is one cluster of more than eight blocks (Hopper's
                        // non-portable sizes, up to 16) is refused unless the kernel opts in.
                        if one_cluster_blocks(name) > 8 {
                            sys::cuFuncSetAttribute(
                                func,
                                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                                1,
                            )
                            .result()
                            .map_err(|e| driver(op, e))?;
                        }
                        // The largest block this kernel can be launched with (its registers
                        // decide).
                        sys::cuFuncGetAttribute(
                            &mut max_threads,
                            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                            func,
                        )
                        .result()
                        .map_err(|e| driver(op, e))?;
                    }
                    Ok(Func { func, blocks_per_sm_256: blocks.max(1) as u32, max_threads: max_threads.max(0) as u32 })
                })
                .collect()
        };
        let funcs = match lookup() {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: loaded above and not handed out.
                let _ = unsafe { result::module::unload(handle) };
                return Err(e);
            }
        };
        for (name, f) in m.ptx.entries.iter().zip(funcs) {
            let _ = self.kernels[self.by_name[name]].func.set(f);
        }
        let _ = m.handle.set(handle);
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: nothing uses these handles after the last Device clone is gone.
        unsafe {
            if result::ctx::set_current(self.ctx).is_ok() {
                let pool = std::mem::take(self.pool.get_mut().unwrap_or_else(|p| p.into_inner()));
                for p in pool.into_values().flatten() {
                    let _ = result::free_async(p, self.stream);
                }
                let _ = result::stream::synchronize(self.stream);
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

/// Blocks of a kernel whose whole grid is one cluster, from its name `<family>_k<K>_...`
/// (kernels-gpu/build_ptx.rs gives it `.reqnctapercluster K`); 0 for any other kernel.
fn one_cluster_blocks(name: &str) -> u32 {
    name.split('_').find_map(|p| p.strip_prefix('k')?.parse::<u32>().ok()).unwrap_or(0)
}
