"""The handlers through XLA itself, on its CPU backend (any jaxlib has one, no GPU needed): XLA's
registration handshake (the FFI version each handler reports), its call frames and attributes,
and the errors the handlers return for bad calls, raised by JAX. The kernels need a CUDA stream,
so a valid call fails here, with an error, after the checks."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kernels_jax import _jax_native as _native, _ops  # noqa: E402


@pytest.fixture(scope="module")
def cpu():
    version = _ops.ffi_api_version()
    if version is not None:
        _native.set_api_version(*version)
    for name, capsule in _native.targets():
        _ops._ffi.register_ffi_target(name, capsule, platform="cpu")
    return jax.devices("cpu")[0]


def run(cpu, target, results, *args, **attrs):
    args = [jax.device_put(a, cpu) for a in args]
    f = jax.jit(lambda *a: _ops._ffi.ffi_call(f"kernels_{target}", results)(*a, **attrs))
    return jax.block_until_ready(f(*args))


def gelu_attrs():
    return dict(op=np.int32(_ops.UNARY_OPS["gelu"][0]), a=np.float32(0), b=np.float32(0))


def test_the_reported_version_is_the_headers(cpu):
    version = _ops.ffi_api_version()
    assert version is not None, "jaxlib ships xla/ffi/api/c_api.h under jax.ffi.include_dir()"
    assert _native.api_version() == version


def test_a_wrong_dtype_is_refused(cpu):
    x = jnp.arange(8, dtype=jnp.int32)
    with pytest.raises(Exception, match="unary_fwd: operand 0 has dtype int32; expected float32"):
        run(cpu, "unary_fwd", _ops._sds((8,), jnp.int32), x, **gelu_attrs())


def test_attributes_reach_the_handler(cpu):
    x = jnp.ones((8,), jnp.float32)
    with pytest.raises(Exception, match="unknown unary op code 4242"):
        run(cpu, "unary_fwd", _ops._sds((8,), jnp.float32), x, op=np.int32(4242), a=np.float32(0), b=np.float32(0))
    with pytest.raises(Exception, match="missing attribute op"):
        run(cpu, "unary_fwd", _ops._sds((8,), jnp.float32), x)


def test_shapes_and_arity_are_checked(cpu):
    x4, x5 = jnp.ones((4,), jnp.float32), jnp.ones((5,), jnp.float32)
    with pytest.raises(Exception, match=r"unary_bwd: operand 1 has shape \[5\]; expected \[4\]"):
        run(cpu, "unary_bwd", _ops._sds((4,), jnp.float32), x4, x5, **gelu_attrs())
    with pytest.raises(Exception, match="unary_fwd: 2 operands and 1 results; expected 1 and 1"):
        run(cpu, "unary_fwd", _ops._sds((4,), jnp.float32), x4, x4, **gelu_attrs())
    q = jnp.ones((1, 4, 2), jnp.bfloat16)
    attn = dict(layout=np.int32(1), causal=np.int32(0), scale=np.float32(0), window_left=np.int32(-1), window_right=np.int32(-1))
    with pytest.raises(Exception, match=r"attention_fwd: operand 0 has shape \[1, 4, 2\]; expected rank 4"):
        run(cpu, "attention_fwd", [_ops._sds(q.shape, q.dtype), _ops._sds((1, 2, 4), jnp.float32)], q, q, q, **attn)


def test_a_valid_call_without_a_cuda_stream_is_an_error(cpu):
    x = jnp.ones((8,), jnp.float32)
    with pytest.raises(Exception):
        run(cpu, "unary_fwd", _ops._sds((8,), jnp.float32), x, **gelu_attrs())
