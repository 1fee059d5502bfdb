"""GPU tests are marked ``gpu``: without JAX, a CUDA device visible to JAX, or one the kernels can
run on, they are skipped (reported as skipped, never as passed); with ``KERNELS_REQUIRE_GPU=1``
(the GPU suite sets it) that fails the session instead."""

import functools
import os

import pytest

# JAX takes 75% of the GPU's memory at its first use unless told not to; the library allocates
# its own (kernel modules, stream-ordered temporaries) beside it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The references are jnp code compiled once per shape; XLA's autotuning of their products took
# seconds a shape on the H100 (12 of one attention test's 20 s) and changes no result we check.
if "--xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()


@functools.lru_cache(maxsize=None)
def gpu_status():
    try:
        import jax
    except ImportError as e:
        return False, f"JAX is not installed ({e})"
    try:
        devices = jax.devices("gpu")
    except RuntimeError as e:
        return False, f"JAX has no GPU backend ({e})"
    if not devices:
        return False, "JAX sees no GPU"
    import kernels_jax

    return kernels_jax.cuda_status()


def _required():
    return os.environ.get("KERNELS_REQUIRE_GPU") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and JAX with CUDA (skipped without, failed with KERNELS_REQUIRE_GPU=1)")


def pytest_sessionstart(session):
    if _required():
        ok, why = gpu_status()
        if not ok:
            pytest.exit(f"KERNELS_REQUIRE_GPU=1 but the kernels cannot run here: {why}", returncode=1)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        ok, why = gpu_status()
        if not ok:
            if _required():
                pytest.fail(f"KERNELS_REQUIRE_GPU=1 but the kernels cannot run here: {why}")
            pytest.skip(f"no GPU: {why}")
