"""``bnswap convert``: a ``torch.export`` program file converted to the consolidated ops.

    bnswap convert model.pt2 -o model_bnswap.pt2 [--include P | '[P, ...]'] [--exclude P ...]

Loads the program (:func:`load_program`, which ``bnswap plan --program`` uses too),
applies :func:`bnswap.convert`, writes it with ``torch.export.save`` and prints the
plan (:func:`bnswap.app.plan_output.render`). Exit status: 0 when every batch-norm node
is converted or left out on purpose (``--include`` / ``--exclude``), 3 when bnswap
leaves one it cannot convert, 2 on usage errors (:func:`convert_main`).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from argparse import ArgumentError
from collections.abc import Sequence

import torch
from jsonargparse import ArgumentParser

import bnswap
from bnswap.app.messages import long_options, pattern_error, short_error, unrecognized_error
from bnswap.app.plan_output import exit_status, print_warnings, render, usage_error

__all__ = [
    "NO_SYNC_FOR_PROGRAMS",
    "TORCHAO_NOTE",
    "ProgramFileError",
    "convert_main",
    "load_program",
]

#: What ``bnswap convert`` says after writing a program on the consolidated ops: torchao's
#: pt2e flow (conv-BN fold, eval switch) sees them only where bnswap's patches are applied.
TORCHAO_NOTE = (
    "for torchao's pt2e quantization, call bnswap.convert(program) in the process that "
    "loads it, before prepare_pt2e / prepare_qat_pt2e (the guide 'pt2e quantization-aware "
    "training')"
)


#: Why ``--sync_batchnorm`` takes no program (``bnswap plan --program``, ``bnswap convert``).
NO_SYNC_FOR_PROGRAMS = (
    "--sync_batchnorm converts a model's BatchNorm layers; a program's "
    "batch-norm nodes have no process group (convert the model with "
    "sync_batchnorm=True, then export it)"
)


#: torch.export.load's pointer to the warnings it logged (silenced here: the traceback of
#: its zip reader), which the one-line error would point to in vain
_NO_WARNINGS_ABOVE = re.compile(
    r"\s*Please check the warnings above for possible errors\.?", re.IGNORECASE
)


class ProgramFileError(ValueError):
    """A file that is no ``torch.export`` program (the message is one line)."""


def load_program(path: str) -> torch.export.ExportedProgram:
    """``torch.export.load(path)``; a missing file or one that is no program raises
    :class:`ProgramFileError` with one line naming the file and the reason."""
    if os.path.isdir(path):
        raise ProgramFileError(f"{path}: is a folder, not a program file (.pt2)")
    if not os.path.isfile(path):
        raise ProgramFileError(f"{path}: no such file")
    quiet = logging.getLogger("torch.export")  # it logs the traceback it then raises
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        return torch.export.load(path)
    except Exception as e:  # torch raises many kinds for a foreign file
        first = _NO_WARNINGS_ABOVE.sub("", (str(e).strip().splitlines() or [""])[0])[:160]
        raise ProgramFileError(
            f"{path}: not a torch.export program (torch.export.load: "
            f"{type(e).__name__}{': ' + first if first else ''})"
        ) from None
    finally:
        quiet.setLevel(level)


def _convert_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="bnswap convert",
        exit_on_error=False,
        description="Convert a torch.export program file so that its batch-norm nodes run "
        "what a swapped layer runs (PyTorch's consolidated ops in training, stock's "
        "aten.batch_norm in evaluation: kernels selected when they run); prints the "
        "plan. Exit "
        "status 0: every node converted or excluded on purpose (--include / "
        "--exclude); 3: some left as they were that bnswap cannot convert; 2: "
        "usage error.",
    )
    p.add_argument("program", type=str, help="the program (torch.export.save, .pt2)")
    p.add_argument(
        "-o",
        "--output",
        type=str,
        required=True,
        help="where to write the converted program (.pt2)",
    )
    p.add_argument(
        "--include",
        type=str | list[str] | None,
        default=None,
        help="a glob pattern on node names to convert, or a list of them (default: all)",
    )
    p.add_argument(
        "--exclude",
        type=str | list[str] | None,
        default=None,
        help="a glob pattern on node names to leave as they are, or a list of them",
    )
    return p


_REQUIRED = "the following arguments are required: "
#: how argparse names convert's arguments -> how they are typed
_CONVERT_SPELLING = {
    "program": "the program to convert (a .pt2 file)",
    "output": "-o/--output (where to write the converted program)",
}
_CONVERT_EXAMPLE = "bnswap convert model.pt2 -o model_bnswap.pt2"


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one existing file, however spelled (``./m.pt2``,
    a symbolic or hard link): :func:`os.path.samefile`. An ``output`` that does not exist
    yet is never the input."""
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def convert_main(argv: Sequence[str]) -> int:
    """Run ``bnswap convert PROGRAM -o OUTPUT`` with ``argv`` (the arguments after
    ``convert``): load, :func:`bnswap.convert`, ``torch.export.save``, print the plan.
    Returns the exit status (0 all converted or left out by the patterns, 3 some left
    that bnswap cannot convert (:func:`exit_status`), 2 usage errors on stderr: a
    missing PROGRAM or ``-o/--output`` (named, with an example), an ``-o`` that is the
    input file (refused before anything is read: never overwritten), a missing folder
    for the output (refused before the program is loaded), a file that is no program)."""
    try:
        if "--sync_batchnorm" in argv or any(a.startswith("--sync_batchnorm=") for a in argv):
            return usage_error(NO_SYNC_FOR_PROGRAMS, "convert")
        cfg = _convert_parser().parse_args(list(argv))
    except SystemExit as e:  # --help (0)
        return int(e.code or 0)
    except ArgumentError as e:
        if str(e).startswith(_REQUIRED):  # name them as typed, with an example
            missing = [
                _CONVERT_SPELLING.get(n.strip(), n.strip())
                for n in str(e)[len(_REQUIRED) :].split(",")
            ]
            return usage_error(
                f"missing {' and '.join(missing)}; e.g. {_CONVERT_EXAMPLE}", "convert"
            )
        text = unrecognized_error(str(e), long_options(_convert_parser())) or short_error(str(e))
        return usage_error(f"{text}\n(bnswap convert --help lists every option)", "convert")
    if (error := pattern_error(cfg)) is not None:
        return usage_error(f"{error}\n(bnswap convert --help lists every option)", "convert")
    if _same_file(cfg.program, cfg.output):
        return usage_error(
            f"-o/--output {cfg.output} is the input program ({cfg.program}): "
            "bnswap convert never overwrites its input; write to another "
            "file, e.g. -o model_bnswap.pt2",
            "convert",
        )
    if os.path.isdir(cfg.output):
        return usage_error(
            f"-o/--output {cfg.output} is a folder; give a file name, e.g. "
            f"-o {os.path.join(cfg.output, 'model_bnswap.pt2')}",
            "convert",
        )
    parent = os.path.dirname(os.path.abspath(cfg.output))
    if not os.path.isdir(parent):  # before the program is loaded (a large file: seconds);
        # torch.export.save raised a RuntimeError with a traceback here
        return usage_error(
            f"{cfg.output}: no such folder: {os.path.dirname(cfg.output)}", "convert"
        )
    try:
        ep = load_program(cfg.program)
    except ProgramFileError as e:
        return usage_error(str(e), "convert")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = bnswap.plan(ep, include=cfg.include, exclude=cfg.exclude)
        new = plan.apply()
    assert isinstance(new, torch.export.ExportedProgram)  # as ep is
    # bnswap's own (no batch-norm node, a pattern that matches none), each once: plan and
    # apply (which plans again) both warn of a pattern that matches nothing
    print_warnings([w for w in caught if str(w.message).startswith("bnswap")], "convert")
    try:
        torch.export.save(new, cfg.output)
    except OSError as e:
        return usage_error(f"{cfg.output}: {e.strerror or e}", "convert")
    except RuntimeError as e:  # torch's zip writer: a place that cannot be written
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return usage_error(f"{cfg.output}: cannot be written ({reason[:160]})", "convert")
    note = f"wrote {cfg.output}"
    if plan.swapped:  # its nodes are bnswap's: torchao's pt2e flow needs bnswap to see it
        note += "\n" + TORCHAO_NOTE
    table = render(plan, "table", note)  # named for the command that ran
    print(re.sub(r"^bnswap:", "bnswap convert:", table, count=1))  # (an applied plan's)
    return exit_status(plan)
