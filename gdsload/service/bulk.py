"""The bulk connection: a stream's batch bytes on a plain socket beside its gRPC call.

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
(`gdsload.service.stored`) has `wire.FileSpan` pieces, written with `os.sendfile` from the shard
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

import errno
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from gdsload.errors import CorruptDataError, StorageError
from gdsload.service import wire
from gdsload.service.config import bind_host, dns_rest, unix_path
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
_FRAME = struct.Struct("<QI")
#: The server's answer to a ticket it accepts.
ACK = b"\x01"
END = object()  # `_frame`: the end marker (a frame of length 0) after a stream's last message
#: `sendmsg` takes at most IOV_MAX buffers per call (1024 on Linux).
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def unix_bulk_path(path: str) -> str:
    """Where the bulk socket of a feed socket at `path` lives."""
    return path + ".bulk"


def offer_message(ticket: bytes, port: int) -> bytes:
    """The first message of a bulk stream."""
    return pb.BatchChunk(bulk=pb.BulkOffer(ticket=ticket, port=port)).SerializeToString()


class ClientGone(Exception):
    """The bulk connection broke or was shut down while the server wrote (the client left, or
    the call ended): the stream ends as cancelled."""


# -- server ------------------------------------------------------------------------------------------
class _Pending:
    """A connection waiting for a ticket: the bytes of it so far, and until when it may send the rest."""

    __slots__ = ("buf", "got", "deadline", "fresh")

    def __init__(self, deadline: float, fresh: bool):
        self.buf = bytearray(TICKET_BYTES)
        self.got = 0
        self.deadline = deadline
        self.fresh = fresh  # never presented a ticket: counts against `max_pending`


class BulkListener:
    """The server's bulk socket (TCP on the feed's host, on `port` or any free port; or
    `PATH.bulk`), the streams waiting for their client's connection, and the connections.

    One thread (`gdsload-bulk`) does everything but a stream's writes: a selector accepts and
    reads tickets, without blocking, for every connection waiting for one (new ones, and idle ones
    between a client's streams); a connection whose ticket is complete and waiting gets `ACK` and
    is lent to its stream (the stream's own thread writes to it); a stream that ends cleanly gives
    it back. So a connection costs a descriptor and a few bytes, never a thread.

    Unauthenticated connections (accepted, no valid ticket presented yet) are capped at
    `max_pending` (`gdsload serve --max-pending-connections`): one over the cap is closed as soon as
    it is accepted; and each has `ticket_s` for its whole ticket, from its accept (not per read: a
    peer trickling a byte at a time is closed at the deadline too). An idle connection that carried
    a stream waits `IDLE_S` for its next ticket, whose bytes must then all come within `ticket_s`
    of its first; idle connections are not capped (each one carried a stream of a ticket handed
    out on an authenticated call). While the cap is full, a client's new connection is closed too:
    its stream fails with UNAVAILABLE (`WAIT_S`) and the client retries.
    """

    def __init__(self, host: str | None = None, port: int = 0, *, unix_path: str | None = None,
                 max_pending: int = MAX_PENDING, ticket_s: float = TICKET_S):
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an integer >= 1, got {max_pending!r}")
        if not 0 < ticket_s < float("inf"):
            raise ValueError(f"ticket_s must be a finite number of seconds > 0, got {ticket_s!r}")
        self.max_pending = max_pending
        self.ticket_s = float(ticket_s)
        if unix_path is not None:
            self.path: str | None = unix_bulk_path(unix_path)
            try:
                os.unlink(self.path)  # a stale socket file of a server that died
            except FileNotFoundError:
                pass
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(self.path)
            self.port = 0
        else:
            self.path = None
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, kind, proto, _, addr = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and host in ("::", "[::]"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # as gRPC's [::] takes IPv4 too
            sock.bind(addr)
            self.port = sock.getsockname()[1]
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._lock = threading.Lock()
        self._waiting: dict[bytes, list] = {}  # ticket -> [presented, BulkSink or None]
        self._pending: dict[socket.socket, _Pending] = {}  # (the selector thread's) waiting for a ticket
        self._fresh = 0  # of them, connections that never presented a ticket (capped)
        self._lent: set[BulkSink] = set()  # connections lent to streams
        self._returned: list[socket.socket] = []  # given back by streams that ended cleanly
        self.accepted = 0  # connections taken in (under the cap)
        self.refused = 0  # connections closed at accept (over the cap)
        self.expired = 0  # connections closed at their deadline (a ticket's, or an idle one's)
        self._closed = False
        self._paused_until: float | None = None  # accepting again then (out of descriptors)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="gdsload-bulk", daemon=True)
        self._thread.start()

    def expect(self) -> tuple[bytes, list]:
        """A new ticket and its slot; give the ticket to the client, then `connection`."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        slot = [threading.Event(), None]
        with self._lock:
            self._waiting[ticket] = slot
        return ticket, slot

    def connection(self, ticket: bytes, slot: list, timeout: float = WAIT_S,
                   cancelled: Any = None) -> BulkSink | None:
        """The sink on the client's connection for `ticket`, or None when it did not come within
        `timeout` (or `cancelled()` turned true)."""
        deadline = time.monotonic() + timeout
        while not slot[0].wait(0.05):
            if time.monotonic() >= deadline or self._closed or (cancelled is not None and cancelled()):
                if self.withdraw(ticket):
                    return None  # withdrawn before any connection presented it
                if slot[0].wait(self.ticket_s):  # presented just now: the selector lends it at once
                    break
                self.withdraw(ticket)  # (its acknowledgement failed; it was put back)
                return None
        return slot[1]

    def withdraw(self, ticket: bytes) -> bool:
        """Take back a ticket no connection presented yet (True), e.g. of a call that ended."""
        with self._lock:
            return self._waiting.pop(ticket, None) is not None

    def pending(self) -> int:
        """Connections waiting for a ticket now (new and idle ones)."""
        return len(self._pending)

    # (everything below runs on the selector thread, but `_give_back`: a stream's thread)
    def _run(self) -> None:
        try:
            while not self._closed:
                now = time.monotonic()
                if self._paused_until is not None and now >= self._paused_until:
                    self._paused_until = None
                    self._sel.register(self._sock, selectors.EVENT_READ)
                nearest = min((p.deadline for p in self._pending.values()), default=now + 1.0)
                if self._paused_until is not None:
                    nearest = min(nearest, self._paused_until)
                for key, _ in self._sel.select(max(0.0, nearest - now)):
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._woken()
                    else:
                        self._read(key.fileobj)
                now = time.monotonic()
                for conn in [c for c, p in self._pending.items() if p.deadline <= now]:
                    self.expired += 1
                    self._drop(conn)
        finally:
            self._shut_all()

    def _accept(self) -> None:
        for _ in range(256):  # then the tickets of those accepted get their turn
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: the backlog keeps the connection; the listener, still
                    # readable, is left alone a moment instead of spinning this thread
                    self._sel.unregister(self._sock)
                    self._paused_until = time.monotonic() + 0.1
                    return
                if exc.errno == errno.ECONNABORTED:
                    continue
                return  # the listener was shut (closing)
            if self._fresh >= self.max_pending:
                self.refused += 1
                conn.close()  # over the cap: without a word
                continue
            self.accepted += 1
            try:
                conn.setblocking(False)
                if conn.family != socket.AF_UNIX:  # a message's last segment goes out at once
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # (reset already)
                conn.close()
                continue
            self._wait_ticket(conn, time.monotonic() + self.ticket_s, fresh=True)

    def _wait_ticket(self, conn: socket.socket, deadline: float, fresh: bool) -> None:
        self._pending[conn] = _Pending(deadline, fresh)
        self._fresh += fresh
        self._sel.register(conn, selectors.EVENT_READ)

    def _unwait(self, conn: socket.socket) -> _Pending:
        p = self._pending.pop(conn)
        self._fresh -= p.fresh
        self._sel.unregister(conn)
        return p

    def _drop(self, conn: socket.socket) -> None:
        """Close a waiting connection: nothing is said to the peer."""
        self._unwait(conn)
        conn.close()

    def _woken(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        with self._lock:
            back, self._returned = self._returned, []
        idle = time.monotonic() + IDLE_S
        for conn in back:
            conn.setblocking(False)
            self._wait_ticket(conn, idle, fresh=False)

    def _read(self, conn: socket.socket) -> None:
        p = self._pending[conn]
        try:
            k = conn.recv_into(memoryview(p.buf)[p.got:], TICKET_BYTES - p.got)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            k = 0
        if not k:
            self._drop(conn)  # the peer closed it (or it broke)
            return
        if not p.got and not p.fresh:  # an idle connection's next ticket: all of it within ticket_s
            p.deadline = min(p.deadline, time.monotonic() + self.ticket_s)
        p.got += k
        if p.got < TICKET_BYTES:
            return
        ticket = bytes(p.buf)
        with self._lock:
            slot = self._waiting.pop(ticket, None)
        if slot is None:
            self._drop(conn)  # not a waiting ticket: nothing is said to the peer
            return
        self._unwait(conn)
        try:
            if conn.send(ACK) != len(ACK):  # (an empty send buffer takes a byte at once)
                raise BlockingIOError
        except OSError:
            with self._lock:  # the stream goes on waiting for another connection with its ticket
                self._waiting.setdefault(ticket, slot)
            conn.close()
            return
        conn.setblocking(True)  # the stream's thread writes with blocking sends
        sink = BulkSink(conn, on_done=self._give_back)
        with self._lock:
            self._lent.add(sink)
        slot[1] = sink
        slot[0].set()

    def _give_back(self, sink: BulkSink, reuse: bool) -> None:
        """(A stream's thread) the stream is done with `sink`'s connection: it waits for the
        client's next ticket (`reuse`: the stream ended cleanly), or it was closed."""
        with self._lock:
            self._lent.discard(sink)
            if reuse and not self._closed:
                self._returned.append(sink.conn)
                reuse = False
            elif reuse:
                sink.conn.close()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # (a full wake pipe wakes the selector all the same; a closed one: closing)

    def _shut_all(self) -> None:
        """(The selector thread, on its way out) close the listener and every connection that is
        not lent to a stream."""
        with self._lock:
            back, self._returned = self._returned, []
        for conn in list(self._pending) + back:
            conn.close()
        self._pending.clear()
        self._sel.close()
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def close(self) -> None:
        """Stop accepting, close the connections waiting for a ticket and break the lent ones (the
        streams still open end with their calls)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lent = list(self._lent)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        for sink in lent:
            sink.shutdown()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)  # the port is free once close() returns
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass


class BulkSink:
    """The server's end of one stream's bulk connection: `send` its messages, then `finish` (the
    end marker; the connection goes back to wait for the client's next stream) or `close`."""

    def __init__(self, conn: socket.socket, on_done: Any = None):
        self.conn = conn
        self._lock = threading.Lock()
        self._shut = False
        self._done = False
        self._on_done = on_done  # (sink, reuse): the listener takes the connection back, or forgets it


    def send(self, frames: Iterable[Sequence[Any]]) -> None:
        """Write messages, each a list of buffers whose concatenation is one serialized BatchChunk
        and whose first buffer is its head (everything before the value of `data`, which is the
        message's last field: `wire.encode_frames`' layout), framed with their lengths, straight
        from the buffers. Raises ClientGone when the connection broke."""
        for pieces in frames:
            views = [p if type(p) is wire.FileSpan else memoryview(p).cast("B") for p in pieces]
            n = sum(v.nbytes for v in views)
            views.insert(0, memoryview(_FRAME.pack(n, views[0].nbytes)))
            start = 0
            for i, v in enumerate(views):  # buffers with sendmsg, members as stored with sendfile
                if type(v) is wire.FileSpan:
                    if i > start:
                        self._sendmsg(views[start:i], socket.MSG_MORE)
                    self._sendfile(v)
                    start = i + 1
            if start < len(views):
                self._sendmsg(views[start:])

    def _sendfile(self, span: wire.FileSpan) -> None:
        """Write `span`'s bytes from its file (the page cache's pages go to the socket: no copy
        here). A file shorter than the span is a `CorruptDataError` naming it; the connection is
        then cut mid-message, so the client takes the call's status, never a short batch."""
        fd, off, n = span
        out = self.conn.fileno()
        while n:
            try:
                k = os.sendfile(out, fd, off, n)
            except (BrokenPipeError, ConnectionError) as exc:
                raise ClientGone(str(exc)) from None
            except OSError as exc:
                if self._shut:  # shut down by the call's end (fileno -1, or a broken socket)
                    raise ClientGone(str(exc)) from None
                raise StorageError(f"sending a stored member (offset {off}) of {_fd_path(fd)} "
                                   f"failed: {exc.strerror or exc}") from exc
            if not k:
                raise CorruptDataError(f"{_fd_path(fd)}: truncated (it ends before offset {off + n}, "
                                       f"where its index has a member): run gdsload verify")
            off += k
            n -= k

    def _sendmsg(self, views: list[memoryview], flags: int = 0) -> None:
        """Write every byte of `views` (byte-format memoryviews), as many per call as IOV_MAX allows
        (`flags`: MSG_MORE when a `sendfile` follows)."""
        try:
            while views:
                sent = self.conn.sendmsg(views[:_IOV_MAX], [], flags)
                while sent and views:
                    k = views[0].nbytes
                    if sent >= k:
                        sent -= k
                        views.pop(0)
                    else:
                        views[0] = views[0][sent:]
                        sent = 0
        except OSError as exc:
            raise ClientGone(str(exc)) from None

    def shutdown(self) -> None:
        """Break the connection (the call ended): a blocked `send` raises ClientGone. Any thread."""
        with self._lock:  # never on a closed descriptor (its number may be another socket's by then)
            if self._shut:
                return
            self._shut = True
            try:
                self.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def finish(self) -> None:
        """The stream ended cleanly: the end marker, and the connection waits for the client's
        next ticket. Raises ClientGone when the connection broke."""
        self._sendmsg([memoryview(_FRAME.pack(0, 0))])
        with self._lock:
            if self._shut:  # the call ended meanwhile (cancelled): not reused
                raise ClientGone("the call ended")
            self._shut = True  # no later shutdown from this stream's call
            self._done = True
        if self._on_done is not None:
            self._on_done(self, True)

    def close(self) -> None:
        """The stream is done without its end marker (an error, a cancel): the connection closes,
        the client takes the call's status."""
        with self._lock:
            if self._done:
                return
            self._done = self._shut = True
            self.conn.close()
        if self._on_done is not None:
            self._on_done(self, False)


# -- client ------------------------------------------------------------------------------------------
def _fd_path(fd: int) -> str:
    """The file an open descriptor is (for messages)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"file descriptor {fd}"


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
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


def bulk_target(address: str) -> tuple[int, str] | None:
    """(socket family, host or socket path) to connect to for a feed `address`; None when bulk is
    not possible for it (unix-abstract:)."""
    if address.startswith("unix:"):
        return socket.AF_UNIX, unix_bulk_path(unix_path(address))
    if address.startswith("unix-abstract:"):
        return None
    # the family is chosen by getaddrinfo in `_connect`
    return socket.AF_INET, bind_host(dns_rest(address).rpartition(":")[0])


def _connect(target: tuple[int, str], port: int) -> socket.socket:
    family, where = target
    if family == socket.AF_UNIX:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_S)
        try:
            sock.connect(where)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return sock
    sock = socket.create_connection((where, port), timeout=CONNECT_S)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class IdleConnections:
    """A client's bulk connections to one server that are between streams (per process and
    address), kept `KEEP_S` for its next stream: a striping client opens one stream per block."""

    def __init__(self, keep: int = 8):
        self._lock = threading.Lock()
        self._socks: list[tuple[socket.socket, float]] = []
        self.keep = keep

    def take(self) -> socket.socket | None:
        now = time.monotonic()
        with self._lock:
            while self._socks:
                sock, since = self._socks.pop()
                if now - since < KEEP_S:
                    return sock
                sock.close()
        return None

    def give(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append((sock, time.monotonic()))
            while len(self._socks) > self.keep:
                self._socks.pop(0)[0].close()

    def close(self) -> None:
        with self._lock:
            for sock, _ in self._socks:
                sock.close()
            self._socks = []


class BulkCall:
    """A StreamBatches call that takes its messages from the bulk connection when the server
    offers one: iterates `(BatchChunk without data, data)` as the gRPC call does (a whole batch
    at a time), `cancel()` as the gRPC call's. A client that cannot connect makes the call again
    without bulk and reports why to `on_refused` (its owner then stops asking that address)."""

    def __init__(self, start: Any, request: pb.BatchRequest, target: tuple[int, str], *,
                 on_refused: Any = None, idle: IdleConnections | None = None, bodies: Any = None):
        self._start = start  # request -> a gRPC call
        self._bodies = bodies  # a `StagingPool` the batch bodies come from (reused memory), or None
        self._on_refused = on_refused
        self._idle = idle
        self._request = request
        self._target = target
        req = pb.BatchRequest()
        req.CopyFrom(request)
        req.bulk = True
        self._call = start(req)
        self._sock: socket.socket | None = None
        self._plain = False  # the server did not offer bulk: the gRPC call carries the batches
        self._ended = False  # the connection said the stream is over (or broke)
        self._cancelled = False
        self._lock = threading.Lock()
        self.refused: str | None = None  # why the offered connection could not be made

    def cancel(self) -> bool:
        with self._lock:
            self._cancelled = True
            call = self._call
            self._shutdown()  # wakes a blocked recv
        return call.cancel()

    def _shutdown(self) -> None:
        """(Under the lock: never on a closed descriptor, whose number may be reused by then.)"""
        if self._sock is not None and self._sock.fileno() >= 0:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _let_go(self, reuse: bool) -> None:
        """Done with the connection: back to the idle ones (a clean end) or closed."""
        with self._lock:
            sock, self._sock = self._sock, None
            self._ended = True
            if sock is None:
                return
            if reuse and not self._cancelled and self._idle is not None:
                self._idle.give(sock)
            else:
                sock.close()

    def __del__(self) -> None:  # a call dropped mid-stream (its consumer left after cancelling it)
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()

    def __iter__(self) -> BulkCall:
        return self

    def _status(self) -> None:
        """The stream's end on the connection: the call says how it ended (raises its error, or
        StopIteration)."""
        for _ in self._call:
            raise wire.ProtocolError("a message on the call after its bulk connection ended")
        raise StopIteration

    def __next__(self) -> tuple[pb.BatchChunk, Any]:
        if self._plain:
            return next(self._call)
        if self._ended:
            self._status()
        if self._sock is None:
            chunk, data = next(self._call)
            if not chunk.HasField("bulk"):
                self._plain = True  # a server that does not offer bulk
                return chunk, data
            if not self._open(chunk.bulk):
                if self._plain:
                    return next(self._call)
                self._status()  # the ticket was refused (withdrawn): the call's status says why
        got = self._read_batch()
        if got is None:
            self._status()
        return got

    def _open(self, offer: pb.BulkOffer) -> bool:
        """Present the ticket on an idle connection (else on a new one) and wait for the server's
        acceptance. False: the server refused the ticket, or the port cannot be reached (then
        `_plain`: the request goes again over gRPC alone)."""
        for fresh in (False, True):
            sock = None if fresh or self._idle is None else self._idle.take()
            if sock is None:
                if not fresh:
                    continue
                try:
                    sock = _connect(self._target, offer.port)
                except OSError as exc:
                    self._fall_back(f"{exc.strerror or exc}")
                    return False
            with self._lock:
                self._sock = sock
                if self._cancelled:
                    self._shutdown()
            try:
                sock.sendall(offer.ticket)
                ack = sock.recv(1)
            except OSError:
                ack = b""
            if ack == ACK:
                return True
            self._let_go(reuse=False)
            self._ended = False
            if self._cancelled:
                break
            # an idle connection the server had closed: a new one; a new one refused: the call says why
        self._ended = True
        return False

    def _fall_back(self, why: str) -> None:
        """The bulk port cannot be reached (a firewall): the same request over gRPC alone."""
        self.refused = why
        if self._on_refused is not None:
            self._on_refused(why)
        self._call.cancel()
        with self._lock:
            self._plain = True
            if not self._cancelled:
                self._call = self._start(self._request)

    def _frame(self, sock: socket.socket) -> tuple[pb.BatchChunk, int] | None:
        """The next message's BatchChunk without `data`, and the length of its data (still to be
        read); None at a clean end of the connection."""
        prefix = _recv_exact(sock, _FRAME.size)
        if prefix is None:
            return None
        n, head_n = _FRAME.unpack(prefix)
        if n == 0:
            return END
        if head_n > n or head_n > MAX_HEAD_BYTES:
            raise wire.ProtocolError(f"a bulk message of {n} bytes announces a head of {head_n}")
        head = _recv_exact(sock, head_n) or b""
        if len(head) != head_n:
            raise EOFError("the bulk connection ended inside a message head")
        size = n - head_n
        if size:  # the head ends with data's tag and length: the message without data is before them
            tail = wire.data_prefix(size)
            if not head.endswith(tail):
                raise wire.ProtocolError("a bulk message whose data is not its last field")
            head = head[: -len(tail)]
        meta, rest = wire.split_chunk(head)
        if len(rest):
            raise wire.ProtocolError("a bulk message with data in its head")
        return meta, size

    def _read_batch(self) -> tuple[pb.BatchChunk, np.ndarray] | None:
        """One whole batch: its chunk 0 (flagged last) and its body, each chunk's data read
        straight into the body's place (the batch's fields become views of it: no copy here)."""
        sock = self._sock
        try:
            got = self._frame(sock)
            if got is None or got is END:  # closed (the call ends with its status), or the end marker
                self._let_go(reuse=got is END)
                return None
            first, size = got
            if first.chunk_index != 0 or not first.HasField("header"):
                raise wire.ProtocolError(f"a batch starts with chunk {first.chunk_index} (no header)")
            total = first.header.body_nbytes if not first.last else size
            if total > MAX_BODY_BYTES or size > total:
                raise wire.ProtocolError(f"step {first.step}: {size} bytes in a body of {total}")
            body = wire.new_body(total, self._bodies)  # the batch's fields are views of it
            view = memoryview(body)
            filled = self._fill(sock, view, 0, size)
            meta, k = first, 0
            while not meta.last:
                got = self._frame(sock)
                if got is None or got is END:
                    raise EOFError("the bulk connection ended inside a batch")
                meta, size = got
                k += 1
                if meta.chunk_index != k or meta.step != first.step:
                    raise wire.ProtocolError(f"expected chunk {k} of step {first.step}, got chunk "
                                             f"{meta.chunk_index} of step {meta.step}")
                if filled + size > total:
                    raise wire.ProtocolError(f"step {first.step}: chunks carry more than the {total} bytes announced")
                filled = self._fill(sock, view, filled, size)
            if filled != total:
                raise wire.ProtocolError(f"step {first.step}: got {filled} of {total} bytes")
            first.last = True  # the whole batch, as one message
            return first, body
        except (OSError, EOFError, wire.ProtocolError) as exc:
            # Cut (cancelled, or the server went away): the call's status tells what happened;
            # a call that ended well after a cut message is a protocol error.
            self._let_go(reuse=False)
            for _ in self._call:
                pass
            if isinstance(exc, wire.ProtocolError):
                raise
            raise wire.ProtocolError("the bulk connection broke inside a message") from None

    @staticmethod
    def _fill(sock: socket.socket, view: memoryview, at: int, n: int) -> int:
        end = at + n
        while at < end:
            k = sock.recv_into(view[at:end], end - at, socket.MSG_WAITALL)
            if not k:
                raise EOFError("the bulk connection ended inside a message")
            at += k
        return at
