"""Appends while a feed serves the dataset (round 4, row 4): a reader that started on a version
finishes its epoch on that version, a state names its version and resumes on it, and
`RemoteLoader(version=K)` reads version K as `gdsload.Dataset(path, version=K)` does.

Before: `convert --append` to a served dataset made every striped `RemoteLoader` fail with
FAILED_PRECONDITION ("rewritten") after 1,920 of 2,100 keys, and its state could not be resumed
over the feed. The version is named by the request's dataset id (which an old server already
refuses when it differs), not by a new field an old server would ignore."""

from __future__ import annotations

import numpy as np
import pytest

import gdsload
from gdsload.errors import StateError
from gdsload.service.client import RemoteLoader
from gdsload.service.server import create_server

B = 4


def samples(start: int, n: int):
    for i in range(start, start + n):
        yield {"__key__": f"k{i:04d}", "x.npy": np.full((4,), i, np.float32), "cls": i % 2}


def write(root, start: int, n: int, append: bool = False):
    with gdsload.ShardWriter(root, shard_size="20KB", append=append, classes=["even", "odd"]) as w:
        for s in samples(start, n):
            w.write(s)


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "root"
    write(root / "ds", 0, 40)
    srv, port = create_server([str(root)])
    srv.start()
    yield root / "ds", f"127.0.0.1:{port}"
    srv.shutdown(grace_s=1)


def remote(address, **kw):
    kw = {"dataset": "ds", "batch_size": B, "shuffle": True, "seed": 3, "output": "numpy", "device": "cpu",
          "stripe_batches": 1, "server_window": 1, "prefetch": 1, **kw}
    return RemoteLoader(address, **kw)


def local_keys(path, **kw):
    loader = gdsload.DataLoader(gdsload.Dataset(str(path), **kw), batch_size=B, shuffle=True, seed=3,
                                device="cpu", output="numpy")
    return [k for b in loader for k in b["__key__"]]


@pytest.mark.parametrize("striped", [False, True])
def test_a_reader_finishes_its_epoch_on_the_version_it_started(served, striped):
    path, address = served
    want = local_keys(path)
    lo = remote([address, address] if striped else address)
    it = iter(lo)
    seen = [k for _ in range(3) for k in next(it)["__key__"]]
    state = lo.state_dict()
    write(path, 40, 24, append=True)  # the server reopens the dataset: version 2, 64 samples
    seen += [k for b in it for k in b["__key__"]]
    assert seen == want  # exactly version 1's epoch, in its order
    # a state saved on version 1 resumes on it: RemoteLoader(version=1)
    again = remote(address, version=1)
    again.load_state_dict(state)
    assert [k for b in again for k in b["__key__"]] == want[3 * B:]
    # a loader on the current version refuses it, naming what happened and how to finish it
    fresh = remote(address)
    assert len(fresh) == 16
    with pytest.raises(StateError, match=r"24 samples appended since this state was saved.*RemoteLoader\(\.\.\., version=K\)"):
        fresh.load_state_dict(state)
    for x in (lo, again, fresh):
        x.close()


def test_version_k_reads_what_the_local_dataset_at_version_k_reads(served):
    path, address = served
    write(path, 40, 24, append=True)
    v1 = remote(address, version=1)
    assert len(v1) == 10 and v1.state_dict()["dataset"] == gdsload.Dataset(str(path), version=1).dataset_id
    assert [k for b in v1 for k in b["__key__"]] == local_keys(path, version=1)
    v2 = remote(address, version=2)
    assert [k for b in v2 for k in b["__key__"]] == local_keys(path)
    with pytest.raises(gdsload.GdsloadError, match="no version 3"):
        len(remote(address, version=3))
    with pytest.raises(gdsload.GdsloadError, match="version must be"):
        remote(address, version=0)
