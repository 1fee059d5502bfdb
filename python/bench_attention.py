"""Times ``kernels_torch.scaled_dot_product_attention`` against ``F.scaled_dot_product_attention``
(PyTorch's default backend choice) in one process, on the same bf16 tensors.

    python3 bench_attention.py [OUT.json] [--quick]

Shapes ``[B, H, S, D]``: B4 H16 S4096 D128 (causal and not), B4 H32 S4096 D64, B1 H16 S16384 D128
causal, B16 H16 S1024 D128 causal; contiguous inputs (the Bhsd layout), and one case of transposed
views of ``[B, S, H, D]`` (ours then runs the Bshd layout in place; PyTorch's takes the views).
``--quick``: the first two shapes only.

GPU time: CUDA events around each call, 5 warm-up calls, the median of 20. The forward runs under
``torch.no_grad``; the backward is ``torch.autograd.grad`` of one retained forward (so it times the
backward alone). TFLOP/s: ``4 B H Sq Sk D`` for the forward (halved when causal), 2.5 times that
for the backward (FlashAttention's convention).

Peak memory of one forward and backward from the inputs (their own memory excluded):
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, and, for ours, the peak of
the driver's stream-ordered pool (``cuMemPoolGetAttribute(USED_MEM_HIGH)`` of the device's default
pool), where the library allocates its temporaries and outputs before they are copied into
PyTorch's tensors: PyTorch's counter does not see them. ``peak_bytes`` is the sum of the two, an
upper bound of the joint peak.

Output: a table, one JSON line per measurement (``{"op": "attention", ...}``), and the whole as
JSON in OUT.json, else ``$OUT/python-bench-attention.json`` if $OUT is set: ``{"device", "torch",
"results": [{"shape", "B", "H", "S", "D", "causal", "layout", "dir" ("fwd", "bwd", "mem"),
"ours_ms", "torch_ms", "ratio" (torch / ours), "ours_tflops", "torch_tflops"}, or for "mem"
"<side>_torch_bytes", "<side>_pool_bytes" (null where the pool cannot be read) and
"<side>_peak_bytes" for the sides "ours" and "torch"; "<side>_error" where a side failed]}``.
"""

import ctypes
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import kernels_torch as kt

SHAPES = [  # B, H, S, D, causal, layout
    (4, 16, 4096, 128, False, "bhsd"),
    (4, 16, 4096, 128, True, "bhsd"),
    (4, 32, 4096, 64, False, "bhsd"),
    (1, 16, 16384, 128, True, "bhsd"),
    (16, 16, 1024, 128, True, "bhsd"),
    (4, 16, 4096, 128, True, "bshd"),
]


def time_ms(fn, warmup=5, reps=20):
    """Median milliseconds of GPU time per call (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


class DriverPool:
    """The peak of the device's default stream-ordered memory pool (cuMemAllocAsync's), through
    the driver API; None where it cannot be read."""

    USED_MEM_HIGH = 8  # CU_MEMPOOL_ATTR_USED_MEM_HIGH

    def __init__(self, ordinal):
        self.pool = None
        try:
            self.cu = ctypes.CDLL("libcuda.so.1")
            dev, pool = ctypes.c_int(), ctypes.c_void_p()
            if self.cu.cuDeviceGet(ctypes.byref(dev), ordinal) == 0:
                if self.cu.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev) == 0:
                    self.pool = pool
        except OSError:
            pass

    def reset(self):
        if self.pool is not None:
            zero = ctypes.c_uint64(0)
            self.cu.cuMemPoolSetAttribute(self.pool, self.USED_MEM_HIGH, ctypes.byref(zero))

    def high(self):
        if self.pool is None:
            return None
        v = ctypes.c_uint64(0)
        if self.cu.cuMemPoolGetAttribute(self.pool, self.USED_MEM_HIGH, ctypes.byref(v)) != 0:
            return None
        return v.value


def make(b, h, s, d, layout, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "bshd":
        return torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return torch.randn(b, h, s, d, generator=g, device="cuda", dtype=torch.bfloat16)


def peak(f, inputs, g, pool):
    """(PyTorch's allocator's peak, the driver pool's peak) of one forward and backward, in bytes
    above what was allocated before."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    pool.reset()
    torch.autograd.grad(f(*inputs), inputs, g)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, pool.high()


def main():
    args = sys.argv[1:]
    quick = "--quick" in args
    args = [a for a in args if a != "--quick"]
    out_env = os.environ.get("OUT")
    out_path = args[0] if args else (os.path.join(out_env, "python-bench-attention.json") if out_env else None)
    ok, why = kt.cuda_status()
    if not (ok and torch.cuda.is_available()):
        print(f"no GPU: {why}; nothing to time")
        return 1 if os.environ.get("KERNELS_REQUIRE_GPU") == "1" else 0
    start = time.time()
    print(f"GPU: {torch.cuda.get_device_name()} (kernels: {why}), PyTorch {torch.__version__}, timer: CUDA events")
    pool = DriverPool(torch.cuda.current_device())
    sides = {"ours": kt.scaled_dot_product_attention, "torch": F.scaled_dot_product_attention}
    results = []
    hdr = f"{'shape':<26} {'layout':<6} {'dir':<4} {'ours ms':>9} {'torch ms':>9} {'ratio':>6} {'ours TF/s':>9} {'torch TF/s':>10}"
    print(hdr)
    print("-" * len(hdr))
    for b, h, s, d, causal, layout in SHAPES[:2] if quick else SHAPES:
        shape = f"B{b} H{h} S{s} D{d}{' causal' if causal else ''}"
        base = {"op": "attention", "shape": shape, "B": b, "H": h, "S": s, "D": d, "causal": causal, "layout": layout}
        flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
        q, k, v = (make(b, h, s, d, layout, seed).requires_grad_() for seed in (1, 2, 3))
        g = make(b, h, s, d, "bhsd", 4)
        recs = {"fwd": dict(base, dir="fwd"), "bwd": dict(base, dir="bwd"), "mem": dict(base, dir="mem")}
        for side, f in sides.items():
            fn = lambda f=f: f(q, k, v, is_causal=causal)  # noqa: E731
            try:
                with torch.no_grad():
                    t = time_ms(fn)
                recs["fwd"][f"{side}_ms"], recs["fwd"][f"{side}_tflops"] = t, flops / t / 1e9
            except Exception as e:  # noqa: BLE001 - recorded, and the other side goes on
                recs["fwd"][f"{side}_error"] = repr(e)[:300]
            try:
                out = fn()
                t = time_ms(lambda out=out: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
                del out
                recs["bwd"][f"{side}_ms"], recs["bwd"][f"{side}_tflops"] = t, 2.5 * flops / t / 1e9
            except Exception as e:  # noqa: BLE001
                recs["bwd"][f"{side}_error"] = repr(e)[:300]
            try:
                torch_bytes, pool_bytes = peak(lambda q, k, v, f=f: f(q, k, v, is_causal=causal), (q, k, v), g, pool)
                m = recs["mem"]
                m[f"{side}_torch_bytes"], m[f"{side}_pool_bytes"] = torch_bytes, pool_bytes
                m[f"{side}_peak_bytes"] = torch_bytes + (pool_bytes or 0)
            except Exception as e:  # noqa: BLE001
                recs["mem"][f"{side}_error"] = repr(e)[:300]
        for dr in ("fwd", "bwd"):
            r = recs[dr]
            if "ours_ms" in r and "torch_ms" in r:
                r["ratio"] = r["torch_ms"] / r["ours_ms"]
            cell = lambda key, fmt: format(r[key], fmt) if key in r else "err"  # noqa: E731
            print(f"{shape:<26} {layout:<6} {dr:<4} {cell('ours_ms', '9.3f'):>9} {cell('torch_ms', '9.3f'):>9} "
                  f"{cell('ratio', '6.2f'):>6} {cell('ours_tflops', '9.1f'):>9} {cell('torch_tflops', '10.1f'):>10}")  # fmt: skip
        m = recs["mem"]
        mib = lambda key: f"{m[key] / 2**20:.0f} MiB" if m.get(key) is not None else "err"  # noqa: E731
        print(f"{shape:<26} {layout:<6} mem  peak fwd+bwd: ours {mib('ours_peak_bytes')} (PyTorch's allocator "
              f"{mib('ours_torch_bytes')}, driver pool {mib('ours_pool_bytes')}), torch {mib('torch_peak_bytes')}")  # fmt: skip
        for r in recs.values():
            results.append(r)
            print(json.dumps(r))
        q = k = v = g = None  # freed before the next shape
        torch.cuda.empty_cache()
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    if out_path:
        with open(out_path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {out_path}")
    print(f"done in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
