"""The loader's counters: one pass's `Progress`, the per-stage wall times of `stats()["stages"]`,
and the first batch's stages (`FirstBatch`, `stats()["first_batch"]`).

`StageTimes` sums the wall seconds spent in each stage over the threads that did it: `read`
(the batch's reads, issue to completion), `check` (CRC32s, headers), `decode` (inside DALI's turn,
the copy out of DALI included), `map` (`map`/`collate_fn`), `copy` (the consumer's owned copies
with `copy=True`; host-to-device copies are queued on a stream and not timed), `wait` (the
consumer waiting for a batch).
Reader stages overlap each other and the consumer, so the figures say where the time goes, not
how long a batch took; `per_batch` divides each by the batches handed out.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

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


FIRST_STAGES = ("open", "plan", "index", "setup", "pipeline_build", "first_read", "first_decode")


@dataclass
class FirstBatch:
    """Where the time from the constructor to the first batch went: `stats()["first_batch"]`.

    Each stage is wall time on the first batch's own path, so the stages add up to at most the
    total: `open` (the constructor opening the dataset: 0 for a `Dataset` opened before), `plan`
    (the constructor's plan and the first batch's sample ids), `index` (the shard indexes read and
    the first batch's reads planned over them: the batch layout at the first `iter()`, the first
    batch's `BatchPlanner.plan`), `setup` (the rest of the first `iter()`: backends, the ring, the
    pass and its threads), `pipeline_build` (building the DALI pipeline, as far as the first
    decode waited for it: the loader's own decoder builds it in a thread started at the first
    `iter()`, while the first batch is planned and read; the whole build is `pipeline_build_s`
    beside the stages), `first_read` (the first batch's reads, issue to completion), `first_decode`
    (its decode, the pipeline build excluded). `other_s` is the rest: the CRC check, handing
    over between threads, assembling the batch. A copy of the loader in another process (pickled
    or forked) counts from when its copy was made. Nothing is recorded after the first batch.
    """

    t0: float
    stages: dict = field(default_factory=lambda: dict.fromkeys(FIRST_STAGES, 0.0))
    total_s: float | None = None
    pipeline_build_s: float | None = None  # the whole build, in its thread (overlapping other stages)
    filling: bool = False  # a reader records the first batch's stages (claimed once: `claim`)
    owner: int | None = None  # the thread that claimed it
    _iter: tuple | None = field(default=None, repr=False)  # (when the first iter() began, index then)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, stage: str, seconds: float) -> None:
        if self.total_s is None:
            with self._lock:
                self.stages[stage] += seconds

    def iter_started(self) -> None:
        """The first `iter()` begins: its `setup` runs until its readers start (`readers_starting`)."""
        if self._iter is None and self.total_s is None:
            self._iter = (time.perf_counter(), self.stages["index"])

    def readers_starting(self) -> None:
        """The pass starts its readers: the first `iter()`'s setup ends (its index reads excluded)."""
        if self._iter is not None and self._iter[0] is not None:
            t, index0 = self._iter
            self._iter = (None, None)
            self.add("setup", time.perf_counter() - t - (self.stages["index"] - index0))

    def claim(self, seq: int) -> bool:
        """Whether the fill of batch `seq` records its stages: batch 0 of the first pass, once."""
        if seq != 0 or self.total_s is not None or self.filling:
            return False
        with self._lock:
            if self.filling:
                return False
            self.filling = True
            self.owner = threading.get_ident()
            return True

    def mine(self, seq: int) -> bool:
        """Whether this thread's fill of batch `seq` is the first batch's (it claimed it)."""
        return seq == 0 and self.total_s is None and self.owner == threading.get_ident()

    def done(self) -> None:
        """The first batch was handed out."""
        if self.total_s is None:
            self.total_s = time.perf_counter() - self.t0

    def report(self) -> dict | None:
        if self.total_s is None:
            return None
        with self._lock:
            stages = dict(self.stages)
        return {"total_s": self.total_s, "stages_s": stages,
                "other_s": max(0.0, self.total_s - sum(stages.values())), "pipeline_build_s": self.pipeline_build_s}
