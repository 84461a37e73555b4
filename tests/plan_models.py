"""Models for tests/test_plan_cli.py, importable by path (``bnswap plan --model ...``)."""

from __future__ import annotations

from torch import nn


class BatchNormTimesTwo(nn.BatchNorm2d):
    """A BatchNorm subclass with its own forward and no registered adapter."""

    def forward(self, x):
        return super().forward(x) * 2


def mixed_net(width: int = 4) -> nn.Module:
    """A layer with an instance forward and a custom-forward subclass (both skipped)
    beside plain layers."""
    hooked = nn.BatchNorm2d(width)
    hooked.forward = hooked.forward  # set on the instance (as a library's hook does)
    return nn.Sequential(
        nn.Conv2d(3, width, 3),
        nn.BatchNorm2d(width),
        hooked,
        BatchNormTimesTwo(width),
        nn.Flatten(),
        nn.LazyLinear(5),
        nn.BatchNorm1d(5),
    )


def plain_net(width: int = 4) -> nn.Module:
    """Every BatchNorm layer swappable."""
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.ReLU())


def unannotated_net(width=4):
    """No return annotation: bnswap plan calls it and checks the result."""
    return plain_net(width)


def failing_net(width: int = 4) -> nn.Module:
    """A model function that raises while building the model."""
    raise RuntimeError(f"kaboom (width {width})")


def not_a_model():
    """Returns no module."""
    return 3


def lazy_net(width: int = 4) -> nn.Module:
    """An uninitialized LazyBatchNorm1d: aten swaps it; ORT cannot export it yet."""
    return nn.Sequential(nn.Linear(3, width), nn.LazyBatchNorm1d())


def two_kinds() -> nn.Module:
    """Two swappable layers (names 0 and 1), for include patterns."""
    return nn.Sequential(nn.BatchNorm2d(2), nn.BatchNorm1d(2))
