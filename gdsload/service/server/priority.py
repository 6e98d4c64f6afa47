"""Priorities on one server (issue 49): `Arbiter`, the turn of every stream to make its next batch.

A server makes at most `slots` batches at once (`--batch-slots`, default its cores). Each stream
(`Arbiter.enter(job, priority, group)`, one `Turn`) asks for a slot at each batch boundary
(`Turn.wait`), holds it while its source makes the batch (`Turn.made` gives it back), then may
send it (`Turn.may_send`) and sends it (`Turn.sent`: the batch's seconds, its making and its
sending, are charged to its job). The rules, in this order:

1. **Strict priority between levels.** A stream waits while a stream of a higher level *wants*
   the server: it is waiting for a slot, making a batch, sending one (`turn.sends`: while its
   bulk connection takes bytes, or its bytes moved less than `RETURN_S` ago), or sent its last
   batch less than `RETURN_S` ago (it asks again within microseconds). A lower stream's batch,
   once made, also waits before its send (`Turn.may_send`; paused, its batch kept): sending is
   most of a raw batch's cost (a stored batch of 3.4 MB: 0.4 ms of the stream thread's CPU to
   make, 2.4 ms to write to the bulk socket), so three lower sends would take most of a server
   limited to a twentieth of a core while the higher batches waited. A sending stream reports
   its progress (`Turn.progress`, per member on the bulk connection, per message in gRPC) while
   a lower level is present. A higher send whose bytes did not move for `RETURN_S` while its
   connection is full (`Turn.full`; on gRPC, which cannot tell, in any case) waits for its client
   and wants nothing (one whose connection takes bytes waits for the server's CPU: at a twentieth
   of a core for 60 ms at times, and lower batches made then took a tenth of the higher job's
   rate), so lower streams run meanwhile, but only a batch that ends before the higher job is
   expected back (*backfill*): each job's pace is measured (the gap between its asks,
   `Job.period`, and the seconds a batch of it takes, `Job.cost`, both moving averages), and a
   lower stream whose job's batch would still be making when the higher job asks again
   (`Job.asked + Job.period`) waits for that ask (a batch cannot be interrupted: at a tenth of a
   core one decoded batch takes seconds). A higher job later than expected by more than its
   period holds nothing. A higher job whose streams all ended holds lower levels back for
   `HANDOVER_S` more: the gap to its next stream (a striping client's next block, or its next
   epoch's probe, bulk handshake and first batch: 0.3 s of every 2-s epoch of a raw job at a
   twentieth of a core), which lower batches would otherwise fill. A stream held back that way
   is *paused*: its loader stops at the batch boundary (its prefetch ring fills, its readers
   wait), its cursor is the request's, and its next batch is the next of its plan when it goes
   on, so nothing is lost or repeated.
2. **Equal share of seconds per job within a level.** Among the waiting streams of the highest
   level, the slot goes to the job that used the fewest seconds of making batches (a job: every
   stream with the same `BatchRequest.job` from the same credentials; an empty job is a job of
   its own), ties to the job served least recently; of that job's streams, the one whose next
   batch comes first in its plan (`Turn.place`: a striping client hands batches out in plan
   order, so it waits for its head block, not for a later one). A job that arrives starts level
   with the least-served job already there (it does not get the time it was absent); a job whose
   streams all ended keeps its seconds for `FORGET_S` (a striping client's next block is a new
   stream: it comes back to its own share, not to the least-served job's). The seconds a batch
   takes (from the grant to the batch's frames ready: the wait for its loader and its encoding;
   then from the start of its send to its end) are its cost, so a decoded batch counts for what
   it took, not as one batch, and a raw one for its send too. A batch decoded in the server's
   decode pool (`pool.DecodePool`) is charged the pool's seconds for its loader's decodes in
   place of the stream's wait for them (`Turn.made(pooled=)`): that wait is mostly other jobs'
   decodes, charged to them, and a loader decodes ahead of its stream. A job's stream later in
   its plan (a later block, a next epoch's pass opened ahead) is paused, its batch kept, while
   one earlier wants the server (`turn.behind`); `crowded` keeps `Turn.may_send`'s fast path.
3. **A share group runs at its highest member's priority** (`group`: the share group's key).

A request that declared it understands pauses (`BatchRequest.understands_pause`) is told: while
paused, `Turn.wait` returns a pause notice (a `BatchChunk` holding only `pause`) when the pause
begins and every `NOTICE_S` while it lasts; the stream loop sends it. An older client gets only a
slower stream (a pause longer than its stall timeout is a stall to it: retried from its cursor).

What it reports (counted in `levels.Levels`): per level, streams open, paused and queued now,
batches made, seconds spent making them and paused (`usage()`, `ServerInfo.priorities`), and the
Prometheus metrics `gdsload_feed_priority_*`. The server's decode pool takes decoding batches in
the same order, reading turns without the lock (`Turn.level`, `.making`, `.wanting`; `pool.DecodePool`).
`grants` keeps the last grants (job, level, the highest level then waiting) for tests and debugging.

Waking: a waiting stream sleeps on a condition of its own; each change (a stream entered, asked,
made its batch or left) settles the waiting streams once (`Arbiter._settle`: their pauses, as
bookkeeping) and wakes only those with something to do: the stream that goes next (unless streams
above hold it back until they change state), a stream whose pause just began (its notice), held
batches when a job's last stream leaves, and, when a send finds its connection full, those that
may go (`Turn.progress`): a higher job's batches wake none of the streams they hold back (three
paused streams woken twice per higher batch and every 0.25 s took 4 % of a 0.05-core server).
Every wait is bounded: `Turn.wait` also wakes every `POLL_S` to check its stop condition, which
the call's end and the server's drain make come at once (`Turn.wake`, `Arbiter.wake_all`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from gdsload.service.server.levels import Job, Levels
from gdsload.service.server.turn import (FORGET_S, HANDOVER_S, HELD, IDLE, MAKING, NOTICE_S, POLL_S, RETURN_S,
                                         SENDING, WAITING, Turn, behind, sends, wake_held)
from gdsload.v1 import feed_pb2 as pb

__all__ = ["Arbiter", "FORGET_S", "NOTICE_S", "POLL_S", "RETURN_S", "Turn"]


class Arbiter:
    """The turns of one server's streams (the module docstring). Thread-safe."""

    def __init__(self, slots: int, metrics: Any = None, clock: Callable[[], float] = time.monotonic):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.metrics = metrics
        self.clock = clock
        self.lock = threading.RLock()
        self.busy = 0
        self.turns: dict[int, Turn] = {}
        self.jobs: dict[tuple, Job] = {}
        self.levels = Levels(metrics)
        self.group_levels: dict[Any, int] = {}  # share group -> its highest priority (replaced, never changed)
        self.top = self.bottom = 0  # the highest and lowest level of its streams (read without the lock)
        self.crowded: frozenset = frozenset()  # the jobs with several streams here (read without the lock)
        self.last_left = float("-inf")  # when a job with a known pace last lost its last stream here
        self.grants: collections.deque = collections.deque(maxlen=100_000)

    # -- streams -----------------------------------------------------------------------------------
    def enter(self, job: tuple, priority: int, group: Any = None, *, notices: bool = False) -> Turn:
        """A stream of `job` (a key: the caller's identity and BatchRequest.job, or unique) at
        `priority`; `group`: its share group's key (None: none); `notices`: it understands pauses."""
        with self.lock:
            t = Turn(self, job, priority, group, notices)
            self.turns[t.id] = t
            self._publish_groups()
            now = self.clock()
            self._forget(now)
            j = self.jobs.get(job)
            if j is None:
                j = self.jobs[job] = Job()
            if not j.streams:  # level with the least-served job of its level (no credit for its absence)
                peers = [self.jobs[o.job].used for o in self.turns.values()
                         if o.job != job and o.job in self.jobs and self.level_of(o) == self.level_of(t)]
                j.used = max(j.used, min(peers, default=0.0))
            j.streams += 1
            j.level = priority
            self.levels.add(priority)
            self.levels.watch(priority, self._count)
            self._settle(now)
        return t

    def leave(self, t: Turn) -> None:
        with self.lock:
            if t.id not in self.turns:
                return
            self._unpause(t, self.clock())
            del self.turns[t.id]
            if t.state is MAKING:
                self.busy -= 1
            self._publish_groups()
            j = self.jobs.get(t.job)
            if j is not None:  # kept `FORGET_S` (a striping client's next block is a new stream)
                j.streams -= 1
                j.left = self.clock()
                if j.period:
                    self.last_left = j.left
                if not j.streams:  # (its hold now ends at a known time: `_between`)
                    wake_held(self.turns.values())
            self._settle(self.clock())

    def wake_all(self) -> None:
        """Every waiting stream looks at its stop condition now (the server drains)."""
        with self.lock:
            for t in self.turns.values():
                t.cv.notify()

    def _publish_groups(self) -> None:
        """`group_levels` anew (the lock is held): readers without the lock see one or the other."""
        levels: dict[Any, int] = {}
        for o in self.turns.values():
            if o.group is not None:
                levels[o.group] = max(levels.get(o.group, o.priority), o.priority)
        self.group_levels = levels
        present = [self.level_of(o) for o in self.turns.values()]
        self.top, self.bottom = max(present, default=0), min(present, default=0)
        jobs = collections.Counter(o.job for o in self.turns.values())
        self.crowded = frozenset(j for j, n in jobs.items() if n > 1)

    def _forget(self, now: float) -> None:
        """Drop the jobs with no stream for `FORGET_S` (the lock is held)."""
        for key in [k for k, j in self.jobs.items() if j.streams <= 0 and now - j.left > FORGET_S]:
            del self.jobs[key]

    def level_of(self, t: Turn) -> int:
        """Its priority, or its share group's highest (the lock is held)."""
        return t.priority if t.group is None else self.group_levels.get(t.group, t.priority)

    def wants(self, t: Turn, now: float) -> bool:
        """Whether `t` wants the server now (rule 1)."""
        if t.state is WAITING or t.state is MAKING:
            return True
        return sends(t, now)[0]  # (or just opened: it asks at once)

    # -- a batch boundary --------------------------------------------------------------------------
    def wait(self, t: Turn, stop: Callable[[], bool]) -> bytes | bool | None:
        with self.lock:
            now = self.clock()
            if t.state is not WAITING:
                t.state, t.since, t.asked = WAITING, now, now
                j = self.jobs.get(t.job)
                if j is not None:
                    j.ask(now)
                self._settle(now)
            while True:
                if stop():  # (it no longer waits, nor wants the server)
                    return self._stopped(t, now)
                mine = self.level_of(t)
                above, until = self._above(t, mine, now)
                timeout = POLL_S
                if above is not None:
                    self._mark_paused(t, above, now)
                    notice = t.notice(now, self.level_of(t))
                    if notice is not None:
                        return notice
                    if until is not None:  # (only return windows above: the server may be free then)
                        timeout = min(timeout, until - now)
                    if t.notices:
                        timeout = min(timeout, t.noticed + NOTICE_S - now)
                else:
                    if not t.memory:
                        self._unpause(t, now)
                    if self.busy < self.slots and self._chosen(mine, now) is t:
                        return self._grant(t, mine, now)
                t.cv.wait(max(timeout, 0.001))
                now = self.clock()

    def _stopped(self, t: Turn, now: float) -> bool:
        """(`wait`, `may_send`: the lock is held) `t`'s stop condition came: it wants nothing now."""
        self._unpause(t, now)
        t.state, t.since = IDLE, now - RETURN_S
        self._settle(now)
        return False

    def _holds(self, o: Turn, now: float, cost: float) -> tuple[bool, float | None]:
        """Whether `o` (of a higher level) holds back a lower stream whose batch takes `cost`
        seconds (rule 1: it wants the server, or its job asks again before that batch would end),
        and until when (None: until `o` changes state)."""
        if o.state is WAITING or o.state is MAKING:
            return True, None
        going, end = sends(o, now)
        if going:
            return True, end
        due = self._due(o, now)
        if due is not None and due < now + cost:
            return True, due if due > now else due + self.jobs[o.job].period
        return False, None

    def _due(self, o: Turn, now: float) -> float | None:
        """When `o`'s job is expected to ask again, while it may still come: up to one period late
        (a job of several streams asks in bursts, so its mean gap is shorter than the gap between
        its bursts); a job later than that reads at a slower pace now and holds nothing."""
        j = self.jobs.get(o.job)
        if j is None or not j.period:
            return None
        due = j.asked + j.period
        return due if now < due + j.period else None

    def _above(self, t: Turn, mine: int, now: float, cost: float | None = None) -> tuple[int | None, float | None]:
        """The highest level above `mine` that holds `t` back (`_holds`; `cost`: of what `t`
        would do, default its job's batch), and, when nothing above holds it for longer than a
        known time, when the last of those times ends (else None)."""
        above, until, hard = None, None, False
        if cost is None:
            cost = self.jobs[t.job].cost if t.job in self.jobs else 0.0
        for o in self.turns.values():
            if o is t:
                continue
            level = self.level_of(o)
            if level <= mine:
                continue
            held, end = self._holds(o, now, cost)
            if not held:
                continue
            above = level if above is None else max(above, level)
            if end is None:
                hard = True
            else:
                until = end if until is None else max(until, end)
        for j in self._between(mine, now):  # a higher job between two of its streams
            above = j.level if above is None else max(above, j.level)
            until = j.left + HANDOVER_S if until is None else max(until, j.left + HANDOVER_S)
        later, end = self._behind(t, now)
        if later:  # (rule 2: its job's stream earlier in the plan wants the server)
            above = mine if above is None else above
            if end is None:
                hard = True
            else:
                until = end if until is None else max(until, end)
        return above, None if hard else until

    def _behind(self, t: Turn, now: float) -> tuple[bool, float | None]:
        """`turn.behind`: whether a stream of `t`'s job and level earlier in the plan wants the server."""
        return behind(t, self.turns.values(), self.level_of, now) if t.job in self.crowded else (False, None)

    def _between(self, mine: int, now: float) -> list[Job]:
        """The jobs above level `mine` that were reading (their pace is known) and whose streams
        all ended less than `HANDOVER_S` ago (rule 1: they hold lower levels back until their
        next stream comes)."""
        if now - self.last_left >= HANDOVER_S:  # (no job left lately: nothing to look at)
            return []
        return [j for j in self.jobs.values()
                if not j.streams and j.period and j.level > mine and now - j.left < HANDOVER_S]

    def _settle(self, now: float) -> None:
        """After a change (the lock is held): each waiting stream that a higher level holds back
        (`_holds`) is paused (bookkeeping), the others are not; wake those whose pause just began
        and that are told of pauses, and, with a slot free, the stream that goes next (the chosen
        of the highest waiting level: if streams above it hold it back, it sleeps until they do
        not)."""
        top = None  # the highest level that wants the server
        soon = []  # (level, when) of the streams above that do not want it now but whose job asks soon
        for o in self.turns.values():
            level = self.level_of(o)
            if self.wants(o, now):
                top = level if top is None else max(top, level)
            else:
                due = self._due(o, now)
                if due is not None:
                    soon.append((level, due))
        for j in self._between(-(1 << 62), now):
            top = j.level if top is None else max(top, j.level)
        first = None
        for o in self.turns.values():
            if o.state is HELD:  # a made batch waiting to be sent: it looks again when nothing above wants
                if top is None or self.level_of(o) >= top:
                    o.cv.notify()
                continue
            if o.state is not WAITING:
                continue
            level = self.level_of(o)
            by = top if top is not None and level < top else None
            if soon:
                cost = self.jobs[o.job].cost if o.job in self.jobs else 0.0
                for lv, due in soon:
                    if lv > level and due < now + cost and (by is None or lv > by):
                        by = lv
            if by is None and self._behind(o, now)[0]:
                by = level  # (its job's earlier stream goes first)
            if by is not None:
                self._mark_paused(o, by, now)
                if o.notices and not o.noticed:
                    o.cv.notify()
            elif not o.memory:
                self._unpause(o, now)
            if first is None or level > first:
                first = level
        if first is not None and self.busy < self.slots:
            chosen = self._chosen(first, now)
            if chosen is not None:  # (held back until streams above change state, which settles
                above, until = self._above(chosen, first, now)  # again, it is not woken to sleep)
                if above is None or until is not None:
                    chosen.cv.notify()

    def _chosen(self, level: int, now: float) -> Turn | None:
        """The waiting stream of `level` whose job comes next (rule 2), and of its streams the one
        whose batch comes first in its plan (`Turn.place`), if no stream of its job earlier in
        the plan wants the server (`_behind`)."""
        best, key = None, None
        for o in self.turns.values():
            if o.state is not WAITING or self.level_of(o) != level or self._behind(o, now)[0]:
                continue
            j = self.jobs[o.job]
            k = (j.used, j.last, o.place, o.asked, o.id)
            if key is None or k < key:
                best, key = o, k
        return best

    def _grant(self, t: Turn, level: int, now: float) -> None:
        waiting = [self.level_of(o) for o in self.turns.values() if o is not t and o.state is WAITING]
        self.grants.append((t.job, level, max(waiting, default=None)))
        t.state, t.since, t.granted = MAKING, now, now
        self.busy += 1
        self.jobs[t.job].last = now
        if self.busy < self.slots:  # the next stream may go too
            self._settle(now)
        return None

    def made(self, t: Turn, memory_wait: bool = False, batch: bool = False,
             pooled: tuple[float, float] | None = None) -> None:
        with self.lock:
            if t.state is not MAKING:
                return
            now = self.clock()
            if t.memory and not memory_wait:
                t.memory = False
                self._unpause(t, now)
            elif memory_wait and not t.memory:
                t.memory = True
                self._mark_paused(t, max((self.level_of(o) for o in self.turns.values()), default=t.priority), now)
                t.noticed = 0.0
            took = now - t.granted
            self.busy -= 1
            t.state, t.since, t.send_start = SENDING, now, now
            j = self.jobs.get(t.job)
            t.pending = took if batch else None
            if batch:  # (its cost is known when it is sent)
                if j is not None:  # (a pooled decode: the pool's seconds, not the wait for them)
                    j.used += took if pooled is None else max(0.0, took - pooled[0]) + pooled[1]
            elif j is not None:
                j.made(took)
            self.levels.made(self.level_of(t), took, now)
            self._settle(now)

    def may_send(self, t: Turn, stop: Callable[[], bool]) -> bytes | bool | None:
        """(`Turn.may_send`) hold a made batch while a higher level wants the server (rule 1)."""
        with self.lock:
            now = self.clock()
            cost = self.jobs[t.job].send if t.job in self.jobs else 0.0
            while True:
                if stop():
                    return self._stopped(t, now)
                above, until = self._above(t, self.level_of(t), now, cost)
                if above is None or t.hurry:
                    if t.state is HELD:
                        self._unpause(t, now)
                    t.state, t.since, t.send_start, t.hurry = SENDING, now, now, False
                    return None
                if t.state is not HELD:
                    t.state = HELD
                    self._settle(now)  # (it no longer wants the server: lower levels may go)
                self._mark_paused(t, above, now)
                notice = t.notice(now, self.level_of(t))
                if notice is not None:
                    return notice
                timeout = POLL_S if until is None else min(POLL_S, until - now)
                if t.notices:
                    timeout = min(timeout, t.noticed + NOTICE_S - now)
                t.cv.wait(max(timeout, 0.001))
                now = self.clock()

    def sent(self, t: Turn) -> None:
        with self.lock:
            if t.state is SENDING:
                now = self.clock()
                t.state, t.since = IDLE, now
                if t.pending is None:  # (nothing was made to send)
                    return
                took = now - t.send_start
                j = self.jobs.get(t.job)
                if j is not None:
                    j.sent(t.pending, took)
                self.levels.busy(self.level_of(t), took, now)
                t.pending = None

    # -- pauses --------------------------------------------------------------------------------------
    def _mark_paused(self, t: Turn, by: int, now: float) -> None:
        """`t` waits for level `by`: a pause (begun now or going on)."""
        if t.paused_since is None:
            t.paused_since, t.pauses, t.noticed = now, t.pauses + 1, 0.0
        t.paused_by = by

    def memory_notice(self, t: Turn) -> bytes | None:
        with self.lock:
            if not t.memory:
                return None
            now = self.clock()
            self._mark_paused(t, t.paused_by, now)
            return t.notice(now, self.level_of(t))

    def release_below(self, priority: int, need: int) -> int:
        """Suspend the sources of streams below `priority` that wait for their turn (lowest level
        first, so their threads are not in their sources), until `need` bytes are parked for
        eviction; returns the bytes parked. The budget's room maker for higher work. A lower stream
        held before its send (`may_send`) sends its batch at once instead, so that it can be
        suspended at its next turn (the higher stream's next try: its admission is retried)."""
        freed = 0
        with self.lock:
            for t in self.turns.values():  # a made batch must go before its loader can be parked: at
                if t.state is HELD and self.level_of(t) < priority:  # its next turn (the next try)
                    t.hurry = True
                    t.cv.notify()
            waiting = sorted((t for t in self.turns.values() if t.state is WAITING and t.release is not None
                              and self.level_of(t) < priority), key=lambda t: (self.level_of(t), -t.id))
            for t in waiting:
                if freed >= need:
                    break
                got = t.release()
                if got:
                    freed += got
                    t.memory = True
                    self._mark_paused(t, priority, self.clock())
                    t.noticed = 0.0  # (told by its own thread, at its next look)
                    t.cv.notify()
        return freed

    def _unpause(self, t: Turn, now: float) -> None:
        if t.paused_since is None:
            return
        took = now - t.paused_since
        t.paused_since = None
        t.paused_s += took
        self.levels.paused(self.level_of(t), took)

    # -- what it reports ----------------------------------------------------------------------------
    def usage(self) -> list[pb.PriorityUse]:
        """Each level's `PriorityUse`, highest first."""
        with self.lock:
            streams = [(self.level_of(t), t.state is WAITING, t.paused_since) for t in self.turns.values()]
            return self.levels.usage(streams, self.slots, self.clock())

    def _count(self, level: int) -> tuple[int, int]:
        """(A scrape of the per-level gauges) the streams of `level` waiting for a slot, and paused."""
        with self.lock:
            mine = [t for t in self.turns.values() if self.level_of(t) == level]
            return sum(t.state is WAITING for t in mine), sum(t.paused_since is not None for t in mine)
