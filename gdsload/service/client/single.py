"""`SingleReceiver`: the receiving half of one pass over one server at a time, failing over.

Its thread streams from the link's address in use, assembles batches and queues them (at most
`prefetch`), resuming after each failure from the position after the last complete batch: a
broken stream that had delivered batches is asked again at once, same address; one that failed
before its first batch counts against the retry budget, marks the address down and moves to the
next one after a backoff. An address that answered DATA_LOSS is not asked again until a batch
arrives, and is final once every address answered it. A stream silent for `deadline_s` is
cancelled by `watchdog` (the pass calls it while it waits) and resumed.

Not a `Schedule` of one server: an unstriped loader asks one stream per epoch (or per
`batches_per_stream`) of its address in use, with no probes and no blocks, and fails over through
its list of addresses in order; a schedule of one would change what it asks of a server.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import grpc

from gdsload.service.client.link import Attempts, EndedEarly, Link
from gdsload.service.client.receive import END, Delivery, Failed, Receiver, check_position, read_batches
from gdsload.service.client.stripe.states import ServerState
from gdsload.service.protocol import status, wire
from gdsload.v1 import feed_pb2 as pb

_STOP = "stop"  # the pass is over (stopped, or its error queued)
_AGAIN = "again"  # ask the next address now (this one answered DATA_LOSS)


class SingleReceiver(Receiver):
    """One pass's batches from `position` to `end` (global positions), one address at a time."""

    def __init__(self, link: Link, template: pb.BatchRequest, *, epoch: int, position: int, global_batch: int,
                 end: int, prefetch: int, stages: Any = None):
        super().__init__(link, template, epoch=epoch, global_batch=global_batch, prefetch=prefetch, stages=stages)
        self.end = end
        self.next_request = position
        self.last_error = "no attempt"
        self.progressed = False  # the stream in flight delivered a batch
        self._call_lock = threading.Lock()
        self._call: Any = None
        self._waiting_since: float | None = None
        self._idle_cancelled = False
        self._paused_since: float | None = None  # the stream in flight is paused (BatchChunk.pause)

    def cancel_calls(self) -> None:
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()

    def watchdog(self) -> None:
        """Cancel a stream that sent nothing for `deadline_s` (it is then resumed); a paused one
        (`BatchChunk.pause`: its server tells it so every second) is slower, not silent."""
        since = self._waiting_since
        if since is not None and self._paused_since is None and time.monotonic() - since > self.link.deadline_s:
            with self._call_lock:
                if self._call is not None and self._waiting_since is not None:
                    self._idle_cancelled = True
                    self._call.cancel()

    def charge_wait(self, seconds: float) -> None:
        self.link.bump(self.link.address(), wait_s=seconds)

    def _waiting(self, since: float | None) -> None:
        self._waiting_since = since

    def run(self) -> None:
        try:
            attempts, corrupt = Attempts(self.link), set()
            while self.next_request < self.end and not self.stop.is_set():
                address = self.link.address()
                outcome = self._attempt(address, attempts, corrupt)
                if outcome is _STOP:
                    return
                if outcome is not _AGAIN and not self._after(address, attempts):
                    return
            if not self.stop.is_set():
                self.put(END)
        except BaseException as exc:  # a bug: hand it to the consumer instead of hanging it
            self.put(Failed(exc))

    def _attempt(self, address: str, attempts: Attempts, corrupt: set[str]) -> str | None:
        """One stream from `address`; `_STOP`, `_AGAIN` or None (see `_after`)."""
        self.progressed = False
        try:
            return self._stream(address, attempts, corrupt)
        except grpc.RpcError as err:
            return self._rpc_failed(err, address, attempts, corrupt)
        except (EndedEarly, wire.ProtocolError) as exc:
            self.last_error = str(exc)
            attempts.fail()
            return None
        finally:
            with self._call_lock:
                self._call = None
            self._resumed(address)
            self.link.mark(address, in_flight=0)

    def _stream(self, address: str, attempts: Attempts, corrupt: set[str]) -> str | None:
        link = self.link
        call = link.channels.stub(address).StreamBatches(
            self.request(self.next_request), timeout=link.stream_deadline_s, metadata=link.metadata)
        with self._call_lock:
            self._call = call
        if self.stop.is_set():
            call.cancel()
            return _STOP
        link.mark(address, state=ServerState.OK.value, in_flight=(self.end - self.next_request) // self.G)
        paused = functools.partial(self._paused, address)
        for chunk, batch, shared in read_batches(call, link.channels.bodies, self.stages, self._waiting, paused):
            self._resumed(address)
            expected = self.next_request + self.G
            check_position(chunk, self.epoch, expected)
            nbytes = wire.body_nbytes(batch)
            if not self.put(Delivery(batch, expected, nbytes, shared)):
                return _STOP
            link.bump(address, batches=1, bytes=nbytes)
            self.next_request = expected
            self.progressed = True
            attempts.reset()
            corrupt.clear()
        if self.next_request < self.end and not self.progressed:
            raise EndedEarly(f"{address} ended the stream without a batch (draining?)")
        return None

    def _paused(self, address: str, notice: pb.StreamPause) -> None:
        """The server holds the stream back for higher-priority work: a slower stream, not a
        failure (each notice is a message: the watchdog sees a live stream)."""
        if self._paused_since is None:
            self._paused_since = time.monotonic()
            self.link.bump(address, pauses=1)
        self.link.mark(address, state=ServerState.PAUSED.value, paused_reason=notice.reason, paused_at=time.time())

    def _resumed(self, address: str) -> None:
        since, self._paused_since = self._paused_since, None
        if since is not None:
            self.link.bump(address, paused_s=time.monotonic() - since)
            self.link.mark(address, state=ServerState.OK.value)

    def _rpc_failed(self, err: grpc.RpcError, address: str, attempts: Attempts, corrupt: set[str]) -> str | None:
        if self.stop.is_set():
            return _STOP
        link = self.link
        idle, self._idle_cancelled = self._idle_cancelled, False
        if not idle and status.is_elsewhere(err):
            # This server's copy is corrupt: ask each other address once, not this one again.
            corrupt.add(address)
            link.bump(address, failures=1)
            if corrupt.issuperset(link.addresses):
                self.put(Failed(link.corrupt_everywhere(err, address)))
                return _STOP
            link.failover(address)
            return _AGAIN
        if not idle and not status.is_retryable(err):
            self.put(Failed(status.from_rpc_error(err, address)))
            return _STOP
        self.last_error = (f"no message for {link.deadline_s} s from {address}" if idle
                           else str(status.from_rpc_error(err, address)))
        attempts.fail()
        return None

    def _after(self, address: str, attempts: Attempts) -> bool:
        """After a stream: a failure before any batch backs off and fails over (or gives up: False),
        one after some batches retries at once, same address."""
        link = self.link
        if not attempts.failures:
            return True
        link.bump(address, failures=1)
        if not self.progressed:
            link.mark(address, state=ServerState.DOWN.value)
            if attempts.spent():
                self.put(Failed(link.gave_up(attempts, self.last_error, address, resume=True)))
                return False
            link.failover(address)
            return not self.stop.wait(attempts.delay())
        attempts.reset()  # broke after some batches: retry at once, same address
        link.reconnect()
        return True
