"""ORT session settings for bnswap's ORT backend: train step ORT / eager stock, same
process, one row per setting.

    python benchmarks/bench_ort.py [--net convnet4|mobilenetv2|resnet18|mainjob] [--steps 10]
                                   [--warmup 3] [--threads N] [--config NAME ...]

Nets, batches, the train step and the interleaved A/B harness are P4's
(``benchmarks/cases.py``, ``benchmarks/harness.py``); the median of the per-pair ratios
ORT/eager is printed per setting (below 1.0 = ORT faster). P4 itself
(``python -m benchmarks --cases P4``) uses ORT intra-op threads = torch's threads and
adds the per-kernel-family breakdown that explains the ratio.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

CONFIGS = {
    # name: session_options (on top of bnswap.ort.DEFAULT_SESSION_OPTIONS)
    "default": {},
    "threads=1": {"intra_op_num_threads": 1},
    "threads=cores": {"intra_op_num_threads": os.cpu_count() or 1},
    "threads=1,mem-pattern": {"intra_op_num_threads": 1, "enable_mem_pattern": True},
    "threads=cores,no-spin": {
        "intra_op_num_threads": os.cpu_count() or 1,
        "config:session.intra_op.allow_spinning": "0",
    },
}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bnswap
    import bnswap.ort
    from benchmarks.cases import _pair, train_step
    from benchmarks.harness import interleaved

    p = argparse.ArgumentParser()
    p.add_argument(
        "--net",
        default="convnet4",
        choices=["convnet4", "mobilenetv2", "resnet18", "mainjob"],
        help="mainjob: the `bnswap train` main job's model and batch "
        "(MobileNetV2 width 0.5, 1x16x16 digits, batch 64)",
    )
    p.add_argument("--steps", type=int, default=10, help="interleaved (ORT, eager) pairs")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--config", nargs="*", default=list(CONFIGS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not bnswap.ort.is_available():
        print(f"ORT not installed: {bnswap.ort.INSTALL}")
        return 0
    if args.net == "mainjob":
        from bnswap.app.models import build_model

        torch.manual_seed(0)
        base = build_model("mobilenetv2", num_classes=10, in_channels=1, width_mult=0.5)
        x, y = torch.randn(64, 1, 16, 16), torch.randint(0, 10, (64,))
    else:
        _, base, x, y = _pair(args.net)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {args.net}, "
        f"input {tuple(x.shape)}"
    )
    for name in args.config:
        eager = copy.deepcopy(base)
        ort_model = bnswap.ort.wrap(
            bnswap.convert(copy.deepcopy(base)), session_options=CONFIGS[name]
        )
        try:  # P4's train step (SGD momentum 0.9) and harness, ORT as A, eager stock as B
            cmp = interleaved(
                train_step(ort_model, x, y, "float32"),
                train_step(eager, x, y, "float32"),
                pairs=args.steps,
                warmup=args.warmup,
            )
        except bnswap.ort.ORTRunError as err:
            print(f"{name:24s} fails: {str(err)[:200]}", flush=True)
            continue
        print(
            f"{name:24s} ORT/eager median ratio {cmp.ratio_median:.3f}  "
            f"(eager {cmp.b_median * 1e3:.2f} ms, ORT {cmp.a_median * 1e3:.2f} ms)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
