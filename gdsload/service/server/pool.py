"""One server's image decoding capacity, shared by its streams: `DecodePool`.

Without it every decoding stream builds its own DALI pipeline with its own threads, so four
streams run four pipelines that compete for the same cores and each pay DALI's fixed cost. With
it, a stream's loader hands each batch to the pool and waits: the loader was built with
`DataLoader(decoder_factory=seat.configure)` (the loader's public seam), so its decoder is the
seat, a `PooledDecoder`, whose `decode_into` (the `ImageDecoder` method the loader calls) queues
the batch as one of the stream the seat is attached to (`attach` when a stream of the loader
starts, `detach` when it ends: a parked loader keeps its seat, detached); `workers` threads take the batches of the
waiting streams in turn (round robin over streams, so a stream with many batches queued does not
starve the others) and decode each with a DALI pipeline of `threads` threads (the server's cores)
for that transform, built on first use and kept while decoding streams are open.

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
(at most `close_timeout_s`), and releases the pipelines in the calling thread, not at the
interpreter's exit. A stream waiting for its batch checks every `POLL_S` whether the pool closed
and gives up `close_timeout_s` after, with `Unavailable`.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from gdsload.errors import RingClosed, Unavailable

_CLOSED = "the server's decode pool is closed (the server is shutting down); retry on another server"

#: How often a stream waiting for its batch checks that the pool is still open (seconds).
POLL_S = 0.25


class _Job:
    __slots__ = ("args", "done", "dst", "encoded", "error", "key", "names", "queued", "result", "started", "waited")

    def __init__(self, key, args, encoded, names, dst):
        self.key, self.args, self.encoded, self.names, self.dst = key, args, encoded, names, dst
        self.queued = time.perf_counter()
        self.waited = 0.0
        self.started = False  # a worker took it
        self.done = threading.Event()
        self.result: list[int] | None = None
        self.error: BaseException | None = None


class DecodePool:
    def __init__(self, *, workers: int, threads: int, metrics: Any = None, linger_s: float = 2.0,
                 close_timeout_s: float = 10.0):
        self.workers = workers
        self.linger_s = linger_s
        self.close_timeout_s = close_timeout_s
        self.threads = threads
        self.metrics = metrics
        self._cv = threading.Condition()
        self._queues: dict[int, collections.deque[_Job]] = {}  # stream -> its waiting batches
        self._turns: collections.deque[int] = collections.deque()  # streams with work, in turn order
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

    def attach(self) -> int:
        """A stream starts decoding through the pool: its id (its queue, served in turn)."""
        with self._cv:
            if self._closed:
                raise Unavailable(_CLOSED)
            self._next_id += 1
            sid = self._next_id
            self._queues[sid] = collections.deque()
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

    def submit(self, sid: int, key: tuple, args: dict, encoded, names, dst) -> tuple[list[int], float]:
        """Decode one batch of stream `sid` (blocks); returns the rows kept and the queue time.
        Raises `RingClosed` when the stream ended (its readers stop), `Unavailable` when the pool
        closed before the batch was decoded (the stream's consumer gets it, in order)."""
        job = _Job(key, args, encoded, names, dst)
        with self._cv:
            if self._closed:
                raise Unavailable(_CLOSED)
            q = self._queues.get(sid)
            if q is None:
                raise RingClosed("the stream ended")
            q.append(job)
            if sid not in self._turns:
                self._turns.append(sid)
            self._cv.notify()
        while not job.done.wait(POLL_S):
            if self._closed and time.monotonic() - self._closed_at > self.close_timeout_s:
                raise Unavailable(_CLOSED + " (the batch was not decoded in time)")
        if job.error is not None:
            raise job.error
        return job.result, job.waited

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
    def _take(self) -> tuple[_Job, Any, Any] | None:
        """The next job in turn, an idle decoder for it (or None: build one) and an idle decoder of
        another transform to drop (making room), or None when the pool is closed."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                if self._turns:
                    sid = self._turns.popleft()
                    q = self._queues.get(sid)
                    if not q:
                        continue
                    job = q.popleft()
                    job.started = True
                    if q:
                        self._turns.append(sid)  # its next batch waits for the others' turns
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
                self._cv.wait()

    def _work(self) -> None:
        from gdsload.decode.image import ImageDecoder

        while True:
            got = self._take()
            if got is None:
                return
            job, dec, evicted = got
            del evicted, got  # its pipeline goes here, outside the lock
            job.waited = time.perf_counter() - job.queued
            if self.metrics is not None:
                self.metrics.pool_busy.inc()
            try:
                if dec is None:
                    dec = ImageDecoder(**job.args)
                job.result = dec.decode_into(job.encoded, job.names, job.dst)
            except BaseException as exc:  # the stream's error (a corrupt image), raised in its thread
                job.error = exc
                dec = None  # DALI may have invalidated it
            finally:
                if self.metrics is not None:
                    self.metrics.pool_busy.dec()
                with self._cv:
                    if dec is None or self._closed:  # closed: released here, by its worker
                        self._built -= 1
                    else:
                        self._free.setdefault(job.key, []).append(dec)
                        dec = None
                job.done.set()
            job = dec = None  # nothing of the batch or a pipeline is kept while waiting

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
        self.queue_s = 0.0  # since the last attach
        self.batches = 0

    def configure(self, **args: Any) -> PooledDecoder:
        """(The loader's decoder factory) `ImageDecoder`'s arguments; the pool's pipelines take
        the pool's threads."""
        self.args = dict(args, threads=self.pool.threads)
        self.key = (repr(args["transform"]), args["batch_size"], args["on_error"], args["seed"])
        return self

    def attach(self) -> PooledDecoder:
        """A stream of the loader starts (`Unavailable` when the pool is closed)."""
        self.detach()
        self.sid = self.pool.attach()
        self.queue_s = 0.0
        self.batches = 0
        return self

    def detach(self) -> None:
        """The stream ended: its batches still queued fail with `RingClosed` (its readers stop)."""
        sid, self.sid = self.sid, None
        if sid is not None:
            self.pool.detach(sid)

    def decode_into(self, encoded, names, dst, *, stream: Any = None) -> list[int]:
        sid = self.sid
        if sid is None:
            raise RingClosed("the stream ended")
        kept, waited = self.pool.submit(sid, self.key, self.args, encoded, names, dst)
        self.queue_s += waited
        self.batches += 1
        m = self.pool.metrics
        if m is not None:
            m.queue_s.labels(self.dataset).observe(waited)
        return kept
