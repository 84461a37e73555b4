"""The adapter registry: a custom BatchNorm subclass (the worked example of
docs/adapters.md), ``bnswap.register`` errors, ``revert`` of adapted layers, and the
lazy timm entry. Runs without torchvision / timm."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import bnswap
from bnswap import registry
from bnswap._swap import SWAP
from bnswap.sync import sync_batch_norm_forward

# --- the worked example (docs/adapters.md) -------------------------------------------


class BatchNormSiLU2d(nn.BatchNorm2d):
    """A user's BatchNorm2d subclass with extra behaviour: SiLU, then a fixed gain."""

    def __init__(self, num_features: int, gain: float = 1.0, **kwargs):
        super().__init__(num_features, **kwargs)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(super().forward(x)) * self.gain


def batch_norm_silu_2d(layer: BatchNormSiLU2d, x: torch.Tensor) -> torch.Tensor:
    """Its adapter: the same forward, with the batch norm on bnswap's kernel."""
    layer._check_input_dim(x)
    return F.silu(bnswap.module_batch_norm(layer, x)) * layer.gain


class PlainSubclass(nn.BatchNorm2d):
    """A subclass that adds nothing to forward: torch's adapter serves it."""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.bnact = BatchNormSiLU2d(8, gain=1.5, momentum=None)
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 1), BatchNormSiLU2d(8, gain=0.5), nn.Dropout(0.3), PlainSubclass(8)
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.block(self.bnact(self.bn(self.conv(x))))
        return self.head(x.mean((2, 3)))


@pytest.fixture
def clean_registry():
    """Restore the registry as it was after each test."""
    adapters, lazy = dict(registry._ADAPTERS), dict(registry._LAZY)
    yield
    for d, saved in ((registry._ADAPTERS, adapters), (registry._LAZY, lazy)):
        d.clear()
        d.update(saved)


def _net() -> Net:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():  # non-trivial affine parameters
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return net


def _qual(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_custom_subclass_skipped_until_registered(clean_registry):
    table = bnswap.plan(_net())
    by_name = {r.name: r for r in table}
    assert by_name["bn"].action == "swap"
    assert by_name["bn"].adapter_name == "bnswap.layers.batch_norm_forward"
    for name in ("bnact", "block.1"):
        assert by_name[name].action == "skip"
        assert "BatchNormSiLU2d overrides forward" in by_name[name].reason
        assert (
            "bnswap.register(BatchNormSiLU2d, <function>), see the 'Adapters' guide of "
            "bnswap's documentation" in by_name[name].reason
        )
        assert by_name[name].adapter_name == "-"
    # a subclass that keeps torch's forward needs no registration
    assert by_name["block.3"].action == "swap"
    assert by_name["block.3"].adapter_name == "bnswap.layers.batch_norm_forward"
    net = _net()
    bnswap.convert(net)
    assert not bnswap.is_swapped(net.bnact) and bnswap.is_swapped(net.block[3])
    assert type(net.bnact) is BatchNormSiLU2d and type(net.block[3]) is PlainSubclass


def test_custom_subclass_registered_bitwise_equal_to_stock(clean_registry):
    bnswap.register(BatchNormSiLU2d, batch_norm_silu_2d)
    assert registry.lookup(BatchNormSiLU2d) is batch_norm_silu_2d

    stock = _net()
    converted = copy.deepcopy(stock)
    keys = list(stock.state_dict())
    table = bnswap.plan(converted)
    assert len(table.swapped) == len(table) == 4
    adapters = {r.name: r.adapter_name for r in table}
    assert adapters == {
        "bn": "bnswap.layers.batch_norm_forward",
        "bnact": _qual(batch_norm_silu_2d),
        "block.1": _qual(batch_norm_silu_2d),
        "block.3": "bnswap.layers.batch_norm_forward",
    }
    assert bnswap.convert(converted) is converted
    assert type(converted.bnact) is BatchNormSiLU2d and bnswap.is_swapped(converted.bnact)
    assert converted.bnact.gain == 1.5 and converted.block[1].gain == 0.5
    assert list(converted.state_dict()) == keys
    assert repr(converted.bnact) == repr(stock.bnact)

    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, converted)]
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    for step in range(3):  # momentum=None: the cumulative average over 3 batches
        outs = []
        for model, opt in zip((stock, converted), opts, strict=True):
            model.train()
            opt.zero_grad()
            torch.manual_seed(step)  # same dropout mask
            out = model(x + step)
            out.square().mean().backward()
            opt.step()
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        pairs = zip(stock.named_parameters(), converted.named_parameters(), strict=True)
        for (n, a), (_, b) in pairs:
            assert torch.equal(a.grad, b.grad), n
            assert torch.equal(a, b), n
        for (n, a), (_, b) in zip(stock.named_buffers(), converted.named_buffers(), strict=True):
            assert torch.equal(a, b), n
    assert int(converted.bnact.num_batches_tracked) == 3
    stock.eval()
    converted.eval()
    with torch.no_grad():
        assert torch.equal(stock(x), converted(x))


def test_adapted_layers_deepcopy_and_pickle_with_their_adapter(clean_registry):
    """A deepcopy keeps the adapter (the copy is swapped); a torch.save of the whole model
    loads as stock's layers (issue 32) and bnswap.convert gives them the adapter again."""
    bnswap.register(BatchNormSiLU2d, batch_norm_silu_2d)
    net = bnswap.convert(_net())
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert not any(bnswap.is_swapped(m) for m in loaded.modules())
    for clone in (copy.deepcopy(net), bnswap.convert(loaded)):
        for a, b in zip(net.modules(), clone.modules(), strict=True):
            assert bnswap.is_swapped(a) == bnswap.is_swapped(b)
            if bnswap.is_swapped(b):
                assert vars(b)[SWAP].owner is bnswap._swap.forward_owner(type(b))
                assert vars(b)[SWAP].adapter is vars(a)[SWAP].adapter
        x = torch.randn(2, 3, 6, 6)
        ref = copy.deepcopy(bnswap.revert(copy.deepcopy(net)))  # stock, same state
        torch.manual_seed(3)  # the same dropout mask
        y = clone(x)
        torch.manual_seed(3)
        assert torch.equal(y, ref(x))
        assert all(torch.equal(a, b) for a, b in zip(clone.buffers(), ref.buffers(), strict=True))


def test_revert_restores_adapted_layers_exactly(clean_registry):
    bnswap.register(BatchNormSiLU2d, batch_norm_silu_2d)
    net = _net()
    net.block.add_module("p", BatchNormSiLU2d(8))
    parametrize.register_parametrization(net.block.p, "weight", nn.Identity())
    p_cls = type(net.block.p)
    assert p_cls.__bases__ == (BatchNormSiLU2d,)
    classes = [(n, type(m)) for n, m in net.named_modules()]
    params = [(n, id(p)) for n, p in net.named_parameters()]
    buffers = [(n, id(b)) for n, b in net.named_buffers()]
    children = [id(m) for m in net.modules()]
    attrs = [(n, sorted(vars(m))) for n, m in net.named_modules()]

    bnswap.convert(net)
    assert [(n, type(m)) for n, m in net.named_modules()] == classes  # never changed
    assert bnswap.is_swapped(net.block.p)
    assert bnswap.revert(net) is net
    assert [(n, type(m)) for n, m in net.named_modules()] == classes
    assert [(n, id(p)) for n, p in net.named_parameters()] == params
    assert [(n, id(b)) for n, b in net.named_buffers()] == buffers
    assert [id(m) for m in net.modules()] == children
    assert [(n, sorted(vars(m))) for n, m in net.named_modules()] == attrs
    assert not any(bnswap.is_swapped(m) for m in net.modules())
    parametrize.remove_parametrizations(net.block.p, "weight")
    assert type(net.block.p) is BatchNormSiLU2d

    # convert / revert twice more: same classes each time.
    for _ in range(2):
        bnswap.convert(net)
        assert bnswap.is_swapped(net.bnact) and type(net.bnact) is BatchNormSiLU2d
        bnswap.revert(net)
        assert not bnswap.is_swapped(net.bnact)
        assert type(net.bnact) is BatchNormSiLU2d and type(net.block[3]) is PlainSubclass


def test_revert_keeps_parametrizations_added_while_converted(clean_registry):
    bnswap.register(BatchNormSiLU2d, batch_norm_silu_2d)
    layer = BatchNormSiLU2d(4)
    parametrize.register_parametrization(layer, "weight", nn.Identity())
    bnswap.convert(layer)
    parametrize.register_parametrization(layer, "bias", nn.Identity())
    cls = type(layer)
    x = torch.randn(2, 4, 3, 3)
    ref = copy.deepcopy(layer)
    bnswap.revert(ref)
    assert torch.equal(layer(x), ref(x))  # both parametrizations apply while swapped
    bnswap.revert(layer)
    assert type(layer) is cls  # torch's class with both properties, untouched by revert
    assert parametrize.is_parametrized(layer, "weight")
    assert parametrize.is_parametrized(layer, "bias")
    assert torch.equal(layer.bias, layer.parametrizations.bias.original)
    parametrize.remove_parametrizations(layer, "bias")
    parametrize.remove_parametrizations(layer, "weight")
    assert type(layer) is BatchNormSiLU2d


def other_adapter(layer, x):
    return F.silu(bnswap.module_batch_norm(layer, x)) * layer.gain


def test_register_replaces_an_earlier_adapter(clean_registry):
    bnswap.register(BatchNormSiLU2d, batch_norm_silu_2d)
    bnswap.register(BatchNormSiLU2d, batch_norm_silu_2d)  # idempotent
    early = bnswap.convert(BatchNormSiLU2d(4))
    bnswap.register(BatchNormSiLU2d, other_adapter)
    assert registry.lookup(BatchNormSiLU2d) is other_adapter
    assert vars(early)[SWAP].adapter is batch_norm_silu_2d  # layers keep theirs
    assert vars(bnswap.convert(BatchNormSiLU2d(4)))[SWAP].adapter is other_adapter
    bnswap.unregister(BatchNormSiLU2d)
    assert registry.lookup(BatchNormSiLU2d) is None
    bnswap.unregister(BatchNormSiLU2d)  # no-op


def test_one_adapter_may_serve_several_classes(clean_registry):
    class Sub(BatchNormSiLU2d):
        pass

    bnswap.register(BatchNormSiLU2d, batch_norm_silu_2d)
    bnswap.register(Sub, batch_norm_silu_2d)  # Sub inherits the forward it adapts
    torch.manual_seed(0)
    stock = nn.Sequential(BatchNormSiLU2d(3, gain=2.0), Sub(3, gain=0.5))
    swapped = bnswap.convert(copy.deepcopy(stock))
    assert [bnswap.is_swapped(m) for m in swapped] == [True, True]
    x = torch.randn(4, 3, 2, 2)
    assert torch.equal(stock(x), swapped(x))


class _NotBN(nn.Module):
    pass


@pytest.mark.parametrize(
    ("source", "adapter", "error", "match"),
    [
        (_NotBN, batch_norm_silu_2d, TypeError, "source_cls must be a _BatchNorm subclass"),
        ("BatchNormSiLU2d", batch_norm_silu_2d, TypeError, "source_cls must be a _Batch"),
        (BatchNormSiLU2d, BatchNormSiLU2d, TypeError, "adapter must be a function"),
        (BatchNormSiLU2d, bnswap.BatchNorm2d, TypeError, "adapter must be a function"),
        (BatchNormSiLU2d, "batch_norm_silu_2d", TypeError, "adapter must be a function"),
        (BatchNormSiLU2d, None, TypeError, "adapter must be a function"),
    ],
)
def test_register_rejects_bad_arguments(clean_registry, source, adapter, error, match):
    before = dict(registry._ADAPTERS)
    with pytest.raises(error, match=match):
        bnswap.register(source, adapter)
    assert before == registry._ADAPTERS


def test_torchs_classes_and_their_plain_subclasses_use_torchs_adapter():
    from bnswap.layers import batch_norm_forward

    for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm2d, PlainSubclass):
        assert registry.lookup(cls) is batch_norm_forward
    assert registry.lookup(nn.SyncBatchNorm) is sync_batch_norm_forward
    assert registry.lookup(BatchNormSiLU2d) is None


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_bnswap_does_not_import_timm():
    out = _run("""
        import sys
        import torch
        import bnswap, bnswap.adapters
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
        bnswap.convert(net)
        bnswap.revert(net)
        print(sorted(m for m in sys.modules
                     if m.split(".")[0] in ("timm", "torchvision") or m == "bnswap.adapters.timm"))
    """)
    assert out.strip() == "[]"


def test_timm_entry_is_resolved_only_when_a_model_holds_the_class():
    """The lazy timm entry, exercised with a stand-in ``timm`` package (so that it runs
    without timm): ``bnswap.adapters.timm`` is imported, and the adapter registered, the
    first time a model holding ``timm.layers.norm_act.BatchNormAct2d`` is planned."""
    out = _run("""
        import sys, types
        import torch
        from torch import nn

        import bnswap
        from bnswap import registry

        # A stand-in for timm's package, built before anything imports timm.
        timm = types.ModuleType("timm")
        layers = types.ModuleType("timm.layers")
        norm_act = types.ModuleType("timm.layers.norm_act")
        trace_utils = types.ModuleType("timm.layers.trace_utils")
        trace_utils._assert = torch._assert
        timm.layers, layers.norm_act, layers.trace_utils = layers, norm_act, trace_utils

        class BatchNormAct2d(nn.BatchNorm2d):
            def __init__(self, n):
                super().__init__(n)
                self.drop = nn.Dropout(0.5)
                self.act = nn.ReLU(inplace=True)

            def forward(self, x):
                torch._assert(x.ndim == 4, f"expected 4D input (got {x.ndim}D input)")
                return self.act(self.drop(super().forward(x)))

        BatchNormAct2d.__module__ = "timm.layers.norm_act"
        norm_act.BatchNormAct2d = BatchNormAct2d
        sys.modules.update({"timm": timm, "timm.layers": layers,
                            "timm.layers.norm_act": norm_act,
                            "timm.layers.trace_utils": trace_utils})

        bnswap.plan(nn.Sequential(nn.BatchNorm2d(3)))
        assert "bnswap.adapters.timm" not in sys.modules
        assert BatchNormAct2d not in registry.registered()

        torch.manual_seed(0)
        stock = nn.Sequential(nn.Conv2d(3, 6, 1), BatchNormAct2d(6))
        converted = bnswap.convert(__import__("copy").deepcopy(stock))
        assert "bnswap.adapters.timm" in sys.modules
        from bnswap.adapters.timm import batch_norm_act_2d
        assert registry.lookup(BatchNormAct2d) is batch_norm_act_2d
        row, = bnswap.plan(converted)
        print(row.cls, row.action, row.adapter_name)
        assert type(converted[1]) is BatchNormAct2d and bnswap.is_swapped(converted[1])
        assert converted[1].act is not None
        x = torch.randn(4, 3, 5, 5)
        for m in (stock, converted):
            torch.manual_seed(1)
            m.train()
            y = m(x)
            y.sum().backward()
            m.eval()
            print(y.sum().item(), m(x).sum().item(), m[0].weight.grad.sum().item(),
                  m[1].running_var.sum().item())
        bnswap.revert(converted)
        assert type(converted[1]) is BatchNormAct2d and not bnswap.is_swapped(converted[1])
    """)
    lines = out.strip().splitlines()
    assert lines[0] == "BatchNormAct2d keep bnswap.adapters.timm.batch_norm_act_2d"
    assert lines[1] == lines[2]  # train output, eval output, gradients, statistics
