"""glibc's malloc for a process that moves large messages: `keep_large_blocks()`.

The feed's messages are megabytes each, and the buffers they pass through are made by code we do
not control (gRPC Python joins each received message into a new `bytes`, and copies each sent one
into a new slice; `wire.encode_batch` joins a chunk into a new `bytes`). glibc serves such blocks
with `mmap` (over its mmap threshold, which it raises only up to the size of the last block freed)
and gives the top of its heaps back to the kernel (over its trim threshold), so a block of the
next message often lands on pages the kernel must fault in and zero again: measured on the 2-core
VM, one raw consumer and one server on loopback (1.4 GB per run, under load from other work):
84,000 (server) and 110,000-160,000 (client) page faults per GB, 1.3 and 1.1 CPU-s/GB; with the
thresholds below 3,400-5,400 and 7,500-10,000 faults per GB, 1.1-1.2 and 0.8-0.9 CPU-s/GB.

`keep_large_blocks()` sets `M_MMAP_THRESHOLD` (64 MiB: blocks up to that size come from the heap)
and `M_TRIM_THRESHOLD` (256 MiB of free heap kept before any is given back) once per process,
through `mallopt`. The cost: freed heap memory, up to the trim threshold, stays with the process
(it is reused by the next messages). It does nothing when the C library is not glibc, when the
user chose malloc settings already (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, or
`glibc.malloc` tunables in `GLIBC_TUNABLES`), or with `GDSLOAD_MALLOPT=0`. `gdsload serve` calls
it at start; a `RemoteLoader` when it first iterates.
"""

from __future__ import annotations

import os

MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_done: bool | None = None  # None: not tried in this process; else whether the settings were made


def keep_large_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); True when they are set now."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("GDSLOAD_MALLOPT", "1") == "0":
        return False
    if ("MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")):
        return False  # the user's own settings win
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: their malloc is not glibc's
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
