"""Build ONNX Runtime training's ``aten_op_executor`` C++ extension into a user cache.

ORTModule (onnxruntime-training 1.19.2) needs the PyTorch C++ extension
``aten_op_executor`` (it dispatches ``com.microsoft::ATen`` nodes back to PyTorch and is
loaded by every graph execution manager). Upstream builds it *into site-packages* with
``python -m torch_ort.configure``; here it is compiled once per (torch, ORT, Python)
triple into::

    $BNSWAP_CACHE_DIR/ort-ext/<torch>-<ort>-<cpython tag>/aten_op_executor<EXT_SUFFIX>

(``$BNSWAP_CACHE_DIR`` defaults to ``$XDG_CACHE_HOME/bnswap``, then
``~/.cache/bnswap``) and loaded from there under ORT's import name by
:mod:`bnswap.ort._compat`. The source file is the one shipped in the installed
onnxruntime-training wheel; nothing third-party is vendored.

The compile is a single ``c++`` call (no ninja, no setuptools) with the flags
``torch.utils.cpp_extension`` uses, about a minute on two cores, logged on the
``bnswap.ort`` logger and streamed to stderr. Concurrent builders wait on a file lock;
the library is written under a temporary name and renamed, so a half-built file is
never loaded. The other ORT extension, ``torch_interop_utils`` (custom
``autograd.Function`` support), does not compile against torch >= 2.13 and is not
built: :mod:`bnswap.ort._compat` turns that feature off.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bnswap import _log
from bnswap.ort.errors import BuildError

logger = logging.getLogger("bnswap.ort")

__all__ = ["EXTENSION", "BuildError", "cache_dir", "ensure_extension", "extension_path"]

EXTENSION = "aten_op_executor"


def _versions() -> tuple[str, str]:
    import onnxruntime
    import torch

    return torch.__version__, onnxruntime.__version__


def cache_dir() -> Path:
    """Folder holding the built extension for the installed torch / ORT / Python.

    ``$BNSWAP_CACHE_DIR`` (else ``$XDG_CACHE_HOME/bnswap``, else ``~/.cache/bnswap``)
    ``/ort-ext/<torch version>-<ort version>-<cpython tag>``, made absolute (a relative
    ``$BNSWAP_CACHE_DIR`` is taken from the current directory at the call).
    """
    root = os.environ.get("BNSWAP_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "bnswap")
    tv, ov = _versions()
    tag = sys.implementation.cache_tag or f"py{sys.version_info[0]}{sys.version_info[1]}"
    return Path(root).absolute() / "ort-ext" / f"{tv}-{ov}-{tag}".replace("+", "_")


def extension_path() -> Path:
    """Where the built ``aten_op_executor`` shared library lives (may not exist yet)."""
    return cache_dir() / (EXTENSION + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def _source() -> Path:
    import onnxruntime

    src = (
        Path(onnxruntime.__file__).parent
        / "training/ortmodule/torch_cpp_extensions/cpu/aten_op_executor/aten_op_executor.cc"
    )
    if not src.is_file():
        raise BuildError(
            f"{src} is missing: the installed onnxruntime package is not a training build. "
            "Install it with: pip install onnxruntime-training-cpu==1.19.2"
        )
    return src


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    found = shutil.which(cxx)
    if found is None:
        raise BuildError(
            f"No C++ compiler found (looked for {cxx!r} on PATH; set CXX to override). "
            "bnswap's ONNX Runtime backend compiles ORT's aten_op_executor extension once "
            "against the installed torch. Install a compiler, e.g. `apt-get install g++` "
            "(Debian/Ubuntu), then run `python -m bnswap.ort build`."
        )
    return found


def _command(src: Path, out: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    cmd = [_compiler(), "-shared", "-fPIC", "-O2", "-std=c++20", "-w"]
    cmd += [f"-DTORCH_EXTENSION_NAME={EXTENSION}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for inc in cpp_extension.include_paths():
        cmd += ["-isystem", inc]
    cmd += ["-isystem", sysconfig.get_paths()["include"]]
    cmd += [str(src), "-o", str(out)]
    for lib in cpp_extension.library_paths():
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    cmd += ["-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
    return cmd


#: Seconds between two progress lines while the compiler runs.
PROGRESS_EVERY = 10.0


@contextlib.contextmanager
def _progress(t0: float, every: float | None = None) -> Iterator[None]:
    """While the block runs, write the elapsed time to stderr every ``every`` seconds
    (on one updated line when stderr is a terminal): the compile prints nothing itself
    (``-w``) for 30 to 90 s."""
    every = PROGRESS_EVERY if every is None else every
    stop = threading.Event()
    tty = sys.stderr.isatty()

    def beat() -> None:
        while not stop.wait(every):
            text = f"bnswap.ort: compiling {EXTENSION}... {time.monotonic() - t0:.0f} s"
            sys.stderr.write(("\r" + text) if tty else text + "\n")
            sys.stderr.flush()

    thread = threading.Thread(target=beat, name="bnswap-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if tty:
            sys.stderr.write("\n")


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_extension(*, force: bool = False) -> Path:
    """Return the path of the built ``aten_op_executor``, compiling it first if needed.

    Args:
        force: rebuild even if the library exists.

    Returns:
        Path of the shared library (see :func:`extension_path`).

    Raises:
        BuildError: no C++ compiler on PATH, ORT is not a training build, or the
            compile failed (the compiler's output is in the message and on stderr).
    """
    out = extension_path()
    if out.is_file() and not force:
        return out
    src = _source()
    with _locked(out.parent):
        if out.is_file() and not force:
            return out  # another process built it while we waited
        cmd = _command(src, out.with_name(out.name + ".tmp"))
        tv, ov = _versions()
        logger.warning(
            "bnswap.ort: building ONNX Runtime's %s extension for torch %s / onnxruntime %s "
            "into %s (one time, about a minute on 2 cores)...",
            EXTENSION,
            tv,
            ov,
            out.parent,
        )
        _log.info(logger, "bnswap.ort: %s", shlex.join(cmd))  # (once per job)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        lines = []
        with _progress(t0):
            for line in proc.stdout:
                lines.append(line)
                sys.stderr.write(line)
        if proc.wait() != 0:
            raise BuildError(
                f"Compiling {EXTENSION} failed (exit {proc.returncode}):\n"
                f"$ {shlex.join(cmd)}\n{''.join(lines[-40:])}"
            )
        os.replace(out.with_name(out.name + ".tmp"), out)
        logger.warning("bnswap.ort: built %s in %.0f s", out, time.monotonic() - t0)
    return out
