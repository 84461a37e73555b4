"""gradcheck / gradgradcheck in float64 of bnswap layers against finite differences.

Train and eval, affine True/False, track_running_stats True/False, every class and
rank (BatchNorm1d on (N, C) and (N, C, L), BatchNorm2d, BatchNorm3d): first and
second derivatives with respect to the input, weight and bias, forward-mode AD, and
the analytic gradients bitwise against stock's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.autograd import gradcheck, gradgradcheck
from torch.func import functional_call

import bnswap

SHAPES = {
    "1d_rank2": (nn.BatchNorm1d, (5, 3)),
    "1d_rank3": (nn.BatchNorm1d, (3, 3, 2)),
    "2d": (nn.BatchNorm2d, (3, 3, 2, 2)),
    "3d": (nn.BatchNorm3d, (2, 3, 2, 2, 1)),
}


def _layer(cls, affine, track, train):
    bn = cls(3, affine=affine, track_running_stats=track, momentum=None).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if affine:
            bn.weight.copy_(torch.rand(3, generator=g, dtype=torch.float64) + 0.5)
            bn.bias.copy_(torch.randn(3, generator=g, dtype=torch.float64))
        if track:
            bn.running_mean.copy_(torch.randn(3, generator=g, dtype=torch.float64))
            bn.running_var.copy_(torch.rand(3, generator=g, dtype=torch.float64) + 0.5)
    return bn.train(train)


def _fn(layer):
    def f(x, *wb):
        if wb:
            return functional_call(layer, {"weight": wb[0], "bias": wb[1]}, (x,))
        return layer(x)

    return f


def _inputs(shape, layer):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1).requires_grad_()
    if layer.affine:
        return (
            x,
            layer.weight.detach().clone().requires_grad_(),
            layer.bias.detach().clone().requires_grad_(),
        )
    return (x,)


@pytest.mark.parametrize("track", [True, False], ids=["track", "notrack"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kind", list(SHAPES))
def test_gradcheck_and_gradgradcheck_float64(kind, train, affine, track):
    cls, shape = SHAPES[kind]
    stock = _layer(cls, affine, track, train)
    layer = bnswap.convert(copy.deepcopy(stock))
    inputs = _inputs(shape, layer)
    f = _fn(layer)
    # batch statistics: the graph really is on the consolidated ops; running statistics:
    # stock's own op (aten::batch_norm, which runs on every device)
    op = f(*inputs).grad_fn.name()
    uses_batch_stats = train or not track
    assert op == (
        "BatchNormWithUpdateBackward0" if uses_batch_stats else _fn(stock)(*inputs).grad_fn.name()
    ), op
    assert op != "BatchNormNoUpdateBackward0"
    assert gradcheck(f, inputs, check_forward_ad=True, check_batched_grad=True)
    assert gradgradcheck(f, inputs)
    # analytic gradients bitwise equal to stock's
    go = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = []
    for fn in (_fn(stock), f):
        ins = tuple(t.detach().clone().requires_grad_() for t in inputs)
        y = fn(*ins)
        grads.append((y, torch.autograd.grad(y, ins, go, create_graph=True)))
    (ys, gs), (yb, gb) = grads
    assert torch.equal(ys, yb)
    for a, b in zip(gs, gb, strict=True):
        assert torch.equal(a, b)
    # second order: bitwise too
    ss = torch.autograd.grad(sum(g.square().sum() for g in gs), gs[0])
    sb = torch.autograd.grad(sum(g.square().sum() for g in gb), gb[0])
    assert torch.equal(ss[0], sb[0])


def test_gradcheck_detects_a_wrong_gradient():
    # gradcheck is a real check here: a function with a wrong backward fails it.
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return bnswap.BatchNorm1d(3).double()(x)

        @staticmethod
        def backward(ctx, g):
            return g  # ignores the normalization

    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert not gradcheck(Wrong.apply, (x,), raise_exception=False)
