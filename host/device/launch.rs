//! Kernel launches on a device's stream.

use super::*;
use crate::error::{Error, Result};
use cudarc::driver::{result, sys};
use kernels_gpu::kernel::{Kernel, KernelArgs};
use std::sync::atomic::Ordering;

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

impl Device {
    /// Launches `kernel` with `args`, whose type is the kernel's declared signature
    /// (`kernels_gpu::*::*Args`, the `A` of its [`Kernel<A>`] handle), so the parameter list
    /// cannot disagree with the device.
    ///
    /// # Safety
    /// Every pointer in `args` must be a device address on this device, valid for every element
    /// the kernel will touch given the other arguments, and no buffer the kernel writes may be
    /// read or written concurrently by other work. The op functions establish this by checking
    /// tensor lengths against the arguments before calling.
    pub(crate) unsafe fn launch<A: KernelArgs>(&self, kernel: Kernel<A>, cfg: LaunchConfig, args: A) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_with(kernel.name(), cfg, args, false) }
    }

    /// [`Device::launch`] as a programmatic dependent launch where the loaded module is `sm_90` or
    /// `sm_90a`:
    /// the kernel may start while the previous one on the stream is still running, and must
    /// wait for it (`prim::grid_dependency_wait`) before its first access to memory. What
    /// that saves is the launch's latency between a small kernel and the one that finishes its
    /// work (a norm's backward and its column sums: two launches of a few microseconds each).
    /// Elsewhere an ordinary launch.
    ///
    /// # Safety
    /// As [`Device::launch`], and the kernel must call `prim::grid_dependency_wait` before it
    /// reads or writes global memory.
    pub(crate) unsafe fn launch_dependent<A: KernelArgs>(
        &self,
        kernel: Kernel<A>,
        cfg: LaunchConfig,
        args: A,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_with(kernel.name(), cfg, args, self.0.ptx_arch.starts_with("sm_90")) }
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
        let traced = self.trace_launch_begin();
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
        if let Some(start) = traced {
            self.trace_launch_end(start, i, cfg, launched.is_ok());
        }
        launched
            .map_err(|e| Error::Kernel { kernel: name.into(), message: format!("launch refused: {e:?} ({cfg:?})") })?;
        // A capturing stream runs nothing yet, and may not be waited for.
        if self.0.sync_each_launch && !self.is_capturing()? {
            self.synchronize()?;
        }
        Ok(())
    }
}
