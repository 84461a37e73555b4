"""What ``bnswap train``, ``bnswap plan`` and ``bnswap convert`` share in reading their
arguments: jsonargparse's parse errors in one line, the object a dotted path names
(:func:`import_path`), the options a parser takes (:func:`long_options`) and the error
of an ``--include`` / ``--exclude`` that is no pattern (:func:`pattern_error`)."""

from __future__ import annotations

import difflib
import importlib
import json
import re
from collections.abc import Iterable
from typing import Any

import yaml

__all__ = [
    "did_you_mean",
    "long_options",
    "pattern_error",
    "short_error",
    "unrecognized_error",
]

_KEY = re.compile(r'Parser key "(?P<key>[^"]+)":\s*(?P<rest>.*)')
_CLASS_PATH = re.compile(r"Problem with given class_path '[^']*':\s*(?P<rest>.*)")
_LITERAL = re.compile(
    r"Expected (?:a )?typing\.Literal\[(?P<choices>.*?)\]"
    r"(?:\. Got value: (?P<got>.*))?$"
)
_EXPECTED = re.compile(r"Expected (?:a )?(?P<type>.+?)(?:\. Got value: (?P<got>.*))?$")
_UNION = "Does not validate against any of the Union subtypes"
#: jsonargparse refusing a class (or a function annotated to return one) whose required
#: parameter has no annotation: it cannot tell how to parse the value.
_UNTYPED = re.compile(
    r"With fail_untyped=(?:True|'all'), all (?:mandatory )?parameters must "
    r"have a supported type\. Parameter '(?P<name>[^']+)' from "
    r"'(?P<src>[^']+)' does not specify a type\.?"
)
#: Longest line kept of a message jsonargparse builds from the user's input (a file
#: that is not a config is quoted whole: "Unexpected config: <the file>").
_MAX = 160


def short_error(message: str) -> str:
    """jsonargparse's error ``message`` in one line, naming the option by its dotted
    path: for a value outside a ``Literal`` (``--trainer.callbacks.init_args.backend
    cuda``), the choices; for a value of the wrong type (``--trainer.max_epochs abc``),
    the types accepted and the value; inside a class (``--model.num_features abc``,
    ``--model.init_args.arch foo``) the innermost option that refused the value; for a
    Union none of whose members accepts the value, its most specific reason (an error
    raised while building the class is given as it is); a required parameter with no type
    annotation (jsonargparse's ``fail_untyped``), which one of which class or function
    and how to annotate it; otherwise the message's first line (cut at 160 characters).

    Examples::

        >>> short_error('Parser key "trainer.max_epochs":\\n'
        ...             '  Does not validate against any of the Union subtypes\\n'
        ...             "  Subtypes: [<class 'int'>, <class 'NoneType'>]\\n"
        ...             '  Errors:\\n'
        ...             "    - Expected a <class 'int'>\\n"
        ...             "    - Expected a <class 'NoneType'>\\n"
        ...             "  Given value type: <class 'str'>\\n"
        ...             '  Given value: abc')
        "trainer.max_epochs: expected int or None, got 'abc'"
        >>> short_error('Parser key "model":\\n'  # doctest: +NORMALIZE_WHITESPACE
        ...             '  Does not validate against any of the Union subtypes\\n'
        ...             "  Subtypes: [<class 'torch.nn.modules.module.Module'>]\\n"
        ...             '  Errors:\\n'
        ...             '    - With fail_untyped=True, all mandatory parameters must have a '
        ...             "supported type. Parameter 'width' from 'mymodels.Net.__init__' does "
        ...             'not specify a type.\\n'
        ...             '  Given value: mymodels.Net')
        "model: parameter 'width' of mymodels.Net has no type annotation, so its value
        cannot be parsed: annotate it (e.g. width: int)"
        >>> short_error('Does not validate against any of the Union subtypes\\n'
        ...             "Subtypes: [<class 'torch.nn.modules.module.Module'>]\\n"
        ...             'Errors:\\n'  # a class that asserts on its argument
        ...             "  - Problem with given class_path 'mymodels.Checked':\\n"
        ...             '      width must be positive, got -2\\n'
        ...             "Given value: Namespace(class_path='mymodels.Checked')")
        'width must be positive, got -2'
    """
    lines = [ln for ln in message.splitlines() if ln.strip()]
    if not lines:
        return message
    if lines[0].startswith("Unexpected config:"):  # the whole file follows
        return (
            "config: not a config file (a YAML mapping of options: trainer:, model:, "
            f"data: ...); it begins {lines[0].split(':', 1)[1].strip()[:40]!r}"
        )
    text = _explain(lines, [])
    return text if text is not None else _first_line(lines[0])


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'CHOICE'?"`` for the choice closest to ``name``
    (:func:`difflib.get_close_matches`, as the front door's subcommand typos and
    argparse from Python 3.12 do), or ``""`` when none is close.

    Examples::

        >>> did_you_mean("--modle", ["--model", "--config", "--program"])
        "; did you mean '--model'?"
        >>> did_you_mean("--zzz", ["--model"])
        ''
    """
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


_UNRECOGNIZED = re.compile(r"unrecognized arguments: (?P<args>.*)", re.DOTALL)


def unrecognized_error(message: str, options: Iterable[str]) -> str | None:
    """argparse's ``unrecognized arguments: --modle m.net`` as ``unknown option
    '--modle'; did you mean '--model'?`` (the first unknown option, the closest of
    ``options``, the parser's option strings), or None for another message or a
    stray value that is no option (argparse's words are kept then).

    Examples::

        >>> unrecognized_error("unrecognized arguments: --modle m.net", ["--model"])
        "unknown option '--modle'; did you mean '--model'?"
        >>> unrecognized_error("unrecognized arguments: --formt=json", ["--format"])
        "unknown option '--formt'; did you mean '--format'?"
        >>> unrecognized_error("unrecognized arguments: --zzz", ["--model"])
        "unknown option '--zzz'"
    """
    m = _UNRECOGNIZED.match(message.strip())
    if m is None:
        return None
    given = next((a for a in m.group("args").split() if a.startswith("-")), None)
    if given is None:
        return None
    name = given.split("=", 1)[0]
    return f"unknown option {name!r}" + did_you_mean(name, options)


def _first_line(line: str) -> str:
    line = line.strip()
    return line if len(line) <= _MAX else line[: _MAX - 3] + "..."


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _body(lines: list[str]) -> list[str]:
    """The lines under ``lines[0]`` (indented deeper), without their indentation."""
    base = _indent(lines[0])
    body = [ln for ln in lines[1:] if _indent(ln) > base]
    cut = min((_indent(ln) for ln in body), default=0)
    return [ln[cut:] for ln in body]


def _items(lines: list[str]) -> list[list[str]]:
    """The ``- item`` entries of a list (each with the lines under it)."""
    items: list[list[str]] = []
    for ln in lines:
        if ln.startswith("- "):
            items.append([ln[2:]])
        elif items:
            items[-1].append(ln[2:] if ln.startswith("  ") else ln)
    return items


def _type_name(text: str) -> str:
    text = text.strip()
    if m := re.fullmatch(r"<class '(?P<path>[^']+)'>", text):
        return {"NoneType": "None"}.get(
            m.group("path").rsplit(".", 1)[-1], m.group("path").rsplit(".", 1)[-1]
        )
    if m := re.fullmatch(r"typing\.Literal\[(?P<choices>.*)\]", text):
        return f"one of {m.group('choices')}"
    return re.sub(r"\b(?:[a-z_][\w]*\.)+(?P<name>[A-Z]\w*)", r"\g<name>", text)


#: How a type in a Union is named beside a Literal's choices.
_CLASS_NAMES = {"Module": "an nn.Module class path (e.g. mymodels.Net)"}


def _split_top(text: str) -> list[str]:
    """``a, b[c, d], e`` -> ``[a, b[c, d], e]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "[(<" and 1) or (ch in "])>" and -1) or 0
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _where(path: list[str]) -> str:
    """``"trainer.max_epochs: "``; nothing when the option is not known."""
    return ".".join(path) + ": " if path else ""


#: jsonargparse's first try of a value given to a class option: as a config file's path
#: (not what the user meant when the value is a class path or a choice)
_NOT_A_PATH = re.compile(r"Expected a path but .* either not accessible or invalid")


def _explain(lines: list[str], path: list[str]) -> str | None:
    head = lines[0].strip()
    if head.startswith("- "):  # alternatives jsonargparse tried, one per item
        items: list[list[str]] = []
        for ln in lines:  # (the lines under an item keep their indentation)
            if ln.startswith("- "):
                items.append([ln[2:]])
            elif items:
                items[-1].append(ln)
        meant = [it for it in items if not _NOT_A_PATH.fullmatch(it[0].strip())] or items
        for item in meant:
            if (text := _explain(item, path)) is not None:
                return text
        return f"{_where(path)}{_first_line(meant[0][0])}"
    if m := _KEY.fullmatch(head):
        inner = [m.group("rest")] if m.group("rest") else []
        rest = inner + _body(lines)
        return _explain(rest, [*path, m.group("key")]) if rest else None
    if m := _CLASS_PATH.fullmatch(head):
        rest = ([m.group("rest")] if m.group("rest") else []) + _body(lines)
        if not rest:
            return None
        # what the class raised (an AssertionError: "width must be positive"), when
        # nothing more specific names an option
        return _explain(rest, path) or f"{_where(path)}{_first_line(rest[0])}"
    if head == _UNION:
        return _union(lines, path)
    if m := _UNTYPED.fullmatch(head):
        name, src = m.group("name"), m.group("src").removesuffix(".__init__")
        return (
            f"{_where(path)}parameter {name!r} of {src} has no type annotation, so its "
            f"value cannot be parsed: annotate it (e.g. {name}: int)"
        )
    if m := _LITERAL.fullmatch(head):
        got = m.group("got") or _given(lines)
        return f"{_where(path)}expected one of {m.group('choices')}" + (
            f", got {got.strip()!r}" if got is not None else ""
        )
    if m := _EXPECTED.fullmatch(head):
        got = m.group("got") or _given(lines)
        return f"{_where(path)}expected {_type_name(m.group('type'))}" + (
            f", got {got.strip()!r}" if got is not None else ""
        )
    return f"{_where(path)}{_first_line(head)}" if path else None


def _given(lines: list[str]) -> str | None:
    return next(
        (
            ln.split("Given value:", 1)[1].strip()
            for ln in lines
            if ln.strip().startswith("Given value:")
        ),
        None,
    )


def _union(lines: list[str], path: list[str]) -> str:
    subtypes = next(
        (ln.split("Subtypes:", 1)[1].strip() for ln in lines if ln.strip().startswith("Subtypes:")),
        "[]",
    )
    errors_at = next((i for i, ln in enumerate(lines) if ln.strip() == "Errors:"), None)
    items = _items(_body(lines[errors_at:])) if errors_at is not None else []
    # The most specific reason first: a value refused inside a class, then what a
    # class refused (an unknown option), then an error raised while building it.
    nested = [it for it in items if any(_KEY.fullmatch(ln.strip()) for ln in it)]
    classes = [it for it in items if _CLASS_PATH.fullmatch(it[0].strip())]
    raised = [it for it in items if not it[0].startswith("Expected ")]
    for group in (nested, classes, raised):
        for item in group:
            text = _explain(item, path)
            if text is not None:
                return text
            return f"{_where(path)}{_first_line(item[0])}"
    names = [_type_name(t) for t in _split_top(subtypes.strip()[1:-1])]
    literal = [n for n in names if n.startswith("one of ")]
    # None: the default, not a choice; a module class besides the choices: its class path
    others = [_CLASS_NAMES.get(n, n) for n in names if n not in literal and n != "None"]
    expected = " or ".join(literal[:1] + others) if literal else " or ".join(names)
    given = _given(lines)
    return f"{_where(path)}expected {expected}" + (f", got {given!r}" if given is not None else "")


def import_path(path: str) -> Any:
    """The object a dotted path names (``mymodels.Tiny``: module ``mymodels``, attribute
    ``Tiny``), or None where nothing importable has that name (the caller reports it)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return None
        return obj
    return None


def long_options(parser: Any) -> list[str]:
    """The ``--options`` ``parser`` takes (for a typo's "did you mean")."""
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]


def pattern_error(cfg: Any) -> str | None:
    """The error for an ``--include`` / ``--exclude`` value that YAML reads as a list but
    not of strings (``'[1]'``): jsonargparse, having failed ``list[str]``, keeps it as one
    bare pattern (a glob character class), which the user did not mean. None when
    both are fine. (A glob that is itself a YAML list, ``'[ab]'``, is given in a list:
    ``'["[ab]"]'``.)"""
    for option in ("include", "exclude"):
        value = getattr(cfg, option)
        if isinstance(value, str) and value.lstrip().startswith("["):
            try:
                loaded = yaml.safe_load(value)
            except yaml.YAMLError:
                continue  # a glob such as '[ab]*'
            if isinstance(loaded, list):
                return (
                    f"{option}: expected a glob pattern or a list of patterns (str), "
                    f"got {value!r}; a pattern that is itself a YAML list goes in one: "
                    f"--{option} '{json.dumps([value])}'"
                )
    return None
