//! Element-wise benchmarks: every unary op and activation, the binary ops, the row broadcast, the
//! fused `act(x * scale + bias)` and the gated `act(a) * b` (SwiGLU, GeGLU), forward and
//! backward, at 2^28 elements and at 2^16, timed
//! the way `triton.testing.do_bench` times PyTorch in `benches/torch_elementwise.py`, so the two
//! sets of numbers compare directly (`scripts/compare.py`).
//!
//! Timing, per iteration, all enqueued without host synchronisation: an L2 flush (`fill_` of a
//! 256 MiB f32 scratch tensor), a CUDA event, the op once (allocating its outputs, as PyTorch
//! eager does), a CUDA event; the outputs are freed after the second event. After the batch every
//! event pair is read; `iter_custom` gets the summed GPU time, and every per-iteration time is
//! kept so that the median (what `do_bench(return_mode="median")` reports) is computed here.
//! Before criterion's own warm-up each case runs at least 3 times and 25 ms (do_bench's warm-up).
//! The median is over all of criterion's calls for the case (its warm-up and its samples): the
//! case is already warm then, and do_bench likewise takes the median of all its repeats.
//!
//! ```text
//! cargo bench --bench elementwise                        # everything, under 4 minutes on an H100
//! cargo bench --bench elementwise -- 'f32/fwd/gelu/'     # a regex over the names below
//! cargo bench --bench elementwise -- '/65536$'           # the small size only
//! cargo bench --bench elementwise -- '^elementwise/(bf16|f16)/'
//! KERNELS_BENCH_JSON=ours.json cargo bench --bench elementwise   # also write the medians
//! ```
//!
//! Names: `elementwise/<dtype>/<fwd|bwd>/<op>/<n>`, e.g. `elementwise/f32/bwd/gelu/268435456`;
//! the device-to-device copy (the memory ceiling) is `elementwise/f32/fwd/copy/<n>`.
//!
//! GB/s counts each input read once and each output written once: unary forward 2N elements,
//! backward 3N (x and grad in, grad_x out); binary 3N and 5N; the row and fused ops 2N forward and
//! 3N backward plus their `[cols]` parameter vectors (read, and their gradients written); the
//! gated ops, on `M = rows * GLU_F` outputs with `rows = n / GLU_F` (an LLM's MLP width), 3M
//! forward (`[rows, 2 GLU_F]` in, `[rows, GLU_F]` out) and 5M backward (and grad in, dx out),
//! `glu_*` from the fused input, `glu2_*` from two tensors.
//! With no GPU the bench prints why and exits 0.

mod harness;

use harness::Run;
use kernels::ops::{self, Activation, BinaryOp, UnaryOp};
use kernels::{DType, Device, Result, Tensor};

/// Columns of the `[rows, COLS]` inputs (the last dimension of the row and fused ops).
const COLS: usize = 1024;
/// F of the gated ops' `[rows, 2F]` inputs: Llama 3 8B's MLP width (not a power of two).
const GLU_F: usize = 14336;
/// The sizes: 2^28 (fills the chip, far beyond L2) and 2^16 (launch-bound).
const SIZES: [usize; 2] = [1 << 28, 1 << 16];

#[derive(Clone, Copy, PartialEq)]
enum Dir {
    Fwd,
    Bwd,
}

impl Dir {
    fn as_str(self) -> &'static str {
        match self {
            Dir::Fwd => "fwd",
            Dir::Bwd => "bwd",
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Copy,
    Unary(UnaryOp),
    /// The backward from the output (`ops::unary_backward_from_output`), as PyTorch's autograd
    /// runs sigmoid's and tanh's: `(y, grad)` in, `grad_x` out.
    UnaryFromOutput(UnaryOp),
    Binary(BinaryOp),
    AddRow,
    Fused(Activation),
    /// `act(a) * b` of the halves of `x: [rows, 2F]`.
    Glu(Activation),
    /// `act(a) * b` of two tensors `[rows, F]`.
    Glu2(Activation),
}

/// Rows of the gated ops' inputs for a case of `n` elements (at least one).
fn glu_rows(n: usize) -> usize {
    (n / GLU_F).max(1)
}

struct Case {
    op: &'static str,
    kind: Kind,
    dtype: DType,
    n: usize,
    dir: Dir,
}

fn dtype_name(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

impl Case {
    fn name(&self) -> String {
        format!("{}/{}/{}/{}", dtype_name(self.dtype), self.dir.as_str(), self.op, self.n)
    }

    /// Bytes moved at the minimum: each input read once, each output written once.
    fn bytes(&self) -> u64 {
        let (n, c, s) = (self.n as u64, COLS as u64, self.dtype.size() as u64);
        let elems = match (self.kind, self.dir) {
            (Kind::Copy, _) => 2 * n,
            (Kind::Unary(_), Dir::Fwd) => 2 * n,
            (Kind::Unary(_) | Kind::UnaryFromOutput(_), Dir::Bwd) => 3 * n,
            (Kind::UnaryFromOutput(_), Dir::Fwd) => unreachable!("a backward only"),
            (Kind::Binary(_), Dir::Fwd) => 3 * n,
            (Kind::Binary(_), Dir::Bwd) => 5 * n,
            // x in, out; the row in.
            (Kind::AddRow, Dir::Fwd) => 2 * n + c,
            // x and grad in, grad_x out; the row in, its gradient out.
            (Kind::AddRow, Dir::Bwd) => 3 * n + 2 * c,
            (Kind::Fused(_), Dir::Fwd) => 2 * n + 2 * c,
            (Kind::Fused(_), Dir::Bwd) => 3 * n + 4 * c,
            (Kind::Glu(_) | Kind::Glu2(_), Dir::Fwd) => 3 * (glu_rows(self.n) * GLU_F) as u64,
            (Kind::Glu(_) | Kind::Glu2(_), Dir::Bwd) => 5 * (glu_rows(self.n) * GLU_F) as u64,
        };
        elems * s
    }

    /// Inputs where the op's domain wants positive numbers (the op table says which).
    fn positive_input(&self) -> bool {
        let Kind::Unary(u) = self.kind else { return false };
        kernels::ops::UNARY_OPS.iter().any(|i| i.name == u.name() && i.positive)
    }
}

/// The whole list, big size first within each dtype.
fn cases() -> Vec<Case> {
    // Every op of the table with its parameters (pow's 2.5 takes the general path), and pow's
    // cube, a multiplication.
    let mut unary: Vec<(&'static str, UnaryOp)> = UnaryOp::all().into_iter().map(|op| (op.name(), op)).collect();
    unary.push(("pow_cube", UnaryOp::Pow(3.0)));
    let binary = [("add", BinaryOp::Add), ("sub", BinaryOp::Sub), ("mul", BinaryOp::Mul), ("div", BinaryOp::Div)];
    let fused = [
        ("scale_bias_relu", Activation::Relu),
        ("scale_bias_gelu", Activation::Gelu),
        ("scale_bias_silu", Activation::Silu),
    ];
    let mut v = Vec::new();
    for &n in &SIZES {
        let mut push = |op, kind, dtype, dir| v.push(Case { op, kind, dtype, n, dir });
        push("copy", Kind::Copy, DType::F32, Dir::Fwd);
        for &(op, u) in &unary {
            push(op, Kind::Unary(u), DType::F32, Dir::Fwd);
            push(op, Kind::Unary(u), DType::F32, Dir::Bwd);
        }
        for &(op, b) in &binary {
            push(op, Kind::Binary(b), DType::F32, Dir::Fwd);
            push(op, Kind::Binary(b), DType::F32, Dir::Bwd);
        }
        push("sigmoid_y", Kind::UnaryFromOutput(Activation::Sigmoid.into()), DType::F32, Dir::Bwd);
        push("tanh_y", Kind::UnaryFromOutput(Activation::Tanh.into()), DType::F32, Dir::Bwd);
        push("add_row", Kind::AddRow, DType::F32, Dir::Fwd);
        push("add_row", Kind::AddRow, DType::F32, Dir::Bwd);
        for &(op, a) in &fused {
            push(op, Kind::Fused(a), DType::F32, Dir::Fwd);
            push(op, Kind::Fused(a), DType::F32, Dir::Bwd);
        }
        // Every activation in bf16, some in f16.
        for &a in Activation::ALL {
            push(a.name(), Kind::Unary(a.into()), DType::BF16, Dir::Fwd);
            push(a.name(), Kind::Unary(a.into()), DType::BF16, Dir::Bwd);
        }
        for dt in [DType::BF16, DType::F16] {
            if dt == DType::F16 {
                push("gelu", Kind::Unary(Activation::Gelu.into()), dt, Dir::Fwd);
                push("gelu", Kind::Unary(Activation::Gelu.into()), dt, Dir::Bwd);
                push("gelu_tanh", Kind::Unary(Activation::GeluTanh.into()), dt, Dir::Fwd);
                push("gelu_tanh", Kind::Unary(Activation::GeluTanh.into()), dt, Dir::Bwd);
                push("relu", Kind::Unary(Activation::Relu.into()), dt, Dir::Fwd);
            }
            push("exp", Kind::Unary(UnaryOp::Exp), dt, Dir::Fwd);
            push("add", Kind::Binary(BinaryOp::Add), dt, Dir::Fwd);
            push("scale_bias_silu", Kind::Fused(Activation::Silu), dt, Dir::Fwd);
            push("scale_bias_silu", Kind::Fused(Activation::Silu), dt, Dir::Bwd);
        }
        // The gated activations: SwiGLU in f32 and bf16, GeGLU (both forms) in bf16, fused and
        // from two tensors.
        let glu = [
            ("glu_silu", Kind::Glu(Activation::Silu), DType::F32),
            ("glu_silu", Kind::Glu(Activation::Silu), DType::BF16),
            ("glu_gelu", Kind::Glu(Activation::Gelu), DType::BF16),
            ("glu_gelu_tanh", Kind::Glu(Activation::GeluTanh), DType::BF16),
            ("glu2_silu", Kind::Glu2(Activation::Silu), DType::BF16),
        ];
        for (op, kind, dt) in glu {
            push(op, kind, dt, Dir::Fwd);
            push(op, kind, dt, Dir::Bwd);
        }
    }
    v
}

/// Creates the case's inputs (fresh random numbers, never zeros) and the closure that runs it.
fn build(dev: &Device, case: &Case, seed: u64) -> Result<Run> {
    if let Kind::Glu(act) | Kind::Glu2(act) = case.kind {
        return build_glu(dev, case, act, seed);
    }
    let (dt, shape) = (case.dtype, [case.n / COLS, COLS]);
    let x = if case.positive_input() {
        Tensor::rand_uniform(dev, &shape, dt, 0.1, 4.0, seed)?
    } else {
        Tensor::rand_normal(dev, &shape, dt, 0.0, 1.0, seed)?
    };
    let other = |s: u64| Tensor::rand_normal(dev, &shape, dt, 0.0, 1.0, seed.wrapping_add(s));
    let row = |s: u64, mean: f32| Tensor::rand_normal(dev, &[COLS], dt, mean, 0.5, seed.wrapping_add(s));
    Ok(match (case.kind, case.dir) {
        (Kind::Copy, _) => Box::new(move || Ok(vec![x.try_clone()?])),
        (Kind::Unary(op), Dir::Fwd) => Box::new(move || Ok(vec![ops::unary(&x, op)?])),
        (Kind::Unary(op), Dir::Bwd) => {
            let g = other(1)?;
            Box::new(move || Ok(vec![ops::unary_backward(&x, &g, op)?]))
        }
        (Kind::UnaryFromOutput(op), _) => {
            let (y, g) = (ops::unary(&x, op)?, other(1)?);
            Box::new(move || Ok(vec![ops::unary_backward_from_output(&y, &g, op)?]))
        }
        (Kind::Binary(op), Dir::Fwd) => {
            let b = other(1)?;
            Box::new(move || Ok(vec![ops::binary(&x, &b, op)?]))
        }
        (Kind::Binary(op), Dir::Bwd) => {
            let (b, g) = (other(1)?, other(2)?);
            Box::new(move || {
                let (ga, gb) = ops::binary_backward(&x, &b, &g, op)?;
                Ok(vec![ga, gb])
            })
        }
        (Kind::AddRow, Dir::Fwd) => {
            let r = row(1, 0.0)?;
            Box::new(move || Ok(vec![ops::binary_row(&x, &r, BinaryOp::Add)?]))
        }
        (Kind::AddRow, Dir::Bwd) => {
            let (r, g) = (row(1, 0.0)?, other(2)?);
            Box::new(move || {
                let (gx, gr) = ops::binary_row_backward(&x, &r, &g, BinaryOp::Add)?;
                Ok(vec![gx, gr])
            })
        }
        (Kind::Fused(act), Dir::Fwd) => {
            let (s, b) = (row(1, 1.0)?, row(2, 0.0)?);
            Box::new(move || Ok(vec![ops::scale_bias_act(&x, &s, &b, act)?]))
        }
        (Kind::Fused(act), Dir::Bwd) => {
            let (s, b, g) = (row(1, 1.0)?, row(2, 0.0)?, other(3)?);
            Box::new(move || {
                let gr = ops::scale_bias_act_backward(&x, &s, &b, &g, act)?;
                Ok(vec![gr.x, gr.scale, gr.bias])
            })
        }
        (Kind::Glu(_) | Kind::Glu2(_), _) => unreachable!("built by build_glu"),
    })
}

/// [`build`] for the gated ops: `x: [rows, 2F]` (or `a`, `b`: `[rows, F]`) and the gradient.
fn build_glu(dev: &Device, case: &Case, act: Activation, seed: u64) -> Result<Run> {
    let (dt, rows) = (case.dtype, glu_rows(case.n));
    let half = |s: u64| Tensor::rand_normal(dev, &[rows, GLU_F], dt, 0.0, 1.0, seed.wrapping_add(s));
    let g = half(3)?;
    Ok(match (case.kind, case.dir) {
        (Kind::Glu(_), dir) => {
            let x = Tensor::rand_normal(dev, &[rows, 2 * GLU_F], dt, 0.0, 1.0, seed)?;
            match dir {
                Dir::Fwd => Box::new(move || Ok(vec![ops::glu(&x, act)?])),
                Dir::Bwd => Box::new(move || Ok(vec![ops::glu_backward(&x, &g, act)?])),
            }
        }
        (_, Dir::Fwd) => {
            let (a, b) = (half(1)?, half(2)?);
            Box::new(move || Ok(vec![ops::glu2(&a, &b, act)?]))
        }
        (_, Dir::Bwd) => {
            let (a, b) = (half(1)?, half(2)?);
            Box::new(move || {
                let (da, db) = ops::glu2_backward(&a, &b, &g, act)?;
                Ok(vec![da, db])
            })
        }
    })
}

fn main() {
    harness::run("elementwise", |_| {
        cases()
            .into_iter()
            .map(|case| harness::Case {
                name: case.name(),
                op: case.op.to_string(),
                dtype: dtype_name(case.dtype),
                n: case.n,
                dir: case.dir.as_str(),
                bytes: case.bytes(),
                build: Box::new(move |dev, seed| build(dev, &case, seed)),
            })
            .collect()
    });
}
