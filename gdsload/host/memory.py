"""How much memory this host, or the current GPU, can still give.

The prefetch ring allocates all its batch memory at once; asking for more than there is would
either fail with an allocator message that names no setting (`Unable to allocate 7.28 TiB`) or,
with overcommit, get the process killed later. `check_fits` refuses such a request up front with
a message naming what to lower. Host: `MemAvailable` from `/proc/meminfo`, capped by a cgroup v2
limit where one is set (containers); elsewhere the free physical pages. GPU: CuPy's free device
memory. Where nothing can be measured, nothing is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from gdsload.errors import GdsloadError


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_headroom() -> int | None:
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def available_host_bytes() -> int | None:
    """Bytes of host memory this process can still allocate without swapping, or None."""
    values = [v for v in (_meminfo_available(), _cgroup_headroom()) if v is not None]
    return min(values) if values else None


def available_device_bytes() -> int | None:
    """Free memory of the current CUDA device (through CuPy), or None without one."""
    try:
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0])
    except Exception:  # no CuPy, no driver, no device: nothing to measure
        return None


def _fmt(nbytes: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def check_fits(what: str, nbytes: int, available: int | None, *, where: str, hint: str) -> None:
    """Raise GdsloadError if `nbytes` of `what` exceed the `available` memory of `where`."""
    if available is not None and nbytes > available:
        raise GdsloadError(
            f"{what} needs {_fmt(nbytes)}, more than the {_fmt(available)} of {where} memory available; {hint}"
        )
