//! Filling tensors (host side of `kernels-gpu/src/init.rs`).

use super::check::with_elem;
use crate::error::Result;
use crate::launch;
use crate::tensor::Tensor;
use kernels_gpu::Elem;
use kernels_gpu::init::{FillArgs, InitElem, RandomArgs};
use kernels_gpu::kernel::Kernel;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Distribution {
    /// `p`, `q` = lo, hi.
    Uniform,
    /// `p`, `q` = mean, std.
    Normal,
}

fn config(t: &Tensor, kernel: &str) -> Result<Option<crate::device::LaunchConfig>> {
    let dev = t.device();
    let vec = with_elem!(t.dtype(), |T| T::VEC as u64);
    Ok(launch::elementwise(t.numel() as u64, vec, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel)?))
}

pub(crate) fn fill(t: &mut Tensor, value: f32) -> Result<()> {
    let kernel = with_elem!(t.dtype(), |T| T::INIT.fill.name());
    let Some(cfg) = config(t, kernel)? else { return Ok(()) };
    let n = t.numel() as u64;
    with_elem!(t.dtype(), |T| {
        let args: FillArgs<T> = (t.dev_ptr_mut()?, n, value);
        // SAFETY: t holds n elements of T.
        unsafe { t.device().launch(T::INIT.fill, cfg, args) }
    })
}

/// `T`'s kernel of `dist`.
fn random_kernel<T: InitElem>(dist: Distribution) -> Kernel<RandomArgs<T>> {
    match dist {
        Distribution::Uniform => T::INIT.uniform,
        Distribution::Normal => T::INIT.normal,
    }
}

pub(crate) fn random(t: &mut Tensor, dist: Distribution, seed: u64, p: f32, q: f32) -> Result<()> {
    let name = with_elem!(t.dtype(), |T| random_kernel::<T>(dist).name());
    let Some(cfg) = config(t, name)? else { return Ok(()) };
    let n = t.numel() as u64;
    with_elem!(t.dtype(), |T| {
        let args: RandomArgs<T> = (t.dev_ptr_mut()?, n, seed as u32, (seed >> 32) as u32, p, q);
        // SAFETY: t holds n elements of T.
        unsafe { t.device().launch(random_kernel::<T>(dist), cfg, args) }
    })
}
