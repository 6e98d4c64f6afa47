"""A damaged index behind a real server (in-process, port 0): an entry sized 2**40 is DATA_LOSS
naming the index file, not INTERNAL from a MemoryError, and the other datasets stay served."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gdsload.format.index import ShardIndex
from gdsload.convert.shards import DatasetWriter
from gdsload.service.client import RemoteLoader
from gdsload.service.server import create_server
from gdsload.service.protocol.status import RemoteError


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged-root")
    for name in ("bad", "good"):
        with DatasetWriter(root / name) as w:
            for i in range(6):
                w.write(f"k{i}", {"npy": _npy(np.full((16, 64), i, np.float32)), "cls": b"%d" % i})
    idx_path = root / "bad" / "shard-000000.idx"
    idx = ShardIndex.load(idx_path)
    sizes = idx.member_size.copy()
    sizes[3] = 2**40
    idx_path.write_bytes(dataclasses.replace(idx, member_size=sizes).to_bytes())
    srv, port = create_server([str(root)])
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.shutdown(grace_s=1)


def _npy(a: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_damaged_index_is_data_loss_naming_the_file(damaged):
    loader = RemoteLoader(damaged, dataset="bad", batch_size=3, output="numpy", max_retries=0)
    with pytest.raises(RemoteError) as e:
        for _ in loader:
            pass
    assert e.value.code == "DATA_LOSS", e.value
    assert "shard-000000.idx" in str(e.value) and "outside its shard" in str(e.value)


def test_other_datasets_are_still_served(damaged):
    loader = RemoteLoader(damaged, dataset="good", batch_size=3, output="numpy", max_retries=0)
    assert sorted(k for b in loader for k in b["__key__"]) == [f"k{i}" for i in range(6)]
