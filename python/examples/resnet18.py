"""A ResNet-18 for 32 x 32 images (the CIFAR stem: one 3x3 convolution, no max pool) trained on
generated data twice from the same initial weights and the same batches: once with every
convolution, batch norm, relu, pool and linear layer from ``kernels_torch.nn`` (the library's
kernels), once in pure PyTorch (cuDNN, cuBLAS). Prints both loss curves, checks that they agree,
and reports the images per second of each.

    python python/examples/resnet18.py                 # float32 (cuDNN without TF32: both in f32)
    python python/examples/resnet18.py --amp           # bfloat16 autocast
    python python/examples/resnet18.py --steps 100 --batch 64

Both models are ``channels_last`` (the NHWC kernels; on bf16 the convolutions' forward with
``C % 8 == 0`` runs on the tensor cores). The data: 10 classes, each a colour and a smooth random
pattern, under unit noise; SGD with momentum 0.9, lr 0.05, weight decay 5e-4; the loss is
PyTorch's ``F.cross_entropy`` in both. Before training, one step of the kernels' model counts
the calls into the native layer and checks that every layer ran the kernels (20
convolutions and 20 batch norms forward and backward, 17 relus, the pool, the linear layer).

Agreement, stated and checked: in float32 the two models differ by the implementations' f32
roundings (a few ulp per operation; up to about 1e-5 relative for the Winograd and FFT
convolutions cuDNN may pick), which training carries on and amplifies step by step: the first
loss must agree within 1e-4 (relative) and the first five within 1e-3. In bfloat16 each layer's
output is rounded to 8 bits either way, and the two sides' roundings differ where their f32
sums differ in the last bits, up to one bf16 unit (2^-8 relative) per rounding: the first loss
must agree within 2^-5 (relative). Beyond the first steps the curves follow each other, not
bit for bit (two runs that differ in the last bits part ways, as two seeds would, and the loss
nears 0): the mean losses of the last 20 steps must agree within 10% (relative) plus 0.02, and
both must have fallen to half the first loss.
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import kernels_torch
from kernels_torch import nn as knn

CLASSES = 10


def conv_bn_relu(nn, cin, cout, stride):
    """A 3x3 convolution, batch norm and relu: ``ConvBNReLU`` of ours, the same three modules
    (and ``state_dict``) in PyTorch."""
    if nn is knn:
        return knn.ConvBNReLU(cin, cout, 3, stride, 1, bias=False)
    return torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(cout),
                               torch.nn.ReLU())  # fmt: skip


class BasicBlock(torch.nn.Module):
    def __init__(self, nn, cin, cout, stride):
        super().__init__()
        self.a = conv_bn_relu(nn, cin, cout, stride)
        self.conv = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.short = None
        if stride != 1 or cin != cout:
            self.short = torch.nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn(self.conv(self.a(x)))
        return self.relu(out + (x if self.short is None else self.short(x)))


class ResNet18(torch.nn.Module):
    def __init__(self, nn):
        super().__init__()
        self.stem = conv_bn_relu(nn, 3, 64, 1)
        blocks, cin = [], 64
        for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            blocks += [BasicBlock(nn, cin, cout, stride), BasicBlock(nn, cout, cout, 1)]
            cin = cout
        self.blocks = torch.nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, CLASSES)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def make_data(n, device, seed=0):
    """``n`` generated images of 10 classes: a colour and a smooth pattern (bilinear from 4 x 4)
    per class, plus unit Gaussian noise per pixel."""
    g = torch.Generator(device=device).manual_seed(seed)
    colour = torch.randn(CLASSES, 3, 1, 1, generator=g, device=device) * 0.5
    pattern = F.interpolate(torch.randn(CLASSES, 3, 4, 4, generator=g, device=device), size=32, mode="bilinear")
    y = torch.randint(0, CLASSES, (n,), generator=g, device=device)
    x = colour[y] + pattern[y] + torch.randn(n, 3, 32, 32, generator=g, device=device)
    return x.contiguous(memory_format=torch.channels_last), y


def batches(x, y, batch, steps, seed=1):
    g = torch.Generator(device=x.device).manual_seed(seed)
    for _ in range(steps):
        i = torch.randint(0, x.shape[0], (batch,), generator=g, device=x.device)
        yield x[i], y[i]


def count_native_calls(model, x, y, amp):
    """One forward and backward of ``model`` with every function of the native layer counted."""
    nat = kernels_torch._native
    counts, saved = {}, {}
    for name in dir(nat):
        f = getattr(nat, name)
        if callable(f) and not name.startswith("_") and name not in ("cuda_status",):

            def wrap(*a, _f=f, _n=name):
                counts[_n] = counts.get(_n, 0) + 1
                return _f(*a)

            saved[name] = f
            setattr(nat, name, wrap)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.cuda.synchronize()
    finally:
        for name, f in saved.items():
            setattr(nat, name, f)
    model.zero_grad(set_to_none=True)
    return counts


def train(model, data, args, label):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    losses = []
    warm = min(10, args.steps // 2)
    t0 = None
    for step, (x, y) in enumerate(batches(*data, args.batch, args.steps)):
        if step == warm:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    ips = (args.steps - warm) * args.batch / seconds
    losses = [v.item() for v in losses]
    print(f"{label}: {ips:,.0f} images/s over steps {warm}-{args.steps - 1} ({seconds:.2f} s)", flush=True)
    return losses, ips


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--amp", action="store_true", help="bfloat16 autocast (default: float32)")
    ap.add_argument("--no-check", action="store_true", help="print the curves without checking them")
    args = ap.parse_args()
    ok, why = kernels_torch.cuda_status()
    if not (ok and torch.cuda.is_available()):
        print(f"resnet18: needs a CUDA GPU ({why})")
        return 0
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False  # float32 convolutions in f32 on both sides
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda"
    dtype = "bfloat16 autocast" if args.amp else "float32"
    print(f"ResNet-18 (32 x 32), {torch.cuda.get_device_name()}, PyTorch {torch.__version__}, {dtype}, "
          f"channels_last, batch {args.batch}, {args.steps} steps")  # fmt: skip

    torch.manual_seed(0)
    ref = ResNet18(torch.nn).to(dev, memory_format=torch.channels_last)
    ours = ResNet18(knn).to(dev, memory_format=torch.channels_last)
    ours.load_state_dict(ref.state_dict())
    data = make_data(20480, dev)

    x0, y0 = next(batches(*data, args.batch, 1, seed=2))
    calls = count_native_calls(ours, x0, y0, args.amp)
    relu = calls.get("activation_fwd", 0)
    want = {"conv2d_fwd": 20, "conv2d_bwd": 20, "batch_norm_fwd": 20, "batch_norm_bwd": 20, "global_avg_pool2d": 2}
    print("native calls in one step of ours: " + ", ".join(f"{k} {v}" for k, v in sorted(calls.items())))
    lin = calls.get("linear_fwd", 0) + calls.get("linear_train_fwd", 0)
    missing = [k for k, v in want.items() if calls.get(k, 0) != v]
    if missing or relu != 17 or lin != 1 or calls.get("linear_bwd", 0) != 1:
        print(f"resnet18: a layer did not run the kernels (expected {want}, 17 relus, one linear)")
        return 1
    # That step must not move the weights (its gradients were dropped, the running statistics
    # were updated): start both from the same state again.
    ours.load_state_dict(ref.state_dict())

    ref_losses, ref_ips = train(ref, data, args, "PyTorch")
    our_losses, our_ips = train(ours, data, args, "ours   ")

    print(f"{'step':>5} {'PyTorch':>10} {'ours':>10} {'rel. diff':>10}")
    for i in sorted(set(list(range(0, min(10, args.steps))) + list(range(0, args.steps, 20)) + [args.steps - 1])):
        r, o = ref_losses[i], our_losses[i]
        print(f"{i:>5} {r:>10.5f} {o:>10.5f} {abs(o - r) / abs(r):>10.2e}")
    tail = min(20, args.steps)
    ref_tail, our_tail = sum(ref_losses[-tail:]) / tail, sum(our_losses[-tail:]) / tail
    print(f"mean loss of the last {tail} steps: PyTorch {ref_tail:.5f}, ours {our_tail:.5f}")
    print(f"images/s: PyTorch {ref_ips:,.0f}, ours {our_ips:,.0f} ({our_ips / ref_ips:.2f}x)")

    if args.no_check:
        return 0
    bad = []
    rel = [abs(o - r) / abs(r) for r, o in zip(ref_losses, our_losses)]
    if args.amp:
        if rel[0] > 2.0**-5:
            bad.append(f"first loss differs by {rel[0]:.2e} (bound 2^-5)")
    else:
        if rel[0] > 1e-4:
            bad.append(f"first loss differs by {rel[0]:.2e} (bound 1e-4)")
        if max(rel[:5]) > 1e-3:
            bad.append(f"the first five losses differ by up to {max(rel[:5]):.2e} (bound 1e-3)")
    if abs(our_tail - ref_tail) > 0.1 * ref_tail + 0.02:
        bad.append(f"the last {tail} steps' mean losses differ by more than 10% + 0.02")
    if not (ref_tail < ref_losses[0] / 2 and our_tail < our_losses[0] / 2):
        bad.append("a run did not halve its loss")
    for b in bad:
        print(f"resnet18: FAILED: {b}")
    if not bad:
        print("resnet18: the loss curves agree within the stated bounds")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
