"""Break opportunities in the inline code of tables, so that wide tables fit the page.

An op name such as ``_native_batch_norm_legit_functional`` is one word to a browser: a
table cell holding it is at least that wide, and a table of several such columns is wider
than furo's text column (furo then scrolls the table in its box, hiding the last
columns). This transform puts an HTML ``<wbr>`` (a break opportunity that copies as
nothing) after each ``_``, ``.``, ``/``, ``,``, ``=`` and ``(``, and between the words of a
CamelCase name (``Distributed<wbr>Data<wbr>Parallel``), inside the inline literals of every
table (not at their start), so a long name wraps at its parts; ``_static/
bnswap.css`` lets table cells wrap. Other builders (``text``, ``man``) get the literals
unchanged.
"""

from __future__ import annotations

import re

from docutils import nodes
from sphinx.application import Sphinx

#: where a name may break: after these characters, and inside a CamelCase word before
#: its next capital (never before the name's first character)
_BREAK_AFTER = re.compile(r"(?<=[_./,=(])(?=.)|(?<=[a-z])(?=[A-Z])")


def split_literal(text: str) -> list[str]:
    """``text`` cut after each break character, its first character kept whole.

    Examples::

        >>> split_literal("_native_batch_norm")
        ['_native_', 'batch_', 'norm']
        >>> split_literal("a.b(c=1)")
        ['a.', 'b(', 'c=', '1)']
        >>> split_literal("nn.SyncBatchNorm")
        ['nn.', 'Sync', 'Batch', 'Norm']
    """
    parts = _BREAK_AFTER.split(text[1:])
    return [text[:1] + parts[0], *parts[1:]] if text else []


def add_breaks(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    """The ``doctree-resolved`` handler: ``<wbr>`` between the parts of each table
    literal (HTML builders only)."""
    if app.builder.format != "html":
        return
    for table in doctree.findall(nodes.table):
        for literal in list(table.findall(nodes.literal)):
            for text in list(literal.findall(nodes.Text)):
                parts = split_literal(str(text))
                if len(parts) < 2:
                    continue
                new: list[nodes.Node] = [nodes.Text(parts[0])]
                for part in parts[1:]:
                    new += [nodes.raw("", "<wbr>", format="html"), nodes.Text(part)]
                text.parent.replace(text, new)


def setup(app: Sphinx) -> dict[str, object]:
    app.connect("doctree-resolved", add_breaks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
