//! The fused epilogue of the tensor-core GEMMs (`gemm_tc.rs` and the split-K reduction; any
//! other kernel that ends in f32 accumulators of a product, one pair of columns at a time):
//!
//! `D = act(alpha * acc + beta * C + bias_col[col] + bias_row[row]) + residual[row, col]`, cast
//! to D's dtype, with C = D (read only when `beta != 0`).
//!
//! The value before the activation is [`crate::gemm::epilogue`]'s, the f32 GEMM's, with the two
//! biases summed first, and the activation its [`crate::gemm::activate`]: the same functions and
//! so the same results as the f32 kernels' epilogue in f32. Nothing here flushes or drops NaN or
//! infinities: `alpha = 0` skips the product (so `0 * inf` is not NaN, as in BLAS), `beta = 0`
//! never reads C (a NaN left in the output buffer cannot leak).

use crate::dtype::Elem;

/// What a tensor-core GEMM does with its f32 accumulators as it stores D (= C):
/// `D = act(alpha * acc + beta * C + bias_col[col] + bias_row[row]) + residual[row, col]`, cast to
/// D's dtype.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Epilogue {
    /// C/D base of this launch (dtype = the kernel's output type).
    pub d: *mut u8,
    /// Row stride of D, in elements.
    pub ldd: u64,
    /// Elements between the batch matrices of D.
    pub stride_d: u64,
    /// Null, or same dtype/ld/stride as D.
    pub residual: *const u8,
    /// Null, or `n` elements of D's dtype.
    pub bias_col: *const u8,
    /// Null, or `m` elements of D's dtype.
    pub bias_row: *const u8,
    /// Rows of D (of this launch).
    pub m: u32,
    /// Columns of D.
    pub n: u32,
    /// The product's factor.
    pub alpha: f32,
    /// C's factor; 0: C is never read.
    pub beta: f32,
    /// One of the `EPI_*` codes of `gemm.rs` (identity, relu, gelu, gelu_tanh, silu).
    pub act: u32,
    /// [`PAIR`] or 0.
    pub flags: u32,
}

/// [`Epilogue::flags`]: D's and the residual's rows (and batches) allow 2-element vector access,
/// i.e. `ldd` and `stride_d` are even and both bases are aligned to two elements.
pub const PAIR: u32 = 1;

/// [`Epilogue::flags`]: D's rows (and batches) start 16-byte aligned (`ldd` and `stride_d`
/// multiples of 16 bytes, the base aligned to 16), so a kernel may store 16 bytes at a time.
pub const QUAD: u32 = 2;

/// A kernel parameter: a plain `#[repr(C)]` value of pointers and integers (72 bytes, alignment
/// 8), which the PTX declares with the same layout (`.param .align 8 .b8 [72]`).
impl crate::kernel::Param for Epilogue {}

/// A storage type of D: f32, f16 or bf16, with loads and stores of one element or an aligned
/// pair (the low address holds the first).
pub trait OutType: Elem {
    /// Loads the element at `p`.
    ///
    /// # Safety
    /// `p` must point at one readable, aligned element in global memory.
    #[cfg(target_arch = "nvptx64")]
    unsafe fn load1(p: *const u8) -> f32;
    /// Stores `v`, rounded to nearest even, at `p`.
    ///
    /// # Safety
    /// `p` must point at one writable, aligned element in global memory.
    #[cfg(target_arch = "nvptx64")]
    unsafe fn store1(p: *mut u8, v: f32);
    /// Loads the two elements at `p`.
    ///
    /// # Safety
    /// `p` must point at two readable elements, aligned to their combined size.
    #[cfg(target_arch = "nvptx64")]
    unsafe fn load2(p: *const u8) -> [f32; 2];
    /// Stores both of `v` at `p`, rounded to nearest even.
    ///
    /// # Safety
    /// `p` must point at two writable elements, aligned to their combined size.
    #[cfg(target_arch = "nvptx64")]
    unsafe fn store2(p: *mut u8, v: [f32; 2]);
}

impl OutType for f32 {
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    unsafe fn load1(p: *const u8) -> f32 {
        // SAFETY: per the contract.
        unsafe { *(p as *const f32) }
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    unsafe fn store1(p: *mut u8, v: f32) {
        // SAFETY: per the contract.
        unsafe { *(p as *mut f32) = v }
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    unsafe fn load2(p: *const u8) -> [f32; 2] {
        // SAFETY: per the contract (8 bytes, 8-byte aligned).
        let w = unsafe { crate::prim::ld_global_v2(p as *const u32) };
        [f32::from_bits(w[0]), f32::from_bits(w[1])]
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    unsafe fn store2(p: *mut u8, v: [f32; 2]) {
        // SAFETY: per the contract.
        unsafe { crate::prim::st_global_v2(p as *mut u32, [v[0].to_bits(), v[1].to_bits()]) }
    }
}

macro_rules! half_out {
    ($t:ty, $to:path, $pack:path, $one:path) => {
        impl OutType for $t {
            #[cfg(target_arch = "nvptx64")]
            #[inline(always)]
            unsafe fn load1(p: *const u8) -> f32 {
                // SAFETY: per the contract.
                $to(unsafe { *(p as *const u16) })
            }
            #[cfg(target_arch = "nvptx64")]
            #[inline(always)]
            unsafe fn store1(p: *mut u8, v: f32) {
                // SAFETY: per the contract.
                unsafe { *(p as *mut u16) = $one(v) }
            }
            #[cfg(target_arch = "nvptx64")]
            #[inline(always)]
            unsafe fn load2(p: *const u8) -> [f32; 2] {
                // SAFETY: per the contract (4 bytes, 4-byte aligned).
                let w = unsafe { *(p as *const u32) };
                [$to(w as u16), $to((w >> 16) as u16)]
            }
            #[cfg(target_arch = "nvptx64")]
            #[inline(always)]
            unsafe fn store2(p: *mut u8, v: [f32; 2]) {
                // SAFETY: per the contract.
                unsafe { *(p as *mut u32) = $pack(v[0], v[1]) }
            }
        }
    };
}
half_out!(crate::dtype::F16, crate::prim::f16_to_f32, crate::prim::f32x2_to_f16x2, crate::prim::f32_to_f16);
half_out!(crate::dtype::BF16, crate::prim::bf16_to_f32, crate::prim::f32x2_to_bf16x2, crate::prim::f32_to_bf16);

/// One element of the epilogue, in f32: `c_old` is read only when `beta != 0`, `residual`
/// (`None`: absent) added after the activation. The host's tests compute the same.
#[inline(always)]
pub fn epilogue_value(
    e: &Epilogue,
    acc: f32,
    c_old: impl FnOnce() -> f32,
    bias_col: f32,
    bias_row: Option<f32>,
    residual: Option<f32>,
) -> f32 {
    let bias = match bias_row {
        Some(r) => bias_col + r,
        None => bias_col,
    };
    let y = crate::gemm::epilogue(acc, e.alpha, e.beta, c_old, bias, e.act);
    match residual {
        Some(r) => y + r,
        None => y,
    }
}

/// Stores D[batch][row][col], D[..][col + 1] from v (bounds-checked against m, n).
///
/// # Safety
/// `e` must describe, for `batch`, a D (and the residual, biases it names) whose every element
/// `row < m`, `col < n` is inside its allocation; `col` even when [`PAIR`] is set. Elements
/// outside `m x n` are neither read nor written.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub unsafe fn store_pair<O: OutType>(e: &Epilogue, batch: u32, row: u32, col: u32, v: [f32; 2]) {
    if row >= e.m || col >= e.n {
        return;
    }
    let size = O::DTYPE.size();
    let idx = (batch as u64 * e.stride_d + row as u64 * e.ldd + col as u64) as usize * size;
    // SAFETY (all accesses below): inside D, the residual and the biases by the contract, for
    // the row and the columns < n checked.
    let d = unsafe { e.d.add(idx) };
    let res = if e.residual.is_null() { None } else { Some(unsafe { e.residual.add(idx) }) };
    let br = if e.bias_row.is_null() { None } else { Some(unsafe { O::load1(e.bias_row.add(row as usize * size)) }) };
    let bias_col = |j: u32| {
        if e.bias_col.is_null() { 0.0 } else { unsafe { O::load1(e.bias_col.add((col + j) as usize * size)) } }
    };
    if e.flags & PAIR != 0 && col + 1 < e.n {
        let old = if e.beta != 0.0 { unsafe { O::load2(d) } } else { [0.0; 2] };
        let r = res.map(|p| unsafe { O::load2(p) });
        let out = [
            epilogue_value(e, v[0], || old[0], bias_col(0), br, r.map(|r| r[0])),
            epilogue_value(e, v[1], || old[1], bias_col(1), br, r.map(|r| r[1])),
        ];
        unsafe { O::store2(d, out) };
    } else {
        unroll!(J: u32; 0 1 => {
            if col + J < e.n {
                let p = unsafe { d.add(J as usize * size) };
                let r = res.map(|q| unsafe { O::load1(q.add(J as usize * size)) });
                let y = epilogue_value(e, v[J as usize], || unsafe { O::load1(p) }, bias_col(J), br, r);
                unsafe { O::store1(p, y) };
            }
        });
    }
}

/// Whether the epilogue is a plain store: `alpha = 1`, no C, bias, activation or residual, and
/// pairs aligned (`store_pair_plain` applies).
#[inline(always)]
pub fn is_plain(e: &Epilogue) -> bool {
    e.alpha == 1.0
        && e.beta == 0.0
        && e.act == crate::gemm::EPI_IDENTITY
        && e.bias_col.is_null()
        && e.bias_row.is_null()
        && e.residual.is_null()
        && e.flags & PAIR != 0
}

/// [`store_pair`] where [`is_plain`] holds: the values rounded and stored, nothing else. A kernel
/// that writes every pair of a tile out in straight-line code takes this path when it can: the
/// whole epilogue written out per pair is several kilobytes of code each.
///
/// # Safety
/// As [`store_pair`].
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub unsafe fn store_pair_plain<O: OutType>(e: &Epilogue, batch: u32, row: u32, col: u32, v: [f32; 2]) {
    if row >= e.m || col >= e.n {
        return;
    }
    let idx = (batch as u64 * e.stride_d + row as u64 * e.ldd + col as u64) as usize * O::DTYPE.size();
    // SAFETY: inside D by the contract, for the row and the columns < n checked; pairs aligned.
    unsafe {
        let d = e.d.add(idx);
        if col + 1 < e.n {
            O::store2(d, v);
        } else {
            O::store1(d, v[0]);
        }
    }
}
