"""The ``bnswap train`` configs shipped with bnswap (LightningCLI YAML).

``configs/`` at the repository root links to these files. A ``--config`` value that is
not an existing path but the name of one of them (``digits_mobilenetv2.yaml``, or
without ``.yaml``) is read from here, so ``bnswap train`` / ``compare`` / ``plan`` work
from any folder.

* ``digits_mobilenetv2.yaml``: the main job (MobileNetV2-style net on scikit-learn's
  digits, the BNSwap callback, backend aten);
* ``digits_mobilenetv2_stock.yaml``: the same run on stock BatchNorm;
* ``digits_mobilenetv2_ort.yaml``: the same run on the ONNX Runtime backend.
"""

from __future__ import annotations

import os
from importlib import resources

__all__ = ["NAMES", "path", "resolve"]

#: The shipped configs' file names.
NAMES = ("digits_mobilenetv2.yaml", "digits_mobilenetv2_stock.yaml", "digits_mobilenetv2_ort.yaml")


def path(name: str) -> str:
    """The file of the shipped config ``name`` (``.yaml`` optional).

    Raises:
        FileNotFoundError: no shipped config has that name (the message lists them).
    """
    base = os.path.basename(name)
    candidates = [base] if base.endswith((".yaml", ".yml")) else [base + ".yaml"]
    for c in candidates:
        ref = resources.files(__name__) / c
        if ref.is_file():
            return str(ref)
    raise FileNotFoundError(
        f"no config {name!r}: not a file here, and not one of bnswap's ({', '.join(NAMES)})"
    )


def resolve(value: str) -> str:
    """``value`` if it is an existing file, else the shipped config of that name.

    Examples::

        >>> from bnswap.app import configs
        >>> configs.resolve("digits_mobilenetv2").endswith("digits_mobilenetv2.yaml")
        True
    """
    if os.path.isfile(value):
        return value
    return path(value)
