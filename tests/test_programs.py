"""bnswap.convert / bnswap.plan of exported programs and graph modules, and bnswap's own
programs in core ATen (bnswap.programs). Every comparison is against the original
program (or stock torch) on identical inputs and weights, bitwise on CPU."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import bnswap
from tests._helpers import to_stock

X = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
CONSOLIDATED = {
    "aten._batch_norm_with_update.default",
    "aten._batch_norm_with_update_functional.default",
    "aten.batch_norm_backward.default",
}
#: what a converted program runs in evaluation: stock's own op (it picks its kernel when
#: it runs, on every device; _batch_norm_no_update has no kernel off the CPU)
EVAL_OP = "aten.batch_norm.default"


def model(no_stats: bool = True) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4, affine=False)]
    if no_stats:
        layers.append(nn.BatchNorm2d(4, affine=False, track_running_stats=False))
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(144, 5), nn.BatchNorm1d(5))


def bn_ops(gm) -> list[str]:
    return [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and "batch_norm" in str(n.target)
    ]


def same_runs(a, b, calls: int = 3) -> None:
    """``a`` and ``b`` (modules) give bitwise the same outputs and buffers, call after call."""
    g = torch.Generator().manual_seed(1)
    for _ in range(calls):
        x = torch.randn(3, 3, 8, 8, generator=g)
        assert torch.equal(a(x), b(x))
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("decomposed", [False, True], ids=["training_ir", "decomposed"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_convert_program_runs_bitwise_like_the_original(train, decomposed):
    ep = torch.export.export(model().train(train), (X,))
    if decomposed:
        ep = ep.run_decompositions()
    before = bn_ops(ep.graph_module)
    new = bnswap.convert(ep)
    assert new is not ep and bn_ops(ep.graph_module) == before  # the input is unchanged
    ops = bn_ops(new.graph_module)
    # training: the consolidated ops; evaluation: aten.batch_norm, but for the
    # track_running_stats=False layer (batch statistics in eval too)
    update, functional = (
        "aten._batch_norm_with_update.default",
        "aten._batch_norm_with_update_functional.default",
    )
    # (the third layer keeps no statistics: batch statistics in eval too)
    expected = (
        [update, update, functional, update]
        if train and not decomposed
        else [functional] * 4
        if train
        else [EVAL_OP, EVAL_OP, functional, EVAL_OP]
    )
    assert ops == expected, ops
    assert new.graph_signature.buffers_to_mutate == ep.graph_signature.buffers_to_mutate
    new.validate()
    same_runs(ep.module(), new.module())
    kept = bn_ops(new.run_decompositions({}).graph_module)
    # training keeps the consolidated ops (functional); aten.batch_norm decomposes, as
    # stock's does
    core = {EVAL_OP: "aten._native_batch_norm_legit_no_training.default", update: functional}
    assert kept == [core.get(o, o) for o in expected], kept


@pytest.mark.parametrize("decomposed", [False, True], ids=["training_ir", "decomposed"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_converted_dynamic_batch_program_refuses_an_empty_batch_before_any_state_moves(
    train, decomposed, tmp_path
):
    """A stock program exported with a dynamic batch (Dim("b") admits 0) returns early on
    an empty batch; the consolidated ops reject empty input with a kernel error, which came
    after the graph had counted the batch (a failed call moved num_batches_tracked). The
    converted program carries bnswap's own empty-batch assertion, checked before anything
    moves (as a converted layer's program); non-empty batches stay bitwise the original's.
    to_stock_ops gives stock's ops back node for node (it made the track_running_stats=False
    node _native_batch_norm_legit.no_stats in the training IR, which rejects an empty batch,
    where stock records aten.batch_norm) and stock's empty-batch behaviour."""
    from torch.export import Dim

    from bnswap.functional import EMPTY_BATCH_MESSAGE

    torch.manual_seed(0)
    m = nn.Sequential(
        nn.BatchNorm2d(3),
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4, affine=False),
        nn.BatchNorm2d(4, track_running_stats=False),
    ).train(train)
    ep = torch.export.export(m, (X,), dynamic_shapes=({0: Dim("b")},))
    if decomposed:
        ep = ep.run_decompositions()
    new = bnswap.convert(ep)
    new.validate()
    same_runs(ep.module(), new.module())
    torch.export.save(new, tmp_path / "m.pt2")
    for prog in (new, torch.export.load(tmp_path / "m.pt2")):
        mod = prog.module()
        before = {k: v.clone() for k, v in mod.state_dict().items()}
        with pytest.raises(RuntimeError, match="got an empty input") as err:
            mod(torch.randn(0, 3, 8, 8))
        assert EMPTY_BATCH_MESSAGE in str(err.value)
        assert all(torch.equal(before[k], v) for k, v in mod.state_dict().items())
    ref, gm = ep.module(), new.module()
    # the graph module, in place; in eval the one node with batch statistics is bnswap's
    # (with core_aten the two eval nodes go back to _native_batch_norm_legit_no_training too)
    assert to_stock(gm, core_aten=decomposed) == (gm, 3 if train else 1)
    assert "got an empty input" not in gm.code  # the assertions went with the nodes
    assert bn_ops(gm) == bn_ops(ref)  # stock's ops again, node for node
    empty = torch.randn(0, 3, 8, 8)
    if decomposed:  # stock's decomposed ops reject an empty batch themselves
        for mod in (ref, gm):
            with pytest.raises(RuntimeError, match="must have at least one element"):
                mod(empty)
    else:
        a, b = ref(empty), gm(empty)
        assert a.shape == b.shape == (0, 4, 6, 6)
    for k, v in ref.state_dict().items():
        assert torch.equal(v, gm.state_dict()[k]), k
    same_runs(ref, gm)


def test_converted_program_saves_and_loads(tmp_path):
    ep = torch.export.export(model(), (X,))
    new = bnswap.convert(ep)
    torch.export.save(new, tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2")
    assert bn_ops(loaded.graph_module) == bn_ops(new.graph_module)
    same_runs(ep.module(), loaded.module())


def test_program_without_batch_norm_warns_and_comes_back_unchanged():
    ep = torch.export.export(nn.Sequential(nn.Linear(3, 2)), (torch.randn(2, 3),))
    with pytest.warns(UserWarning, match="no batch-norm node"):
        assert bnswap.convert(ep) is ep
    assert len(bnswap.plan(ep)) == 0
    converted = bnswap.convert(torch.export.export(model(), (X,)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converted already: no warning, itself
        assert bnswap.convert(converted) is converted


def test_convert_graph_module_rewrites_its_nodes_in_place():
    ep = torch.export.export(model(), (X,))
    gm = ep.module()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the model has no BatchNorm layer"
        assert bnswap.convert(gm) is gm
    assert set(bn_ops(gm)) <= CONSOLIDATED and len(bn_ops(gm)) == 4
    same_runs(ep.module(), gm)


def _joint_graph(seed: int) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """make_fx of a native_batch_norm forward + autograd.grad (a joint graph holding
    native_batch_norm and native_batch_norm_backward), and its arguments."""

    def f(x, w, b, rm, rv):
        y = torch.ops.aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)[0]
        return (*torch.autograd.grad(y.square().sum(), (x, w, b)), y)

    g = torch.Generator().manual_seed(seed)
    args = [
        torch.randn(4, 3, 5, 5, generator=g, requires_grad=True),
        torch.rand(3, generator=g, requires_grad=True),
        torch.randn(3, generator=g, requires_grad=True),
        torch.zeros(3),
        torch.ones(3),
    ]
    return make_fx(f)(*args), args


def _fresh(args: list[torch.Tensor]) -> list[torch.Tensor]:
    return [a.detach().clone().requires_grad_(a.requires_grad) for a in args]


def test_joint_graph_native_batch_norm_and_backward():
    """make_fx of forward + autograd.grad: native_batch_norm / native_batch_norm_backward
    become _batch_norm_with_update / batch_norm_backward (with the forward's reserve);
    outputs, gradients and statistics bitwise."""
    gm, args = _joint_graph(seed=2)
    ref = copy.deepcopy(gm)
    bnswap.convert(gm)
    assert bn_ops(gm) == [
        "aten._batch_norm_with_update.default",
        "aten.batch_norm_backward.default",
    ]
    a1, a2 = _fresh(args), _fresh(args)
    for p, q in zip(ref(*a1), gm(*a2), strict=True):
        assert torch.equal(p, q)
    assert torch.equal(a1[3], a2[3]) and torch.equal(a1[4], a2[4])  # running stats


def test_a_backward_node_whose_forward_is_excluded_is_planned_as_skipped():
    """native_batch_norm_backward becomes batch_norm_backward only with its forward's
    reserve, so only when its forward node is rewritten too. With the forward excluded
    the plan said the backward was swapped ("1 of 2") while convert left both; the plan
    now says what convert does, and the graph runs bitwise as before."""
    gm, args = _joint_graph(seed=3)
    ref = copy.deepcopy(gm)
    for kw in (dict(exclude="native_batch_norm"), dict(include="*_backward")):
        p = bnswap.plan(gm, **kw)
        assert [(r.name, r.action) for r in p] == [
            ("native_batch_norm", "skip"),
            ("native_batch_norm_backward", "skip"),
        ]
        assert p.skipped[1].reason.startswith(
            "its forward node 'native_batch_norm' is left as it is ("
        ), p.skipped[1].reason
        assert bnswap.convert(gm, **kw) is gm
        assert (
            bn_ops(gm)
            == bn_ops(ref)
            == ["aten.native_batch_norm.default", "aten.native_batch_norm_backward.default"]
        )
    a1, a2 = _fresh(args), _fresh(args)
    for u, v in zip(ref(*a1), gm(*a2), strict=True):
        assert torch.equal(u, v)
    assert [r.action for r in bnswap.plan(gm)] == ["swap", "swap"]  # both together: swapped


def test_plan_of_a_program_one_row_per_node():
    ep = torch.export.export(model().train(), (X,))
    p = bnswap.plan(ep, device="cuda")
    assert isinstance(p, bnswap.ProgramPlan) and len(p) == 4 and not p.skipped
    assert [r.name for r in p] == [
        n for n in (n.name for n in ep.graph.nodes) if n.startswith("batch_norm")
    ]
    assert [r.becomes for r in p] == ["aten._batch_norm_with_update.default"] * 2 + [
        "aten._batch_norm_with_update_functional.default",
        "aten._batch_norm_with_update.default",
    ]
    if not torch.cuda.is_available():
        # stock's aten.batch_norm selects at run time: its cudnn_enabled=False (what
        # torch.export records) is ignored by torch (it said "Native" for every node).
        # By torch's rule: cuDNN for the affine layer; the affine=False layer (no weight),
        # the track_running_stats=False layer without weight and the BatchNorm1d on
        # (N, C) input (rank 2) run the native kernel.
        assert [r.kernel_before for r in p] == ["Cudnn (predicted)"] + ["Native (predicted)"] * 3
        # after convert: the consolidated ops with convert's stand-ins (cuDNN for the
        # affine=False layers too); the BatchNorm1d on (N, C) input stays native (rank 2)
        assert [r.kernel for r in p] == ["Cudnn (predicted)"] * 3 + ["Native (predicted)"]
    assert p.summary().startswith("bnswap plan: 4 of 4")
    assert bnswap.plan(ep, exclude="batch_norm_1").skipped[0].reason == "excluded by 'batch_norm_1'"
    assert bn_ops(ep.graph_module) == ["aten.batch_norm.default"] * 4  # a plan changes nothing
    for fn in (bnswap.plan, bnswap.convert):
        with pytest.raises(ValueError, match=r"backend='ort' takes an nn.Module"):
            fn(ep, "ort")
    with pytest.raises(TypeError, match="glob patterns"):
        bnswap.plan(ep, include=[nn.BatchNorm2d])


def test_plan_of_a_float16_program_predicts_torchs_rule():
    """Guards (a fresh user's review): a float16 model's program was predicted to run
    cuDNN on CUDA; torch takes half input to cuDNN only with float32 parameters."""
    if torch.cuda.is_available():
        pytest.skip("predictions are made only without a CUDA device")
    for train in (True, False):
        m = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).half().train(train)
        ep = torch.export.export(m, (torch.randn(2, 3, 5, 5).half(),))
        (row,) = bnswap.plan(ep, device="cuda")
        assert row.kernel_before == "Native (predicted)"
        if train:  # (what an eval node becomes: the off-CPU issue's choice)
            assert row.kernel == "Native (predicted)"
        mixed = nn.Sequential(nn.BatchNorm2d(4)).train(train)  # float32 parameters, half input
        ep = torch.export.export(mixed, (torch.randn(2, 4, 5, 5).half(),))
        (row,) = bnswap.plan(ep, device="cuda")
        assert row.kernel_before == "Cudnn (predicted)"
        if train:
            assert row.kernel == "Cudnn (predicted)"


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_bnswap_program_reaches_core_aten_like_stock(train):
    """run_decompositions() with the default table: only core ATen ops, stock's batch-norm
    ops, bitwise stock's outputs and buffer updates."""
    stock = model(no_stats=False).train(train)
    swapped = bnswap.convert(copy.deepcopy(stock))
    ps = torch.export.export(stock, (X,)).run_decompositions()
    pb = torch.export.export(swapped, (X,)).run_decompositions()
    assert bn_ops(pb.graph_module) == bn_ops(ps.graph_module)

    def overloads(ep):
        return {
            n.target
            for n in ep.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        }

    # stock's program is core ATen by definition (_native_batch_norm_legit_functional is
    # the functional form of the core-tagged _native_batch_norm_legit); bnswap's adds
    # only core-tagged ops (its stand-ins' aten.full, the empty-batch assertion)
    extra = overloads(pb) - overloads(ps)
    assert all(
        torch.Tag.core in op.tags for op in extra if op is not torch.ops.aten._assert_scalar.default
    ), extra
    same_runs(ps.module(), pb.module())


def test_core_aten_patch_applied_at_first_conversion_not_at_import():
    code = (
        "import torch, torch._decomp as d, bnswap\n"
        "from torch import nn\n"
        "op = torch.ops.aten._batch_norm_no_update.default\n"
        "assert op not in torch.export.default_decompositions()\n"
        "assert not hasattr(d._core_aten_decompositions_post_autograd, '_bnswap_patched')\n"
        "bnswap.convert(nn.BatchNorm1d(3))\n"
        "assert op in torch.export.default_decompositions()\n"
        "from torch._inductor.decomposition import decompositions\n"
        "from bnswap._compat import CORE_ATEN_DECOMPOSITIONS as ours\n"
        "assert decompositions[op] is not ours[op]  # inductor keeps torch's own\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.slow
def test_aot_inductor_package_of_a_bnswap_program_matches_eager(tmp_path):
    """aoti_compile_and_package / aoti_load_package of a converted training program on
    CPU: eager's output within float rounding. (An evaluation program converts to
    stock's own aten.batch_norm: AOTInductor compiles it as stock's.)"""
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    ep = bnswap.convert(torch.export.export(copy.deepcopy(stock), (X,)))
    assert "aten._batch_norm_with_update.default" in bn_ops(ep.graph_module)
    path = aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))
    run = aoti_load_package(path)
    torch.testing.assert_close(run(X), stock(X), rtol=1e-5, atol=1e-5)


def test_executorch_to_edge_takes_a_bnswap_program_like_stocks():
    """ExecuTorch's to_edge (core ATen only) on an eval program: it refused bnswap's
    _batch_norm_no_update; now it gets stock's ops. (Training programs: to_edge refuses
    stock's _native_batch_norm_legit_functional too.) Runs where executorch is installed
    (tested: executorch 1.5.1, torch 2.13)."""
    exir = pytest.importorskip("executorch.exir")
    stock = model(no_stats=False).eval()
    swapped = bnswap.convert(copy.deepcopy(stock))
    edges = [
        exir.to_edge(torch.export.export(m, (X,))).exported_program() for m in (stock, swapped)
    ]
    assert bn_ops(edges[1].graph_module) == bn_ops(edges[0].graph_module)
    assert torch.equal(edges[1].module()(X), edges[0].module()(X))


def test_plan_of_a_bnswap_program_says_already():
    ep = torch.export.export(bnswap.convert(model()).eval(), (X,))
    p = bnswap.plan(ep)
    assert len(p) == 4 and all(r.already and r.action == "keep" for r in p)
    # evaluation: stock's own op; the layer without statistics: a consolidated one
    assert [r.reason for r in p] == [
        "evaluation: aten.batch_norm picks its kernel when it runs (a swapped layer's op)"
    ] * 2 + ["already the consolidated op"] + [
        "evaluation: aten.batch_norm picks its kernel when it runs (a swapped layer's op)"
    ]
    assert p.summary() == (
        "bnswap plan: all 4 batch-norm nodes already on bnswap's ops: nothing would change"
    )
    assert repr(p) == "ProgramPlan(0 swap, 4 keep, 0 skip)"
    assert {r.kernel for r in p} == {"Native"}


def test_revert_of_a_program_names_to_stock_ops():
    """Guards (a newcomer's try): revert(program) said only "expects a torch.nn.Module"."""
    ep = bnswap.convert(torch.export.export(model().eval(), (X,)))
    with pytest.raises(
        TypeError,
        match=r"got ExportedProgram; a program's consolidated nodes "
        r"go back to stock's ops with bnswap.to_stock_ops",
    ):
        bnswap.revert(ep)


def test_revert_of_a_graph_module_undoes_convert_of_its_nodes():
    """Guards (a newcomer's try): revert(gm) after convert(gm) (the pt2e door) left the
    consolidated nodes in place, silently; it gives back stock's graph, which runs as
    the never-converted graph does."""
    ep = torch.export.export(model(), (X,))
    gm, stock = ep.module(), ep.module()
    assert bnswap.convert(gm) is gm and set(bn_ops(gm)) <= CONSOLIDATED
    assert bnswap.revert(gm) is gm
    assert bn_ops(gm) == bn_ops(stock) and not set(bn_ops(gm)) & CONSOLIDATED
    same_runs(stock, gm)


def test_a_program_pattern_that_matches_no_node_warns():
    """Guards (a newcomer's try): convert(ep, include=["nomatch"]) converted 0 nodes without
    a word, where a module's unmatched pattern warns."""
    ep = torch.export.export(model().eval(), (X,))
    with pytest.warns(
        bnswap.plan.__globals__["UnmatchedPatternWarning"],
        match=r"include pattern 'backbone\.\*' matches no batch-norm node "
        r"\(program patterns match node names, e.g. 'batch_norm_1'\)",
    ):
        bnswap.convert(ep, include=["backbone.*"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        bnswap.plan(ep, include=["batch_norm*"])  # matches: no warning


@pytest.mark.parametrize(
    "patterns", [{"include": []}, {"exclude": 42}, {"exclude": b"1"}], ids=["empty", "int", "bytes"]
)
def test_a_programs_empty_include_includes_nothing_and_a_bad_pattern_is_bnswaps_error(patterns):
    """Issue 46: as for a module, include=[] includes no node (it converted every one) and
    says so; exclude=42 gets bnswap's TypeError (it was list()'s "'int' object is not
    iterable"), before anything changes; bytes are one pattern (not list()'s ints)."""
    ep = torch.export.export(model().train(), (X,))
    if "exclude" in patterns:
        with pytest.raises(
            TypeError,
            match=r"^exclude takes glob patterns \(str\) on node "
            rf"names for a program, got {re.escape(repr(patterns['exclude']))}$",
        ):
            bnswap.convert(ep, **patterns)
        return
    seen, new = _unmatched_warnings(lambda: bnswap.convert(ep, **patterns))
    assert seen == [
        "bnswap: include is empty, so it matches no batch-norm node and none is swapped "
        "(include=None, the default, swaps every node)"
    ]
    assert new is ep and bn_ops(ep.module()) == bn_ops(
        torch.export.export(model().train(), (X,)).module()
    )
    assert {(r.action, r.reason) for r in bnswap.plan(ep, **patterns)} == {
        ("skip", "not matched by include")
    }


def _unmatched_warnings(fn):
    """The UnmatchedPatternWarning messages ``fn()`` gives (every one: "always"), and its
    result."""
    from bnswap.plan import UnmatchedPatternWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return [str(w.message) for w in caught if issubclass(w.category, UnmatchedPatternWarning)], out


def test_each_call_warns_once_for_a_program_pattern_that_matches_nothing():
    """Guards (a newcomer's report): ``bnswap.plan(ep, exclude=["nomatch*"]).apply()``
    warned twice (once at plan, once because apply planned again), and so did
    ``bnswap.convert(ep.module(), ...)`` (convert planned, then apply planned again). Each
    call the user makes warns once (apply of a plan that warned, not at all), and the
    program converts as before: bitwise the original's outputs and statistics."""
    text = (
        "bnswap: exclude pattern 'nomatch*' matches no batch-norm node (program patterns "
        "match node names, e.g. 'batch_norm_1')"
    )
    ep = torch.export.export(model(), (X,))
    seen, p = _unmatched_warnings(lambda: bnswap.plan(ep, exclude=["nomatch*"]))
    assert seen == [text]
    seen, new = _unmatched_warnings(p.apply)
    assert seen == []  # plan said it
    assert len(bn_ops(new.graph_module)) == 4 and set(bn_ops(new.graph_module)) <= CONSOLIDATED
    same_runs(ep.module(), new.module())
    for call in (
        lambda: bnswap.plan(ep, exclude=["nomatch*"]).apply(),
        lambda: bnswap.convert(ep, exclude=["nomatch*"]),
        lambda: bnswap.plan(ep.module(), exclude=["nomatch*"]).apply(),
        lambda: bnswap.convert(ep.module(), exclude=["nomatch*"]),
    ):
        seen, out = _unmatched_warnings(call)
        assert seen == [text]
        runs = out.module() if isinstance(out, torch.export.ExportedProgram) else out
        assert len(bn_ops(runs)) == 4 and set(bn_ops(runs)) <= CONSOLIDATED
        same_runs(ep.module(), runs)
    # a pattern that matches a node: no warning, from plan, apply or convert
    seen, out = _unmatched_warnings(
        lambda: bnswap.plan(ep, exclude=["batch_norm_1", "nomatch*"]).apply()
    )
    assert seen == [text] and bn_ops(out.graph_module).count("aten.batch_norm.default") == 1


def _layer_and_node_graph() -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A GraphModule holding both a BatchNorm layer and a stock batch-norm node: make_fx's
    native_batch_norm (training, statistics updated in place), then a call to its ``bn``
    submodule (a BatchNorm2d) on the output; and its arguments (x, w, b, rm, rv)."""

    def f(x, w, b, rm, rv):
        return torch.ops.aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)[0]

    g = torch.Generator().manual_seed(4)
    args = [
        torch.randn(4, 3, 5, 5, generator=g),
        torch.rand(3, generator=g),
        torch.randn(3, generator=g),
        torch.zeros(3),
        torch.ones(3),
    ]
    gm = make_fx(f)(*args)
    gm.add_submodule("bn", nn.BatchNorm2d(3))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        bn = gm.graph.call_module("bn", (out.args[0],))
    out.args = (bn,)
    gm.recompile()
    return gm, args


@pytest.mark.parametrize(
    "pattern, warned",
    [
        (
            "nomatch*",
            [
                "bnswap: exclude pattern 'nomatch*' matches no BatchNorm layer and no "
                "batch-norm node"
            ],
        ),
        ("bn", []),  # the layer (no node is named so)
        ("native_batch_norm", []),  # the node (no layer is named so)
    ],
)
def test_convert_of_a_graph_with_layers_and_nodes_warns_once_for_a_pattern_matching_neither(
    pattern, warned
):
    """Guards: convert of a GraphModule holding BatchNorm layers and stock batch-norm nodes
    planned the layers (warning for a pattern that matched no layer) and then the nodes
    (warning again for one that matched no node): a pattern that matched neither warned
    twice, and one that named the layer (or the node) warned that it matched nothing. It
    warns once now, for a pattern matching neither, and converts what the pattern leaves:
    outputs and statistics bitwise the unconverted graph's."""
    gm, args = _layer_and_node_graph()
    ref = copy.deepcopy(gm)
    seen, out = _unmatched_warnings(lambda: bnswap.convert(gm, exclude=pattern))
    assert out is gm and seen == warned
    assert bnswap.is_swapped(gm.bn) is (pattern != "bn")
    assert bn_ops(gm) == (
        ["aten.native_batch_norm.default"]
        if pattern == "native_batch_norm"
        else ["aten._batch_norm_with_update.default"]
    )
    a1 = [a.clone() for a in args]
    a2 = [a.clone() for a in args]
    for _ in range(2):
        assert torch.equal(gm(*a2), ref(*a1))
    for s, t in zip(
        [*a1, *ref.bn.state_dict().values()], [*a2, *gm.bn.state_dict().values()], strict=True
    ):
        assert torch.equal(s, t)


def test_convert_of_a_graph_with_layers_and_nodes_reads_a_generator_of_patterns_once():
    """Guards (a reviewer's find): both roads read the patterns; a generator was used up
    by the layers' plan, so the nodes' plan saw none: the node the pattern excluded was
    converted, and nothing warned. Both are left out now, without a warning."""
    gm, _ = _layer_and_node_graph()
    seen, out = _unmatched_warnings(
        lambda: bnswap.convert(gm, exclude=(p for p in ["bn", "native_batch_norm"]))
    )
    assert out is gm and seen == []
    assert not bnswap.is_swapped(gm.bn)
    assert bn_ops(gm) == ["aten.native_batch_norm.default"]


def test_convert_of_a_graph_with_layers_and_nodes_refuses_a_class_pattern_before_any_swap():
    """A node pattern is a name: a class (which layers take) is refused for the graph's
    nodes, now before any layer is swapped (the layers were swapped first, then the error
    left them so)."""
    gm, _ = _layer_and_node_graph()
    with pytest.raises(TypeError, match=r"include takes glob patterns \(str\) on node names"):
        bnswap.convert(gm, include=[nn.BatchNorm2d])
    assert not bnswap.is_swapped(gm.bn)
    assert bn_ops(gm) == ["aten.native_batch_norm.default"]


def test_convert_program_shows_no_warning_of_torchs_own_deep_copy():
    """A newcomer's report: ``bnswap.convert(program)`` showed torch's FutureWarning about
    its pytree API (``isinstance(treespec, LeafSpec)``), raised by torch's deep copy of
    the program, which the user cannot act on. The converted program is still right."""
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    ep = torch.export.export(m, (torch.randn(2, 3, 8, 8),))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = bnswap.convert(ep)
    assert not [w for w in seen if "LeafSpec" in str(w.message)], [str(w.message) for w in seen]
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(out.module()(x), m(x))


def test_convert_of_a_graph_without_shape_metadata_when_no_stand_in_is_needed():
    """Guards (a helper's find): a ``symbolic_trace`` graph calling
    ``aten.native_batch_norm`` with weight, bias and statistics has no ``meta['val']``;
    plan said swap, and convert crashed reading a dtype only the stand-ins need
    (AttributeError: 'NoneType' object has no attribute 'dtype'). It now converts and
    runs bitwise like the original, running statistics included."""

    class Direct(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.rand(4) + 0.5)
            self.b = nn.Parameter(torch.randn(4))
            self.register_buffer("rm", torch.zeros(4))
            self.register_buffer("rv", torch.ones(4))

        def forward(self, x):
            return torch.ops.aten.native_batch_norm.default(
                x, self.w, self.b, self.rm, self.rv, True, 0.1, 1e-5
            )[0]

    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(Direct())
    ref = copy.deepcopy(gm)
    assert [r.action for r in bnswap.plan(gm).rows] == ["swap"]
    bnswap.convert(gm)
    assert bn_ops(gm) == ["aten._batch_norm_with_update.default"]
    for _ in range(2):
        x = torch.randn(3, 4, 5, 5)
        assert torch.equal(gm(x), ref(x))
    assert torch.equal(gm.rm, ref.rm) and torch.equal(gm.rv, ref.rv)
