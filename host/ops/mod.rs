//! The operations. One file per kernel family, named as its device-side counterpart in
//! `kernels-gpu/src/`. Every op validates devices, dtypes and shapes before it launches, and
//! returns an error naming itself and the offending shapes otherwise.

pub mod cross_entropy;
pub mod elementwise;
pub mod gemm;
pub mod init;
pub mod linear;
pub mod mathprobe;
pub mod norm;
pub mod optim;
pub mod reduce;
pub mod softmax;
pub mod transpose;

pub use cross_entropy::*;
pub use elementwise::*;
pub use gemm::*;
pub use linear::*;
pub use norm::*;
pub use optim::*;
pub use reduce::*;
pub use softmax::*;
pub use transpose::*;

/// Every kernel the row-operation families launch (softmax, norms, cross-entropy, reductions,
/// transpose), the GEMM and the optimizer, with the parameter count of the signature the host launches it
/// with; checked against the PTX by `tests/cpu.rs`.
pub fn row_family_kernels() -> Vec<(String, usize)> {
    let mut v = softmax::launched_kernels();
    v.extend(norm::launched_kernels());
    v.extend(cross_entropy::launched_kernels());
    v.extend(reduce::launched_kernels());
    v.extend(transpose::launched_kernels());
    v.extend(gemm::launched_kernels());
    v.extend(optim::launched_kernels());
    v
}

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Runs `$body` with the type alias `$T` bound to the device storage type of `$dt`
/// (`f32`, `kernels_gpu::F16`, `kernels_gpu::BF16`), so one launch site serves all dtypes.
macro_rules! with_elem {
    ($dt:expr, |$T:ident| $body:expr) => {
        match $dt {
            kernels_gpu::DType::F32 => {
                type $T = f32;
                $body
            }
            kernels_gpu::DType::F16 => {
                type $T = kernels_gpu::F16;
                $body
            }
            kernels_gpu::DType::BF16 => {
                type $T = kernels_gpu::BF16;
                $body
            }
        }
    };
}
pub(crate) use with_elem;

/// How a row kernel runs: its name and launch.
pub(crate) struct RowPlan {
    pub kernel: String,
    pub cfg: crate::device::LaunchConfig,
    /// Vectors per thread of the register-resident kernel, `None` for the streaming one.
    pub v: Option<usize>,
}

/// Whether a register-resident forward (softmax, the norms) may hold rows of `cols` elements of
/// `dt` at eight vectors a thread: f32 always; f16/bf16 only for rows over 16384, which four
/// would hold only in blocks over 512 threads (one an SM), while eight hold rows of 32768 in 512
/// threads, two blocks an SM. Below, eight were slower than four (bf16 layer norm at 8192 x 8192:
/// docs/worklog.md, 2026-11-23c).
pub(crate) fn eight_vectors_fwd(dt: kernels_gpu::DType, cols: u64) -> bool {
    dt == kernels_gpu::DType::F32 || cols > 16384
}

/// Chooses between the register-resident instances of the row kernel `stem` (`<stem>_v<V>_<dt>`,
/// `V` from `avail`) and its streaming one (`<stem>_stream_<dt>`) for `rows` rows of `cols`
/// elements of `dt`: registers when the rows are whole 16-byte vectors, short enough, and the
/// kernel's registers allow the block (see `kernels-gpu/src/rows.rs`); the row spread over a
/// group as `spread` says ([`crate::launch::Spread`]; `Narrow` for launches of few rows).
/// `None` if `rows` is 0.
pub(crate) fn row_plan(
    dev: &crate::Device,
    stem: &str,
    dt: kernels_gpu::DType,
    rows: u64,
    cols: u64,
    avail: &[usize],
    spread: crate::launch::Spread,
) -> Result<Option<RowPlan>> {
    use crate::launch;
    let vec = with_elem!(dt, |T| <T as kernels_gpu::Elem>::VEC as u64);
    let sfx = dt.suffix();
    if rows == 0 {
        return Ok(None);
    }
    // Few rows: narrow groups, so that the rows spread over more blocks and SMs (64 rows of
    // 1024 f32 in 16 blocks of four-vector groups ran at 0.93-0.96 of PyTorch's speed, in 32
    // blocks of two-vector groups at 1.1). The forwards go further: `fwd_row_plan`.
    let spread = if rows >= 4 * dev.sm_count() as u64 { spread } else { launch::Spread::Narrow };
    if cols > 0
        && cols.is_multiple_of(vec)
        && let Some(v) = launch::reg_vectors(cols / vec, avail, spread)
    {
        let g = launch::group_size(cols / vec, v as u64);
        let kernel = format!("{stem}_v{v}_{sfx}");
        if launch::rows_fit_grid(rows, g)
            && let Some(cfg) = launch::rows(rows, g)
            && cfg.block.0 * cfg.block.1 <= dev.max_threads(&kernel)?
        {
            return Ok(Some(RowPlan { kernel, cfg, v: Some(v) }));
        }
    }
    // Streaming: about four vectors per thread per pass, up to 1024 threads per row. (Sixteen,
    // i.e. 512 threads and two rows per SM, measured slower on the H100 for the f32 softmax
    // backward and layer norm at 4096 x 32768: docs/worklog.md, 2026-11-25.)
    let kernel = format!("{stem}_stream_{sfx}");
    let max = dev.max_threads(&kernel)? / 32 * 32;
    let g = launch::group_size(cols.div_ceil(vec), 4).min(max.max(32));
    let cfg = launch::rows(rows, g).expect("rows > 0");
    Ok(Some(RowPlan { kernel, cfg, v: None }))
}

/// The plan of a register-resident forward (softmax, log-softmax, layer and RMS norm) over
/// `avail` vectors a thread (ascending): [`row_plan`] with `spread` (`Wide` or `Two`), except
/// where that grid needs more than one wave of resident blocks and `Wide`'s needs one (`Two`'s
/// more, lighter blocks then wait for a second wave: RMS norm bf16 at 8192 x 512, 8 MiB, lost
/// with a two-vector kernel, two waves where four vectors made one: docs/worklog.md, 2026-11-26g),
/// and except for launches of fewer rows than four an SM. Those take the fewest vectors a thread
/// (the most threads a row, up to 1024) whose grid still fits one wave of resident blocks: their
/// time is the latency of one pass over each row, which more threads a row shorten, until a
/// second wave would double it. On the H100 this beat `Spread::Narrow` (the fewest vectors that
/// keep a group at 128 threads) at every few-row shape measured, and one vector a thread where it
/// would take two waves lost to four vectors in one (docs/worklog.md, 2026-11-25e).
pub(crate) fn fwd_row_plan(
    dev: &crate::Device,
    stem: &str,
    dt: kernels_gpu::DType,
    rows: u64,
    cols: u64,
    avail: &[usize],
    spread: crate::launch::Spread,
) -> Result<Option<RowPlan>> {
    use crate::launch;
    let vec = with_elem!(dt, |T| <T as kernels_gpu::Elem>::VEC as u64);
    let few = rows > 0 && rows < 4 * dev.sm_count() as u64;
    if few && cols > 0 && cols.is_multiple_of(vec) {
        let nvec = cols / vec;
        for &v in avail.iter().filter(|&&v| nvec <= v as u64 * kernels_gpu::rows::MAX_GROUP as u64) {
            let kernel = format!("{stem}_v{v}_{}", dt.suffix());
            let g = launch::group_size(nvec, v as u64);
            let Some(cfg) = launch::rows(rows, g) else { continue };
            let threads = cfg.block.0 * cfg.block.1;
            if !launch::rows_fit_grid(rows, g) || threads > dev.max_threads(&kernel)? {
                continue;
            }
            let resident = dev.sm_count() as u64 * dev.blocks_per_sm(&kernel, threads, cfg.shared_bytes)? as u64;
            if cfg.grid.0 as u64 <= resident {
                return Ok(Some(RowPlan { kernel, cfg, v: Some(v) }));
            }
        }
    }
    let plan = row_plan(dev, stem, dt, rows, cols, avail, spread)?;
    if spread == launch::Spread::Wide {
        return Ok(plan);
    }
    let wide = row_plan(dev, stem, dt, rows, cols, avail, launch::Spread::Wide)?;
    let waves = |p: &RowPlan| -> Result<u64> {
        let threads = p.cfg.block.0 * p.cfg.block.1;
        let resident = dev.sm_count() as u64 * dev.blocks_per_sm(&p.kernel, threads, p.cfg.shared_bytes)? as u64;
        Ok((p.cfg.grid.0 as u64).div_ceil(resident.max(1)))
    };
    match (plan, wide) {
        (Some(p), Some(w)) if p.v.is_some() && w.v.is_some() && waves(&w)? == 1 && waves(&p)? > 1 => Ok(Some(w)),
        (plan, _) => Ok(plan),
    }
}

/// Cluster sizes of the one-row-per-cluster kernels `<stem>_c<C>_v4_<dt>` (sm_90; the softmax
/// backward), which hold four vectors a thread.
pub(crate) const ROW_CLUSTERS: [u32; 3] = [2, 4, 8];

/// A row cut into runs over a thread-block cluster (sm_90; `kernels-gpu/src/rows.rs`): the kernel
/// `<stem>_c<C>_v<V>_<dt>`, `C` blocks of `threads` threads, and the block's dynamic shared
/// memory (the reductions', the cluster exchange's and the caller's `extra`).
pub(crate) struct ClusterSplit {
    pub kernel: String,
    pub blocks: u32,
    pub threads: u32,
    pub shared_bytes: u32,
}

/// The smallest cluster of `sizes` whose blocks of at most `max_threads` threads hold a row of
/// `cols` at `v` vectors a thread, where the device's module has that kernel (sm_90), the rows
/// are whole vectors, and the shared memory fits; `extra(run_cols)` is what the caller's kernel
/// keeps per block for a run of `run_cols` columns. `None` otherwise.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cluster_kernel(
    dev: &crate::Device,
    stem: &str,
    dt: kernels_gpu::DType,
    cols: u64,
    v: u64,
    sizes: &[u32],
    max_threads: u32,
    extra: impl Fn(u64) -> u64,
) -> Result<Option<ClusterSplit>> {
    use kernels_gpu::rows::{cluster_slots, reduce_smem_bytes};
    let vec = with_elem!(dt, |T| <T as kernels_gpu::Elem>::VEC as u64);
    if !cols.is_multiple_of(vec) {
        return Ok(None);
    }
    let Some((c, g)) = crate::launch::cluster_split(cols / vec, v, sizes, max_threads) else { return Ok(None) };
    let kernel = format!("{stem}_c{c}_v{v}_{}", dt.suffix());
    if !dev.has_kernel(&kernel) || g > dev.max_threads(&kernel)? {
        return Ok(None);
    }
    let run_cols = (cols / vec).div_ceil(c as u64) * vec;
    let smem = reduce_smem_bytes(g) as u64 + cluster_slots(c) as u64 * 4 + extra(run_cols);
    if smem > dev.max_shared_bytes() as u64 {
        return Ok(None);
    }
    Ok(Some(ClusterSplit { kernel, blocks: c, threads: g, shared_bytes: smem as u32 }))
}

/// A launch of `<stem>_c<C>_v4_<dt>` with one cluster of `C` blocks of at most `max_threads`
/// threads per row ([`cluster_kernel`]); `None` where there is no such kernel or split.
pub(crate) fn cluster_row_plan(
    dev: &crate::Device,
    stem: &str,
    dt: kernels_gpu::DType,
    rows: u64,
    cols: u64,
    max_threads: u32,
) -> Result<Option<RowPlan>> {
    let Some(cs) = cluster_kernel(dev, stem, dt, cols, 4, &ROW_CLUSTERS, max_threads, |_| 0)? else {
        return Ok(None);
    };
    let blocks = rows * cs.blocks as u64;
    if rows == 0 || blocks > i32::MAX as u64 {
        return Ok(None);
    }
    let cfg = crate::device::LaunchConfig {
        grid: (blocks as u32, 1, 1),
        block: (cs.threads, 1, 1),
        shared_bytes: cs.shared_bytes,
    };
    Ok(Some(RowPlan { kernel: cs.kernel, cfg, v: Some(4) }))
}

/// `x` must have at least one dimension; returns `(rows, cols)` over the last one.
pub(crate) fn rows_cols(op: &'static str, x: &Tensor) -> Result<(u64, u64)> {
    let Some(&cols) = x.shape().last() else {
        return Err(Error::InvalidArgument {
            op,
            message: "needs a tensor with at least one dimension, got a scalar".into(),
        });
    };
    let rows = x.numel().checked_div(cols).unwrap_or(0);
    Ok((rows as u64, cols as u64))
}

pub(crate) fn check_same_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch { op, expected: a.device().ordinal(), got: b.device().ordinal() });
    }
    Ok(())
}

pub(crate) fn check_same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch { op, expected: a.dtype(), got: b.dtype() });
    }
    Ok(())
}

pub(crate) fn check_same_shape(op: &'static str, a: &Tensor, b: &Tensor, detail: &'static str) -> Result<()> {
    shapes_match(op, a.shape(), b.shape(), detail)
}

/// `got` must equal `expected`.
pub(crate) fn shapes_match(op: &'static str, expected: &[usize], got: &[usize], detail: &'static str) -> Result<()> {
    if expected != got {
        return Err(Error::ShapeMismatch { op, expected: expected.to_vec(), got: got.to_vec(), detail });
    }
    Ok(())
}

/// A row broadcast along the last dimension of `x_shape` must have shape `[last_dim]`.
pub(crate) fn row_matches(
    op: &'static str,
    x_shape: &[usize],
    row_shape: &[usize],
    detail: &'static str,
) -> Result<()> {
    shapes_match(op, &[x_shape.last().copied().unwrap_or(1)], row_shape, detail)
}

macro_rules! binary_methods {
    ($($name:ident, $row:ident => $op:expr;)*) => {
        $(
            /// Element-wise with a tensor of the same shape.
            pub fn $name(&self, other: &Tensor) -> Result<Tensor> { binary(self, other, $op) }
            /// With `row` (shape `[last_dim]`) broadcast over the other dimensions.
            pub fn $row(&self, row: &Tensor) -> Result<Tensor> { binary_row(self, row, $op) }
        )*
    };
}

/// The binary ops as methods (the unary ops' come from their table: `ops::elementwise`).
impl Tensor {
    binary_methods! {
        add, add_row => BinaryOp::Add; sub, sub_row => BinaryOp::Sub;
        mul, mul_row => BinaryOp::Mul; div, div_row => BinaryOp::Div;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_checks_name_the_op_and_shapes() {
        assert!(shapes_match("add", &[2, 3], &[2, 3], "").is_ok());
        let err = shapes_match("add", &[2, 3], &[3, 2], "operands must have one shape").unwrap_err();
        assert_eq!(err.to_string(), "add: shape mismatch, expected [2, 3], got [3, 2] (operands must have one shape)");
        assert!(row_matches("bias", &[4, 5], &[5], "").is_ok());
        assert!(row_matches("bias", &[5], &[5], "").is_ok());
        assert!(row_matches("bias", &[], &[1], "").is_ok());
        assert!(matches!(row_matches("bias", &[4, 5], &[4], ""), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(row_matches("bias", &[4, 5], &[1, 5], ""), Err(Error::ShapeMismatch { .. })));
    }

    #[test]
    fn element_counts_overflow_is_an_error() {
        assert_eq!(crate::tensor::numel("t", &[2, 3, 4]).unwrap(), 24);
        assert_eq!(crate::tensor::numel("t", &[]).unwrap(), 1);
        assert_eq!(crate::tensor::numel("t", &[0, usize::MAX]).unwrap(), 0);
        assert!(matches!(crate::tensor::numel("t", &[usize::MAX, 2]), Err(Error::InvalidArgument { .. })));
    }

    #[test]
    fn errors_display_what_failed() {
        let e = Error::DTypeMismatch { op: "binary", expected: crate::DType::F32, got: crate::DType::BF16 };
        assert_eq!(e.to_string(), "binary: dtype mismatch, expected F32, got BF16");
        let e = Error::Kernel { kernel: "relu_fwd_f32".into(), message: "CUDA_ERROR_ILLEGAL_ADDRESS".into() };
        assert!(e.to_string().contains("relu_fwd_f32"));
        let e = Error::NoDriver { detail: "libcuda.so.1 was not found".into() };
        assert!(e.to_string().starts_with("no CUDA driver"));
    }
}
