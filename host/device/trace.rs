//! The opt-in timeline recorder: every kernel launched on a device between
//! [`Device::start_trace`] and [`Device::stop_trace`], timed on the GPU by a pair of CUDA events
//! around it, with the allocator's state when it was issued; and the spans the caller (or an op)
//! names with [`Device::trace_scope`], with the bytes and FLOPs it declares. The result, a
//! [`Trace`], writes itself as Chrome trace JSON, which Perfetto (ui.perfetto.dev) and
//! `chrome://tracing` open.
//!
//! Costs only while recording: two events a launch (created, recorded, and destroyed at
//! `stop_trace`), and one relaxed atomic load a launch when not.

use super::*;
use crate::error::{Error, Result, driver};
use cudarc::driver::{result, sys};
use std::fmt::Write as _;
use std::sync::atomic::Ordering;

/// Launches a recording keeps at most; later ones run untimed and are counted in
/// [`Trace::dropped`] (each one holds two driver events until [`Device::stop_trace`]).
pub const MAX_TRACED_LAUNCHES: usize = 1 << 20;

/// What a traced span moves and computes, as its author declares it: the bytes read plus
/// written in device memory and the floating-point operations (a fused multiply-add counts two).
/// Zero where unknown; the trace then shows no rate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    /// Bytes read and written in device memory.
    pub bytes: u64,
    /// Floating-point operations.
    pub flops: u64,
}

/// One kernel of a [`Trace`]. Times in microseconds from the start of the recording.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct KernelSpan {
    /// The kernel's entry name.
    pub name: String,
    /// When it started and how long it ran, on the GPU.
    pub start_us: f64,
    /// Its duration.
    pub dur_us: f64,
    /// Its launch geometry.
    pub config: LaunchConfig,
    /// [`MemoryStats::allocated_bytes`] when it was issued.
    pub allocated_bytes: usize,
    /// [`MemoryStats::reserved_bytes`] when it was issued.
    pub reserved_bytes: usize,
}

/// One named span of a [`Trace`] (see [`Device::trace_scope`]): from the point of the stream
/// where it was opened to the one where it was closed.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ScopeSpan {
    /// Its name.
    pub name: String,
    /// When the GPU reached its start, in microseconds from the start of the recording.
    pub start_us: f64,
    /// How long the GPU took from its start to its end.
    pub dur_us: f64,
    /// What its author declared it moves and computes.
    pub cost: Cost,
    /// [`MemoryStats::allocated_bytes`] when it was opened and when it was closed.
    pub allocated_bytes: (usize, usize),
}

/// A finished recording (see [`Device::stop_trace`]), in the order the work was issued.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Trace {
    /// The device, as `cuda:N name`.
    pub device: String,
    /// Every kernel recorded.
    pub kernels: Vec<KernelSpan>,
    /// Every span that was closed while recording.
    pub scopes: Vec<ScopeSpan>,
    /// Launches past [`MAX_TRACED_LAUNCHES`], not recorded.
    pub dropped: usize,
}

/// An event pair waiting for `stop_trace`, and what is known of it at issue time.
struct Pending {
    what: What,
    start: sys::CUevent,
    end: sys::CUevent,
}

enum What {
    Kernel { index: usize, config: LaunchConfig, allocated: usize, reserved: usize },
    Scope { name: String, cost: Cost, allocated: (usize, usize) },
}

/// The state of a device while it records.
pub(super) struct Recording {
    /// Tells a span opened in an earlier recording from one of this recording.
    id: u64,
    origin: sys::CUevent,
    pending: Vec<Pending>,
    launches: usize,
    dropped: usize,
}

/// The span opened by [`Device::trace_scope`]; closing it (dropping it) records its end on the
/// stream. Inert when the device was not recording at the opening.
#[must_use = "the span ends where this guard is dropped"]
pub struct TraceScope<'a> {
    open: Option<(&'a Device, u64, String, Cost, sys::CUevent, usize)>,
}

static RECORDINGS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Drop for TraceScope<'_> {
    fn drop(&mut self) {
        let Some((dev, id, name, cost, start, allocated)) = self.open.take() else { return };
        let end = dev.bind().ok().and_then(|()| dev.record_timing_event().ok());
        let after = dev.memory_stats().allocated_bytes;
        let mut rec = dev.trace_state();
        match (rec.as_mut().filter(|r| r.id == id), end) {
            (Some(rec), Some(end)) => rec.pending.push(Pending {
                what: What::Scope { name, cost, allocated: (allocated, after) },
                start,
                end,
            }),
            // Stopped meanwhile (or restarted), or the end could not be recorded: left out.
            (_, end) => {
                destroy_events(&[Some(start), end]);
            }
        }
    }
}

fn destroy_events(events: &[Option<sys::CUevent>]) {
    for ev in events.iter().flatten() {
        // SAFETY: each event was created by this module and is used by nothing after this.
        let _ = unsafe { result::event::destroy(*ev) };
    }
}

impl Device {
    fn trace_state(&self) -> std::sync::MutexGuard<'_, Option<Recording>> {
        self.0.trace.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new timing event recorded now on this thread's stream for the device; the context is
    /// bound.
    fn record_timing_event(&self) -> Result<sys::CUevent> {
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| driver("trace", e))?;
        // SAFETY: event and stream belong to the bound context.
        if let Err(e) = unsafe { result::event::record(ev, self.stream()) } {
            destroy_events(&[Some(ev)]);
            return Err(driver("trace", e));
        }
        Ok(ev)
    }

    /// Starts recording every kernel this process launches on this device, from any thread and
    /// on any stream ([`Device::with_stream`] included), until [`Device::stop_trace`]. An error
    /// if it is recording already.
    pub fn start_trace(&self) -> Result<()> {
        self.bind()?;
        let mut rec = self.trace_state();
        if rec.is_some() {
            return Err(Error::InvalidArgument {
                op: "start_trace",
                message: format!("cuda:{} is recording already", self.0.ordinal),
            });
        }
        let origin = self.record_timing_event()?;
        let id = RECORDINGS.fetch_add(1, Ordering::Relaxed);
        *rec = Some(Recording { id, origin, pending: Vec::new(), launches: 0, dropped: 0 });
        self.0.tracing.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether the device is recording (between [`Device::start_trace`] and
    /// [`Device::stop_trace`]).
    pub fn is_tracing(&self) -> bool {
        self.0.tracing.load(Ordering::Acquire)
    }

    /// Ends the recording: waits for the recorded work to finish and returns its timeline. An
    /// error if the device was not recording. Spans still open are left out.
    pub fn stop_trace(&self) -> Result<Trace> {
        self.bind()?;
        let Some(rec) = self.trace_state().take() else {
            return Err(Error::InvalidArgument {
                op: "stop_trace",
                message: format!("cuda:{} is not recording (start_trace first)", self.0.ordinal),
            });
        };
        self.0.tracing.store(false, Ordering::Release);
        let mut trace = Trace {
            device: format!("cuda:{} {}", self.0.ordinal, self.0.name),
            dropped: rec.dropped,
            ..Trace::default()
        };
        // SAFETY: recorded in this device's context, which is bound.
        let mut result = unsafe { result::event::synchronize(rec.origin) }.map_err(|e| self.kernel_fault(e));
        for p in &rec.pending {
            if result.is_err() {
                break;
            }
            result = self.span_times(rec.origin, p).map(|(start_us, dur_us)| match &p.what {
                &What::Kernel { index, config, allocated, reserved } => trace.kernels.push(KernelSpan {
                    name: self.0.kernels.get(index).map_or_else(String::new, |k| k.name.clone()),
                    start_us,
                    dur_us,
                    config,
                    allocated_bytes: allocated,
                    reserved_bytes: reserved,
                }),
                What::Scope { name, cost, allocated } => trace.scopes.push(ScopeSpan {
                    name: name.clone(),
                    start_us,
                    dur_us,
                    cost: *cost,
                    allocated_bytes: *allocated,
                }),
            });
        }
        let events = rec.pending.iter().flat_map(|p| [Some(p.start), Some(p.end)]);
        destroy_events(&events.chain([Some(rec.origin)]).collect::<Vec<_>>());
        result.map(|()| trace)
    }

    /// Start and duration of a recorded pair, in microseconds from `origin`; waits for its end.
    fn span_times(&self, origin: sys::CUevent, p: &Pending) -> Result<(f64, f64)> {
        // SAFETY: the three events were recorded in this device's context, which is bound.
        unsafe {
            result::event::synchronize(p.end).map_err(|e| self.kernel_fault(e))?;
            let start = result::event::elapsed(origin, p.start).map_err(|e| driver("stop_trace", e))?;
            let end = result::event::elapsed(origin, p.end).map_err(|e| driver("stop_trace", e))?;
            Ok((start as f64 * 1e3, (end - start).max(0.0) as f64 * 1e3))
        }
    }

    /// Opens a named span on this device's timeline, closed when the returned guard drops: what
    /// the stream runs in between (the kernels of an op, a layer, a training step) appears under
    /// it, with `cost` shown as bytes, FLOPs and the rates they imply. Spans nest. Free when the
    /// device is not recording; events that cannot be recorded leave the span out rather than
    /// fail the caller.
    pub fn trace_scope(&self, name: &str, cost: Cost) -> TraceScope<'_> {
        let id = match self.trace_state().as_ref() {
            Some(rec) if self.bind().is_ok() => rec.id,
            _ => return TraceScope { open: None },
        };
        match self.record_timing_event() {
            Ok(ev) => {
                TraceScope { open: Some((self, id, name.to_string(), cost, ev, self.memory_stats().allocated_bytes)) }
            }
            Err(_) => TraceScope { open: None },
        }
    }

    /// The start event of a launch about to be issued, if recording (and under the limit); the
    /// context is bound.
    pub(super) fn trace_launch_begin(&self) -> Option<sys::CUevent> {
        if !self.is_tracing() {
            return None;
        }
        let mut rec = self.trace_state();
        let rec = rec.as_mut()?;
        if rec.launches >= MAX_TRACED_LAUNCHES {
            rec.dropped += 1;
            return None;
        }
        rec.launches += 1;
        self.record_timing_event().ok()
    }

    /// Records the end of the launch begun by [`Device::trace_launch_begin`] (forgets it when
    /// the launch was refused).
    pub(super) fn trace_launch_end(&self, start: sys::CUevent, index: usize, config: LaunchConfig, launched: bool) {
        if !launched {
            return destroy_events(&[Some(start)]);
        }
        let stats = self.memory_stats();
        let end = self.record_timing_event().ok();
        let mut rec = self.trace_state();
        match (rec.as_mut(), end) {
            (Some(rec), Some(end)) => rec.pending.push(Pending {
                what: What::Kernel { index, config, allocated: stats.allocated_bytes, reserved: stats.reserved_bytes },
                start,
                end,
            }),
            (_, end) => destroy_events(&[Some(start), end]),
        }
    }
}

/// Writes `s` as a JSON string literal.
fn json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

const MIB: f64 = 1024.0 * 1024.0;

impl Trace {
    /// The timeline as Chrome trace JSON (the "JSON object" format of the Trace Event Format):
    /// spans and kernels as complete events on one track, so that a span stacks over its
    /// kernels; the allocator's state at each kernel as a counter track. Times in
    /// microseconds.
    pub fn to_chrome_json(&self) -> String {
        let mut out = String::from("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n");
        out.push_str("{\"ph\":\"M\",\"pid\":0,\"tid\":0,\"name\":\"process_name\",\"args\":{\"name\":");
        json_str(&mut out, &self.device);
        out.push_str("}}");
        for s in &self.scopes {
            out.push_str(",\n{\"ph\":\"X\",\"pid\":0,\"tid\":0,\"cat\":\"scope\",\"name\":");
            json_str(&mut out, &s.name);
            let _ = write!(
                out,
                ",\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"allocated MiB at start\":{:.3},\"allocated MiB at end\":{:.3}",
                s.start_us,
                s.dur_us,
                s.allocated_bytes.0 as f64 / MIB,
                s.allocated_bytes.1 as f64 / MIB
            );
            if s.cost.bytes > 0 {
                let _ = write!(out, ",\"bytes\":{}", s.cost.bytes);
                if s.dur_us > 0.0 {
                    let _ = write!(out, ",\"GB/s\":{:.1}", s.cost.bytes as f64 / (s.dur_us * 1e3));
                }
            }
            if s.cost.flops > 0 {
                let _ = write!(out, ",\"flops\":{}", s.cost.flops);
                if s.dur_us > 0.0 {
                    let _ = write!(out, ",\"TFLOP/s\":{:.2}", s.cost.flops as f64 / (s.dur_us * 1e6));
                }
            }
            out.push_str("}}");
        }
        for k in &self.kernels {
            out.push_str(",\n{\"ph\":\"X\",\"pid\":0,\"tid\":0,\"cat\":\"kernel\",\"name\":");
            json_str(&mut out, &k.name);
            let c = &k.config;
            let _ = write!(
                out,
                ",\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"grid\":[{},{},{}],\"block\":[{},{},{}],\"shared bytes\":{}}}}}",
                k.start_us, k.dur_us, c.grid.0, c.grid.1, c.grid.2, c.block.0, c.block.1, c.block.2, c.shared_bytes
            );
            let _ = write!(
                out,
                ",\n{{\"ph\":\"C\",\"pid\":0,\"name\":\"memory\",\"ts\":{:.3},\"args\":{{\"allocated MiB\":{:.3},\"reserved MiB\":{:.3}}}}}",
                k.start_us,
                k.allocated_bytes as f64 / MIB,
                k.reserved_bytes as f64 / MIB
            );
        }
        out.push_str("\n]}\n");
        out
    }

    /// Writes [`Trace::to_chrome_json`] to `path`.
    pub fn write_chrome_json(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_chrome_json()).map_err(|e| Error::InvalidArgument {
            op: "write_chrome_json",
            message: format!("cannot write {}: {e}", path.display()),
        })
    }

    /// GPU time of the kernels whose name contains `pattern`, in microseconds.
    pub fn kernel_time_us(&self, pattern: &str) -> f64 {
        self.kernels.iter().filter(|k| k.name.contains(pattern)).map(|k| k.dur_us).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chrome_json_escapes_names_and_states_rates() {
        let t = Trace {
            device: "cuda:0 \"test\"".into(),
            kernels: vec![KernelSpan {
                name: "gelu_f32".into(),
                start_us: 1.5,
                dur_us: 2.0,
                config: LaunchConfig { grid: (4, 1, 1), block: (256, 1, 1), shared_bytes: 0 },
                allocated_bytes: 1 << 20,
                reserved_bytes: 2 << 20,
            }],
            scopes: vec![ScopeSpan {
                name: "layer\\1\n".into(),
                start_us: 1.0,
                dur_us: 4.0,
                cost: Cost { bytes: 4_000_000, flops: 8_000_000_000 },
                allocated_bytes: (0, 1 << 20),
            }],
            dropped: 0,
        };
        let j = t.to_chrome_json();
        assert!(j.contains(r#""name":"cuda:0 \"test\"""#), "{j}");
        assert!(j.contains(r#""name":"layer\\1\u000a""#), "{j}");
        // 4e6 bytes in 4 us: 1000 GB/s; 8e9 flops in 4 us: 2000 TFLOP/s.
        assert!(j.contains(r#""GB/s":1000.0"#) && j.contains(r#""TFLOP/s":2000.00"#), "{j}");
        assert!(j.contains(r#""allocated MiB":1.000,"reserved MiB":2.000"#), "{j}");
        assert_eq!(j.matches("\"ph\":\"X\"").count(), 2);
        assert_eq!(t.kernel_time_us("gelu"), 2.0);
    }
}
