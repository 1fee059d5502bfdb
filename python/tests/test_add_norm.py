"""The residual add fused with layer norm and RMS norm (``kt.add_layer_norm``, ``kt.add_rms_norm``
and the ``nn`` modules ``AddLayerNorm``, ``AddRMSNorm``) against PyTorch's eager composition
``h = x + residual; y = F.layer_norm(h, ...)``: ``h`` bit for bit against PyTorch's own
``x + residual``; ``y`` and the gradients (given gradients of both ``y`` and ``h``) against PyTorch's
norm run in float64 on that ``h``, f32, f16 and bf16, on the GPU. Also: only one of the outputs
used, the modules and their fallback, opcheck of the four operators, the eager path against the
custom ops bit for bit, ``torch.compile(fullgraph=True)``, gradcheck, refusals and empty inputs.
Tolerances as ``test_ops.py``.
"""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kernels_torch as kt  # noqa: E402
from kernels_torch import nn as knn  # noqa: E402

from test_ops import DEV, DTYPES, close, randn  # noqa: E402

pytestmark = pytest.mark.gpu

# Rows not a multiple of the vector width, longer than the register-resident kernels hold, several
# normalised dimensions, an LLM width.
CASES = [
    ((64, 1024), [1024]),
    ((37, 1000), [1000]),
    ((5, 20000), [20000]),
    ((3, 4, 8, 16), [8, 16]),
    ((4, 5120), [5120]),
]


def _norm(layer, eps):
    def f(h, ns, w, b):
        return F.layer_norm(h, ns, w, b, eps) if layer else F.rms_norm(h, ns, w, eps)

    return f


def _ours(layer, eps):
    def f(x, r, ns, w, b):
        return kt.add_layer_norm(x, r, ns, w, b, eps) if layer else kt.add_rms_norm(x, r, ns, w, eps)

    return f


def _check(layer, dtype, shape, ns, w, b, eps, seed):
    """Ours against the float64 reference at PyTorch's h, for gradients of y and of h."""
    x = randn(*shape, dtype=dtype, scale=2.0, seed=seed).requires_grad_()
    r = (randn(*shape, dtype=dtype, scale=2.0, seed=seed + 1) + 0.5).requires_grad_()
    g = randn(*shape, dtype=dtype, seed=seed + 2)
    dh = randn(*shape, dtype=dtype, seed=seed + 3)
    params = [p for p in (w, b) if p is not None]
    y, h = _ours(layer, eps)(x, r, ns, w, b)
    grads = torch.autograd.grad((y, h), [x, r, *params], (g, dh))
    # h exactly as PyTorch's eager add; the reference differentiates at that h, where the
    # gradient of x (and of the residual) is dh plus the norm's.
    h_torch = x.detach() + r.detach()
    assert torch.equal(h, h_torch), f"h differs from PyTorch's x + residual ({dtype}, {shape})"
    hd = h_torch.double().requires_grad_()
    pd = [p.detach().double().requires_grad_() for p in params]
    wd, bd = (pd + [None, None])[:2] if w is not None else (None, None)
    yd = _norm(layer, eps)(hd, ns, wd, bd)
    ref = torch.autograd.grad((yd, hd), [hd, *pd], (g.double(), dh.double()))
    what = f"{'add_layer_norm' if layer else 'add_rms_norm'} {dtype} {shape}"
    close(y, yd.detach(), dtype, f"{what} forward")
    close(grads[0], ref[0], dtype, f"{what} grad of x")
    assert torch.equal(grads[0], grads[1]), f"{what}: the gradients of x and of the residual differ"
    for o, rf, n in zip(grads[2:], ref[1:], ["weight", "bias"]):
        close(o, rf, dtype, f"{what} grad of {n}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine", ["weight_bias", "weight", "none"])
def test_add_layer_norm(affine, dtype):
    for i, (shape, ns) in enumerate(CASES):
        w = (randn(*ns, dtype=dtype, seed=8) * 0.2 + 1).requires_grad_() if affine != "none" else None
        b = randn(*ns, dtype=dtype, seed=9).requires_grad_() if affine == "weight_bias" else None
        _check(True, dtype, shape, ns, w, b, 1e-5, 10 * i)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "none"])
def test_add_rms_norm(weighted, dtype):
    for i, (shape, ns) in enumerate(CASES):
        w = (randn(*ns, dtype=dtype, seed=12) * 0.2 + 1).requires_grad_() if weighted else None
        _check(False, dtype, shape, ns, w, None, 1e-6, 10 * i + 1)


@pytest.mark.parametrize("layer", [True, False], ids=["layer_norm", "rms_norm"])
def test_one_output_used(layer):
    """Only y, or only h, feeds the loss: the other output's gradient is absent (or zero)."""
    x = randn(16, 256, scale=2.0, seed=20).requires_grad_()
    r = randn(16, 256, seed=21).requires_grad_()
    w = (randn(256, seed=22) * 0.2 + 1).requires_grad_()
    eps = 1e-5
    for pick in (0, 1):
        out = _ours(layer, eps)(x, r, [256], w, None)
        gx, gw = torch.autograd.grad(out[pick].sum(), [x, w], allow_unused=True, materialize_grads=True)
        hd = (x.detach() + r.detach()).double().requires_grad_()
        wd = w.detach().double().requires_grad_()
        ref_out = (_norm(layer, eps)(hd, [256], wd, None), hd)
        rx, rw = torch.autograd.grad(ref_out[pick].sum(), [hd, wd], allow_unused=True, materialize_grads=True)
        close(gx, rx, torch.float32, f"grad of x, output {pick} used")
        close(gw, rw, torch.float32, f"grad of the weight, output {pick} used")


def test_modules():
    """The modules: LayerNorm's and RMSNorm's parameters and state_dict, the kernels on CUDA, and
    PyTorch's composition on the CPU with the same results (to the f32 tolerance)."""
    x, r = randn(8, 64, seed=30), randn(8, 64, seed=31)
    mods = [(knn.AddLayerNorm(64, device=DEV), torch.nn.LayerNorm)]
    if hasattr(knn, "AddRMSNorm"):
        mods.append((knn.AddRMSNorm(64, eps=1e-6, device=DEV), torch.nn.RMSNorm))
    for m, base in mods:
        with torch.no_grad():
            m.weight.normal_()
        assert isinstance(m, base) and m.state_dict().keys() == base(64).state_dict().keys()
        y, h = m(x, r)
        assert torch.equal(h, x + r)
        cpu = m.to("cpu")
        yc, hc = cpu(x.cpu(), r.cpu())
        close(y.cpu(), yc, torch.float32, f"{type(m).__name__} on CUDA against its CPU fallback")
        assert torch.equal(hc, (x + r).cpu())


def test_opcheck():
    x = randn(8, 64, seed=40).requires_grad_()
    r = randn(8, 64, seed=41).requires_grad_()
    w = randn(64, seed=42).requires_grad_()
    b = randn(64, seed=43).requires_grad_()
    g, dh = randn(8, 64, seed=44), randn(8, 64, seed=45)
    ops = torch.ops.rustkernels
    _, h, mean, rstd = ops.add_layer_norm(x, r, [64], w, b, 1e-5)
    _, _, rrstd = ops.add_rms_norm(x, r, [64], w, 1e-6)
    h = h.detach()
    cases = [
        (ops.add_layer_norm, (x, r, [64], w, b, 1e-5)),
        (ops.add_layer_norm, (x, r, [64], None, None, 1e-5)),
        (ops.add_rms_norm, (x, r, [64], w, 1e-6)),
        (ops.add_layer_norm_backward, (h, [64], w.detach(), mean, rstd, g, dh, True, True)),
        (ops.add_layer_norm_backward, (h, [64], None, mean, rstd, g, None, False, False)),
        (ops.add_rms_norm_backward, (h, [64], w.detach(), rrstd, g, dh, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_eager_path_and_custom_op_path_agree():
    x = randn(32, 128, seed=50).requires_grad_()
    r = randn(32, 128, seed=51).requires_grad_()
    w = randn(128, seed=52).requires_grad_()
    g, dh = randn(32, 128, seed=53), randn(32, 128, seed=54)
    ops = torch.ops.rustkernels
    pairs = [
        (lambda x, r, w: kt.add_layer_norm(x, r, [128], w),
         lambda x, r, w: ops.add_layer_norm(x, r, [128], w, None, 1e-5)[:2]),
        (lambda x, r, w: kt.add_rms_norm(x, r, [128], w, 1e-6),
         lambda x, r, w: ops.add_rms_norm(x, r, [128], w, 1e-6)[:2]),
    ]  # fmt: skip
    for eager, op in pairs:
        outs = []
        for f in (eager, op):
            leaves = [t.detach().clone().requires_grad_() for t in (x, r, w)]
            y, h = f(*leaves)
            outs.append((y.detach(), h.detach(), torch.autograd.grad((y, h), leaves, (g, dh))))
        (ye, he, ge), (yo, ho, go) = outs
        assert torch.equal(ye, yo) and torch.equal(he, ho)
        for a, c in zip(ge, go):
            assert torch.equal(a, c)


def test_torch_compile_fullgraph():
    def block(x, r, w):
        y, h = kt.add_rms_norm(x, r, [x.shape[-1]], w, 1e-6)
        y2, h2 = kt.add_layer_norm(kt.silu(y), h, [x.shape[-1]], w)
        return (y2.float() * h2.float()).sum()

    x = randn(64, 256, seed=60).requires_grad_()
    r = randn(64, 256, seed=61).requires_grad_()
    w = (randn(256, seed=62) * 0.1 + 1).requires_grad_()
    cf = torch.compile(block, fullgraph=True)
    res = []
    for f in (block, cf):
        leaves = [t.detach().clone().requires_grad_() for t in (x, r, w)]
        loss = f(*leaves)
        res.append((loss.detach(), torch.autograd.grad(loss, leaves)))
    (le, ge), (lc, gc) = res
    assert torch.equal(le, lc)
    for a, c in zip(ge, gc):
        assert torch.equal(a, c)


def test_gradcheck_f32():
    """Finite differences in f32, as test_ops.py's gradcheck (its step and tolerances)."""
    import warnings

    x = randn(3, 8, scale=1.5, seed=70).requires_grad_()
    r = randn(3, 8, seed=71).requires_grad_()
    w = (randn(8, seed=72) * 0.2 + 1).requires_grad_()
    b = randn(8, seed=73).requires_grad_()
    cases = {
        "add_layer_norm": (lambda x, r, w, b: kt.add_layer_norm(x, r, [8], w, b), [x, r, w, b]),
        "add_rms_norm": (lambda x, r, w: kt.add_rms_norm(x, r, [8], w, 1e-6), [x, r, w]),
    }
    for name, (f, inputs) in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=2e-3, rtol=2e-2), name


def test_refusals_and_empty_inputs():
    x = randn(4, 8)
    with pytest.raises(ValueError, match="residual has shape"):
        kt.add_rms_norm(x, randn(4, 4), [8])
    with pytest.raises(TypeError, match="residual has dtype"):
        kt.add_layer_norm(x, x.half(), [8])
    with pytest.raises(ValueError, match="residual is on cpu"):
        kt.add_layer_norm(x, x.cpu(), [8])
    with pytest.raises(ValueError, match="weight has shape"):
        kt.add_rms_norm(x, x, [8], torch.ones(4, device=DEV))
    for shape, ns in [((0, 8), [8]), ((4, 0), [0])]:
        e = torch.empty(shape, device=DEV).requires_grad_()
        w = torch.ones(ns, device=DEV, requires_grad=True)
        y, h = kt.add_layer_norm(e, e, ns, w)
        assert y.shape == h.shape == e.shape
        (y.sum() + h.sum()).backward()
        assert w.grad.shape == tuple(ns) and not w.grad.any()
