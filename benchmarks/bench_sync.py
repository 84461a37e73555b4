"""Synchronized BatchNorm on 2 gloo ranks (CPU): DDP train step time of bnswap's
synchronized layers (``convert(model, sync_batchnorm=True)``) against unsynchronized
bnswap, and against an all_gather-based synchronization written here (detectron2's
``NaiveSyncBatchNorm`` approach: per-rank mean and mean of squares, gathered with an
autograd all_gather + sum, all_reduce in backward); collectives per step.

    python benchmarks/bench_sync.py [--pairs 15] [--warmup 3] [--nets mainjob,resnet18s]
                                    [--out benchmarks/results/sync]

Each rank runs the same interleaved schedule (``benchmarks/harness.py``: A, B, A, B, ...
after warm-up, fixed calls per sample, so the collectives pair up), one torch thread per
rank; rank 0 reports the median of the per-pair ratios and its 95 % interval. DDP with
its defaults (gradient buckets, ``broadcast_buffers=True``) for every variant. Goal:
synchronized / unsynchronized <= 1.15 on the main job's net.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nets() -> dict:
    from bnswap.app.models import MobileNetV2, ResNet18

    # name -> (factory, per-rank batch, channels, H=W)
    return {
        # the `bnswap train` main job's model and batch (global 64 = 2 x 32), 1x16x16 digits
        "mainjob": (lambda: MobileNetV2(num_classes=10, in_channels=1, width_mult=0.5), 32, 1,
                    16),
        # ResNet-18 at small size: width 16, 3x32x32, 16 per rank
        "resnet18s": (lambda: ResNet18(num_classes=10, in_channels=3, width=16), 16, 3, 32),
    }


class _AllGatherSum(torch.autograd.Function):
    """detectron2's ``AllReduce``: all_gather then sum in forward, all_reduce in backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        return torch.stack(parts).sum(0)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        dist.all_reduce(g)
        return g


class NaiveSyncBatchNorm2d(nn.BatchNorm2d):
    """detectron2's ``NaiveSyncBatchNorm`` (equal per-rank batches): mean and mean of
    squares per rank, one autograd all_gather, var = E[x^2] - E[x]^2 (float32 sums)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or dist.get_world_size() == 1:
            return super().forward(x)
        c = x.shape[1]
        mean = x.mean(dim=[0, 2, 3])
        meansqr = (x * x).mean(dim=[0, 2, 3])
        vec = _AllGatherSum.apply(torch.cat([mean, meansqr])) / dist.get_world_size()
        mean, meansqr = torch.split(vec, c)
        var = meansqr - mean * mean
        with torch.no_grad():
            self.running_mean += self.momentum * (mean.detach() - self.running_mean)
            self.running_var += self.momentum * (var.detach() - self.running_var)
            self.num_batches_tracked += 1
        invstd = torch.rsqrt(var + self.eps)
        scale = self.weight * invstd
        bias = self.bias - mean * scale
        return x * scale.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)


def naive(model: nn.Module) -> nn.Module:
    """``model`` with every BatchNorm2d a NaiveSyncBatchNorm2d sharing its state."""
    for m in model.modules():
        if type(m) is nn.BatchNorm2d:
            m.__class__ = NaiveSyncBatchNorm2d
    return model


def count_collectives(step) -> dict[str, int]:
    """Collectives one step issues, by kind (the profiler's ``gloo:*`` /
    ``c10d`` record_function events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: dict[str, int] = {}
    for e in prof.events():
        name = e.name
        if name.startswith("gloo:"):
            counts[name] = counts.get(name, 0) + 1
    return counts


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    import bnswap
    from benchmarks.harness import interleaved
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for name in args.nets.split(","):
        factory, batch, ch, hw = nets()[name]
        torch.manual_seed(0)
        base = factory()
        variants = {
            "sync": bnswap.convert(copy.deepcopy(base), sync_batchnorm=True),
            "unsync": bnswap.convert(copy.deepcopy(base)),
            "naive": naive(copy.deepcopy(base)),
        }
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(batch, ch, hw, hw, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        steps = {}
        for key, model in variants.items():
            ddp = DDP(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

            def step(ddp=ddp, opt=opt) -> None:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(ddp(x), y).backward()
                opt.step()

            steps[key] = step
        collectives = {k: count_collectives(s) for k, s in steps.items()}
        layers = sum(isinstance(m, nn.BatchNorm2d) for m in base.modules())
        row = {"bn_layers": layers, "per_rank_batch": batch, "input": [ch, hw, hw],
               "collectives_per_step": collectives}
        for a, b in (("sync", "unsync"), ("naive", "unsync"), ("sync", "naive")):
            cmp = interleaved(steps[a], steps[b], pairs=args.pairs, warmup=args.warmup)
            row[f"{a}/{b}"] = cmp.to_dict()
        results[name] = row
    if rank == 0:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        from benchmarks.harness import machine_info

        doc = {"machine": machine_info(), "world_size": world, "threads_per_rank": 1,
               "pairs": args.pairs, "results": results}
        with open(args.out + ".json", "w") as f:
            json.dump(doc, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(table(doc))
        print(table(doc))
    dist.destroy_process_group()


def table(doc: dict) -> str:
    lines = ["| net | BN layers | A/B | wall: median (95 % CI) | A / B ms | CPU time: median "
             "(95 % CI) |", "|---|---|---|---|---|---|"]
    for net, row in doc["results"].items():
        for key in ("sync/unsync", "naive/unsync", "sync/naive"):
            r = row[key]
            lo, hi = r["ratio_ci95"]
            clo, chi = r["cpu_ratio_ci95"]
            lines.append(f"| {net} | {row['bn_layers']} | {key} | {r['ratio_median']:.3f} "
                         f"({lo:.3f}-{hi:.3f}) | {r['a_median_ms']:.0f} / {r['b_median_ms']:.0f} "
                         f"| {r['cpu_ratio_median']:.3f} ({clo:.3f}-{chi:.3f}) |")
    lines += ["", "| net | variant | collectives per step (per rank; gloo events) |",
              "|---|---|---|"]
    for net, row in doc["results"].items():
        for variant, counts in row["collectives_per_step"].items():
            coll = ", ".join(f"{k.removeprefix('gloo:')} {v}" for k, v in sorted(counts.items()))
            lines.append(f"| {net} | {variant} | {coll} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nets", default="mainjob,resnet18s")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "sync"))
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args), nprocs=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
