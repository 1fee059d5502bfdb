"""The operators: ``jax.ffi.ffi_call`` wrappers around the Rust handlers (``kernels_<op>``
targets, registered on first use), each with a ``jax.custom_vjp`` whose backward is the library's
backward kernel.

The handlers check every operand's dtype and shape themselves; a mismatch fails the XLA program
with an error naming the op (``XlaRuntimeError`` / ``JaxRuntimeError``), never a crash.
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_native as _native

try:
    _ffi = jax.ffi
except AttributeError:  # jax before 0.4.38 had it under jax.extend
    from jax.extend import ffi as _ffi

__all__ = [
    "UNARY_OPS",
    "ffi_api_version",
    "register",
    "softmax",
    "log_softmax",
    "layer_norm",
    "rms_norm",
    "cross_entropy",
    "linear",
    "LINEAR_ACTIVATIONS",
    "dot_product_attention",
]

#: The unary op table: ``name -> (code, activation, ((param, default), ...), positive, doc)``,
#: one function of this module each (``kernels_jax.gelu(x)``, ``kernels_jax.leaky_relu(x, 0.2)``).
UNARY_OPS = {row[0]: (code, *row[1:]) for code, row in enumerate(_native.UNARY_OPS)}


def ffi_api_version():
    """``(major, minor)`` of the XLA FFI API in the header of the installed jaxlib
    (``jax.ffi.include_dir()``), or ``None`` where it cannot be read."""
    try:
        path = os.path.join(_ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, AttributeError):
        return None
    major = re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text)
    minor = re.search(r"#define XLA_FFI_API_MINOR (\d+)", text)
    return (int(major.group(1)), int(minor.group(1))) if major and minor else None


_registered = False


def register():
    """Registers the handlers with XLA for the CUDA platform (once; every operator calls it).

    XLA asks each handler for its FFI API version when it is registered, and before FFI API 0.2
    accepts only its own: the handlers report the version of the installed jaxlib's header, or,
    where that is unreadable, the one XLA names in its refusal."""
    global _registered
    if _registered:
        return
    version = ffi_api_version()
    if version is not None:
        _native.set_api_version(*version)
    for name, capsule in _native.targets():
        try:
            _ffi.register_ffi_target(name, capsule, platform="CUDA")
        except Exception as e:  # jaxlib's error type differs between versions
            m = re.search(r"framework's API version \((\d+)\.(\d+)\)", str(e))
            if m is None:
                raise
            _native.set_api_version(int(m.group(1)), int(m.group(2)))
            _ffi.register_ffi_target(name, capsule, platform="CUDA")
    _registered = True


def _call(target, results, *args, vmap_method="sequential", **attrs):
    register()
    return _ffi.ffi_call(f"kernels_{target}", results, vmap_method=vmap_method)(*args, **attrs)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


# ---------------------------------------------------------------------------------------------
# Unary ops and activations: one target pair for the whole table, the row by its code.


def _unary_fwd_call(code, a, b, x):
    return _call(
        "unary_fwd", _sds(x.shape, x.dtype), x,
        vmap_method="broadcast_all", op=np.int32(code), a=np.float32(a), b=np.float32(b),
    )  # fmt: skip


def _unary_bwd_call(code, a, b, x, g):
    return _call(
        "unary_bwd", _sds(x.shape, x.dtype), x, g,
        vmap_method="broadcast_all", op=np.int32(code), a=np.float32(a), b=np.float32(b),
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _unary(code, a, b, x):
    return _unary_fwd_call(code, a, b, x)


def _unary_f(code, a, b, x):
    return _unary_fwd_call(code, a, b, x), x


def _unary_b(code, a, b, x, g):
    return (_unary_bwd_call(code, a, b, x, g.astype(x.dtype)),)


_unary.defvjp(_unary_f, _unary_b)


def _make_unary(name, code, params, doc):
    names = [p for p, _ in params]
    defaults = {p: d for p, d in params}

    def op(x, *args, **kwargs):
        if len(args) > len(names):
            raise TypeError(f"{name}() takes at most {len(names)} parameters ({', '.join(names) or 'none'})")
        values = dict(defaults)
        values.update(zip(names, args))
        for k, v in kwargs.items():
            if k not in defaults:
                raise TypeError(f"{name}() got an unexpected keyword argument {k!r}")
            values[k] = v
        p = [float(values[n]) for n in names] + [0.0, 0.0]
        return _unary(code, p[0], p[1], jnp.asarray(x))

    op.__name__ = op.__qualname__ = name
    sig = ", ".join(f"{p}={d}" for p, d in params)
    op.__doc__ = f"{name}(x{', ' + sig if sig else ''}): {doc} Element-wise, with its backward kernel."
    return op


for _name, (_code, _act, _params, _positive, _doc) in UNARY_OPS.items():
    globals()[_name] = _make_unary(_name, _code, _params, _doc)
    __all__.append(_name)


# ---------------------------------------------------------------------------------------------
# Softmax and log-softmax over the last axis.


def _softmax_fwd_call(log, x):
    return _call("softmax_fwd", _sds(x.shape, x.dtype), x, vmap_method="broadcast_all", log=np.int32(log))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _softmax(log, x):
    return _softmax_fwd_call(log, x)


def _softmax_f(log, x):
    y = _softmax_fwd_call(log, x)
    return y, y


def _softmax_b(log, y, g):
    gx = _call("softmax_bwd", _sds(y.shape, y.dtype), y, g.astype(y.dtype), vmap_method="broadcast_all", log=np.int32(log))
    return (gx,)


_softmax.defvjp(_softmax_f, _softmax_b)


def _along_last(f, x, axis):
    x = jnp.asarray(x)
    axis = axis % x.ndim if x.ndim else 0
    if axis == x.ndim - 1 or x.ndim == 0:
        return f(x)
    return jnp.moveaxis(f(jnp.moveaxis(x, axis, -1)), -1, axis)


def softmax(x, axis=-1):
    """``jax.nn.softmax(x, axis)`` (one axis), computed in f32 and rounded once."""
    return _along_last(functools.partial(_softmax, False), x, axis)


def log_softmax(x, axis=-1):
    """``jax.nn.log_softmax(x, axis)`` (one axis), computed in f32 and rounded once."""
    return _along_last(functools.partial(_softmax, True), x, axis)


# ---------------------------------------------------------------------------------------------
# Layer norm and RMS norm over the last axis; the statistics are saved for the backward in f32.


def _norm_fwd_call(layer, eps, x, w, b):
    rows = x.shape[:-1]
    results = [_sds(x.shape, x.dtype)] + ([_sds(rows, jnp.float32)] if layer else []) + [_sds(rows, jnp.float32)]
    args = [x] + ([w] if w is not None else []) + ([b] if b is not None else [])
    return _call(
        "norm_fwd", results, *args,
        layer=np.int32(layer), weight=np.int32(w is not None), bias=np.int32(b is not None), eps=np.float32(eps),
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _norm(layer, eps, x, w, b):
    return _norm_fwd_call(layer, eps, x, w, b)[0]


def _norm_f(layer, eps, x, w, b):
    y, *stats = _norm_fwd_call(layer, eps, x, w, b)
    return y, (x, w, b, stats)


def _norm_b(layer, eps, res, g):
    x, w, b, stats = res
    cols = x.shape[-1:]
    results = [_sds(x.shape, x.dtype)] + ([_sds(cols, w.dtype)] if w is not None else [])
    results += [_sds(cols, b.dtype)] if b is not None else []
    args = [x] + ([w] if w is not None else []) + list(stats) + [g.astype(x.dtype)]
    out = _call(
        "norm_bwd", results, *args,
        layer=np.int32(layer), weight=np.int32(w is not None), bias=np.int32(b is not None), eps=np.float32(eps),
    )  # fmt: skip
    gx, rest = out[0], list(out[1:])
    gw = rest.pop(0) if w is not None else None
    gb = rest.pop(0) if b is not None else None
    return gx, gw, gb


_norm.defvjp(_norm_f, _norm_b)


def _vector(v, x, what):
    if v is None:
        return None
    v = jnp.asarray(v)
    if v.shape != x.shape[-1:]:
        raise ValueError(f"{what}: shape {v.shape}, expected {x.shape[-1:]} (x's last axis)")
    return v


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """Layer norm over the last axis: ``(x - mean) / sqrt(var + eps) * weight + bias`` (weight and
    bias optional, of x's dtype and last axis), statistics in f32."""
    x = jnp.asarray(x)
    return _norm(True, float(eps), x, _vector(weight, x, "layer_norm weight"), _vector(bias, x, "layer_norm bias"))


def rms_norm(x, weight=None, eps=1e-6):
    """RMS norm over the last axis: ``x / sqrt(mean(x^2) + eps) * weight`` (weight optional)."""
    x = jnp.asarray(x)
    return _norm(False, float(eps), x, _vector(weight, x, "rms_norm weight"), None)


# ---------------------------------------------------------------------------------------------
# Cross-entropy over class indices, fused with the log-softmax.

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _ce_attrs(opts):
    reduction, ignore_index, smoothing = opts
    return dict(reduction=np.int32(reduction), ignore_index=np.int32(ignore_index), label_smoothing=np.float32(smoothing))


def _ce_fwd_call(opts, logits, targets):
    rows = logits.shape[:-1]
    results = [_sds(rows if opts[0] == 0 else (), logits.dtype), _sds(rows, jnp.float32), _sds((1,), jnp.float32)]
    return _call("cross_entropy_fwd", results, logits, targets, **_ce_attrs(opts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cross_entropy(opts, logits, targets):
    return _ce_fwd_call(opts, logits, targets)[0]


def _cross_entropy_f(opts, logits, targets):
    loss, lse, count = _ce_fwd_call(opts, logits, targets)
    return loss, (logits, targets, lse, count)


def _cross_entropy_b(opts, res, g):
    logits, targets, lse, count = res
    gx = _call(
        "cross_entropy_bwd", _sds(logits.shape, logits.dtype), logits, targets, lse, count, g.astype(logits.dtype),
        **_ce_attrs(opts),
    )  # fmt: skip
    return gx, None


_cross_entropy.defvjp(_cross_entropy_f, _cross_entropy_b)


def cross_entropy(logits, labels, *, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    """``torch.nn.functional.cross_entropy`` over class indices: logits ``[..., C]`` (float32,
    float16 or bfloat16), integer ``labels`` of logits' leading shape; ``reduction`` ``"mean"``
    (over the rows whose label is not ``ignore_index``), ``"sum"`` or ``"none"``;
    ``label_smoothing`` in ``[0, 1]``. The loss has logits' dtype. Waits for the GPU to check the
    labels: one outside ``[0, C)`` other than ``ignore_index`` is an error naming its row."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction {reduction!r}, expected one of {tuple(_REDUCTIONS)}")
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    if logits.ndim < 1 or labels.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: logits {logits.shape} and labels {labels.shape}: expected [..., C] and [...]")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"cross_entropy: labels must be integers, got {labels.dtype}")
    if labels.dtype != jnp.int64:
        # The kernels read int64; without jax_enable_x64 JAX has none, so each label goes as
        # its two 32-bit words (low, high), which the handler reads as one int64.
        low = labels.astype(jnp.int32)
        labels = jnp.stack([low, jnp.where(low < 0, -1, 0).astype(jnp.int32)], axis=-1)
    opts = (_REDUCTIONS[reduction], int(ignore_index), float(label_smoothing))
    return _cross_entropy(opts, logits, labels)


# ---------------------------------------------------------------------------------------------
# The linear layer: one GEMM with the bias and the activation fused into its store.

#: The activations ``linear`` fuses into the GEMM.
LINEAR_ACTIVATIONS = ("identity", "relu", "gelu", "gelu_tanh", "silu")


def _linear_call(act, x, w, b):
    args = [x, w] + ([b] if b is not None else [])
    return _call(
        "linear_fwd", _sds(x.shape[:-1] + (w.shape[0],), x.dtype), *args,
        act=np.int32(act), bias=np.int32(b is not None),
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear(act, x, w, b):
    return _linear_call(act, x, w, b)


def _linear_f(act, x, w, b):
    identity = UNARY_OPS["identity"][0]
    if act == identity:
        return _linear_call(act, x, w, b), (x, w, b, None)
    # The backward needs the pre-activation: the GEMM, then the activation, in two kernels.
    z = _linear_call(identity, x, w, b)
    return _unary_fwd_call(act, 0.0, 0.0, z), (x, w, b, z)


def _linear_b(act, res, g):
    x, w, b, z = res
    g = g.astype(x.dtype)
    dz = g if z is None else _unary_bwd_call(act, 0.0, 0.0, z, g)
    results = [_sds(x.shape, x.dtype), _sds(w.shape, w.dtype)] + ([_sds(b.shape, b.dtype)] if b is not None else [])
    out = _call("linear_bwd", results, x, w, dz, bias=np.int32(b is not None))
    return out[0], out[1], (out[2] if b is not None else None)


_linear.defvjp(_linear_f, _linear_b)


def linear(x, weight, bias=None, activation="identity"):
    """``act(x @ weight.T + bias)`` (``torch.nn.functional.linear``'s layout: weight ``[out,
    in]``, x ``[..., in]``), one GEMM with the bias and the activation (one of
    ``LINEAR_ACTIVATIONS``) fused into its store; float32 (f32 FMAs), or bfloat16 or float16
    (the tensor cores, f32 accumulation, rounded once). The gradient: the activation's backward,
    then two GEMMs and a column sum."""
    if activation not in LINEAR_ACTIVATIONS:
        raise ValueError(f"linear: activation {activation!r} is not one of {LINEAR_ACTIVATIONS}")
    x, weight = jnp.asarray(x), jnp.asarray(weight)
    if weight.ndim != 2 or x.ndim < 1 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear: x {x.shape} and weight {weight.shape}: expected [..., in] and [out, in]")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"linear: bias {bias.shape}, expected ({weight.shape[0]},)")
    return _linear(UNARY_OPS[activation][0], x, weight, bias)


# ---------------------------------------------------------------------------------------------
# Attention (FlashAttention forward and backward), bf16 or f16.

_LAYOUTS = {"BSHD": 1, "BHSD": 0}


def _attention_fwd_call(opts, q, k, v):
    layout, causal, scale, wl, wr = opts
    b, hq, sq = (q.shape[0], q.shape[2], q.shape[1]) if layout == 1 else q.shape[:3]
    return _call(
        "attention_fwd", [_sds(q.shape, q.dtype), _sds((b, hq, sq), jnp.float32)], q, k, v,
        layout=np.int32(layout), causal=np.int32(causal), scale=np.float32(scale),
        window_left=np.int32(wl), window_right=np.int32(wr),
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(opts, q, k, v):
    return _attention_fwd_call(opts, q, k, v)[0]


def _attention_f(opts, q, k, v):
    out, lse = _attention_fwd_call(opts, q, k, v)
    return out, (q, k, v, out, lse)


def _attention_b(opts, res, g):
    q, k, v, out, lse = res
    layout, causal, scale, wl, wr = opts
    dq, dk, dv = _call(
        "attention_bwd", [_sds(q.shape, q.dtype), _sds(k.shape, k.dtype), _sds(v.shape, v.dtype)],
        q, k, v, out, lse, g.astype(q.dtype),
        layout=np.int32(layout), causal=np.int32(causal), scale=np.float32(scale),
        window_left=np.int32(wl), window_right=np.int32(wr),
    )  # fmt: skip
    return dq, dk, dv


_attention.defvjp(_attention_f, _attention_b)


def dot_product_attention(q, k, v, *, scale=None, is_causal=False, layout="BSHD", window=None):
    """``jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal)`` on the
    library's FlashAttention kernels: q ``[B, Sq, Hq, D]``, k and v ``[B, Sk, Hkv, D]`` (layout
    ``"BSHD"``, JAX's) or ``[B, H, S, D]`` (``"BHSD"``); bf16 or f16; ``D`` a multiple of 8 up
    to 256; ``Hq`` a multiple of ``Hkv`` (grouped-query attention). ``is_causal``: the causal
    mask aligned at the top left (query i sees keys up to i), as JAX's. ``window``: a local
    window ``(left, right)``: query ``i`` sees keys ``j`` with ``c - left <= j <= c + right``
    around its diagonal ``c`` (``i`` with ``is_causal``, which cuts ``right`` to 0; else ``i + Sk
    - Sq``, bottom right, as FlashAttention's ``window_size``), ``None`` on a side for unbounded."""
    if layout not in _LAYOUTS:
        raise ValueError(f"dot_product_attention: layout {layout!r}, expected 'BSHD' or 'BHSD'")
    if scale is not None and not float(scale) > 0:
        raise ValueError(f"dot_product_attention: scale must be positive, got {scale}")
    wl, wr = (-1, -1) if window is None else (-1 if window[0] is None else int(window[0]), -1 if window[1] is None else int(window[1]))
    opts = (_LAYOUTS[layout], 1 if is_causal else 0, 0.0 if scale is None else float(scale), wl, wr)
    return _attention(opts, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
