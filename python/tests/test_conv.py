"""Convolution, batch norm and pooling 2d (``kernels_torch.conv2d``, ``batch_norm``, ``max_pool2d``,
``avg_pool2d``, ``adaptive_avg_pool2d``, their ``torch.ops.rustkernels`` ops and the ``nn`` modules)
on the GPU, in float32, bfloat16 and float16, NCHW and ``channels_last``, against PyTorch's own
functions run in float64 on the same (rounded) inputs.

Tolerances are worst-case bounds, not fitted ones (none was widened to pass); they are the bounds
of the library's own GPU tests (tests/conv.rs, tests/pool.rs), where they are derived. With ``u =
2^-24``, ``gamma(L) = L u / (1 - L u)`` bounds the error of a sum of ``L`` terms accumulated in f32
in any order, as a multiple of ``M``, the sum of the terms' magnitudes (a product's rounding
counts as one more term). The tensor cores' additions truncate: a bf16/f16 forward on them (NHWC,
one group, ``C % 8 == 0``) errs by at most ``tc_terms(L) 2^-23 M`` (tests/common/reference.rs).
Storing an f32 value known to ``e`` in bf16 or f16 leaves it known to ``e + u_d (|exact| + e) +
tiny_d`` (``u_d`` the dtype's unit roundoff, ``tiny_d`` half its smallest denormal); an f32 result
is stored as computed. Per result, ``L`` and ``M``:

- convolution: ``C/g R S`` products (+1 with a bias), ``M = conv(|x|, |w|) + |b|``;
- its input gradient: ``K/g R S`` products, ``M = conv_transpose(|dy|, |w|)``; the filter's
  ``N P Q`` products, ``M = sum |dy| |x|``; the bias's ``N P Q`` terms, ``M = sum |dy|`` (the float64
  gradients of the convolution of ``|x|`` and ``|w|`` given ``|dy|`` are exactly these sums);
- average pooling: the window's ``kh kw`` terms and the division (``L + 1``), ``M = avg(|x|)``;
  its gradient at most ``ceil(kh / sh) ceil(kw / sw)`` terms ``g / divisor`` (each rounded once:
  ``2 L``), ``M`` the float64 gradient of ``avg`` given ``|g|``; the global average pool ``H W + 1``
  and ``mean |x|``, its gradient one division;
- max pooling selects: its output and indices equal PyTorch's in the same dtype; its gradient
  sums at most ``ceil(kh / sh) ceil(kw / sw)`` gradients.

Batch norm's worst-case bounds depend on the kernels' reduction plan (tests/batchnorm.rs derives
them per channel); here, as for layer norm in test_ops.py, it is held to ``eps |ref| + eps
max(1, max |ref|)`` with ``eps`` 1e-5 in f32 (some 170 f32 roundings of the largest value: the
statistics of the shapes below, a few thousand values of unit spread per channel, are far
inside it) and one unit in the last place of the storage type for bf16 and f16 (the kernels
compute in f32 and round once).
"""

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kernels_torch as kt  # noqa: E402
from kernels_torch import _native  # noqa: E402
from kernels_torch import nn as knn  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
U = 2.0**-24
ULP = 2.0**-23
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["f32", "bf16", "f16"]
# (unit roundoff, half the smallest denormal) of the storage type; f32 results are not rounded again.
UNIT = {torch.float32: (0.0, 0.0), torch.bfloat16: (2.0**-8, 2.0**-134), torch.float16: (2.0**-11, 2.0**-25)}
EPS = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def tc_terms(k: int) -> int:
    return 18 * -(-k // 16) + 1 + 4


def stored(dt, exact, e):
    u, tiny = UNIT[dt]
    return e + u * (exact.abs() + e) + tiny


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def layout(t, channels_last):
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t.contiguous()


def within(what, ours, ref, tol, dtype) -> float:
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


def close(ours, ref, dtype, what=""):
    """test_ops.py's tolerance (module docstring), for batch norm."""
    assert ours.dtype == dtype, f"{what}: dtype {ours.dtype}, expected {dtype}"
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
    eps = EPS[dtype]
    ref = ref.double()
    big = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    torch.testing.assert_close(ours.double(), ref, rtol=eps, atol=eps * big, msg=lambda m: f"{what}: {m}")


# --- convolution --------------------------------------------------------------------------------

# (N, C, H, W, K, (R, S), stride, padding, dilation, groups, bias): a 3-channel stem; C % 8 == 0
# (the tensor cores in bf16/f16 NHWC) with a stride that does not divide; 1x1 with an odd K;
# groups with dilation and a non-square filter; depthwise; a 5x5 filter larger than the stride
# leaves; one image of one pixel.
CONV_CASES = [
    (2, 3, 17, 13, 5, (3, 3), 1, 1, 1, 1, True),
    (3, 16, 9, 11, 24, (3, 3), 2, 1, 1, 1, True),
    (4, 16, 6, 5, 33, (1, 1), 1, 0, 1, 1, True),
    (2, 6, 10, 9, 4, (3, 2), (2, 1), (1, 0), (2, 1), 2, True),
    (2, 12, 8, 7, 12, (3, 3), 1, 1, 1, 12, False),
    (1, 3, 5, 5, 2, (5, 5), 3, 2, 1, 1, True),
    (1, 8, 1, 1, 8, (1, 1), 1, 0, 1, 1, False),
]


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def conv_inputs(case, dt, channels_last, seed):
    n, c, h, w, k, (r, s), stride, padding, dilation, groups, bias = case
    x = layout(randn(n, c, h, w, dtype=dt, seed=seed), channels_last)
    wt = layout(randn(k, c // groups, r, s, scale=1 / math.sqrt(c // groups * r * s), dtype=dt, seed=seed + 1),
                channels_last)  # fmt: skip
    b = randn(k, dtype=dt, seed=seed + 2) if bias else None
    return x, wt, b, dict(stride=stride, padding=padding, dilation=dilation, groups=groups)


def on_tensor_cores(dt, channels_last, c, groups):
    return dt in (torch.bfloat16, torch.float16) and channels_last and groups == 1 and c % 8 == 0


class ConvReference:
    """F.conv2d in float64 on the inputs, its gradients given dy, and the bounds of the module
    docstring."""

    def __init__(self, x, w, b, dy, opts, tensor_cores):
        dt = x.dtype
        leaves = [t.detach().double().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
        y = F.conv2d(*leaves, **opts) if b is not None else F.conv2d(*leaves, None, **opts)
        grads = torch.autograd.grad(y, leaves, dy.double())
        self.y, self.dx, self.dw = y.detach(), grads[0], grads[1]
        self.db = grads[2] if b is not None else None
        # The magnitudes: the same sums over |x|, |w|, |b| and |dy|.
        abs_leaves = [t.detach().double().abs().requires_grad_() for t in (x, w)]
        ya = F.conv2d(*abs_leaves, None, **opts)
        dxa, dwa = torch.autograd.grad(ya, abs_leaves, dy.double().abs())
        m = ya.detach() + (b.double().abs().view(1, -1, 1, 1) if b is not None else 0)
        n, c, _, _ = x.shape
        k, cg, r, s = w.shape
        g = opts["groups"]
        npq = n * y.shape[2] * y.shape[3]
        ly = cg * r * s + (1 if b is not None else 0)
        acc = tc_terms(cg * r * s) * ULP if tensor_cores else gamma(ly)
        self.ytol = stored(dt, self.y, acc * m)
        self.dxtol = stored(dt, self.dx, gamma(k // g * r * s) * dxa)
        self.dwtol = stored(dt, self.dw, gamma(npq) * dwa)
        self.dbtol = stored(dt, self.db, gamma(npq) * dy.double().abs().sum((0, 2, 3))) if b is not None else None


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("case", range(len(CONV_CASES)))
def test_conv2d_against_pytorch(case, dt, channels_last):
    cs = CONV_CASES[case]
    x, w, b, opts = conv_inputs(cs, dt, channels_last, seed=10 * case)
    leaves = [t.detach().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    y = kt.conv2d(*leaves, **opts) if b is not None else kt.conv2d(*leaves, None, **opts)
    if channels_last and x.shape[1] > 1 and y.shape[2] * y.shape[3] > 1:
        assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous(), "channels_last in, out"
    dy = layout(randn(*y.shape, dtype=dt, seed=10 * case + 3), channels_last)
    grads = torch.autograd.grad(y, leaves, dy)
    r = ConvReference(x, w, b, dy, opts, on_tensor_cores(dt, channels_last, cs[1], cs[9]))
    what = f"conv {cs} {dt} {'channels_last' if channels_last else 'nchw'}"
    worst = within(f"{what} y", y.detach(), r.y, r.ytol, dt)
    worst = max(worst, within(f"{what} dx", grads[0], r.dx, r.dxtol, dt))
    worst = max(worst, within(f"{what} dw", grads[1], r.dw, r.dwtol, dt))
    if b is not None:
        worst = max(worst, within(f"{what} db", grads[2], r.db, r.dbtol, dt))
    print(f"{what}: worst error / bound {worst:.3f}")


def test_conv2d_only_the_gradients_asked_for_and_padding_strings():
    x = randn(2, 4, 9, 9, seed=1)
    w = randn(6, 4, 3, 3, scale=0.2, seed=2).requires_grad_()
    b = randn(6, seed=3)
    y = kt.conv2d(x, w, b, padding="same")
    (gw,) = torch.autograd.grad(y.sum(), [w])  # x and b need no gradient: not computed
    r = ConvReference(x, w.detach(), b, torch.ones_like(y), dict(stride=1, padding=1, dilation=1, groups=1), False)
    within("same padding y", y.detach(), r.y, r.ytol, torch.float32)
    within("same padding dw", gw, r.dw, r.dwtol, torch.float32)
    yv = kt.conv2d(x, w.detach(), None, padding="valid")
    assert yv.shape == (2, 6, 7, 7)
    with pytest.raises(ValueError, match="one side more"):
        kt.conv2d(x, randn(6, 4, 2, 2, seed=4), None, padding="same")
    # Unbatched [C, H, W], as F.conv2d.
    y3 = kt.conv2d(x[0], w.detach(), b, padding=1)
    assert torch.equal(y3, kt.conv2d(x[:1], w.detach(), b, padding=1)[0])


def test_conv2d_refusals():
    x = randn(2, 4, 8, 8)
    w = randn(6, 4, 3, 3)
    with pytest.raises(ValueError, match="groups"):
        kt.conv2d(x, w, groups=2)
    with pytest.raises(ValueError, match="empty"):
        kt.conv2d(randn(1, 4, 2, 2), w)
    with pytest.raises(TypeError, match="dtype torch.float64"):
        kt.conv2d(x.double(), w.double())
    with pytest.raises(TypeError, match="weight has dtype torch.float16"):
        kt.conv2d(x, w.half())
    with pytest.raises(ValueError, match="is on cpu"):
        kt.conv2d(x.cpu(), w.cpu())


# --- batch norm ---------------------------------------------------------------------------------

# (N, C, H, W): primes, one channel, one value per image, C % 8 == 0.
BN_SHAPES = [(4, 5, 17, 13), (2, 1, 7, 9), (37, 3, 1, 1), (3, 16, 8, 8)]


def bn_params(c, seed):
    w = (randn(c, seed=seed) * 0.5 + 1).requires_grad_()
    b = randn(c, seed=seed + 1).requires_grad_()
    rm = randn(c, seed=seed + 2)
    rv = randn(c, seed=seed + 3).abs() + 0.5
    return w, b, rm, rv


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", BN_SHAPES, ids=str)
def test_batch_norm_against_pytorch(shape, dt, channels_last, training):
    n, c, h, w_ = shape
    x = layout(randn(*shape, scale=2.0, seed=20) + 3, channels_last).to(dt).requires_grad_()
    w, b, rm, rv = bn_params(c, seed=21)
    dy = layout(randn(*shape, seed=25), channels_last).to(dt)
    rm_ours, rv_ours = rm.clone(), rv.clone()
    y = kt.batch_norm(x, rm_ours, rv_ours, w, b, training, 0.1, 1e-5)
    assert y.dtype == dt and y.shape == x.shape
    if channels_last and c > 1 and h * w_ > 1:
        assert y.is_contiguous(memory_format=torch.channels_last)
    gx, gw, gb = torch.autograd.grad(y, [x, w, b], dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    rm_ref, rv_ref = rm.double(), rv.double()
    yr = F.batch_norm(leaves[0], rm_ref, rv_ref, leaves[1], leaves[2], training, 0.1, 1e-5)
    rgx, rgw, rgb = torch.autograd.grad(yr, leaves, dy.double())
    what = f"batch_norm {shape} {dt} {'channels_last' if channels_last else 'nchw'} {'train' if training else 'eval'}"
    close(y, yr, dt, f"{what} y")
    close(gx, rgx, dt, f"{what} dx")
    close(gw, rgw, torch.float32, f"{what} dweight")
    close(gb, rgb, torch.float32, f"{what} dbias")
    # The running statistics: updated in training (unbiased variance), untouched in evaluation.
    close(rm_ours, rm_ref, torch.float32, f"{what} running_mean")
    close(rv_ours, rv_ref, torch.float32, f"{what} running_var")
    if not training:
        assert torch.equal(rm_ours, rm) and torch.equal(rv_ours, rv)


def test_batch_norm_without_affine_or_running_statistics():
    x = randn(8, 3, 5, 5, seed=30).requires_grad_()
    dy = randn(8, 3, 5, 5, seed=31)
    y = kt.batch_norm(x, None, None, None, None, True)
    (gx,) = torch.autograd.grad(y, [x], dy)
    xr = x.detach().double().requires_grad_()
    yr = F.batch_norm(xr, None, None, None, None, True)
    (rgx,) = torch.autograd.grad(yr, [xr], dy.double())
    close(y, yr, torch.float32, "no affine y")
    close(gx, rgx, torch.float32, "no affine dx")
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        kt.batch_norm(randn(1, 3, 1, 1), None, None, None, None, True)
    with pytest.raises(ValueError, match="running_mean"):
        kt.batch_norm(x.detach(), None, None, None, None, False)
    with pytest.raises(TypeError, match="must be torch.float32"):
        kt.batch_norm(x.detach(), None, None, torch.ones(3, device=DEV, dtype=torch.half), None, True)


# --- pooling ------------------------------------------------------------------------------------

# (shape, kernel, stride, padding, ceil_mode): ResNet's stem pool on odd sizes, a stride that does
# not divide, ceil_mode's extra window, overlapping windows of a non-square kernel, one window.
POOL_CASES = [
    ((2, 5, 17, 13), 3, 2, 1, False),
    ((3, 4, 9, 10), 2, 2, 0, True),
    ((1, 6, 11, 7), (3, 2), (2, 1), (1, 1), False),
    ((2, 3, 5, 5), (4, 3), 3, (2, 1), True),
    ((4, 16, 3, 3), 3, 3, 0, False),
]


def windows_per_input(k, s):
    (kh, kw), (sh, sw) = _pair(k), _pair(s)
    return -(-kh // sh) * -(-kw // sw)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("case", range(len(POOL_CASES)))
def test_max_pool2d_against_pytorch(case, dt, channels_last):
    shape, k, s, p, ceil = POOL_CASES[case]
    x = layout(randn(*shape, seed=40 + case), channels_last).to(dt).requires_grad_()
    y, idx = kt.max_pool2d(x, k, s, p, 1, ceil, True)
    yr, idxr = F.max_pool2d(x.detach(), k, s, p, 1, ceil, True)
    what = f"max_pool2d {POOL_CASES[case]} {dt}"
    assert torch.equal(y, yr), f"{what}: values"  # a selection: exact
    assert idx.dtype == torch.int64 and torch.equal(idx, idxr), f"{what}: indices"
    if channels_last and shape[1] > 1 and y.shape[2] * y.shape[3] > 1:
        assert y.is_contiguous(memory_format=torch.channels_last)
    dy = layout(randn(*y.shape, seed=50 + case), channels_last).to(dt)
    (gx,) = torch.autograd.grad(y, [x], dy)
    xr = x.detach().double().requires_grad_()
    (rgx,) = torch.autograd.grad(F.max_pool2d(xr, k, s, p, 1, ceil), [xr], dy.double())
    # The same windows select the same elements (the float64 input has the same order).
    (mag,) = torch.autograd.grad(F.max_pool2d(xr, k, s, p, 1, ceil), [xr], dy.double().abs())
    within(f"{what} dx", gx, rgx, stored(dt, rgx, gamma(windows_per_input(k, s)) * mag), dt)
    assert torch.equal(kt.max_pool2d(x.detach(), k, s, p, 1, ceil), y)  # without indices


@pytest.mark.parametrize("count_include_pad", [True, False], ids=["include_pad", "exclude_pad"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("case", range(len(POOL_CASES)))
def test_avg_pool2d_against_pytorch(case, dt, channels_last, count_include_pad):
    shape, k, s, p, ceil = POOL_CASES[case]
    x = layout(randn(*shape, seed=60 + case), channels_last).to(dt).requires_grad_()
    y = kt.avg_pool2d(x, k, s, p, ceil, count_include_pad)
    dy = layout(randn(*y.shape, seed=70 + case), channels_last).to(dt)
    (gx,) = torch.autograd.grad(y, [x], dy)
    # The references in NCHW: PyTorch's CUDA backward for channels_last inputs with padding is
    # wrong before pytorch/pytorch#188345 (issue #188344: the padding offset is left out).
    xr = x.detach().double().contiguous().requires_grad_()
    yr = F.avg_pool2d(xr, k, s, p, ceil, count_include_pad)
    (rgx,) = torch.autograd.grad(yr, [xr], dy.double().contiguous())
    xa = x.detach().double().abs().contiguous().requires_grad_()
    ya = F.avg_pool2d(xa, k, s, p, ceil, count_include_pad)
    (ga,) = torch.autograd.grad(ya, [xa], dy.double().abs().contiguous())
    kh, kw = _pair(k)
    what = f"avg_pool2d {POOL_CASES[case]} {dt} include_pad={count_include_pad}"
    within(f"{what} y", y.detach(), yr.detach(), stored(dt, yr.detach(), gamma(kh * kw + 1) * ya.detach()), dt)
    within(f"{what} dx", gx, rgx, stored(dt, rgx, gamma(2 * windows_per_input(k, s)) * ga), dt)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", [(2, 5, 7, 9), (3, 64, 4, 4), (1, 3, 1, 1), (2, 16, 33, 31)], ids=str)
def test_adaptive_avg_pool2d_to_one(shape, dt, channels_last):
    x = layout(randn(*shape, seed=80), channels_last).to(dt).requires_grad_()
    y = kt.adaptive_avg_pool2d(x, 1)
    assert y.shape == (shape[0], shape[1], 1, 1)
    dy = randn(*y.shape, seed=81).to(dt)
    (gx,) = torch.autograd.grad(y, [x], dy)
    xr = x.detach().double().requires_grad_()
    yr = F.adaptive_avg_pool2d(xr, 1)
    (rgx,) = torch.autograd.grad(yr, [xr], dy.double())
    hw = shape[2] * shape[3]
    mag = x.detach().double().abs().mean((2, 3), keepdim=True)
    what = f"adaptive_avg_pool2d {shape} {dt}"
    within(f"{what} y", y.detach(), yr.detach(), stored(dt, yr.detach(), gamma(hw + 1) * mag), dt)
    within(f"{what} dx", gx, rgx, stored(dt, rgx, 2 * U * rgx.abs()), dt)


def test_adaptive_avg_pool2d_other_sizes_run_pytorchs():
    x = randn(2, 3, 8, 8, seed=82)
    calls = []
    orig = _native.global_avg_pool2d
    import kernels_torch._conv as conv_mod

    def spy(*a):
        calls.append(a)
        return orig(*a)

    conv_mod._native.global_avg_pool2d = spy
    try:
        assert torch.equal(kt.adaptive_avg_pool2d(x, (2, 4)), F.adaptive_avg_pool2d(x, (2, 4)))
        assert torch.equal(kt.adaptive_avg_pool2d(x.cpu(), 1), F.adaptive_avg_pool2d(x.cpu(), 1))
        assert not calls
        assert torch.equal(kt.adaptive_avg_pool2d(x, (None, 1)), F.adaptive_avg_pool2d(x, (None, 1)))
        assert not calls
        kt.adaptive_avg_pool2d(x, (1, 1))
        knn.AdaptiveAvgPool2d(1)(x)
        assert len(calls) == 2
    finally:
        conv_mod._native.global_avg_pool2d = orig


def test_pool_refusals():
    x = randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match="dilation"):
        kt.max_pool2d(x, 3, 1, 1, 2)
    with pytest.raises(ValueError, match="half of the kernel"):
        kt.max_pool2d(x, 3, 1, 2)
    with pytest.raises(ValueError, match="divisor_override"):
        kt.avg_pool2d(x, 2, divisor_override=3)


# --- opcheck, the two call paths, streams, torch.compile -----------------------------------------


def test_opcheck():
    """torch.library.opcheck on every op of this family, both layouts (the ops take physical
    shapes: NHWC tensors are [N, H, W, C], filters [K, R, S, C/groups])."""
    ops = torch.ops.rustkernels
    x = randn(2, 8, 7, 6, seed=90).requires_grad_()
    xh = randn(2, 7, 6, 8, seed=91).requires_grad_()
    w = randn(4, 8, 3, 3, scale=0.2, seed=92).requires_grad_()
    wh = randn(4, 3, 3, 8, scale=0.2, seed=93).requires_grad_()
    b = randn(4, seed=94).requires_grad_()
    g = randn(2, 4, 4, 3, seed=95)
    c = dict(stride=[2, 2], padding=[1, 1], dilation=[1, 1])
    cases = [
        (ops.conv2d, (x, w, b, c["stride"], c["padding"], c["dilation"], 1, 0)),
        (ops.conv2d, (xh, wh, None, c["stride"], c["padding"], c["dilation"], 1, 1)),
        (ops.conv2d_backward, (x.detach(), w.detach(), g, [2, 2], [1, 1], [1, 1], 1, 0, True, True, True)),
        (ops.conv2d_backward, (x.detach(), w.detach(), g, [2, 2], [1, 1], [1, 1], 1, 0, False, True, False)),
    ]
    bw = (randn(8, seed=96) + 1).requires_grad_()
    bb = randn(8, seed=97).requires_grad_()
    rm, rv = randn(8, seed=98), randn(8, seed=99).abs() + 0.5
    cases += [
        (ops.batch_norm, (x, bw, bb, rm, rv, True, 0.1, 1e-5, 0)),
        (ops.batch_norm, (xh, bw, bb, rm, rv, False, 0.1, 1e-5, 1)),
        (ops.batch_norm, (x, None, None, None, None, True, 0.1, 1e-5, 0)),
    ]
    y, mean, invstd, _, _ = ops.batch_norm(x.detach(), bw.detach(), bb.detach(), None, None, True, 0.1, 1e-5, 0)
    cases.append((ops.batch_norm_backward, (x.detach(), bw.detach(), mean, invstd, randn(*x.shape), True, 0, True, True)))
    pool = ([3, 3], [2, 2], [1, 1], True)
    cases += [
        (ops.max_pool2d, (x, *pool, 0)),
        (ops.max_pool2d, (xh, *pool, 1)),
        (ops.avg_pool2d, (x, *pool, False, 0)),
        (ops.avg_pool2d, (xh, *pool, True, 1)),
        (ops.global_avg_pool2d, (x, 0)),
        (ops.global_avg_pool2d, (xh, 1)),
    ]
    yp, idx = ops.max_pool2d(x.detach(), *pool, 0)
    cases += [
        (ops.max_pool2d_backward, (randn(*yp.shape, seed=100), idx, list(x.shape), *pool, 0)),
        (ops.avg_pool2d_backward, (randn(*yp.shape, seed=101), list(x.shape), *pool, True, 0)),
        (ops.global_avg_pool2d_backward, (randn(2, 1, 1, 8, seed=102), list(xh.shape), 1)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    assert torch.equal(rm, randn(8, seed=98)), "the op must not write its running_mean input"


def test_eager_path_and_custom_op_path_agree():
    """The functions' eager path (an autograd.Function calling the implementations) and the custom
    ops run the same kernels: the same bits, forward and backward."""
    x = randn(2, 8, 9, 7, seed=110).contiguous(memory_format=torch.channels_last).requires_grad_()
    w = randn(16, 8, 3, 3, scale=0.2, seed=111).requires_grad_()
    b = randn(16, seed=112).requires_grad_()
    ops = torch.ops.rustkernels

    def eager(x, w, b):
        return kt.conv2d(x, w, b, 2, 1)

    def op(x, w, b):
        return ops.conv2d(x.permute(0, 2, 3, 1), w.permute(0, 2, 3, 1), b, [2, 2], [1, 1], [1, 1], 1, 1).permute(
            0, 3, 1, 2
        )

    g = randn(2, 16, 5, 4, seed=113)
    ye = eager(x, w, b)
    ge = torch.autograd.grad(ye, [x, w, b], g)
    yo = op(x, w, b)
    go = torch.autograd.grad(yo, [x, w, b], g)
    assert torch.equal(ye, yo)
    for a, c in zip(ge, go):
        assert torch.equal(a, c)
    bw, bb = randn(8, seed=114).requires_grad_(), randn(8, seed=115).requires_grad_()
    rm, rv = torch.zeros(8, device=DEV), torch.ones(8, device=DEV)
    ye = kt.batch_norm(x, rm, rv, bw, bb, True)
    yo = ops.batch_norm(x.permute(0, 2, 3, 1), bw, bb, rm, rv, True, 0.1, 1e-5, 1)[0].permute(0, 3, 1, 2)
    gb = randn(*x.shape, seed=116)
    for a, c in zip(torch.autograd.grad(ye, [x, bw, bb], gb), torch.autograd.grad(yo, [x, bw, bb], gb)):
        assert torch.equal(a, c)
    assert torch.equal(ye, yo)


def test_runs_on_the_current_stream():
    """On a side stream after a long sleep: the ops must see what the stream computed before them,
    and work queued after them their outputs, with no synchronisation."""
    x = randn(4, 8, 16, 16, seed=120)
    w = randn(8, 8, 3, 3, scale=0.2, seed=121)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        x2 = x * 2
        y = kt.conv2d(x2, w, None, 1, 1)
        z = kt.batch_norm(y, None, None, None, None, True)
        p = kt.max_pool2d(z, 2)
        q = kt.adaptive_avg_pool2d(p, 1)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    xd = (x * 2).double()
    yr = F.conv2d(xd, w.double(), None, 1, 1)
    zr = F.batch_norm(yr, None, None, None, None, True)
    qr = F.adaptive_avg_pool2d(F.max_pool2d(zr, 2), 1)
    close(y, yr, torch.float32, "conv on a side stream")
    close(q, qr, torch.float32, "conv, batch norm, pools on a side stream")


def test_torch_compile_fullgraph():
    """The same kernels compiled (every op of f is one of ours, or a view): the same bits."""

    def f(x, w, bw, bb, rm, rv):
        h = kt.conv2d(x, w, None, 1, 1)
        h = kt.batch_norm(h, rm, rv, bw, bb, True)
        h = kt.relu(h)
        h = kt.max_pool2d(h, 3, 2, 1)
        return kt.adaptive_avg_pool2d(h, 1)

    x = randn(2, 8, 9, 9, seed=130).contiguous(memory_format=torch.channels_last)
    w = randn(8, 8, 3, 3, scale=0.2, seed=131).contiguous(memory_format=torch.channels_last).requires_grad_()
    bw, bb = (randn(8, seed=132) + 1).requires_grad_(), randn(8, seed=133).requires_grad_()
    rms = [torch.zeros(8, device=DEV) for _ in range(2)]
    rvs = [torch.ones(8, device=DEV) for _ in range(2)]
    cf = torch.compile(f, fullgraph=True)
    g = randn(2, 8, 1, 1, seed=134)
    le = f(x, w, bw, bb, rms[0], rvs[0])
    ge = torch.autograd.grad(le, [w, bw, bb], g)
    lc = cf(x, w, bw, bb, rms[1], rvs[1])
    gc = torch.autograd.grad(lc, [w, bw, bb], g)
    assert torch.equal(le, lc)
    for a, c in zip(ge, gc):
        assert torch.equal(a, c)
    assert torch.equal(rms[0], rms[1]) and torch.equal(rvs[0], rvs[1]), "the running statistics, updated once each"
    assert not torch.equal(rms[1], torch.zeros(8, device=DEV))


# --- modules ------------------------------------------------------------------------------------


def spy_on(name):
    """Counts the calls of ``_native.<name>`` (the kernels' entry) while in the context."""
    import contextlib

    import kernels_torch._conv as conv_mod

    @contextlib.contextmanager
    def ctx():
        calls = []
        orig = getattr(_native, name)

        def spy(*a):
            calls.append(a)
            return orig(*a)

        setattr(conv_mod._native, name, spy)
        try:
            yield calls
        finally:
            setattr(conv_mod._native, name, orig)

    return ctx()


def test_conv2d_module_state_dict_and_fallbacks():
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(6, 10, 3, stride=2, padding=1, groups=2, device=DEV)
    ours = knn.Conv2d(6, 10, 3, stride=2, padding=1, groups=2, device=DEV)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ours.load_state_dict(ref.state_dict())
    x = randn(3, 6, 11, 9, seed=140)
    with spy_on("conv2d_fwd") as calls:
        y = ours(x)
        assert len(calls) == 1
        r = ConvReference(x, ref.weight.detach(), ref.bias.detach(), torch.ones_like(y),
                          dict(stride=2, padding=1, dilation=1, groups=2), False)  # fmt: skip
        within("nn.Conv2d", y.detach(), r.y, r.ytol, torch.float32)
        # CPU, float64, reflect padding and an asymmetric "same": PyTorch's, bit for bit.
        cpu = knn.Conv2d(6, 10, 3, padding=1, groups=2)
        cpu.load_state_dict({k: v.cpu() for k, v in ref.state_dict().items()})
        assert torch.equal(cpu(x.cpu()), F.conv2d(x.cpu(), cpu.weight, cpu.bias, 1, 1, 1, 2))
        refl = knn.Conv2d(6, 10, 3, padding=1, padding_mode="reflect", groups=2, device=DEV)
        refl(x)
        same = knn.Conv2d(6, 10, 2, padding="same", groups=2, device=DEV)
        same(x)
        dbl = knn.Conv2d(6, 10, 3, groups=2, device=DEV, dtype=torch.float64)
        dbl(x.double())
        assert len(calls) == 1
        # Under autocast: bf16, as F.conv2d; the f32 weight's gradient comes back in f32.
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yb = ours(x)
        assert yb.dtype == torch.bfloat16 and len(calls) == 2
        yb.float().sum().backward()
        assert ours.weight.grad.dtype == torch.float32


def test_batch_norm_module_trains_as_pytorchs():
    """Three training steps and one evaluation: outputs, running statistics and
    num_batches_tracked as PyTorch's module, with momentum 0.1 and with momentum None (a
    cumulative average)."""
    for momentum in (0.1, None):
        torch.manual_seed(1)
        ref = torch.nn.BatchNorm2d(5, momentum=momentum, device=DEV)
        ours = knn.BatchNorm2d(5, momentum=momentum, device=DEV)
        assert ours.state_dict().keys() == ref.state_dict().keys()
        with torch.no_grad():
            ref.weight.normal_()
            ref.bias.normal_()
        ours.load_state_dict(ref.state_dict())
        ref64 = torch.nn.BatchNorm2d(5, momentum=momentum, device=DEV, dtype=torch.float64)
        ref64.load_state_dict(ref.state_dict())
        with spy_on("batch_norm_fwd") as calls:
            for step in range(3):
                x = randn(4, 5, 6, 7, scale=2.0, seed=150 + step) + step
                close(ours(x), ref64(x.double()), torch.float32, f"BatchNorm2d step {step}")
            assert len(calls) == 3
            assert int(ours.num_batches_tracked) == int(ref64.num_batches_tracked) == 3
            close(ours.running_mean, ref64.running_mean, torch.float32, "running_mean")
            close(ours.running_var, ref64.running_var, torch.float32, "running_var")
            ours.eval()
            ref64.eval()
            x = randn(4, 5, 6, 7, seed=160)
            close(ours(x), ref64(x.double()), torch.float32, "BatchNorm2d eval")
            assert len(calls) == 4
            # Half-precision parameters and CPU tensors: PyTorch's.
            half = knn.BatchNorm2d(5, device=DEV, dtype=torch.float16)
            half(x.half())
            knn.BatchNorm2d(5)(x.cpu())
            assert len(calls) == 4
            # Under autocast the input is bf16, the parameters f32: the kernels, as cuDNN.
            with torch.autocast("cuda", dtype=torch.bfloat16):
                yb = ours(x.bfloat16())
            assert yb.dtype == torch.bfloat16 and len(calls) == 5


def test_pool_modules():
    x = randn(2, 3, 9, 8, seed=170).contiguous(memory_format=torch.channels_last)
    with spy_on("max_pool2d_fwd") as calls:
        m = knn.MaxPool2d(3, 2, 1)
        assert torch.equal(m(x), torch.nn.MaxPool2d(3, 2, 1)(x))
        mi = knn.MaxPool2d(2, return_indices=True)
        y, i = mi(x)
        yr, ir = torch.nn.MaxPool2d(2, return_indices=True)(x)
        assert torch.equal(y, yr) and torch.equal(i, ir)
        knn.MaxPool2d(3, 1, 1, dilation=2)(x)  # PyTorch's
        knn.MaxPool2d(2)(x.cpu())
        assert len(calls) == 2
    a = knn.AvgPool2d(3, 2, 1, count_include_pad=False)
    r = F.avg_pool2d(x.double(), 3, 2, 1, count_include_pad=False)
    close(a(x), r, torch.float32, "AvgPool2d")
    assert torch.equal(knn.AvgPool2d(2, divisor_override=3)(x), F.avg_pool2d(x, 2, divisor_override=3))
    g = knn.AdaptiveAvgPool2d(1)
    close(g(x), F.adaptive_avg_pool2d(x.double(), 1), torch.float32, "AdaptiveAvgPool2d")
    assert knn.AdaptiveAvgPool2d((3, 2))(x).shape == (2, 3, 3, 2)


def conv_bn_relu_reference(x, conv, bn):
    """relu(bn(conv(x))) in float64 (bn in evaluation), and the magnitudes of the folded
    convolution's terms, ``conv(|x|, |w s|) + |(b - mean) s| + |bias|``."""
    xd = x.double()
    s = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
    cb = conv.bias.double() if conv.bias is not None else 0.0
    opts = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups)
    z = F.conv2d(xd, conv.weight.double(), None, **opts)
    y = F.relu(F.batch_norm(z + (cb.view(1, -1, 1, 1) if conv.bias is not None else 0), bn.running_mean.double(),
                            bn.running_var.double(), bn.weight.double(), bn.bias.double(), False, 0.0, bn.eps))  # fmt: skip
    bf = ((cb - bn.running_mean.double()) * s).abs() + bn.bias.double().abs()
    m = F.conv2d(xd.abs(), (conv.weight.double() * s.view(-1, 1, 1, 1)).abs(), None, **opts) + bf.view(1, -1, 1, 1)
    return y, m


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_conv_bn_relu(dt, channels_last):
    """Training: the three modules in turn, as the same three modules alone (the same kernels).
    Evaluation: one folded convolution and the relu, under the fold's roundings, in f32 (``s =
    weight / sqrt(var + eps)`` within 8 u: rsqrt's 2 ulp and three roundings; ``w s`` one more;
    ``(b - mean) s + bias`` within 12 u of ``|(b - mean) s| + |bias|``): 16 u of every term's
    magnitude; under bf16 autocast the folded weight and bias are then rounded to bf16 (``u_d``)
    before the convolution; then the convolution's own bound, the store, and the relu
    (1-Lipschitz)."""
    torch.manual_seed(2)
    m = knn.ConvBNReLU(16, 24, 3, stride=1, padding=1, bias=True, device=DEV)
    ref = torch.nn.Sequential(torch.nn.Conv2d(16, 24, 3, 1, 1, bias=True), torch.nn.BatchNorm2d(24), torch.nn.ReLU())
    ref = ref.to(DEV)
    assert m.state_dict().keys() == ref.state_dict().keys()
    ref.load_state_dict(m.state_dict())
    x = layout(randn(3, 16, 10, 9, seed=180), channels_last)
    # Training: running statistics and outputs as the module sequence.
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dt == torch.bfloat16):
        y = m(x)
        seq = torch.nn.Sequential(knn.Conv2d(16, 24, 3, 1, 1), knn.BatchNorm2d(24), knn.ReLU()).to(DEV)
        seq.load_state_dict(ref.state_dict())
        assert torch.equal(y, seq(x))
    assert torch.equal(m[1].running_mean, seq[1].running_mean)
    # Evaluation, folded: against float64 relu(bn(conv(x))) with the trained statistics.
    m.eval()
    with torch.no_grad():
        m[1].running_var.mul_(randn(24, seed=181).abs() + 0.5)
        m[1].weight.normal_()
    with spy_on("batch_norm_fwd") as bn_calls, spy_on("conv2d_fwd") as conv_calls:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dt == torch.bfloat16):
            y = m(x)
        assert len(conv_calls) == 1 and not bn_calls, "one convolution, no batch norm"
    assert y.dtype == dt
    yr, mag = conv_bn_relu_reference(x.to(dt), m[0], m[1])  # autocast's bf16 input
    tc = on_tensor_cores(dt, channels_last, 16, 1)
    conv_acc = tc_terms(16 * 9) * ULP if tc else gamma(16 * 9 + 1)
    fold = 16 * U + UNIT[dt][0]
    tol = stored(dt, yr, (conv_acc * (1 + fold) + fold) * mag)
    within(f"ConvBNReLU eval {dt}", y, yr, tol, dt)
    # from_modules over PyTorch's modules: shares their parameters.
    conv, bn = torch.nn.Conv2d(16, 24, 3, padding=1, device=DEV), torch.nn.BatchNorm2d(24, device=DEV)
    fm = knn.ConvBNReLU.from_modules(conv, bn)
    assert fm[0].weight is conv.weight and isinstance(fm[0], knn.Conv2d) and isinstance(fm[1], knn.BatchNorm2d)


def test_small_cnn_trains_like_pytorch():
    """A small CNN (ConvBNReLU, MaxPool2d, Conv2d, BatchNorm2d, ReLU, AdaptiveAvgPool2d, Linear) on
    generated 16 x 16 images of 4 classes (a colour per class under unit noise), SGD with
    momentum, 60 steps, channels_last f32, from the same weights and batches as the same network
    of PyTorch's modules (cuDNN without TF32, so both compute in f32). The losses differ by the
    two implementations' f32 roundings (a few ulp per operation; up to about 1e-5 relative for
    the Winograd and FFT convolutions cuDNN may pick), which training carries on and amplifies:
    the first loss must agree within 1e-4 (relative), the first five within 1e-3, and both runs
    must halve their loss."""

    def net(mods):
        conv, bn, relu, pool, gap, lin = mods
        return torch.nn.Sequential(
            torch.nn.Sequential(conv(3, 16, 3, 1, 1, bias=False), bn(16), relu()),
            pool(2),
            conv(16, 32, 3, 1, 1, bias=False),
            bn(32),
            relu(),
            gap(1),
            torch.nn.Flatten(),
            lin(32, 4),
        ).to(DEV, memory_format=torch.channels_last)

    tn = torch.nn
    torch.manual_seed(3)
    ref = net((tn.Conv2d, tn.BatchNorm2d, tn.ReLU, tn.MaxPool2d, tn.AdaptiveAvgPool2d, tn.Linear))
    ours = net((knn.Conv2d, knn.BatchNorm2d, knn.ReLU, knn.MaxPool2d, knn.AdaptiveAvgPool2d, knn.Linear))
    ours[0] = knn.ConvBNReLU.from_modules(ours[0][0], ours[0][1])
    ours.load_state_dict(ref.state_dict())
    g = torch.Generator(device=DEV).manual_seed(4)
    colours = torch.randn(4, 3, 1, 1, generator=g, device=DEV)
    batches = []
    for _ in range(60):
        y = torch.randint(0, 4, (32,), generator=g, device=DEV)
        x = colours[y] + torch.randn(32, 3, 16, 16, generator=g, device=DEV)
        batches.append((x.contiguous(memory_format=torch.channels_last), y))
    prev = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        curves = []
        for model in (ref, ours):
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            losses = []
            for x, y in batches:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            curves.append(losses)
    finally:
        torch.backends.cudnn.allow_tf32 = prev
    r, o = curves
    print(f"loss: first {r[0]:.5f} / {o[0]:.5f}, last {r[-1]:.5f} / {o[-1]:.5f} (PyTorch / ours)")
    assert o[0] == pytest.approx(r[0], rel=1e-4)
    for i in range(5):
        assert o[i] == pytest.approx(r[i], rel=1e-3), f"step {i}: {o[i]} against {r[i]}"
    assert max(r[-5:]) < r[0] / 2 and max(o[-5:]) < o[0] / 2


def test_gradcheck_f32():
    """Finite differences in f32 (the kernels have no float64): eps 1e-3, the function's magnitude
    about 1: truncation near 1e-7, rounding near 1e-4, under the atol."""
    x = randn(2, 3, 5, 4, seed=190).requires_grad_()
    w = randn(4, 3, 3, 3, scale=0.3, seed=191).requires_grad_()
    b = randn(4, seed=192).requires_grad_()
    bw = (randn(3, seed=193) * 0.2 + 1).requires_grad_()
    bb = randn(3, seed=194).requires_grad_()
    cases = {
        "conv2d": (lambda x, w, b: kt.conv2d(x, w, b, 1, 1), [x, w, b]),
        "conv2d strided dilated": (lambda x, w: kt.conv2d(x, w, None, 2, 2, 2), [x, w]),
        "batch_norm": (lambda x, w, b: kt.batch_norm(x, None, None, w, b, True), [x, bw, bb]),
        "avg_pool2d": (lambda x: kt.avg_pool2d(x, 3, 2, 1, True, False), [x]),
        "adaptive_avg_pool2d": (lambda x: kt.adaptive_avg_pool2d(x, 1), [x]),
    }
    for name, (f, inputs) in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "not a double precision floating point"
            assert torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=2e-3, rtol=2e-2), name
