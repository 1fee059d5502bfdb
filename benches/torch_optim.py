"""PyTorch baselines for benches/optim.rs: one torch.optim.AdamW(fused=True) step on 2^24
parameters of f32 and bf16, timed with triton.testing.do_bench (warmup=25, rep=200, median),
written as the same JSON records as the Rust bench, so that scripts/compare.py joins the two on
(op, dtype, n, direction).

    python3 benches/torch_optim.py torch_optim.json [REGEX]

The step is `opt.step()` on one parameter tensor whose `.grad` is set and whose state already
exists (the first step, which creates it, runs in the warm-up): PyTorch's fused multi-tensor
kernel plus the optimizer's Python overhead, which is what a training loop pays. Bytes are
counted as in the Rust bench (f32 moments: n * (3 s + 16)), although PyTorch keeps bf16 moments
for bf16 parameters and moves 14 bytes per element where we move 22 (see benches/optim.rs).
"""
from functools import partial

import torch

import torch_baseline
from torch_baseline import Case

dev = "cuda"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
N = 1 << 24
g_ = torch.Generator(device=dev).manual_seed(0)


def normal(n, dt, std):
    return (torch.randn(n, device=dev, dtype=torch.float32, generator=g_) * std).to(dt)


def build(dt):
    t = DTYPES[dt]
    p = torch.nn.Parameter(normal(N, t, 0.02))
    p.grad = normal(N, t, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, fused=True)
    opt.step()  # creates the state
    return opt.step


def main():
    def all_cases():
        for dt in DTYPES:
            s = torch.finfo(DTYPES[dt]).bits // 8
            yield Case(f"torch/{dt}/step/adamw/{N}", "adamw", dt, N, "step", N * (3 * s + 16), partial(build, dt))

    torch_baseline.main(all_cases(), 56)


if __name__ == "__main__":
    main()
