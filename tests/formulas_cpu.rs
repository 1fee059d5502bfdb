//! CPU tests of the kernels' formulas: the very f32 code the GPU runs (`kernels_gpu::ops`, built
//! for the host) against the f64 references of `tests/common/reference.rs`, with the same
//! tolerances as the GPU tests, and the references' derivatives against central finite
//! differences. A wrong formula fails here, in CI, without a GPU.

mod common;

use common::reference as r;
use common::*;
use kernels::DType;
use kernels::ops::BinaryOp;

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
