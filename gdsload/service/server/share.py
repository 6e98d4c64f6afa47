"""Share groups: jobs that ask one server for the same batches are fed by one producer (`ShareHub`).

A stream whose `BatchRequest.share` is set is a *subscriber*, a `SharedSource`. Its *share key* is
everything that makes its batches (`protocol.request.identity_key`: the request without its RANGE
and DELIVERY fields), its epoch, the share name itself, the chunk size the server cuts it to, and
the caller's credentials (`identity`: a hash of the bearer token the call carried and the TLS
client identity). Different credentials never share; so rank r of job A shares with rank r of job
B only.

Producers. A key has one producer, or a few (jobs at different places of the epoch, or a striping
client's blocks). A producer is one `sources.LoaderSource` (a loader of the request from a start
step, whole epoch) opened through the server's `open_loader`, which takes a parked loader from the
server's `loaders.LoaderPool` when there is one; each batch it makes is serialized once and its
chunks are kept in a window of the last `window` batches. There is no producer thread: a subscriber
that needs the producer's next step makes it (one at a time), so a producer runs exactly as fast as
its fastest subscriber asks, and its loader's own readers prefetch as for any stream. Each
subscriber has its own cursor (`next`, the step it sends next, and `end`) and is served from the
window while its step is there. A new subscriber joins a producer whose window holds its start
step, or whose next step it is; otherwise it gets a producer of its own from its start (others may
join that one later): a job that starts late, resumes from an older `state_dict()`, or asks for
another block. When producers of its key exist but all have gone past its start, that is a
`behind` fallback.

Loaders go back to the pool as soon as their producer needs them no more: when it has made its
last step (the first job into the next epoch then takes the loader while the others still read the
last epoch's window, instead of a second loader, ring and DALI pipeline being built, and their
memory touched for the first time, at every epoch boundary), or when its last subscriber leaves (a
striping client's next block takes it). Such a *retired* producer keeps its window for late
joiners; a subscriber of it that needs more than its window moves to another producer. A producer
without subscribers is dropped, window and all, after `linger_s`, or at once when the budget needs
room (`evict_idle`).

No job waits for another. Before a producer makes step n with a full window, the subscribers that
still need the window's oldest batch hold it back; they get `hold_s` to take it, then they are
detached, and each goes on from its own cursor on a producer of its own (a `detached` fallback: the
private path). A paused job thus costs the others at most `hold_s`, once. (A detached job does not
rejoin the group it fell out of: it has its own producer for the rest of its stream.)

Exactly once: a subscriber sends its own steps next .. end-1, each once, in order; a producer makes
each step once, in plan order; and a step's bytes depend only on the key (the loader's batches are
a pure function of the request, crop and flip positions included), so a subscriber gets the batches
its own private stream would have sent. A batch sent again (a copy after the first) carries
`BatchHeader.shared = true` (merged into chunk 0, see feed.proto), which the client counts in
`RemoteLoader.stats()["shared_batches"]`.

Memory, against the `Budget`: a producer's loader reserves what any stream's does, and its window
`window` serialized batches (`estimate.wire_bytes`, an upper bound from the layout), refused as a
whole when the two are over the budget; a subscriber reserves one serialized batch (the one it is
sending may have left the window) and a fixed overhead, and counts as an open stream. The window
never holds more bytes than it reserved: a batch bigger than the estimate pushes older ones out
early, detaching those still waiting for them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from gdsload.service.protocol import request
from gdsload.service.protocol.status import BadRequest
from gdsload.service.server.admission import PRODUCER, Budget, Claim
from gdsload.service.server.logs import event
from gdsload.service.server.window import Producer, SharedFrames, Subscriber, WindowBatch
from gdsload.v1 import feed_pb2 as pb

#: Bytes a subscriber reserves besides one batch (its generator, gRPC's call state).
SUBSCRIBER_OVERHEAD_BYTES = 1 << 20


def identity(context: Any) -> str:
    """Who is calling, as far as sharing is concerned: a hash of the bearer token the call carried
    (the token itself is not kept) and of the TLS client certificate (mutual TLS: the certificate,
    its common name and alternative names, from gRPC's auth context). Calls without either (a
    server without token and TLS client certificates) all have the same identity."""
    h = hashlib.sha256(b"gdsload-share\0")
    try:
        meta = context.invocation_metadata() or ()
    except Exception:
        meta = ()
    for k, v in meta:
        if k == "authorization":
            _, _, token = str(v).strip().partition(" ")
            h.update(b"token\0" + token.strip().encode() + b"\0")
    try:
        auth = context.auth_context() or {}
    except Exception:
        auth = {}
    # the client certificate itself (mutual TLS): two clients whose certificates name the same
    # host (SAN) are still two identities
    for name in ("x509_pem_cert", "x509_common_name", "x509_subject_alternative_name"):
        for value in auth.get(name, ()):
            h.update(name.encode() + b"\0" + bytes(value) + b"\0")
    return h.hexdigest()[:32]


class ShareHub:
    """The share groups of one server: `subscribe(req, context)` opens a subscriber. `window`:
    batches kept per producer (>= 1); `hold_s`: how long a producer with a full window waits for
    its slowest subscriber before detaching it; `linger_s`: how long a producer without
    subscribers keeps its window for late joiners. `open_loader(req)`: a whole-epoch
    `sources.LoaderSource` of a request (its loader from the pool or new, reserved); `chunk(req)`:
    the chunk size the server cuts a request's batches to; `claim`: how a subscriber's refusals
    read (`admission.stream_claim`)."""

    def __init__(self, budget: Budget, open_loader: Callable[[pb.BatchRequest], Any], *, metrics: Any,
                 chunk: Callable[[pb.BatchRequest], int], claim: Claim, log: logging.Logger,
                 window: int = 4, hold_s: float = 0.5, linger_s: float = 2.0):
        self.budget = budget
        self.open_loader = open_loader
        self.metrics = metrics
        self.chunk = chunk
        self.claim = claim
        self.log = log
        self.window = window
        self.hold_s = hold_s
        self.linger_s = linger_s
        self.cond = threading.Condition()
        self.groups: dict[tuple, list[Producer]] = {}
        self.handoffs = 0  # producers whose loader came from the pool (no loader built)
        self._closed = False

    # -- what the server and tests look at --------------------------------------------------------
    def producers(self) -> list[Producer]:
        with self.cond:
            return [p for ps in self.groups.values() for p in ps]

    def window_bytes(self) -> tuple[int, int]:
        """(bytes in the windows now, bytes the windows reserved)."""
        ps = self.producers()
        return sum(p.window_nbytes for p in ps), sum(p.window_memory for p in ps)

    # -- a subscriber ---------------------------------------------------------------------------
    def subscribe(self, req: pb.BatchRequest, context: Any) -> SharedSource:
        """A subscriber of `req`'s group (its producer found or made), its memory reserved and
        counted as an open stream."""
        key = (identity(context), self.chunk(req), request.identity_key(req), req.epoch, req.share)
        G = req.batch_size * (req.world_size or 1)
        if G < 1 or req.start_position % G:
            raise BadRequest(f"start_position {req.start_position} must be a multiple of batch_size * "
                             f"world_size ({req.batch_size} * {req.world_size or 1}), with batch_size >= 1")
        sub = Subscriber(req.start_position // G)
        p = self._subscribe(req, key, sub)
        try:
            held = self.budget.reserve(p.batch_bytes + SUBSCRIBER_OVERHEAD_BYTES, self.claim)
            try:
                slot = self.budget.stream()
            except BaseException:
                held.release()
                raise
        except BaseException:
            self._leave(sub)
            raise
        self.metrics.share_subscriptions.labels(p.label).inc()
        self.metrics.share_subscribers.labels(p.label).inc()
        stop = lambda: self.budget.draining.is_set() or not context.is_active()  # noqa: E731
        return SharedSource(self, req, key, sub, p, [held, slot], stop)

    def _subscribe(self, req: pb.BatchRequest, key: tuple, sub: Subscriber, *, detached: bool = False,
                   moved: bool = False) -> Producer:
        """Attach `sub` to a producer of `key` that can serve its next step, or to a new one (its
        loader from the pool when one is parked: a striping client's next block does not pay for
        a new loader). `detached`: it fell out of a producer (joins none); `moved`: its producer
        was retired and cannot make its next step."""
        with self.cond:
            while True:
                ps = self.groups.get(key, [])
                p = None if detached else next((p for p in ps if p.joinable(sub.next)), None)
                if p is None:
                    break
                if not p.ready:  # being built: wait for it (bounded: building ends, either way)
                    self.cond.wait(0.05)
                    continue
                self._attach(sub, p, req)
                return p
            if ps and not detached and not moved and any(sub.next < q.first() for q in ps if not q.closed):
                self.metrics.share_fallbacks.labels(req.dataset, "behind").inc()
            p = Producer(key, sub.next, req.dataset, self.metrics.share_window_bytes)
            self.groups.setdefault(key, []).append(p)
            p.subs.add(sub)
            sub.producer = p
            sub.detached = False
        try:
            self._build(p, req)
        except BaseException as exc:
            with self.cond:
                p.failed = exc
                p.subs.discard(sub)
                sub.producer = None
                self._drop(p)
                self.cond.notify_all()
            raise
        with self.cond:
            p.ready = True
            self._set_end(sub, p, req)
            self.cond.notify_all()
        return p

    def _attach(self, sub: Subscriber, p: Producer, req: pb.BatchRequest) -> None:
        p.subs.add(sub)
        p.idle_since = None
        sub.producer = p
        sub.detached = False
        self._set_end(sub, p, req)

    @staticmethod
    def _set_end(sub: Subscriber, p: Producer, req: pb.BatchRequest) -> None:
        if sub.end is None:
            end = p.end_step
            sub.end = min(end, sub.next + req.max_batches) if req.max_batches else end

    def _build(self, p: Producer, req: pb.BatchRequest) -> None:
        """Open the producer's loader at its start, whole epoch (outside the lock: it validates,
        reserves, and may take a parked loader), and reserve its window."""
        r = pb.BatchRequest()
        r.CopyFrom(req)
        r.start_position = p.start * req.batch_size * (req.world_size or 1)
        r.max_batches = 0
        source = self.open_loader(r)
        try:
            batch_bytes = source.wire_bytes()
            p.window_res = self.budget.reserve(self.window * batch_bytes, PRODUCER,
                                               held=source.opened.reservation.nbytes)
        except BaseException:
            source.close("refused")
            raise
        p.source, p.label, p.payload, p.batch_bytes = source, source.label, source.payload, batch_bytes
        p.end_step = source.end_position // source.G
        self.handoffs += source.reused
        self.metrics.share_producers.inc()

    # -- serving --------------------------------------------------------------------------------
    def _next(self, sub: Subscriber, stop: Callable[[], bool]):
        """The next batch of `sub`: (batch, 1 if a copy else 0); "detached" when it must move to a
        producer of its own, "moved" when its producer was retired before its step; None when its
        stream ends here (done, or `stop()`: draining, cancelled). Makes the batch when `sub` is
        the one that needs the producer's next step."""
        with self.cond:
            while True:
                if stop() or sub.next >= sub.end:
                    return None
                if sub.detached:
                    return "detached"
                p = sub.producer
                b = p.get(sub.next)
                if b is not None:
                    return self._take(sub, b)
                if p.failed is not None:
                    raise p.failed
                if p.ended:
                    if p.retired:  # its loader went back to the pool: find the producer for this step
                        p.subs.discard(sub)
                        if not p.subs:
                            self._idle(p)
                        return "moved"
                    return None  # the loader ended before this step: cannot happen for a valid plan
                if sub.next == p.next and not p.producing and p.room(self.window, self.hold_s, self._detach):
                    p.producing = True
                    break
                self.cond.wait(p.wait_s(self.hold_s))
        return self._produce(p, sub)

    def _take(self, sub: Subscriber, b: WindowBatch) -> tuple[WindowBatch, int]:
        """The batch, and whether this is a copy (its chunk 0 is then flagged shared)."""
        sub.next += 1
        b.taken += 1
        self.cond.notify_all()  # the producer may be waiting for this subscriber
        return b, int(b.taken > 1)

    def _detach(self, s: Subscriber) -> None:
        """`s` falls out of its producer (the lock is held); it moves on from its own cursor."""
        p = s.producer
        s.detached = True
        if p is not None:
            p.subs.discard(s)
            if not p.subs:
                self._idle(p)
        self.cond.notify_all()

    def _idle(self, p: Producer) -> None:
        """`p` has no subscriber left (the lock is held): dropped after `linger_s` unless one joins."""
        p.idle_since = time.monotonic()
        t = threading.Timer(self.linger_s, self._reap)
        t.daemon = True
        t.start()

    def _produce(self, p: Producer, sub: Subscriber) -> tuple[WindowBatch, int] | None:
        """Make step `p.next` (this thread alone holds `p.producing`), put it in the window and
        take it for `sub`; after the producer's last step, its loader goes back to the pool."""
        try:
            enc = p.source.next()
            b = None if enc is None else WindowBatch(p.next, [list(f) for f in enc.pieces()], enc.nbytes,
                                                     enc.samples)
        except BaseException as exc:
            with self.cond:
                p.failed = exc
                p.producing = False
                self.cond.notify_all()
            raise
        with self.cond:
            p.producing = False
            if b is None:  # the epoch ended before this step: cannot happen for a valid plan
                p.ended = True
                self.cond.notify_all()
                return None
            p.append(b)
            p.trim(sub, self._detach)
            self.metrics.share_produced.labels(p.label).inc()
            got = self._take(sub, b)
            done = p.retire() if p.next >= p.end_step else None
        self._close_source(p, done, "ok")
        return got

    # -- leaving and closing --------------------------------------------------------------------
    def _leave(self, sub: Subscriber) -> None:
        """`sub`'s stream ended: its producer, left without subscribers, retires its loader (or,
        failed or shutting down, is dropped and closes it)."""
        with self.cond:
            p = sub.producer
            sub.producer = None
            if p is None:
                return
            p.subs.discard(sub)
            self.cond.notify_all()
            if p.subs or p.closed:
                return
            if p.failed is not None or self._closed or self.budget.draining.is_set():
                p.idle_since = time.monotonic()
                source, outcome = self._drop(p), "error" if p.failed is not None else "drained"
            else:
                self._idle(p)
                source, outcome = p.retire(), "ok"
        self._close_source(p, source, outcome)

    def _drop(self, p: Producer) -> Any:
        """Take `p` out of its group, its window released (the lock is held); returns its loader
        source, if it still has one, for the caller to close."""
        ps = self.groups.get(p.key)
        if ps is not None and p in ps:
            ps.remove(p)
            if not ps:
                del self.groups[p.key]
        return p.drop()

    def _close_source(self, p: Producer, source: Any, outcome: str) -> None:
        """Close a producer's loader source (outside the lock): parked after "ok", else closed."""
        if source is None:
            return
        source.close(outcome)
        self.metrics.share_producers.dec()
        event(self.log, "share_producer_end", level=logging.DEBUG, producer=p.id, dataset=p.label,
              start=p.start, produced=p.produced, parked=outcome == "ok")

    def _reap(self, *, all_idle: bool = False) -> None:
        """Drop the producers without subscribers that waited `linger_s` (all of them: `all_idle`)."""
        now = time.monotonic()
        out = []
        with self.cond:
            for ps in list(self.groups.values()):
                for p in list(ps):
                    if (p.ready and not p.subs and not p.producing and p.idle_since is not None
                            and (all_idle or now - p.idle_since >= self.linger_s - 0.01)):
                        out.append((p, self._drop(p)))
        for p, source in out:
            self._close_source(p, source, "drained" if self._closed else "ok")

    def evict_idle(self, need: int = 0) -> int:
        """Drop every producer without subscribers now (the budget needs room)."""
        before = len(self.producers())
        self._reap(all_idle=True)
        return before - len(self.producers())

    def close(self) -> None:
        """At shutdown: drop every producer (their streams have ended), closing their loaders."""
        with self.cond:
            self._closed = True
            out = [(p, self._drop(p)) for ps in list(self.groups.values()) for p in list(ps)
                   if not p.subs and not p.producing]
        for p, source in out:
            self._close_source(p, source, "drained")


class SharedSource:
    """One subscriber of a share group, as a `sources.BatchSource`: its steps from the window of
    its producer (moving to another producer when detached or when its producer retired). Holds
    its reservations (one serialized batch, and its stream) until `close`."""

    def __init__(self, hub: ShareHub, req: pb.BatchRequest, key: tuple, sub: Subscriber, p: Producer,
                 held: list[Any], stop: Callable[[], bool]):
        self.hub, self.req, self.key, self.sub, self.held = hub, req, key, sub, held
        self.label, self.payload, self.producer = p.label, p.payload, p.id
        self.copies = 0
        self.stop = stop  # the server drains, or the call ended: the stream ends at this batch
        self.closed = False

    def next(self) -> SharedFrames | None:
        hub, sub = self.hub, self.sub
        while True:
            got = hub._next(sub, self.stop)
            if got is None:
                return None
            if got == "detached":
                hub.metrics.share_fallbacks.labels(self.req.dataset, "detached").inc()
                hub._subscribe(self.req, self.key, sub, detached=True)
            elif got == "moved":
                hub._subscribe(self.req, self.key, sub, moved=True)
            else:
                batch, copy = got
                self.copies += copy
                return SharedFrames(batch, bool(copy))

    def close(self, outcome: str) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.hub._leave(self.sub)
        finally:
            for r in self.held:
                r.release()
            self.hub.metrics.share_subscribers.labels(self.label).dec()

    def log_fields(self, end: bool) -> dict[str, Any]:
        req = self.req
        if end:
            return {"shared_batches": self.copies, "share": req.share}
        return dict(epoch=req.epoch, start_position=req.start_position, rank=req.rank,
                    world_size=req.world_size or 1, batch_size=req.batch_size, share=req.share,
                    producer=self.producer)
