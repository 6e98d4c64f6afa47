"""The plan-driven shard cache (`gdsload.io.cache`) against moto's real S3 server (the session
fixture `s3` in tests/conftest.py): datasets are converted locally, uploaded with s3fs, and read
through `gdsload.Dataset("s3://...", cache_dir=...)`.

What is checked: every batch (keys, arrays, labels) and its order equal to reading the local copy,
over two shuffled epochs and a resume; the folder never above `cache_limit` while a small cache
evicts; two processes sharing one folder download each shard once (the cache's fetch.log) and
leave no lock file; a download killed with SIGKILL leaves no file taken as complete and the next
run is right (its lock file gone too); a
corrupt object is fetched twice, then fails naming the shard; a limit below the shuffle window
is refused; `cache_dir=False` reads ranges as before.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from npykit import npy_dataset
from s3kit import SpaceWatch, fetch_log, shard_bytes, upload

from gdsload.convert.engine import ConvertOptions, convert
from gdsload.errors import CorruptDataError, GdsloadError
from gdsload.io.cache import CacheFullError
from gdsload.dataset.sharded import ShardedDataset
from gdsload.loader.dataloader import DataLoader, Dataset

BUCKET = "gdsload-cache-test"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def remote(s3, tmp_path_factory):
    """60 uint8[3, 32, 32] .npy samples with labels in 9 shards: (local path, s3 URL)."""
    root = tmp_path_factory.mktemp("cache")
    ds = npy_dataset(root / "src", root / "ds", num_samples=60, shape=(3, 32, 32), dtype="uint8", seed=3,
                     shard_size=40_000)
    assert len(ShardedDataset(ds).shards) >= 8
    return ds, upload(s3, ds, BUCKET, "ds")


def _batches(ds, epochs=(0, 1), **kw):
    """Every batch of `epochs` as (keys, npy bytes, labels) plus the loader's last stats."""
    kw = {"batch_size": 4, "shuffle": True, "seed": 7, "shuffle_window": 3, "output": "numpy",
          "device": "cpu", "num_workers": 2, **kw}
    loader = DataLoader(ds, **kw)
    out = []
    try:
        for e in epochs:
            loader.set_epoch(e)
            for b in loader:
                out.append((tuple(b["__key__"]), b["npy"].tobytes(), b["cls"].tolist()))
        return out, loader.stats()
    finally:
        loader.close()


def test_cached_reads_equal_the_local_copy_in_content_and_order(remote, tmp_path):
    local, url = remote
    want, _ = _batches(Dataset(str(local)))
    got, stats = _batches(Dataset(url, cache_dir=tmp_path / "c"))
    assert got == want
    c = stats["cache"]
    n = len(ShardedDataset(local).shards)
    assert stats["io_path"] == "posix"  # the cached copy is read as a local file
    assert c["fetches"] == n  # each shard once over two epochs: the cache holds them all
    assert c["bytes_fetched"] == sum(s.stat().st_size for s in local.glob("*.tar"))
    assert c["hits"] > 0 and c["hits"] + c["misses"] > c["fetches"]
    # a batch waited for its shards exactly when one was missing (read-ahead may have won every race)
    assert (c["misses"] > 0) == (c["fetch_wait_s"] > 0) and c["fetch_wait_s"] >= 0
    assert 1 <= c["max_readahead_depth"] <= n and 0 <= c["readahead_depth"] <= c["max_readahead_depth"]
    assert c["retries"] == 0
    # a second loader on the warm folder fetches nothing
    again, stats = _batches(Dataset(url, cache_dir=tmp_path / "c"))
    assert again == want and stats["cache"]["fetches"] == 0 and stats["cache"]["misses"] == 0


def test_resume_from_a_state_is_unchanged(remote, tmp_path):
    local, url = remote
    kw = {"batch_size": 4, "shuffle": True, "seed": 1, "output": "numpy", "device": "cpu"}
    ref = DataLoader(Dataset(str(local)), **kw)
    it = iter(ref)
    for _ in range(5):
        next(it)
    state = ref.state_dict()
    rest_local = [tuple(b["__key__"]) for b in it]
    ref.close()
    cached = DataLoader(Dataset(url, cache_dir=tmp_path / "c"), **kw)
    cached.load_state_dict(state)
    assert [tuple(b["__key__"]) for b in cached] == rest_local
    assert cached.state_dict() == ref.state_dict()
    cached.close()


def test_small_limit_evicts_by_the_plan_and_never_exceeds_it(remote, tmp_path):
    local, url = remote
    sizes = sorted((s.stat().st_size for s in local.glob("*.tar")), reverse=True)
    limit = sum(sizes[:4])  # window 3 (+1 for a batch across a round boundary)
    folder = tmp_path / "c"
    watch = SpaceWatch(folder, shard_bytes, every_s=0.0005)
    try:
        got, stats = _batches(Dataset(url, cache_dir=folder, cache_limit=limit))
    finally:
        peak = watch.stop()
    want, _ = _batches(Dataset(str(local)))
    assert got == want
    c = stats["cache"]
    assert c["evictions"] > 0 and c["fetches"] > len(sizes) / 2
    assert 0 < peak <= limit, (peak, limit)
    assert shard_bytes(folder) <= limit


def test_a_limit_below_the_shuffle_window_is_refused(remote, tmp_path):
    _, url = remote
    loader = DataLoader(Dataset(url, cache_dir=tmp_path / "c", cache_limit=10_000), batch_size=4,
                        shuffle=True, shuffle_window=3, output="numpy", device="cpu")
    with pytest.raises(CacheFullError, match=r"cache_limit .* shuffle_window=3"):
        iter(loader)
    with pytest.raises(GdsloadError, match="invalid size"):
        Dataset(url, cache_limit="lots")


def test_cache_dir_false_reads_ranges_and_default_folder_is_under_xdg(remote, tmp_path, monkeypatch):
    local, url = remote
    want, _ = _batches(Dataset(str(local)), epochs=(0,))
    got, stats = _batches(Dataset(url, cache_dir=False), epochs=(0,))
    assert got == want and stats["io_path"] == "fsspec" and "cache" not in stats
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    got, stats = _batches(Dataset(url), epochs=(0,))
    assert got == want
    assert stats["cache"]["folder"] == str(tmp_path / "xdg" / "gdsload" / "shards")
    assert Dataset(str(local)).cache_dir is None  # a local dataset has no cache


# -- other processes -------------------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import json, os, sys, time
    from gdsload.loader.dataloader import DataLoader, Dataset
    url, folder, go = sys.argv[1], sys.argv[2], sys.argv[3]
    loader = DataLoader(Dataset(url, cache_dir=folder), batch_size=4, shuffle=True, seed=7,
                        shuffle_window=3, output="numpy", device="cpu")
    while go and not os.path.exists(go):  # start together with the other process
        time.sleep(0.005)
    keys = [list(b["__key__"]) for b in loader]
    print(json.dumps({"keys": keys, "cache": loader.stats()["cache"]}))
""")


def _child(url: str, folder: Path, go: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", _CHILD, url, str(folder), str(go or "")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_sharing_a_folder_download_each_shard_once(remote, tmp_path):
    local, url = remote
    folder = tmp_path / "shared"
    go = tmp_path / "go"
    procs = [_child(url, folder, go), _child(url, folder, go)]
    time.sleep(3)  # both import and open the dataset, then wait for `go`
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    want = [list(k) for k, _, _ in _batches(Dataset(str(local)), epochs=(0,))[0]]
    assert outs[0]["keys"] == want and outs[1]["keys"] == want
    names = sorted(s["name"] for s in ShardedDataset(local).shards)
    assert sorted(fetch_log(folder)) == names  # every shard downloaded exactly once, by one of them
    assert sum(o["cache"]["fetches"] for o in outs) == len(names)
    assert [p.name for p in folder.glob("*.lock")] == [".space.lock"]  # each shard's removed by its holder


@pytest.fixture(scope="module")
def big(s3, tmp_path_factory):
    """One 32 MB shard, so a download lasts long enough to be killed in the middle."""
    root = tmp_path_factory.mktemp("big")
    ds = npy_dataset(root / "src", root / "ds", num_samples=8, shape=(4, 1024, 1024), dtype="uint8", seed=5,
                     shard_size=2**30)
    assert len(ShardedDataset(ds).shards) == 1
    return ds, upload(s3, ds, BUCKET, "big")


def test_a_killed_download_is_never_taken_as_complete(big, tmp_path):
    local, url = big
    folder = tmp_path / "c"
    sha = ShardedDataset(local).shards[0]["sha256"]
    p = _child(url, folder)
    deadline = time.monotonic() + 60
    killed_at = None
    while time.monotonic() < deadline and p.poll() is None:
        parts = list(folder.glob(f"{sha}.tar.part-*")) if folder.exists() else []
        sizes = [q.stat().st_size for q in parts if q.exists()]
        if sizes and 0 < max(sizes):
            os.kill(p.pid, signal.SIGKILL)
            killed_at = max(sizes)
            break
        time.sleep(0.001)
    p.communicate()
    assert killed_at is not None, "the download ended before it could be killed"
    assert not (folder / f"{sha}.tar").exists()  # a partial download has no complete name
    assert list(folder.glob(f"{sha}.tar.part-*"))  # ... only a .part, which nobody will use
    p = _child(url, folder)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    got = json.loads(out)
    want = [list(k) for k, _, _ in _batches(Dataset(str(local)), epochs=(0,), batch_size=4)[0]]
    assert got["keys"] == want and got["cache"]["fetches"] == 1
    assert not list(folder.glob(f"{sha}.tar.part-*"))  # the stale part is gone
    assert not list(folder.glob(f"{sha}.lock"))  # and the killed process's lock file
    assert (folder / f"{sha}.tar").read_bytes() == next(local.glob("*.tar")).read_bytes()


def test_a_corrupt_object_is_fetched_twice_then_named(s3, remote, tmp_path):
    local, _ = remote
    victim = ShardedDataset(local).shards[2]["name"]
    bad = tmp_path / "bad"  # a copy with the victim damaged, uploaded as it is: the store never
    shutil.copytree(local, bad)  # held an intact object under that key
    data = bytearray((bad / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    (bad / victim).write_bytes(bytes(data))
    url = upload(s3, bad, BUCKET, "corrupt")
    folder = tmp_path / "c"
    with pytest.raises(CorruptDataError, match=rf"shard {victim} .*SHA-256.*fetched twice"):
        _batches(Dataset(url, cache_dir=folder), epochs=(0,))
    assert victim not in fetch_log(folder) and fetch_log(folder, "corrupt") == [victim, victim]
    sha = ShardedDataset(local).shards[2]["sha256"]
    assert not list(folder.glob(f"{sha}.tar*"))  # nothing of it is kept


def test_feed_server_serves_a_dataset_at_a_url_through_the_cache(remote, tmp_path):
    """`gdsload serve s3://... --cache-dir DIR`: a real gRPC server on loopback, its streams read
    the shards from the cache folder (downloaded once) and deliver the local copy's order."""
    pytest.importorskip("grpc")
    from gdsload.cli import main as cli_main
    from gdsload.service.client import RemoteLoader
    from gdsload.service.server import create_server

    local, url = remote
    folder = tmp_path / "served"
    srv, port = create_server([url], cache_dir=str(folder))
    srv.start()
    try:
        kw = {"batch_size": 4, "shuffle": True, "seed": 7, "shuffle_window": 3, "output": "numpy"}
        for _ in range(2):  # the second stream finds every shard in the cache
            remote_loader = RemoteLoader(f"127.0.0.1:{port}", dataset="ds", **kw)
            got = [tuple(b["__key__"]) for b in remote_loader]
            remote_loader.close()
            want = [k for k, _, _ in _batches(Dataset(str(local)), epochs=(0,))[0]]
            assert got == want
    finally:
        srv.shutdown(grace_s=2)
    assert sorted(fetch_log(folder)) == sorted(s["name"] for s in ShardedDataset(local).shards)
    with pytest.raises(SystemExit):  # a bad --cache-limit is a usage error at start
        cli_main(["serve", url, "--cache-limit", "lots"])


@pytest.mark.dali
def test_decoded_images_through_a_tight_cache_equal_the_local_copy(s3, tmp_path):
    """Images decoded by DALI (batches take decode turns in order, three reader threads) through
    a cache that holds only window + 1 shards: same pixels, same order as the local copy."""
    from gdsload.decode.image import ImageTransform
    from gdsload.sampledata import make_image_folder

    make_image_folder(tmp_path / "src", num_images=40, num_classes=2, mean_size=(48, 32), workers=1)
    convert(str(tmp_path / "src"), tmp_path / "ds", ConvertOptions(workers=1, progress=False, shard_size=30_000))
    local = tmp_path / "ds"
    url = upload(s3, local, BUCKET, "imgs")
    sizes = sorted((s.stat().st_size for s in local.glob("*.tar")), reverse=True)
    assert len(sizes) >= 6
    kw = {"batch_size": 4, "shuffle": True, "seed": 3, "shuffle_window": 2, "output": "numpy", "device": "cpu",
          "num_workers": 3, "transform": ImageTransform(train=False, size=16, resize=16, mean=None, std=None,
                                                         dtype="uint8", layout="NHWC")}

    def run(ds):
        loader = DataLoader(ds, **kw)
        out = [(tuple(b["__key__"]), b["jpg"].tobytes()) for b in loader]
        stats = loader.stats()
        loader.close()
        return out, stats

    want, _ = run(Dataset(str(local)))
    got, stats = run(Dataset(url, cache_dir=tmp_path / "c", cache_limit=sum(sizes[:3])))  # window + 1
    assert got == want and stats["cache"]["evictions"] > 0


def test_a_pickled_loader_keeps_its_cache_settings(remote, tmp_path):
    """A loader handed to another process (pickled) reads through the same cache folder; its
    cache object itself (threads, locks, pins) is never pickled but built afresh."""
    import pickle

    local, url = remote
    folder = tmp_path / "c"
    loader = DataLoader(Dataset(url, cache_dir=folder, cache_limit="10MB"), batch_size=4, output="numpy",
                        device="cpu")
    it = iter(loader)
    next(it)
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.dataset.cache_dir == str(folder) and copy.dataset.cache_limit == 10**7
    rest = [tuple(b["__key__"]) for b in copy]
    assert rest == [tuple(b["__key__"]) for b in it]
    assert copy.stats()["cache"]["folder"] == str(folder)
    n = len(ShardedDataset(local).shards)  # one folder: each shard downloaded once by the two
    assert loader.stats()["cache"]["fetches"] + copy.stats()["cache"]["fetches"] == n
    loader.close()
    copy.close()


def test_readers_waiting_for_room_hold_no_pins(remote, tmp_path):
    """Room for two shards. Batch 2 needs shards 0 and 2, batch 3 shards 1 and 3; 0 and 1 are
    present, pinned by batches 0 and 1, then released. Before: batch 2 kept its pin on 0 while it
    waited for room for 2 (one reader at a time does that), batch 3 kept its pin on 1 while it
    waited in line, and nothing could be evicted: CacheFullError once the wait timed out. Now a
    reader waits holding no pin, and both batches get their shards."""
    from gdsload.io.cache import ShardCache

    _, url = remote
    ds = ShardedDataset(url)
    sizes = [s["bytes"] for s in ds.shards[:4]]
    limit = 2 * max(sizes)
    assert 3 * min(sizes) > limit  # two shards fit, three never do
    cache = ShardCache(ds.root, ds.shards, tmp_path / "c", limit, fetchers=1, wait_timeout_s=5)
    try:
        cache.acquire(0, [0])
        cache.acquire(1, [1])
        got: dict[int, object] = {}

        def batch(seq, shards):
            try:
                got[seq] = cache.acquire(seq, shards)
            except Exception as exc:  # noqa: BLE001 - reported below
                got[seq] = exc

        threads = [threading.Thread(target=batch, args=(2, [0, 2])), threading.Thread(target=batch, args=(3, [1, 3]))]
        threads[0].start()
        time.sleep(0.3)  # batch 2 is waiting for room, in line
        threads[1].start()
        time.sleep(0.3)
        cache.release(0)
        cache.release(1)
        threads[0].join(30)
        if isinstance(got.get(2), dict):
            cache.release(2)
        threads[1].join(30)
        assert isinstance(got[2], dict) and sorted(got[2]) == [0, 2], got.get(2)
        assert isinstance(got[3], dict) and sorted(got[3]) == [1, 3], got.get(3)
        cache.release(3)
    finally:
        cache.close()


def test_a_mix_reads_each_url_part_through_its_own_cache(remote, tmp_path):
    """A Mix holding a dataset at a URL (and a local one) caches that part's shards whole: same
    batches as the local copies, every remote shard fetched once, the local part read in place."""
    from gdsload import Mix

    local, url = remote
    want, _ = _batches(Mix([Dataset(str(local)), Dataset(str(local))], names=["a", "b"]), epochs=(0,))
    got, stats = _batches(Mix([Dataset(url, cache_dir=tmp_path / "c"), Dataset(str(local))], names=["a", "b"]),
                          epochs=(0,))
    assert got == want
    assert stats["io_path"] == "posix"  # cached parts are local files: no range requests
    n = len(ShardedDataset(local).shards)
    assert stats["cache"]["fetches"] == n and stats["cache"]["folder"] == str(tmp_path / "c")
    assert sorted(p.name for p in (tmp_path / "c").glob("*.tar")) and shard_bytes(tmp_path / "c") == sum(
        s.stat().st_size for s in local.glob("*.tar"))
