"""A user's training script under torchrun, as a new user writes one (issue 26): logging
at INFO, ``bnswap.convert`` of the main job's net (``bnswap.app.models.MobileNetV2``,
width 0.5, 52 BatchNorm layers), then DDP on the CPU (gloo).

    torchrun --nproc_per_node=2 tests/torchrun_job.py OUT_DIR

Each rank logs to stderr with its rank in the line (``[rank R] LEVEL name: message``),
at INFO, and

1. converts a net before ``init_process_group`` (torchrun's ``RANK`` is all there is);
2. starts the process group (gloo), drops ``RANK`` / ``LOCAL_RANK`` from its environment
   (so only the process group tells the rank) and converts another with
   ``sync_batchnorm=True``;
3. wraps in DDP a net whose SyncBatchNorm layers bnswap did not swap: converted first,
   then ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` (what Lightning's
   ``Trainer(sync_batchnorm=True)`` does after a LightningModule converted in
   ``__init__``), and one whose SyncBatchNorm is excluded; writes the errors to
   OUT_DIR/rank<R>.json.

Used by tests/test_launchers.py.
"""

import json
import logging
import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from _helpers import COLLECTIVE_TIMEOUT_S
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import bnswap
from bnswap.app.models import MobileNetV2

torch.set_num_threads(1)  # two processes on two cores


def net() -> nn.Module:
    torch.manual_seed(0)
    return MobileNetV2(width_mult=0.5, num_classes=10)  # configs/digits_mobilenetv2.yaml's


class Doubled(nn.BatchNorm2d):
    """A subclass that overrides forward (bnswap has no adapter for it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def ddp_error(model: nn.Module) -> dict[str, str] | None:
    try:
        DistributedDataParallel(model)
    except Exception as e:  # what the user sees, recorded for the test
        return {"type": type(e).__name__, "message": str(e)}
    return None


def main(out_dir: str) -> None:
    rank = os.environ["RANK"]
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    bnswap.convert(net())  # 1. before the process group: RANK alone
    # a layer convert leaves (it overrides forward): its warning once per job
    bnswap.convert(nn.Sequential(Doubled(3), nn.BatchNorm2d(3)))
    dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    for key in ("RANK", "LOCAL_RANK"):
        os.environ.pop(key, None)
    bnswap.convert(net(), sync_batchnorm=True)  # 2. the process group says the rank
    # 3. SyncBatchNorm layers bnswap did not swap
    late = nn.SyncBatchNorm.convert_sync_batchnorm(bnswap.convert(net()))
    excluded = nn.SyncBatchNorm.convert_sync_batchnorm(net())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the excluded layer is what this case wants)
        bnswap.convert(excluded, exclude="features.0.1")
    swapped = bnswap.convert(net(), sync_batchnorm=True)
    errors = {
        "late": ddp_error(late),
        "excluded": ddp_error(excluded),
        "swapped": ddp_error(swapped),
    }
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(errors, f)


if __name__ == "__main__":
    main(sys.argv[1])
    dist.destroy_process_group()  # (gloo's threads joined before the interpreter exits)
