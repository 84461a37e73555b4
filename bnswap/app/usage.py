"""The ``bnswap`` command's subcommand table and top-level help (no imports: the front
door, :mod:`bnswap.app.command`, and the Lightning subcommands, :mod:`bnswap.app.cli`,
share it)."""

from __future__ import annotations

import os
import sys

__all__ = ["EXIT_USAGE", "LIGHTNING_EXTRA", "LIGHTNING_SUBCOMMANDS", "SUBCOMMANDS", "help_text",
           "import_from_cwd"]

#: Every subcommand of the console script, with its one-line help.
SUBCOMMANDS = {
    "train": "train the configured model (Trainer.fit) and print the final validation figures",
    "validate": "run one validation epoch (Trainer.validate)",
    "test": "run one test epoch (Trainer.test)",
    "predict": "run prediction (Trainer.predict) and write the predictions to a file",
    "compare": "train each config in turn (stock vs bnswap by default), plot them "
               "(runs/compare.png, .json) and print seconds per epoch",
    "plan": "show what bnswap would swap in a model, before training (exit 3 if a layer "
            "would be skipped)",
    "convert": "convert a torch.export program file (.pt2) to the consolidated batch-norm "
               "ops: bnswap convert model.pt2 -o model_bnswap.pt2",
}

#: The subcommands that need the ``lightning`` extra.
LIGHTNING_SUBCOMMANDS = ("train", "validate", "test", "predict", "compare")

#: What ``pip`` installs for the Lightning subcommands.
LIGHTNING_EXTRA = "pip install 'bnswap[lightning]'"

EXIT_USAGE = 2


def help_text() -> str:
    width = max(map(len, SUBCOMMANDS))
    return "\n".join([
        "usage: bnswap [-h] {" + ",".join(SUBCOMMANDS) + "} ...",
        "",
        "bnswap: train with BatchNorm on PyTorch's consolidated batch-norm ops (or ONNX "
        "Runtime's), and inspect what it swaps.",
        "",
        "subcommands:",
        *(f"  {name:<{width}}  {text}" for name, text in SUBCOMMANDS.items()),
        "",
        "`bnswap SUBCOMMAND --help` lists a subcommand's options; "
        + ", ".join(LIGHTNING_SUBCOMMANDS) + f" need Lightning ({LIGHTNING_EXTRA}).",
    ])




def import_from_cwd() -> None:
    """Make the current folder importable (the user's own ``--model mymodels.Net``), as
    ``python -m`` does."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
