"""The shard cache reads the plan over a bounded window of upcoming batches (`ShardCache.start_epoch`),
against moto's real S3 server (the session fixture `s3` in tests/conftest.py).

What is checked: starting an epoch of 10^7 batches (a lazy sequence whose `__getitem__` computes
each batch's shards and counts its calls) reads only the window's batches, not the epoch, and
takes little memory (tracemalloc's peak), both where the window stops at `cache_limit`'s worth of
shards and where it stops at `horizon_max`; the window follows the cursor to the epoch's end;
eviction drops the shard used furthest ahead, a shard used only past the window counting as
furthest; a batch too big for the limit is refused up front in the first window, later when
read.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from npykit import npy_dataset
from s3kit import upload

from gdsload.dataset.sharded import ShardedDataset
from gdsload.io.cache import CacheFullError, ShardCache

BUCKET = "gdsload-cache-horizon"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EPOCH = 10**7  # batches: a 10^7-entry dict of lists (the schedule before) takes well over 1 GB


@pytest.fixture(scope="module")
def remote(s3, tmp_path_factory):
    """60 uint8[3, 32, 32] .npy samples in >= 8 shards at an s3 URL: its `ShardedDataset`."""
    root = tmp_path_factory.mktemp("horizon")
    ds = npy_dataset(root / "src", root / "ds", num_samples=60, shape=(3, 32, 32), dtype="uint8", seed=5,
                     shard_size=40_000)
    ds = ShardedDataset(upload(s3, ds, BUCKET, "ds"))
    assert len(ds.shards) >= 8
    return ds


class Lazy(Sequence[list[int]]):
    """`n` batches, batch i's shards `fn(i)` computed when indexed; `calls` counts the indexings."""

    def __init__(self, n: int, fn: Callable[[int], list[int]]):
        self.n, self.fn, self.calls = n, fn, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            raise TypeError("the cache must never slice the epoch")
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.calls += 1
        return self.fn(i)


def _start(cache: ShardCache, batches: Lazy) -> int:
    """Start the epoch and stop its read-ahead; tracemalloc's peak (bytes) during the start."""
    tracemalloc.start()
    try:
        cache.start_epoch(batches)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    cache.stop()
    return peak


def _child(root: str, shards: list, folder: str) -> dict:
    """In a fresh process (no client library threads allocating beside it): start the two big
    epochs over `folder`, where every shard is already, and slide one window to its end."""
    n = len(shards)
    out: dict = {}
    # room for shards 0-3: the shards ahead exceed it at the first use of shard 4
    small = ShardCache(root, shards, folder, sum(s["bytes"] for s in shards[:4]), fetchers=2)
    try:
        rotating = Lazy(EPOCH, lambda i: [(i // 50) % n])
        out["rotating"] = {"peak": _start(small, rotating), "calls": rotating.calls, "end": small._end,
                           "uses": list(small._uses), "min": small.horizon_min,
                           "present": all(small._present(s) for s in range(n))}
    finally:
        small.close()
    cache = ShardCache(root, shards, folder, sum(s["bytes"] for s in shards) + 65536, fetchers=2)
    try:
        same = Lazy(EPOCH, lambda i: [0])
        out["same"] = {"peak": _start(cache, same), "calls": same.calls, "end": cache._end,
                       "uses": list(cache._uses[0]), "min": cache.horizon_min, "max": cache.horizon_max}
        calls = same.calls
        far = EPOCH - 10
        cache.acquire(far, [0])  # present: no download
        cache.release(far)
        out["slid"] = {"cursor": cache._cursor, "end": cache._end, "uses": list(cache._uses[0]),
                       "trail": cache._TRAIL, "calls": same.calls - calls}
    finally:
        cache.close()
    return out


def test_starting_an_epoch_of_ten_million_batches_reads_only_the_window(remote, tmp_path):
    """Every shard is fetched first, so read-ahead has nothing to download in the big epochs,
    which run in a fresh process: tracemalloc's peak is then the schedule's own. Shards change
    every 50 batches: the window stops once the shards ahead exceed the limit. One shard for
    every batch: it stops at `horizon_max`. Before: `start_epoch` indexed all 10^7 batches and
    built a dict of 10^7 seqs (minutes and gigabytes)."""
    ds = remote
    n = len(ds.shards)
    folder = tmp_path / "c"
    cache = ShardCache(ds.root, ds.shards, folder, sum(s["bytes"] for s in ds.shards) + 65536)
    try:
        for seq in range(n):  # every shard here: nothing to fetch in the child
            cache.acquire(seq, [seq])
            cache.release(seq)
        assert all(cache._present(s) for s in range(n))
    finally:
        cache.close()
    code = (f"import json, sys; sys.path[:0] = {[str(HERE), str(HERE.parent)]!r}; "
            "from test_cache_horizon import _child; "
            "print(json.dumps(_child(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])))")
    run = subprocess.run([sys.executable, "-c", code, ds.root, json.dumps(ds.shards), str(folder)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])

    r = got["rotating"]
    # the first window, checked up front (horizon_min), then read up to batch 200, shard 4's first
    assert r["end"] == 4 * 50 + 1, r
    assert r["calls"] == r["min"] + r["end"]
    assert r["peak"] < 2_000_000, r  # a 10^7-entry dict of lists: well over 1 GB
    assert r["uses"] == [0, 1, 2, 3, 4]
    assert r["present"]  # read-ahead found its window's shards here, fetched and evicted nothing

    s = got["same"]
    assert s["end"] == s["max"]
    assert s["calls"] == s["min"] + s["max"] <= 5000
    assert s["peak"] < 4_000_000, s
    assert s["uses"] == list(range(s["max"]))

    # the window follows the cursor (kept `_TRAIL` batches behind it), to the epoch's end; the
    # batches it skipped are never read
    w = got["slid"]
    far = EPOCH - 10
    assert w["cursor"] == far + 1 and w["end"] == EPOCH
    assert w["uses"] == list(range(far + 1 - w["trail"], EPOCH))
    assert w["calls"] == 10 + w["trail"]


@pytest.mark.parametrize("later", ["in_window", "past_window"])
def test_eviction_drops_the_shard_used_furthest_ahead(remote, tmp_path, later):
    """Room for two shards. Batches 0, 1, 2 read shards 0, 1, 2; shard 0 is read again by batch 3,
    shard 1 by batch 5 (`in_window`) or only by the epoch's last batch, far past the window
    (`past_window`: its next use is unknown and ranks furthest). Batch 2 makes room: shard 1
    goes, shard 0 stays. Swapped (shard 1 needed next): shard 0 goes."""
    ds = remote
    sizes = [s["bytes"] for s in ds.shards[:3]]
    limit = 2 * max(sizes) + 4096  # and fetch.log: else both would go to make room for it
    assert 3 * min(sizes) > limit  # two shards fit, three never do
    for soon, late in ((0, 1), (1, 0)):
        again = {3: soon, (5 if later == "in_window" else EPOCH - 1): late}
        batches = Lazy(EPOCH, lambda i, again=again: [i] if i < 3 else [again[i]] if i in again else [])
        cache = ShardCache(ds.root, ds.shards, tmp_path / f"c{soon}", limit, fetchers=1, wait_timeout_s=10)
        try:
            cache.start_epoch(batches)
            cache.stop()  # no read-ahead: only the reader fetches and evicts, in batch order
            for seq in range(3):
                cache.acquire(seq, [seq])
                cache.release(seq)
            assert cache._present(2) and cache._present(soon), (soon, later)
            assert not cache._present(late), (soon, later)
            assert batches.calls <= cache.horizon_min + cache.horizon_max + 3
        finally:
            cache.close()


def test_a_batch_too_big_for_the_limit_is_refused_up_front_or_when_read(remote, tmp_path):
    """In the first `horizon_min` batches: `start_epoch` refuses it, as before. Past them (the
    window reaches it only later): the reader of that batch gets the same error, and the epoch's
    other batches read on."""
    ds = remote
    limit = 2 * max(s["bytes"] for s in ds.shards)
    cache = ShardCache(ds.root, ds.shards, tmp_path / "c", limit, fetchers=1, wait_timeout_s=10)
    try:
        with pytest.raises(CacheFullError, match="cannot hold the shards one batch reads"):
            cache.start_epoch(Lazy(EPOCH, lambda i: [0, 1, 2] if i == 5 else [0]))
        big = 10**6
        cache.start_epoch(Lazy(EPOCH, lambda i: [0, 1, 2] if i == big else [0]))
        cache.stop()
        with pytest.raises(CacheFullError, match="cannot hold the shards one batch reads"):
            cache.acquire(big, [0, 1, 2])
        assert cache.acquire(big + 1, [0]) == {0: cache.path(0)}
        cache.release(big + 1)
    finally:
        cache.close()
