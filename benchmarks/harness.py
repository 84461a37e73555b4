"""Timing and reporting helpers shared by the benchmark cases.

Every A/B comparison runs in one process, interleaved A, B, A, B, ... after warm-up,
with the garbage collector off while timing. Each sample is ``inner`` back-to-back calls
timed with ``time.perf_counter`` (``inner`` is chosen so that one sample lasts at least
``min_sample_s``). The result reports the median time of each side and the median of
the per-pair ratios A/B with a distribution-free 95 % confidence interval for that median
(order statistics of the binomial(n, 1/2) distribution), so a shared, noisy machine
shows up as a wide interval rather than a wrong number.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Comparison", "calibrate_inner", "interleaved", "machine_info", "median_ci"]


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median of ``values``.

    The interval [x_(j), x_(k)] (order statistics) with j, k the binomial(n, 1/2)
    quantiles covers the true median with probability >= ``level``; for n < 6 it is
    the full range.
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return (math.nan, math.nan)
    if n < 6:
        return (xs[0], xs[-1])
    alpha = (1.0 - level) / 2.0
    cdf = 0.0
    j = 0
    for i in range(n + 1):
        p = math.comb(n, i) / 2.0**n
        if cdf + p > alpha:
            j = i
            break
        cdf += p
    # lower bound: x_(j) (1-based j -> index j-1), symmetric upper bound x_(n-j+1)
    lo = xs[max(j - 1, 0)]
    hi = xs[min(n - j, n - 1)]
    return (lo, hi)


@dataclass
class Comparison:
    """Result of an interleaved A/B comparison (times in seconds per call)."""

    a_times: list[float]
    b_times: list[float]
    inner: int
    warmup: int
    inner_b: int | None = None  # calls per B sample when it differs from A's
    a_cpu: list[float] = field(default_factory=list)  # process CPU time per call
    b_cpu: list[float] = field(default_factory=list)
    ratios: list[float] = field(init=False)
    cpu_ratios: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.ratios = [a / b for a, b in zip(self.a_times, self.b_times, strict=True)]
        self.cpu_ratios = [
            a / b for a, b in zip(self.a_cpu, self.b_cpu, strict=True) if a > 0 and b > 0
        ]

    @property
    def a_median(self) -> float:
        return statistics.median(self.a_times)

    @property
    def b_median(self) -> float:
        return statistics.median(self.b_times)

    @property
    def ratio_median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def ratio_ci95(self) -> tuple[float, float]:
        return median_ci(self.ratios)

    def to_dict(self) -> dict:
        lo, hi = self.ratio_ci95
        return {
            "a_median_ms": self.a_median * 1e3,
            "b_median_ms": self.b_median * 1e3,
            "ratio_median": self.ratio_median,
            "ratio_of_medians": self.a_median / self.b_median,
            "ratio_ci95": [lo, hi],
            "pairs": len(self.ratios),
            # the same samples in process CPU time (time.process_time): time the process
            # spent descheduled on a shared machine does not count.
            "cpu_ratio_median": statistics.median(self.cpu_ratios) if self.cpu_ratios else None,
            "cpu_ratio_ci95": list(median_ci(self.cpu_ratios)) if self.cpu_ratios else None,
            "a_cpu_median_ms": statistics.median(self.a_cpu) * 1e3 if self.a_cpu else None,
            "b_cpu_median_ms": statistics.median(self.b_cpu) * 1e3 if self.b_cpu else None,
            "inner": self.inner,
            "inner_b": self.inner if self.inner_b is None else self.inner_b,
            "warmup": self.warmup,
        }


def _time_calls(fn: Callable[[], object], inner: int) -> tuple[float, float]:
    """(wall-clock, process CPU) seconds per call."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    t1 = time.perf_counter()
    c1 = time.process_time()
    return (t1 - t0) / inner, (c1 - c0) / inner


def calibrate_inner(fn: Callable[[], object], min_sample_s: float, cap: int = 100_000) -> int:
    """Smallest power-of-two-ish count of calls that lasts at least ``min_sample_s``."""
    inner = 1
    while True:
        t = _time_calls(fn, inner)[0] * inner
        if t >= min_sample_s or inner >= cap:
            return inner
        inner = min(cap, max(inner * 2, int(inner * min_sample_s / max(t, 1e-9) * 1.2)))


def interleaved(
    fa: Callable[[], object],
    fb: Callable[[], object],
    *,
    pairs: int,
    warmup: int = 2,
    min_sample_s: float = 0.0,
    inner: int | None = None,
    max_seconds: float | None = None,
) -> Comparison:
    """Time ``fa`` and ``fb`` interleaved (A, B, A, B, ...) after ``warmup`` calls of each.

    Args:
        fa, fb: the two variants; each call is one unit of work (a train step, one op).
        pairs: number of (A, B) samples.
        warmup: untimed calls of each, interleaved, before timing.
        min_sample_s: when ``inner`` is None, choose the calls per sample of each side so
            that one sample lasts at least this (A and B may get different counts).
        inner: calls per sample of both sides (overrides ``min_sample_s``).
        max_seconds: stop adding pairs after this long (at least 5 pairs are kept).
    """
    for _ in range(warmup):
        fa()
        fb()
    if inner is not None:
        inner_a = inner_b = inner
    elif min_sample_s > 0:
        inner_a, inner_b = calibrate_inner(fa, min_sample_s), calibrate_inner(fb, min_sample_s)
    else:
        inner_a = inner_b = 1
    a_times: list[float] = []
    b_times: list[float] = []
    a_cpu: list[float] = []
    b_cpu: list[float] = []
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    start = time.perf_counter()
    try:
        for i in range(pairs):
            for f, n, wall, cpu in ((fa, inner_a, a_times, a_cpu), (fb, inner_b, b_times, b_cpu)):
                w, c = _time_calls(f, n)
                wall.append(w)
                cpu.append(c)
            if max_seconds is not None and i >= 4 and time.perf_counter() - start > max_seconds:
                break
    finally:
        if was_enabled:
            gc.enable()
    return Comparison(a_times, b_times, inner_a, warmup, inner_b, a_cpu, b_cpu)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on Linux/macOS
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        if out.returncode == 0:
            return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def python_loop_ms() -> float:
    """Median time of a 1M-iteration pure-Python loop (3 runs): a yardstick of how fast
    (or how loaded) the machine was, for the Python-bound cases such as P5."""
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        x = 0
        for i in range(1_000_000):
            x += i
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e3, 1)


def machine_info() -> dict:
    """What the numbers were measured on."""
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        mem_gib = None
    caps = {}
    with contextlib.suppress(Exception):  # pragma: no cover
        caps = {"cpu_capability": torch.backends.cpu.get_cpu_capability()}
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_start": load_average(),
        "python_loop_1m_ms_start": python_loop_ms(),
        "git_commit": _git_commit(),
        # the interpreter relative to the repository (a result file names no machine path)
        "executable": os.path.relpath(
            sys.executable, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        ),
        **caps,
    }
