"""Synchronized BatchNorm with bnswap in plain PyTorch DDP (no Lightning), on any device.

Every process trains the main job's MobileNetV2-style network on its share of each
global batch of scikit-learn's digits (same fixed split and seed as ``bnswap train``):

1. ``bnswap.convert(model, sync_batchnorm=True)``: every ``BatchNorm2d`` becomes a
   swapped ``nn.SyncBatchNorm`` sharing its Parameter and buffer objects; in training its
   statistics are the global batch's (one all_gather per layer), on CPU with gloo as on
   CUDA with NCCL (stock ``SyncBatchNorm`` refuses CPU input);
2. ``DistributedDataParallel`` averages the gradients;
3. ``bnswap.revert(model)`` gives back the original ``BatchNorm2d`` objects, trained.

Run with torchrun (gloo on CPU; NCCL when CUDA is available)::

    torchrun --nproc_per_node=2 examples/ddp_syncbn.py
    torchrun --nproc_per_node=2 examples/ddp_syncbn.py --steps 20 --out runs/syncbn

With equal per-process batches this is one process training stock ``nn.BatchNorm2d`` on
the concatenated global batch (tests/test_sync.py checks that, to float
rounding).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import bnswap
from bnswap.app.digits import digits_split
from bnswap.app.models import MobileNetV2


def global_batches(n_train: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """The training indices of each step's global batch (the same on every process)."""
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed))
    return [order[(i * batch_size) % (n_train - batch_size):][:batch_size] for i in range(steps)]


def build(width_mult: float, seed: int) -> nn.Module:
    """The network, with the same initial weights on every process."""
    torch.manual_seed(seed)
    return MobileNetV2(width_mult=width_mult)


def optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def main(steps: int = 8, batch_size: int = 64, lr: float = 0.05, width_mult: float = 0.5,
         image_size: int = 16, seed: int = 0, out: str | None = None,
         num_threads: int | None = 1, float64: bool = False,
         timeout_s: float = 1800.0) -> dict:
    """Train ``steps`` steps of ``batch_size`` (the global batch, split evenly) on every
    process of the torchrun job; rank 0 prints the plan and the validation accuracy;
    ``out``: a folder where each rank saves its final state_dict (``rank{r}.pt``).

    Args:
        steps: training steps.
        batch_size: the global batch size (a multiple of the number of processes).
        lr: SGD learning rate (momentum 0.9).
        width_mult: MobileNetV2 width multiplier.
        image_size: digits are resized to (image_size, image_size).
        seed: weights, data split and batch order.
        out: folder for the final states (None: not saved).
        num_threads: ``torch.set_num_threads`` per process (None: torch's default).
        float64: weights and data in float64 (tests compare with one process to 1e-7;
            in float32 the deep layers' small batch variances amplify rounding to ~1e-3
            after a step, for stock as for bnswap).
        timeout_s: seconds a rank waits in one collective (or for its peers) before
            it fails; torch's default is 30 minutes.
    """
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    cuda = torch.cuda.is_available()
    # how long a rank waits in one collective before it fails (torch's default: 30 min)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if batch_size % world:
        raise ValueError(f"batch_size {batch_size} is not a multiple of {world} processes")
    (xt, yt), (xv, yv) = digits_split(image_size, seed=seed)
    dtype = torch.float64 if float64 else torch.float32
    xt, xv = xt.to(dtype), xv.to(dtype)

    model = build(width_mult, seed).to(device, dtype)
    bn_before = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    bnswap.convert(model, sync_batchnorm=True)  # BatchNorm2d -> swapped SyncBatchNorm
    if rank == 0:
        print(bnswap.plan(model).summary(), "| synchronized over:",
              bnswap.plan(model)[0].sync, "| kernel:", bnswap.plan(model)[0].kernel)
    ddp = DDP(model, device_ids=[device.index] if cuda else None, broadcast_buffers=False)
    opt = optimizer(ddp, lr)

    share = batch_size // world
    t0 = time.perf_counter()
    for step, idx in enumerate(global_batches(len(yt), batch_size, steps, seed)):
        mine = idx[rank * share:(rank + 1) * share]
        x, y = xt[mine].to(device), yt[mine].to(device)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients; SyncBatchNorm's all_reduce ran first
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} (rank 0's share)")
    seconds = time.perf_counter() - t0

    bnswap.revert(model)  # the original BatchNorm2d objects, trained
    assert [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)] == bn_before
    model.eval()
    with torch.no_grad():
        acc = (model(xv.to(device)).argmax(1).cpu() == yv).float().mean().item()
    if rank == 0:
        print(f"{world} processes, {steps} steps in {seconds:.1f} s; val_acc {acc:.4f}; "
              f"the model holds {len(bn_before)} stock BatchNorm2d layers again")
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if out is not None:
        os.makedirs(out, exist_ok=True)
        torch.save(state, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()
    return {"val_acc": acc, "state": state}


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
