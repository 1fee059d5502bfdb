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
use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI, PI};

const N: usize = 1 << 24;
const COLS: usize = 1024;
const ROWS: usize = N / COLS;
const STRIDE: usize = 16;
const EDGE: usize = 4096;
const RUNS: usize = 20;
const FLUSH_ELEMS: usize = 1 << 26;

// --- the CPU reference, in f64, following PyTorch's definitions --------------------------------

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn gelu_tanh_inner(x: f64) -> f64 {
    (2.0 / PI).sqrt() * (x + 0.044715 * x * x * x)
}

fn act_f(a: Activation, x: f64) -> f64 {
    match a {
        Activation::Identity => x,
        Activation::Relu => {
            if x > 0.0 {
                x
            } else {
                0.0
            }
        }
        Activation::LeakyRelu { negative_slope } => {
            if x > 0.0 {
                x
            } else {
                x * negative_slope as f64
            }
        }
        Activation::Sigmoid => sigmoid(x),
        Activation::Tanh => x.tanh(),
        Activation::Gelu => 0.5 * x * (1.0 + libm::erf(x * FRAC_1_SQRT_2)),
        Activation::GeluTanh => 0.5 * x * (1.0 + gelu_tanh_inner(x).tanh()),
        Activation::Silu => x * sigmoid(x),
        Activation::Mish => x * x.exp().ln_1p().tanh(),
        Activation::Softplus { beta, threshold } => {
            let (b, t) = (beta as f64, threshold as f64);
            if b * x > t { x } else { (b * x).exp().ln_1p() / b }
        }
    }
}

/// d act / dx.
fn act_d(a: Activation, x: f64) -> f64 {
    match a {
        Activation::Identity => 1.0,
        Activation::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        Activation::LeakyRelu { negative_slope } => {
            if x > 0.0 {
                1.0
            } else {
                negative_slope as f64
            }
        }
        Activation::Sigmoid => sigmoid(x) * (1.0 - sigmoid(x)),
        Activation::Tanh => 1.0 - x.tanh() * x.tanh(),
        Activation::Gelu => 0.5 * (1.0 + libm::erf(x * FRAC_1_SQRT_2)) + x * (-0.5 * x * x).exp() / (2.0 * PI).sqrt(),
        Activation::GeluTanh => {
            let t = gelu_tanh_inner(x).tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (2.0 / PI).sqrt() * (1.0 + 3.0 * 0.044715 * x * x)
        }
        Activation::Silu => {
            let s = sigmoid(x);
            s * (1.0 + x * (1.0 - s))
        }
        Activation::Mish => {
            let t = x.exp().ln_1p().tanh();
            t + x * sigmoid(x) * (1.0 - t * t)
        }
        Activation::Softplus { beta, threshold } => {
            let (b, t) = (beta as f64, threshold as f64);
            if b * x > t { 1.0 } else { sigmoid(b * x) }
        }
    }
}

fn unary_f(op: UnaryOp, x: f64) -> f64 {
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Abs => x.abs(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Expm1 => x.exp_m1(),
        UnaryOp::Log1p => x.ln_1p(),
        UnaryOp::Erf => libm::erf(x),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Pow(p) => x.powf(p as f64),
        UnaryOp::Clamp { min, max } => x.max(min as f64).min(max as f64),
        UnaryOp::AddScalar(s) => x + s as f64,
        UnaryOp::SubScalar(s) => x - s as f64,
        UnaryOp::MulScalar(s) => x * s as f64,
        UnaryOp::DivScalar(s) => x / s as f64,
        UnaryOp::Act(a) => act_f(a, x),
    }
}

/// d op / dx.
fn unary_d(op: UnaryOp, x: f64) -> f64 {
    match op {
        UnaryOp::Neg => -1.0,
        UnaryOp::Abs => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }
        UnaryOp::Exp | UnaryOp::Expm1 => x.exp(),
        UnaryOp::Log => 1.0 / x,
        UnaryOp::Log1p => 1.0 / (1.0 + x),
        UnaryOp::Erf => FRAC_2_SQRT_PI * (-x * x).exp(),
        UnaryOp::Sqrt => 0.5 / x.sqrt(),
        UnaryOp::Rsqrt => -0.5 / (x * x.sqrt()),
        UnaryOp::Pow(p) => {
            let p = p as f64;
            if p == 0.0 { 0.0 } else { p * x.powf(p - 1.0) }
        }
        UnaryOp::Clamp { min, max } => {
            if x >= min as f64 && x <= max as f64 {
                1.0
            } else {
                0.0
            }
        }
        UnaryOp::AddScalar(_) | UnaryOp::SubScalar(_) => 1.0,
        UnaryOp::MulScalar(s) => s as f64,
        UnaryOp::DivScalar(s) => 1.0 / s as f64,
        UnaryOp::Act(a) => act_d(a, x),
    }
}

fn binary_f(op: BinaryOp, a: f64, b: f64) -> f64 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
    }
}

/// (dL/da, dL/db) given dL/dout = g.
fn binary_d(op: BinaryOp, a: f64, b: f64, g: f64) -> (f64, f64) {
    match op {
        BinaryOp::Add => (g, g),
        BinaryOp::Sub => (g, -g),
        BinaryOp::Mul => (g * b, g * a),
        BinaryOp::Div => (g / b, -g * a / (b * b)),
    }
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
        let positive = matches!(op, UnaryOp::Log | UnaryOp::Log1p | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Pow(_));
        let (x, xh) = if positive { self.positive(dt)? } else { self.normal(dt)? };
        let mut run = || Ok(vec![ops::unary(&x, op)?]);
        self.case(name, dt, "fwd", 2 * N as u64, &mut run, &|_, i| unary_f(op, xh[i] as f64))
    }

    fn unary_bwd(&mut self, name: &str, op: UnaryOp, dt: DType) -> Result<()> {
        let positive = matches!(op, UnaryOp::Log | UnaryOp::Log1p | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Pow(_));
        let (x, xh) = if positive { self.positive(dt)? } else { self.normal(dt)? };
        let (g, gh) = self.normal(dt)?;
        let mut run = || Ok(vec![ops::unary_backward(&x, &g, op)?]);
        self.case(name, dt, "bwd", 3 * N as u64, &mut run, &|_, i| gh[i] as f64 * unary_d(op, xh[i] as f64))
    }

    /// The second operand: positive for `div` (the normal draws include exact zeros, whose
    /// quotients are infinite), normal otherwise.
    fn operand(&mut self, op: BinaryOp, dt: DType) -> Result<(Tensor, Vec<f32>)> {
        if op == BinaryOp::Div { self.positive(dt) } else { self.normal(dt) }
    }

    fn binary_fwd(&mut self, name: &str, op: BinaryOp, dt: DType) -> Result<()> {
        let ((a, ah), (b, bh)) = (self.normal(dt)?, self.operand(op, dt)?);
        let mut run = || Ok(vec![ops::binary(&a, &b, op)?]);
        self.case(name, dt, "fwd", 3 * N as u64, &mut run, &|_, i| binary_f(op, ah[i] as f64, bh[i] as f64))
    }

    fn binary_bwd(&mut self, name: &str, op: BinaryOp, dt: DType) -> Result<()> {
        let ((a, ah), (b, bh), (g, gh)) = (self.normal(dt)?, self.operand(op, dt)?, self.normal(dt)?);
        let mut run = || {
            let (ga, gb) = ops::binary_backward(&a, &b, &g, op)?;
            Ok(vec![ga, gb])
        };
        let reference = |k: usize, i: usize| {
            let (da, db) = binary_d(op, ah[i] as f64, bh[i] as f64, gh[i] as f64);
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
            act_f(act, xh[i] as f64 * sh[c] as f64 + bh[c] as f64)
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
            gh[i] as f64 * act_d(act, xh[i] as f64 * sh[c] as f64 + bh[c] as f64)
        };
        let reference = |k: usize, i: usize| match k {
            0 => dz(i) * sh[i % COLS] as f64,
            1 => (0..ROWS).map(|row| dz(row * COLS + i) * xh[row * COLS + i] as f64).sum(),
            _ => (0..ROWS).map(|row| dz(row * COLS + i)).sum(),
        };
        self.case(name, dt, "bwd", 3 * N as u64 + 4 * COLS as u64, &mut run, &reference)
    }
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

    let unary: [(&str, UnaryOp); 25] = [
        ("neg", UnaryOp::Neg),
        ("abs", UnaryOp::Abs),
        ("exp", UnaryOp::Exp),
        ("log", UnaryOp::Log),
        ("expm1", UnaryOp::Expm1),
        ("log1p", UnaryOp::Log1p),
        ("erf", UnaryOp::Erf),
        ("sqrt", UnaryOp::Sqrt),
        ("rsqrt", UnaryOp::Rsqrt),
        ("pow(3)", UnaryOp::Pow(3.0)),
        ("clamp(-0.5, 0.5)", UnaryOp::Clamp { min: -0.5, max: 0.5 }),
        ("add_scalar(1.5)", UnaryOp::AddScalar(1.5)),
        ("sub_scalar(1.5)", UnaryOp::SubScalar(1.5)),
        ("mul_scalar(1.5)", UnaryOp::MulScalar(1.5)),
        ("div_scalar(1.5)", UnaryOp::DivScalar(1.5)),
        ("identity", Activation::Identity.into()),
        ("relu", Activation::Relu.into()),
        ("leaky_relu", Activation::LEAKY_RELU.into()),
        ("sigmoid", Activation::Sigmoid.into()),
        ("tanh", Activation::Tanh.into()),
        ("gelu", Activation::Gelu.into()),
        ("gelu_tanh", Activation::GeluTanh.into()),
        ("silu", Activation::Silu.into()),
        ("mish", Activation::Mish.into()),
        ("softplus", Activation::SOFTPLUS.into()),
    ];
    let f32_ = DType::F32;
    for &(name, op) in &unary {
        t.unary_fwd(name, op, f32_)?;
    }
    let bwd = [
        "erf",
        "rsqrt",
        "pow(3)",
        "clamp(-0.5, 0.5)",
        "relu",
        "sigmoid",
        "tanh",
        "gelu",
        "gelu_tanh",
        "silu",
        "mish",
        "softplus",
    ];
    for &(name, op) in unary.iter().filter(|(n, _)| bwd.contains(n)) {
        t.unary_bwd(name, op, f32_)?;
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

    for dt in [DType::BF16, DType::F16] {
        t.unary_fwd("gelu", Activation::Gelu.into(), dt)?;
        t.unary_bwd("gelu", Activation::Gelu.into(), dt)?;
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
