"""A stranger's install (issue 21, item 1; issue 33, item 4): bnswap's sdist and wheel,
built from this checkout by ``python -m build`` (the wheel from the sdist, so the sdist
is complete) and checked by ``twine check --strict``, the wheel's contents and metadata
asserted, then the wheel (not the checkout) in a fresh virtual environment with torch
alone (no extras, no Lightning), used from a project folder holding the user's own
``mymodels.py``: ``bnswap --version``, ``bnswap plan --model``, a convert and a training
step against stock.

torch comes into the fresh venv by links to this environment's (the same release and
build, pinned by a constraints file when the wheel is installed): measured on 2 cores,
the fixture takes about 15 s that way, where ``--system-site-packages`` would expose every
package of this environment (Lightning included, so the missing-extra checks could not
run) and ``pip install torch==2.13.0`` copies 1 GB.

Slow and run once: only where torch is a CPU build (the main environment), not again in
the zoo's CUDA build of 6 GB."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests._helpers import imported_modules

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        torch.version.cuda is not None,
        reason="runs once, in the environment with torch's CPU build",
    ),
]

MYMODELS = textwrap.dedent("""
    from torch import nn

    def net(width=8):
        return nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.ReLU())

    class Net(nn.Module):
        def __init__(self, width: int = 4):
            super().__init__()
            self.bn = nn.BatchNorm1d(width)
""")


def _clean_env() -> dict[str, str]:
    """This process's environment without what points at this checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _pip(py: Path, *args: str) -> None:
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
        env=_clean_env(),
    )


def _torch_alone(site: Path) -> None:
    """Make this environment's torch, and what it requires, importable in ``site`` (a fresh
    venv's site-packages) by links, as ``pip install torch`` would have installed them:
    the same release and build in seconds, with no 1 GB copy (a nearly full disk failed
    the copy in CI) and no download. Nothing else of this environment is visible there."""
    todo, seen = ["torch"], set()
    while todo:
        dist = distribution(todo.pop())
        name = canonicalize_name(dist.metadata["Name"])
        if name in seen:
            continue
        seen.add(name)
        todo += [
            r.name
            for r in map(Requirement, dist.requires or [])
            if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
        for top in {f.parts[0] for f in dist.files or []}:
            target = Path(dist.locate_file(top))
            if top in ("..", "__pycache__") or top.endswith(".pth") or (site / top).exists():
                continue  # scripts, caches, .pth hooks; the venv's own pip / setuptools
            (site / top).symlink_to(target, target_is_directory=target.is_dir())


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("install")
    wheels = tmp / "dist"
    # --no-isolation: the build backend (setuptools) of this environment, no download
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("bnswap-*.whl")
    env = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    py = env / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    _torch_alone(Path(site))
    (tmp / "constraints.txt").write_text(f"torch=={torch.__version__}\n")
    _pip(py, "-c", str(tmp / "constraints.txt"), str(wheel))
    return env, wheel


def _run(env: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=300, cwd=cwd, env=_clean_env()
    )


def test_wheel_with_torch_alone(venv, tmp_path):
    venv, wheel = venv
    # bnswap is not on PyPI: a missing extra names the wheel it was installed from (issue
    # 26: "pip install 'bnswap[lightning]'" could not work)
    hint = f"pip install '{wheel}[lightning]' (bnswap's 'lightning' extra)"
    proj = tmp_path / "project"
    proj.mkdir()
    (proj / "mymodels.py").write_text(MYMODELS)
    py, exe = str(venv / "bin" / "python"), str(venv / "bin" / "bnswap")
    # the installed package, not this checkout
    r = _run(venv, py, "-c", "import bnswap, lightning", cwd=proj)
    assert "No module named 'lightning'" in r.stderr
    r = _run(
        venv,
        py,
        "-c",
        textwrap.dedent("""
        import copy, torch, bnswap
        from torch import nn
        print(bnswap.__file__)
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        ref = copy.deepcopy(m)
        p = bnswap.plan(m)
        bnswap.convert(m)
        x = torch.randn(4, 3, 6, 6)
        assert torch.equal(m(x), ref(x)), "output differs from stock"
        assert torch.equal(m[1].running_var, ref[1].running_var)
        bnswap.revert(m)
        print(p.summary(), bnswap.is_swapped(m[1]))
    """),
        cwd=proj,
    )
    assert r.returncode == 0, r.stderr
    file, summary = r.stdout.splitlines()
    assert str(venv) in file
    assert summary == "bnswap plan: 1 of 1 BatchNorm layers would be swapped, 0 skipped False"

    r = _run(venv, py, "-X", "importtime", exe, "--help", cwd=proj)
    assert r.returncode == 0 and "plan" in r.stdout and "bnswap's 'lightning' extra" in r.stdout
    imported = imported_modules(r.stderr)
    assert "_bnswap_command" in imported and not {"torch", "bnswap"} & imported  # 0.03 s
    r = _run(venv, exe, "plan", "--model", "mymodels.net", "--model.width", "5", cwd=proj)
    assert r.returncode == 0, r.stderr
    # torch warns "Failed to initialize NumPy" where NumPy is absent: not on bnswap's runs
    assert (
        "NumPy" not in r.stderr and "NumPy" in _run(venv, py, "-c", "import torch", cwd=proj).stderr
    )
    assert r.stdout.splitlines()[0] == (
        "bnswap plan: 1 of 1 BatchNorm layers would be swapped, 0 skipped"
    )
    r = _run(venv, exe, "plan", "--model", "mymodels.Net", "--format", "json", cwd=proj)
    assert r.returncode == 0 and '"class": "BatchNorm1d"' in r.stdout, r.stderr
    for sub in ("train", "compare"):
        r = _run(venv, exe, sub, "--config", "digits_mobilenetv2.yaml", cwd=proj)
        assert (r.returncode, r.stdout) == (2, "")
        assert r.stderr.splitlines()[-1] == (
            f"bnswap {sub}: error: needs Lightning, which is not installed: {hint}"
        )
        assert "Traceback" not in r.stderr
    r = _run(venv, exe, "plan", "--config", "digits_mobilenetv2.yaml", cwd=proj)
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        f"bnswap plan: error: digits_mobilenetv2.yaml needs lightning, which is not "
        f"installed: {hint}"
    )
    r = _run(venv, py, "-c", "from bnswap import BNSwap", cwd=proj)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        f"ModuleNotFoundError: bnswap.BNSwap needs Lightning, which is not installed: {hint}"
    )
    # the wheel gone: the extra by name and the README's Install section
    moved = wheel.with_suffix(".moved")
    wheel.rename(moved)
    try:
        r = _run(venv, py, "-c", "from bnswap import BNSwap", cwd=proj)
    finally:
        moved.rename(wheel)
    assert r.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: bnswap.BNSwap needs Lightning, which is not installed: bnswap's "
        "'lightning' extra: pip install '.[lightning]' in a checkout of bnswap (README, "
        "Install; bnswap is not on PyPI)"
    )


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_sdist_and_wheel_pass_twine_and_hold_what_they_should(venv):
    _, wheel = venv
    (sdist,) = wheel.parent.glob("bnswap-*.tar.gz")
    r = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.count("PASSED") == 2, r.stdout + r.stderr
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    version = _pyproject()["version"]
    assert wheel.name == f"bnswap-{version}-py3-none-any.whl"
    install = (ROOT / "docs" / "install.md").read_text()  # the Install page, as it says
    assert f"pip install -c constraints.txt dist/{wheel.name}" in install
    assert "bnswap/py.typed" in names and "_bnswap_command.py" in names
    configs = {n for n in names if n.startswith("bnswap/app/configs/") and n.endswith(".yaml")}
    assert (
        configs
        == {
            f"bnswap/app/configs/{p.name}"
            for p in (ROOT / "bnswap" / "app" / "configs").glob("*.yaml")
        }
        != set()
    )
    assert f"bnswap-{version}.dist-info/licenses/LICENSE" in names
    assert not [
        n
        for n in names
        if n.split("/")[0] in ("tests", "benchmarks", "docs", "examples")
        or n.startswith("bnswap/tests")
    ], names
    fields = [line.split(": ", 1) for line in meta.split("\n\n", 1)[0].splitlines() if ": " in line]
    assert ["Version", version] in fields and ["License-Expression", "Apache-2.0"] in fields
    assert ["Requires-Python", ">=3.10"] in fields
    assert ["Description-Content-Type", "text/markdown"] in fields
    assert any(k == "Requires-Dist" and v.startswith("torch>=2.4.1") for k, v in fields)
    classifiers = {v for k, v in fields if k == "Classifier"}
    assert {"Programming Language :: Python :: 3.11", "Typing :: Typed"} <= classifiers
    assert meta.split("\n\n", 1)[1].startswith("# bnswap")  # the README, as the description
    # the sdist (MANIFEST.in): what a packager reads, and no tests/ or benchmarks/
    # (setuptools' default adds tests/test_*.py without the helpers they import)
    with tarfile.open(sdist) as t:
        files = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml"} <= files, sorted(files)
    assert not [n for n in files if n.split("/")[0] in ("tests", "benchmarks")], sorted(files)


def test_one_version_source(venv):
    """pyproject.toml's version is the one source: the installed metadata,
    ``bnswap.__version__`` and ``bnswap --version`` all say it."""
    env, _ = venv
    version = _pyproject()["version"]
    r = _run(env, str(env / "bin" / "bnswap"), "--version", cwd=env)
    assert (r.returncode, r.stdout.strip()) == (0, f"bnswap {version}"), r.stderr
    r = _run(
        env, str(env / "bin" / "python"), "-c", "import bnswap; print(bnswap.__version__)", cwd=env
    )
    assert r.stdout.strip() == version, r.stderr
    assert "__version__ = " not in (ROOT / "bnswap" / "__init__.py").read_text().replace(
        "__version__ = _version()", ""
    )


def test_a_training_step_from_the_wheel_is_stock_s(venv, tmp_path):
    """One SGD step of a converted model, in the fresh venv, against stock on an identical
    copy: the same loss, weights and running statistics, bit for bit (the CPU kernels)."""
    env, _ = venv
    r = _run(
        env,
        str(env / "bin" / "python"),
        "-c",
        textwrap.dedent("""
        import copy, torch, bnswap
        from torch import nn
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                            nn.Linear(4 * 4 * 4, 3))
        m = bnswap.convert(copy.deepcopy(ref))
        x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 3, (8,))
        for net in (m, ref):
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            print(loss.item())
        assert bnswap.is_swapped(m[1]) and not bnswap.is_swapped(ref[1])
        for (k, a), (_, b) in zip(m.state_dict().items(), ref.state_dict().items()):
            assert torch.equal(a, b), k
        print("same")
    """),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    first, second, same = r.stdout.split()
    assert first == second and same == "same"
