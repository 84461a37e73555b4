"""Every patch bnswap applies to torch and torchao, in one place (a backend's own live
in its package, e.g. :mod:`bnswap.ort._compat`). ``import bnswap`` applies none of them: they are
applied once, by :func:`install`, when the process first holds a swapped layer (the
first swap, or a swapped layer unpickled: :func:`bnswap._swap.on_first_swap`) or a bnswap
entry point first meets a program holding the consolidated ops (:func:`install_for`:
``bnswap.convert`` / ``plan`` / ``revert`` of a loaded ``.pt2`` program); a module
not imported by then is patched when it is, by an import hook, so bnswap imports none of
them. Each is version-gated, listed in :data:`PATCHES` (and ``docs/patches.md``), can be
turned off with ``BNSWAP_DISABLE_PATCHES`` (``all`` or names, comma-separated), and
changes nothing for a model that holds no swapped layer. Each is what a consumer that
hands the model to a runtime of its own needs to see stock's BatchNorm (the guide "After
training", docs/after-training.md).

* **TorchScript** (``torch.jit.script``, ``torch.jit.trace``):
  ``torch.jit._recursive.create_script_module`` builds its module from a *stock view* of
  the model: the same Parameter and buffer tensors in new
  module objects of the same classes, without bnswap's mark (the class's own forward
  set on views of layers whose class holds bnswap's dispatcher), internal buffers
  and internal hooks (a backend's, ``bnswap._swap.add_internal_buffer`` /
  ``INTERNAL_HOOK``), and with each backend wrapper replaced by the model it wraps. The
  class's ``forward`` (``aten::batch_norm``, whose kernel TorchScript's runtime picks) is
  compiled, and the user's model is never touched, not even briefly. Gate: the function
  exists with torch's signature (tested on torch 2.4.1, 2.9.1, 2.13, 2.14, 2.15.0).
* **torch.compile** (``dynamo``): dynamo's trace rules treat the dispatcher's file
  (:mod:`bnswap._swap`) as torch.nn's: traced where traced code calls it, skipped as a
  frame of its own (:func:`patch_dynamo_trace_rules`), so a model bnswap never touched
  compiles the same frames and graphs as without bnswap. Gate: ``trace_rules.add`` and
  ``BUILTIN_INLINE_WHEN_CALLED`` exist (tested on torch 2.13, 2.14).
* **inductor's eval conv-BN pass** (``inductor``): a pattern for
  ``torch.batch_norm`` (what a swapped eval layer's dynamo graph holds, where stock's
  holds ``F.batch_norm``) in ``efficient_conv_bn_eval_pass``, so the opt-in pass
  folds swapped eval layers as it folds stock's (:func:`patch_inductor_conv_bn_eval`).
  Gate: torch's ``efficient_conv_bn_eval_decomposed`` and the pass exist (torch 2.13,
  2.14).
* **torch.onnx, dynamo exporter**, given an exported program:
  ``torch.onnx._internal.exporter._fx_passes.decompose_with_registry`` decomposes it
  (into a new program, as before) keeping the consolidated ops, then rewrites them into
  stock's core ATen ops (:func:`bnswap.to_stock_ops` with ``core_aten=True``), so ONNX
  translates (and folds into Conv) what it translates for stock; without it they were
  decomposed into Sub / Mul / Add, and track_running_stats=False layers lost their batch
  statistics. Gate: that function and its ``_decomp`` helpers exist (tested on torch
  2.9.1, 2.13, 2.14, 2.15.0; torch 2.4 has no such module: nothing is patched there).
* **torchao pt2e** (``prepare_pt2e`` / ``prepare_qat_pt2e``,
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
* **DDP on the CPU**: ``DistributedDataParallel``'s check that refuses CPU modules
  holding a ``SyncBatchNorm`` lets modules through whose SyncBatchNorm layers are all
  swapped (:func:`_patch_ddp_syncbn_check`).
* **Whole-model checkpoints** (``checkpoints``): ``_BatchNorm`` gets a ``__getstate__``
  that leaves the swap entry and internal buffers out of ``torch.save`` / pickle and
  ``copy.copy`` (a checkpoint names nothing of bnswap's and loads as stock's layers,
  where bnswap is not installed too; issue 32), and a ``__deepcopy__`` that keeps them
  (the copy is swapped, bound to itself); a pickle for another process of the job
  (multiprocessing's ``ForkingPickler``) keeps them too (:func:`_patch_checkpoints`).
* **core ATen** (``ExportedProgram.run_decompositions()`` with the default table):
  ``torch._decomp._core_aten_decompositions_post_autograd`` (the list the default table
  starts from) also decomposes the consolidated ops into stock's core ATen batch-norm
  ops (:func:`patch_core_aten_decompositions`), so a bnswap program reaches core ATen
  (ExecuTorch's ``to_edge``) as stock's does. Applied by :func:`install` with the others
  (the first swap, or ``bnswap.convert(program)``). Gate: ``CustomDecompTable`` builds its
  table with that function (torch 2.13 / 2.14).

"""

from __future__ import annotations

import collections
import copy
import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.utils import parametrize

from bnswap import _swap as _swap_module
from bnswap._graph import CONSOLIDATED_TARGETS, to_stock_ops
from bnswap._swap import (
    INTERNAL_BUFFER_PREFIX,
    INTERNAL_HOOK,
    SWAP,
    class_forward,
    dispatches,
    internal_buffer_names,
    is_swapped,
    on_first_swap,
    wrapped_model,
)
from bnswap._warn import warn

__all__ = [
    "CORE_ATEN_DECOMPOSITIONS",
    "DISABLE_ENV",
    "MIN_TORCHAO",
    "PATCHES",
    "Patch",
    "applied",
    "holds_consolidated",
    "install",
    "install_for",
    "patch_core_aten_decompositions",
    "stock_view",
]

logger = logging.getLogger("bnswap")

MIN_TORCHAO = (0, 18)
_PATCHED = "_bnswap_patched"
_lock = threading.RLock()  # install() holds it while a patch below takes it
_installed = False
_aten = torch.ops.aten


def _mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _PATCHED, True)
    return fn


def _patched(fn: object) -> bool:
    return bool(getattr(fn, _PATCHED, False))


# ------------------------------------------------------------------------ TorchScript
def stock_view(module: nn.Module, memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """``module`` as stock sees it, for TorchScript: new module objects (``copy.copy``, the
    same classes) sharing every Parameter and buffer tensor, without bnswap's forward
    entry, internal buffers (:func:`bnswap._swap.add_internal_buffer`) and internal
    forward pre-hooks (:data:`bnswap._swap.INTERNAL_HOOK`); a backend wrapper (e.g. the
    ORT backend's) becomes the view of the model it wraps. A module with nothing of
    bnswap's in its tree is returned itself."""
    memo = {} if memo is None else memo
    key = id(module)
    if key in memo:
        return memo[key]
    inner = wrapped_model(module)
    if inner is not None:
        memo[key] = view = stock_view(inner, memo)
        return view
    if isinstance(module, torch.jit.ScriptModule):
        return module
    children = {
        k: (stock_view(v, memo) if v is not None else None) for k, v in module._modules.items()
    }
    hooks = [k for k, h in module._forward_pre_hooks.items() if getattr(h, INTERNAL_HOOK, False)]
    internal = internal_buffer_names(module)
    dispatched = dispatches(type(module))
    own = SWAP in module.__dict__ or dispatched or bool(hooks) or bool(internal)
    if not own and all(children[k] is module._modules[k] for k in children):
        memo[key] = module
        return module
    # not copy.copy: a parametrized module's __getstate__ refuses (torch's parametrize)
    view = object.__new__(type(module))
    view.__dict__.update(module.__dict__)
    memo[key] = view
    d = view.__dict__
    d.pop(SWAP, None)
    if dispatched and "forward" not in d:
        # the class's own forward, which TorchScript compiles (not bnswap's dispatcher,
        # which its class holds in this process: a Python function it cannot compile)
        d["forward"] = types.MethodType(class_forward(type(module)), view)
    if internal:
        d["_buffers"] = {k: v for k, v in module._buffers.items() if k not in internal}
        d["_non_persistent_buffers_set"] = module._non_persistent_buffers_set - set(internal)
    if hooks:  # TorchScript would compile them (and cannot: not functions)
        d["_forward_pre_hooks"] = collections.OrderedDict(  # torch's own type
            (k, h) for k, h in module._forward_pre_hooks.items() if k not in hooks
        )
    d["_modules"] = children
    return view


def _patch_torchscript() -> bool:
    rec = getattr(torch.jit, "_recursive", None)
    original = getattr(rec, "create_script_module", None)
    if original is None or _patched(original):
        return original is not None
    if list(inspect.signature(original).parameters)[:2] != ["nn_module", "stubs_fn"]:
        logger.debug(
            "bnswap: torch.jit._recursive.create_script_module has an unknown "
            "signature; torch.jit.script of swapped layers is not supported here"
        )
        return False

    @functools.wraps(original)
    def create_script_module(nn_module: Any, stubs_fn: Any, *args: Any, **kwargs: Any) -> Any:
        # torch.jit.script and torch.jit.trace (which builds its module here, then
        # records the original's forward: swapped layers record stock's op then)
        if isinstance(nn_module, nn.Module):
            nn_module = stock_view(nn_module)
        return original(nn_module, stubs_fn, *args, **kwargs)

    assert rec is not None  # it holds original
    rec.create_script_module = _mark(create_script_module)
    return True


# ------------------------------------------------------------------ torch.compile (dynamo)
def patch_dynamo_trace_rules(mod: Any) -> bool:
    """Tell dynamo to treat the file of bnswap's dispatcher (:mod:`bnswap._swap`) as it
    treats torch.nn's: skipped where a frame of its own starts there, traced where traced
    code calls it. Stock's ``_BatchNorm.forward`` is never a compiled frame of its own
    (``nn.BatchNorm2d(4).compile()`` and ``nn.Sequential(...).compile()`` of torch's
    modules run eagerly), so the dispatcher that now stands in every BatchNorm class's
    ``forward`` must not be one either: a model bnswap never touched compiles the same
    frames, graphs and bits as in a process without bnswap. Inlined from a user's
    ``forward``, it is traced as before (a swapped layer's graph holds the consolidated
    ops). Two of dynamo's lists: ``SKIP_DIRS`` (through ``trace_rules.add``) and
    ``BUILTIN_INLINE_WHEN_CALLED`` (read for inlined calls before ``SKIP_DIRS``)."""
    add = getattr(mod, "add", None)
    inline_when_called = getattr(mod, "BUILTIN_INLINE_WHEN_CALLED", None)
    skip_dirs = getattr(mod, "SKIP_DIRS", None)
    if (
        not callable(add)
        or not isinstance(inline_when_called, set)
        or not isinstance(skip_dirs, list)
    ):
        logger.debug("bnswap: torch._dynamo.trace_rules lacks add / BUILTIN_INLINE_WHEN_CALLED")
        return False
    path = _dispatcher_file()
    if path in inline_when_called:
        return True
    inline_when_called.add(path)  # first: a traced caller must never see it skipped
    add(_swap_module.__name__)
    return True


def _dispatcher_file() -> str:
    """The dispatcher's source file as dynamo spells paths (posix, absolute)."""
    return os.path.abspath(_swap_module.__file__ or "").replace(os.sep, "/")


#: The convolutions torch's own eval conv-BN pass folds into, by their ``torch`` names
#: (its list for traced graphs; with ``torch._C._nn.linear``).
_FOLDED_INPUTS = (
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
)


def patch_inductor_conv_bn_eval(mod: Any) -> bool:
    """Let inductor's opt-in eval conv-BN pass
    (``torch._inductor.config.efficient_conv_bn_eval_fx_passes``) fold swapped layers:
    it matches ``F.batch_norm`` / ``aten.batch_norm`` / BatchNorm modules, and a swapped
    eval layer's traced graph holds ``torch.batch_norm``, the function stock's
    ``F.batch_norm`` ends in (swapped layers never call ``F.batch_norm``: a user's patch
    of it reaches stock layers only). A pattern of the same pass for that function hands
    the same arguments to torch's own ``efficient_conv_bn_eval_decomposed``: the same
    graph, memory and outputs as stock's layer in that pass."""
    decomposed = getattr(mod, "efficient_conv_bn_eval_decomposed", None)
    pass_dict = getattr(mod, "efficient_conv_bn_eval_pass", None)
    pm = sys.modules.get("torch._inductor.pattern_matcher")
    if decomposed is None or pass_dict is None or pm is None:
        return False
    if getattr(mod, _PATCHED, False):
        return True
    params = list(inspect.signature(decomposed).parameters)
    if params[:5] != ["bn_weight", "bn_bias", "bn_running_mean", "bn_running_var", "bn_eps"]:
        return False
    config = sys.modules["torch._inductor.config"]
    op = torch.batch_norm
    inputs = (torch._C._nn.linear, *(getattr(torch, n) for n in _FOLDED_INPUTS))

    def enabled(match: Any) -> bool:
        return bool(not config.freezing and config.efficient_conv_bn_eval_fx_passes)

    def fold(match: Any, *args: Any, **kwargs: Any) -> None:
        bn = match.nodes[0]
        graph = match.graph
        # torch.batch_norm(input, weight, bias, running_mean, running_var, training,
        # momentum, eps, cudnn_enabled), as module_batch_norm calls it; evaluation only
        if len(bn.args) != 9 or bn.kwargs or bn.args[5] is not False:
            return
        conv = bn.args[0]
        if not isinstance(conv, torch.fx.Node) or conv.op != "call_function":
            return
        if not any(conv.target is f for f in inputs) or len(conv.users) > 1:
            return
        if len(conv.args) < 2:
            return
        counters = sys.modules["torch._dynamo.utils"].counters
        counters["inductor"]["efficient_conv_bn_eval"] += 1
        _, weight, bias, running_mean, running_var, _training, _momentum, eps, _ = bn.args
        with graph.inserting_before(bn):
            new = graph.create_node(
                op="call_function",
                target=decomposed,
                args=(
                    weight,
                    bias,
                    running_mean,
                    running_var,
                    eps,
                    conv.target,
                    conv.args[1],
                    conv.args[2] if len(conv.args) >= 3 else None,
                    conv.args[0],
                    conv.args[3:],
                ),
                name="efficient_conv_bn_eval",
            )
        bn.replace_all_uses_with(new)
        graph.erase_node(bn)
        graph.erase_node(conv)

    pm.register_graph_pattern(pm.CallFunctionVarArgs(op), pass_dict=pass_dict, extra_check=enabled)(
        fold
    )
    setattr(mod, _PATCHED, True)
    return True


# ---------------------------------------------------------------- torch.onnx (dynamo)
def _has_bnswap_nodes(ep: torch.export.ExportedProgram) -> bool:
    return any(
        n.op == "call_function"
        and n.target in (_aten._batch_norm_with_update.default, _aten._batch_norm_no_update.default)
        for n in ep.graph.nodes
    )


def patch_onnx_exporter(mod: Any) -> bool:
    """Make torch.onnx's dynamo exporter see stock's core ATen ops in an exported
    program: it decomposes the program (into a new one) keeping bnswap's ops, then
    rewrites those with :func:`bnswap.to_stock_ops` (``core_aten=True``); the user's
    program is not changed."""
    original = getattr(mod, "decompose_with_registry", None)
    decomp = getattr(mod, "_decomp", None)
    if original is None or decomp is None or _patched(original):
        return original is not None

    @functools.wraps(original)
    def decompose_with_registry(exported_program: Any, registry: Any) -> Any:
        if not _has_bnswap_nodes(exported_program):
            return original(exported_program, registry)
        ops = set(decomp.get_onnx_implemented_overloads(registry))
        table = decomp.create_onnx_friendly_decomposition_table(ops)
        for op in (
            _aten._batch_norm_with_update_functional.default,
            _aten._batch_norm_no_update.default,
        ):
            table.pop(op, None)  # kept for the rewrite below (ONNX decomposed them)
        decomposed = exported_program.run_decompositions(table)
        to_stock_ops(decomposed, core_aten=True)
        return decomposed

    mod.decompose_with_registry = _mark(decompose_with_registry)
    return True


# ------------------------------------------------------------------------------ torchao
def _version(mod_name: str) -> tuple[int, ...]:
    raw = str(getattr(sys.modules.get(mod_name), "__version__", "0"))
    parts = []
    for p in raw.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


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

    return _mark(patched)


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
    if _version("torchao") < MIN_TORCHAO:
        _unpatched(
            "torchao "
            + ".".join(map(str, _version("torchao")))
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
    if all(_patched(getattr(mod, name, None)) for name in helpers):
        return True
    if _torchao_too_old():
        return False
    for name, callers in helpers.items():
        if not _calls(mod, name, callers):
            verb = "calls" if len(callers) == 1 else "call"
            _unpatched(f"torchao's {mod.__name__}.{' / '.join(callers)} no longer {verb} {name}")
            return False
    for name in helpers:
        if not _patched(getattr(mod, name)):
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


# ---------------------------------------------------------------------- core ATen
def _with_update_functional(
    input: torch.Tensor,
    weight: Any,
    bias: Any,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    eps: float,
) -> tuple[Any, ...]:
    out, save_mean, save_rstd, new_mean, new_var = (
        _aten._native_batch_norm_legit_functional.default(
            input, weight, bias, running_mean, running_var, True, momentum, eps
        )
    )
    reserve = torch.empty(0, dtype=torch.uint8, device=input.device)  # cuDNN's only
    return out, save_mean, save_rstd, reserve, new_mean, new_var


def _no_update(
    input: torch.Tensor,
    weight: Any,
    bias: Any,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    eps: float,
) -> tuple[Any, ...]:
    out, save_mean, save_rstd = _aten._native_batch_norm_legit_no_training.default(
        input, weight, bias, running_mean, running_var, momentum, eps
    )
    return out, save_mean, save_rstd, torch.empty(0, dtype=torch.uint8, device=input.device)


def _backward(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    weight: Any,
    running_mean: Any,
    running_var: Any,
    save_mean: Any,
    save_var: Any,
    update: bool,
    eps: float,
    output_mask: list[bool],
    reserve: torch.Tensor,
) -> tuple[Any, ...]:
    # (native_batch_norm_backward is in the core table: it decomposes on, as stock's)
    grads: tuple[Any, ...] = _aten.native_batch_norm_backward.default(
        grad_out,
        input,
        weight,
        running_mean,
        running_var,
        save_mean,
        save_var,
        update,
        eps,
        output_mask,
    )
    return grads


#: What bnswap adds to the core ATen decomposition table: each consolidated op as the
#: stock core ATen op with the same schema arguments (pytorch PR 116092 made the
#: consolidated ops from these; their CPU kernels are the same functions).
CORE_ATEN_DECOMPOSITIONS: dict[Any, Callable[..., tuple[Any, ...]]] = {
    _aten._batch_norm_with_update_functional.default: _with_update_functional,
    _aten._batch_norm_no_update.default: _no_update,
    _aten.batch_norm_backward.default: _backward,
}


def patch_core_aten_decompositions() -> bool:
    """Let ``ExportedProgram.run_decompositions()`` (the default, core ATen table) turn
    the consolidated ops into stock's core ATen ops: ``_batch_norm_with_update_functional``
    -> ``_native_batch_norm_legit_functional``, ``_batch_norm_no_update`` ->
    ``_native_batch_norm_legit_no_training``, ``batch_norm_backward`` ->
    ``native_batch_norm_backward`` (:data:`CORE_ATEN_DECOMPOSITIONS`).

    torch lists the ops it decomposes for core ATen in
    ``torch._decomp._core_aten_decompositions_post_autograd`` (a fixed list;
    ``torch.export.default_decompositions()`` and ``core_aten_decompositions()`` start
    from it); the consolidated ops are not core ATen and not on it, so they were kept.
    This wraps that function to add them (torch's own entry wins if it ever has one).
    Inductor is unaffected: its table takes its own decompositions of these ops over the
    core table's. Applied by :func:`install` (the first swap, or
    ``bnswap.convert(program)``); idempotent, thread-safe. Gate: the function exists and
    ``torch.export.decomp_utils.CustomDecompTable`` calls it by name (torch 2.13 / 2.14).

    Returns:
        True when applied (now or before), False when the gate fails (logged at DEBUG).
    """
    import torch._decomp as decomp

    original = getattr(decomp, "_core_aten_decompositions_post_autograd", None)
    if original is None:
        return False
    if _patched(original):
        return True
    try:
        from torch.export.decomp_utils import CustomDecompTable
    except ImportError:
        return False
    names = CustomDecompTable.__init__.__code__.co_names
    if "_core_aten_decompositions_post_autograd" not in names:
        logger.debug(
            "bnswap: torch's default decomposition table is not built by "
            "_core_aten_decompositions_post_autograd; core ATen not patched"
        )
        return False

    @functools.wraps(original)
    def _core_aten_decompositions_post_autograd() -> dict[Any, Any]:
        table: dict[Any, Any] = original()
        for op, fn in CORE_ATEN_DECOMPOSITIONS.items():
            table.setdefault(op, fn)
        return table

    with _lock:
        if not _patched(decomp._core_aten_decompositions_post_autograd):
            decomp._core_aten_decompositions_post_autograd = _mark(
                _core_aten_decompositions_post_autograd
            )
    return True


# ------------------------------------------------------------------- DDP on the CPU
def _patch_ddp_syncbn_check() -> bool:
    """Let ``DistributedDataParallel`` wrap a CPU module whose ``SyncBatchNorm`` layers are
    all swapped (:mod:`bnswap.sync` runs them on every device).

    ``DistributedDataParallel.__init__`` refuses any CPU module holding an
    ``nn.SyncBatchNorm`` (``ValueError: SyncBatchNorm layers only work with GPU modules``,
    its ``_passing_sync_batchnorm_handle``) because stock's synchronized kernels are
    CUDA-only. The check still refuses a CPU module with any unswapped ``SyncBatchNorm``,
    with torch's ``ValueError`` and message, followed by the qualified names of those
    layers and the fix (:func:`_unswapped_sync_message`); on other devices it is torch's
    check as it is. Gate: the method exists (torch 2.4 to 2.15)."""
    from torch.nn.parallel import distributed

    ddp = distributed.DistributedDataParallel
    stock = getattr(ddp, "_passing_sync_batchnorm_handle", None)
    if stock is None:
        return False
    if _patched(stock):
        return True

    @functools.wraps(stock)
    def _passing_sync_batchnorm_handle(self: Any, module: nn.Module) -> None:
        left = [
            n
            for n, m in module.named_modules()
            if isinstance(m, nn.SyncBatchNorm) and not is_swapped(m)
        ]
        if not left:
            return
        if getattr(self, "device_type", None) == "cpu" and callable(
            getattr(self, "_log_and_throw", None)
        ):
            self._log_and_throw(ValueError, _unswapped_sync_message(left))
        stock(self, module)

    ddp._passing_sync_batchnorm_handle = _mark(_passing_sync_batchnorm_handle)  # type: ignore[method-assign]  # the patch
    return True


#: How many layer names the DDP error lists before it counts the rest.
_NAMED = 5


def _unswapped_sync_message(names: list[str]) -> str:
    """torch's message (``SyncBatchNorm layers only work with GPU modules``), the layers
    bnswap did not swap by qualified name (the first :data:`_NAMED`, then how many more),
    and how to have them swapped."""
    shown = ", ".join(repr(n or "(root)") for n in names[:_NAMED])
    if len(names) > _NAMED:
        shown += f" and {len(names) - _NAMED} more"
    return (
        "SyncBatchNorm layers only work with GPU modules: "
        f"{len(names)} torch.nn.SyncBatchNorm layer{'s are' if len(names) > 1 else ' is'} "
        f"not swapped by bnswap ({shown}). On the CPU only bnswap's swapped SyncBatchNorm "
        "runs. Fix: bnswap.convert(model) after the sync conversion (torch's and timm's "
        "convert_sync_batchnorm and Trainer(sync_batchnorm=True) make new, unswapped "
        "layers), or bnswap.convert(model, sync_batchnorm=True) in its place, without "
        "excluding them; with Lightning, BNSwap() in the Trainer's callbacks (it handles "
        "Trainer(sync_batchnorm=True)), with no exclude / include pattern leaving them out "
        "(an excluded layer stays torch's SyncBatchNorm, which DDP refuses on the CPU). "
        "bnswap.plan(model) shows each layer"
    )


# ------------------------------------------------------------ whole-model checkpoints
_BN_CLASS = torch.nn.modules.batchnorm._BatchNorm


def _stock_state(state: Any) -> Any:
    """``state`` (a BatchNorm layer's ``__getstate__``) without anything of bnswap's:
    internal buffers and bnswap's own attributes (``_bnswap_*``: the swap's mark,
    :data:`bnswap._swap.SWAP`, the original layer a ``convert(..., sync_batchnorm=True)``
    SyncBatchNorm keeps for ``revert``); a new dict when something is left out."""
    if not isinstance(state, dict):
        return state
    buffers = state.get("_buffers")
    internal = (
        [k for k in buffers if k.startswith(INTERNAL_BUFFER_PREFIX)]
        if isinstance(buffers, dict)
        else []
    )
    own = [k for k in state if isinstance(k, str) and k.startswith(INTERNAL_BUFFER_PREFIX)]
    if not internal and not own:
        return state
    state = {k: v for k, v in state.items() if k not in own}
    if internal:
        assert isinstance(buffers, dict)  # internal names came from it
        state["_buffers"] = type(buffers)((k, v) for k, v in buffers.items() if k not in internal)
        nonpersistent = state.get("_non_persistent_buffers_set")
        if isinstance(nonpersistent, set):
            state["_non_persistent_buffers_set"] = nonpersistent - set(internal)
    return state


def _forking_codes() -> frozenset[types.CodeType]:
    from multiprocessing import reduction

    return frozenset(
        f.__code__
        for f in (reduction.ForkingPickler.dumps.__func__, reduction.dump)  # type: ignore[attr-defined]  # typeshed: dumps is a classmethod
        if hasattr(f, "__code__")
    )


_FORKING_CODES: frozenset[types.CodeType] = frozenset()


def _pickle_keeps_swap() -> bool:
    """Whether the pickle being made keeps bnswap's swap: a deepcopy (``_keep``), or a
    pickle for another process of this job (multiprocessing's ``ForkingPickler``, called
    from these two functions, the pickler itself being C). Called directly by the
    pickling method (``_BatchNorm.__getstate__`` below, ``bnswap._swap.Swap.__reduce__``):
    frame 2 is the one that pickles."""
    return bool(_keep.active) or sys._getframe(2).f_code in _FORKING_CODES


class _Keep(threading.local):
    active = 0


_keep = _Keep()


def _patch_checkpoints() -> bool:
    """``torch.save`` / pickle and ``copy.copy`` of a BatchNorm layer leave bnswap's swap
    out (the layer loads as stock's, where bnswap is not installed too: nothing of
    bnswap's is pickled); ``copy.deepcopy`` keeps it, and so does a
    pickle for another process of the job (multiprocessing's ``ForkingPickler``:
    ``torch.multiprocessing.spawn``'s arguments, its queues)."""
    cls = _BN_CLASS
    prev = getattr(cls, "__getstate__", None)  # nn.Module's (object's on Python 3.11+)
    if prev is not None and _patched(prev):
        return True
    if (
        prev is None
        or "__getstate__" in vars(cls)
        or "__deepcopy__" in vars(cls)
        or hasattr(cls, "__deepcopy__")
        or not hasattr(copy, "_reconstruct")
    ):
        warn(
            "bnswap: this torch's BatchNorm defines its own __getstate__ / __deepcopy__, "
            "so the checkpoints patch is off: torch.save(model) of a converted model "
            "names bnswap (loading it needs bnswap); save model.state_dict(), or "
            "bnswap.revert(model) before torch.save(model)",
            UserWarning,
        )
        return False

    @_mark
    def __getstate__(self: nn.Module) -> Any:
        state = prev(self)
        # deep-copied (__deepcopy__ below), or pickled for another process of this job
        # (mp.spawn, torch.multiprocessing queues): the swap goes along, that process
        # running this environment
        if _pickle_keeps_swap():
            return state
        return _stock_state(state)

    @_mark
    def __deepcopy__(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
        # copy.deepcopy's own procedure for a class without __deepcopy__ (the reduction,
        # then copy._reconstruct), with the swap and internal buffers kept
        if parametrize.is_parametrized(self):
            # torch's parametrized classes refuse __getstate__; torch deep-copies their
            # __dict__ (parametrize's default_deepcopy), the mark with it
            y = type(self).__new__(type(self))
            memo[id(self)] = y
            y.__dict__ = copy.deepcopy(self.__dict__, memo)
            return y
        # the full state, the swap's mark included
        depth = _keep.active
        _keep.active = depth + 1
        try:
            rv = self.__reduce_ex__(4)
        finally:
            _keep.active = depth
        new: nn.Module = copy._reconstruct(self, memo, *rv)  # type: ignore[attr-defined]  # typeshed omits it
        return new

    global _FORKING_CODES
    _FORKING_CODES = _forking_codes()
    _swap_module.pickle_keeps_swap = _pickle_keeps_swap
    cls.__getstate__ = __getstate__  # type: ignore[method-assign]  # the patch
    cls.__deepcopy__ = __deepcopy__  # type: ignore[attr-defined]  # the patch (none before)
    return True


# ---------------------------------------------------------------------- the table
class Patch(NamedTuple):
    """One patch: its ``name`` (for ``BNSWAP_DISABLE_PATCHES``), the ``module`` it
    patches (``None``: torch itself, patched at once), the function that applies it
    (True if applied), the ``target`` it replaces, why, and its version ``gate``."""

    name: str
    module: str | None
    apply: Callable[..., bool]
    target: str
    why: str
    gate: str


#: Every patch, in the order :func:`install` applies them (``docs/patches.md``).
PATCHES: tuple[Patch, ...] = (
    Patch(
        "torchscript",
        None,
        _patch_torchscript,
        "torch.jit._recursive.create_script_module",
        "torch.jit.script / torch.jit.trace compile stock's forward on a stock view of the "
        "model (the user's modules untouched)",
        "the function exists with parameters (nn_module, stubs_fn, ...); tested on torch "
        "2.4.1, 2.9.1, 2.13, 2.14, 2.15.0",
    ),
    Patch(
        "dynamo",
        "torch._dynamo.trace_rules",
        patch_dynamo_trace_rules,
        "torch._dynamo.trace_rules.SKIP_DIRS / BUILTIN_INLINE_WHEN_CALLED (bnswap/_swap.py added)",
        "torch.compile treats bnswap's dispatcher (every BatchNorm class's forward from the "
        "first swap on) as torch.nn's own code: traced where a traced forward calls it, never "
        "a compiled frame of its own, so models bnswap never touched compile as without it",
        "trace_rules.add and the set BUILTIN_INLINE_WHEN_CALLED exist; tested on torch 2.13 / 2.14",
    ),
    Patch(
        "inductor",
        "torch._inductor.fx_passes.efficient_conv_bn_eval",
        patch_inductor_conv_bn_eval,
        "torch._inductor.fx_passes.pre_grad.efficient_conv_bn_eval_pass (a pattern added)",
        "inductor's opt-in eval conv-BN pass (efficient_conv_bn_eval_fx_passes) folds a "
        "swapped eval layer's torch.batch_norm as it folds stock's F.batch_norm",
        "efficient_conv_bn_eval_decomposed(bn_weight, bn_bias, bn_running_mean, "
        "bn_running_var, bn_eps, ...) and the pass exist; tested on torch 2.13 / 2.14",
    ),
    Patch(
        "onnx",
        "torch.onnx._internal.exporter._fx_passes",
        patch_onnx_exporter,
        "torch.onnx._internal.exporter._fx_passes.decompose_with_registry",
        "torch.onnx.export(dynamo=True) translates stock's core ATen batch norm (folded "
        "into Conv; track_running_stats=False keeps batch statistics)",
        "the function and its _decomp helpers exist (absent in torch 2.4); tested on "
        "torch 2.9.1, 2.13, 2.14, 2.15.0",
    ),
    Patch(
        "torchao",
        "torchao.quantization.pt2e.quantize_pt2e",
        patch_torchao_pt2e,
        "torchao.quantization.pt2e.quantize_pt2e._get_node_name_to_scope",
        "prepare_pt2e / prepare_qat_pt2e read a swapped model's graph on stock's "
        "aten.batch_norm (conv-BN fold, quantizer patterns): the prepared graph is stock's; "
        "convert_pt2e too (also wrapped: _convert_to_reference_decomposed_fx), for a "
        "prepared graph the user converted",
        f"torchao >= {'.'.join(map(str, MIN_TORCHAO))}, the helpers called by name",
    ),
    Patch(
        "torchao",
        "torchao.quantization.pt2e.export_utils",
        patch_torchao_export_utils,
        "torchao.quantization.pt2e.export_utils._replace_batchnorm",
        "move_exported_model_to_eval / _train switch a graph that holds the consolidated "
        "ops (a swapped model's exported training graph) as stock's: in evaluation its "
        "running statistics never update",
        f"torchao >= {'.'.join(map(str, MIN_TORCHAO))}, the helper called by name",
    ),
    Patch(
        "ddp",
        None,
        _patch_ddp_syncbn_check,
        "torch.nn.parallel.DistributedDataParallel._passing_sync_batchnorm_handle",
        "DistributedDataParallel wraps a CPU module whose SyncBatchNorm layers are all "
        "swapped (stock refuses any SyncBatchNorm on the CPU: its kernels are CUDA-only)",
        "the method exists; tested on torch 2.13 / 2.14",
    ),
    Patch(
        "checkpoints",
        None,
        _patch_checkpoints,
        "torch.nn.modules.batchnorm._BatchNorm.__getstate__ / __deepcopy__ (added)",
        "torch.save / pickle of a whole model and copy.copy leave the swap out (nothing of "
        "bnswap's in a checkpoint: it loads where bnswap is not installed, as stock's "
        "layers); copy.deepcopy and multiprocessing's pickles (mp.spawn) keep it",
        "_BatchNorm defines neither (inherits nn.Module's __getstate__), copy._reconstruct "
        "exists; tested on torch 2.13 / 2.14",
    ),
    Patch(
        "core_aten",
        None,
        patch_core_aten_decompositions,
        "torch._decomp._core_aten_decompositions_post_autograd",
        "ExportedProgram.run_decompositions() (the default, core ATen table) turns the "
        "consolidated ops into stock's core ATen batch-norm ops (ExecuTorch's to_edge)",
        "the function exists and torch.export.decomp_utils.CustomDecompTable calls it by "
        "name; tested on torch 2.13 / 2.14",
    ),
)

#: Environment variable: ``all``, or patch names (``torchscript``, ``dynamo``,
#: ``inductor``, ``onnx``, ``torchao``, ``ddp``, ``checkpoints``, ``core_aten``),
#: comma-separated, that :func:`install` leaves out.
DISABLE_ENV = "BNSWAP_DISABLE_PATCHES"
_NAMES = {p.name for p in PATCHES}
_applied: set[str] = set()


def _disabled() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    if "all" in names:
        return set(_NAMES)
    unknown = sorted(names - _NAMES)
    if unknown:
        warnings.warn(
            f"bnswap: {DISABLE_ENV} names unknown patches {unknown}; known: 'all', "
            + ", ".join(repr(n) for n in sorted(_NAMES)),
            RuntimeWarning,
            stacklevel=2,
        )
    return names & _NAMES


def applied() -> frozenset[str]:
    """The targets of the patches applied so far in this process (empty until the first
    swapped layer exists; see :data:`PATCHES`)."""
    return frozenset(_applied)


def _apply(p: Patch, mod: Any) -> bool:
    done = p.apply(mod) if p.module is not None else p.apply()
    if done:
        _applied.add(p.target)
    return done


# ----------------------------------------------------------------------- import hook
_PATCHES: dict[str, Callable[[Any], bool]] = {}


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then ``patch`` on the module it loaded."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[Any], object]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for inspect
        return getattr(self._loader, name)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Patches a module right after it is first imported (the module's own code runs
    unchanged; only the finished module object is patched)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install() -> None:
    """Apply the patches of :data:`PATCHES` but those ``BNSWAP_DISABLE_PATCHES`` names
    (idempotent, thread-safe; a no-op after the first call). Called when the process
    first holds a swapped layer, or when a bnswap entry point first meets a program
    holding the consolidated batch-norm ops (:func:`install_for`); never by
    ``import bnswap``."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        off = _disabled()
        for p in PATCHES:
            if p.name in off:
                continue
            if p.module is None:
                _apply(p, None)
            elif p.module in sys.modules:
                _apply(p, sys.modules[p.module])
            else:
                _PATCHES[p.module] = functools.partial(_apply, p)
        if _PATCHES and not any(isinstance(f, _ImportHook) for f in sys.meta_path):
            sys.meta_path.insert(0, _ImportHook())


def holds_consolidated(program: object) -> bool:
    """Whether ``program`` (a ``torch.export.ExportedProgram`` or a ``torch.fx.GraphModule``,
    nested graphs included) has a node on a consolidated batch-norm op
    (:data:`bnswap._graph.CONSOLIDATED_TARGETS`); False for anything else."""
    gm = program.graph_module if isinstance(program, torch.export.ExportedProgram) else program
    if not isinstance(gm, torch.fx.GraphModule):
        return False
    graphs = [
        g
        for g in (getattr(m, "graph", None) for m in gm.modules())
        if isinstance(g, torch.fx.Graph)
    ]
    return any(
        n.op == "call_function" and n.target in CONSOLIDATED_TARGETS
        for g in graphs
        for n in g.nodes
    )


def install_for(program: object) -> None:
    """:func:`install` when ``program`` holds a consolidated batch-norm node
    (:func:`holds_consolidated`). Every bnswap entry point that takes a program calls it
    (``bnswap.convert`` / ``plan`` / ``revert`` of an ``ExportedProgram`` or a
    ``GraphModule``): a program that ``bnswap convert`` wrote, loaded with
    ``torch.export.load``, swaps no layer when it loads, yet torchao's pt2e flow needs the
    patches for it (:func:`patch_torchao_pt2e`); ``bnswap.convert`` of it changes nothing
    in the graph and applies them. A no-op once installed."""
    if not _installed and holds_consolidated(program):
        install()


on_first_swap(install)
