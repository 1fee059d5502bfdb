//! All-reduce bus bandwidth (`kernels::dist`, NCCL) over every GPU of the machine in one
//! process, from 1 MiB to 1 GiB, f32 and bf16, in place; `benches/torch_dist.py` times
//! `torch.distributed`'s NCCL all-reduce the same way (one process per GPU) under the same names.
//!
//! ```text
//! KERNELS_NCCL_LIB=.../libnccl.so.2 cargo bench --bench dist
//! KERNELS_BENCH_JSON=dist.json KERNELS_DIST_GPUS=2 cargo bench --bench dist -- bf16
//! ```
//!
//! Bus bandwidth as nccl-tests defines it: `bytes / time * 2 (world - 1) / world`, the traffic
//! of each link in a ring, comparable across world sizes. Time: the median over 5 repeats of
//! the GPU time of a burst of all-reduces (CUDA events on every device, the slowest device's),
//! after 5 warm-up ones. Names: `dist/<dtype>/all_reduce/<world>gpu/<bytes>`; the JSON's
//! `bytes` are the bus bytes, so its `gbs` is the bus bandwidth. Fewer than 2 GPUs: says so and
//! measures nothing. NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`).

use kernels::dist::{self, Communicator, ReduceOp};
use kernels::{DType, Device, Tensor};

fn main() {
    // SAFETY: before any other thread exists; NCCL reads it when it initialises.
    unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let n = match kernels::device_count() {
        Ok(n) if n >= 2 => n,
        Ok(n) => return println!("dist bench skipped: {n} GPU(s), the all-reduce needs 2 or more"),
        Err(e) => return println!("dist bench skipped: no GPU ({e})"),
    };
    let world = std::env::var("KERNELS_DIST_GPUS").ok().and_then(|v| v.parse().ok()).unwrap_or(n).clamp(2, n);
    if let Err(e) = run(world, filter.as_deref()) {
        eprintln!("dist bench failed: {e}");
        std::process::exit(1);
    }
}

fn run(world: usize, filter: Option<&str>) -> kernels::Result<()> {
    let devs = (0..world).map(Device::cuda).collect::<kernels::Result<Vec<_>>>()?;
    let comms = Communicator::new_group(&devs)?;
    let (version, lib) = dist::nccl_version()?;
    println!("{} x {world}, NCCL {version} ({lib})", devs[0].name());
    let mut records = Vec::new();
    for dt in [DType::F32, DType::BF16] {
        let dname = if dt == DType::F32 { "f32" } else { "bf16" };
        for log2 in 20..=30 {
            let bytes = 1usize << log2;
            let name = format!("dist/{dname}/all_reduce/{world}gpu/{bytes}");
            if filter.is_some_and(|f| !name.contains(f)) {
                continue;
            }
            let elems = bytes / dt.size();
            let mut xs =
                devs.iter().map(|d| Tensor::full(d, &[elems], dt, 1.0)).collect::<kernels::Result<Vec<_>>>()?;
            let mut burst = |iters: usize| -> kernels::Result<f64> {
                let starts = devs.iter().map(Device::record_event).collect::<kernels::Result<Vec<_>>>()?;
                for _ in 0..iters {
                    // Sums of ones grow by a factor of `world` each time: harmless in f32 and
                    // bf16 (they saturate at infinity, which costs the same).
                    dist::group(|| comms.iter().zip(&mut xs).try_for_each(|(c, x)| c.all_reduce_(x, ReduceOp::Sum)))?;
                }
                let ends = devs.iter().map(Device::record_event).collect::<kernels::Result<Vec<_>>>()?;
                let mut ms = 0f64;
                for (s, e) in starts.iter().zip(&ends) {
                    ms = ms.max(s.elapsed_ms(e)? as f64);
                }
                Ok(ms / iters as f64)
            };
            let iters = ((256usize << 20) / bytes).clamp(5, 50);
            burst(5)?;
            let mut times = (0..5).map(|_| burst(iters)).collect::<kernels::Result<Vec<_>>>()?;
            times.sort_by(f64::total_cmp);
            let ms = times[2];
            let bus_bytes = bytes as f64 * 2.0 * (world - 1) as f64 / world as f64;
            let busbw = bus_bytes / ms / 1e6;
            println!(
                "{name:44} {:10.1} us  algbw {:7.1} GB/s  busbw {busbw:7.1} GB/s",
                ms * 1e3,
                bytes as f64 / ms / 1e6
            );
            records.push(format!(
                "  {{\"name\": \"{name}\", \"op\": \"all_reduce_{world}gpu\", \"dtype\": \"{dname}\", \"n\": {elems}, \
                 \"direction\": \"fwd\", \"bytes\": {}, \"ms\": {ms}, \"gbs\": {busbw}}}",
                bus_bytes as u64
            ));
        }
    }
    if let Ok(path) = std::env::var("KERNELS_BENCH_JSON") {
        let json = format!("[\n{}\n]\n", records.join(",\n"));
        if let Err(e) = std::fs::write(&path, json) {
            eprintln!("cannot write {path}: {e}");
        }
    }
    Ok(())
}
