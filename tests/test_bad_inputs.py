"""Bad inputs: what each gets from stock nn.BatchNorm and from bnswap (docs/reliability.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._helpers_reliab import outcome, pair, state_diff


@pytest.mark.parametrize(
    "eps,train,track",
    [(0.0, True, True), (-1e-5, True, True), (-1.0, False, True), (0.0, False, False)],
)
def test_non_positive_eps_raises_as_stock(eps, train, track):
    stock, swapped = pair(nn.BatchNorm2d(3, eps=eps, track_running_stats=track).train(train))
    x = torch.randn(2, 3, 4, 4)
    a, b = outcome(lambda: stock(x)), outcome(lambda: swapped(x))
    assert a[0] == "err" and b == a, (a, b)
    assert issubclass(a[1][0], ValueError) and "eps" in a[1][1]
    # stock increments num_batches_tracked before F.batch_norm raises; bnswap raises first
    assert state_diff(stock, swapped) == (["num_batches_tracked"] if train and track else [])


def test_zero_eps_in_eval_runs_as_stock():
    stock, swapped = pair(nn.BatchNorm2d(3, eps=0.0).eval())
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(stock(x), swapped(x))


@pytest.mark.parametrize("train", [True, False])
def test_zero_channels_raise_stock_index_error(train):
    stock, swapped = pair(nn.BatchNorm2d(0).train(train))
    x = torch.randn(2, 0, 3, 3)
    a, b = outcome(lambda: stock(x)), outcome(lambda: swapped(x))
    assert a[0] == "err" and a[1][0] is IndexError and b == a, (a, b)


@pytest.mark.parametrize("n", [2, 0])
@pytest.mark.parametrize("track", [True, False])
@pytest.mark.parametrize("missing", ["running_mean", "running_var", "both"])
@pytest.mark.parametrize("train", [True, False])
def test_statistics_set_to_none_behave_as_stock(train, missing, track, n):
    # A layer whose statistics a user set to None (one or both): stock's
    # _BatchNorm.forward decides on batch statistics only when both are None and
    # ATen raises for one missing; bnswap follows it case by case.
    layer = nn.BatchNorm2d(3, track_running_stats=track)
    if not track:
        layer.running_mean, layer.running_var = torch.rand(3), torch.rand(3) + 0.5
    for name in (["running_mean", "running_var"] if missing == "both" else [missing]):
        setattr(layer, name, None)
    stock, swapped = pair(layer.train(train))
    x = torch.randn(n, 3, 4, 4)
    a, b = outcome(lambda: stock(x)), outcome(lambda: swapped(x))
    assert a[0] == b[0], (a, b)
    if a[0] == "err":
        assert a[1] == b[1]
        nbt_moved = train and track
        assert state_diff(stock, swapped) == (["num_batches_tracked"] if nbt_moved else [])
    else:
        assert torch.equal(a[1], b[1])
        assert state_diff(stock, swapped) == []
