//! Gated activations: `y = act(a) * b` over rows of `F` elements (SwiGLU with SiLU, GeGLU with
//! GELU, GLU with the sigmoid, ReGLU with ReLU; any activation of the op table), forward and
//! backward, from one fused input `[.., 2F]` (`a` its first half, `b` its second, as PyTorch's
//! `F.glu` splits) or from two tensors `[.., F]`.
//!
//! One kernel serves both layouts: `a` and `b` are pointers into rows of `ld` elements (`2F` for
//! the fused input, where `b = a + F`; `F` for two tensors), the output and the incoming
//! gradient rows of `F`, and the backward's `da` and `db` rows of `ld` again (the fused input's
//! gradient is `[.., 2F]` in the same layout).
//!
//! Memory pattern: bound by bandwidth like the other element-wise kernels. A 2-D grid: block
//! `(bx, by)` of 256 threads, thread `x` of the grid takes the 16-byte vector `x` of each of its
//! rows, rows `y, y + grid_y * by, ...` (no division per vector, which a flat index over
//! `[rows, F]` would need). Where `F` is a multiple of the vector width every row, and the fused
//! input's second half, starts 16-byte aligned: one 16-byte load of `a`, of `b` and one store a
//! thread and row. Otherwise the same vector's lanes are moved one element at a time.

use crate::dtype::Elem;
#[cfg(target_arch = "nvptx64")]
use crate::dtype::for_lanes;
use crate::ops::{UnaryFn, bwd_for, fwd_for};

/// Forward: `(a, b, y, rows, cols, ld, p0, p1)`: `y[r * cols + c] = act(a[r * ld + c]; p0, p1) *
/// b[r * ld + c]` for `r < rows`, `c < cols`.
pub type GluFwdArgs<T> = (*const T, *const T, *mut T, u64, u64, u64, f32, f32);
/// Backward: `(a, b, g, da, db, rows, cols, ld, p0, p1)`: with `i = r * ld + c`,
/// `da[i] = g[r * cols + c] * b[i] * act'(a[i])`, `db[i] = g[r * cols + c] * act(a[i])`.
pub type GluBwdArgs<T> = (*const T, *const T, *const T, *mut T, *mut T, u64, u64, u64, f32, f32);

/// Threads a block of the gated kernels (`bx * by`).
pub const GLU_BLOCK: u32 = 256;

/// One element of the forward in f32 (storage type `T`: f16/bf16 use the activation's
/// `fwd_half`): `act(a) * b`.
#[inline(always)]
pub fn fwd_one<T: Elem, O: UnaryFn>(a: f32, b: f32, p0: f32, p1: f32) -> f32 {
    fwd_for::<O, T>(a, p0, p1) * b
}

/// One element of the backward, `(da, db)`: `act'(a) * (g b)` and `g act(a)`, in the order of
/// PyTorch's autograd of `act(a) * b` (the product's gradient `g b` first, then the activation's
/// backward). Where `g b` overflows but `g` and `b` are finite, `act'(a) g` is taken first and
/// then times `b`: the activations' backward is linear in the gradient, and a derivative of 0
/// (far in the tails) then gives the exact 0, not `inf * 0`.
#[inline(always)]
pub fn bwd_one<T: Elem, O: UnaryFn>(a: f32, b: f32, g: f32, p0: f32, p1: f32) -> (f32, f32) {
    let gb = g * b;
    let da = if gb.is_infinite() && g.is_finite() && b.is_finite() {
        bwd_for::<O, T>(a, g, p0, p1) * b
    } else {
        bwd_for::<O, T>(a, gb, p0, p1)
    };
    (da, g * fwd_for::<O, T>(a, p0, p1))
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::prim::*;

    #[inline(always)]
    unsafe fn load<T: Elem>(p: *const T) -> [f32; 8] {
        // SAFETY: callers pass a whole vector inside the tensor, 16-byte aligned (rows of a
        // multiple of the vector width in 16-byte aligned allocations). Nothing the launch
        // writes is read (the host never passes an output that overlaps an input).
        unsafe { T::unpack(ld_global_nc_v4(p as *const u32)) }
    }

    #[inline(always)]
    unsafe fn store<T: Elem>(p: *mut T, v: &[f32; 8]) {
        // SAFETY: as `load`.
        unsafe { st_global_v4(p as *mut u32, T::pack(v)) }
    }

    /// Calls `f(r, c0)` for each row `r` of this thread and its vector's first column `c0`
    /// (below `cols`), where the vector is thread `x` of the grid's.
    #[inline(always)]
    fn each_row<T: Elem>(rows: u64, cols: u64, mut f: impl FnMut(u64, u64)) {
        let w = T::VEC as u64;
        let c0 = (block_idx_x() as u64 * block_dim_x() as u64 + thread_idx_x() as u64) * w;
        if c0 >= cols {
            return;
        }
        let by = block_dim_y() as u64;
        let mut r = block_idx_y() as u64 * by + thread_idx_y() as u64;
        let step = grid_dim_y() as u64 * by;
        while r < rows {
            f(r, c0);
            r += step;
        }
    }

    // SAFETY (both kernels): the host launches a grid whose x threads cover `ceil(cols / VEC)`
    // vectors, passes `a`, `b` (and `da`, `db`) valid for `rows` rows of `ld >= cols` elements
    // and `y` (`g`) for `rows * cols`; every index below is `r * ld + c` or `r * cols + c` with
    // `r < rows`, `c < cols`.

    pub unsafe fn glu_fwd<T: Elem, O: UnaryFn>(
        a: *const T,
        b: *const T,
        y: *mut T,
        rows: u64,
        cols: u64,
        ld: u64,
        p0: f32,
        p1: f32,
    ) {
        let w = T::VEC as u64;
        if cols.is_multiple_of(w) {
            each_row::<T>(
                rows,
                cols,
                // SAFETY: see above; `c` is a multiple of the vector width below `cols`, so
                // the vector is whole and 16-byte aligned.
                #[inline(always)]
                |r, c| unsafe {
                    let i = (r * ld + c) as usize;
                    let (va, vb) = (load(a.add(i)), load(b.add(i)));
                    let mut v = [0.0f32; 8];
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| v[k] = fwd_one::<T, O>(va[k], vb[k], p0, p1),
                    );
                    store(y.add((r * cols + c) as usize), &v);
                },
            );
        } else {
            each_row::<T>(
                rows,
                cols,
                #[inline(always)]
                |r, c0| {
                    for k in 0..w {
                        let c = c0 + k;
                        if c < cols {
                            let i = (r * ld + c) as usize;
                            // SAFETY: see above.
                            unsafe {
                                let (va, vb) = ((*a.add(i)).to_f32(), (*b.add(i)).to_f32());
                                *y.add((r * cols + c) as usize) = T::from_f32(fwd_one::<T, O>(va, vb, p0, p1));
                            }
                        }
                    }
                },
            );
        }
    }

    pub unsafe fn glu_bwd<T: Elem, O: UnaryFn>(
        a: *const T,
        b: *const T,
        g: *const T,
        da: *mut T,
        db: *mut T,
        rows: u64,
        cols: u64,
        ld: u64,
        p0: f32,
        p1: f32,
    ) {
        let w = T::VEC as u64;
        if cols.is_multiple_of(w) {
            each_row::<T>(
                rows,
                cols,
                // SAFETY: see above; `c` is a multiple of the vector width below `cols`, so
                // the vector is whole and 16-byte aligned.
                #[inline(always)]
                |r, c| unsafe {
                    let i = (r * ld + c) as usize;
                    let (va, vb, vg) = (load(a.add(i)), load(b.add(i)), load(g.add((r * cols + c) as usize)));
                    let (mut ra, mut rb) = ([0.0f32; 8], [0.0f32; 8]);
                    for_lanes::<T>(
                        #[inline(always)]
                        |k| (ra[k], rb[k]) = bwd_one::<T, O>(va[k], vb[k], vg[k], p0, p1),
                    );
                    store(da.add(i), &ra);
                    store(db.add(i), &rb);
                },
            );
        } else {
            each_row::<T>(
                rows,
                cols,
                #[inline(always)]
                |r, c0| {
                    for k in 0..w {
                        let c = c0 + k;
                        if c < cols {
                            let i = (r * ld + c) as usize;
                            // SAFETY: see above.
                            unsafe {
                                let (va, vb) = ((*a.add(i)).to_f32(), (*b.add(i)).to_f32());
                                let vg = (*g.add((r * cols + c) as usize)).to_f32();
                                let (ga, gb) = bwd_one::<T, O>(va, vb, vg, p0, p1);
                                *da.add(i) = T::from_f32(ga);
                                *db.add(i) = T::from_f32(gb);
                            }
                        }
                    }
                },
            );
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

// --- the host's handles ---------------------------------------------------------------------

use crate::kernel::Kernel;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::KernelEntry;
#[cfg(not(target_arch = "nvptx64"))]
use crate::ops::Activation;

/// An activation's gated kernels of storage type `T` ([`crate::ops::Activation::glu_kernels`]).
#[derive(Clone, Copy, Debug)]
pub struct GluKernels<T> {
    /// `glu_<act>_fwd_<dtype>`.
    pub fwd: Kernel<GluFwdArgs<T>>,
    /// `glu_<act>_bwd_<dtype>`.
    pub bwd: Kernel<GluBwdArgs<T>>,
}

/// A storage type's gated kernels, by activation (declared below from the activation list).
#[cfg(not(target_arch = "nvptx64"))]
pub trait GluElem: Elem {
    /// The gated kernels of `act`.
    fn glu(act: Activation) -> GluKernels<Self>;
}

#[cfg(not(target_arch = "nvptx64"))]
impl Activation {
    /// The gated `act(a) * b` kernels of the activation in storage type `T`.
    pub fn glu_kernels<T: GluElem>(self) -> GluKernels<T> {
        T::glu(self)
    }
}

// The kernels' f32 formulas, run here (the CPU tests use them).
macro_rules! glu_f32 {
    ($($op:ident $O:ident),* $(,)?) => {
        #[cfg(not(target_arch = "nvptx64"))]
        impl Activation {
            /// The gated forward's f32 formula ([`fwd_one`]) with the kernel's parameters `p0`, `p1`.
            pub fn glu_fwd_f32(self, a: f32, b: f32, p0: f32, p1: f32) -> f32 {
                match self { $(Activation::$O => fwd_one::<f32, crate::ops::$O>(a, b, p0, p1)),* }
            }
            /// The gated backward's f32 formula ([`bwd_one`]): `(da, db)`.
            pub fn glu_bwd_f32(self, a: f32, b: f32, g: f32, p0: f32, p1: f32) -> (f32, f32) {
                match self { $(Activation::$O => bwd_one::<f32, crate::ops::$O>(a, b, g, p0, p1)),* }
            }
        }
    };
}
crate::activation_list!(glu_f32);

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    fn of<T: GluElem>() -> impl Iterator<Item = KernelEntry> {
        Activation::ALL.iter().flat_map(|&a| {
            let k = a.glu_kernels::<T>();
            [k.fwd.entry(), k.bwd.entry()]
        })
    }
    of::<f32>().chain(of::<crate::F16>()).chain(of::<crate::BF16>())
}

macro_rules! glu_kernels {
    ($($op:ident $O:ident),* $(,)?) => {
        $( $crate::for_each_elem!(glu_kernels, $op, $O); )*
        $crate::for_each_elem!(glu_kernels, [$($op $O)*]);
    };
    ($T:ty, $sfx:ident, [$($op:ident $O:ident)*]) => {
        paste::paste! {
            #[cfg(not(target_arch = "nvptx64"))]
            impl GluElem for $T {
                fn glu(act: Activation) -> GluKernels<$T> {
                    match act {
                        $(Activation::$O => GluKernels {
                            fwd: [<glu_ $op _fwd_ $sfx>],
                            bwd: [<glu_ $op _bwd_ $sfx>],
                        },)*
                    }
                }
            }
        }
    };
    ($T:ty, $sfx:ident, $op:ident, $O:ident) => {
        paste::paste! {
            $crate::kernel!([<glu_ $op _fwd_ $sfx>]: GluFwdArgs<$T> = |a, b, y, rows, cols, ld, p0, p1|
                glu_fwd::<$T, crate::ops::$O>(a, b, y, rows, cols, ld, p0, p1));
            $crate::kernel!([<glu_ $op _bwd_ $sfx>]: GluBwdArgs<$T> = |a, b, g, da, db, rows, cols, ld, p0, p1|
                glu_bwd::<$T, crate::ops::$O>(a, b, g, da, db, rows, cols, ld, p0, p1));
        }
    };
}
crate::activation_list!(glu_kernels);
