"""Host buffers for the packed members of batches that decode nothing, owned by those batches.

Part of the ring package: the ring and this pool are the only allocators of batch memory.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np


#: The smallest staging buffer (a new one has a quarter of headroom over the batch, at least this).
MIN_BUFFER_NBYTES = 4 << 20


def buffer_nbytes(nbytes: int) -> int:
    """The size of the buffer `StagingPool.take(nbytes)` allocates when no free one fits: a quarter
    over `nbytes` (the next batch may be a bit bigger), at least `MIN_BUFFER_NBYTES`. The feed
    server sizes a stream's memory reservation with it (`gdsload.service.server.estimate`)."""
    return max(nbytes + nbytes // 4, MIN_BUFFER_NBYTES)


class StagingPool:
    """Buffers for the packed members of batches that decode nothing (`plan(..., packed=True)`),
    which the batch's `BytesColumn`s own; a buffer comes back here when the last array or view
    of it is gone (a ctypes owner per batch, watched by `weakref.finalize`), never earlier.

    Why: a fresh multi-MB buffer per batch goes to and from the OS (glibc serves it with `mmap`
    or trims it from the heap) and its pages are touched for the first time again; reusing them
    gave ~10 % more samples/s in tier R (30,000 photos, batch 64, 6 interleaved pairs of fresh
    processes on the 2-core VM). At most `keep` free buffers are kept (the largest), so a job
    that held many batches at once does not keep their memory after it let them go.

    Buffers are NumPy allocations of at least 4 MiB, not `bytearray`s: NumPy asks the kernel for
    transparent huge pages from 4 MiB up (`madvise(MADV_HUGEPAGE)`), so a new buffer costs a
    few 2 MiB page faults instead of one per 4 KiB page, and it is not zero-filled first. Filling
    a new 2.8 MB buffer took a median 0.6 ms against 1.4 ms (5 fresh processes each, 2-core VM;
    one of the five took 4.7 ms, the kernel compacting memory for a huge page)."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.allocated = 0  # buffers made (not taken from the free ones): what reuse saves shows here
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        if not nbytes:  # nothing staged (a .npy dataset whose labels are in the index): no buffer
            return np.zeros(0, np.uint8)
        with self._lock:  # the smallest free buffer that fits (by position: arrays compare by value)
            fits = [i for i, b in enumerate(self._free) if len(b) >= nbytes]
            buf = self._free.pop(min(fits, key=lambda i: len(self._free[i]))) if fits else None
        if buf is None:  # headroom: the next batch may be a bit bigger
            buf = np.empty(buffer_nbytes(nbytes), np.uint8)
            self.allocated += 1
        # the owner spans the whole buffer: ctypes keeps every array type it makes (c_char * n)
        # for the life of the process, so a type per batch size added ~10 GC-tracked objects per
        # batch for good (a type per pool buffer size instead: a few per process)
        owner = (ctypes.c_char * len(buf)).from_buffer(buf)
        weakref.finalize(owner, self._give_back, buf).atexit = False
        return np.frombuffer(owner, np.uint8, count=nbytes)

    def _give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.keep:  # drop the smallest
                self._free.pop(min(range(len(self._free)), key=lambda i: len(self._free[i])))
