//! GEMM benchmarks against cuBLAS in the same process, on the same buffers and stream: the
//! standard shapes (4096^3, 8192^3, the skinny 8192x8192x128, 128x8192x8192 and
//! 4096x4096x16384), the transposed layouts a linear layer uses, and the fused
//! `relu(x @ W^T + b)` at 8192x4096 by 4096x4096 against cuBLAS's plain product (PyTorch's eager
//! `relu(F.linear(x, W, b))` is cuBLAS plus one kernel; its figures against ours are in
//! docs/worklog.md, 2026-11-24b-gemm). The `3xtf32` cases run the same shapes with
//! `Precision::Tf32x3` (still against cuBLAS's FP32 product); the `gemm/tf32` cases (4096^3,
//! 8192^3, the linear layer's `nt` and its fused form) run plain TF32, `Precision::Tf32`, against
//! cuBLAS in TF32 (`cublasGemmEx`, `CUBLAS_COMPUTE_32F_FAST_TF32`, what PyTorch runs with
//! `allow_tf32 = True`). `accuracy` prints the relative error of our three precisions, cuBLAS
//! FP32 and cuBLAS TF32 against an f64 product on the same data, and of the bf16/f16 products,
//! ours and `cublasGemmEx`'s, with f32 and 16-bit D.
//! The `bf16` and `f16` cases run the tensor-core GEMM (`host/ops/gemm_tc.rs`) against cuBLAS's
//! `cublasGemmEx` with the same input and output dtype and f32 accumulation
//! (`CUBLAS_COMPUTE_32F`, what PyTorch's `F.linear` in bf16 runs), at the shapes of a transformer's
//! layers (4096^3, 8192^3, 2048^3, 8192x11008x4096, 8192x4096x11008, 8192x128256x4096, the skinny
//! 128x4096x4096 and 16x4096x4096, the latter bound by reading W), plus the fused
//! `gelu(x @ W^T + b)` against cuBLAS's plain product.
//!
//! Method: for each case, ours and cuBLAS alternate in rounds of 5 launches, each launch between
//! two CUDA events, after a warm-up of 3 launches each; the median over all timed launches is
//! reported (20 each by default, `KERNELS_GEMM_ITERS`). A GEMM of these sizes is compute-bound
//! (8192^3 reads 0.8 GB for 1.1 TFLOP), so the L2 is not flushed. cuBLAS runs in its default FP32
//! mode (no TF32: `CUBLAS_DEFAULT_MATH`, as PyTorch with `allow_tf32 = False`) except in the
//! `gemm/tf32` cases, loaded at run
//! time from `libcublas.so.12` (the suite script points `LD_LIBRARY_PATH` at the pip wheel's
//! copy). JSON records (`KERNELS_BENCH_JSON`) carry both times and the ratio.
//!
//! ```text
//! cargo bench --bench gemm                  # everything
//! cargo bench --bench gemm -- 4096          # names containing "4096"
//! cargo bench --bench gemm -- gemm/tf32/    # plain TF32 against cuBLAS TF32
//! cargo bench --bench gemm -- accuracy      # the accuracy table only
//! ```

use cudarc::cublas::{result as cublas, sys as cublas_sys};
use kernels::ops::{self, Activation, Gemm, Precision};
use kernels::{DType, Device, Result, Tensor};

struct Case {
    name: String,
    /// The dtype of A, B and C: f32 (FMAs, 3xTF32 or TF32: `g.precision`), or bf16/f16 on the
    /// tensor cores.
    dtype: DType,
    g: Gemm,
    m: usize,
    n: usize,
    k: usize,
    /// The fused linear epilogue (bias + relu) for ours; cuBLAS runs the plain product.
    linear: bool,
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let mut add_p = |m: usize, n: usize, k: usize, ta: bool, tb: bool, linear: bool, precision: Precision| {
        let ops = format!("{}{}", if ta { 't' } else { 'n' }, if tb { 't' } else { 'n' });
        let what = match (linear, precision) {
            (false, Precision::Highest | Precision::Tf32) => "sgemm",
            (true, Precision::Highest | Precision::Tf32) => "linear_bias_relu",
            (false, _) => "sgemm_3xtf32",
            (true, _) => "linear_bias_relu_3xtf32",
        };
        let family = if precision == Precision::Tf32 { "tf32" } else { "f32" };
        let g = Gemm { precision: Some(precision), ..Gemm::new(ta, tb) };
        v.push(Case { name: format!("gemm/{family}/{what}_{ops}@{m}x{n}x{k}"), dtype: DType::F32, g, m, n, k, linear });
    };
    let mut add = |m, n, k, ta, tb, linear| add_p(m, n, k, ta, tb, linear, Precision::Highest);
    add(4096, 4096, 4096, false, false, false);
    add(8192, 8192, 8192, false, false, false);
    add(8192, 8192, 128, false, false, false);
    add(128, 8192, 8192, false, false, false);
    add(4096, 4096, 16384, false, false, false);
    // The layouts of a linear layer: forward x W^T (nt), dW = dy^T x (tn); and tt.
    add(4096, 4096, 4096, false, true, false);
    add(4096, 4096, 4096, true, false, false);
    add(4096, 4096, 4096, true, true, false);
    // Small and odd.
    add(1024, 1024, 1024, false, false, false);
    add(1000, 1000, 1000, false, false, false);
    // The fused linear layer: x [8192, 4096] @ W^T, W [4096, 4096]; and a small one.
    add(8192, 4096, 4096, false, true, true);
    add(64, 1024, 1024, false, true, true);
    // 3xTF32 on the tensor cores (cuBLAS still runs its FP32 product: the ratio is against it).
    let p = Precision::Tf32x3;
    add_p(4096, 4096, 4096, false, false, false, p);
    add_p(4096, 4096, 4096, false, true, false, p);
    add_p(8192, 4096, 4096, false, true, true, p);
    add_p(8192, 8192, 8192, false, false, false, p);
    add_p(8192, 8192, 128, false, false, false, p);
    add_p(128, 8192, 8192, false, false, false, p);
    add_p(4096, 4096, 16384, false, false, false, p);
    add_p(4096, 4096, 4096, true, false, false, p);
    add_p(4096, 4096, 4096, true, true, false, p);
    add_p(1000, 1000, 1000, false, false, false, p);
    add_p(64, 1024, 1024, false, true, true, p);
    // Plain TF32 against cuBLAS in TF32.
    let p = Precision::Tf32;
    add_p(4096, 4096, 4096, false, false, false, p);
    add_p(8192, 8192, 8192, false, false, false, p);
    add_p(4096, 4096, 4096, false, true, false, p);
    add_p(8192, 4096, 4096, false, true, true, p);
    // bf16 and f16 on the tensor cores, against cuBLAS in the same dtype. `nt` is the linear
    // layer's forward (x W^T); the fused case is gelu(x W^T + b).
    for dtype in [DType::BF16, DType::F16] {
        let mut add_h = |m: usize, n: usize, k: usize, ta: bool, tb: bool, linear: bool| {
            let ops = format!("{}{}", if ta { 't' } else { 'n' }, if tb { 't' } else { 'n' });
            let what = if linear { "linear_bias_gelu" } else { "gemm" };
            let name = format!("gemm/{}/{what}_{ops}@{m}x{n}x{k}", dtype.suffix());
            v.push(Case { name, dtype, g: Gemm::new(ta, tb), m, n, k, linear });
        };
        for (m, n, k) in
            [(4096, 4096, 4096), (8192, 8192, 8192), (2048, 2048, 2048), (8192, 11008, 4096), (8192, 4096, 11008)]
        {
            add_h(m, n, k, false, false, false);
            add_h(m, n, k, false, true, false);
        }
        add_h(8192, 128256, 4096, false, true, false);
        add_h(128, 4096, 4096, false, true, false);
        add_h(16, 4096, 4096, false, true, false);
        add_h(4096, 4096, 4096, true, false, false);
        add_h(4096, 4096, 4096, true, true, false);
        add_h(8192, 4096, 4096, false, true, true);
        if dtype == DType::BF16 {
            // GPT-2 124M at batch x context = 16 x 1024 (examples/gpt2): the forward's x W^T (the
            // QKV, attention output, MLP up and down projections), the backward's dy W and
            // dy^T x, and the MLP's fused up projection.
            for (n, k) in [(2304, 768), (768, 768), (3072, 768), (768, 3072)] {
                add_h(16384, n, k, false, true, false);
                add_h(16384, k, n, false, false, false);
                add_h(n, k, 16384, true, false, false);
            }
            add_h(16384, 3072, 768, false, true, true);
        }
    }
    v
}

fn median(v: &mut [f32]) -> f64 {
    v.sort_by(f32::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 { v[m] as f64 } else { (v[m - 1] as f64 + v[m] as f64) / 2.0 }
}

/// cuBLAS's row-major `C = op(A) op(B)`: column-major `C^T = op(B)^T op(A)^T`, so B goes first.
///
/// # Safety
/// The tensors hold the matrices the case describes, on `dev`, and outlive the launch (the
/// caller synchronises before dropping them).
unsafe fn cublas_sgemm(h: cublas_sys::cublasHandle_t, cs: &Case, a: &Tensor, b: &Tensor, c: &mut Tensor) {
    use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    let (m, n, k) = (cs.m as i32, cs.n as i32, cs.k as i32);
    let lda = if cs.g.trans_a { m } else { k };
    let ldb = if cs.g.trans_b { k } else { n };
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: per the function contract.
    unsafe {
        cublas::sgemm(
            h,
            if cs.g.trans_b { CUBLAS_OP_T } else { CUBLAS_OP_N },
            if cs.g.trans_a { CUBLAS_OP_T } else { CUBLAS_OP_N },
            n,
            m,
            k,
            &alpha,
            b.device_ptr() as *const f32,
            ldb,
            a.device_ptr() as *const f32,
            lda,
            &beta,
            c.device_ptr() as *mut f32,
            n,
        )
        .expect("cublasSgemm");
    }
}

/// cuBLAS's row-major product through `cublasGemmEx`, arranged as [`cublas_sgemm`]: bf16 or f16
/// matrices (`cs.dtype`) into C of the same dtype, accumulated in f32 (`CUBLAS_COMPUTE_32F`); or
/// f32 ones in TF32 (`CUBLAS_COMPUTE_32F_FAST_TF32`).
///
/// # Safety
/// As [`cublas_sgemm`].
unsafe fn cublas_gemm_ex(h: cublas_sys::cublasHandle_t, cs: &Case, a: &Tensor, b: &Tensor, c: &mut Tensor) {
    // SAFETY: per the function contract.
    unsafe { cublas_gemm_ex_into(h, cs, a, b, c, cs.dtype) }
}

/// [`cublas_gemm_ex`] with C of dtype `out` (the inputs' dtype or f32).
///
/// # Safety
/// As [`cublas_sgemm`].
unsafe fn cublas_gemm_ex_into(
    h: cublas_sys::cublasHandle_t,
    cs: &Case,
    a: &Tensor,
    b: &Tensor,
    c: &mut Tensor,
    out: DType,
) {
    use cublas_sys::cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32};
    use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    let (m, n, k) = (cs.m as i32, cs.n as i32, cs.k as i32);
    let lda = if cs.g.trans_a { m } else { k };
    let ldb = if cs.g.trans_b { k } else { n };
    let (alpha, beta) = (1.0f32, 0.0f32);
    let cuda_type = |d: DType| match d {
        DType::F16 => cublas_sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => cublas_sys::cudaDataType::CUDA_R_16BF,
        DType::F32 => cublas_sys::cudaDataType::CUDA_R_32F,
    };
    let (ty, compute) = match cs.dtype {
        DType::F32 => (cuda_type(DType::F32), CUBLAS_COMPUTE_32F_FAST_TF32),
        d => (cuda_type(d), CUBLAS_COMPUTE_32F),
    };
    // SAFETY: per the function contract; alpha and beta are f32, as both compute types want.
    unsafe {
        cublas::gemm_ex(
            h,
            if cs.g.trans_b { CUBLAS_OP_T } else { CUBLAS_OP_N },
            if cs.g.trans_a { CUBLAS_OP_T } else { CUBLAS_OP_N },
            n,
            m,
            k,
            (&alpha as *const f32).cast(),
            b.device_ptr() as *const std::ffi::c_void,
            ty,
            ldb,
            a.device_ptr() as *const std::ffi::c_void,
            ty,
            lda,
            (&beta as *const f32).cast(),
            c.device_ptr() as *mut std::ffi::c_void,
            cuda_type(out),
            n,
            compute,
            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .expect("cublasGemmEx");
    }
}

/// cuBLAS's product for the case's dtype: FP32 for f32 (TF32 for the `Precision::Tf32` cases),
/// f32 accumulation for bf16 and f16.
///
/// # Safety
/// As [`cublas_sgemm`].
unsafe fn cublas_any(h: cublas_sys::cublasHandle_t, cs: &Case, a: &Tensor, b: &Tensor, c: &mut Tensor) {
    let fp32 = cs.dtype == DType::F32 && cs.g.precision != Some(Precision::Tf32);
    // SAFETY: per the function contract.
    unsafe { if fp32 { cublas_sgemm(h, cs, a, b, c) } else { cublas_gemm_ex(h, cs, a, b, c) } }
}

fn run_case(dev: &Device, h: cublas_sys::cublasHandle_t, cs: &Case, iters: usize) -> Result<(f64, f64)> {
    let (ar, ac) = if cs.g.trans_a { (cs.k, cs.m) } else { (cs.m, cs.k) };
    let (br, bc) = if cs.g.trans_b { (cs.n, cs.k) } else { (cs.k, cs.n) };
    let dt = cs.dtype;
    let a = Tensor::rand_normal(dev, &[ar, ac], dt, 0.0, 1.0, 1)?;
    let b = Tensor::rand_normal(dev, &[br, bc], dt, 0.0, 1.0, 2)?;
    let bias = Tensor::rand_normal(dev, &[cs.n], dt, 0.0, 1.0, 3)?;
    let mut c = Tensor::zeros(dev, &[cs.m, cs.n], dt)?;
    let mut c_ref = Tensor::zeros(dev, &[cs.m, cs.n], dt)?;
    // The fused linear layer: relu in f32 (as measured before), GELU in bf16/f16.
    let act = if dt == DType::F32 { Activation::Relu } else { Activation::Gelu };
    let ours = |c: &mut Tensor| -> Result<()> {
        if cs.linear { ops::gemm_ex(&a, &b, c, cs.g, Some(&bias), act) } else { ops::gemm(&a, &b, c, cs.g) }
    };
    let (mut t_ours, mut t_blas) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        ours(&mut c)?;
        // SAFETY: the tensors live until the synchronisation below.
        unsafe { cublas_any(h, cs, &a, &b, &mut c_ref) };
    }
    dev.synchronize()?;
    let rounds = iters.div_ceil(5);
    for _ in 0..rounds {
        let mut ev = Vec::new();
        for _ in 0..5 {
            let s = dev.record_event()?;
            ours(&mut c)?;
            ev.push((s, dev.record_event()?));
        }
        for (s, e) in &ev {
            t_ours.push(s.elapsed_ms(e)?);
        }
        let mut ev = Vec::new();
        for _ in 0..5 {
            let s = dev.record_event()?;
            // SAFETY: as above; elapsed_ms waits for the end events.
            unsafe { cublas_any(h, cs, &a, &b, &mut c_ref) };
            ev.push((s, dev.record_event()?));
        }
        for (s, e) in &ev {
            t_blas.push(s.elapsed_ms(e)?);
        }
    }
    dev.synchronize()?;
    // A sanity check that both computed the same product (on a sample; the tests do the real
    // checking): relative difference of a few entries.
    if !cs.linear {
        let (x, y) = (c.to_f32_vec()?, c_ref.to_f32_vec()?);
        let step = (x.len() / 97).max(1);
        // Both round the f32 sums to the output dtype once: up to an ulp of it apart. In TF32
        // each product errs by up to 2^-10 of itself, both sides: a few 2^-10 sqrt(k) apart.
        let tol = match dt {
            DType::F32 if cs.g.precision == Some(Precision::Tf32) => 1e-2,
            DType::F32 => 1e-3,
            DType::F16 => 2e-3,
            DType::BF16 => 1e-2,
        };
        for i in (0..x.len()).step_by(step) {
            let d = (x[i] - y[i]).abs() / (y[i].abs() + (cs.k as f32).sqrt());
            assert!(d < tol, "{}: ours {} vs cuBLAS {} at {i}", cs.name, x[i], y[i]);
        }
    }
    Ok((median(&mut t_ours), median(&mut t_blas)))
}

/// The f64 product of row-major `a` (`m x k`) and `b` (`k x n`).
fn product_f64(a: &[f32], b: &[f32], (m, n, k): (usize, usize, usize)) -> Vec<f64> {
    let mut want = vec![0.0f64; m * n];
    for i in 0..m {
        for kk in 0..k {
            let x = a[i * k + kk] as f64;
            let row = &b[kk * n..(kk + 1) * n];
            for (w, &y) in want[i * n..(i + 1) * n].iter_mut().zip(row) {
                *w += x * y as f64;
            }
        }
    }
    want
}

/// `|got - want| / |want|` in the Frobenius norm.
fn rel_frobenius(got: &[f32], want: &[f64]) -> f64 {
    let (e2, r2) =
        got.iter().zip(want).fold((0.0f64, 0.0f64), |(e2, r2), (&g, &w)| (e2 + (g as f64 - w).powi(2), r2 + w * w));
    (e2 / r2).sqrt()
}

/// Relative Frobenius error against an f64 product of `m x k` by `k x n` (row-major, computed
/// here) for ours in each precision (FMAs, 3xTF32, TF32) and for cuBLAS in FP32 and in TF32
/// (`CUBLAS_TF32_TENSOR_OP_MATH`), on the same data: normal
/// values (sums that cancel) and uniform values in [0, 1) (sums that grow, where a biased
/// rounding shows).
fn accuracy(dev: &Device, h: cublas_sys::cublasHandle_t) -> Result<()> {
    println!("\naccuracy: relative Frobenius error against f64 (same inputs for every row)");
    println!(
        "{:<36} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "data, m x n x k", "ours f32", "ours 3xTF32", "ours TF32", "cuBLAS f32", "cuBLAS TF32"
    );
    let (m, n) = (256usize, 256usize);
    for k in [4096usize, 16384] {
        for uniform in [false, true] {
            let (a, b) = if uniform {
                (
                    Tensor::rand_uniform(dev, &[m, k], DType::F32, 0.0, 1.0, 11)?,
                    Tensor::rand_uniform(dev, &[k, n], DType::F32, 0.0, 1.0, 12)?,
                )
            } else {
                (
                    Tensor::rand_normal(dev, &[m, k], DType::F32, 0.0, 1.0, 11)?,
                    Tensor::rand_normal(dev, &[k, n], DType::F32, 0.0, 1.0, 12)?,
                )
            };
            let (ha, hb) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
            let want = product_f64(&ha, &hb, (m, n, k));
            let err = |got: &[f32]| rel_frobenius(got, &want);
            let mut row = Vec::new();
            // `Tf32x3Always`: at this size `Tf32x3` would run the FMA kernel.
            for precision in [Precision::Highest, Precision::Tf32x3Always, Precision::Tf32] {
                let mut c = Tensor::empty(dev, &[m, n], DType::F32)?;
                ops::gemm(&a, &b, &mut c, Gemm { precision: Some(precision), ..Gemm::default() })?;
                row.push(err(&c.to_vec::<f32>()?));
            }
            let cs = Case { name: String::new(), dtype: DType::F32, g: Gemm::default(), m, n, k, linear: false };
            for math in
                [cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH, cublas_sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH]
            {
                let mut c = Tensor::empty(dev, &[m, n], DType::F32)?;
                // SAFETY: the handle is live; the tensors outlive the product (to_vec synchronises).
                unsafe {
                    cublas_sys::cublasSetMathMode(h, math).result().expect("math mode");
                    cublas_sgemm(h, &cs, &a, &b, &mut c);
                }
                row.push(err(&c.to_vec::<f32>()?));
            }
            // SAFETY: as above.
            unsafe { cublas_sys::cublasSetMathMode(h, cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH) }
                .result()
                .expect("math mode");
            let data = format!("{}, {m} x {n} x {k}", if uniform { "uniform [0,1)" } else { "normal" });
            println!(
                "{data:<36} {:>12.3e} {:>12.3e} {:>12.3e} {:>12.3e} {:>12.3e}",
                row[0], row[1], row[2], row[3], row[4]
            );
        }
    }
    Ok(())
}

/// The accuracy of the bf16/f16 products: relative Frobenius error against the f64 product of
/// the same (rounded) inputs, ours and cuBLAS's `cublasGemmEx`, each with f32 and with 16-bit
/// output (the 16-bit rounding of D, up to 2^-8 or 2^-11 relative, then dominates).
fn accuracy_tc(dev: &Device, h: cublas_sys::cublasHandle_t) -> Result<()> {
    println!("\naccuracy (bf16/f16 inputs): relative Frobenius error against f64 of the same inputs");
    println!(
        "{:<40} {:>12} {:>12} {:>12} {:>12}",
        "inputs, data, m x n x k", "ours f32 D", "cuBLAS f32", "ours 16-bit", "cuBLAS 16b"
    );
    let (m, n) = (256usize, 256usize);
    for dt in [DType::BF16, DType::F16] {
        for k in [4096usize, 16384] {
            for uniform in [false, true] {
                let make = |r: usize, c: usize, seed: u64| {
                    if uniform {
                        Tensor::rand_uniform(dev, &[r, c], dt, 0.0, 1.0, seed)
                    } else {
                        Tensor::rand_normal(dev, &[r, c], dt, 0.0, 1.0, seed)
                    }
                };
                let (a, b) = (make(m, k, 21)?, make(k, n, 22)?);
                let (ha, hb) = (a.to_dtype(DType::F32)?.to_vec::<f32>()?, b.to_dtype(DType::F32)?.to_vec::<f32>()?);
                let want = product_f64(&ha, &hb, (m, n, k));
                let err =
                    |c: &Tensor| -> Result<f64> { Ok(rel_frobenius(&c.to_dtype(DType::F32)?.to_vec::<f32>()?, &want)) };
                let cs = Case { name: String::new(), dtype: dt, g: Gemm::default(), m, n, k, linear: false };
                let mut row = Vec::new();
                for out in [DType::F32, dt] {
                    let mut c = Tensor::empty(dev, &[m, n], out)?;
                    ops::gemm(&a, &b, &mut c, Gemm::default())?;
                    row.push(err(&c)?);
                    let mut c = Tensor::empty(dev, &[m, n], out)?;
                    // SAFETY: the handle is live; the tensors outlive the product (err synchronises).
                    unsafe { cublas_gemm_ex_into(h, &cs, &a, &b, &mut c, out) };
                    row.push(err(&c)?);
                }
                let data =
                    format!("{}, {}, {m} x {n} x {k}", dt.suffix(), if uniform { "uniform [0,1)" } else { "normal" });
                println!("{data:<40} {:>12.3e} {:>12.3e} {:>12.3e} {:>12.3e}", row[0], row[1], row[2], row[3]);
            }
        }
    }
    Ok(())
}

fn main() {
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no GPU: {e}, benchmarks skipped");
            return;
        }
    };
    // With the feature `candle`, cudarc links cuBLAS (candle's choice) instead of loading it, and
    // has no probe: a binary that started has it.
    #[cfg(not(feature = "candle"))]
    // SAFETY: probing whether the shared library can be opened.
    if !unsafe { cublas_sys::is_culib_present() } {
        println!("cuBLAS (libcublas.so.12) not found: set LD_LIBRARY_PATH to its folder; benchmarks skipped");
        std::process::exit(1);
    }
    let iters: usize = std::env::var("KERNELS_GEMM_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let h = cublas::create_handle().expect("cublasCreate");
    // SAFETY: the handle is live; the stream is the device's (cuBLAS and ours are then ordered).
    unsafe {
        cublas::set_stream(h, dev.cu_stream() as cublas_sys::cudaStream_t).expect("cublasSetStream");
        cublas_sys::cublasSetMathMode(h, cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH).result().expect("math mode");
    }
    println!("device: {} ({} SMs); {iters} timed launches each", dev.name(), dev.sm_count());
    println!("{:<60} {:>10} {:>9} {:>10} {:>9} {:>7}", "case", "ours ms", "TFLOP/s", "cuBLAS ms", "TFLOP/s", "ratio");
    let mut json = Vec::new();
    for cs in cases() {
        if !filter.is_empty() && !filter.iter().any(|f| cs.name.contains(f.as_str())) {
            continue;
        }
        let (ours, blas) = run_case(&dev, h, &cs, iters).unwrap_or_else(|e| panic!("{}: {e}", cs.name));
        let flop = 2.0 * cs.m as f64 * cs.n as f64 * cs.k as f64;
        let (tf, tb) = (flop / ours / 1e9, flop / blas / 1e9);
        println!("{:<60} {:>10.3} {:>9.1} {:>10.3} {:>9.1} {:>6.3}x", cs.name, ours, tf, blas, tb, blas / ours);
        json.push(format!(
            "  {{\"name\": \"{}\", \"m\": {}, \"n\": {}, \"k\": {}, \"ms\": {ours}, \"tflops\": {tf}, \"cublas_ms\": {blas}, \
             \"cublas_tflops\": {tb}, \"ratio_vs_cublas\": {}}}",
            cs.name,
            cs.m,
            cs.n,
            cs.k,
            blas / ours
        ));
    }
    if filter.is_empty() || filter.iter().any(|f| f == "accuracy") {
        accuracy(&dev, h).unwrap_or_else(|e| panic!("accuracy: {e}"));
        accuracy_tc(&dev, h).unwrap_or_else(|e| panic!("accuracy_tc: {e}"));
    }
    if let Ok(path) = std::env::var("KERNELS_BENCH_JSON") {
        std::fs::write(&path, format!("[\n{}\n]\n", json.join(",\n"))).expect("write the JSON");
        println!("wrote {} records to {path}", json.len());
    }
    // SAFETY: no work uses the handle any more (the last case synchronised).
    unsafe { cublas::destroy_handle(h) }.expect("cublasDestroy");
}
