"""bnswap's ONNX Runtime training backend: the public face.

``bnswap.convert(model, backend="ort")`` (or :func:`wrap` on a converted model) returns
an ``ORTModule`` in which every training BatchNorm runs as
``com.microsoft::BatchNormInternal`` + ``BatchNormalizationGrad`` (ORT PR 7539), with
PyTorch's running-statistics rule. How it works, what is tested and the limits:
``docs/ort.md``.

Here: :func:`is_available`, :func:`build`, :func:`wrap`, :func:`executed_ops`, the
errors (:mod:`bnswap.ort.errors`), and ``BNSwapORTModule`` (the wrapper class, defined
in :mod:`bnswap.ort._module`). ``import bnswap`` never imports ONNX Runtime, and neither
does this module: it is imported when :func:`wrap`, :func:`build` or
``BNSwapORTModule`` are first used.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import os
import sys
import warnings
from typing import Any

from torch import nn

from bnswap._swap import WRAPPER_STATE
from bnswap.extras import install_command
from bnswap.ort._layers import check_devices, check_layers, trace_constants
from bnswap.ort._logs import LOG_LEVEL_ENV, ort_log_level
from bnswap.ort._original import UnwrappedCallWarning
from bnswap.ort._original import release as _release
from bnswap.ort.errors import (
    BuildError,
    LayerRunsTwiceError,
    ORTBackendError,
    ORTNotAvailableError,
    ORTRunError,
    StatsNotWrittenError,
    UnsupportedLayerError,
    UnsupportedVersionError,
)

logger = logging.getLogger("bnswap.ort")

__all__ = [
    "DEFAULT_SESSION_OPTIONS",
    "INSTALL",
    "LOG_LEVEL_ENV",
    "BuildError",
    "LayerRunsTwiceError",
    "ORTBackendError",
    "ORTNotAvailableError",
    "ORTRunError",
    "StatsNotWrittenError",
    "UnsupportedLayerError",
    "UnsupportedVersionError",
    "UnwrappedCallWarning",
    "build",
    "check_python",
    "executed_ops",
    "is_available",
    "ort_log_level",
    "unwrap",
    "wrap",
]

#: The exact install commands for the CPU backend (torch first, pinned).
INSTALL = "pip install onnxruntime-training-cpu==1.19.2 && pip install --no-deps torch-ort==1.19.2"

#: ``onnxruntime.SessionOptions`` attributes bnswap sets on every ORT session; override per
#: model with ``wrap(session_options=)``. Empty: ORT's defaults (intra-op threads = all
#: cores, spinning; ORTModule turns memory patterns off), its fastest setting measured
#: here (benchmarks/README.md, "ORT (P4)"): ``enable_mem_pattern`` and no spinning were
#: slower. ``{"intra_op_num_threads": 1}`` helps when other processes load the cores.
#: ``execution_mode=ORT_PARALLEL`` fails in ORT 1.19.2's training session.
DEFAULT_SESSION_OPTIONS: dict[str, Any] = {}


#: Python versions onnxruntime-training 1.19.2 (the last release) has wheels for.
SUPPORTED_PYTHON = ((3, 10), (3, 11))


def check_python(version: tuple[int, ...] | None = None) -> None:
    """Raise unless this Python (or ``version``, e.g. ``(3, 12, 1)``) is one ONNX Runtime
    training runs on: 3.10 or 3.11. onnxruntime-training 1.19.2 is its last release
    (no wheels for Python 3.12 and newer; upstream has proposed removing ORTModule), so
    the ``bnswap[ort]`` / ``bnswap[ort-cpu]`` extras install nothing there.

    Raises:
        ORTNotAvailableError: (an ImportError) on Python 3.12 and newer (or older than
            3.10), naming the versions and ``backend="aten"``.

    Examples::

        >>> import bnswap.ort
        >>> bnswap.ort.check_python((3, 11, 9))
        >>> bnswap.ort.check_python((3, 12, 0))
        Traceback (most recent call last):
        ...
        bnswap.ort.errors.ORTNotAvailableError: bnswap's ORT backend: ONNX Runtime training ...
    """
    v = tuple(sys.version_info[:2] if version is None else version[:2])
    if v not in SUPPORTED_PYTHON:
        raise ORTNotAvailableError(
            "bnswap's ORT backend: ONNX Runtime training needs Python 3.10 or 3.11 (this is "
            f"Python {v[0]}.{v[1]}); onnxruntime-training 1.19.2 is its last release and "
            "has no wheels for Python 3.12 and newer. Use backend='aten' (the default), or "
            "a Python 3.10 / 3.11 environment."
        )


def is_available() -> bool:
    """True if onnxruntime-training and torch-ort are installed (nothing is imported).

    Examples::

        >>> import bnswap.ort
        >>> isinstance(bnswap.ort.is_available(), bool)
        True
    """
    # find_spec of a submodule would import onnxruntime, whose __init__ imports ORTModule
    # (which patches torch); only top-level specs and the file system are consulted.
    try:
        ort = importlib.util.find_spec("onnxruntime")
        if ort is None or importlib.util.find_spec("torch_ort") is None:
            return False
        return any(
            os.path.isfile(os.path.join(p, "training", "ortmodule", "__init__.py"))
            for p in (ort.submodule_search_locations or [])
        )
    except (ImportError, ValueError):
        return False


def _require() -> Any:
    """``onnxruntime.training.ortmodule``, made usable on this torch (or
    :class:`ORTNotAvailableError` naming the Python versions or the install command)."""
    check_python()
    if not is_available():
        extra = install_command("ort-cpu")  # (bnswap is not on PyPI: from where it came)
        raise ORTNotAvailableError(
            "bnswap's ORT backend needs ONNX Runtime training and torch-ort. Install them "
            f"with: {INSTALL}   (or bnswap's 'ort-cpu' extra: "
            f"{extra + ' && ' if extra else 'README, Install, then '}"
            "pip install --no-deps torch-ort==1.19.2). Never install plain `onnxruntime` "
            "in the same environment: it replaces the training build."
        )
    from bnswap.ort import _compat

    return _compat.apply()


def build(*, force: bool = False) -> str:
    """Build ORT's ``aten_op_executor`` extension into the cache (once); return its path.

    The cache is ``$BNSWAP_CACHE_DIR/ort-ext`` (default ``~/.cache/bnswap``), one folder
    per torch / ORT / Python version; about a minute on 2 cores, progress on stderr.

    Raises:
        ORTNotAvailableError: ORT training is not installed.
        BuildError: no C++ compiler, or the compile failed.

    Examples::

        >>> import bnswap.ort
        >>> path = bnswap.ort.build()  # once; later calls return at once
        >>> path.endswith(".so")
        True
    """
    if not is_available():
        _require()
    from bnswap.ort import _build

    return str(_build.ensure_extension(force=force))


def __getattr__(name: str) -> Any:
    if name == "BNSwapORTModule":  # imports ONNX Runtime: only when asked for
        _require()
        from bnswap.ort._module import BNSwapORTModule

        return BNSwapORTModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def wrap(
    module: nn.Module,
    *,
    fallback: str | None = None,
    session_options: dict[str, Any] | None = None,
    debug_options: Any = None,
) -> nn.Module:
    """Wrap ``module`` in ONNX Runtime's ``ORTModule`` with bnswap's BatchNorm semantics.

    ``module``'s BatchNorm layers must already be bnswap layers (``bnswap.convert(model,
    backend="ort")`` swaps them, then calls this). The model is not copied: ORT trains its
    Parameters and buffers in place, so optimizers, ``state_dict`` and checkpoints keep
    working. Its train/eval mode is kept.

    Args:
        module: an ``nn.Module`` (not a LightningModule: wrap its children) with float32
            BatchNorm parameters on the CPU (tested: onnxruntime-training-cpu 1.19.2) or
            CUDA (ONNX Runtime's GPU training build; untested here). No other device.
        fallback: ``None`` (default): anything ORT cannot export or run raises
            :class:`ORTRunError`. ``"aten"``: warn (``RuntimeWarning``) and run the
            model eagerly on bnswap's aten layers instead.
        session_options: ``onnxruntime.SessionOptions`` attributes to set, e.g.
            ``{"intra_op_num_threads": 2}``; keys ``"config:<key>"`` become session config
            entries. Defaults: :data:`DEFAULT_SESSION_OPTIONS`.
        debug_options: ``onnxruntime.training.ortmodule.DebugOptions``.

    Returns:
        A ``torch_ort.ORTModule`` (subclass ``BNSwapORTModule``); with ``fallback="aten"``
        and an ORT that cannot be set up, ``module`` itself (after a warning).

    Raises:
        ORTNotAvailableError: ORT training / torch-ort not installed (names the command),
            or Python 3.12 and newer (:func:`check_python`).
        UnsupportedVersionError, BuildError: untested versions; the extension cannot be
            built (``fallback=None``; with ``"aten"``: a warning and ``module``).
        UnsupportedLayerError: a BatchNorm layer is not swapped, not initialized, not
            float32 or not on CPU / CUDA (raised before ORT is imported); on CUDA with an
            ONNX Runtime build without ``CUDAExecutionProvider`` (the CPU build,
            ``ort-cpu``).
        TypeError: ``module`` is not an ``nn.Module`` or is a LightningModule.
        ValueError: unknown ``fallback``.
        ORTRunError: ORT cannot build the wrapper (``fallback=None``).

    Examples::

        >>> import torch, bnswap, bnswap.ort
        >>> from torch import nn
        >>> model = bnswap.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
        >>> wrapped = bnswap.ort.wrap(model)
        >>> wrapped.module is model
        True
        >>> wrapped(torch.randn(2, 3, 6, 6)).shape
        torch.Size([2, 4, 4, 4])
        >>> bnswap.ort.executed_ops(wrapped)["BatchNormInternal"]
        1
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"bnswap.ort.wrap expects an nn.Module, got {type(module).__name__}")
    if fallback not in (None, "aten"):
        raise ValueError(f"fallback must be None or 'aten', got {fallback!r}")
    if type(module).__module__.startswith(("lightning", "pytorch_lightning")) or any(
        c.__module__.startswith(("lightning.pytorch", "pytorch_lightning"))
        for c in type(module).__mro__[1:]
    ):
        raise TypeError(
            "ORTModule cannot wrap a LightningModule: wrap its child modules "
            "(bnswap.BNSwap(backend='ort') does this)."
        )
    check_layers(module)
    trace_constants(module, add=True)
    try:
        _require()
        from bnswap.ort._module import BNSwapORTModule

        if debug_options is None:
            from onnxruntime.training.ortmodule import DebugOptions, LogLevel

            debug_options = DebugOptions(log_level=getattr(LogLevel, ort_log_level()))
        opts = dict(DEFAULT_SESSION_OPTIONS)
        opts.update(session_options or {})
        import onnxruntime

        check_devices(module, list(onnxruntime.get_available_providers()))

        onnxruntime.set_seed(int(__import__("torch").initial_seed() % sys.maxsize))
        return BNSwapORTModule(
            module, fallback=fallback, session_options=opts, debug_options=debug_options
        )
    except BaseException as err:
        trace_constants(module, add=False)
        if not isinstance(err, Exception):
            raise
        if fallback == "aten":
            warnings.warn(
                f"bnswap.ort: ONNX Runtime cannot be set up ({err}); using the "
                "eager 'aten' backend (fallback='aten').",
                RuntimeWarning,
                stacklevel=2,
            )
            return module
        if isinstance(err, (ORTBackendError, TypeError, ValueError)):
            raise  # its own type: ORTNotAvailableError, UnsupportedVersionError, BuildError
        raise ORTRunError(f"bnswap.ort: could not set up ONNX Runtime: {err}") from err


def unwrap(wrapper: nn.Module) -> nn.Module:
    """The model ``wrapper`` (what :func:`wrap` / ``bnswap.convert(..., backend="ort")``
    returned) wraps, no longer marked as wrapped: calling it directly stops warning
    (:class:`UnwrappedCallWarning`). Its layers stay swapped (``bnswap.revert`` them).

    Raises:
        TypeError: ``wrapper`` was not made by :func:`wrap`.

    Examples::

        >>> import torch, bnswap, bnswap.ort
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        >>> wrapped = bnswap.convert(model, backend="ort")
        >>> bnswap.ort.unwrap(wrapped) is model
        True
        >>> model(torch.randn(2, 3, 6, 6)).shape  # eager again, no warning
        torch.Size([2, 4, 4, 4])
    """
    state = wrapper.__dict__.get(WRAPPER_STATE) if isinstance(wrapper, nn.Module) else None
    model: nn.Module | None = getattr(state, "model", None)
    if model is None:
        raise TypeError(
            "bnswap.ort.unwrap expects a model returned by bnswap.ort.wrap / "
            "bnswap.convert(..., backend='ort')"
        )
    _release(model)
    return model


def executed_ops(model: nn.Module, training: bool | None = None) -> collections.Counter[str]:
    """Op types of the graph ONNX Runtime runs for ``model`` (its optimized session graph).

    Args:
        model: what :func:`wrap` / ``bnswap.convert(..., backend="ort")`` returned, after
            at least one forward in the requested mode.
        training: the training graph (forward + backward; contains
            ``BatchNormInternal`` and ``BatchNormalizationGrad``) or the inference graph
            (``BatchNormalization``); default: ``model.training``.

    Returns:
        ``collections.Counter`` of ONNX op types (domain-less names, e.g.
        ``{"Conv": 1, "BatchNormInternal": 1, ...}``).

    Raises:
        TypeError: ``model`` was not made by :func:`wrap`.
        ORTRunError: (a RuntimeError) no ORT session exists yet for that mode (run a
            forward first).

    Examples::

        >>> import torch, bnswap, bnswap.ort
        >>> from torch import nn
        >>> wrapped = bnswap.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)),
        ...                          backend="ort")
        >>> wrapped(torch.randn(2, 3, 6, 6)).sum().backward()
        >>> ops = bnswap.ort.executed_ops(wrapped)
        >>> ops["BatchNormInternal"], ops["BatchNormalizationGrad"]
        (1, 1)
    """
    state = model.__dict__.get(WRAPPER_STATE) if isinstance(model, nn.Module) else None
    files = getattr(state, "graph_files", None)
    if files is None:
        raise TypeError(
            "executed_ops expects a model returned by bnswap.ort.wrap / "
            "bnswap.convert(..., backend='ort')"
        )
    if training is None:
        training = model.training
    mode = "training" if training else "inference"
    assert state is not None  # it has graph_files
    cache = state.ops
    if mode not in cache:
        path = files.get(mode)
        if path is None or not os.path.isfile(path):
            raise ORTRunError(
                f"ONNX Runtime has not built its {mode} session for this model "
                "yet: run a forward in that mode first."
            )
        import onnx

        model = onnx.load(path, load_external_data=False)
        counter: collections.Counter[str] = collections.Counter(n.op_type for n in model.graph.node)
        for fn in model.functions:
            counter.update(n.op_type for n in fn.node)
        cache[mode] = counter
    return collections.Counter(cache[mode])
