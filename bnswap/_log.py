"""bnswap's log, once per job: ``logging.getLogger("bnswap")``, at INFO on global rank
zero and at DEBUG on the other ranks.

A training script launched on several processes (``torchrun``, Lightning's ``ddp`` /
``ddp_spawn``, ``mp.spawn``) runs ``bnswap.convert(model)`` once per process; logging its
plan at INFO on every rank printed the same table once per rank, interleaved. The
ecosystem logs such messages on rank zero only (Lightning's ``rank_zero_info``, timm's
``if utils.is_primary(args)``); bnswap does the same, and keeps the other ranks' lines
at DEBUG (still there for whoever debugs one rank); bnswap's warnings follow the same
rule (:mod:`bnswap._warn`). The rank is torch.distributed's when a default process
group is initialized, else the launcher's environment (``RANK``: torchrun,
torch.distributed.launch, Lightning's cluster environments; ``LOCAL_RANK``: the only one
Lightning's ``ddp`` launcher sets in the processes it starts, as Lightning's own
``rank_zero_only`` reads it). Neither: one process, INFO. ``torch.multiprocessing.spawn``
sets neither: a script that converts before ``init_process_group`` logs on every rank
(convert after it, or set ``RANK``).

bnswap adds no handler to any logger (a script shows the INFO lines, the plan's table,
with ``logging.basicConfig(level=logging.INFO)``). Where nothing is configured at all (no
handler on the ``bnswap`` logger or above it, no level of its own: Python then drops INFO,
its ``logging.lastResort`` shows WARNING and above), one line that must not go unseen (the
swap's one-line summary, :func:`bnswap.convert`) goes to ``sys.stderr`` on rank zero (or
in a single process), once per process, as ``lastResort`` would write it, e.g. ``bnswap.convert:
1 of 1 BatchNorm layers swapped, 0 skipped; for the per-layer table call
logging.basicConfig(level=logging.INFO)``: a trainer that configures only its own logger
(Ultralytics') shows that bnswap swapped (issue 32).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, TextIO

import torch.distributed as dist

__all__ = ["RANK_ENV", "info", "info_level", "logger", "rank", "unconfigured"]

logger = logging.getLogger("bnswap")

#: The environment variables read for the rank (in this order) before a process group
#: is initialized.
RANK_ENV = ("RANK", "LOCAL_RANK")


def rank() -> int | None:
    """This process's global rank in a job of several processes, or None for one
    process: ``torch.distributed.get_rank()`` once a default process group is
    initialized, else the first of :data:`RANK_ENV` that is set (and an integer).

    Examples::

        >>> import os
        >>> from bnswap import _log
        >>> os.environ["RANK"] = "1"
        >>> _log.rank(), _log.info_level() == logging.DEBUG
        (1, True)
        >>> del os.environ["RANK"]
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for key in RANK_ENV:
        value = os.environ.get(key, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return None


def info_level() -> int:
    """``logging.INFO`` on global rank zero or in a single process, ``logging.DEBUG``
    on every other rank (:func:`rank`)."""
    return logging.INFO if rank() in (None, 0) else logging.DEBUG


if TYPE_CHECKING:  # generic in typeshed; subscriptable at run time from Python 3.11 only
    _StreamHandler = logging.StreamHandler[TextIO]
else:
    _StreamHandler = logging.StreamHandler


class _Stderr(_StreamHandler):
    """``logging.lastResort``'s handler at INFO: the message alone, to ``sys.stderr`` as
    it is when the line is written (pytest's capture, a redirected stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        self.used = False

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


_STDERR = _Stderr()


def unconfigured(log: logging.Logger) -> bool:
    """True when nothing in this process shows ``log``'s INFO lines because nothing is
    configured: no handler on ``log`` or above it, no level of its own, and INFO below
    the effective level (the root logger's default WARNING)."""
    return (
        log.level == logging.NOTSET and not log.isEnabledFor(logging.INFO) and not log.hasHandlers()
    )


def info(
    log: logging.Logger, msg: str, *args: object, unconfigured_line: str | None = None
) -> None:
    """``log.info(msg, *args)`` on rank zero, ``log.debug(...)`` on the other ranks; the
    message is formatted only when that level is enabled (``%s`` arguments, as
    ``logging`` does). ``unconfigured_line``, if given, goes to ``sys.stderr`` instead on
    rank zero when logging is not configured at all (:func:`unconfigured`), once per
    process.

    Examples::

        >>> import logging
        >>> from bnswap import _log
        >>> _log.info(logging.getLogger("bnswap"), "%s layers swapped", 3)
    """
    level = info_level()
    if log.isEnabledFor(level):
        log.log(level, msg, *args, stacklevel=2)
    elif (
        unconfigured_line is not None
        and not _STDERR.used
        and level == logging.INFO
        and unconfigured(log)
    ):
        _STDERR.used = True  # once per process (a script converting many models)
        _STDERR.handle(log.makeRecord(log.name, level, "", 0, unconfigured_line, (), None))
