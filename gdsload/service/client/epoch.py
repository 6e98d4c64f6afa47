"""`RemoteEpoch`: one pass of a `RemoteLoader`, the iterator the training loop holds.

The remote twin of `gdsload.loader.epoch.Epoch`, composed the same way and given what it uses:
the loader's `Cursor` (it registers with `begin` and moves it with `advance` / `end` exactly as
`Epoch` does, so `set_epoch` during a live pass applies to the next `iter()` and
`load_state_dict` stops this pass: `gdsload.frontend.cursor`), a receiver opened at the cursor's
(epoch, position) (`single.SingleReceiver` or `stripe.receiver.StripedReceiver`), the output
conversion and the loader's counters (`Tally`). `__next__` takes the receiver's next queue item
(`receive.Delivery`, `END` or `Failed`) and hands the converted batch out.

Lifetime: the receiver's threads hold their link and queue, never this pass nor the loader, and
the cursor refers to the pass weakly. A pass (or its loader) dropped mid-epoch is collected, and
its finalizer cancels the receiver's calls at once.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from gdsload.errors import PassStopped
from gdsload.frontend.stages import StageTimes
from gdsload.service.client.receive import END, Delivery, Receiver
from gdsload.service.protocol import status

#: The stages of `RemoteLoader.stats()["stages"]` (the shape of `DataLoader.stats()["stages"]`).
STAGES = ("receive", "map", "wait")
#: How long `__next__` waits for an item before it runs the receiver's watchdog and checks that
#: the receiving thread is alive.
GET_POLL_S = 0.25
#: How long closing a pass waits for its receiving thread to end.
JOIN_S = 10.0
#: The next epoch's pass is opened when this pass's remaining steps, at the rate the loop took
#: them so far, would last this many times a new pass's set-up (`Tally.setup_s`: the last pass
#: opened at its `iter()`, from its receiver's start to its first batch queued): a new pass costs
#: every server a request, its loader's set-up and a first batch before anything comes (0.3-0.5 s
#: at a twentieth of a core: 10 steps of a raw training loop; bench/priority_bench.py). Opened
#: earlier, it took the servers from this epoch's last blocks (seen: half an epoch early, when an
#: opened-ahead pass's own set-up, slowed by the epoch beside it, was taken for a new pass's).
AHEAD_SETUPS = 2.0


class Tally:
    """What `RemoteLoader.stats()` counts of its passes in this process: batches, bytes,
    shared_batches, wait_s, and the stage times (`gdsload.frontend.stages.StageTimes`)."""

    def __init__(self) -> None:
        self.counts: dict[str, Any] = {"batches": 0, "bytes": 0, "wait_s": 0.0, "shared_batches": 0}
        self.stages = StageTimes(STAGES)
        self.span: list[float] = []  # [clock, wait_s] at the first batch, the clock at the last
        # what the last pass opened at its iter() took from its receiver's start to its first
        # batch (a pass opened ahead says nothing of it: it ran beside the epoch before it)
        self.setup_s: float | None = None

    def servers_needed(self, servers: int) -> int | None:
        """`servers` (in use) scaled by the loop's time over its time not waiting since its first
        batch: the servers that would have fed it without a stall at their observed rate (None
        before two batches; `servers` when it never waited: fewer may do, it cannot tell)."""
        if not self.span or not self.span[2]:
            return None
        took = self.span[2] - self.span[0]
        stall = min(took, max(0.0, self.counts["wait_s"] - self.span[1]))
        return max(1, min(100 * servers, math.ceil(servers * took / max(took - stall, 1e-3 * took, 1e-9))))

    def waited(self, seconds: float) -> None:
        self.counts["wait_s"] += seconds
        self.stages.add("wait", seconds)

    def delivered(self, d: Delivery) -> None:
        self.counts["batches"] += 1
        if self.span:
            self.span[2] = time.monotonic()
        else:
            self.span = [time.monotonic(), self.counts["wait_s"], 0.0]
        self.counts["shared_batches"] += bool(d.shared)
        self.counts["bytes"] += d.nbytes


class RemoteEpoch:
    """One pass. `open_receiver(epoch, position)` makes the pass's receiver once the cursor said
    where the pass starts; `convert(batch)` is the batch as handed out; `restart()` is a new pass
    of the loader (for this iterator used in a forked child); `end`: the epoch's end position
    (`Plan.end_position`): the batch that reaches it is the epoch's last, and handing it out moves
    the cursor to (next epoch, 0), as the local `Epoch` does (`gdsload.frontend.cursor`).

    `ahead(epoch)` (optional) opens the pass of `epoch` from its start before it is asked for:
    called once in this epoch's tail (`AHEAD_SETUPS`, and at the latest with its last batch), so
    the loop's next `iter()`, which starts there (the cursor moved), finds its first batches on
    the way (the loader's `_open_receiver` adopts that receiver)."""

    def __init__(self, open_receiver: Callable[[int, int], Receiver], cursor: Any, convert: Callable[[Any], Any],
                 tally: Tally, restart: Callable[[], Any], *, end: int,
                 ahead: Callable[[int], None] | None = None):
        self.cursor = cursor
        self.end = end
        self._ahead = ahead
        self._began, self._handed = time.monotonic(), 0  # the pass's pace: batches handed out since
        self._open_receiver = open_receiver  # again from a new position: `skip_to`
        self.convert = convert
        self.tally = tally
        self._restart = restart
        self.pid = os.getpid()  # the receiver's threads and calls exist in this process only
        self._successor: Any = None
        self._done = True  # until the receiver starts: `close()` has nothing to stop
        self._stopped_by: str | None = None  # `stop(why)`: the loader's call that ended this pass
        self.epoch, position = cursor.begin(self)  # the live pass (gdsload.frontend.cursor)
        try:
            self._start(open_receiver(self.epoch, position))
        except BaseException:
            cursor.detach(self)
            raise

    def _start(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self._done = False
        self._finalizer = weakref.finalize(self, receiver.cancel)
        self._cold = receiver.thread is None  # (not opened ahead: its set-up is a new pass's)
        self.thread = receiver.start()

    def __iter__(self) -> RemoteEpoch:
        return self

    def __next__(self) -> Any:
        if self.pid != os.getpid():
            return self._next_in_forked_child()
        if self._done:
            if self._stopped_by is not None:
                raise PassStopped(f"this pass was stopped by the loader's {self._stopped_by}: call "
                                  "iter(loader) again for the pass it set up")
            raise StopIteration
        t0 = time.perf_counter()
        item = self._get()
        waited = time.perf_counter() - t0
        self.tally.waited(waited)
        self.receiver.charge_wait(waited)  # (striped: the receiver charges the servers it waits on)
        if isinstance(item, Delivery):
            if item.position >= self.end:  # the epoch's last batch completes it, StopIteration asked or not
                self.cursor.advance(self, self.epoch + 1, 0)  # (Lightning and HF's Trainer take len() batches)
            else:
                self.cursor.advance(self, self.epoch, item.position)
            self.tally.delivered(item)
            if self._ahead is not None:
                self._look_ahead(item.position)
            return self.convert(item.batch)
        if item is END:
            self.cursor.end(self, self.epoch)  # the next pass is the next epoch
            self.close()
            raise StopIteration
        self.close()
        raise item.error

    def _look_ahead(self, position: int) -> None:
        """Open the next epoch's pass when this one's remaining steps are few (see `ahead`)."""
        self._handed += 1
        now, rx, tally = time.monotonic(), self.receiver, self.tally
        if self._handed == 1 and (self._cold or tally.setup_s is None):
            tally.setup_s = (rx.first_at or now) - rx.opened_at
        left = (self.end - position) // rx.G
        if left > rx.queue.maxsize and left * (now - self._began) > AHEAD_SETUPS * tally.setup_s * self._handed:
            return  # (left steps at the pass's pace so far outlast AHEAD_SETUPS set-ups)
        ahead, self._ahead = self._ahead, None
        ahead(self.epoch + 1)

    def _get(self) -> Any:
        rx = self.receiver
        while True:
            try:
                return rx.queue.get(timeout=GET_POLL_S)
            except queue.Empty:
                rx.watchdog()
                if not self.thread.is_alive() and rx.queue.empty():
                    self.close()
                    raise status.RemoteError("the receiver thread ended without a result", code="INTERNAL") from None

    def _next_in_forked_child(self) -> Any:
        """The parent's iterator, used in a forked child: its receiver thread is not here and its
        queue's lock may be held, so continue with a new pass of the child's copy of the loader,
        which starts at the loader's cursor (the batch after the last one handed out)."""
        if self._successor is None:
            if self._done:
                raise StopIteration
            self._done = True
            self._successor = self._restart()
        return next(self._successor)

    def __reduce__(self):
        raise TypeError("a gdsload.RemoteLoader iterator cannot be pickled: pickle the loader itself, whose copy "
                        "continues from the loader's state_dict()")

    def stop(self, why: str) -> None:
        """`load_state_dict()` or `set_epoch()` while this pass is live (`gdsload.frontend.cursor`):
        cancel its stream now and make a later `next()` say why."""
        if not self._done:
            self._stopped_by = why
        self.close()

    def skip_to(self, position: int | None) -> None:
        """The loader's `skip()` moved the cursor to global `position` of this pass's epoch (None:
        to its end; `gdsload.frontend.cursor`): the receiver is cancelled, the batches it received
        ahead are dropped with its queue, and a new receiver asks from `position` (the request's
        `start_position`), so the servers read none of the skipped steps. The training loop's `for`
        goes on over this same iterator. None: the pass closes; its next `next()` raises
        StopIteration."""
        if self._done or self.pid != os.getpid():  # (a forked child's copy restarts from the cursor)
            return
        if position is None:
            self.close()
            return
        self._halt()
        try:
            self._start(self._open_receiver(self.epoch, position))
        except BaseException:
            self.cursor.detach(self)
            raise

    def close(self) -> None:
        if self._done:
            return
        self._halt()
        self.cursor.detach(self)

    def _halt(self) -> None:
        """Cancel the receiver's calls and wait for its thread; the cursor is not told."""
        self._done = True
        self._finalizer()  # cancels the calls (the parent's are left alone in a forked child)
        if os.getpid() == self.pid and self.thread is not threading.current_thread():
            self.thread.join(timeout=JOIN_S)
