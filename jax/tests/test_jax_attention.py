"""``kernels_jax.dot_product_attention`` against attention written in ``jax.numpy``, forward and
backward, bf16 and f16, on the GPU.

The reference runs in f32 (products at ``Precision.HIGHEST``, no TF32) on the same rounded
inputs, with JAX's autodiff for the gradients. The check is norm-wise, per tensor:
``||ours - ref|| <= C u ||ref||`` with ``u`` the unit roundoff of the dtype (2^-8 bf16, 2^-11 f16)
and ``C`` = 4 forward, 8 backward: the kernel rounds the softmax weights to the dtype before ``P V``
(a relative ``u/2`` each) and its output once, and in the backward also ``dS`` and ``P`` before
their products, each error independent and of zero mean, so the norm-wise error stays a small
multiple of ``u``. A wrong mask, scale, layout or head mapping errs by far more (tens of percent).
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kernels_jax as kj  # noqa: E402

pytestmark = pytest.mark.gpu

U = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11}
HIGHEST = jax.lax.Precision.HIGHEST


def reference(q, k, v, scale=None, is_causal=False, window=None):
    """Attention in f32 on ``[B, S, H, D]`` tensors, grouped-query heads by repetition."""
    q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    hq, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    k, v = jnp.repeat(k, hq // hkv, axis=2), jnp.repeat(v, hq // hkv, axis=2)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * scale
    sq, sk = q.shape[1], k.shape[1]
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    mask = np.ones((sq, sk), bool)
    if is_causal:
        mask &= j <= i
    if window is not None:
        # Around the diagonal: top left under the causal mask, else bottom right (as the op's).
        c = i if is_causal else i + sk - sq
        left, right = window
        if left is not None:
            mask &= j >= c - left
        if right is not None:
            mask &= j <= c + right
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision=HIGHEST)


def rel_err(ours, ref):
    o, r = np.asarray(ours.astype(jnp.float32), np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(o).all(), "non-finite values"
    return np.linalg.norm(o - r) / np.linalg.norm(r)


def rand(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, causal, window)
    (2, 128, 128, 4, 4, 64, False, None),
    (2, 128, 128, 4, 4, 64, True, None),
    (1, 100, 77, 8, 2, 128, False, None),
    (1, 77, 200, 4, 1, 32, True, None),
    (3, 33, 33, 2, 2, 80, False, None),
    (1, 256, 256, 2, 2, 64, True, (32, 0)),
    (1, 96, 160, 2, 2, 64, False, (48, 16)),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_attention_forward_and_backward(case, dtype):
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = rand((b, sq, hq, d), dtype, 0), rand((b, sk, hkv, d), dtype, 1), rand((b, sk, hkv, d), dtype, 2)
    u = U[jnp.dtype(dtype)]

    def ours_f(q, k, v):
        return kj.dot_product_attention(q, k, v, is_causal=causal, window=window)

    def ref_f(q, k, v):
        return reference(q, k, v, is_causal=causal, window=window)

    out = jax.jit(ours_f)(q, k, v)
    assert out.dtype == jnp.dtype(dtype) and out.shape == q.shape
    e = rel_err(out, ref_f(q, k, v))
    assert e <= 4 * u, f"forward: relative error {e:.3g} > 4u = {4 * u:.3g}"

    g = rand(q.shape, dtype, 3)
    _, vjp = jax.vjp(ours_f, q, k, v)
    _, ref_vjp = jax.vjp(ref_f, *(t.astype(jnp.float32) for t in (q, k, v)))
    for what, o, r in zip(("dq", "dk", "dv"), vjp(g), ref_vjp(g.astype(jnp.float32))):
        assert o.dtype == jnp.dtype(dtype)
        e = rel_err(o, r)
        assert e <= 8 * u, f"{what}: relative error {e:.3g} > 8u = {8 * u:.3g}"


def test_bhsd_layout_and_scale():
    dtype = jnp.bfloat16
    q, k, v = rand((2, 64, 4, 64), dtype, 4), rand((2, 96, 4, 64), dtype, 5), rand((2, 96, 4, 64), dtype, 6)
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    out = kj.dot_product_attention(t(q), t(k), t(v), scale=0.3, layout="BHSD")
    e = rel_err(t(out), reference(q, k, v, scale=0.3))
    assert e <= 4 * U[jnp.dtype(dtype)], e


def test_f32_is_refused_with_an_error():
    q = rand((1, 8, 1, 8), jnp.float32, 0)
    with pytest.raises(Exception, match="bf16 or f16"):
        jax.block_until_ready(kj.dot_product_attention(q, q, q))


def test_grad_under_jit_of_a_loss():
    dtype = jnp.bfloat16
    q, k, v = rand((1, 64, 2, 64), dtype, 10), rand((1, 64, 2, 64), dtype, 11), rand((1, 64, 2, 64), dtype, 12)

    def loss(f, q, k, v):
        return (f(q, k, v).astype(jnp.float32) ** 2).sum()

    ours = jax.jit(jax.grad(lambda q, k, v: loss(lambda *a: kj.dot_product_attention(*a, is_causal=True), q, k, v), argnums=(0, 1, 2)))(q, k, v)
    f32 = [t.astype(jnp.float32) for t in (q, k, v)]
    ref = jax.grad(lambda q, k, v: loss(lambda *a: reference(*a, is_causal=True), q, k, v), argnums=(0, 1, 2))(*f32)
    for what, o, r in zip(("dq", "dk", "dv"), ours, ref):
        e = rel_err(o, r)
        assert e <= 8 * U[jnp.dtype(dtype)], f"{what}: {e:.3g}"
