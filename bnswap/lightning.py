"""Lightning integration: the :class:`BNSwap` callback.

``Trainer(callbacks=[BNSwap()])`` runs every BatchNorm layer of the LightningModule on
bnswap layers (PyTorch's consolidated batch-norm ops) for fit, validate, test and
predict. Works with ``lightning`` (``lightning.pytorch``) and, when that is not
installed, ``pytorch_lightning``; with both installed, :data:`BNSwapPL` is the callback
for ``pytorch_lightning.Trainer``.

When the swap happens
---------------------
Lightning 2.6 runs a stage in this order: ``Callback.setup``, ``LightningModule.setup``,
``configure_model``, checkpoint restore (``ckpt_path``), ``strategy.setup`` (sync-BN
conversion, precision, device move, DDP wrap, ``configure_optimizers``), then
``on_fit_start`` / ``on_{validation,test,predict}_start``. No callback hook runs between
``configure_model`` and ``strategy.setup``, and ``on_fit_start`` comes after the
optimizers and the DDP wrapper exist. So the callback

1. swaps the layers that already exist in ``Callback.setup``;
2. from then until the stage starts, keeps a PyTorch global module-registration hook
   (``torch.nn.modules.module.register_module_module_registration_hook``, public API):
   when a submodule containing BatchNorm is attached to the LightningModule (in
   ``LightningModule.setup`` or ``configure_model``), its layers are swapped right
   there, with ``include`` / ``exclude`` matched against their qualified names;
3. at ``on_{fit,validation,test,predict}_start`` removes the hook, swaps anything left
   over (a no-op in practice), computes :attr:`BNSwap.plan` on the final model and logs
   it on global rank zero, once per run.

Hence checkpoints restore into bnswap layers, the optimizers are built over them, and
DDP wraps them. A swapped layer keeps its class, module, Parameter and buffer objects
(only its forward is bnswap's), so the state_dict keys are those of stock BatchNorm:
checkpoints move freely between stock and bnswap models.

4. before every training step, swaps BatchNorm layers that appeared in the model since
   (timm's ``freeze`` / ``unfreeze`` rebuild every one; a callback may attach a new
   head), keeping their Parameters, and logs each addition on global rank zero.

``Trainer(sync_batchnorm=True)``
--------------------------------
Lightning converts every ``_BatchNorm`` (swapped layers included: they are BatchNorms)
to ``torch.nn.SyncBatchNorm`` inside ``strategy.setup``. SyncBatchNorm runs its own
cross-process kernel: bnswap leaves it alone. The callback logs a warning naming the
number of SyncBatchNorm layers and the plan lists them as skipped; training proceeds on
SyncBatchNorm (stock behaviour). Use ``sync_batchnorm=False`` to train on bnswap layers.

``backend="ort"``
----------------
ONNX Runtime cannot wrap a LightningModule, so each direct child holding BatchNorm is
wrapped with ``bnswap.ort.wrap`` (``ORTModule``; same Parameter objects and state_dict
keys), at the same moments as the swap, hence before the optimizers and DDP. A child
holding a layer that bnswap does not swap (excluded, SyncBatchNorm, ...) stays eager:
its bnswap layers run on aten and the plan says so.

Other guarantees
----------------
The callback never calls ``train()`` / ``eval()``: a submodule the user put in eval
stays in eval. It never touches ``track_running_stats``, so Lightning's
``BaseFinetuning`` / ``BackboneFinetuning`` freeze bnswap layers as they freeze stock
ones (swapped layers keep their class).
"""

from __future__ import annotations

import importlib
import logging
import warnings
import weakref
from dataclasses import replace
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle

import bnswap
from bnswap.convert import _apply, _log, ort_inner
from bnswap._swap import is_swapped
from bnswap.plan import Plan, rows_from, select_kernel
from bnswap.walker import Patterns, _patterns, check_backend, decide

try:  # the unified package first, the standalone one otherwise
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - exercised only without `lightning`
    import pytorch_lightning as pl  # type: ignore[no-redef]

__all__ = ["BNSwap", "pl"]

log = logging.getLogger(__name__)  # "bnswap.lightning"
# Same convention as lightning.pytorch's own logger: INFO by default, with a handler of
# its own unless the application configured the root logger.
log.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    log.addHandler(logging.StreamHandler())
    log.propagate = False

_PATTERN_WARNING = r"bnswap: (include|exclude) pattern"
_SYNC_REASON_CLASS = "SyncBatchNorm"


def _has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in module.modules())


def _import_ort() -> Any:
    """bnswap.ort, checked usable (it imports ONNX Runtime only when it wraps)."""
    ort = importlib.import_module("bnswap.ort")
    if not ort.is_available():
        raise ort.ORTNotAvailableError(
            "BNSwap(backend='ort') needs ONNX Runtime training and torch-ort: " + ort.INSTALL)
    return ort


class _BNSwapBase:
    """The callback's logic, independent of which Lightning package provides the base."""

    def __init__(
        self,
        backend: str = "aten",
        *,
        include: Patterns = None,
        exclude: Patterns = None,
        revert_on_teardown: bool = False,
    ) -> None:
        """Swap the LightningModule's BatchNorm layers for bnswap layers.

        Args:
            backend: ``"aten"``: bnswap layers on ``aten._batch_norm_with_update`` /
                ``_batch_norm_no_update`` / ``batch_norm_backward``. ``"ort"``: the
                same layers, and each direct child of the LightningModule that holds
                BatchNorm is wrapped with ``bnswap.ort.wrap`` (ONNX Runtime's
                ``BatchNormInternal``).
            include, exclude: glob pattern(s) on qualified names relative to the
                LightningModule (as in ``pl_module.named_modules()``, e.g.
                ``"backbone.*"``) and/or classes, as in :func:`bnswap.convert`.
            revert_on_teardown: after each run (fit, validate, test, predict), give
                every swapped layer its own forward back (:func:`bnswap.revert`).

        Raises:
            ValueError: unknown ``backend``.
            TypeError: a pattern is neither str nor class.
            bnswap.ort.ORTNotAvailableError: (an ImportError, at ``setup``, before the model
                changes) ``backend="ort"`` without ONNX Runtime training installed.
        """
        check_backend(backend)  # validate everything now, not mid-run
        _patterns(include, "include")
        _patterns(exclude, "exclude")
        self.backend = backend
        self.include = include
        self.exclude = exclude
        self.revert_on_teardown = revert_on_teardown
        #: The plan of the last run (set when the run starts), or None before any run.
        self.plan: Plan | None = None
        self._root: nn.Module | None = None
        self._handle: RemovableHandle | None = None
        self._busy = False
        self._pending = False
        self._swapped: dict[int, str] = {}  # id(layer) -> when this callback swapped it
        # layers the plan skips (excluded, SyncBatchNorm...): not planned again each step
        self._left_alone: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __repr__(self) -> str:
        return (f"BNSwap(backend={self.backend!r}, include={self.include!r}, "
                f"exclude={self.exclude!r}, revert_on_teardown={self.revert_on_teardown})")

    # ------------------------------------------------------------------ swapping
    def _swap(self, root: nn.Module, when: str) -> None:
        """Swap what the filters select and is not swapped yet; remember when."""
        with warnings.catch_warnings():
            # patterns may match layers that configure_model has not built yet; the
            # final plan warns about patterns that match nothing.
            warnings.filterwarnings("ignore", message=_PATTERN_WARNING)
            decisions = decide(root, "aten", self.include, self.exclude)
        todo = [d.module for d in decisions if d.action == "swap" and not d.already]
        if todo:  # what bnswap.convert(root) does, on the decisions made above
            _apply(root, decisions, "aten")
            _log(decisions, "aten")
        for m in todo:
            self._swapped.setdefault(id(m), when)
        if self.backend == "ort":
            self._wrap_children(root)

    def _wrap_children(self, root: nn.Module) -> None:
        """backend="ort": wrap each direct child whose BatchNorm layers are all bnswap
        layers (a child holding an excluded or unswappable layer stays eager, on aten)."""
        ort = _import_ort()
        for name, child in list(root.named_children()):
            if ort_inner(child) is not None:
                continue
            bns = [m for m in child.modules() if isinstance(m, _BatchNorm)]
            if bns and all(is_swapped(m) for m in bns):
                self._busy = True
                try:
                    setattr(root, name, ort.wrap(child))
                finally:
                    self._busy = False

    def _on_register(self, parent: nn.Module, name: str, sub: Any) -> Any:
        """torch global module-registration hook, active from setup to the stage start."""
        root = self._root
        if self._busy or root is None or not isinstance(sub, nn.Module):
            return None
        if not _has_batchnorm(sub):
            return None
        if parent is not root and not any(parent is m for m in root.modules()):
            return None  # built elsewhere (or not attached yet: its attach comes later)
        self._busy = True
        try:
            # torch calls this hook just before it stores `sub`; store it first so the
            # walk sees the qualified names that include / exclude are matched against.
            parent._modules[name] = sub
            self._swap(root, "swapped when configure_model attached it")
        finally:
            self._busy = False
        if self.backend == "ort" and parent is root:
            return root._modules[name]  # the wrapped child, if it was wrapped
        return None

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _start(self, trainer: Any, pl_module: nn.Module) -> None:
        """The stage starts: strategy.setup is done. Finish, record and log the plan."""
        if not self._pending:
            return
        self._pending = False
        self._remove_hook()
        self._swap(pl_module, "swapped at stage start")
        self.plan = self._current_plan(pl_module)
        if getattr(trainer, "is_global_zero", True):
            log.info("%s", self.plan)
            n_sync = sum(1 for r in self.plan.rows if r.cls == _SYNC_REASON_CLASS)
            if n_sync:
                log.warning(
                    "BNSwap: %d layer(s) are torch.nn.SyncBatchNorm (Trainer(sync_batchnorm=True) "
                    "converts every BatchNorm, swapped ones included, in strategy.setup). "
                    "SyncBatchNorm runs its own cross-process kernel; bnswap leaves it alone. "
                    "Use sync_batchnorm=False to train on bnswap layers.", n_sync)
            if not self.plan.rows:
                log.warning("BNSwap: the model has no BatchNorm layer; nothing was swapped%s",
                            " and nothing is wrapped in ONNX Runtime"
                            if self.backend == "ort" else "")

    def _current_plan(self, pl_module: nn.Module) -> Plan:
        """The plan of ``pl_module`` as it is now, with when each layer was swapped."""
        rows = []
        decisions = decide(pl_module, self.backend, self.include, self.exclude)
        wrapped = [n + "." for n, c in pl_module.named_children()
                   if ort_inner(c) is not None]
        for d, r in zip(decisions, rows_from(decisions, self.backend).rows, strict=True):
            m = d.module
            when = self._swapped.get(id(m))
            if when is not None and r.action == "swap":
                r = replace(r, reason=when)
            if (self.backend == "ort" and r.action == "swap"
                    and not r.name.startswith(tuple(wrapped))):
                # its child was not wrapped (it holds a layer bnswap does not swap)
                r = replace(r, backend="aten", kernel=select_kernel(m),
                            reason=(r.reason + "; " if r.reason != "-" else "")
                            + "eager: its top-level module holds a layer that is not swapped")
            rows.append(r)
        return Plan(rows)

    def _swap_added(self, trainer: Any, pl_module: nn.Module) -> None:
        """Swap BatchNorm layers that appeared in the model since the stage started.

        Finetuning code builds layers mid-fit: timm's ``freeze_batch_norm_2d`` /
        ``unfreeze_batch_norm_2d`` replace every BatchNorm2d with a new one, and any
        callback may attach a new head. Checked before every training step (a walk over
        the modules, about 40 us per 100 modules on a 2-core EPYC VM); only layers not seen
        before are planned. Their Parameters are kept (an optimizer stays valid); each
        addition is logged on global rank zero.
        """
        fresh = [m for m in pl_module.modules() if isinstance(m, _BatchNorm)
                 and not is_swapped(m) and m not in self._left_alone]
        if not fresh:
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_PATTERN_WARNING)
            decisions = decide(pl_module, "aten", self.include, self.exclude)
        todo = [d for d in decisions if d.action == "swap" and not d.already]
        for d in decisions:
            if d.action == "skip":
                self._left_alone.add(d.module)
        when = (f"swapped during fit (epoch {getattr(trainer, 'current_epoch', '?')}, "
                f"global step {getattr(trainer, 'global_step', '?')})")
        if todo:
            _apply(pl_module, decisions, "aten")
            for d in todo:
                self._swapped[id(d.module)] = when
        if self.backend == "ort":
            self._wrap_children(pl_module)
        if todo:
            self.plan = self._current_plan(pl_module)
            if getattr(trainer, "is_global_zero", True):
                log.info("BNSwap: %d BatchNorm layer(s) appeared in the model during fit and "
                         "were swapped before their first training step: %s", len(todo),
                         ", ".join(d.name for d in todo))

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self._remove_hook()
        if self.backend == "ort":
            _import_ort()  # fail before anything changes (ORTNotAvailableError)
        self._root = pl_module
        self._pending = True
        self._swapped = {}
        self._left_alone = weakref.WeakSet()
        self._swap(pl_module, "swapped at setup")
        self._handle = register_module_module_registration_hook(self._on_register)

    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        self._start(trainer, pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any,
                             batch_idx: int) -> None:
        self._swap_added(trainer, pl_module)

    def on_sanity_check_start(self, trainer: Any, pl_module: nn.Module) -> None:
        self._start(trainer, pl_module)

    def on_validation_start(self, trainer: Any, pl_module: nn.Module) -> None:
        self._start(trainer, pl_module)

    def on_test_start(self, trainer: Any, pl_module: nn.Module) -> None:
        self._start(trainer, pl_module)

    def on_predict_start(self, trainer: Any, pl_module: nn.Module) -> None:
        self._start(trainer, pl_module)

    def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
        self._remove_hook()
        self._pending = False

    def teardown(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self._remove_hook()
        self._pending = False
        self._root = None
        if self.revert_on_teardown:
            for name, child in list(pl_module.named_children()):
                inner = ort_inner(child)
                if inner is not None:  # undo bnswap.ort.wrap
                    setattr(pl_module, name, inner)
            bnswap.revert(pl_module)


class BNSwap(_BNSwapBase, pl.Callback):
    """Lightning callback: every BatchNorm layer of the LightningModule becomes a bnswap
    layer before checkpoint restore, the optimizers and the DDP wrapper exist.

    Shapes, dtypes and numerics are those of stock ``nn.BatchNorm1d/2d/3d``: input
    (N, C, *) float16 / bfloat16 / float32 / float64, output the same.

    Attributes:
        plan: the :class:`bnswap.Plan` of the last run (one row per BatchNorm layer:
            name, class, action swap / skip, reason, backend, kernel), set when the run
            starts and logged on global rank zero by the ``bnswap.lightning`` logger.

    See :meth:`_BNSwapBase.__init__` for the arguments and the module docstring for
    when the swap happens and what ``sync_batchnorm=True`` does.
    """

    __init__ = _BNSwapBase.__init__


def __getattr__(name: str) -> Any:
    if name == "BNSwapPL":  # the callback for pytorch_lightning.Trainer
        import pytorch_lightning

        if pl is pytorch_lightning:
            return BNSwap
        cls = type("BNSwap", (_BNSwapBase, pytorch_lightning.Callback),
                   {"__doc__": BNSwap.__doc__, "__module__": __name__,
                    "__init__": _BNSwapBase.__init__})
        globals()["BNSwapPL"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
