"""The node rewrites of :mod:`bnswap.programs`, both directions: ``to_stock_ops`` (below)
and ``to_consolidated_ops`` (stock's batch-norm nodes as the ops bnswap's layers run:
``bnswap.convert(program)``, whose docstring gives the rules). They sit low because
:mod:`bnswap._compat` applies ``to_stock_ops`` for torch.onnx and torchao.

A swapped layer in training records the consolidated ops under ``torch.export``
(``_batch_norm_with_update``: its kernel is picked when it runs; in evaluation it records
stock's own ``aten.batch_norm``). Graph tools written against stock's graph look for
``aten.batch_norm``: torchao's pt2e quantization finds conv-BN pairs by that op (its QAT
fold, its quantizers' conv-BN patterns; bnswap applies this rewrite for it automatically,
:mod:`bnswap._compat`). This rewrite turns the graph into exactly what stock's layer
records, node for node:

* ``aten._batch_norm_with_update(x, w, b, running_mean, running_var, momentum, eps)``
  -> ``aten.batch_norm(x, w, b, running_mean, running_var, True, momentum, eps,
  False)`` (``cudnn_enabled`` as ``torch.export`` records stock's call: False on torch
  2.13 / 2.14 / 2.15, which trace with cuDNN off; on 2.9 the flag as it is. No release
  reads the argument: ``_batch_norm_impl_index`` asks ``torch.backends.cudnn.enabled``
  when it runs); ``aten._batch_norm_no_update(...)``, which programs of earlier bnswap
  releases hold, -> the same with ``training`` False. The ops' schemas
  (``native_functions.yaml``) take the same arguments, and both update the statistics
  they are given in place with ``momentum`` and the unbiased batch variance: the
  semantics are the same. Only the first output of the consolidated ops is ever used
  (save_mean / save_invstd / reserve feed autograd).
* The stand-in ones / zeros bnswap passes for a missing weight / bias
  (``aten.full_like`` of the layer's tensor or of the input's channel view; in programs
  bnswap saved before, ``aten.full`` / ``ones`` / ``zeros``)
  (``affine=False``) and the throw-away statistics of ``track_running_stats=False``
  become ``None`` again, as stock passes them (also for the functional op
  ``bnswap.convert(program)`` records for such a node: ``aten.batch_norm`` without
  statistics, or ``_native_batch_norm_legit.no_stats`` with ``core_aten``).
* bnswap's empty-batch runtime assertion (:data:`bnswap.functional.EMPTY_BATCH_MESSAGE`,
  recorded by its layers and added by ``bnswap.convert(program)``) is removed: stock's
  ``aten.batch_norm`` accepts an empty batch.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch._ops import OpOverload
from torch.fx import GraphModule, Node
from torch.fx.node import Argument

from bnswap.functional import EMPTY_BATCH_MESSAGE, EMPTY_BATCH_MESSAGES

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["to_stock_ops"]

_aten = torch.ops.aten
_WITH_UPDATE = _aten._batch_norm_with_update.default
_WITH_UPDATE_FUNCTIONAL = _aten._batch_norm_with_update_functional.default
_NO_UPDATE = _aten._batch_norm_no_update.default
_BATCH_NORM = _aten.batch_norm.default
#: bnswap's forward nodes :func:`to_stock_ops` rewrites (``_batch_norm_no_update``: in
#: programs of earlier releases, which ran it in evaluation)
_TARGETS = (_WITH_UPDATE, _WITH_UPDATE_FUNCTIONAL, _NO_UPDATE)
#: the consolidated ops' nodes (forward and backward): a graph holding one needs
#: bnswap's patches (:func:`bnswap.programs.install_patches_for`)
CONSOLIDATED_TARGETS = (*_TARGETS, _aten.batch_norm_backward.default)
#: the consolidated nodes bnswap's layers record today, which ``convert`` keeps
#: (``_batch_norm_no_update`` is not among them: it has no kernel off the CPU, and
#: ``convert`` rewrites it)
CURRENT_TARGETS = (_WITH_UPDATE, _WITH_UPDATE_FUNCTIONAL, _aten.batch_norm_backward.default)


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


#: The ops a stand-in can be (their fill value; None: the op's second argument):
#: ``full_like(like, value)`` is what bnswap's layers and ``bnswap.convert(program)``
#: record (it follows the tensor it is made like: :func:`bnswap.functional._stand_ins`);
#: full / ones / zeros with a literal device and dtype are what bnswap recorded before
#: (programs saved then still load and turn back into stock's).
_FILLS = {
    _aten.full_like.default: None,
    _aten.full.default: None,
    _aten.ones.default: 1.0,
    _aten.zeros.default: 0.0,
}


def _fill_value(arg: object) -> float | None:
    """The constant ``arg`` is filled with, when it is a fresh fill node (:data:`_FILLS`)
    used only once (bnswap's stand-ins), else None."""
    if not isinstance(arg, Node) or arg.op != "call_function" or arg.target not in _FILLS:
        return None
    if len(arg.users) != 1:
        return None
    value: object = _FILLS[arg.target]
    if value is None:
        value = arg.args[1] if len(arg.args) > 1 else None
    return float(value) if isinstance(value, (int, float)) else None


def _stand_ins(node: Node, training: bool) -> tuple[list[Argument], list[Node]]:
    """The op's (x, w, b, mean, var) with bnswap's stand-ins as None, and those nodes."""
    x, w, b, mean, var = node.args[:5]
    constants: list[Node] = []
    if isinstance(w, Node) and _fill_value(w) == 1.0:
        constants.append(w)
        w = None
    if isinstance(b, Node) and _fill_value(b) == 0.0:
        constants.append(b)
        b = None
    if (
        training
        and isinstance(mean, Node)
        and isinstance(var, Node)
        and _fill_value(mean) == 0.0
        and _fill_value(var) == 1.0
    ):
        constants += [mean, var]  # track_running_stats=False: stock passes no statistics
        mean = var = None
    return [x, w, b, mean, var], constants


def _erase_unused(graph: torch.fx.Graph, nodes: Iterable[Argument]) -> None:
    """Erase each of ``nodes`` that nothing uses any more, and what computed it when
    nothing else uses that either (a stand-in's channel view of its input, an
    assertion's condition). Placeholders and impure nodes (in-place updates) stay."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if (
            isinstance(n, Node)
            and n.op == "call_function"
            and not n.users
            and n.graph is graph
            and not n.is_impure()
        ):
            stack.extend(a for a in n.all_input_nodes)
            graph.erase_node(n)


def _rewrite(
    graph: torch.fx.Graph,
    node: Node,
    core_aten: bool,
    renamed: Callable[[str, str], None] | None = None,
) -> bool:
    users = list(node.users)
    if any(u.target is not operator.getitem for u in users):
        return False
    momentum, eps = node.args[5], node.args[6]
    functional = node.target is _WITH_UPDATE_FUNCTIONAL
    training = node.target is not _NO_UPDATE
    (x, w, b, mean, var), constants = _stand_ins(node, training)
    args: tuple[Argument, ...]
    # which outputs of the new op the old op's outputs become (None: must be unused)
    only_out = all(u.args[1] == 0 or not u.users for u in users)
    if functional and mean is None and (core_aten or not only_out):
        # (out, save_mean, save_invstd) of no_stats: stock's decomposed op. (In the
        # training IR stock records aten.batch_norm with no statistics, below: a
        # converted stock program's track_running_stats=False node is functional.)
        target, args = _aten._native_batch_norm_legit.no_stats, (x, w, b, True, momentum, eps)
        index: dict[int, int | None] = {0: 0, 1: 1, 2: 2}
    elif functional and mean is not None:
        # (out, save_mean, save_rstd, running_mean_out, running_var_out)
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
            old_of = {j: i for i, j in index.items() if j is not None}
            new.meta["val"] = tuple(old_val[old_of[j]] for j in sorted(old_of))
    for u in users:
        i = u.args[1]
        assert isinstance(i, int)  # every user is a getitem of the op's output tuple
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
    _erase_unused(graph, constants)
    return True


def _eval_to_core(
    graph: torch.fx.Graph, node: Node, renamed: Callable[[str, str], None] | None
) -> bool:
    """``aten.batch_norm(..., training=False, ...)`` in a core ATen graph (what
    ``bnswap.convert`` made of ``_native_batch_norm_legit_no_training``) as that op again:
    output 0 of ``_native_batch_norm_legit_no_training(x, w, b, running_mean,
    running_var, momentum, eps)``. False (unchanged) for a node in training."""
    call = stock_call(node)
    assert call is not None  # an aten.batch_norm node
    (x, w, b, mean, var, training, momentum, eps), _ = call
    if training is not False:
        return False
    with graph.inserting_before(node):
        new = graph.call_function(
            _aten._native_batch_norm_legit_no_training.default, (x, w, b, mean, var, momentum, eps)
        )
        out = graph.call_function(operator.getitem, (new, 0))
    for n in (new, out):
        n.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    _set_val(new, _fake_mode(graph))
    val = _val(new)
    if isinstance(val, (tuple, list)):
        out.meta["val"] = val[0]
    node.replace_all_uses_with(out)
    if renamed is not None:  # an ExportedProgram's signature names its outputs
        renamed(node.name, out.name)
    graph.erase_node(node)
    return True


def _drop_empty_batch_asserts(graph: torch.fx.Graph) -> None:
    for node in list(graph.nodes):
        if (
            node.op == "call_function"
            and node.target is _aten._assert_scalar.default
            and len(node.args) > 1
            and node.args[1] in EMPTY_BATCH_MESSAGES
        ):
            cond = node.args[0]
            graph.erase_node(node)
            # its condition (numel != 0) and what computed it, when nothing else uses them
            _erase_unused(graph, [cond])


def _signature_renames(ep: torch.export.ExportedProgram) -> list[tuple[Node, str]]:
    """The placeholders and outputs of ``ep`` whose names its graph signature spells
    otherwise, as (node, the signature's name), when each such name is free in the graph;
    [] otherwise (nothing a rename alone would mend)."""
    graph = ep.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    outs = output.args[0] if output is not None and output.args else ()
    sig = ep.graph_signature
    if (
        len(sig.input_specs) != len(placeholders)
        or not isinstance(outs, (tuple, list))
        or len(sig.output_specs) != len(outs)
    ):
        return []
    taken = {n.name: n for n in graph.nodes}
    renames = []
    for node, spec in (
        *zip(placeholders, sig.input_specs, strict=True),
        *zip(outs, sig.output_specs, strict=True),
    ):
        name = getattr(spec.arg, "name", None)
        if not isinstance(node, Node) or not isinstance(name, str) or node.name == name:
            continue
        if taken.get(name, node) is not node:
            return []
        renames.append((node, name))
    return renames


def validation_error(ep: torch.export.ExportedProgram) -> Exception | None:
    """``ep.validate()``'s ``SpecViolationError``, or None for a valid program (torch 2.4's
    ``ExportedProgram`` names it ``_validate``; without either, None)."""
    from torch._export.verifier import SpecViolationError

    check = getattr(ep, "validate", None) or getattr(ep, "_validate", None)
    if check is None:
        return None
    try:
        check()
    except SpecViolationError as err:
        return err
    return None


def check_program(ep: torch.export.ExportedProgram, *, repair: bool) -> None:
    """Raise torch's error (``ep.validate()``'s ``SpecViolationError``) for a program that
    is not valid, unless renaming nodes to the names its graph signature gives makes it
    valid: ``copy.deepcopy(ep)`` renames a node that shadows a Python builtin (the
    placeholder ``input`` of an ``nn.Sequential`` program becomes ``input_1``), which its
    signature does not follow; such a copy still runs (``.module()``,
    ``run_decompositions``), so bnswap takes it. With ``repair`` the renames are kept (the
    program is then valid); without, ``ep`` is left exactly as it was. Nothing is changed
    when the error is raised."""
    error = validation_error(ep)
    if error is None:
        return
    renames = _signature_renames(ep)
    before = [(n, n.name, n.target) for n, _ in renames]
    for node, name in renames:
        node.name = name  # (torch.export names its placeholders so, past the namespace)
        if node.op == "placeholder":
            node.target = name
    mended = bool(renames) and validation_error(ep) is None
    if mended and repair:
        ep.graph_module.recompile()
        return
    for node, name, target in before:  # back as they were
        node.name, node.target = name, target
    if not mended:
        raise error


def to_stock_ops(
    module: GraphModule | torch.export.ExportedProgram, *, core_aten: bool = False
) -> int:
    """Rewrite bnswap's batch-norm nodes of an exported graph into stock's
    ``aten.batch_norm``, in place (a program's own graph too: the public
    :func:`bnswap.to_stock_ops` returns a new program instead, issue 46).

    The rewritten graph is the one stock ``nn.BatchNorm`` layers record: the same op,
    arguments, outputs and statistics updates (see the module docstring for the rule,
    from the ops' schemas in ``native_functions.yaml``). bnswap calls it for torchao's
    pt2e calls (``prepare_pt2e`` / ``prepare_qat_pt2e``, ``move_exported_model_to_eval``
    / ``_train``, ``convert_pt2e``: their graphs stay stock's); call it yourself for
    other graph tools that expect stock's op. Its kernel is then stock's
    (:mod:`bnswap.kernels`: ``aten.batch_norm`` selects when it runs; with
    ``core_aten`` the ``_native_batch_norm_legit*`` ops bind the native kernel).

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
        >>> from bnswap._graph import to_stock_ops
        >>> to_stock_ops(gm)
        1
        >>> [str(n.target) for n in gm.graph.nodes if "batch_norm" in str(n.target)]
        ['aten.batch_norm.default']
    """
    renamed = None
    gm: GraphModule
    if isinstance(module, torch.export.ExportedProgram):
        check_program(module, repair=True)
        gm = module.graph_module
        renamed = module.graph_signature.replace_all_uses
    elif isinstance(module, GraphModule):
        gm = module
    else:
        raise TypeError(
            "bnswap.to_stock_ops expects a torch.fx.GraphModule or a "
            f"torch.export.ExportedProgram, got {type(module).__name__}"
        )
    count = 0
    for sub in gm.modules():  # the root graph and any nested graphs (cond, scan...)
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            names = renamed if sub is gm else None
            if (node.target in _TARGETS and _rewrite(graph, node, core_aten, names)) or (
                core_aten and node.target is _BATCH_NORM and _eval_to_core(graph, node, names)
            ):
                count += 1
                changed = True
        before = len(graph.nodes)
        _drop_empty_batch_asserts(graph)
        if changed or len(graph.nodes) != before:
            graph.lint()
            sub.recompile()  # type: ignore[operator]  # nn.Module.__getattr__ -> Tensor | Module
    return count


# ------------------------------------------------- the other direction: stock -> bnswap
# Stock's batch-norm ops, what each of them takes, as (x, w, b, mean, var, training,
# momentum, eps) positions (None: the op has no such argument), and whether it is
# functional (returns the new statistics rather than updating its inputs).
_STOCK: dict[object, tuple[tuple[int | None, ...], bool]] = {
    _aten.batch_norm.default: ((0, 1, 2, 3, 4, 5, 6, 7), False),
    _aten._native_batch_norm_legit_functional.default: ((0, 1, 2, 3, 4, 5, 6, 7), True),
    _aten._native_batch_norm_legit_no_training.default: ((0, 1, 2, 3, 4, None, 5, 6), False),
    _aten._native_batch_norm_legit.default: ((0, 1, 2, 3, 4, 5, 6, 7), False),
    _aten._native_batch_norm_legit.no_stats: ((0, 1, 2, None, None, 3, 4, 5), True),
    _aten.native_batch_norm.default: ((0, 1, 2, 3, 4, 5, 6, 7), False),
    # programs of earlier bnswap releases: evaluation on an op with no kernel off the CPU
    _NO_UPDATE: ((0, 1, 2, 3, 4, None, 5, 6), False),
}
_BACKWARD = _aten.native_batch_norm_backward.default
#: every op :func:`to_consolidated_ops` rewrites
STOCK_TARGETS = (*_STOCK, _BACKWARD)


def _arg(node: Node, i: int | None, default: Argument = None) -> Argument:
    if i is None:
        return default
    if i < len(node.args):
        return node.args[i]
    assert isinstance(node.target, OpOverload)  # one of _STOCK's ops
    return node.kwargs.get(node.target._schema.arguments[i].name, default)


def stock_call(node: Node) -> tuple[list[Argument], bool] | None:
    """``[x, w, b, mean, var, training, momentum, eps]`` of a stock batch-norm node and
    whether its op is functional; None for any other node."""
    if node.op != "call_function" or node.target not in _STOCK:
        return None
    pos, functional = _STOCK[node.target]
    args = [_arg(node, i) for i in pos]
    if pos[5] is None:
        args[5] = False  # _native_batch_norm_legit_no_training, _batch_norm_no_update
    return args, functional


def runs_bnswap_op(node: Node) -> bool:
    """Whether ``node`` runs the op a swapped layer runs in its place already: a
    consolidated op of training (:data:`CURRENT_TARGETS`), or stock's ``aten.batch_norm``
    in evaluation (what a swapped layer calls then). :func:`convert` keeps it."""
    if node.op != "call_function":
        return False
    if node.target in CURRENT_TARGETS:
        return True
    call = stock_call(node) if node.target is _BATCH_NORM else None
    return call is not None and call[0][5] is False


def consolidated_target(node: Node) -> tuple[OpOverload | None, str]:
    """The op a stock batch-norm node becomes (None: it stays), and why it stays (``"-"``
    when it does not): a consolidated op in training, ``aten.batch_norm`` in evaluation.
    ``native_batch_norm_backward`` becomes ``batch_norm_backward`` when its forward node
    is rewritten into a consolidated op too."""
    if node.op == "call_function" and node.target is _BACKWARD:
        fwd = _forward_of(node)
        if fwd is None or consolidated_target(fwd)[0] not in _TARGETS:
            return None, (
                "its forward is no stock batch-norm node this rewrite turns "
                "into a consolidated op (the cuDNN reserve comes from it)"
            )
        return _aten.batch_norm_backward.default, "-"
    call = stock_call(node)
    if call is None:
        return None, "not a batch-norm node"
    (x, w, b, mean, var, training, momentum, _eps), functional = call
    if (
        any(u.op != "call_function" or u.target is not operator.getitem for u in node.users)
        and node.target is not _BATCH_NORM
    ):
        return None, "an output is used other than by indexing"
    if (mean is None) != (var is None):
        return None, "only one of running_mean / running_var is given"
    if not isinstance(training, bool) or not isinstance(momentum, (int, float)):
        return None, "training / momentum is not a constant"
    if not training and mean is None:
        return None, "evaluation without running statistics (stock raises)"
    if not training and functional:
        return None, "a functional op in evaluation (no consolidated counterpart)"
    if not training:
        if node.target is _BATCH_NORM:
            return None, _EVAL_KEPT
        if any(u.args[1] != 0 and u.users for u in node.users):
            return None, (
                "evaluation with save_mean / save_invstd used (a backward graph): "
                "aten.batch_norm returns the output alone"
            )
        return _BATCH_NORM, "-"
    if w is None and b is None and mean is None and _rank(x) is None:
        return None, (
            "no shape metadata (node.meta['val']) for the input's channel "
            "view the stand-in weight / bias / statistics are made like"
        )
    if functional or mean is None:
        return _WITH_UPDATE_FUNCTIONAL, "-"
    return _WITH_UPDATE, "-"


#: Why stock's ``aten.batch_norm`` in evaluation stays: it is the op a swapped layer runs.
_EVAL_KEPT = "evaluation: aten.batch_norm picks its kernel when it runs (a swapped layer's op)"


def _forward_of(node: Node) -> Node | None:
    """The forward batch-norm node whose save_mean a ``native_batch_norm_backward``
    node reads (``getitem(forward, 1)``)."""
    save_mean = node.args[5] if len(node.args) > 5 else None
    if (
        isinstance(save_mean, Node)
        and save_mean.target is operator.getitem
        and isinstance(save_mean.args[0], Node)
        and (stock_call(save_mean.args[0]) or save_mean.args[0].target in _TARGETS)
    ):
        return save_mean.args[0]
    return None


def _val(node: object) -> object:
    return node.meta.get("val") if isinstance(node, Node) else None


def _rank(x: object) -> int | None:
    """The number of dimensions of ``x``'s value (>= 2), None without metadata."""
    v = _val(x)
    return v.dim() if isinstance(v, torch.Tensor) and v.dim() >= 2 else None


def _fake_mode(graph: torch.fx.Graph) -> FakeTensorMode | None:
    from torch._guards import detect_fake_mode

    try:
        return detect_fake_mode([v for n in graph.nodes if isinstance(v := _val(n), torch.Tensor)])
    except AssertionError:  # several fake modes (make_fx): the new nodes get no "val"
        return None


def _fill_like(
    graph: torch.fx.Graph,
    like: Argument,
    value: float,
    meta: dict[str, object],
    fake: FakeTensorMode | None,
) -> Node:
    """``aten.full_like(like, value)``, as bnswap's layers record their stand-ins (no
    device or dtype of its own: it follows ``like``; :func:`to_stock_ops` turns it back
    into ``None``)."""
    node = graph.call_function(_aten.full_like.default, (like, value), {"pin_memory": False})
    node.meta.update({k: v for k, v in meta.items() if k != "val"})
    _set_val(node, fake)
    return node


def _channel_view(
    graph: torch.fx.Graph, x: Node, meta: dict[str, object], fake: FakeTensorMode | None
) -> Node:
    """The (C,) view of ``x`` (N, C, *) a layer without any (C,) tensor of its own makes
    its stand-ins like, as bnswap's core does (``select(0, 0)``, then ``select(1, 0)``
    down to one dimension: no kernel, no copy)."""
    xv = _val(x)
    assert isinstance(xv, torch.Tensor)  # consolidated_target checked it: _rank(x)
    view = x
    for i in range(xv.dim() - 1):
        view = graph.call_function(_aten.select.int, (view, 0 if i == 0 else 1, 0))
        view.meta.update({k: v for k, v in meta.items() if k != "val"})
        _set_val(view, fake)
    return view


def _getitem(graph: torch.fx.Graph, node: Node, i: int, meta: dict[str, object]) -> Node:
    g = graph.call_function(operator.getitem, (node, i))
    g.meta.update({k: v for k, v in meta.items() if k != "val"})
    val = _val(node)
    if isinstance(val, (tuple, list)):
        g.meta["val"] = val[i]
    return g


def _set_val(node: Node, fake: FakeTensorMode | None) -> None:
    if fake is None:
        return
    args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    if any(isinstance(a, Node) and _val(a) is None for a in node.all_input_nodes):
        return
    assert callable(node.target)  # a call_function node: the op
    with fake:
        node.meta["val"] = node.target(*args, **node.kwargs)


def _assert_not_empty(graph: torch.fx.Graph, x: object, meta: dict[str, object]) -> None:
    """bnswap's empty-batch assertion (:data:`EMPTY_BATCH_MESSAGE`, what a converted
    layer's exported program carries) for a node whose input may be empty (a dynamic
    size: ``Dim("batch")`` admits 0). Stock's op returns early for an empty batch; the
    consolidated ops raise a kernel error, and by then the graph has counted the batch
    (stock's ``num_batches_tracked`` update comes between the input and the op). So the
    assertion goes right after the input is computed (after the placeholders when it is
    one), before any state moves; :func:`to_stock_ops` removes it with its condition."""
    xv = _val(x)
    if (
        not isinstance(x, Node)
        or not isinstance(xv, torch.Tensor)
        or not isinstance(xv.numel(), torch.SymInt)
    ):
        return
    at = x.next
    while at.op == "placeholder":
        at = at.next
    kept = {k: v for k, v in meta.items() if k != "val"}
    with graph.inserting_before(at):
        numel = graph.call_function(_aten.sym_numel.default, (x,))
        numel.meta.update(kept)
        numel.meta["val"] = xv.numel()
        cond = graph.call_function(operator.ne, (numel, 0))
        cond.meta.update(kept)
        cond.meta["val"] = xv.numel() != 0
        check = graph.call_function(_aten._assert_scalar.default, (cond, EMPTY_BATCH_MESSAGE))
        check.meta.update(kept)
        check.meta["val"] = None


def _to_consolidated(
    graph: torch.fx.Graph,
    node: Node,
    target: OpOverload,
    fake: FakeTensorMode | None,
    renamed: Callable[[str, str], None] | None,
) -> Node:
    call = stock_call(node)
    assert call is not None  # consolidated_target chose it
    (x, w, b, mean, var, _training, momentum, eps), _ = call
    # constants: consolidated_target checked momentum; eps is the schema's float literal
    assert isinstance(momentum, (int, float)) and isinstance(eps, (int, float))
    meta = dict(node.meta)
    if target is _BATCH_NORM:
        return _to_eval_batch_norm(graph, node, [x, w, b, mean, var], momentum, eps, renamed)
    _assert_not_empty(graph, x, meta)
    with graph.inserting_before(node):
        if w is None or b is None or mean is None:
            # what the stand-ins are made like: the layer's first (C,) tensor, else a view
            # of the input (plan checked its metadata then), as bnswap's core does
            like = next((t for t in (w, b, mean) if t is not None), None)
            if like is None:
                assert isinstance(x, Node)  # consolidated_target checked it: _rank(x)
                like = _channel_view(graph, x, meta, fake)
        if w is None:
            w = _fill_like(graph, like, 1.0, meta, fake)
        if b is None:
            b = _fill_like(graph, like, 0.0, meta, fake)
        if mean is None:  # batch statistics only: throw-away statistics, as bnswap's core
            mean = _fill_like(graph, like, 0.0, meta, fake)
            var = _fill_like(graph, like, 1.0, meta, fake)
        new = graph.call_function(target, (x, w, b, mean, var, float(momentum), float(eps)))
        new.meta.update({k: v for k, v in meta.items() if k != "val"})
        _set_val(new, fake)
    if node.target is _aten.batch_norm.default:  # one tensor: getitem 0 stands for it
        with graph.inserting_after(new):
            out = _getitem(graph, new, 0, meta)
        node.replace_all_uses_with(out)
        if renamed is not None:  # an ExportedProgram's signature names its outputs
            renamed(node.name, out.name)
    else:
        # (out, save_mean, save_invstd[, new_mean, new_var]) -> the consolidated op's
        # (out, save_mean, save_invstd, reserve[, new_mean, new_var])
        for u in list(node.users):
            i = u.args[1]
            assert isinstance(i, int)  # consolidated_target: only getitem users
            u.args = (new, i if i < 3 else i + 1)  # the same getitem nodes: names stay
    graph.erase_node(node)
    return new


def _to_eval_batch_norm(
    graph: torch.fx.Graph,
    node: Node,
    args: list[Argument],
    momentum: float,
    eps: float,
    renamed: Callable[[str, str], None] | None,
) -> Node:
    """An evaluation node (its output 0 alone used: :func:`consolidated_target`) as stock's
    ``aten.batch_norm(x, w, b, running_mean, running_var, False, momentum, eps,
    cudnn_enabled)``, the op a swapped layer runs in evaluation; stand-ins of an earlier
    bnswap's ``_batch_norm_no_update`` node become None again, as stock passes them."""
    (x, w, b, mean, var), constants = (
        _stand_ins(node, training=False) if node.target is _NO_UPDATE else (args, [])
    )
    with graph.inserting_before(node):
        new = graph.call_function(
            _BATCH_NORM, (x, w, b, mean, var, False, momentum, eps, _export_cudnn_enabled())
        )
    new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        new.meta["val"] = val[0]
    for u in list(node.users):
        if u.args[1] == 0:
            u.replace_all_uses_with(new)
            if renamed is not None:  # an ExportedProgram's signature names its outputs
                renamed(u.name, new.name)
        graph.erase_node(u)  # (consolidated_target: the other outputs are unused)
    graph.erase_node(node)
    _erase_unused(graph, constants)
    return new


def _backward_to_consolidated(
    graph: torch.fx.Graph, node: Node, fake: FakeTensorMode | None
) -> Node:
    """``native_batch_norm_backward(grad, x, w, mean, var, save_mean, save_invstd, train,
    eps, mask)`` -> ``batch_norm_backward(grad, x, w, mean, var, save_mean, save_invstd,
    update, eps, mask, reserve)``: the same arguments, the forward's weight (its
    stand-in when it had none) and its reserve (output 3)."""
    fwd = _forward_of(node)
    assert fwd is not None
    assert isinstance(node.target, OpOverload)  # native_batch_norm_backward
    schema = node.target._schema
    args = list(node.args) + [node.kwargs[a.name] for a in schema.arguments[len(node.args) :]]
    grad, x, _w, mean, var, save_mean, save_invstd, train, eps, mask = args[:10]
    meta = dict(node.meta)
    with graph.inserting_before(node):
        reserve = _getitem(graph, fwd, 3, meta)
        new = graph.call_function(
            _aten.batch_norm_backward.default,
            (grad, x, fwd.args[1], mean, var, save_mean, save_invstd, train, eps, mask, reserve),
        )
        new.meta.update({k: v for k, v in meta.items() if k != "val"})
        _set_val(new, fake)
    for u in list(node.users):
        u.args = (new, u.args[1])
    graph.erase_node(node)
    return new


def to_consolidated_ops(
    gm: GraphModule,
    *,
    names: Callable[[str], bool] | None = None,
    renamed: Callable[[str, str], None] | None = None,
) -> list[tuple[str, str, str]]:
    """Rewrite ``gm``'s stock batch-norm nodes (:data:`STOCK_TARGETS`) into the
    consolidated ops, in place, and recompile it; the low half of
    :func:`bnswap.programs.convert` (its docstring gives the rules).

    Args:
        gm: the graph (nested graphs included).
        names: which node names to rewrite (default: all).
        renamed: called with (old, new) when a node the graph outputs is replaced (an
            ExportedProgram's signature names its outputs).

    Returns:
        ``(node name, op before, op after)`` for each node rewritten, in graph order.
    """
    done = []
    for sub in gm.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        fake = _fake_mode(graph)
        forwards = [n for n in graph.nodes if n.op == "call_function" and n.target in _STOCK]
        backwards = [n for n in graph.nodes if n.op == "call_function" and n.target is _BACKWARD]
        # the backward nodes first: they look their forward node up by its stock op
        plans = [
            (n, n.name, str(n.target), target)
            for n in backwards + forwards
            if names is None or names(n.name)
            if (target := consolidated_target(n)[0]) is not None
        ]
        if not plans:
            continue
        for n, name, before, target in plans:
            if n.target is _BACKWARD:
                continue
            _to_consolidated(graph, n, target, fake, renamed if sub is gm else None)
            done.append((name, before, str(target)))
        for n, name, before, target in plans:
            if n.target is _BACKWARD:
                fwd = _forward_of(n)
                if fwd is None or fwd.target not in _TARGETS:
                    continue
                _backward_to_consolidated(graph, n, fake)
                done.append((name, before, str(target)))
        graph.lint()
        sub.recompile()  # type: ignore[operator]  # nn.Module.__getattr__ -> Tensor | Module
    return done
