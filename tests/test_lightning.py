"""The BNSwap Lightning callback, with real Trainers on the real digits data.

Every value is checked against the same run with stock BatchNorm (no callback): on CPU
the consolidated ops run the same native kernels, so states must agree bit for bit.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import sys
import warnings
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import bnswap

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from bnswap.app.data import DigitsDataModule  # noqa: E402
from bnswap.app.models import ConvNet4  # noqa: E402
from bnswap.lightning import BNSwap  # noqa: E402
from tests._helpers import COLLECTIVE_TIMEOUT_S, rank_env, rank_script, run_processes  # noqa: E402

CH = (8, 16, 16, 32)  # a small ConvNet4: fast on 2 cores
RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"  # where rank_zero_info logs


def bn_layers(module: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in module.named_modules() if isinstance(m, _BatchNorm)}


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"differ: {diff}"


def data(**kw) -> DigitsDataModule:
    kw.setdefault("batch_size", 32)
    kw.setdefault("image_size", 8)
    return DigitsDataModule(**kw)


def trainer(callbacks=(), **kw) -> pl.Trainer:
    args = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        num_sanity_val_steps=0,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
    )
    args.update(kw)
    return pl.Trainer(callbacks=list(callbacks), **args)


class Classifier(pl.LightningModule):
    """A ConvNet4 classifier; ``build="configure_model"`` builds the net there."""

    def __init__(self, build: str = "init", lr: float = 0.05, sched: bool = False):
        super().__init__()
        self.build, self.lr, self.sched = build, lr, sched
        self.net: nn.Module | None = ConvNet4(channels=CH) if build == "init" else None
        self.seen: dict[str, object] = {}

    def configure_model(self) -> None:
        if self.net is None:
            self.net = ConvNet4(channels=CH)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.setdefault("train_swapped", []).append(
            [bnswap.is_swapped(m) for m in bn_layers(self).values()]
        )
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.seen.setdefault("val_swapped", []).append(
            [bnswap.is_swapped(m) for m in bn_layers(self).values()]
        )
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.seen.setdefault("test_swapped", []).append(
            [bnswap.is_swapped(m) for m in bn_layers(self).values()]
        )
        self.log("test_loss", nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        self.seen.setdefault("predict_swapped", []).append(
            [bnswap.is_swapped(m) for m in bn_layers(self).values()]
        )
        return self(batch[0])

    def configure_optimizers(self):
        self.seen["bn_swapped_at_configure_optimizers"] = {
            n: bnswap.is_swapped(m) for n, m in bn_layers(self).items()
        }
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        if not self.sched:
            return opt
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=self.lr, total_steps=int(self.trainer.estimated_stepping_batches)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(pl.Callback):
    """Records what the model looks like when fit starts."""

    def on_fit_start(self, trainer, pl_module):
        self.bn_at_fit_start = bn_layers(pl_module)
        self.opt_param_ids = {
            id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]
        }


def global_registration_hooks() -> int:
    from torch.nn.modules import module as torch_module

    return len(torch_module._global_module_registration_hooks)


def fit_pair(make_model, make_trainer_kwargs=None, swap_kwargs=None, extra_callbacks=()):
    """Fit the same model with stock BatchNorm and with BNSwap; return both models."""
    out = {}
    for variant in ("stock", "bnswap"):
        pl.seed_everything(0)
        model = make_model()
        cbs = [*(cb() for cb in extra_callbacks)]
        if variant == "bnswap":
            cbs.insert(0, BNSwap(**(swap_kwargs or {})))
        t = trainer(cbs, **(make_trainer_kwargs or {}))
        t.fit(model, data())
        out[variant] = (model, t)
    return out


# --------------------------------------------------------------------------- given case 1
def test_configure_model_layers_are_swapped_before_the_optimizer_exists():
    runs = fit_pair(lambda: Classifier(build="configure_model"), extra_callbacks=[Recorder])
    model, t = runs["bnswap"]
    # configure_optimizers (inside strategy.setup) already saw bnswap layers only
    classes = model.seen["bn_swapped_at_configure_optimizers"]
    assert len(classes) == 4 and all(classes.values())
    rec = next(c for c in t.callbacks if isinstance(c, Recorder))
    assert rec.bn_at_fit_start and all(bnswap.is_swapped(m) for m in rec.bn_at_fit_start.values())
    # the optimizer holds exactly the model's parameters, the bnswap layers' included
    assert rec.opt_param_ids == {id(p) for p in model.parameters()}
    for m in rec.bn_at_fit_start.values():
        assert {id(m.weight), id(m.bias)} <= rec.opt_param_ids
    # the plan: every layer swapped as configure_model attached it; hook gone after fit
    cb = next(c for c in t.callbacks if isinstance(c, BNSwap))
    assert [r.action for r in cb.plan.rows] == ["swap"] * 4
    assert {r.reason for r in cb.plan.rows} == {"swapped when configure_model attached it"}
    assert global_registration_hooks() == 0
    # the right value is stock's: same trained state, bit for bit
    stock_model, _ = runs["stock"]
    assert all(type(m) is nn.BatchNorm2d for m in bn_layers(stock_model).values())
    assert_states_equal(state(model), state(stock_model))


def test_layers_built_in_init_are_swapped_at_setup_and_plan_logged_once():
    records: list[logging.LogRecord] = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(record)

    h = H(level=logging.INFO)
    logging.getLogger(RANK_ZERO_LOGGER).addHandler(h)  # rank_zero_info's logger
    try:
        cb = BNSwap()
        model = Classifier()
        t = trainer([cb], max_epochs=2, limit_train_batches=2)
        t.fit(model, data())
    finally:
        logging.getLogger(RANK_ZERO_LOGGER).removeHandler(h)
    plans = [r.getMessage() for r in records if r.getMessage().startswith("BNSwap (")]
    # once per run, although validation starts twice; one line: every layer swapped
    assert plans == ["BNSwap (fit): 4 of 4 BatchNorm layers swapped, 0 skipped"], plans
    assert cb.plan.summary() == "bnswap: 4 of 4 BatchNorm layers swapped, 0 skipped"
    assert [r.name for r in cb.plan.rows] == [f"net.features.{i}" for i in (1, 4, 8, 11)]
    assert {r.reason for r in cb.plan.rows} == {"swapped at setup"}
    assert {r.kernel for r in cb.plan.rows} == {"Native"}
    assert all(
        type(m) is nn.BatchNorm2d and bnswap.is_swapped(m) for m in bn_layers(model).values()
    )


def test_plan_logged_again_only_when_it_changes(caplog):
    """Guards: one Trainer's validate / test / predict each logged the whole table again
    (issue 21); now one line, and the rows not swapped again when a layer's row changed."""
    caplog.set_level(logging.INFO, logger=RANK_ZERO_LOGGER)
    cb = BNSwap(exclude="net.features.11")
    model = Classifier()
    t = trainer(
        [cb], max_epochs=1, limit_train_batches=2, limit_val_batches=1, limit_test_batches=1
    )
    t.fit(model, data())
    t.validate(model, data())
    t.test(model, data())
    model.extra = nn.BatchNorm1d(3)  # the table changes (a new row): logged again
    t.validate(model, data())
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("BNSwap (")]
    skipped = (
        "net.features.11  BatchNorm2d  skip    -        -       -        excluded by "
        "'net.features.11'"
    )
    header = (
        "layer            class        action  backend  kernel  adapter  reason\n"
        "---------------  -----------  ------  -------  ------  -------  ------\n"
    )
    assert msgs == [
        f"BNSwap (fit): 3 of 4 BatchNorm layers swapped, 1 skipped\n{header}{skipped}",
        "BNSwap (validate): 3 of 4 BatchNorm layers swapped, 1 skipped (unchanged since the "
        "last stage)",
        "BNSwap (test): 3 of 4 BatchNorm layers swapped, 1 skipped (unchanged since the last "
        "stage)",
        f"BNSwap (validate): 4 of 5 BatchNorm layers swapped, 1 skipped\n{header}{skipped}",
    ]


@pytest.mark.parametrize("log_table", [False, True])
def test_a_stage_logs_one_line_and_the_layers_not_swapped_or_the_whole_plan(caplog, log_table):
    """Issue 26: every fit and resume logged the whole table (52 rows for the shipped
    MobileNetV2, each repeating the same sync note). A stage logs one summary line and
    the rows of the layers not swapped; ``log_table=True`` logs the whole plan; the whole
    plan goes to the ``bnswap`` logger at DEBUG either way."""
    caplog.set_level(logging.INFO, logger=RANK_ZERO_LOGGER)
    caplog.set_level(logging.DEBUG, logger="bnswap")  # (last: caplog's handler at DEBUG)
    cb = BNSwap(exclude="net.features.4", log_table=log_table)
    t = trainer([cb], max_epochs=1, limit_train_batches=1, limit_val_batches=1)
    t.fit(Classifier(), data())
    shown = [
        r.getMessage()
        for r in caplog.records
        if r.name == RANK_ZERO_LOGGER and r.getMessage().startswith("BNSwap (")
    ]
    debug = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "bnswap"]
    table = str(cb.plan)
    line = "BNSwap (fit): 3 of 4 BatchNorm layers swapped, 1 skipped"
    assert shown == [
        line
        + "\n"
        + (
            table.partition("\n")[2]
            if log_table
            else (
                "layer           class        action  backend  kernel  adapter  reason\n"
                "--------------  -----------  ------  -------  ------  -------  ------\n"
                "net.features.4  BatchNorm2d  skip    -        -       -        excluded by "
                "'net.features.4'"
            )
        )
    ]
    assert len(shown[0].splitlines()) == (7 if log_table else 4)
    assert debug == [(logging.DEBUG, table)]
    with pytest.raises(TypeError, match="log_table must be True or False, got 'yes'"):
        BNSwap(log_table="yes")


def test_layers_converted_before_the_callback_are_kept_and_said_so():
    """Issue 26: a model converted in ``__init__`` (all but one layer) and given to
    ``BNSwap``: the rows of the layers converted before say ``keep`` ("already swapped"),
    the one the callback swapped says ``swap`` and when; the fit is stock's bit for bit."""

    class Converted(Classifier):
        def __init__(self):
            super().__init__()
            bnswap.convert(self.net, exclude="features.11")

    models = {}
    for variant, make, cbs in (("stock", Classifier, []), ("bnswap", Converted, [BNSwap()])):
        pl.seed_everything(0)
        models[variant] = make()
        trainer(cbs, limit_train_batches=2).fit(models[variant], data())
    model, cb = models["bnswap"], cbs[0]
    assert [(r.name, r.action, r.reason) for r in cb.plan.rows] == [
        ("net.features.1", "keep", "already swapped"),
        ("net.features.4", "keep", "already swapped"),
        ("net.features.8", "keep", "already swapped"),
        ("net.features.11", "swap", "swapped at setup"),
    ]
    assert all(bnswap.is_swapped(m) for m in bn_layers(model).values())
    assert not any(bnswap.is_swapped(m) for m in bn_layers(models["stock"]).values())
    assert_states_equal(state(model), state(models["stock"]))


# --------------------------------------------------------------------------- given case 2
class FinetuneModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        net = ConvNet4(channels=CH)
        self.backbone = net.features
        self.head = net.head

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.backbone(x).mean((2, 3))), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)


class BNSnapshots(pl.Callback):
    def __init__(self):
        self.snaps: dict[str, dict] = {}
        self.tracking: dict[int, list[bool]] = {}

    def _snap(self, pl_module):
        return {
            k: v.clone()
            for k, v in pl_module.backbone.state_dict().items()
            if "running_" in k or "num_batches_tracked" in k
        }

    def on_train_epoch_start(self, trainer, pl_module):
        self.snaps[f"start{trainer.current_epoch}"] = self._snap(pl_module)
        self.tracking[trainer.current_epoch] = [
            m.track_running_stats for m in bn_layers(pl_module.backbone).values()
        ]

    def on_train_epoch_end(self, trainer, pl_module):
        self.snaps[f"end{trainer.current_epoch}"] = self._snap(pl_module)


class FrozenBNBackboneFinetuning(BackboneFinetuning):
    """BackboneFinetuning whose first epochs also freeze the backbone's BatchNorm layers
    when ``train_bn=False`` (stock ``freeze_before_training`` calls ``freeze(backbone)``
    with its default ``train_bn=True``, so stock BN statistics keep moving)."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone, train_bn=self.train_bn)


def _finetune_runs(callback_cls):
    return fit_pair(
        FinetuneModel,
        {"max_epochs": 2, "limit_train_batches": 3, "limit_val_batches": 0},
        extra_callbacks=[
            lambda: callback_cls(unfreeze_backbone_at_epoch=1, train_bn=False),
            BNSnapshots,
        ],
    )


def _compare_variants(runs):
    per_variant = {}
    for variant, (model, t) in runs.items():
        snap = next(c for c in t.callbacks if isinstance(c, BNSnapshots))
        per_variant[variant] = (snap, state(model))
    assert all(bnswap.is_swapped(m) for m in bn_layers(runs["bnswap"][0]).values())
    stock, swapped = per_variant["stock"], per_variant["bnswap"]
    assert stock[0].tracking == swapped[0].tracking
    for key in ("start0", "end0", "start1", "end1"):
        assert_states_equal(stock[0].snaps[key], swapped[0].snaps[key])
    assert_states_equal(stock[1], swapped[1])
    return per_variant


def test_backbone_finetuning_train_bn_false_freezes_bnswap_layers_like_stock():
    """Given case 2: backbone (BatchNorm included) frozen for epoch 0, unfrozen at 1."""
    per_variant = _compare_variants(_finetune_runs(FrozenBNBackboneFinetuning))
    for variant, (snap, _) in per_variant.items():
        assert snap.tracking == {0: [False] * 4, 1: [True] * 4}, variant
        # frozen for epoch 0: running stats and counters bit-identical
        assert_states_equal(snap.snaps["start0"], snap.snaps["end0"])
        assert all(
            int(v) == 0 for k, v in snap.snaps["end0"].items() if k.endswith("num_batches_tracked")
        )
        # unfrozen at epoch 1: they move (3 batches)
        for k, v in snap.snaps["end1"].items():
            if k.endswith("num_batches_tracked"):
                assert int(v) == 3
            else:
                assert not torch.equal(v, snap.snaps["end0"][k]), k


def test_stock_backbone_finetuning_keeps_bn_statistics_moving_as_stock():
    """Lightning's own BackboneFinetuning freezes the backbone's weights but leaves its
    BatchNorm layers tracking in the first epochs (whatever ``train_bn``): bnswap
    layers do exactly what stock ones do."""
    per_variant = _compare_variants(_finetune_runs(BackboneFinetuning))
    for variant, (snap, _) in per_variant.items():
        assert snap.tracking == {0: [True] * 4, 1: [True] * 4}, variant
        assert all(
            int(v) == 3 for k, v in snap.snaps["end0"].items() if k.endswith("num_batches_tracked")
        )


# --------------------------------------------------------------------------- eval submodule
class PartlyEvalModel(Classifier):
    def __init__(self):
        super().__init__()
        self.side = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4))
        self.side.eval()  # the user's choice: must survive the whole fit

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y) + self.side(x).pow(2).mean()


def test_submodule_in_eval_stays_in_eval():
    runs = fit_pair(PartlyEvalModel)
    for variant, (model, _) in runs.items():
        assert not model.side.training and not model.side[1].training, variant
        assert model.net.training
        assert int(model.side[1].num_batches_tracked) == 0
        assert torch.equal(model.side[1].running_mean, torch.zeros(4))
    assert bnswap.is_swapped(runs["bnswap"][0].side[1])
    assert_states_equal(state(runs["stock"][0]), state(runs["bnswap"][0]))


# --------------------------------------------------------------------------- accumulation
def test_accumulate_grad_batches_counts_every_forward_as_stock():
    runs = fit_pair(Classifier, {"accumulate_grad_batches": 3, "limit_train_batches": 6})
    for variant, (model, t) in runs.items():
        assert t.global_step == 2, variant  # 6 batches / 3 per optimizer step
        for m in bn_layers(model).values():
            assert int(m.num_batches_tracked) == 6  # k = 3 per optimizer step
    assert_states_equal(state(runs["stock"][0]), state(runs["bnswap"][0]))


# --------------------------------------------------------------------------- revert
def test_revert_on_teardown_gives_stock_classes_back():
    model = Classifier()
    params_before = {n: p for n, p in model.named_parameters()}
    cb = BNSwap(revert_on_teardown=True)
    seen = {}

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["classes"] = {
                (type(m), bnswap.is_swapped(m)) for m in bn_layers(pl_module).values()
            }

    trainer([cb, Spy()]).fit(model, data())
    assert seen["classes"] == {(nn.BatchNorm2d, True)}
    assert {(type(m), bnswap.is_swapped(m)) for m in bn_layers(model).values()} == {
        (nn.BatchNorm2d, False)
    }
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert cb.plan is not None and len(cb.plan.swapped) == 4


# --------------------------------------------------------------------------- other stages
@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_validate_test_predict_run_on_swapped_layers(stage):
    results = {}
    for variant in ("stock", "bnswap"):
        pl.seed_everything(0)
        model = Classifier(build="configure_model")
        cbs = [BNSwap()] if variant == "bnswap" else []
        t = trainer(cbs, limit_test_batches=2, limit_predict_batches=2)
        out = getattr(t, stage)(model, datamodule=data())
        results[variant] = (model, out)
    model, out = results["bnswap"]
    assert model.seen[f"{'val' if stage == 'validate' else stage}_swapped"] == [[True] * 4] * 2
    stock_model, stock_out = results["stock"]
    key = f"{'val' if stage == 'validate' else stage}_swapped"
    assert stock_model.seen[key] == [[False] * 4] * 2
    if stage == "predict":
        assert all(torch.equal(a, b) for a, b in zip(out, stock_out, strict=True))
    else:
        assert out == stock_out


# --------------------------------------------------------------------------- given case 3
def test_resume_from_mid_epoch_checkpoint_is_bitwise_identical(tmp_path):
    kw = {"max_epochs": 2, "limit_train_batches": 6, "limit_val_batches": 2}

    def run(ckpt_dir=None, ckpt_path=None, swap=True):
        pl.seed_everything(0)
        model = Classifier(build="configure_model", sched=True)  # restore into its layers
        cbs = [BNSwap()] if swap else []
        extra = {}
        if ckpt_dir is not None:
            cbs.append(
                ModelCheckpoint(
                    dirpath=ckpt_dir,
                    every_n_train_steps=1,
                    save_top_k=-1,
                    filename="{epoch}-{step}",
                )
            )
            extra["enable_checkpointing"] = True
        t = trainer(cbs, **kw, **extra)
        t.fit(model, data(), ckpt_path=ckpt_path)
        return model, t

    full, _ = run(ckpt_dir=tmp_path)
    ref = state(full)
    stock, _ = run(swap=False)
    assert_states_equal(state(stock), ref)  # the right value is stock's
    # mid-epoch checkpoints: inside epoch 0 and inside epoch 1
    for name in ("epoch=0-step=2.ckpt", "epoch=1-step=9.ckpt"):
        resumed, t = run(ckpt_path=tmp_path / name)
        assert t.global_step == 12
        assert all(bnswap.is_swapped(m) for m in bn_layers(resumed).values())
        assert_states_equal(state(resumed), ref)


# --------------------------------------------------------------------------- checkpoints
def test_checkpoints_move_between_stock_and_bnswap(tmp_path):
    kw = {"max_epochs": 1, "limit_train_batches": 3, "enable_checkpointing": True}

    def fit(swap, ckpt_path=None, max_epochs=1, dirpath=None):
        pl.seed_everything(0)
        model = Classifier()
        cbs = [BNSwap()] if swap else []
        cbs.append(ModelCheckpoint(dirpath=dirpath or tmp_path / "x", save_last=True))
        t = trainer(cbs, **{**kw, "max_epochs": max_epochs})
        t.fit(model, data(), ckpt_path=ckpt_path)
        return model

    stock_1 = fit(False, dirpath=tmp_path / "stock")
    swap_1 = fit(True, dirpath=tmp_path / "swap")
    assert_states_equal(state(stock_1), state(swap_1))
    # stock checkpoint -> bnswap model, training continues as the stock run does
    from_stock = fit(
        True, ckpt_path=tmp_path / "stock" / "last.ckpt", max_epochs=2, dirpath=tmp_path / "a"
    )
    stock_2 = fit(
        False, ckpt_path=tmp_path / "stock" / "last.ckpt", max_epochs=2, dirpath=tmp_path / "b"
    )
    assert all(bnswap.is_swapped(m) for m in bn_layers(from_stock).values())
    assert_states_equal(state(from_stock), state(stock_2))
    # bnswap checkpoint -> stock model (and through load_state_dict, strict)
    from_swap = fit(
        False, ckpt_path=tmp_path / "swap" / "last.ckpt", max_epochs=2, dirpath=tmp_path / "c"
    )
    assert all(type(m) is nn.BatchNorm2d for m in bn_layers(from_swap).values())
    assert_states_equal(state(from_swap), state(stock_2))
    ckpt = torch.load(tmp_path / "swap" / "last.ckpt", weights_only=True)
    plain = Classifier()
    plain.load_state_dict(ckpt["state_dict"], strict=True)
    assert_states_equal(state(plain), state(swap_1))


# --------------------------------------------------------------------------- filters
def test_include_exclude_are_matched_against_qualified_names():
    class Two(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.a = None
            self.b = ConvNet4(channels=CH)

        def configure_model(self):
            if self.a is None:
                self.a = ConvNet4(channels=CH)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.a(x) + self.b(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    model = Two()
    cb = BNSwap(exclude=["a.features.1", "b.*"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([cb], limit_train_batches=1, limit_val_batches=0).fit(model, data())
    # "a.features.1" matches nothing before configure_model: no spurious warning
    assert not [w for w in caught if str(w.message).startswith("bnswap")]
    swapped = {n for n, m in bn_layers(model).items() if bnswap.is_swapped(m)}
    assert swapped == {"a.features.4", "a.features.8", "a.features.11"}
    skipped = {r.name: r.reason for r in cb.plan.rows if r.action == "skip"}
    assert skipped["a.features.1"] == "excluded by 'a.features.1'"
    assert skipped["b.features.1"] == "excluded by 'b.*'"
    # a pattern that matches nothing in the final model warns, once
    model, cb = Two(), BNSwap(include=["nope.*"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([cb], limit_train_batches=1, limit_val_batches=0).fit(model, data())
    ours = [w for w in caught if str(w.message).startswith("bnswap")]
    assert [str(w.message) for w in ours] == [
        "bnswap: include pattern 'nope.*' matches no BatchNorm layer; BNSwap's patterns "
        "match qualified names from the LightningModule down, as pl_module.named_modules() "
        "gives them (e.g. 'b.features.1')"
    ]
    assert ours[0].filename == __file__  # the trainer.fit line, not Lightning's call.py
    assert not any(bnswap.is_swapped(m) for m in model.modules())


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match="unknown backend"):
        BNSwap("cudnn")
    with pytest.raises(TypeError, match="glob patterns"):
        BNSwap(include=[3])
    with pytest.raises(TypeError, match=r"^exclude takes glob patterns .*, got 42$"):
        BNSwap(exclude=42)
    for one in (b"1", bytearray(b"1")):  # one bad pattern, not the ints list() makes
        with pytest.raises(
            TypeError, match=rf"^include takes glob patterns .*, got {re.escape(repr(one))}$"
        ):
            BNSwap(include=one)
    # issue 46: the TypeError named the private _BNSwapBase.__init__()
    with pytest.raises(TypeError, match=r"^BNSwap\.__init__\(\) got an unexpected keyword "):
        BNSwap(exclud="head.*")
    # a generator of patterns is read once: every stage plans with it (issue 46)
    assert BNSwap(exclude=(p for p in ["a.*", "b"])).exclude == ["a.*", "b"]


def test_a_pattern_from_inside_an_attribute_warns_with_the_name_that_would_match():
    """Issue 46: BNSwap(exclude=["features.1"]) for a LightningModule whose net is
    ``self.net`` matched nothing (names start at the LightningModule's attributes:
    'net.features.1'), and the warning did not say so. It names the guess, and the layer
    stays swapped (the pattern left nothing out)."""
    model, cb = Classifier(), BNSwap(exclude=["features.1"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([cb], limit_train_batches=1, limit_val_batches=0).fit(model, data())
    ours = [w for w in caught if str(w.message).startswith("bnswap")]
    assert [str(w.message) for w in ours] == [
        "bnswap: exclude pattern 'features.1' matches no BatchNorm layer; BNSwap's patterns "
        "match qualified names from the LightningModule down, as pl_module.named_modules() "
        "gives them: did you mean 'net.features.1'?"
    ]
    assert ours[0].filename == __file__  # the trainer.fit line
    assert all(bnswap.is_swapped(m) for m in bn_layers(model).values())


def test_two_callbacks_in_one_trainer_are_refused_before_anything_changes():
    """Issue 46: with two BNSwap callbacks the first swapped every layer at setup and the
    second's exclude did nothing, silently. Refused at setup, naming both, the model
    untouched; one callback with the patterns does what the two meant."""
    model = Classifier()
    before = state(model)
    two = [BNSwap(), BNSwap(exclude="net.features.1")]
    with pytest.raises(ValueError, match=r"^bnswap: this Trainer has 2 BNSwap callbacks \("):
        trainer(two, limit_train_batches=1, limit_val_batches=0).fit(model, data())
    assert not any(bnswap.is_swapped(m) for m in bn_layers(model).values())
    assert_states_equal(before, state(model))
    one = BNSwap(exclude="net.features.1")
    trainer([one], limit_train_batches=1, limit_val_batches=0).fit(model, data())
    assert {n for n, m in bn_layers(model).items() if not bnswap.is_swapped(m)} == {
        "net.features.1"
    }


# --------------------------------------------------------------------------- sync BN
class _FakeTrainer:
    is_global_zero = True


def test_sync_batchnorm_layers_are_swapped_at_stage_start():
    """Trainer(sync_batchnorm=True): Lightning's TorchSyncBatchNorm converts every
    _BatchNorm, bnswap layers included, in strategy.setup (after the callback's setup);
    the callback swaps the new SyncBatchNorm layers at stage start. The conversion steps
    of a fit by hand: setup -> layer sync -> stage start."""
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    model = Classifier()
    weights = [m.weight for m in bn_layers(model).values()]
    cb = BNSwap()
    try:
        cb.setup(_FakeTrainer(), model, "fit")
        assert all(bnswap.is_swapped(m) for m in bn_layers(model).values())
        model = TorchSyncBatchNorm().apply(model)  # what DDPStrategy.setup does
        with warnings.catch_warnings(record=True) as caught:  # rank_zero_warn
            warnings.simplefilter("always")
            cb.on_fit_start(_FakeTrainer(), model)
    finally:
        cb.teardown(_FakeTrainer(), model, "fit")
    layers = bn_layers(model)
    assert all(type(m) is nn.SyncBatchNorm for m in layers.values())
    assert [m.weight for m in layers.values()] == weights  # same Parameter objects
    assert [(r.action, r.adapter_name) for r in cb.plan.rows] == [
        ("swap", "bnswap.sync.sync_batch_norm_forward")
    ] * 4
    assert [str(w.message) for w in caught if "BNSwap" in str(w.message)] == []
    assert global_registration_hooks() == 0


@pytest.mark.parametrize("exclude", [None, "net.features.4"])
def test_sync_batchnorm_layer_sync_is_deferred_past_the_ddp_wrap_and_reverts_exactly(exclude):
    """A real Trainer(strategy="ddp", sync_batchnorm=True), its strategy's steps of a fit
    by hand (no processes): BNSwap stands in for Lightning's TorchSyncBatchNorm from
    setup("fit"). Its apply (before the DDP wrap, which refuses SyncBatchNorm on the CPU)
    leaves the model alone; the stage start converts every layer to a swapped, synchronized
    SyncBatchNorm sharing the Parameters; the revert gives the original (still swapped)
    layer objects back, and teardown gives Lightning its plugin back. With a layer
    excluded, Lightning's own conversion runs (stock behaviour)."""
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    t = trainer(strategy="ddp", devices=2, sync_batchnorm=True)
    lightning_plugin = t.strategy._layer_sync
    assert type(lightning_plugin) is TorchSyncBatchNorm
    model = Classifier()
    originals = bn_layers(model)
    cb = BNSwap(exclude=exclude)
    try:
        cb.setup(t, model, "fit")
        applied = t.strategy._layer_sync.apply(model)  # DDPStrategy.setup, before the wrap
        assert applied is model
        layers = bn_layers(model)
        if exclude is None:  # deferred: nothing for DDP's constructor to refuse
            assert layers == originals
        else:
            assert all(type(m) is nn.SyncBatchNorm for m in layers.values())
        cb.on_fit_start(t, model)
        layers = bn_layers(model)
        assert all(type(m) is nn.SyncBatchNorm for m in layers.values())
        assert [m.weight for m in layers.values()] == [m.weight for m in originals.values()]
        assert [(r.name, r.action, r.synchronized) for r in cb.plan.rows] == [
            (n, "skip", False) if n == exclude else (n, "swap", True) for n in originals
        ]
        reverted = t.strategy._layer_sync.revert(model)  # DDPStrategy.teardown
    finally:
        cb.teardown(t, model, "fit")
    assert t.strategy._layer_sync is lightning_plugin
    layers = bn_layers(reverted)
    if exclude is None:  # the very objects, swapped as BNSwap left them at setup
        assert layers == originals
        assert all(bnswap.is_swapped(m) for m in layers.values())
    else:  # Lightning's revert: new _BatchNormXd layers
        assert {type(m).__name__ for m in layers.values()} == {"_BatchNormXd"}
    assert global_registration_hooks() == 0


def test_sync_batchnorm_deferred_fit_warns_once_for_a_pattern_that_matches_nothing():
    """Guards: with Trainer(sync_batchnorm=True) the stage start converted the model
    (``bnswap.convert(..., sync_batchnorm=True)``, warning about a pattern that matches
    nothing) and then planned it for the log (warning again): two warnings for one fit.
    The strategy's steps of a fit by hand, as above: one warning, at the caller's line, and
    every layer a swapped SyncBatchNorm sharing the original Parameters."""
    t = trainer(strategy="ddp", devices=2, sync_batchnorm=True)
    model = Classifier()
    originals = bn_layers(model)
    cb = BNSwap(exclude=["nomatch*"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cb.setup(t, model, "fit")
            t.strategy._layer_sync.apply(model)  # deferred: the model is left as it is
            cb.on_fit_start(t, model)
            layers = bn_layers(model)
            t.strategy._layer_sync.revert(model)
        finally:
            cb.teardown(t, model, "fit")
    ours = [w for w in caught if str(w.message).startswith("bnswap")]
    assert [str(w.message) for w in ours] == [
        "bnswap: exclude pattern 'nomatch*' matches no BatchNorm layer; BNSwap's patterns "
        "match qualified names from the LightningModule down, as pl_module.named_modules() "
        "gives them (e.g. 'net.features.1')"
    ]
    assert ours[0].filename == __file__
    assert all(type(m) is nn.SyncBatchNorm and bnswap.is_swapped(m) for m in layers.values())
    assert [m.weight for m in layers.values()] == [m.weight for m in originals.values()]
    assert bn_layers(model) == originals


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_sync_batchnorm_two_processes_train_like_one_process_on_the_global_batch(
    strategy, tmp_path
):
    """Trainer(sync_batchnorm=True, strategy=ddp / ddp_spawn, accelerator="cpu",
    devices=2) + BNSwap(), real gloo processes (tests/lightning_sync_fit.py; stock
    Lightning raises "SyncBatchNorm layers only work with GPU modules" here): every
    training step runs a swapped SyncBatchNorm sharing the original Parameters and
    buffers; the stage's line logged on rank zero says it synchronizes over WORLD, 2
    ranks (one line: every layer swapped); both
    ranks end identical and equal to one process training stock BatchNorm on the global
    batches (float64) within float32 rounding; teardown puts the original layer back."""
    script = rank_script("lightning_sync_fit")
    proc = run_processes(
        [sys.executable, script.__file__, strategy, str(tmp_path)], timeout=600, env=rank_env()
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + "\n--- stderr ---\n" + proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"{strategy}_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r in ranks:
        assert r["world_size"] == 2
        assert [s[:4] for s in r["seen"]] == [("SyncBatchNorm", True, True, True)] * script.STEPS
        assert r["plan"] == [("net.1", "SyncBatchNorm", "swap", "WORLD, 2 ranks")]
        assert "synchronized at fit start, after the DDP wrap" in r["plan_text"]
        assert r["original_back"] and r["original_swapped"]
    out = proc.stdout + proc.stderr
    assert (
        out.count(
            "BNSwap (fit): 1 of 1 BatchNorm layers swapped, 0 skipped; 1 synchronized "
            "over WORLD, 2 ranks\n"
        )
        == 1
    )  # rank zero only
    assert "net.1  SyncBatchNorm" not in out  # (the whole table: at DEBUG)
    s0, s1 = ranks[0]["state"], ranks[1]["state"]
    assert [k for k in s0 if not torch.equal(s0[k], s1[k])] == []
    ref = script.reference()
    for k, want in ref.items():
        if not want.is_floating_point():  # num_batches_tracked
            assert torch.equal(s0["net." + k], want), k
            continue
        torch.testing.assert_close(
            s0["net." + k].double(), want, rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}"
        )


# --------------------------------------------------------------------------- packaging
def test_import_bnswap_does_not_import_lightning():
    code = (
        "import sys, bnswap\n"
        "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') "
        "for m in sys.modules), sorted(m for m in sys.modules if 'lightning' in m)\n"
        "from bnswap.lightning import BNSwap\n"
        "assert bnswap.BNSwap is BNSwap\n"
        "import lightning.pytorch as pl\n"
        "assert issubclass(BNSwap, pl.Callback)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env=env)


def test_pytorch_lightning_trainer_works_with_BNSwapPL():
    ptl = pytest.importorskip("pytorch_lightning")
    from bnswap.lightning import BNSwapPL

    class M(ptl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = ConvNet4(channels=CH)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    model, cb = M(), BNSwapPL()
    t = ptl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    loader = data()
    loader.setup()
    t.fit(model, train_dataloaders=loader.train_dataloader())
    assert all(bnswap.is_swapped(m) for m in bn_layers(model).values())
    assert len(cb.plan.swapped) == 4


def test_ort_backend_without_onnxruntime_fails_before_changing_the_model(monkeypatch):
    import bnswap.ort

    monkeypatch.setattr(bnswap.ort, "is_available", lambda: False)
    model, cb = Classifier(), BNSwap("ort")
    with pytest.raises(bnswap.ort.ORTNotAvailableError, match="onnxruntime-training-cpu"):
        cb.setup(_FakeTrainer(), model, "fit")
    assert not any(bnswap.is_swapped(m) for m in model.modules())
    assert global_registration_hooks() == 0


def _ort_available() -> bool:
    import bnswap.ort

    return bnswap.ort.is_available()


@pytest.mark.ort
@pytest.mark.skipif(not _ort_available(), reason="needs onnxruntime-training (bnswap[ort-cpu])")
def test_ort_backend_wraps_configure_model_children_before_the_optimizer():
    """backend="ort": each BatchNorm-holding child of the LightningModule is wrapped with
    bnswap.ort.wrap before configure_optimizers; training matches stock within float32
    rounding (ORT's kernels differ), the counters exactly; revert unwraps."""
    import bnswap.ort

    class M(Classifier):
        def __init__(self):
            super().__init__(build="configure_model")
            self.plain = nn.Linear(2, 2)  # no BatchNorm: not wrapped

        def configure_optimizers(self):
            self.seen["net_at_configure_optimizers"] = type(self.net).__name__
            self.seen["plain_at_configure_optimizers"] = type(self.plain).__name__
            return super().configure_optimizers()

    states = {}
    for variant in ("stock", "ort"):
        pl.seed_everything(0)
        model = M()
        cbs = [BNSwap("ort", revert_on_teardown=True)] if variant == "ort" else []
        seen: dict = {}

        class Spy(pl.Callback):
            def __init__(self, seen):
                self.seen = seen

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                self.seen["net"] = pl_module.net

        trainer([*cbs, Spy(seen)]).fit(model, data())
        states[variant] = state(model)
        if variant == "ort":
            assert model.seen["net_at_configure_optimizers"] == "BNSwapORTModule"
            assert model.seen["plain_at_configure_optimizers"] == "Linear"
            ops = bnswap.ort.executed_ops(seen["net"], training=True)  # ORT really ran it
            assert ops["BatchNormInternal"] == 4 and ops["BatchNormalizationGrad"] == 4
            assert {r.kernel for r in cbs[0].plan.rows} == {"BatchNormInternal (ORT)"}
            assert type(model.net) is ConvNet4  # unwrapped and reverted at teardown
            assert {type(m) for m in bn_layers(model).values()} == {nn.BatchNorm2d}
    a, b = states["stock"], states["ort"]
    assert a.keys() == b.keys()
    for k in a:
        if k.endswith("num_batches_tracked"):
            assert torch.equal(a[k], b[k])
        else:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)


@pytest.mark.ort
@pytest.mark.skipif(not _ort_available(), reason="needs onnxruntime-training (bnswap[ort-cpu])")
def test_ort_backend_leaves_children_with_unswapped_layers_eager(caplog):
    caplog.set_level(logging.INFO, logger=RANK_ZERO_LOGGER)

    class M(Classifier):
        def __init__(self):
            super().__init__()
            self.side = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2), nn.BatchNorm2d(2))

    model, cb = M(), BNSwap("ort", exclude="side.2")
    cb.setup(_FakeTrainer(), model, "fit")
    cb.on_fit_start(_FakeTrainer(), model)
    cb.teardown(_FakeTrainer(), model, "fit")
    assert type(model.net).__name__ == "BNSwapORTModule"
    assert type(model.side) is nn.Sequential
    assert bnswap.is_swapped(model.side[1]) and type(model.side[2]) is nn.BatchNorm2d
    rows = {r.name: r for r in cb.plan.rows}
    assert rows["net.features.1"].kernel == "BatchNormInternal (ORT)"
    assert (rows["side.1"].backend, rows["side.1"].kernel) == ("aten", "Native")
    # when it was swapped, then where it runs (the plan's placement note)
    assert rows["side.1"].reason == (
        "swapped at setup; eager: its top-level module holds a layer that is not swapped"
    )
    assert rows["net.features.1"].reason == "swapped at setup"
    assert rows["side.2"].action == "skip"
    # the stage's line says how many run where; the rows shown: the eager one, the skipped
    line, *shown = next(
        r.getMessage() for r in caplog.records if r.getMessage().startswith("BNSwap (")
    ).splitlines()
    assert line == (
        "BNSwap (fit): 5 of 6 BatchNorm layers swapped, 1 skipped; 4 on ort, 1 on aten (eager)"
    )
    assert [ln.split()[:3] for ln in shown[2:]] == [
        ["side.1", "BatchNorm2d", "swap"],
        ["side.2", "BatchNorm2d", "skip"],
    ]


@pytest.mark.ort
@pytest.mark.skipif(not _ort_available(), reason="needs onnxruntime-training (bnswap[ort-cpu])")
def test_ort_backend_with_trainer_sync_batchnorm_is_refused_before_anything_changes():
    """Guards: BNSwap(backend="ort") with Trainer(sync_batchnorm=True) wrapped the children
    at setup; Lightning's conversion then called add_module on the ORT wrapper in
    strategy.setup and every rank died with ORT's "ORTModule does not support adding
    modules to it" (seen first at teardown). It is refused at setup now, naming the fix."""
    t = trainer(strategy="ddp", devices=2, sync_batchnorm=True)
    plugin = t.strategy._layer_sync
    model, cb = Classifier(), BNSwap("ort")
    with pytest.raises(
        bnswap.ort.UnsupportedLayerError,
        match=r"sync_batchnorm=True with backend='ort'.*Use backend='aten'",
    ):
        cb.setup(t, model, "fit")
    assert not any(bnswap.is_swapped(m) for m in model.modules())
    assert type(model.net) is ConvNet4 and t.strategy._layer_sync is plugin
    assert global_registration_hooks() == 0
    cb.setup(t, model, "validate")  # no layer sync outside fit: nothing to refuse
    cb.teardown(t, model, "validate")


@pytest.mark.ort
@pytest.mark.skipif(not _ort_available(), reason="needs onnxruntime-training (bnswap[ort-cpu])")
def test_ort_backend_keeps_a_child_with_a_syncbatchnorm_eager_and_synchronized_on_aten():
    """Guards: the callback planned with "aten", swapped the SyncBatchNorm onto bnswap's
    synchronized forward, then wrapped its child in ORT, which cannot synchronize. The
    plan (wrap="children") now keeps that child eager, on aten, and says why."""

    class M(Classifier):
        def __init__(self):
            super().__init__()
            self.synced = nn.Sequential(nn.Conv2d(1, 2, 1), nn.SyncBatchNorm(2))

    torch.manual_seed(0)
    model, cb = M(), BNSwap("ort")
    stock = copy.deepcopy(model.synced)
    cb.setup(_FakeTrainer(), model, "fit")
    cb.on_fit_start(_FakeTrainer(), model)
    assert type(model.net).__name__ == "BNSwapORTModule"
    assert type(model.synced) is nn.Sequential and bnswap.is_swapped(model.synced[1])
    row = next(r for r in cb.plan.rows if r.name == "synced.1")
    assert (row.backend, row.adapter_name) == ("aten", "bnswap.sync.sync_batch_norm_forward")
    assert row.reason == (
        "swapped at setup; eager, synchronized on aten: its top-level "
        "module holds a SyncBatchNorm (ONNX Runtime cannot synchronize "
        "batch statistics across processes)"
    )
    x = torch.randn(4, 1, 3, 3)  # one process, no process group: stock's local batch norm
    torch.testing.assert_close(model.synced(x), stock(x))
    torch.testing.assert_close(model.synced[1].running_var, stock[1].running_var)
    cb.teardown(_FakeTrainer(), model, "fit")


def test_a_failing_configure_model_leaves_no_global_hook_behind():
    class Broken(Classifier):
        def configure_model(self):
            self.net = ConvNet4(channels=CH)
            raise RuntimeError("boom in configure_model")

    model = Broken(build="configure_model")
    with pytest.raises(RuntimeError, match="boom"):
        trainer([BNSwap()]).fit(model, data())
    assert global_registration_hooks() == 0
    # what was attached before the failure was swapped as it was attached
    assert all(bnswap.is_swapped(m) for m in bn_layers(model).values())


# ------------------------------------------------------------ layers built during fit
class RebuildBatchNorm(pl.Callback):
    """What a finetuning step such as timm's freeze / unfreeze round trip does mid-fit:
    every BatchNorm2d replaced by a new stock one (statistics copied, the same Parameter
    objects moved over so the optimizer keeps training them), stored straight into
    ``_modules`` as torch.ao's module swaps do (no module-registration hook fires)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch != 1:
            return
        for parent in list(pl_module.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.BatchNorm2d:
                    new = nn.BatchNorm2d(child.num_features, momentum=child.momentum)
                    new.weight, new.bias = child.weight, child.bias
                    for b in ("running_mean", "running_var", "num_batches_tracked"):
                        getattr(new, b).copy_(getattr(child, b))
                    parent._modules[name] = new


def test_layers_built_during_fit_are_swapped_before_their_first_training_step(caplog):
    """Guards: BNSwap swapped only what existed when the stage started, so layers a
    callback rebuilt mid-fit trained on stock BatchNorm, silently."""
    caplog.set_level(logging.INFO, logger=RANK_ZERO_LOGGER)
    runs = fit_pair(Classifier, {"max_epochs": 2}, extra_callbacks=[RebuildBatchNorm])
    model, t = runs["bnswap"]
    stock_model, _ = runs["stock"]
    steps = model.seen["train_swapped"]
    assert len(steps) == 8 and all(all(s) and len(s) == 4 for s in steps)
    assert all(not any(s) for s in stock_model.seen["train_swapped"])
    # the same numbers as stock's run with the same rebuild, bit for bit
    assert_states_equal(state(stock_model), state(model))
    cb = next(c for c in t.callbacks if isinstance(c, BNSwap))
    assert {r.reason for r in cb.plan.rows} == {"swapped during fit (epoch 1, global step 4)"}
    added = [
        r.getMessage() for r in caplog.records if "appeared in the model since" in r.getMessage()
    ]
    assert len(added) == 1 and "4 BatchNorm layer(s)" in added[0]
    assert "net.features.1" in added[0]


class _NoBatchNorm(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_model_without_batchnorm_warns_like_convert():
    """bnswap.convert warns for a model with no BatchNorm layer; so does the callback
    (once, on rank zero: rank_zero_warn), and it wraps nothing."""
    model = _NoBatchNorm()
    cb = BNSwap()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([cb], limit_train_batches=1, limit_val_batches=0).fit(model, data())
    warned = [w for w in caught if "BNSwap: the model has no BatchNorm layer" in str(w.message)]
    assert len(warned) == 1 and len(cb.plan) == 0
    with pytest.warns(UserWarning, match="the model has no BatchNorm layer"):
        bnswap.convert(_NoBatchNorm().net)


class _LazyHead(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, 16), nn.LazyBatchNorm1d(), nn.ReLU(), nn.Linear(16, 10)
        )
        self.wrapped_at_step: list[bool] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.wrapped_at_step.append(type(self.net).__name__ == "BNSwapORTModule")
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.ort
@pytest.mark.skipif(not _ort_available(), reason="needs onnxruntime-training (bnswap[ort-cpu])")
def test_ort_backend_wraps_a_child_with_a_lazy_layer_once_it_has_initialized():
    """Guards: the child was wrapped while its LazyBatchNorm had no parameters, and its
    first forward crashed inside ORT's setup (a raw ValueError). It now runs eagerly
    (swapped, aten) until its first step has initialized the layer, then on ORT."""
    states = []
    for callbacks in ([], [BNSwap("ort")]):
        pl.seed_everything(0)
        model = _LazyHead()
        trainer(callbacks, max_epochs=1, limit_train_batches=3, limit_val_batches=0).fit(
            model, data()
        )
        states.append((model, state(model)))
    (_stock, s_state), (swapped, b_state) = states
    assert swapped.wrapped_at_step == [False, True, True]
    assert s_state.keys() == b_state.keys()
    for k in s_state:
        torch.testing.assert_close(
            b_state[k].double(), s_state[k].double(), rtol=1e-4, atol=1e-5, msg=k
        )


# --------------------------------------------------------------- ORT: mixed train / eval
def _flags(module: nn.Module) -> list[tuple[str, bool]]:
    return [(n, m.training) for n, m in module.named_modules()]


def _assert_close_states(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k.endswith("num_batches_tracked"):
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=atol, msg=k)


class FrozenBNModel(Classifier):
    """Fine-tuning with frozen BatchNorm layers (detection backbones): two layers of the
    training model in eval mode for the whole fit."""

    def __init__(self):
        super().__init__()
        self.net.features[1].eval()
        self.net.features[8].eval()


def _stock_then_ort(model_class: type, stage: str, **trainer_kwargs) -> dict[str, tuple]:
    """``model_class()`` run twice from seed 0 through ``Trainer.<stage>`` ("fit" or
    "validate"): stock, then ``BNSwap("ort")``. Asserts, for each, that no module of its
    net changed its training flag (a mixed train / eval model stays mixed), and that both
    end with the same state (within 1e-4 relative, 1e-5 absolute; counters exact).
    Returns ``{"stock" | "ort": (model, its original net)}`` for the caller's checks."""
    runs, states = {}, {}
    for variant in ("stock", "ort"):
        pl.seed_everything(0)
        model = model_class()
        net = model.net
        before = _flags(net)
        run = getattr(trainer([BNSwap("ort")] if variant == "ort" else [], **trainer_kwargs), stage)
        run(model, data(), **({"verbose": False} if stage == "validate" else {}))
        assert _flags(net) == before, variant  # (Lightning restores its own switch)
        runs[variant], states[variant] = (model, net), state(net)
    _assert_close_states(states["stock"], states["ort"])
    return runs


@pytest.mark.ort
@pytest.mark.skipif(not _ort_available(), reason="needs onnxruntime-training (bnswap[ort-cpu])")
def test_ort_backend_frozen_batchnorm_fine_tuning_matches_stock():
    """Issue 19 case 1 under a real Trainer: BNSwap(backend="ort") changes no module's
    flag (fit, with its validation round trips), the frozen layers keep their statistics
    and counters, and the fit matches stock's."""
    import bnswap.ort

    runs = _stock_then_ort(FrozenBNModel, "fit", limit_train_batches=3)
    for variant, (model, net) in runs.items():
        assert model.training, variant
        assert int(net.features[1].num_batches_tracked) == 0, variant
        assert torch.equal(net.features[8].running_mean, torch.zeros(16)), variant
        assert int(net.features[4].num_batches_tracked) == 3, variant
    wrapped = runs["ort"][0].net
    assert isinstance(wrapped, bnswap.ort.BNSwapORTModule)
    assert bnswap.ort.executed_ops(wrapped, training=True)["BatchNormInternal"] == 2


class AdaBNValidation(Classifier):
    """AdaBN-style: one layer recalibrates its statistics during validation (train mode
    inside the eval model Lightning validates)."""

    def on_validation_model_eval(self) -> None:
        super().on_validation_model_eval()
        self.net.features[11].train()


@pytest.mark.ort
@pytest.mark.skipif(not _ort_available(), reason="needs onnxruntime-training (bnswap[ort-cpu])")
def test_ort_backend_train_mode_layer_in_an_eval_model_matches_stock():
    """One layer in train mode inside the eval model Lightning validates
    (AdaBN): it updates its statistics on both validation batches, the others none, and
    the result matches stock's."""
    for variant, (_, net) in _stock_then_ort(AdaBNValidation, "validate").items():
        assert int(net.features[11].num_batches_tracked) == 2, variant
        assert int(net.features[1].num_batches_tracked) == 0, variant


class FeatureHeadSplit(Classifier):
    """The feature / head split: ``self.net[:-1](x)`` then ``self.net[-1]``, with len,
    iteration and submodule attributes of the container."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 10),
        )

    def forward(self, x):
        assert len(self.net) == 9 and self.net[1].num_features == 8
        assert [type(m).__name__ for m in self.net][-1] == "Linear"
        return self.net[-1](self.net[:-1](x))


@pytest.mark.ort
@pytest.mark.skipif(not _ort_available(), reason="needs onnxruntime-training (bnswap[ort-cpu])")
def test_ort_backend_feature_head_split_of_a_wrapped_sequential_matches_stock():
    """Issue 19 case 3: indexing, slicing, len and iteration of a child BNSwap(backend=
    "ort") wrapped raised "'BNSwapORTModule' object is not subscriptable"; the features
    slice runs on ONNX Runtime, the fit matches stock's within 1e-4."""
    import bnswap.ort

    runs = {}
    for variant in ("stock", "ort"):
        pl.seed_everything(0)
        model = FeatureHeadSplit()
        net = model.net
        cbs = [BNSwap("ort")] if variant == "ort" else []
        with warnings.catch_warnings():
            warnings.simplefilter("error", bnswap.ort.UnwrappedCallWarning)
            trainer(cbs, limit_train_batches=3).fit(model, data())
        runs[variant] = state(net)
        if variant == "ort":
            assert isinstance(model.net, bnswap.ort.BNSwapORTModule) and model.net.module is net
            ops = bnswap.ort.executed_ops(model.net[:-1], training=True)
            assert ops["BatchNormInternal"] == 2
            assert model.net[-1] is net[-1] and list(model.net) == list(net)
    assert int(runs["ort"]["1.num_batches_tracked"]) == 3
    _assert_close_states(runs["stock"], runs["ort"], atol=1e-4)


# --------------------------------------------------------------------------- pickling
class SpawnClassifier(Classifier):
    """A Classifier whose every rank records, for every training step, whether each
    BatchNorm layer ran bnswap's forward, and the callback's plan (ddp_spawn's workers
    return only the weights and the metrics to the main process)."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def on_train_end(self):
        plan = next((cb.plan for cb in self.trainer.callbacks if isinstance(cb, BNSwap)), None)
        torch.save(
            {
                "train_swapped": self.seen["train_swapped"],
                "world_size": self.trainer.world_size,
                "plan": None if plan is None else [(r.name, r.action) for r in plan.rows],
            },
            os.path.join(self.out_dir, f"rank{self.global_rank}.pt"),
        )


def _fresh_and_used_callbacks() -> tuple[BNSwap, BNSwap]:
    used = BNSwap(exclude="net.features.4")
    model = Classifier()
    trainer([used]).fit(model, data())
    return BNSwap(include="net.*"), used


def test_callback_pickles_fresh_and_after_a_fit():
    """A launcher pickles the callback (ddp_spawn, ddp_notebook): a fresh one and one that
    ran a fit (holding its per-run state: a WeakSet of skipped layers) both round-trip,
    keep their arguments and plan, and the copy swaps like the original."""
    import pickle

    fresh, used = _fresh_and_used_callbacks()
    assert len(used._left_alone) == 1  # the per-run state that did not pickle
    for cb in (fresh, used):
        copy = pickle.loads(pickle.dumps(cb))
        assert type(copy) is BNSwap and repr(copy) == repr(cb)
        if cb.plan is None:
            assert copy.plan is None
        else:
            assert [(r.name, r.action, r.reason) for r in copy.plan.rows] == [
                (r.name, r.action, r.reason) for r in cb.plan.rows
            ]
        model = Classifier()
        trainer([copy]).fit(model, data())
        assert [(n, bnswap.is_swapped(m)) for n, m in bn_layers(model).items()] == [
            (n, cb is fresh or n != "net.features.4") for n in bn_layers(model)
        ]
        assert global_registration_hooks() == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_spawn_fit_with_bnswap_like_stock(tmp_path):
    """Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2): the launcher pickles
    the callback into two real processes; every rank trains on swapped layers and the
    weights returned to the main process equal stock BatchNorm's ddp_spawn run, bit for
    bit."""
    states = {}
    for variant in ("stock", "bnswap"):
        out = tmp_path / variant
        out.mkdir()
        pl.seed_everything(0)
        model = SpawnClassifier(str(out))
        cbs = [BNSwap()] if variant == "bnswap" else []
        # its ranks' collectives time out in COLLECTIVE_TIMEOUT_S (a hung rank fails the
        # test in a minute, not at the pytest timeout)
        spawn = DDPStrategy(start_method="spawn", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        trainer(cbs, strategy=spawn, devices=2).fit(model, data())
        states[variant] = state(model)
        ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
        for r in ranks:
            assert r["world_size"] == 2 and len(r["train_swapped"]) == 4
            assert r["train_swapped"] == [[variant == "bnswap"] * 4] * 4
        if variant == "bnswap":
            assert ranks[0]["plan"] == [(f"net.features.{i}", "swap") for i in (1, 4, 8, 11)]
    # the main process got the trained weights back (not its initial ones) ...
    pl.seed_everything(0)
    initial = state(SpawnClassifier(str(tmp_path)))
    assert not torch.equal(
        states["stock"]["net.features.1.weight"], initial["net.features.1.weight"]
    )
    # ... identical to stock's
    assert_states_equal(states["bnswap"], states["stock"])
