"""Resumption: the server SIGKILLed and restarted mid-epoch, a consumer stopped and restarted from
its saved state, a server draining on SIGTERM. Each epoch is still read exactly once."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import grpc
from feedkit import free_port, health_status, spawn_server
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gdsload.service.client import RemoteLoader

FEATS = 256  # samples of root/feats


def _loaders(address, world, **kw):
    return [RemoteLoader(address, dataset="feats", batch_size=8, shuffle=True, seed=5, rank=r, world_size=world,
                         drop_last=True, output="numpy", backoff_s=0.05, max_backoff_s=0.5, max_retries=60, prefetch=1,
                         **kw)
            for r in range(world)]


def test_server_sigkill_and_restart_mid_epoch(roots, tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    log = tmp_path / "server.log"
    proc = spawn_server(roots, port, log)
    restarted: list = []
    world = 2
    # Short streams (3 batches), so that every consumer must open new streams while the server is
    # down; each consumer runs in its own thread and pauses at the barrier for the kill.
    loaders = _loaders(address, world, batches_per_stream=3)
    barrier = threading.Barrier(world + 1, timeout=60)
    seen: list[list[str]] = [[] for _ in range(world)]
    errors: list[BaseException] = []

    def consume(rank: int) -> None:
        try:
            it = iter(loaders[rank])
            for _ in range(4):
                seen[rank] += next(it)["__key__"]
            barrier.wait()
            for batch in it:
                seen[rank] += batch["__key__"]
        except BaseException as exc:  # reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        barrier.wait()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        restarted.append(spawn_server(roots, port, log))  # the consumers retry meanwhile
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        counts = Counter(k for keys in seen for k in keys)
        assert len(counts) == FEATS and set(counts.values()) == {1}
        assert all(x.stats()["reconnects"] >= 1 for x in loaders), [x.stats() for x in loaders]
        assert all(x.state_dict()["epoch"] == 1 for x in loaders)
    finally:
        for p in (proc, *restarted):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_consumer_restarted_from_saved_state(server):
    _, address = server
    first = _loaders(address, 4)
    seen: Counter[str] = Counter()
    states = []
    for x in first:
        it = iter(x)
        for _ in range(3):
            seen.update(next(it)["__key__"])
        states.append(x.state_dict())
        x.close()  # the consumer "dies"; only its state survives
    assert all(s["position"] == 3 * 32 for s in states)
    # restarted, here on another world size with the same global batch (elastic resume)
    again = [RemoteLoader(address, dataset="feats", batch_size=16, shuffle=True, seed=5, rank=r, world_size=2,
                          drop_last=True, output="numpy") for r in range(2)]
    for x in again:
        x.load_state_dict(states[0])
        for b in x:
            seen.update(b["__key__"])
    assert len(seen) == FEATS and set(seen.values()) == {1}


def test_sigterm_drains_and_exits_0(roots, tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    log = tmp_path / "server.log"
    proc = spawn_server(roots, port, log, "--grace", "30")
    new = None
    try:
        assert health_status(address) == health_pb2.HealthCheckResponse.SERVING
        assert health_status(address, "gdsload.v1.Feed") == health_pb2.HealthCheckResponse.SERVING
        statuses = []
        channel = grpc.insecure_channel(address)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)

        def follow():
            try:
                for r in watch:
                    statuses.append(r.status)
                    if r.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                        watch.cancel()
            except grpc.RpcError:
                pass

        watcher = threading.Thread(target=follow)
        watcher.start()
        (loader,) = _loaders(address, 1)
        it = iter(loader)
        seen: Counter[str] = Counter(next(it)["__key__"])
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        drain_s = time.monotonic() - t0
        watcher.join(timeout=10)
        channel.close()
        assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        text = log.read_text()
        assert '"event": "shutdown_done"' in text and '"drained": true' in text
        assert drain_s < 15, f"drain took {drain_s:.1f} s: streams did not end at a batch boundary"
        new = spawn_server(roots, port, log)  # the client resumes on the restarted server
        for b in it:
            seen.update(b["__key__"])
        assert len(seen) == FEATS and set(seen.values()) == {1}
    finally:
        for p in (proc, new):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
