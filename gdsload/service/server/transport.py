"""How a stream's batches travel: inside the gRPC call (`GrpcFrames`) or on the bulk connection
(`BulkFrames`, over a `bulk.BulkSink`), behind one interface: `send(frames, progress=None)` (an iterable of what
the call yields: gRPC messages, or nothing when the bytes went on the bulk connection; `progress`,
when given, is called as the bytes move: per message in gRPC, per member on the bulk connection,
where it is also called with True when the connection is full: the send waits for its client),
`finish()` (the stream ended cleanly), `close()` (always, last), `active()` (the call is still on).

`open_transport` is a generator (it yields the bulk offer through the call, then waits for the
client's connection) that returns the transport, or None when the call ended meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

from gdsload.service.protocol.framing import WAIT_S as BULK_WAIT_S
from gdsload.service.protocol.framing import offer_message
from gdsload.service.protocol.status import Unavailable
from gdsload.v1 import feed_pb2 as pb


class GrpcFrames:
    """Batches inside the gRPC call: each chunk one message, already serialized (the call's
    response serializer is the identity)."""

    bulk = False

    def __init__(self, context: Any):
        self.context = context

    def active(self) -> bool:
        return self.context.is_active()

    def send(self, frames: Any, progress: Callable[..., None] | None = None) -> Iterable[bytes]:
        if progress is None:
            return frames.messages()
        return _progressing(frames.messages(), progress)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class BulkFrames:
    """Batches on the bulk connection (`bulk.BulkSink`): written straight from the batch's
    buffers (and stored members with `sendfile`) before `send` returns, so the loader may reuse
    them after; `finish` writes the end marker and gives the connection back for the client's
    next stream; `close` without it cuts the connection (the client takes the call's status)."""

    bulk = True

    def __init__(self, sink: Any, context: Any):
        self.sink = sink
        self.context = context

    def active(self) -> bool:
        return self.context.is_active()

    def send(self, frames: Any, progress: Callable[..., None] | None = None) -> Iterable[bytes]:
        self.sink.send(frames.pieces(), progress)  # raises bulk.ClientGone when the connection broke
        return ()

    def full(self) -> bool:
        """Whether the connection takes no bytes now (the client reads none: `priority`'s rule 1)."""
        return self.sink.full()

    def finish(self) -> None:
        self.sink.finish()

    def close(self) -> None:
        self.sink.close()


def _progressing(messages: Iterable[bytes], progress: Callable[[], None]) -> Iterator[bytes]:
    for m in messages:
        progress()
        yield m


def open_transport(req: pb.BatchRequest, context: Any, listener: Any,
                   metrics: Any) -> Generator[bytes, None, GrpcFrames | BulkFrames | None]:
    """The transport of one call: the bulk connection when the request asks for it and the server
    offers it (`listener`, a `bulk.BulkListener`, else None), else gRPC. Offering it yields the
    offer message; the client then connects with its ticket within `WAIT_S`, or the stream fails
    with UNAVAILABLE (None: the call ended first)."""
    if not (req.bulk and listener is not None):
        return GrpcFrames(context)
    ticket, slot = listener.expect()
    try:
        yield offer_message(ticket, listener.port)
    except GeneratorExit:  # the call ended before the client connected
        listener.withdraw(ticket)
        raise
    sink = listener.connection(ticket, slot, cancelled=lambda: not context.is_active())
    if sink is None:
        if not context.is_active():
            return None
        raise Unavailable(f"the client did not open the bulk connection within {BULK_WAIT_S:g} s "
                          "(a firewall between it and the server's bulk port?)")
    metrics.bulk_streams.inc()
    if not context.add_callback(sink.shutdown):  # a call that ends breaks a blocked write
        sink.shutdown()
    return BulkFrames(sink, context)
