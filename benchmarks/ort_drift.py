"""How far the ORT backend drifts from eager stock BatchNorm over training steps.

    python benchmarks/ort_drift.py [--steps 20] [--net convnet4|mainjob] [--batch 32]

Trains an identical copy of a net twice from the same weights on the same real digits
batches (scikit-learn): stock ``nn.BatchNorm2d`` eagerly, and
``bnswap.convert(model, backend="ort")``; once with SGD (lr 0.05, momentum 0.9) and once
with AdamW (lr 1e-3). Prints, at steps 1, 2, 5, 10 and the last, the largest absolute
difference of the parameters, of the running statistics, and of the training-mode
outputs. One step is float32 rounding (ORT's kernels sum in another order); the
figures show how each optimizer carries it. README ("The ONNX Runtime backend") and
docs/ort.md quote its output.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import bnswap
from bnswap.app.data import DigitsDataModule
from bnswap.app.models import ConvNet4, MobileNetV2


def _net(name: str) -> nn.Module:
    if name == "mainjob":
        return MobileNetV2(width_mult=0.5)
    return ConvNet4(channels=(8, 16, 16, 32))


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        float((x.detach().double() - y.detach().double()).abs().max())
        for x, y in zip(a, b, strict=True)
    )


def drift(opt_name: str, net: str, steps: int, batch: int) -> list[tuple[int, float, float, float]]:
    """(step, params, running stats, outputs) max abs differences ORT vs stock."""
    torch.manual_seed(0)
    ref = _net(net)
    model = copy.deepcopy(ref)
    wrapped = bnswap.convert(model, backend="ort")
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    }[opt_name]
    opt, opt_ref = make(wrapped.parameters()), make(ref.parameters())
    dm = DigitsDataModule(batch_size=batch, image_size=16 if net == "mainjob" else 8)
    dm.setup("fit")
    rows = []
    data = iter(dm.train_dataloader())
    for step in range(1, steps + 1):
        try:
            x, y = next(data)
        except StopIteration:
            data = iter(dm.train_dataloader())
            x, y = next(data)
        out, out_ref = wrapped(x), ref(x)
        nn.functional.cross_entropy(out, y).backward()
        nn.functional.cross_entropy(out_ref, y).backward()
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        stats = [b for n, b in model.named_buffers() if "running" in n]
        stats_ref = [b for n, b in ref.named_buffers() if "running" in n]
        rows.append(
            (
                step,
                _max_diff(list(model.parameters()), list(ref.parameters())),
                _max_diff(stats, stats_ref),
                _max_diff([out], [out_ref]),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--net", choices=("convnet4", "mainjob"), default="convnet4")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    show = {1, 2, 5, 10, args.steps}
    for opt_name in ("sgd", "adamw"):
        print(f"{args.net}, {opt_name}: max |ORT - stock| after each step")
        print(f"{'step':>5} {'params':>10} {'run. stats':>10} {'outputs':>10}")
        for step, dp, ds, do in drift(opt_name, args.net, args.steps, args.batch):
            if step in show:
                print(f"{step:>5} {dp:>10.2e} {ds:>10.2e} {do:>10.2e}")


if __name__ == "__main__":
    main()
