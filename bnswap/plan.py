"""The module road: what happens to every BatchNorm layer of a model, and why.

One :class:`PlanRow` per layer (swap, keep or skip, the reason, the adapter, the backend, the
kernel): :func:`plan_layers`; :meth:`Plan.apply` carries the plan out, atomically;
:func:`revert_layers` undoes it. The front door (:mod:`bnswap.convert`: ``bnswap.plan``,
``bnswap.convert``, ``bnswap.revert``) hands a module here, a program to
:mod:`bnswap.programs`; this road knows nothing of programs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from bnswap import kernels, registry
from bnswap._patterns import (
    EMPTY_INCLUDE,
    Pattern,
    Patterns,
    check_patterns,
    pattern_list,
    pattern_str,
)
from bnswap._rows import Rows
from bnswap._swap import (
    SWAP,
    Adapter,
    adapter_of,
    swap,
    type_before_parametrizations,
    undo_of,
    unswap,
)
from bnswap._warn import UnmatchedPatternWarning, warn
from bnswap.backends import BACKENDS, Backend, backend_named, place_children
from bnswap.kernels import CUDNN_BN_MIN_EPSILON as CUDNN_BN_MIN_EPSILON  # (plan's name before)
from bnswap.registry import qualified_name
from bnswap.sync import (
    NOT_SYNCED,
    ORIGINAL,
    SYNC_REASON,
    SYNC_REASONS,
    describe_group,
    original_of,
    sync_class,
    sync_kernel,
    to_sync_batch_norm,
)

__all__ = [
    "BACKENDS",
    "WRAP_SCOPES",
    "Pattern",
    "Patterns",
    "Plan",
    "PlanRow",
    "UnmatchedPatternWarning",
    "check_backend",
    "check_module",
    "check_patterns",
    "plan_layers",
    "revert_layers",
    "select_kernel",
    "warn_left",
    "warn_unmatched",
]

#: What a wrapping backend (``"ort"``) wraps: the whole model, or each direct child whose
#: BatchNorm layers it can all run (what the Lightning callback does: a LightningModule
#: cannot be wrapped itself).
WRAP_SCOPES = ("model", "children")


#: The :class:`bnswap.backends.Backend` named ``backend`` (ValueError naming the choices
#: unless it is 'aten' or 'ort').
check_backend = backend_named


def check_module(module: object, fn: str) -> None:
    """Raise TypeError unless ``module`` is an ``nn.Module`` (``fn`` names the caller)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"bnswap.{fn}() expects a torch.nn.Module, got {type(module).__name__}")


def select_kernel(m: nn.Module, device: torch.device | str | None = None) -> str:
    """The kernel a swapped layer runs on ``device`` (default: where its tensors are), by
    torch's rule (:func:`bnswap.kernels.layer_kernel`): ``"Native"``, ``"Cudnn"`` or
    ``"Miopen"``, in training and in eval.

    In training a swapped layer calls ``_batch_norm_with_update`` with stand-in weight /
    bias for affine=False; in eval stock's ``aten.batch_norm(training=False)`` with its own
    (none for affine=False). Where the two differ the answer names both, e.g. ``"Cudnn;
    eval Native"``. A ``BatchNorm1d`` names both input ranks where they differ: ``"Cudnn
    for (N, C, L); Native for (N, C)"`` (cuDNN needs input of rank 3 or more). For
    ``cuda`` on a machine without one the answer is torch's rule, marked ``"(predicted)"``
    (``"Cudnn (predicted)"``). ``"n/a (...)"`` for the meta device, a torch without
    ``torch._C._select_batch_norm_backend``, or a device the probe cannot run on.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from bnswap.plan import select_kernel
        >>> select_kernel(nn.BatchNorm2d(4))
        'Native'
        >>> select_kernel(nn.BatchNorm2d(4, affine=False), "meta")
        'n/a (meta)'
    """
    return kernels.layer_kernel(m, device)


@dataclass(frozen=True)
class PlanRow:
    """What happens to one BatchNorm layer, and why.

    Attributes:
        name: qualified name as in ``named_modules()`` (``"(root)"`` for the model).
        cls: the layer's class name (seen through torch's parametrization class).
        action: ``"swap"`` (swapped by :meth:`Plan.apply`), ``"keep"`` (swapped
            already: apply leaves it as it is) or ``"skip"`` (left on its class's
            forward; the reason says why).
        reason: why (``"-"`` for a plain swap).
        backend: ``"aten"`` or ``"ort"``; ``"-"`` when skipped.
        adapter: the function the layer's forward becomes (None when skipped);
            :attr:`adapter_name` is its qualified name, the table's column.
        module: the layer itself.
        lazy: an uninitialized ``LazyBatchNorm*`` (it keeps the swap when it
            initializes).
        already: swapped before this plan was made (action ``"keep"``).
        excluded: skipped because ``include`` / ``exclude`` left it out (the user's
            choice: ``convert`` does not warn about it, and ``bnswap plan`` exits 0), not
            because bnswap cannot swap it.
        device: where :attr:`kernel` is evaluated (None: where the layer's tensors are).
        sync_class: the synchronized class the layer becomes (``nn.SyncBatchNorm``)
            with ``sync_batchnorm=True``, else None.
        process_group: the ``process_group`` it gets then (None: WORLD).
        placement: why a swapped layer runs eager on aten although the plan's backend
            wraps (``plan(..., wrap="children")``, whose child holding it is not
            wrapped): one of ``"eager: its top-level module holds a layer that is not
            swapped"``, ``"eager, synchronized on aten: its top-level module holds a
            SyncBatchNorm (...)"`` (the backend cannot synchronize), ``"eager until a
            forward initializes its top-level module's lazy layer (then wrapped)"``; the
            reason ends with it (the table shows it there, not as a column of its own).
            None when the row runs where the plan's backend puts it, for a skipped
            layer, and in a plan that wraps the whole model or nothing (``"aten"``).

    Examples::

        >>> import bnswap
        >>> from torch import nn
        >>> row = bnswap.plan(nn.Sequential(nn.BatchNorm1d(4)))[0]
        >>> row.name, row.cls, row.action, row.backend, row.kernel, row.adapter_name
        ('0', 'BatchNorm1d', 'swap', 'aten', 'Native', 'bnswap.layers.batch_norm_forward')
        >>> model = nn.Sequential(nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm1d(4)))
        >>> row = bnswap.plan(model, "ort", exclude="0.1", wrap="children")[0]
        >>> row.backend, row.placement
        ('aten', 'eager: its top-level module holds a layer that is not swapped')
    """

    name: str
    cls: str
    action: str
    reason: str
    backend: str
    adapter: Adapter | None = None
    module: nn.Module | None = field(default=None, repr=False, compare=False)
    lazy: bool = False
    already: bool = False
    excluded: bool = False
    device: torch.device | str | None = field(default=None, repr=False, compare=False)
    sync_class: type | None = None
    process_group: object = field(default=None, repr=False, compare=False)
    placement: str | None = field(default=None, repr=False)  # (the reason ends with it)

    @property
    def synchronized(self) -> bool:
        """Whether the swapped layer synchronizes its training statistics (a
        ``SyncBatchNorm``, or becoming one)."""
        return self.action != "skip" and (
            self.sync_class is not None or isinstance(self.module, nn.SyncBatchNorm)
        )

    @property
    def sync(self) -> str:
        """Over what the layer synchronizes in training, for example ``"WORLD, 2 ranks"``, ``"group
        of 4 ranks"``, ``"WORLD after init_process_group; unsynchronized before"`` (before
        ``torch.distributed.init_process_group`` training normalizes with this process's
        batch alone, as stock ``SyncBatchNorm`` does); ``"-"`` for a layer that does not
        synchronize."""
        if not self.synchronized:
            return "-"
        group = (
            self.process_group
            if self.sync_class is not None
            else getattr(self.module, "process_group", None)
        )
        return describe_group(group)

    def _synchronizes_now(self) -> bool:
        return self.synchronized and self.sync.endswith("ranks")

    @property
    def adapter_name(self) -> str:
        """``module.function`` of :attr:`adapter`, ``"-"`` when there is none."""
        return qualified_name(self.adapter) if self.adapter is not None else "-"

    @property
    def kernel(self) -> str:
        """The kernel this layer runs with on :attr:`device`, by torch's rule
        (``bnswap.plan.select_kernel``, :mod:`bnswap.kernels`) for ``aten``: ``"Native"`` on CPU,
        ``"Cudnn"`` on NVIDIA GPUs where the rule holds, both modes where they differ
        (``"Cudnn; eval Native"`` for an affine=False layer);
        ``"Sync (Native); eval Native"`` for a layer that synchronizes over more than
        one rank (:func:`bnswap.sync.sync_kernel`: the device's kernels in the slots of
        bnswap's one formulation; in eval the unsynchronized layer's kernel);
        ``"BatchNormInternal (ORT)"`` for ``ort``, ``"-"`` when skipped. Computed when
        read (a probe per layer: it cost more than convert itself on large models,
        benchmarks P5)."""
        if self.action == "skip" or self.module is None:
            return "-"
        fixed = backend_named(self.backend).kernel
        if fixed is not None:
            return fixed
        if self._synchronizes_now():  # in eval: the unsynchronized layer's call
            dev = self.device if self.device is not None else kernels.layer_device(self.module)
            eval_kernel = kernels.layer_kernel(self.module, dev, training=False)
            return f"{sync_kernel(dev)}; eval {eval_kernel}"
        return select_kernel(self.module, self.device)

    def to_dict(self) -> dict[str, str]:
        """The table's columns as plain strings (for logging or JSON); :attr:`placement`
        is no key of its own: the reason holds it, as the table does."""
        return {
            "name": self.name,
            "cls": self.cls,
            "action": self.action,
            "reason": self.reason,
            "backend": self.backend,
            "kernel": self.kernel,
            "adapter": self.adapter_name,
            "sync": self.sync,
        }


class Plan(Rows[PlanRow]):
    """The rows of a conversion, in ``named_modules()`` order.

    ``str(plan)`` is an aligned text table; ``plan.swapped`` / ``plan.skipped`` are the
    rows by action; ``plan.to_dicts()`` gives plain dicts (for logging or JSON);
    :meth:`apply` carries it out.

    Args:
        rows: the rows.
        model: the model planned (what :meth:`apply` returns or wraps).
        backend: ``"aten"`` or ``"ort"``.
        wrap: ``"model"`` or ``"children"`` (see :func:`plan`).
        to_wrap: the names of the direct children :meth:`apply` wraps, for
            ``wrap="children"`` on a wrapping backend.

    Examples::

        >>> import bnswap
        >>> from torch import nn
        >>> p = bnswap.plan(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
        >>> p
        Plan(1 swap, 0 skip)
        >>> p.to_dicts()[0]["kernel"], len(p.swapped), len(p.skipped)
        ('Native', 1, 0)
    """

    def __init__(
        self,
        rows: Sequence[PlanRow],
        model: nn.Module | None = None,
        backend: str = "aten",
        parents: dict[int, list[tuple[nn.Module, str]]] | None = None,
        wrap: str = "model",
        to_wrap: Sequence[str] = (),
    ):
        self.rows: tuple[PlanRow, ...] = tuple(rows)
        self.model = model
        self.backend = backend_named(backend).name
        self.wrap = wrap
        self.to_wrap: tuple[str, ...] = tuple(to_wrap)
        # id(layer) -> (parent, key) of every place it sits: where apply() puts the
        # SyncBatchNorm a sync_batchnorm=True row makes
        self._parents = parents or {}

    counted = "BatchNorm layers"

    def apply(self) -> nn.Module:
        """Swap every layer the plan swaps and is not swapped yet; with
        ``backend="ort"``, then wrap the model in ONNX Runtime's ``ORTModule``
        (:func:`bnswap.ort.wrap`; not when the model has no BatchNorm layer), or, with
        ``wrap="children"``, each child named in :attr:`to_wrap` (in place).

        Atomic: on any error (``KeyboardInterrupt`` included) every swap done so far is
        undone and the error raised; the model is as it was. Only a successful apply sets
        ``applied`` (:meth:`summary` then says "swapped", not "would be swapped").

        Returns:
            The model, or its ORT wrapper: what :func:`bnswap.convert` returns and
            :func:`bnswap.revert` takes.

        Raises:
            ValueError: the plan has no model.
            bnswap.ort.ORTBackendError: what :func:`bnswap.ort.wrap` raises, for
                ``backend="ort"``; its ``UnsupportedLayerError`` for a ``SyncBatchNorm``
                there.

        Examples::

            >>> import bnswap
            >>> from torch import nn
            >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
            >>> p = bnswap.plan(model)
            >>> print(p.summary())
            bnswap plan: 1 of 1 BatchNorm layers would be swapped, 0 skipped
            >>> p.apply() is model, bnswap.is_swapped(model[1])
            (True, True)
            >>> print(p.summary())
            bnswap: 1 of 1 BatchNorm layers swapped, 0 skipped
        """
        if self.model is None:
            raise ValueError("this Plan has no model to apply to (build it with bnswap.plan)")
        backend = backend_named(self.backend)
        if not backend.synchronizes and self.wrap == "model":
            _refuse_sync(self.rows, backend)
        if self.refused:  # every layer it cannot run, named, before anything changes
            blocking = [f"{r.name!r} ({r.reason.partition('; ')[0]})" for r in self.skipped]
            blocking = blocking or [
                f"{r.name!r} is an uninitialized {r.cls}" for r in self.swapped if r.lazy
            ]
            raise backend.unsupported_error(backend.refusal(blocking, skipped=bool(self.skipped)))
        undos: list[Callable[[], None]] = []
        model = self.model
        try:
            for r in self.rows:
                if r.action == "swap" and r.sync_class is not None:
                    assert r.adapter is not None and r.module is not None
                    layer = to_sync_batch_norm(r.module, r.process_group, r.sync_class)
                    swap(layer, r.adapter)
                    for parent, key in self._parents.get(id(r.module), ()):
                        undos.append(functools.partial(parent._modules.__setitem__, key, r.module))
                        parent._modules[key] = layer
                    if r.module is model:
                        model = layer
                elif r.action == "swap":
                    assert r.adapter is not None and r.module is not None
                    # the undo is taken before the swap, so an interrupt between the
                    # two (a KeyboardInterrupt) cannot leave a layer swapped
                    undos.append(undo_of(r.module))
                    swap(r.module, r.adapter)
                elif r.action == "skip" and r.module is not None and SWAP in r.module.__dict__:
                    # a skipped layer that holds a swap: one its class's forward, replaced
                    # since (a class-level patch), no longer runs (bypass_of). Dropped, so
                    # that a dispatcher put on that class again cannot revive it
                    undos.append(undo_of(r.module))
                    del r.module.__dict__[SWAP]
            if backend.wraps and self.wrap == "children":
                for key in self.to_wrap:
                    child = model._modules[key]
                    assert child is not None
                    wrapped = backend.wrap(child)
                    undos.append(functools.partial(model._modules.__setitem__, key, child))
                    # not setattr: torch's module registration hooks would see a new child
                    model._modules[key] = wrapped
            elif backend.wraps and self.rows and not backend.is_wrapper(self.model):
                model = backend.wrap(self.model)
        except BaseException:
            for undo in reversed(undos):
                undo()
            raise
        self.applied = True  # the summary says what was done from now on
        return model  # (an ORT wrapper exports again on its next call)

    def __str__(self) -> str:
        header: tuple[str, ...] = (
            "layer",
            "class",
            "action",
            "backend",
            "kernel",
            "adapter",
            "reason",
        )
        body: list[tuple[str, ...]] = [
            (r.name, r.cls, r.action, r.backend, r.kernel, r.adapter_name, r.reason)
            for r in self.rows
        ]
        if any(r.synchronized for r in self.rows):  # the sync column only when it says something
            header = (*header[:-1], "sync", header[-1])
            body = [(*b[:-1], r.sync, b[-1]) for b, r in zip(body, self.rows, strict=True)]
        if not body:
            return self.summary() + " (the model has no BatchNorm layers)"
        # Every column but the last (the reason, not padded) as wide as its widest cell.
        widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header) - 1)]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(
                [*(str(c).ljust(w) for c, w in zip(cells, widths, strict=False)), str(cells[-1])]
            )

        rule = line(["-" * w for w in widths] + ["-" * len(header[-1])])
        return "\n".join([self.summary(), line(header), rule, *(line(b) for b in body)])

    @property
    def refused(self) -> bool:
        """Whether :meth:`apply` refuses the model as planned: a backend that wraps the
        whole model (``"ort"``) with a row it cannot run (a skipped layer, an
        uninitialized lazy one)."""
        return bool(self._refusal())

    def _refusal(self) -> str:
        """What the backend cannot run in this plan, or ``""``."""
        backend = backend_named(self.backend)
        if self.wrap != "model":
            return ""
        if not backend.runs_skipped and self.skipped:
            return "a skipped layer"
        if not backend.runs_uninitialized and any(r.lazy for r in self.swapped):
            return "an uninitialized lazy layer: run one forward first"
        return ""

    def summary(self) -> str:
        """``"bnswap plan: N of M BatchNorm layers would be swapped, K skipped"``
        (``"bnswap: N of M BatchNorm layers swapped, K skipped"`` once ``applied``;
        see ``Rows.summary`` in ``bnswap._rows``), and when :attr:`refused`, that convert
        refuses the model (so nothing would change)."""
        text = super().summary()
        refusal = self._refusal()
        if refusal:  # (nothing would change, said once: at the end)
            text = text.removesuffix(": nothing would change")
            backend = backend_named(self.backend)
            text += (
                f"; convert(backend={backend.name!r}) refuses this model ({backend.runtime} "
                f"cannot run {refusal}): nothing would change"
            )
        return text

    def __repr__(self) -> str:
        return f"Plan({self._counts()})"


_NONE: tuple[()] = ()


def _refuse_sync(rows: Sequence[PlanRow], backend: Backend) -> None:
    """Raise the backend's error for a SyncBatchNorm it would run (ONNX Runtime's
    BatchNormInternal computes each process's own statistics)."""
    for r in rows:
        if isinstance(r.module, nn.SyncBatchNorm) and not r.reason.startswith(
            ("excluded", "not matched")
        ):
            raise backend.sync_error(r.name)


def _bn_parent(name: str, rows: dict[str, PlanRow]) -> PlanRow | None:
    """The row of the innermost BatchNorm layer that holds the layer ``name`` (a
    submodule of it, as timm's ``SplitBatchNorm2d`` holds its ``aux_bn``), or None."""
    while "." in name:
        name = name.rpartition(".")[0]
        if name in rows:
            return rows[name]
    return rows.get("") if name and "" in rows else None


def _row(
    name: str,
    m: nn.Module,
    cls: type,
    backend: Backend,
    device: torch.device | str | None,
    action: str,
    reason: str,
    adapter: Adapter | None = None,
    **kw: Any,
) -> PlanRow:
    if (
        action == "skip"
        and backend.skip_note
        and not (backend.cannot_sync and reason.startswith(backend.cannot_sync))
    ):
        reason += "; " + backend.skip_note
    # PlanRow's own __init__ (a frozen dataclass: one object.__setattr__ per field) took
    # most of convert's time per layer (benchmarks P5); the same fields, set at once
    row = _new_row(PlanRow)
    fields_ = row.__dict__
    fields_.update(_ROW_DEFAULTS)
    fields_.update(
        name=name or "(root)",
        cls=cls.__name__,
        action=action,
        reason=reason or "-",
        backend=backend.name if action != "skip" else "-",
        adapter=adapter,
        module=m,
        device=device,
        **kw,
    )
    return row


_new_row = object.__new__
#: PlanRow's fields that have a default, with it (_row sets the others).
_ROW_DEFAULTS = {f.name: f.default for f in fields(PlanRow) if f.default is not MISSING}


#: The reason of a layer whose forward is an instance attribute.
_SET_ON_INSTANCE = (
    "its forward is set on the instance (by a library's hook, e.g. accelerate's, or by "
    "hand); swapping would drop it"
)


def plan_layers(
    module: nn.Module,
    backend: str = "aten",
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    device: torch.device | str | None = None,
    sync_batchnorm: bool = False,
    process_group: object = None,
    wrap: str = "model",
) -> tuple[Plan, list[tuple[str, Pattern | None]]]:
    """The module road's plan (:func:`bnswap.plan` of a module comes here; its arguments):
    the plan of ``module``'s BatchNorm layers, warning nothing, and each include / exclude
    pattern that matches no layer as ``("include" | "exclude", pattern)``, which
    :func:`warn_unmatched` warns about (``bnswap.convert`` of a GraphModule holding
    batch-norm nodes too warns only about a pattern that matches neither); ``("include",
    None)`` for an empty ``include`` (:data:`EMPTY_INCLUDE`)."""
    check_module(module, "plan")
    be = backend_named(backend)
    if wrap not in WRAP_SCOPES:
        raise ValueError(
            f"unknown wrap {wrap!r}; choose one of {', '.join(map(repr, WRAP_SCOPES))}"
        )
    if sync_batchnorm and not be.synchronizes:
        raise be.sync_error()
    kernels.check_device(device)  # an unknown device type fails here, not in the table
    wrapper, module = module, be.model_of(module)  # (an ORT wrapper: the model inside)
    inc = pattern_list(include, "include")
    exc = pattern_list(exclude, "exclude")
    patterns = [("exclude", i, p) for i, p in enumerate(exc)]
    patterns += [("include", i, p) for i, p in enumerate(inc)]
    used: set[tuple[str, int]] = set()
    rows: list[PlanRow] = []
    # the rows of BatchNorm layers that hold submodules (qualified name as named_modules
    # gives it): the only ones another layer can be part of (_bn_parent)
    by_name: dict[str, PlanRow] = {}
    for name, m in module.named_modules(remove_duplicate=True):
        if not isinstance(m, _BatchNorm):
            continue
        cls, current = type_before_parametrizations(m), adapter_of(m)
        # a pattern: a glob on the qualified name, or a class the layer is an instance of
        # (no list per layer without patterns: on 10,000-layer models the garbage
        # collector's passes over the model, not this loop, set convert's time)
        hits = (
            [
                (kind, i)
                for kind, i, p in patterns
                if (isinstance(m, p) if isinstance(p, type) else fnmatchcase(name, p))
            ]
            if patterns
            else _NONE
        )
        used.update(hits)
        hit_exc = [i for kind, i in hits if kind == "exclude"] if hits else _NONE
        hit_inc = [i for kind, i in hits if kind == "include"] if hits else _NONE
        lazy = isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()
        uninit = f"uninitialized {cls.__name__}: keeps the swap when it initializes" if lazy else ""
        # a BatchNorm layer inside another (timm's SplitBatchNorm2d and its aux_bn, which
        # its adapter calls) follows it: left out with it, chosen with it, synchronized
        # only with it (a half-converted layer otherwise)
        parent = _bn_parent(name, by_name) if by_name else None
        if hit_exc:
            left_out: str | None = f"excluded by {pattern_str(exc[hit_exc[0]])}"
        elif parent is not None:
            left_out = (
                f"excluded with the BatchNorm layer it is part of, {parent.name!r}"
                if parent.excluded
                else None
            )
        else:
            left_out = "not matched by include" if include is not None and not hit_inc else None
        to_sync = (
            sync_class(cls)
            if sync_batchnorm
            and type(m) is cls
            and left_out is None
            and (parent is None or parent.synchronized)
            else None
        )
        row = functools.partial(_row, name, m, cls, be, device)
        if to_sync is not None and (current is not None or "forward" not in vars(m)):
            rows.append(
                row(
                    "swap",
                    SYNC_REASONS.get(to_sync.__name__, SYNC_REASON).format(to_sync.__name__),
                    registry.lookup(to_sync),
                    sync_class=to_sync,
                    process_group=process_group,
                )
            )
        elif current is not None:
            reason = "already swapped" + ("; " + uninit if lazy else "")
            rows.append(row("keep", reason, current, lazy=lazy, already=True))
        elif left_out is not None:
            rows.append(row("skip", left_out, excluded=True))
        elif isinstance(m, nn.SyncBatchNorm) and not be.synchronizes and wrap == "model":
            refused = type(be.sync_error(name)).__name__
            rows.append(row("skip", f"{be.cannot_sync} (convert refuses the model: {refused})"))
        elif "forward" in vars(m):
            rows.append(row("skip", _SET_ON_INSTANCE))
        elif (adapter := registry.lookup(cls)) is not None:
            note = uninit.replace("keeps", "swapped now, keeps")
            if sync_batchnorm and not isinstance(m, nn.SyncBatchNorm):
                why = (
                    NOT_SYNCED
                    if parent is None or parent.synchronized
                    else f"not synchronized: part of {parent.name!r}, which is not"
                )
                note = "; ".join(filter(None, [note, why]))
            rows.append(row("swap", note, adapter, lazy=lazy))
        else:
            replaced = registry.replaced_forward(cls)
            rows.append(
                row(
                    "skip",
                    (
                        f"{replaced[0].__name__}.forward is not torch's (a class-level patch "
                        f"put {qualified_name(replaced[1])} there); swapping would drop it"
                        if replaced is not None
                        else f"{cls.__name__} overrides forward; swapping would drop it "
                        "(pytorch issue 187298)"
                    )
                    + f"; register an adapter: bnswap.register({cls.__name__}, <function>), "
                    "see the 'Adapters' guide of bnswap's documentation"
                    + (
                        "; convert drops its swap, made before the patch (it no longer runs)"
                        if SWAP in m.__dict__
                        else ""
                    ),
                )
            )
        if m._modules:
            by_name[name] = rows[-1]
    unmatched: list[tuple[str, Pattern | None]] = [
        (kind, p)
        for kind, pats in (("include", inc), ("exclude", exc))
        for i, p in enumerate(pats)
        if (kind, i) not in used
    ]
    if include is not None and not inc:
        unmatched.append(("include", None))  # include=[]: EMPTY_INCLUDE
    parents: dict[int, list[tuple[nn.Module, str]]] = {}
    if any(r.sync_class is not None for r in rows):
        for holder in module.modules():
            for key, child in holder._modules.items():
                if child is not None:
                    parents.setdefault(id(child), []).append((holder, key))
    to_wrap: list[str] = []
    if be.wraps and wrap == "children" and wrapper is module:  # (a wrapper: wrapped whole)
        rows, to_wrap = place_children(rows, module, be)
    return Plan(rows, wrapper, be.name, parents, wrap, to_wrap), unmatched


def warn_unmatched(unmatched: Sequence[tuple[str, Pattern | None]]) -> None:
    """Warn (:class:`UnmatchedPatternWarning`) about each include / exclude pattern that
    :func:`plan_layers` found matching no BatchNorm layer, and an empty ``include``."""
    for kind, p in unmatched:
        warn(
            EMPTY_INCLUDE
            if p is None
            else f"bnswap: {kind} pattern {pattern_str(p)} matches no BatchNorm layer",
            UnmatchedPatternWarning,
        )


def _named(rows: list[PlanRow], limit: int = 5) -> str:
    """``'a', 'b' and 3 more`` of the rows' qualified names."""
    names = ", ".join(repr(r.name) for r in rows[:limit])
    return names + (f" and {len(rows) - limit} more" if len(rows) > limit else "")


def _reasons(rows: list[PlanRow], drop: str = "") -> str:
    """``reason: 'a', 'b'; other reason: 'c'``, the rows grouped by their reason (its
    first clause, without the prefix ``drop``)."""
    by: dict[str, list[PlanRow]] = {}
    for r in rows:
        by.setdefault(r.reason.partition("; ")[0].removeprefix(drop), []).append(r)
    return "; ".join(f"{text}: {_named(rs)}" for text, rs in by.items())


def _left_unasked(todo: Plan, sync_batchnorm: bool) -> str:
    """The warning for the layers ``todo`` leaves on their own forward although the user's
    include / exclude did not leave them out, and with ``sync_batchnorm`` the swapped
    layers that stay unsynchronized: how many, why, and which (qualified names), or
    ``""``."""
    left = [r for r in todo.skipped if not r.excluded]
    unsynced = (
        [r for r in todo.rows if sync_batchnorm and r.action != "skip" and not r.synchronized]
        if sync_batchnorm
        else []
    )
    if not left and not unsynced:
        return ""
    of = len(todo)
    parts = []
    if left:
        n = len(left)
        what = (
            f"none of the model's {of} BatchNorm layers can be swapped"
            if n == of
            else f"{n} of the model's {of} BatchNorm layers {'was' if n == 1 else 'were'} "
            f"not swapped (kept {'its' if n == 1 else 'their'} own forward)"
        )
        parts.append(f"{what}: {_reasons(left)}")
        if any(".forward is not torch's (a class-level patch" in r.reason for r in left):
            parts.append(
                "a class whose forward a class-level patch replaced needs an adapter that "
                "does what that function does (bnswap.register; the 'Adapters' guide of "
                "bnswap's documentation)"
            )
        if any(r.reason.partition("; ")[0].endswith(" overrides forward") for r in left):
            parts.append(
                "a subclass that overrides forward needs an adapter "
                "(bnswap.register; the 'Adapters' guide of bnswap's documentation)"
            )
    if unsynced:
        n = len(unsynced)
        parts.append(
            f"{n} swapped layer{'s' if n > 1 else ''} stay{'' if n > 1 else 's'} "
            f"unsynchronized with sync_batchnorm=True: "
            f"{_reasons(unsynced, drop='not synchronized: ')}"
        )
    return "bnswap.convert: " + "; ".join(parts) + "; bnswap.plan(model) shows each layer and why"


def warn_left(todo: Plan, sync_batchnorm: bool = False) -> None:
    """``bnswap.convert``'s warnings about a plan it applied: the layers it left on their
    own forward although include / exclude did not leave them out, and with
    ``sync_batchnorm`` the swapped layers that stay unsynchronized (how many, why, which);
    or that the model has no BatchNorm layer at all (UserWarning)."""
    left = _left_unasked(todo, sync_batchnorm)
    if left:
        warn(left, UserWarning)
    elif not todo.rows:
        be = backend_named(todo.backend)
        warn(
            "bnswap.convert: the model has no BatchNorm layer; nothing was swapped"
            + (
                f"; it is not wrapped in {be.runtime} (as BNSwap(backend="
                f"{be.name!r}) leaves such modules eager)"
                if be.wraps and not be.is_wrapper(todo.model)
                else ""
            ),
            UserWarning,
        )


def revert_layers(module: nn.Module) -> nn.Module:
    """The module road's revert (:func:`bnswap.revert` of a module comes here): every
    swapped layer of ``module`` runs its class's own forward again, its internal buffers
    gone, and each ``SyncBatchNorm`` that ``sync_batchnorm=True`` made is replaced by the
    original layer object it shares its state with (:func:`bnswap.sync.original_of`).
    Returns ``module``, or the original layer when ``module`` itself is such a
    SyncBatchNorm."""
    modules = list(module.modules())  # an ORT wrapper's modules() include the model's
    # One pass over the modules, testing their __dict__ before calling anything: the
    # per-module calls cost more than the traversal itself (benchmarks P5).
    stand_ins = False
    for m in modules:
        d = m.__dict__
        stand_ins = stand_ins or ORIGINAL in d
        if SWAP in d or m._buffers:  # (what unswap removes: the mark, internal buffers)
            unswap(m)
    if stand_ins:  # SyncBatchNorm layers convert(..., sync_batchnorm=True) put in
        first = len(modules)
        for parent in modules:  # (the originals put back are visited too)
            for key, child in parent._modules.items():
                if child is None or ORIGINAL not in child.__dict__:
                    continue
                original = original_of(child)
                if original is not None:
                    parent._modules[key] = original
                    modules.append(original)
        for m in modules[first:]:
            unswap(m)
    root = original_of(module)
    return module if root is None else root
