"""Helpers shared by the shard cache tests against moto's real S3 server (the session fixture
`s3` in tests/conftest.py): tests/io/test_cache.py, tests/io/test_cache_limit.py and
tests/test_faults.py. Uploading a local dataset, reading the cache folder's fetch.log, and
watching the most the folder holds, each look under its space lock."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path


def upload(s3, local: Path, bucket: str, name: str) -> str:
    """Copy the dataset folder `local` to `bucket/name` (the bucket made if absent); its URL."""
    if not s3.exists(bucket):
        s3.mkdir(bucket)
    s3.put(str(local), f"{bucket}/{name}", recursive=True)
    s3.invalidate_cache()
    return f"s3://{bucket}/{name}"


def fetch_log(folder: Path, outcome: str = "ok") -> list[str]:
    """Shard names of the downloads in the cache's fetch.log that ended with `outcome`."""
    p = folder / "fetch.log"
    lines = [line.split() for line in p.read_text().splitlines()] if p.exists() else []
    return [f[2] for f in lines if f[-1] == outcome]


def shard_bytes(folder: Path) -> int:
    """What the folder holds: complete shards and partial downloads at their size now. By inode:
    a .part renamed to its final name while the folder is listed is one file, not two."""
    sizes = {}
    for e in os.scandir(folder):
        if ".tar" in e.name:
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            sizes[st.st_ino] = st.st_size
    return sum(sizes.values())


class SpaceWatch:
    """The most `measure(folder)` gave (for a tuple, the most of each item; `start` until the
    first look), looked at every `every_s` while the folder's `.space.lock` exists, each look
    holding that lock as a reserving process does: a listing is not a snapshot, and one that
    saw a shard before its eviction and the download that took its place after would count
    both."""

    def __init__(self, folder: Path, measure: Callable[[Path], int | tuple[int, ...]] = shard_bytes,
                 every_s: float = 0.001, start: int | tuple[int, ...] = 0):
        self.folder, self.measure, self.every_s, self.peak = folder, measure, every_s, start
        self._done = threading.Event()
        self._t = threading.Thread(target=self._run)
        self._t.start()

    def _run(self) -> None:
        lock = self.folder / ".space.lock"
        while not self._done.is_set():
            if lock.exists():
                fd = os.open(lock, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    now = self.measure(self.folder)
                    if isinstance(now, tuple):
                        self.peak = tuple(map(max, self.peak, now))
                    else:
                        self.peak = max(self.peak, now)
                finally:
                    os.close(fd)
            time.sleep(self.every_s)

    def stop(self):
        """Stop watching; the peak."""
        self._done.set()
        self._t.join()
        return self.peak
