"""`gdsload.host.malloc.keep_large_blocks`: set once per process, not over the user's own malloc
settings, and what it is for: a process that makes and drops multi-MB buffers stops paying a page
fault per 4 KiB of each (fresh processes, so the settings of this one do not matter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "confstr") or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""),
                                reason="glibc's malloc")

CHURN = """
import resource, sys
from gdsload.host.malloc import keep_large_blocks
done = keep_large_blocks() if sys.argv[1] == "tuned" else False
keep = []
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(200):  # what a stream does: a message of ~3.4 MB made, a few kept, then dropped
    keep.append(b"x" * (3_400_000 + 4096 * (i % 7)))
    if len(keep) > 3:
        keep.pop(0)
print(done, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _run(mode: str, **env) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in {**os.environ, **env}.items()
                              if not k.startswith("MALLOC_") or k in env}, check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_large_blocks_stop_faulting():
    tuned, faults = _run("tuned")
    assert tuned
    _, plain = _run("plain")
    # 200 blocks of 3.4 MB: ~830 pages each when every block is fresh
    assert faults < plain / 5, (faults, plain)


def test_the_users_settings_and_the_opt_out_win():
    assert _run("tuned", GDSLOAD_MALLOPT="0")[0] is False
    assert _run("tuned", MALLOC_TRIM_THRESHOLD_="1000000")[0] is False
