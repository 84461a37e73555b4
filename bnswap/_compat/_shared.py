"""What the patch modules of :mod:`bnswap._compat` share: the mark on a function bnswap
put in place of another library's (:func:`mark`, :func:`is_patched`: a patch applied
twice is applied once), an installed library's version (:func:`version_of`, for a
version gate), the lock :func:`bnswap._compat.install` holds while a patch takes it too,
and bnswap's logger (a gate that fails says why at DEBUG)."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("bnswap")

#: The attribute that marks a function (or module) bnswap patched.
PATCHED = "_bnswap_patched"
lock = threading.RLock()  # install() holds it while a patch takes it


def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, marked as bnswap's (:func:`is_patched`)."""
    setattr(fn, PATCHED, True)
    return fn


def is_patched(fn: object) -> bool:
    """Whether ``fn`` is one bnswap put in place (:func:`mark`)."""
    return bool(getattr(fn, PATCHED, False))


def version_of(mod_name: str) -> tuple[int, ...]:
    """The (major, minor) version of the imported module ``mod_name`` (its
    ``__version__``; ``(0,)`` when it has none or is not imported)."""
    raw = str(getattr(sys.modules.get(mod_name), "__version__", "0"))
    parts = []
    for p in raw.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)
