"""The ``ddp`` patch (:data:`bnswap._compat.PATCHES`).

**DDP on the CPU**: ``DistributedDataParallel``'s check that refuses CPU modules
holding a ``SyncBatchNorm`` lets modules through whose SyncBatchNorm layers are all
swapped (:func:`patch_ddp_syncbn_check`).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from bnswap._compat._shared import is_patched, mark
from bnswap._swap import is_swapped


def patch_ddp_syncbn_check() -> bool:
    """Let ``DistributedDataParallel`` wrap a CPU module whose ``SyncBatchNorm`` layers are
    all swapped (:mod:`bnswap.sync` runs them on every device).

    ``DistributedDataParallel.__init__`` refuses any CPU module holding an
    ``nn.SyncBatchNorm`` (``ValueError: SyncBatchNorm layers only work with GPU modules``,
    its ``_passing_sync_batchnorm_handle``) because stock's synchronized kernels are
    CUDA-only. The check still refuses a CPU module with any unswapped ``SyncBatchNorm``,
    with torch's ``ValueError`` and message, followed by the qualified names of those
    layers and the fix (:func:`_unswapped_sync_message`); on other devices it is torch's
    check as it is. Gate: the method exists (torch 2.4 to 2.15)."""
    from torch.nn.parallel import distributed

    ddp = distributed.DistributedDataParallel
    stock = getattr(ddp, "_passing_sync_batchnorm_handle", None)
    if stock is None:
        return False
    if is_patched(stock):
        return True

    @functools.wraps(stock)
    def _passing_sync_batchnorm_handle(self: Any, module: nn.Module) -> None:
        left = [
            n
            for n, m in module.named_modules()
            if isinstance(m, nn.SyncBatchNorm) and not is_swapped(m)
        ]
        if not left:
            return
        if getattr(self, "device_type", None) == "cpu" and callable(
            getattr(self, "_log_and_throw", None)
        ):
            self._log_and_throw(ValueError, _unswapped_sync_message(left))
        stock(self, module)

    ddp._passing_sync_batchnorm_handle = mark(_passing_sync_batchnorm_handle)  # type: ignore[method-assign]  # the patch
    return True


#: How many layer names the DDP error lists before it counts the rest.
_NAMED = 5


def _unswapped_sync_message(names: list[str]) -> str:
    """torch's message (``SyncBatchNorm layers only work with GPU modules``), the layers
    bnswap did not swap by qualified name (the first :data:`_NAMED`, then how many more),
    and how to have them swapped."""
    shown = ", ".join(repr(n or "(root)") for n in names[:_NAMED])
    if len(names) > _NAMED:
        shown += f" and {len(names) - _NAMED} more"
    return (
        "SyncBatchNorm layers only work with GPU modules: "
        f"{len(names)} torch.nn.SyncBatchNorm layer{'s are' if len(names) > 1 else ' is'} "
        f"not swapped by bnswap ({shown}). On the CPU only bnswap's swapped SyncBatchNorm "
        "runs. Fix: bnswap.convert(model) after the sync conversion (torch's and timm's "
        "convert_sync_batchnorm and Trainer(sync_batchnorm=True) make new, unswapped "
        "layers), or bnswap.convert(model, sync_batchnorm=True) in its place, without "
        "excluding them; with Lightning, BNSwap() in the Trainer's callbacks (it handles "
        "Trainer(sync_batchnorm=True)), with no exclude / include pattern leaving them out "
        "(an excluded layer stays torch's SyncBatchNorm, which DDP refuses on the CPU). "
        "bnswap.plan(model) shows each layer"
    )
