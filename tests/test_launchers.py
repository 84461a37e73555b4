"""What a user's script under a real launcher shows (issue 26): ``torchrun`` of 2 gloo
ranks on the CPU running tests/torchrun_job.py (the main job's net, logging at INFO).

* bnswap's plan table is logged once per job (rank zero), before and after
  ``init_process_group``, as Lightning's ``rank_zero_info`` and timm's
  ``if utils.is_primary(args)`` do; the other rank's record is at DEBUG.
* DDP on the CPU of a model whose SyncBatchNorm layers bnswap did not swap raises
  torch's ``ValueError`` naming the layers and the fix (it was torch's bare
  ``SyncBatchNorm layers only work with GPU modules``, raised through bnswap's patch).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from tests._helpers import rank_env, run_processes
from tests.sync_cases import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("torchrun_job.py")
TABLE = "bnswap: 52 of 52 BatchNorm layers swapped, 0 skipped"


def _torchrun(out: Path) -> str:
    """The job's stderr (both ranks': torchrun passes its workers' streams through)."""
    env = rank_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = run_processes(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(SCRIPT),
            str(out),
        ],
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + "\n--- stderr ---\n" + proc.stderr[-4000:]
    return proc.stderr


def test_torchrun_job_logs_the_plan_once_and_ddp_names_unswapped_sync_layers(tmp_path):
    err = _torchrun(tmp_path)
    # Once per job: one table per convert call (the script makes 5), from rank 0; it was
    # one per rank, interleaved
    summaries = [ln for ln in err.splitlines() if "BatchNorm layers swapped," in ln]
    one = "bnswap: 51 of 52 BatchNorm layers swapped, 1 skipped"  # (the excluded one)
    small = "bnswap: 1 of 2 BatchNorm layers swapped, 1 skipped"  # (Doubled's net)
    assert summaries == [
        f"[rank 0] INFO bnswap: {t}" for t in (TABLE, small, TABLE, TABLE, one, TABLE)
    ], summaries
    assert not re.search(r"^\[rank 1\] INFO", err, flags=re.M), err[-3000:]
    # bnswap's warnings once per job too (a layer convert leaves: it warned per rank)
    assert (
        err.count(
            "UserWarning: bnswap.convert: 1 of the model's 2 BatchNorm layers was not swapped"
        )
        == 1
    ), err[-3000:]
    rows = [ln for ln in err.splitlines() if ln.startswith("features.")]
    assert len(rows) == 5 * 52, len(rows)  # (the table's rows: no prefix of their own)
    # after init_process_group the synchronized rows say over what: 52 + 51 + 52 rows
    assert err.count("WORLD, 2 ranks") == 155, err[-3000:]

    for rank in (0, 1):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert errors["swapped"] is None  # every SyncBatchNorm swapped: DDP wraps it
        late, excluded = errors["late"], errors["excluded"]
        assert late["type"] == excluded["type"] == "ValueError"
        assert late["message"].startswith(
            "SyncBatchNorm layers only work with GPU modules: 52 torch.nn.SyncBatchNorm layers "
            "are not swapped by bnswap ('features.0.1', 'features.1.conv.0.1', "
            "'features.1.conv.1.1', 'features.2.conv.0.1', 'features.2.conv.1.1' and 47 more)."
        )
        assert excluded["message"].startswith(
            "SyncBatchNorm layers only work with GPU modules: 1 torch.nn.SyncBatchNorm layer "
            "is not swapped by bnswap ('features.0.1')."
        )
        for e in (late, excluded):
            assert (
                "Fix: bnswap.convert(model) after the sync conversion (torch's and "
                "timm's convert_sync_batchnorm and Trainer(sync_batchnorm=True) make new, "
                "unswapped layers), or bnswap.convert(model, sync_batchnorm=True) in its "
                "place, without excluding them; with Lightning, BNSwap() in the "
                "Trainer's callbacks (it handles Trainer(sync_batchnorm=True)), with no "
                "exclude / include pattern leaving them out"
            ) in e["message"]
