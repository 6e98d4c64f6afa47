"""What both receivers of a `RemoteLoader` pass share: the items of their queue (`Delivery`,
`END`, `Failed`), their base (`Receiver`: the queue of at most `prefetch` items, `stop`, `put`,
`cancel`) and the reading of one stream's messages into whole batches (`read_batches`).

A receiver runs in its own thread(s) and holds the link, a request template and its queue, never
the loader nor the pass: those stay collectable while it waits, and their finalizer calls `cancel`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gdsload.service.protocol import status, wire
from gdsload.v1 import feed_pb2 as pb

#: How long a receiver's thread waits for room in the queue before it looks at `stop` again.
PUT_POLL_S = 0.1
#: A pass opened ahead (`RemoteLoader(prefetch_next_epoch=True)`) that waited this long with its
#: queue full and no `iter()` took it over cancels itself, so that servers do not hold its streams
#: while the loop does something else (a validation loop); that `iter()` then opens a new pass.
AHEAD_IDLE_S = 10.0


@dataclass(frozen=True)
class Delivery:
    """One batch for the pass: `position` is the global position after it in its epoch, `nbytes`
    its body's bytes, `shared` whether a server sent it as a copy of a share group's batch."""

    batch: dict[str, Any]
    position: int
    nbytes: int
    shared: bool


@dataclass(frozen=True)
class Failed:
    """The pass ends with `error` (raised to the training loop)."""

    error: BaseException


class _End:
    def __repr__(self) -> str:
        return "END"


END = _End()  # the pass ran to its end


class Receiver:
    """The receiving half of one pass (subclasses: `single.SingleReceiver`,
    `stripe.receiver.StripedReceiver`). `run` is its thread; `cancel` may run in a finalizer."""

    def __init__(self, link: Any, template: pb.BatchRequest, *, epoch: int, global_batch: int, prefetch: int,
                 stages: Any = None):
        self.link = link  # link.Link
        self.template = template
        self.epoch = epoch
        self.G = global_batch
        self.stages = stages  # the loader's StageTimes: "receive" is timed here
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.pid = os.getpid()  # its threads and calls exist in this process only
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.failed = False  # a `Failed` item was queued: the pass ends with it
        self.opened_at = time.monotonic()
        self.first_at: float | None = None  # when its first batch was queued
        self.ahead = False  # opened ahead and not taken over yet (`claim`): it may expire
        self._claim = threading.Lock()

    def claim(self) -> bool:
        """A pass takes this receiver opened ahead over: False if it expired, failed or was
        cancelled first (then it is of no use)."""
        with self._claim:
            self.ahead = False
            return not self.stop.is_set() and not self.failed

    def _expired(self, since: float) -> bool:
        """Opened ahead, its queue full since `since` for `AHEAD_IDLE_S`: cancel it (True)."""
        if not self.ahead or time.monotonic() - since < AHEAD_IDLE_S:
            return False
        with self._claim:
            if not self.ahead:
                return False
            self.failed = True
            self.cancel()
            return True

    def start(self) -> threading.Thread:
        """Start `run` in its thread (once); the thread."""
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="gdsload-remote", daemon=True)
            self.thread.start()
        return self.thread

    def run(self) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        """Stop the thread(s) and cancel the calls in flight; never blocks (safe in a finalizer)."""
        if os.getpid() != self.pid:  # a forked child: the threads, calls and their locks are the parent's
            return
        self.stop.set()
        self.cancel_calls()

    def cancel_calls(self) -> None:
        raise NotImplementedError

    def watchdog(self) -> None:
        """Called by the pass while it waits for an item (the striped receiver watches itself)."""

    def charge_wait(self, seconds: float) -> None:
        """The training loop waited `seconds` for an item (charged to the server it waited on)."""

    def put(self, item: Any, on_full: Callable[[], None] | None = None) -> bool:
        """Queue `item` unless `stop` is set first (False then); `on_full` runs while it waits."""
        self.failed = self.failed or isinstance(item, Failed)
        if self.first_at is None and isinstance(item, Delivery):
            self.first_at = time.monotonic()
        since = time.monotonic()
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=PUT_POLL_S)
                return True
            except queue.Full:
                if self._expired(since):
                    return False
                if on_full is not None:
                    on_full()
        return False

    def request(self, position: int) -> pb.BatchRequest:
        """The template asking from global `position` (a copy)."""
        req = pb.BatchRequest()
        req.CopyFrom(self.template)
        req.start_position = position
        return req


def read_batches(call: Any, bodies: Any, stages: Any, waiting: Callable[[float | None], None],
                 paused: Callable[[pb.StreamPause], None] | None = None,
                 ) -> Iterator[tuple[pb.BatchChunk, dict[str, Any], bool]]:
    """The whole batches of one stream, as `(last chunk, batch, shared)`. `waiting(t)` is called
    with the clock before each message is awaited and with None once it came; the time from
    there to the batch's chunk assembled is "receive" (`stages`). A pause notice (a message with
    only `BatchChunk.pause`: the server holds the stream back for higher-priority work) goes to
    `paused` and is no batch (without `paused`, it is dropped). A batch that fails its CRC32
    check (`status.CorruptCopy`, handled as its server's DATA_LOSS) cancels the call first: the
    server would go on sending."""
    asm = wire.ChunkAssembler(bodies)
    it = iter(call)
    shared = False
    while True:
        t0 = time.perf_counter()
        waiting(time.monotonic())
        try:
            chunk, data = next(it)
        except StopIteration:
            return
        finally:
            waiting(None)
        if chunk.chunk_index == 0:  # a share group's copy (BatchHeader.shared)
            if not chunk.HasField("header") and chunk.HasField("pause"):
                if paused is not None:
                    paused(chunk.pause)
                continue
            shared = chunk.header.shared
        try:
            batch = asm.add(chunk, data)
        except status.CorruptCopy:
            call.cancel()
            raise
        if stages is not None:
            stages.add("receive", time.perf_counter() - t0)
        if batch is not None:
            yield chunk, batch, shared


def check_position(chunk: pb.BatchChunk, epoch: int, expected: int) -> None:
    """A batch must be the one asked for next: `ProtocolError` otherwise."""
    if chunk.epoch != epoch or chunk.position != expected:
        raise wire.ProtocolError(f"got the batch of epoch {chunk.epoch} ending at position {chunk.position}, "
                                 f"expected epoch {epoch} position {expected}")
