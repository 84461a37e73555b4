"""Synchronized BatchNorm against the cost of its collectives: DDP train steps on gloo ranks
(CPU, one torch thread a rank), interleaved in one run.

Variants, each a DDP train step of the same net and batch (DDP defaults: gradient
buckets, ``broadcast_buffers=True``):

* ``unsync``: unsynchronized bnswap (``bnswap.convert(model)``);
* ``floor``: the unsynchronized step with the synchronized step's collectives at the same
  points and nothing else: a forward pre-hook on each BatchNorm layer doing its all_gather
  of 2C + 1 floats, a hook on the layer's output gradient doing its backward collective
  of 2C floats (the calls ``bnswap.sync`` itself makes), no synchronization maths. No
  exact synchronization can cost less than this;
* ``sync``: bnswap's synchronized layers (``convert(model, sync_batchnorm=True)``);
* ``collectives``: those collectives alone, back to back (no model);
* what ``bnswap.sync`` did not keep, each the synchronized step with one change: the
  other backward collective (``all_reduce`` of the sums, or ``all_gather``), functional
  collectives in eager instead of plain c10d calls, and the layers on a process group of
  their own (apart from DDP's gradient buckets on WORLD); reported per round as its
  step time over the synchronized step's.

Each round runs every variant once, in an order rotated from round to round, on every rank
(the collectives pair up); rank 0 reports medians and, per round, the synchronized step's
extra time over ``unsync`` as a multiple of the floor's extra (wall and process CPU time:
``time.process_time``, every thread of the process), and sync / floor CPU time, each a
median with its distribution-free 95 % interval (``benchmarks/harness.py``). Goal: extra <=
1.1x the floor's extra, CPU time <= 1.1x the floor's. Then a profiler breakdown of
a few steps of each variant: the synchronized layers' forward and backward split into
collectives and waiting (``bnswap.sync.all_gather`` / ``all_reduce`` spans: the c10d call
and the wait for the slowest rank), statistics, normalization, the backward's sums and
input gradient, and the rest (Chan's combination, packing, Python); stock BatchNorm's
kernels of ``unsync`` and the floor's hooks beside them.

The full measurement (the figures in ``benchmarks/results/sync.md`` and the README's "Many
processes" section; about 5 minutes on a 2-core machine: 318 s with other jobs loading it)::

    python -m benchmarks.bench_sync

``--quick`` (a 3-layer net, 2 ranks, 3 rounds, under a minute) checks that it runs.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("unsync", "floor", "sync", "collectives")


def nets() -> dict:
    from bnswap.app.models import MobileNetV2, ResNet18

    # name -> (factory, per-rank batch, channels, H=W)
    return {
        # the `bnswap train` main job's model and batch (global 64 = 2 x 32), 1x16x16 digits
        "mainjob": (lambda: MobileNetV2(num_classes=10, in_channels=1, width_mult=0.5), 32, 1, 16),
        # ResNet-18 at small size: width 16, 3x32x32, 16 per rank
        "resnet18s": (lambda: ResNet18(num_classes=10, in_channels=3, width=16), 16, 3, 32),
        # --quick: 3 conv + BatchNorm layers
        "tiny": (
            lambda: nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.Conv2d(8, 16, 3, padding=1),
                nn.BatchNorm2d(16),
                nn.ReLU(),
                nn.Conv2d(16, 16, 3, padding=1),
                nn.BatchNorm2d(16),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(16, 10),
            ),
            8,
            3,
            8,
        ),
    }


def bn_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def add_floor_hooks(model: nn.Module, group, world: int) -> nn.Module:
    """``model`` (unsynchronized) with each BatchNorm layer's collectives and nothing
    else: its all_gather of 2C + 1 floats before its forward, its backward collective of
    2C floats when its output gradient is ready; ``bnswap.sync``'s own calls."""
    from bnswap import _global_batch

    for m in bn_layers(model):
        c = m.num_features

        def pre(mod, args, c=c):
            _global_batch._all_gather(args[0].new_zeros(2 * c + 1), group, world, False)

        def backward_collective(grad, c=c) -> None:
            _global_batch._sum_over_ranks(grad.new_zeros(2 * c), group, world, False)

        def post(mod, args, out):
            if out.requires_grad:
                out.register_hook(backward_collective)

        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    return model


def collectives_alone(channels: list[int], group, world: int):
    """The synchronized step's collectives back to back: the all_gathers in forward
    order, the backward collectives in reverse."""
    from bnswap import _global_batch

    def run() -> None:
        for c in channels:
            _global_batch._all_gather(torch.zeros(2 * c + 1), group, world, False)
        for c in reversed(channels):
            _global_batch._sum_over_ranks(torch.zeros(2 * c), group, world, False)

    return run


def count_collectives(step) -> dict[str, int]:
    """Collectives one step issues, by kind (the profiler's ``gloo:*`` events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("gloo:"):
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


def rounds(steps: dict, n: int, warmup: int) -> dict:
    """Every step once a round, ``n`` rounds after ``warmup``, the order rotated each
    round (the same on every rank); wall and process CPU seconds per call."""
    names = list(steps)
    for _ in range(warmup):
        for k in names:
            steps[k]()
    wall = {k: [] for k in names}
    cpu = {k: [] for k in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(n):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                c0, t0 = time.process_time(), time.perf_counter()
                steps[k]()
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
    finally:
        gc.enable()
    return {"wall": wall, "cpu": cpu}


def _median_ci(xs: list[float]) -> dict:
    from benchmarks.harness import median_ci

    lo, hi = median_ci(xs)
    return {"median": statistics.median(xs), "ci95": [lo, hi]}


def summarize(times: dict) -> dict:
    """Medians (ms) of each variant, and per round: the sync step's extra over unsync as a
    multiple of the floor's extra (wall, CPU), and sync / floor CPU time."""
    wall, cpu = times["wall"], times["cpu"]
    out: dict = {
        "ms": {k: statistics.median(v) * 1e3 for k, v in wall.items()},
        "cpu_ms": {k: statistics.median(v) * 1e3 for k, v in cpu.items()},
        "rounds": len(wall["sync"]),
    }

    def extra_ratio(t: dict) -> list[float]:
        return [
            (s - u) / (f - u)
            for s, f, u in zip(t["sync"], t["floor"], t["unsync"], strict=True)
            if f - u > 0
        ]

    out["extra_over_floor_extra"] = _median_ci(extra_ratio(wall))
    out["cpu_extra_over_floor_extra"] = _median_ci(extra_ratio(cpu))
    out["cpu_sync_over_floor"] = _median_ci(
        [s / f for s, f in zip(cpu["sync"], cpu["floor"], strict=True)]
    )
    out["sync_over_unsync"] = _median_ci(
        [s / u for s, u in zip(wall["sync"], wall["unsync"], strict=True)]
    )
    out["floor_over_unsync"] = _median_ci(
        [f / u for f, u in zip(wall["floor"], wall["unsync"], strict=True)]
    )
    m = out["ms"]
    out["extra_ms"] = {"floor": m["floor"] - m["unsync"], "sync": m["sync"] - m["unsync"]}
    # the same figure from the medians (less noisy than the per-round ratio's median)
    out["extra_ratio_of_medians"] = out["extra_ms"]["sync"] / out["extra_ms"]["floor"]
    out["goal_met"] = (
        out["extra_over_floor_extra"]["median"] <= 1.1
        and out["cpu_sync_over_floor"]["median"] <= 1.1
    )
    return out


#: breakdown categories: (label, event names) of the events inside a synchronized
#: layer's forward (``_SyncBatchNorm``) or backward (``_SyncBatchNormBackward``)
_COLLECTIVE = ("bnswap.sync.all_gather", "bnswap.sync.all_reduce")
_FORWARD = (
    ("statistics kernel", ("aten::batch_norm_update_stats", "aten::mean")),
    ("normalization kernel", ("aten::_batch_norm_no_update",)),
)
_BACKWARD = (
    ("sums kernel", ("aten::native_batch_norm_backward",)),
    ("input gradient kernels", ("aten::_batch_norm_no_update", "aten::addcmul_")),
)


def breakdown(step, steps: int) -> dict:
    """Profiler breakdown of ``steps`` calls of ``step`` (ms per step, this rank): wall
    time, the synchronized layers' forward and backward totals, their collectives and
    waiting, kernels and the rest; stock BatchNorm's kernels; the floor's collectives."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - t0
    evts = list(prof.events())
    sums: dict[str, float] = {}

    def add(key: str, us: float) -> None:
        sums[key] = sums.get(key, 0.0) + us

    def under(e, names) -> float:
        return sum(ch.cpu_time_total for ch in _descendants(e) if ch.name in names)

    for e in evts:
        if e.name == "_SyncBatchNorm" or e.name == "_SyncBatchNormBackward":
            part = "forward" if e.name == "_SyncBatchNorm" else "backward"
            total = e.cpu_time_total
            coll = under(e, _COLLECTIVE)
            add(f"sync {part}", total)
            add(f"sync {part}: collectives and waiting", coll)
            rest = total - coll
            for label, names in _FORWARD if part == "forward" else _BACKWARD:
                t = under(e, names)
                add(f"sync {part}: {label}", t)
                rest -= t
            add(f"sync {part}: the rest", rest)
        elif e.name in ("aten::_batch_norm_with_update", "aten::batch_norm_backward") and (
            e.cpu_parent is None or "batch_norm" not in e.cpu_parent.name
        ):
            add(f"stock BatchNorm: {e.name.removeprefix('aten::')}", e.cpu_time_total)
        elif e.name in _COLLECTIVE and not any(
            a.name.startswith("_SyncBatchNorm") for a in _ancestors(e)
        ):
            add("floor hooks: collectives and waiting", e.cpu_time_total)
    out = {k: v / 1e3 / steps for k, v in sums.items()}
    out["step wall"] = wall * 1e3 / steps
    return out


def _descendants(e):
    stack = list(e.cpu_children)
    while stack:
        ch = stack.pop()
        yield ch
        stack.extend(ch.cpu_children)


def _ancestors(e):
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def _with(module, name: str, value, step):
    """``step`` run with ``module.name`` set to ``value`` (restored after)."""

    def run() -> None:
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            step()
        finally:
            setattr(module, name, old)

    return run


def alternatives(times: dict) -> dict:
    """Per round, each alternative's step time over the synchronized step's (wall, CPU)."""
    out = {}
    for k in times["wall"]:
        if k.startswith("sync, "):
            out[k.removeprefix("sync, ")] = {
                part: _median_ci(
                    [a / b for a, b in zip(times[part][k], times[part]["sync"], strict=True)]
                )
                for part in ("wall", "cpu")
            }
    return out


#: Seconds a collective waits for a rank that never joins.
COLLECTIVE_TIMEOUT_S = 120


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    # a rank that dies leaves the others waiting no longer than this (gloo's default is
    # 30 minutes): the longest collective here takes milliseconds
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bnswap
    from bnswap import _global_batch

    group = dist.group.WORLD
    own = dist.new_group(list(range(world)))  # (every rank creates it, in the same order)
    other = "all_reduce" if _global_batch._BACKWARD_COLLECTIVE == "all_gather" else "all_gather"
    results = {}
    for name in args.nets.split(","):
        factory, batch, ch, hw = nets()[name]
        torch.manual_seed(0)
        base = factory()
        channels = [m.num_features for m in bn_layers(base)]
        models = {
            "unsync": bnswap.convert(copy.deepcopy(base)),
            "floor": add_floor_hooks(bnswap.convert(copy.deepcopy(base)), group, world),
            "sync": bnswap.convert(copy.deepcopy(base), sync_batchnorm=True),
            "sync, own process group": bnswap.convert(
                copy.deepcopy(base), sync_batchnorm=True, process_group=own
            ),
        }
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(batch, ch, hw, hw, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        steps = {}
        for key, model in models.items():
            ddp = DDP(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

            def step(ddp=ddp, opt=opt, x=x, y=y) -> None:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(ddp(x), y).backward()
                opt.step()

            steps[key] = step
        steps["collectives"] = collectives_alone(channels, group, world)
        # what bnswap.sync did not keep, on the same model as "sync"
        steps[f"sync, backward {other}"] = _with(
            _global_batch, "_BACKWARD_COLLECTIVE", other, steps["sync"]
        )
        if _global_batch._EAGER_C10D:
            steps["sync, functional collectives"] = _with(
                _global_batch, "_EAGER_C10D", False, steps["sync"]
            )
        counts = {k: count_collectives(s) for k, s in steps.items()}
        times = rounds(steps, args.rounds, args.warmup)
        main = {part: {k: times[part][k] for k in VARIANTS} for part in ("wall", "cpu")}
        row = {
            "bn_layers": len(channels),
            "per_rank_batch": batch,
            "input": [ch, hw, hw],
            "collectives_per_step": counts,
            **summarize(main),
            "alternatives": alternatives(times),
            "alternatives_ms": {
                k: statistics.median(v) * 1e3
                for k, v in times["wall"].items()
                if k.startswith("sync, ")
            },
            "samples_ms": {k: [t * 1e3 for t in v] for k, v in times["wall"].items()},
            "samples_cpu_ms": {k: [t * 1e3 for t in v] for k, v in times["cpu"].items()},
            "breakdown": {
                k: breakdown(steps[k], args.profile_steps) for k in ("unsync", "floor", "sync")
            },
        }
        results[name] = row
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def table(doc: dict) -> str:
    lines = [
        f"`{doc['command']}`: {doc['rounds']} rounds, {doc['seconds']} s; the synchronized "
        f"layers' collectives: all_gather forward, `{doc['backward_collective']}` backward, "
        f"{'plain c10d' if doc['eager_c10d'] else 'functional'} calls, on WORLD (with DDP's "
        f"buckets); load average at start {doc['machine'].get('load_average_start')}.",
        "",
        "| ranks | net | BN layers | unsync / floor / sync / collectives alone, ms | extra "
        "over unsync: floor / sync, ms | sync extra / floor extra, wall (95 % CI) | same, CPU "
        "| sync / floor CPU time | goal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for world, per_net in doc["results"].items():
        for net, r in per_net.items():
            m, e = r["ms"], r["extra_ms"]
            w, c, cs = (
                r["extra_over_floor_extra"],
                r["cpu_extra_over_floor_extra"],
                r["cpu_sync_over_floor"],
            )
            lines.append(
                f"| {world} | {net} | {r['bn_layers']} | {m['unsync']:.0f} / {m['floor']:.0f} / "
                f"{m['sync']:.0f} / {m['collectives']:.0f} | {e['floor']:.0f} / {e['sync']:.0f} "
                f"| {w['median']:.2f} ({w['ci95'][0]:.2f}-{w['ci95'][1]:.2f}) | "
                f"{c['median']:.2f} ({c['ci95'][0]:.2f}-{c['ci95'][1]:.2f}) | "
                f"{cs['median']:.2f} ({cs['ci95'][0]:.2f}-{cs['ci95'][1]:.2f}) | "
                f"{'met' if r['goal_met'] else 'missed'} |"
            )
    lines += [
        "",
        "What bnswap.sync did not keep, in the same rounds (per round, its step over "
        "the synchronized step's; median, 95 % CI):",
        "",
        "| ranks | net | alternative | ms | wall | CPU |",
        "|---|---|---|---|---|---|",
    ]
    for world, per_net in doc["results"].items():
        for net, r in per_net.items():
            for alt, v in r["alternatives"].items():
                w, c = v["wall"], v["cpu"]
                lines.append(
                    f"| {world} | {net} | {alt} | {r['alternatives_ms']['sync, ' + alt]:.0f} | "
                    f"{w['median']:.2f} ({w['ci95'][0]:.2f}-{w['ci95'][1]:.2f}) | "
                    f"{c['median']:.2f} ({c['ci95'][0]:.2f}-{c['ci95'][1]:.2f}) |"
                )
    lines += [
        "",
        "Profiler breakdown (rank 0, ms per step; the profiler adds its own cost):",
        "",
        "| ranks | net | variant | part | ms |",
        "|---|---|---|---|---|",
    ]
    for world, per_net in doc["results"].items():
        for net, r in per_net.items():
            for variant, parts in r["breakdown"].items():
                for part, ms in parts.items():
                    lines.append(f"| {world} | {net} | {variant} | {part} | {ms:.1f} |")
    lines += [
        "",
        "| ranks | net | variant | collectives per step (per rank; gloo events) |",
        "|---|---|---|---|",
    ]
    for world, per_net in doc["results"].items():
        for net, r in per_net.items():
            for variant, counts in r["collectives_per_step"].items():
                coll = ", ".join(
                    f"{k.removeprefix('gloo:')} {v}" for k, v in sorted(counts.items())
                )
                lines.append(f"| {world} | {net} | {variant} | {coll} |")
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The full measurement: python -m benchmarks.bench_sync (about 5 minutes on "
        "2 cores); --quick checks that it runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    p.add_argument(
        "--nets",
        default="mainjob,resnet18s",
        help="comma-separated: mainjob, resnet18s, tiny (default mainjob,resnet18s)",
    )
    p.add_argument("--ranks", default="2,3", help="world sizes, one run each (default 2,3)")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=3,
        help="steps profiled per variant for the breakdown (default 3)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="--nets tiny --ranks 2 --rounds 3 --warmup 1 --profile-steps 1",
    )
    p.add_argument(
        "--out",
        default=None,
        help="writes OUT.json and OUT.md (default benchmarks/results/sync, "
        "with --quick benchmarks/results/sync_quick)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.nets, args.ranks, args.rounds, args.warmup, args.profile_steps = ("tiny", "2", 3, 1, 1)
    if args.out is None:
        args.out = os.path.join(
            ROOT, "benchmarks", "results", "sync_quick" if args.quick else "sync"
        )
    sys.path.insert(0, ROOT)
    from benchmarks.harness import machine_info
    from bnswap import _global_batch

    doc = {
        "machine": machine_info(),
        "threads_per_rank": 1,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "backward_collective": _global_batch._BACKWARD_COLLECTIVE,
        "eager_c10d": _global_batch._EAGER_C10D,
        "command": " ".join(["python -m benchmarks.bench_sync", *(argv or sys.argv[1:])]),
        "results": {},
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    t0 = time.perf_counter()
    for world in (int(w) for w in args.ranks.split(",")):
        part = f"{args.out}.{world}ranks.tmp.json"
        mp.spawn(worker, args=(world, _free_port(), args, part), nprocs=world)
        with open(part) as f:
            doc["results"][str(world)] = json.load(f)
        os.remove(part)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    with open(args.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(table(doc))
    print(table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
