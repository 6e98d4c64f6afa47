"""Everything the shard cache writes counts against `cache_limit` (issue 46, row 6), against
moto's real S3 server (the session fixture `s3` in tests/conftest.py).

Before: three datasets read through one 8 MB cache left 15.3 MB in the folder: the index copies
(`<sha256>.idx`, one per shard ever read, 22-44 kB each) were never counted nor evicted, and
the per-shard lock files (`<sha256>.lock`) were never removed.

What is checked: three datasets read one after the other through one small folder never hold
more than the limit in all (every file under the folder, `os.walk`: shards, downloads, index and
manifest copies, fetch.log), looked at under the folder's space lock as a reserving process
does; the one allowance is the `users/` entry of the running process (its need and one 65-byte
line per shard of its window: `gdsload.io.cache` says why it is not counted); lock files never
more than the downloads in progress. Idle,
the folder holds at most the limit, no lock file but `.space.lock`, no `users/` entry, and an
index copy only beside its shard. The lock scheme (lock files unlinked by their holder) keeps
downloads of one shard exclusive between processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from npykit import npy_dataset
from s3kit import SpaceWatch, upload

from gdsload.dataset.sharded import ShardedDataset
from gdsload.loader.dataloader import DataLoader, Dataset

BUCKET = "gdsload-cache-limit-test"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def three(s3, tmp_path_factory):
    """Three datasets of 60 uint8[3, 32, 32] .npy samples in about 10 shards each, with no shard
    in common (other seeds): [(local path, s3 URL)]."""
    root = tmp_path_factory.mktemp("limit")
    out = []
    for k in range(3):
        ds = npy_dataset(root / f"src{k}", root / f"ds{k}", num_samples=60, shape=(3, 32, 32), dtype="uint8",
                         seed=20 + k, shard_size=20_000)
        assert len(ShardedDataset(ds).shards) >= 8
        out.append((ds, upload(s3, ds, BUCKET, f"ds{k}")))
    return out


def _walk(folder: Path) -> tuple[int, int, list[str]]:
    """Bytes of every file under `folder` (by inode: a file renamed while it is listed is one
    file), the bytes of those in users/, and the names of the lock files there."""
    sizes: dict[int, int] = {}
    users = 0
    locks = []
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            sizes[st.st_ino] = st.st_size
            if Path(dirpath).name == "users":
                users += st.st_size
            if name.endswith(".lock"):
                locks.append(name)
    return sum(sizes.values()), users, locks


def _held(folder: Path) -> tuple[int, int, int]:
    """Bytes of every file under `folder` but users/, bytes in users/, lock files but the space
    lock: what `SpaceWatch` keeps the most of."""
    total, users, locks = _walk(folder)
    return total - users, users, len([n for n in locks if n != ".space.lock"])


def test_three_datasets_through_one_small_cache_stay_within_the_limit(three, tmp_path):
    folder = tmp_path / "c"
    sizes = sorted((s["bytes"] for local, _ in three for s in ShardedDataset(local).shards), reverse=True)
    limit = sum(sizes[:6])  # window 3, and room for three more
    assert sum(sizes) > 2 * limit  # every dataset evicts the one before
    kw = {"batch_size": 4, "shuffle": True, "seed": 7, "shuffle_window": 3, "output": "numpy",
          "device": "cpu", "num_workers": 2}
    watch = SpaceWatch(folder, _held, every_s=0.001, start=(0, 0, 0))
    try:
        for local, url in three:
            ref = DataLoader(Dataset(str(local)), **kw)
            want = [tuple(b["__key__"]) for b in ref]
            ref.close()
            loader = DataLoader(Dataset(url, cache_dir=folder, cache_limit=limit), **kw)
            try:
                assert [tuple(b["__key__"]) for b in loader] == want
                assert loader.stats()["cache"]["fetches"] >= len(ShardedDataset(local).shards)
            finally:
                loader.close()
    finally:
        most, most_users, most_locks = watch.stop()
    assert 0 < most <= limit, (most, limit)  # everything but users/
    assert most_users <= 21 + 65 * 3, most_users  # the need, and the next shards its window holds
    # lock files: one per download in progress (4 read-ahead threads, 2 readers), none after it
    assert most_locks <= 4 + 2, most_locks
    total, users, locks = _walk(folder)
    assert total <= limit and users == 0, (total, limit)
    assert locks == [".space.lock"]
    assert not list((folder / "users").iterdir())
    tars = {p.name[: -len(".tar")] for p in folder.glob("*.tar")}
    idx = {p.name[: -len(".idx")] for p in folder.glob("*.idx")}
    assert tars and idx and idx <= tars  # an index copy lies beside its shard only
    last = {s["sha256"] for s in ShardedDataset(three[-1][0]).shards}
    assert tars <= last  # the two datasets before were evicted, their index copies with them
    assert (folder / "fetch.log").stat().st_size <= limit // 64
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [".space.lock", "fetch.log", "manifests", "users", *(f"{s}.tar" for s in tars), *(f"{s}.idx" for s in idx)])


def test_a_roomy_cache_keeps_every_index_and_no_lock_file(three, tmp_path):
    """With room, every cached shard has its index copy beside it (an epoch runs with the store
    down from them: tests/test_faults.py), and no lock file is left."""
    local, url = three[0]
    folder = tmp_path / "c"
    loader = DataLoader(Dataset(url, cache_dir=folder), batch_size=4, output="numpy", device="cpu")
    n = len(list(loader))
    loader.close()
    assert n > 0
    shas = sorted(s["sha256"] for s in ShardedDataset(local).shards)
    assert sorted(p.name[: -len(".tar")] for p in folder.glob("*.tar")) == shas
    assert sorted(p.name[: -len(".idx")] for p in folder.glob("*.idx")) == shas
    assert _walk(folder)[2] == [".space.lock"]


# -- the lock files between processes ----------------------------------------------------------------
_HOLDER = textwrap.dedent("""
    import os, sys, time
    from gdsload.io.cache import ShardCache
    folder, rounds = sys.argv[1], int(sys.argv[2])
    shards = [{"name": "x.tar", "bytes": 1, "sha256": "ab" * 32, "samples": 1}]
    cache = ShardCache("s3://nowhere/x", shards, folder, 1 << 20)
    marker = os.path.join(folder, "held")
    bad = 0
    for _ in range(rounds):
        fd = cache._lock_shard(0)
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # another holder: EEXIST
        except FileExistsError:
            bad += 1
        else:
            time.sleep(0.0005)
            os.unlink(marker)
        cache._unlock_shard(0, fd)
    cache.close()
    print(bad)
""")


def test_lock_files_are_removed_and_the_lock_stays_exclusive_between_processes(tmp_path):
    """Three processes take and give back one shard's lock 300 times each; the holder unlinks the
    lock file before it lets go. A process that waited on the old file sees it is no longer the
    one at that name and locks the new one: never two holders at once (a marker file created
    with O_EXCL by each holder), and no lock file is left. Unlinking without that check lets a
    waiter and a newcomer hold "the" lock at once."""
    folder = tmp_path / "c"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder), "300"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(int(out.strip()))
    assert outs == [0, 0, 0]
    assert sorted(p.name for p in folder.iterdir()) == [".space.lock"]
