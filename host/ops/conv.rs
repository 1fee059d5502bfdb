//! 2-d convolution (host side of `kernels-gpu/src/conv/`): [`conv2d`] and its gradients
//! [`conv2d_backward`], as PyTorch's `F.conv2d` with stride, padding, dilation and groups.
//!
//! Layouts ([`Layout2d`]): NHWC, `x` `[N, H, W, C]` with the filter `[K, R, S, C/groups]`
//! (channels last in both) and the output `[N, P, Q, K]`; NCHW, PyTorch's `[N, C, H, W]`,
//! `[K, C/groups, R, S]`, `[N, K, P, Q]`. Every tensor is dense in its layout.
//!
//! The forward of bf16 and f16 in NHWC with one group and `C % 8 == 0` runs on the tensor
//! cores (an implicit GEMM, [`uses_tensor_cores`]), and so do the input's and the filter's
//! gradients where also `K % 8 == 0` ([`uses_tensor_cores_backward`]); everything else, and the
//! bias's gradient, runs the general kernels: every shape, deterministic, f32 accumulation, one
//! thread per result (not fast).

use super::check::{check_same_device, check_same_dtype, shapes_match, with_elem};
use crate::DType;
use crate::device::LaunchConfig;
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::Tensor;
use kernels_gpu::conv::{
    ConvBwdDataArgs, ConvDgradTcArgs, ConvElem, ConvFwdArgs, ConvGeom, ConvTcArgs, ConvWPartArgs, ConvWSumArgs,
    ConvWgradTcArgs, out_size, tc_applies, tc_bwd_applies, tc_bwd_kernels, tc_kernel,
};
use kernels_gpu::gemm::EPI_IDENTITY;
use kernels_gpu::gemm_epilogue::{Epilogue, PAIR, QUAD};
use kernels_gpu::gemm_tc as tc;

use super::batchnorm::Layout2d;

/// A convolution's parameters, as `F.conv2d`'s (pairs are `(height, width)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOpts {
    /// The step between output positions, at least 1.
    pub stride: (usize, usize),
    /// Zeros added on both sides.
    pub padding: (usize, usize),
    /// The step between filter taps, at least 1.
    pub dilation: (usize, usize),
    /// Channel groups: C and K are multiples of it (C for depthwise).
    pub groups: usize,
    /// The layout of `x`, the filter and the output.
    pub layout: Layout2d,
}

impl Default for Conv2dOpts {
    /// Stride 1, no padding, no dilation, one group, NHWC.
    fn default() -> Self {
        Conv2dOpts { stride: (1, 1), padding: (0, 0), dilation: (1, 1), groups: 1, layout: Layout2d::Nhwc }
    }
}

/// Which gradients [`conv2d_backward`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvNeeds {
    /// The input's, `dx`.
    pub input: bool,
    /// The filter's, `dw`.
    pub weight: bool,
    /// The bias's, `db` (`[K]`).
    pub bias: bool,
}

impl ConvNeeds {
    /// All three.
    pub const ALL: ConvNeeds = ConvNeeds { input: true, weight: true, bias: true };
}

/// The gradients of [`conv2d_backward`]: those asked for, each in `x`'s dtype.
#[derive(Clone, Debug)]
pub struct Conv2dGrads {
    /// `dx`, `x`'s shape.
    pub input: Option<Tensor>,
    /// `dw`, the filter's shape.
    pub weight: Option<Tensor>,
    /// `db`, `[K]`.
    pub bias: Option<Tensor>,
}

/// The largest size, stride, padding or dilation: the kernels' position arithmetic stays in i64.
const MAX_DIM: usize = i32::MAX as usize;

/// The problem of `x` and `w` under `opts`, checked: ranks, devices, dtypes, groups, channels.
pub fn geometry(op: &'static str, x: &Tensor, w: &Tensor, opts: &Conv2dOpts) -> Result<ConvGeom> {
    check_same_device(op, x, w)?;
    check_same_dtype(op, x, w)?;
    let bad = |message: String| Error::InvalidArgument { op, message };
    let (&[a0, a1, a2, a3], &[b0, b1, b2, b3]) = (x.shape(), w.shape()) else {
        return Err(bad(format!(
            "x and the filter must have 4 dimensions, got x {:?} and filter {:?}",
            x.shape(),
            w.shape()
        )));
    };
    let nhwc = opts.layout == Layout2d::Nhwc;
    let (n, c, h, wd) = if nhwc { (a0, a3, a1, a2) } else { (a0, a1, a2, a3) };
    let (k, cg, r, s) = if nhwc { (b0, b3, b1, b2) } else { (b0, b1, b2, b3) };
    let (g, (sh, sw), (ph, pw), (dh, dw)) = (opts.groups, opts.stride, opts.padding, opts.dilation);
    if g == 0 || sh == 0 || sw == 0 || dh == 0 || dw == 0 {
        return Err(bad(format!(
            "groups, stride and dilation must be at least 1, got groups {g}, stride {:?}, dilation {:?}",
            opts.stride, opts.dilation
        )));
    }
    if r == 0 || s == 0 {
        return Err(bad(format!("the filter {:?} has an empty spatial size {r}x{s}", w.shape())));
    }
    if !c.is_multiple_of(g) || !k.is_multiple_of(g) {
        return Err(bad(format!("groups {g} must divide the input channels {c} and the filters {k}")));
    }
    if cg != c / g {
        let mut want = w.shape().to_vec();
        want[if nhwc { 3 } else { 1 }] = c / g;
        return Err(Error::ShapeMismatch {
            op,
            expected: want,
            got: w.shape().to_vec(),
            detail: "the filter's channels must be x's channels divided by groups",
        });
    }
    let all = [n, c, h, wd, k, r, s, g, sh, sw, ph, pw, dh, dw];
    if all.iter().any(|&v| v > MAX_DIM) || (h + 2 * ph).max(wd + 2 * pw) > MAX_DIM {
        return Err(bad(format!(
            "x {:?}, filter {:?} and {opts:?}: a size or parameter above {MAX_DIM}",
            x.shape(),
            w.shape()
        )));
    }
    let u = |v: usize| v as u32;
    let p = out_size(h as u64, r as u64, sh as u64, ph as u64, dh as u64) as usize;
    let q = out_size(wd as u64, s as u64, sw as u64, pw as u64, dw as u64) as usize;
    Ok(ConvGeom {
        n: u(n),
        c: u(c),
        h: u(h),
        w: u(wd),
        k: u(k),
        r: u(r),
        s: u(s),
        p: u(p),
        q: u(q),
        groups: u(g),
        stride_h: u(sh),
        stride_w: u(sw),
        pad_h: u(ph),
        pad_w: u(pw),
        dil_h: u(dh),
        dil_w: u(dw),
        nhwc: nhwc as u32,
        pad: 0,
    })
}

/// The output's shape: `[N, P, Q, K]` (NHWC) or `[N, K, P, Q]`.
pub fn output_shape(g: &ConvGeom) -> Vec<usize> {
    let [n, k, p, q] = [g.n, g.k, g.p, g.q].map(|v| v as usize);
    if g.nhwc != 0 { vec![n, p, q, k] } else { vec![n, k, p, q] }
}

/// `bias`, if given, must be `[K]` of x's dtype and device.
fn check_bias(op: &'static str, x: &Tensor, bias: Option<&Tensor>, k: usize) -> Result<()> {
    if let Some(b) = bias {
        check_same_device(op, x, b)?;
        check_same_dtype(op, x, b)?;
        shapes_match(op, &[k], b.shape(), "the bias must be [K]")?;
    }
    Ok(())
}

/// Launch geometry of a grid-stride kernel over `total` items.
fn grid(dev: &crate::Device, name: &str, total: u64) -> Result<Option<LaunchConfig>> {
    Ok(launch::elementwise(total, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(name)?))
}

/// Whether [`conv2d`] of `dtype` on the problem `g` ([`geometry`]) runs on the tensor cores:
/// bf16 or f16, NHWC, one group, C a multiple of 8, and the implicit GEMM's sizes within its
/// grid (`N P Q` rows with a tile's 128 more below 2^32, `R S C` below 2^31, K within 65535
/// tiles of 128).
pub fn uses_tensor_cores(dtype: DType, g: &ConvGeom) -> bool {
    let rsc = g.r as u64 * g.s as u64 * g.c as u64;
    tc_applies(dtype, g)
        && g.npq() + tc::BM as u64 <= u32::MAX as u64
        && rsc <= i32::MAX as u64
        && (g.k as u64).div_ceil(tc::BN as u64) <= 65_535
        && g.npq().div_ceil(tc::BM as u64) <= i32::MAX as u64
}

/// Whether [`conv2d_backward`] of `dtype` on the problem `g` ([`geometry`]) computes the input's
/// and the filter's gradients on the tensor cores (the bias's stays on the general kernels):
/// bf16 or f16, NHWC, one group, C and K multiples of 8 (each 16-byte chunk of dy, the filter
/// and x is 8 contiguous elements), and both implicit GEMMs within their grids: `N H W` and `N P
/// Q` rows with a tile's 128 more below 2^32, `R S K` and `R S C` below 2^31, C and K within
/// 65535 tiles of 128. (Tensors not 16-byte aligned, as views from elsewhere may be, also take
/// the general kernels.)
pub fn uses_tensor_cores_backward(dtype: DType, g: &ConvGeom) -> bool {
    let (r, s) = (g.r as u64, g.s as u64);
    let nhw = g.n as u64 * g.h as u64 * g.w as u64;
    let tiles = |v: u32| (v as u64).div_ceil(tc::BN as u64);
    tc_bwd_applies(dtype, g)
        && nhw + tc::BM as u64 <= u32::MAX as u64
        && g.npq() + tc::BM as u64 <= u32::MAX as u64
        && r * s * g.c as u64 <= i32::MAX as u64
        && r * s * g.k as u64 <= i32::MAX as u64
        && tiles(g.c) <= 65_535
        && tiles(g.k) <= 65_535
}

/// Blocks (tiles times chunks) the tensor-core weight gradient aims at: a constant, so that the
/// chunks, and with them the results' bits, depend on the shape alone.
const TC_WGRAD_BLOCKS: u64 = 1024;
// So that the chunks fit the grid's z dimension.
const _: () = assert!(TC_WGRAD_BLOCKS <= 65_535);
/// The fewest terms of a chunk of the tensor-core weight gradient (8 stages).
const TC_WGRAD_MIN_TERMS: u64 = 256;
/// The most floats of its partials (1 GiB), unless a single chunk needs more.
const TC_WGRAD_PART_MAX: u64 = 1 << 28;

/// The tensor-core weight gradient's cut of the `N P Q` terms: `(chunk_len, chunks)`, the
/// length a multiple of 32 (the tile's stage), every chunk starting inside the terms; `(0, 0)`
/// for none. A function of the shape only.
pub fn tc_wgrad_chunking(g: &ConvGeom) -> (u32, u32) {
    let npq = g.npq();
    let rsc = g.r as u64 * g.s as u64 * g.c as u64;
    let e_w = g.k as u64 * rsc;
    if npq == 0 || e_w == 0 {
        return (0, 0);
    }
    let tiles = (g.k as u64).div_ceil(tc::BM as u64) * rsc.div_ceil(tc::BN as u64);
    let want = (TC_WGRAD_BLOCKS / tiles).min(TC_WGRAD_PART_MAX / e_w).min(npq.div_ceil(TC_WGRAD_MIN_TERMS)).max(1);
    let len = npq.div_ceil(want).next_multiple_of(tc::BK as u64);
    (len as u32, npq.div_ceil(len) as u32)
}

/// The tensor-core forward (see [`uses_tensor_cores`]; something to compute).
fn fwd_tc(g: &ConvGeom, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, y: &mut Tensor) -> Result<()> {
    let dev = x.device().clone();
    let kernel = tc_kernel(x.dtype()).ok_or_else(|| Error::InvalidArgument {
        op: "conv2d",
        message: "internal: no tensor-core kernel for f32".into(),
    })?;
    let k = g.k as u64;
    // D = y as the N P Q x K matrix: pairs where K is even, 16-byte rows where K % 8 == 0 (its
    // base is 16-byte aligned: `fwd_into`).
    let flags = if k.is_multiple_of(2) { PAIR | if k.is_multiple_of(8) { QUAD } else { 0 } } else { 0 };
    let e = Epilogue {
        d: y.dev_ptr_mut::<u8>()?,
        ldd: k,
        stride_d: 0,
        residual: std::ptr::null(),
        bias_col: bias.map_or(std::ptr::null(), |b| b.dev_ptr::<u8>()),
        bias_row: std::ptr::null(),
        m: g.npq() as u32,
        n: g.k,
        alpha: 1.0,
        beta: 0.0,
        act: EPI_IDENTITY,
        flags,
    };
    let cfg = LaunchConfig {
        grid: (g.npq().div_ceil(tc::BM as u64) as u32, k.div_ceil(tc::BN as u64) as u32, 1),
        block: (tc::THREADS, 1, 1),
        shared_bytes: tc::SMEM_BYTES,
    };
    let args: ConvTcArgs = (*g, x.dev_ptr(), w.dev_ptr(), e);
    // SAFETY: x is [N, H, W, C] and w [K, R, S, C] of the kernel's dtype (checked), dense, 16-byte
    // aligned allocations, C % 8 == 0 and one group (`uses_tensor_cores`); y is [N, P, Q, K], its
    // memory its own, and the bias K elements; the grid covers N P Q rows and K columns.
    unsafe { dev.launch(kernel, cfg, args) }
}

fn fwd_into(g: &ConvGeom, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, y: &mut Tensor) -> Result<()> {
    let total = y.numel() as u64;
    if total == 0 {
        return Ok(());
    }
    // Tensors wrapped from elsewhere (PyTorch's views) may start off 16 bytes.
    let aligned = [Some(x), Some(w), bias, Some(&*y)].into_iter().flatten().all(|t| t.dev_ptr_u64().is_multiple_of(16));
    if aligned && uses_tensor_cores(x.dtype(), g) {
        return fwd_tc(g, x, w, bias, y);
    }
    let dev = x.device().clone();
    with_elem!(x.dtype(), |T| {
        let kernel = <T as ConvElem>::FWD;
        let Some(cfg) = grid(&dev, kernel.name(), total)? else { return Ok(()) };
        let b = bias.map_or(std::ptr::null(), |b| b.dev_ptr());
        let args: ConvFwdArgs<T> = (*g, x.dev_ptr(), w.dev_ptr(), b, y.dev_ptr_mut()?, total);
        // SAFETY: x, w, bias and y have the shapes `geometry` and `output_shape` give for `g`
        // (checked), dense, of T; bias is null or K elements. y's memory is its own
        // (`dev_ptr_mut`), so nothing read is written.
        unsafe { dev.launch(kernel, cfg, args) }
    })
}

/// 2-d convolution, as `F.conv2d(x, w, bias, stride, padding, dilation, groups)` in the layout
/// of `opts` (see the module). f32, f16 or bf16, all operands of one dtype; sums in f32, rounded
/// once. Output `P = (H + 2 pad_h - dil_h (R - 1) - 1) / stride_h + 1` (and `Q` alike), 0
/// where the padded input is smaller than the dilated filter (PyTorch raises there).
///
/// Non-finite values: the general kernels skip the taps that fall on the padding; the
/// tensor-core path ([`uses_tensor_cores`]) multiplies them as zeros, so there a NaN or infinity
/// in the filter also makes NaN the outputs whose window puts that tap on the padding (as a
/// convolution of the explicitly padded input would).
pub fn conv2d(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, opts: &Conv2dOpts) -> Result<Tensor> {
    let op = "conv2d";
    let g = geometry(op, x, w, opts)?;
    check_bias(op, x, bias, g.k as usize)?;
    let mut y = Tensor::alloc(op, x.device(), &output_shape(&g), x.dtype())?;
    fwd_into(&g, x, w, bias, &mut y)?;
    Ok(y)
}

/// [`conv2d`] into `y`, which must have the output's shape and x's dtype and device.
pub fn conv2d_out(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, opts: &Conv2dOpts, y: &mut Tensor) -> Result<()> {
    let op = "conv2d_out";
    let g = geometry(op, x, w, opts)?;
    check_bias(op, x, bias, g.k as usize)?;
    check_same_device(op, x, y)?;
    check_same_dtype(op, x, y)?;
    shapes_match(op, &output_shape(&g), y.shape(), "y must be the convolution's output shape")?;
    fwd_into(&g, x, w, bias, y)
}

/// Items of the weight gradient's first pass: a thread each per chunk.
const WPART_THREADS: u64 = 1 << 18;

/// The weight gradient's cut of the `npq` terms for `e_all` items: `(chunk_len, chunks)`, about
/// [`WPART_THREADS`] items in all, chunks of at least 64 terms; `(0, 0)` for no terms. A function
/// of the shape only, so results do not depend on the GPU.
pub(crate) fn chunking(npq: u64, e_all: u64) -> (u64, u64) {
    if npq == 0 || e_all == 0 {
        return (0, 0);
    }
    let want = (WPART_THREADS / e_all).clamp(1, npq.div_ceil(64));
    let len = npq.div_ceil(want);
    (len, npq.div_ceil(len))
}

/// The gradients of [`conv2d`]'s input, filter and bias for the output gradient `dy` (the
/// output's shape), those `needs` asks for. Deterministic: every sum in a fixed order, in f32,
/// rounded once (the filter's and bias's over `N P Q` terms in consecutive chunks, added in
/// order). `db[k]` is the sum of `dy` over `N, P, Q`.
///
/// Non-finite values: on the tensor cores ([`uses_tensor_cores_backward`]) the taps that read no
/// output (dx) and the padding (dw) are multiplied as zeros, so there a NaN or infinity in the
/// filter at channel `c` makes NaN all of `dx[.., c]`, and one in `dy` at filter `k` all of
/// `dw[k]` (the general kernels skip those terms).
pub fn conv2d_backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    opts: &Conv2dOpts,
    needs: ConvNeeds,
) -> Result<Conv2dGrads> {
    let op = "conv2d_backward";
    let g = geometry(op, x, w, opts)?;
    let (dev, dt) = (x.device(), x.dtype());
    let mut grads = Conv2dGrads {
        input: needs.input.then(|| Tensor::alloc(op, dev, x.shape(), dt)).transpose()?,
        weight: needs.weight.then(|| Tensor::alloc(op, dev, w.shape(), dt)).transpose()?,
        bias: needs.bias.then(|| Tensor::alloc(op, dev, &[g.k as usize], dt)).transpose()?,
    };
    conv2d_backward_out(x, w, dy, opts, &mut grads)?;
    Ok(grads)
}

/// [`conv2d_backward`] into the gradients `grads` holds (x's dtype and device; `input` of x's
/// shape, `weight` of the filter's, `bias` `[K]`): those present are computed, the others not.
pub fn conv2d_backward_out(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    opts: &Conv2dOpts,
    grads: &mut Conv2dGrads,
) -> Result<()> {
    let op = "conv2d_backward";
    let g = geometry(op, x, w, opts)?;
    check_same_device(op, x, dy)?;
    check_same_dtype(op, x, dy)?;
    shapes_match(op, &output_shape(&g), dy.shape(), "dy must be the convolution's output shape")?;
    let k = [g.k as usize];
    for (t, shape, what) in [
        (&grads.input, x.shape(), "dx must have x's shape"),
        (&grads.weight, w.shape(), "dw must have the filter's shape"),
        (&grads.bias, &k[..], "db must be [K]"),
    ] {
        if let Some(t) = t {
            check_same_device(op, x, t)?;
            check_same_dtype(op, x, t)?;
            shapes_match(op, shape, t.shape(), what)?;
        }
    }
    let dev = x.device().clone();
    let dt = x.dtype();
    // Tensors wrapped from elsewhere (PyTorch's views) may start off 16 bytes.
    let aligned = |ts: &[&Tensor]| ts.iter().all(|t| t.dev_ptr_u64().is_multiple_of(16));
    let tc = uses_tensor_cores_backward(dt, &g) && aligned(&[x, w, dy]);
    if let Some(dx) = grads.input.as_mut() {
        let total = dx.numel() as u64;
        if tc && total > 0 && aligned(&[dx]) {
            dgrad_tc(&g, dy, w, dx)?;
        } else {
            with_elem!(dt, |T| {
                let kernel = <T as ConvElem>::BWD_DATA;
                if let Some(cfg) = grid(&dev, kernel.name(), total)? {
                    let args: ConvBwdDataArgs<T> = (g, dy.dev_ptr(), w.dev_ptr(), dx.dev_ptr_mut()?, total);
                    // SAFETY: dy, w and dx have the shapes of `g` (checked), dense, of T; dx's
                    // memory is its own.
                    unsafe { dev.launch(kernel, cfg, args) }?;
                }
                Ok::<(), Error>(())
            })?;
        }
    }
    match grads.weight.as_mut() {
        Some(dw) if tc && g.npq() > 0 => {
            wgrad_tc(&g, x, dy, dw)?;
            w_general(&g, x, dy, None, grads.bias.as_mut())
        }
        dw => w_general(&g, x, dy, dw, grads.bias.as_mut()),
    }
}

/// The tensor-core backward-data (see [`uses_tensor_cores_backward`]; x, w, dy and dx 16-byte
/// aligned, something to compute).
fn dgrad_tc(g: &ConvGeom, dy: &Tensor, w: &Tensor, dx: &mut Tensor) -> Result<()> {
    let dev = dy.device().clone();
    let (kernel, _) = tc_bwd_kernels(dy.dtype()).ok_or_else(|| Error::InvalidArgument {
        op: "conv2d_backward",
        message: "internal: no tensor-core kernel for f32".into(),
    })?;
    let nhw = g.n as u64 * g.h as u64 * g.w as u64;
    let cfg = LaunchConfig {
        grid: (nhw.div_ceil(tc::BM as u64) as u32, (g.c as u64).div_ceil(tc::BN as u64) as u32, 1),
        block: (tc::THREADS, 1, 1),
        shared_bytes: tc::SMEM_BYTES,
    };
    let args: ConvDgradTcArgs = (*g, dy.dev_ptr(), w.dev_ptr(), dx.dev_ptr_mut()?);
    // SAFETY: dy is [N, P, Q, K], w [K, R, S, C] and dx [N, H, W, C] of the kernel's dtype
    // (checked), dense, 16-byte aligned, C and K multiples of 8 and one group
    // (`uses_tensor_cores_backward`); dx's memory is its own; the grid covers N H W rows and C
    // columns.
    unsafe { dev.launch(kernel, cfg, args) }
}

/// The tensor-core weight gradient (see [`uses_tensor_cores_backward`]; x, w and dy 16-byte
/// aligned, `N P Q > 0`): the chunks' partials ([`tc_wgrad_chunking`]), then their ordered sum.
fn wgrad_tc(g: &ConvGeom, x: &Tensor, dy: &Tensor, dw: &mut Tensor) -> Result<()> {
    let op = "conv2d_backward";
    let dev = x.device().clone();
    let (_, kernel) = tc_bwd_kernels(x.dtype())
        .ok_or_else(|| Error::InvalidArgument { op, message: "internal: no tensor-core kernel for f32".into() })?;
    let e_w = g.w_len();
    let (chunk_len, chunks) = tc_wgrad_chunking(g);
    if chunks == 0 {
        return w_general(g, x, dy, Some(dw), None);
    }
    let rsc = g.r as u64 * g.s as u64 * g.c as u64;
    let mut part = Tensor::alloc(op, &dev, &[(e_w * chunks as u64) as usize], DType::F32)?;
    let cfg = LaunchConfig {
        grid: (rsc.div_ceil(tc::BN as u64) as u32, (g.k as u64).div_ceil(tc::BM as u64) as u32, chunks),
        block: (tc::THREADS, 1, 1),
        shared_bytes: tc::SMEM_BYTES,
    };
    let args: ConvWgradTcArgs = (*g, x.dev_ptr(), dy.dev_ptr(), part.dev_ptr_mut()?, chunk_len);
    // SAFETY: x is [N, H, W, C] and dy [N, P, Q, K] of the kernel's dtype (checked), dense,
    // 16-byte aligned, C and K multiples of 8, one group (`uses_tensor_cores_backward`); part
    // holds `chunks` slices of K R S C floats, its own memory; every chunk starts inside N P Q
    // (`tc_wgrad_chunking`); the grid covers R S C columns, K rows and the chunks.
    unsafe { dev.launch(kernel, cfg, args) }?;
    with_elem!(x.dtype(), |T| {
        let kernel = <T as ConvElem>::BWD_WSUM;
        if let Some(cfg) = grid(&dev, kernel.name(), e_w)? {
            let args: ConvWSumArgs<T> =
                (part.dev_ptr(), dw.dev_ptr_mut()?, std::ptr::null_mut(), e_w, e_w, chunks as u64);
            // SAFETY: part holds e_w * chunks floats (written by the launch before, in stream
            // order); dw holds e_w elements, its own memory; no bias items (e_all = e_w).
            unsafe { dev.launch(kernel, cfg, args) }?;
        }
        Ok::<(), Error>(())
    })
}

/// The general kernels' filter and bias gradients, those given.
fn w_general(g: &ConvGeom, x: &Tensor, dy: &Tensor, dw: Option<&mut Tensor>, db: Option<&mut Tensor>) -> Result<()> {
    let op = "conv2d_backward";
    if dw.is_none() && db.is_none() {
        return Ok(());
    }
    let dev = x.device().clone();
    let e_w = if dw.is_some() { g.w_len() } else { 0 };
    let e_all = e_w + if db.is_some() { g.k as u64 } else { 0 };
    let (chunk_len, chunks) = chunking(g.npq(), e_all);
    let mut part = Tensor::alloc(op, &dev, &[(e_all * chunks) as usize], DType::F32)?;
    with_elem!(x.dtype(), |T| {
        let dwp = match dw {
            Some(t) => t.dev_ptr_mut::<T>()?,
            None => std::ptr::null_mut::<T>(),
        };
        let dbp = match db {
            Some(t) => t.dev_ptr_mut::<T>()?,
            None => std::ptr::null_mut::<T>(),
        };
        let kernel = <T as ConvElem>::BWD_WPART;
        if let Some(cfg) = grid(&dev, kernel.name(), e_all * chunks)? {
            let args: ConvWPartArgs<T> =
                (*g, x.dev_ptr(), dy.dev_ptr(), part.dev_ptr_mut()?, e_w, e_all, chunk_len, chunks);
            // SAFETY: x and dy have the shapes of `g`, dense, of T; part holds e_all * chunks
            // floats, and every chunk starts below N P Q (`chunking`).
            unsafe { dev.launch(kernel, cfg, args) }?;
        }
        let kernel = <T as ConvElem>::BWD_WSUM;
        if let Some(cfg) = grid(&dev, kernel.name(), e_all)? {
            let args: ConvWSumArgs<T> = (part.dev_ptr(), dwp, dbp, e_w, e_all, chunks);
            // SAFETY: part holds e_all * chunks floats (written by the launch before, in stream
            // order); dw holds e_w elements (null when e_w is 0), db e_all - e_w (null when that
            // is 0), each its own memory.
            unsafe { dev.launch(kernel, cfg, args) }?;
        }
        Ok::<(), Error>(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_terms() {
        assert_eq!(chunking(0, 10), (0, 0));
        assert_eq!(chunking(10, 0), (0, 0));
        for (npq, e) in [(1, 1), (63, 5), (64 * 56 * 56, 64 * 64 * 9), (200_704, 64), (7, 1 << 20), (1 << 30, 1)] {
            let (len, chunks) = chunking(npq, e);
            assert!(len >= 1 && chunks >= 1, "{npq} {e}");
            // Every chunk starts inside the terms and together they cover them.
            assert!((chunks - 1) * len < npq && chunks * len >= npq, "{npq} {e}: {len} x {chunks}");
            assert!(e * chunks <= WPART_THREADS.max(e), "{npq} {e}");
        }
    }

    /// ResNet's 3x3 layer of 64 channels at 56 x 56, batch 64, NHWC: the tests' base geometry.
    fn resnet_3x3() -> ConvGeom {
        ConvGeom {
            n: 64,
            c: 64,
            h: 56,
            w: 56,
            k: 64,
            r: 3,
            s: 3,
            p: 56,
            q: 56,
            groups: 1,
            stride_h: 1,
            stride_w: 1,
            pad_h: 1,
            pad_w: 1,
            dil_h: 1,
            dil_w: 1,
            nhwc: 1,
            pad: 0,
        }
    }

    #[test]
    fn tensor_core_weight_chunks() {
        let g = resnet_3x3();
        assert_eq!(tc_wgrad_chunking(&ConvGeom { n: 0, ..g }), (0, 0));
        for g in [
            g,
            ConvGeom { n: 1, h: 3, w: 3, p: 3, q: 3, ..g },
            ConvGeom { n: 1, h: 1, w: 1, p: 1, q: 1, ..g },
            ConvGeom { c: 2048, k: 512, r: 1, s: 1, h: 7, w: 7, p: 7, q: 7, pad_h: 0, pad_w: 0, ..g },
            ConvGeom { c: 512, k: 512, h: 7, w: 7, p: 7, q: 7, ..g },
            ConvGeom { n: 256, c: 8, k: 8, h: 224, w: 224, r: 7, s: 7, p: 112, q: 112, ..g },
            ConvGeom { c: 4096, k: 4096, r: 7, s: 7, h: 1, w: 1, p: 1, q: 1, pad_h: 3, pad_w: 3, ..g },
        ] {
            let (len, chunks) = tc_wgrad_chunking(&g);
            let (len, chunks, npq) = (len as u64, chunks as u64, g.npq());
            assert!(len >= 1 && chunks >= 1 && len.is_multiple_of(tc::BK as u64), "{g:?}: {len} x {chunks}");
            // Every chunk starts inside the terms and together they cover them.
            assert!((chunks - 1) * len < npq && chunks * len >= npq, "{g:?}: {len} x {chunks}");
            assert!(chunks <= TC_WGRAD_BLOCKS, "{g:?}: {chunks}");
            assert!(chunks == 1 || chunks * g.w_len() <= TC_WGRAD_PART_MAX, "{g:?}: {chunks}");
        }
    }

    #[test]
    fn tensor_core_rule() {
        let g = resnet_3x3();
        assert!(uses_tensor_cores(DType::BF16, &g) && uses_tensor_cores(DType::F16, &g));
        assert!(!uses_tensor_cores(DType::F32, &g));
        for other in [
            ConvGeom { nhwc: 0, ..g },
            ConvGeom { groups: 2, ..g },
            ConvGeom { c: 3, ..g },
            ConvGeom { c: 0, ..g },
            // N P Q past the epilogue's 32-bit rows.
            ConvGeom { n: 1 << 21, ..g },
        ] {
            assert!(!uses_tensor_cores(DType::BF16, &other), "{other:?}");
        }
        assert!(uses_tensor_cores_backward(DType::BF16, &g) && uses_tensor_cores_backward(DType::F16, &g));
        assert!(!uses_tensor_cores_backward(DType::F32, &g));
        for other in [
            ConvGeom { nhwc: 0, ..g },
            ConvGeom { groups: 2, ..g },
            ConvGeom { c: 3, ..g },
            ConvGeom { k: 12, ..g },
            ConvGeom { k: 0, ..g },
            // N H W past 32-bit rows (N P Q too).
            ConvGeom { n: 1 << 21, ..g },
            // N H W past 32-bit rows, N P Q not (a strided 1x1).
            ConvGeom { n: 1 << 19, h: 112, w: 112, r: 1, s: 1, p: 56, q: 56, stride_h: 2, stride_w: 2, ..g },
        ] {
            assert!(!uses_tensor_cores_backward(DType::BF16, &other), "{other:?}");
        }
        assert_eq!(output_shape(&g), vec![64, 56, 56, 64]);
        assert_eq!(output_shape(&ConvGeom { nhwc: 0, k: 8, p: 3, q: 5, ..g }), vec![64, 8, 3, 5]);
    }
}
