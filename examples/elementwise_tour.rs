//! A tour of the element-wise ops on the GPU: runs each one on 2^24 random elements, checks the
//! result against a CPU reference in f64 computed from the same (copied back) inputs, and prints
//! a table of time, bandwidth and error.
//!
//! ```text
//! cargo run --release --example elementwise_tour          # TOUR_SEED=<n> repeats a run's inputs
//! ```
//!
//! Checks: before the checked run the memory pool is poisoned with NaN (tensors of the outputs'
//! sizes, filled and freed), so an element the kernel does not write shows up; every output
//! element must be finite (all inputs are drawn where the reference is finite); the error is
//! compared on every 16th element (from a random phase) plus the first and last 4096, and on
//! every element of the `[cols]` parameter gradients. Error per element: |out - ref| / max(|ref|, 1)
//! (relative, absolute below 1); for a parameter gradient, a column sum, |out - ref| / max|ref|.
//! Tolerances: f32 1e-5, bf16 4e-3 (one bf16 ulp), f16 1e-3.
//!
//! Time: median of 20 runs, each after an L2 flush (a 256 MiB fill), between CUDA events.
//! GB/s counts each input read once and each output written once, as `benches/elementwise.rs`;
//! "% copy" compares with a device-to-device copy of the same 2^24 f32 elements, timed the same way.
//!
//! Exits 1 if any check fails, 2 on a GPU error, 0 (with a one-line message) when there is no GPU.

use kernels::ops::{self, Activation, BinaryOp, UnaryOp};
use kernels::{DType, Device, Result, Tensor};

const N: usize = 1 << 24;
const COLS: usize = 1024;
const ROWS: usize = N / COLS;
const STRIDE: usize = 16;
const EDGE: usize = 4096;
const RUNS: usize = 20;
const FLUSH_ELEMS: usize = 1 << 26;

// The f64 references of the tests (PyTorch's definitions), shared rather than written twice.
#[allow(dead_code)]
#[path = "../tests/common/reference.rs"]
mod reference;

/// The op's inputs are drawn positive (its row in the op table says so).
fn positive(op: UnaryOp) -> bool {
    ops::UNARY_OPS.iter().any(|i| i.name == op.name() && i.positive)
}

// --- the harness ---------------------------------------------------------------------------------

fn dtype_name(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

fn tolerance(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::BF16 => 4e-3,
        DType::F16 => 1e-3,
    }
}

fn median(v: &mut [f32]) -> f64 {
    v.sort_by(f32::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 { v[m] as f64 } else { (v[m - 1] as f64 + v[m] as f64) / 2.0 }
}

type Outputs = Result<Vec<Tensor>>;

struct Tour {
    dev: Device,
    flush: Tensor,
    seed: u64,
    draws: u64,
    copy_gbs: f64,
    failures: Vec<String>,
}

impl Tour {
    fn next_seed(&mut self) -> u64 {
        self.draws += 1;
        self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(self.draws.wrapping_mul(0x2545_f491_4f6c_dd1d))
    }

    /// `[ROWS, COLS]` standard normal numbers, and their host copy.
    fn normal(&mut self, dt: DType) -> Result<(Tensor, Vec<f32>)> {
        let s = self.next_seed();
        let t = Tensor::rand_normal(&self.dev, &[ROWS, COLS], dt, 0.0, 1.0, s)?;
        let h = t.to_f32_vec()?;
        Ok((t, h))
    }

    /// Uniform on [0.1, 4): for ops that want positive inputs.
    fn positive(&mut self, dt: DType) -> Result<(Tensor, Vec<f32>)> {
        let s = self.next_seed();
        let t = Tensor::rand_uniform(&self.dev, &[ROWS, COLS], dt, 0.1, 4.0, s)?;
        let h = t.to_f32_vec()?;
        Ok((t, h))
    }

    /// A `[COLS]` parameter: normal with `mean` and std 0.5.
    fn row(&mut self, dt: DType, mean: f32) -> Result<(Tensor, Vec<f32>)> {
        let s = self.next_seed();
        let t = Tensor::rand_normal(&self.dev, &[COLS], dt, mean, 0.5, s)?;
        let h = t.to_f32_vec()?;
        Ok((t, h))
    }

    /// Median GPU time (ms) of `run`, each run after an L2 flush, between two events.
    fn time(&mut self, run: &mut dyn FnMut() -> Outputs) -> Result<f64> {
        let mut pairs = Vec::with_capacity(RUNS);
        for i in 0..RUNS {
            self.flush.fill_(i as f32)?;
            let start = self.dev.record_event()?;
            let outs = run()?;
            let end = self.dev.record_event()?;
            drop(outs);
            pairs.push((start, end));
        }
        let mut ms = pairs.iter().map(|(s, e)| s.elapsed_ms(e)).collect::<Result<Vec<f32>>>()?;
        Ok(median(&mut ms))
    }

    /// Runs, checks and times one case. `elems` counts the elements moved (inputs read once,
    /// outputs written once); `reference(k, i)` is element `i` of output `k`.
    fn case(
        &mut self,
        op: &str,
        dt: DType,
        dir: &str,
        elems: u64,
        run: &mut dyn FnMut() -> Outputs,
        reference: &dyn Fn(usize, usize) -> f64,
    ) -> Result<()> {
        // A first run warms up and tells the output sizes; then poison the pool with NaN at those
        // sizes, so that the checked run's outputs most likely land on NaN.
        let sizes: Vec<usize> = run()?.iter().map(Tensor::numel).collect();
        let poison = sizes.iter().map(|&m| Tensor::full(&self.dev, &[m], dt, f32::NAN)).collect::<Result<Vec<_>>>()?;
        drop(poison);
        let outs = run()?;
        let host = outs.iter().map(Tensor::to_f32_vec).collect::<Result<Vec<_>>>()?;
        drop(outs);

        let phase = (self.seed % STRIDE as u64) as usize;
        let (mut err, mut nonfinite) = (0.0f64, 0usize);
        for (k, h) in host.iter().enumerate() {
            nonfinite += h.iter().filter(|v| !v.is_finite()).count();
            if h.len() == N {
                let idx = (0..EDGE).chain((phase..N).step_by(STRIDE)).chain(N - EDGE..N);
                for i in idx {
                    let (o, r) = (h[i] as f64, reference(k, i));
                    if o.is_finite() {
                        err = err.max((o - r).abs() / r.abs().max(1.0));
                    }
                }
            } else {
                let refs: Vec<f64> = (0..h.len()).map(|i| reference(k, i)).collect();
                let scale = refs.iter().fold(f64::MIN_POSITIVE, |m, r| m.max(r.abs()));
                for (o, r) in h.iter().zip(&refs) {
                    if o.is_finite() {
                        err = err.max((*o as f64 - r).abs() / scale);
                    }
                }
            }
        }
        let tol = tolerance(dt);
        let ok = nonfinite == 0 && err.is_finite() && err <= tol;
        let verdict = if ok {
            "OK".to_string()
        } else if nonfinite > 0 {
            format!("FAIL ({nonfinite} non-finite)")
        } else {
            format!("FAIL (tol {tol:.0e})")
        };

        let ms = self.time(run)?;
        let bytes = elems as f64 * dt.size() as f64;
        let gbs = bytes / ms / 1e6;
        let pct = if self.copy_gbs > 0.0 { 100.0 * gbs / self.copy_gbs } else { 0.0 };
        let name = format!("{op} {dir}");
        println!(
            "| {name:<22} | {:<5} | {:>9.1} | {gbs:>8.1} | {pct:>6.1} | {err:>9.2e} | {verdict} |",
            dtype_name(dt),
            ms * 1e3
        );
        if !ok {
            self.failures.push(format!("{name} {}", dtype_name(dt)));
        }
        Ok(())
    }

    fn unary_fwd(&mut self, name: &str, op: UnaryOp, dt: DType) -> Result<()> {
        let (x, xh) = if positive(op) { self.positive(dt)? } else { self.normal(dt)? };
        let mut run = || Ok(vec![ops::unary(&x, op)?]);
        self.case(name, dt, "fwd", 2 * N as u64, &mut run, &|_, i| reference::unary_fwd(op, xh[i] as f64))
    }

    fn unary_bwd(&mut self, name: &str, op: UnaryOp, dt: DType) -> Result<()> {
        let (x, xh) = if positive(op) { self.positive(dt)? } else { self.normal(dt)? };
        let (g, gh) = self.normal(dt)?;
        let mut run = || Ok(vec![ops::unary_backward(&x, &g, op)?]);
        self.case(name, dt, "bwd", 3 * N as u64, &mut run, &|_, i| reference::unary_bwd(op, xh[i] as f64, gh[i] as f64))
    }

    /// The second operand: positive for `div` (the normal draws include exact zeros, whose
    /// quotients are infinite), normal otherwise.
    fn operand(&mut self, op: BinaryOp, dt: DType) -> Result<(Tensor, Vec<f32>)> {
        if op == BinaryOp::Div { self.positive(dt) } else { self.normal(dt) }
    }

    fn binary_fwd(&mut self, name: &str, op: BinaryOp, dt: DType) -> Result<()> {
        let ((a, ah), (b, bh)) = (self.normal(dt)?, self.operand(op, dt)?);
        let mut run = || Ok(vec![ops::binary(&a, &b, op)?]);
        self.case(name, dt, "fwd", 3 * N as u64, &mut run, &|_, i| {
            reference::binary_fwd(op, ah[i] as f64, bh[i] as f64)
        })
    }

    fn binary_bwd(&mut self, name: &str, op: BinaryOp, dt: DType) -> Result<()> {
        let ((a, ah), (b, bh), (g, gh)) = (self.normal(dt)?, self.operand(op, dt)?, self.normal(dt)?);
        let mut run = || {
            let (ga, gb) = ops::binary_backward(&a, &b, &g, op)?;
            Ok(vec![ga, gb])
        };
        let reference = |k: usize, i: usize| {
            let (da, db) = reference::binary_bwd(op, ah[i] as f64, bh[i] as f64, gh[i] as f64);
            if k == 0 { da } else { db }
        };
        self.case(name, dt, "bwd", 5 * N as u64, &mut run, &reference)
    }

    fn add_row_fwd(&mut self, dt: DType) -> Result<()> {
        let ((x, xh), (r, rh)) = (self.normal(dt)?, self.row(dt, 0.0)?);
        let mut run = || Ok(vec![ops::binary_row(&x, &r, BinaryOp::Add)?]);
        let elems = 2 * N as u64 + COLS as u64;
        self.case("add_row", dt, "fwd", elems, &mut run, &|_, i| xh[i] as f64 + rh[i % COLS] as f64)
    }

    fn add_row_bwd(&mut self, dt: DType) -> Result<()> {
        let ((x, _), (r, _), (g, gh)) = (self.normal(dt)?, self.row(dt, 0.0)?, self.normal(dt)?);
        let mut run = || {
            let (gx, gr) = ops::binary_row_backward(&x, &r, &g, BinaryOp::Add)?;
            Ok(vec![gx, gr])
        };
        let reference = |k: usize, i: usize| {
            if k == 0 { gh[i] as f64 } else { (0..ROWS).map(|row| gh[row * COLS + i] as f64).sum() }
        };
        self.case("add_row", dt, "bwd", 3 * N as u64 + 2 * COLS as u64, &mut run, &reference)
    }

    fn fused_fwd(&mut self, name: &str, act: Activation, dt: DType) -> Result<()> {
        let ((x, xh), (s, sh), (b, bh)) = (self.normal(dt)?, self.row(dt, 1.0)?, self.row(dt, 0.0)?);
        let mut run = || Ok(vec![ops::scale_bias_act(&x, &s, &b, act)?]);
        let reference = |_: usize, i: usize| {
            let c = i % COLS;
            reference::act_fwd(act, xh[i] as f64 * sh[c] as f64 + bh[c] as f64)
        };
        self.case(name, dt, "fwd", 2 * N as u64 + 2 * COLS as u64, &mut run, &reference)
    }

    fn fused_bwd(&mut self, name: &str, act: Activation, dt: DType) -> Result<()> {
        let ((x, xh), (s, sh), (b, bh)) = (self.normal(dt)?, self.row(dt, 1.0)?, self.row(dt, 0.0)?);
        let (g, gh) = self.normal(dt)?;
        let mut run = || {
            let gr = ops::scale_bias_act_backward(&x, &s, &b, &g, act)?;
            Ok(vec![gr.x, gr.scale, gr.bias])
        };
        // dL/dz at element i, z = x * scale + bias.
        let dz = |i: usize| {
            let c = i % COLS;
            reference::act_bwd(act, xh[i] as f64 * sh[c] as f64 + bh[c] as f64, gh[i] as f64)
        };
        let reference = |k: usize, i: usize| match k {
            0 => dz(i) * sh[i % COLS] as f64,
            1 => (0..ROWS).map(|row| dz(row * COLS + i) * xh[row * COLS + i] as f64).sum(),
            _ => (0..ROWS).map(|row| dz(row * COLS + i)).sum(),
        };
        self.case(name, dt, "bwd", 3 * N as u64 + 4 * COLS as u64, &mut run, &reference)
    }
}

/// `name(p, ...)`: the op's name and its parameters, if it has any.
fn label(op: UnaryOp) -> String {
    let info = ops::UNARY_OPS.iter().find(|i| i.name == op.name()).expect("every op is in the table");
    let p = op.params();
    let args: Vec<String> = (0..info.params.len()).map(|k| format!("{}", p[k])).collect();
    if args.is_empty() { op.name().to_string() } else { format!("{}({})", op.name(), args.join(", ")) }
}

fn tour(dev: Device) -> Result<Vec<String>> {
    let seed = std::env::var("TOUR_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    println!("{} ({} SMs), 2^24 elements as [{ROWS}, {COLS}], TOUR_SEED={seed}", dev.name(), dev.sm_count());
    let flush = Tensor::zeros(&dev, &[FLUSH_ELEMS], DType::F32)?;
    let mut t = Tour { dev, flush, seed, draws: 0, copy_gbs: 0.0, failures: Vec::new() };

    // The ceiling: a device-to-device copy of the same size, timed the same way.
    let (x, _) = t.normal(DType::F32)?;
    let copy_ms = t.time(&mut || Ok(vec![x.try_clone()?]))?;
    drop(x);
    t.copy_gbs = 2.0 * (N * 4) as f64 / copy_ms / 1e6;
    println!("device-to-device copy: {:.1} us, {:.1} GB/s\n", copy_ms * 1e3, t.copy_gbs);
    println!("| op                     | dtype |   time us |     GB/s | % copy |   max err | check |");
    println!("|------------------------|-------|----------:|---------:|-------:|----------:|-------|");

    // Every op of the op table, forward and backward, with its parameters.
    let unary: Vec<(String, UnaryOp)> = UnaryOp::all().into_iter().map(|op| (label(op), op)).collect();
    let f32_ = DType::F32;
    for (name, op) in &unary {
        t.unary_fwd(name, *op, f32_)?;
    }
    for (name, op) in &unary {
        t.unary_bwd(name, *op, f32_)?;
    }
    for (name, op) in [("add", BinaryOp::Add), ("sub", BinaryOp::Sub), ("mul", BinaryOp::Mul), ("div", BinaryOp::Div)] {
        t.binary_fwd(name, op, f32_)?;
    }
    t.binary_bwd("mul", BinaryOp::Mul, f32_)?;
    t.binary_bwd("div", BinaryOp::Div, f32_)?;
    t.add_row_fwd(f32_)?;
    t.add_row_bwd(f32_)?;
    for (name, act) in [
        ("scale_bias_relu", Activation::Relu),
        ("scale_bias_gelu", Activation::Gelu),
        ("scale_bias_silu", Activation::Silu),
    ] {
        t.fused_fwd(name, act, f32_)?;
    }
    t.fused_bwd("scale_bias_gelu", Activation::Gelu, f32_)?;
    t.fused_bwd("scale_bias_silu", Activation::Silu, f32_)?;

    for &a in Activation::ALL {
        t.unary_fwd(&label(a.into()), a.into(), DType::BF16)?;
        t.unary_bwd(&label(a.into()), a.into(), DType::BF16)?;
    }
    for dt in [DType::BF16, DType::F16] {
        if dt == DType::F16 {
            t.unary_fwd("gelu", Activation::Gelu.into(), dt)?;
            t.unary_bwd("gelu", Activation::Gelu.into(), dt)?;
        }
        t.unary_fwd("exp", UnaryOp::Exp, dt)?;
        t.binary_fwd("add", BinaryOp::Add, dt)?;
        t.fused_fwd("scale_bias_silu", Activation::Silu, dt)?;
        t.fused_bwd("scale_bias_silu", Activation::Silu, dt)?;
    }
    Ok(t.failures)
}

fn main() {
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("elementwise_tour: no GPU, nothing to run: {e}");
            return;
        }
    };
    match tour(dev) {
        Ok(failures) if failures.is_empty() => println!("\nall checks passed"),
        Ok(failures) => {
            println!("\n{} check(s) FAILED: {}", failures.len(), failures.join(", "));
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("elementwise_tour: GPU error: {e}");
            std::process::exit(2);
        }
    }
}
