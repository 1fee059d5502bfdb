"""kernels_jax: the `kernels` library's Rust-written GPU kernels as JAX operators.

Each operator is an XLA custom call (``jax.ffi.ffi_call``) to a handler written in Rust against
the XLA FFI's C ABI, running on XLA's own device buffers and stream, with a ``jax.custom_vjp``
whose backward pass is the library's backward kernel. They work under ``jax.jit``, ``jax.grad``
and ``jax.vmap``, on CUDA devices only.

    import jax, jax.numpy as jnp, kernels_jax as kj
    x = jnp.ones((4096, 1024), jnp.bfloat16)
    y = jax.jit(kj.gelu)(x)                            # the custom call kernels_unary_fwd
    g = jax.grad(lambda x: kj.gelu(x).astype(jnp.float32).sum())(x)   # kernels_unary_bwd

Without JAX installed only ``cuda_status`` and the native layer (``kernels_jax._jax_native``) are
available.
"""

from . import _jax_native as _native

__version__ = "0.1.0"


def cuda_status():
    """``(True, gpu_name)`` if the kernels can run here, else ``(False, reason)``: no driver, no
    device, or a GPU older than compute capability 8.0."""
    return _native.cuda_status()


try:
    import jax as _jax  # noqa: F401
except ImportError as _e:  # the native layer stays usable (CI checks it without JAX)
    _JAX_ERROR = _e
else:
    _JAX_ERROR = None
    from ._ops import *  # noqa: F401,F403
    from ._ops import __all__ as _ops_all

    __all__ = ["cuda_status", *_ops_all]
