"""A small decoder-only language model (pre-norm blocks: RMSNorm, causal self-attention with
RoPE, SwiGLU MLP) trained on a generated corpus twice from the same initial weights and the
same batches: once with every op from ``kernels_torch`` (the library's kernels), once in pure
PyTorch. Prints both loss curves, checks that ours reaches PyTorch's, and reports the tokens per
second and peak memory of each.

    python python/examples/transformer_block.py                       # the default run (bf16)
    python python/examples/transformer_block.py --json block.json     # and everything as JSON
    python python/examples/transformer_block.py --compile             # also torch.compile'd PyTorch
    python python/examples/transformer_block.py --layers 4 --width 512 --heads 8 --steps 100
    python python/examples/transformer_block.py --dry-run             # CPU, f32, tiny: no GPU needed

The model, one definition for both (``Ops`` is the switch): a token embedding, ``--layers``
blocks ``x += attn(rms_norm(x)); x += mlp(rms_norm(x))``, a final RMSNorm, an LM head (not tied)
and the cross-entropy. Attention: one fused QKV projection (no biases anywhere), RoPE on the
queries and keys (element ``i`` of a head paired with ``i + D / 2``, LLaMA's), causal attention,
an output projection. MLP: one up projection to ``[.., 2F]``, SwiGLU ``silu(a) * b``
of its halves, a down projection. Ours: ``kernels_torch.embedding``, ``rms_norm`` (the first
norm), ``add_rms_norm`` (every residual add with the norm after it, the final norm included),
``linear``, ``rope``, ``scaled_dot_product_attention``, ``swiglu`` and ``cross_entropy`` on the bf16
logits. PyTorch's: ``F.embedding``, ``x + residual`` then ``F.rms_norm``, ``F.linear``, RoPE
composed in f32 (the kernel's formula; PyTorch has no RoPE op), ``F.scaled_dot_product_attention
(is_causal=True)``, ``F.silu(a) * b`` and ``F.cross_entropy`` on the logits cast to f32 (as the
kernel computes in f32: nanoGPT's and llm.c's practice). Before training, one step of ours
counts the calls into the native layer and checks that every op ran the kernels.

Precision: bf16 parameters and activations, f32 master weights (AdamW, clipping and weight
decay on the masters; the bf16 parameters are the masters rounded after each step), as the
Rust GPT-2 example trains. AdamW (0.9, 0.95), weight decay 0.1 on the matrices, gradients
clipped to norm 1, a linear warm-up then a cosine decay to a tenth. GPT-2's initialization:
N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2 L)), unit norm weights.

The corpus: sequences of a fixed random Markov chain of order two over ``--vocab`` tokens. Each
token has ``K = --branch`` distinct successors ``succ[t][0..K)``; the token after ``x[t]`` is
``succ[x[t]][j]``, in the slot ``j = cls[x[t-1]]`` given by a fixed random class of the token
before with probability ``--follow``, else in a uniform slot. Printed, in nats: the unigram
entropy (near ``ln(vocab)``) and the bigram one ``H(next | current)`` (at most ``ln K``: what
the current token alone tells, which the MLP can learn), both measured on the training
targets, and the chain's entropy rate (the floor, exact): the entropy of ``(f, q, ..., q)``, ``q =
(1 - follow) / K``, ``f = follow + q``. Going below the bigram entropy takes the attention (the
class of the previous token).

Agreement, stated and checked. Ours and PyTorch (seed 0) differ only by where each rounds to
bf16, so their curves follow each other without being equal; how far apart two correct runs
end is measured by a third training, PyTorch from a second seed's initial weights (seed 1, the
same batches). Pass criteria:

- the first losses (same weights, same batch) agree within one bf16 ulp of PyTorch's (the loss
  of ours is itself a bf16 number, the kernel's output dtype; everything else only differs by
  roundings averaged over ``batch * seq`` tokens);
- both runs learn: the mean loss of the last 50 steps below ``0.75 ln(vocab)``, clearly below the
  unigram entropy (within a few tenths of ``ln(vocab)``);
- ours reaches PyTorch's curve: the last 50 steps' mean losses differ by at most
  ``max(2 |tail(seed 1) - tail(seed 0)|, 2% of tail(seed 0))``: twice the spread of two seeds
  (one pair of seeds estimates the spread loosely, hence the factor), and a floor because on
  the same batches two seeds' curves can end nearly together, closer than two implementations'
  bf16 roundings need to keep them.

Also reported, not checked: the largest per-step difference, the mean per-step difference over
the whole curve against the two seeds', and each run's tokens per second (the median step time
by CUDA events after the warm-up steps, and the synchronised wall time over the same steps) and
peak memory (``torch.cuda.max_memory_allocated`` above what was allocated before the model).
``--compile`` adds a ``torch.compile``'d PyTorch run (seed 0) to the table and the JSON.

Exit status: 0 when the check passes, 1 when it fails, 2 when the run cannot start (no CUDA
GPU, or ``kernels_torch`` missing or unable to run here).
"""

import argparse
import gc
import json
import math
import statistics
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:
    print(f"transformer_block: needs PyTorch ({e})", file=sys.stderr)
    sys.exit(2)

EPS = 1e-6  # the norms' epsilon (bf16's own, PyTorch's default, would swamp the small initial rows)
TAIL = 50  # the steps whose mean loss is compared


# --- the two sets of ops -------------------------------------------------------------------------


class TorchOps:
    """The model's ops in pure PyTorch."""

    @staticmethod
    def embedding(idx, weight):
        return F.embedding(idx, weight)

    @staticmethod
    def rms_norm(x, weight):
        return F.rms_norm(x, weight.shape, weight, EPS)

    @staticmethod
    def add_rms_norm(x, residual, weight):
        h = x + residual
        return F.rms_norm(h, weight.shape, weight, EPS), h

    @staticmethod
    def linear(x, weight):
        return F.linear(x, weight)

    @staticmethod
    def rope(x, cos, sin):
        """``x [B, S, H, D]``: pairs ``(i, i + D / 2)`` turned by the tables' angles, in f32,
        rounded once (the kernel's formula)."""
        c, s = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
        a, b = x.float().chunk(2, dim=-1)
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)

    @staticmethod
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    @staticmethod
    def swiglu(x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b

    @staticmethod
    def cross_entropy(logits, target):
        return F.cross_entropy(logits.float(), target)


class KernelOps:
    """The model's ops from ``kernels_torch``."""

    def __init__(self, kt):
        self.kt = kt

    def embedding(self, idx, weight):
        return self.kt.embedding(idx, weight)

    def rms_norm(self, x, weight):
        return self.kt.rms_norm(x, weight.shape, weight, EPS)

    def add_rms_norm(self, x, residual, weight):
        return self.kt.add_rms_norm(x, residual, weight.shape, weight, EPS)

    def linear(self, x, weight):
        return self.kt.linear(x, weight)

    def rope(self, x, cos, sin):
        return self.kt.rope(x, cos, sin, layout="bshd")

    def attention(self, q, k, v):
        return self.kt.scaled_dot_product_attention(q, k, v, is_causal=True)

    def swiglu(self, x):
        return self.kt.swiglu(x)

    def cross_entropy(self, logits, target):
        # On the bf16 logits (the kernel computes in f32): no f32 copy of them.
        return self.kt.cross_entropy(logits, target)


# --- the model -----------------------------------------------------------------------------------


def ffn_width(width):
    """LLaMA's SwiGLU width: 8/3 of the model's (the parameters of a 4x GELU MLP), rounded up to
    a multiple of 256."""
    return -(-(8 * width // 3) // 256) * 256


class Block(torch.nn.Module):
    def __init__(self, cfg, device, dtype):
        super().__init__()
        c, f = cfg["width"], cfg["ffn"]

        def p(*shape):
            return torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))

        self.attn_norm, self.qkv, self.proj = p(c), p(3 * c, c), p(c, c)
        self.mlp_norm, self.up, self.down = p(c), p(2 * f, c), p(c, f)
        self.heads = cfg["heads"]

    def attention(self, ops, y, cos, sin):
        b, s, c = y.shape
        h = self.heads
        # [B, S, 3, H, D]: q, k and v are [B, S, H, D] slices; attention takes [B, H, S, D] views.
        q, k, v = ops.linear(y, self.qkv).view(b, s, 3, h, c // h).unbind(2)
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        out = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return ops.linear(out.transpose(1, 2).reshape(b, s, c), self.proj)

    def mlp(self, ops, y):
        return ops.linear(ops.swiglu(ops.linear(y, self.up)), self.down)


class Model(torch.nn.Module):
    """The language model; ``ops`` (``TorchOps`` or ``KernelOps``) runs its maths. Parameters are
    created uninitialised: ``load_state_dict`` a state of ``initial_state``."""

    def __init__(self, cfg, ops, device="cpu", dtype=torch.float32):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        v, c = cfg["vocab"], cfg["width"]
        self.wte = torch.nn.Parameter(torch.empty(v, c, device=device, dtype=dtype))
        self.blocks = torch.nn.ModuleList(Block(cfg, device, dtype) for _ in range(cfg["layers"]))
        self.final_norm = torch.nn.Parameter(torch.empty(c, device=device, dtype=dtype))
        self.lm_head = torch.nn.Parameter(torch.empty(v, c, device=device, dtype=dtype))
        cos, sin = rope_tables(cfg["seq"], c // cfg["heads"])
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, idx, target):
        ops = self.ops
        # The norm before each sublayer, and the final one; each but the first is fused with
        # the residual add before it.
        norms = [w for b in self.blocks for w in (b.attn_norm, b.mlp_norm)] + [self.final_norm]
        x = ops.embedding(idx, self.wte)  # the residual stream
        y = ops.rms_norm(x, norms[0])
        for i, b in enumerate(self.blocks):
            y, x = ops.add_rms_norm(b.attention(ops, y, self.cos, self.sin), x, norms[2 * i + 1])
            y, x = ops.add_rms_norm(b.mlp(ops, y), x, norms[2 * i + 2])
        logits = ops.linear(y, self.lm_head)
        return ops.cross_entropy(logits.view(-1, logits.shape[-1]), target.reshape(-1))


def rope_tables(max_pos, head_dim, base=10000.0):
    """``kernels_torch.rope_tables``: cos and sin f32 ``[max_pos, D / 2]`` of ``p * base **
    (-2 i / D)``, computed in f64 and rounded once (here so that the CPU dry run needs no
    package)."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return angle.cos().float(), angle.sin().float()


def initial_state(cfg, seed):
    """GPT-2's initialization in f32 on the CPU, from ``seed``."""
    m = Model(cfg, None)
    g = torch.Generator().manual_seed(seed)
    std_res = 0.02 / math.sqrt(2 * max(1, cfg["layers"]))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std_res if name.endswith(("proj", "down")) else 0.02, generator=g)
    return dict(m.state_dict())


# --- the corpus ----------------------------------------------------------------------------------


def make_corpus(cfg, n_seq, seed=1234):
    """``n_seq`` sequences of ``seq + 1`` tokens of the chain (see the module's doc), generated on
    the CPU (the same on every device), and its entropies in nats: ``unigram`` and ``bigram``
    measured on the targets (positions 2 on: the first two tokens are random), ``rate`` exact,
    ``uniform`` = ln(vocab)."""
    v, k, follow, length = cfg["vocab"], cfg["branch"], cfg["follow"], cfg["seq"] + 1
    g = torch.Generator().manual_seed(seed)
    # Token t's successors: (r[t] + off[j]) mod v, distinct since the k offsets are.
    off = torch.randperm(v, generator=g)[:k]
    succ = (torch.randint(0, v, (v, 1), generator=g) + off) % v
    cls = torch.randint(0, k, (v,), generator=g)
    toks = torch.randint(0, v, (n_seq, length), generator=g)
    picks = torch.full((n_seq, length), -1, dtype=torch.int64)  # each token's successor slot j
    follows = torch.rand(n_seq, length, generator=g) < follow
    uniform = torch.randint(0, k, (n_seq, length), generator=g)
    for t in range(2, length):
        j = torch.where(follows[:, t], cls[toks[:, t - 2]], uniform[:, t])
        toks[:, t], picks[:, t] = succ[toks[:, t - 1], j], j
    # Plug-in estimates: the unigram entropy, and H(next | current) = H(j | current) (a token's
    # successors are distinct).
    nxt, cur, j = toks[:, 2:].reshape(-1), toks[:, 1:-1].reshape(-1), picks[:, 2:].reshape(-1)
    pair = torch.bincount(cur * k + j, minlength=v * k).double().view(v, k)
    rows = pair.sum(1)
    h_rows = -torch.xlogy(pair, pair / rows.clamp(min=1)[:, None]).sum(1)  # count x H(j | cur)
    q = (1 - follow) / k
    f = follow + q
    rate = -(f * math.log(f) + ((k - 1) * q * math.log(q) if q > 0 else 0.0))
    ent = dict(
        uniform=math.log(v),
        unigram=entropy(torch.bincount(nxt, minlength=v).double()),
        bigram=float(h_rows.sum() / rows.sum()),
        rate=rate,
    )
    return toks, ent


def entropy(counts):
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


# --- training ------------------------------------------------------------------------------------


def lr_at(args, step):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    decay = (step - args.warmup) / max(1, args.steps - args.warmup)
    low = args.lr / 10
    return low + 0.5 * (1 + math.cos(math.pi * min(decay, 1.0))) * (args.lr - low)


class Trainer:
    """A model in ``dtype`` from ``state``, with f32 masters for bf16 parameters (f32 parameters
    are their own masters), AdamW on the masters."""

    def __init__(self, cfg, ops, state, args, device, dtype, compile=False):
        self.model = Model(cfg, ops, device, dtype)
        self.model.load_state_dict(state)  # rounds the f32 state to dtype
        self.params = list(self.model.parameters())
        names = [n for n, _ in self.model.named_parameters()]
        if dtype == torch.float32:
            self.masters = self.params
        else:
            self.masters = [state[n].to(device, torch.float32).clone() for n in names]
        groups = [
            {"params": [m for m in self.masters if m.dim() >= 2], "weight_decay": 0.1},
            {"params": [m for m in self.masters if m.dim() < 2], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
        self.forward = torch.compile(self.model) if compile else self.model

    def step(self, x, y, lr):
        loss = self.forward(x, y)
        loss.backward()
        if self.masters is not self.params:
            for m, p in zip(self.masters, self.params):
                m.grad = p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, 1.0)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return loss.detach()


def train(cfg, ops, state, data, args, label, dtype, compile=False):
    """Trains from ``state`` on ``data`` (inputs and targets ``[steps, B, S]``); returns the
    losses, the timings and the peak memory."""
    x_all, y_all = data
    device = x_all.device
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    tr = Trainer(cfg, ops, state, args, device, dtype, compile)
    steps = args.steps
    losses = torch.zeros(steps, device=device)
    warm = min(args.timing_warmup, steps // 2)
    marks = []  # per step: (start, end) CUDA events, or perf_counter seconds on the CPU
    t0 = None
    for step in range(steps):
        if step == warm:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        losses[step] = tr.step(x_all[step], y_all[step], lr_at(args, step))
        if cuda:
            end.record()
        else:
            end = time.perf_counter()
        marks.append((start, end))
        if args.log_every and (step % args.log_every == 0 or step == steps - 1):
            print(f"  {label} step {step:>4}: loss {losses[step].item():.4f}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    step_ms = [(s.elapsed_time(e) if cuda else (e - s) * 1e3) for s, e in marks[warm:]]
    tokens = x_all.shape[1] * x_all.shape[2]
    med = statistics.median(step_ms)
    out = dict(
        label=label,
        losses=[float(v) for v in losses.tolist()],
        timed_steps=steps - warm,
        step_ms_median=med,
        tokens_per_s=tokens / (med / 1e3),
        tokens_per_s_wall=tokens * (steps - warm) / wall,
        peak_allocated_bytes=(torch.cuda.max_memory_allocated() - before) if cuda else None,
    )
    del tr
    print(
        f"{label}: {out['tokens_per_s']:,.0f} tokens/s (median step {med:.2f} ms over steps {warm}-{steps - 1}; "
        f"wall {out['tokens_per_s_wall']:,.0f})"
        + (f", peak {out['peak_allocated_bytes'] / 2**30:.2f} GiB" if cuda else ""),
        flush=True,
    )
    return out


def count_native_calls(kt, cfg, state, x, y, dtype):
    """One forward and backward of ours with every function of the native layer counted."""
    nat = kt._native
    counts, saved = {}, {}
    for name in dir(nat):
        f = getattr(nat, name)
        if callable(f) and not name.startswith("_") and name != "cuda_status":

            def wrap(*a, _f=f, _n=name):
                counts[_n] = counts.get(_n, 0) + 1
                return _f(*a)

            saved[name] = f
            setattr(nat, name, wrap)
    try:
        model = Model(cfg, KernelOps(kt), x.device, dtype)
        model.load_state_dict(state)
        model(x, y).backward()
        torch.cuda.synchronize()
    finally:
        for name, f in saved.items():
            setattr(nat, name, f)
    return counts


def expected_calls(layers):
    per = {"linear_fwd": 4, "linear_bwd": 4, "rope": 4, "add_norm_fwd": 2, "add_norm_bwd": 2}
    per.update(attention_fwd=1, attention_bwd=1, glu_fwd=1, glu_bwd=1)
    want = {k: v * layers for k, v in per.items()}
    want["linear_fwd"] += 1  # the LM head
    want["linear_bwd"] += 1
    want.update(embedding_fwd=1, embedding_bwd=1, norm_fwd=1, norm_bwd=1, cross_entropy_fwd=1, cross_entropy_bwd=1)
    return want


# --- the report ----------------------------------------------------------------------------------


def bf16_ulp(x):
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x != 0 else 2.0**-133


def compare(runs, ent, bf16):
    """The comparison of the curves and the pass criteria (see the module's doc)."""
    a, o, b = (runs[k]["losses"] for k in ("torch", "ours", "torch_seed1"))
    tail = min(TAIL, len(a))

    def tail_mean(v):
        return sum(v[-tail:]) / tail

    diffs = [abs(x - y) for x, y in zip(o, a)]
    seed_diffs = [abs(x - y) for x, y in zip(b, a)]
    ta, to, tb = tail_mean(a), tail_mean(o), tail_mean(b)
    d_ours, d_seed = abs(to - ta), abs(tb - ta)
    bound = max(2 * d_seed, 0.02 * ta)
    learn = 0.75 * ent["uniform"]
    first_bound = bf16_ulp(a[0]) if bf16 else 1e-3 * abs(a[0])
    checks = [
        dict(
            name="first loss",
            value=diffs[0],
            bound=first_bound,
            ok=diffs[0] <= first_bound,
            what="|ours - PyTorch| at step 0" + (" (bound: one bf16 ulp of the loss)" if bf16 else ""),
        ),
        dict(
            name="PyTorch learns",
            value=ta,
            bound=learn,
            ok=ta < learn,
            what=f"PyTorch's last-{tail} mean loss below 0.75 ln(vocab)",
        ),
        dict(
            name="ours learns",
            value=to,
            bound=learn,
            ok=to < learn,
            what=f"ours' last-{tail} mean loss below 0.75 ln(vocab)",
        ),
        dict(
            name="ours reaches PyTorch",
            value=d_ours,
            bound=bound,
            ok=d_ours <= bound,
            what="|tail(ours) - tail(PyTorch)| <= max(2 |tail(seed 1) - tail(seed 0)|, 2% of tail(seed 0))",
        ),
    ]
    stats = dict(
        tail_steps=tail,
        tail_mean=dict(torch=ta, ours=to, torch_seed1=tb),
        tail_mean_abs_diff=dict(ours=d_ours, seed=d_seed),
        max_abs_diff=dict(ours=max(diffs), ours_step=diffs.index(max(diffs)), seed=max(seed_diffs)),
        mean_abs_diff=dict(ours=sum(diffs) / len(diffs), seed=sum(seed_diffs) / len(seed_diffs)),
        # Informative: below the bigram entropy, the attention is doing its part.
        below_bigram=dict(torch=ta < ent["bigram"], ours=to < ent["bigram"]),
    )
    return stats, checks


def print_report(runs, stats, checks, ent, steps):
    keys = [k for k in ("torch", "ours", "torch_seed1", "torch_compile") if k in runs]
    print()
    print(f"{'step':>5} " + " ".join(f"{runs[k]['label']:>14}" for k in keys) + f" {'|ours-torch|':>13}")
    rows = sorted(set(list(range(min(5, steps))) + list(range(0, steps, max(1, steps // 15))) + [steps - 1]))
    for i in rows:
        vals = " ".join(f"{runs[k]['losses'][i]:>14.4f}" for k in keys)
        print(f"{i:>5} {vals} {abs(runs['ours']['losses'][i] - runs['torch']['losses'][i]):>13.2e}")
    t = stats["tail_steps"]
    tm = stats["tail_mean"]
    print(
        f"mean loss of the last {t} steps: PyTorch {tm['torch']:.4f}, ours {tm['ours']:.4f}, "
        f"PyTorch seed 1 {tm['torch_seed1']:.4f}"
    )
    print(
        f"entropies (nats): uniform {ent['uniform']:.3f}, unigram {ent['unigram']:.3f}, bigram "
        f"{ent['bigram']:.3f}, the chain's rate {ent['rate']:.3f} (the floor)"
    )
    m = stats["max_abs_diff"]
    print(
        f"|ours - PyTorch|: max {m['ours']:.4f} (step {m['ours_step']}), mean {stats['mean_abs_diff']['ours']:.4f}, "
        f"last-{t} means {stats['tail_mean_abs_diff']['ours']:.4f}; seed 1 against seed 0: max {m['seed']:.4f}, "
        f"mean {stats['mean_abs_diff']['seed']:.4f}, last-{t} means {stats['tail_mean_abs_diff']['seed']:.4f}"
    )
    bb = stats["below_bigram"]
    print(
        f"last-{t} mean below the bigram entropy (the attention at work): PyTorch "
        f"{'yes' if bb['torch'] else 'no'}, ours {'yes' if bb['ours'] else 'no'}"
    )
    ref = runs["torch"]["tokens_per_s"]
    print(f"{'':<18} {'tokens/s':>12} {'(wall)':>12} {'vs PyTorch':>10} {'peak memory':>12}")
    for k in ("torch", "ours", "torch_compile"):
        if k in runs:
            r = runs[k]
            mem = f"{r['peak_allocated_bytes'] / 2**30:>8.2f} GiB" if r["peak_allocated_bytes"] is not None else "n/a"
            print(
                f"{r['label']:<18} {r['tokens_per_s']:>12,.0f} {r['tokens_per_s_wall']:>12,.0f} "
                f"{r['tokens_per_s'] / ref:>9.2f}x {mem:>12}"
            )
    for c in checks:
        verdict = "ok" if c["ok"] else "FAILED"
        print(f"check {c['name']}: {verdict}: {c['value']:.4f} against {c['bound']:.4f} ({c['what']})")


# --- main ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=None, help="SwiGLU width F (default: 8/3 width, rounded up to 256)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--branch", type=int, default=8, help="successors of each token in the corpus")
    ap.add_argument("--follow", type=float, default=0.75, help="how often the previous token's class picks")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30, help="steps of linear learning-rate warm-up")
    ap.add_argument("--timing-warmup", type=int, default=10, help="steps left out of the timings")
    ap.add_argument("--log-every", type=int, default=50, help="a progress line every k steps (0: none)")
    ap.add_argument("--compile", action="store_true", help="also time a torch.compile'd PyTorch run")
    ap.add_argument("--json", help="write the configuration, curves, timings and checks here")
    ap.add_argument("--no-check", action="store_true", help="report without failing on the check")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="on the CPU in f32 at a tiny size (unless given), PyTorch's ops in every run; needs no GPU "
        "nor kernels_torch, checks nothing",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        tiny = dict(steps=2, batch=2, seq=32, width=64, heads=4, layers=2, vocab=256, log_every=1)
        for k, v in tiny.items():
            if "--" + k.replace("_", "-") not in given:
                setattr(args, k, v)
    return args


def refuse(msg):
    print(f"transformer_block: {msg}", file=sys.stderr)
    return 2


def main(argv=None):
    started = time.perf_counter()
    args = parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq < 1 or args.layers < 0 or not 1 <= args.branch <= args.vocab:
        return refuse("--steps, --batch and --seq must be positive, --layers not negative, --branch in [1, vocab]")
    if args.width % args.heads or (args.width // args.heads) % 2:
        return refuse(f"--width {args.width} must split into --heads {args.heads} heads of an even size")
    kt = None
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    else:
        if not torch.cuda.is_available():
            return refuse("needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run runs on the CPU")
        try:
            import kernels_torch as kt
        except ImportError as e:
            return refuse(f"needs the kernels_torch package (python/, built with maturin): {e}")
        ok, why = kt.cuda_status()
        if not ok:
            return refuse(f"kernels_torch cannot run here: {why}")
        device, dtype = torch.device("cuda"), torch.bfloat16
        d = args.width // args.heads
        if d % 8 or not 8 <= d <= 256:
            return refuse(f"the attention kernels take head dims that are multiples of 8 up to 256, not {d}")
    # bf16 parameters with f32 masters rather than autocast: every op then sees one dtype, so the
    # residual add and the norm after it fuse (autocast's f32 residual stream meets bf16 branches).
    cfg = dict(
        vocab=args.vocab,
        width=args.width,
        heads=args.heads,
        layers=args.layers,
        ffn=args.ffn or ffn_width(args.width),
        seq=args.seq,
        branch=args.branch,
        follow=args.follow,
    )
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
    print(
        f"transformer LM: {cfg['layers']} layers, width {cfg['width']}, {cfg['heads']} heads of "
        f"{cfg['width'] // cfg['heads']}, SwiGLU {cfg['ffn']}, vocab {cfg['vocab']}; batch {args.batch} x "
        f"{args.seq}, {args.steps} steps; {str(dtype).replace('torch.', '')}; {dev_name}, PyTorch {torch.__version__}",
        flush=True,
    )

    t = time.perf_counter()
    toks, ent = make_corpus(cfg, args.steps * args.batch)
    toks = toks.view(args.steps, args.batch, args.seq + 1).to(device)
    data = (toks[..., :-1].contiguous(), toks[..., 1:].contiguous())
    del toks
    print(
        f"corpus: {args.steps * args.batch * args.seq:,} tokens in {time.perf_counter() - t:.1f} s; entropy "
        f"(nats): unigram {ent['unigram']:.3f} (uniform {ent['uniform']:.3f}), bigram "
        f"{ent['bigram']:.3f}, the chain's rate {ent['rate']:.3f}",
        flush=True,
    )
    state0, state1 = initial_state(cfg, 0), initial_state(cfg, 1)

    calls = None
    if kt is not None:
        calls = count_native_calls(kt, cfg, state0, data[0][0], data[1][0], dtype)
        print("native calls in one step of ours: " + ", ".join(f"{k} {v}" for k, v in sorted(calls.items())))
        want = expected_calls(cfg["layers"])
        wrong = {k: (calls.get(k, 0), v) for k, v in want.items() if calls.get(k, 0) != v}
        if wrong:
            print(f"transformer_block: FAILED: an op did not run the kernels as expected (got, want): {wrong}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(device=dev_name, native_calls=calls, expected_calls=want, passed=False), f, indent=1)
            return 1
        ours = KernelOps(kt)
    else:
        ours = TorchOps  # the dry run: the pipeline end to end, PyTorch's ops in every run

    runs = {}
    runs["torch"] = train(cfg, TorchOps, state0, data, args, "PyTorch", dtype)
    runs["ours"] = train(cfg, ours, state0, data, args, "ours" if kt is not None else "ours (dry: torch)", dtype)
    runs["torch_seed1"] = train(cfg, TorchOps, state1, data, args, "PyTorch seed 1", dtype)
    if args.compile:
        runs["torch_compile"] = train(cfg, TorchOps, state0, data, args, "PyTorch compile", dtype, compile=True)

    stats, checks = compare(runs, ent, dtype == torch.bfloat16)
    print_report(runs, stats, checks, ent, args.steps)
    passed = all(c["ok"] for c in checks)
    print(f"total time {time.perf_counter() - started:.1f} s")
    enforced = not (args.dry_run or args.no_check)
    if args.json:
        out = dict(
            config=dict(cfg, batch=args.batch, steps=args.steps, lr=args.lr, warmup=args.warmup,
                        timing_warmup=args.timing_warmup, dtype=str(dtype).replace("torch.", "")),
            device=dev_name,
            torch=torch.__version__,
            dry_run=args.dry_run,
            entropy=ent,
            native_calls=calls,
            runs=runs,
            comparison=stats,
            checks=checks,
            passed=passed,
            seconds=time.perf_counter() - started,
        )  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if not enforced:
        why = "dry run" if args.dry_run else "--no-check"
        print(f"transformer_block: the check is not enforced ({why}); it would have {'passed' if passed else 'failed'}")
        return 0
    print("transformer_block: " + ("ours reaches PyTorch's loss curve" if passed else "FAILED"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
