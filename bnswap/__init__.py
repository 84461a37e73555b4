"""bnswap: swap ``nn.BatchNorm`` layers for layers on PyTorch's consolidated batch-norm
ops (``aten._batch_norm_with_update`` / ``_batch_norm_no_update`` /
``batch_norm_backward``, pytorch PR 116092) or on ONNX Runtime's
``com.microsoft::BatchNormInternal``.

``import bnswap`` imports neither Lightning nor ONNX Runtime: ``bnswap.BNSwap`` (the
Lightning callback) and ``bnswap.ort`` load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from bnswap.convert import convert, revert
from bnswap.layers import BatchNorm1d, BatchNorm2d, BatchNorm3d, BNSwapLayer
from bnswap.plan import Plan, PlanRow, plan
from bnswap.registry import register, unregister

__version__ = "0.1.0"

__all__ = [
    "BNSwap",
    "BNSwapLayer",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Plan",
    "PlanRow",
    "convert",
    "is_swapped",
    "plan",
    "register",
    "revert",
    "unregister",
]


def is_swapped(module: object) -> bool:
    """True if ``module`` is a bnswap layer (or an uninitialized lazy layer that becomes one)."""
    if isinstance(module, BNSwapLayer):
        return True
    pending = getattr(module, "__dict__", {}).get("cls_to_become")
    return isinstance(pending, type) and issubclass(pending, BNSwapLayer)


def __getattr__(name: str) -> Any:
    if name == "BNSwap":
        return importlib.import_module("bnswap.lightning").BNSwap
    if name == "ort":
        return importlib.import_module("bnswap.ort")
    raise AttributeError(f"module 'bnswap' has no attribute {name!r}")
