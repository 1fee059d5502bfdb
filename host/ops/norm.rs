//! Layer norm and RMS norm over the last dimension (host side of `kernels-gpu/src/norm.rs`),
//! forward and backward.

use super::{check_same_device, check_same_dtype, check_same_shape, row_matches, row_plan, rows_cols, with_elem};
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::Tensor;
use kernels_gpu::DType;
use kernels_gpu::kernel::Params;
use kernels_gpu::norm::{COLSUM_LANES, NormBwdArgs, NormColGradArgs, NormColsumArgs, NormFwdArgs, padded};

/// PyTorch's default `eps` of `layer_norm`.
pub const LAYER_NORM_EPS: f32 = 1e-5;

/// What the forward saves for the backward: per row, the mean (layer norm only) and
/// `rstd = 1 / sqrt(var + eps)`, f32 of shape `x.shape()[..last]`.
#[derive(Debug)]
pub struct NormStats {
    pub mean: Option<Tensor>,
    pub rstd: Tensor,
}

/// Gradients of a norm: of the input, and of the weight and bias where the forward had them.
#[derive(Debug)]
pub struct NormGrads {
    pub x: Tensor,
    pub weight: Option<Tensor>,
    pub bias: Option<Tensor>,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Layer,
    Rms,
}

impl Kind {
    fn stem(self) -> &'static str {
        match self {
            Kind::Layer => "layer_norm",
            Kind::Rms => "rms_norm",
        }
    }
    fn fwd_vectors(self, dt: DType) -> &'static [usize] {
        if dt == DType::F32 { &[1, 2, 4, 8] } else { &[1, 2, 4] }
    }
    fn bwd_vectors(dt: DType) -> &'static [usize] {
        if dt == DType::F32 { &[1, 2, 4] } else { &[1, 2] }
    }
}

fn check_param(op: &'static str, x: &Tensor, p: Option<&Tensor>, what: &'static str) -> Result<()> {
    if let Some(p) = p {
        check_same_device(op, x, p)?;
        check_same_dtype(op, x, p)?;
        row_matches(op, x.shape(), p.shape(), what)?;
    }
    Ok(())
}

fn check_eps(op: &'static str, eps: f32) -> Result<()> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::InvalidArgument { op, message: format!("eps must be finite and >= 0, got {eps}") });
    }
    Ok(())
}

fn rows_of(op: &'static str, x: &Tensor) -> Result<(u64, u64)> {
    let (rows, cols) = rows_cols(op, x)?;
    if cols == 0 {
        return Err(Error::InvalidArgument {
            op,
            message: format!("cannot normalise rows of length 0 (shape {:?})", x.shape()),
        });
    }
    Ok((rows, cols))
}

fn ptr_or_null<T>(t: Option<&Tensor>) -> *const T {
    t.map_or(std::ptr::null(), |t| t.dev_ptr())
}

fn forward(
    op: &'static str,
    kind: Kind,
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<(Tensor, NormStats)> {
    check_eps(op, eps)?;
    check_param(op, x, weight, "the weight must match the last dimension")?;
    check_param(op, x, bias, "the bias must match the last dimension")?;
    let (rows, cols) = rows_of(op, x)?;
    let dev = x.device();
    let stat_shape = &x.shape()[..x.shape().len() - 1];
    let mut y = x.alloc_like(op)?;
    let mut mean = if kind == Kind::Layer { Some(Tensor::alloc(op, dev, stat_shape, DType::F32)?) } else { None };
    let mut rstd = Tensor::alloc(op, dev, stat_shape, DType::F32)?;
    let dt = x.dtype();
    let stem = format!("{}_fwd", kind.stem());
    if let Some(p) = row_plan(dev, &stem, dt, rows, cols, kind.fwd_vectors(dt), true)? {
        let mean_p = mean.as_mut().map_or(std::ptr::null_mut(), |m| m.dev_ptr_mut());
        with_elem!(dt, |T| {
            let args: NormFwdArgs<T> = (
                x.dev_ptr(),
                ptr_or_null(weight),
                ptr_or_null(bias),
                y.dev_ptr_mut(),
                mean_p,
                rstd.dev_ptr_mut(),
                rows,
                cols,
                eps,
            );
            // SAFETY: x, y hold rows * cols elements of T, weight and bias cols (or are null),
            // mean and rstd rows floats (mean null for rms).
            unsafe { dev.launch(&p.kernel, p.cfg, args) }
        })?;
    }
    Ok((y, NormStats { mean, rstd }))
}

/// Launches `norm_colsum` over `partial[2][chunks][cols]` into new `[cols]` tensors of the
/// input's dtype: the weight gradient if `dw`, the bias gradient if `db`.
fn colsums(
    op: &'static str,
    x: &Tensor,
    partial: &Tensor,
    chunks: u64,
    cols: u64,
    dw: bool,
    db: bool,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let dev = x.device();
    let alloc = |on: bool| on.then(|| Tensor::alloc(op, dev, &[cols as usize], x.dtype())).transpose();
    let (mut w, mut b) = (alloc(dw)?, alloc(db)?);
    let cfg = crate::device::LaunchConfig {
        grid: (cols.div_ceil(32) as u32, 2, 1),
        block: (32, COLSUM_LANES, 1),
        shared_bytes: 32 * COLSUM_LANES * 4,
    };
    let kernel = kernels_gpu::kernel_name!("norm_colsum", x.dtype());
    with_elem!(x.dtype(), |T| {
        let ptr = |t: &mut Option<Tensor>| t.as_mut().map_or(std::ptr::null_mut(), |t| t.dev_ptr_mut::<T>());
        let args: NormColsumArgs<T> = (partial.dev_ptr(), ptr(&mut w), ptr(&mut b), chunks, cols);
        // SAFETY: partial holds 2 * chunks * cols floats (the caller's buffer); the outputs cols
        // elements each, or are null.
        unsafe { dev.launch(kernel, cfg, args) }
    })?;
    Ok((w, b))
}

fn backward(
    op: &'static str,
    kind: Kind,
    x: &Tensor,
    weight: Option<&Tensor>,
    want_bias: bool,
    stats: &NormStats,
    grad: &Tensor,
) -> Result<NormGrads> {
    check_param(op, x, weight, "the weight must match the last dimension")?;
    check_same_device(op, x, grad)?;
    check_same_dtype(op, x, grad)?;
    check_same_shape(op, x, grad, "grad must have the input's shape")?;
    let (rows, cols) = rows_of(op, x)?;
    let stat_shape = &x.shape()[..x.shape().len() - 1];
    shapes_f32(op, &stats.rstd, stat_shape)?;
    let mean_p: *const f32 = match (kind, &stats.mean) {
        (Kind::Layer, Some(m)) => {
            shapes_f32(op, m, stat_shape)?;
            m.dev_ptr()
        }
        (Kind::Layer, None) => {
            return Err(Error::InvalidArgument { op, message: "layer norm statistics have no mean".into() });
        }
        (Kind::Rms, _) => std::ptr::null(),
    };
    let dev = x.device();
    let dt = x.dtype();
    let mut gx = x.alloc_like(op)?;
    let want_params = weight.is_some() || want_bias;
    let stem = format!("{}_bwd", kind.stem());
    let Some(mut p) = row_plan(dev, &stem, dt, rows, cols, Kind::bwd_vectors(dt), true)? else {
        // No rows: the parameter gradients are sums over nothing.
        let zeros = |on: bool| on.then(|| Tensor::zeros(dev, &[cols as usize], dt)).transpose();
        return Ok(NormGrads { x: gx, weight: zeros(weight.is_some())?, bias: zeros(want_bias)? });
    };
    // The register-resident kernel keeps each group's column sums in shared memory.
    let sums_bytes = if want_params { p.cfg.block.1 as u64 * 2 * padded(cols) as u64 * 4 } else { 0 };
    if p.v.is_some() && p.cfg.shared_bytes as u64 + sums_bytes > dev.max_shared_bytes() as u64 {
        let kernel = format!("{stem}_stream_{}", dt.suffix());
        let vec = with_elem!(dt, |T| <T as kernels_gpu::Elem>::VEC as u64);
        let g = launch::group_size(cols.div_ceil(vec), 4).min(dev.max_threads(&kernel)? / 32 * 32);
        p = super::RowPlan { kernel, cfg: launch::rows(rows, g).expect("rows > 0"), v: None };
    }
    let mut cfg = p.cfg;
    let mut partial: Option<(Tensor, u64)> = None;
    if p.v.is_some() {
        // Persistent: one wave of blocks, each with its own partial row of dw and db.
        cfg.shared_bytes += sums_bytes as u32;
        let per_sm = dev.blocks_per_sm(&p.kernel, cfg.block.0 * cfg.block.1, cfg.shared_bytes)?;
        cfg.grid.0 = cfg.grid.0.min(dev.sm_count() * per_sm);
        if want_params {
            let chunks = cfg.grid.0 as u64;
            partial = Some((Tensor::alloc(op, dev, &[2, chunks as usize, cols as usize], DType::F32)?, chunks));
        }
    }
    let part_p = partial.as_mut().map_or(std::ptr::null_mut(), |(t, _)| t.dev_ptr_mut::<f32>());
    with_elem!(dt, |T| {
        let args: NormBwdArgs<T> = (
            x.dev_ptr(),
            ptr_or_null(weight),
            grad.dev_ptr(),
            mean_p,
            stats.rstd.dev_ptr(),
            gx.dev_ptr_mut(),
            part_p,
            rows,
            cols,
        );
        // SAFETY: x, grad, gx hold rows * cols elements of T; weight cols (or null); the
        // statistics rows floats (checked above); partial 2 * grid * cols floats or null.
        unsafe { dev.launch(&p.kernel, cfg, args) }
    })?;
    if !want_params {
        return Ok(NormGrads { x: gx, weight: None, bias: None });
    }
    if partial.is_none() {
        // Streaming rows: the column sums are a pass of their own.
        let (ccfg, chunks) = launch::col_reduce(rows, cols, dev.sm_count(), 8).expect("rows and cols > 0");
        let mut t = Tensor::alloc(op, dev, &[2, chunks as usize, cols as usize], DType::F32)?;
        let kernel = format!("{}_colgrad_{}", kind.stem(), dt.suffix());
        with_elem!(dt, |T| {
            let args: NormColGradArgs<T> =
                (x.dev_ptr(), grad.dev_ptr(), mean_p, stats.rstd.dev_ptr(), t.dev_ptr_mut(), rows, cols);
            // SAFETY: as above; partial holds 2 * chunks * cols floats for grid.y = chunks.
            unsafe { dev.launch(&kernel, ccfg, args) }
        })?;
        partial = Some((t, chunks as u64));
    }
    let (t, chunks) = partial.as_ref().expect("set above");
    let (dw, db) = colsums(op, x, t, *chunks, cols, weight.is_some(), want_bias)?;
    Ok(NormGrads { x: gx, weight: dw, bias: db })
}

fn shapes_f32(op: &'static str, t: &Tensor, shape: &[usize]) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch { op, expected: DType::F32, got: t.dtype() });
    }
    super::shapes_match(op, shape, t.shape(), "norm statistics must have one entry per row")
}

/// Layer norm over the last dimension, as `F.layer_norm(x, (cols,), weight, bias, eps)`
/// (biased variance). Returns the output and the statistics the backward needs.
pub fn layer_norm(x: &Tensor, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f32) -> Result<(Tensor, NormStats)> {
    forward("layer_norm", Kind::Layer, x, weight, bias, eps)
}

/// Gradients of [`layer_norm`]: of `x`, and of the weight and (if `bias` was used) the bias.
pub fn layer_norm_backward(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: bool,
    stats: &NormStats,
    grad: &Tensor,
) -> Result<NormGrads> {
    backward("layer_norm_backward", Kind::Layer, x, weight, bias, stats, grad)
}

/// RMS norm over the last dimension, as `F.rms_norm(x, (cols,), weight, eps)`:
/// `x / sqrt(mean(x^2) + eps) * weight`. PyTorch's default `eps` is the dtype's epsilon
/// (`torch.finfo(x.dtype).eps`); pass it explicitly.
pub fn rms_norm(x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<(Tensor, NormStats)> {
    forward("rms_norm", Kind::Rms, x, weight, None, eps)
}

/// Gradients of [`rms_norm`]: of `x` and of the weight.
pub fn rms_norm_backward(x: &Tensor, weight: Option<&Tensor>, stats: &NormStats, grad: &Tensor) -> Result<NormGrads> {
    backward("rms_norm_backward", Kind::Rms, x, weight, false, stats, grad)
}

pub(crate) fn launched_kernels() -> Vec<(String, usize)> {
    let mut v = Vec::new();
    for dt in DType::ALL {
        let (f, b, c, s) = with_elem!(dt, |T| (
            <NormFwdArgs<T> as Params>::ARITY,
            <NormBwdArgs<T> as Params>::ARITY,
            <NormColGradArgs<T> as Params>::ARITY,
            <NormColsumArgs<T> as Params>::ARITY
        ));
        let sfx = dt.suffix();
        for kind in [Kind::Layer, Kind::Rms] {
            let st = kind.stem();
            v.extend(kind.fwd_vectors(dt).iter().map(|n| (format!("{st}_fwd_v{n}_{sfx}"), f)));
            v.extend(Kind::bwd_vectors(dt).iter().map(|n| (format!("{st}_bwd_v{n}_{sfx}"), b)));
            v.push((format!("{st}_fwd_stream_{sfx}"), f));
            v.push((format!("{st}_bwd_stream_{sfx}"), b));
            v.push((format!("{st}_colgrad_{sfx}"), c));
        }
        v.push((format!("norm_colsum_{sfx}"), s));
    }
    v
}
