"""ONNX Runtime's log level for bnswap's sessions: ``$BNSWAP_ORT_LOG_LEVEL``."""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["LOG_LEVEL_ENV", "ort_log_level", "quiet_ort_notices"]

#: The environment variable that sets ONNX Runtime's own log level: VERBOSE, INFO,
#: WARNING (the default) or ERROR. It applies to ORTModule's Python logger
#: (``orttraining``, ``orttraining.rank-<rank>`` under DDP, which otherwise printed its
#: exporter's INFO lines, 80 and more for a 3-layer model, under
#: ``logging.basicConfig(level=logging.INFO)``) and to the C++ session logger (at WARNING, its
#: warning about the optimized graph bnswap saves for
#: :func:`executed_ops` is left out).
LOG_LEVEL_ENV = "BNSWAP_ORT_LOG_LEVEL"
_LOG_LEVELS = ("VERBOSE", "INFO", "WARNING", "ERROR")
_warned: set[str] = set()

#: ORTModule's informational notices, which ORT 1.19.2 logs at WARNING: its feature
#: banner (once per mode a model runs in) and its fast-path notice. Shown at INFO and
#: VERBOSE only.
ORT_NOTICES = ("is accelerating your model", "Fast path enabled - skipping checks")


def ort_log_level() -> str:
    """ONNX Runtime's log level: ``$BNSWAP_ORT_LOG_LEVEL`` (VERBOSE, INFO, WARNING or
    ERROR, any case), WARNING when unset or empty, and for an unknown value (with a
    warning, once per value)."""
    value = os.environ.get(LOG_LEVEL_ENV, "").strip().upper() or "WARNING"
    if value not in _LOG_LEVELS:
        if value not in _warned:
            _warned.add(value)
            warnings.warn(
                f"bnswap.ort: {LOG_LEVEL_ENV}={value!r} is not one of "
                f"{', '.join(_LOG_LEVELS)}; using WARNING",
                UserWarning,
                stacklevel=2,
            )
        return "WARNING"
    return value


class _DropNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if ort_log_level() in ("VERBOSE", "INFO"):
            return True
        message = record.getMessage()
        return not any(n in message for n in ORT_NOTICES)


def quiet_ort_notices(logger: logging.Logger | None = None) -> None:
    """Keep :data:`ORT_NOTICES` off ORTModule's loggers unless ``$BNSWAP_ORT_LOG_LEVEL``
    is INFO or VERBOSE (idempotent).

    ORTModule logs to ``orttraining`` in a single process but to
    ``orttraining.rank-<rank>`` when ``torch.distributed`` is initialized with more than
    one process (ORT 1.19.2's ``configure_ortmodule_logger``, at the ORTModule's
    creation). A logger's filters see only the records logged on that logger, not those
    its children propagate, so the filter goes on ``orttraining`` and on ``logger``, the
    one an ORTModule was given (its ``_logger``; a ``.rank-<rank>`` one under DDP).
    """
    for target in (logging.getLogger("orttraining"), logger):
        if target is not None and not any(isinstance(f, _DropNotices) for f in target.filters):
            target.addFilter(_DropNotices())
