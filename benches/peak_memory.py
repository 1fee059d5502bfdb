"""The memory column of the benchmark report: what one call of an op allocates at its peak
beyond what was allocated before it (its outputs and workspaces), by PyTorch's caching
allocator's own count, `torch.cuda.max_memory_allocated`, as the Rust harness counts ours with
`Device::memory_stats().peak_allocated_bytes` (both in allocator blocks, rounded to 512 bytes).
"""
import torch


def peak_extra_bytes(fn):
    """Peak bytes allocated during one call of `fn` beyond those allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)
