//! Trains a two-layer perceptron on generated data, on the GPU, with the library's kernels only:
//! `logits = Linear(GELU(Linear(x)))`, cross-entropy over 10 classes, AdamW (one fused kernel per
//! parameter). Prints the loss as it falls.
//!
//! ```text
//! cargo run --release --example mlp
//! cargo run --release --example mlp -- --trace mlp.json   # and a timeline of ten steps
//! ```
//!
//! The data: 4096 points of 64 features, N(0, 1), labelled by a random "teacher" network
//! (the argmax of `tanh(x T1) T2`), so that the task is learnable but not linear.
//!
//! The check: the same network, from the same initial weights, is computed on the CPU in f64
//! (forward, backward, AdamW) for the first steps. At every one of those steps the GPU's loss must
//! match the reference within a relative 1e-4, and, at step 0, every gradient element within
//! `1e-4` of the largest of its tensor: the f32 sums here have at most 4096 terms, whose error
//! bound `K u` is 2.4e-4 relative to the sum of magnitudes and in practice (random signs) about
//! `sqrt(K) u` = 4e-6. After the first AdamW step parameters are no longer compared
//! element by element: Adam divides by `sqrt(v)`, so a gradient element near zero, rounded
//! differently, may legitimately move its parameter by `lr` either way; the losses, which
//! depend on all of them, are compared instead. At the end the loss must have fallen below half
//! its initial value. Exits 1 if a check fails, 0 with a message when there is no GPU.
//!
//! With `--trace PATH`, ten steps after the checked ones are recorded (`Device::start_trace`):
//! each step, each layer's forward and backward and the optimizer as spans with their FLOPs and
//! bytes, every kernel, and the allocator's state, written to PATH as Chrome trace JSON (open it
//! in ui.perfetto.dev).

use kernels::device::Cost;
use kernels::ops::{self, Activation, AdamW, AdamWState, CrossEntropyOpts};
use kernels::{DType, Device, IndexTensor, Tensor};

// The f64 references the tests check against.
#[allow(dead_code)]
#[path = "../tests/common/reference.rs"]
mod reference;

const N: usize = 4096;
const D: usize = 64;
const H: usize = 256;
const C: usize = 10;
const STEPS: usize = 300;
const CHECKED_STEPS: usize = 5;
const TRACED_STEPS: usize = 10;

/// SplitMix64 and Box-Muller: reproducible data and initial weights.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u1, u2) = (1.0 - self.unit(), self.unit());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
    /// PyTorch's `nn.Linear` initialisation: uniform on `+-1/sqrt(fan_in)`.
    fn linear(&mut self, n: usize, fan_in: usize) -> Vec<f32> {
        let b = 1.0 / (fan_in as f64).sqrt();
        (0..n).map(|_| ((2.0 * self.unit() - 1.0) * b) as f32).collect()
    }
}

/// The network's parameters, in the order w1, b1, w2, b2 (PyTorch's layouts: w is [out, in]).
type Params<T> = [Vec<T>; 4];

/// f64 reference: loss and gradients of the mean cross-entropy.
fn reference(p: &Params<f64>, x: &[f32], y: &[i64]) -> (f64, Params<f64>) {
    let [w1, b1, w2, b2] = p;
    let gelu = |z: f64| 0.5 * z * (1.0 + libm::erf(z / std::f64::consts::SQRT_2));
    let gelu_d = |z: f64| {
        0.5 * (1.0 + libm::erf(z / std::f64::consts::SQRT_2))
            + z * (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt()
    };
    let mut g: Params<f64> = [vec![0.0; H * D], vec![0.0; H], vec![0.0; C * H], vec![0.0; C]];
    let mut loss = 0.0;
    let (mut z1, mut h1) = (vec![0.0; H], vec![0.0; H]);
    for n in 0..N {
        let xn = &x[n * D..(n + 1) * D];
        for j in 0..H {
            z1[j] = b1[j] + (0..D).map(|i| w1[j * D + i] * xn[i] as f64).sum::<f64>();
            h1[j] = gelu(z1[j]);
        }
        let logits: Vec<f64> = (0..C).map(|c| b2[c] + (0..H).map(|j| w2[c * H + j] * h1[j]).sum::<f64>()).collect();
        let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = mx + logits.iter().map(|l| (l - mx).exp()).sum::<f64>().ln();
        loss += lse - logits[y[n] as usize];
        // d loss / d logits = (softmax - onehot) / N.
        let dl: Vec<f64> =
            (0..C).map(|c| ((logits[c] - lse).exp() - if c == y[n] as usize { 1.0 } else { 0.0 }) / N as f64).collect();
        let mut dh = vec![0.0; H];
        for c in 0..C {
            g[3][c] += dl[c];
            for j in 0..H {
                g[2][c * H + j] += dl[c] * h1[j];
                dh[j] += dl[c] * w2[c * H + j];
            }
        }
        for j in 0..H {
            let dz = dh[j] * gelu_d(z1[j]);
            g[1][j] += dz;
            for i in 0..D {
                g[0][j * D + i] += dz * xn[i] as f64;
            }
        }
    }
    (loss / N as f64, g)
}

/// PyTorch's AdamW step in f64 (the moments kept per parameter): the tests' reference.
fn adamw_ref(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], cfg: &AdamW, t: u64) {
    for i in 0..p.len() {
        let s = reference::adamw(p[i], g[i], m[i], v[i], cfg, t);
        (p[i], m[i], v[i]) = (s.p, s.m, s.v);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let trace = match args.as_slice() {
        [] => None,
        [flag, path] if flag == "--trace" => Some(std::path::PathBuf::from(path)),
        _ => {
            eprintln!("usage: mlp [--trace PATH]");
            std::process::exit(2);
        }
    };
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no GPU ({e}): nothing to train");
            return;
        }
    };
    match run(&dev, trace.as_deref()) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("GPU error: {e}");
            std::process::exit(2);
        }
    }
}

/// A GEMM's cost: `2 m n k` FLOPs, and f32 operands of `m x k`, `k x n` and `m x n` read or
/// written once each.
fn gemm_cost(m: usize, n: usize, k: usize) -> Cost {
    Cost { flops: (2 * m * n * k) as u64, bytes: (4 * (m * k + k * n + m * n)) as u64 }
}

fn run(dev: &Device, trace: Option<&std::path::Path>) -> kernels::Result<bool> {
    let mut rng = Rng(2026);
    // The data and its teacher.
    let x: Vec<f32> = (0..N * D).map(|_| rng.normal() as f32).collect();
    let t1: Vec<f64> = (0..D * 32).map(|_| rng.normal()).collect();
    let t2: Vec<f64> = (0..32 * C).map(|_| rng.normal()).collect();
    let y: Vec<i64> = (0..N)
        .map(|n| {
            let h: Vec<f64> =
                (0..32).map(|j| (0..D).map(|i| x[n * D + i] as f64 * t1[i * 32 + j]).sum::<f64>().tanh()).collect();
            let s: Vec<f64> = (0..C).map(|c| (0..32).map(|j| h[j] * t2[j * C + c]).sum()).collect();
            (0..C).max_by(|&a, &b| s[a].total_cmp(&s[b])).unwrap() as i64
        })
        .collect();
    let init: Params<f32> = [rng.linear(H * D, D), rng.linear(H, D), rng.linear(C * H, H), rng.linear(C, H)];
    let shapes: [&[usize]; 4] = [&[H, D], &[H], &[C, H], &[C]];

    let xt = Tensor::from_slice(dev, &x, &[N, D])?;
    let yt = IndexTensor::from_slice(dev, &y, &[N])?;
    let one = Tensor::full(dev, &[], DType::F32, 1.0)?;
    let mut params: Vec<Tensor> =
        init.iter().zip(shapes).map(|(v, s)| Tensor::from_slice(dev, v, s)).collect::<Result<_, _>>()?;
    let mut opt: Vec<AdamWState> = params.iter().map(AdamWState::new).collect::<Result<_, _>>()?;
    let cfg = AdamW { lr: 3e-3, ..AdamW::default() };

    let mut reference_params: Params<f64> = init.clone().map(|v| v.iter().map(|&a| a as f64).collect());
    let mut moments: Vec<(Vec<f64>, Vec<f64>)> =
        reference_params.iter().map(|p| (vec![0.0; p.len()], vec![0.0; p.len()])).collect();
    let mut ok = true;
    let mut first_loss = f32::NAN;
    let mut last_loss = f32::NAN;
    let t0 = std::time::Instant::now();
    let traced = CHECKED_STEPS..CHECKED_STEPS + TRACED_STEPS;
    for step in 0..STEPS {
        if trace.is_some() && step == traced.start {
            dev.start_trace()?;
        }
        let step_span = dev.trace_scope(&format!("step {step}"), Cost::default());
        // Forward: h = gelu(x W1^T + b1) (z1 kept for GELU's backward), logits = h W2^T + b2.
        let (h, s1) = {
            let _s = dev.trace_scope("linear 1 + gelu", gemm_cost(N, H, D));
            ops::linear_train(&xt, &params[0], Some(&params[1]), Activation::Gelu)?
        };
        let (logits, s2) = {
            let _s = dev.trace_scope("linear 2", gemm_cost(N, C, H));
            ops::linear_train(&h, &params[2], Some(&params[3]), Activation::Identity)?
        };
        let ce = Cost { bytes: (4 * N * C) as u64, flops: 0 };
        let (loss, saved) = {
            let _s = dev.trace_scope("cross-entropy", ce);
            ops::cross_entropy(&logits, &yt, CrossEntropyOpts::default())?
        };
        // Backward: dX and dW of each layer, two GEMMs each.
        let dlogits = {
            let _s = dev.trace_scope("cross-entropy backward", Cost { bytes: 2 * ce.bytes, flops: 0 });
            ops::cross_entropy_backward(&logits, &yt, &saved, &one)?
        };
        let twice = |c: Cost| Cost { flops: 2 * c.flops, bytes: 2 * c.bytes };
        let g2 = {
            let _s = dev.trace_scope("linear 2 backward", twice(gemm_cost(N, C, H)));
            ops::linear_backward(&h, &params[2], &logits, &s2, &dlogits, Some(&params[3]))?
        };
        let g1 = {
            let _s = dev.trace_scope("linear 1 backward", twice(gemm_cost(N, H, D)));
            ops::linear_backward(&xt, &params[0], &h, &s1, &g2.x, Some(&params[1]))?
        };
        let grads = [g1.weight, g1.bias.expect("bias"), g2.weight, g2.bias.expect("bias")];

        let l = loss.to_vec::<f32>()?[0];
        if step == 0 {
            first_loss = l;
        }
        last_loss = l;
        if step < CHECKED_STEPS {
            let (lref, gref) = reference(&reference_params, &x, &y);
            let rel = ((l as f64 - lref) / lref).abs();
            let good = rel <= 1e-4;
            ok &= good;
            println!(
                "step {step:>3}  loss {l:.6}  (f64 reference {lref:.6}, relative difference {rel:.1e}{})",
                if good { "" } else { "  MISMATCH" }
            );
            if step == 0 {
                for (k, (g, gr)) in grads.iter().zip(&gref).enumerate() {
                    let got = g.to_vec::<f32>()?;
                    let scale = gr.iter().fold(0.0f64, |a, &b| a.max(b.abs()));
                    let worst = got.iter().zip(gr).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max) / scale;
                    let good = worst <= 1e-4;
                    ok &= good;
                    println!(
                        "         gradient {}: max |gpu - f64| / max |f64| = {worst:.1e}{}",
                        ["w1", "b1", "w2", "b2"][k],
                        if good { "" } else { "  MISMATCH" }
                    );
                }
            }
            for (k, gr) in gref.iter().enumerate() {
                let (m, v) = &mut moments[k];
                adamw_ref(&mut reference_params[k], gr, m, v, &cfg, step as u64 + 1);
            }
        } else if step % 25 == 0 || step + 1 == STEPS {
            println!("step {step:>3}  loss {l:.6}");
        }
        {
            // AdamW reads p, g, m, v and writes p, m, v: seven f32 streams a parameter.
            let n: usize = params.iter().map(Tensor::numel).sum();
            let _s = dev.trace_scope("AdamW", Cost { bytes: (7 * 4 * n) as u64, flops: 0 });
            for ((p, g), st) in params.iter_mut().zip(&grads).zip(&mut opt) {
                st.update(p, g, &cfg)?;
            }
        }
        drop(step_span);
        if let Some(path) = trace.filter(|_| step + 1 == traced.end) {
            let t = dev.stop_trace()?;
            t.write_chrome_json(path)?;
            println!(
                "trace of steps {}..{}: {} kernels, {:.1} us of kernel time a step, written to {}",
                traced.start,
                traced.end,
                t.kernels.len(),
                t.kernels.iter().map(|k| k.dur_us).sum::<f64>() / TRACED_STEPS as f64,
                path.display()
            );
        }
    }
    dev.synchronize()?;
    let secs = t0.elapsed().as_secs_f64();
    let fell = last_loss < 0.5 * first_loss;
    ok &= fell;
    println!(
        "{STEPS} steps in {secs:.2} s ({:.2} ms a step, the CPU reference of the first {CHECKED_STEPS} included); loss {first_loss:.4} -> {last_loss:.4}{}",
        secs * 1e3 / STEPS as f64,
        if fell { "" } else { "  (did not halve: FAILED)" }
    );
    println!("{}", if ok { "all checks passed" } else { "CHECKS FAILED" });
    Ok(ok)
}
