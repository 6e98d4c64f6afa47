"""`StripePolicy`: every number the striping schedule decides by, in one frozen object.

The first four are `RemoteLoader` keywords (`stripe_batches`, `server_window`, `stall_timeout_s`,
`resolve_interval_s`); the rest are the schedule's tuning, measured on servers held to a CPU quota
(docs/feed/striping.md), and the polling periods of the receiving threads. Nothing in
`gdsload.service.client.stripe` decides by a number that is not here.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

from gdsload.errors import ConfigError


@dataclass(frozen=True)
class StripePolicy:
    """How a striping `RemoteLoader` spreads its blocks over servers.

    `stripe_batches`: consecutive steps per block; `server_window`: requests in flight per server;
    `stall_timeout_s`: a request silent this long is cancelled and its server probed (a unary call
    bounded by it too); `resolve_interval_s`: `dns:///` names are resolved again this often.
    """

    stripe_batches: int = 4
    server_window: int = 2
    stall_timeout_s: float = 5.0
    resolve_interval_s: float = 5.0
    #: The span a server's pace is measured over (`model.Pace`): many periods of a CPU quota, and
    #: short enough to see a straggler within a second or two.
    pace_s: float = 2.0
    #: A request at the head of the plan silent this long (and over `hedge_after_blocks` block
    #: times old) is hedged: longer than a CPU quota's pause (a 0.1-core container stands still
    #: 90 ms of every 100 ms), far shorter than `stall_timeout_s`.
    silent_s: float = 0.25
    #: The head block in flight this many typical block times is asked of an idle server too.
    hedge_after_blocks: float = 2.0
    #: A server whose batches come this many times slower than the median server's has one
    #: request in flight instead of `server_window` (it finishes one block at a time).
    slow_ratio: float = 2.5
    #: Paces closer than this ratio are noise (decoding servers' rates jitter), not a straggler.
    straggler_ratio: float = 3.0
    #: The idle server hedges a straggler's head block when it would deliver the rest in under
    #: this share of the time the straggler still needs.
    hedge_share: float = 0.5
    #: Weight of a new block's time in the typical block time (an EWMA).
    block_weight: float = 0.2
    #: A stream held beyond the window this long, its server's slots all taken, is cancelled when a
    #: block before it is fetched by nobody (its server failed).
    hold_s: float = 0.1
    #: At an epoch's start a server's slots wait this long at most for the other servers' first
    #: probes, so that each block goes to its owner: started as soon as one server answered, that
    #: one took the first two blocks (the others were not live yet) and made the stripe's first
    #: eight batches at one server's pace, half of each block's time spent on the other's.
    first_probes_s: float = 0.5
    #: Longest and shortest wait of a request slot with nothing to do (a server backing off waits
    #: until its next try, within these).
    idle_wait_s: float = 0.25
    min_wait_s: float = 0.01
    #: The hand-out thread's period: waiting for the head batch, for room in the queue, and
    #: between stall watches while batches flow.
    poll_s: float = 0.1

    def __post_init__(self) -> None:
        counts = (self.stripe_batches, self.server_window)
        if not all(_number(n) and 1 <= n < float("inf") for n in counts):
            raise ConfigError(f"stripe_batches and server_window must be >= 1, got {self.stripe_batches} "
                              f"and {self.server_window}")
        object.__setattr__(self, "stripe_batches", int(self.stripe_batches))
        object.__setattr__(self, "server_window", int(self.server_window))
        for f in fields(self)[2:]:
            value = getattr(self, f.name)
            if not (_number(value) and value > 0):
                raise ConfigError(f"{f.name} must be > 0 seconds, got {value!r}" if f.name.endswith("_s")
                                  else f"{f.name} must be > 0, got {value!r}")
            object.__setattr__(self, f.name, float(value))


def _number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
