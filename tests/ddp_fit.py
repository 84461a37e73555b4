"""Fit a small ConvNet4 on the digits with Trainer(strategy="ddp", accelerator="cpu",
devices=2) (gloo), with or without BNSwap (``ort``: BNSwap(backend="ort"), ORTModule children
inside Lightning's DDP wrapper), and save every rank's final state.

    python tests/ddp_fit.py {stock|bnswap|ort} OUT_DIR

Lightning's launcher re-runs this script for rank 1; each rank writes
OUT_DIR/<variant>_rank<r>.pt with the state_dict, the BatchNorm classes and the plan.
Used by tests/test_ddp.py.
"""

import os
import sys
import warnings
from datetime import timedelta

import torch
from _helpers import COLLECTIVE_TIMEOUT_S
from torch import nn

torch.set_num_threads(1)  # two processes on two cores
warnings.filterwarnings("ignore", message=r".*(LeafSpec|does not have many workers).*")


def _kind(m: nn.Module) -> str:
    """The layer's class, and "(swapped)" when it runs bnswap's forward."""
    import bnswap

    name = type(m).__module__ + "." + type(m).__name__
    return name + " (swapped)" if bnswap.is_swapped(m) else name


def main(variant: str, out_dir: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from bnswap.app.data import DigitsDataModule
    from bnswap.app.models import ConvNet4
    from bnswap.lightning import BNSwap

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = None

        def configure_model(self):
            if self.net is None:
                self.net = ConvNet4(channels=(8, 16, 16, 32))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            self.classes_at_configure_optimizers = sorted(
                {_kind(m) for m in self.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
            )
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    pl.seed_everything(0)
    callbacks = {"stock": [], "bnswap": [BNSwap()], "ort": [BNSwap(backend="ort")]}[variant]
    trainer = pl.Trainer(
        strategy=DDPStrategy(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)),
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    model = Classifier()
    trainer.fit(model, DigitsDataModule(batch_size=32, image_size=8))
    rank = trainer.global_rank
    plan = callbacks[0].plan if callbacks else None
    ort_ops = None
    if variant == "ort":
        import bnswap.ort

        ort_ops = dict(bnswap.ort.executed_ops(model.net, training=True))
    torch.save(
        {
            "ort_ops": ort_ops,
            "net_type": type(model.net).__name__,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "classes": sorted(
                {
                    _kind(m)
                    for m in model.modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm)
                }
            ),
            "classes_at_configure_optimizers": model.classes_at_configure_optimizers,
            "plan": None if plan is None else [(r.name, r.action) for r in plan.rows],
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
        },
        os.path.join(out_dir, f"{variant}_rank{rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Join gloo's threads before the interpreter exits: left to process teardown they
    # sometimes aborted the run after it had finished ("terminate called without an
    # active exception", exit code -6; 2 of 6 runs here, on a 2-core VM).
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
