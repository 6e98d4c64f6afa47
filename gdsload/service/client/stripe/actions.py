"""What the striping schedule answers and hears: the actions of a request slot (`Wait`, `PROBE`,
`EXIT`, or a `model.Fetch` to run), what a batch's arrival changed (`Delivered`), and what a
request's error means (`Failure`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from gdsload.service.client.stripe.model import Fetch


class Failure(Enum):
    """What a request's error means for its server (`Schedule.on_failure`)."""

    CORRUPT = "corrupt"  # DATA_LOSS: not this block from this server
    REFUSED = "refused"  # FAILED_PRECONDITION: it cannot serve this request
    RETRY = "retry"  # a retryable status, a protocol error: down, probed after a backoff
    FATAL = "fatal"  # any other status: the epoch ends with it


@dataclass(frozen=True)
class Wait:
    """Nothing for this request slot now: wait up to `seconds` (or until woken)."""

    seconds: float


PROBE = "probe"  # ask the server whether it serves this dataset (`probe_ok` / `_refused` / `_failed`)
EXIT = "exit"  # the server is refused or gone: the slot ends


@dataclass
class Delivered:
    """What a batch's arrival changed: `head` (it is the step the hand-out waits for), `whole` (its
    block is whole: request slots may pick the next), `cancel` (copies no longer needed)."""

    head: bool = False
    whole: bool = False
    cancel: list[Fetch] = field(default_factory=list)
