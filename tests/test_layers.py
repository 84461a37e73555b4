"""Parity of bnswap layers with stock nn.BatchNorm (the core issue's given cases + matrix)."""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys

import pytest
import torch
from torch import nn

import bnswap
from tests._helpers import assert_state_equal, pair, step

SHAPES = {
    nn.BatchNorm1d: [(8, 3), (4, 3, 5)],
    nn.BatchNorm2d: [(4, 3, 5, 5)],
    nn.BatchNorm3d: [(2, 3, 2, 3, 2)],
}
CASES = [(cls, shape) for cls, shapes in SHAPES.items() for shape in shapes]


# --- given cases -----------------------------------------------------------------------


def test_case1_blocks_of_constants_one_step():
    x = torch.cat([torch.full((4, 2, 3, 3), float(v)) for v in (1, 2, 3, 4)])
    bn = bnswap.convert(nn.BatchNorm2d(2, momentum=0.1))
    assert isinstance(bn, bnswap.BatchNorm2d)
    y = bn(x)
    torch.testing.assert_close(bn.running_mean, torch.full((2,), 0.25))
    torch.testing.assert_close(bn.running_var, torch.full((2,), 0.9 + 0.1 * 1.25 * 144 / 143))
    torch.testing.assert_close(bn.running_var, torch.full((2,), 1.025874), rtol=0, atol=1e-6)
    assert bn.num_batches_tracked.item() == 1
    expect = (x.double() - 2.5) / (1.25 + bn.eps) ** 0.5  # biased variance in the output
    torch.testing.assert_close(y.double(), expect, rtol=1e-6, atol=1e-6)


def test_case2_momentum_none_cumulative_average():
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(8, 2, generator=g) * (i + 1) + i for i in range(3)]
    stock, swapped = pair(nn.BatchNorm1d(2, momentum=None))
    for b in batches:
        step(stock, swapped, b)
    means = torch.stack([b.double().mean(0) for b in batches]).mean(0)
    vars_ = torch.stack([b.double().var(0, unbiased=True) for b in batches]).mean(0)
    torch.testing.assert_close(swapped.running_mean.double(), means, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(swapped.running_var.double(), vars_, rtol=1e-6, atol=1e-7)
    assert swapped.num_batches_tracked.item() == 3
    assert_state_equal(stock, swapped)  # and bitwise equal to stock in eager


_CASE3 = """
import torch, bnswap
from torch import nn
bn = bnswap.convert(nn.BatchNorm1d(120, track_running_stats=False)).eval()
try:
    bn(torch.randn(1, 120))
except ValueError as e:
    assert "more than 1 value per channel" in str(e), e
    print("raised")
"""


def test_case3_no_tracking_eval_batch_of_one_raises_without_crash():
    r = subprocess.run([sys.executable, "-c", _CASE3], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "raised"
    stock, swapped = pair(nn.BatchNorm1d(120, track_running_stats=False))
    stock.eval(), swapped.eval()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        stock(torch.randn(1, 120))
    x = torch.randn(2, 120)
    y1, y2, g1, g2 = step(stock, swapped, x)
    assert torch.equal(y1, y2) and torch.equal(g1, g2)


class BatchNormReLU(nn.BatchNorm2d):
    def forward(self, x):
        return torch.relu(super().forward(x))


def test_case4_subclass_with_own_forward_is_left_in_place():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormReLU(4), nn.BatchNorm2d(4))
    ref = copy.deepcopy(model)
    p = bnswap.plan(model)
    row = next(r for r in p if r.name == "1")
    assert row.action == "skip" and "overrides forward" in row.reason
    assert "187298" in row.reason and "bnswap.register" in row.reason
    bnswap.convert(model)
    assert type(model[1]) is BatchNormReLU and not bnswap.is_swapped(model[1])
    assert isinstance(model[2], bnswap.BatchNorm2d)
    x = torch.randn(4, 3, 8, 8)
    y1, y2 = ref(x), model(x)
    assert torch.equal(y1, y2)
    assert (model[:2](x) >= 0).all()  # the subclass still applies its ReLU


def test_case5_half_channels_last_with_float_params():
    """Half input in channels_last, float32 parameters: against stock on the same
    input, bitwise (the reference used to be a copy of the converted layer)."""
    stock, bn = pair(nn.BatchNorm2d(3))
    x = torch.randn(4, 3, 16, 16).half().to(memory_format=torch.channels_last)
    y_stock, y, gx_stock, gx = step(stock, bn, x)
    assert y.dtype == torch.float16 and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, y_stock) and torch.equal(gx, gx_stock)
    assert_state_equal(stock, bn)  # statistics and parameter gradients
    assert bn.weight.dtype == torch.float32
    assert torch.isfinite(bn.weight.grad).all() and torch.isfinite(gx).all()


# --- the matrix: bitwise equal to stock on CPU ------------------------------------------


@pytest.mark.parametrize("cls,shape", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("affine,track", list(itertools.product([True, False], repeat=2)))
@pytest.mark.parametrize("momentum", [0.1, None, 0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matrix_bitwise(cls, shape, affine, track, momentum, dtype):
    stock, swapped = pair(
        cls(shape[1], affine=affine, track_running_stats=track, momentum=momentum, dtype=dtype)
    )
    g = torch.Generator().manual_seed(3)
    for training in (True, True, False, True, False):
        stock.train(training), swapped.train(training)
        x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
        y1, y2, gx1, gx2 = step(stock, swapped, x)
        assert torch.equal(y1, y2)
        assert torch.equal(gx1, gx2)
        assert y2.dtype == dtype
    assert_state_equal(stock, swapped)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["contiguous", "channels_last"])
def test_half_inputs_float_params_match_stock(dtype, fmt):
    stock, swapped = pair(nn.BatchNorm2d(5))
    g = torch.Generator().manual_seed(4)
    for training in (True, False, True):
        stock.train(training), swapped.train(training)
        x = torch.randn(4, 5, 6, 6, generator=g).to(dtype)
        if fmt == "channels_last":
            x = x.to(memory_format=torch.channels_last)
        y1, y2, gx1, gx2 = step(stock, swapped, x)
        assert y2.dtype == dtype
        assert y2.is_contiguous(memory_format=torch.channels_last) == (fmt == "channels_last")
        torch.testing.assert_close(y2, y1, rtol=0, atol=0)
        torch.testing.assert_close(gx2, gx1, rtol=0, atol=0)
    assert_state_equal(stock, swapped)


def test_channels_last_3d():
    stock, swapped = pair(nn.BatchNorm3d(3))
    x = torch.randn(2, 3, 4, 4, 4).to(memory_format=torch.channels_last_3d)
    y1, y2, gx1, gx2 = step(stock, swapped, x)
    assert y2.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2)
    assert_state_equal(stock, swapped)


def test_autocast_bf16_matches_stock():
    net = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU())
    stock, swapped = pair(net)
    x = torch.randn(4, 3, 10, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2, gx1, gx2 = step(stock, swapped, x)
    assert y1.dtype == y2.dtype
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2)
    assert_state_equal(stock, swapped)


def test_track_running_stats_flipped_at_run_time():
    stock, swapped = pair(nn.BatchNorm2d(3))
    g = torch.Generator().manual_seed(5)
    for track, training in [
        (True, True),
        (False, True),
        (False, False),
        (True, False),
        (True, True),
    ]:
        for m in (stock, swapped):
            m.track_running_stats = track
            m.train(training)
        y1, y2, gx1, gx2 = step(stock, swapped, torch.randn(4, 3, 3, 3, generator=g))
        assert torch.equal(y1, y2) and torch.equal(gx1, gx2)
        assert_state_equal(stock, swapped)
    assert swapped.num_batches_tracked.item() == 2


def test_eval_uses_running_stats_and_does_not_update():
    bn = bnswap.convert(nn.BatchNorm2d(3))
    bn.running_mean.fill_(1.0)
    bn.running_var.fill_(4.0)
    bn.eval()
    x = torch.randn(2, 3, 4, 4)
    y = bn(x)
    torch.testing.assert_close(y, (x - 1.0) / (4.0 + bn.eps) ** 0.5)
    assert bn.num_batches_tracked.item() == 0
    assert torch.equal(bn.running_mean, torch.ones(3))


# --- errors: stock's types and messages, raised before any state changes ------------------


def _errors(fn):
    try:
        fn()
    except Exception as e:
        return type(e), str(e)
    return None


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 3, 3), (2, 3, 2)])
@pytest.mark.parametrize("kw", [{}, {"track_running_stats": False}, {"affine": False}])
@pytest.mark.parametrize("training", [True, False])
def test_errors_match_stock(shape, kw, training):
    stock, swapped = pair(nn.BatchNorm2d(3, **kw))
    stock.train(training), swapped.train(training)
    x = torch.randn(shape)
    e1, e2 = _errors(lambda: stock(x)), _errors(lambda: swapped(x))
    assert e1 == e2
    if e1 is None:  # neither raised (no channel to check against): the same answer
        assert torch.equal(stock(x), swapped(x))
        assert_state_equal(stock, swapped)
    else:  # both raised; the statistics are untouched on both sides (the counter may
        # differ: stock counts the batch before some errors, docs/reliability.md dev. 1)
        for name in ("running_mean", "running_var"):
            a, b = getattr(stock, name), getattr(swapped, name)
            assert (a is None and b is None) or torch.equal(a, b)


def test_one_value_per_channel_raises_before_touching_statistics():
    bn = bnswap.convert(nn.BatchNorm2d(3))
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        bn(torch.randn(1, 3, 1, 1))
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k  # stock would have incremented num_batches_tracked
    assert not torch.isnan(bn.running_var).any()


def test_wrong_channels_leave_state_untouched():
    bn = bnswap.convert(nn.BatchNorm2d(3))
    with pytest.raises(RuntimeError, match="running_mean should contain 4 elements not 3"):
        bn(torch.randn(2, 4, 3, 3))
    assert bn.num_batches_tracked.item() == 0


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_an_empty_batch_gives_stocks_output_and_gradients(channels, affine, training):
    """aten::batch_norm's early return for an empty batch, ``input.clone() * weight[0] +
    bias[0]``: stock's output (shape, dtype) and zero, not missing, gradients for weight
    and bias; statistics untouched, the batch counted in training. Guards the core's copy
    of that return (C = 1 included)."""
    stock, swapped = pair(nn.BatchNorm2d(channels, affine=affine).train(training))
    y1, y2, gx1, gx2 = step(stock, swapped, torch.randn(0, channels, 3, 3))
    assert y1.shape == y2.shape == (0, channels, 3, 3) and y1.dtype == y2.dtype
    assert torch.equal(gx1, gx2)
    if affine:
        assert torch.equal(swapped.weight.grad, torch.zeros(channels))
    assert_state_equal(stock, swapped)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_input_into_an_affine_false_float_layer_matches_stock(dtype):
    """Half input, float32 running statistics, no affine parameters: the constants take
    the statistics' dtype, so the CPU kernel runs stock's mixed-dtype path."""
    stock, swapped = pair(nn.BatchNorm2d(5, affine=False))
    g = torch.Generator().manual_seed(5)
    for training in (True, False, True):
        stock.train(training), swapped.train(training)
        x = torch.randn(4, 5, 3, 3, generator=g).to(dtype)
        y1, y2, gx1, gx2 = step(stock, swapped, x)
        assert y2.dtype == dtype and torch.equal(y1, y2) and torch.equal(gx1, gx2)
    assert_state_equal(stock, swapped)


@pytest.mark.parametrize("training", [True, False])
def test_a_layer_with_a_weight_and_no_bias_matches_stock(training):
    """A layer whose bias was set to None (weight kept): stock's output, gradients and
    statistics (the core passes zeros for the missing bias)."""
    ref = nn.BatchNorm2d(4)
    ref.bias = None
    stock, swapped = pair(ref.train(training))
    y1, y2, gx1, gx2 = step(stock, swapped, torch.randn(3, 4, 2, 2))
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2)
    assert_state_equal(stock, swapped)
