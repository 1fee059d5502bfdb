"""Times ``kernels_torch.conv2d`` forward and backward against PyTorch's (cuDNN, with
``torch.backends.cudnn.benchmark = True``) on ResNet-50's convolution layers: bfloat16,
``channels_last``, batch 64, the same tensors for both.

    python3 bench_conv.py [OUT.json] [--quick] [--batch N]

GPU time as bench.py's (``triton.testing.do_bench``: CUDA events, L2 flushed before each run,
warm-up, median; CUDA events with the same method without Triton). "fwd": the convolution alone
(no autograd); "bwd": the gradients of the input and the filter (data + weight) from a forward
recorded once (``torch.autograd.grad(..., retain_graph=True)``), without the forward.
TFLOP/s count ``2 N P Q K (C / groups) R S`` per forward and twice that per backward. Ratio =
PyTorch's time / ours (above 1: ours is faster). The JSON goes to OUT.json, else to
$OUT/python-bench-conv.json if $OUT is set. ``--quick``: three layers.
"""

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

import kernels_torch as kt
from bench import bench_ms

# (name, C, K, H (= W), filter, stride, padding, groups): ResNet-50's layers at batch 64.
LAYERS = [
    ("conv1 7x7/2 3->64 @224", 3, 64, 224, 7, 2, 3, 1),
    ("3x3 64->64 @56", 64, 64, 56, 3, 1, 1, 1),
    ("1x1 64->256 @56", 64, 256, 56, 1, 1, 0, 1),
    ("3x3 128->128 @28", 128, 128, 28, 3, 1, 1, 1),
    ("3x3 256->256 @14", 256, 256, 14, 3, 1, 1, 1),
    ("3x3 512->512 @7", 512, 512, 7, 3, 1, 1, 1),
    ("1x1 1024->256 @14", 1024, 256, 14, 1, 1, 0, 1),
    ("depthwise 3x3 256 @28", 256, 256, 28, 3, 1, 1, 256),
]
QUICK = ("3x3 64->64 @56", "1x1 64->256 @56", "3x3 256->256 @14")


def main():
    args = list(sys.argv[1:])
    quick = "--quick" in args
    batch = 64
    if "--batch" in args:
        batch = int(args[args.index("--batch") + 1])
        del args[args.index("--batch") : args.index("--batch") + 2]
    args = [a for a in args if a != "--quick"]
    out_path = args[0] if args else (os.path.join(os.environ["OUT"], "python-bench-conv.json") if os.environ.get("OUT") else None)
    ok, why = kt.cuda_status()
    if not (ok and torch.cuda.is_available()):
        print(f"no GPU: {why}; nothing to time")
        return 1 if os.environ.get("KERNELS_REQUIRE_GPU") == "1" else 0
    torch.backends.cudnn.benchmark = True
    start = time.time()
    print(f"GPU: {torch.cuda.get_device_name()} (kernels: {why}), PyTorch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}, bf16 channels_last, batch {batch}")  # fmt: skip
    hdr = f"{'layer':<24} {'dir':<4} {'ours ms':>9} {'cuDNN ms':>9} {'ours TF/s':>9} {'cuDNN TF/s':>10} {'ratio':>6}"
    print(hdr)
    print("-" * len(hdr))
    results = []
    dt = torch.bfloat16
    for name, c, k, hw, r, stride, pad, groups in LAYERS:
        if quick and name not in QUICK:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(batch, c, hw, hw, generator=g, device="cuda").to(dt)
        x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
        w = (torch.randn(k, c // groups, r, r, generator=g, device="cuda") / (c // groups * r * r) ** 0.5).to(dt)
        w = w.contiguous(memory_format=torch.channels_last).requires_grad_()
        opts = (None, stride, pad, 1, groups)
        with torch.no_grad():
            yo, yr = kt.conv2d(x, w, *opts), F.conv2d(x, w, *opts)
        p = yr.shape[2]
        flops = 2.0 * batch * p * p * k * (c // groups) * r * r
        err = ((yo.float() - yr.float()).abs().max() / yr.float().abs().max()).item()
        dy = torch.randn(yr.shape, generator=g, device="cuda").to(dt).contiguous(memory_format=torch.channels_last)
        rec = {"layer": name, "N": batch, "C": c, "K": k, "H": hw, "W": hw, "R": r, "S": r, "stride": stride,
               "padding": pad, "groups": groups, "dtype": "bfloat16", "layout": "channels_last",
               "fwd_max_rel_diff": err}  # fmt: skip
        for direction in ("fwd", "bwd"):
            if direction == "fwd":
                with torch.no_grad():
                    t_o = bench_ms(lambda: kt.conv2d(x, w, *opts))
                    t_r = bench_ms(lambda: F.conv2d(x, w, *opts))
                f = flops
            else:
                yo, yr = kt.conv2d(x, w, *opts), F.conv2d(x, w, *opts)
                t_o = bench_ms(lambda: torch.autograd.grad(yo, [x, w], dy, retain_graph=True))
                t_r = bench_ms(lambda: torch.autograd.grad(yr, [x, w], dy, retain_graph=True))
                f = 2 * flops
                del yo, yr
            ro, rr = f / t_o / 1e9, f / t_r / 1e9
            rec[f"{direction}_ours_ms"], rec[f"{direction}_torch_ms"] = t_o, t_r
            rec[f"{direction}_ours_tflops"], rec[f"{direction}_torch_tflops"] = ro, rr
            rec[f"{direction}_ratio"] = t_r / t_o
            print(f"{name:<24} {direction:<4} {t_o:9.4f} {t_r:9.4f} {ro:9.1f} {rr:10.1f} {t_r / t_o:6.2f}", flush=True)
        results.append(rec)
    ratios = {d: [r[f"{d}_ratio"] for r in results] for d in ("fwd", "bwd")}
    geo = {d: (2.0 ** (sum(math.log2(v) for v in vs) / len(vs)) if vs else None) for d, vs in ratios.items()}
    if results:
        print(f"geometric mean ratio (cuDNN time / ours): fwd {geo['fwd']:.3f}, bwd {geo['bwd']:.3f}")
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cudnn": torch.backends.cudnn.version(), "cudnn_benchmark": True, "results": results,
               "geomean_ratio": geo}  # fmt: skip
    if out_path:
        with open(out_path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {out_path}")
    print(f"done in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
