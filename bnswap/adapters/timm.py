"""bnswap adapter for timm's ``BatchNormAct2d`` (imports timm).

timm builds the BatchNorm layers of MobileNetV2/V3, EfficientNet, RegNet, DenseNet,
CSPDarkNet and more as ``timm.layers.norm_act.BatchNormAct2d``: an ``nn.BatchNorm2d``
subclass whose ``forward`` is a copy of ``BatchNorm2d.forward`` (``F.batch_norm``)
followed by ``self.drop`` and ``self.act``. Since it overrides ``forward``, bnswap
swaps it only through this adapter, registered lazily in :mod:`bnswap.registry` (this
module is imported the first time a model holding that class is planned or converted).

The swapped layer is the same object of the same class: ``drop`` and ``act`` are its
own child modules still, and its state_dict keys are unchanged.
"""

from __future__ import annotations

from timm.layers import norm_act as _timm_norm_act
from timm.layers.trace_utils import _assert
from torch import Tensor

from bnswap.functional import module_batch_norm
from bnswap.sync import sync_batch_norm_forward

__all__ = ["batch_norm_act_2d", "sync_batch_norm_act_2d"]


def batch_norm_act_2d(layer: _timm_norm_act.BatchNormAct2d, x: Tensor) -> Tensor:
    """timm's ``BatchNormAct2d.forward`` with its batch norm on the consolidated ops.

    timm's rank check (``AssertionError`` for input that is not 4D, as timm raises),
    batch norm with ``nn.BatchNorm2d`` semantics (running statistics updated in training,
    ``momentum=None`` as a cumulative average) on ``aten._batch_norm_with_update`` /
    ``aten._batch_norm_no_update`` (:func:`bnswap.module_batch_norm`), then
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
    x = module_batch_norm(layer, x)  # type: ignore[arg-type]
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
