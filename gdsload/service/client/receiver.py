"""The iterator the training loop holds for one `RemoteLoader` pass (`_RemoteEpoch`): it hands
out what its receiver queued (`single.SingleReceiver`, or `stripe.receiver.StripedReceiver`) and
moves the loader's cursor.

Lifetime: the receiver's threads hold the connection state (`Link`) and their own queue, never
the loader nor the epoch iterator, and the loader refers to its epoch weakly. A loader or iterator
dropped mid-epoch is therefore collected, and its finalizer cancels the stream at once.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Any

from gdsload.errors import PassStopped
from gdsload.service.client.receive import END, Delivery
from gdsload.service.client.single import SingleReceiver
from gdsload.service.client.stripe.policy import StripePolicy
from gdsload.service.client.stripe.receiver import StripedReceiver
from gdsload.service.protocol import status


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
        self.receiver: SingleReceiver | StripedReceiver
        if loader.striped:
            policy = StripePolicy(stripe_batches=loader.stripe_batches, server_window=loader.server_window,
                                  stall_timeout_s=loader.stall_timeout_s,
                                  resolve_interval_s=loader.resolve_interval_s)
            self.receiver = StripedReceiver(
                loader._link, loader._request(epoch, position), epoch=epoch, position=position,
                global_batch=plan.global_batch, end=plan.end_position, prefetch=loader.prefetch,
                policy=policy, dataset_id=plan.dataset_id, stages=loader._stages)
        else:
            self.receiver = SingleReceiver(loader._link, loader._request(epoch, position), epoch=epoch,
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
        self.receiver.charge_wait(waited)  # (striped: the receiver charges the servers it waits on)
        if isinstance(item, Delivery):
            self.cursor.advance(self, self.epoch, item.position)
            L._stats["batches"] += 1
            L._stats["shared_batches"] += bool(item.shared)
            L._stats["bytes"] += item.nbytes
            return L._convert(item.batch)
        if item is END:
            self._finish()
            raise StopIteration
        self.close()
        raise item.error

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
