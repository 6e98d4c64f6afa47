"""`prefetch_factor="auto"` / `num_workers="auto"` (`gdsload.loader.autotune`): the decision rule, the
ring growing under running producers, and a real loader that grows only when it stalls."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gdsload.loader.fill import SlotFiller
from gdsload.loader import autotune
from gdsload.errors import GdsloadError
from gdsload.convert.shards import DatasetWriter
from gdsload.loader.dataloader import DataLoader
from gdsload.ring.ring import Ring, SlotSpec


def _feed(tuner, windows, *, wait, pwait, dt=0.02):
    """Feed `windows` windows of batches with per-batch consumer/producer wait seconds."""
    t = w = p = 0.0
    actions = [tuner.observe(t, w, p)]
    for _ in range(windows * autotune.WINDOW):
        t, w, p = t + dt, w + wait, p + pwait
        actions.append(tuner.observe(t, w, p))
    return [a for a in actions if a]


def test_rule_grows_on_stall_with_backpressure_adds_workers_without():
    bursty = autotune.Tuner(True, True, 2, 2, 4)
    assert _feed(bursty, 3, wait=0.005, pwait=0.005) == ["grow"] * 3
    slow = autotune.Tuner(True, True, 2, 2, 4)
    assert _feed(slow, 3, wait=0.005, pwait=0.0) == ["worker"] * 3
    fixed_workers = autotune.Tuner(True, False, 2, 2, 4)
    assert _feed(fixed_workers, 3, wait=0.005, pwait=0.0) == []  # more slots would not help
    fine = autotune.Tuner(True, True, 2, 2, 4)
    assert _feed(fine, 3, wait=0.0005, pwait=0.005) == []  # 2.5 % stall: below the 5 % threshold
    at_bound = autotune.Tuner(True, False, autotune.MAX_PREFETCH, 2, 4)
    assert _feed(at_bound, 2, wait=0.005, pwait=0.005) == []
    assert autotune.fits(100, 400) and not autotune.fits(101, 400) and autotune.fits(1, None)


def test_a_new_epochs_first_wait_is_not_a_stall():
    def epochs(restart):
        t = autotune.Tuner(True, True, 2, 2, 4)
        acts = [t.observe(0.02 * k, 0.0, 0.0) for k in range(autotune.WINDOW + 1)]  # epoch 1: calm
        if restart:
            t.restart()
        now, wait = 0.02 * autotune.WINDOW + 1.0, 1.0  # epoch 2's first batch: 1 s filling the ring
        acts += [t.observe(now + 0.02 * k, wait, 0.0) for k in range(autotune.WINDOW)]
        return [a for a in acts if a]
    assert epochs(restart=False) == ["worker"]  # what the loader did before it restarted the tuner
    assert epochs(restart=True) == []


def test_ring_grows_while_producers_run_in_order():
    ring = Ring(SlotSpec({"x": ((4,), "int64")}), 2)
    n = 60
    def produce(start):
        for seq in range(start, n, 2):
            slot = ring.acquire(seq, timeout=10)
            slot.buffers["x"][:] = seq
            ring.publish(slot)
    threads = [threading.Thread(target=produce, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    seen = []
    for seq in range(n):
        if seq == 20:
            ring.grow(3)
            assert ring.num_slots == 5 and len(ring.arenas) == 2
        slot = ring.get(seq, timeout=10)
        assert (slot.buffers["x"] == seq).all() and slot.seq == seq
        seen.append(slot.index)
        time.sleep(0.001)
        ring.release(slot)
    for t in threads:
        t.join()
    assert set(seen[30:]) - {0, 1}  # the new slots carry batches
    assert ring.stats()["nbytes_total"] == 5 * ring.nbytes_per_slot
    with pytest.raises(GdsloadError, match="grow"):
        ring.grow(0)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto") / "ds"
    with DatasetWriter(root) as w:
        for i in range(400):
            w.write(f"k{i:04d}", {"bin": bytes([i % 256]) * 100, "cls": str(i % 5).encode()})
    return root


def _run(root, step_s, monkeypatch=None, slow_every=0, **kw):
    if slow_every:
        fill = SlotFiller.fill

        def bursty(self, slot, seq, ids):  # every n-th batch is slow (a cold shard, say)
            if seq % slow_every == slow_every - 1:
                time.sleep(0.03)
            return fill(self, slot, seq, ids)

        monkeypatch.setattr(SlotFiller, "fill", bursty)
    dl = DataLoader(str(root), batch_size=4, device="cpu", output="numpy", decode=False, **kw)
    keys = []
    for b in dl:
        keys += b["__key__"]
        time.sleep(step_s)
    st = dl.stats()
    slots = dl._resources.ring.num_slots
    dl.close()
    return keys, st, slots


def test_auto_grows_when_bursty_and_keeps_order(small, monkeypatch):
    keys, st, slots = _run(small, 0.006, monkeypatch, slow_every=6, prefetch_factor="auto", num_workers=1)
    assert keys == [f"k{i:04d}" for i in range(400)]
    assert st["auto"] == "prefetch" and st["prefetch_factor"] > autotune.START_PREFETCH
    assert slots == st["prefetch_factor"] + 1 and st["prefetch_factor"] <= autotune.MAX_PREFETCH


def test_auto_stays_small_when_the_loader_keeps_up(small):
    keys, st, slots = _run(small, 0.002, prefetch_factor="auto", num_workers="auto")
    assert len(keys) == 400
    assert st["prefetch_factor"] == autotune.START_PREFETCH and slots == 3
    assert st["num_workers"] == autotune.START_WORKERS and st["auto"] == "prefetch,workers"


def test_bad_values_are_refused(small):
    for kw in (dict(prefetch_factor="many"), dict(num_workers=-1), dict(prefetch_factor=True)):
        with pytest.raises(GdsloadError, match="'auto'"):
            DataLoader(str(small), device="cpu", **kw)
