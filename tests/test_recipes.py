"""The recipes of docs/recipes.md, run as a user would, against stock (issue 32).

Lightning Fabric with 2 CPU ranks (gloo, tests/fabric_sync_fit.py), bnswap's synchronized
BatchNorm converted before or after ``fabric.setup``, against one process training stock
BatchNorm on the global batch (float64).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests._helpers import rank_env, rank_script, run_processes


@pytest.mark.timeout(900)
@pytest.mark.parametrize("when", ["before", "after"])
def test_fabric_two_ranks_synchronized_train_like_one_process(when, tmp_path):
    """``bnswap.convert(model, sync_batchnorm=True)`` before or after ``fabric.setup``
    (Fabric's DDP, 2 CPU ranks): every step runs a swapped SyncBatchNorm, both ranks end
    identical and equal to one process on the global batches (float64) within float32
    rounding."""
    script = rank_script("fabric_sync_fit")
    proc = run_processes(
        [sys.executable, script.__file__, when, str(tmp_path)], timeout=600, env=rank_env()
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + "\n--- stderr ---\n" + proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"{when}_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r in ranks:
        assert r["world_size"] == 2
        assert r["seen"] == [("SyncBatchNorm", True)] * script.STEPS
    s0, s1 = ranks[0]["state"], ranks[1]["state"]
    assert [k for k in s0 if not torch.equal(s0[k], s1[k])] == []
    for k, want in script.reference().items():
        if not want.is_floating_point():  # num_batches_tracked
            assert torch.equal(s0[k], want), k
            continue
        torch.testing.assert_close(
            s0[k].double(), want, rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}"
        )


# ---------------------------------------------------------------- Hugging Face Trainer
class _Images(torch.utils.data.Dataset):
    """16 random 3x16x16 images with labels of 3 classes, as the Trainer takes them."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(16, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 3, (16,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def test_hugging_face_trainer_recipe_is_bitwise_stock(tmp_path):
    """A tiny randomly initialised transformers ResNet (no download: ``ResNetConfig`` +
    ``save_pretrained``), loaded with ``from_pretrained`` (stock layers: bnswap's swap is
    never saved, issue 32), ``bnswap.convert`` before its ``Trainer``: three SGD steps end
    bitwise equal to stock's (every parameter and buffer), every BatchNorm layer swapped."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import bnswap

    torch.manual_seed(0)
    config = transformers.ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        num_labels=3,
    )
    transformers.ResNetForImageClassification(config).save_pretrained(tmp_path / "model")
    states, models = [], []
    for convert in (False, True):
        model = transformers.ResNetForImageClassification.from_pretrained(tmp_path / "model")
        assert not any(bnswap.is_swapped(m) for m in model.modules())
        if convert:
            bnswap.convert(model)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"out{convert}"),
            max_steps=3,
            per_device_train_batch_size=4,
            learning_rate=0.1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_strategy="no",
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        transformers.Trainer(model=model, args=args, train_dataset=_Images()).train()
        states.append(model.state_dict())
        models.append(model)
    bns = [m for m in models[1].modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 6 and all(bnswap.is_swapped(m) for m in bns)
    assert states[0].keys() == states[1].keys()
    assert [k for k in states[0] if not torch.equal(states[0][k], states[1][k])] == []
    initial = transformers.ResNetForImageClassification.from_pretrained(
        tmp_path / "model"
    ).state_dict()
    moved = [k for k in initial if not torch.equal(initial[k], states[1][k])]
    assert any(k.endswith("running_mean") for k in moved)  # it trained


def _pickled_names(pickles: list[bytes]) -> tuple[list[str], set[str]]:
    """(the module of every global a pickle loads, every string it holds), op by op."""
    import pickletools

    names: list[str] = []
    strings: set[str] = set()
    for data in pickles:
        pushed: list[str] = []
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                names.append(str(arg).split(" ")[0])
            elif op.name == "STACK_GLOBAL":
                names.append(pushed[-2])
            elif isinstance(arg, str):
                pushed.append(arg)
                strings.add(arg)
    return names, strings


# ------------------------------------------------------------------------- Ultralytics
def test_ultralytics_trainer_recipe_is_bitwise_stock_with_ema_and_resume(tmp_path):
    """YOLOv8n (Ultralytics' bundled yaml, no download) on a tiny data set the script
    writes, trained with the recipe's trainer (``get_model`` returns
    ``bnswap.convert(super().get_model(...))``), with the recipe's
    ``on_pretrain_routine_end`` callback (converts the model and ``trainer.ema.ema``) and
    with stock's: every step runs 57 swapped layers in the model and in its EMA copy, the
    checkpoint after the first epoch (model and EMA) and the one after a resume are bitwise stock's,
    and neither names bnswap (it loads where bnswap is not installed, issue 32)."""
    pytest.importorskip("ultralytics")
    import zipfile

    script = rank_script("ultralytics_fit")
    env = rank_env(YOLO_OFFLINE="1", YOLO_CONFIG_DIR=str(tmp_path / "config"))
    ckpts, seen = {}, {}
    for kind in ("stock", "bnswap", "callback"):
        seen[kind] = []
        for phase in ("first", "resume"):
            proc = run_processes(
                [sys.executable, script.__file__, kind, phase, str(tmp_path)], timeout=600, env=env
            )
            assert proc.returncode == (3 if phase == "first" else 0), proc.stderr[-4000:]
            # Ultralytics configures its own logger only: bnswap's line shows regardless
            line = (
                "bnswap.convert: 57 of 57 BatchNorm layers swapped, 0 skipped; for the "
                "per-layer table call logging.basicConfig(level=logging.INFO)\n"
            )
            assert (proc.stderr + proc.stdout).count(line) == (kind != "stock")  # once
            seen[kind] += json.loads(proc.stdout.strip().splitlines()[-1])
            last = tmp_path / kind / "run" / "weights" / "last.pt"
            with zipfile.ZipFile(last) as z:
                pickles = [z.read(n) for n in z.namelist() if n.endswith(".pkl")]
            # nothing of bnswap's: no attribute of its, no class or function of its module.
            # (Read op by op: Ultralytics also stores the checkout's last commit message.)
            names, strings = _pickled_names(pickles)
            assert "_bnswap_swap" not in strings
            assert not [n for n in names if n.split(".")[0] == "bnswap"], names
            ckpts[kind, phase] = torch.load(last, weights_only=False)
    assert seen["stock"] == [[0, 0]] * 4
    assert seen["bnswap"] == seen["callback"] == [[57, 57]] * 4
    # Ultralytics 8.4 saves the EMA copy (its "model" entry is None) during training, and
    # strips last.pt to the EMA weights as "model" when the run ends
    for phase, key in (("first", "ema"), ("resume", "model")):
        a = ckpts["stock", phase]
        for b in (ckpts["bnswap", phase], ckpts["callback", phase]):
            for k in ("model", "ema"):
                assert (a[k] is None) == (b[k] is None), (phase, k)
            sa, sb = a[key].state_dict(), b[key].state_dict()
            assert sa.keys() == sb.keys() and len(sa) > 300
            assert [k for k in sa if not torch.equal(sa[k], sb[k])] == [], (phase, key)
            assert not any("forward" in vars(m) for m in b[key].modules())


# ------------------------------------------------------------------- the swap, visible
_CONVERT = """
import logging, os, sys, torch, bnswap
{setup}
for _ in range(2):   # the line once per process
    bnswap.convert(torch.nn.Sequential(torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 2),
                                       torch.nn.BatchNorm1d(2)))
"""
_LINE = (
    "bnswap.convert: 2 of 2 BatchNorm layers swapped, 0 skipped; for the per-layer table "
    "call logging.basicConfig(level=logging.INFO)\n"
)


@pytest.mark.parametrize(
    "setup, env, want",
    [
        ("", {}, _LINE),  # nothing configured
        ("logging.getLogger('ultralytics').addHandler(logging.StreamHandler())", {}, _LINE),
        ("logging.basicConfig(level=logging.WARNING)", {}, ""),  # the user's choice
        ("logging.getLogger('bnswap').setLevel(logging.WARNING)", {}, ""),
        ("", {"RANK": "1"}, ""),  # rank zero only
        ("logging.basicConfig(level=logging.INFO, format='%(message)s')", {}, "table"),
    ],
)
def test_the_swap_is_visible_where_logging_is_not_configured(setup, env, want):
    """A script or trainer that configures no logging (or only its own logger, as
    Ultralytics does) sees bnswap.convert's one-line summary on stderr, once per process
    (Python drops INFO there: logging.lastResort shows WARNING and above); a configured
    process gets what it configured (the whole table at INFO, nothing at WARNING), other ranks
    nothing."""
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    e["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(__file__)), e.get("PYTHONPATH", "")]
    )
    proc = run_processes(
        [sys.executable, "-c", _CONVERT.format(setup=setup)], timeout=120, env={**e, **env}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if want == "table":
        assert proc.stderr.count("bnswap: 2 of 2 BatchNorm layers swapped, 0 skipped\n") == 2
        assert _LINE not in proc.stderr
    else:
        assert proc.stderr == want
    assert proc.stdout == ""
