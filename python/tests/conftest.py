"""GPU tests are marked ``gpu``: without a usable GPU they are skipped (reported as skipped,
never as passed); with ``KERNELS_REQUIRE_GPU=1`` (the GPU suite sets it) a missing GPU fails the
session instead."""

import functools
import os

import pytest


@functools.lru_cache(maxsize=None)
def gpu_status():
    try:
        import torch
    except ImportError as e:
        return False, f"PyTorch is not installed ({e})"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    import kernels_torch

    return kernels_torch.cuda_status()


def _required():
    return os.environ.get("KERNELS_REQUIRE_GPU") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and PyTorch (skipped without, failed with KERNELS_REQUIRE_GPU=1)")


def pytest_sessionstart(session):
    ok, why = gpu_status()
    if _required() and not ok:
        pytest.exit(f"KERNELS_REQUIRE_GPU=1 but the kernels cannot run here: {why}", returncode=1)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        ok, why = gpu_status()
        if not ok:
            if _required():
                pytest.fail(f"KERNELS_REQUIRE_GPU=1 but the kernels cannot run here: {why}")
            pytest.skip(f"no GPU: {why}")
