"""``bnswap plan``: any model or the main job's config, three formats, exit codes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("jsonargparse")
pytest.importorskip("lightning.pytorch")

import bnswap
from bnswap.app import convert_cli, plan_cli
from tests import plan_models
from tests._helpers import run_bnswap

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = plan_cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_layer_swapped_exits_0_in_each_format(capsys):
    code, out, _ = run(capsys, "--model", "tests.plan_models.plain_net", "--model.width", "6")
    assert code == 0 and out.startswith("bnswap plan: 1 of 1 BatchNorm layers would be swapped")
    code, out, _ = run(capsys, "--model", "tests.plan_models.plain_net", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["summary"] == {
        "layers": 1,
        "swapped": 1,
        "skipped": 0,
        "backend": "aten",
        "text": data["summary"]["text"],
        "note": None,
    }
    assert data["layers"] == [
        {
            "name": "1",
            "class": "BatchNorm2d",
            "action": "swap",
            "backend": "aten",
            "kernel": "Native",
            "adapter": "bnswap.layers.batch_norm_forward",
            "sync": None,
            "reason": None,
        }
    ]
    code, out, _ = run(capsys, "--model", "tests.plan_models.plain_net", "--format", "markdown")
    rows = [ln for ln in out.splitlines() if ln.startswith("| ")]
    assert code == 0 and rows[0].split(" | ")[0] == "| layer" and len(rows) == 2
    assert [c.strip() for c in rows[1].strip("|").split("|")][:3] == [
        "`1`",
        "`BatchNorm2d`",
        "swap",
    ]
    # docs/cli.md: the Markdown table has the JSON's columns, sync always; the plain
    # table shows sync only when a layer synchronizes
    assert [c.strip() for c in rows[0].strip("|").split("|")] == [
        "layer",
        "class",
        "action",
        "backend",
        "kernel",
        "adapter",
        "sync",
        "reason",
    ]
    code, out, _ = run(capsys, "--model", "tests.plan_models.plain_net")
    assert code == 0 and out.splitlines()[1].split() == [
        "layer",
        "class",
        "action",
        "backend",
        "kernel",
        "adapter",
        "reason",
    ]


def test_skipped_layers_exit_3_with_their_reasons(capsys):
    code, out, _ = run(capsys, "--model", "tests.plan_models.mixed_net", "--format", "json")
    data = json.loads(out)
    assert code == plan_cli.EXIT_SOME_SKIPPED == 3
    by_name = {r["name"]: r for r in data["layers"]}
    assert by_name["2"]["action"] == "skip" and "set on the instance" in by_name["2"]["reason"]
    assert by_name["3"]["action"] == "skip" and "overrides forward" in by_name["3"]["reason"]
    assert [r["action"] for r in data["layers"]] == ["swap", "skip", "skip", "swap"]
    # JSON says null where the table shows "-" (it wrote the string "-")
    assert {k: by_name["3"][k] for k in ("backend", "kernel", "adapter")} == dict.fromkeys(
        ("backend", "kernel", "adapter")
    )
    code, out, _ = run(capsys, "--model", "tests.plan_models.mixed_net", "--exclude", '["6"]')
    assert code == 3 and "excluded by '6'" in out


@pytest.mark.parametrize(
    "option, args, api",
    [
        ("--exclude", ["6"], "6"),  # a bare pattern (a new user's report)
        ("--exclude", ["[12]"], None),  # YAML's list [12], not strings: refused
        ("--exclude", ["[1-3]*"], "[1-3]*"),  # no YAML: a glob character class
        ("--exclude", ['["2", "6"]'], ["2", "6"]),  # a JSON list
        ("--exclude", ["['2', '6']"], ["2", "6"]),  # a YAML list
        ("--exclude+", ["2", "--exclude+", "6"], ["2", "6"]),  # one pattern at a time
        ("--include", ["1"], "1"),
        ("--include", ['["1", "6"]'], ["1", "6"]),
    ],
)
def test_include_and_exclude_take_a_bare_pattern_or_a_list(capsys, option, args, api):
    """Guards: ``--exclude head.*`` failed ("exclude: expected list[str] or None, got
    'head.*'", exit 2) where bnswap.plan and BNSwap(exclude=...) take one pattern. Each
    form plans what the Python API plans with the same patterns; a value YAML reads as a
    list of non-strings stays a usage error (jsonargparse would keep it as one glob)."""
    code, out, err = run(
        capsys, "--model", "tests.plan_models.mixed_net", "--format", "json", option, *args
    )
    if api is None:
        assert code == 2 and out == ""
        assert err.splitlines()[0] == (
            "bnswap plan: error: exclude: expected a glob pattern or a list of patterns "
            "(str), got '[12]'; a pattern that is itself a YAML list goes in one: "
            "--exclude '[\"[12]\"]'"
        ), err
        return
    key = option.strip("-+")
    want = bnswap.plan(plan_models.mixed_net(), **{key: api})
    got = json.loads(out)["layers"]
    assert [(r["name"], r["action"], r["reason"]) for r in got] == [
        (r.name, r.action, None if r.reason == "-" else r.reason) for r in want
    ]
    # 3 only for a layer bnswap cannot swap, not for one the patterns left out (issue 26)
    assert code == (
        3
        if any(not r.reason.startswith(("excluded by", "not matched by")) for r in want.skipped)
        else 0
    )
    assert any(key in r.reason for r in want.skipped)  # the patterns did something


def test_the_main_jobs_config(capsys):
    code, out, _ = run(capsys, "--config", "digits_mobilenetv2.yaml")
    assert code == 0 and out.startswith("bnswap plan: 52 of 52 BatchNorm layers would be swapped")
    code, out, _ = run(capsys, "--config", "digits_mobilenetv2_ort.yaml", "--format", "json")
    assert json.loads(out)["summary"]["backend"] == "ort"  # the config's callback


def test_a_device_not_present_is_predicted_and_said(capsys):
    import torch

    code, out, _ = run(capsys, "--model", "tests.plan_models.plain_net", "--device", "cuda")
    assert code == 0
    if torch.cuda.is_available():
        assert "Cudnn" in out and "predicted" not in out
    else:
        assert "Cudnn (predicted)" in out and "note: no cuda device here" in out


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--model", "tests.plan_models.plain_net", "--config", "digits_mobilenetv2.yaml"],
        ["--model", "tests.plan_models.plain_net", "--backend", "cudnn"],
        ["--model", "no.such.model"],
        ["--config", "nosuch.yaml"],
        ["--model", "tests.plan_models.plain_net", "--device", "gpu"],
        ["--model", "tests.plan_models.plain_net", "--format", "xml"],
    ],
)
def test_usage_errors_exit_2(capsys, args):
    code, out, err = run(capsys, *args)
    assert code == plan_cli.EXIT_USAGE == 2 and "error" in err and not out


def test_the_console_script_exits_with_the_plans_status(tmp_path):
    proc = run_bnswap(["plan", "--model", "tests.plan_models.mixed_net"])
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "bnswap plan: 2 of 4 BatchNorm layers would be swapped, 2 skipped" in proc.stdout


def test_an_unannotated_function_is_called_and_its_result_checked(capsys):
    """Guards: a plain factory ``def net(width=4): return nn.Sequential(...)`` was refused
    until annotated (issue 21); its arguments are --model.NAME, as for a class."""
    code, out, err = run(
        capsys,
        "--model",
        "tests.plan_models.unannotated_net",
        "--model.width",
        "6",
        "--format",
        "json",
    )
    assert (code, err) == (0, "")
    ref = bnswap.plan(plan_models.plain_net(6)).to_dicts()
    assert [{k: v for k, v in r.items() if k != "cls"} for r in ref] == [
        {k: "-" if v is None else v for k, v in r.items() if k != "class"}
        for r in json.loads(out)["layers"]
    ]
    code, out, err = run(capsys, "--model=tests.plan_models.unannotated_net", "--model.wdth", "6")
    assert code == 2 and err.splitlines()[0] == (
        "bnswap plan: error: unknown option '--model.wdth'; did you mean '--model.width'?"
    )
    code, out, err = run(capsys, "--model", "tests.plan_models.not_a_model")
    assert (
        code == 2
        and not out
        and err.splitlines()
        == [
            "bnswap plan: error: model: tests.plan_models.not_a_model returned int, not an "
            "nn.Module"
        ]
    )


def test_notes_say_what_the_kernel_column_could_not_know(capsys, monkeypatch):
    """Guards: --device mps (absent) showed n/a with no word why; --backend ort --device
    cuda printed the cuDNN prediction note for a column that names ORT's kernel."""
    import importlib

    # (where ONNX Runtime training is missing, .venv-zoo, a note says so: another test)
    monkeypatch.setattr(importlib.import_module("bnswap.ort"), "is_available", lambda: True)
    code, out, _ = run(capsys, "--model", "tests.plan_models.plain_net", "--device", "meta")
    assert code == 0 and out.splitlines()[-1] == (
        "note: the kernel for device 'meta' could not be probed here (n/a (meta)): is the "
        "device present?"
    )
    code, out, _ = run(
        capsys, "--model", "tests.plan_models.plain_net", "--backend", "ort", "--device", "cuda"
    )
    assert code == 0 and "note" not in out and "BatchNormInternal (ORT)" in out


def test_a_closed_pipe_is_not_an_error(tmp_path):
    """Guards: `bnswap plan ... | head -1` ended in a BrokenPipeError traceback, exit 1."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "_bnswap_command", "plan", "--config", "digits_mobilenetv2.yaml"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=root,
    )
    proc.stdout.close()  # the reader leaves before the table is written
    try:  # (a hung command fails the test at the timeout, killed, not blocking the read)
        _, err_bytes = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    err = err_bytes.decode()
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_help_lists_every_option_without_the_module_class_list(capsys):
    """Guards the help formatter: jsonargparse appends "known subclasses: ..." to
    ``--model`` (every nn.Module class imported, ~450 lines); the help keeps each option,
    its type and default, and stays one screen long."""
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for option in (
        "--model MODEL",
        "--config CONFIG",
        "--backend BACKEND",
        "--include",
        "--exclude",
        "--device DEVICE",
        "--format {table,json,markdown}",
    ):
        assert option in out
    assert "known subclasses" not in out and "torch.nn.Identity" not in out
    assert "(type: Module | null, default: null)" in " ".join(out.split())
    assert len(out.splitlines()) < 60


def test_model_help_usage_line_names_bnswap_plan(capsys, monkeypatch):
    """Guards (issue 33's newcomer): ``bnswap plan --model.help CLASS`` printed jsonargparse's
    usage with the process's name, ``usage: bnswap [--model.num_features ...]`` (or
    ``_bnswap_command.py`` under ``python -m``), where the options are ``bnswap plan``'s.
    sys.argv[0] is left as it was."""
    monkeypatch.setattr(
        sys, "argv", ["/somewhere/bin/bnswap", "plan", "--model.help", "torch.nn.BatchNorm2d"]
    )
    code, out, _ = run(capsys, "--model.help", "torch.nn.BatchNorm2d")
    assert code == 0 and out.startswith("usage: bnswap plan --model.num_features NUM_FEATURES")
    assert "--model.momentum" in out and sys.argv[0] == "/somewhere/bin/bnswap"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--config", "digits_mobilenetv2.yaml", "--backend", "cuda"],
            "backend: expected one of 'aten', 'ort', got 'cuda'",
        ),
        (
            ["--model", "torch.nn.BatchNorm2d", "--model.num_features", "abc"],
            "model.num_features: expected int, got 'abc'",
        ),
        (
            [
                "--model",
                "torch.nn.BatchNorm2d",
                "--model.num_features",
                "3",
                "--model.momentum",
                "a",
            ],
            "model.momentum: expected float or None, got 'a'",
        ),
        (
            ["--model", "torch.nn.BatchNorm2d", "--model.num_features", "3", "--include", "[1]"],
            "include: expected a glob pattern or a list of patterns (str), got '[1]'",
        ),
        (["--model", "tests.plan_models.failing_net"], "model: kaboom (width 4)"),
        (
            ["--model", "torch.nn.BatchNorm2d", "--model.num_features", "3", "--device", "tpu"],
            "device: 'tpu' is not a device type torch knows (e.g. cpu, cuda, ",
        ),
        (["--config", "/etc/hostname"], "/etc/hostname: no 'model' section"),
    ],
)
def test_usage_errors_name_the_option_and_the_reason_in_one_line(capsys, args, message):
    """Guards the one-line errors (a fresh user's report): a wrong backend said
    "expected None"; a wrong value inside --model was cut off after 'Parser key
    "num_features":'; a model function that raised, and a bad device, printed
    jsonargparse's / torch's report without the option."""
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.splitlines()[0].startswith(f"bnswap plan: error: {message}"), err
    assert len(err.splitlines()) <= 2


def test_a_pattern_that_matches_nothing_warns_in_one_line(capsys):
    """Guards the warning's form: Python's default printed the source path and line."""
    code, out, err = run(
        capsys, "--model", "tests.plan_models.plain_net", "--include", '["nothing*"]'
    )
    # (exit 3: an include that matches no layer swaps nothing, a typo a CI gate must
    # not pass; an include that matches some layers exits 0, issue 26)
    assert code == 3 and "not matched by include" in out
    assert err == "bnswap plan: warning: include pattern 'nothing*' matches no BatchNorm layer\n"


def test_a_mistyped_option_gets_a_did_you_mean_as_a_mistyped_subcommand_does(capsys, tmp_path):
    """Guards (a newcomer's report): ``bnswap plan --modle m.net`` answered "unrecognized
    arguments: --modle m.net" where ``bnswap plann`` gets "did you mean 'plan'?". Through
    the front door, as typed; an option nothing is close to keeps argparse's word."""
    from _bnswap_command import main

    for args, message in (
        (
            ["plan", "--modle", "tests.plan_models.plain_net"],
            "bnswap plan: error: unknown option '--modle'; did you mean '--model'?",
        ),
        (
            ["plan", "--model", "tests.plan_models.plain_net", "--formt=json"],
            "bnswap plan: error: unknown option '--formt'; did you mean '--format'?",
        ),
        (
            ["plan", "--model", "tests.plan_models.plain_net", "--zzzzzz", "1"],
            "bnswap plan: error: unknown option '--zzzzzz'",
        ),
        (
            ["convert", str(tmp_path / "m.pt2"), "--ouput", str(tmp_path / "o.pt2")],
            "bnswap convert: error: unknown option '--ouput'; did you mean '--output'?",
        ),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        out = capsys.readouterr()
        assert exit_.value.code == 2 and not out.out
        command = args[0]
        assert out.err.splitlines() == [message, f"(bnswap {command} --help lists every option)"]


def test_convert_with_sync_batchnorm_says_why_programs_take_none(capsys, tmp_path):
    """A newcomer's find (issue 26): ``bnswap convert m.pt2 -o o.pt2 --sync_batchnorm``
    answered a bare "unrecognized arguments", where ``bnswap plan --program`` explains.
    The same one line, exit 2, from both."""
    assert (
        convert_cli.convert_main(
            [str(tmp_path / "m.pt2"), "-o", str(tmp_path / "o.pt2"), "--sync_batchnorm"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err == f"bnswap convert: error: {convert_cli.NO_SYNC_FOR_PROGRAMS}\n"
    assert "process group" in err


def test_an_include_that_chooses_some_layers_exits_0_and_one_that_chooses_none_3(capsys):
    """Guards the include half of issue 26's exit rule: the layers an include leaves out
    are left out on purpose (exit 0) when it chose some; an include that matched no
    layer swaps nothing (exit 3, with its warning)."""
    code, out, _ = run(capsys, "--model", "tests.plan_models.two_kinds", "--include", "0")
    assert code == 0 and "not matched by include" in out, out
    code, out, _ = run(capsys, "--model", "tests.plan_models.two_kinds", "--include", "9")
    assert code == 3, out


def test_a_config_that_is_no_yaml_is_a_usage_error(capsys, tmp_path):
    """Guards: a config with a YAML syntax error gave a 49-line yaml traceback (exit 1)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("foo: [unclosed\n")
    code, out, err = run(capsys, "--config", str(bad))
    assert code == 2 and out == ""
    assert err == f"bnswap plan: error: {bad}: not YAML (while parsing a flow sequence)\n"


@pytest.mark.parametrize("device", ["xpu", "hpu", "mtia"])
def test_a_device_this_torch_cannot_probe_gets_the_note(capsys, device):
    """Guards: xpu / mtia raised AssertionError ("Torch not compiled with XPU enabled") and
    hpu ModuleNotFoundError from the probe, through the table (exit 1); they get the
    "could not be probed" note, as mps does."""
    import torch

    if getattr(torch, device, None) is not None and getattr(torch, device).is_available():
        pytest.skip(f"a {device} device is present")
    code, out, err = run(capsys, "--model", "tests.plan_models.plain_net", "--device", device)
    assert code == 0 and err == ""
    assert f"note: the kernel for device '{device}' could not be probed here (n/a (" in out


def test_a_config_without_the_callback_says_training_it_keeps_stock(capsys):
    """Guards (a newcomer's report): `plan --config digits_mobilenetv2_stock.yaml` said
    "52 of 52 swapped" with no word that training that config swaps nothing."""
    note = (
        "note: digits_mobilenetv2_stock.yaml has no BNSwap callback: `bnswap train` with "
        "it keeps stock BatchNorm; the table is what adding one would swap"
    )
    code, out, _ = run(capsys, "--config", "digits_mobilenetv2_stock.yaml")
    assert code == 0 and out.rstrip("\n").splitlines()[-1] == note
    code, out, _ = run(capsys, "--config", "digits_mobilenetv2_stock.yaml", "--format", "json")
    assert json.loads(out)["summary"]["note"] == note
    code, out, _ = run(capsys, "--config", "digits_mobilenetv2.yaml", "--format", "json")
    assert json.loads(out)["summary"]["note"] is None


# ------------------------------------------------------------------ programs (.pt2)
def _program_file(tmp_path):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4, affine=False))
    model.train()
    x = torch.randn(2, 3, 8, 8)
    ep = torch.export.export(model, (x,))
    path = tmp_path / "model.pt2"
    torch.export.save(ep, path)
    return path, ep, x


def test_plan_of_a_program_file_one_row_per_node(capsys, tmp_path):
    path, _, _ = _program_file(tmp_path)
    code, out, _ = run(capsys, "--program", str(path), "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["summary"]["nodes"] == 2 and data["summary"]["swapped"] == 2
    assert [(r["node"], r["op"], r["becomes"], r["kernel"]) for r in data["nodes"]] == [
        (n, "aten.batch_norm.default", "aten._batch_norm_with_update.default", "Native")
        for n in ("batch_norm", "batch_norm_1")
    ]
    code, out, _ = run(
        capsys, "--program", str(path), "--exclude", '["batch_norm_1"]', "--format", "markdown"
    )
    # (exit 0: a node left out on purpose; issue 26)
    assert code == 0 and "| `batch_norm_1` |" in out and "excluded by 'batch_norm_1'" in out
    # docs/cli.md: a program's Markdown table has kernel_before beside kernel (the JSON's
    # columns); the plain table shows kernel only
    assert "| node | op | action | becomes | kernel_before | kernel | reason |" in out
    code, out, _ = run(capsys, "--program", str(path))
    assert code == 0 and out.splitlines()[1].split() == [
        "node",
        "op",
        "action",
        "becomes",
        "kernel",
        "reason",
    ]


def test_plan_and_convert_of_a_converted_program_say_nothing_would_change(tmp_path, capsys):
    """Issue 26: ``bnswap plan`` of a program bnswap had converted said ``swap`` ("already
    the consolidated op"). Now ``keep`` in the table and JSON, exit 0, and the summary
    says nothing would change; ``bnswap convert`` of it says the same."""
    path, _, _ = _program_file(tmp_path)
    done = tmp_path / "done.pt2"
    assert convert_cli.convert_main([str(path), "-o", str(done)]) == 0
    capsys.readouterr()
    summary = "all 2 batch-norm nodes already on bnswap's ops: nothing would change"
    code, out, _ = run(capsys, "--program", str(done))
    assert code == 0 and out.startswith(f"bnswap plan: {summary}\n")
    assert [ln.split()[2] for ln in out.splitlines()[3:5]] == ["keep", "keep"]
    code, out, _ = run(capsys, "--program", str(done), "--format", "json")
    data = json.loads(out)
    assert code == 0 and [r["action"] for r in data["nodes"]] == ["keep", "keep"]
    assert data["summary"]["text"] == f"bnswap plan: {summary}"
    assert convert_cli.convert_main([str(done), "-o", str(tmp_path / "again.pt2")]) == 0
    # (convert reports the applied plan: what was done)
    assert capsys.readouterr().out.startswith(
        "bnswap convert: all 2 batch-norm nodes already on bnswap's ops: nothing changed\n"
    )


def test_bnswap_convert_writes_a_program_that_runs_like_the_original(tmp_path, capsys):
    import torch

    path, ep, x = _program_file(tmp_path)
    out_path = tmp_path / "model_bnswap.pt2"
    assert convert_cli.convert_main([str(path), "-o", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 batch-norm nodes swapped" in out and f"wrote {out_path}" in out
    new = torch.export.load(out_path)
    assert {str(n.target) for n in new.graph.nodes if "batch_norm" in str(n.target)} == {
        "aten._batch_norm_with_update.default"
    }
    a, b = ep.module(), new.module()
    for _ in range(2):
        assert torch.equal(a(x), b(x))
    for (k, v), (_, w) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(v, w), k
    # --exclude takes a bare pattern, as bnswap plan's does: that node is left stock
    part = tmp_path / "part.pt2"
    assert convert_cli.convert_main([str(path), "-o", str(part), "--exclude", "*_1"]) == 0
    assert [
        str(n.target) for n in torch.export.load(part).graph.nodes if "batch_norm" in str(n.target)
    ] == ["aten._batch_norm_with_update.default", "aten.batch_norm.default"]


@pytest.mark.parametrize("cmd", ["plan", "convert"])
def test_a_file_that_is_no_program_is_a_one_line_usage_error(capsys, tmp_path, cmd):
    bad = tmp_path / "notes.pt2"
    bad.write_text("not a program")
    if cmd == "plan":
        code, out, err = run(capsys, "--program", str(bad))
    else:
        code = convert_cli.convert_main([str(bad), "-o", str(tmp_path / "o.pt2")])
        out, err = capsys.readouterr()
    assert code == 2 and not out and not (tmp_path / "o.pt2").exists()
    assert err.count("\n") == 1 and err.startswith(
        f"bnswap {cmd}: error: {bad}: not a torch.export program"
    ), err


def test_convert_keeps_its_old_import_path():
    """``bnswap convert`` moved to bnswap.app.convert_cli (issue 47: no module over 800
    lines); ``bnswap.app.plan_cli.convert_main``, and the names both commands share, still
    name the same objects."""
    from bnswap.app import plan_output

    assert plan_cli.convert_main is convert_cli.convert_main
    assert plan_cli.render is plan_output.render
    assert (plan_cli.EXIT_ALL_SWAPPED, plan_cli.EXIT_USAGE, plan_cli.EXIT_SOME_SKIPPED) == (0, 2, 3)
    assert set(plan_cli.__all__) <= set(vars(plan_cli))


def test_convert_into_a_missing_folder_is_a_one_line_usage_error(capsys, tmp_path):
    """Guards (a fresh user's review): -o into a folder that does not exist ended in
    torch.export.save's RuntimeError traceback (exit 1)."""
    import torch
    from torch import nn

    src = tmp_path / "m.pt2"
    torch.export.save(
        torch.export.export(nn.Sequential(nn.BatchNorm2d(3)).eval(), (torch.randn(2, 3, 4, 4),)),
        str(src),
    )
    out = tmp_path / "nothere" / "o.pt2"
    code = convert_cli.convert_main([str(src), "-o", str(out)])
    cap = capsys.readouterr()
    assert (code, cap.out) == (2, "") and not out.parent.exists()
    assert cap.err == f"bnswap convert: error: {out}: no such folder: {out.parent}\n"


def test_convert_refuses_a_missing_folder_before_loading_the_program(capsys, tmp_path, monkeypatch):
    """Guards (issue 33's newcomer): ``bnswap convert m.pt2 -o /missing/dir/out.pt2``
    loaded the whole program before refusing the folder. The program is never read."""
    src = tmp_path / "m.pt2"
    src.write_bytes(b"not read")
    loaded = []
    monkeypatch.setattr(convert_cli, "load_program", lambda path: loaded.append(path))
    out = tmp_path / "nothere" / "o.pt2"
    code = convert_cli.convert_main([str(src), "-o", str(out)])
    cap = capsys.readouterr()
    assert (code, cap.out, loaded) == (2, "", [])
    assert cap.err == f"bnswap convert: error: {out}: no such folder: {out.parent}\n"


def test_convert_to_a_folder_or_an_unwritable_place_is_a_one_line_usage_error(capsys, tmp_path):
    """Guards (a newcomer's report): ``-o`` naming an existing folder, or a place torch's
    zip writer cannot open (``/proc/...``), ended in torch.export.save's RuntimeError
    traceback, exit 1; a folder given as the program said "no such file"."""
    path, _, _ = _program_file(tmp_path)
    folder = tmp_path / "outdir"
    folder.mkdir()
    code = convert_cli.convert_main([str(path), "-o", str(folder)])
    cap = capsys.readouterr()
    assert (code, cap.out, list(folder.iterdir())) == (2, "", [])
    assert cap.err == (
        f"bnswap convert: error: -o/--output {folder} is a folder; give a "
        f"file name, e.g. -o {folder / 'model_bnswap.pt2'}\n"
    )
    for cmd in (
        lambda: run(capsys, "--program", str(folder)),
        lambda: (
            convert_cli.convert_main([str(folder), "-o", str(tmp_path / "o.pt2")]),
            *capsys.readouterr(),
        ),
    ):
        code, out, err = cmd()
        assert (code, out) == (2, "") and err.endswith(
            f"error: {folder}: is a folder, not a program file (.pt2)\n"
        )
    if pathlib.Path("/proc/self").is_dir():  # Linux: a folder no file can be made in
        code = convert_cli.convert_main([str(path), "-o", "/proc/bnswap_o.pt2"])
        cap = capsys.readouterr()
        assert (code, cap.out) == (2, "") and cap.err.startswith(
            "bnswap convert: error: /proc/bnswap_o.pt2: cannot be written ("
        )
        assert len(cap.err.splitlines()) == 1 and "Traceback" not in cap.err


@pytest.mark.parametrize(
    "args, missing",
    [
        (["m.pt2"], "-o/--output (where to write the converted program)"),
        (["-o", "o.pt2"], "the program to convert (a .pt2 file)"),
        (
            [],
            "the program to convert (a .pt2 file) and -o/--output (where to write the "
            "converted program)",
        ),
    ],
)
def test_convert_without_its_arguments_names_them_with_an_example(capsys, args, missing):
    """Guards (a user's try): ``bnswap convert model.pt2`` said "the following arguments
    are required: output", naming no option a user types."""
    code = convert_cli.convert_main(args)
    cap = capsys.readouterr()
    assert (code, cap.out) == (2, "")
    assert cap.err == (
        f"bnswap convert: error: missing {missing}; e.g. bnswap convert "
        "model.pt2 -o model_bnswap.pt2\n"
    )


@pytest.mark.parametrize("spelling", ["same", "dot", "symlink", "hardlink"])
def test_convert_refuses_to_overwrite_its_input(capsys, tmp_path, monkeypatch, spelling):
    """Guards (a user's try): ``bnswap convert m.pt2 -o m.pt2`` (or ``-o ./m.pt2``, or a
    link to it) overwrote the input program. Refused in one line, exit 2, the file
    unchanged byte for byte; a new file next to it is still written."""
    import os

    import torch
    from torch import nn

    monkeypatch.chdir(tmp_path)
    torch.export.save(
        torch.export.export(nn.Sequential(nn.BatchNorm2d(3)).train(), (torch.randn(2, 3, 4, 4),)),
        "m.pt2",
    )
    before = (tmp_path / "m.pt2").read_bytes()
    out = {"same": "m.pt2", "dot": "./sub/../m.pt2", "symlink": "link.pt2", "hardlink": "hard.pt2"}[
        spelling
    ]
    (tmp_path / "sub").mkdir()
    if spelling == "symlink":
        os.symlink(tmp_path / "m.pt2", tmp_path / "link.pt2")
    elif spelling == "hardlink":
        os.link(tmp_path / "m.pt2", tmp_path / "hard.pt2")
    code = convert_cli.convert_main(["m.pt2", "-o", out])
    cap = capsys.readouterr()
    assert (code, cap.out) == (2, "") and (tmp_path / "m.pt2").read_bytes() == before
    assert cap.err == (
        f"bnswap convert: error: -o/--output {out} is the input program "
        "(m.pt2): bnswap convert never overwrites its input; write to "
        "another file, e.g. -o model_bnswap.pt2\n"
    )
    assert convert_cli.convert_main(["m.pt2", "-o", "new.pt2"]) == 0  # another file: written
    assert (tmp_path / "m.pt2").read_bytes() == before
    new = torch.export.load("new.pt2")
    assert any("_batch_norm_with_update" in str(n.target) for n in new.graph.nodes)


def test_plan_for_ort_says_when_onnx_runtime_is_missing(capsys, monkeypatch):
    """Guards (a fresh user's review): --backend ort planned every row onto
    BatchNormInternal with no word that ONNX Runtime training is not installed."""
    import importlib

    ort = importlib.import_module("bnswap.ort")
    monkeypatch.setattr(ort, "is_available", lambda: False)
    code, out, _ = run(capsys, "--model", "tests.plan_models.plain_net", "--backend", "ort")
    assert code == 0 and out.splitlines()[-1] == (
        "note: ONNX Runtime training is not installed here: converting with backend='ort' "
        f"raises ORTNotAvailableError ({ort.INSTALL})"
    )
    monkeypatch.setattr(ort, "is_available", lambda: True)
    code, out, _ = run(capsys, "--model", "tests.plan_models.plain_net", "--backend", "ort")
    assert "note" not in out


def test_a_model_the_backend_would_refuse_exits_3(capsys):
    """Guards: --backend ort of a model with an uninitialized lazy layer said "1 of 1
    swapped" and exited 0, while convert(backend="ort") refuses it."""
    code, out, _ = run(capsys, "--model", "tests.plan_models.lazy_net", "--backend", "ort")
    assert code == plan_cli.EXIT_SOME_SKIPPED
    assert "refuses this model (ONNX Runtime cannot run an uninitialized lazy" in out
    code, out, _ = run(capsys, "--model", "tests.plan_models.lazy_net")
    assert code == plan_cli.EXIT_ALL_SWAPPED and "refuses" not in out


# ------------------------------------------- a newcomer's five rough edges (nc3)
def _caught_warnings(fn):
    """The messages of the warnings ``fn()`` raises (the Python API's own words)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


def test_an_unmatched_pattern_warns_once_with_one_prefix(capsys, tmp_path):
    """Guards (a newcomer's report): ``bnswap convert x.pt2 -o y.pt2 --exclude
    '*features*'`` printed "bnswap convert: warning: bnswap: exclude pattern ..." twice
    (plan warned, then apply planned again). Once, with the command's prefix only; the
    text is the Python API's warning; bnswap plan (--program, --model) says it once too."""
    import torch

    path, ep, _ = _program_file(tmp_path)
    api = _caught_warnings(lambda: bnswap.plan(ep, exclude="*features*"))
    assert len(api) == 1 and api[0].startswith("bnswap: exclude pattern '*features*'")
    line = api[0].removeprefix("bnswap: ")
    out = tmp_path / "y.pt2"
    assert convert_cli.convert_main([str(path), "-o", str(out), "--exclude", "*features*"]) == 0
    cap = capsys.readouterr()
    assert cap.err == f"bnswap convert: warning: {line}\n"
    assert {
        str(n.target) for n in torch.export.load(out).graph.nodes if "batch_norm" in str(n.target)
    } == {"aten._batch_norm_with_update.default"}
    code, _, err = run(capsys, "--program", str(path), "--exclude", "*features*")
    assert (code, err) == (0, f"bnswap plan: warning: {line}\n")
    api = _caught_warnings(lambda: bnswap.plan(plan_models.plain_net(), exclude="*features*"))
    assert len(api) == 1
    code, _, err = run(capsys, "--model", "tests.plan_models.plain_net", "--exclude", "*features*")
    assert (code, err) == (0, f"bnswap plan: warning: {api[0].removeprefix('bnswap: ')}\n")


def test_convert_names_itself_in_its_output(capsys, tmp_path):
    """Guards (a newcomer's report): ``bnswap convert``'s output began "bnswap plan: 3 of
    3 batch-norm nodes swapped", as if the wrong subcommand ran. Its first line names
    bnswap convert, the rest is the plan's table; bnswap plan and the Python API's
    summary keep "bnswap plan"."""
    path, ep, _ = _program_file(tmp_path)
    ref = bnswap.plan(ep)
    assert ref.summary() == "bnswap plan: 2 of 2 batch-norm nodes would be swapped, 0 skipped"
    out_path = tmp_path / "o.pt2"
    assert convert_cli.convert_main([str(path), "-o", str(out_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "bnswap convert: 2 of 2 batch-norm nodes swapped, 0 skipped"
    assert out[1:] == [*str(ref).splitlines()[1:], f"wrote {out_path}", convert_cli.TORCHAO_NOTE]
    assert not any("bnswap plan" in ln for ln in out)
    code, plan_out, _ = run(capsys, "--program", str(path))
    assert code == 0 and plan_out.splitlines() == str(ref).splitlines()


@pytest.mark.parametrize("kind", ["torch.save", "text"])
@pytest.mark.parametrize("cmd", ["plan", "convert"])
def test_a_file_that_is_no_program_points_to_no_warnings(capsys, tmp_path, cmd, kind):
    """Guards (a newcomer's report): a ``torch.save`` file said "... Please check the
    warnings above for possible errors.)" where no warning was shown (torch logs them;
    bnswap silences that log). The sentence goes; the rest of torch's message stays."""
    import torch

    bad = tmp_path / "x.pt2"
    if kind == "torch.save":
        torch.save({"a": 1}, bad)
    else:
        bad.write_text("hello")
    try:
        torch.export.load(bad)
    except Exception as e:  # the reference: torch's own words
        torch_error = e
    capsys.readouterr()  # what torch itself logged for the reference (torch 2.14 does)
    first = str(torch_error).strip().splitlines()[0]
    kept = first.replace("Please check the warnings above for possible errors.", "").strip()
    if cmd == "plan":
        code, out, err = run(capsys, "--program", str(bad))
    else:
        code = convert_cli.convert_main([str(bad), "-o", str(tmp_path / "o.pt2")])
        out, err = capsys.readouterr()
    assert (code, out) == (2, "") and "warnings above" not in err
    assert err == (
        f"bnswap {cmd}: error: {bad}: not a torch.export program "
        f"(torch.export.load: {type(torch_error).__name__}: {kept})\n"
    )


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    """Writes the user's ``mymodels.py`` into tmp_path and runs the front door there
    (it makes the current folder importable); each test gets its own module."""
    import importlib

    def write(source: str) -> None:
        (tmp_path / "mymodels.py").write_text(source)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "path", list(sys.path))  # (the front door adds the cwd)
        sys.modules.pop("mymodels", None)
        importlib.invalidate_caches()

    yield write
    sys.modules.pop("mymodels", None)


def front_door(capsys, *args: str) -> tuple[int, str, str]:
    """``bnswap ARGS`` as the console script runs it (``_bnswap_command.main``)."""
    import _bnswap_command

    with pytest.raises(SystemExit) as e:
        _bnswap_command.main(list(args))
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


USER_MODELS = """
from torch import nn

CALLS = []

def f(width, **kw):
    CALLS.append(width)
    return nn.Sequential(nn.BatchNorm1d(width))

def g(width: int, depth=2):
    CALLS.append(width)
    return nn.Sequential(nn.BatchNorm1d(width))

def two(width, depth, scale=1):
    CALLS.append(width)
    return nn.Sequential(*[nn.BatchNorm1d(width) for _ in range(depth)])

class R(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.bn = nn.BatchNorm1d(width)

class T(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(width)

def make(width):
    return R(width)

def annotated(width) -> nn.Module:
    return nn.Sequential(nn.BatchNorm1d(width))
"""


def _user_module():
    """The user's module, as the front door imported it."""
    return sys.modules["mymodels"]


def test_a_plain_factorys_missing_argument_is_named_before_the_call(capsys, user_models):
    """Guards (a newcomer's report): ``bnswap plan --model mymodels.f`` with ``def
    f(width, **kw)`` and no --model.width called f(width=None), which failed inside torch
    ("empty(): argument 'size' ... not NoneType"). A usage error names the argument and
    the options that give it (the help's spelling too) before f is called; given, it
    plans what the Python API plans; an annotated factory's error is jsonargparse's."""
    user_models(USER_MODELS)
    code, out, err = front_door(capsys, "plan", "--model", "mymodels.f")
    assert (code, out) == (2, "") and _user_module().CALLS == []
    assert err == (
        "bnswap plan: error: model: mymodels.f needs width, which has no "
        "default: give it as --model.width VALUE\n"
    )
    # the help spells the factory's arguments as they are given, under the factory's name
    code, help_text, _ = front_door(capsys, "plan", "--model", "mymodels.f", "--help")
    assert code == 0 and "arguments of mymodels.f (--model.NAME VALUE):" in help_text
    assert "--model.width WIDTH" in help_text and "model_args" not in help_text
    assert "<function" not in help_text and help_text.startswith("usage: bnswap plan ")
    code, out, err = front_door(capsys, "plan", "--model", "mymodels.two", "--model.depth", "2")
    assert (code, out) == (2, "") and _user_module().CALLS == []
    assert err == (
        "bnswap plan: error: model: mymodels.two needs width, which has no "
        "default: give it as --model.width VALUE\n"
    )
    code, _, err = front_door(capsys, "plan", "--model", "mymodels.two")
    assert (
        code == 2
        and "needs width and depth, which have no default: give them as "
        "--model.width VALUE --model.depth VALUE\n"
        in err
    )
    for option in ("--model.width", "--model_args.width"):
        code, out, err = front_door(
            capsys, "plan", "--model", "mymodels.f", option, "3", "--format", "json"
        )
        assert (code, err) == (0, "")
        ref = bnswap.plan(_user_module().f(3)).to_dicts()
        assert (
            [(r["name"], r["action"]) for r in json.loads(out)["layers"]]
            == [(r["name"], r["action"]) for r in ref]
            == [("0", "swap")]
        )
    # an annotated parameter: jsonargparse's own requirement, as before
    code, out, err = front_door(capsys, "plan", "--model", "mymodels.g")
    assert (code, out) == (2, "") and err == (
        "bnswap plan: error: the following arguments are required: model.width\n"
        "(bnswap plan --help lists every option)\n"
    )


def test_a_factory_that_raises_on_its_arguments_is_named_with_the_values(capsys, user_models):
    """Guards (a newcomer's report): ``--model mymodels.f --model.width abc`` (no
    annotation: jsonargparse passes the string) said only the model's own TypeError;
    the error now names the call it came from, with the values as given."""
    user_models(USER_MODELS)
    code, out, err = front_door(capsys, "plan", "--model", "mymodels.f", "--model.width", "abc")
    try:
        _user_module().f("abc")
    except TypeError as e:
        reference = str(e)
    assert (code, out) == (2, "")
    assert err == (
        f"bnswap plan: error: model: mymodels.f(width='abc') raised TypeError: {reference}\n"
    )


def test_a_class_parameter_without_annotation_says_what_to_do(capsys, user_models, tmp_path):
    """Guards (a newcomer's report): ``--model mymodels.R`` with ``__init__(self, width)``
    printed jsonargparse's "With fail_untyped=True, all mandatory parameters must have a
    supported type. ...". One line names the parameter and the class and what to do:
    annotate it, or wrap the class in a function; the advice works. (A config naming such
    a class ended in a traceback, exit 1: the same line, exit 2.)"""
    user_models(USER_MODELS)
    want = (
        "bnswap plan: error: model: parameter 'width' of mymodels.R has no type "
        "annotation, so its value cannot be parsed: annotate it (e.g. width: int), or "
        "wrap the class in a function with no return annotation (def make(width): "
        "return R(width)), which bnswap plan calls with --model.width VALUE\n"
    )
    for args in (
        ["--model", "mymodels.R"],
        ["--model", "mymodels.R", "--model.width", "3"],
        ["--model", '{"class_path": "mymodels.R", "init_args": {"width": 3}}'],
    ):
        code, out, err = front_door(capsys, "plan", *args)
        assert (code, out, err) == (2, "", want), args
    code, out, err = front_door(capsys, "plan", "--model", "mymodels.annotated")
    assert (code, out) == (2, "") and err == (
        "bnswap plan: error: model: parameter 'width' of mymodels.annotated has no type "
        "annotation, so its value cannot be parsed: annotate it (e.g. width: int), or drop "
        "the function's return annotation: bnswap plan then calls it with --model.width "
        "VALUE as given\n"
    )
    ref = [(r.name, r.action) for r in bnswap.plan(_user_module().R(3))]
    for fixed in ("mymodels.T", "mymodels.make"):  # annotated, or wrapped: planned
        code, out, err = front_door(
            capsys, "plan", "--model", fixed, "--model.width", "3", "--format", "json"
        )
        assert (code, err) == (0, "")
        assert [(r["name"], r["action"]) for r in json.loads(out)["layers"]] == ref
    config = tmp_path / "r.yaml"
    config.write_text("model:\n  class_path: mymodels.R\n  init_args:\n    width: 3\n")
    code, out, err = front_door(capsys, "plan", "--config", str(config))
    assert (code, out) == (2, "") and err == (
        f"bnswap plan: error: {config}: model: parameter 'width' of mymodels.R has no type "
        "annotation, so its value cannot be parsed: annotate it (e.g. width: int)\n"
    )


# ------------------------------------------------- issue 26: the command line's rows
ISSUE26_MODELS = """
from torch import nn
from torch.nn import Sequential

CALLS = []

class Net(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width))
        self.head = nn.Sequential(nn.BatchNorm1d(width))

class Checked(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        assert width > 0, f"width must be positive, got {width}"
        self.bn = nn.BatchNorm1d(width)

def factory(width=4):
    CALLS.append(width)
    return Net(width)

def checked(width=4):
    return Checked(width)

def helper() -> int:
    return 3

class NotAModel:
    pass
"""


def test_layers_excluded_on_purpose_exit_0_and_layers_bnswap_cannot_swap_3(
    capsys, user_models, tmp_path
):
    """Guards issue 26 (a new user's report): ``bnswap plan --exclude 'head.*'`` exited 3,
    "some skipped", for layers the user left out on purpose. Exit 0 when every layer
    not swapped was excluded (``--exclude``) or not matched (``--include``); 3 stays
    for a layer bnswap cannot swap and for a backend that refuses the model (ORT runs no
    stock layer, excluded or not). The table is the Python API's, unchanged."""
    user_models(ISSUE26_MODELS)
    proc = run_bnswap(["plan", "--model", "mymodels.Net", "--exclude", "head.*"], cwd=tmp_path)
    ref = bnswap.plan(_import_user_module().Net(), exclude="head.*")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr[-2000:]
    assert proc.stdout == f"{ref}\n" and [r.action for r in ref] == ["swap", "skip"]
    # tests.plan_models.mixed_net: "1" and "6" swappable; "2", "3" bnswap cannot swap
    for args, patterns, code in (
        (["--exclude", '["2", "3"]'], {"exclude": ["2", "3"]}, 0),
        (["--include", '["1", "6"]'], {"include": ["1", "6"]}, 0),
        (["--exclude", "6"], {"exclude": "6"}, 3),
        (
            ["--exclude", '["2", "3"]', "--backend", "ort"],
            {"exclude": ["2", "3"], "backend": "ort"},
            3,
        ),
    ):
        got = front_door(
            capsys, "plan", "--model", "tests.plan_models.mixed_net", "--format", "json", *args
        )
        want = bnswap.plan(plan_models.mixed_net(), **patterns)
        assert got[0] == code, (args, got)
        assert [(r["name"], r["action"], r["reason"]) for r in json.loads(got[1])["layers"]] == [
            (r.name, r.action, None if r.reason == "-" else r.reason) for r in want
        ]
        assert want.refused is (patterns.get("backend") == "ort")


def test_a_program_node_excluded_on_purpose_exits_0_in_plan_and_convert(capsys, tmp_path):
    """Issue 26's exit rule for programs: a node left out by ``--exclude`` /
    ``--include`` (``bnswap plan --program``, ``bnswap convert``) is no reason for 3."""
    path, ep, _ = _program_file(tmp_path)
    for option, value in (("--exclude", "batch_norm_1"), ("--include", "batch_norm")):
        code, out, _ = front_door(capsys, "plan", "--program", str(path), option, value)
        ref = bnswap.plan(ep, **{option[2:]: value})
        assert (code, out) == (0, f"{ref}\n") and len(ref.skipped) == 1
        written = tmp_path / f"{option[2:]}.pt2"
        code, out, _ = front_door(capsys, "convert", str(path), "-o", str(written), option, value)
        assert code == 0 and written.is_file() and "1 skipped" in out.splitlines()[0]


def test_sync_batchnorm_plans_what_the_api_plans_with_the_sync_column(capsys, tmp_path):
    """Guards issue 26: ``bnswap plan --sync_batchnorm`` was an unrecognized argument,
    though ``bnswap.plan(..., sync_batchnorm=True)`` exists. Bare, ``true`` or
    ``=true``: the API's table with its ``sync`` column; ``false``: the plain plan;
    refused in one line where the API refuses (``--backend ort``) or has no such
    conversion (``--program``); ``--config`` takes the config's
    ``trainer.sync_batchnorm`` (what training with BNSwap does) unless given."""
    import warnings

    import yaml

    model = "tests.plan_models.plain_net"
    ref = bnswap.plan(plan_models.plain_net(), sync_batchnorm=True)
    assert "sync" in str(ref).splitlines()[1].split() and ref[0].synchronized
    for args in (["--sync_batchnorm"], ["--sync_batchnorm", "true"], ["--sync_batchnorm=true"]):
        assert front_door(capsys, "plan", "--model", model, *args) == (0, f"{ref}\n", "")
    plain = bnswap.plan(plan_models.plain_net())
    assert front_door(capsys, "plan", "--model", model, "--sync_batchnorm", "false") == (
        0,
        f"{plain}\n",
        "",
    )
    code, out, _ = front_door(
        capsys, "plan", "--model", model, "--sync_batchnorm", "--format", "json"
    )
    assert code == 0 and [r["sync"] for r in json.loads(out)["layers"]] == [ref[0].sync]
    with pytest.raises(TypeError) as api:
        bnswap.plan(plan_models.plain_net(), "ort", sync_batchnorm=True)
    assert front_door(capsys, "plan", "--model", model, "--sync_batchnorm", "--backend", "ort") == (
        2,
        "",
        f"bnswap plan: error: {str(api.value).removeprefix('bnswap: ')}\n",
    )
    path, _, _ = _program_file(tmp_path)
    code, out, err = front_door(capsys, "plan", "--program", str(path), "--sync_batchnorm")
    assert (
        (code, out) == (2, "")
        and err.count("\n") == 1
        and err.startswith(
            "bnswap plan: error: --sync_batchnorm converts a model's BatchNorm layers"
        )
    )
    # a config whose Trainer synchronizes: every layer of its model becomes SyncBatchNorm
    config = yaml.safe_load((ROOT / "configs" / "digits_mobilenetv2.yaml").read_text())
    config["trainer"]["sync_batchnorm"] = True
    synced = tmp_path / "synced.yaml"
    synced.write_text(yaml.safe_dump(config))
    rows = {}
    for name, args in (
        ("shipped", ["--config", "digits_mobilenetv2.yaml"]),
        ("synced", ["--config", str(synced)]),
        ("off", ["--config", str(synced), "--sync_batchnorm", "false"]),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (Lightning's own, building the module)
            code, out, _ = front_door(capsys, "plan", *args, "--format", "json")
        assert code == 0, (name, out)
        rows[name] = json.loads(out)["layers"]
    assert len(rows["synced"]) == 52 and {r["sync"] for r in rows["synced"]} == {ref[0].sync}
    assert rows["off"] == rows["shipped"] and {r["sync"] for r in rows["off"]} == {None}
    assert [r["name"] for r in rows["synced"]] == [r["name"] for r in rows["shipped"]]


def test_a_factory_whose_class_raises_is_one_line_exit_2_as_the_class_is(
    capsys, user_models, tmp_path
):
    """Guards issue 26: ``--model mymodels.factory --model.width -2`` (a function with no
    return annotation that builds a class, which raises torch's RuntimeError on the
    value) ended in about 20 lines of traceback, exit 1, where the class itself gives
    one line, exit 2. Both are one line, exit 2, the factory's naming its call; a class
    that asserts (jsonargparse's "Problem with given class_path", whose reason was cut
    off) says its assertion."""
    user_models(ISSUE26_MODELS)
    proc = run_bnswap(["plan", "--model", "mymodels.factory", "--model.width", "-2"], cwd=tmp_path)
    mine = _import_user_module()
    reasons = {}
    for cls in (mine.Net, mine.Checked):
        with pytest.raises(Exception) as e:
            cls(-2)
        reasons[cls.__name__] = (type(e.value).__name__, str(e.value))
    assert reasons["Checked"] == ("AssertionError", "width must be positive, got -2")
    kind, text = reasons["Net"]
    assert kind == "RuntimeError" and "Traceback" not in proc.stderr
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        2,
        "",
        f"bnswap plan: error: model: mymodels.factory(width=-2) raised {kind}: {text}\n",
    )
    for path, want in (
        ("mymodels.Net", text),
        ("mymodels.Checked", reasons["Checked"][1]),
        (
            "mymodels.checked",
            f"mymodels.checked(width=-2) raised AssertionError: {reasons['Checked'][1]}",
        ),
    ):
        assert front_door(capsys, "plan", "--model", path, "--model.width", "-2") == (
            2,
            "",
            f"bnswap plan: error: model: {want}\n",
        ), path


def test_a_module_given_as_the_model_names_the_models_in_it(capsys, user_models, tmp_path):
    """Guards issue 26: ``--model mymodels`` (a module) said "expected Module or None,
    got 'mymodels'". It says it is a module and names what in it ``--model`` takes (its
    nn.Module classes and functions, not a helper annotated to return an int, a plain
    class, or what it imported: torch's Sequential), each of which plans; a module's
    long list is cut."""
    user_models(ISSUE26_MODELS)
    (tmp_path / "constants.py").write_text("from torch import nn\nWIDTH = 4\n")
    listed = ["mymodels.Net", "mymodels.Checked", "mymodels.factory", "mymodels.checked"]
    assert front_door(capsys, "plan", "--model", "mymodels") == (
        2,
        "",
        "bnswap plan: error: model: mymodels is a module, not a model; give a class or "
        f"function in it: {', '.join(listed)}\n",
    )
    for path in listed:  # the advice works
        assert front_door(capsys, "plan", "--model", path)[0] == 0, path
    code, out, err = front_door(capsys, "plan", "--model", "torch.nn")
    assert (
        (code, out, err.count("\n")) == (2, "", 1)
        and err.startswith(
            "bnswap plan: error: model: torch.nn is a module, not a model; give a class or "
            "function in it: torch.nn."
        )
        and err.endswith(" in all)\n")
    )
    assert front_door(capsys, "plan", "--model", "constants") == (
        2,
        "",
        "bnswap plan: error: model: constants is a module, not a model, and holds no "
        "nn.Module class or function; give a class, or a function that returns a "
        "module: --model constants.NAME\n",
    )


def test_a_device_torch_does_not_know_is_one_line_before_the_model_is_built(capsys, user_models):
    """Guards issue 26: ``--device tpu`` printed torch's list of its 20 device types. One
    line with a few examples (each a device torch reads), before the model is built."""
    import torch

    user_models(ISSUE26_MODELS)
    for device in ("tpu", "gpu"):
        with pytest.raises(RuntimeError, match="Expected one of cpu, cuda"):
            torch.device(device)
        assert front_door(capsys, "plan", "--model", "mymodels.factory", "--device", device) == (
            2,
            "",
            f"bnswap plan: error: device: {device!r} is not a device type torch "
            f"knows (e.g. {plan_cli._DEVICE_EXAMPLES})\n",
        )
    code, out, err = front_door(capsys, "plan", "--model", "mymodels.factory", "--device", "cuda:x")
    assert (code, out) == (2, "") and err == (
        "bnswap plan: error: device: 'cuda:x': Invalid device string: 'cuda:x' (e.g. "
        f"{plan_cli._DEVICE_EXAMPLES})\n"
    )
    assert _user_module().CALLS == []  # refused before the factory ran
    for example in plan_cli._DEVICE_EXAMPLES.split(", "):
        torch.device(example)


def _import_user_module():
    """The user's ``mymodels`` imported here (the front door imports it from the current
    folder; a test that ran the console script in a subprocess has not)."""
    import importlib

    import _bnswap_command

    _bnswap_command.import_from_cwd()
    return importlib.import_module("mymodels")


@pytest.mark.parametrize(
    "given, said",
    [
        (["--model.widht", "4"], "unknown option '--model.widht'; did you mean '--model.width'?"),
        (
            ["--model.init_args.widht=4"],
            "unknown option '--model.init_args.widht'; did you mean '--model.init_args.width'?",
        ),
        (["--model.zzzzz", "4"], "unknown option '--model.zzzzz'"),  # nothing close
    ],
)
def test_a_class_models_mistyped_argument_gets_a_did_you_mean(capsys, user_models, given, said):
    """Issue 46: ``--model mymodels.Net --model.widht 4`` said jsonargparse's "model: Option
    'widht' is not accepted" where a function's typo got "did you mean". The same line for
    a class, from its constructor's parameters, in the form given."""
    user_models(ISSUE26_MODELS)
    code, out, err = front_door(capsys, "plan", "--model", "mymodels.Net", *given)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"bnswap plan: error: {said}",
        "(bnswap plan --help lists every option)",
    ]
    assert front_door(capsys, "plan", "--model", "mymodels.Net", "--model.width", "5")[0] == 0
