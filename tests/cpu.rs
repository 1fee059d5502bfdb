//! CPU-only tests: what needs no GPU. The random-number generator against published known
//! answers, the chunk kernels' work a thread, and the behaviour without a driver (an error, never
//! a panic). (The embedded PTX is checked against the host's launches by the crate's unit tests.)

use kernels::{DType, Device, Error};
use kernels_gpu::ops::Unary;

/// Known-answer vectors of Philox4x32-10 from the Random123 distribution (kat_vectors).
#[test]
fn philox_known_answers() {
    use kernels_gpu::init::philox4x32_10;
    assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
    assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
    assert_eq!(
        philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
        [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
    );
}

#[test]
fn uniform_and_normal_generators_have_the_right_moments() {
    use kernels_gpu::init::{normal_at, uniform_at};
    let n = 1u64 << 20;
    let (mut s1, mut s2) = (0.0f64, 0.0f64);
    for i in 0..n {
        let u = uniform_at(42, i, -1.0, 3.0) as f64;
        assert!((-1.0..3.0).contains(&u), "uniform value {u} outside [-1, 3)");
        s1 += u;
    }
    assert!((s1 / n as f64 - 1.0).abs() < 5.0 * (16.0f64 / 12.0).sqrt() / (n as f64).sqrt());
    s1 = 0.0;
    for i in 0..n {
        let z = normal_at(7, i, 0.0, 1.0) as f64;
        assert!(z.is_finite());
        s1 += z;
        s2 += z * z;
    }
    let mean = s1 / n as f64;
    let var = s2 / n as f64 - mean * mean;
    assert!(mean.abs() < 5.0 / (n as f64).sqrt(), "mean {mean}");
    assert!((var - 1.0).abs() < 5.0 * (2.0f64).sqrt() / (n as f64).sqrt(), "variance {var}");
}

/// The unary chunk kernels' vectors a thread (`UnaryFn::CHUNK`, which the host sizes their grid
/// with, from the op's form): one vector for the memory-bound ops and forms, 16 elements for
/// pow's general forms, whose math sets the pace. (The kernels assert 1, 2 or 4 when compiled.)
#[test]
fn chunk_kernels_take_one_vector_or_sixteen_elements() {
    let (a, b) = (0.5, 0.25);
    for &op in Unary::ALL.iter().filter(|&&op| op != Unary::Pow) {
        for dt in DType::ALL {
            assert_eq!(op.chunk(op.fwd_form(a, b), dt), 1, "{op:?} {dt:?}");
            assert_eq!(op.chunk(op.bwd_form(a, b), dt), 1, "{op:?} {dt:?}");
        }
    }
    for dt in DType::ALL {
        let general = if dt == DType::F32 { 4 } else { 2 };
        let pow = Unary::Pow;
        for p in [2.5, -0.5, 4.0, f32::INFINITY, 0.0] {
            assert_eq!(pow.chunk(pow.fwd_form(p, 0.0), dt), general, "x^{p} {dt:?}");
        }
        for p in [2.0, 3.0, 1.0, -1.0] {
            assert_eq!(pow.chunk(pow.fwd_form(p, 0.0), dt), 1, "x^{p} {dt:?}");
            assert_eq!(pow.chunk(pow.bwd_form(p + 1.0, 0.0), dt), 1, "x^{} backward {dt:?}", p + 1.0);
        }
    }
}

/// Without a driver (CI) `Device::cuda` is an error with a clear message; with one it works.
#[test]
fn a_missing_gpu_is_an_error_not_a_panic() {
    match Device::cuda(0) {
        Ok(dev) => assert!(!dev.name().is_empty()),
        Err(e @ (Error::NoDriver { .. } | Error::NoDevice { .. })) => {
            let msg = e.to_string();
            assert!(msg.contains("CUDA"), "unclear message: {msg}");
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
    // Asking for a device that cannot exist is an error either way.
    assert!(matches!(Device::cuda(1 << 20), Err(Error::NoDriver { .. } | Error::NoDevice { .. })));
}
