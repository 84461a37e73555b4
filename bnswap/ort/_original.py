"""A warning when the model an ORT wrapper wraps is called directly.

``bnswap.convert(model, backend="ort")`` returns a new module (the wrapper); ``model``
itself still runs, eagerly on bnswap's aten layers, so a user who kept calling it trained
without ONNX Runtime and without a word (issue 19). Each wrapped model gets a forward
pre-hook (:class:`WarnUnwrappedCall`, a picklable module-level object) that warns once,
with :class:`UnwrappedCallWarning`, naming the wrapper to call. The wrapper's own calls
of its model (its forward, ORT's export, the shape passes, the eager fallback) run
inside :func:`wrapper_call` and never warn; nor do tracing and exporting.

The hook is bnswap's, the model the user's: a pickle / ``torch.save`` / ``copy.deepcopy``
of the model alone carries no trace of it (issue 32: the checkpoint loads where bnswap is
not installed). The model's ``_forward_pre_hooks`` becomes a :class:`_PreHooks`, an
``OrderedDict`` that reduces to a plain ``collections.OrderedDict`` without bnswap's
internal hooks; the wrapper registers the hook again on its copy of the model when it is
itself unpickled or deep-copied.

Imports no ONNX Runtime (an unpickled model holding the hook needs none).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from bnswap._swap import INTERNAL_HOOK

__all__ = ["UnwrappedCallWarning", "WarnUnwrappedCall", "register", "release", "wrapper_call"]


class UnwrappedCallWarning(UserWarning):
    """A model wrapped by ``bnswap.convert(model, backend="ort")`` / ``bnswap.ort.wrap``
    was called directly: it runs eagerly (aten), not on ONNX Runtime. Call the wrapper
    that ``convert`` returned."""


_local = threading.local()
# wrapped model -> [weakref to its wrapper, warned yet]
_wrapped: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


@contextlib.contextmanager
def wrapper_call() -> Iterator[None]:
    """Inside: calls of wrapped models are the wrappers' own (no warning; per thread)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


class WarnUnwrappedCall:
    """Forward pre-hook on a wrapped model: warn once per model when it is called from
    outside its wrapper (:class:`UnwrappedCallWarning`). Left out of TorchScript's view
    of the model (:data:`bnswap._swap.INTERNAL_HOOK`)."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        if (
            torch.compiler.is_compiling()
            or torch.jit.is_tracing()
            or torch.onnx.is_in_onnx_export()
            or getattr(_local, "depth", 0)
        ):
            return None
        entry = _wrapped.get(module)
        if entry is None or entry[1] or entry[0]() is None:
            return None
        entry[1] = True
        warnings.warn(
            f"bnswap.ort: this {type(module).__name__} is wrapped by the ONNX Runtime "
            "module that bnswap.convert(model, backend='ort') / bnswap.ort.wrap returned "
            "(a BNSwapORTModule); calling the model itself runs it eagerly on the 'aten' "
            "backend, not on ONNX Runtime. Call the wrapper instead "
            "(`model = bnswap.convert(model, backend='ort')`). Warned once per model.",
            UnwrappedCallWarning,
            stacklevel=_user_level(),
        )
        return None


setattr(WarnUnwrappedCall, INTERNAL_HOOK, True)


def _user_level() -> int:
    """``stacklevel`` of the first frame outside this file and torch.nn.Module's call
    machinery (the user's call of the model)."""
    import sys

    skip = (__file__, nn.modules.module.__file__)
    from types import FrameType

    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename in skip:
        frame, level = frame.f_back, level + 1
    return level


class _PreHooks(collections.OrderedDict[Any, Any]):
    """A wrapped model's ``_forward_pre_hooks``: torch's ``OrderedDict`` (the same entries,
    order and handles; torch's ``RemovableHandle`` holds a weak reference to it) that
    pickles, and copies, as a plain ``collections.OrderedDict`` without the internal hooks
    (:data:`bnswap._swap.INTERNAL_HOOK`): a pickle of the model names nothing of bnswap's,
    and a copy is not wrapped (the hook would have nothing to warn of there)."""

    def __reduce__(self) -> tuple[Any, ...]:
        # stock's own reduction of an OrderedDict (class, no arguments, no state, the
        # items), so the bytes are those of the model never wrapped
        return (
            collections.OrderedDict,
            (),
            None,
            None,
            iter([(k, h) for k, h in self.items() if not getattr(h, INTERNAL_HOOK, False)]),
        )


def register(model: nn.Module, wrapper: nn.Module) -> None:
    """``model`` is now wrapped by ``wrapper``: install the hook (once)."""
    with _lock:
        _wrapped[model] = [weakref.ref(wrapper), False]
    hooks = model._forward_pre_hooks
    if any(isinstance(h, WarnUnwrappedCall) for h in hooks.values()):
        return
    if type(hooks) is collections.OrderedDict:  # torch's: one that pickles without the hook
        # (a handle taken before, for a hook on the model itself, refers to the old dict
        # and no longer removes its hook: docs/ort.md)
        hooks = model.__dict__["_forward_pre_hooks"] = _PreHooks(hooks)
    model.register_forward_pre_hook(WarnUnwrappedCall())


def release(model: nn.Module) -> None:
    """``model`` is no longer wrapped (unwrapped): remove the hook. The model keeps its
    :class:`_PreHooks` (empty of bnswap's hooks, it pickles as before): the handles of
    hooks registered while it was wrapped refer to that dict."""
    with _lock:
        _wrapped.pop(model, None)
    for key, hook in list(model._forward_pre_hooks.items()):
        if isinstance(hook, WarnUnwrappedCall):
            del model._forward_pre_hooks[key]
