"""Batch-at-a-time read planning: sample ids -> where every member of the batch is and goes.

The loader's hot path used to walk a batch sample by sample (a lookup, a dict, an `Extent` and
a name string per member); at 35 KB per image that Python, not the storage, set the pace. Here a
batch is planned with NumPy over the shard indexes:

- per shard, once, on the first batch that touches it (`ShardColumns`): for every field read, the
  index row of each sample's member (-1: the sample has none), and the key blob;
- per batch: global ids -> (shard, sample) with one `searchsorted`; then, for each shard the batch
  touches (a handful, the shuffle window), the offsets, sizes, CRC32s and index labels of every
  field with array indexing. `.npy` rows go to row i of their batch tensor (payload offset plus
  the probed header size; every size checked in one comparison); other members get consecutive
  64-byte-aligned places in the slot's staging buffer (an exclusive cumulative sum).

What comes out (`BatchReads`) is arrays plus one key list: the loader turns it into
`gdsload.io.table.ExtentTable`s (coalesced and read with array operations) and, once the bytes
have landed, `gdsload.dataset.verify.check_crcs` compares the staged members' CRC32s against the index in one pass.

Not planned here (`plan` returns None, and the loader reads the batch member by member, as
before): `.npy` members whose headers must be read (`verify="full"`, indexes from before C order
was guaranteed) and `.npy` payloads under 4 KiB (their header length varies).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gdsload.errors import FormatError
from gdsload.format.tar import ALIGN

STAGE_ALIGN = 64  # bytes: staged members start on cache lines (DALI and zlib read them there)


def round_up(n: np.ndarray | int, to: int = STAGE_ALIGN) -> Any:
    return -(-n // to) * to


def distinct(shards: np.ndarray) -> list[int]:
    """The shard numbers in `shards`, ascending. Not `np.unique`: NumPy 2 imports `numpy.ma` on
    its first call (~11 ms, inside a fresh loader's first batch)."""
    return np.flatnonzero(np.bincount(shards)).tolist() if len(shards) else []


class ShardColumns:
    """One shard's index arranged for batch gathers: `rows[field][j]` is the index row of sample
    j's member of `field` (-1: none); keys as one decoded string when the blob is ASCII."""

    __slots__ = ("index", "rows", "key_offsets", "key_text", "key_blob")

    def __init__(self, index: Any, fields: Sequence[str]):
        self.index = index
        n = index.num_samples
        sample_of_row = np.repeat(np.arange(n, dtype=np.int64), np.diff(index.sample_start))
        self.rows: dict[str, np.ndarray] = {}
        for f in fields:
            col = np.full(n, -1, np.int64)
            if f in index.extensions:
                rows = np.flatnonzero(index.member_ext == index.extensions.index(f))
                col[sample_of_row[rows]] = rows
            self.rows[f] = col
        self.key_offsets = index.key_offsets.tolist()
        self.key_blob = bytes(index.key_blob)
        self.key_text = self.key_blob.decode("ascii") if self.key_blob.isascii() else None

    def keys(self, js: np.ndarray) -> list[str]:
        ko = self.key_offsets
        text = self.key_text
        if text is not None:
            return [text[ko[j] : ko[j + 1]] for j in js.tolist()]
        blob = self.key_blob
        return [blob[ko[j] : ko[j + 1]].decode("utf-8") for j in js.tolist()]


class SampleNames(Sequence):
    """ "shard.tar:key" of each sample of a batch, built only when an error names one."""

    __slots__ = ("_shards", "_shard", "_keys")

    def __init__(self, shards: Sequence[dict], shard: np.ndarray, keys: list[str]):
        self._shards, self._shard, self._keys = shards, shard, keys

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return f"{self._shards[int(self._shard[i])]['name']}:{self._keys[i]}"


@dataclass(slots=True)
class BatchReads:
    """Where a batch's members are (file = global shard number) and where they go.

    `tensors[f]`: (file offset, nbytes) of each sample's `.npy` array data, in batch order (row i
    of the batch tensor). `staged[f]`: (staging offset, nbytes, sample) of the members staged, read
    from `staged_file`/`staged_offset` (flat over fields, the same order as `staged_pos`).
    `labels[f]`: the index's label column, per sample (fields without one in some shard are
    staged instead and parsed by the loader). `crc`: (staging offset, nbytes, expected CRC32,
    sample) of the staged members to check."""

    n: int
    shard: np.ndarray
    keys: list[str]
    names: SampleNames
    tensors: dict[str, tuple[np.ndarray, np.ndarray]]
    staged: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    labels: dict[str, np.ndarray]
    staged_file: np.ndarray
    staged_offset: np.ndarray
    staged_pos: np.ndarray
    staged_nbytes: np.ndarray
    crc: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]] | None


class BatchPlanner:
    """Plans batches of one dataset (`ShardedDataset` or a Mix's `ConcatShards`) for the loader's
    fields. `fields`: (name, kind, TensorField or None) in batch order; `crc_shards[s]`: whether
    shard s's staged members are CRC-checked. Thread-safe (shard columns are built once)."""

    def __init__(self, ds: Any, fields: Sequence[tuple[str, str, Any]], *, crc_shards: Sequence[bool]):
        self.ds = ds
        self.fields = list(fields)
        self.paths = tuple(ds.shard_path(s) for s in range(len(ds.shards)))
        self.starts = np.concatenate(([0], np.cumsum([s["samples"] for s in ds.shards]))).astype(np.int64)
        self.crc_shards = np.asarray(crc_shards, bool)
        self._names = [name for name, _, _ in self.fields]
        self._cols: dict[int, ShardColumns] = {}
        self._lock = threading.Lock()

    def columns(self, s: int) -> ShardColumns:
        cols = self._cols.get(s)
        if cols is None:
            cols = ShardColumns(self.ds.index(s), self._names)  # outside the lock: a race builds twice
            with self._lock:
                cols = self._cols.setdefault(s, cols)
        return cols

    def plan(self, ids: np.ndarray, *, packed: bool = False) -> BatchReads | None:
        """The reads of batch `ids`. Staged members start on STAGE_ALIGN-byte boundaries, or with
        `packed` back to back (so `check_crcs` checks them in one call)."""
        ids = np.asarray(ids, np.int64)
        B = len(ids)
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        local = ids - self.starts[shard]
        nf = len(self.fields)
        off = np.zeros((nf, B), np.int64)
        size = np.zeros((nf, B), np.int64)
        crc = np.zeros((nf, B), np.int64)
        has_crc = np.zeros(B, bool)
        labels = {name: np.zeros(B, np.int64) for name, kind, _ in self.fields if kind == "label"}
        from_index = {name: np.ones(B, bool) for name in labels}
        keys: list[Any] = [None] * B
        for s in distinct(shard):
            sel = np.flatnonzero(shard == s)
            js = local[sel]
            cols = self.columns(s)
            idx = cols.index
            for i, k in zip(sel.tolist(), cols.keys(js)):
                keys[i] = k
            for fi, (name, kind, _) in enumerate(self.fields):
                rows = cols.rows[name][js]
                if rows.min() < 0:
                    bad = int(js[int(np.argmax(rows < 0))])
                    raise FormatError(f"sample {idx.key(bad)!r} in {self.ds.shards[s]['name']} has no field {name!r}")
                if kind == "label" and name in idx.labels:
                    labels[name][sel] = idx.labels[name][js]
                    continue
                if kind == "label":
                    from_index[name][sel] = False
                off[fi, sel] = idx.member_offset[rows]
                size[fi, sel] = idx.member_size[rows]
                if idx.member_crc is not None and self.crc_shards[s]:
                    crc[fi, sel] = idx.member_crc[rows]
                    has_crc[sel] = True
        names = SampleNames(self.ds.shards, shard, keys)
        tensors: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        staged_rows: list[tuple[int, np.ndarray]] = []  # (field number, samples staged)
        for fi, (name, kind, tensor) in enumerate(self.fields):
            if kind == "tensor":
                n = size[fi]
                if n.min() < ALIGN:  # a small .npy: its header length varies, read it first
                    return None
                wrong = n - tensor.header_nbytes != tensor.nbytes
                if wrong.any():
                    i = int(np.argmax(wrong))
                    tensor.data_extent(names[i], int(off[fi, i]), int(n[i]))  # raises, naming it
                tensors[name] = (off[fi] + tensor.header_nbytes, np.full(B, tensor.nbytes, np.int64))
            elif kind != "label":
                staged_rows.append((fi, np.arange(B)))
            elif not from_index[name].all():
                staged_rows.append((fi, np.flatnonzero(~from_index[name])))
        # staged members, sample-major (sample i's fields together), 64-byte aligned places
        if staged_rows:
            fis = np.concatenate([np.full(len(r), fi) for fi, r in staged_rows])
            smp = np.concatenate([r for _, r in staged_rows])
            order = np.lexsort((fis, smp))
            fis, smp = fis[order], smp[order]
            nb = size[fis, smp]
            pos = np.zeros(len(nb), np.int64)
            np.cumsum((nb if packed else round_up(nb))[:-1], out=pos[1:])
            staged = {}
            for fi, rows in staged_rows:
                mask = fis == fi
                staged[self.fields[fi][0]] = (pos[mask], nb[mask], smp[mask])
            sfile, soff = shard[smp], off[fis, smp]
            check = has_crc[smp]
            crcs = None
            if check.any():
                crcs = (pos[check], nb[check], crc[fis, smp][check], smp[check],
                        [self.fields[fi][0] for fi in fis[check].tolist()])
        else:
            empty = np.zeros(0, np.int64)
            staged, sfile, soff, pos, nb, crcs = {}, empty, empty, empty, empty, None
        return BatchReads(B, shard, keys, names, tensors, staged,
                          {k: v for k, v in labels.items() if from_index[k].any()},
                          sfile, soff, pos, nb, crcs)
