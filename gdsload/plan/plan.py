"""The plan: which samples each rank reads, in which order, and how a run resumes.

This module is a pure function of its inputs (it imports only NumPy and the standard library, does
no I/O and keeps no state that affects results). Everything the loader, the service and a resumed
run need to agree on the order is here.

Order versions
--------------
The order of an epoch is versioned; a `Plan` names its version (``order``), and so does every
state it writes (`PlanState` field ``"order"``; a state without it is of order 1, written before
versions existed). A state is resumed only by a plan of its own order: another is refused naming
both. Every version stays here, so an old checkpoint always resumes (pass ``order=1``).

* Order 1 (rule 3 below, and `gdsload.plan.mix.mix_order`): the whole epoch's order is built in
  memory before its first batch (three sorts of ``N`` keys, 40-72 bytes per sample at the peak,
  8 kept), so its cost grows with the epoch: 10^8 samples take minutes and gigabytes.
* Order 2 (`gdsload.plan.window`, `gdsload.plan.interleave`): the same scheme with its sorts
  replaced by keyed bijections (`gdsload.plan.permute`), so the sample at a position is computed
  from the position: per batch, with memory O(shards + datasets) per epoch, never O(samples); an
  epoch of 10^10 samples plans as fast as one of 10^3. Rules 1-6 hold as stated, 3 with the
  differences `gdsload.plan.window` gives (a window counts at most the non-empty shards and the
  largest shard's samples; empty shards take no place).

`DEFAULT_ORDER` is the loaders' default; a `Plan` not told (like a state not saying) is order 1.

Terms
-----
* A dataset is a tuple of shard sample counts ``shard_sizes``; sample ids are numbered shard-major
  (shard 0 holds ids ``0..n0-1``, shard 1 the next ``n1`` ids, ...). ``N = sum(shard_sizes)``.
* The *epoch order* is a permutation of ``0..N-1`` (`epoch_order`).
* A *position* is an index into the epoch order. Global step ``k`` covers positions
  ``[k*G, (k+1)*G)`` where ``G = batch_size * world_size`` is the global batch.
* A saved *state* (`PlanState`) holds an epoch and the number of positions all ranks together have
  consumed, plus everything the order depends on.

Invariants
----------
1. Determinism: the epoch order depends only on ``(shard_sizes, seed, epoch, shuffle, window)``,
   never on world size, rank, batch size, threads or timing. Randomness comes from PCG64 seeded
   with ``SeedSequence([seed, epoch, 0x706C616E])`` and is consumed only as raw 64-bit words
   (``random_raw``) and turned into permutations by stable sorts, so the order does not change
   with NumPy's `Generator` method implementations either.
2. Unshuffled order is the identity ``0..N-1``.
3. Shuffled order (the exact scheme, with ``w = window``). Let the shard order be a random
   permutation of the shards; the shard at place ``p`` in it is *dealt* over the rounds
   ``p, p+1, ..., p+w-1``: its samples are put in a random order and the ``j``-th one goes to round
   ``p + (j mod w)``. The epoch emits round 0, then round 1, ..., each round's samples in a random
   order. Consequences, which hold for every input (the tests check them):

   a. Open shards: at every position at most ``w`` shards are *open* (have samples both at or
      before and at or after that position). A streaming reader needs at most ``w`` shards at once.
   b. Runs: any ``m`` consecutive positions, ``m = min(shard_sizes)``, draw from at most ``w + 1``
      shards. (A round with all ``w`` shards present has at least ``m`` samples, so such a run
      touches at most two consecutive rounds; the rounds at either end have fewer shards.)
   c. ``window=1`` shuffles within each shard only (shards are emitted one after another, in the
      shuffled shard order). A window of at least the number of shards spreads every shard over
      most of the epoch.
   d. Cost (order 1): three sorts of ``N`` 64-bit keys; about 0.2 s for 1.3 M samples. Order 2:
      O(shards) per epoch, then per batch a few array operations over its positions.

4. Sharding across ranks: in step ``k`` rank ``r`` takes positions ``k*G + r + j*world_size`` for
   ``j = 0..batch_size-1`` (that is ``order[r::world_size]`` cut into batches of ``batch_size``).
   Ranks therefore read disjoint positions, and every rank has the same number of batches.

   * ``drop_last=True``: only positions ``[0, floor(N/G)*G)`` are used. All batches are full and no
     sample is read twice; up to ``G-1`` samples of the epoch are not read.
   * ``drop_last=False`` (as torch's ``DistributedSampler``): the order is extended cyclically from
     its start to ``T = ceil(N/world_size)*world_size`` positions (position ``i`` reads
     ``order[i % N]``), so every sample is read at least once and only the padded positions repeat
     (fewer than ``world_size`` of them). Each rank reads ``T/world_size`` samples; the last batch
     of every rank may hold fewer than ``batch_size``.

   The epoch has ``floor(N/G)`` (drop_last) or ``ceil(N/G)`` steps; ``end_position`` is that number
   times ``G``. Both depend on ``G`` but not on how it splits into ``batch_size * world_size``.
5. Resumption: a state records the epoch and the position (a multiple of ``G``, at most
   ``end_position``; ``end_position`` means the epoch is done). `Plan.resume` accepts it only if the
   dataset, seed, shuffle, window, drop_last, number of samples and global batch are those of the
   plan; the world size may differ (elastic resume). Since positions index the global order, the
   positions read before and after a resume are complementary: with ``drop_last=True`` the epoch is
   read exactly once in total; with ``drop_last=False`` every sample is read at least once (only
   the padding, whose size depends on the world size, can differ).
6. Mixing (`gdsload.plan.mix`, `gdsload.Mix`): a weighted mix of datasets is a plan over the
   datasets' shards one after another whose epoch order is `gdsload.plan.mix.mix_order` instead of
   `epoch_order`: each dataset contributes its weight's share of an epoch (default size: the sum
   of the datasets; or ``samples_per_epoch``; or fixed per dataset with ``repeat``/``samples``),
   drawn from its own epochs (no repeat within one; its own shuffle) and interleaved per sample
   or per global batch (``mix_by``). Still a pure function of (datasets, weights, seed, epoch);
   rules 4 and 5 apply unchanged to the epoch size ``M``, and a state also records the mix, so a
   state from another mix is refused naming the difference (and a mix state is refused here).
"""

from __future__ import annotations

import functools
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import numpy as np

from gdsload.errors import PlanError, StateError  # noqa: F401 (re-exported: defined in errors.py)

__all__ = [
    "BlockSteps",
    "DEFAULT_ORDER",
    "ORDERS",
    "STATE_VERSION",
    "Plan",
    "PlanBatches",
    "PlanError",
    "PlanState",
    "StateError",
    "epoch_order",
]

STATE_VERSION = 1
"""Version of the `PlanState` layout; a state of another version is refused."""

ORDERS = (1, 2)
"""The order versions this module plans (module docstring, "Order versions")."""

DEFAULT_ORDER = 2
"""The order a `DataLoader` and a `RemoteLoader` plan when not told (the same, so that both give
the same batches; a `RemoteLoader`'s requests name it, and a server older than order versions
refuses order 2 rather than serve order 1: `gdsload.service.protocol.request`). States saved before
order versions (no "order" field: order 1) resume with ``order=1``, as the refusal says."""

_DOMAIN = 0x706C616E  # "plan": keeps this stream apart from other users of the same seed


class PlanState(TypedDict):
    """The JSON-serialisable loader state: where a run is, and what its order depends on
    (``order``: the order version; absent in states written before versions: order 1)."""

    version: int
    order: NotRequired[int]  # (`_OPTIONAL_FIELDS`: NotRequired is not seen under postponed annotations)
    dataset: str
    seed: int
    shuffle: bool
    window: int
    drop_last: bool
    epoch: int
    position: int
    global_batch: int
    num_samples: int


_OPTIONAL_FIELDS = ("order",)  # the `PlanState` fields a state may lack


# --------------------------------------------------------------------------------------------
# validation helpers


def _int(name: str, value: Any, *, minimum: int, error: type[PlanError] = PlanError) -> int:
    """`value` as an int >= minimum (NumPy integers accepted; bools and floats refused)."""
    if isinstance(value, bool):
        raise error(f"{name} must be an integer >= {minimum}, got the bool {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise error(
            f"{name} must be an integer >= {minimum}, got {value!r} ({type(value).__name__})"
        ) from None
    if result < minimum:
        raise error(f"{name} must be an integer >= {minimum}, got {result}")
    return result


def _bool(name: str, value: Any, *, error: type[PlanError] = PlanError) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise error(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _order_version(value: Any, *, name: str = "order", error: type[PlanError] = PlanError) -> int:
    """`value` as an order version (one of `ORDERS`)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) not in ORDERS:
        raise error(f"{name} must be one of the order versions {' or '.join(map(str, ORDERS))}, got {value!r}")
    return int(value)


def _shard_sizes(value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise PlanError(
            "shard_sizes must be a sequence of sample counts (ints >= 0), "
            f"got {type(value).__name__}"
        )
    return tuple(_int(f"shard_sizes[{i}]", n, minimum=0) for i, n in enumerate(value))


def _shorten(a: str, b: str, limit: int = 16) -> tuple[str, str]:
    """`a` and `b` (e.g. long hashes) cut to a readable length that still tells them apart."""
    differ = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    keep = max(limit, differ + 4)
    saved, current = (repr(t if len(t) <= keep else t[:keep] + "…") for t in (a, b))
    return saved, current


# --------------------------------------------------------------------------------------------
# the epoch order


def _sort_by_group(group: np.ndarray, key_source: np.random.PCG64) -> np.ndarray:
    """A permutation sorting by `group` (ints >= 0), random order within each group.

    The group goes into the high ``k`` bits of one uint64 key (``k`` = bit length of the largest
    group) and the top ``64-k`` bits of a raw PCG64 word into the rest (at least 40 random bits
    for fewer than 2**24 groups); rare ties are broken by a stable sort, so the result is
    deterministic. One sort of packed keys is several times faster than `np.lexsort`.
    """
    n = group.shape[0]
    top = int(group.max()) if n else 0
    bits = max(top.bit_length(), 1)
    random = key_source.random_raw(n)
    key = (group.astype(np.uint64) << np.uint64(64 - bits)) | (random >> np.uint64(bits))
    return np.argsort(key, kind="stable")


def _compute_order(
    sizes: tuple[int, ...], seed: int, epoch: int, shuffle: bool, window: int
) -> np.ndarray:
    total = sum(sizes)
    if not shuffle or total == 0:
        return np.arange(total, dtype=np.int64)
    bits = np.random.PCG64(np.random.SeedSequence([seed, epoch, _DOMAIN]))
    counts = np.asarray(sizes, dtype=np.int64)
    first_id = np.concatenate(([0], np.cumsum(counts)[:-1]))

    # 1. shard order: a random permutation of the shards
    shard_perm = _sort_by_group(np.zeros(len(sizes), dtype=np.int64), bits)
    placed_counts = counts[shard_perm]
    placed_start = np.concatenate(([0], np.cumsum(placed_counts)[:-1]))
    place = np.repeat(np.arange(len(sizes), dtype=np.int64), placed_counts)
    # the stream: shards one after another in the shuffled shard order
    stream = np.arange(total, dtype=np.int64) + np.repeat(
        first_id[shard_perm] - placed_start, placed_counts
    )

    # 2. a random order within each shard; the j-th sample of the shard at place p -> round p+j%w
    stream = stream[_sort_by_group(place, bits)]
    rank_in_shard = np.arange(total, dtype=np.int64) - np.repeat(placed_start, placed_counts)
    rounds = place + rank_in_shard % window

    # 3. emit the rounds in order, each in a random order
    return stream[_sort_by_group(rounds, bits)]


def epoch_order(
    shard_sizes: Sequence[int],
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    window: int = 4,
    order: int = 1,
) -> np.ndarray:
    """The global sample ids of one epoch, in order (a new int64 array, a permutation of 0..N-1).

    Unshuffled: ``0..N-1``. Shuffled: shard order permuted and samples mixed within a sliding
    window of `window` shards, as described in the module docstring, in order version `order`.
    Depends only on the arguments. (The whole epoch: O(N) memory in either version; a plan reads
    order 2 per batch instead.)
    """
    sizes = _shard_sizes(shard_sizes)
    args = (sizes, _int("seed", seed, minimum=0), _int("epoch", epoch, minimum=0), _bool("shuffle", shuffle),
            _int("window", window, minimum=1))
    if _order_version(order) == 1:
        return _compute_order(*args)
    from gdsload.plan.window import WindowOrder

    return WindowOrder(*args).at(np.arange(sum(sizes), dtype=np.int64))


@functools.lru_cache(maxsize=4)
def _cached_order(
    sizes: tuple[int, ...], seed: int, epoch: int, shuffle: bool, window: int
) -> np.ndarray:
    order = _compute_order(sizes, seed, epoch, shuffle, window)
    order.setflags(write=False)
    return order


class _Materialised:
    """An order-1 epoch order (a whole array) behind the interface order 2's objects have."""

    def __init__(self, order: np.ndarray):
        self.order = order

    def at(self, positions: np.ndarray) -> np.ndarray:
        return self.order[positions]


# Order-2 epoch objects (O(shards) each), shared by plans of the same dataset and order options:
# the ranks, the server's streams and the batches of one epoch look them up per batch.
_EPOCHS: OrderedDict[tuple, Any] = OrderedDict()
_EPOCHS_LOCK = threading.Lock()
_EPOCHS_KEPT = 16
_EPOCHS_BYTES = 64 * 1024 * 1024  # kept together at most (the newest is kept whatever its size)


def cached_epoch(key: tuple, build: Callable[[], Any]) -> Any:
    """The epoch object of `key`, built by `build()` on a miss; least recently used evicted."""
    with _EPOCHS_LOCK:
        hit = _EPOCHS.get(key)
        if hit is not None:
            _EPOCHS.move_to_end(key)
            return hit
    made = build()
    with _EPOCHS_LOCK:
        made = _EPOCHS.setdefault(key, made)
        _EPOCHS.move_to_end(key)
        while len(_EPOCHS) > 1 and (len(_EPOCHS) > _EPOCHS_KEPT
                                    or sum(o.nbytes for o in _EPOCHS.values()) > _EPOCHS_BYTES):
            _EPOCHS.popitem(last=False)
    return made


# --------------------------------------------------------------------------------------------
# the plan of one rank


@dataclass(frozen=True)
class Plan:
    """What one rank reads: the epoch order (`epoch_order`) sliced across ranks into batches.

    `dataset_id` names the dataset (the loader passes a hash of the manifest's shard hashes); it
    is stored in states so that a state is never applied to another dataset. `batch_size` is per
    rank; the global batch is ``batch_size * world_size``. `earlier`: `(dataset_id, num_samples)`
    of the versions this dataset was appended to, so that a state saved on one of them is refused
    as such ("the dataset has changed: N samples appended").
    """

    dataset_id: str
    shard_sizes: tuple[int, ...]
    batch_size: int
    world_size: int = 1
    rank: int = 0
    seed: int = 0
    shuffle: bool = False
    window: int = 4
    drop_last: bool = False
    earlier: tuple[tuple[str, int], ...] = ()
    order: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dataset_id, str) or not self.dataset_id:
            raise PlanError(f"dataset_id must be a non-empty string, got {self.dataset_id!r}")
        sizes = _shard_sizes(self.shard_sizes)
        if not sizes or sum(sizes) == 0:
            raise PlanError(
                f"the dataset has no samples ({len(sizes)} shards, all empty); "
                "a plan needs at least one sample"
            )
        object.__setattr__(self, "shard_sizes", sizes)
        object.__setattr__(self, "batch_size", _int("batch_size", self.batch_size, minimum=1))
        world = _int("world_size", self.world_size, minimum=1)
        object.__setattr__(self, "world_size", world)
        if isinstance(self.rank, bool):
            raise PlanError(f"rank must be an integer in 0..{world - 1}, got {self.rank!r}")
        try:
            rank = operator.index(self.rank)
        except TypeError:
            raise PlanError(
                f"rank must be an integer in 0..{world - 1}, got {self.rank!r}"
            ) from None
        if not 0 <= rank < world:
            raise PlanError(
                f"rank {rank} is out of range: with world_size {world} the valid ranks are "
                f"0..{world - 1}"
            )
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "seed", _int("seed", self.seed, minimum=0))
        object.__setattr__(self, "shuffle", _bool("shuffle", self.shuffle))
        object.__setattr__(self, "window", _int("window", self.window, minimum=1))
        object.__setattr__(self, "drop_last", _bool("drop_last", self.drop_last))
        object.__setattr__(self, "order", _order_version(self.order))

    # ---- sizes ------------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """N, the number of samples in the dataset."""
        return sum(self.shard_sizes)

    @property
    def global_batch(self) -> int:
        """G = batch_size * world_size: the positions one global step covers."""
        return self.batch_size * self.world_size

    @property
    def num_steps(self) -> int:
        """Global steps per epoch: floor(N/G) with drop_last, else ceil(N/G)."""
        n, g = self.num_samples, self.global_batch
        return n // g if self.drop_last else -(-n // g)

    @property
    def end_position(self) -> int:
        """The position after the last step of an epoch (num_steps * G); a state there is done."""
        return self.num_steps * self.global_batch

    def _used_positions(self) -> int:
        """Positions of the (padded) order that ranks read: floor(N/G)*G or ceil(N/W)*W."""
        n, w = self.num_samples, self.world_size
        return self.end_position if self.drop_last else -(-n // w) * w

    def num_batches(self, epoch: int = 0) -> int:
        """Batches this rank reads per epoch (the same for every rank and every epoch)."""
        _int("epoch", epoch, minimum=0)
        return self.num_steps

    def __len__(self) -> int:
        return self.num_steps

    # ---- order ------------------------------------------------------------------------------

    @functools.cached_property
    def _sizes_key(self) -> str:
        from gdsload.plan.window import sizes_key

        return sizes_key(self.shard_sizes)

    def _epoch(self, epoch: int) -> Any:
        """The order of `epoch` as an object whose ``at(positions)`` gives the ids there: order 1's
        whole array (built once per epoch, cached), or order 2's on-demand order."""
        if self.order == 1:
            return _Materialised(self._order(epoch))
        from gdsload.plan.window import WindowOrder

        args = (self.shard_sizes, self.seed, epoch, self.shuffle, self.window)
        return cached_epoch(("plan", 2, self._sizes_key, *args[1:]), lambda: WindowOrder(*args))

    def _order(self, epoch: int) -> np.ndarray:
        """The whole epoch's order (an array of N ids; order 2 builds it: O(N), for checks)."""
        if self.order == 1:
            return _cached_order(self.shard_sizes, self.seed, epoch, self.shuffle, self.window)
        return self._epoch(epoch).at(np.arange(self.num_samples, dtype=np.int64))

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """The global ids this rank reads in `epoch`, in order (a new int64 array of about N/W ids:
        the whole epoch's share of this rank; `batch` and `batches` compute one batch at a time)."""
        epoch = _int("epoch", epoch, minimum=0)
        positions = np.arange(self.rank, self._used_positions(), self.world_size, dtype=np.int64)
        if not self.drop_last:
            positions %= self.num_samples  # the padding repeats the order from its start
        return self._epoch(epoch).at(positions)

    def _check_position(self, position: Any, *, error: type[PlanError], name: str) -> int:
        position = _int(name, position, minimum=0, error=error)
        g, end = self.global_batch, self.end_position
        if position % g:
            raise error(
                f"{name} = {position} is not a multiple of the global batch {g} "
                f"(batch_size {self.batch_size} x world_size {self.world_size})"
            )
        if position > end:
            raise error(
                f"{name} = {position} is beyond the epoch: valid positions are multiples of {g} "
                f"in 0..{end}"
            )
        return position

    def batches(self, epoch: int, start_position: int = 0) -> Iterator[np.ndarray]:
        """This rank's batches of `epoch` (int64 arrays of global ids), from `start_position`,
        each computed when the iterator reaches it.

        `start_position` counts the order positions all ranks together have consumed: a multiple
        of the global batch, at most `end_position` (which yields nothing).
        """
        epoch = _int("epoch", epoch, minimum=0)
        start = self._check_position(start_position, error=PlanError, name="start_position")
        return self._batches(epoch, start // self.global_batch)

    def _batches(self, epoch: int, first_step: int) -> Iterator[np.ndarray]:
        lazy = PlanBatches(self, epoch, range(first_step, self.num_steps))
        for i in range(len(lazy)):
            yield lazy[i]

    def batch(self, epoch: int, step: int) -> np.ndarray:
        """This rank's batch of global step `step` of `epoch` (``0 <= step < num_steps``)."""
        epoch = _int("epoch", epoch, minimum=0)
        step = self._check_step(step)
        return self._batch(self._epoch(epoch), step)

    def batches_at(self, epoch: int, steps: Sequence[int]) -> PlanBatches:
        """This rank's batches of the global steps `steps` of `epoch`, in that order, as a
        sequence computed per item when asked (a range of steps, or a server's strided blocks)."""
        return PlanBatches(self, _int("epoch", epoch, minimum=0), steps)

    def _check_step(self, step: Any) -> int:
        step = _int("step", step, minimum=0)
        if step >= self.num_steps:
            raise PlanError(f"step {step} is beyond the epoch: it has {self.num_steps} steps (0..{self.num_steps - 1})")
        return step

    def _batch(self, order: Any, step: int) -> np.ndarray:
        return self._steps(order, [step])[0]

    def _steps(self, order: Any, steps: Sequence[int]) -> list[np.ndarray]:
        """This rank's batches of `steps`, from one evaluation of the order over all their
        positions (rule 4: in step k rank r reads positions k*G + r + j*W below the used ones)."""
        w, used, b = self.world_size, self._used_positions(), self.batch_size
        first = np.asarray(steps, np.int64) * self.global_batch + self.rank
        count = np.minimum(b, np.maximum(0, -(-(used - first) // w)))
        width = int(count.max(initial=0))  # (not `b`: a batch_size over the epoch's samples costs nothing)
        positions = first[:, None] + w * np.arange(width, dtype=np.int64)[None, :]  # [steps, batch]
        full = width == b and bool((count == b).all())
        if not full:
            positions = positions[np.arange(width)[None, :] < count[:, None]]  # (row-major: step by step)
        if not self.drop_last:
            positions %= self.num_samples  # the padding repeats the order from its start
        ids = order.at(positions.reshape(-1))
        if full:
            return list(ids.reshape(len(first), b))
        ends = np.cumsum(count).tolist()
        return [ids[a:e] for a, e in zip([0, *ends[:-1]], ends)]

    # ---- state ------------------------------------------------------------------------------

    def state(self, epoch: int, position: int) -> PlanState:
        """The state of a run that has consumed `position` order positions of `epoch`."""
        epoch = _int("epoch", epoch, minimum=0)
        position = self._check_position(position, error=PlanError, name="position")
        return PlanState(
            version=STATE_VERSION,
            order=self.order,
            dataset=self.dataset_id,
            seed=self.seed,
            shuffle=self.shuffle,
            window=self.window,
            drop_last=self.drop_last,
            epoch=epoch,
            position=position,
            global_batch=self.global_batch,
            num_samples=self.num_samples,
        )

    def resume(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """``(epoch, position)`` of a saved `state`, after checking it belongs to this plan.

        The world size may differ from the one that saved the state; the global batch may not.
        Raises `StateError` naming the field for a malformed or incompatible state. Keys that a
        state does not define are ignored.
        """
        if not isinstance(state, Mapping):
            raise StateError(
                f"a loader state must be a mapping (a dict), got {type(state).__name__}"
            )
        missing = [k for k in PlanState.__annotations__ if k not in _OPTIONAL_FIELDS and k not in state]
        if missing:
            raise StateError(
                "the state is missing the field(s) " + ", ".join(repr(k) for k in missing)
                + f"; a state has the fields {', '.join(PlanState.__annotations__)}"
            )
        self._check_mix(state)
        version = _int("state field 'version'", state["version"], minimum=0, error=StateError)
        if version != STATE_VERSION:
            raise StateError(
                f"state field 'version' is {version}; this gdsload reads state version "
                f"{STATE_VERSION}"
            )
        self._check_order(state)
        dataset = state["dataset"]
        if not isinstance(dataset, str):
            raise StateError(
                f"state field 'dataset' must be a string, got {dataset!r} "
                f"({type(dataset).__name__})"
            )
        appended_to = dict(self.earlier).get(dataset)
        if appended_to is not None:
            raise StateError(
                f"the dataset has changed: {self.num_samples - appended_to} samples appended since "
                f"this state was saved (it is from the version with {appended_to} samples, id "
                f"{dataset!r}); the order of an epoch depends on every sample, so start a new "
                f"epoch from a fresh state, or finish this one on the old version: "
                f"gdsload.Dataset(path, version=K), or RemoteLoader(..., version=K) over the feed "
                f"(`gdsload inspect` lists the versions)"
            )
        if dataset != self.dataset_id:
            saved_id, current_id = _shorten(dataset, self.dataset_id)
            raise StateError(
                f"state field 'dataset' does not match: the state is from dataset {saved_id}, "
                f"this loader reads {current_id}"
            )
        current: dict[str, Any] = {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "window": self.window,
            "drop_last": self.drop_last,
        }
        for field, now in current.items():
            if isinstance(now, bool):
                saved: Any = _bool(f"state field {field!r}", state[field], error=StateError)
            else:
                saved = _int(f"state field {field!r}", state[field], minimum=0, error=StateError)
            if saved != now:
                raise StateError(
                    f"state field {field!r} does not match: the state was saved with "
                    f"{field} {saved!r}, this loader has {field} {now!r}"
                )
        saved_g = _int(
            "state field 'global_batch'", state["global_batch"], minimum=1, error=StateError
        )
        if saved_g != self.global_batch:
            raise StateError(
                f"state field 'global_batch' does not match: the state was saved with global "
                f"batch {saved_g}, this loader has {self.global_batch} (batch_size "
                f"{self.batch_size} x world_size {self.world_size}); a resume may change the world "
                f"size but must keep batch_size x world_size the same"
            )
        epoch = _int("state field 'epoch'", state["epoch"], minimum=0, error=StateError)
        position = self._check_position(
            state["position"], error=StateError, name="state field 'position'"
        )
        return epoch, position

    def _check_order(self, state: Mapping[str, Any]) -> None:
        """Refuse a state of another order version, naming both (absent: order 1)."""
        if "order" not in state:
            saved, how = 1, "the state has no 'order' field (it was saved before order versions): it is of order 1"
        else:
            saved = _order_version(state["order"], name="state field 'order'", error=StateError)
            how = f"the state is of order {saved}"
        if saved != self.order:
            raise StateError(
                f"state field 'order' does not match: {how}, this loader plans order {self.order}; "
                f"resume it with a loader of order={saved} (every order version stays readable) or "
                f"start a new epoch from a fresh state"
            )

    def _check_mix(self, state: Mapping[str, Any]) -> None:
        """Refuse a state of a mix (`gdsload.plan.mix.MixPlan` checks the mix instead)."""
        if "mix" in state:
            mix = state["mix"] if isinstance(state["mix"], Mapping) else {}
            names = [d.get("name") for d in mix.get("datasets", ()) if isinstance(d, Mapping)]
            raise StateError(
                f"the state is from a mix of datasets {names}, this loader reads one dataset "
                f"({self.dataset_id!r}); resume it with the same gdsload.Mix"
            )


class PlanBatches(Sequence[np.ndarray]):
    """A plan's batches for given global steps of one epoch, computed when indexed, a chunk of
    about `CHUNK_POSITIONS` positions at a time (order 2's array operations cost about as much for
    one batch as for 30: a chunk makes them per sample), of which the last `CHUNKS_KEPT` are kept
    (a pass over 10^8 batches holds a few dozen of them). Safe to index from several threads.

    The first item is a chunk of its own: the first batch of a pass waits for its own positions
    only, not for a chunk's (issue 55: 128 batches' at batch 64). A chunk is computed once: a
    thread asking for one that another is computing waits for it (two readers starting a pass
    both computed the first chunk before)."""

    CHUNK_POSITIONS = 8192
    CHUNKS_KEPT = 4

    def __init__(self, plan: Plan, epoch: int, steps: Sequence[int]):
        if isinstance(steps, (range, BlockSteps)):  # increasing by construction: its ends suffice
            if len(steps):
                plan._check_step(steps[0])
                plan._check_step(steps[-1])
        else:
            steps = [plan._check_step(s) for s in steps]
        self.plan, self.epoch, self.steps = plan, epoch, steps
        self._order = plan._epoch(epoch)
        self._per_chunk = max(1, self.CHUNK_POSITIONS // plan.batch_size)
        self._chunks: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._pending: dict[int, threading.Event] = {}  # chunks being computed, by another thread
        self._lock = threading.Lock()
        self.computed = 0  # chunks computed (a chunk evicted and asked again counts again)

    def __len__(self) -> int:
        return len(self.steps)

    def _chunk(self, i: int) -> tuple[int, int, int]:
        """Item `i`'s chunk: (number, first item, position of `i` in it); item 0 is chunk 0 alone."""
        if i == 0:
            return 0, 0, 0
        c, k = divmod(i - 1, self._per_chunk)
        return c + 1, 1 + c * self._per_chunk, k

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self.steps))[i]  # negative indices; IndexError past the end
        c, lo, k = self._chunk(i)
        while True:
            with self._lock:
                chunk = self._chunks.get(c)
                if chunk is not None:
                    return chunk[k]
                busy = self._pending.get(c)
                if busy is None:
                    self._pending[c] = done = threading.Event()
                    break
            busy.wait()  # computed by another thread (or failed there: asked again here)
        try:
            chunk = self.plan._steps(self._order, self.steps[lo:1 if c == 0 else lo + self._per_chunk])
            with self._lock:
                self.computed += 1
                self._chunks[c] = chunk
                while len(self._chunks) > self.CHUNKS_KEPT:
                    self._chunks.popitem(last=False)
        finally:
            with self._lock:
                del self._pending[c]
            done.set()
        return chunk[k]


class BlockSteps(Sequence[int]):
    """The steps of every `stride`-th block of `block` steps, from step `first` (the rest of its
    block, then blocks ``b + stride``, ``b + 2*stride``, ... of ``b = first // block``) below
    `num_steps`, at most `limit` of them (0: no limit): a feed server's stream of a striped epoch
    (`BatchRequest.block_stride`). Increasing; O(1) memory, length and indexing, so a stream over
    an epoch of 10^8 steps lists none of them."""

    def __init__(self, first: int, num_steps: int, block: int, stride: int, limit: int = 0):
        first, num_steps = _int("first", first, minimum=0), _int("num_steps", num_steps, minimum=0)
        self.block, self.stride = _int("block", block, minimum=1), _int("stride", stride, minimum=1)
        self.first, b = first, first // self.block
        self.head = max(0, min((b + 1) * self.block, num_steps) - first)  # the rest of the first block
        self.base = b
        blocks = -(-num_steps // self.block)  # blocks holding steps (the last may be short)
        later = max(0, (blocks - 1 - b) // self.stride) if first < num_steps else 0
        n = self.head + later * self.block
        if later and b + later * self.stride == blocks - 1:  # the epoch's last, short block
            n -= blocks * self.block - num_steps
        self.length = min(n, _int("limit", limit, minimum=0)) if limit else n

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.length))]
        i = range(self.length)[i]  # negative indices; IndexError past the end
        if i < self.head:
            return self.first + i
        k, offset = divmod(i - self.head, self.block)
        return (self.base + (k + 1) * self.stride) * self.block + offset

    def __repr__(self) -> str:
        return f"BlockSteps({len(self)} steps from {self[0] if self.length else None}, block {self.block}, " \
               f"stride {self.stride})"
