//! GPU tests of the transpose family (`ops::transpose`, `ops::transpose_out`,
//! `Tensor::transpose`) in f32, f16 and bf16: random shapes (edges around the tile sizes 32, 64
//! and 128 and the vector widths 4 and 8, primes, batches over one or two leading dimensions)
//! and fixed large ones, both kernel paths (whole-vector and scalar), grids whose `grid.y` cap
//! makes blocks loop, and more than 2^31 elements. Inputs are random bit patterns, including
//! NaNs with payloads (quiet and signalling, both signs), infinities, denormals and -0.0; a
//! transpose moves bits, so results are compared bit for bit. Outputs start as NaN (poisoned
//! allocations, NaN-filled `out` tensors) and the inputs never hold those patterns, so an
//! element the kernel fails to write cannot pass.

mod common;

use common::*;
use half::{bf16, f16};
use kernels::ops;
use kernels::{DType, Device, Error, Tensor};
use proptest::prelude::*;
use std::process::ExitCode;

/// Bits of a poisoned allocation (`KERNELS_POISON_ALLOC=1` fills new memory with 0xFF bytes).
fn poison(dt: DType) -> u32 {
    if dt == DType::F32 { u32::MAX } else { 0xffff }
}

/// NaNs with payloads (quiet, signalling, both signs), infinities, the smallest and largest
/// denormals, signed zeros, one and the largest finite value.
fn specials(dt: DType) -> &'static [u32] {
    match dt {
        DType::F32 => &[
            0x7fc0_0000,
            0xffc0_0000,
            0x7fc0_1234,
            0x7f80_0001,
            0xffbf_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x0000_0001,
            0x8000_0001,
            0x007f_ffff,
            0x8000_0000,
            0x0000_0000,
            0x3f80_0000,
            0x7f7f_ffff,
        ],
        DType::F16 => &[
            0x7e00, 0xfe00, 0x7e5a, 0x7c01, 0xfdff, 0x7c00, 0xfc00, 0x0001, 0x8001, 0x03ff, 0x8000, 0x0000, 0x3c00,
            0x7bff,
        ],
        DType::BF16 => &[
            0x7fc0, 0xffc0, 0x7fc5, 0x7f81, 0xffbf, 0x7f80, 0xff80, 0x0001, 0x8001, 0x007f, 0x8000, 0x0000, 0x3f80,
            0x7f7f,
        ],
    }
}

/// `n` random bit patterns of `dt` (in the low bits of a u32): a quarter specials, the rest
/// uniform over all patterns (which includes NaNs with random payloads). Never the poison
/// pattern nor any of `avoid` (the fill of a NaN `out` tensor).
fn random_bits(rng: &mut TestRng, n: usize, dt: DType, avoid: &[u32]) -> Vec<u32> {
    let mask = if dt == DType::F32 { u32::MAX } else { 0xffff };
    let sp = specials(dt);
    (0..n)
        .map(|_| {
            let mut b = if rng.below(4) == 0 { sp[rng.below(sp.len())] } else { rng.next_u64() as u32 & mask };
            while b == poison(dt) || avoid.contains(&b) {
                b ^= 1;
            }
            b
        })
        .collect()
}

/// A tensor holding exactly `bits` (no conversion on the way).
fn upload(dev: &Device, bits: &[u32], shape: &[usize], dt: DType) -> Result<Tensor, String> {
    match dt {
        DType::F32 => Tensor::from_slice(dev, &bits.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>(), shape),
        DType::F16 => {
            Tensor::from_slice(dev, &bits.iter().map(|&b| f16::from_bits(b as u16)).collect::<Vec<_>>(), shape)
        }
        DType::BF16 => {
            Tensor::from_slice(dev, &bits.iter().map(|&b| bf16::from_bits(b as u16)).collect::<Vec<_>>(), shape)
        }
    }
    .map_err(e)
}

/// The tensor's bit patterns.
fn bits_of(t: &Tensor) -> Result<Vec<u32>, String> {
    Ok(match t.dtype() {
        DType::F32 => t.to_vec::<f32>().map_err(e)?.into_iter().map(f32::to_bits).collect(),
        DType::F16 => t.to_vec::<f16>().map_err(e)?.into_iter().map(|h| h.to_bits() as u32).collect(),
        DType::BF16 => t.to_vec::<bf16>().map_err(e)?.into_iter().map(|h| h.to_bits() as u32).collect(),
    })
}

/// Bits of the NaN that `nan_tensor` fills with.
fn nan_fill(dev: &Device, dt: DType) -> Result<u32, String> {
    Ok(bits_of(&nan_tensor(dev, &[1], dt)?)?[0])
}

/// `(batch, rows, cols)` of a shape of rank >= 2.
fn dims(shape: &[usize]) -> (usize, usize, usize) {
    let n = shape.len();
    (shape[..n - 2].iter().product(), shape[n - 2], shape[n - 1])
}

fn swapped(shape: &[usize]) -> Vec<usize> {
    let mut s = shape.to_vec();
    let n = s.len();
    s.swap(n - 2, n - 1);
    s
}

/// The CPU transpose: `y[b, c, r] = x[b, r, c]`.
fn reference(x: &[u32], shape: &[usize]) -> Vec<u32> {
    let (batch, rows, cols) = dims(shape);
    let mut y = vec![0u32; x.len()];
    for b in 0..batch {
        let (xm, ym) = (&x[b * rows * cols..(b + 1) * rows * cols], &mut y[b * rows * cols..(b + 1) * rows * cols]);
        for r in 0..rows {
            for c in 0..cols {
                ym[c * rows + r] = xm[r * cols + c];
            }
        }
    }
    y
}

/// Bit-for-bit comparison of a transposed tensor with the reference; on failure, where the
/// first mismatches are (as output coordinates) and how many hold an unwritten pattern.
fn check(what: &str, dt: DType, shape: &[usize], t: &Tensor, want: &[u32], fill: u32) -> Result<(), String> {
    let out_shape = swapped(shape);
    if t.shape() != out_shape.as_slice() || t.dtype() != dt {
        return Err(format!("{what} of {shape:?} {dt:?}: got a {:?} {:?} tensor", t.shape(), t.dtype()));
    }
    let got = bits_of(t)?;
    let bad: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
    if bad.is_empty() {
        return Ok(());
    }
    let (_, rows, cols) = dims(shape);
    let unwritten = bad.iter().filter(|&&i| got[i] == poison(dt) || got[i] == fill).count();
    let mut msg = format!(
        "{what} of {shape:?} {dt:?}: {} of {} elements differ ({unwritten} of them unwritten)",
        bad.len(),
        want.len()
    );
    for &i in bad.iter().take(6) {
        let (b, c, r) = (i / (rows * cols), i / rows % cols, i % rows);
        msg += &format!("\n  y[{b}, {c}, {r}]: got {:#x}, want {:#x} (= x[{b}, {r}, {c}])", got[i], want[i]);
    }
    Err(msg)
}

/// `ops::transpose` of random bits of `shape`, against the reference.
fn case(dev: &Device, dt: DType, shape: &[usize], seed: u64) -> Result<(), String> {
    let n: usize = shape.iter().product();
    let xs = random_bits(&mut TestRng::new(seed), n, dt, &[]);
    let x = upload(dev, &xs, shape, dt)?;
    let y = ops::transpose(&x).map_err(e)?;
    check("transpose", dt, shape, &y, &reference(&xs, shape), poison(dt))
}

/// Every entry point on one shape: `transpose` (poisoned allocation), `transpose_out` into a
/// NaN-filled tensor, the `Tensor` method, and the transpose back giving the input.
fn all_entry_points(dev: &Device, dt: DType, shape: &[usize], seed: u64) -> Result<(), String> {
    let n: usize = shape.iter().product();
    let fill = nan_fill(dev, dt)?;
    let xs = random_bits(&mut TestRng::new(seed), n, dt, &[fill]);
    let x = upload(dev, &xs, shape, dt)?;
    let want = reference(&xs, shape);
    let y = ops::transpose(&x).map_err(e)?;
    check("transpose", dt, shape, &y, &want, fill)?;
    let mut out = nan_tensor(dev, &swapped(shape), dt)?;
    ops::transpose_out(&x, &mut out).map_err(e)?;
    check("transpose_out", dt, shape, &out, &want, fill)?;
    check("Tensor::transpose", dt, shape, &x.transpose().map_err(e)?, &want, fill)?;
    let back = y.transpose().map_err(e)?;
    if back.shape() != shape || bits_of(&back)? != xs {
        return Err(format!("transposing {shape:?} {dt:?} twice does not give the input back"));
    }
    Ok(())
}

/// One dimension: values around the vector widths (4, 8) and tile sides (32, 64, 128),
/// primes, and anything up to 300.
fn dim() -> impl Strategy<Value = usize> {
    let edge = prop::sample::select(vec![
        1usize, 2, 3, 4, 5, 7, 8, 9, 12, 16, 24, 31, 32, 33, 40, 63, 64, 65, 97, 127, 128, 129, 136, 255, 256, 257,
    ]);
    prop_oneof![3 => edge, 1 => 1usize..300]
}

/// Shapes of rank 2 to 4: up to two leading (batch) dimensions of 1 to 3.
fn shapes() -> impl Strategy<Value = Vec<usize>> {
    (prop::collection::vec(1usize..4, 0..=2), dim(), dim()).prop_map(|(mut s, r, c)| {
        s.push(r);
        s.push(c);
        s
    })
}

/// Fixed shapes: a large unaligned matrix, a single row and a single column of a prime length,
/// a batch of odd matrices, aligned matrices with whole and partial tiles, long thin ones, and
/// a rank-4 batch.
fn fixed_shapes() -> Vec<Vec<usize>> {
    if sanitizer() {
        vec![vec![257, 129], vec![1, 1009], vec![1009, 1], vec![3, 65, 33], vec![2, 136, 264]]
    } else {
        vec![
            vec![4097, 1025],
            vec![1, 100_003],
            vec![100_003, 1],
            vec![3, 257, 129],
            vec![1024, 2048],
            vec![2, 520, 776],
            vec![8, 8192],
            vec![8192, 8],
            vec![2, 3, 129, 1031],
            vec![1000, 1000],
        ]
    }
}

/// Launches whose `grid.y` (batch times row tiles) is capped at 65535, so blocks loop: a batch
/// of 65537 small matrices on the scalar and on the vector path, and (not under the sanitizer)
/// a column of more than 65535 * 32 rows.
fn folded_grid(dev: &Device, dt: DType) -> Result<(), String> {
    let mut shapes = vec![vec![65_537, 2, 3], vec![65_537, 8, 8]];
    if !sanitizer() {
        shapes.push(vec![2_100_001, 1]);
    }
    for (i, s) in shapes.iter().enumerate() {
        case(dev, dt, s, 7 + i as u64)?;
    }
    Ok(())
}

/// More than 2^31 elements (bf16, 46344 x 46344, the vector path): 64-bit indices everywhere.
/// The input is generated on the device (`rand_uniform`) and recomputed on the CPU where needed;
/// checked are every output element from linear index 2^31 - 2^20 on and every 997th before.
fn beyond_2_31(dev: &Device) -> Result<(), String> {
    const N: usize = 46_344;
    const { assert!(N * N > 1 << 31 && N.is_multiple_of(8)) };
    let (seed, lo, hi) = (5u64, -3.0f32, 3.0f32);
    let x = Tensor::rand_uniform(dev, &[N, N], DType::BF16, lo, hi, seed).map_err(e)?;
    let y = ops::transpose(&x).map_err(e)?;
    drop(x);
    let got = y.to_vec::<bf16>().map_err(e)?;
    let tail = (1usize << 31) - (1 << 20);
    for i in (0..tail).step_by(997).chain(tail..N * N) {
        // y[c, r] = x[r, c] with i = c * N + r.
        let (c, r) = (i / N, i % N);
        let want = bf16::from_f32(kernels_gpu::init::uniform_at(seed, (r * N + c) as u64, lo, hi));
        if got[i].to_bits() != want.to_bits() {
            return Err(format!("y[{c}, {r}] (element {i}) is {:#x}, want {:#x}", got[i].to_bits(), want.to_bits()));
        }
    }
    Ok(())
}

fn argument_errors(dev: &Device) -> Result<(), String> {
    let dt = DType::F32;
    for shape in [vec![5usize], vec![]] {
        let x = Tensor::zeros(dev, &shape, dt).map_err(e)?;
        match ops::transpose(&x) {
            Err(err @ Error::InvalidArgument { .. }) => {
                let msg = err.to_string();
                if !msg.starts_with("transpose: ") || !msg.contains(&format!("{shape:?}")) {
                    return Err(format!("the error does not name the op and the shape: {msg}"));
                }
            }
            other => return Err(format!("transpose of shape {shape:?}: expected InvalidArgument, got {other:?}")),
        }
        let mut out = Tensor::zeros(dev, &shape, dt).map_err(e)?;
        if !matches!(ops::transpose_out(&x, &mut out), Err(Error::InvalidArgument { .. })) {
            return Err(format!("transpose_out of shape {shape:?} must be InvalidArgument"));
        }
    }
    let x = Tensor::zeros(dev, &[3, 5], dt).map_err(e)?;
    for bad in [vec![3usize, 5], vec![15], vec![5, 3, 1], vec![1, 5, 3]] {
        let mut out = Tensor::zeros(dev, &bad, dt).map_err(e)?;
        match ops::transpose_out(&x, &mut out) {
            Err(Error::ShapeMismatch { op: "transpose_out", expected, got, .. })
                if expected == [5, 3] && got == bad => {}
            other => return Err(format!("transpose_out into {bad:?}: expected ShapeMismatch, got {other:?}")),
        }
    }
    let mut out = Tensor::zeros(dev, &[5, 3], DType::BF16).map_err(e)?;
    if !matches!(ops::transpose_out(&x, &mut out), Err(Error::DTypeMismatch { .. })) {
        return Err("transpose_out into another dtype must be DTypeMismatch".into());
    }
    Ok(())
}

/// Empty tensors give empty tensors of the transposed shape (no launch).
fn empty_tensors(dev: &Device) -> Result<(), String> {
    for dt in DType::ALL {
        for shape in [vec![0usize, 5], vec![5, 0], vec![0, 0], vec![2, 0, 3], vec![0, 3, 4], vec![3, 4, 0, 2]] {
            let x = Tensor::zeros(dev, &shape, dt).map_err(e)?;
            let y = ops::transpose(&x).map_err(e)?;
            if y.shape() != swapped(&shape).as_slice() || y.numel() != 0 || y.dtype() != dt {
                return Err(format!("transpose of {shape:?}: got {y:?}"));
            }
            let mut out = Tensor::zeros(dev, &swapped(&shape), dt).map_err(e)?;
            ops::transpose_out(&x, &mut out).map_err(e)?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for dt in DType::ALL {
        tests.push(test(format!("transpose/random_shapes/{dt:?}"), move |dev: &Device| {
            prop(48, (shapes(), any::<u64>()), |(shape, seed)| case(dev, dt, &shape, seed))
        }));
        tests.push(test(format!("transpose/fixed_shapes/{dt:?}"), move |dev: &Device| {
            fixed_shapes().iter().enumerate().try_for_each(|(i, s)| all_entry_points(dev, dt, s, 100 + i as u64))
        }));
        // Under the sanitizer, 65537 blocks are slow: one dtype is enough there.
        if !sanitizer() || dt == DType::F32 {
            tests.push(test(format!("transpose/folded_grid/{dt:?}"), move |dev: &Device| folded_grid(dev, dt)));
        }
    }
    tests.push(test("transpose/errors/arguments", argument_errors));
    tests.push(test("transpose/errors/empty_tensors", empty_tensors));
    // 8.6 GB of device memory and 4.3 GB of host memory; far too slow under compute-sanitizer.
    if !sanitizer() {
        tests.push(test("transpose/bf16_beyond_2^31", beyond_2_31));
    }
    run(tests)
}
