"""pt2e quantization-aware training of converted models (issue 31, items 1 and 2; issue 45).

A converted model's exported training graph holds ``aten._batch_norm_with_update``,
which torchao's conv-BN fold, quantizer patterns and train / eval switch do not match.
bnswap's torchao patch hands torchao the graph on stock's ``aten.batch_norm``
(``bnswap.to_stock_ops``) before ``prepare_pt2e`` / ``prepare_qat_pt2e``,
``move_exported_model_to_eval`` / ``_train`` and ``convert_pt2e`` read it, and puts
nothing back: the prepared, switched and quantized graphs are stock's, node for node
(stock's ``aten.batch_norm`` picks its kernel when it runs: its ``cudnn_enabled``
argument is read by no torch release). Every case runs the whole flow on stock
``nn.BatchNorm`` and on an identical converted copy and compares bit for bit on the CPU:
the graphs, parameters, gradients, running statistics, observer / fake-quant state after
several steps, eval outputs, the quantized graph, its constants and outputs, and running
statistics that inference leaves as they are.

torchao's pattern exports are memoized module-wide (:func:`tests._pt2e.memoize_patterns`:
each call sees the graph a fresh export gives).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import bnswap
from tests._helpers import outcome, state_diff
from tests._pt2e import (
    QUANTIZERS,
    STOCK,
    WITH_UPDATE,
    bn_ops,
    graph_of,
    memoize_patterns,
    train,
    visible_bn,
    xnnpack,
)

pytest.importorskip("torchao")
from torchao.quantization.pt2e import (
    move_exported_model_to_eval,
    move_exported_model_to_train,
)
from torchao.quantization.pt2e.quantize_pt2e import (
    convert_pt2e,
    prepare_pt2e,
    prepare_qat_pt2e,
)


@pytest.fixture(scope="module", autouse=True)
def memoized_patterns():
    with memoize_patterns():
        yield


_bn = visible_bn


def conv_bn():
    return nn.Sequential(nn.Conv2d(3, 4, 3), _bn(nn.BatchNorm2d(4))), (4, 3, 8, 8)


def conv_bn_relu():
    return nn.Sequential(nn.Conv2d(3, 4, 3), _bn(nn.BatchNorm2d(4)), nn.ReLU()), (4, 3, 8, 8)


def conv_nobias_bn_eps_momentum():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, bias=False),
        _bn(nn.BatchNorm2d(4, eps=1e-3, momentum=0.3)),
        nn.ReLU(),
        nn.Conv2d(4, 4, 1),
        _bn(nn.BatchNorm2d(4)),
    ), (4, 3, 8, 8)


def linear_bn1d():
    return nn.Sequential(nn.Linear(12, 6), _bn(nn.BatchNorm1d(6)), nn.ReLU()), (8, 12)


MODELS = {f.__name__: f for f in (conv_bn, conv_bn_relu, conv_nobias_bn_eps_momentum, linear_bn1d)}


def build(name: str) -> tuple[nn.Module, nn.Module, tuple[int, ...]]:
    torch.manual_seed(0)
    model, shape = MODELS[name]()
    stock = model.train()
    return stock, bnswap.convert(copy.deepcopy(stock)), shape


def batches(shape: tuple[int, ...], n: int, dtype: torch.dtype = torch.float32) -> list:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(n)]


def prepared(model: nn.Module, shape: tuple[int, ...], quantizer: str) -> torch.fx.GraphModule:
    gm = torch.export.export(model, (batches(shape, 1)[0],)).module()
    return prepare_qat_pt2e(gm, QUANTIZERS[quantizer]())


def quantized_like_stock(ps, pb, xs, to_eval: bool, folded: bool) -> None:
    """convert_pt2e of copies of stock's (``ps``) and bnswap's (``pb``) prepared graphs,
    moved to eval first (``to_eval``) or in torchao's tutorial order (a train-mode copy
    converted, the quantized model moved to eval after): the same quantized graph node
    for node (``folded``: no batch norm left), constants and outputs, and inference calls
    that leave every running statistic as it was (:func:`inference_like_stock`)."""
    qs, qb = copy.deepcopy(ps), copy.deepcopy(pb)
    if to_eval:
        move_exported_model_to_eval(qs)
        move_exported_model_to_eval(qb)
    qs, qb = convert_pt2e(qs), convert_pt2e(qb)
    if not to_eval:
        move_exported_model_to_eval(qs)
        move_exported_model_to_eval(qb)
    assert graph_of(qb) == graph_of(qs), to_eval
    assert (bn_ops(qb) == []) == folded, bn_ops(qb)
    assert state_diff(qs, qb) == []
    inference_like_stock(qb, qs, xs)


def inference_like_stock(q, ref, xs) -> None:
    """Two inference calls of ``q`` and of stock's ``ref``: the same outputs and the same
    state after, and neither changes a running statistic. (What they may change: torchao's
    switch leaves a BatchNorm1d's ``num_batches_tracked += 1``, stock's model counts
    calls.)"""
    moved = []
    for m in (q, ref):
        before = copy.deepcopy(m)
        moved.append(([m(x) for x in xs[:2]], state_diff(before, m)))
    (ys, keys), (ys_ref, keys_ref) = moved
    assert keys == keys_ref and not [k for k in keys if "running_" in k], keys
    assert all(torch.equal(y, r) for y, r in zip(ys, ys_ref, strict=True))
    assert state_diff(ref, q) == []


@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
@pytest.mark.parametrize("name", list(MODELS))
def test_qat_flow_of_a_converted_models_graph_is_stocks(name, quantizer):
    """Guards: torchao's fold matched nothing in a converted model's graph (no fold, a
    switch to eval that left the statistics updating), and a naive rewrite left
    convert_pt2e's fold unapplied. The prepared graph is stock's node for node, and so is
    every later one; bitwise stock's through 3 QAT steps, eval, train again, convert_pt2e
    (moved to eval before, or after as torchao's tutorial does)."""
    stock, swapped, shape = build(name)
    xs = batches(shape, 4)
    ps, pb = prepared(stock, shape, quantizer), prepared(swapped, shape, quantizer)
    n_bn = len(bn_ops(ps))
    assert n_bn > 0 and bn_ops(ps) == [STOCK] * n_bn
    assert graph_of(pb) == graph_of(ps)  # stock's prepared graph, the conv-BN fold too
    assert torch.equal(train(pb, xs[:3]), train(ps, xs[:3]))
    assert state_diff(ps, pb) == []  # params, grads, running stats, observers / fake-quant
    for p in (ps, pb):
        move_exported_model_to_eval(p)
    assert graph_of(pb) == graph_of(ps)
    assert torch.equal(pb(xs[3]), ps(xs[3])) and state_diff(ps, pb) == []
    for p in (ps, pb):
        move_exported_model_to_train(p)
    assert graph_of(pb) == graph_of(ps)
    assert torch.equal(train(pb, xs[3:]), train(ps, xs[3:])) and state_diff(ps, pb) == []
    for to_eval in (True, False):
        quantized_like_stock(ps, pb, xs, to_eval, folded=name.startswith("conv"))


@pytest.mark.parametrize("name", ["conv_bn_relu", "linear_bn1d"])
def test_switch_of_a_converted_models_exported_graph_is_stocks(name):
    """Guards: move_exported_model_to_eval of a converted model's exported training graph
    (not prepared) matched no batch norm, so "eval" kept updating the running statistics.
    Switched, it is stock's graph node for node: bitwise stock's outputs, statistics that
    calls leave as they were; switched back, stock's training graph and steps."""
    stock, swapped, shape = build(name)
    xs = batches(shape, 4)
    gs = torch.export.export(stock, (xs[0],)).module()
    gb = torch.export.export(swapped, (xs[0],)).module()
    assert bn_ops(gs) == [STOCK] and bn_ops(gb) == [WITH_UPDATE]
    for g in (gs, gb):
        move_exported_model_to_eval(g)
    assert graph_of(gb) == graph_of(gs)
    inference_like_stock(gb, gs, xs)
    for g in (gs, gb):
        move_exported_model_to_train(g)
    assert graph_of(gb) == graph_of(gs)
    assert torch.equal(train(gb, xs[2:]), train(gs, xs[2:])) and state_diff(gs, gb) == []


@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
def test_ptq_flow_of_a_converted_models_eval_graph_is_stocks(quantizer):
    """prepare_pt2e (post-training) of a converted model in eval: its exported graph is
    stock's (a swapped layer's evaluation is stock's call), so torchao folds the batch
    norms after a Linear / Conv and keeps one after a ReLU as for stock; calibration and
    convert_pt2e as stock, bit for bit."""
    torch.manual_seed(0)
    stock = nn.Sequential(
        nn.Linear(12, 6),
        _bn(nn.BatchNorm1d(6)),
        nn.ReLU(),
        nn.Linear(6, 6),
        nn.ReLU(),
        _bn(nn.BatchNorm1d(6)),
    ).eval()
    swapped = bnswap.convert(copy.deepcopy(stock))
    xs = batches((8, 12), 3)
    out = []
    for m in (stock, swapped):
        gm = torch.export.export(m, (xs[0],)).module()
        p = prepare_pt2e(gm, QUANTIZERS[quantizer](qat=False))
        graph = graph_of(p)
        for x in xs[:2]:
            p(x)
        q = convert_pt2e(p)
        out.append((bn_ops(p), graph, p, graph_of(q), q(xs[2])))
    (os_, gs, ps, qgs, ys), (ob, gb, pb, qgb, yb) = out
    assert os_ == ob == [STOCK] and gb == gs
    assert state_diff(ps, pb) == [] and qgb == qgs and torch.equal(yb, ys)


def test_prepared_graph_moves_like_stocks():
    """.double() and .to("meta") (standing in for CUDA: no device or dtype of bnswap's
    own in the graph) move the prepared graph as stock's: the same state, the same
    outputs or the same error (torchao's fake quantizers keep float32 scales)."""
    stock, swapped, shape = build("conv_nobias_bn_eps_momentum")
    ps, pb = prepared(stock, shape, "xnnpack"), prepared(swapped, shape, "xnnpack")
    x = batches(shape, 1)[0]

    def run(p, device, dtype):
        kind, y = outcome(lambda: p.to(device, dtype)(x.to(device, dtype)))
        if kind == "ok":
            y = (
                y.device.type,
                y.dtype,
                tuple(y.shape),
                y.tolist() if y.device.type != "meta" else None,
            )
        return kind, y, [(k, v.device.type, v.dtype) for k, v in p.state_dict().items()]

    assert graph_of(pb) == graph_of(ps)
    for device, dtype in (("cpu", torch.float64), ("meta", torch.float32)):
        assert run(pb, device, dtype) == run(ps, device, dtype), (device, dtype)


def test_a_prepared_graph_bnswap_converts_switches_and_quantizes_as_stocks():
    """bnswap.convert(prepared), which bnswap.plan invites (it lists a prepared graph's
    stock training nodes as `swap`), puts the consolidated ops into the prepared graph:
    it trains bitwise as stock's, and the switch and convert_pt2e read it on stock's ops
    (their patches: without convert_pt2e's, torchao's tutorial order, a train-mode copy
    converted, leaves the batch norm unfolded). Moved to eval it is stock's graph, node
    for node; back in train, stock's too."""
    stock, _, shape = build("conv_bn_relu")
    ps = prepared(stock, shape, "xnnpack")
    pb = bnswap.convert(copy.deepcopy(ps))
    assert bn_ops(pb) == [WITH_UPDATE] and bn_ops(ps) == [STOCK]
    xs = batches(shape, 4)
    assert torch.equal(train(pb, xs[:3]), train(ps, xs[:3])) and state_diff(ps, pb) == []
    quantized_like_stock(ps, pb, xs, to_eval=False, folded=True)
    for p in (ps, pb):
        move_exported_model_to_eval(p)
    assert graph_of(pb) == graph_of(ps)
    assert torch.equal(pb(xs[3]), ps(xs[3])) and state_diff(ps, pb) == []
    quantized_like_stock(ps, pb, xs, to_eval=True, folded=True)
    for p in (ps, pb):
        move_exported_model_to_train(p)
    assert graph_of(pb) == graph_of(ps)


def test_momentum_none_is_refused_before_torchao_and_the_graph_is_left_as_it_was():
    """Stock cannot export a momentum=None layer; bnswap's graph of one would lose its
    cumulative update in torchao's fold or switch: refused by each torchao call bnswap's
    patch reads the graph for; prepare and convert_pt2e leave the user's graph as it was
    (move_exported_model_to_eval has run torchao's own first steps by then: its dropout
    switch, which drops dead nodes, and its mark)."""
    torch.manual_seed(0)
    model = bnswap.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None)))
    gm = torch.export.export(model, (batches((4, 3, 8, 8), 1)[0],)).module()
    before = graph_of(gm)
    for call in (lambda: prepare_qat_pt2e(gm, xnnpack()), lambda: convert_pt2e(gm)):
        with pytest.raises(NotImplementedError, match="momentum=None"):
            call()
        assert graph_of(gm) == before
    with pytest.raises(NotImplementedError, match="momentum=None"):
        move_exported_model_to_eval(gm)
    assert bn_ops(gm) == [WITH_UPDATE]


def test_plan_of_a_graph_module_lists_its_batch_norm_nodes():
    """Guards: bnswap.plan(ep.module()) of a converted model's graph said "0 of 0
    BatchNorm layers"; now one row per node, as for the ExportedProgram: consolidated
    nodes `keep`, with their kernel per device. A prepared QAT graph is stock's: the same
    rows for a converted model's as for stock's (node names aside: the rewrite names the
    nodes it makes)."""
    stock, swapped, shape = build("conv_nobias_bn_eps_momentum")
    ep = torch.export.export(swapped, (batches(shape, 1)[0],))
    for program in (ep, ep.module()):
        p = bnswap.plan(program, device="cuda")
        assert [r.action for r in p] == ["keep", "keep"], str(p)
        assert [r.op for r in p] == [WITH_UPDATE] * 2
        expected = "Cudnn" if torch.cuda.is_available() else "Cudnn (predicted)"
        assert [r.kernel for r in p] == [expected] * 2
        assert [r.kernel for r in bnswap.plan(program, device="cpu")] == ["Native"] * 2
        assert p.summary() == (
            "bnswap plan: all 2 batch-norm nodes already on bnswap's ops: nothing would change"
        )
    rows = [
        [(r.op, r.action, r.becomes) for r in bnswap.plan(prepared(m, shape, "xnnpack"))]
        for m in (stock, swapped)
    ]
    assert rows[1] == rows[0] and [r[1] for r in rows[0]] == ["swap", "swap"]


_FAKE_PT2E = """
def _get_node_name_to_scope(model):
    return {}
def prepare(model, scope, is_qat, obs_or_fq_callback=None):
    return model
def _convert_to_reference_decomposed_fx(model):
    return model
def prepare_pt2e(model, quantizer):
    return prepare(model, _get_node_name_to_scope(model), is_qat=False)
def prepare_qat_pt2e(model, quantizer):
    return prepare(model, _get_node_name_to_scope(model), is_qat=True)
def convert_pt2e(model):
    return _convert_to_reference_decomposed_fx(model)
"""


def _fake_pt2e(source: str = _FAKE_PT2E):
    import types

    mod = types.ModuleType("fake_torchao_quantize_pt2e")
    exec(source, mod.__dict__)
    return mod, dict(vars(mod))


@pytest.mark.parametrize("case", ["too_old", "helper_moved", "convert_helper_moved"])
def test_an_older_or_changed_torchao_is_left_as_it_is_with_one_warning(case, monkeypatch):
    """The version gate: torchao older than 0.18, or a helper bnswap wraps no longer
    called by name (prepare's or convert_pt2e's), leaves that torchao module as it is
    (the user's graph too) with one warning that says what torchao then misses and the
    call that does it by hand."""
    import torchao

    from bnswap._compat import torchao as torchao_patches

    monkeypatch.setattr(torchao_patches, "_unpatched_warned", set())
    source = _FAKE_PT2E
    if case == "too_old":
        monkeypatch.setattr(torchao, "__version__", "0.17.0")
    elif case == "helper_moved":
        source = source.replace(
            "prepare(model, _get_node_name_to_scope(model), is_qat=True)",
            "prepare(model, {}, is_qat=True)",
        )
    else:
        source = source.replace("return _convert_to_reference_decomposed_fx(model)", "return model")
    mod, before = _fake_pt2e(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        applied = torchao_patches.patch_torchao_pt2e(mod)
        if case == "too_old":  # the other torchao module: no second warning
            assert torchao_patches.patch_torchao_export_utils(mod) is False
    messages = [str(w.message) for w in caught if "bnswap" in str(w.message)]
    assert len(messages) == 1, messages
    assert applied is False and dict(vars(mod)) == before  # nothing patched
    assert "do not match (silently" in messages[0], messages[0]
    assert "bnswap.to_stock_ops(graph) before each of those calls" in messages[0]
    assert "cudnn" not in messages[0].lower()
    expected = {
        "too_old": "torchao 0.17 is older than 0.18",
        "helper_moved": "prepare_pt2e / prepare_qat_pt2e no longer call _get_node_name_to_scope",
        "convert_helper_moved": "convert_pt2e no longer calls _convert_to_reference_decomposed_fx",
    }[case]
    assert expected in messages[0], messages[0]


def test_qat_example_gives_stocks_figures():
    """examples/qat_pt2e.py (the issue's flow on the digits data, a tiny budget): stock
    and bnswap print the same float / int8 accuracies; int8 logits and the final QAT
    state are bitwise identical; bnswap's prepared graph holds stock's op, as stock's."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "qat_pt2e.py"
    spec = importlib.util.spec_from_file_location("qat_pt2e", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(epochs=1, qat_epochs=1, limit=2, width_mult=0.25, num_threads=None)
    assert res["identical"] is True
    s, b = res["stock"], res["bnswap"]
    assert (s["float_acc"], s["int8_acc"]) == (b["float_acc"], b["int8_acc"])
    n = s["batch_norm_ops"]["batch_norm"]
    assert n > 0 and b["batch_norm_ops"] == s["batch_norm_ops"] == {"batch_norm": n}


def _guide_snippets() -> list[str]:
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "qat.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_the_guides_snippets_run_as_written_and_give_stocks_quantized_model(tmp_path, monkeypatch):
    """docs/qat.md's flow as written (on the CPU: its device is "cpu" without CUDA) gives
    the quantized model stock's flow gives, the same snippet with the model left stock
    (its one bnswap call removed): the same prepared graph (stock's), node for node, the
    same quantized graph and outputs, bit for bit. Its loaded-program snippet runs as
    written after it, on the program of the snippet's model saved where it says, and
    prepares the same graph."""
    flow, loaded = _guide_snippets()
    assert "bnswap.convert(Net().train())" in flow and ".to(device)" in flow
    runs = {}
    for name, source in (
        ("bnswap", flow),
        ("stock", flow.replace("bnswap.convert(Net().train())", "Net().train()")),
    ):
        torch.manual_seed(0)
        ns: dict = {}
        # in two parts, to see the prepared graph before convert_pt2e (which rewrites it)
        cut = source.index("move_exported_model_to_eval(prepared)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compile(source[:cut], f"docs/qat.md ({name})", "exec"), ns)
            ns["trained_on"] = bn_ops(ns["prepared"])
            ns["prepared_graph"] = graph_of(ns["prepared"])
            exec(compile("\n" * source[:cut].count("\n") + source[cut:], "docs/qat.md", "exec"), ns)
        runs[name] = ns
    b, s = runs["bnswap"], runs["stock"]
    assert str(b["device"]) == "cpu" or torch.cuda.is_available()
    assert b["trained_on"] == s["trained_on"] == [STOCK] * 2
    assert b["prepared_graph"] == s["prepared_graph"]
    assert graph_of(b["quantized"]) == graph_of(s["quantized"]) and bn_ops(b["quantized"]) == []
    assert torch.equal(b["quantized"](b["x"]), s["quantized"](s["x"]))
    assert state_diff(b["quantized"], s["quantized"]) == []
    monkeypatch.chdir(tmp_path)
    torch.export.save(torch.export.export(b["model"], (b["x"],)), "model_bnswap.pt2")
    exec(compile(loaded, "docs/qat.md (loaded program)", "exec"), b)
    assert graph_of(b["prepared"]) == b["prepared_graph"]  # stock's, as in the flow above
    # the fold: torchao's QAT pattern scales each conv's weight
    assert sum(n.target is torch.ops.aten.sqrt.default for n in b["prepared"].graph.nodes) == 2
