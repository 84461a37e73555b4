"""``bnswap.plan``: a dry run of :func:`bnswap.convert`, one row per BatchNorm layer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from bnswap.registry import qualified_name
from bnswap.walker import Decision, Patterns, check_module, decide

__all__ = ["Plan", "PlanRow", "plan", "select_kernel"]

@dataclass(frozen=True)
class PlanRow:
    """One BatchNorm layer: qualified name (``"(root)"`` for the model itself), class,
    action (``"swap"`` / ``"skip"``), reason, backend (``"aten"`` / ``"ort"``), the
    kernel PyTorch or ORT will run it with, and the adapter (the forward it runs,
    ``module.function``)."""

    name: str
    cls: str
    action: str
    reason: str
    backend: str
    kernel: str
    adapter: str


def _layer_device(m: nn.Module) -> torch.device:
    for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
        return t.device
    return torch.device("cpu")


def select_kernel(m: nn.Module, device: torch.device | str | None = None) -> str:
    """The kernel ``torch._C._select_batch_norm_backend`` picks for a bnswap layer on
    ``device`` in training: ``"Native"``, ``"Cudnn"`` or ``"Miopen"``.

    The probe input is (2, C, 1[, 1[, 1]]) (rank 3 for BatchNorm1d, which uses native
    for (N, C) input) in the layer's parameter dtype, with defined weight, bias and
    statistics, as the bnswap core always passes them. Returns ``"n/a (...)"`` where the
    device is not present or the function does not exist in this torch.
    """
    dev = torch.device(device) if device is not None else _layer_device(m)
    select = getattr(torch._C, "_select_batch_norm_backend", None)
    if select is None:
        return "n/a (torch too old)"
    if dev.type == "meta":
        return "n/a (meta)"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return "n/a (no CUDA device)"
    c = int(getattr(m, "num_features", 1))
    dim = 5 if isinstance(m, nn.BatchNorm3d) else 4 if isinstance(m, nn.BatchNorm2d) else 3
    ref = getattr(m, "weight", None)
    dtype = ref.dtype if isinstance(ref, torch.Tensor) and ref.is_floating_point() else torch.float32
    try:
        x = torch.empty((2, c) + (1,) * (dim - 2), device=dev, dtype=dtype)
        ones = torch.ones(c, device=dev, dtype=dtype)
        zeros = torch.zeros(c, device=dev, dtype=dtype)
        backend = select(x, ones, zeros, zeros, ones, True, float(getattr(m, "eps", 1e-5)))
    except (RuntimeError, TypeError) as e:  # pragma: no cover - exotic devices
        return f"n/a ({type(e).__name__})"
    return str(backend).rsplit(".", 1)[-1]


class Plan(Sequence[PlanRow]):
    """The rows of a conversion, in ``named_modules()`` order.

    ``str(plan)`` is an aligned text table; ``plan.swapped`` / ``plan.skipped`` are the
    rows by action; ``plan.to_dicts()`` gives plain dicts (for logging or JSON).
    """

    def __init__(self, rows: Sequence[PlanRow]):
        self.rows: tuple[PlanRow, ...] = tuple(rows)

    def __getitem__(self, i):  # type: ignore[override]
        return self.rows[i]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[PlanRow]:
        return iter(self.rows)

    @property
    def swapped(self) -> list[PlanRow]:
        return [r for r in self.rows if r.action == "swap"]

    @property
    def skipped(self) -> list[PlanRow]:
        return [r for r in self.rows if r.action == "skip"]

    def to_dicts(self) -> list[dict[str, str]]:
        return [asdict(r) for r in self.rows]

    def summary(self) -> str:
        return (f"bnswap plan: {len(self.swapped)} of {len(self.rows)} BatchNorm layers "
                f"swapped, {len(self.skipped)} skipped")

    def __str__(self) -> str:
        header = ("layer", "class", "action", "backend", "kernel", "adapter", "reason")
        body = [(r.name, r.cls, r.action, r.backend, r.kernel, r.adapter, r.reason)
                for r in self.rows]
        if not body:
            return self.summary() + " (the model has no BatchNorm layers)"
        widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
        widths[-1] = 0  # the reason column is last and not padded

        def line(cells: Sequence[str]) -> str:
            return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

        rule = "  ".join("-" * w for w in widths[:-1]) + "  " + "-" * len(header[-1])
        return "\n".join([self.summary(), line(header), rule, *(line(b) for b in body)])

    def __repr__(self) -> str:
        return f"Plan({len(self.swapped)} swap, {len(self.skipped)} skip)"


def rows_from(decisions: Sequence[Decision], backend: str,
              device: torch.device | str | None = None) -> Plan:
    rows = []
    for d in decisions:
        if d.action == "swap":
            kernel = ("BatchNormInternal (ORT)" if backend == "ort"
                      else select_kernel(d.module, device))
            adapter = qualified_name(d.adapter) if d.adapter is not None else "-"
            be = backend
        else:
            kernel, adapter, be = "-", "-", "-"
        reason = d.reason or "-"
        if backend == "ort" and d.action == "skip":
            reason += ("; ORT cannot run an unswapped BatchNorm: bnswap.convert(..., "
                       "backend='ort') refuses the model, BNSwap keeps its child eager")
        rows.append(PlanRow(d.name, d.source.__name__, d.action, reason, be, kernel, adapter))
    return Plan(rows)


def plan(
    module: nn.Module,
    backend: str = "aten",
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    device: torch.device | str | None = None,
) -> Plan:
    """What :func:`bnswap.convert` would do to ``module``, without changing it.

    Args:
        module: any ``nn.Module``.
        backend: ``"aten"`` (consolidated aten ops) or ``"ort"`` (ONNX Runtime's
            ``com.microsoft::BatchNormInternal``).
        include, exclude: glob pattern(s) on qualified names from ``named_modules()``
            and/or classes (matched with ``isinstance``); a layer is swapped only if it
            matches ``include`` (when given) and no ``exclude``.
        device: where to evaluate the kernel choice
            (``torch._C._select_batch_norm_backend``); default: where each layer's
            parameters live.

    Returns:
        A :class:`Plan`.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; a pattern is not str or class.
        ValueError: unknown ``backend``.
    """
    check_module(module, "plan")
    return rows_from(decide(module, backend, include, exclude), backend, device)
