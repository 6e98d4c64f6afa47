"""Weighted mixing of several datasets: the order and the plan of a `gdsload.Mix`.

Part of the plan layer: a pure function of its inputs (NumPy and the standard library; the only
gdsload import is the plan), no I/O, no state that affects results. The user object `Mix`, which
opens datasets, is `gdsload.dataset.mix`; it is read wherever a `Dataset` is: `DataLoader`,
`RemoteLoader`, `gdsload serve`.

Semantics
---------
Datasets ``0..k-1`` with ``N_i`` samples each. Per epoch of the mix, dataset ``i`` contributes
``c_i`` samples, fixed by exactly one of (MosaicML Streaming's `proportion` / `repeat` / `choose`):

* ``samples[i]``: ``c_i = samples[i]`` (absolute);
* ``repeat[i]``: ``c_i = round(repeat[i] * N_i)`` (up- or down-sampling);
* otherwise its weight (``weights[i]``; with ``weights=None`` every weight is ``N_i``, which is
  plain concatenation with a random interleave): the weighted datasets share what is left of the
  epoch, ``E - sum(fixed c_i)``, in proportion to their weights (largest-remainder rounding, ties
  to the lower index, so the counts add up exactly and differ from ``share * w_i / sum(w)`` by
  less than 1).

``E`` is ``samples_per_epoch``, or by default ``sum(fixed c_i) + sum(N_i of the weighted ones)``
(the sum of the datasets when none is fixed). The epoch has ``M = sum(c_i)`` samples.

Order of epoch ``e``: an array of ``M`` *global ids* (not a permutation: a dataset may give more
or fewer samples than it has). Dataset ``i``'s sample ``j`` has id ``offset_i + j`` with
``offset_i = N_0 + ... + N_{i-1}``, so the loader reads a mix like one dataset whose shards are
the datasets' shards one after another.

1. Each dataset has its own endless *stream*: its own epochs ``0, 1, 2, ...`` one after another,
   each the single-dataset `epoch_order` (its own shuffle, seeded from ``(seed, i)``). Mix epoch
   ``e`` takes stream positions ``[e*c_i, (e+1)*c_i)``. So no sample repeats within one of the
   dataset's own epochs; when a dataset is exhausted the mix moves on to its next own epoch.
2. The interleave: which dataset each position of the epoch comes from. With ``shuffle`` a
   random permutation of the multiset (``c_i`` times ``i``; PCG64 raw words, stable sort, as in
   the plan); without, a smooth interleave (dataset ``i``'s ``j``-th sample at key
   ``(j + 0.5) / c_i``), so every stretch of the epoch has nearly the weights' proportions.
3. ``mix_by="batch"``: the unit of the interleave is a whole global batch ``G`` instead of one
   sample, so every global step (every rank's batch in it) comes from one dataset. Counts are then
   apportioned in whole global batches (``E // G`` of them; fixed counts rounded down to whole
   batches) and ``M`` is a multiple of ``G``. This is the only case where the order depends on
   ``G``, which a resume keeps anyway.

That is order 1 (`gdsload.plan.plan`, "Order versions"): the epoch's order is built whole, and
its cost grows with the epoch (below). Order 2 (`gdsload.plan.interleave`) keeps the counts
``c_i`` and the streams of rule 1 (each own epoch in order 2) and computes per block of
positions: the counts before a position are the smooth interleave's (rule 2 without shuffle),
exactly, so every block of `BLOCK` units has the weights' proportions to within one unit per
dataset, and with ``shuffle`` the block's positions are permuted; nothing is built per sample, so
``samples_per_epoch=10**10`` plans as fast as ``10**3``.

Everything else is the plan's (`gdsload.plan.plan`): ranks take interleaved slices of this order, the
``drop_last`` and padding rules apply to ``M``, a state records the global position and resumes
exactly, also on another world size with the same global batch. A state also records the mix
(datasets' ids, weights, repeat, samples, samples_per_epoch, mix_by); a state from another mix is
refused naming the first difference (weights are compared as given: ``[1, 2]`` and
``[0.5, 1]`` mix alike, but a state of one is refused by the other; source names only label
and may change). Cost, once per epoch (cached like the plan's): one sort
of ``M/unit`` random keys, one linear radix sort, and the datasets' own epoch orders that the
epoch touches (three sorts each; an own epoch cut by the epoch boundary is computed in both
epochs); no Python per sample. About 0.9 s for 1.3 M samples mixed 0.7/0.3 from two datasets on
the 2-core VM, against 0.3 s for one dataset's `epoch_order`.

Fields: a mix yields the fields every dataset has (in the first dataset's order), plus
``"__key__"`` and ``"__source__"`` (per sample, the name of its dataset: ``names=``, or each
dataset's folder name). Asking for a field one dataset lacks is an error naming that dataset;
there is no fill (a batch tensor needs every sample to have the field).
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypedDict

import numpy as np

from gdsload.plan.plan import (
    Plan,
    PlanError,
    PlanState,
    StateError,
    _compute_order,
    _order_version,
    _shorten,
    cached_epoch,
)

__all__ = ["MixPlan", "MixSource", "MixSpec", "mix_order"]

_DOMAIN = 0x6D6978  # "mix": keeps the interleave and the per-dataset seeds apart from the plan's
MIX_BY = ("sample", "batch")


# --------------------------------------------------------------------------------------------
# the resolved description: what the order depends on


@dataclass(frozen=True)
class MixSource:
    """One dataset of a mix, resolved: its identity and sizes, and how its count is fixed
    (exactly one of `weight`, `repeat`, `samples` is not None)."""

    name: str
    dataset_id: str
    shard_sizes: tuple[int, ...]
    weight: float | None = None
    repeat: float | None = None
    samples: int | None = None

    @property
    def num_samples(self) -> int:
        return sum(self.shard_sizes)

    @functools.cached_property
    def sizes_key(self) -> str:
        """A short identity of `shard_sizes` (cache keys)."""
        from gdsload.plan.window import sizes_key

        return sizes_key(self.shard_sizes)

    def fixed_count(self) -> int | None:
        """``c_i`` when fixed by `samples` or `repeat`, else None (weighted)."""
        if self.samples is not None:
            return self.samples
        if self.repeat is not None:
            return round(self.repeat * self.num_samples)
        return None


class MixSourceState(TypedDict):
    name: str
    dataset: str
    num_samples: int
    weight: float | None
    repeat: float | None
    samples: int | None


class MixState(TypedDict):
    """What a loader state records about a mix (state field "mix")."""

    datasets: list[MixSourceState]
    samples_per_epoch: int | None
    mix_by: str


@dataclass(frozen=True)
class MixSpec:
    """A resolved mix: everything its order depends on besides (seed, epoch, shuffle, window)."""

    sources: tuple[MixSource, ...]
    samples_per_epoch: int | None = None
    mix_by: str = "sample"
    # a token mix's weight schedule: ((tokens consumed, (weight per dataset, ...)), ...), increasing
    # token counts > 0; from each count on, the weights are its (`gdsload.plan.tokenmix`)
    schedule: tuple[tuple[int, tuple[float, ...]], ...] = ()

    def __post_init__(self) -> None:
        if not self.sources:
            raise PlanError("a mix needs at least one dataset")
        if self.mix_by not in MIX_BY:
            raise PlanError(f"mix_by must be 'sample' or 'batch', got {self.mix_by!r}")
        for i, s in enumerate(self.sources):
            if s.num_samples == 0:
                raise PlanError(f"dataset {i} ({s.name!r}) of the mix has no samples")
            if sum(x is not None for x in (s.weight, s.repeat, s.samples)) != 1:
                raise PlanError(f"dataset {i} ({s.name!r}): give exactly one of weight, repeat, samples")
        weighted = [s for s in self.sources if s.fixed_count() is None]
        if weighted and sum(s.weight for s in weighted) <= 0:
            raise PlanError("the weights of the mix are all 0; at least one must be > 0")
        if not weighted and self.samples_per_epoch is not None:
            fixed = sum(s.fixed_count() for s in self.sources)
            if self.samples_per_epoch != fixed:
                raise PlanError(
                    f"every dataset of the mix has repeat or samples (together {fixed} samples); "
                    f"samples_per_epoch {self.samples_per_epoch} would contradict them: leave it out"
                )
        check_schedule(self.schedule, len(self.sources))
        self.units(1)  # refuses a samples_per_epoch below the fixed counts (also holds per batch)

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """The datasets' shards one after another: the id space of the mix."""
        return tuple(n for s in self.sources for n in s.shard_sizes)

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Global id of each dataset's first sample (length k+1: the last is the total)."""
        out = np.concatenate(([0], np.cumsum([s.num_samples for s in self.sources]))).astype(np.int64)
        out.setflags(write=False)
        return out

    def units(self, unit: int = 1) -> np.ndarray:
        """Per dataset, its count per epoch in units of `unit` samples (1, or G for mix_by batch)."""
        fixed = [s.fixed_count() for s in self.sources]
        out = [0 if c is None else c // unit for c in fixed]
        weighted = [i for i, c in enumerate(fixed) if c is None]
        if weighted:
            if self.samples_per_epoch is not None:
                total = self.samples_per_epoch
            else:
                total = sum(c for c in fixed if c is not None) + sum(
                    self.sources[i].num_samples for i in weighted)
            share = total // unit - sum(out)
            if share < 0:
                raise PlanError(
                    f"samples_per_epoch {total} is smaller than the samples the datasets with "
                    f"repeat/samples take ({sum(out) * unit}); raise it or lower those"
                )
            weights = [Fraction(self.sources[i].weight) for i in weighted]
            quotas = [share * w / sum(weights) for w in weights]
            counts = [int(q) for q in quotas]  # floor (quotas are >= 0)
            by_remainder = sorted(range(len(quotas)), key=lambda j: (-(quotas[j] - counts[j]), j))
            for j in by_remainder[: share - sum(counts)]:
                counts[j] += 1
            for i, c in zip(weighted, counts):
                out[i] = c
        return np.asarray(out, dtype=np.int64)

    def counts(self, unit: int = 1) -> np.ndarray:
        """Per dataset, the samples it contributes to one epoch (``c_i``)."""
        return self.units(unit) * unit

    def describe(self) -> MixState:
        out = MixState(
            datasets=[MixSourceState(name=s.name, dataset=s.dataset_id, num_samples=s.num_samples,
                                     weight=s.weight, repeat=s.repeat, samples=s.samples)
                      for s in self.sources],
            samples_per_epoch=self.samples_per_epoch, mix_by=self.mix_by,
        )
        if self.schedule:  # only then: a mix without one keeps its id and states
            out["schedule"] = [[at, list(w)] for at, w in self.schedule]  # type: ignore[typeddict-unknown-key]
        return out

    @functools.cached_property
    def mix_id(self) -> str:
        """Identity of the order: a hash of everything but the names (which only label)."""
        d = self.describe()
        for s in d["datasets"]:
            s.pop("name")
        return "mix-" + hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def differences(self, saved: Any) -> str | None:
        """The first way a state's "mix" field differs from this mix, in words (None: same)."""
        now = self.describe()
        if not isinstance(saved, Mapping) or not isinstance(saved.get("datasets"), list):
            return "it is malformed (a mapping with a 'datasets' list was expected)"
        old = saved["datasets"]
        if len(old) != len(now["datasets"]):
            return f"the state mixes {len(old)} datasets, this loader mixes {len(now['datasets'])}"
        for i, (a, b) in enumerate(zip(old, now["datasets"])):
            if not isinstance(a, Mapping):
                return f"dataset {i} is malformed"
            for key in ("dataset", "num_samples", "weight", "repeat", "samples"):
                if a.get(key) != b[key]:
                    x, y = (a.get(key), b[key])
                    if key == "dataset" and isinstance(x, str):
                        x, y = _shorten(x, y)
                    return (f"dataset {i} ({b['name']!r}) differs in {key!r}: the state has {x}, "
                            f"this loader has {y}")
        if saved.get("schedule", []) != now.get("schedule", []):
            return (f"the weight schedule differs: the state has {saved.get('schedule', [])!r}, this loader "
                    f"has {now.get('schedule', [])!r}")
        for key in ("samples_per_epoch", "mix_by"):
            if saved.get(key) != now[key]:
                return f"{key!r} differs: the state has {saved.get(key)!r}, this loader has {now[key]!r}"
        return None


def check_schedule(schedule: Any, k: int) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """A weight schedule checked and normalised: ``[(tokens, [w_0 .. w_k-1]), ...]`` with token
    counts > 0 and increasing, each a list of `k` finite weights >= 0, not all 0."""
    if schedule is None:
        return ()
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, (list, tuple)):
        raise PlanError(f"schedule must be a list of (tokens, weights) pairs, got {schedule!r}")
    out, last = [], 0
    for n, entry in enumerate(schedule):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise PlanError(f"schedule[{n}] must be a (tokens, weights) pair, got {entry!r}")
        at, weights = entry
        if isinstance(at, bool) or not isinstance(at, (int, np.integer)) or at <= last:
            raise PlanError(f"schedule[{n}]: the token count must be an int > {last} (counts increase), got {at!r}")
        if isinstance(weights, (str, bytes)) or not isinstance(weights, (list, tuple, np.ndarray)) or len(weights) != k:
            raise PlanError(f"schedule[{n}]: give {k} weights, one per dataset, got {weights!r}")
        ws = []
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)) \
                    or not np.isfinite(w) or w < 0:
                raise PlanError(f"schedule[{n}]: weights must be finite numbers >= 0, got {w!r}")
            ws.append(float(w))
        if sum(ws) <= 0:
            raise PlanError(f"schedule[{n}]: the weights are all 0; at least one must be > 0")
        out.append((int(at), tuple(ws)))
        last = int(at)
    return tuple(out)


# --------------------------------------------------------------------------------------------
# the order


def _source_seed(seed: int, i: int) -> int:
    return int(np.random.SeedSequence([seed, i, _DOMAIN]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def _stream(source: MixSource, seed: int, i: int, shuffle: bool, window: int,
            start: int, count: int) -> np.ndarray:
    """Positions ``[start, start+count)`` of dataset `i`'s stream (its own epochs in a row)."""
    n = source.num_samples
    if count == 0:
        return np.empty(0, dtype=np.int64)
    first, last = start // n, (start + count - 1) // n
    own_seed = _source_seed(seed, i)
    parts = [_compute_order(source.shard_sizes, own_seed, e, shuffle, window) for e in range(first, last + 1)]
    flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return flat[start - first * n : start - first * n + count]


def mix_order(spec: MixSpec, *, seed: int, epoch: int, shuffle: bool, window: int = 4,
              global_batch: int = 1, order: int = 1) -> np.ndarray:
    """The global ids of mix epoch `epoch`, in order (int64; see the module docstring), in order
    version `order` (the whole epoch: O(M) memory either way; a `MixPlan` of order 2 computes
    per batch instead).

    `global_batch` matters only with ``mix_by="batch"`` (the interleave's unit).
    """
    unit = global_batch if spec.mix_by == "batch" else 1
    if _order_version(order) == 2:
        mixed = mix_order2(spec, seed=seed, epoch=epoch, shuffle=shuffle, window=window, unit=unit)
        return mixed.at(np.arange(mixed.num_samples, dtype=np.int64))
    units = spec.units(unit)
    k = len(spec.sources)
    labels = np.repeat(np.arange(k, dtype=np.int64), units)
    if shuffle:
        bits = np.random.PCG64(np.random.SeedSequence([seed, epoch, _DOMAIN]))
        labels = labels[np.argsort(bits.random_raw(labels.shape[0]), kind="stable")]
    else:
        starts = np.repeat(np.cumsum(units) - units, units)
        rank = np.arange(labels.shape[0], dtype=np.int64) - starts
        key = (rank + 0.5) / np.repeat(units, units).astype(np.float64)
        labels = labels[np.argsort(key, kind="stable")]
    # uint16 labels: NumPy's stable sort of <= 16-bit integers is a radix sort (linear)
    per_position = np.repeat(labels.astype(np.uint16 if k < 2**16 else np.int64), unit)
    offsets = spec.offsets
    counts = units * unit
    ids = [
        _stream(s, seed, i, shuffle, window, epoch * int(counts[i]), int(counts[i])) + offsets[i]
        for i, s in enumerate(spec.sources)
    ]
    out = np.empty(per_position.shape[0], dtype=np.int64)
    # positions grouped by dataset, in epoch order within each: the m-th gets its m-th stream id
    out[np.argsort(per_position, kind="stable")] = np.concatenate(ids)
    return out


def mix_order2(spec: MixSpec, *, seed: int, epoch: int, shuffle: bool, window: int, unit: int) -> Any:
    """Order 2 of mix epoch `epoch` (`gdsload.plan.interleave.MixOrder`, computed where asked);
    its datasets' own epochs are built when reached and shared through `cached_epoch`."""
    from gdsload.plan.interleave import MixOrder
    from gdsload.plan.window import WindowOrder

    def own(i: int, source: MixSource) -> Any:
        own_seed = _source_seed(seed, i)

        def at_epoch(e: int) -> Any:
            args = (source.shard_sizes, own_seed, e, shuffle, window)
            return cached_epoch(("plan", 2, source.sizes_key, *args[1:]), lambda: WindowOrder(*args))

        return at_epoch

    offsets = spec.offsets
    sources = [(own(i, s), s.num_samples, int(offsets[i])) for i, s in enumerate(spec.sources)]
    return MixOrder(spec.units(unit).tolist(), unit, seed, epoch, shuffle, sources)


# What building one epoch's order costs: the peak of `mix_order`'s arrays per sample of the
# epoch (measured with tracemalloc at 1e6 and 4e6 samples: 42 B shuffled, 66 B in order; mix_by
# "batch" the same), and what the finished order keeps (int64 ids).
ORDER_PEAK_BYTES_PER_SAMPLE = 72
ORDER_KEPT_BYTES_PER_SAMPLE = 8
ORDER_CACHE_BYTES = 256 * 1024 * 1024  # orders kept between calls, all mixes together (LRU)


# Order 2 keeps per epoch its block cache and, per dataset, about 40 bytes per shard for each own
# epoch in use (two at an own epoch's end).
ORDER2_SHARD_BYTES = 2 * 40


def order_nbytes(spec: MixSpec, global_batch: int = 1, order: int = 1) -> int:
    """The most memory building one epoch's order of `spec` takes, from the counts alone (nothing
    is built to know it): order 1, its samples times `ORDER_PEAK_BYTES_PER_SAMPLE`; order 2, its
    block cache and its datasets' own orders (O(shards), whatever the epoch's size)."""
    if _order_version(order) == 2:
        from gdsload.plan.interleave import MixOrder

        return MixOrder.nbytes + ORDER2_SHARD_BYTES * len(spec.shard_sizes)
    unit = global_batch if spec.mix_by == "batch" else 1
    return int(spec.counts(unit).sum()) * ORDER_PEAK_BYTES_PER_SAMPLE


def check_order_memory(spec: MixSpec, global_batch: int, limit: int | None, what: str, order: int = 1) -> None:
    """Refuse (`PlanError`) a mix whose epoch order would take more than `limit` bytes to build
    (`what` names the limit); None: no limit known. Only order 1 grows with the epoch."""
    need = order_nbytes(spec, global_batch, order)
    if limit is not None and need > limit:
        unit = global_batch if spec.mix_by == "batch" else 1
        raise PlanError(
            f"one epoch of this mix has {int(spec.counts(unit).sum())} samples, and building its order "
            f"takes up to {need} bytes ({ORDER_PEAK_BYTES_PER_SAMPLE} per sample), over {what} of {limit} "
            f"bytes; lower samples_per_epoch, repeat or samples"
        )


_orders: dict[tuple, np.ndarray] = {}  # the order cache (insertion order = least recent first)
_orders_lock = threading.Lock()


def _cached_mix_order(spec: MixSpec, seed: int, epoch: int, shuffle: bool, window: int,
                      global_batch: int) -> np.ndarray:
    """`mix_order`, kept in a cache of at most `ORDER_CACHE_BYTES` (an order bigger than that is
    not kept); a miss first checks the build's memory against the host's available memory."""
    key = (spec, seed, epoch, shuffle, window, global_batch)
    with _orders_lock:
        order = _orders.pop(key, None)
        if order is not None:
            _orders[key] = order  # most recent now
            return order
    from gdsload.host.memory import available_host_bytes

    check_order_memory(spec, global_batch, available_host_bytes(), "the memory available on this host")
    order = mix_order(spec, seed=seed, epoch=epoch, shuffle=shuffle, window=window,
                      global_batch=global_batch)
    order.setflags(write=False)
    if order.nbytes <= ORDER_CACHE_BYTES:
        with _orders_lock:
            _orders[key] = order
            while sum(o.nbytes for o in _orders.values()) > ORDER_CACHE_BYTES:
                del _orders[next(iter(_orders))]
    return order


# --------------------------------------------------------------------------------------------
# the plan of one rank over a mix


class MixPlanState(PlanState):
    mix: MixState


@dataclass(frozen=True)
class MixPlan(Plan):
    """A `Plan` whose epoch order is `mix_order` of `mix`; `num_samples` is the mix's epoch size
    ``M``. `dataset_id` must be ``mix.mix_id`` and `shard_sizes` ``mix.shard_sizes``."""

    mix: MixSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mix, MixSpec):
            raise PlanError(f"a MixPlan needs a MixSpec, got {type(self.mix).__name__}")
        super().__post_init__()
        if self.shard_sizes != self.mix.shard_sizes or self.dataset_id != self.mix.mix_id:
            raise PlanError("a MixPlan's dataset_id and shard_sizes must be its mix's")
        if self.num_samples == 0:
            raise PlanError(
                "the mix's epoch is empty"
                + (f" (mix_by='batch' apportions whole global batches of {self.global_batch})"
                   if self.mix.mix_by == "batch" else "")
            )

    @property
    def _global_batch_for_order(self) -> int:
        return self.global_batch if self.mix.mix_by == "batch" else 1

    @functools.cached_property
    def num_samples(self) -> int:
        """M, the samples of one epoch of the mix."""
        return int(self.mix.counts(self._global_batch_for_order).sum())

    def _epoch(self, epoch: int) -> Any:
        if self.order == 1:
            return super()._epoch(epoch)  # order 1's whole array, from `_order`
        unit = self._global_batch_for_order
        key = ("mix", 2, self.mix.mix_id, self.seed, epoch, self.shuffle, self.window, unit)
        return cached_epoch(key, lambda: mix_order2(self.mix, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                                                    window=self.window, unit=unit))

    def _order(self, epoch: int) -> np.ndarray:
        if self.order == 1:
            return _cached_mix_order(self.mix, self.seed, epoch, self.shuffle, self.window,
                                     self._global_batch_for_order)
        return self._epoch(epoch).at(np.arange(self.num_samples, dtype=np.int64))

    def source_of(self, ids: np.ndarray) -> np.ndarray:
        """The dataset index of each global id."""
        return np.searchsorted(self.mix.offsets[1:], ids, side="right")

    def state(self, epoch: int, position: int) -> MixPlanState:
        state = super().state(epoch, position)
        return MixPlanState(**state, mix=self.mix.describe())

    def _check_mix(self, state: Mapping[str, Any]) -> None:
        if "mix" not in state:
            raise StateError(
                f"the state is from a single dataset (dataset {state.get('dataset')!r}), this loader "
                f"reads a mix of {[s.name for s in self.mix.sources]}"
            )
        why = self.mix.differences(state["mix"])
        if why is not None:
            raise StateError(f"state field 'mix' does not match: {why}")
