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

`BatchPlanner.spans` is the same planning for a batch of stored members and index labels only,
reading and checking nothing: where each member lies and its expected CRC32, for the feed server
to send from the page cache (`gdsload.service.server.stored`).

Every batch is planned here, also those whose `.npy` headers must be read (`verify="full"`,
indexes from before conversion guaranteed C order: `needs_headers`): those headers are staged like
any member (4 KiB each) and listed in a `TensorChecks`, with, under `verify="full"`, each
member's CRC32 (its staged header, then its row of the batch tensor once read). `.npy` payloads
under 4 KiB have headers of other lengths: theirs are read (`read_extent`, outside the caller's
lock) and parsed while planning, to find where their array data starts.
"""

from __future__ import annotations

import contextlib
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


def needs_headers(ds: Any, s: int, mode: Any) -> bool:
    """Whether the `.npy` headers of shard `s` are read and checked: under `verify="full"`, or when
    neither its manifest entry nor its index vouches for C order (converted before it was
    recorded). Loads the shard's index only when the manifest does not say."""
    return mode == "full" or not (ds.shards[s].get("npy_c_order") or ds.index(s).npy_c_order)


@dataclass(slots=True)
class TensorChecks:
    """What is checked of one `.npy` field's members of a batch past their sizes
    (`gdsload.dataset.verify.check_crcs`).

    `heads`: (staging offset, nbytes, sample) of the headers staged, each parsed against `tensor`
    (dtype, shape, C order). `crcs` (`verify="full"`): (sample, expected CRC32, head) per member,
    `head` the member's staged header as (staging offset, nbytes), its row of the batch tensor
    following it; or, for a payload under 4 KiB, its bytes (all of the member, read while planning)."""

    name: str
    tensor: Any  # gdsload.decode.raw.TensorField
    heads: tuple[np.ndarray, np.ndarray, np.ndarray]
    crcs: list[tuple[int, int, Any]]


@dataclass(slots=True)
class BatchReads:
    """Where a batch's members are (file = global shard number) and where they go.

    `tensors[f]`: (file offset, nbytes) of each sample's `.npy` array data, in batch order (row i
    of the batch tensor). `staged[f]`: (staging offset, nbytes, sample) of the members staged, read
    from `staged_file`/`staged_offset` (flat over fields, the same order as `staged_pos`); for a
    `.npy` field, its headers to check. `labels[f]`: the index's label column, per sample (fields
    without one in some shard are staged instead and parsed by the loader). `crc`: (staging
    offset, nbytes, expected CRC32, sample, field) of the staged members to check. `tensor_checks`:
    the `.npy` fields whose headers (and, under `verify="full"`, CRC32s) are checked."""

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
    tensor_checks: list[TensorChecks]


@dataclass(slots=True)
class BatchSpans:
    """Where a batch's members are, for sending them as stored (`BatchPlanner.spans`): per sample,
    its key and global shard; `members[f]`: (file offset, nbytes, expected CRC32 or None) of each
    sample's member of bytes field `f`, in batch order; `labels[f]`: the index's label column."""

    keys: list[str]
    shard: np.ndarray
    members: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]
    labels: dict[str, np.ndarray]


class BatchPlanner:
    """Plans batches of one dataset (`ShardedDataset` or a Mix's `ConcatShards`) for the loader's
    fields. `fields`: (name, kind, TensorField or None) in batch order; `shard_verify[s]`: the
    `verify` mode of shard s's dataset (None: staged members are not CRC-checked; "full": `.npy`
    members are too). Thread-safe (shard columns are built once)."""

    def __init__(self, ds: Any, fields: Sequence[tuple[str, str, Any]], *, shard_verify: Sequence[Any]):
        self.ds = ds
        self.fields = list(fields)
        self.paths = tuple(ds.shard_path(s) for s in range(len(ds.shards)))
        self.starts = np.concatenate(([0], np.cumsum([s["samples"] for s in ds.shards]))).astype(np.int64)
        self.shard_verify = list(shard_verify)
        self.crc_shards = np.array([mode is not None for mode in self.shard_verify], bool)
        self._tensors = any(kind == "tensor" for _, kind, _ in self.fields)
        self._names = [name for name, _, _ in self.fields]
        self._cols: dict[int, ShardColumns] = {}
        self._headers: dict[int, bool] = {}
        self._lock = threading.Lock()
        self._spans_why: tuple[str | None] | None = None  # spans_unsupported(), once decided

    def columns(self, s: int) -> ShardColumns:
        cols = self._cols.get(s)
        if cols is None:
            cols = ShardColumns(self.ds.index(s), self._names)  # outside the lock: a race builds twice
            headers = self._tensors and needs_headers(self.ds, s, self.shard_verify[s])
            with self._lock:
                self._headers.setdefault(s, headers)
                cols = self._cols.setdefault(s, cols)
        return cols

    def _rows(self, s: int, cols: ShardColumns, name: str, js: np.ndarray) -> np.ndarray:
        """The index rows of field `name` of shard `s`'s samples `js`; a sample without it is a
        FormatError naming it."""
        rows = cols.rows[name][js]
        if rows.min() < 0:
            bad = int(js[int(np.argmax(rows < 0))])
            raise FormatError(f"sample {cols.index.key(bad)!r} in {self.ds.shards[s]['name']} has no field {name!r}")
        return rows

    def spans_unsupported(self) -> str | None:
        """Why `spans` cannot plan these batches (None: it can). It plans batches of members sent
        as stored (bytes fields) and index labels: every label field has its column in every
        shard's index, and the CRC32s are checked on all shards (each index has them) or none.
        Decided once per planner (its fields and shards do not change): a parked loader's next
        stream does not walk every index again."""
        if self._spans_why is None:
            self._spans_why = (self._spans_check(),)
        return self._spans_why[0]

    def _spans_check(self) -> str | None:
        checked = set()
        for s in range(len(self.ds.shards)):
            idx = self.ds.index(s)
            for name, kind, _ in self.fields:
                if kind == "label" and name not in idx.labels:
                    return f"field {name!r} has no label column in the index of {self.ds.shards[s]['name']}"
                if kind not in ("label", "bytes"):
                    return f"field {name!r} is read as {kind}"
            checked.add(bool(self.crc_shards[s]) and idx.member_crc is not None)
        if len(checked) > 1:
            return "some shards have member CRC32s to check and others not"
        return None

    def spans(self, ids: np.ndarray) -> BatchSpans:
        """The members of batch `ids` where they lie in the shards, for a loader whose
        `spans_unsupported()` is None: nothing is read, and no CRC32 is checked (the members'
        expected CRC32s come with them, for whoever reads them)."""
        ids = np.asarray(ids, np.int64)
        B = len(ids)
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        local = ids - self.starts[shard]
        members: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}
        labels: dict[str, np.ndarray] = {}
        keys: list[Any] = [None] * B
        shards = distinct(shard)
        for s in shards:
            sel = np.flatnonzero(shard == s) if len(shards) > 1 else slice(None)
            js = local[sel]
            cols = self.columns(s)
            idx = cols.index
            if len(shards) > 1:
                for i, k in zip(sel.tolist(), cols.keys(js)):
                    keys[i] = k
            else:
                keys = cols.keys(js)
            crc = idx.member_crc if self.crc_shards[s] else None
            for name, kind, _ in self.fields:
                rows = self._rows(s, cols, name, js)
                if kind == "label":
                    labels.setdefault(name, np.zeros(B, np.int64))[sel] = idx.labels[name][js]
                    continue
                m = members.get(name)
                if m is None:
                    m = members[name] = (np.zeros(B, np.int64), np.zeros(B, np.int64),
                                         None if crc is None else np.zeros(B, np.uint32))
                m[0][sel] = idx.member_offset[rows]
                m[1][sel] = idx.member_size[rows]
                if crc is not None:
                    m[2][sel] = crc[rows]
        return BatchSpans(keys, shard, members, labels)

    def plan(self, ids: np.ndarray, *, packed: bool = False, lock: Any = None) -> BatchReads:
        """The reads of batch `ids`. Staged members start on STAGE_ALIGN-byte boundaries, or with
        `packed` back to back (so `check_crcs` checks them in one call). The array work runs
        under `lock` (the caller's, for the Python-heavy part of a batch), the header reads of
        `.npy` payloads under 4 KiB after it."""
        ids = np.asarray(ids, np.int64)
        B = len(ids)
        with lock if lock is not None else contextlib.nullcontext():
            reads, small = self._plan(ids, B, packed)
        for one in small:  # outside the lock: one read per such payload
            self._small_heads(reads, one)
        return reads

    def _plan(self, ids: np.ndarray, B: int, packed: bool) -> tuple[BatchReads, list[tuple]]:
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        local = ids - self.starts[shard]
        nf = len(self.fields)
        off = np.zeros((nf, B), np.int64)
        size = np.zeros((nf, B), np.int64)
        crc = np.zeros((nf, B), np.int64)
        has_crc = np.zeros(B, bool)
        heads = np.zeros(B, bool)  # the sample's .npy headers are read and checked
        full = np.zeros(B, bool)  # and, whole, its .npy members' CRC32s
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
            if self._headers[s]:
                heads[sel] = True
                full[sel] = self.shard_verify[s] == "full" and idx.member_crc is not None
            for fi, (name, kind, _) in enumerate(self.fields):
                rows = self._rows(s, cols, name, js)
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
        small: list[tuple[int, np.ndarray]] = []  # (field number, samples whose .npy payload is under 4 KiB)
        staged_nb = size
        for fi, (name, kind, tensor) in enumerate(self.fields):
            if kind == "tensor":
                n = size[fi]
                short = n < ALIGN  # a small .npy: its header length varies, read it while planning
                wrong = ~short & (n - tensor.header_nbytes != tensor.nbytes)
                if wrong.any():
                    i = int(np.argmax(wrong))
                    tensor.data_extent(names[i], int(off[fi, i]), int(n[i]))  # raises, naming it
                tensors[name] = (off[fi] + tensor.header_nbytes, np.full(B, tensor.nbytes, np.int64))
                if short.any():
                    small.append((fi, np.flatnonzero(short)))
                head = np.flatnonzero(heads & ~short)  # aligned payloads: their 4 KiB header staged
                if len(head):
                    if staged_nb is size:
                        staged_nb = size.copy()
                    staged_nb[fi] = tensor.header_nbytes
                    staged_rows.append((fi, head))
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
            nb = staged_nb[fis, smp]
            pos = np.zeros(len(nb), np.int64)
            np.cumsum((nb if packed else round_up(nb))[:-1], out=pos[1:])
            staged = {}
            for fi, rows in staged_rows:
                mask = fis == fi
                staged[self.fields[fi][0]] = (pos[mask], nb[mask], smp[mask])
            sfile, soff = shard[smp], off[fis, smp]
            is_tensor = np.array([kind == "tensor" for _, kind, _ in self.fields], bool)
            check = has_crc[smp] & ~is_tensor[fis]  # a header's CRC is its whole member's (TensorChecks)
            crcs = None
            if check.any():
                crcs = (pos[check], nb[check], crc[fis, smp][check], smp[check],
                        [self.fields[fi][0] for fi in fis[check].tolist()])
        else:
            empty = np.zeros(0, np.int64)
            staged, sfile, soff, pos, nb, crcs = {}, empty, empty, empty, empty, None
        checks = []
        if heads.any():
            empty = np.zeros(0, np.int64)
            for fi, (name, kind, tensor) in enumerate(self.fields):
                if kind != "tensor":
                    continue
                hpos, hnb, hsmp = staged.get(name, (empty, empty, empty))
                where = dict(zip(hsmp.tolist(), zip(hpos.tolist(), hnb.tolist())))
                crcs_f = [(i, int(crc[fi, i]), where[i]) for i in np.flatnonzero(full).tolist() if i in where]
                checks.append(TensorChecks(name, tensor, (hpos, hnb, hsmp), crcs_f))
        return BatchReads(B, shard, keys, names, tensors, staged,
                          {k: v for k, v in labels.items() if from_index[k].any()},
                          sfile, soff, pos, nb, crcs, checks), \
            [(fi, rows, off[fi, rows], size[fi, rows], full[rows], crc[fi, rows]) for fi, rows in small]

    def _small_heads(self, reads: BatchReads, small: tuple) -> None:
        """`.npy` payloads under 4 KiB (`small`: field number, samples, their offsets, sizes,
        whether their CRC32s are checked, the CRC32s): each read whole, its header parsed
        (dtype, shape, C order, where its array data starts) and, under `verify="full"`, its
        bytes kept for the CRC32 check."""
        fi, rows, offs, sizes, checked, expected = small
        name, _, tensor = self.fields[fi]
        data = reads.tensors[name][0]
        checks = next((c for c in reads.tensor_checks if c.name == name), None)
        for i, o, n, c, e in zip(rows.tolist(), offs.tolist(), sizes.tolist(), checked.tolist(), expected.tolist()):
            head = self.ds.read_extent(int(reads.shard[i]), o, n)
            data[i] = tensor.data_extent(reads.names[i], o, n, head)[0]
            if c and checks is not None:
                checks.crcs.append((i, e, head))

