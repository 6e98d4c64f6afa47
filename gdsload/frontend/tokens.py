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
only after tokenizing; `encode_batch_fast` per block of `BLOCK` documents), and ``len()`` is not known.
With ``device="cuda"`` and KvikIO, a token dataset on local disk takes the GPU path
(`gdsload.frontend.tokens_gpu`: each step's pieces read into a device ring, the batch assembled
there; its CRC32s are not checked, as for `.npy` rows read into GPU memory; ``verify="full"`` keeps
the host path).

State (`gdsload.plan.pack.TokenState`): the plan's fields (``position`` counts documents of the
epoch order) plus ``step``, the packing's carry-over (``offset`` of a document cut by ``concat``,
``carry``: pieces ``best_fit`` took but has not placed) and what the rows depend on; a state from
other data, ``seq_len``, packing, eos, tokenizer, seed, shuffle, window, drop_last or global batch is
refused naming the field. A mix adds ``mix`` (what it mixes, compared field by field) and
``mix_cursor`` (where its document stream stands: `gdsload.plan.tokenmix.MixCursor`), so a resume
replays nothing.

A pass (one ``iter()``) follows `gdsload.frontend.cursor`'s rules, as `gdsload.DataLoader`'s:
`load_state_dict` and a `set_epoch` that changes the epoch stop the live pass (its prefetch thread
ends before the call returns; its next ``next()`` raises `PassStopped`) and the next ``iter()``
starts from the loaded state (Lightning loads a checkpoint after calling ``iter()``); a new
``iter()`` closes the live pass (it ends with StopIteration) and continues from the state;
`state_dict()` always says what the next ``iter()`` does. ``prefetch`` global steps are packed,
read and assembled ahead on a thread while the training step runs; only handing a batch out moves
the state, so it is exact whatever was made ahead.

Data may also be a `gdsload.Mix` of token datasets, mixed by tokens (`gdsload.plan.tokenmix`:
weights and a schedule in tokens consumed; its epoch is the datasets' tokens together, so
``len()`` is not known), or a token dataset on a feed server (`gdsload.ServedTokens`: its
documents are streamed in the epoch's order and packed here, `gdsload.service.client.tokens`).

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

import queue
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from gdsload.errors import ConfigError, FormatError, PassStopped, StateError
from gdsload.format import tokens as tf
from gdsload.format.manifest import dataset_id
from gdsload.frontend.cursor import Cursor
from gdsload.frontend.output import as_output, default_output
from gdsload.frontend.tokendocs import Documents, StreamedEpoch, is_served, open_data
from gdsload.host.dist import dist_rank_world
from gdsload.plan import pack as pk
from gdsload.plan.plan import STATE_VERSION
from gdsload.plan.tokenmix import MixCursor, MixedEpoch, TokenMix

ORDER = 2  # the plan's order version the document order uses
# text tokenized on the fly: documents tokenized at once, from BLOCK up (each block twice the last):
# one encode_batch_fast call of many documents keeps the tokenizer's threads busy (a block's longest
# document is its tail), and the first batch waits for BLOCK only
_TEXT_BLOCK = 4096
_AHEAD = 1 << 20  # concat over local token shards: global tokens packed and read at a time (0: by step)


class TokenLoader:
    """Packed token rows (module docstring). Batches are dicts of `input_ids`, `labels`,
    `position_ids`, `attention_mask` ([batch_size, seq_len]) and `cu_seqlens` (int32, 1-D),
    NumPy arrays or torch tensors (`output`) on `device`.

    `data`: a dataset path or URL, a `gdsload.Dataset`, or a `gdsload.Mix` of token datasets
    (mixed by tokens: `gdsload.plan.tokenmix`). `eos_token` (a token string, or an id) is appended
    to every document. `pad_id` fills padding (default: the eos id, else 0). `window`: the
    shuffle's window of shards (the plan's). `rank`/`world_size` default to the initialised
    `torch.distributed` group, else 0 of 1. `prefetch`: global steps packed, read and assembled
    ahead on a thread of the loader while the training step runs (that many wait for the training
    loop, and the thread makes one more; ``concat`` over a local token dataset hands them over in
    lists of `prefetch` steps: one list waits, the thread makes one more; 0: everything on the
    training thread).
    """

    def __init__(self, data: Any, seq_len: int, batch_size: int, *, shuffle: bool = False, seed: int = 0,
                 pack: str = "concat", tokenizer: Any = None, eos_token: Any = None, pad_id: int | None = None,
                 drop_last: bool = False, rank: int | None = None, world_size: int | None = None,
                 output: str | None = None, device: str = "cpu", window: int = 4, prefetch: int = 2):
        for name, v, lo in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1), ("seed", seed, 0),
                            ("window", window, 1), ("prefetch", prefetch, 0)):
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
        self.pack, self.drop_last, self.window, self.prefetch = pack, bool(drop_last), int(window), int(prefetch)
        self.rank, self.world_size = rank, world_size
        self.output, self.device = default_output(output), device
        mix = data if type(data).__name__ == "Mix" else None
        self._parts = [open_data(d) for d in mix.datasets] if mix is not None else [open_data(data)]
        self._source = self._parts[0]
        self._served = self._source if is_served(self._source) else None
        if mix is not None and any(is_served(p) for p in self._parts):
            raise ConfigError("a Mix of served token datasets is not supported: mix local datasets, or read one "
                              "served dataset")
        self.manifest = self._source.manifest
        self._tok = tf.load_tokenizer(tokenizer) if tokenizer is not None else None
        tok_sha = tf.tokenizer_info(self._tok)["tokenizer_sha256"] if self._tok is not None else None
        metas = [tf.check_meta(p.manifest, name=p.root) for p in self._parts]
        self.meta = metas[0]
        if mix is not None:
            for p, m in zip(self._parts, metas):
                if m is None:
                    raise ConfigError(f"{p.root} of the mix is not a token dataset: a TokenLoader mixes token "
                                      f"datasets (convert it with --tokenizer)")
                if m["tokenizer_sha256"] != metas[0]["tokenizer_sha256"]:
                    raise ConfigError(f"{p.root} of the mix was tokenized with another tokenizer than "
                                      f"{self._parts[0].root} (SHA-256 {m['tokenizer_sha256'][:12]}... and "
                                      f"{metas[0]['tokenizer_sha256'][:12]}...): mixed datasets share one tokenizer")
        if self.meta is not None:
            if tok_sha is not None and tok_sha != self.meta["tokenizer_sha256"]:
                raise ConfigError(f"{self._source.root} was tokenized with another tokenizer (SHA-256 "
                                  f"{self.meta['tokenizer_sha256'][:12]}..., this one {tok_sha[:12]}...); pass "
                                  f"its tokenizer, or none (pre-tokenized data needs none)")
            tok_sha = self.meta["tokenizer_sha256"]
            per_part = [[int(s["documents"]) for s in p.manifest["shards"]] for p in self._parts]
            dtypes = [np.dtype(m["dtype"]).newbyteorder("<") for m in metas]
            vocab = max(m["vocab_size"] for m in metas)
        else:
            if tf.TEXT_FIELD not in self.manifest["fields"]:
                raise FormatError(f"{self._source.root} is neither a token dataset nor a text dataset (fields "
                                  f"{', '.join(self.manifest['fields'])}); convert the corpus with gdsload convert")
            if self._tok is None:
                raise ConfigError(f"{self._source.root} holds text (converted without --tokenizer): pass "
                                  f"tokenizer= (a tokenizer.json) to tokenize it on the fly")
            per_part = [[int(s["samples"]) for s in self.manifest["shards"]]]
            dtypes = [np.dtype("<u4")]
            vocab = self._tok.get_vocab_size(with_added_tokens=True)
        special = self.meta["special_tokens"] if self.meta is not None else None
        self.eos_id = tf.resolve_token(eos_token, tok=self._tok, special=special, vocab_size=vocab)
        self.pad_id = int(pad_id) if pad_id is not None else (self.eos_id if self.eos_id is not None else 0)
        self.tokenizer_sha256 = tok_sha
        verify = all(getattr(d, "verify", "fast") is not None for d in (mix.datasets if mix is not None else [data]))
        self.docs = Documents(self._parts, dtypes, per_part, tok=self._tok if self.meta is None else None,
                              eos_id=self.eos_id, verify=verify,
                              cache_limit=max(1 << (23 if self.meta is None else 22),
                                              8 * (self.prefetch + 2) * self.global_batch * self.seq_len))
        self.num_documents = self.docs.num_documents
        self._verify_full = any(getattr(d, "verify", None) == "full"
                                for d in (mix.datasets if mix is not None else [data]))
        self._lock = threading.RLock()  # the caches, between the prefetch thread and the caller
        self.mix = None
        if mix is not None:
            self._setup_mix(mix, per_part, metas)
            self._id = self.mix.mix_id
        else:
            self._id = dataset_id(self.manifest["shards"])
        self._epoch, self._step, self._state = 0, 0, pk.start_state()
        self._mixpos: tuple[int, MixCursor] | None = None  # a mix: (base position, the stream there)
        self._cursor = Cursor()  # the live pass (gdsload.frontend.cursor's rules)
        from gdsload.frontend.tokens_gpu import device_path

        self._gpu = device_path(self)  # device="cuda" with KvikIO: reads and assembly on the GPU

    def _setup_mix(self, mix: Any, per_part: list[list[int]], metas: list[Any]) -> None:
        from gdsload.plan.mix import MixSource, MixSpec

        if any(r is not None for r in mix.repeat) or any(n is not None for n in mix.samples):
            raise ConfigError("a TokenLoader mixes by token weights: repeat= and samples= (counts of samples) "
                              "do not apply; give weights")
        if mix.samples_per_epoch is not None:
            raise ConfigError("a TokenLoader's mix epoch is the datasets' tokens together; samples_per_epoch "
                              "does not apply (count steps with max_steps instead)")
        if mix.mix_by != "sample":
            raise ConfigError("mix_by='batch' is not supported by TokenLoader: documents of every dataset are "
                              "packed into the rows by their token weights")
        extra = 1 if self.eos_id is not None else 0
        tokens = [m["num_tokens"] + extra * m["num_documents"] for m in metas]
        for p, t in zip(self._parts, tokens):
            if t == 0:
                raise ConfigError(f"{p.root} of the mix has no tokens")
        w0 = list(mix.weights) if mix._weights_given else [float(t) for t in tokens]
        sources = tuple(MixSource(name=n, dataset_id=dataset_id(p.manifest["shards"]), shard_sizes=tuple(sizes),
                                  weight=float(w)) for n, p, sizes, w in zip(mix.names, self._parts, per_part, w0))
        self.mix = MixSpec(sources, None, "sample", schedule=tuple(mix.schedule))
        self.tokens_per_epoch = int(sum(tokens))
        offsets = np.concatenate([[0], np.cumsum([sum(s) for s in per_part])]).tolist()
        self._mixer = TokenMix(docs_per_shard=per_part, offsets=offsets[:-1],
                               phases=[(0, w0)] + [(int(b), list(w)) for b, w in mix.schedule],
                               seed=self.seed, shuffle=self.shuffle, window=self.window,
                               tokens_per_epoch=self.tokens_per_epoch, lengths=self.docs.lengths)

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def num_tokens(self) -> int:
        """Tokens of an epoch, end-of-document tokens included (a token dataset only)."""
        if self.meta is None:
            raise TypeError("a text dataset tokenized on the fly has no known token count")
        if self.mix is not None:
            return self.tokens_per_epoch
        return self.meta["num_tokens"] + (self.num_documents if self.eos_id is not None else 0)

    def __len__(self) -> int:
        if self.meta is None:
            raise TypeError("len() of a TokenLoader over text tokenized on the fly is not known (its token "
                            "count is known only once tokenized): convert the corpus with --tokenizer")
        if self.mix is not None:
            raise TypeError("len() of a TokenLoader over a Mix is not known: a mix's epoch ends with the "
                            f"document that crosses its {self.tokens_per_epoch} tokens (tokens_per_epoch); "
                            "count steps (max_steps) instead")
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
        """Start the next pass at `epoch`'s start; a live pass is stopped (`gdsload.frontend.cursor`'s
        rule: its `next()` raises `PassStopped`). The epoch the loader is at changes nothing."""
        if not isinstance(epoch, (int, np.integer)) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError(f"epoch must be an int >= 0, got {epoch!r}")
        if int(epoch) != self._epoch:
            self._cursor.stop(f"set_epoch({int(epoch)})")
            self._epoch, self._step, self._state, self._mixpos = int(epoch), 0, pk.start_state(), None

    def _identity(self) -> dict[str, Any]:
        out = {"version": STATE_VERSION, "kind": "tokens", "tokens_version": pk.TOKENS_STATE, "order": ORDER,
               "dataset": self._id, "seed": self.seed, "shuffle": self.shuffle, "window": self.window,
               "drop_last": self.drop_last, "global_batch": self.global_batch, "num_samples": self.num_documents,
               "seq_len": self.seq_len, "pack": self.pack, "eos": self.eos_id, "tokenizer": self.tokenizer_sha256}
        if self.mix is not None:
            out["mix"] = self.mix.describe()
        return out

    def state_dict(self) -> pk.TokenState:
        """Where the next batch comes from (JSON-serialisable; `gdsload.plan.pack.TokenState`; a
        mix adds ``mix`` and ``mix_cursor``). While a pass is live: after its last batch handed out."""
        st = self._state
        out = dict(**self._identity(), epoch=self._epoch, step=self._step, position=int(st["position"]),
                   offset=int(st["offset"]), carry=[[int(v) for v in p] for p in st["carry"]])
        if self.mix is not None:
            with self._lock:
                base, cur = self._mixpos if self._mixpos is not None else (0, self._mixer.epoch_start(self._epoch))
            out["mix_cursor"] = {"base": base, **cur.to_json()}
        return out  # type: ignore[return-value]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state` (checked first: a state that does not fit is refused and changes
        nothing); a live pass is stopped (its `next()` raises `PassStopped`)."""
        mixpos = None
        if self.mix is not None and isinstance(state, Mapping) and state.get("kind") == "tokens":
            if "mix" not in state:
                raise StateError(f"the state is from a single dataset, this loader reads a mix of "
                                 f"{[s.name for s in self.mix.sources]}")
            why = self.mix.differences(state["mix"])
            if why is not None:
                raise StateError(f"state field 'mix' does not match: {why}")
            mc = state.get("mix_cursor")
            if not isinstance(mc, Mapping) or not isinstance(mc.get("base"), int) or mc["base"] < 0:
                raise StateError("a mix's state needs 'mix_cursor' with an int 'base' >= 0")
            mixpos = (mc["base"], MixCursor.from_json(mc, len(self.mix.sources)))
        epoch, step, st = pk.check_state(state, self._identity())
        if mixpos is not None and mixpos[0] > min([st["position"]] + [p[0] for p in st["carry"]]):
            raise StateError("state field 'mix_cursor' is after the state's position")
        self._cursor.stop("load_state_dict()")
        self._epoch, self._step, self._state, self._mixpos = epoch, step, st, mixpos

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        old = self._cursor.live()
        if old is not None:
            old.close()  # a new iter() closes the live pass (its iterator ends) and continues
        it = _Pass(self, self._epoch, self._step, self._state, self._mixpos)
        self._cursor.begin(it)
        it.start()
        return it

    def _epoch_packer(self, epoch: int, mixpos: tuple[int, MixCursor] | None,
                      state: pk.PackState | None = None) -> tuple[Any, pk.Packer, Any]:
        """(positions -> document ids, the epoch's packer, the mixed epoch, the served stream or
        None). A served dataset's stream starts at the first position `state` still needs."""
        if self._served is not None:
            order = pk.DocOrder(self.docs.docs_per_shard, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                                window=self.window)
            base = _base(state) if state is not None else 0
            stream = StreamedEpoch(self, order, epoch, base)
            self.docs.stream = stream
            packer = pk.Packer(seq_len=self.seq_len, rows=self.global_batch, pack=self.pack,
                               num_documents=self.num_documents, lengths=stream.lengths)
            return stream.at, packer, stream
        if self.mix is None:
            order = pk.DocOrder(self.docs.docs_per_shard, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                                window=self.window)
            packer = pk.Packer(seq_len=self.seq_len, rows=self.global_batch, pack=self.pack,
                               num_documents=self.num_documents, lengths=lambda pos: self.docs.lengths(order.at(pos)),
                               block_max=_TEXT_BLOCK if self.meta is None else pk.BLOCK)
            return order.at, packer, None
        mixed = self._mixer.epoch(epoch, *(mixpos[::-1] if mixpos is not None else ()))
        packer = pk.Packer(seq_len=self.seq_len, rows=self.global_batch, pack=self.pack, num_documents=None,
                           lengths=mixed.lengths)
        return mixed.at, packer, mixed

    @staticmethod
    def _named(at: Any, rows: list[list[pk.Piece]]) -> list[list[pk.Piece]]:
        flat = [p for row in rows for p in row]
        ids = {}
        if flat:
            got = at(np.asarray([p[0] for p in flat], np.int64)).tolist()
            ids = dict(zip((p[0] for p in flat), got))
        return [[(ids[p[0]], p[1], p[2]) for p in row] for row in rows]

    def rows(self, epoch: int, state: pk.PackState) -> tuple[list[list[pk.Piece]], pk.PackState]:
        """The global step's rows from `state` (pieces name document ids) and the state after (a
        mix: `state` of the epoch's start or the loader's own position)."""
        with self._lock:
            at, packer, _ = self._epoch_packer(epoch, self._mixpos if epoch == self._epoch else None, state)
            rows, nxt = packer.step(state)
            return self._named(at, rows), nxt

    def _steps(self, epoch: int, step: int, state: pk.PackState,
               mixpos: tuple[int, MixCursor] | None) -> Iterator[tuple[Any, Any]]:
        """The pass's items, each ``(arrays or None, the loader's state after it)``: a batch and
        the state once it is handed out, or (None, state) for the end of the epoch."""
        if self._chunked():
            yield from self._concat_steps(epoch, step, state)
            return
        with self._lock:
            at, packer, mixed = self._epoch_packer(epoch, mixpos, state)
        try:
            while True:
                with self._lock:
                    rows, nxt = packer.step(state)
                    rows = self._named(at, rows)
                    pieces = sum(len(r) for r in rows)
                    last = packer.exhausted(nxt)
                    full = all(sum(p[2] for p in r) == self.seq_len for r in rows)
                    ends = not pieces or (last and self.drop_last and not full)
                    if ends or last:
                        after = (epoch + 1, 0, pk.start_state(), None)
                        if isinstance(mixed, MixedEpoch):
                            end = mixed.cursor(mixed.end)
                            self._mixer.remember_start(epoch + 1, end)
                            after = (epoch + 1, 0, pk.start_state(), (0, end))
                    else:
                        mp = None
                        if isinstance(mixed, MixedEpoch):
                            base = _base(nxt)
                            mp = (base, mixed.cursor(base))
                            mixed.forget(base)
                        after = (epoch, step + 1, nxt, mp)
                    if isinstance(mixed, StreamedEpoch):
                        self.docs.stream = mixed  # the documents fetch takes (rows() may have made another)
                    arrays = None if ends else self._batch(rows[self.rank::self.world_size])
                    if isinstance(mixed, StreamedEpoch) and not (ends or last):
                        mixed.forget(_base(nxt))  # the documents this step's rows took are cached now
                if self._gpu is not None and arrays is not None:  # planned: a ring slot is waited
                    arrays = self._gpu.make(arrays)  # for outside the lock (state_dict takes it)
                yield arrays, after
                if ends or last:
                    return
                state, step = nxt, step + 1
        finally:
            if isinstance(mixed, StreamedEpoch):
                mixed.close()

    def _chunked(self) -> bool:
        """Whether passes take `_concat_steps` (``concat`` over a local token dataset, host path)."""
        return bool(_AHEAD and self.pack == "concat" and self.meta is not None and self.mix is None
                    and self._served is None and self._gpu is None)

    def _concat_steps(self, epoch: int, step: int, state: pk.PackState) -> Iterator[Any]:
        """`_steps` for ``concat`` over a local token dataset, `_AHEAD` tokens of steps at a time
        (`gdsload.plan.pack.concat_ahead` and `ConcatChunk`: the same batches and states as step
        by step; the chunk's states, lengths and reads at once, then each batch in a few NumPy
        calls over that batch, when the pass hands it on). A step's arrays are its own, never
        written again, so a batch kept stays as it was handed out. Items come in lists of up to
        `prefetch` consecutive steps (one hand-over between threads for several steps: each costs
        a wake-up and a GIL switch, as much as making a batch)."""
        order = pk.DocOrder(self.docs.docs_per_shard, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                            window=self.window)
        n, rows, seq = self.num_documents, self.global_batch, self.seq_len
        cap = rows * seq
        ahead = max(1, _AHEAD // cap)
        scratch = np.empty(0, self.docs.dtypes[0])  # a chunk's documents: made of its batches only, then reused
        while True:
            with self._lock:
                pos, off = int(state["position"]), int(state["offset"])
                parts, got, at = [], 0, pos
                while got < off + ahead * cap and at < n:  # lengths until they fill the steps
                    cnt = min(n - at, max(pk.BLOCK, 2 * len(parts) * pk.BLOCK))
                    parts.append(self.docs.lengths(order.at(np.arange(at, at + cnt, dtype=np.int64))))
                    got, at = got + int(parts[-1].sum()), at + cnt
                lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
                consumed, offs, real = pk.concat_ahead(lengths, off, seq_len=seq, rows=rows, steps=ahead,
                                                       complete=at >= n)
                lengths = lengths[:int(consumed[-1]) + int(offs[-1] > 0)]
                total = int(real.sum())
                need = pk.rank_documents(lengths, off, total, seq_len=seq, rows=rows, rank=self.rank,
                                         world=self.world_size)
                ids = order.at(pos + np.flatnonzero(need))
                flat = self.docs.read_end_to_end(ids, lengths[need], out=scratch)
                if len(flat) > len(scratch) and flat.dtype == scratch.dtype:  # the next chunks' buffer
                    scratch = np.empty(max(len(flat), 2 * len(scratch)), flat.dtype)
                chunk = pk.ConcatChunk(flat, lengths, off, total, seq_len=seq, rows=rows, rank=self.rank,
                                       world=self.world_size, pad_id=self.pad_id, need=need)
            group: list[tuple[Any, Any]] = []
            for t in range(len(real)):
                nxt = pk.PackState(position=pos + int(consumed[t]), offset=int(offs[t]), carry=[])
                last = nxt["position"] >= n and not nxt["offset"]
                ends = not real[t] or (last and self.drop_last and real[t] < cap)
                after = (epoch + 1, 0, pk.start_state(), None) if ends or last else (epoch, step + 1, nxt, None)
                group.append((None if ends else chunk.batch(t), after))
                if ends or last:
                    yield group
                    return
                if len(group) >= self.prefetch:
                    yield group
                    group = []
                state, step = nxt, step + 1
            if group:
                yield group

    def _batch(self, rows: list[list[pk.Piece]]) -> Any:
        if self._gpu is not None:  # gdsload.frontend.tokens_gpu: planned here, read by `_steps`
            return self._gpu.plan(rows)
        self.docs.fetch({p[0] for row in rows for p in row})
        cache = self.docs.cache
        return pk.assemble(rows, self.seq_len, lambda p: cache[p[0]][p[1]:p[1] + p[2]], self.pad_id)

    def _hand_out(self, arrays: Any) -> dict[str, Any]:
        if self._gpu is not None:
            return self._gpu.hand_out(arrays)
        if self.output == "numpy" and self.device == "cpu":  # as_output would give each array as it is
            return arrays
        return {k: as_output(v, self.output, self.device) for k, v in arrays.items()}

_END = object()


class _Pass:
    """One `iter()` of a TokenLoader: its steps, made `prefetch` steps ahead on a thread (or on the
    caller's thread with prefetch=0). Only handing a batch out moves the loader's state, so the
    state is exact whatever was made ahead. Follows `gdsload.frontend.cursor`'s rules: `stop(why)`
    (load_state_dict, set_epoch) ends the producer before it returns and makes the next `next()`
    raise `PassStopped`; `close()` (a newer iter()) ends it with StopIteration."""

    def __init__(self, loader: TokenLoader, epoch: int, step: int, state: pk.PackState,
                 mixpos: tuple[int, MixCursor] | None):
        self.epoch, self._loader = epoch, loader
        self._gen = loader._steps(epoch, step, state, mixpos)
        self._stopped_by: str | None = None
        self._done = False
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._q: queue.Queue = queue.Queue(maxsize=1 if loader._chunked() else max(1, loader.prefetch))
        self._held: list[Any] = []  # the rest of a list of items (`_concat_steps`), in order

    def start(self) -> None:
        if self._loader._gpu is not None:
            self._loader._gpu.begin_pass()
        if self._loader.prefetch > 0:
            self._thread = threading.Thread(target=_produce, args=(self._gen, self._q, self._halt),
                                            name="gdsload-tokens", daemon=True)
            self._thread.start()
            if self._loader._gpu is not None:
                self._loader._gpu.producer = self._thread

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._stopped_by is not None:
            raise PassStopped(f"this pass was stopped by the loader's {self._stopped_by}: call iter(loader) "
                              "again for the pass it set up")
        if self._done:
            raise StopIteration
        if self._held:
            item = self._held.pop(0)
        elif self._thread is None:
            item = next(self._gen, _END)
        else:
            item = self._q.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        if isinstance(item, list):
            item, self._held = item[0], item[1:]
        arrays, after = item
        lo = self._loader
        lo._epoch, lo._step, lo._state, lo._mixpos = after
        if arrays is None:
            self.close()
            raise StopIteration
        return lo._hand_out(arrays)

    def _end(self) -> None:
        was_done, self._done = self._done, True
        self._halt.set()
        if self._loader._gpu is not None and not was_done:
            self._loader._gpu.end_pass()  # a producer waiting for a slot wakes (RingClosed)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._loader._cursor.detach(self)

    def close(self) -> None:
        self._end()

    def stop(self, why: str) -> None:
        self._stopped_by = why
        self._end()

    def skip_to(self, position: int | None) -> None:  # the cursor's Pass protocol; TokenLoader has no skip
        raise NotImplementedError

    def __del__(self) -> None:
        self._halt.set()


def _produce(gen: Iterator[Any], q: queue.Queue, halt: threading.Event) -> None:
    """The prefetch thread: the pass's items into `q` until the pass ends or `halt` is set. It holds
    no reference to the pass, so a pass dropped unfinished is collected and its thread ends."""
    try:
        for item in gen:
            while not halt.is_set():
                try:
                    q.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if halt.is_set():
                return
        item = _END
    except BaseException as exc:  # handed to the training thread at its next()
        item = exc
    while not halt.is_set():
        try:
            q.put(item, timeout=0.05)
            return
        except queue.Full:
            continue


def _base(state: pk.PackState) -> int:
    """The first position a packing state still needs (best_fit's carry is before its position)."""
    return min([int(state["position"])] + [int(p[0]) for p in state["carry"]])


