"""``torch.nn`` modules running the kernels on CUDA tensors of f32, f16 and bf16, and PyTorch's own
implementation otherwise (CPU tensors, float64, and the cases listed per module).

Most are subclasses of the PyTorch module they replace (same constructor, parameters and
``state_dict``), so a model switches with a changed import. ``FusedBiasAct`` is new:
``act(x * scale + bias)`` in one kernel; so is ``RotaryEmbedding`` (PyTorch has no such module).
``AddLayerNorm`` and ``AddRMSNorm`` are ``LayerNorm`` and ``RMSNorm`` (same parameters and
``state_dict``) whose ``forward(x, residual)`` adds the residual first and returns ``(y, h)``.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _conv, _ops
from ._ops import _DTYPE_CODES

__all__ = [
    "AdaptiveAvgPool2d",
    "AddLayerNorm",
    "AddRMSNorm",
    "AvgPool2d",
    "BatchNorm2d",
    "Conv2d",
    "ConvBNReLU",
    "CrossEntropyLoss",
    "Embedding",
    "FusedBiasAct",
    "GELU",
    "GeGLU",
    "LayerNorm",
    "Linear",
    "LogSoftmax",
    "MaxPool2d",
    "ReGLU",
    "RMSNorm",
    "RotaryEmbedding",
    "Softmax",
    "SwiGLU",
    "Swish",
]


def _ours(*ts: Optional[Tensor]) -> bool:
    """Whether the kernels take these tensors: all on one CUDA device, of one supported dtype
    (None entries are absent parameters)."""
    first = ts[0]
    if not (first.is_cuda and first.dtype in _DTYPE_CODES):
        return False
    return all(t is None or (t.device == first.device and t.dtype == first.dtype) for t in ts[1:])


def _activation_module(name: str, module: str, params: tuple):
    """The ``torch.nn`` module ``module`` running activation ``name`` of the op table: a subclass
    with the same constructor, attributes and ``state_dict``; ``inplace=True`` runs PyTorch's
    in-place op."""
    base = getattr(torch.nn, module)
    fn = getattr(_ops, name)
    attrs = tuple(p for p, _ in params)  # PyTorch's modules keep their parameters by these names

    def forward(self, x: Tensor) -> Tensor:
        if _ours(x) and not getattr(self, "inplace", False):
            return fn(x, *(getattr(self, a) for a in attrs))
        return base.forward(self, x)

    doc = f"``torch.nn.{module}`` running ``kernels_torch.{name}`` on CUDA tensors of f32, f16 and bf16."
    return type(module, (base,), {"forward": forward, "__doc__": doc, "__module__": __name__})


# One module per activation of the op table that stands for a ``torch.nn`` module (``GELU``, below,
# takes PyTorch's ``approximate``).
_MODULES = {
    row[6]: _activation_module(name, row[6], tuple(row[2]))
    for name, row in _ops.UNARY_OPS.items()
    if row[1] and row[6] and name not in ("gelu", "gelu_tanh")
}
globals().update(_MODULES)
__all__ += list(_MODULES)


class GELU(torch.nn.GELU):
    """``torch.nn.GELU(approximate="none" | "tanh")``."""

    def forward(self, x: Tensor) -> Tensor:
        return _ops.gelu(x, self.approximate) if _ours(x) else super().forward(x)


Swish = SiLU  # noqa: F821 (defined above from the table)

_TORCH = {}  # activation name -> PyTorch's version, from the op table


def _torch_activation(x: Tensor, act: str, a: float, b: float) -> Tensor:
    """PyTorch's own version of each activation of ``_ops.ACTIVATIONS`` (the table's ``torch``)."""
    if act not in _TORCH:
        _TORCH[act] = eval(_ops.UNARY_OPS[act][5], {"torch": torch, "F": F})  # the table's own text
    params = (a, b)[: len(_ops.ACTIVATIONS[act][1])]
    return _TORCH[act](x, *params)


class FusedBiasAct(torch.nn.Module):
    """``act(x * scale + bias)`` over the last dimension (``features``), in one kernel forward and
    one pass plus a column sum backward, where PyTorch runs three kernels each way.

    ``bias`` is a parameter (zeros at first); ``scale`` too if ``scale=True`` (ones at first),
    else a constant 1. ``activation`` is a name of ``kernels_torch.ACTIVATIONS``; ``params`` its
    parameters (``negative_slope``; ``beta, threshold``), PyTorch's defaults if omitted.
    """

    def __init__(
        self,
        features: int,
        activation: str = "gelu",
        *params: float,
        scale: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if activation not in _ops.ACTIVATIONS:
            raise ValueError(f"FusedBiasAct: unknown activation {activation!r}; known: {', '.join(_ops.ACTIVATIONS)}")
        defaults = [d for _, d in _ops.ACTIVATIONS[activation][1]]
        if len(params) > len(defaults):
            raise ValueError(f"FusedBiasAct: {activation} takes {len(defaults)} parameters, got {len(params)}")
        self.features = features
        self.activation = activation
        self.params = tuple(float(p) for p in params) + tuple(defaults[len(params) :])
        kw = {"device": device, "dtype": dtype}
        self.bias = torch.nn.Parameter(torch.zeros(features, **kw))
        if scale:
            self.scale = torch.nn.Parameter(torch.ones(features, **kw))
        else:
            self.register_buffer("scale", torch.ones(features, **kw), persistent=False)

    def extra_repr(self) -> str:
        p = f", params={self.params}" if self.params else ""
        return f"{self.features}, activation={self.activation!r}{p}, scale={isinstance(self.scale, torch.nn.Parameter)}"

    def forward(self, x: Tensor) -> Tensor:
        if _ours(x, self.scale, self.bias):
            return _ops.scale_bias_act(x, self.scale, self.bias, self.activation, *self.params)
        a, b = _ops._act_params(self.params)
        return _torch_activation(x * self.scale + self.bias, self.activation, a, b)


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` followed by an optional activation, ``act(x @ W^T + b)``: the bias and
    the activation (``None``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``) are fused into
    the GEMM's store. Same constructor (``activation`` is keyword-only), parameters and
    ``state_dict`` as ``torch.nn.Linear``.

    CUDA tensors of float32 (the f32 GEMM), bfloat16 or float16 (the tensor cores, f32
    accumulation) run the kernels, forward and backward. Inside ``torch.autocast("cuda", dtype)``
    the input and parameters are cast to ``dtype`` first, as autocast casts those of
    ``F.linear`` (the gradients of f32 parameters come back in f32), and the kernels run in that
    dtype. float64, CPU tensors and mixed dtypes outside autocast run PyTorch's ``F.linear`` and
    activation.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        activation: Optional[str] = None,
    ) -> None:
        act = _ops._linear_act("Linear", activation)  # refused before any allocation
        super().__init__(in_features, out_features, bias, device, dtype)
        self.activation = act

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"

    def forward(self, x: Tensor) -> Tensor:
        ts = _ops._autocast_inputs(x, self.weight, self.bias)
        if _ours(*ts):
            return _ops.linear(*ts, self.activation)
        return _torch_activation(F.linear(x, self.weight, self.bias), self.activation, 0.0, 0.0)


class Softmax(torch.nn.Softmax):
    """``torch.nn.Softmax(dim)``; along a dimension other than the last, through a copy;
    ``dim=None`` (PyTorch's legacy implicit choice) runs PyTorch's."""

    def forward(self, x: Tensor) -> Tensor:
        return _ops.softmax(x, self.dim) if self.dim is not None and _ours(x) else super().forward(x)


class LogSoftmax(torch.nn.LogSoftmax):
    """``torch.nn.LogSoftmax(dim)``, as ``Softmax``."""

    def forward(self, x: Tensor) -> Tensor:
        return _ops.log_softmax(x, self.dim) if self.dim is not None and _ours(x) else super().forward(x)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm``; PyTorch's when the parameters' dtype or device differ from the
    input's (e.g. f32 parameters with a bf16 input under autocast)."""

    def forward(self, x: Tensor) -> Tensor:
        if _ours(x, self.weight, self.bias):
            return _ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return super().forward(x)


if hasattr(torch.nn, "RMSNorm"):  # PyTorch 2.4+

    class RMSNorm(torch.nn.RMSNorm):
        """``torch.nn.RMSNorm``; PyTorch's when the weight's dtype or device differ from the
        input's."""

        def forward(self, x: Tensor) -> Tensor:
            if _ours(x, self.weight):
                return _ops.rms_norm(x, self.normalized_shape, self.weight, self.eps)
            return super().forward(x)


class AddLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` of ``h = x + residual``: ``forward(x, residual)`` returns ``(y, h)``,
    ``h`` the next residual, in one kernel each way (``kernels_torch.add_layer_norm``); PyTorch's
    composition when the tensors' dtypes or devices differ."""

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        if _ours(x, residual, self.weight, self.bias):
            return _ops.add_layer_norm(x, residual, self.normalized_shape, self.weight, self.bias, self.eps)
        h = x + residual
        return super().forward(h), h


if hasattr(torch.nn, "RMSNorm"):  # PyTorch 2.4+

    class AddRMSNorm(torch.nn.RMSNorm):
        """``torch.nn.RMSNorm`` of ``h = x + residual``: ``forward(x, residual)`` returns ``(y, h)``
        in one kernel each way (``kernels_torch.add_rms_norm``); PyTorch's composition when the
        tensors' dtypes or devices differ."""

        def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
            if _ours(x, residual, self.weight):
                return _ops.add_rms_norm(x, residual, self.normalized_shape, self.weight, self.eps)
            h = x + residual
            return super().forward(h), h


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` on the kernels for CUDA logits of f32, f16 and bf16 with
    their target (and weight) on the same device: every shape and target form of
    ``kernels_torch.cross_entropy``; PyTorch's elsewhere."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        if (
            _ours(input)
            and input.dim() > 0
            and target.device == input.device
            and (target.dtype == torch.int64 or target.dtype == input.dtype)
            and (self.weight is None or self.weight.device == input.device)
        ):
            return _ops.cross_entropy(
                input, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing
            )
        return super().forward(input, target)


class _Gated(torch.nn.Module):
    """``act(a) * b`` of the halves ``a, b = x.chunk(2, dim=-1)`` of ``x: [.., 2F]`` (output
    ``[.., F]``), one kernel forward and one backward on CUDA tensors of f32, f16 and bf16;
    PyTorch's composition elsewhere. No parameters: the projections stay ``Linear`` layers."""

    _act = "silu"

    def _torch(self, a: Tensor) -> Tensor:
        return F.silu(a)

    def forward(self, x: Tensor) -> Tensor:
        if _ours(x):
            return _ops.glu_act(x, self._act)
        a, b = x.chunk(2, dim=-1)
        return self._torch(a) * b


class SwiGLU(_Gated):
    """SwiGLU: ``F.silu(a) * b``."""


class GeGLU(_Gated):
    """GeGLU: ``F.gelu(a, approximate=approximate) * b``."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GeGLU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate
        self._act = "gelu" if approximate == "none" else "gelu_tanh"

    def _torch(self, a: Tensor) -> Tensor:
        return F.gelu(a, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class ReGLU(_Gated):
    """ReGLU: ``F.relu(a) * b``."""

    _act = "relu"

    def _torch(self, a: Tensor) -> Tensor:
        return F.relu(a)


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope_reference(
    x: Tensor, cos: Tensor, sin: Tensor, layout: str = "bhsd", interleaved: bool = False, offset: int = 0
) -> Tensor:
    """``kernels_torch.rope`` composed of PyTorch ops (the fallback of ``RotaryEmbedding``, and
    the eager baseline): Hugging Face's ``x * cos + rotate_half(x) * sin``, or its interleaved form,
    computed in float32 (float64 for float64 x) and rounded to x's dtype."""
    s = x.shape[2] if layout == "bhsd" else x.shape[1]
    r = 2 * cos.shape[-1]
    ct = torch.promote_types(x.dtype, torch.float32)
    c, si = cos[offset : offset + s].to(x.device, ct), sin[offset : offset + s].to(x.device, ct)
    if interleaved:
        c, si = c.repeat_interleave(2, dim=-1), si.repeat_interleave(2, dim=-1)
    else:
        c, si = torch.cat((c, c), dim=-1), torch.cat((si, si), dim=-1)
    if layout == "bshd":
        c, si = c[:, None, :], si[:, None, :]  # [S, 1, R] against [B, S, H, R]
    xr, rest = x[..., :r].to(ct), x[..., r:]
    if interleaved:
        pairs = xr.unflatten(-1, (-1, 2))
        rot = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        rot = _rotate_half(xr)
    y = (xr * c + rot * si).to(x.dtype)
    return torch.cat((y, rest), dim=-1) if rest.shape[-1] else y


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding of queries or keys: ``forward(x, offset=0)`` rotates ``x``
    (``[B, H, S, D]``, or ``[B, S, H, D]`` with ``layout="bshd"``) at positions ``offset`` to
    ``offset + S - 1``, by ``kernels_torch.rope`` on CUDA tensors of f32, f16 and bf16 and by the
    same formula in PyTorch ops otherwise. ``dim`` is the rotary dimension (the first ``dim`` of
    ``D`` rotate), ``max_pos`` the most positions, ``base`` LLaMA's (10000; 500000 for LLaMA 3).
    The tables are float32 buffers (``cos``, ``sin``, ``[max_pos, dim / 2]``), not saved in the
    ``state_dict``."""

    def __init__(
        self,
        dim: int,
        max_pos: int,
        base: float = 10000.0,
        *,
        interleaved: bool = False,
        layout: str = "bhsd",
        device=None,
    ) -> None:
        super().__init__()
        if layout not in ("bhsd", "bshd"):
            raise ValueError(f"RotaryEmbedding: layout must be 'bhsd' or 'bshd', got {layout!r}")
        cos, sin = _ops.rope_tables(max_pos, dim, base, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.dim, self.max_pos, self.base = dim, max_pos, base
        self.interleaved, self.layout = interleaved, layout

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, max_pos={self.max_pos}, base={self.base}, interleaved={self.interleaved}, "
            f"layout={self.layout!r}"
        )

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        if _ours(x) and self.cos.device == x.device:
            return _ops.rope(x, self.cos, self.sin, layout=self.layout, interleaved=self.interleaved, offset=offset)
        return rope_reference(x, self.cos, self.sin, self.layout, self.interleaved, offset)


class Embedding(torch.nn.Embedding):
    """``torch.nn.Embedding`` (same constructor, ``weight`` and ``state_dict``) running
    ``kernels_torch.embedding`` for int64 indices into a CUDA weight of f32, f16 or bf16, with the
    deterministic backward; PyTorch's own implementation for CPU tensors, other index dtypes,
    ``max_norm``, ``scale_grad_by_freq`` and ``sparse=True``. Indices outside ``[0, V)`` are not
    checked on the kernels' path (see ``kernels_torch.embedding``)."""

    def forward(self, input: Tensor) -> Tensor:
        w = self.weight
        if (
            _ours(w)
            and isinstance(input, Tensor)
            and input.device == w.device
            and input.dtype == torch.int64
            and self.max_norm is None
            and not self.scale_grad_by_freq
            and not self.sparse
        ):
            return _ops.embedding(input, w, self.padding_idx)
        return super().forward(input)


# --- convolution, batch norm, pooling -----------------------------------------------------------


def _conv_padding(conv: torch.nn.Conv2d):
    """The conv's padding as the kernels take it, or None where they do not apply (a padding mode
    other than zeros, ``"same"`` that pads one side more)."""
    if conv.padding_mode != "zeros":
        return None
    p = conv.padding
    if p == "valid":
        return (0, 0)
    if p == "same":
        return _conv.same_padding(conv.kernel_size, conv.dilation)
    return tuple(p)


class Conv2d(torch.nn.Conv2d):
    """``torch.nn.Conv2d`` (same constructor, parameters and ``state_dict``) running
    ``kernels_torch.conv2d`` on CUDA tensors of float32, bfloat16 or float16, forward and backward;
    a ``channels_last`` input (and model: ``model.to(memory_format=torch.channels_last)`` makes the
    weights so too) runs the NHWC kernels in place. Inside ``torch.autocast("cuda", dtype)`` the
    input and parameters are cast to ``dtype`` first, as autocast casts those of ``F.conv2d``.
    PyTorch's own for CPU tensors, float64, mixed dtypes outside autocast, ``padding_mode`` other
    than ``"zeros"`` and a ``"same"`` padding that pads one side more."""

    def forward(self, x: Tensor) -> Tensor:
        padding = _conv_padding(self)
        if padding is not None and isinstance(x, Tensor) and x.dim() in (3, 4):
            ts = _ops._autocast_inputs(x, self.weight, self.bias)
            if _ours(*ts):
                return _conv.conv2d(*ts, self.stride, padding, self.dilation, self.groups)
        return super().forward(x)


def _bn_ours(x: Tensor, *params: Optional[Tensor]) -> bool:
    """Whether the kernels take a batch norm of ``x`` with these per-channel tensors: x 4-d on
    CUDA of a supported dtype, every given parameter float32 on x's device."""
    if not (isinstance(x, Tensor) and x.dim() == 4 and x.is_cuda and x.dtype in _DTYPE_CODES):
        return False
    return all(p is None or (p.dtype == torch.float32 and p.device == x.device) for p in params)


class BatchNorm2d(torch.nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` (same constructor, parameters, buffers and ``state_dict``, the same
    running-statistics update, ``momentum=None`` included) running ``kernels_torch.batch_norm``
    on CUDA inputs of float32, bfloat16 or float16 whose parameters and running statistics are
    float32 (a float32 module, or any under ``torch.autocast``); PyTorch's own otherwise (CPU
    tensors, float64, a module converted to half precision). Training with ``momentum=None``
    reads the batch count back to the host, so under CUDA graph capture it raises a RuntimeError
    (before any work is issued) where PyTorch's module breaks the capture."""

    def forward(self, x: Tensor) -> Tensor:
        if not _bn_ours(x, self.weight, self.bias, self.running_mean, self.running_var):
            return super().forward(x)
        self._check_input_dim(x)
        # torch.nn.modules.batchnorm._BatchNorm.forward, with the kernels' batch norm.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            if self.momentum is None and torch.cuda.is_current_stream_capturing():
                # Refused before any work is issued, so the capture stays usable.
                raise RuntimeError(
                    "BatchNorm2d(momentum=None) cannot be captured in a CUDA graph: its factor "
                    "1 / num_batches_tracked is read back to the host each step (as in PyTorch's "
                    "BatchNorm2d); give the module a float momentum to capture it"
                )
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        return _conv.batch_norm(
            x,
            self.running_mean if keep else None,
            self.running_var if keep else None,
            self.weight,
            self.bias,
            bn_training,
            factor,
            self.eps,
        )


def _pool_ours(x: Tensor, padding, kernel_size) -> bool:
    if not (isinstance(x, Tensor) and x.dim() in (3, 4) and _ours(x)):
        return False
    (ph, pw), (kh, kw) = _conv._pair("pool", "padding", padding), _conv._pair("pool", "kernel_size", kernel_size)
    return 0 <= ph <= kh // 2 and 0 <= pw <= kw // 2


class MaxPool2d(torch.nn.MaxPool2d):
    """``torch.nn.MaxPool2d`` running ``kernels_torch.max_pool2d`` on CUDA tensors of float32,
    bfloat16 or float16 (``return_indices`` included); PyTorch's for ``dilation`` other than 1,
    CPU tensors and float64."""

    def forward(self, x: Tensor):
        if _conv._pair("MaxPool2d", "dilation", self.dilation) == (1, 1) and _pool_ours(
            x, self.padding, self.kernel_size
        ):
            return _conv.max_pool2d(
                x, self.kernel_size, self.stride, self.padding, 1, self.ceil_mode, self.return_indices
            )
        return super().forward(x)


class AvgPool2d(torch.nn.AvgPool2d):
    """``torch.nn.AvgPool2d`` running ``kernels_torch.avg_pool2d`` on CUDA tensors of float32,
    bfloat16 or float16; PyTorch's for ``divisor_override``, CPU tensors and float64."""

    def forward(self, x: Tensor) -> Tensor:
        if self.divisor_override is None and _pool_ours(x, self.padding, self.kernel_size):
            return _conv.avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                                    self.count_include_pad)  # fmt: skip
        return super().forward(x)


class AdaptiveAvgPool2d(torch.nn.AdaptiveAvgPool2d):
    """``torch.nn.AdaptiveAvgPool2d``: to 1 x 1 on the kernels' global average pool (CUDA tensors of
    float32, bfloat16 or float16); every other output size, and other tensors, PyTorch's."""

    def forward(self, x: Tensor) -> Tensor:
        return _conv.adaptive_avg_pool2d(x, self.output_size)


class ConvBNReLU(torch.nn.Sequential):
    """``relu(bn(conv(x)))``: a ``Conv2d``, a ``BatchNorm2d`` and a ``ReLU`` of this module (as
    children ``0``, ``1``, ``2``, so the ``state_dict`` is that of ``torch.nn.Sequential(Conv2d,
    BatchNorm2d, ReLU)`` and of ``torch.ao.nn.intrinsic.ConvBnReLU2d``).

    Training: the three modules in turn (the kernels' convolution, batch norm with its
    running-statistics update, relu). Evaluation: the batch norm folded into the convolution's
    weight and bias (``kernels_torch.fold_batch_norm``: one convolution, then the relu), where
    the convolution's kernels apply and the batch norm keeps running statistics; otherwise the
    three modules in turn. The constructor takes ``Conv2d``'s arguments (``bias`` defaults to False,
    as before a batch norm) and ``BatchNorm2d``'s ``eps`` and ``momentum``; ``from_modules(conv,
    bn)`` wraps existing ones (their parameters are shared, not copied)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = False,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        device=None,
        dtype=None,
    ) -> None:
        kw = {"device": device, "dtype": dtype}
        super().__init__(
            Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, **kw),
            BatchNorm2d(out_channels, eps, momentum, **kw),
            ReLU(),  # noqa: F821 (defined above from the table)
        )

    @classmethod
    def from_modules(cls, conv: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d) -> "ConvBNReLU":
        """A ``ConvBNReLU`` over ``conv`` and ``bn`` (PyTorch's or ours; PyTorch's are re-classed as
        this package's, which share their parameters and buffers)."""
        m = cls.__new__(cls)
        torch.nn.Sequential.__init__(m, conv, bn, ReLU())  # noqa: F821
        if type(conv) is torch.nn.Conv2d:
            conv.__class__ = Conv2d
        if type(bn) is torch.nn.BatchNorm2d:
            bn.__class__ = BatchNorm2d
        return m

    def forward(self, x: Tensor) -> Tensor:
        conv, bn = self[0], self[1]
        if self.training or bn.training or bn.running_mean is None or not isinstance(conv, torch.nn.Conv2d):
            return self[2](bn(conv(x)))
        padding = _conv_padding(conv)
        if padding is None or not (isinstance(x, Tensor) and x.dim() in (3, 4)):
            return self[2](bn(conv(x)))
        # Folded in the parameters' precision, then cast as autocast casts the convolution's.
        w, b = _conv.fold_batch_norm(conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)
        ts = _ops._autocast_inputs(x, w, b)
        if not _ours(*ts):
            return self[2](bn(conv(x)))
        return _ops.relu(_conv.conv2d(*ts, conv.stride, padding, conv.dilation, conv.groups))
