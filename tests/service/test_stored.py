"""Raw batches sent as stored (`gdsload.service.server.stored`): the server sends members from the page
cache with `sendfile`, the client checks their CRC32s. The batches are the local loader's; an
older client (no `checks_item_crc32`), gRPC without the bulk connection and fields the loader
parses are read by the loader as before; a member changed on disk fails over to an intact copy,
and a shard cut short is DATA_LOSS, never a short batch."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from feedkit import assert_same_batches, local_batches

from gdsload.service.protocol import request
from gdsload.service.client import RemoteLoader
from gdsload.service.server import create_server
from gdsload.service.protocol.status import RemoteError

KW = dict(batch_size=16, shuffle=True, seed=4, decode=False, output="numpy")


def _stored(srv) -> float:
    return srv.metrics.registry.get_sample_value("gdsload_feed_stored_streams_total") or 0.0


def _epoch(address, **kw) -> list[dict]:
    loader = RemoteLoader(address, dataset="imgs", **{**KW, **kw})
    try:
        return list(loader)
    finally:
        loader.close()


@pytest.fixture(scope="module")
def want(roots):
    return local_batches(roots / "imgs", **{k: v for k, v in KW.items() if k != "output"})


@pytest.mark.parametrize("fixture", ["big_server", "server"])  # one message per batch; 64 KiB ones
def test_raw_batches_go_as_stored_and_equal_the_local_loader(request, fixture, want):
    srv, address = request.getfixturevalue(fixture)
    before = _stored(srv)
    got = _epoch(address)
    assert _stored(srv) == before + 1
    assert {k for b in got for k in b} == {"cls", "jpg", "__key__"}  # a label column and bytes
    assert_same_batches([{k: b[k] if k == "cls" else list(b[k]) for k in b} for b in got],
                        [{k: b[k] if k == "cls" else list(b[k]) for k in b} for b in want])
    # resumed mid-epoch from a state dict, as stored too
    loader = RemoteLoader(address, dataset="imgs", **KW)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    loader.close()
    again = RemoteLoader(address, dataset="imgs", **KW)
    again.load_state_dict(state)
    rest = [list(b["__key__"]) for b in again]
    assert rest == [list(b["__key__"]) for b in want[2:]]


def test_a_stripe_over_two_servers_is_sent_as_stored_and_in_plan_order(big_server, server, want):
    """Striping (one stream of blocks per server, `block_stride`) over two servers that both
    send as stored: the local loader's batches, in its order."""
    (a, first), (b, second) = big_server, server
    before = _stored(a), _stored(b)
    got = _epoch([first, second], stripe_batches=1)
    assert _stored(a) > before[0] and _stored(b) > before[1]
    assert [list(x["__key__"]) for x in got] == [list(w["__key__"]) for w in want]
    assert [list(x["jpg"]) for x in got] == [list(w["jpg"]) for w in want]
    assert all(np.array_equal(x["cls"], w["cls"]) for x, w in zip(got, want))


def test_others_are_read_by_the_loader(big_server, want, monkeypatch):
    """No bulk connection, or a client older than `checks_item_crc32`: the loader reads and checks
    on the server, and the batches are the same."""
    srv, address = big_server
    before = _stored(srv)
    plain = _epoch(address, bulk=False)
    made = request.to_request

    def older(*a, **kw):
        req = made(*a, **kw)
        req.checks_item_crc32 = False
        return req

    monkeypatch.setattr(request, "to_request", older)
    old = _epoch(address)
    assert _stored(srv) == before
    monkeypatch.undo()
    feats = RemoteLoader(address, dataset="feats", batch_size=16, output="numpy")  # .npy tensors: parsed
    assert sum(len(b["__key__"]) for b in feats) == 256
    feats.close()
    assert _stored(srv) == before
    for got in (plain, old):
        assert [list(b["__key__"]) for b in got] == [list(b["__key__"]) for b in want]
        assert [list(b["jpg"]) for b in got] == [list(b["jpg"]) for b in want]


@pytest.fixture
def two_copies(roots, tmp_path):
    """Two servers over their own copies of root/imgs."""
    servers, addresses, copies = [], [], []
    for node in ("a", "b"):
        copy = tmp_path / node / "imgs"
        shutil.copytree(roots / "imgs", copy)
        srv, port = create_server([str(copy.parent)])
        srv.start()
        servers.append(srv)
        addresses.append(f"127.0.0.1:{port}")
        copies.append(copy)
    yield servers, addresses, copies
    for srv in servers:
        srv.shutdown(grace_s=1)


def _member(copy, key: str, field: str = "jpg") -> tuple[str, int]:
    """(shard path, offset) of one member of the dataset at `copy`."""
    from gdsload.dataset.sharded import ShardedDataset

    ds = ShardedDataset(str(copy))
    for s in range(len(ds.shards)):
        idx = ds.index(s)
        for j in range(idx.num_samples):
            if idx.key(j) == key:
                rows = range(int(idx.sample_start[j]), int(idx.sample_start[j + 1]))
                row = next(r for r in rows if idx.extensions[idx.member_ext[r]] == field)
                return ds.shard_path(s), int(idx.member_offset[row])
    raise KeyError(key)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:  # in place: the server's open descriptor sees it
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_member_changed_on_disk_fails_over_then_is_data_loss(two_copies, want):
    servers, addresses, copies = two_copies
    key = want[3]["__key__"][5]
    _flip(*_member(copies[0], key))
    got = _epoch(addresses, stripe=False)  # the first address's copy fails the check: the second's is used
    assert [list(b["__key__"]) for b in got] == [list(b["__key__"]) for b in want]
    assert [list(b["jpg"]) for b in got] == [list(b["jpg"]) for b in want]
    assert all(_stored(s) >= 1 for s in servers)

    _flip(*_member(copies[1], key))
    with pytest.raises(RemoteError) as e:
        _epoch(addresses, stripe=False)
    assert e.value.code == "DATA_LOSS"
    assert repr(key) in str(e.value) and "CRC32" in str(e.value) and "changed on disk" in str(e.value)
    assert any("every address" in note for note in e.value.__notes__)


def test_a_shard_cut_short_is_data_loss_not_a_short_batch(two_copies, want):
    servers, addresses, copies = two_copies
    path, offset = _member(copies[0], want[-1]["__key__"][0])
    with open(path, "r+b") as f:
        f.truncate(offset + 10)
    with pytest.raises(RemoteError) as e:  # (caught by the size check of the stream's layout)
        _epoch(addresses[0])
    assert e.value.code == "DATA_LOSS" and path.rsplit("/", 1)[1] in str(e.value)


def test_a_span_past_the_end_of_its_file_cuts_the_message(tmp_path):
    """The server's end: a file shorter than its index says (cut after the stream began) is a
    `CorruptDataError` naming it, and the peer gets part of a frame, never a whole one."""
    import os
    import socket

    from gdsload.errors import CorruptDataError
    from gdsload.service.server.bulk import BulkSink
    from gdsload.service.protocol.wire import FileSpan

    path = tmp_path / "shard-000000.tar"
    path.write_bytes(b"x" * 5000)
    fd = os.open(path, os.O_RDONLY)
    a, b = socket.socketpair()
    try:
        sink = BulkSink(a)
        sink.send([[b"head", FileSpan(fd, 1000, 3000)]])  # within the file: the frame goes whole
        with pytest.raises(CorruptDataError, match="shard-000000.tar: truncated"):
            sink.send([[b"head", FileSpan(fd, 4000, 3000)]])
        a.close()
        got = b"".join(iter(lambda: b.recv(65536), b""))
        assert got[12:16] == b"head" and got[16:3016] == b"x" * 3000
        assert len(got) == 2 * 12 + 4 + 3000 + 4 + 1000  # the second frame announced 3004 bytes, got 1004
    finally:
        os.close(fd)
        b.close()
