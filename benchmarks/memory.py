"""P6 worker: peak memory of one train step, in a process of its own.

``python -m benchmarks.memory --net convnet4 --variant bnswap|stock [--dtype bfloat16]``
prints one JSON line: ``aten_peak_bytes`` (peak of ATen CPU allocations during one
train step above what was allocated before it, from the profiler's allocation events:
tracemalloc cannot see ATen's allocator), ``maxrss_kib`` (the process's peak RSS, VmHWM).
"""

from __future__ import annotations

import argparse
import json
import resource

import torch


def aten_peak_bytes(fn) -> int:
    """Peak of the running sum of ATen CPU allocations/frees while ``fn()`` runs."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocs: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    allocs.sort()
    cur = peak = 0
    for _, size in allocs:
        cur += size
        peak = max(peak, cur)
    return peak


def peak_rss_kib() -> int:
    """This process's peak resident set size, KiB: ``VmHWM`` from /proc (that of this
    program's address space), else ``ru_maxrss`` (which on Linux also counts the RSS of
    the parent at fork time, before exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--net", required=True)
    ap.add_argument("--variant", choices=("bnswap", "stock"), required=True)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from benchmarks.cases import _pair, train_step

    swapped, stock, x, y = _pair(args.net)
    model = swapped if args.variant == "bnswap" else stock
    del swapped, stock
    step = train_step(model, x, y, args.dtype)
    step()  # warm-up: optimizer state, allocator caches
    peak = aten_peak_bytes(step)
    rss = peak_rss_kib()
    print(
        json.dumps(
            {
                "net": args.net,
                "variant": args.variant,
                "dtype": args.dtype,
                "aten_peak_bytes": peak,
                "maxrss_kib": rss,
            }
        )
    )


if __name__ == "__main__":
    main()
