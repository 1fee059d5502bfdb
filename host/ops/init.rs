//! Filling tensors (host side of `kernels-gpu/src/init.rs`).

use super::check::with_elem;
use crate::DType;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::{IndexTensor, Tensor};
use kernels_gpu::Elem;
use kernels_gpu::init::{FillArgs, InitElem, RandintArgs, RandomArgs, randint};
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

/// The tensors these kernels make: constants and random values.
impl Tensor {
    /// Every element `value`, rounded to `dtype`.
    pub fn full(dev: &Device, shape: &[usize], dtype: DType, value: f32) -> Result<Tensor> {
        let mut t = Tensor::alloc("Tensor::full", dev, shape, dtype)?;
        t.fill_(value)?;
        Ok(t)
    }

    /// Uniform random values on `[lo, hi)` (before rounding to `dtype`), generated on the device
    /// by Philox4x32-10 from `seed`: the same seed gives the same tensor on any GPU.
    pub fn rand_uniform(dev: &Device, shape: &[usize], dtype: DType, lo: f32, hi: f32, seed: u64) -> Result<Tensor> {
        let op = "Tensor::rand_uniform";
        if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
            return Err(Error::InvalidArgument { op, message: format!("need finite lo <= hi, got [{lo}, {hi})") });
        }
        let mut t = Tensor::alloc(op, dev, shape, dtype)?;
        random(&mut t, Distribution::Uniform, seed, lo, hi)?;
        Ok(t)
    }

    /// Normal random values with `mean` and standard deviation `std`, generated on the device
    /// (Philox4x32-10 and Box-Muller) from `seed`.
    pub fn rand_normal(dev: &Device, shape: &[usize], dtype: DType, mean: f32, std: f32, seed: u64) -> Result<Tensor> {
        let op = "Tensor::rand_normal";
        if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
            return Err(Error::InvalidArgument {
                op,
                message: format!("need finite mean and std >= 0, got {mean}, {std}"),
            });
        }
        let mut t = Tensor::alloc(op, dev, shape, dtype)?;
        random(&mut t, Distribution::Normal, seed, mean, std)?;
        Ok(t)
    }

    /// Sets every element to `value` (rounded to the dtype).
    pub fn fill_(&mut self, value: f32) -> Result<()> {
        fill(self, value)
    }
}

impl IndexTensor {
    /// Integers uniform on `[low, high)`, as `torch.randint(low, high, shape)`, generated on the
    /// device by Philox4x32-10 from `seed` (`kernels_gpu::init::randint_at`: 64 random bits per
    /// element scaled by a multiply, each value within `2^-64` of its share): the same seed gives
    /// the same indices on any GPU. An error unless `low < high`.
    pub fn randint(dev: &Device, low: i64, high: i64, shape: &[usize], seed: u64) -> Result<IndexTensor> {
        let op = "IndexTensor::randint";
        if low >= high {
            return Err(Error::InvalidArgument { op, message: format!("need low < high, got [{low}, {high})") });
        }
        // At most 2^64 - 1: high - low of two i64.
        let span = (high as i128 - low as i128) as u64;
        let mut t = IndexTensor::alloc(op, dev, shape)?;
        let n = t.numel() as u64;
        let Some(cfg) = launch::elementwise(n, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(randint.name())?) else {
            return Ok(t);
        };
        let args: RandintArgs = (t.dev_ptr_mut(), n, seed as u32, (seed >> 32) as u32, low, span);
        // SAFETY: t holds n indices, written before the tensor is handed out.
        unsafe { dev.launch(randint, cfg, args) }?;
        Ok(t)
    }
}
