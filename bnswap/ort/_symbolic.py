"""TorchScript-exporter symbolics for the consolidated batch-norm ops (pytorch PR 116092).

torch's TorchScript ONNX exporter has symbolics for ``aten::batch_norm`` only; bnswap
layers trace to

* ``aten::_batch_norm_with_update(input, weight, bias, running_mean!, running_var!,
  float momentum, float eps) -> (out, save_mean, save_invstd, reserve)`` (batch
  statistics), exported as ONNX ``BatchNormalization`` (opset 15) with
  ``training_mode=1``, which ORT's pre-training transform rewrites into
  ``com.microsoft::BatchNormInternal`` + ``BatchNormalizationGrad``;
* ``aten::batch_norm(..., training=False, ...)`` (running statistics: what a swapped
  layer runs in evaluation, stock's own call), exported as ``BatchNormalization`` with
  ``training_mode=0``, or written out element-wise for a frozen layer inside ORT's
  training graph (below); with ``training=True`` (code that calls ``F.batch_norm``
  itself) torch's own symbolic; ``aten::_batch_norm_no_update`` (what earlier bnswap
  releases ran in evaluation) the same way.

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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx

#: The TorchScript exporter's graph context and values (``torch._C.Value``) the symbolics
#: get: private classes whose module moved between torch releases (``_TSE``).
_G = Any
_V = Any

_TSE = "torch.onnx._internal.torchscript_exporter"

__all__ = ["ONNX_TRAINING_MOMENTUM", "register"]

#: ONNX momentum emitted for training-mode batch norm: running stats := batch stats.
ONNX_TRAINING_MOMENTUM = 0.0


def _helpers() -> Any:
    return importlib.import_module(f"{_TSE}.symbolic_helper")


#: Fill values of the private statistics given to batch-statistics-only layers.
_SCRATCH_MEAN = 2.0**-100
_SCRATCH_VAR = 2.0**-99


def _private_stat(g: _G, input: _V, like: _V, fill: float) -> _V:
    import torch

    tse = importlib.import_module(f"{_TSE}._type_utils")
    channels = _helpers()._get_tensor_dim_size(input, 1)
    dtype = tse.JitScalarType.from_value(like, tse.JitScalarType.FLOAT).dtype()
    if channels is None:
        raise RuntimeError(
            "bnswap.ort: batch-statistics-only BatchNorm needs a static channel count to export"
        )
    return g.op("Constant", value_t=torch.full((channels,), fill, dtype=dtype))


def _batch_norm_with_update(
    g: _G, input: _V, weight: _V, bias: _V, running_mean: _V, running_var: _V, momentum: _V, eps: _V
) -> tuple[_V, None, None, None]:
    sh = _helpers()
    eps = sh._maybe_get_const(eps, "f")
    weight, bias, running_mean, running_var = sh._batchnorm_helper(
        g, input, weight, bias, running_mean, running_var
    )
    if running_mean.node().kind() != "prim::Param" or running_var.node().kind() != "prim::Param":
        # Throw-away statistics (track_running_stats=False): BatchNormInternal writes the
        # batch statistics into them (aliased outputs). Zeros / ones could be merged by
        # ORT's common-subexpression pass with any equal constant of the model, which
        # the write would then corrupt; use values no model uses instead.
        running_mean = _private_stat(g, input, running_mean, _SCRATCH_MEAN)
        running_var = _private_stat(g, input, running_var, _SCRATCH_VAR)
    out, new_mean, new_var = g.op(
        "BatchNormalization",
        input,
        weight,
        bias,
        running_mean,
        running_var,
        epsilon_f=eps,
        momentum_f=ONNX_TRAINING_MOMENTUM,
        training_mode_i=1,
        outputs=3,
    )
    new_mean.setType(running_mean.type())
    new_var.setType(running_var.type())
    return out, None, None, None


def _exporting_for_training() -> bool:
    import torch

    globals_ = importlib.import_module(f"{_TSE}._globals").GLOBALS
    return bool(globals_.training_mode == torch.onnx.TrainingMode.TRAINING)


def _batch_norm_no_update(
    g: _G, input: _V, weight: _V, bias: _V, running_mean: _V, running_var: _V, momentum: _V, eps: _V
) -> tuple[_V, None, None, None]:
    sh = _helpers()
    eps = sh._maybe_get_const(eps, "f")
    weight, bias, running_mean, running_var = sh._batchnorm_helper(
        g, input, weight, bias, running_mean, running_var
    )
    if _exporting_for_training():
        # An eval-mode (frozen) layer inside ORT's training graph. ORT's training
        # transform turns every BatchNormalization into BatchNormInternal, which
        # normalizes with batch statistics whatever training_mode says (measured on
        # onnxruntime-training 1.19.2: a frozen layer's output was 0.64 off stock's).
        # Written out as element-wise ops (ORT differentiates each), the running-stat
        # normalization of aten's native CPU kernel: y = x * a + b with
        # a = weight / sqrt(running_var + eps), b = bias - running_mean * a.
        return (
            _frozen_batch_norm(g, sh, input, weight, bias, running_mean, running_var, eps),
            None,
            None,
            None,
        )
    out = g.op(
        "BatchNormalization",
        input,
        weight,
        bias,
        running_mean,
        running_var,
        epsilon_f=eps,
        momentum_f=1.0,
        training_mode_i=0,
        outputs=1,
    )
    return out, None, None, None


def _batch_norm(
    g: _G,
    input: _V,
    weight: _V,
    bias: _V,
    running_mean: _V,
    running_var: _V,
    training: _V,
    momentum: _V,
    eps: _V,
    cudnn_enabled: _V,
) -> _V:
    """``aten::batch_norm``: in evaluation as :func:`_batch_norm_no_update` (a frozen
    layer in ORT's training graph needs it); in training, torch's own symbolic."""
    sh = _helpers()
    if sh._maybe_get_const(training, "i"):
        opset = importlib.import_module(f"{_TSE}.symbolic_opset14")
        return opset.batch_norm(
            g,
            input,
            weight,
            bias,
            running_mean,
            running_var,
            training,
            momentum,
            eps,
            cudnn_enabled,
        )
    return _batch_norm_no_update(g, input, weight, bias, running_mean, running_var, momentum, eps)[
        0
    ]


def _frozen_batch_norm(
    g: _G,
    sh: Any,
    input: _V,
    weight: _V,
    bias: _V,
    running_mean: _V,
    running_var: _V,
    eps: float,
) -> _V:
    import torch

    rank = sh._get_tensor_rank(input)
    if rank is None:
        raise RuntimeError(
            "bnswap.ort: an eval-mode BatchNorm in a training graph needs "
            "an input of known rank to export"
        )
    shape = g.op("Constant", value_t=torch.tensor([1, -1] + [1] * (rank - 2), dtype=torch.int64))
    eps_c = g.op("Constant", value_t=torch.tensor(eps, dtype=torch.float32))
    invstd = g.op("Reciprocal", g.op("Sqrt", g.op("Add", running_var, eps_c)))
    scale = g.op("Mul", weight, invstd)
    shift = g.op("Sub", bias, g.op("Mul", running_mean, scale))
    return g.op(
        "Add", g.op("Mul", input, g.op("Reshape", scale, shape)), g.op("Reshape", shift, shape)
    )


def register(opset: int) -> None:
    """Register the symbolics for ``opset`` (>= 15, ORT uses 17) in torch's exporter.

    Call inside :func:`bnswap.ort._compat.ort_scope`, which undoes the registration.
    """
    from torch.onnx import register_custom_op_symbolic

    register_custom_op_symbolic("aten::_batch_norm_with_update", _batch_norm_with_update, opset)
    register_custom_op_symbolic("aten::_batch_norm_no_update", _batch_norm_no_update, opset)
    register_custom_op_symbolic("aten::batch_norm", _batch_norm, opset)


def keep_running_stat_aliases(model: onnx.ModelProto) -> int:
    """Make ORT write running statistics for batch norms whose output is a model output.

    Measured with onnxruntime-training 1.19.2 (CPU): when a training-mode
    ``BatchNormalization``'s output is consumed only by the graph output (the model
    returns the batch norm's output, e.g. a network ending in BatchNorm1d), ORT's
    training session does not write ``BatchNormInternal``'s aliased running-stat outputs
    into the input buffers, while any other consumer (even ``Mul``) restores the write.
    Such outputs get an exact no-op, ``(y * 2) * 0.5`` (power-of-two scaling is exact in
    floating point, and ORT's no-op elimination keeps it), before the graph output.

    Args:
        model: ``onnx.ModelProto`` from the TorchScript exporter; changed in place.

    Returns:
        The number of batch-norm outputs rewritten.
    """
    import onnx
    from onnx import helper

    graph = model.graph
    outputs = {o.name for o in graph.output}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def reaches_only_outputs(name: str, depth: int = 0) -> bool:
        users = consumers.get(name, [])
        if depth > 8 or (not users and name not in outputs):
            return False
        return all(
            u.op_type == "Identity" and reaches_only_outputs(u.output[0], depth + 1) for u in users
        )

    rewritten = 0
    new_nodes = []
    for node in graph.node:
        new_nodes.append(node)
        if node.op_type != "BatchNormalization" or len(node.output) < 3:
            continue
        y = node.output[0]
        if not reaches_only_outputs(y):
            continue
        raw = y + "_bnswap_raw"
        doubled = y + "_bnswap_x2"
        node.output[0] = raw
        two = helper.make_tensor(raw + "_two", onnx.TensorProto.FLOAT, [], [2.0])
        half = helper.make_tensor(raw + "_half", onnx.TensorProto.FLOAT, [], [0.5])
        new_nodes.append(helper.make_node("Constant", [], [two.name], value=two))
        new_nodes.append(helper.make_node("Constant", [], [half.name], value=half))
        new_nodes.append(helper.make_node("Mul", [raw, two.name], [doubled]))
        new_nodes.append(helper.make_node("Mul", [doubled, half.name], [y]))
        rewritten += 1
    if rewritten:
        del graph.node[:]
        graph.node.extend(new_nodes)
    return rewritten
