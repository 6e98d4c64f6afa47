"""The storage-backend contract: read byte extents of shards into a buffer the caller owns.

Invariant: a backend writes exactly the bytes `[offset, offset + nbytes)` of each extent's file to
`out[out_offsets[i] : out_offsets[i] + nbytes]` and touches no other byte of `out`. It never
allocates batch memory; the only memory a backend owns is small per-thread scratch (the bytes of
tar headers between coalesced extents, or an aligned bounce buffer for O_DIRECT).

Performance contract: extents of one file that are adjacent or separated by less than `max_gap`
bytes are merged by `coalesce` into one system-level read, so a sample whose members sit next to
each other in a shard costs one read, not one per member. `stats()["reads"]` counts those reads.

This module needs the standard library and NumPy only.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gdsload.errors import CorruptDataError, GdsloadError

PAGE = 4096  # bytes; GDS and O_DIRECT need file offsets, sizes and buffer addresses aligned to it


@dataclass(frozen=True)
class Extent:
    """`nbytes` bytes of the file `path` starting at byte `offset`."""

    path: str
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.nbytes < 0:
            raise GdsloadError(
                f"extent of {self.path!r} has offset={self.offset}, nbytes={self.nbytes}; "
                "both must be >= 0"
            )

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Piece:
    """One requested extent inside a `ReadGroup`: file bytes `[offset, offset+nbytes)` go to
    `out[out_offset : out_offset+nbytes]`."""

    offset: int
    nbytes: int
    out_offset: int


@dataclass(frozen=True)
class ReadGroup:
    """One system-level read: file bytes `[offset, offset+nbytes)` of `path`, made of `pieces`
    (sorted by file offset, non-overlapping) and the gaps between them, which are read and dropped."""

    path: str
    offset: int
    nbytes: int
    pieces: tuple[Piece, ...]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def payload_nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def coalesce(
    extents: Sequence[Extent],
    out_offsets: Sequence[int],
    *,
    max_gap: int = 64 * 1024,
    max_pieces: int | None = None,
    max_span: int | None = None,
    contiguous_out: bool = False,
) -> list[ReadGroup]:
    """Merge extents of the same file into as few reads as possible.

    Two extents (taken in file order) join one group when they belong to the same path, do not
    overlap, and the second starts at most `max_gap` bytes after the first ends (0 = adjacent
    only). `max_pieces` caps the extents per group (preadv takes at most IOV_MAX buffers).
    `contiguous_out=True` merges only when the extents are also back to back in `out` (and
    adjacent in the file), so a group is one contiguous destination range: what a backend that
    cannot scatter (KvikIO) needs. Zero-length extents read nothing and are dropped. Overlapping
    extents are legal; they simply land in separate groups.

    Groups come back sorted by (path, offset); every non-empty extent is in exactly one group.
    """
    if len(extents) != len(out_offsets):
        raise GdsloadError(
            f"got {len(extents)} extents but {len(out_offsets)} out_offsets; they must pair up"
        )
    if max_gap < 0:
        raise GdsloadError(f"max_gap={max_gap} must be >= 0")
    if max_pieces is not None and max_pieces < 1:
        raise GdsloadError(f"max_pieces={max_pieces} must be >= 1")
    if max_span is not None and max_span < 1:
        raise GdsloadError(f"max_span={max_span} must be >= 1")
    order = sorted(
        (i for i, e in enumerate(extents) if e.nbytes > 0),
        key=lambda i: (extents[i].path, extents[i].offset, extents[i].nbytes),
    )
    groups: list[ReadGroup] = []
    path: str | None = None
    pieces: list[Piece] = []

    def flush() -> None:
        if pieces:
            start = pieces[0].offset
            end = pieces[-1].offset + pieces[-1].nbytes
            groups.append(ReadGroup(path or "", start, end - start, tuple(pieces)))

    for i in order:
        e = extents[i]
        piece = Piece(e.offset, e.nbytes, int(out_offsets[i]))
        if pieces and e.path == path:
            last = pieces[-1]
            gap = e.offset - (last.offset + last.nbytes)
            joins = (
                0 <= gap <= max_gap
                and (max_pieces is None or len(pieces) < max_pieces)
                and (max_span is None or e.end - pieces[0].offset <= max_span)
            )
            if contiguous_out:
                joins = joins and gap == 0 and piece.out_offset == last.out_offset + last.nbytes
            if joins:
                pieces.append(piece)
                continue
        flush()
        path, pieces = e.path, [piece]
    flush()
    return groups


def check_request(
    extents: Sequence[Extent], out: Any, out_offsets: Sequence[int], *, device_ok: bool
) -> None:
    """Validate a `read` call before any I/O starts; raises `GdsloadError` naming the bad value.

    `out` must be a 1-D C-contiguous uint8 array: a NumPy array, or (when `device_ok`) any array
    exposing `__cuda_array_interface__` such as a CuPy array. Every destination range must fit.
    """
    is_numpy = isinstance(out, np.ndarray)
    is_device = hasattr(out, "__cuda_array_interface__")
    if not is_numpy and not (device_ok and is_device):
        kinds = "a NumPy or CuPy array" if device_ok else "a NumPy array (host memory)"
        raise GdsloadError(f"out must be {kinds}, got {type(out).__name__}")
    if out.ndim != 1 or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise GdsloadError(
            f"out must be a 1-D C-contiguous uint8 array, got shape={tuple(out.shape)} "
            f"dtype={out.dtype} contiguous={bool(out.flags.c_contiguous)}"
        )
    if is_numpy and not out.flags.writeable:
        raise GdsloadError("out is read-only; pass a writeable array")
    if len(extents) != len(out_offsets):
        raise GdsloadError(
            f"got {len(extents)} extents but {len(out_offsets)} out_offsets; they must pair up"
        )
    size = int(out.shape[0])
    for e, o in zip(extents, out_offsets):
        if not isinstance(e, Extent):
            raise GdsloadError(f"extents must hold Extent objects, got {type(e).__name__}")
        if o < 0 or o + e.nbytes > size:
            raise GdsloadError(
                f"out_offset={o} with nbytes={e.nbytes} (from {e.path!r}@{e.offset}) does not fit "
                f"in out of {size} bytes"
            )


def short_read(path: str, offset: int, nbytes: int, got: int, file_size: int | None) -> CorruptDataError:
    """The error for a file that ends before `offset + nbytes` (a corrupt copy, not a failed read)."""
    size = "unknown size" if file_size is None else f"{file_size} bytes"
    return CorruptDataError(
        f"short read from {path!r}: wanted {nbytes} bytes at offset {offset} "
        f"(up to byte {offset + nbytes}), got {got}; the file has {size}"
    )


def gather(futures: Sequence[Future[int]]) -> Future[int]:
    """One future for many: its result is the sum of theirs.

    It completes only once every input future is done, even when one fails early, so that no
    backend thread is still writing into `out` when the caller sees the error; the first
    exception (in input order) is then raised.
    """
    result: Future[int] = Future()
    result.set_running_or_notify_cancel()
    if not futures:
        result.set_result(0)
        return result
    pending = [len(futures)]
    lock = threading.Lock()

    def done(_: Future[int]) -> None:
        with lock:
            pending[0] -= 1
            if pending[0]:
                return
        for f in futures:
            exc = f.exception()
            if exc is not None:
                result.set_exception(exc)
                return
        result.set_result(sum(f.result() for f in futures))

    for f in futures:
        f.add_done_callback(done)
    return result


class ReadStats:
    """Thread-safe counters behind `Backend.stats()`.

    `reads`: system-level reads (one preadv, one HTTP range request, one cuFile pread) after
    coalescing. `bytes_read`: payload bytes delivered into `out`. `bytes_transferred`: bytes
    moved from storage, including coalesced gaps and O_DIRECT alignment padding.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads = 0
        self._bytes_read = 0
        self._bytes_transferred = 0

    def add(self, *, reads: int, bytes_read: int, bytes_transferred: int) -> None:
        with self._lock:
            self._reads += reads
            self._bytes_read += bytes_read
            self._bytes_transferred += bytes_transferred

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "reads": self._reads,
                "bytes_read": self._bytes_read,
                "bytes_transferred": self._bytes_transferred,
            }


@runtime_checkable
class Backend(Protocol):
    """Reads byte extents of shard files into a buffer the caller owns.

    Memory kind: `out` is host memory (a NumPy array) for every backend; backends with
    `device_capable` also take CUDA device memory (a CuPy array, or anything exposing
    `__cuda_array_interface__`). Pinned host memory helps KvikIO, and is never required.

    Alignment: any offset and size work. The fast paths want 4096-byte alignment (`PAGE`): GDS
    reads straight into device memory without a bounce buffer only for file offsets, sizes and
    device addresses that are multiples of 4096, and O_DIRECT needs that for host memory too.
    gdsload's shards place payloads of 4 KiB or more at such offsets.

    Ownership: `out` stays the caller's; the backend only writes the destination ranges named by
    `out_offsets` and keeps no reference once the future is done. The caller must keep `out`
    alive and must neither read nor reuse those ranges until the future is done. The backend
    allocates no batch memory (only small per-thread scratch).

    Threads: `read` may be called from many threads at once and returns without waiting for the
    I/O, which runs on the backend's own threads. `close` must not race with reads in flight;
    after `close` the backend cannot be used.
    """

    @property
    def name(self) -> str:
        """The I/O path actually in use: "posix", "posix-odirect", "kvikio-gds", "kvikio-compat",
        "fsspec". A backend that had to fall back (O_DIRECT refused, no GDS) reports the fallback."""
        ...

    @property
    def device_capable(self) -> bool:
        """True when `out` may be CUDA device memory."""
        ...

    def read(
        self, extents: Sequence[Extent], out: Any, out_offsets: Sequence[int]
    ) -> Future[int]:
        """Read `extents[i]` into `out[out_offsets[i] : out_offsets[i] + extents[i].nbytes]`.

        Bad arguments (wrong buffer kind, ranges that do not fit) raise `GdsloadError` here, before
        any I/O. The future's result is the total payload bytes read (the sum of `nbytes`). It
        raises `CorruptDataError` (a `FormatError`) naming the path, offset and sizes when a file
        is shorter than `offset + nbytes`, and `StorageError` when a file cannot be opened or read
        (a fault a later try or another copy may get past; see `gdsload.errors`).
        """
        ...

    def read_table(self, table: Any, out: Any) -> Future[int]:
        """Read a whole `gdsload.io.table.ExtentTable` into `out` (a batch in one call); the
        default plans it with `read`, POSIX reads it with `preadv` per coalesced run."""
        ...

    def register(self, buf: Any) -> bool:
        """Register device memory the backend will read into (cuFile buffer registration);
        True when registered. Backends without registration return False."""
        ...

    def order_on(self, stream: int) -> None:
        """Order device reads on CUDA stream `stream` (a raw handle) instead of the legacy
        stream; a no-op where reads are synchronous or host-only."""
        ...

    def forget(self, path: str) -> None:
        """Close whatever is open on `path` (an evicted cache file), so its space is freed."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters since construction: `reads`, `bytes_read`, `bytes_transferred` (see ReadStats)."""
        ...

    def close(self) -> None:
        """Release threads and file descriptors. Idempotent."""
        ...

    def __enter__(self) -> Backend: ...

    def __exit__(self, *exc_info: object) -> None: ...


class PooledBackend:
    """Lifecycle shared by the backends: a lazily started thread pool, stats, close, `with`.

    Subclasses set `_pool_threads` and `_pool_name`, and release their open files in
    `_release()`, which `close()` calls once, after the pool has drained (no read in flight).
    """

    _pool_name = "gdsload-io"

    def __init__(self, pool_threads: int) -> None:
        self._pool_threads = pool_threads
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._stats = ReadStats()

    def stats(self) -> dict[str, int]:
        return self._stats.snapshot()

    # the protocol's optional capabilities: no-ops unless a backend has them
    def read_table(self, table: Any, out: Any) -> Future[int]:
        """A table as extents through `read` (which checks them); POSIX overrides this."""
        if not len(table):
            done: Future[int] = Future()
            done.set_result(0)
            return done
        extents, outs = table.extents()
        return self.read(extents, out, outs)

    def register(self, buf: Any) -> bool:
        return False

    def order_on(self, stream: int) -> None:
        pass

    def forget(self, path: str) -> None:
        pass

    def _check_open(self) -> None:
        """Raise if closed; call with `self._lock` held."""
        if self._closed:
            raise GdsloadError(f"{self!r} is closed")

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            self._check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._pool_threads, thread_name_prefix=self._pool_name,
                                                initializer=self._thread_init)
            return self._pool

    def _thread_init(self) -> None:
        """Runs first in each pool thread (e.g. to set the thread's current CUDA device)."""

    def _release(self) -> None:
        """Close cached files; called once by `close()` after the pool has drained."""

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
