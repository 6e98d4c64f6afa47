"""The schedule's data: a server (`Server`, with its `Pace`) and a request in flight (`Fetch`).

Plain objects, no locks and no clocks: the times they hold are the ones the schedule was given.
`Fetch.last` is the one field written outside the schedule (by the request's thread, as each
message arrives: a float store), so the stall watch sees silence without a lock per message.
"""

from __future__ import annotations

import collections
from typing import Any

from gdsload.service.client.stripe.states import CancelReason, ServerState, check


class Pace:
    """A server's time per batch, from the batches it delivered (duplicates included) over the
    last `span_s` seconds, counting every request it serves.

    Not per request, nor from single gaps: a server held to a CPU quota (a 0.1-core container
    runs 10 ms of every 100 ms) sends bursts of batches 1 ms apart and then nothing for 90 ms, and
    one serving two requests sends each half as often; read per request and per gap, servers of
    one speed looked 3-10x apart and had their blocks hedged all the time. Only deliveries set it:
    a request overtaken before its first batch says nothing of its server's pace (a cold server
    building its pipeline read as a straggler that way, and was never asked again)."""

    def __init__(self, span_s: float):
        self.span_s = span_s
        self.batch_s = 0.0  # 0: none yet
        self.arrivals: collections.deque[float] = collections.deque()

    def arrived(self, now: float) -> None:
        a = self.arrivals
        a.append(now)
        while now - a[0] > self.span_s:
            a.popleft()
        if len(a) >= 2:
            self.batch_s = (now - a[0]) / (len(a) - 1)

    def pause(self, seconds: float) -> None:
        """None of its batches were asked for during the `seconds` just past (a stream held back
        by the reorder window): that time is not its slowness."""
        self.arrivals = collections.deque([t + seconds for t in self.arrivals])


class Server:
    """One endpoint of a striped epoch: its state, backoff, pace and requests in flight.

    `endpoint`: what its address came from (`link.Endpoint`: `target`, `tls_name`, `source`)."""

    def __init__(self, endpoint: Any, pace_s: float):
        self.endpoint = endpoint
        self.address: str = endpoint.target
        self.state = ServerState.NEW
        self.fails = 0  # consecutive failures, stalls and overtakes since it last delivered a batch (backoff)
        self.next_try = 0.0  # when it may be probed again
        self.probing = False
        self.fetches: set[Fetch] = set()
        self.pace = Pace(pace_s)
        self.delivered = 0  # batches it delivered this epoch, duplicates included (0: cold)
        self.strided = False  # it serves BatchRequest.block_stride (ServerInfo.serves_block_stride)
        self.paused_at = 0.0  # when it last became PAUSED (`pause`)
        self.paused_own = False  # that pause is for its job's own earlier batches there (`pause.paused`)

    @property
    def batch_s(self) -> float:
        return self.pace.batch_s

    def move(self, to: ServerState) -> bool:
        """Change state along `states.TRANSITIONS` (else `IllegalTransition`); whether it changed."""
        old, self.state = self.state, check(self.state, to)
        return old is not to

    def serving(self) -> bool:
        """Whether it is healthy: OK, or PAUSED for its job's own earlier batches there (that
        pause is an order, not a lack of capacity: its blocks stay its own, `pause.paused`)."""
        return self.state is ServerState.OK or (self.state is ServerState.PAUSED and self.paused_own)

    def laid_out(self) -> bool:
        """Whether blocks are laid out over it (`Schedule.live`): serving, or PAUSED for another
        job's work, which ends (its blocks may be taken meanwhile, as a busy server's:
        `Schedule.pick`). Laid out afresh at each such pause and again at its end, a job's blocks
        changed hands twice: every stream of the other servers was cancelled at its block's end
        and begun again, a new loader on a server each (traced in `bench/priority_bench.py`: the
        three low jobs opened up to 10 streams, epoch starts included, in the 2 s after the high
        job left)."""
        return self.serving() or self.state is ServerState.PAUSED

    def busy(self) -> int:
        """Its requests that are not being cancelled. A cancelled stream of its own blocks (its
        block was done elsewhere) leaves its slot free to start the next one at once: its blocks
        are not stolen meanwhile (each steal, and each stream that then finds its next block
        stolen, is one more request for a server)."""
        return len([f for f in self.fetches if f.reason is None])

    def in_flight(self) -> int:
        """Steps asked of it and not received yet."""
        return sum([f.end - f.next for f in self.fetches])


class Fetch:
    """One request in flight: steps [next, end) of one block from one server; with `stride` > 1,
    after that block the blocks `block + stride`, `block + 2 * stride`, ... to the epoch's end
    (one stream for all of a server's blocks)."""

    def __init__(self, server: Server, block: int, next_step: int, end: int, now: float, stride: int = 0):
        self.server = server
        self.block = block
        self.first = next_step  # the request's first step
        self.next = next_step
        self.end = end
        self.stride = stride
        self.got = 0  # batches delivered from its current block
        self.held = False  # its current block waited for the window: not a block time
        self.started = now
        self.last = now  # when the last message arrived (the stall clock)
        self.delivered_at = now  # when its last whole batch arrived
        self.opened = False  # its call was made (the stall watch starts then)
        self.reason: CancelReason | None = None  # why it was cancelled
        self.call: Any = None  # the call running it: the worker's, never read by the schedule

    def claims(self, block: int) -> bool:
        """Whether `block` is a later block of this stream (one of its server's, still to come)."""
        return (self.stride > 0 and self.reason is None and block > self.block
                and (block - self.block) % self.stride == 0)

    def heard(self, now: float) -> None:
        """A message of it arrived (the request's thread, without the lock)."""
        self.last = now

    def __repr__(self) -> str:
        return (f"Fetch({self.server.address}, block={self.block}, steps={self.next}-{self.end - 1}, "
                f"stride={self.stride}, reason={self.reason and self.reason.value})")
