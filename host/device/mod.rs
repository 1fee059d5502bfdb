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
//!
//! Split by concern: `context` (the driver, devices, contexts and streams), `module` (the
//! embedded PTX and its per-op modules), `launch`, `memory` (the cache and the buffers),
//! `map_cache` (TMA tensor maps kept on the device, written once each), `event` and `trace`
//! (the timeline recorder). Nothing here knows of the ops.

mod context;
mod event;
mod launch;
mod map_cache;
mod memory;
mod module;
mod trace;

pub use context::device_count;
pub(crate) use context::forget_current_context;
pub use event::Event;
pub(crate) use event::{Mark, SideStream};
pub use launch::LaunchConfig;
pub use map_cache::TensorMapCacheStats;
pub(crate) use memory::DeviceBuffer;
pub use memory::MemoryStats;
pub use module::{PTX_ARCHES, ptx, ptx_arch_for, ptx_for};
pub use trace::{Cost, KernelSpan, MAX_TRACED_LAUNCHES, ScopeSpan, Trace, TraceScope};

// The types of `Inner` and what `context` builds it from (the submodules import `super::*`).
use cudarc::driver::sys;
use module::{Kernel, Module, modules_for};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};

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
    /// `KERNELS_SYNC=1`: synchronise after every launch, so a fault is pinned to its kernel
    /// (not on a stream capturing a CUDA graph, which runs nothing then).
    sync_each_launch: bool,
    /// `KERNELS_POISON_ALLOC=1`: fill every new allocation with 0xFF bytes (NaN in f32, f16 and
    /// bf16), so an element a kernel fails to write reads back as NaN. For tests; costs a memset.
    poison_alloc: bool,
    /// Freed blocks by capacity, reused without a driver call (see `alloc`), and the memory
    /// counters of `memory_stats`.
    pool: Mutex<memory::Pool>,
    /// `blocks_per_sm` answers by (kernel, threads, shared bytes): the driver's occupancy query
    /// costs microseconds, as much as a small kernel.
    occupancy: Mutex<HashMap<(usize, u32, u32), u32>>,
    /// Resident clusters by (kernel, cluster size, threads, shared bytes): `max_active_clusters`.
    cluster_occupancy: Mutex<HashMap<(usize, u32, u32, u32), u32>>,
    /// Whether `trace` holds a recording: read on every launch, so the lock is taken only while
    /// recording.
    tracing: AtomicBool,
    trace: Mutex<Option<trace::Recording>>,
    /// Slots of TMA tensor maps on the device by their words, written once (`map_cache`).
    map_cache: Mutex<map_cache::MapCache>,
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
