"""The loop shared by the PyTorch baselines of the bandwidth benches (torch_elementwise.py,
torch_rows.py, torch_index.py, torch_embedding.py, torch_rope.py, torch_batchnorm.py,
torch_optim.py): each case timed with triton.testing.do_bench (warmup=25, rep=200, median),
printed as a line, and written as a JSON list of records that scripts/compare.py joins with the
Rust bench's on (op, dtype, n, direction).

Every script keeps its command line:

    python3 benches/torch_<family>.py OUT.json [REGEX]

OUT.json (default /dev/null) receives the records of the cases whose name REGEX searches (all
without it): {"name", "op", "dtype", "n", "direction", "bytes", "ms", "gbs", "peak_extra_bytes"}.
"""
import json
import re
import sys
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from triton.testing import do_bench

from peak_memory import peak_extra_bytes


class Case(NamedTuple):
    """One case: its record's fields, and `build` making the thunk to time (called only when
    the name passes the filter, so that a skipped case allocates nothing)."""
    name: str
    op: str
    dtype: str
    n: int
    direction: str
    nbytes: int
    build: Callable[[], Callable[[], object]]


def main(cases: Iterable[Case], width: int, header: tuple = ()):
    """Runs the cases as the command line says (module notes): prints the GPU and PyTorch
    version (then `header`), a line a case with its name padded to `width`, and writes the
    records."""
    path = sys.argv[1] if len(sys.argv) > 1 else "/dev/null"
    keep = re.compile(sys.argv[2]) if len(sys.argv) > 2 else None
    print(torch.cuda.get_device_name(), "torch", torch.__version__, *header, flush=True)
    rows = []
    for c in cases:
        if keep is not None and not keep.search(c.name):
            continue
        fn = c.build()
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        gbs = c.nbytes / ms / 1e6
        rows.append(dict(name=c.name, op=c.op, dtype=c.dtype, n=c.n, direction=c.direction, bytes=c.nbytes, ms=ms,
                         gbs=gbs, peak_extra_bytes=peak_extra_bytes(fn)))
        print(f"{c.name:{width}s} {ms * 1e3:10.2f} us {gbs:9.1f} GB/s", flush=True)
        del fn
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {len(rows)} records to {path}")
