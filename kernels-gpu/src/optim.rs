//! Optimizer steps: AdamW (`torch.optim.AdamW`, non-amsgrad, maximize=False) as one fused
//! element-wise kernel. For step `t >= 1`, learning rate `lr`, decay `wd`:
//!
//! ```text
//! p = p - lr * wd * p                       (decoupled weight decay)
//! m = b1 * m + (1 - b1) * g
//! v = b2 * v + (1 - b2) * g^2
//! p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//! ```
//!
//! The host folds everything that depends only on the step into seven f32 scalars, computed in
//! f64 and rounded once ([`AdamWScalars`]; PyTorch's fused kernel does the same with
//! `step_size = lr / bc1` and `bc2_sqrt`). One more fold than PyTorch's: multiplying the last
//! fraction's numerator and denominator by `bc2_sqrt = sqrt(1 - b2^t)` gives
//! `p -= (lr * bc2_sqrt / bc1) * m / (sqrt(v) + eps * bc2_sqrt)`, the same value in exact
//! arithmetic with one multiplication fewer per element, and the kernel's parameter list stays
//! within twelve while every coefficient (`b1` and `1 - b1`, `b2` and `1 - b2`) is the f32
//! rounding of its f64 value. (Deriving `1 - b2` on the device from an f32 `b2 = 0.999` would be
//! off by 1.3e-5 relative, 200 f32 ulps.)
//!
//! Dtypes: parameters and gradients are f32, f16 or bf16 (one dtype); the moments `m` and `v`
//! are f32 whatever the parameters' dtype, and every element is computed in f32 and rounded once
//! to the parameter's dtype. Keeping the moments in f32 is what keeps low-precision training
//! stable: `v` spans many orders of magnitude and its updates `(1 - b2) g^2` are a thousandth of
//! it, below half a bf16 ulp (2^-9 relative), so a bf16 `v` would stop moving. PyTorch keeps the
//! states in the parameters' dtype (`torch.optim.AdamW` on bf16 parameters has bf16 `exp_avg`
//! and `exp_avg_sq`); ours cost 8 more bytes per element for f16/bf16 parameters.
//!
//! Memory pattern: the element-wise grid-stride loop of `elementwise.rs` (16-byte vectors of
//! the parameter's dtype, several per thread in flight, then the tail one element per thread).
//! A vector of `VEC` parameters pairs with `VEC / 4` 16-byte vectors of each moment; every
//! element of `p`, `g`, `m`, `v` is read once and `p`, `m`, `v` written once. Tensors are whole
//! allocations (16-byte aligned) and an element offset that is a multiple of `VEC` is 16-byte
//! aligned in every one of them, so every whole vector is loaded with one instruction. `p`, `m`
//! and `v` are updated in place and so read through the coherent path; `g` through `.nc`.

use crate::kernel::Kernel;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::KernelEntry;

/// `(p, g, m, v, n, lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, eps)`:
/// one AdamW step over `n` elements, in place on `p` (dtype `T`), `m` and `v` (f32); `g` (`T`) is
/// only read. The scalars are those of [`AdamWScalars`], in its field order.
pub type AdamWArgs<T> = (*mut T, *const T, *mut f32, *mut f32, u64, f32, f32, f32, f32, f32, f32, f32);

/// Parameter vectors each thread loads per round of its grid-stride loop (the host sizes the
/// grid with it). A parameter vector comes with its gradient and `VEC / 4` vectors of each
/// moment: 64 bytes for f32, 96 for f16/bf16, so one or two per round keep 96-128 bytes per
/// thread in flight, as the element-wise kernels do, in fewer registers (four f32 rounds took
/// 144 registers: one block of 256 threads per SM).
pub const fn unroll(dt: crate::DType) -> usize {
    match dt {
        crate::DType::F32 => 2,
        crate::DType::F16 | crate::DType::BF16 => 1,
    }
}

/// The per-step constants of an AdamW update, each the f32 rounding of its f64 value. With
/// `bc1 = 1 - beta1^t`, `bc2_sqrt = sqrt(1 - beta2^t)`:
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    /// `lr * weight_decay`.
    pub lr_wd: f32,
    /// The first moment's decay.
    pub beta1: f32,
    /// `1 - beta1`, rounded once on the host.
    pub one_minus_beta1: f32,
    /// The second moment's decay.
    pub beta2: f32,
    /// `1 - beta2`, rounded once on the host.
    pub one_minus_beta2: f32,
    /// `lr * bc2_sqrt / bc1`.
    pub step_size: f32,
    /// `eps * bc2_sqrt`.
    pub eps: f32,
}

/// One element's update: `(p, m, v)` after the step, in f32 (`p` before rounding to its
/// dtype). The kernels run exactly this; the host tests run it on the CPU.
///
/// Rounding, in order: `p * (1 - lr_wd)` as one fma; `m` and `v` as one fma each after the
/// product by `1 - beta` (`v`'s as `((1 - b2) * g) * g`, which overflows later than `g * g`);
/// `sqrt` correctly rounded; a correctly rounded division; the update as one fma.
/// NaN and infinities propagate as IEEE arithmetic does (a NaN or infinite gradient gives NaN
/// parameters, as in PyTorch). A `-0.0` parameter may come out `+0.0`, also as in PyTorch.
#[inline(always)]
pub fn adamw_update(p: f32, g: f32, m: f32, v: f32, s: &AdamWScalars) -> (f32, f32, f32) {
    use crate::math::{fma, sqrt};
    let p = fma(-s.lr_wd, p, p);
    let m = fma(s.beta1, m, s.one_minus_beta1 * g);
    let v = fma(s.beta2, v, (s.one_minus_beta2 * g) * g);
    let p = fma(-s.step_size, m / (sqrt(v) + s.eps), p);
    (p, m, v)
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::{Elem, for_lanes};
    use crate::elementwise::grid_stride_by;
    use crate::prim::*;

    /// `VEC` consecutive f32 moments from `q` (16-byte aligned): one or two 16-byte loads, as raw
    /// words (unpacked on use, which keeps a round's loads together).
    #[inline(always)]
    unsafe fn load_f32<T: Elem>(q: *const f32) -> [[u32; 4]; 2] {
        // SAFETY: the caller passes `VEC` floats inside the buffer, 16-byte aligned. Coherent
        // loads: this launch writes the same buffer.
        unsafe {
            let a = ld_global_v4(q as *const u32);
            let b = if T::VEC == 8 { ld_global_v4(q.add(4) as *const u32) } else { [0; 4] };
            [a, b]
        }
    }

    #[inline(always)]
    unsafe fn store_f32<T: Elem>(q: *mut f32, v: &[f32; 8]) {
        // SAFETY: as `load_f32`.
        unsafe {
            st_global_v4(q as *mut u32, [v[0].to_bits(), v[1].to_bits(), v[2].to_bits(), v[3].to_bits()]);
            if T::VEC == 8 {
                st_global_v4(q.add(4) as *mut u32, [v[4].to_bits(), v[5].to_bits(), v[6].to_bits(), v[7].to_bits()]);
            }
        }
    }

    #[inline(always)]
    fn unpack_f32(r: [[u32; 4]; 2]) -> [f32; 8] {
        let f = f32::from_bits;
        [f(r[0][0]), f(r[0][1]), f(r[0][2]), f(r[0][3]), f(r[1][0]), f(r[1][1]), f(r[1][2]), f(r[1][3])]
    }

    #[allow(clippy::too_many_arguments)]
    pub unsafe fn adamw_step<T: Elem>(
        p: *mut T,
        g: *const T,
        m: *mut f32,
        v: *mut f32,
        n: u64,
        lr_wd: f32,
        beta1: f32,
        one_minus_beta1: f32,
        beta2: f32,
        one_minus_beta2: f32,
        step_size: f32,
        eps: f32,
    ) {
        let s = AdamWScalars { lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, eps };
        // SAFETY: the host passes four distinct tensors of n elements each (whole allocations,
        // 16-byte aligned); grid_stride hands out offsets of whole vectors of T below n (whose
        // VEC moments are then whole, aligned f32 vectors) and tail indices below n.
        unsafe {
            grid_stride_by::<T, _>(
                n,
                unroll(T::DTYPE),
                #[inline(always)]
                |o| {
                    (
                        ld_global_v4(p.add(o) as *const u32),
                        ld_global_nc_v4(g.add(o) as *const u32),
                        load_f32::<T>(m.add(o)),
                        load_f32::<T>(v.add(o)),
                    )
                },
                #[inline(always)]
                |o, (rp, rg, rm, rv)| {
                    let (mut vp, vg, mut vm, mut vv) = (T::unpack(rp), T::unpack(rg), unpack_f32(rm), unpack_f32(rv));
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| (vp[k], vm[k], vv[k]) = adamw_update(vp[k], vg[k], vm[k], vv[k], &s),
                    );
                    st_global_v4(p.add(o) as *mut u32, T::pack(&vp));
                    store_f32::<T>(m.add(o), &vm);
                    store_f32::<T>(v.add(o), &vv);
                },
                #[inline(always)]
                |i| {
                    let (np, nm, nv) =
                        adamw_update((*p.add(i)).to_f32(), (*g.add(i)).to_f32(), *m.add(i), *v.add(i), &s);
                    *p.add(i) = T::from_f32(np);
                    *m.add(i) = nm;
                    *v.add(i) = nv;
                },
            )
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

// --- the kernels: `adamw_step_<dtype>` ---------------------------------------------------------

macro_rules! optim_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<adamw_step_ $sfx>]: AdamWArgs<$T> =
                |p, g, m, v, n, lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, eps|
                adamw_step::<$T>(p, g, m, v, n, lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, eps));
            #[cfg(not(target_arch = "nvptx64"))]
            impl AdamWElem for $T {
                const ADAMW: Kernel<AdamWArgs<$T>> = [<adamw_step_ $sfx>];
            }
        }
    };
}
crate::for_each_elem!(optim_kernels);

/// A storage type's AdamW kernel, typed.
pub trait AdamWElem: crate::Elem {
    /// `adamw_step_<dt>` for `Self`.
    const ADAMW: Kernel<AdamWArgs<Self>>;
}

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    use crate::dtype::{BF16, F16};
    [f32::ADAMW.entry(), F16::ADAMW.entry(), BF16::ADAMW.entry()].into_iter()
}
