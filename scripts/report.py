#!/usr/bin/env python3
"""The README's performance tables and figure from the results data (docs/results/*.json).

    python3 scripts/report.py [RUN.json ...] [--figure docs/performance.png] [--no-figure]

Without arguments each bench family (element-wise, row operations, matrix products, optimizer)
comes from the newest run in docs/results/ that measured it, its run of record where the run
names one; with RUN.json files, from those only. Prints markdown (the tables the README carries,
each with its date, GPU, PyTorch version and commit) and writes the figure: bandwidth of the
memory-bound ops against PyTorch's and the device-to-device copy, and TFLOP/s of the matrix
products against cuBLAS. The figure needs matplotlib (`pip install matplotlib`); nothing in CI
runs this script. docs/results/README.md describes the data.
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
FAMILIES = ("elementwise", "rows", "gemm", "optim")
BIG = 1 << 28


def run_key(path):
    m = re.match(r"(\d{4}-\d\d-\d\d)([a-z]?)", os.path.basename(path))
    return (m.group(1), m.group(2)) if m else ("", "")


def load_runs(paths):
    runs = []
    for p in sorted(paths, key=run_key):
        with open(p) as f:
            r = json.load(f)
        r["_path"] = os.path.relpath(p, ROOT)
        runs.append(r)
    return runs


def pick(runs, fam):
    """(run, table) of the newest measurement of record of `fam` (a table marked `of_record`),
    else of its newest measurement: a run that measured a few cases only (a new op, an
    experiment) does not replace the last full one unless it says it is of record."""
    kind = "gemm" if fam == "gemm" else "compare"
    newest = None
    for run in reversed(runs):
        tables = [t for t in run["tables"] if t["kind"] == kind and any(r.get("family") == fam for r in t["records"])]
        if not tables:
            continue
        rec = [t for t in tables if t.get("of_record")]
        # The fullest table of the run: experiments often measure a few cases only.
        best = max(rec or tables, key=lambda t: (len(t["records"]), tables.index(t)))
        if rec:
            return run, best
        newest = newest or (run, best)
    return newest or (None, None)


def paired_for(run, table, fam):
    """The paired ratios measured in the same part of the run as `table`: {(op, dtype, dir): ratio}."""
    out = {}
    for t in run["tables"]:
        if t["kind"] == "paired" and t.get("part") == table.get("part"):
            for r in t["records"]:
                if r.get("family") == fam:
                    out.setdefault((r["op"], r["dtype"], r["dir"], r.get("shape")), r["ratio"])
    return out


def n_str(n):
    return f"2^{n.bit_length() - 1}" if n and n & (n - 1) == 0 else str(n)


def fmt(x, f="{:.1f}"):
    return "-" if x is None else f.format(x)


def source(run, table):
    commit = f", commit {run['commit']}" if run.get("commit") else ""
    return (f"{run['date']} on an {run.get('gpu') or 'unknown GPU'} (driver {run.get('driver') or '?'}, "
            f"PyTorch {run.get('torch') or '?'}{commit}; `{run['_path']}`)")


def no_kernel(r, ceiling=3000.0):
    """A case where one side runs no kernel (the gradient passed on): its GB/s is no bandwidth."""
    if "no kernel" in (r.get("note") or ""):
        return True
    return r.get("unit") == "GB/s" and max(r.get("ours") or 0, r.get("baseline") or 0) > 4 * ceiling


def elementwise_table(run, table):
    recs = [r for r in table["records"] if r["family"] == "elementwise"]
    paired = paired_for(run, table, "elementwise")
    big = [r for r in recs if r["n"] == BIG]
    lines = [f"Element-wise, {source(run, table)}. 2^28 elements ([262144, 1024]); the last column is "
             "the 2^16 ratio paired in one process (`torch_paired.py`), `-` where not paired. "
             f"Device-to-device copy: {fmt(table.get('copy_gbs'))} GB/s.", ""]
    lines.append("| op | dtype | dir | ours GB/s | PyTorch GB/s | ratio | ratio 2^16, paired |")
    lines.append("|---|---|---|---:|---:|---:|---:|")
    order = {"f32": 0, "bf16": 1, "f16": 2}
    for r in sorted(big, key=lambda r: (order.get(r["dtype"], 3), r["op"], r["dir"])):
        if no_kernel(r):
            continue
        p = paired.get((r["op"], r["dtype"], r["dir"], None))
        lines.append(f"| {r['op']} | {r['dtype']} | {r['dir']} | {fmt(r['ours'])} | {fmt(r['baseline'])} | "
                     f"{fmt(r['ratio'], '{:.3f}')} | {fmt(p, '{:.3f}')} |")
    ratios = [r["ratio"] for r in big if r["ratio"] is not None and not no_kernel(r)]
    if ratios:
        low = min((r for r in big if r["ratio"] is not None and not no_kernel(r)), key=lambda r: r["ratio"])
        lines += ["", f"{len(ratios)} cases at 2^28: median ratio {statistics.median(ratios):.3f}, lowest "
                  f"{low['ratio']:.3f} ({low['op']} {low['dtype']} {low['dir']}). Cases where PyTorch runs no "
                  "kernel (its gradient is the incoming one) are left out."]
    if paired:
        pr = sorted(paired.values())
        lines.append(f"Paired at 2^16: {len(pr)} cases, median ratio {statistics.median(pr):.3f}, "
                     f"{sum(1 for x in pr if x < 1.0)} under 1.0 by the medians.")
    return lines


def rows_table(run, table):
    recs = [r for r in table["records"] if r["family"] == "rows"]
    shapes = ["16384x4096", "65536x1024", "4096x32768", "262144x128", "64x1024"]
    ops = [("softmax", "fwd"), ("softmax", "bwd"), ("log_softmax", "fwd"), ("log_softmax", "bwd"),
           ("layer_norm", "fwd"), ("layer_norm", "bwd"), ("rms_norm", "fwd"), ("rms_norm", "bwd")]
    idx = {(r["op"], r["dir"], r.get("shape"), r["dtype"]): r for r in recs}
    lines = [f"Row operations, {source(run, table)}. f32 GB/s (ratio to PyTorch eager):", ""]
    lines.append("| op | " + " | ".join(s.replace("x", " x ") for s in shapes) + " |")
    lines.append("|---|" + "---|" * len(shapes))
    for op, d in ops:
        cells = []
        for s in shapes:
            r = idx.get((op, d, s, "f32"))
            cells.append("-" if r is None else f"{r['ours']:.0f} ({r['ratio']:.2f}x)")
        if any(c != "-" for c in cells):
            lines.append(f"| {op.replace('_', ' ')} {d} | " + " | ".join(cells) + " |")
    other = [r for r in recs if r["op"] not in {o for o, _ in ops} and r["dtype"] == "f32"]
    if other:
        lines += ["", "| op | shape | dtype | dir | ours GB/s | PyTorch GB/s | ratio |", "|---|---|---|---|---:|---:|---:|"]
        for r in sorted(other, key=lambda r: (r["op"], -(r["n"] or 0), r["dir"])):
            lines.append(f"| {r['op']} | {r.get('shape', '-')} | {r['dtype']} | {r['dir']} | {fmt(r['ours'])} | "
                         f"{fmt(r['baseline'])} | {fmt(r['ratio'], '{:.3f}')} |")
    ratios = [r["ratio"] for r in recs if r["ratio"] is not None]
    if ratios:
        low = min((r for r in recs if r["ratio"] is not None), key=lambda r: r["ratio"])
        lines += ["", f"{len(ratios)} cases (f32, bf16): median ratio {statistics.median(ratios):.3f}, lowest "
                  f"{low['ratio']:.3f} ({low['op']} {low.get('shape', '')} {low['dtype']} {low['dir']})."]
    return lines


def gemm_name(r):
    op, shape = r["op"], r["shape"].replace("x", " x ")
    prec = "3xTF32" if "3xtf32" in op else "f32 FMA"
    if r.get("dtype") in ("bf16", "f16"):
        prec = r["dtype"]
        what = "gelu(x @ W^T + b)" if op.startswith("linear") else f"GEMM {op.rsplit('_', 1)[-1].upper()}"
        return f"{what}, {shape}", prec
    layout = op.rsplit("_", 1)[-1].upper()
    what = "relu(x @ W^T + b)" if op.startswith("linear") else f"GEMM {layout}"
    return f"{what}, {shape}", prec


def gemm_table(run, table):
    half = any(r.get("dtype") in ("bf16", "f16") for r in table["records"])
    blas = "`cublasGemmEx`, f32 accumulation" if half else "`cublasSgemm`, FP32"
    lines = [f"Matrix products ({'bf16, f16' if half else 'f32'}), {source(run, table)}. TFLOP/s; ratio = cuBLAS "
             f"({blas}) time / ours:", ""]
    lines.append("| product (m x n x k) | precision | ours | cuBLAS | ratio |")
    lines.append("|---|---|---:|---:|---:|")
    for r in table["records"]:
        name, prec = gemm_name(r)
        lines.append(f"| {name} | {prec} | {fmt(r['ours'])} | {fmt(r['baseline'])} | {fmt(r['ratio'], '{:.3f}')} |")
    return lines


def optim_table(run, table):
    lines = [f"Optimizer, {source(run, table)}. One AdamW step on 2^24 parameters against "
             "`torch.optim.AdamW(fused=True)`; GB/s counts our traffic (f32 moments):", ""]
    lines.append("| dtype | ours GB/s | PyTorch GB/s | ratio |")
    lines.append("|---|---:|---:|---:|")
    for r in table["records"]:
        if r["family"] == "optim":
            lines.append(f"| {r['dtype']} | {fmt(r['ours'])} | {fmt(r['baseline'])} | {fmt(r['ratio'], '{:.3f}')} |")
    return lines


def figure(picked, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(18, 17), constrained_layout=True)
    gs = fig.add_gridspec(3, 2, height_ratios=[1.0, 1.0, 1.15])
    ours_c, torch_c = "#1f6fb4", "#f28e2b"
    ew_run, ew = picked.get("elementwise", (None, None))
    ceiling = ew.get("copy_gbs") if ew else None

    def bars(ax, recs, label_of, title, baseline_name="PyTorch", unit="GB/s", ceiling=None):
        recs = list(recs)
        x = range(len(recs))
        w = 0.4
        ax.bar([i - w / 2 for i in x], [r["ours"] for r in recs], w, color=ours_c, label="ours")
        ax.bar([i + w / 2 for i in x], [r["baseline"] or 0 for r in recs], w, color=torch_c, label=baseline_name)
        if ceiling:
            ax.axhline(ceiling, color="black", ls="--", lw=1, label=f"device copy ({ceiling:.0f} GB/s)")
        ax.set_xticks(list(x))
        ax.set_xticklabels([label_of(r) for r in recs], rotation=60, ha="right", fontsize=9)
        ax.set_xlim(-0.7, len(recs) - 0.3)
        ax.set_ylabel(unit)
        top = max([r["ours"] for r in recs] + [r["baseline"] or 0 for r in recs] + [ceiling or 0])
        ax.set_ylim(0, top * 1.22)
        ax.set_title(title, fontsize=12)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(loc="upper center", ncol=3, fontsize=9, framealpha=0.95)

    if ew:
        big = [r for r in ew["records"] if r["n"] == BIG and not no_kernel(r) and r["ours"] and r["baseline"]]
        for col, d in enumerate(("fwd", "bwd")):
            ax = fig.add_subplot(gs[col, :])
            # A backward that hands an incoming gradient on moves less than its count says: left out.
            cap = 1.3 * (ceiling or 3000.0)
            sel = sorted((r for r in big if r["dir"] == d and max(r["ours"], r["baseline"]) < cap), key=lambda r: (r["dtype"] != "f32", r["dtype"], r["op"]))
            bars(ax, sel, lambda r: r["op"] if r["dtype"] == "f32" else f"{r['op']} {r['dtype']}",
                 f"Element-wise {'forward' if d == 'fwd' else 'backward'}, 2^28 elements ({ew_run['date']})",
                 ceiling=ceiling)
    rw_run, rw = picked.get("rows", (None, None))
    if rw:
        keep = ("16384x4096", "4096x32768")
        sel = [r for r in rw["records"] if r.get("shape") in keep and r["dtype"] == "f32" and r["ours"] and r["baseline"]]
        sel.sort(key=lambda r: (r["op"], r["dir"], keep.index(r["shape"])))
        ax = fig.add_subplot(gs[2, 0])
        bars(ax, sel, lambda r: f"{r['op']} {r['dir']} {r['shape'].replace('x', ' x ')}",
             f"Row operations, f32 ({rw_run['date']})", ceiling=ceiling)
    gm_run, gm = picked.get("gemm", (None, None))
    if gm:
        ax = fig.add_subplot(gs[2, 1])
        half = any(r.get("dtype") in ("bf16", "f16") for r in gm["records"])
        # A run of the 16-bit products: its bf16 cases (f16's are the same shapes).
        recs = [r for r in gm["records"] if not half or r.get("dtype") == "bf16"]
        recs.sort(key=lambda r: ("3xtf32" in r["op"], r["op"].startswith("linear")))
        bars(ax, recs, lambda r: ", ".join(gemm_name(r)[::-1]).replace("relu(x @ W^T + b)", "linear+relu"),
             f"Matrix products, {'bf16' if half else 'f32'} ({gm_run['date']})",
             baseline_name="cuBLAS (cublasGemmEx)" if half else "cuBLAS (FP32)", unit="TFLOP/s")
    fig.suptitle(f"kernels against PyTorch and cuBLAS on an {(ew_run or gm_run or {}).get('gpu', 'unknown GPU')}",
                 fontsize=14)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="run files (default: docs/results/*.json)")
    ap.add_argument("--figure", default=os.path.join(ROOT, "docs", "performance.png"))
    ap.add_argument("--no-figure", action="store_true")
    a = ap.parse_args()
    paths = a.runs or glob.glob(os.path.join(RESULTS, "*.json"))
    if not paths:
        sys.exit(f"no run files in {RESULTS}")
    runs = load_runs(paths)
    picked = {}
    for fam in FAMILIES:
        run, table = pick(runs, fam)
        if table is not None:
            picked[fam] = (run, table)
    makers = {"elementwise": elementwise_table, "rows": rows_table, "gemm": gemm_table, "optim": optim_table}
    out = []
    for fam in FAMILIES:
        if fam in picked:
            out += makers[fam](*picked[fam]) + [""]
    print("\n".join(out).rstrip())
    if not a.no_figure:
        figure(picked, a.figure)
        print(f"\n(figure: {os.path.relpath(a.figure, ROOT)})", file=sys.stderr)


if __name__ == "__main__":
    main()
