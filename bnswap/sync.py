"""Synchronized BatchNorm on bnswap's path: ``nn.SyncBatchNorm`` layers, swapped.

A swapped ``nn.SyncBatchNorm`` keeps its class, Parameters, buffers, ``process_group``
and state_dict keys (like every bnswap swap, :mod:`bnswap._swap`); its forward is
:func:`sync_batch_norm_forward`:

* training in a process group of more than one rank (``process_group``, default
  ``torch.distributed.group.WORLD``): batch statistics of the *global* batch, the
  concatenation of every rank's input, on any device and backend (gloo, NCCL, ...).
  Each rank computes its per-channel count ``n_i``, mean and biased variance ``v_i =
  M2_i / n_i`` (M2: the sum of squared deviations from its own mean), one
  ``all_gather`` exchanges the packed (2C + 1,) tensor, and every rank combines them
  with Chan et al.'s pairwise formula (``mean = sum(n_i mean_i) / n``, ``M2 = sum(M2_i +
  n_i (mean_i - mean)^2)``), so uneven per-rank batches and empty ranks give the global
  batch's statistics, with no cancellation of raw sums of squares in float32.
  ``running_var`` takes the unbiased variance ``M2 / (n - 1)``; ``num_batches_tracked``
  and ``momentum=None`` (cumulative average) as stock. The backward needs the sums over
  the ranks of the packed (2C,) ``sum(dy)`` and ``sum(dy * (x - mean))``, by one
  ``all_gather`` (each rank adds the rows in rank order): the input gradient is the
  global batch's, parameter gradients are each rank's share (as stock SyncBatchNorm's;
  DDP averages them);
* evaluation, training without an initialized process group, or a group of one rank:
  exactly bnswap's unsynchronized path (:func:`bnswap.module_batch_norm`), bitwise equal
  to stock ``nn.BatchNorm`` (stock ``SyncBatchNorm`` raises on CPU when a group is
  initialized).

The work around the two collectives runs on the device's own batch-norm kernels where
they take the tensors (:data:`DEVICE_KERNELS`, :class:`Slots`; eager mode): on the CPU
ATen's native kernels (the per-rank statistics in one ``batch_norm_update_stats``, the
backward's two sums in one ``native_batch_norm_backward`` pass, the input gradient in
two passes), on CUDA stock SyncBatchNorm's (``batch_norm_stats``'s kernel,
``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``); elsewhere, and in code
being compiled, the same formulation in portable torch ops. The normalization itself is
stock's evaluation call, ``torch.batch_norm(..., training=False, ...)``, with the global
statistics: ``aten::batch_norm`` picks cuDNN / MIOpen / native on every device
(``aten._batch_norm_no_update`` has no kernel off the CPU: ``docs/design.md``, "The
evaluation op").

In eager mode the collectives are plain c10d calls; in code being compiled,
``torch.distributed._functional_collectives`` inside the ``torch.autograd.Function``, so
``torch.compile(fullgraph=True)`` captures a synchronized model without a graph break
(stock's masks the gathered statistics with a data-dependent index: pytorch issue
156680). Why the global combination stays in torch ops and what each choice costs:
``docs/design.md``, "Synchronized BatchNorm".

:func:`to_sync_batch_norm` / :func:`original_of` are ``convert(model,
sync_batchnorm=True)``'s two directions: a ``BatchNorm1d/2d/3d`` becomes an
``nn.SyncBatchNorm`` that shares its Parameter, buffer and hook objects, and
``bnswap.revert`` puts the original module object back.

This module and :mod:`bnswap._global_batch` (the per-rank steps, the slots and the
collectives, which it re-exports) are the only bnswap modules that run collectives
(``bnswap._log`` imports ``torch.distributed`` to read the rank only).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from bnswap._global_batch import (
    DEVICE_KERNELS,
    ONE_VALUE_MESSAGE,
    SYNC_KERNEL,
    GlobalStats,
    RankStats,
    Slots,
    _SyncBatchNorm,
    global_stats,
    rank_input_grad,
    rank_output,
    rank_stats,
    rank_sums,
    sync_kernel,
)
from bnswap._swap import SWAP
from bnswap.functional import (
    check_batch_norm_input,
    check_momentum,
    exponential_average_factor,
    module_batch_norm,
)

__all__ = [
    "DEVICE_KERNELS",
    "FLAGS",
    "NOT_SYNCED",
    "NO_GROUP_YET",
    "ONE_VALUE_MESSAGE",
    "ORIGINAL",
    "SYNC_CLASSES",
    "SYNC_KERNEL",
    "SYNC_REASON",
    "SYNC_REASONS",
    "GlobalStats",
    "RankStats",
    "Slots",
    "describe_group",
    "global_stats",
    "original_of",
    "rank_input_grad",
    "rank_output",
    "rank_stats",
    "rank_sums",
    "sync_batch_norm_forward",
    "sync_class",
    "sync_group",
    "sync_kernel",
    "synchronized_batch_norm",
    "to_sync_batch_norm",
]

#: The instance attribute (in ``__dict__``, never a submodule: not in the state_dict) of a
#: SyncBatchNorm that ``convert(..., sync_batchnorm=True)`` made, holding the original layer
#: in a 1-tuple: no Module value, so that code which copies a module's attributes with
#: ``setattr`` (higher's ``innerloop_ctx``) does not register it as a child.
ORIGINAL = "_bnswap_original"


def _world(layer: nn.Module) -> Any:
    group = getattr(layer, "process_group", None)
    return dist.group.WORLD if group is None else group


#: ``module.Class`` of a BatchNorm class -> ``module:Class`` of the synchronized class
#: ``sync_batchnorm=True`` turns it into (resolved when a model holds the source class, so
#: its package is already imported).
SYNC_CLASSES: dict[str, str] = {
    "torch.nn.modules.batchnorm.BatchNorm1d": "torch.nn:SyncBatchNorm",
    "torch.nn.modules.batchnorm.BatchNorm2d": "torch.nn:SyncBatchNorm",
    "torch.nn.modules.batchnorm.BatchNorm3d": "torch.nn:SyncBatchNorm",
    # timm's own synchronized class (what timm.layers.convert_sync_batchnorm makes): a
    # SyncBatchNorm keeping drop and act; bnswap.adapters.timm has its adapter
    "timm.layers.norm_act.BatchNormAct2d": "timm.layers.norm_act:SyncBatchNormAct",
}


def sync_class(cls: type) -> type | None:
    """The synchronized class ``convert(..., sync_batchnorm=True)`` turns layers of exactly
    ``cls`` into (``nn.SyncBatchNorm`` for ``nn.BatchNorm1d/2d/3d``, timm's
    ``SyncBatchNormAct`` for timm's ``BatchNormAct2d``), or None."""
    target = SYNC_CLASSES.get(f"{cls.__module__}.{cls.__qualname__}")
    if target is None:
        return None
    mod, _, name = target.partition(":")
    return getattr(importlib.import_module(mod), name, None)


#: The plan's reason for a swapped layer that ``sync_batchnorm=True`` leaves unsynchronized.
NOT_SYNCED = (
    "not synchronized: sync_batchnorm=True converts BatchNorm1d/2d/3d (exact "
    "class, not parametrized) and timm's BatchNormAct2d"
)


#: The plan's reason for a layer that ``sync_batchnorm=True`` turns into the class
#: :func:`sync_class` names (``str.format`` with its name), by that name.
SYNC_REASON = (
    "sync_batchnorm=True: becomes {}, same Parameter and buffer objects; bnswap.revert "
    "puts the original back"
)
SYNC_REASONS = {
    "SyncBatchNormAct": "sync_batchnorm=True: becomes timm's SyncBatchNormAct (timm's own "
    "synchronized class, as timm.layers.convert_sync_batchnorm makes; drop and act kept), "
    "same Parameter and buffer objects; bnswap.revert puts the original back"
}

#: The ``sync`` column of a synchronized layer over WORLD before
#: ``torch.distributed.init_process_group``: training then normalizes with this process's
#: batch alone (:func:`sync_group` returns None), as stock ``SyncBatchNorm.forward`` does.
NO_GROUP_YET = "WORLD after init_process_group; unsynchronized before"


def describe_group(process_group: Any = None) -> str:
    """Over what a layer with this ``process_group`` synchronizes, for the plan's
    ``sync`` column: ``"WORLD, 2 ranks"``, ``"group of 2 ranks"``, ``"group without this
    rank"``; with no process group initialized (training then normalizes with this
    process's batch alone, as stock ``SyncBatchNorm.forward`` does: :func:`sync_group`
    returns None), :data:`NO_GROUP_YET` for WORLD and ``"group: unsynchronized (no
    process group initialized)"`` for a group (one destroyed since).

    Examples::

        >>> describe_group()  # no torch.distributed.init_process_group here
        'WORLD after init_process_group; unsynchronized before'
    """
    named = "WORLD" if process_group is None else "group"
    if not (dist.is_available() and dist.is_initialized()):
        return (
            NO_GROUP_YET
            if process_group is None
            else ("group: unsynchronized (no process group initialized)")
        )
    group = dist.group.WORLD if process_group is None else process_group
    if dist.get_rank(group) < 0:
        return "group without this rank"
    size = dist.get_world_size(group)
    return f"{named}{',' if named == 'WORLD' else ' of'} {size} rank{'s' if size != 1 else ''}"


def sync_group(layer: nn.Module) -> Any:
    """The process group ``layer`` synchronizes over in this forward, or None: not in
    training, ``torch.distributed`` unavailable or not initialized, or a group of one rank
    (stock ``SyncBatchNorm.forward``'s ``need_sync``).

    Raises:
        ValueError: the layer's ``process_group`` does not contain this rank (torch's
            collectives would return without communicating: a silent wrong result).
    """
    if not layer.training or not dist.is_available() or not dist.is_initialized():
        return None
    group = _world(layer)
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"SyncBatchNorm: this rank (global rank {dist.get_rank()}) is not in the layer's "
            "process_group, so it cannot synchronize batch statistics with it. Give each "
            "rank the group it belongs to (torch.distributed.new_subgroups / "
            "new_group on every rank), or None for WORLD."
        )
    if dist.get_world_size(group) == 1:
        return None
    return group


def synchronized_batch_norm(layer: _BatchNorm, input: Tensor, group: Any) -> Tensor:
    """Batch norm of ``input`` with the statistics of the global batch over ``group``
    (a training step of ``layer``, a ``_BatchNorm``; see the module docstring).

    Args:
        layer: the layer; its running statistics and ``num_batches_tracked`` are updated
            in place (when it tracks them), after the collective.
        input: ``(N, C, *)`` tensor, float16 / bfloat16 / float32 / float64; N may differ
            between ranks and be 0.
        group: the process group (every rank of it must call this for the layer).

    Returns:
        Tensor of ``input``'s shape and dtype; statistics are computed in float32
        (float64 for float64 input).

    Raises:
        Before any collective (no rank is left waiting): what stock raises for the wrong
        channel count (RuntimeError), a non-floating dtype (NotImplementedError), a
        non-positive eps (ValueError) or a momentum that is no number (TypeError). After
        the all_gather, on every rank, before any state changes: ValueError ``"Expected
        more than 1 value per channel when training, ..."`` when the global batch has one
        value per channel.
    """
    # read where stock reads it, before anything runs: only when it counts the batch (a
    # layer without the attribute, a torch 0.3-era pickle: stock's AttributeError)
    nbt = layer.num_batches_tracked if layer.track_running_stats else None
    weight, bias = layer.weight, layer.bias
    tracking = layer.track_running_stats and layer.running_mean is not None
    running_mean = layer.running_mean if tracking else None
    running_var = layer.running_var if tracking else None
    check_batch_norm_input(
        input, weight, bias, running_mean, running_var, True, layer.eps, synchronized=True
    )
    check_momentum(layer.momentum)  # as the unsynchronized path: before anything moves
    out: Tensor
    out, mean, unbiased, total = _SyncBatchNorm.apply(
        input, weight, bias, float(layer.eps), group, dist.get_world_size(group), input.size()
    )
    if nbt is not None:
        nbt.add_(1)
    if running_mean is None:
        return out
    assert running_var is not None  # check_batch_norm_input: both statistics or neither
    compiling = torch.compiler.is_compiling()
    factor = exponential_average_factor(
        layer.momentum,
        nbt if layer.track_running_stats else None,
        traced=compiling,
        like=running_mean,
    )
    with torch.no_grad():
        # An all-empty global batch moves no statistics (stock's early return).
        if isinstance(total, Tensor):  # compiled: a factor of 0 then, with finite batch
            # statistics, so no branch on the count is needed
            # (made like the statistics, in place: the graph names no dtype, issue 25)
            f = torch.full_like(running_mean, 0.0).add_(factor).mul_(total > 0)
            running_mean.mul_(1 - f).add_(mean * f)
            running_var.mul_(1 - f).add_(unbiased * f)
        elif total:  # eager: the count was read
            share = float(factor)  # (a 0-dim momentum tensor of any dtype, as stock takes it)
            running_mean.lerp_(mean.to(running_mean.dtype), share)
            running_var.lerp_(unbiased.to(running_var.dtype), share)
    return out


def sync_batch_norm_forward(layer: nn.SyncBatchNorm, input: Tensor) -> Tensor:
    """``nn.SyncBatchNorm.forward`` on bnswap's path: the adapter of ``SyncBatchNorm``.

    Args:
        layer: an ``nn.SyncBatchNorm``.
        input: ``(N, C, *)`` tensor with at least 2 dimensions.

    Returns:
        Tensor of the same shape and dtype.

    Raises:
        ValueError: ``"expected at least 2D input (got 1D input)"``,
            ``"SyncBatchNorm number of input channels should be non-zero"`` (stock's
            checks), or the process group does not contain this rank; what
            :func:`synchronized_batch_norm` raises when synchronizing, else what
            :func:`bnswap.module_batch_norm` raises.

    Examples::

        >>> import torch, bnswap
        >>> from torch import nn
        >>> layer = bnswap.convert(nn.SyncBatchNorm(3))   # no process group: unsynchronized
        >>> x = torch.randn(4, 3, 5)
        >>> torch.equal(layer(x), nn.BatchNorm1d(3)(x))
        True
    """
    layer._check_input_dim(input)
    layer._check_non_zero_input_channels(input)
    group = sync_group(layer)
    if group is None:
        return module_batch_norm(layer, input)
    return synchronized_batch_norm(layer, input, group)


def to_sync_batch_norm(
    layer: nn.Module, process_group: Any = None, cls: type[nn.Module] = nn.SyncBatchNorm
) -> nn.Module:
    """A ``cls`` (``nn.SyncBatchNorm``) layer that shares ``layer``'s state: the same
    Parameter, buffer, child module and hook dicts (an optimizer built on ``layer``'s
    parameters stays valid; ``.to()`` / ``load_state_dict`` on one show on the other), its
    flags copied, ``process_group`` set, and ``layer`` itself kept (under
    :data:`ORIGINAL`, in a 1-tuple) for :func:`original_of`. Not swapped yet; ``layer``
    is unchanged.
    """
    sync = cls.__new__(cls)
    state = {k: v for k, v in layer.__dict__.items() if k != SWAP}
    sync.__dict__.update(state)
    sync.__dict__["process_group"] = process_group
    sync.__dict__[ORIGINAL] = (layer,)
    return sync


#: The plain attributes of a ``_BatchNorm`` that :func:`original_of` hands back to the
#: original layer: :func:`to_sync_batch_norm` copies them by value, so a change made while
#: the SyncBatchNorm stood in (``layer.momentum = 0.01``, ``eval()``) lands on it only.
#: (Parameters, buffers and hooks live in dicts the two layers share.)
FLAGS = ("training", "num_features", "eps", "momentum", "affine", "track_running_stats")

#: The dicts :func:`to_sync_batch_norm` shares between the layer and its stand-in: a
#: stand-in that holds other ones is a copy (see :func:`original_of`).
_SHARED = ("_parameters", "_buffers", "_modules")


def original_of(layer: nn.Module) -> nn.Module | None:
    """The layer ``to_sync_batch_norm`` made ``layer`` from, given ``layer``'s
    :data:`FLAGS` (``training``, ``momentum``, ``eps``, ...: what was set on the
    SyncBatchNorm while it stood in, as Lightning's own revert keeps them); None for any
    other module. For a copy of such a layer's ``__dict__`` with dicts of its own (issue
    32), a new layer of the original's class on the copy's state, never the original."""
    held = getattr(layer, "__dict__", {}).get(ORIGINAL)
    if not (isinstance(held, tuple) and len(held) == 1 and isinstance(held[0], nn.Module)):
        return None
    original = held[0]
    state = layer.__dict__
    mine = original.__dict__
    if any(state.get(k) is not mine.get(k) for k in _SHARED):
        # a copy of the stand-in (its __dict__ copied with new parameter / buffer dicts:
        # learn2learn's clone_module, a DataParallel replica): the original is another
        # model's layer; the copy gets a layer of the original's class on its own state
        fresh = type(original).__new__(type(original))
        fresh.__dict__.update(
            (k, v) for k, v in state.items() if k not in (ORIGINAL, SWAP, "process_group")
        )
        return fresh
    for name in FLAGS:
        if name in state:
            original.__dict__[name] = state[name]
    return original
