"""PyTorch baselines for benches/batchnorm.rs: ``F.batch_norm`` (training with the running
statistics, evaluation), its autograd backward, the stem's ``F.max_pool2d`` (3, 2, 1) and
``F.adaptive_avg_pool2d(x, 1)`` on ResNet-50's shapes at batch 64, bf16 and f32, NCHW and
channels_last, with ``torch.backends.cudnn.benchmark = True``; timed with triton.testing.do_bench
(warmup=25, rep=200, median), written as the same JSON records as the Rust bench, so that
scripts/compare.py joins the two on (op, dtype, n, direction).

    python3 benches/torch_batchnorm.py torch_batchnorm.json [REGEX]

Parameters and running statistics are float32 (as the library's, and as cuDNN takes them for
half inputs). The backward is autograd's gradient of x, weight and bias over a retained graph.
"""
from functools import partial

import torch
import torch.nn.functional as F

import torch_baseline
from torch_baseline import Case

dev = "cuda"
torch.backends.cudnn.benchmark = True
BATCH = 64
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
BN_SHAPES = [(64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (256, 14), (1024, 14), (512, 7), (2048, 7)]
g_ = torch.Generator(device=dev).manual_seed(0)


def cases():
    out = []
    for dt in DTYPES:
        for layout in ("nhwc", "nchw"):
            for shape in BN_SHAPES:
                out += [("batch_norm_train", "fwd", dt, layout, shape), ("batch_norm_train", "bwd", dt, layout, shape),
                        ("batch_norm_eval", "fwd", dt, layout, shape), ("copy", "fwd", dt, layout, shape)]
            for direction in ("fwd", "bwd"):
                out += [("max_pool", direction, dt, layout, (64, 112)), ("global_avg_pool", direction, dt, layout, (2048, 7))]
    return out


def nbytes(op, direction, dt, shape):
    c, h = shape
    e = BATCH * c * h * h
    s = torch.finfo(DTYPES[dt]).bits // 8
    if op == "batch_norm_train":
        return (2 if direction == "fwd" else 3) * e * s
    if op in ("batch_norm_eval", "copy"):
        return 2 * e * s
    if op == "max_pool":
        return e * s + e // 4 * (s + 8)
    return e * s + BATCH * c * s


def build(op, direction, dt, layout, shape):
    t = DTYPES[dt]
    c, h = shape
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = (0.5 + 2.0 * torch.randn(BATCH, c, h, h, device=dev, generator=g_)).to(t).contiguous(memory_format=fmt)
    if op == "copy":
        return lambda: x.clone(memory_format=torch.preserve_format)
    if op in ("batch_norm_train", "batch_norm_eval"):
        w = (1.0 + 0.1 * torch.randn(c, device=dev, generator=g_)).requires_grad_(direction == "bwd")
        b = (0.1 * torch.randn(c, device=dev, generator=g_)).requires_grad_(direction == "bwd")
        rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)
        training = op == "batch_norm_train"
        if direction == "fwd":
            return lambda: F.batch_norm(x, rm, rv, w, b, training=training)
        xr = x.detach().requires_grad_(True)
        y = F.batch_norm(xr, rm, rv, w, b, training=True)
        g = torch.randn_like(y)
        return lambda: torch.autograd.grad(y, (xr, w, b), g, retain_graph=True)
    if op == "max_pool":
        if direction == "fwd":
            return lambda: F.max_pool2d(x, 3, 2, 1)
        xr = x.detach().requires_grad_(True)
        y = F.max_pool2d(xr, 3, 2, 1)
        g = torch.randn_like(y)
        return lambda: torch.autograd.grad(y, xr, g, retain_graph=True)
    if direction == "fwd":
        return lambda: F.adaptive_avg_pool2d(x, 1)
    xr = x.detach().requires_grad_(True)
    y = F.adaptive_avg_pool2d(xr, 1)
    g = torch.randn_like(y)
    return lambda: torch.autograd.grad(y, xr, g, retain_graph=True)


def main():
    def all_cases():
        for op, direction, dt, layout, shape in cases():
            c, h = shape
            opname = f"{op}_{layout}@{c}x{h}"
            elements = BATCH * c * h * h
            yield Case(f"torch/{dt}/{direction}/{opname}/{elements}", opname, dt, elements, direction,
                       nbytes(op, direction, dt, shape), partial(build, op, direction, dt, layout, shape))

    torch_baseline.main(all_cases(), 64)


if __name__ == "__main__":
    main()
