"""One server's image decoding capacity, shared by its streams: `DecodePool`.

Without it every decoding stream builds its own DALI pipeline with its own threads, so four
streams run four pipelines that compete for the same cores and each pay DALI's fixed cost. With
it, a stream's loader hands each batch to the pool and waits: the loader was built with
`DataLoader(decoder_factory=seat.configure)` (the loader's public seam), so its decoder is the
seat, a `PooledDecoder`, whose `decode_into` (the `ImageDecoder` method the loader calls) queues
the batch as one of the stream the seat is attached to (`attach` when a stream of the loader
starts, `detach` when it ends: a parked loader keeps its seat, detached); `workers` threads take
the waiting batches and decode each with a DALI pipeline of `threads` threads (the server's cores)
for that transform, built on first use and kept while decoding streams are open.

The order of batches is the server's `priority.Arbiter`'s (issue 49): a stream's seat knows its
stream's turn (`PooledDecoder.rank`, from `sources.LoaderSource.rank`), and so its level and job.
A loader's readers decode ahead of its stream (its prefetch ring), so without this a paused lower
stream's batches already queued, and those its readers queue while the higher stream sends, would
be decoded before the higher stream's next one, and a job of many streams would get more.

1. **Strict priority between levels.** A stream's batch waits while a stream of a higher level is
   active: it has a batch queued or being decoded, had one decoded less than `HOLD_S` ago (its
   loader's next comes at once), or its turn wants the server (`priority.Turn.wanting`). While a
   higher level has a stream here at all, the lower ones use at most `workers - 1` workers (at
   least 1): a higher stream whose client reads slowly (its ring full, nothing queued) finds a
   worker free for its next batch instead of waiting for a lower batch to end. Two
   exceptions keep every wait bounded: a stream that holds one of the arbiter's batch slots
   (`Turn.making`: its stream waits for this batch, and the higher stream may wait for its slot)
   and a stream with no turn (a share group's producer, whose turns are its subscribers'; a
   stream between its start and its turn) are never held back; they are ordered at their level
   (no turn: level 0).
2. **Equal decode seconds per job within a level.** Among the batches not held back, the highest
   level's first; within it the job (`Turn.job`: the caller and `BatchRequest.job`) with the
   fewest seconds of decoding (each batch charges its stream's job the seconds its worker took),
   then the job served least recently, then the batch queued first. A job new to the pool starts
   level with the least-served job of its level; one that comes back within `FORGET_S` (a
   striping client's next block is a new stream) keeps its seconds. Of one job's streams, the
   one whose next batch comes first in its plan (`priority.Turn.place`: a striping client's head
   block) goes first, and the job's later streams wait while it has a batch queued, being decoded
   or decoded less than `HOLD_S` ago: a client hands batches out in plan order, so a later
   block's batch decoded beside the head's only halves the head's pace (measured at a quarter
   core: the first batches of a job's two blocks on a server came every 1.2-1.4 s against 0.75 s
   after, the client waiting). A stream holding a batch slot is never held (rule 1's exception).

3. **A higher batch waits at most a slice of a lower one** (`slicing`). A running decode cannot
   be interrupted, so while a higher level has a stream here a lower batch is decoded in
   `slicing.SLICES` slices, its worker giving way between two when a higher batch is queued (or,
   for a stream that may be held back, a higher level is active): the rest of the batch goes back
   to the head of its stream's queue. The output is the whole batch's; without a higher level
   here a batch is decoded whole, as one run of the loader's decoder.

`order` keeps (job, level, the highest active level, whether a batch was held back) per batch
taken (not the rest of a batch taken again), `slices` (job, level, first row, end row) per slice
decoded (a whole batch is one), for tests and debugging; `used()` the decode seconds per job.

Bounds: a pipeline is only ever used by one worker at a time and a loader decodes one batch at a
time, so at most min(workers, attached streams) pipelines exist: the pool never holds more
decoders than the open decoding streams have reserved against `--max-memory` (each still
reserves a decoder's share); when the last decoding stream detaches, the pipelines are kept
`linger_s` (2 s) for the next stream (a striping client opens one per block), then closed.

Metrics: `gdsload_feed_decode_pool_busy` (workers decoding now), `gdsload_feed_decode_pool_streams`
(streams attached), `gdsload_feed_decode_queue_seconds{dataset}` (time a batch waited for a
worker); each stream's total queue time is in its `stream_end` log event.

Shutdown and ends, every wait bounded: a stream that ends (`detach`) fails its batches still
queued with `RingClosed` (its readers stop at once) and a batch it submits later too; `close()`
fails every queued batch with `Unavailable` (not `RingClosed`: a reader stops quietly on that,
leaving its stream's consumer waiting for the batch), lets the workers finish the batch in hand
(at most `close_timeout_s`; a batch decoded in slices fails at its next slice, as queued: with
`RingClosed` when its stream ended, `Unavailable` when the pool closed), and releases the
pipelines in the calling thread, not at the interpreter's exit. A stream waiting for its batch
checks every `POLL_S` whether the pool closed and gives up `close_timeout_s` after, with
`Unavailable`.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from gdsload.errors import RingClosed, Unavailable
from gdsload.service.server.priority import FORGET_S as PRIORITY_FORGET_S
from gdsload.service.server.priority import RETURN_S
from gdsload.service.server.slicing import CLOSED as _CLOSED
from gdsload.service.server.slicing import Batch, Slicing

#: How often a stream waiting for its batch checks that the pool is still open (seconds).
POLL_S = 0.25
#: A stream whose batch was decoded less than this ago still wants the pool (its loader's next
#: batch comes at once): lower levels wait meanwhile (`priority.RETURN_S`).
HOLD_S = RETURN_S
#: How long a worker waits for the next batch of a less-served job of the same level, decoded just
#: before (`_owed`): a loader queues its next batch as its last one is decoded.
NEXT_S = 0.01
#: How long a job with no stream attached keeps its decode seconds (`priority.FORGET_S`).
FORGET_S = PRIORITY_FORGET_S


class DecodePool(Slicing):
    def __init__(self, *, workers: int, threads: int, metrics: Any = None, linger_s: float = 2.0,
                 close_timeout_s: float = 10.0, clock: Any = time.monotonic):
        self.workers = workers
        self.clock = clock
        self.linger_s = linger_s
        self.close_timeout_s = close_timeout_s
        self.threads = threads
        self.metrics = metrics
        self._cv = threading.Condition()
        self._queues: dict[int, collections.deque[Batch]] = {}  # stream -> its waiting batches
        self._seats: dict[int, PooledDecoder] = {}  # stream -> its seat (its `turn`: level and job)
        self._busy: dict[int, int] = {}  # stream -> its batches being decoded
        self._done: dict[int, float] = {}  # stream -> when its last batch was decoded (`clock`)
        self._ended: dict[int, float] = {}  # the same, in real seconds (`_owed`)
        self.next_s = NEXT_S
        self._jobs: dict[Any, list[float]] = {}  # job -> [decode seconds, last served, last seen]
        self.order: collections.deque = collections.deque(maxlen=100_000)  # per batch taken (the docstring)
        self.slices: collections.deque = collections.deque(maxlen=100_000)  # per slice (`slicing`)
        self._free: dict[tuple, list[Any]] = {}  # key -> idle decoders
        self._built = 0
        self._attached = 0
        self._next_id = 0
        self._closed = False
        self._closed_at = 0.0
        self._linger: threading.Timer | None = None
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"gdsload-decode-pool-{i}")
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    # -- streams ---------------------------------------------------------------------------------
    def seat(self, dataset: str) -> PooledDecoder:
        """A loader's seat in the pool: hand `seat.configure` to the loader as its decoder factory
        (`DataLoader(decoder_factory=)`); each stream of the loader `attach`es it, and `detach`es
        it when it ends."""
        return PooledDecoder(self, dataset)

    def attach(self, seat: PooledDecoder | None = None) -> int:
        """A stream starts decoding through the pool: its id (its queue, served in its turn: the
        seat's `turn`, when it has one)."""
        with self._cv:
            if self._closed:
                raise Unavailable(_CLOSED)
            self._next_id += 1
            sid = self._next_id
            self._queues[sid] = collections.deque()
            self._seats[sid] = seat
            self._busy[sid] = 0
            self._attached += 1
            if self._linger is not None:  # a stream came within the linger: keep the pipelines
                self._linger.cancel()
                self._linger = None
        self._gauge()
        return sid

    def detach(self, sid: int) -> None:
        """The stream ended: its batches still queued fail with `RingClosed` (its readers stop)."""
        with self._cv:
            left = self._queues.pop(sid, None)
            if left is None:
                return
            self._seats.pop(sid, None)
            self._busy.pop(sid, None)
            self._done.pop(sid, None)
            self._ended.pop(sid, None)
            self._forget()
            for job in left:
                job.error = RingClosed("the stream ended")
                job.done.set()
            self._attached -= 1
            if self._attached == 0 and not self._closed:  # release the pipelines unless a stream
                if self._linger is not None:  # comes soon (a striping client's next block)
                    self._linger.cancel()
                self._linger = threading.Timer(self.linger_s, self._release_if_idle)
                self._linger.daemon = True
                self._linger.start()
            self._cv.notify_all()
        self._gauge()

    def _release_if_idle(self) -> None:
        with self._cv:
            if self._attached or self._linger is None:  # a stream came meanwhile (or a newer timer)
                return
            self._linger = None
            idle = self._take_free()
        del idle  # the pipelines (and their memory) go here, outside the lock

    def _take_free(self) -> list[Any]:
        """Every idle decoder, out of the pool (the lock is held); the caller drops them."""
        idle = [d for decs in self._free.values() for d in decs]
        self._built -= len(idle)
        self._free.clear()
        return idle

    def submit(self, sid: int, key: tuple, args: dict, encoded, names, dst) -> tuple[list[int], float, float]:
        """Decode one batch of stream `sid` (blocks); returns the rows kept, the queue time and the
        seconds its worker took (its job's charge).
        Raises `RingClosed` when the stream ended (its readers stop), `Unavailable` when the pool
        closed before the batch was decoded (the stream's consumer gets it, in order)."""
        job = Batch(key, args, encoded, names, dst)
        with self._cv:
            if self._closed:
                raise Unavailable(_CLOSED)
            q = self._queues.get(sid)
            if q is None:
                raise RingClosed("the stream ended")
            job.sid = sid
            q.append(job)
            self._cv.notify_all()
        while not job.done.wait(POLL_S):
            if self._closed and time.monotonic() - self._closed_at > self.close_timeout_s:
                raise Unavailable(_CLOSED + " (the batch was not decoded in time)")
        if job.error is not None:
            raise job.error
        return job.result, job.waited, job.spent

    def close(self) -> bool:
        """Stop the workers and release the pipelines: batches still queued fail, the batches being
        decoded finish (each worker waited for at most `close_timeout_s` in all). Returns True
        when every worker ended in time."""
        with self._cv:
            if not self._closed:
                self._closed = True
                self._closed_at = time.monotonic()
            waiting = [job for q in self._queues.values() for job in q]
            for q in self._queues.values():
                q.clear()
            if self._linger is not None:
                self._linger.cancel()
                self._linger = None
            idle = self._take_free()
            self._cv.notify_all()
        for job in waiting:  # an error their streams deliver in order (RingClosed would not be:
            job.error = Unavailable(_CLOSED)  # a reader stops quietly on it, and its consumer waits)
            job.done.set()
        del idle  # destroyed here, not left to the interpreter's exit
        deadline = time.monotonic() + self.close_timeout_s
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        with self._cv:  # what a worker gave back on its way out
            idle = self._take_free()
        del idle
        return not any(t.is_alive() for t in self._threads)

    # -- workers -------------------------------------------------------------------------------------
    def _take(self) -> tuple[Batch, Any, Any] | None:
        """The next job in turn, an idle decoder for it (or None: build one) and an idle decoder of
        another transform to drop (making room), or None when the pool is closed."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                sid, wake = self._pick(self.clock())
                if sid is not None:
                    job = self._queues[sid].popleft()
                    job.started = True
                    self._busy[sid] += 1
                    decs = self._free.get(job.key)
                    dec = decs.pop() if decs else None
                    evicted = None
                    if dec is None and self._built >= max(1, min(self.workers, self._attached)):
                        for others in self._free.values():  # an idle pipeline of another transform
                            if others:
                                evicted = others.pop()
                                self._built -= 1
                                break
                    if dec is None:
                        self._built += 1
                    return job, dec, evicted
                self._cv.wait(wake)

    # -- the order of batches: the arbiter's rules -----------------------------------------------------
    def _rank(self, sid: int) -> tuple[int, Any, bool]:
        """(level, job, bound) of stream `sid` (the lock is held): its seat's turn's level and job,
        bound to no level when it holds a batch slot (the arbiter granted it: it must not wait here
        for higher work, which may wait for its slot) or has no turn (a share group's producer, a
        stream not in turns yet: level 0, a job of its own)."""
        seat = self._seats.get(sid)
        turn = getattr(seat, "turn", None)
        if turn is None:
            return 0, ("seat", sid), False
        return turn.level(), turn.job, not turn.making()

    def _place(self, sid: int) -> tuple | None:
        """Where stream `sid`'s next batch is in its job's plan (`priority.Turn.place`), or None."""
        return getattr(getattr(self._seats.get(sid), "turn", None), "place", None) or None

    def _working(self, sid: int, now: float) -> bool:
        """Whether stream `sid` has a batch queued or being decoded, or had one decoded less than
        `HOLD_S` ago (its loader queues its next at once)."""
        return bool(self._queues[sid] or self._busy[sid] or now - self._done.get(sid, -HOLD_S) < HOLD_S)

    def _active(self, sid: int, now: float) -> bool:
        """Whether stream `sid` wants the pool now: a batch queued or being decoded, its last one
        decoded less than `HOLD_S` ago (its next comes at once), or its turn wants the server."""
        if self._working(sid, now):
            return True
        turn = getattr(self._seats.get(sid), "turn", None)
        return turn is not None and turn.wanting()

    def _pick(self, now: float) -> tuple[int | None, float | None]:
        """The stream whose batch a worker takes next, or None and how long to wait (None: until
        notified). Rule 1: a bound stream's batch waits while a stream of a higher level is active
        (`_active`); rule 2: of the rest, the highest level first, then the job with the fewest
        decode seconds, then the one served least recently, then of its streams the one whose next
        batch comes first in its plan (`priority.Turn.place`), then the batch queued first."""
        ranks = {sid: self._rank(sid) for sid in self._queues}
        top = max((ranks[s][0] for s in self._queues if self._active(s, now)), default=None)
        ranked = [ranks[s][0] for s in self._queues if getattr(self._seats.get(s), "turn", None) is not None]
        highest = max(ranked, default=None)  # the highest level with a stream here, active or not
        below = sum(self._busy[s] for s in self._queues if highest is not None and ranks[s][0] < highest)
        places = {sid: self._place(sid) for sid in self._queues}
        head: dict[Any, tuple] = {}  # (level, job) -> the first place in plan order of its streams in work
        for sid in self._queues:
            if places[sid] is not None and self._working(sid, now):
                lj = ranks[sid][:2]
                head[lj] = min(head.get(lj, places[sid]), places[sid])
        best, key, held = None, None, False
        for sid, q in self._queues.items():
            if not q:
                continue
            level, job, bound = ranks[sid]
            if bound and ((top is not None and level < top)
                          or (highest is not None and level < highest and below >= max(1, self.workers - 1))
                          or (places[sid] is not None and places[sid] > head.get((level, job), places[sid]))):
                held = True  # (below the highest level here, one worker is kept for it; behind its job's
                continue  # head stream, it waits for that one: rule 2)
            used, last, _ = self._jobs.get(job) or self._enter(job, level, ranks)
            place = places[sid] or ()
            k = (-level, used, last, place, q[0].queued, sid)
            if key is None or k < key:
                best, key = sid, k
        if best is not None and self._owed(best, ranks, now):
            return None, self.next_s
        if best is not None:
            level, job, _ = ranks[best]
            head = self._queues[best][0]
            head.job = job
            self._jobs[job][1] = self._jobs[job][2] = now
            if not head.started:  # (not the rest of a batch a worker gave way with: `slicing`)
                self.order.append((job, level, top, held))
            return best, None
        return None, (HOLD_S / 2 if held else None)

    def _owed(self, sid: int, ranks: dict, now: float) -> bool:
        """Whether a job of `sid`'s level with fewer seconds had its batch decoded less than
        `NEXT_S` ago and has not queued its next yet (a loader queues it at once): it is waited
        for, or the job whose next batch happened to be queued first would get more than its
        share. A bound stream only (one holding a slot is not kept waiting)."""
        level, job, bound = ranks[sid]
        if not bound:
            return False
        used = self._jobs[job][0]
        real = time.monotonic()  # (the wait for a loader is in real seconds, whatever the clock)
        for other, (lv, j, _) in ranks.items():
            if (lv == level and j != job and not self._queues[other] and not self._busy[other]
                    and real - self._ended.get(other, real - self.next_s) < self.next_s and j in self._jobs
                    and self._jobs[j][0] < used):
                return True
        return False

    def _enter(self, job: Any, level: int, ranks: dict) -> list[float]:
        """A job's row (the lock is held): a job new to the pool starts level with the least-served
        job of its level here (no credit for its absence); one back within `FORGET_S` keeps its
        seconds, but no fewer than that."""
        peers = [self._jobs[j][0] for lv, j, _ in ranks.values()
                 if lv == level and j != job and j in self._jobs and j[0] != "seat"]  # (not a stream without turn)
        row = self._jobs.setdefault(job, [0.0, 0.0, self.clock()])
        row[0] = max(row[0], min(peers, default=0.0))
        return row

    def _forget(self) -> None:
        """Drop the jobs of no attached stream not seen for `FORGET_S` (the lock is held)."""
        now = self.clock()
        live = {self._rank(sid)[1] for sid in self._queues}
        for job in [j for j, row in self._jobs.items() if j not in live and now - row[2] > FORGET_S]:
            del self._jobs[job]

    def used(self) -> dict[Any, float]:
        """Decode seconds per job (the jobs seen in the last `FORGET_S` or attached)."""
        with self._cv:
            return {j: row[0] for j, row in self._jobs.items()}

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.pool_streams.set(self._attached)


class PooledDecoder:
    """A loader's decoder (what `DataLoader(decoder_factory=seat.configure)` gets back): each
    `decode_into` goes through the pool, queued as the batch of the stream the seat is attached
    to; a seat not attached (its loader parked) refuses with `RingClosed`."""

    device = "cpu"

    def __init__(self, pool: DecodePool, dataset: str):
        self.pool, self.dataset = pool, dataset
        self.args: dict[str, Any] = {}
        self.key: tuple = ()
        self.sid: int | None = None
        self.turn: Any = None  # its stream's `priority.Turn` (`rank`): the order of its batches
        self.queue_s = 0.0  # since the last attach
        self.batches = 0
        self.decoded_s = 0.0  # the seconds the pool's workers took for its batches, ever (never reset:
        # a source reads how much it grew; one writer, as a loader decodes one batch at a time)

    def configure(self, **args: Any) -> PooledDecoder:
        """(The loader's decoder factory) `ImageDecoder`'s arguments; the pool's pipelines take
        the pool's threads."""
        self.args = dict(args, threads=self.pool.threads)
        self.key = (repr(args["transform"]), args["batch_size"], args["on_error"], args["seed"])
        return self

    def attach(self) -> PooledDecoder:
        """A stream of the loader starts (`Unavailable` when the pool is closed)."""
        self.detach()
        self.turn = None
        self.sid = self.pool.attach(self)
        self.queue_s = 0.0
        self.batches = 0
        return self

    def rank(self, turn: Any) -> None:
        """Its stream's turn (`priority.Turn`): its batches are taken at its level and charged to
        its job (until it detaches)."""
        pool = self.pool
        with pool._cv:
            self.turn = turn
            if turn is not None and self.sid in pool._queues:  # (re)entering: level with its peers
                ranks = {sid: pool._rank(sid) for sid in pool._queues}
                if not any(r[1] == turn.job for sid, r in ranks.items() if sid != self.sid):
                    pool._enter(turn.job, turn.level(), ranks)
            pool._cv.notify_all()

    def detach(self) -> None:
        """The stream ended: its batches still queued fail with `RingClosed` (its readers stop)."""
        sid, self.sid = self.sid, None
        self.turn = None
        if sid is not None:
            self.pool.detach(sid)

    def decode_into(self, encoded, names, dst, *, stream: Any = None) -> list[int]:
        sid = self.sid
        if sid is None:
            raise RingClosed("the stream ended")
        kept, waited, spent = self.pool.submit(sid, self.key, self.args, encoded, names, dst)
        self.queue_s += waited
        self.decoded_s += spent
        self.batches += 1
        m = self.pool.metrics
        if m is not None:
            m.queue_s.labels(self.dataset).observe(waited)
        return kept
