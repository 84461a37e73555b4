"""Programs that move (issue 25): a graph captured from bnswap moves to another device or
dtype exactly as stock's does.

The matrix: BatchNorm1d ((N, C) and (N, C, L)), 2d, 3d and SyncBatchNorm (unsynchronized),
each of affine x track_running_stats, a numeric momentum, train and eval; three kinds of
program (exported from a converted model; ``bnswap.convert`` of stock's program; either of
them saved as a ``.pt2`` and loaded in a process that never imports bnswap), moved four
ways (``tests/moves.py``). Every moved program is held against stock's program of an
identical copy, moved the same way: outputs and state bitwise equal where it computes (the
CPU dtypes), shape / dtype / device on meta, the same error where stock errs. bnswap's
stand-ins for a missing weight, bias or statistics were ``aten.full`` nodes with a literal
``device=cpu, dtype=float32`` (24 of 48 cases of the public report failed).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import bnswap
from tests import moves
from tests._helpers import consolidated_nodes, to_stock

KINDS = {
    "bn1d_nc": (nn.BatchNorm1d, (6, 3)),
    "bn1d_ncl": (nn.BatchNorm1d, (4, 3, 5)),
    "bn2d": (nn.BatchNorm2d, (2, 3, 4, 4)),
    "bn3d": (nn.BatchNorm3d, (2, 3, 2, 3, 3)),
    "syncbn": (nn.SyncBatchNorm, (2, 3, 4, 4)),
}
CASES = [
    f"{k}-affine{int(a)}-stats{int(t)}-{'train' if tr else 'eval'}"
    for k, a, t, tr in itertools.product(KINDS, (True, False), (True, False), (True, False))
]


def _case(case: str) -> tuple[nn.Module, torch.Tensor]:
    """(the stock layer of ``case``, its input): non-trivial weights and statistics."""
    kind, affine, stats, mode = case.split("-")
    cls, shape = KINDS[kind]
    torch.manual_seed(0)
    layer = cls(3, affine=affine == "affine1", track_running_stats=stats == "stats1", momentum=0.3)
    with torch.no_grad():
        for p in layer.parameters():
            p.uniform_(0.5, 1.5)
        if layer.running_mean is not None:
            layer.running_mean.uniform_(-1, 1)
            layer.running_var.uniform_(0.5, 2)
    return layer.train(mode == "train"), torch.randn(*shape)


def _programs(case: str) -> dict[str, torch.export.ExportedProgram]:
    """Fresh programs of ``case``: stock's, and bnswap's two in-process kinds."""
    layer, x = _case(case)
    return {
        "stock": torch.export.export(copy.deepcopy(layer), (x,)),
        "exported": torch.export.export(bnswap.convert(copy.deepcopy(layer)), (x,)),
        "converted": bnswap.convert(torch.export.export(copy.deepcopy(layer), (x,))),
    }


def _user_inputs(ep: torch.export.ExportedProgram) -> list[str]:
    return [
        s.arg.name
        for s in ep.graph_signature.input_specs
        if s.kind == torch.export.graph_signature.InputKind.USER_INPUT
    ]


@pytest.mark.parametrize("case", CASES)
def test_a_program_moves_exactly_as_stocks(case):
    _, x = _case(case)
    progs = _programs(case)
    # a converted layer exported as the root module: stock's input name (it was args_0,
    # or export failed reading the swapped forward's __code__)
    assert _user_inputs(progs["exported"]) == _user_inputs(progs["stock"]) == ["input"]
    for move in moves.MOVES:
        fresh = progs if move == moves.MOVES[0] else _programs(case)  # a move moves state
        want = moves.outcome(fresh["stock"], move, x)
        for kind in ("exported", "converted"):
            got = moves.outcome(fresh[kind], move, x)
            assert moves.difference(got, want) is None, (kind, move, moves.difference(got, want))


def test_saved_programs_move_as_stocks_in_a_process_that_never_imports_bnswap(tmp_path):
    """Both kinds of bnswap program of every case, saved as .pt2 files, loaded in a fresh
    process that imports torch only, moved four ways there: each as stock's program."""
    index = {}
    for case in CASES:
        _, x = _case(case)
        progs = _programs(case)
        files = {
            "input": f"{case}.x.pt",
            "stock": f"{case}.stock.pt2",
            "bnswap": {k: f"{case}.{k}.pt2" for k in ("exported", "converted")},
        }
        torch.save(x, tmp_path / files["input"])
        torch.export.save(progs["stock"], tmp_path / files["stock"])
        for k, name in files["bnswap"].items():
            torch.export.save(progs[k], tmp_path / name)
        index[case] = files
    (tmp_path / "index.json").write_text(json.dumps(index))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moves.py")
    p = subprocess.run(
        [sys.executable, script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results.pop("bnswap imported") == "[]"
    assert len(results) == len(CASES) * 2 * len(moves.MOVES)
    wrong = {k: v for k, v in results.items() if v is not None}
    assert not wrong, wrong


def _pinned(gm: torch.fx.GraphModule) -> list[str]:
    """The nodes of ``gm`` (nested graphs included) that name a device or a dtype."""
    return sorted(
        f"{n.target}(dtype={n.kwargs.get('dtype')}, device={n.kwargs.get('device')})"
        for sub in gm.modules()
        for n in getattr(sub, "graph", torch.fx.Graph()).nodes
        if n.op == "call_function" and ("device" in n.kwargs or "dtype" in n.kwargs)
    )


class _Loss(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return (self.net(x).sum(),)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.BatchNorm2d(4, affine=False),
        nn.BatchNorm2d(4, track_running_stats=False),
        nn.BatchNorm2d(4, affine=False, track_running_stats=False),
    ).train()


def _graphs(model: nn.Module, x: torch.Tensor, kind: str) -> list[torch.fx.GraphModule]:
    from torch._functorch.aot_autograd import aot_export_module

    if kind == "export":
        return [torch.export.export(model, (x,)).graph_module]
    if kind == "core_aten":
        return [torch.export.export(model, (x,)).run_decompositions().graph_module]
    if kind == "joint":
        return [aot_export_module(_Loss(model), (x,), trace_joint=True, output_loss_index=0)[0]]
    if kind == "compile":  # the forward and backward graphs aot_eager runs
        from torch._dynamo.backends.common import aot_autograd

        seen: list[torch.fx.GraphModule] = []

        def keep(gm, _inputs):
            seen.append(gm)
            return gm.forward

        torch._dynamo.reset()
        out = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))(x)
        out.sum().backward()
        torch._dynamo.reset()
        return seen
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["export", "core_aten", "joint", "compile"])
def test_no_graph_carries_a_device_or_dtype_of_bnswaps_own(kind):
    """What bnswap's layers record under torch.export (training IR and core ATen),
    aot_export_module(trace_joint=True) and torch.compile's aot graphs names no device
    or dtype that stock's graph of the same net does not (none here)."""
    x = torch.randn(2, 3, 6, 6)
    stock = _graphs(_net(), x, kind)
    ours = _graphs(bnswap.convert(_net()), x, kind)
    assert [_pinned(g) for g in ours] == [_pinned(g) for g in stock] == [[]] * len(stock)
    ops = {str(n.target) for g in ours for n in g.graph.nodes}
    assert ops & (
        {"aten._native_batch_norm_legit_functional.default"}
        if kind == "core_aten"
        else {
            "aten._batch_norm_with_update.default",  # (core ATen: stock's ops)
            "aten._batch_norm_with_update_functional.default",
        }
    )
    assert "aten.full_like.default" in ops  # the stand-ins are in the graph


@pytest.mark.parametrize("decomposed", [False, True], ids=["training_ir", "core_aten"])
def test_what_convert_inserts_names_no_device_or_dtype(decomposed):
    """bnswap.convert of a stock program and of a stock joint graph (GraphModule): the
    stand-ins it inserts follow the tensors they stand beside, and the converted program
    moves to float64 as stock's does."""
    from torch._functorch.aot_autograd import aot_export_module

    x = torch.randn(2, 3, 6, 6)
    ep = torch.export.export(_net(), (x,))
    if decomposed:
        ep = ep.run_decompositions()
    new = bnswap.convert(ep)
    assert _pinned(new.graph_module) == [] and any(
        "full_like" in str(n.target) for n in new.graph.nodes
    )
    assert torch.equal(new.module().double()(x.double()), ep.module().double()(x.double()))
    joint = aot_export_module(_Loss(_net()), (x,), trace_joint=True, output_loss_index=0)[0]
    bnswap.convert(joint)
    assert _pinned(joint) == []
    assert {str(n.target) for n in joint.graph.nodes} >= {"aten.batch_norm_backward.default"}


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith(("bn1d_ncl", "bn2d"))])
def test_to_stock_ops_gives_stocks_graph_node_for_node(case):
    """bnswap.to_stock_ops turns bnswap's stand-ins (full_like of the layer's tensor or of
    the input's channel view) back into None: the graph is stock's, node for node, and
    nothing of the stand-ins is left."""
    progs = _programs(case)
    want = [(n.op, str(n.target)) for n in progs["stock"].graph.nodes]
    for kind in ("exported", "converted"):
        gm = progs[kind].module()
        bnswap.to_stock_ops(gm)
        got = [(n.op, str(n.target)) for n in gm.graph.nodes]
        ref = [(n.op, str(n.target)) for n in progs["stock"].module().graph.nodes]
        assert got == ref, kind
    assert want  # (the program's own graph, for the message)


def test_a_compiled_converted_model_moved_after_its_first_call_recompiles_and_runs():
    """torch.compile (aot_eager) of a converted model, called, then moved to float64 and
    to bfloat16: each call recompiles for the new dtype and gives stock's eager result
    on an identical copy, running statistics included."""
    from torch._dynamo.utils import counters

    stock = _net()
    model = bnswap.convert(copy.deepcopy(stock))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 6, 6, generator=g)
    try:
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            stock.to(dtype)
            model.to(dtype)
            xd = x.to(dtype)
            assert torch.equal(compiled(xd), stock(xd)), dtype
            for k, v in stock.state_dict().items():
                assert torch.equal(model.state_dict()[k], v), (dtype, k)
        assert counters["stats"]["unique_graphs"] >= 3  # one graph per dtype
    finally:
        torch._dynamo.reset()


def _sequential_program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, affine=False)).train()
    return torch.export.export(m, (torch.randn(2, 3, 6, 6),))


def _deep_copy(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(ep)


def test_a_deep_copied_program_converts_plans_and_goes_back_to_stock():
    """copy.deepcopy of an nn.Sequential program renames its placeholder input to
    input_1, which its signature does not follow (ep.validate() raises
    SpecViolationError), though the copy runs. bnswap.convert / plan().apply() of it
    raised that error; they now return a valid program, bitwise the original's, and
    to_stock_ops mends the copy it returns."""
    from torch._export.verifier import SpecViolationError

    ep = _sequential_program()
    copied = _deep_copy(ep)
    with pytest.raises(SpecViolationError, match="does not match node name input_1"):
        copied.validate()
    x = torch.randn(2, 3, 6, 6)
    for new in (bnswap.convert(_deep_copy(ep)), bnswap.plan(_deep_copy(ep)).apply()):
        new.validate()
        assert _user_inputs(new) == ["input"]
        assert torch.equal(new.module()(x), ep.module()(x))
    assert [r.action for r in bnswap.plan(_deep_copy(ep)).rows] == ["swap"]
    bn = _deep_copy(
        torch.export.export(
            bnswap.convert(
                nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, affine=False)).train()
            ),
            (x,),
        )
    )
    again = bnswap.convert(bn)  # a deep copy of bnswap's own program: converted already
    again.validate()
    assert torch.equal(again.module()(x), bn.module()(x))
    stock, rewritten = to_stock(bn)  # a new program, valid; bn itself unchanged
    assert rewritten == 1 and stock is not bn and consolidated_nodes(bn) == 1
    stock.validate()


def test_a_program_invalid_otherwise_is_refused_with_torchs_error_before_any_change():
    """A signature naming an input another node holds is no rename: convert, plan and
    to_stock_ops raise torch's own SpecViolationError, and the program is unchanged."""
    from torch._export.verifier import SpecViolationError

    ep = _sequential_program()
    spec = next(s for s in ep.graph_signature.input_specs if s.arg.name == "input")
    spec.arg.name = "conv2d"  # the name of another node of the graph
    with pytest.raises(SpecViolationError) as want:
        ep.validate()
    before = [(n.name, str(n.target), n.args) for n in ep.graph.nodes]
    code = ep.graph_module.code
    for call in (bnswap.convert, bnswap.plan, bnswap.to_stock_ops):
        with pytest.raises(SpecViolationError) as err:
            call(ep)
        assert str(err.value) == str(want.value), call
        assert [(n.name, str(n.target), n.args) for n in ep.graph.nodes] == before
        assert ep.graph_module.code == code


def test_a_cumulative_average_program_names_no_device_or_dtype_and_moves():
    """momentum=None (stock's layer cannot be exported in training: pytorch issue
    194504): the factor 1 / num_batches_tracked was computed with .to(float32), which
    torch.export records with an _assert_tensor_metadata(num_batches_tracked,
    device=cpu) node, so a program captured on one device failed on another
    ("Tensor device mismatch") and a .double() program kept a float32 factor. It is now
    made like the running statistics: nothing pinned, and the moved program follows
    stock's eager layer moved the same way (within one float64 ulp: in a graph the
    update is tensor maths, where stock's kernel takes a Python float)."""

    def net():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 4, 3),
            nn.BatchNorm2d(4, momentum=None),
            nn.BatchNorm2d(4, affine=False, momentum=None),
        ).train()

    x = torch.randn(2, 3, 6, 6)
    for kind in ("export", "core_aten", "compile"):
        assert [_pinned(g) for g in _graphs(bnswap.convert(net()), x, kind)] in ([[]], [[], []])
    # captured on the meta device, run on the CPU
    on_meta = torch.export.export(bnswap.convert(net().to("meta")), (x.to("meta"),))
    moved = on_meta.module().to_empty(device="cpu")
    moved.load_state_dict(net().state_dict())
    stock = net()
    assert torch.equal(moved(x), stock(x))
    # captured on the CPU, moved to float64, three cumulative updates
    mod = torch.export.export(bnswap.convert(net()), (x,)).module().double()
    stock = net().double()
    for _ in range(3):
        assert torch.equal(mod(x.double()), stock(x.double()))
    for k, v in stock.state_dict().items():
        assert v.dtype == mod.state_dict()[k].dtype, k
        assert torch.allclose(mod.state_dict()[k], v, rtol=2.3e-16, atol=0), k
