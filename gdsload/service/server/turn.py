"""One stream's place in the server's priority arbiter (`priority.Arbiter`, whose docstring has
the rules): `Turn`, the calls a stream makes at each batch boundary, and the states and times
the rules are written in."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from typing import Any

from gdsload.v1 import feed_pb2 as pb

#: A stream that sent its batch less than this ago still wants the server (it asks again at once).
RETURN_S = 0.05
#: How often a paused stream that understands pauses is told so.
NOTICE_S = 1.0
#: Longest wait of a stream between looks at its stop condition (a change in the arbiter wakes the
#: streams it concerns at once: `Arbiter._settle`, and a send that finds its connection full:
#: `Turn.progress`; the call's end and the server's drain too). Each look costs a paused stream
#: ~0.2 ms at a twentieth of a core: three paused streams looking every 0.25 s took 2 % of it.
POLL_S = 1.0
#: How long a higher job whose streams all ended still holds lower levels back: the gap until its
#: next stream (a striping client's next block, the next epoch: a probe, the bulk handshake and
#: the first batch; about 0.3 s at a twentieth of a core), which lower batches would otherwise fill.
HANDOVER_S = 0.5
#: How long a job with no stream keeps its seconds: a striping client's next block (a new stream)
#: comes back to its share, not to the least-served job's.
FORGET_S = 5.0
#: A stream's states (`Turn.state`): asking for a slot, holding one, its batch made and held before
#: its send (a higher level wants the server), sending it, neither.
WAITING, MAKING, HELD, SENDING, IDLE = "waiting", "making", "held", "sending", "idle"


class Turn:
    """One stream's place in the arbiter (`priority`'s docstring has the rules). Used by the stream's thread
    only; `leave()` once, when the stream ends."""

    _ids = itertools.count()

    def __init__(self, arbiter: Any, job: tuple, priority: int, group: Any, notices: bool):
        self.arbiter, self.job, self.priority, self.group, self.notices = arbiter, job, priority, group, notices
        self.id = next(self._ids)
        self.state = IDLE
        self.since = arbiter.clock()  # when it entered its state
        self.asked = self.since  # when it began to wait
        self.granted = 0.0
        self.place: tuple = ()  # its next batch's (epoch, step) in its job's plan (`sources.LoaderSource.place`)
        self.pending: float | None = None  # its made batch's seconds (its send is charged with them: `sent`)
        self.send_start = 0.0  # when its send began
        self.paused_since: float | None = None
        self.paused_by = 0
        self.paused_s = 0.0  # in all
        self.pauses = 0
        self.noticed = 0.0  # when it was last told it is paused
        self.memory = False  # its source waits for memory that higher work holds
        self.hurry = False  # (held) send now: higher work needs the memory its loader holds
        self.release: Callable[[], int] | None = None  # suspend its source (`sources.LoaderSource.suspend`)
        self.full: Callable[[], bool] | None = None  # its connection takes no bytes now (`transport.BulkFrames.full`)
        self.cv = threading.Condition(arbiter.lock)  # its own: woken only when it has something to do

    def wait(self, stop: Callable[[], bool]) -> bytes | bool | None:
        """Wait for a slot: None when granted (make the batch, then `made()`), a pause notice to
        send (then call again), or False when `stop()` became true."""
        return self.arbiter.wait(self, stop)

    def made(self, memory_wait: bool = False, batch: bool = False,
             pooled: tuple[float, float] | None = None) -> None:
        """The batch is made (or the source ended): the slot is free. `batch`: there is a batch to
        send (its seconds are charged when it is `sent`; else now). `memory_wait`: no batch, the
        source waits for memory (`sources.MEMORY_WAIT`): it stays paused (`memory_notice`).
        `pooled`: (waited, decoded) for a batch decoded in the server's decode pool
        (`sources.LoaderSource.pooled`): its job pays the pool's seconds for its decodes in place
        of its wait for them."""
        self.arbiter.made(self, memory_wait, batch, pooled)

    def may_send(self, stop: Callable[[], bool]) -> bytes | bool | None:
        """(After `made(batch=True)`) wait while a higher level wants the server (rule 1): None
        when the batch may go, a pause notice to send (then call again), or False when `stop()`
        became true (the batch is not sent). Without a level above this stream's on the server
        and another stream of its job, returns at once without the lock."""
        a = self.arbiter
        if a.top <= self.level() and self.job not in a.crowded:
            self.send_start = a.clock()
            return None
        return a.may_send(self, stop)

    def progress(self, stuck: bool = False) -> None:
        """Its send moved (the transport calls it per member or message; no lock), or, `stuck`, its
        connection is full: the send waits for its client, so the streams it holds back that may
        go without a slot look again (lower ones with a batch made, `HELD`, and its job's later
        ones), and the one that goes next (`Arbiter._settle`): they go `RETURN_S` on if it still
        waits (nothing else would wake them: `sends`)."""
        a = self.arbiter
        self.since = a.clock()
        if stuck:
            with a.lock:
                wake_held(a.turns.values(), self.job)
                a._settle(a.clock())

    def progress_hook(self) -> Callable[..., None] | None:
        """`progress`, for the transport, when a lower level or another stream of its job is on
        the server (else None: nothing to hold back, no call per member)."""
        a = self.arbiter
        return self.progress if a.bottom < self.level() or self.job in a.crowded else None

    def memory_notice(self) -> bytes | None:
        """(Waiting for memory) the pause notice to send, if due."""
        return self.arbiter.memory_notice(self)

    def sent(self) -> None:
        self.arbiter.sent(self)

    def wake(self) -> None:
        """Look at the stop condition now (the call ended: `grpc.ServicerContext.add_callback`)."""
        with self.arbiter.lock:
            self.cv.notify()

    # -- read without the arbiter's lock (the decode pool's order: `pool.DecodePool`) ---------------
    def level(self) -> int:
        """Its level now: its priority, or its share group's highest (`Arbiter.group_levels`)."""
        return self.priority if self.group is None else self.arbiter.group_levels.get(self.group, self.priority)

    def making(self) -> bool:
        """Whether it holds a batch slot (granted, its batch not made yet)."""
        return self.state is MAKING

    def wanting(self) -> bool:
        """Whether it wants the server now (`Arbiter.wants`: waiting, making, sending, or just sent)."""
        a = self.arbiter
        return a.wants(self, a.clock())

    def leave(self) -> None:
        self.arbiter.leave(self)

    def notice(self, now: float, mine: int) -> bytes | None:
        """(Paused; the arbiter's lock held) the pause notice to send, if due; `mine`: its level."""
        if not self.notices or (self.noticed and now - self.noticed < NOTICE_S):
            return None
        self.noticed, by = now, self.paused_by
        why = (f"priority {by} work on this server (this stream: priority {mine})" if by != mine else
               f"its job's earlier batches on this server (priority {mine})")
        return pb.BatchChunk(pause=pb.StreamPause(reason=why, by_priority=by,
                                                  paused_s=now - self.paused_since)).SerializeToString()


def wake_held(turns: Iterable[Turn], job: tuple | None = None) -> None:
    """(The arbiter's lock held) a hold just came to end at a known time that no change will mark
    (a send waits for its client; a job's last stream left: `HANDOVER_S`): the streams that may
    then go without a slot look again, those with a batch made (`HELD`) and `job`'s waiting ones
    (its later streams)."""
    for o in turns:
        if o.state is HELD or (o.state is WAITING and o.job == job):
            o.cv.notify()


def sends(o: Turn, now: float) -> tuple[bool, float | None]:
    """Whether `o` wants the server for its send (neither waiting, making nor held), and until when
    (None: until it changes state): its send goes on and its connection takes bytes (`Turn.full`:
    a send that is slow for the server's CPU, not held up by its client), or its bytes moved, or it
    sent its batch (or opened), less than `RETURN_S` ago. A send whose bytes did not move for
    `RETURN_S` while its connection is full (on a transport that cannot tell: in any case) waits
    for its client, and wants nothing meanwhile."""
    if o.state is HELD:
        return False, None
    if o.state is SENDING and o.full is not None and not o.full():
        return True, None
    if now - o.since < RETURN_S:
        return True, o.since + RETURN_S
    return False, None


def behind(t: Turn, turns: Iterable[Turn], level_of: Callable[[Turn], int], now: float) -> tuple[bool, float | None]:
    """Whether a stream of `t`'s job and level whose next batch comes earlier in the plan
    (`Turn.place`) wants the server (it waits, makes, or sent less than `RETURN_S` ago: it goes
    first), and until when (None: until it changes state)."""
    if not t.place:
        return False, None
    held, until, mine = False, None, level_of(t)
    for o in turns:
        if o is t or o.job != t.job or not o.place or o.place >= t.place or level_of(o) != mine:
            continue
        if o.state is WAITING or o.state is MAKING:
            return True, None
        going, end = sends(o, now)
        if going and end is None:
            return True, None
        if going:
            held, until = True, max(until or 0.0, end)
    return held, until
