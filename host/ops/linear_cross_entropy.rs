//! Linear layer + cross-entropy, forward and backward together, in chunks of rows, as the fused
//! losses of LLM training (Liger-Kernel's `FusedLinearCrossEntropy`): `loss = CE(h @ W^T, t)`
//! with the gradients of `h` and `W`, without ever holding the `[N, V]` logits. No kernels of
//! its own: the GEMM and [`cross_entropy_one_pass`](super::cross_entropy_one_pass)'s kernel.
//!
//! For each chunk of rows `[r0, r1)`: `logits = h[r0..r1] @ W^T` (one GEMM into a reused
//! `[chunk, V]` buffer), the one-pass cross-entropy turns those logits into their gradient in
//! place (already scaled by the loss's gradient: the mean's count of rows not ignored is counted
//! over all rows first), then `dh[r0..r1] = dlogits @ W` and `dW += dlogits^T @ h[r0..r1]` (the
//! GEMM's `beta = 1`).
//!
//! Memory beyond the inputs and the returned gradients (`dh` `[N, H]`, `dW` `[V, H]`): the
//! chunk's logits, `chunk * V` elements (at most [`LinearCrossEntropyOpts::chunk_bytes`], 256
//! MiB by default, or the given rows), and `N` f32 per-row losses. With
//! [`LinearCrossEntropyOpts::weight_grad_f32`] `dW` is f32 (`V * H * 4` bytes) and sums the
//! chunks exactly as the GEMM's f32 accumulator does; otherwise it has the weight's dtype and is
//! rounded once per chunk.

use super::check::check_same_device;
use super::cross_entropy::{
    CrossEntropyOnePassOpts, OnePassPtrs, Reduction, finish_loss, launch_count, launch_one_pass,
};
use super::gemm::{Gemm, gemm};
use crate::error::{Error, Result};
use crate::tensor::{IndexTensor, Tensor};
use kernels_gpu::DType;

/// The options of [`linear_cross_entropy`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearCrossEntropyOpts {
    /// The cross-entropy's: reduction, `ignore_index`, label smoothing, z-loss, and the loss's
    /// gradient (`grad_scale`). For [`Reduction::None`] the gradients are those of
    /// `grad_scale` times the sum of the rows' losses.
    pub ce: CrossEntropyOnePassOpts,
    /// Rows per chunk, rounded up to a multiple of 8 (every chunk then starts 16-byte aligned);
    /// `None`: as many as keep the chunk's logits within `chunk_bytes`.
    pub chunk_rows: Option<usize>,
    /// The bound on the chunk's logits when `chunk_rows` is `None` (at least 8 rows are taken).
    pub chunk_bytes: usize,
    /// Accumulate and return the weight's gradient in f32 (else in the weight's dtype).
    pub weight_grad_f32: bool,
}

impl Default for LinearCrossEntropyOpts {
    fn default() -> Self {
        LinearCrossEntropyOpts {
            ce: CrossEntropyOnePassOpts::default(),
            chunk_rows: None,
            chunk_bytes: 256 << 20,
            weight_grad_f32: false,
        }
    }
}

/// What [`linear_cross_entropy`] returns.
#[derive(Debug)]
pub struct LinearCrossEntropy {
    /// The loss: `[]`, or `[N]` for [`Reduction::None`], in the hidden states' dtype.
    pub loss: Tensor,
    /// The gradient of the hidden states, `[N, H]`.
    pub hidden_grad: Tensor,
    /// The gradient of the weight, `[V, H]` (f32 with `weight_grad_f32`).
    pub weight_grad: Tensor,
}

/// Rows per chunk for `v` classes of `dt`.
fn chunk_rows(opts: &LinearCrossEntropyOpts, v: usize, dt: DType) -> usize {
    let rows = opts.chunk_rows.unwrap_or(opts.chunk_bytes / (v * dt.size()).max(1));
    rows.max(1).checked_next_multiple_of(8).unwrap_or(usize::MAX / 8 * 8)
}

/// A tensor over `shape` of `dt` at byte offset `off` into `t`'s memory.
///
/// # Safety
/// `off` plus the view's bytes lie within `t`, `t` outlives the view and the work issued on it,
/// and no other tensor writes that memory while an op writes the view.
unsafe fn view(t: &Tensor, off: usize, shape: &[usize]) -> Result<Tensor> {
    // SAFETY: the caller's contract is from_device_ptr's (same device and context as `t`).
    unsafe { Tensor::from_device_ptr(t.device(), t.dev_ptr_u64() + off as u64, shape, t.dtype()) }
}

/// Cross-entropy of `hidden @ weight^T` (`[N, H] @ [V, H]^T`, PyTorch's
/// `F.cross_entropy(F.linear(hidden, weight), target)`) and the gradients of `hidden` and
/// `weight`, in chunks of rows (see the module's documentation for the memory). `hidden` and
/// `weight` share a dtype: bf16 or f16 run on the tensor cores with f32 accumulation, f32 on the
/// f32 GEMM. The loss's options and errors are [`cross_entropy_one_pass`](super::cross_entropy_one_pass)'s.
pub fn linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    target: &IndexTensor,
    opts: LinearCrossEntropyOpts,
) -> Result<LinearCrossEntropy> {
    let op = "linear_cross_entropy";
    let (n, h, v) = match (hidden.shape(), weight.shape()) {
        (&[n, h], &[v, hw]) if h == hw => (n, h, v),
        (hs, ws) => {
            return Err(Error::InvalidArgument {
                op,
                message: format!("hidden must be [N, H] and weight [V, H], got {hs:?} and {ws:?}"),
            });
        }
    };
    check_same_device(op, hidden, weight)?;
    if hidden.dtype() != weight.dtype() {
        return Err(Error::InvalidArgument {
            op,
            message: format!("hidden and weight must share a dtype, got {:?} and {:?}", hidden.dtype(), weight.dtype()),
        });
    }
    if target.shape() != [n] {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![n],
            got: target.shape().to_vec(),
            detail: "one target class index per row of hidden",
        });
    }
    if target.device() != hidden.device() {
        return Err(Error::DeviceMismatch { op, expected: hidden.device().ordinal(), got: target.device().ordinal() });
    }
    if v == 0 && n > 0 {
        return Err(Error::InvalidArgument { op, message: "the weight has no classes (V = 0)".into() });
    }
    let ce = opts.ce;
    let s = ce.ce.label_smoothing;
    if !(0.0..=1.0).contains(&s) {
        return Err(Error::InvalidArgument { op, message: format!("label_smoothing must be in [0, 1], got {s}") });
    }
    for (x, what) in [(ce.z_loss, "z_loss"), (ce.grad_scale, "grad_scale")] {
        if !x.is_finite() {
            return Err(Error::InvalidArgument { op, message: format!("{what} must be finite, got {x}") });
        }
    }
    let dev = hidden.device();
    let dt = hidden.dtype();
    let wdt = if opts.weight_grad_f32 { DType::F32 } else { dt };
    let dh = Tensor::alloc(op, dev, &[n, h], dt)?;
    // Zeros for N = 0; every chunk after the first adds to it.
    let mut dw = if n == 0 { Tensor::zeros(dev, &[v, h], wdt)? } else { Tensor::alloc(op, dev, &[v, h], wdt)? };
    let loss_shape: &[usize] = if ce.ce.reduction == Reduction::None { &[n] } else { &[] };
    let mut loss = Tensor::alloc(op, dev, loss_shape, dt)?;
    let mut loss_f32 = Tensor::alloc(op, dev, &[n], DType::F32)?;
    let mut count = Tensor::alloc(op, dev, &[1], DType::F32)?;
    let mut bad = IndexTensor::zeros(dev, &[1])?;
    let chunk = chunk_rows(&opts, v, dt).min(n.next_multiple_of(8)).max(8);
    let logits = if n > 0 { Tensor::alloc(op, dev, &[chunk, v], dt)? } else { Tensor::alloc(op, dev, &[0], dt)? };
    let (count_ptr, loss_ptr) = (count.dev_ptr_mut::<f32>()? as u64, loss_f32.dev_ptr_mut::<f32>()? as u64);
    let loss_out = if ce.ce.reduction == Reduction::None { loss.dev_ptr_mut::<u8>()? as u64 } else { 0 };
    let bad_ptr = bad.dev_ptr_mut() as u64;
    let tgt = target.dev_ptr() as u64;
    if ce.ce.reduction == Reduction::Mean {
        // SAFETY: target holds n indices, count one f32.
        unsafe { launch_count(dev, tgt, count_ptr, n as u64, ce.ce.ignore_index)? };
    }
    let sz = dt.size();
    let mut r0 = 0;
    while r0 < n {
        let c = chunk.min(n - r0);
        // SAFETY: r0 + c <= n rows of hidden and dh, c <= chunk rows of the logits buffer; r0 is a
        // multiple of 8, so every view starts 16-byte aligned; the parents outlive this call's
        // work (stream-ordered), and each view is the only writer of its memory while written.
        let (hv, mut lv, mut dhv) = unsafe {
            (view(hidden, r0 * h * sz, &[c, h])?, view(&logits, 0, &[c, v])?, view(&dh, r0 * h * sz, &[c, h])?)
        };
        gemm(&hv, weight, &mut lv, Gemm::new(false, true))?;
        let lp = lv.dev_ptr_mut::<u8>()? as u64;
        let p = OnePassPtrs {
            x: lp,
            gx: lp,
            target: tgt + 8 * r0 as u64,
            grad: 0,
            count: count_ptr,
            loss: loss_ptr + 4 * r0 as u64,
            loss_out: if loss_out == 0 { 0 } else { loss_out + (sz * r0) as u64 },
            bad: bad_ptr,
        };
        // SAFETY: the logits view holds c * v of dt (gradient in place); target, the losses
        // (and for none loss_out) from row r0 hold c entries; count and bad one each.
        unsafe { launch_one_pass(dev, dt, &p, c as u64, v as u64, &ce)? };
        gemm(&lv, weight, &mut dhv, Gemm::default())?;
        let g = Gemm { trans_a: true, beta: if r0 == 0 { 0.0 } else { 1.0 }, ..Gemm::default() };
        gemm(&lv, &hv, &mut dw, g)?;
        r0 += c;
    }
    finish_loss(op, target, &loss_f32, &bad, &ce.ce, &mut loss, v as u64)?;
    Ok(LinearCrossEntropy { loss, hidden_grad: dh, weight_grad: dw })
}
