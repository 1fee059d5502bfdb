//! Layer norm and RMS norm over the last dimension (host side of `kernels-gpu/src/norm.rs`),
//! forward and backward, and the same fused with the residual add before them
//! (`add_layer_norm`, `add_rms_norm`: `h = x + residual`, `y = norm(h)`, one pass each way).

use super::check::{check_same_device, check_same_dtype, check_same_shape, row_matches, rows_cols, with_elem};
use crate::error::{Error, Result};
use crate::launch;
use crate::rows::{self, RowPlan, Spread, fwd_row_plan, row_plan};
use crate::tensor::Tensor;
use kernels_gpu::DType;
use kernels_gpu::kernel::Kernel;
use kernels_gpu::norm::{
    COLSUM_LANES, NormBwdArgs, NormBwdOneArgs, NormColGradArgs, NormColsumArgs, NormElem, NormFwdArgs, NormOp,
    ONE_CLUSTER, SLICES_THREADS, padded, slices_smem_floats,
};
use kernels_gpu::rows::RowVariant;

/// PyTorch's default `eps` of `layer_norm`.
pub const LAYER_NORM_EPS: f32 = 1e-5;

/// What the forward saves for the backward: per row, the mean (layer norm only) and
/// `rstd = 1 / sqrt(var + eps)`, f32 of shape `x.shape()[..last]`.
#[derive(Debug)]
pub struct NormStats {
    /// Each row's mean (layer norm; `None` for RMS norm).
    pub mean: Option<Tensor>,
    /// Each row's `1 / sqrt(var + eps)` (layer norm) or `1 / sqrt(mean(x^2) + eps)` (RMS norm).
    pub rstd: Tensor,
}

/// Gradients of a norm: of the input, and of the weight and bias where the forward had them.
#[derive(Debug)]
pub struct NormGrads {
    /// Of the input: its shape and dtype.
    pub x: Tensor,
    /// Of the weight (`[cols]`), where asked for.
    pub weight: Option<Tensor>,
    /// Of the bias (`[cols]`, layer norm only), where asked for.
    pub bias: Option<Tensor>,
}

/// What the fused residual add and norm ([`add_layer_norm`], [`add_rms_norm`]) return.
#[derive(Debug)]
pub struct AddNorm {
    /// The norm of `h`: `x`'s shape and dtype.
    pub y: Tensor,
    /// The new residual `h = x + residual`, rounded to the dtype as PyTorch's eager `x + residual`
    /// (an f32 sum, rounded once): the next layer's residual and the backward's input.
    pub h: Tensor,
    /// The statistics of `h`'s rows, for the backward.
    pub stats: NormStats,
}

/// The fused add's operands of a forward: `h = x + residual` is written to `h` and normalised;
/// `residual` `None`: `h` holds the residual and is overwritten (in place).
struct Residual<'a> {
    residual: Option<&'a Tensor>,
    h: &'a mut Tensor,
}

/// The register-resident instances the forward chooses from for rows of `cols`: the op's, eight
/// vectors a thread only where [`rows::eight_vectors_fwd`] says.
fn fwd_vectors<T>(op: &NormOp<T>, dt: DType, cols: u64) -> Vec<usize> {
    op.fwd.reg_vectors().filter(|&v| v < 8 || rows::eight_vectors_fwd(dt, cols)).collect()
}

/// A launch of the backward's row kernels.
type BwdPlan<T> = RowPlan<Kernel<NormBwdArgs<T>>>;

/// The forward's kernel and launch (of the fused add's kernels if `add`).
fn forward_plan<T: NormElem>(
    dev: &crate::Device,
    kind: Kind,
    add: bool,
    rows: u64,
    cols: u64,
) -> Result<Option<RowPlan<Kernel<NormFwdArgs<T>>>>> {
    let dt = T::DTYPE;
    let table = T::NORM;
    let op = kind.op(&table, add);
    fwd_row_plan(dev, &op.fwd, dt, rows, cols, &fwd_vectors(op, dt, cols), kind.fwd_spread(dt))
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Layer,
    Rms,
}

impl Kind {
    /// The kind's kernels in `table`, the fused residual add's if `add`.
    fn op<T>(self, table: &kernels_gpu::norm::NormKernels<T>, add: bool) -> &NormOp<T> {
        table.op(self == Kind::Layer, add)
    }
    /// How the forward spreads a row of `dt` (see [`Spread::Two`]): two vectors a thread for
    /// f16/bf16, four for f32.
    ///
    /// f32 RMS norm's four-vector kernel holds 40 registers (six 256-thread blocks an SM) and ran
    /// faster than two vectors at mid shapes, and f32 layer norm lost with two vectors as often as it
    /// gained (H100, docs/worklog.md, 2026-11-26g). Layer norm's f16/bf16 two-vector kernel holds 32
    /// registers since its parameters' defaults are packed (40 before, when two vectors were mixed
    /// too), and beat four vectors from 4096 x 256 to 65536 x 1024, level at 262144 x 128 and 16384 x
    /// 4096 (H100, bf16, docs/worklog.md, 2026-11-26h).
    fn fwd_spread(self, dt: DType) -> Spread {
        if dt == DType::F32 { Spread::Wide } else { Spread::Two }
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

/// The written counterpart of [`ptr_or_null`] (a shared tensor is copied first, so it can fail).
fn ptr_mut_or_null<T>(t: Option<&mut Tensor>) -> Result<*mut T> {
    Ok(match t {
        Some(t) => t.dev_ptr_mut()?,
        None => std::ptr::null_mut(),
    })
}

fn forward(
    op: &'static str,
    kind: Kind,
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<(Tensor, NormStats)> {
    let (_, _) = rows_of(op, x)?;
    let (mut y, mut stats) = (x.alloc_like(op)?, alloc_stats(op, kind, x)?);
    forward_out(op, kind, x, None, weight, bias, eps, &mut y, &mut stats)?;
    Ok((y, stats))
}

/// The fused forward into new tensors: `h = x + residual` and its norm.
fn add_forward(
    op: &'static str,
    kind: Kind,
    x: &Tensor,
    residual: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<AddNorm> {
    let (_, _) = rows_of(op, x)?;
    let mut out = AddNorm { y: x.alloc_like(op)?, h: x.alloc_like(op)?, stats: alloc_stats(op, kind, x)? };
    let AddNorm { y, h, stats } = &mut out;
    forward_out(op, kind, x, Some(Residual { residual: Some(residual), h }), weight, bias, eps, y, stats)?;
    Ok(out)
}

/// The fused forward in place: `h = x + residual` into `residual`, and its norm.
fn add_forward_(
    op: &'static str,
    kind: Kind,
    x: &Tensor,
    residual: &mut Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<(Tensor, NormStats)> {
    let (_, _) = rows_of(op, x)?;
    let (mut y, mut stats) = (x.alloc_like(op)?, alloc_stats(op, kind, x)?);
    forward_out(op, kind, x, Some(Residual { residual: None, h: residual }), weight, bias, eps, &mut y, &mut stats)?;
    Ok((y, stats))
}

/// New statistics for the rows of `x` (a mean for layer norm); `x` has a last dimension.
fn alloc_stats(op: &'static str, kind: Kind, x: &Tensor) -> Result<NormStats> {
    let dev = x.device();
    let stat_shape = &x.shape()[..x.shape().len() - 1];
    let mean = if kind == Kind::Layer { Some(Tensor::alloc(op, dev, stat_shape, DType::F32)?) } else { None };
    Ok(NormStats { mean, rstd: Tensor::alloc(op, dev, stat_shape, DType::F32)? })
}

/// The forward into `y` and `stats`; with `add`, of `h = x + residual` (written to `add.h`).
#[allow(clippy::too_many_arguments)]
fn forward_out(
    op: &'static str,
    kind: Kind,
    x: &Tensor,
    add: Option<Residual<'_>>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
    y: &mut Tensor,
    stats: &mut NormStats,
) -> Result<()> {
    check_eps(op, eps)?;
    check_param(op, x, weight, "the weight must match the last dimension")?;
    check_param(op, x, bias, "the bias must match the last dimension")?;
    let (rows, cols) = rows_of(op, x)?;
    let dev = x.device();
    check_same_device(op, x, y)?;
    check_same_dtype(op, x, y)?;
    check_same_shape(op, x, y, "the output must have the input's shape")?;
    if let Some(r) = &add {
        for (t, what) in
            [(r.residual, "the residual must have the input's shape"), (Some(&*r.h), "h must have the input's shape")]
        {
            if let Some(t) = t {
                check_same_device(op, x, t)?;
                check_same_dtype(op, x, t)?;
                check_same_shape(op, x, t, what)?;
            }
        }
    }
    let stat_shape = &x.shape()[..x.shape().len() - 1];
    check_stats(op, kind, x, stats, stat_shape)?;
    let NormStats { mean, rstd } = stats;
    with_elem!(x.dtype(), |T| {
        if let Some(p) = forward_plan::<T>(dev, kind, add.is_some(), rows, cols)? {
            // `h` first: made writable (copied if a clone shares it) before its address is read,
            // which in place is also the residual's.
            let (res_p, h_p): (*const T, *mut T) = match add {
                Some(Residual { residual, h }) => {
                    let h_p = h.dev_ptr_mut()?;
                    (residual.map_or(h_p as *const T, |r| r.dev_ptr()), h_p)
                }
                None => (std::ptr::null(), std::ptr::null_mut()),
            };
            let mean_p = ptr_mut_or_null(mean.as_mut())?;
            let args: NormFwdArgs<T> = (
                x.dev_ptr(),
                ptr_or_null(weight),
                ptr_or_null(bias),
                y.dev_ptr_mut()?,
                mean_p,
                rstd.dev_ptr_mut()?,
                rows,
                cols,
                eps,
                res_p,
                h_p,
            );
            // SAFETY: x, y hold rows * cols elements of T, weight and bias cols (or are null),
            // mean and rstd rows floats (mean null for rms); residual and h rows * cols (h the
            // residual in place; distinct from x and y, which `&mut` and the copy on write of a
            // shared tensor ensure) for the fused kernels, null for the others.
            unsafe { dev.launch(p.kernel, p.cfg, args) }?;
        }
        Ok(())
    })
}

/// The statistics must be f32, one per row, on x's device; a mean exactly for layer norm.
fn check_stats(op: &'static str, kind: Kind, x: &Tensor, stats: &NormStats, stat_shape: &[usize]) -> Result<()> {
    check_same_device(op, x, &stats.rstd)?;
    shapes_f32(op, &stats.rstd, stat_shape)?;
    match (kind, &stats.mean) {
        (Kind::Layer, Some(m)) => {
            check_same_device(op, x, m)?;
            shapes_f32(op, m, stat_shape)
        }
        (Kind::Layer, None) => Err(Error::InvalidArgument { op, message: "layer norm statistics have no mean".into() }),
        (Kind::Rms, Some(_)) => Err(Error::InvalidArgument { op, message: "RMS norm statistics have no mean".into() }),
        (Kind::Rms, None) => Ok(()),
    }
}

/// Launches `norm_colsum` over `partial[2][chunks][cols]` into the `[cols]` tensors of the
/// input's dtype that are given: the weight gradient `w`, the bias gradient `b`.
fn colsums(
    x: &Tensor,
    partial: &Tensor,
    chunks: u64,
    cols: u64,
    w: Option<&mut Tensor>,
    b: Option<&mut Tensor>,
) -> Result<()> {
    let dev = x.device();
    let cfg = crate::device::LaunchConfig {
        grid: (cols.div_ceil(32) as u32, 2, 1),
        block: (32, COLSUM_LANES, 1),
        shared_bytes: 32 * COLSUM_LANES * 4,
    };
    with_elem!(x.dtype(), |T| {
        let kernel = T::NORM.colsum;
        let args: NormColsumArgs<T> = (partial.dev_ptr(), ptr_mut_or_null(w)?, ptr_mut_or_null(b)?, chunks, cols);
        // SAFETY: partial holds 2 * chunks * cols floats (the caller's buffer); the outputs cols
        // elements each (checked by the caller), or are null. `norm_colsum` waits for the
        // backward before its first access.
        unsafe { dev.launch_dependent(kernel, cfg, args) }
    })
}

#[allow(clippy::too_many_arguments)]
fn backward(
    op: &'static str,
    kind: Kind,
    x: &Tensor,
    weight: Option<&Tensor>,
    want_bias: bool,
    stats: &NormStats,
    grad: &Tensor,
    grad_h: Option<&Tensor>,
) -> Result<NormGrads> {
    let (_, cols) = rows_of(op, x)?;
    let dev = x.device();
    let alloc = |on: bool| on.then(|| Tensor::alloc(op, dev, &[cols as usize], x.dtype())).transpose();
    let mut grads = NormGrads { x: x.alloc_like(op)?, weight: alloc(weight.is_some())?, bias: alloc(want_bias)? };
    backward_out(op, kind, x, weight, stats, grad, grad_h, &mut grads)?;
    Ok(grads)
}

/// The backward into `grads`: the weight's gradient is computed if `grads.weight` is given (which
/// needs the weight), the bias's if `grads.bias` is; `grad_h` (the fused add's `dh`, `x`'s shape)
/// is added to the input's gradient.
#[allow(clippy::too_many_arguments)]
fn backward_out(
    op: &'static str,
    kind: Kind,
    x: &Tensor,
    weight: Option<&Tensor>,
    stats: &NormStats,
    grad: &Tensor,
    grad_h: Option<&Tensor>,
    grads: &mut NormGrads,
) -> Result<()> {
    check_param(op, x, weight, "the weight must match the last dimension")?;
    check_same_device(op, x, grad)?;
    check_same_dtype(op, x, grad)?;
    check_same_shape(op, x, grad, "grad must have the input's shape")?;
    if let Some(d) = grad_h {
        check_same_device(op, x, d)?;
        check_same_dtype(op, x, d)?;
        check_same_shape(op, x, d, "the residual's gradient must have the input's shape")?;
    }
    let (rows, cols) = rows_of(op, x)?;
    let stat_shape = &x.shape()[..x.shape().len() - 1];
    check_stats(op, kind, x, stats, stat_shape)?;
    let mean_p: *const f32 = stats.mean.as_ref().map_or(std::ptr::null(), |m| m.dev_ptr());
    check_same_device(op, x, &grads.x)?;
    check_same_dtype(op, x, &grads.x)?;
    check_same_shape(op, x, &grads.x, "the input's gradient must have the input's shape")?;
    if grads.weight.is_some() && weight.is_none() {
        return Err(Error::InvalidArgument { op, message: "a weight gradient was asked for without a weight".into() });
    }
    check_param(op, x, grads.weight.as_ref(), "the weight's gradient must match the last dimension")?;
    check_param(op, x, grads.bias.as_ref(), "the bias's gradient must match the last dimension")?;
    let NormGrads { x: gx, weight: gw, bias: gb } = grads;
    with_elem!(x.dtype(), |T| {
        backward_launch::<T>(op, kind, (rows, cols), x, weight, stats, (grad, grad_h), mean_p, gx, gw, gb)
    })
}

/// [`backward_out`]'s launches for elements of `T`, its arguments checked: the fused add's
/// kernels where `grad_h` is given, else the norm's.
#[allow(clippy::too_many_arguments)]
fn backward_launch<T: NormElem>(
    op: &'static str,
    kind: Kind,
    (rows, cols): (u64, u64),
    x: &Tensor,
    weight: Option<&Tensor>,
    stats: &NormStats,
    (grad, grad_h): (&Tensor, Option<&Tensor>),
    mean_p: *const f32,
    gx: &mut Tensor,
    gw: &mut Option<Tensor>,
    gb: &mut Option<Tensor>,
) -> Result<()> {
    let dev = x.device();
    let dt = x.dtype();
    let table = T::NORM;
    let norm = kind.op(&table, grad_h.is_some());
    let dh_p: *const T = ptr_or_null(grad_h);
    let want_params = gw.is_some() || gb.is_some();
    let slices = if want_params { slices_plan(dev, norm, dt, rows, cols)? } else { None };
    if let Some(p) = slices {
        let args: NormBwdOneArgs<T> = (
            x.dev_ptr(),
            ptr_or_null(weight),
            grad.dev_ptr(),
            mean_p,
            stats.rstd.dev_ptr(),
            gx.dev_ptr_mut()?,
            ptr_mut_or_null(gw.as_mut())?,
            ptr_mut_or_null(gb.as_mut())?,
            rows,
            cols,
            dh_p,
        );
        // SAFETY: x, grad, gx (and dh, or null) hold rows * cols elements of T; weight, dw, db
        // cols (or null); the statistics rows floats (checked above); the launch is one
        // cluster of the kernel's size, its blocks and shared memory as `bwd_slices` requires
        // (slices_plan). gx aliases no input: `&mut`, and a shared tensor is copied first.
        return unsafe { dev.launch(p.kernel, p.cfg, args) };
    }
    let Some((p, chunks)) = backward_plan(dev, norm, dt, rows, cols, want_params)? else {
        // No rows: the parameter gradients are sums over nothing.
        for g in [gw, gb].into_iter().flatten() {
            g.fill_(0.0)?;
        }
        return Ok(());
    };
    let cfg = p.cfg;
    let mut partial = match chunks {
        Some(chunks) if want_params => {
            Some((Tensor::alloc(op, dev, &[2, chunks as usize, cols as usize], DType::F32)?, chunks))
        }
        _ => None,
    };
    let part_p = ptr_mut_or_null(partial.as_mut().map(|(t, _)| t))?;
    let args: NormBwdArgs<T> = (
        x.dev_ptr(),
        ptr_or_null(weight),
        grad.dev_ptr(),
        mean_p,
        stats.rstd.dev_ptr(),
        gx.dev_ptr_mut()?,
        part_p,
        rows,
        cols,
        dh_p,
    );
    // SAFETY: x, grad, gx (and dh, or null) hold rows * cols elements of T; weight cols (or
    // null); the statistics rows floats (checked above); partial 2 * grid * cols floats or null.
    unsafe { dev.launch(p.kernel, cfg, args) }?;
    if !want_params {
        return Ok(());
    }
    if partial.is_none() {
        // Streaming rows: the column sums are a pass of their own.
        let (ccfg, chunks) = launch::col_reduce(rows, cols, dev.sm_count(), 8).expect("rows and cols > 0");
        let mut t = Tensor::alloc(op, dev, &[2, chunks as usize, cols as usize], DType::F32)?;
        let args: NormColGradArgs<T> =
            (x.dev_ptr(), grad.dev_ptr(), mean_p, stats.rstd.dev_ptr(), t.dev_ptr_mut()?, rows, cols);
        // SAFETY: as above; partial holds 2 * chunks * cols floats for grid.y = chunks.
        unsafe { dev.launch(norm.colgrad, ccfg, args) }?;
        partial = Some((t, chunks as u64));
    }
    let (t, chunks) = partial.as_ref().expect("set above");
    colsums(x, t, *chunks, cols, gw.as_mut(), gb.as_mut())
}

/// The backward with parameter gradients as one cluster of eight or sixteen blocks, each a
/// slice of the columns of every row (`<stem>_bwd_slices_k<K>_v<V>_<dt>`, sm_90; see
/// `bwd_slices` in kernels-gpu/src/norm.rs): block `k` of `bx` (across its slice of the
/// columns) by `by` threads, a thread one vector of the slice in `V` rows, the fewest `V` that
/// holds the rows in at most [`SLICES_THREADS`] threads.
/// `None` outside [`slices_shape`], where the device has no such kernel or the rows do not fit.
fn slices_plan<T>(
    dev: &crate::Device,
    norm: &NormOp<T>,
    dt: DType,
    rows: u64,
    cols: u64,
) -> Result<Option<RowPlan<Kernel<NormBwdOneArgs<T>>>>> {
    let vec = with_elem!(dt, |T| <T as kernels_gpu::Elem>::VEC as u64);
    if !slices_shape(rows, cols, vec) {
        return Ok(None);
    }
    // Sixteen blocks where eight would hold more than 8192 elements each, if the device can
    // schedule a cluster that large (Hopper's non-portable size; not every GPC of every part
    // has 16 SMs free); else eight.
    let sizes: &[u32] = if rows * cols > SLICES_ELEMS_PER_BLOCK * ONE_CLUSTER as u64 {
        &[SLICES_WIDE_CLUSTER, ONE_CLUSTER]
    } else {
        &[ONE_CLUSTER]
    };
    for &k in sizes {
        // Threads across a slice: a power of two up to a warp (several rows a warp), else whole
        // warps. Blocks left with no columns (fewer vectors than blocks) still add their zeros.
        let per = (cols / vec).div_ceil(k as u64);
        let bx = if per <= 32 { per.next_power_of_two() } else { per.div_ceil(32) * 32 };
        let Some(instances) = norm.slices(k) else { return Ok(None) };
        for &(v, kernel) in instances.kernels {
            if !dev.has_kernel(kernel.name()) {
                return Ok(None);
            }
            let limit = SLICES_THREADS.min(dev.max_threads(kernel.name())?) as u64;
            // Whole warps: the row sums' shuffles take all 32 lanes.
            let by = rows.div_ceil(v as u64).next_multiple_of(32u64.div_ceil(bx));
            if bx * by > limit {
                continue;
            }
            let [_, _, floats] = slices_smem_floats(rows, bx as u32, by as u32, vec as u32);
            if floats * 4 > dev.max_shared_bytes() as usize {
                break;
            }
            if k > ONE_CLUSTER && dev.max_active_clusters(kernel.name(), k, (bx * by) as u32, (floats * 4) as u32)? == 0
            {
                break;
            }
            let cfg = crate::device::LaunchConfig {
                grid: (k, 1, 1),
                block: (bx as u32, by as u32, 1),
                shared_bytes: (floats * 4) as u32,
            };
            return Ok(Some(RowPlan { kernel, cfg, v: Some(v) }));
        }
    }
    Ok(None)
}

/// Most rows the slices backward takes. On the H100 the slices in eight blocks beat the plans
/// before them (the single cluster of a row a block, the persistent plan) at every shape of at
/// most 64 rows measured, in both norms and in f32 and bf16; from 96 rows they lost: there the
/// persistent plan spreads many short rows over the whole GPU, the slices hold eight rows a
/// thread on eight SMs (sixteen blocks did not move that bound either: see
/// `SLICES_ELEMS_PER_BLOCK`; docs/worklog.md, 2026-11-26b).
const SLICES_MAX_ROWS: u64 = 64;
/// Most elements the slices backward takes: the largest launches measured (64 x 2048, 16 x
/// 8192, 8 x 16384).
const SLICES_MAX_ELEMS: u64 = 1 << 17;
/// Blocks of the wide slices cluster (`<stem>_bwd_slices_k16_...`, a non-portable size).
const SLICES_WIDE_CLUSTER: u32 = 16;
/// Elements a block of the eight-block cluster holds at most before the launch takes sixteen:
/// then its thread holds up to eight rows, and half the columns a block halves that. H100, us,
/// eight / sixteen blocks (f32 layer norm; RMS norm and bf16 alike): 64 x 2048 10.5 / 8.9,
/// 32 x 4096 11.1 / 9.3, 16 x 8192 11.5 / 9.9, 8 x 16384 12.5 / 10.7; at 2^16 elements and
/// below sixteen gained nothing (64 x 1024 8.3 / 8.7, 8 x 1024 6.5 / 6.5).
const SLICES_ELEMS_PER_BLOCK: u64 = 8192;

/// Whether `rows` x `cols` (with `vec` elements a vector) is a shape for the slices backward:
/// whole vectors, 1 to [`SLICES_MAX_ROWS`] rows, at most [`SLICES_MAX_ELEMS`] elements.
fn slices_shape(rows: u64, cols: u64, vec: u64) -> bool {
    (1..=SLICES_MAX_ROWS).contains(&rows) && rows * cols <= SLICES_MAX_ELEMS && cols.is_multiple_of(vec)
}

/// The backward's kernel and launch, and the number of partial rows of dw, db it writes
/// (`None`: it writes none, and a column pass computes them). In order of preference:
/// - register-resident, one group per row, persistent (one wave of blocks, each with its own
///   partial row), when the row fits one block's registers and its column sums shared memory,
///   unless that leaves an f16/bf16 launch one block of 512 threads an SM;
/// - register-resident in a thread-block cluster (sm_90), one partial row per cluster;
/// - streaming.
fn backward_plan<T>(
    dev: &crate::Device,
    norm: &NormOp<T>,
    dt: DType,
    rows: u64,
    cols: u64,
    want_params: bool,
) -> Result<Option<(BwdPlan<T>, Option<u64>)>> {
    // The cluster kernel's launch and its partial rows of dw, db: one per cluster.
    let cluster = || -> Result<Option<(BwdPlan<T>, Option<u64>)>> {
        Ok(cluster_plan(dev, norm, dt, rows, cols, want_params)?.map(|(c, p)| {
            let chunks = (p.cfg.grid.0 / c) as u64;
            (p, Some(chunks))
        }))
    };
    let avail: Vec<usize> = norm.bwd.reg_vectors().collect();
    let Some(mut p) = row_plan(dev, &norm.bwd, dt, rows, cols, &avail, Spread::Wide)? else {
        return Ok(None);
    };
    // The register-resident kernel keeps each group's column sums in shared memory.
    let sums_bytes = if want_params { p.cfg.block.1 as u64 * 2 * padded(cols) as u64 * 4 } else { 0 };
    let fits = p.v.is_some() && p.cfg.shared_bytes as u64 + sums_bytes <= dev.max_shared_bytes() as u64;
    if fits {
        p.cfg.shared_bytes += sums_bytes as u32;
        let threads = p.cfg.block.0 * p.cfg.block.1;
        let per_sm = dev.blocks_per_sm(p.kernel.name(), threads, p.cfg.shared_bytes)?;
        // f16/bf16 rows of about 6600-8192 columns take two vectors a thread in 416-512 threads
        // of 72-80 registers: one block an SM, 13-16 warps. A cluster of smaller blocks keeps more
        // in flight and was faster for bf16 at 8192 x 8192 on the H100 (f32 at 8192 columns, also one
        // 512-thread block an SM, went the other way, and so did bf16 at 4096 columns, three
        // 256-thread blocks: docs/worklog.md, 2026-11-25). Not for eight rows an SM or fewer: there
        // the one wave of blocks beat the cluster; from about nine rows an SM the cluster led
        // (docs/worklog.md, 2026-11-26g). RMS norm's bf16 kernel holds 64 registers, two blocks an
        // SM, and stays.
        let thin = dt != DType::F32 && per_sm * threads < 768 && rows > 8 * dev.sm_count() as u64;
        if thin && let Some(plan) = cluster()? {
            return Ok(Some(plan));
        }
        p.cfg.grid.0 = p.cfg.grid.0.min(dev.sm_count() * per_sm);
        let chunks = p.cfg.grid.0 as u64;
        return Ok(Some((p, Some(chunks))));
    }
    if let Some(plan) = cluster()? {
        return Ok(Some(plan));
    }
    if p.v.is_some() {
        let kernel = rows::instance(&norm.bwd, RowVariant::Stream)?;
        let vec = with_elem!(dt, |T| <T as kernels_gpu::Elem>::VEC as u64);
        let g = rows::group_size(cols.div_ceil(vec), 4).min(dev.max_threads(kernel.name())? / 32 * 32);
        p = RowPlan { kernel, cfg: rows::grid(rows, g).expect("rows > 0"), v: None };
    }
    Ok(Some((p, None)))
}

/// The kernels that the forward and the backward of layer norm (`layer`) or RMS norm run on
/// `dev` for rows x cols of `dt`, the backward with or without parameter gradients (for tests:
/// which path a shape takes).
#[doc(hidden)]
pub fn norm_kernels(
    dev: &crate::Device,
    layer: bool,
    dt: DType,
    rows: u64,
    cols: u64,
    params: bool,
) -> Result<[String; 2]> {
    kernels_of(dev, layer, false, dt, rows, cols, params)
}

/// [`norm_kernels`] of the fused residual add and norm, the backward with `dh` (without it, the
/// backward is the norm's).
#[doc(hidden)]
pub fn add_norm_kernels(
    dev: &crate::Device,
    layer: bool,
    dt: DType,
    rows: u64,
    cols: u64,
    params: bool,
) -> Result<[String; 2]> {
    kernels_of(dev, layer, true, dt, rows, cols, params)
}

fn kernels_of(
    dev: &crate::Device,
    layer: bool,
    add: bool,
    dt: DType,
    rows: u64,
    cols: u64,
    params: bool,
) -> Result<[String; 2]> {
    let kind = if layer { Kind::Layer } else { Kind::Rms };
    with_elem!(dt, |T| {
        let table = T::NORM;
        let norm = kind.op(&table, add);
        let fwd = forward_plan::<T>(dev, kind, add, rows, cols)?.map(|p| p.kernel.name());
        let one = if params { slices_plan(dev, norm, dt, rows, cols)? } else { None };
        let bwd = match one {
            Some(p) => Some(p.kernel.name()),
            None => backward_plan(dev, norm, dt, rows, cols, params)?.map(|(p, _)| p.kernel.name()),
        };
        Ok([fwd.unwrap_or_default().to_string(), bwd.unwrap_or_default().to_string()])
    })
}

/// Vectors of `x` and of `g` a thread of the cluster kernels (`<op>_bwd_c<C>_v<V>_<dt>`, sm_90
/// only, the sizes `C` from the family's table) holds (within the 64 registers of a 1024-thread
/// block: build_ptx.rs).
const CLUSTER_VECTORS: u64 = 2;

/// The backward of rows too long for one block's registers, held by a cluster of blocks
/// instead (see `bwd_reg` in kernels-gpu/src/norm.rs): when the device's module has the
/// kernels (sm_90), the rows are whole vectors and short enough. A persistent grid of as many
/// clusters as can be resident at once, each walking rows; `None` otherwise. Returns the
/// cluster size with the plan.
fn cluster_plan<T>(
    dev: &crate::Device,
    norm: &NormOp<T>,
    dt: DType,
    rows: u64,
    cols: u64,
    want_params: bool,
) -> Result<Option<(u32, BwdPlan<T>)>> {
    let v = CLUSTER_VECTORS;
    let sums = |run_cols: u64| if want_params { 2 * padded(run_cols) as u64 * 4 } else { 0 };
    let sizes: Vec<u32> = norm.bwd.cluster_sizes(v as usize).collect();
    let Some(cs) = rows::cluster_kernel(dev, &norm.bwd, dt, cols, v, &sizes, 1024, sums)? else {
        return Ok(None);
    };
    if rows == 0 {
        return Ok(None);
    }
    let resident = dev.max_active_clusters(cs.kernel.name(), cs.blocks, cs.threads, cs.shared_bytes)?;
    if resident == 0 {
        return Ok(None);
    }
    let clusters = (resident as u64).min(rows) as u32;
    let cfg = crate::device::LaunchConfig {
        grid: (clusters * cs.blocks, 1, 1),
        block: (cs.threads, 1, 1),
        shared_bytes: cs.shared_bytes,
    };
    Ok(Some((cs.blocks, RowPlan { kernel: cs.kernel, cfg, v: Some(v as usize) })))
}

fn shapes_f32(op: &'static str, t: &Tensor, shape: &[usize]) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch { op, expected: DType::F32, got: t.dtype() });
    }
    super::check::shapes_match(op, shape, t.shape(), "norm statistics must have one entry per row")
}

/// Layer norm over the last dimension, as `F.layer_norm(x, (cols,), weight, bias, eps)`
/// (biased variance). Returns the output and the statistics the backward needs.
pub fn layer_norm(x: &Tensor, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f32) -> Result<(Tensor, NormStats)> {
    forward("layer_norm", Kind::Layer, x, weight, bias, eps)
}

/// Gradients of [`layer_norm`]: of `x`, of the weight if given, and of the bias if given. `weight`
/// and `bias` are the forward's (the bias's value is not needed, only whether there is one).
pub fn layer_norm_backward(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    stats: &NormStats,
    grad: &Tensor,
) -> Result<NormGrads> {
    let op = "layer_norm_backward";
    check_param(op, x, bias, "the bias must match the last dimension")?;
    backward(op, Kind::Layer, x, weight, bias.is_some(), stats, grad, None)
}

/// RMS norm over the last dimension, as `F.rms_norm(x, (cols,), weight, eps)`:
/// `x / sqrt(mean(x^2) + eps) * weight`. PyTorch's default `eps` is the dtype's epsilon
/// (`torch.finfo(x.dtype).eps`); pass it explicitly.
pub fn rms_norm(x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<(Tensor, NormStats)> {
    forward("rms_norm", Kind::Rms, x, weight, None, eps)
}

/// Gradients of [`rms_norm`]: of `x` and of the weight.
pub fn rms_norm_backward(x: &Tensor, weight: Option<&Tensor>, stats: &NormStats, grad: &Tensor) -> Result<NormGrads> {
    backward("rms_norm_backward", Kind::Rms, x, weight, false, stats, grad, None)
}

/// [`layer_norm`] into `y` (the shape and dtype of `x`) and `stats` (f32, one per row, with a
/// mean).
pub fn layer_norm_out(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
    y: &mut Tensor,
    stats: &mut NormStats,
) -> Result<()> {
    forward_out("layer_norm", Kind::Layer, x, None, weight, bias, eps, y, stats)
}

/// [`layer_norm_backward`] into `grads`: the weight's gradient if `grads.weight` is given, the
/// bias's if `grads.bias` is.
pub fn layer_norm_backward_out(
    x: &Tensor,
    weight: Option<&Tensor>,
    stats: &NormStats,
    grad: &Tensor,
    grads: &mut NormGrads,
) -> Result<()> {
    backward_out("layer_norm_backward", Kind::Layer, x, weight, stats, grad, None, grads)
}

/// [`rms_norm`] into `y` (the shape and dtype of `x`) and `stats` (f32, one per row, no mean).
pub fn rms_norm_out(
    x: &Tensor,
    weight: Option<&Tensor>,
    eps: f32,
    y: &mut Tensor,
    stats: &mut NormStats,
) -> Result<()> {
    forward_out("rms_norm", Kind::Rms, x, None, weight, None, eps, y, stats)
}

/// [`rms_norm_backward`] into `grads` (the weight's gradient if `grads.weight` is given; no bias).
pub fn rms_norm_backward_out(
    x: &Tensor,
    weight: Option<&Tensor>,
    stats: &NormStats,
    grad: &Tensor,
    grads: &mut NormGrads,
) -> Result<()> {
    if grads.bias.is_some() {
        return Err(Error::InvalidArgument { op: "rms_norm_backward", message: "RMS norm has no bias".into() });
    }
    backward_out("rms_norm_backward", Kind::Rms, x, weight, stats, grad, None, grads)
}

/// The residual add fused with layer norm: `h = x + residual` (rounded to the dtype, as PyTorch's
/// eager `x + residual`), `y = layer_norm(h)` as [`layer_norm`], in one kernel: one read of `x` and
/// `residual`, one write of `h` and `y`. Returns `y`, `h` and `h`'s statistics for the backward.
pub fn add_layer_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<AddNorm> {
    add_forward("add_layer_norm", Kind::Layer, x, residual, weight, bias, eps)
}

/// [`add_layer_norm`] in place: `h` is written over `residual` (a clone sharing its memory is
/// left as it was); returns `y` and the statistics.
pub fn add_layer_norm_(
    x: &Tensor,
    residual: &mut Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<(Tensor, NormStats)> {
    add_forward_("add_layer_norm", Kind::Layer, x, residual, weight, bias, eps)
}

/// [`add_layer_norm`] into `out` (`y` and `h` of `x`'s shape and dtype, the statistics f32 with a
/// mean).
pub fn add_layer_norm_out(
    x: &Tensor,
    residual: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
    out: &mut AddNorm,
) -> Result<()> {
    let AddNorm { y, h, stats } = out;
    let add = Some(Residual { residual: Some(residual), h });
    forward_out("add_layer_norm", Kind::Layer, x, add, weight, bias, eps, y, stats)
}

/// Gradients of [`add_layer_norm`] from the forward's `h` and statistics, `grad` (of `y`) and
/// `grad_h` (of `h`, flowing in from later layers through the residual stream; `None`: zero).
/// `.x` is the gradient of both `x` and `residual` (`grad_h + layer_norm_backward(grad)`, one
/// rounding), `.weight`, `.bias` as [`layer_norm_backward`]'s. One pass over the rows plus the
/// weight's column sums, as the norm's backward.
pub fn add_layer_norm_backward(
    h: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    stats: &NormStats,
    grad: &Tensor,
    grad_h: Option<&Tensor>,
) -> Result<NormGrads> {
    let op = "add_layer_norm_backward";
    check_param(op, h, bias, "the bias must match the last dimension")?;
    backward(op, Kind::Layer, h, weight, bias.is_some(), stats, grad, grad_h)
}

/// [`add_layer_norm_backward`] into `grads` (the weight's gradient if `grads.weight` is given,
/// the bias's if `grads.bias` is).
pub fn add_layer_norm_backward_out(
    h: &Tensor,
    weight: Option<&Tensor>,
    stats: &NormStats,
    grad: &Tensor,
    grad_h: Option<&Tensor>,
    grads: &mut NormGrads,
) -> Result<()> {
    backward_out("add_layer_norm_backward", Kind::Layer, h, weight, stats, grad, grad_h, grads)
}

/// The residual add fused with RMS norm: `h = x + residual` (rounded to the dtype, as PyTorch's
/// eager `x + residual`), `y = rms_norm(h)` as [`rms_norm`], in one kernel: one read of `x` and
/// `residual`, one write of `h` and `y`. Returns `y`, `h` and `h`'s statistics for the backward.
pub fn add_rms_norm(x: &Tensor, residual: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<AddNorm> {
    add_forward("add_rms_norm", Kind::Rms, x, residual, weight, None, eps)
}

/// [`add_rms_norm`] in place: `h` is written over `residual` (a clone sharing its memory is left
/// as it was); returns `y` and the statistics.
pub fn add_rms_norm_(
    x: &Tensor,
    residual: &mut Tensor,
    weight: Option<&Tensor>,
    eps: f32,
) -> Result<(Tensor, NormStats)> {
    add_forward_("add_rms_norm", Kind::Rms, x, residual, weight, None, eps)
}

/// [`add_rms_norm`] into `out` (`y` and `h` of `x`'s shape and dtype, the statistics f32, no
/// mean).
pub fn add_rms_norm_out(
    x: &Tensor,
    residual: &Tensor,
    weight: Option<&Tensor>,
    eps: f32,
    out: &mut AddNorm,
) -> Result<()> {
    let AddNorm { y, h, stats } = out;
    let add = Some(Residual { residual: Some(residual), h });
    forward_out("add_rms_norm", Kind::Rms, x, add, weight, None, eps, y, stats)
}

/// Gradients of [`add_rms_norm`] from the forward's `h` and statistics, `grad` (of `y`) and
/// `grad_h` (of `h`; `None`: zero): `.x` of both `x` and `residual` (`grad_h +
/// rms_norm_backward(grad)`, one rounding), `.weight` as [`rms_norm_backward`]'s.
pub fn add_rms_norm_backward(
    h: &Tensor,
    weight: Option<&Tensor>,
    stats: &NormStats,
    grad: &Tensor,
    grad_h: Option<&Tensor>,
) -> Result<NormGrads> {
    backward("add_rms_norm_backward", Kind::Rms, h, weight, false, stats, grad, grad_h)
}

/// [`add_rms_norm_backward`] into `grads` (the weight's gradient if `grads.weight` is given; no
/// bias).
pub fn add_rms_norm_backward_out(
    h: &Tensor,
    weight: Option<&Tensor>,
    stats: &NormStats,
    grad: &Tensor,
    grad_h: Option<&Tensor>,
    grads: &mut NormGrads,
) -> Result<()> {
    let op = "add_rms_norm_backward";
    if grads.bias.is_some() {
        return Err(Error::InvalidArgument { op, message: "RMS norm has no bias".into() });
    }
    backward_out(op, Kind::Rms, h, weight, stats, grad, grad_h, grads)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cluster plan asks the table for instances at [`CLUSTER_VECTORS`]: every storage type
    /// and both norms must declare some there, or their long rows would silently stream.
    #[test]
    fn cluster_instances_are_at_the_planned_vectors() {
        fn check<T: NormElem>() {
            let table = T::NORM;
            for kind in [Kind::Layer, Kind::Rms] {
                for add in [false, true] {
                    let sizes: Vec<u32> = kind.op(&table, add).bwd.cluster_sizes(CLUSTER_VECTORS as usize).collect();
                    assert!(!sizes.is_empty(), "{:?}", T::DTYPE);
                }
            }
        }
        check::<f32>();
        check::<kernels_gpu::F16>();
        check::<kernels_gpu::BF16>();
    }

    #[test]
    fn slices_take_few_rows() {
        for (rows, cols, vec, yes) in [
            (1, 4, 4, true),
            (8, 1024, 4, true),
            (64, 1024, 4, true),
            (64, 2048, 8, true),
            (16, 8192, 4, true),
            (4, 32768, 8, true),
            (0, 1024, 4, false),
            (65, 1024, 4, false),
            (64, 2056, 4, false),
            (8, 32768, 4, false),
            (8, 1022, 4, false),
        ] {
            assert_eq!(slices_shape(rows, cols, vec), yes, "{rows} x {cols}, {vec} a vector");
        }
    }
}
