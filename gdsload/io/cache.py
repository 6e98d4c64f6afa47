"""A plan-driven local cache of whole shards, for datasets at a URL (s3://, gs://, http(s)://).

Why: reading byte ranges from an object store costs one request (10-50 ms) per sample, so latency,
not bandwidth, sets the speed. A whole shard is one request at the store's bandwidth. The loader's
order is a pure function known in advance (`gdsload.plan.plan`), so this cache is told the shards every
batch of the epoch needs (`start_epoch`) and fetches them before they are needed, and when it needs
room it evicts the shard needed furthest in the future, or one not needed again this epoch
(Belady's rule, exact here because the future is known). Cached shards are plain local files: the
loader reads them through its ordinary I/O backend (posix, KvikIO/GDS).

Folder layout (one folder per node, shared by every process that uses it; files are named by the
shard's SHA-256, so datasets with a shard in common share it and a rewritten shard never hits a
stale copy):

    <sha256>.tar                    a complete, verified shard (size and SHA-256 of the manifest);
                                    it appears only by an atomic rename, so one is never partial
    <sha256>.tar.part-<nbytes>-<id> a download in progress (<nbytes>: what it will grow to)
    <sha256>.lock                   held (flock, exclusive) while that shard is downloaded: another
                                    process that needs it waits there instead of downloading it too
    .space.lock                     held while a process reserves space (counts, evicts, creates a
                                    .part), so the reservations of all processes are serialised
    fetch.log                       one line per download: time, pid, shard, bytes, seconds, ok|corrupt

Invariants:
- The bytes in the folder never exceed `limit_bytes` (as this process counts them: complete
  shards plus every .part at its final size): space is reserved before a download starts.
- A shard a batch of this process is reading is pinned: a shared flock on the complete file is held
  while any batch uses it. An evictor (in any process) takes an exclusive non-blocking flock before
  it unlinks, and skips a file it cannot lock.
- A crash mid-download leaves only a .part, never a complete name; a .part whose `.lock` nobody
  holds is stale and is removed at the next reservation (or when its shard is fetched again).
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
import os
import threading
import time
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
    """

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
        self._uses: dict[int, list[int]] = {}  # shard -> batch seqs of this epoch that need it
        self._upcoming: list[int] = []  # shards of this epoch in order of first use
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
            finally:
                fcntl.flock(self._space_fd, fcntl.LOCK_UN)

    def _users(self) -> list[int]:
        """The needs (bytes) of the other live processes registered in the folder; entries of
        dead ones are removed. Call with the space lock held."""
        return [need for need, _ in self._others()]

    def _others(self) -> list[tuple[int, set[str]]]:
        """Per other live process registered in the folder: its need (bytes) and the shards (by
        SHA-256) it says it needs next; entries of dead ones are removed. An entry is the need on
        its first line, then one SHA-256 a line (`_publish_wanted`)."""
        needs: list[tuple[int, set[str]]] = []
        users = self.folder / "users"
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
        ahead = sorted((s for s in self._upcoming if self._next_use(s, c) != _NEVER),
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
        users = self.folder / "users"
        users.mkdir(exist_ok=True)
        self._user_name = f"{os.getpid()}-{id(self)}"
        fd = os.open(users / self._user_name, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, str(need).encode(), 0)
        self._user_fd = fd

    def _unregister(self) -> None:
        if self._user_fd is not None:
            try:
                os.unlink(self.folder / "users" / self._user_name)
            except FileNotFoundError:
                pass
            os.close(self._user_fd)
            self._user_fd = None

    def start_epoch(self, batches: Sequence[Sequence[int]]) -> None:
        """The shards each batch of this epoch needs, in the order the batches are read (batch
        `seq` is `batches[seq]`); starts the read-ahead threads."""
        uses: dict[int, list[int]] = {}
        biggest = 0
        for seq, shards in enumerate(batches):
            shards = [int(s) for s in shards]
            biggest = max(biggest, sum(self.shards[s]["bytes"] for s in shards))
            for s in shards:
                uses.setdefault(s, []).append(seq)
        if biggest > self.limit_bytes:
            raise CacheFullError(
                f"cache_limit {_human(self.limit_bytes)} cannot hold the shards one batch reads "
                f"({_human(biggest)}); raise cache_limit or lower batch_size"
            )
        self.stop()
        with self._lock:
            self._generation += 1
            self._uses = uses
            self._upcoming = sorted(uses, key=lambda s: uses[s][0])
            self._cursor = 0
            self._publish_wanted()
            self._errors.clear()
            gen = self._generation
            self._threads = [threading.Thread(target=self._read_ahead, args=(gen,), daemon=True,
                                              name=f"gdsload-cache-{i}") for i in range(self.fetchers)]
        for t in self._threads:
            t.start()

    def _next_use(self, shard: int, after: int) -> float:
        """The first batch at or after `after` that needs `shard` (inf: none this epoch)."""
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
            self._publish_wanted()
            self._changed.notify_all()

    # -- the reader's side ------------------------------------------------------------------------
    def acquire(self, seq: int, shards: Sequence[int]) -> dict[int, str]:
        """Local paths of `shards` for batch `seq`, pinned until `release(seq)`; waits for (or
        does) the downloads still missing."""
        shards = list(dict.fromkeys(int(s) for s in shards))
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
        ahead = [s for s in self._upcoming if self._next_use(s, c) != _NEVER]
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
        lock_fd = os.open(self._lock_path(shard), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # another process downloading it: wait for it
            if self._present(shard):
                return True
            err = self._errors.get(shard)
            if isinstance(err, CorruptDataError):  # fetched twice already (by read-ahead)
                raise err
            for stale in self.folder.glob(f"{entry['sha256']}.tar.part-*"):  # we hold its lock
                stale.unlink(missing_ok=True)
            part = self._reserve(shard, foreground=foreground)
            if part is None:
                return None
            try:
                self._fetch_verified(shard, part)
                self._publish(part, self.path(shard))
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
            os.close(lock_fd)  # releases the flock

    def _fetch_verified(self, shard: int, part: Path) -> None:
        """Download into `part`, retrying network faults; a hash or size mismatch is fetched once
        more, then a `CorruptDataError`."""
        entry = self.shards[shard]
        url = self._remote(shard)
        for attempt in range(2):
            t0 = time.perf_counter()
            size, digest = self._fetch(url, part)
            ok = size == entry["bytes"] and digest == entry["sha256"]
            transit = digest.startswith("transit:")
            with open(self.folder / _LOG, "a") as log:  # O_APPEND: lines of processes interleave whole
                log.write(f"{time.time():.3f} {os.getpid()} {entry['name']} {size} "
                          f"{time.perf_counter() - t0:.3f} {'ok' if ok else 'corrupt'}\n")
            if ok:
                return
            problem = (digest.removeprefix("transit:") if transit
                       else f"size is {size} bytes, manifest says {entry['bytes']}" if size != entry["bytes"]
                       else f"SHA-256 is {digest[:16]}..., manifest says {entry['sha256'][:16]}...")
        raise CorruptDataError(f"shard {entry['name']} at {url} does not match the manifest ({problem}; "
                               f"fetched twice); the stored object is corrupt or was rewritten"
                               + (", or bytes are damaged on the way from the store" if transit else ""))

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
    def _reserve(self, shard: int, *, foreground: bool) -> Path | None:
        """Evict until `shard` fits, then create its .part (all under the folder-wide lock);
        None where there is no room now (the caller waits holding no shard lock)."""
        entry = self.shards[shard]
        need = entry["bytes"]
        with self._lock:
            fcntl.flock(self._space_fd, fcntl.LOCK_EX)
            try:
                if self._make_room(shard, need, foreground=foreground):
                    part = self.folder / f"{entry['sha256']}.tar.part-{need}-{os.getpid()}-{threading.get_ident()}"
                    part.touch()
                    return part
            finally:
                fcntl.flock(self._space_fd, fcntl.LOCK_UN)
        return None

    def _publish(self, part: Path, path: str) -> None:
        """Rename a verified .part to its shard's name under the folder-wide space lock: a
        reservation that listed the folder during the rename could see neither name (the .part
        gone, the new name not yet read) and count the shard as free space."""
        with self._lock:
            fcntl.flock(self._space_fd, fcntl.LOCK_EX)
            try:
                os.replace(part, path)
            finally:
                fcntl.flock(self._space_fd, fcntl.LOCK_UN)

    def _usage(self) -> tuple[int, dict[str, int]]:
        """Bytes held in the folder, and the complete shards there (file name -> bytes); stale
        .part files (their shard's lock is free) are removed on the way."""
        used = 0
        complete: dict[str, int] = {}
        for e in os.scandir(self.folder):
            name = e.name
            if name.endswith(".tar"):
                try:
                    complete[name] = e.stat().st_size
                except FileNotFoundError:
                    continue
                used += complete[name]
            elif ".tar.part-" in name:
                sha, _, rest = name.partition(".tar.part-")
                if self._is_stale(sha):
                    Path(e.path).unlink(missing_ok=True)
                    continue
                try:
                    used += max(int(rest.split("-")[0]), e.stat().st_size)
                except (ValueError, FileNotFoundError):
                    continue
        return used, complete

    def _is_stale(self, sha: str) -> bool:
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

    def _make_room(self, shard: int, need: int, *, foreground: bool) -> bool:
        """Evict complete shards, furthest next use first, until `need` more bytes fit; call with
        both locks held. Read-ahead never evicts a shard needed no later than `shard`."""
        used, complete = self._usage()
        if used + need <= self.limit_bytes:
            return True
        c = self._cursor
        mine = self._next_use(shard, c)
        by_sha = {s["sha256"]: i for i, s in enumerate(self.shards)}
        wanted = set().union(*(w for _, w in self._others()))  # by other processes, next
        def key(name: str) -> float:
            i = by_sha.get(name[: -len(".tar")])
            return _NEVER if i is None else self._next_use(i, c)
        # those no other process needs next first, each group furthest next use (ours) first
        for name in sorted(complete, key=lambda n: (n[: -len(".tar")] not in wanted, key(n)), reverse=True):
            nxt = key(name)
            if not foreground and (nxt <= mine or name[: -len(".tar")] in wanted):
                continue
            i = by_sha.get(name[: -len(".tar")])
            if i is not None and i in self._pins:
                continue
            if self._evict(self.folder / name):
                used -= complete[name]
                if used + need <= self.limit_bytes:
                    return True
        return False

    def _evict(self, path: Path) -> bool:
        """Unlink a complete shard nobody pins (an exclusive non-blocking flock first)."""
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
        finally:
            os.close(fd)
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
            self._unregister()
            if self._space_fd >= 0:
                os.close(self._space_fd)
                self._space_fd = -1
