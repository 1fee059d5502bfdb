"""Each operator against PyTorch's own implementation, forward and backward, f32, f16 and bf16, on
the GPU.

The reference is PyTorch's implementation run in float64 on the same (rounded) inputs. Tolerance,
elementwise: ``|ours - ref| <= eps * |ref| + eps * max(1, max|ref|)`` with ``eps`` = 1e-5 for f32
(about 80 ulp: the library's math is within 2 ulp, its ops add a few f32 roundings and row sums
of up to 50000 terms) and one unit of the last place of the storage type for f16 (2^-10) and
bf16 (2^-7): the kernels compute in f32 and round once to the storage type. The absolute term
lets values that come from cancellation (a small sum of large terms) err by that much relative
to the tensor's largest magnitude.
"""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kernels_torch as kt  # noqa: E402
from kernels_torch import _native  # noqa: E402
from kernels_torch import nn as knn  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
DEV = "cuda"


def close(ours, ref, dtype, what="", k=1):
    """Within the module's tolerance, ``k`` times it for a result that rounds ``k`` times as often."""
    assert ours.dtype == dtype, f"{what}: dtype {ours.dtype}, expected {dtype}"
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
    eps = k * EPS[dtype]
    ref = ref.double()
    big = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    torch.testing.assert_close(ours.double(), ref, rtol=eps, atol=eps * big, msg=lambda m: f"{what}: {m}")


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def ref_grads(f, inputs, grad):
    """PyTorch's f in float64 on the inputs, and the gradients of `inputs` given `grad`."""
    leaves = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    y = f(*leaves)
    want = [t for t in leaves if t is not None and t.requires_grad]
    gs = torch.autograd.grad(y, want, grad.double())
    return y.detach(), gs


def our_grads(f, inputs, grad):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    y = f(*leaves)
    want = [t for t in leaves if t is not None and t.requires_grad]
    gs = torch.autograd.grad(y, want, grad)
    return y.detach(), gs


def _torch_of(name):
    """PyTorch's version of an op of the table (its ``torch`` column)."""
    return eval(kt.UNARY_OPS[name][5], {"torch": torch, "F": F})


def _ours_of(name):
    return (lambda x, *p: kt.gelu(x, "tanh")) if name == "gelu_tanh" else getattr(kt, name)


# Every activation of the op table with PyTorch's defaults (name -> (ours, PyTorch's)), and some
# with other parameters.
ACTS = {
    name: (lambda x, n=name, p=params: _ours_of(n)(x, *(d for _, d in p)),
           lambda x, n=name, p=params: _torch_of(n)(x, *(d for _, d in p)))
    for name, (_, params) in kt.ACTIVATIONS.items()
    if name != "identity"
}  # fmt: skip
for _name, _p in [("leaky_relu", (0.2,)), ("softplus", (2.0, 5.0)), ("elu", (0.5,)), ("celu", (2.5,))]:
    ACTS[f"{_name}{_p}"] = (lambda x, n=_name, p=_p: _ours_of(n)(x, *p), lambda x, n=_name, p=_p: _torch_of(n)(x, *p))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(ACTS))
def test_activation(name, dtype):
    ours, ref = ACTS[name]
    for shape, seed in [((257, 1031), 1), ((3,), 2), ((0, 5), 3)]:
        x = randn(*shape, dtype=dtype, scale=3.0, seed=seed).requires_grad_()
        g = randn(*shape, dtype=dtype, seed=seed + 100)
        y, (gx,) = our_grads(ours, [x], g)
        ry, (rgx,) = ref_grads(ref, [x], g)
        close(y, ry, dtype, f"{name} forward {shape}")
        close(gx, rgx, dtype, f"{name} backward {shape}")


# The fused act(x * scale + bias) for every activation, PyTorch's version beside it; softplus
# with other parameters than its defaults.
SBA_PARAMS = {name: tuple(d for _, d in params) for name, (_, params) in kt.ACTIVATIONS.items()}
SBA_PARAMS["softplus"] = (1.5, 4.0)
SBA = {name: (lambda x, n=name: _torch_of(n)(x, *SBA_PARAMS[n])) for name in SBA_PARAMS}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(SBA))
def test_scale_bias_act(act, dtype):
    params = SBA_PARAMS[act]
    for rows, cols in [(96, 1000), (5, 33)]:
        x = randn(rows, cols, dtype=dtype, scale=2.0, seed=1).requires_grad_()
        s = randn(cols, dtype=dtype, seed=2).requires_grad_()
        b = randn(cols, dtype=dtype, seed=3).requires_grad_()
        g = randn(rows, cols, dtype=dtype, seed=4)
        y, gs = our_grads(lambda x, s, b: kt.scale_bias_act(x, s, b, act, *params), [x, s, b], g)
        ry, rgs = ref_grads(lambda x, s, b: SBA[act](x * s + b), [x, s, b], g)
        close(y, ry, dtype, f"{act} forward")
        for o, r, n in zip(gs, rgs, ["x", "scale", "bias"]):
            close(o, r, dtype, f"{act} grad of {n}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax(log, dtype):
    ours = kt.log_softmax if log else kt.softmax
    ref = torch.log_softmax if log else torch.softmax
    for shape, dim in [((64, 1000), -1), ((33, 4096), -1), ((6, 50001), -1), ((4, 7, 130), -1), ((40, 24), 0)]:
        x = randn(*shape, dtype=dtype, scale=4.0, seed=5).requires_grad_()
        g = randn(*shape, dtype=dtype, seed=6)
        y, (gx,) = our_grads(lambda x: ours(x, dim), [x], g)
        ry, (rgx,) = ref_grads(lambda x: ref(x, dim), [x], g)
        close(y, ry, dtype, f"forward {shape}")
        close(gx, rgx, dtype, f"backward {shape}")


NORM_CASES = [((64, 1024), [1024]), ((37, 1000), [1000]), ((5, 20000), [20000]), ((3, 4, 8, 16), [8, 16])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine", ["weight_bias", "weight", "none"])
def test_layer_norm(affine, dtype):
    for shape, ns in NORM_CASES:
        x = randn(*shape, dtype=dtype, scale=2.0, seed=7).add(0.5).requires_grad_()
        w = (randn(*ns, dtype=dtype, seed=8) * 0.2 + 1).requires_grad_() if affine != "none" else None
        b = randn(*ns, dtype=dtype, seed=9).requires_grad_() if affine == "weight_bias" else None
        g = randn(*shape, dtype=dtype, seed=10)
        y, gs = our_grads(lambda x, w, b: kt.layer_norm(x, ns, w, b, 1e-5), [x, w, b], g)
        ry, rgs = ref_grads(lambda x, w, b: F.layer_norm(x, ns, w, b, 1e-5), [x, w, b], g)
        close(y, ry, dtype, f"forward {shape}")
        assert len(gs) == len(rgs)
        for o, r, n in zip(gs, rgs, ["x", "weight", "bias"]):
            close(o, r, dtype, f"grad of {n} {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "none"])
def test_rms_norm(weighted, dtype):
    eps = torch.finfo(dtype).eps
    for shape, ns in NORM_CASES:
        x = randn(*shape, dtype=dtype, scale=2.0, seed=11).requires_grad_()
        w = (randn(*ns, dtype=dtype, seed=12) * 0.2 + 1).requires_grad_() if weighted else None
        g = randn(*shape, dtype=dtype, seed=13)
        y, gs = our_grads(lambda x, w: kt.rms_norm(x, ns, w), [x, w], g)  # eps=None: the dtype's
        ry, rgs = ref_grads(lambda x, w: F.rms_norm(x, ns, w, eps), [x, w], g)
        close(y, ry, dtype, f"forward {shape}")
        for o, r, n in zip(gs, rgs, ["x", "weight"]):
            close(o, r, dtype, f"grad of {n} {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(reduction, dtype):
    for (n, c), smoothing in [((256, 5000), 0.0), ((64, 1000), 0.1), ((3, 7), 0.0)]:
        x = randn(n, c, dtype=dtype, scale=3.0, seed=14).requires_grad_()
        t = torch.randint(0, c, (n,), device=DEV, generator=torch.Generator(device=DEV).manual_seed(15))
        t[::5] = -100  # ignored rows
        g = randn(n, dtype=dtype, seed=16) if reduction == "none" else torch.tensor(1.5, device=DEV, dtype=dtype)
        kw = dict(reduction=reduction, label_smoothing=smoothing)
        y, (gx,) = our_grads(lambda x: kt.cross_entropy(x, t, **kw), [x], g)
        ry, (rgx,) = ref_grads(lambda x: F.cross_entropy(x, t, **kw), [x], g)
        close(y, ry, dtype, f"loss {n}x{c}")
        close(gx, rgx, dtype, f"grad {n}x{c}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_shapes_weights_and_probabilities(reduction, dtype):
    """PyTorch's other forms: ``[N, C, d1, d2]`` and unbatched ``[C]`` on the fused kernel (its
    tolerance); class weights and class probabilities, our log-softmax under PyTorch's formulas,
    which round each of their element-wise products (target, weight, smoothing) to the storage
    type: up to four roundings where the fused kernel has one, so four times the tolerance."""
    gen = torch.Generator(device=DEV).manual_seed(17)
    c = 11
    w = (torch.rand(c, device=DEV, generator=gen) + 0.5).to(dtype)
    idx = torch.randint(0, c, (3, 5, 2), device=DEV, generator=gen)
    idx[0, ::2] = -100
    probs = torch.softmax(randn(3, c, 5, seed=18), dim=1).to(dtype)
    cases = [
        # (name, logits shape, target, weight, smoothing, k)
        ("spatial", (3, c, 5, 2), idx, None, 0.0, 1),
        ("spatial smoothed", (3, c, 5, 2), idx, None, 0.2, 1),
        ("unbatched", (c,), torch.tensor(4, device=DEV), None, 0.0, 1),
        ("weighted", (15, c), idx[:, :, 0].reshape(-1), w, 0.0, 4),
        ("weighted smoothed", (3, c, 5), idx[:, :, 1], w, 0.1, 4),
        ("probabilities", (3, c, 5), probs, None, 0.0, 4),
        ("probabilities weighted smoothed", (3, c, 5), probs, w, 0.1, 4),
    ]
    for name, shape, t, wt, ls, k in cases:
        x = randn(*shape, dtype=dtype, scale=2.0, seed=19).requires_grad_()
        out_shape = () if reduction != "none" else (t.shape if not t.is_floating_point() else shape[:1] + shape[2:])
        g = randn(*out_shape, dtype=dtype, seed=20) if out_shape else torch.tensor(1.5, device=DEV, dtype=dtype)
        kw = dict(reduction=reduction, label_smoothing=ls)
        y, (gx,) = our_grads(lambda x: kt.cross_entropy(x, t, wt, **kw), [x], g)
        tr = t.double() if t.is_floating_point() else t
        wr = None if wt is None else wt.double()
        ry, (rgx,) = ref_grads(lambda x: F.cross_entropy(x, tr, wr, **kw), [x], g)
        close(y, ry, dtype, f"{name}: loss", k)
        close(gx, rgx, dtype, f"{name}: grad", k)
        if reduction == "mean":
            m = knn.CrossEntropyLoss(weight=wt, label_smoothing=ls)
            close(m(x.detach(), t), ry, dtype, f"{name}: nn.CrossEntropyLoss", k)


def test_softmax_of_0d_and_empty_norms():
    """PyTorch's edge cases: softmax of a 0-d tensor is 1 (log-softmax 0); layer and RMS norm of
    empty tensors (no rows, or rows of length 0) give empty results, with or without parameters,
    and zero parameter gradients."""
    x = torch.tensor(3.0, device=DEV, requires_grad=True)
    y = kt.softmax(x, 0)
    assert y.shape == () and y.item() == 1.0
    assert kt.log_softmax(x).item() == 0.0
    y.backward()
    assert x.grad.item() == 0.0
    with pytest.raises(IndexError):
        kt.softmax(x, 1)
    for shape, ns in [((0, 8), [8]), ((4, 0), [0]), ((2, 0, 3), [3])]:
        x = torch.empty(shape, device=DEV).requires_grad_()
        w = torch.ones(ns, device=DEV, requires_grad=True)
        b = torch.zeros(ns, device=DEV, requires_grad=True)
        y = kt.layer_norm(x, ns, w, b)
        assert y.shape == x.shape
        y.sum().backward()
        assert w.grad.shape == tuple(ns) and not w.grad.any() and not b.grad.any()
        r = kt.rms_norm(x, ns, w)
        assert r.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_one_pass(reduction, dtype):
    """Against F.cross_entropy (plus the z-loss written out in PyTorch) in float64, with rows whose
    length is not a multiple of the vector width, ignored rows and a loss gradient other than 1."""
    cases = [((256, 5003), 0.0, 0.0), ((64, 1000), 0.1, 1e-3), ((3, 7), 0.0, 0.0), ((2, 1), 0.2, 0.0)]
    for (n, c), smoothing, z in cases:
        x = randn(n, c, dtype=dtype, scale=3.0, seed=14).requires_grad_()
        t = torch.randint(0, c, (n,), device=DEV, generator=torch.Generator(device=DEV).manual_seed(15))
        t[::5] = -100  # ignored rows
        g = randn(n, dtype=dtype, seed=16) if reduction == "none" else torch.tensor(1.5, device=DEV, dtype=dtype)
        kw = dict(reduction=reduction, label_smoothing=smoothing)

        def ref(x):
            loss = F.cross_entropy(x, t, **kw)
            zl = torch.where(t != -100, torch.logsumexp(x, -1) ** 2, 0.0) * z
            return loss + {"none": zl, "sum": zl.sum(), "mean": zl.sum() / (t != -100).sum()}[reduction]

        y, (gx,) = our_grads(lambda x: kt.cross_entropy_one_pass(x, t, z_loss=z, **kw), [x], g)
        ry, (rgx,) = ref_grads(ref, [x], g)
        close(y, ry, dtype, f"loss {n}x{c}")
        close(gx, rgx, dtype, f"grad {n}x{c}")


def test_cross_entropy_out_of_range_target_names_its_row():
    x = randn(4, 10)
    t = torch.tensor([1, 2, 10, 3], device=DEV)
    with pytest.raises(ValueError, match="target of row 2 is outside"):
        kt.cross_entropy(x, t)


# --- gradcheck --------------------------------------------------------------------------------


def test_gradcheck_f32():
    """Finite differences in f32 (the kernels have no f64): eps 1e-3 gives a truncation error near
    1e-7 and a rounding error near 1e-4 of the function's magnitude (about 1), under the atol."""
    x = randn(3, 8, scale=1.5, seed=20).requires_grad_()
    w = (randn(8, seed=21) * 0.2 + 1).requires_grad_()
    b = randn(8, seed=22).requires_grad_()
    t = torch.tensor([0, 7, 3], device=DEV)
    cases = {
        "gelu": (kt.gelu, [x]),
        "gelu_tanh": (lambda x: kt.gelu(x, "tanh"), [x]),
        "silu": (kt.silu, [x]),
        "mish": (kt.mish, [x]),
        "softplus": (lambda x: kt.softplus(x, 2.0), [x]),  # threshold 20: no kink near x
        "softsign": (kt.softsign, [x]),
        "elu": (kt.elu, [x]),  # alpha 1: the derivative is continuous at 0
        "sigmoid": (kt.sigmoid, [x]),
        "tanh": (kt.tanh, [x]),
        "softmax": (kt.softmax, [x]),
        "log_softmax": (kt.log_softmax, [x]),
        "layer_norm": (lambda x, w, b: kt.layer_norm(x, [8], w, b), [x, w, b]),
        "rms_norm": (lambda x, w: kt.rms_norm(x, [8], w, 1e-6), [x, w]),
        "scale_bias_act": (lambda x, w, b: kt.scale_bias_act(x, w, b, "gelu"), [x, w, b]),
        "cross_entropy": (lambda x: kt.cross_entropy(x, t, label_smoothing=0.1), [x]),
    }
    import warnings

    for name, (f, inputs) in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "not a double precision floating point"
            assert torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=2e-3, rtol=2e-2), name


def test_opcheck():
    """torch.library.opcheck: schema, fake implementation, autograd registration and AOT dispatch
    of every operator on real CUDA tensors."""
    x = randn(8, 64, seed=30).requires_grad_()
    w = randn(64, seed=31).requires_grad_()
    b = randn(64, seed=32).requires_grad_()
    g = randn(8, 64, seed=33)
    t = torch.tensor([0, 1, 2, 3, 4, 5, 6, -100], device=DEV)
    ops = torch.ops.rustkernels
    cases = [
        (ops.gelu, (x,)),
        (ops.softplus, (x, 2.0, 5.0)),
        (ops.leaky_relu, (x, 0.3)),
        (ops.gelu_backward, (x.detach(), g)),
        (ops.sigmoid_backward, (torch.sigmoid(x).detach(), g)),
        (ops.scale_bias_act, (x, w, b, "silu", 0.0, 0.0)),
        (ops.scale_bias_act_backward, (x.detach(), w.detach(), b.detach(), g, "silu", 0.0, 0.0)),
        (ops.softmax, (x,)),
        (ops.log_softmax_backward, (x.detach().log_softmax(-1), g)),
        (ops.layer_norm, (x, [64], w, b, 1e-5)),
        (ops.layer_norm, (x, [64], None, None, 1e-5)),
        (ops.rms_norm, (x, [64], w, 1e-6)),
        (ops.cross_entropy, (x, t, "mean", -100, 0.0)),
        (ops.cross_entropy, (x, t, "none", -100, 0.2)),
        (ops.cross_entropy_one_pass, (x, t, "mean", -100, 0.0, 0.0)),
        (ops.cross_entropy_one_pass, (x, t, "none", -100, 0.2, 1e-3)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


# --- streams, views, layouts, refusals ----------------------------------------------------------


def test_runs_on_the_current_stream():
    """On a side stream, the op must see what the stream computed just before it (after a long
    sleep), and work queued after it must see its output: no synchronisation anywhere."""
    x = randn(1024, 1024, seed=40)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time on s
        x3 = x * 3  # on s, after the sleep
        y = kt.gelu(x3)
        z = kt.layer_norm(y, [1024])
        p = kt.softmax(z + 1)
        loss = kt.cross_entropy(p, torch.zeros(1024, dtype=torch.long, device=DEV))
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    # Element by element: a sum over the layer norm's output is a cancellation (about 0), whose
    # f32 rounding says nothing about the ordering.
    yr = F.gelu((x * 3).double())
    zr = F.layer_norm(yr, [1024])
    pr = torch.softmax(zr + 1, -1)
    lr = F.cross_entropy(pr, torch.zeros(1024, dtype=torch.long, device=DEV))
    for o, r, what in [(y, yr, "gelu"), (z, zr, "layer norm"), (p, pr, "softmax"), (loss, lr, "cross-entropy")]:
        close(o, r, torch.float32, f"{what} on a side stream")


def test_views_with_offsets_and_strides():
    base = randn(65, 1024, seed=41)
    x = base[1:]  # storage offset 1024 elements: aligned, used in place
    assert x.storage_offset() == 1024 and x.is_contiguous()
    close(kt.silu(x), F.silu(x.double()), torch.float32, "offset view")
    flat = randn(4099, seed=42)
    xm = flat[3:].view(64, 64)  # offset 12 bytes: misaligned, copied first
    assert xm.data_ptr() % 16 != 0
    close(kt.gelu(xm), F.gelu(xm.double()), torch.float32, "misaligned view")
    close(kt.layer_norm(xm, [64]), F.layer_norm(xm.double(), [64]), torch.float32, "misaligned view, layer norm")
    xt = randn(64, 100, seed=43).t()  # non-contiguous
    close(kt.softmax(xt), torch.softmax(xt.double(), -1), torch.float32, "transposed")
    assert flat.sum().isfinite()  # the inputs were not written
    # Gradients arriving with zero strides (from .sum()) and expanded tensors.
    xe = randn(32, 64, seed=44).requires_grad_()
    kt.mish(xe).sum().backward()
    xr = xe.detach().double().requires_grad_()
    F.mish(xr).sum().backward()
    close(xe.grad, xr.grad, torch.float32, "expanded gradient")


# The native layer's plain element-wise ops (for benches/torch_paired.py): parameters,
# PyTorch's function and whether the input must be positive.
NATIVE_UNARY = {
    "neg": ((), torch.neg, False),
    "exp": ((), torch.exp, False),
    "log": ((), torch.log, True),
    "erf": ((), torch.erf, False),
    "rsqrt": ((), torch.rsqrt, True),
    "pow": ((2.5,), lambda x: torch.pow(x, 2.5), True),
    "clamp": ((-0.5, 0.75), lambda x: torch.clamp(x, -0.5, 0.75), False),
    "div_scalar": ((1.5,), lambda x: x / 1.5, False),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(NATIVE_UNARY))
def test_native_unary_and_binary(name, dtype):
    params, ref, positive = NATIVE_UNARY[name]
    code = kt.UNARY_OPS[name][0]  # the op's row in the table the native module exports
    a, b = (tuple(params) + (0.0, 0.0))[:2]
    dt = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
    stream = torch.cuda.current_stream().cuda_stream
    for n, seed in [(65536, 1), (1031, 2), (3, 3)]:
        x = randn(n, dtype=dtype, seed=seed)
        x = x.abs() + 0.25 if positive else x
        g, y = randn(n, dtype=dtype, seed=seed + 10), randn(n, dtype=dtype, seed=seed + 20)
        # Divisors away from 0: x / y must not overflow f16 where the float64 reference does not.
        y = torch.where(y < 0, y - 0.5, y + 0.5)
        out = torch.full_like(x, float("nan"))
        _native.unary_fwd(0, stream, dt, code, a, b, x.data_ptr(), out.data_ptr(), n)
        close(out, ref(x.double()), dtype, f"{name} forward {n}")
        xr = x.double().requires_grad_()
        (rgx,) = torch.autograd.grad(ref(xr), xr, g.double())
        gx = torch.full_like(x, float("nan"))
        _native.unary_bwd(0, stream, dt, code, a, b, x.data_ptr(), g.data_ptr(), gx.data_ptr(), n)
        close(gx, rgx, dtype, f"{name} backward {n}")
        for op, f in enumerate([torch.add, torch.sub, torch.mul, torch.div]):
            out = torch.full_like(x, float("nan"))
            _native.binary_fwd(0, stream, dt, op, x.data_ptr(), y.data_ptr(), out.data_ptr(), n)
            close(out, f(x.double(), y.double()), dtype, f"binary {op} {n}")


def test_sigmoid_and_tanh_keep_their_output():
    """Their autograd saves the output, not the input (as PyTorch's), and the backward from it
    matches float64 autograd at the input; the backward ops take the output."""
    for f, ref in [(kt.sigmoid, torch.sigmoid), (kt.tanh, torch.tanh)]:
        for dtype in DTYPES:
            x = randn(4099, dtype=dtype, scale=3.0, seed=50).requires_grad_()
            g = randn(4099, dtype=dtype, seed=51)
            y = f(x)
            (saved,) = y.grad_fn.saved_tensors
            assert saved.data_ptr() == y.data_ptr() and saved.data_ptr() != x.data_ptr(), f
            (gx,) = torch.autograd.grad(y, x, g)
            xr = x.detach().double().requires_grad_()
            (rgx,) = torch.autograd.grad(ref(xr), xr, g.double())
            close(gx, rgx, dtype, f"{ref.__name__} backward from the output")
            op = getattr(torch.ops.rustkernels, ref.__name__ + "_backward")
            close(op(y.detach(), g), rgx, dtype, f"{ref.__name__}_backward op")


def test_native_refuses_misaligned_addresses():
    x = randn(64)
    y = torch.empty_like(x)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        _native.activation_fwd(0, 0, 0, kt.ACTIVATIONS["gelu"][0], 0.0, 0.0, x.data_ptr() + 4, y.data_ptr(), 32)


def test_refusals():
    x = randn(4, 8)
    with pytest.raises(TypeError, match="dtype torch.float64"):
        kt.gelu(x.double())
    with pytest.raises(TypeError, match="dtype torch.int64"):
        kt.silu(torch.ones(4, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="weight is on cpu"):
        kt.layer_norm(x, [8], torch.ones(8))
    with pytest.raises(TypeError, match="weight has dtype torch.float16 but must be torch.float32"):
        kt.layer_norm(x, [8], torch.ones(8, device=DEV, dtype=torch.float16))
    with pytest.raises(ValueError, match="weight has shape"):
        kt.rms_norm(x, [8], torch.ones(4, device=DEV))
    with pytest.raises(ValueError, match="normalized_shape"):
        kt.layer_norm(x, [4])
    with pytest.raises(ValueError, match="bias has shape"):
        kt.scale_bias_act(x, torch.ones(8, device=DEV), torch.ones(7, device=DEV))
    with pytest.raises(TypeError, match="target has dtype torch.int32"):
        kt.cross_entropy(x, torch.zeros(4, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match=r"take class indices of shape \[2, 8\]"):
        kt.cross_entropy(x.view(2, 2, 8), torch.zeros(2, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="x is on cpu"):
        kt.mish(x.cpu())


def test_modules_use_the_kernels_on_cuda_and_pytorch_elsewhere():
    x = randn(16, 32, seed=50)
    calls = []
    orig = _native.activation_fwd

    def spy(*a):
        calls.append(a)
        return orig(*a)

    import kernels_torch._ops as ops_mod

    ops_mod._native.activation_fwd = spy
    try:
        close(knn.Swish()(x), F.silu(x.double()), torch.float32, "Swish on CUDA")
        assert len(calls) == 1
        knn.Swish()(x.cpu())
        knn.Swish()(x.double())  # float64: PyTorch's
        assert len(calls) == 1
    finally:
        ops_mod._native.activation_fwd = orig
    m = knn.FusedBiasAct(32, "gelu", scale=True, device=DEV)
    with torch.no_grad():
        m.bias.normal_()
        m.scale.normal_()
    close(m(x), F.gelu(x.double() * m.scale.double() + m.bias.double()), torch.float32, "FusedBiasAct")
    ln = knn.LayerNorm(32, device=DEV)
    close(ln(x), F.layer_norm(x.double(), [32], ln.weight.double(), ln.bias.double()), torch.float32, "LayerNorm")
    ce = knn.CrossEntropyLoss()
    t = torch.arange(16, device=DEV)
    close(ce(x, t), F.cross_entropy(x.double(), t), torch.float32, "CrossEntropyLoss")


def test_eager_path_and_custom_op_path_agree():
    """The functions take a thin eager path (an autograd.Function calling the implementations);
    the custom ops (torch.ops.rustkernels.*) run the same kernels: the same bits both ways.

    Each pair is differentiated with respect to exactly the inputs it uses (autograd.grad refuses
    an input that is not in the graph), and must return a gradient for every one of them."""
    x = randn(32, 128, seed=70).requires_grad_()
    w = randn(128, seed=71).requires_grad_()
    g = randn(32, 128, seed=72)
    lw = (randn(128, 128, seed=73) / 16).requires_grad_()  # a linear layer's weight and bias
    lb = randn(128, seed=74).requires_grad_()
    ops = torch.ops.rustkernels
    pairs = [
        ("silu", kt.silu, ops.silu, [x]),
        ("layer_norm", lambda x, w: kt.layer_norm(x, [128], w), lambda x, w: ops.layer_norm(x, [128], w, None, 1e-5)[0],
         [x, w]),
        ("log_softmax", kt.log_softmax, ops.log_softmax, [x]),
        ("linear relu", lambda x, w, b: kt.linear(x, w, b, "relu"), lambda x, w, b: ops.linear(x, w, b, "relu"),
         [x, lw, lb]),
        ("linear gelu", lambda x, w, b: kt.linear(x, w, b, "gelu"), lambda x, w, b: ops.linear_train(x, w, b, "gelu")[0],
         [x, lw, lb]),
    ]  # fmt: skip
    for name, eager, op, inputs in pairs:
        ye, ge = our_grads(eager, inputs, g)
        yo, go = our_grads(op, inputs, g)
        assert len(ge) == len(go) == len(inputs), name
        assert torch.equal(ye, yo), name
        for i, (a, b) in enumerate(zip(ge, go)):
            assert a is not None and b is not None, f"{name}: no gradient for input {i}"
            assert torch.equal(a, b), f"{name}: gradients of input {i} differ"


def test_torch_compile_fullgraph():
    def f(x, w, b):
        h = kt.scale_bias_act(x, w, b, "silu")
        h = kt.layer_norm(h, [h.shape[-1]], w, b)
        return kt.cross_entropy(kt.gelu(h), torch.zeros(x.shape[0], dtype=torch.long, device=x.device))

    x = randn(64, 256, seed=60).requires_grad_()
    w = (randn(256, seed=61) * 0.1 + 1).requires_grad_()
    b = randn(256, seed=62).requires_grad_()
    cf = torch.compile(f, fullgraph=True)
    ye, ge = our_grads(f, [x, w, b], torch.tensor(1.0, device=DEV))
    yc, gc = our_grads(cf, [x, w, b], torch.tensor(1.0, device=DEV))
    # The same kernels on the same inputs: bit for bit.
    assert torch.equal(ye, yc)
    for a, c in zip(ge, gc):
        assert torch.equal(a, c)
