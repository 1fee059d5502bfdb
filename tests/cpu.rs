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

/// NCCL is loaded at run time: without it (this machine), making an id, a group or asking the
/// version is `Error::NoNccl` saying what was tried and how to point the library at one.
#[test]
fn a_missing_nccl_is_an_error_not_a_panic() {
    use kernels::dist;
    match dist::UniqueId::new() {
        Err(Error::NoNccl { detail }) => {
            assert!(detail.contains("KERNELS_NCCL_LIB") && detail.contains("libnccl"), "unclear: {detail}");
            assert!(matches!(dist::nccl_version(), Err(Error::NoNccl { .. })));
            assert!(matches!(dist::group(|| Ok(())), Err(Error::NoNccl { .. })));
        }
        // A machine with NCCL: the id is made by it, and the version is 2.10 or newer.
        Ok(id) => {
            assert_eq!(dist::UniqueId::from_hex(&id.to_hex()).unwrap(), id);
            assert!(dist::nccl_version().unwrap().0 >= 21000);
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
}

/// The out-of-memory message says what was asked for, what tensors hold, what the cache held and
/// what the device had; an error without sizes (the driver's, outside an allocation) says less.
#[test]
fn out_of_memory_says_what_was_asked_allocated_and_cached() {
    let e = Error::OutOfMemory {
        op: "Tensor::empty",
        bytes: 3 << 30,
        allocated: 1 << 20,
        cached: 3 << 19,
        device_free: 512 << 20,
        device_total: 80 << 30,
    };
    assert_eq!(
        e.to_string(),
        "Tensor::empty: out of device memory allocating 3072.00 MiB (3221225472 bytes); tensors hold \
         1.00 MiB, the cache 1.50 MiB; the device has 512.00 MiB free of 81920.00 MiB"
    );
    let e = Error::OutOfMemory { op: "softmax", bytes: 0, allocated: 0, cached: 0, device_free: 0, device_total: 0 };
    assert_eq!(e.to_string(), "softmax: out of device memory");
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

#[allow(dead_code)]
#[path = "common/attention_bwd_ref.rs"]
mod attention_bwd_ref;

/// Rounds to the dtype (to nearest even).
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

/// Standard normal values from SplitMix64 (two uniforms each), rounded to a dtype.
struct Normals(u64);
impl Normals {
    fn draw(&mut self, n: usize, dt: DType) -> Vec<f32> {
        (0..n).map(|_| round(dt, self.next() as f32)).collect()
    }
    fn next(&mut self) -> f64 {
        let mut u = [0.0f64; 2];
        for x in &mut u {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            *x = ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64;
        }
        (-2.0 * (1.0 - u[0]).ln()).sqrt() * (std::f64::consts::TAU * u[1]).cos()
    }
}

/// A key of a row: its index, k and v.
type Key<'a> = (usize, &'a [f32], &'a [f32]);

/// The attention forward kernel's arithmetic for one row over `keys` (index, k, v), in increasing
/// order: blocks of 64 keys, the online softmax in log2 units, four partial row sums a row as the
/// kernel's lanes hold them, P rounded to the dtype before `P V`; `no_rescale` leaves O unscaled
/// when the maximum grows. Returns the stored output and the lse; a row with no key gets zeros
/// and `-inf`, as the kernel's.
fn emulate_fwd(dt: DType, scale: f32, q: &[f32], keys: &[Key], no_rescale: bool) -> (Vec<f32>, f32) {
    let d = q.len();
    if keys.is_empty() {
        return (vec![0.0; d], f32::NEG_INFINITY);
    }
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

/// The attention bound (tests/common/attention_ref.rs) admits an f32 emulation of the kernel's
/// path ([`emulate_fwd`]) and rejects three wrong computations: O not rescaled when the row
/// maximum grows, the scale `1/D` for `1/sqrt(D)`, and a causal mask off by one. So the GPU
/// tests built on it can fail on such a kernel.
#[test]
fn attention_bound_admits_an_emulation_and_rejects_wrong_paths() {
    use attention_ref::{row_ref, scale_of};

    let sk = 300;
    for (di, dt) in [DType::BF16, DType::F16].into_iter().enumerate() {
        for (si, (d, scale)) in [(64usize, None), (128, Some(0.5f32))].into_iter().enumerate() {
            let mut normals = Normals((4 * di + si) as u64);
            let (q, k, v) = (normals.draw(sk * d, dt), normals.draw(sk * d, dt), normals.draw(sk * d, dt));
            let row = |x: &[f32], i: usize| x[i * d..(i + 1) * d].to_vec();
            let sc = scale_of(scale, d);
            // Causal rows: query i sees keys 0..=i (`extra`: one more, the off-by-one mask).
            let passes = |i: usize, sc_used: f32, extra: usize, no_rescale: bool| -> bool {
                let (ks, vs): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
                    (0..(i + 1 + extra).min(sk)).map(|j| (row(&k, j), row(&v, j))).unzip();
                let keys: Vec<Key> = (0..ks.len()).map(|j| (j, &ks[j][..], &vs[j][..])).collect();
                let exact_keys: Vec<(&[f32], &[f32])> = (0..=i).map(|j| (&ks[j][..], &vs[j][..])).collect();
                let r = row_ref(dt, sc, &row(&q, i), &exact_keys, sk);
                let (o, lse) = emulate_fwd(dt, sc_used, &row(&q, i), &keys, no_rescale);
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

/// An attention problem for the backward's CPU tests: `group` query heads over one key/value
/// head, each tensor row-major (`[group][seq_q][d]`, `[seq_k][d]`), the mask as key ranges.
struct AttnProblem {
    group: usize,
    seq_q: usize,
    seq_k: usize,
    d: usize,
    scale: f32,
    keys: Vec<(usize, usize)>,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    dout: Vec<f64>,
}

impl AttnProblem {
    /// Random values of `dt` (normal); `sees(i, j)` the mask.
    #[allow(clippy::too_many_arguments)]
    fn new(
        seed: u64,
        dt: DType,
        group: usize,
        seq_q: usize,
        seq_k: usize,
        d: usize,
        scale: Option<f32>,
        sees: impl Fn(usize, usize) -> bool,
    ) -> AttnProblem {
        let mut n = Normals(seed);
        let mut draw = |len: usize| n.draw(len, dt).into_iter().map(f64::from).collect::<Vec<f64>>();
        let (q, k, v, dout) = (draw(group * seq_q * d), draw(seq_k * d), draw(seq_k * d), draw(group * seq_q * d));
        let keys = attention_bwd_ref::key_ranges(seq_q, seq_k, sees);
        let scale = attention_ref::scale_of(scale, d);
        AttnProblem { group, seq_q, seq_k, d, scale, keys, q, k, v, dout }
    }

    fn problem(&self) -> attention_bwd_ref::Problem<'_> {
        attention_bwd_ref::Problem {
            group: self.group,
            seq_q: self.seq_q,
            seq_k: self.seq_k,
            d: self.d,
            scale: self.scale as f64,
            keys: &self.keys,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            dout: &self.dout,
        }
    }

    fn seen(&self, r: usize) -> std::ops::Range<usize> {
        let (a, b) = self.keys[r % self.seq_q];
        a..b.max(a)
    }
}

/// The f64 reference gradients of the attention backward (tests/common/attention_bwd_ref.rs)
/// against central differences of the f64 forward's loss `sum dout . o`, on tiny problems: no
/// mask, both causal masks (GQA; with Sq > Sk rows that see no key), a window, a negative
/// scale.
///
/// Tolerance: a central difference of step `h` errs by `h^2 / 6 |L'''|` at some point of the
/// step, plus the f64 evaluation errors of the two losses over `2 h`. Along one input, the loss
/// is a sum over rows of `E_pi[w]`, `w_j = dout . v_j`, under weights `pi_j` proportional to
/// `exp(b_j t)` (`b_j = c k_jd` for `q_d`, `c q_d` at key `j` alone for `k_jd`); its third
/// derivative is the cumulant `E[W B^3] - 3 Cov(W, B) Var(B)` of the centred `W`, `B`, at most `4
/// R_w R_b^3` with `R` their ranges over the row's keys. The loss is linear in v: no
/// truncation. Each f64 loss is off by at most `2^-53 (2 D + 2 Sk + 8)` of `sum |dout| (sum p
/// |v| + |o|) (1 + |c| max S + |lse|)` (the score sums, the exponent, the weight and output sums,
/// the final dot product), counted twice for the two perturbed points.
#[test]
fn attention_backward_reference_matches_finite_differences() {
    use attention_bwd_ref::{FwdErr, Problem, backward, forward, loss};
    type Sees = fn(usize, usize, usize, usize) -> bool;
    let none: Sees = |_, _, _, _| true;
    let top_left: Sees = |i, j, _, _| j <= i;
    let bottom_right: Sees = |i, j, sq, sk| j + sq <= i + sk;
    // Window (1, 1) about the bottom-right diagonal.
    let window: Sees = |i, j, sq, sk| j + sq + 1 >= i + sk && j + sq <= i + sk + 1;
    let cases: [(usize, usize, usize, Option<f32>, Sees); 5] = [
        (1, 3, 5, None, none),
        (2, 3, 5, None, top_left),
        (2, 5, 3, None, bottom_right),
        (1, 4, 6, Some(-0.7), window),
        (3, 4, 4, Some(0.9), bottom_right),
    ];
    let h = 2f64.powi(-13);
    for (n, &(group, sq, sk, scale, sees)) in cases.iter().enumerate() {
        let d = 8;
        let pr = AttnProblem::new(90 + n as u64, DType::F16, group, sq, sk, d, scale, |i, j| sees(i, j, sq, sk));
        let p = pr.problem();
        let f = forward(&p);
        let g = backward(DType::F16, &p, &f, &FwdErr::exact(&p, &f));
        let c = pr.scale as f64;
        let rows = group * sq;
        // The ranges over each row's keys of w_j = dout . v_j and of each k_jd.
        let dotf = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
        let range = |it: &mut dyn Iterator<Item = f64>| {
            let (lo, hi) = it.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)));
            if lo > hi { 0.0 } else { hi - lo }
        };
        let rw: Vec<f64> = (0..rows)
            .map(|r| range(&mut pr.seen(r).map(|j| dotf(&pr.dout[r * d..(r + 1) * d], &pr.v[j * d..(j + 1) * d]))))
            .collect();
        // The f64 evaluation error of one loss.
        let eval_err = 2f64.powi(-53) * (2 * d + 2 * sk + 8) as f64 * {
            (0..rows)
                .map(|r| {
                    let (qr, lse) = (&pr.q[r * d..(r + 1) * d], f.lse[r]);
                    if lse == f64::NEG_INFINITY {
                        return 0.0;
                    }
                    let smax = pr.seen(r).map(|j| dotf_abs(qr, &pr.k[j * d..(j + 1) * d])).fold(0.0, f64::max);
                    let mag: f64 = (0..d)
                        .map(|x| {
                            let pv: f64 = pr
                                .seen(r)
                                .map(|j| (c * dotf(qr, &pr.k[j * d..(j + 1) * d]) - lse).exp() * pr.v[j * d + x].abs())
                                .sum();
                            pr.dout[r * d + x].abs() * (pv + f.o[r * d + x].abs())
                        })
                        .sum();
                    mag * (1.0 + c.abs() * smax + lse.abs())
                })
                .sum::<f64>()
        };
        let tol = |m3: f64| h * h / 6.0 * m3 + 2.0 * eval_err / (2.0 * h);

        // Which tensor, and the third-derivative bound of each of its elements.
        let m3_q = |r: usize, x: usize| {
            let rb = c.abs() * range(&mut pr.seen(r).map(|j| pr.k[j * d + x]));
            4.0 * rw[r] * rb.powi(3)
        };
        let m3_k = |j: usize, x: usize| {
            (0..rows)
                .filter(|&r| pr.seen(r).contains(&j))
                .map(|r| 4.0 * rw[r] * (c * pr.q[r * d + x]).abs().powi(3))
                .sum()
        };
        let mut worst = 0.0f64;
        for which in 0..3 {
            let len = [rows * d, sk * d, sk * d][which];
            for at in 0..len {
                let eval = |delta: f64| {
                    let mut q = pr.q.clone();
                    let mut k = pr.k.clone();
                    let mut v = pr.v.clone();
                    [&mut q, &mut k, &mut v][which][at] += delta;
                    let p2 = Problem { q: &q, k: &k, v: &v, ..p };
                    loss(&p2, &forward(&p2))
                };
                let fd = (eval(h) - eval(-h)) / (2.0 * h);
                let (want, m3) = match which {
                    0 => (g.dq[at], m3_q(at / d, at % d)),
                    1 => (g.dk[at], m3_k(at / d, at % d)),
                    _ => (g.dv[at], 0.0),
                };
                let t = tol(m3);
                assert!(
                    (fd - want).abs() <= t,
                    "case {n}: {}[{at}] = {want:e}, finite difference {fd:e} (tolerance {t:e})",
                    ["dq", "dk", "dv"][which]
                );
                worst = worst.max(t);
                // The check can fail: dk without the scale is rejected.
                if which == 1 && want.abs() > 1e-3 {
                    assert!((fd - want / c).abs() > t, "case {n}: dk without the scale passed");
                }
            }
        }
        assert!(worst < 1e-5, "case {n}: the finite differences' tolerance {worst:e} says too little");
        // Rows that see no key and keys no row sees: zero gradients.
        for r in (0..rows).filter(|&r| pr.seen(r).is_empty()) {
            assert!(g.dq[r * d..(r + 1) * d].iter().all(|&x| x == 0.0) && !g.row_sees[r % sq], "case {n}: row {r}");
        }
        for j in (0..sk).filter(|&j| !(0..rows).any(|r| pr.seen(r).contains(&j))) {
            let zero = g.dk[j * d..(j + 1) * d].iter().chain(&g.dv[j * d..(j + 1) * d]).all(|&x| x == 0.0);
            assert!(zero && !g.key_seen[j], "case {n}: key {j}");
        }
    }
}

/// `sum |a_d b_d|`.
fn dotf_abs(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum()
}

/// A computation of the attention backward: the kernels' path, or a wrong one its bound must
/// reject.
#[derive(Clone, Copy, Debug, PartialEq)]
enum BwdPath {
    Kernel,
    /// dK not multiplied by the scale.
    DkWithoutScale,
    /// `delta` of the next row of the head.
    DeltaOfNextRow,
    /// Each row sees one more key (a causal mask off by one).
    MaskOffByOne,
    /// dK and dV from the first head of the group only (GQA not summed).
    FirstHeadOnly,
    /// `P = 2^(S sl2 - lse)`: the lse left in natural units.
    LseNotInLog2,
}

/// The backward kernels' arithmetic in f32 (tests/common/attention_bwd_ref.rs, steps 1 to 7)
/// given the forward's stored output `o` and `lse` (row-major, as `pr.q`), along `path`:
/// `delta` by 32 lanes of fma and a shuffle tree; `P = ex2(fl(S sl2) - fl(lse log2e))` flushed
/// below 2^-126; `dS = P (dP - delta)`; P and dS rounded to the dtype; each gradient an f32 sum
/// (in order: more accurate than the tensor cores' truncating steps, which the bound covers),
/// times the scale, rounded to the dtype. Returns `(dq, dk, dv)`.
fn emulate_bwd(dt: DType, pr: &AttnProblem, o: &[f32], lse: &[f32], path: BwdPath) -> [Vec<f32>; 3] {
    let (group, sq, sk, d) = (pr.group, pr.seq_q, pr.seq_k, pr.d);
    let rows = group * sq;
    let row = |x: &[f64], r: usize| -> Vec<f32> { x[r * d..(r + 1) * d].iter().map(|&v| v as f32).collect() };
    let (q, dout) =
        ((0..rows).map(|r| row(&pr.q, r)).collect::<Vec<_>>(), (0..rows).map(|r| row(&pr.dout, r)).collect::<Vec<_>>());
    let (k, v) =
        ((0..sk).map(|j| row(&pr.k, j)).collect::<Vec<_>>(), (0..sk).map(|j| row(&pr.v, j)).collect::<Vec<_>>());
    let delta: Vec<f32> = (0..rows)
        .map(|r| {
            let mut lanes = [0.0f32; 32];
            for (l, lane) in lanes.iter_mut().enumerate() {
                for x in 8 * l..(8 * l + 8).min(d) {
                    *lane = dout[r][x].mul_add(o[r * d + x], *lane);
                }
            }
            for off in [16, 8, 4, 2, 1] {
                let prev = lanes;
                for (l, lane) in lanes.iter_mut().enumerate() {
                    *lane = prev[l] + prev[l ^ off];
                }
            }
            lanes[0]
        })
        .collect();
    let l2e = std::f32::consts::LOG2_E;
    let lse2: Vec<f32> = lse
        .iter()
        .map(|&l| match l {
            f32::NEG_INFINITY => f32::INFINITY,
            _ if path == BwdPath::LseNotInLog2 => l,
            _ => l * l2e,
        })
        .collect();
    let sl2 = pr.scale * l2e;
    let seen = |r: usize| {
        let (a, b) = pr.keys[r % sq];
        let b = if path == BwdPath::MaskOffByOne && b > a { (b + 1).min(sk) } else { b };
        a..b.max(a)
    };
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0.0f32, |s, (&x, &y)| x.mul_add(y, s));
    let pair = |r: usize, j: usize| -> (f32, f32) {
        let p = (dot(&q[r], &k[j]) * sl2 - lse2[r]).exp2();
        let p = if p < f32::MIN_POSITIVE { 0.0 } else { p };
        let dr = if path == BwdPath::DeltaOfNextRow { r / sq * sq + (r % sq + 1) % sq } else { r };
        (p, p * (dot(&dout[r], &v[j]) - delta[dr]))
    };
    let mut dq = vec![0.0f32; rows * d];
    for r in 0..rows {
        let mut acc = vec![0.0f32; d];
        for j in seen(r) {
            let ds = round(dt, pair(r, j).1);
            acc.iter_mut().zip(&k[j]).for_each(|(a, &kx)| *a = ds.mul_add(kx, *a));
        }
        for x in 0..d {
            dq[r * d + x] = round(dt, pr.scale * acc[x]);
        }
    }
    let (mut dk, mut dv) = (vec![0.0f32; sk * d], vec![0.0f32; sk * d]);
    let heads = if path == BwdPath::FirstHeadOnly { sq } else { rows };
    for j in 0..sk {
        let (mut ak, mut av) = (vec![0.0f32; d], vec![0.0f32; d]);
        for r in (0..heads).filter(|&r| seen(r).contains(&j)) {
            let (p, ds) = pair(r, j);
            let (p, ds) = (round(dt, p), round(dt, ds));
            for x in 0..d {
                ak[x] = ds.mul_add(q[r][x], ak[x]);
                av[x] = p.mul_add(dout[r][x], av[x]);
            }
        }
        let c = if path == BwdPath::DkWithoutScale { 1.0 } else { pr.scale };
        for x in 0..d {
            dk[j * d + x] = round(dt, c * ak[x]);
            dv[j * d + x] = round(dt, av[x]);
        }
    }
    [dq, dk, dv]
}

/// Whether gradients pass the bound `g` as the GPU tests' comparison has it (the bound, one ulp
/// of the dtype, the smallest normal f32; exact zeros where no pair is seen); the number of
/// elements that fail, by gradient.
fn bwd_failures(dt: DType, g: &attention_bwd_ref::Grads, got: &[Vec<f32>; 3], d: usize, sq: usize) -> [usize; 3] {
    let want = [(&g.dq, &g.dq_tol), (&g.dk, &g.dk_tol), (&g.dv, &g.dv_tol)];
    let mut bad = [0; 3];
    for (w, ((want, tol), got)) in want.into_iter().zip(got).enumerate() {
        for (i, &x) in got.iter().enumerate() {
            let zero = if w == 0 { !g.row_sees[i / d % sq] } else { !g.key_seen[i / d] };
            let ok = if zero {
                x == 0.0
            } else {
                ((x as f64) - want[i]).abs() <= tol[i] + ulp(dt, want[i]) + f32::MIN_POSITIVE as f64
            };
            bad[w] += usize::from(!ok);
        }
    }
    bad
}

/// The attention backward's bound (tests/common/attention_bwd_ref.rs) admits the f32 emulation
/// of the kernels' path ([`emulate_bwd`]) on the forward's emulated output ([`emulate_fwd`], the
/// bound given its measured error, as the GPU tests have it) and on a forward output at the edge
/// of the forward's own bound (the bound given that bound), and rejects wrong computations: dK
/// without the scale, `delta` of the next row, a causal mask off by one, GQA's heads not summed,
/// the lse not converted to log2 units. Shapes: causal GQA, a window with rows that see no key
/// and a negative scale, MQA with Sq < Sk (keys no row sees: exact zeros).
#[test]
fn attention_backward_bound_admits_an_emulation_and_rejects_wrong_paths() {
    use BwdPath::*;
    use attention_bwd_ref::{FwdErr, backward, forward};
    use attention_ref::row_ref;
    type Sees = fn(usize, usize) -> bool;
    let top_left: Sees = |i, j| j <= i;
    // Bottom right (Sk - Sq = -60), window (10, 0).
    let window: Sees = |i, j| j + 60 <= i && i <= j + 70;
    // (group, Sq, Sk, D, scale, mask, the wrong paths that apply).
    type Config = (usize, usize, usize, usize, Option<f32>, Sees, &'static [BwdPath]);
    let configs: [Config; 3] = [
        (2, 150, 150, 64, None, top_left, &[DkWithoutScale, DeltaOfNextRow, MaskOffByOne, FirstHeadOnly, LseNotInLog2]),
        (1, 120, 60, 32, Some(-0.4), window, &[DkWithoutScale, DeltaOfNextRow, MaskOffByOne, LseNotInLog2]),
        (4, 40, 100, 128, Some(0.3), top_left, &[DkWithoutScale, DeltaOfNextRow, FirstHeadOnly, LseNotInLog2]),
    ];
    for (di, dt) in [DType::BF16, DType::F16].into_iter().enumerate() {
        for (ci, &(group, sq, sk, d, scale, sees, wrong)) in configs.iter().enumerate() {
            let what = format!("{dt:?} group {group} Sq {sq} Sk {sk} D {d}");
            let pr = AttnProblem::new((10 * ci + di) as u64, dt, group, sq, sk, d, scale, sees);
            let p = pr.problem();
            let f = forward(&p);
            let rows = group * sq;
            let f32_row =
                |x: &[f64], r: usize| -> Vec<f32> { x[r * d..(r + 1) * d].iter().map(|&v| v as f32).collect() };
            let (k32, v32): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
                (0..sk).map(|j| (f32_row(&pr.k, j), f32_row(&pr.v, j))).unzip();

            // The forward as its kernel computes it, and the bound given its measured error.
            let (mut o_emu, mut lse_emu) = (Vec::new(), Vec::new());
            for r in 0..rows {
                let keys: Vec<Key> = pr.seen(r).map(|j| (j, &k32[j][..], &v32[j][..])).collect();
                let (o, lse) = emulate_fwd(dt, pr.scale, &f32_row(&pr.q, r), &keys, false);
                o_emu.extend(o);
                lse_emu.push(lse);
            }
            let to64 = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
            let g = backward(dt, &p, &f, &FwdErr::measured(&p, &f, &to64(&o_emu), &to64(&lse_emu)));
            let got = emulate_bwd(dt, &pr, &o_emu, &lse_emu, Kernel);
            assert_eq!(bwd_failures(dt, &g, &got, d, sq), [0; 3], "{what}: the emulation fails its bound");

            // A forward output at the edge of the forward's bound: each O off by its bound (or
            // half of it where the rounding to the dtype would go past), its sign pushing delta
            // one way in even rows and the other in odd ones; lse off by its bound.
            let (mut o_tol, mut lse_tol, mut o_edge, mut lse_edge) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for r in 0..rows {
                let keys: Vec<(&[f32], &[f32])> = pr.seen(r).map(|j| (&k32[j][..], &v32[j][..])).collect();
                let rr = row_ref(dt, pr.scale, &f32_row(&pr.q, r), &keys, sk);
                let flip = if r % 2 == 0 { 1.0 } else { -1.0 };
                for x in 0..d {
                    let (o, t) = (f.o[r * d + x], rr.o_tol[x]);
                    let s = flip * pr.dout[r * d + x].signum();
                    let mut e = round(dt, (o + s * t) as f32);
                    if ((e as f64) - o).abs() > t + ulp(dt, o) {
                        e = round(dt, (o + s * t / 2.0) as f32);
                    }
                    assert!(((e as f64) - o).abs() <= t + ulp(dt, o), "{what}: O at the edge");
                    o_edge.push(e);
                }
                o_tol.extend(rr.o_tol);
                lse_tol.push(rr.lse_tol);
                lse_edge.push((f.lse[r] + flip * rr.lse_tol) as f32);
            }
            let gb = backward(dt, &p, &f, &FwdErr::bounded(dt, &p, &f, &o_tol, &lse_tol));
            let edge = emulate_bwd(dt, &pr, &o_edge, &lse_edge, Kernel);
            assert_eq!(bwd_failures(dt, &gb, &edge, d, sq), [0; 3], "{what}: the forward's edge fails the bound");
            assert_eq!(bwd_failures(dt, &gb, &got, d, sq), [0; 3], "{what}: the emulation fails the forward's bound");

            for &path in wrong {
                let bad = bwd_failures(dt, &g, &emulate_bwd(dt, &pr, &o_emu, &lse_emu, path), d, sq);
                let loose = bwd_failures(dt, &gb, &emulate_bwd(dt, &pr, &o_emu, &lse_emu, path), d, sq);
                assert!(bad.iter().sum::<usize>() > 0, "{what}: {path:?} passed");
                assert!(loose.iter().sum::<usize>() > 0, "{what}: {path:?} passed the forward's bound");
            }
        }
    }
}

#[allow(dead_code)]
#[path = "common/rope_ref.rs"]
mod rope_ref;

/// Deterministic inputs in [-4, 4) for the RoPE tests (an LCG: no GPU harness here).
fn rope_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        })
        .collect()
}

/// LLaMA's tables for `max_pos` positions and rotary dimension `rot`, as `ops::rope_tables`.
fn rope_test_tables(max_pos: usize, rot: usize) -> (Vec<f32>, Vec<f32>) {
    let mut c = Vec::new();
    let mut s = Vec::new();
    for p in 0..max_pos {
        for i in 0..rot / 2 {
            let a = p as f64 * 10000f64.powf(-2.0 * i as f64 / rot as f64);
            c.push(a.cos() as f32);
            s.push(a.sin() as f32);
        }
    }
    (c, s)
}

/// The backward reference (the rotation by the opposite angle) is the gradient of the forward:
/// `d <g, rope(x)> / dx` by central differences of the f64 forward, every coordinate, both
/// layouts and conventions, a partial rotary dimension and an offset.
#[test]
fn rope_backward_reference_matches_finite_differences() {
    use kernels::ops::{Layout, RopeOpts, RopeStyle};
    let shape = [2, 3, 2, 8];
    let n: usize = shape.iter().product();
    let (cos, sin) = rope_test_tables(9, 8);
    let (c6, s6) = rope_test_tables(9, 6);
    for layout in [Layout::Bhsd, Layout::Bshd] {
        for style in [RopeStyle::Half, RopeStyle::Interleaved] {
            for (rotary_dim, cos, sin) in [(None, &cos, &sin), (Some(6), &c6, &s6)] {
                let opts = RopeOpts { layout, style, offset: 4, rotary_dim };
                let x: Vec<f64> = rope_values(n, 1).into_iter().map(f64::from).collect();
                let g = rope_values(n, 2);
                let f = |x: &[f64]| -> f64 {
                    let y = rope_ref::rope_f64(x, shape, &opts, cos, sin, 1.0);
                    y.iter().zip(&g).map(|(&y, &g)| y * g as f64).sum()
                };
                let (grad, _) = rope_ref::rope_ref(&g, shape, &opts, cos, sin, -1.0);
                for i in 0..n {
                    let h = 1e-3;
                    let (mut a, mut b) = (x.clone(), x.clone());
                    a[i] += h;
                    b[i] -= h;
                    let numeric = (f(&a) - f(&b)) / (2.0 * h);
                    assert!(
                        (grad[i] - numeric).abs() <= 1e-9 * (1.0 + grad[i].abs()),
                        "{opts:?}: d/dx[{i}] reference {} vs finite differences {numeric}",
                        grad[i]
                    );
                }
            }
        }
    }
}

/// The bound of `rope_ref::tol` admits the kernel's f32 formula (`kernels_gpu::rope::rotate`) at
/// every element, and rejects the rotation by a neighbouring position's angle (an offset off by
/// one) and the opposite angle (forward for backward).
#[test]
fn rope_bound_admits_the_kernel_formula_and_rejects_wrong_angles() {
    use kernels::ops::{Layout, RopeOpts, RopeStyle};
    let shape = [1, 64, 4, 128];
    let n: usize = shape.iter().product();
    let (cos, sin) = rope_test_tables(80, 128);
    let x = rope_values(n, 3);
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        let opts = RopeOpts { layout: Layout::Bshd, style, offset: 10, rotary_dim: None };
        let (want, inputs) = rope_ref::rope_ref(&x, shape, &opts, &cos, &sin, 1.0);
        let err = |got: &[f64]| -> usize {
            (0..n).filter(|&i| (got[i] - want[i]).abs() > rope_ref::tol(inputs[i]).atol).count()
        };
        let kernel: Vec<f64> = inputs.iter().map(|p| p.expect("all rotated").f32() as f64).collect();
        assert_eq!(err(&kernel), 0, "{style:?}: the kernel's formula exceeds the bound");
        let shifted = RopeOpts { offset: 11, ..opts };
        let (wrong, _) = rope_ref::rope_ref(&x, shape, &shifted, &cos, &sin, 1.0);
        // Pair 0's angle at position p is p radians: one position more is a different rotation
        // for every element but the slowest pairs' (angles below an f32 ulp's effect).
        assert!(err(&wrong) > n / 2, "{style:?}: an offset off by one passes the bound");
        let (back, _) = rope_ref::rope_ref(&x, shape, &opts, &cos, &sin, -1.0);
        assert!(err(&back) > n / 2, "{style:?}: the opposite angle passes the bound");
    }
}
