"""A small classifier (layer norm, GELU, RMS norm, log-softmax) trained by a jitted SGD step with
kernels_jax's operators, against the same model in pure JAX, from the same start and data.

    python jax/examples/train_mlp.py         # on a machine with a CUDA GPU, jax and kernels_jax

Both use f32 and products at Precision.HIGHEST, so the two loss curves differ only by the
operators' roundings; the test (jax/tests/test_jax_train.py) checks that they agree.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import kernels_jax as kj

HIGHEST = jax.lax.Precision.HIGHEST


def _layer_norm(x, w, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * w + b


def _rms_norm(x, w, eps=1e-6):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w


PURE = {
    "layer_norm": _layer_norm,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "rms_norm": _rms_norm,
    "log_softmax": jax.nn.log_softmax,
}
KERNELS = {"layer_norm": kj.layer_norm, "gelu": kj.gelu, "rms_norm": kj.rms_norm, "log_softmax": kj.log_softmax}


def init(seed=0, d_in=64, d_hidden=256, classes=10):
    r = np.random.default_rng(seed)
    f = lambda *s, scale=1.0: jnp.asarray(r.standard_normal(s).astype(np.float32) * scale)  # noqa: E731
    return {
        "ln_w": jnp.ones(d_in), "ln_b": jnp.zeros(d_in),
        "w1": f(d_in, d_hidden, scale=d_in**-0.5), "b1": jnp.zeros(d_hidden),
        "rms_w": jnp.ones(d_hidden),
        "w2": f(d_hidden, classes, scale=d_hidden**-0.5), "b2": jnp.zeros(classes),
    }  # fmt: skip


def data(seed=1, n=512, d_in=64, classes=10):
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, d_in)).astype(np.float32)
    teacher = r.standard_normal((d_in, classes)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(np.argmax(np.tanh(x @ teacher), axis=1).astype(np.int32))


def loss(ops, params, x, y):
    h = ops["layer_norm"](x, params["ln_w"], params["ln_b"])
    h = ops["gelu"](jnp.dot(h, params["w1"], precision=HIGHEST) + params["b1"])
    h = ops["rms_norm"](h, params["rms_w"])
    logp = ops["log_softmax"](jnp.dot(h, params["w2"], precision=HIGHEST) + params["b2"])
    return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()


def train(ops, steps=30, lr=0.5):
    """The loss before each of ``steps`` SGD steps."""
    params, (x, y) = init(), data()

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(functools.partial(loss, ops))(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads), value

    losses = []
    for _ in range(steps):
        params, value = step(params, x, y)
        losses.append(float(value))
    return losses


if __name__ == "__main__":
    ours, ref = train(KERNELS), train(PURE)
    for i, (a, b) in enumerate(zip(ours, ref)):
        print(f"step {i:3d}  kernels_jax {a:.6f}  pure JAX {b:.6f}  rel diff {abs(a - b) / abs(b):.2e}")
