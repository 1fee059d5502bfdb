"""PyTorch's side of the bf16 GEMM comparisons (benches/gemm.rs runs ours and cuBLAS in-process):
`F.linear` in bf16 and f16 at the shapes of benches/gemm.rs, and the eager
`gelu(F.linear(x, W, b))` (three kernels: cuBLAS, the bias add, GELU) that the fused linear layer
replaces; and f32 `torch.matmul` and `F.linear` in plain TF32
(`torch.backends.cuda.matmul.allow_tf32 = True`, PyTorch's "high") at 4096^3 and 8192^3, the
`gemm/tf32` cases of benches/gemm.rs. Timed as triton.testing.do_bench does (CUDA events, L2
flushed, median).

    python3 benches/torch_gemm.py [OUT.json]
"""
import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (2048, 2048, 2048), (8192, 11008, 4096),
          (8192, 4096, 11008), (8192, 128256, 4096), (128, 4096, 4096), (16, 4096, 4096)]
GPT2_SHAPES = [(16384, 2304, 768), (16384, 768, 768), (16384, 3072, 768), (16384, 768, 3072)]


def main():
    records = []
    for dtype, dt in [(torch.bfloat16, "bf16"), (torch.float16, "f16")]:
        cases = [(s, False) for s in SHAPES] + [((8192, 4096, 4096), True)]
        if dtype == torch.bfloat16:
            # GPT-2 124M at 16 x 1024 tokens (examples/gpt2), as benches/gemm.rs.
            cases += [(s, False) for s in GPT2_SHAPES] + [((16384, 3072, 768), True)]
        for (m, n, k), fused in cases:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype)
            b = torch.randn(n, device="cuda", dtype=dtype)
            fn = (lambda x=x, w=w, b=b: F.gelu(F.linear(x, w, b))) if fused else (lambda x=x, w=w: F.linear(x, w))
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            tflops = 2.0 * m * n * k / ms / 1e9
            what = "gelu(linear(x, W, b))" if fused else "linear(x, W)"
            print(f"{dt} {what:<24} {m}x{n}x{k}: {ms * 1e3:9.1f} us {tflops:7.1f} TFLOP/s")
            records.append({"op": what, "dtype": dt, "shape": f"{m}x{n}x{k}", "ms": ms, "tflops": tflops})
            del x, w, b
    # f32 in plain TF32: matmul (A @ B, the `nn` case) and F.linear (x @ W^T, `nt`).
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        for m, n, k in [(4096, 4096, 4096), (8192, 8192, 8192)]:
            a = torch.randn(m, k, device="cuda")
            b = torch.randn(k, n, device="cuda")
            w = torch.randn(n, k, device="cuda")
            fns = [("matmul(A, B)", lambda a=a, b=b: a @ b), ("linear(x, W)", lambda a=a, w=w: F.linear(a, w))]
            for what, fn in fns:
                ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
                tflops = 2.0 * m * n * k / ms / 1e9
                print(f"tf32 {what:<24} {m}x{n}x{k}: {ms * 1e3:9.1f} us {tflops:7.1f} TFLOP/s")
                records.append({"op": what, "dtype": "tf32", "shape": f"{m}x{n}x{k}", "ms": ms, "tflops": tflops})
            del a, b, w, fns
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "records": records}, f,
                      indent=1)


if __name__ == "__main__":
    main()
