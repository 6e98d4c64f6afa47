"""Packing documents into fixed-length rows: a pure function of the documents' lengths in order.

Terms
-----
* A *position* is an index into an epoch's document order (`DocOrder`: the plan's order 2 over
  documents, so 10^10 documents plan as fast as 10^3). ``lengths(positions)`` gives each
  document's length in tokens, end-of-document token included (the caller adds it): the packer
  sees lengths only, never tokens, so every rank packs every global step without reading its
  documents, and then reads only the tokens of its own rows.
* A *piece* ``(position, start, length)`` is the tokens ``start:start+length`` of a document; a
  *row* is a list of pieces of at most ``seq_len`` tokens in all (the rest is padding).
* A *global step* is ``rows`` rows (the global batch: batch size times world size); rank ``r`` of
  ``world`` takes rows ``r::world``, so the rows, and the stream, do not depend on the world size.

Modes
-----
* ``"concat"``: documents one after another, cut at row ends; every row is full but the last ones.
  The state between steps is the next position and the tokens of it already emitted (``offset``).
* ``"best_fit"``: never cuts a document that fits a row; a longer one is cut into pieces of
  ``seq_len`` (each a full row) and its remainder. Per step, the pieces carried over from the last
  step, then documents taken in order until the pieces hold at least `LOOKAHEAD` times the step's
  capacity (``rows * seq_len``), are placed best-fit: carried pieces first (oldest first, so none
  waits forever: the first always fits an empty row), then the new ones longest first (ties by
  position), each into the row with the least room that holds it (ties: the lowest row). Pieces
  that fit nowhere are carried to the next step (the state's ``carry``, at most about one step's
  tokens). Within a row pieces are ordered by (position, start).

`Packer.step(state)` returns one step's rows and the state after it; the epoch ends with the
first step that has no piece. Cost: O(pieces * log rows) per step, plus the lengths asked for.
`concat_ahead` and `ConcatChunk` are ``concat`` for many steps at once (the same states and
batches as `Packer.step` and `assemble`): the states in one NumPy pass, each batch in a few NumPy
calls over that batch; the loader's path over local token shards.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

import numpy as np

from gdsload.errors import StateError

__all__ = ["LOOKAHEAD", "PACKS", "DocOrder", "PackState", "Packer", "TokenState", "assemble",
           "ConcatChunk", "check_state", "concat_steps"]

PACKS = ("concat", "best_fit")
# best_fit takes documents until its pieces hold this many steps' capacity (>= 1: the steps bound
# relies on it). Measured on the tests' corpus (stdlib text, 831 documents of 31-8,000 tokens, seq_len
# 2048, rows per step 4/8/16): 1.0 filled 95.2/97.7/97.7 % of all positions, 2.0 97.7/97.7/97.7 %
# (98.0/99.3/99.8 % of the steps before the last), carrying at most 24-59 pieces.
LOOKAHEAD = 2.0
IGNORE = -100  # the label of a position the loss skips (HF and torch's CrossEntropyLoss default)
BLOCK = 512  # lengths asked for at once
TOKENS_STATE = 1  # version of the token part of the state

Piece = tuple[int, int, int]  # (position, start, length)


class PackState(TypedDict):
    position: int  # the next position not yet taken into the packer
    offset: int  # concat: tokens of that position's document already emitted
    carry: list[list[int]]  # best_fit: pieces taken but not placed yet, [position, start, length]


def start_state() -> PackState:
    return PackState(position=0, offset=0, carry=[])


class DocOrder:
    """The documents of one epoch in order: `at(positions)` gives global document ids.

    Unshuffled: the identity. Shuffled: the plan's order 2 (`gdsload.plan.window.WindowOrder`)
    with the shards' document counts as its shard sizes: shard order permuted, documents mixed
    within a window of `window` shards; O(shards) memory, any position computed on demand."""

    def __init__(self, docs_per_shard: Sequence[int], *, seed: int, epoch: int, shuffle: bool, window: int):
        self.num_documents = int(sum(docs_per_shard))
        self._order = None
        if shuffle and self.num_documents:
            from gdsload.plan.window import WindowOrder

            self._order = WindowOrder(tuple(int(n) for n in docs_per_shard), seed, epoch, True, window)

    def at(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, np.int64)
        return positions.copy() if self._order is None else self._order.at(positions)


class _Lengths:
    """Lengths by position, asked for in blocks of `BLOCK`, each block twice the last up to
    `block_max` (a cache of the last block). With `num_documents` None the epoch ends where
    `lengths` first gives fewer lengths than asked for."""

    def __init__(self, lengths: Callable[[np.ndarray], np.ndarray], num_documents: int | None,
                 block_max: int = BLOCK):
        self._fn, self.n = lengths, num_documents
        self._start, self._block = 0, np.zeros(0, np.int64)
        self._end: int | None = num_documents
        self._size, self._max = min(BLOCK, block_max), block_max

    def _load(self, pos: int) -> None:
        size, self._size = self._size, min(self._max, 2 * self._size)
        want = size if self.n is None else max(0, min(size, self.n - pos))
        self._start = pos
        self._block = np.asarray(self._fn(np.arange(pos, pos + want, dtype=np.int64)), np.int64)
        if len(self._block) < want:
            self._end = pos + len(self._block)

    def has(self, pos: int) -> bool:
        """Whether the epoch has a document at `pos`."""
        if self._end is not None:
            return pos < self._end
        if not 0 <= pos - self._start < len(self._block):
            self._load(pos)
        return 0 <= pos - self._start < len(self._block)

    def __call__(self, pos: int) -> int:
        i = pos - self._start
        if not 0 <= i < len(self._block):
            self._load(pos)
            i = 0
        return int(self._block[i])


class Packer:
    """One epoch's packing: `step(state)` -> (the step's `rows` rows of pieces, the next state).

    `lengths(positions)` (int64 array in, int64 array out) must depend on the positions only:
    then so do the rows. `num_documents` None: not known ahead (a mix by tokens): `lengths` then
    gives fewer lengths than asked for at the epoch's end. Not thread-safe (it caches the last
    block of lengths)."""

    def __init__(self, *, seq_len: int, rows: int, pack: str, num_documents: int | None,
                 lengths: Callable[[np.ndarray], np.ndarray], block_max: int = BLOCK):
        if pack not in PACKS:
            raise ValueError(f"pack must be one of {', '.join(map(repr, PACKS))}, got {pack!r}")
        self.seq_len, self.rows, self.pack, self.n = seq_len, rows, pack, num_documents
        self._len = _Lengths(lengths, num_documents, block_max)

    def step(self, state: PackState) -> tuple[list[list[Piece]], PackState]:
        return self._concat(state) if self.pack == "concat" else self._best_fit(state)

    def _concat(self, state: PackState) -> tuple[list[list[Piece]], PackState]:
        pos, off, out = int(state["position"]), int(state["offset"]), []
        for _ in range(self.rows):
            row: list[Piece] = []
            room = self.seq_len
            while room and self._len.has(pos):
                length = self._len(pos)
                take = min(length - off, room)
                if take > 0:
                    row.append((pos, off, take))
                    off += take
                    room -= take
                if off >= length:
                    pos, off = pos + 1, 0
            out.append(row)
        return out, PackState(position=pos, offset=off, carry=[])

    def _best_fit(self, state: PackState) -> tuple[list[list[Piece]], PackState]:
        seq = self.seq_len
        carry = [tuple(int(v) for v in p) for p in state["carry"]]
        total = sum(p[2] for p in carry)
        pos, new = int(state["position"]), []
        need = LOOKAHEAD * self.rows * seq
        while total < need and self._len.has(pos):
            length = self._len(pos)
            start = 0
            while length - start > seq:
                new.append((pos, start, seq))
                start += seq
            if length > start:
                new.append((pos, start, length - start))
            total += length
            pos += 1
        new.sort(key=lambda p: (-p[2], p[0], p[1]))
        free = [(seq, b) for b in range(self.rows)]  # (room, row), sorted
        rows: list[list[Piece]] = [[] for _ in range(self.rows)]
        left: list[list[int]] = []
        for piece in carry + new:
            i = bisect.bisect_left(free, (piece[2], -1))
            if i == len(free):
                left.append(list(piece))
                continue
            room, b = free.pop(i)
            rows[b].append(piece)  # type: ignore[arg-type]
            if room > piece[2]:
                bisect.insort(free, (room - piece[2], b))
        for row in rows:
            row.sort()
        return rows, PackState(position=pos, offset=0, carry=left)


    def exhausted(self, state: PackState) -> bool:
        """Whether `state` has nothing left to pack in this epoch."""
        return not self._len.has(int(state["position"])) and not state["carry"] and not state["offset"]


def exhausted(state: PackState, num_documents: int) -> bool:
    """Whether a state has nothing left to pack in its epoch."""
    return state["position"] >= num_documents and not state["carry"] and not state["offset"]


def concat_steps(num_tokens: int, *, seq_len: int, rows: int, drop_last: bool) -> int:
    """Exact global steps of a ``"concat"`` epoch of `num_tokens` tokens (end-of-document tokens
    included): full steps, plus the padded last one unless `drop_last`."""
    per_step = seq_len * rows
    return num_tokens // per_step if drop_last else -(-num_tokens // per_step)


def best_fit_steps_bound(num_documents: int, num_tokens: int, *, seq_len: int, rows: int) -> int:
    """An upper bound of a ``"best_fit"`` epoch's global steps. Every step but the last puts at
    least one piece in every row (a step with a piece left over has no row that holds it: every
    row has a piece; a step without leaves its documents' stream exhausted unless all its rows are
    full), and an epoch has at most ``documents + tokens // seq_len`` pieces."""
    pieces = num_documents + num_tokens // seq_len
    return -(-pieces // rows) + 1


# -- rows into a batch ----------------------------------------------------------------------------
def assemble(rows: Sequence[Sequence[Piece]], seq_len: int, tokens: Callable[[Piece], np.ndarray],
             pad_id: int) -> dict[str, np.ndarray]:
    """A batch from rows of pieces: `tokens(piece)` gives a piece's ids (its length of them).

    ``input_ids`` (int64 [B, seq_len]); ``labels`` (int64): the ids, with `IGNORE` (-100) at each
    piece that starts a document (its first token: the model shifts, and that token is not
    predicted from its own document) and on padding; ``position_ids`` (int64): each piece's
    offset in its document counting on (0 at a document's start); ``attention_mask`` (int64): 1 on
    tokens, 0 on padding; ``cu_seqlens`` (int32): the boundaries of the pieces over the flattened
    batch, each row's padding one sequence of its own, from 0 to ``B * seq_len`` (FlashAttention's
    varlen layout; the rows' ends are boundaries).

    Vectorised: one `tokens` call per piece, then whole-batch NumPy (no loop over tokens or
    rows); a batch whose rows are all full (every ``concat`` step but the last) is the pieces'
    ids end to end, reshaped."""
    b = len(rows)
    flat = [p for row in rows for p in row]
    counts = np.fromiter((len(row) for row in rows), np.int64, b)
    if not flat:
        cu = np.arange(b + 1, dtype=np.int32) * seq_len
        return {"input_ids": np.full((b, seq_len), pad_id, np.int64),
                "labels": np.full((b, seq_len), IGNORE, np.int64),
                "position_ids": np.zeros((b, seq_len), np.int64),
                "attention_mask": np.zeros((b, seq_len), np.int64), "cu_seqlens": cu}
    start = np.fromiter((p[1] for p in flat), np.int64, len(flat))
    n = np.fromiter((p[2] for p in flat), np.int64, len(flat))
    got = [tokens(p) for p in flat]
    have = np.fromiter(map(len, got), np.int64, len(got))
    if (bad := np.flatnonzero(have != n)).size:
        i = int(bad[0])
        raise ValueError(f"tokens({flat[i]}) gave {int(have[i])} ids, expected {int(n[i])}")
    ends = np.cumsum(n)
    before = ends - n  # tokens of the pieces before each piece, over all rows
    row_of = np.repeat(np.arange(b, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts  # each row's first piece
    row_base = np.zeros(b, np.int64)
    has = counts > 0
    row_base[has] = before[first[has]]
    at = before - row_base[row_of]  # each piece's offset in its row
    fill = np.zeros(b, np.int64)
    np.add.at(fill, row_of, n)
    if (over := np.flatnonzero(fill > seq_len)).size:
        raise ValueError(f"row {int(over[0])} holds {int(fill[over[0]])} tokens, more than seq_len {seq_len}")
    total = int(ends[-1])
    ids = np.concatenate(got).astype(np.int64, copy=False)  # a new array: never the caller's documents
    dest = row_of * seq_len + at  # each piece's first token, flattened
    pos = np.repeat(start - before, n) + np.arange(total, dtype=np.int64)
    if total == b * seq_len:  # every row full: the pieces are the batch end to end
        input_ids, position_ids = ids.reshape(b, seq_len), pos.reshape(b, seq_len)
        labels = input_ids.copy()
        mask = np.ones((b, seq_len), np.int64)
    else:  # a row's pieces are one run of `ids` (and of `pos`): a slice a row, not a scatter a field
        input_ids = np.full((b, seq_len), pad_id, np.int64)
        position_ids = np.zeros((b, seq_len), np.int64)
        for r, (a, f) in enumerate(zip(row_base.tolist(), fill.tolist())):
            input_ids[r, :f] = ids[a:a + f]
            position_ids[r, :f] = pos[a:a + f]
        real = np.arange(seq_len)[None, :] < fill[:, None]
        labels = np.where(real, input_ids, IGNORE)
        mask = real.astype(np.int64)
    labels.reshape(-1)[dest[start == 0]] = IGNORE
    row_ends = (np.flatnonzero(fill < seq_len) + 1) * seq_len
    cu = np.sort(np.concatenate([[0], dest + n, row_ends])).astype(np.int32)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "attention_mask": mask,
            "cu_seqlens": cu}


# -- concat, many steps at once ------------------------------------------------------------------
def concat_ahead(lengths: np.ndarray, offset: int, *, seq_len: int, rows: int, steps: int,
                 complete: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``concat``'s next global steps from a state ``(position, offset)``, in one NumPy pass:
    what `Packer.step` gives step by step, for `steps` steps (fewer where the epoch ends).

    `lengths`: the lengths of the documents from the state's position on, at least enough for
    `steps` full steps, or (`complete`) all the epoch has left. Returns ``(consumed, offsets,
    real)``, one entry a step: the state after it is ``(position + consumed, offsets)``, and
    ``real`` its real tokens (``rows * seq_len`` but at the epoch's end; 0: the step has no piece).
    Stops after the first step that leaves nothing to pack or has no piece."""
    cap = rows * seq_len
    lengths = np.asarray(lengths, np.int64)
    m = len(lengths)
    cum = np.cumsum(lengths) - offset  # each document's end, from the state's first token on
    avail = int(cum[-1]) if m else 0
    k = steps if not complete else min(steps, max(1, -(-avail // cap)))
    bounds = np.arange(1, k + 1, dtype=np.int64) * cap
    e = np.searchsorted(cum, bounds, side="left")
    inside = e < m
    ec = np.minimum(e, max(m - 1, 0))
    # a document that ends on the step's last token is consumed; one of 0 tokens right after is not
    done = inside & (cum[ec] == bounds) & (lengths[ec] > 0) if m else inside
    e = e + done
    inside = e < m
    ec = np.minimum(e, max(m - 1, 0))
    offs = np.where(inside, bounds - (cum[ec] - lengths[ec]) if m else 0, 0)
    if complete:  # a step with room left takes every document left (those of 0 tokens too)
        room = bounds > avail
        e, offs = np.where(room, m, e), np.where(room, 0, offs)
    real = np.clip(avail - (bounds - cap), 0, cap)
    return e.astype(np.int64), offs.astype(np.int64), real.astype(np.int64)


class ConcatChunk:
    """Rank `rank`'s batches of ``concat`` steps whose tokens are the documents of `lengths` end to
    end from `offset` (the first `real` tokens of that span are the steps' real tokens together),
    as `assemble` makes them: ``batch(t)`` for each of the chunk's ``steps``.

    `flat` holds the whole documents this rank's rows touch, in order, as stored (uint16 or uint32,
    each with its eos), the others left out (`need`: `rank_documents`' answer, computed here if
    not given; `lengths` includes them). A row's documents are all needed, so each row is one run
    of `flat`. What depends on the whole chunk (each row's run in `flat` and its first token's
    position, the documents' starts by step, every step's cu_seqlens) is computed here once over
    documents and rows; ``batch(t)`` makes the step's arrays, new (no other batch shares them, and
    nothing writes them after), in a few NumPy calls over that batch only: arrays of one batch,
    allocated and freed at the training loop's pace, stay in cache and reuse the allocator's memory,
    where arrays of a whole chunk would cost a page fault every 4 KiB."""

    def __init__(self, flat: np.ndarray, lengths: np.ndarray, offset: int, real: int, *, seq_len: int, rows: int,
                 rank: int, world: int, pad_id: int, need: np.ndarray | None = None):
        S, cap = seq_len, rows * seq_len
        self.steps = k = -(-real // cap) if real else 0
        self.b = b = len(range(rank, rows, world))
        self.flat, self.S, self.pad_id, self.contiguous = flat, S, pad_id, world == 1
        lengths = np.asarray(lengths, np.int64)
        start = np.cumsum(lengths) - lengths - offset  # each document's first token in the span (< 0: before)
        if need is None:
            need = rank_documents(lengths, offset, real, seq_len=S, rows=rows, rank=rank, world=world)
        nl = np.where(need, lengths, 0)
        shift = start - (np.cumsum(nl) - nl)  # span index - flat index, for each needed document's tokens
        lo = (np.arange(k, dtype=np.int64)[:, None] * rows + np.arange(rank, rows, world)[None, :]).reshape(-1) * S
        self.rlen = np.clip(real - lo, 0, S)  # each of this rank's rows (step-major): its real tokens
        live = self.rlen > 0
        d = np.clip(np.searchsorted(start, lo, side="right") - 1, 0, None)  # the document of its first token
        self.fa = np.where(live, lo - shift[d] if len(lengths) else 0, 0)  # its first token in `flat`
        self.p0 = np.where(live, lo - start[d] if len(lengths) else 0, 0)  # that token's position in its document
        self.full = (self.rlen.reshape(k, b) == S).all(axis=1).tolist() if k else []
        # documents (of >= 1 token) starting inside one of this rank's rows: labels -100 there
        nz = lengths > 0
        sd = start[nz]
        inside = (sd >= 0) & (sd < real)
        sd = sd[inside]
        grow = sd // S
        mine = (grow % rows) % world == rank
        sd, grow = sd[mine], grow[mine]
        j = (grow // rows) * b + ((grow % rows) - rank) // world  # this rank's row number in the chunk
        q = sd - grow * S
        per = b * S
        o = j * S + q  # over the chunk's rows of this rank, flattened
        self.starts, self.start_edges = o % per, np.searchsorted(o, np.arange(k + 1) * per).tolist()
        cut = q > 0
        # cu_seqlens: 0, each piece's end (a document start or the padding's start inside a row), each row's end
        padq = self.rlen
        inner = (padq > 0) & (padq < S)
        cuts = np.concatenate([o[cut], (np.arange(len(lo)) + 1) * S, np.flatnonzero(inner) * S + padq[inner]])
        step = np.concatenate([(cuts - 1) // per, np.arange(k)])
        vals = np.concatenate([cuts, np.arange(k) * per]) - step * per
        by = np.argsort(step * (per + 1) + vals, kind="stable")
        self.cu = vals[by].astype(np.int32)
        ends = np.cumsum(np.bincount(step, minlength=k))
        self.cu_edges = [0, *ends.tolist()]
        # positions: each piece (between two cu_seqlens) counts on from its first token's position (its
        # row's first: p0; any other: 0, a document's start), so a step's positions are one repeat + arange
        first = np.ones(len(self.cu), bool)
        first[ends - 1] = False  # a step's last boundary starts no piece
        c, pstep = vals[by][first], np.repeat(np.arange(k), ends - np.concatenate([[0], ends[:-1]]) - 1)
        row = pstep * b + c // S
        row_p0 = self.p0[np.minimum(row, max(len(self.p0) - 1, 0))] if len(self.p0) else np.zeros(0, np.int64)
        self.shift = np.where(c % S == 0, row_p0, 0) - c
        self.plen = np.diff(vals[by])[first[:-1]] if len(c) else np.zeros(0, np.int64)
        self.arange = np.arange(per, dtype=np.int64)

    def batch(self, t: int) -> dict[str, np.ndarray]:
        """Step `t`'s arrays (``0 <= t < steps``)."""
        b, S = self.b, self.S
        r0, r1 = t * b, (t + 1) * b
        full = self.full[t]
        if full and self.contiguous:  # one rank: the step's rows are one run of `flat`
            a = int(self.fa[r0])
            ids = self.flat[a:a + b * S].astype(np.int64).reshape(b, S)
        else:
            ids = np.empty((b, S), np.int64) if full else np.full((b, S), self.pad_id, np.int64)
            for i, (a, n) in enumerate(zip(self.fa[r0:r1].tolist(), self.rlen[r0:r1].tolist())):
                ids[i, :n] = self.flat[a:a + n]
        labels = ids.copy()
        labels.reshape(-1)[self.starts[self.start_edges[t]:self.start_edges[t + 1]]] = IGNORE
        p0, p1 = self.cu_edges[t] - t, self.cu_edges[t + 1] - t - 1  # the step's pieces
        pos = np.repeat(self.shift[p0:p1], self.plen[p0:p1])
        pos += self.arange
        pos = pos.reshape(b, S)
        if full:
            mask = np.ones((b, S), np.int64)
        else:
            pad = np.arange(S)[None, :] >= self.rlen[r0:r1, None]
            labels[pad] = IGNORE
            pos[pad] = 0
            mask = (~pad).astype(np.int64)
        return {"input_ids": ids, "labels": labels, "position_ids": pos, "attention_mask": mask,
                "cu_seqlens": self.cu[self.cu_edges[t]:self.cu_edges[t + 1]]}


def rank_documents(lengths: np.ndarray, offset: int, real: int, *, seq_len: int, rows: int, rank: int,
                   world: int) -> np.ndarray:
    """Which documents of a ``concat`` span (`concat_batches`'s terms) hold a token of one of rank
    `rank`'s rows: those it reads."""
    lengths = np.asarray(lengths, np.int64)
    start = np.cumsum(lengths) - lengths - offset
    end = np.minimum(start + lengths, real)
    first = np.maximum(start, 0) // seq_len
    last = (end - 1) // seq_len
    nrows = -(-real // seq_len) + 1
    g = np.arange(nrows + 1, dtype=np.int64)
    own = np.concatenate([[0], np.cumsum((g % rows) % world == rank)])  # own rows before row g
    has = end > np.maximum(start, 0)
    return has & (own[np.clip(last + 1, 0, nrows + 1)] - own[np.clip(first, 0, nrows + 1)] > 0)


# -- state ----------------------------------------------------------------------------------------
class TokenState(TypedDict):
    """A token loader's state: the plan's fields (``position`` counts documents of the epoch's
    order) plus the packing: ``step`` (global steps done in ``epoch``), ``offset`` and ``carry``
    (`PackState`) and what the rows depend on (``seq_len``, ``pack``, ``eos``, ``tokenizer``)."""

    version: int
    kind: str  # "tokens"
    tokens_version: int
    order: int
    dataset: str
    seed: int
    shuffle: bool
    window: int
    drop_last: bool
    global_batch: int  # rows per global step
    num_samples: int  # documents
    seq_len: int
    pack: str
    eos: int | None
    tokenizer: str | None  # SHA-256 of the tokenizer's JSON (pre-tokenized data: the dataset's)
    epoch: int
    step: int
    position: int
    offset: int
    carry: list[list[int]]


IDENTITY = ("version", "kind", "tokens_version", "order", "dataset", "num_samples", "seq_len", "pack",
            "eos", "tokenizer", "seed", "shuffle", "window", "drop_last", "global_batch")
_WHAT = {"dataset": "data", "num_samples": "number of documents", "global_batch": "global batch (rows per step)"}


def check_state(state: Any, mine: Mapping[str, Any]) -> tuple[int, int, PackState]:
    """``(epoch, step, PackState)`` of a saved `state`, after checking it is one of this loader's
    (`mine`: a `TokenState`); the world size may differ, nothing in `IDENTITY` may. Raises
    `StateError` naming the first difference."""
    if not isinstance(state, Mapping):
        raise StateError(f"a token loader state is a dict, got {type(state).__name__}")
    if state.get("kind") != "tokens":
        raise StateError("this state is not a TokenLoader's (it has no kind 'tokens'): a DataLoader's "
                         "state resumes a DataLoader")
    for key in IDENTITY:
        if key not in state:
            raise StateError(f"the state lacks {key!r}")
        if state[key] != mine[key]:
            raise StateError(f"the state is of another {_WHAT.get(key, key)}: {state[key]!r} there, "
                             f"{mine[key]!r} here; it cannot resume this loader")
    for key in ("epoch", "step", "position", "offset"):
        v = state.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise StateError(f"state field {key!r} must be an int >= 0, got {v!r}")
    carry = state.get("carry")
    if not isinstance(carry, list) or not all(
            isinstance(p, (list, tuple)) and len(p) == 3 and all(isinstance(v, int) and v >= 0 for v in p)
            for p in carry):
        raise StateError("state field 'carry' must be a list of [position, start, length]")
    if "mix" not in mine and state["position"] > state["num_samples"]:  # a mix's epoch may take more
        raise StateError(f"state position {state['position']} is past the epoch's {state['num_samples']} documents")
    return state["epoch"], state["step"], PackState(position=state["position"], offset=state["offset"],
                                                    carry=[list(p) for p in carry])
