"""The ``bnswap`` console script's front door: the subcommand table and the dispatch.

It imports neither Lightning nor torch: ``bnswap --help`` answers at once, ``bnswap
plan`` imports torch and jsonargparse only (:mod:`bnswap.app.plan_cli`), and the
Lightning subcommands (:mod:`bnswap.app.cli`) import Lightning when run; without it they
print one line naming ``pip install 'bnswap[lightning]'`` and exit 2. The current folder
is importable for ``--model`` / ``--config`` class paths, as ``python -m`` makes it.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Sequence

from bnswap.app.usage import (
    EXIT_USAGE,
    LIGHTNING_EXTRA,
    SUBCOMMANDS,
    help_text,
    import_from_cwd,
)

__all__ = ["main"]

def _has_lightning() -> bool:
    return (importlib.util.find_spec("lightning") is not None
            or importlib.util.find_spec("pytorch_lightning") is not None)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: ``plan`` goes to :mod:`bnswap.app.plan_cli`, the Lightning
    subcommands to :func:`bnswap.app.cli.main`.

    Exits with status 2 on usage errors (an unknown subcommand, none, a Lightning
    subcommand without Lightning installed)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # as argparse does for a missing subcommand: usage error
        print(help_text(), file=sys.stderr)
        sys.exit(EXIT_USAGE)
    if args[0] in ("-h", "--help"):
        print(help_text())
        return
    if args[0] not in SUBCOMMANDS:
        print(help_text(), file=sys.stderr)
        print(f"\nbnswap: error: unknown subcommand {args[0]!r}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    import_from_cwd()  # the user's own modules (`--model mymodels.Net`)
    if args[0] == "plan":
        from bnswap.app import plan_cli

        sys.exit(plan_cli.main(args[1:]))
    if args[0] == "convert":
        from bnswap.app import plan_cli

        sys.exit(plan_cli.convert_main(args[1:]))
    if not _has_lightning():
        print(f"bnswap {args[0]}: error: needs Lightning, which is not installed: "
              f"{LIGHTNING_EXTRA}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    # Lightning 2.6 on torch 2.13 warns on every batch about torch's own pytree API.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    from bnswap.app import cli

    cli.main(args if argv is not None else None)


if __name__ == "__main__":  # pragma: no cover
    main()
