"""The small sizes' kernel durations under Nsight Compute: ours and PyTorch's kernel for the same
case, alternating, each replayed by ncu with the caches flushed and the clocks locked, timed by
`gpu__time_duration` (nanoseconds, no 32-ns event steps, no launch path):

    ncu --csv --metrics gpu__time_duration.sum --log-file OUT.csv \\
        python3 benches/ncu_small.py run NAMES.json [--iters N] [--filter REGEX]
    python3 benches/ncu_small.py report OUT.csv NAMES.json [RESULT.json]

RESULT.json is a run file in the format of docs/results/ (benches/results_json.py) with one table
of kind "ncu": kernel durations in ns, ratio = PyTorch's median over ours.

Why (docs/worklog.md, 2026-11-26d): paired with CUDA events (`torch_paired.py`), what is
left between the two libraries at 2^16 is one to three steps of the event timer, in cases that
change from run to run. This measures the kernels alone. The cases are `torch_paired.py`'s
element-wise ones with a PyTorch kernel of their own (not autograd's compositions), built by its
`elementwise_case` on the same tensors. Every case runs once first (modules loaded); then for
each a marker kernel (`torch.cuda._sleep`, PyTorch's `spin_kernel`) and `iters` launches of ours
and of PyTorch's, alternating. `report` pairs them by position, checks that every one of ours is
a kernel of this library's naming and every one of PyTorch's is not, and prints the ratio of the
medians (PyTorch's time / ours) and the trimmed difference of the pairs with its standard error
(`pairstats.py`), by which a case is slower or level. ncu's durations also come in steps of 32 ns on the H100, but
they are the kernels' alone, at locked clocks, with cold caches.
"""
import csv
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pairstats  # noqa: E402
import results_json  # noqa: E402

MARKER = "spin_kernel"  # `cuda::<unnamed>::spin_kernel(long)` in ncu 2025.3


def cases(keep):
    """(name, ours, PyTorch's) for the element-wise cases against a PyTorch kernel at 2^16."""
    import torch_paired as tp

    out = []
    for family, op, kind, dt, direction in tp.cases():
        if family != "elementwise":
            continue
        name = f"{dt}/{direction}/{op}/{tp.N}"
        autograd = direction == "bwd" and not (
            kind == "unary_y" or (kind == "unary" and op in tp.TORCH_KERNEL_BWD)
        )
        if autograd or kind == "fused" or (keep is not None and not keep.search(name)):
            continue
        pair = tp.elementwise_case(op, kind, dt, direction)
        if pair is not None:
            out.append((name, pair[0], pair[1]))
    return out


def run(names_path, iters, keep):
    import torch

    todo = cases(keep)
    with open(names_path, "w") as f:
        json.dump([n for n, _, _ in todo], f)
    # Modules loaded and allocator blocks cached, every case, before the first marker.
    for _, ours, theirs in todo:
        ours(), theirs()
    torch.cuda.synchronize()
    for name, ours, theirs in todo:
        print(name, flush=True)
        torch.cuda._sleep(1)
        for _ in range(iters):
            ours()
            theirs()
        torch.cuda.synchronize()


def ours_name(kernel):
    """Whether a kernel is one of this library's: `<stem>_<kind>[_small]_<dtype>`."""
    return re.fullmatch(r"[a-z0-9_]+_(f32|f16|bf16)", kernel) is not None


def report(path, names_path, out_json=None):
    # ncu's CSV: one row per kernel and metric; keep the log's order by ID.
    rows = []
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "nsecond")
        v = float(r["Metric Value"].replace(",", ""))
        scale = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6}.get(unit, 1.0)
        rows.append((int(r["ID"]), r["Kernel Name"], v * scale))
    rows.sort()
    marks = [i for i, (_, k, _) in enumerate(rows) if MARKER in k]
    with open(names_path) as f:
        names = json.load(f)
    records = []
    for c, m in enumerate(marks):
        end = marks[c + 1] if c + 1 < len(marks) else len(rows)
        seq = rows[m + 1:end]
        # The alternating run from the start, each pair the same two kernels as the first (a log
        # of the first version of this script had the next case's warm-up pair at the end).
        ours_t, theirs_t = [], []
        for j in range(0, len(seq) - 1, 2):
            (_, ko, to), (_, kt, tt) = seq[j], seq[j + 1]
            if not ours_name(ko) or ours_name(kt) or (ko, kt) != (seq[0][1], seq[1][1]):
                break
            ours_t.append(to)
            theirs_t.append(tt)
        name = names[c] if c < len(names) else f"case {c}"
        if not ours_t:
            # PyTorch's clone (the identity's baseline) is a copy, not a kernel.
            print(f"{name}: no pairs (kernels {[k[:40] for _, k, _ in seq[:2]]}: PyTorch ran no kernel?)")
            continue
        mo, mt = statistics.median(ours_t), statistics.median(theirs_t)
        diff, se = pairstats.trimmed_difference(ours_t, theirs_t)
        records.append(dict(name=name, ours_ns=mo, torch_ns=mt, ratio=mt / mo, diff_ns=diff, diff_se_ns=se,
                            slower=pairstats.slower(diff, se), pairs=len(ours_t), ours_kernel=seq[0][1],
                            torch_kernel=seq[1][1][:60]))
        flag = "  **SLOWER**" if records[-1]["slower"] else ""
        print(f"{name:28s} ours {mo:7.0f} ns  torch {mt:7.0f} ns  ratio {mt / mo:6.3f}  (torch - ours {diff:+5.0f} "
              f"+- {2 * se:3.0f} ns; {len(ours_t)} pairs, {seq[0][1]}){flag}")
    under = [r for r in records if r["ratio"] < 1.0]
    slow = [r for r in records if r["slower"]]
    if records:
        print(f"\n{len(records)} cases: {len(under)} under 1.0x by the medians; median ratio "
              f"{statistics.median(r['ratio'] for r in records):.3f}; {len(slow)} slower by more than two "
              "standard errors of the trimmed difference"
              + (": " + ", ".join(f"{r['name']} {r['diff_ns']:+.0f} ns" for r in slow) if slow else ""))
    if out_json:
        results_json.add_table(out_json, "ncu", [as_result(r) for r in records], append=False,
                               title="the kernels alone under Nsight Compute (gpu__time_duration)")


def as_result(r):
    """A record of this script as one of docs/results/: names are DTYPE/DIR/OP/SIZE."""
    dt, direction, op, size = r["name"].split("/")
    n = 1
    for d in size.split("x"):
        n *= int(d)
    op = f"{op}@{size}" if "x" in size else op
    return results_json.record(op, dt, n, direction, "ns", r["ours_ns"], r["torch_ns"], r["ratio"], diff_ns=r["diff_ns"],
                               diff_se_ns=r["diff_se_ns"], slower=r["slower"], pairs=r["pairs"], kernel=r["ours_kernel"])


def main():
    args = sys.argv[1:]
    if args[:1] == ["run"] and len(args) >= 2:
        iters = int(args[args.index("--iters") + 1]) if "--iters" in args else 10
        keep = re.compile(args[args.index("--filter") + 1]) if "--filter" in args else None
        run(args[1], iters, keep)
    elif args[:1] == ["report"] and len(args) >= 3:
        report(args[1], args[2], args[3] if len(args) > 3 else None)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
