"""Order 2 of one dataset: the window shuffle as a function of the position, computed where asked.

The scheme is order 1's (`gdsload.plan.plan`, invariant 3), with its two sorts replaced by keyed
bijections (`gdsload.plan.permute`), so that the sample at a position is computed from the
position alone, with memory O(shards), never O(samples):

* Places: the non-empty shards in a random order (PCG64 raw words from
  ``SeedSequence([seed, epoch, 0x706C616E, 2])``, stably sorted: an O(S) sort per epoch). Empty
  shards take no place. ``w = min(window, largest shard)``: a window over the largest shard deals
  exactly as one of that size.
* Dealing: the shard at place ``p`` (``n_p`` samples) takes its samples in the order of the
  keyed bijection ``sigma_shard`` of ``[0, n_p)``; its ``j``-th goes to round ``p + (j mod w)``.
  Round ``r`` therefore holds, for ``t`` with place ``p = r - t`` (``0 <= t < w``), the
  ``j = t + w*i < n_p``: ``ceil((n_p - t) / w)`` samples of that place.
* Emitting: rounds in order; position ``o`` of round ``r`` shows member ``pi_r(o)`` of the
  round's canonical list (``t`` ascending, then ``i``), ``pi_r`` the keyed bijection of
  ``[0, size_r)``.

Round sizes change only where a place starts or stops dealing (rounds ``p``, ``p + n_p mod w``,
``p + w``), so the rounds are kept as at most ``3S`` segments of equal-sized rounds (their first
round, size and first position), whatever the window: memory O(S), about 100 bytes per shard at
most (equal shards: a few segments plus 24 bytes per shard). So invariants 3a and 3b hold as in
order 1 (at most ``w`` shards open at any position; any ``min(shard_sizes)`` consecutive positions
draw from at most ``w + 1`` shards), and 3c (``window=1``: shards one after another, shuffled
within); a window of at least the shard size with equal shards puts every shard in most rounds.
A position costs a binary search over the segments, two keyed bijections and, per round touched,
O(min(w, S)) for the round's list (rounds hold about ``min(w, S)`` samples or more when shards
are of similar sizes; a few large shards among many tiny ones with a large window make rounds
of few samples, and that cost per sample).
"""

from __future__ import annotations

import hashlib

import numpy as np

from gdsload.plan.pcg import raw_words
from gdsload.plan.permute import permute, subkeys

__all__ = ["WindowOrder", "sizes_key"]

_DOMAIN = 0x706C616E  # "plan", as order 1; the version number (2) follows it in the seed
_CELLS = 1 << 22  # most (rounds x window) cells one group of positions lays out at once


def sizes_key(sizes: tuple[int, ...]) -> str:
    """A short identity of a shard-size tuple (cache keys: hashing the tuple itself per batch
    would cost O(shards) each time)."""
    raw = np.asarray(sizes, dtype=np.int64).tobytes()
    return f"{len(sizes)}:" + hashlib.blake2b(raw, digest_size=16).hexdigest()


class WindowOrder:
    """Order 2 of one epoch of a dataset: `at(positions)` gives the sample ids (module docstring).

    Immutable once built and safe to share between threads.
    """

    def __init__(self, sizes: tuple[int, ...], seed: int, epoch: int, shuffle: bool, window: int):
        counts = np.asarray(sizes, dtype=np.int64)
        self.total = int(counts.sum())
        self.shuffle = bool(shuffle) and self.total > 0
        if not self.shuffle:
            return
        self.counts = counts
        self.first = np.zeros(len(counts), np.int64)
        np.cumsum(counts[:-1], out=self.first[1:])
        shards = np.flatnonzero(counts)
        # NumPy's PCG64 words, computed without importing numpy.random for a few (`gdsload.plan.pcg`)
        words = raw_words([seed, epoch, _DOMAIN, 2], len(shards) + 2)
        self.round_key, self.sample_key = int(words[0]), int(words[1])
        self.place_shard = shards[np.argsort(words[2:], kind="stable")]
        n = counts[self.place_shard]
        S = self.places = len(shards)
        w = self.window = int(min(window, int(n.max())))
        # round sizes as segments: place p adds q + (rem > 0) from round p, drops the 1 at p + rem
        # (rem > 0) and q at p + w
        q, rem = n // w, n % w
        p = np.arange(S, dtype=np.int64)
        at = np.concatenate([p, (p + rem)[rem > 0], p + w])
        delta = np.concatenate([q + (rem > 0), -np.ones(int((rem > 0).sum()), np.int64), -q])
        rounds, where = np.unique(at, return_inverse=True)
        change = np.zeros(len(rounds), np.int64)
        np.add.at(change, where, delta)
        slope = np.cumsum(change)
        keep = np.concatenate(([True], slope[1:] != slope[:-1]))  # merge equal neighbours
        self.seg_round = rounds[keep]
        self.seg_size = slope[keep]
        lengths = np.diff(np.append(self.seg_round, S + w - 1))
        self.seg_pos = np.zeros(len(self.seg_round), np.int64)
        np.cumsum((lengths * self.seg_size)[:-1], out=self.seg_pos[1:])

    @property
    def nbytes(self) -> int:
        if not self.shuffle:
            return 0
        return sum(a.nbytes for a in (self.counts, self.first, self.place_shard, self.seg_round, self.seg_size,
                                      self.seg_pos))

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The sample ids at `positions` (int64 in ``[0, total)``; any shape, any order)."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return positions.copy()
        flat = positions.ravel()
        seg = np.searchsorted(self.seg_pos, flat, side="right") - 1
        size = self.seg_size[seg]
        k, offset = np.divmod(flat - self.seg_pos[seg], size)
        rounds = self.seg_round[seg] + k
        out = np.empty(flat.shape, np.int64)
        sort = np.argsort(rounds, kind="stable")
        touched, first_of = np.unique(rounds[sort], return_index=True)
        width = min(self.window, self.places)
        per_group = max(1, _CELLS // width)
        for g in range(0, len(touched), per_group):
            lo = first_of[g]
            hi = first_of[g + per_group] if g + per_group < len(touched) else len(sort)
            sel = sort[lo:hi]
            out[sel] = self._in_rounds(touched[g:g + per_group], rounds[sel], offset[sel], size[sel], width)
        return out.reshape(positions.shape)

    def _in_rounds(self, touched: np.ndarray, rounds: np.ndarray, offset: np.ndarray, size: np.ndarray,
                   width: int) -> np.ndarray:
        w, S = self.window, self.places
        member = permute(offset, size, subkeys(self.round_key, rounds))
        # the round's canonical list: t ascending (place r - t), each ceil((n_p - t) / w) members;
        # the places of round r are those with 0 <= t < w and 0 <= r - t < S, at most `width`
        t_low = np.maximum(touched - (S - 1), 0)
        t = t_low[:, None] + np.arange(width, dtype=np.int64)[None, :]
        place = touched[:, None] - t
        valid = (place >= 0) & (t < w)
        n = self.counts[self.place_shard[np.clip(place, 0, S - 1)]]
        take = np.where(valid, np.maximum((n - t + w - 1) // w, 0), 0)
        ends = np.cumsum(take, axis=1)
        row = np.searchsorted(touched, rounds)
        stride = int(ends[:, -1].max()) + 1
        flat_ends = (ends + (np.arange(len(touched), dtype=np.int64) * stride)[:, None]).ravel()
        col = np.searchsorted(flat_ends, member + row * stride, side="right") - row * width
        i = member - (ends[row, col] - take[row, col])
        tt = t_low[row] + col
        shard = self.place_shard[rounds - tt]
        j = tt + w * i
        return self.first[shard] + permute(j, self.counts[shard], subkeys(self.sample_key, shard))
