"""Priorities and preemption in the feed (issue 49), on real servers on loopback.

The arbiter's rules are checked first on their own, with a clock that moves only by the seconds
each batch takes (so the order of grants is the rules' alone): strict priority between levels,
equal seconds per job within a level (a job of two streams gets no more than one of one stream,
a job of dear batches gets fewer batches, not fewer seconds), a share group at its highest
member's priority. Then on servers: higher work held on a server (a turn of priority 100 that
holds the server's one batch slot: the lower streams pause at their batch boundary) pauses a
RemoteLoader's stream; its client sees a slower stream (stats say paused, when and why), never an
error, not even with `stall_timeout_s` and `retry_timeout_s` far below the pause; its epoch is
the local loader's keys in plan order, and a state taken while paused resumes exactly. A request
that does not declare it understands pauses (an older client) gets no pause message, only its
batches. A high job among three low ones: no batch of a lower level is ever made while a higher
stream waits for its turn, and every job's every epoch is exact. The token file's limits refuse
a priority above them with PERMISSION_DENIED naming the limit. No assertion is on a duration;
every wait is bounded.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from gdsload import RemoteLoader
from gdsload.errors import GdsloadError, RemoteError
from gdsload.service.protocol import auth
from gdsload.service.protocol.status import PermissionDenied
from gdsload.service.server import create_server
from gdsload.service.server import priority
from gdsload.service.server.priority import Arbiter
from gdsload.service.server.turn import HANDOVER_S, RETURN_S
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc

from feedkit import local_batches

B = 8  # feats: 256 samples, 32 batches an epoch


def keys(batches) -> list[str]:
    return [k for b in batches for k in b["__key__"]]


def until(cond, what: str, timeout: float = 20.0, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(every)


# -- the rules, on their own ------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def run_streams(arbiter: Arbiter, clock: Clock, streams: list, grants: int) -> None:
    """Each stream (a turn, its batch's cost in clock seconds) asks again at once after each batch,
    until `grants` batches were made in all; the clock moves only while a batch is made."""
    made = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def run(turn, cost):
        while not stop.is_set():
            got = turn.wait(stop.is_set)
            if got is False:
                return
            if got is not None:
                continue
            with lock:
                clock.t += cost
                made[0] += 1
                if made[0] >= grants:
                    stop.set()
            turn.made()
            turn.sent()

    # holds the slot until every stream waits (a job of its own each time: one back with a pace
    # would hold the lower levels for the handover, on a clock that stands still meanwhile)
    blocker = arbiter.enter(("test", "blocker", time.monotonic_ns()), 1 << 30)
    assert blocker.wait(stop.is_set) is None
    arbiter.grants.clear()
    threads = [threading.Thread(target=run, args=s, daemon=True) for s in streams]
    for t in threads:
        t.start()
    until(lambda: all(turn.state == "waiting" for turn, _ in streams), "every stream waits")
    blocker.made()
    blocker.leave()
    for t in threads:
        t.join(60)
    stop.set()
    assert not any(t.is_alive() for t in threads)


def test_within_a_level_each_job_gets_an_equal_share_of_seconds_not_of_batches():
    clock = Clock()
    arb = Arbiter(1, clock=clock)
    a1, a2 = arb.enter(("id", "A"), 0), arb.enter(("id", "A"), 0)  # job A: two streams
    b = arb.enter(("id", "B"), 0)
    c = arb.enter(("id", "C"), 0)  # job C: batches three times as dear (decoded, say)
    run_streams(arb, clock, [(a1, 1.0), (a2, 1.0), (b, 1.0), (c, 3.0)], grants=120)
    used = {j: arb.jobs[("id", j)].used for j in "ABC"}
    assert max(used.values()) - min(used.values()) <= 3.0 + 1e-9, used  # within one dear batch
    count = {j: sum(1 for job, _, _ in arb.grants if job == ("id", j)) for j in "ABC"}
    assert abs(count["A"] - count["B"]) <= 2, count  # two streams: no more than one stream
    assert count["C"] * 2 < count["B"], count  # a third of the batches for the same seconds


def test_four_equal_jobs_get_equal_shares_whatever_their_streams():
    clock = Clock()
    arb = Arbiter(1, clock=clock)
    streams = [(arb.enter(("id", f"job{j}"), 0), 1.0) for j, n in enumerate((1, 1, 2, 3)) for _ in range(n)]
    run_streams(arb, clock, streams, grants=200)
    count = [sum(1 for job, _, _ in arb.grants if job == ("id", f"job{j}")) for j in range(4)]
    assert sum(count) >= 200 and max(count) - min(count) <= 3, count  # 50 each, within a few batches


def test_of_a_job_s_streams_the_first_in_its_plan_goes_first():
    """A striping client hands batches out in plan order, so of one job's streams on a server the
    one whose next batch comes first in its plan (`Turn.place`: its head block) goes first; a
    later block's batch made first would only wait in the client (seen: a job's head block made
    at half its job's share while its next block took the rest, its batches handed out 4 to 12
    at a time after 5-s gaps)."""
    clock = Clock()
    arb = Arbiter(1, clock=clock)
    later, head = arb.enter(("id", "A"), 0), arb.enter(("id", "A"), 0)
    later.place, head.place = (0, 8), (0, 0)
    run_streams(arb, clock, [(later, 1.0), (head, 1.0)], grants=4)
    assert [g[0] for g in arb.grants] == [("id", "A")] * 4
    assert later.asked < head.asked and head.granted > later.granted  # (head made all four)
    head.place = (0, 12)  # its block done, it reads its next: now the other is first
    run_streams(arb, clock, [(later, 1.0), (head, 1.0)], grants=2)
    assert later.granted > head.granted
    for t in (later, head):
        t.leave()


def test_a_job_s_later_stream_waits_while_its_earlier_one_wants_the_server():
    """Of one job's streams, one whose next batch comes later in the plan (its next epoch's pass,
    opened ahead) gets no slot, and does not send a batch it made, while an earlier one wants the
    server (waits, makes, or sent less than RETURN_S ago): it would only take the server from
    the batches the client waits for first (seen: a raw training loop's waits in an epoch's
    last blocks). It is paused meanwhile and told why; another job's stream is not held."""
    clock = Clock()
    arb = Arbiter(2, clock=clock)
    stop = threading.Event()
    head, ahead = arb.enter(("id", "A"), 3), arb.enter(("id", "A"), 3, notices=True)
    other = arb.enter(("id", "B"), 3)
    head.place, ahead.place, other.place = (0, 60), (1, 0), (0, 0)
    got: dict = {}
    notices: list[bytes] = []

    def ask(name, call):  # (until it gets an answer other than a pause notice)
        while (r := call(stop.is_set)) is not None and r is not False:
            notices.append(r)
        got[name] = r

    def settle_after_return():  # the clock moves past RETURN_S (no change wakes the streams)
        clock.t += 2 * RETURN_S
        with arb.lock:
            arb._settle(clock.t)

    def asking(name, call) -> threading.Thread:
        t = threading.Thread(target=ask, args=(name, call), daemon=True)
        t.start()
        return t

    assert head.wait(stop.is_set) is None  # head makes a batch (one slot of two)
    waiter = asking("ahead", ahead.wait)
    until(lambda: notices, "the held stream's pause notice")
    notice = pb.BatchChunk.FromString(notices[0]).pause
    assert "earlier batches" in notice.reason and notice.by_priority == 3, notice  # (the job's own: the client
    # keeps that server live, `pause.paused(own=)`)
    assert other.wait(stop.is_set) is None  # another job's stream takes the free slot at once
    other.made()
    other.sent()
    head.made(batch=True)  # head sends: it still wants the server
    time.sleep(0.2)
    assert "ahead" not in got and ahead.paused_since is not None
    head.sent()
    settle_after_return()  # head sent a while ago and asks nothing: the later stream goes
    until(lambda: "ahead" in got, "the later stream's slot")
    assert got["ahead"] is None and ahead.paused_since is None
    waiter.join(10)
    ahead.made(batch=True)
    asking("head", head.wait).join(10)
    assert got["head"] is None  # head asks again and makes a batch
    sender = asking("send", ahead.may_send)
    time.sleep(0.2)
    assert "send" not in got  # the later stream's made batch waits
    head.made(batch=True)
    head.sent()
    settle_after_return()
    until(lambda: "send" in got, "the later stream's send")
    assert got["send"] is None
    sender.join(10)
    ahead.sent()
    for x in (head, ahead, other):
        x.leave()


def test_a_job_back_within_forget_s_keeps_its_seconds_a_new_one_starts_level():
    """A striping client's next block is a new stream of the same job: it comes back to its own
    seconds, not to the least-served job's (which gave a job ahead of its share a fresh start at
    every block); a job new to the level starts level with the least served; a job gone for
    longer than FORGET_S is forgotten."""
    from gdsload.service.server.priority import FORGET_S

    clock = Clock()
    arb = Arbiter(1, clock=clock)
    a, b = arb.enter(("id", "A"), 0), arb.enter(("id", "B"), 0)
    run_streams(arb, clock, [(a, 3.0), (b, 1.0)], grants=40)
    for _ in range(2):  # A alone for two dear batches more: ahead of B
        assert a.wait(lambda: False) is None
        clock.t += 3.0
        a.made()
        a.sent()
    ahead, behind = arb.jobs[("id", "A")].used, arb.jobs[("id", "B")].used
    assert ahead > behind
    a.leave()  # its block ends; its next block's stream comes at once
    a2 = arb.enter(("id", "A"), 0)
    assert arb.jobs[("id", "A")].used >= ahead  # its own seconds, not B's (fewer, maybe)
    c = arb.enter(("id", "C"), 0)
    assert arb.jobs[("id", "C")].used == min(arb.jobs[("id", "A")].used, behind)
    for t in (a2, c):
        t.leave()
    clock.t += FORGET_S + 1
    d = arb.enter(("id", "D"), 0)  # (a stream entering drops the jobs gone for longer)
    assert ("id", "A") not in arb.jobs and ("id", "C") not in arb.jobs
    for t in (b, d):
        t.leave()


def test_a_pooled_decode_charges_its_job_the_pools_seconds_not_its_stream_s_wait():
    """A stream whose batches are decoded in the server's decode pool waits for them behind other
    jobs' decodes (and its loader decodes ahead): its job pays the pool's seconds for its decodes,
    not that wait. Charged the wait, a job whose first batch waited 11 s for the pool (seen at a
    quarter core: four jobs' first batches, one pipeline) was then held back until the other jobs
    had used 11 s each, and its client, silent that long, counted a stall."""
    clock = Clock()
    arb = Arbiter(1, clock=clock)
    a, b = arb.enter(("id", "A"), 0), arb.enter(("id", "B"), 0)
    assert a.wait(lambda: False) is None
    clock.t += 11.5  # 11 s of it waiting for the pool, whose workers took 0.5 s for A's batches
    a.made(batch=True, pooled=(11.0, 0.5))
    assert a.may_send(lambda: False) is None
    clock.t += 0.25  # its send
    a.sent()
    assert arb.jobs[("id", "A")].used == pytest.approx(0.5 + 0.5 + 0.25)  # made 0.5 (not its wait) + 0.5 + send
    run_streams(arb, clock, [(a, 1.0), (b, 1.0)], grants=6)  # B at 1 and 2 s, then A at 1.25 s goes
    assert [g[0][1] for g in arb.grants] == ["B", "B", "A", "B", "A", "B"]  # (charged 11.75 s: B six times)
    for t in (a, b):
        t.leave()


def test_strict_priority_between_levels_and_a_share_group_at_its_highest_member():
    clock = Clock()
    arb = Arbiter(1, clock=clock)
    lows = [arb.enter(("id", f"low{i}"), 0) for i in range(3)]
    member = arb.enter(("id", "member"), 0, group="g")  # priority 0, in the group of a priority-5 stream
    peer = arb.enter(("id", "peer"), 5, group="g")
    assert arb.level_of(member) == 5
    stop = threading.Event()
    assert peer.wait(stop.is_set) is None  # the group's priority-5 stream makes a batch: it wants the server
    out: list = []

    def one(turn):
        out.append(turn.wait(stop.is_set))

    t = threading.Thread(target=one, args=(lows[0],), daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # level 0 waits while level 5 wants the server
    stop.set()
    t.join(5)
    assert out == [False]
    peer.made()
    peer.sent()
    peer.leave()
    clock.t += 1.0  # (the group's peer left long ago: it wants nothing)
    high = arb.enter(("id", "high"), 10)
    run_streams(arb, clock, [(x, 1.0) for x in lows] + [(member, 1.0), (high, 1.0)], grants=40)
    assert [job for job, _, _ in arb.grants] == [("id", "high")] * 40  # high asks again at once: only it
    assert all(level >= (waiting or 0) for _, level, waiting in arb.grants)
    high.leave()
    clock.t += HANDOVER_S  # (a job between two of its streams holds lower levels until then)
    run_streams(arb, clock, [(x, 1.0) for x in lows] + [(member, 1.0)], grants=40)
    assert {job for job, _, _ in arb.grants} == {("id", f"low{i}") for i in range(3)} | {("id", "member")}


def test_a_lower_batch_backfills_only_a_gap_it_ends_within():
    """A higher job that reads at its own pace (a training loop: it asks every second, its
    batches take 0.1 s) leaves gaps; a lower job's batch starts in a gap only when it is expected
    to end before the higher job asks again (its measured cost against the higher job's measured
    period); a dearer one waits for that ask, and goes when the higher job is later than its
    period."""
    clock = Clock()
    arb = Arbiter(1, clock=clock)
    never = lambda: False  # noqa: E731
    cheap, dear = arb.enter(("id", "cheap"), 0), arb.enter(("id", "dear"), 0)
    for turn, cost in ((cheap, 0.3), (dear, 1.5)):  # their costs, measured before the high job came
        assert turn.wait(never) is None
        clock.t += cost
        turn.made()
        turn.sent()
    high = arb.enter(("id", "high"), 10)
    for i in range(3):  # asks at 0, 1, 2 s: a period of 1 s
        if i:
            clock.t += 0.9
        assert high.wait(never) is None
        clock.t += 0.1
        high.made()
        high.sent()
    assert arb.jobs[("id", "high")].period == pytest.approx(1.0)
    clock.t += 0.2  # 0.7 s before the high job's next ask: a 0.3-s batch fits, a 1.5-s one does not
    stop = threading.Event()
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(dear.wait(stop.is_set)), daemon=True)
    waiter.start()
    assert cheap.wait(never) is None  # the cheap one backfills at once
    clock.t += 0.3
    cheap.made()
    cheap.sent()
    waiter.join(0.5)
    assert waiter.is_alive() and not got  # the dear one waits for the high job's ask
    assert dear.paused_since is not None
    clock.t += 0.2  # the high job asks on time: it goes first, the dear one still waits
    assert high.wait(never) is None
    assert [job for job, _, _ in arb.grants][-1] == ("id", "high")
    clock.t += 0.1
    high.made()
    high.sent()
    clock.t += 1.5  # the high job is 0.6 s late: within a period (a job's asks come in bursts), it still holds
    waiter.join(0.5)
    assert waiter.is_alive() and not got
    clock.t += 0.6  # 1.2 s late, more than its period: it reads at a slower pace now and holds nothing
    waiter.join(10)  # (the waiter looks again by itself within POLL_S)
    assert got == [None] and dear.paused_since is None
    assert [job for job, _, _ in arb.grants][-1] == ("id", "dear")
    dear.made()
    for t in (cheap, dear, high):
        t.leave()


def test_waiting_streams_do_not_poll(monkeypatch):
    """Eight streams wait behind a higher one making a batch: they sleep until something
    concerns them (at most one look each per POLL_S for their stop condition), rather than each
    looking at all the others every few milliseconds (at 0.05 of a core, that took more of the
    server than its batches)."""
    arb = Arbiter(1)
    high = arb.enter(("id", "high"), 10)
    assert high.wait(lambda: False) is None  # making a batch: every lower stream waits
    looks = [0]
    above = arb._above

    def counted(*args):
        looks[0] += 1
        return above(*args)

    monkeypatch.setattr(arb, "_above", counted)
    stop = threading.Event()
    lows = [arb.enter(("id", f"low{i}"), 0) for i in range(8)]
    threads = [threading.Thread(target=t.wait, args=(stop.is_set,), daemon=True) for t in lows]
    for t in threads:
        t.start()
    until(lambda: looks[0] >= 8, "every low stream looked once")
    start, t0 = looks[0], time.monotonic()
    time.sleep(0.5)
    spent = time.monotonic() - t0
    # (a loaded machine makes fewer looks, never more; a 20-ms poll made ~25 each in 0.5 s)
    assert priority.POLL_S >= 0.25
    assert looks[0] - start <= 8 * (spent / 0.25 + 1), looks[0] - start
    stop.set()
    for t in lows:
        t.wake()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    high.made()
    for t in lows + [high]:
        t.leave()


def test_a_higher_job_s_batches_do_not_wake_the_streams_they_hold_back(monkeypatch):
    """Three lower streams wait while a higher one makes, sends (slowly: its connection takes
    bytes, `Turn.full`) and asks again, batch after batch: none of its changes wakes them (each
    wake costs a paused stream ~0.2 ms at a twentieth of a core: two per higher batch took 4 % of
    such a server from the job that paused them); the higher stream's end does."""
    arb = Arbiter(1)
    high = arb.enter(("id", "high"), 10)
    high.full = lambda: False
    looks = [0]
    above = arb._above
    me = threading.current_thread()

    def counted(*args):
        if threading.current_thread() is not me:  # (a lower stream's own look)
            looks[0] += 1
        return above(*args)

    monkeypatch.setattr(arb, "_above", counted)
    assert high.wait(lambda: False) is None
    lows = [arb.enter(("id", f"low{i}"), 0) for i in range(3)]
    got: list = []
    stop = threading.Event()
    threads = [threading.Thread(target=lambda t=t: got.append(t.wait(stop.is_set)), daemon=True) for t in lows]
    for t in threads:
        t.start()
    until(lambda: looks[0] >= 3, "every low stream looked once")
    start, t0 = looks[0], time.monotonic()
    for _ in range(20):
        high.made(batch=True)
        assert high.may_send(lambda: False) is None
        time.sleep(RETURN_S * 1.5)  # a slow send: its bytes do not move for a while
        high.progress_hook()()
        high.sent()
        assert high.wait(lambda: False) is None
    spent = time.monotonic() - t0
    assert not got
    # (at most their own look per POLL_S; one per change made 20 to 60)
    assert looks[0] - start <= 3 * (spent / priority.POLL_S + 1), looks[0] - start
    high.made()
    high.leave()
    until(lambda: got == [None], "a low stream goes once the higher one left (one slot)")
    stop.set()
    for t in lows:
        t.wake()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads) and sorted(got, key=str) == [False, False, None]
    for t in lows:
        t.leave()


# -- on servers --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_slot(roots):
    """Two servers that make one batch at a time (`batch_slots=1`): contention on every batch."""
    servers = [create_server([str(roots)], batch_slots=1, max_message_bytes=64 * 1024) for _ in range(2)]
    for srv, _ in servers:
        srv.start()
    yield [(srv, f"127.0.0.1:{port}") for srv, port in servers]
    for srv, _ in servers:
        srv.shutdown(grace_s=2)


class Held:
    """Higher work held on a server: a turn of priority 100 making a batch (its one slot taken)
    until `release()`; every lower stream pauses at its next batch boundary."""

    def __init__(self, srv, priority: int = 100):
        self.turn = srv.servicer.arbiter.enter(("test", "held"), priority)
        assert self.turn.wait(lambda: False) is None

    def release(self):
        self.turn.made()
        self.turn.leave()


@pytest.mark.parametrize("striped", [False, True])
def test_a_paused_job_sees_a_slower_stream_and_its_state_resumes_exactly(one_slot, roots, striped):
    """Higher work held on every server the job uses: its streams pause; for 5x `stall_timeout_s`
    and 2.5x `retry_timeout_s` no paused server counts a stall or a failure and the loop gets no
    error; then its epoch is exact, and a state taken while paused resumes exactly."""
    (srv, addr), (srv2, addr2) = one_slot
    local = keys(local_batches(roots / "feats", batch_size=B))
    kw = dict(dataset="feats", batch_size=B, output="numpy", prefetch=1, stall_timeout_s=0.5,
              retry_timeout_s=1.0, deadline_s=1.0)
    addresses = [addr, addr2] if striped else addr
    loader = RemoteLoader(addresses, **kw, stripe_batches=2, server_window=1)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    errors: list = []

    def consume():  # the training loop, waiting for its next batch while the stream is paused
        try:
            got.extend(it)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    held = [Held(s) for s in ([srv, srv2] if striped else [srv])]
    loop = threading.Thread(target=consume, daemon=True)
    try:
        loop.start()
        paused = lambda: {a: r for a, r in loader.stats()["servers"].items() if r["state"] == "paused"}  # noqa: E731
        until(lambda: paused(), "a stream paused")
        state = loader.state_dict()  # taken while the job is paused
        before = paused()
        time.sleep(2.5)  # paused for 5x stall_timeout_s and 2.5x retry_timeout_s: still no error
        after = loader.stats()["servers"]
        for a, row in before.items():
            now = after[a]
            assert now["state"] == "paused" and (now["stalls"], now["failures"]) == (row["stalls"], row["failures"]), \
                str(after)
            assert "priority 100" in now["paused_reason"] and now["paused_at"] <= time.time()
        assert not errors and len(got) < len(local) // B  # the loop waits for the paused streams
    finally:
        for h in held:
            h.release()
    loop.join(60)
    assert not loop.is_alive() and not errors, (str(errors[0]) if errors else None, loader.stats()["servers"])
    assert keys(got) == local  # the epoch, exact and in plan order, across the pause
    rows = loader.stats()["servers"]
    assert all(rows[a]["pauses"] >= 1 and rows[a]["paused_s"] > 0 and rows[a]["state"] != "paused" for a in before)
    again = RemoteLoader(addresses, **kw)
    again.load_state_dict(state)
    rest = keys(list(again))  # from the state taken while paused: the rest of the epoch, exactly
    assert 0 < len(rest) < len(local) and rest == local[len(local) - len(rest):]
    assert loader.stats()["servers_needed"] >= 1
    loader.close()
    again.close()


def _stream(addr: str, understands_pause: bool) -> tuple[list, threading.Thread]:
    req = pb.BatchRequest(dataset="feats", batch_size=B, world_size=1, max_batches=3,
                          understands_pause=understands_pause, priority=0)
    messages: list = []
    ch = grpc.insecure_channel(addr)
    call = pb_grpc.FeedStub(ch).StreamBatches(req, timeout=30)

    def read():
        for m in call:
            messages.append(m)
        ch.close()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return messages, t


def test_only_a_request_that_understands_pauses_is_told(one_slot):
    srv, addr = one_slot[0]
    held = Held(srv)
    try:
        old, t_old = _stream(addr, False)
        new, t_new = _stream(addr, True)
        arb = srv.servicer.arbiter
        until(lambda: sum(u.paused for u in arb.usage() if u.priority == 0) == 2, "both streams paused")
        until(lambda: len(new) >= 2, "two notices to the new request", timeout=10)
        assert old == []  # an older client: no message while paused
    finally:
        held.release()
    t_old.join(30)
    t_new.join(30)
    assert not t_old.is_alive() and not t_new.is_alive()
    assert all(not m.HasField("pause") for m in old) and sum(m.last for m in old) == 3
    notices = [m for m in new if m.HasField("pause")]
    assert len(notices) >= 2 and new[:len(notices)] == notices  # told first, then its batches
    assert notices[0].pause.by_priority == 100 and notices[-1].pause.paused_s >= 1.0
    assert not notices[0].HasField("header") and not notices[0].data
    assert sum(m.last for m in new) == 3


def test_a_high_job_among_three_low_ones(one_slot, roots):
    """Every grant goes to the highest level waiting; the high job's batches were made while low
    ones waited (they yielded); each job's epoch is exact."""
    srv, addr = one_slot[0]
    arb = srv.servicer.arbiter
    local = keys(local_batches(roots / "feats", batch_size=B))
    lows = [RemoteLoader(addr, dataset="feats", batch_size=B, output="numpy", priority=0) for _ in range(3)]
    low_keys: list[list[str]] = [[] for _ in lows]
    started = threading.Barrier(4, timeout=30)
    errors: list = []

    def run(i):
        try:
            it = iter(lows[i])
            low_keys[i] += next(it)["__key__"]
            started.wait()
            for b in it:
                low_keys[i] += b["__key__"]
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    started.wait()
    arb.grants.clear()
    high = RemoteLoader(addr, dataset="feats", batch_size=B, output="numpy", priority=10, job="train")
    high_keys = keys(high)
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert high_keys == local
    assert all(k == local for k in low_keys)
    grants = list(arb.grants)
    assert all(level >= (waiting if waiting is not None else level) for _, level, waiting in grants), grants
    mine = [g for g in grants if g[1] == 10]
    assert len(mine) == len(local) // B + 1  # every batch of the high job made once, then its end found
    assert any(waiting == 0 for _, _, waiting in mine)  # made while low streams waited: they yielded
    use = {u.priority: u for u in high.server_info().priorities}
    assert use[10].batches >= 32 and use[0].batches >= 3 * 32 and use[0].paused_s > 0
    text = srv.metrics.text()
    assert 'gdsload_feed_priority_batches_total{priority="10"}' in text
    assert 'gdsload_feed_priority_paused_seconds_total{priority="0"}' in text
    for lo in lows + [high]:
        lo.close()


# -- who may ask for what ---------------------------------------------------------------------------
def test_token_file_limits_priorities(roots, tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# name token highest\ntrain tok-train 10\nprep tok-prep 0\ninfer tls:infer.local 5\n")
    clients = auth.read_clients(path)
    srv, port = create_server([str(roots)], token=clients)
    srv.start()
    addr = f"127.0.0.1:{port}"
    try:
        def first(token, priority):
            lo = RemoteLoader(addr, dataset="feats", batch_size=B, output="numpy", token=token, priority=priority,
                              retry_timeout_s=2)
            try:
                return next(iter(lo))["__key__"]
            finally:
                lo.close()

        assert first("tok-train", 10) and first("tok-prep", 0)
        with pytest.raises(RemoteError) as e:
            first("tok-prep", 1)
        assert e.value.code == "PERMISSION_DENIED" and "priority 0 at most" in str(e.value), e.value
        with pytest.raises(RemoteError) as e:
            first("tok-train", 11)
        assert e.value.code == "PERMISSION_DENIED" and "'train'" in str(e.value) and "10 at most" in str(e.value)
        with pytest.raises(RemoteError) as e:
            first("wrong", 0)
        assert e.value.code == "UNAUTHENTICATED"
    finally:
        srv.shutdown(grace_s=2)


def test_token_file_formats_and_tls_identities(tmp_path):
    one = tmp_path / "one"
    one.write_text("s3cret\n")
    assert auth.read_clients(one) == "s3cret"  # the file of before: one token, priority 0 at most
    only = auth.Clients.of("s3cret")
    only.check_priority(0, [("authorization", "Bearer s3cret")], {})
    with pytest.raises(PermissionDenied, match="priority 0 at most"):
        only.check_priority(1, [("authorization", "Bearer s3cret")], {})
    many = tmp_path / "many"
    many.write_text("infer tls:infer.local 5\nbatch tok 1\n")
    clients = auth.read_clients(many)
    tls = {"x509_common_name": [b"infer.local"]}
    clients.check_priority(5, [], tls)  # a mutual-TLS client mapped by its certificate's name
    with pytest.raises(PermissionDenied, match="'infer', which may ask priority 5 at most"):
        clients.check_priority(6, [], tls)
    with pytest.raises(PermissionDenied, match="not listed"):
        clients.check_priority(1, [], {"x509_common_name": [b"other"]})
    assert auth.interceptors(clients)[0] is not None and auth.interceptors(auth.Clients([auth.Client(
        "x", "tls:x", 3)])) == []  # TLS identities only: no token check
    bad = tmp_path / "bad"
    bad.write_text("train tok ten\n")
    with pytest.raises(GdsloadError, match="line 1 must be 'NAME TOKEN HIGHEST_PRIORITY'"):
        auth.read_clients(bad)
    bad.write_text("a tok 1\nb tok 2\n")
    with pytest.raises(GdsloadError, match="appears twice"):
        auth.read_clients(bad)


def test_remote_loader_checks_its_priority():
    with pytest.raises(GdsloadError, match="priority must be an integer"):
        RemoteLoader("127.0.0.1:1", dataset="feats", priority=1.5)
    with pytest.raises(GdsloadError, match="job must be a string"):
        RemoteLoader("127.0.0.1:1", dataset="feats", job="x" * 129)
    lo = RemoteLoader("127.0.0.1:1", dataset="feats", priority=-3)
    other = RemoteLoader("127.0.0.1:1", dataset="feats")
    assert lo.priority == -3 and len(lo.job) == 32 and lo.job != other.job


def _low_paused_by_held_work(srv, addr: str, low) -> tuple[list, list, threading.Thread, Held]:
    """`low` reads two batches, then the rest on a thread while priority-5 work holds `srv`; returns
    once the low job's stream says it is paused: (its batches so far, its errors, the thread, the
    held work)."""
    it = iter(low)
    got = [next(it), next(it)]
    errors: list = []

    def consume():
        try:
            got.extend(it)
        except BaseException as exc:  # noqa: BLE001 (reported by the caller)
            errors.append(exc)

    held = Held(srv, priority=5)
    loop = threading.Thread(target=consume, daemon=True)
    loop.start()
    try:
        until(lambda: low.stats()["servers"][addr]["state"] == "paused", "the low job paused")
    except BaseException:
        held.release()
        raise
    return got, errors, loop, held


# -- memory for higher work -------------------------------------------------------------------------
def test_a_higher_job_short_of_memory_gets_a_paused_lower_jobs_and_both_epochs_stay_exact(roots):
    """Room for one stream and a half (`--max-memory`): a priority-0 job paused (by priority-5
    work) has its loader parked and evicted so that a priority-10 job's stream fits; the low job
    goes on from its next step when memory returns. Without the room maker the high job's
    stream is refused (UNAVAILABLE) until its retry budget ends."""
    from gdsload.service.protocol.config import Limits

    local = keys(local_batches(roots / "feats", batch_size=B))
    probe, port = create_server([str(roots)], max_message_bytes=64 * 1024)
    probe.start()
    try:
        lo = RemoteLoader(f"127.0.0.1:{port}", dataset="feats", batch_size=B, output="numpy", prefetch=1)
        it = iter(lo)
        next(it)
        one = lo.server_info().memory_in_use_bytes  # one stream's reservation
        lo.close()
    finally:
        probe.shutdown(grace_s=1)
    assert one > 0
    srv, port = create_server([str(roots)], batch_slots=2, max_message_bytes=64 * 1024,
                              limits=Limits(max_message_bytes=64 * 1024, max_memory_bytes=one * 3 // 2))
    srv.start()
    addr = f"127.0.0.1:{port}"
    low = RemoteLoader(addr, dataset="feats", batch_size=B, output="numpy", prefetch=1)
    held = None
    try:
        got, errors, loop, held = _low_paused_by_held_work(srv, addr, low)
        high = RemoteLoader(addr, dataset="feats", batch_size=B, output="numpy", priority=10, retry_timeout_s=5,
                            backoff_s=0.05, max_backoff_s=0.2)
        assert keys(high) == local  # it fitted: the paused job's memory was given to it
        assert srv.servicer.budget.reserved <= one * 3 // 2
        held.release()
        held = None
        loop.join(60)
        assert not loop.is_alive() and not errors, errors
        assert keys(got) == local  # the low job, suspended and resumed: exact, in plan order
        assert low.stats()["servers"][addr]["failures"] == 0
        high.close()
    finally:
        if held is not None:
            held.release()
        low.close()
        srv.shutdown(grace_s=2)


def test_a_suspended_job_resumes_when_the_higher_one_left_its_loader_parked(roots):
    """The higher job's loader, parked when it finished, holds its memory for the pool's idle_s:
    the suspended lower job's stream must not wait for it to go stale (its resume counts parked
    loaders as room: the budget evicts them). Here idle_s is 10 minutes: the low job's epoch ends
    within the bounded wait only if the parked loader gave way."""
    from gdsload.service.protocol.config import Limits

    local = keys(local_batches(roots / "feats", batch_size=B))
    probe, port = create_server([str(roots)], max_message_bytes=64 * 1024)
    probe.start()
    try:
        lo = RemoteLoader(f"127.0.0.1:{port}", dataset="feats", batch_size=B, output="numpy", prefetch=1)
        next(iter(lo))
        one = probe.servicer.budget.reserved  # one stream's reservation (open, or parked: the epoch is small)
        lo.close()
    finally:
        probe.shutdown(grace_s=1)
    srv, port = create_server([str(roots)], batch_slots=2, max_message_bytes=64 * 1024,
                              limits=Limits(max_message_bytes=64 * 1024, max_memory_bytes=one * 3 // 2))
    srv.servicer.warm.idle_s = 600.0
    srv.start()
    addr = f"127.0.0.1:{port}"
    low = RemoteLoader(addr, dataset="feats", batch_size=B, output="numpy", prefetch=1, retry_timeout_s=120)
    held = None
    try:
        got, errors, loop, held = _low_paused_by_held_work(srv, addr, low)
        # (another request than the low job's: its parked loader is not the low job's to take)
        high = RemoteLoader(addr, dataset="feats", batch_size=B, output="numpy", priority=10, retry_timeout_s=5,
                            backoff_s=0.05, max_backoff_s=0.2, shuffle=True, seed=1)
        assert keys(high) == keys(local_batches(roots / "feats", batch_size=B, shuffle=True, seed=1))
        high.close()
        until(lambda: len(srv.servicer.warm) >= 1, "the high job's loader parked, holding its memory")
        held.release()
        held = None
        loop.join(60)  # (far below idle_s: only an evicted parked loader lets the low job go on)
        assert not loop.is_alive() and not errors, (errors, low.stats()["servers"])
        assert keys(got) == local  # suspended, resumed: exact, in plan order
        assert srv.servicer.budget.reserved <= one * 3 // 2
    finally:
        if held is not None:
            held.release()
        low.close()
        srv.shutdown(grace_s=2)


@pytest.mark.parametrize("first, num_steps, block, stride", [
    (0, 37, 4, 2), (5, 37, 4, 2), (3, 40, 4, 3), (8, 41, 2, 4), (0, 9, 3, 1), (2, 2, 4, 2)])
def test_a_suspended_stripe_stream_resumes_with_exactly_its_remaining_steps(first, num_steps, block, stride):
    """The request a suspended `block_stride` stream reopens (`LoaderSource.next_step`: from the
    step after its last batch) asks for exactly the steps it had left, whatever batch it stopped at."""
    from types import SimpleNamespace

    from gdsload.plan.plan import BlockSteps
    from gdsload.service.server.sources import LoaderSource

    seq = list(BlockSteps(first, num_steps, block, stride))
    req = SimpleNamespace(block_batches=block, block_stride=stride)
    assert LoaderSource.next_step(SimpleNamespace(last_step=None, steps=iter(()), step=first, req=req)) == first
    for i, last in enumerate(seq):
        nxt = LoaderSource.next_step(SimpleNamespace(last_step=last, steps=iter(()), step=None, req=req))
        rest = list(BlockSteps(nxt, num_steps, block, stride)) if nxt < num_steps else []
        assert rest == seq[i + 1:], (last, nxt)


# -- the client's side, pure --------------------------------------------------------------------------
def test_the_schedule_s_paused_server_is_not_stalled_not_hedged_and_does_not_spend_the_retry_budget():
    from test_schedule import T0, deliver, finish, make, srv

    from gdsload.service.client.stripe import pause
    from gdsload.service.client.stripe.actions import Failure

    sch, link = make(retry_timeout_s=1.0, stall_timeout_s=0.5)
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    fa, fb = sch.pick(a, T0), sch.pick(b, T0)  # a: the head block 0; b: block 1
    fa.opened = fb.opened = True
    pause.paused(sch, fa, "priority 10 work on this server", T0)
    assert a.state.value == "paused" and link.server_stats()["a:1"]["pauses"] == 1
    assert link.server_stats()["a:1"]["paused_reason"] == "priority 10 work on this server"
    stalled, spent = sch.watch(T0 + 10)  # both silent for 20x stall_timeout_s
    assert stalled == [fb]  # b's request is cancelled as stalled; a's (paused) is not
    assert not sch.straggles(fa, b, 0, T0 + 10)  # never hedged
    assert sch.head_waits(T0 + 10) is False and sch.head_waits(T0 + 20) is False  # 20x retry_timeout_s
    deliver(sch, fa, T0 + 21, n=1)  # a batch ends the pause
    assert a.state.value == "ok" and link.server_stats()["a:1"]["paused_s"] == pytest.approx(21)
    pause.paused(sch, fa, "again", T0 + 22)  # a failure while paused keeps it paused, then DOWN when done
    sch.on_failure(fa, Failure.RETRY, RuntimeError("UNAVAILABLE"), T0 + 22)
    assert a.state.value == "paused"
    sch.on_finish(fa)
    assert a.state.value == "down"
    finish(sch, fb, T0 + 23)


@pytest.mark.parametrize("own", [True, False])
def test_a_server_paused_for_its_job_s_earlier_batches_keeps_its_pace_and_its_blocks(own):
    """A pause notice whose `by_priority` is the job's own (`turn.behind`: a pass opened ahead,
    held while this epoch's stream on that server wants it) is not the server's slowness: the
    paused time is left out of its pace, so it keeps its window and the blocks its stream claims
    (at a twentieth of a core each new request is a new loader). Paused by a higher job, its pace
    counts the pause and reads as a straggler's: the other server steals its next block. Either
    way its blocks stay laid out over it (`Schedule.live`, `Server.laid_out`: block b is still the
    b-th server's, so the streams go on)."""
    from test_schedule import T0, deliver, make, srv

    from gdsload.service.client.stripe import pause

    sch, _ = make(steps=64)
    a, b = srv(sch, "a:1"), srv(sch, "b:1")
    a.strided = b.strided = True
    fa, fb = sch.pick(a, T0), sch.pick(b, T0)  # one stream each: blocks 0, 2, ... and 1, 3, ...
    assert (fa.block, fa.stride, fb.block, fb.stride) == (0, 2, 1, 2)
    deliver(sch, fb, T0 + 0.1, n=3, dt=0.1)  # b: a batch every 0.1 s
    deliver(sch, fa, T0 + 0.1, n=2, dt=0.1)
    pause.paused(sch, fa, "held", T0 + 0.2, own=own)
    assert sch.live() == ["a:1", "b:1"]  # (its blocks stay laid out over it: the streams go on)
    assert not sch.straggles(fa, b, 2, T0 + 1.6)  # never hedged while paused
    deliver(sch, fa, T0 + 1.7, n=1)  # 1.5 s paused, then on
    assert a.state.value == "ok"
    if own:
        assert a.batch_s == pytest.approx(0.05) and sch.window(a) == 2
        assert sch.pick(b, T0 + 1.8) is None  # block 2 stays a's stream's; 3 is b's own
    else:
        assert a.batch_s == pytest.approx(0.8) and sch.window(a) == 1
        f = sch.pick(b, T0 + 1.8)
        assert (f.server, f.block, f.stride) == (b, 2, 0)  # stolen


def test_servers_needed_is_the_servers_in_use_scaled_by_the_stall():
    from gdsload.service.client.epoch import Tally

    t = Tally()
    assert t.servers_needed(2) is None
    t.span, t.counts["wait_s"] = [0.0, 1.0, 10.0], 1.0  # 10 s since the first batch, no stall after it
    assert t.servers_needed(2) == 2
    t.counts["wait_s"] = 6.0  # half of the loop's time waiting: twice the servers
    assert t.servers_needed(2) == 4


def test_a_reading_higher_job_between_two_of_its_streams_holds_lower_levels_for_the_handover():
    """A striping client's next block, or its next epoch, is a new stream: a higher job that was
    reading holds lower levels back for HANDOVER_S after its last stream left (its next stream
    would otherwise start on a server busy with lower batches); a job that made one batch and
    left (no pace) holds nothing."""
    clock = Clock()
    arb = Arbiter(1, clock=clock)
    never = lambda: False  # noqa: E731
    high = arb.enter(("id", "high"), 10)
    for _ in range(3):  # it reads: its pace is known
        assert high.wait(never) is None
        clock.t += 0.01
        high.made()
        high.sent()
    high.leave()
    low = arb.enter(("id", "low"), 0)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(low.wait(never)), daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not got and low.paused_since is not None
    clock.t += HANDOVER_S  # it did not come back: the low stream goes (it looks again by itself)
    waiter.join(10)
    assert got == [None] and low.paused_since is None
    low.made()
    once = arb.enter(("id", "once"), 10)  # one batch, no pace
    assert once.wait(never) is None
    once.made()
    once.sent()
    once.leave()
    clock.t += RETURN_S
    assert low.wait(never) is None  # at once
    low.made()
    low.leave()
