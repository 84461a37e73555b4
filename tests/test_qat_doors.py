"""A program on the consolidated ops loaded from a file goes through torchao's pt2e QAT
flow exactly as stock's once bnswap met it: each door in a fresh interpreter
(``tests/qat_doors.py``), against stock's flow on the same weights run where bnswap is
not imported, with XNNPACK's quantizer and ``X86InductorQuantizer``.

The doors: a ``.pt2`` that the ``bnswap convert`` CLI wrote, then
``bnswap.convert(torch.export.load(path).module())`` (d1); a converted model exported
and saved in one process, loaded in another, then ``bnswap.convert(program)`` (d2); a
stock program loaded from disk, then ``bnswap.convert(program)`` (d3). The first two
change nothing in the graph: the call applies bnswap's patches. Bitwise on the CPU: the
prepared graph node for node (stock's, the conv-BN fold included), QAT outputs and state
after 3 steps, the eval graph node for node and its output, the quantized graph node for
node, its outputs, and its state, unchanged by inference calls. And what docs/qat.md
says of a graph torchao prepared before bnswap met the program.

The three interpreters run side by side (each imports torch and torchao and exports
torchao's patterns once: ~1 min of CPU each).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import bnswap
from tests._helpers import ROOT, run_bnswap
from tests._pt2e import QUANTIZERS, STOCK, WITH_UPDATE, bn_ops, visible_bn

pytest.importorskip("torchao")

SCRIPT = Path(__file__).with_name("qat_doors.py")
ROLES = ("stock_and_d3", "d1", "d2")
TORCHAO_PATCHES = {
    "torchao.quantization.pt2e.export_utils._replace_batchnorm",
    "torchao.quantization.pt2e.quantize_pt2e._get_node_name_to_scope",
}


def _model() -> nn.Module:
    """conv-BN (no conv bias; eps, momentum of its own), ReLU, conv-BN, ReLU: torchao's
    QAT fold; then a BN alone, which stays a batch norm in the quantized model (whose
    running statistics must not change at inference)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, bias=False),
        visible_bn(nn.BatchNorm2d(4, eps=1e-3, momentum=0.3)),
        nn.ReLU(),
        nn.Conv2d(4, 4, 1),
        visible_bn(nn.BatchNorm2d(4)),
        nn.ReLU(),
        visible_bn(nn.BatchNorm2d(4)),
    ).train()


@pytest.fixture(scope="module")
def doors(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("qat_doors")
    stock = _model()
    x = torch.randn(4, 3, 8, 8)
    ep = torch.export.export(stock, (x,))
    assert bn_ops(ep.module()) == [STOCK] * 3
    torch.export.save(ep, d / "stock.pt2")
    swapped = bnswap.convert(copy.deepcopy(stock))
    torch.export.save(torch.export.export(swapped, (x,)), d / "inproc.pt2")
    cli = run_bnswap(["convert", str(d / "stock.pt2"), "-o", str(d / "cli.pt2")])
    assert cli.returncode == 0, cli.stderr[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.pop("BNSWAP_DISABLE_PATCHES", None)
    procs = {
        role: subprocess.Popen(
            [sys.executable, str(SCRIPT), role, str(d)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for role in ROLES
    }
    failed = []
    for role, p in procs.items():
        try:
            _, err = p.communicate(timeout=1200)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode != 0:
            failed.append(f"{role}: exit {p.returncode}\n{err[-3000:]}")
    assert not failed, "\n".join(failed)
    return {role: torch.load(d / f"{role}.pt", weights_only=False) for role in ROLES}


def _same_state(a: dict, b: dict) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys: {sorted(a.keys() ^ b.keys())}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
@pytest.mark.parametrize("door", ["d1", "d2", "d3"])
def test_a_loaded_programs_qat_flow_is_stocks(doors, door, quantizer):
    ref = doors["stock_and_d3"]["stock"][quantizer]
    got = doors["stock_and_d3" if door == "d3" else door][door][quantizer]
    assert ref["prepared_bn"] == [STOCK] * 3
    # the prepared graph is stock's, node for node, the conv-BN fold included: torchao's
    # QAT pattern scales each conv's weight by weight / sqrt(running_var + eps)
    assert got["prepared"] == ref["prepared"]
    assert sum(node[1] == "aten.sqrt.default" for node in ref["prepared"]) == 2
    assert torch.equal(got["qat_y"], ref["qat_y"])
    assert _same_state(got["qat_state"], ref["qat_state"]) == []
    assert got["eval"] == ref["eval"]
    assert torch.equal(got["eval_y"], ref["eval_y"])
    assert got["q_graph"] == ref["q_graph"]
    # the lone BN stays a batch norm, in evaluation: the quantized model holds running
    # statistics, and inference calls leave them (and everything else) as they were
    assert any(k.endswith("running_mean") for k in ref["q_before"])
    for r in (ref, got):
        assert _same_state(r["q_after"], r["q_before"]) == []
    assert _same_state(got["q_before"], ref["q_before"]) == []
    for y, y_ref in zip(got["q_ys"], ref["q_ys"], strict=True):
        assert torch.equal(y, y_ref)


def test_importing_bnswap_and_loading_patch_nothing_the_documented_call_does(doors):
    """``import bnswap`` and ``torch.export.load`` patch nothing (bnswap's promise); the
    call docs/qat.md names, ``bnswap.convert`` of the loaded program or its module,
    applies the torchao patch although it changes nothing in the graph."""
    for role in ("d1", "d2"):
        assert doors[role]["applied_on_load"] == [], role
        assert doors[role]["installed"] is True, role
        assert set(doors[role]["applied"]) >= TORCHAO_PATCHES, role
    assert doors["d2"]["same_program"] is True  # converted already: returned itself


def test_a_graph_prepared_before_bnswap_met_the_program_is_as_the_guide_says(doors):
    """docs/qat.md, a graph torchao prepared before bnswap met the program: no conv-BN
    fold (prepare saw no batch norm); moved to eval once bnswap met the program, its
    nodes are stock's in evaluation and the quantized model's running statistics never
    move; moved to eval before, the switch saw nothing, its nodes still update, and
    convert_pt2e (which does not switch again) keeps them updating at inference."""
    d = doors["d2"]
    assert "aten.sqrt.default" not in d["late_prepared"]  # no fold
    assert d["late_prepared"].count(WITH_UPDATE) == 3
    assert d["early_eval"] == [(WITH_UPDATE, True)] * 3
    assert d["late_eval"] == [(STOCK, False)] * 3
    late, early = d["late"], d["early"]
    assert any(k.endswith("running_mean") for k in late["q_before"])
    assert _same_state(late["q_after"], late["q_before"]) == []
    moved = _same_state(early["q_after"], early["q_before"])
    assert [k for k in moved if k.endswith("running_mean")], moved


_ENTRY_POINTS = """
import json, os, sys, warnings
import torch
import bnswap
from bnswap import _compat

warnings.simplefilter("ignore")
ep = torch.export.load(sys.argv[1])
stock = torch.export.load(sys.argv[2])
calls = {
    "load": lambda: None,
    "plan(stock program)": lambda: bnswap.plan(stock),
    "plan(program)": lambda: bnswap.plan(ep),
    "plan(graph)": lambda: bnswap.plan(ep.module()),
    "convert(program)": lambda: bnswap.convert(ep),
    "convert(graph)": lambda: bnswap.convert(ep.module()),
    "revert(graph)": lambda: bnswap.revert(ep.module()),
    "to_stock_ops(graph)": lambda: bnswap.to_stock_ops(ep.module()),
}
out = {}
for name, call in calls.items():  # each in a child: this process stays unpatched
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        call()
        os.write(w, json.dumps(_compat._installed).encode())
        os._exit(0)
    os.close(w)
    out[name] = json.loads(os.read(r, 100) or b"null")
    os.waitpid(pid, 0)
print(json.dumps(out))
"""


def test_each_entry_point_that_meets_the_consolidated_ops_applies_the_patches(tmp_path):
    """In a process where bnswap swapped nothing: plan / convert / revert of a loaded
    program on the consolidated ops (or its module) apply bnswap's patches; loading it,
    planning a stock program and bnswap.to_stock_ops (which turns the graph stock's)
    apply none. Each call in a forked child of one fresh interpreter."""
    stock = _model()
    x = torch.randn(4, 3, 8, 8)
    torch.export.save(torch.export.export(stock, (x,)), tmp_path / "stock.pt2")
    swapped = bnswap.convert(copy.deepcopy(stock))
    torch.export.save(torch.export.export(swapped, (x,)), tmp_path / "bnswap.pt2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.pop("BNSWAP_DISABLE_PATCHES", None)
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            _ENTRY_POINTS,
            str(tmp_path / "bnswap.pt2"),
            str(tmp_path / "stock.pt2"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {
        "load": False,
        "plan(stock program)": False,
        "plan(program)": True,
        "plan(graph)": True,
        "convert(program)": True,
        "convert(graph)": True,
        "revert(graph)": True,
        "to_stock_ops(graph)": False,
    }
