//! RoPE benchmarks: `ops::rope` forward, backward and in place on LLM shapes (LLaMA-7B's queries,
//! 32 heads of 128, at batch 4 and 4096 positions; a 64-dim head, GPT-J's interleaved pairs), in
//! both layouts, bf16 and f32, and a device-to-device copy of the same tensor as the bandwidth
//! ceiling. Timed by the shared harness (`benches/harness`); `benches/torch_rope.py` times
//! PyTorch's eager composition (`x * cos + rotate_half(x) * sin`; the complex product for the
//! interleaved pairs) on the same cases under the same names.
//!
//! ```text
//! cargo bench --bench rope
//! KERNELS_BENCH_JSON=rope.json cargo bench --bench rope -- 'bf16'
//! ```
//!
//! Names: `rope/<dtype>/<fwd|bwd|inplace>/<op>_<layout>@<B>x<S>x<H>x<D>/<elements>`, `op` one of
//! `rope` (half-rotation), `rope_interleaved`, `copy`. GB/s counts x read and written once, and the
//! tables' rows of the sequence's positions read once (`2 * S * D / 2` f32; the copy: none).

mod harness;

use harness::{Case, Run, dtype_name};
use kernels::ops::{self, Layout, RopeOpts, RopeStyle};
use kernels::{DType, Device, Result, Tensor};

/// `(B, S, H, D)`: LLaMA-7B's queries at batch 4 and 4096 positions; a smaller head.
const SHAPES: [(usize, usize, usize, usize); 2] = [(4, 4096, 32, 128), (8, 2048, 16, 64)];

#[derive(Clone, Copy)]
enum Op {
    Rope(RopeStyle),
    Copy,
}

fn case(op: Op, dir: &'static str, dt: DType, layout: Layout, (b, s, h, d): (usize, usize, usize, usize)) -> Case {
    let n = b * s * h * d;
    let tables = if matches!(op, Op::Copy) { 0 } else { 4 * (s * d) as u64 };
    let bytes = 2 * (n * dt.size()) as u64 + tables;
    let name = match op {
        Op::Rope(RopeStyle::Half) => "rope",
        Op::Rope(RopeStyle::Interleaved) => "rope_interleaved",
        Op::Copy => "copy",
    };
    let l = if layout == Layout::Bhsd { "bhsd" } else { "bshd" };
    let opname = format!("{name}_{l}@{b}x{s}x{h}x{d}");
    Case {
        name: format!("{}/{dir}/{opname}/{n}", dtype_name(dt)),
        op: opname,
        dtype: dtype_name(dt),
        n,
        dir,
        bytes,
        build: Box::new(move |dev, seed| build(dev, op, dir, dt, layout, (b, s, h, d), seed)),
    }
}

fn build(
    dev: &Device,
    op: Op,
    dir: &str,
    dt: DType,
    layout: Layout,
    (b, s, h, d): (usize, usize, usize, usize),
    seed: u64,
) -> Result<Run> {
    let shape = if layout == Layout::Bhsd { [b, h, s, d] } else { [b, s, h, d] };
    let mut x = Tensor::rand_normal(dev, &shape, dt, 0.0, 1.0, seed)?;
    let Op::Rope(style) = op else {
        return Ok(Box::new(move || Ok(vec![x.try_clone()?])));
    };
    let (cos, sin) = ops::rope_tables(dev, s, d, 10000.0)?;
    let opts = RopeOpts { layout, style, offset: 0, rotary_dim: None };
    Ok(match dir {
        "fwd" => Box::new(move || Ok(vec![ops::rope(&x, &cos, &sin, &opts)?])),
        "bwd" => Box::new(move || Ok(vec![ops::rope_backward(&x, &cos, &sin, &opts)?])),
        _ => Box::new(move || {
            ops::rope_inplace(&mut x, &cos, &sin, &opts)?;
            Ok(vec![])
        }),
    })
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for dt in [DType::BF16, DType::F32] {
        for shape in SHAPES {
            for layout in [Layout::Bshd, Layout::Bhsd] {
                for style in [RopeStyle::Half, RopeStyle::Interleaved] {
                    for dir in ["fwd", "bwd", "inplace"] {
                        v.push(case(Op::Rope(style), dir, dt, layout, shape));
                    }
                }
            }
            v.push(case(Op::Copy, "fwd", dt, Layout::Bshd, shape));
        }
    }
    v
}

fn main() {
    harness::run("rope", |_| cases());
}
