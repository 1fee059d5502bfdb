//! Evaluates one math function over a buffer of f32 inputs, so the accuracy of [`crate::math`]
//! can be measured on the GPU itself (the same code is measured on the CPU by
//! `kernels-gpu/tests/math_accuracy.rs`; the GPU test checks that the device agrees).

/// `(x, y, n, which)`: `y[i] = f(x[i])` with `f` chosen by `which` ([`MathFn`] as u32).
pub type MathProbeArgs = (*const f32, *mut f32, u64, u32);
/// `(x, y, out, n)`: `out[i] = fastmath::pow(x[i], y[i])`, the pow the kernels run.
pub type MathProbePowArgs = (*const f32, *const f32, *mut f32, u64);

/// The functions the probe evaluates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum MathFn {
    /// `fastmath::exp`.
    Exp = 0,
    /// `fastmath::expm1`.
    Expm1 = 1,
    /// `fastmath::log`.
    Log = 2,
    /// `fastmath::log1p`.
    Log1p = 3,
    /// `fastmath::tanh`.
    Tanh = 4,
    /// `fastmath::erf`.
    Erf = 5,
    /// `sin(pi x)` (`fastmath::sinpi`).
    Sinpi = 6,
    /// `cos(pi x)` (`fastmath::cospi`).
    Cospi = 7,
    /// `fastmath::sqrt`.
    Sqrt = 8,
    /// `fastmath::normal_cdf`, GELU's Phi (not an ulp-accurate function: its own bound).
    NormalCdf = 9,
    /// `fastmath::normal_pdf`, GELU's backward phi (likewise).
    NormalPdf = 10,
    /// `1 / sqrt(x)` (`fastmath::rsqrt`).
    Rsqrt = 11,
}

impl MathFn {
    /// Every function, in code order.
    pub const ALL: [MathFn; 12] = [
        MathFn::Exp,
        MathFn::Expm1,
        MathFn::Log,
        MathFn::Log1p,
        MathFn::Tanh,
        MathFn::Erf,
        MathFn::Sinpi,
        MathFn::Cospi,
        MathFn::Sqrt,
        MathFn::NormalCdf,
        MathFn::NormalPdf,
        MathFn::Rsqrt,
    ];

    /// The function as the kernels call it (`crate::fastmath`: on the CPU, `crate::math`).
    #[inline(always)]
    pub fn eval(self, x: f32) -> f32 {
        use crate::fastmath as m;
        match self {
            MathFn::Exp => m::exp(x),
            MathFn::Expm1 => m::expm1(x),
            MathFn::Log => m::log(x),
            MathFn::Log1p => m::log1p(x),
            MathFn::Tanh => m::tanh(x),
            MathFn::Erf => m::erf(x),
            MathFn::Sinpi => m::sinpi(x),
            MathFn::Cospi => m::cospi(x),
            MathFn::Sqrt => m::sqrt(x),
            MathFn::NormalCdf => m::normal_cdf(x),
            MathFn::NormalPdf => m::normal_pdf(x),
            MathFn::Rsqrt => m::rsqrt(x),
        }
    }
}

#[cfg(target_arch = "nvptx64")]
unsafe fn probe(x: *const f32, y: *mut f32, n: u64, which: u32) {
    let f = match which {
        0 => MathFn::Exp,
        1 => MathFn::Expm1,
        2 => MathFn::Log,
        3 => MathFn::Log1p,
        4 => MathFn::Tanh,
        5 => MathFn::Erf,
        6 => MathFn::Sinpi,
        7 => MathFn::Cospi,
        8 => MathFn::Sqrt,
        9 => MathFn::NormalCdf,
        10 => MathFn::NormalPdf,
        _ => MathFn::Rsqrt,
    };
    let mut i = crate::prim::global_thread_x();
    while i < n {
        // SAFETY: i < n, the length of both buffers.
        unsafe { *y.add(i as usize) = f.eval(*x.add(i as usize)) };
        i += crate::prim::grid_threads_x();
    }
}

crate::kernel!(math_probe_f32: MathProbeArgs = |x, y, n, which| probe(x, y, n, which));

#[cfg(target_arch = "nvptx64")]
unsafe fn probe_pow(x: *const f32, y: *const f32, out: *mut f32, n: u64) {
    let mut i = crate::prim::global_thread_x();
    while i < n {
        // SAFETY: i < n, the length of all three buffers.
        unsafe { *out.add(i as usize) = crate::fastmath::pow(*x.add(i as usize), *y.add(i as usize)) };
        i += crate::prim::grid_threads_x();
    }
}

crate::kernel!(math_probe_pow_f32: MathProbePowArgs = |x, y, out, n| probe_pow(x, y, out, n));

/// Every kernel of the probe (`math_probe_f32`, `math_probe_pow_f32`): its name and arity (for
/// the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
    [math_probe_f32.entry(), math_probe_pow_f32.entry()].into_iter()
}
