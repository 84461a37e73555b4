"""The ``inductor`` patch (:data:`bnswap._compat.PATCHES`).

**inductor's eval conv-BN pass** (``inductor``): a pattern for
``torch.batch_norm`` (what a swapped eval layer's dynamo graph holds, where stock's
holds ``F.batch_norm``) in ``efficient_conv_bn_eval_pass``, so the opt-in pass
folds swapped eval layers as it folds stock's (:func:`patch_inductor_conv_bn_eval`).
Gate: torch's ``efficient_conv_bn_eval_decomposed`` and the pass exist (torch 2.13,
2.14).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from bnswap._compat._shared import PATCHED

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
    if getattr(mod, PATCHED, False):
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
    setattr(mod, PATCHED, True)
    return True
