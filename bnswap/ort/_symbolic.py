"""TorchScript-exporter symbolics for the consolidated batch-norm ops (pytorch PR 116092).

torch's TorchScript ONNX exporter has symbolics for ``aten::batch_norm`` only; bnswap
layers trace to

* ``aten::_batch_norm_with_update(input, weight, bias, running_mean!, running_var!,
  float momentum, float eps) -> (out, save_mean, save_invstd, reserve)`` (batch
  statistics), exported as ONNX ``BatchNormalization`` (opset 15) with
  ``training_mode=1``, which ORT's pre-training transform rewrites into
  ``com.microsoft::BatchNormInternal`` + ``BatchNormalizationGrad``;
* ``aten::_batch_norm_no_update(...)`` (running statistics), exported as
  ``BatchNormalization`` with ``training_mode=0``.

ONNX momentum is the weight of the *old* running value (``1 - torch momentum``). The
training symbolic always emits ONNX ``momentum=0``: ORT's ``BatchNormInternal``
(``.Alias(3, 1)``, ``.Alias(4, 2)`` in orttraining's CPU kernel) then writes the batch
mean and the *biased* batch variance into the running_mean / running_var torch buffers
in place, and :mod:`bnswap.ort._stats` turns them into PyTorch's update (momentum or
cumulative average, unbiased variance, num_batches_tracked) around each call. The
traced momentum float (a per-trace constant, wrong for ``momentum=None``) is therefore
never used. These symbolics are registered only while bnswap exports a model it wrapped
(inside :func:`bnswap.ort._compat.ort_scope`).

The three extra outputs (save_mean, save_invstd, reserve) only feed autograd and are
never used in a traced forward; they are returned as ``None`` (dead outputs).
"""

from __future__ import annotations

import importlib

_TSE = "torch.onnx._internal.torchscript_exporter"

__all__ = ["register", "ONNX_TRAINING_MOMENTUM"]

#: ONNX momentum emitted for training-mode batch norm: running stats := batch stats.
ONNX_TRAINING_MOMENTUM = 0.0


def _helpers():
    return importlib.import_module(f"{_TSE}.symbolic_helper")


def _batch_norm_with_update(g, input, weight, bias, running_mean, running_var, momentum, eps):
    sh = _helpers()
    eps = sh._maybe_get_const(eps, "f")
    weight, bias, running_mean, running_var = sh._batchnorm_helper(
        g, input, weight, bias, running_mean, running_var)
    out, new_mean, new_var = g.op(
        "BatchNormalization", input, weight, bias, running_mean, running_var,
        epsilon_f=eps, momentum_f=ONNX_TRAINING_MOMENTUM, training_mode_i=1, outputs=3)
    new_mean.setType(running_mean.type())
    new_var.setType(running_var.type())
    return out, None, None, None


def _batch_norm_no_update(g, input, weight, bias, running_mean, running_var, momentum, eps):
    sh = _helpers()
    eps = sh._maybe_get_const(eps, "f")
    weight, bias, running_mean, running_var = sh._batchnorm_helper(
        g, input, weight, bias, running_mean, running_var)
    out = g.op("BatchNormalization", input, weight, bias, running_mean, running_var,
               epsilon_f=eps, momentum_f=1.0, training_mode_i=0, outputs=1)
    return out, None, None, None


def register(opset: int) -> None:
    """Register both symbolics for ``opset`` (>= 15, ORT uses 17) in torch's exporter.

    Call inside :func:`bnswap.ort._compat.ort_scope`, which undoes the registration.
    """
    from torch.onnx import register_custom_op_symbolic

    register_custom_op_symbolic("aten::_batch_norm_with_update", _batch_norm_with_update, opset)
    register_custom_op_symbolic("aten::_batch_norm_no_update", _batch_norm_no_update, opset)
