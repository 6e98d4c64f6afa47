"""The server's stored path, call by call (issue 48: its CPU per stored member): `BulkSink.send`
writes messages that mix buffers and runs of stored members byte for byte as framed, and
`StoredBatches.open` works a loader's answer out once (a striping client's next stream takes the
parked loader)."""

from __future__ import annotations

import gc
import os
import socket
import threading

import numpy as np

from gdsload.service.protocol.framing import FRAME
from gdsload.service.protocol.wire import FileSpan
from gdsload.service.server.bulk import BulkSink
from gdsload.service.server.stored import StoredBatches


def _received(sock: socket.socket, out: list[bytes]) -> None:
    while chunk := sock.recv(65536):
        out.append(chunk)


def test_messages_of_buffers_and_runs_of_stored_members_go_byte_for_byte(tmp_path):
    data = bytes(range(256)) * 40
    path = tmp_path / "shard-000000.tar"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    a, b = socket.socketpair()
    got: list[bytes] = []
    reader = threading.Thread(target=_received, args=(b, got))
    reader.start()
    arr = np.arange(6, dtype=np.int32)
    messages = [
        [b"HEAD", FileSpan(fd, 0, 10), FileSpan(fd, 5000, 3), memoryview(b"mid"), arr.view(np.uint8),
         FileSpan(fd, 100, 7), b"tail"],  # buffers, a run of two members, buffers, a member, a buffer
        [b"H2", FileSpan(fd, 9000, 1000)],  # a member last
        [b"only buffers", bytearray(b"!")],
        [b"H3"],  # a head alone (a chunk without data)
    ]
    try:
        sink = BulkSink(a)
        sink.send(messages[:2])
        sink.send(messages[2:])
        sink.finish()
    finally:
        a.close()
        reader.join(10)
        os.close(fd)
        b.close()
    assert not reader.is_alive()
    want = b""
    for pieces in messages:
        body = b"".join(data[p.offset:p.offset + p.nbytes] if type(p) is FileSpan else bytes(p) for p in pieces)
        want += FRAME.pack(len(body), len(pieces[0])) + body
    want += FRAME.pack(0, 0)  # the end marker
    assert b"".join(got) == want


class _Shards:
    def __init__(self, n: int, local: bool = True):
        self.shards = [{}] * n
        self.local = local
        self.asked = 0

    def local_fd(self, s: int) -> int | None:
        self.asked += 1
        return 10 + s if self.local else None


class _Loader:
    """What `StoredBatches.open` reads of a loader: its planner and its dataset's shards."""

    def __init__(self, shards: _Shards, unsupported: str | None = None):
        planner = type("Planner", (), {"spans_unsupported": lambda _self: unsupported, "fields": ()})()
        self.batch_layout = lambda: type("Layout", (), {"planner": planner})()
        self.dataset = type("Dataset", (), {"shards": shards})()


def test_a_loaders_stored_batches_are_worked_out_once_and_dropped_with_it():
    shards = _Shards(5)
    loader = _Loader(shards)
    first, why = StoredBatches.open(loader)
    assert first is not None and why == "" and first.fds.tolist() == [10, 11, 12, 13, 14]
    assert StoredBatches.open(loader)[0] is first  # the parked loader's next stream
    assert shards.asked == 5
    other = _Loader(shards)  # another loader of the same dataset: its own answer
    assert StoredBatches.open(other)[0] is not first and shards.asked == 10
    # refusals are per loader too, with their reason
    assert StoredBatches.open(_Loader(_Shards(2, local=False))) == (None, "a shard of the dataset is not a local file")
    assert StoredBatches.open(_Loader(_Shards(2), unsupported="a .npy field")) == (None, "a .npy field")
    from gdsload.service.server import stored

    held = len(stored._OPENED)
    del loader, first
    gc.collect()
    assert len(stored._OPENED) == held - 1  # the dropped loader's entry went with it
