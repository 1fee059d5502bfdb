"""The operators: ``torch.library`` custom ops in the ``rustkernels`` namespace, each with a fake
(meta) implementation and, for the forward ops, a registered autograd formula whose backward is
itself a custom op, so that they work in eager mode, under ``torch.compile(fullgraph=True)`` and
with ``torch.library.opcheck``.

How a call runs: the op checks its tensors (CUDA, one device, f32/f16/bf16, one dtype), makes
inputs contiguous and 16-byte aligned (a copy only for a non-contiguous or misaligned view: the
kernels load 16-byte vectors from the first element), allocates every output with PyTorch's
allocator (``torch.empty``), and hands the raw addresses and PyTorch's current stream to
``_native``, which runs the kernel on that stream (``kernels::Device::with_stream``). Nothing is
synchronised, except by the cross-entropy, which reads back whether a target was out of range.

Under CUDA graph capture (``torch.cuda.graph``) every operator records into the graph: the
library's temporaries become the graph's own allocations, and the cross-entropy skips its
target check (nothing may wait for a capturing stream), so an out-of-range target then gives a
NaN loss instead of an error. Call each operator once before capturing, as PyTorch's warm-up
does: its kernels load on first use.
"""

import inspect
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _native

NS = "rustkernels"

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_ALIGN = int(_native.ALIGNMENT)

# The op table (kernels_gpu::unary_table), exported by the native module: one row per op,
# ``(name, activation, ((param, default), ...), from_output, positive, torch, module, doc)``; a
# row's code in ``_native`` is its index.
UNARY_OPS = {row[0]: (code,) + tuple(row[1:]) for code, row in enumerate(_native.UNARY_OPS)}

# Activation name -> (code in _native, parameter names with PyTorch's defaults).
ACTIVATIONS = {name: (row[0], tuple(row[2])) for name, row in UNARY_OPS.items() if row[1]}

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}

try:  # the raw handle without building a torch.cuda.Stream object (what Inductor calls)
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older or CPU-only builds

    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def cuda_status() -> tuple[bool, str]:
    """``(True, gpu_name)`` if the kernels can run here, else ``(False, reason)``."""
    return _native.cuda_status()


def cuda_available() -> bool:
    """Whether the kernels can run here (an NVIDIA driver and a GPU of compute capability 8.0+)."""
    return _native.cuda_status()[0]


def _cuda_note() -> str:
    ok, why = _native.cuda_status()
    return "" if ok else f" (and CUDA is unavailable here: {why})"


def _check(op: str, name: str, t: Tensor, like: Optional[Tensor] = None, dtype=None) -> Tensor:
    """``t`` as the kernels need it: a CUDA tensor of a supported dtype, on ``like``'s device
    and of its dtype (or of ``dtype``), contiguous and 16-byte aligned (copied if it is not)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{NS}::{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(
            f"{NS}::{op}: {name} is on {t.device}; the kernels run on CUDA tensors only "
            f"(kernels_torch.nn's modules fall back to PyTorch for CPU tensors){_cuda_note()}"
        )
    want = dtype if dtype is not None else (like.dtype if like is not None else None)
    if want is None and t.dtype not in _DTYPE_CODES:
        raise TypeError(f"{NS}::{op}: {name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    if want is not None and t.dtype != want:
        raise TypeError(f"{NS}::{op}: {name} has dtype {t.dtype} but must be {want}")
    if like is not None and t.device != like.device:
        raise ValueError(f"{NS}::{op}: {name} is on {t.device} but the input is on {like.device}")
    if not t.is_contiguous() or t.data_ptr() % _ALIGN:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _where(x: Tensor) -> tuple[int, int, int]:
    """The device index, PyTorch's current stream on it, and the dtype code."""
    i = x.device.index
    return i, _raw_stream(i), _DTYPE_CODES[x.dtype]


def _new(shape, like: Tensor, dtype=None) -> Tensor:
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


# --- the two call paths -------------------------------------------------------------------------
#
# Every operator is a torch.library custom op (what torch.compile, opcheck and tracing see). Its
# dispatch, though, costs some 15 microseconds of host time per call on top of the native call's
# 4 (the custom op's Python autograd wrapper and the dispatcher, twice per call with its backward),
# which dominates small tensors. So the functions below run eager calls on plain CUDA tensors
# through one torch.autograd.Function calling the same implementations and the same autograd
# formulas directly, and everything else (compiling, tracing, tensor subclasses, functorch
# transforms) through the custom op.

_IMPL = {}  # op name -> its implementation (the function the custom op wraps)
_AUTOGRAD = {}  # op name -> (setup_context, backward) registered for it


def _custom_op(name: str, schema: Optional[str] = None):
    def wrap(fn):
        _IMPL[name] = fn
        return torch.library.custom_op(f"{NS}::{name}", fn, mutates_args=(), schema=schema)

    return wrap


def _autograd(opdef, name: str, backward, setup) -> None:
    _AUTOGRAD[name] = (setup, backward)
    opdef.register_autograd(backward, setup_context=setup)


def _op(name: str):
    return getattr(getattr(torch.ops, NS), name)


def _bwd(ctx, name: str):
    """The backward op: its implementation itself on the eager path, else the custom op."""
    return _IMPL[name] if getattr(ctx, "eager", False) else _op(name)


class _Eager(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, *inputs):
        out = _IMPL[name](*inputs)
        ctx.eager, ctx.name = True, name
        _AUTOGRAD[name][0](ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, *grads):
        g = _AUTOGRAD[ctx.name][1](ctx, *grads)
        return (None,) + (tuple(g) if isinstance(g, tuple) else (g,))


def _call(name: str, x, *args):
    if type(x) is Tensor and x.is_cuda and not torch.compiler.is_compiling() and not _functorch_active():
        return _Eager.apply(name, x, *args)
    return _op(name)(x, *args)


def _functorch_active() -> bool:
    f = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(f and f())


def _call_elementwise(name: str, x, *args):
    """``_call`` for an element-wise op: a ``channels_last`` 4-d tensor (whose memory is dense but
    not contiguous) runs on its memory in place, as the contiguous ``[N, H, W, C]`` view, and the
    result is the same kind of view, where a copy would make it contiguous and slower to read
    back by the NHWC kernels after it."""
    if (
        isinstance(x, Tensor)
        and x.dim() == 4
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last)
    ):
        return _call(name, x.permute(0, 2, 3, 1), *args).permute(0, 3, 1, 2)
    return _call(name, x, *args)


# --- activations ---------------------------------------------------------------------------------


def _act_params(params: Sequence[float]) -> tuple[float, float]:
    p = tuple(float(v) for v in params) + (0.0, 0.0)
    return p[0], p[1]


# The activations whose backward reads the saved output instead of the input (a kernel of their
# own: ``y`` in the table), as PyTorch's autograd does for sigmoid and tanh: the output is saved
# (the input may be freed), and the backward kernel is a few multiplications (``grad * (1 - y) *
# y``) where from the input it computes the activation again. Their backward ops take ``y`` where
# the others take ``x``.
_FROM_OUTPUT = {name for name, row in UNARY_OPS.items() if row[1] and row[3] == "y"}


def _define_activation(name: str, code: int, params: tuple) -> None:
    sig = "".join(f", float {p}={d}" for p, d in params)
    nparams = len(params)
    from_output = name in _FROM_OUTPUT
    arg = "y" if from_output else "x"
    native_bwd = _native.activation_bwd_y if from_output else _native.activation_bwd

    def fwd_impl(x: Tensor, *p: float) -> Tensor:
        x = _check(name, "x", x)
        y = torch.empty_like(x)
        dev, stream, dt = _where(x)
        a, b = _act_params(p)
        _native.activation_fwd(dev, stream, dt, code, a, b, x.data_ptr(), y.data_ptr(), x.numel())
        return y

    def bwd_impl(x: Tensor, grad: Tensor, *p: float) -> Tensor:
        # x: the input, or the output for the activations of _FROM_OUTPUT.
        x = _check(f"{name}_backward", arg, x)
        grad = _check(f"{name}_backward", "grad", grad, like=x)
        if grad.shape != x.shape:
            raise ValueError(f"{NS}::{name}_backward: grad has shape {tuple(grad.shape)}, {arg} {tuple(x.shape)}")
        gx = torch.empty_like(x)
        dev, stream, dt = _where(x)
        a, b = _act_params(p)
        native_bwd(dev, stream, dt, code, a, b, x.data_ptr(), grad.data_ptr(), gx.data_ptr(), x.numel())
        return gx

    fwd = _custom_op(name, f"(Tensor x{sig}) -> Tensor")(fwd_impl)
    bwd = _custom_op(f"{name}_backward", f"(Tensor {arg}, Tensor grad{sig}) -> Tensor")(bwd_impl)

    @fwd.register_fake
    def _(x, *p):
        return x.new_empty(x.shape)

    @bwd.register_fake
    def _(x, grad, *p):
        return x.new_empty(x.shape)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output if from_output else inputs[0])
        ctx.params = inputs[1:]

    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors  # x, or y for _FROM_OUTPUT
        return (_bwd(ctx, f"{name}_backward")(saved, grad, *ctx.params),) + (None,) * nparams

    _autograd(fwd, name, backward, setup_context)


for _name, (_code, _params) in ACTIVATIONS.items():
    if _name != "identity":
        _define_activation(_name, _code, _params)


def _public(name: str, params: tuple, doc: str):
    """The Python function of activation ``name``: ``f(x, *params)`` with PyTorch's parameter
    names and defaults (``inspect.signature`` shows them)."""
    names = tuple(p for p, _ in params)
    defaults = tuple(float(d) for _, d in params)

    if not names:

        def fn(x: Tensor) -> Tensor:
            return _call_elementwise(name, x)

    else:

        def fn(x: Tensor, *args, **kwargs) -> Tensor:
            if kwargs or len(args) != len(names):
                bound = sig.bind(x, *args, **kwargs)
                bound.apply_defaults()
                args = tuple(bound.arguments[p] for p in names)
            return _call_elementwise(name, x, *(float(a) for a in args))

    P = inspect.Parameter
    sig = inspect.Signature(
        [P("x", P.POSITIONAL_OR_KEYWORD, annotation=Tensor)]
        + [P(p, P.POSITIONAL_OR_KEYWORD, default=d, annotation=float) for p, d in zip(names, defaults)],
        return_annotation=Tensor,
    )
    fn.__name__ = fn.__qualname__ = name
    fn.__signature__ = sig
    fn.__doc__ = f"``{name}``: {doc.strip('.')}; PyTorch's ``{UNARY_OPS[name][5]}``, forward and backward on the GPU."
    return fn


# One function per activation of the table (``gelu`` takes PyTorch's ``approximate`` instead, and
# ``identity`` has none).
FUNCTIONS = tuple(n for n in ACTIVATIONS if n not in ("identity", "gelu", "gelu_tanh"))
for _name in FUNCTIONS:
    globals()[_name] = _public(_name, ACTIVATIONS[_name][1], UNARY_OPS[_name][7])
FUNCTIONS += ("gelu",)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU as ``F.gelu``: the erf form, or the tanh approximation with ``approximate="tanh"``."""
    if approximate == "none":
        return _call_elementwise("gelu", x)
    if approximate == "tanh":
        return _call_elementwise("gelu_tanh", x)
    raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


swish = silu  # noqa: F821 (defined above from the table)


# --- act(x * scale + bias) ----------------------------------------------------------------------


def _activation(op: str, act: str, a: float, b: float) -> tuple[int, float, float]:
    if act not in ACTIVATIONS:
        raise ValueError(f"{NS}::{op}: unknown activation {act!r}; known: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act][0], float(a), float(b)


def _rows_cols(op: str, x: Tensor) -> tuple[int, int]:
    if x.dim() == 0:
        raise ValueError(f"{NS}::{op}: needs a tensor with at least one dimension, got a scalar")
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols


def _check_row(op: str, name: str, p: Tensor, x: Tensor) -> Tensor:
    p = _check(op, name, p, like=x)
    if tuple(p.shape) != (x.shape[-1],):
        raise ValueError(f"{NS}::{op}: {name} has shape {tuple(p.shape)}; it must be [{x.shape[-1]}] (x's last dimension)")
    return p


@_custom_op("scale_bias_act")
def scale_bias_act_op(x: Tensor, scale: Tensor, bias: Tensor, act: str, a: float, b: float) -> Tensor:
    op = "scale_bias_act"
    code, a, b = _activation(op, act, a, b)
    x = _check(op, "x", x)
    scale, bias = _check_row(op, "scale", scale, x), _check_row(op, "bias", bias, x)
    rows, cols = _rows_cols(op, x)
    y = torch.empty_like(x)
    dev, stream, dt = _where(x)
    _native.scale_bias_act_fwd(
        dev, stream, dt, code, a, b, x.data_ptr(), scale.data_ptr(), bias.data_ptr(), y.data_ptr(), rows, cols
    )
    return y


@scale_bias_act_op.register_fake
def _(x, scale, bias, act, a, b):
    return x.new_empty(x.shape)


@_custom_op("scale_bias_act_backward")
def scale_bias_act_backward_op(
    x: Tensor, scale: Tensor, bias: Tensor, grad: Tensor, act: str, a: float, b: float
) -> tuple[Tensor, Tensor, Tensor]:
    op = "scale_bias_act_backward"
    code, a, b = _activation(op, act, a, b)
    x = _check(op, "x", x)
    scale, bias = _check_row(op, "scale", scale, x), _check_row(op, "bias", bias, x)
    grad = _check(op, "grad", grad, like=x)
    if grad.shape != x.shape:
        raise ValueError(f"{NS}::{op}: grad has shape {tuple(grad.shape)}, x {tuple(x.shape)}")
    rows, cols = _rows_cols(op, x)
    gx, gs, gb = torch.empty_like(x), torch.empty_like(scale), torch.empty_like(bias)
    dev, stream, dt = _where(x)
    _native.scale_bias_act_bwd(
        dev, stream, dt, code, a, b, x.data_ptr(), scale.data_ptr(), bias.data_ptr(), grad.data_ptr(),
        gx.data_ptr(), gs.data_ptr(), gb.data_ptr(), rows, cols,
    )  # fmt: skip
    return gx, gs, gb


@scale_bias_act_backward_op.register_fake
def _(x, scale, bias, grad, act, a, b):
    return x.new_empty(x.shape), scale.new_empty(scale.shape), bias.new_empty(bias.shape)


def _sba_setup(ctx, inputs, output):
    x, scale, bias, act, a, b = inputs
    ctx.save_for_backward(x, scale, bias)
    ctx.act = (act, a, b)


def _sba_backward(ctx, grad):
    x, scale, bias = ctx.saved_tensors
    gx, gs, gb = _bwd(ctx, "scale_bias_act_backward")(x, scale, bias, grad, *ctx.act)
    return gx, gs, gb, None, None, None


_autograd(scale_bias_act_op, "scale_bias_act", _sba_backward, _sba_setup)


def scale_bias_act(x: Tensor, scale: Tensor, bias: Tensor, activation: str = "gelu", *params: float) -> Tensor:
    """``act(x * scale + bias)`` in one kernel, ``scale`` and ``bias`` of shape ``[x.shape[-1]]``;
    ``params`` are the activation's (``negative_slope``; ``beta, threshold``), PyTorch's defaults
    if omitted. Backward: the gradients of x, scale and bias in one pass plus a column sum."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"scale_bias_act: unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
    defaults = [d for _, d in ACTIVATIONS[activation][1]]
    p = list(params) + defaults[len(params) :]
    a, b = _act_params(p)
    return _call("scale_bias_act", x, scale, bias, activation, a, b)


# --- gated activations: act(a) * b ---------------------------------------------------------------


def _glu_halves(op: str, x: Tensor) -> tuple[int, int]:
    """Rows and F of the fused input ``[.., 2F]``."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"{NS}::{op}: x must be [.., 2F] (a and b its halves), got shape {tuple(x.shape)}")
    f = x.shape[-1] // 2
    return (x.numel() // (2 * f) if f else 0), f


def _glu_pair(op: str, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    a = _check(op, "a", a)
    b = _check(op, "b", b, like=a)
    if a.shape != b.shape:
        raise ValueError(f"{NS}::{op}: a has shape {tuple(a.shape)}, b {tuple(b.shape)}; they must have one shape")
    return a, b


@_custom_op("glu")
def glu_op(x: Tensor, act: str, a: float, b: float) -> Tensor:
    op = "glu"
    code, a, b = _activation(op, act, a, b)
    x = _check(op, "x", x)
    rows, f = _glu_halves(op, x)
    y = _new((*x.shape[:-1], f), x)
    dev, stream, dt = _where(x)
    _native.glu_fwd(dev, stream, dt, code, a, b, x.data_ptr(), 0, y.data_ptr(), rows, f)
    return y


@glu_op.register_fake
def _(x, act, a, b):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@_custom_op("glu_backward")
def glu_backward_op(x: Tensor, grad: Tensor, act: str, a: float, b: float) -> Tensor:
    op = "glu_backward"
    code, a, b = _activation(op, act, a, b)
    x = _check(op, "x", x)
    rows, f = _glu_halves(op, x)
    grad = _check(op, "grad", grad, like=x)
    if tuple(grad.shape) != (*x.shape[:-1], f):
        raise ValueError(f"{NS}::{op}: grad has shape {tuple(grad.shape)}, x {tuple(x.shape)}")
    gx = torch.empty_like(x)
    dev, stream, dt = _where(x)
    _native.glu_bwd(dev, stream, dt, code, a, b, x.data_ptr(), 0, grad.data_ptr(), gx.data_ptr(), 0, rows, f)
    return gx


@glu_backward_op.register_fake
def _(x, grad, act, a, b):
    return x.new_empty(x.shape)


def _glu_setup(ctx, inputs, output):
    x, act, a, b = inputs
    ctx.save_for_backward(x)
    ctx.act = (act, a, b)


def _glu_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return _bwd(ctx, "glu_backward")(x, grad, *ctx.act), None, None, None


_autograd(glu_op, "glu", _glu_backward, _glu_setup)


@_custom_op("glu2")
def glu2_op(x: Tensor, gate: Tensor, act: str, a: float, b: float) -> Tensor:
    # x: the activation's input (``a`` of ``act(a) * b``), gate: ``b``.
    op = "glu2"
    code, a, b = _activation(op, act, a, b)
    x, gate = _glu_pair(op, x, gate)
    rows, f = _rows_cols(op, x)
    y = torch.empty_like(x)
    dev, stream, dt = _where(x)
    _native.glu_fwd(dev, stream, dt, code, a, b, x.data_ptr(), gate.data_ptr(), y.data_ptr(), rows, f)
    return y


@glu2_op.register_fake
def _(x, gate, act, a, b):
    return x.new_empty(x.shape)


@_custom_op("glu2_backward")
def glu2_backward_op(x: Tensor, gate: Tensor, grad: Tensor, act: str, a: float, b: float) -> tuple[Tensor, Tensor]:
    op = "glu2_backward"
    code, a, b = _activation(op, act, a, b)
    x, gate = _glu_pair(op, x, gate)
    grad = _check(op, "grad", grad, like=x)
    if grad.shape != x.shape:
        raise ValueError(f"{NS}::{op}: grad has shape {tuple(grad.shape)}, x {tuple(x.shape)}")
    rows, f = _rows_cols(op, x)
    gx, gg = torch.empty_like(x), torch.empty_like(x)
    dev, stream, dt = _where(x)
    _native.glu_bwd(
        dev, stream, dt, code, a, b, x.data_ptr(), gate.data_ptr(), grad.data_ptr(), gx.data_ptr(), gg.data_ptr(),
        rows, f,
    )  # fmt: skip
    return gx, gg


@glu2_backward_op.register_fake
def _(x, gate, grad, act, a, b):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _glu2_setup(ctx, inputs, output):
    x, gate, act, a, b = inputs
    ctx.save_for_backward(x, gate)
    ctx.act = (act, a, b)


def _glu2_backward(ctx, grad):
    x, gate = ctx.saved_tensors
    gx, gg = _bwd(ctx, "glu2_backward")(x, gate, grad, *ctx.act)
    return gx, gg, None, None, None


_autograd(glu2_op, "glu2", _glu2_backward, _glu2_setup)


def glu_act(x: Tensor, activation: str = "silu", *params: float, gate: Optional[Tensor] = None) -> Tensor:
    """``act(a) * b`` in one kernel, forward and backward: ``a, b = x.chunk(2, dim=-1)`` (as
    ``F.glu`` splits ``x: [.., 2F]``, output ``[.., F]``), or ``a = x`` and ``b = gate`` (one
    shape). ``activation`` is any of ``ACTIVATIONS`` (``"silu"``: SwiGLU, ``"gelu"`` or
    ``"gelu_tanh"``: GeGLU, ``"relu"``: ReGLU, ``"sigmoid"``: GLU with the halves in this order,
    which ``F.glu`` swaps: ``F.glu(x) = a * sigmoid(b)``); ``params`` are its parameters,
    PyTorch's defaults if omitted."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"glu_act: unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
    defaults = [d for _, d in ACTIVATIONS[activation][1]]
    a, b = _act_params(list(params) + defaults[len(params) :])
    if gate is None:
        return _call("glu", x, activation, a, b)
    return _call("glu2", x, gate, activation, a, b)


def swiglu(x: Tensor, gate: Optional[Tensor] = None) -> Tensor:
    """SwiGLU: ``F.silu(a) * b`` (``a, b = x.chunk(2, dim=-1)``, or ``a = x``, ``b = gate``)."""
    return glu_act(x, "silu", gate=gate)


def geglu(x: Tensor, gate: Optional[Tensor] = None, approximate: str = "none") -> Tensor:
    """GeGLU: ``F.gelu(a, approximate=approximate) * b`` (halves of ``x``, or ``x`` and ``gate``)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return glu_act(x, "gelu" if approximate == "none" else "gelu_tanh", gate=gate)


def reglu(x: Tensor, gate: Optional[Tensor] = None) -> Tensor:
    """ReGLU: ``F.relu(a) * b`` (halves of ``x``, or ``x`` and ``gate``)."""
    return glu_act(x, "relu", gate=gate)


# --- softmax ------------------------------------------------------------------------------------


def _define_softmax(name: str, log: bool) -> None:
    def fwd_impl(x: Tensor) -> Tensor:
        x = _check(name, "x", x)
        rows, cols = _rows_cols(name, x)
        y = torch.empty_like(x)
        dev, stream, dt = _where(x)
        _native.softmax_fwd(dev, stream, dt, log, x.data_ptr(), y.data_ptr(), rows, cols)
        return y

    def bwd_impl(y: Tensor, grad: Tensor) -> Tensor:
        op = f"{name}_backward"
        y = _check(op, "y", y)
        grad = _check(op, "grad", grad, like=y)
        if grad.shape != y.shape:
            raise ValueError(f"{NS}::{op}: grad has shape {tuple(grad.shape)}, the output {tuple(y.shape)}")
        rows, cols = _rows_cols(op, y)
        gx = torch.empty_like(y)
        dev, stream, dt = _where(y)
        _native.softmax_bwd(dev, stream, dt, log, y.data_ptr(), grad.data_ptr(), gx.data_ptr(), rows, cols)
        return gx

    fwd = _custom_op(name, "(Tensor x) -> Tensor")(fwd_impl)
    bwd = _custom_op(f"{name}_backward", "(Tensor y, Tensor grad) -> Tensor")(bwd_impl)
    fwd.register_fake(lambda x: x.new_empty(x.shape))
    bwd.register_fake(lambda y, grad: y.new_empty(y.shape))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return _bwd(ctx, f"{name}_backward")(y, grad)

    _autograd(fwd, name, backward, setup_context)


_define_softmax("softmax", False)
_define_softmax("log_softmax", True)


def _last_dim(f, x: Tensor, dim: int) -> Tensor:
    if x.dim() == 0:
        # PyTorch takes a 0-d tensor as one row of one element (dim 0 or -1).
        if dim not in (0, -1):
            raise IndexError(f"Dimension out of range (expected to be in range of [-1, 0], but got {dim})")
        return f(x.reshape(1)).reshape(())
    d = dim % x.dim()
    if d == x.dim() - 1:
        return f(x)
    # The kernels work along the last dimension: move `dim` there (the op copies the view).
    return f(x.movedim(d, -1)).movedim(-1, d)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``torch.softmax(x, dim)``; along a dimension other than the last, through a copy."""
    return _last_dim(lambda t: _call("softmax", t), x, dim)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``torch.log_softmax(x, dim)``; along a dimension other than the last, through a copy."""
    return _last_dim(lambda t: _call("log_softmax", t), x, dim)


# --- layer norm, RMS norm -----------------------------------------------------------------------


def _norm_shape(op: str, x: Tensor, normalized_shape: Sequence[int]) -> tuple[int, int, list[int]]:
    ns = [int(n) for n in normalized_shape]
    k = len(ns)
    if k == 0 or list(x.shape[x.dim() - k :]) != ns or x.dim() < k:
        raise ValueError(f"{NS}::{op}: normalized_shape {ns} must be the last dimensions of x, shape {list(x.shape)}")
    lead = list(x.shape[: x.dim() - k])
    # Rows of length 0, or no rows: the output is empty, as PyTorch's (the ops return early).
    return math.prod(lead), math.prod(ns), lead


def _check_param(op: str, name: str, p: Optional[Tensor], x: Tensor, ns: Sequence[int]) -> Optional[Tensor]:
    if p is None:
        return None
    p = _check(op, name, p, like=x)
    if list(p.shape) != list(ns):
        raise ValueError(f"{NS}::{op}: {name} has shape {list(p.shape)}; it must be normalized_shape {list(ns)}")
    return p


def _ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


@_custom_op("layer_norm")
def layer_norm_op(
    x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], bias: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    op = "layer_norm"
    x = _check(op, "x", x)
    rows, cols, lead = _norm_shape(op, x, normalized_shape)
    weight = _check_param(op, "weight", weight, x, normalized_shape)
    bias = _check_param(op, "bias", bias, x, normalized_shape)
    y = torch.empty_like(x)
    mean, rstd = _new(lead, x, torch.float32), _new(lead, x, torch.float32)
    if x.numel() == 0:
        return y, mean, rstd
    dev, stream, dt = _where(x)
    _native.norm_fwd(
        dev, stream, dt, x.data_ptr(), _ptr(weight), _ptr(bias), y.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
        rows, cols, float(eps),
    )  # fmt: skip
    return y, mean, rstd


@layer_norm_op.register_fake
def _(x, normalized_shape, weight, bias, eps):
    lead = list(x.shape[: x.dim() - len(normalized_shape)])
    return x.new_empty(x.shape), x.new_empty(lead, dtype=torch.float32), x.new_empty(lead, dtype=torch.float32)


@_custom_op("layer_norm_backward")
def layer_norm_backward_op(
    x: Tensor,
    normalized_shape: list[int],
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    grad: Tensor,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of x, weight and bias; a gradient not asked for is an empty tensor."""
    op = "layer_norm_backward"
    x = _check(op, "x", x)
    rows, cols, lead = _norm_shape(op, x, normalized_shape)
    weight = _check_param(op, "weight", weight, x, normalized_shape)
    mean = _check(op, "mean", mean, like=x, dtype=torch.float32)
    rstd = _check(op, "rstd", rstd, like=x, dtype=torch.float32)
    grad = _check(op, "grad", grad, like=x)
    if grad.shape != x.shape or list(mean.shape) != lead or list(rstd.shape) != lead:
        raise ValueError(f"{NS}::{op}: grad must have x's shape and the statistics {lead}")
    if weight_grad and weight is None:
        raise ValueError(f"{NS}::{op}: a weight gradient needs the weight")
    gx = torch.empty_like(x)
    if x.numel() == 0:
        # Sums over no rows (or of empty rows).
        z = lambda want: x.new_zeros(normalized_shape if want else [0])  # noqa: E731
        return gx, z(weight_grad), z(bias_grad)
    gw = _new(normalized_shape if weight_grad else [0], x)
    gb = _new(normalized_shape if bias_grad else [0], x)
    dev, stream, dt = _where(x)
    _native.norm_bwd(
        dev, stream, dt, x.data_ptr(), _ptr(weight), mean.data_ptr(), rstd.data_ptr(), grad.data_ptr(),
        gx.data_ptr(), gw.data_ptr() if weight_grad else 0, gb.data_ptr() if bias_grad else 0, rows, cols,
    )  # fmt: skip
    return gx, gw, gb


@layer_norm_backward_op.register_fake
def _(x, normalized_shape, weight, mean, rstd, grad, weight_grad, bias_grad):
    ns = list(normalized_shape)
    return x.new_empty(x.shape), x.new_empty(ns if weight_grad else [0]), x.new_empty(ns if bias_grad else [0])


def _ln_setup(ctx, inputs, output):
    x, ns, weight, bias, eps = inputs
    y, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.ns = ns
    ctx.want = (weight is not None and weight.requires_grad, bias is not None and bias.requires_grad)
    ctx.mark_non_differentiable(mean, rstd)


def _ln_backward(ctx, grad, _gmean, _grstd):
    x, weight, mean, rstd = ctx.saved_tensors
    wg, bg = ctx.want
    gx, gw, gb = _bwd(ctx, "layer_norm_backward")(x, ctx.ns, weight, mean, rstd, grad, wg, bg)
    return gx, None, (gw if wg else None), (gb if bg else None), None


_autograd(layer_norm_op, "layer_norm", _ln_backward, _ln_setup)


def layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
) -> Tensor:
    """``F.layer_norm`` over the trailing ``normalized_shape`` (biased variance, f32 statistics)."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    return _call("layer_norm", x, list(normalized_shape), weight, bias, eps)[0]


@_custom_op("rms_norm")
def rms_norm_op(x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    op = "rms_norm"
    x = _check(op, "x", x)
    rows, cols, lead = _norm_shape(op, x, normalized_shape)
    weight = _check_param(op, "weight", weight, x, normalized_shape)
    y = torch.empty_like(x)
    rstd = _new(lead, x, torch.float32)
    if x.numel() == 0:
        return y, rstd
    dev, stream, dt = _where(x)
    _native.norm_fwd(
        dev, stream, dt, x.data_ptr(), _ptr(weight), 0, y.data_ptr(), 0, rstd.data_ptr(), rows, cols, float(eps)
    )
    return y, rstd


@rms_norm_op.register_fake
def _(x, normalized_shape, weight, eps):
    lead = list(x.shape[: x.dim() - len(normalized_shape)])
    return x.new_empty(x.shape), x.new_empty(lead, dtype=torch.float32)


@_custom_op("rms_norm_backward")
def rms_norm_backward_op(
    x: Tensor, normalized_shape: list[int], weight: Optional[Tensor], rstd: Tensor, grad: Tensor, weight_grad: bool
) -> tuple[Tensor, Tensor]:
    """Gradients of x and weight; the weight's is an empty tensor if not asked for."""
    op = "rms_norm_backward"
    x = _check(op, "x", x)
    rows, cols, lead = _norm_shape(op, x, normalized_shape)
    weight = _check_param(op, "weight", weight, x, normalized_shape)
    rstd = _check(op, "rstd", rstd, like=x, dtype=torch.float32)
    grad = _check(op, "grad", grad, like=x)
    if grad.shape != x.shape or list(rstd.shape) != lead:
        raise ValueError(f"{NS}::{op}: grad must have x's shape and rstd {lead}")
    if weight_grad and weight is None:
        raise ValueError(f"{NS}::{op}: a weight gradient needs the weight")
    gx = torch.empty_like(x)
    if x.numel() == 0:
        return gx, x.new_zeros(normalized_shape if weight_grad else [0])
    gw = _new(normalized_shape if weight_grad else [0], x)
    dev, stream, dt = _where(x)
    _native.norm_bwd(
        dev, stream, dt, x.data_ptr(), _ptr(weight), 0, rstd.data_ptr(), grad.data_ptr(), gx.data_ptr(),
        gw.data_ptr() if weight_grad else 0, 0, rows, cols,
    )  # fmt: skip
    return gx, gw


@rms_norm_backward_op.register_fake
def _(x, normalized_shape, weight, rstd, grad, weight_grad):
    return x.new_empty(x.shape), x.new_empty(list(normalized_shape) if weight_grad else [0])


def _rms_setup(ctx, inputs, output):
    x, ns, weight, eps = inputs
    y, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.ns = ns
    ctx.wg = weight is not None and weight.requires_grad
    ctx.mark_non_differentiable(rstd)


def _rms_backward(ctx, grad, _grstd):
    x, weight, rstd = ctx.saved_tensors
    gx, gw = _bwd(ctx, "rms_norm_backward")(x, ctx.ns, weight, rstd, grad, ctx.wg)
    return gx, None, (gw if ctx.wg else None), None


_autograd(rms_norm_op, "rms_norm", _rms_backward, _rms_setup)


def rms_norm(
    x: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None, eps: Optional[float] = None
) -> Tensor:
    """``F.rms_norm``: ``x / sqrt(mean(x^2) + eps) * weight``; ``eps=None`` is PyTorch's default,
    ``torch.finfo(x.dtype).eps``."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return _call("rms_norm", x, list(normalized_shape), weight, eps)[0]


# --- residual add fused with layer norm, RMS norm -----------------------------------------------
#
# ``h = x + residual`` (rounded to the dtype, as PyTorch's ``x + residual``) and ``y = norm(h)`` in
# one kernel; the ops return ``(y, h, *statistics)`` and the functions ``(y, h)``. The backward
# takes the gradients of both outputs: that of x and of the residual is ``dh + norm'(dy)`` (one
# tensor, returned for both), the parameters' are the norm's.


def _add_norm_inputs(op: str, x: Tensor, residual: Tensor, normalized_shape: Sequence[int]):
    x = _check(op, "x", x)
    residual = _check(op, "residual", residual, like=x)
    if residual.shape != x.shape:
        raise ValueError(f"{NS}::{op}: residual has shape {list(residual.shape)}, x {list(x.shape)}")
    rows, cols, lead = _norm_shape(op, x, normalized_shape)
    return x, residual, rows, cols, lead


@_custom_op("add_layer_norm")
def add_layer_norm_op(
    x: Tensor,
    residual: Tensor,
    normalized_shape: list[int],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    op = "add_layer_norm"
    x, residual, rows, cols, lead = _add_norm_inputs(op, x, residual, normalized_shape)
    weight = _check_param(op, "weight", weight, x, normalized_shape)
    bias = _check_param(op, "bias", bias, x, normalized_shape)
    y, h = torch.empty_like(x), torch.empty_like(x)
    mean, rstd = _new(lead, x, torch.float32), _new(lead, x, torch.float32)
    if x.numel() == 0:
        return y, h, mean, rstd
    dev, stream, dt = _where(x)
    _native.add_norm_fwd(
        dev, stream, dt, x.data_ptr(), residual.data_ptr(), _ptr(weight), _ptr(bias), y.data_ptr(), h.data_ptr(),
        mean.data_ptr(), rstd.data_ptr(), rows, cols, float(eps),
    )  # fmt: skip
    return y, h, mean, rstd


@add_layer_norm_op.register_fake
def _(x, residual, normalized_shape, weight, bias, eps):
    lead = list(x.shape[: x.dim() - len(normalized_shape)])
    stat = lambda: x.new_empty(lead, dtype=torch.float32)  # noqa: E731
    return x.new_empty(x.shape), x.new_empty(x.shape), stat(), stat()


@_custom_op("add_rms_norm")
def add_rms_norm_op(
    x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    op = "add_rms_norm"
    x, residual, rows, cols, lead = _add_norm_inputs(op, x, residual, normalized_shape)
    weight = _check_param(op, "weight", weight, x, normalized_shape)
    y, h = torch.empty_like(x), torch.empty_like(x)
    rstd = _new(lead, x, torch.float32)
    if x.numel() == 0:
        return y, h, rstd
    dev, stream, dt = _where(x)
    _native.add_norm_fwd(
        dev, stream, dt, x.data_ptr(), residual.data_ptr(), _ptr(weight), 0, y.data_ptr(), h.data_ptr(), 0,
        rstd.data_ptr(), rows, cols, float(eps),
    )  # fmt: skip
    return y, h, rstd


@add_rms_norm_op.register_fake
def _(x, residual, normalized_shape, weight, eps):
    lead = list(x.shape[: x.dim() - len(normalized_shape)])
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(lead, dtype=torch.float32)


def _add_norm_backward(
    op: str,
    h: Tensor,
    normalized_shape: list[int],
    weight: Optional[Tensor],
    mean: Optional[Tensor],
    rstd: Tensor,
    grad: Tensor,
    grad_h: Optional[Tensor],
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of x (and of the residual), weight and bias; a gradient not asked for is an
    empty tensor."""
    h = _check(op, "h", h)
    rows, cols, lead = _norm_shape(op, h, normalized_shape)
    weight = _check_param(op, "weight", weight, h, normalized_shape)
    mean = None if mean is None else _check(op, "mean", mean, like=h, dtype=torch.float32)
    rstd = _check(op, "rstd", rstd, like=h, dtype=torch.float32)
    grad = _check(op, "grad", grad, like=h)
    grad_h = None if grad_h is None else _check(op, "grad_h", grad_h, like=h)
    if (
        grad.shape != h.shape
        or (grad_h is not None and grad_h.shape != h.shape)
        or list(rstd.shape) != lead
        or (mean is not None and list(mean.shape) != lead)
    ):
        raise ValueError(f"{NS}::{op}: grad and grad_h must have h's shape and the statistics {lead}")
    if weight_grad and weight is None:
        raise ValueError(f"{NS}::{op}: a weight gradient needs the weight")
    z = lambda want: h.new_zeros(normalized_shape if want else [0])  # noqa: E731
    if h.numel() == 0:
        return torch.empty_like(h), z(weight_grad), z(bias_grad)
    gx = torch.empty_like(h)
    gw = _new(normalized_shape if weight_grad else [0], h)
    gb = _new(normalized_shape if bias_grad else [0], h)
    dev, stream, dt = _where(h)
    _native.add_norm_bwd(
        dev, stream, dt, h.data_ptr(), _ptr(weight), _ptr(mean), rstd.data_ptr(), grad.data_ptr(), _ptr(grad_h),
        gx.data_ptr(), gw.data_ptr() if weight_grad else 0, gb.data_ptr() if bias_grad else 0, rows, cols,
    )  # fmt: skip
    return gx, gw, gb


@_custom_op("add_layer_norm_backward")
def add_layer_norm_backward_op(
    h: Tensor,
    normalized_shape: list[int],
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    grad: Tensor,
    grad_h: Optional[Tensor],
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of x (and of the residual), weight and bias; a gradient not asked for is an
    empty tensor."""
    op = "add_layer_norm_backward"
    return _add_norm_backward(op, h, normalized_shape, weight, mean, rstd, grad, grad_h, weight_grad, bias_grad)


@add_layer_norm_backward_op.register_fake
def _(h, normalized_shape, weight, mean, rstd, grad, grad_h, weight_grad, bias_grad):
    ns = list(normalized_shape)
    return h.new_empty(h.shape), h.new_empty(ns if weight_grad else [0]), h.new_empty(ns if bias_grad else [0])


@_custom_op("add_rms_norm_backward")
def add_rms_norm_backward_op(
    h: Tensor,
    normalized_shape: list[int],
    weight: Optional[Tensor],
    rstd: Tensor,
    grad: Tensor,
    grad_h: Optional[Tensor],
    weight_grad: bool,
) -> tuple[Tensor, Tensor]:
    """Gradients of x (and of the residual) and weight; the weight's is an empty tensor if not
    asked for."""
    op = "add_rms_norm_backward"
    gx, gw, _ = _add_norm_backward(op, h, normalized_shape, weight, None, rstd, grad, grad_h, weight_grad, False)
    return gx, gw


@add_rms_norm_backward_op.register_fake
def _(h, normalized_shape, weight, rstd, grad, grad_h, weight_grad):
    return h.new_empty(h.shape), h.new_empty(list(normalized_shape) if weight_grad else [0])


def _add_ln_setup(ctx, inputs, output):
    x, residual, ns, weight, bias, eps = inputs
    y, h, mean, rstd = output
    ctx.save_for_backward(h, weight, mean, rstd)
    ctx.ns = ns
    ctx.want = (weight is not None and weight.requires_grad, bias is not None and bias.requires_grad)
    ctx.mark_non_differentiable(mean, rstd)


def _add_ln_backward(ctx, grad, grad_h, _gmean, _grstd):
    h, weight, mean, rstd = ctx.saved_tensors
    wg, bg = ctx.want
    if grad is None:  # only h was used: the norm passes nothing back
        grad = torch.zeros_like(h)
    gx, gw, gb = _bwd(ctx, "add_layer_norm_backward")(h, ctx.ns, weight, mean, rstd, grad, grad_h, wg, bg)
    return gx, gx, None, (gw if wg else None), (gb if bg else None), None


_autograd(add_layer_norm_op, "add_layer_norm", _add_ln_backward, _add_ln_setup)


def _add_rms_setup(ctx, inputs, output):
    x, residual, ns, weight, eps = inputs
    y, h, rstd = output
    ctx.save_for_backward(h, weight, rstd)
    ctx.ns = ns
    ctx.wg = weight is not None and weight.requires_grad
    ctx.mark_non_differentiable(rstd)


def _add_rms_backward(ctx, grad, grad_h, _grstd):
    h, weight, rstd = ctx.saved_tensors
    if grad is None:
        grad = torch.zeros_like(h)
    gx, gw = _bwd(ctx, "add_rms_norm_backward")(h, ctx.ns, weight, rstd, grad, grad_h, ctx.wg)
    return gx, gx, None, (gw if ctx.wg else None), None


_autograd(add_rms_norm_op, "add_rms_norm", _add_rms_backward, _add_rms_setup)


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
) -> tuple[Tensor, Tensor]:
    """``h = x + residual; y = F.layer_norm(h, normalized_shape, weight, bias, eps)`` in one kernel
    each way; returns ``(y, h)``, ``h`` (the next residual) as PyTorch's ``x + residual`` rounds
    it. The gradient of x and of the residual is one tensor, returned for both."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    y, h, _, _ = _call("add_layer_norm", x, residual, list(normalized_shape), weight, bias, eps)
    return y, h


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor] = None,
    eps: Optional[float] = None,
) -> tuple[Tensor, Tensor]:
    """``h = x + residual; y = F.rms_norm(h, normalized_shape, weight, eps)`` in one kernel each
    way; returns ``(y, h)``. ``eps=None`` is PyTorch's default, ``torch.finfo(x.dtype).eps``."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    y, h, _ = _call("add_rms_norm", x, residual, list(normalized_shape), weight, eps)
    return y, h


# --- cross-entropy ------------------------------------------------------------------------------


def _ce_check(op: str, logits: Tensor, target: Tensor, reduction: str) -> tuple[Tensor, Tensor, int, int, int]:
    logits = _check(op, "logits", logits)
    target = _check(op, "target", target, like=logits, dtype=torch.int64)
    if logits.dim() != 2 or tuple(target.shape) != (logits.shape[0],):
        raise ValueError(
            f"{NS}::{op}: logits must be [N, C] and target [N] (class indices), got {list(logits.shape)} "
            f"and {list(target.shape)}"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{NS}::{op}: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    return logits, target, logits.shape[0], logits.shape[1], _REDUCTIONS[reduction]


@_custom_op("cross_entropy")
def cross_entropy_op(
    logits: Tensor, target: Tensor, reduction: str, ignore_index: int, label_smoothing: float
) -> tuple[Tensor, Tensor, Tensor]:
    op = "cross_entropy"
    logits, target, n, c, red = _ce_check(op, logits, target, reduction)
    loss = _new([n] if red == 0 else [], logits)
    lse, count = _new([n], logits, torch.float32), _new([1], logits, torch.float32)
    dev, stream, dt = _where(logits)
    _native.cross_entropy_fwd(
        dev, stream, dt, logits.data_ptr(), target.data_ptr(), loss.data_ptr(), lse.data_ptr(), count.data_ptr(),
        n, c, red, int(ignore_index), float(label_smoothing),
    )  # fmt: skip
    return loss, lse, count


@cross_entropy_op.register_fake
def _(logits, target, reduction, ignore_index, label_smoothing):
    n = logits.shape[0]
    loss = logits.new_empty([n] if reduction == "none" else [])
    return loss, logits.new_empty([n], dtype=torch.float32), logits.new_empty([1], dtype=torch.float32)


@_custom_op("cross_entropy_backward")
def cross_entropy_backward_op(
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    count: Tensor,
    grad: Tensor,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
) -> Tensor:
    op = "cross_entropy_backward"
    logits, target, n, c, red = _ce_check(op, logits, target, reduction)
    lse = _check(op, "lse", lse, like=logits, dtype=torch.float32)
    count = _check(op, "count", count, like=logits, dtype=torch.float32)
    grad = _check(op, "grad", grad, like=logits)
    gx = torch.empty_like(logits)
    dev, stream, dt = _where(logits)
    _native.cross_entropy_bwd(
        dev, stream, dt, logits.data_ptr(), target.data_ptr(), lse.data_ptr(), count.data_ptr(), grad.data_ptr(),
        gx.data_ptr(), n, c, red, int(ignore_index), float(label_smoothing),
    )  # fmt: skip
    return gx


@cross_entropy_backward_op.register_fake
def _(logits, target, lse, count, grad, reduction, ignore_index, label_smoothing):
    return logits.new_empty(logits.shape)


def _ce_setup(ctx, inputs, output):
    logits, target, reduction, ignore_index, label_smoothing = inputs
    loss, lse, count = output
    ctx.save_for_backward(logits, target, lse, count)
    ctx.opts = (reduction, ignore_index, label_smoothing)
    ctx.mark_non_differentiable(lse, count)


def _ce_backward(ctx, grad, _glse, _gcount):
    logits, target, lse, count = ctx.saved_tensors
    gx = _bwd(ctx, "cross_entropy_backward")(logits, target, lse, count, grad, *ctx.opts)
    return gx, None, None, None, None


_autograd(cross_entropy_op, "cross_entropy", _ce_backward, _ce_setup)


def cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Optional[Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy`` with PyTorch's arguments and shapes.

    - Class indices (int64) without class weights: one fused kernel for the log-softmax and the
      loss (and one for the backward). Logits ``[N, C]`` with target ``[N]`` as they are; an
      unbatched ``[C]`` with a 0-d target, and ``[N, C, d1, ...]`` with ``[N, d1, ...]``, with the
      class dimension moved last first (a copy for the latter); ``reduction="none"`` gives the
      target's shape back. An out-of-range target (not ``ignore_index``) is a ValueError naming
      its row, which costs a synchronisation with the GPU per call; under CUDA graph capture it
      is not checked (its loss is NaN).
    - Class weights, or class probabilities as the target (floating point, the input's shape):
      the log-softmax is ours, the rest PyTorch's own formulas (those of ATen's
      ``cross_entropy``), so the result is PyTorch's on our log-softmax.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{NS}::cross_entropy: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if input.dim() == 0:
        raise ValueError(f"{NS}::cross_entropy: input must have a class dimension, got a 0-d tensor")
    cd = 0 if input.dim() == 1 else 1
    c = input.shape[cd]
    if target.is_floating_point():
        if target.shape != input.shape:
            raise ValueError(
                f"{NS}::cross_entropy: class probabilities must have the input's shape {list(input.shape)}, "
                f"got {list(target.shape)}"
            )
    else:
        want = list(input.shape[:cd]) + list(input.shape[cd + 1 :])
        if list(target.shape) != want:
            raise ValueError(
                f"{NS}::cross_entropy: logits [N, C, d1, ...] (or [C]) take class indices of shape {want}, "
                f"got {list(target.shape)}"
            )
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != c):
        raise ValueError(f"{NS}::cross_entropy: weight must have C = {c} elements, got shape {list(weight.shape)}")
    if weight is None and not target.is_floating_point():
        rows = input if input.dim() == 2 else input.movedim(cd, -1).reshape(-1, c)
        loss = _call("cross_entropy", rows, target.reshape(-1), reduction, ignore_index, label_smoothing)[0]
        return loss.reshape(target.shape) if reduction == "none" else loss
    logp = log_softmax(input, cd)
    w = None if weight is None else weight.view([c] + [1] * (input.dim() - cd - 1))
    if target.is_floating_point():
        t = target * (1 - label_smoothing) + label_smoothing / c if label_smoothing > 0 else target
        terms = logp * t if w is None else logp * t * w
        if reduction == "none":
            return -terms.sum(cd)
        total = -terms.sum()
        if reduction == "sum":
            return total
        # The mean over the rows (every position of [N, d1, ...]); NaN where there are none.
        return total / (input.numel() // c) if input.numel() else total * math.nan
    nll = F.nll_loss(logp, target, weight, ignore_index=ignore_index, reduction=reduction)
    if label_smoothing <= 0:
        return nll
    ignored = target == ignore_index
    smooth = -(logp.sum(cd) if w is None else (logp * w).sum(cd))
    smooth = smooth.masked_fill(ignored, 0.0)
    if reduction == "mean":
        if weight is None:
            smooth = smooth.sum() / (~ignored).sum()
        else:
            smooth = smooth.sum() / weight.gather(0, target.masked_select(~ignored).flatten()).sum()
    elif reduction == "sum":
        smooth = smooth.sum()
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / c)


@_custom_op("cross_entropy_one_pass")
def cross_entropy_one_pass_op(
    logits: Tensor, target: Tensor, reduction: str, ignore_index: int, label_smoothing: float, z_loss: float
) -> tuple[Tensor, Tensor]:
    op = "cross_entropy_one_pass"
    logits, target, n, c, red = _ce_check(op, logits, target, reduction)
    loss = _new([n] if red == 0 else [], logits)
    gx = torch.empty_like(logits)
    dev, stream, dt = _where(logits)
    _native.cross_entropy_one_pass_fwd(
        dev, stream, dt, logits.data_ptr(), target.data_ptr(), loss.data_ptr(), gx.data_ptr(),
        n, c, red, int(ignore_index), float(label_smoothing), float(z_loss),
    )  # fmt: skip
    return loss, gx


@cross_entropy_one_pass_op.register_fake
def _(logits, target, reduction, ignore_index, label_smoothing, z_loss):
    n = logits.shape[0]
    return logits.new_empty([n] if reduction == "none" else []), logits.new_empty(logits.shape)


def _ce1_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _ce1_backward(ctx, grad, _ggx):
    # The forward wrote the gradient for a loss gradient of 1: scale it by the one that came.
    (gx,) = ctx.saved_tensors
    g = grad[:, None] if grad.dim() == 1 else grad
    return gx * g, None, None, None, None, None


_autograd(cross_entropy_one_pass_op, "cross_entropy_one_pass", _ce1_backward, _ce1_setup)


def cross_entropy_one_pass(
    input: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> Tensor:
    """``F.cross_entropy`` (as :func:`cross_entropy`) plus an optional z-loss (``z_loss * lse^2``
    a row not ignored), with the logits' gradient computed in the forward, in one read of the
    logits: the backward only scales it by the loss's gradient (a no-op multiply by 1 for a
    loss that is the objective). Keeps an ``[N, C]`` gradient from the forward to the backward
    in place of the logits themselves."""
    return _call("cross_entropy_one_pass", input, target, reduction, ignore_index, label_smoothing, z_loss)[0]


# --- linear layer -------------------------------------------------------------------------------
#
# act(x @ W^T + b) on the library's GEMM: float32 on the CUDA cores (FFMA, or 3xTF32 when set),
# bfloat16 and float16 on the tensor cores with f32 accumulation, each result rounded once to the
# dtype (x, weight, bias, grad and every output share one dtype). Three ops:
# - linear: one kernel, the bias and activation fused into the GEMM's store (inference, and
#   training with identity or relu, whose backward reads y).
# - linear_train: the GEMM stores the pre-activation z, then one element-wise pass writes
#   y = act(z); returns (y, z), z saved for the backward of GELU, GELU-tanh and SiLU.
# - linear_backward: dz = act'(z) * dy, dx = dz @ W, dW = dz^T @ x, db = column sums of dz, each
#   only if asked for (an empty tensor otherwise).
# ``linear(...)`` below picks linear_train when a gradient will be needed and the activation's
# derivative needs z; the custom op `linear` called directly with gradients recomputes z in its
# backward (one GEMM more).

# The activations the GEMM's epilogue fuses (the native module says which).
LINEAR_ACTIVATIONS = tuple(_native.LINEAR_ACTIVATIONS)
_NEEDS_PRE = ("gelu", "gelu_tanh", "silu")


def _linear_act(op: str, activation: Optional[str]) -> str:
    act = "identity" if activation is None else activation
    if act not in LINEAR_ACTIVATIONS:
        raise ValueError(
            f"{NS}::{op}: activation {activation!r} is not fused into the GEMM; "
            f"supported: None, {', '.join(repr(a) for a in LINEAR_ACTIVATIONS)}"
        )
    return act


def _linear_check(
    op: str, x: Tensor, weight: Tensor, bias: Optional[Tensor]
) -> tuple[Tensor, Tensor, Optional[Tensor], int, int, int]:
    """x, weight, bias as the kernels need them, and (rows, in, out) of x viewed as [rows, in]."""
    x = _check(op, "x", x)
    weight = _check(op, "weight", weight, like=x)
    if weight.dim() != 2:
        raise ValueError(f"{NS}::{op}: weight must be [out_features, in_features], got shape {list(weight.shape)}")
    out, inp = weight.shape
    if x.dim() == 0 or x.shape[-1] != inp:
        raise ValueError(
            f"{NS}::{op}: x's last dimension must be in_features = {inp} (weight {list(weight.shape)}), "
            f"got x of shape {list(x.shape)}"
        )
    if bias is not None:
        bias = _check(op, "bias", bias, like=x)
        if tuple(bias.shape) != (out,):
            raise ValueError(f"{NS}::{op}: bias has shape {list(bias.shape)}; it must be [{out}] (out_features)")
    rows = x.numel() // inp if inp else math.prod(x.shape[:-1])
    return x, weight, bias, rows, inp, out


def _out_shape(x: Tensor, weight: Tensor) -> list:
    return list(x.shape[:-1]) + [weight.shape[0]]


@_custom_op("linear", '(Tensor x, Tensor weight, Tensor? bias=None, str activation="identity") -> Tensor')
def linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "identity") -> Tensor:
    op = "linear"
    act = _linear_act(op, activation)
    x, weight, bias, rows, inp, out = _linear_check(op, x, weight, bias)
    y = _new(_out_shape(x, weight), x)
    dev, stream, dt = _where(x)
    _native.linear_fwd(
        dev, stream, dt, ACTIVATIONS[act][0], x.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(), rows, inp,
        out,
    )  # fmt: skip
    return y


@linear_op.register_fake
def _(x, weight, bias=None, activation="identity"):
    return x.new_empty(_out_shape(x, weight))


@_custom_op(
    "linear_train", '(Tensor x, Tensor weight, Tensor? bias=None, str activation="identity") -> (Tensor, Tensor)'
)
def linear_train_op(
    x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "identity"
) -> tuple[Tensor, Tensor]:
    """``(y, pre)``: ``pre`` is the pre-activation ``x @ W^T + b`` for GELU, GELU-tanh and SiLU, an
    empty tensor for identity and relu (whose backward reads y)."""
    op = "linear_train"
    act = _linear_act(op, activation)
    if act not in _NEEDS_PRE:
        return _IMPL["linear"](x, weight, bias, act), x.new_empty([0])
    x, weight, bias, rows, inp, out = _linear_check(op, x, weight, bias)
    shape = _out_shape(x, weight)
    y, pre = _new(shape, x), _new(shape, x)
    dev, stream, dt = _where(x)
    _native.linear_train_fwd(
        dev, stream, dt, ACTIVATIONS[act][0], x.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(), pre.data_ptr(),
        rows, inp, out,
    )  # fmt: skip
    return y, pre


@linear_train_op.register_fake
def _(x, weight, bias=None, activation="identity"):
    shape = _out_shape(x, weight)
    return x.new_empty(shape), x.new_empty(shape if activation in _NEEDS_PRE else [0])


@_custom_op("linear_backward")
def linear_backward_op(
    x: Tensor,
    weight: Tensor,
    saved: Tensor,
    grad: Tensor,
    activation: str,
    x_grad: bool,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of x, weight and bias of ``act(x @ W^T + b)`` from ``grad`` (y's); ``saved`` is the
    output y for relu, the pre-activation for GELU, GELU-tanh and SiLU (unused for identity). A
    gradient not asked for is an empty tensor."""
    op = "linear_backward"
    act = _linear_act(op, activation)
    x, weight, _, rows, inp, out = _linear_check(op, x, weight, None)
    shape = _out_shape(x, weight)
    grad = _check(op, "grad", grad, like=x)
    if list(grad.shape) != shape:
        raise ValueError(f"{NS}::{op}: grad has shape {list(grad.shape)}, the output {shape}")
    dz = None
    if act != "identity":
        saved = _check(op, "saved", saved, like=x)
        if list(saved.shape) != shape:
            raise ValueError(f"{NS}::{op}: saved has shape {list(saved.shape)}, the output {shape}")
        dz = _new(shape, x)
    gx = _new(x.shape if x_grad else [0], x)
    gw = _new(weight.shape if weight_grad else [0], x)
    gb = _new([out] if bias_grad else [0], x)
    dev, stream, dt = _where(x)
    _native.linear_bwd(
        dev, stream, dt, ACTIVATIONS[act][0], x.data_ptr(), weight.data_ptr(), 0 if dz is None else saved.data_ptr(),
        grad.data_ptr(), _ptr(dz), gx.data_ptr() if x_grad else 0, gw.data_ptr() if weight_grad else 0,
        gb.data_ptr() if bias_grad else 0, rows, inp, out,
    )  # fmt: skip
    return gx, gw, gb


@linear_backward_op.register_fake
def _(x, weight, saved, grad, activation, x_grad, weight_grad, bias_grad):
    return (
        x.new_empty(x.shape if x_grad else [0]),
        x.new_empty(weight.shape if weight_grad else [0]),
        x.new_empty([weight.shape[0]] if bias_grad else [0]),
    )


def _linear_want(ctx, x, weight, bias) -> None:
    ctx.want = (x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)


def _linear_grads(ctx, x, weight, saved, grad, act):
    xg, wg, bg = ctx.want
    gx, gw, gb = _bwd(ctx, "linear_backward")(x, weight, saved, grad, act, xg, wg, bg)
    return (gx if xg else None), (gw if wg else None), (gb if bg else None)


def _linear_setup(ctx, inputs, output):
    x, weight, bias, act = inputs
    ctx.act = act
    _linear_want(ctx, x, weight, bias)
    # relu's derivative is read off the output (y > 0 exactly where x @ W^T + b > 0); GELU and
    # SiLU need the pre-activation, which this op does not keep: the backward recomputes it.
    ctx.save_for_backward(x, weight, bias, output)


def _linear_backward(ctx, grad):
    x, weight, bias, y = ctx.saved_tensors
    saved = y
    if ctx.act in _NEEDS_PRE:
        saved = _bwd(ctx, "linear")(x, weight, bias, "identity")
    return _linear_grads(ctx, x, weight, saved, grad, ctx.act) + (None,)


_autograd(linear_op, "linear", _linear_backward, _linear_setup)


def _linear_train_setup(ctx, inputs, output):
    x, weight, bias, act = inputs
    y, pre = output
    ctx.act = act
    _linear_want(ctx, x, weight, bias)
    ctx.save_for_backward(x, weight, pre if act in _NEEDS_PRE else y)
    ctx.mark_non_differentiable(pre)


def _linear_train_backward(ctx, grad, _gpre):
    x, weight, saved = ctx.saved_tensors
    return _linear_grads(ctx, x, weight, saved, grad, ctx.act) + (None,)


_autograd(linear_train_op, "linear_train", _linear_train_backward, _linear_train_setup)


def _autocast_dtype() -> Optional[torch.dtype]:
    """The dtype of an enabled CUDA autocast region, else None."""
    try:
        if not torch.is_autocast_enabled("cuda"):
            return None
        return torch.get_autocast_dtype("cuda")
    except (TypeError, AttributeError):  # PyTorch before 2.4: no device argument
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def _autocast_inputs(*ts: Optional[Tensor]) -> tuple:
    """``ts`` cast as CUDA autocast casts the inputs of ``F.linear``: inside an enabled region,
    every tensor to the region's dtype (a differentiable cast: the gradient of an f32 parameter
    comes back in f32). Unchanged outside a region, and where the kernels would not take them
    anyway (CPU tensors, float64, several devices), which then run PyTorch's own path."""
    dt = _autocast_dtype()
    first = ts[0]
    if dt is None or dt not in _DTYPE_CODES or not isinstance(first, Tensor):
        return ts
    for t in ts:
        if t is not None and not (t.is_cuda and t.device == first.device and t.dtype in _DTYPE_CODES):
            return ts
    return tuple(None if t is None else t.to(dt) for t in ts)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None) -> Tensor:
    """``act(F.linear(x, weight, bias))`` for CUDA tensors of one dtype, float32, bfloat16 or
    float16 (the last two on the tensor cores, accumulated in f32 and rounded once): ``x [...,
    in]``, ``weight [out, in]``, ``bias [out]``; ``activation`` None (identity), ``"relu"``,
    ``"gelu"``, ``"gelu_tanh"`` or ``"silu"``. Inside ``torch.autocast("cuda", dtype)`` the
    tensors are first cast to ``dtype``, as autocast casts those of ``F.linear``. Forward: one
    GEMM with the bias and activation fused into its store; when a gradient will be needed and
    the activation is GELU or SiLU, the GEMM stores the pre-activation and one element-wise pass
    applies the activation. Backward: two GEMMs (dx, dW) reading their transposes in place, a
    column sum (db, in f32) and, except for identity, one element-wise pass (dz)."""
    act = _linear_act("linear", activation)
    x, weight, bias = _autocast_inputs(x, weight, bias)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if grad and act in _NEEDS_PRE:
        return _call("linear_train", x, weight, bias, act)[0]
    return _call("linear", x, weight, bias, act)


# --- scaled dot-product attention ---------------------------------------------------------------
#
# The library's FlashAttention (bf16 and f16 on the tensor cores; f32 statistics). Two ops:
# - attention: (q, k, v) -> (out, lse), each tensor contiguous in one memory layout, ``layout`` 0
#   (``[B, H, S, D]``, "Bhsd") or 1 (``[B, S, H, D]``, "Bshd"); out in q's layout, lse f32
#   ``[B, Hq, Sq]`` (the natural log of each row's softmax denominator, -inf for a row that sees
#   no key).
# - attention_backward: (q, k, v, out, lse, grad) -> (dq, dk, dv), in the same layout.
# ``scaled_dot_product_attention`` below takes PyTorch's ``[B, H, S, D]`` tensors, picks the
# layout they already are in (a contiguous tensor is Bhsd, the ``transpose(1, 2)`` of a
# contiguous ``[B, S, H, D]`` is Bshd) and returns the output as PyTorch's shape (a transposed
# view for Bshd).

_LAYOUTS = ("bhsd", "bshd")
_CAUSAL = {"none": 0, "top_left": 1, "bottom_right": 2}
_ATTN_DTYPES = (torch.float16, torch.bfloat16)
_ATTN_SCHEMA_OPTS = "int layout, int causal, float? scale, int window_left, int window_right"


def _attn_check(op: str, q: Tensor, k: Tensor, v: Tensor, layout: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as the kernels need them (CUDA, bf16 or f16, one dtype and device, contiguous and
    16-byte aligned, copied if not) with consistent rank-4 shapes in ``layout``."""
    if layout not in (0, 1):
        raise ValueError(f"{NS}::{op}: layout must be 0 (Bhsd) or 1 (Bshd), got {layout}")
    q = _check(op, "q", q)
    if q.dtype not in _ATTN_DTYPES:
        raise TypeError(f"{NS}::{op}: q has dtype {q.dtype}; attention takes bfloat16 or float16")
    k, v = _check(op, "k", k, like=q), _check(op, "v", v, like=q)
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"{NS}::{op}: q, k and v must have rank 4 ({_LAYOUTS[layout]}) and v k's shape, got "
            f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        )
    return q, k, v


def _attn_lse_shape(q: Tensor, layout: int) -> list:
    b, x, y, _ = q.shape
    return [b, x, y] if layout == 0 else [b, y, x]


def _attn_native_opts(causal: int, scale: Optional[float], window_left: int, window_right: int) -> tuple:
    return int(causal), (None if scale is None else float(scale)), (int(window_left), int(window_right))


@_custom_op("attention", f"(Tensor q, Tensor k, Tensor v, {_ATTN_SCHEMA_OPTS}) -> (Tensor, Tensor)")
def attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: int,
    causal: int,
    scale: Optional[float],
    window_left: int,
    window_right: int,
) -> tuple[Tensor, Tensor]:
    op = "attention"
    q, k, v = _attn_check(op, q, k, v, layout)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = _new(_attn_lse_shape(q, layout), q, torch.float32)
    dev, stream, dt = _where(q)
    c, s, w = _attn_native_opts(causal, scale, window_left, window_right)
    _native.attention_fwd(
        dev, stream, dt, layout, c, s, w, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        list(q.shape), list(k.shape),
    )  # fmt: skip
    return out, lse


@attention_op.register_fake
def _(q, k, v, layout, causal, scale, window_left, window_right):
    return q.new_empty(q.shape), q.new_empty(_attn_lse_shape(q, layout), dtype=torch.float32)


@_custom_op(
    "attention_backward",
    f"(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor grad, {_ATTN_SCHEMA_OPTS}) "
    "-> (Tensor, Tensor, Tensor)",
)
def attention_backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad: Tensor,
    layout: int,
    causal: int,
    scale: Optional[float],
    window_left: int,
    window_right: int,
) -> tuple[Tensor, Tensor, Tensor]:
    op = "attention_backward"
    q, k, v = _attn_check(op, q, k, v, layout)
    out = _check(op, "out", out, like=q)
    grad = _check(op, "grad", grad, like=q)
    lse = _check(op, "lse", lse, like=q, dtype=torch.float32)
    if out.shape != q.shape or grad.shape != q.shape or list(lse.shape) != _attn_lse_shape(q, layout):
        raise ValueError(
            f"{NS}::{op}: out and grad must have q's shape {list(q.shape)} and lse {_attn_lse_shape(q, layout)}, "
            f"got {list(out.shape)}, {list(grad.shape)}, {list(lse.shape)}"
        )
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    dev, stream, dt = _where(q)
    c, s, w = _attn_native_opts(causal, scale, window_left, window_right)
    _native.attention_bwd(
        dev, stream, dt, layout, c, s, w, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        grad.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), list(q.shape), list(k.shape),
    )  # fmt: skip
    return dq, dk, dv


@attention_backward_op.register_fake
def _(q, k, v, out, lse, grad, layout, causal, scale, window_left, window_right):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attn_setup(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.opts = tuple(inputs[3:])
    ctx.mark_non_differentiable(lse)


def _attn_backward(ctx, grad, _glse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _bwd(ctx, "attention_backward")(q, k, v, out, lse, grad, *ctx.opts)
    return (dq, dk, dv) + (None,) * len(ctx.opts)


_autograd(attention_op, "attention", _attn_backward, _attn_setup)


def _is_bhsd(t: Tensor) -> bool:
    return t.is_contiguous()


def _is_bshd(t: Tensor) -> bool:
    return t.transpose(1, 2).is_contiguous()


def _sdpa_refuse(msg: str, exc=ValueError):
    raise exc(f"scaled_dot_product_attention: {msg}")


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: str = "top_left",
    window: Optional[tuple[int, int]] = None,
) -> Tensor:
    """``F.scaled_dot_product_attention`` on the library's FlashAttention kernels (forward and
    backward), for CUDA tensors of bfloat16 or float16.

    Takes what PyTorch's takes, of shapes ``[B, H, S, D]`` (or ``[H, S, D]``, or more leading
    dimensions): ``query [..., Hq, Sq, D]``, ``key`` and ``value [..., Hkv, Sk, D]``;
    ``is_causal``: PyTorch's mask (query ``i`` sees keys ``j <= i``, the diagonal from the top
    left, also when ``Sq != Sk``); ``scale``: the factor of ``Q K^T``, ``1/sqrt(D)`` if None;
    ``enable_gqa``: grouped-query attention, ``Hq`` a multiple of ``Hkv`` (query head ``h`` uses
    key/value head ``h // (Hq // Hkv)``, as PyTorch's). Returns ``[..., Hq, Sq, D]``; autograd
    gives the gradients of query, key and value.

    Memory layout, without copies where possible: a contiguous ``[B, H, S, D]`` tensor is read in
    place, and so is one that is the ``transpose(1, 2)`` of a contiguous ``[B, S, H, D]`` (what a
    projection's output ``.view(B, S, H, D).transpose(1, 2)`` gives); the kernels then run in that
    layout, and the output is the same kind of view (``[B, H, S, D]`` whose memory is ``[B, S, H,
    D]``). Whichever layout more of the three inputs have is used; any other tensor (another
    view, a slice of a fused QKV projection, a misaligned one) is copied into it first.

    Beyond PyTorch's arguments (keyword-only): ``causal_alignment="bottom_right"`` with
    ``is_causal`` puts the diagonal at the bottom right (query ``i`` sees keys ``j <= i + Sk -
    Sq``, FlashAttention's, as with a KV cache); ``window=(left, right)`` a sliding window: query
    ``i`` sees keys ``c(i) - left <= j <= c(i) + right`` (``c(i)`` the diagonal; ``right`` is cut to
    0 under ``is_causal``; a negative side is unbounded). A query that sees no key gets zeros
    (PyTorch's gives NaN).

    Refused (with an error saying so): ``attn_mask``, ``dropout_p != 0``, dtypes other than
    bfloat16 and float16 (TypeError), CPU tensors, head dims that are not a multiple of 8 from 8
    to 256, a ``value`` whose head dim differs from ``key``'s, and different head counts without
    ``enable_gqa`` (as PyTorch).
    """
    if attn_mask is not None:
        _sdpa_refuse("attn_mask is not supported (only is_causal, and the window); pass attn_mask=None")
    if dropout_p != 0.0:
        _sdpa_refuse(f"dropout_p={dropout_p} is not supported (attention dropout is not implemented); pass 0.0")
    if causal_alignment not in ("top_left", "bottom_right"):
        _sdpa_refuse(f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            _sdpa_refuse(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dtype not in _ATTN_DTYPES:
            _sdpa_refuse(f"{name} has dtype {t.dtype}; the kernels take bfloat16 or float16 (cast first)", TypeError)
        if t.device.type != "cuda":
            _sdpa_refuse(f"{name} is on {t.device}; the kernels run on CUDA tensors only{_cuda_note()}")
        if t.dim() < 3:
            _sdpa_refuse(f"{name} must be [..., heads, seq, head_dim] (rank 3 or more), got shape {list(t.shape)}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        dts = f"{query.dtype}, {key.dtype}, {value.dtype}"
        _sdpa_refuse(f"query, key and value must have one dtype, got {dts}", TypeError)
    if key.device != query.device or value.device != query.device:
        _sdpa_refuse(f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}")
    if query.dim() != key.dim() or key.shape[:-1] != value.shape[:-1] or query.shape[:-3] != key.shape[:-3]:
        _sdpa_refuse(
            f"query [..., Hq, Sq, D], key and value [..., Hkv, Sk, D] must share their leading dimensions, "
            f"and key and value their heads and length, got {list(query.shape)}, {list(key.shape)}, {list(value.shape)}"
        )
    d = query.shape[-1]
    if key.shape[-1] != d or value.shape[-1] != d:
        _sdpa_refuse(
            f"query, key and value must have one head dim (a value head dim of its own is not supported), got "
            f"{query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]}"
        )
    if d % 8 or not 8 <= d <= 256:
        _sdpa_refuse(f"the head dim must be a multiple of 8 from 8 to 256, got {d}")
    hq, hkv = query.shape[-3], key.shape[-3]
    if hq != hkv:
        if not enable_gqa:
            _sdpa_refuse(
                f"query has {hq} heads and key/value {hkv}: grouped-query attention needs enable_gqa=True "
                "(as PyTorch's)"
            )
        if hkv == 0 or hq % hkv:
            _sdpa_refuse(f"with enable_gqa the query heads ({hq}) must be a multiple of the key/value heads ({hkv})")
    causal = _CAUSAL[causal_alignment] if is_causal else 0
    # -1: an unbounded side (both: no window).
    wl, wr = (-1, -1) if window is None else (max(int(window[0]), -1), max(int(window[1]), -1))

    lead = query.shape[:-3]
    if query.dim() == 3:
        q4, k4, v4 = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    elif query.dim() == 4:
        q4, k4, v4 = query, key, value
    else:
        q4, k4, v4 = (t.reshape(-1, *t.shape[-3:]) for t in (query, key, value))
    ts = (q4, k4, v4)
    # The layout more of the inputs already have (a tensor with one head or one row is both;
    # contiguous first on a tie: PyTorch's own).
    layout = 1 if sum(_is_bshd(t) for t in ts) > sum(_is_bhsd(t) for t in ts) else 0
    if layout == 1:
        q4, k4, v4 = (t.transpose(1, 2) for t in ts)  # contiguous [B, S, H, D] where they were Bshd
    out = _call("attention", q4, k4, v4, layout, causal, scale, wl, wr)[0]
    if layout == 1:
        out = out.transpose(1, 2)
    if query.dim() == 3:
        return out.squeeze(0)
    if query.dim() > 4:
        return out.unflatten(0, lead)
    return out


# --- rotary position embedding ------------------------------------------------------------------
#
# rope: (x, cos, sin) -> x rotated, x contiguous rank 4 in ``layout`` 0 (``[B, H, S, D]``) or 1
# (``[B, S, H, D]``), cos and sin float32 ``[max_pos, R / 2]`` (R, the rotary dimension, is twice
# their width: the first R of D elements rotate, the rest pass through). rope_backward: the same
# with the output's gradient, rotated by the opposite angle.

_ROPE_LAYOUTS = {"bhsd": 0, "bshd": 1}
_ROPE_SCHEMA = "(Tensor x, Tensor cos, Tensor sin, int layout, bool interleaved, int offset) -> Tensor"


def _rope_impl(op: str, backward: bool, x: Tensor, cos: Tensor, sin: Tensor, layout, interleaved, offset) -> Tensor:
    x = _check(op, "x", x)
    cos = _check(op, "cos", cos, like=x, dtype=torch.float32)
    sin = _check(op, "sin", sin, like=x, dtype=torch.float32)
    if x.dim() != 4 or cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(
            f"{NS}::{op}: x must have rank 4 and cos and sin one shape [max_pos, rotary_dim / 2], got "
            f"{list(x.shape)}, {list(cos.shape)}, {list(sin.shape)}"
        )
    if offset < 0:
        raise ValueError(f"{NS}::{op}: offset must be non-negative, got {offset}")
    y = torch.empty_like(x)
    dev, stream, dt = _where(x)
    _native.rope(
        dev, stream, dt, layout, interleaved, offset, backward, x.data_ptr(), y.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), list(x.shape), cos.shape[0], cos.shape[1],
    )  # fmt: skip
    return y


@_custom_op("rope", _ROPE_SCHEMA)
def rope_op(x: Tensor, cos: Tensor, sin: Tensor, layout: int, interleaved: bool, offset: int) -> Tensor:
    return _rope_impl("rope", False, x, cos, sin, layout, interleaved, offset)


@_custom_op("rope_backward", _ROPE_SCHEMA.replace("Tensor x", "Tensor grad"))
def rope_backward_op(grad: Tensor, cos: Tensor, sin: Tensor, layout: int, interleaved: bool, offset: int) -> Tensor:
    return _rope_impl("rope_backward", True, grad, cos, sin, layout, interleaved, offset)


@rope_op.register_fake
def _(x, cos, sin, layout, interleaved, offset):
    return x.new_empty(x.shape)


@rope_backward_op.register_fake
def _(grad, cos, sin, layout, interleaved, offset):
    return grad.new_empty(grad.shape)


def _rope_setup(ctx, inputs, output):
    _, cos, sin, layout, interleaved, offset = inputs
    if getattr(cos, "requires_grad", False) or getattr(sin, "requires_grad", False):
        # Learned tables would need their own gradient, which this op does not compute.
        ctx.table_grad = True
    ctx.save_for_backward(cos, sin)
    ctx.opts = (layout, interleaved, offset)


def _rope_backward(ctx, grad):
    if getattr(ctx, "table_grad", False):
        raise NotImplementedError(f"{NS}::rope: no gradient for cos and sin (they must not require grad)")
    cos, sin = ctx.saved_tensors
    return _bwd(ctx, "rope_backward")(grad, cos, sin, *ctx.opts), None, None, None, None, None


_autograd(rope_op, "rope", _rope_backward, _rope_setup)


def rope(
    x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "bhsd", interleaved: bool = False, offset: int = 0
) -> Tensor:
    """Rotary position embedding of ``x`` (``[B, H, S, D]`` for ``layout="bhsd"``, ``[B, S, H, D]``
    for ``"bshd"``; float32, float16 or bfloat16) in one kernel, with autograd.

    ``cos``, ``sin``: float32 ``[max_pos, R / 2]``, the cosine and sine of pair ``i``'s angle at
    position ``p`` (``rope_tables``); the first ``R`` elements of each row rotate, the rest pass
    through. Row ``s`` of the sequence is at position ``offset + s`` (a KV cache's length), which
    must be below ``max_pos``. Pairs ``(i, i + R / 2)`` (GPT-NeoX, LLaMA, Hugging Face's
    ``x * cos + rotate_half(x) * sin`` with the tables repeated twice), or ``(2 i, 2 i + 1)`` with
    ``interleaved=True`` (GPT-J). Math in f32, the result rounded once to x's dtype."""
    if layout not in _ROPE_LAYOUTS:
        raise ValueError(f"{NS}::rope: layout must be 'bhsd' or 'bshd', got {layout!r}")
    return _call("rope", x, cos, sin, _ROPE_LAYOUTS[layout], bool(interleaved), int(offset))


def rope_tables(max_pos: int, rotary_dim: int, base: float = 10000.0, device=None) -> tuple[Tensor, Tensor]:
    """The tables of ``rope``: ``cos`` and ``sin`` float32 ``[max_pos, rotary_dim / 2]``, pair ``i``
    turning by ``p * base ** (-2 i / rotary_dim)`` at position ``p`` (LLaMA's), computed in float64
    and rounded once."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"{NS}::rope_tables: rotary_dim must be even and at least 2, got {rotary_dim}")
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    cos, sin = angle.cos().float(), angle.sin().float()
    return (cos, sin) if device is None else (cos.to(device), sin.to(device))


# --- embedding ----------------------------------------------------------------------------------
#
# embedding: (indices int64 of any shape, weight [V, D], padding_idx) -> weight's rows, shape
# indices.shape + [D], a copy. embedding_backward: (grad, indices, num_weights, padding_idx) ->
# [num_weights, D], each row the sum of the gradient rows of its occurrences, deterministic (a
# sort of the indices, then f32 sums in increasing position). padding_idx as aten's: a row in
# [0, V) that gets no gradient, or -1 for none. An index outside [0, V) cannot raise PyTorch's
# device-side assertion here: the forward gives a row of zeros and the backward drops it.


def _emb_indices(op: str, indices: Tensor, like: Tensor) -> Tensor:
    return _check(op, "indices", indices, like=like, dtype=torch.int64)


@_custom_op("embedding", "(Tensor indices, Tensor weight, int padding_idx=-1) -> Tensor")
def embedding_op(indices: Tensor, weight: Tensor, padding_idx: int = -1) -> Tensor:
    op = "embedding"
    weight = _check(op, "weight", weight)
    idx = _emb_indices(op, indices, weight)
    if weight.dim() != 2:
        raise ValueError(f"{NS}::{op}: weight must be [V, D], got {list(weight.shape)}")
    v, d = weight.shape
    out = _new(list(idx.shape) + [d], weight)
    if out.numel():
        dev, stream, dt = _where(weight)
        _native.embedding_fwd(dev, stream, dt, weight.data_ptr(), idx.data_ptr(), out.data_ptr(), v, d, idx.numel())
    return out


@embedding_op.register_fake
def _(indices, weight, padding_idx=-1):
    return weight.new_empty(list(indices.shape) + [weight.shape[1]])


@_custom_op("embedding_backward", "(Tensor grad, Tensor indices, int num_weights, int padding_idx=-1) -> Tensor")
def embedding_backward_op(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int = -1) -> Tensor:
    op = "embedding_backward"
    grad = _check(op, "grad", grad)
    idx = _emb_indices(op, indices, grad)
    if grad.dim() != idx.dim() + 1 or grad.shape[:-1] != idx.shape:
        raise ValueError(
            f"{NS}::{op}: grad must be the indices' shape followed by D, got {list(grad.shape)} for indices "
            f"{list(idx.shape)}"
        )
    d = grad.shape[-1]
    if idx.numel() == 0:
        return grad.new_zeros([num_weights, d])
    gw = _new([num_weights, d], grad)
    if gw.numel():
        dev, stream, dt = _where(grad)
        pad = int(padding_idx) if padding_idx >= 0 else None
        _native.embedding_bwd(
            dev, stream, dt, grad.data_ptr(), idx.data_ptr(), gw.data_ptr(), num_weights, d, idx.numel(), pad
        )
    return gw


@embedding_backward_op.register_fake
def _(grad, indices, num_weights, padding_idx=-1):
    return grad.new_empty([num_weights, grad.shape[-1]])


def _emb_setup(ctx, inputs, output):
    indices, weight, padding_idx = inputs
    ctx.save_for_backward(indices)
    ctx.opts = (weight.shape[0], padding_idx)


def _emb_backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    return None, _bwd(ctx, "embedding_backward")(grad, indices, *ctx.opts), None


_autograd(embedding_op, "embedding", _emb_backward, _emb_setup)


def embedding(input: Tensor, weight: Tensor, padding_idx: Optional[int] = None) -> Tensor:
    """``F.embedding(input, weight, padding_idx)``: the rows of ``weight`` (``[V, D]``, float32,
    float16 or bfloat16) for the int64 indices ``input`` (any shape), with autograd; the output has
    shape ``input.shape + [D]`` and the weight's bits.

    ``padding_idx`` (in ``[-V, V)``, negative from the end) gets no gradient, as PyTorch's. The
    backward is deterministic: each row's gradient is the f32 sum of its occurrences' gradient
    rows in increasing position, rounded once. An index outside ``[0, V)`` is not checked (that
    would wait for the GPU): its output row is zeros and its gradient goes nowhere, where
    PyTorch stops with a device-side assertion. No ``max_norm``, ``scale_grad_by_freq`` or
    ``sparse`` (``kernels_torch.nn.Embedding`` runs PyTorch's for those)."""
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"{NS}::embedding: weight must be a [V, D] tensor, got {getattr(weight, 'shape', weight)}")
    v = weight.shape[0]
    if padding_idx is None:
        p = -1
    elif -v <= padding_idx < v:
        p = padding_idx + v if padding_idx < 0 else padding_idx
    else:
        raise ValueError(f"{NS}::embedding: padding_idx must be in [-{v}, {v}), got {padding_idx}")
    # The indices lead: a plain tensor (the weight is usually a Parameter) takes the eager path.
    return _call("embedding", input, weight, int(p))
