//! CPU tests of the kernels' formulas: the very f32 code the GPU runs (`kernels_gpu::ops`, built
//! for the host) against the f64 references of `tests/common/reference.rs`, with the same
//! tolerances as the GPU tests, and the references' derivatives against central finite
//! differences. A wrong formula fails here, in CI, without a GPU.

mod common;

use common::reference as r;
use common::*;
use kernels::DType;
use kernels::ops::BinaryOp;
use kernels_gpu::ops::{PowForm, Unary};

const N: usize = 200_000;

#[test]
fn unary_formulas_match_the_f64_references() {
    for (op, d) in unary_ops() {
        let mut rng = TestRng::new(0x5eed ^ N as u64);
        let xs = draw(&mut rng, N, DType::F32, d);
        let gs = draw(&mut rng, N, DType::F32, Draw { scale: 1.0, positive: false, special: 0.02 });
        let (k, a, b) = op.kernel();
        let fwd: Vec<f32> = xs.iter().map(|&x| k.fwd_f32(x, a, b)).collect();
        let want: Vec<f64> = xs.iter().map(|&x| r::unary_fwd(op, x as f64)).collect();
        let show = |i: usize| format!("x = {:e}", xs[i]);
        compare(
            &format!("{op:?} forward"),
            DType::F32,
            &fwd,
            &want,
            |i| r::unary_fwd_tol(op, xs[i] as f64),
            |i| at_extremes(&[xs[i]], || fwd[i]),
            show,
        )
        .unwrap();
        let bwd: Vec<f32> = (0..N).map(|i| k.bwd_f32(xs[i], gs[i], a, b)).collect();
        let want: Vec<f64> = (0..N).map(|i| r::unary_bwd(op, xs[i] as f64, gs[i] as f64)).collect();
        compare(
            &format!("{op:?} backward"),
            DType::F32,
            &bwd,
            &want,
            |i| r::unary_bwd_tol(op, xs[i] as f64, gs[i] as f64),
            |i| at_extremes(&[xs[i], gs[i]], || bwd[i]),
            show,
        )
        .unwrap();
    }
}

#[test]
fn output_grad_formulas_match_the_f64_references() {
    for (op, d, kernel) in output_grad_ops() {
        let mut rng = TestRng::new(0xb1d ^ N as u64);
        let xs = draw(&mut rng, N, DType::F32, d);
        let gs = draw(&mut rng, N, DType::F32, Draw { scale: 1.0, positive: false, special: 0.02 });
        let (k, a, b) = op.kernel();
        let ys: Vec<f32> = xs.iter().map(|&x| k.fwd_f32(x, a, b)).collect();
        let got: Vec<f32> = (0..N).map(|i| bwd_y_f32(op, kernel, ys[i], gs[i])).collect();
        check_bwd_y(op, kernel, DType::F32, &xs, &ys, &gs, &got).unwrap();
    }
}

/// pow's per-form small entries (`ops::PowForm`) must give the all-forms kernel's bits, for the
/// exponents the host sends to them (the forward's `p`, the backward's `p - 1`) and only those.
#[test]
fn pow_form_entries_compute_pows_bits() {
    let mut rng = TestRng::new(0x9e3779b9);
    let xs = draw(&mut rng, N, DType::F32, Draw::NORMAL);
    let gs = draw(&mut rng, N, DType::F32, Draw { scale: 1.0, positive: false, special: 0.02 });
    let pow = Unary::Pow;
    let with_entry = [2.0, 3.0, 1.0, -1.0];
    for p in [2.0, 3.0, 1.0, -1.0, 4.0, 0.0, 0.5, 2.5, -2.0, -3.0, f32::INFINITY, f32::NAN] {
        assert_eq!(PowForm::of(p).is_some(), with_entry.contains(&p), "PowForm::of({p})");
        if let Some(f) = PowForm::of(p) {
            for &x in &xs {
                let (got, want) = (f.fwd_f32(x, p, 0.0), pow.fwd_f32(x, p, 0.0));
                assert!(same_bits(got, want), "{f:?} forward at x = {x:e}, p = {p}: {got:e}, pow {want:e}");
            }
        }
        if let Some(f) = PowForm::of(p - 1.0) {
            for (&x, &g) in xs.iter().zip(&gs) {
                let (got, want) = (f.bwd_f32(x, g, p, 0.0), pow.bwd_f32(x, g, p, 0.0));
                assert!(same_bits(got, want), "{f:?} backward at x = {x:e}, g = {g:e}, p = {p}: {got:e}, pow {want:e}");
            }
        }
    }
}

/// Equal bits, any NaN equal to any NaN.
fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn reference_derivatives_match_finite_differences() {
    for (op, d) in unary_ops() {
        let mut rng = TestRng::new(77);
        for x in draw(&mut rng, 20_000, DType::F32, Draw { special: 0.0, ..d }) {
            let Some(fd) = r::finite_difference(op, x as f64) else { continue };
            let analytic = r::unary_bwd(op, x as f64, 1.0);
            assert!(
                (analytic - fd).abs() <= 1e-5 * (1.0 + fd.abs()),
                "{op:?} at {x:e}: derivative {analytic:e}, finite difference {fd:e}"
            );
        }
    }
}

/// The gated kernels' f32 formulas (`kernels_gpu::glu::fwd_one`, `bwd_one`) against the f64
/// references and their bounds, for every activation, on the GPU tests' inputs; and the
/// references' derivatives against finite differences.
#[test]
fn glu_formulas_match_the_f64_references() {
    const M: usize = 50_000;
    for act in activations() {
        let mut rng = TestRng::new(0x91 ^ M as u64);
        let xa = draw(&mut rng, M, DType::F32, Draw::NORMAL);
        let xb = draw(&mut rng, M, DType::F32, Draw::NORMAL);
        let gs = draw(&mut rng, M, DType::F32, Draw { scale: 1.0, positive: false, special: 0.02 });
        let (k, p0, p1) = act.kernel();
        let (a, b, g) = (|i: usize| xa[i] as f64, |i: usize| xb[i] as f64, |i: usize| gs[i] as f64);
        let show = |i: usize| format!("a = {:e}, b = {:e}, g = {:e}", xa[i], xb[i], gs[i]);
        let fwd: Vec<f32> = (0..M).map(|i| k.glu_fwd_f32(xa[i], xb[i], p0, p1)).collect();
        let want: Vec<f64> = (0..M).map(|i| r::glu_fwd(act, a(i), b(i))).collect();
        compare(
            &format!("glu {act:?} forward"),
            DType::F32,
            &fwd,
            &want,
            |i| r::glu_fwd_tol(act, a(i), b(i)),
            |i| at_extremes(&[xa[i], xb[i]], || fwd[i]),
            show,
        )
        .unwrap();
        let bwd: Vec<(f32, f32)> = (0..M).map(|i| k.glu_bwd_f32(xa[i], xb[i], gs[i], p0, p1)).collect();
        let want: Vec<(f64, f64)> = (0..M).map(|i| r::glu_bwd(act, a(i), b(i), g(i))).collect();
        let tol = |i: usize| r::glu_bwd_tol(act, a(i), b(i), g(i));
        let em = |i: usize| at_extremes(&[xa[i], xb[i], gs[i]], || 0.0).map(|_| bwd[i]);
        for (what, pick) in [("d/da", 0usize), ("d/db", 1)] {
            let side = |p: (f32, f32)| if pick == 0 { p.0 } else { p.1 };
            let side64 = |p: (f64, f64)| if pick == 0 { p.0 } else { p.1 };
            compare(
                &format!("glu {act:?} {what}"),
                DType::F32,
                &bwd.iter().map(|&p| side(p)).collect::<Vec<_>>(),
                &want.iter().map(|&p| side64(p)).collect::<Vec<_>>(),
                |i| if pick == 0 { tol(i).0 } else { tol(i).1 },
                |i| em(i).map(side),
                show,
            )
            .unwrap();
        }
        let (mut checked, fd_n) = (0, 20_000);
        for i in 0..fd_n {
            let Some((fa, fb)) = r::glu_finite_difference(act, a(i), b(i)) else { continue };
            let (da, db) = r::glu_bwd(act, a(i), b(i), 1.0);
            // The activation's difference quotient, within 1e-5 (1 + |d|), scaled by b.
            let err_a = 1e-5 * (1.0 + fa.abs()) * b(i).abs().max(1.0);
            assert!(
                (da - fa).abs() <= err_a && (db - fb).abs() <= 1e-5 * (1.0 + fb.abs()),
                "glu {act:?} at {}: derivatives ({da:e}, {db:e}), finite differences ({fa:e}, {fb:e})",
                show(i)
            );
            checked += 1;
        }
        assert!(checked > fd_n / 2, "glu {act:?}: {checked} finite differences of {fd_n}");
    }
}

#[test]
fn binary_formulas_match_the_f64_references() {
    for op in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div] {
        let mut rng = TestRng::new(3);
        let (xs, ys) = (draw(&mut rng, N, DType::F32, Draw::NORMAL), draw(&mut rng, N, DType::F32, Draw::NORMAL));
        let gs = draw(&mut rng, N, DType::F32, Draw::NORMAL);
        let k = op.kernel();
        let show = |i: usize| format!("x = {:e}, y = {:e}, g = {:e}", xs[i], ys[i], gs[i]);
        let fwd: Vec<f32> = (0..N).map(|i| k.fwd_f32(xs[i], ys[i])).collect();
        let want: Vec<f64> = (0..N).map(|i| r::binary_fwd(op, xs[i] as f64, ys[i] as f64)).collect();
        compare(
            &format!("{op:?}"),
            DType::F32,
            &fwd,
            &want,
            |_| Tol { rtol: 0.0, atol: 0.0 },
            |i| at_extremes(&[xs[i], ys[i]], || fwd[i]),
            show,
        )
        .unwrap();
        let bwd: Vec<(f32, f32)> = (0..N).map(|i| k.bwd_f32(xs[i], ys[i], gs[i])).collect();
        let refs: Vec<(f64, f64)> =
            (0..N).map(|i| r::binary_bwd(op, xs[i] as f64, ys[i] as f64, gs[i] as f64)).collect();
        let tol = |i: usize| r::binary_bwd_tol(op, ys[i] as f64, gs[i] as f64);
        let gx: Vec<f32> = bwd.iter().map(|p| p.0).collect();
        let gy: Vec<f32> = bwd.iter().map(|p| p.1).collect();
        compare(
            &format!("{op:?} d/dx"),
            DType::F32,
            &gx,
            &refs.iter().map(|p| p.0).collect::<Vec<_>>(),
            |i| tol(i).0,
            |i| at_extremes(&[xs[i], ys[i], gs[i]], || gx[i]),
            show,
        )
        .unwrap();
        compare(
            &format!("{op:?} d/dy"),
            DType::F32,
            &gy,
            &refs.iter().map(|p| p.1).collect::<Vec<_>>(),
            |i| tol(i).1,
            |i| at_extremes(&[xs[i], ys[i], gs[i]], || gy[i]),
            show,
        )
        .unwrap();
    }
}

/// The AdamW update the kernels run (`kernels_gpu::optim::adamw_update` with the host's folded
/// constants) against PyTorch's formula in f64, within the bounds derived in `tests/optim.rs`:
/// several configurations, early and late steps, zero gradients and moments.
#[test]
fn adamw_update_matches_the_f64_reference() {
    use kernels::ops::AdamW;
    let d = AdamW::default();
    let configs = [
        d,
        AdamW { lr: 0.1, beta1: 0.5, beta2: 0.9, eps: 1e-3, weight_decay: 0.3 },
        AdamW { lr: 1e-2, beta1: 0.0, beta2: 0.0, eps: 1e-6, weight_decay: 0.0 },
        AdamW { lr: 0.0, weight_decay: 0.0, ..d },
        AdamW { lr: 3e-4, beta1: 0.99, beta2: 0.9999, eps: 1e-8, weight_decay: 0.1 },
    ];
    let n = N / 4;
    for (ci, cfg) in configs.iter().enumerate() {
        for step in [1u64, 2, 3, 10, 1000, 1 << 40] {
            let s = cfg.scalars(step).unwrap();
            let mut rng = TestRng::new(ci as u64 * 1000 + step);
            let scale = 10f64.powf(rng.unit() * 4.0 - 3.0);
            let ps = draw(&mut rng, n, DType::F32, Draw::FINITE);
            let gs: Vec<f32> =
                (0..n).map(|_| if rng.unit() < 0.03 { 0.0 } else { (rng.normal() * scale) as f32 }).collect();
            let ms: Vec<f32> = (0..n).map(|_| if step == 1 { 0.0 } else { (rng.normal() * scale) as f32 }).collect();
            let vs: Vec<f32> = (0..n)
                .map(|_| if step == 1 || rng.unit() < 0.03 { 0.0 } else { (rng.normal() * scale).powi(2) as f32 })
                .collect();
            let got: Vec<(f32, f32, f32)> =
                (0..n).map(|i| kernels_gpu::optim::adamw_update(ps[i], gs[i], ms[i], vs[i], &s)).collect();
            let want: Vec<r::AdamWStep> =
                (0..n).map(|i| r::adamw(ps[i] as f64, gs[i] as f64, ms[i] as f64, vs[i] as f64, cfg, step)).collect();
            let show = |i: usize| format!("p = {:e}, g = {:e}, m = {:e}, v = {:e}", ps[i], gs[i], ms[i], vs[i]);
            let what = |x: &str| format!("AdamW {x}, {cfg:?}, step {step}");
            let pick = |f: fn(&(f32, f32, f32)) -> f32| got.iter().map(f).collect::<Vec<f32>>();
            let none = |_| None;
            let (gp, gm, gv) = (pick(|t| t.0), pick(|t| t.1), pick(|t| t.2));
            let wp: Vec<f64> = want.iter().map(|w| w.p).collect();
            let wm: Vec<f64> = want.iter().map(|w| w.m).collect();
            let wv: Vec<f64> = want.iter().map(|w| w.v).collect();
            compare(&what("p"), DType::F32, &gp, &wp, |i| want[i].tol_p, none, show).unwrap();
            compare(&what("m"), DType::F32, &gm, &wm, |i| want[i].tol_m, none, show).unwrap();
            compare(&what("v"), DType::F32, &gv, &wv, |i| want[i].tol_v, none, show).unwrap();
            if cfg.lr == 0.0 {
                assert!((0..n).all(|i| gp[i].to_bits() == ps[i].to_bits() || ps[i] == 0.0), "lr = 0 moved p");
            }
        }
    }
}

/// The 3xTF32 split (`kernels_gpu::gemm_tf32x3::split_tf32`, the code the GEMM runs): `hi` is `x`
/// rounded to TF32 (to nearest, ties away), `lo` is the exact rest, and what the tensor core
/// reads of them (`lo` truncated to TF32) is within `max(2^-21 |x|, 2^-136)` of `x`;
/// infinities give `lo = 0`, NaN a NaN `lo`.
#[test]
fn tf32x3_split_holds_x_to_2_pow_minus_21() {
    use kernels_gpu::gemm_tf32x3::split_tf32;
    let tf32 = |b: u32| f32::from_bits(b & 0xffff_e000) as f64;
    let mut rng = TestRng::new(0x7f32);
    let mut xs: Vec<f32> =
        (0..N).map(|_| (rng.normal() * 10f64.powi((rng.next_u64() % 60) as i32 - 30)) as f32).collect();
    xs.extend((0..N / 10).map(|_| f32::from_bits(rng.next_u64() as u32 & 0x7fff_ffff)).filter(|x| x.is_finite()));
    xs.extend([0.0, -0.0, 1.0, -1.0, f32::MIN_POSITIVE, 1e-40, -3e-45, 1.0 + f32::EPSILON, 3.4e38, -3.4e38]);
    // Ties: exactly half a TF32 step above 1 rounds away from zero.
    xs.push(f32::from_bits(0x3f80_1000));
    for &x in &xs {
        let (hi, lo) = split_tf32(x);
        assert_eq!(hi & 0x1fff, 0, "x = {x:e}: hi has bits below TF32");
        let seen = tf32(hi) + tf32(lo);
        let bound = (2f64.powi(-21) * (x as f64).abs()).max(2f64.powi(-136));
        assert!((seen - x as f64).abs() <= bound, "x = {x:e}: hi + lo = {seen:e}, off by more than {bound:e}");
        // hi is the nearest TF32 value (ties away from zero).
        let step = 2f64.powi(((x as f64).abs().log2().floor() as i32).max(-200) - 10).max(2f64.powi(-136));
        assert!(
            (tf32(hi) - x as f64).abs() <= step / 2.0 || x.abs() > 3.4e38,
            "x = {x:e}: hi = {} is not the nearest TF32",
            tf32(hi)
        );
    }
    assert_eq!(f32::from_bits(split_tf32(1.0 + 2f32.powi(-11)).0), 1.0 + 2f32.powi(-10), "ties round away");
    for inf in [f32::INFINITY, f32::NEG_INFINITY] {
        assert_eq!(split_tf32(inf), (inf.to_bits(), 0), "infinity: lo must be 0");
    }
    for nan in [f32::NAN, f32::from_bits(0x7f80_0001), f32::from_bits(0xffff_ffff)] {
        assert!(f32::from_bits(split_tf32(nan).1).is_nan(), "NaN {:#x}: lo must be NaN", nan.to_bits());
    }
}

/// Plain TF32's rounding (`kernels_gpu::gemm_tf32x3::round_tf32`, the code the GEMM runs): what
/// the tensor core reads of it (the top 19 bits) is `x` rounded to the nearest TF32 value, ties
/// away from zero (`cvt.rna.tf32.f32`), against a reference computed in f64 from the exponent;
/// so within `max(2^-11 |x|, 2^-137)` of `x`. Infinities stay, finite values within half a step
/// of `f32::MAX` become infinities, and every NaN stays a NaN as the tensor core reads it.
#[test]
fn tf32_round_is_to_nearest_and_keeps_nan() {
    use kernels_gpu::gemm_tf32x3::round_tf32;
    let seen = |x: f32| f32::from_bits(round_tf32(x) & 0xffff_e000);
    let mut rng = TestRng::new(0x7f31);
    let mut xs: Vec<f32> =
        (0..N).map(|_| (rng.normal() * 10f64.powi((rng.next_u64() % 60) as i32 - 30)) as f32).collect();
    xs.extend((0..N / 10).map(|_| f32::from_bits(rng.next_u64() as u32)).filter(|x| x.is_finite()));
    xs.extend([0.0, -0.0, 1.0, -1.0, f32::MIN_POSITIVE, 1e-40, -3e-45, 1.0 + f32::EPSILON, 3.4e38, -3.4e38]);
    xs.extend([f32::MAX, -f32::MAX, f32::from_bits(0x7f7f_efff), f32::from_bits(0x007f_f000)]);
    // Ties, both signs: half a TF32 step above 1 and below -1.
    xs.extend([f32::from_bits(0x3f80_1000), f32::from_bits(0xbf80_1000)]);
    for &x in &xs {
        // The nearest TF32 value: 10 mantissa bits at x's exponent (-126 for denormals).
        let e = (((x.to_bits() >> 23) & 0xff) as i32 - 127).max(-126);
        let step = 2f64.powi(e - 10);
        let want = ((x.abs() as f64 / step + 0.5).floor() * step).copysign(x as f64) as f32;
        let got = seen(x);
        assert_eq!(got.to_bits(), want.to_bits(), "x = {x:e} ({:#x}): {got:e}, expected {want:e}", x.to_bits());
        let bound = (2f64.powi(-11) * (x as f64).abs()).max(2f64.powi(-137));
        assert!(want.is_infinite() || (got as f64 - x as f64).abs() <= bound, "x = {x:e}: {got:e}");
    }
    assert_eq!(seen(1.0 + 2f32.powi(-11)), 1.0 + 2f32.powi(-10), "ties round away");
    assert_eq!(seen(f32::MAX), f32::INFINITY, "within half a step of f32::MAX");
    for inf in [f32::INFINITY, f32::NEG_INFINITY] {
        assert_eq!(seen(inf), inf);
    }
    let mut nans = vec![f32::NAN, -f32::NAN];
    nans.extend([0x7f80_0001u32, 0x7f80_1000, 0x7fff_e000, 0x7fff_ffff, 0xffff_ffff, 0xffff_f000].map(f32::from_bits));
    nans.extend((0..1000).map(|_| f32::from_bits(rng.next_u64() as u32 | 0x7f80_0001)));
    for nan in nans {
        assert!(nan.is_nan());
        assert!(seen(nan).is_nan(), "NaN {:#x} read as {:e}", nan.to_bits(), seen(nan));
    }
}
