//! Optimizer benchmarks: one fused AdamW step (`ops::adamw_step`) on 2^24 parameters of f32 and
//! bf16, timed by the shared harness (`benches/harness`: do_bench's method, L2 flushed before
//! every run, medians); `benches/torch_optim.py` times `torch.optim.AdamW(fused=True).step()` on
//! the same cases under the same names.
//!
//! ```text
//! cargo bench --bench optim
//! KERNELS_BENCH_JSON=optim.json cargo bench --bench optim
//! ```
//!
//! Names: `optim/<dtype>/step/adamw/<n>`. GB/s counts what our step must move: the parameters
//! read and written, the gradient read, and the two f32 moments read and written, `n * (3 s +
//! 16)` bytes for parameters of `s` bytes (28 per element in f32, 22 in bf16). PyTorch keeps the
//! moments in the parameters' dtype (14 bytes per bf16 element), so for bf16 the time ratio
//! compares different traffic: 22/14 = 1.57 times the bytes for us, i.e. a ratio of about 0.64
//! at equal bandwidth.

mod harness;

use harness::{Case, Run, dtype_name};
use kernels::ops::{self, AdamW};
use kernels::{DType, Device, Result, Tensor};

const N: usize = 1 << 24;

fn case(dt: DType, n: usize) -> Case {
    let bytes = n as u64 * (3 * dt.size() as u64 + 16);
    Case {
        name: format!("{}/step/adamw/{n}", dtype_name(dt)),
        op: "adamw".into(),
        dtype: dtype_name(dt),
        n,
        dir: "step",
        bytes,
        build: Box::new(move |dev, seed| build(dev, dt, n, seed)),
    }
}

fn build(dev: &Device, dt: DType, n: usize, seed: u64) -> Result<Run> {
    let mut p = Tensor::rand_normal(dev, &[n], dt, 0.0, 0.02, seed)?;
    let g = Tensor::rand_normal(dev, &[n], dt, 0.0, 1e-3, seed + 1)?;
    let mut m = Tensor::rand_normal(dev, &[n], DType::F32, 0.0, 1e-3, seed + 2)?;
    let mut v = Tensor::rand_uniform(dev, &[n], DType::F32, 0.0, 1e-6, seed + 3)?;
    let cfg = AdamW::default();
    let mut step = 0u64;
    Ok(Box::new(move || {
        step += 1;
        ops::adamw_step(&mut p, &g, &mut m, &mut v, &cfg, step)?;
        Ok(vec![])
    }))
}

fn main() {
    harness::run("optim", |_| vec![case(DType::F32, N), case(DType::BF16, N)]);
}
