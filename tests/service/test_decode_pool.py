"""A server's decoding is one pool shared by its streams, by default: concurrent decoding streams
(here also a striping client, whose every block is a stream) get the local loader's images, the
pool's occupancy and queue time are in its metrics, its pipelines are released with the last
decoding stream, a stream with a backlog does not starve another, and a server shut down with
streams mid-batch (in process, and `gdsload serve` on SIGTERM) ends within seconds."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from feedkit import assert_same_batches, free_port, local_batches, spawn_server

from gdsload.decode.image import ImageTransform
from gdsload.errors import RingClosed, Unavailable
from gdsload.service.client import RemoteLoader
from gdsload.service.server.pool import DecodePool
from gdsload.service.server import create_server

EVAL = ImageTransform(size=32, train=False, resize=36)

pytestmark = pytest.mark.dali


@pytest.fixture(scope="module")
def pooled(roots):
    srv, port = create_server([str(roots)], max_message_bytes=64 * 1024)  # the pool is the default
    srv.start()
    assert srv.servicer.pool is not None and srv.servicer.pool.workers == 2
    yield srv, f"127.0.0.1:{port}"
    srv.shutdown(grace_s=2)


def test_concurrent_streams_through_the_pool_equal_local(pooled, roots):
    srv, address = pooled
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def consume(rank: int) -> None:
        try:
            results[rank] = list(RemoteLoader(address, dataset="imgs", decode=True, output="numpy", batch_size=8,
                                              shuffle=True, seed=7, rank=rank, world_size=3, transform=EVAL))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for rank in range(3):
        assert_same_batches(results[rank], local_batches(roots / "imgs", decode=True, batch_size=8, shuffle=True,
                                                         seed=7, rank=rank, world_size=3, transform=EVAL))
    text = srv.metrics.text()
    assert "gdsload_feed_decode_pool_busy 0.0" in text  # nobody decodes now
    assert "gdsload_feed_decode_pool_streams 0.0" in text
    count = [ln for ln in text.splitlines() if ln.startswith('gdsload_feed_decode_queue_seconds_count{dataset="imgs"}')]
    assert count and float(count[0].split()[-1]) == sum(len(b) for b in results.values())
    pool = srv.servicer.pool
    assert 1 <= pool._built <= 2  # kept a moment for the next stream, at most one per worker
    deadline = time.monotonic() + 10
    while pool._built and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool._built == 0 and not any(pool._free.values())  # then released


def test_striping_client_over_pooled_servers(pooled, roots):
    _, address = pooled
    other, port = create_server([str(roots)], max_message_bytes=64 * 1024, decode_pool=1)
    other.start()
    try:
        kw = dict(batch_size=6, shuffle=True, seed=2, transform=EVAL)
        got = list(RemoteLoader([address, f"127.0.0.1:{port}"], dataset="imgs", decode=True, output="numpy",
                                stripe_batches=2, **kw))
        assert_same_batches(got, local_batches(roots / "imgs", decode=True, **kw))
    finally:
        other.shutdown(grace_s=2)


def test_the_cli_turns_the_pool_off_only_when_asked():
    import argparse

    from gdsload.cli.serve import configure_serve_parser

    p = argparse.ArgumentParser()
    configure_serve_parser(p)
    assert p.parse_args(["root"]).decode_pool == 2
    assert p.parse_args(["root", "--no-decode-pool"]).decode_pool == 0
    assert p.parse_args(["root", "--decode-pool", "3"]).decode_pool == 3


# -- the pool itself: fairness and ends ------------------------------------------------------------
@pytest.fixture(scope="module")
def encoded(roots):
    """8 encoded JPEGs of the test set and their names (what a loader hands the decoder)."""
    from gdsload.loader.dataloader import DataLoader, Dataset

    dl = DataLoader(Dataset(str(roots / "imgs")), batch_size=8, decode=False, device="cpu", output="numpy",
                    copy=True)
    try:
        batch = next(iter(dl))
    finally:
        dl.close()
    return [np.frombuffer(bytes(b), np.uint8) for b in batch["jpg"]], list(batch["__key__"])


#: What a decoding loader of batch 8 with EVAL hands its decoder factory (`Resources.open`).
ARGS = dict(transform=EVAL, batch_size=8, device="cpu", threads=2, seed=0, on_error="raise", device_id=0)


def _attached(pool):
    """A stream's seat in the pool: configured as a decoding loader's factory call does
    (`DataLoader(decoder_factory=seat.configure)`), then attached as its stream starts."""
    return pool.seat("imgs").configure(**ARGS).attach()


def test_a_stream_with_a_backlog_does_not_starve_another(roots, encoded):
    """Stream A queues 10 batches, then stream B one; then one worker starts: B's batch is the
    second decoded (streams take turns), not the eleventh (first come, first served)."""
    images, names = encoded
    pool = DecodePool(workers=0, threads=1)  # its worker is started below, once all is queued
    try:
        a, b = _attached(pool), _attached(pool)
        tags: dict[int, str] = {}  # id of a batch's output array -> which batch
        taken: list[str] = []  # batches in the order the worker took them
        kept_rows: list[list[int]] = []
        take = pool._take

        def recording_take():
            got = take()
            if got is not None:
                taken.append(tags[id(got[0].dst)])
            return got

        pool._take = recording_take

        def decode(dec, tag):
            dst = np.empty((8, 3, 32, 32), np.float32)
            tags[id(dst)] = tag
            kept_rows.append(dec.decode_into(images, names, dst))

        threads = [threading.Thread(target=decode, args=(a, f"a{i}")) for i in range(10)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(pool._queues[a.sid]) < 10:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        threads.append(threading.Thread(target=decode, args=(b, "b")))
        threads[-1].start()
        while len(pool._queues[b.sid]) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        worker = threading.Thread(target=pool._work, daemon=True)
        pool._threads.append(worker)
        worker.start()
        for t in threads:
            t.join(timeout=60)
        assert kept_rows == [list(range(8))] * 11
        assert sorted(taken) == sorted([f"a{i}" for i in range(10)] + ["b"])
        assert taken.index("b") == 1, taken
        assert a.batches == 10 and b.batches == 1 and b.queue_s > 0
    finally:
        assert pool.close()


def test_ended_stream_and_closed_pool_fail_fast(roots, encoded):
    """A stream that ended answers RingClosed at once (its readers stop), a closed pool
    Unavailable (the stream's consumer gets it in order), never a wait."""
    images, names = encoded
    pool = DecodePool(workers=1, threads=1, linger_s=0.05)
    try:
        dec = _attached(pool)
        dst = np.empty((8, 3, 32, 32), np.float32)
        assert dec.decode_into(images, names, dst) == list(range(8))
        assert pool._built == 1
        dec.detach()
        with pytest.raises(RingClosed):
            dec.decode_into(images, names, dst)
        deadline = time.monotonic() + 5  # the linger passed: the pipeline is released
        while pool._built and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool._built == 0
        dec.attach()  # the loader's next stream
        t0 = time.monotonic()
        assert pool.close()  # workers end, pipelines released
        assert time.monotonic() - t0 < 5 and not any(t.is_alive() for t in pool._threads)
        with pytest.raises(Unavailable, match="shutting down"):
            dec.decode_into(images, names, dst)
        with pytest.raises(Unavailable):
            _attached(pool)
    finally:
        pool.close()


# -- servers shut down with pooled streams mid-batch ------------------------------------------------
def _consume(address, rank, world, out, stop_after=None, **kw):
    try:
        loader = RemoteLoader(address, dataset="imgs", decode=True, output="numpy", batch_size=16, shuffle=True,
                              seed=1, rank=rank, world_size=world, transform=EVAL, max_retries=0, **kw)
        for i, _ in enumerate(loader):
            if stop_after is not None and i + 1 >= stop_after:
                break
            time.sleep(0.05)  # a slow trainer: the streams stay open
        loader.close()
        out.append("done")
    except Exception as exc:  # the server went away under it: expected here
        out.append(type(exc).__name__)


def test_shutdown_with_pooled_streams_mid_batch_is_quick(roots):
    srv, port = create_server([str(roots)], max_message_bytes=64 * 1024)
    srv.start()
    address = f"127.0.0.1:{port}"
    out: list[str] = []
    threads = [threading.Thread(target=_consume, args=(address, r, 3, out)) for r in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30  # every stream has sent a batch and decodes its next ones
    while (srv.servicer.active_streams() < 3 or "gdsload_feed_decode_pool_busy 0.0" in srv.metrics.text()) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    pool = srv.servicer.pool
    t0 = time.monotonic()
    srv.shutdown(grace_s=0)  # no drain: the streams are cut mid-batch
    took = time.monotonic() - t0
    for t in threads:
        t.join(timeout=30)
    assert took < 8, took
    assert not any(t.is_alive() for t in pool._threads) and pool._built == 0
    assert srv.servicer.active_streams() == 0
    assert len(out) == 3, out
    left = [t.name for t in threading.enumerate() if t.name.startswith("gdsload-reader")]
    assert not left, left  # the streams' loaders are closed, their readers ended


def test_serve_exits_on_sigterm_after_pooled_streams_cut_short(roots, tmp_path):
    """The hang of `bench/remote_bench.py --tiny` with the pool: decoding consumers that stop
    after one batch, others still reading, then SIGTERM: `gdsload serve` exits 0 within seconds."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = spawn_server(roots, port, tmp_path / "server.log")  # --grace 5, the default pool
    try:
        out: list[str] = []
        short = [threading.Thread(target=_consume, args=(address, r, 4, out, 1)) for r in range(4)]
        for t in short:
            t.start()
        for t in short:
            t.join(timeout=60)
        assert out == ["done"] * 4, out
        reading = [threading.Thread(target=_consume, args=(address, r, 2, out)) for r in range(2)]
        for t in reading:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 15
        for t in reading:
            t.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
