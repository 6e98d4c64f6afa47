"""`loader.skip(n)` (issue 52 item 3): the next `n` global steps (the same on every rank) are not
read or decoded; it acts on the live pass (the loop goes on with the batch after them, prefetched
batches dropped) or, before `iter()`, on the next one; it does not cross the end of the epoch
(refused, naming how many steps remain); skipping exactly the rest completes the epoch as its
last batch does (the state is the next epoch's start); `state_dict()` holds the advanced
position. The feed's twin is tests/service/test_skip_remote.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gdsload.errors import ConfigError
from gdsload.loader.dataloader import DataLoader

N, BATCH = 48, 4  # 12 steps of 4 on one rank, 6 global steps of 8 on two


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """`N` samples whose `npy` row is 8 copies of its own index: a batch's rows name its keys."""
    import gdsload

    path = tmp_path_factory.mktemp("skip") / "ds"
    with gdsload.ShardWriter(str(path), shard_size="48KiB") as w:
        for i in range(N):
            w.write({"__key__": f"{i:04d}", "npy": np.full(8, i, np.float32)})
    return str(path)


def make(path: str, **kw) -> DataLoader:
    return DataLoader(path, **{"batch_size": BATCH, "shuffle": True, "seed": 3, "device": "cpu", "output": "numpy",
                               "num_workers": 2, "prefetch_factor": 3, **kw})


def checked(batch) -> list[str]:
    """The batch's keys, after checking that its rows are the samples they name."""
    keys = list(batch["__key__"])
    np.testing.assert_array_equal(np.asarray(batch["npy"])[:, 0], [int(k) for k in keys])
    return keys


def steps_of(path: str, epoch: int = 0, **kw) -> list[list[str]]:
    """Each step's keys of an uninterrupted epoch."""
    lo = make(path, **kw)
    lo.set_epoch(epoch)
    out = [checked(b) for b in lo]
    lo.close()
    return out


def flat(steps) -> list[str]:
    return [k for s in steps for k in s]


def recorder():
    """A `map` that records the key of every sample it sees (what was read and decoded)."""
    seen, lock = [], threading.Lock()

    def record(sample):
        with lock:
            seen.append(sample["__key__"])
        return sample

    return record, seen


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_before_iter_starts_the_next_pass_after_the_skipped_steps(tiny, workers):
    ref = steps_of(tiny)
    record, seen = recorder()
    lo = make(tiny, num_workers=workers, map=record, **({"prefetch_factor": None} if workers == 0 else {}))
    lo.skip(3)
    st = lo.state_dict()
    assert (st["epoch"], st["position"], len(lo)) == (0, 3 * BATCH, 12)
    assert [k for b in lo for k in checked(b)] == flat(ref[3:])
    assert sorted(seen) == sorted(flat(ref[3:]))  # nothing of the skipped steps was read or decoded
    assert lo.epoch == 1 and lo.stats()["batches"] == 9
    lo.close()


@pytest.mark.parametrize("mode", ["workers0", "workers2", "process"])
def test_skip_mid_pass_the_loop_goes_on_after_the_skipped_steps(tiny, mode):
    """The `for` loop goes on over the same iterator with the batch after the skipped steps; the
    batch the loop still holds keeps its values (its slot is not written over by the restarted
    pass); a second skip in the same pass works too; process workers (`map` in `worker_mode=
    "process"`) are started again behind the same iterator."""
    ref = steps_of(tiny)
    kw = {"workers0": {"num_workers": 0, "prefetch_factor": None}, "workers2": {},
          "process": {"map": dict, "worker_mode": "process"}}[mode]
    lo = make(tiny, **kw)
    got, held = [], None
    for i, b in enumerate(lo):
        got.append(checked(b))
        if i == 1:
            held = b  # the loop's batch across the skip (copy=False: views of its ring slot)
            lo.skip(4)
            assert lo.state_dict()["position"] == 6 * BATCH
        if i == 3:
            lo.skip(2)
        if held is not None and i == 4:
            assert checked(held) == ref[1]
    assert got == ref[:2] + ref[6:8] + ref[10:]
    assert lo.epoch == 1 and lo.state_dict()["position"] == 0
    lo.close()


def test_nothing_of_the_skipped_steps_is_read(tiny):
    """Reads counted at the backend (`read_table`, with `num_workers=0` each batch is read when
    `next()` asks for it): a pass that skips 5 steps mid-pass reads exactly the bytes of the
    batches it handed out, step for step those an uninterrupted pass reads for them. With reader
    threads, what was read and decoded (`map`) is the handed-out steps plus at most the batches
    filled ahead at the skip (ring slots and readers), never the later skipped ones."""

    def counted(lo):
        it = iter(lo)
        res = lo._resources
        reads = []
        for backend in {id(b): b for b in (res.backend, res.host_backend) if b is not None}.values():
            inner = backend.read_table

            def read_table(table, out, inner=inner):
                fut = inner(table, out)
                reads.append(fut.result())
                return fut

            backend.read_table = read_table
        return it, reads

    lo = make(tiny, num_workers=0, prefetch_factor=None)
    it, reads = counted(lo)
    read_after = [sum(reads) for _ in it]
    lo.close()
    per_step = np.diff([0, *read_after])  # bytes read for each step
    assert len(per_step) == 12 and per_step.min() > 0

    lo = make(tiny, num_workers=0, prefetch_factor=None)
    it, reads = counted(lo)
    for i, _ in enumerate(it):
        if i == 2:
            lo.skip(5)  # steps 3..7
    assert sum(reads) == sum(per_step) - sum(per_step[3:8])
    lo.close()

    ref = steps_of(tiny)
    record, seen = recorder()
    lo = make(tiny, num_workers=2, prefetch_factor=2, map=record)
    got = []
    for i, b in enumerate(lo):
        got += checked(b)
        if i == 0:
            lo.skip(8)  # steps 1..8
    assert got == flat(ref[:1] + ref[9:])
    # 3 ring slots, step 0's held: steps 1 and 2 filled ahead, step 3 at most (in the slot step 0's
    # release frees as the pass stops); steps 4..8 never
    ahead = set(seen) - set(got)
    assert ahead <= set(flat(ref[1:4])), sorted(ahead)
    lo.close()


def test_skip_is_the_same_global_steps_on_every_rank(tiny):
    """Two ranks (world size 2, global batch 8, 6 steps) each skip 2 steps after their first
    batch: each gets its own uninterrupted batches minus the same steps, the two together are
    the one-rank loader's global batches of the kept steps (batch 8), and their states are equal
    and resume on one rank exactly."""
    one = steps_of(tiny, batch_size=2 * BATCH)  # the global batches
    states, got = [], []
    for rank in range(2):
        ref = steps_of(tiny, rank=rank, world_size=2)
        lo = make(tiny, rank=rank, world_size=2)
        it = iter(lo)
        mine = [checked(next(it))]
        lo.skip(2)
        mine.append(checked(next(it)))
        states.append(lo.state_dict())
        mine += [checked(b) for b in it]
        assert mine == ref[:1] + ref[3:], rank
        got.append(mine)
        lo.close()
    assert states[0] == states[1] and states[0]["position"] == 4 * 2 * BATCH
    for step, a, b in zip([0, 3, 4, 5], *got):
        assert sorted(a + b) == sorted(one[step]), step
    resumed = make(tiny, batch_size=2 * BATCH)
    resumed.load_state_dict(states[0])
    assert [checked(b) for b in resumed] == one[4:]
    resumed.close()


def test_skip_to_exactly_the_end_completes_the_epoch(tiny):
    """As the epoch's last batch does: the state is (next epoch, 0), the live pass ends (its next
    `next()` raises StopIteration, not PassStopped) and the next `iter()` runs the next epoch. A
    skip after the last batch was handed out (the pass still live) is the next epoch's."""
    e0, e1 = steps_of(tiny, 0), steps_of(tiny, 1)
    lo = make(tiny)
    it = iter(lo)
    assert [checked(next(it)) for _ in range(5)] == e0[:5]
    lo.skip(7)
    st = lo.state_dict()
    assert (lo.epoch, st["epoch"], st["position"]) == (1, 1, 0)
    with pytest.raises(StopIteration):
        next(it)
    assert [checked(b) for b in lo] == e1

    lo.set_epoch(0)
    lo.skip(len(lo))  # before iter(): the whole epoch
    assert (lo.epoch, lo.state_dict()["position"]) == (1, 0)
    it = iter(lo)
    assert [checked(next(it)) for _ in range(len(lo))] == e1  # len() batches, no StopIteration asked
    lo.skip(2)  # the pass handed out epoch 1's last batch: the skip is epoch 2's
    assert (lo.epoch, lo.state_dict()["position"]) == (2, 2 * BATCH)
    with pytest.raises(StopIteration):
        next(it)
    assert [checked(b) for b in lo] == steps_of(tiny, 2)[2:]
    lo.close()


def test_skip_past_the_end_is_refused_naming_how_many_remain(tiny):
    ref = steps_of(tiny)
    lo = make(tiny)
    with pytest.raises(ConfigError, match=r"skip\(13\) crosses the end of epoch 0: 12 of its 12 steps remain"):
        lo.skip(13)
    it = iter(lo)
    got = [checked(next(it)) for _ in range(5)]
    with pytest.raises(ConfigError, match="7 of its 12 steps remain"):
        lo.skip(8)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="whole number of global steps"):
            lo.skip(bad)
    lo.skip(0)  # nothing
    assert lo.state_dict()["position"] == 5 * BATCH
    got += [checked(b) for b in it]  # the pass went on untouched
    assert got == ref
    lo.close()


def test_state_after_skip_holds_the_position_and_resumes_exactly(tiny):
    ref = steps_of(tiny)
    lo = make(tiny)
    it = iter(lo)
    got = [checked(next(it)) for _ in range(2)]
    lo.skip(3)
    after_skip = lo.state_dict()
    got.append(checked(next(it)))
    state = lo.state_dict()
    lo.close()
    assert got == ref[:2] + ref[5:6]
    assert (after_skip["position"], state["position"]) == (5 * BATCH, 6 * BATCH)
    for st, first in ((after_skip, 5), (state, 6)):
        resumed = make(tiny)
        resumed.load_state_dict(st)
        assert [checked(b) for b in resumed] == ref[first:]
        resumed.close()
