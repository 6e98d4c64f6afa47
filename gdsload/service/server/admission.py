"""The server's one memory budget and its open streams: `Budget.reserve(nbytes, what) -> Reservation`.

Every byte a stream, a share group's producer or window, or a parked loader may hold is reserved
here before it is allocated, against `Limits.max_memory_bytes` (`--max-memory`); `Budget.reserved`
is the only counter of reserved bytes on the server. A reservation larger than the whole budget is
refused with `OverLimit` (RESOURCE_EXHAUSTED: it can never fit); one that does not fit next to the
others is refused with `Unavailable` (UNAVAILABLE: its client retries later or elsewhere), after
the budget asked its room makers (`on_short`: the loader pool's parked loaders, the share groups'
idle windows) to give back what they can. A server that is shutting down (`draining`) refuses
everything with UNAVAILABLE. `Budget.stream()` counts one open stream against `Limits.max_streams`
the same way (0 bytes; "at capacity" is UNAVAILABLE).

A `Reservation` is released exactly once (`release()`, or leaving its `with` block), whatever
happened; `hand_over()` moves its bytes to a new owner (a stream's loader going into the pool
keeps its reservation, so the next stream of the request does not reserve again). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gdsload.service.protocol.status import OverLimit, Unavailable

DRAINING = "the server is shutting down; retry on another server or after the restart"


@dataclass(frozen=True)
class Claim:
    """What asks for memory (`name`) and how its refusals say so: `over` (more than the whole
    budget) and `busy` (does not fit now), format strings over `n` (bytes asked), `limit`,
    `reserved` and `streams`."""

    name: str
    over: str
    busy: str


def stream_claim(slots: int) -> Claim:
    """A stream (or a share group's subscriber) whose loader has a ring of `slots` batches."""
    return Claim(
        "a stream",
        over=("a stream of this request holds up to {n} bytes (ring of %d batches and buffers), over the "
              "server's memory budget of {limit} bytes (--max-memory); lower batch_size" % slots),
        busy=("the server's memory budget is in use ({reserved} of {limit} bytes held by {streams} streams, "
              "this one needs {n}); retry later or on another server"))


PRODUCER = Claim(
    "a shared producer",
    over=("a shared producer of this request holds up to {n} bytes (its loader and window of batches), over "
          "the server's memory budget of {limit} bytes (--max-memory); lower batch_size or gdsload serve "
          "--share-window"),
    busy=("the server's memory budget is in use ({reserved} of {limit} bytes held by {streams} streams), "
          "a shared producer needs {n}; retry later or on another server"))


class Reservation:
    """Bytes of the budget (and, for a stream's, one of its streams) held until `release()`."""

    __slots__ = ("_budget", "nbytes", "stream", "what")

    def __init__(self, budget: Budget | None, nbytes: int, what: str, stream: bool = False):
        self._budget = budget
        self.nbytes = nbytes
        self.what = what
        self.stream = stream

    def release(self) -> None:
        """Give the bytes (and the stream) back; later calls do nothing."""
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.give_back(self.nbytes, self.stream)

    def hand_over(self) -> Reservation:
        """A new reservation of the same bytes, for another owner; this one then holds nothing
        (releasing it, or leaving its `with` block, gives nothing back)."""
        budget, self._budget = self._budget, None
        return Reservation(budget, self.nbytes, self.what, self.stream)

    @property
    def held(self) -> bool:
        return self._budget is not None

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Reservation({self.nbytes} bytes of {self.what}{', a stream' if self.stream else ''})"


class Budget:
    """`limit_bytes` for everything the server holds, `max_streams` open streams."""

    def __init__(self, limit_bytes: int, max_streams: int, draining: threading.Event | None = None):
        self.limit = limit_bytes
        self.max_streams = max_streams
        self.draining = draining if draining is not None else threading.Event()
        self._cv = threading.Condition()
        self._reserved = 0
        self._streams = 0
        self._room: list[Callable[[int], object]] = []

    def on_short(self, make_room: Callable[[int], object]) -> None:
        """Call `make_room(need)` (in the order given) when `need` more bytes do not fit; each may
        release reservations it holds (parked loaders, idle share windows)."""
        self._room.append(make_room)

    @property
    def reserved(self) -> int:
        """Bytes reserved now (by streams, producers, windows and parked loaders)."""
        return self._reserved

    @property
    def streams(self) -> int:
        """Streams open now."""
        return self._streams

    def reserve(self, nbytes: int, what: Claim, *, held: int = 0) -> Reservation:
        """Reserve `nbytes`, or refuse: RESOURCE_EXHAUSTED when `nbytes + held` (`held`: what the
        same holder reserved already, e.g. a producer's loader beside its window) is over the whole
        budget, UNAVAILABLE when draining or when it does not fit next to the others."""
        whole = nbytes + held
        if self._reserved + nbytes > self.limit:
            for make_room in self._room:
                if self._reserved + nbytes <= self.limit:
                    break
                make_room(nbytes)
        if whole > self.limit:
            raise OverLimit(what.over.format(n=whole, limit=self.limit))
        if self.draining.is_set():
            raise Unavailable(DRAINING)
        with self._cv:
            if self._reserved + nbytes > self.limit:
                raise Unavailable(what.busy.format(n=nbytes, limit=self.limit, reserved=self._reserved,
                                                   streams=self._streams))
            self._reserved += nbytes
        return Reservation(self, nbytes, what.name)

    def stream(self) -> Reservation:
        """Count one open stream (0 bytes), or refuse with UNAVAILABLE: draining, or at capacity."""
        if self.draining.is_set():
            raise Unavailable(DRAINING)
        with self._cv:
            if self._streams >= self.max_streams:
                raise Unavailable(f"the server is at capacity ({self.max_streams} streams); retry later")
            self._streams += 1
        return Reservation(self, 0, "a stream", stream=True)

    def give_back(self, nbytes: int, stream: bool = False) -> None:
        """(`Reservation.release`) return `nbytes` and, for a stream's, the stream."""
        with self._cv:
            self._reserved -= nbytes
            self._streams -= stream
            self._cv.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no stream is open (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._streams:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True
