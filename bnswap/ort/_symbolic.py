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


#: Fill values of the private statistics given to batch-statistics-only layers.
_SCRATCH_MEAN = 2.0 ** -100
_SCRATCH_VAR = 2.0 ** -99


def _private_stat(g, input, like, fill: float):
    import torch

    tse = importlib.import_module(f"{_TSE}._type_utils")
    channels = _helpers()._get_tensor_dim_size(input, 1)
    dtype = tse.JitScalarType.from_value(like, tse.JitScalarType.FLOAT).dtype()
    if channels is None:
        raise RuntimeError("bnswap.ort: batch-statistics-only BatchNorm needs a static "
                           "channel count to export")
    return g.op("Constant", value_t=torch.full((channels,), fill, dtype=dtype))


def _batch_norm_with_update(g, input, weight, bias, running_mean, running_var, momentum, eps):
    sh = _helpers()
    eps = sh._maybe_get_const(eps, "f")
    weight, bias, running_mean, running_var = sh._batchnorm_helper(
        g, input, weight, bias, running_mean, running_var)
    if running_mean.node().kind() != "prim::Param" or running_var.node().kind() != "prim::Param":
        # Throw-away statistics (track_running_stats=False): BatchNormInternal writes the
        # batch statistics into them (aliased outputs). Zeros / ones would be merged by
        # ORT's constant sharing with an affine=False layer's constant bias / weight,
        # which the write would then corrupt; use private values instead.
        running_mean = _private_stat(g, input, running_mean, _SCRATCH_MEAN)
        running_var = _private_stat(g, input, running_var, _SCRATCH_VAR)
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


def keep_running_stat_aliases(model) -> int:
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
    from onnx import helper, numpy_helper

    graph = model.graph
    outputs = {o.name for o in graph.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def reaches_only_outputs(name: str, depth: int = 0) -> bool:
        users = consumers.get(name, [])
        if depth > 8 or (not users and name not in outputs):
            return False
        return all(u.op_type == "Identity" and reaches_only_outputs(u.output[0], depth + 1)
                   for u in users)

    graph_inputs = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    rewritten = 0
    new_nodes = []
    for node in graph.node:
        if node.op_type == "BatchNormalization":
            # Constant weight / bias / statistics (affine=False, track_running_stats=False)
            # may be one value shared by several layers after the exporter's CSE; ORT's
            # gradient builder then defines the same gradient name twice, and
            # BatchNormInternal would write statistics into a shared constant. Give each
            # batch norm private copies.
            for idx in range(1, min(5, len(node.input))):
                name = node.input[idx]
                src = producers.get(name)
                if name in graph_inputs or src is None or src.op_type not in (
                        "Constant", "ConstantOfShape"):
                    continue
                value = _constant_value(src, producers, _channels(node, graph, producers))
                if value is None:
                    continue
                private = f"{name}_bnswap_{node.name or id(node)}_{idx}"
                # A Constant becomes an initializer in ORT, which its CSE leaves alone
                # (identical ConstantOfShape nodes would be merged again).
                new_nodes.append(helper.make_node(
                    "Constant", [], [private], name=private,
                    value=numpy_helper.from_array(value, private + "_value")))
                node.input[idx] = private
                rewritten += 1
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
        onnx_dedupe_dead(new_nodes, graph)
        del graph.node[:]
        graph.node.extend(new_nodes)
    return rewritten


def onnx_dedupe_dead(nodes: list, graph) -> None:
    """Drop Constant / ConstantOfShape nodes whose outputs nothing uses any more."""
    used = {name for n in nodes for name in n.input} | {o.name for o in graph.output}
    nodes[:] = [n for n in nodes if not (n.op_type in ("Constant", "ConstantOfShape")
                                         and all(o not in used for o in n.output))]


def _channels(bn, graph, producers) -> int | None:
    """C of a BatchNormalization node, from a statically shaped parameter input."""
    from onnx import numpy_helper

    typed = {i.name: i for i in graph.input}
    for name in bn.input[1:5]:
        if name in typed:
            dims = typed[name].type.tensor_type.shape.dim
            if len(dims) == 1 and dims[0].HasField("dim_value"):
                return int(dims[0].dim_value)
        src = producers.get(name)
        if src is not None and src.op_type == "Constant":
            attrs = {a.name: a for a in src.attribute}
            if "value" in attrs:
                return int(numpy_helper.to_array(attrs["value"].t).size)
    return None


def _constant_value(node, producers, channels):
    """The (C,) array a Constant / ConstantOfShape node feeding a batch norm produces,
    or None if unknown."""
    import numpy as np
    from onnx import numpy_helper

    attrs = {a.name: a for a in node.attribute}
    if node.op_type == "Constant":
        return numpy_helper.to_array(attrs["value"].t) if "value" in attrs else None
    if channels is None:
        return None
    fill = (numpy_helper.to_array(attrs["value"].t) if "value" in attrs
            else np.zeros(1, dtype=np.float32))
    return np.full((channels,), fill.reshape(-1)[0], dtype=fill.dtype)
