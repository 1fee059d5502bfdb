"""Each operator against JAX's own (``jax.nn`` / ``jax.numpy``), forward and backward (``jax.vjp``
and ``jax.grad``), in f32 and bf16, under ``jax.jit``, on the GPU.

The reference is JAX's function in f32 on the same (rounded) inputs, the gradients JAX's autodiff
of it. Tolerance, elementwise: ``|ours - ref| <= eps * |ref| + eps * max(1, max|ref|)`` with
``eps`` = 1e-5 for f32 (about 80 ulp: the library's math is within 2 ulp, XLA's within a few, and
both add a few f32 roundings and row sums) and one unit of the last place of bf16 (2^-7): the
kernels compute in f32 and round once. The absolute term lets values that come from cancellation
err by that much relative to the tensor's largest magnitude.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import kernels_jax as kj  # noqa: E402
from kernels_jax import _ops  # noqa: E402

pytestmark = pytest.mark.gpu

F32, BF16 = jnp.float32, jnp.bfloat16
EPS = {jnp.dtype(F32): 1e-5, jnp.dtype(BF16): 2.0**-7}


def close(ours, ref, dtype, what=""):
    assert ours.dtype == jnp.dtype(dtype), f"{what}: dtype {ours.dtype}, expected {jnp.dtype(dtype)}"
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape}, expected {ref.shape}"
    o = np.asarray(ours.astype(F32), dtype=np.float64)
    r = np.asarray(ref.astype(F32), dtype=np.float64)
    eps = EPS[jnp.dtype(dtype)]
    big = max(1.0, float(np.nanmax(np.abs(r)))) if r.size else 1.0
    err = np.abs(o - r)
    ok = (err <= eps * np.abs(r) + eps * big) | (np.isnan(o) & np.isnan(r))
    if not ok.all():
        i = np.unravel_index(np.argmax(np.where(ok, -np.inf, err)), ok.shape)
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.size} elements off; e.g. at {i}: {o[i]} vs {r[i]}")


def randn(shape, dtype, seed=0, scale=1.0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
    return jnp.asarray(x).astype(dtype)


# The points where an op's derivative jumps (relu, abs, the bounds of clamp and of PARAMS'
# clamp, hardswish's, softplus(2, 5)'s threshold): inputs near them are moved off, as JAX and the
# library take different one-sided derivatives there (JAX splits a tie of max/min in half).
KINKS = np.array([0.0, -0.5, 0.5, -1.0, 2.0, 2.5, -3.0, 3.0], np.float32)


def inputs(shape, dtype, positive, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 2
    if positive:
        x = np.abs(x) + 0.1
    x = np.asarray(jnp.asarray(x).astype(dtype).astype(F32))
    near = np.abs(x[..., None] - KINKS).min(-1) < 0.03
    x = np.where(near, x + 0.07, x)
    return jnp.asarray(x).astype(dtype)


def _softplus(x, beta, threshold):
    return jnp.where(beta * x > threshold, x, jax.nn.softplus(beta * x) / beta)


# JAX's version of every row of the op table, a callable of ``(x, *params)``.
REFS = {
    "neg": lambda x: -x,
    "add_scalar": lambda x, s: x + s,
    "sub_scalar": lambda x, s: x - s,
    "mul_scalar": lambda x, s: x * s,
    "div_scalar": lambda x, s: x / s,
    "abs": jnp.abs,
    "exp": jnp.exp,
    "log": jnp.log,
    "expm1": jnp.expm1,
    "log1p": jnp.log1p,
    "erf": lax.erf,
    "sqrt": jnp.sqrt,
    "rsqrt": lax.rsqrt,
    "pow": lambda x, p: x**p,
    "clamp": lambda x, lo, hi: jnp.clip(x, lo, hi),
    "identity": lambda x: x,
    "relu": jax.nn.relu,
    "leaky_relu": lambda x, s: jax.nn.leaky_relu(x, s),
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
    "softplus": _softplus,
    "elu": lambda x, a: jax.nn.elu(x, a),
    "selu": jax.nn.selu,
    "celu": lambda x, a: jax.nn.celu(x, a),
    "hardswish": jax.nn.hard_swish,
    "hardsigmoid": jax.nn.hard_sigmoid,
    "softsign": jax.nn.soft_sign,
}

# Rows with other parameters than the defaults.
PARAMS = [("leaky_relu", (0.2,)), ("softplus", (2.0, 5.0)), ("elu", (0.5,)), ("celu", (2.5,)), ("clamp", (-1.0, 2.0)), ("pow", (3.0,))]
CASES = [(n, tuple(d for _, d in kj.UNARY_OPS[n][2])) for n in sorted(kj.UNARY_OPS)] + PARAMS


def test_every_row_of_the_table_has_a_reference_and_a_function():
    assert set(REFS) == set(kj.UNARY_OPS)
    for name in kj.UNARY_OPS:
        assert callable(getattr(kj, name)), name


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}{p}" for n, p in CASES])
def test_unary_forward_and_backward(name, params, dtype):
    positive = kj.UNARY_OPS[name][3]
    ours_f = lambda x: getattr(kj, name)(x, *params)  # noqa: E731
    ref_f = lambda x: REFS[name](x, *params)  # noqa: E731
    x = inputs((3, 257), dtype, positive)
    close(jax.jit(ours_f)(x), ref_f(x.astype(F32)), dtype, name)
    g = randn(x.shape, dtype, seed=1)
    y, vjp = jax.vjp(ours_f, x)
    (gx,) = vjp(g)
    _, ref_vjp = jax.vjp(ref_f, x.astype(F32))
    (ref_gx,) = ref_vjp(g.astype(F32))
    close(gx, ref_gx, dtype, f"{name} gradient")


@pytest.mark.parametrize("shape", [(1,), (7,), (4099,), (2, 3, 5, 7), (1, 1, 1)])
def test_unary_awkward_shapes(shape):
    x = randn(shape, F32, seed=2)
    close(jax.jit(kj.gelu)(x), jax.nn.gelu(x, approximate=False), F32, f"gelu {shape}")
    g = jax.jit(jax.grad(lambda x: (kj.silu(x) * x).sum()))(x)
    close(g, jax.grad(lambda x: (jax.nn.silu(x) * x).sum())(x), F32, f"silu grad {shape}")


def test_jit_grad_of_a_composition():
    x = randn((64, 96), F32, seed=3)

    def loss(x, act, sm):
        return (sm(act(x) * 0.5) * x).sum()

    ours = jax.jit(jax.grad(lambda x: loss(x, kj.gelu_tanh, kj.softmax)))(x)
    ref = jax.grad(lambda x: loss(x, lambda v: jax.nn.gelu(v, approximate=True), jax.nn.softmax))(x)
    close(ours, ref, F32, "grad of softmax(gelu_tanh(x))")


def test_vmap():
    x = randn((4, 5, 33), F32, seed=4)
    close(jax.vmap(kj.softmax)(x), jax.nn.softmax(x, axis=-1), F32, "vmap softmax")
    close(jax.vmap(kj.tanh)(x), jnp.tanh(x), F32, "vmap tanh")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape,axis", [((5, 1000), -1), ((3, 7, 33), -1), ((1, 1), -1), ((2, 4099), -1), ((6, 5, 4), 0)])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax(log, shape, axis, dtype):
    ours_f = (lambda x: kj.log_softmax(x, axis)) if log else (lambda x: kj.softmax(x, axis))
    ref_f = (lambda x: jax.nn.log_softmax(x, axis=axis)) if log else (lambda x: jax.nn.softmax(x, axis=axis))
    x = randn(shape, dtype, seed=5, scale=3.0)
    what = f"{'log_' if log else ''}softmax {shape} axis {axis}"
    close(jax.jit(ours_f)(x), ref_f(x.astype(F32)), dtype, what)
    g = randn(shape, dtype, seed=6)
    _, vjp = jax.vjp(ours_f, x)
    _, ref_vjp = jax.vjp(ref_f, x.astype(F32))
    close(vjp(g)[0], ref_vjp(g.astype(F32))[0], dtype, f"{what} gradient")


def _layer_norm_ref(x, w, b, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    y = (x - m) * lax.rsqrt(v + eps)
    y = y if w is None else y * w
    return y if b is None else y + b


def _rms_norm_ref(x, w, b, eps):
    y = x * lax.rsqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(4, 333), (2, 3, 64), (1, 4096), (5,)])
@pytest.mark.parametrize("kind", ["layer", "layer_noaffine", "layer_nobias", "rms", "rms_noweight"])
def test_norms(kind, shape, dtype):
    cols = shape[-1]
    x = randn(shape, dtype, seed=7, scale=2.0) + jnp.asarray(0.5, dtype)
    w = None if kind in ("layer_noaffine", "rms_noweight") else randn((cols,), dtype, seed=8) + jnp.asarray(1.0, dtype)
    b = randn((cols,), dtype, seed=9) if kind == "layer" else None
    eps = 1e-5
    if kind.startswith("layer"):
        ours_f = lambda x, w, b: kj.layer_norm(x, w, b, eps)  # noqa: E731
        ref_f = lambda x, w, b: _layer_norm_ref(x, w, b, eps)  # noqa: E731
    else:
        ours_f = lambda x, w, b: kj.rms_norm(x, w, eps)  # noqa: E731
        ref_f = lambda x, w, b: _rms_norm_ref(x, w, b, eps)  # noqa: E731
    up = lambda t: None if t is None else t.astype(F32)  # noqa: E731
    close(jax.jit(ours_f)(x, w, b), ref_f(up(x), up(w), up(b)), dtype, f"{kind} {shape}")
    g = randn(shape, dtype, seed=10)
    _, vjp = jax.vjp(ours_f, x, w, b)
    _, ref_vjp = jax.vjp(ref_f, up(x), up(w), up(b))
    for what, o, r in zip(("x", "weight", "bias"), vjp(g), ref_vjp(g.astype(F32))):
        if r is None:
            assert o is None, what
        else:
            close(o, r, dtype, f"{kind} {shape} gradient of {what}")


def test_grad_of_norms_under_jit():
    x, w, b = randn((8, 256), F32, seed=11), randn((256,), F32, seed=12), randn((256,), F32, seed=13)

    def loss(ln, rms, x, w, b):
        return (rms(ln(x, w, b), w) ** 2).sum()

    ours = jax.jit(jax.grad(lambda *a: loss(kj.layer_norm, kj.rms_norm, *a), argnums=(0, 1, 2)))(x, w, b)
    ref = jax.grad(
        lambda *a: loss(lambda x, w, b: _layer_norm_ref(x, w, b, 1e-5), lambda x, w: _rms_norm_ref(x, w, None, 1e-6), *a),
        argnums=(0, 1, 2),
    )(x, w, b)
    for what, o, r in zip(("x", "weight", "bias"), ours, ref):
        close(o, r, F32, f"gradient of {what}")


def _linear_ref(x, w, b, act):
    y = jnp.dot(x, w.T, precision=lax.Precision.HIGHEST)
    y = y if b is None else y + b
    return {"identity": lambda v: v, "relu": jax.nn.relu, "gelu": lambda v: jax.nn.gelu(v, approximate=False),
            "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True), "silu": jax.nn.silu}[act](y)  # fmt: skip


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("act", kj.LINEAR_ACTIVATIONS)
@pytest.mark.parametrize("xs,out,bias", [((3, 5, 96), 80, True), ((7, 33), 17, False), ((1, 8), 1, True)])
def test_linear(xs, out, bias, act, dtype):
    x = randn(xs, dtype, seed=14)
    w = randn((out, xs[-1]), dtype, seed=15, scale=xs[-1] ** -0.5)
    b = randn((out,), dtype, seed=16) if bias else None
    up = lambda t: None if t is None else t.astype(F32)  # noqa: E731
    what = f"linear {xs} -> {out} {act}"
    ours_f = lambda x, w, b: kj.linear(x, w, b, act)  # noqa: E731
    ref_f = lambda x, w, b: _linear_ref(x, w, b, act)  # noqa: E731
    close(jax.jit(ours_f)(x, w, b), ref_f(up(x), up(w), up(b)), dtype, what)
    g = randn(xs[:-1] + (out,), dtype, seed=17)
    y, vjp = jax.vjp(ours_f, x, w, b)
    # The training forward (GEMM, then the activation) rounds the pre-activation to the dtype
    # first: in bf16 its output may differ from the fused one by that rounding.
    close(y, ref_f(up(x), up(w), up(b)), dtype, f"{what} (training forward)")
    _, ref_vjp = jax.vjp(ref_f, up(x), up(w), up(b))
    for name, o, r in zip(("x", "weight", "bias"), vjp(g), ref_vjp(g.astype(F32))):
        if r is None:
            assert o is None, name
        else:
            close(o, r, dtype, f"{what} gradient of {name}")


def _cross_entropy_ref(logits, labels, reduction, ignore_index, smoothing):
    logp = jax.nn.log_softmax(logits, axis=-1)
    valid = labels != ignore_index
    nll = -jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    loss = jnp.where(valid, (1 - smoothing) * nll - smoothing * logp.mean(-1), 0.0)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(64, 1000), (3, 5, 37)])
def test_cross_entropy(shape, smoothing, reduction, dtype):
    logits = randn(shape, dtype, seed=18, scale=2.0)
    labels = np.random.default_rng(19).integers(0, shape[-1], size=shape[:-1]).astype(np.int32)
    labels.reshape(-1)[::7] = -100  # ignored rows
    labels = jnp.asarray(labels)
    what = f"cross_entropy {shape} {reduction} smoothing {smoothing}"
    ours_f = lambda x: kj.cross_entropy(x, labels, reduction=reduction, label_smoothing=smoothing)  # noqa: E731
    ref_f = lambda x: _cross_entropy_ref(x, labels, reduction, -100, smoothing)  # noqa: E731
    close(jax.jit(ours_f)(logits), ref_f(logits.astype(F32)), dtype, what)
    g = randn(shape[:-1], dtype, seed=20) if reduction == "none" else jnp.asarray(1.5, dtype)
    _, vjp = jax.vjp(ours_f, logits)
    _, ref_vjp = jax.vjp(ref_f, logits.astype(F32))
    close(vjp(g)[0], ref_vjp(g.astype(F32))[0], dtype, f"{what} gradient")


def test_cross_entropy_under_jit_grad_with_traced_labels():
    logits = randn((32, 50), F32, seed=21)
    labels = jnp.asarray(np.random.default_rng(22).integers(0, 50, size=32).astype(np.int32))
    ours = jax.jit(jax.grad(lambda x, y: kj.cross_entropy(x, y)))(logits, labels)
    ref = jax.grad(lambda x: _cross_entropy_ref(x, labels, "mean", -100, 0.0))(logits)
    close(ours, ref, F32, "grad of the mean cross-entropy")


def test_cross_entropy_refuses_an_out_of_range_label():
    logits = randn((4, 10), F32)
    labels = jnp.asarray([1, 2, 10, 3], jnp.int32)
    _raises(r"target of row 2 is outside \[0, 10\)", lambda: kj.cross_entropy(logits, labels))


# Errors: the handlers refuse a bad call with an XLA error naming the op and the operand; JAX
# raises it (XlaRuntimeError, or JaxRuntimeError in newer versions) and stays usable.


def _raises(match, f, *args):
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(f(*args))


def test_a_wrong_dtype_is_an_error_not_a_crash():
    _raises(r"unary_fwd: operand 0 has dtype int32; expected float32, float16 or bfloat16", kj.gelu, jnp.arange(8, dtype=jnp.int32))
    x = randn((16,), F32)
    close(kj.gelu(x), jax.nn.gelu(x, approximate=False), F32, "gelu after an error")


def test_a_wrong_shape_or_arity_is_an_error():
    code = kj.UNARY_OPS["gelu"][0]
    attrs = dict(op=np.int32(code), a=np.float32(0), b=np.float32(0))
    x4, x5 = randn((4,), F32), randn((5,), F32)
    _raises(r"unary_bwd: operand 1 has shape \[5\]; expected \[4\]", lambda: _ops._call("unary_bwd", _ops._sds((4,), F32), x4, x5, **attrs))
    _raises(r"unary_fwd: 2 operands and 1 results; expected 1 and 1", lambda: _ops._call("unary_fwd", _ops._sds((4,), F32), x4, x4, **attrs))
    _raises(r"unary_fwd: missing attribute op", lambda: _ops._call("unary_fwd", _ops._sds((4,), F32), x4))
    _raises(r"norm_fwd: RMS norm has no bias", lambda: _ops._call(
        "norm_fwd", [_ops._sds((4,), F32), _ops._sds((), F32)], x4, x4,
        layer=np.int32(0), weight=np.int32(0), bias=np.int32(1), eps=np.float32(1e-5),
    ))  # fmt: skip
    close(kj.relu(x4), jax.nn.relu(x4), F32, "relu after the errors")


def test_the_registration_reports_the_installed_ffi_version():
    kj.register()
    header = kj.ffi_api_version()
    if header is not None:
        assert _ops._native.api_version() == header
