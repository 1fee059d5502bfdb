"""PyTorch baselines for benches/rope.rs: the eager composition of RoPE on the same shapes, dtypes,
layouts and directions, timed with triton.testing.do_bench (warmup=25, rep=200, median), written
as the same JSON records as the Rust bench, so that scripts/compare.py joins the two on (op,
dtype, n, direction).

    python3 benches/torch_rope.py torch_rope.json [REGEX]

The half-rotation is Hugging Face's LLaMA: ``x * cos + rotate_half(x) * sin`` with the tables in
x's dtype, ``[S, D]`` (the halves' angles repeated), broadcast over the heads. The interleaved
pairs are Meta's LLaMA code: ``view_as_complex`` of x in f32 times the complex exponentials,
``view_as_real``, back to x's dtype. The backward is autograd's over a retained graph; "inplace"
is the forward written back into x (``x.copy_``), as close as eager PyTorch comes. The copy is
``x.clone()``. Bytes are counted as in the Rust bench.
"""
from functools import partial

import torch

import torch_baseline
from torch_baseline import Case

dev = "cuda"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
SHAPES = [(4, 4096, 32, 128), (8, 2048, 16, 64)]
g_ = torch.Generator(device=dev).manual_seed(0)


def cases():
    out = []
    for dt in DTYPES:
        for shape in SHAPES:
            for layout in ("bshd", "bhsd"):
                for op in ("rope", "rope_interleaved"):
                    out += [(op, d, dt, layout, shape) for d in ("fwd", "bwd", "inplace")]
            out.append(("copy", "fwd", dt, "bshd", shape))
    return out


def nbytes(op, dt, shape):
    b, s, h, d = shape
    n = b * s * h * d
    return 2 * n * torch.finfo(DTYPES[dt]).bits // 8 + (0 if op == "copy" else 4 * s * d)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def build(op, direction, dt, layout, shape):
    t = DTYPES[dt]
    b, s, h, d = shape
    xs = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
    x = torch.randn(*xs, device=dev, generator=g_).to(t)
    if op == "copy":
        return lambda: x.clone()
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64, device=dev) / d)
    ang = torch.outer(torch.arange(s, dtype=torch.float64, device=dev), inv)  # [S, D / 2]
    bcast = (lambda u: u) if layout == "bhsd" else (lambda u: u[:, None, :])  # against [.., S, H, ..]
    if op == "rope":
        cos = bcast(torch.cat((ang.cos(), ang.cos()), -1).to(t))
        sin = bcast(torch.cat((ang.sin(), ang.sin()), -1).to(t))

        def f(x):
            return x * cos + rotate_half(x) * sin
    else:
        freqs = bcast(torch.polar(torch.ones_like(ang), ang).to(torch.complex64))

        def f(x):
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)

    if direction == "fwd":
        return lambda: f(x)
    if direction == "inplace":
        return lambda: x.copy_(f(x))
    xr = x.detach().requires_grad_(True)
    y = f(xr)
    g = torch.randn(*xs, device=dev, generator=g_).to(t)
    return lambda: torch.autograd.grad(y, xr, g, retain_graph=True)


def main():
    def all_cases():
        for op, direction, dt, layout, shape in cases():
            b, s, h, d = shape
            opname = f"{op}_{layout}@{b}x{s}x{h}x{d}"
            n = b * s * h * d
            yield Case(f"torch/{dt}/{direction}/{opname}/{n}", opname, dt, n, direction, nbytes(op, dt, shape),
                       partial(build, op, direction, dt, layout, shape))

    torch_baseline.main(all_cases(), 64)


if __name__ == "__main__":
    main()
