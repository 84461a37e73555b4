"""The LightningModule of the main job: an image classifier over :mod:`bnswap.app.models`.

The network is built from stock ``torch.nn`` layers; whether it trains on stock
BatchNorm or on bnswap layers is decided by the Trainer's callbacks (``bnswap.BNSwap``),
never by this module, so one config differs from the other by the callback alone.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import AttributeDict
from torch import Tensor, nn
from torch.nn import functional as F

from bnswap.app.models import build_model

__all__ = ["DigitsClassifier"]


class DigitsClassifier(pl.LightningModule):
    """Cross-entropy classifier with per-epoch validation loss / accuracy history.

    Args:
        arch: ``"mobilenetv2"``, ``"convnet4"`` or ``"resnet18"`` (see
            :func:`bnswap.app.models.build_model`), or a network of your own: an
            ``nn.Module`` taking (N, in_channels, H, W) float32 and returning (N,
            num_classes) logits (on the command line ``--model.arch mymodels.Net``, its
            arguments ``--model.arch.init_args.NAME VALUE``).
        num_classes, in_channels: passed to a named model (a network of your own is
            built by its own arguments).
        model_kwargs: further constructor arguments of the model (e.g. ``width_mult``).
        optimizer: ``"sgd"`` (momentum, Nesterov) or ``"adamw"``.
        lr: peak learning rate.
        weight_decay: decoupled (AdamW) or L2 (SGD) weight decay.
        momentum: SGD momentum.
        scheduler: ``"onecycle"`` (cosine one-cycle over the whole run, per step),
            ``"cosine"`` (per step, no warm-up) or ``"none"``.

    Batches are ``(x, y)``: x (N, in_channels, H, W) float32, y (N,) int64. Logs
    ``train_loss`` per step and ``val_loss`` / ``val_acc`` per epoch; ``history`` holds
    one dict ``{"epoch", "val_loss", "val_acc"}`` per validation epoch (sanity check
    excluded).

    Raises:
        ValueError: an unknown optimizer or scheduler; lr <= 0; weight_decay or momentum
            < 0; num_classes or in_channels < 1 (here, not mid-fit in torch.optim).
    """

    def __init__(
        self,
        arch: Literal["mobilenetv2", "convnet4", "resnet18"] | nn.Module = "mobilenetv2",
        num_classes: int = 10,
        in_channels: int = 1,
        model_kwargs: dict[str, Any] | None = None,
        optimizer: Literal["sgd", "adamw"] = "sgd",
        lr: float = 0.05,
        weight_decay: float = 5e-4,
        momentum: float = 0.9,
        scheduler: Literal["onecycle", "cosine", "none"] = "onecycle",
    ):
        super().__init__()
        if optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
        if scheduler not in ("onecycle", "cosine", "none"):
            raise ValueError(f"scheduler must be 'onecycle', 'cosine' or 'none', got {scheduler!r}")
        # what torch.optim would refuse only in configure_optimizers, mid-fit
        for name, value, ok, rule in (
            ("lr", lr, lr > 0, "> 0"),
            ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
            ("momentum", momentum, momentum >= 0, ">= 0"),
            ("num_classes", num_classes, num_classes >= 1, ">= 1"),
            ("in_channels", in_channels, in_channels >= 1, ">= 1"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {value}")
        own = isinstance(arch, nn.Module)
        # (a module is saved with the weights, not as a hyperparameter: Lightning's advice)
        self.save_hyperparameters(ignore=["arch"] if own else None)
        self.net: nn.Module = (
            arch
            if isinstance(arch, nn.Module)
            else build_model(
                arch, num_classes=num_classes, in_channels=in_channels, **(model_kwargs or {})
            )
        )
        self.history: list[dict[str, float]] = []
        self._val_sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.net(x)
        return logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_sums = torch.zeros(3, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self._val_sums += torch.stack(
            [
                F.cross_entropy(logits, y, reduction="sum").double(),
                (logits.argmax(1) == y).sum().double(),
                torch.tensor(float(len(y)), dtype=torch.float64, device=y.device),
            ]
        )

    def on_validation_epoch_end(self) -> None:
        sums = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum")
        val_loss = float(sums[0] / sums[2])
        val_acc = float(sums[1] / sums[2])
        # The sums above are reduced over all processes already, so every rank logs the
        # same values: sync_dist with max keeps them exact and tells Lightning they are
        # synchronized (without it, a ddp fit warned "It is recommended to use
        # `self.log('val_loss', ..., sync_dist=True)`" once per metric).
        self.log("val_loss", val_loss, prog_bar=True, sync_dist=True, reduce_fx="max")
        self.log("val_acc", val_acc, prog_bar=True, sync_dist=True, reduce_fx="max")
        if not self.trainer.sanity_checking:
            self.history.append(
                {"epoch": int(self.current_epoch), "val_loss": val_loss, "val_acc": val_acc}
            )

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def on_test_epoch_end(self) -> None:
        sums = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum")
        self.log("test_loss", float(sums[0] / sums[2]), sync_dist=True, reduce_fx="max")
        self.log("test_acc", float(sums[1] / sums[2]), sync_dist=True, reduce_fx="max")

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        logits: Tensor = self(batch[0])
        return logits.argmax(1)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        assert isinstance(hp, AttributeDict)  # save_hyperparameters() made it
        if hp.optimizer == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(
                self.parameters(),
                lr=hp.lr,
                momentum=hp.momentum,
                nesterov=True,
                weight_decay=hp.weight_decay,
            )
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        if hp.scheduler == "none":
            return opt
        # OneCycleLR needs a few steps per phase; tiny smoke runs just end early.
        total = max(8, int(self.trainer.estimated_stepping_batches))
        if hp.scheduler == "onecycle":
            sched: Any = torch.optim.lr_scheduler.OneCycleLR(
                opt, max_lr=hp.lr, total_steps=total, pct_start=0.25
            )
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
            )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
