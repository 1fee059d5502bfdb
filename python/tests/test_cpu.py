"""What works without a GPU: the modules' fallback to PyTorch on CPU tensors, the operators'
refusals, their schemas and their fake (meta) implementations through autograd."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kernels_torch as kt  # noqa: E402
from kernels_torch import nn as knn  # noqa: E402


def test_modules_fall_back_to_pytorch_on_cpu():
    torch.manual_seed(0)
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    pairs = [
        (knn.GELU(), torch.nn.GELU()),
        (knn.GELU("tanh"), torch.nn.GELU("tanh")),
        (knn.Swish(), torch.nn.SiLU()),
        (knn.Mish(), torch.nn.Mish()),
        (knn.ReLU(), torch.nn.ReLU()),
        (knn.LeakyReLU(0.2), torch.nn.LeakyReLU(0.2)),
        (knn.Sigmoid(), torch.nn.Sigmoid()),
        (knn.Tanh(), torch.nn.Tanh()),
        (knn.Softplus(2.0, 5.0), torch.nn.Softplus(2.0, 5.0)),
        (knn.ELU(0.5), torch.nn.ELU(0.5)),
        (knn.CELU(2.5), torch.nn.CELU(2.5)),
        (knn.Softmax(-1), torch.nn.Softmax(-1)),
        (knn.LogSoftmax(0), torch.nn.LogSoftmax(0)),
        (knn.LayerNorm(16, dtype=torch.float64), torch.nn.LayerNorm(16, dtype=torch.float64)),
        (knn.RMSNorm(16, dtype=torch.float64), torch.nn.RMSNorm(16, dtype=torch.float64)),
    ]
    # Every module of the op table, with PyTorch's defaults.
    pairs += [(cls(), getattr(torch.nn, name)()) for name, cls in knn._MODULES.items()]
    for ours, ref in pairs:
        assert isinstance(ours, type(ref)), type(ours).__name__
        assert torch.equal(ours(x), ref(x)), type(ours).__name__
    t = torch.tensor([1, 0, 3, 15, 2, 2, 9, 0])
    assert torch.equal(knn.CrossEntropyLoss(label_smoothing=0.1)(x, t), F.cross_entropy(x, t, label_smoothing=0.1))
    m = knn.FusedBiasAct(16, "softplus", 2.0, scale=True, dtype=torch.float64)
    with torch.no_grad():
        m.bias.normal_()
        m.scale.normal_()
    assert torch.equal(m(x), F.softplus(x * m.scale + m.bias, 2.0, 20.0))
    assert m.params == (2.0, 20.0)
    m(x).sum().backward()
    assert m.bias.grad is not None and m.scale.grad is not None and x.grad is not None


def test_gated_modules_fall_back_to_pytorch_on_cpu():
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    a, b = x.chunk(2, dim=-1)
    for m, ref in [
        (knn.SwiGLU(), F.silu(a) * b),
        (knn.GeGLU(), F.gelu(a) * b),
        (knn.GeGLU("tanh"), F.gelu(a, approximate="tanh") * b),
        (knn.ReGLU(), F.relu(a) * b),
    ]:
        assert torch.equal(m(x), ref), type(m).__name__
        # The same views as the module's (PyTorch's CPU kernels may round a strided view and a
        # contiguous copy differently).
        af, bf = x.float().chunk(2, dim=-1)
        assert torch.equal(m(x.float()), m._torch(af) * bf), type(m).__name__
    with pytest.raises(ValueError, match="approximate"):
        knn.GeGLU("fast")


def test_linear_module_falls_back_to_pytorch_on_cpu():
    """CPU tensors (float32 and float64): PyTorch's F.linear and activation, bit for bit, with
    gradients; the same parameters and state_dict keys as torch.nn.Linear."""
    torch.manual_seed(1)
    acts = {None: lambda z: z, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
            "silu": F.silu}  # fmt: skip
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(2, 5, 16, dtype=dtype, requires_grad=True)
        for act, f in acts.items():
            for bias in (True, False):
                m = knn.Linear(16, 8, bias, dtype=dtype, activation=act)
                ref = torch.nn.Linear(16, 8, bias, dtype=dtype)
                ref.load_state_dict(m.state_dict())
                assert set(m.state_dict()) == set(ref.state_dict())
                assert isinstance(m, torch.nn.Linear) and m.activation == (act or "identity")
                assert torch.equal(m(x), f(ref(x))), (act, bias, dtype)
                gs = torch.autograd.grad(m(x).sum(), [x] + list(m.parameters()))
                rgs = torch.autograd.grad(f(ref(x)).sum(), [x] + list(ref.parameters()))
                for a, b in zip(gs, rgs):
                    assert torch.equal(a, b), (act, bias, dtype)
    assert "activation='silu'" in repr(knn.Linear(4, 2, activation="silu"))


def test_linear_refuses_cpu_and_other_dtypes_and_activations():
    x, w, b = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3)
    for f in (kt.linear, torch.ops.rustkernels.linear):
        with pytest.raises(ValueError, match="x is on cpu; the kernels run on CUDA tensors only"):
            f(x, w, b, "relu")
    for dt in (torch.float16, torch.bfloat16):  # taken (on CUDA), so the device is what is refused
        with pytest.raises(ValueError, match="x is on cpu; the kernels run on CUDA tensors only"):
            torch.ops.rustkernels.linear(x.to(dt), w.to(dt), b.to(dt), "relu")
    with pytest.raises(ValueError, match="activation 'mish' is not fused"):
        knn.Linear(8, 3, activation="mish")
    with pytest.raises(ValueError, match="activation 'tanh' is not fused"):
        kt.linear(x, w, b, "tanh")


def test_linear_fake_implementations_and_autograd_wiring_on_meta_tensors():
    x = torch.empty(3, 5, 8, device="meta", requires_grad=True)
    w = torch.empty(4, 8, device="meta", requires_grad=True)
    b = torch.empty(4, device="meta", requires_grad=True)
    ops = torch.ops.rustkernels
    for act in kt.LINEAR_ACTIVATIONS:
        for f, bias in [(kt.linear, b), (kt.linear, None), (ops.linear, b), (lambda *a: ops.linear_train(*a)[0], b)]:
            y = f(x, w, bias, act)
            assert y.shape == (3, 5, 4) and y.device.type == "meta", act
            gs = torch.autograd.grad(y.sum(), [x, w, b], allow_unused=True)
            assert [None if g is None else tuple(g.shape) for g in gs] == [
                (3, 5, 8), (4, 8), (4,) if bias is not None else None
            ], act  # fmt: skip
        y, pre = ops.linear_train(x.detach(), w.detach(), None, act)
        assert pre.shape == ((3, 5, 4) if act in ("gelu", "gelu_tanh", "silu") else (0,)), act
    gx, gw, gb = ops.linear_backward(x.detach(), w.detach(), torch.empty(3, 5, 4, device="meta"),
                                     torch.empty(3, 5, 4, device="meta"), "gelu", False, True, True)  # fmt: skip
    assert gx.shape == (0,) and gw.shape == (4, 8) and gb.shape == (4,)
    # bf16 and f16: the fake implementations keep the dtype, forward and backward.
    for dt in (torch.bfloat16, torch.float16):
        xd, wd, bd = (t.detach().to(dt).requires_grad_() for t in (x, w, b))
        for f in (kt.linear, ops.linear, lambda *a: ops.linear_train(*a)[0]):
            y = f(xd, wd, bd, "gelu")
            assert y.dtype == dt and y.shape == (3, 5, 4), dt
            gs = torch.autograd.grad(y.sum(), [xd, wd, bd])
            assert [g.dtype for g in gs] == [dt] * 3, dt
        y, pre = ops.linear_train(xd.detach(), wd.detach(), bd.detach(), "silu")
        assert y.dtype == pre.dtype == dt and pre.shape == (3, 5, 4)


def test_embedding_module_falls_back_to_pytorch_on_cpu():
    ref = torch.nn.Embedding(12, 5, padding_idx=2, dtype=torch.float64)
    ours = knn.Embedding(12, 5, padding_idx=2, dtype=torch.float64)
    assert isinstance(ours, torch.nn.Embedding)
    ours.load_state_dict(ref.state_dict())
    assert set(ours.state_dict()) == {"weight"}
    idx = torch.tensor([[0, 2, 11], [2, 2, 7]])
    assert torch.equal(ours(idx), ref(idx))
    ours(idx).sum().backward()
    ref(idx).sum().backward()
    assert torch.equal(ours.weight.grad, ref.weight.grad)
    assert torch.equal(ours.weight.grad[2], torch.zeros(5, dtype=torch.float64))


def test_modules_keep_pytorch_state_dicts():
    ref = torch.nn.LayerNorm(16)
    ours = knn.LayerNorm(16)
    ours.load_state_dict(ref.state_dict())
    assert set(ours.state_dict()) == {"weight", "bias"}
    assert set(knn.FusedBiasAct(4).state_dict()) == {"bias"}  # the constant scale is not saved
    assert set(knn.FusedBiasAct(4, scale=True).state_dict()) == {"bias", "scale"}


def test_ops_refuse_cpu_tensors_and_say_cuda_is_unavailable():
    x = torch.randn(4, 8)
    for f in (kt.gelu, kt.silu, kt.softmax, lambda x: kt.layer_norm(x, [8]), lambda x: kt.rms_norm(x, [8])):
        with pytest.raises(ValueError, match=r"x is on cpu; the kernels run on CUDA tensors only") as e:
            f(x)
        ok, why = kt.cuda_status()
        if not ok:
            assert "CUDA is unavailable here" in str(e.value) and why in str(e.value)
    with pytest.raises(ValueError, match="logits is on cpu"):
        kt.cross_entropy(x, torch.zeros(4, dtype=torch.long))


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown activation 'swoosh'"):
        knn.FusedBiasAct(4, "swoosh")
    with pytest.raises(ValueError, match="takes 0 parameters"):
        knn.FusedBiasAct(4, "gelu", 1.0)
    with pytest.raises(ValueError, match="approximate"):
        kt.gelu(torch.randn(2), approximate="fast")


def test_schemas():
    ops = torch.ops.rustkernels
    assert str(ops.softplus.default._schema) == "rustkernels::softplus(Tensor x, float beta=1., float threshold=20.) -> Tensor"
    assert str(ops.gelu_backward.default._schema) == "rustkernels::gelu_backward(Tensor x, Tensor grad) -> Tensor"
    assert str(ops.tanh_backward.default._schema) == "rustkernels::tanh_backward(Tensor y, Tensor grad) -> Tensor"
    activations = [n for n in kt.ACTIVATIONS if n != "identity"]
    assert {"relu", "gelu", "elu", "selu", "celu", "hardswish", "hardsigmoid", "softsign"} <= set(activations)
    for name in activations + ["scale_bias_act", "softmax", "log_softmax", "layer_norm", "rms_norm", "cross_entropy",
                               "linear", "embedding"]:  # fmt: skip
        assert hasattr(ops, name) and hasattr(ops, name + "_backward"), name
    assert str(ops.linear.default._schema) == (
        'rustkernels::linear(Tensor x, Tensor weight, Tensor? bias=None, str activation="identity") -> Tensor'
    )
    assert hasattr(ops, "linear_train")
    assert str(ops.embedding.default._schema) == (
        "rustkernels::embedding(Tensor indices, Tensor weight, int padding_idx=-1) -> Tensor"
    )


def test_fake_implementations_and_autograd_wiring_on_meta_tensors():
    """The fake (meta) implementations give the real ones' shapes and dtypes, and autograd reaches
    each backward op with the right gradients present (no data: meta tensors)."""
    x = torch.empty(4, 8, device="meta", requires_grad=True)
    w = torch.empty(8, device="meta", requires_grad=True)
    b = torch.empty(8, device="meta", requires_grad=True)
    t = torch.zeros(4, dtype=torch.long, device="meta")
    cases = {
        "gelu": (lambda: kt.gelu(x), (True, False, False)),
        "softplus": (lambda: kt.softplus(x, 2.0, 3.0), (True, False, False)),
        "layer_norm": (lambda: kt.layer_norm(x, [8], w, b), (True, True, True)),
        "layer_norm no bias": (lambda: kt.layer_norm(x, [8], w, None), (True, True, False)),
        "rms_norm": (lambda: kt.rms_norm(x, [8], w), (True, True, False)),
        "softmax dim 0": (lambda: kt.softmax(x, 0), (True, False, False)),
        "log_softmax": (lambda: kt.log_softmax(x), (True, False, False)),
        "scale_bias_act": (lambda: kt.scale_bias_act(x, w, b, "leaky_relu"), (True, True, True)),
        "cross_entropy": (lambda: kt.cross_entropy(x, t, reduction="none"), (True, False, False)),
    }
    for name, (f, want) in cases.items():
        y = f()
        assert y.device.type == "meta", name
        gs = torch.autograd.grad(y.sum(), [x, w, b], allow_unused=True)
        assert tuple(g is not None for g in gs) == want, name
        for g, p in zip(gs, (x, w, b)):
            assert g is None or g.shape == p.shape, name
    y, mean, rstd = torch.ops.rustkernels.layer_norm(torch.empty(2, 3, 4, 5, device="meta"), [4, 5], None, None, 1e-5)
    assert y.shape == (2, 3, 4, 5) and mean.shape == (2, 3) and rstd.dtype == torch.float32
    loss, lse, count = torch.ops.rustkernels.cross_entropy(x.detach(), t, "mean", -100, 0.0)
    assert loss.shape == () and lse.shape == (4,) and count.shape == (1,)


def test_embedding_fake_implementation_and_autograd_wiring_on_meta_tensors():
    w = torch.empty(10, 6, device="meta", requires_grad=True)
    idx = torch.zeros(3, 4, dtype=torch.long, device="meta")
    y = kt.embedding(idx, w, padding_idx=-1)
    assert y.device.type == "meta" and y.shape == (3, 4, 6)
    (gw,) = torch.autograd.grad(y.sum(), w)
    assert gw.shape == (10, 6)
    with pytest.raises(ValueError, match="padding_idx"):
        kt.embedding(idx, w, padding_idx=10)
    with pytest.raises(ValueError, match="weight is on cpu; the kernels run on CUDA tensors only"):
        kt.embedding(torch.zeros(2, dtype=torch.long), torch.randn(4, 2))
