"""PyTorch baselines for benches/embedding.rs: ``F.embedding`` and its autograd backward on the
same tables, token counts and dtypes, timed with triton.testing.do_bench (warmup=25, rep=200,
median), written as the same JSON records as the Rust bench, so that scripts/compare.py joins the
two on (op, dtype, n, direction).

    python3 benches/torch_embedding.py torch_embedding.json [REGEX]

The forward is ``F.embedding(idx, weight)``; the backward is autograd's gradient of the weight
over a retained graph (PyTorch's dense embedding backward: a sort of the indices, then segment
sums). The copies are ``clone()`` of a tensor of the output's shape. Tokens are uniform in
``[0, V)``. Bytes are counted as in the Rust bench.
"""
from functools import partial

import torch
import torch.nn.functional as F

import torch_baseline
from torch_baseline import Case

dev = "cuda"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
SHAPES = [("gpt2", 50257, 768, 8192), ("llama", 128256, 4096, 8192)]
g_ = torch.Generator(device=dev).manual_seed(0)


def cases():
    out = []
    for dt in DTYPES:
        for shape in SHAPES:
            for direction in ("fwd", "bwd"):
                out += [(op, direction, dt, shape) for op in ("embedding", "copy")]
    return out


def rows_out(direction, shape):
    _, v, _, n = shape
    return n if direction == "fwd" else v


def nbytes(op, direction, dt, shape):
    _, v, d, n = shape
    s = torch.finfo(DTYPES[dt]).bits // 8
    r = rows_out(direction, shape)
    return 2 * r * d * s if op == "copy" else (r + n) * d * s + 8 * n


def build(op, direction, dt, shape):
    t = DTYPES[dt]
    _, v, d, n = shape
    if op == "copy":
        x = torch.randn(rows_out(direction, shape), d, device=dev, generator=g_).to(t)
        return lambda: x.clone()
    idx = torch.randint(0, v, (n,), device=dev, generator=g_)
    w = torch.randn(v, d, device=dev, generator=g_).to(t)
    if direction == "fwd":
        return lambda: F.embedding(idx, w)
    wr = w.detach().requires_grad_(True)
    y = F.embedding(idx, wr)
    g = torch.randn(n, d, device=dev, generator=g_).to(t)
    return lambda: torch.autograd.grad(y, wr, g, retain_graph=True)


def main():
    def all_cases():
        for op, direction, dt, shape in cases():
            model, v, d, n = shape
            opname = f"{op}_{model}@{v}x{d}x{n}"
            elements = rows_out(direction, shape) * d
            yield Case(f"torch/{dt}/{direction}/{opname}/{elements}", opname, dt, elements, direction,
                       nbytes(op, direction, dt, shape), partial(build, op, direction, dt, shape))

    torch_baseline.main(all_cases(), 64)


if __name__ == "__main__":
    main()
