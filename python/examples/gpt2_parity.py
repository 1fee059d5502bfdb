"""GPT-2 in PyTorch beside the Rust example (``examples/gpt2``): the same model, initial weights,
batches, AdamW, clipping and learning-rate schedule, step for step; and PyTorch's fastest
training of the same model (``torch.compile``, SDPA) timed beside the example's throughput.

    # 1. parity: the example's dump of its first 20 steps (see the README)
    bin/examples/gpt2 --data rust-std.tok --steps 20 --warmup 5 --batch 8 --accum 2 --dump DUMP
    python3 python/examples/gpt2_parity.py --dump DUMP

    # 2. throughput: the example's --json of a full-size run, PyTorch on the same config
    bin/examples/gpt2 --data rust-std.tok --steps 60 --json rust.json
    python3 python/examples/gpt2_parity.py --bench rust.json

Needs only PyTorch and a CUDA GPU (the safetensors files are read by hand).

Parity. Three trainings from the dumped initial weights on the dumped batches: the example's
(its losses are in the dump), PyTorch's in the example's precision (``bf16``: parameters and
activations in bf16, f32 master weights, the micro-batches' gradients summed in f32, AdamW on
the masters, the masters rounded to bf16 after each step), and PyTorch's in f32 throughout
(TF32 off): the exact computation, up to f32 rounding. bf16 compute makes each side's loss
differ from the exact one by the effect of its roundings; two correct bf16 implementations
round at different places, so they differ from each other by up to about the sum of their
distances to the exact loss. The bound, per step ``s``::

    |L_rust(s) - L_bf16(s)| <= max(ulp_bf16(L_bf16(s)), 2 * max_{s' <= s} |L_bf16(s') - L_f32(s')|)

``ulp_bf16(L)``: the spacing of bf16 numbers at ``L`` (``2^(floor(log2 L) - 7)``; 0.03125 for
losses in [4, 8)): the losses agree to the loss's own bf16 rounding at least. The second term
is twice PyTorch's own bf16-against-f32 distance so far (a distance that grows as training
amplifies early differences; the running maximum keeps one lucky step from setting the bound).
Also shown, not part of the pass: each gradient tensor of the first step against f32, the
example's and PyTorch bf16's relative distance (``||g - g_f32|| / ||g_f32||``), and the
gradient norms.

Throughput. PyTorch's GPT-2 (nanoGPT's) with ``torch.compile`` and
``F.scaled_dot_product_attention`` (FlashAttention or cuDNN on bf16), fused AdamW, clipping,
reading the loss each step as the example does, in two precisions: ``autocast`` (f32 parameters,
bf16 autocast: nanoGPT and llm.c's ``train_gpt2.py``) and ``bf16`` (the example's: bf16
parameters and f32 masters). Tokens per second over the steps after the warm-up (which
compiles), and ``torch.cuda.max_memory_allocated`` from the model's creation on, beside the
example's numbers (tokens/s over its steady steps, the peak its allocator counted the same way).
MFU counts FLOPs as the example does: 6 per GEMM parameter and ``12 L T C`` for the attention.
"""

import argparse
import json
import math
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def read_safetensors(path):
    """The tensors of a safetensors file (F32, F16, BF16), on the CPU."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        buf = bytearray(data[8 + n + a : 8 + n + b])
        out[name] = torch.frombuffer(buf, dtype=dtypes[e["dtype"]]).reshape(e["shape"]).clone()
    return out


class Attention(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c, 4 * c)
        self.c_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c)
        self.attn = Attention(c, heads)
        self.ln_2 = nn.LayerNorm(c)
        self.mlp = Mlp(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT-2: learned positions, pre-norm blocks, the LM head tied to ``wte``."""

    def __init__(self, cfg):
        super().__init__()
        c = cfg["width"]
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg["vocab"], c),
                wpe=nn.Embedding(cfg["context"], c),
                h=nn.ModuleList(Block(c, cfg["heads"]) for _ in range(cfg["layers"])),
                ln_f=nn.LayerNorm(c),
            )
        )
        self.lm_head = nn.Linear(c, cfg["vocab"], bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        # GPT-2's initialization (the example's): N(0, 0.02), residual projections
        # N(0, 0.02 / sqrt(2 L)), zero biases, unit norms.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg["layers"]))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        t = idx.shape[1]
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(t, device=idx.device))
        for block in tr.h:
            x = block(x)
        logits = self.lm_head(tr.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def lr_at(cfg, step):
    """llm.c's schedule, as the example's ``Hyper::lr_at``."""
    lr, warmup, steps = cfg["lr"], cfg["warmup"], cfg["steps"]
    low = lr * cfg["min_lr_frac"]
    if step < warmup:
        return lr * (step + 1) / warmup
    if steps <= warmup:
        return lr
    decay = min((step - warmup) / (steps - warmup), 1.0)
    return low + 0.5 * (1.0 + math.cos(math.pi * decay)) * (lr - low)


def flops_per_token(cfg, seq):
    """The example's count: 6 per GEMM parameter, 12 L T C for the attention."""
    c, layers = cfg["width"], cfg["layers"]
    return 6 * (12 * layers * c * c + cfg["vocab"] * c) + 12 * layers * seq * c


def peak_flops(name):
    """The dense bf16 peak by GPU name (the example's table), or None."""
    n = name.upper()
    if "H100" in n and "PCIE" in n:
        return 756e12
    if "H100" in n or "H200" in n:
        return 989.4e12
    if "A100" in n:
        return 312e12
    return None


class Trainer:
    """A GPT and its optimizer in one precision: ``f32`` (parameters are the masters),
    ``bf16`` (bf16 parameters, f32 masters, gradients summed in f32) or ``autocast``
    (f32 parameters, bf16 autocast)."""

    def __init__(self, cfg, precision, init=None, compile=False):
        self.cfg, self.precision = cfg, precision
        self.model = GPT(cfg).cuda()
        if init is not None:
            missing = [n for n, _ in self.model.named_parameters() if n not in init]
            if missing:
                sys.exit(f"the dump's weights lack {missing[:3]}...")
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    p.copy_(init[n])
        self.params = [p for _, p in self.model.named_parameters()]
        self.names = [n for n, _ in self.model.named_parameters()]
        if precision == "bf16":
            self.masters = [p.detach().clone().float().requires_grad_() for p in self.params]
            self.model.to(torch.bfloat16)
            self.params = list(self.model.parameters())
        else:
            self.masters = self.params
        decay = [m for m in self.masters if m.dim() >= 2]
        rest = [m for m in self.masters if m.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": rest, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(
            groups, lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["eps"], fused=True
        )
        self.forward = torch.compile(self.model) if compile else self.model

    def step(self, micros, lr, keep_grads=False):
        """One step on ``micros`` (pairs of [B, T] int64 CUDA tensors): returns the mean loss,
        the norm before clipping, and (``keep_grads``) the f32 gradients before clipping."""
        accum = len(micros)
        total = torch.zeros((), device="cuda")
        for x, y in micros:
            if self.precision == "autocast":
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = self.forward(x, y)
            else:
                loss = self.forward(x, y)
            (loss / accum).backward()
            total += loss.detach() / accum
            if self.precision == "bf16":
                grads = [p.grad.float() for p in self.params]
                if self.masters[0].grad is None:
                    for m, g in zip(self.masters, grads):
                        m.grad = g
                else:
                    torch._foreach_add_([m.grad for m in self.masters], grads)
                for p in self.params:
                    p.grad = None
        kept = [m.grad.detach().clone() for m in self.masters] if keep_grads else None
        clip = self.cfg["clip"]
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.masters, clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in self.masters]))
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.precision == "bf16":
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        # Read each step, as the example reads its loss and norm.
        return total.item(), norm.item(), kept


def bf16_ulp(x):
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x != 0 else 2.0**-133


def parity(args):
    d = args.dump
    cfg = json.load(open(f"{d}/config.json"))
    rust = json.load(open(f"{d}/losses.json"))
    batches = json.load(open(f"{d}/batches.json"))
    init = read_safetensors(f"{d}/init.safetensors")
    grads0 = read_safetensors(f"{d}/grads0.safetensors")
    steps = min(len(rust), len(batches), args.steps)
    b, t = cfg["batch"], cfg["seq"]
    print(
        f"parity: {cfg['layers']} layers, {cfg['heads']} heads, width {cfg['width']}, vocab {cfg['vocab']}; "
        f"batch {b} x {t} x {cfg['accum']} accumulated; {steps} steps from step {cfg['start_step']}; "
        f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}"
    )
    # The schedule: the example's learning rates against this script's formula.
    for r in rust[:steps]:
        want = lr_at(cfg, r["step"])
        if abs(r["lr"] - want) > 1e-12 * max(want, 1e-30):
            sys.exit(f"step {r['step']}: the example's lr {r['lr']} is not the schedule's {want}")

    def micros(step):
        return [
            (
                torch.tensor(m["inputs"], dtype=torch.int64, device="cuda").view(b, t),
                torch.tensor(m["targets"], dtype=torch.int64, device="cuda").view(b, t),
            )
            for m in batches[step]
        ]

    runs = {}
    for precision in ("bf16", "f32"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        tr = Trainer(cfg, precision, init)
        out = []
        for s in range(steps):
            out.append(tr.step(micros(s), lr_at(cfg, cfg["start_step"] + s), keep_grads=(s == 0)))
        runs[precision] = (out, dict(zip(tr.names, out[0][2])))
        del tr
        torch.cuda.empty_cache()

    ok = True
    worst_ref = 0.0
    print(f"{'step':>4} {'example':>10} {'torch bf16':>10} {'torch f32':>10} {'|diff|':>9} {'bound':>9}  norms (example, bf16, f32)")
    for s in range(steps):
        lr_, lb, lf = rust[s]["loss"], runs["bf16"][0][s][0], runs["f32"][0][s][0]
        worst_ref = max(worst_ref, abs(lb - lf))
        bound = max(bf16_ulp(lb), 2 * worst_ref)
        diff = abs(lr_ - lb)
        good = diff <= bound
        ok &= good
        norms = (rust[s]["norm"], runs["bf16"][0][s][1], runs["f32"][0][s][1])
        print(
            f"{s:>4} {lr_:>10.5f} {lb:>10.5f} {lf:>10.5f} {diff:>9.2e} {bound:>9.2e}"
            f"  {norms[0]:.4f} {norms[1]:.4f} {norms[2]:.4f}{'' if good else '  MISMATCH'}"
        )

    print("first step's gradients, relative distance to f32 (example, torch bf16):")
    gb, gf = runs["bf16"][1], runs["f32"][1]
    worse = 0
    for name in gf:
        ref = gf[name].float()
        scale = torch.linalg.vector_norm(ref).item()
        if scale == 0:
            continue
        mine = grads0[name].cuda().float().view_as(ref)
        de = torch.linalg.vector_norm(mine - ref).item() / scale
        db = torch.linalg.vector_norm(gb[name].float() - ref).item() / scale
        flag = de > 2 * db + 2.0**-8
        worse += flag
        if flag or args.verbose:
            print(f"  {name:<40} {de:.2e} {db:.2e}{'  (more than twice torch bf16 + 2^-8)' if flag else ''}")
    print(f"  {len(gf)} tensors, {worse} more than twice torch bf16's distance + 2^-8")
    print("parity: PASSED" if ok else "parity: FAILED")
    return ok


def bench(args):
    rust = json.load(open(args.bench))
    cfg = dict(rust["config"])
    b, t, accum = cfg["batch"], cfg["seq"], cfg["accum"]
    cfg.update(lr=6e-4, min_lr_frac=0.1, warmup=10, steps=args.bench_steps, weight_decay=0.1, beta1=0.9,
               beta2=0.95, eps=1e-8, clip=1.0)  # fmt: skip
    torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name()
    peak = peak_flops(name)
    fpt = flops_per_token(cfg, t)
    gen = torch.Generator(device="cuda").manual_seed(0)
    top = min(256, cfg["vocab"])  # the example's byte tokens
    data = [
        [(torch.randint(0, top, (b, t), device="cuda", generator=gen),
          torch.randint(0, top, (b, t), device="cuda", generator=gen)) for _ in range(accum)]
        for _ in range(4)
    ]  # fmt: skip
    rows = [("example (Rust)", rust["tokens_per_s"], rust["peak_allocated_bytes"], rust["device"])]
    for precision in args.variants.split(","):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        tr = Trainer(cfg, precision, compile=not args.eager)
        warm = args.warmup_steps
        for s in range(warm):
            tr.step(data[s % 4], lr_at(cfg, s))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = args.bench_steps
        for s in range(n):
            tr.step(data[s % 4], lr_at(cfg, warm + s))
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        tok_s = n * b * t * accum / secs
        label = f"torch {precision}" + ("" if args.eager else " + compile")
        rows.append((label, tok_s, torch.cuda.max_memory_allocated(), name))
        del tr
    print(
        f"throughput: {cfg['layers']} layers, width {cfg['width']}, vocab {cfg['vocab']}, "
        f"batch {b} x {t} x {accum}; {fpt / 1e9:.3f} GFLOP a token"
    )
    print(f"{'':<26} {'tokens/s':>11} {'MFU':>7} {'peak memory':>12}  device")
    for label, tok_s, mem, dev in rows:
        mfu = f"{100 * fpt * tok_s / peak:.1f}%" if peak else "n/a"
        print(f"{label:<26} {tok_s / 1e3:>10.1f}k {mfu:>7} {mem / 2**30:>9.2f} GiB  {dev}")
    best = max(rows[1:], key=lambda r: r[1])
    print(
        f"example / fastest PyTorch ({best[0]}): {rows[0][1] / best[1]:.3f}x tokens/s, "
        f"{rows[0][2] / best[2]:.3f}x peak memory"
    )
    if args.out:
        json.dump([dict(label=r[0], tokens_per_s=r[1], peak_allocated_bytes=r[2], device=r[3]) for r in rows],
                  open(args.out, "w"), indent=1)  # fmt: skip
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dump", help="the example's --dump folder: run the parity")
    p.add_argument("--steps", type=int, default=20, help="parity steps (at most the dump's)")
    p.add_argument("--bench", help="the example's --json summary: time PyTorch on its config")
    p.add_argument("--variants", default="autocast,bf16", help="PyTorch precisions to time")
    p.add_argument("--bench-steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=8, help="untimed steps first (torch.compile compiles)")
    p.add_argument("--eager", action="store_true", help="time PyTorch without torch.compile")
    p.add_argument("--out", help="write the throughput table as JSON")
    p.add_argument("--verbose", action="store_true", help="every gradient tensor's distance")
    args = p.parse_args()
    if not (args.dump or args.bench):
        p.error("give --dump DIR (parity) and/or --bench RUST_JSON (throughput)")
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU: the parity and the timings run on one")
    ok = True
    if args.dump:
        ok &= parity(args)
    if args.bench:
        ok &= bench(args)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
