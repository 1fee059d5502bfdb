//! The embedded PTX, cut into one module per op and loaded on the op's first use, and what
//! the launch logic asks of a loaded kernel (occupancy, block limits).

use super::*;
use crate::error::{Error, Result, driver};
use cudarc::driver::{result, sys};
use std::ffi::CString;
use std::sync::{Mutex, OnceLock};

/// The PTX modules built from `kernels-gpu` by `build.rs`, stored deflated, oldest target
/// first: `sm_80` (every kernel; the driver compiles it for any GPU from Ampere on), `sm_90`
/// (the same kernels plus those that need Hopper's thread-block clusters, for any GPU from
/// Hopper on) and `sm_90a` (those plus the `wgmma` kernels, for compute capability 9.0 only).
pub(super) static PTX_DEFLATED: [(&str, &[u8]); 3] = [
    ("sm_80", include_bytes!(concat!(env!("OUT_DIR"), "/kernels-sm_80.ptx.deflate"))),
    ("sm_90", include_bytes!(concat!(env!("OUT_DIR"), "/kernels-sm_90.ptx.deflate"))),
    ("sm_90a", include_bytes!(concat!(env!("OUT_DIR"), "/kernels-sm_90a.ptx.deflate"))),
];

/// The architectures whose PTX the library embeds, oldest first.
pub const PTX_ARCHES: [&str; 3] = [PTX_DEFLATED[0].0, PTX_DEFLATED[1].0, PTX_DEFLATED[2].0];

/// The PTX built for `arch` (one of [`PTX_ARCHES`]; decompressed on first use), or `None`.
pub fn ptx_for(arch: &str) -> Option<&'static str> {
    pub(super) static PTX: [OnceLock<String>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let i = PTX_DEFLATED.iter().position(|(a, _)| *a == arch)?;
    Some(PTX[i].get_or_init(|| {
        let bytes =
            miniz_oxide::inflate::decompress_to_vec(PTX_DEFLATED[i].1).expect("the embedded PTX is valid deflate");
        String::from_utf8(bytes).expect("PTX is ASCII")
    }))
}

/// The PTX that a device of compute capability `cc` loads: the newest target it can run
/// (`sm_90a` runs on 9.0 alone: its instructions are not in later GPUs).
pub fn ptx_arch_for(cc: (i32, i32)) -> &'static str {
    match cc {
        (9, 0) => "sm_90a",
        (9.., _) => "sm_90",
        _ => "sm_80",
    }
}

/// The portable PTX (`sm_80`), which every supported GPU can load.
pub fn ptx() -> &'static str {
    ptx_for(PTX_ARCHES[0]).expect("embedded")
}

/// One op's module of the PTX for `arch` (`kernels_gpu::ptx_modules`): its text for the driver
/// and its entries.
pub(super) struct PtxModule {
    pub(super) key: String,
    pub(super) text: CString,
    pub(super) entries: Vec<String>,
}

/// The PTX for `arch` cut into one module per op (split on first use, shared by the devices).
pub(super) fn modules_for(arch: &str) -> Option<&'static [PtxModule]> {
    pub(super) static MODULES: [OnceLock<Vec<PtxModule>>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
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

/// A kernel of the library: its name, its op's module, and its function once that is loaded.
pub(super) struct Kernel {
    pub(super) name: String,
    /// Index into `Inner::modules`.
    pub(super) module: usize,
    pub(super) func: OnceLock<Func>,
}

/// A loaded kernel function and what the launch logic asks of it.
#[derive(Clone, Copy)]
pub(super) struct Func {
    pub(super) func: sys::CUfunction,
    /// Resident blocks per SM at 256 threads: the grid-stride kernels launch one full wave.
    blocks_per_sm_256: u32,
    /// The largest block it can be launched with (`CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK`).
    pub(super) max_threads: u32,
}

/// An op's module on this device, loaded (compiled by the driver) on first use of one of its
/// kernels: see `kernels_gpu::ptx_modules` for why not all at once.
pub(super) struct Module {
    pub(super) ptx: &'static PtxModule,
    pub(super) handle: OnceLock<sys::CUmodule>,
    /// Held while the module loads, so that two threads do not load it twice.
    pub(super) loading: Mutex<()>,
}

impl Device {
    /// Whether the device's PTX has kernel `name` (the `sm_90` PTX has kernels that the `sm_80`
    /// one lacks, and `sm_90a` more). Loads nothing.
    pub(crate) fn has_kernel(&self, name: &str) -> bool {
        self.0.by_name.contains_key(name)
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

    pub(super) fn kernel_index(&self, name: &str) -> Result<usize> {
        self.0.by_name.get(name).copied().ok_or_else(|| Error::KernelNotFound { name: name.into() })
    }

    /// Kernel `i`'s function, loading its module first if this is the module's first use.
    pub(super) fn func(&self, i: usize) -> Result<Func> {
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
}

impl Inner {
    /// Looks up the kernels of `m`, just loaded as `handle` (with this device's context
    /// current), sets what every launch may need, and marks the module loaded. On an error the
    /// module is unloaded and stays unloaded.
    pub(super) fn install(&self, m: &Module, handle: sys::CUmodule) -> Result<()> {
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

/// Blocks of a kernel whose whole grid is one cluster, from its name `<family>_k<K>_...`
/// (kernels-gpu/build_ptx.rs gives it `.reqnctapercluster K`); 0 for any other kernel.
pub(super) fn one_cluster_blocks(name: &str) -> u32 {
    name.split('_').find_map(|p| p.strip_prefix('k')?.parse::<u32>().ok()).unwrap_or(0)
}
