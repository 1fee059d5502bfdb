//! Strided gathers and their reductions, the general ground under broadcasting and permutes:
//! `strided_copy` writes a contiguous tensor of a given shape from a source read at any element
//! strides (0 repeats an element: a broadcast dimension; permuted strides: a permute), and
//! `sum_to` sums a contiguous tensor over some dimensions into the shape with those
//! dimensions 1 (the gradient of a broadcast). One element a thread; `sum_to` adds in the same
//! order every run, in f32, and rounds once.

use crate::kernel::Kernel;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::KernelEntry;

/// The largest rank of a strided launch.
pub const MAX_RANK: usize = 8;
const _: () = assert!(MAX_RANK == 8, "offset() unrolls eight dimensions");

/// The geometry of a [`strided_copy`](StridedArgs): the output's shape (row-major, contiguous)
/// and, per output dimension, the source's element stride (0 for a broadcast dimension). Unused
/// dimensions (past `rank`) are 1 with stride 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedGeom {
    /// Dimensions in use.
    pub rank: u32,
    /// Padding, 0.
    pub pad: u32,
    /// The output's shape.
    pub shape: [u64; MAX_RANK],
    /// The source's element strides.
    pub strides: [u64; MAX_RANK],
}

/// A kernel parameter: a plain `#[repr(C)]` value of integers, 8-byte aligned.
impl crate::kernel::Param for StridedGeom {}

/// The geometry of a [`sum_to`](SumToArgs): the input's shape `full` (contiguous), the output's
/// (`full` with the summed dimensions 1), and the input's row-major strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SumToGeom {
    /// Dimensions in use.
    pub rank: u32,
    /// Padding, 0.
    pub pad: u32,
    /// The output's shape: `full` with the summed dimensions 1.
    pub kept: [u64; MAX_RANK],
    /// The summed dimensions' sizes, 1 elsewhere.
    pub summed: [u64; MAX_RANK],
    /// The input's row-major element strides.
    pub strides: [u64; MAX_RANK],
}

/// A kernel parameter, as [`StridedGeom`].
impl crate::kernel::Param for SumToGeom {}

/// `(x, out, geom, n)`: `out[i] = x[offset(i)]` for the `n` elements of `geom.shape`.
pub type StridedArgs<T> = (*const T, *mut T, StridedGeom, u64);
/// `(x, out, geom, n)`: `out[j]` = the sum of `x` over the summed dimensions at `j`'s kept
/// index, for the `n` elements of `geom.kept`.
pub type SumToArgs<T> = (*const T, *mut T, SumToGeom, u64);

/// The source offset of the flat index `i` of `shape`, reading `strides`: the row-major
/// multi-index of `i` dotted with the strides (host and device alike). The loop runs over the
/// constant `MAX_RANK` (unrolled: constant indices keep the kernel parameter out of a stack
/// frame) and skips the dimensions past `rank`.
#[inline(always)]
#[allow(unused_assignments)] // the last dimension's `i /= n`
pub fn offset(mut i: u64, rank: u32, shape: &[u64; MAX_RANK], strides: &[u64; MAX_RANK]) -> u64 {
    let mut off = 0;
    macro_rules! dim {
        ($d:expr) => {
            if ($d as u32) < rank {
                let n = shape[$d];
                off += (i % n) * strides[$d];
                i /= n;
            }
        };
    }
    dim!(7);
    dim!(6);
    dim!(5);
    dim!(4);
    dim!(3);
    dim!(2);
    dim!(1);
    dim!(0);
    off
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::Elem;
    use crate::prim::*;

    /// # Safety
    /// `x` is readable at every offset `geom` gives for `i < n`; `out` holds `n` elements.
    #[inline(always)]
    pub unsafe fn strided_copy<T: Elem>(x: *const T, out: *mut T, g: StridedGeom, n: u64) {
        let mut i = global_thread_x();
        let step = grid_threads_x();
        while i < n {
            let off = offset(i, g.rank, &g.shape, &g.strides);
            // SAFETY: the function contract.
            unsafe { *out.add(i as usize) = *x.add(off as usize) };
            i += step;
        }
    }

    /// # Safety
    /// `x` holds the elements of `kept * summed` (its shape), `out` the `n` of `kept`.
    #[inline(always)]
    pub unsafe fn sum_to<T: Elem>(x: *const T, out: *mut T, g: SumToGeom, n: u64) {
        // Unused dimensions are 1: the product over all of them is the summed count.
        let per = g.summed.iter().product::<u64>();
        let mut j = global_thread_x();
        let step = grid_threads_x();
        while j < n {
            let base = offset(j, g.rank, &g.kept, &g.strides);
            let mut acc = 0.0f32;
            let mut k = 0;
            while k < per {
                let off = base + offset(k, g.rank, &g.summed, &g.strides);
                // SAFETY: the function contract; `off` indexes `x`'s shape.
                acc += unsafe { *x.add(off as usize) }.to_f32();
                k += 1;
            }
            // SAFETY: j < n.
            unsafe { *out.add(j as usize) = T::from_f32(acc) };
            j += step;
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

/// A storage type's strided kernels, typed.
pub trait StridedElem: crate::Elem {
    /// `strided_copy_<dtype>`.
    const COPY: Kernel<StridedArgs<Self>>;
    /// `sum_to_<dtype>`.
    const SUM_TO: Kernel<SumToArgs<Self>>;
}

macro_rules! strided_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<strided_copy_ $sfx>]: StridedArgs<$T> = |x, out, g, n|
                strided_copy::<$T>(x, out, g, n));
            $crate::kernel!([<sum_to_ $sfx>]: SumToArgs<$T> = |x, out, g, n| sum_to::<$T>(x, out, g, n));
            #[cfg(not(target_arch = "nvptx64"))]
            impl StridedElem for $T {
                const COPY: Kernel<StridedArgs<$T>> = [<strided_copy_ $sfx>];
                const SUM_TO: Kernel<SumToArgs<$T>> = [<sum_to_ $sfx>];
            }
        }
    };
}
crate::for_each_elem!(strided_kernels);

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    use crate::dtype::{BF16, F16};
    [
        f32::COPY.entry(),
        F16::COPY.entry(),
        BF16::COPY.entry(),
        f32::SUM_TO.entry(),
        F16::SUM_TO.entry(),
        BF16::SUM_TO.entry(),
    ]
    .into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec;
    use std::vec::Vec;

    fn pad(v: &[u64], fill: u64) -> [u64; MAX_RANK] {
        let mut a = [fill; MAX_RANK];
        a[..v.len()].copy_from_slice(v);
        a
    }

    #[test]
    fn offsets_follow_the_strides() {
        // A [2, 3] source read as [4, 2, 3] with the first dimension broadcast.
        let (shape, strides) = (pad(&[4, 2, 3], 1), pad(&[0, 3, 1], 0));
        let got: Vec<u64> = (0..24).map(|i| offset(i, 3, &shape, &strides)).collect();
        let want: Vec<u64> = (0..24).map(|i| i % 6).collect();
        assert_eq!(got, want);
        // A [2, 3] source permuted to [3, 2]: element (i, j) is source (j, i).
        let (shape, strides) = (pad(&[3, 2], 1), pad(&[1, 3], 0));
        let got: Vec<u64> = (0..6).map(|i| offset(i, 2, &shape, &strides)).collect();
        assert_eq!(got, vec![0, 3, 1, 4, 2, 5]);
        assert_eq!(offset(0, 0, &pad(&[], 1), &pad(&[], 0)), 0);
    }

    #[test]
    fn sum_to_covers_each_input_once() {
        // [2, 3, 4] summed over dimensions 0 and 2 into [1, 3, 1].
        let g = SumToGeom {
            rank: 3,
            pad: 0,
            kept: pad(&[1, 3, 1], 1),
            summed: pad(&[2, 1, 4], 1),
            strides: pad(&[12, 4, 1], 0),
        };
        let mut seen = [0; 24];
        for j in 0..3 {
            let base = offset(j, g.rank, &g.kept, &g.strides);
            for k in 0..8 {
                let off = base + offset(k, g.rank, &g.summed, &g.strides);
                assert_eq!((off / 4) % 3, j, "element {off} summed into {j}");
                seen[off as usize] += 1;
            }
        }
        assert!(seen.iter().all(|&s| s == 1));
    }
}
