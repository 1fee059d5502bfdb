"""``kernels_torch.scaled_dot_product_attention`` against ``F.scaled_dot_product_attention``.

The reference is PyTorch's SDPA run in float64 on the same (bf16 or f16) inputs, with autograd for
the gradients. Each element is checked against a bound derived for it from the f64 intermediates,
not a fitted tolerance. With ``u`` the unit roundoff of the dtype (2^-8 bf16, 2^-11 f16), ``p`` the
softmax weights, ``o`` the output, ``s`` the scores and ``sc`` the scale:

Forward. The kernel computes scores in f32 on the tensor cores, exponentiates them in f32 (each
weight perturbed by a relative ``e_s``, below), rounds the weights to the dtype before ``P V`` (a
relative ``u`` each) and the output once (``u |o|``). A relative perturbation ``d_j`` of weight
``j`` in numerator and denominator moves ``o`` by ``sum_j p_j d_j (v_j - o)``, so

    |o - o_ref| <= 2 * ((u + e_s) * (sum_j p_j |v_j| + |o|)) + 2^-24

where ``e_s = (D + 8) 2^-23 sc max_j sum_d |q_d k_jd|`` (an f32 dot product of D terms) ``+ 2^-22
(1 + 3 max_j |s_j|)`` (rounding the exponent's argument and ``ex2.approx``), per row. The factor 2
covers the second-order terms and the f32 accumulations (about ``Sk / 16`` additions of ``2^-24``,
below ``2^-16``); ``2^-24`` is the spacing of f16's subnormals. The log-sum-exp: ``2 (e_s + Sk
2^-24) + 2^-22 |lse|`` (the f32 sum of the weights, and its rounding).

Backward (FlashAttention-2's): ``P`` is recomputed from the saved log-sum-exp (relative error ``e_b
= e_s + tol(lse)``), ``dV = P^T dO`` with ``P`` rounded to the dtype, ``dP = dO V^T`` in f32
(``gamma = (D + 8) 2^-23 |dO| |V|^T``), ``Delta = rowsum(dO * o)`` from the kernel's own output
(``dDelta = sum_c |dO_c| tol(o_c)``, one error per row), ``dS = P (dP - Delta)`` rounded to the
dtype, ``dQ = sc dS K``, ``dK = sc dS^T Q``. The systematic errors are bounded in the worst case,
``E = p (gamma + e_b |dP - Delta|)`` per weight and ``dDelta`` per row (which enters ``dQ`` as
``sc dDelta |P K|``); the roundings of ``dS`` and ``P`` are independent zero-mean errors of at
most ``u`` (variance ``u^2 / 3``) in sums of up to ``Sk`` terms, bounded by 6 standard deviations
(``r = 6 u / sqrt(3)``; a worst-case ``u sum |dS K|`` would be ``sqrt(Sk)`` times looser and would
not catch a wrong answer):

    tol(dQ) = 2 sc (E |K| + dDelta |P K| + 2^-16 |dS| |K|) + r sc sqrt(dS^2 K^2) + 2 u |dQ| + 2^-24
    tol(dK) = 2 sc (E^T |Q| + (p dDelta)^T |Q| + 2^-16 |dS|^T |Q|) + r sc sqrt((dS^2)^T Q^2) + 2 u |dK| + 2^-24
    tol(dV) = 2 ((p e_b)^T |dO| + 2^-16 p^T |dO|) + r sqrt((p^2)^T dO^2) + 2 u |dV| + 2^-24

summed over the query heads of a group for dK and dV (grouped-query attention; the variances
summed under the root). An f32 emulation of this path (weights and ``dS`` rounded to the dtype)
stays within 0.4 of each bound on these cases, and ``test_bounds_reject_a_wrong_answer`` checks
that the bounds catch a 5% error of the scale, forward and backward.
"""

import math
import time

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kernels_torch as kt  # noqa: E402
from kernels_torch import _ops  # noqa: E402
from kernels_torch import nn as knn  # noqa: E402

DEV = "cuda"
U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
gpu = pytest.mark.gpu


def rand(shape, dtype, seed, layout="bhsd"):
    """Normal values of ``dtype`` as a ``[B, H, S, D]`` tensor, contiguous (``bhsd``) or the
    ``transpose(1, 2)`` of a contiguous ``[B, S, H, D]`` (``bshd``)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    if layout == "bshd":
        b, h, s, d = shape
        return torch.randn(b, s, h, d, generator=g, device=DEV).to(dtype).transpose(1, 2)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def band(sq, sk, causal, alignment="top_left", window=None):
    """The boolean mask ``[Sq, Sk]`` (True: the query sees the key), as the library documents it;
    None when every key is seen."""
    if not causal and window is None:
        return None
    i = torch.arange(sq, device=DEV)[:, None]
    j = torch.arange(sk, device=DEV)[None, :]
    c = i if (causal and alignment == "top_left") else i + (sk - sq)
    seen = torch.ones(sq, sk, dtype=torch.bool, device=DEV)
    if causal:
        seen &= j <= c
    if window is not None:
        left, right = window
        if left >= 0:
            seen &= j >= c - left
        if right >= 0 and not causal:
            seen &= j <= c + right
    return seen


class Ref:
    """PyTorch's SDPA in float64 on ``q, k, v`` (``[B, H, S, D]``), the f64 intermediates and the
    bounds of the module's doc."""

    def __init__(self, q, k, v, causal=False, scale=None, alignment="top_left", window=None, dout=None):
        self.dtype = q.dtype
        u = U[q.dtype]
        hq, hkv = q.shape[1], k.shape[1]
        self.group = hq // hkv
        d, sq, sk = q.shape[-1], q.shape[2], k.shape[2]
        self.sc = sc = 1.0 / math.sqrt(d) if scale is None else scale
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        K, V = k64.repeat_interleave(self.group, 1), v64.repeat_interleave(self.group, 1)
        mask = band(sq, sk, causal, alignment, window)
        if mask is None:
            o = F.scaled_dot_product_attention(q64, K, V, is_causal=causal and alignment == "top_left", scale=sc)
        else:
            o = F.scaled_dot_product_attention(q64, K, V, attn_mask=mask, scale=sc)
        self.o = o.detach()
        with torch.no_grad():
            Qd, Kd, Vd = q64.detach(), K.detach(), V.detach()
            s = sc * (Qd @ Kd.transpose(-1, -2))
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            self.lse = torch.logsumexp(s, -1)
            p = torch.exp(s - self.lse[..., None])
            self.p = p
            fin = s.masked_fill(torch.isinf(s), 0.0)
            qk = abs(sc) * (Qd.abs() @ Kd.abs().transpose(-1, -2))
            self.e_s = (d + 8) * 2.0**-23 * qk.amax(-1) + 2.0**-22 * (1 + 3 * fin.abs().amax(-1))
            S = p @ Vd.abs()
            self.tol_o = 2 * (u + self.e_s[..., None]) * (S + self.o.abs()) + 2.0**-24
            self.tol_lse = 2 * (self.e_s + sk * 2.0**-24) + 2.0**-22 * self.lse.abs()
        if dout is None:
            return
        dO = dout.double()
        self.dq, self.dk, self.dv = (g.detach() for g in torch.autograd.grad(o, (q64, k64, v64), dO))
        with torch.no_grad():
            o_ = self.o
            dP = dO @ Vd.transpose(-1, -2)
            delta = (dO * o_).sum(-1, keepdim=True)
            dS = p * (dP - delta)
            e_b = (self.e_s + self.tol_lse)[..., None]
            d_delta = (dO.abs() * self.tol_o).sum(-1, keepdim=True) + (d + 8) * 2.0**-23 * (dO * o_).abs().sum(
                -1, keepdim=True
            )
            gamma = (d + 8) * 2.0**-23 * (dO.abs() @ Vd.abs().transpose(-1, -2))
            a = abs(sc)
            # Systematic errors of dS (the same sign along a row for Delta's): worst case.
            sys_ds = p * (gamma + e_b * (dP - delta).abs())
            # Rounding dS and P to the dtype: independent, zero-mean errors of at most u each
            # (variance u^2/3) in sums of up to Sk terms: 6 standard deviations.
            sd = 6 * u / math.sqrt(3)
            self.tol_dq = (
                2 * (a * sys_ds @ Kd.abs() + a * d_delta * (p @ Kd).abs() + 2.0**-16 * a * dS.abs() @ Kd.abs())
                + a * sd * ((dS * dS) @ (Kd * Kd)).sqrt()
                + 2 * u * self.dq.abs()
                + 2.0**-24
            )
            dst = dS.transpose(-1, -2)
            tk = 2 * (a * sys_ds.transpose(-1, -2) @ Qd.abs() + a * (p * d_delta).transpose(-1, -2).abs() @ Qd.abs())
            tk = tk + 2 * 2.0**-16 * a * dst.abs() @ Qd.abs()
            vk = (a * sd) ** 2 * ((dst * dst) @ (Qd * Qd))
            pt = p.transpose(-1, -2)
            tv = 2 * ((pt * e_b.transpose(-1, -2)) @ dO.abs() + 2.0**-16 * pt @ dO.abs())
            vv = sd**2 * ((pt * pt) @ (dO * dO))
            self.tol_dk = self.fold(tk) + self.fold(vk).sqrt() + 2 * u * self.dk.abs() + 2.0**-24
            self.tol_dv = self.fold(tv) + self.fold(vv).sqrt() + 2 * u * self.dv.abs() + 2.0**-24

    def fold(self, t):
        """Sums a per-query-head ``[B, Hq, Sk, D]`` over each key/value head's group."""
        b, h, s, d = t.shape
        return t.view(b, h // self.group, self.group, s, d).sum(2)


def within(got, ref, tol, what):
    """Whether every element is within its bound; the message names the worst one."""
    got = got.double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    err = (got - ref).abs()
    bad = ~(err <= tol)  # NaN fails
    if bad.any():
        ratio = torch.where(bad, err / tol, torch.zeros_like(err)).nan_to_num(float("inf"))
        i = ratio.argmax()
        idx = tuple(int(x) for x in torch.unravel_index(i, ratio.shape))
        return False, (
            f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond their bound; worst at {idx}: got "
            f"{got[idx].item():.6g}, expected {ref[idx].item():.6g}, bound {tol[idx].item():.3g}"
        )
    return True, ""


def check(got, ref, tol, what):
    ok, msg = within(got, ref, tol, what)
    assert ok, msg


# (B, Hq, Hkv, Sq, Sk, D, is_causal, layout): odd lengths, Sq != Sk both ways, every head dim
# class, grouped- and multi-query attention, both memory layouts.
CASES = [
    (2, 4, 4, 1, 1, 64, False, "bhsd"),
    (1, 2, 2, 17, 17, 96, True, "bhsd"),
    (1, 2, 2, 1000, 1000, 128, True, "bshd"),
    (2, 2, 2, 17, 1000, 64, False, "bhsd"),
    (1, 2, 2, 1000, 17, 128, True, "bshd"),
    (1, 2, 2, 300, 300, 256, False, "bhsd"),
    (1, 2, 2, 257, 129, 256, True, "bshd"),
    (2, 3, 3, 33, 65, 8, True, "bshd"),
    (2, 8, 2, 100, 130, 64, True, "bhsd"),
    (1, 4, 1, 17, 17, 128, False, "bshd"),
]
IDS = [f"B{c[0]}H{c[1]}/{c[2]}S{c[3]}x{c[4]}D{c[5]}{'causal' if c[6] else ''}-{c[7]}" for c in CASES]


def inputs(case, dtype, seed=0):
    b, hq, hkv, sq, sk, d, causal, layout = case
    q = rand((b, hq, sq, d), dtype, seed, layout)
    k = rand((b, hkv, sk, d), dtype, seed + 1, layout)
    v = rand((b, hkv, sk, d), dtype, seed + 2, layout)
    return q, k, v, causal, hq != hkv


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward(case, dtype):
    q, k, v, causal, gqa = inputs(case, dtype)
    out = kt.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    assert out.dtype == dtype and out.shape == q.shape
    if case[-1] == "bshd":  # the output is a view of the Bshd result, as the inputs were
        assert out.transpose(1, 2).is_contiguous()
    else:
        assert out.is_contiguous()
    r = Ref(q, k, v, causal)
    check(out, r.o, r.tol_o, "out")
    layout = 1 if case[-1] == "bshd" else 0
    qq, kk, vv = (t.transpose(1, 2) for t in (q, k, v)) if layout else (q, k, v)
    _, lse = torch.ops.rustkernels.attention(qq, kk, vv, layout, int(causal), None, -1, -1)
    check(lse, r.lse, r.tol_lse, "lse")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward(case, dtype):
    q, k, v, causal, gqa = inputs(case, dtype, seed=10)
    dout = rand(q.shape, dtype, 13)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = kt.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    r = Ref(q, k, v, causal, dout=dout)
    checks = ((dq, r.dq, r.tol_dq, "dq", q), (dk, r.dk, r.tol_dk, "dk", k), (dv, r.dv, r.tol_dv, "dv", v))
    for got, ref, tol, name, like in checks:
        assert got.dtype == dtype and got.shape == like.shape, name
        check(got, ref, tol, name)


@gpu
def test_rank_3_scale_and_f16():
    """``[H, S, D]`` inputs, an explicit scale (negative too), both dtypes."""
    for dtype in (torch.bfloat16, torch.float16):
        q = rand((1, 4, 70, 64), dtype, 20)[0]
        k, v = rand((1, 4, 90, 64), dtype, 21)[0], rand((1, 4, 90, 64), dtype, 22)[0]
        for scale in (0.3, -0.05):
            out = kt.scaled_dot_product_attention(q, k, v, scale=scale)
            assert out.shape == (4, 70, 64)
            r = Ref(q[None], k[None], v[None], scale=scale)
            check(out[None], r.o, r.tol_o, f"rank 3, scale {scale}")


@gpu
def test_bottom_right_and_window():
    """The keyword-only extras against PyTorch's SDPA with the equivalent boolean mask (shapes
    where every query sees a key: PyTorch's gives NaN for one that sees none)."""
    dtype = torch.bfloat16
    q = rand((1, 2, 40, 64), dtype, 30)
    k, v = rand((1, 2, 100, 64), dtype, 31), rand((1, 2, 100, 64), dtype, 32)
    g = rand(q.shape, dtype, 33)
    for causal, alignment, window in [
        (True, "bottom_right", None),
        (True, "top_left", (8, 0)),
        (True, "bottom_right", (16, 5)),
        (False, "top_left", (10, 3)),
        (False, "top_left", (-1, 4)),
    ]:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = kt.scaled_dot_product_attention(*leaves, is_causal=causal, causal_alignment=alignment, window=window)
        what = f"causal={causal} {alignment} window={window}"
        r = Ref(q, k, v, causal, alignment=alignment, window=window, dout=g)
        check(out, r.o, r.tol_o, what)
        grads = torch.autograd.grad(out, leaves, g)
        for got, ref, tol, name in zip(grads, (r.dq, r.dk, r.dv), (r.tol_dq, r.tol_dk, r.tol_dv), ("dq", "dk", "dv")):
            check(got, ref, tol, f"{what}: {name}")


@gpu
def test_bounds_reject_a_wrong_answer():
    """The bounds are not vacuous: PyTorch's result for a scale 5% off fails them, forward and
    backward, while the reference itself passes."""
    dtype = torch.bfloat16
    q, k, v, causal, _ = inputs(CASES[2], dtype, seed=40)
    dout = rand(q.shape, dtype, 43)
    r = Ref(q, k, v, causal, dout=dout)
    wrong = Ref(q, k, v, causal, scale=r.sc * 1.05, dout=dout)
    assert within(r.o, r.o, r.tol_o, "")[0]
    assert not within(wrong.o, r.o, r.tol_o, "")[0]
    assert not within(wrong.dq, r.dq, r.tol_dq, "")[0]
    assert not within(wrong.dk, r.dk, r.tol_dk, "")[0]
    assert not within(wrong.dv, r.dv, r.tol_dv, "")[0]


# --- layouts, paths, opcheck, torch.compile ----------------------------------------------------


@gpu
def test_layouts_are_read_in_place():
    """Contiguous ``[B, H, S, D]`` runs Bhsd and the transposed view of a contiguous ``[B, S, H,
    D]`` runs Bshd, both on the caller's memory (no copy); anything else is copied into the
    layout most inputs have."""
    seen = []
    orig = _ops._native.attention_fwd

    def spy(*a):
        seen.append((a[3], a[7], a[8], a[9]))  # layout, q, k, v addresses
        return orig(*a)

    _ops._native.attention_fwd = spy
    try:
        for layout in ("bhsd", "bshd"):
            q, k, v = (rand((2, 4, 33, 64), torch.bfloat16, s, layout) for s in (50, 51, 52))
            seen.clear()
            kt.scaled_dot_product_attention(q, k, v)
            assert seen == [(int(layout == "bshd"), q.data_ptr(), k.data_ptr(), v.data_ptr())], layout
        # A slice of a fused projection [B, S, 3, H, D] is neither: copied, the others read in place.
        qkv = rand((2, 33, 3, 4 * 64), torch.bfloat16, 53).view(2, 33, 3, 4, 64)
        q = qkv[:, :, 0].transpose(1, 2)
        k, v = (rand((2, 4, 33, 64), torch.bfloat16, s, "bshd") for s in (54, 55))
        seen.clear()
        out = kt.scaled_dot_product_attention(q, k, v)
        assert seen[0][0] == 1 and seen[0][1] != q.data_ptr() and seen[0][2:] == (k.data_ptr(), v.data_ptr())
        r = Ref(q, k, v)
        check(out, r.o, r.tol_o, "sliced q")
    finally:
        _ops._native.attention_fwd = orig


@gpu
def test_eager_path_and_custom_op_path_agree():
    """The function's eager path and the custom op run the same kernels: the same bits."""
    q, k, v = (rand((2, 4, 65, 64), torch.bfloat16, s).requires_grad_() for s in (60, 61, 62))
    g = rand(q.shape, torch.bfloat16, 63)
    ye = kt.scaled_dot_product_attention(q, k, v, is_causal=True)
    ge = torch.autograd.grad(ye, (q, k, v), g)
    yo = torch.ops.rustkernels.attention(q, k, v, 0, 1, None, -1, -1)[0]
    go = torch.autograd.grad(yo, (q, k, v), g)
    assert torch.equal(ye, yo)
    for a, b in zip(ge, go):
        assert torch.equal(a, b)


@gpu
def test_opcheck():
    """torch.library.opcheck: schema, fake implementations (shapes, dtypes, strides), autograd
    registration and AOT dispatch, both layouts, with grouped-query attention."""
    ops = torch.ops.rustkernels
    for layout in (0, 1):
        shape_q, shape_kv = ((2, 4, 33, 64), (2, 2, 40, 64)) if layout == 0 else ((2, 33, 4, 64), (2, 40, 2, 64))
        q = rand(shape_q, torch.bfloat16, 70).requires_grad_()
        k = rand(shape_kv, torch.bfloat16, 71).requires_grad_()
        v = rand(shape_kv, torch.bfloat16, 72).requires_grad_()
        torch.library.opcheck(ops.attention, (q, k, v, layout, 1, None, -1, -1))
        torch.library.opcheck(ops.attention, (q, k, v, layout, 0, 0.2, 8, 8))
        out, lse = ops.attention(q, k, v, layout, 1, None, -1, -1)
        g = rand(shape_q, torch.bfloat16, 73)
        args = (q.detach(), k.detach(), v.detach(), out.detach(), lse, g, layout, 1, None, -1, -1)
        torch.library.opcheck(ops.attention_backward, args)


@gpu
def test_torch_compile_fullgraph():
    """A projection, our SDPA on the Bshd views it gives, and the output projection, compiled with
    fullgraph=True: the same bits as eager, forward and backward."""
    b, s, h, d = 2, 100, 4, 64
    x = rand((1, b, s, h * d), torch.bfloat16, 80)[0].requires_grad_()
    w = (rand((1, 1, 3 * h * d, h * d), torch.bfloat16, 81)[0, 0] / 16).requires_grad_()

    def f(x, w):
        q, k, v = (x @ w.t()).view(b, s, 3, h, d).unbind(2)
        o = kt.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2).reshape(b, s, h * d)

    g = rand((1, b, s, h * d), torch.bfloat16, 82)[0]
    cf = torch.compile(f, fullgraph=True)
    ye = f(x, w)
    ge = torch.autograd.grad(ye, (x, w), g)
    yc = cf(x, w)
    gc = torch.autograd.grad(yc, (x, w), g)
    torch.testing.assert_close(yc, ye, rtol=0, atol=0)
    for a, c in zip(ge, gc):
        torch.testing.assert_close(c, a, rtol=0, atol=0)


# --- refusals ---------------------------------------------------------------------------------


def test_refusals_without_a_gpu():
    """What the function refuses before it looks for a GPU (CPU tensors here)."""
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    sdpa = kt.scaled_dot_product_attention
    with pytest.raises(ValueError, match="attn_mask is not supported"):
        sdpa(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p=0.1 is not supported"):
        sdpa(q, q, q, dropout_p=0.1)
    for dt in (torch.float32, torch.float64):
        with pytest.raises(TypeError, match=f"dtype {dt}; the kernels take bfloat16 or float16"):
            sdpa(q.to(dt), q.to(dt), q.to(dt))
    with pytest.raises(ValueError, match="query is on cpu; the kernels run on CUDA tensors only"):
        sdpa(q, q, q)
    with pytest.raises(ValueError, match="causal_alignment"):
        sdpa(q, q, q, is_causal=True, causal_alignment="diagonal")


@gpu
def test_refusals():
    sdpa = kt.scaled_dot_product_attention
    q = rand((1, 4, 8, 64), torch.bfloat16, 90)
    kv = rand((1, 2, 8, 64), torch.bfloat16, 91)
    with pytest.raises(ValueError, match="needs enable_gqa=True"):
        sdpa(q, kv, kv)
    k3 = rand((1, 3, 8, 64), torch.bfloat16, 92)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of the key/value heads \(3\)"):
        sdpa(q, k3, k3, enable_gqa=True)
    for d in (12, 264):
        t = rand((1, 2, 8, d), torch.bfloat16, 93)
        with pytest.raises(ValueError, match=f"multiple of 8 from 8 to 256, got {d}"):
            sdpa(t, t, t)
    with pytest.raises(ValueError, match="one head dim"):
        sdpa(q, q, rand((1, 4, 8, 32), torch.bfloat16, 94))
    with pytest.raises(TypeError, match="one dtype"):
        sdpa(q, q, q.half())
    with pytest.raises(TypeError, match="dtype torch.float32"):
        sdpa(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="on cpu"):
        sdpa(q, q.cpu(), q)
    with pytest.raises(ValueError, match="rank 3 or more"):
        sdpa(q[0, 0], q[0, 0], q[0, 0])
    with pytest.raises(ValueError, match="leading dimensions"):
        sdpa(q, rand((1, 4, 9, 64), torch.bfloat16, 95), q)


# --- training ---------------------------------------------------------------------------------

VOCAB, SEQ, DIM, HEADS, NSEQ, STEPS = 128, 128, 128, 4, 64, 200


class Block(torch.nn.Module):
    """Embeddings, one pre-norm transformer block (RMSNorm, causal multi-head attention, SwiGLU
    MLP) and a head; ``kit`` picks the modules and the SDPA (ours or PyTorch's)."""

    def __init__(self, kit):
        super().__init__()
        norm, linear, self.sdpa, self.silu = kit
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.n1, self.n2, self.n3 = norm(DIM), norm(DIM), norm(DIM)
        self.qkv = linear(DIM, 3 * DIM, bias=False)
        self.proj = linear(DIM, DIM, bias=False)
        self.up = linear(DIM, 8 * DIM, bias=False)
        self.down = linear(4 * DIM, DIM, bias=False)
        self.head = linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        b, s = tokens.shape
        x = self.emb(tokens) + self.pos[:s]
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)
        a = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, DIM))
        gate, up = self.up(self.n2(x)).chunk(2, -1)
        x = x + self.down(self.silu(gate) * up)
        return self.head(self.n3(x))


OURS = (knn.RMSNorm, knn.Linear, kt.scaled_dot_product_attention, kt.silu)
PYTORCH = (torch.nn.RMSNorm, torch.nn.Linear, F.scaled_dot_product_attention, F.silu)


def train(kit, data, state=None):
    """Adam, ``STEPS`` steps on the whole fixed set (next-token prediction), bf16 parameters;
    returns the losses, tokens/s (after 10 warm-up steps) and the initial state."""
    torch.manual_seed(0)
    model = Block(kit).to(DEV, torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    state = {k: t.clone() for k, t in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    x, y = data[:, :-1], data[:, 1:]
    for step in range(STEPS):
        if step == 10:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    tps = (STEPS - 10) * x.numel() / (time.perf_counter() - t0)
    return [float(v) for v in torch.stack(losses).tolist()], tps, state


@gpu
def test_transformer_block_trains_like_pytorch():
    """A one-block transformer (RMSNorm, attention, SwiGLU) built with the package's modules and
    SDPA, trained 200 Adam steps in bf16 to memorise 64 fixed random sequences of 128 tokens,
    against the same block built with PyTorch's (same initial weights, same data).

    The two differ only by rounding (bf16 kernels on both sides: the softmax weights and each
    product's output rounded to 2^-8), so the first loss must agree to 1%, and the loss curves,
    averaged over windows of 20 steps, must agree within 5% of the initial loss (a shift of
    about 4 steps where the loss falls fastest): rounding changes the trajectory, not the rate of
    learning. Both must have learned (the last window below a quarter of the initial loss)."""
    g = torch.Generator(device=DEV).manual_seed(1)
    data = torch.randint(0, VOCAB, (NSEQ, SEQ + 1), generator=g, device=DEV)
    ref, ref_tps, state = train(PYTORCH, data)
    ours, our_tps, _ = train(OURS, data, state)
    win = [(sum(ref[i : i + 20]) / 20, sum(ours[i : i + 20]) / 20) for i in range(0, STEPS, 20)]
    print(
        f"transformer block B{NSEQ} S{SEQ} D{DIM} H{HEADS}, bf16, {STEPS} steps: tokens/s ours {our_tps:,.0f}, "
        f"PyTorch {ref_tps:,.0f} ({our_tps / ref_tps:.2f}x)"
    )
    print("loss by 20 steps (PyTorch / ours): " + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in win))
    assert ours[0] == pytest.approx(ref[0], rel=1e-2)
    for a, b in win:
        assert abs(a - b) <= 0.05 * ref[0], win
    assert win[-1][0] < ref[0] / 4 and win[-1][1] < ours[0] / 4, win
