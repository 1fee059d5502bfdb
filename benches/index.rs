//! Index op benchmarks: `ops::index_select` and its backward (`index_select_backward`),
//! `ops::gather` and its backward (`gather_backward`), and `ops::scatter_add`, in bf16 and f32,
//! with indices drawn by `IndexTensor::randint`. Timed by the shared harness
//! (`benches/harness`); `benches/torch_index.py` times PyTorch's `index_select`, `gather`,
//! `scatter_add` and the autograd backward passes on the same cases under the same names.
//!
//! ```text
//! cargo bench --bench index
//! KERNELS_BENCH_JSON=index.json cargo bench --bench index -- 'bf16'
//! ```
//!
//! Names: `index/<dtype>/<fwd|bwd>/<op>_<case>/<elements>`, `elements` the output's. Every call
//! of these ops reads back the flag of an out-of-range index (a wait for the device), which the
//! times include; PyTorch checks with device-side assertions instead. Bytes: each input read
//! once (the indices at 8 bytes each), the output written once; a `dst` added to is read.

mod harness;

use harness::{Case, Run, dtype_name};
use kernels::ops;
use kernels::{DType, Device, IndexTensor, Result, Tensor};

/// One case: the op (`index_select`, `gather`, `scatter_add`), the direction, the input's
/// shape, the dimension, and the index's shape.
#[derive(Clone, Copy)]
struct Shape {
    op: &'static str,
    name: &'static str,
    x: [usize; 2],
    dim: usize,
    idx: [usize; 2],
}

const SHAPES: [Shape; 5] = [
    // Rows of a table (the embedding's access), and columns of a square matrix.
    Shape { op: "index_select", name: "rows", x: [32768, 1024], dim: 0, idx: [8192, 1] },
    Shape { op: "index_select", name: "cols", x: [4096, 4096], dim: 1, idx: [1024, 1] },
    // One class per row of logits, and the top 256 of each row.
    Shape { op: "gather", name: "pick", x: [8192, 32000], dim: 1, idx: [8192, 1] },
    Shape { op: "gather", name: "topk", x: [4096, 32000], dim: 1, idx: [4096, 256] },
    // Messages of 16384 edges summed into 1024 nodes (a graph layer's aggregation).
    Shape { op: "scatter_add", name: "nodes", x: [1024, 1024], dim: 0, idx: [16384, 1024] },
];

/// The index's element count (the 1-d index of `index_select` is `idx[0]` long).
fn idx_len(s: &Shape) -> usize {
    if s.op == "index_select" { s.idx[0] } else { s.idx[0] * s.idx[1] }
}

/// The forward's output shape: `x` with `dim` resized (`index_select`), the index's (`gather`),
/// `x`'s (`scatter_add`).
fn out_shape(s: &Shape) -> Vec<usize> {
    match s.op {
        "index_select" => {
            let mut o = s.x.to_vec();
            o[s.dim] = s.idx[0];
            o
        }
        "gather" => s.idx.to_vec(),
        _ => s.x.to_vec(),
    }
}

fn case(dir: &'static str, dt: DType, s: Shape) -> Case {
    let e = dt.size() as u64;
    let (x, o) = (s.x.iter().product::<usize>() as u64, out_shape(&s).iter().product::<usize>() as u64);
    let i = idx_len(&s) as u64;
    // Forward gathers read what they write (o) and write o; the backward passes read the
    // gradient (o) and write x. scatter_add reads dst and src (the index's shape), writes dst.
    let (elements, bytes) = match (s.op, dir) {
        ("scatter_add", _) => (x, (2 * x + i) * e + 8 * i),
        (_, "fwd") => (o, 2 * o * e + 8 * i),
        _ => (x, (o + x) * e + 8 * i),
    };
    let opname = format!("{}_{}@{}x{}", s.op, s.name, s.x[0], s.x[1]);
    Case {
        name: format!("{}/{dir}/{opname}/{elements}", dtype_name(dt)),
        op: opname,
        dtype: dtype_name(dt),
        n: elements as usize,
        dir,
        bytes,
        build: Box::new(move |dev, seed| build(dev, dir, dt, s, seed)),
    }
}

fn build(dev: &Device, dir: &str, dt: DType, s: Shape, seed: u64) -> Result<Run> {
    let v = s.x[s.dim] as i64;
    let ishape: Vec<usize> = if s.op == "index_select" { vec![s.idx[0]] } else { s.idx.to_vec() };
    let idx = IndexTensor::randint(dev, 0, v, &ishape, seed)?;
    let x = Tensor::rand_normal(dev, &s.x, dt, 0.0, 1.0, seed)?;
    let dim = s.dim;
    Ok(match (s.op, dir) {
        ("index_select", "fwd") => Box::new(move || Ok(vec![ops::index_select(&x, dim, &idx)?])),
        ("index_select", _) => {
            let g = Tensor::rand_normal(dev, &out_shape(&s), dt, 0.0, 1.0, seed + 1)?;
            Box::new(move || Ok(vec![ops::index_select_backward(&g, dim, &idx, v as usize)?]))
        }
        ("gather", "fwd") => Box::new(move || Ok(vec![ops::gather(&x, dim, &idx)?])),
        ("gather", _) => {
            let g = Tensor::rand_normal(dev, &s.idx, dt, 0.0, 1.0, seed + 1)?;
            let xs = s.x;
            Box::new(move || Ok(vec![ops::gather_backward(&g, dim, &idx, &xs)?]))
        }
        _ => {
            let src = Tensor::rand_normal(dev, &s.idx, dt, 0.0, 1.0, seed + 1)?;
            Box::new(move || Ok(vec![ops::scatter_add(&x, dim, &idx, &src)?]))
        }
    })
}

fn cases() -> Vec<Case> {
    let mut c = Vec::new();
    for dt in [DType::BF16, DType::F32] {
        for s in SHAPES {
            c.push(case("fwd", dt, s));
            if s.op != "scatter_add" {
                c.push(case("bwd", dt, s));
            }
        }
    }
    c
}

fn main() {
    harness::run("index", |_| cases());
}
