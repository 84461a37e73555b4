"""bnswap layers: torch's BatchNorm classes, running on the consolidated batch-norm ops.

A swapped layer keeps its class (``type(layer) is nn.BatchNorm2d``); only its forward
differs (:mod:`bnswap._swap`). For torch's ``BatchNorm1d/2d/3d`` (and their subclasses that
keep torch's ``forward``, such as the lazy classes) that forward is
:func:`batch_norm_forward`: ``_BatchNorm.forward`` with its ``F.batch_norm`` call replaced by
:func:`module_batch_norm`, i.e. ``aten._batch_norm_with_update`` in training (pytorch PR
116092) and stock's own ``aten.batch_norm`` in evaluation, with exactly ``nn.BatchNorm``'s
semantics, on every device.

:class:`BatchNorm1d`, :class:`BatchNorm2d` and :class:`BatchNorm3d` build such layers and
recognise them: ``bnswap.BatchNorm2d(8)`` returns an ``nn.BatchNorm2d`` that is already
swapped, and ``isinstance(layer, bnswap.BatchNorm2d)`` is True for any swapped
``nn.BatchNorm2d``.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from bnswap._swap import is_swapped, swap
from bnswap.functional import module_batch_norm

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "batch_norm_forward",
    "is_swapped",
    "module_batch_norm",
]


def batch_norm_forward(layer: _BatchNorm, input: Tensor) -> Tensor:
    """``torch.nn.modules.batchnorm._BatchNorm.forward`` on the consolidated ops: the
    adapter of torch's BatchNorm classes.

    Args:
        layer: a ``_BatchNorm`` (its ``_check_input_dim`` checks the rank).
        input: ``(N, C, *)`` tensor, float16 / bfloat16 / float32 / float64, any memory format.

    Returns:
        Tensor of the same shape, dtype and memory format.

    Raises:
        ValueError: as stock, for the wrong rank (``"expected 4D input (got 3D
            input)"``) or one value per channel in training, before any state changes
            (:func:`bnswap.functional.check_batch_norm_input`).
        RuntimeError: as stock, for the wrong channel count, before any state changes;
            ``"mixed dtype (CPU): ..."`` from the kernel, after counting the batch.
        NotImplementedError: as stock, for integer input, before any state changes.

    Examples::

        >>> import torch, bnswap
        >>> from torch import nn
        >>> bn = nn.BatchNorm2d(3)
        >>> x = torch.randn(4, 3, 5, 5)
        >>> torch.equal(bnswap.layers.batch_norm_forward(bn, x), nn.BatchNorm2d(3)(x))
        True
    """
    layer._check_input_dim(input)
    return module_batch_norm(layer, input)


def _stock_signature(stock: type) -> inspect.Signature:
    """``stock``'s constructor signature, returning what it builds (not ``None``)."""
    return inspect.signature(stock).replace(return_annotation=inspect.Signature.empty)


class _SwappedClass(type):
    """Metaclass of :class:`BatchNorm1d` / ``2d`` / ``3d``: calling one builds the stock
    layer and swaps it; ``isinstance`` is True for swapped layers of the stock class."""

    _stock: type

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        layer = cls._stock(*args, **kwargs)
        swap(layer, batch_norm_forward)
        return layer

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, cls._stock) and is_swapped(obj)


if TYPE_CHECKING:  # for type checkers: calling one builds the stock class, with its signature

    class BatchNorm1d(nn.BatchNorm1d): ...

    class BatchNorm2d(nn.BatchNorm2d): ...

    class BatchNorm3d(nn.BatchNorm3d): ...

else:

    class BatchNorm1d(metaclass=_SwappedClass):
        """``nn.BatchNorm1d(num_features, eps=1e-05, momentum=0.1, affine=True,
        track_running_stats=True, device=None, dtype=None)``, swapped.

        Returns an ``nn.BatchNorm1d`` (its class, constructor arguments, parameters, buffers,
        state_dict keys and errors are torch's) whose forward runs the consolidated ops.
        Shape: input (N, C) or (N, C, L), output the same. Parameters and statistics are (C,)
        tensors (float32 by default); input may be float16, bfloat16, float32 or float64.
        ``isinstance(m, bnswap.BatchNorm1d)``: ``m`` is a swapped ``nn.BatchNorm1d``.

        Examples::

            >>> import torch, bnswap
            >>> from torch import nn
            >>> bn = bnswap.BatchNorm1d(4)
            >>> type(bn) is nn.BatchNorm1d, isinstance(bn, bnswap.BatchNorm1d)
            (True, True)
            >>> bn(torch.randn(8, 4)).shape
            torch.Size([8, 4])
        """

        _stock = nn.BatchNorm1d
        #: stock's constructor signature: ``inspect.signature`` / ``help`` and the API page show it
        __signature__ = _stock_signature(nn.BatchNorm1d)

    class BatchNorm2d(metaclass=_SwappedClass):
        """``nn.BatchNorm2d(...)``, swapped: as :class:`BatchNorm1d`, for input (N, C, H, W),
        contiguous or channels_last (memory format preserved).

        Examples::

            >>> import torch, bnswap
            >>> bn = bnswap.BatchNorm2d(3)
            >>> bn(torch.randn(2, 3, 4, 4)).shape
            torch.Size([2, 3, 4, 4])
        """

        _stock = nn.BatchNorm2d
        #: stock's constructor signature: ``inspect.signature`` / ``help`` and the API page show it
        __signature__ = _stock_signature(nn.BatchNorm2d)

    class BatchNorm3d(metaclass=_SwappedClass):
        """``nn.BatchNorm3d(...)``, swapped: as :class:`BatchNorm1d`, for input
        (N, C, D, H, W), contiguous or channels_last_3d.

        Examples::

            >>> import torch, bnswap
            >>> bn = bnswap.BatchNorm3d(2)
            >>> bn(torch.randn(2, 2, 3, 3, 3)).shape
            torch.Size([2, 2, 3, 3, 3])
        """

        _stock = nn.BatchNorm3d
        #: stock's constructor signature: ``inspect.signature`` / ``help`` and the API page show it
        __signature__ = _stock_signature(nn.BatchNorm3d)
