//! `Tensor`: a contiguous, row-major array in device memory with a shape and a dtype.

use crate::DType;
use crate::device::{Device, DeviceBuffer};
use crate::error::{Error, Result};
use half::{bf16, f16};
use std::fmt;
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

/// How many leading values [`Tensor`]'s `Display` reads back and shows.
const DISPLAY_VALUES: usize = 6;

impl fmt::Display for Tensor {
    /// `Tensor[4096, 1024] bf16 cuda:0 [0.1235, -1.5, 0, 3.25, inf, NaN, ...]`: the shape, dtype,
    /// device and the first few values, each with the fewest digits that identify it in its dtype.
    /// Reads back only those values, after the work queued on the device; if that fails, the
    /// error's text stands in for the values.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor{:?} {} cuda:{} ", self.shape, self.dtype.suffix(), self.device().ordinal())?;
        match self.leading_f32(DISPLAY_VALUES) {
            Ok(v) => f.write_str(&format_values(&v, self.dtype, self.numel())),
            Err(e) => write!(f, "<{e}>"),
        }
    }
}

/// `[a, b, c, ...]`: `values` (the first of `total`, as f32) in `dtype`'s shortest form, and `...`
/// where more follow.
fn format_values(values: &[f32], dtype: DType, total: usize) -> String {
    let mut items: Vec<String> = values.iter().map(|&x| format_value(x, dtype)).collect();
    if total > values.len() {
        items.push("...".into());
    }
    format!("[{}]", items.join(", "))
}

/// `x` (a value of `dtype`, widened to f32) with the fewest significant digits that read back as
/// the same `dtype` value, in exponent form below 1e-4 and from 1e6 on in magnitude.
fn format_value(x: f32, dtype: DType) -> String {
    let same = |y: f32| match dtype {
        DType::F32 => y.to_bits() == x.to_bits(),
        DType::F16 => f16::from_f32(y).to_bits() == f16::from_f32(x).to_bits(),
        DType::BF16 => bf16::from_f32(y).to_bits() == bf16::from_f32(x).to_bits(),
    };
    // f32's own `Display` is already the shortest; f16 and bf16 need fewer digits than f32.
    let x = if dtype == DType::F32 || !x.is_finite() {
        x
    } else {
        (0..9).filter_map(|p| format!("{x:.p$e}").parse::<f32>().ok()).find(|&y| same(y)).unwrap_or(x)
    };
    if x.is_finite() && x != 0.0 && !(1e-4..1e6).contains(&x.abs()) { format!("{x:e}") } else { format!("{x}") }
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
    pub(crate) fn buf_mut(&mut self, op: &'static str) -> Result<&mut DeviceBuffer> {
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

    /// Copies the tensor back; `T` must match the dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch { op: "Tensor::to_vec", expected: self.dtype, got: T::DTYPE });
        }
        let mut v = vec![T::from_f32(0.0); self.numel()];
        self.buf.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// The tensor's bytes as the device holds them (little-endian elements), waiting for it.
    pub(crate) fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.buf.bytes()];
        self.buf.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// A tensor of `shape` and `dtype` from its bytes (little-endian elements, exactly the
    /// size the shape needs).
    pub(crate) fn from_bytes(
        op: &'static str,
        dev: &Device,
        bytes: &[u8],
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let mut t = Self::alloc(op, dev, shape, dtype)?;
        if bytes.len() != t.buf.bytes() {
            return Err(Error::InvalidArgument {
                op,
                message: format!("{} bytes for {shape:?} {dtype:?}, which needs {}", bytes.len(), t.buf.bytes()),
            });
        }
        t.buf_mut(op)?.copy_from_host(bytes)?;
        Ok(t)
    }

    /// Copies the tensor back, widening f16/bf16 to f32 (exact).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        match self.dtype {
            DType::F32 => self.to_vec::<f32>(),
            DType::F16 => Ok(self.to_vec::<f16>()?.into_iter().map(f16::to_f32).collect()),
            DType::BF16 => Ok(self.to_vec::<bf16>()?.into_iter().map(bf16::to_f32).collect()),
        }
    }

    /// The first `k` elements (all of them if fewer), widened to f32; reads back only those.
    fn leading_f32(&self, k: usize) -> Result<Vec<f32>> {
        fn read<T: Element>(t: &Tensor, k: usize) -> Result<Vec<f32>> {
            let mut v = vec![T::from_f32(0.0); k];
            // SAFETY: the first `k <= numel` elements of the tensor's memory, which `t`, borrowed
            // until the read is done, keeps alive; dropping a borrowed buffer leaves it alone.
            let prefix = unsafe { DeviceBuffer::borrowed(t.device(), t.buf.ptr(), k * T::DTYPE.size()) };
            prefix.copy_to_host(&mut v)?;
            Ok(v.into_iter().map(T::to_f32).collect())
        }
        let k = k.min(self.numel());
        match self.dtype {
            DType::F32 => read::<f32>(self, k),
            DType::F16 => read::<f16>(self, k),
            DType::BF16 => read::<bf16>(self, k),
        }
    }

    /// The value of a tensor of one element (of any shape: `[]`, `[1]`, `[1, 1]`...), as
    /// PyTorch's `.item()`; `T` must match the dtype. An error for any other element count.
    pub fn to_scalar<T: Element>(&self) -> Result<T> {
        let op = "Tensor::to_scalar";
        if self.numel() != 1 {
            return Err(Error::InvalidArgument {
                op,
                message: format!("needs a tensor of one element, got shape {:?}", self.shape),
            });
        }
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch { op, expected: self.dtype, got: T::DTYPE });
        }
        let v = self.to_vec::<T>()?;
        v.first().copied().ok_or_else(|| Error::InvalidArgument { op, message: "internal: no value read".into() })
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
    /// The tensor's memory, shared (to keep it alive while a collective of an NCCL group may
    /// still use it).
    pub(crate) fn buffer(&self) -> Arc<DeviceBuffer> {
        self.buf.clone()
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
///
/// `clone` is cheap: the clones share the device memory. Indices are written only by what
/// creates them, before they are handed out, or by an `_out` op into a tensor that no clone
/// shares, so no clone ever sees another change.
#[derive(Clone)]
pub struct IndexTensor {
    buf: Arc<DeviceBuffer>,
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
        t.fresh_buf(op)?.copy_from_host(data)?;
        Ok(t)
    }

    /// All zeros.
    pub fn zeros(dev: &Device, shape: &[usize]) -> Result<IndexTensor> {
        let op = "IndexTensor::zeros";
        let mut t = Self::alloc(op, dev, shape)?;
        t.fresh_buf(op)?.memset(0)?;
        Ok(t)
    }

    /// The memory of a tensor just allocated, which no clone shares yet (the error is
    /// unreachable, and no reason to panic).
    fn fresh_buf(&mut self, op: &'static str) -> Result<&mut DeviceBuffer> {
        Arc::get_mut(&mut self.buf)
            .ok_or(Error::InvalidArgument { op, message: "internal: a new index tensor's memory is shared".into() })
    }

    /// Indices over `buf`, which holds exactly `shape`'s element count of i64.
    pub(crate) fn from_buffer(buf: DeviceBuffer, shape: Vec<usize>) -> IndexTensor {
        debug_assert_eq!(shape.iter().product::<usize>() * 8, buf.bytes());
        IndexTensor { buf: Arc::new(buf), shape }
    }

    /// Uninitialised indices (written by the op that allocates them).
    pub(crate) fn alloc(op: &'static str, dev: &Device, shape: &[usize]) -> Result<IndexTensor> {
        let n = numel(op, shape)?;
        let bytes = n
            .checked_mul(8)
            .ok_or_else(|| Error::InvalidArgument { op, message: format!("shape {shape:?} of i64 is too large") })?;
        Ok(IndexTensor { buf: Arc::new(dev.alloc(op, bytes)?), shape: shape.to_vec() })
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
    /// For the op that allocated the tensor to write it, before handing it out: no clone shares
    /// the memory yet (see the type's `clone`).
    pub(crate) fn dev_ptr_mut(&mut self) -> *mut i64 {
        self.buf.ptr() as *mut i64
    }

    /// For an `_out` op to write indices it was handed: refused while a clone shares them.
    pub(crate) fn dev_ptr_mut_unshared(&mut self, op: &'static str) -> Result<*mut i64> {
        match Arc::get_mut(&mut self.buf) {
            Some(buf) => Ok(buf.ptr() as *mut i64),
            None => Err(Error::InvalidArgument {
                op,
                message: "the index tensor's memory is shared with a clone, which would see the write".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_values_are_short_and_exact() {
        let f = |x: f32, dt| format_value(x, dt);
        // bf16's 0.1234 is 0.12353515625: four digits identify it.
        assert_eq!(f(bf16::from_f32(0.1234).to_f32(), DType::BF16), "0.1235");
        assert_eq!(f(f16::from_f32(0.1234).to_f32(), DType::F16), "0.1234");
        assert_eq!(f(0.1234, DType::F32), "0.1234");
        assert_eq!(f(-1.5, DType::BF16), "-1.5");
        assert_eq!(f(0.0, DType::F16), "0");
        assert_eq!(f(-0.0, DType::F32), "-0");
        assert_eq!(f(f32::INFINITY, DType::F16), "inf");
        assert_eq!(f(f32::NEG_INFINITY, DType::BF16), "-inf");
        assert_eq!(f(f32::NAN, DType::F32), "NaN");
        assert_eq!(f(65504.0, DType::F16), "65500"); // f16's largest: no other f16 is nearer 65500
        assert_eq!(f(1e6, DType::F32), "1e6");
        assert_eq!(f(f16::from_bits(1).to_f32(), DType::F16), "6e-8"); // the smallest denormal
        assert_eq!(f(f32::MAX, DType::F32), "3.4028235e38");
        assert_eq!(f(1e-4, DType::F32), "0.0001");
        // Every f16 and bf16 value reads back as itself.
        for bits in 0..=u16::MAX {
            let (h, b) = (f16::from_bits(bits), bf16::from_bits(bits));
            let (sh, sb) = (f(h.to_f32(), DType::F16), f(b.to_f32(), DType::BF16));
            let (rh, rb) = (f16::from_f32(sh.parse().unwrap()), bf16::from_f32(sb.parse().unwrap()));
            assert!(rh.to_bits() == bits || h.is_nan() && rh.is_nan(), "f16 {bits:#06x}: {sh}");
            assert!(rb.to_bits() == bits || b.is_nan() && rb.is_nan(), "bf16 {bits:#06x}: {sb}");
        }
    }

    #[test]
    fn display_lists_the_leading_values() {
        assert_eq!(format_values(&[], DType::F32, 0), "[]");
        assert_eq!(format_values(&[1.0, -2.5], DType::F32, 2), "[1, -2.5]");
        assert_eq!(format_values(&[1.0, -2.5], DType::BF16, 4096), "[1, -2.5, ...]");
    }
}
