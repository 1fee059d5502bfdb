//! Batch norm and pooling benchmarks on ResNet-50's shapes at batch 64: `ops::batch_norm`
//! (training forward with the running statistics' update, evaluation forward) and
//! `ops::batch_norm_backward` on every batch norm's `(C, H)` of the network, the stem's max pool
//! (3x3, stride 2, padding 1, 112 -> 56) and the head's global average pool (2048 x 7 x 7),
//! forward and backward, bf16 and f32, NCHW and NHWC; and a copy of each batch norm's input
//! (the bandwidth ceiling). Timed by the shared harness (`benches/harness`);
//! `benches/torch_batchnorm.py` times PyTorch's (cuDNN's) on the same cases under the same names.
//!
//! ```text
//! cargo bench --bench batchnorm
//! KERNELS_BENCH_JSON=batchnorm.json cargo bench --bench batchnorm -- 'bf16/.*nhwc'
//! ```
//!
//! Names: `<dtype>/<fwd|bwd>/<op>_<layout>@<C>x<H>/<elements>`, `op` one of `batch_norm_train`,
//! `batch_norm_eval`, `max_pool`, `global_avg_pool`, `copy`; `elements` the input's. Bytes: each
//! input read once and each output written once (the training forward reads x twice, which is
//! not counted); the max pool's int64 indices count 8 bytes an output.

mod harness;

use harness::{Case, Run, dtype_name};
use kernels::ops::{self, BatchNormOpts, Layout2d, Pool2dOpts};
use kernels::{DType, Device, Result, Tensor};

const BATCH: usize = 64;

/// ResNet-50's batch norms: `(C, H = W)`.
const BN_SHAPES: [(usize, usize); 9] =
    [(64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (256, 14), (1024, 14), (512, 7), (2048, 7)];

#[derive(Clone, Copy)]
enum Op {
    Train,
    Eval,
    MaxPool,
    Gap,
    Copy,
}

fn layout_name(l: Layout2d) -> &'static str {
    if l == Layout2d::Nhwc { "nhwc" } else { "nchw" }
}

fn case(op: Op, dir: &'static str, dt: DType, l: Layout2d, (c, h): (usize, usize)) -> Case {
    let s = dt.size() as u64;
    let elements = BATCH * c * h * h;
    let e = elements as u64;
    let (stem, bytes) = match (op, dir) {
        (Op::Train, "fwd") => ("batch_norm_train", 2 * e * s),
        (Op::Eval, _) => ("batch_norm_eval", 2 * e * s),
        (Op::Train, _) => ("batch_norm_train", 3 * e * s),
        // x and dx, and a quarter as many outputs with their indices.
        (Op::MaxPool, _) => ("max_pool", e * s + e / 4 * (s + 8)),
        (Op::Gap, _) => ("global_avg_pool", e * s + (BATCH * c) as u64 * s),
        (Op::Copy, _) => ("copy", 2 * e * s),
    };
    let opname = format!("{stem}_{}@{c}x{h}", layout_name(l));
    Case {
        name: format!("{}/{dir}/{opname}/{elements}", dtype_name(dt)),
        op: opname,
        dtype: dtype_name(dt),
        n: elements,
        dir,
        bytes,
        build: Box::new(move |dev, seed| build(dev, op, dir, dt, l, (c, h), seed)),
    }
}

fn build(dev: &Device, op: Op, dir: &str, dt: DType, l: Layout2d, (c, h): (usize, usize), seed: u64) -> Result<Run> {
    let shape = l.shape(BATCH, c, h, h);
    let x = Tensor::rand_normal(dev, &shape, dt, 0.5, 2.0, seed)?;
    let w = Tensor::rand_normal(dev, &[c], DType::F32, 1.0, 0.1, seed + 1)?;
    let b = Tensor::rand_normal(dev, &[c], DType::F32, 0.0, 0.1, seed + 2)?;
    let mut rm = Tensor::zeros(dev, &[c], DType::F32)?;
    let mut rv = Tensor::full(dev, &[c], DType::F32, 1.0)?;
    let train = BatchNormOpts { layout: l, ..BatchNormOpts::default() };
    let eval = BatchNormOpts { training: false, ..train };
    let mut pool = Pool2dOpts::new(3);
    pool.stride = (2, 2);
    pool.padding = (1, 1);
    pool.layout = l;
    Ok(match (op, dir) {
        (Op::Train, "fwd") => Box::new(move || {
            let (y, s) = ops::batch_norm(&x, Some(&w), Some(&b), Some(&mut rm), Some(&mut rv), &train)?;
            Ok(vec![y, s.mean, s.invstd])
        }),
        (Op::Eval, _) => {
            Box::new(move || Ok(vec![ops::batch_norm(&x, Some(&w), Some(&b), Some(&mut rm), Some(&mut rv), &eval)?.0]))
        }
        (Op::Train, _) => {
            let (_, stats) = ops::batch_norm(&x, Some(&w), Some(&b), None, None, &train)?;
            let g = Tensor::rand_normal(dev, &shape, dt, 0.0, 1.0, seed + 3)?;
            Box::new(move || {
                let gr = ops::batch_norm_backward(&x, Some(&w), Some(&b), &stats, &g, &train)?;
                Ok([Some(gr.x), gr.weight, gr.bias].into_iter().flatten().collect())
            })
        }
        (Op::MaxPool, "fwd") => Box::new(move || {
            let (y, _idx) = ops::max_pool2d(&x, &pool)?;
            Ok(vec![y])
        }),
        (Op::MaxPool, _) => {
            let (y, idx) = ops::max_pool2d(&x, &pool)?;
            let g = Tensor::rand_normal(dev, y.shape(), dt, 0.0, 1.0, seed + 3)?;
            Box::new(move || Ok(vec![ops::max_pool2d_backward(&g, &idx, &shape, &pool)?]))
        }
        (Op::Gap, "fwd") => Box::new(move || Ok(vec![ops::global_avg_pool2d(&x, l)?])),
        (Op::Gap, _) => {
            let g = Tensor::rand_normal(dev, &l.shape(BATCH, c, 1, 1), dt, 0.0, 1.0, seed + 3)?;
            Box::new(move || Ok(vec![ops::global_avg_pool2d_backward(&g, &shape, l)?]))
        }
        (Op::Copy, _) => Box::new(move || Ok(vec![x.try_clone()?])),
    })
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for dt in [DType::BF16, DType::F32] {
        for l in [Layout2d::Nhwc, Layout2d::Nchw] {
            for shape in BN_SHAPES {
                v.push(case(Op::Train, "fwd", dt, l, shape));
                v.push(case(Op::Train, "bwd", dt, l, shape));
                v.push(case(Op::Eval, "fwd", dt, l, shape));
                v.push(case(Op::Copy, "fwd", dt, l, shape));
            }
            for dir in ["fwd", "bwd"] {
                v.push(case(Op::MaxPool, dir, dt, l, (64, 112)));
                v.push(case(Op::Gap, dir, dt, l, (2048, 7)));
            }
        }
    }
    v
}

fn main() {
    harness::run("batchnorm", |_| cases());
}
