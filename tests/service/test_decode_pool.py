"""A server's decoding is one pool shared by its streams: concurrent decoding streams (here also a
striping client, whose every block is a stream) get the local loader's images, the pool's
occupancy and queue time are in its metrics, and its pipelines are released with the last
decoding stream."""

from __future__ import annotations

import threading
import time

import pytest
from feedkit import assert_same_batches, local_batches

from gdsload.decode.image import ImageTransform
from gdsload.service.client import RemoteLoader
from gdsload.service.server import create_server

EVAL = ImageTransform(size=32, train=False, resize=36)

pytestmark = pytest.mark.dali


@pytest.fixture(scope="module")
def pooled(roots):
    srv, port = create_server([str(roots)], max_message_bytes=64 * 1024, decode_pool=2)
    srv.start()
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
