"""Order 2 of a mix: which dataset each position of an epoch reads, and which of its samples,
computed per block of positions, with memory O(datasets + shards + block), never O(samples).

Given per dataset ``i`` its count ``c_i`` of *units* in the epoch (`MixSpec.units`; a unit is
a sample, or a global batch with ``mix_by="batch"``; ``K = sum(c_i)`` units):

1. Cumulative counts. Before unit ``x`` of the epoch, dataset ``i`` has had ``C_i(x)`` units:
   the ``x`` smallest of the keys ``(j + 1/2) / c_i`` (``j < c_i``, all datasets together, ties to
   the lower dataset index) are ``C_i(x)`` of dataset ``i`` (Sainte-Laguë's sequential
   apportionment, the smooth interleave of order 1 without shuffle). `cumulative` computes it
   exactly from ``x`` alone (integer arithmetic, O(k log k)); ``C_i(K) = c_i``, and every
   ``C_i`` is nondecreasing, so the counts of any stretch are never negative and every stretch
   has the weights' proportions to within one unit per dataset.
2. Blocks. The epoch's units are cut into blocks of `BLOCK` units; block ``b`` holds
   ``C_i(end) - C_i(start)`` units of dataset ``i``. Within it the labels (dataset ``i`` repeated
   that often, in dataset order) are put in a random order with ``shuffle`` (PCG64 raw words of
   ``SeedSequence([seed, epoch, b, 0x6D6978, 2])``, stable sort), or without shuffle interleaved
   smoothly by the keys ``(m + 1/2) / n_i`` of the block's own counts (stable sort; exact in
   float64 at these sizes).
3. Streams. The ``m``-th unit of dataset ``i`` in epoch ``e`` (``m = C_i(block start) + its
   rank in the block``) covers positions ``(e * c_i + m) * unit + (0..unit-1)`` of the dataset's
   stream: its own epochs one after another, each its order 2 (`WindowOrder`, seeded from
   ``(seed, i)`` as in order 1). An own epoch is built when the stream reaches it (O(its shards)).

A batch costs the blocks it touches (cached: one block's labels and ranks, 10 bytes per unit,
about 0.7 MB) and its datasets' own orders at its positions. Weights enter only through the counts
``c_i``, so counts in other units (tokens) give the same machinery.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

__all__ = ["BLOCK", "MixOrder", "cumulative"]

BLOCK = 1 << 16  # units per block (part of order 2: changing it changes the order)
_DOMAIN = 0x6D6978  # "mix", as order 1
_BLOCKS_KEPT = 4


def cumulative(counts: Sequence[int], x: int) -> list[int]:
    """``C_i(x)`` for every dataset: how many of the first `x` units of the smooth interleave of
    `counts` are dataset ``i``'s (module docstring, step 1). Exact (Python integers)."""
    counts = [int(c) for c in counts]
    total = sum(counts)
    if not 0 <= x <= total:
        raise ValueError(f"x = {x} is outside 0..{total}")
    if x == total:
        return counts
    # every key below x / total: count of j with (2j + 1) * total < 2 * x * c
    took = [min(c, max(0, -((total - 2 * x * c) // (2 * total)))) for c in counts]
    have = sum(took)
    if have < x:  # add the smallest keys left, ties to the lower index
        heap = [(Fraction(2 * s + 1, 2 * c), i) for i, (s, c) in enumerate(zip(took, counts)) if s < c]
        heapq.heapify(heap)
        while have < x:
            _, i = heapq.heappop(heap)
            took[i] += 1
            have += 1
            if took[i] < counts[i]:
                heapq.heappush(heap, (Fraction(2 * took[i] + 1, 2 * counts[i]), i))
    elif have > x:  # drop the largest keys taken, ties to the higher index
        heap = [(-Fraction(2 * s - 1, 2 * c), -i) for i, (s, c) in enumerate(zip(took, counts)) if s > 0]
        heapq.heapify(heap)
        while have > x:
            _, neg = heapq.heappop(heap)
            i = -neg
            took[i] -= 1
            have -= 1
            if took[i] > 0:
                heapq.heappush(heap, (-Fraction(2 * took[i] - 1, 2 * counts[i]), -i))
    return took


class MixOrder:
    """Order 2 of one epoch of a mix: `at(positions)` gives global sample ids.

    `units`: per dataset, its units in the epoch; `unit`: samples per unit; `sources`: per dataset,
    a callable ``own(own_epoch) -> WindowOrder`` (cached by the caller) and its sample count and
    first global id. Thread-safe (a lock guards the block cache only).
    """

    def __init__(self, units: Sequence[int], unit: int, seed: int, epoch: int, shuffle: bool,
                 sources: Sequence[tuple]):
        self.units = [int(u) for u in units]
        self.unit, self.seed, self.epoch, self.shuffle = int(unit), int(seed), int(epoch), bool(shuffle)
        self.sources = list(sources)  # (own_order(e) callable, num_samples, offset)
        self.total_units = sum(self.units)
        self.num_samples = self.total_units * self.unit
        self._blocks: OrderedDict[int, tuple] = OrderedDict()
        self._lock = threading.Lock()

    nbytes = BLOCK * 10 * _BLOCKS_KEPT  # the most the block cache holds (labels and ranks)

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block `b`: per unit its dataset (uint16/int64) and rank among that dataset's units of
        the block, and per dataset its units before the block."""
        with self._lock:
            hit = self._blocks.get(b)
            if hit is not None:
                self._blocks.move_to_end(b)
                return hit
        start, stop = b * BLOCK, min((b + 1) * BLOCK, self.total_units)
        before = cumulative(self.units, start)
        n = np.subtract(cumulative(self.units, stop), before).astype(np.int64)
        k = len(self.units)
        labels = np.repeat(np.arange(k, dtype=np.uint16 if k < 2**16 else np.int64), n)
        if self.shuffle:
            words = np.random.PCG64(np.random.SeedSequence([self.seed, self.epoch, b, _DOMAIN, 2]))
            labels = labels[np.argsort(words.random_raw(len(labels)), kind="stable")]
        else:
            rank = np.arange(len(labels), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
            labels = labels[np.argsort((2 * rank + 1) / np.repeat(2 * n, n).astype(np.float64), kind="stable")]
        by_label = np.argsort(labels, kind="stable")
        ranks = np.empty(len(labels), np.int64)
        ranks[by_label] = np.arange(len(labels), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        out = (labels, ranks, np.asarray(before, np.int64))
        with self._lock:
            self._blocks[b] = out
            while len(self._blocks) > _BLOCKS_KEPT:
                self._blocks.popitem(last=False)
        return out

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The global sample ids at `positions` (int64 in ``[0, num_samples)``, any shape)."""
        positions = np.asarray(positions, dtype=np.int64)
        flat = positions.ravel()
        units, within = np.divmod(flat, self.unit)
        blocks = units // BLOCK
        label = np.empty(flat.shape, np.int64)
        m = np.empty(flat.shape, np.int64)
        for b in np.unique(blocks).tolist():
            sel = np.flatnonzero(blocks == b)
            labels, ranks, before = self._block(b)
            u = units[sel] - b * BLOCK
            label[sel] = labels[u]
            m[sel] = before[label[sel]] + ranks[u]
        out = np.empty(flat.shape, np.int64)
        for i in np.unique(label).tolist():
            sel = np.flatnonzero(label == i)
            own, n, offset = self.sources[i]
            # the epoch's first stream position, in Python integers (epochs go up to 2**64)
            base_epoch, base = divmod(self.epoch * self.units[i] * self.unit, n)
            own_epoch, place = np.divmod(base + m[sel] * self.unit + within[sel], n)
            ids = np.empty(len(sel), np.int64)
            for e in np.unique(own_epoch).tolist():
                at = np.flatnonzero(own_epoch == e)
                ids[at] = own(base_epoch + e).at(place[at])
            out[sel] = ids + offset
        return out.reshape(positions.shape)
