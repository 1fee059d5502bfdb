"""The operators under CUDA graph capture (``torch.cuda.graph``), on the GPU.

Each family is captured forward only and, where it has autograd, forward and backward (the
gradients of the inputs by ``torch.autograd.grad`` inside the capture, given upstream gradients
``cos(1.7 out)``, which vary with the inputs). The protocol is PyTorch's: warm-up on a side stream
(which also loads each kernel outside the capture), capture into ``torch.cuda.CUDAGraph`` on static
inputs, then for two fresh random inputs: copy them into the static ones, ``replay()``, and run
the same function eagerly on the same inputs. Replay and eager run must agree bit for bit: the
kernels are deterministic (f32 sums in a fixed order, no atomics anywhere: docs/design.md), the
kernel a call runs depends only on shapes, dtypes and the GPU, and a replay runs the recorded
launches on the new values. What would show as a difference or an error: a replay that did not
read the new inputs, a launch argument recorded by host address (the tensor maps of the Hopper
GEMM and attention), a temporary the graph does not own, a synchronisation inside the capture.

Also: the cross-entropy's target check, skipped under capture (an out-of-range target gives a
NaN loss on replay, a ValueError eagerly); ``nn.BatchNorm2d(momentum=None)``, refused under
capture with the capture still usable afterwards.
"""

import pytest

torch = pytest.importorskip("torch")
from torch import Tensor  # noqa: E402

import kernels_torch as kt  # noqa: E402
from kernels_torch import nn as knn  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
MODES = pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])


def randn(*shape, dtype=F32, seed=0, scale=1.0, shift=0.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale + shift).to(dtype)


def randint(high, *shape, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randint(0, high, shape, generator=g, device=DEV)


def bits(t: Tensor) -> Tensor:
    """The tensor's bits (floating point as integers of its width, so NaNs compare too)."""
    t = t.detach().contiguous()
    return t.view(_BITS[t.element_size()]) if t.is_floating_point() else t


def with_backward(f):
    """The step of ``f``: its outputs and, for the inputs that require grad, their gradients
    given upstream gradients ``cos(1.7 out)``."""

    def step(*inputs):
        outs = f(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        leaves = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
        if not leaves:
            return tuple(o.detach() for o in outs)
        ups = [torch.cos(1.7 * o.detach().float()).to(o.dtype) for o in outs]
        return tuple(o.detach() for o in outs) + tuple(torch.autograd.grad(outs, leaves, ups))

    return step


def leaves(ts, diff, backward):
    return [t.detach().clone().requires_grad_(backward and i in diff) for i, t in enumerate(ts)]


def check_replay(make, f, diff=(), backward=False, state=(), seeds=(1, 2)):
    """Captures ``with_backward(f)`` on static copies of ``make(0)`` (gradients of the inputs at
    ``diff`` if ``backward``) and checks its replays on ``make(seed)`` for each seed against the
    eager run, bit for bit. ``state``: tensors ``f`` updates in place (running statistics), set
    back before the eager run and compared after it."""
    step = with_backward(f)
    static = leaves(make(0), diff, backward)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*static)
    for seed in seeds:
        fresh = make(seed)
        with torch.no_grad():
            for s, t in zip(static, fresh):
                s.copy_(t)
        before = [s.clone() for s in state]
        graph.replay()
        replayed = [bits(o).clone() for o in out]
        after = [bits(s).clone() for s in state]
        with torch.no_grad():
            for s, b in zip(state, before):
                s.copy_(b)
        want = step(*leaves(fresh, diff, backward))
        torch.cuda.synchronize()
        assert len(want) == len(out)
        for i, (r, w) in enumerate(zip(replayed, want)):
            assert r.shape == w.shape, f"output {i}: shape {tuple(r.shape)}, eager {tuple(w.shape)}"
            assert torch.equal(r, bits(w)), f"output {i} (seed {seed}): the replay differs from the eager run"
        for i, (a, s) in enumerate(zip(after, state)):
            assert torch.equal(a, bits(s)), f"state {i} (seed {seed}): the replay's update differs from the eager one"
    del graph


# --- activations, gated and fused element-wise ops -------------------------------------------------

ACTS = {
    "gelu": lambda x: kt.gelu(x),
    "gelu_tanh": lambda x: kt.gelu(x, "tanh"),
    "silu": lambda x: kt.silu(x),
    "sigmoid": lambda x: kt.sigmoid(x),  # its backward reads the output
    "elu": lambda x: kt.elu(x, 0.5),
}


@MODES
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(ACTS))
def test_activation(name, dtype, backward):
    check_replay(lambda s: [randn(37, 1000, dtype=dtype, seed=s)], ACTS[name], (0,), backward)


@MODES
def test_swiglu_fused_and_gated(backward):
    check_replay(lambda s: [randn(64, 2 * 520, dtype=BF16, seed=s)], kt.swiglu, (0,), backward)
    check_replay(
        lambda s: [randn(64, 520, dtype=BF16, seed=s), randn(64, 520, dtype=BF16, seed=s + 100)],
        kt.swiglu, (0, 1), backward,
    )  # fmt: skip


@MODES
def test_scale_bias_act(backward):
    def make(s):
        return [randn(96, 300, seed=s), randn(300, seed=s + 100, shift=1.0), randn(300, seed=s + 200)]

    check_replay(make, lambda x, sc, b: kt.scale_bias_act(x, sc, b, "silu"), (0, 1, 2), backward)


# --- softmax and norms ----------------------------------------------------------------------------


@MODES
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax(log, dtype, backward):
    f = kt.log_softmax if log else kt.softmax
    check_replay(lambda s: [randn(64, 1000, dtype=dtype, seed=s, scale=3.0)], lambda x: f(x, -1), (0,), backward)
    # Another dim than the last goes through a copy (PyTorch's, in the graph too).
    check_replay(lambda s: [randn(50, 7, dtype=dtype, seed=s)], lambda x: f(x, 0), (0,), backward)


@MODES
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_layer_norm_and_rms_norm(dtype, backward):
    def make(s):
        return [randn(37, 1000, dtype=dtype, seed=s, scale=2.0), randn(1000, dtype=dtype, seed=s + 100, shift=1.0),
                randn(1000, dtype=dtype, seed=s + 200)]  # fmt: skip

    check_replay(make, lambda x, w, b: kt.layer_norm(x, [1000], w, b, 1e-5), (0, 1, 2), backward)
    check_replay(make, lambda x, w, b: kt.rms_norm(x, [1000], w, 1e-6), (0, 1), backward)


@MODES
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_add_layer_norm_and_add_rms_norm(dtype, backward):
    def make(s):
        return [randn(37, 1000, dtype=dtype, seed=s), randn(37, 1000, dtype=dtype, seed=s + 50),
                randn(1000, dtype=dtype, seed=s + 100, shift=1.0), randn(1000, dtype=dtype, seed=s + 200)]  # fmt: skip

    check_replay(make, lambda x, r, w, b: kt.add_layer_norm(x, r, [1000], w, b, 1e-5), (0, 1, 2, 3), backward)
    check_replay(make, lambda x, r, w, b: kt.add_rms_norm(x, r, [1000], w, 1e-6), (0, 1, 2), backward)


# --- cross-entropy --------------------------------------------------------------------------------


def _ce_inputs(n, c, dtype):
    def make(s):
        t = randint(c, n, seed=s + 100)
        t[::7] = -100  # some ignored rows
        return [randn(n, c, dtype=dtype, seed=s, scale=2.0), t]

    return make


@MODES
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_cross_entropy_two_pass_and_one_pass(dtype, reduction, backward):
    make = _ce_inputs(64, 1000, dtype)
    check_replay(make, lambda x, t: kt.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1), (0,), backward)
    check_replay(make, lambda x, t: kt.cross_entropy_one_pass(x, t, reduction=reduction, z_loss=1e-4), (0,), backward)


@pytest.mark.parametrize("one_pass", [False, True], ids=["two_pass", "one_pass"])
def test_cross_entropy_skips_its_target_check_under_capture(one_pass):
    """Under capture nothing may wait for the stream, so the target check is not made: an
    out-of-range target gives a NaN loss on replay (memory-safe), where the eager call raises."""
    f = kt.cross_entropy_one_pass if one_pass else kt.cross_entropy
    logits, target = randn(16, 10, seed=1), randint(10, 16, seed=2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        f(logits, target)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = f(logits, target)
    graph.replay()
    assert torch.isfinite(loss).item(), "valid targets: a finite loss"
    target[5] = 10  # outside [0, 10), not ignore_index
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(loss).item(), "an out-of-range target under capture: a NaN loss"
    with pytest.raises(ValueError, match="row 5 is outside"):
        f(logits, target)


# --- linear layer ---------------------------------------------------------------------------------

# (rows, in, out): 64 rows take the Hopper GEMM's paired split along K on an H100/H200 (an f32
# workspace and a reduction in the graph), 300 its plain persistent launch; elsewhere mma.sync.
LINEAR = [(64, 256, 384), (300, 512, 384)]


@MODES
@pytest.mark.parametrize("act", ["identity", "gelu"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dims", LINEAR, ids=["64", "300"])
def test_linear(dims, dtype, act, backward):
    m, k, n = dims

    def make(s):
        return [randn(m, k, dtype=dtype, seed=s), randn(n, k, dtype=dtype, seed=s + 100, scale=k**-0.5),
                randn(n, dtype=dtype, seed=s + 200)]  # fmt: skip

    check_replay(make, lambda x, w, b: kt.linear(x, w, b, act), (0, 1, 2), backward)


# --- attention and rotary embedding ---------------------------------------------------------------

# (B, Hq, Hkv, Sq, Sk, D, is_causal): head dims up to 128 (padded to 64 or 128) take the Hopper
# kernels on an H100/H200 (tensor maps, forward and backward), 160 the general ones; grouped-query
# heads; Sq != Sk.
SDPA = [
    (2, 4, 4, 128, 128, 64, True),
    (1, 8, 2, 100, 130, 128, False),
    (2, 2, 2, 70, 70, 96, True),
    (1, 2, 2, 50, 50, 160, True),
]


@MODES
@pytest.mark.parametrize("case", SDPA, ids=["d64_causal", "d128_gqa", "d96_causal", "d160_causal"])
def test_scaled_dot_product_attention(case, backward):
    b, hq, hkv, sq, sk, d, causal = case

    def make(s):
        return [randn(b, hq, sq, d, dtype=BF16, seed=s), randn(b, hkv, sk, d, dtype=BF16, seed=s + 100),
                randn(b, hkv, sk, d, dtype=BF16, seed=s + 200)]  # fmt: skip

    def f(q, k, v):
        return kt.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)

    check_replay(make, f, (0, 1, 2), backward)


@MODES
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_rope(layout, backward):
    cos, sin = kt.rope_tables(80, 48, device=DEV)  # a partial rotary dim: 48 of 64
    shape = (2, 4, 60, 64) if layout == "bhsd" else (2, 60, 4, 64)
    check_replay(
        lambda s: [randn(*shape, dtype=BF16, seed=s)],
        lambda x: kt.rope(x, cos, sin, layout=layout, offset=7), (0,), backward,
    )  # fmt: skip


# --- embedding ------------------------------------------------------------------------------------


@MODES
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_embedding(dtype, backward):
    # 300 indices into 50 rows: repeats, which the backward's sort and sums gather.
    def make(s):
        return [randint(50, 6, 50, seed=s + 100), randn(50, 72, dtype=dtype, seed=s)]

    check_replay(make, lambda i, w: kt.embedding(i, w, padding_idx=3), (1,), backward)


# --- convolution, batch norm, pooling -------------------------------------------------------------


def _layout(t, channels_last):
    return t.to(memory_format=torch.channels_last) if channels_last else t


@MODES
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_conv2d(dtype, channels_last, backward):
    def make(s):
        return [_layout(randn(2, 16, 13, 11, dtype=dtype, seed=s), channels_last),
                _layout(randn(24, 16, 3, 3, dtype=dtype, seed=s + 100, scale=0.2), channels_last),
                randn(24, dtype=dtype, seed=s + 200)]  # fmt: skip

    check_replay(make, lambda x, w, b: kt.conv2d(x, w, b, stride=(2, 1), padding=1), (0, 1, 2), backward)


@MODES
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_batch_norm(dtype, training, backward):
    rm, rv = randn(8, seed=7), randn(8, seed=8).abs() + 0.5

    def make(s):
        return [randn(4, 8, 9, 7, dtype=dtype, seed=s, scale=2.0, shift=0.5), randn(8, seed=s + 100, shift=1.0),
                randn(8, seed=s + 200)]  # fmt: skip

    def f(x, w, b):
        return kt.batch_norm(x, rm, rv, w, b, training=training, momentum=0.1, eps=1e-5)

    # Training updates the running statistics in place, on every replay as on every eager call.
    check_replay(make, f, (0, 1, 2), backward, state=(rm, rv))


@MODES
def test_pooling(backward):
    def make(s):
        return [randn(2, 8, 15, 13, dtype=BF16, seed=s)]

    check_replay(make, lambda x: kt.max_pool2d(x, 3, stride=2, padding=1), (0,), backward)
    check_replay(make, lambda x: kt.avg_pool2d(x, 2, ceil_mode=True), (0,), backward)
    check_replay(make, lambda x: kt.adaptive_avg_pool2d(x, 1), (0,), backward)


# --- a whole training step ------------------------------------------------------------------------


def test_a_small_transformer_block_step():
    """Several ops in one graph, the library's temporaries of one call and another's in one
    capture: norm, projections, attention, SwiGLU, residual adds and the loss, with gradients."""
    b, s, h, d, width, vocab = 2, 64, 4, 32, 128, 96

    def make(seed):
        return [randint(vocab, b, s, seed=seed + 1), randn(vocab, width, dtype=BF16, seed=seed + 2),
                randn(3 * width, width, dtype=BF16, seed=seed + 3, scale=width**-0.5),
                randn(2 * 256, width, dtype=BF16, seed=seed + 4, scale=width**-0.5),
                randn(width, 256, dtype=BF16, seed=seed + 5, scale=256**-0.5)]  # fmt: skip

    def f(tokens, emb, wqkv, w1, w2):
        x = kt.embedding(tokens, emb)
        hn = kt.rms_norm(x, [width], None, 1e-6)
        q, k, v = kt.linear(hn, wqkv).view(b, s, 3, h, d).unbind(2)
        a = kt.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + a.transpose(1, 2).reshape(b, s, width)
        x = x + kt.linear(kt.swiglu(kt.linear(kt.rms_norm(x, [width], None, 1e-6), w1)), w2)
        logits = kt.linear(x.reshape(b * s, width), emb)
        return kt.cross_entropy(logits[:-1], tokens.reshape(-1)[1:])

    check_replay(make, f, (1, 2, 3, 4), True)


# --- refused under capture ------------------------------------------------------------------------


def test_batch_norm_momentum_none_is_refused_under_capture_and_the_capture_survives():
    """``nn.BatchNorm2d(momentum=None)`` reads its batch count back each training step: under
    capture it raises before issuing any work, and the rest of the capture records and replays."""
    bn = knn.BatchNorm2d(8, momentum=None).to(DEV)
    x = randn(2, 8, 5, 5, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        bn(x)
        kt.gelu(x)
    torch.cuda.current_stream().wait_stream(side)
    count = bn.num_batches_tracked.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(RuntimeError, match=r"momentum=None\) cannot be captured"):
            bn(x)
        y = kt.gelu(x)
    x.copy_(randn(2, 8, 5, 5, seed=2))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(y), bits(kt.gelu(x))), "the capture after the refusal replays"
    assert torch.equal(bn.num_batches_tracked, count), "the refused call counted a batch"
    # With a float momentum the module captures.
    bn.momentum = 0.1
    check_replay(lambda s: [randn(2, 8, 5, 5, seed=s)], bn, (0,), True, state=(bn.running_mean, bn.running_var))
