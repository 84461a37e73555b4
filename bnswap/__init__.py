"""bnswap: swap ``nn.BatchNorm`` layers for layers on PyTorch's consolidated batch-norm
ops in training (``aten._batch_norm_with_update`` / ``batch_norm_backward``, pytorch PR
116092; stock's ``aten.batch_norm`` in evaluation) or on ONNX Runtime's
``com.microsoft::BatchNormInternal``.

``import bnswap`` imports neither Lightning nor ONNX Runtime: ``bnswap.BNSwap`` (the
Lightning callback) and ``bnswap.ort`` load on first use.
"""

from __future__ import annotations

import importlib
import importlib.metadata as _metadata
import types
from typing import TYPE_CHECKING, Any

from bnswap import _compat  # noqa: F401  (registers its patches for the first swap)
from bnswap._patterns import check_patterns
from bnswap._swap import is_swapped
from bnswap.convert import convert, plan, revert
from bnswap.functional import module_batch_norm
from bnswap.layers import BatchNorm1d, BatchNorm2d, BatchNorm3d
from bnswap.plan import Plan, PlanRow
from bnswap.programs import ProgramPlan, to_stock_ops
from bnswap.registry import register, safe_globals, unregister

if TYPE_CHECKING:  # imported on first use (it imports Lightning): typed for checkers
    from bnswap.lightning import BNSwap as BNSwap


def _version() -> str:
    """The installed distribution's version: pyproject.toml's, the one version source."""
    try:
        return _metadata.version("bnswap")
    except _metadata.PackageNotFoundError:  # a checkout on sys.path, never installed
        return "0+unknown"


__version__ = _version()

__all__ = [
    "BNSwap",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Plan",
    "PlanRow",
    "ProgramPlan",
    "check_patterns",
    "convert",
    "is_swapped",
    "module_batch_norm",
    "plan",
    "register",
    "revert",
    "safe_globals",
    "to_stock_ops",
    "unregister",
]

# bnswap._compat registered its patches to apply when the first layer is swapped:
# `import bnswap` itself changes nothing in torch or any other library (docs/patches.md).


def __dir__() -> list[str]:
    """The public names and submodules (``dir(bnswap)``, tab completion), without what
    this file imports for itself."""
    modules = [
        n
        for n, v in globals().items()
        if isinstance(v, types.ModuleType)
        and not n.startswith("_")
        and v.__name__.startswith("bnswap.")
    ]
    return sorted({*__all__, "__version__", "ort", *modules})


def __getattr__(name: str) -> Any:
    if name == "BNSwap":
        return importlib.import_module("bnswap.lightning").BNSwap
    if name == "ort":
        return importlib.import_module("bnswap.ort")
    raise AttributeError(f"module 'bnswap' has no attribute {name!r}")
