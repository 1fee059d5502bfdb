//! Row-operation benchmarks: softmax, layer norm and RMS norm (forward and backward) on the four
//! standard shapes and a small one, the residual add fused with layer and RMS norm (forward, and
//! backward with the residual stream's gradient) on LLM shapes, log-softmax, cross-entropy forward +
//! backward at 8192 x 32000 and 8192 x 128256 (two-pass and one-pass), the fused linear +
//! cross-entropy at 8192 x 4096 -> 128256, sums (whole tensor, along rows, and over the rows per column at
//! 8192 x 4096: a linear layer's bias gradient), and transpose. Timed by the
//! shared harness (`benches/harness`: do_bench's method, L2 flushed before every run, medians);
//! `benches/torch_rows.py` times PyTorch on the same cases under the same names.
//!
//! ```text
//! cargo bench --bench rows                         # everything
//! cargo bench --bench rows -- 'softmax'            # a regex over the names
//! KERNELS_BENCH_JSON=rows.json cargo bench --bench rows
//! KERNELS_BENCH_SHAPES=4092x32768,4096x32768 cargo bench --bench rows -- 'f32/fwd/layer_norm'
//! ```
//!
//! `KERNELS_BENCH_SHAPES` (comma-separated `ROWSxCOLS`) replaces the suite's shapes for softmax,
//! the norms and transpose (f32 and bf16 at each), for studies of one kernel across shapes;
//! `benches/torch_rows.py` reads it too.
//!
//! Names: `rows/<dtype>/<fwd|bwd|fwdbwd>/<op>@<rows>x<cols>/<rows*cols>`. GB/s counts each
//! input read once and each output written once: softmax forward 2N elements, backward 3N (y and
//! grad in, grad_x out); the norms likewise plus their weight, bias and per-row statistics;
//! cross-entropy forward + backward 3N (logits read by each, the gradient written), one-pass 2N
//! (read once, the gradient written); sums N; transpose 2N; the fused add and norm forward 4N
//! (x and the residual in, h and y out), backward 4N (h, grad and dh in, the input's gradient
//! out), each with its parameters and statistics. The fused linear + cross-entropy
//! (`linear_cross_entropy@<rows>x<classes>`, hidden size [`LCE_HIDDEN`]) counts the hidden states
//! and the weight read and their gradients written; its time and peak memory are the point.

mod harness;

use harness::{Case, Run, dtype_name};
use kernels::ops::{self, CrossEntropyOnePassOpts, CrossEntropyOpts, LinearCrossEntropyOpts, ReduceOp};
use kernels::{DType, Device, IndexTensor, Result, Tensor};

/// The suite's shapes, and a small one.
const SHAPES: [(usize, usize); 5] = [(16384, 4096), (65536, 1024), (4096, 32768), (262144, 128), (64, 1024)];

/// The shapes of the fused residual add and norm: Llama 3 8B's 16384 tokens of 4096, and 8192
/// of 5120 (Llama 2 13B's width).
const ADD_NORM_SHAPES: [(usize, usize); 2] = [(16384, 4096), (8192, 5120)];

/// The hidden size of the fused linear + cross-entropy case (Llama 3 8B's).
const LCE_HIDDEN: usize = 4096;

#[derive(Clone, Copy)]
enum Op {
    Softmax,
    LogSoftmax,
    LayerNorm,
    RmsNorm,
    AddLayerNorm,
    AddRmsNorm,
    CrossEntropy,
    CrossEntropyOnePass,
    LinearCrossEntropy,
    SumAll,
    SumRows,
    SumCols,
    Transpose,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Softmax => "softmax",
            Op::LogSoftmax => "log_softmax",
            Op::LayerNorm => "layer_norm",
            Op::RmsNorm => "rms_norm",
            Op::AddLayerNorm => "add_layer_norm",
            Op::AddRmsNorm => "add_rms_norm",
            Op::CrossEntropy => "cross_entropy",
            Op::CrossEntropyOnePass => "cross_entropy_one_pass",
            Op::LinearCrossEntropy => "linear_cross_entropy",
            Op::SumAll => "sum",
            Op::SumRows => "sum_rows",
            Op::SumCols => "sum_cols",
            Op::Transpose => "transpose",
        }
    }
}

fn case(op: Op, dir: &'static str, dt: DType, rows: usize, cols: usize) -> Case {
    let n = rows * cols;
    let s = dt.size() as u64;
    let (n64, r64, c64) = (n as u64, rows as u64, cols as u64);
    let bytes = match (op, dir) {
        (Op::Softmax | Op::LogSoftmax, "fwd") => 2 * n64 * s,
        (Op::Softmax | Op::LogSoftmax, _) => 3 * n64 * s,
        // x in, y out, weight and bias in, mean and rstd out (f32).
        (Op::LayerNorm, "fwd") => (2 * n64 + 2 * c64) * s + 8 * r64,
        (Op::RmsNorm, "fwd") => (2 * n64 + c64) * s + 4 * r64,
        // x, grad in, grad_x out, weight in, statistics in, weight and bias gradients out.
        (Op::LayerNorm, _) => (3 * n64 + 3 * c64) * s + 8 * r64,
        (Op::RmsNorm, _) => (3 * n64 + 2 * c64) * s + 4 * r64,
        // x and the residual in, h and y out, weight (and bias) in, statistics out.
        (Op::AddLayerNorm, "fwd") => (4 * n64 + 2 * c64) * s + 8 * r64,
        (Op::AddRmsNorm, "fwd") => (4 * n64 + c64) * s + 4 * r64,
        // h, grad and dh in, the input's gradient out, weight in, its gradients out, statistics in.
        (Op::AddLayerNorm, _) => (4 * n64 + 3 * c64) * s + 8 * r64,
        (Op::AddRmsNorm, _) => (4 * n64 + 2 * c64) * s + 4 * r64,
        (Op::CrossEntropy, _) => 3 * n64 * s + 8 * r64,
        (Op::CrossEntropyOnePass, _) => 2 * n64 * s + 8 * r64,
        (Op::LinearCrossEntropy, _) => 2 * (r64 + c64) * LCE_HIDDEN as u64 * s + 8 * r64,
        (Op::SumAll | Op::SumRows | Op::SumCols, _) => n64 * s,
        (Op::Transpose, _) => 2 * n64 * s,
    };
    let opname = format!("{}@{rows}x{cols}", op.name());
    Case {
        name: format!("{}/{dir}/{opname}/{n}", dtype_name(dt)),
        op: opname,
        dtype: dtype_name(dt),
        n,
        dir,
        bytes,
        build: Box::new(move |dev, seed| build(dev, op, dir, dt, rows, cols, seed)),
    }
}

fn build(dev: &Device, op: Op, dir: &str, dt: DType, rows: usize, cols: usize, seed: u64) -> Result<Run> {
    let targets = || {
        let t: Vec<i64> = (0..rows as u64).map(|i| ((i * 2654435761 + seed) % cols as u64) as i64).collect();
        IndexTensor::from_slice(dev, &t, &[rows])
    };
    if let Op::LinearCrossEntropy = op {
        // No [rows, cols] input: the point is never to hold the logits.
        let h = Tensor::rand_normal(dev, &[rows, LCE_HIDDEN], dt, 0.0, 1.0, seed)?;
        let w = Tensor::rand_normal(dev, &[cols, LCE_HIDDEN], dt, 0.0, 0.02, seed + 1)?;
        let t = targets()?;
        return Ok(Box::new(move || {
            let o = ops::linear_cross_entropy(&h, &w, &t, LinearCrossEntropyOpts::default())?;
            Ok(vec![o.loss, o.hidden_grad, o.weight_grad])
        }));
    }
    let x = Tensor::rand_normal(dev, &[rows, cols], dt, 0.0, 1.0, seed)?;
    let g = || Tensor::rand_normal(dev, &[rows, cols], dt, 0.0, 1.0, seed + 1);
    let w = Tensor::rand_normal(dev, &[cols], dt, 1.0, 0.1, seed + 2)?;
    let b = Tensor::rand_normal(dev, &[cols], dt, 0.0, 0.1, seed + 3)?;
    let fwd = dir == "fwd";
    Ok(match op {
        Op::Softmax | Op::LogSoftmax => {
            let log = matches!(op, Op::LogSoftmax);
            if fwd {
                Box::new(move || Ok(vec![if log { ops::log_softmax(&x)? } else { ops::softmax(&x)? }]))
            } else {
                let (y, g) = (if log { ops::log_softmax(&x)? } else { ops::softmax(&x)? }, g()?);
                Box::new(move || {
                    Ok(vec![if log { ops::log_softmax_backward(&y, &g)? } else { ops::softmax_backward(&y, &g)? }])
                })
            }
        }
        Op::LayerNorm | Op::RmsNorm => {
            let layer = matches!(op, Op::LayerNorm);
            let eps = 1e-5;
            let f = move |x: &Tensor, w: &Tensor, b: &Tensor| {
                if layer { ops::layer_norm(x, Some(w), Some(b), eps) } else { ops::rms_norm(x, Some(w), eps) }
            };
            if fwd {
                Box::new(move || {
                    let (y, st) = f(&x, &w, &b)?;
                    Ok([Some(y), st.mean, Some(st.rstd)].into_iter().flatten().collect())
                })
            } else {
                let (_, st) = f(&x, &w, &b)?;
                let g = g()?;
                Box::new(move || {
                    let gr = if layer {
                        ops::layer_norm_backward(&x, Some(&w), Some(&b), &st, &g)?
                    } else {
                        ops::rms_norm_backward(&x, Some(&w), &st, &g)?
                    };
                    Ok([Some(gr.x), gr.weight, gr.bias].into_iter().flatten().collect())
                })
            }
        }
        Op::AddLayerNorm | Op::AddRmsNorm => {
            let layer = matches!(op, Op::AddLayerNorm);
            let eps = 1e-5;
            let res = Tensor::rand_normal(dev, &[rows, cols], dt, 0.0, 1.0, seed + 4)?;
            let f = move |x: &Tensor, r: &Tensor, w: &Tensor, b: &Tensor| {
                if layer {
                    ops::add_layer_norm(x, r, Some(w), Some(b), eps)
                } else {
                    ops::add_rms_norm(x, r, Some(w), eps)
                }
            };
            if fwd {
                Box::new(move || {
                    let o = f(&x, &res, &w, &b)?;
                    Ok([Some(o.y), Some(o.h), o.stats.mean, Some(o.stats.rstd)].into_iter().flatten().collect())
                })
            } else {
                let o = f(&x, &res, &w, &b)?;
                let (g, dh) = (g()?, Tensor::rand_normal(dev, &[rows, cols], dt, 0.0, 1.0, seed + 5)?);
                Box::new(move || {
                    let gr = if layer {
                        ops::add_layer_norm_backward(&o.h, Some(&w), Some(&b), &o.stats, &g, Some(&dh))?
                    } else {
                        ops::add_rms_norm_backward(&o.h, Some(&w), &o.stats, &g, Some(&dh))?
                    };
                    Ok([Some(gr.x), gr.weight, gr.bias].into_iter().flatten().collect())
                })
            }
        }
        Op::CrossEntropy => {
            let t = targets()?;
            let one = Tensor::full(dev, &[], dt, 1.0)?;
            Box::new(move || {
                let (loss, saved) = ops::cross_entropy(&x, &t, CrossEntropyOpts::default())?;
                let gx = ops::cross_entropy_backward(&x, &t, &saved, &one)?;
                Ok(vec![loss, gx])
            })
        }
        Op::CrossEntropyOnePass => {
            let t = targets()?;
            Box::new(move || {
                let (loss, gx) = ops::cross_entropy_one_pass(&x, &t, CrossEntropyOnePassOpts::default(), None)?;
                Ok(vec![loss, gx])
            })
        }
        Op::LinearCrossEntropy => unreachable!("built above"),
        Op::SumAll => Box::new(move || Ok(vec![ops::reduce(&x, ReduceOp::Sum)?])),
        Op::SumRows => Box::new(move || Ok(vec![ops::reduce_last_dim(&x, ReduceOp::Sum)?])),
        Op::SumCols => Box::new(move || Ok(vec![ops::reduce_leading_dims(&x, ReduceOp::Sum)?])),
        Op::Transpose => Box::new(move || Ok(vec![ops::transpose(&x)?])),
    })
}

/// The shapes of softmax and the norms: `KERNELS_BENCH_SHAPES` if set, else [`SHAPES`].
fn shapes() -> Vec<(usize, usize)> {
    let Ok(spec) = std::env::var("KERNELS_BENCH_SHAPES") else { return SHAPES.to_vec() };
    let parse = |s: &str| {
        let (r, c) = s.trim().split_once('x')?;
        Some((r.parse().ok()?, c.parse().ok()?))
    };
    spec.split(',')
        .map(|s| parse(s).unwrap_or_else(|| panic!("KERNELS_BENCH_SHAPES: expected ROWSxCOLS, got {s:?}")))
        .collect()
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for dt in [DType::F32, DType::BF16] {
        for (r, c) in shapes() {
            if dt == DType::BF16 && r == 64 {
                continue;
            }
            for op in [Op::Softmax, Op::LayerNorm, Op::RmsNorm] {
                v.push(case(op, "fwd", dt, r, c));
                v.push(case(op, "bwd", dt, r, c));
            }
        }
    }
    let add_shapes =
        if std::env::var_os("KERNELS_BENCH_SHAPES").is_some() { shapes() } else { ADD_NORM_SHAPES.to_vec() };
    for dt in [DType::F32, DType::BF16] {
        for &(r, c) in &add_shapes {
            for op in [Op::AddLayerNorm, Op::AddRmsNorm] {
                v.push(case(op, "fwd", dt, r, c));
                v.push(case(op, "bwd", dt, r, c));
            }
        }
    }
    for (r, c) in [(16384, 4096), (64, 1024)] {
        v.push(case(Op::LogSoftmax, "fwd", DType::F32, r, c));
        v.push(case(Op::LogSoftmax, "bwd", DType::F32, r, c));
    }
    for dt in [DType::F32, DType::BF16] {
        v.push(case(Op::CrossEntropy, "fwdbwd", dt, 8192, 32000));
    }
    v.push(case(Op::CrossEntropy, "fwdbwd", DType::F32, 64, 1024));
    v.push(case(Op::CrossEntropy, "fwdbwd", DType::BF16, 8192, 128256));
    for dt in [DType::F32, DType::BF16] {
        v.push(case(Op::CrossEntropyOnePass, "fwdbwd", dt, 8192, 32000));
    }
    v.push(case(Op::CrossEntropyOnePass, "fwdbwd", DType::BF16, 8192, 128256));
    v.push(case(Op::CrossEntropyOnePass, "fwdbwd", DType::F32, 64, 1024));
    v.push(case(Op::LinearCrossEntropy, "fwdbwd", DType::BF16, 8192, 128256));
    for dt in [DType::F32, DType::BF16] {
        v.push(case(Op::SumAll, "fwd", dt, 1 << 18, 1 << 10));
        v.push(case(Op::SumRows, "fwd", dt, 1 << 18, 1 << 10));
    }
    for dt in [DType::F32, DType::BF16] {
        v.push(case(Op::SumCols, "fwd", dt, 8192, 4096));
    }
    v.push(case(Op::SumAll, "fwd", DType::F32, 64, 1024));
    v.push(case(Op::SumRows, "fwd", DType::F32, 64, 1024));
    if std::env::var_os("KERNELS_BENCH_SHAPES").is_some() {
        for dt in [DType::F32, DType::BF16] {
            for (r, c) in shapes() {
                v.push(case(Op::Transpose, "fwd", dt, r, c));
            }
        }
    } else {
        for dt in [DType::F32, DType::BF16] {
            v.push(case(Op::Transpose, "fwd", dt, 8192, 8192));
        }
        v.push(case(Op::Transpose, "fwd", DType::F32, 64, 1024));
    }
    v
}

fn main() {
    harness::run("rows", |_| cases());
}
