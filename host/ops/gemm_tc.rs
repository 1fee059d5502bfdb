//! Matrix products in bf16 and f16 on the tensor cores (host side of
//! `kernels-gpu/src/gemm_tc.rs`, with the epilogue of `kernels-gpu/src/gemm_epilogue.rs`):
//! `C = act(alpha * op(A) @ op(B) + beta * C + bias + row_bias) + residual`, A and B both bf16 or
//! both f16, accumulated in f32, C bf16, f16 or f32 (rounded once, to C's dtype).
//!
//! [`gemm_ex`](super::gemm_ex), [`gemm`](super::gemm()) and [`matmul`](super::matmul) come here
//! for such operands; [`gemm_fused`] is the entry with the whole epilogue.
//!
//! Launch logic (as the f32 GEMM's, `host/ops/gemm.rs`): one block per 128 x 128 tile of C and
//! per batch; when C has fewer tiles than the GPU has SMs and K is long, K is split into slices
//! computed as a batch into an f32 workspace and summed in a fixed order by a second kernel,
//! which applies the epilogue (deterministic: no atomics). Problems beyond the grid's limits
//! are launched in pieces.

use super::Activation;
use super::check::check_same_device;
use super::gemm::{Dims, Gemm, MAX_GRID_YZ, MIN_SLICE, dims, fused_activation, gemm_dims, problem};
use super::gemm_wgmma;
use crate::device::{Device, LaunchConfig};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use kernels_gpu::DType;
use kernels_gpu::gemm::EPI_IDENTITY;
use kernels_gpu::gemm_epilogue::{Epilogue as DevEpilogue, PAIR, QUAD};
use kernels_gpu::gemm_tc::{
    self as tc, GemmTcArgs, SPLITK_THREADS, SplitKReduceTcArgs, splitk_reduce_kernel, tc_kernel,
};

/// What a GEMM does as it stores C, beyond `alpha` and `beta` ([`gemm_fused`]):
/// `C = act(alpha * op(A) @ op(B) + beta * C + bias[col] + row_bias[row]) + residual[row, col]`.
#[derive(Clone, Copy, Debug)]
pub struct Epilogue<'a> {
    /// One value per column of C (`[n]`), of C's dtype.
    pub bias: Option<&'a Tensor>,
    /// One value per row of C (`[m]`), of C's dtype; the same for every matrix of a batch.
    pub row_bias: Option<&'a Tensor>,
    /// Applied before the residual is added: one of those [`Gemm::can_fuse`] accepts.
    pub act: Activation,
    /// Added after the activation: a tensor of C's shape and dtype.
    pub residual: Option<&'a Tensor>,
}

impl Default for Epilogue<'_> {
    /// None of it: `C = alpha * op(A) @ op(B) + beta * C`.
    fn default() -> Self {
        Epilogue { bias: None, row_bias: None, act: Activation::Identity, residual: None }
    }
}

/// The GEMM with the whole epilogue: `C = act(alpha * op(A) @ op(B) + beta * C + bias[col] +
/// row_bias[row]) + residual`, in one kernel (two under split-K), shapes and dtypes as
/// [`gemm_ex`](super::gemm_ex). With bf16 or f16 operands every part of the epilogue is
/// supported. With f32 operands (the f32 GEMM's kernels), `row_bias` and `residual` are not:
/// they return [`Error::InvalidArgument`].
pub fn gemm_fused(a: &Tensor, b: &Tensor, c: &mut Tensor, g: Gemm, epi: Epilogue<'_>) -> Result<()> {
    let op = "gemm";
    let (da, db, dc) = (dims(op, "A", a)?, dims(op, "B", b)?, dims(op, "C", c)?);
    if [a.dtype(), b.dtype(), c.dtype()] == [DType::F32; 3] {
        if epi.row_bias.is_some() || epi.residual.is_some() {
            return Err(Error::InvalidArgument {
                op,
                message: "a row bias or a residual is fused only into bf16 and f16 products (the f32 GEMM \
                          takes a column bias and an activation)"
                    .into(),
            });
        }
        return gemm_dims(op, (a, da), (b, db), (c, dc), g, epi.bias, epi.act);
    }
    gemm_tc_dims(op, (a, da), (b, db), (c, dc), g, epi)
}

/// A problem's sizes: `(batch, m, n, k)`.
type Problem = (u64, u64, u64, u64);

/// An operand in device memory: address (bytes) and element strides.
#[derive(Clone, Copy, Debug)]
struct Mat {
    ptr: u64,
    ld: u64,
    /// Between the matrices of a batch (0: shared).
    stride: u64,
}

impl Mat {
    /// The same operand `elements` further on, of `size` bytes each.
    fn at(self, elements: u64, size: u64) -> Mat {
        Mat { ptr: self.ptr + size * elements, ..self }
    }
}

/// The operands of one product as the kernels take them: A, B (bf16 or f16 of `input`), and
/// the epilogue's D, residual and biases (of `output`).
#[derive(Clone, Copy, Debug)]
struct Operands {
    input: DType,
    output: DType,
    a: Mat,
    b: Mat,
    d: Mat,
    /// Same ld and stride as D; 0: none.
    residual: u64,
    bias_col: u64,
    bias_row: u64,
}

/// The dtypes of a product on the tensor cores: A and B both bf16 or both f16; C any.
fn check_dtypes(op: &'static str, a: &Tensor, b: &Tensor) -> Result<DType> {
    match (a.dtype(), b.dtype()) {
        (DType::BF16, DType::BF16) => Ok(DType::BF16),
        (DType::F16, DType::F16) => Ok(DType::F16),
        (DType::F32, DType::F32) => Err(Error::InvalidArgument {
            op,
            message: "f32 products write an f32 C (for a bf16 or f16 result, give bf16 or f16 operands)".into(),
        }),
        (x, y) => Err(Error::InvalidArgument {
            op,
            message: format!(
                "A is {x:?} and B is {y:?}: a product takes A and B both f32, both bf16 or both f16 (cast one first)"
            ),
        }),
    }
}

/// A vector of the epilogue (bias or row bias): `len` values of C's dtype on A's device.
fn check_vector(op: &'static str, what: &str, t: &Tensor, len: u64, a: &Tensor, c: &Tensor) -> Result<()> {
    check_same_device(op, a, t)?;
    if t.dtype() != c.dtype() {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{what} is {:?} but C is {:?}: it must have C's dtype", t.dtype(), c.dtype()),
        });
    }
    if t.shape() != [len as usize] {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{what} must have shape [{len}], got {:?}", t.shape()),
        });
    }
    Ok(())
}

/// [`gemm_fused`] for bf16 and f16 operands given as [`Dims`] (and the entry of
/// [`gemm_ex`](super::gemm_ex) for them): checks, then launches.
pub(crate) fn gemm_tc_dims(
    op: &'static str,
    (a, da): (&Tensor, Dims),
    (b, db): (&Tensor, Dims),
    (c, dc): (&mut Tensor, Dims),
    g: Gemm,
    epi: Epilogue<'_>,
) -> Result<()> {
    let input = check_dtypes(op, a, b)?;
    let (batch, m, n, k) = problem(op, (a, da), (b, db), (c, dc), &g)?;
    let Some(act) = fused_activation(epi.act) else {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "{:?} cannot be fused into the GEMM's store (Identity, Relu, Gelu, GeluTanh, Silu can)",
                epi.act
            ),
        });
    };
    if let Some(t) = epi.bias {
        check_vector(op, "bias", t, n, a, c)?;
    }
    if let Some(t) = epi.row_bias {
        check_vector(op, "row bias", t, m, a, c)?;
    }
    if let Some(r) = epi.residual {
        check_same_device(op, a, r)?;
        if r.dtype() != c.dtype() || r.shape() != c.shape() {
            return Err(Error::InvalidArgument {
                op,
                message: format!(
                    "the residual must have C's shape and dtype ({:?} {:?}), got {:?} {:?}",
                    c.shape(),
                    c.dtype(),
                    r.shape(),
                    r.dtype()
                ),
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
    let (ar, ac) = if g.trans_a { (k, m) } else { (m, k) };
    let (br, bc) = if g.trans_b { (n, k) } else { (k, n) };
    let stride = |d: Dims, r: u64, cols: u64| if d.0.is_some() { r * cols } else { 0 };
    let ops = Operands {
        input,
        output: c.dtype(),
        a: Mat { ptr: a.dev_ptr_u64(), ld: ac, stride: stride(da, ar, ac) },
        b: Mat { ptr: b.dev_ptr_u64(), ld: bc, stride: stride(db, br, bc) },
        d: Mat { ptr: c.dev_ptr_mut::<u8>()? as u64, ld: n, stride: stride(dc, m, n) },
        residual: epi.residual.map_or(0, |t| t.dev_ptr_u64()),
        bias_col: epi.bias.map_or(0, |t| t.dev_ptr_u64()),
        bias_row: epi.row_bias.map_or(0, |t| t.dev_ptr_u64()),
    };
    let problem = (batch, m, n, k);
    if let Some(done) = try_fast_path(&dev, problem, &ops, &g, act) {
        return done;
    }
    launch(&dev, problem, &ops, &g, act)
}

/// The Hopper kernels' turn (`gemm_wgmma`, sm_90a): `Some(result)` when they took the product,
/// `None` to leave it to the mma.sync kernels. They take every product whose operands the copy
/// engine can read ([`gemm_wgmma::supports`]). A single product with fewer 256 x 256 cluster
/// tiles than the GPU has clusters of two SMs, and a long enough K, is split along K into as
/// many slices as fill the GPU (each at least [`WGMMA_MIN_SLICE`] long), computed into an f32
/// workspace and summed in order by the reduction of the mma.sync path. A single product of at
/// most [`WGMMA_MAX_PAIRED_ROWS`] rows (where a cluster's second tile would lie below D) and
/// fewer column tiles than clusters is split so in any case, the two blocks of a cluster on one
/// tile, each with its own K slice.
fn try_fast_path(dev: &Device, problem: Problem, ops: &Operands, g: &Gemm, act: u32) -> Option<Result<()>> {
    let (batch, m, n, k) = problem;
    // K = 0 (D is the epilogue of zeros) has no tensor to map.
    if k == 0 || m.max(n).max(k) > i32::MAX as u64 {
        return None;
    }
    let a = gemm_wgmma::Operand { ptr: ops.a.ptr, ld: ops.a.ld, stride: ops.a.stride, trans: g.trans_a };
    let b = gemm_wgmma::Operand { ptr: ops.b.ptr, ld: ops.b.ld, stride: ops.b.stride, trans: g.trans_b };
    if !gemm_wgmma::supports(dev, ops.input, ops.output, &a, &b) {
        return None;
    }
    let tiles_n = n.div_ceil(256);
    let cluster_tiles = batch.saturating_mul(m.div_ceil(256)).saturating_mul(tiles_n);
    let clusters = dev.sm_count() as u64 / 2;
    if batch == 1 && m <= WGMMA_MAX_PAIRED_ROWS && tiles_n < clusters && k >= 2 * WGMMA_MIN_PAIRED {
        // One tile row, fewer tiles than clusters: the blocks of a cluster share each tile, in K
        // slices (with more tiles, the workspace would cost more than the idle blocks).
        let pairs = (clusters / tiles_n).min(k / (2 * WGMMA_MIN_SLICE)).max(1);
        return Some(wgmma_split_k(dev, (m, n, k), (pairs, true), ops, (&a, &b), g, act));
    }
    let splits =
        if batch == 1 && cluster_tiles < clusters { (clusters / cluster_tiles).min(k / WGMMA_MIN_SLICE) } else { 1 };
    if splits > 1 {
        return Some(wgmma_split_k(dev, (m, n, k), (splits, false), ops, (&a, &b), g, act));
    }
    let epi = epilogue_for(ops, ops.d, (0, 0), (m, n), g, act);
    Some(gemm_wgmma::launch("gemm", dev, (ops.input, ops.output), problem, &a, &b, epi, None))
}

/// The shortest K slice of the Hopper kernels' split: 8 stages.
const WGMMA_MIN_SLICE: u64 = 512;

/// The shortest K slice where a product of one tile row pairs the blocks of a cluster: 2 stages.
const WGMMA_MIN_PAIRED: u64 = 128;

/// The most rows a product may have for the paired split: one consumer warpgroup's 64, so that
/// each block's other consumer idles. Pairing measured faster than the unpaired kernel at 16
/// rows and slower at 128, where both consumers are busy (docs/worklog.md, 2026-11-27-next).
const WGMMA_MAX_PAIRED_ROWS: u64 = 64;

/// [`try_fast_path`]'s split-K: `splits` (about) equal slices of K, a multiple of the stage;
/// `paired`: `2 * splits` of them, each cluster's two blocks on one tile (at most 128 rows).
fn wgmma_split_k(
    dev: &Device,
    (m, n, k): (u64, u64, u64),
    (splits, paired): (u64, bool),
    ops: &Operands,
    (a, b): (&gemm_wgmma::Operand, &gemm_wgmma::Operand),
    g: &Gemm,
    act: u32,
) -> Result<()> {
    let op = "gemm";
    let slices = if paired { 2 * splits } else { splits };
    let chunk = k.div_ceil(slices).div_ceil(64) * 64;
    // Paired, a last slice that starts beyond K is zeros; unpaired, there is none.
    let (launched, slices) = if paired { (splits, slices) } else { (k.div_ceil(chunk), k.div_ceil(chunk)) };
    let ws = Tensor::alloc(op, dev, &[slices as usize, m as usize, n as usize], DType::F32)?;
    let wm = Mat { ptr: ws.dev_ptr_u64(), ld: n, stride: m * n };
    let partial = Operands { output: DType::F32, d: wm, residual: 0, bias_col: 0, bias_row: 0, ..*ops };
    let plain = Gemm { alpha: 1.0, beta: 0.0, ..*g };
    let epi = epilogue_for(&partial, wm, (0, 0), (m, n), &plain, EPI_IDENTITY);
    let split = gemm_wgmma::Split { chunk, paired };
    gemm_wgmma::launch(op, dev, (ops.input, DType::F32), (launched, m, n, k), a, b, epi, Some(split))?;
    reduce_splits(dev, &ws, slices, (m, n), ops, g, act)
}

/// How one product runs: K slices (1: no split) of `chunk` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    splits: u64,
    chunk: u64,
}

/// The plan for `batch` products of `m x k` by `k x n` on a GPU with `sms` SMs: the f32 GEMM's
/// (`host/ops/gemm.rs`, `plan`), with this kernel's tile and stage depth and its two resident
/// blocks an SM: split K only for a single product whose C has fewer tiles than SMs, into at
/// most one wave of blocks, slices of at least [`MIN_SLICE`]. Total over any sizes.
fn plan(m: u64, n: u64, k: u64, batch: u64, sms: u64) -> Plan {
    let tiles = m.div_ceil(tc::BM as u64).saturating_mul(n.div_ceil(tc::BN as u64));
    if batch == 1 && tiles > 0 && tiles < sms && k >= 2 * MIN_SLICE {
        let splits = (sms.saturating_mul(2) / tiles).min(k / MIN_SLICE);
        if splits > 1 {
            let chunk = k.div_ceil(splits).div_ceil(tc::BK as u64) * tc::BK as u64;
            return Plan { splits: k.div_ceil(chunk), chunk };
        }
    }
    Plan { splits: 1, chunk: k }
}

/// Whether D's (and the residual's) rows and batches allow the epilogue's pair stores: even
/// leading dimension and batch stride, bases aligned to two elements.
fn pair_flag(d: Mat, residual: u64, size: u64) -> u32 {
    let even = d.ld.is_multiple_of(2) && d.stride.is_multiple_of(2);
    let aligned = d.ptr.is_multiple_of(2 * size) && residual.is_multiple_of(2 * size);
    let quad = (d.ld * size).is_multiple_of(16) && (d.stride * size).is_multiple_of(16) && d.ptr.is_multiple_of(16);
    if even && aligned { PAIR | if quad { QUAD } else { 0 } } else { 0 }
}

/// The device epilogue of a launch whose first row of D is `r0` of batch `z0`.
fn epilogue_for(ops: &Operands, d: Mat, (z0, r0): (u64, u64), (m, n): (u64, u64), g: &Gemm, act: u32) -> DevEpilogue {
    let size = ops.output.size() as u64;
    let off = (z0 * d.stride + r0 * d.ld) * size;
    let shift = |p: u64, by: u64| if p == 0 { 0 } else { p + by };
    let residual = shift(ops.residual, off);
    DevEpilogue {
        d: (d.ptr + off) as *mut u8,
        ldd: d.ld,
        stride_d: d.stride,
        residual: residual as *const u8,
        bias_col: ops.bias_col as *const u8,
        bias_row: shift(ops.bias_row, r0 * size) as *const u8,
        m: m as u32,
        n: n as u32,
        alpha: g.alpha,
        beta: g.beta,
        act,
        flags: pair_flag(Mat { ptr: d.ptr + off, ..d }, residual, size),
    }
}

/// Launches the tile kernel over `batch` products into `ops.d` (with its epilogue) or, for a
/// split-K slice, `d` (the f32 workspace, plain epilogue), in pieces within the grid's limits.
fn launch_tiles(dev: &Device, (batch, m, n, k): Problem, ops: &Operands, g: &Gemm, act: u32) -> Result<()> {
    let kernel = tc_kernel(ops.input, ops.output, g.trans_a, g.trans_b).ok_or_else(|| Error::InvalidArgument {
        op: "gemm",
        message: format!("internal: no tensor-core kernel for {:?} operands", ops.input),
    })?;
    let rows_per_launch = MAX_GRID_YZ * tc::BM as u64;
    let gx = n.div_ceil(tc::BN as u64);
    let in_size = ops.input.size() as u64;
    let mut z0 = 0;
    while z0 < batch {
        let nz = (batch - z0).min(MAX_GRID_YZ);
        let mut r0 = 0;
        while r0 < m {
            let nr = (m - r0).min(rows_per_launch);
            // Row r0 of op(A): row r0 of A, or column r0 of the stored transpose.
            let a_off = z0 * ops.a.stride + if g.trans_a { r0 } else { r0 * ops.a.ld };
            let cfg = LaunchConfig {
                grid: (gx as u32, nr.div_ceil(tc::BM as u64) as u32, nz as u32),
                block: (tc::THREADS, 1, 1),
                shared_bytes: tc::SMEM_BYTES,
            };
            let args: GemmTcArgs = (
                ops.a.at(a_off, in_size).ptr as *const u16,
                ops.b.at(z0 * ops.b.stride, in_size).ptr as *const u16,
                ops.a.ld,
                ops.b.ld,
                ops.a.stride,
                ops.b.stride,
                k as u32,
                epilogue_for(ops, ops.d, (z0, r0), (nr, n), g, act),
            );
            // SAFETY: the callers checked that A and B hold the batches of matrices these sizes,
            // leading dimensions and strides describe, and D (C's own memory: `dev_ptr_mut`),
            // the residual (D's shape) and the biases (`n`, `m` values) those of the epilogue,
            // all of the dtypes of this kernel; D is written, the rest only read. The grid
            // covers `nr` rows and `n` columns of each of `nz` products.
            unsafe { dev.launch(kernel, cfg, args)? };
            r0 += nr;
        }
        z0 += nz;
    }
    Ok(())
}

/// Runs the product: one launch of the tile kernel, or split-K into an f32 workspace and the
/// reduction.
fn launch(dev: &Device, (batch, m, n, k): Problem, ops: &Operands, g: &Gemm, act: u32) -> Result<()> {
    let p = plan(m, n, k, batch, dev.sm_count() as u64);
    if p.splits == 1 {
        return launch_tiles(dev, (batch, m, n, k), ops, g, act);
    }
    // Split-K: slice s reads K columns [s * chunk, (s + 1) * chunk) of op(A) and rows of op(B),
    // i.e. a batch whose strides step along K, into f32 workspace slice s.
    let op = "gemm";
    let ws = Tensor::alloc(op, dev, &[p.splits as usize, m as usize, n as usize], DType::F32)?;
    let in_size = ops.input.size() as u64;
    let a_step = if g.trans_a { p.chunk * ops.a.ld } else { p.chunk };
    let b_step = if g.trans_b { p.chunk } else { p.chunk * ops.b.ld };
    let wm = Mat { ptr: ws.dev_ptr_u64(), ld: n, stride: m * n };
    let slice = |s: u64| Operands {
        output: DType::F32,
        a: Mat { stride: a_step, ..ops.a.at(s * a_step, in_size) },
        b: Mat { stride: b_step, ..ops.b.at(s * b_step, in_size) },
        d: wm.at(s * m * n, 4),
        residual: 0,
        bias_col: 0,
        bias_row: 0,
        ..*ops
    };
    let full = if k.is_multiple_of(p.chunk) { p.splits } else { p.splits - 1 };
    let plain = Gemm { alpha: 1.0, beta: 0.0, ..*g };
    launch_tiles(dev, (full, m, n, p.chunk), &slice(0), &plain, EPI_IDENTITY)?;
    if full < p.splits {
        launch_tiles(dev, (1, m, n, k - full * p.chunk), &slice(full), &plain, EPI_IDENTITY)?;
    }
    reduce_splits(dev, &ws, p.splits, (m, n), ops, g, act)
}

/// `D = epilogue(sum of the f32 slices of ws)`, summed in order (deterministic), for a single
/// product whose `splits` partial products `ws` holds (`[splits, m, n]`).
fn reduce_splits(
    dev: &Device,
    ws: &Tensor,
    splits: u64,
    (m, n): (u64, u64),
    ops: &Operands,
    g: &Gemm,
    act: u32,
) -> Result<()> {
    let groups = m * n.div_ceil(2);
    let cfg = LaunchConfig {
        grid: (groups.div_ceil(SPLITK_THREADS as u64) as u32, 1, 1),
        block: (SPLITK_THREADS, 1, 1),
        shared_bytes: 0,
    };
    let args: SplitKReduceTcArgs = (ws.dev_ptr(), splits as u32, epilogue_for(ops, ops.d, (0, 0), (m, n), g, act));
    // SAFETY: ws holds `splits` slices of m x n floats, D (batch 1) is m x n with its residual
    // and biases as checked; one thread per 2 columns of a row, the grid covers m * ceil(n / 2).
    unsafe { dev.launch(splitk_reduce_kernel(ops.output), cfg, args) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn plan_splits_k_only_when_tiles_are_too_few() {
        let sms = 132;
        for (m, n, k) in [(4096, 4096, 4096), (8192, 8192, 128), (2048, 2048, 2048), (1, 1, 1), (100, 100, 100)] {
            assert_eq!(plan(m, n, k, 1, sms).splits, 1, "{m}x{n}x{k}");
        }
        // 128 x 4096 by 4096 and 16 x 4096 by 4096: 32 tiles, 8 slices of 512: 256 blocks, one
        // wave of two an SM.
        for m in [128, 16] {
            let p = plan(m, 4096, 4096, 1, sms);
            assert_eq!((p.splits, p.chunk), (8, 512), "{p:?}");
        }
        // Batched products never split; nor short K.
        assert_eq!(plan(128, 4096, 4096, 2, sms).splits, 1);
        assert_eq!(plan(128, 128, 500, 1, sms).splits, 1);
        // Prime K: the last slice is shorter.
        let p = plan(64, 64, 100_003, 1, sms);
        assert!(p.splits > 1 && p.chunk * (p.splits - 1) < 100_003 && p.chunk * p.splits >= 100_003, "{p:?}");
    }

    #[test]
    fn pair_stores_need_even_rows_and_aligned_bases() {
        let d = |ptr, ld, stride| Mat { ptr, ld, stride };
        // Rows and bases on 16 bytes: 16-byte stores too.
        assert_eq!(pair_flag(d(1 << 20, 8, 64), 0, 2), PAIR | QUAD);
        assert_eq!(pair_flag(d(1 << 20, 8, 0), 1 << 21, 4), PAIR | QUAD);
        // Pairs, not 16 bytes: rows of 12 bytes, a base on 4.
        assert_eq!(pair_flag(d(1 << 20, 6, 0), 0, 2), PAIR);
        assert_eq!(pair_flag(d((1 << 20) + 4, 8, 0), 0, 2), PAIR);
        assert_eq!(pair_flag(d(1 << 20, 7, 0), 0, 2), 0);
        assert_eq!(pair_flag(d(1 << 20, 8, 21), 0, 2), 0);
        assert_eq!(pair_flag(d((1 << 20) + 2, 8, 0), 0, 2), 0);
        assert_eq!(pair_flag(d(1 << 20, 8, 0), (1 << 21) + 4, 4), 0);
    }

    #[test]
    fn epilogue_of_a_piece_starts_at_its_rows() {
        let ops = Operands {
            input: DType::BF16,
            output: DType::F16,
            a: Mat { ptr: 0, ld: 0, stride: 0 },
            b: Mat { ptr: 0, ld: 0, stride: 0 },
            d: Mat { ptr: 1 << 20, ld: 10, stride: 1000 },
            residual: 1 << 24,
            bias_col: 4096,
            bias_row: 8192,
        };
        let g = Gemm { alpha: 2.0, beta: 0.5, ..Gemm::default() };
        let e = epilogue_for(&ops, ops.d, (3, 7), (5, 10), &g, 2);
        assert_eq!(e.d as u64, (1 << 20) + 2 * (3000 + 70));
        assert_eq!(e.residual as u64, (1 << 24) + 2 * (3000 + 70));
        assert_eq!((e.bias_col as u64, e.bias_row as u64), (4096, 8192 + 14));
        assert_eq!(
            (e.m, e.n, e.ldd, e.stride_d, e.alpha, e.beta, e.act, e.flags),
            (5, 10, 10, 1000, 2.0, 0.5, 2, PAIR)
        );
        // Absent parts stay null wherever the piece starts.
        let none = Operands { residual: 0, bias_col: 0, bias_row: 0, ..ops };
        let e = epilogue_for(&none, none.d, (1, 1), (5, 10), &g, 0);
        assert!(e.residual.is_null() && e.bias_col.is_null() && e.bias_row.is_null());
    }

    #[test]
    fn operand_dtypes() {
        // The dtype rules need tensors; their logic is `check_dtypes`' match, mirrored here on
        // the host-only kernel table: f32 inputs have no tensor-core kernel.
        assert!(tc_kernel(DType::F32, DType::F32, false, false).is_none());
        for input in [DType::BF16, DType::F16] {
            for output in DType::ALL {
                for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                    let k = tc_kernel(input, output, ta, tb).unwrap();
                    let layout = format!("{}{}", if ta { 't' } else { 'n' }, if tb { 't' } else { 'n' });
                    assert_eq!(k.name(), format!("gemm_tc_{layout}_{}_{}", input.suffix(), output.suffix()));
                }
            }
        }
        assert_eq!(std::mem::size_of::<DevEpilogue>(), 72);
    }

    fn size() -> impl Strategy<Value = u64> {
        prop_oneof![Just(0u64), Just(1), Just(u64::MAX), Just(u64::MAX - 1), 0..1u64 << 20, any::<u64>()]
    }

    proptest! {
        /// Any sizes give a plan, never a panic, and its slices cover K exactly, each a whole
        /// number of stages and at least `MIN_SLICE` long.
        #[test]
        fn plan_is_total_and_covers_k(m in size(), n in size(), k in size(), batch in size(), sms in size()) {
            let p = plan(m, n, k, batch, sms);
            prop_assert!(p.splits >= 1);
            if p.splits == 1 {
                prop_assert_eq!(p.chunk, k);
            } else {
                prop_assert!(batch == 1 && p.chunk >= MIN_SLICE && p.chunk.is_multiple_of(tc::BK as u64), "{:?}", p);
                prop_assert!(p.chunk * (p.splits - 1) < k && p.chunk.checked_mul(p.splits).is_none_or(|c| c >= k));
                prop_assert!(p.splits <= k / MIN_SLICE, "{:?}", p);
            }
        }
    }
}
