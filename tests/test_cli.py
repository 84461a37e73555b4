"""The `bnswap` console script (LightningCLI) and the examples, on the real digits data."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from tests._helpers import imported_modules, run_bnswap

pytest.importorskip("lightning.pytorch")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "digits_mobilenetv2.yaml"
STOCK = ROOT / "configs" / "digits_mobilenetv2_stock.yaml"


def tiny(tmp: Path) -> list[str]:
    """Overrides that shrink the main job to a smoke run."""
    return [
        "--trainer.max_epochs=2",
        "--trainer.limit_train_batches=3",
        "--trainer.limit_val_batches=2",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--model.init_args.model_kwargs={width_mult: 0.25}",
        f"--trainer.default_root_dir={tmp}",
    ]


def test_console_script_is_installed():
    eps = importlib.metadata.entry_points(group="console_scripts", name="bnswap")
    assert [ep.value for ep in eps] == ["_bnswap_command:main"]


def test_bnswap_train_on_two_ddp_devices_finishes_and_reports_once(tmp_path):
    """Guards (issue 26's review): ``bnswap train --trainer.devices 2 --trainer.strategy
    ddp`` trained, then crashed: rank 1 returned before reading ``Trainer.log_dir``, a
    broadcast rank 0 then waited on ("Connection closed by peer"). It finishes, writes
    the history once, prints the final figures once, and Lightning's sync_dist
    recommendation for the already-reduced validation figures is gone. Real ddp
    processes on 127.0.0.1: collectives time out after COLLECTIVE_TIMEOUT_S, and the
    whole process session is killed past the test's timeout."""
    from datetime import timedelta

    from tests._helpers import COLLECTIVE_TIMEOUT_S

    proc = run_bnswap(
        [
            "train",
            "--config",
            str(CONFIG),
            *tiny(tmp_path),
            "--trainer.max_epochs=1",
            "--trainer.devices=2",
            "--trainer.strategy=lightning.pytorch.strategies.DDPStrategy",
            f"--trainer.strategy.timeout={timedelta(seconds=COLLECTIVE_TIMEOUT_S)}",
            "--trainer.accelerator=cpu",
        ],
        cwd=tmp_path,
        timeout=300,
        processes=True,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("final validation accuracy:") == 1
    assert len(list(tmp_path.rglob("history.json"))) == 1
    assert "sync_dist=True" not in out


def test_a_lightning_subcommand_without_scikit_learn_says_so_in_one_line(monkeypatch, capsys):
    """A newcomer's find (issue 26): with Lightning but no scikit-learn, ``bnswap train``
    ended in a ModuleNotFoundError traceback (exit 1) from the digits data. One line now,
    exit 2, naming what is missing and the extra that brings it, before any import of the
    job."""
    import importlib.util

    import _bnswap_command
    from bnswap.extras import install_hint

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a)
    )
    with pytest.raises(SystemExit) as done:
        _bnswap_command.main(["train", "--config", str(CONFIG)])
    assert done.value.code == 2
    assert capsys.readouterr().err == (
        "bnswap train: error: needs scikit-learn (the main job's digits data), which is not "
        f"installed: {install_hint('lightning')}\n"
    )


def test_configs_differ_only_by_the_callback():
    a, b = yaml.safe_load(CONFIG.read_text()), yaml.safe_load(STOCK.read_text())
    cbs = a["trainer"].pop("callbacks")
    assert cbs == [{"class_path": "bnswap.lightning.BNSwap", "init_args": {"backend": "aten"}}]
    assert "callbacks" not in b["trainer"]
    for cfg in (a, b):
        cfg["trainer"].pop("default_root_dir")
        cfg["trainer"]["logger"]["init_args"].pop("name")
    assert a == b
    assert a["model"]["init_args"]["arch"] == "mobilenetv2"


def test_bnswap_train_prints_the_plan_and_the_final_accuracy(tmp_path):
    exe = shutil.which("bnswap", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "_bnswap_command"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "train", "--config", str(CONFIG), *tiny(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # the callback's line (once, on rank zero; issue 26: not the 52-row table), the
    # plan's summary, then the figures
    assert out.count("BNSwap (fit): 52 of 52 BatchNorm layers swapped, 0 skipped\n") == 1
    # the plan after training: applied, so not "bnswap plan:" (as if bnswap plan ran)
    assert out.splitlines().count("bnswap: 52 of 52 BatchNorm layers swapped, 0 skipped") == 1
    assert "bnswap plan:" not in out
    assert "layer  " not in out and "net.features.0.1" not in out
    line = next(ln for ln in out.splitlines() if ln.startswith("final validation accuracy:"))
    acc = float(line.split()[3])
    hist = json.loads(next(tmp_path.rglob("history.json")).read_text())
    assert hist["batchnorm"] == "bnswap" and hist["backend"] == "aten" and len(hist["history"]) == 2
    assert line.endswith("bnswap BatchNorm, backend aten)")
    assert acc == pytest.approx(hist["history"][-1]["val_acc"], abs=5e-5)
    # the same smoke run with stock BatchNorm reaches the same figures, bit for bit
    stock = subprocess.run(
        [*cmd, "train", "--config", str(STOCK), *tiny(tmp_path / "stock")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert stock.returncode == 0, stock.stdout[-2000:] + stock.stderr[-2000:]
    stock_hist = json.loads(next((tmp_path / "stock").rglob("history.json")).read_text())
    assert hist["history"] == stock_hist["history"] and stock_hist["batchnorm"] == "stock"


def test_bnswap_compare_runs_anywhere_and_plots_stock_vs_bnswap(tmp_path, capsys, monkeypatch):
    """From a folder with no configs/ (the shipped ones are used), without LightningCLI's
    "args parameter" warning; the legend names the backend; seconds per epoch printed."""
    from _bnswap_command import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["bnswap", "compare", "--out", "cmp.png"])
    # no --out: compare.png under --trainer.default_root_dir (tiny() gives tmp_path/runs;
    # it wrote runs/compare.png under the current folder whatever the root)
    png = tmp_path / "runs" / "compare.png"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # train options given directly go to every run (as --overrides would)
        main(
            [
                "compare",
                "--trainer.max_epochs",
                "2",
                "--overrides",
                json.dumps(tiny(tmp_path / "runs")[1:]),
            ]
        )
    assert not [w for w in caught if "args parameter" in str(w.message)]
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    res = json.loads(png.with_suffix(".json").read_text())
    assert list(res) == ["stock", "bnswap (aten)"]
    assert [len(r["history"]) for r in res.values()] == [2, 2]
    assert res["bnswap (aten)"]["plan"].startswith("bnswap: 52 of 52 BatchNorm layers swapped")
    for label, r in res.items():
        f = r["final"]
        assert f == {k: r["history"][-1][k] for k in ("val_loss", "val_acc")}  # float64
        assert f"{label}: final val_acc {f['val_acc']:.4f}" in out
        assert r["seconds_per_epoch"] > 0 and f"{r['seconds_per_epoch']} s per epoch" in out
    # issue 33: the seconds came in run order with no word on it, so stock (first) looked
    # 1.6x slower; each says its run, and a line says they are no speed comparison
    lines = out.strip().splitlines()
    assert "(run 1: " in lines[-3] and lines[-3].lstrip().startswith("stock:")
    assert "(run 2: " in lines[-2] and lines[-2].lstrip().startswith("bnswap (aten):")
    from bnswap.app.cli import TIMES_NOTE

    assert lines[-1] == TIMES_NOTE and "not a speed comparison" in lines[-1]
    assert f"wrote {png} and {png.with_suffix('.json')}" in out
    # the right value is stock's: on CPU both run the same native kernels
    assert res["stock"]["history"] == res["bnswap (aten)"]["history"]


def test_the_configs_ship_in_the_package_and_configs_links_to_them():
    from bnswap.app import configs

    for name in configs.NAMES:
        assert (ROOT / "configs" / name).read_text() == Path(configs.path(name)).read_text()
    assert configs.resolve("digits_mobilenetv2") == configs.path("digits_mobilenetv2.yaml")
    with pytest.raises(FileNotFoundError, match="not one of bnswap's"):
        configs.resolve("nosuch.yaml")


def test_csv_logs_follow_default_root_dir(tmp_path):
    """Guards: --trainer.default_root_dir did not move the CSV logs (the config's logger
    had its own save_dir)."""
    from bnswap.app.cli import run_train

    root = tmp_path / "elsewhere"
    cli = run_train(["--config", "digits_mobilenetv2.yaml", *tiny(root), "--trainer.max_epochs=1"])
    assert Path(cli.trainer.log_dir).is_relative_to(root)
    assert list(root.rglob("metrics.csv"))
    # ... unless a save_dir is given
    other = tmp_path / "logs_here"
    cli = run_train(
        [
            "--config",
            "digits_mobilenetv2.yaml",
            *tiny(root),
            "--trainer.max_epochs=1",
            f"--trainer.logger.init_args.save_dir={other}",
        ]
    )
    assert Path(cli.trainer.log_dir).is_relative_to(other)


def test_a_wrong_backend_fails_while_parsing_in_two_lines(tmp_path):
    """Guards: `--trainer.callbacks.init_args.backend cuda` printed 83 lines of traceback
    after `Seed set to 0`."""
    proc = run_bnswap(
        [
            "train",
            "--config",
            "digits_mobilenetv2.yaml",
            "--trainer.callbacks.init_args.backend",
            "cuda",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) <= 2, lines
    assert "expected one of 'aten', 'ort', got 'cuda'" in lines[0]
    assert "Seed set" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "config, args, message",
    [
        (
            "digits_mobilenetv2.yaml",
            ["--trainer.max_epochs", "abc"],
            "trainer.max_epochs: expected int or None, got 'abc'",
        ),
        (
            "digits_mobilenetv2.yaml",
            ["--model.init_args.arch", "foo"],
            "model.arch: expected one of 'mobilenetv2', 'convnet4', 'resnet18' or an nn.Module "
            "class path (e.g. mymodels.Net), got 'foo'",
        ),
        (
            "digits_mobilenetv2.yaml",
            ["--model.init_args.optimizer", "adam"],
            "model.optimizer: expected one of 'sgd', 'adamw', got 'adam'",
        ),
        (  # a stock config: no callback to take the option (it said "Option 'backend'
            # is not accepted")
            "digits_mobilenetv2_stock.yaml",
            ["--trainer.callbacks.backend", "ort"],
            "trainer.callbacks.backend: no BNSwap callback is given to take it: add one first "
            "(--trainer.callbacks bnswap.BNSwap --trainer.callbacks.backend VALUE) or use a "
            "config that has one (--config digits_mobilenetv2.yaml)",
        ),
        (
            "digits_mobilenetv2.yaml",
            ["--trainer.callbacks.backnd", "aten"],
            "trainer.callbacks: option 'backnd' is taken by no callback given; did you mean "
            "'backend'?",
        ),
        (
            "digits_mobilenetv2.yaml",
            ["--trainer.max_epochz", "3"],
            "unknown option '--trainer.max_epochz'; did you mean '--trainer.max_epochs'?",
        ),
        (
            "digits_mobilenetv2.yaml",
            ["--model.arch", "foo"],
            "model.arch: expected one of 'mobilenetv2', 'convnet4', 'resnet18' or an nn.Module "
            "class path (e.g. mymodels.Net), got 'foo'",
        ),
    ],
)
def test_wrong_values_fail_while_parsing_in_two_lines(
    capsys, monkeypatch, tmp_path, config, args, message
):
    """Guards: a wrong max_epochs or a stock config given a backend printed 9-12 lines of
    jsonargparse's Union report; an unknown arch failed after `Seed set to 0` with a
    74-line traceback (exit 1)."""
    from _bnswap_command import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", config, *args])
    assert exit_.value.code == 2
    err = capsys.readouterr()
    lines = (err.out + err.err).strip().splitlines()
    assert lines == [f"bnswap train: error: {message}", "(bnswap train --help lists every option)"]


def test_a_backend_without_a_callback_fails_as_with_one(capsys, monkeypatch, tmp_path):
    """Guards (a newcomer's report): ``--trainer.callbacks.backend cuda`` on the command
    line with no BNSwap callback said "trainer.callbacks: Option 'backend' is not accepted";
    a config's callback gave the clear error. Both now begin with the same words, and
    the first says how to add the callback."""
    from _bnswap_command import main

    monkeypatch.chdir(tmp_path)
    errors = []
    for config in ([], ["--config", "digits_mobilenetv2.yaml"]):
        with pytest.raises(SystemExit) as exit_:
            main(["train", *config, "--trainer.callbacks.backend", "cuda"])
        assert exit_.value.code == 2
        err = capsys.readouterr()
        errors.append((err.out + err.err).strip().splitlines())
    same = (
        "bnswap train: error: trainer.callbacks.backend: expected one of 'aten', 'ort', got 'cuda'"
    )
    assert errors[1] == [same, "(bnswap train --help lists every option)"]
    assert errors[0] == [
        f"{same}; and no BNSwap callback is given to take it: add one first "
        "(--trainer.callbacks bnswap.BNSwap --trainer.callbacks.backend VALUE) or use a "
        "config that has one (--config digits_mobilenetv2.yaml)",
        "(bnswap train --help lists every option)",
    ]


MYMODELS = """
import lightning.pytorch as pl
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3), nn.BatchNorm2d(width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10),
        )

    def forward(self, x):
        return self.net(x)


class Lit(pl.LightningModule):
    def __init__(self, width: int = 4):
        super().__init__()
        self.net = Tiny(width)
        self.history = []

    def training_step(self, batch, i):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def test_train_takes_a_lightning_module_and_names_the_fix_for_a_plain_one(
    capsys, monkeypatch, tmp_path
):
    """Guards (a newcomer's report): ``bnswap train --model mymodels.Tiny`` (a module in
    the current folder) failed with jsonargparse's "Expected a path but mymodels.Tiny
    either not accessible or invalid": --model took DigitsClassifier's subclasses only,
    so a LightningModule of the user's own was refused as well. Now any LightningModule
    trains, and a plain nn.Module gets a usage error naming ``--model.arch``, which
    trains it as the digits classifier's network (with the callback's swap)."""
    import bnswap
    from bnswap.app.cli import run_train

    (tmp_path / "mymodels_i41.py").write_text(MYMODELS)
    # the real command, from the folder that holds the module
    proc = run_bnswap(["train", "--model", "mymodels_i41.Tiny"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "bnswap train: error: model: mymodels_i41.Tiny is an nn.Module, not a LightningModule "
        "(which adds the loss, optimizer and training step): train it as the digits "
        "classifier's network, --config digits_mobilenetv2.yaml --model.arch "
        "mymodels_i41.Tiny (its arguments: --model.arch.NAME VALUE), or give a LightningModule",
        "(bnswap train --help lists every option)",
    ]
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # the fix it names: the network, built with its own argument, swapped by the callback
    args = [a for a in tiny(tmp_path) if "model_kwargs" not in a]
    cli = run_train(
        [
            "--config",
            "digits_mobilenetv2.yaml",
            "--model.arch",
            "mymodels_i41.Tiny",
            "--model.arch.width",
            "6",
            *args,
        ]
    )
    net = cli.model.net
    assert type(net).__module__ == "mymodels_i41" and type(net).__name__ == "Tiny"
    assert net.net[1].num_features == 6 and bnswap.is_swapped(net.net[1])
    assert cli.results["plan"] == "bnswap: 1 of 1 BatchNorm layers swapped, 0 skipped"
    assert cli.trainer.current_epoch == 2
    # a LightningModule of one's own, on the digits data
    cli = run_train(
        [
            "--model",
            "mymodels_i41.Lit",
            "--data",
            "bnswap.app.data.DigitsDataModule",
            *[a for a in args if not a.startswith("--trainer.limit_val")],
            "--trainer.limit_val_batches=0",
        ]
    )
    assert type(cli.model).__name__ == "Lit" and cli.trainer.global_step == 6
    capsys.readouterr()
    # what is no LightningModule at all, and a module that does not import
    for value, message in (
        ("torch.optim.SGD", "model: torch.optim.SGD is no LightningModule subclass"),
        ("nosuch_i41.Net", "model: No module named 'nosuch_i41'"),
    ):
        with pytest.raises(SystemExit):
            run_train(["--model", value, "--data", "bnswap.app.data.DigitsDataModule"])
        assert capsys.readouterr().err.splitlines()[0] == f"bnswap train: error: {message}"


@pytest.mark.parametrize(
    "args, want",
    [
        (["--trainer.callbacks.exclude", "head.*"], "head.*"),
        (
            ["--trainer.callbacks.init_args.exclude", '["head.*", "features.0.*"]'],
            ["head.*", "features.0.*"],
        ),
        (["--trainer.callbacks.include", "features.*"], "features.*"),
    ],
)
def test_the_callbacks_patterns_take_a_bare_pattern_or_a_list(
    capsys, monkeypatch, tmp_path, args, want
):
    """BNSwap(include=..., exclude=...) take one pattern or a list (``Patterns``); the
    train CLI gives the callback either form as typed (``bnswap plan`` refused a bare one
    until its options took the same forms: tests/test_plan_cli.py)."""
    from _bnswap_command import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", "digits_mobilenetv2.yaml", *args, "--print_config"])
    assert exit_.value.code in (0, None)
    (cb,) = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
    key = "exclude" if "exclude" in args[0] else "include"
    assert cb["class_path"] == "bnswap.lightning.BNSwap"
    assert cb["init_args"][key] == want


def test_help_lists_every_subcommand(capsys):
    from _bnswap_command import SUBCOMMANDS, main

    main(["--help"])
    out = capsys.readouterr().out
    for name in ("train", "validate", "test", "predict", "compare", "plan", "convert"):
        assert name in SUBCOMMANDS
        assert any(line.strip().startswith(name + " ") for line in out.splitlines()), name


@pytest.mark.parametrize("args, code", [(["--help"], 0), (["nope"], 2), (["plann"], 2), ([], 2)])
def test_the_front_door_imports_no_torch(args, code):
    """Issue 21, item 1: ``bnswap --help``, a mistyped subcommand and a bare ``bnswap``
    answer without importing torch (1.7 s here) or anything of the package; ``bnswap
    plan`` does import both (the check can see them: benchmarks/startup.py times it)."""
    cmd = [sys.executable, "-X", "importtime", "-m", "_bnswap_command"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv, rc, must in (
        (args, code, False),
        (["plan", "--model", "torch.nn.BatchNorm1d", "--model.num_features", "3"], 0, True),
    ):
        p = subprocess.run(
            [*cmd, *argv], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
        )
        assert p.returncode == rc, p.stderr[-2000:]
        imported = imported_modules(p.stderr)
        assert ("torch" in imported and "bnswap" in imported) is must, sorted(imported)[:20]
        assert ("usage: bnswap" in p.stdout + p.stderr) is (not must)


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_the_package_version_without_importing_torch(flag):
    import bnswap

    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "_bnswap_command", flag],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert (p.returncode, p.stdout) == (0, f"bnswap {bnswap.__version__}\n")
    assert importlib.metadata.version("bnswap") == bnswap.__version__
    assert "| torch" not in p.stderr


def test_plain_pytorch_example_matches_stock():
    spec = importlib.util.spec_from_file_location(
        "plain_pytorch", ROOT / "examples" / "plain_pytorch.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(epochs=1, width_mult=0.25, max_batches=3, num_threads=None)
    assert res["identical"] is True
    # one torch thread by default, like `bnswap train` (two were 7-9x slower per epoch)
    assert inspect.signature(mod.main).parameters["num_threads"].default == 1
    assert res["stock"]["val_acc"] == res["bnswap"]["val_acc"]


@pytest.mark.parametrize("name", ["ddp_syncbn", "plain_pytorch", "qat_pt2e"])
def test_each_examples_help_gives_its_whole_description(name):
    """Guards (a new user's try): ``python examples/ddp_syncbn.py --help`` cut its
    description mid-sentence ("Train ``steps`` steps of ``batch_size`` (the global batch,
    split over the"): jsonargparse shows a docstring's first line only. The paragraph
    above the options is the example's ``DESCRIPTION`` (else its main's first paragraph),
    whole."""
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    want = getattr(mod, "DESCRIPTION", None) or inspect.getdoc(mod.main).split("\n\n")[0]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "COLUMNS": "80",
    }
    proc = subprocess.run(
        [sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    described = proc.stdout.split("\n\n")[1]  # usage, description, options
    assert " ".join(described.split()) == " ".join(want.split())
    assert described.rstrip().endswith("."), described


@pytest.mark.ort
def test_ort_main_job_config_runs_on_ort_and_tracks_the_aten_run(tmp_path):
    """configs/digits_mobilenetv2_ort.yaml is the main job with backend: ort and nothing
    else changed; a smoke run of it executes BatchNormInternal for every BatchNorm layer
    and ends close to the same smoke run on the aten backend."""
    import bnswap.ort
    from bnswap.app.cli import run_train

    if not bnswap.ort.is_available():
        pytest.skip("onnxruntime-training / torch-ort not installed")
    ort_cfg = ROOT / "configs" / "digits_mobilenetv2_ort.yaml"
    a, b = yaml.safe_load(CONFIG.read_text()), yaml.safe_load(ort_cfg.read_text())
    assert b["trainer"]["callbacks"] == [
        {"class_path": "bnswap.lightning.BNSwap", "init_args": {"backend": "ort"}}
    ]
    for cfg in (a, b):
        cfg["trainer"].pop("callbacks")
        cfg["trainer"].pop("default_root_dir")
        cfg["trainer"]["logger"]["init_args"].pop("name")
    assert a == b
    runs = {}
    for name, cfg in (("aten", CONFIG), ("ort", ort_cfg)):
        cli = run_train(["--config", str(cfg), *tiny(tmp_path / name)])
        runs[name] = cli
        assert cli.results["backend"] == name
    net = runs["ort"].model.net
    assert type(net).__name__ == "BNSwapORTModule"
    n_bn = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in net.modules())
    assert n_bn > 0 and bnswap.ort.executed_ops(net, training=True)["BatchNormInternal"] == n_bn
    got, want = runs["ort"].results["history"], runs["aten"].results["history"]
    assert len(got) == len(want) == 2
    # float32 rounding only (ill-conditioned net, tests/test_ort.py): measured relative
    # gaps 1.5e-3 and 1.3e-2 after 3 and 6 SGD steps
    for g, w in zip(got, want, strict=True):
        assert g["val_loss"] == pytest.approx(w["val_loss"], rel=5e-2)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["train", "--config", "digits_mobilenetv2.yaml", "--trainer.max_epochs", "-3"],
            "bnswap train: error: `max_epochs` must be a non-negative integer or -1. "
            "You passed in -3.",
        ),
        (
            ["train", "--config", "digits_mobilenetv2.yaml", "--data.batch_size", "0"],
            "bnswap train: error: batch_size should be a positive integer value, got 0",
        ),
        (
            ["validate", "--config", "digits_mobilenetv2.yaml", "--ckpt_path", "missing.ckpt"],
            "bnswap validate: error: ckpt_path: no such file: 'missing.ckpt'",
        ),
        (
            ["train", "--config", "digits_mobilenetv2.yaml", "--model.init_args.lr", "-1"],
            "bnswap train: error: lr must be > 0, got -1.0",
        ),
        (
            ["train", "--config", "digits_mobilenetv2.yaml", "--model.init_args.num_classes", "0"],
            "bnswap train: error: num_classes must be >= 1, got 0",
        ),
        (
            ["train", "--config", "digits_mobilenetv2.yaml", "--num_threads", "0"],
            "bnswap train: error: num_threads: expected a positive integer or null, got 0",
        ),
        (
            ["compare", "--labels", "a", "b", "c"],
            "bnswap compare: error: labels: 3 given for 2 configs",
        ),
        # a train option's typo is compare's error (it said "bnswap train: error")
        (
            ["compare", "--trainer.max_epochz", "2"],
            "bnswap compare: error: unknown option '--trainer.max_epochz'; did you mean "
            "'--trainer.max_epochs'?",
        ),
        (
            ["train"],
            "bnswap train: error: missing --data, --model (a config gives them: "
            "--config digits_mobilenetv2.yaml)",
        ),
        (
            ["train", "--config", "notes.txt"],
            "bnswap train: error: config: not a config file (a YAML mapping of options: trainer:, "
            "model:, data: ...); it begins 'root:x:0:0:root:/root:/bin/bash'",
        ),
        (
            ["compare", "--configs", "digits_mobilenetv2.yaml", "nothere.yaml"],
            "bnswap compare: error: configs: no config 'nothere.yaml': not a file here, and "
            "not one "
            "of bnswap's (digits_mobilenetv2.yaml, digits_mobilenetv2_stock.yaml, "
            "digits_mobilenetv2_ort.yaml)",
        ),
    ],
)
def test_values_refused_after_parsing_fail_before_training_in_two_lines(
    capsys, monkeypatch, tmp_path, args, message
):
    """Guards (a fresh user's report): a negative max_epochs, batch_size 0 and a missing
    checkpoint passed parsing and ended in 29-70-line tracebacks (exit 1); no config said
    "bnswap: error: ... required: train.data, train.model"; a file that is not a config was
    echoed whole; compare trained its first config before finding the second missing."""
    from _bnswap_command import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("root:x:0:0:root:/root:/bin/bash\n" * 30)
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr()
    prog = message.split(":")[0]
    lines = [ln for ln in (err.out + err.err).strip().splitlines() if ln != "Seed set to 0"]
    assert lines == [message, f"({prog} --help lists every option)"]
    assert not list(tmp_path.rglob("*.csv"))  # nothing trained


def test_compare_takes_configs_one_by_one_or_as_a_list(capsys):
    """Guards the README's ``--configs A.yaml B.yaml``: only a JSON list parsed."""
    from _bnswap_command import main

    for configs in (
        ["digits_mobilenetv2_stock.yaml", "digits_mobilenetv2.yaml"],
        ['["digits_mobilenetv2_stock.yaml", "digits_mobilenetv2.yaml"]'],
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["compare", "--configs", *configs, "--labels", "a", "b", "--print_config"])
        assert exit_.value.code == 0
        cfg = yaml.safe_load(capsys.readouterr().out)
        assert cfg["configs"] == ["digits_mobilenetv2_stock.yaml", "digits_mobilenetv2.yaml"]
        assert cfg["labels"] == ["a", "b"]


def test_no_subcommand_is_a_usage_error(capsys):
    """argparse's convention: help on stderr, exit 2 (it exited 0)."""
    from _bnswap_command import SUBCOMMANDS, main

    with pytest.raises(SystemExit) as exit_:
        main([])
    out = capsys.readouterr()
    assert exit_.value.code == 2 and out.out == ""
    assert all(name in out.err for name in SUBCOMMANDS)


@pytest.mark.parametrize("epochs", [1, 3])
def test_the_compare_plot_counts_whole_epochs_from_1(epochs):
    """Guards the epoch axis: after one epoch matplotlib's integer locator fell back to
    ticks 0.945 ... 1.05 (it wants two integers in view)."""
    pytest.importorskip("matplotlib")
    from bnswap.app.cli import plot

    history = [{"epoch": e, "val_loss": 1.0 / (e + 1), "val_acc": 0.3 * e} for e in range(epochs)]
    fig = plot({"stock": {"history": history}, "bnswap (aten)": {"history": history}})
    fig.canvas.draw()
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        assert [t for t in ax.get_xticks() if lo <= t <= hi] == list(range(1, epochs + 1))
        assert [line.get_xdata().tolist() for line in ax.get_lines()] == [
            list(range(1, epochs + 1))
        ] * 2
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["stock", "bnswap (aten)"]
    assert "the curves coincide" in fig._suptitle.get_text()


def test_predict_writes_its_predictions_and_says_where(tmp_path, capsys, monkeypatch):
    """Guards: ``bnswap predict`` printed and wrote nothing (issue 21)."""
    import torch

    from bnswap.app.cli import BNSwapCLI

    monkeypatch.setattr(sys, "argv", ["bnswap"])
    cli = BNSwapCLI(
        args=[
            "predict",
            "--config",
            str(CONFIG),
            *tiny(tmp_path)[2:],
            "--trainer.limit_predict_batches=2",
        ]
    )
    path = tmp_path / "predictions.pt"
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"wrote {path}: 359 predictions in 2 batches (torch.load it: a list of tensors, "
        "one per batch)"
    )
    got = torch.load(path)
    model = cli.model.eval()
    want = []
    with torch.no_grad():
        for i, (x, _) in enumerate(cli.datamodule.predict_dataloader()):
            if i == 2:
                break
            want.append(model(x).argmax(1))
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_ort_config_without_onnx_runtime_is_a_usage_error(capsys, monkeypatch, tmp_path):
    """Guards (a fresh user's review): the ORT config where ONNX Runtime training is not
    installed ended in a 41-line ORTNotAvailableError traceback (exit 1) once fit began."""
    import importlib

    from _bnswap_command import main

    ort = importlib.import_module("bnswap.ort")
    monkeypatch.setattr(ort, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", "digits_mobilenetv2_ort.yaml", *tiny(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr()
    lines = [ln for ln in (err.out + err.err).strip().splitlines() if ln != "Seed set to 0"]
    assert lines == [
        "bnswap train: error: trainer.callbacks: BNSwap(backend='ort') needs ONNX Runtime "
        f"training and torch-ort: {ort.INSTALL}",
        "(bnswap train --help lists every option)",
    ]
    assert not list(tmp_path.rglob("*.csv"))  # nothing trained


def test_a_mistyped_subcommand_gets_a_did_you_mean_not_the_whole_help():
    """Guards issue 26: ``bnswap plann`` printed the whole help (13 lines) and "unknown
    subcommand". argparse's two lines instead: the usage, then the closest subcommand
    (difflib, as argparse does from Python 3.12 and git does) or the choices."""
    import _bnswap_command

    usage = _bnswap_command.usage_line()
    assert _bnswap_command.help_text().splitlines()[0] == usage
    for typed, error in (
        ("plann", "unknown subcommand 'plann'; did you mean 'plan'?"),
        ("trian", "unknown subcommand 'trian'; did you mean 'train'?"),
        # issue 33: an option was "an unknown subcommand", with no hint
        ("--verison", "unknown option '--verison'; did you mean '--version'?"),
        ("--hlep", "unknown option '--hlep'; did you mean '--help'?"),
        (
            "nope",
            "unknown subcommand 'nope' (choose from "
            + ", ".join(_bnswap_command.SUBCOMMANDS)
            + ")",
        ),
    ):
        p = run_bnswap([typed], timeout=120)
        assert (p.returncode, p.stdout, p.stderr) == (2, "", f"{usage}\nbnswap: error: {error}\n")


def test_the_front_door_alone_holds_the_subcommand_table():
    """Guards issue 26's house row: ``bnswap.app.cli`` imported the front door (its table
    and ``main``) while the front door imports it to dispatch. Nothing in the package
    imports ``_bnswap_command``; the Lightning parser knows its own subcommands, which
    are the front door's Lightning ones."""
    import ast

    import _bnswap_command
    from bnswap.app.cli import BNSwapCLI

    importers = []
    for path in sorted((ROOT / "bnswap").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom)
                else [node.value]
                if isinstance(node, ast.Constant)
                else []
            )
            if "_bnswap_command" in names:  # (a static import, or import_module's string)
                importers.append(str(path.relative_to(ROOT)))
    assert importers == []
    assert [*BNSwapCLI.subcommands(), "compare"] == list(_bnswap_command.LIGHTNING_SUBCOMMANDS)


# ------------------------------------------------ usage errors before Lightning (issue 46)
def _parser_options(subcommand: str) -> list[str]:
    """Every ``--option`` of ``bnswap SUBCOMMAND``'s real parser (LightningCLI's, built)."""
    from bnswap.app import cli

    seen: dict[str, list[str]] = {}

    class Catch(cli._Parser):
        def error(self, message, ex=None):
            seen["options"] = cli._option_strings(getattr(ex, "subcommand_parser", None) or self)
            raise SystemExit(2)

    with pytest.raises(SystemExit):
        cli.BNSwapCLI(args=[subcommand, "--no-such-option"], parser_class=Catch)
    return seen["options"]


@pytest.mark.parametrize("subcommand", ["train", "validate", "test", "predict"])
def test_the_front_doors_option_list_is_the_parsers(subcommand):
    """The front door reads each Trainer subcommand's options from the sources (no import
    of Lightning): the same names as LightningCLI's parser gives (less its '.help' entries
    of a Trainer argument's class and the '+' of list arguments, which it reads as their
    option), so a Lightning release that adds or renames one shows here."""
    from _bnswap_command import lightning_options

    real = {
        o.rstrip("+")
        for o in _parser_options(subcommand)
        if not (o.startswith("--trainer.") and o.endswith(".help"))
    }
    assert set(lightning_options(subcommand)) == real


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--nope"],
        ["train", "--config", "digits_mobilenetv2.yaml", "--trainer.max_epochz", "3"],
        ["train", "--num_threadz", "2"],
        ["train", "--trainer.max_epochs=2", "--ckpt-path", "a.ckpt"],
        ["validate", "--verbse", "false"],
        ["predict", "--return_predictons", "true"],
        ["test", "--trainr.max_epochs", "1"],
        ["compare", "--trainer.max_epochz", "2"],
        ["train"],
        ["validate"],
        ["train", "--config", "nope.yaml"],
        ["validate", "--config=sub/nope.yml", "--trainer.max_epochs", "1"],
        ["train", "--config", "nope.yaml", "--nope"],
        ["train", "--nope", "--config", "nope.yaml"],
        ["test", "--trainr.max_epochs", "1", "--model", "bnswap.app.task.DigitsClassifier"],
    ],
)
def test_a_usage_error_is_the_parsers_before_lightning_is_imported(
    capsys, monkeypatch, tmp_path, args
):
    """Issue 46: a usage error of a Lightning subcommand took 11-17 s (Lightning's import
    and the parser's build). The front door finds a mistyped option, a config file that
    is not there and a run with no model and data first: the same two lines as the full
    parser prints (run here with the front door's check off)."""
    import _bnswap_command

    monkeypatch.chdir(tmp_path)
    errors = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(_bnswap_command, "lightning_usage_error", lambda *a: None)
        with pytest.raises(SystemExit) as exit_:
            _bnswap_command.main(args)
        assert exit_.value.code == 2
        errors.append(capsys.readouterr().err)
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"bnswap {args[0]}: error: ")


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--config", "digits_mobilenetv2.yaml", "--model.init_args.lr", "0.1"],
        ["train", "--config", "digits_mobilenetv2.yaml", "--trainer.callbacks.backend", "ort"],
        ["train", "--model=m.Lit", "--trainer.logger.save_dir", "x"],
        ["train", "--trainer.callbacks+=bnswap.BNSwap", "--data.batch_size", "8"],
        ["predict", "--config=digits_mobilenetv2_stock.yaml", "--ckpt_path", "x.ckpt"],
        ["train", "--config=digits_mobilenetv2.yaml", "--print_config", "--", "--nope"],
        ["train", "--num_thread", "2", "--ckpt", "a.ckpt", "--model", "m.Lit"],  # expanded
        ["train", "--config", "digits_mobilenetv2.yaml"],  # a shipped config, by name
        ["train", "--config", "trainer:\n  max_epochs: 1\n", "--model", "m.Lit"],  # its text
        ["compare"],
        ["train", "--trainer.callbacks.backend", "cuda"],  # (the parser reads it first)
        ["predict", "--num_threads", "2"],
    ],
)
def test_options_the_front_door_cannot_judge_are_left_to_the_parser(args):
    """Options under a class-valued one (the class is known once parsed), known ones and
    the start of one (argparse expands an abbreviation, with jsonargparse's deprecation
    warning) are no usage error of the front door's."""
    from _bnswap_command import lightning_usage_error

    assert lightning_usage_error(args[0], args[1:]) is None


@pytest.mark.parametrize(
    "args, said",
    [
        (["--trainr.x", "1"], "unknown option '--trainr.x'; did you mean"),
        (["--config", "nope.yaml"], "config: File does not exist: "),
        ([], "missing --data, --model"),
    ],
)
def test_a_usage_error_answers_without_importing_torch_or_lightning(args, said):
    """Issue 46: ``bnswap train --trainr.max_epochs 3`` answered after 11-17 s; the front
    door's check imports neither torch nor Lightning."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "_bnswap_command", "train", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert p.returncode == 2
    imported = imported_modules(p.stderr)
    assert not {"torch", "lightning", "bnswap"} & imported, sorted(imported)[:20]
    assert f"bnswap train: error: {said}" in p.stderr
