"""`DataLoader(order=...)`: the order version reaches the plan and the state, a state of the other
order is refused, and a pass computes its batches as its readers claim them (`Plan.batches_at`),
never the whole epoch first, also for a server's strided steps."""

from __future__ import annotations

import numpy as np
import pytest

import gdsload
from gdsload import DataLoader
from gdsload.dataset.mix import Mix
from gdsload.plan.plan import DEFAULT_ORDER, Plan, PlanBatches, StateError


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("orders")
    for name, n in (("a", 60), ("b", 40)):
        with gdsload.ShardWriter(root / name, shard_size="16KiB") as w:
            for i in range(n):
                w.write({"__key__": f"{name}{i:03d}", "x.npy": np.array([i], np.int64)})
    return root


def loader(source, **kw):
    kw.setdefault("batch_size", 4)
    return DataLoader(source, decode=False, output="numpy", device="cpu", num_workers=2,
                      fields=["__key__", "x.npy"], **kw)


def keys(batches):
    return [list(b[0]) for b in batches]


def test_the_order_reaches_the_plan_the_batches_and_the_state(two):
    ds = gdsload.Dataset(str(two / "a"))
    names = [f"a{i:03d}" for i in range(60)]
    by_order = {}
    for order in (1, 2):
        lo = loader(ds, shuffle=True, seed=3, order=order)
        assert lo.plan.order == order and lo.state_dict()["order"] == order
        got = keys(lo)
        want = [[names[i] for i in b] for b in Plan(ds.dataset_id, ds.shard_sizes, 4, shuffle=True, seed=3,
                                                    order=order).batches(0)]
        assert got == want
        by_order[order] = got
    assert by_order[1] != by_order[2]
    assert loader(ds).plan.order == DEFAULT_ORDER


def test_a_state_of_the_other_order_is_refused_naming_both(two):
    ds = gdsload.Dataset(str(two / "a"))
    one = loader(ds, shuffle=True, seed=3, order=1)
    it = iter(one)
    next(it)
    state = one.state_dict()
    one.close()
    with pytest.raises(StateError, match="the state is of order 1, this loader plans order 2; resume it with "
                                         "a loader of order=1"):
        loader(ds, shuffle=True, seed=3, order=2).load_state_dict(state)
    again = loader(ds, shuffle=True, seed=3, order=1)
    again.load_state_dict(state)
    assert keys(again)[0] == keys(loader(ds, shuffle=True, seed=3, order=1))[1]


def test_a_pass_computes_only_the_batches_it_reaches(two, monkeypatch):
    """A mix of 400,000 samples per epoch (100,000 steps): two batches taken, then a break. The
    pass computed the first batch alone and the first chunk after it (`PlanBatches.CHUNK_POSITIONS`
    positions), not the epoch (before `batches_at`, `Epoch` listed every batch first)."""
    computed = []
    real = Plan._steps

    def counting(self, order, steps):
        computed.extend(steps)
        return real(self, order, steps)

    monkeypatch.setattr(Plan, "_steps", counting)
    mix = Mix([str(two / "a"), str(two / "b")], weights=[0.5, 0.5], samples_per_epoch=400_000)
    lo = loader(mix, shuffle=True, seed=1, order=2, prefetch_factor=2)
    assert len(lo) == 100_000
    chunk = PlanBatches.CHUNK_POSITIONS // 4
    it = iter(lo)
    head = [next(it) for _ in range(2)]
    it.close()
    assert sorted(computed) == list(range(chunk + 1)), len(set(computed))  # each step once
    assert [list(b[0]) for b in head] == [key_of(lo.plan.batch(0, s)) for s in (0, 1)]

    computed.clear()
    steps = [3, 500, 9_999, 99_999]  # a server's blocks of a stripe
    strided = list(lo.iter_batches(steps=steps))
    assert sorted(set(computed)) == steps
    assert [list(b[0]) for b in strided] == [key_of(lo.plan.batch(0, s)) for s in steps]


def key_of(ids):
    """The keys of the mix's global ids (dataset a's 60 samples, then b's 40)."""
    return [f"a{i:03d}" if i < 60 else f"b{i - 60:03d}" for i in ids.tolist()]
