"""Where a stream's loader comes from: `Loaders.open(req)`, and its reuse, `LoaderPool`.

`Loaders.open(req)` checks the request against the server's limits, opens its dataset (or `Mix`)
from the catalog, takes a parked loader of the same request from the pool or builds a new
`gdsload.DataLoader` (CPU, NumPy output, no copies; it allocates nothing until iterated), reserves
what it may hold (`estimate.stream_bytes`, against the `Budget`) and positions it at the request's
start with `load_state_dict`. The result, an `Opened`, is what a `sources.LoaderSource` iterates.

`LoaderPool` is the server's one reuse mechanism. A loader whose stream ended well or was
cancelled (a striping client's hedged copy, a consumer that left; a share group's producer that
has made its last step or lost its last subscriber) is as usable as a `for` loop left with
`break`: it is parked under its request's identity (`protocol.request.identity_key`: the request
without its position, epoch, stream limits and transport, plus the served dataset's id) with its
memory reservation, for at most `idle_s` (10 s), at most `keep` of them (8, oldest closed first).
The next stream of the same request, a striping client's next block, a share group's next epoch or
next producer, takes it (`take`) and pays for no new loader, ring or DALI pipeline (a slow server
that built a loader per block could become too slow ever to deliver a batch before being overtaken
again). Parked loaders give way to anything new: the budget asks `evict(need)` to close the oldest
until `need` fits. Parked loaders are not open streams (`ServerInfo.memory_in_use_bytes` leaves
them out).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gdsload.service.protocol import mixwire, request
from gdsload.service.protocol.config import MIN_CHUNK_BYTES, Limits
from gdsload.service.protocol.status import BadRequest, DatasetChanged, OverLimit
from gdsload.service.server import estimate
from gdsload.service.server.admission import Budget, Reservation, stream_claim
from gdsload.v1 import feed_pb2 as pb

#: How long a parked loader waits for the next stream of its request before it is closed.
WARM_S = 10.0
#: Plans whose planned ids a server keeps (`PlannedIds`), the most recently used (as parked loaders).
PLANS_KEPT = 8


class Loaded:
    """One loader of the server as the pool keeps it: the `DataLoader` and, when it decodes images
    through the server's decode pool, its seat there (`pool.PooledDecoder`)."""

    __slots__ = ("loader", "seat")

    def __init__(self, loader: Any, seat: Any = None):
        self.loader = loader
        self.seat = seat

    def close(self) -> None:
        if self.seat is not None:
            self.seat.detach()
        self.loader.close()


class LoaderPool:
    """Parked loaders by key (the module docstring): `take`, `park`, `evict`, `close`."""

    def __init__(self, budget: Budget, *, keep: int = 8, idle_s: float = WARM_S):
        self.budget = budget
        self.keep = keep
        self.idle_s = idle_s
        self.hits = 0  # streams that took a parked loader
        self._lock = threading.Lock()
        self._parked: list[tuple[Any, Loaded, Reservation, float]] = []  # (key, loaded, reservation, since)
        self._closed = False

    def take(self, key: Any) -> tuple[Loaded, Reservation] | None:
        """The newest loader parked under `key`, with the reservation it holds (the caller does not
        reserve again), or None."""
        self._close_out(self._pick(stale=True))
        with self._lock:
            for i in range(len(self._parked) - 1, -1, -1):
                if self._parked[i][0] == key:
                    self.hits += 1
                    _, loaded, reservation, _ = self._parked.pop(i)
                    return loaded, reservation
        return None

    def has(self, key: Any) -> bool:
        """Whether a loader of `key` is parked now."""
        with self._lock:
            return any(k == key for k, _, _, _ in self._parked)

    def park(self, key: Any, loaded: Loaded, reservation: Reservation) -> bool:
        """Keep `loaded` (its iterator closed: its readers stopped) for the next stream of `key`;
        closed at once instead (False) when the pool keeps none, is closed, or the server drains."""
        with self._lock:
            kept = self.keep > 0 and not self._closed and not self.budget.draining.is_set()
            if kept:
                self._parked.append((key, loaded, reservation, time.monotonic()))
        if not kept:
            self._close_out([(loaded, reservation)])
            return False
        self._close_out(self._pick(stale=True, keep=self.keep))
        return True

    def evict(self, need: int = 0) -> int:
        """Close parked loaders, oldest first, until `need` more bytes fit in the budget (the
        budget's room maker); returns how many were closed."""
        out = self._pick(need=need)
        self._close_out(out)
        return len(out)

    def parked_nbytes(self) -> int:
        """Bytes the parked loaders hold reserved."""
        with self._lock:
            return sum(r.nbytes for _, _, r, _ in self._parked)

    def close(self) -> None:
        """Close every parked loader; later ones are closed as they come (at shutdown)."""
        with self._lock:
            self._closed = True
        self._close_out(self._pick(keep=0))

    def __len__(self) -> int:
        return len(self._parked)

    def _pick(self, *, stale: bool = False, keep: int | None = None, need: int = 0) -> list:
        """Take out the parked loaders to close: stale ones, those beyond `keep`, and the oldest
        while `need` does not fit."""
        out = []
        with self._lock:
            now = time.monotonic()
            while self._parked and ((stale and now - self._parked[0][3] > self.idle_s)
                                    or (keep is not None and len(self._parked) > keep)
                                    or (need and self.budget.reserved + need > self.budget.limit)):
                _, loaded, reservation, _ = self._parked.pop(0)
                out.append((loaded, reservation))
                if need:
                    reservation.release()  # counted at once, so the loop sees the room
        return out

    @staticmethod
    def _close_out(out: list) -> None:
        for loaded, reservation in out:  # outside the lock: closing joins threads
            loaded.close()
            reservation.release()


@dataclass(frozen=True)
class Settings:
    """The server's loader settings, per stream (not the client's to choose)."""

    workers: int = 2
    prefetch: int = 2
    decode_threads: int = 2


@dataclass
class Opened:
    """A loader positioned at a request's start and what its stream needs to send its batches:
    its ids per batch (`planned`, from the start), its steps (a `block_stride` stream) or None."""

    loaded: Loaded
    reservation: Reservation
    key: Any
    label: str  # the dataset's name, or a mix's label
    payload: str  # "raw" | "decoded"
    planned: Any
    steps: Any  # a `BlockSteps` (a `block_stride` stream) or None
    chunk: int
    reused: bool

    @property
    def loader(self) -> Any:
        return self.loaded.loader


class Loaders:
    """`open(req) -> Opened` (the module docstring)."""

    def __init__(self, catalog: Any, limits: Limits, budget: Budget, pool: LoaderPool, settings: Settings,
                 decode_pool: Any = None):
        self.catalog = catalog
        self.limits = limits
        self.budget = budget
        self.pool = pool
        self.settings = settings
        self.decode_pool = decode_pool  # pool.DecodePool, or None: a DALI pipeline per loader
        self.claim = stream_claim(settings.prefetch + 1)
        self._plans: OrderedDict[Any, PlannedIds] = OrderedDict()  # by pool key, the newest last
        self._plans_lock = threading.Lock()

    def planned(self, key: Any) -> PlannedIds:
        """The planned ids of the streams of `key` (the pool's key: one plan), for every loader of
        it (a stripe's strided stream and its steals and hedges have a loader each)."""
        with self._plans_lock:
            got = self._plans.get(key)
            if got is None:
                got = self._plans[key] = PlannedIds()
                while len(self._plans) > PLANS_KEPT:
                    self._plans.popitem(last=False)
            self._plans.move_to_end(key)
            return got

    def check(self, req: pb.BatchRequest) -> Any:
        """The request's loader options, checked against the limits and the combination rules."""
        L = self.limits
        opts = request.to_options(req, max_image_side=L.max_image_side)
        if req.batch_size > L.max_batch_size:
            raise OverLimit(f"batch_size {req.batch_size} is over the server's limit of "
                            f"{L.max_batch_size} samples per batch")
        request.check_combination(req)
        if req.max_chunk_bytes and req.max_chunk_bytes < MIN_CHUNK_BYTES:
            raise BadRequest(f"max_chunk_bytes must be 0 (server default) or >= {MIN_CHUNK_BYTES}, "
                             f"got {req.max_chunk_bytes}")
        return opts

    def open(self, req: pb.BatchRequest, opts: Any = None) -> Opened:
        """Validate `req` (unless `opts`, its options, say it was), take or build its loader,
        reserve its memory, position it at the start. What this reserved is released, and the
        loader closed, if anything fails."""
        opts = opts if opts is not None else self.check(req)
        payload = "decoded" if opts.decode else "raw"
        dataset, transform, order, order_memory = self._dataset(req, opts, payload)
        key = (dataset.dataset_id, request.identity_key(req))  # (the key holds dataset_id's order tag)
        got = self.pool.take(key)
        loaded, reservation = got if got is not None else (self._build(dataset, opts, transform, req, order), None)
        try:
            if reservation is None:  # (a parked loader's reservation is the same figure: same request)
                memory = estimate.stream_bytes(loaded.loader.batch_layout(), prefetch=self.settings.prefetch,
                                               limits=self.limits, dataset=req.dataset) + order_memory
                reservation = self.budget.reserve(memory, self.claim)
            with reservation:
                planned, steps = _position(loaded.loader, req, self.planned(key))
                return Opened(loaded, reservation.hand_over(), key, req.dataset, payload, planned, steps,
                              estimate.chunk_bytes(req, self.limits), got is not None)
        except BaseException:
            loaded.close()
            raise

    def _dataset(self, req: pb.BatchRequest, opts: Any, payload: str) -> tuple[Any, Any, int, int]:
        """(the dataset or mix, the loader's transform, the order version, the mix order's bytes)
        of `req` (the version is named in `dataset_id`: `request.split_order`)."""
        ident, order = request.split_order(req.dataset_id)
        if req.HasField("mix"):  # a gdsload.Mix of served datasets; req.dataset becomes its label
            dataset = mixwire.open_mix(self.catalog, req)
        else:
            dataset = self.catalog.dataset(req.dataset, list(req.fields), ident)
        if ident and ident != dataset.dataset_id:
            raise DatasetChanged(
                f"dataset {req.dataset!r} on this server has id {dataset.dataset_id}, the client "
                f"planned with {request.cut(ident)} (BatchRequest.dataset_id): the dataset was "
                f"rewritten; start from a fresh state"
            )
        kinds = {f: dataset.shards.fields.get(f, "") for f in dataset.fields}
        images = [f for f in dataset.fields if kinds[f] == "image"]
        if payload == "decoded" and len(images) > 1:
            raise BadRequest(
                f"dataset {req.dataset!r} has the image fields {images} and PAYLOAD_DECODED "
                f"decodes one: name it (and the other fields wanted) in BatchRequest.fields, "
                f"or send PAYLOAD_RAW for the encoded bytes"
            )
        transform = opts.transform
        if req.media:  # video/audio decoded here (issue 30): gdsload.service.protocol.mediawire
            if payload != "decoded":
                raise BadRequest("BatchRequest.media is set but payload is PAYLOAD_RAW: send PAYLOAD_DECODED")
            from gdsload.service.protocol import mediawire

            media = mediawire.from_specs(req.media, kinds)
            if media:
                transform = {**media, **({images[0]: transform} if images and transform is not None else {})}
        # building a mix's epoch order takes memory too (gdsload.plan.mix); refused before anything is built
        memory = estimate.order_bytes(dataset, req, self.budget.limit, order) if req.HasField("mix") else 0
        return dataset, transform, order, memory

    def _build(self, dataset: Any, opts: Any, transform: Any, req: pb.BatchRequest, order: int) -> Loaded:
        """A new loader of order version `order` (it allocates nothing until iterated), decoding
        through the decode pool when the server has one (`DataLoader(decoder_factory=)`)."""
        from gdsload.loader.dataloader import DataLoader

        seat = self.decode_pool.seat(req.dataset) if opts.decode and self.decode_pool is not None else None
        s = self.settings
        loader = DataLoader(dataset, **{**request.loader_kwargs(opts), "transform": transform},
                            order=order, num_workers=s.workers, prefetch_factor=s.prefetch, pin_memory=False,
                            io="auto", decode_threads=s.decode_threads,
                            decoder_factory=seat.configure if seat is not None else None)
        return Loaded(loader, seat)


def _position(loader: Any, req: pb.BatchRequest, kept: PlannedIds) -> tuple[Any, Any]:
    """Position the loader at the request's start: (the plan's batches of ids of the stream's
    steps, beside the loader's: they name skipped samples and place stored members; the steps of
    a `block_stride` stream, or None). Both are computed as the stream reaches them
    (`BlockSteps`, `PlannedIds`), so a striped stream of an epoch of 10^10 samples lists none of
    its steps. Checking start_position here names the request's field in the message."""
    from gdsload.plan.plan import BlockSteps

    plan = loader.plan
    plan.batches(req.epoch, req.start_position)  # (checks start_position)
    loader.load_state_dict(plan.state(req.epoch, req.start_position))
    first, n = req.start_position // plan.global_batch, len(plan)
    if req.block_stride <= 1:  # the steps from the start, at most max_batches of them
        return kept.stream(plan, req.epoch, range(first, min(n, first + req.max_batches)
                                                  if req.max_batches else n)), None
    # blocks b, b + stride, ... of the epoch (one stream per server of a stripe)
    steps = BlockSteps(first, n, req.block_batches, req.block_stride, req.max_batches)
    return kept.stream(plan, req.epoch, steps), steps


class PlannedIds:
    """The ids of one plan per step (order 2 computes them from the positions:
    `gdsload.plan.window`), planned for a stream's next steps at once and kept for the later
    streams of the plan, of its two latest epochs, at most `KEEP_POSITIONS` positions' worth of
    steps each (512 KB of ids), the oldest dropped first. A striping client's streams of one
    server cover the same steps again (a stream cancelled when its next block went elsewhere is
    asked again from its next own block): the next plans only the steps that were not. Streams
    on several threads share it."""

    KEEP_POSITIONS = 65536

    def __init__(self) -> None:
        self._epochs: OrderedDict[int, dict[int, tuple[Any, int]]] = OrderedDict()  # step -> (its
        self._lock = threading.Lock()  # `PlanBatches`, its index there)
        self.planned = 0  # steps given to the plan (not found here)

    def stream(self, plan: Any, epoch: int, steps: Any) -> Iterator[Any]:
        """The ids of `steps` (increasing) of `epoch`, each when the stream reaches it: found here,
        else with the stream's next steps from `plan.batches_at`, which computes them a chunk of
        positions at a time when first asked (`PlanBatches`: a chunk's worth of steps ahead)."""
        from gdsload.plan.plan import PlanBatches

        with self._lock:
            kept = self._epochs.get(epoch)
            if kept is None:
                kept = self._epochs[epoch] = {}
                while len(self._epochs) > 2:
                    self._epochs.popitem(last=False)
        ahead = max(1, PlanBatches.CHUNK_POSITIONS // plan.batch_size)
        keep = max(2 * ahead, self.KEEP_POSITIONS // plan.batch_size)
        for i, step in enumerate(steps):
            got = kept.get(step)
            if got is None:
                run = steps[i:i + ahead]
                batches = plan.batches_at(epoch, run)
                with self._lock:
                    self.planned += len(run)
                    for j, s in enumerate(run):
                        kept[s] = (batches, j)
                    while len(kept) > keep:
                        del kept[next(iter(kept))]
                got = (batches, 0)
            yield got[0][got[1]]


def stride_steps(first: int, num_steps: int, block: int, stride: int, limit: int = 0) -> list[int]:
    """The steps of a `BatchRequest.block_stride` stream, listed: from `first` to the end of its
    block of `block` steps, then every `stride`-th block after it, at most `limit` steps (0: no
    limit). Streams use them unlisted (`gdsload.plan.plan.BlockSteps`)."""
    from gdsload.plan.plan import BlockSteps

    return list(BlockSteps(first, num_steps, block, stride, limit))
