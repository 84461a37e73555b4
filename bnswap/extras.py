"""bnswap's extras (``pyproject.toml``'s optional dependencies) and the command that
installs one from where this bnswap came from.

bnswap is not on PyPI, so ``pip install 'bnswap[lightning]'`` finds nothing unless an
index of your own has it. A missing extra's message names instead what works for this
installation, read from its distribution's ``direct_url.json`` (PEP 610, which pip
writes for an install that did not come from an index):

* from a checkout (``pip install .``; ``-e`` kept for an editable install), or run
  from a checkout on ``sys.path``: ``pip install '/path/to/bnswap[lightning]'``;
* from a wheel or sdist file still where it was:
  ``pip install '/path/to/bnswap-0.1.0-py3-none-any.whl[lightning]'``;
* from a URL or a VCS: ``pip install 'bnswap[lightning] @ git+https://...'``;
* from an index (no ``direct_url.json``): ``pip install 'bnswap[lightning]'``;

and otherwise the extra's name and the README's Install section. Standard library only.
"""

from __future__ import annotations

import json
import os
import shlex
from importlib import metadata
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = ["EXTRAS", "command_for", "install_command", "install_hint"]

#: Each extra and what it brings (README, Install).
EXTRAS = {
    "lightning": "Lightning, scikit-learn, matplotlib: the BNSwap callback and the "
    "train / validate / test / predict / compare subcommands",
    "onnx": "onnxscript, onnx: torch.onnx.export(..., dynamo=True) of a converted model",
    "ort-cpu": "onnxruntime-training-cpu 1.19.2: backend='ort' (then pip install --no-deps "
    "torch-ort==1.19.2)",
    "ort": "onnxruntime-training 1.19.2 (CUDA), torch-ort 1.19.2: backend='ort' on GPUs",
    "qat": "torchao 0.18: pt2e quantization-aware training of converted models",
    "lint": "mypy, ruff: bnswap's checks (make lint)",
    "dev": "pytest, hypothesis, torchao, ptflops, higher, build, twine and the lint extra: "
    "bnswap's own test suite and its checks",
    "docs": "Sphinx, furo, myst-parser, pytest, playwright: the documentation site (make "
    "docs), its examples and its browser check",
}

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _checkout() -> str | None:
    """The checkout this bnswap runs from (the folder above the package holding bnswap's
    ``pyproject.toml``), or None when it runs from an installed copy."""
    root = os.path.dirname(_PACKAGE)
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    return root if 'name = "bnswap"' in text else None


def _installed() -> tuple[bool, dict[str, Any] | None]:
    """Whether a ``bnswap`` distribution is installed, and its ``direct_url.json``."""
    try:
        text = metadata.distribution("bnswap").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return False, None
    try:
        return True, (json.loads(text) if text else None)
    except ValueError:
        return True, None


def _local_path(url: str) -> str | None:
    parsed = urlparse(url)
    return unquote(parsed.path) if parsed.scheme == "file" else None


def install_command(extra: str) -> str | None:
    """``pip install ...`` that adds ``extra`` to this bnswap, from where it was installed
    (see the module's docstring), or None when nothing says where that was.

    Raises:
        ValueError: ``extra`` is not one of :data:`EXTRAS`.

    Examples::

        >>> from bnswap import extras
        >>> cmd = extras.install_command("lightning")
        >>> cmd is None or (cmd.startswith("pip install ") and "[lightning]" in cmd)
        True
    """
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; bnswap's extras are {', '.join(EXTRAS)}")
    installed, info = _installed()
    return command_for(extra, info, installed=installed, checkout=_checkout())


def command_for(
    extra: str,
    direct_url: dict[str, Any] | None,
    *,
    installed: bool = True,
    checkout: str | None = None,
) -> str | None:
    """The ``pip install`` of :func:`install_command` for a distribution whose
    ``direct_url.json`` (PEP 610) is ``direct_url`` (None: it has none, installed from an
    index), or for code running from the folder ``checkout``; None when not ``installed``
    and not run from a checkout, or installed from a file or folder that is gone.

    Examples::

        >>> from bnswap.extras import command_for
        >>> command_for("lightning", {"url": "https://github.com/o/bnswap.git",
        ...                           "vcs_info": {"vcs": "git", "commit_id": "7f3e1a"}})
        "pip install 'bnswap[lightning] @ git+https://github.com/o/bnswap.git@7f3e1a'"
        >>> command_for("onnx", None)
        "pip install 'bnswap[onnx]'"
    """
    url = (direct_url or {}).get("url", "")
    path = _local_path(url)
    if checkout is not None:  # running from a checkout: that folder
        same = path is not None and os.path.realpath(path) == os.path.realpath(checkout)
        editable = same and ((direct_url or {}).get("dir_info") or {}).get("editable")
        return f"pip install {'-e ' if editable else ''}{shlex.quote(f'{checkout}[{extra}]')}"
    if not installed:
        return None
    if direct_url is None:  # from an index that has bnswap
        return f"pip install {shlex.quote(f'bnswap[{extra}]')}"
    vcs = direct_url.get("vcs_info")
    if vcs is not None:  # PEP 610: the URL without the "git+" prefix; the commit pinned
        rev = vcs.get("commit_id") or vcs.get("requested_revision")
        ref = f"{vcs.get('vcs', 'git')}+{url}" + (f"@{rev}" if rev else "")
        return f"pip install {shlex.quote(f'bnswap[{extra}] @ {ref}')}"
    if path is None:  # a remote archive
        return f"pip install {shlex.quote(f'bnswap[{extra}] @ {url}')}"
    if not os.path.exists(path):  # a checkout or a file since moved or deleted
        return None
    editable = (direct_url.get("dir_info") or {}).get("editable")
    return f"pip install {'-e ' if editable else ''}{shlex.quote(f'{path}[{extra}]')}"


def install_hint(extra: str) -> str:
    """What a message about a missing extra says: :func:`install_command`'s command, or
    bnswap's extra by name and the README's Install section.

    Examples::

        >>> from bnswap import extras
        >>> "lightning" in extras.install_hint("lightning")
        True
    """
    cmd = install_command(extra)
    if cmd is not None:
        return f"{cmd} (bnswap's {extra!r} extra)"
    return (
        f"bnswap's {extra!r} extra: pip install '.[{extra}]' in a checkout of bnswap "
        "(README, Install; bnswap is not on PyPI)"
    )
