"""Share groups: jobs that ask one server for the same batches are fed by one producer (`ShareHub`).

A stream whose `BatchRequest.share` is set is a *subscriber*. Its *share key* is everything that
makes its batches: the request without `start_position`, `max_batches` and `max_chunk_bytes`
(dataset, dataset id, seed, epoch, shuffle, window, drop_last, batch size, rank, world size,
payload, transform, fields, on_error, mix, media, and the share name itself), the chunk size the
server cuts it to, and the caller's credentials (`identity`: a hash of the bearer token the call
carried and the TLS client identity). Different credentials never share; so rank r of job A shares
with rank r of job B only.

Producers. A key has one producer, or a few (jobs at different places of the epoch, or a
striping client's blocks). A producer is one `DataLoader` from a start step; each batch it makes
is serialized once (`wire.encode_batch`) and its chunks are kept in a window of the last `window`
batches. There is no producer thread: a subscriber that needs the producer's next step makes it
(one at a time), so a producer runs exactly as fast as its fastest subscriber asks, and its
loader's own readers prefetch as for any stream. Each subscriber has its own cursor (`next`, the
step it sends next, and `end`) and is served from the window while its step is there. A new
subscriber joins a producer whose window holds its start step, or whose next step it is;
otherwise it gets a producer of its own from its start (others may join that one later): a job
that starts late, resumes from an older `state_dict()`, or asks for another block. When producers
of its key exist but all have gone past its start, that is a `behind` fallback. A new producer
takes the loader of an idle producer of its key, or of the same request's previous epoch, when
there is one (a striping client's next block, or the group's next epoch, then costs no new loader,
as with the server's parked loaders). A producer that has made its last step counts as idle even
while subscribers still read its window: the first job into the next epoch takes its loader while
the others finish the last one, instead of a second loader, ring and DALI pipeline being built
(and, decoded, their memory touched for the first time) at every epoch boundary. The idle one
keeps its window for late joiners, and a subscriber of it that needs more than its window moves
to another producer.

No job waits for another. Before a producer makes step n with a full window, the subscribers that
still need the window's oldest batch hold it back; they get `hold_s` to take it, then they are
detached, and each goes on from its own cursor on a producer of its own (a `detached` fallback:
the private path). A paused job thus costs the others at most `hold_s`, once. (A detached job
does not rejoin the group it fell out of: it has its own producer for the rest of its stream.)
A subscriber whose call ends (done, cancelled, failed) leaves. A producer without subscribers
lingers `linger_s` for late joiners (a striping client's next request), then its loader is parked
for the next stream of the same request (`FeedServicer._park`) or closed.

Exactly once: a subscriber sends its own steps next .. end-1, each once, in order; a producer
makes each step once, in plan order; and a step's bytes depend only on the key (the loader's
batches are a pure function of the request, crop and flip positions included), so a subscriber
gets the batches its own private stream would have sent. A batch sent again (a copy after the
first) carries `BatchHeader.shared = true` (merged into chunk 0, see feed.proto), which the client
counts in `RemoteLoader.stats()["shared_batches"]`.

Memory, against --max-memory: a producer reserves its loader's bound (`stream_memory`) plus
`window` serialized batches (`FeedServicer.batch_wire_bytes`, an upper bound from the index); a
subscriber reserves one serialized batch (the one it is sending may have left the window) and a
fixed overhead. The window never holds more bytes than it reserved: a batch bigger than the
estimate pushes older ones out early, detaching those still waiting for them.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from gdsload.frontend.options import check_share
from gdsload.service.protocol import wire
from gdsload.service.server.bulk import ClientGone
from gdsload.service.server.logs import event
from gdsload.service.protocol.status import BadRequest
from gdsload.v1 import feed_pb2 as pb

#: What a copy's chunk 0 gets appended: `BatchChunk{header: BatchHeader{shared: true}}`, which a
#: protobuf parser merges into the chunk's header (two instances of an embedded message merge).
SHARED_SUFFIX = pb.BatchChunk(header=pb.BatchHeader(shared=True)).SerializeToString()
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


def request_key(req: pb.BatchRequest, *, epoch: bool = True) -> bytes:
    """The request without what differs between the subscribers of one group (and without the
    epoch: what a loader is built from, so one producer's loader can serve the next epoch)."""
    r = pb.BatchRequest()
    r.CopyFrom(req)
    r.ClearField("start_position")
    r.ClearField("max_batches")
    r.ClearField("max_chunk_bytes")
    r.ClearField("bulk")  # how the bytes travel, not which
    r.ClearField("checks_item_crc32")  # who checks them
    r.ClearField("block_batches")  # which steps of the epoch a stream takes
    r.ClearField("block_stride")
    if not epoch:
        r.ClearField("epoch")
    return r.SerializeToString(deterministic=True)


class _Batch:
    """One batch in a window: its serialized chunks, as the first subscriber gets them."""

    __slots__ = ("again", "chunks", "heads", "nbytes", "samples", "step", "taken", "wire_nbytes")

    def __init__(self, step: int, chunks: list[bytes], nbytes: int, samples: int, heads: list[int]):
        self.step = step
        self.chunks = chunks
        self.heads = heads  # per chunk, the bytes before its data (a bulk connection's frame needs it)
        self.nbytes = nbytes  # batch body
        self.samples = samples
        self.wire_nbytes = sum(len(c) for c in chunks)
        self.taken = 0
        self.again: list[bytes] | None = None  # the chunks of a copy (chunk 0 flagged shared)

    def copy_chunks(self) -> list[bytes]:
        if self.again is None:
            self.again = [self.chunks[0] + SHARED_SUFFIX, *self.chunks[1:]]
        return self.again

    def frames(self, copy: bool) -> list[list[Any]]:
        """The chunks as `bulk.BulkSink.send` takes them (head, data), without copying the data; a
        copy's chunk 0 gets `SHARED_SUFFIX` before its head instead of after its data (protobuf
        merges the two headers either way)."""
        out = [[memoryview(c)[:h], memoryview(c)[h:]] for c, h in zip(self.chunks, self.heads)]
        if copy:
            out[0][0] = SHARED_SUFFIX + bytes(out[0][0])
        return out


class _Sub:
    """A subscriber: one StreamBatches call of a share group, and its cursor."""

    __slots__ = ("detached", "end", "next", "producer")

    def __init__(self, start: int):
        self.next = start  # the step it sends next
        self.end: int | None = None  # the step after its last (known once its producer is)
        self.producer: _Producer | None = None
        self.detached = False


class _Producer:
    """One loader of a share key, from `start`, and the window of its last batches."""

    _ids = itertools.count(1)

    def __init__(self, key: tuple, start: int, dataset: str, loader_key: tuple = ()):
        self.id = next(self._ids)
        self.key = key
        self.loader_key = loader_key  # the key without the epoch: whose loaders it may take
        self.dataset = dataset
        self.start = start
        self.next = start  # the step it makes next
        self.end_step = 0
        self.window: collections.deque[_Batch] = collections.deque()
        self.window_nbytes = 0
        self.subs: set[_Sub] = set()
        self.ready = False  # the loader is built (until then only its start can join)
        self.failed: BaseException | None = None
        self.ended = False  # makes no more batches: its loader ran to the end, or was handed on
        self.donated = False  # its loader went to a newer producer of its key; its window stays
        self.closed = False
        self.producing = False
        self.blocked_since: float | None = None
        self.idle_since: float | None = None
        self.produced = 0
        # set by ShareHub._build
        self.loader: Any = None
        self.it: Any = None
        self.planned: Any = None
        self.opts: dict[str, Any] = {}
        self.epoch = 0
        self.G = 1
        self.end_position = 0
        self.loader_memory = 0
        self.window_memory = 0
        self.batch_bytes = 0
        self.pooled: Any = None

    def first(self) -> int:
        """The oldest step it can still serve."""
        return self.window[0].step if self.window else self.next

    def joinable(self, step: int) -> bool:
        if self.closed or self.failed is not None:
            return False
        if not self.ready:
            return step == self.start
        return self.first() <= step < self.next or (step == self.next and not self.ended)

    def get(self, step: int) -> _Batch | None:
        if self.window and self.window[0].step <= step < self.next:
            return self.window[step - self.window[0].step]
        return None


class ShareHub:
    """The share groups of one server (`FeedServicer.share`): `stream(req, context)` serves a
    subscriber. `window`: batches kept per producer (>= 1); `hold_s`: how long a producer with a
    full window waits for its slowest subscriber before detaching it; `linger_s`: how long a
    producer without subscribers waits for another before it is closed (its loader parked)."""

    def __init__(self, servicer: Any, *, window: int = 4, hold_s: float = 0.5, linger_s: float = 2.0,
                 skip_remedy: str = ""):
        self.sv = servicer
        self.window = window
        self.hold_s = hold_s
        self.linger_s = linger_s
        self.skip_remedy = skip_remedy
        self.cond = threading.Condition()
        self.groups: dict[tuple, list[_Producer]] = {}
        self.handoffs = 0  # loaders handed from an idle producer to a new one (no loader built)
        self._closed = False

    # -- what the server and tests look at --------------------------------------------------------
    def producers(self) -> list[_Producer]:
        with self.cond:
            return [p for ps in self.groups.values() for p in ps]

    def window_bytes(self) -> tuple[int, int]:
        """(bytes in the windows now, bytes the windows reserved)."""
        with self.cond:
            ps = [p for ps in self.groups.values() for p in ps]
            return sum(p.window_nbytes for p in ps), sum(p.window_memory for p in ps)

    # -- a subscriber ---------------------------------------------------------------------------
    def stream(self, req: pb.BatchRequest, context: Any, sink: Any = None) -> Iterator[bytes]:
        """The chunks of one subscriber's steps, yielded for gRPC or, with `sink` (a
        `bulk.BulkSink`), written to its bulk connection."""
        sv, metrics = self.sv, self.sv.metrics
        try:
            check_share(req.share)
        except ValueError as exc:
            raise BadRequest(f"BatchRequest.{exc}") from None
        who, chunk = identity(context), sv.chunk_bytes(req)
        key = (who, chunk, request_key(req))
        lkey = (who, chunk, request_key(req, epoch=False))
        G = req.batch_size * (req.world_size or 1)
        if G < 1 or req.start_position % G:
            raise BadRequest(f"start_position {req.start_position} must be a multiple of batch_size * "
                             f"world_size ({req.batch_size} * {req.world_size or 1}), with batch_size >= 1")
        sub = _Sub(req.start_position // G)
        p = self._subscribe(req, key, lkey, sub)
        memory = p.batch_bytes + SUBSCRIBER_OVERHEAD_BYTES
        try:
            sv._enter(req.dataset, memory)
        except BaseException:
            self._leave(sub)
            raise
        metrics.share_subscriptions.labels(req.dataset).inc()
        metrics.share_subscribers.labels(req.dataset).inc()
        payload = p.opts["payload"]
        m_batches = metrics.batches.labels(req.dataset, payload)
        m_samples = metrics.samples.labels(req.dataset, payload)
        m_bytes = metrics.bytes.labels(req.dataset, payload)
        m_read = metrics.read_s.labels(payload)
        m_send = metrics.send_s.labels(payload)
        m_sent = metrics.share_sent.labels(req.dataset)
        t0 = time.perf_counter()
        sent = copies = sent_bytes = 0
        outcome = "ok"
        event(sv.log, "stream_start", peer=_peer(context), dataset=req.dataset, payload=payload,
              epoch=req.epoch, start_position=req.start_position, rank=req.rank,
              world_size=req.world_size or 1, batch_size=req.batch_size, share=req.share, producer=p.id)
        try:
            while True:
                t_read = time.perf_counter()
                got = self._next(sub, context)
                if got is None:
                    outcome = "drained" if sv.draining.is_set() else (
                        "cancelled" if not context.is_active() else "ok")
                    return
                if got == "detached":
                    metrics.share_fallbacks.labels(req.dataset, "detached").inc()
                    p = self._subscribe(req, key, lkey, sub, detached=True)
                    continue
                if got == "moved":
                    p = self._subscribe(req, key, lkey, sub, moved=True)
                    continue
                batch, copy = got
                m_read.observe(time.perf_counter() - t_read)
                t_send = time.perf_counter()
                if sink is None:
                    chunks = batch.chunks
                    if copy:
                        with self.cond:  # made once per batch, under the lock, for every gRPC copy
                            chunks = batch.copy_chunks()
                    yield from chunks
                else:
                    sink.send(batch.frames(copy))
                m_send.observe(time.perf_counter() - t_send)
                sent += 1
                copies += copy
                sent_bytes += batch.nbytes
                m_sent.inc()
                m_batches.inc()
                m_samples.inc(batch.samples)
                m_bytes.inc(batch.nbytes)
        except (GeneratorExit, ClientGone):
            outcome = "cancelled"
            raise
        except Exception as exc:
            from gdsload.service.protocol.status import to_status

            outcome = to_status(exc)[0].name
            raise
        finally:
            self._leave(sub)
            sv._leave(req.dataset, memory)
            metrics.share_subscribers.labels(req.dataset).dec()
            el = time.perf_counter() - t0
            event(sv.log, "stream_end", peer=_peer(context), dataset=req.dataset, outcome=outcome,
                  batches=sent, shared_batches=copies, bytes=sent_bytes, seconds=round(el, 3),
                  mb_per_s=round(sent_bytes / el / 1e6, 1) if el > 0 else None, share=req.share)

    def _subscribe(self, req: pb.BatchRequest, key: tuple, lkey: tuple, sub: _Sub, *, detached: bool = False,
                   moved: bool = False) -> _Producer:
        """Attach `sub` to a producer of `key` that can serve its next step, or to a new one (with
        the loader of an idle producer of the key when there is one: a striping client's next block
        does not pay for a new loader, and the idle producer's window stays for late joiners).
        `lkey`: the key without the epoch (whose idle loaders it may take). `detached`: it fell
        out of a producer (joins none); `moved`: its producer handed its loader on and cannot make
        its next step."""
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
                self.sv.metrics.share_fallbacks.labels(req.dataset, "behind").inc()
            p = _Producer(key, sub.next, req.dataset, lkey)
            donor = next((q for qs in self.groups.values() for q in qs
                          if q.loader_key == lkey and q.ready and (not q.subs or q.next >= q.end_step)
                          and not q.producing and q.loader is not None and q.failed is None and not q.closed
                          and not q.ended), None)
            old_it = None
            if donor is not None:  # an idle producer's loader, positioned anew (its window stays)
                p.loader, p.opts, p.loader_memory, p.pooled = donor.loader, donor.opts, donor.loader_memory, donor.pooled
                old_it = donor.it
                donor.loader = donor.it = donor.pooled = None
                donor.loader_memory = 0
                donor.ended = donor.donated = True
                self.handoffs += 1
            self.groups.setdefault(key, []).append(p)
            p.subs.add(sub)
            sub.producer = p
            sub.detached = False
        try:
            self._build(p, req, old_it)
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

    def _attach(self, sub: _Sub, p: _Producer, req: pb.BatchRequest) -> None:
        p.subs.add(sub)
        p.idle_since = None
        sub.producer = p
        sub.detached = False
        self._set_end(sub, p, req)

    @staticmethod
    def _set_end(sub: _Sub, p: _Producer, req: pb.BatchRequest) -> None:
        if sub.end is None:
            end = p.end_step
            sub.end = min(end, sub.next + req.max_batches) if req.max_batches else end

    def _build(self, p: _Producer, req: pb.BatchRequest, old_it: Any = None) -> None:
        """Open the producer's loader at its start (outside the lock: it validates, reserves, and
        may take a parked loader), or position the loader it was handed (`p.loader`, whose last
        iteration was `old_it`)."""
        sv = self.sv
        r = pb.BatchRequest()
        r.CopyFrom(req)
        G = req.batch_size * (req.world_size or 1)
        r.start_position = p.start * G
        if p.loader is not None:
            self._reposition(p, r, old_it)
            return
        loader, opts = sv._open_loader(r)
        window_memory = self.window * opts["batch_bytes"]
        memory = opts["memory"]
        try:
            sv._reserve(window_memory + (0 if opts["reused"] else memory))
        except BaseException:
            loader.close()
            if opts["reused"]:
                sv._release(memory)
            raise
        p.loader, p.opts, p.planned = loader, opts, opts["planned"]
        p.loader_memory, p.window_memory, p.batch_bytes = memory, window_memory, opts["batch_bytes"]
        p.epoch = req.epoch
        p.G = loader.plan.global_batch
        p.end_position = loader.plan.end_position
        p.end_step = p.end_position // p.G
        sv.metrics.share_producers.inc()
        try:
            if opts["payload"] == "decoded" and sv.pool is not None:
                p.pooled = sv.pool.attach(loader, req.dataset)
            p.it = iter(loader)
        except BaseException:
            self._close_loader(p, park=False)
            raise

    def _reposition(self, p: _Producer, r: pb.BatchRequest, old_it: Any) -> None:
        """A handed-on loader (its memory reserved already) at `r.start_position`, with a window."""
        sv, loader = self.sv, p.loader
        try:
            if old_it is not None:
                old_it.close()  # its readers stop; the ring and threads stay
            planned = loader.plan.batches(r.epoch, r.start_position)
            loader.load_state_dict(loader.plan.state(r.epoch, r.start_position))
            window_memory = self.window * p.opts["batch_bytes"]
            sv._reserve(window_memory)
            p.window_memory = window_memory
            p.planned = planned
            p.batch_bytes = p.opts["batch_bytes"]
            p.epoch = r.epoch
            p.G = loader.plan.global_batch
            p.end_position = loader.plan.end_position
            p.end_step = p.end_position // p.G
            p.it = iter(loader)
        except BaseException:
            self._close_loader(p, park=False)
            raise

    # -- serving --------------------------------------------------------------------------------
    def _next(self, sub: _Sub, context: Any):
        """The next batch of `sub`: (batch, 1 if a copy else 0); "detached" when it
        must move to a producer of its own; None when its stream ends here (done, draining,
        cancelled). Makes the batch when `sub` is the one that needs the producer's next step."""
        sv = self.sv
        with self.cond:
            while True:
                if sv.draining.is_set() or not context.is_active() or sub.next >= sub.end:
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
                    if p.donated:  # its loader went to a newer producer: find the one for this step
                        p.subs.discard(sub)
                        if not p.subs:
                            self._idle(p)
                        return "moved"
                    return None  # the loader ended before this step: cannot happen for a valid plan
                if sub.next == p.next and not p.producing and self._room(p):
                    p.producing = True
                    break
                self.cond.wait(self._wait_s(p))
        return self._produce(p, sub)

    def _take(self, sub: _Sub, b: _Batch) -> tuple[_Batch, int]:
        """The batch, and whether this is a copy (its chunk 0 is then flagged shared: over gRPC
        `_Batch.copy_chunks`, over a bulk connection `_Batch.frames`)."""
        sub.next += 1
        b.taken += 1
        self.cond.notify_all()  # the producer may be waiting for this subscriber
        return b, int(b.taken > 1)

    def _wait_s(self, p: _Producer) -> float:
        if p.blocked_since is None:
            return 0.1
        return max(0.005, min(0.1, p.blocked_since + self.hold_s - time.monotonic()))

    def _room(self, p: _Producer) -> bool:
        """Whether `p` may make its next step now (the lock is held): its window has room, or the
        oldest batch is no longer needed, or those who still need it had `hold_s` to take it and
        are detached now."""
        while len(p.window) >= self.window:
            oldest = p.window[0].step
            blockers = [s for s in p.subs if s.next <= oldest]
            if blockers:
                now = time.monotonic()
                if p.blocked_since is None:
                    p.blocked_since = now
                if now - p.blocked_since < self.hold_s:
                    return False
                for s in blockers:
                    self._detach(s)
            self._evict(p)
        p.blocked_since = None
        return True

    def _detach(self, s: _Sub) -> None:
        """`s` falls out of its producer (the lock is held); it moves on from its own cursor."""
        p = s.producer
        s.detached = True
        if p is not None:
            p.subs.discard(s)
            if not p.subs:
                self._idle(p)
        self.cond.notify_all()

    def _idle(self, p: _Producer) -> None:
        """`p` has no subscriber left (the lock is held): closed after `linger_s` unless one joins."""
        p.idle_since = time.monotonic()
        t = threading.Timer(self.linger_s, self._reap)
        t.daemon = True
        t.start()

    def _evict(self, p: _Producer) -> None:
        b = p.window.popleft()
        p.window_nbytes -= b.wire_nbytes
        self.sv.metrics.share_window_bytes.dec(b.wire_nbytes)

    def _produce(self, p: _Producer, sub: _Sub) -> tuple[_Batch, int]:
        """Make step `p.next` (this thread alone holds `p.producing`), put it in the window and
        take it for `sub`."""
        from gdsload.decode.image import DecodeError

        sv = self.sv
        step = p.next
        try:
            try:
                batch = next(p.it)
            except DecodeError as exc:  # word the remedy in protocol terms
                raise DecodeError(exc.reason, remedy=self.skip_remedy) from exc
            ids = next(p.planned)
            keys = batch[wire.KEY]
            skipped = sv._left_out(p.loader.dataset, ids, keys) if len(keys) < len(ids) else []
            frames = list(wire.encode_frames(batch, epoch=p.epoch, step=step, position=(step + 1) * p.G,
                                             max_chunk_bytes=p.opts["max_chunk_bytes"], skipped_keys=skipped,
                                             end_position=p.end_position))
            b = _Batch(step, [b"".join(f) for f in frames], wire.body_nbytes(batch), len(keys),
                       [len(f[0]) for f in frames])
        except StopIteration:  # the epoch ended before this step: cannot happen for a valid plan
            with self.cond:
                p.ended = True
                p.producing = False
                self.cond.notify_all()
            return None
        except BaseException as exc:
            with self.cond:
                p.failed = exc
                p.producing = False
                self.cond.notify_all()
            raise
        with self.cond:
            p.window.append(b)
            p.window_nbytes += b.wire_nbytes
            sv.metrics.share_window_bytes.inc(b.wire_nbytes)
            p.next += 1
            p.produced += 1
            p.producing = False
            # a batch bigger than the estimate: older ones leave early (their waiters detach)
            while p.window_nbytes > p.window_memory and len(p.window) > 1:
                oldest = p.window[0].step
                for s in [s for s in p.subs if s.next <= oldest and s is not sub]:
                    self._detach(s)
                self._evict(p)
            sv.metrics.share_produced.labels(p.dataset).inc()
            return self._take(sub, b)

    # -- leaving and closing --------------------------------------------------------------------
    def _leave(self, sub: _Sub) -> None:
        with self.cond:
            p = sub.producer
            sub.producer = None
            if p is None:
                return
            p.subs.discard(sub)
            self.cond.notify_all()
            if p.subs or p.closed:
                return
            if p.failed is not None or self._closed or self.sv.draining.is_set():
                p.idle_since = time.monotonic()
                self._drop(p)
            else:
                self._idle(p)
                return
        self._close_loader(p, park=False)

    def _drop(self, p: _Producer) -> None:
        """Take `p` out of its group (the lock is held); its loader is closed by the caller."""
        p.closed = True
        ps = self.groups.get(p.key)
        if ps is not None and p in ps:
            ps.remove(p)
            if not ps:
                del self.groups[p.key]
        while p.window:
            self._evict(p)

    def _reap(self, *, all_idle: bool = False) -> None:
        """Close the producers without subscribers that waited `linger_s` (all of them: `all_idle`)."""
        now = time.monotonic()
        out = []
        with self.cond:
            for ps in list(self.groups.values()):
                for p in list(ps):
                    if (p.ready and not p.subs and not p.producing and p.idle_since is not None
                            and (all_idle or now - p.idle_since >= self.linger_s - 0.01)):
                        self._drop(p)
                        out.append(p)
        for p in out:
            self._close_loader(p, park=not all_idle and p.failed is None and not self.sv.draining.is_set())

    def evict_idle(self) -> int:
        """Close every producer without subscribers now (the memory budget needs room)."""
        before = len(self.producers())
        self._reap(all_idle=True)
        return before - len(self.producers())

    def _close_loader(self, p: _Producer, *, park: bool) -> None:
        """Release the window's reservation, and park or close the loader (if it still has one)."""
        sv = self.sv
        if p.window_memory:
            sv._release(p.window_memory)
            p.window_memory = 0
        loader = p.loader
        if loader is None:
            return
        p.loader = None
        if p.pooled is not None:
            p.pooled.detach()
        if park and p.it is not None and sv.warm_loaders:
            p.it.close()  # its readers stop; the ring, backends and threads stay for the next stream
            sv._park(p.opts["key"], loader, p.loader_memory)
        else:
            loader.close()
            sv._release(p.loader_memory)
        sv.metrics.share_producers.dec()
        event(sv.log, "share_producer_end", level=logging.DEBUG, producer=p.id, dataset=p.dataset,
              start=p.start, produced=p.produced, parked=park)

    def close(self) -> None:
        """At shutdown: close every producer (their streams have ended)."""
        with self.cond:
            self._closed = True
            out = [p for ps in self.groups.values() for p in ps if not p.subs and not p.producing]
            for p in out:
                self._drop(p)
        for p in out:
            self._close_loader(p, park=False)


def _peer(context: Any) -> str:
    try:
        return context.peer()
    except Exception:
        return "?"
