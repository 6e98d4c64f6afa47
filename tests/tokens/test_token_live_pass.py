"""TokenLoader's live pass follows `gdsload.frontend.cursor`'s rules (as DataLoader, issue 46 rows
10/11: tests/loader/test_live_pass.py), and its prefetch thread leaves the state exact."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import gdsload
from gdsload.errors import PassStopped, StateError

SEQ, B = 256, 4


def make(corpus, **kw):
    kw = {"shuffle": True, "seed": 3, "pack": "best_fit", "eos_token": "<eos>", "output": "numpy", **kw}
    return gdsload.TokenLoader(str(corpus.tokens), SEQ, B, **kw)


def ids(batches):
    return [b["input_ids"] for b in batches]


@pytest.fixture(scope="module")
def epochs(corpus):
    """The input_ids of epochs 0 and 5 with no prefetch (the reference)."""
    ld = make(corpus, prefetch=0)
    e0 = ids(ld)
    ld.set_epoch(5)
    return e0, ids(ld)


def test_prefetch_gives_the_rows_and_exact_states_of_no_prefetch(corpus, epochs):
    """A pass 3 steps ahead hands out the same batches; the state after each batch is the
    no-prefetch loader's (the thread's work ahead never shows in it), and resumes there."""
    e0, _ = epochs
    a, b = make(corpus, prefetch=0), make(corpus, prefetch=3)
    ia, ib = iter(a), iter(b)
    for k in range(12):
        assert np.array_equal(next(ib)["input_ids"], e0[k])
        next(ia)
        assert b.state_dict() == a.state_dict(), k
    state = json.loads(json.dumps(b.state_dict()))
    again = make(corpus, prefetch=3)
    again.load_state_dict(state)
    assert all(np.array_equal(x, y) for x, y in zip(ids(again), e0[12:], strict=True))


def test_load_state_dict_after_iter_stops_the_live_pass(corpus, epochs):
    """Lightning's order: iter(), then load_state_dict(): the live pass's thread ends before the
    call returns, its next() raises PassStopped, and the next iter() resumes from the state."""
    e0, _ = epochs
    first = make(corpus)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()
    ld = make(corpus)
    live = iter(ld)
    next(live)
    producer = live._thread
    assert isinstance(producer, threading.Thread) and producer.is_alive()
    ld.load_state_dict(state)
    assert ld.state_dict() == state  # what the next iter() will do
    assert not producer.is_alive()  # it ended before load_state_dict returned
    with pytest.raises(PassStopped, match=r"load_state_dict\(\)"):
        next(live)
    assert all(np.array_equal(x, y) for x, y in zip(ids(ld), e0[7:], strict=True))


def test_set_epoch_during_a_live_pass_stops_it(corpus, epochs):
    e0, e5 = epochs
    ld = make(corpus)
    it = iter(ld)
    assert np.array_equal(next(it)["input_ids"], e0[0])
    ld.set_epoch(5)
    s = ld.state_dict()
    assert (s["epoch"], s["step"], s["position"]) == (5, 0, 0)
    with pytest.raises(PassStopped, match=r"set_epoch\(5\)"):
        next(it)
    assert all(np.array_equal(x, y) for x, y in zip(ids(ld), e5, strict=True)) and ld.epoch == 6


def test_set_epoch_with_the_current_epoch_and_a_bad_state_keep_the_live_pass(corpus, epochs):
    e0, _ = epochs
    ld = make(corpus)
    it = iter(ld)
    got = [next(it)["input_ids"]]
    ld.set_epoch(0)  # a trainer setting the epoch it is in
    with pytest.raises(StateError):
        ld.load_state_dict({**ld.state_dict(), "seed": 99})
    got += ids(it)
    assert all(np.array_equal(x, y) for x, y in zip(got, e0, strict=True)) and ld.epoch == 1


def test_a_new_iter_closes_the_live_pass_and_continues(corpus, epochs):
    e0, _ = epochs
    ld = make(corpus)
    old = iter(ld)
    next(old)
    next(old)
    new = iter(ld)
    with pytest.raises(StopIteration):
        next(old)
    assert np.array_equal(next(new)["input_ids"], e0[2])


def test_an_error_on_the_prefetch_thread_reaches_next(corpus, tmp_path):
    """A damaged shard read ahead on the thread is raised by the training thread's next()."""
    import shutil

    from gdsload.errors import CorruptDataError

    bad = tmp_path / "bad"
    shutil.copytree(corpus.tokens, bad)
    shard = sorted(bad.glob("*.tar"))[0]
    data = bytearray(shard.read_bytes())
    for at in range(4096, len(data) - 4096, 8192):
        data[at] ^= 0xFF
    shard.write_bytes(bytes(data))
    ld = gdsload.TokenLoader(str(bad), SEQ, B, eos_token="<eos>", output="numpy", prefetch=2)
    with pytest.raises(CorruptDataError, match="CRC32"):
        for _ in ld:
            pass


def test_reads_run_on_the_prefetch_thread_ahead_of_the_training_step(corpus):
    """With prefetch, documents are read on the loader's thread, up to `prefetch` steps ahead of the
    batch the training loop holds (so they overlap its step); with prefetch=0 on the caller's."""
    import time

    for prefetch, want in ((2, {"gdsload-tokens"}), (0, {threading.current_thread().name})):
        ld = make(corpus, prefetch=prefetch, shuffle=False)
        threads, steps = set(), []
        real = ld._source.read_extent

        def read_extent(shard, offset, nbytes, real=real):
            threads.add(threading.current_thread().name)
            return real(shard, offset, nbytes)

        ld._source.read_extent = read_extent
        real_batch = ld._batch
        ld._batch = lambda rows, real_batch=real_batch: (steps.append(1), real_batch(rows))[1]
        it = iter(ld)
        next(it)
        if prefetch:
            deadline = time.monotonic() + 5
            while len(steps) < 2 + prefetch and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)
            # the batch handed out, `prefetch` waiting, one more made and waiting for room: no further
            assert len(steps) == 2 + prefetch
        else:
            assert len(steps) == 1
        assert threads == want, (prefetch, threads)
