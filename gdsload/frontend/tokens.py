"""`gdsload.TokenLoader`: packed rows of tokens for language-model training, resumable exactly.

Per global step (``batch_size * world_size`` rows of ``seq_len``) every rank packs the step's rows
from the documents' lengths alone (`gdsload.plan.pack.Packer` over the epoch's document order,
`DocOrder`), then reads and assembles only its rows ``rank::world_size``
(`gdsload.plan.pack.assemble`). The rows are a pure function of (data, seed, epoch, shuffle,
window, seq_len, pack, eos, the global batch), never of the world size, so a state saved on 4 ranks
resumes on 3 or 2 with the same global batch and the stream goes on as if uninterrupted.

Data: a token dataset (`gdsload convert CORPUS DST --tokenizer tokenizer.json`) is read as
stored: each document is one positioned read (adjacent documents coalesced into one), checked
against its CRC32 in the index (unless the `Dataset` was opened with ``verify=None``); lengths come
from the index, so packing reads no tokens. A text dataset (converted without ``--tokenizer``)
needs ``tokenizer=``: every rank tokenizes the documents of each global step (lengths are known
only after tokenizing; `encode_batch` per block of `BLOCK` documents), and ``len()`` is not known.

State (`gdsload.plan.pack.TokenState`): the plan's fields (``position`` counts documents of the
epoch order) plus ``step``, the packing's carry-over (``offset`` of a document cut by ``concat``,
``carry``: pieces ``best_fit`` took but has not placed) and what the rows depend on; a state from
other data, ``seq_len``, packing, eos, tokenizer, seed, shuffle, window, drop_last or global batch is
refused naming the field. `load_state_dict` may come before or after ``iter()``: a live pass goes
on from the loaded state at its next ``next()``.

Epochs: ``iter()`` runs the rest of the cursor's epoch; the pass that hands out the epoch's last
batch moves the cursor to the next epoch (as `gdsload.DataLoader` does). The last global step is
padded (rows, or parts of rows, of `pad_id` with label -100 and attention 0), or dropped with
``drop_last`` unless every row of it is full.

``len()`` (steps of an epoch, as for every rank): exact for ``concat`` (from the manifest's token
counts), an upper bound for ``best_fit`` (`gdsload.plan.pack.best_fit_steps_bound`: documents plus
tokens / seq_len pieces, at least one a row per step; real epochs are far shorter), not known
for text tokenized on the fly (`TypeError`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from gdsload.errors import ConfigError, CorruptDataError, FormatError
from gdsload.format import tokens as tf
from gdsload.format.crc import crc32
from gdsload.format.manifest import dataset_id
from gdsload.frontend.output import as_output, default_output
from gdsload.host.dist import dist_rank_world
from gdsload.plan import pack as pk
from gdsload.plan.plan import STATE_VERSION

ORDER = 2  # the plan's order version the document order uses
_GAP = 64 << 10  # documents of a shard at most this many bytes apart are read in one read
_TABLES_KEPT = 16  # shards' document tables kept loaded


class TokenLoader:
    """Packed token rows (module docstring). Batches are dicts of `input_ids`, `labels`,
    `position_ids`, `attention_mask` ([batch_size, seq_len]) and `cu_seqlens` (int32, 1-D),
    NumPy arrays or torch tensors (`output`) on `device`.

    `data`: a dataset path or URL, or a `gdsload.Dataset`. `eos_token` (a token string, or an id)
    is appended to every document. `pad_id` fills padding (default: the eos id, else 0).
    `window`: the shuffle's window of shards (the plan's). `rank`/`world_size` default to the
    initialised `torch.distributed` group, else 0 of 1.
    """

    def __init__(self, data: Any, seq_len: int, batch_size: int, *, shuffle: bool = False, seed: int = 0,
                 pack: str = "concat", tokenizer: Any = None, eos_token: Any = None, pad_id: int | None = None,
                 drop_last: bool = False, rank: int | None = None, world_size: int | None = None,
                 output: str | None = None, device: str = "cpu", window: int = 4):
        for name, v, lo in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1), ("seed", seed, 0),
                            ("window", window, 1)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise ConfigError(f"{name} must be an int >= {lo}, got {v!r}")
        if pack not in pk.PACKS:
            raise ConfigError(f"pack must be one of {', '.join(map(repr, pk.PACKS))}, got {pack!r}")
        if output not in (None, "numpy", "torch"):
            raise ConfigError(f"output must be 'numpy' or 'torch', got {output!r}")
        if rank is None and world_size is None:
            rank, world_size = dist_rank_world() or (0, 1)
        rank, world_size = int(rank or 0), int(world_size or 1)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not one of world_size {world_size}")
        self.seq_len, self.batch_size, self.shuffle, self.seed = int(seq_len), int(batch_size), bool(shuffle), int(seed)
        self.pack, self.drop_last, self.window = pack, bool(drop_last), int(window)
        self.rank, self.world_size = rank, world_size
        self.output, self.device = default_output(output), device
        self._source = _open(data)
        self.manifest = self._source.manifest
        self.meta = tf.check_meta(self.manifest, name=self._source.root)
        self._tok = tf.load_tokenizer(tokenizer) if tokenizer is not None else None
        tok_sha = tf.tokenizer_info(self._tok)["tokenizer_sha256"] if self._tok is not None else None
        if self.meta is not None:
            if tok_sha is not None and tok_sha != self.meta["tokenizer_sha256"]:
                raise ConfigError(f"{self._source.root} was tokenized with another tokenizer (SHA-256 "
                                  f"{self.meta['tokenizer_sha256'][:12]}..., this one {tok_sha[:12]}...); pass "
                                  f"its tokenizer, or none (pre-tokenized data needs none)")
            tok_sha = self.meta["tokenizer_sha256"]
            self._docs_per_shard = [int(s["documents"]) for s in self.manifest["shards"]]
            self._dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
            vocab = self.meta["vocab_size"]
        else:
            if tf.TEXT_FIELD not in self.manifest["fields"]:
                raise FormatError(f"{self._source.root} is neither a token dataset nor a text dataset (fields "
                                  f"{', '.join(self.manifest['fields'])}); convert the corpus with gdsload convert")
            if self._tok is None:
                raise ConfigError(f"{self._source.root} holds text (converted without --tokenizer): pass "
                                  f"tokenizer= (a tokenizer.json) to tokenize it on the fly")
            self._docs_per_shard = [int(s["samples"]) for s in self.manifest["shards"]]
            vocab = self._tok.get_vocab_size(with_added_tokens=True)
        special = self.meta["special_tokens"] if self.meta is not None else None
        self.eos_id = tf.resolve_token(eos_token, tok=self._tok, special=special, vocab_size=vocab)
        self.pad_id = int(pad_id) if pad_id is not None else (self.eos_id if self.eos_id is not None else 0)
        self.tokenizer_sha256 = tok_sha
        self._doc_start = np.concatenate([[0], np.cumsum(self._docs_per_shard)]).astype(np.int64)
        self.num_documents = int(self._doc_start[-1])
        self._id = dataset_id(self.manifest["shards"])
        self._verify = getattr(data, "verify", "fast") is not None
        self._tables: OrderedDict[int, tuple[tf.DocTable, np.ndarray]] = OrderedDict()
        self._docs: OrderedDict[int, np.ndarray] = OrderedDict()  # document id -> ids (eos included)
        self._docs_tokens = 0
        self._docs_limit = max(1 << 22, 8 * self.global_batch * self.seq_len)
        self._packers: dict[int, tuple[pk.DocOrder, pk.Packer]] = {}
        self._epoch, self._step, self._state = 0, 0, pk.start_state()
        self._loads = 0  # bumped by load_state_dict / set_epoch: a live pass adopts the new cursor

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def num_tokens(self) -> int:
        """Tokens of an epoch, end-of-document tokens included (a token dataset only)."""
        if self.meta is None:
            raise TypeError("a text dataset tokenized on the fly has no known token count")
        return self.meta["num_tokens"] + (self.num_documents if self.eos_id is not None else 0)

    def __len__(self) -> int:
        if self.meta is None:
            raise TypeError("len() of a TokenLoader over text tokenized on the fly is not known (its token "
                            "count is known only once tokenized): convert the corpus with --tokenizer")
        if self.pack == "concat":
            return pk.concat_steps(self.num_tokens, seq_len=self.seq_len, rows=self.global_batch,
                                   drop_last=self.drop_last)
        return pk.best_fit_steps_bound(self.num_documents, self.num_tokens, seq_len=self.seq_len,
                                       rows=self.global_batch)

    # -- state ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        if not isinstance(epoch, (int, np.integer)) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError(f"epoch must be an int >= 0, got {epoch!r}")
        if int(epoch) != self._epoch:
            self._epoch, self._step, self._state = int(epoch), 0, pk.start_state()
            self._loads += 1

    def _identity(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "kind": "tokens", "tokens_version": pk.TOKENS_STATE, "order": ORDER,
                "dataset": self._id, "seed": self.seed, "shuffle": self.shuffle, "window": self.window,
                "drop_last": self.drop_last, "global_batch": self.global_batch, "num_samples": self.num_documents,
                "seq_len": self.seq_len, "pack": self.pack, "eos": self.eos_id, "tokenizer": self.tokenizer_sha256}

    def state_dict(self) -> pk.TokenState:
        """Where the next batch comes from (JSON-serialisable; `gdsload.plan.pack.TokenState`)."""
        st = self._state
        return pk.TokenState(**self._identity(), epoch=self._epoch, step=self._step,  # type: ignore[typeddict-item]
                             position=int(st["position"]), offset=int(st["offset"]),
                             carry=[[int(v) for v in p] for p in st["carry"]])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._epoch, self._step, self._state = pk.check_state(state, self._identity())
        self._loads += 1

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._pass()

    def _packer(self, epoch: int) -> pk.Packer:
        got = self._packers.get(epoch)
        if got is None:
            order = pk.DocOrder(self._docs_per_shard, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                                window=self.window)
            got = (order, pk.Packer(seq_len=self.seq_len, rows=self.global_batch, pack=self.pack,
                                    num_documents=self.num_documents,
                                    lengths=lambda positions: self._lengths(order.at(positions))))
            self._packers = {epoch: got}  # one epoch at a time
        return got[1]

    def rows(self, epoch: int, state: pk.PackState) -> tuple[list[list[pk.Piece]], pk.PackState]:
        """The global step's rows from `state` (pieces name document ids) and the state after."""
        packer = self._packer(epoch)
        order = self._packers[epoch][0]
        rows, nxt = packer.step(state)
        ids = {}
        flat = [p for row in rows for p in row]
        if flat:
            got = order.at(np.asarray([p[0] for p in flat], np.int64)).tolist()
            ids = dict(zip((p[0] for p in flat), got))
        return [[(ids[p[0]], p[1], p[2]) for p in row] for row in rows], nxt

    def _pass(self) -> Iterator[dict[str, Any]]:
        epoch, loads = self._epoch, self._loads
        while True:
            if self._loads != loads:
                epoch, loads = self._epoch, self._loads
            if self._epoch != epoch:
                return  # this pass's epoch is done (the cursor is at the next one)
            rows, nxt = self.rows(epoch, self._state)
            pieces = sum(len(r) for r in rows)
            last = pk.exhausted(nxt, self.num_documents)
            full = all(sum(p[2] for p in r) == self.seq_len for r in rows)
            if not pieces or (last and self.drop_last and not full):
                self._epoch, self._step, self._state = epoch + 1, 0, pk.start_state()
                return
            batch = self._batch(rows[self.rank::self.world_size])
            if last:
                self._epoch, self._step, self._state = epoch + 1, 0, pk.start_state()
            else:
                self._step, self._state = self._step + 1, nxt
            yield batch

    def _batch(self, rows: list[list[pk.Piece]]) -> dict[str, Any]:
        self._fetch({p[0] for row in rows for p in row})
        arrays = pk.assemble(rows, self.seq_len, lambda p: self._docs[p[0]][p[1]:p[1] + p[2]], self.pad_id)
        return {k: as_output(v, self.output, self.device) for k, v in arrays.items()}

    # -- documents -----------------------------------------------------------------------------
    def _shard_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._doc_start, ids, side="right") - 1

    def _table(self, shard: int) -> tuple[tf.DocTable, np.ndarray]:
        """A shard's document table and each document's byte offset in the shard."""
        got = self._tables.get(shard)
        if got is not None:
            self._tables.move_to_end(shard)
            return got
        src = self._source
        entry = self.manifest["shards"][shard]
        where = f"{src.root}/{entry['index']}"
        data = src.read_file(entry["index"])
        index = src.index(shard)
        table = tf.DocTable.from_index_bytes(data, name=where, num_chunks=index.num_samples)
        if table.num_documents != entry["documents"]:
            raise FormatError(f"{where}: {table.num_documents} documents, the manifest says {entry['documents']}")
        got = (table, table.byte_offsets(index.member_offset, self._dtype.itemsize))
        self._tables[shard] = got
        while len(self._tables) > _TABLES_KEPT:
            self._tables.popitem(last=False)
        return got

    def _lengths(self, ids: np.ndarray) -> np.ndarray:
        """Tokens of documents `ids`, eos included."""
        extra = 1 if self.eos_id is not None else 0
        if self.meta is None:
            self._fetch(ids.tolist())
            return np.asarray([len(self._docs[i]) for i in ids.tolist()], np.int64)
        out = np.empty(len(ids), np.int64)
        shards = self._shard_of(ids)
        for s in np.unique(shards).tolist():
            sel = shards == s
            table, _ = self._table(s)
            out[sel] = table.ntokens[ids[sel] - self._doc_start[s]].astype(np.int64) + extra
        return out

    def _fetch(self, ids: Any) -> None:
        """Put documents `ids` in the document cache (read and checked, or tokenized)."""
        missing = sorted({int(i) for i in ids} - self._docs.keys())
        for i in ids:
            if int(i) in self._docs:
                self._docs.move_to_end(int(i))
        if missing:
            got = self._tokenize(missing) if self.meta is None else self._read(missing)
            eos = [] if self.eos_id is None else [self.eos_id]
            for i, arr in zip(missing, got):
                arr = np.concatenate([arr.astype(np.int64), np.asarray(eos, np.int64)])
                self._docs[i] = arr
                self._docs_tokens += len(arr)
        keep = set(int(i) for i in ids)
        while self._docs_tokens > self._docs_limit and len(self._docs) > len(keep):
            i, arr = next(iter(self._docs.items()))
            if i in keep:
                self._docs.move_to_end(i)
                continue
            del self._docs[i]
            self._docs_tokens -= len(arr)

    def _tokenize(self, ids: list[int]) -> list[np.ndarray]:
        texts = []
        for i in ids:
            s = int(self._shard_of(np.asarray([i]))[0])
            texts.append(self._source.sample_in_shard(s, i - int(self._doc_start[s]))[tf.TEXT_FIELD].decode("utf-8"))
        return [np.asarray(e.ids, np.int64) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def _read(self, ids: list[int]) -> list[np.ndarray]:
        """Token ids of documents `ids` (sorted), read as stored: per shard, documents in runs
        at most `_GAP` bytes apart are one read; each checked against its CRC32."""
        out: dict[int, np.ndarray] = {}
        arr = np.asarray(ids, np.int64)
        shards = self._shard_of(arr)
        item = self._dtype.itemsize
        for s in np.unique(shards).tolist():
            table, offsets = self._table(s)
            sel_ids = arr[shards == s]
            local = sel_ids - self._doc_start[s]
            off = offsets[local]
            size = table.ntokens[local].astype(np.int64) * item
            by = np.argsort(off, kind="stable")
            k = 0
            while k < len(by):
                j = k
                end = off[by[k]] + size[by[k]]
                while j + 1 < len(by) and off[by[j + 1]] - end <= _GAP:
                    j += 1
                    end = max(end, off[by[j]] + size[by[j]])
                lo = int(off[by[k]])
                blob = self._source.read_extent(s, lo, int(end) - lo) if end > lo else b""
                for t in by[k:j + 1].tolist():
                    d = int(local[t])
                    raw = memoryview(blob)[int(off[t]) - lo:int(off[t]) - lo + int(size[t])]
                    if self._verify and crc32(raw) != int(table.crc[d]):
                        raise CorruptDataError(
                            f"{self._source.shard_path(s)}: document {d} of the shard (offset {int(off[t])}, "
                            f"{int(size[t])} bytes) fails its CRC32 check: the shard is damaged; re-run gdsload convert")
                    out[int(sel_ids[t])] = np.frombuffer(raw, self._dtype)
                k = j + 1
        return [out[i] for i in ids]


def _open(data: Any) -> Any:
    """The `ShardedDataset` under `data` (a path or URL, or a `gdsload.Dataset`)."""
    from gdsload.dataset.sharded import ShardedDataset

    if isinstance(data, (str, os.PathLike)):
        return _Source(ShardedDataset(data))
    if type(data).__name__ == "Mix":
        raise ConfigError("a Mix of token datasets is not supported by TokenLoader yet (mixing by tokens is "
                          "its own step); pass one dataset")
    path = getattr(data, "path", None)
    if isinstance(path, str) and hasattr(data, "verify"):
        return _Source(ShardedDataset(path, version=getattr(data, "version", None)))
    raise ConfigError(f"data must be a dataset path or URL or a gdsload.Dataset, got {type(data).__name__}")


class _Source:
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
