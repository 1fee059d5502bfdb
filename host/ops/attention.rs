//! Scaled dot-product attention, forward and backward, bf16 and f16 on the tensor cores (host
//! side of `kernels-gpu/src/attention/`, FlashAttention-2 on `mma.sync`): [`attention`],
//! [`attention_backward`].

use super::check::check_same_device;
use crate::device::{Device, LaunchConfig};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use kernels_gpu::DType;
use kernels_gpu::attention::backward::{self as bwd, AttnBwdParams};
use kernels_gpu::attention::hopper::{self, HopperParams, hopper_kernel};
use kernels_gpu::attention::hopper_bwd::{self, HopperBwdParams, hopper_bwd_kernels};
use kernels_gpu::attention::{self as attn, AttentionArgs, AttnParams, fwd_kernel, padded_dim, smem_bytes};

/// Which keys a query sees beyond the window ([`AttentionOpts::causal`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Causal {
    /// Every key.
    #[default]
    None,
    /// Query `i` sees keys `j <= i` (PyTorch's `is_causal`: the mask's diagonal starts at the
    /// top left).
    TopLeft,
    /// Query `i` sees keys `j <= i + Sk - Sq` (FlashAttention's: the last query sees every key,
    /// as with a KV cache). With `Sq > Sk` the first `Sq - Sk` queries see no key.
    BottomRight,
}

/// How Q, K, V and the output are laid out in memory (contiguous tensors of rank 4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// `[batch, heads, seq, head_dim]` (PyTorch's `scaled_dot_product_attention`).
    #[default]
    Bhsd,
    /// `[batch, seq, heads, head_dim]` (FlashAttention's; what a projection's output reshaped
    /// gives without a transpose).
    Bshd,
}

/// The options of [`attention`]. `AttentionOpts::default()` is plain attention: no mask, scale
/// `1/sqrt(D)`, [`Layout::Bhsd`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOpts {
    /// The causal mask, if any.
    pub causal: Causal,
    /// The factor of `Q K^T`; `None`: `1/sqrt(D)`. Must be finite (any sign, or 0).
    pub scale: Option<f32>,
    /// A sliding window `(left, right)`: query `i` sees keys `j` with `c(i) - left <= j <= c(i) +
    /// right`, where `c(i)` is the diagonal: `i` under [`Causal::TopLeft`], `i + Sk - Sq`
    /// otherwise (bottom right, as FlashAttention's `window_size`). With a causal mask, `right`
    /// is cut to 0. `(usize::MAX, 0)` with [`Causal::None`] is the bottom-right causal mask.
    pub window: Option<(usize, usize)>,
    /// The memory layout of Q, K, V and the output.
    pub layout: Layout,
}

/// The shapes of one attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub d: usize,
}

/// Beyond every row: a band offset that sees all keys (kept far from i64's limits so the
/// kernel's `i + lo`, `i + hi + 1` cannot overflow).
const BIG: i64 = 1 << 33;

/// The rank-4 shape `s` of a tensor as `(batch, heads, seq, head_dim)`.
fn bhsd(layout: Layout, s: &[usize]) -> (usize, usize, usize, usize) {
    match layout {
        Layout::Bhsd => (s[0], s[1], s[2], s[3]),
        Layout::Bshd => (s[0], s[2], s[1], s[3]),
    }
}

/// The element strides `[batch, head, row]` of a contiguous tensor of shape `(b, h, s, d)`
/// (batch, heads, seq, head dim) in `layout`.
pub(crate) fn strides(layout: Layout, (_, h, s, d): (usize, usize, usize, usize)) -> [u64; 3] {
    let (h, s, d) = (h as u64, s as u64, d as u64);
    match layout {
        Layout::Bhsd => [h * s * d, s * d, d],
        Layout::Bshd => [s * h * d, d, h * d],
    }
}

/// Checks the shapes of Q, K and V (rank 4 each, in `layout`) and returns them: K and V of one
/// shape, Q's batch and head dim, a head dim that is a multiple of 8 from 8 to 256, query heads
/// a multiple of the key/value heads, sequences below 2^31.
pub(crate) fn dims(op: &'static str, layout: Layout, q: &[usize], k: &[usize], v: &[usize]) -> Result<Dims> {
    for (what, s) in [("q", q), ("k", k), ("v", v)] {
        if s.len() != 4 {
            return Err(Error::InvalidArgument {
                op,
                message: format!("{what} must have rank 4 ({layout:?}), got shape {s:?}"),
            });
        }
    }
    if k != v {
        return Err(Error::ShapeMismatch {
            op,
            expected: k.to_vec(),
            got: v.to_vec(),
            detail: "v must have k's shape",
        });
    }
    let (b, hq, sq, d) = bhsd(layout, q);
    let (bk, hkv, sk, dk) = bhsd(layout, k);
    if bk != b || dk != d {
        let mut expected = k.to_vec();
        expected[0] = b;
        expected[3] = d;
        return Err(Error::ShapeMismatch {
            op,
            expected,
            got: k.to_vec(),
            detail: "k and v must have q's batch and head dim",
        });
    }
    if d == 0 || !d.is_multiple_of(8) || d > 256 {
        return Err(Error::InvalidArgument {
            op,
            message: format!("the head dim must be a multiple of 8 from 8 to 256, got {d}"),
        });
    }
    if (hkv == 0 && hq > 0) || (hkv > 0 && !hq.is_multiple_of(hkv)) {
        return Err(Error::InvalidArgument {
            op,
            message: format!("q's heads ({hq}) must be a multiple of k's and v's ({hkv})"),
        });
    }
    let limit = i32::MAX as usize;
    if sq > limit || sk > limit || hq > limit {
        return Err(Error::InvalidArgument {
            op,
            message: format!("sequences and heads must be below 2^31, got {sq} queries, {sk} keys, {hq} heads"),
        });
    }
    Ok(Dims { batch: b, heads_q: hq, heads_kv: hkv, seq_q: sq, seq_k: sk, d })
}

/// The band of keys each query sees: key `j` is seen by query `i` iff `i + lo <= j <= i + hi`
/// (and `j < Sk`), from the options' mask and window (see [`AttentionOpts::window`]).
pub(crate) fn band(causal: Causal, window: Option<(usize, usize)>, seq_q: usize, seq_k: usize) -> (i64, i64) {
    let off = if causal == Causal::TopLeft { 0 } else { seq_k as i64 - seq_q as i64 };
    let far = |x: usize| (x as u64).min(BIG as u64) as i64;
    let hi = match (causal, window) {
        (Causal::None, None) => BIG,
        (Causal::None, Some((_, right))) => off + far(right),
        _ => off,
    };
    let lo = window.map_or(-BIG, |(left, _)| off - far(left));
    (lo.clamp(-BIG, BIG), hi.clamp(-BIG, BIG))
}

/// How an attention is launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The kernel's padded head dim.
    pub dp: u32,
    /// Its dynamic shared memory.
    pub smem: u32,
    /// Blocks per (batch, head): `ceil(Sq / 64)`.
    pub q_blocks: u32,
    /// Batches per launch: the grid (`q_blocks * heads_q * batches`, one dimension) stays below
    /// 2^31.
    pub batches: usize,
}

/// The launch of `dims` on a GPU whose blocks may have `max_smem` bytes of dynamic shared
/// memory: an error if the kernel for its head dim needs more, or a (batch, head) has more query
/// blocks than a grid can hold.
pub(crate) fn plan(op: &'static str, dims: &Dims, max_smem: u32) -> Result<Plan> {
    let dp = padded_dim(dims.d as u32).ok_or_else(|| Error::InvalidArgument {
        op,
        message: format!("the head dim must be a multiple of 8 from 8 to 256, got {}", dims.d),
    })?;
    let smem = smem_bytes(dp);
    if smem > max_smem {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "head dim {} needs {smem} bytes of shared memory a block; this GPU allows {max_smem}",
                dims.d
            ),
        });
    }
    let q_blocks = dims.seq_q.div_ceil(attn::BM as usize);
    let per_batch = q_blocks.saturating_mul(dims.heads_q).max(1);
    let limit = i32::MAX as usize;
    if per_batch > limit {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{} heads of {} queries exceed a grid's 2^31 blocks", dims.heads_q, dims.seq_q),
        });
    }
    Ok(Plan { dp, smem, q_blocks: q_blocks as u32, batches: (limit / per_batch).min(dims.batch).max(1) })
}

/// Scaled dot-product attention, forward: `out = softmax(scale Q K^T + mask) V` per (batch,
/// query head), with the key/value head `h / (Hq / Hkv)` (grouped-query attention; one key/value
/// head: multi-query), and `lse`, the natural log of each row's sum of `exp(scale q k_j)` over
/// the keys it sees (what a backward pass needs).
///
/// - `q`: `[B, Hq, Sq, D]` ([`Layout::Bhsd`]) or `[B, Sq, Hq, D]` ([`Layout::Bshd`]); `k`, `v`:
///   `[B, Hkv, Sk, D]` or `[B, Sk, Hkv, D]`, `Hq` a multiple of `Hkv`. All bf16 or all f16; `D`
///   a multiple of 8 from 8 to 256; `Sq` and `Sk` any (they may differ), below 2^31.
/// - Returns `(out, lse)`: `out` of q's shape, dtype and layout; `lse` f32 `[B, Hq, Sq]`.
/// - The mask: [`AttentionOpts::causal`] and [`AttentionOpts::window`]. A query that sees no key
///   (all masked, or `Sk = 0`), or whose every score is `-inf`, gets zeros and `lse = -inf`, as
///   FlashAttention (where the naive formula gives NaN).
/// - NaN and infinities propagate as in the naive formula: a NaN score, or a `+inf` one, makes
///   its row NaN; a `-inf` score is a weight of 0. A non-finite value of V at a key a row sees
///   reaches that row; at a key it does not see, it may (when the key shares a tile of keys
///   with one it sees, as `0 * inf` is NaN: 64 keys, or 128 on Hopper for head dims up to 128),
///   or may not.
/// - Accuracy: scores and products are accumulated in f32; the softmax weights are rounded to
///   the input dtype before they multiply V (as FlashAttention), which dominates the error:
///   about `2^-8` (bf16) or `2^-11` (f16) of `sum_j p_j |v_j|` (tests/attention.rs derives the
///   whole bound).
/// - Memory: O(B H S D); no `Sq x Sk` matrix is formed. Q, K and V are read in place in either
///   layout (no copies).
///
/// Errors ([`Error`]): tensors on different devices; a dtype other than bf16 or f16, or
/// different dtypes ([`Error::DTypeMismatch`]); shapes that do not fit
/// ([`Error::ShapeMismatch`] for k and v, [`Error::InvalidArgument`] otherwise: rank, head dim,
/// heads); a scale that is not finite; a tensor whose memory does not start on 16 bytes (the
/// copies move 16 bytes; tensors the library allocates always do); a GPU with less shared memory
/// a block than the head dim's kernel needs (46 KB up to D = 64, 87 KB to 128, 101 KB to 256).
/// On an H100 or H200 (sm_90a) head dims up to 128 run on the Hopper kernels (`wgmma` and the
/// copy engine, FlashAttention-3 style), the others on the general `mma.sync` ones.
/// Empty batches or queries (`B = 0`, `Hq = 0`, `Sq = 0`) give empty outputs.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<(Tensor, Tensor)> {
    let op = "attention";
    let (dims, _) = check_inputs(op, q, k, v, opts)?;
    let mut out = Tensor::alloc(op, q.device(), q.shape(), q.dtype())?;
    let mut lse = Tensor::alloc(op, q.device(), &[dims.batch, dims.heads_q, dims.seq_q], DType::F32)?;
    attention_out(q, k, v, opts, &mut out, &mut lse)?;
    Ok((out, lse))
}

/// [`attention`] into given tensors: `out` (q's shape, dtype and layout) and `lse` (f32 `[B, Hq,
/// Sq]`), whose memory must start on 16 bytes like the inputs'. Errors: [`attention`]'s, and
/// outputs of another device, dtype or shape.
pub fn attention_out(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOpts,
    out: &mut Tensor,
    lse: &mut Tensor,
) -> Result<()> {
    let op = "attention";
    let (dims, scale) = check_inputs(op, q, k, v, opts)?;
    let dtype = q.dtype();
    check_output(op, q, out, dtype, q.shape(), "out must have q's shape")?;
    check_output(
        op,
        q,
        lse,
        DType::F32,
        &[dims.batch, dims.heads_q, dims.seq_q],
        "lse must be [batch, heads_q, seq_q]",
    )?;
    let dev = q.device().clone();
    let p = plan(op, &dims, dev.max_shared_bytes())?;
    if dims.batch == 0 || dims.heads_q == 0 || dims.seq_q == 0 {
        return Ok(());
    }
    let (lo, hi) = band(opts.causal, opts.window, dims.seq_q, dims.seq_k);
    let kernel = fwd_kernel(dtype, p.dp).ok_or_else(|| Error::InvalidArgument {
        op,
        message: format!("internal: no attention kernel for {dtype:?} and head dim {}", p.dp),
    })?;
    let qs = strides(opts.layout, (dims.batch, dims.heads_q, dims.seq_q, dims.d));
    let ks = strides(opts.layout, (dims.batch, dims.heads_kv, dims.seq_k, dims.d));
    let params = AttnParams {
        q: q.dev_ptr(),
        k: k.dev_ptr(),
        v: v.dev_ptr(),
        o: out.dev_ptr_mut::<u16>()?,
        lse: lse.dev_ptr_mut::<f32>()?,
        q_stride: qs,
        k_stride: ks,
        v_stride: ks,
        o_stride: qs,
        lo,
        hi,
        seq_q: dims.seq_q as u32,
        seq_k: dims.seq_k as u32,
        d: dims.d as u32,
        heads_q: dims.heads_q as u32,
        group: (dims.heads_q / dims.heads_kv.max(1)) as u32,
        q_blocks: p.q_blocks,
        scale_log2: scale * std::f32::consts::LOG2_E,
        pad: 0,
    };
    if uses_hopper(&dev, dtype, &dims, p.dp) {
        return launch_hopper(op, &dev, dtype, &params, &dims, p.dp);
    }
    launch(&dev, kernel, &params, &dims, &p)
}

/// Whether the forward of `dims` runs on the Hopper kernels (`kernels-gpu/src/attention/
/// hopper.rs`): an sm_90a GPU (H100, H200) with their shared memory, a padded head dim of 64 or
/// 128, and at least one key (the copy engine's tensor maps have no empty dimension).
fn uses_hopper(dev: &Device, dtype: DType, dims: &Dims, dp: u32) -> bool {
    dev.ptx_arch() == "sm_90a"
        && hopper_kernel(dtype, dp).is_some()
        && dims.seq_k > 0
        && dev.max_shared_bytes() >= hopper::smem_bytes(dp)
}

/// Launches the Hopper forward: the tensor maps of Q, K and V (4-D, `(d, row, head, batch)`
/// from `params`' strides) in a small buffer written just before the launch, stream-ordered,
/// then [`Plan::batches`]-like pieces of the batch so that the grid stays below 2^31.
fn launch_hopper(
    op: &'static str,
    dev: &Device,
    dtype: DType,
    params: &AttnParams,
    dims: &Dims,
    dp: u32,
) -> Result<()> {
    let kernel = hopper_kernel(dtype, dp)
        .ok_or_else(|| Error::InvalidArgument { op, message: format!("internal: no Hopper kernel for {dp}") })?;
    let map = |ptr: *const u16, (rows, heads): (usize, usize), st: [u64; 3], box_rows: u32| {
        let dims = [dims.d as u64, rows as u64, heads as u64, dims.batch as u64];
        super::gemm_wgmma::tiled_map(op, dtype, ptr as u64, &dims, &[st[2], st[1], st[0]], &[64, box_rows, 1, 1])
    };
    let mq = map(params.q, (dims.seq_q, dims.heads_q), params.q_stride, hopper::BM)?;
    let mk = map(params.k, (dims.seq_k, dims.heads_kv), params.k_stride, hopper::BN)?;
    let mv = map(params.v, (dims.seq_k, dims.heads_kv), params.v_stride, hopper::BN)?;
    let maps = super::gemm_wgmma::upload_maps(op, dev, &[mq, mk, mv])?;
    let q_blocks = dims.seq_q.div_ceil(hopper::BM as usize);
    let per_batch = q_blocks * dims.heads_q;
    let batches = (i32::MAX as usize / per_batch.max(1)).clamp(1, dims.batch.max(1));
    let smem = hopper::smem_bytes(dp);
    let mut z0 = 0;
    while z0 < dims.batch {
        let nz = (dims.batch - z0).min(batches);
        let piece = HopperParams {
            maps: maps.ptr() as *const u64,
            o: params.o,
            lse: params.lse,
            o_stride: params.o_stride,
            lo: params.lo,
            hi: params.hi,
            seq_q: params.seq_q,
            seq_k: params.seq_k,
            d: params.d,
            heads_q: params.heads_q,
            group: params.group,
            q_blocks: q_blocks as u32,
            scale_log2: params.scale_log2,
            z0: z0 as u32,
        };
        let cfg =
            LaunchConfig { grid: ((per_batch * nz) as u32, 1, 1), block: (hopper::THREADS, 1, 1), shared_bytes: smem };
        // SAFETY: the maps describe Q, K and V as `dims` checked them (the copy engine reads
        // nothing outside them); O and lse are as for `launch`; the grid covers batches
        // `z0..z0 + nz`; `smem` is within the device's limit (`uses_hopper`); the maps live until
        // the kernel has read them (a cache slot is never rewritten, a buffer of this call's own
        // is freed stream-ordered after it).
        unsafe { dev.launch(kernel, cfg, (piece,))? };
        z0 += nz;
    }
    Ok(())
}

/// The checks of Q, K, V and the options shared by every entry point: one device, bf16 or f16
/// alike, shapes that fit ([`dims`]), a finite scale, memory that starts on 16 bytes. Returns
/// the shapes and the scale.
fn check_inputs(op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<(Dims, f32)> {
    check_same_device(op, q, k)?;
    check_same_device(op, q, v)?;
    let dtype = q.dtype();
    if dtype == DType::F32 {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{op} takes bf16 or f16 tensors, got F32 (cast first)"),
        });
    }
    for t in [k, v] {
        if t.dtype() != dtype {
            return Err(Error::DTypeMismatch { op, expected: dtype, got: t.dtype() });
        }
    }
    let dims = dims(op, opts.layout, q.shape(), k.shape(), v.shape())?;
    let scale = opts.scale.unwrap_or(1.0 / (dims.d as f32).sqrt());
    if !scale.is_finite() {
        return Err(Error::InvalidArgument { op, message: format!("the scale must be finite, got {scale}") });
    }
    for (what, t) in [("q", q), ("k", k), ("v", v)] {
        check_aligned(op, what, t)?;
    }
    Ok((dims, scale))
}

/// An error unless `t`'s memory starts on 16 bytes (the kernels' copies move 16 bytes).
fn check_aligned(op: &'static str, what: &str, t: &Tensor) -> Result<()> {
    if t.dev_ptr_u64().is_multiple_of(16) {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        op,
        message: format!("{what}'s memory must start on 16 bytes, at {:#x}", t.dev_ptr_u64()),
    })
}

/// An error unless the output `t` is on `like`'s device, of `dtype` and `shape`, and starts on
/// 16 bytes.
fn check_output(
    op: &'static str,
    like: &Tensor,
    t: &Tensor,
    dtype: DType,
    shape: &[usize],
    detail: &'static str,
) -> Result<()> {
    check_same_device(op, like, t)?;
    if t.dtype() != dtype {
        return Err(Error::DTypeMismatch { op, expected: dtype, got: t.dtype() });
    }
    if t.shape() != shape {
        return Err(Error::ShapeMismatch { op, expected: shape.to_vec(), got: t.shape().to_vec(), detail });
    }
    check_aligned(op, "the output", t)
}

/// Scaled dot-product attention, backward: the gradients `(dq, dk, dv)` of a loss whose
/// gradient with respect to [`attention`]'s output is `dout`, given that call's inputs, its
/// `out` and `lse`, and the same `opts`.
///
/// - `q`, `k`, `v`, `opts`: as given to [`attention`]; `out`, `lse`: what it returned; `dout`:
///   `out`'s shape, dtype and layout. Returns `dq`, `dk`, `dv` of the shapes, dtype and layout of
///   `q`, `k` and `v`. With grouped-query attention, `dk` and `dv` sum over the query heads that
///   share a key/value head.
/// - Deterministic: no atomics; every gradient element is summed in one fixed order by one
///   thread, so two calls on the same inputs give the same bits.
/// - A query row that sees no key (`lse = -inf`) contributes nothing; keys no query sees get
///   zero gradients.
/// - Memory: O(B H S) f32 workspace (each row's `dout . out` and log-sum-exp), no `Sq x Sk`
///   matrix.
/// - Accuracy: products accumulate in f32; the weights `P` and their gradients `dS` are rounded
///   to the input dtype before they enter the tensor cores (as FlashAttention), which dominates
///   the error (tests/attention.rs derives the bound).
///
/// Errors: those of [`attention`], and `out`, `lse` or `dout` whose shape or dtype is not what
/// [`attention`] returns for these inputs.
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    opts: &AttentionOpts,
) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "attention_backward";
    check_inputs(op, q, k, v, opts)?;
    let dev = q.device();
    let mut dq = Tensor::alloc(op, dev, q.shape(), q.dtype())?;
    let mut dk = Tensor::alloc(op, dev, k.shape(), q.dtype())?;
    let mut dv = Tensor::alloc(op, dev, v.shape(), q.dtype())?;
    attention_backward_out(q, k, v, out, lse, dout, opts, (&mut dq, &mut dk, &mut dv))?;
    Ok((dq, dk, dv))
}

/// [`attention_backward`] into given tensors `(dq, dk, dv)` (the shapes and dtype of q, k and v;
/// memory that starts on 16 bytes). Errors: [`attention_backward`]'s, and gradients of another
/// device, dtype or shape.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_out(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    opts: &AttentionOpts,
    (dq, dk, dv): (&mut Tensor, &mut Tensor, &mut Tensor),
) -> Result<()> {
    let op = "attention_backward";
    let (dims, scale) = check_inputs(op, q, k, v, opts)?;
    let dtype = q.dtype();
    for t in [out, lse, dout] {
        check_same_device(op, q, t)?;
    }
    for t in [out, dout] {
        if t.dtype() != dtype {
            return Err(Error::DTypeMismatch { op, expected: dtype, got: t.dtype() });
        }
    }
    if lse.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch { op, expected: DType::F32, got: lse.dtype() });
    }
    for (t, detail) in [(out, "out must have q's shape"), (dout, "dout must have q's shape")] {
        if t.shape() != q.shape() {
            return Err(Error::ShapeMismatch { op, expected: q.shape().to_vec(), got: t.shape().to_vec(), detail });
        }
    }
    let lse_shape = [dims.batch, dims.heads_q, dims.seq_q];
    if lse.shape() != lse_shape {
        return Err(Error::ShapeMismatch {
            op,
            expected: lse_shape.to_vec(),
            got: lse.shape().to_vec(),
            detail: "lse must be [batch, heads_q, seq_q]",
        });
    }
    for (what, t) in [("out", out), ("dout", dout)] {
        check_aligned(op, what, t)?;
    }
    check_output(op, q, dq, dtype, q.shape(), "dq must have q's shape")?;
    check_output(op, q, dk, dtype, k.shape(), "dk must have k's shape")?;
    check_output(op, q, dv, dtype, v.shape(), "dv must have v's shape")?;
    let dev = q.device().clone();
    let p = plan_backward(op, &dims, dev.max_shared_bytes())?;
    // Without queries the key gradients are zeros; without keys the query gradients are.
    if dims.heads_q == 0 || dims.seq_q == 0 {
        dk.fill_(0.0)?;
        return dv.fill_(0.0);
    }
    if dims.batch == 0 || dims.seq_k == 0 {
        return dq.fill_(0.0);
    }
    let kernels = bwd::bwd_kernels(dtype, p.fwd.dp).ok_or_else(|| Error::InvalidArgument {
        op,
        message: format!("internal: no attention backward kernels for {dtype:?} and head dim {}", p.fwd.dp),
    })?;
    let rows = dims.batch * dims.heads_q * p.fwd.q_blocks as usize * attn::BM as usize;
    let mut lse2 = Tensor::alloc(op, &dev, &[rows], DType::F32)?;
    let mut delta = Tensor::alloc(op, &dev, &[rows], DType::F32)?;
    let (lo, hi) = band(opts.causal, opts.window, dims.seq_q, dims.seq_k);
    let params = AttnBwdParams {
        q: q.dev_ptr(),
        k: k.dev_ptr(),
        v: v.dev_ptr(),
        o: out.dev_ptr(),
        dout: dout.dev_ptr(),
        dq: dq.dev_ptr_mut::<u16>()?,
        dk: dk.dev_ptr_mut::<u16>()?,
        dv: dv.dev_ptr_mut::<u16>()?,
        lse: lse.dev_ptr(),
        lse2: lse2.dev_ptr_mut::<f32>()?,
        delta: delta.dev_ptr_mut::<f32>()?,
        q_stride: strides(opts.layout, (dims.batch, dims.heads_q, dims.seq_q, dims.d)),
        kv_stride: strides(opts.layout, (dims.batch, dims.heads_kv, dims.seq_k, dims.d)),
        lo,
        hi,
        seq_q: dims.seq_q as u32,
        seq_k: dims.seq_k as u32,
        d: dims.d as u32,
        heads_q: dims.heads_q as u32,
        group: (dims.heads_q / dims.heads_kv.max(1)) as u32,
        q_blocks: p.fwd.q_blocks,
        k_blocks: p.k_blocks,
        scale,
        scale_log2: scale * std::f32::consts::LOG2_E,
        pad: 0,
    };
    if uses_hopper_bwd(&dev, dtype, &dims, p.fwd.dp) {
        launch_backward(&dev, &kernels, &params, &dims, &p, false)?;
        return launch_hopper_bwd(op, &dev, dtype, &params, &dims, &p);
    }
    launch_backward(&dev, &kernels, &params, &dims, &p, true)
}

/// Whether the backward of `dims` runs on the Hopper kernels (`kernels-gpu/src/attention/
/// hopper_bwd.rs`) after `prep`: an sm_90a GPU with their shared memory and a padded head dim
/// of 64 or 128.
fn uses_hopper_bwd(dev: &Device, dtype: DType, dims: &Dims, dp: u32) -> bool {
    dev.ptx_arch() == "sm_90a"
        && hopper_bwd_kernels(dtype, dp).is_some()
        && dims.seq_k > 0
        && dims.seq_q > 0
        && dev.max_shared_bytes() >= hopper_bwd::smem_bytes(dp)
}

/// Launches the Hopper backward's dQ and dK/dV kernels once `prep` has written the workspaces:
/// the tensor maps of Q, K, V and dO (boxes of 64 x 64) on the device (`upload_maps`: a slot of
/// the device's cache, or a buffer written just before, stream-ordered), then pieces of the batch that keep both grids below 2^31.
fn launch_hopper_bwd(
    op: &'static str,
    dev: &Device,
    dtype: DType,
    params: &AttnBwdParams,
    dims: &Dims,
    p: &BwdPlan,
) -> Result<()> {
    let dp = p.fwd.dp;
    let (dq_kernel, dkdv_kernel) = hopper_bwd_kernels(dtype, dp)
        .ok_or_else(|| Error::InvalidArgument { op, message: format!("internal: no Hopper backward for {dp}") })?;
    let map = |ptr: *const u16, (rows, heads): (usize, usize), st: [u64; 3]| {
        let shape = [dims.d as u64, rows as u64, heads as u64, dims.batch as u64];
        super::gemm_wgmma::tiled_map(op, dtype, ptr as u64, &shape, &[st[2], st[1], st[0]], &[64, hopper_bwd::BN, 1, 1])
    };
    let (qs, ks) = (params.q_stride, params.kv_stride);
    let maps = [
        map(params.q, (dims.seq_q, dims.heads_q), qs)?,
        map(params.k, (dims.seq_k, dims.heads_kv), ks)?,
        map(params.v, (dims.seq_k, dims.heads_kv), ks)?,
        map(params.dout, (dims.seq_q, dims.heads_q), qs)?,
    ];
    let maps = super::gemm_wgmma::upload_maps(op, dev, &maps)?;
    let bm = hopper_bwd::BM as usize;
    let (q_blocks, k_blocks) = (dims.seq_q.div_ceil(bm), dims.seq_k.div_ceil(bm));
    let (dq_per_batch, dkdv_per_batch) = (q_blocks * dims.heads_q, k_blocks * dims.heads_kv);
    let batches = (i32::MAX as usize / dq_per_batch.max(dkdv_per_batch).max(1)).clamp(1, dims.batch.max(1));
    let smem = hopper_bwd::smem_bytes(dp);
    let mut z0 = 0;
    while z0 < dims.batch {
        let nz = (dims.batch - z0).min(batches);
        let piece = HopperBwdParams {
            maps: maps.ptr() as *const u64,
            dq: params.dq,
            dk: params.dk,
            dv: params.dv,
            lse2: params.lse2,
            delta: params.delta,
            q_stride: qs,
            kv_stride: ks,
            lo: params.lo,
            hi: params.hi,
            seq_q: params.seq_q,
            seq_k: params.seq_k,
            d: params.d,
            heads_q: params.heads_q,
            group: params.group,
            blocks: q_blocks as u32,
            stat_pitch: p.fwd.q_blocks * attn::BM,
            scale: params.scale,
            scale_log2: params.scale_log2,
            z0: z0 as u32,
        };
        let cfg = |blocks: usize| LaunchConfig {
            grid: ((blocks * nz) as u32, 1, 1),
            block: (hopper_bwd::THREADS, 1, 1),
            shared_bytes: smem,
        };
        // SAFETY: the maps describe Q, K, V and dO as `attention_backward` checked them (the
        // copy engine reads nothing outside them); dQ, dK and dV are this call's outputs of the
        // inputs' shapes and strides, the workspaces `prep`'s (`batch * heads_q * stat_pitch`
        // f32 each, written before in stream order); each grid covers batches `z0..z0 + nz`
        // (`blocks` resident blocks per head); `smem` is within the device's limit
        // (`uses_hopper_bwd`); the maps live until the kernels have read them (a cache slot is
        // never rewritten, a buffer of this call's own is freed stream-ordered after them).
        unsafe {
            dev.launch(dq_kernel, cfg(dq_per_batch), (piece,))?;
            dev.launch(dkdv_kernel, cfg(dkdv_per_batch), (HopperBwdParams { blocks: k_blocks as u32, ..piece },))?;
        }
        z0 += nz;
    }
    Ok(())
}

/// How a backward is launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BwdPlan {
    /// The forward's plan: the padded head dim, `q_blocks` (the grid of `prep` and `dq`) and the
    /// batches per launch, here also within the dK/dV grid's limit.
    pub fwd: Plan,
    /// Key blocks per (batch, key/value head): `ceil(Sk / 64)`.
    pub k_blocks: u32,
    /// Dynamic shared memory of the dQ kernel.
    pub smem_dq: u32,
    /// Dynamic shared memory of the dK/dV kernels.
    pub smem_dkdv: u32,
}

/// The backward's launch of `dims` on a GPU whose blocks may have `max_smem` bytes of dynamic
/// shared memory (errors as [`plan`]'s).
pub(crate) fn plan_backward(op: &'static str, dims: &Dims, max_smem: u32) -> Result<BwdPlan> {
    let mut fwd = plan(op, dims, max_smem)?;
    let (smem_dq, smem_dkdv) = (bwd::smem_dq(fwd.dp), bwd::smem_dkdv(fwd.dp));
    let need = smem_dq.max(smem_dkdv);
    if need > max_smem {
        return Err(Error::InvalidArgument {
            op,
            message: format!(
                "the backward of head dim {} needs {need} bytes of shared memory a block; this GPU allows {max_smem}",
                dims.d
            ),
        });
    }
    let k_blocks = dims.seq_k.div_ceil(bwd::BN_KV as usize);
    let per_batch = k_blocks.saturating_mul(dims.heads_kv).max(1);
    let limit = i32::MAX as usize;
    if per_batch > limit {
        return Err(Error::InvalidArgument {
            op,
            message: format!("{} heads of {} keys exceed a grid's 2^31 blocks", dims.heads_kv, dims.seq_k),
        });
    }
    fwd.batches = fwd.batches.min(limit / per_batch).max(1);
    Ok(BwdPlan { fwd, k_blocks: k_blocks as u32, smem_dq, smem_dkdv })
}

/// Launches the backward's kernels over every batch, [`Plan::batches`] at a time: `prep`, then,
/// with `all`, the dQ and dK/dV kernels.
fn launch_backward(
    dev: &Device,
    kernels: &bwd::BwdKernels,
    params: &AttnBwdParams,
    dims: &Dims,
    p: &BwdPlan,
    all: bool,
) -> Result<()> {
    let stats_per_batch = (dims.heads_q * p.fwd.q_blocks as usize * attn::BM as usize) as u64;
    let lse_per_batch = (dims.heads_q * dims.seq_q) as u64;
    let mut z0 = 0;
    while z0 < dims.batch {
        let nz = (dims.batch - z0).min(p.fwd.batches);
        let at = |ptr: u64, stride: u64, size: u64| ptr + z0 as u64 * stride * size;
        let (qs, ks) = (params.q_stride[0], params.kv_stride[0]);
        let piece = AttnBwdParams {
            q: at(params.q as u64, qs, 2) as *const u16,
            k: at(params.k as u64, ks, 2) as *const u16,
            v: at(params.v as u64, ks, 2) as *const u16,
            o: at(params.o as u64, qs, 2) as *const u16,
            dout: at(params.dout as u64, qs, 2) as *const u16,
            dq: at(params.dq as u64, qs, 2) as *mut u16,
            dk: at(params.dk as u64, ks, 2) as *mut u16,
            dv: at(params.dv as u64, ks, 2) as *mut u16,
            lse: at(params.lse as u64, lse_per_batch, 4) as *const f32,
            lse2: at(params.lse2 as u64, stats_per_batch, 4) as *mut f32,
            delta: at(params.delta as u64, stats_per_batch, 4) as *mut f32,
            ..*params
        };
        let q_grid = (p.fwd.q_blocks * dims.heads_q as u32 * nz as u32, 1, 1);
        let cfg = |grid, shared_bytes| LaunchConfig { grid, block: (attn::THREADS, 1, 1), shared_bytes };
        // SAFETY: `attention_backward` checked Q, K, V, O, dO and lse against these shapes,
        // strides and dtypes, their bases 16-byte aligned; dQ, dK, dV (the inputs' shapes) and
        // the workspaces (`batch * heads_q * q_blocks * 64` f32 each) are this call's own
        // allocations. This piece's pointers start at batch z0 and its grids cover its `nz`
        // batches: `q_blocks * heads_q` blocks each for `prep` and `dq`, `k_blocks * heads_kv`
        // for the dK/dV kernels; the shared memory is each kernel's own size, within the
        // device's limit (`plan_backward`). The kernels run in stream order: `prep` writes the
        // workspaces the others read.
        unsafe {
            dev.launch(kernels.prep, cfg(q_grid, 0), (piece,))?;
            if !all {
                z0 += nz;
                continue;
            }
            dev.launch(kernels.dq, cfg(q_grid, p.smem_dq), (piece,))?;
            for kernel in kernels.dkdv.iter().flatten() {
                let grid = (p.k_blocks * dims.heads_kv as u32 * nz as u32, 1, 1);
                dev.launch(*kernel, cfg(grid, p.smem_dkdv), (piece,))?;
            }
        }
        z0 += nz;
    }
    Ok(())
}

/// Launches the forward over every batch, [`Plan::batches`] at a time.
fn launch(
    dev: &Device,
    kernel: kernels_gpu::kernel::Kernel<AttentionArgs>,
    params: &AttnParams,
    dims: &Dims,
    p: &Plan,
) -> Result<()> {
    let lse_per_batch = (dims.heads_q * dims.seq_q) as u64;
    let mut z0 = 0;
    while z0 < dims.batch {
        let nz = (dims.batch - z0).min(p.batches);
        let at = |ptr: u64, stride: u64, size: u64| ptr + z0 as u64 * stride * size;
        let piece = AttnParams {
            q: at(params.q as u64, params.q_stride[0], 2) as *const u16,
            k: at(params.k as u64, params.k_stride[0], 2) as *const u16,
            v: at(params.v as u64, params.v_stride[0], 2) as *const u16,
            o: at(params.o as u64, params.o_stride[0], 2) as *mut u16,
            lse: at(params.lse as u64, lse_per_batch, 4) as *mut f32,
            ..*params
        };
        let cfg = LaunchConfig {
            grid: (p.q_blocks * dims.heads_q as u32 * nz as u32, 1, 1),
            block: (attn::THREADS, 1, 1),
            shared_bytes: p.smem,
        };
        // SAFETY: `dims` checked Q, K and V against these shapes and strides (K, V with
        // `heads_q / group` heads) and their dtype against the kernel's; their bases are 16-byte
        // aligned; O (Q's shape, this call's own allocation) and lse (`[B, Hq, Sq]` f32) are
        // written, the rest only read. The grid is `q_blocks * heads_q` blocks for each of the
        // `nz` batches of this piece, whose pointers start at batch z0; `smem` is the kernel's
        // `smem_bytes` for its padded head dim, within the device's limit (`plan`).
        unsafe { dev.launch(kernel, cfg, (piece,))? };
        z0 += nz;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(batch: usize, heads_q: usize, heads_kv: usize, seq_q: usize, seq_k: usize, d: usize) -> Dims {
        Dims { batch, heads_q, heads_kv, seq_q, seq_k, d }
    }

    #[test]
    fn shapes_in_both_layouts() {
        let r = dims("attention", Layout::Bhsd, &[2, 8, 100, 64], &[2, 2, 37, 64], &[2, 2, 37, 64]);
        assert_eq!(r.unwrap(), d(2, 8, 2, 100, 37, 64));
        let r = dims("attention", Layout::Bshd, &[2, 100, 8, 96], &[2, 37, 1, 96], &[2, 37, 1, 96]);
        assert_eq!(r.unwrap(), d(2, 8, 1, 100, 37, 96));
        // Empty sizes are shapes like any other.
        let r = dims("attention", Layout::Bhsd, &[0, 4, 0, 8], &[0, 4, 0, 8], &[0, 4, 0, 8]);
        assert_eq!(r.unwrap(), d(0, 4, 4, 0, 0, 8));
        assert_eq!(strides(Layout::Bhsd, (2, 8, 100, 64)), [8 * 100 * 64, 100 * 64, 64]);
        assert_eq!(strides(Layout::Bshd, (2, 8, 100, 64)), [100 * 8 * 64, 64, 8 * 64]);
    }

    #[test]
    fn bad_shapes_are_typed_errors() {
        let e = |q: &[usize], k: &[usize], v: &[usize]| dims("attention", Layout::Bhsd, q, k, v).unwrap_err();
        let msg = |err: Error| match err {
            Error::InvalidArgument { message, .. } => message,
            other => panic!("expected InvalidArgument, got {other:?}"),
        };
        assert!(msg(e(&[2, 8, 100], &[2, 8, 100, 64], &[2, 8, 100, 64])).contains("rank 4"));
        assert!(matches!(e(&[2, 8, 10, 64], &[2, 8, 10, 64], &[2, 8, 11, 64]), Error::ShapeMismatch { .. }));
        assert!(matches!(e(&[2, 8, 10, 64], &[3, 8, 10, 64], &[3, 8, 10, 64]), Error::ShapeMismatch { .. }));
        assert!(matches!(e(&[2, 8, 10, 64], &[2, 8, 10, 32], &[2, 8, 10, 32]), Error::ShapeMismatch { .. }));
        for bad in [0, 12, 264, 512] {
            let s = [1, 1, 4, bad];
            assert!(msg(e(&s, &s, &s)).contains("multiple of 8 from 8 to 256"), "{bad}");
        }
        assert!(msg(e(&[1, 8, 4, 64], &[1, 3, 4, 64], &[1, 3, 4, 64])).contains("multiple of k's"));
        assert!(msg(e(&[1, 8, 4, 64], &[1, 0, 4, 64], &[1, 0, 4, 64])).contains("multiple of k's"));
        assert!(msg(e(&[1, 1, 1 << 31, 64], &[1, 1, 4, 64], &[1, 1, 4, 64])).contains("below 2^31"));
    }

    /// The band against the documented rule, for every mask.
    #[test]
    fn bands_follow_the_documented_masks() {
        for (sq, sk) in [(5usize, 5usize), (3, 9), (9, 3), (1, 1), (4, 0)] {
            let br = sk as i64 - sq as i64;
            let sees = |(lo, hi): (i64, i64), i: i64, j: i64| i + lo <= j && j <= i + hi;
            for i in 0..sq as i64 {
                for j in 0..sk as i64 {
                    assert!(sees(band(Causal::None, None, sq, sk), i, j));
                    assert_eq!(sees(band(Causal::TopLeft, None, sq, sk), i, j), j <= i);
                    assert_eq!(sees(band(Causal::BottomRight, None, sq, sk), i, j), j <= i + br);
                    let w = Some((2, 1));
                    assert_eq!(sees(band(Causal::None, w, sq, sk), i, j), i + br - 2 <= j && j <= i + br + 1);
                    assert_eq!(sees(band(Causal::TopLeft, w, sq, sk), i, j), i - 2 <= j && j <= i);
                    assert_eq!(sees(band(Causal::BottomRight, w, sq, sk), i, j), i + br - 2 <= j && j <= i + br);
                    let wide = Some((usize::MAX, usize::MAX));
                    assert!(sees(band(Causal::None, wide, sq, sk), i, j));
                    let causal = band(Causal::None, Some((usize::MAX, 0)), sq, sk);
                    assert_eq!(sees(causal, i, j), j <= i + br);
                }
            }
        }
        let (lo, hi) = band(Causal::None, Some((usize::MAX, usize::MAX)), 1 << 30, 1);
        assert!(lo >= -BIG && hi <= BIG);
    }

    #[test]
    fn plans_fit_the_shared_memory_and_the_grid() {
        let h100 = 227 * 1024;
        let p = plan("attention", &d(3, 8, 2, 100, 300, 96), h100).unwrap();
        assert_eq!(p, Plan { dp: 128, smem: 87040, q_blocks: 2, batches: 3 });
        let p = plan("attention", &d(1, 1, 1, 1, 1, 8), 48 * 1024).unwrap();
        assert_eq!((p.dp, p.smem), (64, 46080));
        // D = 256 needs 99 KiB: refused where a block may have 64 KiB.
        let err = plan("attention", &d(1, 1, 1, 1, 1, 256), 64 * 1024).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { ref message, .. } if message.contains("101376 bytes")));
        // Batches split so that the grid stays below 2^31 blocks.
        let p = plan("attention", &d(1000, 1 << 12, 1, 1 << 20, 1, 64), h100).unwrap();
        let per = (1usize << 14) * (1 << 12);
        assert_eq!(p.batches, i32::MAX as usize / per);
        assert!(p.batches * per <= i32::MAX as usize);
        assert!(plan("attention", &d(1, 1 << 16, 1, 1 << 30, 1, 64), h100).is_err());
        // Empty problems plan (and launch nothing).
        let p = plan("attention", &d(0, 0, 0, 0, 0, 64), h100).unwrap();
        assert_eq!((p.q_blocks, p.batches), (0, 1));
    }

    #[test]
    fn backward_plans_fit_the_shared_memory_and_both_grids() {
        let h100 = 227 * 1024;
        let p = plan_backward("attention_backward", &d(3, 8, 2, 100, 300, 96), h100).unwrap();
        assert_eq!((p.fwd.dp, p.fwd.q_blocks, p.k_blocks, p.fwd.batches), (128, 2, 5, 3));
        assert_eq!((p.smem_dq, p.smem_dkdv), (bwd::smem_dq(128), bwd::smem_dkdv(128)));
        // D = 256 needs 135 KiB for the backward: refused where the forward's 99 KiB fits.
        let err = plan_backward("attention_backward", &d(1, 1, 1, 1, 1, 256), 110 * 1024).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { ref message, .. } if message.contains("backward")));
        // The key grid limits the batches per launch too.
        let p = plan_backward("attention_backward", &d(1000, 1 << 10, 1 << 10, 64, 1 << 20, 64), h100).unwrap();
        let per_k = (1usize << 14) * (1 << 10);
        assert_eq!(p.fwd.batches, i32::MAX as usize / per_k);
        assert!(plan_backward("attention_backward", &d(1, 1 << 16, 1 << 16, 1, 1 << 30, 64), h100).is_err());
    }
}
