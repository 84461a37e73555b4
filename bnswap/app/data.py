"""scikit-learn's bundled handwritten digits as a Lightning DataModule.

1,797 real 8x8 grey-level images of the digits 0-9 (UCI "Optical Recognition of
Handwritten Digits", shipped inside scikit-learn, so it loads offline), scaled to
[0, 1], standardized with the training split's mean and std, upsampled (bilinear) to
``image_size`` and split into a fixed train / validation partition by ``seed``.

The training order is a function of ``(seed, epoch)`` only, and the DataModule's
``state_dict`` records how many batches of the current epoch the Trainer has
processed, so a run resumed from a mid-epoch checkpoint sees exactly the batches the
uninterrupted run would have seen (bitwise-equal resumes; see ``tests/test_lightning.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from bnswap.app.digits import digits_split, load_digits_tensors

__all__ = ["DigitsDataModule", "EpochShuffleSampler", "digits_split", "load_digits_tensors"]


class EpochShuffleSampler(Sampler[int]):
    """Shuffles ``range(n)`` with a generator seeded by ``seed + epoch``.

    Lightning calls :meth:`set_epoch` at the start of each epoch. After
    :meth:`skip_in_epoch` ``(epoch, k)``, iterations of that epoch start at sample
    ``k``: a resumed run continues where the checkpoint left off.
    """

    def __init__(self, n: int, seed: int = 0):
        self.n = n
        self.seed = seed
        self.epoch = 0
        self._skip: tuple[int, int] | None = None  # (epoch, samples to skip)

    def set_epoch(self, epoch: int) -> None:
        if self._skip is not None and self._skip[0] != epoch:
            self._skip = None  # the resumed epoch is over
        self.epoch = epoch

    def skip_in_epoch(self, epoch: int, samples: int) -> None:
        self._skip = (epoch, samples) if samples > 0 else None

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        if self._skip is not None and self._skip[0] == self.epoch:
            order = order[self._skip[1] :]
        return iter(order)

    def __len__(self) -> int:
        return self.n


class DigitsDataModule(pl.LightningDataModule):
    """The digits data, fixed split, deterministic order.

    Args:
        batch_size: training batch size (the last partial batch is dropped, so every
            training batch has exactly this many images).
        val_batch_size: validation batch size.
        image_size: side of the square images fed to the model (8x8 originals are
            upsampled bilinearly); 16 by default.
        val_fraction: share of the 1,797 images held out for validation.
        seed: fixes the split and the per-epoch training order.
        num_workers: DataLoader workers (0: load in the main process; the data set is
            a few MB of tensors).

    Batches are ``(x, y)``: x (B, 1, image_size, image_size) float32, standardized with
    the training split's mean / std; y (B,) int64.

    Raises:
        ValueError: val_fraction outside (0, 1); batch_size, val_batch_size or image_size
            below 1; num_workers below 0 (raised here, before any training starts).
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_batch_size: int = 256,
        image_size: int = 16,
        val_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        for name, value in (
            ("batch_size", batch_size),
            ("val_batch_size", val_batch_size),
            ("image_size", image_size),
        ):
            if value < 1:  # torch's DataLoader / interpolate would refuse it mid-fit
                raise ValueError(f"{name} should be a positive integer value, got {value}")
        if num_workers < 0:
            raise ValueError(f"num_workers should be a non-negative integer, got {num_workers}")
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.image_size = image_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self._resume: dict[str, int] | None = None
        self._sampler: EpochShuffleSampler | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        (xt, yt), (xv, yv) = digits_split(self.image_size, self.val_fraction, self.seed)
        self.train_set = TensorDataset(xt, yt)
        self.val_set = TensorDataset(xv, yv)

    def train_dataloader(self) -> DataLoader[Any]:
        assert self.train_set is not None, "call setup() first"
        self._sampler = EpochShuffleSampler(len(self.train_set), self.seed)
        if self._resume is not None:
            self._sampler.set_epoch(self._resume["epoch"])
            self._sampler.skip_in_epoch(
                self._resume["epoch"], self._resume["batches"] * self.batch_size
            )
            self._resume = None
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=self._sampler,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader[Any]:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(
            self.val_set,
            batch_size=self.val_batch_size,
            shuffle=False,
            num_workers=self.num_workers,
        )

    def test_dataloader(self) -> DataLoader[Any]:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader[Any]:
        return self.val_dataloader()

    # -- checkpointing: where in the epoch a mid-epoch checkpoint was taken ----------
    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        if trainer is None or not trainer.training:
            return {}
        # Checkpoints are written after a batch was processed (on_train_batch_end) or at
        # the end of an epoch; `processed` counts this epoch's batches either way.
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]  # Lightning's _BatchProgress.current: a _ProcessedTracker, typed as its base
        return {"epoch": int(trainer.current_epoch), "batches": int(done)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "epoch" in state_dict and "batches" in state_dict:
            self._resume = {
                "epoch": int(state_dict["epoch"]),
                "batches": int(state_dict["batches"]),
            }
