"""The receiving side of a `RemoteLoader` epoch: the thread that streams and assembles batches
(`_Receiver`: one server at a time, failing over) and the iterator the training loop holds
(`_RemoteEpoch`), which hands batches out in plan order and moves the loader's cursor.

Lifetime: the receiver thread holds the connection state (`_Link`) and its own queue, never the
loader nor the epoch iterator, and the loader refers to its epoch weakly. A loader or iterator
dropped mid-epoch is therefore collected, and its finalizer cancels the stream at once.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
import weakref
from typing import Any

import grpc

from gdsload.errors import PassStopped
from gdsload.service.protocol import status, wire
from gdsload.service.client.link import _Attempts, _Link, _Retry, resolve
from gdsload.v1 import feed_pb2 as pb


class _Receiver:
    """The receiving half of one epoch, run by its thread: streams from the link's servers,
    assembles batches and queues them (at most `prefetch`), resuming after each failure from the
    position after the last complete batch.

    It holds the link, a request template and its queue, never the loader nor the epoch
    iterator: those stay collectable while the thread waits, and their finalizer calls `cancel`.
    """

    def __init__(self, link: _Link, template: pb.BatchRequest, *, epoch: int, position: int,
                 global_batch: int, end: int, prefetch: int, stages: Any = None):
        self.link = link
        self.stages = stages  # the loader's StageTimes: "receive" is timed here
        self.template = template
        self.epoch = epoch
        self.G = global_batch
        self.end = end
        self.next_request = position
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.pid = os.getpid()
        self.stop = threading.Event()
        self._call_lock = threading.Lock()
        self._call: Any = None
        self._waiting_since: float | None = None
        self._idle_cancelled = False

    def cancel(self) -> None:
        """Stop the thread and cancel the call in flight; never blocks (safe in a finalizer)."""
        if os.getpid() != self.pid:  # a forked child: the thread, the call and their locks are the parent's
            return
        self.stop.set()
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()

    def watchdog(self) -> None:
        """Cancel a stream that sent nothing for `deadline_s` (it is then resumed)."""
        since = self._waiting_since
        if since is not None and time.monotonic() - since > self.link.deadline_s:
            with self._call_lock:
                if self._call is not None and self._waiting_since is not None:
                    self._idle_cancelled = True
                    self._call.cancel()

    def _put(self, item: tuple) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _request(self) -> pb.BatchRequest:
        req = pb.BatchRequest()
        req.CopyFrom(self.template)
        req.start_position = self.next_request
        return req

    def run(self) -> None:
        link = self.link
        attempts = _Attempts(link)
        corrupt: set[str] = set()  # addresses that answered DATA_LOSS since the last batch
        last_error = "no attempt"
        try:
            while self.next_request < self.end and not self.stop.is_set():
                address = link.address()
                progressed = False
                try:
                    call = link.channels.stub(address).StreamBatches(
                        self._request(), timeout=link.stream_deadline_s, metadata=link.metadata)
                    with self._call_lock:
                        self._call = call
                    if self.stop.is_set():
                        call.cancel()
                        return
                    link.mark(address, state="ok", in_flight=(self.end - self.next_request) // self.G)
                    asm = wire.BatchAssembler(link.channels.bodies)
                    it = iter(call)
                    stages = self.stages
                    shared = False
                    while True:
                        t0 = time.perf_counter()
                        self._waiting_since = time.monotonic()
                        try:
                            chunk, data = next(it)
                        except StopIteration:
                            break
                        finally:
                            self._waiting_since = None
                        if chunk.chunk_index == 0:  # a share group's copy (BatchHeader.shared)
                            shared = chunk.header.shared
                        batch = _assemble(asm, call, chunk, data)
                        if stages is not None:
                            stages.add("receive", time.perf_counter() - t0)
                        if batch is None:
                            continue
                        expected = self.next_request + self.G
                        if chunk.epoch != self.epoch or chunk.position != expected:
                            raise wire.ProtocolError(
                                f"got the batch of epoch {chunk.epoch} ending at position {chunk.position}, "
                                f"expected epoch {self.epoch} position {expected}")
                        nbytes = wire.body_nbytes(batch)
                        if not self._put(("batch", batch, expected, nbytes, shared)):
                            return
                        link.bump(address, batches=1, bytes=nbytes)
                        self.next_request = expected
                        progressed = True
                        attempts.reset()
                        corrupt.clear()
                    if self.next_request < self.end and not progressed:
                        raise _Retry(f"{address} ended the stream without a batch (draining?)")
                except grpc.RpcError as err:
                    if self.stop.is_set():
                        return
                    idle = self._idle_cancelled
                    self._idle_cancelled = False
                    if not idle and status.is_elsewhere(err):
                        # This server's copy is corrupt: ask each other address once, not this one again.
                        corrupt.add(address)
                        link.bump(address, failures=1)
                        if corrupt.issuperset(link.addresses):
                            self._put(("error", link.corrupt_everywhere(err, address)))
                            return
                        link.failover(address)
                        continue
                    if not idle and not status.is_retryable(err):
                        self._put(("error", status.from_rpc_error(err, address)))
                        return
                    last_error = (f"no message for {link.deadline_s} s from {address}" if idle
                                  else str(status.from_rpc_error(err, address)))
                    attempts.fail()
                except (_Retry, wire.ProtocolError) as exc:
                    last_error = str(exc)
                    attempts.fail()
                finally:
                    with self._call_lock:
                        self._call = None
                    link.mark(address, in_flight=0)
                if attempts.failures:
                    link.bump(address, failures=1)
                if attempts.failures and not progressed:
                    link.mark(address, state="down")
                    if attempts.spent():
                        self._put(("error", link.gave_up(attempts, last_error, address, resume=True)))
                        return
                    link.failover(address)
                    if self.stop.wait(attempts.delay()):
                        return
                elif attempts.failures:  # broke after some batches: retry at once, same address
                    attempts.reset()
                    link.reconnect()
            if not self.stop.is_set():
                self._put(("end",))
        except BaseException as exc:  # a bug: hand it to the consumer instead of hanging it
            self._put(("error", exc))



def _assemble(asm: wire.BatchAssembler, call: Any, chunk: pb.BatchChunk, data: Any) -> Any:
    """`asm.add`; a batch that fails its CRC32 check (`status.CorruptCopy`, handled as its
    server's DATA_LOSS) cancels its call first: the server would go on sending."""
    try:
        return asm.add(chunk, data)
    except status.CorruptCopy:
        call.cancel()
        raise


class _RemoteEpoch:
    """One pass, the consumer's side: `__next__` hands out what the receiver thread queued and
    moves the loader's cursor. Dropping it (or its loader) cancels the receiver's stream."""

    def __init__(self, loader: Any):  # a RemoteLoader (no import: no cycle)
        self.loader = loader
        plan = loader.plan
        self._done = True  # until the receiver starts: `close()` has nothing to stop
        self._stopped_by: str | None = None  # `stop(why)`: the loader's call that ended this pass
        self.cursor = loader.cursor
        epoch, position = self.cursor.begin(self)  # the live pass (gdsload.frontend.cursor)
        self.epoch = epoch
        try:
            self._start(loader, plan, epoch, position)
        except BaseException:
            self.cursor.detach(self)
            raise

    def _start(self, loader: Any, plan: Any, epoch: int, position: int) -> None:
        self.receiver: _Receiver | _StripedReceiver
        if loader.striped:
            self.receiver = _StripedReceiver(
                loader._link, loader._request(epoch, position), epoch=epoch, position=position,
                global_batch=plan.global_batch, end=plan.end_position, prefetch=loader.prefetch,
                stripe_batches=loader.stripe_batches, server_window=loader.server_window,
                stall_timeout_s=loader.stall_timeout_s, resolve_interval_s=loader.resolve_interval_s,
                dataset_id=plan.dataset_id, stages=loader._stages)
        else:
            self.receiver = _Receiver(loader._link, loader._request(epoch, position), epoch=epoch,
                                      position=position, global_batch=plan.global_batch,
                                      end=plan.end_position, prefetch=loader.prefetch, stages=loader._stages)
        self.pid = os.getpid()  # the receiver thread and its call exist in this process only
        self._successor: _RemoteEpoch | None = None
        self._done = False
        self._finalizer = weakref.finalize(self, self.receiver.cancel)
        self.thread = threading.Thread(target=self.receiver.run, name="gdsload-remote", daemon=True)
        self.thread.start()

    def __iter__(self) -> _RemoteEpoch:
        return self

    def __next__(self) -> Any:
        if self.pid != os.getpid():
            return self._next_in_forked_child()
        if self._done:
            if self._stopped_by is not None:
                raise PassStopped(f"this pass was stopped by the loader's {self._stopped_by}: call "
                                  "iter(loader) again for the pass it set up")
            raise StopIteration
        L = self.loader
        t0 = time.perf_counter()
        while True:
            try:
                item = self.receiver.queue.get(timeout=0.25)
                break
            except queue.Empty:
                self.receiver.watchdog()
                if not self.thread.is_alive() and self.receiver.queue.empty():
                    self.close()
                    raise status.RemoteError("the receiver thread ended without a result",
                                             code="INTERNAL") from None
        waited = time.perf_counter() - t0
        L._stats["wait_s"] += waited
        L._stages.add("wait", waited)
        if not L.striped:  # striped: the receiver charges the servers of the batch it waits for
            L._link.bump(L._link.address(), wait_s=waited)
        if item[0] == "batch":
            _, batch, position, nbytes, shared = item
            self.cursor.advance(self, self.epoch, position)
            L._stats["batches"] += 1
            L._stats["shared_batches"] += bool(shared)
            L._stats["bytes"] += nbytes
            return L._convert(batch)
        if item[0] == "end":
            self._finish()
            raise StopIteration
        self.close()
        raise item[1]

    def _next_in_forked_child(self) -> Any:
        """The parent's iterator, used in a forked child: its receiver thread is not here and its
        queue's lock may be held, so continue with a new iteration of the child's copy of the
        loader, which starts at the loader's cursor (the batch after the last one handed out)."""
        if self._successor is None:
            if self._done:
                raise StopIteration
            self._done = True
            self._successor = iter(self.loader)
        return next(self._successor)

    def __reduce__(self):
        raise TypeError("a gdsload.RemoteLoader iterator cannot be pickled: pickle the loader itself, whose copy "
                        "continues from the loader's state_dict()")

    def _finish(self) -> None:
        self.cursor.end(self, self.epoch)  # the next pass is the next epoch
        self.close()

    def stop(self, why: str) -> None:
        """`load_state_dict()` or `set_epoch()` while this pass is live (`gdsload.frontend.cursor`):
        cancel its stream now and make a later `next()` say why."""
        if not self._done:
            self._stopped_by = why
        self.close()

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self._finalizer()  # cancels the call (the parent's is left alone in a forked child)
        if os.getpid() == self.pid and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        self.cursor.detach(self)


# -- striping ----------------------------------------------------------------------------------------
#: The span a server's pace is measured over (`_Server.pace`): many periods of a CPU quota, and
#: short enough to see a straggler within a second or two.
PACE_S = 2.0
#: A request at the head of the plan silent this long (and over 2 block times old) is hedged
#: (`_StripedReceiver._straggles`): longer than a CPU quota's pause (a 0.1-core container stands
#: still 90 ms of every 100 ms), far shorter than `stall_timeout_s`.
SILENT_S = 0.25


class _Server:
    """One endpoint of a striped epoch: its health and the requests it has in flight."""

    def __init__(self, endpoint):
        self.ep = endpoint
        self.address = endpoint.target
        # new (not probed yet), ok, suspect (stalled: probe first), down (failed: probe after a
        # backoff), refused (another dataset version, or cannot serve this request), gone (left)
        self.state = "new"
        self.fails = 0  # consecutive failures (backoff)
        self.next_try = 0.0
        self.probing = False
        self.fetches: set[_Fetch] = set()
        self.batch_s = 0.0  # its time per batch (`pace`; 0: none yet)
        self.arrivals: collections.deque[float] = collections.deque()  # its batches' arrival times, PACE_S
        self._floor = (0.0, 0.0)  # (batch_s at least, until when): `at_least`
        self.strided = False  # it serves BatchRequest.block_stride (ServerInfo.serves_block_stride)

    def pace(self, now: float) -> None:
        """A batch of it arrived at `now`: `batch_s` becomes its time per batch over the last
        `PACE_S` seconds, counting every request it serves. Not per request, nor from single gaps:
        a server held to a CPU quota (a 0.1-core container runs 10 ms of every 100 ms) sends
        bursts of batches 1 ms apart and then nothing for 90 ms, and one serving two requests
        sends each half as often; read per request and per gap, servers of one speed looked 3-10x
        apart and had their blocks hedged all the time (a stream, and work, each)."""
        a = self.arrivals
        a.append(now)
        while now - a[0] > PACE_S:
            a.popleft()
        if len(a) >= 2:
            self.batch_s = (now - a[0]) / (len(a) - 1)
        floor, until = self._floor
        if now < until and floor > self.batch_s:
            self.batch_s = floor

    def pause(self, seconds: float) -> None:
        """None of its batches were asked for during the `seconds` just past (a stream held back
        by the reorder window): that time is not its slowness."""
        self.arrivals = collections.deque(t + seconds for t in self.arrivals)

    def at_least(self, batch_s: float) -> None:
        """Its next batch takes at least `batch_s` (a request of it was overtaken before it sent
        anything), for the next `PACE_S` seconds."""
        self._floor = (batch_s, time.monotonic() + PACE_S)
        self.batch_s = max(self.batch_s, batch_s)


class _Fetch:
    """One request in flight: steps [next, end) of one block from one server; with `stride` > 1,
    after that block the blocks `block + stride`, `block + 2 * stride`, ... to the epoch's end
    (one stream for all of a server's blocks: `_StripedReceiver`)."""

    def __init__(self, server: _Server, block: int, next_step: int, end: int, stride: int = 0):
        self.server = server
        self.block = block
        self.next = next_step
        self.end = end
        self.stride = stride
        self.got = 0  # batches delivered from its current block
        self.held = False  # its current block waited for the window (`_hold`): not a block time
        self.started = time.monotonic()
        self.last = self.started  # when the last message arrived (the stall clock)
        self.delivered_at = self.started  # when its last whole batch arrived
        self.call: Any = None
        self.reason: str | None = None  # why it was cancelled: stall, done, gone, stop

    def claims(self, block: int) -> bool:
        """Whether `block` is a later block of this stream (one of its server's, still to come)."""
        return (self.stride > 0 and self.reason is None and block > self.block
                and (block - self.block) % self.stride == 0)


class _StripedReceiver:
    """The receiving half of one epoch drawn from several servers at once.

    The epoch's steps (batches of this rank) are cut into blocks of `stripe_batches` consecutive
    steps; block b is asked of the b-th healthy server modulo their number (addresses sorted), a
    stable assignment, so jobs with the same plan and servers put step k on the same server. Each
    server runs `server_window` requests at a time (`StreamBatches` with `start_position` at the
    block's first missing step and `max_batches` its remaining steps). Only blocks within
    `servers x server_window` blocks of the plan-order head are asked for, so what arrives out of
    order waits in a reorder buffer of at most that many blocks; batches leave it in plan order
    into the epoch's queue (`prefetch`).

    One stream per server: a server whose `ServerInfo.serves_block_stride` is true gets its own
    blocks on one request (`BatchRequest.block_stride` = the number of healthy servers) instead of
    one request per block: a request costs a server ~1 ms of CPU (the call, the bulk ticket, a
    loader taken, positioned and parked), which on a server held to 0.1 core was a fifth of what
    it spent per byte of raw batches, and its loader reads ahead across its blocks. Such a stream
    claims its server's later blocks: nobody else asks for them unless that server is a straggler
    (below), and its batches wait (the stream unread, so the server stops) while their block is
    beyond the window. The stream is cancelled and the server asked again, from its lowest block
    still missing, when the healthy servers change or when its next block is already done or
    being fetched elsewhere. A server's other request slots steal and hedge as before.

    Stealing: a server with none of its own blocks left in the window takes the lowest block no
    one is fetching whose owner has all its requests in flight; when the head block is in flight on
    another server for over twice the typical block time, or when by the servers' measured rates
    the idle server would deliver the rest in under half the time the other still needs (a
    straggler: `_straggles`), an idle server asks for it too. A request silent for
    `stall_timeout_s`, or one overtaken by such a copy before it sent anything, is cancelled, its
    server is probed (a unary call bounded by `stall_timeout_s`) before it gets work again, and
    its block goes to whoever is idle. A batch that arrives twice (hedged, or after a stall) is dropped.
    A server that fails is retried after a backoff; one that answers another dataset id (or
    FAILED_PRECONDITION: it cannot serve this request) is refused for the epoch; DATA_LOSS
    refuses that server for that block only, and is final once every server answered it.
    `dns:///` addresses are resolved every `resolve_interval_s`: servers that appear join,
    those that vanish leave (their blocks go back to the others).

    The retry budget is the loader's: no new batch for `retry_timeout_s` (or more than
    `max_retries` consecutive failures) while failures occur ends the epoch with `RemoteError`.
    """

    def __init__(self, link: _Link, template: pb.BatchRequest, *, epoch: int, position: int,
                 global_batch: int, end: int, prefetch: int, stripe_batches: int, server_window: int,
                 stall_timeout_s: float, resolve_interval_s: float, dataset_id: str | None,
                 stages: Any = None):
        self.link = link
        self.stages = stages  # the loader's StageTimes: "receive" is timed in each request's thread
        self.template = template
        self.epoch = epoch
        self.G = global_batch
        self.out = position // global_batch  # next step handed out
        self.end = end // global_batch  # steps of the epoch
        self.K = stripe_batches
        self.W = server_window
        self.stall_s = stall_timeout_s
        self.resolve_s = resolve_interval_s
        self.dataset_id = dataset_id
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.pid = os.getpid()
        self.stop = threading.Event()
        # one re-entrant lock (cancel() may run in a finalizer) and two conditions on it: `cond`
        # wakes the request slots and held streams (a block done, a request over, the window
        # moved, a server's state), `arrived` the hand-out loop (the head batch came, an error):
        # waking every slot for every batch cost the client more CPU than receiving it
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        self.arrived = threading.Condition(lock)
        self.ready: dict[int, tuple] = {}  # step -> queue item, the reorder buffer
        self.have: set[int] = set()  # steps received (in ready or handed out), this epoch
        self.fetchers: dict[int, set[_Fetch]] = {}  # block -> requests in flight
        self.corrupt: dict[int, set[str]] = {}  # block -> addresses that answered DATA_LOSS
        self.servers: dict[str, _Server] = {}
        self.error: BaseException | None = None
        self.attempts = _Attempts(link)
        self.last_error = "no attempt"
        self.block_s = 0.0  # typical (EWMA) time of a whole block
        self.threads: list[threading.Thread] = []
        self._resolved_at = -1e9
        self._dropped = False  # cancel() was called: nobody reads the queue any more
        self.progress_at = time.monotonic()  # when a batch last arrived (or the head began to wait)
        self._head_waits = False
        self._watched_at = 0.0
        # one stream per server (block_stride) needs blocks of several steps; a share group's
        # producers are per request position, so its requests stay one per block
        self.stride_ok = not template.share

    # -- servers ---------------------------------------------------------------------------------
    def _resolve(self) -> None:
        """(Re)resolve the addresses; start workers for new endpoints, retire vanished ones."""
        now = time.monotonic()
        if now - self._resolved_at < self.resolve_s and self.servers:
            return
        self._resolved_at = now
        found: dict[str, Any] = {}
        failed: list[str] = []
        for address in self.link.addresses:
            try:
                for ep in resolve(address):
                    found.setdefault(ep.target, ep)
            except OSError as exc:
                failed.append(f"{address}: {exc}")
                for srv in self.servers.values():  # keep what it resolved to before
                    if srv.ep.source == address:
                        found.setdefault(srv.address, srv.ep)
        with self.cond:
            if failed and not found:
                self.last_error = "cannot resolve " + "; ".join(failed)
            for target, ep in found.items():
                if target not in self.servers:
                    srv = self.servers[target] = _Server(ep)
                    self.link.mark(target, state="new", in_flight=0)
                    for slot in range(self.W):
                        t = threading.Thread(target=self._work, args=(srv,), daemon=True,
                                             name=f"gdsload-stripe-{len(self.servers)}.{slot}")
                        self.threads.append(t)
                        t.start()
            for target, srv in self.servers.items():
                if target not in found and srv.state != "gone":
                    srv.state = "gone"
                    self.link.mark(target, state="gone", in_flight=0)
                    for f in list(srv.fetches):
                        self._cancel(f, "gone")
            self.cond.notify_all()

    def _live(self) -> list[str]:
        return sorted(a for a, s in self.servers.items() if s.state == "ok")

    def _probe(self, srv: _Server) -> None:
        """Ask a server that is new, failed or stalled whether it serves our dataset, and whether
        it serves `block_stride` (unary calls bounded by `stall_timeout_s`), then mark it ok, down
        or refused."""
        link = self.link
        try:
            timeout = min(link.deadline_s, self.stall_s)
            stub = link.channels.stub(srv.address, srv.ep.tls_name)
            if self.template.dataset and self.dataset_id:
                info = stub.ListDatasets(pb.ListDatasetsRequest(name=self.template.dataset), timeout=timeout,
                                         metadata=link.metadata).datasets[0]
                if info.dataset_id != self.dataset_id:
                    self._refuse(srv, status.RemoteError(
                        f"{srv.address} serves dataset {self.template.dataset!r} with id {info.dataset_id}, "
                        f"this loader planned with {self.dataset_id}: another version of the dataset, not "
                        f"used", code="FAILED_PRECONDITION", address=srv.address))
                    return
            server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout, metadata=link.metadata)
        except grpc.RpcError as err:
            if not (status.is_retryable(err) or status.is_elsewhere(err)):
                self._refuse(srv, status.from_rpc_error(err, srv.address))
                return
            with self.cond:
                self._failed(srv, str(status.from_rpc_error(err, srv.address)))
            return
        with self.cond:
            if srv.state != "gone":
                srv.state = "ok"
                srv.fails = 0
                srv.strided = server.serves_block_stride and self.stride_ok
                self.link.mark(srv.address, state="ok")
            self.cond.notify_all()

    def _refuse(self, srv: _Server, exc: BaseException) -> None:
        with self.cond:
            if srv.state != "gone":
                srv.state = "refused"
                self.link.mark(srv.address, state="refused")
                self.link.bump(srv.address, failures=1)
            self.last_error = str(exc)
            if all(s.state in ("refused", "gone") for s in self.servers.values()):
                self._fail(exc)
            self.cond.notify_all()

    def _failed(self, srv: _Server, error: str, state: str = "down") -> None:
        """Count a failed attempt on `srv` and back off (the lock is held)."""
        self.link.bump(srv.address, failures=1)
        self.last_error = error
        self.attempts.fail()
        srv.fails += 1
        if srv.state not in ("gone", "refused"):
            srv.state = state
            self.link.mark(srv.address, state=state)
        srv.next_try = time.monotonic() + self.link.backoff(srv.fails)
        self.cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.stop.set()
        self.cond.notify_all()
        self.arrived.notify_all()

    # -- blocks ------------------------------------------------------------------------------------
    def _first_missing(self, block: int) -> int:
        step = max(block * self.K, self.out)
        end = min((block + 1) * self.K, self.end)
        while step < end and step in self.have:
            step += 1
        return step

    def _pick(self, srv: _Server) -> _Fetch | None:
        """The next request for `srv` (the lock is held): its own lowest block in the window, else
        the lowest block no one fetches whose owner has no free slot, else (a straggler at the
        head) the head block."""
        live = self._live()
        median = self._median_batch_s()
        if srv.address not in live or len(srv.fetches) >= self._window(srv, median):
            return None
        head = self.out // self.K
        last = min(head + len(live) * self.W, -(-self.end // self.K))
        free: list[tuple[int, int]] = []
        streams = [f for s in self.servers.values() for f in s.fetches if f.stride]
        for b in range(head, last):
            start = self._first_missing(b)
            if start >= min((b + 1) * self.K, self.end) or srv.address in self.corrupt.get(b, ()):
                continue
            claim = next((f for f in streams if f.claims(b)), None)
            if claim is not None and (claim.server is srv or self._window(claim.server, median) == self.W):
                continue  # a later block of a server's stream (stolen only from a straggler)
            if not self.fetchers.get(b):
                owner = live[b % len(live)]
                if owner == srv.address:
                    if srv.strided and len(live) > 1 and not any(f.stride and f.reason is None for f in srv.fetches):
                        return self._start(srv, b, start, stride=len(live))
                    return self._start(srv, b, start)
                if (self._busy(self.servers[owner]) >= self._window(self.servers[owner], median)  # owner busy: steal it
                        or owner in self.corrupt.get(b, ())):  # or cannot serve it
                    free.append((b, start))
        if free:
            return self._start(srv, *free[0])
        b = head
        start = self._first_missing(b)
        ff = self.fetchers.get(b, set())
        if (b < last and start < min((b + 1) * self.K, self.end) and len(ff) == 1
                and srv.address not in self.corrupt.get(b, ())
                and all(f.server is not srv for f in ff) and self._straggles(next(iter(ff)), srv, start)):
            return self._start(srv, b, start)
        return None

    @staticmethod
    def _busy(srv: _Server) -> int:
        """`srv`'s requests that are not being cancelled. A cancelled stream of its own blocks
        (its block was done elsewhere) leaves its slot free to start the next one at once: its
        blocks are not stolen meanwhile (each steal, and each stream that then finds its next
        block stolen, is one more request for a server)."""
        return sum(1 for f in srv.fetches if f.reason is None)

    def _median_batch_s(self) -> float:
        """The median pace (`_Server.batch_s`) of the healthy servers with one; 0 with fewer than two."""
        rates = sorted(s.batch_s for s in self.servers.values() if s.batch_s > 0 and s.state == "ok")
        return rates[(len(rates) - 1) // 2] if len(rates) >= 2 else 0.0

    def _window(self, srv: _Server, median: float | None = None) -> int:
        """Requests `srv` may have in flight: `server_window`, or 1 while its batches come over
        2.5x slower than the median server's (`median`: `_median_batch_s()`, computed once per
        pick). A straggler then works on one block at a time, which it finishes in half the time
        two would take, and the others take the blocks it would have held."""
        median = self._median_batch_s() if median is None else median
        if self.W > 1 and srv.batch_s > 0 and median > 0 and srv.batch_s > 2.5 * median:
            return 1
        return self.W

    def _straggles(self, f: _Fetch, idle: _Server, start: int) -> bool:
        """Whether the idle server `idle` should ask for the head block that `f` is fetching: `f`
        has taken over twice the typical block time and sent nothing for `SILENT_S` (a block time,
        if longer), or, by the servers' paces (`_Server.pace`), `f`'s server is at least 3x slower
        and `idle` would deliver the rest (plus a batch's time to start) in under half the time
        `f`'s server still needs (a
        server several times slower than the others is overtaken at once instead of after two
        block times; servers within 3x of each other, as decoding servers' rates jitter, are not:
        a copy overtaken before it sent anything marks its server suspect)."""
        now = time.monotonic()
        if self.block_s > 0 and now - f.started > 2 * self.block_s and now - f.last > max(SILENT_S, self.block_s):
            return True
        slow, fast = f.server.batch_s, idle.batch_s
        if not (slow > 0 and fast > 0) or slow < 3 * fast:  # rates this close: noise, not a straggler
            return False
        left = (f.end - f.next) * slow - (now - f.delivered_at)  # f's remaining time, by its server's rate
        return (f.end - start + 1) * fast < 0.5 * left

    def _start(self, srv: _Server, block: int, start: int, stride: int = 0) -> _Fetch:
        f = _Fetch(srv, block, start, min((block + 1) * self.K, self.end), stride)
        self.fetchers.setdefault(block, set()).add(f)
        srv.fetches.add(f)
        self._in_flight(srv)
        return f

    def _in_flight(self, srv: _Server) -> None:
        self.link.mark(srv.address, in_flight=sum(f.end - f.next for f in srv.fetches))

    def _cancel(self, f: _Fetch, reason: str) -> None:
        if f.reason is None:
            f.reason = reason
        call = f.call
        if call is not None:
            call.cancel()

    def _finish(self, f: _Fetch) -> None:
        """`f` is over (the lock is held)."""
        self.fetchers.get(f.block, set()).discard(f)
        f.server.fetches.discard(f)
        self._in_flight(f.server)
        self.cond.notify_all()

    # -- worker: one request slot of one server ----------------------------------------------------
    def _work(self, srv: _Server) -> None:
        try:
            while not self.stop.is_set():
                with self.cond:
                    if srv.state in ("gone", "refused"):
                        return
                    now = time.monotonic()
                    fetch = None
                    if srv.state != "ok":
                        if srv.probing or now < srv.next_try:
                            self.cond.wait(min(0.25, max(0.01, srv.next_try - now)))
                            continue
                        srv.probing = True
                    else:
                        fetch = self._pick(srv)
                        if fetch is None:
                            self.cond.wait(0.25)
                            continue
                if fetch is None:
                    try:
                        self._probe(srv)
                    finally:
                        srv.probing = False
                    continue
                self._fetch(fetch)
        except BaseException as exc:  # a bug: hand it to the consumer instead of hanging it
            with self.cond:
                self._fail(exc)

    def _fetch(self, f: _Fetch) -> None:
        srv, link = f.server, self.link
        req = pb.BatchRequest()
        req.CopyFrom(self.template)
        req.start_position = f.next * self.G
        if f.stride:  # this server's blocks from here to the epoch's end, on one stream
            req.block_batches, req.block_stride = self.K, f.stride
        else:
            req.max_batches = f.end - f.next
        try:
            call = link.channels.stub(srv.address, srv.ep.tls_name).StreamBatches(
                req, timeout=link.stream_deadline_s, metadata=link.metadata)
            f.call = call
            if self.stop.is_set() or f.reason is not None:
                call.cancel()
            asm = wire.BatchAssembler(link.channels.bodies)
            stages = self.stages
            t0 = time.perf_counter()
            shared = False
            for chunk, data in call:
                f.last = time.monotonic()
                if chunk.chunk_index == 0:  # a share group's copy (BatchHeader.shared)
                    shared = chunk.header.shared
                batch = _assemble(asm, call, chunk, data)
                if stages is not None:
                    stages.add("receive", time.perf_counter() - t0)
                if batch is None:
                    t0 = time.perf_counter()
                    continue
                expected = (f.next + 1) * self.G
                if chunk.epoch != self.epoch or chunk.position != expected:
                    raise wire.ProtocolError(
                        f"got the batch of epoch {chunk.epoch} ending at position {chunk.position}, "
                        f"expected epoch {self.epoch} position {expected}")
                if f.stride:
                    self._hold(f)
                self._deliver(f, ("batch", batch, expected, wire.body_nbytes(batch), shared))
                if f.stride and f.next >= f.end and f.reason is None:
                    self._advance(f)
                if f.reason is not None:
                    break  # cancelled (stall, a hedged copy done, stop): the call is being cancelled
                t0 = time.perf_counter()
            with self.cond:
                if f.reason in ("stall", "overtaken"):  # (a call cancelled after its last batch ends quietly)
                    self._stalled(f)
                elif f.next < f.end and f.reason is None:
                    self._failed(srv, f"{srv.address} ended the stream of steps {req.start_position // self.G}-"
                                      f"{f.end - 1} before step {f.next} (draining?)")
                elif f.next >= f.end:
                    if not f.stride:  # (a stream of blocks times each block in `_advance`)
                        self._block_done(time.monotonic() - f.started, req.max_batches)
                    srv.fails = 0
        except grpc.RpcError as err:
            with self.cond:
                if self.stop.is_set() or f.reason in ("done", "gone", "stop"):
                    return
                if f.reason in ("stall", "overtaken"):
                    self._stalled(f)
                elif status.is_elsewhere(err):
                    bad = self.corrupt.setdefault(f.block, set())
                    bad.add(srv.address)
                    link.bump(srv.address, failures=1)
                    if bad.issuperset(a for a, s in self.servers.items() if s.state not in ("gone", "refused")):
                        self._fail(link.corrupt_everywhere(err, srv.address))
                elif err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._refuse(srv, status.from_rpc_error(err, srv.address))
                elif status.is_retryable(err):
                    self._failed(srv, str(status.from_rpc_error(err, srv.address)))
                else:
                    self._fail(status.from_rpc_error(err, srv.address))
        except wire.ProtocolError as exc:
            with self.cond:
                self._failed(srv, str(exc))
        finally:
            with self.cond:
                f.call = None
                self._finish(f)

    def _block_done(self, took: float, steps: int) -> None:
        """A block of `steps` steps took `took` s: the typical block time (lock held)."""
        took *= self.K / max(1, steps)
        self.block_s = took if not self.block_s else 0.8 * self.block_s + 0.2 * took

    def _hold(self, f: _Fetch) -> None:
        """Wait while the block of `f`'s batch lies beyond the window (`servers x server_window`
        blocks from the head): the stream is not read meanwhile, so its server stops. A block
        before it that nobody fetches or claims (its server failed) ends the hold: `f` is
        cancelled when its server has no other request slot free to take that block."""
        with self.cond:
            held = False
            since = time.monotonic()
            while (f.reason is None and not self.stop.is_set()
                   and f.block >= self.out // self.K + max(1, len(self._live())) * self.W):
                self.cond.wait(0.1)
                f.last = time.monotonic()  # held here, not silent
                held = True
                if (f.last - since > 0.1 and len(f.server.fetches) >= self._window(f.server)
                        and self._orphan(f.block)):
                    self._cancel(f, "done")
            if held:  # the block's clock and its server's rate start now, not while it was held
                f.server.pause(f.last - since)
                f.started = f.delivered_at = f.last
                f.held = True

    def _orphan(self, below: int) -> bool:
        """Whether a block from the head to `below` is missing, fetched by nobody and not claimed
        by a healthy server's stream (lock held)."""
        streams = [g for s in self.servers.values() if s.state == "ok" for g in s.fetches if g.stride]
        for b in range(self.out // self.K, below):
            if (self._first_missing(b) < min((b + 1) * self.K, self.end) and not self.fetchers.get(b)
                    and not any(g.claims(b) for g in streams)):
                return True
        return False

    def _advance(self, f: _Fetch) -> None:
        """`f`'s block is whole: move it to its server's next block, or end it (the call is
        cancelled and the server asked again) when that block is done or fetched elsewhere or
        the healthy servers changed."""
        with self.cond:
            now = time.monotonic()
            if not f.held:  # (a held block's batches came from buffers at once after the wait)
                self._block_done(now - f.started, f.end - f.block * self.K)
            self.fetchers.get(f.block, set()).discard(f)
            nxt = f.block + f.stride
            live = self._live()
            if nxt * self.K >= self.end:
                f.next = f.end  # the epoch's end: the server ends the stream
                return
            start, end = self._first_missing(nxt), min((nxt + 1) * self.K, self.end)
            if (len(live) != f.stride or live[nxt % len(live)] != f.server.address or start != nxt * self.K
                    or self.fetchers.get(nxt) or f.server.address in self.corrupt.get(nxt, ())):
                self._cancel(f, "done")
                return
            f.block, f.next, f.end, f.got, f.held = nxt, start, end, 0, False
            f.started = f.last = f.delivered_at = now
            self.fetchers.setdefault(nxt, set()).add(f)
            self._in_flight(f.server)

    def _stalled(self, f: _Fetch) -> None:
        """`f` was cancelled as stalled: its server is probed before it gets work again."""
        srv = f.server
        self.link.bump(srv.address, stalls=1)
        if f.reason == "overtaken":  # its next batch takes at least this long: a rate for `_window`/`_straggles`
            srv.at_least(time.monotonic() - f.started)
        self._failed(srv, f"no message for {self.stall_s:g} s from {srv.address} (stalled)"
                     if f.reason == "stall" else f"{srv.address} sent nothing while another "
                     f"server sent its block (stalled?)", state="suspect")

    def _deliver(self, f: _Fetch, item: tuple) -> None:
        step = f.next
        with self.cond:
            f.next += 1
            f.got += 1
            now = time.monotonic()
            f.delivered_at = now
            srv = f.server
            srv.pace(now)
            if step in self.have or step < self.out:
                self.link.bump(f.server.address, duplicates=1)
            else:
                self.have.add(step)
                self.ready[step] = item
                self.link.bump(f.server.address, batches=1, bytes=item[3])
                self.attempts.reset()
                if step == self.out:
                    self.arrived.notify()
            self._in_flight(f.server)
            block = f.block
            self.progress_at = time.monotonic()
            if self._first_missing(block) >= min((block + 1) * self.K, self.end):
                self.cond.notify_all()  # the block is whole: slots may pick the next
                for other in list(self.fetchers.get(block, ())):  # a hedged copy: no longer needed
                    if other is not f:  # one that sent nothing at all, though asked first, was overtaken: a stall
                        stalled = other.last == other.started and not other.got and other.started <= f.started
                        self._cancel(other, "overtaken" if stalled else "done")

    # -- the hand-out loop (the receiver thread) ----------------------------------------------------
    def watchdog(self) -> None:
        """Nothing: the hand-out loop watches the requests itself."""

    def _watch(self) -> None:
        """Cancel requests silent for `stall_timeout_s`; re-resolve names now and then."""
        now = self._watched_at = time.monotonic()
        with self.cond:
            for srv in self.servers.values():
                for f in list(srv.fetches):
                    if f.reason is None and f.call is not None and now - f.last > self.stall_s:
                        self._cancel(f, "stall")
            spent = self.attempts.spent() and not any(s.fetches for s in self.servers.values())
        if spent:
            with self.cond:
                address = ", ".join(self.servers) or ", ".join(self.link.addresses)
                self._fail(self.link.gave_up(self.attempts, self.last_error, address, resume=True))
            return
        self._resolve()

    def cancel(self) -> None:
        """Stop the threads and cancel the calls in flight; never blocks (safe in a finalizer)."""
        if os.getpid() != self.pid:  # a forked child: the threads and calls are the parent's
            return
        self._dropped = True
        self._halt()

    def _halt(self) -> None:
        self.stop.set()
        for _ in range(3):  # the sets may change under us (no lock here: see cancel)
            try:
                for srv in list(self.servers.values()):
                    for f in list(srv.fetches):
                        self._cancel(f, "stop")
                return
            except RuntimeError:
                continue

    def _put(self, item: tuple) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                self._watch()
        return False

    def run(self) -> None:
        try:
            self._resolve()
            while self.out < self.end:
                with self.cond:
                    item = self.ready.pop(self.out, None)
                    if item is None and self.error is None and not self.stop.is_set():
                        t0 = time.monotonic()
                        self.arrived.wait(0.1)
                        waited = time.monotonic() - t0
                        for f in self.fetchers.get(self.out // self.K, ()):
                            self.link.bump(f.server.address, wait_s=waited)
                    error = self.error
                if error is not None:
                    self._halt()
                    self._put_final(("error", error))
                    return
                if self.stop.is_set():
                    return
                if item is None:
                    now = time.monotonic()
                    if not self._head_waits:
                        self._head_waits = True
                        self.progress_at = max(self.progress_at, now)
                    elif now - self.progress_at > self.link.retry_timeout_s:  # no batch at all: give up
                        with self.cond:
                            self.attempts.fail()
                            self.attempts.since = self.progress_at
                            self._fail(self.link.gave_up(self.attempts, self.last_error, ", ".join(self.servers),
                                                         resume=True))
                        continue
                    self._watch()
                    continue
                self._head_waits = False
                if time.monotonic() - self._watched_at > 0.1:  # also when batches flow: stalls elsewhere
                    self._watch()
                if not self._put(item):
                    return
                with self.cond:
                    self.out += 1
                    if self.out % self.K == 0 or self.out >= self.end:  # the window moved a block
                        self.cond.notify_all()
            self._halt()
            self._put_final(("end",))
        except BaseException as exc:  # a bug: hand it to the consumer instead of hanging it
            self._halt()
            self._put_final(("error", exc))

    def _put_final(self, item: tuple) -> None:
        """The last item, queued even though `stop` is set (unless the consumer is gone)."""
        while True:
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                if self._dropped:
                    return
