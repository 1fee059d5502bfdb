#!/usr/bin/env python3
"""Compares the element-wise bench with its PyTorch baselines.

    KERNELS_BENCH_JSON=ours.json cargo bench --bench elementwise
    python3 benches/torch_elementwise.py torch.json
    python3 scripts/compare.py ours.json torch.json [REFERENCE.json] [--json RUN.json]

(Likewise for the `rows`, `optim`, `rope` and `embedding` benches with benches/torch_rows.py,
torch_optim.py, torch_rope.py and torch_embedding.py.)

Prints a markdown table joined on (op, dtype, n, direction): our GB/s, PyTorch's GB/s, the ratio
by time (PyTorch's median time over ours: above 1 means we are faster), and our GB/s as a
percentage of our own device-to-device copy of the largest size (the memory ceiling), and the
peak MiB one call allocates beyond what was allocated before it, ours and PyTorch's (each
allocator's own count, where the records carry `peak_extra_bytes`). Rows are
flagged when the ratio is under 0.97 at the large size (2^28) or under 1.0 at the small size;
the fused act(x * scale + bias) rows must be at least 2x faster than PyTorch's three kernels.
Both files must come from one run on one machine: compare ratios, never absolute numbers
across runs. REFERENCE.json (optional): further PyTorch timings of the same run, records of
{"name", "ms", "gbs"}, listed after the table for context. --json RUN.json appends the table to
that run file (created if absent) in the format of docs/results/ (benches/results_json.py), which
scripts/report.py reads. Always exits 0.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# results_json.py sits beside this script in a bundle, in benches/ in the repository.
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benches")]
import results_json  # noqa: E402

MIB = 1024.0 * 1024.0
BIG_MIN_RATIO = 0.97
SMALL_MIN_RATIO = 1.0
FUSED_MIN_SPEEDUP = 2.0
# PyTorch runs no kernel for these gradients (they alias the incoming gradient), so its time is
# only launch/autograd overhead while we write fresh outputs: read those ratios with that in mind.
TORCH_ALIASES = {("add", "bwd"), ("add_scalar", "bwd"), ("sub_scalar", "bwd"), ("add_row", "bwd")}


def load(path):
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        sys.exit(f"{path}: expected a JSON array of records")
    return data


def key(r):
    return (r["op"], r["dtype"], int(r["n"]), r["direction"])


def n_str(n):
    n = int(n)
    if n > 0 and n & (n - 1) == 0:
        return f"2^{n.bit_length() - 1}"
    return str(n)


def num(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def main():
    args = sys.argv[1:]
    out_json = None
    if "--json" in args:
        i = args.index("--json")
        if i + 1 >= len(args):
            print(__doc__)
            return
        out_json = args[i + 1]
        del args[i:i + 2]
    if len(args) < 2:
        print(__doc__)
        return
    ours = {key(r): r for r in load(args[0])}
    torch = {key(r): r for r in load(args[1])}
    reference = load(args[2]) if len(args) > 2 else []

    sizes = sorted({k[2] for k in list(ours) + list(torch)})
    big = sizes[-1] if sizes else 0

    def copy_gbs(recs):
        r = recs.get(("copy", "f32", big, "fwd"))
        return r["gbs"] if r and r.get("gbs") else None

    ceiling = copy_gbs(ours)
    ceiling_src = "ours"
    if ceiling is None:
        ceiling, ceiling_src = copy_gbs(torch), "PyTorch's"
    print(f"Copy ceiling: {num(ceiling)} GB/s ({ceiling_src} device-to-device copy of {n_str(big)} f32)")
    if copy_gbs(torch) is not None and copy_gbs(ours) is not None:
        print(f"PyTorch's copy (clone) of the same: {num(copy_gbs(torch))} GB/s")
    print()

    print("| op | dtype | n | dir | ours GB/s | PyTorch GB/s | ratio (time) | % of copy | "
          "ours peak MiB | PyTorch peak MiB | note |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    flagged, fused, records = [], [], []
    order = sorted(set(ours) | set(torch), key=lambda k: (-k[2], k[1] != "f32", k[1], k[0], k[3]))
    for k in order:
        op, dt, n, d = k
        o, t = ours.get(k), torch.get(k)
        og = o["gbs"] if o else None
        tg = t["gbs"] if t else None
        # The memory column: peak bytes one call allocates beyond what was allocated before it.
        om = o.get("peak_extra_bytes") / MIB if o and o.get("peak_extra_bytes") is not None else None
        tm = t.get("peak_extra_bytes") / MIB if t and t.get("peak_extra_bytes") is not None else None
        ratio = t["ms"] / o["ms"] if o and t and o.get("ms") and t.get("ms") else None
        pct = 100.0 * og / ceiling if og and ceiling else None
        notes = []
        if o is None:
            notes.append("missing in ours")
        if t is None:
            notes.append("missing in PyTorch")
        if ratio is not None:
            is_fused = op.startswith("scale_bias_")
            limit = BIG_MIN_RATIO if n >= big else SMALL_MIN_RATIO
            if is_fused:
                fused.append((k, ratio))
                limit = max(limit, FUSED_MIN_SPEEDUP)
                notes.append(f"fused speedup {ratio:.2f}x")
            if ratio < limit:
                notes.append(f"**FLAG** < {limit:g}")
                flagged.append((k, ratio, limit))
            if (op, d) in TORCH_ALIASES:
                notes.append("PyTorch runs no kernel")
        kept = [x for x in notes if not x.startswith(("**FLAG**", "fused speedup"))]
        records.append(results_json.record(op, dt, n, d, "GB/s", og, tg, ratio, pct_of_copy=pct,
                                           peak_mib=om, baseline_peak_mib=tm, note="; ".join(kept) or None))
        print(
            f"| {op} | {dt} | {n_str(n)} | {d} | {num(og)} | {num(tg)} | {num(ratio, '{:.3f}')} | "
            f"{num(pct)} | {num(om, '{:.3g}')} | {num(tm, '{:.3g}')} | {'; '.join(notes)} |"
        )

    print()
    if fused:
        print("Fused act(x * scale + bias) vs PyTorch's eager three-kernel sequence "
              f"(target >= {FUSED_MIN_SPEEDUP:g}x):")
        for (op, dt, n, d), r in fused:
            mark = "ok" if r >= FUSED_MIN_SPEEDUP else "BELOW TARGET"
            print(f"- {op} {dt} {n_str(n)} {d}: {r:.2f}x ({mark})")
        print()
    print(f"{len(flagged)} flagged row(s) (ratio under {BIG_MIN_RATIO} at {n_str(big)}, "
          f"under {SMALL_MIN_RATIO} below it, under {FUSED_MIN_SPEEDUP}x for the fused op).")
    for (op, dt, n, d), r, lim in flagged:
        print(f"- {op} {dt} {n_str(n)} {d}: {r:.3f} (< {lim:g})")

    if reference:
        print()
        print("PyTorch's reference timings (same run):")
        for a in reference:
            print(f"- {a['name']}: {a['ms'] * 1e3:.1f} us, {a['gbs']:.1f} GB/s")

    if out_json:
        fams = sorted({r["family"] for r in records})
        results_json.add_table(out_json, "compare", records, title=f"{', '.join(fams)} against PyTorch (compare.py)",
                               copy_gbs=ceiling)
        print(f"\nappended {len(records)} records to {out_json}")


if __name__ == "__main__":
    main()
