"""The linear layer, ``act(x @ W^T + b)`` (``kernels_torch.linear``, ``torch.ops.rustkernels.linear``,
``linear_train``, ``linear_backward``, ``kernels_torch.nn.Linear``), on the GPU, against PyTorch's
``F.linear`` and activation run in float64 on the same f32 inputs.

Tolerance: a worst-case bound per element, not a fitted one (none was widened to pass).
``u = 2^-24`` is f32's unit roundoff. Each pre-activation ``z = sum_k x_k w_k + b`` is a sum of K
products and the bias accumulated in f32 with FMAs, in some order (one running sum per thread, or
split-K's ``s <= K / 256`` slices added in order); any such summation errs by at most ``(K + s) u
S`` to first order, ``S = sum_k |x_k w_k| + |b|``, and the store adds a few roundings: ``|z -
z_exact| <= (K + s + 4) u S`` (the bound of the library's GEMM tests, ``tests/gemm.rs``). The
activation passes that error on with its slope (at most 1.13 for GELU, 1.1 for SiLU; 1.2 is used)
and adds its own error (the library's element-wise bounds, ``tests/common/reference.rs``:
SiLU 5 ulp, GELU 4 ulp + 2|z| ulp absolute, GELU-tanh 6 ulp + 4|z| ulp; relu and identity exact).
Backward: ``dz = act'(z) dy`` carries the activation backward's bound plus z's error times
``|act''| <= 0.8`` (GELU's largest; SiLU's is 0.5), or, for relu, where ``|z|`` is within z's
error, all of ``|dy|`` (the sign of z may flip); ``dx = dz W``, ``dW = dz^T x`` add ``(K' + s + 4)
u S'`` for their own sums (K' = out and rows) and pass dz's error on through ``|W|`` and ``|x|``;
``db``, a column sum of ``rows`` terms in some order, adds ``(rows + 4) u sum |dz|``. The tests
also print the largest error as a fraction of its bound (typically near ``sqrt(K) / K`` of it:
random rounding errors cancel).

Plain TF32 (``set_float32_matmul_precision("high")``) rounds each operand of every product (the
forward's and the backward's) to TF32, to nearest: ``x' = x (1 + d)``, ``|d| <= 2^-11`` (half a
step of 10 mantissa bits; normal values, as the random data are). The tensor core multiplies
``x' w'`` exactly, so each term errs by ``|x w| |dx + dw + dx dw| <= rho |x w|``, ``rho = 2^-10 +
2^-22``; the sum of the rounded terms then errs as 3xTF32's does, of ``S' <= S + rho S_p``
(``S_p = sum_k |x_k w_k|``, without the bias): in all ``sum_terms(K) u S + rho (1 + sum_terms(K)
u) S_p`` (``operand_terms``).
"""

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kernels_torch as kt  # noqa: E402
from kernels_torch import nn as knn  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
U = 2.0**-24  # f32 unit roundoff
ULP = 2.0**-23  # f32 ulp of 1 (the element-wise bounds are stated in it)
ACTS = ["identity", "relu", "gelu", "gelu_tanh", "silu"]
REF = {
    "identity": lambda z: z,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}
SLOPE = {"identity": 1.0, "relu": 1.0, "gelu": 1.2, "gelu_tanh": 1.2, "silu": 1.2}


def randn(*shape, scale=1.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV) * scale


def sum_terms(k: int, precision: str = "highest") -> int:
    """Roundings on a sum of k products in the GEMM: k, split-K's slices (at most k / 256), 4.
    In 3xTF32 (``tests/gemm.rs``): each product off by up to 24 u of itself, the tensor core's
    truncating additions up to 1.5 k u: ``2 k + s + 32``; plain TF32 ("high") sums as 3xTF32."""
    return k + k // 256 + 4 if precision == "highest" else 2 * k + k // 256 + 32


RHO = 2.0**-10 + 2.0**-22  # plain TF32: a product of two operands rounded to TF32, relative


def operand_terms(k: int, precision: str = "highest") -> float:
    """Plain TF32's further error, a multiple of ``S_p = sum |x w|`` (module docstring)."""
    return RHO * (1 + sum_terms(k, precision) * U) if precision == "high" else 0.0


def act_fwd_tol(act, z, y):
    az = z.abs()
    if act == "silu":
        return 5 * ULP * y.abs() + 3e-37
    if act == "gelu":
        return 4 * ULP * y.abs() + 2 * ULP * az
    if act == "gelu_tanh":
        return 6 * ULP * y.abs() + 4 * ULP * az
    return torch.zeros_like(y)


def act_bwd_tol(act, z, dy, dz):
    # Derivative formulas chain up to 8 roundings (16 ulp relative) and cancel at an absolute
    # scale of |dy| (2 + |z|) ulp (tests/common/reference.rs, act_bwd_tol).
    ad = dy.abs()
    return 16 * ULP * dz.abs() + ad * (2 + z.abs()) * 8 * ULP + ad * z * z * ULP


class Reference:
    """F.linear and the activation in float64 on the f32 inputs, their gradients given dy, and
    the error bounds of the module docstring."""

    def __init__(self, x, w, b, act, dy, precision="highest"):
        k, out = w.shape[1], w.shape[0]
        xd = x.detach().double().requires_grad_()
        wd = w.detach().double().requires_grad_()
        bd = b.detach().double().requires_grad_() if b is not None else None
        z = F.linear(xd, wd, bd)
        y = REF[act](z)
        dyd = dy.double()
        leaves = [xd, wd] + ([bd] if bd is not None else [])
        grads = torch.autograd.grad(y, leaves, dyd)
        self.y, self.dx, self.dw = y.detach(), grads[0], grads[1]
        self.db = grads[2] if bd is not None else None
        z = z.detach()
        x2, z2, dy2 = xd.detach().reshape(-1, k), z.reshape(-1, out), dyd.reshape(-1, out)
        rows = x2.shape[0]
        sp = x2.abs() @ wd.detach().abs().T
        s = sp + bd.detach().abs() if bd is not None else sp
        zerr = sum_terms(k, precision) * U * s + operand_terms(k, precision) * sp
        self.ytol = (SLOPE[act] * zerr + act_fwd_tol(act, z2, self.y.reshape(-1, out))).reshape(self.y.shape)
        # dz = act'(z) dy, exactly, and its error bound.
        zl = z2.clone().requires_grad_()
        dz = torch.autograd.grad(REF[act](zl), zl, dy2)[0].abs()
        if act == "identity":
            dzerr = torch.zeros_like(dz)
        elif act == "relu":
            dzerr = torch.where(z2.abs() <= zerr, dy2.abs(), torch.zeros_like(dz))
        else:
            dzerr = 0.8 * dy2.abs() * zerr + act_bwd_tol(act, z2, dy2, dz)
        wa, xa = wd.detach().abs(), x2.abs()
        # TF32 rounds the computed dz, within dzerr of dz.
        da = dz + dzerr
        self.dxtol = (
            sum_terms(out, precision) * U * dz @ wa + dzerr @ wa + operand_terms(out, precision) * da @ wa
        ).reshape(x.shape)
        self.dwtol = (
            sum_terms(rows, precision) * U * dz.T @ xa + dzerr.T @ xa + operand_terms(rows, precision) * da.T @ xa
        )
        self.dbtol = (rows + 4) * U * dz.sum(0) + dzerr.sum(0)


def within(what, ours, ref, tol, dtype=torch.float32) -> float:
    """Every element of ours within tol of ref (NaN fails); returns the largest error / bound."""
    assert ours.dtype == dtype, f"{what}: dtype {ours.dtype}, expected {dtype}"
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
    err = (ours.double() - ref).abs()
    bad = ~(err <= tol)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {ref.numel()} elements beyond the bound; first at {i}: "
            f"ours {ours[i].item()!r}, exact {ref[i].item()!r}, error {err[i].item():.3e}, bound {tol[i].item():.3e}"
        )
    return (err / tol.clamp_min(1e-300)).max().item() if ref.numel() else 0.0


def check_layer(f, x, w, b, act, dy, what, precision="highest"):
    """f(x, w, b) forward and backward against the reference; returns the worst error / bound."""
    r = Reference(x, w, b, act, dy, precision)
    # detach() keeps the storage, offset and strides: views stay views.
    leaves = [t.detach().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    y = f(*leaves) if b is not None else f(*leaves, None)
    grads = torch.autograd.grad(y, leaves, dy)
    worst = within(f"{what} y", y.detach(), r.y, r.ytol)
    worst = max(worst, within(f"{what} dx", grads[0], r.dx, r.dxtol))
    worst = max(worst, within(f"{what} dW", grads[1], r.dw, r.dwtol))
    if b is not None:
        worst = max(worst, within(f"{what} db", grads[2], r.db, r.dbtol))
    return worst


# (x's shape, out_features): primes, ones, a 3-D input, a split-K product (one 128 x 128 tile of
# output and K = 2048: the GEMM splits K to fill the GPU), an output wider than one tile.
SHAPES = [((257, 129), 67), ((1, 1), 1), ((3, 7, 64), 31), ((5, 13), 1031), ((64, 2048), 96), ((2, 3, 5, 40), 7)]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("act", ACTS)
def test_linear_against_float64(act, bias):
    worst = 0.0
    for n, (shape, out) in enumerate(SHAPES):
        k = shape[-1]
        x = randn(*shape, seed=10 + n)
        w = randn(out, k, scale=1 / math.sqrt(k), seed=20 + n)
        b = randn(out, seed=30 + n) if bias else None
        dy = randn(*shape[:-1], out, seed=40 + n)
        f = lambda x, w, b: kt.linear(x, w, b, act)  # noqa: E731
        worst = max(worst, check_layer(f, x, w, b, act, dy, f"{act} {shape} -> {out}"))
    print(f"linear {act} bias={bias}: largest error {worst:.3f} of the bound")


def test_linear_tf32x3_against_float64():
    """With ``set_float32_matmul_precision("tf32x3")`` the layer runs 3xTF32 (on 512 rows x 512
    outputs, K = 512: big enough for it) within that bound, and differs from the FMA result; set
    back, it runs FMAs again."""
    shape, out = (512, 512), 512
    x = randn(*shape, seed=50)
    w = randn(out, shape[1], scale=1 / math.sqrt(shape[1]), seed=51)
    b = randn(out, seed=52)
    dy = randn(shape[0], out, seed=53)
    assert kt.get_float32_matmul_precision() == "highest"
    fma = kt.linear(x, w, b, "gelu")
    kt.set_float32_matmul_precision("tf32x3")
    try:
        assert kt.get_float32_matmul_precision() == "tf32x3"
        tc = kt.linear(x, w, b, "gelu")
        for act in ["relu", "gelu"]:
            f = lambda x, w, b: kt.linear(x, w, b, act)  # noqa: E731
            worst = check_layer(f, x, w, b, act, dy, f"tf32x3 {act}", precision="tf32x3")
            print(f"linear tf32x3 {act}: largest error {worst:.3f} of the bound")
    finally:
        kt.set_float32_matmul_precision("highest")
    assert not torch.equal(fma, tc), "tf32x3 gave the FMA kernel's bits: the setting did not reach the layer"
    assert torch.equal(kt.linear(x, w, b, "gelu"), fma), "set back to highest, the layer did not run FMAs"
    with pytest.raises(ValueError, match="not a precision"):
        kt.set_float32_matmul_precision("medium")


def test_linear_tf32_high_against_float64():
    """With ``set_float32_matmul_precision("high")`` (PyTorch's name for plain TF32; ``"tf32"`` is
    the same) the layer runs plain TF32, forward and backward, within the TF32 bound of the
    module docstring, on 512 rows x 512 outputs (K = 512) and on the odd and split-K shapes; its
    bits differ from both the FMA and the 3xTF32 kernels' (the setting reached the layer); set
    back, it runs FMAs again."""
    shape, out = (512, 512), 512
    x = randn(*shape, seed=80)
    w = randn(out, shape[1], scale=1 / math.sqrt(shape[1]), seed=81)
    b = randn(out, seed=82)
    dy = randn(shape[0], out, seed=83)
    assert kt.get_float32_matmul_precision() == "highest"
    fma = kt.linear(x, w, b, "gelu")
    kt.set_float32_matmul_precision("tf32x3")
    try:
        x3 = kt.linear(x, w, b, "gelu")
        kt.set_float32_matmul_precision("tf32")
        assert kt.get_float32_matmul_precision() == "high"
        kt.set_float32_matmul_precision("high")
        assert kt.get_float32_matmul_precision() == "high"
        tc = kt.linear(x, w, b, "gelu")
        for act in ["identity", "relu", "gelu"]:
            f = lambda x, w, b: kt.linear(x, w, b, act)  # noqa: E731
            worst = check_layer(f, x, w, b, act, dy, f"tf32 {act}", precision="high")
            print(f"linear tf32 {act}: largest error {worst:.3f} of the bound")
        for n, (shp, o) in enumerate(SHAPES):
            k = shp[-1]
            xs, ws = randn(*shp, seed=90 + n), randn(o, k, scale=1 / math.sqrt(k), seed=100 + n)
            bs, dys = randn(o, seed=110 + n), randn(*shp[:-1], o, seed=120 + n)
            f = lambda x, w, b: kt.linear(x, w, b, "silu")  # noqa: E731
            check_layer(f, xs, ws, bs, "silu", dys, f"tf32 silu {shp} -> {o}", precision="high")
    finally:
        kt.set_float32_matmul_precision("highest")
    assert not torch.equal(tc, fma), "high gave the FMA kernel's bits: the setting did not reach the layer"
    assert not torch.equal(tc, x3), "high gave the 3xTF32 kernel's bits, not plain TF32's"
    assert torch.equal(kt.linear(x, w, b, "gelu"), fma), "set back to highest, the layer did not run FMAs"


@pytest.mark.parametrize("act", ["relu", "gelu", "silu"])
def test_linear_custom_ops_directly(act):
    """The custom ops as torch.ops calls: linear (whose backward recomputes the pre-activation for
    GELU and SiLU) and linear_train, forward and backward, against the reference."""
    ops = torch.ops.rustkernels
    x, w, b = randn(33, 70, seed=50), randn(45, 70, scale=0.12, seed=51), randn(45, seed=52)
    dy = randn(33, 45, seed=53)
    check_layer(lambda x, w, b: ops.linear(x, w, b, act), x, w, b, act, dy, f"ops.linear {act}")
    check_layer(lambda x, w, b: ops.linear_train(x, w, b, act)[0], x, w, b, act, dy, f"ops.linear_train {act}")


def test_linear_gradients_only_where_needed():
    """A gradient is computed only for the inputs that need one (the first layer's x has none)."""
    x, w, b = randn(16, 24, seed=54), randn(8, 24, seed=55).requires_grad_(), randn(8, seed=56).requires_grad_()
    y = kt.linear(x, w, b, "gelu")
    gw, gb = torch.autograd.grad(y.sum(), [w, b])
    r = Reference(x, w, b, "gelu", torch.ones_like(y))
    within("dW", gw, r.dw, r.dwtol)
    within("db", gb, r.db, r.dbtol)
    _, gw2, gb2 = torch.ops.rustkernels.linear_backward(
        x, w.detach(), x.new_empty(16, 8), y.detach(), "identity", False, True, False
    )
    assert gw2.shape == (8, 24) and gb2.numel() == 0


def test_linear_empty_shapes():
    """No rows: an empty output, a zero weight and bias gradient; no inputs (in_features = 0):
    act(bias), as F.linear."""
    w, b = randn(8, 16, seed=57).requires_grad_(), randn(8, seed=58).requires_grad_()
    x = torch.empty(0, 16, device=DEV, requires_grad=True)
    y = kt.linear(x, w, b, "silu")
    assert y.shape == (0, 8)
    gx, gw, gb = torch.autograd.grad(y.sum(), [x, w, b])
    assert gx.shape == (0, 16) and torch.equal(gw, torch.zeros_like(gw)) and torch.equal(gb, torch.zeros_like(gb))
    x0, w0 = torch.empty(5, 0, device=DEV), torch.empty(3, 0, device=DEV)
    b0 = randn(3, seed=59)
    for act in ACTS:
        torch.testing.assert_close(kt.linear(x0, w0, b0, act), REF[act](b0.double()).float().expand(5, 3))
    assert torch.equal(kt.linear(x0, w0, None, "relu"), torch.zeros(5, 3, device=DEV))


def test_linear_gradcheck_f32():
    """Finite differences in f32 (the GEMM has no f64). Here K = 5 and S = sum |x w| + |b| is about
    1.2, so each evaluation errs by at most (K + 4) u S = 7e-7 in z plus the activation's few ulp
    of values near 1 (under 1e-6), and a central difference (two evaluations over 2 eps, eps =
    1e-3) by at most 1.7e-3, under the atol of 2e-3; the truncation error is about eps^2 / 6 =
    2e-7. Relu is left out (its kink)."""
    x = randn(3, 5, scale=0.5, seed=60).requires_grad_()
    w = randn(4, 5, scale=0.5, seed=61).requires_grad_()
    b = randn(4, scale=0.5, seed=62).requires_grad_()
    ops = torch.ops.rustkernels
    for act in ["identity", "gelu", "gelu_tanh", "silu"]:
        for name, f in [("kt.linear", lambda x, w, b: kt.linear(x, w, b, act)),
                        ("ops.linear", lambda x, w, b: ops.linear(x, w, b, act))]:  # fmt: skip
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "not a double precision floating point"
                assert torch.autograd.gradcheck(f, [x, w, b], eps=1e-3, atol=2e-3, rtol=2e-2), f"{name} {act}"


def test_linear_opcheck():
    ops = torch.ops.rustkernels
    x = randn(8, 24, seed=63).requires_grad_()
    w = randn(16, 24, scale=0.2, seed=64).requires_grad_()
    b = randn(16, seed=65).requires_grad_()
    z = F.linear(x, w, b).detach()
    g = randn(8, 16, seed=66)
    cases = [
        (ops.linear, (x, w, b, "gelu")),
        (ops.linear, (x, w, None, "relu")),
        (ops.linear, (x.detach().view(2, 4, 24), w, b, "identity")),
        (ops.linear_train, (x, w, b, "silu")),
        (ops.linear_train, (x, w, b, "relu")),
        (ops.linear_backward, (x.detach(), w.detach(), z, g, "gelu", True, True, True)),
        (ops.linear_backward, (x.detach(), w.detach(), F.relu(z), g, "relu", False, True, False)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_linear_runs_on_the_current_stream():
    """On a side stream, after a long sleep on it, forward and backward must see what the stream
    computed before them; the reference runs after the streams are joined."""
    x0 = randn(512, 256, seed=67)
    w = randn(384, 256, scale=1 / 16, seed=68).requires_grad_()
    b = randn(384, seed=69).requires_grad_()
    dy = randn(512, 384, seed=70)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time on s
        x = x0 * 3  # on s, after the sleep
        y = kt.linear(x, w, b, "gelu")
        gw, gb = torch.autograd.grad(y, [w, b], dy)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    r = Reference(x0 * 3, w, b, "gelu", dy)
    within("y on a side stream", y.detach(), r.y, r.ytol)
    within("dW on a side stream", gw, r.dw, r.dwtol)
    within("db on a side stream", gb, r.db, r.dbtol)


def test_linear_views_with_offsets_and_strides():
    """An aligned offset view is used in place; a misaligned one, a transposed weight and a
    strided bias are copied first; the results are the same as for the contiguous tensors."""
    base = randn(65, 64, seed=71)
    x = base[1:]  # offset 64 floats: aligned
    assert x.storage_offset() == 64 and x.is_contiguous()
    w = randn(64, 48, scale=0.125, seed=72).t()  # [48, 64], not contiguous
    flat = randn(4099, seed=73)
    xm = flat[3:].view(64, 64)  # offset 12 bytes: misaligned
    assert xm.data_ptr() % 16 != 0
    bs = randn(96, seed=74)[::2]  # stride 2
    dy = randn(64, 48, seed=75)
    for name, xv in [("offset view", x), ("misaligned view", xm)]:
        check_layer(lambda x, w, b: kt.linear(x, w, b, "silu"), xv, w, bs, "silu", dy, name)
        assert torch.equal(
            kt.linear(xv, w, bs, "relu"), kt.linear(xv.contiguous(), w.contiguous(), bs.contiguous(), "relu")
        )
    assert flat.isfinite().all() and base.isfinite().all()  # the inputs were not written


def test_linear_refusals():
    ops = torch.ops.rustkernels
    x, w, b = randn(4, 8), randn(3, 8), randn(3)
    for dt in (torch.float16, torch.bfloat16):
        for f in (ops.linear, ops.linear_train, kt.linear):
            with pytest.raises(TypeError, match=f"weight has dtype torch.float32 but must be {dt}"):
                f(x.to(dt), w, b.to(dt), "relu")
        with pytest.raises(TypeError, match=f"weight has dtype {dt} but must be torch.float32"):
            ops.linear(x, w.to(dt), b, "identity")
        with pytest.raises(TypeError, match=f"bias has dtype {dt}"):
            kt.linear(x, w, b.to(dt))
        g = randn(4, 3).to(dt)
        with pytest.raises(TypeError, match=f"grad has dtype {dt} but must be torch.float32"):
            ops.linear_backward(x, w, x.new_empty(4, 3), g, "relu", True, True, True)
    with pytest.raises(TypeError, match="x has dtype torch.float64; supported"):
        ops.linear(x.double(), w.double(), None, "relu")
    with pytest.raises(ValueError, match="x is on cpu"):
        ops.linear(x.cpu(), w.cpu(), b.cpu(), "relu")
    with pytest.raises(ValueError, match="weight is on cpu"):
        kt.linear(x, w.cpu(), b)
    with pytest.raises(ValueError, match="in_features = 8"):
        kt.linear(randn(4, 7), w, b)
    with pytest.raises(ValueError, match=r"bias has shape \[4\]"):
        kt.linear(x, w, randn(4))
    with pytest.raises(ValueError, match="must be \\[out_features, in_features\\]"):
        kt.linear(x, randn(8), None)
    with pytest.raises(ValueError, match="'mish' is not fused"):
        kt.linear(x, w, b, "mish")


def test_linear_module_uses_the_kernels_on_cuda_and_pytorch_otherwise():
    import kernels_torch._ops as ops_mod

    calls = {"linear_fwd": 0, "linear_train_fwd": 0}
    orig = {k: getattr(ops_mod._native, k) for k in calls}

    def spy(name):
        def f(*a):
            calls[name] += 1
            return orig[name](*a)

        return f

    torch.manual_seed(0)
    m = knn.Linear(32, 16, activation="gelu", device=DEV)
    x = randn(8, 32, seed=76)
    for k in calls:
        setattr(ops_mod._native, k, spy(k))
    try:
        with torch.no_grad():
            y = m(x)  # inference: one fused kernel
        assert calls == {"linear_fwd": 1, "linear_train_fwd": 0}
        m(x).sum().backward()  # training with GELU: z kept for the backward
        assert calls == {"linear_fwd": 1, "linear_train_fwd": 1}
        r = Reference(x, m.weight, m.bias, "gelu", torch.ones(8, 16, device=DEV))
        within("module y", y, r.y, r.ytol)
        within("module dW", m.weight.grad, r.dw, r.dwtol)
        # float64 and CPU: PyTorch's F.linear and activation.
        md = knn.Linear(32, 16, activation="silu", device=DEV, dtype=torch.float64)
        assert torch.equal(md(x.double()), F.silu(F.linear(x.double(), md.weight, md.bias)))
        mc = knn.Linear(32, 16, activation="relu")
        assert torch.equal(mc(x.cpu()), F.relu(F.linear(x.cpu(), mc.weight, mc.bias)))
        assert calls == {"linear_fwd": 1, "linear_train_fwd": 1}
        # bf16 parameters and input: the kernels (test_linear_tc_module_and_autocast has more).
        mb = knn.Linear(32, 16, activation="relu", device=DEV, dtype=torch.bfloat16)
        with torch.no_grad():
            assert mb(x.bfloat16()).dtype == torch.bfloat16
        assert calls == {"linear_fwd": 2, "linear_train_fwd": 1}
    finally:
        for k, f in orig.items():
            setattr(ops_mod._native, k, f)


def test_linear_module_torch_compile_fullgraph():
    """A small MLP of kernels_torch.nn.Linear compiled with fullgraph=True: the custom ops in the
    graph, forward and backward, give the same bits as eager mode (the same kernels on the same
    inputs)."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        knn.Linear(64, 128, activation="gelu"),
        knn.Linear(128, 96, activation="relu"),
        knn.Linear(96, 10),
    ).to(DEV)
    params = list(model.parameters())
    cm = torch.compile(model, fullgraph=True)
    for x_grad in (True, False):
        x = randn(32, 64, seed=77).requires_grad_(x_grad)
        g = randn(32, 10, seed=78)
        inputs = ([x] if x_grad else []) + params
        ye = model(x)
        yc = cm(x)
        assert torch.equal(ye, yc)
        ge = torch.autograd.grad(ye, inputs, g)
        gc = torch.autograd.grad(yc, inputs, g)
        for i, (a, c) in enumerate(zip(ge, gc)):
            assert torch.equal(a, c), f"gradient {i} (x_grad={x_grad})"
    with torch.no_grad():
        assert torch.equal(model(x), cm(x))


# --- bfloat16 and float16 (the tensor cores) ---------------------------------------------------
#
# Tolerance (the bounds of tests/common/linear_ref.rs, where they are derived): ``u_d`` is the
# dtype's unit roundoff (2^-8 bf16, 2^-11 f16) and ``tiny_d`` half its smallest denormal; storing an
# f32 value known to ``e`` in the dtype leaves it known to ``stored(e) = e + u_d (|exact| + e) +
# tiny_d``. The GEMM's f32 value of a sum of K exact products (bf16 and f16 products are exact in
# f32) errs by at most ``tc_terms(K) 2^-23 S``, ``tc_terms(K) = 18 ceil(K / 16) + s + 4`` (the
# tensor cores' truncating additions, 16 products a step; s <= K / 256 split-K slices; the
# epilogue's roundings). The forward rounds once after the activation (fused, f32) or stores z
# first (training with GELU, GELU-tanh, SiLU). dz reads the stored z (|act''| <= 0.8 passes its
# error on) and is stored; dx and dW are GEMMs of the stored dz; db sums dz in f32 in some order
# (``(rows + 4) 2^-24 sum |dz|``). Every output is rounded once more to the dtype.

TC_DTYPES = [torch.bfloat16, torch.float16]
_NEEDS_PRE = ("gelu", "gelu_tanh", "silu")  # the activations whose training forward stores z
TC_UNIT = {torch.bfloat16: (2.0**-8, 2.0**-134), torch.float16: (2.0**-11, 2.0**-25)}


def tc_terms(k: int) -> int:
    """``tc_bound_terms`` of tests/common/reference.rs: the GEMM's error in units of 2^-23 S."""
    return 18 * -(-k // 16) + max(1, k // 256) + 4


def stored(dt, exact, e):
    u, tiny = TC_UNIT[dt]
    return e + u * (exact.abs() + e) + tiny


class ReferenceTC:
    """F.linear and the activation in float64 on the (bf16 or f16) inputs, their gradients given
    dy, and the bounds above. ``stored_pre``: the forward stored z before the activation."""

    def __init__(self, x, w, b, act, dy, stored_pre):
        dt = x.dtype
        k, out = w.shape[1], w.shape[0]
        xd = x.detach().double().requires_grad_()
        wd = w.detach().double().requires_grad_()
        bd = b.detach().double().requires_grad_() if b is not None else None
        z = F.linear(xd, wd, bd)
        y = REF[act](z)
        leaves = [xd, wd] + ([bd] if bd is not None else [])
        grads = torch.autograd.grad(y, leaves, dy.double())
        self.y, self.dx, self.dw = y.detach(), grads[0], grads[1]
        self.db = grads[2] if bd is not None else None
        z = z.detach()
        x2, z2, dy2 = xd.detach().reshape(-1, k), z.reshape(-1, out), dy.double().reshape(-1, out)
        rows = x2.shape[0]
        s = x2.abs() @ wd.detach().abs().T
        if bd is not None:
            s = s + bd.detach().abs()
        tz = tc_terms(k) * ULP * s
        ez = stored(dt, z2, tz)
        y2 = self.y.reshape(-1, out)
        ey = SLOPE[act] * (ez if stored_pre else tz) + act_fwd_tol(act, z2, y2)
        self.ytol = stored(dt, y2, ey).reshape(self.y.shape)
        zl = z2.clone().requires_grad_()
        dz = torch.autograd.grad(REF[act](zl), zl, dy2)[0]
        if act == "identity":
            edz = torch.zeros_like(dz)
        elif act == "relu":
            edz = torch.where(z2.abs() <= tz + TC_UNIT[dt][1], dy2.abs(), torch.zeros_like(dz))
        else:
            edz = stored(dt, dz, 0.8 * dy2.abs() * ez + act_bwd_tol(act, z2, dy2, dz.abs()))
        da = dz.abs() + edz
        wa, xa = wd.detach().abs(), x2.abs()
        self.dxtol = stored(dt, self.dx.reshape(-1, k), edz @ wa + tc_terms(out) * ULP * da @ wa).reshape(x.shape)
        self.dwtol = stored(dt, self.dw, edz.T @ xa + tc_terms(rows) * ULP * da.T @ xa)
        self.dbtol = stored(dt, self.db, edz.sum(0) + (rows + 4) * U * da.sum(0)) if bd is not None else None


def check_layer_tc(f, x, w, b, act, dy, what, stored_pre):
    """f(x, w, b) (bf16 or f16) forward and backward against ReferenceTC; the worst error / bound."""
    dt = x.dtype
    r = ReferenceTC(x, w, b, act, dy, stored_pre)
    leaves = [t.detach().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    y = f(*leaves) if b is not None else f(*leaves, None)
    grads = torch.autograd.grad(y, leaves, dy)
    worst = within(f"{what} y", y.detach(), r.y, r.ytol, dt)
    worst = max(worst, within(f"{what} dx", grads[0], r.dx, r.dxtol, dt))
    worst = max(worst, within(f"{what} dW", grads[1], r.dw, r.dwtol, dt))
    if b is not None:
        worst = max(worst, within(f"{what} db", grads[2], r.db, r.dbtol, dt))
    return worst


def tc_inputs(shape, out, dt, bias, seed):
    k = shape[-1]
    x = randn(*shape, seed=seed).to(dt)
    w = randn(out, k, scale=1 / math.sqrt(max(k, 1)), seed=seed + 1).to(dt)
    b = randn(out, seed=seed + 2).to(dt) if bias else None
    dy = randn(*shape[:-1], out, seed=seed + 3).to(dt)
    return x, w, b, dy


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dt", TC_DTYPES, ids=["bf16", "f16"])
def test_linear_tc_against_float64(dt, act, bias):
    """kt.linear in bf16 and f16: the training path (z stored for GELU, GELU-tanh, SiLU) forward
    and backward, and the inference path (one fused GEMM) forward, against float64."""
    worst = 0.0
    for n, (shape, out) in enumerate(SHAPES):
        x, w, b, dy = tc_inputs(shape, out, dt, bias, 100 + 10 * n)
        f = lambda x, w, b: kt.linear(x, w, b, act)  # noqa: E731
        worst = max(worst, check_layer_tc(f, x, w, b, act, dy, f"{dt} {act} {shape} -> {out}", act in _NEEDS_PRE))
        with torch.no_grad():
            y = kt.linear(x, w, b, act)
        r = ReferenceTC(x, w, b, act, dy, stored_pre=False)
        worst = max(worst, within(f"{dt} {act} {shape} -> {out} inference y", y, r.y, r.ytol, dt))
    print(f"linear {dt} {act} bias={bias}: largest error {worst:.3f} of the bound")


@pytest.mark.parametrize("dt", TC_DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("act", ["relu", "gelu", "silu"])
def test_linear_tc_custom_ops_directly(dt, act):
    """torch.ops.rustkernels.linear (its backward recomputes z, stored in the dtype) and
    linear_train on bf16 and f16, against float64."""
    ops = torch.ops.rustkernels
    x, w, b, dy = tc_inputs((33, 70), 45, dt, True, 150)
    pre = act in _NEEDS_PRE
    check_layer_tc(lambda x, w, b: ops.linear(x, w, b, act), x, w, b, act, dy, f"ops.linear {dt} {act}", False)
    check_layer_tc(
        lambda x, w, b: ops.linear_train(x, w, b, act)[0], x, w, b, act, dy, f"ops.linear_train {dt} {act}", pre
    )


def test_linear_tc_gradients_against_float64_gradcheck():
    """Gradcheck in f64-checked form: the f64 reference's gradients are first confirmed by
    torch.autograd.gradcheck (finite differences in float64), then the bf16 and f16 kernels'
    gradients must lie within the derived bound of them. Relu is left out of the finite
    differences (its kink), not out of the bound check."""
    for dt in TC_DTYPES:
        for act in ACTS:
            x, w, b, dy = tc_inputs((6, 9), 5, dt, True, 160)
            leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
            if act != "relu":
                assert torch.autograd.gradcheck(lambda x, w, b: REF[act](F.linear(x, w, b)), leaves), f"{dt} {act}"
            f = lambda x, w, b: kt.linear(x, w, b, act)  # noqa: E731
            check_layer_tc(f, x, w, b, act, dy, f"gradcheck {dt} {act}", act in _NEEDS_PRE)


def test_linear_tc_opcheck():
    ops = torch.ops.rustkernels
    for dt in TC_DTYPES:
        x = randn(8, 24, seed=170).to(dt).requires_grad_()
        w = (randn(16, 24, seed=171) * 0.2).to(dt).requires_grad_()
        b = randn(16, seed=172).to(dt).requires_grad_()
        z = F.linear(x, w, b).detach()
        g = randn(8, 16, seed=173).to(dt)
        cases = [
            (ops.linear, (x, w, b, "gelu")),
            (ops.linear, (x, w, None, "relu")),
            (ops.linear, (x.detach().view(2, 4, 24), w, b, "identity")),
            (ops.linear_train, (x, w, b, "silu")),
            (ops.linear_train, (x, w, b, "relu")),
            (ops.linear_backward, (x.detach(), w.detach(), z, g, "gelu", True, True, True)),
            (ops.linear_backward, (x.detach(), w.detach(), F.relu(z), g, "relu", False, True, False)),
        ]
        for op, args in cases:
            torch.library.opcheck(op, args)
        # The fake (meta) implementations give the dtype and shapes of the real ones.
        real = [t.detach() for t in (x, w, b)]  # detached outside the mode: a real tensor's op
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fx, fw, fb = (mode.from_tensor(t) for t in real)
            y, pre = ops.linear_train(fx, fw, fb, "gelu")
            assert (y.dtype, pre.dtype, tuple(y.shape), tuple(pre.shape)) == (dt, dt, (8, 16), (8, 16))


@pytest.mark.parametrize("dt", TC_DTYPES, ids=["bf16", "f16"])
def test_linear_tc_module_and_autocast(dt):
    """nn.Linear with parameters of the dtype runs the kernels; with f32 parameters inside
    torch.autocast("cuda", dt) it casts input and parameters to dt (as autocast casts those of
    F.linear), runs the kernels, and returns f32 gradients to the f32 parameters: bit for bit
    the kernels' on the cast tensors, and within the bounds of float64."""
    import kernels_torch._ops as ops_mod

    calls = {"linear_fwd": 0, "linear_train_fwd": 0, "linear_bwd": 0}
    orig = {k: getattr(ops_mod._native, k) for k in calls}

    def spy(name):
        def f(*a):
            calls[name] += 1
            return orig[name](*a)

        return f

    torch.manual_seed(2)
    m = knn.Linear(40, 24, activation="gelu", device=DEV)
    x = randn(3, 5, 40, seed=180)
    dy = randn(3, 5, 24, seed=181).to(dt)
    for k in calls:
        setattr(ops_mod._native, k, spy(k))
    try:
        with torch.autocast("cuda", dtype=dt):
            ya = m(x)
        assert ya.dtype == dt
        assert calls == {"linear_fwd": 0, "linear_train_fwd": 1, "linear_bwd": 0}
        gw, gb = torch.autograd.grad(ya, [m.weight, m.bias], dy)
        assert calls["linear_bwd"] == 1
        assert gw.dtype == torch.float32 and gb.dtype == torch.float32
        xc, wc, bc = (t.detach().to(dt) for t in (x, m.weight, m.bias))
        wc.requires_grad_()
        bc.requires_grad_()
        y2 = kt.linear(xc, wc, bc, "gelu")
        gw2, gb2 = torch.autograd.grad(y2, [wc, bc], dy)
        assert torch.equal(ya, y2) and torch.equal(gw, gw2.float()) and torch.equal(gb, gb2.float())
        r = ReferenceTC(xc, wc, bc, "gelu", dy, stored_pre=True)
        within("autocast y", ya.detach(), r.y, r.ytol, dt)
        within("autocast dW", gw2, r.dw, r.dwtol, dt)
        within("autocast db", gb2, r.db, r.dbtol, dt)
        # Inference inside autocast: one fused kernel.
        with torch.no_grad():
            with torch.autocast("cuda", dtype=dt):
                yi = m(x)
            assert calls["linear_fwd"] == 1
            assert torch.equal(yi, kt.linear(xc, wc.detach(), bc.detach(), "gelu"))
        assert calls["linear_fwd"] == 2
        # Parameters of the dtype, no autocast: the kernels.
        mb = knn.Linear(40, 24, activation="relu", device=DEV, dtype=dt)
        with torch.no_grad():
            yb = mb(xc)
        assert yb.dtype == dt and calls["linear_fwd"] == 3
        rb = ReferenceTC(xc, mb.weight, mb.bias, "relu", dy, stored_pre=False)
        within("module y", yb, rb.y, rb.ytol, dt)
        # Mixed dtypes outside autocast (f32 parameters, a dt input): PyTorch's, which refuses.
        with pytest.raises(RuntimeError):
            m(xc)
        assert calls["linear_fwd"] == 3
    finally:
        for k, f in orig.items():
            setattr(ops_mod._native, k, f)


@pytest.mark.parametrize("dt", TC_DTYPES, ids=["bf16", "f16"])
def test_linear_tc_empty_shapes(dt):
    """No rows: an empty output and zero weight and bias gradients; in_features = 0: act(bias)."""
    w = randn(8, 16, seed=190).to(dt).requires_grad_()
    b = randn(8, seed=191).to(dt).requires_grad_()
    x = torch.empty(0, 16, device=DEV, dtype=dt, requires_grad=True)
    y = kt.linear(x, w, b, "silu")
    assert y.shape == (0, 8) and y.dtype == dt
    gx, gw, gb = torch.autograd.grad(y.sum(), [x, w, b])
    assert gx.shape == (0, 16) and torch.equal(gw, torch.zeros_like(gw)) and torch.equal(gb, torch.zeros_like(gb))
    b0 = randn(3, seed=192).to(dt)
    y0 = kt.linear(torch.empty(5, 0, device=DEV, dtype=dt), torch.empty(3, 0, device=DEV, dtype=dt), b0, "relu")
    assert torch.equal(y0, F.relu(b0).expand(5, 3))
