"""The plan: epoch order, sharding across ranks, resumption (also elastic), state checks, in both
order versions (order 2 at 10^10 samples: tests/plan/test_order2.py)."""

from __future__ import annotations

import ast
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdsload.errors import GdsloadError
from gdsload.plan.plan import DEFAULT_ORDER, ORDERS, STATE_VERSION, Plan, PlanError, StateError, epoch_order

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# 1..300 samples over 1..7 shards (empty shards allowed, as long as the dataset is not empty)
shard_sizes = st.lists(st.integers(0, 60), min_size=1, max_size=7).filter(lambda s: sum(s) > 0)
nonempty_shard_sizes = st.lists(st.integers(1, 45), min_size=1, max_size=7)
orders = st.sampled_from(ORDERS)


def shard_of(sizes, ids):
    """The shard each global id belongs to."""
    return np.searchsorted(np.cumsum(sizes), ids, side="right")


def all_ranks(plan: Plan, **changes) -> list[Plan]:
    from dataclasses import replace

    base = replace(plan, **changes) if changes else plan
    return [replace(base, rank=r) for r in range(base.world_size)]


# ---------------------------------------------------------------------------------------------
# epoch order


@SETTINGS
@given(sizes=shard_sizes, seed=st.integers(0, 2**40), epoch=st.integers(0, 50),
       shuffle=st.booleans(), window=st.integers(1, 9), order=orders)
def test_order_is_a_deterministic_permutation(sizes, seed, epoch, shuffle, window, order):
    got = epoch_order(sizes, seed=seed, epoch=epoch, shuffle=shuffle, window=window, order=order)
    assert got.dtype == np.int64
    assert np.array_equal(np.sort(got), np.arange(sum(sizes)))
    again = epoch_order(tuple(sizes), seed=seed, epoch=epoch, shuffle=shuffle, window=window, order=order)
    assert np.array_equal(got, again)
    if not shuffle:
        assert np.array_equal(got, np.arange(sum(sizes)))


@pytest.mark.parametrize("order", ORDERS)
def test_unshuffled_is_identity_whatever_seed_and_window(order):
    for seed, window in [(0, 1), (5, 4), (123, 100)]:
        got = epoch_order((4, 0, 7, 3), seed=seed, epoch=3, shuffle=False, window=window, order=order)
        assert got.tolist() == list(range(14))


@pytest.mark.parametrize("order", ORDERS)
def test_other_epoch_or_seed_gives_other_order(order):
    sizes = (30, 25, 40, 5)
    base = epoch_order(sizes, seed=1, epoch=0, shuffle=True, order=order)
    assert not np.array_equal(base, np.arange(100))
    assert not np.array_equal(base, epoch_order(sizes, seed=1, epoch=1, shuffle=True, order=order))
    assert not np.array_equal(base, epoch_order(sizes, seed=2, epoch=0, shuffle=True, order=order))
    assert not np.array_equal(base, epoch_order(sizes, seed=1, epoch=0, shuffle=True, window=2, order=order))
    for window in (1, 2, 4):
        epochs = {tuple(epoch_order((20,) * 5, seed=0, epoch=e, shuffle=True, window=window, order=order))
                  for e in range(10)}
        assert len(epochs) == 10


def test_the_two_orders_differ():
    sizes = (30, 25, 40, 5)
    assert not np.array_equal(epoch_order(sizes, seed=1, epoch=0, shuffle=True, order=1),
                              epoch_order(sizes, seed=1, epoch=0, shuffle=True, order=2))


def test_order_is_pinned():
    # The order is part of the resume contract (a state saved today must resume to the same
    # remainder after an upgrade): changing the scheme must be a deliberate, versioned decision.
    assert epoch_order((3, 2, 4), seed=7, epoch=1, shuffle=True, window=2).tolist() == [
        3, 2, 4, 1, 6, 7, 0, 8, 5,
    ]
    assert epoch_order((5, 5, 5, 5), seed=0, epoch=0, shuffle=True, window=1).tolist() == [
        1, 4, 3, 2, 0, 19, 16, 18, 15, 17, 13, 12, 10, 14, 11, 5, 9, 8, 6, 7,
    ]


def test_order_2_is_pinned():
    # Order 2 is as much part of the resume contract as order 1 (a third order would be a new
    # version): these values were computed when order 2 was introduced.
    assert epoch_order((3, 2, 4), seed=7, epoch=1, shuffle=True, window=2, order=2).tolist() == [
        2, 0, 5, 8, 1, 6, 3, 7, 4,
    ]
    assert epoch_order((5, 5, 5, 5), seed=0, epoch=0, shuffle=True, window=1, order=2).tolist() == [
        14, 12, 13, 11, 10, 9, 6, 5, 8, 7, 1, 2, 4, 3, 0, 16, 15, 18, 17, 19,
    ]
    big = Plan("ds", (10**6,) * 10**4, 4, shuffle=True, seed=3, order=2)  # 10^10 samples
    assert big.batch(5, 10**9).tolist() == [4320818479, 6979459945, 1236606255, 6979879593]


@SETTINGS
@given(sizes=shard_sizes, seed=st.integers(0, 1000), window=st.integers(1, 8), order=orders)
def test_window_open_shards_bound(sizes, seed, window, order):
    # Documented bound (a): at every position at most `window` shards are open, i.e. have samples
    # both at-or-before and at-or-after that position.
    order = epoch_order(sizes, seed=seed, epoch=0, shuffle=True, window=window, order=order)
    shard = shard_of(sizes, order)
    n = len(order)
    first = np.full(len(sizes), n)
    last = np.full(len(sizes), -1)
    np.minimum.at(first, shard, np.arange(n))
    np.maximum.at(last, shard, np.arange(n))
    present = last >= 0
    coverage = np.zeros(n + 1, dtype=np.int64)
    np.add.at(coverage, first[present], 1)
    np.add.at(coverage, last[present] + 1, -1)
    assert np.cumsum(coverage).max() <= window


@SETTINGS
@given(sizes=nonempty_shard_sizes, seed=st.integers(0, 1000), window=st.integers(1, 8), order=orders)
def test_window_run_bound(sizes, seed, window, order):
    # Documented bound (b): any min(shard_sizes) consecutive positions draw from <= window+1 shards.
    order = epoch_order(sizes, seed=seed, epoch=0, shuffle=True, window=window, order=order)
    shard = shard_of(sizes, order)
    m = min(sizes)
    for start in range(len(order) - m + 1):
        assert len(set(shard[start : start + m].tolist())) <= window + 1


@SETTINGS
@given(sizes=shard_sizes, seed=st.integers(0, 1000), order=orders)
def test_window_one_shuffles_within_shards_only(sizes, seed, order):
    order = epoch_order(sizes, seed=seed, epoch=0, shuffle=True, window=1, order=order)
    shard = shard_of(sizes, order)
    runs = [int(s) for i, s in enumerate(shard) if i == 0 or shard[i - 1] != s]
    assert len(runs) == len(set(runs)) == sum(1 for n in sizes if n)


@pytest.mark.parametrize("order", ORDERS)
def test_large_window_mixes_shards(order):
    order = epoch_order((50,) * 4, seed=3, epoch=0, shuffle=True, window=8, order=order)
    # every shard appears in the first quarter of the epoch
    assert set(shard_of((50,) * 4, order[:50]).tolist()) == {0, 1, 2, 3}


def test_performance_sanity_imagenet_sized():
    sizes = tuple([1300] * 1000)
    order = epoch_order(sizes, seed=0, epoch=0, shuffle=True)
    assert order.shape == (1_300_000,)
    assert np.array_equal(np.bincount(order, minlength=1_300_000), np.ones(1_300_000, np.int64))


def test_epoch_order_rejects_bad_arguments():
    with pytest.raises(PlanError, match="window"):
        epoch_order((3,), seed=0, epoch=0, shuffle=True, window=0)
    with pytest.raises(PlanError, match="seed"):
        epoch_order((3,), seed=-1, epoch=0, shuffle=True)
    with pytest.raises(PlanError, match="epoch"):
        epoch_order((3,), seed=0, epoch=-2, shuffle=True)
    with pytest.raises(PlanError, match=r"shard_sizes\[1\]"):
        epoch_order((3, -1), seed=0, epoch=0, shuffle=True)
    with pytest.raises(PlanError, match=r"shard_sizes\[0\]"):
        epoch_order((2.5,), seed=0, epoch=0, shuffle=True)
    with pytest.raises(PlanError, match="shuffle"):
        epoch_order((3,), seed=0, epoch=0, shuffle="yes")
    assert epoch_order((), seed=0, epoch=0, shuffle=True).shape == (0,)


# ---------------------------------------------------------------------------------------------
# sharding across ranks


@SETTINGS
@given(sizes=shard_sizes, world=st.integers(1, 8), batch=st.integers(1, 16),
       drop_last=st.booleans(), shuffle=st.booleans(), seed=st.integers(0, 100),
       epoch=st.integers(0, 3), window=st.integers(1, 5), version=orders)
def test_ranks_partition_the_epoch(sizes, world, batch, drop_last, shuffle, seed, epoch, window, version):
    plans = all_ranks(Plan("ds", tuple(sizes), batch, world_size=world, seed=seed,
                           shuffle=shuffle, window=window, drop_last=drop_last, order=version))
    n, g = sum(sizes), batch * world
    # the order every rank slices is the world-independent epoch order
    order = epoch_order(sizes, seed=seed, epoch=epoch, shuffle=shuffle, window=window, order=version)

    per_rank = [p.epoch_indices(epoch) for p in plans]
    batches = [list(p.batches(epoch)) for p in plans]
    steps = {len(p) for p in plans} | {p.num_batches(epoch) for p in plans}
    assert steps == {len(b) for b in batches}  # equal batch counts across ranks
    (num_steps,) = steps
    for p, ids, bs in zip(plans, per_rank, batches):
        assert np.array_equal(np.concatenate(bs) if bs else np.zeros(0, np.int64), ids)
        # one batch at a time, and any steps in any order, give the same batches
        assert all(np.array_equal(p.batch(epoch, k), b) for k, b in enumerate(bs))
        picked = list(range(num_steps))[::-2]
        assert all(np.array_equal(a, bs[k]) for a, k in zip(p.batches_at(epoch, picked), picked))

    # exact layout: in step k rank r holds positions k*G + r + j*world
    total = n // g * g if drop_last else -(-n // world) * world
    padded = order[np.arange(total) % n]
    for r, bs in enumerate(batches):
        for k, b in enumerate(bs):
            pos = k * g + r + world * np.arange(len(b))
            assert np.array_equal(b, padded[pos])

    everything = np.concatenate(per_rank)
    if drop_last:
        assert num_steps == n // g
        assert all(len(b) == batch for bs in batches for b in bs)
        assert len(set(everything.tolist())) == len(everything)  # no duplicates
        assert sorted(everything.tolist()) == sorted(order[: n // g * g].tolist())
    else:
        assert num_steps == -(-n // g)
        assert len({len(ids) for ids in per_rank}) == 1  # equal sample counts per rank
        assert len(everything) == -(-n // world) * world
        assert set(everything.tolist()) == set(range(n))  # every sample at least once
        extra = Counter(everything.tolist()) - Counter(range(n))
        padding = order[np.arange(len(everything) - n) % n]  # cyclic when world > n
        assert extra == Counter(padding.tolist())  # only the padding repeats
        assert all(len(b) == batch for bs in batches for b in bs[:-1])


def test_drop_last_with_too_few_samples_gives_no_batches():
    plan = Plan("ds", (3, 2), batch_size=4, world_size=2, drop_last=True)
    assert len(plan) == 0 and list(plan.batches(0)) == [] and plan.end_position == 0


def test_padding_when_world_exceeds_dataset():
    plans = all_ranks(Plan("ds", (3,), batch_size=2, world_size=5))
    got = [p.epoch_indices(0).tolist() for p in plans]
    assert got == [[0], [1], [2], [0], [1]]


# ---------------------------------------------------------------------------------------------
# resumption


def roundtrip(state):
    return json.loads(json.dumps(state))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_gives_the_identical_remainder(drop_last, shuffle, order):
    plan = Plan("ds", (17, 30, 8, 21), batch_size=3, world_size=2, rank=1, seed=9,
                shuffle=shuffle, drop_last=drop_last, order=order)
    full = list(plan.batches(2))
    steps = len(full)
    assert steps >= 4
    for k in (0, 1, steps // 2, steps - 1, steps):
        state = roundtrip(plan.state(2, k * plan.global_batch))
        epoch, position = plan.resume(state)
        assert (epoch, position) == (2, k * plan.global_batch)
        rest = list(plan.batches(epoch, position))
        assert len(rest) == steps - k
        assert all(np.array_equal(a, b) for a, b in zip(full[k:], rest))


def read(plan: Plan, epoch: int, start: int, stop: int | None = None) -> list[int]:
    """Everything all ranks of `plan` read from global position `start` up to `stop`."""
    out: list[int] = []
    g = plan.global_batch
    for p in all_ranks(plan):
        for k, b in enumerate(p.batches(epoch, start)):
            if stop is not None and start + k * g >= stop:
                break
            out.extend(b.tolist())
    return out


@SETTINGS
@given(sizes=shard_sizes, half=st.integers(1, 4), drop_last=st.booleans(),
       shuffle=st.booleans(), seed=st.integers(0, 100), version=orders, data=st.data())
def test_elastic_resume_reads_the_rest_exactly(sizes, half, drop_last, shuffle, seed, version, data):
    b4 = 2 * half  # world 4 x batch b4 == world 2 x batch 2*b4 == world 8 x batch b4/2
    before_plan = Plan("ds", tuple(sizes), b4, world_size=4, seed=seed, shuffle=shuffle,
                       drop_last=drop_last, order=version)
    n, g = sum(sizes), before_plan.global_batch
    stop_step = data.draw(st.integers(0, len(before_plan)), label="stop_step")
    position = stop_step * g
    state = roundtrip(before_plan.state(1, position))
    before = read(before_plan, 1, 0, position)
    order = epoch_order(sizes, seed=seed, epoch=1, shuffle=shuffle, window=4, order=version)

    for world, batch in [(2, 2 * b4), (8, half), (4, b4), (1, g)]:
        after_plan = Plan("ds", tuple(sizes), batch, world_size=world, seed=seed,
                          shuffle=shuffle, drop_last=drop_last, order=version)
        epoch, pos = after_plan.resume(state)
        assert (epoch, pos) == (1, position)
        total = Counter(before) + Counter(read(after_plan, epoch, pos))
        if drop_last:
            assert total == Counter(order[: n // g * g].tolist())  # exactly once, nothing lost
        else:
            assert set(total) == set(range(n))  # nothing lost
            assert sum(total.values()) - n < max(world, 4)  # only padding repeats


# ---------------------------------------------------------------------------------------------
# state checks


BASE = dict(dataset_id="a" * 64, shard_sizes=(10, 20, 7), batch_size=2, world_size=4,
            seed=5, shuffle=True, window=3, drop_last=False)


@pytest.mark.parametrize("order", ORDERS)
def test_state_is_tiny_json(order):
    plan = Plan(**BASE, order=order)
    state = plan.state(3, 16)
    assert set(state) == {"version", "order", "dataset", "seed", "shuffle", "window", "drop_last",
                          "epoch", "position", "global_batch", "num_samples"}
    assert state["version"] == STATE_VERSION and state["order"] == order
    assert roundtrip(state) == state
    assert len(json.dumps(state)) < 400
    assert plan.resume(roundtrip(state)) == (3, 16)


def test_a_plan_not_told_is_order_1_and_the_loader_default_is_named():
    assert Plan(**BASE).order == 1 and Plan(**BASE).state(0, 0)["order"] == 1
    assert DEFAULT_ORDER in ORDERS


def test_a_state_without_order_is_of_order_1():
    """States saved before order versions have no "order": order 1 resumes them, order 2 refuses
    them saying so."""
    old = dict(Plan(**BASE).state(2, 16))
    del old["order"]
    assert Plan(**BASE).resume(old) == (2, 16)
    with pytest.raises(StateError, match=r"'order' does not match: the state has no 'order' field .* it is of "
                                         r"order 1, this loader plans order 2; resume it with a loader of order=1"):
        Plan(**BASE, order=2).resume(old)


@pytest.mark.parametrize(("saved", "current"), [(1, 2), (2, 1)])
def test_a_state_of_another_order_is_refused_naming_both(saved, current):
    state = roundtrip(Plan(**BASE, order=saved).state(0, 8))
    with pytest.raises(StateError, match=f"the state is of order {saved}, this loader plans order {current}; "
                                         f"resume it with a loader of order={saved}"):
        Plan(**BASE, order=current).resume(state)


@pytest.mark.parametrize("bad", [0, 3, "2", 2.0, True, None])
def test_an_unknown_order_is_refused(bad):
    with pytest.raises(PlanError, match=f"order must be one of the order versions 1 or 2, got {bad!r}"):
        Plan(**BASE, order=bad)
    state = dict(Plan(**BASE).state(0, 8), order=bad)
    with pytest.raises(StateError, match="state field 'order' must be one of the order versions 1 or 2"):
        Plan(**BASE).resume(state)
    with pytest.raises(PlanError, match="order"):
        epoch_order((3,), seed=0, epoch=0, shuffle=True, order=bad)


@pytest.mark.parametrize("order", ORDERS)
def test_single_batches_and_bad_steps(order):
    plan = Plan(**BASE, order=order)
    assert len(plan.batches_at(0, range(0))) == 0
    with pytest.raises(PlanError, match=r"step 5 is beyond the epoch: it has 5 steps \(0\.\.4\)"):
        plan.batch(0, 5)
    with pytest.raises(PlanError, match="step 5 is beyond"):
        plan.batches_at(0, range(3, 6))
    with pytest.raises(PlanError, match="step must be an integer >= 0, got -1"):
        plan.batches_at(0, [2, -1])
    lazy = plan.batches_at(1, range(1, 4))
    assert [b.tolist() for b in lazy[1:]] == [plan.batch(1, k).tolist() for k in (2, 3)]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(dataset_id="b" * 64), "dataset"),
        (dict(seed=6), "seed"),
        (dict(shuffle=False), "shuffle"),
        (dict(window=4), "window"),
        (dict(drop_last=True), "drop_last"),
        (dict(batch_size=4), "global_batch"),
        (dict(world_size=2), "global_batch"),
        (dict(shard_sizes=(10, 20, 8)), "num_samples"),
    ],
)
def test_incompatible_state_is_refused_naming_the_field(change, field):
    state = roundtrip(Plan(**BASE).state(0, 8))
    other = Plan(**{**BASE, **change})
    with pytest.raises(StateError, match=f"'{field}'") as info:
        other.resume(state)
    message = str(info.value)
    if field == "dataset":
        assert "'aaaaaaaaaaaaaaaa…'" in message and "'bbbbbbbbbbbbbbbb…'" in message
    elif field == "global_batch":
        assert "8" in message and str(other.global_batch) in message
    else:
        now = other.num_samples if field == "num_samples" else getattr(other, field)
        assert f"{field} {state[field]!r}" in message and f"{field} {now!r}" in message


def test_dataset_ids_with_a_common_prefix_are_told_apart():
    state = Plan(**{**BASE, "dataset_id": "f" * 40 + "1" * 24}).state(0, 0)
    with pytest.raises(StateError, match="f{40}1111…'.*f{40}aaaa…'"):
        Plan(**{**BASE, "dataset_id": "f" * 40 + "a" * 24}).resume(state)


def test_elastic_world_size_is_accepted():
    state = Plan(**BASE).state(0, 8)
    for world, batch in [(1, 8), (2, 4), (8, 1)]:
        assert Plan(**{**BASE, "world_size": world, "batch_size": batch}).resume(state) == (0, 8)


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda s: s.pop("position"), "missing.*'position'"),
        (lambda s: s.pop("dataset"), "missing.*'dataset'"),
        (lambda s: s.update(version=2), "version"),
        (lambda s: s.update(position="8"), "position"),
        (lambda s: s.update(position=8.0), "position"),
        (lambda s: s.update(position=True), "position"),
        (lambda s: s.update(position=-8), "position"),
        (lambda s: s.update(position=6), "'position' = 6 is not a multiple of the global batch 8"),
        (lambda s: s.update(position=48), r"'position' = 48 is beyond the epoch.*0\.\.40"),
        (lambda s: s.update(epoch=-1), "epoch"),
        (lambda s: s.update(epoch="0"), "epoch"),
        (lambda s: s.update(seed="5"), "seed"),
        (lambda s: s.update(shuffle=1), "shuffle"),
        (lambda s: s.update(dataset=7), "dataset"),
        (lambda s: s.update(global_batch=0), "global_batch"),
    ],
)
def test_malformed_state_is_refused(mutate, pattern):
    state = dict(Plan(**BASE).state(0, 8))
    mutate(state)
    with pytest.raises(StateError, match=pattern):
        Plan(**BASE).resume(state)


def test_non_mapping_state_is_refused():
    for bad in (None, [], "state", 3):
        with pytest.raises(StateError, match="mapping"):
            Plan(**BASE).resume(bad)


def test_end_of_epoch_state_resumes_to_nothing():
    plan = Plan(**BASE)
    end = plan.end_position
    assert end == len(plan) * plan.global_batch == 40
    assert plan.resume(plan.state(0, end)) == (0, end)
    assert list(plan.batches(0, end)) == []


def test_bad_start_positions_are_refused():
    plan = Plan(**BASE)
    with pytest.raises(PlanError, match="multiple of the global batch 8"):
        list(plan.batches(0, 4))
    with pytest.raises(PlanError, match="beyond the epoch"):
        plan.batches(0, 48)
    with pytest.raises(PlanError, match="position"):
        plan.state(0, 12)


# ---------------------------------------------------------------------------------------------
# plan validation and module hygiene


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (dict(rank=4), r"rank 4 is out of range.*0\.\.3"),
        (dict(rank=-1), r"rank -1 is out of range.*0\.\.3"),
        (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
        (dict(batch_size=True), "batch_size"),
        (dict(world_size=0), "world_size must be an integer >= 1, got 0"),
        (dict(window=0), "window must be an integer >= 1, got 0"),
        (dict(seed=-3), "seed must be an integer >= 0, got -3"),
        (dict(shuffle="no"), "shuffle must be True or False"),
        (dict(dataset_id=""), "dataset_id"),
        (dict(shard_sizes=(0, 0)), "no samples"),
        (dict(shard_sizes=()), "no samples"),
        (dict(shard_sizes=(3, -2)), r"shard_sizes\[1\] must be an integer >= 0, got -2"),
        (dict(shard_sizes="abc"), "shard_sizes"),
    ],
)
def test_invalid_plans_are_refused(change, pattern):
    with pytest.raises(PlanError, match=pattern) as info:
        Plan(**{**BASE, **change})
    assert isinstance(info.value, GdsloadError) and isinstance(info.value, ValueError)


def test_plan_is_frozen_and_normalises():
    plan = Plan("ds", [np.int64(3), 4], np.int32(2), world_size=2, rank=np.int64(1))
    assert plan.shard_sizes == (3, 4) and type(plan.shard_sizes[0]) is int
    assert plan.global_batch == 4 and plan.num_samples == 7
    with pytest.raises(AttributeError):
        plan.rank = 0  # type: ignore[misc]
    assert hash(plan) == hash(Plan("ds", (3, 4), 2, world_size=2, rank=1))


def test_state_error_is_a_gdsload_error():
    assert issubclass(StateError, GdsloadError) and issubclass(StateError, PlanError)


@pytest.mark.parametrize("module", ["plan", "mix", "permute", "window", "interleave"])
def test_plan_modules_import_only_numpy_and_stdlib(module):
    import sys

    source = Path(__file__).resolve().parents[2] / "gdsload" / "plan" / f"{module}.py"
    tree = ast.parse(source.read_text())
    roots, ours = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
            if node.module.startswith("gdsload"):
                ours.add(node.module)
    assert roots - set(sys.stdlib_module_names) <= {"numpy", "gdsload"}
    assert all(m.startswith(("gdsload.plan.", "gdsload.errors", "gdsload.host.")) for m in ours), ours
    assert not any(isinstance(node, ast.Assert) for node in ast.walk(tree))
