"""The ``bnswap`` console script's front door: the subcommand table, the help, the dispatch.

A top-level module of bnswap's wheel, outside the ``bnswap`` package on purpose: importing
anything under ``bnswap`` runs ``bnswap/__init__.py``, which imports torch (1.7 s on a
2-core machine), so a front door inside the package could not answer ``bnswap --help``
without it. This module imports the standard library only: ``bnswap --help``, a
mistyped subcommand and a mistyped option of a Lightning subcommand
(:func:`lightning_usage_error`, which reads their options from the sources) answer in
about 0.1 s (``benchmarks/startup.py``). ``bnswap plan`` / ``convert`` then import torch
and jsonargparse (:mod:`bnswap.app.plan_cli`, :mod:`bnswap.app.convert_cli`), and the
Lightning subcommands Lightning (:mod:`bnswap.app.cli`); without Lightning those print
one line naming the ``pip install`` of bnswap's ``lightning`` extra from where bnswap was
installed (:func:`bnswap.extras.install_hint`) and exit 2. The current folder is
importable for ``--model`` / ``--config`` class paths, as ``python -m`` makes it.

Not an API: users run ``bnswap`` (or ``python -m _bnswap_command``).
"""

from __future__ import annotations

import ast
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
    "lightning_options",
    "lightning_usage_error",
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


#: The options of every Trainer subcommand (train / validate / test / predict) that are
#: not parameters of the Trainer or of its method: LightningCLI's, and bnswap's own
#: ``--num_threads`` (``bnswap.app.cli.BNSwapCLI``; tests/test_cli.py checks the list
#: against the parser's).
CLI_OPTIONS = (
    "--help",
    "--config",
    "--print_config",
    "--seed_everything",
    "--trainer",
    "--model",
    "--model.help",
    "--data",
    "--data.help",
    "--optimizer",
    "--optimizer.help",
    "--lr_scheduler",
    "--lr_scheduler.help",
    "--num_threads",
)

#: Options whose value is a class: the options under them (``--model.init_args.lr``,
#: ``--data.batch_size``) are that class's, known once it is parsed.
_CLASS_OPTIONS = ("--model", "--data", "--optimizer", "--lr_scheduler")

#: Parameters of the Trainer's methods that LightningCLI does not make options (what it
#: passes itself: the model and the data).
_NOT_OPTIONS = (
    "self",
    "model",
    "train_dataloaders",
    "val_dataloaders",
    "dataloaders",
    "datamodule",
)


def _parameters(path: str, cls: str, method: str) -> list[str] | None:
    """The parameter names of ``cls.method`` in the Python file ``path``, read from its
    source (``ast``: nothing is imported), or None when the file or the method is not
    there as expected."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    a = item.args
                    if a.vararg is not None or a.kwarg is not None:
                        return None  # its options come from elsewhere
                    return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return None


def _package_dir(name: str) -> str | None:
    """Where the top-level package ``name`` is, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return locations[0] if locations else None


def lightning_options(subcommand: str) -> list[str] | None:
    """The options ``bnswap SUBCOMMAND`` (train / validate / test / predict) takes, as
    LightningCLI builds them, read without importing Lightning (about 7 s on 2 cores, most
    of a usage error's time before, issue 46): :data:`CLI_OPTIONS`, ``--trainer.NAME`` for
    each parameter of Lightning's ``Trainer.__init__`` and ``--NAME`` for each of the
    subcommand's method (bnswap's ``Trainer.train``, Lightning's ``validate`` / ``test`` /
    ``predict``), read from their source files. None when a source is not where this
    expects it (another Lightning layout): the full parser then answers."""
    lightning, bnswap = _package_dir("lightning"), _package_dir("bnswap")
    if lightning is None or bnswap is None:
        return None
    trainer = os.path.join(lightning, "pytorch", "trainer", "trainer.py")
    init = _parameters(trainer, "Trainer", "__init__")
    method = (
        _parameters(os.path.join(bnswap, "app", "cli.py"), "Trainer", "train")
        if subcommand == "train"
        else _parameters(trainer, "Trainer", subcommand)
    )
    if init is None or method is None:
        return None
    return [
        *CLI_OPTIONS,
        *(f"--trainer.{p}" for p in init if p != "self"),
        *(f"--{p}" for p in method if p not in _NOT_OPTIONS),
    ]


def _config_error(args: Sequence[str]) -> str | None:
    """The full parser's error for ``--config X.yaml`` that is neither a file nor one of
    bnswap's shipped configs (``config: File does not exist: '/abs/X.yaml'``), or None.
    Only a value that names a YAML / JSON file is judged (``--config`` also takes a
    config's text)."""
    for i, a in enumerate(args):
        value = args[i + 1] if a == "--config" and i + 1 < len(args) else None
        if a.startswith("--config="):
            value = a.split("=", 1)[1]
        if value is None or not value.endswith((".yaml", ".yml", ".json")):
            continue
        if os.path.isfile(value):
            continue
        bnswap = _package_dir("bnswap")
        shipped = os.path.join(bnswap or "", "app", "configs", os.path.basename(value))
        if bnswap is None or os.path.isfile(shipped):
            continue
        return f"config: File does not exist: {os.path.abspath(value)!r}"
    return None


def lightning_usage_error(subcommand: str, args: Sequence[str]) -> str | None:
    """The usage error for the first option of ``args`` that ``bnswap SUBCOMMAND`` does
    not take (``unknown option '--trainer.max_epochz'; did you mean
    '--trainer.max_epochs'?``, the full parser's words), found before Lightning is
    imported, or for a ``--config`` file that is not there, or for no argument at all
    (``missing --data, --model``); None when every option is known, or may be (one
    under a class-valued option: ``--model.init_args.lr``, ``--trainer.callbacks.backend``,
    which the full parser checks; the start of an option's name, which argparse expands:
    ``--num_thread``), or the options cannot be read (:func:`lightning_options`). ``compare`` checks
    the train options it passes on (``--trainer.*``, ``--seed_everything``) against
    ``train``'s. In the parser's order (a config, then an unknown option; what is missing
    only when nothing is given, as the parser first reads any option given), but before
    anything is imported: where ``--model`` / ``--data`` names a
    class that cannot be imported and an option is mistyped, the option is said first
    (the parser said the class)."""
    compare = subcommand == "compare"
    if compare:
        args = [a for a in args if a.startswith(("--trainer.", "--seed_everything"))]
        subcommand = "train"
    options = lightning_options(subcommand)
    if options is None:
        return None
    # in the full parser's order: a config it cannot read, an unknown option, then what
    # is missing
    error = _config_error(args) or _unknown_option(args, options)
    if error is None and not compare and not args:  # (any option given is read first)
        error = "missing --data, --model (a config gives them: --config digits_mobilenetv2.yaml)"
    return error


def _unknown_option(args: Sequence[str], options: list[str]) -> str | None:
    """The first option of ``args`` that is none of ``options`` (see
    :func:`lightning_usage_error`), as the parser says it, or None."""
    known = set(options)
    for a in args:
        if a == "--":  # (what follows is no option)
            return None
        if not a.startswith("--"):
            continue
        name = a.split("=", 1)[0].rstrip("+")  # (--trainer.callbacks+=... appends)
        if name in known or name.startswith(tuple(o + "." for o in _CLASS_OPTIONS)):
            continue
        if name.startswith("--trainer.") and name.count(".") > 1:
            continue  # inside a Trainer argument's own class (--trainer.logger.save_dir)
        if any(o.startswith(name) for o in options):
            continue  # an abbreviation argparse expands (--num_thread), or refuses as ambiguous
        close = difflib.get_close_matches(name, options, n=1)
        return f"unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
    return None


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
    """Console entry point: ``plan`` goes to :mod:`bnswap.app.plan_cli`, ``convert`` to
    :mod:`bnswap.app.convert_cli`, the Lightning subcommands to
    :func:`bnswap.app.cli.run_lightning_subcommand`.

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
        from bnswap.app import convert_cli

        sys.exit(convert_cli.convert_main(args[1:]))
    missing = _missing_for_the_job()
    error = lightning_usage_error(args[0], args[1:]) if missing is None else None
    if error is not None:  # a mistyped option, said before Lightning is imported
        prog = f"bnswap {args[0]}"
        print(f"{prog}: error: {error}\n({prog} --help lists every option)", file=sys.stderr)
        sys.exit(EXIT_USAGE)
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
