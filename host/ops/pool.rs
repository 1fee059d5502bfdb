//! 2-d pooling (host side of `kernels-gpu/src/pool.rs`): [`max_pool2d`], [`avg_pool2d`] and
//! [`global_avg_pool2d`] with their backward passes, as PyTorch's `F.max_pool2d`,
//! `F.avg_pool2d` and `F.adaptive_avg_pool2d(x, 1)`, over `[N, C, H, W]` or `[N, H, W, C]`
//! ([`Layout2d`]), f32, f16 and bf16 (sums in f32).
//!
//! The windows, output sizes (`ceil_mode` included), divisors (`count_include_pad`) and the
//! padding limit (at most half the kernel) are PyTorch's; so is NaN in a max window (it wins)
//! and the saved index (`h * W + w` within the plane). The backward passes gather per input
//! element, so they are deterministic.

use super::batchnorm::Layout2d;
use super::check::{check_same_device, check_same_dtype, shapes_match, with_elem};
use crate::error::{Error, Result};
use crate::launch;
use crate::tensor::{IndexTensor, Tensor};
use kernels_gpu::pool::{
    AvgBwdArgs, AvgFwdArgs, GapBwdArgs, GapFwdArgs, INCLUDE_PAD, MaxBwdArgs, MaxFwdArgs, PoolElem, pack,
};

/// Kernel, stride and padding of [`max_pool2d`] and [`avg_pool2d`], in (rows, columns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dOpts {
    /// The window.
    pub kernel: (usize, usize),
    /// The step between windows (PyTorch's default: the kernel).
    pub stride: (usize, usize),
    /// Implicit padding on each side, at most half the kernel (max pooling pads with -inf,
    /// average pooling with zeros).
    pub padding: (usize, usize),
    /// Output sizes rounded up (a last window that starts inside the input or its left padding).
    pub ceil_mode: bool,
    /// Average pooling: divide by the window's size including padding (PyTorch's default) or
    /// only by its elements inside the input.
    pub count_include_pad: bool,
    /// The memory layout of the input (and of the output and gradients).
    pub layout: Layout2d,
}

impl Pool2dOpts {
    /// A square `k x k` window with stride `k`, no padding, PyTorch's defaults otherwise.
    pub fn new(k: usize) -> Self {
        Pool2dOpts {
            kernel: (k, k),
            stride: (k, k),
            padding: (0, 0),
            ceil_mode: false,
            count_include_pad: true,
            layout: Layout2d::Nchw,
        }
    }
}

/// PyTorch's `pooling_output_shape` for one dimension (`op` names the error).
fn out_len(op: &'static str, len: usize, k: usize, s: usize, p: usize, ceil: bool) -> Result<usize> {
    let bad = |message: String| Err(Error::InvalidArgument { op, message });
    if k == 0 || s == 0 {
        return bad(format!("kernel {k} and stride {s} must be positive"));
    }
    if p > k / 2 {
        return bad(format!("padding {p} must be at most half of the kernel {k}"));
    }
    const LIMIT: usize = i32::MAX as usize;
    if len > LIMIT || k > LIMIT || s > LIMIT || p > LIMIT {
        return bad(format!("sizes past 2^31 - 1: input {len}, kernel {k}, stride {s}, padding {p}"));
    }
    let span = (len + 2 * p) as i64 - k as i64;
    let mut out =
        if span < 0 { 0 } else { (if ceil { (span + s as i64 - 1) / s as i64 } else { span / s as i64 }) + 1 };
    if ceil && out > 0 && (out - 1) * s as i64 >= (len + p) as i64 {
        out -= 1;
    }
    if out <= 0 {
        return bad(format!("the output is empty: input {len}, kernel {k}, stride {s}, padding {p}"));
    }
    Ok(out as usize)
}

/// The input's `(N, C, H, W)` and the output's `(OH, OW)`.
type Geometry = ((usize, usize, usize, usize), (usize, usize));

/// The [`Geometry`] of a pooling of `input` (a shape).
fn geometry(op: &'static str, input: &[usize], o: &Pool2dOpts) -> Result<Geometry> {
    let (n, c, h, w) = o.layout.dims(op, input)?;
    let oh = out_len(op, h, o.kernel.0, o.stride.0, o.padding.0, o.ceil_mode)?;
    let ow = out_len(op, w, o.kernel.1, o.stride.1, o.padding.1, o.ceil_mode)?;
    Ok(((n, c, h, w), (oh, ow)))
}

/// The packed size arguments `(in_hw, out_hw, k, s, p)`.
fn packed(h: usize, w: usize, oh: usize, ow: usize, o: &Pool2dOpts) -> (u64, u64, u64, u64, u64) {
    let p2 = |a: usize, b: usize| pack(a as u64, b as u64);
    (p2(h, w), p2(oh, ow), p2(o.kernel.0, o.kernel.1), p2(o.stride.0, o.stride.1), p2(o.padding.0, o.padding.1))
}

/// `out` must be a tensor of `like`'s dtype and device of shape `shape`.
fn check_out(op: &'static str, like: &Tensor, out: &Tensor, shape: &[usize], what: &'static str) -> Result<()> {
    check_same_device(op, like, out)?;
    check_same_dtype(op, like, out)?;
    shapes_match(op, shape, out.shape(), what)
}

/// Max pooling 2d, as `F.max_pool2d(x, kernel, stride, padding, ceil_mode=...,
/// return_indices=True)`: the output and the index (`h * W + w` in the plane) of each window's
/// maximum, the first in row-major order, or the last NaN if the window has one.
pub fn max_pool2d(x: &Tensor, opts: &Pool2dOpts) -> Result<(Tensor, IndexTensor)> {
    let op = "max_pool2d";
    let ((n, c, _, _), (oh, ow)) = geometry(op, x.shape(), opts)?;
    let shape = opts.layout.shape(n, c, oh, ow);
    let mut y = Tensor::alloc(op, x.device(), &shape, x.dtype())?;
    let mut idx = IndexTensor::alloc(op, x.device(), &shape)?;
    max_pool2d_out(x, opts, &mut y, &mut idx)?;
    Ok((y, idx))
}

/// [`max_pool2d`] into `y` (the output's shape, x's dtype and device) and `indices` (the
/// output's shape, memory no clone shares).
pub fn max_pool2d_out(x: &Tensor, opts: &Pool2dOpts, y: &mut Tensor, indices: &mut IndexTensor) -> Result<()> {
    let op = "max_pool2d";
    let ((n, c, h, w), (oh, ow)) = geometry(op, x.shape(), opts)?;
    let shape = opts.layout.shape(n, c, oh, ow);
    check_out(op, x, y, &shape, "y must have the output's shape")?;
    shapes_match(op, &shape, indices.shape(), "indices must have the output's shape")?;
    if indices.device() != x.device() {
        return Err(Error::DeviceMismatch { op, expected: x.device().ordinal(), got: indices.device().ordinal() });
    }
    let dev = x.device().clone();
    let total = y.numel() as u64;
    let (ihw, ohw, k, s, p) = packed(h, w, oh, ow, opts);
    with_elem!(x.dtype(), |T| {
        let kernel = <T as PoolElem>::MAX_FWD;
        if let Some(cfg) = launch::elementwise(total, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?) {
            let args: MaxFwdArgs<T> = (
                x.dev_ptr(),
                y.dev_ptr_mut()?,
                indices.dev_ptr_mut_unshared(op)?,
                n as u64,
                c as u64,
                ihw,
                ohw,
                k,
                s,
                p,
                opts.layout.code(),
            );
            // SAFETY: x holds n c h w elements (its shape), y and idx n c oh ow (checked), each
            // its own memory; the windows stay inside the plane (clipped).
            unsafe { dev.launch(kernel, cfg, args) }?;
        }
        Ok::<(), Error>(())
    })
}

/// The gradient of [`max_pool2d`]'s input of shape `input_shape`: each element receives the sum
/// of `grad` over the windows whose saved index it is (f32, windows in increasing order).
pub fn max_pool2d_backward(
    grad: &Tensor,
    indices: &IndexTensor,
    input_shape: &[usize],
    opts: &Pool2dOpts,
) -> Result<Tensor> {
    let op = "max_pool2d_backward";
    geometry(op, input_shape, opts)?;
    let mut dx = Tensor::alloc(op, grad.device(), input_shape, grad.dtype())?;
    max_pool2d_backward_out(grad, indices, opts, &mut dx)?;
    Ok(dx)
}

/// [`max_pool2d_backward`] into `dx`, of the input's shape (grad's dtype and device).
pub fn max_pool2d_backward_out(grad: &Tensor, indices: &IndexTensor, opts: &Pool2dOpts, dx: &mut Tensor) -> Result<()> {
    let op = "max_pool2d_backward";
    let ((n, c, h, w), (oh, ow)) = geometry(op, dx.shape(), opts)?;
    let shape = opts.layout.shape(n, c, oh, ow);
    shapes_match(op, &shape, grad.shape(), "grad must have the output's shape")?;
    shapes_match(op, &shape, indices.shape(), "indices must have the output's shape")?;
    if indices.device() != grad.device() {
        return Err(Error::DeviceMismatch { op, expected: grad.device().ordinal(), got: indices.device().ordinal() });
    }
    check_same_device(op, grad, dx)?;
    check_same_dtype(op, grad, dx)?;
    let dev = grad.device().clone();
    let total = dx.numel() as u64;
    let (ihw, ohw, k, s, p) = packed(h, w, oh, ow, opts);
    with_elem!(grad.dtype(), |T| {
        let kernel = <T as PoolElem>::MAX_BWD;
        if let Some(cfg) = launch::elementwise(total, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?) {
            let args: MaxBwdArgs<T> = (
                grad.dev_ptr(),
                indices.dev_ptr(),
                dx.dev_ptr_mut()?,
                n as u64,
                c as u64,
                ihw,
                ohw,
                k,
                s,
                p,
                opts.layout.code(),
            );
            // SAFETY: grad and indices hold n c oh ow elements (checked), dx n c h w (its shape),
            // its own memory.
            unsafe { dev.launch(kernel, cfg, args) }?;
        }
        Ok::<(), Error>(())
    })
}

/// Average pooling 2d, as `F.avg_pool2d(x, kernel, stride, padding, ceil_mode,
/// count_include_pad)`: each window's f32 sum divided by its size (see [`Pool2dOpts`]).
pub fn avg_pool2d(x: &Tensor, opts: &Pool2dOpts) -> Result<Tensor> {
    let op = "avg_pool2d";
    let ((n, c, _, _), (oh, ow)) = geometry(op, x.shape(), opts)?;
    let mut y = Tensor::alloc(op, x.device(), &opts.layout.shape(n, c, oh, ow), x.dtype())?;
    avg_pool2d_out(x, opts, &mut y)?;
    Ok(y)
}

/// [`avg_pool2d`] into `y` (the output's shape, x's dtype and device).
pub fn avg_pool2d_out(x: &Tensor, opts: &Pool2dOpts, y: &mut Tensor) -> Result<()> {
    let op = "avg_pool2d";
    let ((n, c, h, w), (oh, ow)) = geometry(op, x.shape(), opts)?;
    check_out(op, x, y, &opts.layout.shape(n, c, oh, ow), "y must have the output's shape")?;
    let dev = x.device().clone();
    let total = y.numel() as u64;
    let (ihw, ohw, k, s, p) = packed(h, w, oh, ow, opts);
    let flags = opts.layout.code() | if opts.count_include_pad { INCLUDE_PAD } else { 0 };
    with_elem!(x.dtype(), |T| {
        let kernel = <T as PoolElem>::AVG_FWD;
        if let Some(cfg) = launch::elementwise(total, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?) {
            let args: AvgFwdArgs<T> = (x.dev_ptr(), y.dev_ptr_mut()?, n as u64, c as u64, ihw, ohw, k, s, p, flags);
            // SAFETY: x holds n c h w elements, y n c oh ow (checked), its own memory.
            unsafe { dev.launch(kernel, cfg, args) }?;
        }
        Ok::<(), Error>(())
    })
}

/// The gradient of [`avg_pool2d`]'s input of shape `input_shape`: each element receives the sum
/// of `grad / divisor` over the windows that contain it.
pub fn avg_pool2d_backward(grad: &Tensor, input_shape: &[usize], opts: &Pool2dOpts) -> Result<Tensor> {
    let op = "avg_pool2d_backward";
    geometry(op, input_shape, opts)?;
    let mut dx = Tensor::alloc(op, grad.device(), input_shape, grad.dtype())?;
    avg_pool2d_backward_out(grad, opts, &mut dx)?;
    Ok(dx)
}

/// [`avg_pool2d_backward`] into `dx`, of the input's shape (grad's dtype and device).
pub fn avg_pool2d_backward_out(grad: &Tensor, opts: &Pool2dOpts, dx: &mut Tensor) -> Result<()> {
    let op = "avg_pool2d_backward";
    let ((n, c, h, w), (oh, ow)) = geometry(op, dx.shape(), opts)?;
    shapes_match(op, &opts.layout.shape(n, c, oh, ow), grad.shape(), "grad must have the output's shape")?;
    check_same_device(op, grad, dx)?;
    check_same_dtype(op, grad, dx)?;
    let dev = grad.device().clone();
    let total = dx.numel() as u64;
    let (ihw, ohw, k, s, p) = packed(h, w, oh, ow, opts);
    let flags = opts.layout.code() | if opts.count_include_pad { INCLUDE_PAD } else { 0 };
    with_elem!(grad.dtype(), |T| {
        let kernel = <T as PoolElem>::AVG_BWD;
        if let Some(cfg) = launch::elementwise(total, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?) {
            let args: AvgBwdArgs<T> = (grad.dev_ptr(), dx.dev_ptr_mut()?, n as u64, c as u64, ihw, ohw, k, s, p, flags);
            // SAFETY: grad holds n c oh ow elements (checked), dx n c h w (its shape), its own
            // memory.
            unsafe { dev.launch(kernel, cfg, args) }?;
        }
        Ok::<(), Error>(())
    })
}

/// `(N, C, H W)` of a global pool's input, with the limits of its kernels.
fn gap_dims(op: &'static str, shape: &[usize], layout: Layout2d) -> Result<(usize, usize, usize)> {
    let (n, c, h, w) = layout.dims(op, shape)?;
    let hw = h * w;
    if hw == 0 && n * c > 0 {
        return Err(Error::InvalidArgument { op, message: format!("the planes of {shape:?} are empty") });
    }
    Ok((n, c, hw))
}

/// Global average pooling, as `F.adaptive_avg_pool2d(x, 1)`: the mean of each `(n, c)` plane,
/// of shape `[N, C, 1, 1]` (NCHW) or `[N, 1, 1, C]` (NHWC). Each plane's f32 sum (NCHW: 32
/// strided partial sums and a butterfly; NHWC: in increasing position) divided by `H W`.
pub fn global_avg_pool2d(x: &Tensor, layout: Layout2d) -> Result<Tensor> {
    let op = "global_avg_pool2d";
    let (n, c, _) = gap_dims(op, x.shape(), layout)?;
    let mut y = Tensor::alloc(op, x.device(), &layout.shape(n, c, 1, 1), x.dtype())?;
    global_avg_pool2d_out(x, layout, &mut y)?;
    Ok(y)
}

/// [`global_avg_pool2d`] into `y` (the output's shape, x's dtype and device).
pub fn global_avg_pool2d_out(x: &Tensor, layout: Layout2d, y: &mut Tensor) -> Result<()> {
    let op = "global_avg_pool2d";
    let (n, c, hw) = gap_dims(op, x.shape(), layout)?;
    check_out(op, x, y, &layout.shape(n, c, 1, 1), "y must have the output's shape")?;
    let dev = x.device().clone();
    // A warp per plane in NCHW, a thread per plane in NHWC.
    let threads = (n * c) as u64 * if layout == Layout2d::Nchw { 32 } else { 1 };
    with_elem!(x.dtype(), |T| {
        let kernel = <T as PoolElem>::GAP_FWD;
        if let Some(cfg) = launch::one_per_thread(threads) {
            let args: GapFwdArgs<T> = (x.dev_ptr(), y.dev_ptr_mut()?, n as u64, c as u64, hw as u64, layout.code());
            // SAFETY: x holds n c hw elements, y n c (checked), its own memory; blocks are whole
            // warps (256 threads).
            unsafe { dev.launch(kernel, cfg, args) }?;
        }
        Ok::<(), Error>(())
    })
}

/// The gradient of [`global_avg_pool2d`]'s input of shape `input_shape`: `grad[n, c] / (H W)`
/// at every element of the plane.
pub fn global_avg_pool2d_backward(grad: &Tensor, input_shape: &[usize], layout: Layout2d) -> Result<Tensor> {
    let op = "global_avg_pool2d_backward";
    gap_dims(op, input_shape, layout)?;
    let mut dx = Tensor::alloc(op, grad.device(), input_shape, grad.dtype())?;
    global_avg_pool2d_backward_out(grad, layout, &mut dx)?;
    Ok(dx)
}

/// [`global_avg_pool2d_backward`] into `dx`, of the input's shape (grad's dtype and device).
pub fn global_avg_pool2d_backward_out(grad: &Tensor, layout: Layout2d, dx: &mut Tensor) -> Result<()> {
    let op = "global_avg_pool2d_backward";
    let (n, c, hw) = gap_dims(op, dx.shape(), layout)?;
    shapes_match(op, &layout.shape(n, c, 1, 1), grad.shape(), "grad must have the output's shape")?;
    check_same_device(op, grad, dx)?;
    check_same_dtype(op, grad, dx)?;
    let dev = grad.device().clone();
    let total = dx.numel() as u64;
    with_elem!(grad.dtype(), |T| {
        let kernel = <T as PoolElem>::GAP_BWD;
        if let Some(cfg) = launch::elementwise(total, 1, 1, dev.sm_count(), dev.blocks_per_sm_256(kernel.name())?) {
            let args: GapBwdArgs<T> = (grad.dev_ptr(), dx.dev_ptr_mut()?, n as u64, c as u64, hw as u64, layout.code());
            // SAFETY: grad holds n c elements (checked), dx n c hw (its shape), its own memory.
            unsafe { dev.launch(kernel, cfg, args) }?;
        }
        Ok::<(), Error>(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_sizes_as_pytorch() {
        let o = |len, k, s, p, ceil| out_len("t", len, k, s, p, ceil);
        // ResNet's stem pool: 112 -> 56 (3, 2, 1).
        assert_eq!(o(112, 3, 2, 1, false).unwrap(), 56);
        assert_eq!(o(5, 2, 2, 0, false).unwrap(), 2);
        assert_eq!(o(5, 2, 2, 0, true).unwrap(), 3);
        // ceil_mode's last window must start inside the input or the left padding.
        assert_eq!(o(4, 2, 2, 1, true).unwrap(), 3);
        assert_eq!(o(6, 3, 3, 1, true).unwrap(), 3);
        assert_eq!(o(1, 1, 1, 0, false).unwrap(), 1);
        assert_eq!(o(1, 3, 1, 1, false).unwrap(), 1);
        for (len, k, s, p) in [(2, 3, 1, 0), (5, 0, 1, 0), (5, 2, 0, 0), (5, 3, 1, 2), (0, 1, 1, 0)] {
            assert!(matches!(o(len, k, s, p, false), Err(Error::InvalidArgument { .. })), "{len} {k} {s} {p}");
        }
        assert!(o(usize::MAX, 3, 1, 1, false).is_err());
    }
}
