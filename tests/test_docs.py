"""Every ``Examples::`` block of the public API runs and prints what it says (doctest).

The public entry points must have one: ``convert``, ``revert``, ``plan``,
``Plan.apply``, ``register``, ``is_swapped``, ``to_stock_ops``, ``BNSwap`` and
``bnswap.ort.wrap``.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

MODULES = [
    "bnswap._swap",
    "bnswap.functional",
    "bnswap.layers",
    "bnswap.registry",
    "bnswap.kernels",
    "bnswap._patterns",
    "bnswap.plan",
    "bnswap.convert",
    "bnswap._graph",
    "bnswap.programs",
    "bnswap.ort.errors",
    "bnswap.sync",
    "bnswap.app.messages",
    "bnswap._log",
    "_bnswap_command",
]

REQUIRED = {
    "bnswap.convert": ["convert", "plan", "revert"],
    "bnswap.plan": ["Plan.apply"],
    "bnswap._patterns": ["check_patterns"],
    "bnswap.registry": ["register"],
    "bnswap._swap": ["is_swapped"],
    "bnswap._graph": ["to_stock_ops"],
    "bnswap.programs": ["convert", "plan", "NodeRow", "ProgramPlan", "to_stock_ops"],
    "bnswap.lightning": ["BNSwap"],
    "bnswap.ort": ["wrap"],
}


def _run(module_name: str) -> dict[str, int]:
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    attempted: dict[str, int] = {}
    for test in finder.find(module, module_name):
        if not test.examples:
            continue
        result = runner.run(test, out=lambda s: None)
        assert result.failed == 0, (
            f"{test.name}: a doctest example failed; run python -m "
            f"doctest -v on {module.__file__} to see it"
        )
        attempted[test.name.removeprefix(module_name + ".")] = result.attempted
    for name in REQUIRED.get(module_name, []):
        assert attempted.get(name, 0) > 0, f"{module_name}.{name} has no Examples:: doctest"
    return attempted


@pytest.mark.parametrize("module_name", MODULES)
def test_examples_run(module_name):
    assert _run(module_name)


def test_lightning_examples_run():
    pytest.importorskip("lightning.pytorch")
    assert _run("bnswap.lightning")
    assert _run("bnswap.app.cli")


def test_ort_examples_run():
    ort = importlib.import_module("bnswap.ort")
    if not ort.is_available():
        pytest.skip("onnxruntime-training is not installed here (the main .venv has it)")
    assert _run("bnswap.ort")


def test_timm_adapter_examples_run():
    pytest.importorskip("timm")
    assert _run("bnswap.adapters.timm")
