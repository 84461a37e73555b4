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

It needs scikit-learn (the digits data: ``pip install scikit-learn``, or the ``lightning``
extra); without it each rank says so in one line (no traceback of the example's) and
exits with status 1 before any process group starts. torchrun then prints its own report
of the failed ranks (``ChildFailedError``, about 30 lines, a traceback of torchrun's own
frames), as it does whenever a rank exits non-zero: no script can silence it, so read the
lines above it. Run as ``python examples/ddp_syncbn.py`` (one process), the one line is
all.

At its defaults (60 steps of 64 images, SGD with momentum 0.9 and a learning rate
falling linearly from 0.05 towards 0) two processes reach a validation accuracy of about
0.9 (0.91 at seed 0; 0.91-0.97 over seeds 0-2) in 50-60 s on a 2-core CPU machine (about
40 s of it training). Validation runs in eval mode, on the layers' running statistics:
exponential averages (momentum 0.1) that lag the weights, so while the weights still
move fast they describe an earlier network and the accuracy stays near chance (the
former defaults, 8 steps at a constant 0.05, gave 0.08, one process with stock
BatchNorm2d on the same global batches exactly the same; the same weights score 0.15
on batch statistics). The falling learning rate lets the statistics catch up: 50 steps
give about 0.5, 60 about 0.9.

The global batch may be split unevenly (``--batch_size 63`` on 2 processes: 32 and 31
images): the synchronized layers normalize with the statistics of the whole global
batch however it is split (ranks may even be empty), and each rank's loss is its share
of the global batch's mean (summed, times the number of processes, over the global
batch size), so DDP's average of the gradients is the global batch's gradient. So, for
any split, this is one process training stock ``nn.BatchNorm2d`` on the concatenated
global batch (tests/test_sync.py checks that with an uneven split, in float64, to 1e-7;
in float32 the two differ by rounding, which after 60 steps moves the accuracy by a few
points: 0.95 for one process at seed 0).
"""

from __future__ import annotations

import inspect
import os
import sys
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
    return [order[(i * batch_size) % (n_train - batch_size) :][:batch_size] for i in range(steps)]


def build(width_mult: float, seed: int) -> nn.Module:
    """The network, with the same initial weights on every process."""
    torch.manual_seed(seed)
    return MobileNetV2(width_mult=width_mult)


def optimizer(
    model: nn.Module, lr: float, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """SGD (momentum 0.9) and its schedule: the learning rate falls linearly from ``lr``
    (step 0) to ``lr / steps`` (the last step); call the schedule's ``step()`` after each
    optimizer step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)


def share_loss(logits: torch.Tensor, y: torch.Tensor, batch_size: int, world: int) -> torch.Tensor:
    """This rank's part of the global batch's mean cross entropy, times ``world``: the
    sum over its share divided by ``batch_size / world``, so that DDP's average of the
    ranks' gradients is the gradient of the global batch's mean loss, even when the
    shares differ in size."""
    return F.cross_entropy(logits, y, reduction="sum") * world / batch_size


def require_sklearn() -> None:
    """Exit with status 1 and one line on stderr when scikit-learn, which holds the
    digits data, is missing: before any process group starts. Every rank says it (when
    one rank exits, torchrun stops the others, so a line from rank 0 alone could be lost);
    torchrun then adds its own report of the failed ranks."""
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError:
        print(
            "examples/ddp_syncbn.py: needs scikit-learn for the digits data: "
            "pip install scikit-learn",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1) from None


def ddp_options() -> dict:
    """No buffer synchronization in forward: every rank's synchronized layers compute the
    same running statistics from the global batch, so broadcasting rank 0's would only
    cost time (and hide a rank that diverged). torch 2.13 names the option
    ``forward_sync_buffers`` and deprecates ``broadcast_buffers`` (a FutureWarning);
    either way the buffers are synchronized once at construction (equal here: same seed)."""
    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def main(
    steps: int = 60,
    batch_size: int = 64,
    lr: float = 0.05,
    width_mult: float = 0.5,
    image_size: int = 16,
    seed: int = 0,
    out: str | None = None,
    num_threads: int | None = 1,
    float64: bool = False,
    timeout_s: float = 1800.0,
) -> dict:
    """Train with synchronized BatchNorm on every process of a torchrun job.

    ``steps`` steps of ``batch_size`` (the global batch, split over the processes with
    ``torch.tensor_split``: shares differ by one image at most); rank 0 prints the plan
    and the validation accuracy; ``out``: a folder where each rank saves its final
    state_dict (``rank{r}.pt``).

    Args:
        steps: training steps (at least 1).
        batch_size: the global batch size (at least 2: a training BatchNorm needs more
            than one value per channel; any split over the processes).
        lr: SGD's initial learning rate (momentum 0.9), falling linearly to 0.
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

    Returns:
        ``{"val_acc": float, "state": the final state_dict on the CPU}``.

    Raises:
        ValueError: ``steps`` < 1 or ``batch_size`` < 2 (before any process group
            starts).
        SystemExit: scikit-learn is missing (status 1, one line on stderr).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if batch_size < 2:
        raise ValueError(
            f"batch_size must be at least 2 (a training BatchNorm needs more "
            f"than one value per channel), got {batch_size}"
        )
    require_sklearn()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    cuda = torch.cuda.is_available()
    # how long a rank waits in one collective before it fails (torch's default: 30 min)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    (xt, yt), (xv, yv) = digits_split(image_size, seed=seed)
    dtype = torch.float64 if float64 else torch.float32
    xt, xv = xt.to(dtype), xv.to(dtype)

    model = build(width_mult, seed).to(device, dtype)
    bn_before = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    bnswap.convert(model, sync_batchnorm=True)  # BatchNorm2d -> swapped SyncBatchNorm
    if rank == 0:
        print(
            bnswap.plan(model).summary(),
            "| synchronized over:",
            bnswap.plan(model)[0].sync,
            "| kernel:",
            bnswap.plan(model)[0].kernel,
        )
    ddp = DDP(model, device_ids=[device.index] if cuda else None, **ddp_options())
    opt, schedule = optimizer(ddp, lr, steps)

    t0 = time.perf_counter()
    for step, idx in enumerate(global_batches(len(yt), batch_size, steps, seed)):
        mine = torch.tensor_split(idx, world)[rank]  # (uneven shares: see share_loss)
        x, y = xt[mine].to(device), yt[mine].to(device)
        loss = share_loss(ddp(x), y, batch_size, world)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients; SyncBatchNorm's all_reduce ran first
        opt.step()
        schedule.step()
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            # (rank 0's share is never empty: tensor_split gives the first ranks the rest)
            mean = loss.item() * batch_size / (world * len(y))
            print(f"step {step}: loss {mean:.4f} (mean over rank 0's share)")
    seconds = time.perf_counter() - t0

    bnswap.revert(model)  # the original BatchNorm2d objects, trained
    assert [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)] == bn_before
    model.eval()
    with torch.no_grad():
        acc = (model(xv.to(device)).argmax(1).cpu() == yv).float().mean().item()
    if rank == 0:
        print(
            f"{world} processes, {steps} steps in {seconds:.1f} s; val_acc {acc:.4f}; "
            f"the model holds {len(bn_before)} stock BatchNorm2d layers again"
        )
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if out is not None:
        os.makedirs(out, exist_ok=True)
        torch.save(state, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()
    return {"val_acc": acc, "state": state}


#: What ``--help`` says above the options (jsonargparse's own choice, the first line of
#: main's docstring, was cut mid-sentence when that sentence ran on).
DESCRIPTION = (
    "Synchronized BatchNorm with bnswap in plain PyTorch DDP (no Lightning), on any "
    "device: every process trains on its share of each global batch of the digits; rank 0 "
    "prints the plan and the validation accuracy. Run it with torchrun: torchrun "
    "--nproc_per_node=2 examples/ddp_syncbn.py [--steps 20 --out runs/syncbn]. Needs "
    "scikit-learn."
)

if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False, description=DESCRIPTION)
