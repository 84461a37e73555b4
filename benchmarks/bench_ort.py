"""ORT session settings for bnswap's ORT backend: train step ORT / eager stock, same
process, one row per setting.

    python benchmarks/bench_ort.py [--net convnet4|mobilenetv2|resnet18] [--steps 10]
                                   [--warmup 3] [--threads N] [--config NAME ...]

Nets, batches and the train step are P4's (``benchmarks/cases.py``). After warm-up the
eager and ORT steps are interleaved pairwise (order alternating) and the median of the
per-pair ratios ORT/eager is printed per setting (below 1.0 = ORT faster). P4 itself
(``python -m benchmarks --cases P4``) uses ORT intra-op threads = torch's threads and
adds the per-kernel-family breakdown that explains the ratio.
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
    # name: session_options (on top of bnswap.ort.DEFAULT_SESSION_OPTIONS)
    "default": {},
    "threads=1": {"intra_op_num_threads": 1},
    "threads=cores": {"intra_op_num_threads": os.cpu_count() or 1},
    "threads=1,mem-pattern": {"intra_op_num_threads": 1, "enable_mem_pattern": True},
    "threads=cores,no-spin": {"intra_op_num_threads": os.cpu_count() or 1,
                              "config:session.intra_op.allow_spinning": "0"},
}


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
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bnswap
    import bnswap.ort
    from benchmarks.cases import _pair

    p = argparse.ArgumentParser()
    p.add_argument("--net", default="convnet4", choices=["convnet4", "mobilenetv2", "resnet18"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--config", nargs="*", default=list(CONFIGS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not bnswap.ort.is_available():
        print(f"ORT not installed: {bnswap.ort.INSTALL}")
        return 0
    _, base, x, y = _pair(args.net)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {args.net}, "
          f"input {tuple(x.shape)}")
    for name in args.config:
        eager = copy.deepcopy(base)
        ort_model = bnswap.ort.wrap(bnswap.convert(copy.deepcopy(base)),
                                    session_options=CONFIGS[name])
        e_step = step_fn(eager, torch.optim.SGD(eager.parameters(), lr=0.01), x, y)
        o_step = step_fn(ort_model, torch.optim.SGD(ort_model.parameters(), lr=0.01), x, y)
        try:
            for _ in range(args.warmup):
                e_step()
                o_step()
        except bnswap.ort.ORTRunError as err:
            print(f"{name:24s} fails: {str(err)[:200]}", flush=True)
            continue
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
