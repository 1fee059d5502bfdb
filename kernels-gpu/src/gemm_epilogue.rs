//! The epilogue of the tensor-core GEMMs: what they do with each pair of f32 accumulators as
//! they store it,
//! `D = act(alpha * acc + beta * C + bias_col[col] + bias_row[row]) + residual[row, col]`,
//! rounded to D's type (f32, bf16 or f16). D is C, updated in place; `beta = 0` never reads it.

use crate::kernel::Param;

/// Bit of [`Epilogue::flags`]: every pair of columns `(2i, 2i + 1)` of D and of the residual
/// starts at an address aligned to the pair's size, so a pair is one store (one load).
pub const EPI_PAIRS: u32 = 1;

/// The epilogue's parameters, one kernel parameter. Pointers are device addresses of D's
/// element type (the kernel's output type); null ones are absent.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Epilogue {
    /// C, overwritten by D: the launch's first matrix.
    pub d: *mut u8,
    /// Elements between rows of D (and of the residual).
    pub ldd: u64,
    /// Elements between the matrices of a batch of D (and of the residual).
    pub stride_d: u64,
    /// Null, or a tensor laid out as D, added after the activation.
    pub residual: *const u8,
    /// Null, or `n` values, one per column, added before the activation.
    pub bias_col: *const u8,
    /// Null, or `m` values, one per row, added before the activation.
    pub bias_row: *const u8,
    /// Rows of D.
    pub m: u32,
    /// Columns of D.
    pub n: u32,
    /// The product's factor.
    pub alpha: f32,
    /// C's factor; 0: C is not read.
    pub beta: f32,
    /// One of the `EPI_*` activations of [`crate::gemm`].
    pub act: u32,
    /// [`EPI_PAIRS`] or 0.
    pub flags: u32,
}

impl Param for Epilogue {}

#[cfg(target_arch = "nvptx64")]
pub use device::{is_plain, store_pair, store_pair_plain};

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::dtype::Elem;
    use crate::gemm::epilogue;

    #[inline(always)]
    unsafe fn load<O: Elem>(p: *const u8, i: u64) -> f32 {
        // SAFETY: the caller's bounds.
        unsafe { (*(p as *const O).add(i as usize)).to_f32() }
    }

    /// Loads the pair at element `i` (even, with [`EPI_PAIRS`]) as one access.
    #[inline(always)]
    unsafe fn load_pair<O: Elem>(p: *const u8, i: u64) -> [f32; 2] {
        // SAFETY: the caller's bounds and alignment.
        unsafe {
            if size_of::<O>() == 2 {
                let w = *(p as *const u32).add(i as usize / 2);
                let lo: O = core::mem::transmute_copy(&(w as u16));
                let hi: O = core::mem::transmute_copy(&((w >> 16) as u16));
                [lo.to_f32(), hi.to_f32()]
            } else {
                let w = *(p as *const u64).add(i as usize / 2);
                [f32::from_bits(w as u32), f32::from_bits((w >> 32) as u32)]
            }
        }
    }

    /// Whether the epilogue is a plain store: `alpha = 1`, no C, bias, activation or residual,
    /// and pairs aligned ([`store_pair_plain`] applies).
    #[inline(always)]
    pub fn is_plain(e: &Epilogue) -> bool {
        e.alpha == 1.0
            && e.beta == 0.0
            && e.act == crate::gemm::EPI_IDENTITY
            && e.bias_col.is_null()
            && e.bias_row.is_null()
            && e.residual.is_null()
            && e.flags & EPI_PAIRS != 0
    }

    /// [`store_pair`] where [`is_plain`] holds: the values rounded and stored, nothing else.
    ///
    /// # Safety
    /// As [`store_pair`].
    #[inline(always)]
    pub unsafe fn store_pair_plain<O: Elem>(e: &Epilogue, batch: u32, row: u32, col: u32, v: [f32; 2]) {
        if row >= e.m || col >= e.n {
            return;
        }
        let i = batch as u64 * e.stride_d + row as u64 * e.ldd + col as u64;
        // SAFETY: (row, col) is inside D, and (row, col + 1) where both are written; pairs are
        // aligned (EPI_PAIRS).
        unsafe {
            if col + 1 < e.n {
                store_pair_raw::<O>(e.d, i, v);
            } else {
                *(e.d as *mut O).add(i as usize) = O::from_f32(v[0]);
            }
        }
    }

    /// Stores the pair `v` at element `i` (even, with [`EPI_PAIRS`]) as one access.
    #[inline(always)]
    unsafe fn store_pair_raw<O: Elem>(d: *mut u8, i: u64, v: [f32; 2]) {
        // SAFETY: the caller's bounds and alignment.
        unsafe {
            if size_of::<O>() == 2 {
                let lo: u16 = core::mem::transmute_copy(&O::from_f32(v[0]));
                let hi: u16 = core::mem::transmute_copy(&O::from_f32(v[1]));
                *(d as *mut u32).add(i as usize / 2) = lo as u32 | (hi as u32) << 16;
            } else {
                *(d as *mut u64).add(i as usize / 2) = v[0].to_bits() as u64 | (v[1].to_bits() as u64) << 32;
            }
        }
    }

    /// Stores `D[batch][row][col]` and `D[batch][row][col + 1]` from the accumulators `v`,
    /// through the epilogue; elements outside `m x n` are skipped.
    ///
    /// # Safety
    /// `e` must describe D, the residual and the biases as its fields say, for `batch`.
    #[inline(always)]
    pub unsafe fn store_pair<O: Elem>(e: &Epilogue, batch: u32, row: u32, col: u32, v: [f32; 2]) {
        if row >= e.m || col >= e.n {
            return;
        }
        let i = batch as u64 * e.stride_d + row as u64 * e.ldd + col as u64;
        // SAFETY: (row, col) is inside D (and col + 1 where it is read or written below); the
        // biases hold m and n values; the caller's contract for the rest.
        unsafe {
            let br = if e.bias_row.is_null() { 0.0 } else { load::<O>(e.bias_row, row as u64) };
            let both = col + 1 < e.n;
            if both && e.flags & EPI_PAIRS != 0 {
                let c = if e.beta != 0.0 { load_pair::<O>(e.d, i) } else { [0.0; 2] };
                let has_res = !e.residual.is_null();
                let r = if has_res { load_pair::<O>(e.residual, i) } else { [0.0; 2] };
                let mut out = [0.0f32; 2];
                for h in 0..2 {
                    let bc = if e.bias_col.is_null() { 0.0 } else { load::<O>(e.bias_col, (col + h as u32) as u64) };
                    let y = epilogue(v[h], e.alpha, e.beta, || c[h], bc + br, e.act);
                    // Added only when present: `-0.0 + 0.0` would lose the sign.
                    out[h] = if has_res { y + r[h] } else { y };
                }
                store_pair_raw::<O>(e.d, i, out);
                return;
            }
            for h in 0..2u32 {
                if h == 1 && !both {
                    break;
                }
                let j = i + h as u64;
                let bc = if e.bias_col.is_null() { 0.0 } else { load::<O>(e.bias_col, (col + h) as u64) };
                let d = e.d as *mut O;
                let mut y = epilogue(v[h as usize], e.alpha, e.beta, || (*d.add(j as usize)).to_f32(), bc + br, e.act);
                if !e.residual.is_null() {
                    y += load::<O>(e.residual, j);
                }
                *d.add(j as usize) = O::from_f32(y);
            }
        }
    }
}
