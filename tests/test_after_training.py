"""The model's life after training: exporting, scripting, fusing, quantizing and counting
a converted model gives what stock gives (issue: "After training").

One test per consumer, each on the issue's net (``Conv2d(3,8,3) -> BatchNorm2d(8) -> ReLU
-> Conv2d(8,8,3) -> BatchNorm2d(8)``, input (4, 3, 16, 16)) against stock ``nn.BatchNorm``
on an identical copy. Exported ONNX files run in real onnxruntime inference sessions.
"""

from __future__ import annotations

import collections
import copy
import io
import warnings

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import bnswap
from tests._helpers import TORCH, state_diff, to_stock

X = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(7))


def net() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)
    )
    with torch.no_grad():  # statistics and affine parameters that make a fold visible
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    return model


def pair(train: bool = False) -> tuple[nn.Module, nn.Module]:
    stock = net().train(train)
    return stock, bnswap.convert(copy.deepcopy(stock))


def _batches(*sizes: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(n, 3, 16, 16, generator=g) for n in sizes]


# --------------------------------------------------------------------------- ONNX
def _onnxruntime():
    """onnxruntime, imported the way bnswap's ORT backend imports it (the training build's
    package replaces torch functions at import; bnswap.ort puts them back)."""
    ort = pytest.importorskip("bnswap.ort")
    if not ort.is_available():
        pytest.skip("onnxruntime-training is not installed here (the main .venv has it)")
    ort._require()
    import onnxruntime

    return onnxruntime


def _ops(proto) -> collections.Counter:
    return collections.Counter(n.op_type for n in proto.graph.node)


def _run_onnx(proto, x: torch.Tensor) -> torch.Tensor:
    onnxruntime = _onnxruntime()
    sess = onnxruntime.InferenceSession(
        proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    name = sess.get_inputs()[0].name
    return torch.from_numpy(sess.run(None, {name: x.numpy()})[0])


def _torchscript_onnx(model: nn.Module, **kwargs):
    onnx = pytest.importorskip("onnx")

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (X,), buf, dynamo=False, **kwargs)
    return onnx.load_from_string(buf.getvalue())


@pytest.mark.parametrize("opset", [17, 20])
def test_onnx_torchscript_export_eval_folds_batch_norm_like_stock(opset):
    """Guards: a swapped layer traced by the TorchScript exporter records stock's
    aten::batch_norm (there is no symbolic for the consolidated ops: the export raised
    UnsupportedOperatorError)."""
    stock, swapped = pair(train=False)
    ps, pb = (
        _torchscript_onnx(stock, opset_version=opset),
        _torchscript_onnx(swapped, opset_version=opset),
    )
    assert _ops(pb) == _ops(ps) == collections.Counter({"Conv": 2, "Relu": 1})
    ys, yb = _run_onnx(ps, X), _run_onnx(pb, X)
    assert torch.equal(yb, ys)
    torch.testing.assert_close(yb, stock(X), rtol=0, atol=1e-5)  # the fold's rounding
    assert bnswap.is_swapped(swapped[1]) and state_diff(stock, swapped) == []


def test_onnx_torchscript_export_training_mode_like_stock():
    stock, swapped = pair(train=True)
    kw = {"training": torch.onnx.TrainingMode.TRAINING, "do_constant_folding": False}
    ps, pb = _torchscript_onnx(stock, **kw), _torchscript_onnx(swapped, **kw)
    assert _ops(pb) == _ops(ps)
    assert _ops(pb)["BatchNormalization"] == 2
    modes = [
        [a.i for a in n.attribute if a.name == "training_mode"]
        for n in pb.graph.node
        if n.op_type == "BatchNormalization"
    ]
    assert modes == [[1], [1]]
    assert [(n.op_type, [(a.name, a.f, a.i) for a in n.attribute]) for n in pb.graph.node] == [
        (n.op_type, [(a.name, a.f, a.i) for a in n.attribute]) for n in ps.graph.node
    ]
    assert torch.equal(_run_onnx(pb, X), _run_onnx(ps, X))
    # the exporter's trace ran on copies of nothing: the statistics did not move
    assert state_diff(stock, swapped) == []


def test_onnx_dynamo_export_folds_batch_norm_like_stock():
    """torch.onnx.export's default exporter (torch.export, then onnxscript): the
    consolidated _batch_norm_no_update was decomposed into Sub/Mul/Add instead of folded."""
    pytest.importorskip("onnxscript")
    stock, swapped = pair(train=False)
    progs = []
    for m in (stock, swapped):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            progs.append(torch.onnx.export(m, (X,), dynamo=True, verbose=False))
    ps, pb = (p.model_proto for p in progs)
    assert _ops(pb) == _ops(ps) == collections.Counter({"Conv": 2, "Relu": 1})
    assert torch.equal(_run_onnx(pb, X), _run_onnx(ps, X))


# --------------------------------------------------------------------- TorchScript
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_torchscript_script_is_stocks_script_and_leaves_the_model_as_it_was(mode):
    """Guards: TorchScript compiles the class's forward (aten::batch_norm, its runtime
    picks the kernel), the user's model object is exactly as before, and scripting twice
    works (it raised "import statements aren't supported", then "Can't redefine")."""
    stock, swapped = pair(train=mode == "train")
    vars_before = {n: dict(vars(m)) for n, m in swapped.named_modules()}
    stock_before = {n: set(vars(m)) for n, m in stock.named_modules()}
    ss = torch.jit.script(copy.deepcopy(stock))
    sb = torch.jit.script(copy.deepcopy(swapped))
    torch.jit.script(swapped)  # on the model itself, and a second time in this process
    sb2 = torch.jit.script(swapped)
    # torch.jit.script adds to a stock model its overload table, no more (the swapped
    # layers are scripted through stock views: they get nothing at all)
    torch.jit.script(stock)
    added_by_torch = {n: set(vars(m)) - stock_before[n] for n, m in stock.named_modules()}
    for n, m in swapped.named_modules():
        now = vars(m)
        assert set(now) - set(vars_before[n]) <= added_by_torch[n], n
        assert all(now[k] is v for k, v in vars_before[n].items()), n
        if bnswap.is_swapped(m):
            assert set(now) == set(vars_before[n]), n
    assert bnswap.is_swapped(swapped[1]) and bnswap.is_swapped(swapped[4])
    kinds = [n.kind() for n in sb.inlined_graph.nodes()]
    assert kinds == [n.kind() for n in ss.inlined_graph.nodes()]
    assert "aten::batch_norm" in kinds
    for x in _batches(4, 6, 4):
        ys = ss(x)
        assert torch.equal(sb(x), ys) and torch.equal(sb2(x), ys)
    for (k, a), (k2, b) in zip(ss.state_dict().items(), sb.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k
    # the eager converted model still runs bnswap's kernel, equal to stock
    ref = copy.deepcopy(swapped)
    bnswap.revert(ref)
    assert torch.equal(swapped(X), ref(X))


def test_torchscript_trace_freeze_optimize_for_inference_like_stock():
    stock, swapped = pair(train=False)
    out = []
    for m in (stock, swapped):
        frozen = torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.trace(m, (X,))))
        out.append((frozen, [n.kind() for n in frozen.graph.nodes()]))
    (fs, ks), (fb, kb) = out
    assert kb == ks and not any("batch_norm" in k for k in kb)
    assert torch.equal(fb(X), fs(X))


def test_torchscript_trace_in_training_with_an_empty_batch_like_stock():
    """Guards: traced, a swapped training layer records stock's aten::batch_norm, whose
    empty-batch rule runs at call time (the consolidated op rejected batch 0)."""
    stock, swapped = pair(train=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        ts, tb = torch.jit.trace(stock, (X,)), torch.jit.trace(swapped, (X,))
    assert [n.kind() for n in tb.inlined_graph.nodes()] == [
        n.kind() for n in ts.inlined_graph.nodes()
    ]
    for x in _batches(2, 0, 3):
        ys, yb = ts(x), tb(x)
        assert ys.shape == yb.shape == (x.shape[0], 8, 12, 12)
        assert torch.equal(ys, yb)
        assert state_diff(stock, swapped) == []  # a trace shares the model's tensors


# ------------------------------------------------------------------------ fusion
def test_fx_optimization_fuse_removes_every_batch_norm_like_stock():
    from torch.fx.experimental.optimization import fuse

    stock, swapped = pair(train=False)
    fs, fb = fuse(stock), fuse(swapped)
    assert not any(isinstance(m, _BatchNorm) for m in fb.modules())
    assert [type(m).__name__ for m in fb.modules()] == [type(m).__name__ for m in fs.modules()]
    assert torch.equal(fb(X), fs(X))


# ------------------------------------------------------------------- quantization
class _Quantizable(nn.Module):
    """QuantStub -> Conv -> ReLU -> BN -> DeQuantStub (the issue's eager-mode case)."""

    def __init__(self):
        super().__init__()
        import torch.ao.quantization as tq

        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.conv, self.relu, self.bn = nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8)

    def forward(self, x):
        return self.dequant(self.bn(self.relu(self.conv(self.quant(x)))))


@pytest.mark.parametrize("qat", [False, True], ids=["ptq", "qat"])
def test_eager_mode_quantization_converts_batch_norm_like_stock(qat):
    """Guards: torch.ao's module mappings are looked up by exact type; a swapped layer
    stayed float BatchNorm ("batch_norm" not implemented for 'quint8')."""
    import torch.ao.quantization as tq

    torch.manual_seed(0)
    stock = _Quantizable()
    swapped = bnswap.convert(copy.deepcopy(stock))
    results = []
    for m in (stock, swapped):
        m.qconfig = (tq.get_default_qat_qconfig if qat else tq.get_default_qconfig)("fbgemm")
        m.train(qat)
        prepared = tq.prepare_qat(m) if qat else tq.prepare(m)
        for x in _batches(4, 4, 4):  # calibration / QAT forwards
            prepared(x)
        prepared.eval()
        converted = tq.convert(prepared)
        results.append((type(converted.bn), converted(X), prepared.bn.running_var))
    (ts, ys, vs), (tb, yb, vb) = results
    assert ts is tb is torch.ao.nn.quantized.BatchNorm2d
    assert torch.equal(yb.dequantize() if yb.is_quantized else yb, ys)
    assert torch.equal(vb, vs)


@pytest.mark.parametrize("qat", [False, True], ids=["ptq", "qat"])
def test_fx_graph_mode_quantization_fuses_conv_bn_like_stock(qat):
    from torch.ao.quantization import get_default_qat_qconfig_mapping, get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx, prepare_qat_fx

    stock, swapped = pair(train=qat)
    results = []
    for m in (stock, swapped):
        if qat:
            prepared = prepare_qat_fx(m, get_default_qat_qconfig_mapping("x86"), (X,))
        else:
            prepared = prepare_fx(m, get_default_qconfig_mapping("x86"), (X,))
        kinds = collections.Counter(type(mm).__name__ for mm in prepared.modules())
        for x in _batches(4, 4):
            prepared(x)
        results.append((kinds, convert_fx(prepared.eval())(X)))
    (ks, ys), (kb, yb) = results
    assert kb == ks
    if qat:  # the QAT modules keep their batch norm inside (torch's BatchNorm2d)
        assert ks["ConvBnReLU2d"] == ks["ConvBn2d"] == 1
    else:  # folded into the convolutions
        assert ks["ConvReLU2d"] == 1 and not any("BatchNorm" in k for k in ks)
    assert torch.equal(yb, ys)


@pytest.mark.parametrize("qat", [True, False], ids=["prepare_qat_pt2e", "prepare_pt2e"])
def test_torchao_pt2e_prepare_gives_stocks_graph(qat):
    """Guards bnswap._compat's torchao patch: torchao's conv-BN QAT fold and its
    quantizers find conv-BN pairs by stock's aten.batch_norm; on the consolidated op the
    fold was silently not applied (6 observers instead of 5). The prepared QAT graph
    then runs the consolidated ops again (tests/test_qat.py): as stock's it is stock's."""
    pytest.importorskip("torchao")
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, prepare_qat_pt2e
    from torchao.testing.pt2e._xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    stock, swapped = pair(train=qat)
    results = []
    for m in (stock, swapped):
        gm = torch.export.export(m, (X,)).module()
        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_qat=qat))
        prepared = (prepare_qat_pt2e if qat else prepare_pt2e)(gm, quantizer)
        # (bnswap hands torchao stock's graph and puts nothing back: stock's prepared graph)
        assert to_stock(prepared) == (prepared, 0)
        ops = collections.Counter(
            str(n.target) for n in prepared.graph.nodes if n.op == "call_function"
        )
        observers = collections.Counter(type(mm).__name__ for mm in prepared.modules())
        results.append((ops, observers, prepared(X)))
    (os_, obs_s, ys), (ob, obs_b, yb) = results
    assert ob == os_ and obs_b == obs_s
    assert torch.equal(yb, ys)
    if qat:  # the fold scales the conv weight by weight / sqrt(running_var + eps)
        assert ob["aten.sqrt.default"] == 2 and obs_b["FusedMovingAvgObsFakeQuantize"] == 5
        assert "aten._batch_norm_with_update.default" not in ob
    else:  # eval conv-BN pairs are folded into the convolution
        assert not any("batch_norm" in k for k in ob)


@pytest.mark.skipif(
    TORCH < (2, 5),
    reason="torch 2.4's torch.export.export returns a "
    "functional graph (other nodes, another order); to_stock_ops's node-for-"
    "node parity with stock's export is tested on torch 2.9 / 2.13 / 2.14 / 2.15",
)
def test_to_stock_ops_gives_stocks_exported_graph_for_every_flag():
    """bnswap.to_stock_ops (what the torchao patch runs) turns a swapped model's export
    into stock's, node for node: affine=False, track_running_stats=False, eval."""
    for kwargs, train in (
        ({}, True),
        ({}, False),
        ({"affine": False}, True),
        ({"track_running_stats": False}, True),
        ({"affine": False, "track_running_stats": False}, False),
    ):
        torch.manual_seed(0)
        stock = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, **kwargs)).train(train)
        swapped = bnswap.convert(copy.deepcopy(stock))
        gs = torch.export.export(stock, (X,)).module()
        gb = torch.export.export(swapped, (X,)).module()
        # (evaluation with running statistics records stock's op already: nothing to do)
        batch_stats = train or kwargs.get("track_running_stats", True) is False
        assert to_stock(gb) == (gb, int(batch_stats)) and to_stock(gs) == (gs, 0)
        nodes = [(n.op, str(n.target), len(n.args)) for n in gs.graph.nodes]
        assert [(n.op, str(n.target), len(n.args)) for n in gb.graph.nodes] == nodes, kwargs
        for n_s, n_b in zip(gs.graph.nodes, gb.graph.nodes, strict=True):
            if n_s.op == "call_function" and "batch_norm" in str(n_s.target):
                assert [a if not isinstance(a, torch.fx.Node) else a.name for a in n_s.args] == [
                    a if not isinstance(a, torch.fx.Node) else a.name for a in n_b.args
                ]
        for x in _batches(4, 4):
            assert torch.equal(gb(x), gs(x))
            assert state_diff(gs, gb) == []
    with pytest.raises(TypeError, match=r"expects a torch.fx.GraphModule"):
        bnswap.to_stock_ops(nn.BatchNorm2d(3))


# ------------------------------------------------------------------------ counting
def test_ptflops_counts_batch_norm_like_stock():
    """Guards: ptflops looks its counters up by exact type; bnswap layers were not
    counted (428,160 instead of 439,040 MACs on the issue's net at 3x32x32)."""
    ptflops = pytest.importorskip("ptflops")
    stock, swapped = pair(train=False)
    counts = [
        ptflops.get_model_complexity_info(
            m, (3, 32, 32), as_strings=False, print_per_layer_stat=False, backend="pytorch"
        )
        for m in (stock, swapped)
    ]
    assert counts[0] == counts[1]
    convs_only = nn.Sequential(stock[0], stock[2], stock[3])
    macs_convs, _ = ptflops.get_model_complexity_info(
        convs_only, (3, 32, 32), as_strings=False, print_per_layer_stat=False, backend="pytorch"
    )
    assert counts[1][0] > macs_convs  # batch norm is counted


# ----------------------------------------------------------------------- exported
@pytest.mark.skipif(
    not hasattr(torch.compiler, "is_exporting"),
    reason="torch.compiler.is_exporting: torch >= 2.5 (on torch 2.4 the "
    "exported program's own shape guard refuses a batch of 0, stock's too)",
)
def test_exported_program_with_an_empty_batch_raises_clearly_or_runs_as_stock():
    """Guards: torch.export's program called with batch 0 failed inside the kernel
    ("input tensor must have at least one element"). Now a runtime assertion says why,
    before the statistics move; after bnswap.to_stock_ops it behaves as stock's."""
    from torch.export import Dim

    stock, swapped = pair(train=True)
    spec = ({0: Dim("batch", min=0)},)
    ms = torch.export.export(stock, (X,), dynamic_shapes=spec).module()
    mb = torch.export.export(swapped, (X,), dynamic_shapes=spec).module()
    b2, b0, b3 = _batches(2, 0, 3)
    assert torch.equal(mb(b2), ms(b2)) and state_diff(ms, mb) == []
    before = {k: v.clone() for k, v in mb.state_dict().items()}
    with pytest.raises(
        RuntimeError, match="bnswap: a batch norm of this exported program got an empty input"
    ):
        mb(b0)
    assert all(torch.equal(v, mb.state_dict()[k]) for k, v in before.items())
    assert to_stock(mb) == (mb, 2)
    for x in (b0, b3):
        ys, yb = ms(x), mb(x)
        assert ys.shape == yb.shape and torch.equal(ys, yb)
        assert state_diff(ms, mb) == []


# ---------------------------------------------------------------------- Lightning
def test_lightning_to_torchscript_and_to_onnx_after_fit_like_stock(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    onnx = pytest.importorskip("onnx")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.cat(_batches(4, 4, 4))), batch_size=4
    )
    fitted = []
    for callbacks in ([], [bnswap.BNSwap()]):
        pl.seed_everything(0)
        module = Module()
        pl.Trainer(
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            default_root_dir=tmp_path,
        ).fit(module, data)
        fitted.append(module)
    stock, swapped = fitted
    assert all(bnswap.is_swapped(m) for m in swapped.modules() if isinstance(m, _BatchNorm))
    assert state_diff(stock, swapped) == []
    ss, sb = stock.to_torchscript(), swapped.to_torchscript()
    assert torch.equal(sb(X), ss(X))
    files = []
    for m, name in ((stock, "stock"), (swapped, "bnswap")):
        path = tmp_path / f"{name}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.to_onnx(path, X, dynamo=False)
        files.append(onnx.load(path))
    assert _ops(files[1]) == _ops(files[0]) == collections.Counter({"Conv": 2, "Relu": 1})
    assert torch.equal(_run_onnx(files[1], X), _run_onnx(files[0], X))


# ------------------------------------------------- found by a newcomer's review round
@pytest.mark.parametrize("to_eval", [True, False], ids=["to_eval", "to_train"])
def test_torchao_move_exported_model_to_eval_and_train_like_stock(to_eval):
    """Guards: torchao's move_exported_model_to_eval / _train (an exported model's only
    way to switch mode) look for stock's aten.batch_norm; on the consolidated ops the
    layer silently kept its mode (outputs 1.7 off, statistics moving in "eval")."""
    pytest.importorskip("torchao")
    from torchao.quantization.pt2e import move_exported_model_to_eval, move_exported_model_to_train

    stock, swapped = pair(train=to_eval)
    gs = torch.export.export(stock, (X,)).module()
    gb = torch.export.export(swapped, (X,)).module()
    for g in (gs, gb):
        (move_exported_model_to_eval if to_eval else move_exported_model_to_train)(g)
    for x in _batches(4, 4):
        assert torch.equal(gb(x), gs(x))
        assert state_diff(gs, gb) == []


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"affine": False}, {"track_running_stats": False}],
    ids=["default", "no-affine", "no-tracking"],
)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_onnx_dynamo_export_of_an_exported_program_like_stock(train, kwargs):
    """Guards: torch.onnx.export given a swapped model's ExportedProgram decomposed the
    consolidated ops into Sub / Mul / Add (not folded) or, in training, into reductions
    with batch statistics (outputs 1.35 off); a track_running_stats=False layer then got
    its throw-away statistics as running ones (0.17 off). bnswap._compat keeps them
    through the exporter's decomposition and rewrites them into stock's core ATen ops."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, **kwargs)).train(train)
    swapped = bnswap.convert(copy.deepcopy(stock))
    protos = []
    for m in (stock, swapped):
        ep = torch.export.export(m, (X,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            protos.append(torch.onnx.export(ep, (X,), dynamo=True, verbose=False).model_proto)
        # (evaluation with running statistics: stock's op already)
        bnswap_ops = m is swapped and (train or kwargs.get("track_running_stats") is False)
        assert to_stock(ep)[1] == int(bnswap_ops)
    ps, pb = protos
    assert _ops(pb) == _ops(ps)
    assert torch.equal(_run_onnx(pb, X), _run_onnx(ps, X))


@pytest.mark.skipif(
    not hasattr(torch.export.ExportedProgram, "validate"),
    reason="ExportedProgram.validate: torch >= 2.5",
)
def test_to_stock_ops_on_an_exported_program_keeps_it_valid_and_saveable(tmp_path):
    """Guards: the rewrite left the program's signature naming an erased node
    (SpecViolationError on validate / torch.export.save). A program is not changed: the
    new one is returned (issue 46: as convert(program) and run_decompositions do)."""
    stock, swapped = pair(train=True)
    ep = torch.export.export(swapped, (X,))
    codes = (ep.graph_module.code, [str(n.target) for n in ep.graph.nodes])
    ep_stock, rewritten = to_stock(ep)
    assert rewritten == 2 and ep_stock is not ep
    assert codes == (ep.graph_module.code, [str(n.target) for n in ep.graph.nodes])
    assert to_stock(ep_stock) == (ep_stock, 0)  # nothing of bnswap's: itself
    ep = ep_stock
    ep.validate()
    path = tmp_path / "program.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path)
    ref = torch.export.export(stock, (X,))
    assert [str(n.target) for n in loaded.graph.nodes] == [str(n.target) for n in ref.graph.nodes]
    assert torch.equal(loaded.module()(X), ref.module()(X))


def test_momentum_none_training_export_saves_and_loads(tmp_path):
    """Guards: the compiled cumulative-average update ran under torch.no_grad(), which
    torch.export recorded as a wrap_with_set_grad_enabled node that torch.export.load
    refused ("missing val field")."""
    torch.manual_seed(0)
    model = bnswap.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None)))
    ep = torch.export.export(copy.deepcopy(model), (X,))
    path = tmp_path / "program.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path).module()
    eager = copy.deepcopy(model)
    for x in _batches(4, 4, 4):
        torch.testing.assert_close(loaded(x), eager(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        dict(loaded.named_buffers())["1.running_var"], eager[1].running_var, rtol=0, atol=1e-6
    )


def test_momentum_none_layer_in_pt2e_qat_is_refused_clearly():
    """Guards: torchao's QAT fold dropped bnswap's cumulative update, silently (running
    statistics frozen, the fold scaled by zero scratch variance). Stock cannot export
    such a layer at all; bnswap refuses it before torchao touches the graph."""
    pytest.importorskip("torchao")
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
    from torchao.testing.pt2e._xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    torch.manual_seed(0)
    model = bnswap.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None)))
    gm = torch.export.export(model, (X,)).module()
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_qat=True))
    with pytest.raises(NotImplementedError, match="momentum=None"):
        prepare_qat_pt2e(gm, quantizer)


def test_exports_of_an_ort_wrapper_record_the_model_it_wraps_like_stock():
    """Guards: torch.onnx.export / torch.jit.script / trace of what backend="ort" returned
    failed (ORT's forward inside the exporter; a varargs forward for TorchScript), and
    the ORT trace buffers leaked into a scripted module's state_dict."""
    ort = pytest.importorskip("bnswap.ort")
    if not ort.is_available():
        pytest.skip("onnxruntime-training is not installed here (the main .venv has it)")
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, affine=False), nn.ReLU())
    wrapped = bnswap.convert(copy.deepcopy(stock), backend="ort")
    wrapped(X).sum().backward()
    stock(X).sum().backward()
    stock.eval(), wrapped.eval()
    ss, sb = torch.jit.script(stock), torch.jit.script(wrapped)
    assert list(sb.state_dict()) == list(ss.state_dict())
    torch.testing.assert_close(sb(X), ss(X), rtol=0, atol=1e-6)
    assert list(torch.jit.script(wrapped.module).state_dict()) == list(ss.state_dict())
    ps, pb = _torchscript_onnx(stock), _torchscript_onnx(wrapped)
    assert _ops(pb) == _ops(ps) == collections.Counter({"Conv": 1, "Relu": 1})
    with torch.no_grad():
        ts = torch.jit.trace(stock, (X,))
        for traced in (torch.jit.trace(wrapped, (X,)), torch.jit.trace(wrapped.module, (X,))):
            torch.testing.assert_close(traced(X), stock(X), rtol=0, atol=1e-6)
            assert list(traced.state_dict()) == list(ts.state_dict())  # no trace buffers


def test_only_the_thread_inside_the_ort_block_records_the_consolidated_ops():
    """``consolidated_ops_while_tracing`` is per thread: another thread (one that never
    entered the block, too) records stock's ops. Guards the flag's default."""
    import threading

    from bnswap.functional import consolidated_ops_while_tracing, records_consolidated_ops

    seen: list[bool] = []

    def other_thread() -> None:
        t = threading.Thread(target=lambda: seen.append(records_consolidated_ops()))
        t.start()
        t.join()

    other_thread()
    with consolidated_ops_while_tracing():
        inside = records_consolidated_ops()
        other_thread()
        with consolidated_ops_while_tracing():
            nested = records_consolidated_ops()
        still = records_consolidated_ops()
    assert seen == [False, False] and (inside, nested, still) == (True, True, True)
    assert records_consolidated_ops() is False


X8 = torch.randn(4, 8, 6, 6, generator=torch.Generator().manual_seed(8))


def _bn_with_stats(affine: bool) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(8, affine=affine).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-0.3, 0.3, generator=torch.Generator().manual_seed(3))
        bn.running_var.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(4))
    return bn


def test_stand_ins_are_used_only_while_tracing_inside_the_block_and_nested_blocks_restore():
    """The core's generic stand-ins provider (``consolidated_ops_while_tracing(stand_ins=
    ...)``, used by bnswap.ort for its per-layer trace buffers): consulted only while the
    TorchScript tracer records a layer inside the block, never in eager code, and each
    nested block's provider (None: fresh ones / zeros) gives way to the enclosing one on
    exit. Values against stock BatchNorm2d in float64 with the stand-ins as parameters."""
    import threading

    from bnswap.functional import consolidated_ops_while_tracing

    # (batch statistics: where the ops need stand-ins; with running statistics a layer
    # makes stock's own call, with None for a missing weight / bias)
    bn = nn.BatchNorm2d(8, affine=False, track_running_stats=False)
    g = torch.Generator().manual_seed(5)
    w_a, w_b, b_b = (torch.rand(8, generator=g) + 0.5 for _ in range(3))
    calls: list[tuple[str, nn.Module]] = []

    def provider(tag: str, weight, bias):
        def stand_ins(layer):
            calls.append((tag, layer))
            return weight, bias

        return stand_ins

    a, b = provider("a", w_a, None), provider("b", w_b, b_b)

    def traced() -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            fn = torch.jit.trace(
                lambda x: bnswap.module_batch_norm(bn, x), (X8,), check_trace=False
            )
        return fn(X8)

    def _stock_with(_bn: nn.Module, weight, bias) -> torch.Tensor:
        """Stock BatchNorm2d on batch statistics, float64, with the given affine
        parameters (ones / zeros for None): what the core must compute with those
        stand-ins."""
        ref = nn.BatchNorm2d(8, track_running_stats=False).double()
        with torch.no_grad():
            ref.weight.copy_(torch.ones(8) if weight is None else weight)
            ref.bias.copy_(torch.zeros(8) if bias is None else bias)
            return ref(X8.double()).float()

    plain = _stock_with(bn, None, None)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(traced(), plain, **tol)  # no block: constants
    seen: list[torch.Tensor] = []
    with consolidated_ops_while_tracing(stand_ins=a):
        eager = bnswap.module_batch_norm(bn, X8)  # not tracing: no stand-ins
        assert calls == []
        torch.testing.assert_close(eager, plain, **tol)
        torch.testing.assert_close(traced(), _stock_with(bn, w_a, None), **tol)
        assert calls == [("a", bn)]
        with consolidated_ops_while_tracing(stand_ins=b):
            torch.testing.assert_close(traced(), _stock_with(bn, w_b, b_b), **tol)
            with consolidated_ops_while_tracing():  # None: fresh constants again
                torch.testing.assert_close(traced(), plain, **tol)
        assert calls == [("a", bn), ("b", bn)]
        torch.testing.assert_close(traced(), _stock_with(bn, w_a, None), **tol)  # restored
        t = threading.Thread(target=lambda: seen.append(traced()))  # per thread
        t.start()
        t.join()
    torch.testing.assert_close(seen[0], plain, **tol)
    assert calls == [("a", bn), ("b", bn), ("a", bn)]
    torch.testing.assert_close(traced(), plain, **tol)  # after the block
    # a layer with its own weight and bias never asks
    own = nn.BatchNorm2d(8, track_running_stats=False).requires_grad_(False)  # (constants)
    with consolidated_ops_while_tracing(stand_ins=a), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.jit.trace(lambda x: bnswap.module_batch_norm(own, x), (X8,), check_trace=False)
    assert len(calls) == 3


def test_revert_removes_internal_buffers_and_torchscript_leaves_them_out():
    """A backend's internal buffers (``bnswap._swap.add_internal_buffer``, as bnswap.ort
    registers its trace buffers): never in the state_dict, left out of TorchScript's
    views (torch.jit.script and torch.jit.trace, which copies each module's buffers into
    a new module), removed by unswap / bnswap.revert; other buffers stay."""
    from bnswap._compat import stock_view
    from bnswap._swap import add_internal_buffer, drop_internal_buffers, internal_buffer_names

    torch.manual_seed(0)
    stock = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        _bn_with_stats(affine=False),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        _bn_with_stats(affine=False),
    ).eval()
    model = bnswap.convert(copy.deepcopy(stock))
    user = torch.full((8,), 7.0)
    model[1].register_buffer("user_extra", user, persistent=False)  # the user's own
    stock[1].register_buffer("user_extra", user, persistent=False)
    for i in (1, 4):
        add_internal_buffer(model[i], "_bnswap_test_ones", torch.ones(8))
        add_internal_buffer(model[i], "_bnswap_test_zeros", torch.zeros(8))
    with pytest.raises(ValueError, match="starts with '_bnswap_'"):
        add_internal_buffer(model[1], "ones", torch.ones(8))
    assert "ones" not in model[1]._buffers
    assert internal_buffer_names(model[1]) == ["_bnswap_test_ones", "_bnswap_test_zeros"]
    assert list(model.state_dict()) == list(stock.state_dict())

    view = stock_view(model)
    assert internal_buffer_names(model[4]) == ["_bnswap_test_ones", "_bnswap_test_zeros"]
    assert list(view[1]._buffers) == [
        "running_mean",
        "running_var",
        "num_batches_tracked",
        "user_extra",
    ]
    assert view[1]._non_persistent_buffers_set == {"user_extra"}
    assert view[1].running_mean is model[1].running_mean
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        scripted, traced = torch.jit.script(model), torch.jit.trace(model, (X,))
        ref_s, ref_t = torch.jit.script(stock), torch.jit.trace(stock, (X,))
    for got, ref in ((scripted, ref_s), (traced, ref_t)):
        assert [k for k, _ in got.named_buffers()] == [k for k, _ in ref.named_buffers()]
        torch.testing.assert_close(got(X), stock(X), rtol=0, atol=1e-6)
    torch.testing.assert_close(model(X), stock(X), rtol=0, atol=1e-6)  # eager bnswap

    drop_internal_buffers(model[4], ["_bnswap_test_zeros", "user_extra"])
    assert internal_buffer_names(model[4]) == ["_bnswap_test_ones"]
    bnswap.revert(model)
    for i in (1, 4):
        assert not bnswap.is_swapped(model[i])
        assert internal_buffer_names(model[i]) == []
        assert not any(k.startswith("_bnswap_") for k in model[i]._non_persistent_buffers_set)
    assert model[1].user_extra is user and "user_extra" in model[1]._non_persistent_buffers_set
    assert [k for k, _ in model.named_buffers()] == [k for k, _ in stock.named_buffers()]
    assert state_diff(model, stock) == []
