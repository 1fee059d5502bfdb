//! Storage types. Every kernel computes in f32; f16 and bf16 are only how tensors are stored, so
//! a kernel is written once, generic over [`Elem`], and instantiated for the three types.

/// The element types of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16 (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`): f32's exponent range, 8 bits of precision.
    BF16,
}

impl DType {
    /// The three, in this order.
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The suffix of the kernel names instantiated for this type (`relu_fwd_bf16`).
    pub const fn suffix(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
}

/// IEEE binary16 storage (same layout as `half::f16`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

/// bfloat16 storage (same layout as `half::bf16`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct BF16(pub u16);

/// A storage type. Kernels move data 16 bytes at a time: `VEC` elements, unpacked into the first
/// `VEC` lanes of an `[f32; 8]` (8 is the most any type packs into 16 bytes).
pub trait Elem: Copy + 'static {
    /// The dtype this storage type is.
    const DTYPE: DType;
    /// Elements in 16 bytes.
    const VEC: usize;
    /// A 32-bit word of a loaded vector whose every element is 1.0 (a word of zeros is 0 in every
    /// type): the default of an absent parameter, packed like a loaded one.
    const ONE_WORD: u32;

    #[cfg(target_arch = "nvptx64")]
    fn to_f32(self) -> f32;
    #[cfg(target_arch = "nvptx64")]
    fn from_f32(x: f32) -> Self;

    /// Unpacks 16 loaded bytes.
    #[cfg(target_arch = "nvptx64")]
    fn unpack(raw: [u32; 4]) -> [f32; 8];
    /// Packs the first `VEC` lanes into 16 bytes, rounding to nearest even.
    #[cfg(target_arch = "nvptx64")]
    fn pack(v: &[f32; 8]) -> [u32; 4];
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    const VEC: usize = 4;
    const ONE_WORD: u32 = 0x3f80_0000;

    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn unpack(r: [u32; 4]) -> [f32; 8] {
        let f = f32::from_bits;
        [f(r[0]), f(r[1]), f(r[2]), f(r[3]), 0.0, 0.0, 0.0, 0.0]
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn pack(v: &[f32; 8]) -> [u32; 4] {
        [v[0].to_bits(), v[1].to_bits(), v[2].to_bits(), v[3].to_bits()]
    }
}

impl Elem for F16 {
    const DTYPE: DType = DType::F16;
    const VEC: usize = 8;
    const ONE_WORD: u32 = 0x3c00_3c00;

    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::prim::f16_to_f32(self.0)
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        F16(crate::prim::f32_to_f16(x))
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn unpack(r: [u32; 4]) -> [f32; 8] {
        let mut v = [0.0; 8];
        for i in 0..4 {
            v[2 * i] = crate::prim::f16_to_f32(r[i] as u16);
            v[2 * i + 1] = crate::prim::f16_to_f32((r[i] >> 16) as u16);
        }
        v
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn pack(v: &[f32; 8]) -> [u32; 4] {
        let mut r = [0; 4];
        for i in 0..4 {
            r[i] = crate::prim::f32x2_to_f16x2(v[2 * i], v[2 * i + 1]);
        }
        r
    }
}

impl Elem for BF16 {
    const DTYPE: DType = DType::BF16;
    const VEC: usize = 8;
    const ONE_WORD: u32 = 0x3f80_3f80;

    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::prim::bf16_to_f32(self.0)
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        BF16(crate::prim::f32_to_bf16(x))
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn unpack(r: [u32; 4]) -> [f32; 8] {
        let mut v = [0.0; 8];
        for i in 0..4 {
            v[2 * i] = f32::from_bits(r[i] << 16);
            v[2 * i + 1] = f32::from_bits(r[i] & 0xffff_0000);
        }
        v
    }
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn pack(v: &[f32; 8]) -> [u32; 4] {
        let mut r = [0; 4];
        for i in 0..4 {
            r[i] = crate::prim::f32x2_to_bf16x2(v[2 * i], v[2 * i + 1]);
        }
        r
    }
}

/// Calls `f(k)` for each lane `k < T::VEC` of a vector, written out lane by lane.
///
/// Why not `for k in 0..T::VEC`: when the body is long (GELU's erf, Mish's three functions) LLVM
/// declines to unroll that loop, the `[f32; 8]` it indexes at run time moves to local memory
/// (stack frames of ~100 bytes, a load and a store per lane), and a bandwidth-bound kernel
/// becomes 2-3x slower. Here every index is a constant; `k < T::VEC` folds away per type.
#[inline(always)]
pub fn for_lanes<T: Elem>(mut f: impl FnMut(usize)) {
    macro_rules! lanes {
        ($($k:literal)*) => { $( if $k < T::VEC { f($k); } )* };
    }
    lanes!(0 1 2 3 4 5 6 7);
}

/// Instantiates `$m!(Type, suffix)` for the three storage types.
#[macro_export]
macro_rules! for_each_elem {
    ($m:ident $(, $extra:tt)*) => {
        $m!(f32, f32 $(, $extra)*);
        $m!($crate::dtype::F16, f16 $(, $extra)*);
        $m!($crate::dtype::BF16, bf16 $(, $extra)*);
    };
}
