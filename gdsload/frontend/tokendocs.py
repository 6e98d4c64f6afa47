"""The documents a `gdsload.TokenLoader` reads: its datasets' shards numbered as one, each shard's
document table, and each document's ids (read as stored and checked, tokenized on the fly, or
streamed from a feed server), with their end-of-document token.

Documents are numbered shard-major over every part (the datasets of a `Mix` one after another).
`Documents.read` reads documents in runs (documents of a shard at most `_GAP` bytes apart are one
read; a run's CRC32s checked in one call); `fetch` keeps documents in a cache of bounded tokens for
the step-by-step path; `with_eos` lays documents end to end with their eos in one NumPy pass;
`read_end_to_end` reads documents straight into such a layout, as stored (the chunked ``concat``).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import numpy as np

from gdsload.errors import ConfigError, CorruptDataError, FormatError
from gdsload.format import tokens as tf
from gdsload.format.crc import first_mismatch
from gdsload.plan import pack as pk

__all__ = ["Documents", "Source", "StreamedEpoch", "is_served", "open_data"]

_GAP = 64 << 10  # documents of a shard at most this many bytes apart are read in one read
_TABLES_KEPT = 16  # shards' document tables kept loaded


class Documents:
    """The documents of `parts` (`Source`s, or one served dataset) with `per_part` documents per
    shard, ids of `dtypes` (one per part); `tok` tokenizes a text dataset (None: token shards);
    `eos_id` is appended to every document; `verify` checks each read against its CRC32;
    `cache_limit` bounds the tokens `fetch` keeps. Not thread-safe: the loader's lock guards it."""

    def __init__(self, parts: list[Any], dtypes: list[np.dtype], per_part: list[list[int]], *, tok: Any,
                 eos_id: int | None, verify: bool, cache_limit: int):
        self.parts, self.dtypes, self.tok, self.eos_id, self.verify = parts, dtypes, tok, eos_id, verify
        self.text = tok is not None
        self.served = parts[0] if is_served(parts[0]) else None
        self.stream: StreamedEpoch | None = None  # a served dataset: the pass's documents
        self.shards = [(p, s) for p, sizes in enumerate(per_part) for s in range(len(sizes))]
        self.entries = [e for p in parts for e in p.manifest["shards"]]
        self.docs_per_shard = [n for sizes in per_part for n in sizes]
        self.doc_start = np.concatenate([[0], np.cumsum(self.docs_per_shard)]).astype(np.int64)
        self.num_documents = int(self.doc_start[-1])
        self._tables: OrderedDict[int, tuple[tf.DocTable, np.ndarray]] = OrderedDict()
        self.cache: OrderedDict[int, np.ndarray] = OrderedDict()  # document id -> ids (eos included)
        self._cached_tokens = 0
        self.cache_limit = cache_limit

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.doc_start, ids, side="right") - 1

    def table(self, shard: int) -> tuple[tf.DocTable, np.ndarray]:
        """A (global) shard's document table and each document's byte offset in the shard."""
        got = self._tables.get(shard)
        if got is not None:
            self._tables.move_to_end(shard)
            return got
        part, local = self.shards[shard]
        src = self.parts[part]
        entry = self.entries[shard]
        where = f"{src.root}/{entry['index']}"
        data = src.read_file(entry["index"])
        index = src.index(local)
        table = tf.DocTable.from_index_bytes(data, name=where, num_chunks=index.num_samples)
        if table.num_documents != entry["documents"]:
            raise FormatError(f"{where}: {table.num_documents} documents, the manifest says {entry['documents']}")
        got = (table, table.byte_offsets(index.member_offset, self.dtypes[part].itemsize))
        self._tables[shard] = got
        while len(self._tables) > _TABLES_KEPT:
            self._tables.popitem(last=False)
        return got

    def lengths(self, ids: np.ndarray) -> np.ndarray:
        """Tokens of documents `ids`, eos included."""
        extra = 1 if self.eos_id is not None else 0
        if self.text:
            self.fetch(ids.tolist())
            return np.asarray([len(self.cache[i]) for i in ids.tolist()], np.int64)
        out = np.empty(len(ids), np.int64)
        shards = self.shard_of(ids)
        for s in np.unique(shards).tolist():
            sel = shards == s
            table, _ = self.table(s)
            out[sel] = table.ntokens[ids[sel] - self.doc_start[s]].astype(np.int64) + extra
        return out

    def fetch(self, ids: Any) -> None:
        """Put documents `ids` in the document cache (read and checked, or tokenized): int64 ids,
        eos appended, made in one NumPy pass for all the missing documents together."""
        want = {int(i) for i in ids}
        docs = self.cache
        missing = []
        for i in want:  # (not `want & docs.keys()`: that makes a set of the whole cache, every step)
            if i in docs:
                docs.move_to_end(i)
            else:
                missing.append(i)
        missing.sort()
        if missing:
            if self.served is not None:
                got = [self.stream.doc(i) for i in missing]
            else:
                got = self.tokenize(missing) if self.text else self.read(missing)
            whole, ends = self.with_eos(got)
            for i, a, b in zip(missing, [0, *ends[:-1].tolist()], ends.tolist()):
                docs[i] = whole[a:b]
            self._cached_tokens += len(whole)
        while self._cached_tokens > self.cache_limit and len(docs) > len(want):
            i, arr = next(iter(docs.items()))
            if i in want:
                docs.move_to_end(i)
                continue
            del docs[i]
            self._cached_tokens -= len(arr)

    def with_eos(self, got: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Documents' ids end to end (int64), each with its eos after it, in one copy: (the ids,
        each one's end)."""
        lens = np.fromiter(map(len, got), np.int64, len(got))
        if not got:
            return np.zeros(0, np.int64), lens
        if self.eos_id is None:
            return np.concatenate(got).astype(np.int64, copy=False), np.cumsum(lens)
        eos = np.asarray([self.eos_id], got[0].dtype)  # (an id of the vocabulary: it fits the ids' dtype)
        return np.concatenate([x for d in got for x in (d, eos)]).astype(np.int64, copy=False), np.cumsum(lens + 1)

    def tokenize(self, ids: list[int]) -> list[np.ndarray]:
        """Token ids of text documents `ids`, in one `encode_batch_fast` call (`encode_batch`'s ids
        without its character offsets, which nothing here uses; `encode_batch` where the installed
        `tokenizers` lacks it)."""
        shards = self.shard_of(np.asarray(ids, np.int64)).tolist()
        texts = [self.parts[0].sample_in_shard(s, i - int(self.doc_start[s]))[tf.TEXT_FIELD].decode("utf-8")
                 for i, s in zip(ids, shards)]
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [np.asarray(e.ids, np.int64) for e in encode(texts, add_special_tokens=False)]

    def read(self, ids: list[int]) -> list[np.ndarray]:
        """Token ids of documents `ids`, read as stored (`_runs`), one array each."""
        out: dict[int, np.ndarray] = {}
        for sel, first, count, toks in self._runs(np.asarray(ids, np.int64)):
            for i, f, n in zip(sel.tolist(), first, count):
                out[i] = toks[f:f + n]
        return [out[i] for i in ids]

    def read_end_to_end(self, ids: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Documents `ids` (distinct; `lengths`: their tokens, eos included) read as stored
        (`_runs`) and laid end to end in their stored dtype, each with its eos after it: what
        `with_eos` gives from `read` (but not widened), each document copied once straight to its place
        (in `out` when it is long enough and of that dtype: the result is then a view of it)."""
        ids, lengths = np.asarray(ids, np.int64), np.asarray(lengths, np.int64)
        dtype = np.result_type(*self.dtypes)
        ends = np.cumsum(lengths)
        total = int(ends[-1]) if len(ends) else 0
        buf = out[:total] if out is not None and out.dtype == dtype and len(out) >= total else np.empty(total, dtype)
        dst, by = ends - lengths, np.argsort(ids, kind="stable")
        for sel, first, count, toks in self._runs(ids):
            for d, f, n in zip(dst[by[np.searchsorted(ids, sel, sorter=by)]].tolist(), first, count):
                buf[d:d + n] = toks[f:f + n]
        if self.eos_id is not None and total:
            buf[ends - 1] = self.eos_id
        return buf

    def _runs(self, arr: np.ndarray) -> Any:
        """Documents `arr` read as stored, per shard in runs: documents at most `_GAP` bytes apart
        are one read, each checked against its CRC32 (a run of back-to-back documents in one call:
        `gdsload.format.crc.first_mismatch`). Yields ``(ids, first, count, tokens)`` a run:
        document ``ids[j]`` is ``tokens[first[j]:first[j] + count[j]]``."""
        shards = self.shard_of(arr)
        for s in np.unique(shards).tolist():
            part, local_shard = self.shards[s]
            src, dtype = self.parts[part], self.dtypes[part]
            table, offsets = self.table(s)
            sel_ids = arr[shards == s]
            local = sel_ids - self.doc_start[s]
            by = np.argsort(offsets[local], kind="stable")
            sel_ids, local = sel_ids[by], local[by]
            off = offsets[local]
            size = table.ntokens[local].astype(np.int64) * dtype.itemsize
            end = off + size
            # a run starts where a document begins more than _GAP bytes after the run's end so far
            cut = np.flatnonzero(off[1:] - np.maximum.accumulate(end)[:-1] > _GAP) + 1
            for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(off)]):
                lo, hi = int(off[a]), int(end[a:b].max())
                blob = src.read_extent(local_shard, lo, hi - lo) if hi > lo else b""
                rel = off[a:b] - lo
                if self.verify:
                    bad = first_mismatch(memoryview(blob), rel, size[a:b], table.crc[local[a:b]].astype(np.int64))
                    if bad is not None:
                        t = a + bad[0]
                        raise CorruptDataError(
                            f"{src.shard_path(local_shard)}: document {int(local[t])} of the shard (offset "
                            f"{int(off[t])}, {int(size[t])} bytes) fails its CRC32 check: the shard is damaged; "
                            f"re-run gdsload convert")
                toks = np.frombuffer(blob, dtype, count=(hi - lo) // dtype.itemsize)
                yield sel_ids[a:b], (rel // dtype.itemsize).tolist(), (size[a:b] // dtype.itemsize).tolist(), toks


def is_served(data: Any) -> bool:
    """A token dataset on a feed server (`gdsload.ServedTokens`): it streams documents."""
    return hasattr(data, "documents") and hasattr(data, "manifest") and hasattr(data, "batch_documents")


class StreamedEpoch:
    """A served dataset's documents of one epoch from position `base` on, as they arrive: the
    packer's lengths, the positions' document numbers (checked against the local `DocOrder`), and
    each document's ids until `forget`."""

    def __init__(self, loader: Any, order: pk.DocOrder, epoch: int, base: int):
        self._order, self._n = order, loader.num_documents
        self._extra = 1 if loader.eos_id is not None else 0
        self._it = loader.docs.served.documents(epoch=epoch, start=base, shuffle=loader.shuffle, seed=loader.seed,
                                            window=loader.window, dtype=loader.docs.dtypes[0])
        self._base = base
        self._ids: list[int] = []
        self._docs: dict[int, np.ndarray] = {}
        self._where = loader.docs.served.root

    def _grow(self, upto: int) -> None:
        upto = min(upto, self._n - 1)
        have = self._base + len(self._ids)
        if upto < have:
            return
        want = self._order.at(np.arange(have, upto + 1, dtype=np.int64)).tolist()
        for w in want:
            got = next(self._it, None)
            if got is None:
                raise CorruptDataError(f"{self._where}: the server's document stream ended at position "
                                       f"{self._base + len(self._ids)} of {self._n}")
            i, arr = got
            if i != w:
                raise CorruptDataError(f"{self._where}: the server sent document {i} at position "
                                       f"{self._base + len(self._ids)}, where this epoch's order has {w} (another "
                                       f"order or dataset on the server)")
            self._ids.append(i)
            self._docs[i] = arr

    def at(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, np.int64)
        if not len(positions):
            return np.zeros(0, np.int64)
        self._grow(int(positions.max()))
        return np.asarray(self._ids, np.int64)[positions - self._base]

    def lengths(self, positions: np.ndarray) -> np.ndarray:
        ids = self.at(positions)
        return np.asarray([len(self._docs[i]) + self._extra for i in ids.tolist()], np.int64)

    def doc(self, i: int) -> np.ndarray:
        return self._docs[i]

    def forget(self, before: int) -> None:
        cut = before - self._base
        if cut > 0:
            for i in self._ids[:cut]:
                self._docs.pop(i, None)
            del self._ids[:cut]
            self._base = before

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


def open_data(data: Any) -> Any:
    """The `ShardedDataset` under `data` (a path or URL, or a `gdsload.Dataset`), or a served
    token dataset (`gdsload.ServedTokens`) as it is."""
    from gdsload.dataset.sharded import ShardedDataset

    if is_served(data):
        return data
    if isinstance(data, (str, os.PathLike)):
        return Source(ShardedDataset(data))
    path = getattr(data, "path", None)
    if isinstance(path, str) and hasattr(data, "verify"):
        return Source(ShardedDataset(path, version=getattr(data, "version", None)))
    raise ConfigError(f"data must be a dataset path or URL, a gdsload.Dataset or a gdsload.Mix of them, "
                      f"got {type(data).__name__}")


class Source:
    """The reads a TokenLoader makes of its dataset."""

    def __init__(self, ds: Any):
        self.ds, self.root, self.manifest = ds, ds.root, ds.manifest
        from gdsload.io.store import open_store

        self._store = open_store(ds.root)

    def read_file(self, name: str) -> bytes:
        return self._store.read(name)

    def index(self, shard: int) -> Any:
        return self.ds.index(shard)

    def read_extent(self, shard: int, offset: int, nbytes: int) -> bytes:
        return self.ds.read_extent(shard, offset, nbytes)

    def sample_in_shard(self, shard: int, j: int) -> dict[str, Any]:
        return self.ds.sample_in_shard(shard, j)

    def shard_path(self, shard: int) -> str:
        return self.ds.shard_path(shard)
