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


# --- a class-level forward patch (issue 46: MEMO-like test-time adaptation) ----------


class Memo:
    """A MEMO-like test-time adaptation patch: a forward that normalizes with the running
    statistics mixed with the batch's (prior 0.8), counting its calls. Both the stock
    model and the converted one run it, so their outputs must be equal."""

    def __init__(self):
        self.calls = 0

        def memo_forward(layer, input):
            self.calls += 1
            batch = input.detach()
            dims = [0, *range(2, batch.dim())]
            mean = 0.8 * layer.running_mean + 0.2 * batch.mean(dims)
            var = 0.8 * layer.running_var + 0.2 * batch.var(dims, unbiased=False)
            return F.batch_norm(input, mean, var, layer.weight, layer.bias, False, 0.0, layer.eps)

        self.forward = memo_forward


@pytest.fixture
def patch_forward():
    """``patch_forward(cls, fn)``: ``cls.forward = fn`` as the user's code does, the class's
    own entry (bnswap's dispatcher on ``_BatchNorm`` in this process, or none) put back
    after the test."""
    saved: list[tuple[type, object]] = []

    def put_back(cls: type, before: object) -> None:
        if before is None:
            if "forward" in vars(cls):
                del cls.forward
        else:
            cls.forward = before

    def patch(cls: type, fn):
        """Returns what puts the class's own entry back now."""
        saved.append((cls, vars(cls).get("forward")))
        cls.forward = fn
        return lambda: put_back(*saved[-1])

    yield patch
    for cls, before in reversed(saved):
        put_back(cls, before)


def _tta_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
    )
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    return net.eval()


_PATCHED = {"BatchNorm2d": nn.BatchNorm2d, "_BatchNorm": torch.nn.modules.batchnorm._BatchNorm}


def _memo_adapter(memo: Memo):
    """An adapter that runs ``memo``'s function on bnswap's kernel (the fix the reason
    names), counting its own calls."""
    seen = []

    def adapter(layer, x):
        seen.append(layer)
        layer._check_input_dim(x)
        batch = x.detach()
        mean = 0.8 * layer.running_mean + 0.2 * batch.mean((0, 2, 3))
        var = 0.8 * layer.running_var + 0.2 * batch.var((0, 2, 3), unbiased=False)
        return torch.batch_norm(
            x, layer.weight, layer.bias, mean, var, False, 0.0, layer.eps, False
        )

    return adapter, seen


@pytest.mark.parametrize("patched", sorted(_PATCHED))
def test_class_patch_before_convert_is_an_override(clean_registry, patch_forward, patched):
    """Order 1 (patch, then build and convert): a forward that is not the function torch
    defined is an override, as a subclass's is: the layers are skipped, the reason names
    the patch and the fix, and the user's function runs (as in stock, the same outputs).
    Registering an adapter for the class swaps them onto it."""
    memo = Memo()
    patch_forward(_PATCHED[patched], memo.forward)
    stock, model = _tta_net(), _tta_net()
    assert registry.overrides_forward(nn.BatchNorm2d)
    assert registry.replaced_forward(nn.BatchNorm2d) == (_PATCHED[patched], memo.forward)
    with pytest.warns(UserWarning, match="class-level patch replaced needs an adapter"):
        bnswap.convert(model)
    rows = bnswap.plan(model).rows
    assert [r.action for r in rows] == ["skip", "skip"]
    assert rows[0].reason == (
        f"{patched}.forward is not torch's (a class-level patch put "
        f"{_qual(memo.forward)} there); swapping would drop it; register an adapter: "
        "bnswap.register(BatchNorm2d, <function>), see the 'Adapters' guide of bnswap's "
        "documentation"
    )
    assert not any(bnswap.is_swapped(m) for m in model.modules())
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        out = model(x)
        assert memo.calls == 2
        assert torch.equal(out, stock(x)) and memo.calls == 4

    adapter, seen = _memo_adapter(memo)
    bnswap.register(nn.BatchNorm2d, adapter)
    bnswap.convert(model)
    assert [r.action for r in bnswap.plan(model)] == ["keep", "keep"]
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))
    assert len(seen) == 2 and memo.calls == 6  # the adapter ran, the patch only for stock
    bnswap.revert(model)
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))
    assert len(seen) == 2 and memo.calls == 10  # reverted: the user's function again


@pytest.mark.parametrize("patched", sorted(_PATCHED))
def test_class_patch_after_convert_runs_and_is_said(clean_registry, patch_forward, patched):
    """Order 2 (convert, then patch the class): the user's function runs (as in stock:
    the same outputs); bnswap says so with one warning, ``is_swapped`` is False, ``plan``
    skips the layers naming the patch, and ``convert`` drops the swap that no longer
    runs. Putting torch's forward back needs a convert to swap them again."""
    stock, model = _tta_net(), _tta_net()
    bnswap.convert(model)
    assert all(bnswap.is_swapped(m) for m in (model[1], model[4]))
    memo = Memo()
    put_back = patch_forward(_PATCHED[patched], memo.forward)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        out = model(x)
        assert memo.calls == 2
        assert torch.equal(out, stock(x)) and memo.calls == 4
    with pytest.warns(UserWarning) as caught:
        assert not bnswap.is_swapped(model[1]) and not bnswap.is_swapped(model[4])
        assert bnswap._swap.adapter_of(model[1]) is None
    assert [str(w.message) for w in caught] == [
        f"bnswap: {patched}.forward was replaced after bnswap swapped layers that run it (by "
        f"{_qual(memo.forward)}, a class-level patch): that function runs for them, not "
        "bnswap's forward (which runs only where that function calls the forward it "
        "replaced). bnswap.is_swapped(layer) is False for them and bnswap.plan skips them; "
        "to run your function on bnswap's kernel, register an adapter that does what it does "
        "(bnswap.register(<class>, <function>), see the 'Adapters' guide of bnswap's "
        "documentation) and convert again"
    ]  # once: not again for the second layer, nor for the calls below
    rows = bnswap.plan(model).rows
    assert [r.action for r in rows] == ["skip", "skip"]
    assert rows[0].reason.startswith(f"{patched}.forward is not torch's (a class-level patch")
    assert rows[0].reason.endswith(
        "; convert drops its swap, made before the patch (it no longer runs)"
    )
    with pytest.warns(UserWarning, match="class-level patch replaced needs an adapter"):
        bnswap.convert(model)
    assert SWAP not in vars(model[1]) and SWAP not in vars(model[4])
    with torch.no_grad():
        assert torch.equal(model(x), stock(x)) and memo.calls == 8
    put_back()  # torch's forward (bnswap's dispatcher) again: the layers are stock's
    assert not any(bnswap.is_swapped(m) for m in model.modules())
    bnswap.convert(model)
    assert [r.action for r in bnswap.plan(model)] == ["keep", "keep"]
    with torch.no_grad():
        assert torch.equal(model(x), stock(x)) and memo.calls == 8


def test_class_patch_that_calls_the_dispatcher_is_no_bypass_for_a_subclass():
    """higher's ``monkeypatch`` makes a subclass whose forward calls the class's (bnswap's
    dispatcher): the copy stays swapped, no warning. A subclass of the user's own is no
    replacement either."""

    class Patched(nn.BatchNorm2d):
        def forward(self, x):
            return nn.BatchNorm2d.forward(self, x)

    layer = bnswap.convert(nn.BatchNorm2d(3))
    copy_ = copy.copy(layer)
    copy_.__dict__.update(layer.__dict__)
    copy_.__class__ = Patched
    assert bnswap._swap.bypass_of(copy_) is None and bnswap.is_swapped(copy_)


def test_class_patch_before_the_first_swap_of_a_process():
    """MEMO's own order in a fresh process: ``_BatchNorm.forward`` replaced before bnswap
    put anything on it. The layers are skipped; an adapter registered for the class runs
    (the dispatcher then stands for the user's function, which the stock layers of other
    classes keep running)."""
    out = _run("""
        import warnings
        import torch, torch.nn.functional as F
        from torch import nn
        from torch.nn.modules.batchnorm import _BatchNorm
        import bnswap
        calls = []
        def memo(self, input):
            calls.append(type(self).__name__)
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        _BatchNorm.forward = memo
        model = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm1d(3)).eval()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            bnswap.convert(model)
        print(len(w), [r.action for r in bnswap.plan(model)])
        seen = []
        def adapter(layer, x):
            seen.append(1)
            return bnswap.module_batch_norm(layer, x)
        bnswap.register(nn.BatchNorm2d, adapter)
        bnswap.convert(model)
        print([r.action for r in bnswap.plan(model)], _BatchNorm.forward is not memo)
        x = torch.randn(2, 3, 1, 1)
        with torch.no_grad():
            y = model[1](model[0](x).flatten(1))
        print(len(seen), calls)
    """)
    assert out.splitlines() == [
        "1 ['skip', 'skip']",
        "['keep', 'skip'] True",
        "1 ['BatchNorm1d']",
    ]
