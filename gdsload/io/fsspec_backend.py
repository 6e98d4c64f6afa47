"""fsspec backend: byte ranges of URLs (s3://, gs://, http(s)://, memory://, file://) on threads.

Invariant: one coalesced group is one ranged request (`fs.cat_file(path, start, end)`), retried
with exponential backoff on transient errors only (connection resets, timeouts, HTTP 5xx/429);
a missing file, a refused request or a file shorter than the range fails at once. The response
bytes are copied into the caller's host buffer (one copy, unavoidable: fsspec returns `bytes`).

Remote requests cost latency more than bandwidth, so `max_gap` defaults to 256 KiB: a few tar
headers and small neighbouring members are cheaper to fetch than a second round trip.

Each backend owns its filesystem instances (`skip_instance_cache=True`), one per protocol, so
`close()` can release their connection pools without touching anyone else's fsspec objects.
fsspec is imported on first use; HTTP also needs aiohttp, S3 s3fs, GCS gcsfs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from gdsload.errors import CorruptDataError, GdsloadError, MissingDependencyError, StorageError
from gdsload.io.base import PooledBackend, Extent, ReadGroup, check_request, coalesce, gather, short_read

_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def is_checksum_error(exc: BaseException) -> bool:
    """The client library found a response's checksum wrong (botocore's `FlexibleChecksumError`,
    raised at the end of a GET whose body does not match the object's stored checksum): the
    bytes were damaged on the way, the stored object may well be intact. By name, so botocore is
    not imported to ask."""
    return any(c.__name__ == "FlexibleChecksumError" for c in type(exc).__mro__)


def _is_transient(exc: BaseException) -> bool:
    """Worth retrying: network hiccups and server-side trouble, not a wrong path or request."""
    if isinstance(exc, (GdsloadError, *_PERMANENT_OS_ERRORS)):
        return False
    if is_checksum_error(exc) or any(c.__name__ in ("HTTPClientError", "ConnectionError") and
                                     c.__module__.startswith("botocore") for c in type(exc).__mro__):
        return True  # bytes damaged in transit; botocore's connection faults (no OSError)
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError and friends
    if isinstance(status, int):
        return status >= 500 or status in (408, 429)
    if isinstance(exc, (OSError, TimeoutError)):  # ConnectionError is an OSError
        return True
    aiohttp = sys.modules.get("aiohttp")  # imported by fsspec's HTTP filesystem when used
    return aiohttp is not None and isinstance(exc, (aiohttp.ClientError, aiohttp.ServerTimeoutError))


class FsspecBackend(PooledBackend):
    """Any fsspec URL through ranged reads on a pool of `threads` threads.

    `retries`: extra attempts per request after a transient error, sleeping `backoff_s`,
    2*`backoff_s`, 4*`backoff_s`... in between. `storage_options` go to the filesystem
    constructor (credentials, endpoints). `max_gap`/`max_span` (bytes) bound coalescing: gaps
    worth fetching rather than paying another round trip, and the largest single request (so big
    batches still become several parallel requests). Host memory only.
    """

    _pool_name = "gdsload-fsspec"

    name = "fsspec"
    device_capable = False

    def __init__(
        self,
        threads: int = 8,
        retries: int = 3,
        *,
        max_gap: int = 256 * 1024,
        max_span: int = 16 * 1024 * 1024,
        backoff_s: float = 0.2,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if threads < 1:
            raise GdsloadError(f"threads={threads} must be >= 1")
        if retries < 0:
            raise GdsloadError(f"retries={retries} must be >= 0")
        if max_gap < 0:
            raise GdsloadError(f"max_gap={max_gap} must be >= 0")
        if max_span < 1:
            raise GdsloadError(f"max_span={max_span} must be >= 1")
        super().__init__(threads)
        self.threads = threads
        self.retries = retries
        self.max_gap = max_gap
        self.max_span = max_span
        self.backoff_s = backoff_s
        self.storage_options = dict(storage_options or {})
        self._filesystems: dict[str, Any] = {}  # protocol -> filesystem owned by this backend
        self._sizes: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"FsspecBackend(threads={self.threads}, retries={self.retries}, max_gap={self.max_gap})"

    # -- public ------------------------------------------------------------------------------
    def read(self, extents: Sequence[Extent], out: Any, out_offsets: Sequence[int]) -> Future[int]:
        check_request(extents, out, out_offsets, device_ok=False)
        groups = coalesce(extents, out_offsets, max_gap=self.max_gap, max_span=self.max_span)
        pool = self._executor()
        return gather([pool.submit(self._read_group, g, out) for g in groups])

    def _release(self) -> None:
        with self._lock:
            filesystems = list(self._filesystems.values())
            self._filesystems.clear()
        for fs in filesystems:
            _close_filesystem(fs)

    # -- internals ---------------------------------------------------------------------------
    def _resolve(self, url: str) -> tuple[Any, str]:
        """(filesystem, path within it) for `url`; one owned filesystem per protocol."""
        import fsspec  # a core dependency of gdsload, imported here to keep `import gdsload` light
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        with self._lock:
            self._check_open()
            fs = self._filesystems.get(protocol)
            if fs is None:
                try:
                    fs, _ = fsspec.core.url_to_fs(url, skip_instance_cache=True, **self.storage_options)
                except ImportError as exc:
                    raise MissingDependencyError(
                        f"reading {url!r} needs the fsspec implementation of {protocol!r}, which "
                        f"is not installed ({exc}); install it, e.g. pip install aiohttp "
                        "(http/https), s3fs (s3://) or gcsfs (gs://)"
                    ) from exc
                self._filesystems[protocol] = fs
        return fs, fs._strip_protocol(url)

    def _size(self, fs: Any, path: str) -> int | None:
        if path not in self._sizes:
            try:
                self._sizes[path] = int(fs.size(path))
            except Exception:  # the size only enriches an error message
                return None
        return self._sizes[path]

    def _read_group(self, group: ReadGroup, out: np.ndarray) -> int:
        fs, path = self._resolve(group.path)
        attempt = 0
        while True:
            try:
                data = fs.cat_file(path, start=group.offset, end=group.end)
                break
            except Exception as exc:
                if attempt < self.retries and _is_transient(exc):
                    time.sleep(self.backoff_s * 2**attempt)
                    attempt += 1
                    continue
                raise self._failure(fs, path, group, exc) from exc
            finally:
                self._stats.add(reads=1, bytes_read=0, bytes_transferred=0)
        self._stats.add(reads=0, bytes_read=0, bytes_transferred=len(data))
        if len(data) < group.nbytes:
            reached = group.offset + len(data)
            piece = next(p for p in group.pieces if p.offset + p.nbytes > reached)
            raise short_read(group.path, piece.offset, piece.nbytes, max(0, reached - piece.offset),
                             self._size(fs, path))
        view = np.frombuffer(data, dtype=np.uint8)
        for p in group.pieces:
            src = p.offset - group.offset
            out[p.out_offset : p.out_offset + p.nbytes] = view[src : src + p.nbytes]
        self._stats.add(reads=0, bytes_read=group.payload_nbytes, bytes_transferred=0)
        return group.payload_nbytes

    def _failure(self, fs: Any, path: str, group: ReadGroup, exc: BaseException) -> GdsloadError:
        """Turn a failed request into our error: CorruptDataError when the range ends past EOF,
        StorageError otherwise."""
        if isinstance(exc, GdsloadError):
            return exc
        size = self._size(fs, path)
        if size is not None and group.end > size:
            piece = next(p for p in group.pieces if p.offset + p.nbytes > size)
            return short_read(group.path, piece.offset, piece.nbytes, max(0, size - piece.offset), size)
        if isinstance(exc, FileNotFoundError):
            return StorageError(f"cannot open {group.path!r}: no such file")
        if is_checksum_error(exc):
            return CorruptDataError(
                f"reading {group.path!r} bytes {group.offset}..{group.end}: the response did not match the "
                f"object's checksum {self.retries + 1} times (damaged in transit, or the stored object is "
                f"corrupt): {exc}")
        return StorageError(
            f"reading {group.path!r} bytes {group.offset}..{group.end} failed after "
            f"{self.retries + 1 if _is_transient(exc) else 1} attempt(s): {type(exc).__name__}: {exc}"
        )


def _close_filesystem(fs: Any) -> None:
    """Release an owned filesystem's connection pool (aiohttp session for HTTP), if it has one.

    fsspec has no public close for async filesystems; HTTPFileSystem keeps its session in
    `_session` and offers the static `close_session(loop, session)` its finalizer uses.
    """
    session = getattr(fs, "_session", None)
    closer = getattr(type(fs), "close_session", None)
    if session is not None and closer is not None:
        try:
            closer(getattr(fs, "loop", None), session)
        except Exception:  # best effort: the finalizer would do the same at garbage collection
            pass
        fs._session = None
