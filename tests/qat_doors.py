"""torchao's pt2e QAT flow on a program loaded from a file, in a fresh interpreter, for
each door through which such a program reaches bnswap (used by tests/test_qat_doors.py).

    python tests/qat_doors.py {stock_and_d3|d1|d2} DIR

DIR holds ``stock.pt2`` (a stock model's program), ``cli.pt2`` (``bnswap convert
stock.pt2 -o cli.pt2``) and ``inproc.pt2`` (the converted model, exported and saved).
Each role writes ``DIR/<role>.pt``: per door, per quantizer, what :func:`flow` records.

* ``stock_and_d3``: the stock reference first, where bnswap is not imported at all
  (``torch.export.load("stock.pt2").module()`` through the flow); then door 3,
  ``bnswap.convert(torch.export.load("stock.pt2"))`` (a stock program converted).
* ``d1``: ``bnswap.convert(torch.export.load("cli.pt2").module())``: the graph holds the
  consolidated ops already; the call changes nothing in it and applies bnswap's patches.
* ``d2``: ``torch.export.load("inproc.pt2")``; first, with bnswap imported but not called
  yet, ``prepare_qat_pt2e`` and 3 steps (what torchao does unpatched: ``late``), a copy
  of it moved to eval there too (``early``); then ``bnswap.convert(program)`` (an
  ExportedProgram on the consolidated ops: returned itself); ``late`` moved to eval and
  both converted (what docs/qat.md says of a graph prepared before bnswap met the
  program); then the flow from the program.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import torch
from _pt2e import (  # this script's folder; imports no bnswap
    QUANTIZERS,
    bn_ops,
    graph_of,
    memoize_patterns,
    train,
)

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=r".*(LeafSpec|deprecated).*")
SHAPE = (4, 3, 8, 8)


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


def targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def state(gm: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in gm.state_dict().items()}


def quantized_calls(q: torch.fx.GraphModule, xs: list[torch.Tensor]) -> dict:
    """Outputs of three inference calls of the quantized model and its state before /
    after (a model that updates running statistics at inference changes it)."""
    before = state(q)
    ys = [q(xs[3]), q(xs[4]), q(xs[3])]
    return {"q_ys": [y.detach() for y in ys], "q_before": before, "q_after": state(q)}


def flow(gm: torch.fx.GraphModule, quantizer: str) -> dict:
    """prepare_qat_pt2e, 3 SGD steps, move_exported_model_to_eval, an eval call,
    convert_pt2e, 3 inference calls; what each step gives."""
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e

    xs = batches(5)
    p = prepare_qat_pt2e(gm, QUANTIZERS[quantizer]())
    out = {"prepared": graph_of(p), "prepared_bn": bn_ops(p)}
    out["qat_y"] = train(p, xs[:3])
    out["qat_state"] = state(p)
    move_exported_model_to_eval(p)
    out["eval"] = graph_of(p)
    out["eval_y"] = p(xs[3]).detach()
    q = convert_pt2e(p)
    out["q_graph"] = graph_of(q)
    return {**out, **quantized_calls(q, xs)}


def load(path: str) -> torch.export.ExportedProgram:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.load(path)


def fresh(ep: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """``ep.module()`` with its own tensors (``ep.module()`` shares the program's: QAT
    steps on one would change the next)."""
    return copy.deepcopy(ep.module())


def applied() -> list[str]:
    return sorted(sys.modules["bnswap"]._compat.applied())


def stock_and_d3(d: str) -> dict:
    assert "bnswap" not in sys.modules
    ref = {q: flow(load(os.path.join(d, "stock.pt2")).module(), q) for q in QUANTIZERS}
    assert "bnswap" not in sys.modules  # the reference never saw bnswap
    import bnswap

    ep = bnswap.convert(load(os.path.join(d, "stock.pt2")))
    return {"stock": ref, "d3": {q: flow(fresh(ep), q) for q in QUANTIZERS}}


def d1(d: str) -> dict:
    import bnswap

    ep = load(os.path.join(d, "cli.pt2"))
    loaded = applied()  # import bnswap + torch.export.load: nothing patched
    gm = bnswap.convert(ep.module())
    installed = bnswap._compat._installed
    return {
        "applied_on_load": loaded,
        "installed": installed,
        "d1": {q: flow(copy.deepcopy(gm), q) for q in QUANTIZERS},
        "applied": applied(),  # (torchao's modules are patched as they are imported)
    }


def batch_norm_modes(gm: torch.fx.GraphModule) -> list[tuple[str, object]]:
    """Each batch-norm node's op and its ``training`` argument (stock's op: position 5;
    ``_batch_norm_with_update`` always updates)."""
    return [
        (str(n.target), n.args[5] if "with_update" not in str(n.target) else True)
        for n in gm.graph.nodes
        if n.op == "call_function" and "batch_norm" in str(n.target)
    ]


def d2(d: str) -> dict:
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e

    import bnswap

    ep = load(os.path.join(d, "inproc.pt2"))
    xs = batches(5)
    # torchao before bnswap met the program: no batch norm seen, so no conv-BN fold
    late = prepare_qat_pt2e(fresh(ep), QUANTIZERS["x86"]())
    out: dict = {"late_prepared": targets(late)}
    train(late, xs[:3])
    early = copy.deepcopy(late)
    move_exported_model_to_eval(early)  # a switch that sees no batch norm either
    out["early_eval"] = batch_norm_modes(early)
    out["applied_on_load"] = applied()  # (import, load, torchao: nothing)
    new = bnswap.convert(ep)
    out["same_program"] = new is ep
    out["installed"] = bnswap._compat._installed
    out["applied"] = applied()  # (quantize_pt2e and export_utils: imported above)
    move_exported_model_to_eval(late)  # now patched: stock's nodes, in evaluation
    out["late_eval"] = batch_norm_modes(late)
    out["late"] = quantized_calls(convert_pt2e(late), xs)
    out["early"] = quantized_calls(convert_pt2e(early), xs)  # torchao's switch ran already
    out["d2"] = {q: flow(fresh(new), q) for q in QUANTIZERS}
    return out


if __name__ == "__main__":
    role, folder = sys.argv[1], sys.argv[2]
    with memoize_patterns():
        result = {"stock_and_d3": stock_and_d3, "d1": d1, "d2": d2}[role](folder)
    torch.save(result, os.path.join(folder, f"{role}.pt"))
