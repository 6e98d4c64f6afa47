"""One server's image decoding capacity, shared by its streams: `DecodePool`.

Without it every decoding stream builds its own DALI pipeline with its own threads, so four
streams run four pipelines that compete for the same cores and each pay DALI's fixed cost. With
it, a stream's loader hands each batch to the pool (`PooledDecoder.decode_into`, the
`ImageDecoder` method the loader calls) and waits; `workers` threads take the batches of the
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
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any


class _Job:
    __slots__ = ("args", "done", "dst", "encoded", "error", "key", "names", "queued", "result", "waited")

    def __init__(self, key, args, encoded, names, dst):
        self.key, self.args, self.encoded, self.names, self.dst = key, args, encoded, names, dst
        self.queued = time.perf_counter()
        self.waited = 0.0
        self.done = threading.Event()
        self.result: list[int] | None = None
        self.error: BaseException | None = None


class DecodePool:
    def __init__(self, *, workers: int, threads: int, metrics: Any = None, linger_s: float = 2.0):
        self.workers = workers
        self.linger_s = linger_s
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
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"gdsload-decode-pool-{i}")
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    # -- streams -------------------------------------------------------------------------------------
    def attach(self, loader: Any, dataset: str) -> PooledDecoder:
        """Make `loader` (a `DataLoader` that decodes, not yet iterated) decode through the pool."""
        if loader._resources is None:
            loader._setup()
        res = loader._resources
        with self._cv:
            self._next_id += 1
            sid = self._next_id
            self._queues[sid] = collections.deque()
            self._attached += 1
        self._gauge()
        args = dict(res._decoder_args, threads=self.threads)
        key = (repr(args["transform"]), args["batch_size"], args["on_error"], args["seed"])
        dec = PooledDecoder(self, sid, key, args, dataset)
        res._decoder = dec
        return dec

    def detach(self, sid: int) -> None:
        from gdsload.errors import RingClosed

        with self._cv:
            left = self._queues.pop(sid, None)
            if left is None:
                return
            for job in left:  # batches of the ended stream still queued: their readers stop now
                job.error = RingClosed("the stream ended")
                job.done.set()
            self._attached -= 1
            if self._attached == 0:  # release the pipelines unless a stream comes soon (a striping
                t = threading.Timer(self.linger_s, self._release_if_idle)  # client's next block)
                t.daemon = True
                t.start()
            self._cv.notify_all()
        self._gauge()

    def _release_if_idle(self) -> None:
        with self._cv:
            if self._attached == 0:  # nobody decodes: release the pipelines (their memory)
                for decs in self._free.values():
                    self._built -= len(decs)
                self._free.clear()

    def submit(self, sid: int, key: tuple, args: dict, encoded, names, dst) -> tuple[list[int], float]:
        """Decode one batch of stream `sid` (blocks); returns the rows kept and the queue time."""
        job = _Job(key, args, encoded, names, dst)
        with self._cv:
            if self._closed:
                raise RuntimeError("the server's decode pool is closed (shutting down)")
            q = self._queues[sid]
            q.append(job)
            if sid not in self._turns:
                self._turns.append(sid)
            self._cv.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result, job.waited

    def close(self) -> None:
        """Stop the workers; batches still queued fail (their streams are ending anyway)."""
        with self._cv:
            self._closed = True
            waiting = [job for q in self._queues.values() for job in q]
            for q in self._queues.values():
                q.clear()
            self._cv.notify_all()
        for job in waiting:
            job.error = RuntimeError("the server's decode pool is closed (shutting down)")
            job.done.set()

    # -- workers -------------------------------------------------------------------------------------
    def _take(self) -> tuple[_Job, Any] | None:
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
                    if q:
                        self._turns.append(sid)  # its next batch waits for the others' turns
                    decs = self._free.get(job.key)
                    dec = decs.pop() if decs else None
                    if dec is None and self._built >= max(1, min(self.workers, self._attached)):
                        for others in self._free.values():  # an idle pipeline of another transform
                            if others:
                                others.pop()
                                self._built -= 1
                                break
                    if dec is None:
                        self._built += 1
                    return job, dec
                self._cv.wait()

    def _work(self) -> None:
        from gdsload.decode.image import ImageDecoder

        while True:
            got = self._take()
            if got is None:
                return
            job, dec = got
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
                    if dec is None:
                        self._built -= 1
                    else:
                        self._free.setdefault(job.key, []).append(dec)
                job.done.set()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.pool_streams.set(self._attached)


class PooledDecoder:
    """What a stream's loader holds as its decoder: each `decode_into` goes through the pool."""

    device = "cpu"

    def __init__(self, pool: DecodePool, sid: int, key: tuple, args: dict, dataset: str):
        self.pool, self.sid, self.key, self.args, self.dataset = pool, sid, key, args, dataset
        self.queue_s = 0.0
        self.batches = 0

    def decode_into(self, encoded, names, dst, *, stream: Any = None) -> list[int]:
        kept, waited = self.pool.submit(self.sid, self.key, self.args, encoded, names, dst)
        self.queue_s += waited
        self.batches += 1
        m = self.pool.metrics
        if m is not None:
            m.queue_s.labels(self.dataset).observe(waited)
        return kept

    def detach(self) -> None:
        self.pool.detach(self.sid)
