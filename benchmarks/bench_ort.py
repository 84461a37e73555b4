"""Train-step time of bnswap's ORT backend vs eager stock PyTorch, same process.

    python benchmarks/bench_ort.py [--steps 30] [--warmup 5] [--batch 32] [--threads N]
                                   [--config NAME ...]

Model: a 4-block CNN (Conv-BN-ReLU x4, pooling, Linear) on (batch, 3, 32, 32) float32.
One step = zero_grad, forward, cross-entropy, backward, SGD step. After warm-up, the
eager and ORT steps are interleaved pairwise (order alternating) and the median of the
per-pair ratios ORT/eager is printed per ORT configuration (below 1.0 = ORT faster).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
from torch import nn

CONFIGS = {
    # name: (session_options, environment for ORTModule)
    "default": ({}, {}),
    "threads=cores": ({"intra_op_num_threads": os.cpu_count() or 1}, {}),
    "threads=cores,seq,mem": ({"intra_op_num_threads": os.cpu_count() or 1,
                               "enable_mem_pattern": True, "enable_mem_reuse": True}, {}),
    "threads=1": ({"intra_op_num_threads": 1}, {}),
}


def make_model(width: int = 32) -> nn.Module:
    layers, c = [], 3
    for i in range(4):
        layers += [nn.Conv2d(c, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                   nn.ReLU()]
        if i % 2 == 1:
            layers.append(nn.MaxPool2d(2))
        c = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def step_fn(model: nn.Module, opt: torch.optim.Optimizer, x, y):
    def step() -> float:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - t
    return step


def main(argv: list[str] | None = None) -> int:
    import bnswap
    import bnswap.ort

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--config", nargs="*", default=list(CONFIGS))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not bnswap.ort.is_available():
        print(f"ORT not installed: {bnswap.ort.INSTALL}")
        return 0
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch,))
    base = make_model()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
          f"batch {args.batch}, 4-block CNN 32x32")
    for name in args.config:
        so, env = CONFIGS[name]
        old_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            eager = copy.deepcopy(base)
            ort_model = bnswap.ort.wrap(bnswap.convert(copy.deepcopy(base)), session_options=so)
            e_step = step_fn(eager, torch.optim.SGD(eager.parameters(), lr=0.01), x, y)
            o_step = step_fn(ort_model, torch.optim.SGD(ort_model.parameters(), lr=0.01), x, y)
            for _ in range(args.warmup):
                e_step()
                o_step()
            ratios, te, to = [], [], []
            for i in range(args.steps):
                if i % 2:
                    a, b = o_step(), e_step()
                else:
                    b, a = e_step(), o_step()
                ratios.append(a / b)
                te.append(b)
                to.append(a)
            print(f"{name:24s} ORT/eager median ratio {statistics.median(ratios):.3f}  "
                  f"(eager {statistics.median(te) * 1e3:.2f} ms, ORT "
                  f"{statistics.median(to) * 1e3:.2f} ms)", flush=True)
        finally:
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return 0


if __name__ == "__main__":
    sys.exit(main())
