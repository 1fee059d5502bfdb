//! The device crate: every kernel of the library, in `no_std` Rust.
//!
//! Compiled twice. For `nvptx64-nvidia-cuda` (by the root `build.rs`) it becomes the PTX module
//! that the host loads; for the host it is an ordinary rlib that exports what both sides must
//! agree on: each kernel family's parameter list ([`mod@kernel`]), the op definitions ([`ops`]) and
//! the math ([`math`]), so the CPU tests run the very code the GPU runs.
//!
//! Layout: `prim` (nvptx64 only) holds every device primitive (indices, barriers, shuffles, shared memory,
//! 16-byte loads and stores, conversions); [`kernel`](mod@kernel), [`dtype`], [`ops`], [`math`],
//! [`fastmath`] and [`rows`] are what the kernels share (signatures, storage types, the op
//! formulas, the math, the row machinery); `ptx_modules` (host only) cuts the built PTX into the
//! modules the host loads per op; every other module is one kernel family.
#![no_std]
// The host build's public items are the API the host crate uses: each says what it is (CI's
// clippy makes a missing doc an error). The device build's are kernels, named by their macros.
#![cfg_attr(not(target_arch = "nvptx64"), warn(missing_docs))]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx, stdarch_nvptx, asm_experimental_arch, core_float_math))]
// `#[inline(always)]` on closures: the per-vector bodies passed to the loop helpers must be inlined
// (an outlined closure gets its captures through local memory).
#![cfg_attr(target_arch = "nvptx64", feature(stmt_expr_attributes))]

// The host build links std for its f32 math (`mul_add`, `sqrt`; core's are unstable), so that
// it builds on stable Rust for a dependent of the library.
#[cfg(not(target_arch = "nvptx64"))]
extern crate std;

/// Writes `$body` out once per literal, with `$k` a constant of type `$t` bound to it. The GEMM
/// kernels need straight-line code with constant indices: shared-memory offsets as immediates
/// and fragments and accumulators in registers, which LLVM's unroller does not guarantee for
/// bodies of hundreds of instructions (a rolled loop indexes its arrays in local memory).
#[allow(unused_macros)]
macro_rules! unroll {
    ($k:ident: $t:ty; $($n:literal)* => $body:block) => {{
        $( {
            const $k: $t = $n;
            $body
        } )*
    }};
}

pub mod attention;
pub mod batchnorm;
pub mod broadcast;
pub mod cast;
pub mod conv;
pub mod cross_entropy;
pub mod dtype;
pub mod elementwise;
pub mod embedding;
pub mod fastmath;
pub mod gemm;
pub mod gemm_epilogue;
pub mod gemm_tc;
pub mod gemm_tf32x3;
pub mod gemm_wgmma;
pub mod glu;
pub mod index;
pub mod init;
pub mod kernel;
pub mod math;
pub mod mathprobe;
pub mod norm;
pub mod ops;
pub mod optim;
pub mod pool;
#[cfg(target_arch = "nvptx64")]
pub mod prim;
#[cfg(not(target_arch = "nvptx64"))]
pub mod ptx_modules;
pub mod reduce;
pub mod rope;
pub mod rows;
pub mod softmax;
pub mod transpose;

pub use dtype::{BF16, DType, Elem, F16};

/// The kernel entry points of a PTX module (its `.visible .entry` names), in order.
pub fn ptx_entries(ptx: &str) -> impl Iterator<Item = &str> {
    ptx.lines()
        .filter_map(|l| l.trim_start().strip_prefix(".visible .entry "))
        .map(|l| l.split('(').next().unwrap_or(l).trim())
}

/// Kernels never panic by design (no indexing that can fail, no unwrap); should a bounds check
/// or overflow check survive, it stops the kernel and the host reports a launch failure.
#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    prim::trap()
}
