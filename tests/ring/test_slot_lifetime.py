"""Slot lifetime (gdsload.ring.ring, "Slot lifetime"): a slot is reused only when nothing references
the arrays of its last batch; a slot whose batch is kept gets other memory (counted in
`stats()["replaced"]`), so a kept batch is never written over, and nothing is replaced or
allocated when nothing is kept. The slot released last waits for the caller's loop variable."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

import gpu_fakes
from gdsload.errors import RingClosed
from gdsload.ring.ring import ALIGN, Ring, SlotSpec

SPEC = SlotSpec({"x": ((4,), "int64"), "big": ((20_000,), "uint8")})


def _address(arr) -> int:
    return arr.data.ptr if hasattr(arr, "__cuda_array_interface__") else arr.ctypes.data


def _cycle(ring: Ring, seq: int, value: int | None = None):
    """Fill batch `seq` with its number, publish it, get it: the consumer's slot."""
    slot = ring.acquire(seq, timeout=5)
    slot.buffers["x"][:] = seq if value is None else value
    slot.buffers["big"][:] = seq % 256
    ring.publish(slot)
    return ring.get(seq, timeout=5)


def _in_arena(ring: Ring, arr) -> bool:
    lo = _address(ring.arena)
    return lo <= _address(arr) < lo + ring.arena.nbytes


def test_kept_arrays_are_never_written_over_and_each_replacement_is_counted():
    ring = Ring(SPEC, 2)
    kept = []
    for seq in range(10):
        got = _cycle(ring, seq)
        kept.append((got.buffers["x"], got.buffers["big"][5:9]))  # a view and a slice of another field
        ring.release(got)
    for seq, (x, big) in enumerate(kept):
        assert (x == seq).all() and (big == seq % 256).all()
    assert ring.stats()["replaced"] == 8  # all but the first batch of each slot
    assert len({_address(x) for x, _ in kept}) == 10


def test_nothing_kept_the_same_memory_comes_back_and_nothing_is_replaced():
    ring = Ring(SPEC, 3)
    seen = {}
    for seq in range(30):
        got = _cycle(ring, seq)
        seen.setdefault(got.index, set()).add((_address(got.buffers["x"]), _address(got.buffers["big"])))
        ring.release(got)
    assert all(len(a) == 1 for a in seen.values()) and len(seen) == 3
    s = ring.stats()
    assert s["replaced"] == 0 and s["fresh_nbytes"] == 0


@pytest.mark.parametrize("make", ["from_numpy", "from_dlpack"])
def test_a_torch_tensor_keeps_the_batch(make):
    """Only the tensor is kept; the NumPy view it was made from is dropped."""
    ring = Ring(SPEC, 2)
    kept = []
    for seq in range(6):
        got = _cycle(ring, seq)
        kept.append(getattr(torch, make)(got.buffers["x"][:2]))
        ring.release(got)
    gc.collect()
    assert [t.tolist() for t in kept] == [[s, s] for s in range(6)]
    assert ring.stats()["replaced"] == 4


def test_the_slot_released_last_waits_for_the_loop_variable_then_is_reused():
    """`for batch in loader` still names batch k while it asks for k+1: the producer of the
    slot's next batch waits until that name goes, and then writes the same memory again."""
    ring = Ring(SPEC, 2)
    for seq in (0, 1):
        s = ring.acquire(seq)
        s.buffers["x"][:] = seq
        ring.publish(s)
    got = ring.get(0)
    batch = {"x": got.buffers["x"]}  # what the loop variable holds
    address = _address(batch["x"])
    ring.release(got)
    assert ring.try_acquire(2) is None  # slot 0 was released last and its batch is still named

    acquired = []
    producer = threading.Thread(target=lambda: acquired.append(ring.acquire(2, timeout=10)))
    producer.start()
    time.sleep(0.05)
    assert not acquired
    t0 = time.monotonic()
    del batch  # the loop rebinds its variable: the weakref callback wakes the producer
    producer.join(5)
    assert acquired and time.monotonic() - t0 < 2
    assert _address(acquired[0].buffers["x"]) == address
    assert ring.stats()["replaced"] == 0


def test_the_slot_released_last_is_replaced_once_the_consumer_moves_on():
    ring = Ring(SPEC, 2)
    for seq in (0, 1):
        s = ring.acquire(seq)
        s.buffers["x"][:] = seq
        ring.publish(s)
    got = ring.get(0)
    kept = got.buffers["x"]
    ring.release(got)
    acquired = []
    producer = threading.Thread(target=lambda: acquired.append(ring.acquire(2, timeout=10)))
    producer.start()
    time.sleep(0.05)
    assert not acquired  # still waiting: the consumer might only be rebinding its loop variable
    ring.release(ring.get(1))  # it moved on: batch 0 is kept
    producer.join(5)
    slot = acquired[0]
    slot.buffers["x"][:] = 2
    assert (kept == 0).all() and _address(slot.buffers["x"]) != _address(kept)
    assert ring.stats()["replaced"] == 1


def test_a_consumer_waiting_for_the_batch_does_not_wait_for_its_own_loop_variable():
    """One slot: the next batch goes where the one still named is. `get` waiting for it lets the
    producer take other memory instead of waiting forever."""
    ring = Ring(SPEC, 1)
    got = _cycle(ring, 0)
    kept = got.buffers["x"]
    ring.release(got)

    def produce():
        s = ring.acquire(1, timeout=10)
        s.buffers["x"][:] = 1
        ring.publish(s)

    producer = threading.Thread(target=produce)
    producer.start()
    nxt = ring.get(1, timeout=5)
    producer.join(5)
    assert (nxt.buffers["x"] == 1).all() and (kept == 0).all()
    assert ring.stats()["replaced"] == 1


def test_a_kept_field_outside_flat_moves_alone_and_comes_back():
    """`flat` fields move as one block; a kept field outside it gets memory of its own, the size of
    that field (a kept label keeps 4 KiB, not the slot). Once let go, the slot is on the arena again."""
    ring = Ring(SPEC, 2, flat={"big"})
    big_home = {}
    kept_x = []
    for seq in range(6):
        got = _cycle(ring, seq)
        big_home.setdefault(got.index, set()).add(_address(got.buffers["big"]))
        kept_x.append(got.buffers["x"])
        ring.release(got)
    assert all(len(a) == 1 for a in big_home.values())  # the block never moved
    assert [int(x[0]) for x in kept_x] == list(range(6))
    s = ring.stats()
    assert s["replaced"] == 4 and s["fresh_nbytes"] == 2 * ALIGN  # one 4 KiB field per slot
    assert not any(_in_arena(ring, x) for x in kept_x[2:])

    kept_big = []
    for seq in range(6, 10):  # now `big` is kept: the whole block moves
        got = _cycle(ring, seq)
        kept_big.append(got.buffers["big"])
        ring.release(got)
    assert [int(b[0]) for b in kept_big] == [s % 256 for s in range(6, 10)]
    assert ring.stats()["fresh_nbytes"] >= SPEC.nbytes

    del kept_x, kept_big, got
    gc.collect()
    for seq in range(10, 14):  # nothing kept any more: back on the arena, nothing fresh
        ring.release(_cycle(ring, seq))
    s = ring.stats()
    assert s["fresh_nbytes"] == 0 and s["replaced"] == 8
    got = _cycle(ring, 14)
    assert _in_arena(ring, got.buffers["x"]) and _in_arena(ring, got.buffers["big"])


def test_private_fields_are_not_watched():
    """A decoder keeping the staging views it was fed (DALI keeps two runs' inputs) does not
    make every slot look kept."""
    spec = SlotSpec({"x": ((4,), "int64"), "__staging__": ((8192,), "uint8")})
    ring = Ring(spec, 2, private={"__staging__"})
    fed = []
    for seq in range(6):
        slot = ring.acquire(seq, timeout=5)
        fed.append(slot.buffers["__staging__"][:100])
        ring.publish(slot)
        ring.release(ring.get(seq))
    assert ring.stats()["replaced"] == 0


def test_spares_are_used_first_and_sit_in_the_arena():
    ring = Ring(SPEC, 2, spares=1)
    assert ring.arena.nbytes == 3 * SPEC.nbytes and ring.stats()["nbytes_total"] == 3 * SPEC.nbytes
    kept = []
    for seq in range(3):
        got = _cycle(ring, seq)
        kept.append(got.buffers["big"])
        ring.release(got)
    assert _in_arena(ring, kept[2])  # the spare block
    assert ring.stats()["fresh_nbytes"] == 0
    got = _cycle(ring, 3)
    kept.append(got.buffers["big"])
    assert not _in_arena(ring, kept[3])  # no spare left: fresh memory
    assert [int(b[0]) for b in kept] == [0, 1, 2, 3]


def test_no_memory_for_a_kept_batch_fails_that_batch_not_the_ring(monkeypatch):
    ring = Ring(SPEC, 1)
    got = _cycle(ring, 0)
    kept = got.buffers["x"]
    ring.release(got)

    def no_memory(device, pin, total):
        raise MemoryError(f"cannot allocate {total} bytes")

    monkeypatch.setattr(ring, "_allocate", no_memory)
    failed = []
    producer = threading.Thread(target=lambda: failed.append(pytest.raises(RingClosed, ring.acquire, 1, 5)))
    producer.start()
    with pytest.raises(MemoryError, match="cannot allocate") as exc_info:
        ring.get(1, timeout=5)
    producer.join(5)
    assert failed and "batch 1 failed in the ring" in str(failed[0].value)
    assert any("drop them, or copy what you keep" in n for n in exc_info.value.__notes__)
    assert (kept == 0).all()
    del kept
    gc.collect()
    ring.release(_cycle(ring, 2))  # once let go, the slot's own memory is used again
    assert ring.stats()["failed"] == 1


def test_reset_starts_after_the_slot_the_loop_variable_may_still_name():
    ring = Ring(SPEC, 3)
    for seq in range(4):
        batch = _cycle(ring, seq)
        view = batch.buffers["x"]  # the loop variable after the pass: the last batch
        ring.release(batch)
    last = batch.index
    ring.close()
    ring.reset()
    got = _cycle(ring, 0)
    assert got.index == (last + 1) % 3
    assert (view == 3).all() and ring.stats()["replaced"] == 0


def test_a_batch_kept_past_the_next_release_is_fenced_when_let_go():
    """A device ring's `drop_fence`: a batch the caller let go after the consumer's next release
    (work may have been queued on it since) gets a fence, which the next batch written to its
    memory waits for; one let go in the loop-variable window does not (its release fence holds)."""
    made = []

    class Fence:
        synced = False

        def __init__(self):
            made.append(self)

        def synchronize(self):
            self.synced = True

    ring = Ring(SPEC, 2, drop_fence=Fence)
    got = _cycle(ring, 0)
    kept = got.buffers["x"]
    ring.release(got)
    nxt = _cycle(ring, 1)
    view = nxt.buffers["big"]
    ring.release(nxt)  # the consumer moved on past batch 0, which is still kept
    assert not made
    del kept  # a metric over it could have been queued until now
    assert len(made) == 1
    slot = ring.acquire(2, timeout=5)  # batch 0's memory, not kept any more: reused
    assert ring.stats()["replaced"] == 0
    slot.wait_fence()
    assert made[0].synced
    del view  # batch 1, let go before the consumer's next release: the loop variable
    assert len(made) == 1


def test_device_ring_keeps_kept_batches_with_spares_first(monkeypatch):
    """On the GPU (CuPy's CPU stand-in): the views are CuPy arrays owning a lease, and tensors
    made with DLPack keep them; a kept block moves to the arena's spare, then to fresh memory."""
    gpu = gpu_fakes.install(monkeypatch, devices=1)
    ring = Ring(SPEC, 2, device="cuda:0", spares=1)
    kept = []
    for seq in range(5):
        got = _cycle(ring, seq)
        kept.append(torch.from_dlpack(got.buffers["big"][:3]))
        ring.release(got)
        gpu.synchronize_all()  # the fake's queued writes hold their arrays; CuPy's kernels do not
    gc.collect()
    assert [t.tolist() for t in kept] == [[s % 256] * 3 for s in range(5)]
    s = ring.stats()
    assert s["replaced"] == 3 and s["fresh_nbytes"] > 0
    del kept
    gc.collect()
    for seq in range(5, 9):
        ring.release(_cycle(ring, seq))
        gpu.synchronize_all()
    assert ring.stats()["fresh_nbytes"] == 0 and ring.stats()["replaced"] == 3
