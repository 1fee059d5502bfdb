//! Matrix products in f32 (host side of `kernels-gpu/src/gemm.rs` and
//! `kernels-gpu/src/gemm_tf32x3.rs`): `C = alpha * op(A) @ op(B) + beta * C` for row-major
//! matrices, batched over a leading dimension, with an optional fused epilogue `act(... +
//! bias)`, in f32 FMAs or, by choice ([`Precision`]), 3xTF32 or plain TF32 on the tensor cores.
//! The families take the same parameters, tiles and grid.
//!
//! Launch logic: one block per 128 x 128 tile of C and per batch. When C has fewer tiles than
//! the GPU has SMs and K is long enough to share out, K is split into slices computed as a batch
//! into a workspace and summed in a fixed order by a second kernel (deterministic; see
//! `plan`). Problems beyond the grid's limits (more than 65535 row tiles or batches) are
//! launched in pieces.

use super::Activation;
use super::check::check_same_device;
use crate::device::{Device, LaunchConfig};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use kernels_gpu::DType;
use kernels_gpu::gemm::{
    BK, EPI_GELU, EPI_GELU_TANH, EPI_IDENTITY, EPI_RELU, EPI_SILU, GemmArgs, SPLITK_THREADS, SplitKReduceArgs,
    TILE_128, Tile, gemm_kernel, gemm_splitk_reduce,
};
use kernels_gpu::gemm_tf32x3::{self as tf32x3, tf32_kernel, tf32x3_kernel};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// The transposes and scalars of a GEMM: `C = alpha * op(A) @ op(B) + beta * C`, where `op(X)` is
/// `X` or, if `trans_x`, `X^T` (the stored matrix read as its transpose, no copy made). `beta = 0`
/// never reads C, so C may hold anything (NaN included) before; `alpha = 0` skips the product.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    /// Read A as its transpose.
    pub trans_a: bool,
    /// Read B as its transpose.
    pub trans_b: bool,
    /// The product's factor.
    pub alpha: f32,
    /// C's factor (0: C is written, not read).
    pub beta: f32,
    /// How the products are computed; `None`: the device's setting
    /// ([`Device::set_f32_matmul_precision`], f32 FMAs unless set).
    pub precision: Option<Precision>,
}

impl Default for Gemm {
    /// `C = A @ B`.
    fn default() -> Self {
        Gemm { trans_a: false, trans_b: false, alpha: 1.0, beta: 0.0, precision: None }
    }
}

impl Gemm {
    /// `C = op(A) @ op(B)` with the given transposes.
    pub fn new(trans_a: bool, trans_b: bool) -> Gemm {
        Gemm { trans_a, trans_b, ..Gemm::default() }
    }

    /// Whether [`gemm_ex`] applies `act` as it stores C (identity, relu, GELU, GELU-tanh, SiLU);
    /// [`linear`](super::linear()) runs the others as a separate element-wise pass.
    pub fn can_fuse(act: Activation) -> bool {
        fused_activation(act).is_some()
    }
}

/// How an f32 product is computed: the levels of PyTorch's `torch.set_float32_matmul_precision`
/// that keep f32 accuracy ([`Precision::Highest`], [`Precision::Tf32x3`]) and, as an explicit
/// opt-in of speed over accuracy, its plain TF32 ([`Precision::Tf32`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// f32 fused multiply-adds on the CUDA cores: PyTorch's `"highest"` (its default), cuBLAS's
    /// default FP32 mode.
    #[default]
    Highest,
    /// "3xTF32" on the tensor cores (kernels-gpu/src/gemm_tf32x3.rs): each operand split into two
    /// TF32 parts and three tensor-core products summed in f32. Each product is held to 2^-21
    /// instead of an FMA's 2^-24, below the error of the f32 sum over K in long products:
    /// measured against f64 at K = 4096, the relative error was 2.7e-7 (FMAs 3.0e-7) on normal
    /// values and 2.2e-7 (FMAs 8.0e-8) on uniform [0, 1) ones; TF32 alone gave 2.9e-4 and 5.6e-6
    /// (docs/worklog.md, 2026-11-24b-gemm). Values below 2^-115 in magnitude are held to 2^-136
    /// absolute.
    /// PyTorch's `"high"` is plain TF32 ([`Precision::Tf32`]), not this.
    ///
    /// Products with a short K (under 256) or a small C (under 2^18 elements) run the FMA kernel
    /// instead, which is faster there and at least as accurate; so does every product on a GPU
    /// with less shared memory a block than the kernel's ring needs (the H100's and A100's
    /// suffice; sm_86 and sm_89's 99 KiB do not).
    Tf32x3,
    /// [`Precision::Tf32x3`] on every shape, also where the FMA kernel is faster (for tests and
    /// measurements of the 3xTF32 kernel on small products).
    Tf32x3Always,
    /// Plain TF32 on the tensor cores (kernels-gpu/src/gemm_tf32x3.rs, `gemm_tf32_*`): PyTorch's
    /// `"high"` (`torch.backends.cuda.matmul.allow_tf32 = True`), cuBLAS's TF32 mode. Each
    /// operand is rounded to TF32 (10 mantissa bits, to nearest: within 2^-11 of itself, 2^-137
    /// absolute below 2^-126) and the tensor core multiplies the roundings exactly, so each
    /// product term errs by up to `(2 * 2^-11 + 2^-22) |a b|`, about 2^-10, before the f32 sum
    /// over K (as [`Precision::Tf32x3`]'s). About 1000x the error of the other precisions: cuBLAS
    /// in TF32 gave 2.9e-4 relative against f64 on normal values at K = 4096, where FMAs gave
    /// 3.0e-7 (docs/worklog.md, 2026-11-24b-gemm).
    ///
    /// Unlike [`Precision::Tf32x3`], every shape runs TF32, small products included: the choice
    /// is an explicit one for the tensor cores' speed. Only a GPU with less shared memory a block
    /// than the kernel's ring needs runs the FMA kernel (more accurate than asked).
    Tf32,
}

/// The precision set per device by [`Device::set_f32_matmul_precision`], by ordinal (one
/// [`Device`] per ordinal per process). Kept here, not in the device, so the runtime knows
/// nothing of the ops.
static MATMUL_PRECISION: Mutex<BTreeMap<usize, Precision>> = Mutex::new(BTreeMap::new());

impl Device {
    /// How the f32 products on this device that do not name a precision are computed (those of
    /// [`matmul`], the linear layer, and [`Gemm`] with `precision: None`),
    /// for every user of the device in the process: PyTorch's
    /// `torch.set_float32_matmul_precision`. [`Precision::Highest`] (f32 FMAs) until set.
    pub fn set_f32_matmul_precision(&self, precision: Precision) {
        MATMUL_PRECISION.lock().unwrap_or_else(|p| p.into_inner()).insert(self.ordinal(), precision);
    }

    /// The precision [`Device::set_f32_matmul_precision`] set.
    pub fn f32_matmul_precision(&self) -> Precision {
        MATMUL_PRECISION.lock().unwrap_or_else(|p| p.into_inner()).get(&self.ordinal()).copied().unwrap_or_default()
    }
}

/// The kernel family a product of `m x k` by `k x n` (`batch` of them) runs in, on a GPU whose
/// blocks may have `max_shared` bytes of shared memory: the 3xTF32 and TF32 kernels need
/// [`tf32x3::SMEM_BYTES`] (an H100 or A100 has them; GPUs with less run the FMA kernel).
fn resolve(precision: Precision, (batch, m, n, k): (u64, u64, u64, u64), max_shared: u32) -> Precision {
    match precision {
        Precision::Tf32x3 | Precision::Tf32x3Always | Precision::Tf32 if max_shared < tf32x3::SMEM_BYTES => {
            Precision::Highest
        }
        Precision::Tf32x3 if k < 256 || batch * m * n < 1 << 18 => Precision::Highest,
        Precision::Tf32x3Always => Precision::Tf32x3,
        p => p,
    }
}

/// The epilogue code of an activation the GEMM can apply as it stores, `None` for the others
/// (which [`mod@super::linear`] applies with a separate element-wise kernel).
pub(crate) fn fused_activation(act: Activation) -> Option<u32> {
    match act {
        Activation::Identity => Some(EPI_IDENTITY),
        Activation::Relu => Some(EPI_RELU),
        Activation::Gelu => Some(EPI_GELU),
        Activation::GeluTanh => Some(EPI_GELU_TANH),
        Activation::Silu => Some(EPI_SILU),
        _ => None,
    }
}

/// The shortest K slice of a split: `plan` keeps every slice at least this long.
pub(crate) const MIN_SLICE: u64 = 256;

/// Largest `grid.y` and `grid.z`; larger problems are launched in pieces.
pub(crate) const MAX_GRID_YZ: u64 = 65_535;

/// How one GEMM runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GemmPlan {
    /// The kernel's tile shape.
    tile: Tile,
    /// K slices (1: no split).
    splits: u64,
    /// K elements per slice (a multiple of the stage depth, except when `splits == 1`).
    chunk: u64,
}

/// The plan for a batch of `batch` products of `m x k` by `k x n` on a GPU with `sms` SMs.
///
/// Split-K only for a single product whose C has fewer 128 x 128 tiles than SMs: such a launch
/// leaves SMs idle whatever K is. The split fills one wave of about two resident blocks per SM
/// (what the kernel's 128 registers a thread allow) without exceeding it (a second, partial wave
/// costs as much as the first: at 128 x 8192 x 8192 five slices ran slower than four;
/// docs/worklog.md, 2026-11-23-gemm), and keeps each slice at least 256 long, so that the partial sums
/// written to and read back from the workspace (`splits * m * n` floats) stay small next to the
/// product's `2 m n k` flops. Total: any sizes give a plan (saturating where a product of
/// them would overflow).
fn plan(m: u64, n: u64, k: u64, batch: u64, sms: u64) -> GemmPlan {
    let tile = TILE_128;
    let tiles = m.div_ceil(tile.bm as u64).saturating_mul(n.div_ceil(tile.bn as u64));
    if batch == 1 && tiles > 0 && tiles < sms && k >= 2 * MIN_SLICE {
        // chunk >= k / splits, so k.div_ceil(chunk) <= splits <= k / MIN_SLICE.
        let splits = (sms.saturating_mul(2) / tiles).min(k / MIN_SLICE);
        if splits > 1 {
            let chunk = k.div_ceil(splits).div_ceil(BK as u64) * BK as u64;
            return GemmPlan { tile, splits: k.div_ceil(chunk), chunk };
        }
    }
    GemmPlan { tile, splits: 1, chunk: k }
}

/// One operand's shape: `(batch or None for a 2-D tensor, rows, cols)` as stored.
pub(crate) fn dims(op: &'static str, name: &str, t: &Tensor) -> Result<(Option<usize>, usize, usize)> {
    match *t.shape() {
        [r, c] => Ok((None, r, c)),
        [b, r, c] => Ok((Some(b), r, c)),
        ref s => Err(Error::InvalidArgument {
            op,
            message: format!("{name} must be a matrix or a batch of matrices (2 or 3 dimensions), got shape {s:?}"),
        }),
    }
}

fn check_f32(op: &'static str, name: &str, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{name} is {:?}: the GEMM computes in f32 only (shape {:?})", t.dtype(), t.shape()),
        });
    }
    Ok(())
}

/// A tensor's shape as `(batch, rows, cols)`: [`dims`] of its shape, or, for the layers built
/// on the GEMM, a matrix view of it (`x [..., in]` as `[rows, in]`).
pub(crate) type Dims = (Option<usize>, usize, usize);

/// Problem sizes `(batch, m, n, k)` of `op(A) @ op(B)` into C, checked; `da`, `db`, `dc` are the
/// operands' [`Dims`], whose element counts must be the tensors'. The dtypes are the caller's to
/// check.
pub(crate) fn problem(
    op: &'static str,
    (a, da): (&Tensor, Dims),
    (b, db): (&Tensor, Dims),
    (c, dc): (&Tensor, Dims),
    g: &Gemm,
) -> Result<(u64, u64, u64, u64)> {
    for (name, t, d) in [("A", a, da), ("B", b, db), ("C", c, dc)] {
        if d.0.unwrap_or(1) * d.1 * d.2 != t.numel() {
            return Err(Error::InvalidArgument {
                op,
                message: format!("{name} viewed as {d:?} but has shape {:?}", t.shape()),
            });
        }
    }
    check_same_device(op, a, b)?;
    check_same_device(op, a, c)?;
    let ((ba, ar, ac), (bb, br, bc), (bc_, m_c, n_c)) = (da, db, dc);
    let (m, ka) = if g.trans_a { (ac, ar) } else { (ar, ac) };
    let (kb, n) = if g.trans_b { (bc, br) } else { (br, bc) };
    let mismatch = |detail: String| Error::InvalidArgument {
        op,
        message: format!(
            "{detail}: A {:?}{}, B {:?}{}, C {:?}",
            a.shape(),
            if g.trans_a { " (transposed)" } else { "" },
            b.shape(),
            if g.trans_b { " (transposed)" } else { "" },
            c.shape()
        ),
    };
    if ka != kb {
        return Err(mismatch(format!("inner dimensions differ ({ka} and {kb})")));
    }
    if (m, n) != (m_c, n_c) {
        return Err(mismatch(format!("C must be {m} x {n}")));
    }
    // A 2-D operand is shared by every matrix of a batch (stride 0); batched ones must agree.
    let batch = match (ba, bb, bc_) {
        (None, None, None) => 1,
        (_, _, None) => return Err(mismatch("a batched product needs a batched C".into())),
        (x, y, Some(bcv)) => {
            if x.is_some_and(|v| v != bcv) || y.is_some_and(|v| v != bcv) {
                return Err(mismatch("batch sizes differ".into()));
            }
            bcv
        }
    };
    for (what, v) in [("m", m), ("n", n), ("k", ka)] {
        if v > i32::MAX as usize {
            return Err(mismatch(format!("{what} = {v} is beyond the kernel's 2^31 - 1")));
        }
    }
    Ok((batch as u64, m as u64, n as u64, ka as u64))
}

/// An operand in device memory: address (bytes) and element strides.
#[derive(Clone, Copy)]
struct Mat {
    ptr: u64,
    ld: u64,
    /// Between the matrices of a batch (0: shared).
    stride: u64,
}

impl Mat {
    fn at(self, elements: u64) -> Mat {
        Mat { ptr: self.ptr + 4 * elements, ..self }
    }
}

/// Launches the tile kernel over `batch` products, in pieces within the grid's limits.
#[allow(clippy::too_many_arguments)]
fn launch_tiles(
    dev: &Device,
    g: &Gemm,
    tile: Tile,
    (a, b, c): (Mat, Mat, Mat),
    bias: u64,
    (batch, m, n, k): (u64, u64, u64, u64),
    epi: u32,
    alpha_beta: (f32, f32),
) -> Result<()> {
    // The 3xTF32 and TF32 kernels have the same tile, grid and parameters, their own block and
    // ring.
    let (kernel, threads, shared_bytes) = match g.precision.unwrap_or_default() {
        Precision::Highest => (gemm_kernel(g.trans_a, g.trans_b, tile), tile.threads(), tile.smem_bytes()),
        Precision::Tf32 => (tf32_kernel(g.trans_a, g.trans_b), tf32x3::THREADS, tf32x3::SMEM_BYTES),
        Precision::Tf32x3 | Precision::Tf32x3Always => {
            (tf32x3_kernel(g.trans_a, g.trans_b), tf32x3::THREADS, tf32x3::SMEM_BYTES)
        }
    };
    debug_assert_eq!((tile.bm, tile.bn), (tf32x3::BM, tf32x3::BN));
    let rows_per_launch = MAX_GRID_YZ * tile.bm as u64;
    let gx = n.div_ceil(tile.bn as u64);
    let mut z0 = 0;
    while z0 < batch {
        let nz = (batch - z0).min(MAX_GRID_YZ);
        let mut r0 = 0;
        while r0 < m {
            let nr = (m - r0).min(rows_per_launch);
            // Row r0 of op(A): row r0 of A, or column r0 of the stored transpose.
            let a_off = z0 * a.stride + if g.trans_a { r0 } else { r0 * a.ld };
            let c_off = z0 * c.stride + r0 * c.ld;
            let cfg = LaunchConfig {
                grid: (gx as u32, nr.div_ceil(tile.bm as u64) as u32, nz as u32),
                block: (threads, 1, 1),
                shared_bytes,
            };
            let args: GemmArgs = (
                a.at(a_off).ptr as *const f32,
                b.at(z0 * b.stride).ptr as *const f32,
                c.at(c_off).ptr as *mut f32,
                bias as *const f32,
                nr as u32,
                n as u32,
                k as u32,
                a.ld,
                b.ld,
                c.ld,
                alpha_beta.0,
                alpha_beta.1,
                a.stride,
                b.stride,
                c.stride,
                epi,
            );
            // SAFETY: the callers checked that A, B and C hold the batches of matrices these
            // sizes, leading dimensions and strides describe (C written, A and B only read, C a
            // separate allocation: it is borrowed mutably), and that bias is null or `n` floats;
            // the grid covers `nr` rows and `n` columns of each of `nz` products.
            unsafe { dev.launch(kernel, cfg, args)? };
            r0 += nr;
        }
        z0 += nz;
    }
    Ok(())
}

/// The GEMM with every option: `C = act(alpha * op(A) @ op(B) + beta * C + bias)`, `bias` a
/// vector of `n` (one per column of C), `act` one of the activations [`Gemm::can_fuse`]
/// accepts. A, B and C are matrices (2-D) or batches (3-D); a 2-D A or B is shared by every
/// matrix of a batched C. Any sizes, empty ones included (`k = 0` gives `act(beta * C + bias)`).
///
/// Dtypes: A, B and C all f32 (f32 FMAs, 3xTF32 or TF32, [`Precision`]); or A and B both bf16 or both
/// f16, on the tensor cores with f32 accumulation, C (and bias) bf16, f16 or f32, the result
/// rounded once to C's dtype ([`mod@super::gemm_tc`]; `g.precision` does not apply). Other
/// mixes are an [`Error::InvalidArgument`]. [`gemm_fused`](super::gemm_fused) adds a row bias
/// and a residual.
pub fn gemm_ex(a: &Tensor, b: &Tensor, c: &mut Tensor, g: Gemm, bias: Option<&Tensor>, act: Activation) -> Result<()> {
    let op = "gemm";
    let (da, db, dc) = (dims(op, "A", a)?, dims(op, "B", b)?, dims(op, "C", c)?);
    gemm_dims(op, (a, da), (b, db), (c, dc), g, bias, act)
}

/// [`gemm_ex`] on operands given as [`Dims`] (matrix views of tensors of other shapes).
pub(crate) fn gemm_dims(
    op: &'static str,
    (a, da): (&Tensor, Dims),
    (b, db): (&Tensor, Dims),
    (c, dc): (&mut Tensor, Dims),
    g: Gemm,
    bias: Option<&Tensor>,
    act: Activation,
) -> Result<()> {
    if [a.dtype(), b.dtype(), c.dtype()] != [DType::F32; 3] {
        // bf16 and f16 operands: the tensor cores (and the errors for mixed dtypes).
        let epi = super::gemm_tc::Epilogue { bias, act, ..Default::default() };
        return super::gemm_tc::gemm_tc_dims(op, (a, da), (b, db), (c, dc), g, epi);
    }
    let (batch, m, n, k) = problem(op, (a, da), (b, db), (c, dc), &g)?;
    let Some(epi) = fused_activation(act) else {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "{act:?} cannot be fused into the GEMM's store (Identity, Relu, Gelu, GeluTanh, Silu can)"
            ),
        });
    };
    if let Some(bias) = bias {
        check_f32(op, "bias", bias)?;
        check_same_device(op, a, bias)?;
        if bias.shape() != [n as usize] {
            return Err(Error::InvalidArgument {
                op,
                message: format!("bias must have shape [{n}] (one per column of C), got {:?}", bias.shape()),
            });
        }
    }
    if !(g.alpha.is_finite() && g.beta.is_finite()) {
        return Err(Error::InvalidArgument {
            op,
            message: format!("alpha and beta must be finite, got {} and {}", g.alpha, g.beta),
        });
    }
    if batch == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    let dev = a.device().clone();
    // From here on `precision` names the kernel family: Highest, Tf32x3 or Tf32.
    let precision = g.precision.unwrap_or(dev.f32_matmul_precision());
    let g = Gemm { precision: Some(resolve(precision, (batch, m, n, k), dev.max_shared_bytes())), ..g };
    let (ar, ac) = if g.trans_a { (k, m) } else { (m, k) };
    let (br, bc) = if g.trans_b { (n, k) } else { (k, n) };
    let stride = |d: Dims, r: u64, cols: u64| if d.0.is_some() { r * cols } else { 0 };
    let am = Mat { ptr: a.dev_ptr_u64(), ld: ac, stride: stride(da, ar, ac) };
    let bm = Mat { ptr: b.dev_ptr_u64(), ld: bc, stride: stride(db, br, bc) };
    let cm = Mat { ptr: c.dev_ptr_u64(), ld: n, stride: stride(dc, m, n) };
    let bias_ptr = bias.map_or(0, |t| t.dev_ptr_u64());
    let p = plan(m, n, k, batch, dev.sm_count() as u64);
    if p.splits == 1 {
        return launch_tiles(&dev, &g, p.tile, (am, bm, cm), bias_ptr, (batch, m, n, k), epi, (g.alpha, g.beta));
    }

    // Split-K: slice s reads K columns [s * chunk, (s + 1) * chunk) of op(A) and rows of op(B),
    // i.e. a batch whose strides step along K, into workspace slice s.
    let ws = Tensor::alloc(op, &dev, &[p.splits as usize, m as usize, n as usize], DType::F32)?;
    let a_step = if g.trans_a { p.chunk * am.ld } else { p.chunk };
    let b_step = if g.trans_b { p.chunk } else { p.chunk * bm.ld };
    let wm = Mat { ptr: ws.dev_ptr_u64(), ld: n, stride: m * n };
    let slice = |s: u64| {
        (Mat { stride: a_step, ..am.at(s * a_step) }, Mat { stride: b_step, ..bm.at(s * b_step) }, wm.at(s * m * n))
    };
    let full = if k.is_multiple_of(p.chunk) { p.splits } else { p.splits - 1 };
    let plain = Gemm { alpha: 1.0, beta: 0.0, ..g };
    launch_tiles(&dev, &plain, p.tile, slice(0), 0, (full, m, n, p.chunk), EPI_IDENTITY, (1.0, 0.0))?;
    if full < p.splits {
        let last = k - full * p.chunk;
        launch_tiles(&dev, &plain, p.tile, slice(full), 0, (1, m, n, last), EPI_IDENTITY, (1.0, 0.0))?;
    }
    let groups = m * n.div_ceil(4);
    let cfg = LaunchConfig {
        grid: (groups.div_ceil(SPLITK_THREADS as u64) as u32, 1, 1),
        block: (SPLITK_THREADS, 1, 1),
        shared_bytes: 0,
    };
    let args: SplitKReduceArgs = (
        ws.dev_ptr(),
        c.dev_ptr_mut()?,
        bias_ptr as *const f32,
        m as u32,
        n as u32,
        n,
        p.splits as u32,
        g.alpha,
        g.beta,
        epi,
    );
    // SAFETY: ws holds `splits` slices of m x n floats, c is m x n (contiguous, ldc = n), bias
    // null or n floats; one thread per 4 columns of a row, the grid covers m * ceil(n / 4).
    unsafe { dev.launch(gemm_splitk_reduce, cfg, args) }
}

/// `C = alpha * op(A) @ op(B) + beta * C` (see [`gemm_ex`] for the shapes).
pub fn gemm(a: &Tensor, b: &Tensor, c: &mut Tensor, g: Gemm) -> Result<()> {
    gemm_ex(a, b, c, g, None, Activation::Identity)
}

/// `A @ B` into a new tensor of A's dtype: `[m, k] @ [k, n] -> [m, n]`, or batched (`[b, m, k] @
/// [b, k, n]`, either side may be 2-D and is then shared by the batch). f32 operands, or bf16
/// (or f16) ones on the tensor cores, with f32 accumulation ([`gemm_ex`]).
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let op = "matmul";
    let (ba, m, _) = dims(op, "A", a)?;
    let (bb, _, n) = dims(op, "B", b)?;
    let shape = match ba.or(bb) {
        Some(bt) => vec![bt, m, n],
        None => vec![m, n],
    };
    // C of the operands' dtype (PyTorch's), accumulated in f32 whatever it is.
    let mut c = Tensor::alloc(op, a.device(), &shape, a.dtype())?;
    gemm(a, b, &mut c, Gemm::default())?;
    Ok(c)
}

impl Tensor {
    /// [`matmul`]: `self @ other`.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        matmul(self, other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn plan_splits_k_only_when_tiles_are_too_few() {
        let sms = 132;
        // Large squares and skinny K: one slice.
        for (m, n, k) in [(4096, 4096, 4096), (8192, 8192, 128), (4096, 4096, 16384), (1, 1, 1), (100, 100, 100)] {
            assert_eq!(plan(m, n, k, 1, sms).splits, 1, "{m}x{n}x{k}");
        }
        // 128 x 8192 by 8192: 64 tiles, split 4 ways: 256 blocks, one wave of two an SM.
        let p = plan(128, 8192, 8192, 1, sms);
        assert_eq!((p.splits, p.chunk), (4, 2048), "{p:?}");
        // 1000^3: 64 tiles, 3 slices of at least 256.
        let p = plan(1000, 1000, 1000, 1, sms);
        assert!(p.splits == 3 && p.chunk.is_multiple_of(BK as u64) && p.chunk * p.splits >= 1000, "{p:?}");
        // Batched products never split; nor short K.
        assert_eq!(plan(128, 8192, 8192, 2, sms).splits, 1);
        assert_eq!(plan(128, 128, 500, 1, sms).splits, 1);
        // Prime K: the last slice is shorter.
        let p = plan(64, 64, 100_003, 1, sms);
        assert!(p.splits > 1 && p.chunk * (p.splits - 1) < 100_003 && p.chunk * p.splits >= 100_003, "{p:?}");
    }

    #[test]
    fn tf32x3_runs_the_fma_kernel_where_that_is_faster() {
        let t = Precision::Tf32x3;
        let h100 = 227 * 1024;
        // Measured on the H100: 3xTF32 faster at 4096^3, 1000^3 and split-K 128 x 8192 x 8192;
        // slower at K = 128 and on C of 64 x 1024.
        for shape in [(1, 4096, 4096, 4096), (1, 1000, 1000, 1000), (1, 128, 8192, 8192), (4, 256, 256, 256)] {
            assert_eq!(resolve(t, shape, h100), Precision::Tf32x3, "{shape:?}");
        }
        for shape in [(1, 8192, 8192, 128), (1, 64, 1024, 1024), (1, 511, 511, 4096)] {
            assert_eq!(resolve(t, shape, h100), Precision::Highest, "{shape:?}");
        }
        assert_eq!(resolve(Precision::Tf32x3Always, (1, 1, 1, 1), h100), Precision::Tf32x3);
        assert_eq!(resolve(Precision::Highest, (1, 4096, 4096, 4096), h100), Precision::Highest);
        // A GPU with 99 KiB of shared memory a block (sm_86, sm_89) cannot run them.
        for p in [Precision::Tf32x3, Precision::Tf32x3Always, Precision::Tf32] {
            assert_eq!(resolve(p, (1, 4096, 4096, 4096), 99 * 1024), Precision::Highest);
        }
    }

    #[test]
    fn tf32_runs_on_every_shape_the_gpu_allows() {
        let h100 = 227 * 1024;
        for shape in [(1, 4096, 4096, 4096), (1, 8192, 8192, 128), (1, 64, 1024, 1024), (1, 1, 1, 1), (3, 0, 5, 0)] {
            assert_eq!(resolve(Precision::Tf32, shape, h100), Precision::Tf32, "{shape:?}");
        }
        assert_eq!(resolve(Precision::Tf32, (1, 1, 1, 1), tf32x3::SMEM_BYTES - 1), Precision::Highest);
    }

    #[test]
    fn fused_activations() {
        assert_eq!(fused_activation(Activation::Relu), Some(EPI_RELU));
        assert_eq!(fused_activation(Activation::Gelu), Some(EPI_GELU));
        assert_eq!(fused_activation(Activation::Silu), Some(EPI_SILU));
        assert_eq!(fused_activation(Activation::Mish), None);
        assert!(Gemm::can_fuse(Activation::GeluTanh) && !Gemm::can_fuse(Activation::Sigmoid));
    }

    fn size() -> impl Strategy<Value = u64> {
        prop_oneof![Just(0u64), Just(1), Just(u64::MAX), Just(u64::MAX - 1), 0..1u64 << 20, any::<u64>()]
    }

    proptest! {
        /// Any sizes give a plan, never a panic, and its slices cover K exactly: `splits - 1`
        /// whole chunks short of K, `splits` past it, each at least `MIN_SLICE` long.
        #[test]
        fn plan_is_total_and_covers_k(m in size(), n in size(), k in size(), batch in size(), sms in size()) {
            let p = plan(m, n, k, batch, sms);
            prop_assert!(p.splits >= 1);
            if p.splits == 1 {
                prop_assert_eq!(p.chunk, k);
            } else {
                prop_assert!(batch == 1 && p.chunk >= MIN_SLICE && p.chunk.is_multiple_of(BK as u64), "{:?}", p);
                prop_assert!(p.chunk * (p.splits - 1) < k && p.chunk.checked_mul(p.splits).is_none_or(|c| c >= k));
                prop_assert!(p.splits <= k / MIN_SLICE, "{:?}", p);
            }
        }
    }
}
