"""The README's and the guides' code runs as written (issue 21, item 2; issue 33).

* Every ``bnswap plan`` and ``bnswap --help`` line of the ``bash`` blocks of README.md
  and docs/*.md, from a folder holding the user's own ``mymodels.py`` (the README's
  example). Lines naming torchvision or timm run where those are installed
  (``.venv-zoo``). The exit status is the value checked: 0 means every BatchNorm layer of
  that model is swapped, or left out by the line's ``--include`` / ``--exclude`` (3 if
  one is skipped that bnswap cannot swap, 2 on a usage error).
* The README's two quick starts (its ``python`` blocks): the PyTorch one prints the plan
  the README shows under it; the Lightning one trains like the same script without
  ``BNSwap()`` (stock), and its layer ends swapped.
* The README stays a landing page: at most about 200 lines, the two commands in its
  first screen."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bnswap

ROOT = Path(__file__).resolve().parents[1]

MYMODELS = """
from torch import nn

def net(width=8):
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.ReLU())
"""


def _texts() -> str:
    return "\n".join(
        p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    )


def readme_lines() -> list[str]:
    text = _texts()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            cmd = line.split("  #", 1)[0].strip()
            cmd = re.sub(r"^(\.venv(-zoo)?/bin/)", "", cmd)
            if cmd.startswith(("bnswap plan", "bnswap --help")):
                lines.append(cmd)
    return lines


def test_the_readme_has_plan_lines():
    lines = readme_lines()
    assert len(lines) >= 5 and any("mymodels" in ln for ln in lines), lines


@pytest.mark.parametrize("line", readme_lines())
def test_readme_line_runs_as_written(line, tmp_path):
    for pkg in ("torchvision", "timm"):
        if pkg in line and importlib.util.find_spec(pkg) is None:
            pytest.skip(f"{pkg} is not installed here (.venv-zoo has it)")
    if "digits_mobilenetv2" in line and importlib.util.find_spec("lightning") is None:
        pytest.skip("the main job's config needs Lightning")
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    exe = shutil.which("bnswap", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "_bnswap_command"]
    p = subprocess.run(
        [*cmd, *shlex.split(line)[1:]], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr[-2000:]
    first = p.stdout.lstrip("*").splitlines()[0]
    if "--help" in line:
        assert first.startswith("usage: bnswap")
    elif "--exclude" in line or "--include" in line:  # exit 0: skipped only on purpose
        n = re.match(
            r"bnswap plan: (\d+) of (\d+) BatchNorm layers would be swapped, "
            r"(\d+) skipped",
            first,
        )
        assert n and int(n.group(1)) + int(n.group(3)) == int(n.group(2)), first
        skipped = [ln for ln in p.stdout.splitlines()[3:] if ln.split()[2:3] == ["skip"]]
        assert len(skipped) == int(n.group(3)) > 0 and all(
            "excluded by" in ln or "not matched by include" in ln for ln in skipped
        ), skipped
    else:
        n = re.match(
            r"bnswap plan: (\d+) of (\d+) BatchNorm layers would be swapped, "
            r"0 skipped",
            first,
        )
        assert n and n.group(1) == n.group(2) and int(n.group(1)) > 0, first


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 230, len(lines)  # ~200, with room for one more section
    first_screen = "\n".join(lines[:32])  # issue 33: the two commands in the first screen
    assert "make demo" in first_screen and "make test" in first_screen
    # the benefit is torch's selection rule, not a GPU measurement (issue 33); the site is
    # viewed served (file:// search shows no snippets)
    assert "torch._C._select_batch_norm_backend" in first_screen
    assert "not yet observed on a GPU" in first_screen
    # issue 46: who it is for, where it changes nothing, what it costs, what is tested
    for words in ("**Use it**", "**It changes nothing else:**", "**It costs**", "**Tested**"):
        assert words in first_screen, words
    assert "python -m http.server -d build/docs/html" in text
    assert "torch.compile(lit_module)" not in text.replace("not `torch.compile(lit_module)`", "")
    assert "configure_model" in text


def test_readme_pytorch_quick_start_prints_the_plan_it_shows(capsys):
    block = _python_blocks()[0]
    assert "bnswap.convert(model)" in block
    scope: dict = {}
    exec(compile(block, "README.md (Quick start: PyTorch)", "exec"), scope)
    printed = capsys.readouterr().out.strip()
    text = (ROOT / "README.md").read_text()
    shown = re.search(r"```python\n.*?```\n\n```text\n(.*?)```", text, flags=re.S).group(1).strip()
    assert printed == shown
    model = scope["model"]  # reverted: stock again, the same as a fresh stock copy
    assert not bnswap.is_swapped(model[1]) and type(model[1]) is torch.nn.BatchNorm2d
    # the sentence under it quotes what the same plan says once applied (issue 33)
    p = bnswap.plan(model)
    p.apply()
    assert f"`{p.summary()}`" in text.replace("\n", " ")
    bnswap.revert(model)


def _run_lightning_block(block: str) -> dict:
    scope: dict = {}
    exec(compile(block, "README.md (Quick start: Lightning)", "exec"), scope)
    return scope


def test_readme_lightning_quick_start_trains_like_stock(caplog):
    """The block as written, and the same block without ``BNSwap()`` (stock BatchNorm,
    compiled the same way): the same weights and running statistics after the epoch
    (float32 rounding: the compiled graphs differ in their batch-norm ops only)."""
    pytest.importorskip("lightning.pytorch")
    block = _python_blocks()[1]
    assert "callbacks=[BNSwap()]" in block and "configure_model" in block
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO):
        ours = _run_lightning_block(block)
    line = "BNSwap (fit): 1 of 1 BatchNorm layers swapped, 0 skipped"  # (rank_zero_info)
    assert f"(`{line}`)" in (ROOT / "README.md").read_text().replace("\n", " ")
    assert [r.getMessage() for r in caplog.records].count(line) == 1, caplog.text[-2000:]
    torch._dynamo.reset()
    stock = _run_lightning_block(block.replace("callbacks=[BNSwap()]", "callbacks=[]"))
    trained = ours["trainer"].lightning_module.net._orig_mod
    ref = stock["trainer"].lightning_module.net._orig_mod
    assert bnswap.is_swapped(trained[1]) and not bnswap.is_swapped(ref[1])
    assert int(trained[1].num_batches_tracked) == 4  # 64 samples, batches of 16
    for (k, a), (_, b) in zip(trained.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
    assert not torch.equal(trained[1].running_mean, torch.zeros(8))  # it did train


def test_every_page_quotes_converts_stderr_line_as_it_is_printed():
    """Where nothing configures logging, ``bnswap.convert`` prints one line to stderr; each
    quote of it in README.md and docs/*.md (inline code or a line of a code block) reads as
    a fresh interpreter prints it, the layer counts aside."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = "import torch, bnswap; bnswap.convert(torch.nn.Sequential(torch.nn.BatchNorm2d(2)))"
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert p.returncode == 0 and p.stdout == "", p.stderr[-2000:]
    (line,) = p.stderr.splitlines()
    assert line.startswith("bnswap.convert: 1 of 1 BatchNorm layers swapped, 0 skipped"), line
    text = _texts()
    quotes = [
        " ".join(q.split()) for q in re.findall(r"`(bnswap\.convert: [^`]*swapped[^`]*)`", text)
    ]
    quotes += re.findall(r"^\s*(bnswap\.convert: .*swapped.*)$", text, flags=re.M)
    assert len(quotes) >= 4, quotes  # README, convert, recipes, training-scripts
    assert [q for q in quotes if re.sub(r"\d+", "N", q) != re.sub(r"\d+", "N", line)] == []


def test_kernel_guide_plan_prints_what_it_shows(capsys):
    """docs/kernels.md's example: ``bnswap.plan(model, device="cuda")`` prints the table
    the guide shows under it (predicted on a machine without CUDA)."""
    if torch.cuda.is_available():
        pytest.skip("the guide shows the prediction made without a CUDA device")
    text = (ROOT / "docs" / "kernels.md").read_text()
    block, shown = re.search(r"```python\n(.*?)```\n\n```text\n(.*?)```", text, re.S).groups()
    exec(compile(block, "docs/kernels.md", "exec"), {})
    assert capsys.readouterr().out.strip() == shown.strip()
