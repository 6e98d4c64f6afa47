"""`gdsload.Mix`: weighted mixing of datasets (plan properties, then the DataLoader end to end).

Plan-level properties (Hypothesis, over random shard sizes, weights, caps, world sizes):
proportions over an epoch within the stated tolerance (< 1 sample per dataset with
mix_by="sample", < one global batch with mix_by="batch"), no sample repeated inside a dataset's
own epoch (each own epoch is that dataset's `epoch_order`), independence from world size, exact
resume at any step, elastic 4 -> 2 -> 8 ranks with nothing lost or repeated, states of another mix
refused naming the difference. Loader-level: real converted `.npy` datasets, values checked
against the source arrays by (dataset, key).
"""

from __future__ import annotations

import collections
import csv
import json
import sys
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from npykit import convert_folder

from gdsload.dataset.sharded import ShardedDataset
from gdsload.dataset.mix import Mix
from gdsload.plan.mix import MixPlan, MixSource, MixSpec, _source_seed, mix_order
from gdsload.plan.plan import Plan, PlanError, StateError, epoch_order

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

sizes_st = st.lists(st.integers(0, 30), min_size=1, max_size=4).filter(lambda s: sum(s) > 0)


@st.composite
def specs(draw, *, caps: bool = True, mix_by=st.sampled_from(["sample", "batch"])):
    """A resolved mix of 1..4 datasets: weights, optionally repeat/samples caps, an epoch size."""
    k = draw(st.integers(1, 4))
    sources = []
    for i in range(k):
        sizes = tuple(draw(sizes_st))
        rule = draw(st.sampled_from(["weight", "weight", "repeat", "samples"] if caps else ["weight"]))
        kw: dict = {}
        if rule == "repeat":
            kw["repeat"] = draw(st.sampled_from([0.5, 1.0, 1.5, 3.0]))
        elif rule == "samples":
            kw["samples"] = draw(st.integers(0, 80))
        else:
            kw["weight"] = draw(st.sampled_from([0.0, 0.1, 0.3, 0.7, 1.0, 2.5, 10.0]))
        sources.append(MixSource(name=f"d{i}", dataset_id=f"id{i}", shard_sizes=sizes, **kw))
    weighted = [s for s in sources if s.weight is not None]
    if weighted and sum(s.weight for s in weighted) == 0:
        sources[sources.index(weighted[0])] = replace(weighted[0], weight=1.0)
    fixed = sum(s.fixed_count() or 0 for s in sources)
    spe = None
    if weighted and draw(st.booleans()):
        spe = fixed + draw(st.integers(1, 150))
    return MixSpec(tuple(sources), spe, draw(mix_by))


def mix_plan(spec: MixSpec, **kw) -> MixPlan:
    kw.setdefault("batch_size", 2)
    return MixPlan(dataset_id=spec.mix_id, shard_sizes=spec.shard_sizes, mix=spec, **kw)


def source_of(spec: MixSpec, ids) -> np.ndarray:
    return np.searchsorted(spec.offsets[1:], ids, side="right")


def expected_share(spec: MixSpec, unit: int) -> list[Fraction]:
    """What the semantics promise each weighted dataset, before rounding, in samples."""
    fixed = [s.fixed_count() for s in spec.sources]
    fixed_units = sum(c // unit for c in fixed if c is not None)
    total = spec.samples_per_epoch
    if total is None:
        total = sum(c if c is not None else s.num_samples for c, s in zip(fixed, spec.sources))
    share = total // unit - fixed_units
    weights = [Fraction(s.weight) if c is None else Fraction(0) for c, s in zip(fixed, spec.sources)]
    return [share * w / sum(weights) * unit if c is None else Fraction(c // unit * unit)
            for c, w in zip(fixed, weights)]


# ---------------------------------------------------------------------------------------------
# proportions


@SETTINGS
@given(spec=specs(), seed=st.integers(0, 2**32), epoch=st.integers(0, 5), shuffle=st.booleans(),
       batch=st.integers(1, 4), world=st.integers(1, 4))
def test_realised_proportions_are_the_weights_within_one_unit(spec, seed, epoch, shuffle, batch, world):
    """Over one epoch each dataset's count is its weight's share to within < 1 sample (mix_by
    sample) or < 1 global batch (mix_by batch); repeat/samples counts are exact (rounded down to
    whole global batches with mix_by batch)."""
    G = batch * world
    unit = G if spec.mix_by == "batch" else 1
    try:
        plan = mix_plan(spec, batch_size=batch, world_size=world, seed=seed, shuffle=shuffle)
    except PlanError as exc:
        assert "empty" in str(exc)
        assert spec.counts(unit).sum() == 0
        return
    order = plan._order(epoch)
    assert order.shape[0] == plan.num_samples == spec.counts(unit).sum()
    realised = np.bincount(source_of(spec, order), minlength=len(spec.sources))
    for i, (got, want) in enumerate(zip(realised, expected_share(spec, unit))):
        assert abs(got - want) < unit, (i, got, want)
        assert got % unit == 0


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.5], [0.9, 0.1], [1, 2, 7], [0.25, 0.25, 0.5]])
def test_proportions_of_several_weight_vectors(weights):
    """The issue's property with explicit weight vectors: over an epoch of 1000 samples each
    dataset's share is within 1 sample of its weight, and (shuffled, per sample) every window of
    200 positions is within 12 percentage points of it."""
    k = len(weights)
    spec = MixSpec(tuple(MixSource(f"d{i}", f"id{i}", (300, 200), weight=float(w)) for i, w in enumerate(weights)),
                   samples_per_epoch=1000)
    order = mix_order(spec, seed=3, epoch=0, shuffle=True)
    src = source_of(spec, order)
    p = np.asarray(weights, dtype=float) / sum(weights)
    assert np.all(np.abs(np.bincount(src, minlength=k) - 1000 * p) < 1)
    for start in range(0, 800, 100):
        window = np.bincount(src[start : start + 200], minlength=k) / 200
        assert np.all(np.abs(window - p) < 0.12), (start, window, p)
    smooth = source_of(spec, mix_order(spec, seed=3, epoch=0, shuffle=False))
    for start in range(0, 950, 50):  # unshuffled: the smooth interleave is close everywhere
        window = np.bincount(smooth[start : start + 50], minlength=k) / 50
        assert np.all(np.abs(window - p) <= 2 / 50 + 1e-9), (start, window)


# ---------------------------------------------------------------------------------------------
# datasets' own epochs


@SETTINGS
@given(spec=specs(), seed=st.integers(0, 2**32), shuffle=st.booleans(), window=st.integers(1, 5),
       G=st.integers(1, 6))
def test_each_dataset_reads_its_own_epochs_in_a_row(spec, seed, shuffle, window, G):
    """Across mix epochs 0..5, dataset i's samples, in order, are its own epoch orders one after
    another (`epoch_order` with its own seed): no sample repeats inside one of its epochs, and an
    exhausted dataset moves on to its next epoch, with its own shuffle."""
    unit = G if spec.mix_by == "batch" else 1
    orders = [mix_order(spec, seed=seed, epoch=e, shuffle=shuffle, window=window, global_batch=G)
              for e in range(6)]
    stream = np.concatenate(orders)
    src = source_of(spec, stream)
    for i, s in enumerate(spec.sources):
        mine = stream[src == i] - spec.offsets[i]
        n = s.num_samples
        assert mine.shape[0] == 6 * spec.counts(unit)[i]
        for own in range(mine.shape[0] // n + 1):
            chunk = mine[own * n : (own + 1) * n]
            if not chunk.shape[0]:
                break
            assert len(set(chunk.tolist())) == chunk.shape[0]  # no repeat inside an own epoch
            full = epoch_order(s.shard_sizes, seed=_source_seed(seed, i), epoch=own, shuffle=shuffle,
                               window=window)
            assert np.array_equal(chunk, full[: chunk.shape[0]])


@SETTINGS
@given(spec=specs(mix_by=st.just("batch")), seed=st.integers(0, 2**32), shuffle=st.booleans(),
       batch=st.integers(1, 4), world=st.integers(1, 4))
def test_mix_by_batch_gives_every_batch_one_source(spec, seed, shuffle, batch, world):
    try:
        plans = [mix_plan(spec, batch_size=batch, world_size=world, rank=r, seed=seed, shuffle=shuffle)
                 for r in range(world)]
    except PlanError:
        return
    steps = list(zip(*[list(p.batches(0)) for p in plans]))
    assert steps
    for step in steps:
        assert len(set(source_of(spec, np.concatenate(step)).tolist())) == 1


# ---------------------------------------------------------------------------------------------
# world size, resume, elastic


def read_positions(plans: list[Plan], epoch: int, start: int, steps: int | None) -> list[list[int]]:
    """Ids each rank reads from `start` for `steps` steps (None: to the end)."""
    out = []
    for p in plans:
        batches = list(p.batches(epoch, start))
        out.append([int(i) for b in batches[:steps] for i in b])
    return out


def ranks(spec: MixSpec, world: int, batch: int, **kw) -> list[MixPlan]:
    return [mix_plan(spec, batch_size=batch, world_size=world, rank=r, **kw) for r in range(world)]


@SETTINGS
@given(spec=specs(mix_by=st.just("sample")), seed=st.integers(0, 2**32), epoch=st.integers(0, 3),
       world=st.sampled_from([1, 2, 3, 4, 6]))
def test_order_is_the_same_across_world_sizes(spec, seed, epoch, world):
    """Interleaving the ranks' reads gives the one global order, whatever the world size."""
    if spec.counts().sum() == 0:
        return
    plans = ranks(spec, world, 1, seed=seed, shuffle=True, drop_last=True)
    per_rank = [p.epoch_indices(epoch) for p in plans]
    merged = np.stack(per_rank, axis=1).reshape(-1)
    order = mix_order(spec, seed=seed, epoch=epoch, shuffle=True)
    assert np.array_equal(merged, order[: merged.shape[0]])
    assert merged.shape[0] == (order.shape[0] // world) * world


@SETTINGS
@given(spec=specs(), seed=st.integers(0, 2**32), data=st.data())
def test_exact_resume_at_any_step(spec, seed, data):
    world, batch = data.draw(st.sampled_from([(1, 4), (2, 2), (4, 1)]))
    drop_last = data.draw(st.booleans())
    try:
        plans = ranks(spec, world, batch, seed=seed, shuffle=True, drop_last=drop_last)
    except PlanError:
        return
    p0 = plans[0]
    epoch = data.draw(st.integers(0, 3))
    k = data.draw(st.integers(0, p0.num_steps))
    state = json.loads(json.dumps(p0.state(epoch, k * p0.global_batch)))
    fresh = ranks(spec, world, batch, seed=seed, shuffle=True, drop_last=drop_last)
    got_epoch, position = fresh[0].resume(state)
    assert (got_epoch, position) == (epoch, k * p0.global_batch)
    for before, after in zip(plans, fresh):
        full = [b.tolist() for b in before.batches(epoch)]
        assert [b.tolist() for b in after.batches(got_epoch, position)] == full[k:]


@SETTINGS
@given(spec=specs(), seed=st.integers(0, 2**32), s1=st.integers(0, 4), s2=st.integers(0, 4),
       epoch=st.integers(0, 2))
def test_elastic_4_2_8_nothing_lost_or_repeated(spec, seed, s1, s2, epoch):
    """4 ranks x 2, then 2 ranks x 4 from rank 0's state, then 8 ranks x 1: the positions read
    are exactly the plan's epoch (drop_last=True), each once."""
    kw = dict(seed=seed, shuffle=True, drop_last=True)
    try:
        four = ranks(spec, 4, 2, **kw)
    except PlanError:
        return
    total_steps = four[0].num_steps
    s1, s2 = min(s1, total_steps), min(s2, total_steps - min(s1, total_steps))
    got = read_positions(four, epoch, 0, s1)
    state = json.loads(json.dumps(four[0].state(epoch, s1 * 8)))
    two = ranks(spec, 2, 4, **kw)
    e, pos = two[0].resume(state)
    got += read_positions(two, e, pos, s2)
    state = two[1].state(e, pos + s2 * 8)
    eight = ranks(spec, 8, 1, **kw)
    e, pos = eight[3].resume(state)
    got += read_positions(eight, e, pos, None)
    everything = collections.Counter(i for r in got for i in r)
    order = mix_order(spec, seed=seed, epoch=epoch, shuffle=True, global_batch=8)
    used = order[: total_steps * 8]
    assert everything == collections.Counter(used.tolist())
    # and each position by the rank the plan gives it: the reads are the order, interleaved
    assert sum(len(r) for r in got) == used.shape[0]


# ---------------------------------------------------------------------------------------------
# states of other mixes


def two(weights=(0.7, 0.3), ids=("a", "b"), **kw) -> MixSpec:
    return MixSpec((MixSource("A", ids[0], (10, 10), weight=weights[0]),
                    MixSource("B", ids[1], (5, 7), weight=weights[1])), **kw)


@pytest.mark.parametrize("other,match", [
    (two(weights=(0.5, 0.5)), r"dataset 0 \('A'\) differs in 'weight': the state has 0.7, this loader has 0.5"),
    (two(ids=("a", "c")), r"dataset 1 \('B'\) differs in 'dataset'"),
    (two(samples_per_epoch=40), r"'samples_per_epoch' differs: the state has None, this loader has 40"),
    (two(mix_by="batch"), r"'mix_by' differs"),
    (MixSpec((MixSource("A", "a", (10, 10), weight=0.7),)), r"the state mixes 2 datasets, this loader mixes 1"),
    (MixSpec((MixSource("A", "a", (10, 10), weight=0.7), MixSource("B", "b", (5, 7), repeat=1.0))),
     r"dataset 1 \('B'\) differs in 'weight'"),
])
def test_state_of_another_mix_is_refused_naming_the_difference(other, match):
    state = mix_plan(two(), batch_size=4).state(0, 8)
    with pytest.raises(StateError, match=match):
        mix_plan(other, batch_size=4).resume(state)


def test_renaming_a_source_keeps_the_state_valid():
    renamed = MixSpec(tuple(replace(s, name=s.name.lower()) for s in two().sources))
    state = mix_plan(two(), batch_size=4).state(0, 8)
    assert mix_plan(renamed, batch_size=4).resume(state) == (0, 8)


def test_single_dataset_and_mix_states_do_not_cross():
    single = Plan(dataset_id="a", shard_sizes=(10, 10), batch_size=4)
    mixed = mix_plan(two(), batch_size=4)
    with pytest.raises(StateError, match="the state is from a single dataset"):
        mixed.resume(single.state(0, 4))
    with pytest.raises(StateError, match=r"the state is from a mix of datasets \['A', 'B'\]"):
        single.resume(mixed.state(0, 4))


# ---------------------------------------------------------------------------------------------
# Mix arguments


class FakeDataset:
    """What a Mix reads from a Dataset before reading data: id, sizes, fields, path."""

    def __init__(self, path, sizes, fields=("npy", "cls")):
        self.path, self.shard_sizes, self.fields = path, tuple(sizes), list(fields)
        self.dataset_id = "id-" + path


@pytest.mark.parametrize("kw,match", [
    (dict(weights=[0.5]), r"weights has 1 entries for 2 datasets"),
    (dict(weights=[0.5, -1]), r"weights\[1\] must be a finite number >= 0"),
    (dict(weights=[0.5, "x"]), r"weights\[1\] must be a number"),
    (dict(weights=[0.0, 0.0]), r"weights of the mix are all 0"),
    (dict(weights=[0.5, 0.5], repeat=[None, 2]), r"dataset 1 has a weight .* and also repeat/samples"),
    (dict(repeat=[1, None], samples=[3, None]), r"dataset 0 has both repeat=1 and samples=3"),
    (dict(weights=[0.5, None]), r"dataset 1 has no weight"),
    (dict(mix_by="step"), r"mix_by must be 'sample' or 'batch'"),
    (dict(samples_per_epoch=0), r"samples_per_epoch must be an integer >= 1"),
    (dict(names=["x", "x"]), r"names must be 2 different non-empty strings"),
    (dict(repeat=[1, 1], samples_per_epoch=7), r"samples_per_epoch 7 would contradict them"),
    (dict(samples=[30, None], samples_per_epoch=10), r"samples_per_epoch 10 is smaller than"),
])
def test_bad_mix_arguments_are_refused_by_name(kw, match):
    a, b = FakeDataset("x/a", (10, 10)), FakeDataset("y/b", (6,))
    with pytest.raises(PlanError, match=match):
        Mix([a, b], **kw).spec


def test_mix_defaults_and_caps():
    a, b = FakeDataset("x/a", (10, 10)), FakeDataset("y/b", (6,), fields=("npy",))
    m = Mix([a, b])  # weights = sizes: concatenation, randomly interleaved
    assert m.names == ["a", "b"] and m.fields == ["npy"] and len(m) == 26
    assert m.spec.counts().tolist() == [20, 6]
    m = Mix([a, b], weights=[None, 1.0], repeat=[0.5, None], samples_per_epoch=30)
    assert m.spec.counts().tolist() == [10, 20]  # a: half of its 20; b: the remaining 20
    m = Mix([a, b], samples=[5, None], weights=[None, 3])
    assert m.spec.counts().tolist() == [5, 6]  # default epoch: 5 fixed + b's 6
    with pytest.raises(PlanError, match=r"fields \['cls'\] are not in dataset 1 \('b'\)"):
        Mix([a, b]).with_fields(["npy", "cls"])
    with pytest.raises(PlanError, match="share a folder name"):
        Mix([a, FakeDataset("z/a", (3,))])
    with pytest.raises(PlanError, match="non-empty list of datasets"):
        Mix("x/a")


# ---------------------------------------------------------------------------------------------
# the DataLoader over a mix of real datasets


class Source:
    def __init__(self, src: Path, dst: Path):
        self.dst = dst
        self.arrays = {p.stem: np.load(p) for p in sorted(src.glob("*.npy"))}
        labels = src / "labels.csv"
        self.labels = {}
        if labels.exists():
            with open(labels) as f:
                self.labels = {r["key"]: int(r["label"]) for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Source]:
    """a: 40 uint8[3,8,8] with labels; b: 24 of them with labels; c: 20 without labels;
    d: 12 uint8[8,3,8] with labels (as many bytes per sample as a, another shape)."""
    from gdsload.sampledata import make_npy_folder

    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, n, seed, labels, shape in (("a", 40, 1, True, (3, 8, 8)), ("b", 24, 2, True, (3, 8, 8)),
                                         ("c", 20, 3, False, (3, 8, 8)), ("d", 12, 4, True, (8, 3, 8))):
        make_npy_folder(root / f"src-{name}", num_samples=n, shape=shape, dtype="uint8", seed=seed,
                        labels=labels)
        out[name] = Source(root / f"src-{name}", convert_folder(root / f"src-{name}", root / name, shard_size=40_000))
    return out


def loader(srcs, names=("a", "b"), **kw):
    from gdsload.loader.dataloader import DataLoader, Dataset

    mix_kw = {k: kw.pop(k) for k in ("weights", "samples_per_epoch", "repeat", "samples", "mix_by") if k in kw}
    mix = Mix([Dataset(str(srcs[n].dst)) for n in names], **mix_kw)
    kw.setdefault("batch_size", 4)
    return DataLoader(mix, device="cpu", output="numpy", num_workers=2, **kw)


def pairs(batches) -> list[list[tuple[str, str]]]:
    return [list(zip(b["__source__"], b["__key__"])) for b in batches]


def test_loader_values_sources_and_proportions(sources):
    dl = loader(sources, weights=[0.7, 0.3], samples_per_epoch=60, shuffle=True, seed=4, copy=True)
    batches = list(dl)
    assert len(batches) == len(dl) == 15
    got = [p for b in pairs(batches) for p in b]
    counts = collections.Counter(s for s, _ in got)
    assert counts == {"a": 42, "b": 18}
    assert len(set(k for s, k in got if s == "a")) == 40  # a: one own epoch (40) and 2 of the next
    for b in batches:
        assert set(b) == {"npy", "cls", "__key__", "__source__"}
        for j, (s, k) in enumerate(zip(b["__source__"], b["__key__"])):
            np.testing.assert_array_equal(b["npy"][j], sources[s].arrays[k])
            assert b["cls"][j] == sources[s].labels[k]
    # the order is the plan's
    plan_ids = np.concatenate(list(dl.plan.batches(0)))
    assert [s for s, _ in got] == dl.dataset.sources_of(plan_ids)


def test_loader_common_fields_and_tuples(sources):
    batches = list(loader(sources, names=("a", "c"), copy=True))
    assert set(batches[0]) == {"npy", "__key__", "__source__"}  # c has no labels: npy only
    assert sum(len(b["__key__"]) for b in batches) == 60
    t = next(iter(loader(sources, names=("a", "c"), fields=("__source__", "npy", "__key__"))))
    assert isinstance(t, tuple) and t[0][0] in ("a", "c") and t[1].shape == (4, 3, 8, 8)
    with pytest.raises(PlanError, match=r"fields \['cls'\] are not in dataset 1 \('c'\)"):
        loader(sources, names=("a", "c"), fields=("npy", "cls"))


@pytest.mark.parametrize("stop", [0, 3, 8])
def test_loader_resume_exact(sources, stop):
    kw = dict(weights=[1, 2], shuffle=True, seed=9, drop_last=True, mix_by="batch")
    full = pairs(loader(sources, **kw))
    assert all(len({s for s, _ in b}) == 1 for b in full)  # mix_by batch: one source per batch
    dl = loader(sources, **kw)
    for i, _ in enumerate(dl):
        if i == stop:
            break
    state = json.loads(json.dumps(dl.state_dict()))
    dl.close()
    resumed = loader(sources, **kw)
    resumed.load_state_dict(state)
    assert pairs(resumed) == full[stop + 1 :]
    other = loader(sources, **{**kw, "weights": [1, 3]})
    with pytest.raises(StateError, match=r"dataset 1 \('b'\) differs in 'weight': the state has 2.0"):
        other.load_state_dict(state)


def test_loader_elastic_4_2_8(sources):
    kw = dict(weights=[0.6, 0.4], samples_per_epoch=64, shuffle=True, seed=2, drop_last=True)

    def run(world, batch, steps, state=None):
        seen, st0 = [], None
        for r in range(world):
            dl = loader(sources, batch_size=batch, world_size=world, rank=r, **kw)
            if state is not None:
                dl.load_state_dict(state)
            for i, b in enumerate(dl):
                seen += list(zip(b["__source__"], b["__key__"]))
                if steps is not None and i + 1 == steps:
                    break
            st0 = st0 or dl.state_dict()
            dl.close()
        return seen, st0

    first, state = run(4, 2, 2)
    second, state = run(2, 4, 3, state)
    third, _ = run(8, 1, None, state)
    assert state["position"] == 40 and len(first) == 16 and len(second) == 24 and len(third) == 24
    ref = loader(sources, batch_size=8, **kw)
    names = ref.dataset.names
    keys = {n: ShardedDataset(str(sources[n].dst)).keys() for n in names}
    order = ref.plan._order(0)
    offsets = ref.dataset.spec.offsets
    src = np.searchsorted(offsets[1:], order, side="right")
    expected = collections.Counter((names[s], keys[names[s]][i - offsets[s]]) for s, i in zip(src, order))
    assert collections.Counter(first + second + third) == expected  # an own-epoch overlap may repeat a pair
    assert sum(expected.values()) == 64


def test_tensor_shapes_must_agree_across_the_mix(sources):
    """Same bytes per sample, other shape: refused before any batch (the aligned payloads' headers
    are not parsed per sample, so this would otherwise come out as a[3,8,8]-shaped d data)."""
    from gdsload.errors import FormatError

    dl = loader(sources, names=("a", "d"))
    with pytest.raises(FormatError, match=r"field 'npy' is uint8\[8, 3, 8\] in dataset 'd' of the mix"):
        next(iter(dl))
    labels = [b for b in loader(sources, names=("a", "d"), fields=("cls", "__source__"))]
    assert sum(len(b[0]) for b in labels) == 52  # without the tensor field the mix reads


def test_mix_bench_tiny(tmp_path):
    """bench/mix_bench.py runs (speed is never asserted; the lead measures it)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "mix_bench.py"
    spec = importlib.util.spec_from_file_location("mix_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--tiny", "--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert r["ratio_mix_over_single"]["median"] > 0 and r["mix"]["samples_per_s"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["args"]["samples"] == 32


def test_mix_is_plan_layer_and_needs_numpy_only():
    """gdsload/plan/mix.py imports nothing but the plan, errors and host facts (the memory
    available, for the order's build), and `gdsload.Mix` loads without
    the loader, grpc or torch (the layer table as a whole: tests/test_layers.py)."""
    import ast
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2] / "gdsload"
    for path in (root / "plan" / "mix.py",):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gdsload"):
                assert node.module.split(".")[1] in ("errors", "plan", "host"), (path.name, node.module)
    code = ("import sys, gdsload; gdsload.Mix; bad = [m for m in ('gdsload.loader.dataloader', 'grpc', 'torch', "
            "'nvidia.dali', 'cupy') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root.parent)


def test_loader_order_does_not_depend_on_threads_and_takes_paths(sources):
    """Paths in a Mix are opened as Datasets; 1 or 3 reader threads give the same batches."""
    from gdsload.loader.dataloader import DataLoader

    kw = dict(weights=[0.5, 0.5], samples_per_epoch=40, shuffle=True, seed=6, copy=True)
    mix = Mix([str(sources["a"].dst), str(sources["b"].dst)], weights=[0.5, 0.5], samples_per_epoch=40)
    one = pairs(DataLoader(mix, batch_size=4, shuffle=True, seed=6, num_workers=1, device="cpu", output="numpy"))
    three = pairs(DataLoader(mix, batch_size=4, shuffle=True, seed=6, num_workers=3, device="cpu", output="numpy"))
    assert one == three == pairs(loader(sources, batch_size=4, **kw))
    assert {s for b in one for s, _ in b} == {"a", "b"}


def _mix_in_forked_child(dl, parent_concat, out) -> None:
    try:
        fresh = dl.dataset.shards is not parent_concat  # the parent's open shards are set aside
        out.put((fresh, pairs(dl)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent test
        out.put(repr(exc))


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_rebuilds_the_mix_shards_and_reads_the_same(sources):
    """A loader over a Mix, used in the parent, iterated in a forked child: the child opens the
    datasets' shards afresh (the parent's readers and their locks are never touched there) and
    reads the same (next) epoch as the parent."""
    import multiprocessing as mp

    dl = loader(sources, weights=[1, 1], shuffle=True, seed=4)
    pairs(dl)  # epoch 0 read in the parent: its readers are open, the cursor is at epoch 1
    parent_concat = dl.dataset.shards
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_mix_in_forked_child, args=(dl, parent_concat, out), daemon=True)
    child.start()
    try:
        got = out.get(timeout=90)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    want = pairs(dl)  # epoch 1 in the parent, whose cursor the child did not move
    dl.close()
    assert not isinstance(got, str), got
    fresh, got_pairs = got
    assert fresh
    assert got_pairs == want


def test_a_mix_order_too_big_for_free_memory_is_refused_at_once(monkeypatch):
    """Before: a local Mix with samples_per_epoch=1e12 started building its order (MemoryError,
    or swapping). Now building one takes at most 72 bytes per sample, checked against the host's
    available memory before anything is built."""
    import time

    from gdsload.plan import mix as pm
    from gdsload.plan.plan import PlanError

    src = (pm.MixSource("a", "x" * 16, (10, 10), weight=1.0), pm.MixSource("b", "y" * 16, (5,), weight=1.0))
    huge = pm.MixSpec(src, samples_per_epoch=10**12)
    plan = pm.MixPlan(dataset_id=huge.mix_id, shard_sizes=huge.shard_sizes, batch_size=4, mix=huge)
    t0 = time.monotonic()
    with pytest.raises(PlanError, match=r"10{12} samples, and building its order takes up to 72{1}0{12} bytes .*"
                                         r"over the memory available on this host"):
        next(plan.batches(0))
    assert time.monotonic() - t0 < 1
    # a fake free-memory figure: refused below the build's need, built at it
    small = pm.MixSpec(src, samples_per_epoch=1000)
    assert pm.order_nbytes(small) == 72_000
    monkeypatch.setattr("gdsload.host.memory.available_host_bytes", lambda: 71_999)
    plan = pm.MixPlan(dataset_id=small.mix_id, shard_sizes=small.shard_sizes, batch_size=4, mix=small, seed=1)
    with pytest.raises(PlanError, match="71999 bytes"):
        next(plan.batches(0))
    monkeypatch.setattr("gdsload.host.memory.available_host_bytes", lambda: 72_000)
    assert len(next(plan.batches(0))) == 4


def test_cached_mix_orders_are_bounded_in_bytes(monkeypatch):
    """The orders kept between calls (an order per epoch, per mix) never hold more than
    ORDER_CACHE_BYTES together: the least recently used go first."""
    from gdsload.plan import mix as pm

    monkeypatch.setattr(pm, "ORDER_CACHE_BYTES", 3 * 8 * 1000)  # three 1000-sample orders
    monkeypatch.setattr(pm, "_orders", {})
    src = (pm.MixSource("a", "x" * 16, (10, 10), weight=1.0), pm.MixSource("b", "y" * 16, (5,), weight=1.0))
    spec = pm.MixSpec(src, samples_per_epoch=1000)
    for epoch in range(10):
        order = pm._cached_mix_order(spec, 1, epoch, True, 4, 1)
        assert order.nbytes == 8000
        assert sum(o.nbytes for o in pm._orders.values()) <= pm.ORDER_CACHE_BYTES
    assert [k[2] for k in pm._orders] == [7, 8, 9]
    assert pm._cached_mix_order(spec, 1, 9, True, 4, 1) is order  # a hit
    big = pm.MixSpec(src, samples_per_epoch=4000)  # bigger than the whole cache: not kept
    pm._cached_mix_order(big, 1, 0, True, 4, 1)
    assert all(k[0] == spec for k in pm._orders)
