"""The ``bnswap`` console script's front door: the subcommand table, the help, the dispatch.

A top-level module of bnswap's wheel, outside the ``bnswap`` package on purpose: importing
anything under ``bnswap`` runs ``bnswap/__init__.py``, which imports torch (1.7 s on a
2-core machine), so a front door inside the package could not answer ``bnswap --help``
without it. This module imports the standard library only: ``bnswap --help`` and a
mistyped subcommand answer in about 0.1 s (``benchmarks/startup.py``). ``bnswap plan`` /
``convert`` then import torch and jsonargparse (:mod:`bnswap.app.plan_cli`), and the
Lightning subcommands Lightning (:mod:`bnswap.app.cli`); without Lightning those print
one line naming the ``pip install`` of bnswap's ``lightning`` extra from where bnswap was
installed (:func:`bnswap.extras.install_hint`) and exit 2. The current folder is
importable for ``--model`` / ``--config`` class paths, as ``python -m`` makes it.

Not an API: users run ``bnswap`` (or ``python -m _bnswap_command``).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence

__all__ = [
    "EXIT_USAGE",
    "LIGHTNING_EXTRA",
    "LIGHTNING_SUBCOMMANDS",
    "OPTIONS",
    "SUBCOMMANDS",
    "help_text",
    "import_from_cwd",
    "main",
    "unknown_subcommand",
    "usage_line",
]

#: Every subcommand of the console script, with its one-line help.
SUBCOMMANDS = {
    "train": "train the configured model (Trainer.fit) and print the final validation figures",
    "validate": "run one validation epoch (Trainer.validate)",
    "test": "run one test epoch (Trainer.test)",
    "predict": "run prediction (Trainer.predict) and write the predictions to a file",
    "compare": "train each config in turn (stock vs bnswap by default), plot them "
    "(runs/compare.png, .json) and print seconds per epoch",
    "plan": "show what bnswap would swap in a model, before training (exit 3 if a layer "
    "would be skipped that was not excluded)",
    "convert": "convert a torch.export program file (.pt2) to the consolidated batch-norm "
    "ops: bnswap convert model.pt2 -o model_bnswap.pt2",
}

#: The options ``bnswap`` takes before a subcommand.
OPTIONS = ("--help", "--version", "-h", "-V")

#: The subcommands that need the ``lightning`` extra.
LIGHTNING_SUBCOMMANDS = ("train", "validate", "test", "predict", "compare")

#: What the Lightning subcommands need, in ``--help`` (which imports no torch; the command
#: for this installation, :func:`bnswap.extras.install_hint`, comes with the error).
LIGHTNING_EXTRA = "bnswap's 'lightning' extra: README, Install"

EXIT_USAGE = 2


def help_text() -> str:
    """``bnswap --help``: the usage line and one line per subcommand."""
    width = max(map(len, SUBCOMMANDS))
    return "\n".join(
        [
            usage_line(),
            "",
            "bnswap: train with BatchNorm on PyTorch's consolidated batch-norm ops (or ONNX "
            "Runtime's), and inspect what it swaps.",
            "",
            "subcommands:",
            *(f"  {name:<{width}}  {text}" for name, text in SUBCOMMANDS.items()),
            "",
            "`bnswap SUBCOMMAND --help` lists a subcommand's options, `bnswap --version` the "
            "version; "
            + ", ".join(LIGHTNING_SUBCOMMANDS)
            + f" need Lightning ({LIGHTNING_EXTRA}).",
        ]
    )


def usage_line() -> str:
    """The first line of ``bnswap --help`` (argparse's ``usage:``)."""
    return "usage: bnswap [-h] [-V] {" + ",".join(SUBCOMMANDS) + "} ..."


def unknown_subcommand(name: str) -> str:
    """The error for ``bnswap NAME`` with no such subcommand: the closest one
    (:func:`difflib.get_close_matches`, as argparse does from Python 3.12 and git does),
    else the choices; for an unknown option (``--verison``) the closest of ``--help`` /
    ``--version``.

    Examples::

        >>> unknown_subcommand("plann")
        "bnswap: error: unknown subcommand 'plann'; did you mean 'plan'?"
        >>> unknown_subcommand("--verison")
        "bnswap: error: unknown option '--verison'; did you mean '--version'?"
        >>> unknown_subcommand("nope")
        "bnswap: error: unknown subcommand 'nope' (choose from train, validate, test, \
predict, compare, plan, convert)"
    """
    if name.startswith("-"):  # an option before any subcommand: --help or --version
        close = difflib.get_close_matches(name.lower(), OPTIONS, n=1)
        if close:
            return f"bnswap: error: unknown option {name!r}; did you mean {close[0]!r}?"
        return (
            f"bnswap: error: unknown option {name!r} (bnswap takes -h/--help, "
            f"-V/--version or a subcommand: {', '.join(SUBCOMMANDS)})"
        )
    close = difflib.get_close_matches(name.lower(), SUBCOMMANDS, n=1)
    if close:
        return f"bnswap: error: unknown subcommand {name!r}; did you mean {close[0]!r}?"
    return f"bnswap: error: unknown subcommand {name!r} (choose from {', '.join(SUBCOMMANDS)})"


def import_from_cwd() -> None:
    """Make the current folder importable (the user's own ``--model mymodels.Net``), as
    ``python -m`` does."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _version() -> str:
    """bnswap's installed version (its distribution's metadata: no import of the package)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bnswap")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


def _has_lightning() -> bool:
    return (
        importlib.util.find_spec("lightning") is not None
        or importlib.util.find_spec("pytorch_lightning") is not None
    )


def _missing_for_the_job() -> str | None:
    """What the Lightning subcommands need and this environment lacks (both come with
    the lightning extra): ``"Lightning"``, ``"scikit-learn (the digits data)"``, or
    None."""
    if not _has_lightning():
        return "Lightning"
    if importlib.util.find_spec("sklearn") is None:  # the main job's data
        return "scikit-learn (the main job's digits data)"
    return None


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: ``plan`` / ``convert`` go to :mod:`bnswap.app.plan_cli`, the
    Lightning subcommands to :func:`bnswap.app.cli.run_lightning_subcommand`.

    Exits with status 2 on usage errors (an unknown subcommand: the usage line and a
    "did you mean"; none: the help; a Lightning subcommand without Lightning
    installed)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # as argparse does for a missing subcommand: usage error
        print(help_text(), file=sys.stderr)
        sys.exit(EXIT_USAGE)
    if args[0] in ("-h", "--help"):
        print(help_text())
        return
    if args[0] in ("-V", "--version"):
        print(f"bnswap {_version()}")
        return
    if args[0] not in SUBCOMMANDS:  # argparse's two lines: the usage, the error
        print(f"{usage_line()}\n{unknown_subcommand(args[0])}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    import_from_cwd()  # the user's own modules (`--model mymodels.Net`)
    # torch built with NumPy support, imported where NumPy is not installed (bnswap needs
    # none), warns on every run; plan and convert use no NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    if args[0] == "plan":
        from bnswap.app import plan_cli

        sys.exit(plan_cli.main(args[1:]))
    if args[0] == "convert":
        from bnswap.app import plan_cli

        sys.exit(plan_cli.convert_main(args[1:]))
    missing = _missing_for_the_job()
    if missing is not None:
        from bnswap.extras import install_hint  # (imports torch: on this error only)

        print(
            f"bnswap {args[0]}: error: needs {missing}, which is not installed: "
            f"{install_hint('lightning')}",
            file=sys.stderr,
        )
        sys.exit(EXIT_USAGE)
    from bnswap.app import cli

    cli.run_lightning_subcommand(args, from_sys_argv=argv is None)


if __name__ == "__main__":  # pragma: no cover
    main()
