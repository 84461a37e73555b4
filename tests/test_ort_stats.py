"""The ORT backend's shape pass (``bnswap.ort._stats.RunningStats.reduction_sizes``), on
its own: it needs no ONNX Runtime, only torch.

``n = N * prod(spatial)`` of each layer's input is what turns ORT's biased batch variance
into PyTorch's unbiased one, so a wrong ``n`` is a silently wrong running_var. The pass
runs the model on the meta device (no compute, no state touched) and falls back to a real
no-grad pass, buffers restored, for a model the meta device cannot run. The end-to-end
statistics under a real ORTModule are in ``tests/test_ort.py``.
"""

from __future__ import annotations

import copy
import logging
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import bnswap
from bnswap.ort._stats import RunningStats, tracked_layers
from bnswap.ort.errors import LayerRunsTwiceError


class Net(nn.Module):
    """Four layers of the four ranks, one that only runs with ``extra=True``, and inputs
    concatenated from every positional argument."""

    def __init__(self, momentum: float | None = 0.1):
        super().__init__()
        self.flat = nn.BatchNorm1d(3, momentum=momentum)  # (N, C)
        self.seq = nn.BatchNorm1d(3, momentum=momentum)  # (N, C, L)
        self.img = nn.BatchNorm2d(3, momentum=momentum)  # (N, C, H, W)
        self.vol = nn.BatchNorm3d(3, momentum=momentum)  # (N, C, D, H, W)
        self.extra_bn = nn.BatchNorm2d(3, momentum=momentum)
        self.stem = nn.Conv2d(3, 3, 1)  # a parameter that must be on meta too

    def forward(self, *xs: torch.Tensor, extra: bool = False, crop: int = 0, cfg=None):
        x = self.stem(torch.cat(xs))
        crop = cfg.crop if cfg is not None else crop
        if crop:
            x = x[..., crop:, crop:]
        y = self.img(x)
        s = self.seq(y.flatten(2))
        f = self.flat(s.mean(2))
        v = self.vol(y.unsqueeze(2).expand(-1, -1, 2, -1, -1))
        out = f.sum() + v.sum()
        if extra:
            out = out + self.extra_bn(x).sum()
        return out


class NeedsRealValues(Net):
    """A forward the meta device cannot run (it reads a value)."""

    def forward(self, *xs, **kw):
        if float(torch.cat(xs).abs().sum()) < 0:  # .item() of a meta tensor raises
            raise AssertionError
        return super().forward(*xs, **kw)


def _stats(model: nn.Module) -> tuple[RunningStats, list]:
    model = bnswap.convert(model)
    return RunningStats(model), tracked_layers(list(model.named_modules()))


def _devices_seen(model: nn.Module) -> list[str]:
    seen: list[str] = []
    model.img.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].device.type))
    return seen


@pytest.mark.parametrize("momentum, training", [(0.1, True), (None, True), (0.1, False)])
def test_sizes_per_rank_from_a_meta_pass(momentum, training, caplog):
    """Guards n for every rank (N for (N, C); N * L; N * H * W; N * D * H * W), None for a
    layer the forward does not run, and that the pass ran on meta only: no real
    compute, no fallback (momentum=None reads the real num_batches_tracked; eval mode
    reads the running statistics, on meta too)."""
    stats, layers = _stats(Net(momentum).train(training))
    seen = _devices_seen(stats.root)
    before = copy.deepcopy(stats.root.state_dict())
    caplog.set_level(logging.DEBUG, logger="bnswap.ort")
    x = torch.randn(4, 3, 5, 6)
    assert [n for n, _ in layers] == ["flat", "seq", "img", "vol", "extra_bn"]
    assert stats.reduction_sizes((x,), {}, layers) == [4, 4 * 30, 4 * 30, 4 * 2 * 30, None]
    assert seen == ["meta"]
    assert "meta shape pass failed" not in caplog.text
    after = stats.root.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sizes_are_cached_per_signature_of_shapes_structure_and_values():
    """Guards the cache key: the same shapes reuse the sizes (no new pass); another
    shape, another structure of the same tensors (positional vs keyword), or another
    non-tensor value that changes what a layer sees each get their own sizes."""
    stats, layers = _stats(Net())
    seen = _devices_seen(stats.root)
    x, y = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    assert stats.reduction_sizes((x,), {}, layers)[2] == 2 * 16
    assert stats.reduction_sizes((torch.randn(2, 3, 4, 4),), {}, layers)[2] == 2 * 16
    assert len(seen) == 1  # cached
    assert stats.reduction_sizes((x, y), {}, layers)[2] == 4 * 16  # (x, y): two leaves
    assert stats.reduction_sizes((x,), {"extra": True}, layers)[4] == 2 * 16
    assert stats.reduction_sizes((x,), {"crop": 1}, layers)[2] == 2 * 9
    assert stats.reduction_sizes((x,), {"crop": 2}, layers)[2] == 2 * 4
    assert stats.reduction_sizes((torch.randn(3, 3, 4, 4),), {}, layers)[2] == 3 * 16
    assert len(seen) == 6


def test_structure_alone_keys_the_cache():
    """The same two tensors, once both positional and once one of them as a keyword
    argument the forward ignores: same leaves, another structure, other sizes."""
    x, y = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)

    class Kw(Net):
        def forward(self, *xs, ignored=None, **kw):
            return super().forward(*xs, **kw)

    stats, layers = _stats(Kw())
    assert stats.reduction_sizes((x, y), {}, layers)[2] == 4 * 16
    assert stats.reduction_sizes((x,), {"ignored": y}, layers)[2] == 2 * 16


def test_the_cache_is_bounded():
    stats, layers = _stats(Net())
    peak = 0
    for n in range(2, 100):
        stats.reduction_sizes((torch.randn(n, 3, 2, 2),), {}, layers)
        peak = max(peak, len(stats._shapes))
    assert peak == 65


def test_a_model_the_meta_device_cannot_run_gets_a_real_pass_with_state_restored(caplog):
    """Guards the fallback: sizes right, keyword arguments passed, every buffer (running
    statistics, num_batches_tracked) bitwise as before, and the reason logged."""
    stats, layers = _stats(NeedsRealValues())
    seen = _devices_seen(stats.root)
    before = copy.deepcopy(stats.root.state_dict())
    caplog.set_level(logging.DEBUG, logger="bnswap.ort")
    x = torch.randn(4, 3, 5, 6)
    sizes = stats.reduction_sizes((x,), {"extra": True, "crop": 1}, layers)
    assert sizes == [4, 4 * 20, 4 * 20, 4 * 2 * 20, 4 * 20]
    assert seen == ["cpu"]  # the meta pass failed before the layer ran
    assert re.fullmatch(
        r"bnswap\.ort: meta shape pass failed \(.*meta tensors.*\); using a "
        r"real pass",
        caplog.records[-1].getMessage(),
    )
    after = stats.root.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_layer_run_twice_is_refused_by_name():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            return self.bn(self.bn(x))

    stats, layers = _stats(Twice())
    with pytest.raises(LayerRunsTwiceError) as err:
        stats.reduction_sizes((torch.randn(2, 3, 4, 4),), {}, layers)
    assert str(err.value) == (
        "bnswap.ort: BatchNorm layer 'bn' runs 2 times in one forward; ONNX Runtime "
        "updates its running statistics once per call site into the same buffers, which "
        "cannot reproduce PyTorch's sequential updates. Use one layer per call site, or "
        "backend='aten'."
    )


def test_empty_inputs_per_layer():
    """Guards which layers get an empty input (the ORT wrapper exports again when this
    changes: a graph traced with an empty input has no batch norm for the layer)."""
    stats, layers = _stats(Net())
    x = torch.randn(2, 3, 4, 4)
    assert stats.empty_inputs((x,), {}, layers) == (False,) * 5
    assert stats.empty_inputs((x[:0],), {"extra": True}, layers) == (True,) * 5
    # (2, 3, 0, 0) images: the (N, C) layer after the spatial mean sees values
    assert stats.empty_inputs((x,), {"crop": 4}, layers) == (False, True, True, True, False)


def test_a_layer_that_does_not_run_keeps_its_place():
    """None for a layer the forward skips, wherever it stands in the list: the sizes line
    up with the layers after it (each gets its own n)."""

    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = nn.BatchNorm2d(3)
            self.a = nn.BatchNorm2d(3)
            self.b = nn.BatchNorm1d(3)

        def forward(self, x):
            return self.b(self.a(x).mean((2, 3)))

    stats, layers = _stats(Skips())
    assert stats.reduction_sizes((torch.randn(4, 3, 2, 5),), {}, layers) == [None, 40, 4]


def test_an_argument_object_keys_the_cache_by_identity():
    """A non-tensor argument that is neither a scalar nor a string (an object, possibly
    unhashable) keys the cache by identity: another object, other sizes."""
    stats, layers = _stats(Net())
    x = torch.randn(2, 3, 4, 4)
    one, two = SimpleNamespace(crop=1), SimpleNamespace(crop=2)
    assert stats.reduction_sizes((x,), {"cfg": one}, layers)[2] == 2 * 9
    assert stats.reduction_sizes((x,), {"cfg": two}, layers)[2] == 2 * 4
    assert stats.reduction_sizes((x,), {"cfg": one}, layers)[2] == 2 * 9
