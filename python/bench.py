"""Times each kernels_torch operator against PyTorch eager (and torch.compile where it applies) in one
process, on the same tensors.

    python3 bench.py [OUT.json] [--quick] [--budget SECONDS] [--ops NAME,NAME,...]

GPU time: ``triton.testing.do_bench`` (CUDA events around each call, L2 flushed before each,
median of the runs; CUDA events with the same method if Triton is missing). Ratio = PyTorch's time
/ ours (above 1: ours is faster). "fwd+bwd" times ``torch.autograd.grad`` of the forward, so it
includes the forward. For the small size, also the host's cost per call (microseconds per call in
a loop without synchronisation: launch overhead, which is what a small tensor pays). The JSON goes
to OUT.json, else to $OUT/python-bench.json if $OUT is set. ``--quick``: bf16 only for the
element-wise and row ops (the linear layer is f32, timed in either mode); ``--ops``: only these.

The linear layer (``relu(F.linear(x, W, b))``, f32) is timed with PyTorch's default matmul
precision, full f32 (``torch.backends.cuda.matmul.allow_tf32`` False, recorded in the JSON): the
library's GEMM is f32 on the CUDA cores, as cuBLAS's SGEMM is.
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import kernels_torch as kt
from kernels_torch import _native

try:
    from triton.testing import do_bench as _triton_bench
except ImportError:  # pragma: no cover
    _triton_bench = None

_FLUSH = None


def bench_ms(fn):
    """Median milliseconds of GPU time per call."""
    if _triton_bench is not None:
        return _triton_bench(fn, warmup=25, rep=100, return_mode="median")
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(5):
        fn()
    times = []
    for _ in range(50):
        _FLUSH.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def host_us(fn, n=2000):
    """Microseconds of host time per call, in a loop of n calls (then one synchronisation)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def grad_fn(f, inputs, g):
    return lambda: torch.autograd.grad(f(*inputs), inputs, g)


def cases(dtype, big):
    """(name, ours, torch's, inputs, grad of the output), on tensors made once per case."""
    dev = "cuda"
    rows, cols = (16384, 4096) if big else (64, 1024)

    def r(*shape, grad=True, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype).requires_grad_(grad)

    x = r(rows, cols, scale=2.0)
    g = r(rows, cols, grad=False)
    w, b = (r(cols) * 0.1 + 1).detach().requires_grad_(), r(cols)
    out = [
        ("gelu", kt.gelu, F.gelu, [x], g),
        ("silu", kt.silu, F.silu, [x], g),
        ("mish", kt.mish, F.mish, [x], g),
        ("scale_bias_silu", lambda x, w, b: kt.scale_bias_act(x, w, b, "silu"), lambda x, w, b: F.silu(x * w + b),
         [x, w, b], g),
        ("softmax", kt.softmax, lambda x: torch.softmax(x, -1), [x], g),
        ("log_softmax", kt.log_softmax, lambda x: torch.log_softmax(x, -1), [x], g),
        ("layer_norm", lambda x, w, b: kt.layer_norm(x, [cols], w, b), lambda x, w, b: F.layer_norm(x, [cols], w, b),
         [x, w, b], g),
        ("rms_norm", lambda x, w: kt.rms_norm(x, [cols], w), lambda x, w: F.rms_norm(x, [cols], w), [x, w], g),
    ]  # fmt: skip
    n, c = (8192, 32000) if big else (64, 1024)
    logits = r(n, c, scale=2.0)
    t = torch.randint(0, c, (n,), device=dev)
    one = torch.tensor(1.0, device=dev, dtype=dtype)
    out.append(("cross_entropy", lambda x: kt.cross_entropy(x, t), lambda x: F.cross_entropy(x, t), [logits], one))
    return out, f"{rows}x{cols}" if big else f"{rows}x{cols}", f"{n}x{c}"


def linear_cases(big):
    """relu(x @ W^T + b) in f32: 8192 x 4096 by 4096 x 4096 (a large layer), 64 x 1024 by 1024 x 1024."""
    rows, k, n = (8192, 4096, 4096) if big else (64, 1024, 1024)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).requires_grad_()

    x, w, b = r(rows, k), r(n, k, scale=k**-0.5), r(n)
    g = torch.randn(rows, n, device="cuda")
    case = ("linear_relu", lambda x, w, b: kt.linear(x, w, b, "relu"), lambda x, w, b: F.relu(F.linear(x, w, b)),
            [x, w, b], g)  # fmt: skip
    return [case], f"{rows}x{k}x{n}", 2.0 * rows * k * n


COMPILED = {"scale_bias_silu", "layer_norm", "rms_norm", "softmax", "cross_entropy", "gelu"}


def main():
    args = [a for a in sys.argv[1:]]
    quick = "--quick" in args
    budget = 150.0
    if "--budget" in args:
        budget = float(args[args.index("--budget") + 1])
        del args[args.index("--budget") : args.index("--budget") + 2]
    only = None
    if "--ops" in args:
        only = set(args[args.index("--ops") + 1].split(","))
        del args[args.index("--ops") : args.index("--ops") + 2]
    args = [a for a in args if a != "--quick"]
    out_path = args[0] if args else (os.path.join(os.environ["OUT"], "python-bench.json") if os.environ.get("OUT") else None)
    ok, why = kt.cuda_status()
    if not (ok and torch.cuda.is_available()):
        print(f"no GPU: {why}; nothing to time")
        return 1 if os.environ.get("KERNELS_REQUIRE_GPU") == "1" else 0
    start = time.time()
    print(f"GPU: {torch.cuda.get_device_name()} (kernels: {why}), PyTorch {torch.__version__}, "
          f"timer: {'triton.testing.do_bench' if _triton_bench else 'CUDA events'}")  # fmt: skip
    results = []
    dtypes = [torch.bfloat16] if quick else [torch.float32, torch.bfloat16]
    hdr = f"{'op':<16} {'dtype':<9} {'shape':<12} {'dir':<8} {'ours ms':>9} {'torch ms':>9} {'ratio':>6} {'compiled':>9} {'ratio':>6}"
    print(hdr)
    print("-" * len(hdr))
    runs = []
    for big in (True, False):
        for dtype in dtypes:
            cs, shape, ce_shape = cases(dtype, big)
            runs += [(big, dtype, c, ce_shape if c[0] == "cross_entropy" else shape, None) for c in cs]
        cs, shape, flops = linear_cases(big)
        runs += [(big, torch.float32, c, shape, flops) for c in cs]
    for big, dtype, (name, ours, ref, inputs, g), sh, flops in runs:
        if only is not None and name not in only:
            continue
        for direction in ("fwd", "fwd+bwd"):
            if direction == "fwd":
                fo, fr = (lambda o=ours: o(*inputs)), (lambda r=ref: r(*inputs))
            else:
                fo, fr = grad_fn(ours, inputs, g), grad_fn(ref, inputs, g)
            with torch.no_grad() if direction == "fwd" else torch.enable_grad():
                t_o, t_r = bench_ms(fo), bench_ms(fr)
            rec = {"op": name, "dtype": str(dtype).replace("torch.", ""), "shape": sh, "dir": direction,
                   "ours_ms": t_o, "torch_ms": t_r, "ratio": t_r / t_o}  # fmt: skip
            tc = ""
            if flops is not None:  # GEMMs: forward one product, fwd+bwd three
                f = flops * (1 if direction == "fwd" else 3)
                rec["ours_tflops"], rec["torch_tflops"] = f / t_o / 1e9, f / t_r / 1e9
                rec["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
                tc = f"  TFLOP/s: ours {rec['ours_tflops']:.1f}, torch {rec['torch_tflops']:.1f}"
            if (big and direction == "fwd" and dtype == torch.bfloat16 and name in COMPILED
                    and time.time() - start < budget):  # fmt: skip
                try:
                    cf = torch.compile(ref, fullgraph=True, dynamic=False)
                    with torch.no_grad():
                        cf(*inputs)
                        t_c = bench_ms(lambda: cf(*inputs))
                    rec["compiled_ms"] = t_c
                    rec["ratio_compiled"] = t_c / t_o
                    tc = f"{t_c:9.4f} {t_c / t_o:6.2f}"
                except Exception as e:  # noqa: BLE001 - report and go on
                    rec["compiled_error"] = repr(e)[:200]
                    tc = "  (compile failed)"
            if not big:
                with torch.no_grad() if direction == "fwd" else torch.enable_grad():
                    rec["ours_host_us"], rec["torch_host_us"] = host_us(fo, 500), host_us(fr, 500)
                tc += f"  host us/call: ours {rec['ours_host_us']:.1f}, torch {rec['torch_host_us']:.1f}"
            results.append(rec)
            print(f"{name:<16} {rec['dtype']:<9} {sh:<12} {direction:<8} {t_o:9.4f} {t_r:9.4f} {t_r / t_o:6.2f} {tc}")
    # What a call costs on the host, layer by layer, for a small tensor: the native call alone
    # (preallocated output, no checks), the custom op, PyTorch's op.
    x = torch.randn(64, 1024, device="cuda")
    y = torch.empty_like(x)
    raw_stream = torch._C._cuda_getCurrentRawStream
    native = lambda: _native.activation_fwd(0, raw_stream(0), 0, 5, 0.0, 0.0, x.data_ptr(), y.data_ptr(), x.numel())  # noqa: E731
    layers = {"native call": host_us(native), "rustkernels::gelu": host_us(lambda: kt.gelu(x)), "F.gelu": host_us(lambda: F.gelu(x))}
    print("host us/call, gelu 64x1024 f32: " + ", ".join(f"{k} {v:.1f}" for k, v in layers.items()))
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results, "host_layers_us": layers}
    if out_path:
        with open(out_path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {out_path}")
    print(f"done in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
