"""`RemoteLoader(prefetch_next_epoch=True)`: a pass in its epoch's tail opens the next epoch's
pass, and the loop's next `iter()` takes that receiver over when it starts there (the cursor moved
to (epoch + 1, 0) with the last batch). Every other next step (another epoch set, a state loaded,
a break, `close()`, no `iter()` for `AHEAD_IDLE_S`) cancels it, and every epoch stays exactly the
plan's. Off by default."""

from __future__ import annotations

import time

import pytest

from gdsload.service.client import RemoteLoader, receive
from gdsload.service.server import create_server

B = 8


def remote(addr, **kw):
    kw = {"dataset": "feats", "batch_size": B, "shuffle": True, "seed": 3, "output": "numpy", "device": "cpu",
          "stripe_batches": 2, "prefetch_next_epoch": True, **kw}
    return RemoteLoader(addr, **kw)


def keys(it):
    return [k for b in it for k in b["__key__"]]


@pytest.fixture(scope="module")
def epochs(server):
    """Epochs 0-2 and 5 of the reference order, read with no pass opened ahead."""
    _, addr = server
    ref = RemoteLoader(addr, dataset="feats", batch_size=B, shuffle=True, seed=3, output="numpy", device="cpu")
    assert ref.prefetch_next_epoch is False  # the default
    out = {e: (ref.set_epoch(e), keys(ref))[1] for e in (0, 1, 2, 5)}
    assert ref._ahead is None
    ref.close()
    return out


@pytest.mark.parametrize("striped", [False, True])
def test_the_next_iter_takes_over_the_pass_opened_ahead(server, epochs, striped):
    _, addr = server
    lo = remote([addr, addr] if striped else addr)
    for epoch in range(3):
        it = iter(lo)
        if epoch:  # the receiver opened in the previous epoch's tail, not a new one
            assert it.receiver is ahead
        assert keys(it) == epochs[epoch]
        assert lo.epoch == epoch + 1 and lo._ahead is not None and lo._ahead[0] == epoch + 1
        ahead = lo._ahead[1]
    # striped: the servers the first pass probed are not probed by the later ones (stripe/schedule.py)
    assert {a for known in lo._link.probed.values() for a in known} == ({addr} if striped else set())
    lo.close()
    assert ahead.stop.is_set()  # close() cancels the pass opened ahead
    ahead.thread.join(10)
    assert not ahead.thread.is_alive()


@pytest.mark.parametrize("striped", [False, True])
def test_len_batches_then_set_epoch_then_iter_as_trainers_do(server, epochs, striped):
    """Lightning and HF's Trainer take `len()` batches, set the next epoch and call `iter()`."""
    _, addr = server
    lo = remote([addr, addr] if striped else addr)
    for epoch in range(3):
        lo.set_epoch(epoch)
        it = iter(lo)
        got = [k for _ in range(len(lo)) for k in next(it)["__key__"]]
        assert got == epochs[epoch]
    lo.close()


@pytest.mark.parametrize("striped", [False, True])
def test_another_epoch_or_a_loaded_state_cancels_the_pass_opened_ahead(server, epochs, striped):
    _, addr = server
    lo = remote([addr, addr] if striped else addr)
    assert keys(lo) == epochs[0]
    ahead = lo._ahead[1]
    lo.set_epoch(5)  # not the epoch opened ahead (1)
    assert keys(lo) == epochs[5]
    assert ahead.stop.is_set()
    # a state of the epoch opened ahead, mid-epoch: the pass starts there, not at the epoch's start
    st = lo.state_dict()
    assert (st["epoch"], st["position"]) == (6, 0) and lo._ahead[0] == 6
    ahead = lo._ahead[1]
    state = dict(st, epoch=1, position=3 * B)
    lo.load_state_dict(state)
    assert keys(lo) == epochs[1][3 * B:]
    assert ahead.stop.is_set()
    lo.close()


def test_a_break_opens_nothing_ahead_and_the_next_iter_continues(server, epochs):
    _, addr = server
    lo = remote([addr, addr])
    it = iter(lo)
    got = [k for _ in range(2) for k in next(it)["__key__"]]
    assert lo._ahead is None  # far from the epoch's end
    assert got + keys(lo) == epochs[0]
    lo.close()


def test_a_pass_opened_ahead_that_failed_is_not_taken_over(roots, epochs):
    """The server goes away once epoch 0 is all received: the pass opened ahead cannot connect
    and gives up (retry budget), and the next `iter()`, a server back on that address, opens a new
    pass that reads epoch 1."""
    srv, port = create_server([str(roots)])
    srv.start()
    addr = f"127.0.0.1:{port}"
    lo = remote(addr, prefetch=64, retry_timeout_s=0.5, backoff_s=0.05, max_backoff_s=0.1)
    try:
        it = iter(lo)
        deadline = time.monotonic() + 20
        while it.receiver.queue.qsize() < len(lo) + 1 and time.monotonic() < deadline:  # every batch, and END
            time.sleep(0.02)
        srv.shutdown(grace_s=0)
        assert keys(it) == epochs[0]  # (the first batch handed out opened the pass ahead: prefetch > len)
        ahead = lo._ahead[1]
        deadline = time.monotonic() + 20
        while not ahead.failed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ahead.failed
        srv, _ = create_server([str(roots)], address=addr)
        srv.start()
        it = iter(lo)
        assert it.receiver is not ahead
        assert keys(it) == epochs[1]
    finally:
        lo.close()
        srv.shutdown(grace_s=0)


def test_a_pass_opened_ahead_and_not_taken_over_expires(server, epochs, monkeypatch):
    """A loop that does something else after the epoch (validation) leaves the pass opened ahead
    waiting on its full queue: after `AHEAD_IDLE_S` it cancels itself (its servers hold no stream
    for it), and the next `iter()` opens a new pass."""
    monkeypatch.setattr(receive, "AHEAD_IDLE_S", 0.3)
    _, addr = server
    lo = remote([addr, addr])
    assert keys(lo) == epochs[0]
    ahead = lo._ahead[1]
    deadline = time.monotonic() + 20
    while not ahead.stop.is_set() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ahead.stop.is_set() and not ahead.claim()
    it = iter(lo)
    assert it.receiver is not ahead
    assert keys(it) == epochs[1]
    lo.close()
