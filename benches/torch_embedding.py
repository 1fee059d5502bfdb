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
import json
import re
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from peak_memory import peak_extra_bytes

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
    path = sys.argv[1] if len(sys.argv) > 1 else "/dev/null"
    keep = re.compile(sys.argv[2]) if len(sys.argv) > 2 else None
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    rows = []
    for op, direction, dt, shape in cases():
        model, v, d, n = shape
        opname = f"{op}_{model}@{v}x{d}x{n}"
        elements = rows_out(direction, shape) * d
        name = f"torch/{dt}/{direction}/{opname}/{elements}"
        if keep is not None and not keep.search(name):
            continue
        fn = build(op, direction, dt, shape)
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        nb = nbytes(op, direction, dt, shape)
        gbs = nb / ms / 1e6
        rows.append(dict(name=name, op=opname, dtype=dt, n=elements, direction=direction, bytes=nb, ms=ms, gbs=gbs,
                         peak_extra_bytes=peak_extra_bytes(fn)))
        print(f"{name:64s} {ms * 1e3:10.2f} us {gbs:9.1f} GB/s", flush=True)
        del fn
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {len(rows)} records to {path}")


if __name__ == "__main__":
    main()
