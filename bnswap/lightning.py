"""Lightning integration: the :class:`BNSwap` callback.

``Trainer(callbacks=[BNSwap()])`` runs every BatchNorm layer of the LightningModule on
PyTorch's consolidated batch-norm ops for fit, validate, test and predict. It uses
bnswap's public API only (:func:`bnswap.plan` / :meth:`bnswap.Plan.apply`,
:func:`bnswap.convert`, :func:`bnswap.revert`, :func:`bnswap.sync.original_of`,
:func:`bnswap.ort.wrap`), and one Lightning attribute: the strategy's layer-sync plugin
(``strategy._layer_sync``, Lightning 2.x), which it stands in for during a fit with
``Trainer(sync_batchnorm=True)``. When it swaps what, and why then:
``docs/lightning.md``. Works with ``lightning`` (``lightning.pytorch``) and, when that is
not installed, ``pytorch_lightning``; with both installed, ``BNSwapPL`` is the callback
for ``pytorch_lightning.Trainer``.
"""

from __future__ import annotations

import fnmatch
import logging
import re
import warnings
import weakref
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle

from bnswap.backends import Backend, backend_named
from bnswap.convert import convert, plan, revert
from bnswap.extras import install_hint
from bnswap.layers import is_swapped
from bnswap.plan import (
    Patterns,
    Plan,
    UnmatchedPatternWarning,
    check_patterns,
)
from bnswap.sync import original_of

if TYPE_CHECKING:  # type checkers read the unified package's types
    import lightning.pytorch as pl
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
else:
    try:  # the unified package first, the standalone one otherwise
        import lightning.pytorch as pl
        from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
    except ImportError:  # exercised only without `lightning` (the install test)
        try:
            import pytorch_lightning as pl  # the older package's name
            from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
        except ImportError:
            raise ModuleNotFoundError(
                "bnswap.BNSwap needs Lightning, which is not installed: "
                + install_hint("lightning"),
                name="lightning",
            ) from None

__all__ = ["BNSwap"]

#: bnswap's logger: the whole plan goes there at DEBUG (global rank zero) at each stage.
logger = logging.getLogger("bnswap")


def _has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in module.modules())


def _listed(patterns: Patterns) -> Patterns:
    """``patterns`` with an iterable made a list: the callback plans at every stage, and a
    generator would be empty from the second plan on (an empty ``include`` swaps nothing)."""
    if patterns is None or isinstance(patterns, (str, bytes, bytearray, type)):
        return patterns  # (bytes: one pattern, refused by check_patterns)
    try:
        return list(patterns)
    except TypeError:  # not iterable: check_patterns says so
        return patterns


def _pattern_hint(root: nn.Module, message: str) -> str:
    """What an unmatched-pattern warning of the callback adds (issue 46): the callback's
    patterns match qualified names from the LightningModule down, so a name from inside
    one of its attributes (``'0'`` for ``self.net = nn.Sequential(...)``) matches
    nothing; with the guesses that would match (``'net.0'``)."""
    found = re.search(r"pattern '(.*)' matches no", message)
    names = [n for n, m in root.named_modules() if isinstance(m, _BatchNorm) and n]
    if found is None or not names:
        return ""
    pattern = found.group(1)
    guesses: dict[str, None] = {}
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts)):
            if fnmatch.fnmatchcase(".".join(parts[i:]), pattern):
                guesses[".".join(parts[:i]) + "." + pattern] = None
                break
    hint = (
        "; BNSwap's patterns match qualified names from the LightningModule down, as "
        "pl_module.named_modules() gives them"
    )
    if guesses:
        return hint + ": did you mean " + " or ".join(map(repr, list(guesses)[:3])) + "?"
    return hint + f" (e.g. {names[0]!r})"


class _LayerSyncAfterWrap:
    """Lightning's layer-sync plugin (``Trainer(sync_batchnorm=True)``) while a BNSwap fit
    runs: BatchNorm becomes bnswap's synchronized ``SyncBatchNorm`` after the DDP wrap.

    Lightning's ``TorchSyncBatchNorm.apply`` runs in ``strategy.setup`` before the DDP wrap
    and makes new ``SyncBatchNorm`` objects; DDP's constructor refuses those on the CPU
    (``ValueError: SyncBatchNorm layers only work with GPU modules``, torch's
    ``_passing_sync_batchnorm_handle``), and its ``revert`` gives ``_BatchNormXd`` layers
    back, not the originals. Here ``apply`` leaves the model as it is when bnswap will
    synchronize every BatchNorm layer of it (then BNSwap converts at the stage start, right
    after the wrap and the optimizers: ``bnswap.convert(..., sync_batchnorm=True)`` keeps
    the Parameter and buffer objects, so DDP's and the optimizers' references stay valid),
    and otherwise (a layer excluded or without a synchronized class) does exactly what
    Lightning's plugin does. ``revert`` puts the original layer objects back (the swap
    they had included), or calls Lightning's.
    """

    def __init__(self, lightning: Any, callback: _BNSwapBase) -> None:
        self.lightning = lightning  # the plugin it stands in for (TorchSyncBatchNorm)
        self.callback = callback
        self.deferred = False  # apply left the conversion to the stage start

    def apply(self, model: nn.Module) -> nn.Module:
        self.deferred = self.callback._synchronizes_all(model)
        return model if self.deferred else self.lightning.apply(model)

    def revert(self, model: nn.Module) -> nn.Module:
        if not self.deferred:
            reverted: nn.Module = self.lightning.revert(model)
            return reverted
        self.deferred = False
        for parent in list(model.modules()):
            for key, child in list(parent._modules.items()):
                original = None if child is None else original_of(child)
                if original is not None:
                    parent._modules[key] = original
        return model


class _BNSwapBase:
    """The callback's logic, independent of which Lightning package provides the base
    (the arguments are documented on :class:`BNSwap`, whose ``__init__`` calls
    :meth:`_init`: a wrong argument's TypeError names ``BNSwap.__init__()``)."""

    def _init(
        self,
        backend: Literal["aten", "ort"] = "aten",
        *,
        include: Patterns = None,
        exclude: Patterns = None,
        revert_on_teardown: bool = False,
        log_table: bool = False,
    ) -> None:
        backend_named(backend)  # validate everything now, not mid-run
        include, exclude = _listed(include), _listed(exclude)
        check_patterns(include, exclude)
        if not isinstance(log_table, bool):
            raise TypeError(f"log_table must be True or False, got {log_table!r}")
        self.backend = backend
        self.include = include
        self.exclude = exclude
        self.revert_on_teardown = revert_on_teardown
        self.log_table = log_table
        #: The plan of the last run (set when the run starts), or None before any run;
        #: applied (its summary: ``"bnswap: 52 of 52 BatchNorm layers swapped, 0 skipped"``).
        self.plan: Plan | None = None
        self._root: nn.Module | None = None
        self._handle: RemovableHandle | None = None
        self._busy = False
        self._pending = False
        self._swapped: dict[int, str] = {}  # id(layer) -> when this callback swapped it
        self._layer_sync: _LayerSyncAfterWrap | None = None  # installed for this fit
        # layers the plan skips (excluded, SyncBatchNorm...): not planned again each step
        self._left_alone: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._logged: list[dict[str, str]] | None = None  # the plan table last logged
        self._stage = "fit"  # the stage being set up (the summary line names it)
        # a wrapping backend left a child eager for its uninitialized lazy layer: the
        # training steps plan again until a forward has initialized it (then it is wrapped)
        self._unwrapped_lazy = False

    # ------------------------------------------------------------------ pickling
    #: Per-run state: the model being set up, the registration hook, layers by id (ids
    #: mean nothing in another process), a WeakSet (its callback does not pickle:
    #: "Can't pickle local object 'WeakSet.__init__.<locals>._remove'"). ``setup``
    #: rebuilds all of it, so a copy carries the arguments and the last ``plan`` only.
    _RUN_STATE = (
        "_root",
        "_handle",
        "_busy",
        "_pending",
        "_swapped",
        "_left_alone",
        "_layer_sync",
        "_unwrapped_lazy",
    )

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` / ``copy.deepcopy`` keep: everything but the per-run state
        (launchers that pickle callbacks: ``ddp_spawn``, ``ddp_notebook``)."""
        return {k: v for k, v in self.__dict__.items() if k not in self._RUN_STATE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._root = self._handle = None
        self._busy = self._pending = False
        self._swapped = {}
        self._left_alone = weakref.WeakSet()
        self._layer_sync = None
        self._unwrapped_lazy = False

    def __repr__(self) -> str:
        return (
            f"BNSwap(backend={self.backend!r}, include={self.include!r}, "
            f"exclude={self.exclude!r}, revert_on_teardown={self.revert_on_teardown}"
            + (", log_table=True" if self.log_table else "")
            + ")"
        )

    # ------------------------------------------------------------------ swapping
    @property
    def _backend(self) -> Backend:
        return backend_named(self.backend)

    def _plan(self, root: nn.Module, **kw: Any) -> Plan:
        """``bnswap.plan`` of ``root`` with this callback's backend and filters; a wrapping
        backend (``"ort"``) wraps the LightningModule's children, not the module itself."""
        return plan(
            root, self.backend, include=self.include, exclude=self.exclude, wrap="children", **kw
        )

    def _swap(self, root: nn.Module, when: str) -> tuple[list[str], tuple[str, ...]]:
        """Swap what the filters select and is not swapped yet, and (``"ort"``) wrap each
        child the plan says is ready; remember when. Returns the names of the layers
        swapped now and of the children wrapped now."""
        with warnings.catch_warnings():
            # patterns may match layers that configure_model has not built yet; the
            # final plan warns about patterns that match nothing.
            warnings.simplefilter("ignore", UnmatchedPatternWarning)
            todo = self._plan(root)
        fresh = [r for r in todo.swapped if not r.already]
        if fresh or todo.to_wrap:
            busy, self._busy = self._busy, True  # what apply attaches is not a new layer
            try:
                todo.apply()
            finally:
                self._busy = busy
        for r in fresh:
            self._swapped.setdefault(id(r.module), when)
        for r in todo.skipped:
            if r.module is not None:  # (a layer's row: always)
                self._left_alone.add(r.module)
        self._unwrapped_lazy = self._backend.wraps and any(r.lazy for r in todo.swapped)
        return [r.name for r in fresh], todo.to_wrap

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
        if self._backend.wraps and parent is root:
            return root._modules[name]  # the wrapped child, if it was wrapped
        return None

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _current_plan(self, pl_module: nn.Module) -> Plan:
        """The plan of ``pl_module`` as it is now, with when each layer was swapped; a
        pattern that matches no layer warns with where the callback's names start
        (:func:`_pattern_hint`)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            now = self._plan(pl_module)
        for w in caught:  # (each again, as it was, at the line plan attributed it to)
            message: Warning | str = w.message
            if issubclass(w.category, UnmatchedPatternWarning):
                message = w.category(str(w.message) + _pattern_hint(pl_module, str(w.message)))
            warnings.warn_explicit(message, w.category, w.filename, w.lineno)
        rows = []
        for r in now:
            when = self._swapped.get(id(r.module))
            if when is not None and r.action != "skip":
                # this callback swapped it (its row now says keep): when, then where it
                # runs (an eager child's note)
                r = replace(
                    r,
                    action="swap",
                    already=False,
                    reason=when + (f"; {r.placement}" if r.placement else ""),
                )
            rows.append(r)
        done = Plan(rows, pl_module, self.backend, wrap="children")
        done.applied = True  # what the model runs now: its summary says "swapped"
        return done

    # ------------------------------------------------------------ sync_batchnorm
    def _synchronizes_all(self, model: nn.Module) -> bool:
        """Whether ``convert(model, sync_batchnorm=True)`` with this callback's filters makes
        every BatchNorm layer a synchronized bnswap layer (what Lightning's plugin would
        make a SyncBatchNorm); False for a model without BatchNorm (nothing to defer)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnmatchedPatternWarning)
            rows = plan(
                model, self.backend, include=self.include, exclude=self.exclude, sync_batchnorm=True
            ).rows
        return bool(rows) and all(r.synchronized for r in rows)

    def _take_over_layer_sync(self, trainer: Any) -> None:
        """setup("fit"), before anything changes: stand in for Lightning's
        ``TorchSyncBatchNorm`` plugin (``Trainer(sync_batchnorm=True)``) until teardown. A
        plugin of the user's own (another ``LayerSync``) keeps Lightning's behaviour. A
        backend that cannot synchronize (``"ort"``) raises its error for any plugin:
        Lightning's conversion would otherwise reach into the ORT-wrapped children in
        strategy.setup (``ORTModule does not support adding modules to it``)."""
        strategy = getattr(trainer, "strategy", None)
        sync = getattr(strategy, "_layer_sync", None)  # Lightning 2.x ParallelStrategy
        if isinstance(sync, _LayerSyncAfterWrap):  # left by a fit that raised
            sync = sync.lightning
            assert strategy is not None  # sync came from it
            strategy._layer_sync = sync
        if sync is not None and not self._backend.synchronizes:
            raise self._backend.sync_error()
        if sync is None or type(sync).__name__ != "TorchSyncBatchNorm":
            return
        self._layer_sync = _LayerSyncAfterWrap(sync, self)
        assert strategy is not None  # sync came from it
        strategy._layer_sync = self._layer_sync

    def _give_back_layer_sync(self, trainer: Any) -> None:
        strategy = getattr(trainer, "strategy", None)
        mine = self._layer_sync
        if mine is not None and getattr(strategy, "_layer_sync", None) is self._layer_sync:
            assert strategy is not None  # it holds mine
            strategy._layer_sync = mine.lightning
        self._layer_sync = None

    def _sync_after_wrap(self, pl_module: nn.Module) -> None:
        """The stage start of a fit whose layer sync was deferred: every BatchNorm layer
        becomes a swapped, synchronized SyncBatchNorm now, after the DDP wrap."""
        if self._layer_sync is None or not self._layer_sync.deferred:
            return
        before = {id(m) for m in pl_module.modules()}
        with warnings.catch_warnings():
            # the stage start's plan, right after this, warns about a pattern that
            # matches nothing (once: not here too)
            warnings.simplefilter("ignore", UnmatchedPatternWarning)
            convert(pl_module, include=self.include, exclude=self.exclude, sync_batchnorm=True)
        for m in pl_module.modules():
            if isinstance(m, nn.SyncBatchNorm) and id(m) not in before:
                self._swapped[id(m)] = (
                    "synchronized at fit start, after the DDP wrap (Trainer(sync_batchnorm=True))"
                )

    def _start(self, trainer: Any, pl_module: nn.Module) -> None:
        """The stage starts: strategy.setup is done. Finish, record and log the plan."""
        if not self._pending:
            return
        self._pending = False
        self._remove_hook()
        self._sync_after_wrap(pl_module)
        self._swap(pl_module, "swapped at stage start")
        self.plan = self._current_plan(pl_module)
        self._log_plan(trainer)
        n_sync = sum(1 for r in self.plan.rows if r.cls == "SyncBatchNorm" and r.action == "skip")
        if n_sync:
            rank_zero_warn(
                f"BNSwap: {n_sync} torch.nn.SyncBatchNorm layer(s) are not swapped (the "
                "plan's reason column says why): they run torch's SyncBatchNorm, which needs "
                "a GPU once a process group is initialized (on the CPU, DDP refuses them)."
            )
        if not self.plan.rows:
            rank_zero_warn(
                "BNSwap: the model has no BatchNorm layer; nothing was swapped"
                + (
                    f" and nothing is wrapped in {self._backend.runtime}"
                    if self._backend.wraps
                    else ""
                )
            )

    def _summary(self) -> str:
        """The stage's one line: ``BNSwap (fit): 52 of 52 BatchNorm layers swapped, 0
        skipped; 52 synchronized over WORLD, 2 ranks`` (how many run bnswap's forward,
        whenever swapped, and how many not; what synchronizes over what; for a wrapping
        backend how many run there)."""
        assert self.plan is not None
        p = self.plan
        text = (
            f"BNSwap ({self._stage}): {len(p.swapped)} of {len(p)} BatchNorm layers "
            f"swapped, {len(p.skipped)} skipped"
        )
        runs = Counter(r.backend for r in self.plan.swapped)
        if self._backend.wraps and runs:
            text += "; " + ", ".join(
                f"{n} on {b}" + (" (eager)" if b != self._backend.name else "")
                for b, n in runs.items()
            )
        groups = Counter(r.sync for r in self.plan.rows if r.synchronized)
        if groups:
            text += "; " + ", ".join(f"{n} synchronized over {g}" for g, n in groups.items())
        return text

    def _log_plan(self, trainer: Any) -> None:
        """The stage start's log, on global rank zero: the summary line, then the rows of
        the layers not swapped (and, for a wrapping backend, of those it runs eager), or
        with ``log_table`` the whole plan; a stage whose plan is as the last one logged
        says so in its line instead. The whole plan at DEBUG on the ``bnswap`` logger."""
        assert self.plan is not None
        if getattr(trainer, "is_global_zero", True) and logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s", self.plan)
        # what each layer runs (the reason says when it was swapped: not a change)
        table = [
            {k: v for k, v in row.items() if k not in ("reason", "action")}
            for row in self.plan.to_dicts()
        ]
        line = self._summary()
        if table == self._logged:
            rank_zero_info(f"{line} (unchanged since the last stage)")
            return
        self._logged = table
        if self.log_table:
            rank_zero_info(f"{line}\n" + str(self.plan).partition("\n")[2])
            return
        notable = Plan(
            [r for r in self.plan.rows if r.action == "skip" or r.placement],
            backend=self.plan.backend,
            wrap="children",
        )
        rank_zero_info(line + ("\n" + str(notable).partition("\n")[2] if notable.rows else ""))

    def _swap_added(self, trainer: Any, pl_module: nn.Module) -> None:
        """Swap BatchNorm layers that appeared in the model since the stage started.

        Finetuning code builds layers mid-fit: timm's ``freeze_batch_norm_2d`` /
        ``unfreeze_batch_norm_2d`` replace every BatchNorm2d with a new one, and any
        callback may attach a new head. Checked in this callback's
        ``on_train_batch_start`` (a walk over the modules, about 40 us per 100 modules on
        a 2-core EPYC VM): a layer built before it (``on_train_epoch_start``, an earlier
        callback) is swapped before its first training step; one built after it in the
        same step (a later callback's or the LightningModule's own
        ``on_train_batch_start``) runs that step on torch's kernel and is swapped before
        the next. Only layers not seen before are planned. Their Parameters are kept (an
        optimizer stays valid); each addition is logged on global rank zero.
        """
        if not self._unwrapped_lazy and not any(
            isinstance(m, _BatchNorm) and not is_swapped(m) and m not in self._left_alone
            for m in pl_module.modules()
        ):
            return  # (a child left unwrapped for its lazy layer is planned again each step)
        when = (
            f"swapped during fit (epoch {getattr(trainer, 'current_epoch', '?')}, "
            f"global step {getattr(trainer, 'global_step', '?')})"
        )
        names, wrapped = self._swap(pl_module, when)
        if names or wrapped:
            self.plan = self._current_plan(pl_module)
        if names:
            rank_zero_info(
                f"BNSwap: {len(names)} BatchNorm layer(s) appeared in the model "
                "since the last training step started; swapped before this one: " + ", ".join(names)
            )
        if wrapped:
            rank_zero_info(
                f"BNSwap: wrapped in {self._backend.runtime} now that their lazy "
                "layers are initialized: " + ", ".join(wrapped)
            )

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self._remove_hook()
        self._backend.check_available()  # fail before anything changes (ORTNotAvailableError)
        self._refuse_another(trainer)
        if stage == "fit":
            self._take_over_layer_sync(trainer)  # (or its refusal, before anything changes)
        self._stage = str(getattr(stage, "value", stage))  # (Lightning's TrainerFn: "fit")
        self._root = pl_module
        self._pending = True
        self._swapped = {}
        self._left_alone = weakref.WeakSet()
        try:
            self._swap(pl_module, "swapped at setup")
        except BaseException:
            self._give_back_layer_sync(trainer)
            raise
        self._handle = register_module_module_registration_hook(self._on_register)

    def _refuse_another(self, trainer: Any) -> None:
        """A Trainer with two BNSwap callbacks (issue 46): the first swaps every layer its
        patterns select at setup, so the second's ``exclude`` did nothing, silently. Both
        refuse, before anything changes."""
        mine = [c for c in getattr(trainer, "callbacks", ()) if isinstance(c, _BNSwapBase)]
        if len(mine) > 1:
            raise ValueError(
                f"bnswap: this Trainer has {len(mine)} BNSwap callbacks ("
                + ", ".join(map(repr, mine))
                + "); give it one: the first would swap every layer its patterns select "
                "before the next could leave any out. One BNSwap takes all the patterns: "
                "BNSwap(include=[...], exclude=[...])."
            )

    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        self._start(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int
    ) -> None:
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
        self._give_back_layer_sync(trainer)  # strategy.teardown has reverted the layer sync
        self._pending = False
        self._root = None
        if self.revert_on_teardown:
            backend = self._backend
            for name, child in list(pl_module.named_children()):
                if backend.is_wrapper(child):  # undo bnswap.ort.wrap
                    setattr(pl_module, name, backend.unwrap(child))
            revert(pl_module)


class BNSwap(_BNSwapBase, pl.Callback):
    """Lightning callback: every BatchNorm layer of the LightningModule runs bnswap's
    kernel, from before checkpoint restore, the optimizers and the DDP wrapper exist.

    Shapes, dtypes and numerics are those of stock ``nn.BatchNorm1d/2d/3d``: input
    ``(N, C, *)`` float16 / bfloat16 / float32 / float64, output the same. Layers built
    during fit (a finetuning step that rebuilds them, a new head) are swapped before
    their first training step. With ``Trainer(sync_batchnorm=True)`` every BatchNorm
    becomes a swapped, synchronized ``nn.SyncBatchNorm`` (global batch statistics, any
    device) right after the DDP wrap, and the original layers come back at teardown. The
    callback never calls ``train()`` / ``eval()`` and never touches
    ``track_running_stats``; it pickles (``ddp_spawn``). When it swaps, and how it stands
    in for Lightning's ``TorchSyncBatchNorm``: ``docs/lightning.md``.

    Args:
        backend: ``"aten"``: PyTorch's consolidated ops in training
            (``aten._batch_norm_with_update`` / ``batch_norm_backward``; stock's
            ``aten.batch_norm`` in evaluation). ``"ort"``: the same
            swap, and each direct child of the LightningModule that holds BatchNorm is
            wrapped with :func:`bnswap.ort.wrap` (ONNX Runtime's ``BatchNormInternal``);
            a child holding a layer bnswap does not swap stays eager.
        include, exclude: glob pattern(s) on qualified names relative to the
            LightningModule (as in ``pl_module.named_modules()``, e.g. ``"backbone.*"``)
            and/or classes, as in :func:`bnswap.convert`.
        revert_on_teardown: after each run (fit, validate, test, predict), unwrap and
            give every swapped layer its own forward back (:func:`bnswap.revert`).
        log_table: log the whole plan (one row per BatchNorm layer) at each stage start.
            By default a stage logs one summary line (``BNSwap (fit): 52 of 52
            BatchNorm layers swapped, 0 skipped; 52 synchronized over WORLD, 2 ranks``)
            and the rows of the layers not swapped (with ``backend="ort"``, also of
            those that run eager on aten); the whole plan goes to the ``bnswap`` logger
            at DEBUG either way. A stage whose plan is as the last one logged logs its
            line only, ``(unchanged since the last stage)``.

    One ``BNSwap`` per Trainer: a second one is refused at ``setup`` (``ValueError``,
    before anything changes), since the first would swap every layer its patterns select
    before the second could leave any out. Give one callback all the patterns.

    Attributes:
        plan: the :class:`bnswap.Plan` of the last run (one row per BatchNorm layer:
            name, class, action swap / keep / skip, reason, backend, kernel, adapter),
            set when the run starts; logged on global rank zero (``rank_zero_info``) as
            ``log_table`` says.

    Raises:
        ValueError: unknown ``backend``; at ``setup``, a Trainer with another ``BNSwap``.
        TypeError: a pattern is neither str nor class; ``log_table`` is not a bool; an
            unknown argument (``BNSwap.__init__() got an unexpected keyword argument``).
        bnswap.ort.ORTNotAvailableError: (an ImportError, at ``setup``, before the model
            changes) ``backend="ort"`` without ONNX Runtime training installed.

    Examples::

        >>> import lightning.pytorch as pl
        >>> from bnswap import BNSwap
        >>> callback = BNSwap(exclude="head.*")
        >>> callback
        BNSwap(backend='aten', include=None, exclude='head.*', revert_on_teardown=False)
        >>> BNSwap(log_table=True)  # the whole plan at each stage start
        BNSwap(backend='aten', include=None, exclude=None, revert_on_teardown=False, log_table=True)
        >>> trainer = pl.Trainer(callbacks=[callback], logger=False, enable_progress_bar=False)
        >>> BNSwap(backend="cudnn")
        Traceback (most recent call last):
        ...
        ValueError: unknown backend 'cudnn'; choose one of 'aten', 'ort'
    """

    def __init__(
        self,
        backend: Literal["aten", "ort"] = "aten",
        *,
        include: Patterns = None,
        exclude: Patterns = None,
        revert_on_teardown: bool = False,
        log_table: bool = False,
    ) -> None:
        self._init(
            backend,
            include=include,
            exclude=exclude,
            revert_on_teardown=revert_on_teardown,
            log_table=log_table,
        )


def __getattr__(name: str) -> Any:
    if name == "BNSwapPL":  # the callback for pytorch_lightning.Trainer
        import pytorch_lightning

        if pl is pytorch_lightning:
            return BNSwap
        cls = type(
            "BNSwap",
            (_BNSwapBase, pytorch_lightning.Callback),
            {"__doc__": BNSwap.__doc__, "__module__": __name__, "__init__": BNSwap.__init__},
        )
        globals()["BNSwapPL"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
