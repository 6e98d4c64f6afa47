"""A plan-driven local cache of whole shards, for datasets at a URL (s3://, gs://, http(s)://).

Why: reading byte ranges from an object store costs one request (10-50 ms) per sample, so latency,
not bandwidth, sets the speed. A whole shard is one request at the store's bandwidth. The loader's
order is a pure function known in advance (`gdsload.plan.plan`), so this cache is told the shards every
batch of the epoch needs (`start_epoch`: a lazy sequence, read only over a sliding window of the
next batches) and fetches them before they are needed, and when it needs room it evicts the shard
needed furthest in the future, or one not needed within the window (Belady's rule, exact within
the window because the future is known). Cached shards are plain local files: the
loader reads them through its ordinary I/O backend (posix, KvikIO/GDS).

Folder layout (one folder per node, shared by every process that uses it; files are named by the
shard's SHA-256, so datasets with a shard in common share it and a rewritten shard never hits a
stale copy):

    <sha256>.tar                    a complete, verified shard (size and SHA-256 of the manifest);
                                    it appears only by an atomic rename, so one is never partial
    <sha256>.idx                    the shard's index (for a restart with the store down), written
                                    beside the complete shard only, and evicted with it
    <sha256>.tar.part-<nbytes>-<id> a download in progress (<nbytes>: what it reserves: the shard,
                                    its index copy and its fetch.log lines, where they fitted)
    <sha256>.lock                   held (flock, exclusive) while that shard is downloaded: another
                                    process that needs it waits there instead of downloading it too;
                                    it exists only while a download of that shard is in progress
    .space.lock                     held while a process reserves space (counts, evicts, creates a
                                    .part, writes metadata), so the reservations of all processes
                                    are serialised; the one file that stays
    manifests/<hash of URL>.json    the manifest of a dataset read here (written at its loader's start)
    users/<pid>-<n>                 a process using the folder: its need and the shards it needs
                                    next (removed when it closes; by another process once it died)
    fetch.log                       one line per download: time, pid, shard, bytes, seconds, ok|corrupt;
                                    the newest lines, at most min(64 kB, limit / 64)

Everything counts: `limit_bytes` bounds the size of every file in the folder (shards, downloads,
index and manifest copies, fetch.log), not the shards alone, save the users/ entries of running
processes (a number and one 65-byte line per shard of its window each, gone with the process):
they are how processes sharing the folder take turns, so they cannot make way, and a limit that
a batch's shards fill to the byte stays usable. Metadata is written under the space lock only
into room counted there. Room for a shard is made by evicting, in order:
manifest copies of datasets none of whose shards is here or wanted next (an offline open of one
could read nothing), then shards by the plan (each with its index copy); a reader waiting for its
batch's shards then also drops the index copies of the shards that stay, fetch.log and the
manifest copies, and nothing else ever waits for metadata. An index copy is written only where it
fits beside shards (with its shard's reservation, or into free room later): with a tight limit
some cached shards may have none (a restart with the store down cannot read those).

Lock files: a shard's lock file is unlinked by the process that holds its lock, before it lets go;
a process that waited on it then finds that the file it locked is no longer the one at that
name (inode check after locking) and locks the new one. Only a holder unlinks, so two processes
never hold the lock of one shard at once, and no lock file outlives the download it guarded (one
left by a killed process is unlinked, under its lock, at the next reservation).

Invariants:
- The bytes in the folder never exceed `limit_bytes` (as this process counts them: every file
  but users/, a .part at what it reserved): space is reserved before a download starts, and the
  metadata this module writes (index and manifest copies, fetch.log lines) is written into room
  counted under the space lock.
- A shard a batch of this process is reading is pinned: a shared flock on the complete file is held
  while any batch uses it. An evictor (in any process) takes an exclusive non-blocking flock before
  it unlinks, and skips a file it cannot lock.
- A crash mid-download leaves only a .part, never a complete name; a .part whose `.lock` nobody
  holds (or that is gone) is stale and is removed at the next reservation (or when its shard is
  fetched again). A temporary file of a metadata write seen under the space lock is a dead
  writer's (they write under it) and is removed too.
- Read-ahead never evicts a shard needed sooner than the one it fetches, and never waits for room;
  the reader of the current batch does wait (pins of other batches go away as their reads end).

Threads: `acquire`/`release` may be called from many threads. Downloads run on `fetchers` threads
(read-ahead) and in the calling thread (a shard not fetched ahead yet).
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import hashlib
import json
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gdsload.errors import CacheFullError  # noqa: F401 (re-exported: defined in errors.py)
from gdsload.errors import CorruptDataError, GdsloadError, StorageError
from gdsload.format import manifest as mf
from gdsload.io.fsspec_backend import is_checksum_error
from gdsload.io.store import url_to_fs

_NEVER = float("inf")
_SPACE_LOCK = ".space.lock"
_LOG = "fetch.log"
_MANIFESTS = "manifests"
_USERS = "users"
_LOG_CAP = 64 * 1024  # fetch.log's most (and at most limit / 64): its newest lines are kept
_LOG_LINE = 256  # a fetch.log line's most (the shard name is cut to fit)
_TMP = ".tmp-"  # in the name of a metadata file being written (under the space lock)


def manifest_copy(folder: str | os.PathLike[str], root: str) -> Path:
    """Where the cache folder `folder` keeps the copy of the manifest of the dataset at `root`
    (a URL): `manifests/<hash of the URL>.json`."""
    return Path(folder) / _MANIFESTS / f"{hashlib.sha256(root.rstrip('/').encode()).hexdigest()[:32]}.json"


def _write_atomic(path: Path, data: bytes) -> None:
    """`data` at `path` through a temporary name and a rename (not fsynced: a torn index copy is
    read again from the store). Call with the space lock held: a temporary file seen under it is a
    dead writer's (`_usage` removes it)."""
    tmp = path.with_name(f".{path.name}{_TMP}{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _drop_stale_lock(path: str) -> bool:
    """Unlink a shard's lock file nobody holds (True; also when it is gone): an exclusive
    non-blocking flock, then, holding it, the check that the file is still the one at that name.
    A holder's lock (any process, this one's other threads too: each opens its own) is left."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                os.unlink(path)
        except FileNotFoundError:
            pass
        return True
    finally:
        os.close(fd)


def _manifest_shards(path: str) -> set[str] | None:
    """The SHA-256s of the shards a manifest copy lists (None: it does not parse)."""
    try:
        with open(path, "rb") as f:
            return {str(s["sha256"]) for s in json.loads(f.read())["shards"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _Folder:
    """What the folder holds, as `ShardCache._usage` counted it (under the space lock)."""

    __slots__ = ("used", "shards", "indexes", "manifests", "log")

    def __init__(self) -> None:
        self.used = 0  # bytes of every file (a .part at what it reserved)
        self.shards: dict[str, int] = {}  # complete shards: SHA-256 -> bytes
        self.indexes: dict[str, tuple[int, float]] = {}  # index copies beside them: SHA-256 -> (bytes, mtime)
        self.manifests: dict[str, tuple[int, float]] = {}  # manifest copies: path -> (bytes, mtime)
        self.log = 0  # bytes of fetch.log


class _Room:
    """What a download reserved beside its shard: the index copy to write with it (None: not
    loaded yet, or no room), and bytes left for its fetch.log lines."""

    __slots__ = ("index", "log")

    def __init__(self, index: bytes | None, log: int) -> None:
        self.index = index
        self.log = log


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/gdsload/shards`, else `~/.cache/gdsload/shards`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gdsload" / "shards"


def _human(n: int) -> str:
    if n < 10**6:
        return f"{n / 1e3:.1f} kB"
    return f"{n / 1e6:.1f} MB" if n < 10**9 else f"{n / 1e9:.2f} GB"


class ShardCache:
    """Whole shards of the dataset at `root` (a URL) in the local folder `folder`, at most
    `limit_bytes` of them (see the module docstring).

    `shards` are the manifest entries (name, bytes, sha256). `retries` network failures per shard
    are retried with exponential backoff from `backoff_s`; a shard whose bytes do not match the
    manifest is fetched once more, then a `CorruptDataError` names it. `wait_timeout_s`: how long
    the reader of a batch waits for room held by other processes' pins before giving up.
    `on_release(path)` is called when this process stops using a cached file (no batch pins it),
    so an I/O backend can close its descriptor and an eviction really frees the space.
    `index_bytes(shard)`: the bytes of that shard's index where this process has it loaded (else
    None), kept beside the cached shard as `<sha256>.idx`; `manifest_bytes`: the dataset's manifest
    as read from the store (None: not read from it), kept as `manifest_copy(folder, root)` from
    `check_limit` on. Both are what a restart with the store down opens (`gdsload.dataset.sharded`);
    both count in `limit_bytes`.

    The plan is read a bounded number of batches ahead (`start_epoch`): at least `horizon_min`
    (max(64, 4 x fetchers)) batches past the cursor, more until the shards needed ahead exceed
    `limit_bytes`, at most `horizon_max` (4096, or `horizon_min` where more).
    """

    _TRAIL = 64  # batches behind the cursor kept in the window (a reader that claimed one may open it late)

    def __init__(
        self,
        root: str,
        shards: Sequence[mf.ShardEntry],
        folder: str | os.PathLike[str],
        limit_bytes: int,
        *,
        fetchers: int = 4,
        retries: int = 3,
        backoff_s: float = 0.2,
        wait_timeout_s: float = 120.0,
        on_release: Callable[[str], None] | None = None,
        index_bytes: Callable[[int], bytes | None] | None = None,
        manifest_bytes: bytes | None = None,
    ) -> None:
        if limit_bytes < 1:
            raise GdsloadError(f"cache_limit must be a positive number of bytes, got {limit_bytes}")
        self.root = root.rstrip("/")
        self.shards = list(shards)
        self.folder = Path(folder)
        self.limit_bytes = int(limit_bytes)
        self.fetchers = max(1, fetchers)
        self.retries = retries
        self.backoff_s = backoff_s
        self.wait_timeout_s = wait_timeout_s
        self.on_release = on_release
        self._index_bytes = index_bytes
        self._manifest_bytes = manifest_bytes
        self._index_sizes: dict[int, int] = {}  # shard -> bytes of its index copy, once made
        self._by_sha = {s["sha256"]: i for i, s in enumerate(self.shards)}
        self._manifests_read: dict[str, tuple[tuple[int, float], set[str] | None]] = {}  # `_make_room`
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._space_fd = os.open(self.folder / _SPACE_LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot use {self.folder} as the shard cache: {exc.strerror or exc}") from exc
        self._fs: Any = None
        self._user_fd: int | None = None  # this process's entry in users/ (see `check_limit`)
        self._user_name = ""
        self._need = 0  # what its window needs (bytes), as registered
        self._wanted: list[str] = []  # the shards it last said it needs next (`_publish_wanted`)
        self._lock = threading.RLock()  # pins, schedule, stats; also serialises space reservations
        self._changed = threading.Condition(self._lock)  # a pin was released, the cursor moved
        self._miss = threading.Lock()  # one reader at a time assembles a batch with missing shards
        self._pins: dict[int, list[int]] = {}  # shard -> [fd holding LOCK_SH, count]
        self._open: dict[int, list[int]] = {}  # batch seq -> shards it pinned
        # the window of batches of this epoch whose shards are known (`start_epoch`, `_extend`)
        self.horizon_min = max(64, 4 * self.fetchers)  # batches past the cursor, at least
        self.horizon_max = max(self.horizon_min, 4096)  # and at most
        self._batches: Sequence[Sequence[int]] = ()
        self._n = 0
        self._end = 0  # the first batch not read into the window
        self._window: deque[tuple[int, list[int]]] = deque()  # (seq, its shards), in order
        self._uses: dict[int, list[int]] = {}  # shard -> batch seqs in the window that need it
        self._seen: set[int] = set()  # shards that entered the window this epoch (`on_shards`)
        self._on_shards: Callable[[list[int]], Any] | None = None
        self._cursor = 0
        self._inflight: set[int] = set()
        self._errors: dict[int, BaseException] = {}
        self._generation = 0
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._stats = {"hits": 0, "misses": 0, "fetches": 0, "bytes_fetched": 0, "fetch_wait_s": 0.0,
                       "evictions": 0, "readahead_depth": 0, "max_readahead_depth": 0, "retries": 0}

    # -- paths --------------------------------------------------------------------------------
    def path(self, shard: int) -> str:
        """Where the complete copy of `shard` lives (whether or not it is there now)."""
        return str(self.folder / f"{self.shards[shard]['sha256']}.tar")

    def _lock_path(self, shard: int) -> Path:
        return self.folder / f"{self.shards[shard]['sha256']}.lock"

    def _lock_shard(self, shard: int) -> int:
        """Take `shard`'s download lock (waiting for a holder): a descriptor holding an exclusive
        flock on the lock file that is at its name now. A holder unlinks the file before it lets
        go (`_unlock_shard`), so a waiter may wake up holding a file no longer there: it then
        tries again on the one at the name (created anew where none is)."""
        path = self._lock_path(shard)
        while True:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # another process downloading it: wait for it
                try:
                    if os.fstat(fd).st_ino == os.stat(path).st_ino:
                        return fd
                except FileNotFoundError:
                    pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def _unlock_shard(self, shard: int, fd: int) -> None:
        """Unlink `shard`'s lock file, then let go of it: only the holder of the file at the name
        unlinks it, and one who waited on it finds it gone (`_lock_shard`), so no two processes
        hold it at once and no lock file is left once nobody downloads the shard."""
        try:
            os.unlink(self._lock_path(shard))
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)

    def _remote(self, shard: int) -> str:
        return f"{self.root}/{self.shards[shard]['name']}"

    def _present(self, shard: int) -> bool:
        return os.path.exists(self.path(shard))

    # -- the schedule ---------------------------------------------------------------------------
    def check_limit(self, window: int) -> None:
        """Refuse a limit below the `window` largest shards: the plan keeps up to `window` shards
        open at once, so a smaller cache would fetch each shard many times over (or stall).

        The folder is shared: this process registers what it needs (`users/<pid>-<n>`, held
        with an exclusive flock while the cache is open, so a dead process's entry is seen as
        stale), and the limit must hold the needs of every process registered there now; the
        last to come is refused, naming the smallest limit for them all. The shards of one
        process's window then always fit beside the others' windows."""
        sizes = sorted((s["bytes"] for s in self.shards), reverse=True)[: max(1, window)]
        need = sum(sizes)
        if self.limit_bytes < need:
            raise CacheFullError(
                f"cache_limit {_human(self.limit_bytes)} is smaller than the {len(sizes)} largest "
                f"shards of {self.root} ({_human(need)}), which shuffle_window={window} keeps open at "
                f"once; raise cache_limit to at least {need} bytes or lower shuffle_window"
            )
        with self._lock:
            fcntl.flock(self._space_fd, fcntl.LOCK_EX)
            try:
                others = self._users()
                total = need + sum(others)
                if total > self.limit_bytes:
                    n = len(others) + 1
                    raise CacheFullError(
                        f"cache_limit {_human(self.limit_bytes)} cannot serve the {n} processes using the "
                        f"shard cache {self.folder} at once: each keeps up to shuffle_window shards open "
                        f"(this one the {len(sizes)} largest of {self.root}, {_human(need)}; the others "
                        f"{', '.join(_human(b) for b in others)}); raise cache_limit to at least {total} bytes "
                        f"for {n} processes, or give each job its own cache_dir"
                    )
                self._register(need)
                self._keep_manifest()
                _, folder = self._make_room(None, 0, foreground=True)  # metadata written since
                self._keep_indexes(folder)
            finally:
                fcntl.flock(self._space_fd, fcntl.LOCK_UN)

    def _keep_manifest(self) -> None:
        """Write the dataset's manifest as read from the store to its copy in the folder (unless
        the copy holds it already); call with both locks held (the caller then makes room)."""
        if self._manifest_bytes is None:
            return
        path = manifest_copy(self.folder, self.root)
        try:
            if path.is_file() and path.read_bytes() == self._manifest_bytes:
                return
            path.parent.mkdir(exist_ok=True)
            _write_atomic(path, self._manifest_bytes)
        except OSError:  # a folder we cannot write: no copy, as without one
            pass

    def _users(self) -> list[int]:
        """The needs (bytes) of the other live processes registered in the folder; entries of
        dead ones are removed. Call with the space lock held."""
        return [need for need, _ in self._others()]

    def _others(self) -> list[tuple[int, set[str]]]:
        """Per other live process registered in the folder: its need (bytes) and the shards (by
        SHA-256) it says it needs next; entries of dead ones are removed. An entry is the need on
        its first line, then one SHA-256 a line (`_publish_wanted`)."""
        needs: list[tuple[int, set[str]]] = []
        users = self.folder / _USERS
        try:
            entries = list(os.scandir(users))
        except FileNotFoundError:
            return needs
        for e in entries:
            if self._user_fd is not None and e.name == self._user_name:
                continue
            try:
                fd = os.open(e.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:  # held: a live process
                    lines = os.pread(fd, 1 << 20, 0).decode(errors="replace").split("\n")
                    try:
                        needs.append((int(lines[0] or 0), {x for x in lines[1:] if len(x) == 64}))
                    except ValueError:
                        pass
                    continue
                os.unlink(e.path)  # nobody holds it: its process is gone
            finally:
                os.close(fd)
        return needs

    def _publish_wanted(self) -> None:
        """Write to this process's entry the shards it needs next, in order of next use, as many
        as its need (bytes) holds: other processes evict those last (they may still, for room
        the batch they read needs). Without it each process evicted by its own plan, which is
        the others' next shards when one runs ahead (four processes fetched 5x the shards).
        Call with the lock held."""
        if self._user_fd is None:
            return
        c = self._cursor
        ahead = sorted((s for s in self._uses if self._next_use(s, c) != _NEVER),
                       key=lambda s: self._next_use(s, c))
        wanted, total = [], 0
        for sh in ahead:
            total += self.shards[sh]["bytes"]
            if total > self._need:
                break
            wanted.append(self.shards[sh]["sha256"])
        if wanted == self._wanted:
            return
        self._wanted = wanted
        data = "\n".join([str(self._need), *wanted]).encode()
        os.pwrite(self._user_fd, data, 0)
        os.ftruncate(self._user_fd, len(data))

    def _register(self, need: int) -> None:
        self._need = need
        if self._user_fd is not None:  # again (a new epoch, another window): update the need
            os.ftruncate(self._user_fd, 0)
            os.pwrite(self._user_fd, str(need).encode(), 0)
            self._wanted = []
            return
        users = self.folder / _USERS
        users.mkdir(exist_ok=True)
        self._user_name = f"{os.getpid()}-{id(self)}"
        fd = os.open(users / self._user_name, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, str(need).encode(), 0)
        self._user_fd = fd

    def _unregister(self) -> None:
        if self._user_fd is not None:
            try:
                os.unlink(self.folder / _USERS / self._user_name)
            except FileNotFoundError:
                pass
            os.close(self._user_fd)
            self._user_fd = None

    def start_epoch(self, batches: Sequence[Sequence[int]],
                    on_shards: Callable[[list[int]], Any] | None = None) -> None:
        """The shards each batch of this epoch needs, in the order the batches are read (batch
        `seq` is `batches[seq]`); starts the read-ahead threads.

        `batches` is kept as the (lazy) sequence it is and indexed only over a sliding window of
        upcoming batches (`_extend`): from the cursor, at least `horizon_min` batches, then more
        until the distinct shards needed ahead exceed `limit_bytes` (what read-ahead could hold
        at once), at most `horizon_max` batches; the window moves with the cursor, keeping
        `_TRAIL` batches behind it (a reader may still open one of those). Memory and time are
        O(window), not O(batches): an epoch of 4x10^7 batches starts at once. Eviction ranks a
        shard with no use inside the window as never used again (furthest), so Belady's rule is
        exact within the window only. A batch whose shards cannot fit in `limit_bytes` is refused
        with `CacheFullError`: those of the first window here, before anything starts; a later
        one when it is read (`acquire`), with the same message.

        `on_shards(shards)`: called (with the lock held: it must not block) with the shards that
        enter the window for the first time this epoch, in order of first use (the loader starts
        loading their indexes)."""
        n = len(batches)
        first = min(n, self.horizon_min)
        for seq in range(first):
            self._check_batch(batches[seq])
        self.stop()
        with self._lock:
            self._generation += 1
            self._batches = batches
            self._n = n
            self._end = 0
            self._window.clear()
            self._uses = {}
            self._seen = set()
            self._on_shards = on_shards
            self._cursor = 0
            self._extend()
            self._publish_wanted()
            self._errors.clear()
            gen = self._generation
            self._threads = [threading.Thread(target=self._read_ahead, args=(gen,), daemon=True,
                                              name=f"gdsload-cache-{i}") for i in range(self.fetchers)]
        for t in self._threads:
            t.start()

    def _check_batch(self, shards: Sequence[int]) -> None:
        """`CacheFullError` where one batch's `shards` cannot fit in `limit_bytes` at once."""
        need = sum(self.shards[int(s)]["bytes"] for s in dict.fromkeys(int(s) for s in shards))
        if need > self.limit_bytes:
            raise CacheFullError(
                f"cache_limit {_human(self.limit_bytes)} cannot hold the shards one batch reads "
                f"({_human(need)}); raise cache_limit or lower batch_size"
            )

    def _extend(self) -> None:
        """Move the window of batches whose shard uses are known (`start_epoch`) to the cursor:
        drop the batches more than `_TRAIL` behind it, and read batches into it until it reaches
        `horizon_min` batches past the cursor and the shards needed from the cursor on exceed
        `limit_bytes`, or `horizon_max` batches past the cursor, or the epoch's end. Call with
        the lock held."""
        c = self._cursor
        low = max(0, c - self._TRAIL)
        window, uses = self._window, self._uses
        while window and window[0][0] < low:
            seq, shards = window.popleft()
            for s in shards:
                lst = uses[s]
                del lst[0]  # `seq`: the lowest use left (batches are dropped in order)
                if not lst:
                    del uses[s]
        if self._end < low:  # the cursor passed the window's end: nothing before `low` is needed
            self._end = low
        cap = min(self._n, c + self.horizon_max)
        if self._end >= cap:
            return
        least = min(self._n, c + self.horizon_min)
        sizes = self.shards
        ahead = sum(sizes[s]["bytes"] for s, lst in uses.items() if lst[-1] >= c)
        fresh: list[int] = []
        while self._end < cap and (self._end < least or ahead <= self.limit_bytes):
            seq = self._end
            shards = list(dict.fromkeys(int(s) for s in self._batches[seq]))
            for s in shards:
                lst = uses.get(s)
                if lst is None:
                    lst = uses[s] = []
                    if s not in self._seen:
                        self._seen.add(s)
                        fresh.append(s)
                if seq >= c and (not lst or lst[-1] < c):
                    ahead += sizes[s]["bytes"]
                lst.append(seq)
            window.append((seq, shards))
            self._end = seq + 1
        if fresh and self._on_shards is not None:
            try:
                self._on_shards(fresh)
            except Exception:  # noqa: BLE001 - loading indexes early is an extra, never a failure
                pass

    def _next_use(self, shard: int, after: int) -> float:
        """The first batch at or after `after` that needs `shard` within the window (inf: none
        there: not needed this epoch, or only past the window's end)."""
        uses = self._uses.get(shard)
        if not uses:
            return _NEVER
        i = bisect.bisect_left(uses, after)
        return uses[i] if i < len(uses) else _NEVER

    def _move_cursor(self) -> None:
        """The cursor is the lowest batch still being read (or the one after the last read)."""
        low = min(self._open) if self._open else None
        if low is not None and low != self._cursor:
            self._cursor = low
            self._extend()
            self._publish_wanted()
            self._changed.notify_all()

    # -- the reader's side ------------------------------------------------------------------------
    def acquire(self, seq: int, shards: Sequence[int]) -> dict[int, str]:
        """Local paths of `shards` for batch `seq`, pinned until `release(seq)`; waits for (or
        does) the downloads still missing."""
        shards = list(dict.fromkeys(int(s) for s in shards))
        self._check_batch(shards)  # those past the first window are checked here (`start_epoch`)
        with self._lock:
            self._open[seq] = []
            self._move_cursor()
        t0 = time.perf_counter()
        missing = [s for s in shards if not self._pin(seq, s)]
        if missing:
            # Wait holding no pin: readers waiting here in line while each pinned a shard could
            # hold, between them, all the room the one downloading needs (seen with 3 readers and
            # room for window + 1 shards: CacheFullError after 120 s). In line, this reader pins
            # its shards one by one; the pins others hold are then only those of batches being
            # read, which come free. All or nothing: where one of its shards finds no room, it
            # drops the pins it took and tries again later. Pinning some while waiting for room
            # for the rest deadlocked processes sharing a folder: four of them, each holding a
            # shard or two of its batch, held all the room between them.
            self._unpin(seq)
            with self._miss:
                deadline = time.monotonic() + self.wait_timeout_s
                while not self._pin_all(seq, shards):
                    self._unpin(seq)
                    if time.monotonic() > deadline:
                        self.release(seq)
                        raise CacheFullError(
                            f"no room in the shard cache {self.folder} (limit {_human(self.limit_bytes)}) for "
                            f"the shards of one batch after {self.wait_timeout_s:.0f} s: the shards there "
                            f"are in use (by this or other processes); raise cache_limit")
                    with self._lock:
                        self._changed.wait(0.05)  # pins of this process come free; others' by polling
            wait = time.perf_counter() - t0
        with self._lock:
            self._stats["hits"] += len(shards) - len(missing)
            self._stats["misses"] += len(missing)
            if missing:
                self._stats["fetch_wait_s"] += wait
        return {s: self.path(s) for s in shards}

    def _pin_all(self, seq: int, shards: Sequence[int]) -> bool:
        """Pin every one of `shards` for batch `seq`, downloading the missing ones; False (some
        pinned) where one finds no room now."""
        for s in shards:
            if self._pin(seq, s):
                continue
            err = self._errors.get(s)
            if isinstance(err, CorruptDataError):
                self.release(seq)
                raise err
            try:
                done = self._try_download(s, foreground=True)
            except BaseException:
                self.release(seq)
                raise
            if done is None or not self._pin(seq, s):  # no room, or evicted since it arrived
                return False
        return True

    def release(self, seq: int) -> None:
        """Batch `seq` has finished reading: unpin its shards."""
        with self._lock:
            for s in self._open.pop(seq, ()):
                self._drop_pin(s)
            if self._open:
                self._move_cursor()
            elif seq + 1 > self._cursor:
                self._cursor = seq + 1
                self._extend()
                self._publish_wanted()
            self._changed.notify_all()

    def _unpin(self, seq: int) -> None:
        """Drop batch `seq`'s pins, keeping it open (the cursor stays at it)."""
        with self._lock:
            shards = self._open.get(seq, [])
            self._open[seq] = []
            for s in shards:
                self._drop_pin(s)
            self._changed.notify_all()

    def _drop_pin(self, s: int) -> None:
        pin = self._pins[s]
        pin[1] -= 1
        if pin[1] == 0:
            del self._pins[s]
            if self.on_release is not None:
                self.on_release(self.path(s))
            os.close(pin[0])  # drops the shared flock: evictable again

    def _pin(self, seq: int, shard: int) -> bool:
        """Pin the complete copy of `shard` for batch `seq`; False when there is none."""
        with self._lock:
            pin = self._pins.get(shard)
            if pin is None:
                path = self.path(shard)
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    return False
                fcntl.flock(fd, fcntl.LOCK_SH)  # an evictor holds LOCK_EX only while it unlinks
                try:
                    same = os.fstat(fd).st_ino == os.stat(path).st_ino
                except FileNotFoundError:
                    same = False
                if not same:  # evicted between the open and the lock
                    os.close(fd)
                    return False
                pin = self._pins[shard] = [fd, 0]
            pin[1] += 1
            self._open.setdefault(seq, []).append(shard)
            return True

    # -- read-ahead -----------------------------------------------------------------------------
    def _read_ahead(self, gen: int) -> None:
        while True:
            with self._lock:
                if self._closed or gen != self._generation:
                    return
                shard, depth = self._pick()
                if shard is None:
                    self._changed.wait(0.5)
                    continue
                self._inflight.add(shard)
                cursor = self._cursor
            fetched = False
            try:
                fetched = self._download(shard, foreground=False)
            except BaseException as exc:  # handed to the reader that needs this shard
                with self._lock:
                    self._errors[shard] = exc
            finally:
                with self._lock:
                    self._inflight.discard(shard)
                    self._stats["readahead_depth"] = depth + int(fetched)
                    self._stats["max_readahead_depth"] = max(self._stats["max_readahead_depth"], depth + int(fetched))
                    if not fetched and gen == self._generation and not self._closed:
                        while cursor == self._cursor and not self._closed and gen == self._generation:
                            if not self._changed.wait(0.5):  # room may come from other processes
                                break

    def _pick(self) -> tuple[int | None, int]:
        """The next shard to fetch ahead (in order of next use) and how many upcoming shards are
        cached ahead of it; call with the lock held."""
        c = self._cursor
        ahead = [s for s in self._uses if self._next_use(s, c) != _NEVER]
        ahead.sort(key=lambda s: self._next_use(s, c))
        depth = 0
        reserved = 0
        for s in ahead:
            reserved += self.shards[s]["bytes"]
            if reserved > self.limit_bytes:  # beyond what the cache can hold at once
                break
            if s in self._errors or s in self._inflight:
                continue
            if self._present(s):
                depth += 1
                continue
            return s, depth
        return None, depth

    # -- downloads --------------------------------------------------------------------------------
    def _download(self, shard: int, *, foreground: bool) -> bool:
        """Make `shard` complete in the folder; False when read-ahead found no room for it.

        The shard's lock is held only while its download runs, never while waiting for room: a
        reader that held it while it waited (for room that the pins of other processes held)
        stalled every process that needed the same shard, themselves holding room (four
        processes sharing a folder hung for minutes)."""
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            done = self._try_download(shard, foreground=foreground)
            if done is not None:
                return done
            if not foreground:
                return False
            if time.monotonic() > deadline:
                entry = self.shards[shard]
                raise CacheFullError(
                    f"no room in the shard cache {self.folder} (limit {_human(self.limit_bytes)}) "
                    f"for shard {entry['name']} ({_human(entry['bytes'])}) after {self.wait_timeout_s:.0f} s: "
                    f"the shards there are in use (by this or other processes); raise cache_limit"
                )
            with self._lock:
                self._changed.wait(0.05)  # pins of this process come free; others' by polling

    def _try_download(self, shard: int, *, foreground: bool) -> bool | None:
        """One try of `_download`: None where there is no room for `shard` now."""
        entry = self.shards[shard]
        lock_fd = self._lock_shard(shard)
        try:
            if self._present(shard):
                return True
            err = self._errors.get(shard)
            if isinstance(err, CorruptDataError):  # fetched twice already (by read-ahead)
                raise err
            for stale in self.folder.glob(f"{entry['sha256']}.tar.part-*"):  # we hold its lock
                stale.unlink(missing_ok=True)
            got = self._reserve(shard, foreground=foreground)
            if got is None:
                return None
            part, room = got
            try:
                self._fetch_verified(shard, part, room)
                self._publish(part, shard, room)
            except BaseException as exc:
                part.unlink(missing_ok=True)
                if isinstance(exc, CorruptDataError):  # before the shard's lock is released, so
                    with self._lock:  # whoever waits on it next takes this answer, not a 3rd fetch
                        self._errors[shard] = exc
                raise
            with self._lock:
                self._errors.pop(shard, None)
                self._stats["fetches"] += 1
                self._stats["bytes_fetched"] += entry["bytes"]
            return True
        finally:
            self._unlock_shard(shard, lock_fd)

    def _fetch_verified(self, shard: int, part: Path, room: _Room) -> None:
        """Download into `part`, retrying network faults; a hash or size mismatch is fetched once
        more, then a `CorruptDataError`."""
        entry = self.shards[shard]
        url = self._remote(shard)
        for attempt in range(2):
            t0 = time.perf_counter()
            size, digest = self._fetch(url, part)
            ok = size == entry["bytes"] and digest == entry["sha256"]
            transit = digest.startswith("transit:")
            self._log_fetch(f"{time.time():.3f} {os.getpid()} {entry['name'][:160]} {size} "
                            f"{time.perf_counter() - t0:.3f} {'ok' if ok else 'corrupt'}\n", room)
            if ok:
                return
            problem = (digest.removeprefix("transit:") if transit
                       else f"size is {size} bytes, manifest says {entry['bytes']}" if size != entry["bytes"]
                       else f"SHA-256 is {digest[:16]}..., manifest says {entry['sha256'][:16]}...")
        raise CorruptDataError(f"shard {entry['name']} at {url} does not match the manifest ({problem}; "
                               f"fetched twice); the stored object is corrupt or was rewritten"
                               + (", or bytes are damaged on the way from the store" if transit else ""))

    def _log_fetch(self, line: str, room: _Room) -> None:
        """Append a line to fetch.log, under the space lock (appends and trims of all processes
        are serialised). The log keeps its newest lines: past min(64 kB, limit / 64) the older
        half goes; where the download's reservation has no room left for the line, older lines
        go so that the log grows by nothing (a line that still does not fit is left out)."""
        data = line.encode()[:_LOG_LINE]
        cap = max(_LOG_LINE, min(_LOG_CAP, self.limit_bytes // 64))
        with self._lock:
            fcntl.flock(self._space_fd, fcntl.LOCK_EX)
            try:
                fd = os.open(self.folder / _LOG, os.O_CREAT | os.O_RDWR | os.O_APPEND | os.O_CLOEXEC, 0o644)
                try:
                    size = os.fstat(fd).st_size
                    most = cap if len(data) <= room.log else min(cap, size)  # its size after this line
                    if size + len(data) > most:
                        old = os.pread(fd, size, 0)
                        keep = max(0, min(most, cap // 2) - len(data))
                        tail = old[len(old) - keep:] if keep else b""
                        if len(tail) < len(old) and b"\n" in tail:  # whole lines only
                            tail = tail[tail.index(b"\n") + 1:]
                        elif len(tail) < len(old):
                            tail = b""
                        os.ftruncate(fd, 0)
                        os.write(fd, tail)
                        size = len(tail)
                    if size + len(data) <= most:
                        os.write(fd, data)  # O_APPEND
                        if len(data) <= room.log:
                            room.log -= len(data)
                finally:
                    os.close(fd)
            except OSError:  # a log we cannot write is no reason to fail a download
                pass
            finally:
                fcntl.flock(self._space_fd, fcntl.LOCK_UN)

    def _fetch(self, url: str, part: Path) -> tuple[int, str]:
        """One whole-object GET streamed into `part` (retried with backoff); (bytes, SHA-256).
        A response whose checksum the client library found wrong (botocore's
        `FlexibleChecksumError`: bytes damaged in transit) gives `(bytes, "transit: ...")`, which
        `_fetch_verified` counts as a corrupt fetch; any other failure (OSError, or the client
        library's own connection errors) is retried, then a `StorageError` naming the URL."""
        if self._fs is None:
            self._fs = url_to_fs(self.root)[0]
        fs = self._fs
        path = fs._strip_protocol(url)
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                fs.get_file(path, str(part))
                break
            except FileNotFoundError as exc:
                raise StorageError(f"shard {url} is missing from the store: {exc}") from exc
            except GdsloadError:
                raise
            except Exception as exc:  # noqa: BLE001 - botocore's errors are no OSError
                if is_checksum_error(exc):
                    return part.stat().st_size if part.exists() else 0, f"transit: {type(exc).__name__}: {exc}"
                if attempt == self.retries:
                    raise StorageError(f"cannot fetch shard {url} after {attempt + 1} tries: {exc}") from exc
                with self._lock:
                    self._stats["retries"] += 1
                time.sleep(delay)
                delay *= 2
        h = hashlib.sha256()
        size = 0
        with open(part, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
                size += len(chunk)
            os.fsync(f.fileno())  # the rename must never publish bytes a power cut could lose
        return size, h.hexdigest()

    # -- space ----------------------------------------------------------------------------------
    def _reserve(self, shard: int, *, foreground: bool) -> tuple[Path, _Room] | None:
        """Evict until `shard` fits, then create its .part (all under the folder-wide lock);
        None where there is no room now (the caller waits holding no shard lock). The .part's
        name reserves, beside the shard, its index copy and two fetch.log lines where they fit
        in the room left (they never evict anything); into what is left after that go the index
        copies of shards here that have none (`_keep_indexes`)."""
        entry = self.shards[shard]
        index = self._index_of(shard)
        with self._lock:
            fcntl.flock(self._space_fd, fcntl.LOCK_EX)
            try:
                ok, folder = self._make_room(shard, entry["bytes"], foreground=foreground)
                if not ok:
                    return None
                free = self.limit_bytes - folder.used - entry["bytes"]
                if index is not None and len(index) > free:
                    index = None
                free -= len(index) if index is not None else 0
                log = 2 * _LOG_LINE if free >= 2 * _LOG_LINE else 0
                nbytes = entry["bytes"] + (len(index) if index is not None else 0) + log
                part = self.folder / f"{entry['sha256']}.tar.part-{nbytes}-{os.getpid()}-{threading.get_ident()}"
                part.touch()
                folder.used += nbytes
                self._keep_indexes(folder)
                return part, _Room(index, log)
            finally:
                fcntl.flock(self._space_fd, fcntl.LOCK_UN)

    def _index_of(self, shard: int) -> bytes | None:
        """The bytes of `shard`'s index where this process has it (`index_bytes`), else None."""
        if self._index_bytes is None:
            return None
        try:
            data = self._index_bytes(shard)
        except Exception:  # noqa: BLE001 - a copy is an extra: never a reason to fail a read
            return None
        if data is not None:
            self._index_sizes[shard] = len(data)
        return data

    def _publish(self, part: Path, shard: int, room: _Room) -> None:
        """Rename a verified .part to its shard's name under the folder-wide space lock (a
        reservation that listed the folder during the rename could see neither name, the .part
        gone, the new name not yet read, and count the shard as free space), and write its index
        copy into the room the .part reserved for it."""
        sha = self.shards[shard]["sha256"]
        with self._lock:
            fcntl.flock(self._space_fd, fcntl.LOCK_EX)
            try:
                os.replace(part, self.path(shard))
                if room.index is not None:
                    try:
                        _write_atomic(self.folder / f"{sha}.idx", room.index)
                    except OSError:
                        pass
            finally:
                fcntl.flock(self._space_fd, fcntl.LOCK_UN)

    def _keep_indexes(self, folder: _Folder) -> None:
        """Write the index copies of this dataset's shards that are here without one, as far as
        they fit in free room (they never evict anything); call with both locks held."""
        if self._index_bytes is None:
            return
        for sha in list(folder.shards):
            i = self._by_sha.get(sha)
            if i is None or sha in folder.indexes:
                continue
            known = self._index_sizes.get(i)
            if known is not None and folder.used + known > self.limit_bytes:
                continue
            data = self._index_of(i)
            if data is None or folder.used + len(data) > self.limit_bytes:
                continue
            try:
                _write_atomic(self.folder / f"{sha}.idx", data)
            except OSError:
                return
            folder.used += len(data)
            folder.indexes[sha] = (len(data), time.time())

    def _usage(self) -> _Folder:
        """Every file in the folder and its bytes (a .part at what it reserved, when more than
        it holds yet). On the way (call with the space lock held), what nobody needs goes: a
        stale .part (its shard's lock is free or gone), a lock file nobody holds, a temporary
        file of a metadata write (its writer died: they write under this lock), an index copy
        whose shard is not here (useless offline, where that shard cannot be read either)."""
        f = _Folder()
        top = str(self.folder)
        for dirpath, _, names in os.walk(top):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                if name.startswith(".") and _TMP in name:
                    Path(path).unlink(missing_ok=True)
                    continue
                if dirpath == top:
                    if name.endswith(".tar"):
                        f.shards[name[: -len(".tar")]] = st.st_size
                    elif ".tar.part-" in name:
                        sha, _, rest = name.partition(".tar.part-")
                        if self._is_stale(sha):
                            Path(path).unlink(missing_ok=True)
                            continue
                        try:
                            f.used += max(int(rest.split("-")[0]), st.st_size)
                        except ValueError:
                            f.used += st.st_size
                        continue
                    elif name.endswith(".lock") and name != _SPACE_LOCK:
                        if _drop_stale_lock(path):
                            continue
                    elif name.endswith(".idx"):
                        f.indexes[name[: -len(".idx")]] = (st.st_size, st.st_mtime)
                    elif name == _LOG:
                        f.log = st.st_size
                elif dirpath == os.path.join(top, _MANIFESTS) and name.endswith(".json"):
                    f.manifests[path] = (st.st_size, st.st_mtime)
                elif dirpath == os.path.join(top, _USERS):
                    continue  # the one thing not counted (see the module docstring)
                f.used += st.st_size
        for sha in [s for s in f.indexes if s not in f.shards]:
            Path(top, f"{sha}.idx").unlink(missing_ok=True)
            f.used -= f.indexes.pop(sha)[0]
        return f

    def _is_stale(self, sha: str) -> bool:
        """A .part of `sha` nobody downloads: its lock file is gone, or nobody holds it (a
        download in progress holds the lock file at the name: only its holder unlinks it)."""
        try:
            fd = os.open(self.folder / f"{sha}.lock", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        finally:
            os.close(fd)

    def _make_room(self, shard: int | None, need: int, *, foreground: bool) -> tuple[bool, _Folder]:
        """Evict until `need` more bytes fit; call with both locks held. Whether they fit, and the
        folder as it is then. In order: manifest copies of datasets none of whose shards is here
        or wanted next by another process (not this dataset's own); complete shards, furthest
        next use first (each with its index copy), read-ahead never evicting one needed no later
        than `shard`; then, for a reader waiting for its batch (`foreground`) only, the index
        copies of the shards that stay, fetch.log and the other manifest copies, this dataset's
        last. `shard` None: room for no shard in particular (as a reader's)."""
        folder = self._usage()
        if folder.used + need <= self.limit_bytes:
            return True, folder
        c = self._cursor
        mine = _NEVER if shard is None else self._next_use(shard, c)
        wanted = set().union(*(w for _, w in self._others()))  # by other processes, next
        own = str(manifest_copy(self.folder, self.root))

        def fits() -> bool:
            return folder.used + need <= self.limit_bytes

        def drop(path: str, nbytes: int) -> None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            folder.used -= nbytes

        for path, (nb, mtime) in sorted(folder.manifests.items(), key=lambda kv: kv[1][1]):
            if path == own:
                continue
            seen = self._manifests_read.get(path)
            if seen is None or seen[0] != (nb, mtime):  # each copy parsed once (while unchanged)
                seen = self._manifests_read[path] = ((nb, mtime), _manifest_shards(path))
            shas = seen[1]
            if shas is not None and not shas.isdisjoint(folder.shards.keys() | wanted):
                continue
            drop(path, nb)
            del folder.manifests[path]
            if fits():
                return True, folder

        def key(sha: str) -> float:
            i = self._by_sha.get(sha)
            return _NEVER if i is None else self._next_use(i, c)
        # those no other process needs next first, each group furthest next use (ours) first
        for sha in sorted(folder.shards, key=lambda s: (s not in wanted, key(s)), reverse=True):
            if not foreground and (key(sha) <= mine or sha in wanted):
                continue
            i = self._by_sha.get(sha)
            if i is not None and i in self._pins:
                continue
            if self._evict(sha, folder) and fits():
                return True, folder
        if not foreground:
            return False, folder
        for sha, (nb, _) in sorted(folder.indexes.items(), key=lambda kv: kv[1][1]):
            drop(os.path.join(self.folder, f"{sha}.idx"), nb)
            del folder.indexes[sha]
            if fits():
                return True, folder
        if folder.log:
            try:
                os.truncate(self.folder / _LOG, 0)
                folder.used -= folder.log
                folder.log = 0
            except OSError:
                pass
            if fits():
                return True, folder
        for path, (nb, _) in sorted(folder.manifests.items(), key=lambda kv: (kv[0] == own, kv[1][1])):
            drop(path, nb)
            del folder.manifests[path]
            if fits():
                return True, folder
        return False, folder

    def _evict(self, sha: str, folder: _Folder) -> bool:
        """Unlink a complete shard nobody pins (an exclusive non-blocking flock first), and its
        index copy; `folder` counts them gone."""
        path = self.folder / f"{sha}.tar"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        try:
            path.unlink(missing_ok=True)
            (self.folder / f"{sha}.idx").unlink(missing_ok=True)
        finally:
            os.close(fd)
        folder.used -= folder.shards.pop(sha, 0) + folder.indexes.pop(sha, (0, 0.0))[0]
        with self._lock:
            self._stats["evictions"] += 1
        return True

    # -- lifecycle ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """hits, misses (shards a batch had to wait for), fetches, bytes_fetched, fetch_wait_s,
        evictions, retries, readahead_depth (shards cached ahead of the reader, last seen) and
        max_readahead_depth, limit_bytes, folder."""
        with self._lock:
            return {**self._stats, "limit_bytes": self.limit_bytes, "folder": str(self.folder)}

    def stop(self) -> None:
        """Stop read-ahead (a download in progress completes)."""
        with self._lock:
            self._generation += 1
            threads, self._threads = self._threads, []
            self._changed.notify_all()
        for t in threads:
            if t is not threading.current_thread():
                t.join()

    def close(self) -> None:
        self.stop()
        with self._lock:
            self._closed = True
            for seq in list(self._open):
                self.release(seq)
            if self._space_fd >= 0 and self._index_bytes is not None:
                # index copies of shards that came before their index was loaded, where they fit
                fcntl.flock(self._space_fd, fcntl.LOCK_EX)
                try:
                    self._keep_indexes(self._usage())
                except OSError:
                    pass
                finally:
                    fcntl.flock(self._space_fd, fcntl.LOCK_UN)
            self._unregister()
            if self._space_fd >= 0:
                os.close(self._space_fd)
                self._space_fd = -1
