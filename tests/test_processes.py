"""The tests' process runner (``tests._helpers.run_processes``): a command whose children
hang (a rank stuck in a collective) fails its test at the timeout, and every process it
started is killed, not left holding CI."""

from __future__ import annotations

import re
import sys
import time

import pytest

from tests._helpers import run_processes

HANG = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (a killed process may stay a zombie until its new parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hung_command_fails_fast_and_its_children_die(tmp_path):
    # (the command would hang for 120 s: the runner's message says it was killed at its
    # timeout; how long that took is not asserted, a loaded machine is slow)
    with pytest.raises(
        pytest.fail.Exception, match="ran past 3 s; its process group was killed"
    ) as e:
        run_processes([sys.executable, "-c", HANG], timeout=3)
    child = int(re.findall(r"^(\d+)$", str(e.value), flags=re.M)[0])
    time.sleep(0.5)
    assert not _alive(child)  # the grandchild is gone too
