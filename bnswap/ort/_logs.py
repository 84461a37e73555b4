"""ONNX Runtime's log level for bnswap's sessions: ``$BNSWAP_ORT_LOG_LEVEL``."""

from __future__ import annotations

import os
import warnings

__all__ = ["LOG_LEVEL_ENV", "ort_log_level"]

#: The environment variable that sets ONNX Runtime's own log level: VERBOSE, INFO,
#: WARNING (the default) or ERROR. It applies to ORTModule's Python logger
#: (``orttraining``, which otherwise printed its exporter's INFO lines, 80 and more for a
#: 3-layer model, under ``logging.basicConfig(level=logging.INFO)``) and to the C++
#: session logger (at WARNING, its warning about the optimized graph bnswap saves for
#: :func:`executed_ops` is left out).
LOG_LEVEL_ENV = "BNSWAP_ORT_LOG_LEVEL"
_LOG_LEVELS = ("VERBOSE", "INFO", "WARNING", "ERROR")


def ort_log_level() -> str:
    """ONNX Runtime's log level: ``$BNSWAP_ORT_LOG_LEVEL`` (VERBOSE, INFO, WARNING or
    ERROR), WARNING by default or for an unknown value (with a warning)."""
    value = os.environ.get(LOG_LEVEL_ENV, "WARNING").strip().upper()
    if value not in _LOG_LEVELS:
        warnings.warn(f"bnswap.ort: {LOG_LEVEL_ENV}={value!r} is not one of "
                      f"{', '.join(_LOG_LEVELS)}; using WARNING", UserWarning, stacklevel=2)
        return "WARNING"
    return value
