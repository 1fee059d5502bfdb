#!/usr/bin/env python3
"""The element-wise bench against PyTorch over several process pairs, for sizes where one run's
ratio is a draw, not a measurement.

At 2^16 elements both libraries take 4.5-6 us a launch, and a case's median lands near one of two
values (about 4.7 or 5.4 us on the H100) in either library. This script runs the bench and its
PyTorch baselines in ROUNDS alternating process pairs (ours, PyTorch, ours, PyTorch, ...) on one
machine and reports, per case, the median over the processes of each side's median time, their
ratio, and the spread of the per-pair ratios.

What it shows (docs/worklog.md, 2026-11-24f): which of the two levels a case gets is set
by where its buffers lie (ours: the same in every process that runs the same cases), not by its
kernel's code, so more processes narrow each case's figure without removing that offset. Read
the table as what this method measures, not as the kernels' own ratio.

    python3 .bundle/repeats.py run [--rounds 5] [--filter REGEX] [--out DIR] [--json RUN.json]
    python3 .bundle/repeats.py report DIR [--json RUN.json]

`run` (on the GPU machine, from the repository root) uses the bundle's
`bin/benches/elementwise` and `torch_elementwise.py`, both restricted by REGEX (default: the 2^16
cases), and writes DIR/ours-K.json and DIR/torch-K.json (K = 1..ROUNDS, with their logs), then the report;
`report` prints the report of such a folder again. Ratio = PyTorch's time / ours (above 1: we are
faster). A case is flagged when the ratio of the medians is under 1.0. Cases where PyTorch runs
no kernel (its gradient aliases the incoming one) and the fused op are listed apart, as in
compare.py. --json RUN.json appends the table to that run file (created if absent) in the format
of docs/results/ (benches/results_json.py): kind "repeats", times in us.
"""
import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# results_json.py sits beside this script in a bundle, in benches/ in the repository.
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benches")]
import results_json  # noqa: E402

# As compare.py: PyTorch runs no kernel for these gradients.
TORCH_ALIASES = {("add", "bwd"), ("add_scalar", "bwd"), ("sub_scalar", "bwd"), ("add_row", "bwd")}
# PyTorch's backward composed by autograd at 2^16 measures its host path (8-230 us against 4.6-6.8
# for a backward kernel of its own: docs/worklog.md, 2026-11-24d); above this ratio a case is listed apart.
HOST_BOUND_RATIO = 2.0


def key(r):
    return (r["op"], r["dtype"], int(r["n"]), r["direction"])


def load(path):
    with open(path) as f:
        return {key(r): float(r["ms"]) for r in json.load(f)}


def unpack_bundle():
    if not os.path.isdir(os.path.join(HERE, "bin")) and os.path.isfile(os.path.join(HERE, "bin.tar.xz")):
        subprocess.run(["tar", "-xJf", os.path.join(HERE, "bin.tar.xz"), "-C", HERE], check=True)


def run(args):
    unpack_bundle()
    bench = os.path.join(HERE, "bin", "benches", "elementwise")
    torch_py = os.path.join(HERE, "torch_elementwise.py")
    for p in (bench, torch_py):
        if not os.path.exists(p):
            sys.exit(f"missing {p}: run from a bundle made by `cargo xtask gpu-bundle`")
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, KERNELS_REQUIRE_GPU="1")
    for k in range(1, args.rounds + 1):
        ours = os.path.join(args.out, f"ours-{k}.json")
        torch = os.path.join(args.out, f"torch-{k}.json")
        for p in (ours, torch):
            if os.path.exists(p):
                os.remove(p)
        print(f"== round {k} of {args.rounds}: ours", flush=True)
        # Shorter criterion windows than the full bench's: at 2^16 a run is ~0.1 ms with its
        # flush, so 0.3 s is thousands of runs.
        cmd = [bench, "--bench", args.filter, "--warm-up-time", "0.1", "--measurement-time", "0.3"]
        with open(ours.replace(".json", ".log"), "w") as log:
            r = subprocess.run(cmd, env=dict(env, KERNELS_BENCH_JSON=ours), stdout=log, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            sys.exit(f"the bench failed (exit status {r.returncode})")
        print(f"== round {k} of {args.rounds}: PyTorch", flush=True)
        with open(torch.replace(".json", ".log"), "w") as log:
            r = subprocess.run([sys.executable, torch_py, torch, args.filter], stdout=log, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            sys.exit(f"torch_elementwise.py failed (exit status {r.returncode})")
    report(args.out, args.json)


def n_str(n):
    return f"2^{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else str(n)


def report(folder, out_json=None):
    ours_files = sorted(glob.glob(os.path.join(folder, "ours-*.json")))
    pairs = []
    for o in ours_files:
        t = o.replace("ours-", "torch-")
        if os.path.exists(t):
            pairs.append((load(o), load(t)))
    if not pairs:
        sys.exit(f"{folder}: no ours-K.json / torch-K.json pairs")
    keys = sorted(set.intersection(*(set(o) & set(t) for o, t in pairs)), key=lambda k: (k[1] != "f32", k[1], k[2], k[0], k[3]))
    print(f"{len(pairs)} process pairs from {folder}; times are medians of each process's median (us)\n")
    print("| op | dtype | n | dir | ours (us) | PyTorch (us) | ratio of medians | per-pair ratios (min-max) | pairs ours faster | note |")
    print("|---|---|---|---|---:|---:|---:|---|---:|---|")
    flagged, apart, records = [], [], []
    for k in keys:
        o = [p[0][k] * 1e3 for p in pairs]
        t = [p[1][k] * 1e3 for p in pairs]
        mo, mt = statistics.median(o), statistics.median(t)
        ratio = mt / mo
        per = [b / a for a, b in zip(o, t)]
        faster = sum(1 for r in per if r >= 1.0)
        op, dt, n, d = k
        note = ""
        if (op, d) in TORCH_ALIASES:
            note = "PyTorch runs no kernel"
        elif op.startswith("scale_bias_"):
            note = "fused: target 2x"
        elif min(per) > HOST_BOUND_RATIO:
            note = "PyTorch's autograd-composed backward"
        if note:
            apart.append(k)
        elif ratio < 1.0:
            flagged.append((k, ratio))
            note = "**under 1.0**"
        print(f"| {op} | {dt} | {n_str(n)} | {d} | {mo:.2f} | {mt:.2f} | {ratio:.3f} | {min(per):.3f}-{max(per):.3f} | {faster}/{len(per)} | {note} |")
        records.append(results_json.record(op, dt, n, d, "us", mo, mt, ratio, pair_ratios=f"{min(per):.3f}-{max(per):.3f}",
                                           pairs_faster=faster, pairs=len(per), note=note.strip("* ") or None))
    compared = len(keys) - len(apart)
    print(f"\n{compared} cases compared kernel to kernel ({len(apart)} listed apart: aliases, the fused op, autograd-composed backward);")
    print(f"{len(flagged)} with the ratio of medians under 1.0" + (":" if flagged else "."))
    for (op, dt, n, d), r in flagged:
        print(f"- {op} {dt} {n_str(n)} {d}: {r:.3f}")
    if out_json:
        results_json.add_table(out_json, "repeats", records, title=f"medians over {len(pairs)} process pairs (repeats.py)")
        print(f"appended {len(records)} records to {out_json}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--filter", default="/65536$", help="regex over the case names (both benches)")
    r.add_argument("--out", default=os.environ.get("OUT", "repeats"))
    r.add_argument("--json", default=None, help="append the table to this run file (docs/results/ format)")
    p = sub.add_parser("report")
    p.add_argument("folder")
    p.add_argument("--json", default=None, help="append the table to this run file (docs/results/ format)")
    a = ap.parse_args()
    if a.cmd == "run":
        if a.rounds < 1:
            sys.exit("--rounds must be at least 1")
        re.compile(a.filter)
        run(a)
    else:
        report(a.folder, a.json)


if __name__ == "__main__":
    main()
