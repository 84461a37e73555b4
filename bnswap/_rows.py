"""The table both kinds of plan share: rows in order, each with an ``action`` of
``"swap"`` (apply swaps it), ``"keep"`` (it runs bnswap's ops already: apply leaves it as
it is) or ``"skip"`` (it keeps torch's forward) (:class:`bnswap.Plan` for a module's
layers, :class:`bnswap.ProgramPlan` for a program's batch-norm nodes)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar, overload

__all__ = ["ACTIONS", "Rows"]

#: A row's ``action``: swapped by ``apply``; already on bnswap's ops (``apply`` changes
#: nothing); left on torch's forward (the reason says why).
ACTIONS = ("swap", "keep", "skip")

Row = TypeVar("Row")


class Rows(Sequence[Row], Generic[Row]):
    """A sequence of rows (``self.rows``, a tuple) with the views every plan offers.
    Subclasses set :attr:`counted` (what the summary counts)."""

    #: What :meth:`summary` counts ("BatchNorm layers", "batch-norm nodes").
    counted = "rows"
    #: What :meth:`summary` calls the ``keep`` rows ("already swapped" layers, nodes
    #: "already on bnswap's ops").
    kept_as = "already swapped"
    rows: tuple[Any, ...]
    #: Whether ``apply`` has carried the plan out (set by a successful ``apply``): the
    #: summary then says what was done, not what would be.
    applied = False

    @overload
    def __getitem__(self, i: int) -> Row: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Row, ...]: ...
    def __getitem__(self, i: int | slice) -> Row | tuple[Row, ...]:
        return self.rows[i]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    @property
    def swapped(self) -> list[Row]:
        """The rows that run bnswap's ops once ``apply`` is done: action ``"swap"``
        (swapped by ``apply``) or ``"keep"`` (already swapped)."""
        return [r for r in self.rows if r.action != "skip"]

    @property
    def kept(self) -> list[Row]:
        """The rows with action ``"keep"``: already swapped, ``apply`` leaves them."""
        return [r for r in self.rows if r.action == "keep"]

    @property
    def skipped(self) -> list[Row]:
        """The rows with action ``"skip"``, each with its reason."""
        return [r for r in self.rows if r.action == "skip"]

    def to_dicts(self) -> list[dict[str, str]]:
        """One plain dict per row (the row's ``to_dict()``; JSON-serializable)."""
        return [r.to_dict() for r in self.rows]

    def _counts(self) -> str:
        """``"1 swap, 0 skip"`` (``"0 swap, 4 keep, 0 skip"`` when some are kept): the
        plans' ``repr``."""
        keep = len(self.kept)
        return (
            f"{len(self.swapped) - keep} swap, "
            + (f"{keep} keep, " if keep else "")
            + f"{len(self.skipped)} skip"
        )

    def summary(self) -> str:
        """What the plan would do, before ``apply``, one count per action, each said once:

        * ``"bnswap plan: N of M <counted> would be swapped, K skipped"``;
        * with J of them swapped already (``keep``), ``"bnswap plan: N of M <counted>
          would be swapped, J already swapped, K skipped"`` (N + J + K = M; a program's
          plan says "already on bnswap's ops": :attr:`kept_as`);
        * with every one not skipped swapped already: ``"bnswap plan: all M <counted>
          already swapped: nothing would change"``, or ``"bnswap plan: J of M <counted>
          already swapped, K skipped: nothing would change"``.

        After a successful ``apply`` (``applied``), what was done, in the same words:
        ``"bnswap: N of M <counted> swapped, K skipped"``, ``"...: nothing changed"``.

        Examples::

            >>> import bnswap, torch.nn as nn
            >>> model = nn.Sequential(nn.BatchNorm2d(2), nn.BatchNorm2d(2))
            >>> print(bnswap.plan(model).summary())
            bnswap plan: 2 of 2 BatchNorm layers would be swapped, 0 skipped
            >>> _ = bnswap.convert(model)
            >>> print(bnswap.plan(model).summary())
            bnswap plan: all 2 BatchNorm layers already swapped: nothing would change
        """
        done = self.applied
        prefix = "bnswap" if done else "bnswap plan"
        total, kept, skipped = len(self.rows), len(self.kept), len(self.skipped)
        new = len(self.swapped) - kept
        if kept and not new:  # apply swaps nothing
            counts = (
                f"all {total} {self.counted} {self.kept_as}"
                if kept == total and total > 1
                else f"{kept} of {total} {self.counted} {self.kept_as}, {skipped} skipped"
            )
            return f"{prefix}: {counts}: {'nothing changed' if done else 'nothing would change'}"
        return (
            f"{prefix}: {new} of {total} {self.counted} {'' if done else 'would be '}swapped, "
            + (f"{kept} {self.kept_as}, " if kept else "")
            + f"{skipped} skipped"
        )
