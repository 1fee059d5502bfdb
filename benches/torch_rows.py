"""PyTorch baselines for benches/rows.rs: the same row operations, shapes, dtypes and directions,
timed with triton.testing.do_bench (warmup=25, rep=200, median), written as the same JSON records
as the Rust bench, so that scripts/compare.py joins the two on (op, dtype, n, direction).

    python3 benches/torch_rows.py torch_rows.json [REGEX]

Backward baselines are PyTorch's own backward kernels as autograd calls them:
aten._softmax_backward_data / _log_softmax_backward_data from the forward's output,
aten.native_layer_norm_backward from the saved mean and rstd (with weight and bias gradients),
and, for RMS norm (a composite op in eager PyTorch), torch.autograd.grad over a retained graph.
The fused residual add and norm (add_layer_norm, add_rms_norm) against the eager composition
``h = x + residual; y = F.layer_norm(h, ...)`` (or ``F.rms_norm``) returning y and h, and its
backward by torch.autograd.grad of (y, h) given (grad, dh) over a retained graph: the norm's
backward kernels and the add of dh, the gradient of x (and so of the residual) and of the
parameters.
Cross-entropy is F.cross_entropy forward and backward (autograd) together; it is also the
baseline of the one-pass cross-entropy (cross_entropy_one_pass, the same computation), and
F.cross_entropy(F.linear(h, W), t) with the gradients of h and W that of the fused
linear_cross_entropy (hidden size 4096). Bytes are counted as in the Rust bench. KERNELS_BENCH_SHAPES (comma-separated ROWSxCOLS) replaces the shapes of
softmax, the norms and transpose, as in the Rust bench.
"""
import os
from functools import partial

import torch
import torch.nn.functional as F

import torch_baseline
from torch_baseline import Case

aten = torch.ops.aten
dev = "cuda"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
SHAPES = [(16384, 4096), (65536, 1024), (4096, 32768), (262144, 128), (64, 1024)]
ADD_NORM_SHAPES = [(16384, 4096), (8192, 5120)]
CUSTOM = os.environ.get("KERNELS_BENCH_SHAPES")
if CUSTOM:
    SHAPES = [tuple(int(d) for d in s.strip().split("x")) for s in CUSTOM.split(",")]
    ADD_NORM_SHAPES = SHAPES
g_ = torch.Generator(device=dev).manual_seed(0)
LCE_HIDDEN = 4096


def normal(shape, dt, mean=0.0, std=1.0):
    return (torch.randn(*shape, device=dev, dtype=torch.float32, generator=g_) * std + mean).to(dt)


def cases():
    out = []
    for dt in DTYPES:
        for r, c in SHAPES:
            if dt == "bf16" and r == 64:
                continue
            for op in ["softmax", "layer_norm", "rms_norm"]:
                out += [(op, "fwd", dt, r, c), (op, "bwd", dt, r, c)]
    for dt in DTYPES:
        for r, c in ADD_NORM_SHAPES:
            for op in ["add_layer_norm", "add_rms_norm"]:
                out += [(op, "fwd", dt, r, c), (op, "bwd", dt, r, c)]
    for r, c in [(16384, 4096), (64, 1024)]:
        out += [("log_softmax", "fwd", "f32", r, c), ("log_softmax", "bwd", "f32", r, c)]
    out += [("cross_entropy", "fwdbwd", dt, 8192, 32000) for dt in DTYPES]
    out += [("cross_entropy", "fwdbwd", "f32", 64, 1024)]
    out += [("cross_entropy", "fwdbwd", "bf16", 8192, 128256)]
    out += [("cross_entropy_one_pass", "fwdbwd", dt, 8192, 32000) for dt in DTYPES]
    out += [("cross_entropy_one_pass", "fwdbwd", "bf16", 8192, 128256)]
    out += [("cross_entropy_one_pass", "fwdbwd", "f32", 64, 1024)]
    out += [("linear_cross_entropy", "fwdbwd", "bf16", 8192, 128256)]
    for dt in DTYPES:
        out += [("sum", "fwd", dt, 1 << 18, 1 << 10), ("sum_rows", "fwd", dt, 1 << 18, 1 << 10)]
    out += [("sum_cols", "fwd", dt, 8192, 4096) for dt in DTYPES]
    out += [("sum", "fwd", "f32", 64, 1024), ("sum_rows", "fwd", "f32", 64, 1024)]
    if CUSTOM:
        out += [("transpose", "fwd", dt, r, c) for dt in DTYPES for r, c in SHAPES]
    else:
        out += [("transpose", "fwd", dt, 8192, 8192) for dt in DTYPES]
        out += [("transpose", "fwd", "f32", 64, 1024)]
    return out


def nbytes(op, direction, r, c, dt):
    n, s = r * c, torch.finfo(DTYPES[dt]).bits // 8
    if op in ("softmax", "log_softmax"):
        return (2 if direction == "fwd" else 3) * n * s
    if op == "layer_norm":
        return (2 * n + 2 * c) * s + 8 * r if direction == "fwd" else (3 * n + 3 * c) * s + 8 * r
    if op == "rms_norm":
        return (2 * n + c) * s + 4 * r if direction == "fwd" else (3 * n + 2 * c) * s + 4 * r
    if op == "add_layer_norm":
        return (4 * n + 2 * c) * s + 8 * r if direction == "fwd" else (4 * n + 3 * c) * s + 8 * r
    if op == "add_rms_norm":
        return (4 * n + c) * s + 4 * r if direction == "fwd" else (4 * n + 2 * c) * s + 4 * r
    if op == "cross_entropy":
        return 3 * n * s + 8 * r
    if op == "cross_entropy_one_pass":
        return 2 * n * s + 8 * r
    if op == "linear_cross_entropy":
        return 2 * (r + c) * LCE_HIDDEN * s + 8 * r
    if op in ("sum", "sum_rows", "sum_cols"):
        return n * s
    return 2 * n * s  # transpose


def build(op, direction, dt, r, c):
    t = DTYPES[dt]
    if op == "linear_cross_entropy":
        h = normal((r, LCE_HIDDEN), t).requires_grad_(True)
        w = normal((c, LCE_HIDDEN), t, 0.0, 0.02).requires_grad_(True)
        tgt = torch.randint(0, c, (r,), device=dev, generator=g_)

        def run_lce():
            loss = F.cross_entropy(F.linear(h, w), tgt)
            return torch.autograd.grad(loss, (h, w))
        return run_lce
    x = normal((r, c), t)
    g = normal((r, c), t)
    w, b = normal((c,), t, 1.0, 0.1), normal((c,), t, 0.0, 0.1)
    if op in ("softmax", "log_softmax"):
        f = torch.softmax if op == "softmax" else torch.log_softmax
        if direction == "fwd":
            return lambda: f(x, -1)
        y = f(x, -1)
        bwd = aten._softmax_backward_data if op == "softmax" else aten._log_softmax_backward_data
        return lambda: bwd(g, y, -1, t)
    if op == "layer_norm":
        if direction == "fwd":
            return lambda: F.layer_norm(x, (c,), w, b)
        _, mean, rstd = aten.native_layer_norm(x, [c], w, b, 1e-5)
        return lambda: aten.native_layer_norm_backward(g, x, [c], mean, rstd, w, b, [True, True, True])
    if op == "rms_norm":
        if direction == "fwd":
            return lambda: F.rms_norm(x, (c,), w, 1e-5)
        xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        y = F.rms_norm(xr, (c,), wr, 1e-5)
        return lambda: torch.autograd.grad(y, (xr, wr), g, retain_graph=True)
    if op in ("add_layer_norm", "add_rms_norm"):
        res = normal((r, c), t)

        def norm(h, w, b):
            return F.layer_norm(h, (c,), w, b, 1e-5) if op == "add_layer_norm" else F.rms_norm(h, (c,), w, 1e-5)

        def fused(x, res, w, b):
            h = x + res
            return norm(h, w, b), h
        if direction == "fwd":
            return lambda: fused(x, res, w, b)
        xr, wr, br = (t_.detach().requires_grad_(True) for t_ in (x, w, b))
        y, h = fused(xr, res, wr, br)
        dh = normal((r, c), t)
        wants = (xr, wr, br) if op == "add_layer_norm" else (xr, wr)
        return lambda: torch.autograd.grad((y, h), wants, (g, dh), retain_graph=True)
    if op in ("cross_entropy", "cross_entropy_one_pass"):
        tgt = torch.randint(0, c, (r,), device=dev, generator=g_)
        xr = x.detach().requires_grad_(True)

        def run():
            loss = F.cross_entropy(xr, tgt)
            return torch.autograd.grad(loss, xr)
        return run
    if op == "sum":
        return lambda: x.sum()
    if op == "sum_rows":
        return lambda: x.sum(-1)
    if op == "sum_cols":
        return lambda: x.sum(0)
    return lambda: x.t().contiguous()


def main():
    def all_cases():
        for op, direction, dt, r, c in cases():
            opname = f"{op}@{r}x{c}"
            n = r * c
            yield Case(f"torch/{dt}/{direction}/{opname}/{n}", opname, dt, n, direction,
                       nbytes(op, direction, r, c, dt), partial(build, op, direction, dt, r, c))

    torch_baseline.main(all_cases(), 56)


if __name__ == "__main__":
    main()
