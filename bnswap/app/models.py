"""Small image classifiers built from stock ``torch.nn`` layers (``nn.BatchNorm2d``).

They are plain ``nn.Module``s with stock BatchNorm, so the same network can be trained
as is (stock) or after :func:`bnswap.convert` (or with the ``bnswap.BNSwap`` Lightning
callback) and the two runs compared.

* :class:`MobileNetV2`: inverted residual blocks (expand 1x1 conv + BN + ReLU6,
  depthwise 3x3 conv + BN + ReLU6, project 1x1 conv + BN, residual when shapes allow),
  the architecture whose convergence problems motivated PyTorch's batch-norm
  consolidation. Small-input ("CIFAR-style") strides by default.
* :class:`ConvNet4`: four conv3x3 + BN + ReLU blocks (32 / 64 / 64 / 128 channels).
* :class:`ResNet18`: BasicBlock ResNet-18 with a small-input stem.

All take input (N, C_in, H, W) float32 and return logits (N, num_classes) float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

__all__ = ["MODELS", "ConvNet4", "InvertedResidual", "MobileNetV2", "ResNet18", "build_model"]


def _make_divisible(v: float, divisor: int = 8) -> int:
    """Round a channel count to a multiple of ``divisor`` (torchvision's rule)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def _conv_bn_act(
    cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    if act:
        layers.append(nn.ReLU6(inplace=True))
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """MobileNetV2 block: [1x1 expand + BN + ReLU6] -> 3x3 depthwise + BN + ReLU6 ->
    1x1 project + BN, with an identity shortcut when stride is 1 and channels match.

    Shape: (N, cin, H, W) -> (N, cout, H / stride, W / stride).
    """

    def __init__(self, cin: int, cout: int, stride: int, expand_ratio: int):
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2, got {stride}")
        hidden = round(cin * expand_ratio)
        self.use_res = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(_conv_bn_act(cin, hidden, 1))
        layers += [
            _conv_bn_act(hidden, hidden, 3, stride, groups=hidden),
            _conv_bn_act(hidden, cout, 1, act=False),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.conv(x)
        return x + out if self.use_res else out


# (expand ratio t, channels c, repeats n, stride s); strides for small inputs
# (32x32: the ImageNet net's first two stride-2 stages run at stride 1).
MOBILENETV2_SETTING: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class MobileNetV2(nn.Module):
    """MobileNetV2 (Sandler et al. 2018) for small images.

    Args:
        num_classes: number of logits.
        in_channels: input channels (1 for the digits data).
        width_mult: channel multiplier (1.0 is the paper's net, 2.2 M parameters at
            1000 classes; 0.5 is a quarter of the compute).
        last_channel: channels of the final 1x1 conv before pooling (1280 in the paper;
            scaled by ``width_mult`` when that is above 1).
        setting: the (t, c, n, s) stage table; default :data:`MOBILENETV2_SETTING`.
        stem_stride: stride of the first 3x3 conv (1 for 32x32 inputs, 2 for ImageNet).
        dropout: dropout before the classifier (0 keeps runs deterministic under
            checkpoint resume, which does not restore RNG state).

    Shape: (N, in_channels, H, W) -> (N, num_classes).
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        width_mult: float = 1.0,
        last_channel: int = 1280,
        setting: Sequence[Sequence[int]] = MOBILENETV2_SETTING,
        stem_stride: int = 1,
        dropout: float = 0.0,
    ):
        super().__init__()
        cin = _make_divisible(32 * width_mult)
        last = _make_divisible(last_channel * max(1.0, width_mult))
        features: list[nn.Module] = [_conv_bn_act(in_channels, cin, 3, stem_stride)]
        for t, c, n, s in setting:
            cout = _make_divisible(c * width_mult)
            for i in range(n):
                features.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        features.append(_conv_bn_act(cin, last, 1))
        self.features = nn.Sequential(*features)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.classifier(self.pool(self.features(x)).flatten(1))
        return logits


class ConvNet4(nn.Module):
    """Four conv3x3 + BatchNorm2d + ReLU blocks (32, 64, 64, 128 channels), 2x2 max-pool
    after the second and fourth, global average pool, linear head.

    Shape: (N, in_channels, H, W) -> (N, num_classes); H, W >= 4.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        channels: Sequence[int] = (32, 64, 64, 128),
    ):
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for i, c in enumerate(channels):
            layers += [
                nn.Conv2d(cin, c, 3, padding=1, bias=False),
                nn.BatchNorm2d(c),
                nn.ReLU(inplace=True),
            ]
            if i % 2 == 1:
                layers.append(nn.MaxPool2d(2))
            cin = c
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.head(self.features(x).mean((2, 3)))
        return logits


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        y: Tensor = self.relu(out + self.shortcut(x))
        return y


class ResNet18(nn.Module):
    """ResNet-18 (BasicBlock, [2, 2, 2, 2], 64-512 channels) with a 3x3 stride-1 stem for
    small inputs (no max-pool).

    Shape: (N, in_channels, H, W) -> (N, num_classes).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        stages: list[nn.Module] = []
        cin = width
        for i, mult in enumerate((1, 2, 4, 8)):
            cout = width * mult
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)))
            cin = cout
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.fc(self.layers(self.stem(x)).mean((2, 3)))
        return logits


MODELS: dict[str, type[nn.Module]] = {
    "mobilenetv2": MobileNetV2,
    "convnet4": ConvNet4,
    "resnet18": ResNet18,
}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Instantiate a model of :data:`MODELS` by name (``"mobilenetv2"``, ``"convnet4"``,
    ``"resnet18"``) with keyword arguments for its constructor.

    Raises:
        ValueError: unknown name.
    """
    try:
        cls = MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None
    return cls(**kwargs)
