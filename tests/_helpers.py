"""The test suite's shared helpers: stock-vs-bnswap pairs, one step on both, state
comparisons, subprocess runs.

Every comparison is against stock ``torch.nn`` BatchNorm on an identical deepcopy.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import bnswap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: This torch's (major, minor), for tests whose stock reference changed between releases
#: (``make compat`` runs the core suite on the oldest supported release and newer ones).
TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def swapped_copy(model: nn.Module) -> nn.Module:
    """A converted deepcopy of ``model`` (``model`` is left stock)."""
    out = copy.deepcopy(model)
    bnswap.convert(out)
    return out


def pair(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(stock model, converted deepcopy): identical state; only the copy is swapped."""
    return model, swapped_copy(model)


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", value) or ("err", (exception type, message))."""
    try:
        return "ok", fn()
    except Exception as e:  # we compare whatever is raised
        return "err", (type(e), str(e))


def same_tensor(
    a: torch.Tensor | None, b: torch.Tensor | None, exact: bool = True, **tol: float
) -> bool:
    """Bitwise (NaN at the same places counts as equal) or allclose, same dtype and shape."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a == b if type(a) is type(b) else False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if exact:
        if a.is_floating_point() or a.is_complex():
            an, bn = a.isnan(), b.isnan()
            return torch.equal(an, bn) and torch.equal(a[~an], b[~bn])
        return torch.equal(a, b)
    return torch.allclose(a.double(), b.double(), equal_nan=True, **tol)


def _copy(t: torch.Tensor | None) -> torch.Tensor | str | None:
    if t is None:
        return None
    if isinstance(t, nn.parameter.UninitializedTensorMixin):
        return "uninitialized"  # a lazy layer's placeholder has no data
    return t.detach().clone()


def state_of(m: nn.Module) -> dict[str, torch.Tensor | str | None]:
    """Parameters, buffers (None ones included), and parameter grads, cloned."""
    out: dict[str, torch.Tensor | str | None] = {}
    for mod_name, mod in m.named_modules(remove_duplicate=False):
        pre = mod_name + "." if mod_name else ""
        for k, v in mod._buffers.items():
            out[pre + k] = _copy(v)
        for k, p in mod._parameters.items():
            out[pre + k] = _copy(p)
            lazy = isinstance(p, nn.parameter.UninitializedTensorMixin)
            g = None if p is None or lazy else p.grad
            out[pre + k + ".grad"] = _copy(g)
    return out


def state_diff(a: nn.Module, b: nn.Module, exact: bool = True, **tol: float) -> list[str]:
    """Names whose tensors differ between two models (empty: identical)."""
    sa, sb = state_of(a), state_of(b)
    if sa.keys() != sb.keys():
        return [f"keys: {sorted(sa.keys() ^ sb.keys())}"]
    return [k for k in sa if not same_tensor(sa[k], sb[k], exact, **tol)]


def stats_have_nan(m: nn.Module) -> bool:
    return any(
        b is not None and b.is_floating_point() and bool(b.isnan().any()) for b in m.buffers()
    )


def run_script(code: str, timeout: float = 120) -> tuple[int, str, str]:
    """Run ``code`` in a fresh interpreter (anything that could kill the process).

    Returns (returncode, stdout, stderr). A negative returncode is a signal (crash).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    return proc.returncode, proc.stdout, proc.stderr


def train_then_eval(model: nn.Module, xs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A train step's output on ``xs[0]`` (backward of its sum), then an eval output on
    ``xs[1]``; with every gradient and the state_dict after. Needs torch only: its source
    also runs where bnswap cannot be imported (:func:`run_where_bnswap_cannot_be_imported`)."""
    model.train()
    y0 = model(xs[0])
    y0.sum().backward()
    model.eval()
    return {
        "y0": y0.detach(),
        "y1": model(xs[1]).detach(),
        **{f"grad.{k}": p.grad for k, p in model.named_parameters()},
        **{f"state.{k}": v for k, v in model.state_dict().items()},
    }


#: The first lines of a fresh interpreter's script where importing bnswap fails, as where
#: it is not installed (a program or checkpoint bnswap wrote must need none of it).
BLOCK_BNSWAP = textwrap.dedent(
    """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "bnswap" or name.startswith("bnswap."):
                raise ImportError("bnswap is blocked in this interpreter")
    sys.meta_path.insert(0, Block())
    sys.modules["bnswap"] = None
    """
)


def run_where_bnswap_cannot_be_imported(
    model_file: Any, xs: list[torch.Tensor], tmp_path: Any
) -> dict[str, torch.Tensor]:
    """``torch.load(model_file, weights_only=False)`` in a fresh interpreter where importing
    bnswap fails, then :func:`train_then_eval` there on ``xs``; returns its results (issue
    32: a whole-model checkpoint needs no bnswap). Asserts that the load imported nothing
    of bnswap's and that ``import bnswap`` fails there."""
    import inspect

    torch.save(xs, os.path.join(tmp_path, "inputs.pt"))
    got_file = os.path.join(tmp_path, "got.pt")
    code = (
        textwrap.indent(BLOCK_BNSWAP, " " * 8)
        + f"""
        import torch
        from torch import nn
        model = torch.load({str(model_file)!r}, weights_only=False)
        xs = torch.load({os.path.join(tmp_path, "inputs.pt")!r})
        assert not any(k.startswith("bnswap") for k in sys.modules if sys.modules[k])
"""
        + textwrap.indent(inspect.getsource(train_then_eval), " " * 8)
        + f"""
        torch.save(train_then_eval(model, xs), {got_file!r})
        try:
            import bnswap
        except ImportError as e:
            print("blocked:", type(e).__name__)
    """
    )
    rc, out, err = run_script(code, timeout=180)
    assert rc == 0, err[-3000:]
    assert "blocked: ModuleNotFoundError" in out or "blocked: ImportError" in out, out
    return torch.load(got_file)


def json_lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def step(stock: nn.Module, swapped: nn.Module, x: torch.Tensor, grad_seed: int = 1):
    """One forward+backward on identical inputs; returns (y1, y2, gx1, gx2)."""
    x1 = x.detach().clone().requires_grad_(x.is_floating_point())
    x2 = x.detach().clone().requires_grad_(x.is_floating_point())
    y1, y2 = stock(x1), swapped(x2)
    g = torch.randn(y1.shape, generator=torch.Generator().manual_seed(grad_seed)).to(y1.dtype)
    if y1.requires_grad:
        y1.backward(g)
        y2.backward(g)
    return y1, y2, x1.grad, x2.grad


def assert_state_equal(a: nn.Module, b: nn.Module, exact: bool = True, **tol) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if exact:
            assert torch.equal(sa[k], sb[k]), k
        else:
            torch.testing.assert_close(sa[k], sb[k], **tol, msg=k)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb
        if pa.grad is None:
            assert pb.grad is None, na
        elif exact:
            assert torch.equal(pa.grad, pb.grad), na
        else:
            torch.testing.assert_close(pa.grad, pb.grad, **tol, msg=na)


#: How long a rank of the tests' process groups waits in one collective (or for its
#: peers to join) before it fails: a hung collective ends the test in seconds.
COLLECTIVE_TIMEOUT_S = 60


def run_processes(cmd: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for a command that starts
    processes of its own (spawned ranks, torchrun workers, a Lightning ddp launch): it
    runs in a new session, and past ``timeout`` seconds the whole session is killed (not
    just ``cmd``: orphaned ranks would keep waiting in their collectives) and the test
    fails with what it printed."""
    import signal

    import pytest

    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(map(str, cmd[:3]))} ... ran past {timeout} s; its process "
            f"group was killed\n{out[-2000:]}\n{err[-4000:]}"
        )
    finally:
        # children left behind by a command that exited (a rank that outlived it)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


#: The launcher variables a rank script must not inherit from the test's environment.
LAUNCHER_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK")


def rank_script(name: str) -> Any:
    """``tests/<name>.py``, a script the tests run as processes, imported for its
    constants and references (the tests folder on ``sys.path`` only while it imports)."""
    import importlib

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def rank_env(**extra: str) -> dict[str, str]:
    """The environment for a rank script: one thread a process, no launcher variable
    inherited (:data:`LAUNCHER_VARS`), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def imported_modules(importtime_stderr: str) -> set[str]:
    """The modules a ``python -X importtime`` run imported, read from its stderr."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime_stderr.splitlines()
        if line.startswith("import time:") and "cumulative" not in line
    }


def run_bnswap(
    args: list[str],
    cwd: Any = ROOT,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    processes: bool = False,
) -> subprocess.CompletedProcess:
    """``bnswap ARGS`` through the installed console script (the ``bnswap`` executable
    next to this interpreter; ``python -m _bnswap_command`` where there is none), with
    this checkout first on ``PYTHONPATH`` (so its ``bnswap`` and front door run, from any
    ``cwd``) and one OpenMP thread; ``capture_output``, ``text``, within ``timeout``.
    ``processes``: the command starts processes of its own (a Lightning ddp run), run by
    :func:`run_processes` (its whole session killed past ``timeout``)."""
    import shutil

    exe = shutil.which("bnswap", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "_bnswap_command"]
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if processes:
        return run_processes([*cmd, *args], timeout, cwd=cwd, env=env)
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


# The two-rank synchronized jobs' net and data (tests/lightning_sync_fit.py,
# tests/fabric_sync_fit.py): each rank takes every other row of the global batch.
SYNC_STEPS, SYNC_PER_RANK, SYNC_LR = 4, 4, 0.1


def sync_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 1))


def sync_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): the global batch of step k is rows 8k .. 8k + 7."""
    g = torch.Generator().manual_seed(1)
    n = SYNC_STEPS * 2 * SYNC_PER_RANK
    return torch.randn(n, 6, generator=g) * 3 + 1, torch.randn(n, 1, generator=g)


def consolidated_nodes(program: Any) -> int:
    """How many nodes of bnswap's (the consolidated batch-norm ops) an ``ExportedProgram``
    or ``GraphModule`` holds, nested graphs included: what ``bnswap.to_stock_ops`` turns
    into stock's."""
    from bnswap._graph import CONSOLIDATED_TARGETS

    gm = getattr(program, "graph_module", program)
    return sum(
        1
        for sub in gm.modules()
        for n in getattr(sub, "graph", torch.fx.Graph()).nodes
        if n.op == "call_function" and n.target in CONSOLIDATED_TARGETS
    )


def to_stock(program: Any, **kwargs: Any) -> tuple[Any, int]:
    """``bnswap.to_stock_ops(program)`` and how many of bnswap's nodes it rewrote (those
    before less those after: 0 after, checked)."""
    before = consolidated_nodes(program)
    out = bnswap.to_stock_ops(program, **kwargs)
    assert consolidated_nodes(out) == 0
    return out, before


_LAZY: list[str] = []


def lazy_device() -> str:
    """torch's Lazy device (its TorchScript backend), initialized once per process (a
    second ``torch._lazy.ts_backend.init()`` raises); skips the test where this torch has
    none. A device other than the CPU whose dispatch of the batch-norm ops is CUDA's
    (tests/test_devices.py says what it shows and what it cannot)."""
    import pytest

    if not _LAZY:
        try:
            import torch._lazy
            import torch._lazy.ts_backend

            torch._lazy.ts_backend.init()
        except Exception as e:  # a torch built without the Lazy TorchScript backend
            pytest.skip(f"torch's Lazy device is not available here: {type(e).__name__}: {e}")
        _LAZY.append("lazy")
    return _LAZY[0]
