"""The ``onnx`` patch (:data:`bnswap._compat.PATCHES`).

**torch.onnx, dynamo exporter**, given an exported program:
``torch.onnx._internal.exporter._fx_passes.decompose_with_registry`` decomposes it
(into a new program, as before) keeping the consolidated ops, then rewrites them into
stock's core ATen ops (:func:`bnswap.to_stock_ops` with ``core_aten=True``), so ONNX
translates (and folds into Conv) what it translates for stock; without it they were
decomposed into Sub / Mul / Add, and track_running_stats=False layers lost their batch
statistics. Gate: that function and its ``_decomp`` helpers exist (tested on torch
2.9.1, 2.13, 2.14, 2.15.0; torch 2.4 has no such module: nothing is patched there).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from bnswap._compat._shared import is_patched, mark
from bnswap._graph import to_stock_ops

_aten = torch.ops.aten


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
    if original is None or decomp is None or is_patched(original):
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

    mod.decompose_with_registry = mark(decompose_with_registry)
    return True
