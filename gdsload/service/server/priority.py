"""Priorities on one server (issue 49): `Arbiter`, the turn of every stream to make its next batch.

A server makes at most `slots` batches at once (`--batch-slots`, default its cores). Each stream
(`Arbiter.enter(job, priority, group)`, one `Turn`) asks for a slot at each batch boundary
(`Turn.wait`), holds it while its source makes the batch (`Turn.made` gives it back, charging the
seconds to its job) and then sends it (`Turn.sent`). The rules, in this order:

1. **Strict priority between levels.** A stream waits while a stream of a higher level *wants*
   the server: it is waiting for a slot, making a batch, or sent its last batch less than
   `RETURN_S` ago (a stream whose client reads at once asks again within microseconds). A higher
   stream blocked in its send for longer (its client does not read: gRPC flow control, or the
   bulk socket full) wants nothing now, so lower streams run meanwhile. A stream held back that
   way is *paused*: its loader stops at the batch boundary (its prefetch ring fills, its readers
   wait), its cursor is the request's, and its next batch is the next of its plan when it goes
   on, so nothing is lost or repeated.
2. **Equal share of seconds per job within a level.** Among the waiting streams of the highest
   level, the slot goes to the job that used the fewest seconds of making batches (a job: every
   stream with the same `BatchRequest.job` from the same credentials; an empty job is a job of
   its own), ties to the job served least recently. A job that arrives starts level with the
   least-served job already there (it does not get the time it was absent); a job whose streams
   all ended keeps its seconds for `FORGET_S` (a striping client's next block is a new stream:
   it comes back to its own share, not to the least-served job's). The seconds a batch
   takes (from the grant to the batch's frames ready: the wait for its loader and its encoding)
   are its cost, so a decoded batch counts for what it took, not as one batch.
3. **A share group runs at its highest member's priority** (`group`: the share group's key).

A request that declared it understands pauses (`BatchRequest.understands_pause`) is told: while
paused, `Turn.wait` returns a pause notice (a `BatchChunk` holding only `pause`) when the pause
begins and every `NOTICE_S` while it lasts; the stream loop sends it. An older client gets no
notice, only a slower stream (a pause longer than its stall timeout is then a stall to it, which
it retries as today, from its cursor).

What it reports: per level, streams open, paused and queued now, batches made, seconds spent
making them and paused (`usage()`, `ServerInfo.priorities`), and the Prometheus metrics
`gdsload_feed_priority_*`. The server's decode pool takes decoding batches in the same order,
reading each turn without the lock (`Turn.level`, `Turn.making`, `Turn.wanting`; `pool.DecodePool`).
`grants` keeps the last grants (job, level, the highest level then
waiting) for tests and debugging. Every wait is bounded: `Turn.wait` wakes at least every
`POLL_S` to check its stop condition.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gdsload.v1 import feed_pb2 as pb

#: A stream that sent its batch less than this ago still wants the server (it asks again at once).
RETURN_S = 0.05
#: How often a paused stream that understands pauses is told so.
NOTICE_S = 1.0
#: Longest wait of a stream between looks at its stop condition and at the others.
POLL_S = 0.02
#: How long a job with no stream keeps its seconds: a striping client's next block (a new stream)
#: comes back to its share, not to the least-served job's.
FORGET_S = 5.0
#: The span of `PriorityUse.utilisation`.
USE_SPAN_S = 10.0

_WAITING, _MAKING, _SENDING, _IDLE = "waiting", "making", "sending", "idle"


@dataclass
class Level:
    """One priority level's counters since the server started."""

    batches: int = 0
    busy_s: float = 0.0
    paused_s: float = 0.0
    recent: collections.deque = field(default_factory=collections.deque)  # (when, seconds) of its batches


@dataclass
class Job:
    used: float = 0.0  # seconds of making batches
    last: float = 0.0  # when it was last granted a slot
    streams: int = 0
    left: float = 0.0  # when its last stream left


class Turn:
    """One stream's place in the arbiter (see the module docstring). Used by the stream's thread
    only; `leave()` once, when the stream ends."""

    _ids = itertools.count()

    def __init__(self, arbiter: Arbiter, job: tuple, priority: int, group: Any, notices: bool):
        self.arbiter, self.job, self.priority, self.group, self.notices = arbiter, job, priority, group, notices
        self.id = next(self._ids)
        self.state = _IDLE
        self.since = arbiter.clock()  # when it entered its state
        self.asked = self.since  # when it began to wait
        self.granted = 0.0
        self.paused_since: float | None = None
        self.paused_by = 0
        self.paused_s = 0.0  # in all
        self.pauses = 0
        self.noticed = 0.0  # when it was last told it is paused
        self.memory = False  # its source waits for memory that higher work holds
        self.release: Callable[[], int] | None = None  # suspend its source (`sources.LoaderSource.suspend`)

    def wait(self, stop: Callable[[], bool]) -> bytes | bool | None:
        """Wait for a slot: None when granted (make the batch, then `made()`), a pause notice to
        send (then call again), or False when `stop()` became true."""
        return self.arbiter.wait(self, stop)

    def made(self, memory_wait: bool = False) -> None:
        """The batch is made (or the source ended): the slot is free, its seconds charged.
        `memory_wait`: no batch, the source waits for memory (`sources.MEMORY_WAIT`): it stays
        paused (`memory_notice`)."""
        self.arbiter.made(self, memory_wait)

    def memory_notice(self) -> bytes | None:
        """(Waiting for memory) the pause notice to send, if due."""
        return self.arbiter.memory_notice(self)

    def sent(self) -> None:
        self.arbiter.sent(self)

    # -- read without the arbiter's lock (the decode pool's order: `pool.DecodePool`) ---------------
    def level(self) -> int:
        """Its level now: its priority, or its share group's highest (`Arbiter.group_levels`)."""
        return self.priority if self.group is None else self.arbiter.group_levels.get(self.group, self.priority)

    def making(self) -> bool:
        """Whether it holds a batch slot (granted, its batch not made yet)."""
        return self.state is _MAKING

    def wanting(self) -> bool:
        """Whether it wants the server now (`Arbiter.wants`: waiting, making, or just sent)."""
        state, since = self.state, self.since
        return state in (_WAITING, _MAKING) or self.arbiter.clock() - since < RETURN_S

    def leave(self) -> None:
        self.arbiter.leave(self)


class Arbiter:
    """The turns of one server's streams (the module docstring). Thread-safe."""

    def __init__(self, slots: int, metrics: Any = None, clock: Callable[[], float] = time.monotonic):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.metrics = metrics
        self.clock = clock
        self.cv = threading.Condition()
        self.busy = 0
        self.turns: dict[int, Turn] = {}
        self.jobs: dict[tuple, Job] = {}
        self.levels: dict[int, Level] = {}
        self.group_levels: dict[Any, int] = {}  # share group -> its highest priority (replaced, never changed)
        self.grants: collections.deque = collections.deque(maxlen=100_000)
        self._shown: dict[int, tuple[int, int]] = {}  # level -> (queued, paused) last set on its gauges
        self._batches: dict[int, Any] = {}  # level -> its batches counter (labelled once)

    # -- streams -----------------------------------------------------------------------------------
    def enter(self, job: tuple, priority: int, group: Any = None, *, notices: bool = False) -> Turn:
        """A stream of `job` (a key: the caller's identity and BatchRequest.job, or unique) at
        `priority`; `group`: its share group's key (None: none); `notices`: it understands pauses."""
        with self.cv:
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
            self.levels.setdefault(priority, Level())
            self.cv.notify_all()
        return t

    def leave(self, t: Turn) -> None:
        with self.cv:
            if t.id not in self.turns:
                return
            self._unpause(t, self.clock())
            del self.turns[t.id]
            if t.state is _MAKING:
                self.busy -= 1
            self._publish_groups()
            j = self.jobs.get(t.job)
            if j is not None:  # kept `FORGET_S` (a striping client's next block is a new stream)
                j.streams -= 1
                j.left = self.clock()
            self._gauges()
            self.cv.notify_all()

    def _publish_groups(self) -> None:
        """`group_levels` anew (the lock is held): readers without the lock see one or the other."""
        levels: dict[Any, int] = {}
        for o in self.turns.values():
            if o.group is not None:
                levels[o.group] = max(levels.get(o.group, o.priority), o.priority)
        self.group_levels = levels

    def _forget(self, now: float) -> None:
        """Drop the jobs with no stream for `FORGET_S` (the lock is held)."""
        for key in [k for k, j in self.jobs.items() if j.streams <= 0 and now - j.left > FORGET_S]:
            del self.jobs[key]

    def level_of(self, t: Turn) -> int:
        """Its priority, or its share group's highest (the lock is held)."""
        if t.group is None:
            return t.priority
        return max(o.priority for o in self.turns.values() if o.group == t.group)

    def wants(self, t: Turn, now: float) -> bool:
        """Whether `t` wants the server now (rule 1)."""
        if t.state in (_WAITING, _MAKING):
            return True
        return now - t.since < RETURN_S  # just sent (or just opened): it asks again at once

    # -- a batch boundary --------------------------------------------------------------------------
    def wait(self, t: Turn, stop: Callable[[], bool]) -> bytes | bool | None:
        with self.cv:
            now = self.clock()
            if t.state is not _WAITING:
                t.state, t.since, t.asked = _WAITING, now, now
                self._gauges()
            while True:
                if stop():  # (it no longer waits, nor wants the server)
                    self._unpause(t, now)
                    t.state, t.since = _IDLE, now - RETURN_S
                    self._gauges()
                    return False
                mine = self.level_of(t)
                above = [self.level_of(o) for o in self.turns.values()
                         if o is not t and self.wants(o, now) and self.level_of(o) > mine]
                if above:
                    notice = self._pause(t, max(above), now)
                    if notice is not None:
                        return notice
                else:
                    if not t.memory:
                        self._unpause(t, now)
                    if self.busy < self.slots and self._chosen(mine) is t:
                        return self._grant(t, mine, now)
                self.cv.wait(POLL_S)
                now = self.clock()

    def _chosen(self, level: int) -> Turn | None:
        """The waiting stream of `level` whose job comes next (rule 2)."""
        best, key = None, None
        for o in self.turns.values():
            if o.state is not _WAITING or self.level_of(o) != level:
                continue
            j = self.jobs[o.job]
            k = (j.used, j.last, o.asked, o.id)
            if key is None or k < key:
                best, key = o, k
        return best

    def _grant(self, t: Turn, level: int, now: float) -> None:
        waiting = [self.level_of(o) for o in self.turns.values() if o is not t and o.state is _WAITING]
        self.grants.append((t.job, level, max(waiting, default=None)))
        t.state, t.since, t.granted = _MAKING, now, now
        self.busy += 1
        self.jobs[t.job].last = now
        self._gauges()
        return None

    def made(self, t: Turn, memory_wait: bool = False) -> None:
        with self.cv:
            if t.state is not _MAKING:
                return
            now = self.clock()
            if t.memory and not memory_wait:
                t.memory = False
                self._unpause(t, now)
            elif memory_wait and not t.memory:
                t.memory = True
                self._pause(t, max((self.level_of(o) for o in self.turns.values()), default=t.priority), now)
                t.noticed = 0.0
            took = now - t.granted
            self.busy -= 1
            t.state, t.since = _SENDING, now
            j = self.jobs.get(t.job)
            if j is not None:
                j.used += took
            lv = self.levels.setdefault(self.level_of(t), Level())
            lv.batches += 1
            lv.busy_s += took
            lv.recent.append((now, took))
            while lv.recent and now - lv.recent[0][0] > USE_SPAN_S:
                lv.recent.popleft()
            if self.metrics is not None:
                level = self.level_of(t)
                counter = self._batches.get(level)
                if counter is None:
                    counter = self._batches[level] = self.metrics.priority_batches.labels(str(level))
                counter.inc()
            self._gauges()
            self.cv.notify_all()

    def sent(self, t: Turn) -> None:
        with self.cv:
            if t.state is _SENDING:
                t.state, t.since = _IDLE, self.clock()

    # -- pauses --------------------------------------------------------------------------------------
    def _pause(self, t: Turn, by: int, now: float) -> bytes | None:
        """`t` waits for level `by`: a pause (begun now or going on); the notice to send, if due."""
        if t.paused_since is None:
            t.paused_since, t.pauses, t.noticed = now, t.pauses + 1, 0.0
            self._gauges()
        t.paused_by = by
        if not t.notices or (t.noticed and now - t.noticed < NOTICE_S):
            return None
        t.noticed = now
        return pb.BatchChunk(pause=pb.StreamPause(
            reason=f"priority {by} work on this server (this stream: priority {self.level_of(t)})",
            by_priority=by, paused_s=now - t.paused_since)).SerializeToString()

    def memory_notice(self, t: Turn) -> bytes | None:
        with self.cv:
            return self._pause(t, t.paused_by, self.clock()) if t.memory else None

    def release_below(self, priority: int, need: int) -> int:
        """Suspend the sources of streams below `priority` that wait for their turn (lowest level
        first, so their threads are not in their sources), until `need` bytes are parked for
        eviction; returns the bytes parked. The budget's room maker for higher work."""
        freed = 0
        with self.cv:
            waiting = sorted((t for t in self.turns.values() if t.state is _WAITING and t.release is not None
                              and self.level_of(t) < priority), key=lambda t: (self.level_of(t), -t.id))
            for t in waiting:
                if freed >= need:
                    break
                got = t.release()
                if got:
                    freed += got
                    t.memory = True
                    self._pause(t, priority, self.clock())
                    t.noticed = 0.0  # (told by its own thread, at its next look)
        return freed

    def _unpause(self, t: Turn, now: float) -> None:
        if t.paused_since is None:
            return
        took = now - t.paused_since
        t.paused_since = None
        t.paused_s += took
        p = self.level_of(t)
        self.levels.setdefault(p, Level()).paused_s += took
        if self.metrics is not None:
            self.metrics.priority_paused_s.labels(str(p)).inc(took)
        self._gauges()

    # -- what it reports ----------------------------------------------------------------------------
    def usage(self) -> list[pb.PriorityUse]:
        """Each level's `PriorityUse`, highest first."""
        with self.cv:
            now = self.clock()
            out = []
            for p in sorted(self.levels, reverse=True):
                lv = self.levels[p]
                mine = [t for t in self.turns.values() if self.level_of(t) == p]
                paused = [t for t in mine if t.paused_since is not None]
                recent = sum(s for when, s in lv.recent if now - when <= USE_SPAN_S)
                out.append(pb.PriorityUse(
                    priority=p, streams=len(mine), paused=len(paused),
                    queued=sum(1 for t in mine if t.state is _WAITING), batches=lv.batches, busy_s=lv.busy_s,
                    paused_s=lv.paused_s + sum(now - t.paused_since for t in paused),
                    utilisation=min(1.0, recent / (self.slots * USE_SPAN_S))))
            return out

    def _gauges(self) -> None:
        """The per-level gauges (the lock is held)."""
        m = self.metrics
        if m is None:
            return
        queued: dict[int, int] = dict.fromkeys(self.levels, 0)
        paused: dict[int, int] = dict.fromkeys(self.levels, 0)
        for t in self.turns.values():
            p = self.level_of(t)
            queued[p] = queued.get(p, 0) + (t.state is _WAITING)
            paused[p] = paused.get(p, 0) + (t.paused_since is not None)
        shown = self._shown
        for p in queued:
            now = (queued[p], paused[p])
            if shown.get(p) != now:  # (a gauge set only when it changes: this runs a few times a batch)
                shown[p] = now
                m.priority_queue.labels(str(p)).set(now[0])
                m.priority_paused.labels(str(p)).set(now[1])
