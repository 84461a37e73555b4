"""What the first swap costs a process that compiled first (issue 40).

At a class's first swap bnswap puts its dispatcher in the class's ``forward`` and drops
the code ``torch.compile`` cached before (``bnswap._swap.forget_compiled_code``): each
compiled frame recompiles at its next call. This measures that recompile on the main
job's net (MobileNetV2, width 0.5, 1x16x16 digits, batch 32, a train step: forward,
cross-entropy, backward), in one process per backend:

1. ``torch.compile(net)``; the first step (the compile) and the median of 5 steps after;
2. ``bnswap.convert(nn.BatchNorm2d(1))`` (an unrelated layer: the process's first swap);
3. the next step of the same, still stock, net (the recompile) and the median of 5 after.

Run: ``python -m benchmarks.recompile [--backends aot_eager,inductor]``; writes
``benchmarks/results/recompile.{json,md}``. Inductor's on-disk caches are turned off so
that both compiles are cold (a warm FX graph cache makes the recompile of an unchanged
stock graph much cheaper than this figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def _one(backend: str) -> dict[str, float]:
    import torch
    import torch._dynamo
    from torch import nn

    from bnswap.app.models import build_model

    torch.set_num_threads(1)
    if backend == "inductor":
        import torch._functorch.config
        import torch._inductor.config

        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    torch.manual_seed(0)
    net = build_model("mobilenetv2", num_classes=10, in_channels=1, width_mult=0.5)
    compiled = torch.compile(net, backend=backend)
    x = torch.randn(32, 1, 16, 16)
    y = torch.randint(0, 10, (32,))

    def step() -> float:
        t = time.perf_counter()
        loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        return time.perf_counter() - t

    first = step()
    steady = statistics.median(step() for _ in range(5))
    import bnswap

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        bnswap.convert(nn.BatchNorm2d(1))
        swap = time.perf_counter() - t
    again = step()
    steady_after = statistics.median(step() for _ in range(5))
    return {
        "compile_step_s": first,
        "steady_step_s": steady,
        "first_swap_s": swap,
        "recompile_step_s": again,
        "steady_step_after_s": steady_after,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="aot_eager,inductor")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one)))
        return
    rows = {}
    for backend in args.backends.split(","):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.recompile", "--one", backend],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(HERE),
        ).stdout
        rows[backend] = json.loads(out.strip().splitlines()[-1])
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "recompile.json"), "w") as f:
        json.dump(rows, f, indent=2)
    lines = [
        "# The first swap after a compile: the recompile it costs",
        "",
        "`python -m benchmarks.recompile` (main job's net, batch 32, one torch thread, "
        "cold compiles). Seconds.",
        "",
        "| backend | compile step | steady step | first swap (convert) | recompile step "
        "| steady step after |",
        "|---|---|---|---|---|---|",
    ]
    for backend, r in rows.items():
        lines.append(
            f"| {backend} | {r['compile_step_s']:.2f} | {r['steady_step_s']:.4f} | "
            f"{r['first_swap_s']:.4f} | {r['recompile_step_s']:.2f} | "
            f"{r['steady_step_after_s']:.4f} |"
        )
    with open(os.path.join(RESULTS, "recompile.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
