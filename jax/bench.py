"""Times each kernels_jax operator against XLA's own code for the same function (``jax.nn`` /
``jax.numpy`` under ``jax.jit``, which XLA fuses), in one process, on the same arrays.

    python3 jax/bench.py [OUT.json] [--quick]

Each case is one jitted function, forward only and forward + backward (``jax.grad`` of the sum
of the output in f32, so it includes the forward). Time: wall clock of 20 calls issued back to
back and waited for once, the median of 15 such batches after a warm-up, divided by 20 (the
dispatch of each call overlaps the GPU's work on the previous). Ratio = XLA's time / ours
(above 1: ours is faster). The JSON goes to OUT.json, else to $OUT/jax-bench.json if $OUT is
set. ``--quick``: the bf16 cases only.
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kernels_jax as kj

CALLS, BATCHES = 20, 15


def bench_ms(f, *args):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(BATCHES + 3):
        t = time.perf_counter()
        for _ in range(CALLS):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / CALLS * 1e3)
    return float(np.median(times[3:]))


def _ln(x, w, b):
    m = x.astype(jnp.float32).mean(-1, keepdims=True)
    v = ((x.astype(jnp.float32) - m) ** 2).mean(-1, keepdims=True)
    return (((x - m) * jax.lax.rsqrt(v + 1e-5)) * w + b).astype(x.dtype)


def _rms(x, w):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * w).astype(x.dtype)


def _ce(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean().astype(logits.dtype)


def cases(dtypes):
    r = np.random.default_rng(0)

    def a(*s, dtype):
        return jnp.asarray(r.standard_normal(s).astype(np.float32)).astype(dtype)

    for dt in dtypes:
        x = a(8192, 4096, dtype=dt)
        w, b = a(4096, dtype=dt), a(4096, dtype=dt)
        yield "gelu", dt, (kj.gelu, lambda x: jax.nn.gelu(x, approximate=False)), (x,)
        yield "silu", dt, (kj.silu, jax.nn.silu), (x,)
        yield "softmax", dt, (kj.softmax, jax.nn.softmax), (x,)
        yield "layer_norm", dt, (kj.layer_norm, _ln), (x, w, b)
        yield "rms_norm", dt, (kj.rms_norm, _rms), (x, w)
        labels = jnp.asarray(r.integers(0, 32000, size=4096).astype(np.int32))
        yield "cross_entropy", dt, (kj.cross_entropy, _ce), (a(4096, 32000, dtype=dt), labels)
        wl = a(4096, 4096, dtype=dt) * 0.02
        yield "linear", dt, (kj.linear, lambda x, w: jnp.dot(x, w.T, precision="highest")), (a(4096, 4096, dtype=dt), wl)
    q = a(4, 2048, 16, 128, dtype=jnp.bfloat16)
    attn = (lambda q, k, v: kj.dot_product_attention(q, k, v, is_causal=True),
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))  # fmt: skip
    yield "attention causal", jnp.bfloat16, attn, (q, q * 0.5, q * 0.25)


def main():
    quick = "--quick" in sys.argv
    out_path = next((a for a in sys.argv[1:] if not a.startswith("--")), None)
    if out_path is None and os.environ.get("OUT"):
        out_path = os.path.join(os.environ["OUT"], "jax-bench.json")
    rows = []
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for name, dt, (ours, xla), args in cases([jnp.bfloat16] if quick else [jnp.bfloat16, jnp.float32]):
        for mode in ("fwd", "fwd+bwd"):
            if mode == "fwd":
                fo, fx = jax.jit(ours), jax.jit(xla)
            else:
                n = 1 if name == "cross_entropy" else len(args)
                grad = lambda f: jax.jit(jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=tuple(range(n))))  # noqa: E731
                fo, fx = grad(ours), grad(xla)
            t_ours, t_xla = bench_ms(fo, *args), bench_ms(fx, *args)
            row = {"op": name, "dtype": jnp.dtype(dt).name, "mode": mode, "ours_ms": t_ours, "xla_ms": t_xla, "ratio": t_xla / t_ours}
            rows.append(row)
            print(f"{name:18s} {row['dtype']:8s} {mode:8s} ours {t_ours:8.3f} ms  XLA {t_xla:8.3f} ms  ratio {row['ratio']:.2f}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
