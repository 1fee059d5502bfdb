"""The example (jax/examples/train_mlp.py): a jitted training step with the operators follows the
same model in pure JAX step for step, and learns."""

import importlib.util
import pathlib

import numpy as np
import pytest

pytest.importorskip("jax")

pytestmark = pytest.mark.gpu


def _example():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_mlp.py"
    spec = importlib.util.spec_from_file_location("train_mlp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_training_matches_pure_jax():
    ex = _example()
    ours, ref = ex.train(ex.KERNELS), ex.train(ex.PURE)
    # f32 throughout, products at HIGHEST: the curves differ by the operators' roundings (about
    # 1e-6 of a loss a step), which 30 steps of SGD do not amplify past 1e-4.
    np.testing.assert_allclose(ours, ref, rtol=1e-4)
    assert ours[-1] < 0.5 * ours[0], f"the loss did not fall: {ours[0]} -> {ours[-1]}"
