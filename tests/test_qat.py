"""pt2e quantization-aware training on the consolidated ops (issue 31, items 1 and 2).

In a process that holds a swapped layer, torchao's ``prepare_qat_pt2e`` of a converted
model's exported graph returns a prepared graph whose batch-norm nodes are
``aten._batch_norm_with_update`` (cuDNN selectable on CUDA), not stock's
``aten.batch_norm(..., cudnn_enabled=False)`` (the native kernel: pytorch issue 111384);
``move_exported_model_to_eval`` / ``_train`` switch them; ``convert_pt2e`` folds and
quantizes as stock. Every case runs the whole flow on stock ``nn.BatchNorm`` and on an
identical converted copy and compares bit for bit on the CPU: parameters, gradients,
running statistics, observer / fake-quant state after several steps, eval outputs, the
quantized graph, its constants and outputs.

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
from tests._helpers import outcome, state_diff, to_stock
from tests._pt2e import (
    NO_UPDATE,
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


@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
@pytest.mark.parametrize("name", list(MODELS))
def test_qat_prepared_graph_trains_on_the_consolidated_ops_like_stock(name, quantizer):
    """Guards: the prepared graph of a converted model was left on stock's
    aten.batch_norm(cudnn_enabled=False) (the native kernel on CUDA), and after
    move_exported_model_to_eval / _train too; a naive rewrite left convert_pt2e's fold
    unapplied. Bitwise stock through 3 QAT steps, eval, train again, convert_pt2e (with
    and without moving to eval first)."""
    stock, swapped, shape = build(name)
    xs = batches(shape, 4)
    ps, pb = prepared(stock, shape, quantizer), prepared(swapped, shape, quantizer)
    n_bn = len(bn_ops(ps))
    assert n_bn > 0 and bn_ops(ps) == [STOCK] * n_bn
    assert bn_ops(pb) == [WITH_UPDATE] * n_bn
    assert to_stock(copy.deepcopy(pb))[1] == n_bn
    assert torch.equal(train(pb, xs[:3]), train(ps, xs[:3]))
    assert state_diff(ps, pb) == []  # params, grads, running stats, observers / fake-quant
    for p in (ps, pb):
        move_exported_model_to_eval(p)
    assert bn_ops(pb) == [NO_UPDATE] * n_bn and bn_ops(ps) == [STOCK] * n_bn
    assert torch.equal(pb(xs[3]), ps(xs[3])) and state_diff(ps, pb) == []
    for p in (ps, pb):
        move_exported_model_to_train(p)
    assert bn_ops(pb) == [WITH_UPDATE] * n_bn
    assert torch.equal(train(pb, xs[3:]), train(ps, xs[3:])) and state_diff(ps, pb) == []
    for to_eval in (False, True):
        qs, qb = copy.deepcopy(ps), copy.deepcopy(pb)
        if to_eval:
            move_exported_model_to_eval(qs)
            move_exported_model_to_eval(qb)
        qs, qb = convert_pt2e(qs), convert_pt2e(qb)
        assert graph_of(qb) == graph_of(qs), to_eval
        if name.startswith("conv"):  # folded into the convolution
            assert bn_ops(qb) == []
        assert state_diff(qs, qb) == []
        assert torch.equal(qb(xs[0]), qs(xs[0]))


@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
def test_ptq_prepare_pt2e_keeps_the_consolidated_ops_like_stock(quantizer):
    """prepare_pt2e (post-training) folds eval batch norms into the Linear / Conv before
    them as stock; one left (after a ReLU) runs _batch_norm_no_update; calibration and
    convert_pt2e as stock."""
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
        ops = bn_ops(p)
        for x in xs[:2]:
            p(x)
        q = convert_pt2e(p)
        out.append((ops, p, graph_of(q), q(xs[2])))
    (os_, ps, gs, ys), (ob, pb, gb, yb) = out
    assert os_ == [STOCK] and ob == [NO_UPDATE]
    assert state_diff(ps, pb) == [] and gb == gs and torch.equal(yb, ys)


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

    for device, dtype in (("cpu", torch.float64), ("meta", torch.float32)):
        assert run(pb, device, dtype) == run(ps, device, dtype), (device, dtype)
    assert bn_ops(pb) == [WITH_UPDATE] * 2


def test_stock_models_prepared_graph_converts_with_bnswap_convert():
    """The door for a model bnswap never saw: bnswap.convert(prepared) puts a stock
    model's prepared graph on the consolidated ops, and it trains, switches and converts
    as the untouched one."""
    stock, _, shape = build("conv_bn_relu")
    ps = prepared(stock, shape, "xnnpack")
    pb = bnswap.convert(copy.deepcopy(ps))
    assert bn_ops(pb) == [WITH_UPDATE] and bn_ops(ps) == [STOCK]
    xs = batches(shape, 4)
    assert torch.equal(train(pb, xs[:3]), train(ps, xs[:3])) and state_diff(ps, pb) == []
    move_exported_model_to_eval(ps)
    move_exported_model_to_eval(pb)
    assert bn_ops(pb) == [NO_UPDATE]
    assert torch.equal(pb(xs[3]), ps(xs[3]))
    qs, qb = convert_pt2e(ps), convert_pt2e(pb)
    assert graph_of(qb) == graph_of(qs) and torch.equal(qb(xs[3]), qs(xs[3]))


def test_momentum_none_is_refused_before_torchao_and_the_graph_is_left_as_it_was():
    """Stock cannot export a momentum=None layer; bnswap's graph of one would lose its
    cumulative update in torchao's fold: refused, the user's graph untouched."""
    torch.manual_seed(0)
    model = bnswap.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None)))
    gm = torch.export.export(model, (batches((4, 3, 8, 8), 1)[0],)).module()
    before = graph_of(gm)
    with pytest.raises(NotImplementedError, match="momentum=None"):
        prepare_qat_pt2e(gm, xnnpack())
    assert graph_of(gm) == before


def test_plan_of_a_graph_module_lists_its_batch_norm_nodes():
    """Guards: bnswap.plan(ep.module()) of a converted model's graph said "0 of 0
    BatchNorm layers"; now one row per node, as for the ExportedProgram: consolidated
    nodes `keep`, with their kernel per device; the prepared QAT graph too."""
    stock, swapped, shape = build("conv_nobias_bn_eps_momentum")
    ep = torch.export.export(swapped, (batches(shape, 1)[0],))
    for program in (ep, ep.module(), prepared(swapped, shape, "xnnpack")):
        p = bnswap.plan(program, device="cuda")
        assert [r.action for r in p] == ["keep", "keep"], str(p)
        assert [r.op for r in p] == [WITH_UPDATE] * 2
        expected = "Cudnn" if torch.cuda.is_available() else "Cudnn (predicted)"
        assert [r.kernel for r in p] == [expected] * 2
        assert [r.kernel for r in bnswap.plan(program, device="cpu")] == ["Native"] * 2
        assert p.summary() == (
            "bnswap plan: all 2 batch-norm nodes already on the consolidated ops: "
            "nothing would change"
        )
    mixed = bnswap.plan(prepared(stock, shape, "xnnpack"))
    assert [r.action for r in mixed] == ["swap", "swap"]


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


@pytest.mark.parametrize("case", ["too_old", "helper_moved", "prepare_moved"])
def test_an_older_or_changed_torchao_warns_once_naming_what_stays_on_stocks_op(case, monkeypatch):
    """The version gate: torchao older than 0.18, or a helper bnswap hooks no longer
    called by name, leaves torchao as it is (the user's graph too) with one warning
    that names what stays on stock's aten.batch_norm and the calls that do it by hand."""
    import torchao

    from bnswap import _compat

    monkeypatch.setattr(_compat, "_unpatched_warned", set())
    source = _FAKE_PT2E
    if case == "too_old":
        monkeypatch.setattr(torchao, "__version__", "0.17.0")
    elif case == "helper_moved":
        source = source.replace(
            "prepare(model, _get_node_name_to_scope(model), is_qat=True)",
            "prepare(model, {}, is_qat=True)",
        )
    else:
        source = source.replace(
            "return prepare(model, _get_node_name_to_scope(model), is_qat=",
            "return model or _get_node_name_to_scope(model) or (",
        )
    mod, before = _fake_pt2e(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        applied = _compat.patch_torchao_pt2e(mod)
        if case == "too_old":  # the other torchao module: no second warning
            assert _compat.patch_torchao_export_utils(mod) is False
    messages = [str(w.message) for w in caught if "bnswap" in str(w.message)]
    assert len(messages) == 1, messages
    assert (
        "stay on stock's aten.batch_norm" in messages[0]
        or "stays on stock's aten.batch_norm" in messages[0]
        or "prepared graphs stay on stock's aten.batch_norm" in messages[0]
    ), messages[0]
    if case == "too_old":
        assert "torchao 0.17 is older than 0.18" in messages[0]
    if case != "prepare_moved":
        assert applied is False and dict(vars(mod)) == before  # nothing patched
        assert "bnswap.to_stock_ops(graph) before" in messages[0]
    else:  # prepare_pt2e / _qat see stock's graph; the prepared graph stays stock's
        assert applied is True and mod.prepare is before["prepare"]
        assert mod._get_node_name_to_scope is not before["_get_node_name_to_scope"]
        assert (
            mod._convert_to_reference_decomposed_fx is before["_convert_to_reference_decomposed_fx"]
        )
        assert "bnswap.convert(prepared)" in messages[0]


def test_nodes_bnswap_cannot_tell_apart_stay_as_torchao_made_them_with_one_warning():
    """A graph whose batch-norm nodes torchao changed in number, some stock's: bnswap
    cannot tell which came from swapped layers, so none is rewritten, and one warning
    names the nodes left on stock's op."""
    from bnswap import _compat

    torch.manual_seed(0)
    gm = torch.export.export(
        nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3)).train(), (torch.randn(4, 3),)
    ).module()
    before = graph_of(gm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _compat._consolidated_again(gm, [True, False, True], "prepare_qat_pt2e") == 0
    assert graph_of(gm) == before
    [w] = [w for w in caught if "bnswap" in str(w.message)]
    assert str(w.message).startswith(
        "bnswap: prepare_qat_pt2e: 2 batch-norm nodes of swapped layers ('batch_norm', "
        "'batch_norm_1') stay on stock's aten.batch_norm (cudnn_enabled=False: the native "
        "kernel on CUDA, pytorch issue 111384): torchao turned the graph's 3 batch-norm "
        "nodes into 2"
    )


def test_qat_example_gives_stocks_figures():
    """examples/qat_pt2e.py (the issue's flow on the digits data, a tiny budget): stock
    and bnswap print the same float / int8 accuracies; int8 logits and the final QAT
    state are bitwise identical; bnswap's prepared graph trains on the consolidated op."""
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
    assert n > 0 and b["batch_norm_ops"] == {"_batch_norm_with_update": n}


def _guide_snippets() -> list[str]:
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "qat.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_the_guides_snippets_run_as_written_and_give_stocks_quantized_model(tmp_path, monkeypatch):
    """docs/qat.md's flow as written (on the CPU: its device is "cpu" without CUDA) gives
    the quantized model stock's flow gives, the same snippet with the model left stock
    (its one bnswap call removed): the same quantized graph and outputs, bit for bit; its
    prepared graph trained on the consolidated op. Its loaded-program snippet runs as
    written after it, on the program of the snippet's model saved where it says."""
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
            exec(compile("\n" * source[:cut].count("\n") + source[cut:], "docs/qat.md", "exec"), ns)
        runs[name] = ns
    b, s = runs["bnswap"], runs["stock"]
    assert str(b["device"]) == "cpu" or torch.cuda.is_available()
    assert b["trained_on"] == [WITH_UPDATE] * 2 and s["trained_on"] == [STOCK] * 2
    assert graph_of(b["quantized"]) == graph_of(s["quantized"]) and bn_ops(b["quantized"]) == []
    assert torch.equal(b["quantized"](b["x"]), s["quantized"](s["x"]))
    assert state_diff(b["quantized"], s["quantized"]) == []
    monkeypatch.chdir(tmp_path)
    torch.export.save(torch.export.export(b["model"], (b["x"],)), "model_bnswap.pt2")
    exec(compile(loaded, "docs/qat.md (loaded program)", "exec"), b)
    assert bn_ops(b["prepared"]) == [WITH_UPDATE] * 2
    # the fold, as in the flow above: torchao's QAT pattern scales each conv's weight
    assert sum(n.target is torch.ops.aten.sqrt.default for n in b["prepared"].graph.nodes) == 2
