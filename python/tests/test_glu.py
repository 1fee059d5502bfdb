"""The gated activations ``act(a) * b`` (``kt.glu_act``, ``swiglu``, ``geglu``, ``reglu`` and the
``nn`` modules) against PyTorch's eager composition run in float64 on the same inputs, forward and
backward, f32, f16 and bf16, on the GPU; opcheck of the four operators, the eager path against the
custom ops bit for bit, and ``torch.compile(fullgraph=True)``. Tolerances as ``test_ops.py``.
"""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kernels_torch as kt  # noqa: E402
from kernels_torch import nn as knn  # noqa: E402

from test_ops import DEV, DTYPES, close, our_grads, randn, ref_grads  # noqa: E402

pytestmark = pytest.mark.gpu

# activation name -> PyTorch's version of it (with its defaults).
TORCH_ACT = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"),
    "sigmoid": torch.sigmoid,
    "relu": F.relu,
}

# F: not a multiple of the vector width (odd halves, unaligned b), aligned, an LLM width.
SHAPES = [((3, 5), 8), ((7,), 13), ((4,), 1), ((0,), 8), ((2,), 11008)]


def _fused_ref(act):
    def f(x):
        a, b = x.chunk(2, dim=-1)
        return TORCH_ACT[act](a) * b

    return f


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(TORCH_ACT))
def test_glu_fused(act, dtype):
    for lead, f in SHAPES:
        x = randn(*lead, 2 * f, dtype=dtype, scale=2.0, seed=f).requires_grad_()
        g = randn(*lead, f, dtype=dtype, seed=f + 1)
        y, (gx,) = our_grads(lambda x: kt.glu_act(x, act), [x], g)
        ry, (rgx,) = ref_grads(_fused_ref(act), [x], g)
        close(y, ry, dtype, f"glu {act} forward {lead} F={f}")
        close(gx, rgx, dtype, f"glu {act} backward {lead} F={f}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(TORCH_ACT))
def test_glu_two_inputs(act, dtype):
    for lead, f in SHAPES:
        a = randn(*lead, f, dtype=dtype, scale=2.0, seed=f).requires_grad_()
        b = randn(*lead, f, dtype=dtype, seed=f + 1).requires_grad_()
        g = randn(*lead, f, dtype=dtype, seed=f + 2)
        y, gs = our_grads(lambda a, b: kt.glu_act(a, act, gate=b), [a, b], g)
        ry, rgs = ref_grads(lambda a, b: TORCH_ACT[act](a) * b, [a, b], g)
        close(y, ry, dtype, f"glu2 {act} forward")
        for o, r, n in zip(gs, rgs, ["a", "b"]):
            close(o, r, dtype, f"glu2 {act} grad of {n}")


def test_named_functions_and_modules():
    x = randn(6, 64, seed=3)
    a, b = x.double().chunk(2, dim=-1)
    close(kt.swiglu(x), F.silu(a) * b, torch.float32, "swiglu")
    close(kt.geglu(x), F.gelu(a) * b, torch.float32, "geglu")
    close(kt.geglu(x, approximate="tanh"), F.gelu(a, approximate="tanh") * b, torch.float32, "geglu tanh")
    close(kt.reglu(x), F.relu(a) * b, torch.float32, "reglu")
    close(kt.swiglu(x[:, :32].contiguous(), x[:, 32:].contiguous()), F.silu(a) * b, torch.float32, "swiglu(a, b)")
    close(kt.glu_act(x, "leaky_relu", 0.3), F.leaky_relu(a, 0.3) * b, torch.float32, "leaky_relu glu")
    for m, ref in [
        (knn.SwiGLU(), F.silu(a) * b),
        (knn.GeGLU(), F.gelu(a) * b),
        (knn.GeGLU("tanh"), F.gelu(a, approximate="tanh") * b),
        (knn.ReGLU(), F.relu(a) * b),
    ]:
        close(m(x), ref, torch.float32, type(m).__name__)
        # PyTorch's composition on the CPU and in float64.
        close(m(x.cpu()).to(DEV), ref, torch.float32, f"{type(m).__name__} on the CPU")
        torch.testing.assert_close(m(x.double()), ref)


def test_refusals():
    x = randn(4, 6, seed=5)
    with pytest.raises(ValueError, match="2F"):
        kt.glu_act(randn(4, 5, seed=6))
    with pytest.raises(ValueError, match="one shape"):
        kt.glu_act(x, gate=randn(4, 5, seed=7))
    with pytest.raises(TypeError):
        kt.glu_act(x, gate=x.half())
    with pytest.raises(ValueError, match="unknown activation"):
        kt.glu_act(x, "nope")
    with pytest.raises(ValueError, match="approximate"):
        kt.geglu(x, approximate="fast")


def test_opcheck_eager_and_compile():
    x = randn(8, 64, seed=30).requires_grad_()
    a = randn(8, 32, seed=31).requires_grad_()
    b = randn(8, 32, seed=32).requires_grad_()
    g = randn(8, 32, seed=33)
    ops = torch.ops.rustkernels
    for op, args in [
        (ops.glu, (x, "silu", 0.0, 0.0)),
        (ops.glu, (x, "gelu", 0.0, 0.0)),
        (ops.glu_backward, (x.detach(), g, "silu", 0.0, 0.0)),
        (ops.glu2, (a, b, "gelu_tanh", 0.0, 0.0)),
        (ops.glu2_backward, (a.detach(), b.detach(), g, "silu", 0.0, 0.0)),
    ]:
        torch.library.opcheck(op, args)

    # The eager path and the custom op: the same kernels, the same bits.
    for eager, op, inputs in [
        (lambda x: kt.swiglu(x), lambda x: ops.glu(x, "silu", 0.0, 0.0), [x]),
        (lambda a, b: kt.geglu(a, b), lambda a, b: ops.glu2(a, b, "gelu", 0.0, 0.0), [a, b]),
    ]:
        ye, ge = our_grads(eager, inputs, g)
        yo, go = our_grads(op, inputs, g)
        assert torch.equal(ye, yo)
        for p, q in zip(ge, go):
            assert torch.equal(p, q)

    def f(x, a, b):
        return kt.swiglu(x) + kt.geglu(a, b, approximate="tanh")

    cf = torch.compile(f, fullgraph=True)
    ye, ge = our_grads(f, [x, a, b], g)
    yc, gc = our_grads(cf, [x, a, b], g)
    assert torch.equal(ye, yc)
    for p, q in zip(ge, gc):
        assert torch.equal(p, q)
