"""Programs moved as users move them, and a moved program held against stock's.

Shared by ``tests/test_moves.py`` and, run as a script (``python tests/moves.py DIR``),
by the process that loads the ``.pt2`` files the test saved and moves them without ever
importing bnswap (so it imports torch only). The four moves of issue 25:
``ep.module().to("meta")``, ``ep.module().double()``, ``ep.module().to(torch.bfloat16)``,
``torch.export.passes.move_to_device_pass(ep, "meta")``. Each move is given a program of
its own: moving ``ep.module()`` moves the program's own state too.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

MOVES = ("meta", "double", "bfloat16", "move_to_device_pass")


def moved(
    ep: torch.export.ExportedProgram, move: str, x: torch.Tensor
) -> tuple[torch.nn.Module, torch.Tensor]:
    """(the program's module after ``move``, the input moved the same way)."""
    if move == "meta":
        return ep.module().to("meta"), x.to("meta")
    if move == "double":
        return ep.module().double(), x.double()
    if move == "bfloat16":
        return ep.module().to(torch.bfloat16), x.to(torch.bfloat16)
    if move == "move_to_device_pass":
        from torch.export.passes import move_to_device_pass

        return move_to_device_pass(ep, "meta").module(), x.to("meta")
    raise ValueError(move)


def outcome(
    ep: torch.export.ExportedProgram, move: str, x: torch.Tensor, calls: int = 2
) -> dict[str, Any]:
    """Run the moved program ``calls`` times: its outputs and its state after each call,
    or the error it raised (type and message)."""
    try:
        module, xm = moved(ep, move, x)
        runs = []
        for _ in range(calls):
            out = module(xm)
            runs.append((out, {k: v.clone() for k, v in module.state_dict().items()}))
        return {"ok": runs}
    except Exception as e:  # compared with what stock raises
        return {"err": (type(e).__name__, str(e))}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.device.type == "meta":
        return True  # no values on meta: shape, dtype and device
    if a.is_floating_point():
        an, bn = a.isnan(), b.isnan()
        return torch.equal(an, bn) and torch.equal(a[~an], b[~bn])
    return torch.equal(a, b)


def difference(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    """Why the moved program's outcome ``got`` is not stock's ``want`` (None: it is):
    the same error, or bitwise the same outputs and state after every call (shape,
    dtype and device on the meta device)."""
    if "err" in got or "err" in want:
        return (
            None
            if got.get("err") == want.get("err")
            else f"got {got.get('err', 'a result')}, stock {want.get('err', 'a result')}"
        )
    for i, ((out, state), (ref, ref_state)) in enumerate(zip(got["ok"], want["ok"], strict=True)):
        if not _same(out, ref):
            return f"call {i}: output differs ({out.dtype}, {out.device} vs {ref.dtype})"
        if list(state) != list(ref_state):
            return f"call {i}: state keys {list(state)} vs {list(ref_state)}"
        for k in state:
            if not _same(state[k], ref_state[k]):
                return f"call {i}: {k} differs"
    return None


def main(folder: str) -> int:
    """Load each case of ``folder/index.json`` (its stock program and bnswap's, saved
    by the test), move each fresh load every way, and write every difference from
    stock's moved program to ``folder/results.json``."""
    import os

    with open(os.path.join(folder, "index.json")) as f:
        index = json.load(f)
    results: dict[str, str | None] = {}
    for case, files in index.items():
        x = torch.load(os.path.join(folder, files["input"]))
        for move in MOVES:
            want = outcome(torch.export.load(os.path.join(folder, files["stock"])), move, x)
            for kind in files["bnswap"]:
                path = os.path.join(folder, files["bnswap"][kind])
                got = outcome(torch.export.load(path), move, x)
                results[f"{case}/{kind}/{move}"] = difference(got, want)
    results["bnswap imported"] = str(sorted(m for m in sys.modules if m.startswith("bnswap")))
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
