//! GPU tests of softmax and log-softmax, forward and backward, in f32, f16 and bf16, against
//! f64 references (`common::reference`) on random shapes (row lengths 1, 2, 31-33, primes,
//! 4097, 100003, ... chosen to hit every kernel: the register-resident ones with 1, 2, 4 and 8
//! vectors per thread, on rows of whole vectors (`_v`) and of any length (`_u`, rows starting
//! at every offset within a vector), the clusters, the streaming one on aligned and unaligned
//! rows) and random
//! values with outliers. The f64 backward reference is itself checked against central finite
//! differences of the f64 forward. Outputs come from poisoned (NaN-filled) allocations, so an
//! unwritten element fails; determinism is checked by running twice and comparing bits.
//!
//! Tolerances. With `E = 2^-24` (f32 rounding) and `K = L + log2(n) + 16`, where `L` bounds the
//! values one thread adds in sequence (64 in registers; `8 * ceil(n / 1024)` streaming) and
//! `log2(n)` the depth of the group reduction: a sum of `n` terms has error at most `K E` times
//! the sum of their magnitudes (the 16 covers `exp`'s 2 ulp, the rescalings of the online
//! softmax and the final products). Each check below scales `K E` by the magnitudes that enter
//! the result; `close` adds one ulp of the storage type for f16/bf16 outputs.

mod common;

use common::reference::{softmax_bwd_ref, softmax_ref};
use common::rows::*;
use common::*;
use kernels::ops;
use kernels::{DType, Device, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

fn softmax_case(dev: &Device, rows: usize, cols: usize, dt: DType, log: bool, seed: u64) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let n = rows * cols;
    let xs = values(&mut rng, n, dt);
    let gs = draw(&mut rng, n, dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let x = tensor(dev, &xs, &[rows, cols], dt)?;
    let g = tensor(dev, &gs, &[rows, cols], dt)?;
    let name = if log { "log_softmax" } else { "softmax" };
    let fwd = |x: &Tensor| if log { ops::log_softmax(x) } else { ops::softmax(x) };
    let bwd = |y: &Tensor, g: &Tensor| if log { ops::log_softmax_backward(y, g) } else { ops::softmax_backward(y, g) };
    let y = fwd(&x).map_err(e)?;
    let ys = y.to_f32_vec().map_err(e)?;
    let gx = bwd(&y, &g).map_err(e)?.to_f32_vec().map_err(e)?;
    let k = k_of(cols) * E;
    for r in 0..rows {
        let row = r * cols..(r + 1) * cols;
        let want = softmax_ref(&xs[row.clone()], log);
        let log_s = if log { want.iter().map(|v| v.exp()).sum::<f64>().ln().abs() } else { 0.0 };
        // log: (x - m) - log(s), with log(s) off by K E relative to s; softmax: relative K E.
        let t = |_: usize| if log { tol(2.0 * E, k * (1.0 + log_s)) } else { tol(k, 0.0) };
        compare(
            &format!("{name} forward row {r} of {rows}x{cols}"),
            dt,
            &ys[row.clone()],
            &want,
            t,
            |_| None,
            |i| format!("x = {:e}", xs[r * cols + i]),
        )?;
        // Backward from the GPU's own y (what autograd hands it).
        let (yr, gr) = (&ys[row.clone()], &gs[row.clone()]);
        let want = softmax_bwd_ref(yr, gr, log);
        let mag: f64 = if log {
            gr.iter().map(|&v| (v as f64).abs()).sum()
        } else {
            yr.iter().zip(gr).map(|(&y, &g)| (y as f64 * g as f64).abs()).sum()
        };
        let sum_g: f64 = gr.iter().map(|&v| v as f64).sum();
        let t = |i: usize| {
            let (y, g) = (yr[i] as f64, gr[i] as f64);
            if log {
                let ey = y.exp();
                tol(4.0 * E, ey * (k * mag + 4.0 * E * sum_g.abs()))
            } else {
                tol(4.0 * E, y.abs() * (k * mag + 2.0 * E * g.abs()))
            }
        };
        compare(
            &format!("{name} backward row {r} of {rows}x{cols}"),
            dt,
            &gx[row.clone()],
            &want,
            t,
            |_| None,
            |i| format!("y = {:e}, g = {:e}", yr[i], gr[i]),
        )?;
        // The reference gradient against finite differences of the f64 forward (a few entries
        // of the first row).
        if r == 0 && cols <= 4096 {
            let xr: Vec<f64> = xs[row.clone()].iter().map(|&v| v as f64).collect();
            let fwd64 = |x: &[f64]| {
                let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let s: f64 = x.iter().map(|&v| (v - m).exp()).sum();
                x.iter()
                    .zip(gr)
                    .map(|(&v, &g)| g as f64 * if log { v - m - s.ln() } else { (v - m).exp() / s })
                    .sum::<f64>()
            };
            let y64: Vec<f64> = softmax_ref(&xs[row.clone()], log);
            for i in [0, cols / 2, cols - 1] {
                let analytic = if log {
                    gr[i] as f64 - y64[i].exp() * sum_g
                } else {
                    let dot: f64 = y64.iter().zip(gr).map(|(&y, &g)| y * g as f64).sum();
                    y64[i] * (gr[i] as f64 - dot)
                };
                check_fd(&format!("{name} d/dx[{i}]"), analytic, fd(&xr, i, fwd64), mag.max(1.0))?;
            }
        }
    }
    // Determinism: the same input, the same bits.
    if bits(&fwd(&x).map_err(e)?)? != bits(&y)? {
        return Err(format!("{name}: two runs differ"));
    }
    Ok(())
}

/// NaN, infinities and all -inf rows behave as PyTorch's softmax. The five rows are repeated
/// eight times, so that for a length that is not whole vectors each starts at every offset within
/// a vector, next to the others (a neighbour's NaN or infinity in a row's first or last vector
/// must not leak into it).
fn softmax_specials(dev: &Device, dt: DType, cols: usize) -> Result<(), String> {
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let base: Vec<f32> = (0..cols).map(|i| round_to(dt, (i as f32 * 0.37).sin() * 4.0)).collect();
    let mut with = |i: usize, v: f32| {
        let mut r = base.clone();
        r[i % cols] = v;
        rows.push(r);
    };
    with(cols / 3, f32::NAN); // a NaN: the row is NaN
    with(cols / 2, f32::INFINITY); // +inf: NaN (inf - inf)
    with(0, f32::NEG_INFINITY); // -inf: probability 0, the rest normal
    rows.push(vec![f32::NEG_INFINITY; cols]); // all -inf: NaN
    rows.push(vec![round_to(dt, 3.0); cols]); // constant: uniform
    const REPS: usize = 8;
    let data: Vec<f32> = rows.concat().repeat(REPS);
    let x = tensor(dev, &data, &[rows.len() * REPS, cols], dt)?;
    for (log, b) in [false, true].into_iter().flat_map(|log| (0..REPS).map(move |b| (log, b))) {
        let y = if log { ops::log_softmax(&x) } else { ops::softmax(&x) }.map_err(e)?.to_f32_vec().map_err(e)?;
        let row = |r: usize| &y[(b * 5 + r) * cols..(b * 5 + r + 1) * cols];
        let ctx = format!("{dt:?} {cols} cols log={log} block {b}");
        if !row(0).iter().all(|v| v.is_nan())
            || !row(1).iter().all(|v| v.is_nan())
            || !row(3).iter().all(|v| v.is_nan())
        {
            return Err(format!("{ctx}: rows with NaN, +inf or all -inf must be NaN"));
        }
        let r2 = row(2);
        let want0 = if log { f32::NEG_INFINITY } else { 0.0 };
        // (With one column that row is all -inf, checked above as row 3.)
        if cols > 1 && (r2[0] != want0 || r2[1..].iter().any(|v| !v.is_finite())) {
            return Err(format!(
                "{ctx}: a -inf entry must give {want0} and leave the others finite, got {:?}",
                &r2[..2.min(cols)]
            ));
        }
        let u = if log { -(cols as f64).ln() } else { 1.0 / cols as f64 };
        if row(4).iter().any(|&v| !close(dt, v, u, tol(4.0 * E, 0.0))) {
            return Err(format!("{ctx}: a constant row must be uniform ({u})"));
        }
    }
    Ok(())
}

/// Row lengths that are not whole vectors (all odd, so rows start at every offset within a
/// vector).
const UNALIGNED: [usize; 7] = [1, 7, 9, 4097, 5123, 32001, 50257];

/// Whether rows of `cols` (not whole vectors) should run in registers: a row takes up to
/// `(cols + VEC - 1) / VEC` vectors rounded up, in up to 1024 threads of four vectors (the `_u`
/// kernels' most, forward and backward). So 5123 everywhere, 32001 in f16/bf16, 50257 nowhere.
fn unaligned_in_registers(dt: DType, cols: usize) -> bool {
    let vec = 16 / dt.size();
    let span = cols / vec + 1 + usize::from(cols % vec > 1);
    span <= 4 * 1024
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for log in [false, true] {
        let name = if log { "log_softmax" } else { "softmax" };
        tests.push(test(format!("{name}/random_shapes"), move |dev: &Device| {
            prop(48, (shapes(), dtype(), any::<u64>()), |((r, c), dt, seed)| softmax_case(dev, r, c, dt, log, seed))
        }));
    }
    for (rows, cols) in paths() {
        tests.push(test(format!("softmax/paths/{rows}x{cols}"), move |dev: &Device| {
            for dt in DType::ALL {
                for log in [false, true] {
                    softmax_case(dev, rows, cols, dt, log, (rows * cols) as u64)?;
                }
            }
            Ok(())
        }));
    }
    tests.push(test("softmax/few_rows_forward_vectors", |dev: &Device| {
        for (rows, cols, dt, want) in FEW_ROWS_FORWARD {
            for log in [false, true] {
                let [s, _] = ops::softmax_kernels(dev, log, dt, rows as u64, cols as u64).map_err(e)?;
                if !s.contains(want) {
                    return Err(format!("{rows}x{cols} {dt:?} runs {s}, not {want}"));
                }
                softmax_case(dev, rows, cols, dt, log, cols as u64)?;
            }
        }
        Ok(())
    }));
    tests.push(test("softmax/specials", |dev: &Device| {
        for dt in DType::ALL {
            for cols in [1, 5, 7, 9, 64, 1031, 4096, 4097, 5123, 40000, 50257] {
                softmax_specials(dev, dt, cols)?;
            }
        }
        Ok(())
    }));
    tests.push(test("softmax/unaligned_rows", |dev: &Device| {
        // Rows that are not whole vectors, in registers (`_u` kernels) where they fit, each
        // length over nine rows, so that rows start at every offset within a vector (any length
        // prime to the vector's elements). Which kernel each takes, then the values.
        for cols in UNALIGNED {
            for dt in DType::ALL {
                for log in [false, true] {
                    let [f, b] = ops::softmax_kernels(dev, log, dt, 9, cols as u64).map_err(e)?;
                    let want = unaligned_in_registers(dt, cols);
                    for (k, what) in [(&f, "_fwd_u"), (&b, "_bwd_u")] {
                        if k.contains(what) != want {
                            return Err(format!("9x{cols} {dt:?} log={log} runs {k}"));
                        }
                    }
                    softmax_case(dev, 9, cols, dt, log, cols as u64)?;
                }
            }
        }
        Ok(())
    }));
    tests.push(test("softmax/cluster_backward", |dev: &Device| {
        // Backward rows too long for one block's registers, held by a cluster on sm_90 (four
        // vectors a thread, up to 1024 threads a block); a row of 16388 f32 is cut unevenly
        // (c = 1: one block's registers; c = 0: rows not of whole vectors, in one block's
        // registers by the kernel for rows of any length).
        for (cols, c_f32, c_half) in [(32768usize, 2, 1), (16388, 2, 0), (40000, 4, 2), (131072, 8, 4)] {
            for dt in DType::ALL {
                for log in [false, true] {
                    let c = if dt == DType::F32 { c_f32 } else { c_half };
                    let [_, k] = ops::softmax_kernels(dev, log, dt, 5, cols as u64).map_err(e)?;
                    let want = match c {
                        0 => "_bwd_u".to_string(),
                        1 => "_bwd_v".to_string(),
                        c => format!("_bwd_c{c}_"),
                    };
                    if dev.compute_capability().0 >= 9 && !k.contains(&want) {
                        return Err(format!("5x{cols} {dt:?} runs {k}, not {want}"));
                    }
                    softmax_case(dev, 5, cols, dt, log, cols as u64)?;
                }
            }
        }
        Ok(())
    }));
    run(tests)
}
