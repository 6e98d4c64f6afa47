"""The receiving side of a `RemoteLoader` epoch: the thread that streams and assembles batches
(`_Receiver`: one server at a time, failing over) and the iterator the training loop holds
(`_RemoteEpoch`), which hands batches out in plan order and moves the loader's cursor.

Lifetime: the receiver thread holds the connection state (`_Link`) and its own queue, never the
loader nor the epoch iterator, and the loader refers to its epoch weakly. A loader or iterator
dropped mid-epoch is therefore collected, and its finalizer cancels the stream at once.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import grpc

from gdsload.service import status, wire
from gdsload.service.link import _Attempts, _Link, _Retry
from gdsload.v1 import feed_pb2 as pb

if TYPE_CHECKING:
    from gdsload.service.client import RemoteLoader

class _Receiver:
    """The receiving half of one epoch, run by its thread: streams from the link's servers,
    assembles batches and queues them (at most `prefetch`), resuming after each failure from the
    position after the last complete batch.

    It holds the link, a request template and its queue, never the loader nor the epoch
    iterator: those stay collectable while the thread waits, and their finalizer calls `cancel`.
    """

    def __init__(self, link: _Link, template: pb.BatchRequest, *, epoch: int, position: int,
                 global_batch: int, end: int, prefetch: int):
        self.link = link
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
                    asm = wire.BatchAssembler()
                    it = iter(call)
                    while True:
                        self._waiting_since = time.monotonic()
                        try:
                            chunk, data = next(it)
                        except StopIteration:
                            break
                        finally:
                            self._waiting_since = None
                        batch = asm.add(chunk, data)
                        if batch is None:
                            continue
                        expected = self.next_request + self.G
                        if chunk.epoch != self.epoch or chunk.position != expected:
                            raise wire.ProtocolError(
                                f"got the batch of epoch {chunk.epoch} ending at position {chunk.position}, "
                                f"expected epoch {self.epoch} position {expected}")
                        if not self._put(("batch", batch, expected, wire.body_nbytes(batch))):
                            return
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
                if attempts.failures and not progressed:
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



class _RemoteEpoch:
    """One pass, the consumer's side: `__next__` hands out what the receiver thread queued and
    moves the loader's cursor. Dropping it (or its loader) cancels the receiver's stream."""

    def __init__(self, loader: RemoteLoader, epoch: int, position: int):
        self.loader = loader
        self.epoch = epoch
        plan = loader.plan
        self.receiver = _Receiver(loader._link, loader._request(epoch, position), epoch=epoch,
                                  position=position, global_batch=plan.global_batch,
                                  end=plan.end_position, prefetch=loader.prefetch)
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
        L._stats["wait_s"] += time.perf_counter() - t0
        if item[0] == "batch":
            _, batch, position, nbytes = item
            L._position = position
            L._stats["batches"] += 1
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
        self.close()
        self.loader._epoch = self.epoch + 1
        self.loader._position = 0

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self._finalizer()  # cancels the call (the parent's is left alone in a forked child)
        if os.getpid() == self.pid and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        if self.loader._active_epoch() is self:
            self.loader._active = None
