//! GPU tests of the tensor's own methods: `to_dtype` (every pair of dtypes, bit for bit against
//! the `half` crate's conversions), `to_scalar`, `Display`, and `IndexTensor`'s clone.

mod common;

use common::*;
use half::{bf16, f16};
use kernels::{DType, Device, Error, IndexTensor, Tensor};
use std::process::ExitCode;

/// Bit patterns of `dt` (in the low 16 bits for f16 and bf16) that a cast must get right: signed
/// zeros, infinities, NaNs (quiet, signalling, negative, with payloads), the denormal and normal
/// limits, the largest finite values (which round to infinity in narrower types), and values
/// exactly halfway between two of the narrower type (ties to even, down and up) or just past.
fn specials(dt: DType) -> Vec<u32> {
    match dt {
        DType::F32 => vec![
            0x0000_0000, // +0
            0x8000_0000, // -0
            0x7f80_0000, // +inf
            0xff80_0000, // -inf
            0x7fc0_0000, // NaN
            0xffc0_1234, // -NaN with a payload
            0x7f80_0001, // signalling NaN
            0x0000_0001, // smallest denormal: 0 in f16 and bf16
            0x007f_ffff, // largest denormal: bf16 rounds it up to the smallest normal
            0x0080_0000, // smallest normal
            0x7f7f_ffff, // largest: inf in f16 and bf16
            0xff7f_0000, // -bf16's largest: exact in bf16
            0x3f80_1000, // 1 + 2^-11: f16 tie, to even (1)
            0x3f80_3000, // 1 + 3 * 2^-11: f16 tie, to even (1 + 2^-9)
            0x3f80_1001, // just past the f16 tie: up
            0x3f80_8000, // 1 + 2^-8: bf16 tie, to even (1)
            0x3f81_8000, // 1 + 3 * 2^-8: bf16 tie, to even (1 + 2^-6)
            0x3f80_8001, // just past the bf16 tie: up
            0x477f_e000, // 65504, f16's largest
            0x477f_efff, // just below 65520: 65504 in f16
            0x477f_f000, // 65520: inf in f16
            0x3380_0000, // 2^-24: f16's smallest denormal
            0x3300_0000, // 2^-25: f16 tie between 0 and 2^-24, to 0
            0x3300_0001, // just past it: 2^-24
            0x33c0_0000, // 1.5 * 2^-24: f16 tie, to 2^-23
            0xb87f_ffff, // -(2^-14 less an f32 ulp): rounds to -f16's smallest normal
            0x4049_0fdb, // pi: rounds in both
        ],
        DType::F16 => vec![
            0x0000, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0xfe01, 0x7c01, // zeros, infinities, NaNs
            0x0001, 0x8001, 0x03ff, 0x0400, 0x7bff, 0xfbff, // denormals, smallest normal, largest
            0x3c01, // 1 + 2^-10: bf16 rounds down to 1
            0x3c04, // 1 + 2^-8: bf16 tie, to even (1)
            0x3c0c, // 1 + 3 * 2^-8: bf16 tie, to even (1 + 2^-6)
            0x3c05, // just past the bf16 tie: up
            0x4248, // pi
        ],
        DType::BF16 => vec![
            0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0xffc1, 0x7f81, // zeros, infinities, NaNs
            0x0001, 0x007f, 0x0080, 0x7f7f, 0xff7f, // denormals, smallest normal, largest
            0x477f, // 65280: exact in f16
            0x4780, // 65536: inf in f16
            0x3380, // 2^-24: f16's smallest denormal
            0x3300, // 2^-25: f16 tie, to 0
            0x3301, // just past it: 2^-24
            0x33c0, // 1.5 * 2^-24: f16 tie, to 2^-23
            0x3f81, // 1 + 2^-7: exact in f16
            0x4049, // pi
        ],
    }
}

fn is_nan(bits: u32, dt: DType) -> bool {
    match dt {
        DType::F32 => bits & 0x7fff_ffff > 0x7f80_0000,
        DType::F16 => bits & 0x7fff > 0x7c00,
        DType::BF16 => bits & 0x7fff > 0x7f80,
    }
}

/// The CPU's cast: widen exactly to f32, then round to nearest even (`half`).
fn cpu_cast(bits: u32, from: DType, to: DType) -> u32 {
    let x = match from {
        DType::F32 => f32::from_bits(bits),
        DType::F16 => f16::from_bits(bits as u16).to_f32(),
        DType::BF16 => bf16::from_bits(bits as u16).to_f32(),
    };
    match to {
        DType::F32 => x.to_bits(),
        DType::F16 => f16::from_f32(x).to_bits() as u32,
        DType::BF16 => bf16::from_f32(x).to_bits() as u32,
    }
}

/// A tensor of `dt` holding exactly these bit patterns.
fn upload(dev: &Device, dt: DType, bits: &[u32]) -> Result<Tensor, String> {
    let shape = [bits.len()];
    match dt {
        DType::F32 => Tensor::from_slice(dev, &bits.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>(), &shape),
        DType::F16 => {
            Tensor::from_slice(dev, &bits.iter().map(|&b| f16::from_bits(b as u16)).collect::<Vec<_>>(), &shape)
        }
        DType::BF16 => {
            Tensor::from_slice(dev, &bits.iter().map(|&b| bf16::from_bits(b as u16)).collect::<Vec<_>>(), &shape)
        }
    }
    .map_err(e)
}

/// The tensor's bit patterns.
fn bits_of(t: &Tensor) -> Result<Vec<u32>, String> {
    Ok(match t.dtype() {
        DType::F32 => t.to_vec::<f32>().map_err(e)?.into_iter().map(f32::to_bits).collect(),
        DType::F16 => t.to_vec::<f16>().map_err(e)?.into_iter().map(|x| x.to_bits() as u32).collect(),
        DType::BF16 => t.to_vec::<bf16>().map_err(e)?.into_iter().map(|x| x.to_bits() as u32).collect(),
    })
}

/// `to_dtype` of `src` (bit patterns of `from`) against the CPU, bit for bit. A NaN must stay a
/// NaN; its sign and payload are the hardware's (a canonical NaN), as in PyTorch.
fn cast_case(dev: &Device, from: DType, to: DType, src: &[u32]) -> Result<(), String> {
    let x = upload(dev, from, src)?;
    let y = x.to_dtype(to).map_err(e)?;
    if y.dtype() != to || y.shape() != x.shape() {
        return Err(format!("{from:?} -> {to:?}: got {:?} {:?}", y.dtype(), y.shape()));
    }
    if from == to && !y.shares_memory(&x) {
        return Err(format!("{from:?} -> {to:?}: a cast to the same dtype must share the memory"));
    }
    let got = bits_of(&y)?;
    for (i, (&s, &g)) in src.iter().zip(&got).enumerate() {
        let want = cpu_cast(s, from, to);
        let ok = if is_nan(want, to) { is_nan(g, to) } else { g == want };
        if !ok {
            return Err(format!(
                "{from:?} -> {to:?}, {} elements: element {i} ({s:#x}) became {g:#x}, the CPU gives {want:#x}",
                src.len()
            ));
        }
    }
    Ok(())
}

/// Every pair of dtypes (the same one included), on sizes 0, 1, 7, 8, 9 and 4097: whole groups
/// of 8 and the one-element tail. Each special value goes through the tail (sizes 1, 7 and 9,
/// rotated) and the vector path (the start and end of 4097, among random bit patterns).
fn cast_all(dev: &Device, from: DType, to: DType) -> Result<(), String> {
    let sp = specials(from);
    let mask = if from == DType::F32 { u32::MAX } else { 0xffff };
    let mut rng = TestRng::new(from as u64 * 3 + to as u64);
    cast_case(dev, from, to, &[])?;
    for n in [1usize, 7, 8, 9] {
        for r in 0..sp.len() {
            let src: Vec<u32> = (0..n).map(|i| sp[(r + i) % sp.len()]).collect();
            cast_case(dev, from, to, &src)?;
        }
    }
    let mut src: Vec<u32> = (0..4097).map(|_| rng.next_u64() as u32 & mask).collect();
    src[..sp.len()].copy_from_slice(&sp);
    let tail = src.len() - sp.len();
    src[tail..].iter_mut().zip(sp.iter().rev()).for_each(|(d, &s)| *d = s);
    cast_case(dev, from, to, &src)
}

fn to_scalar(dev: &Device) -> Result<(), String> {
    let t = Tensor::from_slice(dev, &[2.5f32], &[]).map_err(e)?;
    if t.to_scalar::<f32>().map_err(e)? != 2.5 {
        return Err("to_scalar of [] f32".into());
    }
    let b = Tensor::from_slice(dev, &[bf16::from_f32(-0.1234)], &[1, 1]).map_err(e)?;
    if b.to_scalar::<bf16>().map_err(e)?.to_bits() != bf16::from_f32(-0.1234).to_bits() {
        return Err("to_scalar of [1, 1] bf16".into());
    }
    if !matches!(b.to_scalar::<f32>(), Err(Error::DTypeMismatch { .. })) {
        return Err("to_scalar::<f32> of a bf16 tensor must be a dtype error".into());
    }
    for shape in [&[0usize][..], &[2], &[1, 3]] {
        let t = Tensor::zeros(dev, shape, DType::F32).map_err(e)?;
        match t.to_scalar::<f32>() {
            Err(Error::InvalidArgument { op: "Tensor::to_scalar", .. }) => {}
            other => return Err(format!("to_scalar of shape {shape:?}: {other:?}")),
        }
    }
    Ok(())
}

fn display(dev: &Device) -> Result<(), String> {
    let cuda = format!("cuda:{}", dev.ordinal());
    let vals = [0.1234f32, -1.5, 0.0, f32::INFINITY, f32::NAN, 3.0, 7.0, 8.0];
    let t = Tensor::from_slice(dev, &vals, &[2, 4]).map_err(e)?;
    let want = format!("Tensor[2, 4] f32 {cuda} [0.1234, -1.5, 0, inf, NaN, 3, ...]");
    if t.to_string() != want {
        return Err(format!("`{t}`, expected `{want}`"));
    }
    let s = Tensor::from_slice(dev, &[f16::from_f32(-0.0)], &[]).map_err(e)?;
    let want = format!("Tensor[] f16 {cuda} [-0]");
    if s.to_string() != want {
        return Err(format!("`{s}`, expected `{want}`"));
    }
    let z = Tensor::zeros(dev, &[3, 0], DType::BF16).map_err(e)?;
    let want = format!("Tensor[3, 0] bf16 {cuda} []");
    if z.to_string() != want {
        return Err(format!("`{z}`, expected `{want}`"));
    }
    // A large bf16 tensor: the header, then six values that read back as its first six.
    let big = Tensor::rand_normal(dev, &[4096, 1024], DType::BF16, 0.0, 1.0, 3).map_err(e)?;
    let text = big.to_string();
    let head = format!("Tensor[4096, 1024] bf16 {cuda} [");
    let list = text.strip_prefix(&head).and_then(|r| r.strip_suffix(", ...]")).ok_or_else(|| format!("`{text}`"))?;
    let shown: Vec<&str> = list.split(", ").collect();
    let first = big.to_vec::<bf16>().map_err(e)?;
    if shown.len() != 6 {
        return Err(format!("`{text}`: expected six values"));
    }
    for (s, x) in shown.iter().zip(&first) {
        let y: f32 = s.parse().map_err(|_| format!("`{text}`: `{s}` is not a number"))?;
        if bf16::from_f32(y).to_bits() != x.to_bits() {
            return Err(format!("`{text}`: `{s}` is not the element {x}"));
        }
    }
    Ok(())
}

fn index_clone(dev: &Device) -> Result<(), String> {
    let a = IndexTensor::from_slice(dev, &[3, -1, 7], &[3]).map_err(e)?;
    let b = a.clone();
    drop(a);
    if b.to_vec().map_err(e)? != [3, -1, 7] || b.shape() != [3] {
        return Err("a clone of an index tensor must keep its values after the original is dropped".into());
    }
    let x = Tensor::from_slice(dev, &[1.0f32, 5.0, 2.0, 0.0, -1.0, 4.0], &[2, 3]).map_err(e)?;
    let am = x.argmax_last_dim().map_err(e)?;
    if am.clone().to_vec().map_err(e)? != [1, 2] || am.to_vec().map_err(e)? != [1, 2] {
        return Err("argmax_last_dim and its clone must read [1, 2]".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut tests = Vec::new();
    for from in DType::ALL {
        for to in DType::ALL {
            tests.push(test(format!("to_dtype/{from:?}/{to:?}"), move |dev: &Device| cast_all(dev, from, to)));
        }
    }
    tests.push(test("to_scalar", to_scalar));
    tests.push(test("display", display));
    tests.push(test("index_clone", index_clone));
    run(tests)
}
