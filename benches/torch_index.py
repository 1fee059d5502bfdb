"""PyTorch baselines for benches/index.rs: ``torch.index_select``, ``torch.gather``,
``Tensor.scatter_add`` and the autograd backward passes of the first two on the same shapes and
dtypes, timed with triton.testing.do_bench (warmup=25, rep=200, median), written as the same JSON
records as the Rust bench, so that scripts/compare.py joins the two on (op, dtype, n, direction).

    python3 benches/torch_index.py torch_index.json [REGEX]

The backward passes are autograd's gradient of the input over a retained graph (PyTorch's
``index_add_`` and ``scatter_add_`` with atomics on CUDA, so their sums are not deterministic).
Indices are uniform in ``[0, size)``. Bytes are counted as in the Rust bench.
"""
from functools import partial

import torch

import torch_baseline
from torch_baseline import Case

dev = "cuda"
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
# (op, name, x shape, dim, index shape): as SHAPES in benches/index.rs.
SHAPES = [
    ("index_select", "rows", (32768, 1024), 0, (8192, 1)),
    ("index_select", "cols", (4096, 4096), 1, (1024, 1)),
    ("gather", "pick", (8192, 32000), 1, (8192, 1)),
    ("gather", "topk", (4096, 32000), 1, (4096, 256)),
    ("scatter_add", "nodes", (1024, 1024), 0, (16384, 1024)),
]
g_ = torch.Generator(device=dev).manual_seed(0)


def cases():
    out = []
    for dt in DTYPES:
        for s in SHAPES:
            out.append(("fwd", dt, s))
            if s[0] != "scatter_add":
                out.append(("bwd", dt, s))
    return out


def idx_shape(s):
    op, _, _, _, idx = s
    return (idx[0],) if op == "index_select" else idx


def out_shape(s):
    op, _, x, dim, idx = s
    if op == "index_select":
        o = list(x)
        o[dim] = idx[0]
        return tuple(o)
    return idx if op == "gather" else x


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def elements_and_bytes(direction, dt, s):
    e = torch.finfo(DTYPES[dt]).bits // 8
    x, o, i = numel(s[2]), numel(out_shape(s)), numel(idx_shape(s))
    if s[0] == "scatter_add":
        return x, (2 * x + i) * e + 8 * i
    if direction == "fwd":
        return o, 2 * o * e + 8 * i
    return x, (o + x) * e + 8 * i


def build(direction, dt, s):
    t = DTYPES[dt]
    op, _, shape, dim, _ = s
    idx = torch.randint(0, shape[dim], idx_shape(s), device=dev, generator=g_)
    x = torch.randn(shape, device=dev, generator=g_).to(t)
    if op == "scatter_add":
        src = torch.randn(s[4], device=dev, generator=g_).to(t)
        return lambda: x.scatter_add(dim, idx, src)
    f = (lambda a: torch.index_select(a, dim, idx)) if op == "index_select" else (lambda a: torch.gather(a, dim, idx))
    if direction == "fwd":
        return lambda: f(x)
    xr = x.detach().requires_grad_(True)
    y = f(xr)
    g = torch.randn(out_shape(s), device=dev, generator=g_).to(t)
    return lambda: torch.autograd.grad(y, xr, g, retain_graph=True)


def main():
    def all_cases():
        for direction, dt, s in cases():
            op, cname, x, _, _ = s
            opname = f"{op}_{cname}@{x[0]}x{x[1]}"
            elements, nb = elements_and_bytes(direction, dt, s)
            yield Case(f"torch/{dt}/{direction}/{opname}/{elements}", opname, dt, elements, direction, nb,
                       partial(build, direction, dt, s))

    torch_baseline.main(all_cases(), 64)


if __name__ == "__main__":
    main()
