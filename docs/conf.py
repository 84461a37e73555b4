"""Sphinx configuration of bnswap's documentation site (``make docs``).

The API reference comes from the docstrings (autodoc + napoleon, Google style), the CLI
reference from the command's own parsers (``_ext/bnswap_cli.py`` renders each
subcommand's ``--help``), the guides are the Markdown files of this folder (myst-parser).
The build runs with warnings as errors and ``nitpicky``, so a reference that resolves to
nothing (a ``:func:`` in a docstring, a Markdown link to a missing page or heading) fails
it. Adding a guide is one line in ``index.md``'s toctree.
"""

from __future__ import annotations

import sys
from importlib.metadata import version as _version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

project = "bnswap"
author = "bnswap contributors"
copyright = "2026, bnswap contributors"
release = _version("bnswap")
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "myst_parser",
    "bnswap_cli",
    "bnswap_wrap",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "_templates", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

# Markdown: ``#`` anchors for headings down to ###, so ``page.md#a-heading`` links resolve
# (and a broken one is a warning, hence an error).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# API: one page per public name (api/*.md), members in source order, signatures without
# the annotations (the docstrings' Args say the types in words: shapes, dtypes).
autodoc_member_order = "bysource"
# bnswap.Plan and bnswap.plan: two pages whose names differ in case only, which collide on
# a case-insensitive file system (macOS, Windows)
autosummary_filename_map = {"bnswap.Plan": "bnswap.Plan-class"}
autodoc_typehints = "none"
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
add_module_names = True

# Every reference must resolve; what lives in other projects (torch, Lightning, ...) has no
# page here (no intersphinx: the build works offline).
nitpicky = True
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(torch|lightning|pytorch_lightning|onnxruntime|torch_ort|jsonargparse|timm"
        r"|torchvision|torchao|numpy|typing|collections|abc|pathlib|enum|logging"
        r"|argparse|contextlib|functools|importlib|difflib|warnings|os|sys)(\..*)?",
    ),
    # bnswap's internals, named in the public docstrings but not pages of the site: each by
    # its exact name, so a typo next to them (bnswap.functional.nonexistent) still fails
    (r"py:class", r"bnswap\.(_swap\.Swap|_rows\.Rows|lightning\._BNSwapBase)"),
    (r"py:data", r"bnswap\.(_graph\.STOCK_TARGETS|functional\.EMPTY_BATCH_MESSAGE)"),
    (r"py:func", r"bnswap\.functional\.check_batch_norm_input"),
    (
        r"py:.*",
        r"(bnswap\.sync\.)?(FLAGS|ORIGINAL|NO_GROUP_YET|sync_group|sync_kernel|synchronized_batch_norm)",
    ),
    (r"py:.*", r"(bnswap\.ort\.)?DEFAULT_SESSION_OPTIONS|check_batch_norm_input|to_wrap|summary"),
    (
        r"py:class",
        r"(int|float|str|bool|dict|list|tuple|set|type|object|None|bytes"
        r"|callable|optional|default|iterable|function)",
    ),
]

html_theme = "furo"
html_title = f"bnswap {release}"
# _static/bnswap.css: tables fit the text column (their cells wrap), so no column hides
html_static_path = ["_static"]
html_css_files = ["bnswap.css"]
html_show_sourcelink = False


def _public_bases(app: object, name: str, obj: object, options: object, bases: list) -> None:
    """``Bases:`` lists public classes only: ``bnswap.lightning.BNSwap`` shows
    ``Callback``, not the private ``_BNSwapBase`` it shares with its
    ``pytorch_lightning`` twin."""
    bases[:] = [b for b in bases if not getattr(b, "__name__", "").startswith("_")]


def setup(app: object) -> None:
    app.connect("autodoc-process-bases", _public_bases)  # type: ignore[attr-defined]
