"""The bulk connection (`gdsload.service.server.bulk`): a stream's messages on a plain socket beside its
call. Same batches as over gRPC and as the local loader; taken by default, refused cleanly, and
every way of ending a stream ends both."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from gdsload import DataLoader, RemoteLoader
from gdsload.service.server import bulk as server_bulk
from gdsload.service.client import bulk as client_bulk
from gdsload.service.protocol import framing
from gdsload.service.server import create_server
from gdsload.v1 import feed_pb2 as pb


def _bulk_streams(srv) -> float:
    return srv.metrics.registry.get_sample_value("gdsload_feed_bulk_streams_total") or 0.0


def _batches(loader) -> list[dict]:
    return [{k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else list(v)) for k, v in b.items()}
            for b in loader]


def _same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["__key__"] == w["__key__"]
        for k in w:
            if k != "__key__":
                assert np.array_equal(np.asarray(g[k]), np.asarray(w[k])), k


@pytest.mark.parametrize("fixture", ["big_server", "server"])  # one message per batch; many (64 KiB)
def test_bulk_batches_equal_grpc_and_local(roots, request, fixture):
    srv, address = request.getfixturevalue(fixture)
    kw = dict(dataset="feats", batch_size=24, shuffle=True, seed=3, output="numpy")
    local = _batches(DataLoader(str(roots / "feats"), batch_size=24, shuffle=True, seed=3, output="numpy"))
    before = _bulk_streams(srv)
    over_bulk = RemoteLoader(address, **kw)
    got = _batches(over_bulk)
    assert _bulk_streams(srv) == before + 1  # taken by default
    _same(got, local)
    # tensors are writable views of the received buffer (no copy), as over gRPC they are copies
    assert all(b["npy"].flags.writeable for b in got)
    plain = _batches(RemoteLoader(address, bulk=False, **kw))
    assert _bulk_streams(srv) == before + 1  # bulk=False: inside gRPC
    _same(plain, local)


def test_received_bodies_are_reused_only_once_their_batch_is_gone(big_server, roots, monkeypatch):
    """A loader receives into buffers of its own pool (`_Channels.bodies`): a batch the training
    loop still holds is never written over, and one it let go of gives its buffer to a later
    batch instead of a new one (whose pages the kernel would clear again). (Bodies from 2 MiB
    on are pooled; here every one is.)"""
    from gdsload.service.protocol import wire

    monkeypatch.setattr(wire, "POOLED_BODY_BYTES", 0)
    srv, address = big_server
    kw = dict(batch_size=16, shuffle=True, seed=5, output="numpy")
    local = _batches(_epoch(roots, kw, 0))
    loader = RemoteLoader(address, dataset="feats", **kw)
    held = list(loader)  # every batch of the epoch kept, as received (views of their bodies)
    _same(held, local)
    pool = loader._link.channels.bodies
    assert pool.allocated >= len(held)  # each held batch has a buffer of its own
    made = pool.allocated
    del held
    loader.set_epoch(1)
    local = _batches(_epoch(roots, kw, 1))
    _same(_batches(loader), local)  # each batch dropped once copied
    assert pool.allocated == made  # the second epoch only reused buffers
    loader.close()


def _epoch(roots, kw, epoch):
    dl = DataLoader(str(roots / "feats"), **kw)
    dl.set_epoch(epoch)
    return dl


def test_raw_bytes_fields_over_bulk(big_server, roots):
    srv, address = big_server
    want = _batches(DataLoader(str(roots / "imgs"), batch_size=16, decode=False, output="numpy"))
    got = list(RemoteLoader(address, dataset="imgs", batch_size=16, decode=False, output="numpy"))
    assert [b["__key__"] for b in got] == [w["__key__"] for w in want]
    for g, w in zip(got, want):
        assert [bytes(x) for x in g["jpg"]] == [bytes(x) for x in w["jpg"]]


def test_a_server_without_bulk_streams_inside_grpc(roots):
    srv, port = create_server([str(roots)], bulk=False)
    srv.start()
    try:
        assert srv.servicer.bulk is None
        n = sum(len(b["__key__"]) for b in RemoteLoader(f"127.0.0.1:{port}", dataset="feats", batch_size=64,
                                                      output="numpy"))
        assert n == 256 and not _bulk_streams(srv)
    finally:
        srv.shutdown(grace_s=1)


def test_an_unreachable_bulk_port_falls_back_to_grpc_once(roots):
    """A client that cannot connect to the offered port (here: the listener is gone, as behind a
    firewall) cancels the call, asks again without bulk, and does not try that address again."""
    srv, port = create_server([str(roots)])
    srv.start()
    try:
        srv.servicer.bulk.close()  # the port refuses connections from now on (the offer still goes out)
        loader = RemoteLoader(f"127.0.0.1:{port}", dataset="feats", batch_size=64, output="numpy")
        assert sum(len(b["__key__"]) for b in loader) == 256
        assert sum(len(b["__key__"]) for b in loader) == 256  # a second epoch: straight to gRPC
        stub = loader._link.channels.stub(f"127.0.0.1:{port}")
        assert stub.bulk_refused  # why, e.g. "Connection refused"
        assert not _bulk_streams(srv)
        deadline = time.monotonic() + 5
        while srv.servicer.active_streams() and time.monotonic() < deadline:  # the refused call ended
            time.sleep(0.05)
        assert srv.servicer.active_streams() == 0
    finally:
        srv.shutdown(grace_s=1)


def test_a_wrong_ticket_is_closed_and_the_stream_goes_on(big_server):
    srv, address = big_server
    with socket.create_connection(("127.0.0.1", srv.servicer.bulk.port), timeout=5) as s:
        s.sendall(os.urandom(framing.TICKET_BYTES))
        assert s.recv(1) == b""  # closed without a word
    assert sum(len(b["__key__"]) for b in RemoteLoader(address, dataset="feats", batch_size=64,
                                                       output="numpy")) == 256


def test_a_client_that_never_connects_ends_its_stream(big_server, monkeypatch):
    """The offer is taken but nobody connects: the server gives up after WAIT_S (shortened here)
    with UNAVAILABLE, holding nothing."""
    import grpc

    srv, address = big_server
    monkeypatch.setattr(srv.servicer.bulk, "connection",
                        lambda ticket, slot, timeout=0.5, cancelled=None: server_bulk.BulkListener.connection(
                            srv.servicer.bulk, ticket, slot, timeout=0.5, cancelled=cancelled))
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream("/gdsload.v1.Feed/StreamBatches", request_serializer=pb.BatchRequest.SerializeToString,
                               response_deserializer=pb.BatchChunk.FromString)(
            pb.BatchRequest(dataset="feats", batch_size=8, bulk=True), timeout=10)
        first = next(call)
        assert first.HasField("bulk") and len(first.bulk.ticket) == framing.TICKET_BYTES and first.bulk.port
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "bulk connection" in err.value.details()


def test_a_sink_says_when_its_client_reads_nothing():
    """`BulkSink.full` (the priority arbiter's test of a send that does not move: held up by its
    client, or by the server's CPU): the kernel's buffers full, or the connection gone."""
    mine, theirs = socket.socketpair()
    sink = server_bulk.BulkSink(mine)
    try:
        assert not sink.full()
        mine.setblocking(False)
        with pytest.raises(BlockingIOError):
            while True:  # the client reads nothing
                mine.send(b"x" * 65536)
        mine.setblocking(True)
        assert sink.full()
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            while True:  # it reads everything
                theirs.recv(1 << 20)
        assert not sink.full()
        sink.close()
        assert sink.full()
    finally:
        theirs.close()


def test_a_sink_with_a_progress_hook_says_when_its_client_stops_reading():
    """A send watched by the priority arbiter (a progress hook) writes without blocking: when the
    connection fills it calls the hook with True (the send now waits for its client), waits, and
    goes on when the client reads; every byte arrives in order."""
    mine, theirs = socket.socketpair()
    sink = server_bulk.BulkSink(mine)
    payload = os.urandom(8 << 20)  # far more than the kernel's buffers
    calls: list = []
    th = threading.Thread(target=lambda: sink.send([[payload[:16], payload[16:]]], lambda *a: calls.append(a)))
    try:
        th.start()
        deadline = time.monotonic() + 10
        while (True,) not in calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (True,) in calls and th.is_alive()  # full: it waits for its client
        got = bytearray()
        head = framing.FRAME.size
        while len(got) < len(payload) + head:
            got += theirs.recv(1 << 20)
        th.join(10)
        assert not th.is_alive()
        assert bytes(got[head:]) == payload  # (after the frame's header)
        assert mine.getblocking()  # (blocking again for the next send)
    finally:
        sink.close()
        theirs.close()


def test_cancelling_mid_stream_ends_the_server_side(big_server, monkeypatch):
    """A consumer that leaves mid-epoch (the loader's epoch closed) cancels the call; the server's
    write, blocked on a full socket, breaks and the stream ends."""
    srv, address = big_server
    real_init, real_connect = server_bulk.BulkSink.__init__, client_bulk._connect
    sinks = []

    def small_sink(self, conn, *args, **kw):  # socket buffers far smaller than the epoch: the server blocks
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        real_init(self, conn, *args, **kw)
        sinks.append(self)

    def small_connect(target, port):
        sock = real_connect(target, port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        return sock

    monkeypatch.setattr(server_bulk.BulkSink, "__init__", small_sink)
    monkeypatch.setattr(client_bulk, "_connect", small_connect)
    loader = RemoteLoader(address, dataset="feats", batch_size=8, output="numpy", prefetch=1)
    it = iter(loader)
    next(it)
    time.sleep(0.3)  # the server fills the socket buffers and blocks
    assert srv.servicer.active_streams() == 1  # blocked in its write
    assert sinks[-1].full()  # (held up by its client: it wants nothing of a priority arbiter)
    it.close()
    deadline = time.monotonic() + 10
    while srv.servicer.active_streams() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.servicer.active_streams() == 0
    # the cancelled stream's loader was parked, as one that ended well: the same request's next
    # stream (a hedged block's next try, say) does not build a new one
    monkeypatch.undo()
    hits = srv.servicer.warm_hits
    again = RemoteLoader(address, dataset="feats", batch_size=8, output="numpy", prefetch=1)
    assert sum(len(b["__key__"]) for b in again) == 256
    assert srv.servicer.warm_hits == hits + 1


def test_unix_server_bulk_socket_beside_its_own(roots, tmp_path):
    path = tmp_path / "feed.sock"
    srv, _ = create_server([str(roots)], address=f"unix:{path}")
    srv.start()
    try:
        assert os.path.exists(f"{path}.bulk")
        n = sum(len(b["__key__"]) for b in RemoteLoader(f"unix:{path}", dataset="feats", batch_size=64,
                                                      output="numpy"))
        assert n == 256 and _bulk_streams(srv) == 1
    finally:
        srv.shutdown(grace_s=1)
    assert not os.path.exists(f"{path}.bulk")


def test_a_connection_cut_inside_a_message_is_a_retried_stream(big_server, roots, monkeypatch):
    """The first bulk connection of the loader ends halfway through a message: the batch is
    dropped, the stream resumed from the cursor, and every sample arrives once, in order."""
    srv, address = big_server
    real = server_bulk.BulkSink.send
    cut = threading.Event()

    def send_then_cut(self, frames, progress=None):
        if not cut.is_set():
            pieces = next(iter(frames))
            cut.set()
            whole = b"".join(bytes(memoryview(p)) for p in pieces)
            head = memoryview(pieces[0]).nbytes
            self.conn.sendall(framing.FRAME.pack(len(whole), head) + whole[: head + (len(whole) - head) // 2])
            raise server_bulk.ClientGone("cut by the test")
        return real(self, frames, progress)

    monkeypatch.setattr(server_bulk.BulkSink, "send", send_then_cut)
    want = [b["__key__"] for b in DataLoader(str(roots / "feats"), batch_size=32, output="numpy")]
    got = [b["__key__"] for b in RemoteLoader(address, dataset="feats", batch_size=32, output="numpy")]
    assert cut.is_set() and got == want


def test_a_clients_next_stream_reuses_its_connection(big_server, roots, monkeypatch):
    """Streams that end cleanly leave their connection to the client's next stream (a striping
    client opens one per block); one the server closed while idle is replaced, nothing lost."""
    srv, address = big_server
    want = [b["__key__"] for b in DataLoader(str(roots / "feats"), batch_size=32, output="numpy")]
    loader = RemoteLoader(address, dataset="feats", batch_size=32, output="numpy", batches_per_stream=2)
    accepted, streams = srv.servicer.bulk.accepted, _bulk_streams(srv)
    assert [b["__key__"] for b in loader] == want  # 4 streams of 2 batches
    assert _bulk_streams(srv) == streams + 4
    assert srv.servicer.bulk.accepted == accepted + 1
    # the server drops idle connections after IDLE_S: the client's kept one is then dead
    monkeypatch.setattr(server_bulk, "IDLE_S", 0.2)
    assert [b["__key__"] for b in loader] == want
    time.sleep(0.6)
    assert [b["__key__"] for b in loader] == want
    assert srv.servicer.bulk.accepted >= accepted + 2


def test_a_call_cancelled_after_the_offer_leaves_no_ticket(big_server):
    import grpc

    srv, address = big_server
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream("/gdsload.v1.Feed/StreamBatches", request_serializer=pb.BatchRequest.SerializeToString,
                               response_deserializer=pb.BatchChunk.FromString)(
            pb.BatchRequest(dataset="feats", batch_size=8, bulk=True), timeout=10)
        assert next(call).HasField("bulk")
        call.cancel()
    deadline = time.monotonic() + 5
    while (srv.servicer.bulk._waiting or srv.servicer.active_streams()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.servicer.bulk._waiting


def test_a_fixed_bulk_port_and_bad_ones(roots):
    from gdsload.errors import GdsloadError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    srv, port = create_server([str(roots)], bulk_port=free)
    srv.start()
    try:
        assert srv.servicer.bulk.port == free
        assert sum(len(b["__key__"]) for b in RemoteLoader(f"127.0.0.1:{port}", dataset="feats", batch_size=64,
                                                         output="numpy")) == 256
        assert _bulk_streams(srv) == 1
    finally:
        srv.shutdown(grace_s=1)
    for bad in (70000, -1, True):
        with pytest.raises(GdsloadError, match="--bulk-port"):
            create_server([str(roots)], bulk_port=bad)
    with pytest.raises(GdsloadError, match="--bulk-port"):
        create_server([str(roots)], address=f"127.0.0.1:{free}", bulk_port=free)
