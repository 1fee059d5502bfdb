"""The results format of docs/results/ (one JSON file per run), shared by the benchmark scripts.

A run is one sitting on one GPU: {"run", "date", "gpu", "driver", "torch", "commit", "commits",
"source", "tables": [...]}. Each table is one measurement of that run: {"kind", "part", "title",
"section", "baseline", "of_record"?, "copy_gbs"?, "records": [...]} where kind is "compare"
(scripts/compare.py: separate processes, do_bench's method), "paired" (benches/torch_paired.py),
"ncu" (benches/ncu_small.py), "repeats" (scripts/repeats.py), "gemm" (benches/gemm.rs against
cuBLAS), "reference" (PyTorch alone) or "table" (anything else, kept as "columns" and "rows").
A record is one case: {"family": "elementwise" | "rows" | "optim" | "gemm", "op", "dtype", "n",
"shape"?, "dir", "unit": "GB/s" | "us" | "ns" | "TFLOP/s", "ours", "baseline", "ratio", ...}
with ratio = the baseline's time / ours (above 1: ours is faster). docs/results/README.md
describes the fields; scripts/report.py reads them.
"""
import datetime
import json
import os
import subprocess

ROW_OPS = ("softmax", "log_softmax", "layer_norm", "rms_norm", "cross_entropy", "sum", "sum_rows",
           "transpose", "argmax", "max", "mean")


def family(op):
    """The bench family of an op name as the benches write it (`softmax@64x1024`, `adamw`, ...)."""
    if op.startswith("adamw"):
        return "optim"
    if op.startswith(("gemm", "sgemm", "linear")):
        return "gemm"
    if "@" in op or op.split("@")[0] in ROW_OPS:
        return "rows"
    return "elementwise"


def record(op, dtype, n, direction, unit, ours, baseline, ratio, **extra):
    """One case. `op` may carry its shape as `op@RxC`; it is split into op and shape."""
    shape = None
    if "@" in op:
        op, shape = op.split("@", 1)
    r = dict(family=family(op if shape is None else f"{op}@{shape}"), op=op, dtype=dtype, n=n, dir=direction,
             unit=unit, ours=ours, baseline=baseline, ratio=ratio)
    if shape is not None:
        r["shape"] = shape
    r.update({k: v for k, v in extra.items() if v is not None})
    # Four decimals are finer than any of these measurements.
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}


def environment():
    """GPU name, driver, PyTorch version and commit, as far as this process can tell."""
    env = {"gpu": None, "driver": None, "torch": None, "commit": os.environ.get("KERNELS_COMMIT")}
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            env["driver"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    if env["commit"] is None:
        try:
            out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
            if out.returncode == 0:
                env["commit"] = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    return env


def new_run(run_id=None, date=None, **meta):
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    run = {"run": run_id or date, "date": date}
    env = environment()
    env.update({k: v for k, v in meta.items() if v is not None})
    run.update(env)
    run["tables"] = []
    return run


def add_table(path, kind, records, title=None, baseline="PyTorch eager", append=True, **extra):
    """Appends one table to the run file at `path` (created for this machine if absent, or
    replaced where `append` is false)."""
    fresh = not append or not os.path.exists(path) or os.path.getsize(path) == 0
    run = new_run() if fresh else load(path)
    t = {"kind": kind, "part": None, "title": title, "section": None, "baseline": baseline}
    t.update({k: v for k, v in extra.items() if v is not None})
    t["records"] = records
    run["tables"].append(t)
    write(path, run)
    return run


def load(path):
    with open(path) as f:
        run = json.load(f)
    if not isinstance(run, dict) or "tables" not in run:
        raise ValueError(f"{path}: not a run file (expected an object with 'tables')")
    return run


def dumps(run):
    """Indented JSON with one record (or table row) a line, so that diffs stay readable."""
    head = {k: v for k, v in run.items() if k != "tables"}
    out = ["{"]
    for k, v in head.items():
        out.append(f" {json.dumps(k)}: {json.dumps(v)},")
    out.append(' "tables": [')
    tables = run.get("tables", [])
    for i, t in enumerate(tables):
        out.append("  {")
        items = [(k, v) for k, v in t.items() if k not in ("records", "rows")]
        for k, v in items:
            out.append(f"   {json.dumps(k)}: {json.dumps(v)},")
        for key in ("rows", "records"):
            if key in t:
                rows = t[key]
                last = key == "records" or "records" not in t
                if not rows:
                    out.append(f'   "{key}": []' + ("" if last else ","))
                    continue
                out.append(f'   "{key}": [')
                for j, r in enumerate(rows):
                    out.append("    " + json.dumps(r) + ("," if j + 1 < len(rows) else ""))
                out.append("   ]" + ("" if last else ","))
        out.append("  }" + ("," if i + 1 < len(tables) else ""))
    out.append(" ]")
    out.append("}")
    return "\n".join(out) + "\n"


def write(path, run):
    with open(path, "w") as f:
        f.write(dumps(run))
