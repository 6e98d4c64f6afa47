"""The striping schedule: which block to ask of which server, when to hedge, steal or cancel.

`Schedule` holds one epoch's striping state (the steps received, the reorder buffer, the requests
in flight per block, the servers and their states) and makes every decision from events: no
threads, no sockets, no clock (each event carries `now`), no randomness of its own (the backoff is
given). The receiving threads (`receiver.StripedReceiver`, `worker.FetchWorker`) call it under
their one lock and carry out what it returns: a request to make (`Fetch`), a wait, a probe, the
requests to cancel. tests/service/test_schedule.py drives it from tables.

The epoch's steps (batches of this rank) are cut into blocks of `stripe_batches` consecutive steps;
block b belongs to the b-th healthy or paused server modulo their number (addresses sorted), a
stable assignment, so jobs with the same plan and servers put step k on the same server. Each
server has `server_window` requests in flight, only for blocks within `servers x server_window`
blocks of the plan-order head, so what arrives out of order waits in a reorder buffer of at most
that many blocks. A server that serves `block_stride` gets all its blocks on one stream (`stride` >
0), which claims its later blocks; the stream is cancelled (and the server asked again from its
lowest missing block) when the healthy servers change or its next block is done or fetched
elsewhere.

Stealing and hedging (`pick`): a server with none of its own blocks left in the window takes the
lowest block no one fetches whose owner has all its requests in flight; it asks for the head block
too when that has been in flight elsewhere for over `hedge_after_blocks` typical block times and
silent for `silent_s`, or at once when by the servers' paces the other is a straggler
(`straggles`). A straggler (`slow_ratio` x the median pace) has one request in flight.

Stalls and cold servers: a request silent for `stall_timeout_s`, or overtaken by another copy
before it sent anything, is cancelled and its server becomes SUSPECT: probed again after a
backoff that grows with each such miss until it delivers a batch. A cold server (one that has
delivered nothing yet this epoch: it is building its pipeline) is the exception: its copy of a
block done elsewhere runs on (its batches are dropped as duplicates) so that it warms, and only
`stall_timeout_s` of silence cancels it. A server's pace comes only from batches it delivered
(`model.Pace`), never from a copy's silence, so a server that was overtaken keeps the full window
and is hedged by time, not at once by pace. (Before, a cold server overtaken once read as a
straggler for good: in one run of four it delivered 0 of 76 batches in two epochs.)

Failures: a failed request makes its server DOWN (probed after the backoff); FAILED_PRECONDITION
or another dataset id makes it REFUSED for the epoch; DATA_LOSS refuses that server for that block
only, and is final once every server answered it. `dns:///` names resolved again add servers and
retire those that vanished (their blocks go back to the others). The retry budget (no new batch
for `retry_timeout_s`, or over `max_retries` failures in a row) ends the epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from gdsload.service.client.stripe import pause
from gdsload.service.client.stripe.actions import EXIT, PROBE, Delivered, Failure, Wait
from gdsload.service.client.stripe.model import Fetch, Server
from gdsload.service.client.stripe.policy import StripePolicy
from gdsload.service.client.stripe.states import FINAL, CancelReason, ServerState

S, C = ServerState, CancelReason


class Stats(Protocol):
    """Where per-server counters go (`link.Link`: `RemoteLoader.stats()["servers"]`)."""

    def bump(self, address: str, **add: float) -> None: ...
    def mark(self, address: str, **values: Any) -> None: ...


class Budget(Protocol):
    """The retry budget (`link.Attempts`): failures in a row since the last batch."""

    failures: int
    since: float

    def fail(self, now: float | None = None) -> None: ...
    def reset(self) -> None: ...
    def spent(self, now: float | None = None) -> bool: ...


class Schedule:
    """One striped epoch's decisions (see the module docstring). Not thread-safe: one lock around
    every call. `first_step`/`end_step`: the steps handed out already and of the epoch."""

    def __init__(self, policy: StripePolicy, *, first_step: int, end_step: int, now: float, stats: Stats,
                 budget: Budget, backoff: Callable[[int], float], retry_timeout_s: float, stride_ok: bool = True,
                 known: Mapping[str, bool] | None = None):
        self.policy = policy
        # address -> serves block_stride, of the servers an earlier pass of the loader probed: not probed
        self.known = known or {}  # again (two calls: 55-60 ms at 0.05 core); one since changed fails its first request
        self.K, self.W = policy.stripe_batches, policy.server_window
        self.out = first_step  # next step handed out
        self.end = end_step
        self.stats = stats
        self.budget = budget
        self.backoff = backoff  # failures in a row -> seconds to wait (with jitter)
        self.stride_ok = stride_ok  # a share group's producers are per request position: one request per block
        self.ready: dict[int, Any] = {}  # step -> its batch, the reorder buffer
        self.have: set[int] = set()  # steps received (in ready or handed out)
        self.fetchers: dict[int, set[Fetch]] = {}  # block -> requests in flight
        self.corrupt: dict[int, set[str]] = {}  # block -> addresses that answered DATA_LOSS
        self.servers: dict[str, Server] = {}
        self.error: BaseException | None = None  # what ends the epoch
        self.last_error = "no attempt"
        self.block_s = 0.0  # typical (EWMA) time of a whole block
        self.resolved_at: float | None = None
        self.retry_timeout_s = retry_timeout_s
        self.opened = self.progress_at = now  # progress_at: when a batch last arrived (or the head began to wait)
        self.waiting_since: float | None = None  # when the hand-out began to wait for the head

    # -- servers -----------------------------------------------------------------------------------
    def resolve_due(self, now: float) -> bool:
        return (self.resolved_at is None or not self.servers
                or now - self.resolved_at >= self.policy.resolve_interval_s)

    def on_resolved(self, answers: dict[str, list[Any] | str], now: float) -> tuple[list[Server], list[Fetch]]:
        """The addresses resolved again: per address its endpoints, or why it did not resolve
        (then what it resolved to before stays). Returns the servers that joined (start their
        slots) and the requests of those that left (cancel them)."""
        self.resolved_at = now
        found: dict[str, Any] = {}
        failed = []
        for address, eps in answers.items():
            if isinstance(eps, str):
                failed.append(f"{address}: {eps}")
                eps = [s.endpoint for s in self.servers.values() if s.endpoint.source == address]
            for ep in eps:
                found.setdefault(ep.target, ep)
        if failed and not found:
            self.last_error = "cannot resolve " + "; ".join(failed)
        joined = []
        for target, ep in found.items():
            if target not in self.servers:
                srv = self.servers[target] = Server(ep, self.policy.pace_s)
                self.stats.mark(target, state=srv.state.value, in_flight=0)
                if target in self.known:
                    self.probe_ok(srv, self.known[target])
                joined.append(srv)
        cancel: list[Fetch] = []
        for target, srv in self.servers.items():
            if target not in found and srv.move(S.GONE):
                self.stats.mark(target, state=S.GONE.value, in_flight=0)
                cancel += self._cancel(srv.fetches, C.GONE)
        return joined, cancel

    def live(self) -> list[str]:
        """The healthy or paused servers' addresses (`Server.laid_out`), sorted: block b is `live[b % len(live)]`'s."""
        return sorted([a for a, s in self.servers.items() if s.laid_out()])

    def work(self, srv: Server, now: float) -> Fetch | Wait | str:
        """What one request slot of `srv` does next: a `Fetch` to run, `PROBE`, a `Wait`, `EXIT`."""
        p = self.policy
        if srv.state in FINAL:
            return EXIT
        if srv.state is S.PAUSED:
            return Wait(p.idle_wait_s)
        if srv.state is not S.OK:
            if srv.probing or now < srv.next_try:
                return Wait(min(p.idle_wait_s, max(p.min_wait_s, srv.next_try - now)))
            srv.probing = True
            return PROBE
        if now - self.opened < p.first_probes_s and any(s.state is S.NEW for s in self.servers.values()):
            return Wait(p.first_probes_s - (now - self.opened))  # (a probe that answers wakes it)
        return self.pick(srv, now) or Wait(p.idle_wait_s)

    def probe_ok(self, srv: Server, strided: bool) -> None:
        """Its probe answered: it gets work (`fails` stays until it delivers: a server that keeps
        stalling is probed less and less often)."""
        srv.probing = False
        if srv.state not in FINAL and srv.move(S.OK):
            self.stats.mark(srv.address, state=S.OK.value)
        srv.strided = strided and self.stride_ok

    def probe_failed(self, srv: Server, error: str, now: float) -> None:
        srv.probing = False
        self._failed(srv, error, now)

    def probe_refused(self, srv: Server, error: BaseException) -> None:
        srv.probing = False
        self._refuse(srv, error)

    def _refuse(self, srv: Server, error: BaseException) -> None:
        if srv.state is not S.GONE:
            if srv.move(S.REFUSED):
                self.stats.mark(srv.address, state=S.REFUSED.value)
            self.stats.bump(srv.address, failures=1)
        self.last_error = str(error)
        if all(s.state in FINAL for s in self.servers.values()):
            self.fail(error)

    def _failed(self, srv: Server, error: str, now: float, state: ServerState = S.DOWN) -> None:
        """A failed attempt on `srv`: counted, and it backs off."""
        self.stats.bump(srv.address, failures=1)
        self.last_error = error
        self.budget.fail(now)
        srv.fails += 1
        if srv.state not in FINAL and srv.state is not S.PAUSED and srv.move(state):  # (`pause.resumed`)
            self.stats.mark(srv.address, state=state.value)
        srv.next_try = now + self.backoff(srv.fails)

    def fail(self, error: BaseException) -> None:
        """End the epoch with `error` (the first one stays)."""
        if self.error is None:
            self.error = error

    # -- picking a request ---------------------------------------------------------------------------
    def first_missing(self, block: int) -> int:
        K, have, out, end = self.K, self.have, self.out, self.end
        step, stop = block * K, (block + 1) * K  # (max/min and `block_end` inline: per block per pick)
        step, stop = (step if step > out else out), (stop if stop < end else end)
        while step < stop and step in have:
            step += 1
        return step

    def block_end(self, block: int) -> int:
        return min((block + 1) * self.K, self.end)

    def pick(self, srv: Server, now: float) -> Fetch | None:
        """The next request for `srv`: its own lowest block in the window, else the lowest block no
        one fetches whose owner has no free slot, else (a straggler at the head) the head block."""
        live = self.live()
        median = self.median_batch_s()
        if srv.address not in live or len(srv.fetches) >= self.window(srv, median):
            return None
        K = self.K
        head = self.out // K
        last = min(head + len(live) * self.W, -(-self.end // K))
        claims, corrupt = self._claims(head, last), self.corrupt
        free = None
        for b in range(head, last):
            start = self.first_missing(b)
            if start >= (b + 1) * K or start >= self.end or (corrupt and srv.address in corrupt.get(b, ())):
                continue
            claim = claims.get(b)
            if claim is not None and (claim.server.state is not S.PAUSED or claim.server.paused_own) and (
                    claim.server is srv or self.window(claim.server, median) == self.W):
                continue  # a later block of a server's stream (stolen from a straggler, or one paused for another job)
            if self.fetchers.get(b):
                continue
            owner = live[b % len(live)]
            if owner == srv.address:
                own_stream = any(f.stride and f.reason is None for f in srv.fetches)
                stride = len(live) if srv.strided and len(live) > 1 and not own_stream else 0
                return self._start(srv, b, start, now, stride)
            other = self.servers[owner]
            if free is None and (other.busy() >= self.window(other, median)  # owner busy: steal it
                                 or owner in self.corrupt.get(b, ())):  # or cannot serve it
                free = (b, start)
        if free is not None:
            return self._start(srv, *free, now)
        start = self.first_missing(head)
        ff = self.fetchers.get(head, set())
        if (head < last and start < self.block_end(head) and len(ff) == 1
                and srv.address not in self.corrupt.get(head, ())
                and all(f.server is not srv for f in ff) and self.straggles(next(iter(ff)), srv, start, now)):
            return self._start(srv, head, start, now)
        return None

    def _claims(self, head: int, last: int) -> dict[int, Fetch]:
        """Blocks `head`..`last - 1` claimed by a stream (`Fetch.claims`), each to the first such
        stream in the servers' and their requests' order: one pass per pick, not one per block."""
        out: dict[int, Fetch] = {}
        for s in self.servers.values():
            for f in s.fetches:
                if f.stride and f.reason is None:
                    first = f.block + f.stride
                    if first < head:
                        first += -(-(head - first) // f.stride) * f.stride
                    for b in range(first, last, f.stride):
                        out.setdefault(b, f)
        return out

    def median_batch_s(self) -> float:
        """The median pace of the healthy servers with one; 0 with fewer than two."""
        rates = sorted([s.pace.batch_s for s in self.servers.values() if s.pace.batch_s > 0 and s.state is S.OK])
        return rates[(len(rates) - 1) // 2] if len(rates) >= 2 else 0.0

    def window(self, srv: Server, median: float | None = None) -> int:
        """Requests `srv` may have in flight: `server_window`, or 1 while its batches come over
        `slow_ratio` times slower than the median server's (`median`: `median_batch_s()`, computed
        once per pick). A straggler then works on one block at a time, which it finishes in half
        the time two would take, and the others take the blocks it would have held."""
        median = self.median_batch_s() if median is None else median
        if self.W > 1 and srv.batch_s > 0 and median > 0 and srv.batch_s > self.policy.slow_ratio * median:
            return 1
        return self.W

    def straggles(self, f: Fetch, idle: Server, start: int, now: float) -> bool:
        """Whether the idle server `idle` should ask for the head block that `f` is fetching: `f`
        has taken over `hedge_after_blocks` typical block times and sent nothing for `silent_s` (a
        block time, if longer), or, by the servers' paces, `f`'s server is at least
        `straggler_ratio` x slower and `idle` would deliver the rest (plus a batch's time to start)
        in under `hedge_share` of the time `f`'s server still needs (a server several times slower
        than the others is overtaken at once instead of after two block times; servers within 3x
        of each other, as decoding servers' rates jitter, are not). A server without a pace (it
        delivered nothing yet) is hedged by time only. A PAUSED server's request is never hedged."""
        p = self.policy
        if f.server.state is S.PAUSED:
            return False
        if (self.block_s > 0 and now - f.started > p.hedge_after_blocks * self.block_s
                and now - f.last > max(p.silent_s, self.block_s)):
            return True
        slow, fast = f.server.batch_s, idle.batch_s
        if not (slow > 0 and fast > 0) or slow < p.straggler_ratio * fast:  # this close: noise
            return False
        left = (f.end - f.next) * slow - (now - f.delivered_at)  # f's remaining time, by its server's pace
        return (f.end - start + 1) * fast < p.hedge_share * left

    def _start(self, srv: Server, block: int, start: int, now: float, stride: int = 0) -> Fetch:
        f = Fetch(srv, block, start, self.block_end(block), now, stride)
        self.fetchers.setdefault(block, set()).add(f)
        srv.fetches.add(f)
        self._in_flight(srv)
        return f

    def _in_flight(self, srv: Server) -> None:
        self.stats.mark(srv.address, in_flight=srv.in_flight())

    def _cancel(self, fetches: Iterable[Fetch], reason: CancelReason) -> list[Fetch]:
        """Mark `fetches` cancelled (a first reason stays); the caller cancels their calls."""
        out = list(fetches)
        for f in out:
            if f.reason is None:
                f.reason = reason
        return out

    def stop_all(self) -> list[Fetch]:
        return self._cancel([f for s in self.servers.values() for f in s.fetches], C.STOP)

    # -- a request's events --------------------------------------------------------------------------
    def on_batch(self, f: Fetch, batch: Any, nbytes: int, now: float) -> Delivered:
        """`f` delivered its step `f.next` (`batch`, of `nbytes`): kept once, in step order."""
        step, srv = f.next, f.server
        f.next, f.got, f.delivered_at = f.next + 1, f.got + 1, now
        srv.delivered += 1
        srv.fails = 0
        pause.resumed(self, srv, now)  # (before its pace counts this batch: `pause.paused`)
        srv.pace.arrived(now)
        out = Delivered()
        if step in self.have or step < self.out:
            self.stats.bump(srv.address, duplicates=1)
        else:
            self.have.add(step)
            self.ready[step] = batch
            self.stats.bump(srv.address, batches=1, bytes=nbytes)
            self.budget.reset()
            out.head = step == self.out
        self._in_flight(srv)
        self.progress_at = now
        if self.first_missing(f.block) >= self.block_end(f.block):
            out.whole = True
            for other in self.fetchers.get(f.block, ()):  # a hedged copy: no longer needed, unless
                if other is f or not other.server.delivered:  # its server is cold: it runs on (warming)
                    continue
                # one that sent nothing at all, though asked first, was overtaken
                overtaken = other.last == other.started and not other.got and other.started <= f.started
                out.cancel += self._cancel([other], C.OVERTAKEN if overtaken else C.DONE)
        return out

    def beyond_window(self, f: Fetch) -> bool:
        """Whether `f`'s (a stream's) current block lies beyond the window: it waits, unread."""
        return f.reason is None and f.block >= self.out // self.K + max(1, len(self.live())) * self.W

    def on_hold(self, f: Fetch, since: float, now: float) -> list[Fetch]:
        """`f` has waited beyond the window since `since`: cancel it when its server has no other
        slot free to take a block before it that nobody fetches or claims (its server failed)."""
        f.last = now  # held here, not silent
        if (now - since > self.policy.hold_s and len(f.server.fetches) >= self.window(f.server)
                and self._orphan(f.block)):
            return self._cancel([f], C.DONE)
        return []

    def on_held(self, f: Fetch, since: float, now: float) -> None:
        """`f` waited from `since` to `now`: its block's clock and its server's pace start now."""
        f.server.pace.pause(now - since)
        f.started = f.delivered_at = now
        f.held = True

    def _orphan(self, below: int) -> bool:
        """Whether a block from the head to `below` is missing, fetched by nobody and not claimed
        by the stream of a healthy or paused server (`Server.laid_out`: its blocks stay its own)."""
        streams = [g for s in self.servers.values() if s.laid_out() for g in s.fetches if g.stride]
        for b in range(self.out // self.K, below):
            if (self.first_missing(b) < self.block_end(b) and not self.fetchers.get(b)
                    and not any(g.claims(b) for g in streams)):
                return True
        return False

    def advance(self, f: Fetch, now: float) -> list[Fetch]:
        """A stream's block is whole: move it to its server's next block, or end it (cancelled:
        the server is asked again) when that block is done or fetched elsewhere or the healthy
        servers changed."""
        if not f.held:  # (a held block's batches came from buffers at once after the wait)
            self._block_done(now - f.started, f.end - f.block * self.K)
        self.fetchers.get(f.block, set()).discard(f)
        nxt = f.block + f.stride
        live = self.live()
        if nxt * self.K >= self.end:
            f.next = f.end  # the epoch's end: the server ends the stream
            return []
        start = self.first_missing(nxt)
        if (len(live) != f.stride or live[nxt % len(live)] != f.server.address or start != nxt * self.K
                or self.fetchers.get(nxt) or f.server.address in self.corrupt.get(nxt, ())):
            return self._cancel([f], C.DONE)
        f.block, f.next, f.end, f.got, f.held = nxt, start, self.block_end(nxt), 0, False
        f.started = f.last = f.delivered_at = now
        self.fetchers.setdefault(nxt, set()).add(f)
        self._in_flight(f.server)
        return []

    def _block_done(self, took: float, steps: int) -> None:
        """A block of `steps` steps took `took` s: the typical block time."""
        took *= self.K / max(1, steps)
        w = self.policy.block_weight
        self.block_s = took if not self.block_s else (1 - w) * self.block_s + w * took

    def on_end(self, f: Fetch, now: float) -> None:
        """`f`'s call ended without an error status."""
        srv = f.server
        if f.reason in (C.STALL, C.OVERTAKEN):  # (a call cancelled after its last batch ends quietly)
            self._stalled(f, now)
        elif f.next < f.end and f.reason is None:
            self._failed(srv, f"{srv.address} ended the stream of steps {f.first}-{f.end - 1} before step "
                              f"{f.next} (draining?)", now)
        elif f.next >= f.end and not f.stride:  # (a stream of blocks times each block in `advance`)
            self._block_done(now - f.started, f.end - f.first)

    def on_failure(self, f: Fetch, kind: Failure, error: BaseException, now: float) -> ServerState:
        """`f`'s call failed with `error`; returns its server's state after it."""
        srv = f.server
        if f.reason in (C.DONE, C.GONE, C.STOP):
            return srv.state
        if f.reason in (C.STALL, C.OVERTAKEN):
            self._stalled(f, now)
        elif kind is Failure.CORRUPT:
            bad = self.corrupt.setdefault(f.block, set())
            bad.add(srv.address)
            self.stats.bump(srv.address, failures=1)
            if bad.issuperset(a for a, s in self.servers.items() if s.state not in FINAL):
                self.fail(error)
        elif kind is Failure.REFUSED:
            self._refuse(srv, error)
        elif kind is Failure.RETRY:
            self._failed(srv, str(error), now)
        else:
            self.fail(error)
        return srv.state

    def _stalled(self, f: Fetch, now: float) -> None:
        """`f` was cancelled as stalled or overtaken: its server is probed before it gets work
        again, after a backoff that grows until it delivers. Its pace is left as its deliveries
        made it: being overtaken says nothing of it."""
        srv = f.server
        self.stats.bump(srv.address, stalls=1)
        why = (f"no message for {self.policy.stall_timeout_s:g} s from {srv.address} (stalled)" if f.reason is C.STALL
               else f"{srv.address} sent nothing while another server sent its block (stalled?)")
        self._failed(srv, why, now, S.SUSPECT)

    def on_finish(self, f: Fetch) -> None:
        """`f`'s call is over."""
        self.fetchers.get(f.block, set()).discard(f)
        f.server.fetches.discard(f)
        if not f.server.fetches:  # a paused server without requests: OK again (DOWN if one failed)
            pause.resumed(self, f.server, f.last)
        self._in_flight(f.server)

    # -- the hand-out loop ---------------------------------------------------------------------------
    def watch(self, now: float) -> tuple[list[Fetch], bool]:
        """Requests silent for `stall_timeout_s` (to cancel), and whether the retry budget is spent
        with nothing in flight (the epoch then ends)."""
        stalled = [f for s in self.servers.values() if s.state is not S.PAUSED for f in s.fetches
                   if f.reason is None and f.opened and now - f.last > self.policy.stall_timeout_s]
        spent = self.budget.spent(now) and not any(s.fetches for s in self.servers.values())
        return self._cancel(stalled, C.STALL), spent

    def take(self) -> Any:
        """The head step's batch, or None while it has not arrived."""
        return self.ready.pop(self.out, None)

    def handed(self) -> bool:
        """The head step was handed out; whether the window moved a block."""
        self.out += 1
        return self.out % self.K == 0 or self.out >= self.end

    def done(self) -> bool:
        return self.out >= self.end

    def head_servers(self) -> list[str]:
        """The servers fetching the head block (the hand-out's wait is charged to them)."""
        return [f.server.address for f in self.fetchers.get(self.out // self.K, ())]

    def head_waits(self, now: float) -> bool:
        """The head batch is missing at `now`; whether no batch arrived for `retry_timeout_s` since
        the head began to wait (the retry budget is then spent: the epoch ends)."""
        if self.waiting_since is None or pause.holds_head(self):  # (a pause is not a failure)
            self.waiting_since = now
            self.progress_at = max(self.progress_at, now)
            return False
        if now - self.progress_at > self.retry_timeout_s:
            self.budget.fail(now)
            self.budget.since = self.progress_at
            return True
        return False

    def head_came(self) -> None:
        self.waiting_since = None
