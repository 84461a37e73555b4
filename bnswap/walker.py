"""Decide, for every BatchNorm layer of a model, whether bnswap swaps it and why.

Shared by :func:`bnswap.plan` (a dry run) and :func:`bnswap.convert` (which applies it).
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from bnswap import registry
from bnswap._swap import Adapter, adapter_of, type_before_parametrizations

BACKENDS = ("aten", "ort")

Pattern = str | type
Patterns = Pattern | Iterable[Pattern] | None


@dataclass
class Decision:
    """What happens to one BatchNorm layer.

    ``action`` is ``"swap"`` (swapped now, or already swapped) or ``"skip"``;
    ``adapter`` the forward it runs (None when skipped); ``lazy`` True for an
    uninitialized LazyBatchNorm (swapped now; it keeps the swap when it initializes).
    """

    name: str
    module: nn.Module
    source: type
    action: str
    reason: str
    adapter: Adapter | None = None
    lazy: bool = False
    already: bool = False


def check_backend(backend: str) -> None:
    """Raise ValueError naming the choices unless ``backend`` is 'aten' or 'ort'."""
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}"
        )


def check_module(module: object, fn: str) -> None:
    """Raise TypeError unless ``module`` is an ``nn.Module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"bnswap.{fn}() expects a torch.nn.Module, got {type(module).__name__}")


def _patterns(p: Patterns, arg: str) -> list[Pattern]:
    if p is None:
        return []
    items = [p] if isinstance(p, (str, type)) else list(p)
    for item in items:
        if not isinstance(item, (str, type)):
            raise TypeError(
                f"{arg} takes glob patterns (str) on qualified module names and/or classes, "
                f"got {item!r}"
            )
    return items


def _matches(pattern: Pattern, name: str, module: nn.Module) -> bool:
    if isinstance(pattern, type):
        return isinstance(module, pattern)
    return fnmatch.fnmatchcase(name, pattern)


_NONE: tuple = ()


def _display(name: str) -> str:
    return name or "(root)"


def decide(
    model: nn.Module, backend: str = "aten", include: Patterns = None, exclude: Patterns = None
) -> list[Decision]:
    """One :class:`Decision` per ``_BatchNorm`` in ``model.named_modules()`` order.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or a pattern is neither str nor class.
        ValueError: unknown ``backend``.

    Warns:
        UserWarning: for each include/exclude pattern that matches no BatchNorm layer.
    """
    check_backend(backend)
    inc = _patterns(include, "include")
    exc = _patterns(exclude, "exclude")
    used: dict[str, set[int]] = {"include": set(), "exclude": set()}
    out: list[Decision] = []
    for name, m in model.named_modules(remove_duplicate=True):
        if not isinstance(m, _BatchNorm):
            continue
        cls = type_before_parametrizations(m)
        shown = _display(name)
        # (no list per layer without patterns: on 10,000-layer models the garbage
        # collector's passes over the model, not this loop, set convert's time)
        hit_exc = [i for i, p in enumerate(exc) if _matches(p, name, m)] if exc else _NONE
        hit_inc = [i for i, p in enumerate(inc) if _matches(p, name, m)] if inc else _NONE
        if hit_exc:
            used["exclude"].update(hit_exc)
        if hit_inc:
            used["include"].update(hit_inc)
        lazy = isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()
        current = adapter_of(m)
        if current is not None:
            out.append(Decision(shown, m, cls, "swap", "already swapped" + (
                f"; uninitialized {cls.__name__}: keeps the swap when it initializes"
                if lazy else ""), current, lazy=lazy, already=True))
            continue
        if hit_exc:
            p = exc[hit_exc[0]]
            out.append(Decision(shown, m, cls, "skip", f"excluded by {_pattern_str(p)}"))
            continue
        if inc and not hit_inc:
            out.append(Decision(shown, m, cls, "skip", "not matched by include"))
            continue
        if isinstance(m, nn.SyncBatchNorm):
            out.append(Decision(shown, m, cls, "skip",
                                "SyncBatchNorm runs its own cross-process kernel; left as is"))
            continue
        adapter = registry.lookup(cls)
        if adapter is not None:
            reason = (f"uninitialized {cls.__name__}: swapped now, keeps the swap when it "
                      "initializes" if lazy else "")
            out.append(Decision(shown, m, cls, "swap", reason, adapter, lazy=lazy))
        else:
            out.append(Decision(
                shown, m, cls, "skip",
                f"{cls.__name__} overrides forward; swapping would drop it (pytorch issue "
                f"187298); register an adapter: bnswap.register({cls.__name__}, <function>), "
                "see docs/adapters.md"))
    for kind, pats in (("include", inc), ("exclude", exc)):
        for i, p in enumerate(pats):
            if i not in used[kind]:
                warnings.warn(
                    f"bnswap: {kind} pattern {_pattern_str(p)} matches no BatchNorm layer",
                    UserWarning,
                    stacklevel=3,
                )
    return out


def _pattern_str(p: Pattern) -> str:
    return p.__name__ if isinstance(p, type) else repr(p)
