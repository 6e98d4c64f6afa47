"""`gdsload.RemoteLoader` across processes, against a real feed server on loopback: torch
DataLoader workers and a multiprocessing Pool under fork, spawn and forkserver, a forked child
iterating its parent's iterator, and a TLS loader that pickles.

The server runs in its own process (`feedkit.spawn_server`): gRPC core does not survive a fork of a
process that runs a server. Dataset "feats": 256 float32 (32, 64) arrays; batches of 32, so an
epoch is 8 batches.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import sys

import pytest
from feedkit import free_port, spawn_server
from mpkit import (METHODS, TIMEOUT_S, assert_no_new_children, assert_same, child_pids, numpy_batch, via_pool,
                   via_torch)
from test_tls import _serve, pki  # noqa: F401  (the TLS test's certificates and in-process server)

from gdsload.service.client import RemoteLoader
from gdsload.service.protocol.config import TlsConfig
from gdsload.service.protocol.status import RemoteError

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork and /proc")

SAMPLES, BATCH, TAKEN = 256, 32, 2


@pytest.fixture(scope="module")
def address(roots, tmp_path_factory):
    port = free_port()
    proc = spawn_server(roots, port, tmp_path_factory.mktemp("mp-server") / "server.log")
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def make_loader(address: str, **kw) -> RemoteLoader:
    kw = dict(dataset="feats", batch_size=BATCH, shuffle=True, seed=5, output="torch", device="cpu") | kw
    return RemoteLoader(address, **kw)


@pytest.fixture
def loaders(address):
    """A fresh loader, and a used one: TAKEN batches taken, its stream still open (its receiver
    thread is waiting to hand over prefetched batches). Yields (fresh, used, used's iterator, taken)."""
    fresh, used = make_loader(address), make_loader(address)
    it = iter(used)
    taken = [next(it) for _ in range(TAKEN)]
    yield fresh, used, it, taken
    fresh.close()
    used.close()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("via", [via_torch, via_pool], ids=["torch", "pool"])
def test_workers_deliver_what_the_parent_would(loaders, method, via):
    fresh, used, it, taken = loaders
    before = child_pids()
    got = via([fresh, used], method)
    assert_no_new_children(before)
    want = list(fresh) + list(it)  # the parent's own loaders, from where each stood
    assert len(want) == SAMPLES // BATCH * 2 - TAKEN
    assert [i for i, _ in got] == list(range(len(want)))
    for (i, g), w in zip(got, want):
        assert_same(g, w, f"batch {i}")
    keys = [k for b in taken + want[SAMPLES // BATCH :] for k in b["__key__"]]
    assert sorted(keys) == sorted(k for b in want[: SAMPLES // BATCH] for k in b["__key__"])


def _drain(it, out) -> None:
    try:
        out.put([numpy_batch(b) for b in it])
    except BaseException as exc:  # reported by the parent (as text: it need not unpickle there)
        out.put(f"{type(exc).__name__}: {exc}")


def test_forked_child_continues_the_parents_iterator(loaders):
    """Before: the child read the parent's prefetch queue, then failed ("the receiver thread ended
    without a result"): the parent's receiver thread is not in the child."""
    _, _, it, _ = loaders
    ctx = mp.get_context("fork")
    before = child_pids()
    out = ctx.Queue()
    child = ctx.Process(target=_drain, args=(it, out), daemon=True)
    child.start()
    try:
        got = out.get(timeout=90)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0
    assert_no_new_children(before)
    assert not isinstance(got, str), got
    want = list(it)
    assert len(got) == len(want) == SAMPLES // BATCH - TAKEN
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"batch {i}")


def test_an_iterator_does_not_pickle_but_says_what_does(loaders):
    with pytest.raises(TypeError, match="pickle the loader itself"):
        pickle.dumps(loaders[2])


def _keys(loader: RemoteLoader) -> list[str]:
    return [k for b in loader for k in b["__key__"]]


def test_a_workers_remote_error_reaches_the_parent(address):
    """Before: RemoteError did not unpickle (keyword-only `code`), so a worker's error broke the
    pool's result handling instead of reaching the caller."""
    before = child_pids()
    with mp.get_context("fork").Pool(1) as pool:
        result = pool.apply_async(_keys, (make_loader(address, dataset="nope", max_retries=0),))
        with pytest.raises(RemoteError, match="nope") as err:
            result.get(TIMEOUT_S)
    assert err.value.code == "NOT_FOUND" and err.value.address == address
    assert_no_new_children(before)


# Last in this module: it runs a gRPC server in the test process, and a process that has run one
# is not forked by the tests above (gRPC core does not survive such a fork; one hung here).
def test_a_tls_loader_pickles_and_its_copy_connects(roots, pki):  # noqa: F811
    """Before: "cannot pickle" grpc's channel credentials, so a TLS loader could not go to a
    spawned worker."""
    srv, address = _serve(roots, TlsConfig.from_files(pki / "server.pem", pki / "server.key"))
    try:
        loader = make_loader(address, tls_ca=pki / "ca.pem")
        it = iter(loader)
        first = next(it)
        copy = pickle.loads(pickle.dumps(loader))
        assert copy.state_dict() == loader.state_dict()
        rest, want = list(copy), list(it)
        assert len(rest) == len(want) == SAMPLES // BATCH - 1 and first["__key__"] != rest[0]["__key__"]
        for i, (g, w) in enumerate(zip(rest, want)):
            assert_same(g, w, f"batch {i}")
        copy.close()
        loader.close()
    finally:
        srv.shutdown(grace_s=1)
