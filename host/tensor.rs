//! `Tensor`: a contiguous, row-major array in device memory with a shape and a dtype.

use crate::DType;
use crate::device::{Device, DeviceBuffer};
use crate::error::{Error, Result};
use half::{bf16, f16};
use std::sync::Arc;

/// Host element types and their [`DType`]: `f32`, `half::f16`, `half::bf16`.
pub trait Element: Copy + Send + Sync + 'static + sealed::Sealed {
    /// The tensor dtype of this host type.
    const DTYPE: DType;
    /// The value as f32 (exact for all three).
    fn to_f32(self) -> f32;
    /// The nearest value of this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
}
mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// A tensor on a GPU. Operations on one device run in issue order on its stream; reading back
/// (`to_vec`) waits for them.
///
/// `clone` is cheap: the clones share the device memory until one of them is written, and the
/// one written first gets its own copy (copy-on-write), so a write through one tensor is never
/// seen through another. Backward passes use it to hand the incoming gradient on without a
/// copy where it is the answer (the gradients of `add`, `sub`'s first operand, `add_scalar`),
/// as PyTorch's autograd does. [`Tensor::try_clone`] copies now.
#[derive(Clone)]
pub struct Tensor {
    buf: Arc<DeviceBuffer>,
    shape: Vec<usize>,
    dtype: DType,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({:?}, {:?}, cuda:{})", self.shape, self.dtype, self.device().ordinal())
    }
}

/// Number of elements of `shape`, or an error if it overflows.
pub(crate) fn numel(op: &'static str, shape: &[usize]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| Error::InvalidArgument {
        op,
        message: format!("shape {shape:?} has more elements than fit in usize"),
    })
}

impl Tensor {
    /// A tensor whose contents are unspecified (whatever the memory held).
    pub fn empty(dev: &Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Self::alloc("Tensor::empty", dev, shape, dtype)
    }

    pub(crate) fn alloc(op: &'static str, dev: &Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let n = numel(op, shape)?;
        let bytes = n.checked_mul(dtype.size()).ok_or_else(|| Error::InvalidArgument {
            op,
            message: format!("shape {shape:?} of {dtype:?} is too large"),
        })?;
        Ok(Tensor { buf: Arc::new(dev.alloc(op, bytes)?), shape: shape.to_vec(), dtype })
    }

    /// The tensor's memory, writable: a fresh tensor's own, or else (shared with a clone) a copy
    /// made first, stream-ordered after every earlier write.
    fn buf_mut(&mut self, op: &'static str) -> Result<&mut DeviceBuffer> {
        if Arc::get_mut(&mut self.buf).is_none() {
            let mut own = self.device().alloc(op, self.buf.bytes())?;
            self.buf.copy_to(&mut own)?;
            self.buf = Arc::new(own);
        }
        // Unique now: no clone shared it, or the copy is a fresh `Arc` that `&mut self` keeps to
        // itself. The error is unreachable, and no reason to panic.
        Arc::get_mut(&mut self.buf).ok_or(Error::InvalidArgument {
            op,
            message: "internal: the tensor's memory is still shared after its copy".into(),
        })
    }

    /// Whether `self` and `other` share device memory (one is a clone of the other, and neither
    /// has been written since).
    pub fn shares_memory(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }

    /// A tensor over `buf`, which holds exactly `shape`'s elements of `dtype` (the interop's
    /// borrowed tensors).
    pub(crate) fn from_buffer(buf: DeviceBuffer, shape: Vec<usize>, dtype: DType) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>() * dtype.size(), buf.bytes());
        Tensor { buf: Arc::new(buf), shape, dtype }
    }

    /// An uninitialised tensor of the same shape, dtype and device as `self`.
    pub(crate) fn alloc_like(&self, op: &'static str) -> Result<Tensor> {
        Self::alloc(op, self.device(), &self.shape, self.dtype)
    }

    /// Copies `data` (row-major, `shape`'s element count) to the device.
    pub fn from_slice<T: Element>(dev: &Device, data: &[T], shape: &[usize]) -> Result<Tensor> {
        let op = "Tensor::from_slice";
        let n = numel(op, shape)?;
        if n != data.len() {
            return Err(Error::InvalidArgument {
                op,
                message: format!("shape {shape:?} holds {n} elements but the slice has {}", data.len()),
            });
        }
        let mut t = Self::alloc(op, dev, shape, T::DTYPE)?;
        t.buf_mut(op)?.copy_from_host(data)?;
        Ok(t)
    }

    /// Copies `data` (f32 values) to the device, rounding to `dtype` on the host.
    pub fn from_f32(dev: &Device, data: &[f32], shape: &[usize], dtype: DType) -> Result<Tensor> {
        match dtype {
            DType::F32 => Self::from_slice(dev, data, shape),
            DType::F16 => Self::from_slice(dev, &data.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), shape),
            DType::BF16 => Self::from_slice(dev, &data.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), shape),
        }
    }

    /// All zeros (a memset; +0.0 in every dtype).
    pub fn zeros(dev: &Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let op = "Tensor::zeros";
        let mut t = Self::alloc(op, dev, shape, dtype)?;
        t.buf_mut(op)?.memset(0)?;
        Ok(t)
    }

    /// Every element `value`, rounded to `dtype`.
    pub fn full(dev: &Device, shape: &[usize], dtype: DType, value: f32) -> Result<Tensor> {
        let mut t = Self::alloc("Tensor::full", dev, shape, dtype)?;
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
        let mut t = Self::alloc(op, dev, shape, dtype)?;
        crate::ops::init::random(&mut t, crate::ops::init::Distribution::Uniform, seed, lo, hi)?;
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
        let mut t = Self::alloc(op, dev, shape, dtype)?;
        crate::ops::init::random(&mut t, crate::ops::init::Distribution::Normal, seed, mean, std)?;
        Ok(t)
    }

    /// Sets every element to `value` (rounded to the dtype).
    pub fn fill_(&mut self, value: f32) -> Result<()> {
        crate::ops::init::fill(self, value)
    }

    /// Copies the tensor back; `T` must match the dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch { op: "Tensor::to_vec", expected: self.dtype, got: T::DTYPE });
        }
        let mut v = vec![T::from_f32(0.0); self.numel()];
        self.buf.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// Copies the tensor back, widening f16/bf16 to f32 (exact).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        match self.dtype {
            DType::F32 => self.to_vec::<f32>(),
            DType::F16 => Ok(self.to_vec::<f16>()?.into_iter().map(f16::to_f32).collect()),
            DType::BF16 => Ok(self.to_vec::<bf16>()?.into_iter().map(bf16::to_f32).collect()),
        }
    }

    /// A copy in new device memory, made now (`clone` shares the memory instead).
    pub fn try_clone(&self) -> Result<Tensor> {
        let op = "Tensor::try_clone";
        let mut t = self.alloc_like(op)?;
        self.buf.copy_to(t.buf_mut(op)?)?;
        Ok(t)
    }

    /// The same data with another shape of the same element count (no copy).
    pub fn reshape(self, shape: &[usize]) -> Result<Tensor> {
        let n = numel("Tensor::reshape", shape)?;
        if n != self.numel() {
            return Err(Error::ShapeMismatch {
                op: "Tensor::reshape",
                expected: self.shape.clone(),
                got: shape.to_vec(),
                detail: "element counts differ",
            });
        }
        Ok(Tensor { shape: shape.to_vec(), ..self })
    }

    /// The dimensions, outermost first (row-major, contiguous).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The element type in device memory.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The GPU that holds the data.
    pub fn device(&self) -> &Device {
        self.buf.device()
    }
    /// The number of elements (1 for shape `[]`, 0 if a dimension is 0).
    pub fn numel(&self) -> usize {
        self.buf.bytes() / self.dtype.size()
    }
    /// Size in bytes.
    pub fn size_bytes(&self) -> usize {
        self.buf.bytes()
    }
    /// The last dimension (1 for a scalar tensor of shape `[]`).
    pub fn last_dim(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Device address of the first element, for handing the tensor to another CUDA library (the
    /// GEMM bench gives it to cuBLAS). Reading or writing through it is the caller's
    /// responsibility: the tensor must outlive that use, which must be ordered on
    /// [`Device::cu_stream`], and a write through it is seen by every clone sharing the memory
    /// (see [`Tensor::shares_memory`]).
    pub fn device_ptr(&self) -> u64 {
        self.buf.ptr()
    }
    /// Device address of the first element, typed for a kernel parameter.
    pub(crate) fn dev_ptr<T>(&self) -> *const T {
        self.buf.ptr() as *const T
    }
    /// Device address of the first element, as a number (for offsets into the buffer).
    pub(crate) fn dev_ptr_u64(&self) -> u64 {
        self.buf.ptr()
    }
    /// Device address of the first element, for a parameter the kernel writes. Taking `&mut self`
    /// makes the borrow checker see the write, and the memory is this tensor's alone (copied
    /// first if a clone shared it), so the address aliases no other tensor's.
    pub(crate) fn dev_ptr_mut<T>(&mut self) -> Result<*mut T> {
        Ok(self.buf_mut("Tensor write")?.ptr() as *mut T)
    }
}

/// A contiguous tensor of `i64` indices on a GPU: class targets of a cross-entropy, results of
/// an argmax (PyTorch's `int64` index tensors). Kept apart from [`Tensor`], whose dtypes are
/// the floating-point ones every op computes on, so an op cannot be handed indices by mistake.
pub struct IndexTensor {
    buf: DeviceBuffer,
    shape: Vec<usize>,
}

impl std::fmt::Debug for IndexTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IndexTensor({:?}, cuda:{})", self.shape, self.device().ordinal())
    }
}

impl IndexTensor {
    /// Copies `data` (row-major, `shape`'s element count) to the device.
    pub fn from_slice(dev: &Device, data: &[i64], shape: &[usize]) -> Result<IndexTensor> {
        let op = "IndexTensor::from_slice";
        let n = numel(op, shape)?;
        if n != data.len() {
            return Err(Error::InvalidArgument {
                op,
                message: format!("shape {shape:?} holds {n} elements but the slice has {}", data.len()),
            });
        }
        let mut t = Self::alloc(op, dev, shape)?;
        t.buf.copy_from_host(data)?;
        Ok(t)
    }

    /// All zeros.
    pub fn zeros(dev: &Device, shape: &[usize]) -> Result<IndexTensor> {
        let mut t = Self::alloc("IndexTensor::zeros", dev, shape)?;
        t.buf.memset(0)?;
        Ok(t)
    }

    /// Indices over `buf`, which holds exactly `shape`'s element count of i64.
    pub(crate) fn from_buffer(buf: DeviceBuffer, shape: Vec<usize>) -> IndexTensor {
        debug_assert_eq!(shape.iter().product::<usize>() * 8, buf.bytes());
        IndexTensor { buf, shape }
    }

    /// Uninitialised indices (written by the op that allocates them).
    pub(crate) fn alloc(op: &'static str, dev: &Device, shape: &[usize]) -> Result<IndexTensor> {
        let n = numel(op, shape)?;
        let bytes = n
            .checked_mul(8)
            .ok_or_else(|| Error::InvalidArgument { op, message: format!("shape {shape:?} of i64 is too large") })?;
        Ok(IndexTensor { buf: dev.alloc(op, bytes)?, shape: shape.to_vec() })
    }

    /// Copies the indices back.
    pub fn to_vec(&self) -> Result<Vec<i64>> {
        let mut v = vec![0i64; self.numel()];
        self.buf.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// The dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The GPU that holds the indices.
    pub fn device(&self) -> &Device {
        self.buf.device()
    }
    /// The number of indices.
    pub fn numel(&self) -> usize {
        self.buf.bytes() / 8
    }

    pub(crate) fn dev_ptr(&self) -> *const i64 {
        self.buf.ptr() as *const i64
    }
    pub(crate) fn dev_ptr_mut(&mut self) -> *mut i64 {
        self.buf.ptr() as *mut i64
    }
}
