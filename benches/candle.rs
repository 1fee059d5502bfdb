//! The candle custom ops (`kernels::candle`, feature `candle`) against candle's own kernels on
//! the same ops and shapes, forward and forward + backward (candle's autograd both ways).
//!
//! ```text
//! cargo bench --features candle --bench candle
//! KERNELS_BENCH_JSON=candle.json cargo bench --features candle --bench candle -- softmax
//! ```
//!
//! candle's side is what a candle user writes with candle-core: its unary kernels for GELU
//! (erf) and SiLU, its matmul (cuBLAS) and broadcast add for the linear layer, and for softmax,
//! the norms and cross-entropy the compositions of candle-core ops that candle-nn's `softmax`,
//! `layer_norm_slow`, `rms_norm_slow` and `loss::cross_entropy` are (the norms widened to f32
//! inside, as candle-nn's are). candle-nn's fused softmax and norm kernels
//! (`softmax_last_dim`, `rms_norm`, `layer_norm`) are not here: candle-nn is no dependency of
//! this crate, and they have no backward of their own.
//!
//! Timing as the other benches (do_bench's way): each run after a 256 MB write that flushes the
//! L2 (50 MB on an H100), CUDA events on candle's stream around the run, at least 25 ms and 3
//! runs of warm-up, then runs until 300 ms of GPU time or 200 runs (at least 10); the median.
//! "fwd+bwd" is the forward and `backward()` of its output (seeded with ones), for every input.
//! Names: `candle/<impl>/<dtype>/<dir>/<op>/<shape>`, impl `candle` or `kernels`; the JSON (with
//! `KERNELS_BENCH_JSON`) has one record per name. A first argument keeps the names containing it.

use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::{D, DType, Device, Tensor, Var};
use kernels::candle as kc;
use kernels::ops::Activation;
use std::time::{Duration, Instant};

type Res<T> = candle_core::Result<T>;

/// One run of an op: its outputs (dropped after the end event).
type RunFn = Box<dyn Fn() -> Res<Vec<Tensor>>>;

fn main() {
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => return println!("candle bench skipped: no GPU ({e})"),
    };
    if let Err(e) = run(&dev, filter.as_deref()) {
        eprintln!("candle bench failed: {e}");
        std::process::exit(1);
    }
}

/// The median GPU time (ms) of `f` on `dev`'s stream, each run after an L2 flush.
fn time(dev: &Device, flush: &Tensor, f: &RunFn) -> Res<f64> {
    let stream = dev.as_cuda_device()?.cuda_stream();
    let cu = |e| candle_core::Error::Msg(format!("CUDA event: {e:?}"));
    let t0 = Instant::now();
    let mut k = 0;
    while k < 3 || t0.elapsed() < Duration::from_millis(25) {
        flush.zero_set()?;
        drop(f()?);
        k += 1;
    }
    dev.synchronize()?;
    let mut samples = vec![];
    let mut total = 0.0;
    while samples.len() < 10 || (total < 300.0 && samples.len() < 200) {
        // Bursts of 10 without synchronising, then the events are read.
        let mut pairs = Vec::with_capacity(10);
        for _ in 0..10 {
            flush.zero_set()?;
            let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(cu)?;
            let out = f()?;
            let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(cu)?;
            drop(out);
            pairs.push((start, end));
        }
        for (s, e) in &pairs {
            let ms = s.elapsed_ms(e).map_err(cu)? as f64;
            samples.push(ms);
            total += ms;
        }
    }
    samples.sort_by(f64::total_cmp);
    let m = samples.len() / 2;
    Ok(if samples.len() % 2 == 1 { samples[m] } else { (samples[m - 1] + samples[m]) / 2.0 })
}

fn randn(dev: &Device, shape: &[usize], dt: DType) -> Res<Tensor> {
    Tensor::randn(0f32, 1f32, shape, dev)?.to_dtype(dt)
}

/// `f` on variables of `inputs` (cloned), forward only or forward and backward.
fn with_grad(inputs: Vec<Tensor>, bwd: bool, f: impl Fn(&[Tensor]) -> Res<Tensor> + 'static) -> Res<RunFn> {
    let vars: Vec<Tensor> =
        inputs.iter().map(|t| Var::from_tensor(t).map(|v| v.as_tensor().clone())).collect::<Res<_>>()?;
    Ok(Box::new(move || {
        let y = f(&vars)?;
        if bwd {
            let g = y.backward()?;
            // The gradients, so that they are freed after the end event.
            let mut out: Vec<Tensor> = vars.iter().filter_map(|v| g.get(v).cloned()).collect();
            out.push(y);
            Ok(out)
        } else {
            Ok(vec![y])
        }
    }))
}

const EPS: f64 = 1e-5;

fn softmax_ref(x: &Tensor, log: bool) -> Res<Tensor> {
    let s = x.broadcast_sub(&x.max_keepdim(D::Minus1)?)?;
    if log {
        s.broadcast_sub(&s.exp()?.sum_keepdim(D::Minus1)?.log()?)
    } else {
        let p = s.exp()?;
        p.broadcast_div(&p.sum_keepdim(D::Minus1)?)
    }
}

/// candle-nn's `layer_norm_slow` / `rms_norm_slow`: in f32 for bf16 and f16.
fn norm_ref(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Res<Tensor> {
    let dt = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let hidden = x.dim(D::Minus1)? as f64;
    let x = match b {
        Some(_) => x.broadcast_sub(&(x.sum_keepdim(D::Minus1)? / hidden)?)?,
        None => x,
    };
    let norm = (x.sqr()?.sum_keepdim(D::Minus1)? / hidden)?;
    let y = x.broadcast_div(&(norm + EPS)?.sqrt()?)?.to_dtype(dt)?.broadcast_mul(w)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// candle-nn's `loss::cross_entropy`: log-softmax, then the mean negative log-likelihood.
fn cross_entropy_ref(x: &Tensor, t: &Tensor) -> Res<Tensor> {
    let n = x.dim(0)? as f64;
    softmax_ref(x, true)?.gather(&t.unsqueeze(1)?, 1)?.sum_all()?.neg()? / n
}

struct Case {
    op: &'static str,
    dt: DType,
    shape: String,
    /// candle's and ours, for forward (`false`) or forward + backward (`true`).
    build: Box<dyn Fn(bool, bool) -> Res<RunFn>>,
}

fn cases(dev: &Device) -> Vec<Case> {
    let mut v = vec![];
    let rows_shapes = [(4096, 4096), (8192, 32000)];
    for dt in [DType::F32, DType::BF16] {
        for (op, act) in [("gelu", Activation::Gelu), ("silu", Activation::Silu)] {
            let d = dev.clone();
            v.push(Case {
                op,
                dt,
                shape: "4096x4096".into(),
                build: Box::new(move |ours, bwd| {
                    let x = randn(&d, &[4096, 4096], dt)?;
                    with_grad(vec![x], bwd, move |t| match (ours, act) {
                        (true, _) => kc::activation(&t[0], act),
                        (false, Activation::Gelu) => t[0].gelu_erf(),
                        (false, _) => t[0].silu(),
                    })
                }),
            });
        }
        for (r, c) in rows_shapes {
            let d = dev.clone();
            v.push(Case {
                op: "softmax",
                dt,
                shape: format!("{r}x{c}"),
                build: Box::new(move |ours, bwd| {
                    let x = randn(&d, &[r, c], dt)?;
                    with_grad(vec![x], bwd, move |t| if ours { kc::softmax(&t[0]) } else { softmax_ref(&t[0], false) })
                }),
            });
            for (op, rms) in [("layer_norm", false), ("rms_norm", true)] {
                let d = dev.clone();
                v.push(Case {
                    op,
                    dt,
                    shape: format!("{r}x{c}"),
                    build: Box::new(move |ours, bwd| {
                        let x = randn(&d, &[r, c], dt)?;
                        let w = randn(&d, &[c], dt)?;
                        let b = randn(&d, &[c], dt)?;
                        let ins = if rms { vec![x, w] } else { vec![x, w, b] };
                        with_grad(ins, bwd, move |t| match (ours, t.get(2)) {
                            (true, Some(b)) => kc::layer_norm(&t[0], &t[1], b, EPS as f32),
                            (true, None) => kc::rms_norm(&t[0], &t[1], EPS as f32),
                            (false, b) => norm_ref(&t[0], &t[1], b),
                        })
                    }),
                });
            }
        }
        let d = dev.clone();
        v.push(Case {
            op: "cross_entropy",
            dt,
            shape: "8192x32000".into(),
            build: Box::new(move |ours, bwd| {
                let x = randn(&d, &[8192, 32000], dt)?;
                let t: Vec<i64> = (0..8192).map(|i| (i * 7919) % 32000).collect();
                let t = Tensor::from_vec(t, 8192, &Device::Cpu)?.to_device(&d)?;
                with_grad(
                    vec![x],
                    bwd,
                    move |x| {
                        if ours { kc::cross_entropy(&x[0], &t) } else { cross_entropy_ref(&x[0], &t) }
                    },
                )
            }),
        });
    }
    let d = dev.clone();
    v.push(Case {
        op: "linear",
        dt: DType::BF16,
        shape: "4096x4096x4096".into(),
        build: Box::new(move |ours, bwd| {
            let dt = DType::BF16;
            let (x, w, b) = (randn(&d, &[4096, 4096], dt)?, randn(&d, &[4096, 4096], dt)?, randn(&d, &[4096], dt)?);
            with_grad(vec![x, w, b], bwd, move |t| {
                if ours { kc::linear(&t[0], &t[1], Some(&t[2])) } else { t[0].matmul(&t[1].t()?)?.broadcast_add(&t[2]) }
            })
        }),
    });
    v
}

fn run(dev: &Device, filter: Option<&str>) -> Res<()> {
    // 256 MB, written before every timed run.
    let flush = Tensor::zeros(1usize << 26, DType::F32, dev)?;
    println!("| op | dtype | shape | direction | candle (ms) | kernels (ms) | candle / kernels |");
    println!("|---|---|---|---|---:|---:|---:|");
    let mut records = vec![];
    for case in cases(dev) {
        for bwd in [false, true] {
            let dir = if bwd { "fwd+bwd" } else { "fwd" };
            let dname = format!("{:?}", case.dt).to_lowercase();
            let name = |imp: &str| format!("candle/{imp}/{dname}/{dir}/{}/{}", case.op, case.shape);
            if filter.is_some_and(|f| !name("candle").contains(f) && !name("kernels").contains(f)) {
                continue;
            }
            let mut ms = [0.0; 2];
            for (i, ours) in [false, true].into_iter().enumerate() {
                let f = (case.build)(ours, bwd)?;
                ms[i] = time(dev, &flush, &f)?;
                drop(f);
                let imp = if ours { "kernels" } else { "candle" };
                records.push(format!(
                    "  {{\"name\": \"{}\", \"impl\": \"{imp}\", \"op\": \"{}\", \"dtype\": \"{dname}\", \
                     \"shape\": \"{}\", \"direction\": \"{dir}\", \"ms\": {}}}",
                    name(imp),
                    case.op,
                    case.shape,
                    ms[i]
                ));
            }
            println!(
                "| {} | {dname} | {} | {dir} | {:.4} | {:.4} | {:.2} |",
                case.op,
                case.shape,
                ms[0],
                ms[1],
                ms[0] / ms[1]
            );
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
