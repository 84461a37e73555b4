"""Every patch bnswap applies to third-party packages, in one place.

onnxruntime-training 1.19.2's ``ORTModule`` predates the torch >= 2.9 ONNX layout (the
TorchScript exporter moved to ``torch.onnx._internal.torchscript_exporter``) and the
``dynamo=True`` default of ``torch.onnx.export``. This module makes it run on the torch
versions bnswap is tested with, and only there: :func:`apply` refuses untested versions
(:data:`TESTED_ORT`, torch >= :data:`MIN_TORCH`) unless ``BNSWAP_ORT_ALLOW_UNTESTED=1``.
Tested with torch 2.13 and 2.14 (``make test``); ``make compat`` (torch 2.4.1, 2.9.1,
2.15.0) runs no ORT test, so older releases stay refused and 2.15 is unverified here.

It is applied only by :mod:`bnswap.ort` (never by ``import bnswap``), and it leaves
torch's public behaviour as it was:

* ORT's import-time and export-time needs for torch's private ONNX modules
  (``torch.onnx._internal.jit_utils``, ``torch.onnx._type_utils``, ``torch.onnx._globals``,
  ``torch.onnx._internal._beartype``, ``symbolic_opset9._convolution`` /
  ``_convolution_mode``) are served by aliases that exist only inside
  :func:`ort_scope` (while ORT is imported, an ``ORTModule`` is built, or ORT exports).
* ORT's export calls ``torch.onnx.export`` with ``dynamo=False`` inside that scope only,
  and on the thread that holds it: another thread's ``torch.onnx.export`` meanwhile keeps
  torch's default.
* The custom symbolics ORT registers (``aten::convolution``, ``cross_entropy_loss``,
  contrib ops...) and bnswap's (:mod:`bnswap.ort._symbolic`) are registered inside the
  scope and the exporter's registry is restored on exit, so a later
  ``torch.onnx.export`` elsewhere in the process exports as before.
* ORT replaces ``torch.manual_seed``, ``torch.cuda.manual_seed`` and
  ``torch.utils.checkpoint.checkpoint`` at import; the originals are put back (ORT's
  RNG is seeded from torch's when a model is wrapped instead).
* Buffers are restored after ORT's export, whose tracing forward runs on the real
  module (it would otherwise apply one extra running-statistics update).

ORT-side fixes (ORT's own modules only):

* ``torch_interop_utils`` (custom ``autograd.Function`` support) does not compile
  against torch >= 2.13: custom-function support is off
  (``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0`` during import) and a stub module satisfies the
  unconditional import; using it raises.
* ``aten_op_executor`` is built by :mod:`bnswap.ort._build` into a user cache and made
  importable as ``onnxruntime.training.ortmodule.torch_cpp_extensions.aten_op_executor``;
  ORT's "extensions not installed" init error (a glob of its own folder) is cleared.
* NVTX range calls (``onnxruntime.training.utils.torch_profile_utils``) raise on CPU
  builds of torch: they become no-ops when CUDA is not available.
* ORT hides its exporter's output by redirecting the stdout / stderr file descriptors;
  where ``sys.stdout`` has none (Jupyter, IDLE, doctest) that failed every export: there
  the streams are left alone.
* ``GraphExecutionManager._get_session_config`` calls a per-manager hook
  (``_bnswap_session_hook``) so bnswap can set session options and record the graph
  the session runs (:func:`bnswap.ort.executed_ops`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bnswap.functional import consolidated_ops_while_tracing
from bnswap.ort._layers import TRACE_BIAS, TRACE_WEIGHT, trace_stand_ins
from bnswap.ort.errors import UnsupportedVersionError

logger = logging.getLogger("bnswap.ort")

TESTED_ORT = ("1.19.2",)
MIN_TORCH = (2, 13)
OVERRIDE_ENV = "BNSWAP_ORT_ALLOW_UNTESTED"

_TSE = "torch.onnx._internal.torchscript_exporter"
_ORTM = "onnxruntime.training.ortmodule"
_EXT_PKG = _ORTM + ".torch_cpp_extensions"

_lock = threading.RLock()
#: Modules wrapped by :func:`bnswap.ort.wrap`: only their exports get bnswap's symbolics.
BNSWAP_MODULES: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_applied = False
_scope_depth = 0


# ---------------------------------------------------------------------------- versions
def _torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def check_versions() -> None:
    """Raise :class:`UnsupportedVersionError` unless ORT and torch are tested versions.

    Tested: onnxruntime-training :data:`TESTED_ORT` with torch >= :data:`MIN_TORCH`
    (the ``torch.onnx._internal.torchscript_exporter`` layout). ``BNSWAP_ORT_ALLOW_UNTESTED=1``
    turns the error into a warning.
    """
    import onnxruntime

    problems = []
    if onnxruntime.__version__ not in TESTED_ORT:
        problems.append(f"onnxruntime {onnxruntime.__version__} (tested: {', '.join(TESTED_ORT)})")
    if _torch_version() < MIN_TORCH or importlib.util.find_spec(_TSE) is None:
        problems.append(
            f"torch {torch.__version__} (tested: >= {'.'.join(map(str, MIN_TORCH))} with "
            f"the {_TSE} layout)"
        )
    if not problems:
        return
    msg = (
        "bnswap's ONNX Runtime compatibility layer was not tested with "
        + " and ".join(problems)
        + f". Set {OVERRIDE_ENV}=1 to try anyway, or install the tested pair: "
        "pip install torch==2.13.0 onnxruntime-training-cpu==1.19.2 && "
        "pip install --no-deps torch-ort==1.19.2"
    )
    if os.environ.get(OVERRIDE_ENV) == "1":
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    else:
        raise UnsupportedVersionError(msg)


# ---------------------------------------------------------------------- scoped aliases
def _alias_modules() -> dict[str, types.ModuleType]:
    beartype = types.ModuleType("torch.onnx._internal._beartype")
    beartype.beartype = lambda fn: fn  # type: ignore[attr-defined]  # removed in torch 2.x
    return {
        "torch.onnx._internal.jit_utils": importlib.import_module(f"{_TSE}.jit_utils"),
        "torch.onnx._type_utils": importlib.import_module(f"{_TSE}._type_utils"),
        "torch.onnx._globals": importlib.import_module(f"{_TSE}._globals"),
        "torch.onnx._internal._beartype": beartype,
    }


def _shim_attrs() -> list[tuple[types.ModuleType, str, Any]]:
    shim9 = importlib.import_module("torch.onnx.symbolic_opset9")
    real9 = importlib.import_module(f"{_TSE}.symbolic_opset9")
    return [(shim9, name, getattr(real9, name)) for name in ("_convolution", "_convolution_mode")]


def _registry() -> Any:
    return importlib.import_module(f"{_TSE}.registration").registry


def _snapshot_registry() -> dict[str, dict[Any, Any]]:
    return {
        name: dict(group._functions._overrides) for name, group in _registry()._registry.items()
    }


def _restore_registry(snap: dict[str, dict[Any, Any]]) -> None:
    reg = _registry()
    for name in list(reg._registry):
        group = reg._registry[name]
        want = snap.get(name)
        if want is None:
            del reg._registry[name]  # a group created inside the scope
            continue
        funcs = group._functions
        for opset in list(funcs._overrides):
            if funcs._overrides[opset] is not want.get(opset):
                funcs.remove_override(opset)
        for opset, fn in want.items():
            if funcs._overrides.get(opset) is not fn:
                funcs.override(opset, fn)


@contextlib.contextmanager
def ort_scope() -> Iterator[None]:
    """Inside: torch's old private ONNX names resolve, ``torch.onnx.export`` defaults to
    the TorchScript exporter (``dynamo=False``) on this thread (other threads keep
    torch's default), and symbolic registrations are undone on exit. Re-entrant; the
    aliases and registrations are process-global while active (hold it briefly)."""
    global _scope_depth
    with _lock:
        _scope_depth += 1
        if _scope_depth > 1:
            try:
                yield
            finally:
                _scope_depth -= 1
            return
        saved_modules = {}
        added = []
        for name, mod in _alias_modules().items():
            if name in sys.modules:
                saved_modules[name] = sys.modules[name]
            sys.modules[name] = mod
            added.append(name)
        saved_attrs = []
        for owner, name, value in _shim_attrs():
            saved_attrs.append((owner, name, owner.__dict__.get(name, _MISSING)))
            setattr(owner, name, value)
        snap = _snapshot_registry()
        real_export = torch.onnx.export
        exporting_thread = threading.get_ident()

        @functools.wraps(real_export)
        def export(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == exporting_thread:  # ORT's export: the TorchScript exporter
                kwargs.setdefault("dynamo", False)
            return real_export(*args, **kwargs)

        torch.onnx.export = export
        try:
            with warnings.catch_warnings():
                _quiet_exporter_warnings()
                yield
        finally:
            torch.onnx.export = real_export
            _restore_registry(snap)
            for owner, name, old in saved_attrs:
                if old is _MISSING:
                    with contextlib.suppress(AttributeError):
                        delattr(owner, name)
                else:
                    setattr(owner, name, old)
            for name in added:
                if name in saved_modules:
                    sys.modules[name] = saved_modules[name]
                else:
                    sys.modules.pop(name, None)
            _scope_depth -= 1


_MISSING = object()


def _quiet_exporter_warnings() -> None:
    # The TorchScript exporter's notes about what ORT's graph does on purpose: in-place
    # buffer updates removed from the trace (ORT writes running stats itself), the
    # traced float momentum, the deprecated dynamo=False path.
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    warnings.filterwarnings("ignore", message=r".*Removing mutation from node.*")
    warnings.filterwarnings("ignore", message=r".*dynamo=False.*")
    warnings.filterwarnings("ignore", message=r".*TorchScript-based ONNX export.*")
    warnings.filterwarnings("ignore", message=r".*DeepSpeed import error.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


# -------------------------------------------------------------------- ORT-side patches
def _unwrap_ort_overrides() -> None:
    """Put back the torch functions ORTModule's ``__init__`` replaced (also when an earlier
    failed ``import onnxruntime.training`` replaced them, possibly more than once)."""

    def original(fn: Callable[..., Any], holder: str) -> Callable[..., Any]:
        seen = 0
        while (getattr(fn, "__module__", "") or "").startswith("onnxruntime") and seen < 8:
            seen += 1
            if holder in getattr(fn, "__globals__", {}) and fn.__name__.startswith("override_"):
                fn = fn.__globals__[holder]
            elif fn.__code__.co_freevars and "original_checkpoint" in fn.__code__.co_freevars:
                idx = fn.__code__.co_freevars.index("original_checkpoint")
                closure = fn.__closure__
                assert closure is not None  # it has free variables
                fn = closure[idx].cell_contents
            else:
                break
        return fn

    torch.manual_seed = original(torch.manual_seed, "torch_manual_seed")
    torch.cuda.manual_seed = original(torch.cuda.manual_seed, "torch_cuda_manual_seed")
    import torch.utils.checkpoint as ckpt

    ckpt.checkpoint = original(ckpt.checkpoint, "")


def _nvtx_noop() -> None:
    from onnxruntime.training.utils import torch_profile_utils as tpu

    if torch.cuda.is_available():
        return

    def torch_nvtx_range_push(msg: str) -> None:  # same signature as ORT's
        return None

    def torch_nvtx_range_pop() -> None:
        return None

    tpu.torch_nvtx_range_push = torch_nvtx_range_push
    tpu.torch_nvtx_range_pop = torch_nvtx_range_pop
    utils: Any = sys.modules.get("onnxruntime.training.utils")
    if utils is not None:
        utils.torch_nvtx_range_push = torch_nvtx_range_push
        utils.torch_nvtx_range_pop = torch_nvtx_range_pop


class _InteropUnavailable(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(
            "ORT's torch_interop_utils extension (custom torch.autograd.Function support) "
            "does not build against torch >= 2.13; bnswap runs ORTModule with custom "
            "autograd functions off (ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0)."
        )


def _load_extension() -> None:
    from bnswap.ort import _build

    path = _build.ensure_extension()
    name = f"{_EXT_PKG}.{_build.EXTENSION}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod


@contextlib.contextmanager
def scoped_env(name: str, value: str) -> Iterator[None]:
    """Set environment variable ``name`` to ``value`` inside the block (ORT reads some
    settings from the environment), then restore it exactly (unset if it was)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _import_ortmodule() -> types.ModuleType:
    interop = f"{_EXT_PKG}.torch_interop_utils"
    if interop not in sys.modules:
        sys.modules[interop] = _InteropUnavailable(interop)
    try:
        with scoped_env("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "0"), ort_scope():
            _nvtx_noop()
            ortmodule = importlib.import_module(_ORTM)
            # Imported lazily by ORT's options; its import-time enable reads the env var.
            importlib.import_module(f"{_ORTM}._custom_autograd_function")
    finally:
        _unwrap_ort_overrides()
    _nvtx_noop()  # utils may have been imported fresh above
    return ortmodule


def _patch_export(ortmodule: types.ModuleType) -> None:
    from onnxruntime.tools import pytorch_export_contrib_ops

    from bnswap.ort import _symbolic

    gtm = importlib.import_module(f"{_ORTM}._graph_transition_manager")
    cls = gtm.GraphTransitionManager
    original = cls.__dict__["_get_exported_model"].__func__

    @functools.wraps(original)
    def _get_exported_model(flattened_module: Any, *args: Any, **kwargs: Any) -> Any:
        opset = kwargs.get("onnx_opset_version", ortmodule.ONNX_OPSET_VERSION)
        if len(args) >= 7:
            opset = args[6]
        # The exporter's tracing forward runs on the real module (running-stat updates,
        # num_batches_tracked) and its train/eval switch resets every submodule's flag.
        state = [(b, b.detach().clone()) for b in flattened_module.buffers()]
        modes = [(m, m.training) for m in flattened_module.modules()]
        original_module = getattr(flattened_module, "_original_module", None)
        trace_bufs: list[tuple[torch.nn.Module, str]] = []
        try:
            with ort_scope():
                pytorch_export_contrib_ops.register()
                importlib.import_module(
                    f"{_ORTM}._custom_op_symbolic_registry"
                ).CustomOpSymbolicRegistry.register_all(opset)
                ours = original_module is not None and original_module in BNSWAP_MODULES
                if ours:
                    _symbolic.register(opset)
                    # The exporter makes graph inputs of state_dict entries only; a
                    # non-persistent buffer would be traced as a constant again.
                    trace_bufs = [
                        (m, name)
                        for m in flattened_module.modules()
                        for name in (TRACE_WEIGHT, TRACE_BIAS)
                        if name in m._buffers and name in m._non_persistent_buffers_set
                    ]
                    for m, name in trace_bufs:
                        m._non_persistent_buffers_set.discard(name)
                if ours:
                    # The exporter's select_model_mode_for_export calls train() / eval()
                    # on the whole module; the trace must see each module's own mode (a
                    # frozen BatchNorm in a training model, a train-mode one in an eval
                    # model): put every flag back just before the traced forward.
                    def keep_modes(_module: torch.nn.Module, _inputs: tuple[Any, ...]) -> None:
                        for m, training in modes:
                            m.training = training

                    handle = flattened_module.register_forward_pre_hook(keep_modes)
                    # bnswap layers trace to the consolidated ops that the symbolics
                    # above export (elsewhere they trace to stock's aten::batch_norm),
                    # affine=False ones on their per-layer trace buffers
                    try:
                        with consolidated_ops_while_tracing(stand_ins=trace_stand_ins):
                            result = original(flattened_module, *args, **kwargs)
                    finally:
                        handle.remove()
                else:
                    result = original(flattened_module, *args, **kwargs)
                if ours:
                    _symbolic.keep_running_stat_aliases(result[0])
                return result
        finally:
            for m, name in trace_bufs:
                m._non_persistent_buffers_set.add(name)
            with torch.no_grad():
                for buf, saved in state:
                    buf.copy_(saved)
            for m, training in modes:
                m.training = training

    cls._get_exported_model = staticmethod(_get_exported_model)

    # GraphExecutionManager.__getstate__ deletes _torch_alloc / _torch_free /
    # _torch_empty_cache, which exist only with a CUDA torch allocator: copy.deepcopy,
    # pickle and torch.save of any ORTModule on a CPU machine raised KeyError.
    gem = importlib.import_module(f"{_ORTM}._graph_execution_manager").GraphExecutionManager
    original_getstate = gem.__getstate__

    @functools.wraps(original_getstate)
    def __getstate__(self: Any) -> Any:
        missing = [
            k
            for k in ("_torch_alloc", "_torch_free", "_torch_empty_cache")
            if k not in self.__dict__
        ]
        for k in missing:
            self.__dict__[k] = None
        try:
            return original_getstate(self)
        finally:
            for k in missing:
                self.__dict__.pop(k, None)

    gem.__getstate__ = __getstate__

    original_cfg = gem._get_session_config

    @functools.wraps(original_cfg)
    def _get_session_config(self: Any) -> Any:
        session_options, providers, provider_options = original_cfg(self)
        hook = getattr(self, "_bnswap_session_hook", None)
        if hook is not None:
            hook(self, session_options)
        return session_options, providers, provider_options

    gem._get_session_config = _get_session_config


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return False
    return True


def _patch_stream_suppression() -> None:
    """ORT's ``_logger._suppress_os_stream_output`` redirects the stdout / stderr file
    descriptors while it exports; where ``sys.stdout`` has none (Jupyter's and IDLE's
    streams, doctest, pytest's ``capsys``) it raised ``TypeError: 'NoneType' object cannot
    be interpreted as an integer`` from its cleanup, and every export failed. There it
    now leaves the streams alone (ORT's messages are then shown, not hidden)."""
    lg: Any = importlib.import_module(f"{_ORTM}._logger")
    original = lg._suppress_os_stream_output
    if getattr(original, "_bnswap_patched", False):
        return

    @functools.wraps(original)
    def _suppress_os_stream_output(enable: bool = True, on_exit: Any = None) -> Any:
        usable = _has_fileno(sys.stdout) and _has_fileno(sys.stderr)
        return original(enable=enable and usable, on_exit=on_exit)

    _suppress_os_stream_output._bnswap_patched = True  # type: ignore[attr-defined]  # its mark
    lg._suppress_os_stream_output = _suppress_os_stream_output


def apply() -> Any:
    """Make ``onnxruntime.training.ortmodule`` usable on this torch; return it (a module
    ORT ships no types for).

    Idempotent and thread-safe. Builds the ``aten_op_executor`` extension on first use
    (:func:`bnswap.ort._build.ensure_extension`).

    Raises:
        UnsupportedVersionError: untested ORT / torch (see :func:`check_versions`).
        BuildError: the extension cannot be built.
        ImportError: ORTModule still fails to import (message names the cause).
    """
    global _applied
    with _lock:
        if _applied:
            return sys.modules[_ORTM]
        check_versions()
        # ORT's ZeRO-offload hooks try to import DeepSpeed on the first forward and warn
        # when it is absent; bnswap never uses ZeRO, so that warning is noise.
        warnings.filterwarnings("ignore", message="DeepSpeed import error", category=UserWarning)
        if _ORTM not in sys.modules:
            # A failed ``import onnxruntime.training`` (its __init__ swallows ORTModule's
            # ImportError) leaves half-initialized submodules behind; start clean.
            for name in [n for n in sys.modules if n.startswith(_ORTM + ".")]:
                if not name.startswith(_EXT_PKG + "."):
                    del sys.modules[name]
        _load_extension()
        ortmodule: Any = _import_ortmodule()
        init_error = ortmodule._FALLBACK_INIT_EXCEPTION
        if init_error is not None and not ortmodule.is_torch_cpp_extensions_installed(
            ortmodule.ORTMODULE_TORCH_CPP_DIR
        ):
            # ORT's own check (a glob of its package folder) failed, as it does whenever
            # the extension lives in bnswap's cache (loaded above): not an error here.
            ortmodule._FALLBACK_INIT_EXCEPTION = None
        elif init_error is not None:
            raise ImportError(f"ORTModule cannot initialize: {init_error}") from init_error
        _patch_export(ortmodule)
        _patch_stream_suppression()
        _applied = True
        logger.debug("bnswap.ort: ORT compatibility layer applied")
        return ortmodule


def lacks_remove_duplicate(ortmodule: types.ModuleType) -> bool:
    """Whether ORTModule's ``named_parameters`` / ``named_buffers`` lack torch's
    ``remove_duplicate`` argument (onnxruntime-training 1.19.2: they do)."""
    cls = ortmodule.ORTModule
    return any(
        "remove_duplicate" not in inspect.signature(getattr(cls, name)).parameters
        for name in ("named_parameters", "named_buffers")
    )


def force_reexport(ortmodule: Any, training: bool) -> None:
    """Make ``ortmodule`` export, build its graph and create its session again on its
    next call in that mode (``training``: the training graph, else the inference one).

    ``GraphTransitionManager.signal_model_changed`` (what ``ORTModule.__setattr__`` uses)
    alone has no effect in onnxruntime-training 1.19.2: by default
    (``ORTMODULE_SKIP_CHECK``: ``SKIP_CHECK_BUILD_GRADIENT | SKIP_CHECK_EXECUTION_AGENT``)
    the managers stop checking for changes after their first call, so the previous
    export info and execution agent are dropped as well, which is what makes them look.
    """
    manager = ortmodule._torch_module._execution_manager(training)
    gtm = manager._graph_transition_manager
    gtm.signal_model_changed()
    gtm._exported_model_info = None
    manager._execution_agent = None
