"""The server's stored path, call by call (issue 48: its CPU per stored member): `BulkSink.send`
writes messages that mix buffers and runs of stored members byte for byte as framed, and
`StoredBatches.open` works a loader's answer out once, and `loaders.PlannedIds` keeps the ids of
the steps its streams computed (a striping client's next stream takes the parked loader)."""

from __future__ import annotations

import gc
import os
import socket
import threading
import weakref

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
    dropped, its_batches = weakref.ref(loader), weakref.ref(first)
    del loader, first
    gc.collect()
    assert dropped() is None and its_batches() is None  # the answer went with its loader


def _old_spans(col) -> list:
    """`StoredColumn.spans` as it was: a loop over the members (the reference)."""
    out: list = []
    for fd, off, n in zip(col.fds.tolist(), col.offsets.tolist(), col.sizes.tolist()):
        if not n:
            continue
        if out and out[-1].fd == fd and out[-1].offset + out[-1].nbytes == off:
            out[-1] = FileSpan(fd, out[-1].offset, out[-1].nbytes + n)
        else:
            out.append(FileSpan(fd, off, n))
    return out


def _old_cut_pieces(pieces, first_room: int, room: int):
    """`wire._cut_pieces` as it was: a loop over the pieces (the reference)."""
    from gdsload.service.protocol.wire import _cut

    queue = iter(pieces)
    current = None
    n = left = 0
    want = first_room
    while True:
        parts, got = [], 0
        while got < want:
            if not left:
                current = next(queue, None)
                if current is None:
                    break
                n = left = current.nbytes if type(current) is FileSpan else memoryview(current).nbytes
            if left == n and left <= want - got:
                parts.append(current)
                got += n
                left = 0
            else:
                take = min(left, want - got)
                parts.append(_cut(current, n - left, take))
                got += take
                left -= take
        yield parts, got
        want = room


def _flat(part) -> tuple:
    return ("span", *part) if type(part) is FileSpan else ("bytes", bytes(part))


def test_spans_and_chunks_are_those_of_the_member_by_member_loops():
    """The array and bisection versions (no Python call per member) give the spans and chunks
    the loops gave, piece for piece: runs of members that follow each other in a file merged,
    members of no bytes left out, pieces whole where they fit and cut where they do not."""
    from gdsload.service.protocol.wire import StoredColumn, _cut_pieces

    rng = np.random.default_rng(48)
    for trial in range(300):
        n = int(rng.integers(0, 40))
        sizes = rng.integers(0, 3, n) * rng.integers(1, 5000, n)  # some members of no bytes
        fds = rng.integers(3, 3 + int(rng.integers(1, 4)), n)
        offs = rng.integers(0, 10**6, n)
        follow = rng.random(n) < 0.4  # members right after the one before, in its file
        for k in range(1, n):
            if follow[k]:
                fds[k], offs[k] = fds[k - 1], offs[k - 1] + sizes[k - 1]
        col = StoredColumn(fds.astype(np.int64), offs.astype(np.int64), sizes.astype(np.int64), None)
        spans = col.spans()
        assert spans == _old_spans(col) and all(type(s) is FileSpan for s in spans)
        assert all(type(v) is int for s in spans for v in s)
        pieces = [p for s in spans for p in (s, b"x" * int(rng.integers(1, 300)))][: int(rng.integers(0, 2 * n + 1))]
        total = sum(p.nbytes if type(p) is FileSpan else len(p) for p in pieces)
        first_room, room = int(rng.integers(1, 9000)), int(rng.integers(1, 9000))
        new, old = _cut_pieces(pieces, first_room, room), _old_cut_pieces(pieces, first_room, room)
        sent = 0
        while True:
            (parts, got), (want_parts, want_got) = next(new), next(old)
            assert got == want_got and [_flat(p) for p in parts] == [_flat(p) for p in want_parts], trial
            sent += got
            if sent >= total:
                break


class _CountingPlan:
    """A real order-2 plan whose `batches_at` counts the steps it is given."""

    def __init__(self, plan):
        self.plan, self.batch_size, self.given = plan, plan.batch_size, 0

    def batches_at(self, epoch, steps):
        self.given += len(steps)
        return self.plan.batches_at(epoch, steps)


def test_a_plans_next_stream_takes_the_ids_its_last_streams_planned():
    """`loaders.PlannedIds`: the ids of a stream's steps are the plan's; a later stream of the
    same epoch over steps planned before (a striped server's stream asked again from its next
    own block, on any loader of the plan) plans none of them again; two epochs are kept; at most
    KEEP_POSITIONS positions' worth of steps each, the oldest dropped first."""
    from gdsload.plan.plan import BlockSteps, Plan, PlanBatches
    from gdsload.service.server.loaders import PlannedIds

    plan = _CountingPlan(Plan("ds", (30000, 25000, 40000, 5000), 64, shuffle=True, seed=3, order=2))
    n, ahead = len(plan.plan), PlanBatches.CHUNK_POSITIONS // 64
    kept = PlannedIds()
    first = BlockSteps(4, n, 4, 3)  # blocks 1, 4, 7, ... of 4 steps: 520 of them
    assert len(first) > ahead
    it = kept.stream(plan, 2, first)
    got = [next(it) for _ in range(10)]  # a stream cancelled after 10 batches
    assert all(np.array_equal(a, plan.plan.batch(2, s)) for a, s in zip(got, first))
    assert plan.given == kept.planned == ahead  # the stream's next chunk of steps
    again = BlockSteps(28, n, 4, 3)  # asked again from block 7: its first chunk planned before
    got = list(kept.stream(plan, 2, again))
    assert all(np.array_equal(a, plan.plan.batch(2, s)) for a, s in zip(got, again))
    assert plan.given == ahead + (len(again) - (ahead - 8))  # only the steps past the first plan
    wider = range(20, 40)  # a stolen run: blocks 5 and 6 (not the stream's) planned now
    assert all(np.array_equal(a, plan.plan.batch(2, s)) for a, s in zip(kept.stream(plan, 2, wider), wider))
    given = plan.given
    assert given == ahead + len(again) - (ahead - 8) + 20
    other = list(kept.stream(plan, 3, range(0, 4)))  # the next epoch: its own ids
    assert all(np.array_equal(a, plan.plan.batch(3, s)) for a, s in zip(other, range(4)))
    list(kept.stream(plan, 2, range(30, 34)))  # the epoch before is still kept
    assert plan.given == given + 4
    list(kept.stream(plan, 4, range(0, 4)))  # a third epoch: the oldest, 2, dropped
    list(kept.stream(plan, 2, range(30, 34)))
    assert plan.given == given + 12
    kept.KEEP_POSITIONS = 64 * 300  # 300 steps of 64, at least 2 chunks (256)
    list(kept.stream(plan, 5, range(0, 300)))
    list(kept.stream(plan, 5, range(300, 400)))
    given = plan.given
    list(kept.stream(plan, 5, range(100, 400)))  # kept: the newest 300 steps
    list(kept.stream(plan, 5, range(0, 1)))  # dropped
    assert plan.given == given + 1
