"""The table both kinds of plan share: rows in order, each with an ``action`` of
``"swap"`` or ``"skip"`` (:class:`bnswap.Plan` for a module's layers,
:class:`bnswap.ProgramPlan` for a program's batch-norm nodes)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["Rows"]

Row = TypeVar("Row")


class Rows(Sequence, Generic[Row]):
    """A sequence of rows (``self.rows``, a tuple) with the views every plan offers.
    Subclasses set :attr:`counted` (what the summary counts)."""

    #: What :meth:`summary` counts ("BatchNorm layers", "batch-norm nodes").
    counted = "rows"
    rows: tuple[Any, ...]

    def __getitem__(self, i):  # type: ignore[override]
        return self.rows[i]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    @property
    def swapped(self) -> list[Row]:
        """The rows with action ``"swap"`` (swapped now by ``apply``, or already)."""
        return [r for r in self.rows if r.action == "swap"]

    @property
    def skipped(self) -> list[Row]:
        """The rows with action ``"skip"``, each with its reason."""
        return [r for r in self.rows if r.action == "skip"]

    def to_dicts(self) -> list[dict[str, str]]:
        """One plain dict per row (the row's ``to_dict()``; JSON-serializable)."""
        return [r.to_dict() for r in self.rows]

    def summary(self) -> str:
        """``"bnswap plan: N of M <counted> swapped, K skipped"``."""
        return (f"bnswap plan: {len(self.swapped)} of {len(self.rows)} {self.counted} "
                f"swapped, {len(self.skipped)} skipped")
