"""The adapter registry: which forward a swapped BatchNorm layer runs.

An *adapter* is a function ``adapter(layer, input, ...)`` that does what the layer's
class's ``forward`` does, with the batch norm on bnswap's kernel
(:func:`bnswap.module_batch_norm`). Which one a layer gets:

* a class registered with :func:`register` (matched exactly, seen through torch's
  parametrization class: ``type_before_parametrizations``): its adapter;
* any other ``_BatchNorm`` class that keeps torch's ``forward`` (``nn.BatchNorm1d/2d/3d``,
  the lazy classes, a subclass that overrides no ``forward``):
  :func:`bnswap.layers.batch_norm_forward`;
* ``nn.SyncBatchNorm`` (and subclasses that keep its ``forward``):
  :func:`bnswap.sync.sync_batch_norm_forward`, synchronized over its ``process_group``;
* a class that overrides ``forward`` and is not registered: none (the layer is skipped;
  swapping would drop its behaviour, pytorch issue 187298). So is a class whose
  ``forward`` a class-level patch replaced in torch's classes
  (``nn.BatchNorm2d.forward = f``, ``_BatchNorm.forward = f``: :func:`replaced_forward`,
  issue 46): torch's forward is the function torch's source defines, nothing else.

Built in: timm's ``timm.layers.norm_act.BatchNormAct2d`` ->
:func:`bnswap.adapters.timm.batch_norm_act_2d`, ``SyncBatchNormAct`` ->
:func:`bnswap.adapters.timm.sync_batch_norm_act_2d` and
``timm.layers.split_batchnorm.SplitBatchNorm2d`` (``train.py --split-bn``) ->
:func:`bnswap.adapters.timm.split_batch_norm_2d`, registered by name so that timm is
imported only when a timm model is converted.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from bnswap._swap import Adapter, stood_for, unpickle_swap
from bnswap.layers import batch_norm_forward
from bnswap.sync import sync_batch_norm_forward

__all__ = [
    "lookup",
    "overrides_forward",
    "qualified_name",
    "register",
    "registered",
    "replaced_forward",
    "safe_globals",
    "unregister",
]

_ADAPTERS: dict[type, Adapter] = {}
# lookup() of classes with no entry of their own, memoized (cleared by register /
# unregister): the qualified-name check of the lazy entries cost ~1 us per layer. Each
# answer is kept with the class's forward it was found for (a class-level patch of it
# since is looked up again).
_FOUND: dict[type, tuple[object, Adapter | None]] = {}
# "module.Class" of a source class -> "module:function" of its adapter, resolved on first
# use (the source's package is already imported when a model holds it).
_LAZY: dict[str, str] = {
    "timm.layers.norm_act.BatchNormAct2d": "bnswap.adapters.timm:batch_norm_act_2d",
    "timm.layers.norm_act.SyncBatchNormAct": "bnswap.adapters.timm:sync_batch_norm_act_2d",
    "timm.layers.split_batchnorm.SplitBatchNorm2d": "bnswap.adapters.timm:split_batch_norm_2d",
}


def qualified_name(obj: object) -> str:
    """``module.qualname`` of a class or function (the plan's ``adapter`` column)."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _defined_by_torch(klass: type, fn: object) -> bool:
    """Whether ``fn``, the ``forward`` in torch's class ``klass``'s ``__dict__`` (bnswap's
    dispatcher seen through), is the function torch's source defines there: its name
    and its code's file are the class's (a function that wraps it with
    ``functools.wraps`` has its name, not its code)."""
    fn = stood_for(fn)
    code = getattr(fn, "__code__", None)
    source = getattr(sys.modules.get(klass.__module__), "__file__", None)
    return (
        code is not None
        and source is not None
        and getattr(fn, "__qualname__", None) == f"{klass.__qualname__}.forward"
        and os.path.splitext(code.co_filename)[0] == os.path.splitext(source)[0]
    )


def replaced_forward(cls: type) -> tuple[type, Callable[..., Any]] | None:
    """The class of torch's whose ``forward`` a layer of ``cls`` runs, with that function,
    when it is not the function torch defined: a class-level patch (test-time adaptation
    code such as MEMO sets ``nn.BatchNorm2d.forward`` or ``_BatchNorm.forward`` to its own
    function, issue 46). None when ``cls`` runs torch's forward or one of its own
    (:func:`overrides_forward`).

    Examples::

        >>> from torch import nn
        >>> from bnswap.registry import replaced_forward
        >>> replaced_forward(nn.BatchNorm2d) is None
        True
    """
    for klass in cls.__mro__:
        fn = vars(klass).get("forward")
        if fn is None or klass.__module__ == "torch.nn.utils.parametrize":
            continue
        if not klass.__module__.startswith("torch.nn.modules"):
            return None  # a forward of the user's class (or none of torch's runs)
        if _defined_by_torch(klass, fn):
            return None
        return klass, stood_for(fn)
    return None


def overrides_forward(cls: type) -> bool:
    """True if a layer of ``cls`` runs a ``forward`` that is not torch's: one that ``cls``
    defines below torch's BatchNorm classes (torch's parametrization class
    ``Parametrized<Base>`` adds none), or one a class-level patch put on torch's classes
    (:func:`replaced_forward`)."""
    for klass in cls.__mro__:
        if "forward" not in vars(klass) or klass.__module__ == "torch.nn.utils.parametrize":
            continue
        if klass.__module__.startswith("torch.nn.modules"):
            return replaced_forward(cls) is not None
        return True
    return False


def register(source_cls: type, adapter: Adapter) -> None:
    """Swap layers of exactly ``source_cls`` with ``adapter`` as their forward.

    Needed for a BatchNorm subclass that overrides ``forward`` (bnswap skips it
    otherwise: a generic swap would drop its behaviour, pytorch issue 187298). A layer
    swapped with it keeps its class, attributes, Parameters, buffers and state_dict keys;
    ``adapter(layer, input)`` runs instead of ``source_cls.forward(layer, input)``.
    Registering again replaces the entry (layers converted earlier keep the adapter they
    were swapped with).

    Args:
        source_cls: a subclass of ``torch.nn.modules.batchnorm._BatchNorm``, matched by
            exact class (for a ``SyncBatchNorm`` subclass, the adapter synchronizes:
            call :func:`bnswap.sync.sync_batch_norm_forward` where it calls
            ``SyncBatchNorm.forward``).
        adapter: a function with ``source_cls.forward``'s signature (the layer first)
            that does what it does, calling :func:`bnswap.module_batch_norm` where it calls
            ``F.batch_norm`` / ``super().forward``. Define it at module level: pickling
            and ``torch.save`` of a whole swapped model store it by qualified name.

    Raises:
        TypeError: ``source_cls`` is not such a class, or ``adapter`` is not callable (a
            class is refused: an adapter is a function of the layer).

    Examples::

        >>> import torch, bnswap
        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> class BatchNormSiLU2d(nn.BatchNorm2d):
        ...     def forward(self, x):
        ...         return F.silu(super().forward(x))
        >>> def batch_norm_silu_2d(layer, x):
        ...     layer._check_input_dim(x)
        ...     return F.silu(bnswap.module_batch_norm(layer, x))
        >>> bnswap.register(BatchNormSiLU2d, batch_norm_silu_2d)
        >>> layer = bnswap.convert(BatchNormSiLU2d(4))
        >>> type(layer) is BatchNormSiLU2d, bnswap.is_swapped(layer)
        (True, True)
        >>> bnswap.unregister(BatchNormSiLU2d)
    """
    if not isinstance(source_cls, type) or not issubclass(source_cls, _BatchNorm):
        raise TypeError(f"source_cls must be a _BatchNorm subclass, got {source_cls!r}")
    if isinstance(adapter, type) or not callable(adapter):
        raise TypeError(
            "adapter must be a function adapter(layer, input) that does what "
            f"{source_cls.__name__}.forward does on bnswap's kernel, got {adapter!r}; see the "
            "'Adapters' guide of bnswap's documentation"
        )
    _ADAPTERS[source_cls] = adapter
    _FOUND.clear()


def unregister(source_cls: type) -> None:
    """Remove ``source_cls``'s entry (a no-op if it has none). Layers swapped earlier keep
    their adapter until :func:`bnswap.revert`.

    Examples::

        >>> import bnswap
        >>> from torch import nn
        >>> class MyBN(nn.BatchNorm2d):
        ...     def forward(self, x):
        ...         return super().forward(x) * 2
        >>> bnswap.register(MyBN, lambda layer, x: bnswap.module_batch_norm(layer, x) * 2)
        >>> bnswap.plan(MyBN(3))[0].action
        'swap'
        >>> bnswap.unregister(MyBN)
        >>> bnswap.plan(MyBN(3))[0].action
        'skip'
    """
    _ADAPTERS.pop(source_cls, None)
    _LAZY.pop(qualified_name(source_cls), None)
    _FOUND.clear()


def _resolve_lazy(cls: type) -> None:
    target = _LAZY.pop(qualified_name(cls), None)
    if target is None:
        return
    mod, _, name = target.partition(":")
    register(cls, getattr(importlib.import_module(mod), name))


def lookup(cls: type) -> Adapter | None:
    """The adapter for layers of class ``cls`` (seen through parametrizations), or None.

    Registered classes first; then :func:`bnswap.sync.sync_batch_norm_forward` for a
    ``SyncBatchNorm`` and :func:`bnswap.layers.batch_norm_forward` for any other
    ``_BatchNorm`` that keeps torch's ``forward``."""
    found = _ADAPTERS.get(cls)
    if found is not None:
        return found
    forward = getattr(cls, "forward", None)
    seen = _FOUND.get(cls)
    if seen is not None and seen[0] is forward:  # (a class-level patch since: looked up again)
        return seen[1]
    _resolve_lazy(cls)
    found = _ADAPTERS.get(cls)
    if found is None and (
        isinstance(cls, type) and issubclass(cls, _BatchNorm) and not overrides_forward(cls)
    ):
        found = sync_batch_norm_forward if issubclass(cls, nn.SyncBatchNorm) else batch_norm_forward
    _FOUND[cls] = (forward, found)
    return found


def registered() -> dict[type, Adapter]:
    """A copy of the resolved registry, source class -> adapter."""
    return dict(_ADAPTERS)


def safe_globals() -> list[Any]:
    """What a whole pickled converted model references of bnswap's where the swap is
    pickled too (``BNSWAP_DISABLE_PATCHES=checkpoints``): the function that rebuilds the
    swap's mark (:class:`bnswap._swap.Swap`), the classes whose ``forward`` it replaces
    and the adapters (torch's, and every registered one). A whole converted model
    otherwise pickles as stock's (nothing of bnswap's: the ``checkpoints`` patch,
    ``docs/patches.md``), so ``torch.load(..., weights_only=True)`` needs stock's classes
    allowlisted only; these are accepted beside them.

    Returns:
        A list of classes and functions for ``torch.serialization.safe_globals`` (torch
        >= 2.5) / ``add_safe_globals``. On torch 2.4 a whole model, stock's or converted,
        does not load with ``weights_only=True`` (its unpickler refuses ``builtins.set``).

    Examples::

        >>> import io, torch, bnswap
        >>> from torch import nn
        >>> m = bnswap.convert(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
        >>> buf = io.BytesIO(); torch.save(m, buf); _ = buf.seek(0)
        >>> stock = [nn.Sequential, nn.Conv2d, nn.BatchNorm2d]   # as for a stock model
        >>> with torch.serialization.safe_globals([*stock, *bnswap.safe_globals()]):
        ...     loaded = torch.load(buf, weights_only=True)
        >>> bnswap.is_swapped(loaded[1]), bnswap.is_swapped(bnswap.convert(loaded)[1])
        (False, True)
    """
    adapters = [batch_norm_forward, *(a for a in _ADAPTERS.values() if a is not batch_norm_forward)]
    owners = [_BatchNorm, nn.SyncBatchNorm, *_ADAPTERS]
    return [unpickle_swap, *dict.fromkeys(owners), *dict.fromkeys(adapters)]
