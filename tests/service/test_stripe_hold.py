"""A striped stream held beyond the window (`FetchWorker._hold`) after its server paused it: the
batch that came ends the pause at once, not when the hold ends. The pause notices the server sent
while the client held the stream lay unread before that batch; read together when the hold began,
they kept the server PAUSED for as long as the hold lasted: no new request for it, its blocks
taken by the other server one stream each (traced in `bench/priority_bench.py`: a server PAUSED
2.2 s past its pause, the low jobs back 3.6 s after the high job left). A real `Schedule`, a real
worker, the receiver's lock and events; no socket (the hold reads nothing)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("grpc")

from gdsload.service.client.link import Attempts, Endpoint, Link
from gdsload.service.client.options import Connection, RetryPolicy
from gdsload.service.client.stripe import pause
from gdsload.service.client.stripe.policy import StripePolicy
from gdsload.service.client.stripe.schedule import Schedule
from gdsload.service.client.stripe.states import ServerState
from gdsload.service.client.stripe.worker import FetchWorker


class Receiver:
    """What `FetchWorker._hold` uses of `StripedReceiver`: its lock and condition, stop, schedule, policy."""

    def __init__(self, schedule: Schedule):
        self.schedule, self.policy = schedule, schedule.policy
        self.cond = threading.Condition()
        self.stop = threading.Event()

    def settle(self, cancel=(), wake: bool = True) -> None:
        assert not list(cancel)  # (nothing to cancel here: the other server has a slot free)
        if wake:
            self.cond.notify_all()


def striped(now: float) -> tuple[Schedule, Receiver]:
    link = Link(["a:1", "b:1"], 0, Connection(), RetryPolicy(), dataset="feats")
    sch = Schedule(StripePolicy(stripe_batches=4, server_window=1), first_step=0, end_step=64, now=now, stats=link,
                   budget=Attempts(link), backoff=lambda n: 1.0, retry_timeout_s=30.0)
    sch.on_resolved({a: [Endpoint(a, None, a)] for a in ("a:1", "b:1")}, now)
    for s in sch.servers.values():
        sch.probe_ok(s, strided=True)
    return sch, Receiver(sch)


def test_a_held_stream_s_batch_ends_its_server_s_pause_while_it_waits_for_the_window():
    now = time.monotonic()
    sch, rx = striped(now)
    a = sch.servers["a:1"]
    f = sch.pick(a, now)  # a's stream: blocks 0, 2, 4, ...
    assert f.stride == 2 and f.block == 0
    f.block, f.next = 4, 16  # its batch of block 4 came; the window (one block a server) is at blocks 0-1
    pause.paused(sch, f, "priority 10 work on this server (this stream: priority 0)", now)  # the unread notices
    assert a.state is ServerState.PAUSED and sch.beyond_window(f)

    held = threading.Thread(target=FetchWorker(rx, a)._hold, args=(f,), daemon=True)
    held.start()
    try:
        deadline = time.monotonic() + 5.0
        while a.state is ServerState.PAUSED and time.monotonic() < deadline:
            time.sleep(0.01)
        with rx.cond:
            assert a.state is ServerState.OK  # while the stream is still held
            assert held.is_alive() and sch.beyond_window(f)
            row = sch.stats.servers["a:1"]
            assert row["state"] == "ok" and row["pauses"] == 1  # stats() says so too
    finally:
        with rx.cond:
            rx.stop.set()
            rx.cond.notify_all()
        held.join(5.0)
    assert not held.is_alive()


def test_a_hold_of_a_server_that_is_not_paused_leaves_its_state():
    now = time.monotonic()
    sch, rx = striped(now)
    a = sch.servers["a:1"]
    f = sch.pick(a, now)
    f.block, f.next = 4, 16
    assert a.state is ServerState.OK and sch.beyond_window(f)
    rx.stop.set()
    FetchWorker(rx, a)._hold(f)  # (stopped: returns at once)
    assert a.state is ServerState.OK and sch.stats.servers["a:1"]["pauses"] == 0
