"""Connections to the bulk port that present no ticket (issue 46 row 7): they cost no server
thread, at most `Limits.max_pending_connections` (`gdsload serve --max-pending-connections`) are
kept, more are closed as they are accepted, and each has `Limits.bulk_ticket_s` for its whole
ticket however slowly its bytes come (the timeout was per read: a byte every 4 s kept a
connection, and its thread, forever)."""

from __future__ import annotations

import os
import select
import socket
import threading
import time

import grpc
import pytest
from feedkit import free_port, spawn_server

from gdsload import RemoteLoader
from gdsload.service.server import bulk as server_bulk
from gdsload.service.client import bulk as client_bulk
from gdsload.service.protocol import framing
from gdsload.service.protocol.config import Limits
from gdsload.service.server import create_server
from gdsload.v1 import feed_pb2 as pb


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (EOF or reset); never blocks."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _connect_many(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def _serve(roots, **limits):
    srv, port = create_server([str(roots)], limits=Limits(**limits))
    srv.start()
    return srv, f"127.0.0.1:{port}"


def test_idle_connections_cost_no_thread_and_over_the_cap_are_closed(roots):
    """600 connections that send nothing: the server's threads do not grow (one each before),
    16 (the cap) are kept, the other 584 are closed at once; once the kept ones leave, a client
    streams over the bulk connection as ever."""
    srv, address = _serve(roots, max_pending_connections=16, bulk_ticket_s=30.0)
    lis = srv.servicer.bulk
    try:
        threads = threading.active_count()
        socks = _connect_many(lis.port, 600)
        try:
            assert _wait(lambda: lis.accepted + lis.refused == 600, 10), (lis.accepted, lis.refused)
            assert threading.active_count() <= threads, (threads, threading.active_count())  # was + 600
            assert (lis.accepted, lis.refused) == (16, 584)
            assert lis.pending() == 16
            assert _wait(lambda: sum(map(_closed, socks)) == 584, 10)
            time.sleep(0.2)
            assert sum(map(_closed, socks)) == 584  # the 16 under the cap stay (30 s to send a ticket)
        finally:
            for s in socks:
                s.close()
        assert _wait(lambda: lis.pending() == 0, 5)  # the peers closed: so does the server
        before = srv.metrics.registry.get_sample_value("gdsload_feed_bulk_streams_total") or 0
        n = sum(len(b["__key__"]) for b in RemoteLoader(address, dataset="feats", batch_size=64, output="numpy"))
        assert n == 256
        assert srv.metrics.registry.get_sample_value("gdsload_feed_bulk_streams_total") == before + 1
    finally:
        srv.shutdown(grace_s=1)


def test_a_trickled_ticket_is_closed_at_the_deadline_of_the_whole_ticket(roots):
    """Connections sending a byte every 0.3 s (never a whole ticket within the test) are closed 1 s
    (`bulk_ticket_s`) after their accept, not kept while bytes keep coming; a whole, valid ticket
    within the deadline still works."""
    srv, address = _serve(roots, bulk_ticket_s=1.0)
    lis = srv.servicer.bulk
    try:
        socks = _connect_many(lis.port, 20)
        t0 = time.monotonic()
        closed_at: dict[int, float] = {}
        while len(closed_at) < len(socks) and time.monotonic() - t0 < 4.0:
            for i, s in enumerate(socks):
                if i in closed_at:
                    continue
                if _closed(s):
                    closed_at[i] = time.monotonic() - t0
                    continue
                try:
                    s.send(b"x")
                except OSError:  # reset: closed
                    closed_at[i] = time.monotonic() - t0
            time.sleep(0.3)
        for s in socks:
            s.close()
        assert len(closed_at) == len(socks), f"{len(socks) - len(closed_at)} trickling connections still open after 4 s"
        assert 0.8 <= min(closed_at.values()) and max(closed_at.values()) <= 2.5, closed_at
        assert lis.expired >= len(socks)
        n = sum(len(b["__key__"]) for b in RemoteLoader(address, dataset="feats", batch_size=64, output="numpy"))
        assert n == 256
    finally:
        srv.shutdown(grace_s=1)


def _offer(address: str, **kw):
    """A raw bulk call: (call, its BulkOffer)."""
    ch = grpc.insecure_channel(address)
    call = ch.unary_stream("/gdsload.v1.Feed/StreamBatches", request_serializer=pb.BatchRequest.SerializeToString,
                           response_deserializer=pb.BatchChunk.FromString)(
        pb.BatchRequest(dataset="feats", batch_size=64, bulk=True, **kw), timeout=10)
    first = next(call)
    assert first.HasField("bulk")
    return ch, call, first.bulk


def test_an_idle_connections_next_ticket_has_the_same_deadline(roots):
    """After a stream, the connection waits `IDLE_S` for the client's next ticket; once its first
    byte comes, the rest must come within `bulk_ticket_s` too (a trickle is closed)."""
    srv, address = _serve(roots, bulk_ticket_s=1.0)
    lis = srv.servicer.bulk
    try:
        ch, call, offer = _offer(address, max_batches=1)
        with socket.create_connection(("127.0.0.1", offer.port), timeout=5) as s:
            s.sendall(offer.ticket)
            assert s.recv(1) == framing.ACK
            while True:  # the stream's messages, then its end marker
                n, _ = framing.FRAME.unpack(framing.recv_exact(s, framing.FRAME.size))
                if n == 0:
                    break
                assert framing.recv_exact(s, n)
            assert list(call) == [] and call.code() == grpc.StatusCode.OK
            ch.close()
            assert _wait(lambda: lis.pending() == 1, 5)  # idle, waiting for the next ticket
            time.sleep(1.3)  # idle: longer than a ticket's deadline is fine (IDLE_S)
            assert not _closed(s)
            t0 = time.monotonic()
            while not _closed(s) and time.monotonic() - t0 < 4.0:
                try:
                    s.send(b"x")
                except OSError:
                    break
                time.sleep(0.3)
            assert time.monotonic() - t0 <= 2.5, "a trickled ticket on an idle connection was kept"
        assert _wait(lambda: lis.pending() == 0, 5)
    finally:
        srv.shutdown(grace_s=1)


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Threads:")))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="counts threads in /proc")
def test_serve_flag_caps_pending_connections_in_the_server_process(roots, tmp_path):
    """`gdsload serve --max-pending-connections 8`: of 300 idle connections, 8 are kept and the
    server process's thread count does not grow."""
    port = free_port()
    proc = spawn_server(roots, port, tmp_path / "serve.log", "--max-pending-connections", "8")
    try:
        ch, call, offer = _offer(f"127.0.0.1:{port}")
        call.cancel()
        ch.close()
        time.sleep(0.3)
        threads = _threads(proc.pid)
        socks = _connect_many(offer.port, 300)
        try:
            assert _wait(lambda: sum(map(_closed, socks)) == 292, 10), sum(map(_closed, socks))
            time.sleep(0.2)
            assert sum(map(_closed, socks)) == 292
            assert _threads(proc.pid) <= threads + 2, (threads, _threads(proc.pid))  # was + 300
        finally:
            for s in socks:
                s.close()
    finally:
        proc.terminate()
        proc.wait(30)


def test_bad_caps_are_refused_naming_them(roots):
    import argparse

    from gdsload.cli.serve import cmd_serve, configure_serve_parser
    from gdsload.errors import GdsloadError

    parser = argparse.ArgumentParser()
    configure_serve_parser(parser)
    assert parser.parse_args([str(roots)]).max_pending_connections == Limits().max_pending_connections == 64
    assert Limits().bulk_ticket_s == framing.TICKET_S == 5.0
    with pytest.raises(GdsloadError, match="--max-pending-connections must be >= 1, got 0"):
        cmd_serve(parser.parse_args([str(roots), "--max-pending-connections", "0"]))
    for bad in (float("nan"), float("inf"), 0, -1.0, True):
        with pytest.raises(GdsloadError, match="bulk_ticket_s"):
            Limits(bulk_ticket_s=bad)
    with pytest.raises(GdsloadError, match="max_pending_connections"):
        Limits(max_pending_connections=0)
