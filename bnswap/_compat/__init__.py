"""Every patch bnswap applies to torch and torchao, in one folder (a backend's own live in its
package, e.g. :mod:`bnswap.ort._compat`). ``import bnswap`` applies none of them: they are
applied once, by :func:`install`, when the process first holds a swapped layer (the first
swap, or a swapped layer unpickled: :func:`bnswap._swap.on_first_swap`) or a bnswap entry
point first meets a program holding the consolidated ops
(:func:`bnswap.programs.install_patches_for`: ``bnswap.convert`` / ``plan`` / ``revert`` of
a loaded ``.pt2`` program); a module not imported by then is patched when it is, by an
import hook, so bnswap imports none of them. Each is version-gated, listed in
:data:`PATCHES` (and ``docs/patches.md``), can be turned off with ``BNSWAP_DISABLE_PATCHES``
(``all`` or names, comma-separated), and changes nothing for a model that holds no swapped
layer. Each is what a consumer that hands the model to a runtime of its own needs to see
stock's BatchNorm (the guide "After training", docs/after-training.md).

One module per patch, each with its target, version gate and the function that applies
it: :mod:`~bnswap._compat.torchscript`, :mod:`~bnswap._compat.dynamo`,
:mod:`~bnswap._compat.inductor`, :mod:`~bnswap._compat.onnx`,
:mod:`~bnswap._compat.torchao` (two targets), :mod:`~bnswap._compat.ddp`,
:mod:`~bnswap._compat.checkpoints`, :mod:`~bnswap._compat.core_aten`; the import hook in
:mod:`~bnswap._compat._hooks`, what they share in :mod:`~bnswap._compat._shared`. This
module is the folder's face: the table (:data:`PATCHES`), :func:`install`,
:func:`applied` and ``BNSWAP_DISABLE_PATCHES``.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

from bnswap._compat._hooks import patch_when_imported
from bnswap._compat._shared import lock
from bnswap._compat.checkpoints import patch_checkpoints
from bnswap._compat.core_aten import CORE_ATEN_DECOMPOSITIONS, patch_core_aten_decompositions
from bnswap._compat.ddp import patch_ddp_syncbn_check
from bnswap._compat.dynamo import patch_dynamo_trace_rules
from bnswap._compat.inductor import patch_inductor_conv_bn_eval
from bnswap._compat.onnx import patch_onnx_exporter
from bnswap._compat.torchao import MIN_TORCHAO, patch_torchao_export_utils, patch_torchao_pt2e
from bnswap._compat.torchscript import patch_torchscript, stock_view
from bnswap._swap import on_first_swap

__all__ = [
    "CORE_ATEN_DECOMPOSITIONS",
    "DISABLE_ENV",
    "MIN_TORCHAO",
    "PATCHES",
    "Patch",
    "applied",
    "install",
    "installed",
    "patch_core_aten_decompositions",
    "stock_view",
]

_installed = False


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
        patch_torchscript,
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
        patch_ddp_syncbn_check,
        "torch.nn.parallel.DistributedDataParallel._passing_sync_batchnorm_handle",
        "DistributedDataParallel wraps a CPU module whose SyncBatchNorm layers are all "
        "swapped (stock refuses any SyncBatchNorm on the CPU: its kernels are CUDA-only)",
        "the method exists; tested on torch 2.13 / 2.14",
    ),
    Patch(
        "checkpoints",
        None,
        patch_checkpoints,
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


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed


def install() -> None:
    """Apply the patches of :data:`PATCHES` but those ``BNSWAP_DISABLE_PATCHES`` names
    (idempotent, thread-safe; a no-op after the first call). Called when the process
    first holds a swapped layer, or when a bnswap entry point first meets a program
    holding the consolidated batch-norm ops (:func:`bnswap.programs.install_patches_for`); never by
    ``import bnswap``."""
    global _installed
    with lock:
        if _installed:
            return
        _installed = True
        off = _disabled()
        later: dict[str, Callable[[Any], bool]] = {}
        for p in PATCHES:
            if p.name in off:
                continue
            if p.module is None:
                _apply(p, None)
            elif p.module in sys.modules:
                _apply(p, sys.modules[p.module])
            else:
                later[p.module] = functools.partial(_apply, p)
        patch_when_imported(later)


on_first_swap(install)
