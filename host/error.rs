//! The library's one error type. Every variant says which operation failed and, where shapes or
//! dtypes are involved, which ones, so a message is enough to find the bad call.

use crate::DType;
use std::fmt;

/// The library's result: [`Error`] unless said otherwise.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, and in which call. `op` is the public function or method that failed (e.g.
/// `"softmax"`, `"Tensor::from_slice"`); its `Display` is one line that names it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// The NVIDIA driver library (`libcuda.so.1`) could not be loaded or initialised.
    NoDriver {
        /// What the loader or `cuInit` said.
        detail: String,
    },
    /// The requested GPU does not exist.
    NoDevice {
        /// The index asked for.
        ordinal: usize,
        /// How many GPUs the driver sees.
        available: usize,
    },
    /// Device memory ran out. The device stays usable: free tensors (or ask for less) and go on.
    /// Where the driver ran out outside an allocation (a launch, another library), every size
    /// is 0: unknown.
    OutOfMemory {
        /// The call that ran out.
        op: &'static str,
        /// The allocation's size in bytes.
        bytes: usize,
        /// Bytes held by this device's live tensors then ([`crate::MemoryStats::allocated_bytes`]).
        allocated: usize,
        /// Bytes in the allocator's cache then ([`crate::MemoryStats::cached_bytes`]); the cache
        /// was emptied before the last try, so this is what could not be given back.
        cached: usize,
        /// Free device memory as the driver saw it after the failure (all processes count).
        device_free: usize,
        /// The device's memory.
        device_total: usize,
    },
    /// Two tensors (or a tensor and what the op expects) have incompatible shapes.
    ShapeMismatch {
        /// The call.
        op: &'static str,
        /// The shape that would fit.
        expected: Vec<usize>,
        /// The shape given.
        got: Vec<usize>,
        /// Which operand, and the rule it breaks.
        detail: &'static str,
    },
    /// Two tensors that must share a dtype do not.
    DTypeMismatch {
        /// The call.
        op: &'static str,
        /// The dtype that would fit (usually the first input's).
        expected: DType,
        /// The dtype given.
        got: DType,
    },
    /// Tensors on different devices were combined.
    DeviceMismatch {
        /// The call.
        op: &'static str,
        /// The first input's device ordinal.
        expected: usize,
        /// The other tensor's.
        got: usize,
    },
    /// An argument out of its domain (a length that does not match the shape, a bad parameter).
    InvalidArgument {
        /// The call.
        op: &'static str,
        /// What was wrong, with the values.
        message: String,
    },
    /// The embedded PTX has no kernel of this name (the host and device builds disagree).
    KernelNotFound {
        /// The kernel's name.
        name: String,
    },
    /// A launch was refused, or a kernel faulted while running.
    Kernel {
        /// The kernel's name.
        kernel: String,
        /// The driver's error.
        message: String,
    },
    /// NCCL (`libnccl.so.2`) could not be loaded, for the collectives of [`crate::dist`].
    NoNccl {
        /// What was tried, and how to point the library at an NCCL.
        detail: String,
    },
    /// NCCL refused or failed a call of [`crate::dist`].
    Collective {
        /// The call.
        op: &'static str,
        /// NCCL's error and its last message.
        message: String,
    },
    /// Any other CUDA driver error.
    Driver {
        /// The call.
        op: &'static str,
        /// The driver's error.
        message: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoDriver { detail } => write!(
                f,
                "no CUDA driver: {detail} (an NVIDIA GPU and its driver are needed to run kernels; \
                 building needs neither)"
            ),
            Error::NoDevice { ordinal, available } => {
                write!(f, "no CUDA device {ordinal}: {available} device(s) present")
            }
            Error::OutOfMemory { op, bytes: 0, .. } => write!(f, "{op}: out of device memory"),
            Error::OutOfMemory { op, bytes, allocated, cached, device_free, device_total } => write!(
                f,
                "{op}: out of device memory allocating {} ({bytes} bytes); tensors hold {}, the \
                 cache {}; the device has {} free of {}",
                Mib(*bytes),
                Mib(*allocated),
                Mib(*cached),
                Mib(*device_free),
                Mib(*device_total)
            ),
            Error::ShapeMismatch { op, expected, got, detail } => {
                write!(f, "{op}: shape mismatch, expected {expected:?}, got {got:?} ({detail})")
            }
            Error::DTypeMismatch { op, expected, got } => {
                write!(f, "{op}: dtype mismatch, expected {expected:?}, got {got:?}")
            }
            Error::DeviceMismatch { op, expected, got } => {
                write!(f, "{op}: tensors on different devices (cuda:{expected} and cuda:{got})")
            }
            Error::InvalidArgument { op, message } => write!(f, "{op}: {message}"),
            Error::KernelNotFound { name } => write!(
                f,
                "kernel `{name}` is not in the embedded PTX (the host and device builds disagree; \
                 rebuild)"
            ),
            Error::Kernel { kernel, message } => write!(f, "kernel `{kernel}` failed: {message}"),
            Error::NoNccl { detail } => write!(f, "no NCCL: {detail}"),
            Error::Collective { op, message } => write!(f, "{op}: {message}"),
            Error::Driver { op, message } => write!(f, "{op}: CUDA driver error: {message}"),
        }
    }
}

impl std::error::Error for Error {}

/// Bytes shown in MiB with two decimals, the unit of `nvidia-smi` and PyTorch's messages.
struct Mib(usize);
impl fmt::Display for Mib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.2} MiB", self.0 as f64 / (1u64 << 20) as f64)
    }
}

/// Turns a driver error into an [`Error`] for `op`.
pub(crate) fn driver(op: &'static str, e: cudarc::driver::DriverError) -> Error {
    use cudarc::driver::sys::CUresult;
    let message = match e.error_string() {
        Ok(s) => format!("{:?}: {}", e.0, s.to_string_lossy()),
        Err(_) => format!("{:?}", e.0),
    };
    match e.0 {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            Error::OutOfMemory { op, bytes: 0, allocated: 0, cached: 0, device_free: 0, device_total: 0 }
        }
        _ => Error::Driver { op, message },
    }
}
