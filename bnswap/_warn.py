"""Warnings attributed to the user's line: the first frame outside the bnswap package
and the trainer that calls bnswap's callback (Lightning); once per job: on global rank
zero (or in one process), as Lightning's ``rank_zero_warn``, and as a DEBUG line of the
``bnswap`` logger on the other ranks (:mod:`bnswap._log` says how the rank is known).

A fixed ``stacklevel`` points at bnswap's own code when the warning is raised a few
calls deep (``convert`` -> ``plan``), so the user sees ``bnswap/convert.py:88``. Python
3.12's ``warnings.warn(..., skip_file_prefixes=...)`` does this; this module does it on
3.11 too.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

from bnswap import _log

__all__ = ["UnmatchedPatternWarning", "warn"]


class UnmatchedPatternWarning(UserWarning):
    """An include / exclude pattern matches no BatchNorm layer of the model (or no
    batch-norm node of a program)."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Packages whose frames stand between the user's line and bnswap's code
#: (``trainer.fit(...)`` -> Lightning's hooks -> BNSwap; ``import torchao...`` ->
#: torchao's own imports -> bnswap's torchao patch): skipped when they are loaded.
_CALLERS = ("lightning", "pytorch_lightning", "lightning_fabric", "torchao")


def _skipped() -> tuple[str, ...]:
    dirs = [_PACKAGE]
    for name in _CALLERS:  # never imported here: only the ones the process has loaded
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the innermost caller outside
    the bnswap package and Lightning (its file and line in the warning, its module for
    the filters): the user's ``bnswap.convert(...)`` or ``trainer.fit(...)`` line. On a
    rank other than zero of a job of several processes it is logged at DEBUG instead
    (every rank converts the same model: a torchrun job of N processes warned N times).

    Examples::

        >>> import warnings
        >>> from bnswap._warn import warn
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn("careful")
        >>> caught[0].category.__name__, "bnswap" in caught[0].filename
        ('UserWarning', False)
    """
    if _log.rank() not in (None, 0):
        _log.logger.debug("%s: %s", category.__name__, message)
        return
    skipped = _skipped()
    frame: FrameType | None = sys._getframe(1)
    level = 2  # stacklevel 2: warn's caller
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
