//! Timing events on a device's stream.

use super::*;
use crate::error::{Result, driver};
use cudarc::driver::{result, sys};

impl Device {
    /// Records a timing event on this device's stream (inside [`Device::with_stream`]: on that
    /// stream).
    pub fn record_event(&self) -> Result<Event> {
        self.bind()?;
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| driver("record_event", e))?;
        let event = Event { ev, dev: self.clone() };
        // SAFETY: event and stream belong to the bound context.
        unsafe { result::event::record(event.ev, self.stream()) }.map_err(|e| driver("record_event", e))?;
        Ok(event)
    }
}

/// A CUDA event recorded on a device's stream, for timing with [`Event::elapsed_ms`].
pub struct Event {
    ev: sys::CUevent,
    dev: Device,
}

impl Event {
    /// Milliseconds of GPU time between `self` and the later event `end`; waits for `end`.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        self.dev.bind()?;
        // SAFETY: both events were recorded on this device's stream and are alive.
        unsafe {
            result::event::synchronize(end.ev).map_err(|e| self.dev.kernel_fault(e))?;
            result::event::elapsed(self.ev, end.ev).map_err(|e| driver("elapsed_ms", e))
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: the event is not used after this.
            let _ = unsafe { result::event::destroy(self.ev) };
        }
    }
}

/// A second stream of a device, for work that overlaps the device's own (collectives while a
/// backward pass runs), ordered with it by events only: [`SideStream::wait_for_device`] before
/// enqueueing, [`Mark::device_waits`] before the device's stream uses the results.
pub(crate) struct SideStream {
    dev: Device,
    stream: sys::CUstream,
}

// SAFETY: a driver stream may be used from any thread once its context is current, which every
// method makes it first.
unsafe impl Send for SideStream {}
unsafe impl Sync for SideStream {}

impl SideStream {
    /// A new non-blocking stream in the device's context.
    pub(crate) fn new(dev: &Device) -> Result<SideStream> {
        dev.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| driver("SideStream::new", e))?;
        Ok(SideStream { dev: dev.clone(), stream })
    }

    /// The stream, for a foreign library's calls (NCCL's).
    pub(crate) fn raw(&self) -> *mut std::ffi::c_void {
        self.stream as *mut std::ffi::c_void
    }

    /// Work enqueued on this stream from now on starts after everything issued so far on the
    /// device's stream (this thread's: the foreign one inside [`Device::with_stream`]).
    pub(crate) fn wait_for_device(&self) -> Result<()> {
        self.dev.bind()?;
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver("SideStream::wait_for_device", e))?;
        // SAFETY: event and both streams belong to the bound context; destroying an event that a
        // stream still waits on is allowed (the driver releases it once the wait is done).
        let r = unsafe {
            result::event::record(ev, self.dev.stream()).and_then(|()| {
                result::stream::wait_event(self.stream, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
            })
        };
        // SAFETY: as above.
        let _ = unsafe { result::event::destroy(ev) };
        r.map_err(|e| driver("SideStream::wait_for_device", e))
    }

    /// The point this stream has reached (what is enqueued on it so far).
    pub(crate) fn mark(&self) -> Result<Mark> {
        self.dev.bind()?;
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver("SideStream::mark", e))?;
        let mark = Mark { ev, dev: self.dev.clone() };
        // SAFETY: event and stream belong to the bound context.
        unsafe { result::event::record(mark.ev, self.stream) }.map_err(|e| driver("SideStream::mark", e))?;
        Ok(mark)
    }

    /// Blocks the host until this stream's work is done.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: the stream belongs to the bound context.
        unsafe { result::stream::synchronize(self.stream) }.map_err(|e| self.dev.kernel_fault(e))
    }
}

impl Drop for SideStream {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: nothing is enqueued on the stream after this; its work finishes first.
            unsafe {
                let _ = result::stream::synchronize(self.stream);
                let _ = result::stream::destroy(self.stream);
            }
        }
    }
}

/// A point of a [`SideStream`] (see [`SideStream::mark`]).
pub(crate) struct Mark {
    ev: sys::CUevent,
    dev: Device,
}

// SAFETY: as `SideStream`'s.
unsafe impl Send for Mark {}
unsafe impl Sync for Mark {}

impl Mark {
    /// Work issued on the device's stream (this thread's) from now on starts after the mark;
    /// the host does not wait.
    pub(crate) fn device_waits(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: event and stream belong to the bound context.
        unsafe {
            result::stream::wait_event(self.dev.stream(), self.ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        }
        .map_err(|e| driver("Mark::device_waits", e))
    }

    /// Blocks the host until the side stream has passed the mark.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: recorded in the bound context.
        unsafe { result::event::synchronize(self.ev) }.map_err(|e| self.dev.kernel_fault(e))
    }

    /// Whether the side stream has passed the mark.
    pub(crate) fn is_done(&self) -> bool {
        // SAFETY: recorded in the device's context; the query needs no current context.
        self.dev.bind().is_ok() && unsafe { result::event::query(self.ev) }.is_ok()
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: not used after this; a pending wait on it stays valid (see above).
            let _ = unsafe { result::event::destroy(self.ev) };
        }
    }
}
