"""Order 2 of a mix (`gdsload.plan.interleave`): exact cumulative counts, each dataset read from its
own streams of order-2 epochs, blocks in the weights' proportions, the plan's contracts (ranks,
resume, elastic), and a mix of 10^10 samples per epoch planned in O(datasets + shards) memory."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdsload.plan import interleave
from gdsload.plan.interleave import cumulative
from gdsload.plan.mix import MixPlan, MixSource, MixSpec, _source_seed, check_order_memory, mix_order, order_nbytes
from gdsload.plan.plan import PlanError, StateError, epoch_order

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def spec_of(sizes_a=(40, 25, 35), sizes_b=(30, 30), weights=(0.7, 0.3), samples_per_epoch=None, mix_by="sample"):
    a = MixSource("a", "id-a", tuple(sizes_a), weight=weights[0])
    b = MixSource("b", "id-b", tuple(sizes_b), weight=weights[1])
    return MixSpec((a, b), samples_per_epoch, mix_by)


def global_batch(plan, epoch, step):
    """Global step `step`'s ids by position (rank r's j-th sample is at r + W*j), all ranks."""
    W = plan.world_size
    parts = [replace(plan, rank=r).batch(epoch, step) for r in range(W)]
    out = np.full(sum(len(p) for p in parts), -1, np.int64)
    for r, p in enumerate(parts):
        out[r + W * np.arange(len(p))] = p
    return out


def plan_of(spec, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("order", 2)
    return MixPlan(dataset_id=spec.mix_id, shard_sizes=spec.shard_sizes, mix=spec, **kw)


@SETTINGS
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda c: sum(c) > 0))
def test_cumulative_counts_are_the_smooth_interleave(counts):
    """C_i(x) for every x equals counting the x smallest keys (j + 1/2) / c_i, ties to the lower
    index, done by brute force; so they are nondecreasing and add up to x."""
    keys = sorted((Fraction(2 * j + 1, 2 * c), i) for i, c in enumerate(counts) for j in range(c))
    seen = [0] * len(counts)
    for x in range(sum(counts) + 1):
        assert cumulative(counts, x) == seen, x
        if x < len(keys):
            seen[keys[x][1]] += 1


def test_cumulative_counts_at_10_to_the_10():
    counts = [7 * 10**9 + 3, 3 * 10**9 - 3, 17]
    for x in (0, 1, 1_234_567_891, 10**10 - 1, 10**10 + 17):
        got = cumulative(counts, x)
        assert sum(got) == x and all(0 <= g <= c for g, c in zip(got, counts))
        assert all(abs(g - Fraction(x * c, sum(counts))) <= 1 for g, c in zip(got, counts))


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("block", [5, 64, interleave.BLOCK])
def test_each_dataset_reads_its_own_streams_in_order(monkeypatch, shuffle, block):
    """Over epochs 0..3 (the datasets' own epochs cut across mix epochs) dataset i's samples, in
    position order, are its stream: its own order-2 epochs one after another."""
    monkeypatch.setattr(interleave, "BLOCK", block)
    spec = spec_of(samples_per_epoch=170)
    counts = spec.counts()
    assert counts.tolist() == [119, 51]
    orders = [mix_order(spec, seed=3, epoch=e, shuffle=shuffle, window=2, order=2) for e in range(4)]
    for i, s in enumerate(spec.sources):
        lo, hi = spec.offsets[i], spec.offsets[i + 1]
        mine = np.concatenate([o[(o >= lo) & (o < hi)] for o in orders]) - lo
        assert all(((o >= lo) & (o < hi)).sum() == counts[i] for o in orders)
        own = np.concatenate([epoch_order(s.shard_sizes, seed=_source_seed(3, i), epoch=e, shuffle=shuffle,
                                          window=2, order=2) for e in range(-(-4 * counts[i] // s.num_samples))])
        assert np.array_equal(mine, own[: len(mine)])


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_block_has_the_weights_proportions(monkeypatch, shuffle):
    monkeypatch.setattr(interleave, "BLOCK", 50)
    spec = spec_of(samples_per_epoch=1003, weights=(0.6, 0.4))
    got = mix_order(spec, seed=1, epoch=2, shuffle=shuffle, order=2)
    from_a = got < spec.offsets[1]
    for start in range(0, 1003, 50):
        n_a = int(from_a[start:start + 50].sum())
        assert n_a == cumulative([602, 401], min(start + 50, 1003))[0] - cumulative([602, 401], start)[0]
        assert abs(n_a - 0.6 * len(from_a[start:start + 50])) < 2
    if not shuffle:  # smooth: never more than 2 of b in a row at 0.6/0.4
        runs = np.diff(np.flatnonzero(np.diff(from_a.astype(int)) != 0))
        assert runs.max() <= 3
    else:
        assert not np.array_equal(got, mix_order(spec, seed=1, epoch=2, shuffle=False, order=2))


def test_mix_by_batch_gives_each_global_batch_one_dataset():
    spec = spec_of(samples_per_epoch=160, mix_by="batch")
    plans = [plan_of(spec, batch_size=4, world_size=2, rank=r, shuffle=True, seed=5) for r in range(2)]
    assert plans[0].num_samples == 160
    for step in range(len(plans[0])):
        ids = np.concatenate([p.batch(0, step) for p in plans])
        assert len(set(plans[0].source_of(ids).tolist())) == 1


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_resume_and_elastic(drop_last):
    spec = spec_of(samples_per_epoch=301)
    four = plan_of(spec, batch_size=4, world_size=4, shuffle=True, seed=9, drop_last=drop_last)
    order = four._order(1)
    assert len(order) == 301
    ranks = [replace(four, rank=r) for r in range(4)]
    counts = {len(list(p.batches(1))) for p in ranks}
    assert counts == {len(four)}
    everything = np.concatenate([np.concatenate(list(p.batches(1))) for p in ranks])
    if drop_last:
        assert sorted(everything.tolist()) == sorted(order[: 301 // 16 * 16].tolist())
    else:
        assert sorted(everything.tolist()) == sorted(order[np.arange(304) % 301].tolist())
    state = json.loads(json.dumps(four.state(1, 5 * 16)))
    assert state["order"] == 2 and state["mix"]["samples_per_epoch"] == 301
    for world, batch in [(2, 8), (1, 16)]:
        other = plan_of(spec, batch_size=batch, world_size=world, shuffle=True, seed=9, drop_last=drop_last)
        epoch, position = other.resume(state)
        assert len(other) == len(four)
        for step in range(position // 16, len(four)):
            # the same id at the same position of the global batch (the padding past the 301
            # samples depends on the world size, rule 4)
            real = 301 - step * 16
            pos = {r + 4 * j: v for r, p in enumerate(ranks) for j, v in enumerate(p.batch(1, step).tolist())
                   if r + 4 * j < real}
            pos2 = {r + world * j: v for r in range(world)
                    for j, v in enumerate(replace(other, rank=r).batch(1, step).tolist()) if r + world * j < real}
            assert pos == pos2 and len(pos) == min(16, real)


def test_a_mix_state_of_the_other_order_is_refused_naming_both():
    spec = spec_of()
    state = plan_of(spec, shuffle=True, order=1).state(0, 8)
    with pytest.raises(StateError, match="the state is of order 1, this loader plans order 2"):
        plan_of(spec, shuffle=True).resume(state)
    with pytest.raises(StateError, match="the state is of order 2, this loader plans order 1"):
        plan_of(spec, shuffle=True, order=1).resume(plan_of(spec, shuffle=True).state(0, 8))


def test_order_2_memory_does_not_grow_with_the_epoch():
    small, huge = spec_of(samples_per_epoch=1000), spec_of(samples_per_epoch=10**10)
    assert order_nbytes(huge, 1, order=2) == order_nbytes(small, 1, order=2) < 4 * 2**20
    assert order_nbytes(huge, 1) == 72 * 10**10  # order 1: 72 bytes per sample
    with pytest.raises(PlanError, match="72 per sample"):
        check_order_memory(huge, 1, 2**30, "1 GiB")
    check_order_memory(huge, 1, 2**30, "1 GiB", order=2)  # not refused


@pytest.mark.parametrize("mix_by", ["sample", "batch"])
def test_a_mix_of_10_to_the_10_samples_resumes_and_changes_world_size_exactly(mix_by):
    tracemalloc.start()
    try:
        spec = spec_of(sizes_a=(1000,) * 7, sizes_b=(500,) * 3, samples_per_epoch=10**10, mix_by=mix_by)
        four = plan_of(spec, batch_size=64, world_size=4, shuffle=True, seed=2)
        assert four.num_samples == 10**10 and len(four) == 10**10 // 256
        k = 31_250_001  # past 2^33 positions: a dataset's stream is in its millionth own epoch
        want = [global_batch(four, 4, s) for s in (k, k + 1, len(four) - 1)]
        state = json.loads(json.dumps(four.state(4, k * 256)))
        two = plan_of(spec, batch_size=128, world_size=2, shuffle=True, seed=2)
        epoch, position = two.resume(state)
        for s, w in zip((position // 256, position // 256 + 1, len(two) - 1), want):
            assert np.array_equal(global_batch(two, epoch, s), w)  # the same ids at the same positions
        from_a = [np.mean(w < spec.offsets[1]) for w in want]
        if mix_by == "sample":
            assert all(abs(f - 0.7) < 0.15 for f in from_a), from_a
        else:
            assert set(from_a) <= {0.0, 1.0}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak


def test_a_huge_epoch_number_is_planned_in_python_integers():
    spec = spec_of(samples_per_epoch=10**10)
    plan = plan_of(spec, shuffle=True, seed=1)
    ids = plan.batch(2**64 - 1, 3)
    assert len(ids) == 4 and ((ids >= 0) & (ids < spec.offsets[-1])).all()
