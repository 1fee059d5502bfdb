"""``torch.nn`` modules running the kernels on CUDA tensors of f32, f16 and bf16, and PyTorch's own
implementation otherwise (CPU tensors, float64, and the cases listed per module).

Most are subclasses of the PyTorch module they replace (same constructor, parameters and
``state_dict``), so a model switches with a changed import. ``FusedBiasAct`` is new:
``act(x * scale + bias)`` in one kernel; so is ``RotaryEmbedding`` (PyTorch has no such module).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _ops
from ._ops import _DTYPE_CODES

__all__ = [
    "CrossEntropyLoss",
    "Embedding",
    "FusedBiasAct",
    "GELU",
    "GeGLU",
    "LayerNorm",
    "Linear",
    "LogSoftmax",
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


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` for logits ``[N, C]`` and int64 class indices ``[N]``; PyTorch's
    for class weights, class-probability targets and other shapes."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        if (
            self.weight is None
            and _ours(input)
            and input.dim() == 2
            and target.dtype == torch.int64
            and target.dim() == 1
            and target.device == input.device
        ):
            return _ops.cross_entropy(input, target, self.ignore_index, self.reduction, self.label_smoothing)
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
