//! GPU tests of tensor creation: fill, zeros, and the seeded uniform and normal generators, whose
//! every element the CPU recomputes from the same Philox4x32-10 code.

mod common;

use common::*;
use kernels::{DType, Device, Tensor};
use kernels_gpu::init::{normal_at, uniform_at};
use proptest::prelude::*;
use std::process::ExitCode;

fn uniform_case(dev: &Device, dt: DType, n: usize, seed: u64) -> Result<(), String> {
    let t = Tensor::rand_uniform(dev, &[n], dt, -2.0, 5.0, seed).map_err(e)?.to_f32_vec().map_err(e)?;
    for (i, &v) in t.iter().enumerate() {
        let want = round_to(dt, uniform_at(seed, i as u64, -2.0, 5.0));
        if v.to_bits() != want.to_bits() {
            return Err(format!("uniform {dt:?} seed {seed}: element {i} is {v}, the CPU computes {want}"));
        }
        if !(-2.0..=5.0).contains(&v) {
            return Err(format!("uniform value {v} outside [-2, 5]"));
        }
    }
    Ok(())
}

fn normal_case(dev: &Device, dt: DType, n: usize, seed: u64) -> Result<(), String> {
    let t = Tensor::rand_normal(dev, &[n], dt, 1.5, 2.0, seed).map_err(e)?.to_f32_vec().map_err(e)?;
    for (i, &v) in t.iter().enumerate() {
        // The same code runs on both sides; allow a few ulp in case the two compilers order a
        // floating-point expression differently.
        let want = round_to(dt, normal_at(seed, i as u64, 1.5, 2.0));
        if !close(dt, v, want as f64, Tol { rtol: 4.0 * common::reference::U, atol: 0.0 }) {
            return Err(format!("normal {dt:?} seed {seed}: element {i} is {v}, the CPU computes {want}"));
        }
    }
    Ok(())
}

fn normal_moments(dev: &Device) -> Result<(), String> {
    let n = 1usize << 24;
    let v = Tensor::rand_normal(dev, &[n], DType::F32, 0.0, 1.0, 1234).map_err(e)?.to_f32_vec().map_err(e)?;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
    let tails = v.iter().filter(|x| x.abs() > 3.0).count() as f64 / n as f64;
    if mean.abs() > 5.0 / (n as f64).sqrt() || (var - 1.0).abs() > 5.0 * 2f64.sqrt() / (n as f64).sqrt() {
        return Err(format!("normal moments off: mean {mean}, variance {var}"));
    }
    // P(|z| > 3) = 0.0026998
    if (tails - 0.0026998).abs() > 5.0 * (0.0027f64 / n as f64).sqrt() {
        return Err(format!("normal tails off: P(|z| > 3) = {tails}"));
    }
    Ok(())
}

fn fill_case(dev: &Device, dt: DType, n: usize, v: f32) -> Result<(), String> {
    let t = Tensor::full(dev, &[n], dt, v).map_err(e)?.to_f32_vec().map_err(e)?;
    let want = round_to(dt, v);
    // NaN payloads may differ between conversions; any NaN is the same value.
    let same = |x: &f32| x.to_bits() == want.to_bits() || (x.is_nan() && want.is_nan());
    if let Some(i) = t.iter().position(|x| !same(x)) {
        return Err(format!("full({v}) {dt:?}: element {i} is {}", t[i]));
    }
    let z = Tensor::zeros(dev, &[n], dt).map_err(e)?.to_f32_vec().map_err(e)?;
    if z.iter().any(|x| x.to_bits() != 0) {
        return Err(format!("zeros {dt:?} has a non-zero element"));
    }
    Ok(())
}

fn seeds_differ(dev: &Device) -> Result<(), String> {
    let a = Tensor::rand_uniform(dev, &[1000], DType::F32, 0.0, 1.0, 1).map_err(e)?.to_f32_vec().map_err(e)?;
    let b = Tensor::rand_uniform(dev, &[1000], DType::F32, 0.0, 1.0, 2).map_err(e)?.to_f32_vec().map_err(e)?;
    let c = Tensor::rand_uniform(dev, &[1000], DType::F32, 0.0, 1.0, 1).map_err(e)?.to_f32_vec().map_err(e)?;
    if a == b || a != c {
        return Err("the same seed must give the same tensor, another seed another".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for dt in DType::ALL {
        tests.push(test(format!("uniform/{dt:?}"), move |dev: &Device| {
            prop(16, (sizes(), any::<u64>()), |(n, seed)| uniform_case(dev, dt, n, seed))
        }));
        tests.push(test(format!("normal/{dt:?}"), move |dev: &Device| {
            prop(16, (sizes(), any::<u64>()), |(n, seed)| normal_case(dev, dt, n, seed))
        }));
        tests.push(test(format!("fill/{dt:?}"), move |dev: &Device| {
            let values = prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(-0.0f32), Just(1e-45f32), any::<f32>()];
            prop(16, (sizes(), values), |(n, v)| fill_case(dev, dt, n, v))
        }));
    }
    tests.push(test("normal/moments", normal_moments));
    tests.push(test("seeds", seeds_differ));
    run(tests)
}
