//! What a program pays before its first results: the device's initialisation, then the first
//! call of a few ops (each loads its op's module of PTX, which the driver compiles for the GPU
//! unless its JIT cache has it), then the same calls again.
//!
//! ```text
//! cargo run --release --example startup                     # with the driver's JIT cache
//! CUDA_CACHE_DISABLE=1 cargo run --release --example startup   # as on a machine's first run
//! ```
//!
//! Exits 0 with a one-line message when there is no GPU, 2 on a GPU error.

use kernels::ops::{self, Activation};
use kernels::{DType, Device, Result, Tensor};
use std::time::Instant;

fn main() {
    let t = Instant::now();
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no GPU ({e}): nothing to time");
            return;
        }
    };
    println!(
        "{:32} {:>9.3} s   ({}, {} PTX)",
        "Device::cuda(0)",
        t.elapsed().as_secs_f64(),
        dev.name(),
        dev.ptx_arch()
    );
    if let Err(e) = run(&dev) {
        eprintln!("GPU error: {e}");
        std::process::exit(2);
    }
}

fn run(dev: &Device) -> Result<()> {
    let x = Tensor::rand_normal(dev, &[1024, 1024], DType::F32, 0.0, 1.0, 1)?;
    let w = Tensor::rand_normal(dev, &[1024], DType::F32, 1.0, 0.1, 2)?;
    let b = Tensor::rand_normal(dev, &[1024], DType::F32, 0.0, 0.1, 3)?;
    let calls: [(&str, &dyn Fn() -> Result<()>); 5] = [
        ("gelu", &|| ops::unary(&x, Activation::Gelu).map(drop)),
        ("softmax", &|| ops::softmax(&x).map(drop)),
        ("layer_norm", &|| ops::layer_norm(&x, Some(&w), Some(&b), ops::LAYER_NORM_EPS).map(drop)),
        ("sum", &|| ops::reduce(&x, ops::ReduceOp::Sum).map(drop)),
        ("matmul 1024^3", &|| ops::matmul(&x, &x).map(drop)),
    ];
    for round in ["first", "second"] {
        for (name, f) in &calls {
            let t = Instant::now();
            f()?;
            dev.synchronize()?;
            println!("{:32} {:>9.3} s", format!("{name} ({round} call)"), t.elapsed().as_secs_f64());
        }
    }
    Ok(())
}
