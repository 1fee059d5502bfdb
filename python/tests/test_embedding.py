"""``kernels_torch.embedding`` (and ``nn.Embedding``) against ``F.embedding``: the forward bit for
bit (a copy), the backward against PyTorch's in float64 within the bound of an f32 sum of ``c``
terms, ``gamma(c - 1) * sum|g|`` (``gamma(k) = k u / (1 - k u)``, ``u = 2^-24``), plus one rounding
to the storage type; ``padding_idx``, out-of-range indices, determinism, the module's fallbacks,
opcheck and ``torch.compile(fullgraph=True)``.
"""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kernels_torch as kt  # noqa: E402
from kernels_torch import nn as knn  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Half an ulp of the final rounding to the dtype, relative (none for float32), and the dtype's
# smallest subnormal (the rounding's absolute floor).
HALF_ULP = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
TINY = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}
DEV = "cuda"


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def randint(high, shape, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randint(0, high, shape, generator=g, device=DEV)


def bits(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def grad_bound_check(gw, idx, g, v, padding_idx=None, what=""):
    """``gw`` against the float64 sums of ``g``'s rows per index, within the f32 bound."""
    dt = gw.dtype
    d = g.shape[-1]
    flat, g2 = idx.reshape(-1), g.reshape(-1, d).double()
    keep = (flat >= 0) & (flat < v)
    if padding_idx is not None:
        keep &= flat != (padding_idx % v)
    flat, g2 = flat[keep], g2[keep]
    ref = torch.zeros(v, d, dtype=torch.float64, device=DEV).index_add_(0, flat, g2)
    absum = torch.zeros(v, d, dtype=torch.float64, device=DEV).index_add_(0, flat, g2.abs())
    c = torch.bincount(flat, minlength=v).double()[:, None]
    u = 2.0**-24
    k = (c - 1).clamp(min=0)
    bound = k * u / (1 - k * u) * absum
    bound = bound + HALF_ULP[dt] * (ref.abs() + bound) + TINY[dt]
    err = (gw.double() - ref).abs()
    bad = err > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, worst {(err - bound).max().item():.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 3, 8, 9, 768, 4099])
@pytest.mark.parametrize("v,shape", [(1, (5,)), (100, (13,)), (1000, (4, 37)), (7, (0,))])
def test_embedding_against_pytorch(dtype, d, v, shape):
    w = randn(v, d, dtype=dtype, seed=d + v).requires_grad_()
    idx = randint(v, shape, seed=v)
    y = kt.embedding(idx, w)
    ref = F.embedding(idx, w.detach())
    assert y.shape == ref.shape and y.dtype == dtype
    assert torch.equal(bits(y), bits(ref))
    g = randn(*y.shape, dtype=dtype, seed=3)
    (gw,) = torch.autograd.grad(y, w, g)
    assert gw.shape == w.shape and gw.dtype == dtype
    grad_bound_check(gw, idx, g, v, what=f"{dtype} d={d} v={v} shape={shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_distinct_indices_give_pytorchs_gradient_bits(dtype):
    v, d = 64, 40
    w = randn(v, d, dtype=dtype, seed=1).requires_grad_()
    idx = torch.randperm(v, device=DEV)[:50]
    g = randn(50, d, dtype=dtype, seed=2)
    (ours,) = torch.autograd.grad(kt.embedding(idx, w), w, g)
    (theirs,) = torch.autograd.grad(F.embedding(idx, w), w, g)
    # One term a row: the gradient's own bits (zeros elsewhere).
    assert torch.equal(bits(ours), bits(theirs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding_idx", [0, 5, -1, -3])
def test_padding_idx_gets_no_gradient(dtype, padding_idx):
    v, d = 9, 16
    w = randn(v, d, dtype=dtype, seed=4).requires_grad_()
    idx = randint(v, (300,), seed=5)
    y = kt.embedding(idx, w, padding_idx=padding_idx)
    assert torch.equal(bits(y), bits(F.embedding(idx, w.detach(), padding_idx=padding_idx)))
    g = randn(*y.shape, dtype=dtype, seed=6)
    (gw,) = torch.autograd.grad(y, w, g)
    assert torch.equal(gw[padding_idx % v], torch.zeros(d, dtype=dtype, device=DEV))
    grad_bound_check(gw, idx, g, v, padding_idx, what=f"{dtype} padding {padding_idx}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_repeated_index_and_determinism(dtype):
    v, d, n = 11, 64, 20000
    w = randn(v, d, dtype=dtype, seed=7).requires_grad_()
    idx = torch.full((n,), 4, device=DEV)
    g = randn(n, d, dtype=dtype, seed=8)
    y = kt.embedding(idx, w)
    (a,) = torch.autograd.grad(y, w, g, retain_graph=True)
    grad_bound_check(a, idx, g, v, what=f"{dtype} all equal")
    many = randint(v, (n,), seed=9)
    ym = kt.embedding(many, w)
    (b,) = torch.autograd.grad(ym, w, g, retain_graph=True)
    for _ in range(3):
        (c,) = torch.autograd.grad(ym, w, g, retain_graph=True)
        assert torch.equal(bits(b), bits(c))


@pytest.mark.gpu
def test_out_of_range_indices_give_zeros_and_no_gradient():
    v, d = 6, 8
    w = randn(v, d, seed=10).requires_grad_()
    idx = torch.tensor([0, -1, 6, 5, 1 << 40], device=DEV)
    y = kt.embedding(idx, w)
    assert torch.equal(y[[0, 3]], w.detach()[[0, 5]])
    assert torch.equal(y[[1, 2, 4]], torch.zeros(3, d, device=DEV))
    (gw,) = torch.autograd.grad(y, w, torch.ones_like(y))
    want = torch.zeros(v, d, device=DEV)
    want[[0, 5]] = 1.0
    assert torch.equal(gw, want)


@pytest.mark.gpu
def test_embedding_errors():
    w = randn(10, 4)
    idx = randint(10, (3,))
    with pytest.raises(TypeError):
        kt.embedding(idx.int(), w)
    with pytest.raises(ValueError):
        kt.embedding(idx, w, padding_idx=10)
    with pytest.raises(ValueError):
        kt.embedding(idx, w, padding_idx=-11)
    with pytest.raises(ValueError):
        kt.embedding(idx, w.reshape(40))
    with pytest.raises(ValueError):
        kt.embedding(idx, w.cpu())
    with pytest.raises(ValueError):
        torch.ops.rustkernels.embedding_backward(randn(4, 4), idx, 10, -1)


@pytest.mark.gpu
def test_embedding_module_uses_the_kernel_and_pytorchs_state_dict():
    ref = torch.nn.Embedding(50, 24, padding_idx=3, device=DEV, dtype=torch.bfloat16)
    m = knn.Embedding(50, 24, padding_idx=3, device=DEV, dtype=torch.bfloat16)
    m.load_state_dict(ref.state_dict())
    assert set(m.state_dict()) == {"weight"}
    idx = randint(50, (4, 9), seed=11)
    y = m(idx)
    assert torch.equal(bits(y), bits(ref(idx)))
    y.float().sum().backward()
    grad_bound_check(m.weight.grad, idx, torch.ones(4, 9, 24, dtype=torch.bfloat16, device=DEV), 50, 3, "module")
    # PyTorch's own for what the kernels do not do.
    for kw in ({"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}):
        a = knn.Embedding(50, 24, device=DEV, **kw)
        b = torch.nn.Embedding(50, 24, device=DEV, **kw)
        b.load_state_dict(a.state_dict())
        assert torch.equal(a(idx), b(idx)), kw
    i32 = knn.Embedding(50, 24, device=DEV)
    assert torch.equal(i32(idx.int()), F.embedding(idx, i32.weight))


@pytest.mark.gpu
def test_embedding_opcheck():
    w = randn(20, 12, seed=12).requires_grad_()
    idx = randint(20, (3, 5), seed=13)
    ops = torch.ops.rustkernels
    for p in (-1, 2):
        torch.library.opcheck(ops.embedding, (idx, w, p))
        torch.library.opcheck(ops.embedding_backward, (randn(3, 5, 12, seed=14), idx, 20, p))


@pytest.mark.gpu
def test_embedding_torch_compile_fullgraph():
    w = randn(100, 64, dtype=torch.bfloat16, seed=15).requires_grad_()
    idx = randint(100, (8, 16), seed=16)

    def f(w, idx):
        return (kt.embedding(idx, w, padding_idx=0).float() ** 2).sum()

    ge = torch.autograd.grad(f(w, idx), w)[0]
    gc = torch.autograd.grad(torch.compile(f, fullgraph=True)(w, idx), w)[0]
    # The same kernels on the same inputs (the squares' sum is PyTorch's in both: compare loosely).
    torch.testing.assert_close(ge, gc)
