"""``bnswap.convert`` / ``bnswap.revert``: swap BatchNorm layers in place, atomically.

Layers are swapped by ``__class__`` assignment to a registered subclass of their own
class, so the module object, its Parameter and buffer objects (an optimizer built
before the swap keeps working), ``training`` flag, ``requires_grad``, device, dtype,
forward / pre-forward / state-dict hooks, ``qconfig`` and parametrizations are all
kept, and ``revert`` is the exact inverse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from bnswap import registry
from bnswap._core import drop_trace_buffers
from bnswap.layers import BNSwapLayer
from bnswap.plan import rows_from
from bnswap.walker import Decision, Patterns, base_class, check_module, decide, is_parametrized

__all__ = ["convert", "revert"]

logger = logging.getLogger("bnswap")


_ORIGIN = "_bnswap_parametrized_origin"


def _class_attrs(cls: type) -> dict[str, object]:
    skip = ("__dict__", "__weakref__", _ORIGIN)
    return {k: v for k, v in vars(cls).items() if k not in skip}


def _set_base_class(module: nn.Module, new_base: type) -> Callable[[], None]:
    """Make ``new_base`` the module's class (under torch's parametrization class, if
    any); return the undo."""
    old_cls = type(module)
    if is_parametrized(module):
        # torch.nn.utils.parametrize injects a subclass ``Parametrized<Base>`` holding the
        # properties; rebuild it on the new base so remove_parametrizations() restores it.
        # The rebuilt class remembers the class it was built from, so that revert gives
        # that very class back (unless parametrizations changed in between).
        attrs = _class_attrs(old_cls)
        origin = vars(old_cls).get(_ORIGIN)
        if (isinstance(origin, type) and origin.__bases__ == (new_base,)
                and _class_attrs(origin) == attrs):
            new_cls = origin
        else:
            new_cls = type(f"Parametrized{new_base.__name__}", (new_base,),
                           {**attrs, _ORIGIN: old_cls})
    else:
        new_cls = new_base
    # object.__setattr__: nn.Module.__setattr__ would only check (slowly) that the value
    # is no Parameter / Module / buffer before doing the same.
    object.__setattr__(module, "__class__", new_cls)

    def undo() -> None:
        object.__setattr__(module, "__class__", old_cls)

    return undo


def _set_lazy_target(module: nn.Module, target: type) -> Callable[[], None]:
    """An uninitialized LazyBatchNorm becomes ``target`` (not its stock class) when it
    initializes (``LazyModuleMixin._infer_parameters`` reads ``cls_to_become``)."""
    had = "cls_to_become" in vars(module)
    old = vars(module).get("cls_to_become")
    module.cls_to_become = target

    def undo() -> None:
        if had:
            module.cls_to_become = old
        else:
            del module.cls_to_become

    return undo


def _swap_one(module: nn.Module, target: type, lazy: bool) -> Callable[[], None]:
    return _set_lazy_target(module, target) if lazy else _set_base_class(module, target)


def convert(
    module: nn.Module,
    backend: str = "aten",
    *,
    include: Patterns = None,
    exclude: Patterns = None,
) -> nn.Module:
    """Swap every BatchNorm layer of ``module`` for its bnswap counterpart, in place.

    Recursive over ``module.named_modules()`` (the root included). Idempotent. Atomic:
    if any layer cannot be converted, the model is left exactly as it was and the error
    is raised. What is not swapped is reported (``bnswap.plan``; the same table is
    logged by the ``bnswap`` logger at INFO): ``SyncBatchNorm`` (its own kernel),
    subclasses that override ``forward`` with no registered adapter (pytorch issue
    187298), unregistered subclasses, and anything excluded. An uninitialized
    ``LazyBatchNorm*`` becomes the bnswap layer when it initializes.

    Args:
        module: any ``nn.Module``; a BatchNorm layer itself is converted too.
        backend: ``"aten"``: layers on ``aten._batch_norm_with_update`` /
            ``_batch_norm_no_update`` (pytorch PR 116092). ``"ort"``: the same layers,
            then the model is wrapped in ONNX Runtime's ``ORTModule``, which runs them as
            ``com.microsoft::BatchNormInternal`` (needs ``bnswap[ort-cpu]`` or
            ``bnswap[ort]``; see :mod:`bnswap.ort`).
        include, exclude: glob pattern(s) on qualified names (as in ``named_modules()``)
            and/or classes. A pattern that matches no BatchNorm layer warns.

    Returns:
        ``module`` itself (layers are swapped by class assignment, never copied); with
        ``backend="ort"``, the ``ORTModule`` wrapping it.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; a pattern is not str or class.
        ValueError: unknown ``backend``.
        ImportError: ``backend="ort"`` without ONNX Runtime training installed.
    """
    check_module(module, "convert")
    decisions = decide(module, backend, include, exclude)
    wrapped = _apply(module, decisions, backend)
    _log(decisions, backend)
    return wrapped


def _apply(module: nn.Module, decisions: list[Decision], backend: str) -> nn.Module:
    """Carry out ``decisions`` (from :func:`bnswap.walker.decide` on ``module``)
    atomically: every swap, then the ORT wrap for ``backend="ort"``; on any error every
    swap done so far is undone and the error raised. Returns what :func:`convert` does."""
    undos: list[Callable[[], None]] = []
    try:
        for d in decisions:
            if d.action == "swap" and not d.already:
                assert d.target is not None
                undos.append(_swap_one(d.module, d.target, d.lazy))
        if backend == "ort":
            from bnswap import ort  # imported only when used

            wrapped = ort.wrap(module)
        else:
            wrapped = module
    except BaseException:
        for undo in reversed(undos):
            undo()
        raise
    return wrapped


def _log(decisions: list[Decision], backend: str) -> None:
    # The table (a kernel probe per layer) is built only when it is logged: it cost more
    # than the conversion itself on large models (benchmarks P5).
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", rows_from(decisions, backend))


def ort_inner(module: nn.Module) -> nn.Module | None:
    """The model inside ``module`` if it is a :func:`bnswap.ort.wrap` wrapper, else None
    (read without importing ONNX Runtime)."""
    inner = getattr(module, "_bnswap_inner", None)
    return inner if isinstance(inner, nn.Module) else None


def revert(module: nn.Module) -> nn.Module:
    """Undo :func:`convert`: every bnswap layer gets its original class back.

    Same module objects, same Parameter and buffer objects, same flags and hooks;
    uninitialized LazyBatchNorm layers become their stock class again when they
    initialize. Layers of classes not in the registry are left alone.

    Returns:
        ``module``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    check_module(module, "revert")
    target = ort_inner(module) or module
    for m in target.modules():
        pending = vars(m).get("cls_to_become")
        if isinstance(pending, type) and registry.source_of(pending) is not None:
            del m.cls_to_become  # back to the class's own cls_to_become
        if not isinstance(m, BNSwapLayer):
            continue
        drop_trace_buffers(m)  # registered by bnswap.ort.wrap
        source = registry.source_of(base_class(m))
        if source is not None:
            _set_base_class(m, source)
    return module
