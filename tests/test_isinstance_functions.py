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
from tests._helpers_reliab import outcome, pair, same_tensor, state_diff


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
    return _randomize(nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, momentum=None),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 5), nn.BatchNorm1d(5),
    ))


def _bn_classes(model: nn.Module) -> list[type]:
    return [type(m) for m in model.modules() if isinstance(m, _BatchNorm)]


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
    return _randomize(nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),          # 0, 1, 2
        nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4),                     # 3, 4
        nn.BatchNorm2d(4), nn.ReLU(),                              # 5, 6
        nn.ConvTranspose2d(4, 4, 1), nn.BatchNorm2d(4),            # 7, 8
        nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6),  # 9, 10, 11
    ))


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
    assert all(issubclass(c, bnswap.BNSwapLayer) for c in _bn_classes(swapped))
    x = torch.randn(2, 3, 7, 7)
    assert torch.equal(fs(x), fb(x))
    torch.testing.assert_close(fb(x), swapped(x), rtol=1e-4, atol=1e-5)


def test_ao_fuse_modules_qat_matches_stock():
    # Training-mode (QAT) fusion wraps the layer in torch.ao's fused modules, which
    # accept only the stock classes: they hold a stock-class view of the bnswap layer
    # (the same Parameter and buffer objects).
    from torch.ao.quantization import fuse_modules_qat

    stock, swapped = pair(_fusable().train())
    fs = fuse_modules_qat(stock, _QAT_GROUPS)
    fb = fuse_modules_qat(swapped, _QAT_GROUPS)
    unfused = swapped[8]  # ConvTranspose+BN: not fusable in QAT, left as is
    assert [type(m) for m in fs.modules()] == [
        nn.BatchNorm2d if type(m) is type(unfused) else type(m) for m in fb.modules()
    ]
    assert sum(isinstance(m, bnswap.BNSwapLayer) for m in fb.modules()) == 1
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


def test_fx_optimization_fuse_leaves_bnswap_layers_unfused():
    # torch.fx.experimental.optimization.fuse matches exact types: it fuses stock
    # conv-BN pairs but leaves bnswap layers in place (documented); the answer is the
    # unfused model's, equal to stock's fused answer up to rounding.
    from torch.fx.experimental.optimization import fuse

    stock, swapped = pair(_net().eval())
    fs, fb = fuse(copy.deepcopy(stock)), fuse(copy.deepcopy(swapped))
    assert not any(isinstance(m, _BatchNorm) for m in fs.modules())
    assert sum(isinstance(m, bnswap.BNSwapLayer) for m in fb.modules()) == 3
    x = torch.randn(4, 3, 5, 5)
    assert torch.equal(fb(x), stock(x))
    torch.testing.assert_close(fb(x), fs(x), rtol=1e-4, atol=1e-5)
    assert same_tensor(fb(x), swapped(x))
