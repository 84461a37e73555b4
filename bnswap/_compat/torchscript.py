"""The ``torchscript`` patch (:data:`bnswap._compat.PATCHES`).

**TorchScript** (``torch.jit.script``, ``torch.jit.trace``):
``torch.jit._recursive.create_script_module`` builds its module from a *stock view* of
the model: the same Parameter and buffer tensors in new
module objects of the same classes, without bnswap's mark (the class's own forward
set on views of layers whose class holds bnswap's dispatcher), internal buffers
and internal hooks (a backend's, ``bnswap._swap.add_internal_buffer`` /
``INTERNAL_HOOK``), and with each backend wrapper replaced by the model it wraps. The
class's ``forward`` (``aten::batch_norm``, whose kernel TorchScript's runtime picks) is
compiled, and the user's model is never touched, not even briefly. Gate: the function
exists with torch's signature (tested on torch 2.4.1, 2.9.1, 2.13, 2.14, 2.15.0).
"""

from __future__ import annotations

import collections
import functools
import inspect
import types
from typing import Any

import torch
from torch import nn

from bnswap._compat._shared import is_patched, logger, mark
from bnswap._swap import (
    INTERNAL_HOOK,
    SWAP,
    class_forward,
    dispatches,
    internal_buffer_names,
    wrapped_model,
)


def stock_view(module: nn.Module, memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """``module`` as stock sees it, for TorchScript: new module objects (``copy.copy``, the
    same classes) sharing every Parameter and buffer tensor, without bnswap's forward
    entry, internal buffers (:func:`bnswap._swap.add_internal_buffer`) and internal
    forward pre-hooks (:data:`bnswap._swap.INTERNAL_HOOK`); a backend wrapper (e.g. the
    ORT backend's) becomes the view of the model it wraps. A module with nothing of
    bnswap's in its tree is returned itself."""
    memo = {} if memo is None else memo
    key = id(module)
    if key in memo:
        return memo[key]
    inner = wrapped_model(module)
    if inner is not None:
        memo[key] = view = stock_view(inner, memo)
        return view
    if isinstance(module, torch.jit.ScriptModule):
        return module
    children = {
        k: (stock_view(v, memo) if v is not None else None) for k, v in module._modules.items()
    }
    hooks = [k for k, h in module._forward_pre_hooks.items() if getattr(h, INTERNAL_HOOK, False)]
    internal = internal_buffer_names(module)
    dispatched = dispatches(type(module))
    own = SWAP in module.__dict__ or dispatched or bool(hooks) or bool(internal)
    if not own and all(children[k] is module._modules[k] for k in children):
        memo[key] = module
        return module
    # not copy.copy: a parametrized module's __getstate__ refuses (torch's parametrize)
    view = object.__new__(type(module))
    view.__dict__.update(module.__dict__)
    memo[key] = view
    d = view.__dict__
    d.pop(SWAP, None)
    if dispatched and "forward" not in d:
        # the class's own forward, which TorchScript compiles (not bnswap's dispatcher,
        # which its class holds in this process: a Python function it cannot compile)
        d["forward"] = types.MethodType(class_forward(type(module)), view)
    if internal:
        d["_buffers"] = {k: v for k, v in module._buffers.items() if k not in internal}
        d["_non_persistent_buffers_set"] = module._non_persistent_buffers_set - set(internal)
    if hooks:  # TorchScript would compile them (and cannot: not functions)
        d["_forward_pre_hooks"] = collections.OrderedDict(  # torch's own type
            (k, h) for k, h in module._forward_pre_hooks.items() if k not in hooks
        )
    d["_modules"] = children
    return view


def patch_torchscript() -> bool:
    rec = getattr(torch.jit, "_recursive", None)
    original = getattr(rec, "create_script_module", None)
    if original is None or is_patched(original):
        return original is not None
    if list(inspect.signature(original).parameters)[:2] != ["nn_module", "stubs_fn"]:
        logger.debug(
            "bnswap: torch.jit._recursive.create_script_module has an unknown "
            "signature; torch.jit.script of swapped layers is not supported here"
        )
        return False

    @functools.wraps(original)
    def create_script_module(nn_module: Any, stubs_fn: Any, *args: Any, **kwargs: Any) -> Any:
        # torch.jit.script and torch.jit.trace (which builds its module here, then
        # records the original's forward: swapped layers record stock's op then)
        if isinstance(nn_module, nn.Module):
            nn_module = stock_view(nn_module)
        return original(nn_module, stubs_fn, *args, **kwargs)

    assert rec is not None  # it holds original
    rec.create_script_module = mark(create_script_module)
    return True
