//! GPU tests of the timeline recorder (`Device::start_trace`, `trace_scope`, `stop_trace`): the
//! kernels recorded are the ones launched, in order, with GPU times that nest inside their
//! spans and that no faster memory could give; the Chrome JSON parses and holds them; misuse is
//! an error.
//!
//! A recording is the device's, shared by every thread: each test holds `SERIAL`.

mod common;

use common::*;
use kernels::device::Cost;
use kernels::ops::{self, Activation, BinaryOp};
use kernels::{DType, Device, Error, Tensor};
use std::process::ExitCode;
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(what()) }
}

/// Event timestamps have a resolution of about half a microsecond.
const RESOLUTION_US: f64 = 1.0;

fn recorded(dev: &Device) -> Result<(), String> {
    let _g = serial();
    const N: usize = 1 << 26;
    let a = Tensor::full(dev, &[N], DType::F32, 1.5).map_err(e)?;
    let b = Tensor::full(dev, &[N], DType::F32, 2.0).map_err(e)?;
    let small = Tensor::from_f32(dev, &[0.5; 1000], &[1000], DType::F32).map_err(e)?;
    dev.synchronize().map_err(e)?;

    dev.start_trace().map_err(e)?;
    check(dev.is_tracing(), || "not tracing after start_trace".into())?;
    let bytes = 3 * N as u64 * 4;
    let sum = {
        let _s = dev.trace_scope("add", Cost { bytes, flops: N as u64 });
        ops::binary(&a, &b, BinaryOp::Add).map_err(e)?
    };
    let g = {
        let _s = dev.trace_scope("gelu \"small\"", Cost::default());
        ops::unary(&small, Activation::Gelu).map_err(e)?
    };
    let trace = dev.stop_trace().map_err(e)?;
    check(!dev.is_tracing(), || "still tracing after stop_trace".into())?;
    // Launched after the recording: not in it.
    let _later = ops::unary(&small, Activation::Relu).map_err(e)?;

    check(trace.dropped == 0, || format!("{} launches dropped", trace.dropped))?;
    check(trace.kernels.len() == 2, || format!("expected 2 kernels, got {:?}", trace.kernels))?;
    let (k0, k1) = (&trace.kernels[0], &trace.kernels[1]);
    check(k0.name.contains("add") && k0.name.contains("f32"), || format!("first kernel {}", k0.name))?;
    check(k1.name.contains("gelu"), || format!("second kernel {}", k1.name))?;
    check(k0.start_us >= 0.0 && k1.start_us + RESOLUTION_US >= k0.start_us + k0.dur_us, || {
        format!("kernels out of order: {k0:?} {k1:?}")
    })?;
    // 768 MiB read and written cannot take less than it would at 5 TB/s, more than any H100 or
    // H200 has.
    let floor_us = bytes as f64 / 5e12 * 1e6;
    check(k0.dur_us >= floor_us, || format!("the add took {} us, less than {floor_us} us", k0.dur_us))?;
    check(k0.allocated_bytes >= 3 * N * 4, || format!("allocated {} at the add", k0.allocated_bytes))?;
    check(k0.reserved_bytes >= k0.allocated_bytes, || format!("reserved {} < allocated", k0.reserved_bytes))?;
    check(k0.config.block.0 > 0 && k0.config.grid.0 > 0, || format!("geometry {:?}", k0.config))?;

    check(trace.scopes.len() == 2, || format!("expected 2 spans, got {:?}", trace.scopes))?;
    for (s, k) in trace.scopes.iter().zip([k0, k1]) {
        check(
            s.start_us <= k.start_us + RESOLUTION_US && k.start_us + k.dur_us <= s.start_us + s.dur_us + RESOLUTION_US,
            || format!("kernel {k:?} outside its span {s:?}"),
        )?;
    }
    let s0 = &trace.scopes[0];
    check(s0.name == "add" && s0.cost.bytes == bytes, || format!("span {s0:?}"))?;
    check(s0.allocated_bytes.1 >= s0.allocated_bytes.0 + N * 4, || format!("the sum's memory: {s0:?}"))?;
    check((trace.kernel_time_us("add") - k0.dur_us).abs() < 1e-9, || "kernel_time_us".into())?;

    let json = trace.to_chrome_json();
    let v: serde_json::Value = serde_json::from_str(&json).map_err(|err| format!("{err}: {json}"))?;
    let events = v["traceEvents"].as_array().ok_or("no traceEvents")?;
    let complete: Vec<_> = events.iter().filter(|ev| ev["ph"] == "X").collect();
    check(complete.len() == 4, || format!("{} complete events in {json}", complete.len()))?;
    check(events.iter().any(|ev| ev["ph"] == "X" && ev["name"] == "gelu \"small\""), || json.clone())?;
    check(events.iter().filter(|ev| ev["ph"] == "C" && ev["name"] == "memory").count() == 2, || json.clone())?;
    let add = complete.iter().find(|ev| ev["name"] == "add").ok_or("no add span")?;
    let rate = add["args"]["GB/s"].as_f64().ok_or("no GB/s")?;
    let want = bytes as f64 / (s0.dur_us * 1e3);
    check((rate - want).abs() <= 0.05 + 1e-6 * want, || format!("GB/s {rate}, want {want}"))?;

    check(sum.to_f32_vec().map_err(e)?.iter().all(|&x| x == 3.5), || "1.5 + 2 != 3.5".into())?;
    drop(g);
    Ok(())
}

fn misuse(dev: &Device) -> Result<(), String> {
    let _g = serial();
    check(matches!(dev.stop_trace(), Err(Error::InvalidArgument { op: "stop_trace", .. })), || {
        "stop_trace without start_trace".into()
    })?;
    dev.start_trace().map_err(e)?;
    let twice = dev.start_trace();
    // A span opened in one recording and closed after it ended is left out of the next one.
    let stale = dev.trace_scope("stale", Cost::default());
    let first = dev.stop_trace().map_err(e)?;
    check(matches!(twice, Err(Error::InvalidArgument { op: "start_trace", .. })), || format!("{twice:?}"))?;
    check(first.kernels.is_empty() && first.scopes.is_empty(), || format!("{first:?}"))?;
    dev.start_trace().map_err(e)?;
    drop(stale);
    let x = Tensor::from_f32(dev, &[1.0; 10], &[10], DType::F32).map_err(e)?;
    let _y = ops::unary(&x, Activation::Silu).map_err(e)?;
    let second = dev.stop_trace().map_err(e)?;
    check(second.scopes.is_empty() && second.kernels.len() == 1, || format!("{second:?}"))?;
    // Not recording: a span is inert.
    drop(dev.trace_scope("idle", Cost::default()));
    check(!dev.is_tracing(), || "tracing after the inert span".into())
}

fn main() -> ExitCode {
    run(vec![test("trace/recorded", recorded), test("trace/misuse", misuse)])
}
