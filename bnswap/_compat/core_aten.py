"""The ``core_aten`` patch (:data:`bnswap._compat.PATCHES`).

**core ATen** (``ExportedProgram.run_decompositions()`` with the default table):
``torch._decomp._core_aten_decompositions_post_autograd`` (the list the default table
starts from) also decomposes the consolidated ops into stock's core ATen batch-norm
ops (:func:`patch_core_aten_decompositions`), so a bnswap program reaches core ATen
(ExecuTorch's ``to_edge``) as stock's does. Applied by :func:`bnswap._compat.install`
with the others (the first swap, or ``bnswap.convert(program)``). Gate:
``CustomDecompTable`` builds its table with that function (torch 2.13 / 2.14).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from bnswap._compat._shared import is_patched, lock, logger, mark

_aten = torch.ops.aten


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
    core table's. Applied by :func:`bnswap._compat.install` (the first swap, or
    ``bnswap.convert(program)``); idempotent, thread-safe. Gate: the function exists and
    ``torch.export.decomp_utils.CustomDecompTable`` calls it by name (torch 2.13 / 2.14).

    Returns:
        True when applied (now or before), False when the gate fails (logged at DEBUG).
    """
    import torch._decomp as decomp

    original = getattr(decomp, "_core_aten_decompositions_post_autograd", None)
    if original is None:
        return False
    if is_patched(original):
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

    with lock:
        if not is_patched(decomp._core_aten_decompositions_post_autograd):
            decomp._core_aten_decompositions_post_autograd = mark(
                _core_aten_decompositions_post_autograd
            )
    return True
