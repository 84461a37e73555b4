"""bnswap's ONNX Runtime training backend.

``bnswap.convert(model, backend="ort")`` (or :func:`wrap` on a model whose BatchNorm
layers are bnswap layers) returns an ``ORTModule`` (``torch_ort.ORTModule``) wrapping
the model. ONNX Runtime exports it with the TorchScript exporter, builds the gradient
graph and runs every training-mode BatchNorm as ``com.microsoft::BatchNormInternal``
(forward) + ``com.microsoft::BatchNormalizationGrad`` (backward); evaluation-mode
layers run as ONNX ``BatchNormalization`` on the running statistics.
:func:`executed_ops` shows the graph ORT actually runs.

Semantics are eager PyTorch's: outputs and gradients match eager ``nn.BatchNorm``
within float32 rounding, and running_mean / running_var / num_batches_tracked follow
PyTorch's rule (momentum or cumulative average, unbiased variance) step by step
(:mod:`bnswap.ort._stats`). A model wrapped in eval stays in eval.

Works with affine=False and track_running_stats=False layers (any number, any widths),
momentum=None, eval mode, ``torch.no_grad`` training forwards, varying batch sizes, and
under DDP (tested with two gloo processes under Lightning). What the exported graph
depends on (layer flags, ``requires_grad``, module structure, Parameter / buffer
objects, non-tensor forward arguments) is checked on every call, and a change triggers a
new export. ``copy.deepcopy``, pickle and ``torch.save`` of the wrapper work.

Limits (each raises a clear error before any state changes): BatchNorm parameters must
be float32 (ORT's CPU kernels); a layer may run only once per forward; all BatchNorm
layers must share the model's train/eval mode; every BatchNorm layer must be a bnswap
layer. In eval mode ORT runs its inference graph: outputs carry no gradient (warned
once when gradients are enabled).

Speed on the CPU (benchmarks P4): ORT's own batch-norm kernels are faster than ATen's,
but its convolution (MLAS) and ``ReluGrad`` kernels are slower, so whole train steps are
slower than eager for conv/ReLU-heavy nets; see ``benchmarks/README.md``.

Needs onnxruntime-training 1.19.2 (``pip install onnxruntime-training-cpu==1.19.2`` and
``pip install --no-deps torch-ort==1.19.2``) and a C++ compiler once: ORT's
``aten_op_executor`` extension is built into ``$BNSWAP_CACHE_DIR/ort-ext/`` on first use
(or ahead of time with ``python -m bnswap.ort build``). ``import bnswap`` never imports
ONNX Runtime; this package imports it only when :func:`wrap` (or :func:`executed_ops`,
:func:`build`) is called.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import warnings
import weakref
from typing import Any

from torch import nn

logger = logging.getLogger("bnswap.ort")

__all__ = ["INSTALL", "ORTNotAvailableError", "ORTRunError", "build", "executed_ops",
           "is_available", "wrap", "DEFAULT_SESSION_OPTIONS"]

#: The exact install commands for the CPU backend (torch first, pinned).
INSTALL = ("pip install onnxruntime-training-cpu==1.19.2 && "
           "pip install --no-deps torch-ort==1.19.2")

#: ``onnxruntime.SessionOptions`` attributes bnswap sets on every ORT session; override per
#: model with ``wrap(session_options=)``. Empty: ORT's defaults (intra-op threads = all
#: cores, spinning; ORTModule turns memory patterns off), its fastest setting measured
#: here (benchmarks/README.md, "ORT (P4)"): ``enable_mem_pattern`` and no spinning were
#: slower. ``{"intra_op_num_threads": 1}`` helps when other processes load the cores.
#: ``execution_mode=ORT_PARALLEL`` fails in ORT 1.19.2's training session.
DEFAULT_SESSION_OPTIONS: dict[str, Any] = {}


class ORTNotAvailableError(ImportError):
    """onnxruntime-training (with ORTModule) is not installed."""


class ORTRunError(RuntimeError):
    """ONNX Runtime could not export, build or run the model (no silent fallback)."""


def is_available() -> bool:
    """True if onnxruntime-training and torch-ort are installed (nothing is imported)."""
    # find_spec of a submodule would import onnxruntime, whose __init__ imports ORTModule
    # (which patches torch); only top-level specs and the file system are consulted.
    try:
        ort = importlib.util.find_spec("onnxruntime")
        if ort is None or importlib.util.find_spec("torch_ort") is None:
            return False
        return any(os.path.isfile(os.path.join(p, "training", "ortmodule", "__init__.py"))
                   for p in (ort.submodule_search_locations or []))
    except (ImportError, ValueError):
        return False


def _require() -> Any:
    if not is_available():
        raise ORTNotAvailableError(
            "bnswap's ORT backend needs ONNX Runtime training and torch-ort. Install them "
            f"with: {INSTALL}   (or: pip install 'bnswap[ort-cpu]' && "
            "pip install --no-deps torch-ort==1.19.2). Never install plain `onnxruntime` "
            "in the same environment: it replaces the training build.")
    from bnswap.ort import _compat

    return _compat.apply()


def build(*, force: bool = False) -> str:
    """Build ORT's ``aten_op_executor`` extension into the cache (once); return its path.

    Raises:
        ORTNotAvailableError: ORT training is not installed.
        bnswap.ort._build.BuildError: no C++ compiler, or the compile failed.
    """
    if not is_available():
        _require()
    from bnswap.ort import _build

    return str(_build.ensure_extension(force=force))


# ------------------------------------------------------------------------- wrapper
_cls_lock = threading.Lock()
_cls: type | None = None


def _bn_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    from torch.nn.modules.batchnorm import _BatchNorm

    return [(n, m) for n, m in module.named_modules() if isinstance(m, _BatchNorm)]


def _check_layers(module: nn.Module) -> None:
    """Convert-time checks of what ORT can run (raise before anything is built)."""
    import torch

    from bnswap import is_swapped

    for name, m in _bn_layers(module):
        label = name or type(m).__name__
        if not is_swapped(m):
            raise TypeError(
                f"bnswap.ort.wrap: BatchNorm layer {label!r} ({type(m).__name__}) is not a "
                "bnswap layer (SyncBatchNorm, an excluded layer, a subclass without an "
                "adapter, a layer added after wrapping, or a model reverted while wrapped). "
                "ORT would export it with a momentum frozen at trace time and "
                "PyTorch's running statistics would be lost. Convert it, or use "
                "backend='aten'. See bnswap.plan(model, backend='ort').")
        for pname, t in (("weight", m.weight), ("bias", m.bias),
                         ("running_mean", m.running_mean), ("running_var", m.running_var)):
            if t is not None and t.dtype != torch.float32:
                raise TypeError(
                    f"bnswap.ort.wrap: layer {label!r} has {pname} of dtype {t.dtype}; ONNX "
                    "Runtime's CPU BatchNormInternal kernel is float32 only. Use float32 "
                    "parameters, or backend='aten'.")
            if t is not None and t.device.type != "cpu" and t.device.type != "cuda":
                raise TypeError(f"bnswap.ort.wrap: layer {label!r} is on {t.device}; "
                                "ORTModule runs on CPU or CUDA.")


def _trace_constants(module: nn.Module, add: bool) -> None:
    """Register (``add``) or remove each affine=False layer's per-layer ones / zeros
    buffers (:data:`bnswap.functional.TRACE_WEIGHT` / ``TRACE_BIAS``, non-persistent).

    Traced as constants, the ones / zeros of two affine=False layers of the same width
    are one value; ORT 1.19.2's pre-gradient optimizations merge them, and its gradient
    builder then emits the merged tensor's gradient once per BatchNormalizationGrad
    ("Duplicate definition of name ..._grad"). Buffers are graph inputs, one per layer,
    which ORT never merges; ORTModule feeds them by name.
    """
    import torch

    from bnswap.functional import TRACE_BIAS, TRACE_WEIGHT, drop_trace_buffers

    for _, m in _bn_layers(module):
        if m.affine:
            continue
        if not add:
            drop_trace_buffers(m)
            continue
        if TRACE_WEIGHT in m._buffers and TRACE_BIAS in m._buffers:
            continue
        like = next((t for t in (m.running_mean, m.running_var) if t is not None), None)
        device = like.device if like is not None else torch.device("cpu")
        c = int(m.num_features)
        m.register_buffer(TRACE_WEIGHT, torch.ones(c, device=device), persistent=False)
        m.register_buffer(TRACE_BIAS, torch.zeros(c, device=device), persistent=False)


def _wrapper_class(ortmodule_pkg: Any) -> type:
    global _cls
    with _cls_lock:
        if _cls is not None:
            return _cls
        import torch
        from torch.utils import _pytree as pytree

        from torch.nn.modules.batchnorm import _BatchNorm

        from bnswap.ort import _compat
        from bnswap.ort._stats import RunningStats, StatsNotWrittenError, detach_tree, leaf_key

        ORTModule = ortmodule_pkg.ORTModule

        class BNSwapORTModule(ORTModule):
            """``ORTModule`` with PyTorch's BatchNorm running-statistics semantics.

            Made by :func:`bnswap.ort.wrap`. ``module`` is the wrapped model (its
            BatchNorm layers are bnswap layers); ``state_dict`` keys, parameters and
            buffers are the model's own (ORT trains them in place).
            """

            def __init__(self, module: nn.Module, *, fallback: str | None,
                         session_options: dict[str, Any], debug_options: Any = None):
                with _compat.scoped_env("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE"), \
                        _compat.ort_scope():
                    super().__init__(module, debug_options)
                d = self.__dict__
                d["_bnswap_inner"] = module
                d["_bnswap_stats"] = RunningStats(module)
                d["_bnswap_fallback"] = fallback
                d["_bnswap_eager"] = False
                d["_bnswap_session_options"] = dict(session_options)
                self._bnswap_install()

            def _bnswap_install(self) -> None:
                """Per-object runtime state, on creation and on unpickling / deepcopy
                (which never carry it): our symbolics for this model's export, a private
                folder for ORT's optimized graphs, and the forward / session hooks."""
                d = self.__dict__
                _compat.BNSWAP_MODULES.add(d["_bnswap_inner"])
                d["_bnswap_graph_files"] = {}
                d["_bnswap_ops"] = {}
                tmp = tempfile.mkdtemp(prefix="bnswap-ort-")
                d["_bnswap_tmp"] = tmp
                weakref.finalize(self, shutil.rmtree, tmp, True)
                d["_bnswap_ort_forward"] = d["forward"]
                d["forward"] = self._bnswap_forward
                for training in (True, False):
                    mgr = self._torch_module._execution_manager(training)
                    mgr._bnswap_session_hook = self._bnswap_session_hook

            def _bnswap_session_hook(self, manager: Any, so: Any) -> None:
                mode = "training" if manager._export_mode == torch.onnx.TrainingMode.TRAINING \
                    else "inference"
                path = os.path.join(self._bnswap_tmp, f"{mode}.onnx")
                so.optimized_model_filepath = path
                self._bnswap_graph_files[mode] = path
                if mode == "training":  # new session: verify its in-place writes next step
                    self.__dict__["_bnswap_verify"] = True
                    self.__dict__["_bnswap_verify_pending"] = True
                self._bnswap_ops.pop(mode, None)
                for key, value in self._bnswap_session_options.items():
                    if key.startswith("config:"):
                        so.add_session_config_entry(key[len("config:"):], str(value))
                    else:
                        setattr(so, key, value)

            def _bnswap_forward(self, *args: Any, **kwargs: Any) -> Any:
                module = self._bnswap_inner
                if self._bnswap_eager:
                    return module(*args, **kwargs)
                self._bnswap_sync_mode(module.training)
                mods = list(module.named_modules())  # the one walk of the model per call
                layers = [(n, m) for n, m in mods if isinstance(m, _BatchNorm)]
                if module.training:
                    for name, m in layers:
                        if not m.training:
                            raise ORTRunError(
                                f"bnswap.ort: BatchNorm layer {name!r} is in eval mode while "
                                "the model trains; ORT exports the whole model in one mode, so "
                                "frozen (eval-mode) BatchNorm layers inside a training model "
                                "need backend='aten' (bnswap.convert(model)).")
                else:
                    for name, m in layers:
                        if m.training:
                            raise ORTRunError(
                                f"bnswap.ort: BatchNorm layer {name!r} is in train mode while "
                                "the model is in eval; ORT exports the whole model in one mode "
                                "(its inference graph would neither use batch statistics nor "
                                "update running ones). Statistics recalibration (AdaBN, "
                                "swa_utils.update_bn on an eval model) needs backend='aten', "
                                "or put the whole model in train mode.")
                self._bnswap_check_export(mods, layers, args, kwargs, module.training)
                if not module.training and torch.is_grad_enabled() and \
                        not self.__dict__.get("_bnswap_warned_eval_grad") and \
                        any(p.requires_grad for p in module.parameters()):
                    self.__dict__["_bnswap_warned_eval_grad"] = True
                    warnings.warn(
                        "bnswap.ort: the model is in eval mode with gradients enabled; ORT runs "
                        "its inference graph, whose outputs carry no gradient (eager's would). "
                        "Evaluate under torch.no_grad(), or use backend='aten' to backpropagate "
                        "through an eval-mode model.", UserWarning, stacklevel=4)
                if module.training:
                    stats = self._bnswap_stats
                    grad = torch.is_grad_enabled()

                    def run() -> Any:
                        if grad:
                            # ORT 1.19.2's backward can reuse the memory of forward outputs
                            # it handed to torch (a returned ReLU activation was found
                            # overwritten with gradient values after backward, with stock
                            # BN under raw ORTModule too): return copies.
                            return pytree.tree_map_only(
                                torch.Tensor, torch.Tensor.clone, self._bnswap_call(args, kwargs))
                        # Eager BN in training mode normalizes with batch statistics and
                        # updates them also under no_grad; ORT would pick its inference
                        # graph (running statistics): run the training graph instead.
                        with torch.enable_grad():
                            return detach_tree(self._bnswap_call(args, kwargs))

                    verify = self.__dict__.get("_bnswap_verify", True)
                    try:
                        out = stats.step(args, kwargs, run, verify=verify, layers=layers,
                                         eager=lambda: module(*args, **kwargs))
                    except ORTRunError as err:
                        return self._bnswap_maybe_fallback(err, args, kwargs)
                    except StatsNotWrittenError as err:
                        return self._bnswap_maybe_fallback(ORTRunError(str(err)), args, kwargs)
                    if stats.verified and self.__dict__.get("_bnswap_verify_pending") is None:
                        self.__dict__["_bnswap_verify"] = False
                    self.__dict__.pop("_bnswap_verify_pending", None)
                    return out
                try:
                    return self._bnswap_call(args, kwargs)
                except ORTRunError as err:
                    return self._bnswap_maybe_fallback(err, args, kwargs)

            def _bnswap_check_export(self, mods: list, layers: list, args: tuple,
                                     kwargs: dict, training: bool) -> None:
                """Re-export when something the exported graph baked in has changed.

                The graph fixes the module structure, the Parameter and buffer tensors
                it is fed, each BatchNorm layer's ``track_running_stats`` and ``eps``
                (Lightning's ``BaseFinetuning`` flips ``track_running_stats`` when it
                freezes / unfreezes), the values of non-tensor forward arguments, and, in
                training, which inputs and parameters require grad. ORT 1.19.2 checks
                none of this after its first call (its default ``ORTMODULE_SKIP_CHECK``):
                it kept writing the statistics of a layer that stopped tracking them,
                returned no gradient for an input that started requiring one, ran an
                old classifier head after the user replaced it, ignored a changed
                ``forward(x, flag=...)`` argument. When the key changes bnswap re-checks
                the layers (as :func:`wrap` does) and makes ORT export again
                (:func:`bnswap.ort._compat.force_reexport`).
                """
                module = self._bnswap_inner
                keys = self.__dict__.setdefault("_bnswap_export_keys", {})
                old = keys.get(training)
                key = self._bnswap_export_key(mods, layers, args, kwargs, training)
                if old is None or old == key:
                    keys[training] = key
                    return
                # Something the graph baked in changed. A replaced or added submodule must
                # pass wrap's checks (a stock BatchNorm would be exported with a frozen
                # momentum); a new affine=False layer needs its trace buffers.
                _check_layers(module)
                _trace_constants(module, add=True)
                self._bnswap_stats.invalidate()
                keys.clear()  # the other mode's graph is stale too
                mods = list(module.named_modules())
                keys[training] = self._bnswap_export_key(
                    mods, [(n, m) for n, m in mods if isinstance(m, _BatchNorm)], args, kwargs,
                    training)
                logger.info("bnswap.ort: the model or its inputs changed in a way the exported "
                            "graph depends on; ONNX Runtime exports again")
                for mode in (True, False):
                    _compat.force_reexport(self, mode)

            @staticmethod
            def _bnswap_export_key(mods: list, layers: list, args: tuple, kwargs: dict,
                                   training: bool) -> tuple:
                """What the exported graph depends on, from one pass over ``mods`` (the
                model's ``named_modules()``): its structure, the identity of every
                Parameter / buffer slot (ORT feeds the tensors it found at export; a
                replaced one would be ignored), each BatchNorm's flags, the non-tensor
                arguments (graph constants) and, in training, ``requires_grad``."""
                structure, tensors, grads = [], [], []
                for n, m in mods:
                    # the forward a layer runs too: bnswap swaps it per instance
                    structure.append((n, type(m), m.__dict__.get("forward")))
                    for p in m._parameters.values():
                        tensors.append(id(p))
                        grads.append(p is not None and p.requires_grad)
                    tensors.extend(id(b) for b in m._buffers.values())
                leaves, spec = pytree.tree_flatten((args, kwargs))
                key: tuple = (
                    tuple(structure), tuple(tensors),
                    tuple((m.track_running_stats, float(m.eps)) for _, m in layers),
                    str(spec),
                    tuple(None if isinstance(x, torch.Tensor) else leaf_key(x) for x in leaves),
                )
                if training:
                    key += (tuple(t.requires_grad for t in leaves if isinstance(t, torch.Tensor)),
                            tuple(grads))
                return key

            def _bnswap_sync_mode(self, training: bool) -> None:
                """Make ORT's mode follow the wrapped model's ``training`` flag.

                ORT picks its training or inference graph from the hidden
                ``_torch_module._flattened_module.training``, which only
                ``ORTModule.train()`` / ``eval()`` update. Code that sets ``.training``
                on every module of ``named_modules()`` instead (Lightning 2.x restores
                the train mode after validation that way, ``_ModuleMode.restore``)
                never reaches it nor the ORTModule itself (``named_modules`` yields the
                wrapped model's modules), so ORT kept running its inference graph in a
                training step. The wrapped model's own flag is the one bnswap reads.
                """
                if self.__dict__.get("training") is not training:
                    self.__dict__["training"] = training
                flat = getattr(self._torch_module, "_flattened_module", None)
                if flat is not None and flat.training is not training:
                    flat.training = training  # its only child is the wrapped model

            def _bnswap_call(self, args: tuple, kwargs: dict) -> Any:
                try:
                    return self._bnswap_ort_forward(*args, **kwargs)
                except Exception as err:
                    if type(err).__module__.startswith("onnxruntime") or \
                            "ORTModule" in type(err).__name__ or "onnxruntime" in str(err):
                        raise ORTRunError(
                            "ONNX Runtime could not run this model (no fallback: pass "
                            f"fallback='aten' to run it eagerly instead): {err}") from err
                    raise

            def _bnswap_maybe_fallback(self, err: Exception, args: tuple, kwargs: dict) -> Any:
                if self._bnswap_fallback != "aten":
                    raise err
                warnings.warn(
                    "bnswap.ort: ONNX Runtime cannot run this model; falling back to the "
                    f"eager 'aten' backend (fallback='aten'). Cause: {err.__cause__ or err}",
                    RuntimeWarning, stacklevel=3)
                self.__dict__["_bnswap_eager"] = True
                return self._bnswap_inner(*args, **kwargs)

            def __getstate__(self) -> dict:
                state = super().__getstate__()
                for key in ("_bnswap_tmp", "_bnswap_graph_files", "_bnswap_ops",
                            "_bnswap_export_keys"):
                    state.pop(key, None)
                # Bound methods are rebuilt by __setstate__. The keys stay (as None): ORT's
                # __setstate__ assigns self.forward, and ORTModule.__setattr__ forwards a
                # name that is not in __dict__ to the wrapped model.
                state["forward"] = state["_bnswap_ort_forward"] = None
                return state

            def __setstate__(self, state: dict) -> None:
                # copy.deepcopy / pickle / torch.save: ORT rebuilds its managers; the
                # copy exports and verifies afresh on its first call.
                with _compat.ort_scope():
                    super().__setstate__(state)
                self.__dict__["_bnswap_verify"] = True
                self._bnswap_install()

        # Importable as bnswap.ort.BNSwapORTModule (module __getattr__), so pickle and
        # torch.save find the class.
        BNSwapORTModule.__module__ = __name__
        BNSwapORTModule.__qualname__ = "BNSwapORTModule"
        _cls = BNSwapORTModule
        return _cls


def __getattr__(name: str) -> Any:
    if name == "BNSwapORTModule":  # built on first use: it subclasses ORT's ORTModule
        return _wrapper_class(_require())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def wrap(module: nn.Module, *, fallback: str | None = None,
         session_options: dict[str, Any] | None = None, debug_options: Any = None) -> nn.Module:
    """Wrap ``module`` in ONNX Runtime's ``ORTModule`` with bnswap's BatchNorm semantics.

    ``module``'s BatchNorm layers must already be bnswap layers (``bnswap.convert(model,
    backend="ort")`` swaps them, then calls this). The model is not copied: ORT trains its
    Parameters and buffers in place, so optimizers, ``state_dict`` and checkpoints keep
    working. Its train/eval mode is kept.

    Args:
        module: an ``nn.Module`` (not a LightningModule: wrap its children) with float32
            BatchNorm parameters on CPU (or CUDA with a CUDA ORT build).
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
        ORTNotAvailableError: ORT training / torch-ort not installed (names the command).
        TypeError: ``module`` is not an ``nn.Module``, a BatchNorm layer is not a bnswap
            layer, or its parameters are not float32.
        ValueError: unknown ``fallback``.
        ORTRunError: ORT cannot build the wrapper (``fallback=None``).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"bnswap.ort.wrap expects an nn.Module, got {type(module).__name__}")
    if fallback not in (None, "aten"):
        raise ValueError(f"fallback must be None or 'aten', got {fallback!r}")
    if type(module).__module__.startswith(("lightning", "pytorch_lightning")) or any(
            c.__module__.startswith(("lightning.pytorch", "pytorch_lightning"))
            for c in type(module).__mro__[1:]):
        raise TypeError("ORTModule cannot wrap a LightningModule: wrap its child modules "
                        "(bnswap.BNSwap(backend='ort') does this).")
    _check_layers(module)
    _trace_constants(module, add=True)
    try:
        ortmodule_pkg = _require()
        cls = _wrapper_class(ortmodule_pkg)
        if debug_options is None:
            from onnxruntime.training.ortmodule import DebugOptions, LogLevel

            debug_options = DebugOptions(log_level=LogLevel.INFO if logger.isEnabledFor(
                logging.INFO) else LogLevel.ERROR)
        opts = dict(DEFAULT_SESSION_OPTIONS)
        opts.update(session_options or {})
        import onnxruntime

        onnxruntime.set_seed(int(__import__("torch").initial_seed() % sys.maxsize))
        return cls(module, fallback=fallback, session_options=opts, debug_options=debug_options)
    except BaseException as err:
        _trace_constants(module, add=False)
        if not isinstance(err, Exception) or isinstance(err, ORTNotAvailableError):
            raise
        if fallback == "aten":
            warnings.warn(f"bnswap.ort: ONNX Runtime unavailable ({err}); using the eager "
                          "'aten' backend (fallback='aten').", RuntimeWarning, stacklevel=2)
            return module
        if isinstance(err, (TypeError, ValueError)):
            raise
        raise ORTRunError(f"bnswap.ort: could not set up ONNX Runtime: {err}") from err


def executed_ops(model: nn.Module, training: bool | None = None) -> collections.Counter:
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
        RuntimeError: no ORT session exists yet for that mode (run a forward first).
    """
    files = model.__dict__.get("_bnswap_graph_files") if isinstance(model, nn.Module) else None
    if files is None:
        raise TypeError("executed_ops expects a model returned by bnswap.ort.wrap / "
                        "bnswap.convert(..., backend='ort')")
    if training is None:
        training = model.training
    mode = "training" if training else "inference"
    cache = model.__dict__["_bnswap_ops"]
    if mode not in cache:
        path = files.get(mode)
        if path is None or not os.path.isfile(path):
            raise RuntimeError(f"ONNX Runtime has not built its {mode} session for this model "
                               "yet: run a forward in that mode first.")
        import onnx

        model = onnx.load(path, load_external_data=False)
        counter: collections.Counter = collections.Counter(n.op_type for n in model.graph.node)
        for fn in model.functions:
            counter.update(n.op_type for n in fn.node)
        cache[mode] = counter
    return collections.Counter(cache[mode])
