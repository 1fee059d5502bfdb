//! Filling tensors: constants and seeded random numbers generated on the device.
//!
//! Random numbers come from Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
//! 1, 2, 3", SC'11), a counter-based generator: element `i` of a tensor is a pure function of
//! `(seed, i)`, so the result does not depend on the launch configuration and the CPU can
//! recompute any element exactly (the tests do).

/// `(y, n, value)`: `y[i] = value` rounded to `T`.
pub type FillArgs<T> = (*mut T, u64, f32);
/// `(y, n, seed_lo, seed_hi, p, q)`: uniform on `[p, q)` or normal with mean `p`, std `q`.
pub type RandomArgs<T> = (*mut T, u64, u32, u32, f32, f32);
/// `(y, n, seed_lo, seed_hi, low, span)`: int64 indices, `y[i] = `[`randint_at`]`(seed, i, low,
/// span)`, uniform on `[low, low + span)`.
pub type RandintArgs = (*mut i64, u64, u32, u32, i64, u64);

/// The family's kernels of one storage type `T`, typed: `fill_<dt>`, `uniform_<dt>`, `normal_<dt>`.
#[allow(missing_docs)]
pub struct InitKernels<T: 'static> {
    pub fill: crate::kernel::Kernel<FillArgs<T>>,
    pub uniform: crate::kernel::Kernel<RandomArgs<T>>,
    pub normal: crate::kernel::Kernel<RandomArgs<T>>,
}
/// A storage type's init kernels (set by the declaration below).
pub trait InitElem: crate::Elem {
    /// The kernels of `Self`.
    const INIT: InitKernels<Self>;
}

const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

#[inline(always)]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// Philox4x32 with 10 rounds: four independent 32-bit words for the 128-bit counter `ctr`.
#[inline(always)]
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for _ in 0..10 {
        let (hi0, lo0) = mulhilo(PHILOX_M0, c[0]);
        let (hi1, lo1) = mulhilo(PHILOX_M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
        k = [k[0].wrapping_add(PHILOX_W0), k[1].wrapping_add(PHILOX_W1)];
    }
    c
}

/// The four random words for elements `4j .. 4j + 4`.
#[inline(always)]
pub fn random_words(seed: u64, j: u64) -> [u32; 4] {
    philox4x32_10([j as u32, (j >> 32) as u32, 0, 0], [seed as u32, (seed >> 32) as u32])
}

/// `w[k]` for `k < 4` by selects: indexing a register array with a run-time index would move the
/// array to local memory on the GPU.
#[inline(always)]
fn pick(w: [u32; 4], k: u64) -> u32 {
    match k {
        0 => w[0],
        1 => w[1],
        2 => w[2],
        _ => w[3],
    }
}

/// A uniform float in `[0, 1)` from the top 24 bits: every value is a multiple of 2^-24.
#[inline(always)]
pub fn unit_uniform(w: u32) -> f32 {
    (w >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// Element `i` of a uniform tensor on `[lo, hi)`, before rounding to the storage type.
#[inline(always)]
pub fn uniform_at(seed: u64, i: u64, lo: f32, hi: f32) -> f32 {
    let w = pick(random_words(seed, i / 4), i % 4);
    crate::math::fma(unit_uniform(w), hi - lo, lo)
}

/// Elements `2m` and `2m + 1` of a standard normal tensor (Box-Muller on one pair of words).
/// `u1` lies in `(0, 1]`, so the logarithm is finite.
#[inline(always)]
pub fn normal_pair(seed: u64, m: u64) -> (f32, f32) {
    let w = random_words(seed, m / 2);
    let (w1, w2) = if m.is_multiple_of(2) { (w[0], w[1]) } else { (w[2], w[3]) };
    let u1 = ((w1 >> 8) + 1) as f32 * (1.0 / 16_777_216.0);
    let u2 = unit_uniform(w2);
    let r = crate::math::sqrt(-2.0 * crate::math::log(u1));
    let t = 2.0 * u2;
    (r * crate::math::cospi(t), r * crate::math::sinpi(t))
}

/// Element `i` of a normal tensor with the given mean and standard deviation.
#[inline(always)]
pub fn normal_at(seed: u64, i: u64, mean: f32, std: f32) -> f32 {
    let (z0, z1) = normal_pair(seed, i / 2);
    crate::math::fma(if i.is_multiple_of(2) { z0 } else { z1 }, std, mean)
}

/// The high 64 bits of the 128-bit product `a b`, from 32-bit halves (no 128-bit arithmetic on
/// the device).
#[inline(always)]
pub fn mul_hi_u64(a: u64, b: u64) -> u64 {
    let (a0, a1, b0, b1) = (a & 0xffff_ffff, a >> 32, b & 0xffff_ffff, b >> 32);
    let (p00, p01, p10, p11) = (a0 * b0, a0 * b1, a1 * b0, a1 * b1);
    let mid = (p00 >> 32) + (p01 & 0xffff_ffff) + (p10 & 0xffff_ffff);
    p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32)
}

/// Element `i` of an int64 tensor uniform on `[low, low + span)` (`span >= 1`): 64 random bits
/// `w` (two Philox words; elements `2m` and `2m + 1` share one call) scaled to
/// `floor(w span / 2^64)` (Lemire's multiply, no division). Each value's probability is within
/// `2^-64` of `1 / span`.
#[inline(always)]
pub fn randint_at(seed: u64, i: u64, low: i64, span: u64) -> i64 {
    let w = random_words(seed, i / 2);
    let (hi, lo) = if i.is_multiple_of(2) { (w[0], w[1]) } else { (w[2], w[3]) };
    let bits = ((hi as u64) << 32) | lo as u64;
    low.wrapping_add(mul_hi_u64(bits, span) as i64)
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::Elem;
    use crate::prim::*;

    /// Each thread writes whole 16-byte vectors; the tail one element per thread.
    #[inline(always)]
    unsafe fn fill_with<T: Elem>(y: *mut T, n: u64, f: impl Fn(u64) -> f32) {
        let w = T::VEC as u64;
        let nv = n / w;
        let mut i = global_thread_x();
        while i < nv {
            let mut v = [0.0f32; 8];
            crate::dtype::for_lanes::<T>(
                #[inline(always)]
                |k| v[k] = f(i * w + k as u64),
            );
            // SAFETY: vector i lies inside y; allocations are 16-byte aligned.
            unsafe { st_global_v4(y.add((i * w) as usize) as *mut u32, T::pack(&v)) };
            i += grid_threads_x();
        }
        let t = nv * w + global_thread_x();
        if t < n {
            // SAFETY: t < n.
            unsafe { *y.add(t as usize) = T::from_f32(f(t)) };
        }
    }

    pub unsafe fn fill<T: Elem>(y: *mut T, n: u64, value: f32) {
        unsafe { fill_with(y, n, |_| value) }
    }

    pub unsafe fn uniform<T: Elem>(y: *mut T, n: u64, s0: u32, s1: u32, lo: f32, hi: f32) {
        let seed = s0 as u64 | (s1 as u64) << 32;
        unsafe { fill_with(y, n, |i| uniform_at(seed, i, lo, hi)) }
    }

    pub unsafe fn normal<T: Elem>(y: *mut T, n: u64, s0: u32, s1: u32, mean: f32, std: f32) {
        let seed = s0 as u64 | (s1 as u64) << 32;
        unsafe { fill_with(y, n, |i| normal_at(seed, i, mean, std)) }
    }

    /// See [`RandintArgs`]: an element a thread.
    pub unsafe fn randint_fill(y: *mut i64, n: u64, s0: u32, s1: u32, low: i64, span: u64) {
        let seed = s0 as u64 | (s1 as u64) << 32;
        let mut i = global_thread_x();
        while i < n {
            // SAFETY: i < n, the elements of y.
            unsafe { *y.add(i as usize) = randint_at(seed, i, low, span) };
            i += grid_threads_x();
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

macro_rules! init_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<fill_ $sfx>]: FillArgs<$T> = |y, n, v| fill::<$T>(y, n, v));
            $crate::kernel!([<uniform_ $sfx>]: RandomArgs<$T> = |y, n, s0, s1, lo, hi|
                uniform::<$T>(y, n, s0, s1, lo, hi));
            $crate::kernel!([<normal_ $sfx>]: RandomArgs<$T> = |y, n, s0, s1, m, s|
                normal::<$T>(y, n, s0, s1, m, s));
            #[cfg(not(target_arch = "nvptx64"))]
            impl InitElem for $T {
                const INIT: InitKernels<$T> =
                    InitKernels { fill: [<fill_ $sfx>], uniform: [<uniform_ $sfx>], normal: [<normal_ $sfx>] };
            }
        }
    };
}
crate::for_each_elem!(init_kernels);

crate::kernel!(randint: RandintArgs = |y, n, s0, s1, low, span| randint_fill(y, n, s0, s1, low, span));

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
    use crate::dtype::{BF16, F16};
    fn entries<T: InitElem>() -> [crate::kernel::KernelEntry; 3]
    where
        FillArgs<T>: crate::kernel::Params,
        RandomArgs<T>: crate::kernel::Params,
    {
        [T::INIT.fill.entry(), T::INIT.uniform.entry(), T::INIT.normal.entry()]
    }
    [entries::<f32>(), entries::<F16>(), entries::<BF16>()].into_iter().flatten().chain([randint.entry()])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mul_hi_is_the_high_half_of_the_product() {
        let vals = [0u64, 1, 2, 3, 0xffff_ffff, 0x1_0000_0000, 0xdead_beef_cafe_f00d, u64::MAX - 1, u64::MAX];
        for &a in &vals {
            for &b in &vals {
                assert_eq!(mul_hi_u64(a, b), ((a as u128 * b as u128) >> 64) as u64, "{a:#x} * {b:#x}");
            }
        }
    }

    #[test]
    fn randint_stays_in_its_range() {
        for (low, span) in [(0i64, 1u64), (-5, 7), (i64::MIN, u64::MAX), (i64::MAX - 2, 3), (10, 1 << 40)] {
            for i in 0..200 {
                let r = randint_at(42, i, low, span);
                let off = (r as i128 - low as i128) as u128;
                assert!(off < span as u128, "low {low} span {span}: {r}");
            }
        }
        // Two elements per Philox call, each its own word pair.
        assert_ne!(randint_at(1, 0, 0, u64::MAX), randint_at(1, 1, 0, u64::MAX));
    }
}
