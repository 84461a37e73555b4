"""The Lightning subcommands of the ``bnswap`` console script (``bnswap --help`` lists
every subcommand).

The console script's front door, ``_bnswap_command`` (outside the package: it imports
no torch), holds the subcommand table and dispatches here (:func:`run_lightning_subcommand`)
and to :mod:`bnswap.app.plan_cli` / :mod:`bnswap.app.convert_cli`; this module never
imports it back. Run them as ``bnswap SUBCOMMAND`` (or ``python -m _bnswap_command
SUBCOMMAND``).

``bnswap train --config configs/digits_mobilenetv2.yaml``
    LightningCLI (jsonargparse): trains the configured model on the configured data.
    ``train`` is ``Trainer.fit`` under the name of the main job; ``validate``, ``test``
    and ``predict`` are LightningCLI's. Every option of the config can be overridden on
    the command line (``--trainer.max_epochs 3``); ``bnswap train --help`` lists them.
    After training it prints the final validation loss and accuracy.

``bnswap compare [--configs A.yaml B.yaml] [--out runs/compare.png]``
    Trains each config in turn (stock BatchNorm vs bnswap by default) and writes a PNG
    of validation loss and accuracy per epoch (and a JSON of the figures), and prints
    the final figures and the seconds per epoch of each run.

``bnswap plan --model torchvision.models.resnet18`` (or ``--config ...``, ``--program``)
    What bnswap would swap in a model, before training (:mod:`bnswap.app.plan_cli`).

``bnswap convert model.pt2 -o model_bnswap.pt2``
    A ``torch.export`` program file with its batch-norm nodes on the consolidated ops
    (:func:`bnswap.app.convert_cli.convert_main`).

A ``--config`` that is not a file but the name of a config shipped with bnswap
(:mod:`bnswap.app.configs`) is read from the package, so the commands work from any
folder. All argument parsing is jsonargparse's (through LightningCLI for the Trainer
subcommands, through ``jsonargparse.CLI`` for ``compare``).
"""

from __future__ import annotations

import json
import re
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args, get_origin, get_type_hints

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from bnswap.app import configs as shipped
from bnswap.app.data import DigitsDataModule
from bnswap.app.messages import did_you_mean, import_path, short_error, unrecognized_error
from bnswap.app.task import DigitsClassifier
from bnswap.lightning import BNSwap

__all__ = [
    "BNSwapCLI",
    "CompareUsageError",
    "Trainer",
    "compare",
    "plot",
    "run_lightning_subcommand",
    "run_train",
]

#: The shipped configs' model and data, imported so that ``bnswap train --help`` lists
#: them among ``--model`` / ``--data``'s known subclasses.
SHIPPED_CLASSES = (DigitsClassifier, DigitsDataModule)

#: ``ckpt_path`` values Lightning resolves itself (not file names).
_CKPT_ALIASES = ("last", "best", "hpc", "registry")

DEFAULT_CONFIGS = ("digits_mobilenetv2_stock.yaml", "digits_mobilenetv2.yaml")


class Trainer(pl.Trainer):
    """Lightning's Trainer with a train method, the CLI's main-job subcommand.

    Its docstrings' first lines are ``bnswap train --help``'s group titles and descriptions
    (jsonargparse prints them as they are): plain text, no reST roles.
    """

    def train(
        self,
        model: pl.LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: pl.LightningDataModule | None = None,
        ckpt_path: str | None = None,
    ) -> None:
        """Train the model (Trainer.fit) and report the final validation accuracy.

        Args:
            model: the LightningModule.
            train_dataloaders, val_dataloaders, datamodule: as in ``Trainer.fit``.
            ckpt_path: checkpoint to resume from.
        """
        t0 = time.perf_counter()
        self.fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path)
        #: Wall-clock seconds of the fit (validation included).
        self.fit_seconds = round(time.perf_counter() - t0, 2)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer.predict, keeping what it returns in self.predictions.

        The ``predict`` subcommand writes them to a file.
        """
        #: What the last ``predict`` returned: one tensor per batch.
        self.predictions = super().predict(*args, **kwargs)
        return self.predictions


class _Parser(LightningArgumentParser):
    """LightningCLI's parser, with its errors in one or two lines (no usage dump)."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        missing = _REQUIRED.search(message)
        if missing and prog == "bnswap":
            # the top parser reports a subcommand's missing options as "train.model"
            keys = [k.strip() for k in missing.group("keys").split(",")]
            sub = keys[0].split(".", 1)[0]
            if sub in BNSwapCLI.subcommands() and all(k.startswith(sub + ".") for k in keys):
                prog = f"bnswap {sub}"
                message = (
                    "missing "
                    + ", ".join("--" + k.split(".", 1)[1] for k in keys)
                    + " (a config gives them: --config digits_mobilenetv2.yaml)"
                )
        text = (
            _wrong_class(message)
            or _callback_option(message)
            or unrecognized_error(message, _option_strings(parser))
            or short_error(message)
        )
        _usage_error(prog, text)


_REQUIRED = re.compile(r"the following arguments are required: (?P<keys>.+)")
_KEY = re.compile(r'Parser key "(?P<key>[^"]+)"')
_NOT_SUBCLASS = re.compile(r"Import path does not correspond to a subclass of (?P<base>\w+)")
_GIVEN = re.compile(r"^\s*Given value: (?P<value>.*)$", re.MULTILINE)
_NOT_ACCEPTED = re.compile(r"Option '(?P<name>[^']+)' is not accepted")
_NESTED = re.compile(r"NestedArg\(key='(?P<key>[^']+)', val='(?P<val>[^']*)'\)")


def _option_strings(parser: Any) -> list[str]:
    """Every ``--option`` ``parser`` takes (its nested ``--trainer.max_epochs`` too)."""
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]


def _wrong_class(message: str) -> str | None:
    """jsonargparse's "Import path does not correspond to a subclass of LightningModule"
    (after "Expected a path but mymodels.Tiny either not accessible or invalid") for
    ``--model`` / ``--data`` naming an importable class of another kind, as what it is
    and what to give: a plain ``nn.Module`` is trained as the digits classifier's
    network (``--model.arch``). None for any other message."""
    import inspect

    from torch import nn

    wrong, key = _NOT_SUBCLASS.search(message), _KEY.match(message.strip())
    given = _GIVEN.findall(message)
    if wrong is None or key is None or not given:
        return None
    path = given[-1].strip()
    obj = import_path(path)
    if obj is None:
        return None
    base = wrong.group("base")
    if key.group("key") == "model" and (
        (inspect.isclass(obj) and issubclass(obj, nn.Module)) or inspect.isfunction(obj)
    ):
        kind = "an nn.Module" if inspect.isclass(obj) else "a function"
        return (
            f"model: {path} is {kind}, not a LightningModule (which adds the loss, "
            "optimizer and training step): train it as the digits classifier's network, "
            f"--config digits_mobilenetv2.yaml --model.arch {path} (its arguments: "
            f"--model.arch.NAME VALUE), or give a LightningModule"
        )
    return f"{key.group('key')}: {path} is no {base} subclass"


def _callback_option(message: str) -> str | None:
    """``--trainer.callbacks.backend cuda`` where no callback takes ``backend`` (no
    ``--config``, or a stock one): jsonargparse's "Option 'backend' is not accepted" as
    the error a BNSwap callback gives the same value (``expected one of 'aten', 'ort',
    got 'cuda'``), and how to add one. For an option no callback of the list takes, the
    closest that the ones given take. None for any other message."""
    import inspect

    key = _KEY.match(message.strip())
    refused = _NOT_ACCEPTED.search(message)
    nested = _NESTED.search(message)
    if (
        key is None
        or key.group("key") != "trainer.callbacks"
        or refused is None
        or not short_error(message).endswith("is not accepted")  # (a callback took it)
    ):
        return None
    name = refused.group("name")
    params = get_type_hints(BNSwap.__init__)
    if name not in params:
        named = re.findall(r"Problem with given class_path '([^']+)'", message)
        taken = [
            p
            for path in dict.fromkeys(named)
            if inspect.isclass(cls := import_path(path))
            for p in inspect.signature(cls.__init__).parameters
            if p not in ("self", "args", "kwargs")
        ]
        return f"trainer.callbacks: option {name!r} is taken by no callback given" + (
            did_you_mean(name, taken) if taken else ""
        )
    value = nested.group("val") if nested is not None and nested.group("key") == name else None
    add = (
        f"add one first (--trainer.callbacks bnswap.BNSwap --trainer.callbacks.{name} "
        "VALUE) or use a config that has one (--config digits_mobilenetv2.yaml)"
    )
    choices = get_args(params[name])
    if get_origin(params[name]) is Literal and value is not None and value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        return (
            f"trainer.callbacks.{name}: expected one of {listed}, got {value!r}; and no "
            f"BNSwap callback is given to take it: {add}"
        )
    return f"trainer.callbacks.{name}: no BNSwap callback is given to take it: {add}"


#: The subcommand a usage error is reported under when another one runs ``train``
#: (``bnswap compare`` passes its train options on: a typo there is compare's error).
_reporting_as: list[str] = []


def _usage_error(prog: str, message: str) -> NoReturn:
    """Print ``prog: error: message`` and the help hint; exit with status 2 (argparse's)."""
    if _reporting_as:
        prog = _reporting_as[-1]
    sys.stderr.write(f"{prog}: error: {message}\n({prog} --help lists every option)\n")
    raise SystemExit(2)


class BNSwapCLI(LightningCLI):
    """LightningCLI with the subcommands ``train`` (fit), ``validate``, ``test``,
    ``predict``. ``--model`` takes any LightningModule and ``--data`` any
    LightningDataModule (a class path; the shipped configs give
    :class:`~bnswap.app.task.DigitsClassifier` and :class:`~bnswap.app.data.DigitsDataModule`);
    a plain ``nn.Module`` trains as the digits classifier's network, ``--model.arch
    mymodels.Net`` (``--model mymodels.Net`` is a usage error that says so)."""

    def __init__(self, args: Sequence[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", pl.LightningModule)
        kwargs.setdefault("datamodule_class", pl.LightningDataModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("trainer_class", Trainer)
        kwargs.setdefault("parser_class", _Parser)
        kwargs.setdefault(
            "parser_kwargs",
            {
                "prog": "bnswap",
                "description": "bnswap: train with BatchNorm on PyTorch's consolidated "
                "batch-norm ops. Also: `bnswap compare --help`.",
            },
        )
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        self.results: dict[str, Any] = {}
        super().__init__(args=list(args) if args is not None else None, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--num_threads",
            type=int | None,
            default=1,
            help="torch intra-op threads (torch.set_num_threads). 1 by default: on a "
            "machine whose cores other processes also use, more threads than free "
            "cores make OpenMP spin (runs several times slower); on an idle 2-core "
            "machine 2 is about 1.4x faster. null keeps torch's default.",
        )

    def before_instantiate_classes(self) -> None:
        cfg = self.config.get(str(self.subcommand), self.config)
        n = cfg.get("num_threads")
        if n is not None and n < 1:
            _usage_error(
                f"bnswap {self.subcommand}",
                f"num_threads: expected a positive integer or null, got {n}",
            )
        if n is not None:
            import torch

            torch.set_num_threads(int(n))
        # The logger writes under --trainer.default_root_dir unless its save_dir is given.
        trainer = cfg.get("trainer")
        logger = trainer.get("logger") if trainer is not None else None
        init = getattr(logger, "init_args", None) if logger is not None else None
        if init is not None and "save_dir" in init and init.get("save_dir") is None:
            init["save_dir"] = trainer.get("default_root_dir") or "."

    def instantiate_classes(self) -> None:
        """Build the Trainer, model and data; a value they refuse (``--trainer.max_epochs
        -3``, ``--data.batch_size 0``: Lightning's MisconfigurationException, a
        ValueError) is a usage error in two lines, as a parse error is, before any
        training starts."""
        prog = f"bnswap {self.subcommand}" if self.subcommand else "bnswap"
        cfg = self.config.get(str(self.subcommand), self.config)
        ckpt = cfg.get("ckpt_path") if hasattr(cfg, "get") else None
        if (
            isinstance(ckpt, str)
            and ckpt not in _CKPT_ALIASES
            and "://" not in ckpt
            and not Path(ckpt).is_file()
        ):
            _usage_error(prog, f"ckpt_path: no such file: {ckpt!r}")
        try:
            super().instantiate_classes()
        except (MisconfigurationException, ValueError) as e:
            _usage_error(prog, short_error(str(e)))
        callbacks = self.trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's _CallbackConnector, undeclared on Trainer
        if any(isinstance(cb, BNSwap) and cb.backend == "ort" for cb in callbacks):
            import bnswap

            try:  # (BNSwap.setup would raise it mid-run, with a traceback)
                bnswap.ort.check_python()
                if not bnswap.ort.is_available():
                    raise bnswap.ort.ORTNotAvailableError(
                        "BNSwap(backend='ort') needs ONNX Runtime training and torch-ort: "
                        + bnswap.ort.INSTALL
                    )
            except bnswap.ort.ORTNotAvailableError as e:
                _usage_error(prog, f"trainer.callbacks: {e}")

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        subs = dict(LightningCLI.subcommands())
        return {"train": subs["fit"], **{k: v for k, v in subs.items() if k != "fit"}}

    def after_train(self) -> None:
        """Print the plan summary and the final validation figures (global rank zero)."""
        history = list(getattr(self.model, "history", []))
        # the last epoch's float64 figures (callback_metrics holds them as float32 tensors,
        # so "final" and the history's last entry differed in the 8th digit)
        metrics = (
            {k: v for k, v in history[-1].items() if k != "epoch"}
            if history
            else {
                k: float(v)
                for k, v in self.trainer.callback_metrics.items()
                if k in ("val_loss", "val_acc")
            }
        )
        callbacks = self.trainer.callbacks  # type: ignore[attr-defined]  # as above
        swap = next((c for c in callbacks if isinstance(c, BNSwap)), None)
        epochs = self.trainer.current_epoch
        seconds = getattr(self.trainer, "fit_seconds", None)
        self.results = {
            "batchnorm": "bnswap" if swap is not None else "stock",
            "backend": swap.backend if swap is not None else None,
            "plan": swap.plan.summary()
            if swap is not None and swap.plan is not None
            else "no BNSwap callback: stock torch.nn BatchNorm",
            "final": metrics,
            "history": history,
            "epochs": epochs,
            "fit_seconds": seconds,
            "seconds_per_epoch": round(seconds / epochs, 2) if seconds and epochs else None,
        }
        # Trainer.log_dir broadcasts rank zero's folder: every rank must ask (rank zero
        # waited on a broadcast the others never joined, and a 2-device fit ended in
        # "Connection closed by peer" after training)
        log_dir = self.trainer.log_dir
        if not self.trainer.is_global_zero:
            return
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / "history.json").write_text(json.dumps(self.results, indent=1))
        print(self.results["plan"])
        if metrics:
            print(
                f"final validation accuracy: {metrics.get('val_acc', float('nan')):.4f}  "
                f"(val_loss {metrics.get('val_loss', float('nan')):.4f}, "
                f"{epochs} epoch{'' if epochs == 1 else 's'}, "
                f"{self.results['batchnorm']} BatchNorm"
                + (f", backend {swap.backend}" if swap is not None else "")
                + ")"
            )

    def after_predict(self) -> None:
        """Write the predictions (one tensor per batch, as ``Trainer.predict`` returns
        them) to ``predictions.pt`` under ``--trainer.default_root_dir`` and say where
        (global rank zero)."""
        predictions = getattr(self.trainer, "predictions", None)
        if predictions is None or not self.trainer.is_global_zero:
            return
        import torch

        path = Path(self.trainer.default_root_dir) / "predictions.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(predictions, path)
        rows = sum(len(p) for p in predictions if hasattr(p, "__len__"))
        print(
            f"wrote {path}: {rows} predictions in {len(predictions)} batches "
            "(torch.load it: a list of tensors, one per batch)"
        )


def run_train(args: Sequence[str]) -> BNSwapCLI:
    """Run ``bnswap train`` with ``args`` (everything after ``train``) in this process
    and return the CLI object (``.model``, ``.trainer``, ``.results``)."""
    # LightningCLI warns when it gets args while sys.argv holds others (it cannot tell a
    # run from Python from a mistake); these args are the whole command.
    saved = sys.argv
    sys.argv = saved[:1]
    try:
        return BNSwapCLI(args=["train", *_resolve_configs(list(args))])
    finally:
        sys.argv = saved


def _resolve_configs(args: list[str]) -> list[str]:
    """``--config NAME`` (or ``--config=NAME``) of a shipped config, as its path."""
    out = list(args)
    for i, a in enumerate(out):
        if a == "--config" and i + 1 < len(out):
            out[i + 1] = _resolve(out[i + 1])
        elif a.startswith("--config="):
            out[i] = "--config=" + _resolve(a.split("=", 1)[1])
    return out


def _resolve(value: str) -> str:
    try:
        return shipped.resolve(value)
    except FileNotFoundError:
        return value  # LightningCLI's own error, naming the path


class CompareUsageError(ValueError):
    """:func:`compare`'s arguments refused before any run: a config not found, labels
    that do not match the configs, an ``out`` whose folder cannot be made."""


def _root_dir(overrides: Sequence[str]) -> str:
    """The ``--trainer.default_root_dir`` among ``bnswap train`` options (the last one
    given), else ``runs``, Lightning's logs' root in the shipped configs."""
    root = "runs"
    for i, a in enumerate(overrides):
        if a.startswith("--trainer.default_root_dir="):
            root = a.split("=", 1)[1]
        elif a == "--trainer.default_root_dir" and i + 1 < len(overrides):
            root = overrides[i + 1]
    return root


#: Under ``bnswap compare``'s figures: its seconds are no speed comparison. One run of each
#: config, in turn, in one process: the first also pays the process's warm-up (imports,
#: first-call allocations, caches), so whichever runs first looks slower.
TIMES_NOTE = (
    "(wall times of one run each, in run order: not a speed comparison, the first "
    "run also pays the process's warm-up; `python -m benchmarks` measures speed in "
    "interleaved pairs)"
)


def compare(
    configs: list[str] | None = None,
    labels: list[str] | None = None,
    out: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Train each config in turn and plot validation loss and accuracy per epoch.

    Args:
        configs: ``bnswap train`` config files (paths, or names of the configs shipped
            with bnswap); by default ``digits_mobilenetv2_stock.yaml`` then
            ``digits_mobilenetv2.yaml``.
        labels: legend labels (default: "stock", or "bnswap (aten)" / "bnswap (ort)" from
            each run's callback).
        out: the PNG to write (parent folders are created); a JSON of the same name
            holds the figures. Default: ``compare.png`` under
            ``--trainer.default_root_dir`` (``runs``).
        overrides: extra ``bnswap train`` arguments applied to every run, e.g.
            ``["--trainer.max_epochs=3"]`` (on the command line, ``bnswap compare
            --trainer.max_epochs 3`` does the same: split_compare_args moves them here).

    Returns:
        ``{label: {"final": {...}, "history": [...], "seconds": float,
        "seconds_per_epoch": float, ...}}`` (also written next to ``out`` as JSON). The
        seconds are one run's wall time each, in run order: no speed comparison
        (:data:`TIMES_NOTE`, printed under them).

    Raises:
        CompareUsageError: (a ValueError) before any run: a config that is neither a file
            nor shipped with bnswap, labels not one per config, ``out``'s folder not
            creatable.
    """
    configs = list(DEFAULT_CONFIGS) if configs is None else configs
    if out is None:
        out = str(Path(_root_dir(overrides or [])) / "compare.png")
    # Checked before the first run trains: every config found, the labels, --out.
    try:
        for cfg in configs:
            shipped.resolve(cfg)
    except FileNotFoundError as e:  # neither a file nor a shipped config
        raise CompareUsageError(f"configs: {e}") from None
    if labels is not None and len(labels) != len(configs):
        raise CompareUsageError(f"labels: {len(labels)} given for {len(configs)} configs")
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CompareUsageError(str(e)) from None
    results: dict[str, Any] = {}
    for i, cfg in enumerate(configs):
        t0 = time.perf_counter()
        _reporting_as.append("bnswap compare")
        try:
            cli = run_train(["--config", cfg, *(overrides or [])])
        finally:
            _reporting_as.pop()
        res = dict(cli.results)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        res["config"] = cfg
        default = res.get("batchnorm", cfg)
        if res.get("backend"):
            default += f" ({res['backend']})"
        label = labels[i] if labels and i < len(labels) else default
        if label in results:
            label = f"{label} ({cfg})"
        results[label] = res

    fig = plot(results)
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    out_path.with_suffix(".json").write_text(json.dumps(results, indent=1))

    print(f"\nwrote {out_path} and {out_path.with_suffix('.json')}")
    width = max(len(label) for label in results)
    for run, (label, res) in enumerate(results.items(), 1):
        f = res["final"]
        per = res.get("seconds_per_epoch")
        print(
            f"{label:>{width}}: final val_acc {f.get('val_acc', float('nan')):.4f}  "
            f"val_loss {f.get('val_loss', float('nan')):.4f}  (run {run}: {res['seconds']} s"
            + (f", {per} s per epoch" if per is not None else "")
            + ")"
        )
    if len(results) > 1:
        print(TIMES_NOTE)
    return results


def plot(results: dict[str, Any]) -> Any:
    """The figure ``bnswap compare`` writes: validation loss (log scale) and accuracy per
    epoch, one curve per run, epochs counted from 1 on whole-number ticks.

    Args:
        results: ``{label: {"history": [{"epoch": int (from 0), "val_loss": float,
            "val_acc": float}, ...]}, ...}``, as :func:`compare` returns.

    Returns:
        The matplotlib ``Figure`` (Agg backend; the caller saves and closes it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = [
        dict(marker="o", linestyle="-", markersize=7),
        dict(marker="x", linestyle="--", markersize=9, linewidth=2),
    ]
    for i, (label, res) in enumerate(results.items()):
        epochs = [h["epoch"] + 1 for h in res["history"]]
        style = styles[i % len(styles)]
        ax_loss.plot(epochs, [h["val_loss"] for h in res["history"]], label=label, **style)
        ax_acc.plot(epochs, [h["val_acc"] for h in res["history"]], label=label, **style)
    ax_loss.set(
        xlabel="epoch", ylabel="validation loss (log scale)", title="Validation loss", yscale="log"
    )
    ax_acc.set(xlabel="epoch", ylabel="validation accuracy", title="Validation accuracy")
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole epochs
        ax.grid(alpha=0.3)
        ax.legend()
    histories = [res["history"] for res in results.values()]
    same = len(histories) > 1 and all(h == histories[0] for h in histories)
    fig.suptitle(
        "MobileNetV2-style net on scikit-learn digits: "
        + " vs ".join(results)
        + ("\n(the curves coincide: identical figures at every epoch)" if same else "")
    )
    fig.tight_layout()
    return fig


#: ``bnswap train`` options that ``bnswap compare`` passes on to every run.
TRAIN_OPTIONS = ("--trainer.", "--model.", "--data.", "--seed_everything")
#: ``bnswap compare`` options that take several values (``--configs A.yaml B.yaml``, or
#: a JSON list).
LIST_OPTIONS = ("--configs", "--labels")


def split_compare_args(args: Sequence[str]) -> list[str]:
    """``bnswap compare``'s arguments with every ``bnswap train`` option (``--trainer.*``,
    ``--model.*``, ``--data.*``, ``--seed_everything``, as ``--key value`` or
    ``--key=value``) moved into ``--overrides`` (after any given there), and the values
    of ``--configs`` / ``--labels`` given one by one made a JSON list.

    Examples::

        >>> split_compare_args(["--out", "c.png", "--trainer.max_epochs", "3"])
        ['--out', 'c.png', '--overrides', '["--trainer.max_epochs=3"]']
        >>> split_compare_args(["--configs", "a.yaml", "b.yaml", "--out", "c.png"])
        ['--configs', '["a.yaml", "b.yaml"]', '--out', 'c.png']
    """
    rest: list[str] = []
    passed: list[str] = []
    given: list[str] = []
    items = list(args)
    i = 0
    while i < len(items):
        a = items[i]
        key = a.split("=", 1)[0]
        if key.startswith(TRAIN_OPTIONS):
            if "=" in a or i + 1 == len(items):
                passed.append(a)
            else:
                passed.append(f"{a}={items[i + 1]}")
                i += 1
        elif (
            key in LIST_OPTIONS
            and "=" not in a
            and i + 1 < len(items)
            and not items[i + 1].lstrip().startswith("[")
        ):
            # --configs A.yaml B.yaml: the values up to the next option, as one list
            values = []
            while i + 1 < len(items) and not items[i + 1].startswith("--"):
                values.append(items[i + 1])
                i += 1
            rest += [a, json.dumps(values)]
        elif key == "--overrides" and "=" not in a and i + 1 < len(items):
            given.extend(json.loads(items[i + 1]))
            i += 1
        elif key == "--overrides":
            given.extend(json.loads(a.split("=", 1)[1]))
        else:
            rest.append(a)
        i += 1
    if given or passed:
        rest += ["--overrides", json.dumps(given + passed)]
    return rest


def run_lightning_subcommand(args: list[str], from_sys_argv: bool) -> None:
    """The Lightning subcommands, as the front door (:func:`_bnswap_command.main`)
    dispatches them: ``compare`` to :func:`compare` (jsonargparse), ``train`` /
    ``validate`` / ``test`` / ``predict`` to :class:`BNSwapCLI`. ``args`` starts with the
    subcommand; ``from_sys_argv``: LightningCLI reads ``sys.argv`` itself (it warns when
    given both)."""
    # Lightning 2.6 on torch 2.13 warns on every batch about torch's own pytree API.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    if args[0] == "compare":
        from jsonargparse import CLI

        try:
            CLI(
                compare,
                args=split_compare_args(args[1:]),
                as_positional=False,
                prog="bnswap compare",
            )
        except CompareUsageError as e:  # refused before any run (not a run's own error)
            _usage_error("bnswap compare", str(e))
        return
    resolved = _resolve_configs(args)
    if from_sys_argv:
        sys.argv = [sys.argv[0], *resolved]
        BNSwapCLI(args=None)
    else:
        saved, sys.argv = sys.argv, sys.argv[:1]
        try:
            BNSwapCLI(args=resolved)
        finally:
            sys.argv = saved
    _end_process_group()


def _end_process_group() -> None:
    """Destroy the default process group a multi-device run made, as torch asks every
    script to do before it exits: Lightning leaves it, and a 2-device ``ddp`` ``bnswap
    train`` was seen to abort at interpreter exit ("terminate called without an active
    exception", exit -6) after a finished fit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover - the entry point is the front door
    print(
        "bnswap.app.cli: error: no command of its own: run bnswap SUBCOMMAND (bnswap "
        "--help lists them), or python -m _bnswap_command SUBCOMMAND",
        file=sys.stderr,
    )
    sys.exit(2)
