"""Order 2 of one dataset (`gdsload.plan.window`, `gdsload.plan.permute`): it is the scheme its
docstring states, computed per position, every epoch a permutation, and at 10^10 samples a plan
resumes exactly, also on another world size, with memory O(shards)."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdsload.plan import window as window_module
from gdsload.plan.permute import permute, subkeys
from gdsload.plan.plan import Plan, epoch_order
from gdsload.plan.window import WindowOrder

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
shard_sizes = st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda s: sum(s) > 0)


def definition(sizes, seed, epoch, window):
    """Order 2 built from `gdsload.plan.window`'s docstring, one sample at a time (no segments,
    no grouping): places, dealing into rounds, rounds emitted through their keyed bijections."""
    words = np.random.PCG64(np.random.SeedSequence([seed, epoch, 0x706C616E, 2])).random_raw(
        sum(1 for n in sizes if n) + 2)
    round_key, sample_key = int(words[0]), int(words[1])
    nonempty = [i for i, n in enumerate(sizes) if n]
    places = [nonempty[k] for k in np.argsort(words[2:], kind="stable")]
    first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    w = min(window, max(sizes))
    rounds: dict[int, list[int]] = {}
    for p, shard in enumerate(places):
        n = sizes[shard]
        sigma = permute(np.arange(n), n, subkeys(sample_key, np.array([shard]))[0])
        for j in range(n):
            rounds.setdefault(p + j % w, []).append((j % w, j // w, int(first[shard] + sigma[j])))
    out = []
    for r in sorted(rounds):
        members = [ident for _, _, ident in sorted(rounds[r])]  # t ascending, then i
        pi = permute(np.arange(len(members)), len(members), subkeys(round_key, np.array([r]))[0])
        out.extend(members[k] for k in pi.tolist())
    return out


@SETTINGS
@given(sizes=shard_sizes, seed=st.integers(0, 2**40), epoch=st.integers(0, 5), window=st.integers(1, 50))
def test_order_2_is_the_documented_scheme(sizes, seed, epoch, window):
    got = epoch_order(sizes, seed=seed, epoch=epoch, shuffle=True, window=window, order=2)
    assert got.tolist() == definition(sizes, seed, epoch, window)


@SETTINGS
@given(n=st.integers(0, 3000), key=st.integers(0, 2**64 - 1))
def test_permute_is_a_bijection(n, key):
    x = np.arange(n)
    p = permute(x, n, key)
    assert np.array_equal(np.sort(p), x)
    assert np.array_equal(permute(x[::-1], n, key), p[::-1])  # elementwise: any order of queries


def test_permute_takes_one_size_and_key_per_element():
    sizes = np.array([1, 2, 7, 1000, 2**40])
    x = np.array([0, 1, 6, 999, 2**40 - 1])
    keys = np.array([5, 6, 7, 8, 9], np.uint64)
    one_by_one = [permute(np.array([a]), n, k)[0] for a, n, k in zip(x, sizes, keys)]
    assert permute(x, sizes, keys).tolist() == one_by_one
    assert all(0 <= v < n for v, n in zip(one_by_one, sizes))


def test_permute_shuffles_evenly():
    # where 0 goes, over 20,000 keys, for n = 10: each place about 2,000 times
    counts = np.bincount(permute(np.zeros(20_000, np.int64), 10, np.arange(20_000)), minlength=10)
    assert counts.min() > 1800 and counts.max() < 2200
    p = permute(np.arange(100_000), 100_000, 3)
    assert abs(np.corrcoef(p[:-1], p[1:])[0, 1]) < 0.02 and abs(np.corrcoef(np.arange(100_000), p)[0, 1]) < 0.02


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_permute_draws_small_permutations_uniformly(n):
    """Every permutation of n elements about equally often over 60,000 keys, also keys in an
    arithmetic progression (a key schedule adding the round number to the key made neighbouring
    keys share round keys: 30x the chi-square of a uniform draw at n = 5)."""
    import itertools

    keys = np.arange(60_000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    rows = np.stack([permute(np.full(len(keys), x), n, keys) for x in range(n)], axis=1)
    index = {p: i for i, p in enumerate(itertools.permutations(range(n)))}
    counts = np.bincount([index[tuple(r)] for r in rows.tolist()], minlength=len(index))
    expected = len(keys) / len(index)
    dof = len(index) - 1
    assert ((counts - expected) ** 2 / expected).sum() / dof < 1 + 4 * (2 / dof) ** 0.5


@pytest.mark.parametrize("n", [33, 100, 1000])
def test_permute_sends_pairs_everywhere_alike(n):
    keys = np.random.default_rng(1).integers(0, 2**63, 200_000).astype(np.uint64)
    a, b = permute(np.zeros(len(keys), np.int64), n, keys), permute(np.ones(len(keys), np.int64), n, keys)
    assert (a != b).all()
    cells = 400  # (pi(0), pi(1)) in 400 groups of cells
    allc = np.arange(n * n)
    expected = np.bincount(allc * cells // (n * n), weights=(allc // n != allc % n).astype(float),
                           minlength=cells) / (n * (n - 1)) * len(keys)
    got = np.bincount((a * n + b) * cells // (n * n), minlength=cells)
    assert ((got - expected) ** 2 / expected).sum() / (cells - 1) < 1.3


def test_chunks_give_each_step_its_batch(monkeypatch):
    from gdsload.plan.plan import PlanBatches

    plan = Plan("ds", (30, 25, 40, 5), 3, world_size=2, rank=1, shuffle=True, seed=2, order=2)
    want = [plan.batch(0, k) for k in range(len(plan))]
    monkeypatch.setattr(PlanBatches, "CHUNK_POSITIONS", 7)  # two steps per chunk
    monkeypatch.setattr(PlanBatches, "CHUNKS_KEPT", 2)
    lazy = plan.batches_at(0, range(len(plan)))
    order = [5, 0, 16, 1, 2, 15, 3, 4]  # across chunks, out of order, some evicted and made again
    assert all(np.array_equal(lazy[i], want[i]) for i in order + list(range(len(plan))))
    assert all(np.array_equal(a, b) for a, b in zip(plan.batches(0, 3 * 6), want[3:]))


def test_positions_are_laid_out_in_groups_alike(monkeypatch):
    sizes = (300, 1, 250, 7, 900, 0, 640)
    for window in (3, 50, 10**6):
        whole = epoch_order(sizes, seed=4, epoch=2, shuffle=True, window=window, order=2)
        monkeypatch.setattr(window_module, "_CELLS", 5)  # a handful of rounds per group
        again = WindowOrder(sizes, 4, 2, True, window).at(np.arange(sum(sizes)))
        monkeypatch.undo()
        assert np.array_equal(whole, again)


def test_a_dataset_of_200000_samples_is_a_permutation_every_epoch():
    sizes = (1999,) * 99 + (2099,)  # 200,000 samples
    assert sum(sizes) == 200_000
    for window in (1, 4, 10**9):
        plan = Plan("ds", sizes, 1000, shuffle=True, seed=1, window=window, order=2)
        seen = []
        for epoch in range(2):
            ids = np.concatenate(list(plan.batches(epoch)))
            assert np.array_equal(np.sort(ids), np.arange(200_000)), (window, epoch)
            seen.append(ids)
        assert not np.array_equal(seen[0], seen[1])


def test_a_large_window_spreads_every_shard():
    # with a window of at least the shard size, every shard has samples in each tenth of the epoch
    sizes = (500,) * 40
    got = epoch_order(sizes, seed=0, epoch=0, shuffle=True, window=10**6, order=2)
    shard = got // 500
    for tenth in np.split(shard, 10):
        assert len(set(tenth.tolist())) >= 38


# --- 10^10 samples -----------------------------------------------------------------------------

HUGE = (10**6,) * 10**4  # 10^10 samples in 10^4 shards


def global_batches(plan: Plan, epoch: int, first_step: int, count: int) -> list[np.ndarray]:
    """The global batches of steps first_step.. (ids by position), assembled from every rank."""
    from dataclasses import replace

    G, W = plan.global_batch, plan.world_size
    out = []
    for step in range(first_step, first_step + count):
        ids = np.full(G, -1, np.int64)
        for r in range(W):
            b = replace(plan, rank=r).batch(epoch, step)
            ids[r + W * np.arange(len(b))] = b
        out.append(ids)
    return out


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_and_elastic_4_to_2_at_10_to_the_10(drop_last):
    tracemalloc.start()
    try:
        four = Plan("ds", HUGE, 8, world_size=4, rank=0, shuffle=True, seed=7, drop_last=drop_last, order=2)
        assert four.num_samples == 10**10
        k = 123_456_789  # steps already taken
        uninterrupted = global_batches(four, 3, k, 4)
        state = json.loads(json.dumps(four.state(3, k * four.global_batch)))
        assert state["order"] == 2
        for world, batch in [(4, 8), (2, 16), (1, 32)]:
            resumed = Plan("ds", HUGE, batch, world_size=world, shuffle=True, seed=7, drop_last=drop_last, order=2)
            epoch, position = resumed.resume(state)
            got = global_batches(resumed, epoch, position // resumed.global_batch, 4)
            assert all(np.array_equal(a, b) for a, b in zip(got, uninterrupted)), world
        # the epoch's end: the last step, padded or dropped the same on every world size
        last = global_batches(four, 3, four.num_steps - 1, 1)[0]
        assert (last >= 0).all() and len(set(last.tolist())) == len(last)
        assert global_batches(Plan("ds", HUGE, 16, world_size=2, shuffle=True, seed=7, drop_last=drop_last,
                                   order=2), 3, four.num_steps - 1, 1)[0].tolist() == last.tolist()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak  # O(shards): 10^4 shards, not 10^10 samples


def test_positions_far_apart_are_distinct_samples_at_10_to_the_10():
    plan = Plan("ds", HUGE, 4096, shuffle=True, seed=1, order=2)
    order = plan._epoch(0)
    rng = np.random.default_rng(0)
    positions = np.unique(rng.integers(0, 10**10, 200_000))
    ids = order.at(positions)
    assert len(np.unique(ids)) == len(positions) and ids.min() >= 0 and ids.max() < 10**10
    # a window of 4 keeps consecutive positions within at most 5 shards
    run = order.at(np.arange(5 * 10**9, 5 * 10**9 + 10**6)) // 10**6
    assert len(set(run.tolist())) <= 5
