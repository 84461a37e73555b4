"""The README's command lines run as written (issue 21, item 2): every ``bnswap plan`` and
``bnswap --help`` line of its ``bash`` blocks, from a folder holding the user's own
``mymodels.py`` (the README's example). Lines naming torchvision or timm run where those
are installed (``.venv-zoo``). The exit status is the value checked: 0 means every
BatchNorm layer of that model is swapped, or left out by the line's ``--include`` /
``--exclude`` (3 if one is skipped that bnswap cannot swap, 2 on a usage error)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MYMODELS = """
from torch import nn

def net(width=8):
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.ReLU())
"""


def readme_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
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
    p = subprocess.run([*cmd, *shlex.split(line)[1:]], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    first = p.stdout.lstrip("*").splitlines()[0]
    if "--help" in line:
        assert first.startswith("usage: bnswap")
    elif "--exclude" in line or "--include" in line:  # exit 0: skipped only on purpose
        n = re.match(r"bnswap plan: (\d+) of (\d+) BatchNorm layers swapped, (\d+) skipped",
                     first)
        assert n and int(n.group(1)) + int(n.group(3)) == int(n.group(2)), first
        skipped = [ln for ln in p.stdout.splitlines()[3:] if ln.split()[2:3] == ["skip"]]
        assert len(skipped) == int(n.group(3)) > 0 and all(
            "excluded by" in ln or "not matched by include" in ln for ln in skipped), skipped
    else:
        n = re.match(r"bnswap plan: (\d+) of (\d+) BatchNorm layers swapped, 0 skipped", first)
        assert n and n.group(1) == n.group(2) and int(n.group(1)) > 0, first
