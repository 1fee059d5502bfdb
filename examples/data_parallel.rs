//! Data-parallel training on every GPU of the machine, one thread per GPU: an MLP of GELU layers
//! with cross-entropy and AdamW, each rank on its share of the batch, the gradients averaged
//! across ranks by NCCL in buckets while the backward pass still runs (`dist::BucketedAllReduce`,
//! communication on a second stream overlapping the next layers' gradients).
//!
//! ```text
//! cargo run --release --example data_parallel                  # every GPU, checked
//! cargo run --release --example data_parallel -- --gpus 2 --steps 50
//! cargo run --release --example data_parallel -- --scaling     # step time on 1, 2, 4, ... GPUs
//! ```
//!
//! The check (default): the same model from the same initial weights is trained on GPU 0 alone
//! on the whole global batch, and on N GPUs with `1/N` of it each. The two differ only in the
//! order of the sums over the batch (split across ranks, then averaged by NCCL), so they agree
//! to f32 rounding: at step 0 every gradient element within `2e-4` of the largest of its tensor
//! (two f32 sums over the K rows of the global batch, each within about `sqrt(K) u`, 1e-5 to
//! 2e-5 here, relative to the sum of magnitudes for random signs, with room for cancellation),
//! and the loss of the first five
//! steps within a relative `1e-4`. Later steps are not compared: AdamW divides by `sqrt(v)`, so a
//! near-zero gradient rounded differently may move its parameter by the learning rate either
//! way (see `examples/mlp.rs`).
//!
//! `--scaling`: weak scaling, as data-parallel training is used: the batch per GPU is fixed and
//! the global batch grows with the GPUs; the step time on N GPUs against one GPU without any
//! communication gives the efficiency `t(1) / t(N)`.
//!
//! Needs NCCL (`KERNELS_NCCL_LIB`, see `kernels::dist`). NVLink multicast is left off
//! (`NCCL_NVLS_ENABLE=0`). Exits 1 if a check fails, 0 with a message when there is no GPU.

use kernels::dist::{BucketedAllReduce, Communicator, ReduceOp};
use kernels::ops::{self, Activation, AdamW, AdamWState, CrossEntropyOpts};
use kernels::{DType, Device, IndexTensor, Tensor};
use std::time::Instant;

/// Input features, hidden width, hidden layers, classes.
const D: usize = 1024;
const W: usize = 2048;
const LAYERS: usize = 4;
const C: usize = 1000;
/// Rows per GPU.
const ROWS_PER_GPU: usize = 8192;
const CHECKED_STEPS: usize = 5;
/// PyTorch DDP's default bucket.
const BUCKET_BYTES: usize = 25 << 20;

/// SplitMix64: reproducible data and initial weights.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f64 / (1u64 << 24) as f64) as f32
    }
    /// PyTorch's `nn.Linear` initialisation: uniform on `+-1/sqrt(fan_in)`.
    fn linear(&mut self, n: usize, fan_in: usize) -> Vec<f32> {
        let b = 1.0 / (fan_in as f32).sqrt();
        (0..n).map(|_| (2.0 * self.unit() - 1.0) * b).collect()
    }
}

/// `(out, in)` of each layer.
fn layer_dims() -> Vec<(usize, usize)> {
    let mut dims = vec![(W, D)];
    dims.extend((1..LAYERS).map(|_| (W, W)));
    dims.push((C, W));
    dims
}

/// Weights and biases, host copies, layer by layer.
fn init_params() -> Vec<(Vec<f32>, Vec<f32>)> {
    let mut rng = Rng(7);
    layer_dims().into_iter().map(|(o, i)| (rng.linear(o * i, i), rng.linear(o, i))).collect()
}

/// `rows` inputs in `[-1, 1)` and labels: the same global data however it is split.
fn data(rows: usize) -> (Vec<f32>, Vec<i64>) {
    let mut rng = Rng(2026);
    let x = (0..rows * D).map(|_| 2.0 * rng.unit() - 1.0).collect();
    let y = (0..rows).map(|_| (rng.next() % C as u64) as i64).collect();
    (x, y)
}

/// What a rank's training returns: the loss of each step, the gradients of the first step (host
/// copies, for the check), and the seconds of the steps after the first.
struct Run {
    losses: Vec<f32>,
    first_grads: Vec<Vec<f32>>,
    secs: f64,
}

/// Trains `steps` steps on `dev` with the rows `x`, `y` (this rank's share), averaging the
/// gradients over `comm`'s ranks when there is one.
fn train(dev: &Device, comm: Option<&Communicator>, x: &[f32], y: &[i64], steps: usize) -> kernels::Result<Run> {
    let rows = y.len();
    let xt = Tensor::from_slice(dev, x, &[rows, D])?;
    let yt = IndexTensor::from_slice(dev, y, &[rows])?;
    let one = Tensor::full(dev, &[], DType::F32, 1.0)?;
    let dims = layer_dims();
    let mut params = Vec::new();
    for ((w, b), &(o, i)) in init_params().iter().zip(&dims) {
        params.push((Tensor::from_slice(dev, w, &[o, i])?, Tensor::from_slice(dev, b, &[o])?));
    }
    let mut opt = Vec::new();
    for (w, b) in &params {
        opt.push((AdamWState::new(w)?, AdamWState::new(b)?));
    }
    let cfg = AdamW { lr: 1e-3, ..AdamW::default() };
    let mut losses = Vec::new();
    let mut first_grads = Vec::new();
    let mut t0 = Instant::now();
    for step in 0..steps {
        if step == 1 {
            dev.synchronize()?;
            t0 = Instant::now();
        }
        // Forward, keeping each layer's input and what its backward needs.
        // outs[l] is layer l's output; layer l's input is outs[l - 1], or x.
        let mut outs: Vec<Tensor> = Vec::new();
        let mut saved = Vec::new();
        for (l, (w, b)) in params.iter().enumerate() {
            let act = if l + 1 < params.len() { Activation::Gelu } else { Activation::Identity };
            let (h, s) = ops::linear_train(if l == 0 { &xt } else { &outs[l - 1] }, w, Some(b), act)?;
            outs.push(h);
            saved.push(s);
        }
        let logits = outs.last().expect("layers");
        let (loss, ce) = ops::cross_entropy(logits, &yt, CrossEntropyOpts::default())?;
        // Backward, last layer first; each layer's gradients join the open bucket, whose
        // all-reduce starts as soon as it is full while the next layers' gradients compute.
        let mut dy = ops::cross_entropy_backward(logits, &yt, &ce, &one)?;
        let mut reducer = comm.map(|c| BucketedAllReduce::new(c, ReduceOp::Mean, BUCKET_BYTES));
        let mut grads = Vec::new();
        for l in (0..params.len()).rev() {
            let (w, b) = &params[l];
            let input = if l == 0 { &xt } else { &outs[l - 1] };
            let g = ops::linear_backward(input, w, &outs[l], &saved[l], &dy, Some(b))?;
            let gb = g.bias.expect("the layer has a bias");
            match &mut reducer {
                Some(r) => {
                    r.push(g.weight)?;
                    r.push(gb)?;
                }
                None => grads.extend([g.weight, gb]),
            }
            dy = g.x;
        }
        if let Some(r) = reducer {
            grads = r.finish()?;
        }
        // grads: w, b of the last layer first.
        if step == 0 {
            for g in &grads {
                first_grads.push(g.to_vec::<f32>()?);
            }
        }
        for (l, ((w, b), (sw, sb))) in params.iter_mut().zip(&mut opt).enumerate() {
            let k = 2 * (dims.len() - 1 - l);
            sw.update(w, &grads[k], &cfg)?;
            sb.update(b, &grads[k + 1], &cfg)?;
        }
        losses.push(loss);
    }
    dev.synchronize()?;
    let secs = t0.elapsed().as_secs_f64();
    let losses = losses.iter().map(|l| l.to_scalar::<f32>()).collect::<kernels::Result<_>>()?;
    Ok(Run { losses, first_grads, secs })
}

/// Trains on `devs.len()` GPUs, one thread each, with `rows_per_gpu` rows of the global data
/// each. Returns every rank's run.
fn data_parallel(devs: &[Device], rows_per_gpu: usize, steps: usize) -> kernels::Result<Vec<Run>> {
    let (x, y) = data(rows_per_gpu * devs.len());
    let comms = Communicator::new_group(devs)?;
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let rows = r * rows_per_gpu..(r + 1) * rows_per_gpu;
                let (x, y) = (&x[rows.start * D..rows.end * D], &y[rows]);
                s.spawn(move || train(c.device(), Some(c), x, y, steps))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank's thread panicked")).collect()
    })
}

/// The mean over ranks of each step's loss: the loss of the global batch (equal shares).
fn global_losses(runs: &[Run]) -> Vec<f32> {
    let n = runs.len() as f32;
    (0..runs[0].losses.len()).map(|s| runs.iter().map(|r| r.losses[s]).sum::<f32>() / n).collect()
}

fn check(devs: &[Device], steps: usize) -> kernels::Result<bool> {
    let n = devs.len();
    let rows = ROWS_PER_GPU * n;
    println!("{n} GPU(s), {rows} rows in all; the same batch on GPU 0 alone first");
    let (x, y) = data(rows);
    let single = train(&devs[0], None, &x, &y, steps)?;
    let runs = data_parallel(devs, ROWS_PER_GPU, steps)?;
    let losses = global_losses(&runs);
    let mut ok = true;
    for (i, (g1, gn)) in single.first_grads.iter().zip(&runs[0].first_grads).enumerate() {
        let scale = g1.iter().fold(0.0f32, |a, &b| a.max(b.abs()));
        let worst = g1.iter().zip(gn).map(|(a, b)| (a - b).abs()).fold(0.0f32, nan_max) / scale;
        let good = worst <= 2e-4; // false for NaN
        ok &= good;
        println!(
            "step 0 gradient {} of layer {}: max |{n} GPUs - 1 GPU| / max |1 GPU| = {worst:.1e}{}",
            ["w", "b"][i % 2],
            LAYERS - i / 2,
            if good { "" } else { "  MISMATCH" }
        );
    }
    // Every rank holds the same averaged gradients.
    for (r, run) in runs.iter().enumerate().skip(1) {
        let same = run.first_grads == runs[0].first_grads;
        ok &= same;
        if !same {
            println!("rank {r}'s reduced gradients differ from rank 0's: MISMATCH");
        }
    }
    for (s, (&l1, &ln)) in single.losses.iter().zip(&losses).enumerate() {
        let rel = ((ln - l1) / l1).abs();
        let checked = s < CHECKED_STEPS;
        let good = !checked || rel <= 1e-4;
        ok &= good;
        if checked || s % 10 == 0 || s + 1 == steps {
            println!(
                "step {s:>3}  loss on {n} GPUs {ln:.6}  on 1 GPU {l1:.6}  (relative difference {rel:.1e}){}",
                if good { "" } else { "  MISMATCH" }
            );
        }
    }
    let fell = losses.last().is_some_and(|&l| l < losses[0]);
    ok &= fell;
    let secs = runs.iter().map(|r| r.secs).fold(0.0, f64::max);
    println!(
        "{} ms a step on {n} GPUs with {ROWS_PER_GPU} rows each; loss {:.4} -> {:.4}{}",
        secs * 1e3 / (steps - 1) as f64,
        losses[0],
        losses.last().copied().unwrap_or(f32::NAN),
        if fell { "" } else { "  (did not fall: FAILED)" }
    );
    println!("{}", if ok { "all checks passed" } else { "CHECKS FAILED" });
    Ok(ok)
}

fn scaling(devs: &[Device], steps: usize) -> kernels::Result<bool> {
    let (x, y) = data(ROWS_PER_GPU);
    let one = train(&devs[0], None, &x, &y, steps)?;
    let t1 = one.secs / (steps - 1) as f64;
    println!("1 GPU, no communication: {:.2} ms a step ({ROWS_PER_GPU} rows)", t1 * 1e3);
    let mut n = 2;
    while n <= devs.len() {
        let runs = data_parallel(&devs[..n], ROWS_PER_GPU, steps)?;
        let tn = runs.iter().map(|r| r.secs).fold(0.0, f64::max) / (steps - 1) as f64;
        println!(
            "{n} GPUs: {:.2} ms a step ({} rows), efficiency t(1)/t({n}) = {:.3}",
            tn * 1e3,
            n * ROWS_PER_GPU,
            t1 / tn
        );
        n *= 2;
    }
    Ok(true)
}

fn main() {
    // SAFETY: before any other thread exists; NCCL reads it when it initialises.
    unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    let mut gpus = None;
    let mut steps = 30;
    let mut scale = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| {
            args.next().and_then(|v| v.parse::<usize>().ok()).unwrap_or_else(|| {
                eprintln!("{name} needs a number");
                std::process::exit(2)
            })
        };
        match a.as_str() {
            "--gpus" => gpus = Some(value("--gpus")),
            "--steps" => steps = value("--steps").max(CHECKED_STEPS + 1),
            "--scaling" => scale = true,
            _ => {
                eprintln!("usage: data_parallel [--gpus N] [--steps S] [--scaling]");
                std::process::exit(2);
            }
        }
    }
    let available = match kernels::device_count() {
        Ok(n) if n > 0 => n,
        Ok(_) | Err(_) => {
            println!("no GPU: nothing to train");
            return;
        }
    };
    let n = gpus.unwrap_or(available).clamp(1, available);
    let devs = match (0..n).map(Device::cuda).collect::<kernels::Result<Vec<_>>>() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("GPU error: {e}");
            std::process::exit(2);
        }
    };
    match if scale { scaling(&devs, steps) } else { check(&devs, steps) } {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}

/// The larger of two differences, NaN if either is (`f32::max` would drop a NaN).
fn nan_max(m: f32, d: f32) -> f32 {
    if m.is_nan() || d.is_nan() { f32::NAN } else { m.max(d) }
}
