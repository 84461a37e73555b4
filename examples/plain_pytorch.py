"""bnswap in a plain PyTorch training loop (no Lightning).

Trains the main job's MobileNetV2-style network on scikit-learn's digits (same fixed
split and seed as ``bnswap train``), once on stock ``nn.BatchNorm2d`` and once after
``bnswap.convert``, and prints the plan's summary line and both validation accuracies.
Like ``bnswap train`` it uses one torch thread by default (``--num_threads``): this small
net ran 7-9x slower per epoch with two threads on a loaded 2-core machine.

    python examples/plain_pytorch.py                 # both runs, 4 epochs each
    python examples/plain_pytorch.py --epochs 2 --width_mult 0.5 --num_threads 2
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn import functional as F

import bnswap
from bnswap.app.digits import digits_split
from bnswap.app.models import MobileNetV2


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Validation (loss, accuracy) of ``model`` on (N, 1, H, W) float32 ``x``."""
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(xb) for xb in x.split(256)])
    model.train()
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def train(
    swap: bool,
    epochs: int = 4,
    batch_size: int = 64,
    lr: float = 0.1,
    width_mult: float = 0.5,
    image_size: int = 16,
    seed: int = 0,
    max_batches: int | None = None,
) -> dict[str, float]:
    """One training run; ``swap`` converts the model's BatchNorm layers first."""
    (xt, yt), (xv, yv) = digits_split(image_size, seed=seed)
    torch.manual_seed(seed)
    model = MobileNetV2(width_mult=width_mult)
    if swap:
        # In place, by class assignment: same Parameter objects, so building the
        # optimizer before or after the swap makes no difference.
        bnswap.convert(model)
        print(bnswap.plan(model).summary())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    steps_per_epoch = len(yt) // batch_size
    if max_batches is not None:
        steps_per_epoch = min(steps_per_epoch, max_batches)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=lr, pct_start=0.25, total_steps=max(8, epochs * steps_per_epoch)
    )
    t0 = time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(yt), generator=torch.Generator().manual_seed(seed + epoch))
        for i in range(steps_per_epoch):
            idx = order[i * batch_size : (i + 1) * batch_size]
            loss = F.cross_entropy(model(xt[idx]), yt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        val_loss, val_acc = evaluate(model, xv, yv)
        print(
            f"[{'bnswap' if swap else 'stock '}] epoch {epoch}: val_loss {val_loss:.4f} "
            f"val_acc {val_acc:.4f}"
        )
    return {
        "val_loss": val_loss,
        "val_acc": val_acc,
        "seconds": time.perf_counter() - t0,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def main(
    epochs: int = 4,
    width_mult: float = 0.5,
    max_batches: int | None = None,
    num_threads: int | None = 1,
) -> dict:
    """Train stock and bnswap and print both final validation figures.

    Args:
        epochs: epochs per run.
        width_mult: MobileNetV2 width multiplier.
        max_batches: cap on training batches per epoch (for smoke tests).
        num_threads: ``torch.set_num_threads`` for both runs (None: torch's default).
    """
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    stock = train(False, epochs, width_mult=width_mult, max_batches=max_batches)
    swapped = train(True, epochs, width_mult=width_mult, max_batches=max_batches)
    same = all(torch.equal(stock["state"][k], swapped["state"][k]) for k in stock["state"])
    for name, r in (("stock", stock), ("bnswap", swapped)):
        print(
            f"{name:>6}: final val_acc {r['val_acc']:.4f}  val_loss {r['val_loss']:.4f}  "
            f"({r['seconds']:.1f} s)"
        )
    print(f"final states bitwise identical: {same}")
    return {"stock": stock, "bnswap": swapped, "identical": same}


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
