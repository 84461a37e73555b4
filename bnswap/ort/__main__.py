"""``python -m bnswap.ort build [--force]``: build ORT's C++ extension into the cache.

``python -m bnswap.ort info``: print versions, the cache folder and whether the
extension is built. Exit status 1 with a one-line reason on failure.
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bnswap.ort", description="bnswap ONNX Runtime backend tools"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile ORT's aten_op_executor extension (once)")
    b.add_argument("--force", action="store_true", help="rebuild even if it exists")
    sub.add_parser("info", help="versions, cache folder, extension status")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import bnswap.ort as ort

    if not ort.is_available():
        print(
            f"bnswap.ort: ONNX Runtime training is not installed. Install: {ort.INSTALL}",
            file=sys.stderr,
        )
        return 1
    from bnswap.ort import _build, _compat

    try:
        _compat.check_versions()
        if args.cmd == "build":
            print(ort.build(force=args.force))
        else:
            import onnxruntime
            import torch

            path = _build.extension_path()
            print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}")
            print(f"extension: {path} ({'built' if path.is_file() else 'not built'})")
    except Exception as err:  # CLI: one line, exit 1
        print(f"bnswap.ort: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
