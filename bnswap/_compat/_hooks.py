"""The import hook of :mod:`bnswap._compat`: a patch whose module is not imported when
:func:`bnswap._compat.install` runs (torch.onnx's exporter, torchao, dynamo's trace
rules, inductor's conv-BN pass) is applied right after that module is first imported,
so bnswap imports none of them itself. The module's own code runs unchanged; only the
finished module object is patched."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Mapping
from typing import Any

#: module name -> the patch to apply to it when it is imported
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


def patch_when_imported(patches: Mapping[str, Callable[[Any], bool]]) -> None:
    """Apply each of ``patches`` (module name -> patch) to its module right after that
    module is first imported: the hook goes first on ``sys.meta_path`` (once per process)."""
    _PATCHES.update(patches)
    if _PATCHES and not any(isinstance(f, _ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook())
