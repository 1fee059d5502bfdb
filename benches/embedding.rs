//! Embedding benchmarks: `ops::embedding` and `ops::embedding_backward` on GPT-2's (V 50257,
//! D 768) and LLaMA-3's (V 128256, D 4096) tables with 8192 tokens drawn uniformly, bf16 and f32,
//! and device-to-device copies as the bandwidth ceilings: of the forward's output (`[N, D]`)
//! under `fwd`, of the weight's gradient (`[V, D]`) under `bwd`. Timed by the shared harness
//! (`benches/harness`); `benches/torch_embedding.py` times PyTorch's `F.embedding` and its
//! autograd backward on the same cases under the same names.
//!
//! ```text
//! cargo bench --bench embedding
//! KERNELS_BENCH_JSON=embedding.json cargo bench --bench embedding -- 'bf16'
//! ```
//!
//! Names: `embedding/<dtype>/<fwd|bwd>/<op>_<model>@<V>x<D>x<N>/<elements>`, `op` one of
//! `embedding`, `copy`; `elements` the output's (`N D` forward, `V D` backward). Bytes: the
//! forward reads the N rows and the indices and writes N rows; the backward reads the N gradient
//! rows and the indices and writes V rows (its sort's traffic not counted); a copy reads and
//! writes its tensor once.

mod harness;

use harness::{Case, Run, dtype_name};
use kernels::ops;
use kernels::{DType, Device, IndexTensor, Result, Tensor};

/// `(model, V, D, N)`.
const SHAPES: [(&str, usize, usize, usize); 2] = [("gpt2", 50257, 768, 8192), ("llama", 128256, 4096, 8192)];

fn case(copy: bool, dir: &'static str, dt: DType, (model, v, d, n): (&'static str, usize, usize, usize)) -> Case {
    let s = dt.size() as u64;
    let (rows_out, rows_in) = if dir == "fwd" { (n, n) } else { (v, n) };
    let elements = rows_out * d;
    let bytes = if copy { 2 * elements as u64 * s } else { (rows_out + rows_in) as u64 * d as u64 * s + 8 * n as u64 };
    let opname = format!("{}_{model}@{v}x{d}x{n}", if copy { "copy" } else { "embedding" });
    Case {
        name: format!("{}/{dir}/{opname}/{elements}", dtype_name(dt)),
        op: opname,
        dtype: dtype_name(dt),
        n: elements,
        dir,
        bytes,
        build: Box::new(move |dev, seed| build(dev, copy, dir, dt, (v, d, n), seed)),
    }
}

fn build(dev: &Device, copy: bool, dir: &str, dt: DType, (v, d, n): (usize, usize, usize), seed: u64) -> Result<Run> {
    if copy {
        let rows = if dir == "fwd" { n } else { v };
        let x = Tensor::rand_normal(dev, &[rows, d], dt, 0.0, 1.0, seed)?;
        return Ok(Box::new(move || Ok(vec![x.try_clone()?])));
    }
    // Uniform tokens from a SplitMix64 stream of the seed.
    let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
    let tokens: Vec<i64> = (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % v as u64) as i64
        })
        .collect();
    let idx = IndexTensor::from_slice(dev, &tokens, &[n])?;
    Ok(if dir == "fwd" {
        let w = Tensor::rand_normal(dev, &[v, d], dt, 0.0, 1.0, seed)?;
        Box::new(move || Ok(vec![ops::embedding(&w, &idx, None)?]))
    } else {
        let g = Tensor::rand_normal(dev, &[n, d], dt, 0.0, 1.0, seed)?;
        Box::new(move || Ok(vec![ops::embedding_backward(&g, &idx, v, None)?]))
    })
}

fn cases() -> Vec<Case> {
    let mut c = Vec::new();
    for dt in [DType::BF16, DType::F32] {
        for shape in SHAPES {
            for dir in ["fwd", "bwd"] {
                c.push(case(false, dir, dt, shape));
                c.push(case(true, dir, dt, shape));
            }
        }
    }
    c
}

fn main() {
    harness::run("embedding", |_| cases());
}
