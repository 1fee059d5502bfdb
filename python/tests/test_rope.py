"""``kernels_torch.rope`` (and ``nn.RotaryEmbedding``) against the same formula composed of
PyTorch ops in float64 (``nn.rope_reference``), forward and backward, f32, f16 and bf16, both
layouts and conventions, a partial rotary dimension and position offsets; opcheck and
``torch.compile(fullgraph=True)``.

Tolerance: the kernel rotates in f32 (two products and a sum, each rounded once) and rounds once
to the storage type: ``|ours - ref| <= ulp(dtype) * |ref| + 2^-22 * max|x|`` elementwise (the
cosine and sine are at most 1, so each product is at most ``max|x|``).
"""

import pytest

torch = pytest.importorskip("torch")

import kernels_torch as kt  # noqa: E402
from kernels_torch import nn as knn  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
DEV = "cuda"


def randn(*shape, dtype=torch.float32, seed=0, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device).to(dtype)


def close(ours, ref, dtype, what=""):
    assert ours.dtype == dtype and ours.shape == ref.shape, f"{what}: {ours.dtype} {tuple(ours.shape)}"
    ref = ref.double()
    big = ref.abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(
        ours.double(), ref, rtol=ULP[dtype], atol=2.0**-22 * big + 1e-30, msg=lambda m: f"{what}: {m}"
    )


def shape_of(layout, b, s, h, d):
    return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,rot", [(128, 128), (64, 32), (80, 80), (6, 4)])
def test_rope_against_the_composition(dtype, layout, interleaved, d, rot):
    offset, s = 5, 17
    x = randn(*shape_of(layout, 2, s, 3, d), dtype=dtype, seed=d + rot).requires_grad_()
    g = randn(*x.shape, dtype=dtype, seed=7)
    cos, sin = kt.rope_tables(64, rot, 10000.0, DEV)
    y = kt.rope(x, cos, sin, layout=layout, interleaved=interleaved, offset=offset)
    (gx,) = torch.autograd.grad(y, x, g)
    x64 = x.detach().double().requires_grad_()
    y64 = knn.rope_reference(x64, cos.double(), sin.double(), layout, interleaved, offset)
    (g64,) = torch.autograd.grad(y64, x64, g.double())
    what = f"{dtype} {layout} interleaved={interleaved} d={d} rot={rot}"
    close(y, y64, dtype, f"forward {what}")
    close(gx, g64, dtype, f"backward {what}")
    # The part beyond the rotary dimension passes through bit for bit.
    assert torch.equal(y[..., rot:], x.detach()[..., rot:])


@pytest.mark.gpu
def test_rotary_embedding_module_uses_the_kernel_on_cuda_and_pytorch_elsewhere():
    m = knn.RotaryEmbedding(64, 128, base=500000.0, layout="bshd", device=DEV)
    x = randn(2, 9, 4, 64, dtype=torch.bfloat16, seed=3)
    y = m(x, offset=11)
    assert torch.equal(y, kt.rope(x, m.cos, m.sin, layout="bshd", offset=11))
    cpu = knn.RotaryEmbedding(64, 128, base=500000.0, layout="bshd")
    close(y, cpu(x.cpu().double(), offset=11).to(DEV), torch.bfloat16, "module on CPU in float64")
    assert m.state_dict() == {}


@pytest.mark.gpu
def test_rope_errors():
    x = randn(1, 2, 8, 64)
    cos, sin = kt.rope_tables(8, 64, device=DEV)
    with pytest.raises(TypeError):
        kt.rope(x, cos.double(), sin)
    with pytest.raises(ValueError):
        kt.rope(x, cos, sin, offset=1)  # positions 1 to 8 of 8
    with pytest.raises(ValueError):
        kt.rope(x, cos, sin[:, :16])  # cos and sin of different shapes
    with pytest.raises(ValueError):
        kt.rope(x[0], cos, sin)
    with pytest.raises(ValueError):
        kt.rope(x, cos, sin, layout="sbhd")
    learned = cos.clone().requires_grad_()
    y = kt.rope(x.clone().requires_grad_(), learned, sin)
    with pytest.raises(NotImplementedError):
        y.sum().backward()


@pytest.mark.gpu
def test_rope_opcheck():
    x = randn(2, 3, 5, 16, seed=1).requires_grad_()
    cos, sin = kt.rope_tables(9, 16, device=DEV)
    ops = torch.ops.rustkernels
    for layout in (0, 1):
        for interleaved in (False, True):
            torch.library.opcheck(ops.rope, (x, cos, sin, layout, interleaved, 2))
            torch.library.opcheck(ops.rope_backward, (x.detach(), cos, sin, layout, interleaved, 2))


@pytest.mark.gpu
def test_rope_torch_compile_fullgraph():
    cos, sin = kt.rope_tables(32, 64, device=DEV)

    def f(q, k):
        q = kt.rope(q, cos, sin, layout="bshd", offset=3)
        k = kt.rope(k, cos, sin, layout="bshd", interleaved=True, offset=3)
        return (q * k).sum()

    q = randn(2, 16, 4, 64, dtype=torch.bfloat16, seed=4).requires_grad_()
    k = randn(2, 16, 4, 64, dtype=torch.bfloat16, seed=5).requires_grad_()
    cf = torch.compile(f, fullgraph=True)
    ye = f(q, k)
    ge = torch.autograd.grad(ye, (q, k))
    yc = cf(q, k)
    gc = torch.autograd.grad(yc, (q, k))
    # The same kernels on the same inputs: bit for bit (the sum is PyTorch's in both).
    for a, b in zip(ge, gc):
        assert torch.equal(a, b)
