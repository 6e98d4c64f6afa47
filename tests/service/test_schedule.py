"""The striping schedule (`gdsload.service.client.stripe.schedule.Schedule`) from tables, without
threads, sockets or clocks: every event carries its time, the backoff is a fixed table, and the
per-server counters go to a real `Link`'s table (no channel is ever opened).

What the rows prove: which block each server is asked for (own, stolen, hedged, one stream per
server), stalls and overtaken copies (suspect, probed again after a growing backoff), the cold
start (a server's pace comes only from batches it delivered; a server overtaken while it built its
pipeline is asked again with the full window and ends up delivering its share), a server failing
and coming back, `dns:///` names resolved again (servers joining and leaving), duplicates dropped,
refusals (another dataset version, FAILED_PRECONDITION, DATA_LOSS per block), the retry budget, and
the state table itself.
"""

from __future__ import annotations

import pytest

pytest.importorskip("grpc")

from gdsload.errors import ConfigError
from gdsload.service.client.link import Attempts, Endpoint, Link
from gdsload.service.client.options import Connection, RetryPolicy
from gdsload.service.client.stripe import pause
from gdsload.service.client.stripe.actions import EXIT, PROBE, Failure, Wait
from gdsload.service.client.stripe.model import Fetch, Server
from gdsload.service.client.stripe.policy import StripePolicy
from gdsload.service.client.stripe.schedule import Schedule
from gdsload.service.client.stripe.states import TRANSITIONS, CancelReason, IllegalTransition, ServerState

S, C = ServerState, CancelReason
T0 = 100.0  # the schedule's clock starts here (any float)
BACKOFF = {1: 0.1, 2: 0.2, 3: 0.4, 4: 0.8}  # failures in a row -> seconds (the link's, without jitter)


def make(servers=("a:1", "b:1"), *, steps=32, ok=True, retry_timeout_s=30.0, max_retries=None, share=False,
         **policy) -> tuple[Schedule, Link]:
    """A schedule over `servers` (all OK unless `ok` is False) and `steps` steps of the epoch."""
    link = Link(list(servers), 0, Connection(), RetryPolicy(retry_timeout_s=retry_timeout_s, max_retries=max_retries),
                dataset="feats")
    sch = Schedule(StripePolicy(**{"stripe_batches": 4, "server_window": 2, **policy}), first_step=0, end_step=steps,
                   now=T0, stats=link, budget=Attempts(link), backoff=lambda n: BACKOFF.get(n, 1.0),
                   retry_timeout_s=retry_timeout_s, stride_ok=not share)
    sch.on_resolved({a: [Endpoint(a, None, a)] for a in servers}, T0)
    if ok:
        for srv in sch.servers.values():
            sch.probe_ok(srv, strided=False)
    return sch, link


def srv(sch: Schedule, address: str) -> Server:
    return sch.servers[address]


def picks(sch: Schedule, order: str, now: float = T0) -> list[tuple[str, int, int] | None]:
    """`pick` for each server named in `order` ("abab"): (server, block, first step) or None."""
    out = []
    for name in order:
        f = sch.pick(srv(sch, f"{name}:1"), now)
        out.append(None if f is None else (name, f.block, f.next))
    return out


def deliver(sch: Schedule, f: Fetch, now: float, n: int | None = None, dt: float = 0.0) -> list[Fetch]:
    """`f` delivers `n` batches (default: the rest of its block), `dt` apart; the copies cancelled."""
    cancelled = []
    for _ in range(f.end - f.next if n is None else n):
        f.heard(now)
        cancelled += sch.on_batch(f, f"step {f.next}", 10, now).cancel
        now += dt
    return cancelled


def finish(sch: Schedule, f: Fetch, now: float) -> None:
    sch.on_end(f, now)
    sch.on_finish(f)


# -- which block of which server -----------------------------------------------------------------------
@pytest.mark.parametrize("servers, window, order, expected", [
    # own blocks first, block b on the b-th server (sorted), `server_window` at a time
    (("a:1", "b:1"), 2, "ababab", [("a", 0, 0), ("b", 1, 4), ("a", 2, 8), ("b", 3, 12), None, None]),
    (("b:1", "a:1"), 1, "abab", [("a", 0, 0), ("b", 1, 4), None, None]),  # sorted: the order given does not count
    (("a:1", "b:1", "c:1"), 1, "cba", [("c", 2, 8), ("b", 1, 4), ("a", 0, 0)]),
    # a server with nothing of its own in the window waits (its owner is not busy: nothing to steal)
    (("a:1", "b:1"), 2, "aaa", [("a", 0, 0), ("a", 2, 8), None]),
])
def test_each_server_is_asked_for_its_own_blocks_within_the_window(servers, window, order, expected):
    sch, _ = make(servers, server_window=window)
    assert picks(sch, order) == expected


def test_an_idle_server_steals_a_block_whose_owner_is_busy():
    """b's blocks come first; then the block of a, a straggler (one request at a time) whose only
    slot is taken; never a block someone fetches."""
    sch, _ = make(server_window=2)
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    a.pace.batch_s, b.pace.batch_s = 1.0, 0.1  # a: 10x the median -> window 1
    assert sch.window(a) == 1 and sch.window(b) == 2
    assert picks(sch, "abba") == [("a", 0, 0), ("b", 1, 4), ("b", 3, 12), None]
    for g in list(b.fetches):  # b's blocks arrive: it steals a's block 2 (a has its one slot busy)
        deliver(sch, g, T0, dt=0.1)
        finish(sch, g, T0 + 0.5)
    assert picks(sch, "b", T0 + 0.5) == [("b", 2, 8)]


def test_a_stripe_of_stride_servers_asks_each_for_one_stream():
    """Servers that serve `block_stride` get one stream each (stride = healthy servers), which
    claims their later blocks; a share group's requests stay one per block."""
    sch, _ = make()
    for s in sch.servers.values():
        sch.probe_ok(s, strided=True)
    a = sch.pick(srv(sch, "a:1"), T0)
    assert (a.block, a.stride) == (0, 2)
    b = sch.pick(srv(sch, "b:1"), T0)
    assert (b.block, b.stride) == (1, 2)
    assert a.claims(2) and a.claims(4) and not a.claims(3)
    second = sch.pick(srv(sch, "a:1"), T0)  # its second slot: not one of its own stream's blocks
    assert second is None or second.block not in (2, 4, 6)
    deliver(sch, a, T0 + 0.4)
    assert sch.advance(a, T0 + 0.4) == [] and (a.block, a.next, a.end) == (2, 8, 12)  # on to its next block
    shared, _ = make(share=True)
    for s in shared.servers.values():
        shared.probe_ok(s, strided=True)
    assert shared.pick(srv(shared, "a:1"), T0).stride == 0


def test_a_stream_is_cancelled_when_its_next_block_is_fetched_elsewhere():
    sch, _ = make()
    for s in sch.servers.values():
        sch.probe_ok(s, strided=True)
    a = sch.pick(srv(sch, "a:1"), T0)
    other = sch._start(srv(sch, "b:1"), 2, 8, T0)  # block 2 (a's next) asked of b, as a hedge would
    deliver(sch, a, T0 + 0.4)
    assert sch.advance(a, T0 + 0.4) == [a] and a.reason is C.DONE
    assert other.reason is None


def test_a_stream_beyond_the_window_is_held_and_its_pace_paused():
    sch, _ = make(("a:1",), server_window=1)
    a = srv(sch, "a:1")
    f = sch._start(a, 1, 4, T0, stride=1)  # block 1 with the window at blocks [0, 1)
    assert sch.beyond_window(f)
    assert sch.on_hold(f, T0, T0 + 0.05) == []  # held a short while: kept
    a.pace.arrived(T0 - 0.1)
    a.pace.arrived(T0)
    sch.on_held(f, T0, T0 + 3.0)
    assert list(a.pace.arrivals) == [T0 + 2.9, T0 + 3.0] and f.started == T0 + 3.0 and f.held


# -- hedging, stalls, the cold start -------------------------------------------------------------------
@pytest.mark.parametrize("slow, fast, block_s, age, silent, left, hedged", [
    (0.0, 0.0, 0.0, 5.0, 5.0, 4, False),  # no block time, no paces: nothing to judge by
    (0.0, 0.0, 1.0, 1.5, 1.5, 4, False),  # in flight 1.5 block times
    (0.0, 0.0, 1.0, 2.5, 1.5, 4, True),  # 2.5 block times, silent 1.5 s
    (0.0, 0.0, 1.0, 2.5, 0.5, 4, False),  # 2.5 block times but it sent something 0.5 s ago (< a block time)
    (0.0, 0.0, 0.1, 0.3, 0.26, 4, True),  # silent over silent_s (0.25 s, longer than a block time)
    (0.4, 0.1, 10.0, 0.0, 0.0, 4, True),  # 4x slower: 1.6 s left against 0.5 s
    (0.25, 0.1, 10.0, 0.0, 0.0, 4, False),  # 2.5x: jitter
    (0.4, 0.1, 10.0, 0.0, 0.0, 1, False),  # one batch left: 0.4 s against 0.2 s
    (0.4, 0.0, 10.0, 0.0, 0.0, 4, False),  # the idle server has no pace yet
    (0.0, 0.1, 10.0, 0.0, 0.0, 4, False),  # the slow one has no pace (it delivered nothing): time rule only
])
def test_the_head_block_is_hedged_by_time_or_by_pace(slow, fast, block_s, age, silent, left, hedged):
    sch, _ = make()
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    a.pace.batch_s, b.pace.batch_s, sch.block_s = slow, fast, block_s
    now = T0 + 10
    f = Fetch(a, 0, 4 - left, 4, now - age)
    f.last = now - silent
    f.delivered_at = now
    assert sch.straggles(f, b, 4 - left, now) is hedged


def test_a_hedged_copy_that_wins_cancels_the_silent_one_as_overtaken():
    """a (warm: it delivered a block) is silent on the head block for over two block times; idle b
    asks for it too and wins: a's copy is cancelled as overtaken, a is suspect (probed after the
    backoff) and gets no pace from its silence."""
    sch, link = make()
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    first, second = sch.pick(a, T0), sch.pick(a, T0)  # blocks 0 and 2
    deliver(sch, second, T0, dt=0.1)
    finish(sch, second, T0 + 0.4)
    assert sch.block_s == pytest.approx(0.4) and a.batch_s == pytest.approx(0.1)
    for f in (sch.pick(b, T0), sch.pick(b, T0)):  # blocks 1 and 3
        deliver(sch, f, T0, dt=0.1)
        finish(sch, f, T0 + 0.4)
    assert sch.pick(b, T0 + 0.7) is None  # 0.7 s: under two block times
    hedge = sch.pick(b, T0 + 0.9)
    assert (hedge.server, hedge.block) == (b, 0)
    assert deliver(sch, hedge, T0 + 0.9) == [first] and first.reason is C.OVERTAKEN
    finish(sch, first, T0 + 1.0)
    assert a.state is S.SUSPECT and a.batch_s == pytest.approx(0.1)  # its pace: its deliveries only
    assert a.next_try == pytest.approx(T0 + 1.0 + BACKOFF[1])
    assert link.server_stats()["a:1"]["stalls"] == 1 and link.server_stats()["a:1"]["state"] == "suspect"


def test_a_copy_that_had_sent_batches_is_cancelled_as_done_without_blame():
    sch, _ = make()
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    first = sch.pick(a, T0)
    deliver(sch, first, T0 + 0.1, n=1)
    hedge = sch._start(b, 0, 1, T0 + 0.2)
    assert deliver(sch, hedge, T0 + 0.3) == [first] and first.reason is C.DONE
    finish(sch, first, T0 + 0.3)
    assert a.state is S.OK


def test_a_silent_request_stalls_and_its_server_is_probed_after_a_growing_backoff():
    sch, link = make(stall_timeout_s=2.0)
    a = srv(sch, "a:1")
    f = sch.pick(a, T0)
    assert sch.watch(T0 + 5) == ([], False)  # no call yet: the stall clock starts with the call
    f.opened = True
    assert sch.watch(T0 + 1.9) == ([], False)
    assert sch.watch(T0 + 2.1) == ([f], False) and f.reason is C.STALL
    finish(sch, f, T0 + 2.1)
    assert a.state is S.SUSPECT and link.server_stats()["a:1"]["stalls"] == 1
    rows = []
    now = T0 + 2.1
    for _ in range(3):  # probed again after each backoff; it stalls again each time
        rows.append((sch.work(a, now), round(a.next_try - now, 3)))
        now = a.next_try
        assert sch.work(a, now) == PROBE
        sch.probe_ok(a, strided=False)
        g = sch.pick(a, now)
        g.opened = True
        now += 2.5
        sch.watch(now)
        finish(sch, g, now)
    # (a slot waits at most idle_wait_s at a time)
    assert rows == [(Wait(pytest.approx(0.1)), 0.1), (Wait(pytest.approx(0.2)), 0.2), (Wait(0.25), 0.4)]
    assert sch.work(a, now) == Wait(0.25) and sch.work(a, a.next_try) == PROBE
    sch.probe_ok(a, strided=False)
    deliver(sch, sch.pick(a, a.next_try), a.next_try + 0.1, n=1)
    assert a.fails == 0  # it delivered: the backoff starts over


def test_cold_start_a_server_overtaken_while_it_builds_its_pipeline_is_not_shut_out():
    """Issue 48: b builds its pipeline (cold: it delivered nothing yet) while a, warm, does its
    blocks and then hedges b's head block and wins. b's request runs on (its batches will be
    duplicates, but its server warms), b stays healthy with the full window, it gets no pace from
    its silence (so it is never hedged at once by pace), and once warm its batches give it a pace
    like a's. A warm server's silent copy, overtaken the same way, is cancelled (previous test)."""
    sch, link = make(server_window=1)
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    fa, fb = sch.pick(a, T0), sch.pick(b, T0)  # blocks 0 and 1
    deliver(sch, fa, T0, dt=0.05)
    finish(sch, fa, T0 + 0.2)
    assert sch.block_s == pytest.approx(0.2)
    for _ in range(4):  # the head (block 0) handed out
        assert sch.take() is not None
        sch.handed()
    f2 = sch.pick(a, T0 + 0.2)  # a's own block 2
    deliver(sch, f2, T0 + 0.2, dt=0.05)
    finish(sch, f2, T0 + 0.4)
    assert not sch.straggles(fb, a, 4, T0 + 0.35)  # b has no pace: hedged by time only, not at once
    hedge = sch.pick(a, T0 + 0.45)  # b's block 1: in flight 0.45 s, over 2 block times, silent
    assert (hedge.block, hedge.server) == (1, a)
    assert deliver(sch, hedge, T0 + 0.45, dt=0.05) == [] and fb.reason is None  # b's copy runs on
    assert b.state is S.OK and b.batch_s == 0.0 and sch.window(b) == 1 and b.fails == 0
    deliver(sch, fb, T0 + 1.5, dt=0.05)  # warm now: four duplicates, and a pace
    finish(sch, fb, T0 + 1.65)
    assert b.delivered == 4 and b.batch_s == pytest.approx(0.05)
    assert link.server_stats()["b:1"]["duplicates"] == 4
    while sch.take() is not None:  # blocks 1 and 2 handed out
        sch.handed()
    assert picks(sch, "b", T0 + 1.65) == [("b", 3, 12)]  # its own next block


def test_cold_start_over_a_whole_epoch_every_step_once_and_the_cold_server_delivers():
    """A whole epoch simulated in 10 ms steps: a warm, b cold for 1.5 s of requests open (its
    pipeline survives a cancelled request, as a server parks its loader), both 20 ms a batch when
    warm. Every step is handed out once in order, and b delivers a share (the defect: 0 of 76)."""
    sch, link = make(steps=160, server_window=2, stripe_batches=4)
    sim = Sim(sch, {"a:1": 0.0, "b:1": 1.5}, batch_s=0.02)
    assert sim.run(limit_s=60) == list(range(160))
    delivered = {a: row["batches"] for a, row in link.server_stats().items()}
    assert delivered["b:1"] >= 20, delivered


class Sim:
    """Servers of a given cold start (seconds of open requests before their first batch) and pace,
    driving a schedule: each 10 ms step runs every slot's action, delivers due batches, hands
    the head out and watches for stalls. Probes answer at once; a cancelled call ends at once."""

    def __init__(self, sch: Schedule, cold_s: dict[str, float], batch_s: float, dt: float = 0.01):
        self.sch, self.cold_s, self.batch_s, self.dt = sch, dict(cold_s), batch_s, dt
        self.slots = {(a, i): None for a in cold_s for i in range(sch.W)}
        self.due: dict[Fetch, float] = {}

    def run(self, limit_s: float) -> list[int]:
        sch, now, out = self.sch, T0, []
        while not sch.done() and now < T0 + limit_s:
            now += self.dt
            for key, f in self.slots.items():
                if f is None:
                    self.slots[key] = self._start(sch.servers[key[0]], now)
            for key, f in list(self.slots.items()):
                if f is not None and self._step(f, now):
                    self.slots[key] = None
            while sch.take() is not None:
                out.append(sch.out)
                sch.handed()
            sch.watch(now)
            assert sch.error is None, sch.error
        return out

    def _start(self, s: Server, now: float) -> Fetch | None:
        action = self.sch.work(s, now)
        if action == PROBE:
            self.sch.probe_ok(s, strided=False)
            action = self.sch.work(s, now)
        if not isinstance(action, Fetch):
            return None
        action.opened = True
        self.due[action] = now + self.batch_s
        return action

    def _step(self, f: Fetch, now: float) -> bool:
        """Advance `f`; True once its call is over."""
        address = f.server.address
        if self.cold_s[address] > 0:  # building its pipeline while a request is open
            self.cold_s[address] -= self.dt / len(f.server.fetches)
            self.due[f] = now + self.batch_s
        elif f.reason is None and now >= self.due[f]:
            f.heard(now)
            self.sch.on_batch(f, f.next, 10, now)
            self.due[f] = now + self.batch_s * len(f.server.fetches)
        if f.reason is None and f.next < f.end:
            return False
        finish(self.sch, f, now)
        return True


# -- failures, refusals, names -------------------------------------------------------------------------
def test_a_server_that_fails_is_down_probed_after_a_backoff_and_comes_back():
    sch, link = make()
    a = srv(sch, "a:1")
    f = sch.pick(a, T0)
    assert sch.on_failure(f, Failure.RETRY, RuntimeError("UNAVAILABLE: restarting"), T0) is S.DOWN
    sch.on_finish(f)
    assert sch.last_error == "UNAVAILABLE: restarting" and sch.budget.failures == 1
    assert sch.work(a, T0 + 0.05) == Wait(pytest.approx(0.05)) and sch.work(a, T0 + 0.1) == PROBE
    sch.probe_failed(a, "connection refused", T0 + 0.1)  # still restarting
    assert a.state is S.DOWN and a.next_try == pytest.approx(T0 + 0.1 + BACKOFF[2])
    assert sch.work(a, a.next_try) == PROBE
    sch.probe_ok(a, strided=False)
    g = sch.pick(a, a.next_try)
    assert a.state is S.OK and g.block == 0
    deliver(sch, g, a.next_try, n=1)
    assert a.fails == 0 and sch.budget.failures == 0
    assert link.server_stats()["a:1"]["failures"] == 2 and link.server_stats()["a:1"]["state"] == "ok"


def test_another_dataset_version_or_failed_precondition_is_refused_for_the_epoch():
    sch, link = make(ok=False)
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    assert sch.work(a, T0) == PROBE and sch.work(a, T0) == Wait(0.01)  # one probe at a time
    sch.probe_refused(a, RuntimeError("another version of the dataset"))
    assert a.state is S.REFUSED and sch.work(a, T0) == EXIT and sch.error is None
    sch.probe_ok(a, strided=False)  # a probe answering late changes nothing
    assert a.state is S.REFUSED
    sch.probe_ok(b, strided=False)
    f = sch.pick(b, T0)
    assert sch.on_failure(f, Failure.REFUSED, RuntimeError("cannot serve"), T0) is S.REFUSED
    assert str(sch.error) == "cannot serve"  # every server refused: the epoch ends
    assert link.server_stats()["b:1"]["state"] == "refused"


def test_data_loss_refuses_a_server_that_block_only_and_is_final_everywhere():
    sch, _ = make()
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    f = sch.pick(a, T0)
    sch.on_failure(f, Failure.CORRUPT, RuntimeError("DATA_LOSS"), T0)
    sch.on_finish(f)
    assert a.state is S.OK and sch.corrupt == {0: {"a:1"}} and sch.error is None
    assert picks(sch, "aabb") == [("a", 2, 8), None, ("b", 1, 4), ("b", 3, 12)]  # block 0: not from a
    f1 = next(f for f in b.fetches if f.block == 1)
    deliver(sch, f1, T0, dt=0.1)
    finish(sch, f1, T0 + 0.4)
    assert picks(sch, "b", T0 + 0.4) == [("b", 0, 0)]  # b takes block 0 (a cannot serve it)
    g = next(f for f in b.fetches if f.block == 0)
    sch.on_failure(g, Failure.CORRUPT, RuntimeError("DATA_LOSS everywhere"), T0)
    assert str(sch.error) == "DATA_LOSS everywhere"


def test_a_fatal_status_ends_the_epoch_and_cancelled_requests_fail_quietly():
    sch, _ = make()
    a = srv(sch, "a:1")
    f, g = sch.pick(a, T0), sch.pick(a, T0)
    g.reason = C.DONE
    assert sch.on_failure(g, Failure.FATAL, RuntimeError("late"), T0) is S.OK and sch.error is None
    sch.on_failure(f, Failure.FATAL, RuntimeError("PERMISSION_DENIED"), T0)
    assert str(sch.error) == "PERMISSION_DENIED"
    assert sorted(x.reason.value for x in sch.stop_all()) == ["done", "stop"]


def test_names_resolved_again_add_and_retire_servers():
    sch, link = make(("dns:///feed:1",), ok=False)
    name = "dns:///feed:1"
    sch.servers.clear()
    one, two = Endpoint("10.0.0.1:1", "feed", name), Endpoint("10.0.0.2:1", "feed", name)
    assert sch.resolve_due(T0)
    joined, gone = sch.on_resolved({name: [one]}, T0)
    assert [s.address for s in joined] == ["10.0.0.1:1"] and gone == []
    assert not sch.resolve_due(T0 + 1) and sch.resolve_due(T0 + 5)
    sch.probe_ok(joined[0], strided=False)
    f = sch.pick(joined[0], T0)
    joined, gone = sch.on_resolved({name: [one, two]}, T0 + 5)  # a pod joins
    assert [s.address for s in joined] == ["10.0.0.2:1"] and gone == []
    sch.probe_ok(joined[0], strided=False)
    assert sch.live() == ["10.0.0.1:1", "10.0.0.2:1"]
    assert sch.on_resolved({name: "no such host"}, T0 + 10) == ([], [])  # a failed lookup keeps what it had
    assert sch.live() == ["10.0.0.1:1", "10.0.0.2:1"]
    joined, gone = sch.on_resolved({name: [two]}, T0 + 15)  # the first one leaves
    assert joined == [] and gone == [f] and f.reason is C.GONE
    first = srv(sch, "10.0.0.1:1")
    assert first.state is S.GONE and sch.work(first, T0 + 15) == EXIT and sch.live() == ["10.0.0.2:1"]
    assert link.server_stats()["10.0.0.1:1"]["state"] == "gone"
    assert sch.on_resolved({name: [one, two]}, T0 + 20)[0] == []  # gone for the epoch
    assert sch.on_resolved({name: "down"}, T0 + 25) == ([], []) and sch.last_error == "no attempt"
    sch.servers.clear()
    sch.on_resolved({name: "no such host"}, T0 + 30)
    assert sch.last_error == "cannot resolve dns:///feed:1: no such host"


# -- what arrives, what is handed out ------------------------------------------------------------------
def test_a_batch_that_arrives_twice_is_kept_once_in_step_order():
    sch, link = make()
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    f = sch.pick(a, T0)
    g = sch._start(b, 0, 0, T0)  # a hedged copy of block 0
    assert sch.on_batch(g, "b0", 10, T0).head  # step 0: the head
    assert not sch.on_batch(f, "a0", 10, T0).head  # step 0 again: dropped
    sch.on_batch(f, "a1", 10, T0)
    assert sch.take() == "b0" and sch.take() is None  # the head is handed out once
    sch.handed()
    assert sch.take() == "a1"
    rows = link.server_stats()
    assert (rows["a:1"]["duplicates"], rows["a:1"]["batches"], rows["b:1"]["batches"]) == (1, 1, 1)


def test_the_head_waits_until_the_retry_budget_is_spent():
    sch, _ = make(retry_timeout_s=10.0)
    assert not sch.head_waits(T0 + 1)  # it begins to wait
    assert not sch.head_waits(T0 + 10.5)
    assert sch.head_waits(T0 + 11.5) and sch.budget.failures == 1 and sch.budget.since == T0 + 1
    sch.head_came()
    assert not sch.head_waits(T0 + 20)


def test_the_budget_spent_ends_the_epoch_once_nothing_is_in_flight():
    sch, _ = make(max_retries=1)
    a = srv(sch, "a:1")
    f = sch.pick(a, T0)
    for _ in range(2):
        sch.on_failure(f, Failure.RETRY, RuntimeError("UNAVAILABLE"), T0)
    assert sch.watch(T0) == ([], False)  # over max_retries, but a request is in flight
    sch.on_finish(f)
    assert sch.watch(T0) == ([], True)


def test_the_handed_out_step_moves_the_window():
    sch, _ = make(steps=6, stripe_batches=4)
    moved = []
    for step in range(6):
        sch.ready[step] = step
        assert sch.take() == step
        moved.append(sch.handed())
    assert moved == [False, False, False, True, False, True] and sch.done()


# -- the state table, the policy -----------------------------------------------------------------------
@pytest.mark.parametrize("old, new", [
    (S.REFUSED, S.OK), (S.GONE, S.NEW), (S.GONE, S.OK), (S.NEW, S.SUSPECT), (S.OK, S.NEW), (S.PAUSED, S.DOWN),
])
def test_an_illegal_transition_raises(old, new):
    s = Server(Endpoint("a:1"), 2.0)
    s.state = old
    with pytest.raises(IllegalTransition, match=f"from {old.value} to {new.value}"):
        s.move(new)
    assert s.state is old


def test_the_table_covers_every_state_and_gone_is_reachable_from_all():
    assert set(TRANSITIONS) == set(S)
    assert all(S.GONE in TRANSITIONS[s] for s in S if s is not S.GONE) and not TRANSITIONS[S.GONE]


def test_a_paused_server_gets_no_work_is_not_hedged_and_a_failure_keeps_it_paused():
    sch, _ = make()
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    f = sch.pick(a, T0)
    a.move(S.PAUSED)
    sch.block_s = 0.1
    assert sch.work(a, T0) == Wait(0.25) and sch.live() == ["a:1", "b:1"]  # its blocks stay laid out over it
    assert not sch.straggles(f, b, 0, T0 + 10)
    sch.on_failure(f, Failure.RETRY, RuntimeError("UNAVAILABLE"), T0)
    assert a.state is S.PAUSED


@pytest.mark.parametrize("kw, message", [
    ({"stripe_batches": 0}, "stripe_batches and server_window must be >= 1, got 0 and 2"),
    ({"server_window": True}, "stripe_batches and server_window must be >= 1"),
    ({"stall_timeout_s": 0}, "stall_timeout_s must be > 0 seconds, got 0"),
    ({"resolve_interval_s": float("nan")}, "resolve_interval_s must be > 0 seconds, got nan"),
    ({"slow_ratio": -1}, "slow_ratio must be > 0, got -1"),
])
def test_the_policy_refuses_bad_numbers_naming_them(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        StripePolicy(**kw)


def test_the_policy_is_frozen_and_its_counts_are_ints():
    p = StripePolicy(stripe_batches=3.0, server_window=1)
    assert (p.stripe_batches, type(p.stripe_batches)) == (3, int)
    with pytest.raises(AttributeError):
        p.pace_s = 1.0


def test_the_blocks_claimed_are_those_each_stream_claims_first_in_order():
    """`pick` looks the streams' claims up in one pass (`_claims`); for every block of the
    window it names the first stream, in the servers' and their requests' order, whose
    `Fetch.claims` is true: streams of several strides, a cancelled one (claims nothing), a
    stream whose own block is below the window's head, and blocks claimed by two streams."""
    sch, _ = make(("a:1", "b:1", "c:1"), steps=400)
    a, b, c = (srv(sch, f"{x}:1") for x in "abc")
    f1 = sch._start(a, 0, 0, T0, stride=3)
    f2 = sch._start(b, 1, 4, T0, stride=2)  # claims 3, 5, 7, ... (3 and 9 are f1's first)
    f3 = sch._start(c, 2, 8, T0, stride=3)
    f4 = sch._start(c, 4, 16, T0, stride=1)
    f4.reason = C.DONE  # cancelled: claims nothing
    sch._start(a, 5, 20, T0)  # not a stream
    streams = [f for s in sch.servers.values() for f in s.fetches if f.stride]
    for head, last in [(0, 60), (1, 40), (5, 33), (7, 8), (30, 30)]:
        got = sch._claims(head, last)
        want = {b_: f for b_ in range(head, last) if (f := next((g for g in streams if g.claims(b_)), None))}
        assert got == want
    # by hand: a's stream first, then b's, then c's
    assert sch._claims(0, 12) == {3: f1, 5: f2, 6: f1, 7: f2, 8: f3, 9: f1, 11: f2}
    assert sch._claims(4, 9) == {5: f2, 6: f1, 7: f2, 8: f3}


def test_servers_probed_by_an_earlier_pass_start_without_a_probe():
    """Each pass is a new schedule: a server an earlier pass of the loader probed (`known`: it
    serves the planned dataset id, and `block_stride` or not) is OK at once; an unknown one is
    probed first, and the known ones wait for its answer (`first_probes_s` at most), then each
    gets its own blocks on one stream from the first pick."""
    link = Link(["a:1", "b:1", "c:1"], 0, Connection(), RetryPolicy(), dataset="feats")
    sch = Schedule(StripePolicy(stripe_batches=4, server_window=2), first_step=0, end_step=32, now=T0, stats=link,
                   budget=Attempts(link), backoff=lambda n: BACKOFF.get(n, 1.0), retry_timeout_s=30.0,
                   known={"a:1": True, "b:1": True})
    sch.on_resolved({a: [Endpoint(a, None, a)] for a in ("a:1", "b:1", "c:1")}, T0)
    assert [srv(sch, a).state for a in ("a:1", "b:1", "c:1")] == [S.OK, S.OK, S.NEW]
    assert sch.work(srv(sch, "c:1"), T0) is PROBE
    assert sch.work(srv(sch, "a:1"), T0) == Wait(0.5)  # (c's answer wakes it)
    sch.probe_ok(srv(sch, "c:1"), strided=True)
    a, b = sch.work(srv(sch, "a:1"), T0 + 0.01), sch.work(srv(sch, "b:1"), T0 + 0.01)
    assert (a.block, a.stride, b.block, b.stride) == (0, 3, 1, 3)  # (three live servers: blocks 0, 3, ... and 1, 4, ...)
    # a known server that fails its first request is DOWN and probed after its backoff, as any other
    sch.on_failure(a, Failure.RETRY, RuntimeError("gone"), T0 + 0.02)
    sch.on_finish(a)
    assert srv(sch, "a:1").state is S.DOWN
    assert isinstance(sch.work(srv(sch, "a:1"), T0 + 0.03), Wait)
    assert sch.work(srv(sch, "a:1"), T0 + 0.2) is PROBE


def test_an_epoch_s_first_blocks_wait_for_every_server_s_first_probe():
    """At an epoch's start a server that answered its probe waits for the others' first probes
    (`first_probes_s` at most), so each block goes to its owner: asked at once, the first server
    took blocks 0 and 1 (the only live one) and made the first eight batches alone, at one
    server's pace. A server whose probe fails stops the wait; one that hangs holds it at most
    `first_probes_s`, then the others start without it."""
    sch, _ = make(("a:1", "b:1"), ok=False)
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    assert sch.work(a, T0) is PROBE and sch.work(b, T0) is PROBE
    sch.probe_ok(a, strided=True)
    assert sch.work(a, T0 + 0.01) == Wait(pytest.approx(0.49))  # not blocks 0 and 1
    sch.probe_ok(b, strided=True)
    fa, fb = sch.work(a, T0 + 0.02), sch.work(b, T0 + 0.02)
    assert (fa.block, fa.stride, fb.block, fb.stride) == (0, 2, 1, 2)
    assert sch.work(a, T0 + 0.02) == Wait(0.25)  # one stream: its next blocks are that stream's

    sch, _ = make(("a:1", "b:1", "c:1"), ok=False)
    a, b, c = (srv(sch, f"{n}:1") for n in "abc")
    for s in (a, b, c):
        assert sch.work(s, T0) is PROBE
    sch.probe_ok(a, strided=True)
    sch.probe_failed(b, "connection refused", T0 + 0.1)  # failed: not waited for
    assert isinstance(sch.work(a, T0 + 0.1), Wait)  # c still answers
    f = sch.work(a, T0 + 0.5)  # c hangs: a starts without it
    assert (f.block, f.stride) == (0, 0)  # (the only live server: one block per request)



def test_a_server_paused_for_another_job_keeps_its_blocks():
    """A pause for another job's work does not lay the blocks out afresh (`Server.laid_out`): the
    other server's stream goes on to its next block, and the paused server's stream goes on when
    its batches come. Laid out over the one server left, the other server's stream was cancelled
    at its block's end, its blocks asked again one stream each, and again when the pause ended
    (at a twentieth of a core each new stream is a new loader)."""
    sch, _ = make()
    for s in sch.servers.values():
        sch.probe_ok(s, strided=True)
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    fa, fb = sch.pick(a, T0), sch.pick(b, T0)
    assert (fa.block, fa.stride, fb.block, fb.stride) == (0, 2, 1, 2)
    deliver(sch, fa, T0, n=1)
    pause.paused(sch, fa, "priority 10 work on this server (this stream: priority 0)", T0 + 0.1)
    assert a.state is S.PAUSED and sch.live() == ["a:1", "b:1"]
    deliver(sch, fb, T0 + 0.2)
    assert sch.advance(fb, T0 + 0.2) == [] and (fb.block, fb.reason) == (3, None)  # b's stream goes on
    assert sch.pick(b, T0 + 0.3) is None  # a's next block stays its stream's (a has a slot free)
    assert sch.work(a, T0 + 0.3) == Wait(0.25)  # a gets no new request while paused
    deliver(sch, fa, T0 + 5.0)  # a's pause ends: its batches come
    assert a.state is S.OK and sch.live() == ["a:1", "b:1"]
    assert sch.advance(fa, T0 + 5.0) == [] and (fa.block, fa.reason) == (2, None)  # and its stream goes on


def test_a_stream_held_behind_a_paused_server_s_claimed_block_is_kept():
    """A stream held beyond the window is cancelled when a block before it belongs to nobody (its
    server failed: `on_hold`); a block that a paused server's stream claims is not such a block.
    (Counted as one, the held stream was cancelled while the other server, still owning the block,
    was paused, and begun again later: one more loader on its server.)"""
    sch, _ = make(server_window=1)
    for s in sch.servers.values():
        sch.probe_ok(s, strided=True)
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    fa, fb = sch.pick(a, T0), sch.pick(b, T0)
    for _ in range(2):  # a's blocks 0 and 2; b's block 1 not yet: the head waits at block 1
        deliver(sch, fa, T0)
        assert sch.advance(fa, T0) == []
    assert fa.block == 4 and sch.beyond_window(fa)
    pause.paused(sch, fb, "priority 10 work on this server (this stream: priority 0)", T0)
    assert sch.on_hold(fa, T0, T0 + 1.0) == [] and fa.reason is None  # block 3 is b's stream's
    b.move(S.OK)
    b.move(S.DOWN)  # b failed: its blocks are nobody's
    assert sch.on_hold(fa, T0, T0 + 1.1) == [fa] and fa.reason is C.DONE
