"""jsonargparse's parse errors in one line, for ``bnswap train`` and ``bnswap plan``."""

from __future__ import annotations

import re

__all__ = ["short_error"]

_LITERAL = re.compile(r"Expected a typing\.Literal\[(?P<choices>.*?)\]\. Got value: (?P<got>.*)")
_KEY = re.compile(r'Parser key "(?P<key>[^"]+)"')


_EXPECTED = re.compile(r"Expected a <class '(?P<type>[^']+)'>")
_SKIP = ("Does not validate", "Subtypes:", "Errors:", "Given value", "- Problem with given",
         "- Expected a")


def short_error(message: str) -> str:
    """jsonargparse's error ``message`` in one line: for a value outside a ``Literal``
    (``--trainer.callbacks.init_args.backend cuda``), the option and the choices; for a
    value of the wrong type (``--trainer.max_epochs abc``), the option, the types and
    the value; for a Union none of whose members accepts the value, the option and the
    first reason; otherwise the message as it is."""
    lines = message.splitlines()
    for i, line in enumerate(lines):
        m = _LITERAL.search(line)
        if m:
            keys = [k.group("key") for k in map(_KEY.search, lines[:i]) if k]
            path = ".".join(k for k in keys if k)
            return (f"{path or 'a value'}: expected one of {m.group('choices')}, "
                    f"got {m.group('got').strip()!r}")
    key = _KEY.match(lines[0]) if lines else None
    if key is None:
        return message
    given = next((ln.split("Given value:", 1)[1].strip() for ln in lines
                  if ln.strip().startswith("Given value:")), None)
    types = [{"NoneType": "None"}.get(t, t) for t in _EXPECTED.findall(message)]
    reasons = [ln.strip().removeprefix("- ") for ln in lines[1:]
               if ln.strip() and not ln.strip().startswith(_SKIP)]
    if reasons:
        return f"{key.group('key')}: {reasons[0]}"
    if types and given is not None:
        return f"{key.group('key')}: expected {' or '.join(types)}, got {given!r}"
    return message
