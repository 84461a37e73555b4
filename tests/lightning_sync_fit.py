"""Fit a small net with Trainer(sync_batchnorm=True, accelerator="cpu", devices=2) (gloo)
and BNSwap(), and save what every rank saw.

    python tests/lightning_sync_fit.py {ddp|ddp_spawn} OUT_DIR

Stock Lightning cannot run this on the CPU (DDP refuses SyncBatchNorm there). At step k
rank r gets rows 8k + r, 8k + r + 2, ... of a fixed data set, so the two ranks' batches
are rows 8k .. 8k + 7: synchronized BatchNorm must train like one process on those 8
rows (:func:`reference`). Each rank writes OUT_DIR/<strategy>_rank<r>.pt: the layers seen at
every training step, the plan, the state after fit and whether the original layer
objects came back at teardown. Used by tests/test_lightning.py.
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

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import bnswap  # noqa: E402
from bnswap.lightning import BNSwap  # noqa: E402


class RankBatches(torch.utils.data.Dataset):
    """Item k: this rank's batch of step k, rows 8k + rank, 8k + rank + 2, ... (what a
    DistributedSampler without shuffling deals)."""

    def __len__(self):
        return STEPS

    def __getitem__(self, step):
        x, y = dataset()
        rows = torch.arange(
            2 * PER_RANK * step + torch.distributed.get_rank(), 2 * PER_RANK * (step + 1), 2
        )
        return x[rows], y[rows]


def reference() -> dict[str, torch.Tensor]:
    """One process, stock BatchNorm, the global batch of each step, float64: the state
    synchronized training must reach."""
    net = make_net().double()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = dataset()
    for step in range(STEPS):
        lo = step * 2 * PER_RANK
        xb, yb = x[lo : lo + 2 * PER_RANK].double(), y[lo : lo + 2 * PER_RANK].double()
        opt.zero_grad()
        nn.functional.mse_loss(net(xb), yb).backward()
        opt.step()
    return net.state_dict()


class Module(pl.LightningModule):
    def __init__(self, out_dir: str, strategy: str):
        super().__init__()
        self.out_dir, self.strategy = out_dir, strategy
        self.net = make_net()
        # the layer object, not a registered submodule (which the conversion would replace)
        object.__setattr__(self, "original", self.net[1])
        self.seen = []

    def training_step(self, batch, batch_idx):
        bn = self.net[1]
        self.seen.append(
            (
                type(bn).__name__,
                bnswap.is_swapped(bn),
                bn.weight is self.original.weight,
                bn.running_mean is self.original.running_mean,
                batch[0].clone(),
            )
        )
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def on_fit_end(self):  # after strategy.teardown (the layer sync's revert)
        cb = next(c for c in self.trainer.callbacks if isinstance(c, BNSwap))
        torch.save(
            {
                "seen": self.seen,
                "world_size": self.trainer.world_size,
                "plan": [(r.name, r.cls, r.action, r.sync) for r in cb.plan.rows],
                "plan_text": str(cb.plan),
                "original_back": self.net[1] is self.original,
                "original_swapped": bnswap.is_swapped(self.original),
                "layer_sync": type(self.trainer.strategy._layer_sync).__name__,
                "state": {k: v.detach().clone() for k, v in self.state_dict().items()},
            },
            os.path.join(self.out_dir, f"{self.strategy}_rank{self.global_rank}.pt"),
        )


def main(strategy: str, out_dir: str) -> None:
    trainer = pl.Trainer(
        # ddp / ddp_spawn as Lightning registers them, with a collective timeout of seconds
        strategy=DDPStrategy(
            start_method="spawn" if strategy == "ddp_spawn" else "popen",
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        ),
        accelerator="cpu",
        devices=2,
        sync_batchnorm=True,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[BNSwap()],
        use_distributed_sampler=False,
    )
    loader = torch.utils.data.DataLoader(RankBatches(), batch_size=None)
    trainer.fit(Module(out_dir, strategy), loader)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
