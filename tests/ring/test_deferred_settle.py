"""`Ring.acquire(seq, defer=True)` and `Slot.settle()` (gdsload.ring.ring, "Slot lifetime"): the
slot the consumer released last, whose batch is still the loop variable, is handed out at once
when only fields outside `flat` are still named, so a reader reads its next batch into the staging
area while the consumer waits for the batch before (issue 55: without it a loader with 2 slots read
each batch only after the one before was handed out, and DALI waited for every read). Writing the
deferred fields waits for `settle`, which keeps the old guarantees: same memory when the name goes,
other memory when the batch is kept."""

from __future__ import annotations

import threading
import time

import pytest

from gdsload.errors import RingClosed
from gdsload.ring.ring import Ring, SlotSpec

# images and labels written through `buffers` (loose); the staging area read by offset, private
SPEC = SlotSpec({"img": ((4, 8), "float32"), "cls": ((4,), "int64"), "__staging__": ((8192,), "uint8")})


def _ring(slots: int = 2) -> Ring:
    return Ring(SPEC, slots, flat={"__staging__"}, private={"__staging__"})


def _address(arr) -> int:
    return arr.ctypes.data


def _fill(slot, seq: int) -> None:
    slot.settle()
    slot.buffers["img"][:] = seq
    slot.buffers["cls"][:] = seq


def _two_published(ring: Ring) -> None:
    for seq in (0, 1):
        s = ring.acquire(seq, defer=True)
        _fill(s, seq)
        ring.publish(s)


def test_a_deferred_slot_comes_at_once_and_settles_when_the_loop_variable_goes():
    ring = _ring()
    _two_published(ring)
    got = ring.get(0)
    batch = {"img": got.buffers["img"], "cls": got.buffers["cls"]}  # what the loop variable holds
    address = _address(batch["img"])
    ring.release(got)
    assert ring.try_acquire(2) is None  # without defer: waits for the loop variable, as before

    slot = ring.acquire(2, timeout=0, defer=True)  # with defer: at once
    assert slot.unsettled and set(slot.buffers) == {"__staging__"}
    slot.buffers["__staging__"][:4] = 7  # read into: allowed before settling
    settled = []
    producer = threading.Thread(target=lambda: (slot.settle(timeout=10), settled.append(True)))
    producer.start()
    time.sleep(0.05)
    assert not settled  # the loop variable still names batch 0's images and labels
    t0 = time.monotonic()
    del batch  # the loop rebinds its variable
    producer.join(5)
    assert settled and time.monotonic() - t0 < 2
    assert not slot.unsettled and _address(slot.buffers["img"]) == address  # same memory, nothing replaced
    assert ring.stats()["replaced"] == 0


def test_a_kept_batch_is_not_written_over_after_a_deferred_acquire():
    ring = _ring()
    _two_published(ring)
    got = ring.get(0)
    kept = got.buffers["img"]
    ring.release(got)
    slot = ring.acquire(2, timeout=0, defer=True)
    done = []
    producer = threading.Thread(target=lambda: (_fill(slot, 2), done.append(True)))
    producer.start()
    time.sleep(0.05)
    assert not done
    ring.release(ring.get(1))  # the consumer moved on: batch 0 is kept, the slot gets other memory
    producer.join(5)
    assert done and (kept == 0).all() and (slot.buffers["img"] == 2).all()
    assert _address(slot.buffers["img"]) != _address(kept) and ring.stats()["replaced"] == 1


def test_the_consumer_waiting_for_the_batch_settles_it():
    """One slot: `get` of the deferred batch itself stops the wait (the batch named is kept)."""
    ring = _ring(1)
    s = ring.acquire(0, defer=True)
    _fill(s, 0)
    ring.publish(s)
    got = ring.get(0)
    kept = got.buffers["cls"]
    ring.release(got)

    def produce():
        slot = ring.acquire(1, timeout=10, defer=True)
        _fill(slot, 1)
        ring.publish(slot)

    producer = threading.Thread(target=produce)
    producer.start()
    nxt = ring.get(1, timeout=5)
    producer.join(5)
    assert (nxt.buffers["cls"] == 1).all() and (kept == 0).all()


def test_publish_settles_and_close_wakes_a_settling_producer():
    ring = _ring()
    _two_published(ring)
    got = ring.get(0)
    batch = got.buffers["img"]
    ring.release(got)
    slot = ring.acquire(2, timeout=0, defer=True)
    errors = []

    def settle():
        try:
            slot.settle(timeout=10)
        except RingClosed as exc:
            errors.append(exc)

    producer = threading.Thread(target=settle)
    producer.start()
    time.sleep(0.05)
    ring.close()
    producer.join(5)
    assert errors and "settling batch 2" in str(errors[0])
    assert (batch == 0).all()

    ring = _ring()
    _two_published(ring)
    got = ring.get(0)
    ring.release(got)
    del got
    slot = ring.acquire(2, timeout=0, defer=True)  # nothing of batch 0 named: not deferred at all
    assert not slot.unsettled and "img" in slot.buffers


def test_fixed_fields_still_named_make_a_deferred_acquire_wait():
    """A field read by offset (in `flat`) cannot wait for `settle`: the read writes it."""
    ring = Ring(SPEC, 2, flat={"__staging__", "img"}, private={"__staging__"})
    _two_published(ring)
    got = ring.get(0)
    img = got.buffers["img"]
    ring.release(got)
    assert ring.try_acquire(2) is None
    with pytest.raises(Exception, match="timed out"):
        ring.acquire(2, timeout=0, defer=True)
    del img
    assert ring.acquire(2, timeout=1, defer=True) is not None
