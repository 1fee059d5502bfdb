//! What the row-operation tests (softmax, the norms, cross-entropy) share: the error model's
//! constants, the shapes and values they draw, the kernel paths they pin, and finite
//! differences for checking the f64 references.

use super::*;
use kernels::{DType, Tensor};
use proptest::prelude::*;

pub const E: f64 = 1.0 / (1u64 << 24) as f64;

pub fn k_of(n: usize) -> f64 {
    let l = 64f64.max(8.0 * n.div_ceil(1024) as f64);
    l + (n.max(2) as f64).log2().ceil() + 16.0
}

pub fn tol(rtol: f64, atol: f64) -> Tol {
    Tol { rtol, atol }
}

/// Row lengths that select each kernel (see `host/rows.rs`, `row_plan`).
pub const COLS: [usize; 18] =
    [1, 2, 3, 31, 32, 33, 127, 128, 1000, 1024, 1031, 4096, 4097, 8192, 16384, 32768, 40000, 100003];

pub fn shapes() -> impl Strategy<Value = (usize, usize)> {
    (0..COLS.len(), 1usize..300).prop_map(|(c, r)| {
        let cols = COLS[c];
        let cap = if sanitizer() { 1 << 14 } else { 1 << 20 };
        (r.min((cap / cols).max(1)), cols)
    })
}

pub fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)]
}

/// Values with outliers: normal with scale 3, and 1% of entries 30x larger.
pub fn values(rng: &mut TestRng, n: usize, dt: DType) -> Vec<f32> {
    let mut v = draw(rng, n, dt, Draw::FINITE);
    for x in v.iter_mut() {
        if rng.unit() < 0.01 {
            *x = round_to(dt, *x * 30.0);
        }
    }
    v
}

pub fn bits(t: &Tensor) -> Result<Vec<u32>, String> {
    Ok(t.to_f32_vec().map_err(e)?.into_iter().map(f32::to_bits).collect())
}

/// Central difference of `f` along coordinate `i` of `x`.
pub fn fd(x: &[f64], i: usize, f: impl Fn(&[f64]) -> f64) -> f64 {
    let h = 1e-5 * x[i].abs().max(1.0);
    let (mut a, mut b) = (x.to_vec(), x.to_vec());
    a[i] += h;
    b[i] -= h;
    (f(&a) - f(&b)) / (2.0 * h)
}

pub fn check_fd(what: &str, analytic: f64, numeric: f64, scale: f64) -> Result<(), String> {
    if (analytic - numeric).abs() > 1e-6 * scale.max(1e-3) {
        return Err(format!(
            "{what}: the f64 reference gradient {analytic:e} disagrees with finite differences {numeric:e}"
        ));
    }
    Ok(())
}

/// Each kernel path once, deterministically, in every dtype: at few rows the fewest vectors a
/// thread that one wave allows, v1 (128, 1024, 4096; 8192 f16/bf16), v2 (8192 f32, 16384
/// f16/bf16), v4/v8 (16384, 32768 f32), streaming aligned (40000) and unaligned (1031, 100003);
/// and with enough rows (at least 4 per SM) for the wide groups of short rows (four vectors a
/// thread).
pub fn paths() -> Vec<(usize, usize)> {
    let paths =
        [(300, 128), (64, 1024), (16, 4096), (8, 8192), (4, 16384), (3, 32768), (2, 40000), (33, 1031), (2, 100003)];
    let wide = if sanitizer() { vec![] } else { vec![(2048, 128), (600, 1024), (700, 24)] };
    paths.into_iter().chain(wide).collect()
}

/// Fewer rows than four an SM: the forwards take as many threads a row as one wave of blocks
/// allows (host: `fwd_row_plan`), one vector a thread up to 1024 vectors a row. The shapes and
/// the instance each must run.
pub const FEW_ROWS_FORWARD: [(usize, usize, DType, &str); 4] = [
    (8, 4096, DType::F32, "_fwd_v1_"),
    (8, 8192, DType::F32, "_fwd_v2_"),
    (8, 4096, DType::BF16, "_fwd_v1_"),
    (8, 16384, DType::BF16, "_fwd_v2_"),
];
