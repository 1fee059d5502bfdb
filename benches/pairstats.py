"""The difference of paired timings, for `torch_paired.py` and `ncu_small.py`.

Why: both timers come in steps (CUDA events: 32 ns on the H100; ncu's `gpu__time_duration`:
16 or 32 ns), one step being 0.5-1% of a launch at 2^16 elements. A median of one library's times
lands on a whole step, so two kernels of the same speed show ratios of 0.99 or 1.01 by which
step each median falls on, and the count of cases under 1.0x moves from run to run. Here the
pairs' differences (PyTorch's time minus ours, each pair timed back to back on the same inputs)
are sorted, trimmed of their outer tenth on each side (the launches that met a stall) and
averaged: the steps average out below one step. The standard error of that trimmed mean is
Tukey and McLaughlin's (from the winsorized variance). A case is *slower* only where the
difference stays below zero by more than two standard errors; otherwise the two are level
within what the timer can tell apart.
"""
import math
import statistics

TRIM = 0.1


def trimmed_difference(ours, theirs, trim=TRIM):
    """(mean, standard error) of the trimmed differences `theirs[i] - ours[i]` (above 0: ours is
    faster), in the samples' unit; the standard error is NaN with fewer than three pairs."""
    d = sorted(t - o for o, t in zip(ours, theirs))
    n = len(d)
    if n == 0:
        return math.nan, math.nan
    g = int(n * trim)
    core = d[g:n - g]
    mean = statistics.fmean(core)
    if n < 3:
        return mean, math.nan
    winsorized = [core[0]] * g + core + [core[-1]] * g
    se = statistics.stdev(winsorized) / ((1 - 2 * g / n) * math.sqrt(n))
    return mean, se


def slower(mean, se):
    """Whether ours is slower beyond two standard errors."""
    return mean + 2 * se < 0
