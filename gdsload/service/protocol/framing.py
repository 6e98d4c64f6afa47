"""The bulk connection's protocol: a stream's batch bytes on a plain socket beside its gRPC call.

This module holds what both ends agree on (the ticket, the frame, the constants); the server's end
is `gdsload.service.server.bulk` (`BulkListener`, `BulkSink`), the client's
`gdsload.service.client.loader.bulk` (`BulkCall`, `IdleConnections`).

Why: gRPC Python sends each message through a copy into a gRPC slice, HTTP/2 framing and
flow-control window updates, and hand-offs between the calling thread and gRPC's event engine;
on the wire benchmark that cost the server ~0.9 CPU-s/GB where `sendall` of the same bytes costs
~0.25. A RemoteLoader therefore asks for `BatchRequest.bulk`, and a server that offers it answers
with one message, `BatchChunk{bulk: BulkOffer{ticket, port}}`; the client writes the 16-byte
ticket on a connection to the offered port on the same host (`PATH.bulk` beside a `unix:PATH`
feed socket): one of its idle ones, else a new one. The server answers `ACK` and from then on
writes the stream's BatchChunk messages there, exactly the messages the call would have carried,
each framed with its length and the length of its head (everything before `data`, its last
field), so the client reads each chunk's data straight into its place in the batch's body. After
the last batch the server writes an end marker (a frame of length 0), ends the call (whose status
is the stream's), and waits on the connection for the client's next ticket: a striping client
opens a stream per block, and the connection outlives them. An error, a cancellation or a
deadline end the call and close the connection instead. Nothing else changes: the request, the
batches, `state_dict()`, the errors.

What it saves, per byte of a raw batch: gRPC's copy into its slices and its per-message work on
the server (`sendmsg` takes the batch's pieces where they lie: the ring slot's bytes; the kernel's
copy into the socket is the only one), and gRPC's two copies on the client (`recv_into` fills one
buffer per message, which the batch's fields are views of). A raw batch sent as stored
(`gdsload.service.server.stored`) has `wire.FileSpan` pieces, written with `os.sendfile` from the shard
(`BulkSink.send`): not even the loader's read into a ring slot is left on the server.

When it is not used (the stream then goes over gRPC as before): a server with TLS (the side
connection would be plaintext), `gdsload serve --no-bulk`, a server older than the field (it
ignores it), a `unix-abstract:` address, a client with `RemoteLoader(bulk=False)`, or a client
that cannot connect to the offered port within `CONNECT_S` (a firewall): that address is then
asked without bulk for the rest of the loader's life. A ticket is 128 random bits, sent only over
the (authenticated) call, valid once and for `WAIT_S`: a connection that does not present a
waiting ticket, all 16 bytes of it, within `TICKET_S` of its accept (`IDLE_S` between streams)
is closed without a word. Connections without a ticket yet cost no thread (one selector thread
reads every ticket) and are at most `MAX_PENDING` (`gdsload serve --max-pending-connections`):
more are closed as they are accepted (`BulkListener`).

Memory stays as bounded as over gRPC: the server writes a message only when the kernel took the
previous one (`sendmsg` blocks while the client does not read).
"""

from __future__ import annotations

import socket
import struct

from gdsload.v1 import feed_pb2 as pb

TICKET_BYTES = 16
#: How long a stream waits for its client to connect and present the ticket.
WAIT_S = 10.0
#: How long an accepted connection has for its whole ticket (`Limits.bulk_ticket_s`).
TICKET_S = 5.0
#: Accepted connections without a ticket yet, at most (`Limits.max_pending_connections`).
MAX_PENDING = 64
#: How long a server keeps a client's idle connection for its next stream; the client keeps it
#: for less (`KEEP_S`), so it does not pick one the server is closing.
IDLE_S = 30.0
KEEP_S = 20.0
#: How long a client tries to connect before it streams over gRPC instead.
CONNECT_S = 3.0
#: Sanity bounds on what a server announces (a header of keys; a batch body).
MAX_HEAD_BYTES = 1 << 30
MAX_BODY_BYTES = 1 << 40
#: Before each message: its length and the length of its head (the bytes before the data).
FRAME = struct.Struct("<QI")
#: The server's answer to a ticket it accepts.
ACK = b"\x01"
END = object()  # `BulkCall`'s reader: the end marker (a frame of length 0) after a stream's last message


def unix_bulk_path(path: str) -> str:
    """Where the bulk socket of a feed socket at `path` lives."""
    return path + ".bulk"


def offer_message(ticket: bytes, port: int) -> bytes:
    """The first message of a bulk stream."""
    return pb.BatchChunk(bulk=pb.BulkOffer(ticket=ticket, port=port)).SerializeToString()


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """`n` bytes, or None at a clean end of stream before the first byte; raises EOFError when
    the stream ends inside them."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            if got == 0:
                return None
            raise EOFError(f"the bulk connection ended {n - got} bytes short")
        got += k
    return bytes(buf)

