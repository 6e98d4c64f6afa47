"""The loader's counters: one pass's `Progress` and the per-stage wall times of `stats()["stages"]`.

`StageTimes` sums the wall seconds spent in each stage over the threads that did it: `read`
(the batch's reads, issue to completion), `check` (CRC32s, headers), `decode` (inside DALI's turn,
the copy out of DALI included), `map` (`map`/`collate_fn`), `copy` (the consumer's owned copies
with `copy=True`; host-to-device copies are queued on a stream and not timed), `wait` (the
consumer waiting for a batch).
Reader stages overlap each other and the consumer, so the figures say where the time goes, not
how long a batch took; `per_batch` divides each by the batches handed out.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdsload.frontend.stages import StageTimes as _StageTimes

STAGES = ("read", "check", "decode", "map", "copy", "wait")


class StageTimes(_StageTimes):
    """`gdsload.frontend.stages.StageTimes` of the loader's `STAGES`."""

    def __init__(self, stages: tuple[str, ...] = STAGES):
        super().__init__(stages)


@dataclass
class Progress:
    """One pass's counters, kept by its consumer per batch; `DataLoader.stats()` reports them."""

    epoch: int
    t0: float  # when the pass started
    wait0: float  # the ring's total consumer wait then
    batches: int = 0
    samples: int = 0  # delivered (corrupt ones skipped are not)
    skipped: int = 0
    bytes_read: int = 0
    t_last: float = 0.0  # when the last batch was handed out
    stages: StageTimes | None = None
