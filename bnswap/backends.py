"""The backends swapped layers run on: one small object per backend, which :func:`bnswap.plan`,
:func:`bnswap.convert` and the Lightning callback ask instead of comparing strings.

A :class:`Backend` says which kernel a plan row shows, whether the backend can synchronize
batch statistics across processes, whether and how a converted model is wrapped (and
unwrapped), and what it checks before anything changes. Two exist:

- ``"aten"``: PyTorch's consolidated batch-norm ops in training
  (``aten._batch_norm_with_update`` / ``batch_norm_backward``, pytorch PR 116092), stock's
  ``aten.batch_norm`` in evaluation; the model runs as it is, on any device; the kernel is
  ``torch._C._select_batch_norm_backend``'s choice per layer, when it runs.
- ``"ort"``: ONNX Runtime training (``com.microsoft::BatchNormInternal``, ORT PR 7539); the
  converted model runs inside an ``ORTModule`` (:func:`bnswap.ort.wrap`). ``bnswap.ort``
  is imported only when a model is wrapped or the backend is checked.

Examples::

    >>> from bnswap.backends import backend_named
    >>> aten, ort = backend_named("aten"), backend_named("ort")
    >>> aten.wraps, aten.synchronizes, aten.kernel is None
    (False, True, True)
    >>> ort.wraps, ort.synchronizes, ort.kernel
    (True, False, 'BatchNormInternal (ORT)')
    >>> backend_named("cudnn")
    Traceback (most recent call last):
    ...
    ValueError: unknown backend 'cudnn'; choose one of 'aten', 'ort'
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TypeVar

from torch import nn

from bnswap._swap import wrapped_model

__all__ = ["BACKENDS", "Backend", "backend_named", "place_children"]

#: A plan row (:class:`bnswap.PlanRow`): its name, action, reason, backend, and whether it
#: synchronizes or waits for a lazy layer to initialize.
Row = TypeVar("Row", bound=Any)


class Backend:
    """What one backend does, asked by name (:func:`backend_named`).

    Attributes:
        name: ``"aten"`` or ``"ort"`` (the ``backend`` argument of :func:`bnswap.convert`).
        kernel: what a swapped plan row's kernel column says for every layer; ``None``
            when torch picks per layer (``torch._C._select_batch_norm_backend``).
        synchronizes: whether ``nn.SyncBatchNorm`` layers can run synchronized on it.
        cannot_sync: the reason a ``SyncBatchNorm`` row is skipped when it cannot.
        wraps: whether a converted model runs inside a wrapper (:meth:`wrap`).
        runs_skipped: whether a model holding a layer bnswap does not swap can run on it
            (aten: the layer runs stock's forward; ORT refuses the model).
        runs_uninitialized: whether a model holding an uninitialized lazy layer can be
            converted (aten: the layer keeps its swap when it initializes; ORT exports the
            model as it is and refuses it).
        runtime: what runs the wrapped model, for messages (``"ONNX Runtime"``).
        skip_note: appended to a skipped row's reason (what a skipped layer means here).
    """

    name = "aten"
    kernel: str | None = None
    synchronizes = True
    cannot_sync = ""
    wraps = False
    runs_skipped = True
    runs_uninitialized = True
    runtime = "PyTorch"
    skip_note = ""

    def check_available(self) -> None:
        """Raise if the backend cannot run in this process (before anything changes)."""

    def sync_error(self, layer: str | None = None) -> Exception:
        """The error for synchronized layers on a backend that cannot synchronize;
        ``layer`` names a SyncBatchNorm layer, None means ``sync_batchnorm=True``."""
        raise AssertionError(f"backend {self.name!r} synchronizes")

    def unsupported_error(self, message: str) -> Exception:
        """The error for a model this backend cannot run as planned."""
        return TypeError(message)

    def refusal(self, blocking: Sequence[str], skipped: bool) -> str:
        """``convert``'s message when this backend refuses a model as planned:
        ``blocking`` names the layers it cannot run, skipped ones (``skipped``) or
        uninitialized lazy ones."""
        fix = (
            "convert them, wrap only submodules without them (BNSwap(backend='ort') "
            "keeps such children eager), or use backend='aten'"
            if skipped
            else "run one forward of the model first (BNSwap(backend='ort') wraps such a "
            "child once it has)"
        )
        what = (
            "a BatchNorm layer that is not a bnswap layer"
            if skipped
            else "an uninitialized lazy layer"
        )
        return (
            f"bnswap.convert: backend={self.name!r} refuses this model: "
            f"{self.runtime} cannot run {what}: {', '.join(blocking)}. To use it, "
            f"{fix}. Nothing was changed; bnswap.plan(model, backend={self.name!r}) "
            "shows every layer."
        )

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` (converted) made to run on this backend: ``model`` itself for aten."""
        return model

    def unwrap(self, wrapper: nn.Module) -> nn.Module:
        """The model inside what :meth:`wrap` returned."""
        return wrapper

    def is_wrapper(self, module: object) -> bool:
        """Whether ``module`` is what :meth:`wrap` returned (not a plain model)."""
        return False

    def model_of(self, module: nn.Module) -> nn.Module:
        """The model a plan of ``module`` lists: ``module`` itself, or the model inside
        ``module`` when it is what this backend's :meth:`wrap` returned.

        Raises:
            ValueError: ``module`` is another backend's wrapper (the aten backend given an
                ONNX Runtime wrapper: the model would keep running ONNX Runtime).

        Examples::

            >>> from torch import nn
            >>> from bnswap.backends import backend_named
            >>> model = nn.Sequential(nn.BatchNorm1d(4))
            >>> backend_named("aten").model_of(model) is model
            True
        """
        inner = wrapped_model(module)
        if inner is None:
            return module
        if not self.is_wrapper(module):
            raise ValueError(
                f"bnswap: backend={self.name!r} given an ONNX Runtime wrapper (what "
                "backend='ort' returned); it would keep running ONNX Runtime. To run the "
                "model on the aten backend, use the model it wraps: model = wrapper.module "
                "(its layers stay swapped unless the wrapper was reverted), or "
                "bnswap.revert(wrapper.module) for stock BatchNorm."
            )
        return inner

    def __repr__(self) -> str:
        return f"<bnswap backend {self.name!r}>"


class _Ort(Backend):
    name = "ort"
    kernel = "BatchNormInternal (ORT)"
    synchronizes = False
    cannot_sync = "ONNX Runtime cannot synchronize batch statistics across processes"
    wraps = True
    runs_skipped = False
    runs_uninitialized = False
    runtime = "ONNX Runtime"
    skip_note = (
        "ORT cannot run an unswapped BatchNorm: bnswap.convert(..., backend='ort') "
        "refuses the model, BNSwap keeps its child eager"
    )

    @staticmethod
    def _ort() -> Any:
        return importlib.import_module("bnswap.ort")  # imports no ONNX Runtime yet

    def check_available(self) -> None:
        """Raises ``bnswap.ort.ORTNotAvailableError`` (an ImportError) on Python 3.12+ or
        without ONNX Runtime training and torch-ort (naming the install command)."""
        ort = self._ort()
        ort.check_python()
        if not ort.is_available():
            raise ort.ORTNotAvailableError(
                "backend='ort' needs ONNX Runtime training and torch-ort: " + ort.INSTALL
            )

    def sync_error(self, layer: str | None = None) -> Exception:
        from bnswap.ort.errors import UnsupportedLayerError  # imports no ONNX Runtime

        what = (
            f"layer {layer!r} is a SyncBatchNorm"
            if layer is not None
            else "sync_batchnorm=True with backend='ort'"
        )
        return UnsupportedLayerError(
            f"bnswap: {what}; the ONNX Runtime backend cannot synchronize batch statistics "
            "across processes (its BatchNormInternal kernel sees one process's batch). Use "
            "backend='aten' (synchronized on every device)"
            + (
                "; or convert with backend='aten' and bnswap.ort.wrap only submodules "
                "without it (BNSwap(backend='ort') keeps such children eager itself)."
                if layer is not None
                else "."
            )
        )

    def unsupported_error(self, message: str) -> Exception:
        from bnswap.ort.errors import UnsupportedLayerError  # imports no ONNX Runtime

        return UnsupportedLayerError(message)

    def wrap(self, model: nn.Module) -> nn.Module:
        wrapper: nn.Module = self._ort().wrap(model)
        return wrapper

    def unwrap(self, wrapper: nn.Module) -> nn.Module:
        model: nn.Module = self._ort().unwrap(wrapper)
        return model

    def is_wrapper(self, module: object) -> bool:
        return wrapped_model(module) is not None


#: The backends by name, in the order error messages list them.
BACKENDS: dict[str, Backend] = {"aten": Backend(), "ort": _Ort()}


def backend_named(backend: str | Backend) -> Backend:
    """The :class:`Backend` called ``backend`` (a Backend is returned as it is).

    Raises:
        ValueError: ``"unknown backend 'cudnn'; choose one of 'aten', 'ort'"``.
    """
    if isinstance(backend, Backend):
        return backend
    found = BACKENDS.get(backend) if isinstance(backend, str) else None
    if found is None:
        raise ValueError(
            f"unknown backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}"
        )
    return found


_EAGER = "eager: its top-level module holds a layer that is not swapped"
_EAGER_SYNC = "eager, synchronized on aten: its top-level module holds a SyncBatchNorm ({})"
_EAGER_LAZY = "eager until a forward initializes its top-level module's lazy layer (then wrapped)"


def place_children(
    rows: list[Row], model: nn.Module, backend: Backend
) -> tuple[list[Row], list[str]]:
    """``wrap="children"``: which direct children of ``model`` get wrapped (each whose
    BatchNorm layers are all swapped and initialized, and synchronize none unless the
    backend can, not wrapped yet), and the rows of swapped layers in the other children,
    which run eager on aten (:attr:`bnswap.PlanRow.placement` says why, and the reason ends
    with it): the rows of a plan with ``wrap="children"``, placed for ``backend``."""
    by_child: dict[str, list[Row]] = {}
    for r in rows:
        by_child.setdefault(r.name.partition(".")[0], []).append(r)
    aten = backend_named("aten")
    placed: dict[int, Row] = {}  # id(row) of the row planned -> the row placed
    to_wrap: list[str] = []
    for key, child in model._modules.items():
        mine = by_child.pop(key, [])
        if not mine:
            continue
        ready = all(r.action != "skip" for r in mine)
        syncs = ready and not backend.synchronizes and any(r.synchronized for r in mine)
        lazy = ready and not syncs and any(r.lazy for r in mine)
        if ready and not syncs and not lazy:
            if not backend.is_wrapper(child):
                to_wrap.append(key)
            continue
        note = _EAGER_SYNC.format(backend.cannot_sync) if syncs else _EAGER_LAZY if lazy else _EAGER
        for r in mine:
            if r.action != "skip":
                placed[id(r)] = replace(
                    r,
                    backend=aten.name,
                    placement=note,
                    reason=(r.reason + "; " if r.reason != "-" else "") + note,
                )
    for rest in by_child.values():  # the model itself is a BatchNorm layer: never wrapped
        for r in rest:
            if r.action != "skip":
                placed[id(r)] = replace(r, backend=aten.name)
    return [placed.get(id(r), r) for r in rows], to_wrap
