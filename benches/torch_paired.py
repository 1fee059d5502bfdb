"""The small sizes against PyTorch, paired: our kernels and PyTorch's timed in one process, launch
by launch, on the same tensors and stream.

    python3 benches/torch_paired.py OUT.json [--iters N] [--filter REGEX] [--half-scan] [--log2-size K]

OUT.json is a run file in the format of docs/results/ (benches/results_json.py) with one table of
kind "paired": times in us, ratio = PyTorch's median time over ours.

Why (docs/worklog.md, 2026-11-26c): at 2^16 elements a launch takes 4-6 us, and in
either library a launch lands near one of two levels about 0.7 us apart. Which one changes from
one measurement window to the next, in the same process on the same tensors: do_bench twice on
the same PyTorch kernel gave 4.61 and 5.31 us. Separate runs of the two libraries (the Rust
bench, then `torch_elementwise.py`) each draw their level on their own, so their ratio at this
size moved by +-15% between runs whatever the kernels did. Here each iteration flushes L2 (256
MB zeroed, as do_bench), times ours with CUDA events, flushes again and times PyTorch's, the
order alternating by iteration; both see the same machine state, the same inputs, outputs from
the same allocator on the same stream. The ratio of the two medians over ITERS pairs (default
600) is the figure; the median of the per-pair ratios is printed beside it as a check, and the
pairs' trimmed difference with its standard error (`pairstats.py`): the events come in 32-ns
steps, so two medians of the same speed differ by a step either way, and a case is *slower* only
where the difference stays below zero by more than two standard errors.

Our kernels run through the PyTorch package's native module (`kernels_torch._native`: the
library's own launch code on PyTorch's stream, as `kernels_torch` users get them). The cases and
their PyTorch baselines are those of `torch_elementwise.py` at 2^16 (the same functions, on the
same tensors; the `_y` cases are ours from the saved output, against the same PyTorch kernel as
the op's backward) and of `torch_rows.py` at 64 x 1024, except where PyTorch runs no kernel (its
gradient aliases the incoming one) and where the package has no entry (the binary backwards,
`add_row`'s backward, the sums): those stay on the process-pair comparison of compare.py.
Backward cases that PyTorch composes with autograd are marked `autograd` (its host work, not a
kernel, is what such a ratio measures). Ratio = PyTorch's time / ours: above 1, ours is faster.
"""
import argparse
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pairstats  # noqa: E402
import results_json  # noqa: E402
import torch_elementwise as te  # noqa: E402
import torch_rows as tr  # noqa: E402
from kernels_torch import _native, _ops  # noqa: E402

N = 1 << 16
ROWS, COLS = 64, 1024
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# Each op of the table by its code in `_native` (its row's index) with its parameters, and pow's
# cube, as the Rust bench names them.
UNARY = {
    row[0]: (code, *(tuple(v for _, v in row[2]) + (0.0, 0.0))[:2]) for code, row in enumerate(_native.UNARY_OPS)
}
UNARY["pow_cube"] = (UNARY["pow"][0], 3.0, 0.0)
ACTS = {name: c for name, c in UNARY.items() if _native.UNARY_OPS[c[0]][1]}
BINARY = {"add": 0, "sub": 1, "mul": 2, "div": 3}
FUSED = {f"scale_bias_{a}": ACTS[a][0] for a in ("relu", "gelu", "silu")}
# PyTorch runs no kernel for these gradients (compare.py's list, and the identity's).
TORCH_ALIASES = {("add_scalar", "bwd"), ("sub_scalar", "bwd")}
# PyTorch's backward is a kernel of its own for these (torch_elementwise.py's UNARY table).
TORCH_KERNEL_BWD = {op for op, (_, b) in te.UNARY.items() if b is not None}

FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")


def stream():
    return torch.cuda.current_stream().cuda_stream


def elementwise_case(op, kind, dt, direction):
    """(ours, PyTorch's) thunks on the same tensors, or None where there is no pair."""
    t = DT[dt]
    code = _ops._DTYPE_CODES[t]
    shape = (N // te.COLS, te.COLS)
    x = te.positive(shape, t) if op in te.POSITIVE else te.normal(shape, t)
    g = te.normal(shape, t)
    if kind == "unary":
        if (op, direction) in TORCH_ALIASES:
            return None
        fwd, bwd = te.UNARY[op]
        if op in ACTS:
            c, a, b = ACTS[op]
            f_fwd, f_bwd = _native.activation_fwd, _native.activation_bwd
        else:
            c, a, b = UNARY[op]
            f_fwd, f_bwd = _native.unary_fwd, _native.unary_bwd
        if direction == "fwd":
            def ours():
                y = torch.empty_like(x)
                f_fwd(0, stream(), code, c, a, b, x.data_ptr(), y.data_ptr(), N)
                return y
            return ours, (lambda: fwd(x))
        def ours():
            gx = torch.empty_like(x)
            f_bwd(0, stream(), code, c, a, b, x.data_ptr(), g.data_ptr(), gx.data_ptr(), N)
            return gx
        return ours, (bwd(x, g) if bwd is not None else te.autograd_bwd(fwd, x, g))
    if kind == "unary_y":
        # Ours from the saved output, against the same PyTorch kernel as the op's backward.
        base = op.removesuffix("_y")
        c, a, b = ACTS[base]
        y = te.UNARY[base][0](x)

        def ours():
            gx = torch.empty_like(x)
            _native.activation_bwd_y(0, stream(), code, c, a, b, y.data_ptr(), g.data_ptr(), gx.data_ptr(), N)
            return gx
        return ours, te.UNARY[base][1](x, g)
    if kind == "binary" and direction == "fwd":
        f, y = te.BINARY[op], te.normal(shape, t)

        def ours():
            out = torch.empty_like(x)
            _native.binary_fwd(0, stream(), code, BINARY[op], x.data_ptr(), y.data_ptr(), out.data_ptr(), N)
            return out
        return ours, (lambda: f(x, y))
    if kind == "row" and direction == "fwd":
        # add_row: x + b with b broadcast along the rows (torch_elementwise.py's row).
        b = te.normal((te.COLS,), t)

        def ours():
            out = torch.empty_like(x)
            _native.binary_row_fwd(0, stream(), code, BINARY[op.removesuffix("_row")], x.data_ptr(), b.data_ptr(),
                                   out.data_ptr(), N // te.COLS, te.COLS)
            return out
        return ours, (lambda: x + b)
    if kind == "fused":
        act, c = te.FUSED[op], FUSED[op]
        s, b = te.normal((te.COLS,), t, 1.0, 0.5), te.normal((te.COLS,), t, 0.0, 0.5)
        rows = N // te.COLS
        if direction == "fwd":
            def ours():
                y = torch.empty_like(x)
                _native.scale_bias_act_fwd(0, stream(), code, c, 0.0, 0.0, x.data_ptr(), s.data_ptr(), b.data_ptr(),
                                           y.data_ptr(), rows, te.COLS)
                return y
            return ours, (lambda: act(x * s + b))

        def ours():
            gx, gs, gb = torch.empty_like(x), torch.empty_like(s), torch.empty_like(b)
            _native.scale_bias_act_bwd(0, stream(), code, c, 0.0, 0.0, x.data_ptr(), s.data_ptr(), b.data_ptr(),
                                       g.data_ptr(), gx.data_ptr(), gs.data_ptr(), gb.data_ptr(), rows, te.COLS)
            return gx
        xr, sr, br = x.clone().requires_grad_(True), s.clone().requires_grad_(True), b.clone().requires_grad_(True)
        yr = act(xr * sr + br)
        return ours, (lambda: torch.autograd.grad(yr, (xr, sr, br), g, retain_graph=True))
    return None


def row_case(op, dt, direction):
    """Softmax, log-softmax, layer norm, RMS norm and transpose at ROWS x COLS: ours on tensors of
    the same distributions as `torch_rows.build`'s, PyTorch's its own thunk."""
    t = DT[dt]
    code = _ops._DTYPE_CODES[t]
    x, g = tr.normal((ROWS, COLS), t), tr.normal((ROWS, COLS), t)
    w, b = tr.normal((COLS,), t, 1.0, 0.1), tr.normal((COLS,), t, 0.0, 0.1)
    theirs = tr.build(op, direction, dt, ROWS, COLS)
    if op in ("softmax", "log_softmax"):
        log = op == "log_softmax"
        y = torch.empty_like(x)
        _native.softmax_fwd(0, stream(), code, log, x.data_ptr(), y.data_ptr(), ROWS, COLS)
        if direction == "fwd":
            def ours():
                out = torch.empty_like(x)
                _native.softmax_fwd(0, stream(), code, log, x.data_ptr(), out.data_ptr(), ROWS, COLS)
                return out
            return ours, theirs

        def ours():
            gx = torch.empty_like(x)
            _native.softmax_bwd(0, stream(), code, log, y.data_ptr(), g.data_ptr(), gx.data_ptr(), ROWS, COLS)
            return gx
        return ours, theirs
    if op == "transpose":
        def ours():
            out = torch.empty((COLS, ROWS), device="cuda", dtype=t)
            _native.transpose(0, stream(), code, x.data_ptr(), out.data_ptr(), 1, ROWS, COLS)
            return out
        return ours, theirs
    layer = op == "layer_norm"
    mean = torch.empty(ROWS, device="cuda", dtype=torch.float32)
    rstd = torch.empty(ROWS, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    bias = b.data_ptr() if layer else 0
    mp = mean.data_ptr() if layer else 0
    _native.norm_fwd(0, stream(), code, x.data_ptr(), w.data_ptr(), bias, y.data_ptr(), mp, rstd.data_ptr(), ROWS, COLS,
                     1e-5)
    if direction == "fwd":
        def ours():
            out, m, r = torch.empty_like(x), torch.empty_like(mean), torch.empty_like(rstd)
            _native.norm_fwd(0, stream(), code, x.data_ptr(), w.data_ptr(), bias, out.data_ptr(),
                             m.data_ptr() if layer else 0, r.data_ptr(), ROWS, COLS, 1e-5)
            return out
        return ours, theirs

    def ours():
        gx, gw, gb = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
        _native.norm_bwd(0, stream(), code, x.data_ptr(), w.data_ptr(), mp, rstd.data_ptr(), g.data_ptr(),
                         gx.data_ptr(), gw.data_ptr(), gb.data_ptr() if layer else 0, ROWS, COLS)
        return gx
    return ours, theirs


def paired(ours, theirs, iters):
    """Per-iteration GPU times (us) of ours and of PyTorch's, each after an L2 flush, the order
    alternating; enqueued in batches without synchronising (as do_bench), then read."""
    to, tt = [], []
    done = 0
    while done < iters:
        batch = min(100, iters - done)
        ev, keep = [], []
        for i in range(batch):
            e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            for f, k in (((ours, 0), (theirs, 2)) if (done + i) % 2 == 0 else ((theirs, 2), (ours, 0))):
                FLUSH.zero_()
                e[k].record()
                keep.append(f())
                e[k + 1].record()
            ev.append(e)
        torch.cuda.synchronize()
        to += [e[0].elapsed_time(e[1]) * 1e3 for e in ev]
        tt += [e[2].elapsed_time(e[3]) * 1e3 for e in ev]
        done += batch
    return to, tt


def cases(half_scan=False):
    """The cases: `torch_elementwise.py`'s at 2^16 and the row ops at 64 x 1024; with `half_scan`,
    instead every element-wise op in bf16 and f16 (the suite's half-precision cases are a few
    activations and `add`), its backward where PyTorch's is a kernel of its own."""
    if half_scan:
        out = []
        for dt in ("bf16", "f16"):
            for op in te.UNARY:
                out.append(("elementwise", op, "unary", dt, "fwd"))
                if op in TORCH_KERNEL_BWD and (op, "bwd") not in TORCH_ALIASES:
                    out.append(("elementwise", op, "unary", dt, "bwd"))
            out += [("elementwise", op + "_y", "unary_y", dt, "bwd") for op in te.FROM_OUTPUT]
            out += [("elementwise", op, "binary", dt, "fwd") for op in te.BINARY]
        return out
    out = []
    for op, kind, dt, n, direction in te.cases():
        if n == 1 << 16 and kind != "copy":
            out.append(("elementwise", op, kind, dt, direction))
    if N != 1 << 16:
        return out  # the row ops' shape is fixed (ROWS x COLS)
    for dt in ("f32",):
        for op in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
            for direction in ("fwd", "bwd"):
                out.append(("rows", op, "row", dt, direction))
        out.append(("rows", "transpose", "row", dt, "fwd"))
    return out


def n_label(n):
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n)


def as_result(r):
    """A record of this script as one of docs/results/ (benches/results_json.py)."""
    size = r["size"]
    op = f"{r['op']}@{size}" if "x" in size else r["op"]
    n = ROWS * COLS if "x" in size else int(size)
    return results_json.record(op, r["dtype"], n, r["direction"], "us", r["ours_us"], r["torch_us"], r["ratio"],
                               pairs_ratio=r["pair_ratio"], diff_ns=r["diff_ns"], diff_se_ns=r["diff_se_ns"],
                               slower=r["slower"], pairs=r["iters"],
                               note="autograd" if r["torch_autograd"] else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--iters", type=int, default=600)
    ap.add_argument("--filter", default=None)
    ap.add_argument("--half-scan", action="store_true", help="every element-wise op in bf16 and f16 instead")
    ap.add_argument("--log2-size", type=int, default=16,
                    help="element-wise cases at 2^K elements (rows of 1024; the row ops run only at 2^16)")
    args = ap.parse_args()
    global N
    N = 1 << args.log2_size
    keep = re.compile(args.filter) if args.filter else None
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    records, skipped = [], []
    for family, op, kind, dt, direction in cases(args.half_scan):
        size = f"{ROWS}x{COLS}" if family == "rows" else str(N)
        name = f"{dt}/{direction}/{op}/{size}"
        if keep is not None and not keep.search(name):
            continue
        pair = elementwise_case(op, kind, dt, direction) if family == "elementwise" else row_case(op, dt, direction)
        if pair is None:
            skipped.append(name)
            continue
        ours, theirs = pair
        paired(ours, theirs, 30)  # warm-up: modules loaded, allocator blocks cached
        to, tt = paired(ours, theirs, args.iters)
        mo, mt = statistics.median(to), statistics.median(tt)
        pr = statistics.median(b / a for a, b in zip(to, tt))
        diff, se = pairstats.trimmed_difference(to, tt)
        if family == "elementwise":
            kernel_bwd = kind == "unary_y" or (kind == "unary" and op in TORCH_KERNEL_BWD)
            autograd = direction == "bwd" and not kernel_bwd
        else:
            autograd = op == "rms_norm" and direction == "bwd"
        rec = dict(name=name, op=op, dtype=dt, size=size, direction=direction, ours_us=mo, torch_us=mt,
                   ratio=mt / mo, pair_ratio=pr, diff_ns=diff * 1e3, diff_se_ns=se * 1e3,
                   slower=pairstats.slower(diff, se), iters=args.iters, torch_autograd=autograd)
        records.append(rec)
        flag = "  autograd" if autograd else ("  **SLOWER**" if rec["slower"] else "")
        print(f"{name:36s} ours {mo:6.2f} us  torch {mt:6.2f} us  ratio {mt / mo:6.3f}  (pairs {pr:.3f}; "
              f"torch - ours {diff * 1e3:+5.0f} +- {2 * se * 1e3:3.0f} ns){flag}", flush=True)
    title = f"paired against PyTorch ({'bf16 and f16' if args.half_scan else n_label(N)}, {args.iters} pairs)"
    results_json.add_table(args.out, "paired", [as_result(r) for r in records], title=title, append=False)
    kernel_cases = [r for r in records if not r["torch_autograd"]]
    under = [r for r in kernel_cases if r["ratio"] < 1.0]
    slow = [r for r in kernel_cases if r["slower"]]
    print(f"\n{len(kernel_cases)} cases against a PyTorch kernel: {len(under)} under 1.0x by the medians"
          + (f" (lowest {min(r['ratio'] for r in under):.3f})" if under else "")
          + f"; {len(slow)} slower by more than two standard errors of the trimmed difference"
          + (": " + ", ".join(f"{r['name']} {r['diff_ns']:+.0f} ns" for r in slow) if slow else ""))
    print(f"{len(records) - len(kernel_cases)} against PyTorch's autograd composition; no pair for: "
          + ", ".join(skipped))
    print(f"wrote {len(records)} records to {args.out}")


if __name__ == "__main__":
    main()
