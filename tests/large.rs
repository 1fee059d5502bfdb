//! More than 2^31 elements on the GPU: indices are 64-bit everywhere, in the element-wise grid
//! stride, in the row-broadcast column index and in the column reduction.

mod common;

use common::*;
use kernels::ops::{self, BinaryOp, UnaryOp};
use kernels::{DType, Device, Tensor};
use kernels_gpu::init::uniform_at;
use std::process::ExitCode;

const COLS: usize = 3077;
const ROWS: usize = (1usize << 31) / COLS + 1000; // rows * cols = 2^31 + ~3M

fn large(dev: &Device) -> Result<(), String> {
    let n = ROWS * COLS;
    assert!(n > (1 << 31));
    let seed = 99;
    let x = Tensor::rand_uniform(dev, &[ROWS, COLS], DType::BF16, -4.0, 4.0, seed).map_err(e)?;
    let y = ops::unary(&x, UnaryOp::MulScalar(2.0)).map_err(e)?;
    let xs = x.to_f32_vec().map_err(e)?;
    let ys = y.to_f32_vec().map_err(e)?;
    drop(y);
    // Doubling is exact in bf16: every element, including those past 2^31, must be 2x.
    if let Some(i) = (0..n).find(|&i| ys[i].to_bits() != (2.0 * xs[i]).to_bits()) {
        return Err(format!("mul_scalar: element {i} is {}, want {}", ys[i], 2.0 * xs[i]));
    }
    drop(ys);
    // The generator must have produced the right values past 2^31 too (the CPU recomputes them).
    for i in (0..n).step_by(997).chain(n - 4096..n) {
        let want = half::bf16::from_f32(uniform_at(seed, i as u64, -4.0, 4.0)).to_f32();
        if xs[i].to_bits() != want.to_bits() {
            return Err(format!("rand_uniform: element {i} is {}, want {want}", xs[i]));
        }
    }
    drop(xs);
    // A bias gradient over rows * cols > 2^31 elements: with grad = 1 every column sums to ROWS,
    // exactly (integers below 2^24 in f32; ROWS rounds to bf16 as the reference does).
    let bias = Tensor::full(dev, &[COLS], DType::BF16, 0.5).map_err(e)?;
    let g = Tensor::full(dev, &[ROWS, COLS], DType::BF16, 1.0).map_err(e)?;
    let (gx, gb) = ops::binary_row_backward(&x, &bias, &g, BinaryOp::Add).map_err(e)?;
    let gb = gb.to_f32_vec().map_err(e)?;
    let want = half::bf16::from_f32(ROWS as f32).to_f32();
    if let Some(c) = gb.iter().position(|&v| v != want) {
        return Err(format!("bias gradient column {c} is {}, want {want}", gb[c]));
    }
    let gx = gx.to_f32_vec().map_err(e)?;
    if let Some(i) = gx.iter().position(|&v| v != 1.0) {
        return Err(format!("grad_x element {i} is {}, want 1", gx[i]));
    }
    Ok(())
}

fn main() -> ExitCode {
    run_with(vec![test("large/bf16_beyond_2^31", large)], true)
}
