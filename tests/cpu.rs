//! CPU-only tests: what needs no GPU. The random-number generator against published known
//! answers, the chunk kernels' work a thread, the behaviour without a driver (an error, never
//! a panic), and the bf16/f16 linear layer's error bounds against a CPU emulation of its path. (The embedded PTX is checked against the host's launches by the crate's unit tests.)

use kernels::{DType, Device, Error};
use kernels_gpu::ops::Unary;

#[allow(dead_code)]
#[path = "common/reference.rs"]
mod reference;

#[allow(dead_code)]
#[path = "common/linear_ref.rs"]
mod linear_ref;

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

/// The bounds of the bf16/f16 linear layer (tests/common/linear_ref.rs) admit a CPU emulation of
/// the layer's path (f32 sums of exact products in one order, f32 epilogue, roundings to the
/// dtype where the layer rounds), and reject two wrong computations: the bias gradient summed
/// in the dtype instead of f32 (where dz is exact), and the weight read untransposed. So the GPU tests built on them
/// can fail on a kernel that rounds too often or reads the wrong operand.
#[test]
fn linear_tc_bounds_admit_an_emulation_and_reject_wrong_paths() {
    use kernels::ops::Activation;
    use linear_ref::{Inputs, check, expect};
    use reference::{act_bwd, act_fwd};

    fn round(dt: DType, v: f32) -> f32 {
        match dt {
            DType::BF16 => half::bf16::from_f32(v).to_f32(),
            DType::F16 => half::f16::from_f32(v).to_f32(),
            DType::F32 => v,
        }
    }
    /// `sum_k a(k) b(k)` in f32 FMAs, in order (the products of two bf16 or f16 are exact).
    fn dot(k: usize, a: impl Fn(usize) -> f32, b: impl Fn(usize) -> f32) -> f32 {
        (0..k).fold(0.0f32, |acc, i| a(i).mul_add(b(i), acc))
    }
    let (rows, inp, out) = (512, 48, 48);
    for (di, dt) in [DType::BF16, DType::F16].into_iter().enumerate() {
        for (ai, act) in [Activation::Identity, Activation::Relu, Activation::Gelu].into_iter().enumerate() {
            // A deterministic spread of values (SplitMix64 to [-1, 1)), rounded to the dtype.
            let mut state = (8 * ai + di) as u64;
            let mut draw = |n: usize, scale: f32| -> Vec<f32> {
                (0..n)
                    .map(|_| {
                        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                        let mut z = state;
                        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                        let u = ((z ^ (z >> 31)) >> 11) as f32 / (1u64 << 53) as f32;
                        round(dt, (2.0 * u - 1.0) * scale)
                    })
                    .collect()
            };
            let (x, w, b, dy) = (draw(rows * inp, 2.0), draw(out * inp, 0.3), draw(out, 1.0), draw(rows * out, 1.0));
            let p = Inputs { x: &x, w: &w, b: Some(&b), dy: &dy, rows, inp, out };
            let r = expect(dt, &p, act, rows as u64);
            let what = format!("{dt:?} {act:?}");

            // The layer's path: z in f32 plus the bias, the activation fused (inference) or on
            // the stored z (training with GELU), dz rounded, the products in f32, db in f32.
            let z32: Vec<f32> = (0..rows * out)
                .map(|ro| dot(inp, |i| x[ro / out * inp + i], |i| w[ro % out * inp + i]) + b[ro % out])
                .collect();
            let act32 = |v: f32| act_fwd(act, v as f64) as f32;
            let fused: Vec<f32> = z32.iter().map(|&v| round(dt, act32(v))).collect();
            let zd: Vec<f32> = z32.iter().map(|&v| round(dt, v)).collect();
            let stored: Vec<f32> = zd.iter().map(|&v| round(dt, act32(v))).collect();
            check(&format!("{what} y"), &fused, &r.y_inference).unwrap();
            let y_train = if act == Activation::Gelu { &stored } else { &fused };
            check(&format!("{what} train y"), y_train, &r.y_train).unwrap();
            let dz: Vec<f32> = (0..rows * out)
                .map(|i| match act {
                    Activation::Relu if y_train[i] <= 0.0 => 0.0,
                    Activation::Relu | Activation::Identity => dy[i],
                    _ => round(dt, act_bwd(act, zd[i] as f64, dy[i] as f64) as f32),
                })
                .collect();
            let dx: Vec<f32> = (0..rows * inp)
                .map(|ri| round(dt, dot(out, |o| dz[ri / inp * out + o], |o| w[o * inp + ri % inp])))
                .collect();
            let dw: Vec<f32> = (0..out * inp)
                .map(|oi| round(dt, dot(rows, |r_| dz[r_ * out + oi / inp], |r_| x[r_ * inp + oi % inp])))
                .collect();
            let db: Vec<f32> = (0..out).map(|o| round(dt, (0..rows).map(|r_| dz[r_ * out + o]).sum::<f32>())).collect();
            check(&format!("{what} dx"), &dx, &r.dx).unwrap();
            check(&format!("{what} dW"), &dw, &r.dw).unwrap();
            let rdb = r.db.as_ref().unwrap();
            check(&format!("{what} db"), &db, rdb).unwrap();

            // Wrong: db as a running sum in the dtype (told apart where dz is exact: with GELU
            // the bound carries dz's own roundings, 512 of them, which are as large).
            if act != Activation::Gelu {
                let db_narrow: Vec<f32> =
                    (0..out).map(|o| (0..rows).fold(0.0, |acc, r_| round(dt, acc + dz[r_ * out + o]))).collect();
                assert!(check("db summed in the dtype", &db_narrow, rdb).is_err(), "{what}: db in the dtype passed");
            }
            // Wrong: x @ W instead of x @ W^T (W is square here).
            let untransposed: Vec<f32> = (0..rows * out)
                .map(|ro| {
                    round(dt, act32(dot(inp, |i| x[ro / out * inp + i], |i| w[i * inp + ro % out]) + b[ro % out]))
                })
                .collect();
            assert!(check("x @ W", &untransposed, &r.y_inference).is_err(), "{what}: x @ W passed");
        }
    }
}

#[allow(dead_code)]
#[path = "common/attention_ref.rs"]
mod attention_ref;

/// The attention bound (tests/common/attention_ref.rs) admits an f32 emulation of the kernel's
/// path (blocks of 64 keys, the online softmax in log2 units, four partial row sums a row as the
/// kernel's lanes hold them, P rounded to the dtype before `P V`) and rejects three wrong
/// computations: O not rescaled when the row maximum grows, the scale `1/D` for `1/sqrt(D)`, and
/// a causal mask off by one. So the GPU tests built on it can fail on such a kernel.
#[test]
fn attention_bound_admits_an_emulation_and_rejects_wrong_paths() {
    use attention_ref::{row_ref, scale_of};

    fn round(dt: DType, v: f32) -> f32 {
        match dt {
            DType::BF16 => half::bf16::from_f32(v).to_f32(),
            DType::F16 => half::f16::from_f32(v).to_f32(),
            DType::F32 => v,
        }
    }
    /// One ulp of `dt` at `w` (the comparison's allowance for the output's rounding).
    fn ulp(dt: DType, w: f64) -> f64 {
        let (mant, min_exp) = if dt == DType::BF16 { (7, -126) } else { (10, -14) };
        let e = if w == 0.0 { min_exp } else { (w.abs().log2().floor() as i32).max(min_exp) };
        2f64.powi(e - mant)
    }
    type Key<'a> = (usize, &'a [f32], &'a [f32]);
    /// The kernel's arithmetic for one row over `keys` (index, k, v), in increasing order;
    /// `no_rescale` leaves O unscaled when the maximum grows.
    fn emulate(dt: DType, scale: f32, q: &[f32], keys: &[Key], no_rescale: bool) -> (Vec<f32>, f32) {
        let d = q.len();
        let sl2 = scale * std::f32::consts::LOG2_E;
        let (mut m, mut l, mut o) = (f32::NEG_INFINITY, [0.0f32; 4], vec![0.0f32; d]);
        let mut at = 0;
        while at < keys.len() {
            let block = keys[at].0 / 64;
            let end = at + keys[at..].iter().take_while(|k| k.0 / 64 == block).count();
            let x: Vec<f32> = keys[at..end]
                .iter()
                .map(|(_, k, _)| q.iter().zip(k.iter()).fold(0.0f32, |s, (&a, &b)| s + a * b) * sl2)
                .collect();
            let m_new = x.iter().fold(m, |a, &b| a.max(b));
            let base = if m_new == f32::NEG_INFINITY { 0.0 } else { m_new };
            let alpha = (m - base).exp2();
            m = m_new;
            if !no_rescale {
                o.iter_mut().for_each(|v| *v *= alpha);
            }
            let mut part = [0.0f32; 4];
            for (n, key) in keys[at..end].iter().enumerate() {
                let p = (x[n] - base).exp2();
                // Lane t of a row holds keys 8J + 2t and 8J + 2t + 1 of the block.
                part[key.0 % 8 / 2] += p;
                let pr = round(dt, p);
                for (oc, &vc) in o.iter_mut().zip(key.2) {
                    *oc = pr.mul_add(vc, *oc);
                }
            }
            for t in 0..4 {
                l[t] = l[t] * alpha + part[t];
            }
            at = end;
        }
        let lt = (l[0] + l[1]) + (l[2] + l[3]);
        let out = o.iter().map(|&v| round(dt, v / lt)).collect();
        let base = if m == f32::NEG_INFINITY { 0.0 } else { m };
        (out, base * std::f32::consts::LN_2 + lt.ln())
    }

    let sk = 300;
    for (di, dt) in [DType::BF16, DType::F16].into_iter().enumerate() {
        for (si, (d, scale)) in [(64usize, None), (128, Some(0.5f32))].into_iter().enumerate() {
            let mut state = (4 * di + si) as u64;
            let mut draw = |n: usize| -> Vec<f32> {
                (0..n)
                    .map(|_| {
                        // Two uniforms (SplitMix64) to a normal, rounded to the dtype.
                        let mut u = [0.0f64; 2];
                        for x in &mut u {
                            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                            let mut z = state;
                            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                            *x = ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64;
                        }
                        let g = (-2.0 * (1.0 - u[0]).ln()).sqrt() * (std::f64::consts::TAU * u[1]).cos();
                        round(dt, g as f32)
                    })
                    .collect()
            };
            let (q, k, v) = (draw(sk * d), draw(sk * d), draw(sk * d));
            let row = |x: &[f32], i: usize| x[i * d..(i + 1) * d].to_vec();
            let sc = scale_of(scale, d);
            // Causal rows: query i sees keys 0..=i (`extra`: one more, the off-by-one mask).
            let passes = |i: usize, sc_used: f32, extra: usize, no_rescale: bool| -> bool {
                let (ks, vs): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
                    (0..(i + 1 + extra).min(sk)).map(|j| (row(&k, j), row(&v, j))).unzip();
                let keys: Vec<Key> = (0..ks.len()).map(|j| (j, &ks[j][..], &vs[j][..])).collect();
                let exact_keys: Vec<(&[f32], &[f32])> = (0..=i).map(|j| (&ks[j][..], &vs[j][..])).collect();
                let r = row_ref(dt, sc, &row(&q, i), &exact_keys, sk);
                let (o, lse) = emulate(dt, sc_used, &row(&q, i), &keys, no_rescale);
                let o_ok = (0..d).all(|c| ((o[c] as f64) - r.o[c]).abs() <= r.o_tol[c] + ulp(dt, r.o[c]));
                let lse_ok = ((lse as f64) - r.lse).abs() <= r.lse_tol + 2f64.powi(-23) * r.lse.abs();
                o_ok && lse_ok
            };
            let rows: Vec<usize> = (0..sk).step_by(13).collect();
            for &i in &rows {
                assert!(passes(i, sc, 0, false), "{dt:?} D {d}: the emulation of row {i} fails its bound");
            }
            let what = format!("{dt:?} D {d}");
            assert!(!rows.iter().all(|&i| passes(i, sc, 0, true)), "{what}: O without rescaling passed");
            assert!(!rows.iter().all(|&i| passes(i, 1.0 / d as f32, 0, false)), "{what}: scale 1/D passed");
            assert!(!rows.iter().all(|&i| passes(i, sc, 1, false)), "{what}: the mask off by one passed");
        }
    }
}
