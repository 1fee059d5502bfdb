//! The timing harness shared by the benches: the way `triton.testing.do_bench` times PyTorch
//! (see `benches/elementwise.rs` for the full description), criterion for the statistics and
//! the command line, and the medians written as JSON (`KERNELS_BENCH_JSON`) for
//! `scripts/compare.py`, with the peak bytes one run allocates (the report's memory column).
#![allow(dead_code)]

use criterion::{Criterion, Throughput};
use kernels::{DType, Device, Event, Result, Tensor};
use std::time::{Duration, Instant};

/// The L2 flush: as do_bench, 256 MB written before every timed run (H100's L2 is 50 MB).
pub const FLUSH_ELEMS: usize = 1 << 26;

/// Enqueues the op once; returns its outputs, so that they are freed after the end event.
pub type Run = Box<dyn FnMut() -> Result<Vec<Tensor>>>;
/// Builds a case on a device from a seed.
pub type Build = Box<dyn Fn(&Device, u64) -> Result<Run>>;

/// One benchmark: its names, the bytes it must move at least, and how to build it (fresh random
/// inputs from the seed, and the closure that runs the op).
pub struct Case {
    /// Criterion's name within the group, e.g. `f32/fwd/gelu/268435456`.
    pub name: String,
    pub op: String,
    pub dtype: &'static str,
    pub n: usize,
    pub dir: &'static str,
    pub bytes: u64,
    pub build: Build,
}

pub fn dtype_name(dt: DType) -> &'static str {
    dt.suffix()
}

/// The device-side state of one case, built when criterion first runs it.
struct State {
    run: Run,
    /// Per-iteration GPU times (ms) of every timed run.
    samples: Vec<f32>,
    /// What one run allocates at its peak beyond what was allocated before it.
    peak_extra_bytes: usize,
}

/// Peak bytes one run allocates (its outputs and workspaces), by the allocator's count as
/// PyTorch's `max_memory_allocated` counts its own (benches/peak_memory.py).
fn peak_extra(dev: &Device, run: &mut Run) -> Result<usize> {
    dev.synchronize()?;
    dev.reset_peak_memory_stats();
    let base = dev.memory_stats().allocated_bytes;
    let outputs = run()?;
    dev.synchronize()?;
    let peak = dev.memory_stats().peak_allocated_bytes.saturating_sub(base);
    drop(outputs);
    Ok(peak)
}

/// Runs `iters` iterations of flush, event, op, event without synchronising, then reads the event
/// pairs. Returns the summed GPU time and appends each iteration's time to `samples`.
fn time_iters(dev: &Device, flush: &mut Tensor, run: &mut Run, iters: u64, samples: &mut Vec<f32>) -> Result<Duration> {
    let mut pairs: Vec<(Event, Event)> = Vec::with_capacity(iters as usize);
    for i in 0..iters {
        flush.fill_(i as f32)?;
        let start = dev.record_event()?;
        let outputs = run()?;
        let end = dev.record_event()?;
        drop(outputs);
        pairs.push((start, end));
    }
    let mut total_ms = 0.0f64;
    for (start, end) in &pairs {
        let ms = start.elapsed_ms(end)?;
        samples.push(ms);
        total_ms += ms as f64;
    }
    Ok(Duration::from_secs_f64(total_ms / 1e3))
}

/// do_bench's warm-up: at least 25 ms and 3 runs, each after an L2 flush, then a synchronisation.
fn warm_up(dev: &Device, flush: &mut Tensor, run: &mut Run) -> Result<()> {
    let t0 = Instant::now();
    let mut k = 0u32;
    while k < 3 || t0.elapsed() < Duration::from_millis(25) {
        flush.fill_(0.0)?;
        drop(run()?);
        k += 1;
        if k.is_multiple_of(8) {
            dev.synchronize()?;
        }
    }
    dev.synchronize()
}

fn median(v: &mut [f32]) -> f64 {
    v.sort_by(f32::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 { v[m] as f64 } else { (v[m - 1] as f64 + v[m] as f64) / 2.0 }
}

struct Record {
    name: String,
    op: String,
    dtype: &'static str,
    n: usize,
    dir: &'static str,
    bytes: u64,
    ms: f64,
    peak_extra_bytes: usize,
}

fn json_num(x: f64) -> String {
    if x.is_finite() { format!("{x}") } else { "null".into() }
}

fn write_json(path: &str, records: &[Record]) -> std::io::Result<()> {
    let mut s = String::from("[\n");
    for (i, r) in records.iter().enumerate() {
        let gbs = r.bytes as f64 / r.ms / 1e6;
        s += &format!(
            "  {{\"name\": \"{}\", \"op\": \"{}\", \"dtype\": \"{}\", \"n\": {}, \"direction\": \"{}\", \
             \"bytes\": {}, \"ms\": {}, \"gbs\": {}, \"peak_extra_bytes\": {}}}{}\n",
            r.name,
            r.op,
            r.dtype,
            r.n,
            r.dir,
            r.bytes,
            json_num(r.ms),
            json_num(gbs),
            r.peak_extra_bytes,
            if i + 1 < records.len() { "," } else { "" }
        );
    }
    s += "]\n";
    std::fs::write(path, s)
}

fn fail(what: &str, e: kernels::Error) -> ! {
    panic!("{what}: {e}")
}

/// Runs `cases` as criterion group `group` on GPU 0 (or says there is none and returns).
pub fn run(group_name: &str, cases: impl FnOnce(&Device) -> Vec<Case>) {
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no GPU: {e}, benchmarks skipped");
            return;
        }
    };
    println!("device: {} ({} SMs)", dev.name(), dev.sm_count());
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(500))
        .nresamples(10_000)
        .without_plots()
        .configure_from_args();
    let mut flush = Tensor::zeros(&dev, &[FLUSH_ELEMS], DType::F32).unwrap_or_else(|e| fail("L2 flush buffer", e));
    let json_path = std::env::var("KERNELS_BENCH_JSON").ok();
    let mut records = Vec::new();
    let cases = cases(&dev);
    let mut group = c.benchmark_group(group_name);
    for (i, case) in cases.iter().enumerate() {
        let name = case.name.clone();
        let mut state: Option<State> = None;
        group.throughput(Throughput::BytesDecimal(case.bytes));
        group.bench_function(name.as_str(), |b| {
            // Built only when criterion runs the case (not when it is filtered out or listed).
            let st = state.get_or_insert_with(|| {
                let mut run = (case.build)(&dev, 0x5eed_0000 + i as u64 * 16).unwrap_or_else(|e| fail(&name, e));
                warm_up(&dev, &mut flush, &mut run).unwrap_or_else(|e| fail(&name, e));
                let peak_extra_bytes = peak_extra(&dev, &mut run).unwrap_or_else(|e| fail(&name, e));
                State { run, samples: Vec::new(), peak_extra_bytes }
            });
            b.iter_custom(|iters| {
                time_iters(&dev, &mut flush, &mut st.run, iters, &mut st.samples).unwrap_or_else(|e| fail(&name, e))
            });
        });
        if let Some(mut st) = state {
            let peak_extra_bytes = st.peak_extra_bytes;
            drop(st.run); // frees the inputs before the next case allocates its own
            if !st.samples.is_empty() {
                let ms = median(&mut st.samples);
                records.push(Record {
                    name: format!("{group_name}/{name}"),
                    op: case.op.clone(),
                    dtype: case.dtype,
                    n: case.n,
                    dir: case.dir,
                    bytes: case.bytes,
                    ms,
                    peak_extra_bytes,
                });
                let r = records.last().expect("just pushed");
                println!(
                    "median {:<44} {:>10.2} us {:>8.1} GB/s ({} runs)",
                    r.name,
                    ms * 1e3,
                    r.bytes as f64 / ms / 1e6,
                    st.samples.len()
                );
                // Rewritten after every case, so that a run cut short keeps what it measured.
                if let Some(path) = &json_path
                    && let Err(e) = write_json(path, &records)
                {
                    eprintln!("cannot write {path}: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
    group.finish();
    c.final_summary();
    if let Some(path) = &json_path {
        println!("wrote {} records to {path}", records.len());
    }
}
