"""The decode pool's workers (`pool.DecodePool`): a batch decoded whole, or in slices while a
higher level has a stream on the server (issue 49).

A DALI run cannot be interrupted. Decoded whole, a lower level's batch that a worker took while
no higher stream was active holds the CPU for its whole decode when the higher stream's next
batch comes: that batch waits for it (one worker) or decodes beside it on the same cores (a
worker kept free for it), either way slower than alone. So while a stream of a higher level than
a batch's is attached to the pool, that batch is decoded `SLICES` runs of ceil(B / `SLICES`)
images (at least 1), and between two slices its worker checks whether it must give way (`_next`):
a higher level's batch is queued (waiting for a worker), or, for a stream the pool may hold back
(`pool._rank`'s bound: no batch slot), a higher level is active (`pool._active`: the rule that
holds a new lower batch back). Then the worker charges the slices done, puts the rest of the
batch back at the head of its stream's queue and takes the next batch in the pool's order: the
higher one, whose wait is at most the slice in progress; the rest resumes when the pool's rules
take it again, in slices while a higher level is still here. Without a higher level here, a batch
is one `decode_into` call, as before slicing.

The output is a whole-batch decode's: each slice is `ImageDecoder.decode_into` of its rows (a run
smaller than the pipeline's batch size, as a batch's last run), written into the slot after the
rows kept so far, its kept indices shifted by the slice's start; so the slot's images, the indices
kept and their order are the same (a deterministic transform gives the same bytes; a training
transform's random draws differ between runs, as they do between the pool's shared pipelines).
With `on_error="raise"` a corrupt image fails the batch at its slice, naming the same first bad
image (the count in the message is the slice's). Each take charges its stream's job the seconds
its worker took, so a sliced batch costs its job the seconds of its slices. A stream that ends
between two slices fails the batch with `RingClosed`, a pool closed then with `Unavailable` (as
for batches still queued).

Why 4 slices: a higher batch then waits at most a quarter of a lower batch's decode, against a
whole one, while a lower batch pays 3 runs more (DALI's per-run cost, a small part of a decode)
only while a higher level is here. `slices` logs (job, level, first row, end row) per slice started,
a whole batch as one, for tests and debugging.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from gdsload.errors import RingClosed, Unavailable

CLOSED = "the server's decode pool is closed (the server is shutting down); retry on another server"

#: A lower level's batch is decoded in this many slices (ceil(B / SLICES) images each, at least 1)
#: while a higher level has a stream attached: a higher batch waits at most one slice (a quarter of
#: a lower batch's decode) for a worker or its cores, for 3 DALI runs more per lower batch.
SLICES = 4


class Batch:
    """One batch of a stream in the pool: its encoded images, names and slot (`dst`), and how far
    its decode got (`offset`: the rows done; `kept`: their indices kept)."""

    __slots__ = ("args", "done", "dst", "encoded", "error", "job", "kept", "key", "names", "offset", "queued",
                 "result", "sid", "since", "spent", "started", "waited")

    def __init__(self, key, args, encoded, names, dst):
        self.key, self.args, self.encoded, self.names, self.dst = key, args, encoded, names, dst
        self.queued = self.since = time.perf_counter()  # (since: when it last began to wait)
        self.sid = 0
        self.job: Any = None  # its stream's job when taken (charged its decode seconds)
        self.waited = 0.0
        self.spent = 0.0  # seconds its worker(s) took, over its slices
        self.started = False  # a worker took it
        self.offset = 0
        self.kept: list[int] = []
        self.done = threading.Event()
        self.result: list[int] | None = None
        self.error: BaseException | None = None


class Slicing:
    """`DecodePool`'s workers (a base class: every name here is the pool's own)."""

    def _work(self) -> None:
        from gdsload.decode.image import ImageDecoder

        while True:
            got = self._take()
            if got is None:
                return
            job, dec, evicted = got
            del evicted, got  # its pipeline goes here, outside the lock
            job.waited += time.perf_counter() - job.since
            t0 = self.clock()
            if self.metrics is not None:
                self.metrics.pool_busy.inc()
            ended = True
            try:
                if dec is None:
                    dec = ImageDecoder(**job.args)
                ended = self._decode(job, dec)
            except BaseException as exc:  # the stream's error (a corrupt image), raised in its thread
                job.error = exc
                dec = None  # DALI may have invalidated it
            finally:
                if self.metrics is not None:
                    self.metrics.pool_busy.dec()
                with self._cv:
                    self._charge(job, t0, ended)
                    if dec is None or self._closed:  # closed: released here, by its worker
                        self._built -= 1
                    else:
                        self._free.setdefault(job.key, []).append(dec)
                        dec = None
                    if not ended:
                        ended = not self._put_back(job)
                if ended:
                    job.done.set()
            job = dec = None  # nothing of the batch or a pipeline is kept while waiting

    def _decode(self, job: Batch, dec: Any) -> bool:
        """Decode `job` from its `offset` on: whole, or slice by slice (`_next`). False when its
        worker gave way before the end (its rest goes back to its queue)."""
        n = len(job.names)
        while True:
            with self._cv:
                span = self._next(job, n)
            if span is None:
                return False
            a, b = span
            if a == 0 and b == n:
                job.result = dec.decode_into(job.encoded, job.names, job.dst)
                return True
            kept = dec.decode_into(job.encoded[a:b], job.names[a:b], job.dst[len(job.kept):])
            job.kept += [a + k for k in kept]
            job.offset = b
            if b == n:
                job.result = job.kept
                return True

    def _next(self, job: Batch, n: int) -> tuple[int, int] | None:
        """The rows of `job`'s next slice (the lock is held), logged; None: give way. The first
        slice of a take is always decoded (the pool's rules just chose it)."""
        level, _, bound = self._rank(job.sid)
        if job.offset and (self._closed or job.sid not in self._queues or self._outranked(job.sid, level, bound)):
            return None
        ranks = [self._rank(s)[0] for s in self._queues if getattr(self._seats.get(s), "turn", None) is not None]
        if any(lv > level for lv in ranks):
            end = min(n, job.offset + max(1, -(-n // SLICES)))
        else:
            end = n
        self.slices.append((job.job, level, job.offset, end))
        return job.offset, end

    def _outranked(self, sid: int, level: int, bound: bool) -> bool:
        """Whether a batch of `sid` (at `level`) gives way between two slices: a stream of a higher
        level has a batch queued, or is active (`_active`) and `sid` may be held back (`bound`)."""
        now = self.clock()
        for other, q in self._queues.items():
            if other != sid and self._rank(other)[0] > level and (q or (bound and self._active(other, now))):
                return True
        return False

    def _put_back(self, job: Batch) -> bool:
        """The rest of `job` back at the head of its stream's queue (the lock is held); False when
        it failed instead: its stream ended (`RingClosed`) or the pool closed (`Unavailable`)."""
        q = self._queues.get(job.sid)
        if self._closed or q is None:
            job.error = Unavailable(CLOSED) if self._closed else RingClosed("the stream ended")
            return False
        job.since = time.perf_counter()
        q.appendleft(job)
        self._cv.notify_all()
        return True

    def _charge(self, job: Batch, t0: float, ended: bool = True) -> None:
        """`job` was decoded from `t0` on (the lock is held): its stream's job pays the seconds;
        `ended`: the batch was decoded (else its worker gave way, the rest goes back)."""
        now = self.clock()
        job.spent += now - t0
        if job.sid in self._busy:
            self._busy[job.sid] -= 1
            if ended:
                self._done[job.sid] = now
                self._ended[job.sid] = time.monotonic()
        row = self._jobs.get(job.job)
        if row is not None:
            row[0] += now - t0
            row[2] = now
