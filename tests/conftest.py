import os
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / "build" / "inductor-cache"))
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Seed every test, and run it with BNSWAP_TEST_THREADS intra-op threads (default 1).

    The kernels in these tests are small; on a shared 2-core CI machine OpenMP's spinning
    threads made steps 10-1000x slower. Both sides of every comparison run under the same
    setting; the previous setting is restored afterwards.
    """
    torch.manual_seed(0)
    old = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("BNSWAP_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(old)
