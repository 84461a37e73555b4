"""The ``checkpoints`` patch (:data:`bnswap._compat.PATCHES`).

**Whole-model checkpoints** (``checkpoints``): ``_BatchNorm`` gets a ``__getstate__``
that leaves the swap entry and internal buffers out of ``torch.save`` / pickle and
``copy.copy`` (a checkpoint names nothing of bnswap's and loads as stock's layers,
where bnswap is not installed too; issue 32), and a ``__deepcopy__`` that keeps them
(the copy is swapped, bound to itself); a pickle for another process of the job
(multiprocessing's ``ForkingPickler``) keeps them too (:func:`patch_checkpoints`).
"""

from __future__ import annotations

import copy
import sys
import threading
import types
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from bnswap import _swap as _swap_module
from bnswap._compat._shared import is_patched, mark
from bnswap._swap import INTERNAL_BUFFER_PREFIX
from bnswap._warn import warn

_BN_CLASS = torch.nn.modules.batchnorm._BatchNorm


def _stock_state(state: Any) -> Any:
    """``state`` (a BatchNorm layer's ``__getstate__``) without anything of bnswap's:
    internal buffers and bnswap's own attributes (``_bnswap_*``: the swap's mark,
    :data:`bnswap._swap.SWAP`, the original layer a ``convert(..., sync_batchnorm=True)``
    SyncBatchNorm keeps for ``revert``); a new dict when something is left out."""
    if not isinstance(state, dict):
        return state
    buffers = state.get("_buffers")
    internal = (
        [k for k in buffers if k.startswith(INTERNAL_BUFFER_PREFIX)]
        if isinstance(buffers, dict)
        else []
    )
    own = [k for k in state if isinstance(k, str) and k.startswith(INTERNAL_BUFFER_PREFIX)]
    if not internal and not own:
        return state
    state = {k: v for k, v in state.items() if k not in own}
    if internal:
        assert isinstance(buffers, dict)  # internal names came from it
        state["_buffers"] = type(buffers)((k, v) for k, v in buffers.items() if k not in internal)
        nonpersistent = state.get("_non_persistent_buffers_set")
        if isinstance(nonpersistent, set):
            state["_non_persistent_buffers_set"] = nonpersistent - set(internal)
    return state


def _forking_codes() -> frozenset[types.CodeType]:
    from multiprocessing import reduction

    return frozenset(
        f.__code__
        for f in (reduction.ForkingPickler.dumps.__func__, reduction.dump)  # type: ignore[attr-defined]  # typeshed: dumps is a classmethod
        if hasattr(f, "__code__")
    )


_FORKING_CODES: frozenset[types.CodeType] = frozenset()


def _pickle_keeps_swap() -> bool:
    """Whether the pickle being made keeps bnswap's swap: a deepcopy (``_keep``), or a
    pickle for another process of this job (multiprocessing's ``ForkingPickler``, called
    from these two functions, the pickler itself being C). Called directly by the
    pickling method (``_BatchNorm.__getstate__`` below, ``bnswap._swap.Swap.__reduce__``):
    frame 2 is the one that pickles."""
    return bool(_keep.active) or sys._getframe(2).f_code in _FORKING_CODES


class _Keep(threading.local):
    active = 0


_keep = _Keep()


def patch_checkpoints() -> bool:
    """``torch.save`` / pickle and ``copy.copy`` of a BatchNorm layer leave bnswap's swap
    out (the layer loads as stock's, where bnswap is not installed too: nothing of
    bnswap's is pickled); ``copy.deepcopy`` keeps it, and so does a
    pickle for another process of the job (multiprocessing's ``ForkingPickler``:
    ``torch.multiprocessing.spawn``'s arguments, its queues)."""
    cls = _BN_CLASS
    prev = getattr(cls, "__getstate__", None)  # nn.Module's (object's on Python 3.11+)
    if prev is not None and is_patched(prev):
        return True
    if (
        prev is None
        or "__getstate__" in vars(cls)
        or "__deepcopy__" in vars(cls)
        or hasattr(cls, "__deepcopy__")
        or not hasattr(copy, "_reconstruct")
    ):
        warn(
            "bnswap: this torch's BatchNorm defines its own __getstate__ / __deepcopy__, "
            "so the checkpoints patch is off: torch.save(model) of a converted model "
            "names bnswap (loading it needs bnswap); save model.state_dict(), or "
            "bnswap.revert(model) before torch.save(model)",
            UserWarning,
        )
        return False

    @mark
    def __getstate__(self: nn.Module) -> Any:
        state = prev(self)
        # deep-copied (__deepcopy__ below), or pickled for another process of this job
        # (mp.spawn, torch.multiprocessing queues): the swap goes along, that process
        # running this environment
        if _pickle_keeps_swap():
            return state
        return _stock_state(state)

    @mark
    def __deepcopy__(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
        # copy.deepcopy's own procedure for a class without __deepcopy__ (the reduction,
        # then copy._reconstruct), with the swap and internal buffers kept
        if parametrize.is_parametrized(self):
            # torch's parametrized classes refuse __getstate__; torch deep-copies their
            # __dict__ (parametrize's default_deepcopy), the mark with it
            y = type(self).__new__(type(self))
            memo[id(self)] = y
            y.__dict__ = copy.deepcopy(self.__dict__, memo)
            return y
        # the full state, the swap's mark included
        depth = _keep.active
        _keep.active = depth + 1
        try:
            rv = self.__reduce_ex__(4)
        finally:
            _keep.active = depth
        new: nn.Module = copy._reconstruct(self, memo, *rv)  # type: ignore[attr-defined]  # typeshed omits it
        return new

    global _FORKING_CODES
    _FORKING_CODES = _forking_codes()
    _swap_module.pickle_keeps_swap = _pickle_keeps_swap
    cls.__getstate__ = __getstate__  # type: ignore[method-assign]  # the patch
    cls.__deepcopy__ = __deepcopy__  # type: ignore[attr-defined]  # the patch (none before)
    return True
