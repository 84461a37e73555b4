"""What ``bnswap plan`` and ``bnswap convert`` print and return: the plan as a table,
JSON or markdown (:func:`render`), warnings and usage errors in one line on stderr
(:func:`print_warnings`, :func:`usage_error`), and the exit status (:func:`exit_status`:
0 every BatchNorm layer or batch-norm node swapped or left out on purpose, 3 one skipped
that bnswap cannot swap or a backend that refuses the model, 2 a usage error)."""

from __future__ import annotations

import json
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import bnswap

__all__ = [
    "EXIT_ALL_SWAPPED",
    "EXIT_SOME_SKIPPED",
    "EXIT_USAGE",
    "WARNING_PREFIX",
    "exit_status",
    "print_warnings",
    "render",
    "usage_error",
]

EXIT_ALL_SWAPPED = 0
EXIT_SOME_SKIPPED = 3
EXIT_USAGE = 2


def _null(cell: str) -> str | None:
    """A table cell for JSON: the table's ``-`` (nothing there) is ``null``."""
    return None if cell == "-" else cell


def _markdown(summary: str, head: list[str], rows: list[list[str]], code: set[int]) -> str:
    """A GitHub table under the plan's summary in bold; the columns in ``code`` as code."""
    lines = [f"**{summary}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cells in rows:
        lines.append(
            "| "
            + " | ".join(
                f"`{c}`" if i in code else str(c).replace("|", "\\|") for i, c in enumerate(cells)
            )
            + " |"
        )
    return "\n".join(lines)


def render(plan: bnswap.Plan | bnswap.ProgramPlan, fmt: str, note: str = "") -> str:
    """The plan as ``table`` (``str(plan)``), ``json`` (``{"layers": [...], "summary":
    {...}}``; a program's: ``{"nodes": [...], ...}``; ``null`` where the table shows ``-``)
    or ``markdown`` (a GitHub table)."""
    records: list[dict[str, str | None]]
    if isinstance(plan, bnswap.ProgramPlan):
        kind, code = "nodes", {0, 1, 3}
        head = ["node", "op", "action", "becomes", "kernel_before", "kernel", "reason"]
        rows = plan.to_dicts()
        records = [{k: _null(v) for k, v in r.items()} for r in rows]
        cells = [[r[k] for k in head] for r in rows]
    else:
        kind, code = "layers", {0, 1, 5}
        head = ["layer", "class", "action", "backend", "kernel", "adapter", "sync", "reason"]
        records = [
            {
                "name": r.name,
                "class": r.cls,
                "action": r.action,
                "backend": _null(r.backend),
                "kernel": _null(r.kernel),
                "adapter": _null(r.adapter_name),
                "sync": _null(r.sync),
                "reason": _null(r.reason),
            }
            for r in plan
        ]
        cells = [
            [r.name, r.cls, r.action, r.backend, r.kernel, r.adapter_name, r.sync, r.reason]
            for r in plan
        ]
    if fmt == "json":
        return json.dumps(
            {
                kind: records,
                "summary": {
                    kind: len(plan),
                    "swapped": len(plan.swapped),
                    "skipped": len(plan.skipped),
                    "backend": plan.backend,
                    "text": plan.summary(),
                    "note": note or None,
                },
            },
            indent=1,
        )
    if fmt == "markdown":
        return _markdown(plan.summary(), head, cells, code) + (f"\n\n{note}" if note else "")
    return str(plan) + (f"\n{note}" if note else "")


WARNING_PREFIX = re.compile(r"^bnswap(?:\.convert)?: ")


def print_warnings(caught: Sequence[warnings.WarningMessage], command: str) -> None:
    """Each warning once, in one line, ``bnswap COMMAND: warning: ...`` (without the
    library's own ``bnswap:`` / ``bnswap.convert:`` prefix), not Python's format."""
    for text in dict.fromkeys(WARNING_PREFIX.sub("", str(w.message)) for w in caught):
        print(f"bnswap {command}: warning: {text}", file=sys.stderr)


def usage_error(message: str, command: str = "plan") -> int:
    """Print ``bnswap plan: error: message`` to stderr; the usage-error exit status."""
    print(f"bnswap {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _left_out_on_purpose(row: Any) -> bool:
    """Whether a skipped row (a layer's :class:`bnswap.PlanRow` or a program's
    ``NodeRow``) was left out by the patterns given (``--include`` / ``--exclude``, a
    config callback's; a backward node whose forward node was): the row's ``excluded``;
    not a layer bnswap cannot swap."""
    return bool(row.excluded)


def exit_status(plan: bnswap.Plan | bnswap.ProgramPlan) -> int:
    """:data:`EXIT_SOME_SKIPPED` when a row is skipped that was not left out on purpose
    (:func:`_left_out_on_purpose`), the backend refuses the model as planned (ORT with a
    layer left stock, even an excluded one: ``Plan.refused``), or ``--include`` matched
    no layer at all (nothing would be swapped: a CI gate must not pass a typo), else
    :data:`EXIT_ALL_SWAPPED`."""
    refused = getattr(plan, "refused", False)  # (a program plan has no backend to refuse)
    if refused or not all(_left_out_on_purpose(r) for r in plan.skipped):
        return EXIT_SOME_SKIPPED
    if not plan.swapped and any(
        r.reason.startswith("not matched by include") for r in plan.skipped
    ):
        return EXIT_SOME_SKIPPED  # an include that chose nothing: a typo, not a choice
    return EXIT_ALL_SWAPPED
