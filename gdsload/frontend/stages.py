"""Per-stage wall times of a loader's `stats()["stages"]`, shared by both loaders.

`StageTimes(stages)` sums the wall seconds spent in each named stage over the threads that did it
(a lock per add: a few adds per batch). `report(batches)` is the shape both `DataLoader.stats()`
and `RemoteLoader.stats()` return: `{"total_s": {stage: s}, "per_batch_s": {stage: s / batches},
"batches": batches}`. Which stages there are, and what each times, is the loader's to say
(`gdsload.loader.stats`, `gdsload.service.client.loader`).
"""

from __future__ import annotations

import threading
from typing import Any


class StageTimes:
    def __init__(self, stages: tuple[str, ...]):
        self._lock = threading.Lock()
        self._s = dict.fromkeys(stages, 0.0)

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._s[stage] += seconds

    def report(self, batches: int) -> dict[str, Any]:
        with self._lock:
            total = dict(self._s)
        return {"total_s": total, "per_batch_s": {k: v / batches for k, v in total.items()} if batches else
                {k: 0.0 for k in total}, "batches": batches}
