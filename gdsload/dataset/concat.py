"""`ConcatShards`: several datasets' shards read as one dataset (what a `gdsload.Mix` reads).

The view numbers shards and samples the way the plan numbers a mix: dataset 0's shards, then
dataset 1's, ...; global sample id ``offset_i + j`` is sample ``j`` of dataset ``i``. It offers the
part of `ShardedDataset` the loader reads (`shards`, `locate`, `index`, `shard_path`,
`read_extent`, `root`, `fields`), each call delegated to the dataset holding the shard, so reads
cost what they cost on that dataset (its cached indexes and file descriptors). Thread-safety is
the datasets' own (the view itself is immutable after construction).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from gdsload.format.index import ShardIndex


class ConcatShards:
    """Shards of `parts` (opened `ShardedDataset`s) one after another; `fields`: the fields read
    (each must be in every part)."""

    def __init__(self, parts: Sequence[Any], *, fields: Sequence[str]):
        self.parts = list(parts)
        self.shards: list[dict[str, Any]] = []
        self._where: list[tuple[int, int]] = []  # global shard -> (part, shard in part)
        for p, part in enumerate(self.parts):
            for s, entry in enumerate(part.shards):
                self.shards.append(entry)
                self._where.append((p, s))
        counts = [entry["samples"] for entry in self.shards]
        self._starts = [0]
        for n in counts:
            self._starts.append(self._starts[-1] + n)
        self.fields = {f: self.parts[0].fields[f] for f in fields}
        # a URL root: the fsspec backend, which also reads local paths (the loader decides with
        # `gdsload.dataset.source.storage_root`, which knows the parts' caches)
        self.root = next((p.root for p in self.parts if p.remote), self.parts[0].root)

    def __len__(self) -> int:
        return self._starts[-1]

    def __repr__(self) -> str:
        return f"ConcatShards({[p.root for p in self.parts]!r}, samples={len(self)})"

    def locate(self, i: int) -> tuple[int, int]:
        """Global sample id -> (global shard number, sample number within the shard)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a mix of {len(self)} samples")
        s = bisect.bisect_right(self._starts, i) - 1
        return s, i - self._starts[s]

    def index(self, shard: int) -> ShardIndex:
        p, s = self._where[shard]
        return self.parts[p].index(s)

    def shard_path(self, shard: int, which: str = "name") -> str:
        p, s = self._where[shard]
        return self.parts[p].shard_path(s, which)

    def load_indexes(self, shards: Any, threads: int = 4) -> list[Any]:
        """Start loading the indexes of `shards` (global numbers), each by the part holding it."""
        by_part: dict[int, list[int]] = {}
        for shard in shards:
            p, s = self._where[int(shard)]
            by_part.setdefault(p, []).append(s)
        return [f for p, local in by_part.items() for f in self.parts[p].load_indexes(local, threads)]

    def read_extent(self, shard: int, offset: int, nbytes: int) -> bytes:
        p, s = self._where[shard]
        return self.parts[p].read_extent(s, offset, nbytes)
