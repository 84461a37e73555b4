"""bnswap batch-norm layers: drop-in subclasses of ``torch.nn.BatchNorm1d/2d/3d``.

Each layer *is* the torch class (``isinstance(layer, nn.BatchNorm2d)`` and
``isinstance(layer, _BatchNorm)`` hold, so Lightning's ``BaseFinetuning``,
``torch.optim.swa_utils.update_bn``, ``torch.func.replace_all_batch_norm_modules_`` and
conv-BN fusion keep working) with the same constructor, parameters, buffers,
state_dict keys and repr fields. Only ``forward`` differs: it runs
:func:`bnswap._core.module_batch_norm`, i.e. ``aten._batch_norm_with_update`` in
training and ``aten._batch_norm_no_update`` in evaluation (pytorch PR 116092), with the
exact ``nn.BatchNorm`` semantics.
"""

from __future__ import annotations

import torch.fx
from torch import Tensor, nn

from bnswap._core import module_batch_norm

__all__ = ["BNSwapLayer", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]


class BNSwapLayer:
    """Mixin that puts a ``_BatchNorm`` subclass's normalization on the bnswap core.

    A bnswap layer with extra behaviour (an activation after the normalization, say) is
    a thin subclass that calls :meth:`_bnswap_normalize` inside its own ``forward``.
    """

    def _bnswap_normalize(self, input: Tensor) -> Tensor:
        """Batch-normalize ``input`` (N, C, *) with this layer's parameters and statistics.

        Raises what stock ``nn.BatchNorm`` raises (ValueError for the wrong rank or one
        value per channel in training, RuntimeError for the wrong channel count,
        NotImplementedError for integer input), before any kernel runs.

        Under ``torch.fx.symbolic_trace`` (``input`` a Proxy) a submodule's normalization
        is recorded as one opaque ``call_function`` on it, so an adapter's own
        ``forward`` (activation, drop...) traces around it, as its stock class's
        ``F.batch_norm`` call does.
        """
        if isinstance(input, torch.fx.Proxy):
            path = input.tracer.path_of_module(self)
            if path:
                module = input.tracer.create_proxy("get_attr", path, (), {})
                return input.tracer.create_proxy("call_function", _normalize, (module, input), {})
        self._check_input_dim(input)  # type: ignore[attr-defined]
        return module_batch_norm(self, input)  # type: ignore[arg-type]

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, torch.fx.Proxy):
            return _fx_leaf(self, input)
        return self._bnswap_normalize(input)

    def _get_name(self) -> str:
        return "bnswap." + type(self).__name__.removeprefix("Parametrized")


def _normalize(module: BNSwapLayer, input: Tensor) -> Tensor:
    """``module._bnswap_normalize(input)``: the call an fx graph records for an adapter."""
    return module._bnswap_normalize(input)


def _fx_leaf(module: nn.Module, input: torch.fx.Proxy) -> object:
    """Record ``module`` as a ``call_module`` node, as ``torch.fx.symbolic_trace`` does
    for the torch.nn BatchNorm classes (leaf modules: their forward cannot be traced
    through, and neither can the bnswap core). The root module is traced as stock."""
    tracer = input.tracer
    path = tracer.path_of_module(module)
    if not path:
        return module._bnswap_normalize(input)  # type: ignore[attr-defined]
    return tracer.create_proxy("call_module", path, (input,), {})


class BatchNorm1d(BNSwapLayer, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` on the consolidated batch-norm ops.

    Shape: input (N, C) or (N, C, L), output the same. Parameters and statistics are
    (C,) tensors (float32 by default); input may be float16, bfloat16, float32 or
    float64 (half inputs with float32 parameters, as stock). Constructor arguments,
    state_dict keys and errors are those of :class:`torch.nn.BatchNorm1d`.
    """


class BatchNorm2d(BNSwapLayer, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` on the consolidated batch-norm ops.

    Shape: input (N, C, H, W), contiguous or channels_last, output the same (memory
    format preserved). Otherwise as :class:`BatchNorm1d`.
    """


class BatchNorm3d(BNSwapLayer, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` on the consolidated batch-norm ops.

    Shape: input (N, C, D, H, W), contiguous or channels_last_3d, output the same.
    Otherwise as :class:`BatchNorm1d`.
    """
