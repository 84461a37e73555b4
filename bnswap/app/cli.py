"""The ``bnswap`` console script.

``bnswap train --config configs/digits_mobilenetv2.yaml``
    LightningCLI (jsonargparse): trains the configured model on the configured data.
    ``train`` is ``Trainer.fit`` under the name of the main job; ``validate``, ``test``
    and ``predict`` are LightningCLI's. Every option of the config can be overridden on
    the command line (``--trainer.max_epochs 3``); ``bnswap train --help`` lists them.
    After training it prints the final validation loss and accuracy.

``bnswap compare [--configs A.yaml B.yaml] [--out runs/compare.png]``
    Trains each config in turn (stock BatchNorm vs bnswap by default) and writes a PNG
    of validation loss and accuracy per epoch, and prints both final figures.

All argument parsing is jsonargparse's (through LightningCLI for the Trainer
subcommands, through ``jsonargparse.CLI`` for ``compare``).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

from bnswap.app.data import DigitsDataModule
from bnswap.app.task import DigitsClassifier
from bnswap.lightning import BNSwap

__all__ = ["BNSwapCLI", "Trainer", "compare", "main", "run_train"]

DEFAULT_CONFIGS = ("configs/digits_mobilenetv2_stock.yaml", "configs/digits_mobilenetv2.yaml")


class Trainer(pl.Trainer):
    """``lightning.pytorch.Trainer`` with :meth:`train`, the CLI's main-job subcommand."""

    def train(self, model: pl.LightningModule, train_dataloaders: Any = None,
              val_dataloaders: Any = None, datamodule: pl.LightningDataModule | None = None,
              ckpt_path: str | None = None) -> None:
        """Train the model (``Trainer.fit``) and report the final validation accuracy.

        Args:
            model: the LightningModule.
            train_dataloaders, val_dataloaders, datamodule: as in ``Trainer.fit``.
            ckpt_path: checkpoint to resume from.
        """
        self.fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path)


class BNSwapCLI(LightningCLI):
    """LightningCLI with the subcommands ``train`` (fit), ``validate``, ``test``,
    ``predict``, defaulting to :class:`~bnswap.app.task.DigitsClassifier` and
    :class:`~bnswap.app.data.DigitsDataModule` (any LightningModule / DataModule may be given
    with ``class_path``)."""

    def __init__(self, args: Sequence[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", DigitsClassifier)
        kwargs.setdefault("datamodule_class", DigitsDataModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("trainer_class", Trainer)
        kwargs.setdefault("parser_kwargs", {
            "prog": "bnswap",
            "description": "bnswap: train with BatchNorm on PyTorch's consolidated "
                           "batch-norm ops. Also: `bnswap compare --help`.",
        })
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        self.results: dict[str, Any] = {}
        super().__init__(args=args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--num_threads", type=int | None, default=1,
            help="torch intra-op threads (torch.set_num_threads). 1 by default: on a "
                 "machine whose cores other processes also use, more threads than free "
                 "cores make OpenMP spin (runs several times slower); on an idle 2-core "
                 "machine 2 is about 1.4x faster. null keeps torch's default.")

    def before_instantiate_classes(self) -> None:
        cfg = self.config.get(str(self.subcommand), self.config)
        n = cfg.get("num_threads")
        if n is not None:
            import torch

            torch.set_num_threads(int(n))

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        subs = dict(LightningCLI.subcommands())
        return {"train": subs["fit"], **{k: v for k, v in subs.items() if k != "fit"}}

    def after_train(self) -> None:
        """Print the plan summary and the final validation figures (global rank zero)."""
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()
                   if k in ("val_loss", "val_acc")}
        history = list(getattr(self.model, "history", []))
        swap = next((c for c in self.trainer.callbacks if isinstance(c, BNSwap)), None)
        self.results = {
            "batchnorm": "bnswap" if swap is not None else "stock",
            "backend": swap.backend if swap is not None else None,
            "plan": swap.plan.summary() if swap is not None and swap.plan is not None
            else "no BNSwap callback: stock torch.nn BatchNorm",
            "final": metrics, "history": history, "epochs": self.trainer.current_epoch,
        }
        if not self.trainer.is_global_zero:
            return
        log_dir = self.trainer.log_dir
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / "history.json").write_text(json.dumps(self.results, indent=1))
        print(self.results["plan"])
        if metrics:
            print(f"final validation accuracy: {metrics.get('val_acc', float('nan')):.4f}  "
                  f"(val_loss {metrics.get('val_loss', float('nan')):.4f}, "
                  f"{self.trainer.current_epoch} epochs, {self.results['batchnorm']} BatchNorm"
                  + (f", backend {swap.backend}" if swap is not None else "") + ")")


def run_train(args: Sequence[str]) -> BNSwapCLI:
    """Run ``bnswap train`` with ``args`` (everything after ``train``) in this process
    and return the CLI object (``.model``, ``.trainer``, ``.results``)."""
    return BNSwapCLI(args=["train", *args])


def compare(configs: list[str] | None = None, labels: list[str] | None = None,
            out: str = "runs/compare.png", overrides: list[str] | None = None) -> dict[str, Any]:
    """Train each config in turn and plot validation loss and accuracy per epoch.

    Args:
        configs: ``bnswap train`` config files; by default
            ``configs/digits_mobilenetv2_stock.yaml`` then ``configs/digits_mobilenetv2.yaml``
            (relative to the current folder).
        labels: legend labels (default: "stock" / "bnswap" from each run's callbacks).
        out: the PNG to write (parent folders are created); a JSON of the same name
            holds the figures.
        overrides: extra ``bnswap train`` arguments applied to every run, e.g.
            ``["--trainer.max_epochs=3"]``.

    Returns:
        ``{label: {"final": {...}, "history": [...], "seconds": float}}``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(DEFAULT_CONFIGS) if configs is None else configs
    results: dict[str, Any] = {}
    for i, cfg in enumerate(configs):
        t0 = time.perf_counter()
        cli = run_train(["--config", cfg, *(overrides or [])])
        res = dict(cli.results)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        res["config"] = cfg
        label = labels[i] if labels and i < len(labels) else res.get("batchnorm", cfg)
        if label in results:
            label = f"{label} ({cfg})"
        results[label] = res

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = [dict(marker="o", linestyle="-", markersize=7),
              dict(marker="x", linestyle="--", markersize=9, linewidth=2)]
    for i, (label, res) in enumerate(results.items()):
        epochs = [h["epoch"] + 1 for h in res["history"]]
        style = styles[i % len(styles)]
        ax_loss.plot(epochs, [h["val_loss"] for h in res["history"]], label=label, **style)
        ax_acc.plot(epochs, [h["val_acc"] for h in res["history"]], label=label, **style)
    ax_loss.set(xlabel="epoch", ylabel="validation loss (log scale)", title="Validation loss",
                yscale="log")
    ax_acc.set(xlabel="epoch", ylabel="validation accuracy", title="Validation accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    histories = [res["history"] for res in results.values()]
    same = len(histories) > 1 and all(h == histories[0] for h in histories)
    fig.suptitle("MobileNetV2-style net on scikit-learn digits: stock BatchNorm vs bnswap"
                 + ("\n(the curves coincide: identical figures at every epoch)" if same else ""))
    fig.tight_layout()
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    out_path.with_suffix(".json").write_text(json.dumps(results, indent=1))

    print(f"\nwrote {out_path}")
    for label, res in results.items():
        f = res["final"]
        print(f"{label:>8}: final val_acc {f.get('val_acc', float('nan')):.4f}  "
              f"val_loss {f.get('val_loss', float('nan')):.4f}  ({res['seconds']} s)")
    return results


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: ``bnswap compare ...`` goes to :func:`compare` (jsonargparse),
    everything else to :class:`BNSwapCLI` (``train`` / ``validate`` / ``test`` /
    ``predict``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    # Lightning 2.6 on torch 2.13 warns on every batch about torch's own pytree API.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    if args[:1] == ["compare"]:
        from jsonargparse import CLI

        CLI(compare, args=args[1:], as_positional=False)
        return
    # LightningCLI reads sys.argv itself; pass args only when called from Python (passing
    # both makes Lightning warn on every command-line run).
    BNSwapCLI(args=None if argv is None else args)


if __name__ == "__main__":  # pragma: no cover
    main()
