"""A user's ``mypy --strict`` sees bnswap's types from this environment (issue 46, item 5).

``python tests/user_types.py`` (``make lint`` runs it with ``.venv``'s Python, the
environment the README builds) writes a small user script into a temporary folder outside
the checkout, so that bnswap can only be found where this Python finds it installed, and
runs this environment's mypy on it in strict mode, with no ``PYTHONPATH`` / ``MYPYPATH``.
It then checks what mypy reveals of bnswap's results: the model's own type from
``convert`` and ``revert``, bnswap's ``Plan``, ``bnswap.BatchNorm2d`` as the stock class
it builds, Lightning's callback class; none may be ``Any``, and the script
must pass strict mode as a user writes it.

An editable install in setuptools' default mode puts bnswap on ``sys.path`` through an
import hook, which mypy does not run: every name of bnswap was ``Any`` and ``import
bnswap`` an error. The Makefile installs it in the strict mode (a tree of links on a
plain ``.pth`` path), which mypy follows; a regular install works as well.

mypy keeps its cache in ``build/mypy-user`` (the first run analyses torch and Lightning:
about a minute on 2 cores; later runs take seconds). Exits 1, saying what differed,
when a check fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn

    import bnswap


    def build() -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())


    model = bnswap.convert(build(), exclude=["0"])
    reveal_type(model)
    plan = bnswap.plan(model)
    reveal_type(plan)
    swapped: list[bool] = [bnswap.is_swapped(m) for m in model.modules()]
    back = bnswap.revert(model)
    reveal_type(back)
    layer = bnswap.BatchNorm2d(8)
    reveal_type(layer)
    stock: nn.BatchNorm2d = layer
    callback = bnswap.BNSwap(exclude="head.*")
    reveal_type(callback)
    y: torch.Tensor = back(torch.randn(2, 3, 5, 5))
""")

#: What mypy must reveal, in the script's order.
EXPECTED = [
    "torch.nn.modules.container.Sequential",
    "bnswap.plan.Plan",
    "torch.nn.modules.container.Sequential",
    "bnswap.layers.BatchNorm2d",  # (for checkers a subclass of nn.BatchNorm2d: what it builds)
    "bnswap.lightning.BNSwap",
]


def check(python: str = sys.executable) -> list[str]:
    """The problems found (empty: the user's strict check sees bnswap's types)."""
    cache = ROOT / "build" / "mypy-user"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "user.py").write_text(USER_SCRIPT)
        proc = subprocess.run(
            [python, "-m", "mypy", "--strict", "--cache-dir", str(cache), "user.py"],
            capture_output=True,
            text=True,
            cwd=tmp,
            env=env,
            timeout=900,
        )
    out = proc.stdout + proc.stderr
    revealed = re.findall(r'Revealed type is "([^"]+)"', out)
    problems = []
    if revealed != EXPECTED:
        problems.append(f"mypy revealed {revealed}, expected {EXPECTED}")
    if any("Any" in r for r in revealed):
        problems.append("bnswap's names are Any: mypy does not see bnswap's types here")
    errors = [line for line in out.splitlines() if ": error:" in line]
    if errors or proc.returncode != 0:
        problems.append("mypy --strict of the user's script failed:\n" + "\n".join(errors or [out]))
    return problems


def main() -> int:
    problems = check()
    if not problems:
        print("user_types: a user's mypy --strict sees bnswap's types from this environment")
        return 0
    print(
        "user_types: a user's mypy --strict in this environment ("
        f"{sys.executable}) does not see bnswap's types:\n- "
        + "\n- ".join(problems)
        + "\nInstall bnswap as the Makefile does (pip install -e . --config-settings "
        "editable_mode=strict) or not editable; the default editable mode's import hook "
        "is invisible to mypy.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
