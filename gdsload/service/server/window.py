"""A share group's producer and its window of serialized batches (`share` has the group's rules).

A `Producer` is one loader source of a share key from its `start` step, the window of its last
batches (`WindowBatch`: each batch's chunks, serialized once) and its subscribers (`Subscriber`: a
stream's cursor). Every method here runs with the hub's lock held (`share.ShareHub.cond`) and
never blocks; making a batch (the loader's work) happens outside it, in the hub.

The window holds at most `window` batches and never more bytes than it reserved (`window_res`):
`room` makes space for the next step, detaching (after `hold_s`) the subscribers that still need
the oldest batch; `trim` pushes older batches out early when one was bigger than the estimate.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gdsload.v1 import feed_pb2 as pb

#: What a copy's chunk 0 gets appended: `BatchChunk{header: BatchHeader{shared: true}}`, which a
#: protobuf parser merges into the chunk's header (two instances of an embedded message merge).
SHARED_SUFFIX = pb.BatchChunk(header=pb.BatchHeader(shared=True)).SerializeToString()


class WindowBatch:
    """One batch in a window: its serialized chunks, as the first subscriber gets them."""

    __slots__ = ("again", "chunks", "heads", "nbytes", "samples", "step", "taken", "wire_nbytes")

    def __init__(self, step: int, frames: list[list[Any]], nbytes: int, samples: int):
        self.step = step
        self.chunks = [b"".join(f) for f in frames]
        self.heads = [len(f[0]) for f in frames]  # per chunk, the bytes before its data (a bulk frame needs it)
        self.nbytes = nbytes  # batch body
        self.samples = samples
        self.wire_nbytes = sum(len(c) for c in self.chunks)
        self.taken = 0
        self.again: list[bytes] | None = None  # the chunks of a copy (chunk 0 flagged shared)

    def copy_chunks(self) -> list[bytes]:
        """A copy's chunks over gRPC, made once per batch (two threads racing make the same bytes)."""
        if self.again is None:
            self.again = [self.chunks[0] + SHARED_SUFFIX, *self.chunks[1:]]
        return self.again

    def frames(self, copy: bool) -> list[list[Any]]:
        """The chunks as `bulk.BulkSink.send` takes them (head, data), without copying the data; a
        copy's chunk 0 gets `SHARED_SUFFIX` before its head instead of after its data (protobuf
        merges the two headers either way)."""
        out = [[memoryview(c)[:h], memoryview(c)[h:]] for c, h in zip(self.chunks, self.heads)]
        if copy:
            out[0][0] = SHARED_SUFFIX + bytes(out[0][0])
        return out


class SharedFrames:
    """A window's batch as one subscriber sends it (`sources.Frames`)."""

    __slots__ = ("batch", "copy")
    group = True

    def __init__(self, batch: WindowBatch, copy: bool):
        self.batch, self.copy = batch, copy

    step = property(lambda self: self.batch.step)
    nbytes = property(lambda self: self.batch.nbytes)
    samples = property(lambda self: self.batch.samples)

    def pieces(self) -> Iterable[Sequence[Any]]:
        return self.batch.frames(self.copy)

    def messages(self) -> Iterable[bytes]:
        return self.batch.copy_chunks() if self.copy else self.batch.chunks


class Subscriber:
    """A subscriber: one StreamBatches call of a share group, and its cursor."""

    __slots__ = ("detached", "end", "next", "producer")

    def __init__(self, start: int):
        self.next = start  # the step it sends next
        self.end: int | None = None  # the step after its last (known once its producer is)
        self.producer: Producer | None = None
        self.detached = False


class Producer:
    """One loader source of a share key, from `start`, and the window of its last batches.
    `gauge`: the server's window-bytes gauge."""

    _ids = itertools.count(1)

    def __init__(self, key: tuple, start: int, label: str, gauge: Any):
        self.id = next(self._ids)
        self.key = key
        self.label = label
        self.gauge = gauge
        self.start = start
        self.next = start  # the step it makes next
        self.end_step = 0
        self.window: collections.deque[WindowBatch] = collections.deque()
        self.window_nbytes = 0
        self.subs: set[Subscriber] = set()
        self.ready = False  # the loader is built (until then only its start can join)
        self.failed: BaseException | None = None
        self.ended = False  # makes no more batches: its loader ran to the end, or was retired
        self.retired = False  # its loader went back to the pool; its window stays
        self.closed = False
        self.producing = False
        self.blocked_since: float | None = None
        self.idle_since: float | None = None
        self.produced = 0
        self.source: Any = None  # sources.LoaderSource, from ShareHub._build until retired
        self.window_res: Any = None  # the window's Reservation
        self.payload = "raw"
        self.batch_bytes = 0

    @property
    def window_memory(self) -> int:
        """Bytes the window reserved (it never holds more)."""
        return self.window_res.nbytes if self.window_res is not None and self.window_res.held else 0

    def first(self) -> int:
        """The oldest step it can still serve."""
        return self.window[0].step if self.window else self.next

    def joinable(self, step: int) -> bool:
        if self.closed or self.failed is not None:
            return False
        if not self.ready:
            return step == self.start
        return self.first() <= step < self.next or (step == self.next and not self.ended)

    def get(self, step: int) -> WindowBatch | None:
        if self.window and self.window[0].step <= step < self.next:
            return self.window[step - self.window[0].step]
        return None

    def append(self, b: WindowBatch) -> None:
        """Step `next`, just made, into the window."""
        self.window.append(b)
        self.window_nbytes += b.wire_nbytes
        self.gauge.inc(b.wire_nbytes)
        self.next += 1
        self.produced += 1

    def evict(self) -> None:
        b = self.window.popleft()
        self.window_nbytes -= b.wire_nbytes
        self.gauge.dec(b.wire_nbytes)

    def room(self, window: int, hold_s: float, detach: Callable[[Subscriber], None]) -> bool:
        """Whether it may make its next step now: its window (of at most `window` batches) has
        room, or the oldest batch is no longer needed, or those who still need it had `hold_s` to
        take it and are detached now."""
        while len(self.window) >= window:
            oldest = self.window[0].step
            blockers = [s for s in self.subs if s.next <= oldest]
            if blockers:
                now = time.monotonic()
                if self.blocked_since is None:
                    self.blocked_since = now
                if now - self.blocked_since < hold_s:
                    return False
                for s in blockers:
                    detach(s)
            self.evict()
        self.blocked_since = None
        return True

    def wait_s(self, hold_s: float) -> float:
        """How long a subscriber waiting on it sleeps before looking again."""
        if self.blocked_since is None:
            return 0.1
        return max(0.005, min(0.1, self.blocked_since + hold_s - time.monotonic()))

    def trim(self, keep: Subscriber, detach: Callable[[Subscriber], None]) -> None:
        """A batch bigger than the estimate: older ones leave early (their waiters, but `keep`,
        detach), so the window stays within what it reserved."""
        while self.window_nbytes > self.window_memory and len(self.window) > 1:
            oldest = self.window[0].step
            for s in [s for s in self.subs if s.next <= oldest and s is not keep]:
                detach(s)
            self.evict()

    def retire(self) -> Any:
        """Its loader source, taken for the pool (the caller closes it): it makes no more steps,
        its window stays."""
        source, self.source = self.source, None
        if source is not None:
            self.ended = self.retired = True
        return source

    def drop(self) -> Any:
        """Closed: its window evicted and its reservation released; returns its loader source, if
        it still has one, for the caller to close."""
        self.closed = True
        while self.window:
            self.evict()
        if self.window_res is not None:
            self.window_res.release()
        source, self.source = self.source, None
        return source
