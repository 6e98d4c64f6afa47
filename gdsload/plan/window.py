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
A position costs, per call, a binary search over the segments (increasing positions: each round's
positions are one run, its values spread by `np.repeat`; others are sorted first and put back),
two keyed bijections and, per round touched, O(min(w, S)) for the round's list (rounds hold about
``min(w, S)`` samples or more when shards are of similar sizes; a few large shards among many
tiny ones with a large window make rounds of few samples, and that cost per sample). Where the
whole permutations of the touched rounds and shards cost about what the positions do (consecutive
positions: `PlanBatches`' chunks), they are computed as tables in one network pass
(`gdsload.plan.permute.permutation_tables`), else per position; either gives the same ids, those
of the first implementation (`tests/plan/test_order2_frozen.py` keeps a copy of it).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from gdsload.plan.pcg import raw_words
from gdsload.plan.permute import permutation_tables, permute_grouped, subkeys, table_sizes

__all__ = ["WindowOrder", "sizes_key"]

_DOMAIN = 0x706C616E  # "plan", as order 1; the version number (2) follows it in the seed
_CELLS = 1 << 22  # most (rounds x window) cells one group of positions lays out at once
_POSITIONS = 1 << 18  # most positions evaluated at once (their arrays, a few tables of about as many)
_TABLE_ENTRIES = 32768  # whole permutations of up to this many entries (plus 2 per position) a call


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
        if len(flat) > 1 and not (flat[1:] >= flat[:-1]).all():  # evaluated in order, put back
            sort = np.argsort(flat, kind="stable")
            out = np.empty(flat.shape, np.int64)
            out[sort] = self._ordered(flat[sort])
            return out.reshape(positions.shape)
        return self._ordered(flat).reshape(positions.shape)

    def _ordered(self, flat: np.ndarray) -> np.ndarray:
        """`at` of increasing positions (repeats allowed): each round's positions are one run, so
        per-round values spread by `np.repeat`, not by searches or sorts."""
        m = len(flat)
        if not m:
            return np.empty(0, np.int64)
        s0, s1 = np.searchsorted(self.seg_pos, flat[[0, -1]], side="right") - 1
        if s0 == s1:  # one segment of equal rounds (most calls): scalars
            size = self.seg_size[s0]
            k, offset = np.divmod(flat - self.seg_pos[s0], size)
            rounds = np.add(k, self.seg_round[s0], out=k)
        else:
            ends = np.searchsorted(flat, self.seg_pos[s0 + 1:s1 + 1])
            per_seg = np.diff(ends, prepend=0, append=m)
            k, offset = np.divmod(flat - np.repeat(self.seg_pos[s0:s1 + 1], per_seg),
                                  np.repeat(self.seg_size[s0:s1 + 1], per_seg))
            rounds = np.add(k, np.repeat(self.seg_round[s0:s1 + 1], per_seg), out=k)
        starts = np.flatnonzero(rounds[1:] != rounds[:-1])
        starts += 1
        starts = np.concatenate(([0], starts, [m]))
        width = min(self.window, self.places)
        per_group = max(1, _CELLS // width)  # rounds laid out together: their lists cost R x width
        runs = len(starts) - 1
        if runs <= per_group and m <= _POSITIONS:
            return self._in_rounds(rounds, offset, starts, width)
        out = np.empty(m, np.int64)
        g = 0
        while g < runs:  # whole rounds, at most per_group of them and _POSITIONS positions (or one round)
            end = min(g + per_group, max(g + 1, int(np.searchsorted(starts, starts[g] + _POSITIONS, "right")) - 1))
            part = starts[g:end + 1]
            a, b = part[0], part[-1]
            out[a:b] = self._in_rounds(rounds[a:b], offset[a:b], part - a, width)
            g = end
        return out

    def _in_rounds(self, rounds: np.ndarray, offset: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
        """The ids of positions in runs of rounds (run ``g``: elements ``starts[g]:starts[g + 1]``,
        round `rounds` there, member `offset` of it before its bijection ``pi_r``)."""
        w, S, m = self.window, self.places, len(rounds)
        counts = np.diff(starts)
        touched = rounds[starts[:-1]]
        # the round's canonical list: t ascending (place r - t), each ceil((n_p - t) / w) members;
        # the places of round r are those with 0 <= t < w and 0 <= r - t < S, at most `width`
        t_low = np.maximum(touched - (S - 1), 0)
        t = t_low[:, None] + np.arange(width, dtype=np.int64)[None, :]
        place = touched[:, None] - t
        valid = (place >= 0) & (t < w)
        n = self.counts[self.place_shard[np.clip(place, 0, S - 1)]]
        take = np.where(valid, np.maximum((n - t + w - 1) // w, 0), 0)
        ends = np.cumsum(take, axis=1)
        # the places these rounds draw from: a range (per place there, if no longer than the
        # positions; else per position)
        low, high = max(int(touched[0] - t_low[0]) - width + 1, 0), min(int(touched[-1] - t_low[-1]), S - 1)
        shards = self.place_shard[low:high + 1] if high - low + 1 <= m else None
        member, sigma = self._bijections(offset, counts, touched, ends[:, -1], shards)
        # the member's place in the list: col = how many of its round's list ends are <= member
        row_start = np.repeat(np.arange(0, len(touched) * width, width, dtype=np.int64), counts)
        if width <= 8:
            col = np.zeros(m, np.int64)
            for c in range(width - 1):
                np.add(col, member >= np.repeat(ends[:, c], counts), out=col)
            cell = col + row_start
        else:
            stride = int(ends[:, -1].max()) + 1
            flat_ends = (ends + (np.arange(len(touched), dtype=np.int64) * stride)[:, None]).ravel()
            cell = np.searchsorted(flat_ends, member + np.repeat(np.arange(len(touched)) * stride, counts),
                                   side="right")
            col = cell - row_start
        i = member - (ends - take).ravel()[cell]
        tt = np.repeat(t_low, counts) + col
        where = rounds - tt  # the sample's place; j, its rank in the shard's dealing
        j = np.multiply(i, w, out=i)
        j += tt
        if shards is None:
            shard = self.place_shard[where]
            ids = permute_grouped(j, self.counts[shard], subkeys(self.sample_key, shard))
            ids += self.first[shard]
            return ids
        where -= low
        return sigma(j, where)

    def _bijections(self, offset: np.ndarray, counts: np.ndarray, touched: np.ndarray, size: np.ndarray,
                    shards: np.ndarray | None) -> tuple[np.ndarray, Any]:
        """``pi_r(offset)`` for the runs of rounds `touched` (`counts` positions each, `size`
        members), and ``sigma(j, place)`` giving ``first[shard] + sigma_shard(j)`` for the shards
        `shards` (by place in that range): by whole tables where they cost at most about what
        the positions do (`permutation_tables`), else per position."""
        m, R = len(offset), len(touched)
        n = size if shards is None else np.concatenate((size, self.counts[shards]))
        which = np.concatenate((touched, shards)) if shards is not None else touched
        key = np.full(len(which), self.round_key, np.uint64)
        key[R:] = self.sample_key
        keys = subkeys(key, which)
        entries = table_sizes(n)
        budget = _TABLE_ENTRIES + 2 * m
        by_rounds = int(entries[:R].sum()) <= budget
        by_places = shards is not None and int(entries[R:].sum()) <= budget
        tabled = slice(0 if by_rounds else R, len(n) if by_places else R)
        offsets, table = (permutation_tables(n[tabled], keys[tabled], entries[tabled])
                          if by_rounds or by_places else (None, None))
        if by_rounds:
            member = table[np.repeat(offsets[:R], counts) + offset]
        else:
            member = permute_grouped(offset, size, keys[:R], counts=counts)
        if shards is None:
            return member, None
        first = self.first[shards]
        if by_places:
            at = offsets[-len(shards):]
            return member, lambda j, place: table[at[place] + j] + first[place]
        return member, lambda j, place: permute_grouped(j, n[R:], keys[R:], index=place) + first[place]
