"""Train a small net with Lightning Fabric on 2 CPU ranks (gloo) and bnswap's synchronized
BatchNorm, converted before or after ``fabric.setup``; each rank saves its state.

    python tests/fabric_sync_fit.py {before|after} OUT_DIR

The recipe of docs/recipes.md: ``bnswap.convert(model, sync_batchnorm=True)`` (stock's
``nn.SyncBatchNorm.convert_sync_batchnorm`` is refused by DDP on the CPU). At step k rank r
gets rows 8k + r, 8k + r + 2, ... of a fixed data set, so the two ranks' batches are rows
8k .. 8k + 7: synchronized BatchNorm must train like one process on those 8 rows
(:func:`reference`). Each rank writes OUT_DIR/<when>_rank<r>.pt. Used by
tests/test_recipes.py.
"""

import os
import sys
import warnings
from datetime import timedelta

import torch
from _helpers import COLLECTIVE_TIMEOUT_S
from _helpers import SYNC_LR as LR
from _helpers import SYNC_PER_RANK as PER_RANK
from _helpers import SYNC_STEPS as STEPS
from _helpers import sync_dataset as dataset
from _helpers import sync_net as make_net
from torch import nn

torch.set_num_threads(1)  # two processes on two cores
warnings.filterwarnings("ignore", message=r".*(LeafSpec|does not have many workers).*")

import lightning as L  # noqa: E402
from lightning.fabric.strategies import DDPStrategy  # noqa: E402

import bnswap  # noqa: E402


def reference() -> dict[str, torch.Tensor]:
    """One process, stock BatchNorm, the global batch of each step, float64."""
    net = make_net().double()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = dataset()
    for step in range(STEPS):
        lo = step * 2 * PER_RANK
        opt.zero_grad()
        nn.functional.mse_loss(
            net(x[lo : lo + 2 * PER_RANK].double()), y[lo : lo + 2 * PER_RANK].double()
        ).backward()
        opt.step()
    return net.state_dict()


def main(when: str, out_dir: str) -> None:
    fabric = L.Fabric(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)),
    )
    fabric.launch()
    net = make_net()
    if when == "before":
        bnswap.convert(net, sync_batchnorm=True)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model, opt = fabric.setup(net, opt)
    if when == "after":
        bnswap.convert(model, sync_batchnorm=True)
    x, y = dataset()
    seen = []
    for step in range(STEPS):
        rows = torch.arange(2 * PER_RANK * step + fabric.global_rank, 2 * PER_RANK * (step + 1), 2)
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x[rows]), y[rows]))
        opt.step()
        seen.append((type(net[1]).__name__, bnswap.is_swapped(net[1])))
    torch.save(
        {
            "seen": seen,
            "world_size": fabric.world_size,
            "state": {k: v.detach().clone() for k, v in net.state_dict().items()},
        },
        os.path.join(out_dir, f"{when}_rank{fabric.global_rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
