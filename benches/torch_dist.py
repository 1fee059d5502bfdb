"""All-reduce bus bandwidth of torch.distributed (NCCL), one process per GPU started with
torch.multiprocessing (no torchrun), timed the way benches/dist.rs times the library's: the same
sizes (1 MiB to 1 GiB), dtypes and names, in place, the median over 5 repeats of the GPU time
of a burst (CUDA events on every rank, the slowest rank's), after 5 warm-up calls.

    python3 benches/torch_dist.py torch_dist.json [REGEX]

KERNELS_DIST_GPUS=N uses the first N GPUs (default all). Fewer than 2 GPUs: says so and writes
an empty list. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

import json
import os
import re
import socket
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"

import torch  # noqa: E402
import torch.distributed as torchdist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

DTYPES = [("f32", torch.float32), ("bf16", torch.bfloat16)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, port, keep, out):
    torch.cuda.set_device(rank)
    torchdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for dname, dt in DTYPES:
        for log2 in range(20, 31):
            nbytes = 1 << log2
            name = f"torch/{dname}/all_reduce/{world}gpu/{nbytes}"
            if keep is not None and not keep.search(name):
                continue
            elems = nbytes // torch.tensor([], dtype=dt).element_size()
            x = torch.ones(elems, dtype=dt, device="cuda")

            def burst(iters):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    torchdist.all_reduce(x, op=torchdist.ReduceOp.SUM)
                end.record()
                end.synchronize()
                t = torch.tensor([start.elapsed_time(end) / iters], device="cuda")
                torchdist.all_reduce(t, op=torchdist.ReduceOp.MAX)
                return t.item()

            iters = min(max((256 << 20) // nbytes, 5), 50)
            burst(5)
            times = sorted(burst(iters) for _ in range(5))
            ms = times[2]
            bus = nbytes * 2 * (world - 1) / world
            busbw = bus / ms / 1e6
            if rank == 0:
                print(f"{name:44s} {ms * 1e3:10.1f} us  algbw {nbytes / ms / 1e6:7.1f} GB/s  busbw {busbw:7.1f} GB/s",
                      flush=True)
            rows.append(dict(name=name, op=f"all_reduce_{world}gpu", dtype=dname, n=elems, direction="fwd",
                             bytes=int(bus), ms=ms, gbs=busbw))
            del x
            torch.cuda.empty_cache()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {len(rows)} records to {out}")
    torchdist.destroy_process_group()


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "/dev/null"
    keep = re.compile(sys.argv[2]) if len(sys.argv) > 2 else None
    n = torch.cuda.device_count()
    world = min(int(os.environ.get("KERNELS_DIST_GPUS", n)), n)
    if world < 2:
        print(f"torch_dist skipped: {n} GPU(s), the all-reduce needs 2 or more")
        with open(path, "w") as f:
            json.dump([], f)
        return
    print(torch.cuda.get_device_name(), f"x {world}", "torch", torch.__version__, "NCCL",
          ".".join(map(str, torch.cuda.nccl.version())), flush=True)
    mp.spawn(worker, args=(world, free_port(), keep, path), nprocs=world, join=True)


if __name__ == "__main__":
    main()
