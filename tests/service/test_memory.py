"""The server-wide memory budget (`--max-memory`): each stream reserves an upper bound of what its
loader holds; a stream that does not fit next to the open ones is refused with UNAVAILABLE (its
client retries), one larger than the whole budget with RESOURCE_EXHAUSTED; what a stalled client
leaves on the server stays inside its reservation. Real servers on loopback."""

from __future__ import annotations

import time

import grpc
import pytest
from feedkit import free_port, spawn_server

from gdsload.service.client import RemoteLoader
from gdsload.service.protocol.config import Limits, default_max_memory, machine_memory_bytes
from gdsload.service.server import create_server
from gdsload.service.server.estimate import STREAM_OVERHEAD_BYTES
from gdsload.service.protocol.status import RemoteError
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc

REQ = dict(dataset="feats", batch_size=32)


def _stub(address, **options):
    return pb_grpc.FeedStub(grpc.insecure_channel(address, options=list(options.items())))


def _info(address) -> pb.ServerInfo:
    return _stub(address).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def _stalled(address, **kw):
    """A stream whose client read one chunk and then stopped reading. Its HTTP/2 window stays at
    64 KiB (no BDP probing), less than the epoch, so the server cannot finish the stream."""
    call = _stub(address, **{"grpc.http2.bdp_probe": 0}).StreamBatches(pb.BatchRequest(**{**REQ, **kw}), timeout=60)
    next(call)
    return call


def _wait_for(predicate, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reservation(roots):
    """The bytes one stalled REQ stream reserves, as the server reports it."""
    srv, port = create_server([str(roots)], max_message_bytes=64 * 1024)
    srv.start()
    address = f"127.0.0.1:{port}"
    try:
        assert _info(address).memory_in_use_bytes == 0
        call = _stalled(address)
        info = _info(address)
        assert info.active_streams == 1 and info.memory_in_use_bytes > 0
        call.cancel()
        _wait_for(lambda: _info(address).memory_in_use_bytes == 0)
        return info.memory_in_use_bytes
    finally:
        srv.shutdown(grace_s=1)


def test_the_reservation_bounds_what_the_stream_allocates(roots, reservation):
    """The same loader the server runs for REQ (workers 2, prefetch 2), built locally: its ring
    is within the reservation."""
    from gdsload.loader.dataloader import DataLoader, Dataset

    dl = DataLoader(Dataset(str(roots / "feats")), batch_size=32, num_workers=2, prefetch_factor=2,
                    device="cpu", output="numpy", copy=False)
    try:
        next(iter(dl))
        ring = dl._resources.ring.stats()["nbytes_total"]
    finally:
        dl.close()
    assert ring <= reservation <= 2 * ring + STREAM_OVERHEAD_BYTES + 2 * 64 * 1024, (ring, reservation)


def test_a_stream_that_does_not_fit_waits_with_unavailable(roots, reservation):
    srv, port = create_server([str(roots)], max_message_bytes=64 * 1024,
                              limits=Limits(max_message_bytes=64 * 1024, max_memory_bytes=reservation * 3 // 2))
    srv.start()
    address = f"127.0.0.1:{port}"
    try:
        assert _info(address).max_memory_bytes == reservation * 3 // 2
        first = _stalled(address)
        with pytest.raises(grpc.RpcError) as e:
            next(_stub(address).StreamBatches(pb.BatchRequest(**REQ), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "memory budget" in e.value.details()
        with pytest.raises(RemoteError) as e2:  # a client without retries sees it as such
            list(RemoteLoader(address, output="numpy", max_retries=0, decode=False, **REQ))
        assert e2.value.code == "UNAVAILABLE"
        # a client with retries waits for the memory and then reads its whole epoch
        waiting = RemoteLoader(address, output="numpy", max_retries=100, backoff_s=0.05, max_backoff_s=0.2,
                               decode=False, **REQ)
        it = iter(waiting)
        time.sleep(0.3)
        first.cancel()
        keys = [k for b in it for k in b["__key__"]]
        assert len(keys) == 256 and len(set(keys)) == 256
        assert waiting.stats()["reconnects"] >= 1
        _wait_for(lambda: _info(address).memory_in_use_bytes == 0)
    finally:
        srv.shutdown(grace_s=1)


def test_a_stream_over_the_whole_budget_is_resource_exhausted(roots, reservation):
    """Budget: exactly one REQ stream; a stream of twice the batch can never fit."""
    srv, port = create_server([str(roots)], limits=Limits(max_message_bytes=64 * 1024,
                                                          max_memory_bytes=reservation))
    srv.start()
    try:
        with pytest.raises(grpc.RpcError) as e:
            next(_stub(f"127.0.0.1:{port}").StreamBatches(pb.BatchRequest(dataset="feats", batch_size=64),
                                                         timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "memory budget" in e.value.details() and "--max-memory" in e.value.details()
    finally:
        srv.shutdown(grace_s=1)


def test_max_memory_flag_and_default(roots, tmp_path):
    assert Limits().max_memory_bytes == default_max_memory() == machine_memory_bytes() // 2 > 0
    port = free_port()
    proc = spawn_server(roots, port, tmp_path / "server.log", "--max-memory", "3MiB")
    try:
        info = _info(f"127.0.0.1:{port}")
        assert info.max_memory_bytes == 3 * 2**20
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_a_client_that_stops_reading_stops_the_server(roots):
    """Batches go out only as far as the client's flow-control window: with 64 KiB and 64 KiB
    chunks the server hands over at most two batches of the 8 and then waits, holding only its
    reservation (the ring), not a growing queue."""
    srv, port = create_server([str(roots)], max_message_bytes=64 * 1024)
    srv.start()
    try:
        call = _stalled(f"127.0.0.1:{port}")
        time.sleep(1.5)
        sent = [line for line in srv.metrics.text().splitlines() if line.startswith("gdsload_feed_batches_total")]
        assert sent and float(sent[0].split()[-1]) <= 2, sent
        assert srv.servicer.active_streams() == 1
        call.cancel()
    finally:
        srv.shutdown(grace_s=1)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc")
def test_a_stalled_decoding_stream_stays_within_its_reservation(roots, tmp_path):
    """The server process's memory growth while one decoding stream (224 px float32) is stalled
    stays under what the stream reserved: the budget is an upper bound, so admitting by it keeps
    the server out of the OOM killer."""
    pytest.importorskip("nvidia.dali")
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = spawn_server(roots, port, tmp_path / "server.log")
    try:
        warm = dict(dataset="imgs", payload=pb.PAYLOAD_DECODED, fields=["jpg"])
        list(_stub(address).StreamBatches(pb.BatchRequest(batch_size=2, max_batches=1, **warm), timeout=60))
        time.sleep(0.5)
        before = _rss(proc.pid)
        call = _stub(address, **{"grpc.http2.bdp_probe": 0}).StreamBatches(
            pb.BatchRequest(batch_size=32, **warm), timeout=60)
        next(call)
        time.sleep(3)  # the ring fills, then the stream waits on the client
        grown = _rss(proc.pid) - before
        reserved = _info(address).memory_in_use_bytes
        assert 0 < grown <= reserved, (grown, reserved)
        call.cancel()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
