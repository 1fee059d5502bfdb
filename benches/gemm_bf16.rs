//! bf16/f16 GEMM benchmarks against cuBLAS (`cublasGemmEx`, f32 accumulation) in the same
//! process, on the same buffers and stream, of `ops::gemm` on an H100 or H200 (the Hopper kernels,
//! `gemm_wgmma`, with their split-K for few tiles): the issue's
//! shapes (4096^3, 8192^3, 2048^3, the LLM projections 8192x11008x4096, 8192x4096x11008 and
//! 8192x128256x4096, the skinny 128x4096x4096 and 16x4096x4096) in the linear layer's layout
//! (`x @ W^T`: A `m x k`, B stored `n x k`), and 4096^3 in every layout and in f16.
//!
//! Method as benches/gemm.rs: ours and cuBLAS alternate in rounds of 5 launches between CUDA
//! events after a warm-up; medians of 20 each (`KERNELS_GEMM_ITERS`). Every element of ours is
//! compared with cuBLAS's (both round the same f32 sums to bf16: they may differ by the f32 sums'
//! differing order, a few ulp of bf16 at most on these sizes).
//!
//! ```text
//! cargo bench --bench gemm_bf16              # everything
//! cargo bench --bench gemm_bf16 -- 4096      # names containing "4096"
//! ```

use cudarc::cublas::{result as cublas, sys as cublas_sys};
use kernels::ops::{self, Gemm};
use kernels::{DType, Device, Result, Tensor};

struct Case {
    name: String,
    dtype: DType,
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let mut add = |m: usize, n: usize, k: usize, ta: bool, tb: bool, dtype: DType| {
        let ops = format!("{}{}", if ta { 't' } else { 'n' }, if tb { 't' } else { 'n' });
        let dt = if dtype == DType::BF16 { "bf16" } else { "f16" };
        v.push(Case { name: format!("gemm/{dt}/{dt}gemm_{ops}@{m}x{n}x{k}"), dtype, ta, tb, m, n, k });
    };
    let bf = DType::BF16;
    for (m, n, k) in [
        (4096, 4096, 4096),
        (8192, 8192, 8192),
        (2048, 2048, 2048),
        (8192, 11008, 4096),
        (8192, 4096, 11008),
        (8192, 128256, 4096),
        (128, 4096, 4096),
        (16, 4096, 4096),
    ] {
        add(m, n, k, false, true, bf);
    }
    add(4096, 4096, 4096, false, false, bf);
    add(4096, 4096, 4096, true, false, bf);
    add(4096, 4096, 4096, true, true, bf);
    add(4096, 4096, 4096, false, true, DType::F16);
    add(8192, 8192, 8192, false, true, DType::F16);
    // Edges: partial tiles in M, N and K (leading dimensions stay multiples of 8).
    for (m, n, k) in [(8, 8, 8), (136, 264, 72), (1000, 1000, 1000), (24, 4104, 520)] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            add(m, n, k, ta, tb, bf);
        }
    }
    v
}

fn median(v: &mut [f32]) -> f64 {
    v.sort_by(f32::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 { v[m] as f64 } else { (v[m - 1] as f64 + v[m] as f64) / 2.0 }
}

/// cuBLAS's row-major `C = op(A) op(B)` in bf16/f16 with f32 accumulation: column-major
/// `C^T = op(B)^T op(A)^T`, so B goes first.
///
/// # Safety
/// The tensors hold the matrices the case describes, on the handle's device, and outlive the
/// launch.
unsafe fn cublas_gemm(h: cublas_sys::cublasHandle_t, cs: &Case, a: &Tensor, b: &Tensor, c: &mut Tensor) {
    use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    let (m, n, k) = (cs.m as i32, cs.n as i32, cs.k as i32);
    let lda = if cs.ta { m } else { k };
    let ldb = if cs.tb { k } else { n };
    let (alpha, beta) = (1.0f32, 0.0f32);
    let t = if cs.dtype == DType::BF16 {
        cublas_sys::cudaDataType_t::CUDA_R_16BF
    } else {
        cublas_sys::cudaDataType_t::CUDA_R_16F
    };
    // SAFETY: per the function contract.
    unsafe {
        cublas::gemm_ex(
            h,
            if cs.tb { CUBLAS_OP_T } else { CUBLAS_OP_N },
            if cs.ta { CUBLAS_OP_T } else { CUBLAS_OP_N },
            n,
            m,
            k,
            &alpha as *const f32 as *const _,
            b.device_ptr() as *const _,
            t,
            ldb,
            a.device_ptr() as *const _,
            t,
            lda,
            &beta as *const f32 as *const _,
            c.device_ptr() as *mut _,
            t,
            n,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .expect("cublasGemmEx");
    }
}

fn run_case(dev: &Device, h: cublas_sys::cublasHandle_t, cs: &Case, iters: usize) -> Result<(f64, f64, f64)> {
    let (ar, ac) = if cs.ta { (cs.k, cs.m) } else { (cs.m, cs.k) };
    let (br, bc) = if cs.tb { (cs.n, cs.k) } else { (cs.k, cs.n) };
    let a = Tensor::rand_normal(dev, &[ar, ac], cs.dtype, 0.0, 1.0, 1)?;
    let b = Tensor::rand_normal(dev, &[br, bc], cs.dtype, 0.0, 1.0, 2)?;
    let mut c = Tensor::zeros(dev, &[cs.m, cs.n], cs.dtype)?;
    let mut c_ref = Tensor::zeros(dev, &[cs.m, cs.n], cs.dtype)?;
    let ours = |c: &mut Tensor| ops::gemm(&a, &b, c, Gemm::new(cs.ta, cs.tb));
    let (mut t_ours, mut t_blas) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        ours(&mut c)?;
        // SAFETY: the tensors live until the synchronisation below.
        unsafe { cublas_gemm(h, cs, &a, &b, &mut c_ref) };
    }
    dev.synchronize()?;
    // Every element against cuBLAS: both round an f32 sum of the same exact products, so they
    // differ by at most one rounding of the output (2^-8 relative for bf16, 2^-11 for f16: one
    // ulp of the larger) plus the two sums' orders (far below 1e-3 sqrt(k) for unit normals).
    // Reported: the largest difference in units of the output's ulp.
    let (x, y) = (c.to_f32_vec()?, c_ref.to_f32_vec()?);
    let ulp = if cs.dtype == DType::BF16 { 2f64.powi(-7) } else { 2f64.powi(-10) };
    let slack = 1e-3 * (cs.k as f64).sqrt();
    let mut worst = 0.0f64;
    for (i, (&p, &q)) in x.iter().zip(&y).enumerate() {
        let (p, q) = (p as f64, q as f64);
        let d = (p - q).abs() / (ulp * p.abs().max(q.abs()) + slack);
        assert!(d <= 1.0, "{}: ours {p} vs cuBLAS {q} at ({}, {})", cs.name, i / cs.n, i % cs.n);
        worst = worst.max(d);
    }
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
            unsafe { cublas_gemm(h, cs, &a, &b, &mut c_ref) };
            ev.push((s, dev.record_event()?));
        }
        for (s, e) in &ev {
            t_blas.push(s.elapsed_ms(e)?);
        }
    }
    dev.synchronize()?;
    Ok((median(&mut t_ours), median(&mut t_blas), worst))
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
    // SAFETY: probing whether the shared library can be opened.
    if !unsafe { cublas_sys::is_culib_present() } {
        println!("cuBLAS (libcublas.so.12) not found: set LD_LIBRARY_PATH to its folder; benchmarks skipped");
        std::process::exit(1);
    }
    if dev.ptx_arch() != "sm_90a" {
        println!("{}: the wgmma kernels need compute capability 9.0; benchmarks skipped", dev.name());
        return;
    }
    let iters: usize = std::env::var("KERNELS_GEMM_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let h = cublas::create_handle().expect("cublasCreate");
    // SAFETY: the handle is live; the stream is the device's (cuBLAS and ours are then ordered).
    unsafe { cublas::set_stream(h, dev.cu_stream() as cublas_sys::cudaStream_t).expect("cublasSetStream") };
    println!("device: {} ({} SMs); {iters} timed launches each", dev.name(), dev.sm_count());
    println!(
        "{:<44} {:>9} {:>8} {:>10} {:>8} {:>7} {:>9}",
        "case", "ours ms", "TFLOP/s", "cuBLAS ms", "TFLOP/s", "ratio", "max diff"
    );
    let mut json = Vec::new();
    for cs in cases() {
        if !filter.is_empty() && !filter.iter().any(|f| cs.name.contains(f.as_str())) {
            continue;
        }
        let (ours, blas, worst) = run_case(&dev, h, &cs, iters).unwrap_or_else(|e| panic!("{}: {e}", cs.name));
        let flop = 2.0 * cs.m as f64 * cs.n as f64 * cs.k as f64;
        let (tf, tb) = (flop / ours / 1e9, flop / blas / 1e9);
        println!(
            "{:<44} {:>9.3} {:>8.1} {:>10.3} {:>8.1} {:>6.3}x {:>9.2e}",
            cs.name,
            ours,
            tf,
            blas,
            tb,
            blas / ours,
            worst
        );
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
    if let Ok(path) = std::env::var("KERNELS_BENCH_JSON") {
        std::fs::write(&path, format!("[\n{}\n]\n", json.join(",\n"))).expect("write the JSON");
        println!("wrote {} records to {path}", json.len());
    }
    // SAFETY: no work uses the handle any more (the last case synchronised).
    unsafe { cublas::destroy_handle(h) }.expect("cublasDestroy");
}
