"""bnswap on real architectures: torchvision and timm models, stock vs converted copy.

Every test builds the stock model (random init, never downloaded), deep-copies it and
converts the copy, so both start from the same weights and buffers; the RNG is seeded
the same before each forward so dropout / drop-path draw the same masks. All checks are
bitwise (``torch.equal``) in float32 on CPU.

Needs torchvision (and timm for the timm models): the ``.venv-zoo`` environment
(``make setup-zoo``). Elsewhere these tests are skipped with the reason.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import bnswap
from bnswap._swap import SWAP

pytestmark = pytest.mark.zoo

_BN_WITH_UPDATE = "aten._batch_norm_with_update.default"
_BN_WITH_UPDATE_FUNCTIONAL = "aten._batch_norm_with_update_functional.default"

# (library, model name, BatchNorm layers the model has, classes of those layers).
MODELS = [
    ("torchvision", "resnet18", 20, {"BatchNorm2d"}),
    ("torchvision", "mobilenet_v2", 52, {"BatchNorm2d"}),
    ("torchvision", "efficientnet_b0", 49, {"BatchNorm2d"}),
    ("timm", "mobilenetv2_100", 52, {"BatchNormAct2d"}),
    ("timm", "efficientnet_b0", 49, {"BatchNormAct2d"}),
    ("timm", "resnet50d", 55, {"BatchNorm2d"}),
]
IDS = [f"{lib}-{name}" for lib, name, _, _ in MODELS]
ADAPTERS = {
    "BatchNorm2d": "bnswap.layers.batch_norm_forward",
    "BatchNormAct2d": "bnswap.adapters.timm.batch_norm_act_2d",
}
NUM_CLASSES = 10
INPUT_SHAPE = (2, 3, 64, 64)  # smallest feature maps: 2x2 (8 values per channel)


def _import(lib: str) -> Any:
    """Import torchvision / timm or skip with the reason (torchvision does not import
    beside torch 2.13.0, so the main environment has neither)."""
    try:
        return importlib.import_module(lib)
    except Exception as e:  # ImportError, or torchvision's operator errors on another torch
        pytest.skip(
            f"{lib} is not importable here ({type(e).__name__}: {e}); the zoo tests run in "
            f".venv-zoo (make setup-zoo: torch 2.14.1, torchvision 0.29.1, timm)"
        )


_STOCK: dict[tuple[str, str], nn.Module] = {}


def _stock(lib: str, name: str) -> nn.Module:
    """A fresh copy of the stock model (built once per session, random init)."""
    key = (lib, name)
    if key not in _STOCK:
        mod = _import(lib)
        torch.manual_seed(0)
        if lib == "timm":
            # Dropout and drop-path on, so that the seeded-RNG equality means something
            # (timm's DenseNet has no drop-path).
            drop = {"drop_rate": 0.2}
            if not name.startswith("densenet"):
                drop["drop_path_rate"] = 0.1
            model = mod.create_model(name, pretrained=False, num_classes=NUM_CLASSES, **drop)
        else:
            model = getattr(mod.models, name)(weights=None, num_classes=NUM_CLASSES)
        _STOCK[key] = model
    return copy.deepcopy(_STOCK[key])


def _pair(lib: str, name: str) -> tuple[nn.Module, nn.Module]:
    stock = _stock(lib, name)
    converted = bnswap.convert(copy.deepcopy(stock))
    return stock, converted


def _input() -> torch.Tensor:
    return torch.randn(INPUT_SHAPE, generator=torch.Generator().manual_seed(1))


def _targets() -> torch.Tensor:
    return torch.tensor([3, 7])


def _bn_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]


def _assert_equal(what: str, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b), f"{what}: max |diff| {(a.double() - b.double()).abs().max()}"


@pytest.mark.parametrize(("lib", "name", "count", "classes"), MODELS, ids=IDS)
def test_plan_swaps_every_batchnorm(lib, name, count, classes):
    stock, converted = _pair(lib, name)
    layers = _bn_layers(stock)
    assert len(layers) == count
    assert {type(m).__name__ for _, m in layers} == classes

    table = bnswap.plan(stock)
    assert len(table) == count
    assert [r.name for r in table] == [n for n, _ in layers]
    assert len(table.swapped) == count, str(table)
    for row in table:
        assert row.adapter_name == ADAPTERS[row.cls], row

    # The converted copy: every layer swapped with the planned adapter, of its stock
    # class still, with the same children (timm's drop / act) and the same state_dict
    # keys; its plan says "already" swapped.
    for (n, s), (n2, c) in zip(layers, _bn_layers(converted), strict=True):
        assert n == n2
        assert bnswap.is_swapped(c) and type(c) is type(s)
        adapter = vars(c)[SWAP].adapter
        assert f"{adapter.__module__}.{adapter.__qualname__}" == ADAPTERS[type(s).__name__]
        assert [k for k, _ in c.named_children()] == [k for k, _ in s.named_children()]
        assert [type(v) for v in c.children()] == [type(v) for v in s.children()]
    assert list(converted.state_dict()) == list(stock.state_dict())
    assert len(bnswap.plan(converted).swapped) == count


@pytest.mark.parametrize(("lib", "name", "count", "classes"), MODELS, ids=IDS)
def test_train_step_and_eval_bitwise(lib, name, count, classes):
    stock, converted = _pair(lib, name)
    x, y = _input(), _targets()
    results = []
    for model in (stock, converted):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(1234)
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        model.eval()
        torch.manual_seed(99)
        with torch.no_grad():
            eval_out = model(x)
        results.append((out.detach(), grads, eval_out))

    (s_out, s_grads, s_eval), (c_out, c_grads, c_eval) = results
    _assert_equal("training output", s_out, c_out)
    assert list(s_grads) == list(c_grads)
    for n in s_grads:
        _assert_equal(f"gradient of {n}", s_grads[n], c_grads[n])
    s_params, c_params = dict(stock.named_parameters()), dict(converted.named_parameters())
    assert list(s_params) == list(c_params)
    for n in s_params:
        _assert_equal(f"parameter {n} after the step", s_params[n], c_params[n])
    s_bufs, c_bufs = dict(stock.named_buffers()), dict(converted.named_buffers())
    assert list(s_bufs) == list(c_bufs)
    assert sum(n.endswith("num_batches_tracked") for n in s_bufs) == count
    for n in s_bufs:
        _assert_equal(f"buffer {n}", s_bufs[n], c_bufs[n])
    for n in (n for n in s_bufs if n.endswith("num_batches_tracked")):
        assert int(c_bufs[n]) == 1, n
    _assert_equal("eval output", s_eval, c_eval)


def _batch_norm_ops(graph: torch.fx.Graph) -> Counter:
    return Counter(
        str(node.target)
        for node in graph.nodes
        if node.op == "call_function" and "batch_norm" in str(node.target)
    )


@pytest.mark.parametrize(("lib", "name", "count", "classes"), MODELS, ids=IDS)
def test_export_graph_has_consolidated_ops(lib, name, count, classes):
    stock, converted = _pair(lib, name)
    x = _input()
    before = {n: b.clone() for n, b in converted.named_buffers()}

    # Stock exports aten.batch_norm; the converted model one _batch_norm_with_update per
    # layer in training, which run_decompositions({}) keeps as
    # _batch_norm_with_update_functional (backend-agnostic: cuDNN is chosen at run time);
    # the default, core ATen table gives stock's core ATen op (issue 20: core ATen
    # consumers such as ExecuTorch get what stock's program gives them).
    stock_ep = torch.export.export(stock.train(), (x,))
    assert _batch_norm_ops(stock_ep.graph) == Counter({"aten.batch_norm.default": count})
    ep = torch.export.export(converted.train(), (x,))
    assert _batch_norm_ops(ep.graph) == Counter({_BN_WITH_UPDATE: count})
    assert _batch_norm_ops(ep.run_decompositions({}).graph) == Counter(
        {_BN_WITH_UPDATE_FUNCTIONAL: count}
    )
    assert (
        _batch_norm_ops(ep.run_decompositions().graph)
        == _batch_norm_ops(stock_ep.run_decompositions().graph)
        == Counter({"aten._native_batch_norm_legit_functional.default": count})
    )

    # Evaluation: stock's own aten.batch_norm per layer (it runs on every device;
    # _batch_norm_no_update has no kernel off the CPU): the stock model's program.
    ep_eval = torch.export.export(converted.eval(), (x,))
    assert _batch_norm_ops(ep_eval.graph) == Counter({"aten.batch_norm.default": count})
    assert _batch_norm_ops(ep_eval.graph) == _batch_norm_ops(
        torch.export.export(stock.eval(), (x,)).graph
    )

    # Exporting traced with fake tensors: the real statistics did not move.
    for n, b in converted.named_buffers():
        _assert_equal(f"buffer {n} after export", before[n], b)


@pytest.mark.parametrize(("lib", "name", "count", "classes"), MODELS, ids=IDS)
def test_revert_restores_original_classes(lib, name, count, classes):
    stock, converted = _pair(lib, name)
    stock_classes = [(n, type(m)) for n, m in stock.named_modules()]
    children = {n: list(m.children()) for n, m in converted.named_modules()}
    assert bnswap.revert(converted) is converted
    assert [(n, type(m)) for n, m in converted.named_modules()] == stock_classes
    assert not any(bnswap.is_swapped(m) for m in converted.modules())
    assert {n: list(m.children()) for n, m in converted.named_modules()} == children
    assert bnswap.plan(converted).swapped == bnswap.plan(stock).swapped  # all swappable again
    # Reverted layers run stock code: same output as the stock model.
    x = _input()
    for model in (stock, converted):
        model.eval()
    with torch.no_grad():
        _assert_equal("output after revert", stock(x), converted(x))


# --- timm's BatchNormAct2d, layer by layer ----------------------------------------------


def _layer_steps(
    stock: nn.Module,
    converted: nn.Module,
    shape: tuple[int, ...],
    fmt: torch.memory_format = torch.contiguous_format,
    steps: int = 3,
) -> None:
    """``steps`` training steps of ``stock`` and ``converted`` on input of ``shape`` in
    ``fmt`` (output and its memory format, input and parameter gradients, every buffer),
    then an eval forward, all bitwise equal."""
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = (torch.randn(shape, generator=gen) * 2 + step).to(memory_format=fmt)
        g = torch.randn(shape, generator=gen)
        results = []
        for model in (stock, converted):
            model.train()
            xi = x.clone().requires_grad_()
            torch.manual_seed(step)
            out = model(xi)
            out.backward(g)
            results.append((out, xi.grad, [p.grad for p in model.parameters()]))
        (s_out, s_gx, s_gp), (c_out, c_gx, c_gp) = results
        _assert_equal("output", s_out, c_out)
        assert c_out.is_contiguous(memory_format=fmt) == s_out.is_contiguous(memory_format=fmt)
        _assert_equal("input gradient", s_gx, c_gx)
        for a, b in zip(s_gp, c_gp, strict=True):
            _assert_equal("parameter gradient", a, b)
        for (n, a), (_, b) in zip(stock.named_buffers(), converted.named_buffers(), strict=True):
            _assert_equal(n, a, b)
    for model in (stock, converted):
        model.eval()
    with torch.no_grad():
        _assert_equal("eval output", stock(x), converted(x))


LAYER_CASES = {
    "default": {},
    "silu-dropout": {"act_layer": "silu", "drop_layer": nn.Dropout},
    "no-act-cumulative": {"apply_act": False, "momentum": None},
    "no-running-stats": {"track_running_stats": False, "act_layer": "relu6"},
    "no-affine-hardswish": {"affine": False, "act_layer": "hard_swish", "inplace": False},
}


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("kwargs", list(LAYER_CASES.values()), ids=list(LAYER_CASES))
def test_timm_batchnormact2d_layer_bitwise(kwargs, channels_last):
    _import("torchvision")
    timm = _import("timm")
    torch.manual_seed(0)
    stock = timm.layers.BatchNormAct2d(6, **kwargs)
    if stock.affine:
        with torch.no_grad():
            stock.weight.uniform_(0.5, 1.5)
            stock.bias.uniform_(-0.5, 0.5)
    converted = bnswap.convert(copy.deepcopy(stock))
    from bnswap.adapters.timm import batch_norm_act_2d

    assert type(converted) is type(stock) and bnswap.is_swapped(converted)
    assert vars(converted)[SWAP].adapter is batch_norm_act_2d
    assert type(converted.act) is type(stock.act) and type(converted.drop) is type(stock.drop)
    assert list(converted.state_dict()) == list(stock.state_dict())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    _layer_steps(stock, converted, (4, 6, 5, 5), fmt)  # momentum=None: over 3 batches

    # timm asserts the rank; so does the adapter, before any state changes.
    converted.train()
    buffers = [b.clone() for b in converted.buffers()]
    for model in (stock, converted):
        with pytest.raises(AssertionError, match=r"expected 4D input \(got 3D input\)"):
            model(torch.randn(4, 6, 5))
    for a, b in zip(buffers, converted.buffers(), strict=True):
        _assert_equal("buffer after the error", a, b)
    assert type(bnswap.revert(converted)) is type(stock) and not bnswap.is_swapped(converted)


# --- timm's SplitBatchNorm2d (train.py --split-bn) --------------------------------------

SPLIT_CASES = {
    "two-splits": {"num_splits": 2},
    "three-splits-cumulative": {"num_splits": 3, "momentum": None},
    "no-affine": {"num_splits": 2, "affine": False},
}


@pytest.mark.parametrize("kwargs", list(SPLIT_CASES.values()), ids=list(SPLIT_CASES))
def test_timm_split_batchnorm_swapped_whole_and_bitwise(kwargs):
    """Issue 26: timm's ``SplitBatchNorm2d`` (``--split-bn``) overrides forward and had no
    adapter: bnswap left it on torch's kernel and swapped its ``aux_bn`` children, a
    half-converted layer, said only at INFO. Now the layer and its auxiliary layers are
    swapped, and training (every split) and eval equal timm's own layer bit for bit."""
    _import("torchvision")
    _import("timm")
    from timm.layers import SplitBatchNorm2d

    torch.manual_seed(0)
    stock = SplitBatchNorm2d(6, **kwargs)
    if stock.affine:
        with torch.no_grad():
            for m in (stock, *stock.aux_bn):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    converted = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a layer left would warn)
        assert bnswap.convert(converted) is converted
    splits = kwargs["num_splits"]
    table = bnswap.plan(stock)
    assert [(r.name, r.action, r.adapter_name) for r in table] == [
        ("(root)", "swap", "bnswap.adapters.timm.split_batch_norm_2d"),
        *((f"aux_bn.{i}", "swap", ADAPTERS["BatchNorm2d"]) for i in range(splits - 1)),
    ]
    assert type(converted) is SplitBatchNorm2d
    assert all(bnswap.is_swapped(m) for _, m in _bn_layers(converted))
    assert list(converted.state_dict()) == list(stock.state_dict())
    _layer_steps(stock, converted, (2 * splits, 6, 5, 5))

    # timm's errors, before any state changes: a batch the splits do not divide, 3D input
    stock.train(), converted.train()
    buffers = [b.clone() for b in converted.buffers()]
    for model in (stock, converted):
        with pytest.raises(AssertionError, match="batch size must be evenly divisible"):
            model(torch.randn(2 * splits + 1, 6, 3, 3))
        with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
            model(torch.randn(2 * splits, 6, 3))
    for a, b in zip(buffers, converted.buffers(), strict=True):
        _assert_equal("buffer after the error", a, b)
    bnswap.revert(converted)
    assert not any(bnswap.is_swapped(m) for _, m in _bn_layers(converted))


def test_timm_split_batchnorm_is_left_out_and_synchronized_whole():
    """A newcomer's find (issue 26): excluding a SplitBatchNorm2d left its aux_bn children
    swapped, and sync_batchnorm=True made the children synchronized SyncBatchNorm while
    the layer itself stayed unsynchronized: half-converted layers, in silence. A
    BatchNorm layer inside another follows it: excluded with it, chosen with it by an
    include, unsynchronized with it (and convert says so, naming them)."""
    timm = _import("timm")
    layer = timm.layers.SplitBatchNorm2d(4, num_splits=3)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), layer)
    plan = bnswap.plan(model, exclude="1")
    assert [(r.name, r.action, r.excluded) for r in plan] == [
        ("1", "skip", True),
        ("1.aux_bn.0", "skip", True),
        ("1.aux_bn.1", "skip", True),
    ]
    assert plan.rows[1].reason == "excluded with the BatchNorm layer it is part of, '1'"
    assert [r.action for r in bnswap.plan(model, include="1")] == ["swap"] * 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bnswap.convert(copy.deepcopy(model), sync_batchnorm=True)
    synced = bnswap.plan(model, sync_batchnorm=True)
    assert [r.synchronized for r in synced] == [False] * 3
    assert [str(w.message) for w in caught if "unsynchronized" in str(w.message)] == [
        "bnswap.convert: 3 swapped layers stay unsynchronized with sync_batchnorm=True: "
        "sync_batchnorm=True converts BatchNorm1d/2d/3d (exact class, not parametrized) and "
        "timm's BatchNormAct2d: '1'; part of '1', which is not: '1.aux_bn.0', '1.aux_bn.1'; "
        "bnswap.plan(model) shows each layer and why"
    ]


def test_timm_convert_splitbn_model_swapped_whole_and_bitwise():
    """A timm model as ``train.py --split-bn`` makes it (``convert_splitbn_model``: every
    BatchNormAct2d becomes a SplitBatchNorm2d holding its drop / act): every layer is
    swapped, convert warns nothing, and a training step (both splits) and eval are timm's
    bit for bit."""
    timm = _import("timm")
    from timm.layers import SplitBatchNorm2d, convert_splitbn_model

    torch.manual_seed(0)
    stock = convert_splitbn_model(
        timm.create_model("mobilenetv3_small_100", pretrained=False, num_classes=NUM_CLASSES),
        num_splits=2,
    )
    splits = [m for _, m in stock.named_modules() if type(m) is SplitBatchNorm2d]
    assert len(splits) == 34 and all(hasattr(m, "act") for m in splits)
    converted = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bnswap.convert(converted)
    table = bnswap.plan(stock)
    assert len(table) == len(table.swapped) == 68, str(table)  # 34 layers, 34 aux layers
    assert Counter(r.adapter_name for r in table) == {
        "bnswap.adapters.timm.split_batch_norm_2d": 34,
        ADAPTERS["BatchNorm2d"]: 34,
    }
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    results = []
    for model in (stock, converted):
        model.train()
        torch.manual_seed(1234)
        out = model(x)
        nn.functional.cross_entropy(out, torch.tensor([3, 7, 1, 0])).backward()
        results.append(out)
    _assert_equal("training output", *results)
    for (n, a), (_, b) in zip(stock.named_parameters(), converted.named_parameters(), strict=True):
        _assert_equal(f"gradient of {n}", a.grad, b.grad)
    for (n, a), (_, b) in zip(stock.named_buffers(), converted.named_buffers(), strict=True):
        _assert_equal(f"buffer {n}", a, b)
    for model in (stock, converted):
        model.eval()
    with torch.no_grad():
        _assert_equal("eval output", stock(x), converted(x))


# --- more timm families built on BatchNormAct2d -----------------------------------------

FAMILIES = [
    ("regnety_002", 44, True),
    ("mobilenetv3_small_100", 34, True),
    ("densenet121", 121, False),
    ("cspdarknet53", 67, False),
]


@pytest.mark.parametrize(("name", "count", "bitwise"), FAMILIES, ids=[n for n, *_ in FAMILIES])
def test_timm_batchnormact_family_swapped(name, count, bitwise):
    """Every layer swapped through the timm adapter; for the small models, one training
    forward and backward bitwise equal to stock (DenseNet-121 and CSPDarkNet-53 are
    plan-only, to keep the file's run time down on 2 cores)."""
    stock, converted = _pair("timm", name)
    table = bnswap.plan(stock)
    assert len(table) == len(table.swapped) == count, str(table)
    assert {(r.cls, r.adapter_name) for r in table} == {
        ("BatchNormAct2d", ADAPTERS["BatchNormAct2d"])
    }
    assert all(bnswap.is_swapped(m) for _, m in _bn_layers(converted))
    if not bitwise:
        return
    x, y = _input(), _targets()
    results = []
    for model in (stock, converted):
        model.train()
        torch.manual_seed(1234)
        out = model(x)
        nn.functional.cross_entropy(out, y).backward()
        results.append((out, model))
    (s_out, s), (c_out, c) = results
    _assert_equal("training output", s_out, c_out)
    for (n, a), (_, b) in zip(s.named_parameters(), c.named_parameters(), strict=True):
        _assert_equal(f"gradient of {n}", a.grad, b.grad)
    for (n, a), (_, b) in zip(s.named_buffers(), c.named_buffers(), strict=True):
        _assert_equal(f"buffer {n}", a, b)


# --- a timm model trained through the Lightning callback ------------------------------


def _lightning_parts() -> tuple[Any, Any, Any]:
    """(lightning.pytorch, bnswap.lightning.BNSwap, bnswap.app.data.DigitsDataModule), or skip.

    scikit-learn (the digits data) is imported only when the data loads, so a missing one
    is checked here: the import of bnswap.app.data alone succeeds without it."""
    if importlib.util.find_spec("sklearn") is None:
        pytest.skip(
            "scikit-learn is not installed here (the digits data); install bnswap[lightning]"
        )
    try:
        pl = importlib.import_module("lightning.pytorch")
        bl = importlib.import_module("bnswap.lightning")
        data = importlib.import_module("bnswap.app.data")
    except ModuleNotFoundError as e:
        name = e.name or ""
        if name.startswith("bnswap."):
            pytest.skip(f"{name} is not in this checkout (the Lightning callback's branch)")
        if name.split(".")[0] in ("lightning", "pytorch_lightning", "sklearn"):
            pytest.skip(f"{name} is not installed here; install bnswap[lightning]")
        raise
    return pl, bl.BNSwap, data.DigitsDataModule


def test_timm_lightning_two_epochs_same_val_accuracy_as_stock(tmp_path):
    """timm mobilenetv2_100 (every BatchNorm a timm BatchNormAct2d) on the digits data,
    two epochs, with and without the BNSwap callback, same seed: the same validation
    accuracy after each epoch, and the same final weights and statistics, bitwise.

    Skipped until ``bnswap.lightning`` / ``bnswap.app.data`` are in the checkout; checked
    against the ``lightning`` branch at 1611077 and c3c3040 (stock 0.148 then 0.513
    validation accuracy, bnswap the same; about 60 s on one thread)."""
    timm = _import("timm")
    pl, BNSwap, DigitsDataModule = _lightning_parts()
    import torch.nn.functional as F

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = timm.create_model(
                "mobilenetv2_100", pretrained=False, num_classes=10, in_chans=1, drop_rate=0.2
            )
            self.val_acc: list[float] = []
            self._correct = self._seen = 0

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def on_validation_epoch_start(self):
            self._correct = self._seen = 0

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self._correct += int((self(x).argmax(1) == y).sum())
            self._seen += len(y)

        def on_validation_epoch_end(self):
            if not self.trainer.sanity_checking:
                self.val_acc.append(self._correct / self._seen)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def fit(callbacks: list, root: str) -> Classifier:
        pl.seed_everything(7, workers=True)
        model = Classifier()
        trainer = pl.Trainer(
            max_epochs=2,
            accelerator="cpu",
            devices=1,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            deterministic=True,
            default_root_dir=str(tmp_path / root),
        )
        trainer.fit(model, DigitsDataModule(batch_size=64, image_size=32, seed=0))
        return model

    stock = fit([], "stock")
    callback = BNSwap()
    swapped = fit([callback], "bnswap")

    assert callback.plan is not None
    assert len(callback.plan.swapped) == len(callback.plan) == 52, str(callback.plan)
    assert {r.adapter_name for r in callback.plan} == {ADAPTERS["BatchNormAct2d"]}
    layers = _bn_layers(swapped)
    assert len(layers) == 52 and all(bnswap.is_swapped(m) for _, m in layers)
    assert not any(bnswap.is_swapped(m) for m in stock.modules())

    assert len(stock.val_acc) == 2
    assert swapped.val_acc == stock.val_acc
    assert stock.val_acc[-1] > 0.3, stock.val_acc  # it learned (chance: 0.1)
    s_state, c_state = stock.state_dict(), swapped.state_dict()
    assert list(s_state) == list(c_state)
    for k in s_state:
        _assert_equal(k, s_state[k], c_state[k])


@pytest.mark.parametrize(("name", "count"), [("resnet18", 20), ("mobilenetv3_small_050", 34)])
def test_timm_freeze_unfreeze_during_fit_stays_swapped(tmp_path, name, count):
    """timm's freeze / unfreeze round trip (``timm.utils.model``: every BatchNorm replaced
    by FrozenBatchNorm2d, then by a new BatchNorm) at the start of epoch 1. Guards: the
    rebuilt layers trained on stock BatchNorm (resnet18 had 19 of 20 swapped after the
    round trip, mobilenetv3_small_050 0 of 34). BNSwap swaps them before their first
    training step; the run equals stock's with the same round trip, bitwise."""
    timm = _import("timm")
    pl, BNSwap, _ = _lightning_parts()
    from timm.utils.model import freeze, unfreeze

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = timm.create_model(name, pretrained=False, num_classes=4)
            self.swapped: list[list[bool]] = []

        def training_step(self, batch, batch_idx):
            self.swapped.append([bnswap.is_swapped(m) for _, m in _bn_layers(self)])
            return self.net(batch[0]).logsumexp(1).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class FreezeUnfreeze(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                freeze(pl_module.net)
                unfreeze(pl_module.net)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, 32, 32, generator=g))
    runs = []
    for callbacks in ([FreezeUnfreeze()], [BNSwap(), FreezeUnfreeze()]):
        pl.seed_everything(0)
        module = Module()
        before = dict(_bn_layers(module))  # (held: a freed layer's id could be reused)
        pl.Trainer(
            max_epochs=2,
            accelerator="cpu",
            devices=1,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            deterministic=True,
            default_root_dir=str(tmp_path),
        ).fit(module, torch.utils.data.DataLoader(data, batch_size=4))
        assert all(m is not before[n] for n, m in _bn_layers(module))  # all rebuilt
        runs.append(module)
    stock, swapped = runs
    assert len(swapped.swapped) == 4 and all(len(s) == count and all(s) for s in swapped.swapped)
    for k, v in stock.state_dict().items():
        _assert_equal(k, v, swapped.state_dict()[k])


@pytest.mark.parametrize(
    ("model", "count"), [("torchvision.models.resnet18", 20), ("timm.models.mobilenetv2_100", 52)]
)
def test_bnswap_plan_of_a_zoo_model_swaps_every_layer(capsys, model, count):
    """`bnswap plan --model torchvision.models.resnet18` (any importable function returning
    an nn.Module, its arguments the jsonargparse way; timm's model functions take only
    **kwargs, which jsonargparse cannot see): every layer swapped, exit 0."""
    _import(model.split(".")[0])
    pytest.importorskip("jsonargparse")
    from bnswap.app import plan_cli

    args = ["--model.num_classes", "10"] if model.startswith("torchvision") else []
    code = plan_cli.main(["--model", model, *args, "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["summary"]["swapped"] == data["summary"]["layers"] == count
