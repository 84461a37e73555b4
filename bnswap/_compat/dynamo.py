"""The ``dynamo`` patch (:data:`bnswap._compat.PATCHES`).

**torch.compile** (``dynamo``): dynamo's trace rules treat the dispatcher's file
(:mod:`bnswap._swap`) as torch.nn's: traced where traced code calls it, skipped as a
frame of its own (:func:`patch_dynamo_trace_rules`), so a model bnswap never touched
compiles the same frames and graphs as without bnswap. Gate: ``trace_rules.add`` and
``BUILTIN_INLINE_WHEN_CALLED`` exist (tested on torch 2.13, 2.14).
"""

from __future__ import annotations

import os
from typing import Any

from bnswap import _swap as _swap_module
from bnswap._compat._shared import logger


def patch_dynamo_trace_rules(mod: Any) -> bool:
    """Tell dynamo to treat the file of bnswap's dispatcher (:mod:`bnswap._swap`) as it
    treats torch.nn's: skipped where a frame of its own starts there, traced where traced
    code calls it. Stock's ``_BatchNorm.forward`` is never a compiled frame of its own
    (``nn.BatchNorm2d(4).compile()`` and ``nn.Sequential(...).compile()`` of torch's
    modules run eagerly), so the dispatcher that now stands in every BatchNorm class's
    ``forward`` must not be one either: a model bnswap never touched compiles the same
    frames, graphs and bits as in a process without bnswap. Inlined from a user's
    ``forward``, it is traced as before (a swapped layer's graph holds the consolidated
    ops). Two of dynamo's lists: ``SKIP_DIRS`` (through ``trace_rules.add``) and
    ``BUILTIN_INLINE_WHEN_CALLED`` (read for inlined calls before ``SKIP_DIRS``)."""
    add = getattr(mod, "add", None)
    inline_when_called = getattr(mod, "BUILTIN_INLINE_WHEN_CALLED", None)
    skip_dirs = getattr(mod, "SKIP_DIRS", None)
    if (
        not callable(add)
        or not isinstance(inline_when_called, set)
        or not isinstance(skip_dirs, list)
    ):
        logger.debug("bnswap: torch._dynamo.trace_rules lacks add / BUILTIN_INLINE_WHEN_CALLED")
        return False
    path = _dispatcher_file()
    if path in inline_when_called:
        return True
    inline_when_called.add(path)  # first: a traced caller must never see it skipped
    add(_swap_module.__name__)
    return True


def _dispatcher_file() -> str:
    """The dispatcher's source file as dynamo spells paths (posix, absolute)."""
    return os.path.abspath(_swap_module.__file__ or "").replace(os.sep, "/")
