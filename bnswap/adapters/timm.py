"""bnswap adapter for timm's ``BatchNormAct2d`` (imports timm).

timm builds the BatchNorm layers of MobileNetV2/V3, EfficientNet, RegNet, DenseNet,
CSPDarkNet and more as ``timm.layers.norm_act.BatchNormAct2d``: an ``nn.BatchNorm2d``
subclass whose ``forward`` is a copy of ``BatchNorm2d.forward`` (``F.batch_norm``)
followed by ``self.drop`` and ``self.act``. Since it overrides ``forward``, bnswap
swaps it only through this adapter, registered lazily in :mod:`bnswap.registry` (this
module is imported the first time a model holding that class is planned or
converted).

The swapped layer is the same object with the same attributes: ``drop`` and ``act``
are its own child modules still, and its state_dict keys are unchanged.
"""

from __future__ import annotations

from timm.layers import norm_act as _timm_norm_act
from timm.layers.trace_utils import _assert
from torch import Tensor

from bnswap.layers import BNSwapLayer

__all__ = ["BatchNormAct2d"]


class BatchNormAct2d(BNSwapLayer, _timm_norm_act.BatchNormAct2d):
    """timm's ``BatchNormAct2d`` with its batch norm on the consolidated ops.

    ``forward(x)`` is timm's: the rank check (``AssertionError`` for input that is not
    4D, as timm raises), batch norm with ``nn.BatchNorm2d`` semantics (running
    statistics updated in training, ``momentum=None`` as a cumulative average), then
    ``self.drop``, then ``self.act``. The batch norm runs
    ``aten._batch_norm_with_update`` in training and ``aten._batch_norm_no_update`` in
    evaluation (:meth:`BNSwapLayer._bnswap_normalize`). Shape: (N, C, H, W) in and out,
    memory format preserved.
    """

    def _check_input_dim(self, input: Tensor) -> None:
        # timm's forward asserts the rank instead of calling BatchNorm2d's check.
        _assert(input.ndim == 4, f"expected 4D input (got {input.ndim}D input)")

    def forward(self, x: Tensor) -> Tensor:
        x = self._bnswap_normalize(x)
        x = self.drop(x)
        x = self.act(x)
        return x
