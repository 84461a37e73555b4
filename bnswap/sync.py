"""Synchronized BatchNorm on bnswap's path: ``nn.SyncBatchNorm`` layers, swapped.

A swapped ``nn.SyncBatchNorm`` keeps its class, Parameters, buffers, ``process_group``
and state_dict keys (like every bnswap swap, :mod:`bnswap._swap`); its forward is
:func:`sync_batch_norm_forward`:

* training in a process group of more than one rank (``process_group``, default
  ``torch.distributed.group.WORLD``): batch statistics of the *global* batch, the
  concatenation of every rank's input, on any device and backend (gloo, NCCL, ...).
  Each rank computes its per-channel (count, mean, M2) (M2: the sum of squared
  deviations from its own mean), one ``all_gather`` exchanges the packed (2C + 1,)
  tensor, and every rank combines them with Chan et al.'s pairwise formula
  (``mean = sum(n_i mean_i) / n``, ``M2 = sum(M2_i + n_i (mean_i - mean)^2)``), so
  uneven per-rank batches and empty ranks give the global batch's statistics, with
  no cancellation of raw sums of squares in float32. ``running_var`` takes the
  unbiased variance ``M2 / (n - 1)``; ``num_batches_tracked`` and ``momentum=None``
  (cumulative average) as stock. The backward needs one ``all_reduce`` of the packed
  (2C,) ``sum(dy)`` and ``sum(dy * (x - mean))``: the input gradient is the global
  batch's, parameter gradients are each rank's share (as stock SyncBatchNorm's; DDP
  averages them);
* evaluation, training without an initialized process group, or a group of one rank:
  exactly bnswap's unsynchronized path (:func:`bnswap.module_batch_norm`), bitwise equal
  to stock ``nn.BatchNorm`` (stock ``SyncBatchNorm`` raises on CPU when a group is
  initialized).

The collectives are ``torch.distributed._functional_collectives`` inside a
``torch.autograd.Function``, so ``torch.compile(fullgraph=True)`` captures a synchronized
model without a graph break (stock's masks the gathered statistics with a data-dependent
index: pytorch issue 156680). Why one portable formulation rather than torch's CUDA
kernels (``batch_norm_stats``, ``batch_norm_gather_stats_with_counts``,
``batch_norm_elemt``): ``docs/design.md``, "Synchronized BatchNorm".

:func:`to_sync_batch_norm` / :func:`original_of` are ``convert(model,
sync_batchnorm=True)``'s two directions: a ``BatchNorm1d/2d/3d`` becomes an
``nn.SyncBatchNorm`` that shares its Parameter, buffer and hook objects, and
``bnswap.revert`` puts the original module object back.

This is the only bnswap module that imports ``torch.distributed``.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from bnswap._swap import is_swapped
from bnswap.functional import check_batch_norm_input, check_momentum, \
    exponential_average_factor, module_batch_norm

__all__ = ["FLAGS", "NO_GROUP_YET", "ONE_VALUE_MESSAGE", "ORIGINAL", "SYNC_CLASSES",
           "SYNC_KERNEL", "describe_group", "original_of", "sync_batch_norm_forward",
           "sync_class", "sync_group", "synchronized_batch_norm", "to_sync_batch_norm"]

#: The instance attribute (in ``__dict__``, never a submodule: not in the state_dict) of a
#: SyncBatchNorm that ``convert(..., sync_batchnorm=True)`` made, holding the original layer.
ORIGINAL = "_bnswap_original"

#: What the plan's kernel column says a synchronized layer runs in training.
SYNC_KERNEL = "Sync (portable)"


def _funcol() -> Any:
    # Imported with the first synchronized forward: torch.distributed itself may lack it
    # (a torch built without distributed support), where no group can be initialized.
    import torch.distributed._functional_collectives as funcol

    return funcol


def _wait(t: Tensor) -> Tensor:
    # Functional collectives return an AsyncCollectiveTensor in eager (a subclass that
    # waits on first use); wait once here, so the ops after it run on a plain tensor.
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


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
        return NO_GROUP_YET if process_group is None else (
            "group: unsynchronized (no process group initialized)")
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
            "new_group on every rank), or None for WORLD.")
    if dist.get_world_size(group) == 1:
        return None
    return group


_no_update = torch.ops.aten._batch_norm_no_update.default


def _reduce_dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_view(t: Tensor, x: Tensor) -> Tensor:
    return t.view(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNorm(torch.autograd.Function):
    """Global batch statistics and normalization: one all_gather forward, one
    all_reduce backward."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor | None, bias: Tensor | None,
                eps: float, group: Any, size: torch.Size) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        funcol = _funcol()
        # all_gather_single (torch 2.13+; all_gather_tensor, its older name, warns there)
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        acc = torch.float64 if input.dtype == torch.float64 else torch.float32
        c = input.shape[1]
        x = input.to(acc)
        count = input.numel() // c if c else 0
        dims = _reduce_dims(x)
        if count:
            # two passes (the mean, then squared deviations from it): as accurate as
            # Welford's torch.var_mean and 2-7x faster on CPU for (N, C, H, W) input
            # (torch.var_mean reduces dims 0, 2, 3 with a strided Welford loop)
            mean = x.mean(dims)
            dev = x - _channel_view(mean, x)
            m2 = (dev * dev).sum(dims)
        else:  # an empty rank: n_i = 0 adds nothing to the global sums
            mean = m2 = torch.zeros(c, dtype=acc, device=input.device)
        packed = torch.cat([mean.new_full((1,), count), mean, m2])
        gathered = _wait(gather(packed, 0, group)).view(-1, 2 * c + 1)
        counts, means, m2s = gathered[:, :1], gathered[:, 1:c + 1], gathered[:, c + 1:]
        total = counts.sum()
        if torch.compiler.is_compiling():
            # a device-side assertion: reading the count would break the graph
            torch._assert_async(total != 1, ONE_VALUE_MESSAGE)
        elif int(total) == 1:  # eager: the count is read (a device sync on CUDA, as stock)
            raise ValueError(_one_value_message(size, group))
        n = total.clamp(min=1)
        g_mean = (counts * means).sum(0) / n
        g_m2 = m2s.sum(0) + (counts * (means - g_mean) ** 2).sum(0)
        invstd = torch.rsqrt(g_m2 / n + eps)
        unbiased = g_m2 / (total - 1).clamp(min=1)
        if count and (weight is None or weight.dtype == acc) and (
                bias is None or bias.dtype == acc):
            # the normalization itself on bnswap's kernel: aten._batch_norm_no_update with
            # the global statistics (one vectorized pass; memory format and half input as
            # the consolidated ops handle them)
            ones = None if weight is not None else torch.ones(c, dtype=acc, device=x.device)
            zeros = None if bias is not None else torch.zeros(c, dtype=acc, device=x.device)
            out = _no_update(input, weight if weight is not None else ones,
                             bias if bias is not None else zeros, g_mean, g_m2 / n, 0.0, eps)[0]
        else:
            scale = invstd if weight is None else invstd * weight.to(acc)
            out = (x - _channel_view(g_mean, x)) * _channel_view(scale, x)
            if bias is not None:
                out = out + _channel_view(bias.to(acc), x)
            out = out.to(input.dtype)
        ctx.save_for_backward(input, weight, g_mean, invstd, total)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.mark_non_differentiable(g_mean, unbiased, total)
        return out, g_mean, unbiased, total

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple:
        input, weight, mean, invstd, total = ctx.saved_tensors
        acc = mean.dtype
        c = input.shape[1]
        dy = grad_out.to(acc)
        xmu = input.to(acc) - _channel_view(mean, dy)
        dims = _reduce_dims(dy)
        if input.numel():
            sum_dy, sum_dy_xmu = dy.sum(dims), (dy * xmu).sum(dims)
        else:
            sum_dy = sum_dy_xmu = torch.zeros(c, dtype=acc, device=input.device)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            reduced = _wait(_funcol().all_reduce(torch.cat([sum_dy, sum_dy_xmu]), "sum",
                                                 ctx.group))
            n = total.clamp(min=1)
            mean_dy, mean_dy_xmu = reduced[:c] / n, reduced[c:] / n
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad_input = ((dy - _channel_view(mean_dy, dy)
                           - xmu * _channel_view(invstd * invstd * mean_dy_xmu, dy))
                          * _channel_view(scale, dy)).to(input.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else acc)
        return grad_input, grad_weight, grad_bias, None, None, None


#: What a compiled synchronized layer's runtime assertion says (a RuntimeError) where eager
#: raises stock's ValueError: a graph cannot read the global count without a break.
ONE_VALUE_MESSAGE = ("Expected more than 1 value per channel when training (in the global "
                     "batch of the layer's process_group)")


def _one_value_message(size: torch.Size, group: Any) -> str:
    return (f"Expected more than 1 value per channel when training, got input size {size} "
            f"(1 value per channel in the global batch of the {dist.get_world_size(group)} "
            "ranks of the layer's process_group)")


def synchronized_batch_norm(layer: nn.Module, input: Tensor, group: Any) -> Tensor:
    """Batch norm of ``input`` with the statistics of the global batch over ``group``
    (a training step of ``layer``, a ``_BatchNorm``; see the module docstring).

    Args:
        layer: the layer; its running statistics and ``num_batches_tracked`` are updated
            in place (when it tracks them), after the collective.
        input: (N, C, *) tensor, float16 / bfloat16 / float32 / float64; N may differ
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
    weight, bias = layer.weight, layer.bias
    tracking = layer.track_running_stats and layer.running_mean is not None
    running_mean = layer.running_mean if tracking else None
    running_var = layer.running_var if tracking else None
    check_batch_norm_input(input, weight, bias, running_mean, running_var, True, layer.eps,
                           synchronized=True)
    check_momentum(layer.momentum)  # as the unsynchronized path: before anything moves
    out, mean, unbiased, total = _SyncBatchNorm.apply(
        input, weight, bias, float(layer.eps), group, input.size())
    nbt = layer.num_batches_tracked
    if layer.track_running_stats and nbt is not None:
        nbt.add_(1)
    if running_mean is None:
        return out
    compiling = torch.compiler.is_compiling()
    factor = exponential_average_factor(
        layer.momentum, nbt if layer.track_running_stats else None, traced=compiling,
        dtype=running_mean.dtype)
    with torch.no_grad():
        # An all-empty global batch moves no statistics (stock's early return): a factor
        # of 0 then, with finite batch statistics, so no branch on the count is needed.
        f = (total > 0).to(running_mean.dtype) * factor
        running_mean.mul_(1 - f).add_(mean.to(running_mean.dtype) * f)
        running_var.mul_(1 - f).add_(unbiased.to(running_var.dtype) * f)
    return out


def sync_batch_norm_forward(layer: nn.Module, input: Tensor) -> Tensor:
    """``nn.SyncBatchNorm.forward`` on bnswap's path: the adapter of ``SyncBatchNorm``.

    Args:
        layer: an ``nn.SyncBatchNorm``.
        input: (N, C, *) tensor with at least 2 dimensions.

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
    layer._check_input_dim(input)  # type: ignore[operator]
    layer._check_non_zero_input_channels(input)  # type: ignore[operator]
    group = sync_group(layer)
    if group is None:
        return module_batch_norm(layer, input)  # type: ignore[arg-type]
    return synchronized_batch_norm(layer, input, group)


def to_sync_batch_norm(layer: nn.Module, process_group: Any = None,
                       cls: type = nn.SyncBatchNorm) -> nn.Module:
    """A ``cls`` (``nn.SyncBatchNorm``) layer that shares ``layer``'s state: the same
    Parameter, buffer, child module and hook dicts (an optimizer built on ``layer``'s
    parameters stays valid; ``.to()`` / ``load_state_dict`` on one show on the other), its
    flags copied, ``process_group`` set, and ``layer`` itself kept (under
    :data:`ORIGINAL`) for :func:`original_of`. Not swapped yet; ``layer`` is unchanged.
    """
    sync = cls.__new__(cls)
    state = {k: v for k, v in layer.__dict__.items() if k != "forward"}
    sync.__dict__.update(state)
    sync.__dict__["process_group"] = process_group
    sync.__dict__[ORIGINAL] = layer
    return sync


#: The plain attributes of a ``_BatchNorm`` that :func:`original_of` hands back to the
#: original layer: :func:`to_sync_batch_norm` copies them by value, so a change made while
#: the SyncBatchNorm stood in (``layer.momentum = 0.01``, ``eval()``) lands on it only.
#: (Parameters, buffers and hooks live in dicts the two layers share.)
FLAGS = ("training", "num_features", "eps", "momentum", "affine", "track_running_stats")


def original_of(layer: nn.Module) -> nn.Module | None:
    """The layer ``to_sync_batch_norm`` made ``layer`` from, given ``layer``'s
    :data:`FLAGS` (``training``, ``momentum``, ``eps``, ...: what was set on the
    SyncBatchNorm while it stood in, as Lightning's own revert keeps them); None for any
    other module."""
    original = getattr(layer, "__dict__", {}).get(ORIGINAL)
    if original is None:
        return None
    state = layer.__dict__
    for name in FLAGS:
        if name in state:
            original.__dict__[name] = state[name]
    return original
