//! Filling tensors (host side of `kernels-gpu/src/init.rs`).

use super::check::with_elem;
use crate::error::Result;
use crate::launch;
use crate::tensor::Tensor;
use kernels_gpu::Elem;
use kernels_gpu::init::{FillArgs, RandomArgs, fill_kernel, normal_kernel, uniform_kernel};

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
    let kernel = fill_kernel(t.dtype());
    let Some(cfg) = config(t, kernel)? else { return Ok(()) };
    let n = t.numel() as u64;
    with_elem!(t.dtype(), |T| {
        let args: FillArgs<T> = (t.dev_ptr_mut()?, n, value);
        // SAFETY: t holds n elements of T.
        unsafe { t.device().launch(kernel, cfg, args) }
    })
}

pub(crate) fn random(t: &mut Tensor, dist: Distribution, seed: u64, p: f32, q: f32) -> Result<()> {
    let kernel = match dist {
        Distribution::Uniform => uniform_kernel(t.dtype()),
        Distribution::Normal => normal_kernel(t.dtype()),
    };
    let Some(cfg) = config(t, kernel)? else { return Ok(()) };
    let n = t.numel() as u64;
    with_elem!(t.dtype(), |T| {
        let args: RandomArgs<T> = (t.dev_ptr_mut()?, n, seed as u32, (seed >> 32) as u32, p, q);
        // SAFETY: t holds n elements of T.
        unsafe { t.device().launch(kernel, cfg, args) }
    })
}
