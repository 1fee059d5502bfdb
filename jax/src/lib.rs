//! `kernels_jax._jax_native`: the `kernels` library's ops as XLA FFI handlers, for JAX's custom calls.
//!
//! The handlers are plain `extern "C"` functions against the XLA FFI's C ABI ([`ffi`], no C++),
//! one per target of the table in [`ops`]. This module hands them to Python as capsules, which the
//! Python layer registers with `jax.ffi.register_ffi_target(..., platform="CUDA")`; JAX then calls
//! them from its compiled programs with XLA's device buffers and stream.

mod ffi;
mod ops;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::atomic::Ordering;

/// Each target's name (`kernels_<op>`, XLA's registry is process-wide) and its handler as a
/// capsule holding the function's address (what `jax.ffi.pycapsule` makes of a ctypes function).
#[pyfunction]
fn targets(py: Python<'_>) -> PyResult<Vec<(String, Py<PyAny>)>> {
    ops::TARGETS
        .iter()
        .map(|&(name, f)| {
            // SAFETY: a nameless capsule without destructor over a function's address, which
            // lives as long as the module (it is never unloaded).
            let cap = unsafe {
                let p = pyo3::ffi::PyCapsule_New(f as *mut std::ffi::c_void, std::ptr::null(), None);
                Bound::from_owned_ptr_or_err(py, p)?
            };
            Ok((format!("kernels_{name}"), cap.unbind()))
        })
        .collect()
}

/// The XLA FFI API version the handlers report when XLA registers them, as `(major, minor)`:
/// XLA before FFI API 0.2 accepts only its own version and passes no API table with the query,
/// so the Python layer sets the one in the header of the installed jaxlib before registering.
#[pyfunction]
fn set_api_version(major: i32, minor: i32) -> PyResult<()> {
    if major != 0 || minor < 1 {
        return Err(PyValueError::new_err(format!(
            "XLA FFI API {major}.{minor}: the handlers are written against API 0.x, x >= 1"
        )));
    }
    ffi::REPORT_MAJOR.store(major, Ordering::Relaxed);
    ffi::REPORT_MINOR.store(minor, Ordering::Relaxed);
    Ok(())
}

/// The version `set_api_version` set (0.1 by default).
#[pyfunction]
fn api_version() -> (i32, i32) {
    (ffi::REPORT_MAJOR.load(Ordering::Relaxed), ffi::REPORT_MINOR.load(Ordering::Relaxed))
}

/// The unary op table as Python data, in the order of the codes the `kernels_unary_*` targets
/// take: one tuple a row, `(name, activation, ((param, default), ...), positive, doc)`.
type UnaryRow = (&'static str, bool, Vec<(&'static str, f32)>, bool, &'static str);

fn unary_rows() -> Vec<UnaryRow> {
    kernels::ops::UNARY_OPS.iter().map(|i| (i.name, i.activation, i.params.to_vec(), i.positive, i.doc)).collect()
}

/// Whether the library can run kernels here, and if not why: `(True, "<GPU name>")` or
/// `(False, "<reason>")`.
#[pyfunction]
fn cuda_status(py: Python<'_>) -> (bool, String) {
    py.detach(|| {
        match kernels::device_count().and_then(|n| if n == 0 { Ok(None) } else { kernels::Device::cuda(0).map(Some) }) {
            Err(e) => (false, e.to_string()),
            Ok(None) => (false, "no CUDA device: the driver reports 0 devices".to_string()),
            Ok(Some(d)) => (true, d.name().to_string()),
        }
    })
}

#[pymodule]
fn _jax_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("UNARY_OPS", unary_rows())?;
    m.add("ALIGNMENT", kernels::interop::ALIGNMENT)?;
    m.add_function(wrap_pyfunction!(targets, m)?)?;
    m.add_function(wrap_pyfunction!(set_api_version, m)?)?;
    m.add_function(wrap_pyfunction!(api_version, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    Ok(())
}
