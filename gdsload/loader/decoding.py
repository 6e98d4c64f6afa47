"""Decode turns: the loader's reader threads run its one DALI pipeline strictly in batch order.

Batch `seq` owns turns `seq * per_batch ... (seq + 1) * per_batch - 1`, one per image field.
`take(turn)` waits until every earlier turn is over, runs the caller's decode, then ends the
turn; the condition's lock is held only to wait and to move on, never through the decode (a
thread that held it through a DALI run stalled every other reader that wanted to give up its
turns, and with them the batches those readers had ready). A batch that failed before or
between its decodes gives up the turns it did not take (`skip_batch`), so later batches go on.
`close()` wakes every waiter: `take` then raises `RingClosed`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gdsload.errors import RingClosed


class DecodeTurns:
    def __init__(self, per_batch: int):
        self.per_batch = per_batch
        self._next = 0  # the turn that may run now
        self._closed = False
        self._cv = threading.Condition()

    @contextmanager
    def take(self, turn: int) -> Iterator[None]:
        """Run the body as turn `turn`, after every earlier one."""
        with self._cv:
            while self._next != turn and not self._closed:
                self._cv.wait()
            if self._closed:
                raise RingClosed("loader closed")
        try:
            yield
        finally:
            with self._cv:
                self._next += 1
                self._cv.notify_all()

    def skip_batch(self, seq: int) -> None:
        """Give up batch `seq`'s turns not taken yet (after the earlier batches' turns)."""
        first, end = seq * self.per_batch, (seq + 1) * self.per_batch
        with self._cv:
            while self._next < first and not self._closed:
                self._cv.wait()
            if first <= self._next < end:
                self._next = end
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class SettledField:
    """Slot field `name` as the decoder's `dst`, for a slot handed out before the consumer's loop
    variable let go of its last batch (`gdsload.ring.ring`, "Slot lifetime": `acquire(defer=True)`):
    the decoder's first slice of it (`ImageDecoder.decode_into`, after its DALI run, before the copy
    out) settles the slot, so the run overlaps the consumer taking the batch before. Only the
    loader's own `ImageDecoder`, which does nothing with `dst` but slice it and copy into the slice,
    gets one (a `decoder_factory`'s decoder gets the field itself, settled first)."""

    __slots__ = ("slot", "name")

    def __init__(self, slot: Any, name: str):
        self.slot = slot
        self.name = name

    def __getitem__(self, key: Any) -> Any:
        self.slot.settle()
        return self.slot.buffers[self.name][key]


class OrderedDecoder:
    """The loader's one image decoder (`Resources.decoder`, one DALI pipeline) run in batch order.

    One pipeline with all cores as DALI threads beats one per reader: the batch the consumer needs
    next gets every core (time to first batch), and its memory is paid once. The decoded run is
    copied out inside the turn, since the next run reuses DALI's buffers."""

    def __init__(self, resources: Any, per_batch: int, times: Any = None):
        self.resources = resources
        self.turns = DecodeTurns(per_batch)
        self.times = times

    def decode(self, turn: int, encoded: list, names: list[str], dst: Any) -> list[int]:
        """Decode `encoded` into `dst` as turn `turn`; the rows kept (corrupt ones skipped)."""
        with self.turns.take(turn):
            t0 = time.perf_counter()
            streams = self.resources.streams
            kept = self.resources.decoder.decode_into(
                encoded, names, dst, stream=streams.stream_handle if streams else None)
            if self.times is not None:
                self.times.add("decode", time.perf_counter() - t0)
            return kept

    def skip_batch(self, seq: int) -> None:
        self.turns.skip_batch(seq)

    def close(self) -> None:
        self.turns.close()
