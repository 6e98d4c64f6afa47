"""The client's end of the bulk connection (`gdsload.service.protocol.framing` has the protocol):
`BulkCall` iterates and cancels like the gRPC call it replaces, reading each chunk's data straight
into the batch's body; `IdleConnections` keeps a process's connections between streams."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np

from gdsload.service.protocol import wire
from gdsload.service.protocol.config import bind_host, dns_rest, unix_path
from gdsload.service.protocol.framing import (
    ACK, CONNECT_S, END, FRAME, KEEP_S, MAX_BODY_BYTES, MAX_HEAD_BYTES, TICKET_BYTES, recv_exact, unix_bulk_path,
)
from gdsload.v1 import feed_pb2 as pb


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
        prefix = recv_exact(sock, FRAME.size)
        if prefix is None:
            return None
        n, head_n = FRAME.unpack(prefix)
        if n == 0:
            return END
        if head_n > n or head_n > MAX_HEAD_BYTES:
            raise wire.ProtocolError(f"a bulk message of {n} bytes announces a head of {head_n}")
        head = recv_exact(sock, head_n) or b""
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
            if not size and first.HasField("pause") and not first.HasField("header"):
                return first, b""  # a pause notice (BatchChunk.pause): receive.read_batches takes it
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
