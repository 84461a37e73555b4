"""torchao pt2e helpers the QAT tests share, in pytest and in their fresh interpreters
(``tests/qat_doors.py``). Imports torch and torchao only, never bnswap: the stock
reference of ``tests/qat_doors.py`` runs where bnswap is not imported.

torchao's pt2e exports the same pattern functions on every call (convert_pt2e's conv-BN
fold exports 96 of them: 17 s per call on 2 cores): :func:`memoize_patterns` memoizes
``_get_aten_graph_module_for_pattern`` by the pattern's code, closure values and the
example inputs' shapes, returning a deep copy of the exported pattern each time, so
every call sees the graph a fresh export gives.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

WITH_UPDATE = "aten._batch_norm_with_update.default"
NO_UPDATE = "aten._batch_norm_no_update.default"
STOCK = "aten.batch_norm.default"


def _key(obj: object, values: bool = False) -> object:
    """A hashable key of a pattern export's arguments (tensors by shape and dtype; by
    value too inside a closure, where they may become constants)."""
    if isinstance(obj, torch.Tensor):
        return (
            "T",
            tuple(obj.shape),
            obj.dtype,
            obj.device.type,
            tuple(obj.flatten().tolist()) if values else None,
        )
    if isinstance(obj, (tuple, list)):
        return tuple(_key(o, values) for o in obj)
    if isinstance(obj, dict):
        return tuple(sorted((k, _key(v, values)) for k, v in obj.items()))
    if isinstance(obj, nn.Module) and callable(getattr(obj, "fn", None)):
        return ("M", type(obj), _key(obj.fn, values))
    if inspect.isfunction(obj):
        return (
            "F",
            obj.__code__,
            tuple(_key(c.cell_contents, True) for c in obj.__closure__ or ()),
        )
    hash(obj)
    return obj


@contextlib.contextmanager
def memoize_patterns() -> Iterator[None]:
    """Within the block, torchao's pattern exports are memoized (see the module
    docstring); torchao's functions are put back after."""
    from torchao.quantization.pt2e import qat_utils, utils

    real = utils._get_aten_graph_module_for_pattern
    cache: dict = {}

    def memoized(pattern: Any, example_inputs: Any, is_cuda: bool = False, **kwargs: Any) -> Any:
        try:
            key = _key((pattern, example_inputs, is_cuda, kwargs))
        except TypeError:  # unhashable: not memoized
            return real(pattern, example_inputs, is_cuda, **kwargs)
        if key not in cache:
            cache[key] = real(pattern, example_inputs, is_cuda, **kwargs)
        return copy.deepcopy(cache[key])

    saved = (utils._get_aten_graph_module_for_pattern, qat_utils._get_aten_graph_module_for_pattern)
    utils._get_aten_graph_module_for_pattern = memoized
    qat_utils._get_aten_graph_module_for_pattern = memoized
    try:
        yield
    finally:
        utils._get_aten_graph_module_for_pattern, qat_utils._get_aten_graph_module_for_pattern = (
            saved
        )


def xnnpack(qat: bool = True) -> Any:
    from torchao.testing.pt2e._xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "XNNPACKQuantizer is deprecated!" (torchao 0.18)
        return XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_qat=qat))


def x86(qat: bool = True) -> Any:
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    return X86InductorQuantizer().set_global(
        get_default_x86_inductor_quantization_config(is_qat=qat)
    )


QUANTIZERS = {"xnnpack": xnnpack, "x86": x86}


def visible_bn(bn: nn.Module) -> nn.Module:
    """``bn`` with statistics and affine parameters that make a fold visible (in place)."""
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-0.3, 0.3)
        bn.running_var.uniform_(0.5, 2.0)
    return bn


def bn_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and "batch_norm" in str(n.target)
    ]


def graph_of(gm: torch.fx.GraphModule) -> list[tuple]:
    """The graph node for node, nodes named by position (a rewrite renames them)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def arg(a: Any) -> str:
        return f"%{index[a]}" if isinstance(a, torch.fx.Node) else repr(a)

    return [
        (
            n.op,
            str(n.target),
            tuple(torch.fx.node.map_aggregate(n.args, arg)),
            tuple(
                sorted((k, str(torch.fx.node.map_aggregate(v, arg))) for k, v in n.kwargs.items())
            ),
        )
        for n in gm.graph.nodes
    ]


def train(p: torch.fx.GraphModule, xs: list[torch.Tensor]) -> torch.Tensor:
    """SGD steps (momentum 0.9) on the mean square of the output; the last output."""
    opt = torch.optim.SGD(p.parameters(), lr=0.05, momentum=0.9)
    for x in xs:
        opt.zero_grad()
        y = p(x)
        y.square().mean().backward()
        opt.step()
    return y.detach()
