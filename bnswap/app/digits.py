"""scikit-learn's bundled handwritten digits as tensors (no Lightning needed).

1,797 real 8x8 grey-level images of the digits 0-9 (the UCI "Optical Recognition of
Handwritten Digits" test set, shipped inside scikit-learn: loads offline).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = ["digits_split", "load_digits_tensors"]


def load_digits_tensors(image_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as ``(images, labels)``.

    Returns:
        images: (1797, 1, image_size, image_size) float32 in [0, 1] (bilinear upsampling
            of the 8x8 originals, which hold 0..16); labels: (1797,) int64 in 0..9.

    Raises:
        ValueError: ``image_size`` < 8.
    """
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    if image_size < 8:
        raise ValueError(f"image_size must be >= 8 (the originals are 8x8), got {image_size}")
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    y = torch.tensor(d.target, dtype=torch.int64)
    return x.contiguous(), y


def digits_split(
    image_size: int = 16, val_fraction: float = 0.2, seed: int = 0
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The fixed train / validation split used by the main job.

    A permutation drawn from ``torch.Generator().manual_seed(seed)`` puts the first
    ``round(1797 * val_fraction)`` images in validation; both parts are standardized
    with the training part's mean and std.

    Returns:
        ``((x_train, y_train), (x_val, y_val))``: x (N, 1, image_size, image_size)
        float32, y (N,) int64.

    Raises:
        ValueError: ``val_fraction`` not in (0, 1); ``image_size`` < 8.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    x, y = load_digits_tensors(image_size)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = round(len(y) * val_fraction)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = (x - mean) / std
    return (x[train_idx], y[train_idx]), (x[val_idx], y[val_idx])
