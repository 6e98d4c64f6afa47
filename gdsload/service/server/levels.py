"""What the priority arbiter counts (`priority.Arbiter`): each job's seconds and pace (`Job`) and
each level's batches, seconds and pauses (`Levels`), reported as `ServerInfo.priorities` and the
Prometheus metrics `gdsload_feed_priority_*`. Used under the arbiter's lock only."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from gdsload.v1 import feed_pb2 as pb

#: The weight of the newest sample in a job's moving averages (`Job.period`, `Job.cost`).
PACE_WEIGHT = 0.25
#: The span of `PriorityUse.utilisation`.
USE_SPAN_S = 10.0


@dataclass
class Job:
    """One job on this server (every stream with its key: `priority.Arbiter.enter`)."""

    used: float = 0.0  # seconds of making and sending batches
    last: float = 0.0  # when it was last granted a slot
    asked: float = 0.0  # when one of its streams last asked for a slot
    period: float = 0.0  # the gap between its asks (a moving average; 0: not known yet)
    cost: float = 0.0  # the seconds a batch of it takes, made and sent (a moving average; 0: not known yet)
    send: float = 0.0  # the seconds a batch of it takes to send (a moving average)
    streams: int = 0
    left: float = 0.0  # when its last stream left
    level: int = 0  # the priority of its streams

    def ask(self, now: float) -> None:
        if self.asked:
            self.period = average(self.period, now - self.asked)
        self.asked = now

    def made(self, took: float) -> None:
        """A slot's use that sent nothing (the source ended or waits for memory)."""
        self.used += took
        self.cost = average(self.cost, took)

    def sent(self, made: float, took: float) -> None:
        """A batch that took `made` seconds to make (charged then) was sent in `took`."""
        self.used += took
        self.cost = average(self.cost, made + took)
        self.send = average(self.send, took)


def average(mean: float, sample: float) -> float:
    """A moving average's next value (`PACE_WEIGHT`; 0: none yet)."""
    return sample if not mean else mean + PACE_WEIGHT * (sample - mean)


@dataclass
class Level:
    """One priority level's counters since the server started."""

    batches: int = 0
    busy_s: float = 0.0
    paused_s: float = 0.0
    recent: collections.deque = field(default_factory=collections.deque)  # (when, seconds) of its batches


class Levels:
    """Every level's counters and gauges (`metrics`: the server's `metrics.Metrics`, or None)."""

    def __init__(self, metrics: Any = None):
        self.metrics = metrics
        self.levels: dict[int, Level] = {}
        self.counters: dict[int, Any] = {}  # level -> its batches counter (labelled once)
        self.watched: set[int] = set()  # levels whose gauges read the arbiter (`watch`)

    def add(self, level: int) -> Level:
        return self.levels.setdefault(level, Level())

    def made(self, level: int, took: float, now: float) -> None:
        """A batch of `level` took `took` seconds."""
        self.busy(level, took, now)
        self.levels[level].batches += 1
        if self.metrics is not None:
            counter = self.counters.get(level)
            if counter is None:
                counter = self.counters[level] = self.metrics.priority_batches.labels(str(level))
            counter.inc()

    def busy(self, level: int, took: float, now: float) -> None:
        """`level` spent `took` more seconds on a batch (`made`: making it, counted; or its send)."""
        lv = self.add(level)
        lv.busy_s += took
        lv.recent.append((now, took))
        while lv.recent and now - lv.recent[0][0] > USE_SPAN_S:
            lv.recent.popleft()

    def paused(self, level: int, took: float) -> None:
        """A stream of `level` was paused `took` seconds."""
        self.add(level).paused_s += took
        if self.metrics is not None:
            self.metrics.priority_paused_s.labels(str(level)).inc(took)

    def watch(self, level: int, count: Callable[[int], tuple[int, int]]) -> None:
        """Give `level`'s gauges (queued, paused) their values at each scrape, from `count(level)`
        (the arbiter's streams then): nothing is set per batch."""
        m = self.metrics
        if m is None or level in self.watched:
            return
        self.watched.add(level)
        m.priority_queue.labels(str(level)).set_function(lambda: count(level)[0])
        m.priority_paused.labels(str(level)).set_function(lambda: count(level)[1])

    def usage(self, streams: list[tuple[int, bool, float | None]], slots: int, now: float) -> list[pb.PriorityUse]:
        """Each level's `PriorityUse`, highest first, from the streams' (level, waiting, paused
        since or None)."""
        out = []
        for p in sorted(self.levels, reverse=True):
            lv = self.levels[p]
            mine = [s for s in streams if s[0] == p]
            paused = [since for _, _, since in mine if since is not None]
            recent = sum(s for when, s in lv.recent if now - when <= USE_SPAN_S)
            out.append(pb.PriorityUse(
                priority=p, streams=len(mine), paused=len(paused), queued=sum(1 for s in mine if s[1]),
                batches=lv.batches, busy_s=lv.busy_s, paused_s=lv.paused_s + sum(now - since for since in paused),
                utilisation=min(1.0, recent / (slots * USE_SPAN_S))))
        return out
