"""The stream loop, the only one: `serve(source, transport, meter)`.

Every StreamBatches call, whatever its source (`sources.LoaderSource`, `sources.StoredSource`,
`share.SharedSource`) and transport (`transport.GrpcFrames`, `transport.BulkFrames`), runs this
loop: at each batch boundary it checks that the server is not draining and that the call is still
on, asks the source for the next batch's frames (a loader's batch is serialized there, once, with
the samples it left out named in `BatchHeader.skipped_keys`), hands them to the transport, and
counts them (`Meter`: the Prometheus metrics and the stream_start/stream_end log events).

Lifecycle contract (what happens to the loader, the reservations and the bulk connection):

- **ok**: the source has no more batches (its epoch, `max_batches` or last block is done). The
  source is closed first: its loader, iterator closed, is parked in the server's `LoaderPool` with
  its memory reservation for the next stream of the same request (a striping client's next block);
  its stream slot and a subscriber's own reservation are released. Then the transport finishes: on
  the bulk connection the end marker, after which the connection waits for the client's next
  ticket (the client's next stream therefore finds the parked loader). The call ends with OK.
- **cancelled**: the call ended (the client cancelled, a hedged copy lost, the consumer left) or
  the bulk connection broke (`ClientGone`). As ok, the loader is parked (as usable as a `for` loop
  left with `break`); the bulk connection is closed, never reused.
- **drained**: the server is shutting down. The stream ends at this batch boundary with OK (the
  client resumes from its cursor elsewhere or after the restart); the loader is closed, not parked
  (the pool refuses loaders while the server drains); the bulk connection gets its end marker.
- **error** (the outcome is the status name, e.g. DATA_LOSS): the loader is closed and its
  reservation released; the bulk connection is closed without its end marker (the client takes the
  call's status); the exception goes on to the servicer, which maps it to the call's status.

Whatever the outcome, `source.close(outcome)`, `meter.end(outcome, ...)` and `transport.close()`
run exactly once, in that order.

Priorities (`turn`, a `priority.Turn`, or None): before each batch the loop waits for its turn
(`Turn.wait`: a paused stream waits here, at a batch boundary, sending the pause notices the
turn hands it), holds its slot while the source makes the batch (`Turn.made`), waits before
sending it while a higher level wants the server (`Turn.may_send`, notices as above; the batch is
kept meanwhile, and dropped unsent if the call or the server ends then: the client's cursor has
not passed it), reports the send's progress to the transport's hook (`Turn.progress_hook`) and
says when the batch went (`Turn.sent`); the turn is left when the stream ends, whatever the
outcome.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from gdsload.service.protocol.status import to_status
from gdsload.service.server.bulk import ClientGone
from gdsload.service.server.logs import event
from gdsload.service.server.sources import MEMORY_WAIT

#: How often a stream waiting for memory (`sources.MEMORY_WAIT`) tries again.
MEMORY_POLL_S = 0.1


class Meter:
    """One stream's metrics and log events (labelled with its source's dataset and payload)."""

    def __init__(self, metrics: Any, log: logging.Logger, source: Any, peer: str):
        self.metrics, self.log, self.source, self.peer = metrics, log, source, peer
        ds, payload = source.label, source.payload
        self.m_batches = metrics.batches.labels(ds, payload)
        self.m_samples = metrics.samples.labels(ds, payload)
        self.m_bytes = metrics.bytes.labels(ds, payload)
        self.m_read = metrics.read_s.labels(payload)
        self.m_send = metrics.send_s.labels(payload)
        self.m_shared = metrics.share_sent.labels(ds)
        self.t0 = time.perf_counter()
        self.batches = self.nbytes = 0

    def start(self) -> None:
        s = self.source
        self.metrics.consumers.labels(s.label).inc()
        self.metrics.streams.labels(s.label).inc()
        event(self.log, "stream_start", peer=self.peer, dataset=s.label, payload=s.payload, **s.log_fields(False))

    def read(self, since: float) -> None:
        self.m_read.observe(time.perf_counter() - since)

    def sent(self, frames: Any, since: float) -> None:
        self.m_send.observe(time.perf_counter() - since)
        self.batches += 1
        self.nbytes += frames.nbytes
        self.m_batches.inc()
        self.m_samples.inc(frames.samples)
        self.m_bytes.inc(frames.nbytes)
        if frames.group:
            self.m_shared.inc()

    def end(self, outcome: str) -> None:
        s, el = self.source, time.perf_counter() - self.t0
        self.metrics.consumers.labels(s.label).dec()
        event(self.log, "stream_end", peer=self.peer, dataset=s.label, outcome=outcome, batches=self.batches,
              bytes=self.nbytes, seconds=round(el, 3),
              mb_per_s=round(self.nbytes / el / 1e6, 1) if el > 0 else None, **s.log_fields(True))


def serve(source: Any, transport: Any, meter: Meter, *, draining: threading.Event,
          turn: Any = None) -> Iterator[bytes]:
    """Send `source`'s batches over `transport` until it ends, the call ends or the server drains
    (the module docstring is the contract). Yields what goes through the gRPC call."""
    outcome = "error"
    try:
        meter.start()
        try:
            outcome = yield from _loop(source, transport, meter, draining, turn)
        except (GeneratorExit, ClientGone):
            outcome = "cancelled"
            raise
        except Exception as exc:
            outcome = to_status(exc)[0].name
            raise
        finally:
            try:
                if turn is not None:
                    turn.leave()
                source.close(outcome)
            finally:
                meter.end(outcome)
        transport.finish()  # after the loader is parked: the client's next stream finds it
    except ClientGone:
        return  # the client left (or the call ended) while its batches were being written
    finally:
        transport.close()


class Notice:
    """A pause notice (`priority.Turn.wait`) as frames for the transport: one message, no batch."""

    def __init__(self, message: bytes):
        self.message = message

    def pieces(self) -> list[list[bytes]]:
        return [[self.message]]  # (the whole message is its head: it has no `data`)

    def messages(self) -> list[bytes]:
        return [self.message]


def _loop(source: Any, transport: Any, meter: Meter, draining: threading.Event, turn: Any) -> Iterator[bytes]:
    """The batches, at each boundary checking the server and the call; returns the outcome."""
    stop = lambda: draining.is_set() or not transport.active()  # noqa: E731
    pooled = getattr(source, "pooled", None)  # (a loader's source: its decodes in the server's pool)
    place = getattr(source, "place", None)  # (a loader's source: where it is in its plan)
    while True:
        if turn is None:
            if draining.is_set():
                return "drained"  # at a batch boundary: the client resumes from its cursor
            if not transport.active():
                return "cancelled"
        else:  # (its wait checks `stop` first: the same checks, once per batch)
            if place is not None:
                turn.place = place()
            got = turn.wait(stop)
            if got is False:  # the call or the server ended (neither comes back)
                return "drained" if draining.is_set() else "cancelled"
            if got is not None:  # a pause notice to send
                yield from transport.send(Notice(got))
                continue
        t_read = time.perf_counter()
        frames = None
        try:
            frames = source.next()
        finally:
            if turn is not None:
                made = frames is not None and frames is not MEMORY_WAIT
                turn.made(frames is MEMORY_WAIT, batch=made, pooled=pooled() if made and pooled else None)
        if frames is MEMORY_WAIT:  # suspended for a higher priority's memory, which is still short
            notice = turn.memory_notice()
            if notice is not None:
                yield from transport.send(Notice(notice))
            draining.wait(MEMORY_POLL_S)
            continue
        if frames is None:
            return "drained" if draining.is_set() else "ok" if transport.active() else "cancelled"
        meter.read(t_read)
        progress = None
        if turn is not None:
            while (got := turn.may_send(stop)) is not None:
                if got is False:  # (the batch goes unsent: the client's cursor is before it)
                    return "drained" if draining.is_set() else "cancelled"
                yield from transport.send(Notice(got))
            progress = turn.progress_hook()
        t_send = time.perf_counter()
        yield from transport.send(frames, progress)  # from the batch's memory, before the loader reuses it
        meter.sent(frames, t_send)
        if turn is not None:
            turn.sent()
