"""Where a dataset's files are written: a local folder, or an fsspec URL (s3://, gs://, memory://).

Both kinds give the same small interface (`Store`), so the shard writer and the conversion engine
do not care where the dataset goes. Names are relative to the dataset root, `/`-separated.

How a file becomes visible, which is what crash safety rests on:

- Local folder (a path or `file://`): every file is written under `.NAME.tmp-PID` next to its final
  name, fsynced, and renamed into place, so a file under its final name is always complete; a
  killed writer leaves only the hidden temporary.
- fsspec URL: every file is one upload to its final name. Object stores (S3, GCS, Azure) publish an
  object only when its upload completes, so a killed writer leaves no visible partial file (at most
  an unfinished multipart upload, invisible, which the bucket's lifecycle rule for incomplete
  uploads removes). A rename would be a full copy there, so none is done. On an fsspec filesystem
  without atomic uploads (sftp, say) a killed writer can leave a partial file; the manifest,
  written last, and `--resume`'s size check keep it from being taken as complete.

Listing caches of fsspec filesystems are dropped before every existence or listing query: other
processes (the Ray workers, an earlier run) write into the same prefix.

One writer at a time (`Store.lock`): a local root is locked with `flock` on `ROOT/.gdsload.lock`
(POSIX; no lock on Windows), which names the holder (pid, host, start time) and is removed when
the holder is done. The kernel drops the lock when the holder dies, however it dies, so a stale
file never blocks anyone; NFS (v4, or v3 with lockd) carries `flock` between hosts on Linux.
Processes forked while it is held share it (the conversion's workers). At an fsspec URL there is no lock:
object stores have no exclusive-create that works through fsspec for every backend, so two writers
into one URL at once are not detected (run one conversion per destination; `gdsload verify`
reports the objects such a race leaves that the manifest does not list).

Write errors name the file: an `OSError` from `write()`, `flush()` or `fsync()` (a full disk's
ENOSPC carries no file name) is re-raised with the path, and a failed file leaves no temporary.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from gdsload.errors import DestinationError, FormatError, GdsloadError, MissingDependencyError, StorageError, require
from gdsload.io.posix import aligned_empty
from gdsload.io import is_remote, local_path  # the one "where is this?" (re-exported here)


def url_to_fs(url: str) -> tuple[Any, str]:
    """`fsspec.core.url_to_fs`, with a missing protocol library (s3fs, gcsfs, ...) reported as a
    `MissingDependencyError` naming the URL."""
    fsspec = require("fsspec", extra="remote", purpose=f"reading or writing {url}")
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise MissingDependencyError(f"{url}: {exc}") from exc


LOCK = ".gdsload.lock"  # the writer lock of a local dataset root (see the module docstring)


def named(exc: OSError, path: str | os.PathLike[str]) -> OSError:
    """`exc` with `path` as its file name where it has none (ENOSPC from `write()` has none); the
    errno picks the same subclass (`PermissionError`, ...)."""
    if exc.filename is None and exc.errno is not None:
        return OSError(exc.errno, exc.strerror, str(path))
    return exc


def write_atomic(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write `data` to the local `path` through a temporary name and an atomic rename (fsynced
    unless `fsync=False`); a failed write leaves no temporary file behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise named(exc, tmp) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class PendingFile(ABC):
    """A file being written: `write()`, then `commit()` to publish it or `abort()` to drop it."""

    @abstractmethod
    def write(self, data: bytes | memoryview) -> int: ...

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...


class Store(ABC):
    """A dataset root to write into (see the module docstring); `root` is for messages."""

    root: str

    def where(self, name: str = "") -> str:
        """`root/name`, for messages."""
        return f"{self.root}/{name}" if name else self.root

    @abstractmethod
    def exists(self, name: str = "") -> bool: ...

    @abstractmethod
    def is_file(self, name: str = "") -> bool: ...

    @abstractmethod
    def list(self, name: str = "") -> list[str]:
        """Names of the entries directly under `name` (files and folders); [] if it is missing."""

    @abstractmethod
    def read(self, name: str) -> bytes: ...

    @abstractmethod
    def size(self, name: str) -> int | None:
        """Size of the file `name`, or None where there is no such file."""

    @abstractmethod
    def write(self, name: str, data: bytes) -> None:
        """Write the whole file `name` (see the module docstring for how it becomes visible)."""

    @abstractmethod
    def create(self, name: str) -> PendingFile: ...

    @abstractmethod
    def remove(self, name: str) -> None:
        """Remove the file `name`; nothing happens when it does not exist."""

    @abstractmethod
    def remove_tree(self, name: str) -> None: ...

    @abstractmethod
    def make_dirs(self, name: str = "") -> None: ...

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the root for one writer while inside; a second one raises `DestinationError`
        naming the holder. Only local roots are locked (see the module docstring)."""
        yield


# -- a local folder ------------------------------------------------------------------------------
DIRECT_BYTES = 8 << 20  # the staging buffer of a file written with O_DIRECT
_DIRECT_ALIGN = 4096  # offsets and lengths of O_DIRECT writes: a multiple of every block size in use


class _LocalPending(PendingFile):
    """A local file written under a temporary name, renamed into place by `commit()`.

    Written with `O_DIRECT` where the platform and filesystem take it (Linux; ext4, xfs, ...; not
    tmpfs): the bytes are gathered in a page-aligned buffer of `DIRECT_BYTES` and each full buffer
    goes to the disk by DMA, so the kernel copies nothing into the page cache (that copy, and the
    page reclaim it causes, was the largest CPU cost of writing shards: ~1.1 CPU-s/GB against 0.2
    for the gather here) and `commit()`'s fsync has only metadata left to write. The new file is
    then not in the page cache: its first read comes from the disk. The tail that does not fill an
    aligned block is written after clearing `O_DIRECT`. Elsewhere, or when the first direct write
    is refused (EINVAL), it is an ordinary buffered file.
    """

    def __init__(self, path: Path):
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        self._fd = -1
        try:
            if direct:
                try:
                    self._fd = os.open(self.tmp, flags | direct, 0o644)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    direct = 0  # the filesystem does not take O_DIRECT (tmpfs)
            if self._fd < 0:
                self._fd = os.open(self.tmp, flags, 0o644)
        except OSError as exc:
            raise named(exc, self.tmp) from exc
        self._direct = bool(direct)
        self._view = memoryview(aligned_empty(DIRECT_BYTES)) if direct else None  # staging
        self._pos = 0  # bytes staged in the buffer

    def _write_all(self, data: memoryview) -> None:
        while data.nbytes:
            n = os.write(self._fd, data)
            data = data[n:]

    def _write_direct(self, data: memoryview) -> None:
        """A whole aligned buffer with O_DIRECT; on EINVAL (a filesystem that opened the file but
        refuses its writes) the file goes on buffered."""
        if self._direct:
            try:
                return self._write_all(data)
            except OSError as exc:
                if exc.errno != errno.EINVAL or os.lseek(self._fd, 0, os.SEEK_CUR) % _DIRECT_ALIGN:
                    raise
                self._buffered()
        self._write_all(data)

    def _buffered(self) -> None:
        import fcntl

        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._direct = False

    def write(self, data: bytes | memoryview) -> int:
        data = memoryview(data).cast("B")
        n = data.nbytes
        try:
            view = self._view
            if view is None:
                self._write_all(data)
                return n
            while data.nbytes:
                k = min(data.nbytes, DIRECT_BYTES - self._pos)
                view[self._pos:self._pos + k] = data[:k]
                self._pos += k
                data = data[k:]
                if self._pos == DIRECT_BYTES:
                    self._write_direct(view)
                    self._pos = 0
        except OSError as exc:
            raise named(exc, self.tmp) from exc
        return n

    def commit(self) -> None:
        try:
            if self._view is not None and self._pos:
                aligned = self._pos - self._pos % _DIRECT_ALIGN
                if aligned:
                    self._write_direct(self._view[:aligned])
                if self._direct and aligned < self._pos:
                    self._buffered()
                self._write_all(self._view[aligned:self._pos])
            os.fsync(self._fd)
            self._close()
            os.replace(self.tmp, self.path)
        except OSError as exc:
            raise named(exc, self.tmp) from exc

    def _close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        self._view = None

    def abort(self) -> None:
        try:
            self._close()
        except OSError:
            pass
        finally:
            self.tmp.unlink(missing_ok=True)


class LocalStore(Store):
    def __init__(self, root: str | os.PathLike[str]):
        self.path = local_path(root)
        self.root = str(self.path)

    def _p(self, name: str) -> Path:
        return self.path / name if name else self.path

    def exists(self, name: str = "") -> bool:
        return self._p(name).exists()

    def is_file(self, name: str = "") -> bool:
        return self._p(name).is_file()

    def list(self, name: str = "") -> list[str]:
        try:
            return [e.name for e in os.scandir(self._p(name))]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def read(self, name: str) -> bytes:
        return self._p(name).read_bytes()

    def size(self, name: str) -> int | None:
        p = self._p(name)
        return p.stat().st_size if p.is_file() else None

    def write(self, name: str, data: bytes) -> None:
        write_atomic(self._p(name), data)

    def create(self, name: str) -> PendingFile:
        return _LocalPending(self._p(name))

    def remove(self, name: str) -> None:
        self._p(name).unlink(missing_ok=True)

    def remove_tree(self, name: str) -> None:
        shutil.rmtree(self._p(name), ignore_errors=True)

    def make_dirs(self, name: str = "") -> None:
        self._p(name).mkdir(parents=True, exist_ok=True)

    @contextmanager
    def lock(self) -> Iterator[None]:
        try:
            import fcntl  # POSIX
        except ImportError:  # Windows: no lock
            yield
            return
        self.make_dirs()
        path = self._p(LOCK)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                os.close(fd)
                raise DestinationError(
                    f"{self.root} is being written by another gdsload conversion "
                    f"({holder or 'holder unknown'}, lock {path}); wait for it to finish or stop it "
                    f"(the lock goes with that process)"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder removed the file between our open and flock: retry
        try:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since {stamp}\n".encode(), 0)
            yield
        finally:
            path.unlink(missing_ok=True)  # while still locked, so nobody holds a lock on a removed file
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


# -- an fsspec URL -------------------------------------------------------------------------------
class _FsspecPending(PendingFile):
    def __init__(self, fs: Any, path: str):
        self.fs, self.path = fs, path
        self._f = fs.open(path, "wb")

    def write(self, data: bytes | memoryview) -> int:
        return self._f.write(data)

    def commit(self) -> None:
        self._f.close()  # the upload completes here, and only here does the object appear

    def abort(self) -> None:
        if not self._f.closed:
            discard = getattr(self._f, "discard", None)  # buffered remote files: drop the upload
            if discard is not None:
                discard()
            else:
                self._f.close()
        try:  # a filesystem that published a partial file anyway
            self.fs.rm_file(self.path)
        except OSError:  # none there, as on object stores
            pass


class FsspecStore(Store):
    def __init__(self, url: str):
        self.fs, path = url_to_fs(url)
        self.path = path.rstrip("/")
        self.root = url.rstrip("/")

    def _p(self, name: str) -> str:
        return f"{self.path}/{name}" if name else self.path

    def _fresh(self, name: str) -> str:
        p = self._p(name)
        self.fs.invalidate_cache(p)
        return p

    def exists(self, name: str = "") -> bool:
        return self.fs.exists(self._fresh(name))

    def is_file(self, name: str = "") -> bool:
        return self.fs.isfile(self._fresh(name))

    def list(self, name: str = "") -> list[str]:
        try:
            entries = self.fs.ls(self._fresh(name), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self._p(name))

    def size(self, name: str) -> int | None:
        try:
            info = self.fs.info(self._fresh(name))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def write(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self._p(name), data)

    def create(self, name: str) -> PendingFile:
        return _FsspecPending(self.fs, self._p(name))

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(self._p(name))
        except FileNotFoundError:
            pass

    def remove_tree(self, name: str) -> None:
        try:
            self.fs.rm(self._fresh(name), recursive=True)
        except FileNotFoundError:
            pass

    def make_dirs(self, name: str = "") -> None:
        """Object stores (filesystems with buckets: s3fs, gcsfs, adlfs) have no folders to make,
        and a missing bucket is an error here, not created (s3fs's `makedirs` would create it)."""
        split = getattr(self.fs, "split_path", None)
        if split is None:
            self.fs.makedirs(self._p(name), exist_ok=True)
            return
        bucket = split(self.path)[0]
        self.fs.invalidate_cache(bucket)
        if not self.fs.exists(bucket):
            raise DestinationError(f"{self.root}: bucket {bucket!r} does not exist or is not accessible "
                                   f"(gdsload does not create buckets)")


def open_store(root: str | os.PathLike[str] | Store) -> Store:
    """The store for a dataset root: a `Store` as it is, an fsspec URL, or a local path."""
    if isinstance(root, Store):
        return root
    return FsspecStore(str(root)) if is_remote(str(root)) else LocalStore(root)


def save_manifest(root: str | os.PathLike[str] | Store, manifest: dict[str, Any]) -> None:
    """Write `root/manifest.json` (a local path, an fsspec URL or a `Store`); see `Store.write`
    for how it becomes visible. Conversion calls this last."""
    from gdsload.format import manifest as mf

    open_store(root).write(mf.MANIFEST, mf.dumps(manifest))


def load_manifest(root: str | os.PathLike[str] | Store) -> dict[str, Any]:
    """Read and check the manifest of the dataset at `root` (a local path, an fsspec URL or a
    `Store`)."""
    from gdsload.format import manifest as mf

    store = open_store(root)
    try:
        text = store.read(mf.MANIFEST).decode()
    except FileNotFoundError:
        hint = ""
        if store.exists(".gdsload-convert"):
            hint = " (a conversion into it was interrupted; re-run gdsload convert with --resume)"
        elif not store.exists():
            hint = " (the folder does not exist)"
        raise FormatError(f"{store.root}: no {mf.MANIFEST}, so this is not a complete gdsload dataset{hint}") from None
    except GdsloadError:
        raise
    except Exception as exc:  # noqa: BLE001 - an unreachable store (botocore's errors are no OSError)
        raise StorageError(f"cannot read {store.where(mf.MANIFEST)}: {type(exc).__name__}: {exc}") from exc
    return mf.parse(text, name=store.where(mf.MANIFEST))
