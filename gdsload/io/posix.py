"""POSIX backend: positioned vectored reads (`preadv`) on cached file descriptors, on a thread pool.

Invariant: one coalesced group is one `preadv` system call (more only when the kernel returns a
partial read), scattering straight into the caller's buffer: the iovec list holds views of `out`
for the requested extents and views of a per-thread scratch buffer (`max_gap` bytes) for the tar
headers between them, so payload bytes are never copied in user space.

O_DIRECT (`o_direct=True`): the kernel then needs the file offset, the length and the buffer
address all aligned to 4096 bytes, which a caller's packed `out` generally is not. This backend
therefore widens each group to whole pages, reads them into a per-thread page-aligned scratch
buffer (`direct_chunk` bytes, read in chunks of that size) and copies the requested bytes out:
every extent works, at the cost of one memcpy; what O_DIRECT buys is bypassing the page cache.
When the filesystem refuses O_DIRECT (EINVAL on open or on read, e.g. some tmpfs or FUSE mounts),
the backend falls back to buffered reads for good and its `name` becomes "posix", so stats never
claim a path that is not in use.

Threads: `read` may be called from many threads; the fd cache is guarded by a lock, and an fd
is closed only by `close()` (never while another read could be using it).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from gdsload.errors import GdsloadError, StorageError
from gdsload.io.base import PooledBackend, PAGE, Extent, ReadGroup, check_request, coalesce, gather, short_read

from gdsload.io.table import ExtentTable, check_table, group_table

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 array of `nbytes` whose data address is a multiple of PAGE (over-allocate, slice)."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    skip = (-raw.ctypes.data) % PAGE
    return raw[skip : skip + nbytes]


def _preadv_full(fd: int, bufs: list[memoryview], offset: int) -> tuple[int, int]:
    """preadv until every buffer is full or EOF; returns (bytes read, system calls made)."""
    done = calls = 0
    first = 0
    while first < len(bufs):
        n = os.preadv(fd, bufs[first:], offset + done)
        calls += 1
        if n == 0:
            break
        done += n
        while first < len(bufs) and n >= len(bufs[first]):
            n -= len(bufs[first])
            first += 1
        if n:
            bufs[first] = bufs[first][n:]
    return done, calls


class _DirectRefused(Exception):
    """The filesystem refused an O_DIRECT read (EINVAL); the group is retried buffered."""


class PosixBackend(PooledBackend):
    """Local files through `preadv` on a pool of `threads` threads; see the module docstring.

    `max_gap` (bytes): extents of one file at most this far apart are read in one call, the gap
    bytes going to scratch. `max_span` (bytes): a coalesced read grows no larger, so a big batch
    still spreads over the threads. `direct_chunk` (bytes, multiple of 4096): the O_DIRECT bounce
    buffer per thread.
    """

    _pool_name = "gdsload-posix"

    device_capable = False

    def __init__(
        self,
        threads: int = 4,
        o_direct: bool = False,
        max_gap: int = 64 * 1024,
        *,
        max_span: int = 8 * 1024 * 1024,
        direct_chunk: int = 8 * 1024 * 1024,
        inline_nbytes: int = 64 * 1024,
    ) -> None:
        if threads < 1:
            raise GdsloadError(f"threads={threads} must be >= 1")
        if max_gap < 0:
            raise GdsloadError(f"max_gap={max_gap} must be >= 0")
        if max_span < 1:
            raise GdsloadError(f"max_span={max_span} must be >= 1")
        if direct_chunk < PAGE or direct_chunk % PAGE:
            raise GdsloadError(f"direct_chunk={direct_chunk} must be a positive multiple of {PAGE}")
        super().__init__(threads)
        self.threads = threads
        self.max_gap = max_gap
        self.max_span = max_span
        self.direct_chunk = direct_chunk
        self.inline_nbytes = inline_nbytes  # groups this small are read in the caller's thread
        self.o_direct_requested = o_direct
        self._direct = bool(o_direct and _O_DIRECT)  # False once the filesystem refused it
        self._fds: dict[str, tuple[int, bool]] = {}  # path -> (fd, opened with O_DIRECT)
        self._retired: list[int] = []  # O_DIRECT fds replaced after a refusal; closed in close()
        self._local = threading.local()

    @property
    def name(self) -> str:
        return "posix-odirect" if self._direct else "posix"

    def __repr__(self) -> str:
        return f"PosixBackend(name={self.name!r}, threads={self.threads}, max_gap={self.max_gap})"

    # -- public ------------------------------------------------------------------------------
    def read(self, extents: Sequence[Extent], out: Any, out_offsets: Sequence[int]) -> Future[int]:
        check_request(extents, out, out_offsets, device_ok=False)
        # Each piece may need a gap buffer before it, hence half of IOV_MAX pieces per call.
        groups = coalesce(extents, out_offsets, max_gap=self.max_gap, max_pieces=_IOV_MAX // 2,
                          max_span=self.max_span)
        pool = self._executor()
        futures: list[Future[int]] = []
        for g in groups:
            if g.nbytes <= self.inline_nbytes:
                # A small read costs less than a hand-off to the pool: do it in this thread.
                f: Future[int] = Future()
                f.set_running_or_notify_cancel()
                try:
                    f.set_result(self._read_group(g, out))
                except BaseException as exc:
                    f.set_exception(exc)
                futures.append(f)
            else:
                futures.append(pool.submit(self._read_group, g, out))
        return gather(futures)

    def read_table(self, table: "ExtentTable", out: Any) -> Future[int]:
        """`read` for an `ExtentTable` (`gdsload.io.table`): grouped with array operations and
        read in the calling thread, one `preadv` per group (callers such as the loader already
        read from several threads; a pool hand-off per group would cost more than it saves).
        Pieces that are adjacent in the file and in `out` share one iovec."""
        if not isinstance(out, np.ndarray) or out.ndim != 1 or out.dtype != np.uint8 or not (
                out.flags.c_contiguous and out.flags.writeable):
            raise GdsloadError("out must be a writeable 1-D C-contiguous uint8 NumPy array (host memory)")
        check_table(table, out)
        done: Future[int] = Future()
        done.set_running_or_notify_cancel()
        try:
            if self._direct:  # O_DIRECT needs page-aligned bounce reads: the Extent path does them
                extents, outs = table.extents()
                return self.read(extents, out, outs)
            done.set_result(self._read_sorted(table, out))
        except BaseException as exc:
            done.set_exception(exc)
        return done

    def _read_sorted(self, table: "ExtentTable", out: np.ndarray) -> int:
        order, starts = group_table(table, max_gap=self.max_gap)
        if not len(order):
            return 0
        f = table.file[order].tolist()
        o = table.offset[order].tolist()
        n = table.nbytes[order].tolist()
        d = table.out_offset[order].tolist()
        mv = memoryview(out)
        gap_scratch = memoryview(self._scratch("gap", max(self.max_gap, 1), aligned=False))
        calls = moved = payload = 0
        limit = _IOV_MAX
        for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
            path = table.paths[f[a]]
            fd, _ = self._fd(path)
            bufs: list[memoryview] = []
            start = pos = o[a]
            dst = d[a]
            run = 0  # bytes of the current run, contiguous in the file and in out
            for k in range(a, b):
                if o[k] == pos and d[k] == dst + run:
                    run += n[k]
                else:
                    if run:
                        bufs.append(mv[dst : dst + run])
                    if o[k] > pos:
                        bufs.append(gap_scratch[: o[k] - pos])
                    dst, run = d[k], n[k]
                pos = o[k] + n[k]
                payload += n[k]
            bufs.append(mv[dst : dst + run])
            off = start
            for c in range(0, len(bufs), limit):  # IOV_MAX buffers per call
                chunk = bufs[c : c + limit]
                want = sum(len(x) for x in chunk)
                try:
                    got, k = _preadv_full(fd, chunk, off)
                except OSError as exc:
                    raise StorageError(f"reading {path!r} at offset {off} failed: {exc.strerror}") from exc
                calls += k
                moved += got
                if got < want:
                    lost = next(j for j in range(a, b) if o[j] + n[j] > off + got)
                    try:
                        size: int | None = os.fstat(fd).st_size
                    except OSError:
                        size = None
                    raise short_read(path, o[lost], n[lost], max(0, off + got - o[lost]), size)
                off += got
        self._stats.add(reads=calls, bytes_read=payload, bytes_transferred=moved)
        return payload

    def forget(self, path: str) -> None:
        """Close the cached fd of `path` (reopened on the next read). The caller guarantees no
        read of `path` is in flight; the shard cache calls this before a file can be evicted, so
        an unlinked file does not keep its disk space through a descriptor held here."""
        with self._lock:
            entry = self._fds.pop(path, None)
        if entry is not None:
            os.close(entry[0])

    def _release(self) -> None:
        with self._lock:
            fds = [fd for fd, _ in self._fds.values()] + self._retired
            self._fds.clear()
            self._retired.clear()
        for fd in fds:
            os.close(fd)

    # -- internals ---------------------------------------------------------------------------
    def _fd(self, path: str) -> tuple[int, bool]:
        """The cached fd for `path` and whether it is O_DIRECT; opened on first use."""
        with self._lock:
            self._check_open()
            entry = self._fds.get(path)
            if entry is not None:
                fd, direct = entry
                if not direct or self._direct:
                    return entry
                # An O_DIRECT fd after a refusal: reopen buffered; other threads may still be
                # using the old fd, so it is closed only by close().
                self._retired.append(fd)
            flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
            fd = -1
            if self._direct:
                try:
                    fd = os.open(path, flags | _O_DIRECT)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise StorageError(f"cannot open {path!r}: {exc.strerror}") from exc
                    self._direct = False
            if fd < 0:
                try:
                    fd = os.open(path, flags)
                except OSError as exc:
                    raise StorageError(f"cannot open {path!r}: {exc.strerror}") from exc
            entry = (fd, self._direct)
            self._fds[path] = entry
            return entry

    def _scratch(self, attr: str, nbytes: int, aligned: bool) -> np.ndarray:
        buf = getattr(self._local, attr, None)
        if buf is None or len(buf) < nbytes:
            buf = aligned_empty(nbytes) if aligned else np.empty(nbytes, dtype=np.uint8)
            setattr(self._local, attr, buf)
        return buf

    def _read_group(self, group: ReadGroup, out: np.ndarray) -> int:
        fd, direct = self._fd(group.path)
        if direct:
            try:
                return self._read_direct(fd, group, out)
            except _DirectRefused:
                with self._lock:
                    self._direct = False
                fd, _ = self._fd(group.path)
        return self._read_buffered(fd, group, out)

    def _read_buffered(self, fd: int, group: ReadGroup, out: np.ndarray) -> int:
        gap_scratch = memoryview(self._scratch("gap", max(self.max_gap, 1), aligned=False))
        bufs: list[memoryview] = []
        pos = group.offset
        for p in group.pieces:
            if p.offset > pos:
                bufs.append(gap_scratch[: p.offset - pos])
            bufs.append(memoryview(out[p.out_offset : p.out_offset + p.nbytes]))
            pos = p.offset + p.nbytes
        try:
            got, calls = _preadv_full(fd, bufs, group.offset)
        except OSError as exc:
            raise StorageError(f"reading {group.path!r} at offset {group.offset} failed: {exc.strerror}") from exc
        self._stats.add(reads=calls, bytes_read=group.payload_nbytes if got == group.nbytes else 0,
                        bytes_transferred=got)
        if got < group.nbytes:
            raise self._short(fd, group, group.offset + got)
        return group.payload_nbytes

    def _read_direct(self, fd: int, group: ReadGroup, out: np.ndarray) -> int:
        start = group.offset - group.offset % PAGE
        stop = -(-group.end // PAGE) * PAGE
        scratch = self._scratch("direct", self.direct_chunk, aligned=True)
        pos = reached = start  # absolute file offsets; pos (scratch[0]) is always page-aligned
        calls = transferred = 0
        while reached < group.end:
            want = min(self.direct_chunk, stop - pos)
            try:
                got = os.preadv(fd, [memoryview(scratch[:want])], pos)
            except OSError as exc:
                if exc.errno == errno.EINVAL and calls == 0:
                    raise _DirectRefused from exc
                raise StorageError(f"reading {group.path!r} at offset {pos} failed: {exc.strerror}") from exc
            calls += 1
            transferred += got
            for p in group.pieces:
                lo, hi = max(p.offset, pos), min(p.offset + p.nbytes, pos + got)
                if lo < hi:
                    dst = p.out_offset + lo - p.offset
                    out[dst : dst + hi - lo] = scratch[lo - pos : hi - pos]
            reached = pos + got
            # A short O_DIRECT read means EOF, unless it stopped on a page boundary (then go on).
            if got == 0 or (got < want and got % PAGE):
                break
            pos = reached
        reached = min(reached, group.end)
        self._stats.add(reads=calls, bytes_read=group.payload_nbytes if reached == group.end else 0,
                        bytes_transferred=transferred)
        if reached < group.end:
            raise self._short(fd, group, reached)
        return group.payload_nbytes

    def _short(self, fd: int, group: ReadGroup, reached: int) -> Exception:
        """The FormatError for the first piece of `group` that ends past file byte `reached`."""
        try:
            size: int | None = os.fstat(fd).st_size
        except OSError:
            size = None
        piece = next(p for p in group.pieces if p.offset + p.nbytes > reached)
        return short_read(group.path, piece.offset, piece.nbytes, max(0, reached - piece.offset), size)
