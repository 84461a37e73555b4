"""The front door: ``bnswap.convert``, ``bnswap.plan`` and ``bnswap.revert``.

Each looks once at what it is given (:func:`_road`) and hands it to one road:

* the **module road** (:mod:`bnswap.plan`): an ``nn.Module``'s BatchNorm layers, planned
  (``plan_layers``), swapped atomically (``Plan.apply``: the layer keeps its class,
  module, Parameter and buffer objects, flags, hooks and state_dict keys) and swapped
  back exactly (``revert_layers``);
* the **program road** (:mod:`bnswap.programs`): the batch-norm nodes of a
  ``torch.export.ExportedProgram``, or of a ``torch.fx.GraphModule`` that holds no
  BatchNorm layer (``ep.module()``, a pt2e prepared graph), planned, rewritten and
  rewritten back (``to_stock_ops``).

A GraphModule holding both BatchNorm layers and batch-norm nodes takes both roads in
``convert`` and ``revert`` (``plan`` of it lists its layers). Neither road calls the
other; a graph holding the consolidated ops applies bnswap's patches here, once.
"""

from __future__ import annotations

from typing import Literal, TypeVar, overload

import torch
from torch import nn
from torch.fx import GraphModule
from torch.nn.modules.batchnorm import _BatchNorm

from bnswap import programs
from bnswap._log import info, logger
from bnswap._patterns import EMPTY_INCLUDE, Patterns, pattern_list
from bnswap._warn import UnmatchedPatternWarning, warn
from bnswap.plan import Plan, plan_layers, revert_layers, warn_left, warn_unmatched
from bnswap.programs import ProgramPlan

__all__ = ["convert", "plan", "revert"]

#: The module type ``convert`` returns in place (``backend="aten"``: the same object).
_M = TypeVar("_M", bound=nn.Module)

#: The roads (:func:`_road`).
MODULE, PROGRAM, BOTH = "module", "program", "both"


def _road(obj: object, fn: str) -> str:
    """Which road ``obj`` takes, decided once: :data:`PROGRAM` for an ``ExportedProgram``
    or a GraphModule with batch-norm nodes (stock's or consolidated) and no BatchNorm
    layer; :data:`BOTH` for a GraphModule with both; :data:`MODULE` for any other
    ``nn.Module``. A program or graph holding consolidated nodes applies bnswap's patches
    (:func:`bnswap.programs.install_patches_for`: torchao's pt2e flow needs them for a
    loaded ``.pt2`` even when nothing changes).

    Raises:
        TypeError: ``obj`` is neither a program nor an ``nn.Module`` (``fn`` names the call).
    """
    if isinstance(obj, torch.export.ExportedProgram):
        road = PROGRAM
    elif not isinstance(obj, nn.Module):
        raise TypeError(f"bnswap.{fn}() expects a torch.nn.Module, got {type(obj).__name__}")
    elif not isinstance(obj, GraphModule) or not programs.stock_nodes(obj, consolidated=True):
        return MODULE
    else:
        road = BOTH if any(isinstance(m, _BatchNorm) for m in obj.modules()) else PROGRAM
    programs.install_patches_for(obj)
    return road


@overload
def convert(
    module: torch.export.ExportedProgram,
    backend: str = "aten",
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    sync_batchnorm: bool = False,
    process_group: object = None,
) -> torch.export.ExportedProgram: ...
@overload
def convert(
    module: _M,
    backend: Literal["aten"] = "aten",
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    sync_batchnorm: bool = False,
    process_group: object = None,
) -> _M: ...
@overload
def convert(
    module: nn.Module,
    backend: str = "aten",
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    sync_batchnorm: bool = False,
    process_group: object = None,
) -> nn.Module: ...
def convert(
    module: nn.Module | torch.export.ExportedProgram,
    backend: str = "aten",
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    sync_batchnorm: bool = False,
    process_group: object = None,
) -> nn.Module | torch.export.ExportedProgram:
    """Swap every BatchNorm layer of ``module`` onto bnswap's kernel, in place.

    Recursive over ``module.named_modules()`` (the root included). Idempotent: swapped
    layers stay as they are, layers added since the last call (a new head, a layer a
    finetuning step rebuilt) are swapped. Atomic: if any layer cannot be converted, the
    model is left exactly as it was and the error is raised. What is not swapped is
    reported: the plan's table (``bnswap.plan``) is logged by the ``bnswap`` logger at
    INFO, once per job (on global rank zero; at DEBUG on the other ranks: a
    ``torchrun`` job of N processes logs it once, not N times), and a layer left on its
    own forward that the user did not exclude (a subclass that overrides ``forward``
    with no registered adapter, pytorch issue 187298) warns. ``nn.SyncBatchNorm`` layers are
    swapped onto bnswap's synchronized forward (:mod:`bnswap.sync`: global batch statistics
    over their ``process_group`` in training, on any device and backend; the
    unsynchronized path otherwise).

    A swapped layer keeps its class (``type(layer) is nn.BatchNorm2d``) and runs
    ``aten._batch_norm_with_update`` (pytorch PR 116092) in training and stock's
    ``aten.batch_norm`` in evaluation, in eager, ``torch.compile`` and ``torch.export``, on
    every device; what hands the model to another runtime
    records stock's ops (``torch.jit.script`` / ``trace``, ``torch.onnx.export``; see the
    guide "After training", ``docs/after-training.md``).

    Given a ``torch.export.ExportedProgram``, returns a new program whose batch-norm
    nodes run the consolidated ops (:func:`bnswap.programs.convert`); given a
    ``torch.fx.GraphModule``, its BatchNorm submodules are swapped and its batch-norm
    ``call_function`` nodes rewritten, in place. A program or graph that holds the
    consolidated ops already (a ``.pt2`` that ``bnswap convert`` wrote, loaded with
    ``torch.export.load``) is left as it is and applies bnswap's patches, as a first swap
    does: torchao's pt2e flow then treats it as stock's (``docs/qat.md``).

    Args:
        module: any ``nn.Module``; a BatchNorm layer itself is converted too; or a
            ``torch.export.ExportedProgram``.
        backend: ``"aten"``: PyTorch's consolidated batch-norm ops. ``"ort"``: the same
            swap, then the model is wrapped in ONNX Runtime's ``ORTModule``, which runs
            its layers as ``com.microsoft::BatchNormInternal`` (needs ``bnswap[ort-cpu]``
            or ``bnswap[ort]``; see :mod:`bnswap.ort`). A model with no BatchNorm layer
            is not wrapped.
        include, exclude: glob pattern(s) on qualified names (as in ``named_modules()``)
            and/or classes, or an iterable of them. A pattern that matches no BatchNorm
            layer warns. ``include=None`` (the default) includes every layer; an empty
            ``include`` (``[]``) includes none: nothing is swapped, and a warning says so.
        sync_batchnorm: also turn every ``nn.BatchNorm1d/2d/3d`` (exact class, not
            parametrized) into a swapped ``nn.SyncBatchNorm`` (timm's ``BatchNormAct2d``
            into timm's ``SyncBatchNormAct``) that shares its Parameter, buffer and hook
            objects (an optimizer built before stays valid); :func:`revert` puts the
            original module objects back. The layers synchronize in training once a
            process group is initialized (before or after this call).
        process_group: the converted layers' ``process_group`` (None: WORLD).

    Returns:
        ``module`` itself; with ``backend="ort"``, the ``ORTModule`` wrapping it. Given a
        wrapper that ``backend="ort"`` returned, with ``backend="ort"``: that wrapper
        (layers added inside since are swapped). With ``sync_batchnorm=True`` and a
        BatchNorm layer as ``module``: the new ``SyncBatchNorm``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; a pattern is not str or class.
        ValueError: unknown ``backend``; ``backend="aten"`` on an ORT wrapper (it would
            keep running ONNX Runtime: convert ``wrapper.module`` instead).
        bnswap.ort.ORTNotAvailableError: (an ImportError) ``backend="ort"`` without ONNX
            Runtime training installed.
        bnswap.ort.errors.UnsupportedLayerError: (a TypeError) ``backend="ort"`` with
            ``sync_batchnorm=True`` or a model holding a ``SyncBatchNorm`` (ONNX Runtime
            cannot synchronize statistics across processes).

    Warns:
        UserWarning: the model has no BatchNorm layer; or some of its layers are left on
            their own forward for a reason other than ``include`` / ``exclude`` (once per
            call: how many, and why, pointing to ``bnswap.plan(model)``).

    Examples::

        >>> import torch, bnswap
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> bnswap.convert(model) is model
        True
        >>> bnswap.is_swapped(model[1]), type(model[1]).__name__
        (True, 'BatchNorm2d')
        >>> bnswap.revert(model) is model and not bnswap.is_swapped(model[1])
        True
        >>> bn = model[1]
        >>> bnswap.convert(model, sync_batchnorm=True)[1]
        SyncBatchNorm(8, eps=1e-05, momentum=0.1, affine=True, bias=True, track_running_stats=True)
        >>> model[1].weight is bn.weight, bnswap.is_swapped(model[1])
        (True, True)
        >>> bnswap.revert(model)[1] is bn
        True
    """
    road = _road(module, "convert")
    if road is PROGRAM:
        if sync_batchnorm:
            raise ValueError(
                "bnswap.convert: sync_batchnorm=True converts modules; a program's "
                "batch-norm nodes have no process group (convert the model, "
                "then export it)"
            )
        # a class as a pattern: programs.plan raises its TypeError (node names only)
        nodes = programs.plan(module, backend, include=include, exclude=exclude)  # type: ignore[arg-type]  # see above
        program = nodes.apply()
        _log(nodes)
        return program
    assert isinstance(module, nn.Module)  # _road: a module
    if road is BOTH:  # both roads read the patterns: listed once (a generator is read once)
        include = None if include is None else pattern_list(include, "include")
        exclude = pattern_list(exclude, "exclude")
    todo, unmatched = plan_layers(
        module,
        backend,
        include=include,
        exclude=exclude,
        sync_batchnorm=sync_batchnorm,
        process_group=process_group,
    )
    graph_nodes = None
    if road is BOTH:
        # its BatchNorm layers and its batch-norm call_function nodes: a pattern may name
        # either, so it warns only when it matches neither (once)
        assert isinstance(module, GraphModule)  # _road: a graph with layers and nodes
        # (a class pattern: the program road's TypeError, nodes have names only)
        graph_nodes, no_node = programs.plan_nodes(module, include=include, exclude=exclude)
        for kind, p in unmatched:
            if (kind, p) in no_node:
                warn(
                    EMPTY_INCLUDE
                    if p is None
                    else f"bnswap: {kind} pattern {p!r} matches no BatchNorm layer and "
                    "no batch-norm node",
                    UnmatchedPatternWarning,
                )
    else:
        warn_unmatched(unmatched)
    out = todo.apply()
    if graph_nodes is not None:  # its batch-norm call_function nodes too, in place
        graph_nodes.apply()
    warn_left(todo, sync_batchnorm)
    _log(todo)
    return out


def _log(todo: Plan | ProgramPlan) -> None:
    """The applied plan's table to the ``bnswap`` logger at INFO, once per job (on rank
    zero); where logging is not configured at all, its summary line to stderr, once per
    process. (str() computes the kernel column, a probe per row: only when it is logged.)"""
    info(
        logger,
        "%s",
        todo,
        unconfigured_line=(
            f"bnswap.convert: {todo.summary().partition(': ')[2]}; for the per-layer "
            "table call logging.basicConfig(level=logging.INFO)"
        ),
    )


@overload
def plan(
    module: torch.export.ExportedProgram,
    backend: str = "aten",
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    device: torch.device | str | None = None,
    sync_batchnorm: bool = False,
    process_group: object = None,
    wrap: str = "model",
) -> ProgramPlan: ...
@overload
def plan(  # type: ignore[overload-overlap]  # a GraphModule is an nn.Module: it matches first
    module: torch.fx.GraphModule,
    backend: str = "aten",
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    device: torch.device | str | None = None,
    sync_batchnorm: bool = False,
    process_group: object = None,
    wrap: str = "model",
) -> Plan | ProgramPlan: ...
@overload
def plan(
    module: nn.Module,
    backend: str = "aten",
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    device: torch.device | str | None = None,
    sync_batchnorm: bool = False,
    process_group: object = None,
    wrap: str = "model",
) -> Plan: ...
def plan(
    module: nn.Module | torch.export.ExportedProgram,
    backend: str = "aten",
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    device: torch.device | str | None = None,
    sync_batchnorm: bool = False,
    process_group: object = None,
    wrap: str = "model",
) -> Plan | ProgramPlan:
    """What :func:`bnswap.convert` would do to ``module``, without changing it.

    A layer is swapped unless it is excluded or overrides ``forward`` with no registered
    adapter (pytorch issue 187298; :func:`bnswap.register`). A ``SyncBatchNorm`` is
    swapped onto bnswap's synchronized forward (:mod:`bnswap.sync`); with
    ``sync_batchnorm=True``, every ``BatchNorm1d/2d/3d`` (and timm's ``BatchNormAct2d``)
    becomes one.

    Given a ``torch.export.ExportedProgram`` (or a GraphModule holding batch-norm
    nodes and no BatchNorm layer, such as ``ep.module()``), returns one row per
    batch-norm node instead (:func:`bnswap.programs.plan`). A GraphModule holding
    consolidated nodes applies bnswap's patches, as a first swap does (``docs/qat.md``).

    Args:
        module: any ``nn.Module``, or a program.
        backend: ``"aten"`` (consolidated aten ops) or ``"ort"`` (ONNX Runtime's
            ``com.microsoft::BatchNormInternal``).
        include, exclude: glob pattern(s) on qualified names from ``named_modules()``
            and/or classes (matched with ``isinstance``), or an iterable of them; a layer
            is swapped only if it matches ``include`` (when given: an empty ``include``,
            ``[]``, matches no layer, and warns so) and no ``exclude``.
        device: where to evaluate the kernel column
            (``torch._C._select_batch_norm_backend``); default: where each layer's
            parameters live.
        sync_batchnorm: convert ``nn.BatchNorm1d/2d/3d`` layers (exact classes, not
            parametrized) to swapped ``nn.SyncBatchNorm`` layers sharing their Parameter
            and buffer objects, and timm's ``BatchNormAct2d`` to timm's
            ``SyncBatchNormAct``; other BatchNorm classes are swapped unsynchronized
            (the reason says so).
        process_group: the converted layers' ``process_group`` (None: WORLD).
        wrap: for a backend that wraps (``"ort"``): ``"model"`` wraps the whole model;
            ``"children"`` wraps each direct child whose BatchNorm layers are all swapped
            and initialized (what :class:`bnswap.lightning.BNSwap` does: a LightningModule cannot be
            wrapped), and the swapped layers of the other children run eager on aten
            (their rows say so). Ignored for ``"aten"``.

    Returns:
        A :class:`Plan` (``plan.apply()`` carries it out).

    Given an ORT wrapper (what ``backend="ort"`` returned), plans the model it wraps;
    :meth:`Plan.apply` then swaps what was added inside and returns the wrapper.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; a pattern is not str or class.
        ValueError: unknown ``backend`` or ``wrap``; ``backend="aten"`` for an ORT
            wrapper.
        RuntimeError: ``device`` is not a device torch knows (``"gpu"``: bnswap's
            message names torch's device types, and ``'cuda'`` for a GPU), before
            anything is planned. TypeError: ``device`` is no str or ``torch.device``.
        bnswap.ort.errors.UnsupportedLayerError: ``sync_batchnorm=True`` with
            ``backend="ort"`` (ONNX Runtime cannot synchronize statistics).

    Warns:
        UnmatchedPatternWarning: (a UserWarning) for each include / exclude pattern that
            matches no BatchNorm layer.

    Examples::

        >>> import bnswap
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SyncBatchNorm(8))
        >>> p = bnswap.plan(model)
        >>> print(p.summary())
        bnswap plan: 2 of 2 BatchNorm layers would be swapped, 0 skipped
        >>> [(r.name, r.adapter_name, r.sync) for r in p]  # doctest: +NORMALIZE_WHITESPACE
        [('1', 'bnswap.layers.batch_norm_forward', '-'),
         ('2', 'bnswap.sync.sync_batch_norm_forward',
          'WORLD after init_process_group; unsynchronized before')]
        >>> bnswap.is_swapped(model[1])  # a plan changes nothing
        False
        >>> [r.cls + (" -> " + r.sync_class.__name__ if r.sync_class else "")
        ...  for r in bnswap.plan(model, sync_batchnorm=True)]
        ['BatchNorm2d -> SyncBatchNorm', 'SyncBatchNorm']
    """
    road = _road(module, "plan")
    if road is PROGRAM:
        # a class as a pattern: programs.plan raises its TypeError (patterns are node names)
        return programs.plan(module, backend, include=include, exclude=exclude, device=device)  # type: ignore[arg-type]  # see above
    assert isinstance(module, nn.Module)  # _road: a program or a module
    todo, unmatched = plan_layers(
        module,
        backend,
        include=include,
        exclude=exclude,
        device=device,
        sync_batchnorm=sync_batchnorm,
        process_group=process_group,
        wrap=wrap,
    )
    warn_unmatched(unmatched)
    return todo


# a SyncBatchNorm that convert(..., sync_batchnorm=True) made gives back the layer it replaced
@overload
def revert(module: nn.SyncBatchNorm) -> nn.Module: ...
@overload
def revert(module: _M) -> _M: ...
def revert(module: nn.Module) -> nn.Module:
    """Undo :func:`convert`: every swapped layer runs its class's own forward again.

    Same module objects, same Parameter and buffer objects, same flags and hooks; only
    the instance attribute bnswap added (and the ORT backend's trace buffers) go. A
    ``SyncBatchNorm`` that ``convert(..., sync_batchnorm=True)`` made is replaced by the
    original layer object it shares its state with (its class and hooks; its flags,
    ``training``, ``momentum``, ``eps``, ..., taken from the SyncBatchNorm,
    :data:`bnswap.sync.FLAGS`). On an ORT wrapper, reverts the model
    inside and returns the wrapper (use ``wrapper.module``). On a ``torch.fx.GraphModule``
    (``ep.module()``, a pt2e prepared graph) its batch-norm ``call_function`` nodes on the
    consolidated ops go back to stock's ``aten.batch_norm`` too, in place
    (:func:`bnswap.to_stock_ops`), the inverse of ``convert(graph_module)``.

    Returns:
        ``module`` (the original layer when ``module`` is itself such a SyncBatchNorm):
        typed as ``module``'s own type (an ``nn.Module`` for a ``SyncBatchNorm``).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    Examples::

        >>> import bnswap
        >>> from torch import nn
        >>> bn = bnswap.convert(nn.BatchNorm1d(4))
        >>> bnswap.revert(bn) is bn, bnswap.is_swapped(bn), "_bnswap_swap" in vars(bn)
        (True, False, False)
    """
    if isinstance(module, torch.export.ExportedProgram):  # (not "expects a Module")
        raise TypeError(
            f"bnswap.revert() expects a torch.nn.Module, got {type(module).__name__}; a "
            "program's consolidated nodes go back to stock's ops with "
            "bnswap.to_stock_ops(program), which returns a new program"
        )
    road = _road(module, "revert")
    if road is not MODULE:  # its consolidated nodes, in place
        programs.to_stock_ops(module)  # type: ignore[call-overload]  # a GraphModule (_road)
    return revert_layers(module) if road is not PROGRAM else module
