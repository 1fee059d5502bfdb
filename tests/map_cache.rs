//! GPU tests of the device's cache of TMA tensor maps (`host/device/map_cache.rs`), through the
//! bf16 GEMM, whose Hopper path (sm_90a) reads its operands through cached maps: a product
//! repeated is cached on its second call, launches no write of its maps from its third on and
//! gives the same bits, a product on buffers freed and
//! allocated again is still right, alternating shapes stay right, and a full cache falls back to
//! a buffer of the call's own. Elsewhere no maps are used, and the counters must not move.
//!
//! One test function, so that the device's counters see only its own calls (libtest-mimic runs
//! trials in parallel).
//!
//! # Tolerance
//! Inputs drawn already rounded to bf16, products into f32: each element within
//! `tc_bound_terms(K, s) * 2^-23 * sum_k |a_k b_k|` of the f64 product plus one f32 ulp, the
//! worst case of the tensor cores' f32 accumulation (tests/common/reference.rs, as in
//! tests/gemm_tc.rs), `s` the most K slices a split-K plan makes.

mod common;

use common::reference::{U, dot_ref, tc_bound_terms};
use common::*;
use kernels::ops::{self, Gemm};
use kernels::{DType, Device, Tensor, TensorMapCacheStats};
use std::process::ExitCode;

/// One product's operands on the host (`m x k` and `k x n`, row-major, rounded to bf16).
struct Product {
    m: usize,
    n: usize,
    k: usize,
    a: Vec<f32>,
    b: Vec<f32>,
}

impl Product {
    fn random(seed: u64, m: usize, n: usize, k: usize) -> Product {
        let mut rng = TestRng::new(seed);
        let mut v = |len: usize| (0..len).map(|_| round_to(DType::BF16, rng.normal() as f32)).collect::<Vec<_>>();
        let a = v(m * k);
        let b = v(k * n);
        Product { m, n, k, a, b }
    }

    fn upload(&self, dev: &Device) -> Result<(Tensor, Tensor), String> {
        Ok((
            tensor(dev, &self.a, &[self.m, self.k], DType::BF16)?,
            tensor(dev, &self.b, &[self.k, self.n], DType::BF16)?,
        ))
    }

    /// `a @ b` into a NaN-filled f32 C, as bits.
    fn run(&self, dev: &Device, a: &Tensor, b: &Tensor) -> Result<Vec<u32>, String> {
        let mut c = nan_tensor(dev, &[self.m, self.n], DType::F32)?;
        ops::gemm(a, b, &mut c, Gemm::default()).map_err(e)?;
        Ok(c.to_f32_vec().map_err(e)?.iter().map(|v| v.to_bits()).collect())
    }

    /// Checks `got` (bits of C) against the f64 product (module notes).
    fn check(&self, what: &str, got: &[u32]) -> Result<(), String> {
        let splits = (self.k / 256).max(1);
        for i in 0..self.m {
            for j in 0..self.n {
                let (want, abs) =
                    dot_ref(self.k, |kk| self.a[i * self.k + kk] as f64, |kk| self.b[kk * self.n + j] as f64);
                let tol = Tol { rtol: 0.0, atol: tc_bound_terms(self.k, splits) * U * abs };
                let g = f32::from_bits(got[i * self.n + j]);
                if !close(DType::F32, g, want, tol) {
                    return Err(format!(
                        "{what}: {}x{}x{} C[{i}][{j}] = {g}, expected {want}, tolerance {tol:?}",
                        self.m, self.n, self.k
                    ));
                }
            }
        }
        Ok(())
    }
}

fn cache_test(dev: &Device) -> Result<(), String> {
    let hopper = dev.ptx_arch() == "sm_90a";
    let stats = || dev.tensor_map_cache_stats();
    let calls = |s: TensorMapCacheStats| s.hits + s.misses + s.bypassed;
    // Calls not cached for want of room (or under capture), not for being new.
    let full = |s: TensorMapCacheStats| s.bypassed - s.first_seen;
    let start = stats();

    // (a) The same product three times: the first call writes a buffer of its own (a set of
    // maps is cached the second time it is asked for), the second caches its maps, the third
    // hits (no write launched); all give the same bits.
    let p = Product::random(1, 256, 384, 520);
    let (a, b) = p.upload(dev)?;
    let first = p.run(dev, &a, &b)?;
    let s1 = stats();
    let second = p.run(dev, &a, &b)?;
    let s2 = stats();
    let third = p.run(dev, &a, &b)?;
    let s3 = stats();
    p.check("first call", &first)?;
    if first != second || first != third {
        return Err("the repeated identical products differ from the first".into());
    }
    if hopper {
        if s1.first_seen != start.first_seen + 1 || calls(s1) != calls(start) + 1 {
            return Err(format!("the first product should not have been cached: {start:?} -> {s1:?}"));
        }
        if s2.misses != s1.misses + 1 || calls(s2) != calls(s1) + 1 {
            return Err(format!("the second product should have been cached: {s1:?} -> {s2:?}"));
        }
        if s3.hits != s2.hits + 1 || calls(s3) != calls(s2) + 1 {
            return Err(format!("the third identical product should have hit: {s2:?} -> {s3:?}"));
        }
    } else if s3 != start {
        return Err(format!("no tensor maps off sm_90a, yet the counters moved: {start:?} -> {s3:?}"));
    }

    // (b) The operands freed and others of the same shapes allocated (at the same addresses
    // when the allocator's cache hands the blocks back): whichever slot serves them, the product
    // is of the new values.
    drop((a, b));
    let q = Product::random(2, p.m, p.n, p.k);
    let (a, b) = q.upload(dev)?;
    q.check("reallocated operands", &q.run(dev, &a, &b)?)?;
    drop((a, b));

    // (c) Two shapes alternating, each on its own operands: every result right, and after the
    // second round (the first asks for each set of maps once, the second caches it) only hits.
    let shapes = [Product::random(3, 128, 136, 64), Product::random(4, 72, 264, 200)];
    let ops: Vec<(Tensor, Tensor)> = shapes.iter().map(|p| p.upload(dev)).collect::<Result<_, _>>()?;
    let mut after_two = stats();
    for round in 0..12 {
        for (p, (a, b)) in shapes.iter().zip(&ops) {
            p.check(&format!("alternating shapes, round {round}"), &p.run(dev, a, b)?)?;
        }
        if round == 1 {
            after_two = stats();
        }
    }
    let s3 = stats();
    if hopper && (s3.misses != after_two.misses || s3.hits != after_two.hits + 20) {
        return Err(format!("alternating shapes after the second round should only hit: {after_two:?} -> {s3:?}"));
    }

    // (d) Distinct products (M grows by one), each twice, until the cache is full: later ones
    // take a buffer of their own and are still right, and the first product (its slot, if the operands come
    // back at the same addresses; a buffer of its own if not) gives the same bits.
    if hopper {
        let b = tensor(dev, &p.b, &[p.k, p.n], DType::BF16)?;
        let rows = p.m + 8000;
        let big = Product::random(5, rows, 8, 64);
        let a_big = tensor(dev, &big.a, &[rows, 64], DType::BF16)?;
        let b_small = tensor(dev, &big.b, &[64, 8], DType::BF16)?;
        let mut full_at = None;
        for m in 1..=rows {
            let a = a_big.narrow(0, 0, m).map_err(e)?;
            let mut c = Tensor::empty(dev, &[m, 8], DType::F32).map_err(e)?;
            ops::gemm(&a, &b_small, &mut c, Gemm::default()).map_err(e)?;
            ops::gemm(&a, &b_small, &mut c, Gemm::default()).map_err(e)?;
            if full(stats()) > full(s3) {
                full_at = Some(m);
                break;
            }
        }
        let Some(m) = full_at else {
            return Err(format!("{rows} distinct products did not fill the cache: {:?}", stats()));
        };
        let s4 = stats();
        // The bypassing product and one more, checked.
        for m in [m, m + 1] {
            let sub = Product { m, n: 8, k: 64, a: big.a[..m * 64].to_vec(), b: big.b.clone() };
            let a = a_big.narrow(0, 0, m).map_err(e)?;
            sub.check("a full cache", &sub.run(dev, &a, &b_small)?)?;
        }
        let s5 = stats();
        if s5.entries != s4.entries || full(s5) != full(s4) + 2 {
            return Err(format!("a full cache should bypass: {s4:?} -> {s5:?}"));
        }
        let a = tensor(dev, &p.a, &[p.m, p.k], DType::BF16)?;
        let again = p.run(dev, &a, &b)?;
        p.check("the first product with a full cache", &again)?;
        if again != first {
            return Err("the first product changed bits with a full cache".into());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    run(vec![test("map_cache/gemm", cache_test)])
}
