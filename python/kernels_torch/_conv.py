"""Convolution, batch norm and pooling 2d: ``torch.library`` custom ops in the ``rustkernels``
namespace, each with a fake implementation and, for the forward ops, an autograd formula whose
backward is itself a custom op (as the ops of ``_ops``, whose helpers they use).

Layouts: every op takes a ``layout`` code, 0 for NCHW (PyTorch's default: ``x [N, C, H, W]``, the
filter ``[K, C/groups, R, S]``) and 1 for NHWC (``x [N, H, W, C]``, the filter ``[K, R, S,
C/groups]``), and its tensors are contiguous in that order: the ops see physical shapes. The
functions below take PyTorch's logical ``[N, C, H, W]`` tensors and pick NHWC for a
``channels_last`` input, passing ``x.permute(0, 2, 3, 1)`` (contiguous, read in place) and
returning the output as the same kind of view, so a ``channels_last`` network stays so without a
copy.

- conv2d: ``(x, weight, bias?) -> y``; conv2d_backward: ``(x, weight, grad) -> (dx, dw, db)``, each
  only if asked for (an empty tensor otherwise).
- batch_norm: ``(x, weight?, bias?, running_mean?, running_var?) -> (y, mean, invstd, new_mean,
  new_var)``: a functional op (an op that writes its inputs can have no autograd formula), whose
  running statistics updated with momentum come back as new tensors (empty in evaluation or
  without running statistics); ``batch_norm`` below copies them into the buffers. Weight, bias
  and statistics are f32 for every dtype of x, as with cuDNN.
- max_pool2d: ``x -> (y, indices)``, int64 indices ``h * W + w`` in the plane, as PyTorch's;
  avg_pool2d, global_avg_pool2d (``adaptive_avg_pool2d`` to 1 x 1); and their backward ops.
"""

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _native
from ._ops import NS, _autocast_inputs, _autograd, _bwd, _call, _check, _custom_op, _DTYPE_CODES, _new, _ptr, _where

NCHW, NHWC = 0, 1


def _pair(op: str, name: str, v) -> tuple:
    """An int or a sequence of one or two ints as ``(height, width)``."""
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(a) for a in v)
    if len(t) == 1:
        return (t[0], t[0])
    if len(t) != 2:
        raise ValueError(f"{NS}::{op}: {name} must be an int or a pair, got {v!r}")
    return t


def _layout(op: str, layout: int) -> int:
    if layout not in (NCHW, NHWC):
        raise ValueError(f"{NS}::{op}: layout must be 0 (NCHW) or 1 (NHWC), got {layout}")
    return layout


def is_channels_last(x: Tensor) -> bool:
    """Whether ``x`` (``[N, C, H, W]``) is laid out as NHWC and not also as NCHW (a tensor with
    one channel, or 1 x 1 planes, is both: it runs as NCHW)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _phys(x: Tensor, layout: int) -> Tensor:
    """The logical ``[N, C, H, W]`` tensor as the op's physical one."""
    return x.permute(0, 2, 3, 1) if layout == NHWC else x


def _logical(y: Tensor, layout: int) -> Tensor:
    return y.permute(0, 3, 1, 2) if layout == NHWC else y


def _nchw(shape: Sequence[int], layout: int) -> tuple:
    """``(N, C, H, W)`` of a physical shape."""
    n, a, b, c = shape
    return (n, c, a, b) if layout == NHWC else (n, a, b, c)


def _shape(n: int, c: int, h: int, w: int, layout: int) -> list:
    return [n, h, w, c] if layout == NHWC else [n, c, h, w]


def _rank4(op: str, name: str, t: Tensor) -> None:
    if t.dim() != 4:
        raise ValueError(f"{NS}::{op}: {name} must have 4 dimensions, got shape {list(t.shape)}")


# --- convolution --------------------------------------------------------------------------------

_CONV_OPTS = "int[] stride, int[] padding, int[] dilation, int groups, int layout"


def _conv_geometry(op, x_shape, w_shape, stride, padding, dilation, groups, layout) -> list:
    """The output's physical shape, after PyTorch's checks on the arguments."""
    layout = _layout(op, layout)
    sh, sw = _pair(op, "stride", stride)
    ph, pw = _pair(op, "padding", padding)
    dh, dw = _pair(op, "dilation", dilation)
    if min(sh, sw, dh, dw) < 1 or min(ph, pw) < 0 or groups < 1:
        raise ValueError(
            f"{NS}::{op}: stride and dilation must be at least 1, padding at least 0 and groups at least 1, got "
            f"stride {stride}, padding {padding}, dilation {dilation}, groups {groups}"
        )
    if len(x_shape) != 4 or len(w_shape) != 4:
        raise ValueError(f"{NS}::{op}: x and the filter must have 4 dimensions, got {list(x_shape)}, {list(w_shape)}")
    n, c, h, w = _nchw(x_shape, layout)
    k, cg, r, s = (w_shape[0], w_shape[3], w_shape[1], w_shape[2]) if layout == NHWC else tuple(w_shape)
    if c % groups or k % groups or cg != c // groups:
        raise ValueError(
            f"{NS}::{op}: x has {c} channels and the filter shape {list(w_shape)} ({k} filters of {cg} channels); "
            f"with groups={groups} both channel counts must be multiples of groups and the filter's C / groups"
        )
    p = (h + 2 * ph - dh * (r - 1) - 1) // sh + 1
    q = (w + 2 * pw - dw * (s - 1) - 1) // sw + 1
    if r < 1 or s < 1 or p < 1 or q < 1:
        raise ValueError(
            f"{NS}::{op}: the output would be empty: input {h}x{w}, padding {(ph, pw)}, filter {r}x{s}, "
            f"dilation {(dh, dw)}, stride {(sh, sw)}"
        )
    return _shape(n, k, p, q, layout)


def _conv_native_opts(op, stride, padding, dilation, groups) -> tuple:
    return _pair(op, "stride", stride), _pair(op, "padding", padding), _pair(op, "dilation", dilation), int(groups)


@_custom_op("conv2d", f"(Tensor x, Tensor weight, Tensor? bias, {_CONV_OPTS}) -> Tensor")
def conv2d_op(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    layout: int,
) -> Tensor:
    op = "conv2d"
    x = _check(op, "x", x)
    weight = _check(op, "weight", weight, like=x)
    y_shape = _conv_geometry(op, x.shape, weight.shape, stride, padding, dilation, groups, layout)
    if bias is not None:
        bias = _check(op, "bias", bias, like=x)
        if list(bias.shape) != [weight.shape[0]]:
            raise ValueError(f"{NS}::{op}: bias has shape {list(bias.shape)}; it must be [{weight.shape[0]}]")
    y = _new(y_shape, x)
    dev, stream, dt = _where(x)
    _native.conv2d_fwd(
        dev, stream, dt, layout, x.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(), list(x.shape),
        list(weight.shape), y_shape, *_conv_native_opts(op, stride, padding, dilation, groups),
    )  # fmt: skip
    return y


@conv2d_op.register_fake
def _(x, weight, bias, stride, padding, dilation, groups, layout):
    return x.new_empty(_conv_geometry("conv2d", x.shape, weight.shape, stride, padding, dilation, groups, layout))


@_custom_op(
    "conv2d_backward",
    f"(Tensor x, Tensor weight, Tensor grad, {_CONV_OPTS}, bool x_grad, bool weight_grad, bool bias_grad) "
    "-> (Tensor, Tensor, Tensor)",
)
def conv2d_backward_op(
    x: Tensor,
    weight: Tensor,
    grad: Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    layout: int,
    x_grad: bool,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of x, the filter and the bias from ``grad`` (the output's); a gradient not asked
    for is an empty tensor."""
    op = "conv2d_backward"
    x = _check(op, "x", x)
    weight = _check(op, "weight", weight, like=x)
    y_shape = _conv_geometry(op, x.shape, weight.shape, stride, padding, dilation, groups, layout)
    grad = _check(op, "grad", grad, like=x)
    if list(grad.shape) != y_shape:
        raise ValueError(f"{NS}::{op}: grad has shape {list(grad.shape)}, the output {y_shape}")
    gx = _new(x.shape if x_grad else [0], x)
    gw = _new(weight.shape if weight_grad else [0], x)
    gb = _new([weight.shape[0]] if bias_grad else [0], x)
    dev, stream, dt = _where(x)
    _native.conv2d_bwd(
        dev, stream, dt, layout, x.data_ptr(), weight.data_ptr(), grad.data_ptr(), gx.data_ptr() if x_grad else 0,
        gw.data_ptr() if weight_grad else 0, gb.data_ptr() if bias_grad else 0, list(x.shape), list(weight.shape),
        y_shape, *_conv_native_opts(op, stride, padding, dilation, groups),
    )  # fmt: skip
    return gx, gw, gb


@conv2d_backward_op.register_fake
def _(x, weight, grad, stride, padding, dilation, groups, layout, x_grad, weight_grad, bias_grad):
    return (
        x.new_empty(x.shape if x_grad else [0]),
        x.new_empty(weight.shape if weight_grad else [0]),
        x.new_empty([weight.shape[0]] if bias_grad else [0]),
    )


def _conv_setup(ctx, inputs, output):
    x, weight, bias = inputs[:3]
    ctx.opts = tuple(inputs[3:])
    ctx.want = (x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    ctx.save_for_backward(x, weight)


def _conv_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    xg, wg, bg = ctx.want
    gx, gw, gb = _bwd(ctx, "conv2d_backward")(x, weight, grad, *ctx.opts, xg, wg, bg)
    return (gx if xg else None), (gw if wg else None), (gb if bg else None), None, None, None, None, None


_autograd(conv2d_op, "conv2d", _conv_backward, _conv_setup)


def same_padding(kernel_size, dilation) -> Optional[tuple]:
    """``padding="same"`` (stride 1) as symmetric padding, or None where PyTorch pads one side
    more than the other (where ``dilation * (kernel - 1)`` is odd)."""
    (r, s), (dh, dw) = _pair("conv2d", "kernel_size", kernel_size), _pair("conv2d", "dilation", dilation)
    th, tw = dh * (r - 1), dw * (s - 1)
    return None if th % 2 or tw % 2 else (th // 2, tw // 2)


def conv2d(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: Union[int, Sequence[int]] = 1,
    padding: Union[int, Sequence[int], str] = 0,
    dilation: Union[int, Sequence[int]] = 1,
    groups: int = 1,
) -> Tensor:
    """``F.conv2d`` for CUDA tensors of one dtype, float32, bfloat16 or float16 (f32
    accumulation, rounded once): ``input [N, C, H, W]`` (or ``[C, H, W]``), ``weight [K, C/groups,
    R, S]``, ``bias [K]``; stride, padding (ints, or ``"valid"``, or ``"same"`` where it is
    symmetric), dilation, groups (depthwise included). A ``channels_last`` input runs the NHWC
    kernels in place and gives a ``channels_last`` output (the weight is read as ``[K, R, S,
    C/groups]``: in place if it is ``channels_last`` too, else through a copy); any other input
    runs the NCHW kernels (a copy first if it is not contiguous). bfloat16/float16 NHWC with one
    group and ``C % 8 == 0`` runs on the tensor cores; the rest, and the backward, run the general
    kernels. Inside ``torch.autocast("cuda", dtype)`` the tensors are first cast to ``dtype``, as
    autocast casts those of ``F.conv2d``. Backward: dx, dW and db, each only if needed,
    deterministic."""
    if isinstance(padding, str):
        if padding == "valid":
            padding = 0
        elif padding == "same":
            if _pair("conv2d", "stride", stride) != (1, 1):
                raise ValueError(f"{NS}::conv2d: padding='same' needs stride 1 (as PyTorch's), got {stride}")
            padding = same_padding(weight.shape[2:], dilation)
            if padding is None:
                raise ValueError(
                    f"{NS}::conv2d: padding='same' with filter {list(weight.shape[2:])} and dilation {dilation} pads "
                    "one side more than the other, which the kernels do not (kernels_torch.nn.Conv2d runs PyTorch's)"
                )
        else:
            raise ValueError(f"{NS}::conv2d: padding must be ints, 'valid' or 'same', got {padding!r}")
    input, weight, bias = _autocast_inputs(input, weight, bias)
    unbatched = isinstance(input, Tensor) and input.dim() == 3
    x = input.unsqueeze(0) if unbatched else input
    _rank4("conv2d", "input", x)
    _rank4("conv2d", "weight", weight)
    layout = NHWC if is_channels_last(x) else NCHW
    opts = (list(_pair("conv2d", "stride", stride)), list(_pair("conv2d", "padding", padding)),
            list(_pair("conv2d", "dilation", dilation)), int(groups), layout)  # fmt: skip
    y = _logical(_call("conv2d", _phys(x, layout), _phys(weight, layout), bias, *opts), layout)
    return y.squeeze(0) if unbatched else y


# --- batch norm ---------------------------------------------------------------------------------


def _bn_check(op: str, x: Tensor, layout: int, params: dict) -> tuple:
    """x and the f32 per-channel tensors as the kernels need them, and C."""
    layout = _layout(op, layout)
    x = _check(op, "x", x)
    _rank4(op, "x", x)
    c = _nchw(x.shape, layout)[1]
    out = {}
    for name, p in params.items():
        if p is not None:
            p = _check(op, name, p, like=x, dtype=torch.float32)
            if list(p.shape) != [c]:
                raise ValueError(f"{NS}::{op}: {name} has shape {list(p.shape)}; it must be [{c}] (the channels)")
        out[name] = p
    return x, c, out


@_custom_op(
    "batch_norm",
    "(Tensor x, Tensor? weight, Tensor? bias, Tensor? running_mean, Tensor? running_var, bool training, "
    "float momentum, float eps, int layout) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def batch_norm_op(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    training: bool,
    momentum: float,
    eps: float,
    layout: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    op = "batch_norm"
    ps = {"weight": weight, "bias": bias, "running_mean": running_mean, "running_var": running_var}
    x, c, ps = _bn_check(op, x, layout, ps)
    rm, rv = ps["running_mean"], ps["running_var"]
    if (rm is None) != (rv is None):
        raise ValueError(f"{NS}::{op}: running_mean and running_var must be given together")
    if not training and rm is None:
        raise ValueError(f"{NS}::{op}: evaluation (training=False) needs running_mean and running_var")
    if training and x.numel() // max(c, 1) == 1:
        raise ValueError(f"{NS}::{op}: expected more than 1 value per channel when training, got input {list(x.shape)}")
    update = training and rm is not None
    # The kernels update the running statistics in place: here, in copies the op returns.
    new_rm = rm.clone() if update else _new([0], x, torch.float32)
    new_rv = rv.clone() if update else _new([0], x, torch.float32)
    y = torch.empty_like(x)
    mean, invstd = _new([c], x, torch.float32), _new([c], x, torch.float32)
    dev, stream, dt = _where(x)
    _native.batch_norm_fwd(
        dev, stream, dt, layout, bool(training), float(momentum), float(eps), x.data_ptr(), _ptr(ps["weight"]),
        _ptr(ps["bias"]), new_rm.data_ptr() if update else (0 if rm is None else rm.data_ptr()),
        new_rv.data_ptr() if update else (0 if rv is None else rv.data_ptr()), y.data_ptr(), mean.data_ptr(),
        invstd.data_ptr(), list(x.shape),
    )  # fmt: skip
    return y, mean, invstd, new_rm, new_rv


@batch_norm_op.register_fake
def _(x, weight, bias, running_mean, running_var, training, momentum, eps, layout):
    c = _nchw(x.shape, layout)[1]
    update = training and running_mean is not None
    f32 = torch.float32
    return (
        x.new_empty(x.shape),
        x.new_empty([c], dtype=f32),
        x.new_empty([c], dtype=f32),
        x.new_empty([c] if update else [0], dtype=f32),
        x.new_empty([c] if update else [0], dtype=f32),
    )


@_custom_op(
    "batch_norm_backward",
    "(Tensor x, Tensor? weight, Tensor mean, Tensor invstd, Tensor grad, bool training, int layout, "
    "bool weight_grad, bool bias_grad) -> (Tensor, Tensor, Tensor)",
)
def batch_norm_backward_op(
    x: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    invstd: Tensor,
    grad: Tensor,
    training: bool,
    layout: int,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of x (x's dtype), the weight and the bias (f32 ``[C]``; an empty tensor if not
    asked for) from ``grad`` and the forward's saved ``mean`` and ``invstd``."""
    op = "batch_norm_backward"
    x, c, ps = _bn_check(op, x, layout, {"weight": weight, "mean": mean, "invstd": invstd})
    grad = _check(op, "grad", grad, like=x)
    if grad.shape != x.shape:
        raise ValueError(f"{NS}::{op}: grad has shape {list(grad.shape)}, x {list(x.shape)}")
    gx = torch.empty_like(x)
    gw = _new([c] if weight_grad else [0], x, torch.float32)
    gb = _new([c] if bias_grad else [0], x, torch.float32)
    dev, stream, dt = _where(x)
    _native.batch_norm_bwd(
        dev, stream, dt, layout, bool(training), x.data_ptr(), _ptr(ps["weight"]), ps["mean"].data_ptr(),
        ps["invstd"].data_ptr(), grad.data_ptr(), gx.data_ptr(), gw.data_ptr() if weight_grad else 0,
        gb.data_ptr() if bias_grad else 0, list(x.shape),
    )  # fmt: skip
    return gx, gw, gb


@batch_norm_backward_op.register_fake
def _(x, weight, mean, invstd, grad, training, layout, weight_grad, bias_grad):
    c = _nchw(x.shape, layout)[1]
    f32 = torch.float32
    return x.new_empty(x.shape), x.new_empty([c] if weight_grad else [0], dtype=f32), x.new_empty(
        [c] if bias_grad else [0], dtype=f32
    )


def _bn_setup(ctx, inputs, output):
    x, weight, bias, _, _, training, _, _, layout = inputs
    _, mean, invstd, new_rm, new_rv = output
    ctx.save_for_backward(x, weight, mean, invstd)
    ctx.opts = (training, layout)
    ctx.want = (x.requires_grad, weight is not None and weight.requires_grad, bias is not None and bias.requires_grad)
    ctx.mark_non_differentiable(mean, invstd, new_rm, new_rv)


def _bn_backward(ctx, grad, _gmean, _ginvstd, _grm, _grv):
    x, weight, mean, invstd = ctx.saved_tensors
    xg, wg, bg = ctx.want
    gx, gw, gb = _bwd(ctx, "batch_norm_backward")(x, weight, mean, invstd, grad, *ctx.opts, wg, bg)
    return (gx if xg else None), (gw if wg else None), (gb if bg else None), None, None, None, None, None, None


_autograd(batch_norm_op, "batch_norm", _bn_backward, _bn_setup)


def batch_norm(
    input: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """``F.batch_norm`` of a CUDA ``input [N, C, H, W]`` of float32, bfloat16 or float16, with
    float32 ``weight``, ``bias``, ``running_mean`` and ``running_var`` (``[C]``; as cuDNN keeps them,
    and as they are under autocast). Training: the batch mean and biased variance (f32), and the
    running statistics, if given, updated in place with ``momentum`` and the unbiased variance;
    evaluation: the running statistics. A ``channels_last`` input runs in place as NHWC and gives
    a ``channels_last`` output. Backward: dx, dweight, dbias with PyTorch's formulas,
    deterministic."""
    _rank4("batch_norm", "input", input)
    layout = NHWC if is_channels_last(input) else NCHW
    y, _, _, new_rm, new_rv = _call(
        "batch_norm", _phys(input, layout), weight, bias, running_mean, running_var, bool(training), float(momentum),
        float(eps), layout,
    )  # fmt: skip
    if training and running_mean is not None:
        with torch.no_grad():
            running_mean.copy_(new_rm)
            running_var.copy_(new_rv)
    return _logical(y, layout)


# --- pooling ------------------------------------------------------------------------------------

_POOL_OPTS = "int[] kernel_size, int[] stride, int[] padding, bool ceil_mode"


def _pool_len(op: str, n: int, k: int, s: int, p: int, ceil: bool) -> int:
    """PyTorch's ``pooling_output_shape`` (dilation 1), with its checks."""
    if k < 1 or s < 1 or p < 0:
        raise ValueError(f"{NS}::{op}: kernel and stride must be positive and padding not negative, got {k}, {s}, {p}")
    if p > k // 2:
        raise ValueError(f"{NS}::{op}: padding {p} must be at most half of the kernel {k}")
    span = n + 2 * p - k
    out = (span + (s - 1 if ceil else 0)) // s + 1 if span >= 0 else 0
    if ceil and out > 0 and (out - 1) * s >= n + p:
        out -= 1
    if out < 1:
        raise ValueError(f"{NS}::{op}: the output would be empty: input {n}, kernel {k}, stride {s}, padding {p}")
    return out


def _pool_geometry(op, x_shape, kernel_size, stride, padding, ceil_mode, layout) -> list:
    layout = _layout(op, layout)
    if len(x_shape) != 4:
        raise ValueError(f"{NS}::{op}: x must have 4 dimensions, got {list(x_shape)}")
    n, c, h, w = _nchw(x_shape, layout)
    kh, kw = _pair(op, "kernel_size", kernel_size)
    sh, sw = _pair(op, "stride", stride)
    ph, pw = _pair(op, "padding", padding)
    oh, ow = _pool_len(op, h, kh, sh, ph, ceil_mode), _pool_len(op, w, kw, sw, pw, ceil_mode)
    return _shape(n, c, oh, ow, layout)


def _pool_native(op, kernel_size, stride, padding, ceil_mode) -> tuple:
    return _pair(op, "kernel_size", kernel_size), _pair(op, "stride", stride), _pair(op, "padding", padding), bool(
        ceil_mode
    )


@_custom_op("max_pool2d", f"(Tensor x, {_POOL_OPTS}, int layout) -> (Tensor, Tensor)")
def max_pool2d_op(
    x: Tensor, kernel_size: list[int], stride: list[int], padding: list[int], ceil_mode: bool, layout: int
) -> tuple[Tensor, Tensor]:
    op = "max_pool2d"
    x = _check(op, "x", x)
    y_shape = _pool_geometry(op, x.shape, kernel_size, stride, padding, ceil_mode, layout)
    y, idx = _new(y_shape, x), _new(y_shape, x, torch.int64)
    dev, stream, dt = _where(x)
    _native.max_pool2d_fwd(
        dev, stream, dt, layout, x.data_ptr(), y.data_ptr(), idx.data_ptr(), list(x.shape), y_shape,
        *_pool_native(op, kernel_size, stride, padding, ceil_mode),
    )  # fmt: skip
    return y, idx


@max_pool2d_op.register_fake
def _(x, kernel_size, stride, padding, ceil_mode, layout):
    shape = _pool_geometry("max_pool2d", x.shape, kernel_size, stride, padding, ceil_mode, layout)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


@_custom_op(
    "max_pool2d_backward", f"(Tensor grad, Tensor indices, int[] input_size, {_POOL_OPTS}, int layout) -> Tensor"
)
def max_pool2d_backward_op(
    grad: Tensor,
    indices: Tensor,
    input_size: list[int],
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    ceil_mode: bool,
    layout: int,
) -> Tensor:
    op = "max_pool2d_backward"
    grad = _check(op, "grad", grad)
    indices = _check(op, "indices", indices, like=grad, dtype=torch.int64)
    y_shape = _pool_geometry(op, input_size, kernel_size, stride, padding, ceil_mode, layout)
    if list(grad.shape) != y_shape or list(indices.shape) != y_shape:
        raise ValueError(
            f"{NS}::{op}: grad and indices must have the output's shape {y_shape}, got {list(grad.shape)}, "
            f"{list(indices.shape)}"
        )
    gx = _new(list(input_size), grad)
    dev, stream, dt = _where(grad)
    _native.max_pool2d_bwd(
        dev, stream, dt, layout, grad.data_ptr(), indices.data_ptr(), gx.data_ptr(), list(input_size), y_shape,
        *_pool_native(op, kernel_size, stride, padding, ceil_mode),
    )  # fmt: skip
    return gx


@max_pool2d_backward_op.register_fake
def _(grad, indices, input_size, kernel_size, stride, padding, ceil_mode, layout):
    return grad.new_empty(list(input_size))


def _max_setup(ctx, inputs, output):
    x = inputs[0]
    _, idx = output
    ctx.save_for_backward(idx)
    ctx.input_size = list(x.shape)
    ctx.opts = tuple(inputs[1:])
    ctx.mark_non_differentiable(idx)


def _max_backward(ctx, grad, _gidx):
    (idx,) = ctx.saved_tensors
    return (_bwd(ctx, "max_pool2d_backward")(grad, idx, ctx.input_size, *ctx.opts),) + (None,) * len(ctx.opts)


_autograd(max_pool2d_op, "max_pool2d", _max_backward, _max_setup)


@_custom_op("avg_pool2d", f"(Tensor x, {_POOL_OPTS}, bool count_include_pad, int layout) -> Tensor")
def avg_pool2d_op(
    x: Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    ceil_mode: bool,
    count_include_pad: bool,
    layout: int,
) -> Tensor:
    op = "avg_pool2d"
    x = _check(op, "x", x)
    y_shape = _pool_geometry(op, x.shape, kernel_size, stride, padding, ceil_mode, layout)
    y = _new(y_shape, x)
    dev, stream, dt = _where(x)
    _native.avg_pool2d(
        dev, stream, dt, layout, False, x.data_ptr(), y.data_ptr(), list(x.shape), y_shape,
        *_pool_native(op, kernel_size, stride, padding, ceil_mode), bool(count_include_pad),
    )  # fmt: skip
    return y


@avg_pool2d_op.register_fake
def _(x, kernel_size, stride, padding, ceil_mode, count_include_pad, layout):
    return x.new_empty(_pool_geometry("avg_pool2d", x.shape, kernel_size, stride, padding, ceil_mode, layout))


@_custom_op(
    "avg_pool2d_backward", f"(Tensor grad, int[] input_size, {_POOL_OPTS}, bool count_include_pad, int layout) -> Tensor"
)
def avg_pool2d_backward_op(
    grad: Tensor,
    input_size: list[int],
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    ceil_mode: bool,
    count_include_pad: bool,
    layout: int,
) -> Tensor:
    op = "avg_pool2d_backward"
    grad = _check(op, "grad", grad)
    y_shape = _pool_geometry(op, input_size, kernel_size, stride, padding, ceil_mode, layout)
    if list(grad.shape) != y_shape:
        raise ValueError(f"{NS}::{op}: grad must have the output's shape {y_shape}, got {list(grad.shape)}")
    gx = _new(list(input_size), grad)
    dev, stream, dt = _where(grad)
    _native.avg_pool2d(
        dev, stream, dt, layout, True, grad.data_ptr(), gx.data_ptr(), list(input_size), y_shape,
        *_pool_native(op, kernel_size, stride, padding, ceil_mode), bool(count_include_pad),
    )  # fmt: skip
    return gx


@avg_pool2d_backward_op.register_fake
def _(grad, input_size, kernel_size, stride, padding, ceil_mode, count_include_pad, layout):
    return grad.new_empty(list(input_size))


def _avg_setup(ctx, inputs, output):
    ctx.input_size = list(inputs[0].shape)
    ctx.opts = tuple(inputs[1:])


def _avg_backward(ctx, grad):
    return (_bwd(ctx, "avg_pool2d_backward")(grad, ctx.input_size, *ctx.opts),) + (None,) * len(ctx.opts)


_autograd(avg_pool2d_op, "avg_pool2d", _avg_backward, _avg_setup)


def _gap_shape(op: str, x_shape, layout: int) -> list:
    layout = _layout(op, layout)
    if len(x_shape) != 4:
        raise ValueError(f"{NS}::{op}: x must have 4 dimensions, got {list(x_shape)}")
    n, c, h, w = _nchw(x_shape, layout)
    if h * w == 0 and n * c > 0:
        raise ValueError(f"{NS}::{op}: the planes of {list(x_shape)} are empty")
    return _shape(n, c, 1, 1, layout)


@_custom_op("global_avg_pool2d", "(Tensor x, int layout) -> Tensor")
def global_avg_pool2d_op(x: Tensor, layout: int) -> Tensor:
    op = "global_avg_pool2d"
    x = _check(op, "x", x)
    y = _new(_gap_shape(op, x.shape, layout), x)
    dev, stream, dt = _where(x)
    _native.global_avg_pool2d(dev, stream, dt, layout, False, x.data_ptr(), y.data_ptr(), list(x.shape))
    return y


@global_avg_pool2d_op.register_fake
def _(x, layout):
    return x.new_empty(_gap_shape("global_avg_pool2d", x.shape, layout))


@_custom_op("global_avg_pool2d_backward", "(Tensor grad, int[] input_size, int layout) -> Tensor")
def global_avg_pool2d_backward_op(grad: Tensor, input_size: list[int], layout: int) -> Tensor:
    op = "global_avg_pool2d_backward"
    grad = _check(op, "grad", grad)
    y_shape = _gap_shape(op, input_size, layout)
    if list(grad.shape) != y_shape:
        raise ValueError(f"{NS}::{op}: grad must have the output's shape {y_shape}, got {list(grad.shape)}")
    gx = _new(list(input_size), grad)
    dev, stream, dt = _where(grad)
    _native.global_avg_pool2d(dev, stream, dt, layout, True, grad.data_ptr(), gx.data_ptr(), list(input_size))
    return gx


@global_avg_pool2d_backward_op.register_fake
def _(grad, input_size, layout):
    return grad.new_empty(list(input_size))


def _gap_setup(ctx, inputs, output):
    x, layout = inputs
    ctx.input_size, ctx.layout = list(x.shape), layout


def _gap_backward(ctx, grad):
    return _bwd(ctx, "global_avg_pool2d_backward")(grad, ctx.input_size, ctx.layout), None


_autograd(global_avg_pool2d_op, "global_avg_pool2d", _gap_backward, _gap_setup)


def _pool_args(op: str, kernel_size, stride, padding) -> tuple:
    k = _pair(op, "kernel_size", kernel_size)
    s = k if stride is None or (not isinstance(stride, int) and len(stride) == 0) else _pair(op, "stride", stride)
    return list(k), list(s), list(_pair(op, "padding", padding))


def _pool_input(op: str, x: Tensor) -> tuple:
    """The input as ``[N, C, H, W]`` (an unbatched ``[C, H, W]`` gets N = 1), its layout, and
    whether it was unbatched."""
    unbatched = isinstance(x, Tensor) and x.dim() == 3
    if unbatched:
        x = x.unsqueeze(0)
    _rank4(op, "input", x)
    layout = NHWC if is_channels_last(x) else NCHW
    return _phys(x, layout), layout, unbatched


def _pool_output(y: Tensor, layout: int, unbatched: bool) -> Tensor:
    y = _logical(y, layout)
    return y.squeeze(0) if unbatched else y


def max_pool2d(
    input: Tensor,
    kernel_size,
    stride=None,
    padding=0,
    dilation=1,
    ceil_mode: bool = False,
    return_indices: bool = False,
):
    """``F.max_pool2d`` for a CUDA ``input [N, C, H, W]`` (or ``[C, H, W]``) of float32, bfloat16
    or float16: the window's maximum (NaN wins), and with ``return_indices`` PyTorch's int64
    indices (``h * W + w`` in the plane, the first maximum). ``dilation`` must be 1 (``nn.MaxPool2d``
    runs PyTorch's otherwise). ``channels_last`` stays so. The backward is deterministic."""
    op = "max_pool2d"
    if _pair(op, "dilation", dilation) != (1, 1):
        raise ValueError(f"{NS}::{op}: dilation {dilation} is not supported (only 1)")
    x, layout, unbatched = _pool_input(op, input)
    y, idx = _call(op, x, *_pool_args(op, kernel_size, stride, padding), bool(ceil_mode), layout)
    y = _pool_output(y, layout, unbatched)
    return (y, _pool_output(idx, layout, unbatched)) if return_indices else y


def avg_pool2d(
    input: Tensor,
    kernel_size,
    stride=None,
    padding=0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: Optional[int] = None,
) -> Tensor:
    """``F.avg_pool2d`` for a CUDA ``input [N, C, H, W]`` (or ``[C, H, W]``) of float32, bfloat16
    or float16: each window's f32 sum over its size (with ``count_include_pad``, the padding
    counts). ``divisor_override`` is not supported (``nn.AvgPool2d`` runs PyTorch's for it)."""
    op = "avg_pool2d"
    if divisor_override is not None:
        raise ValueError(f"{NS}::{op}: divisor_override is not supported")
    x, layout, unbatched = _pool_input(op, input)
    args = _pool_args(op, kernel_size, stride, padding)
    y = _call(op, x, *args, bool(ceil_mode), bool(count_include_pad), layout)
    return _pool_output(y, layout, unbatched)


def adaptive_output_size(x: Tensor, output_size) -> tuple:
    """``output_size`` of ``F.adaptive_avg_pool2d`` as ``(height, width)`` (None: the input's)."""
    size = (output_size, output_size) if output_size is None or isinstance(output_size, int) else tuple(output_size)
    if len(size) == 1:
        size = (size[0], size[0])
    h, w = x.shape[-2], x.shape[-1]
    return (h if size[0] is None else int(size[0]), w if size[1] is None else int(size[1]))


def adaptive_avg_pool2d(input: Tensor, output_size) -> Tensor:
    """``F.adaptive_avg_pool2d``: to 1 x 1 (the global average pool, each plane's mean in f32) on
    the kernels for a CUDA ``input [N, C, H, W]`` (or ``[C, H, W]``) of float32, bfloat16 or
    float16; every other output size, and other tensors, run PyTorch's."""
    ok = (
        isinstance(input, Tensor)
        and input.dim() in (3, 4)
        and input.is_cuda
        and input.dtype in _DTYPE_CODES
        and adaptive_output_size(input, output_size) == (1, 1)
    )
    if not ok:
        return F.adaptive_avg_pool2d(input, output_size)
    x, layout, unbatched = _pool_input("global_avg_pool2d", input)
    return _pool_output(_call("global_avg_pool2d", x, layout), layout, unbatched)


def fold_batch_norm(
    weight: Tensor,
    bias: Optional[Tensor],
    running_mean: Tensor,
    running_var: Tensor,
    bn_weight: Optional[Tensor],
    bn_bias: Optional[Tensor],
    eps: float,
) -> tuple[Tensor, Tensor]:
    """A convolution followed by a batch norm in evaluation, as one convolution: ``weight *
    s`` and ``(bias - running_mean) * s + bn_bias`` with ``s = bn_weight / sqrt(running_var +
    eps)`` per output channel, computed in f32 (float64 for float64) and rounded once to the
    convolution's dtype. Differentiable (PyTorch ops)."""
    ct = torch.promote_types(weight.dtype, torch.float32)
    s = torch.rsqrt(running_var.to(ct) + eps)
    if bn_weight is not None:
        s = s * bn_weight.to(ct)
    b = -running_mean.to(ct) if bias is None else bias.to(ct) - running_mean.to(ct)
    b = b * s
    if bn_bias is not None:
        b = b + bn_bias.to(ct)
    w = weight.to(ct) * s.reshape(-1, *([1] * (weight.dim() - 1)))
    return w.to(weight.dtype), b.to(weight.dtype)


__all__ = [
    "adaptive_avg_pool2d",
    "avg_pool2d",
    "batch_norm",
    "conv2d",
    "fold_batch_norm",
    "is_channels_last",
    "max_pool2d",
]
