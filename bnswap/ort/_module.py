"""``BNSwapORTModule``: ONNX Runtime's ``ORTModule`` with PyTorch's BatchNorm semantics.

Importing this module imports ONNX Runtime training (through
:func:`bnswap.ort._compat.apply`); :mod:`bnswap.ort` imports it only when a model is
wrapped. Everything bnswap keeps on a wrapper lives in one :class:`WrapperState`, in
the wrapper's ``__dict__`` under :data:`bnswap._swap.WRAPPER_STATE` (``"_bnswap"``).

A forward, in named steps (:meth:`BNSwapORTModule._bnswap_forward`):

1. :func:`graph_mode` and :meth:`~BNSwapORTModule._bnswap_sync_mode`: ORT runs its
   training graph when the wrapped model or any of its BatchNorm layers is in train
   mode (each module keeps its own mode inside the graph: a frozen layer normalizes
   with its running statistics), else its inference graph;
2. :meth:`~BNSwapORTModule._bnswap_check_export`: re-export when what the graph baked in
   changed (each module's train/eval flag included);
3. :meth:`~BNSwapORTModule._bnswap_train_step` (running statistics by PyTorch's rule,
   :mod:`bnswap.ort._stats`) or :meth:`~BNSwapORTModule._bnswap_eval_step`.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from bnswap import _log
from bnswap._swap import SWAP, WRAPPER_STATE, adapter_of, swap
from bnswap.ort import _compat, _original
from bnswap.ort._layers import check_layers, trace_constants
from bnswap.ort._logs import ort_log_level, quiet_ort_notices
from bnswap.ort._stats import RunningStats, detach_tree, leaf_key
from bnswap.ort.errors import ORTRunError

__all__ = ["BNSwapORTModule", "Verification", "WrapperState", "graph_mode"]

logger = logging.getLogger("bnswap.ort")

_ortmodule = _compat.apply()
_ORTModule: Any = _ortmodule.ORTModule  # (ORT ships no types)
_NAMED_LACK_REMOVE_DUPLICATE = _compat.lacks_remove_duplicate(_ortmodule)
_fallback_exceptions = __import__(
    "onnxruntime.training.ortmodule._fallback_exceptions", fromlist=["_"]
)


class Verification(enum.Enum):
    """Whether the next training step checks that ORT wrote the batch statistics into
    the running_mean buffers (:meth:`bnswap.ort._stats.RunningStats.step`)."""

    NEXT_STEP = "next step"  # a new training session: its in-place writes are unproven
    DONE = "done"


@dataclass
class WrapperState:
    """Everything bnswap keeps on one wrapper.

    ``model``, ``fallback``, ``session_options``, ``eager`` and ``stats`` survive
    pickling; the rest is per object (rebuilt by :meth:`BNSwapORTModule._bnswap_install`).
    """

    model: nn.Module
    fallback: str | None
    session_options: dict[str, Any]
    stats: RunningStats
    eager: bool = False  # ORT failed with fallback="aten": the model runs eagerly
    verification: Verification = Verification.NEXT_STEP
    warned_eval_grad: bool = False
    export_keys: dict[bool, tuple[Any, ...]] = field(default_factory=dict)
    ort_forward: Callable[..., Any] | None = None
    graph_files: dict[str, str] = field(default_factory=dict)
    ops: dict[str, Any] = field(default_factory=dict)
    tmp: str | None = None
    # wrapper[a:b] of a wrapped container: (index, the slice's children) -> its wrapper
    slices: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    debug_options: Any = None  # ORT's DebugOptions the wrapper was made with

    def __getstate__(self) -> dict[str, Any]:
        keep = ("model", "fallback", "session_options", "stats", "eager")
        state = {k: v for k, v in self.__dict__.items() if k in keep}
        # a whole-model pickle leaves the layers' swap and internal buffers out (bnswap's
        # checkpoints patch, issue 32); a wrapper is bnswap's own object: it puts them
        # back when it is unpickled
        state["adapters"] = {
            name: adapter_of(m)
            for name, m in self.model.named_modules()
            if adapter_of(m) is not None
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        adapters = state.pop("adapters", {})
        self.__init__(**state)  # type: ignore[misc]  # rebuilt in place from its pickle
        modules = dict(self.model.named_modules())
        for name, adapter in adapters.items():
            if modules.get(name) is not None and adapter_of(modules[name]) is None:
                swap(modules[name], adapter)
        if adapters:
            trace_constants(self.model, add=True)


def graph_mode(model_training: bool, layers: Sequence[tuple[str, nn.Module]]) -> bool:
    """Which ORT graph runs: the training graph (forward + backward, batch statistics
    written) when the model or any of its BatchNorm ``layers`` is in train mode, else the
    inference graph. Each module keeps its own mode inside the exported graph
    (:func:`bnswap.ort._compat.apply`'s export keeps every flag), so a frozen
    (eval-mode) BatchNorm in a training model exports as ``aten::batch_norm(training=False)``
    (running statistics, never updated) and a train-mode one in an eval model (AdaBN)
    as ``_batch_norm_with_update``, as eager PyTorch runs them."""
    return model_training or any(m.training for _, m in layers)


def _recorded_elsewhere() -> bool:
    """Whether the call is being recorded for another runtime: ``torch.jit.trace`` /
    the TorchScript ONNX exporter, or ``torch.export`` (strict or not, which
    ``torch.onnx.export(dynamo=True)`` uses) / ``torch.compile``."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()


def _is_ort_error(err: BaseException) -> bool:
    """An error raised by ONNX Runtime itself (by type: ORTModule's fallback exceptions
    and the classes of ORT's own modules, e.g. its C++ ``Fail`` / ``InvalidArgument``)."""
    return isinstance(err, _fallback_exceptions.ORTModuleFallbackException) or type(
        err
    ).__module__.startswith("onnxruntime")


class BNSwapORTModule(_ORTModule):
    """``ORTModule`` with PyTorch's BatchNorm running-statistics semantics.

    Made by :func:`bnswap.ort.wrap`. ``module`` is the wrapped model (its BatchNorm
    layers are swapped); ``state_dict`` keys, parameters and buffers are the model's own
    (ORT trains them in place).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        fallback: str | None,
        session_options: dict[str, Any],
        debug_options: Any = None,
    ):
        # ORTModule.__init__ ends with self.train(module.training), which resets the
        # flag of every submodule (a frozen BatchNorm inside a training model was
        # silently un-frozen): wrapping never changes a flag of the user's model.
        modes = [(m, m.training) for m in module.modules()]
        try:
            with (
                _compat.scoped_env("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE"),
                _compat.ort_scope(),
            ):
                super().__init__(module, debug_options)
        finally:
            for m, training in modes:
                m.training = training
        self.__dict__[WRAPPER_STATE] = WrapperState(
            model=module,
            fallback=fallback,
            session_options=dict(session_options),
            stats=RunningStats(module),
            debug_options=debug_options,
        )
        self._bnswap_install()

    def _bnswap_state(self) -> WrapperState:
        """The wrapper's :class:`WrapperState` (a method, not a property: ORT's
        ``ORTModule.__init__`` reads every member before the state exists)."""
        state: WrapperState = self.__dict__[WRAPPER_STATE]
        return state

    # ------------------------------------------------------------------ setup
    def _bnswap_install(self) -> None:
        """Per-object runtime state, on creation and on unpickling / deepcopy (which
        never carry it): our symbolics for this model's export, a private folder for
        ORT's optimized graphs, the forward / session hooks, and the filter that keeps ORT's
        notices off this ORTModule's logger."""
        state = self._bnswap_state()
        # ORT's notices off the logger this ORTModule logs to (orttraining.rank-<r> under
        # DDP; an unpickled copy gets that logger by name, without the filter)
        quiet_ort_notices(self._logger)
        _compat.BNSWAP_MODULES.add(state.model)
        _original.register(state.model, self)  # calling the model directly warns once
        state.tmp = tempfile.mkdtemp(prefix="bnswap-ort-")
        weakref.finalize(self, shutil.rmtree, state.tmp, True)
        state.ort_forward = self.__dict__["forward"]
        self.__dict__["forward"] = self._bnswap_forward
        for training in (True, False):
            mgr = self._torch_module._execution_manager(training)
            mgr._bnswap_session_hook = self._bnswap_session_hook

    def _bnswap_session_hook(self, manager: Any, so: Any) -> None:
        """Called by ORT (patched ``_get_session_config``) for each new session: set
        bnswap's session options and record the graph file the session runs."""
        state = self._bnswap_state()
        mode = (
            "training" if manager._export_mode == torch.onnx.TrainingMode.TRAINING else "inference"
        )
        path = os.path.join(state.tmp or tempfile.gettempdir(), f"{mode}.onnx")
        so.optimized_model_filepath = path
        # ORT's C++ logger: 0 verbose, 1 info, 2 warning, 3 error. At bnswap's default
        # (WARNING) it would warn at every new session about the optimized graph saved
        # just above for executed_ops: one level up.
        so.log_severity_level = {"VERBOSE": 0, "INFO": 1, "WARNING": 3, "ERROR": 3}[ort_log_level()]
        state.graph_files[mode] = path
        if mode == "training":  # a new session: verify its in-place writes
            state.verification = Verification.NEXT_STEP
        state.ops.pop(mode, None)
        for key, value in state.session_options.items():
            if key.startswith("config:"):
                so.add_session_config_entry(key[len("config:") :], str(value))
            else:
                setattr(so, key, value)

    # ------------------------------------------------------ torch.nn.Module API
    if _NAMED_LACK_REMOVE_DUPLICATE:
        # ORT 1.19.2's ORTModule.named_parameters / named_buffers take (prefix, recurse)
        # only; torch.export.export (and torch.onnx.export(dynamo=True), which uses it)
        # call them with remove_duplicate=False: TypeError. The wrapped model's own
        # methods, with torch's signature (same names as ORT's: no wrapper prefix).
        def named_parameters(
            self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
        ) -> Iterator[tuple[str, nn.Parameter]]:
            yield from self.module.named_parameters(
                prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate
            )

        def named_buffers(
            self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
        ) -> Iterator[tuple[str, torch.Tensor]]:
            yield from self.module.named_buffers(
                prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate
            )

    # -------------------------------------------------------------- containers
    # A wrapped container (nn.Sequential, ModuleList, ModuleDict) keeps its container
    # behaviour through the wrapper: ``len``, iteration, ``in``, indexing return the
    # user's own modules (attribute access already reaches them: ORTModule.__getattr__).
    # A slice holding BatchNorm layers (the feature / head split, ``net[:-1](x)``) is a
    # new container each time; it runs on ONNX Runtime through a wrapper made once per
    # (index, children) and kept on this wrapper; a slice without BatchNorm is returned
    # as it is (eager, as BNSwap(backend="ort") leaves such children).
    def __len__(self) -> int:
        return len(self.module)

    def __iter__(self) -> Any:
        return iter(self.module)

    def __contains__(self, item: Any) -> bool:
        return item in self.module

    def __getitem__(self, idx: Any) -> Any:
        item = self.module[idx]
        if (
            not isinstance(idx, slice)
            or not isinstance(item, nn.Module)
            or not any(isinstance(m, _BatchNorm) for m in item.modules())
        ):
            return item
        state = self._bnswap_state()
        key = (idx.start, idx.stop, idx.step, tuple(id(m) for m in item.children()))
        wrapper = state.slices.get(key)
        if wrapper is None or list(wrapper.module.children()) != list(item.children()):
            if len(state.slices) > 16:
                state.slices.clear()
            check_layers(item)  # as bnswap.ort.wrap does
            trace_constants(item, add=True)
            wrapper = type(self)(
                item,
                fallback=state.fallback,
                session_options=state.session_options,
                debug_options=state.debug_options,
            )
            state.slices[key] = wrapper
        # the slice container is bnswap's own object: it follows the wrapped model's flag
        wrapper.module.training = self.module.training
        return wrapper

    # ---------------------------------------------------------------- forward
    def _bnswap_forward(self, *args: Any, **kwargs: Any) -> Any:
        with _original.wrapper_call():  # the wrapper's own calls of its model never warn
            return self._bnswap_forward_inner(args, kwargs)

    def _bnswap_forward_inner(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = self._bnswap_state()
        model = state.model
        if state.eager or _recorded_elsewhere():
            # Being traced or exported (torch.jit.trace, torch.onnx.export, Lightning's
            # to_onnx / to_torchscript) records the model ORT wraps, as stock's layers:
            # the exporter's runtime picks its kernels. (ORT's own export traces that
            # model directly, never this wrapper.)
            return model(*args, **kwargs)
        mods = list(model.named_modules())  # the one walk of the model per call
        layers = [(n, m) for n, m in mods if isinstance(m, _BatchNorm)]
        training = graph_mode(model.training, layers)
        self._bnswap_sync_mode(training)
        self._bnswap_check_export(mods, layers, args, kwargs, training)
        if training:
            return self._bnswap_train_step([(n, m) for n, m in layers if m.training], args, kwargs)
        self._bnswap_warn_eval_grad()
        return self._bnswap_eval_step(args, kwargs)

    def _bnswap_sync_mode(self, training: bool) -> None:
        """Make ORT's mode follow the wrapped model's ``training`` flag.

        ORT picks its training or inference graph from the hidden
        ``_torch_module._flattened_module.training``, which only ``ORTModule.train()`` /
        ``eval()`` update. Code that sets ``.training`` on every module of
        ``named_modules()`` instead (Lightning 2.x restores the train mode after
        validation that way, ``_ModuleMode.restore``) never reaches it nor the ORTModule
        itself (``named_modules`` yields the wrapped model's modules), so ORT kept
        running its inference graph in a training step. The wrapped model's own flag is
        the one bnswap reads.
        """
        if self.__dict__.get("training") is not training:
            self.__dict__["training"] = training
        flat = getattr(self._torch_module, "_flattened_module", None)
        if flat is not None and flat.training is not training:
            flat.training = training  # its only child is the wrapped model

    def _bnswap_check_export(
        self,
        mods: list[Any],
        layers: list[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        training: bool,
    ) -> None:
        """Re-export when something the exported graph baked in has changed.

        The graph fixes the module structure (and which forward each layer runs), the
        Parameter and buffer tensors it is fed, each BatchNorm layer's
        ``track_running_stats`` and ``eps`` (Lightning's ``BaseFinetuning`` flips
        ``track_running_stats`` when it freezes / unfreezes), the values of non-tensor
        forward arguments, which BatchNorm layers get an empty input (the core returns
        early for one, so the traced graph holds no batch norm for that layer: an eval
        wrapper whose first batch was empty gave un-normalized outputs for every later
        batch) and, in training, which inputs and parameters require grad.
        ORT 1.19.2 checks none of this after its first call (its default
        ``ORTMODULE_SKIP_CHECK``): it kept writing the statistics of a layer that stopped
        tracking them, returned no gradient for an input that started requiring one, ran
        an old classifier head after the user replaced it, ignored a changed
        ``forward(x, flag=...)`` argument. When the key changes bnswap re-checks the
        layers (as :func:`bnswap.ort.wrap` does) and makes ORT export again
        (:func:`bnswap.ort._compat.force_reexport`).
        """
        state = self._bnswap_state()
        keys = state.export_keys
        old = keys.get(training)
        key = (
            *self._bnswap_export_key(mods, layers, args, kwargs, training),
            state.stats.empty_inputs(args, kwargs, layers),
        )
        if old is None or old == key:
            keys[training] = key
            return
        # A replaced or added submodule must pass wrap's checks (a stock BatchNorm would
        # be exported with a frozen momentum); a new affine=False layer needs its trace
        # buffers.
        check_layers(state.model)
        trace_constants(state.model, add=True)
        state.stats.invalidate()
        keys.clear()  # the other mode's graph is stale too
        mods = list(state.model.named_modules())
        layers = [(n, m) for n, m in mods if isinstance(m, _BatchNorm)]
        keys[training] = (
            *self._bnswap_export_key(mods, layers, args, kwargs, training),
            state.stats.empty_inputs(args, kwargs, layers),
        )
        _log.info(
            logger,
            "bnswap.ort: the model or its inputs changed in a way the exported "
            "graph depends on; ONNX Runtime exports again",
        )  # (once per job)
        for mode in (True, False):
            _compat.force_reexport(self, mode)

    @staticmethod
    def _bnswap_export_key(
        mods: list[Any],
        layers: list[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        training: bool,
    ) -> tuple[Any, ...]:
        """What the exported graph depends on, from one pass over ``mods`` (the model's
        ``named_modules()``): its structure, the identity of every Parameter / buffer
        slot (ORT feeds the tensors it found at export; a replaced one would be ignored),
        each BatchNorm's flags, the non-tensor arguments (graph constants) and, in
        training, ``requires_grad``."""
        structure, tensors, grads = [], [], []
        for n, m in mods:
            # the forward a layer runs too: an instance forward, bnswap's swap (its mark,
            # per instance); and its own train/eval flag (the graph carries each
            # module's mode)
            d = m.__dict__
            structure.append((n, type(m), d.get("forward"), d.get(SWAP), m.training))
            for p in m._parameters.values():
                tensors.append(id(p))
                grads.append(p is not None and p.requires_grad)
            tensors.extend(id(b) for b in m._buffers.values())
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key: tuple[Any, ...] = (
            tuple(structure),
            tuple(tensors),
            tuple((m.track_running_stats, float(m.eps)) for _, m in layers),
            str(spec),
            tuple(None if isinstance(x, torch.Tensor) else leaf_key(x) for x in leaves),
        )
        if training:
            key += (
                tuple(t.requires_grad for t in leaves if isinstance(t, torch.Tensor)),
                tuple(grads),
            )
        return key

    def _bnswap_warn_eval_grad(self) -> None:
        state = self._bnswap_state()
        if (
            not state.warned_eval_grad
            and torch.is_grad_enabled()
            and any(p.requires_grad for p in state.model.parameters())
        ):
            state.warned_eval_grad = True
            warnings.warn(
                "bnswap.ort: the model is in eval mode with gradients enabled; ORT runs its "
                "inference graph, whose outputs carry no gradient (eager's would). Evaluate "
                "under torch.no_grad(), or use backend='aten' to backpropagate through an "
                "eval-mode model.",
                UserWarning,
                stacklevel=5,
            )

    def _bnswap_train_step(
        self, layers: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """One training forward on ORT, the running statistics by PyTorch's rule."""
        state = self._bnswap_state()
        grad = torch.is_grad_enabled()

        def run() -> Any:
            if grad:
                # ORT 1.19.2's backward can reuse the memory of forward outputs it handed
                # to torch (a returned ReLU activation was found overwritten with gradient
                # values after backward, with stock BN under raw ORTModule too): return
                # copies.
                return pytree.tree_map_only(
                    torch.Tensor, torch.Tensor.clone, self._bnswap_ort_call(args, kwargs)
                )
            # Eager BN in training mode normalizes with batch statistics and updates them
            # also under no_grad; ORT would pick its inference graph (running
            # statistics): run the training graph instead.
            with torch.enable_grad():
                return detach_tree(self._bnswap_ort_call(args, kwargs))

        verify = state.verification is Verification.NEXT_STEP
        try:
            out = state.stats.step(
                args,
                kwargs,
                run,
                verify=verify,
                layers=layers,
                eager=lambda: state.model(*args, **kwargs),
            )
        except ORTRunError as err:  # StatsNotWrittenError, LayerRunsTwiceError included
            return self._bnswap_fallback(err, args, kwargs)
        if state.stats.verified:
            state.verification = Verification.DONE
        return out

    def _bnswap_eval_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return self._bnswap_ort_call(args, kwargs)
        except ORTRunError as err:
            return self._bnswap_fallback(err, args, kwargs)

    def _bnswap_ort_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """ORT's own forward; its errors become :class:`ORTRunError`."""
        try:
            ort_forward = self._bnswap_state().ort_forward
            assert ort_forward is not None  # set by _bnswap_install
            return ort_forward(*args, **kwargs)
        except Exception as err:
            if _is_ort_error(err):
                raise ORTRunError(
                    "ONNX Runtime could not run this model (no fallback: pass "
                    f"fallback='aten' to run it eagerly instead): {err}"
                ) from err
            raise

    def _bnswap_fallback(
        self, err: ORTRunError, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        state = self._bnswap_state()
        if state.fallback != "aten":
            raise err
        warnings.warn(
            "bnswap.ort: ONNX Runtime cannot run this model; falling back to the eager "
            f"'aten' backend (fallback='aten'). Cause: {err.__cause__ or err}",
            RuntimeWarning,
            stacklevel=6,
        )  # the user's call of the wrapper
        state.eager = True
        return state.model(*args, **kwargs)

    # ------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()
        # Bound methods are rebuilt by __setstate__. The key stays (as None): ORT's
        # __setstate__ assigns self.forward, and ORTModule.__setattr__ forwards a name
        # that is not in __dict__ to the wrapped model.
        state["forward"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.deepcopy / pickle / torch.save: ORT rebuilds its managers; the copy exports
        # and verifies afresh on its first call.
        with _compat.ort_scope():
            super().__setstate__(state)
        self._bnswap_install()
