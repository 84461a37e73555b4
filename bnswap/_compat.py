"""Every patch bnswap applies to torch and torchao, in one place (the ONNX Runtime ones
live in :mod:`bnswap.ort._compat`). Each is version-gated, applied once by
:func:`install` (at ``import bnswap``), and changes nothing for a model that holds no
swapped layer.

* **TorchScript** (``torch.jit.script``). TorchScript compiles ``module.forward``, and on
  a swapped layer that is bnswap's Python forward (an instance attribute,
  :mod:`bnswap._swap`), which it cannot compile. The patched
  ``torch.jit._recursive.infer_methods_to_compile`` (the function ``torch.jit.script``
  asks which methods to compile) hides that attribute while it reads the module, so the
  class's own ``forward`` is compiled: a scripted swapped model is stock's scripted
  model (``aten::batch_norm``, whose kernel TorchScript's runtime picks), and the user's
  model is back as it was before ``torch.jit.script`` returns. Gate: the function exists
  with torch's one-argument signature (torch 2.4 - 2.14 tested 2.13 / 2.14).
* **torchao pt2e** (``prepare_pt2e`` / ``prepare_qat_pt2e``). Its conv-BN fold and the
  quantizers' conv-BN patterns look for stock's ``aten.batch_norm``; the graph of a
  swapped model carries the consolidated ops, so they silently matched nothing. The first
  helper both functions call, ``torchao.quantization.pt2e.quantize_pt2e.
  _get_node_name_to_scope(model)``, now runs :func:`bnswap.to_stock_ops` on the model
  first, so every later step sees stock's graph. Patched when that module is imported
  (an import hook; at once if it already is). Gate: torchao >= 0.18 (tested 0.18.0) and
  both functions calling that helper by name.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from bnswap._swap import SwappedForward

__all__ = ["install", "TORCHAO_PT2E", "MIN_TORCHAO"]

logger = logging.getLogger("bnswap")

TORCHAO_PT2E = "torchao.quantization.pt2e.quantize_pt2e"
MIN_TORCHAO = (0, 18)
_PATCHED = "_bnswap_patched"
_lock = threading.Lock()
_installed = False


# ------------------------------------------------------------------------ TorchScript
def _patch_torchscript() -> bool:
    rec = getattr(torch.jit, "_recursive", None)
    original = getattr(rec, "infer_methods_to_compile", None)
    if original is None or getattr(original, _PATCHED, False):
        return original is not None
    if list(inspect.signature(original).parameters) != ["nn_module"]:
        logger.debug("bnswap: torch.jit._recursive.infer_methods_to_compile has an unknown "
                     "signature; torch.jit.script of swapped layers is not supported here")
        return False

    @functools.wraps(original)
    def infer_methods_to_compile(nn_module: torch.nn.Module) -> Any:
        d = nn_module.__dict__
        fwd = d.get("forward")
        if type(fwd) is not SwappedForward:
            return original(nn_module)
        del d["forward"]  # the class's forward is what TorchScript compiles
        try:
            return original(nn_module)
        finally:
            d["forward"] = fwd

    setattr(infer_methods_to_compile, _PATCHED, True)
    rec.infer_methods_to_compile = infer_methods_to_compile
    return True


# ------------------------------------------------------------------------------ torchao
def _version(mod_name: str) -> tuple[int, ...]:
    raw = str(getattr(sys.modules.get(mod_name), "__version__", "0"))
    parts = []
    for p in raw.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def patch_torchao_pt2e(mod: Any) -> bool:
    """Make ``mod`` (torchao's ``quantize_pt2e`` module) rewrite swapped layers' nodes to
    stock's before its prepare functions look at a graph; False if not applicable."""
    helper = getattr(mod, "_get_node_name_to_scope", None)
    if helper is None or getattr(helper, _PATCHED, False):
        return helper is not None
    if _version("torchao") < MIN_TORCHAO:
        logger.debug("bnswap: torchao %s is older than tested; pt2e rewrite not applied",
                     _version("torchao"))
        return False
    for name in ("prepare_pt2e", "prepare_qat_pt2e"):
        fn = getattr(mod, name, None)
        if fn is None or "_get_node_name_to_scope" not in fn.__code__.co_names:
            logger.debug("bnswap: torchao's %s does not call _get_node_name_to_scope; "
                         "pt2e rewrite not applied", name)
            return False
    from bnswap._graph import to_stock_ops

    @functools.wraps(helper)
    def _get_node_name_to_scope(model: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(model, torch.fx.GraphModule):
            to_stock_ops(model)
        return helper(model, *args, **kwargs)

    setattr(_get_node_name_to_scope, _PATCHED, True)
    mod._get_node_name_to_scope = _get_node_name_to_scope
    return True


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

    def __init__(self, patches: dict[str, Callable[[Any], object]]) -> None:
        self._patches = patches

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = self._patches.get(fullname)
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


def _hook_torchao() -> None:
    loaded = sys.modules.get(TORCHAO_PT2E)
    if loaded is not None:
        patch_torchao_pt2e(loaded)
        return
    if not any(isinstance(f, _ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook({TORCHAO_PT2E: patch_torchao_pt2e}))


def install() -> None:
    """Apply the patches above (idempotent, thread-safe; a no-op after the first call)."""
    global _installed
    with _lock:
        if _installed:
            return
        _patch_torchscript()
        _hook_torchao()
        _installed = True
