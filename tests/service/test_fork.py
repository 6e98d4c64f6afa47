"""A loader made (and used) in a parent works in forked children: each process makes its own
channels after the fork, as torch DataLoader workers need.

The server runs in its own process here, as in real use: gRPC core does not survive a fork of a
process that runs a server (children abort now and then in the epoll poller)."""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections import Counter

import pytest
from feedkit import free_port, spawn_server

from gdsload.service.client import RemoteLoader

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork start method")


def _child(loader: RemoteLoader, out) -> None:
    try:
        out.put([k for b in loader for k in b["__key__"]])
    except BaseException as exc:  # reported by the parent
        out.put(exc)


@pytest.fixture
def remote_server(roots, tmp_path):
    port = free_port()
    proc = spawn_server(roots, port, tmp_path / "server.log")
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def test_forked_workers(remote_server):
    address = remote_server
    loaders = [RemoteLoader(address, dataset="feats", batch_size=16, shuffle=True, seed=4, rank=r, world_size=2,
                            output="numpy") for r in range(2)]
    for x in loaders:
        assert len(x) == 8  # the parent has open channels now
    in_flight = iter(loaders[0])  # held: a dropped iterator cancels its stream
    first = next(in_flight)  # and a stream in flight
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(x, out)) for x in loaders]
    for p in procs:
        p.start()
    results = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert not [r for r in results if isinstance(r, BaseException)], results
    counts = Counter(k for keys in results for k in keys) + Counter(first["__key__"])
    assert len(counts) == 256 and set(counts.values()) == {1}
    # the parent still works after the fork
    assert sum(len(b["__key__"]) for b in loaders[1]) == 128
