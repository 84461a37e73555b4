"""The adapter registry: which bnswap class replaces which BatchNorm class.

Built in: ``torch.nn.BatchNorm1d/2d/3d`` -> :mod:`bnswap.layers`, and timm's
``timm.layers.norm_act.BatchNormAct2d`` -> ``bnswap.adapters.timm.BatchNormAct2d``,
registered by name so that timm is imported only when a timm model is converted.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

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


# torch.ao.quantization.fuse_modules looks fusers up by exact module types; the keys
# added for each registered bnswap class, so unregister() can remove them.
_FUSER_KEYS: dict[type, list[tuple[type, ...]]] = {}


def _stock_view(m: nn.Module) -> nn.Module:
    """A shallow copy of a bnswap layer with its source class: the same Parameter and
    buffer objects (torch's fused classes accept only the stock BatchNorm classes)."""
    if not isinstance(m, layers.BNSwapLayer):
        return m
    from bnswap.convert import _set_base_class  # noqa: PLC0415 - avoids an import cycle
    from bnswap.walker import base_class  # noqa: PLC0415

    source = _SOURCES.get(base_class(m))
    if source is None:
        return m
    view = object.__new__(type(m))
    view.__dict__.update(m.__dict__)
    _set_base_class(view, source)
    return view


def _fuser_on_stock_view(fuser: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def fuse(is_qat: bool, *mods: nn.Module) -> nn.Module:
        return fuser(is_qat, *(_stock_view(m) for m in mods))

    fuse.__name__ = f"bnswap_{getattr(fuser, '__name__', 'fuser')}"
    return fuse


def _register_fusers(source_cls: type, swapped_cls: type) -> None:
    """Let ``torch.ao.quantization.fuse_modules`` fuse ``swapped_cls`` wherever it fuses
    ``source_cls`` (same fuser method, given a stock-class view of the layer)."""
    try:
        from torch.ao.quantization import fuser_method_mappings as fm  # noqa: PLC0415
    except ImportError:  # pragma: no cover - builds without torch.ao
        return
    table = getattr(fm, "_DEFAULT_OP_LIST_TO_FUSER_METHOD", None)
    if not isinstance(table, dict):  # pragma: no cover - a future torch layout
        return
    added = _FUSER_KEYS.setdefault(swapped_cls, [])
    for key, fuser in list(table.items()):
        if isinstance(key, tuple) and source_cls in key:
            new_key = tuple(swapped_cls if t is source_cls else t for t in key)
            if new_key not in table:
                table[new_key] = _fuser_on_stock_view(fuser)
                added.append(new_key)


def _unregister_fusers(swapped_cls: type) -> None:
    keys = _FUSER_KEYS.pop(swapped_cls, [])
    if keys:
        from torch.ao.quantization import fuser_method_mappings as fm  # noqa: PLC0415

        for key in keys:
            fm._DEFAULT_OP_LIST_TO_FUSER_METHOD.pop(key, None)


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
        _unregister_fusers(old)
    _SWAPS[source_cls] = swapped_cls
    _SOURCES[swapped_cls] = source_cls
    _register_fusers(source_cls, swapped_cls)


def unregister(source_cls: type) -> None:
    """Remove ``source_cls`` from the registry (a no-op if it is not registered)."""
    swapped = _SWAPS.pop(source_cls, None)
    if swapped is not None:
        _SOURCES.pop(swapped, None)
        _unregister_fusers(swapped)
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
