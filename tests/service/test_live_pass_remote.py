"""`RemoteLoader` keeps the local loader's cursor rules (round 4, row 3): its pass registers as the
cursor's live pass, so `load_state_dict()` or an epoch-changing `set_epoch()` during a live pass
cancels that pass's stream before the next `iter()`, and `state_dict()` says what the next
`iter()` will do. Before: `set_epoch(5)` mid-pass gave a state of (5, 40) (resuming it lost 160
samples of epoch 0 and skipped 40 of epoch 5), and `load_state_dict()` moved the live pass."""

from __future__ import annotations

import pytest

from gdsload.errors import PassStopped
from gdsload.service.client import RemoteLoader

B = 8


def remote(addr, **kw):
    kw = {"dataset": "feats", "batch_size": B, "shuffle": True, "seed": 3, "output": "numpy", "device": "cpu",
          "stripe_batches": 2, **kw}
    return RemoteLoader(addr, **kw)


def keys(it):
    return [k for b in it for k in b["__key__"]]


@pytest.mark.parametrize("striped", [False, True])
def test_set_epoch_during_a_live_remote_pass(server, striped):
    _, addr = server
    addrs = [addr, addr] if striped else addr
    ref = remote(addrs)
    order0 = keys(ref)
    ref.set_epoch(5)
    order5 = keys(ref)
    ref.close()
    lo = remote(addrs)
    it = iter(lo)
    got = [k for _ in range(3) for k in next(it)["__key__"]]
    assert got == order0[:3 * B]
    lo.set_epoch(5)
    st = lo.state_dict()
    assert (st["epoch"], st["position"]) == (5, 0)
    with pytest.raises(PassStopped, match=r"set_epoch\(5\)"):
        next(it)
    assert keys(lo) == order5 and lo.epoch == 6
    lo.close()


@pytest.mark.parametrize("striped", [False, True])
def test_load_state_dict_during_a_live_remote_pass_then_iter(server, striped):
    _, addr = server
    addrs = [addr, addr] if striped else addr
    ref = remote(addrs)
    order, states = [], []
    for b in ref:
        order += list(b["__key__"])
        states.append(ref.state_dict())
    ref.close()
    lo = remote(addrs)
    for k, target in ((0, 4), (5, 1), (2, 2)):
        it = iter(lo)
        for _ in range(k):
            next(it)
        lo.load_state_dict(states[target])
        assert lo.state_dict() == states[target]
        with pytest.raises(PassStopped, match="load_state_dict"):
            next(it)
        assert keys(lo) == order[(target + 1) * B:], (k, target)
    lo.close()


@pytest.mark.parametrize("striped", [False, True])
def test_break_then_iter_continues_after_the_last_batch_handed_out(server, striped):
    """The remote twin of the local rule: a new `iter()` closes the live pass (its iterator ends)
    and continues from the cursor; a set_epoch with the current epoch keeps the pass; one after a
    drained pass applies at once (tests/loader/test_stages.py, tests/loader/test_live_pass.py)."""
    _, addr = server
    addrs = [addr, addr] if striped else addr
    ref = remote(addrs)
    order = keys(ref)
    ref.close()
    lo = remote(addrs)
    it = iter(lo)
    got = [k for _ in range(2) for k in next(it)["__key__"]]
    lo.set_epoch(0)  # the epoch it is at: the pass goes on
    got += next(it)["__key__"]
    again = iter(lo)  # a `break` and a new loop
    with pytest.raises(StopIteration):
        next(it)
    got += keys(again)
    assert got == order and lo.epoch == 1 and lo.state_dict()["position"] == 0
    lo.set_epoch(7)  # after a drained pass: at once
    assert lo.state_dict()["epoch"] == 7
    lo.close()


@pytest.mark.parametrize("striped", [False, True])
def test_the_last_remote_batch_completes_the_epoch_without_stop_iteration(server, striped):
    """The remote twin of tests/interop/test_trainers.py's last-batch test: Lightning and the HF
    Trainer take `len(loader)` batches and never ask for the StopIteration, so the epoch's last
    batch handed out moves the loader to (next epoch, 0): the next `iter()` runs that epoch, and a
    state taken there resumes at its start. Before: the state was (0, end) and the next `iter()`
    gave no batch."""
    _, addr = server
    addrs = [addr, addr] if striped else addr
    ref = remote(addrs)
    e0 = keys(ref)
    e1 = keys(ref)
    ref.close()
    assert e0 != e1
    lo = remote(addrs)
    it = iter(lo)
    got = [k for _ in range(len(lo)) for k in next(it)["__key__"]]
    assert got == e0
    state = lo.state_dict()
    assert (lo.epoch, state["epoch"], state["position"]) == (1, 1, 0)
    assert keys(lo) == e1  # the next iter(), the old one never drained
    other = remote(addrs)
    other.load_state_dict(state)
    assert keys(other) == e1
    lo.close()
    other.close()
