"""The Makefile's environments (issue 46, items 5 and 7): what ``make lint``, ``make docs``
and ``make demo`` install from a clean checkout (each only its own tools; ``make test``
still lints first), the strict editable install a user's type checker follows, and the
links made again exactly when the package's files change. GNU make's own dry run
(``make -n``) for the first, a real run with a stand-in Python (which records its
arguments) in a copy of the Makefile for the last. Needs ``make``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

STRICT = "--config-settings editable_mode=strict"


def _dry_run(target: str, tmp_path: Path) -> list[str]:
    """The commands ``make TARGET`` runs from a clean checkout (its venv not there yet)."""
    # (under `make test` the suite runs inside make: a nested make would print its
    # directory, and inherit the outer one's flags)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(
        [
            "make",
            "-n",
            "--no-print-directory",
            f"VENV={tmp_path / 'venv'}",
            f"ZOO={tmp_path / 'zoo'}",
            target,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _installs(lines: list[str]) -> list[str]:
    return [line for line in lines if "pip install" in line and "--upgrade pip" not in line]


def _editable(installs: list[str]) -> list[str]:
    """What each editable install installs, with its options."""
    return [i.split(" -e ", 1)[1] for i in installs if " -e " in i]


def test_lint_installs_the_demo_then_its_own_tools_only(tmp_path):
    lines = _dry_run("lint", tmp_path)
    installs = _installs(lines)
    assert installs[0].endswith("torch==2.13.0+cpu 2>/dev/null || \\")  # torch first
    assert _editable(installs) == [
        f"'.[lightning]' {STRICT}",
        f"'.[lightning,onnx,lint]' {STRICT}",
        f". {STRICT}",
    ]
    text = "\n".join(lines)
    for other in ("transformers", "bnswap.ort build", ",dev", "docs]", "torch-ort", "sphinx"):
        assert other not in text, other
    checks = lines[-4:]
    assert [c.split("/bin/")[-1] for c in checks] == [
        "ruff check .",
        "ruff format --check .",
        "mypy bnswap",
        "python tests/user_types.py",
    ]


def test_docs_installs_the_demo_then_its_own_tools_only(tmp_path):
    lines = _dry_run("docs", tmp_path)
    installs = _installs(lines)
    assert any(i.endswith(f"-e '.[lightning,docs]' {STRICT}") for i in installs)
    text = "\n".join(lines)
    for other in ("transformers", "bnswap.ort build", "lint]", ",dev", "torch-ort", "ruff"):
        assert other not in text, other
    assert lines[-2].endswith("-m sphinx -b html -n -W --keep-going -q docs build/docs/html")
    assert lines[-1].endswith("-m pytest -q -p no:cacheprovider tests/test_docs.py")


def test_demo_installs_the_lightning_extra_only_and_test_lints_first(tmp_path):
    demo = _dry_run("demo", tmp_path)
    assert _editable(_installs(demo)) == [
        f"'.[lightning]' {STRICT}",
        f". {STRICT}",
    ]
    assert demo[-1].endswith("bnswap train --config configs/digits_mobilenetv2.yaml")
    test = _dry_run("test", tmp_path)
    ruff = next(i for i, line in enumerate(test) if line.endswith("ruff check ."))
    suite = [i for i, line in enumerate(test) if "-m pytest -q -rs" in line]
    assert len(suite) == 2 and ruff < suite[0]  # lint, then both suites
    assert any("bnswap.ort build" in line for line in test[ruff : suite[0]])


def test_links_are_made_again_when_the_package_s_files_change(tmp_path):
    """``$(VENV)/.linked`` reinstalls (the stand-in Python records it) on its first run,
    not again while the package's files stay the same (edits need nothing: the links show
    them), and again when a file is added or removed or the link tree is gone."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    pkg = tmp_path / "bnswap"
    (pkg / "app" / "configs").mkdir(parents=True)
    for f in ("__init__.py", "py.typed", "app/__init__.py", "app/configs/a.yaml"):
        (pkg / f).write_text("")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    calls = tmp_path / "calls"
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    python.chmod(0o755)
    (venv / ".demo-installed").touch()  # newer than the Makefile: the venv is set up

    def relinks() -> int:
        before = calls.read_text().count("\n") if calls.exists() else 0
        proc = subprocess.run(
            ["make", "VENV=venv", "venv/.linked"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return calls.read_text().count("\n") - before

    assert relinks() == 1
    assert calls.read_text().strip().endswith(f"--no-deps -e . {STRICT}")
    assert relinks() == 0
    (pkg / "__init__.py").write_text("x = 1\n")  # an edit: the links show it
    assert relinks() == 0
    (pkg / "new.py").write_text("")
    assert relinks() == 1
    assert relinks() == 0
    (pkg / "new.py").unlink()
    assert relinks() == 1
    tree = tmp_path / "build" / "__editable__.bnswap-0.1.0-py3-none-any"
    tree.mkdir(parents=True)  # as pip's install makes it
    assert relinks() == 1
    assert relinks() == 0
    shutil.rmtree(tmp_path / "build")  # `rm -rf build`: the links are gone
    assert relinks() == 1
    assert os.path.exists(venv / ".package-files")
