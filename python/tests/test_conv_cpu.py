"""Convolution, batch norm and pooling without a GPU: the modules' fallback to PyTorch on CPU
tensors (bit for bit), their ``state_dict``, the operators' schemas, and their fake (meta)
implementations through autograd, both layouts."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kernels_torch as kt  # noqa: E402
from kernels_torch import nn as knn  # noqa: E402

CL = torch.channels_last


def test_modules_fall_back_to_pytorch_on_cpu():
    torch.manual_seed(0)
    x = torch.randn(3, 6, 11, 9, dtype=torch.float64)
    pairs = [
        (knn.Conv2d(6, 4, 3, 2, 1, groups=2, dtype=torch.float64), torch.nn.Conv2d(6, 4, 3, 2, 1, groups=2,
                                                                                    dtype=torch.float64)),
        (knn.MaxPool2d(3, 2, 1), torch.nn.MaxPool2d(3, 2, 1)),
        (knn.MaxPool2d(2, return_indices=True), torch.nn.MaxPool2d(2, return_indices=True)),
        (knn.AvgPool2d(3, 2, 1, count_include_pad=False), torch.nn.AvgPool2d(3, 2, 1, count_include_pad=False)),
        (knn.AdaptiveAvgPool2d(1), torch.nn.AdaptiveAvgPool2d(1)),
        (knn.AdaptiveAvgPool2d((2, 3)), torch.nn.AdaptiveAvgPool2d((2, 3))),
    ]  # fmt: skip
    for ours, ref in pairs:
        assert isinstance(ours, type(ref))
        ours.load_state_dict(ref.state_dict())
        a, b = ours(x), ref(x)
        if isinstance(a, tuple):
            assert all(torch.equal(p, q) for p, q in zip(a, b)), type(ref).__name__
        else:
            assert torch.equal(a, b), type(ref).__name__


def test_batch_norm_module_falls_back_and_keeps_the_running_statistics():
    for momentum in (0.1, None):
        ref = torch.nn.BatchNorm2d(6, momentum=momentum, dtype=torch.float64)
        ours = knn.BatchNorm2d(6, momentum=momentum, dtype=torch.float64)
        assert set(ours.state_dict()) == set(ref.state_dict())
        ours.load_state_dict(ref.state_dict())
        for step in range(3):
            x = torch.randn(4, 6, 5, 5, dtype=torch.float64) + step
            assert torch.equal(ours(x), ref(x))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(getattr(ours, name), getattr(ref, name)), name
        ours.eval()
        ref.eval()
        x = torch.randn(2, 6, 3, 3, dtype=torch.float64)
        assert torch.equal(ours(x), ref(x))


def test_conv_bn_relu_falls_back_and_has_sequentials_state_dict():
    torch.manual_seed(1)
    m = knn.ConvBNReLU(4, 8, 3, padding=1, dtype=torch.float64)
    ref = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                              torch.nn.ReLU()).double()  # fmt: skip
    assert set(m.state_dict()) == set(ref.state_dict())
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 4, 7, 6, dtype=torch.float64)
    assert torch.equal(m(x), ref(x))
    m.eval()
    ref.eval()
    assert torch.equal(m(x), ref(x))  # CPU: no folding, PyTorch's three modules
    # The fold itself (PyTorch ops): one convolution with the folded weight and bias.
    w, b = kt.fold_batch_norm(m[0].weight, None, m[1].running_mean, m[1].running_var, m[1].weight, m[1].bias, m[1].eps)
    torch.testing.assert_close(F.relu(F.conv2d(x, w, b, padding=1)), ref(x))


def test_schemas():
    ops = torch.ops.rustkernels
    for name in ("conv2d", "batch_norm", "max_pool2d", "avg_pool2d", "global_avg_pool2d"):
        assert hasattr(ops, name) and hasattr(ops, name + "_backward"), name
    assert str(ops.conv2d.default._schema) == (
        "rustkernels::conv2d(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, "
        "int groups, int layout) -> Tensor"
    )
    # Functional (no input written), so autograd can be registered: new running statistics come back.
    assert not ops.batch_norm.default._schema.is_mutable


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_fake_implementations_and_autograd_wiring_on_meta_tensors(channels_last):
    fmt = CL if channels_last else torch.contiguous_format
    x = torch.empty(2, 8, 9, 7, device="meta").contiguous(memory_format=fmt).requires_grad_()
    w = torch.empty(6, 4, 3, 3, device="meta").contiguous(memory_format=fmt).requires_grad_()
    b = torch.empty(6, device="meta", requires_grad=True)
    y = kt.conv2d(x, w, b, stride=2, padding=1, groups=2)
    assert y.shape == (2, 6, 5, 4) and y.device.type == "meta"
    assert y.is_contiguous(memory_format=CL) == channels_last
    gx, gw, gb = torch.autograd.grad(y.sum(), [x, w, b])
    assert gx.shape == x.shape and gw.shape == w.shape and gb.shape == b.shape
    (gw_only,) = torch.autograd.grad(kt.conv2d(x.detach(), w, None, 1, "same", 1, 2).sum(), [w])
    assert gw_only.shape == w.shape

    bw = torch.empty(8, device="meta", requires_grad=True)
    bb = torch.empty(8, device="meta", requires_grad=True)
    rm, rv = torch.zeros(8, device="meta"), torch.ones(8, device="meta")
    for training in (True, False):
        yb = kt.batch_norm(x, rm, rv, bw, bb, training)
        assert yb.shape == x.shape and yb.is_contiguous(memory_format=CL) == channels_last
        gs = torch.autograd.grad(yb.sum(), [x, bw, bb])
        assert [g.shape for g in gs] == [x.shape, bw.shape, bb.shape]
        assert gs[1].dtype == torch.float32
    xb = x.detach().to(torch.bfloat16).requires_grad_()
    yb = kt.batch_norm(xb, rm, rv, bw, bb, True)
    assert yb.dtype == torch.bfloat16
    gs = torch.autograd.grad(yb.sum(), [xb, bw, bb])
    assert [g.dtype for g in gs] == [torch.bfloat16, torch.float32, torch.float32]

    yp, idx = kt.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True)
    assert yp.shape == (2, 8, 5, 4) and idx.dtype == torch.int64 and idx.shape == yp.shape
    (g,) = torch.autograd.grad(yp.sum(), [x])
    assert g.shape == x.shape
    ya = kt.avg_pool2d(x, (3, 2), (2, 1), (1, 1))
    assert ya.shape == (2, 8, 5, 8)
    (g,) = torch.autograd.grad(ya.sum(), [x])
    assert g.shape == x.shape
    layout = 1 if channels_last else 0
    phys = x.permute(0, 2, 3, 1) if channels_last else x
    yg = torch.ops.rustkernels.global_avg_pool2d(phys, layout)
    assert yg.shape == ((2, 1, 1, 8) if channels_last else (2, 8, 1, 1))
    (g,) = torch.autograd.grad(yg.sum(), [x])
    assert g.shape == x.shape


def test_refusals_without_a_gpu():
    x = torch.randn(2, 4, 8, 8)
    w = torch.randn(6, 4, 3, 3)
    with pytest.raises(ValueError, match="x is on cpu; the kernels run on CUDA tensors only"):
        kt.conv2d(x, w)
    with pytest.raises(ValueError, match="x is on cpu"):
        kt.batch_norm(x, None, None, None, None, True)
    with pytest.raises(ValueError, match="x is on cpu"):
        kt.max_pool2d(x, 2)
    # The output sizes and arguments are checked as PyTorch checks them (on meta tensors: no data).
    m = torch.empty(2, 4, 8, 8, device="meta")
    with pytest.raises(ValueError, match="groups"):
        kt.conv2d(m, torch.empty(6, 4, 3, 3, device="meta"), groups=2)
    with pytest.raises(ValueError, match="empty"):
        kt.conv2d(m, torch.empty(6, 4, 9, 9, device="meta"))
    with pytest.raises(ValueError, match="half of the kernel"):
        kt.avg_pool2d(m, 2, 1, 2)
    with pytest.raises(ValueError, match="dilation"):
        kt.max_pool2d(m, 2, dilation=2)
    assert torch.equal(kt.adaptive_avg_pool2d(x, (3, 3)), F.adaptive_avg_pool2d(x, (3, 3)))
