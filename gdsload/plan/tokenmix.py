"""Mixing token datasets by tokens: the document order of a `gdsload.Mix` read by a `TokenLoader`.

Part of the plan layer: a pure function of its inputs (the datasets' documents per shard, their
documents' lengths, the weights, the seed), no I/O.

Rule
----
Datasets ``0..k-1``. Each has an endless *stream* of its documents: its own epochs one after
another, each its `DocOrder` (order 2 over documents, seeded from ``(seed, i)`` as a sample mix's
datasets are, `gdsload.plan.mix`), so no document repeats within one of its own epochs.

The mixed stream takes one document at a time, from the dataset that is most behind its share of
the tokens: with weights ``w`` (the phase's, below), the dataset ``i`` with ``w[i] > 0`` whose
tokens taken in this phase divided by ``w[i]`` is least (ties: the lowest ``i``). Over any stretch
the datasets' tokens are then in the weights' proportions to within one document each (weighing by
documents would let a corpus of long documents dominate). A *schedule* changes the weights at
given token counts: phase ``p`` starts with the first document taken once ``bounds[p]`` tokens of
the whole run (epochs before included) have been taken; its counts start at 0.

Epochs: the mixed stream runs on across epochs (so does the schedule's token count). Epoch ``e``
holds the documents taken while the tokens taken before them are under ``(e + 1) *
tokens_per_epoch`` (default: the datasets' tokens together, one pass's worth), so it ends with
the document that crosses that count.

The stream is sequential (which dataset comes next depends on the lengths before it), so the
mixer's position is a small `MixCursor` (tokens taken, each stream's position, the phase and its
counts), recorded in a loader's state: a resume continues from it without replaying anything. An
epoch not reached yet (``set_epoch(n)`` from a fresh loader) is found by running the stream from
the start, reading lengths only (about a million documents a second).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gdsload.errors import StateError
from gdsload.plan.mix import _source_seed
from gdsload.plan.pack import DocOrder

_BLOCK = 512  # documents of one stream looked up at once


@dataclass(frozen=True)
class MixCursor:
    """Where the mixed stream stands before some document: tokens taken since the run's start,
    documents taken of each stream, the schedule's phase and the tokens each dataset gave in it."""

    total: int
    streams: tuple[int, ...]
    phase: int
    phase_tokens: tuple[int, ...]

    @classmethod
    def start(cls, k: int) -> MixCursor:
        return cls(0, (0,) * k, 0, (0,) * k)

    def to_json(self) -> dict[str, Any]:
        return {"total": self.total, "streams": list(self.streams), "phase": self.phase,
                "phase_tokens": list(self.phase_tokens)}

    @classmethod
    def from_json(cls, d: Any, k: int) -> MixCursor:
        def ints(v: Any, n: int | None) -> bool:
            return isinstance(v, list) and (n is None or len(v) == n) and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)

        if (not isinstance(d, Mapping) or not ints([d.get("total"), d.get("phase")], None)
                or not ints(d.get("streams"), k) or not ints(d.get("phase_tokens"), k)):
            raise StateError(f"state field 'mix_cursor' is malformed (expected total, phase and {k} streams "
                             f"and phase_tokens, ints >= 0), got {d!r}")
        return cls(d["total"], tuple(d["streams"]), d["phase"], tuple(d["phase_tokens"]))


class TokenMix:
    """The mixed document stream of `k` datasets (module docstring).

    `docs_per_shard[i]`: dataset i's documents per shard; `offsets[i]`: the global id of its first
    document; `phases`: ``[(bound, weights), ...]`` with bound 0 first, increasing;
    `lengths(global ids)`: tokens of each document (end of document included)."""

    def __init__(self, *, docs_per_shard: Sequence[Sequence[int]], offsets: Sequence[int],
                 phases: Sequence[tuple[int, Sequence[float]]], seed: int, shuffle: bool, window: int,
                 tokens_per_epoch: int, lengths: Callable[[np.ndarray], np.ndarray]):
        self.k = len(docs_per_shard)
        self._sizes = [tuple(int(n) for n in d) for d in docs_per_shard]
        self._n = [sum(s) for s in self._sizes]
        self._offsets = [int(o) for o in offsets]
        self._bounds = [int(b) for b, _ in phases]
        self._weights = [tuple(float(w) for w in ws) for _, ws in phases]
        if self._bounds[0] != 0 or any(b >= c for b, c in zip(self._bounds, self._bounds[1:])):
            raise ValueError(f"phase bounds must start at 0 and increase, got {self._bounds}")
        self.seed, self.shuffle, self.window = seed, shuffle, window
        self.tokens_per_epoch = int(tokens_per_epoch)
        if self.tokens_per_epoch < 1:
            raise ValueError("tokens_per_epoch must be >= 1")
        self._lengths = lengths
        self._orders: dict[tuple[int, int], DocOrder] = {}
        self._starts: dict[int, MixCursor] = {0: MixCursor.start(self.k)}

    def _ids(self, i: int, start: int, count: int) -> np.ndarray:
        """Global ids of dataset i's stream positions ``start .. start+count`` (within one own epoch
        or across)."""
        n = self._n[i]
        out = np.empty(count, np.int64)
        j = 0
        while j < count:
            e, local = divmod(start + j, n)
            take = min(count - j, n - local)
            key = (i, e)
            order = self._orders.get(key)
            if order is None:
                order = DocOrder(self._sizes[i], seed=_source_seed(self.seed, i), epoch=e, shuffle=self.shuffle,
                                 window=self.window)
                if len(self._orders) > 4 * self.k:
                    self._orders.clear()
                self._orders[key] = order
            out[j:j + take] = order.at(np.arange(local, local + take, dtype=np.int64)) + self._offsets[i]
            j += take
        return out

    def epoch(self, epoch: int, start: MixCursor | None = None, base: int = 0) -> MixedEpoch:
        """Epoch `epoch` from `base` (an epoch position) where the stream stands at `start`
        (None: the epoch's start, `base` 0, found by running the epochs before it)."""
        if start is None:
            start, base = self.epoch_start(epoch), 0
        return MixedEpoch(self, epoch, start, base)

    def epoch_start(self, epoch: int) -> MixCursor:
        """The cursor at the start of `epoch` (runs the stream from the last epoch start known)."""
        e = max(k for k in self._starts if k <= epoch)
        while e < epoch:
            self._starts[e + 1] = MixedEpoch(self, e, self._starts[e], 0).run_to_end()
            e += 1
        return self._starts[epoch]

    def remember_start(self, epoch: int, cursor: MixCursor) -> None:
        self._starts[epoch] = cursor


class MixedEpoch:
    """One epoch of the mixed stream from position `base` on: `at(positions)` (global ids),
    `lengths(positions)` (cut at the epoch's end: fewer are returned), `cursor(position)` (the
    stream before that position, for a state). Positions before `forget`'s are dropped."""

    def __init__(self, mix: TokenMix, epoch: int, start: MixCursor, base: int):
        self.mix, self.epoch = mix, epoch
        self._limit = (epoch + 1) * mix.tokens_per_epoch
        self._base = base
        self._ids: list[int] = []
        self._lens: list[int] = []
        self._cursors: list[MixCursor] = [start]  # cursor before base + j
        self.end: int | None = None
        self._bufs: list[tuple[int, np.ndarray, np.ndarray]] = [(s, np.zeros(0, np.int64), np.zeros(0, np.int64))
                                                                 for s in start.streams]

    def _next_of(self, i: int, j: int) -> tuple[int, int]:
        start, ids, lens = self._bufs[i]
        if not start <= j < start + len(ids):
            ids = self.mix._ids(i, j, _BLOCK)
            lens = np.asarray(self.mix._lengths(ids), np.int64)
            start = j
            self._bufs[i] = (start, ids, lens)
        return int(ids[j - start]), int(lens[j - start])

    def _grow(self, upto: int) -> None:
        """Take documents until position `upto` is known or the epoch ends."""
        mix = self.mix
        while self.end is None and self._base + len(self._ids) <= upto:
            c = self._cursors[-1]
            if c.total >= self._limit:
                self.end = self._base + len(self._ids)
                break
            phase, tokens = c.phase, c.phase_tokens
            p = bisect.bisect_right(mix._bounds, c.total) - 1
            if p != phase:
                phase, tokens = p, (0,) * mix.k
            w = mix._weights[phase]
            best, key = -1, 0.0
            for i in range(mix.k):
                if w[i] > 0:
                    v = tokens[i] / w[i]
                    if best < 0 or v < key:
                        best, key = i, v
            doc, n = self._next_of(best, c.streams[best])
            streams = list(c.streams)
            streams[best] += 1
            tk = list(tokens)
            tk[best] += n
            self._ids.append(doc)
            self._lens.append(n)
            self._cursors.append(MixCursor(c.total + n, tuple(streams), phase, tuple(tk)))

    def _index(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, np.int64)
        if len(positions) and positions.min() < self._base:
            raise ValueError(f"position {int(positions.min())} was forgotten (kept from {self._base})")
        return positions - self._base

    def at(self, positions: np.ndarray) -> np.ndarray:
        idx = self._index(positions)
        if len(idx):
            self._grow(int(positions.max()))
        return np.asarray(self._ids, np.int64)[idx] if len(idx) else np.zeros(0, np.int64)

    def lengths(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, np.int64)
        if not len(positions):
            return np.zeros(0, np.int64)
        self._grow(int(positions.max()))
        if self.end is not None:
            positions = positions[positions < self.end]
        return np.asarray(self._lens, np.int64)[self._index(positions)]

    def cursor(self, position: int) -> MixCursor:
        self._grow(position - 1)
        return self._cursors[position - self._base]

    def forget(self, before: int) -> None:
        """Drop what is kept of the positions before `before`."""
        cut = before - self._base
        if cut > 4096 and cut > len(self._ids) // 2:
            del self._ids[:cut], self._lens[:cut], self._cursors[:cut]
            self._base = before

    def run_to_end(self) -> MixCursor:
        """The cursor after the epoch's last document."""
        while self.end is None:
            self._grow(self._base + len(self._ids) + 4096)
            self.forget(self._base + len(self._ids))
        return self._cursors[self.end - self._base]
