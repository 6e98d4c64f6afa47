"""`prefetch_factor="auto"` and `num_workers="auto"`: the loader sizes its ring and reader threads
from what the training loop does, within stated bounds.

The consumer's wait (the data stall) is measured per window of batches. When it waits more than
`STALL` (5 %) of a window, one of two things is short:

- depth: the producers were ahead and got stopped by a full ring (they waited in `acquire`), yet
  the consumer later waited: production is bursty (a slow shard, a long decode) and a deeper ring
  absorbs it. The ring grows by one slot, up to `MAX_PREFETCH` (8) batches ahead, and only while
  the new slot fits in memory with room to spare (`MEMORY_SHARE`: a slot may take at most a quarter
  of what is free).
- throughput: the producers never waited, they are just slower than the consumer. More slots
  would not help; with `num_workers="auto"` (which starts at 2) one more reader thread starts, up
  to two per core, at most 16 (`max_workers`). With a fixed `num_workers` nothing changes: the data stall is then what the
  storage and decoder can do.

A loader that keeps up (the consumer waits less than `STALL`) keeps `prefetch_factor` at its start
value (`START_PREFETCH`, 2), so "auto" costs no memory it does not need. Nothing shrinks: a ring
that grew keeps its slots for later epochs (memory is allocated once per growth step, never
returned mid-run). `stats()` reports the current `prefetch_factor`, `num_workers`, and `auto`.
"""

from __future__ import annotations

from dataclasses import dataclass

STALL = 0.05  # fraction of wall time the consumer may wait before the tuner acts
START_PREFETCH = 2
START_WORKERS = 2
MAX_PREFETCH = 8
MEMORY_SHARE = 0.25  # a new slot may take at most this share of the free memory
WINDOW = 8  # batches per measurement window
MIN_WINDOW_S = 0.05  # ... and at least this long, so that timer noise is not a stall


@dataclass
class Tuner:
    """Decides, once per window, whether to add a ring slot or a reader thread.

    `observe(now, wait_s, producer_wait_s)` takes cumulative counters (the ring's) at each batch
    the consumer gets, and returns "grow", "worker" or None.
    """

    auto_prefetch: bool
    auto_workers: bool
    prefetch: int
    workers: int
    max_workers: int
    _batches: int = 0
    _t0: float | None = None
    _wait0: float = 0.0
    _pwait0: float = 0.0

    def restart(self) -> None:
        """A new pass: its first batch (the ring filling) is start-up, not a stall."""
        self._t0, self._batches = None, 0

    def observe(self, now: float, wait_s: float, producer_wait_s: float) -> str | None:
        if self._t0 is None:  # the first batch includes start-up: measure from it
            self._t0, self._wait0, self._pwait0 = now, wait_s, producer_wait_s
            return None
        self._batches += 1
        wall = now - self._t0
        if self._batches < WINDOW or wall < MIN_WINDOW_S:
            return None
        stalled = (wait_s - self._wait0) / wall > STALL
        backpressure = producer_wait_s - self._pwait0 > STALL * wall
        self._batches, self._t0, self._wait0, self._pwait0 = 0, now, wait_s, producer_wait_s
        if not stalled:
            return None
        if backpressure and self.auto_prefetch and self.prefetch < MAX_PREFETCH:
            return "grow"
        if self.auto_workers and self.workers < self.max_workers:
            return "worker"
        return None


def max_workers() -> int:
    """The most reader threads "auto" starts: two per core (reads block in the kernel, so
    threads beyond the cores help with storage latency), at most 16."""
    import os

    return min(16, 2 * (os.cpu_count() or 1))


def fits(slot_nbytes: int, available: int | None) -> bool:
    """Whether one more slot of `slot_nbytes` may be allocated with `available` bytes free
    (None: unknown, e.g. no /proc/meminfo: grow)."""
    return available is None or slot_nbytes <= MEMORY_SHARE * available
