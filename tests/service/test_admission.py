"""The server's one memory budget (`server.admission.Budget`) and its sizing (`server.estimate`):
reservations are counted once and released once (also from a `with` block, also after being
handed over), a claim over the whole budget is RESOURCE_EXHAUSTED and one that does not fit now
UNAVAILABLE (after the room makers, in order, gave back what they could), a draining server and
one at capacity refuse with UNAVAILABLE; the staging buffers a stream reserves for are the ring's
own rule."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gdsload.service.protocol.status import OverLimit, Unavailable
from gdsload.service.server.admission import PRODUCER, Budget, stream_claim

STREAM = stream_claim(3)


def test_reservations_count_once_and_release_once():
    b = Budget(100, max_streams=4)
    r = b.reserve(60, STREAM)
    assert b.reserved == 60 and r.held and r.nbytes == 60
    r.release()
    r.release()
    assert b.reserved == 0 and not r.held
    with b.reserve(30, STREAM) as r2:
        assert b.reserved == 30
    assert b.reserved == 0 and not r2.held
    with pytest.raises(RuntimeError), b.reserve(30, STREAM):
        raise RuntimeError("fails inside")
    assert b.reserved == 0


def test_hand_over_moves_the_bytes_to_a_new_owner():
    b = Budget(100, max_streams=4)
    with b.reserve(40, STREAM) as r:
        kept = r.hand_over()
    assert b.reserved == 40 and kept.held and not r.held
    kept.release()
    assert b.reserved == 0


def test_over_the_whole_budget_is_resource_exhausted_naming_it():
    b = Budget(100, max_streams=4)
    with pytest.raises(OverLimit) as e:
        b.reserve(101, STREAM)
    assert "holds up to 101 bytes" in str(e.value) and "ring of 3 batches" in str(e.value)
    assert "memory budget of 100 bytes (--max-memory)" in str(e.value)
    loader = b.reserve(70, STREAM)
    with pytest.raises(OverLimit, match="--share-window") as e:  # the loader's 70 and a window of 40
        b.reserve(40, PRODUCER, held=loader.nbytes)
    assert "holds up to 110 bytes" in str(e.value)
    assert b.reserved == 70


def test_what_does_not_fit_now_is_unavailable_after_the_room_makers():
    b = Budget(100, max_streams=4)
    calls: list[tuple[str, int]] = []
    parked = [b.reserve(30, STREAM), b.reserve(30, STREAM)]

    def windows(need: int) -> None:
        calls.append(("windows", need))

    def loaders(need: int) -> None:
        calls.append(("loaders", need))
        if parked:
            parked.pop().release()

    b.on_short(windows)
    b.on_short(loaders)
    r = b.reserve(60, STREAM)  # 60 + 60 > 100: windows give nothing, one parked loader goes
    assert calls == [("windows", 60), ("loaders", 60)] and b.reserved == 90
    calls.clear()
    with pytest.raises(Unavailable) as e:  # the last parked loader goes, still 60 + 50 > 100
        b.reserve(50, STREAM)
    assert "memory budget is in use (60 of 100 bytes held by 0 streams, this one needs 50)" in str(e.value)
    assert calls == [("windows", 50), ("loaders", 50)] and not parked
    with pytest.raises(Unavailable, match="a shared producer needs 50"):
        b.reserve(50, PRODUCER)
    calls.clear()
    assert b.reserve(40, STREAM).held and calls == []  # it fits: nobody is asked
    r.release()


def test_streams_are_counted_against_max_streams():
    b = Budget(100, max_streams=2)
    s1, s2 = b.stream(), b.stream()
    assert b.streams == 2 and b.reserved == 0
    with pytest.raises(Unavailable, match=r"at capacity \(2 streams\)"):
        b.stream()
    s1.release()
    s1.release()
    assert b.streams == 1
    t = threading.Timer(0.1, s2.release)
    t.start()
    t0 = time.monotonic()
    assert b.wait_idle(5.0) and time.monotonic() - t0 < 4
    assert b.streams == 0


def test_a_draining_server_refuses_everything():
    b = Budget(100, max_streams=2)
    b.draining.set()
    for ask in (lambda: b.reserve(1, STREAM), b.stream):
        with pytest.raises(Unavailable, match="shutting down"):
            ask()
    assert b.reserved == 0 and b.streams == 0


def test_staging_buffers_are_sized_by_the_rings_rule():
    from gdsload.ring.staging import StagingPool, buffer_nbytes

    pool = StagingPool()
    for n in (1000, 5 << 20):
        arr = pool.take(n)
        assert len(arr) == n and len(np.frombuffer(arr.base, np.uint8)) == buffer_nbytes(n)
    assert buffer_nbytes(1000) == 4 << 20 and buffer_nbytes(8 << 20) == 10 << 20
