"""The two ``torchao`` patches (:data:`bnswap._compat.PATCHES`).

**torchao pt2e** (``prepare_pt2e`` / ``prepare_qat_pt2e``,
``move_exported_model_to_eval`` / ``_train``, ``convert_pt2e``): their conv-BN fold,
the quantizers' conv-BN patterns and the train / eval switch look for stock's
``aten.batch_norm``, and a swapped model's exported training graph holds
``_batch_norm_with_update``: they matched nothing, silently (no fold; a switch to eval
that left the running statistics updating). The helper each calls first by its
module-global name (``quantize_pt2e._get_node_name_to_scope`` and
``_convert_to_reference_decomposed_fx``, ``export_utils._replace_batchnorm``) now
rewrites the graph's consolidated nodes into stock's (:func:`bnswap.to_stock_ops`, in
place; a graph without them is left as it is), however the user imported the public
function: torchao reads stock's graph and makes stock's graph of it, prepared,
switched and quantized, and bnswap puts nothing back. (Nothing to put back for a
kernel: ``aten.batch_norm``'s ``cudnn_enabled`` argument is read by no torch release,
``_batch_norm_impl_index`` asks ``torch.backends.cudnn.enabled`` when it runs, so
stock's prepared graph picks its kernel, cuDNN on CUDA where torch's rule allows, when
it runs, on the torch releases torchao 0.18 is tested with, 2.13 / 2.14.) The switch's
rewrite is for a graph that was never prepared (an exported training graph moved to
eval); ``convert_pt2e``'s for a prepared graph the user put on the consolidated ops
(``bnswap.convert(prepared)``), whose fold would match nothing in torchao's own
order (a train-mode copy converted). A ``momentum=None`` layer is refused there with a
clear error (stock's graph cannot hold it: ``torch.export`` of a stock one raises;
torchao would drop bnswap's cumulative update). Gate: torchao >= 0.18 (tested 0.18.0)
and the helpers called by name; otherwise nothing in that module is patched and one
warning names the calls that do it by hand.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from bnswap._compat._shared import is_patched, logger, mark, version_of
from bnswap._graph import to_stock_ops
from bnswap._warn import warn

MIN_TORCHAO = (0, 18)
_aten = torch.ops.aten


def _refuse_cumulative(gm: torch.fx.GraphModule) -> None:
    """bnswap's compiled momentum=None update: batch statistics via momentum 1 on
    ``zeros_like`` scratch statistics, then a ``lerp_`` into the running ones."""
    for node in gm.graph.nodes:
        if (
            node.op == "call_function"
            and node.target is _aten._batch_norm_with_update.default
            and node.args[5] == 1.0
            and getattr(node.args[3], "target", None) is _aten.zeros_like.default
        ):
            raise NotImplementedError(
                "bnswap: a BatchNorm layer with momentum=None (a cumulative moving average) "
                "is in this exported graph; torchao's pt2e fold would drop its running-"
                "statistics update, silently (torch.export of a stock one raises instead). "
                "Set a momentum (e.g. 0.1) on the layer before exporting, or "
                "bnswap.revert(model)."
            )


_TORCHAO_OPS = "prepare_pt2e / prepare_qat_pt2e, move_exported_model_to_eval / _train, convert_pt2e"


def _stock_first(helper: Callable[..., Any]) -> Callable[..., Any]:
    """A torchao helper that reads a graph, handed the graph on stock's ops: its
    consolidated batch-norm nodes rewritten into stock's ``aten.batch_norm``, in place
    (:func:`bnswap.to_stock_ops`; a graph without them is left as it is), after a
    ``momentum=None`` layer is refused (:func:`_refuse_cumulative`). torchao then reads
    stock's graph and makes stock's graph of it; bnswap puts nothing back."""

    @functools.wraps(helper)
    def patched(model: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(model, torch.fx.GraphModule):
            _refuse_cumulative(model)
            to_stock_ops(model)
        return helper(model, *args, **kwargs)

    return mark(patched)


_unpatched_warned: set[str] = set()


def _unpatched(why: str) -> None:
    """The one warning of a process whose torchao bnswap does not patch (older than
    :data:`MIN_TORCHAO`, or its helpers moved)."""
    if why in _unpatched_warned:
        return
    _unpatched_warned.add(why)
    warn(
        f"bnswap: {why}; torchao's {_TORCHAO_OPS} are not patched: a swapped model's "
        "exported training graph keeps the consolidated batch-norm ops, which torchao's "
        "conv-BN fold, quantizer patterns and train / eval switch do not match "
        "(silently: no fold, and a switch to eval that leaves the running statistics "
        "updating). By hand: bnswap.to_stock_ops(graph) before each of those calls (the "
        "graph is then stock's); or use torchao " + ".".join(map(str, MIN_TORCHAO)) + " (tested)",
        UserWarning,
    )


def _calls(mod: Any, helper_name: str, callers: tuple[str, ...]) -> bool:
    """Each of ``callers`` (functions of ``mod``) calls ``mod``'s ``helper_name`` by its
    module-global name."""
    if getattr(mod, helper_name, None) is None:
        return False
    for name in callers:
        fn = getattr(mod, name, None)
        code = getattr(fn, "__code__", None)
        if code is None or helper_name not in code.co_names:
            logger.debug("bnswap: torchao's %s does not call %s", name, helper_name)
            return False
    return True


def _torchao_too_old() -> bool:
    if version_of("torchao") < MIN_TORCHAO:
        _unpatched(
            "torchao "
            + ".".join(map(str, version_of("torchao")))
            + " is older than "
            + ".".join(map(str, MIN_TORCHAO))
        )
        return True
    return False


def _stock_first_in(mod: Any, helpers: dict[str, tuple[str, ...]]) -> bool:
    """Wrap each of ``mod``'s ``helpers`` (name -> the public functions that call it) in
    :func:`_stock_first`: all of them, or none (torchao older than :data:`MIN_TORCHAO`, or
    a caller that no longer calls its helper by name: the one warning of
    :func:`_unpatched`). True when they are wrapped (now or before)."""
    if all(is_patched(getattr(mod, name, None)) for name in helpers):
        return True
    if _torchao_too_old():
        return False
    for name, callers in helpers.items():
        if not _calls(mod, name, callers):
            verb = "calls" if len(callers) == 1 else "call"
            _unpatched(f"torchao's {mod.__name__}.{' / '.join(callers)} no longer {verb} {name}")
            return False
    for name in helpers:
        if not is_patched(getattr(mod, name)):
            setattr(mod, name, _stock_first(getattr(mod, name)))
    return True


def patch_torchao_pt2e(mod: Any) -> bool:
    """torchao's ``quantize_pt2e``: ``prepare_pt2e`` / ``prepare_qat_pt2e`` (their first
    helper, ``_get_node_name_to_scope``) and ``convert_pt2e``
    (``_convert_to_reference_decomposed_fx``) read the graph on stock's ops
    (:func:`_stock_first`): the conv-BN fold and the quantizers' patterns match a swapped
    layer's nodes, and the prepared and quantized graphs are stock's. convert_pt2e's for
    a prepared graph that holds the consolidated ops all the same (the user's
    ``bnswap.convert(prepared)``: its fold would match nothing). False: nothing patched
    (torchao too old, or a helper no longer called by name: one warning says so)."""
    return _stock_first_in(
        mod,
        {
            "_get_node_name_to_scope": ("prepare_pt2e", "prepare_qat_pt2e"),
            "_convert_to_reference_decomposed_fx": ("convert_pt2e",),
        },
    )


def patch_torchao_export_utils(mod: Any) -> bool:
    """torchao's ``export_utils``: ``move_exported_model_to_eval`` / ``_train`` switch a
    graph that holds the consolidated ops (a swapped model's exported training graph,
    never prepared; a prepared graph the user converted) as stock's: their
    ``_replace_batchnorm`` reads it on stock's ops (:func:`_stock_first`), so its nodes
    run in evaluation, never updating the running statistics, and the graph is stock's.
    False: nothing patched (as :func:`patch_torchao_pt2e`)."""
    return _stock_first_in(
        mod,
        {"_replace_batchnorm": ("_move_exported_model_to_eval", "_move_exported_model_to_train")},
    )
