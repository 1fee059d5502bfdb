//! GPU tests of layer norm and RMS norm, forward and backward, in f32, f16 and bf16, against
//! f64 references (`common::reference`) on random shapes (row lengths chosen to hit every kernel:
//! register-resident, persistent, cluster, slices and streaming) and random values with
//! outliers. The f64 backward reference is itself checked against central finite differences of
//! the f64 forward. Outputs come from poisoned (NaN-filled) allocations, so an unwritten element
//! fails; determinism is checked by running twice and comparing bits.
//!
//! Tolerances. With `E = 2^-24` (f32 rounding) and `K = L + log2(n) + 16`, where `L` bounds the
//! values one thread adds in sequence (64 in registers; `8 * ceil(n / 1024)` streaming) and
//! `log2(n)` the depth of the group reduction: a sum of `n` terms has error at most `K E` times
//! the sum of their magnitudes (the 16 covers `exp`'s 2 ulp, the rescalings of the online
//! softmax and the final products). Each check below scales `K E` by the magnitudes that enter
//! the result; `close` adds one ulp of the storage type for f16/bf16 outputs.

mod common;

use common::reference::{norm_bwd_ref, norm_ref};
use common::rows::*;
use common::*;
use kernels::ops;
use kernels::{DType, Device, Error, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

/// A norm case: `rows` rows of `values` moved by `shift` (2: a mean far from zero, so that
/// centring matters; 0: rows centred near zero, as transformer activations mostly are).
#[allow(clippy::too_many_arguments)]
fn norm_case(
    dev: &Device,
    rows: usize,
    cols: usize,
    dt: DType,
    layer: bool,
    affine: bool,
    seed: u64,
    shift: f32,
) -> Result<(), String> {
    let mut rng = TestRng::new(seed);
    let n = rows * cols;
    let xs: Vec<f32> = values(&mut rng, n, dt).into_iter().map(|v| round_to(dt, v + shift)).collect();
    let gs = draw(&mut rng, n, dt, Draw { scale: 1.0, positive: false, special: 0.0 });
    let ws: Vec<f32> = (0..cols).map(|_| round_to(dt, (1.0 + 0.5 * rng.normal()) as f32)).collect();
    let bs: Vec<f32> = (0..cols).map(|_| round_to(dt, rng.normal() as f32)).collect();
    let x = tensor(dev, &xs, &[rows, cols], dt)?;
    let g = tensor(dev, &gs, &[rows, cols], dt)?;
    let w = tensor(dev, &ws, &[cols], dt)?;
    let b = tensor(dev, &bs, &[cols], dt)?;
    let eps = 1e-5f32;
    let name = if layer { "layer_norm" } else { "rms_norm" };
    let (wo, bo) = if affine { (Some(&w), if layer { Some(&b) } else { None }) } else { (None, None) };
    let (y, stats) = if layer { ops::layer_norm(&x, wo, bo, eps) } else { ops::rms_norm(&x, wo, eps) }.map_err(e)?;
    let grads = if layer {
        ops::layer_norm_backward(&x, wo, bo, &stats, &g)
    } else {
        ops::rms_norm_backward(&x, wo, &stats, &g)
    }
    .map_err(e)?;
    let ys = y.to_f32_vec().map_err(e)?;
    let gx = grads.x.to_f32_vec().map_err(e)?;
    let rstd = stats.rstd.to_f32_vec().map_err(e)?;
    let mean = stats.mean.as_ref().map(|m| m.to_f32_vec()).transpose().map_err(e)?;
    let k = k_of(cols) * E;
    let w64: Vec<f64> = ws.iter().map(|&v| v as f64).collect();
    let b64: Vec<f64> = bs.iter().map(|&v| v as f64).collect();
    let (w_opt, b_opt) = (wo.map(|_| &w64[..]), bo.map(|_| &b64[..]));
    let (mut dw, mut db) = (vec![0.0f64; cols], vec![0.0f64; cols]);
    let (mut dw_mag, mut db_mag) = (vec![0.0f64; cols], vec![0.0f64; cols]);
    // The weight gradient's error from each row's xh (see dxh below).
    let mut dw_err = vec![0.0f64; cols];
    for r in 0..rows {
        let row = r * cols..(r + 1) * cols;
        let xr: Vec<f64> = xs[row.clone()].iter().map(|&v| v as f64).collect();
        let gr: Vec<f64> = gs[row.clone()].iter().map(|&v| v as f64).collect();
        let (want, m, rs) = norm_ref(&xr, w_opt, b_opt, eps as f64, layer);
        let mean_abs = xr.iter().map(|v| v.abs()).sum::<f64>() / cols as f64;
        if !close(DType::F32, rstd[r], rs, tol(k * (1.0 + mean_abs * mean_abs * rs * rs), 0.0)) {
            return Err(format!("{name} {rows}x{cols} row {r}: rstd {} want {rs}", rstd[r]));
        }
        if let Some(mv) = &mean
            && !close(DType::F32, mv[r], m, tol(0.0, k * mean_abs))
        {
            return Err(format!("{name} {rows}x{cols} row {r}: mean {} want {m}", mv[r]));
        }
        // Error of y: of the mean (K E mean|x|) and of rstd (relative K E (1 + mean^2 rstd^2)),
        // times rstd and the weight, plus the roundings of the products.
        let rel_rstd = k * (1.0 + mean_abs * mean_abs * rs * rs);
        let t = |i: usize| {
            let wv = w_opt.map_or(1.0, |w| w[i]).abs();
            tol(
                4.0 * E,
                wv * rs * (k * mean_abs + rel_rstd * (xr[i] - m).abs()) + 4.0 * E * b_opt.map_or(0.0, |b| b[i].abs()),
            )
        };
        compare(
            &format!("{name} forward row {r} of {rows}x{cols}"),
            dt,
            &ys[row.clone()],
            &want,
            t,
            |_| None,
            |i| format!("x = {:e}", xr[i]),
        )?;
        let want = norm_bwd_ref(&xr, w_opt, &gr, eps as f64, layer);
        let xh: Vec<f64> = xr.iter().map(|&v| (v - m) * rs).collect();
        let gw: Vec<f64> = (0..cols).map(|i| gr[i] * w_opt.map_or(1.0, |w| w[i])).collect();
        let s_gw = gw.iter().map(|v| v.abs()).sum::<f64>() / cols as f64;
        let s_gwxh = gw.iter().zip(&xh).map(|(a, b)| (a * b).abs()).sum::<f64>() / cols as f64;
        // xh = (x - mean) * rstd on the GPU carries the mean's error times rstd (absolute) and
        // rstd's (relative): |dxh| <= (k + rel_rstd) (mean|x| rstd + |xh|); it enters gx directly
        // and through the row sums of gw and gw * xh.
        let dxh = |i: usize| (k + rel_rstd) * (mean_abs * rs + xh[i].abs());
        let t = |i: usize| {
            let sums = (k + rel_rstd) * (gw[i].abs() + s_gw + (1.0 + xh[i].abs()) * (s_gwxh + s_gw));
            tol(4.0 * E, rs * (sums * (1.0 + mean_abs * rs) + dxh(i) * s_gwxh))
        };
        compare(
            &format!("{name} backward row {r} of {rows}x{cols}"),
            dt,
            &gx[row.clone()],
            &want,
            t,
            |_| None,
            |i| format!("x = {:e}, g = {:e}", xr[i], gr[i]),
        )?;
        if r == 0 && cols <= 4096 {
            let f = |x: &[f64]| {
                norm_ref(x, w_opt, b_opt, eps as f64, layer).0.iter().zip(&gr).map(|(y, g)| y * g).sum::<f64>()
            };
            for i in [0, cols / 2, cols - 1] {
                check_fd(&format!("{name} d/dx[{i}]"), want[i], fd(&xr, i, f), rs * s_gw * cols as f64)?;
            }
        }
        for i in 0..cols {
            dw[i] += gr[i] * xh[i];
            db[i] += gr[i];
            dw_mag[i] += (gr[i] * xh[i]).abs();
            dw_err[i] += gr[i].abs() * dxh(i);
            db_mag[i] += gr[i].abs();
        }
    }
    // Parameter gradients: column sums over the rows (sequential chains of at most `rows`).
    let kc = (rows as f64 + 16.0) * E + k;
    if let Some(gw) = &grads.weight {
        let got = gw.to_f32_vec().map_err(e)?;
        compare(
            &format!("{name} weight gradient {rows}x{cols}"),
            dt,
            &got,
            &dw,
            |i| tol(0.0, kc * 2.0 * dw_mag[i] + dw_err[i]),
            |_| None,
            |i| format!("column {i}"),
        )?;
    } else if affine {
        return Err(format!("{name}: no weight gradient"));
    }
    if let Some(gb) = &grads.bias {
        let got = gb.to_f32_vec().map_err(e)?;
        compare(
            &format!("{name} bias gradient {rows}x{cols}"),
            dt,
            &got,
            &db,
            |i| tol(0.0, kc * db_mag[i]),
            |_| None,
            |i| format!("column {i}"),
        )?;
    }
    if affine != grads.weight.is_some() || (affine && layer) != grads.bias.is_some() {
        return Err(format!("{name}: parameter gradients returned for parameters not given (or missing)"));
    }
    // Determinism of the forward and of the column sums.
    let (y2, _) = if layer { ops::layer_norm(&x, wo, bo, eps) } else { ops::rms_norm(&x, wo, eps) }.map_err(e)?;
    if bits(&y2)? != bits(&y)? {
        return Err(format!("{name}: two forward runs differ"));
    }
    if let Some(gw) = &grads.weight {
        let again = if layer {
            ops::layer_norm_backward(&x, wo, bo, &stats, &g)
        } else {
            ops::rms_norm_backward(&x, wo, &stats, &g)
        }
        .map_err(e)?;
        if bits(again.weight.as_ref().unwrap())? != bits(gw)? {
            return Err(format!("{name}: two weight gradients differ"));
        }
    }
    Ok(())
}

fn norm_errors(dev: &Device) -> Result<(), String> {
    let x = Tensor::rand_normal(dev, &[4, 10], DType::F32, 0.0, 1.0, 1).map_err(e)?;
    let w = Tensor::full(dev, &[9], DType::F32, 1.0).map_err(e)?;
    if !matches!(ops::layer_norm(&x, Some(&w), None, 1e-5), Err(Error::ShapeMismatch { .. })) {
        return Err("a weight of the wrong length must be a shape error".into());
    }
    if !matches!(ops::rms_norm(&x, None, f32::NAN), Err(Error::InvalidArgument { .. })) {
        return Err("a NaN eps must be rejected".into());
    }
    let s = Tensor::full(dev, &[], DType::F32, 1.0).map_err(e)?;
    if !matches!(ops::softmax(&s), Err(Error::InvalidArgument { .. })) {
        return Err("softmax of a scalar (no last dimension) must be an error".into());
    }
    // Empty: no rows.
    let z = Tensor::zeros(dev, &[0, 7], DType::BF16).map_err(e)?;
    if ops::softmax(&z).map_err(e)?.shape() != [0, 7] {
        return Err("softmax of [0, 7] must be [0, 7]".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for (rows, cols) in paths() {
        tests.push(test(format!("norms/paths/{rows}x{cols}"), move |dev: &Device| {
            for dt in DType::ALL {
                for layer in [true, false] {
                    norm_case(dev, rows, cols, dt, layer, true, (rows + cols) as u64, 2.0)?;
                }
                norm_case(dev, rows, cols, dt, true, true, (rows * cols) as u64, 0.0)?;
            }
            Ok(())
        }));
    }
    tests.push(test("norms/few_rows_forward_vectors", |dev: &Device| {
        for (rows, cols, dt, want) in FEW_ROWS_FORWARD {
            for layer in [true, false] {
                let [k, _] = ops::norm_kernels(dev, layer, dt, rows as u64, cols as u64, true).map_err(e)?;
                if !k.contains(want) {
                    return Err(format!("{rows}x{cols} {dt:?} runs {k}, not {want}"));
                }
                norm_case(dev, rows, cols, dt, layer, true, (rows * cols) as u64, 2.0)?;
            }
        }
        Ok(())
    }));
    for layer in [true, false] {
        let name = if layer { "layer_norm" } else { "rms_norm" };
        tests.push(test(format!("{name}/random_shapes"), move |dev: &Device| {
            prop(
                40,
                (shapes(), dtype(), any::<bool>(), any::<u64>(), any::<bool>()),
                |((r, c), dt, affine, seed, far)| {
                    norm_case(dev, r, c, dt, layer, affine, seed, if far { 2.0 } else { 0.0 })
                },
            )
        }));
    }
    tests.push(test("layer_norm/large_mean", |dev: &Device| {
        // A mean far from zero against a unit spread: E[x^2] - mean^2 would lose every digit
        // of the variance here (x^2 ~ 1e8, its f32 rounding ~ 4), so this checks that the
        // variance is computed stably, in every path (registers at 1, 2, 4 and 8 vectors a
        // thread, and streaming: 1001 and 100003 columns are not whole vectors). It tells the
        // two apart in f32 only: f16/bf16 cannot store such a ratio (their spacing at 1e4 is
        // 8 and 64), so there the offset is 100 and the paths are checked at a modest one.
        let mut rng = TestRng::new(17);
        for dt in DType::ALL {
            for cols in [8usize, 64, 1000, 1001, 4096, 32768, 100003] {
                let rows = 3;
                let offset = if dt == DType::F32 { 1e4 } else { 100.0 };
                let xs: Vec<f32> = (0..rows * cols).map(|_| round_to(dt, (offset + rng.normal()) as f32)).collect();
                let x = tensor(dev, &xs, &[rows, cols], dt)?;
                let (_, stats) = ops::layer_norm(&x, None, None, 1e-5).map_err(e)?;
                let rstd = stats.rstd.to_f32_vec().map_err(e)?;
                let mean = stats.mean.as_ref().expect("layer norm saves the mean").to_f32_vec().map_err(e)?;
                for r in 0..rows {
                    let xr: Vec<f64> = xs[r * cols..(r + 1) * cols].iter().map(|&v| v as f64).collect();
                    let (_, m, rs) = norm_ref(&xr, None, None, 1e-5, true);
                    // The mean to 1e-5 of the offset (sums of 1e4-sized values). rstd: the
                    // two-pass variance is off by the square of the mean's error relative to
                    // the spread, (1e-7 x 1e4 x a few tens)^2 ~ 1e-4 at worst; E[x^2] - mean^2
                    // would be off by ~ f32 eps x 1e8 = 6 times the variance itself.
                    let rel = (rstd[r] as f64 - rs).abs() / rs;
                    if (mean[r] as f64 - m).abs() > 1e-5 * offset || rel > 1e-2 {
                        return Err(format!(
                            "{dt:?} {rows}x{cols} row {r}: mean {} rstd {} want {m} {rs} (relative {rel:e})",
                            mean[r], rstd[r]
                        ));
                    }
                }
            }
        }
        Ok(())
    }));
    tests.push(test("norms/many_rows_persistent", |dev: &Device| {
        // More rows than a wave of blocks: the persistent backward's loop and its partial sums.
        let rows = if sanitizer() { 300 } else { 20000 };
        for dt in DType::ALL {
            norm_case(dev, rows, 64, dt, true, true, 5, 2.0)?;
            norm_case(dev, rows, 128, dt, false, true, 6, 2.0)?;
        }
        Ok(())
    }));
    tests.push(test("norms/thin_half_backward", |dev: &Device| {
        // Rows of 8192 (launch rule in host/ops/norm.rs, `backward_plan`): f16/bf16 layer norm
        // and f16 RMS norm would fit one 512-thread block an SM (two vectors a thread, 72-80
        // registers), so on sm_90 more than eight rows an SM take a cluster of 4 instead; fewer
        // rows, f32 (one block an SM too) and bf16 RMS norm (64 registers, two blocks an SM) stay
        // in one block. When the kernels' registers change, this rule needs measuring again.
        // Under the sanitizer, 72 rows: past the slices kernel's 64 (`norms/slices_backward`).
        let many = 8 * dev.sm_count() as usize + 144;
        let all_rows = if sanitizer() { vec![72] } else { vec![600, many] };
        for rows in all_rows {
            for dt in DType::ALL {
                for layer in [true, false] {
                    let [_, k] = ops::norm_kernels(dev, layer, dt, rows as u64, 8192, true).map_err(e)?;
                    let thin = dt != DType::F32 && (layer || dt == DType::F16);
                    let want = if thin && rows == many { "_bwd_c4_" } else { "_bwd_v" };
                    if dev.compute_capability().0 >= 9 && !k.contains(want) {
                        return Err(format!("{rows}x8192 {dt:?} runs {k}, not {want}"));
                    }
                    norm_case(dev, rows, 8192, dt, layer, true, 8192 + rows as u64, 2.0)?;
                }
            }
        }
        Ok(())
    }));
    tests.push(test("norms/slices_backward", |dev: &Device| {
        // At most 64 rows with parameter gradients: on sm_90 one cluster of eight blocks
        // (sixteen over 2^16 elements where the device can schedule them, as every H100 SXM
        // and H200 can), each a slice of the columns of every row (host: `slices_plan`). Slices
        // narrower than a warp (8, 200 and 1000 columns: several rows a warp; at 8, blocks with
        // no columns at all), wider than one (1032, 2048, 4000, 4096, 8192, 16384: several warps
        // across; 1032 and 4000 in slices of unequal length), one to eight rows a thread, rows
        // not filling the last row slot; the same bits on a second run; without parameter
        // gradients, or with 128 rows (where the persistent plan is faster), the other kernels.
        for (rows, cols) in [
            (64usize, 1024usize),
            (9, 1024),
            (8, 1024),
            (2, 4000),
            (24, 4096),
            (16, 8192),
            (64, 2048),
            (8, 16384),
            (3, 8),
            (60, 200),
            (1, 1000),
            (40, 1032),
            (128, 1024),
            (128, 128),
        ] {
            for dt in DType::ALL {
                for layer in [true, false] {
                    let [_, k] = ops::norm_kernels(dev, layer, dt, rows as u64, cols as u64, true).map_err(e)?;
                    let sm90 = dev.compute_capability().0 >= 9;
                    if k.contains("_bwd_slices_") != (sm90 && rows <= 64) {
                        return Err(format!("{rows}x{cols} {dt:?} runs {k}"));
                    }
                    let sixteen = rows * cols > 1 << 16;
                    if k.contains("_slices_") && dev.sm_count() >= 132 && k.contains("_k16_") != sixteen {
                        return Err(format!(
                            "{rows}x{cols} {dt:?} runs {k} ({} blocks expected)",
                            if sixteen { 16 } else { 8 }
                        ));
                    }
                    let [_, k] = ops::norm_kernels(dev, layer, dt, rows as u64, cols as u64, false).map_err(e)?;
                    if k.contains("_slices_") {
                        return Err(format!("{rows}x{cols} {dt:?} without parameter gradients runs {k}"));
                    }
                    for affine in [true, false] {
                        norm_case(dev, rows, cols, dt, layer, affine, (5 * rows + cols) as u64, 2.0)?;
                    }
                }
                let mut rng = TestRng::new(rows as u64 + 1);
                let x = tensor(dev, &values(&mut rng, rows * cols, dt), &[rows, cols], dt)?;
                let g = tensor(dev, &values(&mut rng, rows * cols, dt), &[rows, cols], dt)?;
                let w = tensor(dev, &values(&mut rng, cols, dt), &[cols], dt)?;
                let (_, st) = ops::rms_norm(&x, Some(&w), 1e-5).map_err(e)?;
                let run = || -> Result<Vec<Vec<u32>>, String> {
                    let gr = ops::rms_norm_backward(&x, Some(&w), &st, &g).map_err(e)?;
                    Ok(vec![bits(&gr.x)?, bits(gr.weight.as_ref().expect("asked for"))?])
                };
                if run()? != run()? {
                    return Err(format!("rms norm backward {rows}x{cols} {dt:?}: two runs differ"));
                }
            }
        }
        Ok(())
    }));
    tests.push(test("norms/cluster_backward", |dev: &Device| {
        // Rows too long for one block's registers, held by clusters of 4 or 8 blocks on sm_90
        // (two vectors a thread, up to 1024 threads a block): more rows than resident clusters
        // (each walks several), runs of unequal length (16392 f32 is 4098 vectors over four
        // blocks), with and without parameters.
        let rows = if sanitizer() { 9 } else { 70 };
        for (cols, c_f32, c_half) in [(32768usize, 4, 4), (16392, 4, 4), (40000, 8, 4), (65536, 8, 4), (65544, 0, 8)] {
            for dt in DType::ALL {
                let c = if dt == DType::F32 { c_f32 } else { c_half };
                for layer in [true, false] {
                    for affine in [true, false] {
                        let [_, k] = ops::norm_kernels(dev, layer, dt, rows as u64, cols as u64, affine).map_err(e)?;
                        // (c = 0: too long for a cluster, streamed.)
                        let want = if c == 0 { "_bwd_stream_".to_string() } else { format!("_bwd_c{c}_") };
                        if dev.compute_capability().0 >= 9 && !k.contains(&want) {
                            return Err(format!("{rows}x{cols} {dt:?} runs {k}, not {want}"));
                        }
                        norm_case(dev, rows, cols, dt, layer, affine, (cols + rows) as u64, 2.0)?;
                    }
                }
            }
        }
        Ok(())
    }));
    tests.push(test("norms/errors", norm_errors));
    run(tests)
}
