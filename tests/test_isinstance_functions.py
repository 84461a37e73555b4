"""torch functions that find BatchNorm layers by isinstance (or by type) must work on a
converted model exactly as on the stock model: each test runs the function on a stock
model and on a converted deepcopy and compares the results (bitwise unless noted).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, replace_all_batch_norm_modules_, vmap
from torch.nn.modules.batchnorm import _BatchNorm

import bnswap
from tests._helpers import (
    TORCH,
    outcome,
    pair,
    state_diff,
)


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm parameters and statistics (a fresh layer is the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                for t in (m.weight, m.bias, m.running_mean):
                    if t is not None:
                        t.copy_(torch.randn(t.shape, generator=g))
                if m.running_var is not None:
                    m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model


def _net() -> nn.Module:
    torch.manual_seed(0)
    return _randomize(
        nn.Sequential(
            nn.Conv2d(3, 4, 3),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 4, 1),
            nn.BatchNorm2d(4, momentum=None),
            nn.Flatten(),
            nn.Linear(4 * 3 * 3, 5),
            nn.BatchNorm1d(5),
        )
    )


def _bn_classes(model: nn.Module) -> list[type]:
    return [type(m) for m in model.modules() if isinstance(m, _BatchNorm)]


# --- torch.optim.swa_utils.update_bn ---------------------------------------------------


def test_update_bn_matches_stock():
    from torch.optim.swa_utils import update_bn

    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(6, 3, 5, 5, generator=g), torch.zeros(6)) for _ in range(4)]
    stock, swapped = pair(_net())
    assert all(bnswap.is_swapped(m) for m in swapped.modules() if isinstance(m, _BatchNorm))
    for m in (stock, swapped):
        m.eval()
        update_bn(loader, m)
    # update_bn resets the statistics, uses the cumulative average (momentum=None)
    # over the loader, then restores momentum and the training flag
    assert state_diff(stock, swapped) == []
    for a, b in zip(stock.modules(), swapped.modules(), strict=True):
        if isinstance(a, _BatchNorm):
            assert a.momentum == b.momentum and a.training == b.training
            assert int(b.num_batches_tracked) == len(loader)
    assert not torch.equal(stock[1].running_mean, _net()[1].running_mean)  # it did move
    x = loader[0][0]
    assert torch.equal(stock.eval()(x), swapped.eval()(x))


# --- torch.func ------------------------------------------------------------------------


def test_replace_all_batch_norm_modules_then_vmap_in_training_matches_stock():
    stock, swapped = pair(_net())
    for m in (stock, swapped):
        replace_all_batch_norm_modules_(m)
    for a, b in zip(stock.modules(), swapped.modules(), strict=True):
        if isinstance(a, _BatchNorm):
            assert bnswap.is_swapped(b)
            assert (a.running_mean, a.running_var, a.num_batches_tracked) == (None, None, None)
            assert (b.running_mean, b.running_var, b.num_batches_tracked) == (None, None, None)
            assert a.track_running_stats is b.track_running_stats is False
    xs = torch.randn(3, 4, 3, 5, 5)  # 3 independent batches of 4
    ys, yb = vmap(stock)(xs), vmap(swapped)(xs)
    assert torch.equal(ys, yb)
    # per-batch batch statistics: as running each batch alone (up to rounding)
    torch.testing.assert_close(yb[1], swapped(xs[1]), rtol=1e-5, atol=1e-5)


def test_per_sample_grads_with_vmap_grad_functional_call_match_stock():
    # The torch.func per-sample-gradient recipe on a training model without statistics.
    stock, swapped = pair(_net())
    for m in (stock, swapped):
        replace_all_batch_norm_modules_(m)
    xs = torch.randn(3, 4, 3, 5, 5)

    def grads(model):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, x):
            return functional_call(model, p, (x,)).square().mean()

        return vmap(torch.func.grad(loss), in_dims=(None, 0))(params, xs)

    gs, gb = grads(stock), grads(swapped)
    assert gs.keys() == gb.keys()
    for k in gs:
        assert torch.equal(gs[k], gb[k]), k


def test_vmap_of_training_layer_with_statistics_raises_as_stock():
    stock, swapped = pair(_net())
    xs = torch.randn(3, 4, 3, 5, 5)
    a, b = outcome(lambda: vmap(stock)(xs)), outcome(lambda: vmap(swapped)(xs))
    assert a[0] == "err" and a == b, (a, b)
    assert "running_mean or running_var" in a[1][1]


def test_vmap_of_eval_layer_matches_stock():
    stock, swapped = pair(_net())
    stock.eval(), swapped.eval()
    xs = torch.randn(3, 4, 3, 5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(vmap(stock)(xs), vmap(swapped)(xs))
    assert state_diff(stock, swapped) == []


@pytest.mark.parametrize("track", [True, False])
def test_jacrev_of_training_layer_raises_or_matches_as_stock(track):
    stock, swapped = pair(_randomize(nn.BatchNorm2d(3, track_running_stats=track)))
    x = torch.randn(2, 3, 2, 2)
    a, b = outcome(lambda: jacrev(stock)(x)), outcome(lambda: jacrev(swapped)(x))
    assert a[0] == b[0], (a, b)
    if track:  # num_batches_tracked.add_ on a captured tensor
        assert a[0] == "err" and a == b
        assert "in-place operation" in a[1][1]
    else:
        assert torch.equal(a[1], b[1])


def test_jacrev_of_eval_layer_matches_stock_and_float64_maths():
    stock, swapped = pair(_randomize(nn.BatchNorm2d(3).double()).eval())
    x = torch.randn(2, 3, 2, 2, dtype=torch.float64)
    js, jb = jacrev(stock)(x), jacrev(swapped)(x)
    assert torch.equal(js, jb)
    # eval batch norm is diagonal: d y[n,c,h,w] / d x[n,c,h,w] = weight / sqrt(var + eps)
    scale = swapped.weight / (swapped.running_var + swapped.eps).sqrt()
    diag = jb.reshape(x.numel(), x.numel()).diagonal().reshape(x.shape)
    torch.testing.assert_close(diag, scale.view(1, 3, 1, 1).expand_as(x).detach())


@pytest.mark.parametrize("train", [True, False])
def test_functional_call_matches_stock(train):
    stock, swapped = pair(_net())
    x = torch.randn(4, 3, 5, 5)
    results = []
    for m in (stock, swapped):
        m.train(train)
        params = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
        buffers = {k: v.clone() for k, v in m.named_buffers()}
        own = {k: v.clone() for k, v in m.state_dict().items()}
        y = functional_call(m, {**params, **buffers}, (x,))
        y.square().sum().backward()
        # the module's own state is untouched; the passed buffers are updated in place
        assert all(torch.equal(v, own[k]) for k, v in m.state_dict().items())
        results.append((y, buffers, {k: p.grad for k, p in params.items()}))
    (ys, bs, gs), (yb, bb, gb) = results
    assert torch.equal(ys, yb)
    assert all(torch.equal(bs[k], bb[k]) for k in bs)
    assert all(torch.equal(gs[k], gb[k]) for k in gs)
    if train:
        assert int(bb["1.num_batches_tracked"]) == 1


# --- SyncBatchNorm.convert_sync_batchnorm ----------------------------------------------


def test_convert_sync_batchnorm_gives_stock_sync_layers():
    # convert_sync_batchnorm replaces every _BatchNorm (bnswap layers included, found by
    # isinstance) with a new torch.nn.SyncBatchNorm holding the same Parameters and
    # statistics: the result is the stock conversion, with no bnswap layer left.
    stock, swapped = pair(_net())
    ss = nn.SyncBatchNorm.convert_sync_batchnorm(stock)
    sb = nn.SyncBatchNorm.convert_sync_batchnorm(swapped)
    assert _bn_classes(ss) == _bn_classes(sb) == [nn.SyncBatchNorm] * 3
    assert not any(bnswap.is_swapped(m) for m in sb.modules())
    assert sb[1].weight is swapped[1].weight and sb[1].running_mean is swapped[1].running_mean
    assert state_diff(ss, sb) == []
    x = torch.randn(4, 3, 5, 5)  # no process group: SyncBatchNorm runs F.batch_norm
    assert torch.equal(ss(x), sb(x))
    assert state_diff(ss, sb) == []
    plan = bnswap.plan(sb)  # bnswap swaps them onto its synchronized forward
    assert [(r.action, r.adapter_name) for r in plan] == [
        ("swap", "bnswap.sync.sync_batch_norm_forward")
    ] * 3


# --- conv-BN fusion --------------------------------------------------------------------

_FUSE_CASES = [
    (nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), (2, 3, 7)),
    (nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), (2, 3, 7, 7)),
    (nn.Conv3d(3, 4, 3), nn.BatchNorm3d(4), (2, 3, 5, 5, 5)),
]


@pytest.mark.parametrize("conv,bn,shape", _FUSE_CASES, ids=["1d", "2d", "3d"])
def test_fuse_conv_bn_eval_matches_stock(conv, bn, shape):
    from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

    stock, swapped = pair(_randomize(nn.Sequential(conv, bn)).eval())
    fs, fb = fuse_conv_bn_eval(stock[0], stock[1]), fuse_conv_bn_eval(swapped[0], swapped[1])
    assert torch.equal(fs.weight, fb.weight) and torch.equal(fs.bias, fb.bias)
    x = torch.randn(shape)
    torch.testing.assert_close(fb(x), swapped(x), rtol=1e-5, atol=1e-5)
    # transposed convolutions (transpose=True) and Linear + BatchNorm1d
    t = _randomize(nn.Sequential(nn.ConvTranspose2d(3, 4, 3), nn.BatchNorm2d(4))).eval()
    ts, tb = pair(t)
    a = fuse_conv_bn_eval(ts[0], ts[1], transpose=True)
    b = fuse_conv_bn_eval(tb[0], tb[1], transpose=True)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    lin = _randomize(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))).eval()
    ls, lb = pair(lin)
    a, b = fuse_linear_bn_eval(ls[0], ls[1]), fuse_linear_bn_eval(lb[0], lb[1])
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


def _fusable() -> nn.Module:
    torch.manual_seed(0)
    return _randomize(
        nn.Sequential(
            nn.Conv2d(3, 4, 3),
            nn.BatchNorm2d(4),
            nn.ReLU(),  # 0, 1, 2
            nn.Conv2d(4, 4, 1),
            nn.BatchNorm2d(4),  # 3, 4
            nn.BatchNorm2d(4),
            nn.ReLU(),  # 5, 6
            nn.ConvTranspose2d(4, 4, 1),
            nn.BatchNorm2d(4),  # 7, 8
            nn.Flatten(),
            nn.Linear(4 * 5 * 5, 6),
            nn.BatchNorm1d(6),  # 9, 10, 11
        )
    )


_GROUPS = [["0", "1", "2"], ["3", "4"], ["5", "6"], ["7", "8"], ["10", "11"]]
_QAT_GROUPS = [g for g in _GROUPS if g != ["7", "8"]]  # no ConvTranspose+BN in QAT


def test_ao_fuse_modules_for_inference_matches_stock():
    from torch.ao.quantization import fuse_modules

    stock, swapped = pair(_fusable().eval())
    fs = fuse_modules(stock, _GROUPS)  # inplace=False: deepcopies
    fb = fuse_modules(swapped, _GROUPS)
    assert [type(m) for m in fs.modules()] == [type(m) for m in fb.modules()]
    assert fs.state_dict().keys() == fb.state_dict().keys()
    for k, v in fs.state_dict().items():
        assert torch.equal(v, fb.state_dict()[k]), k
    # the user's model is untouched (still converted)
    assert all(bnswap.is_swapped(m) for m in swapped.modules() if isinstance(m, _BatchNorm))
    x = torch.randn(2, 3, 7, 7)
    assert torch.equal(fs(x), fb(x))
    torch.testing.assert_close(fb(x), swapped(x), rtol=1e-4, atol=1e-5)


def test_ao_fuse_modules_qat_matches_stock():
    # Training-mode (QAT) fusion wraps the layer in torch.ao's fused modules, which
    # look the stock classes up by exact type: a swapped layer is one.
    from torch.ao.quantization import fuse_modules_qat

    stock, swapped = pair(_fusable().train())
    fs = fuse_modules_qat(stock, _QAT_GROUPS)
    fb = fuse_modules_qat(swapped, _QAT_GROUPS)
    assert [type(m) for m in fs.modules()] == [type(m) for m in fb.modules()]
    # the fused modules hold the (copied) layers themselves: every one still swapped,
    # and ConvTranspose+BN (not fusable in QAT) is left as is
    bns = [n for n, m in fb.named_modules() if isinstance(m, _BatchNorm)]
    assert "8" in bns and all(bnswap.is_swapped(fb.get_submodule(n)) for n in bns)
    assert state_diff(fs, fb) == []
    x = torch.randn(2, 3, 7, 7)
    assert torch.equal(fs(x), fb(x))
    assert state_diff(fs, fb) == []


# --- torch.fx ---------------------------------------------------------------------------


def test_fx_symbolic_trace_keeps_layers_as_leaves_like_stock():
    stock, swapped = pair(_net())
    gs, gb = torch.fx.symbolic_trace(stock), torch.fx.symbolic_trace(swapped)
    ops = [(n.op, n.target) for n in gs.graph.nodes]
    assert ops == [(n.op, n.target) for n in gb.graph.nodes]
    assert ("call_module", "1") in ops
    assert isinstance(gb.get_submodule("1"), bnswap.BatchNorm2d)
    for train in (True, False, True):
        gs.train(train), gb.train(train)
        x = torch.randn(4, 3, 5, 5)
        assert torch.equal(gs(x), gb(x))
        assert state_diff(gs, gb) == []


def test_fx_symbolic_trace_of_a_bare_layer_fails_as_stock():
    a = outcome(lambda: torch.fx.symbolic_trace(nn.BatchNorm2d(3)))
    b = outcome(lambda: torch.fx.symbolic_trace(bnswap.BatchNorm2d(3)))
    assert a[0] == b[0] == "err" and a[1][0] is b[1][0]


def test_fx_optimization_fuse_fuses_swapped_layers_as_stock():
    """torch.fx.experimental.optimization.fuse matches exact types (``type(m) is
    nn.BatchNorm2d``): a swapped layer keeps its class, so it is fused as stock's is. Which
    pairs stock fuses depends on the release: torch 2.4 fuses Conv-BN but not Linear-BN."""
    from torch.fx.experimental.optimization import fuse

    stock, swapped = pair(_net().eval())
    fs, fb = fuse(copy.deepcopy(stock)), fuse(copy.deepcopy(swapped))
    left = [n for n, m in fs.named_modules() if isinstance(m, _BatchNorm)]
    assert [n for n, m in fb.named_modules() if isinstance(m, _BatchNorm)] == left
    assert len(left) < 3  # stock fused something (both Conv-BN pairs on every release)
    if TORCH >= (2, 9):
        assert left == []
    assert [type(m).__name__ for m in fs.modules()] == [type(m).__name__ for m in fb.modules()]
    x = torch.randn(4, 3, 5, 5)
    assert torch.equal(fb(x), fs(x))
    assert all(bnswap.is_swapped(m) for m in swapped.modules() if isinstance(m, _BatchNorm))


class _BNReLU(nn.BatchNorm2d):
    """A timm-BatchNormAct2d-style subclass: F.batch_norm then an activation in its own
    forward (stock fx traces through it: F.batch_norm takes Proxies)."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        return torch.relu(
            nn.functional.batch_norm(
                x,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                self.training,
                self.momentum,
                self.eps,
            )
        )


def bn_relu(layer, x):
    """_BNReLU's adapter."""
    return torch.relu(bnswap.module_batch_norm(layer, x))


def test_fx_symbolic_trace_through_an_adapter_like_stock():
    """fx traces through a layer whose class is not a torch.nn leaf (timm's
    BatchNormAct2d, an adapted user class): a swapped one records stock's graph
    (F.batch_norm), so fx-based tools see what they see with stock."""
    from bnswap import registry

    saved = dict(registry._ADAPTERS)
    bnswap.register(_BNReLU, bn_relu)
    try:
        torch.manual_seed(0)
        stock = nn.Sequential(nn.Conv2d(3, 4, 3), _BNReLU(4), nn.Conv2d(4, 4, 1))
        swapped = bnswap.convert(copy.deepcopy(stock))
        assert type(swapped[1]) is _BNReLU and bnswap.is_swapped(swapped[1])
        for train in (True, False):  # a traced graph bakes in the mode it was traced in
            stock.train(train), swapped.train(train)
            gs = torch.fx.symbolic_trace(copy.deepcopy(stock))
            gb = torch.fx.symbolic_trace(copy.deepcopy(swapped))
            assert [(n.op, n.target) for n in gs.graph.nodes] == [
                (n.op, n.target) for n in gb.graph.nodes
            ]
            for _ in range(2):
                x = torch.randn(4, 3, 6, 6)
                assert torch.equal(gs(x), gb(x))
                assert state_diff(gs, gb) == []
    finally:
        registry._ADAPTERS.clear()
        registry._ADAPTERS.update(saved)


class _KeywordCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), _BNReLU(4)

    def forward(self, x):
        return self.bn(x=self.conv(x))  # the layer's input passed by keyword


def test_fx_symbolic_trace_through_an_adapter_called_with_a_keyword_input():
    """Guards: the stock-recording check looked at positional arguments only, so a Proxy
    passed by keyword reached bnswap's core (TraceError where stock traces)."""
    from bnswap import registry

    saved = dict(registry._ADAPTERS)
    bnswap.register(_BNReLU, bn_relu)
    try:
        torch.manual_seed(0)
        stock = _KeywordCall()
        swapped = bnswap.convert(copy.deepcopy(stock))
        gs, gb = torch.fx.symbolic_trace(stock), torch.fx.symbolic_trace(swapped)
        assert [(n.op, n.target) for n in gs.graph.nodes] == [
            (n.op, n.target) for n in gb.graph.nodes
        ]
        x = torch.randn(4, 3, 6, 6)
        assert torch.equal(gs(x), gb(x))
    finally:
        registry._ADAPTERS.clear()
        registry._ADAPTERS.update(saved)


@pytest.mark.parametrize("momentum", [0.3, None])
def test_running_stats_under_torch_func_grad_follow_stock(momentum):
    """Inside ``torch.func.grad`` the core runs stock's call (no batching rule for the
    consolidated ops): gradients, running statistics (momentum, cumulative average) and
    the layer's eps as stock's. Guards the arguments of that call."""
    stock = nn.BatchNorm2d(3, momentum=momentum, eps=0.5)
    stock.running_mean.fill_(0.25)
    stock.running_var.fill_(2.0)
    swapped = bnswap.convert(copy.deepcopy(stock))
    x = torch.randn(4, 3, 2, 2)
    grads = []
    for m in (stock, swapped):

        def loss(params, buffers, m=m):  # buffers as inputs: updated in place
            return functional_call(m, {**params, **buffers}, (x,)).square().sum()

        for _ in range(2):
            g = torch.func.grad(loss)(dict(m.named_parameters()), dict(m.named_buffers()))
        grads.append(g)
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
    assert state_diff(stock, swapped) == []
    assert int(swapped.num_batches_tracked) == 2
