"""server/host_memory.py: the daemon's glibc settings, each tried in a process of its own (they are process-wide)."""
import os
import subprocess
import sys

import pytest

CHECK = """
import ctypes, sys
from inference_engine.server.host_memory import set_mmap_threshold, trim
glibc = hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
print(glibc, set_mmap_threshold(int(sys.argv[1])), trim())
"""


def run(kib: int, **env: str) -> list[str]:
    e = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | env
    out = subprocess.run([sys.executable, "-c", CHECK, str(kib)], env=e, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_a_threshold_is_set_on_glibc_and_zero_leaves_glibcs_own():
    glibc, fixed, trimmed = run(1024)
    if glibc != "True":
        pytest.skip("not glibc: nothing is set (and the call says so)")
    assert fixed == "True" and trimmed == "True"
    assert run(0)[1] == "False"  # 0: glibc's dynamic threshold, untouched


def test_the_environments_own_setting_wins():
    assert run(1024, MALLOC_MMAP_THRESHOLD_="65536")[1] == "False"
