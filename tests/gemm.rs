//! GPU tests of the GEMM (`ops::gemm`, `ops::gemm_ex`, `ops::matmul`) and the linear layer
//! (`ops::linear`, `ops::linear_train`, `ops::linear_backward`), against f64 references.
//!
//! # Tolerance
//! Each element of C is a sum of K products accumulated in f32 with FMAs, in one running sum
//! per thread (or, under split-K, `s` running sums added in order). The classical bound for
//! such a recursive sum is `|c - c_exact| <= gamma * S`, with `S = sum_k |a_ik b_kj|` and `gamma =
//! (K + s) u / (1 - (K + s) u)`, `u = 2^-24` the unit roundoff; `s` is taken at its most,
//! `max(1, K / 256)` (the GEMM never cuts K into slices shorter than 256). The epilogue adds a
//! few roundings of the value itself (`alpha *`, `beta * C +`, `+ bias`: at most 3 ulp of the
//! running scale).
//! So every element must satisfy
//!     |c - c_exact| <= (K + s + 4) * 2^-24 * (|alpha| S + |beta c_old| + |bias|) + activation,
//! where an activation adds its own error bound (`act_fwd_tol`, the same as the element-wise
//! tests) and passes the input's error through with its Lipschitz constant (1 for relu, below
//! 1.13 for GELU and 1.1 for SiLU; 1.2 is used). This is a worst-case bound, not a fitted one:
//! no test tolerance was widened to pass. The tests also report the relative Frobenius error,
//! which for random data sits near `sqrt(K) u`, far inside the bound.
//!
//! The tensor-core precisions sum on the tensor core, whose additions truncate (see
//! `Case::bound_terms`). Plain TF32 (`Precision::Tf32`) also rounds each operand to TF32 before
//! the exact tensor-core product (see `Case::operand_terms`).
//!
//! Outputs are poisoned (NaN) before each product; with `beta = 0`, C is never read, so the NaN
//! must not leak; with `beta != 0`, C holds random values.

mod common;

use common::reference::{U, act_bwd, act_bwd_tol, act_fwd, act_fwd_tol};
use common::*;
use kernels::ops::{self, Activation, Gemm, Precision};
use kernels::{DType, Device, Error, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

/// A batch of row-major matrices on the host, as f32 values (what the GPU sees) .
#[derive(Clone, Debug)]
struct Mats {
    batch: Option<usize>,
    rows: usize,
    cols: usize,
    v: Vec<f32>,
}

impl Mats {
    fn random(rng: &mut TestRng, batch: Option<usize>, rows: usize, cols: usize) -> Mats {
        let n = batch.unwrap_or(1) * rows * cols;
        Mats { batch, rows, cols, v: (0..n).map(|_| rng.normal() as f32).collect() }
    }
    fn shape(&self) -> Vec<usize> {
        match self.batch {
            Some(b) => vec![b, self.rows, self.cols],
            None => vec![self.rows, self.cols],
        }
    }
    /// Element `(r, c)` of matrix `z` (a 2-D operand is the same for every z).
    fn at(&self, z: usize, r: usize, c: usize) -> f64 {
        let z = if self.batch.is_some() { z } else { 0 };
        self.v[(z * self.rows + r) * self.cols + c] as f64
    }
    fn upload(&self, dev: &Device) -> Result<Tensor, String> {
        Tensor::from_slice(dev, &self.v, &self.shape()).map_err(e)
    }
}

/// One product: shapes, options and the data.
#[derive(Clone, Debug)]
struct Case {
    g: Gemm,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: Mats,
    b: Mats,
    c0: Option<Mats>,
    bias: Option<Vec<f32>>,
    act: Activation,
}

fn make_case(
    seed: u64,
    g: Gemm,
    batch: Option<usize>,
    (m, n, k): (usize, usize, usize),
    share: u8,
    bias: bool,
    act: Activation,
) -> Case {
    let mut rng = TestRng::new(seed);
    // share: 0 both batched, 1 A shared (2-D), 2 B shared.
    let ba = if share == 1 { None } else { batch };
    let bb = if share == 2 { None } else { batch };
    let (ar, ac) = if g.trans_a { (k, m) } else { (m, k) };
    let (br, bc) = if g.trans_b { (n, k) } else { (k, n) };
    let a = Mats::random(&mut rng, ba, ar, ac);
    let b = Mats::random(&mut rng, bb, br, bc);
    let c0 = (g.beta != 0.0).then(|| Mats::random(&mut rng, batch, m, n));
    let bias = bias.then(|| (0..n).map(|_| rng.normal() as f32).collect());
    Case { g, batch: batch.unwrap_or(1), m, n, k, a, b, c0, bias, act }
}

impl Case {
    fn a_op(&self, z: usize, i: usize, kk: usize) -> f64 {
        if self.g.trans_a { self.a.at(z, kk, i) } else { self.a.at(z, i, kk) }
    }
    fn b_op(&self, z: usize, kk: usize, j: usize) -> f64 {
        if self.g.trans_b { self.b.at(z, j, kk) } else { self.b.at(z, kk, j) }
    }
    /// The exact pre-activation value and its error bound before the activation.
    fn exact(&self, z: usize, i: usize, j: usize, splits: usize) -> (f64, f64) {
        let (mut s, mut abs) = (0.0f64, 0.0f64);
        for kk in 0..self.k {
            let p = self.a_op(z, i, kk) * self.b_op(z, kk, j);
            s += p;
            abs += p.abs();
        }
        let alpha = self.g.alpha as f64;
        let mut v = if alpha == 0.0 { 0.0 } else { alpha * s };
        let products = alpha.abs() * abs;
        let mut scale = products;
        if let Some(c0) = &self.c0 {
            let old = c0.at(z, i, j);
            v += self.g.beta as f64 * old;
            scale += (self.g.beta as f64 * old).abs();
        }
        if let Some(b) = &self.bias {
            v += b[j] as f64;
            scale += (b[j] as f64).abs();
        }
        (v, (U / 2.0) * (self.bound_terms(splits) * scale + self.operand_terms(splits) * products))
    }

    /// The error bound's multiple of `u S` (module header): `K + s + 4` for f32 FMAs. For
    /// 3xTF32, each product is off by at most `3 * 2^-21 = 24 u` of `|a b|` (the split), and the
    /// tensor core's additions truncate: at most one ulp (`2 u`) of the running sum for each of
    /// the three products of 8 terms per 8 steps of K (`0.75 K` ulps, `1.5 K u`), plus one
    /// rounded add per stage of 32 and the slices and the epilogue as above: `2 K + s + 32`
    /// covers them.
    fn bound_terms(&self, splits: usize) -> f64 {
        match self.g.precision {
            None | Some(Precision::Highest) => (self.k + splits + 4) as f64,
            Some(_) => (2 * self.k + splits + 32) as f64,
        }
    }

    /// Plain TF32's further error, a multiple of `u |alpha| S` (0 for the other precisions).
    /// Each operand is rounded to TF32 to nearest: `a' = a (1 + da)`, `|da| <= 2^-11` (half a step
    /// of 10 mantissa bits; normal values, as the random data are), and likewise `b'`. The tensor
    /// core multiplies `a' b'` exactly, so each term errs by `|a b| |da + db + da db| <= (2^-10 +
    /// 2^-22) |a b| = (2^14 + 4) u |a b|`: `16388 u S` over the sum. The summation of the `a' b'`
    /// then errs as [`Case::bound_terms`] says, of `S' = sum |a' b'| <= (1 + 2^-10 + 2^-22) S`
    /// instead of `S`: `(2 K + s + 32) (2^-10 + 2^-22) u S` more.
    fn operand_terms(&self, splits: usize) -> f64 {
        match self.g.precision {
            Some(Precision::Tf32) => {
                let rounding = 2f64.powi(-10) + 2f64.powi(-22);
                rounding / (U / 2.0) + self.bound_terms(splits) * rounding
            }
            _ => 0.0,
        }
    }
}

/// Runs the case on the GPU and checks `rows` of every matrix (all rows when `None`).
fn check(dev: &Device, cs: &Case, rows: Option<&[usize]>) -> Result<(), String> {
    let a = cs.a.upload(dev)?;
    let b = cs.b.upload(dev)?;
    let cshape: Vec<usize> =
        if cs.a.batch.is_some() || cs.b.batch.is_some() { vec![cs.batch, cs.m, cs.n] } else { vec![cs.m, cs.n] };
    let mut c = match &cs.c0 {
        Some(c0) => c0.upload(dev)?,
        None => {
            let mut t = Tensor::empty(dev, &cshape, DType::F32).map_err(e)?;
            t.fill_(f32::NAN).map_err(e)?;
            t
        }
    };
    let bias = cs.bias.as_ref().map(|v| Tensor::from_slice(dev, v, &[cs.n])).transpose().map_err(e)?;
    ops::gemm_ex(&a, &b, &mut c, cs.g, bias.as_ref(), cs.act).map_err(e)?;
    let got = c.to_vec::<f32>().map_err(e)?;
    // The most K slices a split-K plan makes: each is at least 256 long (host/ops/gemm.rs).
    let splits = (cs.k / 256).max(1);
    let all: Vec<usize> = (0..cs.m).collect();
    let rows = rows.unwrap_or(&all);
    let (mut err2, mut ref2) = (0.0f64, 0.0f64);
    for z in 0..cs.batch {
        for &i in rows {
            for j in 0..cs.n {
                let (pre, bound) = cs.exact(z, i, j, splits);
                let want = act_fwd(cs.act, pre);
                let t = act_fwd_tol(cs.act, want);
                let lip = if matches!(cs.act, Activation::Identity | Activation::Relu) { 1.0 } else { 1.2 };
                let tol = lip * bound + t.rtol * want.abs() + t.atol + 1e-38;
                let g = got[(z * cs.m + i) * cs.n + j] as f64;
                if g.is_nan() || (g - want).abs() > tol {
                    return Err(format!(
                        "{}x{}x{} batch {} {:?} {:?}: C[{z}][{i}][{j}] = {g}, expected {want} (pre-activation {pre}), tolerance {tol:e}",
                        cs.m, cs.n, cs.k, cs.batch, cs.g, cs.act
                    ));
                }
                err2 += (g - want).powi(2);
                ref2 += want.powi(2);
            }
        }
    }
    let rel = if ref2 > 0.0 { (err2 / ref2).sqrt() } else { 0.0 };
    // The worst-case bound in Frobenius form, as a second check. It bounds the product's error
    // alone: an activation other than relu adds its own rounding (the per-element check above
    // allows for it), which for a few elements near a zero of GELU or SiLU is larger relative to
    // the output than K u (1x1x4 under GELU: 1.1e-6).
    let plain = matches!(cs.act, Activation::Identity | Activation::Relu);
    if cs.k > 0 && plain && rel > (cs.bound_terms(splits) + cs.operand_terms(splits)) * U {
        return Err(format!("{}x{}x{}: relative Frobenius error {rel:e} beyond K u", cs.m, cs.n, cs.k));
    }
    Ok(())
}

fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        Just(1),
        Just(2),
        Just(3),
        Just(4),
        Just(5),
        Just(7),
        Just(8),
        Just(31),
        Just(33),
        Just(127),
        Just(128),
        Just(129),
        Just(131),
        Just(200),
        Just(256),
        Just(257),
        1usize..300,
    ]
}

fn acts() -> impl Strategy<Value = Activation> {
    prop_oneof![
        Just(Activation::Identity),
        Just(Activation::Relu),
        Just(Activation::Gelu),
        Just(Activation::GeluTanh),
        Just(Activation::Silu),
    ]
}

fn precisions() -> impl Strategy<Value = Precision> {
    prop_oneof![Just(Precision::Highest), Just(Precision::Tf32x3Always), Just(Precision::Tf32)]
}

/// The ways of computing an f32 product: FMAs, 3xTF32, plain TF32.
const PRECISIONS: [Precision; 3] = [Precision::Highest, Precision::Tf32x3Always, Precision::Tf32];

fn random_products(dev: &Device) -> Result<(), String> {
    let strat = (
        (any::<bool>(), any::<bool>()),
        (dim(), dim(), dim()),
        prop_oneof![Just(None), (1usize..4).prop_map(Some)],
        0u8..3,
        (prop_oneof![Just(1.0f32), Just(0.0), -2.0f32..2.0], prop_oneof![Just(0.0f32), Just(1.0), -2.0f32..2.0]),
        any::<bool>(),
        (acts(), precisions()),
        any::<u64>(),
    );
    prop(144, strat, |((ta, tb), mnk, batch, share, (alpha, beta), bias, (act, precision), seed)| {
        let g = Gemm { trans_a: ta, trans_b: tb, alpha, beta, precision: Some(precision) };
        let share = if batch.is_some() { share } else { 0 };
        check(dev, &make_case(seed, g, batch, mnk, share, bias, act), None)
    })
}

/// Sizes where the kernel's fast paths and the planner's choices matter, checked on sampled rows
/// (the f64 reference of a whole 4096^3 product would take minutes).
fn large_products(dev: &Device) -> Result<(), String> {
    let big = if sanitizer() { 300 } else { 1024 };
    let rows = [0usize, 1, 63, 64, 127, 128, 129, 255];
    let shapes = [
        (big, big, big),
        (big + 3, big - 5, 513),
        // Split-K: 128 x 4096 has 32 tiles; K = 8192 splits.
        (128, if sanitizer() { 512 } else { 4096 }, 8192),
        // Prime K, split with a shorter last slice.
        (64, 64, 100_003),
        // Odd leading dimensions: no 16-byte loads.
        (129, 131, 257),
        // Skinny K.
        (big, big, 3),
        // Enough 128 x 128 tiles to fill the GPU without a split (144 for 132 SMs).
        (1536, 1544, if sanitizer() { 64 } else { 300 }),
    ];
    for precision in PRECISIONS {
        for (i, &(m, n, k)) in shapes.iter().enumerate() {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                let g = Gemm { trans_a: ta, trans_b: tb, alpha: 1.0, beta: 0.0, precision: Some(precision) };
                let cs = make_case(1000 + i as u64, g, None, (m, n, k), 0, i % 2 == 0, Activation::Identity);
                let r: Vec<usize> = rows.iter().copied().filter(|&r| r < m).chain([m - 1]).collect();
                check(dev, &cs, Some(&r))?;
            }
        }
        // The fused epilogue on the split-K path and on a large tile grid.
        for (i, act) in [Activation::Relu, Activation::Gelu, Activation::Silu].into_iter().enumerate() {
            let g = Gemm { trans_a: false, trans_b: true, alpha: 0.5, beta: 0.75, precision: Some(precision) };
            let cs = make_case(2000 + i as u64, g, None, (128, 1000, 4096), 0, true, act);
            check(dev, &cs, Some(&[0, 5, 127]))?;
            let cs = make_case(3000 + i as u64, g, None, (big, big, 64), 0, true, act);
            check(dev, &cs, Some(&[0, 77, big - 1]))?;
        }
    }
    Ok(())
}

/// NaN and infinity in A reach exactly their rows of C; beta = 0 never reads C; alpha = 0 skips
/// the product (no inf * 0).
fn ieee(dev: &Device) -> Result<(), String> {
    let (m, n, k) = (130usize, 70usize, 40usize);
    let mut rng = TestRng::new(7);
    let mut a = Mats::random(&mut rng, None, m, k);
    let mut b = Mats::random(&mut rng, None, k, n);
    a.v[3 * k + 5] = f32::NAN;
    // A NaN whose payload lies in the bits TF32 drops (3xTF32 rounds them away from `hi`).
    a.v[7 * k + 2] = f32::from_bits(0x7f80_0001);
    // NaNs whose top mantissa bits are all set (the GPU's own NaN, and a negative one): adding
    // half a TF32 step to their bits carries out of the exponent, to a zero or a denormal.
    a.v[50 * k + 9] = f32::from_bits(0x7fff_ffff);
    a.v[60 * k + 30] = f32::from_bits(0xffff_f000);
    a.v[100 * k + 1] = f32::INFINITY;
    // Row 120 of A and column 9 of B: denormals only (products near 1e-76 underflow to 0; the
    // rows of A that meet column 9 must still be finite, and row 120 times normal B is a sum
    // of denormals that must not be flushed).
    for kk in 0..k {
        a.v[120 * k + kk] = f32::from_bits(0x0040_0000 + kk as u32 * 4099) * if kk % 2 == 0 { 1.0 } else { -1.0 };
        b.v[kk * n + 9] = f32::from_bits(0x0000_1000 + kk as u32 * 77);
    }
    // Column 40 of B: minus infinity at one K.
    b.v[11 * n + 40] = f32::NEG_INFINITY;
    let (ta, tb) = (a.upload(dev)?, b.upload(dev)?);
    for precision in PRECISIONS {
        let mut c = Tensor::full(dev, &[m, n], DType::F32, f32::NAN).map_err(e)?;
        ops::gemm(&ta, &tb, &mut c, Gemm { precision: Some(precision), ..Gemm::default() }).map_err(e)?;
        let got = c.to_vec::<f32>().map_err(e)?;
        for i in 0..m {
            for j in 0..n {
                let g = got[i * n + j];
                // IEEE: inf * x is +-inf for x != 0, and a sum holding +inf and -inf is NaN.
                let ok = match (i, j) {
                    (3 | 7 | 50 | 60, _) => g.is_nan(),
                    (100, _) | (_, 40) => g.is_nan() || g.is_infinite(),
                    (120, _) => {
                        let exact: f64 = (0..k).map(|kk| a.at(0, 120, kk) * b.at(0, kk, j)).sum();
                        let scale: f64 = (0..k).map(|kk| (a.at(0, 120, kk) * b.at(0, kk, j)).abs()).sum();
                        // 3xTF32 holds a value below 2^-115 to 2^-136 absolute (gemm_tf32x3.rs:
                        // TF32 has no bits below that), so each product is off by up to 2^-136
                        // times the other factor (2^-135 leaves room for both roundings). Plain
                        // TF32 rounds A's denormals to 2^-137 absolute, and B's normal values to
                        // 2^-11 relative: 2^-11 of each product more.
                        let tiny = match precision {
                            Precision::Highest => 0.0,
                            _ => 2f64.powi(-135) * (0..k).map(|kk| b.at(0, kk, j).abs()).sum::<f64>(),
                        };
                        let rel = if precision == Precision::Tf32 { 1e-4 + 2f64.powi(-11) } else { 1e-4 };
                        g.is_finite() && ((g as f64) - exact).abs() <= rel * scale + tiny + 1e-44
                    }
                    _ => g.is_finite(),
                };
                if !ok {
                    return Err(format!("{precision:?}: C[{i}][{j}] = {g}"));
                }
            }
        }
    }
    // alpha = 0, beta = 2: C = 2 C exactly, infinities of A notwithstanding.
    let c0: Vec<f32> = (0..m * n).map(|i| i as f32 * 0.25 - 7.0).collect();
    let mut c = Tensor::from_slice(dev, &c0, &[m, n]).map_err(e)?;
    ops::gemm(&ta, &tb, &mut c, Gemm { alpha: 0.0, beta: 2.0, ..Gemm::default() }).map_err(e)?;
    let got = c.to_vec::<f32>().map_err(e)?;
    if let Some(i) = (0..m * n).find(|&i| got[i] != 2.0 * c0[i]) {
        return Err(format!("alpha = 0: C[{i}] = {}, expected {}", got[i], 2.0 * c0[i]));
    }
    // k = 0: C = act(beta C + bias).
    let (a0, b0) =
        (Tensor::zeros(dev, &[m, 0], DType::F32).map_err(e)?, Tensor::zeros(dev, &[0, n], DType::F32).map_err(e)?);
    let bias: Vec<f32> = (0..n).map(|j| j as f32 - 30.0).collect();
    let tbias = Tensor::from_slice(dev, &bias, &[n]).map_err(e)?;
    let mut c = Tensor::full(dev, &[m, n], DType::F32, f32::NAN).map_err(e)?;
    ops::gemm_ex(&a0, &b0, &mut c, Gemm::default(), Some(&tbias), Activation::Relu).map_err(e)?;
    let got = c.to_vec::<f32>().map_err(e)?;
    if let Some(i) = (0..m * n).find(|&i| got[i] != bias[i % n].max(0.0)) {
        return Err(format!("k = 0: C[{i}] = {}, expected relu(bias)", got[i]));
    }
    Ok(())
}

/// The same product twice gives the same bits (split-K included: no atomics).
fn deterministic(dev: &Device) -> Result<(), String> {
    for (m, n, k) in [(128usize, 2048usize, 8192usize), (300, 300, 300)] {
        let mut rng = TestRng::new(11);
        let a = Mats::random(&mut rng, None, m, k).upload(dev)?;
        let b = Mats::random(&mut rng, None, k, n).upload(dev)?;
        for precision in PRECISIONS {
            let run = || -> Result<Vec<f32>, String> {
                let mut c = Tensor::empty(dev, &[m, n], DType::F32).map_err(e)?;
                ops::gemm(&a, &b, &mut c, Gemm { precision: Some(precision), ..Gemm::default() }).map_err(e)?;
                c.to_vec::<f32>().map_err(e)
            };
            let (x, y) = (run()?, run()?);
            if x.iter().zip(&y).any(|(p, q)| p.to_bits() != q.to_bits()) {
                return Err(format!("{precision:?} {m}x{n}x{k}: two runs differ"));
            }
        }
    }
    Ok(())
}

/// `Device::set_f32_matmul_precision` reaches the products that name no precision (`matmul`,
/// the linear layer): with Tf32x3 set, `matmul` gives the bits of an explicit 3xTF32 product
/// (and not those of the FMA kernel); with Tf32 set, `matmul` and `linear` give those of explicit
/// plain TF32 products (and not those of the other two); set back, those of the FMA kernel. The
/// other tests name their precision or use shapes below the 3xTF32 threshold and the default
/// precision elsewhere, and this one sets it back before it returns. Plain TF32 reaches every
/// shape, so while it is set the tests that use the default precision wait ([`PRECISION`]).
fn device_precision(dev: &Device) -> Result<(), String> {
    let _alone = PRECISION.write().unwrap_or_else(|p| p.into_inner());
    let n = 512; // C of 2^18 elements, K = 512: 3xTF32 runs its own kernel.
    let mut rng = TestRng::new(21);
    let a = Mats::random(&mut rng, None, n, n).upload(dev)?;
    let b = Mats::random(&mut rng, None, n, n).upload(dev)?;
    let explicit = |p: Precision| -> Result<Vec<u32>, String> {
        let mut c = Tensor::empty(dev, &[n, n], DType::F32).map_err(e)?;
        ops::gemm(&a, &b, &mut c, Gemm { precision: Some(p), ..Gemm::default() }).map_err(e)?;
        Ok(c.to_vec::<f32>().map_err(e)?.iter().map(|v| v.to_bits()).collect())
    };
    let implicit = || -> Result<Vec<u32>, String> {
        Ok(ops::matmul(&a, &b).map_err(e)?.to_vec::<f32>().map_err(e)?.iter().map(|v| v.to_bits()).collect())
    };
    let (fma, tf32x3) = (explicit(Precision::Highest)?, explicit(Precision::Tf32x3)?);
    if fma == tf32x3 {
        return Err("the FMA and 3xTF32 kernels gave the same bits: the comparison below proves nothing".into());
    }
    if dev.f32_matmul_precision() != Precision::Highest {
        return Err(format!("default precision is {:?}", dev.f32_matmul_precision()));
    }
    dev.set_f32_matmul_precision(Precision::Tf32x3);
    let got = implicit();
    let reported = dev.f32_matmul_precision();
    dev.set_f32_matmul_precision(Precision::Highest);
    if reported != Precision::Tf32x3 || got? != tf32x3 {
        return Err("with Tf32x3 set, matmul did not run the 3xTF32 kernel".into());
    }
    if implicit()? != fma {
        return Err("set back to Highest, matmul did not run the FMA kernel".into());
    }

    // Plain TF32, through matmul and through the linear layer (x W^T: B transposed).
    let tf32 = explicit(Precision::Tf32)?;
    if tf32 == fma || tf32 == tf32x3 {
        return Err("the TF32 kernel gave the bits of the FMA or 3xTF32 kernel".into());
    }
    let linear_explicit = {
        let mut c = Tensor::empty(dev, &[n, n], DType::F32).map_err(e)?;
        let g = Gemm { precision: Some(Precision::Tf32), ..Gemm::new(false, true) };
        ops::gemm(&a, &b, &mut c, g).map_err(e)?;
        c.to_vec::<f32>().map_err(e)?.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
    };
    dev.set_f32_matmul_precision(Precision::Tf32);
    let got = implicit();
    let got_linear = ops::linear(&a, &b, None, Activation::Identity)
        .and_then(|y| y.to_vec::<f32>())
        .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>());
    let reported = dev.f32_matmul_precision();
    dev.set_f32_matmul_precision(Precision::Highest);
    if reported != Precision::Tf32 || got? != tf32 {
        return Err("with Tf32 set, matmul did not run the TF32 kernel".into());
    }
    if got_linear.map_err(e)? != linear_explicit {
        return Err("with Tf32 set, linear did not run the TF32 kernel".into());
    }
    Ok(())
}

fn errors(dev: &Device) -> Result<(), String> {
    let t = |s: &[usize]| Tensor::zeros(dev, s, DType::F32).map_err(e);
    let (a, b) = (t(&[4, 5])?, t(&[6, 7])?);
    let mut c = t(&[4, 7])?;
    let want = |r: kernels::Result<()>, what: &str| match r {
        Err(Error::InvalidArgument { op: "gemm", message }) => {
            if message.contains(what) {
                Ok(())
            } else {
                Err(format!("message {message:?} lacks {what:?}"))
            }
        }
        other => Err(format!("expected InvalidArgument about {what}, got {other:?}")),
    };
    want(ops::gemm(&a, &b, &mut c, Gemm::default()), "inner dimensions differ (5 and 6)")?;
    let b = t(&[5, 7])?;
    let mut c_bad = t(&[4, 8])?;
    want(ops::gemm(&a, &b, &mut c_bad, Gemm::default()), "C must be 4 x 7")?;
    let h = Tensor::zeros(dev, &[4, 5], DType::BF16).map_err(e)?;
    want(ops::gemm(&h, &b, &mut c, Gemm::default()), "both bf16 or both f16")?;
    let bias = t(&[8])?;
    want(ops::gemm_ex(&a, &b, &mut c, Gemm::default(), Some(&bias), Activation::Relu), "bias must have shape [7]")?;
    want(ops::gemm_ex(&a, &b, &mut c, Gemm::default(), None, Activation::Mish), "cannot be fused")?;
    let a3 = t(&[2, 4, 5])?;
    want(ops::gemm(&a3, &b, &mut c, Gemm::default()), "batched C")?;
    Ok(())
}

// --- the linear layer ---------------------------------------------------------------------------

/// f64 reference of `act(x W^T + b)` and its backward.
struct LinearRef {
    z: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
}

fn linear_ref(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    dy: &[f32],
    (rows, inp, out): (usize, usize, usize),
    act: Activation,
) -> LinearRef {
    let mut z = vec![0.0; rows * out];
    for r in 0..rows {
        for o in 0..out {
            z[r * out + o] = b[o] as f64 + (0..inp).map(|i| x[r * inp + i] as f64 * w[o * inp + i] as f64).sum::<f64>();
        }
    }
    let dz: Vec<f64> = z.iter().zip(dy).map(|(&zz, &g)| act_bwd(act, zz, g as f64)).collect();
    let mut dx = vec![0.0; rows * inp];
    let mut dw = vec![0.0; out * inp];
    let mut db = vec![0.0; out];
    for r in 0..rows {
        for o in 0..out {
            let d = dz[r * out + o];
            db[o] += d;
            for i in 0..inp {
                dx[r * inp + i] += d * w[o * inp + i] as f64;
                dw[o * inp + i] += d * x[r * inp + i] as f64;
            }
        }
    }
    LinearRef { z, dx, dw, db }
}

fn close(what: &str, got: &[f32], want: &[f64], tol: &[f64]) -> Result<(), String> {
    for (i, ((&g, &w), &t)) in got.iter().zip(want).zip(tol).enumerate() {
        if g.is_nan() || (g as f64 - w).abs() > t + 1e-30 {
            return Err(format!("{what}[{i}] = {g}, expected {w}, tolerance {t:e}"));
        }
    }
    Ok(())
}

/// The device's f32 product precision is one per process: [`device_precision`] holds this
/// exclusively while it changes it, the tests that rely on the default share it.
static PRECISION: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// The layer against [`linear_ref`]. Tolerances propagate the bounds of the module header:
/// `z` carries at most `(in + 4) u S_z` (S_z = sum |x w| + |b|); `y = act(z)` adds the
/// activation's own bound and passes z's error with slope <= 1.2; `dz = act'(z) dy` carries
/// the activation backward's bound plus z's error times |act''| <= 0.8 (GELU's maximum; SiLU's is
/// 0.5), or, for relu where |z| is within z's error, a whole |dy| (the sign may flip); the
/// products `dx = dz W`, `dW = dz^T x`, `db = sum dz` add their own `(terms + 4) u S` and pass dz's
/// error through `|W|`, `|x|`, 1.
fn linear_layer(dev: &Device) -> Result<(), String> {
    let _default_precision = PRECISION.read().unwrap_or_else(|p| p.into_inner());
    let u = U / 2.0;
    for (case, &(rows, inp, out, act)) in [
        (7usize, 33usize, 65usize, Activation::Relu),
        (130, 64, 200, Activation::Gelu),
        (64, 129, 31, Activation::Silu),
        (1, 1, 1, Activation::Identity),
        (300, 17, 10, Activation::Mish),
    ]
    .iter()
    .enumerate()
    {
        let mut rng = TestRng::new(500 + case as u64);
        let mut draw = |n: usize| (0..n).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
        let (x, w, b, dy) = (draw(rows * inp), draw(out * inp), draw(out), draw(rows * out));
        let r = linear_ref(&x, &w, &b, &dy, (rows, inp, out), act);
        let up = |v: &[f32], s: &[usize]| Tensor::from_slice(dev, v, s).map_err(e);
        // A 3-D input: the layer folds the leading dimensions.
        let (tx, tw, tb, tdy) =
            (up(&x, &[1, rows, inp])?, up(&w, &[out, inp])?, up(&b, &[out])?, up(&dy, &[1, rows, out])?);
        let y_inf = ops::linear(&tx, &tw, Some(&tb), act).map_err(e)?;
        let (y, saved) = ops::linear_train(&tx, &tw, Some(&tb), act).map_err(e)?;
        if y.shape() != [1, rows, out] {
            return Err(format!("y has shape {:?}", y.shape()));
        }
        let zerr: Vec<f64> = (0..rows * out)
            .map(|ro| {
                let (r_, o) = (ro / out, ro % out);
                let s = b[o].abs() as f64
                    + (0..inp).map(|i| (x[r_ * inp + i] as f64 * w[o * inp + i] as f64).abs()).sum::<f64>();
                (inp + 4) as f64 * u * s
            })
            .collect();
        let want_y: Vec<f64> = r.z.iter().map(|&z| act_fwd(act, z)).collect();
        let ytol: Vec<f64> = want_y
            .iter()
            .zip(&zerr)
            .map(|(&y, &ez)| {
                let t = act_fwd_tol(act, y);
                1.2 * ez + t.rtol * y.abs() + t.atol
            })
            .collect();
        close("linear y", &y_inf.to_vec::<f32>().map_err(e)?, &want_y, &ytol)?;
        close("linear_train y", &y.to_vec::<f32>().map_err(e)?, &want_y, &ytol)?;
        let g = ops::linear_backward(&tx, &tw, &y, &saved, &tdy, Some(&tb)).map_err(e)?;
        let mut dz_abs = vec![0.0; rows * out];
        let mut dz_err = vec![0.0; rows * out];
        for ro in 0..rows * out {
            let (z, d) = (r.z[ro], dy[ro] as f64);
            let dz = act_bwd(act, z, d);
            dz_abs[ro] = dz.abs();
            dz_err[ro] = match act {
                Activation::Identity => 0.0,
                Activation::Relu => {
                    if z.abs() <= zerr[ro] {
                        d.abs()
                    } else {
                        0.0
                    }
                }
                _ => {
                    let t = act_bwd_tol(act, z, d);
                    0.8 * d.abs() * zerr[ro] + t.rtol * dz.abs() + t.atol
                }
            };
        }
        let (mut tdx, mut tdw, mut tdb) = (vec![0.0; rows * inp], vec![0.0; out * inp], vec![0.0; out]);
        for ro in 0..rows {
            for o in 0..out {
                let (a, ea) = (dz_abs[ro * out + o], dz_err[ro * out + o]);
                tdb[o] += (rows + 4) as f64 * u * a + ea;
                for i in 0..inp {
                    let (wa, xa) = ((w[o * inp + i] as f64).abs(), (x[ro * inp + i] as f64).abs());
                    tdx[ro * inp + i] += (out + 4) as f64 * u * a * wa + ea * wa;
                    tdw[o * inp + i] += (rows + 4) as f64 * u * a * xa + ea * xa;
                }
            }
        }
        close("dx", &g.x.to_vec::<f32>().map_err(e)?, &r.dx, &tdx)?;
        close("dw", &g.weight.to_vec::<f32>().map_err(e)?, &r.dw, &tdw)?;
        close("db", &g.bias.ok_or("no bias gradient")?.to_vec::<f32>().map_err(e)?, &r.db, &tdb)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let tests = vec![
        test("gemm/random_products", random_products),
        test("gemm/large_products_sampled_rows", large_products),
        test("gemm/ieee", ieee),
        test("gemm/deterministic", deterministic),
        test("gemm/device_precision", device_precision),
        test("gemm/errors", errors),
        test("linear/forward_backward", linear_layer),
    ];
    run(tests)
}
