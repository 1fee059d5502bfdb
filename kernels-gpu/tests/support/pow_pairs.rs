//! The (x, y) pairs pow is measured on, shared by the CPU accuracy test
//! (`kernels-gpu/tests/math_accuracy.rs`) and the GPU one (`tests/math_gpu.rs`), which include
//! this file by path.

const NAN: f32 = f32::NAN;
const INF: f32 = f32::INFINITY;
const DEN: f32 = 1.0e-45; // smallest denormal, 2^-149

/// splitmix64: a small, fixed-seed generator for the random pow pairs.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 * 2f64.powi(-53)
    }
}

/// The f32 values within `k` ulp of each of `centres`.
pub fn around(centres: &[f32], k: i32) -> Vec<f32> {
    let mut v = Vec::new();
    for &c in centres {
        for d in -k..=k {
            let b = c.to_bits() as i64 + d as i64;
            if (0..=u32::MAX as i64).contains(&b) {
                v.push(f32::from_bits(b as u32));
            }
        }
    }
    v
}

/// The (x, y) pairs both pows are measured on.
pub fn pow_pairs() -> Vec<(f32, f32)> {
    // Dense x against a list of y (integers, halves, large, tiny, special), x near 1 against
    // huge y, and random pairs from a fixed seed.
    let mut ys: Vec<f32> = (-12..=12).map(|k| k as f32).collect();
    ys.extend([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 1.0 / 3.0, -1.0 / 3.0, 0.1, -0.1, 0.75, 3.7]);
    ys.extend([100.0, -100.0, 1000.5, -1000.5, 12345.678, -12345.678, 65536.0, -65537.0]);
    ys.extend([1e6, -1e6, 16777215.0, -16777215.0, 16777216.0, 1e9, -1e9, 1e30, -1e30]);
    ys.extend([1e-3, -1e-3, 1e-7, -1e-7, 1e-20, -1e-20, DEN, -DEN, 0.0, -0.0, INF, -INF, NAN]);
    let mut pairs = Vec::new();
    // Dense x over all 2^32 bit patterns (both signs, zeros, denormals, infinities, NaNs).
    let mut i = 9u64;
    while i < 1 << 32 {
        let x = f32::from_bits(i as u32);
        for &y in &ys {
            pairs.push((x, y));
        }
        i += 65_537;
    }
    // x close to 1 with large |y|: the cases that need log2 x to many more than 24 bits.
    for &x in &around(&[1.0], 300) {
        for y in [1e5f32, -1e5, 3e6, -3e6, 1.5e7, -1.5e7, 1e9] {
            pairs.push((x, y));
        }
    }
    // Random pairs: x uniform over the bit patterns of positive finite floats, y such that
    // y log2 x is uniform in [-160, 140] (the full range of results, overflow and underflow
    // included); then negative x with integer y; then uniform bit patterns for both.
    let mut rng = Rng(0x005e_ed0f_9a11);
    for _ in 0..1 << 22 {
        let x = f32::from_bits((rng.next() % 0x7f80_0000) as u32);
        let l = f64::from(x).log2();
        let t = -160.0 + 300.0 * rng.unit();
        let y = if l == 0.0 { t as f32 } else { (t / l) as f32 };
        pairs.push((x, y));
    }
    for _ in 0..1 << 18 {
        let x = -f32::from_bits((rng.next() % 0x7f80_0000) as u32);
        let l = f64::from(x).abs().log2().abs().max(1e-3);
        let y = ((-160.0 + 300.0 * rng.unit()) / l).round() as f32;
        pairs.push((x, y));
        pairs.push((x, y + 1.0));
    }
    for _ in 0..1 << 18 {
        pairs.push((f32::from_bits(rng.next() as u32), f32::from_bits(rng.next() as u32)));
    }
    pairs
}
