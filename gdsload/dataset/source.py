"""What a loader reads: the `Source` interface of `Dataset` and `Mix`, and the caches of its parts.

A loader never asks which kind it was given. Everything it needs is here:

| member | `Dataset` | `Mix` |
| --- | --- | --- |
| `dataset_id`, `shard_sizes`, `fields` | its own | the mix's (ids hashed, shards one after another) |
| `shards` | its `ShardedDataset` | a `ConcatShards` over the parts |
| `parts`, `names` | itself, its folder name | the opened datasets, their names |
| `select(fields)` | a copy reading `fields` | the same, each field in every part |
| `sources_of(ids)` | None (no `"__source__"`) | the part name of each global id |
| `make_plan(**args)` | `Plan` | `MixPlan` |

`open_source(obj)` turns a path, a `Dataset` or a `Mix` (whose string entries become `Dataset`s)
into a `Source`. `PartCaches` gives each part at a URL its own shard cache (`gdsload.io.cache`) and
presents them as one, numbered by the source's global shards; `storage_root` is the one place
that says where a source's bytes are read from (local files, cached or not, or a URL).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gdsload.io import is_remote


@runtime_checkable
class Source(Protocol):
    dataset_id: str
    shard_sizes: tuple[int, ...]
    fields: list[str]
    shards: Any
    parts: list[Any]
    names: list[str]

    def select(self, fields: Sequence[str]) -> Source: ...

    def sources_of(self, ids: np.ndarray) -> list[str] | None: ...

    def make_plan(self, **plan_args: Any) -> Any: ...


def open_source(obj: Any) -> Source:
    """A `Source` for a path, a `Dataset` or a `Mix` (paths in a mix are opened as `Dataset`s)."""
    from gdsload.dataset.dataset import Dataset

    if isinstance(obj, (str, bytes)) or hasattr(obj, "__fspath__"):
        return Dataset(str(obj))
    opener = getattr(obj, "open", None)
    if callable(opener) and hasattr(obj, "spec_with"):  # a Mix: open its string entries
        return obj.open(Dataset)
    if isinstance(obj, Source):
        return obj
    from gdsload.errors import ConfigError

    raise ConfigError(f"a loader reads a gdsload.Dataset, a gdsload.Mix or a dataset path, got {obj!r}")


def storage_root(source: Source) -> str:
    """Where the loader's reads go, for choosing the I/O backend: a part at a URL read without a
    cache makes it the URL (the fsspec backend reads local paths too); otherwise local files (the
    parts' own folders, or their cache folders)."""
    for part in source.parts:
        if part.cache_dir is None and is_remote(part.shards.root):
            return part.shards.root
    first = source.parts[0]
    return first.cache_dir if first.cache_dir is not None else first.shards.root


class _PartBatches(Sequence[list[int]]):
    """`batches` (shard lists, global numbers) seen by the part holding shards `first` to
    `first + n - 1`: each batch's shards in it, numbered in the part, computed when indexed."""

    def __init__(self, batches: Sequence[Sequence[int]], first: int, n: int):
        self.batches, self.first, self.n = batches, first, n

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        first, n = self.first, self.n
        return [int(s) - first for s in self.batches[i] if first <= s < first + n]


class PartCaches:
    """The shard caches of a source's parts at URLs, as one cache over its global shard numbers.

    Parts without a cache (local, or `cache_dir=False`) are read in place: their shards are never
    in `acquire`'s answer. Each cache keeps its own limit, folder and read-ahead."""

    def __init__(self, source: Source, on_release: Callable[[str], None] | None = None):
        self._parts: list[tuple[int, int, Any]] = []  # (first global shard, shard count, cache)
        first = 0
        for part in source.parts:
            n = len(part.shards.shards)
            if part.cache_dir is not None:  # (io.cache imported only here: a local dataset never needs it)
                from gdsload.io.cache import ShardCache

                sh = part.shards
                self._parts.append((first, n, ShardCache(sh.root, sh.shards, part.cache_dir, part.cache_limit,
                                                         on_release=on_release, index_bytes=sh.index_copy,
                                                         manifest_bytes=sh.manifest_bytes)))
            first += n

    def __bool__(self) -> bool:
        return bool(self._parts)

    def _split(self, shards: Sequence[int]) -> list[tuple[int, Any, list[int]]]:
        out = []
        for first, n, cache in self._parts:
            local = [int(s) - first for s in shards if first <= s < first + n]
            out.append((first, cache, local))
        return out

    def check_limit(self, window: int) -> None:
        for _, _, cache in self._parts:
            cache.check_limit(window)

    def start_epoch(self, batches: Sequence[Sequence[int]],
                    on_shards: Callable[[list[int]], Any] | None = None) -> None:
        """Each part's cache gets a lazy view of `batches` (its own shards, numbered in the part):
        a cache reads a bounded window of it (`ShardCache.start_epoch`), never the whole epoch.
        `on_shards`: called with global shard numbers as they enter a cache's window."""
        for first, n, cache in self._parts:
            cb = None if on_shards is None else (lambda local, f=first: on_shards([f + s for s in local]))
            cache.start_epoch(_PartBatches(batches, first, n), cb)

    def acquire(self, seq: int, shards: Sequence[int]) -> dict[int, str]:
        """Local paths of the cached shards among `shards` (global numbers), pinned for batch `seq`."""
        out: dict[int, str] = {}
        for first, cache, local in self._split(shards):
            if local:
                out.update({first + s: path for s, path in cache.acquire(seq, local).items()})
        return out

    def release(self, seq: int) -> None:
        for _, _, cache in self._parts:
            cache.release(seq)

    def stats(self) -> dict[str, Any]:
        """One cache's stats as they are; several: the counters added up, folders listed."""
        stats = [cache.stats() for _, _, cache in self._parts]
        if len(stats) == 1:
            return stats[0]
        out: dict[str, Any] = {}
        for st in stats:
            for k, v in st.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = max(out.get(k, 0), v) if k.startswith("max_") else out.get(k, 0) + v
        out["folder"] = [st["folder"] for st in stats]
        return out

    def close(self) -> None:
        for _, _, cache in self._parts:
            cache.close()
