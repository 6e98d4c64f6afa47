"""`StripedReceiver`: the receiving half of one epoch drawn from several servers at once.

Its threads carry out what the `Schedule` decides (schedule.py says what that is): one hand-out
thread (`run`: resolves the addresses, watches for stalls, hands the batches out of the reorder
buffer into the pass's queue in plan order) and `server_window` request slots per server
(`worker.FetchWorker`). One re-entrant lock guards the schedule (`cancel` may run in a finalizer),
with two conditions on it: `cond` wakes the request slots and held streams (a block done, a
request over, the window moved, a server's state), `arrived` the hand-out thread (the head batch
came, an error): waking every slot for every batch cost the client more CPU than receiving it.

The retry budget is the loader's: no new batch for `retry_timeout_s` (or more than `max_retries`
consecutive failures) while failures occur ends the epoch with `RemoteError`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

from gdsload.service.client.link import Attempts, Link, resolve
from gdsload.service.client.receive import END, Failed, Receiver
from gdsload.service.client.stripe.model import Fetch
from gdsload.service.client.stripe.policy import StripePolicy
from gdsload.service.client.stripe.schedule import Schedule
from gdsload.service.client.stripe.worker import FetchWorker
from gdsload.v1 import feed_pb2 as pb


class StripedReceiver(Receiver):
    """One epoch's batches from every healthy server, handed out in plan order (steps from
    `position` to `end`, global positions)."""

    def __init__(self, link: Link, template: pb.BatchRequest, *, epoch: int, position: int, global_batch: int,
                 end: int, prefetch: int, policy: StripePolicy, dataset_id: str | None, stages: Any = None):
        super().__init__(link, template, epoch=epoch, global_batch=global_batch, prefetch=prefetch, stages=stages)
        self.policy = policy
        self.dataset_id = dataset_id
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        self.arrived = threading.Condition(lock)
        # one stream per server (block_stride) needs blocks of several steps; a share group's
        # producers are per request position, so its requests stay one per block
        self.schedule = Schedule(policy, first_step=position // global_batch, end_step=end // global_batch,
                                 now=time.monotonic(), stats=link, budget=Attempts(link), backoff=link.backoff,
                                 retry_timeout_s=link.retry_timeout_s, stride_ok=not template.share,
                                 known=dict(link.probed.get(dataset_id or "", {})))
        self.threads: list[threading.Thread] = []
        self._dropped = False  # cancel() was called: nobody reads the queue any more
        self._watched_at = 0.0

    # -- carrying out the schedule's answers (the lock is held) ------------------------------------------
    def settle(self, cancel: Iterable[Fetch] = (), wake: bool = True) -> None:
        """Cancel the calls of `cancel`; end the epoch if the schedule failed it; wake the slots."""
        for f in cancel:
            call = f.call
            if call is not None:
                call.cancel()
        if self.schedule.error is not None and not self.stop.is_set():
            self.stop.set()
            self.arrived.notify_all()
            wake = True
        if wake:
            self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            self.schedule.fail(exc)
            self.settle()

    def cancel_calls(self) -> None:
        self._dropped = True
        self._halt()

    def _halt(self) -> None:
        self.stop.set()
        for _ in range(3):  # the sets may change under us (no lock here: see cancel)
            try:
                for f in self.schedule.stop_all():
                    call = f.call
                    if call is not None:
                        call.cancel()
                return
            except RuntimeError:
                continue

    # -- the hand-out thread ---------------------------------------------------------------------------
    def _resolve(self) -> None:
        """(Re)resolve the addresses when due; start the slots of new servers, cancel the
        requests of vanished ones."""
        now = time.monotonic()
        if not self.schedule.resolve_due(now):
            return
        answers: dict[str, list[Any] | str] = {}
        for address in self.link.addresses:
            try:
                answers[address] = resolve(address)
            except OSError as exc:
                answers[address] = str(exc)
        with self.cond:
            joined, gone = self.schedule.on_resolved(answers, now)
            for srv in joined:
                for slot in range(self.policy.server_window):
                    t = threading.Thread(target=FetchWorker(self, srv).run, daemon=True,
                                         name=f"gdsload-stripe-{len(self.schedule.servers)}.{slot}")
                    self.threads.append(t)
                    t.start()
            self.settle(gone)

    def _watch(self) -> None:
        """Cancel requests silent for `stall_timeout_s`; end a spent budget; re-resolve names."""
        now = self._watched_at = time.monotonic()
        link, sch = self.link, self.schedule
        with self.cond:
            stalled, spent = sch.watch(now)
            self.settle(stalled, wake=False)
            if spent:
                address = ", ".join(sch.servers) or ", ".join(link.addresses)
                sch.fail(link.gave_up(sch.budget, sch.last_error, address, resume=True))
                self.settle()
                return
        self._resolve()

    def run(self) -> None:
        sch, poll_s = self.schedule, self.policy.poll_s
        try:
            self._resolve()
            while not sch.done():
                with self.cond:
                    item = sch.take()
                    if item is None and sch.error is None and not self.stop.is_set():
                        t0 = time.monotonic()
                        self.arrived.wait(poll_s)
                        waited = time.monotonic() - t0
                        for address in sch.head_servers():
                            self.link.bump(address, wait_s=waited)
                    error = sch.error
                if error is not None:
                    self._halt()
                    self._put_final(Failed(error))
                    return
                if self.stop.is_set():
                    return
                if item is None:
                    self._head_missing()
                    continue
                sch.head_came()
                if time.monotonic() - self._watched_at > poll_s:  # also when batches flow: stalls elsewhere
                    self._watch()
                if not self.put(item, on_full=self._watch):
                    return
                with self.cond:
                    if sch.handed():  # the window moved a block
                        self.cond.notify_all()
            self._halt()
            self._put_final(END)
        except BaseException as exc:  # a bug: hand it to the consumer instead of hanging it
            self._halt()
            self._put_final(Failed(exc))

    def _head_missing(self) -> None:
        sch = self.schedule
        with self.cond:
            if sch.head_waits(time.monotonic()):  # no batch at all for retry_timeout_s: give up
                sch.fail(self.link.gave_up(sch.budget, sch.last_error, ", ".join(sch.servers), resume=True))
                self.settle()
                return
        self._watch()

    def _put_final(self, item: Any) -> None:
        """The last item, queued even though `stop` is set (unless the consumer is gone)."""
        self.failed = isinstance(item, Failed)
        while True:
            try:
                self.queue.put(item, timeout=self.policy.poll_s)
                return
            except queue.Full:
                if self._dropped:
                    return
