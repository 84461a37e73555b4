"""``bnswap.to_stock_ops``: an exported graph's bnswap batch norms as stock's op.

A swapped layer records the consolidated ops under ``torch.export`` (that is its point:
``_batch_norm_with_update`` keeps cuDNN selectable where stock's graph binds the native
kernel, pytorch issue 111384). Graph tools written against stock's graph look for
``aten.batch_norm`` instead: torchao's pt2e quantization finds conv-BN pairs by that op
(its QAT fold, its quantizers' conv-BN patterns; bnswap applies this rewrite for it
automatically, :mod:`bnswap._compat`). This rewrite turns the graph into exactly what
stock's layer records, node for node:

* ``aten._batch_norm_with_update(x, w, b, running_mean, running_var, momentum, eps)``
  -> ``aten.batch_norm(x, w, b, running_mean, running_var, True, momentum, eps,
  False)`` (``cudnn_enabled`` False, as ``torch.export`` records stock's call on torch
  2.13 / 2.14 / 2.15: it traces with cuDNN off; on 2.9 the flag as it is, as stock's);
  ``aten._batch_norm_no_update(...)`` -> the same with ``training``
  False. The
  ops' schemas (``native_functions.yaml``) take the same arguments, and both update
  the statistics they are given in place with ``momentum`` and the unbiased batch
  variance: the semantics are the same. Only the first output of the consolidated ops is
  ever used (save_mean / save_invstd / reserve feed autograd).
* The constant ones / zeros bnswap passes for a missing weight / bias
  (``affine=False``) and the throw-away statistics of ``track_running_stats=False``
  become ``None`` again, as stock passes them.
* bnswap's empty-batch runtime assertion (:data:`bnswap.functional.EMPTY_BATCH_MESSAGE`) is
  removed: stock's ``aten.batch_norm`` accepts an empty batch.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

from bnswap.functional import EMPTY_BATCH_MESSAGE

__all__ = ["to_stock_ops"]

_aten = torch.ops.aten
_WITH_UPDATE = _aten._batch_norm_with_update.default
_WITH_UPDATE_FUNCTIONAL = _aten._batch_norm_with_update_functional.default
_NO_UPDATE = _aten._batch_norm_no_update.default
_TARGETS = (_WITH_UPDATE, _WITH_UPDATE_FUNCTIONAL, _NO_UPDATE)


def _export_cudnn_enabled() -> bool:
    """aten.batch_norm's last argument (``cudnn_enabled``) as ``torch.export`` records
    stock's layer on this torch: ``F.batch_norm`` passes ``torch.backends.cudnn.enabled``,
    read inside export's ``_ignore_backend_decomps`` (torch/export/_trace.py), which turns
    cuDNN off on torch 2.13 / 2.14 / 2.15 and leaves it as it is on 2.9 (``make compat``).
    The flags that context sets are restored on exit."""
    try:
        from torch.export._trace import _ignore_backend_decomps
    except ImportError:  # a release without it: the newest known behaviour
        return False
    with _ignore_backend_decomps():
        return bool(torch.backends.cudnn.enabled)


_FILLS = {_aten.full.default: None, _aten.ones.default: 1.0, _aten.zeros.default: 0.0}


def _fill_value(arg: object) -> float | None:
    """The constant ``arg`` is filled with, when it is a fresh full / ones / zeros node
    used only once (bnswap's stand-ins), else None."""
    if not isinstance(arg, Node) or arg.op != "call_function" or arg.target not in _FILLS:
        return None
    if len(arg.users) != 1:
        return None
    value = _FILLS[arg.target]
    if value is None:
        value = arg.args[1] if len(arg.args) > 1 else None
    return float(value) if isinstance(value, (int, float)) else None


def _stand_ins(node: Node, training: bool) -> tuple[list, list[Node]]:
    """The op's (x, w, b, mean, var) with bnswap's stand-ins as None, and those nodes."""
    x, w, b, mean, var = node.args[:5]
    constants = []
    if _fill_value(w) == 1.0:
        constants.append(w)
        w = None
    if _fill_value(b) == 0.0:
        constants.append(b)
        b = None
    if training and _fill_value(mean) == 0.0 and _fill_value(var) == 1.0:
        constants += [mean, var]  # track_running_stats=False: stock passes no statistics
        mean = var = None
    return [x, w, b, mean, var], constants


def _rewrite(graph: torch.fx.Graph, node: Node, core_aten: bool,
             renamed: Callable[[str, str], None] | None = None) -> bool:
    users = list(node.users)
    if any(u.target is not operator.getitem for u in users):
        return False
    momentum, eps = node.args[5], node.args[6]
    functional = node.target is _WITH_UPDATE_FUNCTIONAL
    training = node.target is not _NO_UPDATE
    (x, w, b, mean, var), constants = _stand_ins(node, training)
    # which outputs of the new op the old op's outputs become (None: must be unused)
    if functional and mean is None:  # (out, save_mean, save_invstd) of no_stats
        target, args = _aten._native_batch_norm_legit.no_stats, (x, w, b, True, momentum, eps)
        index: dict[int, int | None] = {0: 0, 1: 1, 2: 2}
    elif functional:  # (out, save_mean, save_rstd, running_mean_out, running_var_out)
        target = _aten._native_batch_norm_legit_functional.default
        args = (x, w, b, mean, var, True, momentum, eps)
        index = {0: 0, 1: 1, 2: 2, 4: 3, 5: 4}
    elif core_aten and not training:  # (out, save_mean, save_rstd)
        target = _aten._native_batch_norm_legit_no_training.default
        args = (x, w, b, mean, var, momentum, eps)
        index = {0: 0, 1: 1, 2: 2}
    else:  # the pre-dispatch graph torch.export.export returns: one tensor
        target = _aten.batch_norm.default
        args = (x, w, b, mean, var, training, momentum, eps, _export_cudnn_enabled())
        index = {0: None}
    if any(u.args[1] not in index and u.users for u in users):
        return False  # an output stock's op has no counterpart for is used
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta.update(node.meta)
    first = next((u for u in users if u.args[1] == 0), None)
    old_val = node.meta.get("val")
    if isinstance(old_val, (tuple, list)):
        if index == {0: None}:
            new.meta["val"] = old_val[0]
        else:  # new output j is old output i where index[i] == j
            new.meta["val"] = tuple(old_val[i] for i, _ in sorted(
                index.items(), key=lambda kv: kv[1]))
    for u in users:
        i = u.args[1]
        if index == {0: None} and u is first:
            u.replace_all_uses_with(new)
            if renamed is not None:  # an ExportedProgram's signature names its outputs
                renamed(u.name, new.name)
            graph.erase_node(u)
        elif index != {0: None} and index.get(i) is not None:
            u.args = (new, index[i])  # the same getitem node: the signature's names stay
        else:
            graph.erase_node(u)
    graph.erase_node(node)
    for c in constants:
        if not c.users:
            graph.erase_node(c)
    return True


def _drop_empty_batch_asserts(graph: torch.fx.Graph) -> None:
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is _aten._assert_scalar.default
                and len(node.args) > 1 and node.args[1] == EMPTY_BATCH_MESSAGE):
            cond = node.args[0]
            graph.erase_node(node)
            # its condition (numel != 0) and what computed it, when nothing else uses them
            stack = [cond]
            while stack:
                n = stack.pop()
                if isinstance(n, Node) and n.op == "call_function" and not n.users:
                    stack.extend(a for a in n.args if isinstance(a, Node))
                    graph.erase_node(n)


def to_stock_ops(module: GraphModule | torch.export.ExportedProgram, *,
                 core_aten: bool = False) -> int:
    """Rewrite bnswap's batch-norm nodes of an exported graph into stock's
    ``aten.batch_norm``, in place.

    The rewritten graph is the one stock ``nn.BatchNorm`` layers record: the same op,
    arguments, outputs and statistics updates (see the module docstring for the rule,
    from the ops' schemas in ``native_functions.yaml``). bnswap calls it for torchao's
    ``prepare_pt2e`` / ``prepare_qat_pt2e``; call it yourself for other graph tools that
    expect stock's op. The graph loses what bnswap's op gives (cuDNN in a training graph
    on CUDA, pytorch issue 111384).

    Args:
        module: a ``torch.fx.GraphModule`` (``exported_program.module()``, or a
            ``torch.export`` / ``make_fx`` graph) or a ``torch.export.ExportedProgram``
            (its ``graph_module``, and its signature), holding
            ``aten._batch_norm_with_update`` / ``_batch_norm_no_update`` nodes (the
            pre-dispatch graph ``torch.export.export`` returns) or, after
            ``run_decompositions()``, ``_batch_norm_with_update_functional``.
        core_aten: the graph is core ATen (``run_decompositions()`` was run): the nodes
            become stock's decomposed ops, ``_native_batch_norm_legit_functional`` /
            ``_native_batch_norm_legit.no_stats`` (track_running_stats=False) /
            ``_native_batch_norm_legit_no_training``, not ``aten.batch_norm``.

    Returns:
        The number of batch-norm nodes rewritten (0 for a stock graph).

    Raises:
        TypeError: ``module`` is neither.

    Examples::

        >>> import torch, bnswap
        >>> from torch import nn
        >>> model = bnswap.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
        >>> gm = torch.export.export(model, (torch.randn(2, 3, 8, 8),)).module()
        >>> bnswap.to_stock_ops(gm)
        1
        >>> [str(n.target) for n in gm.graph.nodes if "batch_norm" in str(n.target)]
        ['aten.batch_norm.default']
    """
    renamed = None
    if isinstance(module, torch.export.ExportedProgram):
        gm = module.graph_module
        renamed = module.graph_signature.replace_all_uses
    elif isinstance(module, GraphModule):
        gm = module
    else:
        raise TypeError(
            "bnswap.to_stock_ops expects a torch.fx.GraphModule or a "
            f"torch.export.ExportedProgram, got {type(module).__name__}")
    count = 0
    for sub in gm.modules():  # the root graph and any nested graphs (cond, scan...)
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        changed = False
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in _TARGETS:
                if _rewrite(graph, node, core_aten, renamed if sub is gm else None):
                    count += 1
                    changed = True
        before = len(graph.nodes)
        _drop_empty_batch_asserts(graph)
        if changed or len(graph.nodes) != before:
            graph.lint()
            sub.recompile()  # type: ignore[operator]
    return count
