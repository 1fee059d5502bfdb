//! Casts between the storage types: `y[i] = x[i]` converted, rounded to nearest even, infinities
//! and signed zeros kept, a NaN staying a NaN (its payload is the hardware's). Widening (f16 or
//! bf16 to f32) is exact; f16 <-> bf16 widens to f32 first, which is exact, so it rounds once.

/// `(x, y, n)`: `y[i] = x[i]` converted, for `i < n`.
pub type CastArgs<S, D> = (*const S, *mut D, u64);

/// Elements a thread converts at a time: one 16-byte vector of f16 or bf16, two of f32.
pub const GROUP: u64 = 8;

/// The kernel casting `Self` into `D`, typed: `None` when they are the same type (there is no
/// kernel for that: the host shares the tensor instead). Set by the declaration below.
pub trait CastKernel<D: 'static>: Sized + 'static {
    /// `cast_<Self>_to_<D>`, or `None` for `D = Self`.
    const KERNEL: Option<crate::kernel::Kernel<CastArgs<Self, D>>>;
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::GROUP;
    use crate::dtype::Elem;
    use crate::prim::*;

    /// [`GROUP`] elements of `T` from `p` into f32 lanes: one 16-byte load, or two for f32.
    ///
    /// # Safety
    /// `p` is 16-byte aligned and the first of `GROUP` readable elements.
    #[inline(always)]
    unsafe fn load_group<T: Elem>(p: *const T) -> [f32; 8] {
        // SAFETY: per the function contract; the second load (f32 only) is bytes 16..32 of it.
        let lo = T::unpack(unsafe { ld_global_nc_v4(p as *const u32) });
        if T::VEC == 8 {
            return lo;
        }
        let hi = T::unpack(unsafe { ld_global_nc_v4(p.add(T::VEC) as *const u32) });
        [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]
    }

    /// Stores `v` as [`GROUP`] elements of `T` at `p`: one 16-byte store, or two for f32.
    ///
    /// # Safety
    /// `p` is 16-byte aligned and the first of `GROUP` writable elements.
    #[inline(always)]
    unsafe fn store_group<T: Elem>(p: *mut T, v: [f32; 8]) {
        // SAFETY: per the function contract; `pack` takes the first `T::VEC` lanes.
        unsafe { st_global_v4(p as *mut u32, T::pack(&v)) };
        if T::VEC == 4 {
            let hi = [v[4], v[5], v[6], v[7], 0.0, 0.0, 0.0, 0.0];
            // SAFETY: bytes 16..32 of the group.
            unsafe { st_global_v4(p.add(T::VEC) as *mut u32, T::pack(&hi)) };
        }
    }

    /// A grid-stride loop over whole groups; the tail (`n % GROUP` elements) one a thread.
    pub unsafe fn cast<S: Elem, D: Elem>(x: *const S, y: *mut D, n: u64) {
        let groups = n / GROUP;
        let mut i = global_thread_x();
        while i < groups {
            let at = (i * GROUP) as usize;
            // SAFETY: group i lies inside x and y (n elements each); allocations are 16-byte
            // aligned and a group is 16 or 32 bytes.
            unsafe { store_group(y.add(at), load_group(x.add(at))) };
            i += grid_threads_x();
        }
        let t = groups * GROUP + global_thread_x();
        if t < n {
            // SAFETY: t < n.
            unsafe { *y.add(t as usize) = D::from_f32((*x.add(t as usize)).to_f32()) };
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

// The instances: every ordered pair of distinct storage types.
macro_rules! cast_kernels {
    ($($name:ident: $S:ty => $D:ty;)*) => {
        $(
            crate::kernel!($name: CastArgs<$S, $D> = |x, y, n| cast::<$S, $D>(x, y, n));
            #[cfg(not(target_arch = "nvptx64"))]
            impl CastKernel<$D> for $S {
                const KERNEL: Option<crate::kernel::Kernel<CastArgs<$S, $D>>> = Some($name);
            }
        )*
        /// Every kernel of the family: its name and arity (for the test against the PTX).
        #[cfg(not(target_arch = "nvptx64"))]
        pub fn all_kernels() -> impl Iterator<Item = crate::kernel::KernelEntry> {
            [$($name.entry()),*].into_iter()
        }
    };
}
cast_kernels! {
    cast_f32_to_f16: f32 => crate::F16;
    cast_f32_to_bf16: f32 => crate::BF16;
    cast_f16_to_f32: crate::F16 => f32;
    cast_f16_to_bf16: crate::F16 => crate::BF16;
    cast_bf16_to_f32: crate::BF16 => f32;
    cast_bf16_to_f16: crate::BF16 => crate::F16;
}

// A type into itself: no kernel.
macro_rules! no_cast {
    ($T:ty, $sfx:ident) => {
        #[cfg(not(target_arch = "nvptx64"))]
        impl CastKernel<$T> for $T {
            const KERNEL: Option<crate::kernel::Kernel<CastArgs<$T, $T>>> = None;
        }
    };
}
crate::for_each_elem!(no_cast);
