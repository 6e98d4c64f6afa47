"""The server's end of the bulk connection (`gdsload.service.protocol.framing` has the protocol):
`BulkListener` reads every ticket on one selector thread and hands a connection to the stream
that expects it; `BulkSink` writes a stream's messages there with `sendmsg` and `sendfile`."""

from __future__ import annotations

import errno
import os
import secrets
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gdsload.errors import CorruptDataError, StorageError
from gdsload.service.protocol import wire
from gdsload.service.protocol.config import bind_host, unix_path
from gdsload.service.protocol.framing import ACK, FRAME, IDLE_S, TICKET_BYTES, TICKET_S, WAIT_S, unix_bulk_path

#: Accepted connections without a ticket yet, at most (`Limits.max_pending_connections`).
MAX_PENDING = 64
#: `sendmsg` takes at most IOV_MAX buffers per call (1024 on Linux).
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


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

    def send(self, frames: Iterable[Sequence[Any]], progress: Callable[..., None] | None = None) -> None:
        """Write messages, each a list of buffers whose concatenation is one serialized BatchChunk
        and whose first buffer is its head (everything before the value of `data`, which is the
        message's last field: `wire.encode_frames`' layout), framed with their lengths, straight
        from the buffers. Raises ClientGone when the connection broke.

        The buffers between stored members go with one `sendmsg`, each run of members with one
        `_sendfiles` (a raw stored batch is a piece per member: no Python call per member but
        `os.sendfile`). `progress`, when given, is called per message and per stored member
        (`priority.Turn.progress`), and with True when the connection is full (the writes are
        then non-blocking: the send waits for its client in `_wait`, lower work may go)."""
        if progress is None:
            return self._send(frames, None)
        self.conn.setblocking(False)
        try:
            self._send(frames, progress)
        finally:
            try:
                self.conn.setblocking(True)
            except OSError:  # (closed meanwhile)
                pass

    def _send(self, frames: Iterable[Sequence[Any]], progress: Callable[..., None] | None) -> None:
        span = wire.FileSpan
        for pieces in frames:
            if progress is not None:
                progress()
            views = [p if type(p) is span else memoryview(p).cast("B") for p in pieces]
            n = sum([v.nbytes for v in views])
            views.insert(0, memoryview(FRAME.pack(n, views[0].nbytes)))
            start = i = 0
            end = len(views)
            while i < end:  # buffers with sendmsg, runs of members as stored with sendfile
                if type(views[i]) is not span:
                    i += 1
                    continue
                if i > start:
                    self._sendmsg(views[start:i], socket.MSG_MORE, progress)
                start = i
                while i < end and type(views[i]) is span:
                    i += 1
                self._sendfiles(views[start:i], progress)
                start = i
            if start < end:
                self._sendmsg(views[start:], 0, progress)

    def _sendfiles(self, spans: list[wire.FileSpan], progress: Callable[..., None] | None = None) -> None:
        """Write each span's bytes from its file (the page cache's pages go to the socket: no copy
        here). A file shorter than a span is a `CorruptDataError` naming it; the connection is
        then cut mid-message, so the client takes the call's status, never a short batch."""
        out = self.conn.fileno()
        sendfile = os.sendfile
        for fd, off, n in spans:
            if progress is not None:
                progress()
            while n:
                try:
                    k = sendfile(out, fd, off, n)
                except BlockingIOError:
                    self._wait(progress)
                    continue
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

    def _sendmsg(self, views: list[memoryview], flags: int = 0, progress: Callable[..., None] | None = None) -> None:
        """Write every byte of `views` (byte-format memoryviews), as many per call as IOV_MAX allows
        (`flags`: MSG_MORE when a `sendfile` follows)."""
        try:
            while views:
                try:
                    sent = self.conn.sendmsg(views[:_IOV_MAX], [], flags)
                except BlockingIOError:
                    self._wait(progress)
                    continue
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

    def _wait(self, progress: Callable[..., None] | None) -> None:
        """(A non-blocking write found the connection full) tell `progress`, wait for the client."""
        if progress is not None:
            progress(True)
        try:
            while not self._writable(1000) and not self._shut:  # (a shutdown ends it: the write fails)
                pass
        except (OSError, ValueError) as exc:  # (closed meanwhile: fileno -1)
            raise ClientGone(str(exc)) from None

    def full(self) -> bool:
        """Whether the connection takes no bytes now: the client reads none (the kernel's buffers
        are full), or the connection is gone. Any thread; no wait."""
        try:
            events = self._writable(0)
        except (OSError, ValueError):  # (closed meanwhile: fileno -1)
            return True
        return not events or bool(events & (select.POLLERR | select.POLLHUP | select.POLLNVAL))

    def _writable(self, timeout_ms: int) -> int:
        """The connection's poll events for writing within `timeout_ms` (0: none, it is full)."""
        poll = select.poll()
        poll.register(self.conn.fileno(), select.POLLOUT)
        ready = poll.poll(timeout_ms)
        return ready[0][1] if ready else 0

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
        self._sendmsg([memoryview(FRAME.pack(0, 0))])
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


def _fd_path(fd: int) -> str:
    """The file an open descriptor is (for messages)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"file descriptor {fd}"

