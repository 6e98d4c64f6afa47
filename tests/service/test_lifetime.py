"""A RemoteLoader dropped mid-epoch gives its server stream back: its receiver thread does not keep
it alive, and the stream is cancelled when the loader (and its iterator) are collected. Before,
each abandoned loader held a stream slot for `stream_deadline_s` (an hour)."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from gdsload.service.client import RemoteLoader
from gdsload.service.protocol.config import Limits
from gdsload.service.server import create_server

MAX_STREAMS = 2


@pytest.fixture(scope="module")
def big_root(tmp_path_factory):
    """128 arrays of 256 KiB (32 MiB): more than a server can push into socket and HTTP/2 buffers
    (about 8 MiB), so a stream whose client stops reading stays open. root/feats (2 MiB) would be
    sent whole at once, and its streams end by themselves."""
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_npy_folder

    base = tmp_path_factory.mktemp("lifetime")
    make_npy_folder(base / "src", num_samples=128, shape=(256, 256), dtype="float32")
    convert(str(base / "src"), str(base / "root" / "big"), ConvertOptions(workers=1, progress=False,
                                                                          shard_size=8_000_000))
    return base / "root"


@pytest.fixture
def small_server(big_root):
    srv, port = create_server([str(big_root)], limits=Limits(max_streams=MAX_STREAMS))
    srv.start()
    yield srv, f"127.0.0.1:{port}"
    srv.shutdown(grace_s=1)


def _loader(address: str, **kw) -> RemoteLoader:
    return RemoteLoader(address, dataset="big", batch_size=4, prefetch=1, output="numpy", **kw)


def _start_and_drop(address: str) -> None:
    """Take one batch of a long epoch, then let the loader and its iterator go out of scope."""
    it = iter(_loader(address))
    assert len(next(it)["__key__"]) == 4


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_dropped_loaders_give_their_streams_back(small_server):
    srv, address = small_server
    for _ in range(MAX_STREAMS):
        _start_and_drop(address)
    gc.collect()
    assert _wait_for(lambda: srv.servicer.active_streams() == 0, 5), \
        f"{srv.servicer.active_streams()} streams of dropped loaders still open"
    assert _wait_for(lambda: not [t for t in threading.enumerate() if t.name == "gdsload-remote"], 5)
    t0 = time.monotonic()
    fresh = _loader(address, max_retries=20, backoff_s=0.05, max_backoff_s=0.2)
    assert len(next(iter(fresh))["__key__"]) == 4
    assert time.monotonic() - t0 < 5
    fresh.close()


def test_a_dropped_iterator_of_a_live_loader_is_cancelled_too(small_server):
    srv, address = small_server
    loader = _loader(address)
    for _ in range(MAX_STREAMS + 1):  # more abandoned epochs than the server has streams
        assert len(next(iter(loader))["__key__"]) == 4
    gc.collect()
    assert _wait_for(lambda: srv.servicer.active_streams() == 0, 5)
    loader.close()
