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
