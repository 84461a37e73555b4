"""A directive that renders the ``bnswap`` command's help as the parsers print it.

``{bnswap-help} SUBCOMMAND`` (or no argument for ``bnswap --help``) runs
``python -m _bnswap_command SUBCOMMAND --help`` and shows its output as a literal block:
the CLI reference is generated from the parsers themselves (the front door's table,
jsonargparse's ``plan`` / ``convert`` parsers, LightningCLI's for the Trainer
subcommands), so it cannot drift from them. ``:same-as: train`` shows only what differs
from ``bnswap train --help``: the first line of the usage, then the sections (the
description, an option group) that ``train``'s help does not hold word for word (the
Trainer subcommands share some 450 lines of Lightning's Trainer options). The reST markup
that Lightning's docstrings bring into the Trainer options' help
(``:class:`datetime.timedelta```, ``:paramref:`~lightning.pytorch.trainer.trainer.Trainer.logger```,
````"auto"````) is shown as the plain text it stands for (:func:`plain_text`). The first
directive starts every help at once, four at a time (each imports torch, the Lightning ones
Lightning: 2-7 s apiece); a build that uses none starts none. A subcommand whose help fails is
a build error.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
#: "" is ``bnswap --help``; the rest, the subcommands (``_bnswap_command.SUBCOMMANDS``).
HELPS = ("", "plan", "convert", "train", "validate", "test", "predict", "compare")
WIDTH = "88"
_RUNS: dict[str, Future] = {}


def _help(sub: str) -> str:
    env = {**os.environ, "COLUMNS": WIDTH, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "_bnswap_command", *([sub] if sub else []), "--help"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise ExtensionError(f"`bnswap {sub} --help` exited {p.returncode}: {p.stderr[-2000:]}")
    return p.stdout.rstrip()


#: a reST role, ``:name:`target``` or ``:name:`~target```, as argparse wrapped it: the
#: target may hold a line break and the next line's indent
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
#: a reST inline literal, ````text````
_LITERAL = re.compile(r"``([^`]+)``")


def _role_text(m: re.Match[str]) -> str:
    """What a role shows: the target (its last part after ``~``), a line break inside it
    kept in front, with its indent."""
    target = "".join(m.group(2).split())
    shown = target.rsplit(".", 1)[-1] if m.group(1) else target
    brk = re.search(r"\n[ ]*", m.group(2))
    return (brk.group(0) if brk else "") + shown


def plain_text(text: str) -> str:
    r"""``text`` (one ``--help``) with reST roles and inline literals as plain text.

    Examples::

        >>> plain_text("a :class:`datetime.timedelta`, ``'auto'``")
        "a datetime.timedelta, 'auto'"
        >>> plain_text("in :paramref:`~lightning.Trainer.call\n      backs`. Default:")
        'in \n      callbacks. Default:'
    """
    return _LITERAL.sub(r"\1", _ROLE.sub(_role_text, text))


def _sections(text: str) -> list[str]:
    """The blocks of one ``--help`` after its usage: each starts at a line in column 0
    (a description, an option group's title) and runs to the next."""
    out: list[list[str]] = []
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("usage:"):
            out.append([line])
        elif out:
            out[-1].append(line)
    return ["\n".join(block).rstrip() for block in out]


def differences(text: str, base: str, base_name: str) -> str:
    """``text`` (one subcommand's help) as far as it differs from ``base`` (another's):
    its usage's first line, a line naming ``base_name``, the blocks ``base`` lacks."""
    usage = text.splitlines()[0].rstrip()
    shared = set(_sections(base))
    own = [block for block in _sections(text) if block not in shared]
    return "\n\n".join(
        [f"{usage} ...", f"(every option of `bnswap {base_name} --help`; these differ:)", *own]
    )


def _start() -> None:
    pool = ThreadPoolExecutor(max_workers=4)
    for sub in HELPS:
        _RUNS[sub] = pool.submit(_help, sub)
    pool.shutdown(wait=False)


class BnswapHelp(SphinxDirective):
    """``bnswap [SUBCOMMAND] --help`` as a literal block."""

    optional_arguments = 1
    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {
        "caption": directives.unchanged,
        "same-as": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        sub = self.arguments[0] if self.arguments else ""
        if sub not in HELPS:
            raise self.error(f"bnswap-help: no subcommand {sub!r} (one of {HELPS[1:]})")
        if not _RUNS:
            _start()
        text = plain_text(_RUNS[sub].result())
        base = self.options.get("same-as")
        if base is not None:
            if base not in HELPS[1:]:
                raise self.error(f"bnswap-help: :same-as: {base!r} is no subcommand")
            text = differences(text, plain_text(_RUNS[base].result()), base)
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def setup(app: Sphinx) -> dict[str, object]:
    app.add_directive("bnswap-help", BnswapHelp)
    return {"version": "1", "parallel_read_safe": True}
