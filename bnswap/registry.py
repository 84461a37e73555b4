"""The adapter registry: which bnswap class replaces which BatchNorm class.

Built in: ``torch.nn.BatchNorm1d/2d/3d`` -> :mod:`bnswap.layers`, and timm's
``timm.layers.norm_act.BatchNormAct2d`` -> ``bnswap.adapters.timm.BatchNormAct2d``,
registered by name so that timm is imported only when a timm model is converted.
"""

from __future__ import annotations

import importlib

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from bnswap import layers

__all__ = ["register", "unregister", "lookup", "source_of", "registered"]

_SWAPS: dict[type, type] = {}
_SOURCES: dict[type, type] = {}
# "module.Class" of a source class -> "module:Class" of its swapped class, resolved on
# first use (the source's package is already imported when a model holds it).
_LAZY: dict[str, str] = {
    "timm.layers.norm_act.BatchNormAct2d": "bnswap.adapters.timm:BatchNormAct2d",
}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register(source_cls: type, swapped_cls: type) -> None:
    """Map a BatchNorm class to its bnswap counterpart for :func:`bnswap.convert`.

    Args:
        source_cls: a subclass of ``torch.nn.modules.batchnorm._BatchNorm`` (not
            ``SyncBatchNorm``), matched by exact class.
        swapped_cls: a subclass of both ``source_cls`` (so ``isinstance`` checks and the
            object layout carry over: layers are swapped by ``__class__`` assignment)
            and :class:`bnswap.layers.BNSwapLayer`. It must not add ``__init__`` state:
            the swapped object keeps the source object's attributes.

    Raises:
        TypeError: if the classes do not satisfy the above.
        ValueError: if ``swapped_cls`` is already registered for another source class
            (:func:`bnswap.revert` must know the one class to go back to).
    """
    if not isinstance(source_cls, type) or not issubclass(source_cls, _BatchNorm):
        raise TypeError(f"source_cls must be a _BatchNorm subclass, got {source_cls!r}")
    if issubclass(source_cls, nn.SyncBatchNorm):
        raise TypeError("SyncBatchNorm has its own cross-process kernel and cannot be swapped")
    if issubclass(source_cls, layers.BNSwapLayer):
        raise TypeError(f"{source_cls.__name__} is already a bnswap layer")
    if not isinstance(swapped_cls, type) or not (
        issubclass(swapped_cls, source_cls) and issubclass(swapped_cls, layers.BNSwapLayer)
    ):
        raise TypeError(
            f"swapped_cls must subclass both {source_cls.__name__} and "
            f"bnswap.layers.BNSwapLayer, got {swapped_cls!r}"
        )
    other = _SOURCES.get(swapped_cls)
    if other is not None and other is not source_cls:
        raise ValueError(
            f"{swapped_cls.__name__} is already registered for {other.__name__}"
        )
    old = _SWAPS.get(source_cls)
    if old is not None:
        _SOURCES.pop(old, None)
    _SWAPS[source_cls] = swapped_cls
    _SOURCES[swapped_cls] = source_cls


def unregister(source_cls: type) -> None:
    """Remove ``source_cls`` from the registry (a no-op if it is not registered)."""
    swapped = _SWAPS.pop(source_cls, None)
    if swapped is not None:
        _SOURCES.pop(swapped, None)
    _LAZY.pop(_qualname(source_cls), None)


def _resolve_lazy(cls: type) -> None:
    target = _LAZY.pop(_qualname(cls), None)
    if target is None:
        return
    mod, _, name = target.partition(":")
    swapped = getattr(importlib.import_module(mod), name)
    register(cls, swapped)


def lookup(cls: type) -> type | None:
    """The bnswap class registered for exactly ``cls``, or None."""
    if cls not in _SWAPS:
        _resolve_lazy(cls)
    return _SWAPS.get(cls)


def source_of(swapped_cls: type) -> type | None:
    """The source class a registered bnswap class replaces, or None."""
    return _SOURCES.get(swapped_cls)


def registered() -> dict[type, type]:
    """A copy of the resolved registry, source class -> bnswap class."""
    return dict(_SWAPS)


for _src, _dst in (
    (nn.BatchNorm1d, layers.BatchNorm1d),
    (nn.BatchNorm2d, layers.BatchNorm2d),
    (nn.BatchNorm3d, layers.BatchNorm3d),
):
    register(_src, _dst)
