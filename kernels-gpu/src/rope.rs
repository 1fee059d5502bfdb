//! Rotary position embedding (RoPE): each pair `(a, b)` of a row of `x` at position `p` is rotated
//! by the angle of `p` and the pair's frequency, `(a c - b s, b c + a s)` with `c = cos[p, i]`,
//! `s = sin[p, i]` read from f32 tables `[max_pos, R / 2]` (`R` the rotary dimension, the first `R`
//! of the row's `D` elements; the rest pass through). The pairs are `(i, i + R / 2)` (the
//! half-rotation of GPT-NeoX and LLaMA) or `(2 i, 2 i + 1)` (interleaved, GPT-J). The backward is
//! the rotation by the opposite angle: the same kernel with `s` negated (`sign = -1`).
//!
//! Memory pattern: one pass, each element read and written once. A thread handles one work item
//! of a row: on the vector path ([`vector_path`]: rows, the two halves or the interleaved pairs
//! on 16-byte boundaries) 16 bytes of each half (half-rotation) or one 16-byte vector
//! (interleaved), or a vector of the pass-through part; elsewhere one pair, or one element of the
//! pass-through part. The items of all rows are one index space walked by a grid-stride loop.
//! A row's position is `offset + (r / inner) % seq`, with `inner` 1 for `[B, H, S, D]` and `H`
//! for `[B, S, H, D]`. In place (`x == y`) the pass-through part is not touched, and `x` is read
//! through the coherent path (the same launch writes it).

use crate::DType;
use crate::kernel::Kernel;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::KernelEntry;

/// `(x, y, cos, sin, rows, d, rot, seq, inner, offset, interleaved, sign)`: rotates `rows` rows
/// of `d` elements of `x` into `y` (or in place, `x == y`): row `r` at position `offset + (r /
/// inner) % seq`, its first `rot` elements in pairs (`interleaved` 0: `(i, i + rot / 2)`, 1:
/// `(2 i, 2 i + 1)`) by the tables `cos`, `sin` (f32, `rot / 2` a position) with the sine times
/// `sign`; the other `d - rot` elements copied. `rot` even, at least 2, at most `d`; `seq` and
/// `inner` at least 1; the tables hold the rows' positions; all 16-byte aligned (whole
/// allocations).
pub type RopeArgs<T> = (*const T, *mut T, *const f32, *const f32, u64, u64, u64, u64, u64, u64, u32, f32);

/// Elements of `dt` in one 16-byte vector.
pub const fn vec_width(dt: DType) -> u64 {
    16 / dt.size() as u64
}

/// Whether rows of `d` elements of `dt` rotated over their first `rot` take the vector path:
/// every row starts on a 16-byte boundary, and so do the second half (half-rotation: `rot / 2`
/// a multiple of the vector width) or the pass-through part (interleaved: `rot` a multiple), and
/// the tables' rows (`rot / 2` f32 a position: a multiple of 4 in the first case, of 2 in the
/// second, which the interleaved path reads 8 bytes at a time for f32).
pub const fn vector_path(dt: DType, d: u64, rot: u64, interleaved: bool) -> bool {
    let v = vec_width(dt);
    d.is_multiple_of(v) && if interleaved { rot.is_multiple_of(v) } else { (rot / 2).is_multiple_of(v) }
}

/// The work items of one row: `(rotation, pass-through)`. Vector path: 16 bytes of each half per
/// item (half-rotation) or one vector of pairs (interleaved), and a vector of the rest; else one
/// pair, and one element of the rest. In place the pass-through items are not launched.
pub const fn items(dt: DType, d: u64, rot: u64, interleaved: bool) -> (u64, u64) {
    let rest = d.saturating_sub(rot);
    if !vector_path(dt, d, rot, interleaved) {
        return (rot / 2, rest);
    }
    let v = vec_width(dt);
    (if interleaved { rot / v } else { rot / 2 / v }, rest / v)
}

/// The rotation of one pair in f32, the kernel's formula: `(a c - b s, b c + a s)`, each product
/// and sum rounded once (no fused multiply-add; the host build computes the same bits).
#[inline(always)]
pub fn rotate(a: f32, b: f32, c: f32, s: f32) -> (f32, f32) {
    (a * c - b * s, b * c + a * s)
}

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::{Elem, for_lanes};
    use crate::prim::*;

    /// `n` (2, 4 or 8: a constant after inlining) f32 of a table from `p`, in the first lanes.
    ///
    /// # Safety
    /// `p` is aligned to `4 n` bytes (16 for `n = 8`) and the first of `n` readable f32 that this
    /// launch does not write.
    #[inline(always)]
    unsafe fn load_table(p: *const f32, n: usize) -> [f32; 8] {
        let f = f32::from_bits;
        // SAFETY: per the function contract (for n = 8 the second load is bytes 16..32).
        unsafe {
            if n == 2 {
                let w = ld_global_v2(p as *const u32);
                return [f(w[0]), f(w[1]), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
            }
            let lo = ld_global_nc_v4(p as *const u32);
            if n == 4 {
                return [f(lo[0]), f(lo[1]), f(lo[2]), f(lo[3]), 0.0, 0.0, 0.0, 0.0];
            }
            let hi = ld_global_nc_v4(p.add(4) as *const u32);
            [f(lo[0]), f(lo[1]), f(lo[2]), f(lo[3]), f(hi[0]), f(hi[1]), f(hi[2]), f(hi[3])]
        }
    }

    /// One vector of `x` at `p` into f32 lanes, through the coherent path (in place, this launch
    /// writes it).
    ///
    /// # Safety
    /// `p` is 16-byte aligned and the first of `T::VEC` readable elements.
    #[inline(always)]
    unsafe fn load_x<T: Elem>(p: *const T) -> [f32; 8] {
        // SAFETY: per the function contract.
        T::unpack(unsafe { ld_global_v4(p as *const u32) })
    }

    /// Rotates the items of all rows; see [`RopeArgs`].
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub unsafe fn rope<T: Elem>(
        x: *const T,
        y: *mut T,
        cos: *const f32,
        sin: *const f32,
        rows: u64,
        d: u64,
        rot: u64,
        seq: u64,
        inner: u64,
        offset: u64,
        interleaved: u32,
        sign: f32,
    ) {
        let il = interleaved != 0;
        let vector = vector_path(T::DTYPE, d, rot, il);
        let (rot_items, pass_items) = items(T::DTYPE, d, rot, il);
        let in_place = core::ptr::eq(x, y.cast_const());
        let per_row = rot_items + if in_place { 0 } else { pass_items };
        if per_row == 0 || seq == 0 || inner == 0 {
            return;
        }
        let half = rot / 2;
        let v = T::VEC as u64;
        let total = rows * per_row;
        let mut t = global_thread_x();
        // 32-bit divisions where the indices fit (a 64-bit one is a long software routine).
        let narrow = total <= u32::MAX as u64;
        while t < total {
            let (r, k, sp) = if narrow {
                let (t, per_row) = (t as u32, per_row as u32);
                let r = t / per_row;
                (r as u64, (t - r * per_row) as u64, ((r / inner as u32) % seq as u32) as u64)
            } else {
                let r = t / per_row;
                (r, t - r * per_row, (r / inner) % seq)
            };
            let pos = offset + sp;
            let row = (r * d) as usize;
            let tab = (pos * half) as usize;
            // SAFETY (every access below): row r < rows holds d elements of x and y from `row`;
            // the tables hold `half` f32 for position `pos` from `tab` (the host's checks). The
            // offsets stay inside: pairs below `half` (or `rot`), pass-through below `d`. On the
            // vector path `row`, `half`, `rot` and the items' offsets are multiples of the vector
            // width, and `tab` of 4 (half-rotation) or 2 (interleaved f32) f32 (`vector_path`).
            unsafe {
                if k < rot_items {
                    if vector && !il {
                        let j = (k * v) as usize;
                        let a = load_x(x.add(row + j));
                        let b = load_x(x.add(row + half as usize + j));
                        let c = load_table(cos.add(tab + j), T::VEC);
                        let s = load_table(sin.add(tab + j), T::VEC);
                        let (mut ya, mut yb) = ([0.0f32; 8], [0.0f32; 8]);
                        for_lanes::<T>(
                            #[inline(always)]
                            |l| {
                                (ya[l], yb[l]) = rotate(a[l], b[l], c[l], s[l] * sign);
                            },
                        );
                        st_global_v4(y.add(row + j) as *mut u32, T::pack(&ya));
                        st_global_v4(y.add(row + half as usize + j) as *mut u32, T::pack(&yb));
                    } else if vector {
                        let j = (k * v) as usize;
                        let a = load_x(x.add(row + j));
                        let c = load_table(cos.add(tab + j / 2), T::VEC / 2);
                        let s = load_table(sin.add(tab + j / 2), T::VEC / 2);
                        let mut o = [0.0f32; 8];
                        for_lanes::<T>(
                            #[inline(always)]
                            |l| {
                                if l % 2 == 0 {
                                    let p = l / 2;
                                    (o[l], o[l + 1]) = rotate(a[l], a[l + 1], c[p], s[p] * sign);
                                }
                            },
                        );
                        st_global_v4(y.add(row + j) as *mut u32, T::pack(&o));
                    } else {
                        let i = k as usize;
                        let (ia, ib) = if il { (2 * i, 2 * i + 1) } else { (i, i + half as usize) };
                        let (a, b) = ((*x.add(row + ia)).to_f32(), (*x.add(row + ib)).to_f32());
                        let (ya, yb) = rotate(a, b, *cos.add(tab + i), *sin.add(tab + i) * sign);
                        *y.add(row + ia) = T::from_f32(ya);
                        *y.add(row + ib) = T::from_f32(yb);
                    }
                } else if vector {
                    let at = row + (rot + (k - rot_items) * v) as usize;
                    st_global_v4(y.add(at) as *mut u32, ld_global_v4(x.add(at) as *const u32));
                } else {
                    let at = row + (rot + k - rot_items) as usize;
                    *y.add(at) = *x.add(at);
                }
            }
            t += grid_threads_x();
        }
    }
}

#[cfg(target_arch = "nvptx64")]
pub use device::*;

/// The storage types' kernels, typed.
pub trait RopeElem: crate::Elem {
    /// `rope_<dtype>`.
    const ROPE: Kernel<RopeArgs<Self>>;
}

macro_rules! rope_kernels {
    ($T:ty, $sfx:ident) => {
        paste::paste! {
            $crate::kernel!([<rope_ $sfx>]: RopeArgs<$T> =
                |x, y, cos, sin, rows, d, rot, seq, inner, offset, interleaved, sign|
                rope::<$T>(x, y, cos, sin, rows, d, rot, seq, inner, offset, interleaved, sign));
            #[cfg(not(target_arch = "nvptx64"))]
            impl RopeElem for $T {
                const ROPE: Kernel<RopeArgs<$T>> = [<rope_ $sfx>];
            }
        }
    };
}
crate::for_each_elem!(rope_kernels);

/// Every kernel of the family: its name and arity (for the test against the PTX).
#[cfg(not(target_arch = "nvptx64"))]
pub fn all_kernels() -> impl Iterator<Item = KernelEntry> {
    use crate::dtype::{BF16, F16};
    [f32::ROPE.entry(), F16::ROPE.entry(), BF16::ROPE.entry()].into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_cover_each_row() {
        for dt in DType::ALL {
            let v = vec_width(dt);
            for d in [2u64, 8, 64, 80, 96, 128, 256, 6, 10, 34] {
                for rot in (2..=d).step_by(2) {
                    for il in [false, true] {
                        let (r, p) = items(dt, d, rot, il);
                        if vector_path(dt, d, rot, il) {
                            let per = if il { v / 2 } else { v };
                            assert_eq!((r * per, p * v), (rot / 2, d - rot), "{dt:?} {d} {rot} {il}");
                            // The tables' rows start on the loads' boundaries.
                            assert!((rot / 2).is_multiple_of(if il && v == 4 { 2 } else { 4 }));
                        } else {
                            assert_eq!((r, p), (rot / 2, d - rot));
                        }
                    }
                }
            }
        }
        // LLM shapes take the vector path in every dtype and style.
        for dt in DType::ALL {
            for d in [64u64, 128, 256] {
                assert!(vector_path(dt, d, d, false) && vector_path(dt, d, d, true));
            }
        }
        assert!(!vector_path(DType::BF16, 8, 8, false) && vector_path(DType::BF16, 8, 8, true));
    }

    #[test]
    fn rotation_is_exact_at_quarter_turns() {
        assert_eq!(rotate(3.0, 5.0, 1.0, 0.0), (3.0, 5.0));
        assert_eq!(rotate(3.0, 5.0, 0.0, 1.0), (-5.0, 3.0));
        let (a, b) = rotate(3.0, 5.0, 0.0, -1.0);
        assert_eq!((a, b), (5.0, -3.0));
    }
}
