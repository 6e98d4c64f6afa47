"""The prefetch ring: allocation once and 4 KiB alignment, in-order delivery under concurrent
producers, backpressure, failure pass-through, shutdown without leaked threads, stall accounting,
and a Hypothesis state machine of the slot protocol."""

from __future__ import annotations

import itertools
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gdsload.errors import GdsloadError
from gdsload.ring.ring import ALIGN, Ring, RingClosed, RingError, RingTimeout, SlotSpec

SPEC = SlotSpec({"x": ((4,), "int64"), "bytes": ((5000,), "uint8")})


def _address(arr) -> int:
    return arr.ctypes.data if isinstance(arr, np.ndarray) else arr.data.ptr


def _fill(slot, seq: int) -> None:
    slot.buffers["x"][:] = seq
    slot.buffers["bytes"][:] = seq % 256
    slot.meta["seq"] = seq


def _check(slot, seq: int) -> None:
    assert slot.seq == seq and slot.meta["seq"] == seq
    assert (slot.buffers["x"] == seq).all()
    assert (slot.buffers["bytes"] == seq % 256).all()


# -- allocation ------------------------------------------------------------------------------------


def test_allocated_once_addresses_stable_and_aligned():
    ring = Ring(SPEC, 3)
    first = {}
    for seq in range(50):
        slot = ring.acquire(seq, timeout=1)
        # the same memory every cycle (the views are new per batch: see test_kept_arrays_*)
        ids = {name: _address(arr) for name, arr in slot.buffers.items()}
        assert first.setdefault(slot.index, ids) == ids
        for arr in slot.buffers.values():
            assert _address(arr) % ALIGN == 0
        _fill(slot, seq)
        ring.publish(slot)
        got = ring.get(seq, timeout=1)
        _check(got, seq)
        ring.release(got)
    assert sorted(first) == [0, 1, 2]
    addresses = sorted(a for ids in first.values() for a in ids.values())
    assert len(set(addresses)) == len(addresses)  # no two fields or slots share memory


@settings(max_examples=40, deadline=None)
@given(
    fields=st.dictionaries(
        st.text("abcdefgh", min_size=1, max_size=4),
        st.tuples(
            st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
            st.sampled_from(["uint8", "int16", "float32", "float64", "<u4", "complex64"]),
        ),
        min_size=1,
        max_size=4,
    ),
    num_slots=st.integers(1, 4),
)
def test_layout_alignment_and_nbytes_accounting(fields, num_slots):
    spec = SlotSpec(fields)
    ring = Ring(spec, num_slots)
    nbytes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in fields.values()]
    padded = sum(-(-n // ALIGN) * ALIGN for n in nbytes)
    stats = ring.stats()
    assert stats["nbytes_per_slot"] == spec.nbytes == padded
    assert stats["nbytes_total"] == num_slots * padded
    assert stats["slots"] == num_slots and stats["device"] == "cpu" and stats["pinned"] is False
    base = _address(ring._arena)
    assert base % ALIGN == 0 or ring.nbytes_total == 0
    for seq in range(num_slots):
        slot = ring.acquire(seq, timeout=0)
        for name, (shape, dtype) in fields.items():
            arr = slot.buffers[name]
            assert arr.shape == tuple(shape) and arr.dtype == np.dtype(dtype)
            assert arr.nbytes == spec.field_nbytes(name)
            if arr.nbytes == 0:
                continue  # an empty view has no address of its own (NumPy keeps the base pointer)
            assert _address(arr) % ALIGN == 0
            offset = _address(arr) - base
            assert seq * padded <= offset and offset + arr.nbytes <= (seq + 1) * padded
            arr[...] = 1  # writable, within its own slot


def test_bad_specs_and_arguments_are_clear_errors():
    for bad in ({}, {"x": ((2,), "O")}, {"x": ((-1,), "uint8")}, {"x": "uint8"}, {"": ((1,), "uint8")}):
        with pytest.raises(RingError):
            SlotSpec(bad)
    with pytest.raises(GdsloadError, match="num_slots"):
        Ring(SPEC, 0)
    with pytest.raises(GdsloadError, match="'tpu'.*'cpu', 'cuda'"):
        Ring(SPEC, 2, device="tpu")
    assert hash(SlotSpec({"x": ((2,), "uint8")})) == hash(SlotSpec({"x": ([2], np.uint8)}))


def test_pin_falls_back_to_pageable_without_cuda():
    ring = Ring(SPEC, 2, pin=True)
    stats = ring.stats()
    if stats["pinned"]:  # a CUDA host with CuPy: genuinely page-locked
        assert ring.pin_error is None
    else:
        assert ring.pin_error  # says why (no CuPy, no driver)
    slot = ring.acquire(0, timeout=0)
    assert all(_address(a) % ALIGN == 0 for a in slot.buffers.values())


# -- ordering and backpressure ---------------------------------------------------------------------


@pytest.mark.parametrize("num_slots,producers", [(1, 3), (3, 4), (8, 6)])
def test_concurrent_producers_deliver_in_order_without_overwrites(num_slots, producers):
    total = 300
    ring = Ring(SPEC, num_slots)
    counter = itertools.count()
    counter_lock = threading.Lock()
    released = [0]  # releases begun by the consumer (bumped just before release())
    max_ahead = [-(10**9)]
    errors: list[BaseException] = []

    def produce(rng: random.Random) -> None:
        try:
            while True:
                with counter_lock:
                    seq = next(counter)
                if seq >= total:
                    return
                slot = ring.acquire(seq, timeout=10)
                with counter_lock:
                    ahead = seq - released[0]
                    max_ahead[0] = max(max_ahead[0], ahead)
                assert ahead < num_slots, f"producer {ahead} batches ahead with {num_slots} slots"
                time.sleep(rng.random() * 0.002)
                _fill(slot, seq)
                ring.publish(slot)
        except BaseException as exc:  # surface in the main thread
            errors.append(exc)
            ring.close()

    threads = [threading.Thread(target=produce, args=(random.Random(k),)) for k in range(producers)]
    for t in threads:
        t.start()
    rng = random.Random(99)
    try:
        for seq in range(total):
            slot = ring.get(seq, timeout=10)
            _check(slot, seq)
            assert ring.stats()["in_flight"] <= num_slots
            time.sleep(rng.random() * 0.001)
            _check(slot, seq)  # nobody wrote into it while we held it
            with counter_lock:
                released[0] += 1
            ring.release(slot)
    finally:
        ring.close()
        for t in threads:
            t.join(5)
    assert not errors, errors
    stats = ring.stats()
    assert stats["gets"] == total and stats["failed"] == 0
    assert 0 <= stats["mean_occupancy"] <= num_slots
    assert max_ahead[0] <= num_slots - 1


def test_backpressure_fast_producer_stays_within_num_slots():
    num_slots = 4
    ring = Ring(SPEC, num_slots)
    acquired: list[int] = []

    def produce() -> None:
        try:
            for seq in itertools.count():
                slot = ring.acquire(seq)
                acquired.append(seq)
                _fill(slot, seq)
                ring.publish(slot)
        except RingClosed:
            pass

    t = threading.Thread(target=produce)
    t.start()
    try:
        for seq in range(20):
            time.sleep(0.01)  # slow consumer: the producer must wait, not run ahead
            assert max(acquired, default=-1) <= seq - 1 + num_slots  # batches 0..seq-1 released so far
            assert ring.stats()["occupancy"] <= num_slots
            slot = ring.get(seq, timeout=5)
            _check(slot, seq)
            ring.release(slot)
        deadline = time.monotonic() + 5
        while ring.stats()["occupancy"] < num_slots and time.monotonic() < deadline:
            time.sleep(0.005)
        assert ring.stats()["occupancy"] == num_slots  # it did fill the ring up to the bound...
        time.sleep(0.02)
        assert max(acquired) == 20 - 1 + num_slots  # ...and not one batch beyond
        assert ring.stats()["producer_wait_s"] > 0
    finally:
        ring.close()
        t.join(5)
    assert not t.is_alive()


# -- protocol errors, failures ---------------------------------------------------------------------


def test_producer_failure_is_reraised_in_order_and_later_batches_work():
    ring = Ring(SPEC, 2)
    bad = ring.acquire(1, timeout=0)  # producers finish out of order: batch 1 fails first
    ring.fail(bad, ValueError("x"))
    good = ring.acquire(0, timeout=0)
    _fill(good, 0)
    ring.publish(good)
    got = ring.get(0, timeout=0)
    _check(got, 0)
    ring.release(got)
    with pytest.raises(ValueError, match="x") as info:
        ring.get(1, timeout=0)
    assert any("batch 1" in note for note in getattr(info.value, "__notes__", ["batch 1"]))
    for seq in (2, 3):  # slot 1 was recycled by the failed get
        slot = ring.acquire(seq, timeout=0)
        _fill(slot, seq)
        ring.publish(slot)
    for seq in (2, 3):
        got = ring.get(seq, timeout=0)
        _check(got, seq)
        ring.release(got)
    assert ring.stats()["failed"] == 1 and ring.stats()["gets"] == 4


def test_protocol_misuse_is_refused():
    ring = Ring(SPEC, 2)
    a = ring.acquire(0, timeout=0)
    with pytest.raises(RingError, match="already acquired"):
        ring.acquire(0, timeout=0)
    with pytest.raises(RingTimeout):
        ring.acquire(2, timeout=0)  # slot 0 still carries batch 0
    assert ring.try_acquire(2) is None
    with pytest.raises(RingError, match="out of order"):
        ring.get(1, timeout=0)
    with pytest.raises(RingError, match="expected held"):
        ring.release(a)
    with pytest.raises(RingError, match="-1"):
        ring.acquire(-1)
    with pytest.raises(RingError, match="timeout"):
        ring.get(0, timeout=-1)
    ring.publish(a)
    with pytest.raises(RingError, match="expected filling"):
        ring.publish(a)
    got = ring.get(0, timeout=0)
    ring.release(got)
    with pytest.raises(RingError, match="stale"):
        ring.release(got)
    with pytest.raises(RingError, match="already acquired"):
        ring.acquire(0, timeout=0)
    with pytest.raises(RingError, match="already delivered|out of order"):
        ring.get(0, timeout=0)
    for seq in (1, 2):
        ring.publish(ring.acquire(seq, timeout=0))
    held = ring.get(1, timeout=0)
    ring.get(2, timeout=0)  # the consumer may hold several batches, up to num_slots
    with pytest.raises(RingError, match="wait forever.*batch 1"):
        ring.get(3)  # slot 1 carries batch 3 only after batch 1 is released
    ring.release(held)


def test_timeout_is_a_timeout_error():
    ring = Ring(SPEC, 1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        ring.get(0, timeout=0.05)
    assert 0.04 < time.monotonic() - t0 < 2
    assert ring.try_get(0) is None


# -- shutdown, stats -------------------------------------------------------------------------------


def test_close_wakes_blocked_producers_and_consumer_no_leaked_threads():
    baseline = threading.active_count()
    ring = Ring(SPEC, 2)
    held = [ring.acquire(0), ring.acquire(1)]  # unpublished: the consumer's get(0) must block
    outcomes: dict[str, BaseException | None] = {}

    def call(name, fn, *args):
        try:
            fn(*args)
            outcomes[name] = None
        except BaseException as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=call, args=(f"acquire{s}", ring.acquire, s)) for s in (2, 3, 4, 5)]
    threads.append(threading.Thread(target=call, args=("get0", ring.get, 0)))
    for t in threads:
        t.start()
    time.sleep(0.1)
    assert all(t.is_alive() for t in threads) and not outcomes  # all blocked
    t0 = time.monotonic()
    ring.close()
    ring.close()  # idempotent
    for t in threads:
        t.join(2)
    assert time.monotonic() - t0 < 1.0
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 5 and all(isinstance(e, RingClosed) for e in outcomes.values()), outcomes
    # After close: publish/fail/release are no-ops, acquire/get refuse.
    ring.publish(held[0])
    ring.fail(held[1], ValueError("late"))
    with pytest.raises(RingClosed):
        ring.acquire(6, timeout=0)
    with pytest.raises(RingClosed):
        ring.get(0)
    assert ring.stats()["closed"] and ring.closed
    assert threading.active_count() == baseline


def test_close_from_another_thread_while_consumer_waits():
    baseline = threading.active_count()
    with Ring(SPEC, 2) as ring:
        closer = threading.Timer(0.05, ring.close)
        closer.start()
        with pytest.raises(RingClosed):
            ring.get(0)
        closer.join()
    assert threading.active_count() == baseline


def test_data_stall_is_recorded_for_a_slow_producer():
    ring = Ring(SPEC, 2)

    def slow() -> None:
        slot = ring.acquire(0)
        time.sleep(0.2)
        _fill(slot, 0)
        ring.publish(slot)

    t = threading.Thread(target=slow)
    t.start()
    slot = ring.get(0, timeout=5)
    t.join()
    _check(slot, 0)
    stats = ring.stats()
    assert stats["wait_s"] >= 0.15 and stats["gets"] == 1
    assert stats["mean_occupancy"] == 0.0  # nothing was ready when the consumer asked
    ring.release(slot)
    # A producer that is ahead: no stall, occupancy seen at get() time.
    for seq in (1, 2):
        s = ring.acquire(seq, timeout=0)
        _fill(s, seq)
        ring.publish(s)
    before = ring.stats()["wait_s"]
    assert ring.stats()["occupancy"] == 2
    ring.release(ring.get(1, timeout=0))
    assert ring.stats()["wait_s"] == before
    assert ring.stats()["mean_occupancy"] == pytest.approx((0 + 2) / 2)


def test_copy_outlives_release():
    ring = Ring(SPEC, 1)
    slot = ring.acquire(0)
    _fill(slot, 7)
    ring.publish(slot)
    got = ring.get(0)
    kept = got.copy()
    ring.release(got)
    nxt = ring.acquire(1, timeout=0)
    _fill(nxt, 8)
    assert (kept["x"] == 7).all() and (nxt.buffers["x"] == 8).all()


# -- the protocol as a state machine ---------------------------------------------------------------


class RingMachine(RuleBasedStateMachine):
    """Single thread, non-blocking calls; a model of every seq's state predicts each answer. The
    consumer also keeps views of batches it got (and drops them again): a kept view never changes,
    and the slot released last waits while a view of its batch is kept ("Slot lifetime")."""

    @initialize(num_slots=st.integers(1, 4))
    def setup(self, num_slots):
        self.n = num_slots
        self.ring = Ring(SlotSpec({"x": ((3,), "int64")}), num_slots)
        self.status: dict[int, str] = {}  # seq -> filling | ready | failed | held | done
        self.producing: dict[int, object] = {}
        self.held: dict[int, object] = {}
        self.next_get = 0
        self.delivered: list[int] = []
        self.kept: list[tuple[int, np.ndarray]] = []  # (seq, a view of its "x")
        self.last_released: int | None = None  # slot index
        self.slot_seq: dict[int, int] = {}  # slot index -> the last seq acquired in it

    def _free_for(self, seq):
        return seq not in self.status and (seq < self.n or self.status.get(seq - self.n) == "done")

    def _waits_for_kept(self, seq):
        """The slot the consumer released last waits while a view of its last batch is kept."""
        i = seq % self.n
        return i == self.last_released and any(s == self.slot_seq.get(i) for s, _ in self.kept)

    @rule(offset=st.integers(0, 9))
    def acquire(self, offset):
        seq = self.next_get + offset
        if seq in self.status:
            with pytest.raises(RingError, match="already acquired"):
                self.ring.try_acquire(seq)
            return
        slot = self.ring.try_acquire(seq)
        if not self._free_for(seq) or self._waits_for_kept(seq):
            assert slot is None
            return
        assert slot is not None and slot.seq == seq and slot.index == seq % self.n
        self.status[seq] = "filling"
        self.producing[seq] = slot
        self.slot_seq[slot.index] = seq

    @precondition(lambda self: self.producing)
    @rule(pick=st.integers(0, 100), ok=st.booleans())
    def publish_or_fail(self, pick, ok):
        seq = sorted(self.producing)[pick % len(self.producing)]
        slot = self.producing.pop(seq)
        if ok:
            slot.buffers["x"][:] = seq
            self.ring.publish(slot)
            self.status[seq] = "ready"
        else:
            self.ring.fail(slot, ValueError(seq))
            self.status[seq] = "failed"

    @rule()
    def get_next(self):
        seq = self.next_get
        state = self.status.get(seq)
        if state == "failed":
            with pytest.raises(ValueError):
                self.ring.try_get(seq)
            self.status[seq] = "done"
            self.next_get += 1
            return
        if self.status.get(seq - self.n) == "held":
            with pytest.raises(RingError, match="wait forever"):
                self.ring.try_get(seq)
            return
        slot = self.ring.try_get(seq)
        if state != "ready":
            assert slot is None
            return
        assert slot is not None and slot.seq == seq and (slot.buffers["x"] == seq).all()
        self.status[seq] = "held"
        self.held[seq] = slot
        self.delivered.append(seq)
        self.next_get += 1

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 100))
    def release(self, pick):
        seq = sorted(self.held)[pick % len(self.held)]
        slot = self.held.pop(seq)
        assert (slot.buffers["x"] == seq).all()  # not overwritten while held
        self.ring.release(slot)
        assert slot.buffers == {}  # a stale handle keeps nothing
        self.status[seq] = "done"
        self.last_released = slot.index

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 100))
    def keep(self, pick):
        seq = sorted(self.held)[pick % len(self.held)]
        self.kept.append((seq, self.held[seq].buffers["x"][1:]))

    @precondition(lambda self: self.kept)
    @rule(pick=st.integers(0, 100))
    def drop_kept(self, pick):
        del self.kept[pick % len(self.kept)]

    @invariant()
    def kept_views_never_change(self):
        for seq, view in self.kept:
            assert (view == seq).all()

    @invariant()
    def occupancy_in_bounds(self):
        stats = self.ring.stats()
        expected = sum(s in ("ready", "failed") for s in self.status.values())
        assert stats["occupancy"] == expected and 0 <= expected <= self.n
        live = [seq for seq, s in self.status.items() if s != "done"]
        assert stats["in_flight"] == len(live) <= self.n

    @invariant()
    def one_owner_per_slot(self):
        live = [seq % self.n for seq, s in self.status.items() if s != "done"]
        assert len(live) == len(set(live))
        assert not ({s % self.n for s in self.producing} & {s % self.n for s in self.held})

    @invariant()
    def delivered_in_order(self):
        assert self.delivered == sorted(self.delivered)
        assert all(s < self.next_get for s in self.delivered)

    def teardown(self):
        self.ring.close()
        with pytest.raises(RingClosed):
            self.ring.acquire(self.next_get + 10**6, timeout=0)


RingMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestRingMachine = RingMachine.TestCase


# -- device memory ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("pin", [False, True])
def test_cuda_device_ring(pin):
    import cupy

    ring = Ring(SPEC, 2, device="cuda", pin=pin)
    stats = ring.stats()
    assert stats["device"] == "cuda:0" and stats["pinned"] is False
    for seq in range(6):
        slot = ring.acquire(seq, timeout=1)
        assert all(isinstance(a, cupy.ndarray) and a.data.ptr % ALIGN == 0 for a in slot.buffers.values())
        _fill(slot, seq)
        ring.publish(slot)
        got = ring.get(seq, timeout=1)
        assert int(got.buffers["x"].sum()) == 4 * seq
        assert isinstance(got.copy()["x"], cupy.ndarray)
        ring.release(got)


@pytest.mark.gpu
def test_pinned_host_ring_on_cuda_host():
    ring = Ring(SPEC, 2, pin=True)
    assert ring.stats()["pinned"] is True and ring.pin_error is None
    slot = ring.acquire(0)
    assert isinstance(slot.buffers["x"], np.ndarray)
    assert all(a.ctypes.data % ALIGN == 0 for a in slot.buffers.values())


def test_reset_reuses_the_same_memory_for_a_new_pass():
    ring = Ring(SlotSpec(fields={"x": ((4,), "int64")}), 2)
    addrs = set()
    slot = ring.acquire(0)
    slot.buffers["x"][:] = 7
    ring.publish(slot)
    ring.acquire(1)  # left in flight, as when a consumer breaks out early
    ring.close()
    ring.reset()
    assert not ring.closed
    for seq in range(5):  # numbering restarts at 0 and every slot is free again
        s = ring.acquire(seq, timeout=1)
        s.buffers["x"][:] = seq
        ring.publish(s)
        got = ring.get(seq, timeout=1)
        assert int(got.buffers["x"][0]) == seq
        addrs.add(got.buffers["x"].ctypes.data)
        ring.release(got)
    assert addrs == {ring.arena.ctypes.data, ring.arena.ctypes.data + ALIGN}  # the arena's two slots


def test_host_spec_fields_get_their_own_arena():
    spec = SlotSpec(fields={"x": ((3, 5), "float32")})
    host = SlotSpec(fields={"__staging__": ((1000,), "uint8"), "cls": ((3,), "int64")})
    ring = Ring(spec, 2, host_spec=host)
    slot = ring.acquire(0)
    assert set(slot.buffers) == {"x", "__staging__", "cls"}
    assert slot.flat.nbytes == spec.nbytes and slot.host_flat.nbytes == host.nbytes
    off = host.layout()["cls"][0]
    slot.host_flat[off : off + 8] = np.array([42], np.int64).view(np.uint8)  # writes through
    assert slot.buffers["cls"][0] == 42
    assert slot.buffers["__staging__"].ctypes.data % ALIGN == 0
    assert ring.stats()["nbytes_total"] == 2 * (spec.nbytes + host.nbytes)
    with pytest.raises(RingError, match="both specs"):
        Ring(spec, 1, host_spec=SlotSpec(fields={"x": ((1,), "uint8")}))
