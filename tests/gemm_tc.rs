//! GPU tests of the bf16 and f16 GEMM on the tensor cores (`ops::gemm_fused`, and `gemm_ex`,
//! `gemm`, `matmul` given bf16 or f16 operands), against f64 references of the rounded inputs.
//!
//! # Tolerance
//! The inputs are drawn already rounded to bf16 (or f16), so the reference sees exactly what
//! the GPU sees. Each element must satisfy
//!     |d - d_exact| <= lip * tc_bound_terms(K, s) * 2^-23 * scale + act_tol + ulp_out(d_exact)
//! (+ 2^-23 |d_exact| with a residual, whose f32 addition rounds once), where `scale = |alpha|
//! sum_k |a_k b_k| + |beta C| + |bias| + |row bias|` and `tc_bound_terms`
//! (tests/common/reference.rs) derives the f32 accumulation's worst case on the tensor cores;
//! `lip` (1 for identity and relu, 1.2 for GELU and SiLU) passes that error through the
//! activation, `act_fwd_tol` is the activation's own error (as in the element-wise tests), and
//! `ulp_out` is one unit in the last place of the output dtype (2^-8 relative for bf16, 2^-11
//! for f16, 2^-24 for f32: the one rounding of the result; a whole ulp, as the f32 error may
//! carry a value across a rounding boundary). A worst-case bound, not a fitted one.
//!
//! Outputs are poisoned (NaN) before each product; with `beta = 0`, C is never read, so the NaN
//! must not leak, and every element must have been written.

mod common;

use common::reference::{U, act_fwd, act_fwd_tol, dot_ref, tc_bound_terms};
use common::*;
use kernels::ops::{self, Activation, Epilogue, Gemm};
use kernels::{DType, Device, Error, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

/// A batch of row-major matrices on the host, as f32 values already rounded to `dt`.
#[derive(Clone, Debug)]
struct Mats {
    batch: Option<usize>,
    rows: usize,
    cols: usize,
    dt: DType,
    v: Vec<f32>,
}

impl Mats {
    fn random(rng: &mut TestRng, dt: DType, batch: Option<usize>, rows: usize, cols: usize) -> Mats {
        let n = batch.unwrap_or(1) * rows * cols;
        Mats { batch, rows, cols, dt, v: (0..n).map(|_| round_to(dt, rng.normal() as f32)).collect() }
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
        tensor(dev, &self.v, &self.shape(), self.dt)
    }
}

/// One product: dtypes, shapes, options and the data.
#[derive(Clone, Debug)]
struct Case {
    input: DType,
    output: DType,
    g: Gemm,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: Mats,
    b: Mats,
    c0: Option<Mats>,
    bias: Option<Vec<f32>>,
    row_bias: Option<Vec<f32>>,
    residual: Option<Mats>,
    act: Activation,
}

/// Which parts of the epilogue a case has.
#[derive(Clone, Copy, Debug, Default)]
struct Parts {
    bias: bool,
    row_bias: bool,
    residual: bool,
}

#[allow(clippy::too_many_arguments)]
fn make_case(
    seed: u64,
    (input, output): (DType, DType),
    g: Gemm,
    batch: Option<usize>,
    (m, n, k): (usize, usize, usize),
    share: u8,
    parts: Parts,
    act: Activation,
) -> Case {
    let mut rng = TestRng::new(seed);
    // share: 0 both batched, 1 A shared (2-D), 2 B shared.
    let ba = if share == 1 { None } else { batch };
    let bb = if share == 2 { None } else { batch };
    let (ar, ac) = if g.trans_a { (k, m) } else { (m, k) };
    let (br, bc) = if g.trans_b { (n, k) } else { (k, n) };
    let a = Mats::random(&mut rng, input, ba, ar, ac);
    let b = Mats::random(&mut rng, input, bb, br, bc);
    let c_batch = if ba.is_some() || bb.is_some() { batch } else { None };
    let c0 = (g.beta != 0.0).then(|| Mats::random(&mut rng, output, c_batch, m, n));
    let mut vec = |len: usize| (0..len).map(|_| round_to(output, rng.normal() as f32)).collect::<Vec<_>>();
    let bias = parts.bias.then(|| vec(n));
    let row_bias = parts.row_bias.then(|| vec(m));
    let residual = parts.residual.then(|| Mats::random(&mut rng, output, c_batch, m, n));
    Case { input, output, g, batch: batch.unwrap_or(1), m, n, k, a, b, c0, bias, row_bias, residual, act }
}

impl Case {
    fn c_shape(&self) -> Vec<usize> {
        if self.a.batch.is_some() || self.b.batch.is_some() {
            vec![self.batch, self.m, self.n]
        } else {
            vec![self.m, self.n]
        }
    }

    /// The exact value of D[z][i][j] and its tolerance (module notes) for `splits` K slices.
    fn exact(&self, z: usize, i: usize, j: usize, splits: usize) -> (f64, Tol) {
        let (s, abs) = dot_ref(
            self.k,
            |kk| if self.g.trans_a { self.a.at(z, kk, i) } else { self.a.at(z, i, kk) },
            |kk| if self.g.trans_b { self.b.at(z, j, kk) } else { self.b.at(z, kk, j) },
        );
        let alpha = self.g.alpha as f64;
        let mut v = if alpha == 0.0 { 0.0 } else { alpha * s };
        let mut scale = alpha.abs() * abs;
        if let Some(c0) = &self.c0 {
            let old = self.g.beta as f64 * c0.at(z, i, j);
            v += old;
            scale += old.abs();
        }
        for add in [self.bias.as_ref().map(|b| b[j]), self.row_bias.as_ref().map(|b| b[i])].into_iter().flatten() {
            v += add as f64;
            scale += (add as f64).abs();
        }
        let mut want = act_fwd(self.act, v);
        let t = act_fwd_tol(self.act, want);
        let lip = if matches!(self.act, Activation::Identity | Activation::Relu) { 1.0 } else { 1.2 };
        let mut tol = Tol { rtol: t.rtol, atol: t.atol + lip * tc_bound_terms(self.k, splits) * U * scale };
        if let Some(r) = &self.residual {
            want += r.at(z, i, j);
            tol.rtol += U;
        }
        (want, tol)
    }

    /// Runs the case on the GPU and checks `rows` of every matrix (all rows when `None`).
    fn check(&self, dev: &Device, rows: Option<&[usize]>) -> Result<(), String> {
        let a = self.a.upload(dev)?;
        let b = self.b.upload(dev)?;
        let mut c = match &self.c0 {
            Some(c0) => c0.upload(dev)?,
            None => nan_tensor(dev, &self.c_shape(), self.output)?,
        };
        let vector = |v: &Option<Vec<f32>>| v.as_ref().map(|v| tensor(dev, v, &[v.len()], self.output)).transpose();
        let (bias, row_bias) = (vector(&self.bias)?, vector(&self.row_bias)?);
        let residual = self.residual.as_ref().map(|r| r.upload(dev)).transpose()?;
        let epi =
            Epilogue { bias: bias.as_ref(), row_bias: row_bias.as_ref(), act: self.act, residual: residual.as_ref() };
        ops::gemm_fused(&a, &b, &mut c, self.g, epi).map_err(e)?;
        if c.dtype() != self.output || c.shape() != self.c_shape() {
            return Err(format!("C became {:?} {:?}", c.dtype(), c.shape()));
        }
        let got = c.to_f32_vec().map_err(e)?;
        // The most K slices a split-K plan makes: each is at least 256 long (host/ops/gemm_tc.rs).
        let splits = (self.k / 256).max(1);
        // Rows not checked against the reference must still have been written: the inputs are
        // finite and small, so a non-finite value is a NaN of the poisoned output.
        if rows.is_some()
            && let Some(p) = got.iter().position(|v| !v.is_finite())
        {
            return Err(format!("{}x{}x{}: D element {p} not written ({})", self.m, self.n, self.k, got[p]));
        }
        let all: Vec<usize> = (0..self.m).collect();
        let rows = rows.unwrap_or(&all);
        for z in 0..self.batch {
            for &i in rows {
                for j in 0..self.n {
                    let (want, tol) = self.exact(z, i, j, splits);
                    let g = got[(z * self.m + i) * self.n + j];
                    if !close(self.output, g, want, tol) {
                        return Err(format!(
                            "{:?} -> {:?} {}x{}x{} batch {} {:?} {:?}: D[{z}][{i}][{j}] = {g}, expected {want}, tolerance {tol:?}",
                            self.input, self.output, self.m, self.n, self.k, self.batch, self.g, self.act
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        Just(1),
        Just(2),
        Just(3),
        Just(7),
        Just(8),
        Just(9),
        Just(16),
        Just(31),
        Just(33),
        Just(127),
        Just(128),
        Just(129),
        Just(131),
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

fn dtypes() -> impl Strategy<Value = (DType, DType)> {
    (
        prop_oneof![Just(DType::BF16), Just(DType::F16)],
        prop_oneof![Just(DType::BF16), Just(DType::F16), Just(DType::F32)],
    )
}

fn random_products(dev: &Device) -> Result<(), String> {
    let strat = (
        (dtypes(), any::<bool>(), any::<bool>()),
        (dim(), dim(), prop_oneof![4 => dim(), 1 => Just(1031usize)]),
        prop_oneof![Just(None), (1usize..4).prop_map(Some)],
        0u8..3,
        (prop_oneof![Just(1.0f32), Just(0.0), -2.0f32..2.0], prop_oneof![Just(0.0f32), Just(1.0), -2.0f32..2.0]),
        (any::<bool>(), any::<bool>(), any::<bool>()),
        acts(),
        any::<u64>(),
    );
    prop(96, strat, |((dts, ta, tb), mnk, batch, share, (alpha, beta), (bias, row_bias, residual), act, seed)| {
        let g = Gemm { trans_a: ta, trans_b: tb, alpha, beta, precision: None };
        let share = if batch.is_some() { share } else { 0 };
        let parts = Parts { bias, row_bias, residual };
        make_case(seed, dts, g, batch, mnk, share, parts, act).check(dev, None)
    })
}

/// Sizes where the tiles, the aligned and element-wise copies and the split-K plan matter,
/// checked on sampled rows (the f64 reference of a whole large product would take minutes).
fn large_products(dev: &Device) -> Result<(), String> {
    let big = if sanitizer() { 300 } else { 1024 };
    let rows = [0usize, 1, 15, 16, 63, 64, 127, 128, 129, 255];
    let shapes = [
        (big, big, big),
        (big + 3, big - 5, 513),
        // Split-K: 128 x 4096 and 16 x 4096 have 32 tiles; K = 4096 splits.
        (128, if sanitizer() { 512 } else { 4096 }, 4096),
        (16, if sanitizer() { 512 } else { 4096 }, 4096),
        // Prime K, split with a shorter last slice.
        (64, 64, 20_011),
        // Odd leading dimensions: element-wise copies, scalar stores.
        (129, 131, 257),
        // Skinny K.
        (big, big, 3),
    ];
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let dts = [(DType::BF16, DType::BF16), (DType::F16, DType::F32), (DType::BF16, DType::F16)][i % 3];
            let g = Gemm { trans_a: ta, trans_b: tb, ..Gemm::default() };
            let parts = Parts { bias: i % 2 == 0, ..Parts::default() };
            let cs = make_case(1000 + i as u64, dts, g, None, (m, n, k), 0, parts, Activation::Identity);
            let r: Vec<usize> = rows.iter().copied().filter(|&r| r < m).chain([m - 1]).collect();
            cs.check(dev, Some(&r))?;
        }
    }
    // The whole epilogue on the split-K path and on a large tile grid.
    for (i, act) in [Activation::Relu, Activation::Gelu, Activation::Silu].into_iter().enumerate() {
        let g = Gemm { trans_a: false, trans_b: true, alpha: 0.5, beta: 0.75, precision: None };
        let all = Parts { bias: true, row_bias: true, residual: true };
        let cs = make_case(2000 + i as u64, (DType::BF16, DType::BF16), g, None, (128, 1000, 4096), 0, all, act);
        cs.check(dev, Some(&[0, 5, 127]))?;
        let cs = make_case(3000 + i as u64, (DType::F16, DType::F16), g, None, (big, big, 64), 0, all, act);
        cs.check(dev, Some(&[0, 77, big - 1]))?;
    }
    // More tiles than the GPU has clusters of two blocks, several rounds of them and a count that
    // no cluster count divides, each tile's K longer than the Hopper kernel's ring: the
    // persistent walk and the ring's phases over many laps (a schedule where a consumer skips
    // ahead over the ring got them wrong and passed every other case here). Rows of both
    // consumers' halves, of both blocks of a cluster and of the last, partial tile.
    let r = [0usize, 1, 63, 64, 127, 128, 255, 256, 2047, 3998, 3999];
    let g = Gemm { trans_a: false, trans_b: true, alpha: 1.0, beta: 0.0, precision: None };
    let parts = Parts { bias: true, residual: true, ..Parts::default() };
    let cs = make_case(5000, (DType::BF16, DType::BF16), g, None, (4000, 2100, 1000), 0, parts, Activation::Gelu);
    cs.check(dev, Some(&r))?;
    let g = Gemm { trans_a: true, trans_b: false, ..Gemm::default() };
    let cs = make_case(
        5001,
        (DType::F16, DType::F32),
        g,
        None,
        (4000, 2100, 700),
        0,
        Parts::default(),
        Activation::Identity,
    );
    cs.check(dev, Some(&r))?;
    // The straight-line epilogue of the Hopper kernel (16-bit D with 16-byte aligned rows, whole
    // 256-column tiles): alpha, the column bias, each activation and the residual; 520 columns
    // end in a partial tile, which takes the general epilogue.
    let acts = [Activation::Identity, Activation::Relu, Activation::Gelu, Activation::GeluTanh, Activation::Silu];
    for (i, act) in acts.into_iter().enumerate() {
        for (j, (dts, alpha)) in
            [((DType::BF16, DType::BF16), 1.0), ((DType::F16, DType::F16), -0.5)].into_iter().enumerate()
        {
            let g = Gemm { trans_a: i % 2 == 1, trans_b: j == 0, alpha, beta: 0.0, precision: None };
            let parts = Parts { bias: (i + j) % 2 == 0, residual: i % 2 == j, ..Parts::default() };
            let cs = make_case(4000 + 2 * i as u64 + j as u64, dts, g, None, (131, 520, 200), 0, parts, act);
            cs.check(dev, None)?;
        }
    }
    Ok(())
}

/// NaN and infinity in A and B reach exactly their rows and columns of D; beta = 0 never reads
/// C; alpha = 0 skips the product (no inf * 0); K = 0 gives the epilogue of zero.
fn ieee(dev: &Device) -> Result<(), String> {
    let (m, n, k) = (130usize, 70usize, 40usize);
    for (input, output) in [(DType::BF16, DType::BF16), (DType::F16, DType::F32), (DType::BF16, DType::F16)] {
        let mut rng = TestRng::new(7);
        let mut a = Mats::random(&mut rng, input, None, m, k);
        let mut b = Mats::random(&mut rng, input, None, k, n);
        a.v[3 * k + 5] = f32::NAN;
        a.v[100 * k + 1] = f32::INFINITY;
        // Column 40 of B: minus infinity at one K.
        b.v[11 * n + 40] = f32::NEG_INFINITY;
        let (ta, tb) = (a.upload(dev)?, b.upload(dev)?);
        let mut c = nan_tensor(dev, &[m, n], output)?;
        ops::gemm(&ta, &tb, &mut c, Gemm::default()).map_err(e)?;
        let got = c.to_f32_vec().map_err(e)?;
        for i in 0..m {
            for j in 0..n {
                let g = got[i * n + j];
                // IEEE: inf * x is +-inf for x != 0, and a sum holding +inf and -inf is NaN.
                let ok = match (i, j) {
                    (3, _) => g.is_nan(),
                    (100, 40) => g.is_nan() || g.is_infinite(),
                    (100, _) => g.is_infinite() && g.is_sign_positive() == (b.at(0, 1, j) > 0.0),
                    (_, 40) => g.is_infinite() && g.is_sign_positive() == (a.at(0, i, 11) < 0.0),
                    _ => g.is_finite(),
                };
                if !ok {
                    return Err(format!("{input:?} -> {output:?}: D[{i}][{j}] = {g}"));
                }
            }
        }
        // alpha = 0, beta = 2: D = 2 C exactly, infinities of A notwithstanding.
        let c0: Vec<f32> = (0..m * n).map(|i| round_to(output, i as f32 * 0.25 - 7.0)).collect();
        let mut c = tensor(dev, &c0, &[m, n], output)?;
        ops::gemm(&ta, &tb, &mut c, Gemm { alpha: 0.0, beta: 2.0, ..Gemm::default() }).map_err(e)?;
        let got = c.to_f32_vec().map_err(e)?;
        if let Some(i) = (0..m * n).find(|&i| got[i] != round_to(output, 2.0 * c0[i])) {
            return Err(format!("alpha = 0: D[{i}] = {}, expected {}", got[i], 2.0 * c0[i]));
        }
        // k = 0: D = act(beta C + bias + row bias) + residual.
        let (a0, b0) = (Tensor::zeros(dev, &[m, 0], input).map_err(e)?, Tensor::zeros(dev, &[0, n], input).map_err(e)?);
        let bias: Vec<f32> = (0..n).map(|j| j as f32 - 30.0).collect();
        let row: Vec<f32> = (0..m).map(|i| (i % 7) as f32).collect();
        let res: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32 - 2.0).collect();
        let (tbias, trow) = (tensor(dev, &bias, &[n], output)?, tensor(dev, &row, &[m], output)?);
        let tres = tensor(dev, &res, &[m, n], output)?;
        let mut c = nan_tensor(dev, &[m, n], output)?;
        let epi = Epilogue { bias: Some(&tbias), row_bias: Some(&trow), act: Activation::Relu, residual: Some(&tres) };
        ops::gemm_fused(&a0, &b0, &mut c, Gemm::default(), epi).map_err(e)?;
        let got = c.to_f32_vec().map_err(e)?;
        let want = |i: usize| (bias[i % n] + row[i / n]).max(0.0) + res[i];
        if let Some(i) = (0..m * n).find(|&i| got[i] != want(i)) {
            return Err(format!("k = 0: D[{i}] = {}, expected {}", got[i], want(i)));
        }
    }
    Ok(())
}

/// The same product twice gives the same bits (split-K included: no atomics).
fn deterministic(dev: &Device) -> Result<(), String> {
    for (m, n, k) in [(128usize, 2048usize, 8192usize), (300, 300, 300)] {
        let mut rng = TestRng::new(11);
        let a = Mats::random(&mut rng, DType::BF16, None, m, k).upload(dev)?;
        let b = Mats::random(&mut rng, DType::BF16, None, k, n).upload(dev)?;
        let run = || -> Result<Vec<u16>, String> {
            let mut c = Tensor::empty(dev, &[m, n], DType::BF16).map_err(e)?;
            ops::gemm(&a, &b, &mut c, Gemm::default()).map_err(e)?;
            Ok(c.to_vec::<half::bf16>().map_err(e)?.iter().map(|v| v.to_bits()).collect())
        };
        if run()? != run()? {
            return Err(format!("{m}x{n}x{k}: two runs differ"));
        }
    }
    Ok(())
}

/// `matmul` and `gemm_ex` on bf16 and f16 operands: the result's dtype and values, and a
/// 2-D operand shared across a batch.
fn api(dev: &Device) -> Result<(), String> {
    for dt in [DType::BF16, DType::F16] {
        let mut rng = TestRng::new(5);
        let a = Mats::random(&mut rng, dt, Some(3), 37, 19);
        let b = Mats::random(&mut rng, dt, None, 19, 45);
        let c = ops::matmul(&a.upload(dev)?, &b.upload(dev)?).map_err(e)?;
        if c.dtype() != dt || c.shape() != [3, 37, 45] {
            return Err(format!("matmul of {dt:?} gave {c:?}"));
        }
        let got = c.to_f32_vec().map_err(e)?;
        for z in 0..3 {
            for i in 0..37 {
                for j in 0..45 {
                    let (want, abs) = dot_ref(19, |kk| a.at(z, i, kk), |kk| b.at(0, kk, j));
                    let tol = Tol { rtol: 0.0, atol: tc_bound_terms(19, 1) * U * abs };
                    if !close(dt, got[(z * 37 + i) * 45 + j], want, tol) {
                        return Err(format!(
                            "matmul {dt:?}: [{z}][{i}][{j}] = {}, expected {want}",
                            got[(z * 37 + i) * 45 + j]
                        ));
                    }
                }
            }
        }
    }
    // gemm_ex with a bias and an activation into f32.
    let g = Gemm { trans_a: true, ..Gemm::default() };
    let cs = make_case(
        9,
        (DType::BF16, DType::F32),
        g,
        None,
        (50, 60, 70),
        0,
        Parts { bias: true, ..Parts::default() },
        Activation::Gelu,
    );
    let (a, b) = (cs.a.upload(dev)?, cs.b.upload(dev)?);
    let bias = tensor(dev, cs.bias.as_ref().unwrap_or(&vec![]), &[60], DType::F32)?;
    let mut c = nan_tensor(dev, &[50, 60], DType::F32)?;
    ops::gemm_ex(&a, &b, &mut c, g, Some(&bias), Activation::Gelu).map_err(e)?;
    let got = c.to_f32_vec().map_err(e)?;
    for i in 0..50 {
        for j in 0..60 {
            let (want, tol) = cs.exact(0, i, j, 1);
            if !close(DType::F32, got[i * 60 + j], want, tol) {
                return Err(format!("gemm_ex: [{i}][{j}] = {}, expected {want}", got[i * 60 + j]));
            }
        }
    }
    Ok(())
}

fn errors(dev: &Device) -> Result<(), String> {
    let t = |s: &[usize], dt: DType| Tensor::zeros(dev, s, dt).map_err(e);
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
    let (a, b) = (t(&[4, 5], DType::BF16)?, t(&[5, 7], DType::BF16)?);
    let mut c = t(&[4, 7], DType::BF16)?;
    // Mixed operand dtypes.
    let b16 = t(&[5, 7], DType::F16)?;
    want(ops::gemm(&a, &b16, &mut c, Gemm::default()), "both bf16 or both f16")?;
    let b32 = t(&[5, 7], DType::F32)?;
    want(ops::gemm(&a, &b32, &mut c, Gemm::default()), "both bf16 or both f16")?;
    let (a32, mut c32) = (t(&[4, 5], DType::F32)?, t(&[4, 7], DType::F32)?);
    want(ops::gemm(&a32, &b, &mut c32, Gemm::default()), "both bf16 or both f16")?;
    // f32 operands into a bf16 C.
    want(ops::gemm(&a32, &b32, &mut c, Gemm::default()), "f32 products write an f32 C")?;
    // Shapes.
    let a_bad = t(&[4, 6], DType::BF16)?;
    want(ops::gemm(&a_bad, &b, &mut c, Gemm::default()), "inner dimensions differ (6 and 5)")?;
    let mut c_bad = t(&[4, 8], DType::BF16)?;
    want(ops::gemm(&a, &b, &mut c_bad, Gemm::default()), "C must be 4 x 7")?;
    // The epilogue's tensors: shape and C's dtype.
    let fused = |c: &mut Tensor, epi: Epilogue<'_>| ops::gemm_fused(&a, &b, c, Gemm::default(), epi);
    let bias_len = t(&[8], DType::BF16)?;
    want(fused(&mut c, Epilogue { bias: Some(&bias_len), ..Epilogue::default() }), "bias must have shape [7]")?;
    let bias_dt = t(&[7], DType::F32)?;
    want(fused(&mut c, Epilogue { bias: Some(&bias_dt), ..Epilogue::default() }), "C's dtype")?;
    let row = t(&[7], DType::BF16)?;
    want(fused(&mut c, Epilogue { row_bias: Some(&row), ..Epilogue::default() }), "row bias must have shape [4]")?;
    let res = t(&[7, 4], DType::BF16)?;
    want(fused(&mut c, Epilogue { residual: Some(&res), ..Epilogue::default() }), "the residual must have C's shape")?;
    let res = t(&[4, 7], DType::F16)?;
    want(fused(&mut c, Epilogue { residual: Some(&res), ..Epilogue::default() }), "the residual must have C's shape")?;
    want(fused(&mut c, Epilogue { act: Activation::Mish, ..Epilogue::default() }), "cannot be fused")?;
    want(ops::gemm(&a, &b, &mut c, Gemm { alpha: f32::NAN, ..Gemm::default() }), "must be finite")?;
    // f32 operands: no row bias, no residual.
    let row32 = t(&[4], DType::F32)?;
    let r = ops::gemm_fused(
        &a32,
        &b32,
        &mut c32,
        Gemm::default(),
        Epilogue { row_bias: Some(&row32), ..Epilogue::default() },
    );
    want(r, "only into bf16 and f16 products")?;
    Ok(())
}

fn main() -> ExitCode {
    let tests = vec![
        test("gemm_tc/random_products", random_products),
        test("gemm_tc/large_products_sampled_rows", large_products),
        test("gemm_tc/ieee", ieee),
        test("gemm_tc/deterministic", deterministic),
        test("gemm_tc/api", api),
        test("gemm_tc/errors", errors),
    ];
    run(tests)
}
