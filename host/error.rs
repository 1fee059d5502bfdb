//! The library's one error type. Every variant says which operation failed and, where shapes or
//! dtypes are involved, which ones, so a message is enough to find the bad call.

use crate::DType;
use std::fmt;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// The NVIDIA driver library (`libcuda.so.1`) could not be loaded or initialised.
    NoDriver { detail: String },
    /// The requested GPU does not exist.
    NoDevice { ordinal: usize, available: usize },
    /// Device memory ran out.
    OutOfMemory { op: &'static str, bytes: usize },
    /// Two tensors (or a tensor and what the op expects) have incompatible shapes.
    ShapeMismatch { op: &'static str, expected: Vec<usize>, got: Vec<usize>, detail: &'static str },
    /// Two tensors that must share a dtype do not.
    DTypeMismatch { op: &'static str, expected: DType, got: DType },
    /// Tensors on different devices were combined.
    DeviceMismatch { op: &'static str, expected: usize, got: usize },
    /// An argument out of its domain (a length that does not match the shape, a bad parameter).
    InvalidArgument { op: &'static str, message: String },
    /// The embedded PTX has no kernel of this name (the host and device builds disagree).
    KernelNotFound { name: String },
    /// A launch was refused, or a kernel faulted while running.
    Kernel { kernel: String, message: String },
    /// Any other CUDA driver error.
    Driver { op: &'static str, message: String },
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
            Error::OutOfMemory { op, bytes } => {
                write!(f, "{op}: out of device memory allocating {bytes} bytes")
            }
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
            Error::Driver { op, message } => write!(f, "{op}: CUDA driver error: {message}"),
        }
    }
}

impl std::error::Error for Error {}

/// Turns a driver error into an [`Error`] for `op`.
pub(crate) fn driver(op: &'static str, e: cudarc::driver::DriverError) -> Error {
    use cudarc::driver::sys::CUresult;
    let message = match e.error_string() {
        Ok(s) => format!("{:?}: {}", e.0, s.to_string_lossy()),
        Err(_) => format!("{:?}", e.0),
    };
    match e.0 {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory { op, bytes: 0 },
        _ => Error::Driver { op, message },
    }
}
