"""KvikIO backend: cuFile reads into CUDA device memory (GPUDirect Storage) or host memory.

Invariant: one coalesced group is one `CuFile.pread` into one contiguous range of `out`. KvikIO
reads into the buffer it is given and cannot scatter, so only extents that are adjacent both in
the file and in `out` are merged (no gap scratch on the device); gdsload's shards keep a sample's
members adjacent, and its payloads >= 4 KiB at file offsets that are multiples of 4096.

GDS fast path: cuFile moves data from NVMe to GPU memory without a bounce buffer only when the
file offset, the size and the device address are multiples of 4096 bytes; other reads still work,
staged through a host bounce buffer. Host (NumPy) buffers are read with POSIX I/O inside KvikIO
(pinned memory makes the later host-to-device copy faster).

`name` is "kvikio-gds" when KvikIO does not prefer compat mode and cuFile itself reports GDS
available (`kvikio.cufile_driver.get("is_gds_available")`); otherwise "kvikio-compat" (KvikIO's
POSIX path, a bounce buffer in host memory for device reads). KvikIO 26.10 imports without a GPU
but refuses every read when libcuda.so.1 is absent; `gdsload.io.choose_backend` only picks this
backend where a CUDA device exists.

Threads: KvikIO splits large reads over its own thread pool (`threads` sets its size, which is
process-wide state of KvikIO); this backend issues groups from a small pool of its own, because
reads below KvikIO's `gds_threshold` run synchronously in the issuing thread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from gdsload.errors import GdsloadError, MissingDependencyError, StorageError
from gdsload.io.base import PooledBackend, Extent, ReadGroup, check_request, coalesce, gather, short_read

INSTALL_HINT = "pip install 'gdsload[cuda12]' (or 'gdsload[cuda13]' on a CUDA 13 host)"


def import_kvikio() -> Any:
    """`import kvikio`, or `MissingDependencyError` with the install hint."""
    try:
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults
    except ImportError as exc:
        raise MissingDependencyError(
            "the 'kvikio' I/O backend (GPUDirect Storage) needs the Python module 'kvikio', which "
            f"is not installed or does not load ({exc}); install it with: {INSTALL_HINT}"
        ) from exc
    return kvikio


def gds_active(kvikio: Any) -> bool:
    """True when reads into device memory really go through GDS, not a compat path."""
    try:
        if kvikio.defaults.is_compat_mode_preferred():
            return False
        return bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception:  # no libcufile, no driver: KvikIO falls back to its POSIX path
        return False


class KvikioBackend(PooledBackend):
    """Local files through KvikIO's `CuFile.pread` into CuPy (device) or NumPy (host) arrays.

    `threads`: the size of KvikIO's thread pool (process-wide; None keeps KvikIO's setting,
    `KVIKIO_NTHREADS`). `issue_threads`: this backend's own threads that issue reads.
    """

    _pool_name = "gdsload-kvikio"

    device_capable = True

    def __init__(self, threads: int | None = None, *, issue_threads: int = 8) -> None:
        if threads is not None and threads < 1:
            raise GdsloadError(f"threads={threads} must be >= 1 or None")
        if issue_threads < 1:
            raise GdsloadError(f"issue_threads={issue_threads} must be >= 1")
        super().__init__(issue_threads)
        self._kvikio = import_kvikio()
        if threads is not None:
            self._kvikio.defaults.set("num_threads", threads)
        self._gds = gds_active(self._kvikio)
        self.issue_threads = issue_threads
        self._files: dict[str, tuple[Any, int]] = {}  # path -> (CuFile, file size in bytes)

    @property
    def name(self) -> str:
        return "kvikio-gds" if self._gds else "kvikio-compat"

    def __repr__(self) -> str:
        return f"KvikioBackend(name={self.name!r})"

    # -- public ------------------------------------------------------------------------------
    def read(self, extents: Sequence[Extent], out: Any, out_offsets: Sequence[int]) -> Future[int]:
        check_request(extents, out, out_offsets, device_ok=True)
        groups = coalesce(extents, out_offsets, max_gap=0, contiguous_out=True)
        pool = self._executor()
        return gather([pool.submit(self._read_group, g, out) for g in groups])

    def _release(self) -> None:
        with self._lock:
            files = [f for f, _ in self._files.values()]
            self._files.clear()
        for f in files:
            f.close()

    # -- internals ---------------------------------------------------------------------------
    def _file(self, path: str) -> tuple[Any, int]:
        with self._lock:
            self._check_open()
            entry = self._files.get(path)
            if entry is None:
                try:
                    size = os.stat(path).st_size
                    handle = self._kvikio.CuFile(path, "r")
                except (OSError, RuntimeError) as exc:
                    raise StorageError(f"cannot open {path!r} with KvikIO: {exc}") from exc
                entry = self._files[path] = (handle, size)
            return entry

    def _read_group(self, group: ReadGroup, out: Any) -> int:
        handle, size = self._file(group.path)
        if group.end > size:  # KvikIO's POSIX path reports EOF as a generic error; check first
            piece = next(p for p in group.pieces if p.offset + p.nbytes > size)
            raise short_read(group.path, piece.offset, piece.nbytes, max(0, size - piece.offset), size)
        first = group.pieces[0].out_offset
        view = out[first : first + group.nbytes]  # contiguous: coalesce(contiguous_out=True)
        try:
            got = handle.pread(view, group.nbytes, group.offset).get()
        except (OSError, RuntimeError) as exc:
            raise StorageError(
                f"KvikIO read of {group.path!r} bytes {group.offset}..{group.end} failed: {exc}"
            ) from exc
        self._stats.add(reads=1, bytes_read=group.payload_nbytes if got == group.nbytes else 0,
                        bytes_transferred=got)
        if got < group.nbytes:
            piece = next(p for p in group.pieces if p.offset + p.nbytes > group.offset + got)
            raise short_read(group.path, piece.offset, piece.nbytes,
                             max(0, group.offset + got - piece.offset), size)
        return group.payload_nbytes
