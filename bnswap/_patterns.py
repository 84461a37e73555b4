"""Include / exclude patterns on a model's layers: glob patterns (str) on qualified
module names, classes (matched with ``isinstance``), or iterables of them; what
:func:`bnswap.plan` / :func:`bnswap.convert` and the Lightning callback take."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "EMPTY_INCLUDE",
    "Pattern",
    "Patterns",
    "check_patterns",
    "pattern_list",
    "pattern_str",
]

Pattern = str | type
Patterns = Pattern | Iterable[Pattern] | None


def pattern_list(p: Patterns, arg: str) -> list[Pattern]:
    if p is None:
        return []
    try:
        # (bytes are one pattern, refused below: not the ints list() makes of them)
        items = [p] if isinstance(p, (str, bytes, bytearray, type)) else list(p)
    except TypeError:  # not iterable (exclude=42): bnswap's message, not list()'s
        items = [p]  # type: ignore[list-item]  # refused just below
    for item in items:
        if not isinstance(item, (str, type)):
            raise TypeError(
                f"{arg} takes glob patterns (str) on qualified module names and/or classes, "
                f"got {item!r}"
            )
    return items


#: What an empty ``include`` says (``include=[]``: nothing is included).
EMPTY_INCLUDE = (
    "bnswap: include is empty, so it matches no BatchNorm layer and none is swapped "
    "(include=None, the default, swaps every layer)"
)


def check_patterns(include: Patterns = None, exclude: Patterns = None) -> None:
    """Raise TypeError unless ``include`` / ``exclude`` are what :func:`bnswap.plan` accepts: a
    glob pattern (str) on qualified module names, a class, or an iterable of those.

    Examples::

        >>> import bnswap
        >>> from torch import nn
        >>> bnswap.check_patterns(include="backbone.*", exclude=[nn.BatchNorm1d])
        >>> bnswap.check_patterns(include=[3])
        Traceback (most recent call last):
        ...
        TypeError: include takes glob patterns (str) on qualified module names and/or classes, got 3
    """
    pattern_list(include, "include")
    pattern_list(exclude, "exclude")


def pattern_str(p: Pattern) -> str:
    return p.__name__ if isinstance(p, type) else repr(p)
