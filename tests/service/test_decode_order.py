"""The decode pool takes batches in the arbiter's order (issue 49): strict priority between levels,
equal decode seconds per job within a level, never a wait on a stream that holds a batch slot.

The pool's own rules are checked with a fake decoder (no DALI) whose every batch moves a fake
clock by its cost, so the order of batches and the seconds charged are the rules' alone. Then on
a real server on loopback (the same fake decoder in its pool): a decoding job of priority 10 among
three of priority 0 gets its batches decoded ahead of theirs (a low batch only ever started while
no higher stream was active, or by a stream holding the server's batch slot), and every job's
epoch is the local loader's, exactly. No assertion is on a duration; every wait is bounded.
"""

from __future__ import annotations

import threading
import time
import zlib

import numpy as np
import pytest
from feedkit import assert_same_batches, local_batches

import gdsload.decode.image as image_mod
from gdsload.decode.image import ImageTransform
from gdsload.service.client import RemoteLoader
from gdsload.service.server import create_server
from gdsload.service.server.pool import FORGET_S, HOLD_S, DecodePool


def until(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.005)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Turn:
    """What the pool reads of a `priority.Turn`: its job, level, and whether it holds a slot or
    wants the server."""

    def __init__(self, job, level: int):
        self.job, self._level, self.slot, self.wants = job, level, False, False

    def level(self) -> int:
        return self._level

    def making(self) -> bool:
        return self.slot

    def wanting(self) -> bool:
        return self.wants


class Costly:
    """A fake `ImageDecoder`: a batch is (clock, cost, label, gate, log); it waits for `gate` (if
    any), moves the clock by `cost` and logs `label`."""

    def __init__(self, **args):
        pass

    def decode_into(self, encoded, names, dst, *, stream=None):
        clock, cost, label, gate, log = encoded
        if gate is not None:
            assert gate.wait(30)
        clock.t += cost
        log.append(label)
        return [0]


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(image_mod, "ImageDecoder", Costly)
    clock = Clock()
    p = DecodePool(workers=1, threads=1, clock=clock)
    yield p, clock
    p.close()


def seat_of(p: DecodePool, turn: Turn | None):
    s = p.seat("d").configure(transform=None, batch_size=1, on_error="raise", seed=0)
    s.attach()
    if turn is not None:
        s.rank(turn)
    return s


def submit(seat, clock, cost, label, log, gate=None) -> threading.Thread:
    t = threading.Thread(target=seat.decode_into, args=((clock, cost, label, gate, log), ["x"], None), daemon=True)
    t.start()
    return t


def queued(p: DecodePool) -> int:
    with p._cv:
        return sum(len(q) for q in p._queues.values())


def test_strict_priority_between_levels_and_no_wait_for_a_stream_holding_a_slot(pool):
    p, clock = pool
    log: list = []
    gate = threading.Event()
    blocker = seat_of(p, None)  # (no turn: never held) takes the one worker until every batch is queued
    a, b, h = Turn("a", 0), Turn("b", 0), Turn("high", 10)
    sa, sb, sh = seat_of(p, a), seat_of(p, b), seat_of(p, h)
    threads = [submit(blocker, clock, 0.0, "blocker", log, gate)]
    until(lambda: log == [] and p._busy[blocker.sid] == 1, "the blocker decoding")
    threads += [submit(sa, clock, 1.0, "a", log), submit(sb, clock, 1.0, "b", log)]
    until(lambda: queued(p) == 2, "the low batches queued")
    threads.append(submit(sh, clock, 1.0, "high", log))
    until(lambda: queued(p) == 3, "the high batch queued")
    gate.set()
    until(lambda: log == ["blocker", "high"], "the high batch first, queued last")
    time.sleep(0.2)  # the clock stands still: the high stream decoded less than HOLD_S ago
    assert log == ["blocker", "high"]
    h.wants = True  # its turn wants the server (it waits for its slot, or makes its batch)
    clock.t += 10 * HOLD_S
    time.sleep(0.2)
    assert log == ["blocker", "high"]  # still held back
    a.slot = True  # stream a holds the batch slot: its batch is never held back
    until(lambda: log == ["blocker", "high", "a"], "a's batch, its stream holding a slot")
    time.sleep(0.2)
    assert log == ["blocker", "high", "a"]  # b's still waits
    h.wants = False  # the high stream sends (its client reads slowly): lower work goes on
    until(lambda: log == ["blocker", "high", "a", "b"], "b's batch once the high stream wants nothing")
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    took = [(job, level, top) for job, level, top, _ in p.order]
    assert took[1] == ("high", 10, 10) and took[2][:2] == ("a", 0) and took[3] == ("b", 0, 0), took
    assert any(held for *_, held in p.order)


def test_a_worker_is_kept_for_a_higher_stream_attached_but_idle(monkeypatch):
    """Two workers, a priority-10 stream attached but idle (its client reads slowly): the low
    streams decode one batch at a time, so the high stream's next batch starts at once."""
    monkeypatch.setattr(image_mod, "ImageDecoder", Costly)
    clock = Clock()
    p = DecodePool(workers=2, threads=1, clock=clock)
    try:
        log: list = []
        gate = threading.Event()
        l1, l2, h = seat_of(p, Turn("l1", 0)), seat_of(p, Turn("l2", 0)), seat_of(p, Turn("high", 10))
        clock.t += 10 * HOLD_S  # (nothing recent)
        threads = [submit(l1, clock, 1.0, "l1", log, gate), submit(l2, clock, 1.0, "l2", log, gate)]
        until(lambda: queued(p) == 1 and sum(p._busy.values()) == 1, "one low batch decoding, one queued")
        time.sleep(0.2)
        assert queued(p) == 1 and sum(p._busy.values()) == 1  # the second worker is kept
        threads.append(submit(h, clock, 1.0, "high", log))
        until(lambda: log == ["high"], "the high batch on the kept worker, at once")
        gate.set()
        until(lambda: sorted(log) == ["high", "l1", "l2"], "the low batches after")
        for t in threads:
            t.join(10)
    finally:
        p.close()


def test_a_job_s_later_stream_waits_for_its_head_stream(monkeypatch):
    """Two workers, one job's two streams (a striping client's head block and a later one): the
    later stream's batch waits while the head stream has one being decoded (else each takes half
    the server while the client waits for the head's), another job's does not, and the wait
    ends when the head stream has had nothing for `HOLD_S` or the later stream holds a slot."""
    monkeypatch.setattr(image_mod, "ImageDecoder", Costly)
    clock = Clock()
    p = DecodePool(workers=2, threads=1, clock=clock)
    try:
        log: list = []
        gate, gate2 = threading.Event(), threading.Event()
        head, later, other = Turn("J", 0), Turn("J", 0), Turn("K", 0)
        head.place, later.place, other.place = (0, 0), (0, 4), (0, 0)
        sh, sl, so = seat_of(p, head), seat_of(p, later), seat_of(p, other)
        clock.t += 10 * HOLD_S
        threads = [submit(sh, clock, 1.0, "head", log, gate)]
        until(lambda: p._busy[sh.sid] == 1, "the head batch decoding")
        threads.append(submit(sl, clock, 1.0, "later", log))
        until(lambda: queued(p) == 1, "the later batch queued")
        time.sleep(0.2)
        assert p._busy[sl.sid] == 0 and queued(p) == 1  # a worker free, and it waits for the head
        threads.append(submit(so, clock, 1.0, "other", log, gate2))
        until(lambda: p._busy[so.sid] == 1, "another job's batch on the free worker")
        gate2.set()
        until(lambda: log == ["other"], "the other job's batch")
        gate.set()
        until(lambda: log == ["other", "head"], "the head batch")
        time.sleep(0.2)  # the clock stands still: the head decoded less than HOLD_S ago
        assert log == ["other", "head"]
        clock.t += 2 * HOLD_S  # the head stream has nothing more now
        until(lambda: log == ["other", "head", "later"], "the later batch once the head is idle")
        gate.clear()
        threads.append(submit(sh, clock, 1.0, "head2", log, gate))
        until(lambda: p._busy[sh.sid] == 1, "the head's next batch decoding")
        threads.append(submit(sl, clock, 1.0, "later2", log))
        time.sleep(0.2)
        assert log[-1] == "later"
        later.slot = True  # the later stream holds the batch slot: never held
        until(lambda: log[-1] == "later2", "the later batch of a stream holding a slot")
        gate.set()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
    finally:
        p.close()


def run_seats(p: DecodePool, clock: Clock, seats: list, batches: int) -> list:
    """Each seat (its cost per batch) submits one batch at a time (as a loader does) until
    `batches` were decoded in all; a blocker holds the worker until every seat has one queued."""
    log: list = []
    stop = threading.Event()
    gate = threading.Event()
    lock = threading.Lock()
    at_stop = p.stopped = {}  # the seconds per job when the run stopped

    def run(seat, cost, label):
        while not stop.is_set():
            seat.decode_into((clock, cost, label, None, log), ["x"], None)
            with lock:
                if len(log) >= batches and not stop.is_set():
                    stop.set()
                    at_stop.update(p.used())  # (every batch logged is charged but one being decoded)
        seat.detach()  # its stream ended (the others wait for its next batch no more)

    blocker = seat_of(p, None)
    first = submit(blocker, clock, 0.0, "blocker", [], gate)
    until(lambda: p._busy[blocker.sid] == 1, "the blocker decoding")
    threads = [threading.Thread(target=run, args=(s, c, i), daemon=True) for i, (s, c) in enumerate(seats)]
    for t in threads:
        t.start()
    until(lambda: queued(p) == len(seats), "every seat's batch queued")
    gate.set()
    for t in threads + [first]:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    blocker.detach()
    return log


def test_equal_decode_seconds_per_job_within_a_level_not_batches_nor_streams(pool):
    p, clock = pool
    p.next_s = 5.0  # (waits for a less-served job's next batch: its thread's, however slow the machine)
    a1, a2 = seat_of(p, Turn("A", 0)), seat_of(p, Turn("A", 0))  # job A: two streams
    b = seat_of(p, Turn("B", 0))
    c = seat_of(p, Turn("C", 0))  # job C: batches three times as dear
    log = run_seats(p, clock, [(a1, 1.0), (a2, 1.0), (b, 1.0), (c, 3.0)], batches=120)
    used = p.stopped  # (the batches queued when the run stopped are decoded after it)
    assert max(used[j] for j in "ABC") - min(used[j] for j in "ABC") <= 3.0 + 1e-9, used  # within one dear batch
    count = {"A": log.count(0) + log.count(1), "B": log.count(2), "C": log.count(3)}
    assert abs(count["A"] - count["B"]) <= 2, count  # two streams: no more than one
    assert count["C"] * 2 < count["B"], count  # a third of the batches for the same seconds
    # a job back within FORGET_S (a striping client's next block) keeps its seconds; a new one
    # starts level with the least-served job of its level
    before = p.used()["A"]  # (every seat detached as its run ended)
    again = seat_of(p, Turn("A", 0))
    assert p.used()["A"] >= before
    newcomer = seat_of(p, Turn("D", 0))
    log = run_seats(p, clock, [(newcomer, 1.0)], batches=1)
    assert p.used()["D"] >= before  # (A's: the one job of its level attached when it came)
    clock.t += FORGET_S + 1
    again.detach()
    assert not {"A", "B", "C", "D"} & set(p.used())  # forgotten


# -- on a real server --------------------------------------------------------------------------------
EVAL = ImageTransform(size=16, train=False, resize=18)


class Stamped:
    """A fake `ImageDecoder` for loaders: each image a deterministic function of its bytes (the
    same in the server's pool and in the local loader), after a short pause (its cost)."""

    def __init__(self, **args):
        self.device = "cpu"

    def decode_into(self, encoded, names, dst, *, stream=None):
        time.sleep(0.002 * len(encoded))
        for i, e in enumerate(encoded):
            dst[i] = zlib.crc32(bytes(e)) % 251
        return list(range(len(encoded)))


def test_a_decoding_high_job_among_three_low_ones_on_a_server(roots, monkeypatch):
    monkeypatch.setattr(image_mod, "ImageDecoder", Stamped)
    srv, port = create_server([str(roots)], batch_slots=1, decode_pool=2, max_message_bytes=64 * 1024)
    srv.start()
    addr = f"127.0.0.1:{port}"
    kw = dict(dataset="imgs", decode=True, output="numpy", batch_size=4, shuffle=True, seed=3, transform=EVAL)
    local = local_batches(roots / "imgs", decode=True, batch_size=4, shuffle=True, seed=3, transform=EVAL,
                          decoder_factory=Stamped)
    try:
        lows = [RemoteLoader(addr, priority=0, job=f"low{i}", **kw) for i in range(3)]
        got: list[list] = [[] for _ in lows]
        started = threading.Barrier(4, timeout=60)
        errors: list = []

        def run(i):
            try:
                it = iter(lows[i])
                got[i].append(next(it))
                started.wait()
                got[i].extend(it)
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        started.wait()
        pool = srv.servicer.pool
        pool.order.clear()
        high = RemoteLoader(addr, priority=10, job="train", **kw)
        high_batches = list(high)
        for t in threads:
            t.join(120)
        assert not errors and not any(t.is_alive() for t in threads), errors
        assert_same_batches(high_batches, local)
        for g in got:
            assert_same_batches(g, local)
        order = list(pool.order)
        highs = [i for i, (job, *_) in enumerate(order) if job[1:] == ("train",)]
        # every batch of the high job went through the pool, ranked but its first ones (decoded
        # before its stream's turn was known: at most its ring's, prefetch + 1, per stream)
        assert len(highs) >= len(local) - 4, (len(highs), len(local))
        # while the high job ran, a batch was taken below the highest level active then only for
        # a stream holding the server's one batch slot or one without its turn yet (in turn, 3
        # low batches for each high one would have been)
        below = [o for o in order[highs[0]:highs[-1]] if o[1] < (o[2] if o[2] is not None else o[1])]
        assert len(below) <= len(local) // 2, (len(below), len(order))
        assert any(held for *_, held in order)  # low batches waited for the high job's
        used = pool.used()
        assert any(job[1:] == ("train",) for job in used)
        for lo in lows + [high]:
            lo.close()
    finally:
        srv.shutdown(grace_s=2)
