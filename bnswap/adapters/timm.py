"""bnswap adapters for timm's ``BatchNormAct2d``, ``SyncBatchNormAct`` and
``SplitBatchNorm2d`` (imports timm).

timm builds the BatchNorm layers of MobileNetV2/V3, EfficientNet, RegNet, DenseNet,
CSPDarkNet and more as ``timm.layers.norm_act.BatchNormAct2d``: an ``nn.BatchNorm2d``
subclass whose ``forward`` is a copy of ``BatchNorm2d.forward`` (``F.batch_norm``)
followed by ``self.drop`` and ``self.act``. Since it overrides ``forward``, bnswap
swaps it only through this adapter, registered lazily in :mod:`bnswap.registry` (this
module is imported the first time a model holding that class is planned or converted).

The swapped layer is the same object of the same class: ``drop`` and ``act`` are its
own child modules still, and its state_dict keys are unchanged.

timm's ``train.py --split-bn`` (AdvProp's auxiliary BatchNorm) builds
``timm.layers.split_batchnorm.SplitBatchNorm2d`` layers (``convert_splitbn_model``): a
``BatchNorm2d`` that, in training, normalizes the first of ``num_splits`` equal parts of
the batch itself and each other part with one of its ``aux_bn`` layers (plain
``BatchNorm2d`` children). It overrides ``forward``, so without an adapter bnswap left
it on torch's kernel while swapping its ``aux_bn`` children: a half-converted layer.
:func:`split_batch_norm_2d` swaps it whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from timm.layers import norm_act as _timm_norm_act
from timm.layers.trace_utils import _assert
from torch import Tensor

from bnswap.functional import module_batch_norm
from bnswap.sync import sync_batch_norm_forward

if TYPE_CHECKING:  # (the module is imported when a model holds that class, not before)
    from timm.layers import split_batchnorm as _timm_split_batchnorm

__all__ = ["batch_norm_act_2d", "split_batch_norm_2d", "sync_batch_norm_act_2d"]


def batch_norm_act_2d(layer: _timm_norm_act.BatchNormAct2d, x: Tensor) -> Tensor:
    """timm's ``BatchNormAct2d.forward`` with its batch norm on the consolidated ops.

    timm's rank check (``AssertionError`` for input that is not 4D, as timm raises),
    batch norm with ``nn.BatchNorm2d`` semantics (running statistics updated in training,
    ``momentum=None`` as a cumulative average) on ``aten._batch_norm_with_update`` in
    training, ``aten.batch_norm`` in evaluation (:func:`bnswap.module_batch_norm`), then
    ``layer.drop``, then ``layer.act``. Shape: (N, C, H, W) in and out, memory format
    preserved.

    Examples::

        >>> import torch, timm, bnswap
        >>> layer = bnswap.convert(timm.layers.BatchNormAct2d(4))
        >>> bnswap.plan(layer)[0].adapter_name
        'bnswap.adapters.timm.batch_norm_act_2d'
        >>> type(layer) is timm.layers.BatchNormAct2d
        True
    """
    _assert(x.ndim == 4, f"expected 4D input (got {x.ndim}D input)")
    x = module_batch_norm(layer, x)
    x = layer.drop(x)
    x = layer.act(x)
    return x


def sync_batch_norm_act_2d(layer: _timm_norm_act.SyncBatchNormAct, x: Tensor) -> Tensor:
    """timm's ``SyncBatchNormAct.forward`` on bnswap's synchronized path: the batch norm
    of ``nn.SyncBatchNorm`` (:func:`bnswap.sync.sync_batch_norm_forward`: global batch
    statistics over ``layer.process_group`` in training; the unsynchronized consolidated
    ops otherwise), then ``layer.drop`` and ``layer.act`` where the layer has them (as
    timm's). ``bnswap.convert(model, sync_batchnorm=True)`` turns a ``BatchNormAct2d``
    into this class, as ``timm.layers.convert_sync_batchnorm`` does. Shape: (N, C, *) in
    and out.

    Examples::

        >>> import torch, timm, bnswap
        >>> layer = bnswap.convert(timm.layers.BatchNormAct2d(4), sync_batchnorm=True)
        >>> type(layer).__name__, bnswap.plan(layer)[0].adapter_name
        ('SyncBatchNormAct', 'bnswap.adapters.timm.sync_batch_norm_act_2d')
    """
    x = sync_batch_norm_forward(layer, x)
    if hasattr(layer, "drop"):
        x = layer.drop(x)
    if hasattr(layer, "act"):
        x = layer.act(x)
    return x


def split_batch_norm_2d(layer: _timm_split_batchnorm.SplitBatchNorm2d, input: Tensor) -> Tensor:
    """timm's ``SplitBatchNorm2d.forward`` with its own batch norm on the consolidated ops.

    In training, the batch (N, C, H, W) is split into ``layer.num_splits`` equal parts
    (timm's ``AssertionError`` "batch size must be evenly divisible by num_splits"
    otherwise, before any state changes); the first is normalized by the layer itself
    (``BatchNorm2d.forward``'s rank check, ``ValueError``, then
    :func:`bnswap.module_batch_norm`), part ``i + 1`` by ``layer.aux_bn[i]`` (a
    ``BatchNorm2d`` child, swapped by its own plan row: the same call timm makes), and the
    parts are concatenated back in order. In eval, the whole batch goes through the layer
    itself (the auxiliary layers are unused, as in timm). Then ``layer.drop`` and
    ``layer.act`` where the layer has them (``convert_splitbn_model`` of a
    ``BatchNormAct2d`` gives it those). Shape: (N, C, H, W) in and out.

    Examples::

        >>> import torch, timm, bnswap
        >>> layer = bnswap.convert(timm.layers.SplitBatchNorm2d(4, num_splits=2))
        >>> [(r.name, r.adapter_name) for r in bnswap.plan(layer)]  # doctest: +NORMALIZE_WHITESPACE
        [('(root)', 'bnswap.adapters.timm.split_batch_norm_2d'),
         ('aux_bn.0', 'bnswap.layers.batch_norm_forward')]
        >>> layer(torch.randn(4, 4, 3, 3)).shape
        torch.Size([4, 4, 3, 3])
    """
    if layer.training:  # the auxiliary layers are used in training only
        split_size = input.shape[0] // layer.num_splits
        assert input.shape[0] == split_size * layer.num_splits, (
            "batch size must be evenly divisible by num_splits"
        )
        parts = input.split(split_size)
        layer._check_input_dim(parts[0])
        out = [module_batch_norm(layer, parts[0])]
        for i, aux in enumerate(layer.aux_bn):
            out.append(aux(parts[i + 1]))
        x = torch.cat(out, dim=0)
    else:
        layer._check_input_dim(input)
        x = module_batch_norm(layer, input)
    if hasattr(layer, "drop"):
        x = layer.drop(x)
    if hasattr(layer, "act"):
        x = layer.act(x)
    return x
