"""Where a stream's batches come from: a `BatchSource`, opened by `open_source(req, ...)`.

Three sources, one protocol (`next() -> Frames | None`, `close(outcome)`):

- `LoaderSource`: a loader of the request (`loaders.Loaders.open`: validated, taken from the pool
  or built, memory reserved, positioned at the start) iterated batch by batch; each batch becomes
  its chunks here (`LoaderSource.next`, the one batch-to-frames step: the samples the loader left
  out named in `BatchHeader.skipped_keys`, `wire.encode_frames`).
- `StoredSource`: the same loader's plan, its batches sent as the members are stored, from the page
  cache (`stored.StoredBatches`), when the request and the dataset allow it.
- `share.SharedSource`: a subscriber of a share group, served from a producer's window; each
  producer is itself a `LoaderSource`.

`open_source` checks the request (the limits and `protocol.request.check_combination`), sends a
request with a share name to its share group, and otherwise tries `StoredSource` then
`LoaderSource`, logging (DEBUG, `not_stored`) why a stream is not sent as stored. Whatever it
opened is released, and nothing is left reserved, when it raises.

Memory for higher priorities (issue 49): a stream's `LoaderSource` can be *suspended* while its
stream waits for its turn (`suspend`, called by `priority.Arbiter.release_below` for work of a
higher priority that does not fit in the budget): its iterator is closed and its loader parked in
the `LoaderPool` with its reservation (which the pool's eviction then releases). Its next turn
opens the loader of the rest of its steps again (`reopen`: from the pool when still parked, else
built and reserved anew); while that memory does not fit, `next` answers `MEMORY_WAIT` (the stream
stays paused, its cursor unchanged) instead of failing.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from gdsload.errors import DecodeError, Unavailable
from gdsload.service.protocol import request, wire
from gdsload.service.server import estimate
from gdsload.service.server.logs import event
from gdsload.service.server.stored import StoredBatches
from gdsload.v1 import feed_pb2 as pb

#: A corrupt sample's remedy, in protocol terms (the loader's names Python arguments).
SKIP_REMEDY = ("set BatchRequest.on_error = ON_ERROR_SKIP to leave corrupt samples out "
               "(BatchHeader.skipped_keys names them)")
#: Outcomes after which a stream's loader is parked for the next stream of its request.
KEEPS_LOADER = ("ok", "cancelled")


class MemoryWait:
    """What a suspended source's `next` answers while its memory does not fit: no batch yet."""

    def __repr__(self) -> str:
        return "MEMORY_WAIT"


MEMORY_WAIT = MemoryWait()


class Frames(Protocol):
    """One batch as its serialized chunks. `pieces()`: each chunk as a list of buffers whose first
    is its head (`wire.encode_frames`' layout: a bulk connection writes them as they are);
    `messages()`: each chunk's bytes (gRPC). Either is taken once. `nbytes`: the batch body;
    `copy`: a share group's copy of a batch sent before (`BatchHeader.shared`); `group`: whether
    it came from a share group."""

    step: int
    nbytes: int
    samples: int
    copy: bool
    group: bool

    def pieces(self) -> Iterable[Sequence[Any]]: ...

    def messages(self) -> Iterable[bytes]: ...


class Encoded:
    """A batch serialized just now (its views valid until the loader's next batch)."""

    __slots__ = ("frames", "nbytes", "samples", "step")
    copy = False
    group = False

    def __init__(self, step: int, frames: Iterator[list[Any]], nbytes: int, samples: int):
        self.step, self.frames, self.nbytes, self.samples = step, frames, nbytes, samples

    def pieces(self) -> Iterable[Sequence[Any]]:
        return self.frames

    def messages(self) -> Iterable[bytes]:
        return (b"".join(pieces) for pieces in self.frames)


class BatchSource(Protocol):
    """What `stream.serve` sends from. One stream's thread calls `next` (the next batch's frames,
    or None when the stream's range is done) and, once, `close(outcome)` ("ok", "cancelled",
    "drained" or a status name): it releases everything the source holds (its loader parked
    after "ok" and "cancelled", else closed; its reservations). `label` and `payload` label the
    stream's metrics; `log_fields(end)` adds to its stream_start/stream_end events. A source
    whose batches are decoded in the server's decode pool also has `pooled()` (`LoaderSource`'s):
    its job's share is charged the pool's seconds for them, not the wait for them."""

    label: str
    payload: str

    def next(self) -> Frames | None: ...

    def close(self, outcome: str) -> None: ...

    def log_fields(self, end: bool) -> dict[str, Any]: ...


def left_out(dataset: Any, ids: np.ndarray, keys: Sequence[str]) -> list[str]:
    """Keys of the samples `ids` (one batch of the plan) that are not in `keys` (the batch the
    loader made, without its skipped samples), in batch order."""
    shards = dataset.shards
    have = Counter(keys)
    out = []
    for gid in ids.tolist():
        s, j = shards.locate(gid)
        key = shards.index(s).key(j)
        if have[key]:
            have[key] -= 1
        else:
            out.append(key)
    return out


class LoaderSource:
    """The batches of one `loaders.Opened` loader, from the request's start to its end (the
    epoch's, `max_batches`, or the last of its `block_stride` steps). `whole_epoch`: every step
    to the epoch's end, whatever the request's `max_batches` (a share group's producer). Holds
    the loader's reservation and, for a stream, its stream slot (`slot`)."""

    def __init__(self, opened: Any, pool: Any, req: pb.BatchRequest, *, slot: Any = None,
                 whole_epoch: bool = False, reopen: Any = None):
        self.opened, self.pool, self.slot = opened, pool, slot
        self.req, self.reopen = req, reopen  # reopen(req): `loaders.Loaders.open` (None: never suspended)
        self.turn: Any = None  # its stream's `priority.Turn` (`rank`), for the decode pool's order
        self.suspended = False
        self.last_step: int | None = None  # the step of the last batch made
        self.label, self.payload = opened.label, opened.payload
        plan = opened.loader.plan
        self.G, self.end_position = plan.global_batch, plan.end_position
        self.epoch, self.step = req.epoch, req.start_position // self.G
        self.start_fields = dict(epoch=req.epoch, start_position=req.start_position, rank=plan.rank,
                                 world_size=plan.world_size, batch_size=req.batch_size)
        self.max_batches = 0 if whole_epoch else req.max_batches
        self.steps = iter(opened.steps) if opened.steps is not None else None
        self.sent = 0
        self.it: Any = None
        self.closed = False
        self.waited = 0.0  # (a pooled decode) the last batch's wait for its loader
        self.decoded_s = 0.0  # (a pooled decode) its seat's `decoded_s` when last looked at
        try:
            seat = opened.loaded.seat
            if seat is not None:
                seat.attach()
                self.decoded_s = seat.decoded_s
            self.start()
        except BaseException:
            self.close("error")
            raise

    def start(self) -> None:
        """Open the loader's iterator (its readers read nothing past the stream's end)."""
        loader, steps = self.opened.loader, self.opened.steps
        if steps is None:
            self.it = loader.iter_batches(self.max_batches or None)
        else:  # the stripe's blocks of this server, read ahead across the gaps (no steps: a start
            # at or past the stripe's last block, an empty stream)
            self.it = loader.iter_batches(steps=steps) if steps else (b for b in ())  # (closes, as theirs)

    def wire_bytes(self) -> int:
        """Upper bound of one of its batches serialized (`estimate.wire_bytes`)."""
        return estimate.wire_bytes(self.opened.loader.batch_layout(), chunk=self.opened.chunk)

    @property
    def reused(self) -> bool:
        """Whether its loader came from the pool (no loader was built)."""
        return self.opened.reused

    def batch(self) -> tuple[np.ndarray, dict[str, Any]]:
        """The next batch's sample ids (the plan's) and the batch (StopIteration at the end)."""
        t0 = time.perf_counter()
        try:
            batch = next(self.it)
        finally:
            self.waited = time.perf_counter() - t0
        return next(self.opened.planned), batch

    def pooled(self) -> tuple[float, float] | None:
        """(After `next`) for a loader that decodes in the server's decode pool: the seconds its last
        batch waited for the loader, and the seconds the pool's workers took for the loader's
        batches since the last look (None: it decodes nothing there). Its job pays the second, not
        the first (`priority.Turn.made`): the wait is mostly other jobs' decodes, which the pool
        charges to them, and the loader decodes ahead of its stream."""
        seat = self.opened.loaded.seat
        if seat is None:
            return None
        spent, self.decoded_s = seat.decoded_s - self.decoded_s, seat.decoded_s
        return self.waited, max(0.0, spent)

    def rank(self, turn: Any) -> None:
        """Its stream's turn: its loader's batches are decoded in the turn's order (`pool.DecodePool`)."""
        self.turn = turn
        if self.opened.loaded.seat is not None:
            self.opened.loaded.seat.rank(turn)

    def suspend(self) -> int:
        """(Another thread, while the stream waits for its turn: `priority.Arbiter.release_below`)
        park the loader with its reservation, to be evicted; returns the bytes it held (0: not
        suspendable, or done)."""
        if self.reopen is None or self.closed or self.suspended:
            return 0
        opened = self.opened
        if opened.loaded.seat is not None:
            opened.loaded.seat.detach()
        if self.it is not None:
            self.it.close()
        self.suspended = True
        self.pool.park(opened.key, opened.loaded, opened.reservation)
        return opened.reservation.nbytes

    def resume(self) -> bool:
        """Open the loader of the rest of the stream's steps again; False while it does not fit."""
        budget, need = self.pool.budget, self.opened.reservation.nbytes
        # (not worth building a loader that cannot reserve; parked loaders give way: a higher job's
        # loader parked when it left would otherwise hold this stream paused for the pool's idle_s)
        if not self.pool.has(self.opened.key) and budget.reserved - self.pool.parked_nbytes() + need > budget.limit:
            return False
        req = pb.BatchRequest()
        req.CopyFrom(self.req)
        req.start_position = self.next_step() * self.G
        if req.max_batches:
            req.max_batches -= self.sent
        try:
            opened = self.reopen(req)
        except Unavailable:
            return False
        self.opened, self.suspended = opened, False
        self.steps = iter(opened.steps) if opened.steps is not None else None
        self.step = req.start_position // self.G
        if opened.loaded.seat is not None:
            opened.loaded.seat.attach()
            opened.loaded.seat.rank(self.turn)
            self.decoded_s = opened.loaded.seat.decoded_s
        self.start()
        return True

    def place(self) -> tuple[int, int]:
        """Where its next batch is in its job's plan: (epoch, step). Of one job's streams on a
        server the first in plan order goes first (`priority.Arbiter`, `pool.DecodePool`): a
        striping client hands batches out in plan order, so the stream of its head block is the
        one it waits for (a later block's, made first, only waits in the client)."""
        return self.epoch, self.next_step()

    def next_step(self) -> int:
        """The step of the stream's next batch (a `block_stride` stream's: the rest of the block,
        then the next of its blocks)."""
        s, req = self.last_step, self.req
        if s is None or self.steps is None:
            return self.step
        k = req.block_batches
        return s + 1 if (s + 1) % k else (s // k + req.block_stride) * k

    def next(self) -> Any:
        if self.max_batches and self.sent >= self.max_batches:
            return None
        if self.suspended and not self.resume():
            return MEMORY_WAIT
        try:
            ids, batch = self.batch()
        except StopIteration:
            return None
        except DecodeError as exc:  # word the remedy in protocol terms
            raise DecodeError(exc.reason, remedy=SKIP_REMEDY) from exc
        step = next(self.steps) if self.steps is not None else self.step
        keys = batch[wire.KEY]
        skipped = left_out(self.opened.loader.dataset, ids, keys) if len(keys) < len(ids) else []
        frames = wire.encode_frames(batch, epoch=self.epoch, step=step, position=(step + 1) * self.G,
                                    max_chunk_bytes=self.opened.chunk, skipped_keys=skipped,
                                    end_position=self.end_position)
        self.step = step + 1
        self.last_step = step
        self.sent += 1
        return Encoded(step, frames, wire.body_nbytes(batch), len(keys))

    def close(self, outcome: str) -> None:
        """Park the loader (after "ok" or "cancelled": its iterator closed, its readers stopped; the
        ring, backends and threads stay for the next stream of the request), else close it."""
        if self.closed:
            return
        self.closed = True
        if self.suspended:  # its loader is parked already
            if self.slot is not None:
                self.slot.release()
            return
        opened = self.opened
        if opened.loaded.seat is not None:
            opened.loaded.seat.detach()  # its queued batches fail: the readers stop at once
        try:
            if outcome in KEEPS_LOADER:
                if self.it is not None:
                    self.it.close()
                self.pool.park(opened.key, opened.loaded, opened.reservation)
            else:
                opened.loaded.close()
                opened.reservation.release()
        finally:
            if self.slot is not None:
                self.slot.release()

    def log_fields(self, end: bool) -> dict[str, Any]:
        if not end:
            return self.start_fields
        seat = self.opened.loaded.seat
        return {"decode_queue_s": round(seat.queue_s, 3) if seat is not None else None}


class StoredSource(LoaderSource):
    """The loader's plan sent as stored members (`stored.StoredBatches`): the loader reads nothing
    and allocates no ring; it is parked after the stream as any."""

    def __init__(self, opened: Any, pool: Any, req: pb.BatchRequest, stored: StoredBatches, *, slot: Any = None):
        self.stored = stored
        super().__init__(opened, pool, req, slot=slot)

    def start(self) -> None:
        pass

    def batch(self) -> tuple[np.ndarray, dict[str, Any]]:
        ids = next(self.opened.planned)
        return ids, self.stored.batch(ids)


def open_source(req: pb.BatchRequest, *, loaders: Any, hub: Any, context: Any, bulk: bool,
                log: logging.Logger, metrics: Any) -> BatchSource:
    """The source of one StreamBatches call (the module docstring). `bulk`: its batches go on a
    bulk connection; `context`: the gRPC call (the caller's identity, for share groups)."""
    if req.HasField("windows"):  # a preprocessing pass's windows, not an epoch (issue 54)
        from gdsload.service.server.windows import open_windows

        return open_windows(req, loaders=loaders)
    opts = loaders.check(req)
    if req.share:
        return hub.subscribe(req, context)
    opened = loaders.open(req, opts)
    try:
        slot = loaders.budget.stream()
    except BaseException:
        opened.loaded.close()
        opened.reservation.release()
        raise
    why = request.stored_refusal(req, bulk=bulk)
    stored = None
    if why is None:
        stored, why = StoredBatches.open(opened.loader)
    if stored is not None:
        metrics.stored_streams.inc()
        return StoredSource(opened, loaders.pool, req, stored, slot=slot)
    event(log, "not_stored", level=logging.DEBUG, dataset=opened.label, reason=why)
    return LoaderSource(opened, loaders.pool, req, slot=slot, reopen=lambda r: loaders.open(r, opts))
