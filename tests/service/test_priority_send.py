"""The priority rule applied to sends (issue 49): a lower stream's made batch waits before its
send while a higher stream wants the server, its seconds (made and sent) are charged to its job,
a higher send that does not move (its client does not read) holds nothing, and with one level
the send path takes no lock and no per-member call. A clock that moves only when the test moves
it decides what "wants" means; no assertion is on a duration; every wait is bounded."""

from __future__ import annotations

import threading

import pytest

from gdsload.service.server.priority import POLL_S, RETURN_S, Arbiter
from gdsload.service.server.turn import HANDOVER_S

never = lambda: False  # noqa: E731


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def made_batch(turn, clock: Clock, cost: float) -> None:
    assert turn.wait(never) is None
    clock.t += cost
    turn.made(batch=True)


def in_thread(fn) -> tuple[threading.Thread, list]:
    got: list = []
    th = threading.Thread(target=lambda: got.append(fn()), daemon=True)
    th.start()
    return th, got


def held_behind_a_send(full=None):
    """A lower batch made, then a higher stream's batch made and sending (its bytes just moved;
    `full`: its connection's test, `Turn.full`; None: a transport that cannot tell), and the lower
    batch's `may_send` in a thread: (clock, arbiter, low, high, thread, what it returned)."""
    clock = Clock()
    arb = Arbiter(2, clock=clock)
    low = arb.enter(("id", "low"), 0)
    made_batch(low, clock, 0.1)
    high = arb.enter(("id", "high"), 10)
    high.full = full
    made_batch(high, clock, 0.1)
    assert high.may_send(never) is None
    high.progress_hook()()
    th, got = in_thread(lambda: low.may_send(never))
    return clock, arb, low, high, th, got


def both_sent(low, high) -> None:
    low.sent()
    high.sent()
    for t in (low, high):
        t.leave()


def test_a_lower_batch_waits_before_its_send_while_a_higher_stream_wants_the_server():
    clock = Clock()
    arb = Arbiter(2, clock=clock)
    low = arb.enter(("id", "low"), 0)
    made_batch(low, clock, 0.1)  # made before the high job came
    high = arb.enter(("id", "high"), 10)
    assert high.wait(never) is None  # the high job makes its batch: it wants the server
    th, got = in_thread(lambda: low.may_send(never))
    th.join(0.5)
    assert th.is_alive() and not got and low.state == "held" and low.paused_since is not None
    clock.t += 0.3
    high.made(batch=True)
    assert high.may_send(never) is None  # (the top level never waits)
    hook = high.progress_hook()
    assert hook is not None  # a lower level is here: the high send reports its progress
    for _ in range(5):  # its bytes move: it still wants the server, the low batch still waits
        clock.t += RETURN_S / 2
        hook()
        th.join(0.1)
        assert th.is_alive() and not got
    high.sent()
    clock.t += RETURN_S / 2  # just sent: it asks again at once
    th.join(0.3)
    assert th.is_alive() and not got
    clock.t += RETURN_S  # it did not ask again: the low batch goes (the waiter looks again by itself)
    th.join(10)
    assert got == [None] and low.state == "sending" and low.paused_since is None
    held_for = low.paused_s
    assert held_for > 0
    clock.t += 0.2
    low.sent()
    job = arb.jobs[("id", "low")]
    assert job.cost == pytest.approx(0.1 + 0.2)  # made and sent, not the time it was held
    assert job.send == pytest.approx(0.2)
    assert job.used == pytest.approx(0.3)
    for t in (low, high):
        t.leave()


@pytest.mark.parametrize("full", [None, True])
def test_a_higher_send_that_does_not_move_holds_nothing(full):
    """A higher stream whose client does not read (its send blocked by flow control: its bulk
    connection is full, or a gRPC transport that cannot tell) wants nothing once its bytes have
    not moved for RETURN_S: lower batches go meanwhile."""
    clock, arb, low, high, th, got = held_behind_a_send(None if full is None else lambda: full)
    th.join(0.3)
    assert th.is_alive() and not got  # the high send just moved
    clock.t += RETURN_S * 1.5  # and then did not
    th.join(10)
    assert got == [None]
    both_sent(low, high)


def test_a_higher_send_slowed_by_the_server_s_cpu_not_its_client_holds_lower_batches():
    """A send whose bytes did not move for RETURN_S while its connection takes bytes waits for the
    server's CPU (a server held to a twentieth of a core runs 1 ms in 20), not for its client: it
    still wants the server, and a lower batch waits until it is sent (then RETURN_S more)."""
    takes = [False]  # the connection is not full
    clock, arb, low, high, th, got = held_behind_a_send(lambda: takes[0])
    clock.t += RETURN_S * 3  # nothing moved, the connection takes bytes
    with arb.lock:  # (the waiter looks again)
        low.cv.notify()
    th.join(0.3)
    assert th.is_alive() and not got and high.wanting()
    takes[0] = True  # its client stopped reading: the send waits for it
    with arb.lock:
        low.cv.notify()
    th.join(10)
    assert got == [None] and not high.wanting()
    both_sent(low, high)


def test_a_higher_send_that_finds_its_connection_full_lets_lower_batches_go_at_once():
    """A send that finds its connection full (`progress(True)`, from the bulk sink) wakes what it
    holds back: a lower batch held while the send's connection took bytes (until that send ends:
    nothing timed) goes RETURN_S later, not at its own next look (`POLL_S`, a second)."""
    full = [False]
    clock, arb, low, high, th, got = held_behind_a_send(lambda: full[0])
    clock.t += RETURN_S * 1.5  # (nothing moved: held while the connection takes bytes)
    th.join(0.3)
    assert th.is_alive() and not got  # held: the higher send goes on
    full[0] = True  # its client stopped reading
    high.progress(True)
    clock.t += RETURN_S * 1.5
    th.join(0.6)  # (well within POLL_S)
    assert got == [None]
    both_sent(low, high)


def test_a_held_lower_batch_goes_when_the_higher_job_s_handover_ends():
    """A lower batch held before its send while a reading higher job made its batches goes once
    that job's last stream here left and `HANDOVER_S` passed: the leave wakes it (its hold now ends
    at a known time), not its own next look (`POLL_S`, a second)."""
    clock = Clock()
    arb = Arbiter(2, clock=clock)
    low = arb.enter(("id", "low"), 0)
    made_batch(low, clock, 0.01)
    high = arb.enter(("id", "high"), 10)
    for _ in range(3):  # it reads: its pace is known
        made_batch(high, clock, 0.01)
        high.sent()
    assert high.wait(never) is None  # making its next batch
    th, got = in_thread(lambda: low.may_send(never))
    th.join(0.3)
    assert th.is_alive() and not got and low.state == "held"
    clock.t += 0.01
    high.made()
    high.leave()
    clock.t += HANDOVER_S * 1.1  # it did not come back
    th.join(POLL_S * 0.6)
    assert got == [None]
    low.sent()
    low.leave()


def test_with_one_level_a_send_takes_no_lock_and_no_call_per_member():
    clock = Clock()
    arb = Arbiter(1, clock=clock)
    a, b = arb.enter(("id", "a"), 3), arb.enter(("id", "b"), 3)
    made_batch(a, clock, 0.1)
    assert a.progress_hook() is None
    with arb.lock:  # held by another thread: a send of the top level must not need it
        th, got = in_thread(lambda: a.may_send(never))
        th.join(10)
        assert got == [None]
    low = arb.enter(("id", "low"), 0)
    assert a.progress_hook() is not None and low.progress_hook() is None
    a.sent()
    for t in (a, b, low):
        t.leave()


def test_a_held_batch_goes_at_once_when_higher_work_needs_its_memory_or_the_call_ends():
    clock = Clock()
    arb = Arbiter(2, clock=clock)
    low, other = arb.enter(("id", "low"), 0), arb.enter(("id", "other"), 0)
    made_batch(low, clock, 0.1)
    made_batch(other, clock, 0.1)
    high = arb.enter(("id", "high"), 10)
    assert high.wait(never) is None
    th, got = in_thread(lambda: low.may_send(never))
    stop = threading.Event()
    th2, got2 = in_thread(lambda: other.may_send(stop.is_set))
    th.join(0.3)
    assert th.is_alive() and th2.is_alive() and not got and not got2
    stop.set()  # the call of one ended: its held batch is not sent (the client's cursor is before it)
    other.wake()
    th2.join(10)
    assert got2 == [False] and other.paused_since is None
    assert th.is_alive() and not got
    # the room maker: a held stream cannot park its loader with its batch unsent, so it sends it now
    # (and is suspended at its next turn, the higher stream's next try)
    assert arb.release_below(10, 1 << 20) == 0
    th.join(10)
    assert got == [None]
    low.sent()
    high.made()
    for t in (low, other, high):
        t.leave()


def test_the_per_level_gauges_are_read_at_the_scrape():
    """The queue and paused gauges are the arbiter's streams at the scrape (nothing set per batch)."""
    prom = pytest.importorskip("prometheus_client")
    from gdsload.service.server.metrics import Metrics

    def is_one(m, name: str, level: int) -> int:
        return prom.generate_latest(m.registry).decode().count(f'{name}{{priority="{level}"}} 1.0')

    clock = Clock()
    m = Metrics()
    arb = Arbiter(1, metrics=m, clock=clock)
    high = arb.enter(("id", "high"), 10)
    assert high.wait(never) is None  # it holds the one slot
    low = arb.enter(("id", "low"), 0)
    th, got = in_thread(lambda: low.wait(never))
    deadline = 200
    while low.state != "waiting" and deadline:
        th.join(0.02)
        deadline -= 1
    assert is_one(m, "gdsload_feed_priority_queue", 0) == 1 and is_one(m, "gdsload_feed_priority_paused", 0) == 1
    assert is_one(m, "gdsload_feed_priority_queue", 10) == 0
    high.made()
    high.leave()
    th.join(10)
    assert got == [None]
    assert is_one(m, "gdsload_feed_priority_queue", 0) == 0 and is_one(m, "gdsload_feed_priority_paused", 0) == 0
    low.made()
    low.leave()
