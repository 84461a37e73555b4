"""The recipes of docs/recipes.md, run as a user would, against stock (issue 32).

Lightning Fabric with 2 CPU ranks (gloo, tests/fabric_sync_fit.py), bnswap's synchronized
BatchNorm converted before or after ``fabric.setup``, against one process training stock
BatchNorm on the global batch (float64).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests._helpers import run_processes


@pytest.mark.timeout(900)
@pytest.mark.parametrize("when", ["before", "after"])
def test_fabric_two_ranks_synchronized_train_like_one_process(when, tmp_path):
    """``bnswap.convert(model, sync_batchnorm=True)`` before or after ``fabric.setup``
    (Fabric's DDP, 2 CPU ranks): every step runs a swapped SyncBatchNorm, both ranks end
    identical and equal to one process on the global batches (float64) within float32
    rounding."""
    sys.path.insert(0, os.path.dirname(__file__))
    try:
        import fabric_sync_fit as script
    finally:
        sys.path.pop(0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        env.pop(k, None)
    proc = run_processes([sys.executable, script.__file__, when, str(tmp_path)],
                         timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + "\n--- stderr ---\n" + proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"{when}_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r in ranks:
        assert r["world_size"] == 2
        assert r["seen"] == [("SyncBatchNorm", True)] * script.STEPS
    s0, s1 = ranks[0]["state"], ranks[1]["state"]
    assert [k for k in s0 if not torch.equal(s0[k], s1[k])] == []
    for k, want in script.reference().items():
        if not want.is_floating_point():  # num_batches_tracked
            assert torch.equal(s0[k], want), k
            continue
        torch.testing.assert_close(s0[k].double(), want, rtol=1e-6, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")
