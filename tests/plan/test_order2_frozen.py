"""Order 2's fast evaluation (`gdsload.plan.window`, `gdsload.plan.permute`) against a frozen copy
of the algorithm as first written (commit 45b4d30): order 2 is part of the format of resumption (a
state saved by an older version must resume the same order), so every sample id and every
``permute`` value must stay bit-identical whatever the implementation does to be cheaper.

The reference below is that code, unchanged but for its names (``ref_`` / ``Ref``); do not edit
it to follow the library."""

from __future__ import annotations

import numpy as np
import pytest

from gdsload.plan import window as window_module
from gdsload.plan.pcg import raw_words
from gdsload.plan.permute import mix64, permute, subkeys
from gdsload.plan.plan import Plan
from gdsload.plan.window import WindowOrder

# --- the frozen reference ----------------------------------------------------------------------

_DOMAIN = 0x706C616E
_CELLS = 1 << 22
ROUNDS = 6
SMALL = 32
_SMALL_STEP = np.uint64(0xD1B54A32D192ED03)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def ref_mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on a uint64 array (a bijection of 64-bit words)."""
    z = np.asarray(z, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def ref_subkeys(key: int | np.uint64, index: np.ndarray) -> np.ndarray:
    """Independent-looking 64-bit keys, one per `index` (int64 >= 0), derived from `key`."""
    index = np.asarray(index, dtype=np.int64).astype(np.uint64)
    return ref_mix64(ref_mix64(index * _GOLDEN + np.uint64(key)) ^ np.uint64(key))


def _bit_length(v: np.ndarray) -> np.ndarray:
    """Exact bit lengths of int64 values >= 0 (no float rounding)."""
    v = v.copy()
    bits = np.zeros(v.shape, np.int64)
    for s in (32, 16, 8, 4, 2, 1):
        big = v >= (1 << s)
        bits += big * s
        v = np.where(big, v >> s, v)
    return bits + (v > 0)


def _round(v: np.ndarray, k: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """``F_i(v)``: the top ``64 - shift`` bits of a multiply-xorshift-multiply hash of ``v ^ k``."""
    z = (v ^ k) * _M1
    z = (z ^ (z >> np.uint64(32))) * _M2
    return z >> shift


def _feistel(x: np.ndarray, high: np.ndarray, low: np.ndarray, keys: list[np.ndarray]) -> np.ndarray:
    hi_mask = (np.uint64(1) << high) - np.uint64(1)
    lo_mask = (np.uint64(1) << low) - np.uint64(1)
    hi_shift = np.uint64(64) - np.maximum(high, np.uint64(1))
    lo_shift = np.uint64(64) - np.maximum(low, np.uint64(1))
    h, lo = x >> low, x & lo_mask
    for i, k in enumerate(keys):
        if i % 2 == 0:
            h = h ^ (_round(lo, k, hi_shift) & hi_mask)
        else:
            lo = lo ^ (_round(h, k, lo_shift) & lo_mask)
    return (h << low) | lo


def _ranks(x: np.ndarray, n: np.ndarray, base: np.ndarray) -> np.ndarray:
    """``pi(x)`` for ``n <= SMALL``: the rank of ``h(x)`` among ``h(0..n-1)``, ties by index."""
    j = np.arange(SMALL, dtype=np.uint64)
    h = ref_mix64(base[:, None] ^ ((j + np.uint64(1)) * _SMALL_STEP)[None, :])
    h = np.where(j[None, :] < n[:, None].astype(np.uint64), h, np.uint64(2**64 - 1))
    mine = h[np.arange(len(x)), x][:, None]
    before = (h < mine) | ((h == mine) & (j[None, :] < x[:, None].astype(np.uint64)))
    return before.sum(axis=1).astype(np.int64)


def ref_permute(x: np.ndarray, n: np.ndarray | int, key: np.ndarray | int) -> np.ndarray:
    """``pi_key(x)`` for the permutation ``pi_key`` of ``[0, n)`` (module docstring); int64.

    `x` must lie in ``[0, n)`` (not checked here: callers compute it); `n` up to ``2**62``.
    """
    x, n, key = np.broadcast_arrays(np.asarray(x, np.int64), np.asarray(n, np.int64),
                                    np.asarray(key).astype(np.uint64))
    shape = x.shape
    x, n, key = x.ravel(), n.ravel(), key.ravel()
    out = x.copy()
    small = np.flatnonzero((n > 1) & (n <= SMALL))
    if len(small):
        out[small] = _ranks(x[small], n[small], ref_mix64(key[small]))
    todo = np.flatnonzero(n > SMALL)
    if not len(todo):
        return out.reshape(shape)
    bits = _bit_length(n[todo] - 1).astype(np.uint64)
    high = (bits + np.uint64(1)) >> np.uint64(1)
    low = bits >> np.uint64(1)
    base = ref_mix64(key[todo])
    keys = [ref_mix64(base ^ np.uint64((i + 1) * int(_GOLDEN) % 2**64)) for i in range(ROUNDS)]
    value = _feistel(x[todo].astype(np.uint64), high, low, keys)
    limit = n[todo].astype(np.uint64)
    while True:
        walk = np.flatnonzero(value >= limit)
        if not len(walk):
            break
        value[walk] = _feistel(value[walk], high[walk], low[walk], [k[walk] for k in keys])
    out[todo] = value.astype(np.int64)
    return out.reshape(shape)


class RefWindowOrder:
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
        member = ref_permute(offset, size, ref_subkeys(self.round_key, rounds))
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
        return self.first[shard] + ref_permute(j, self.counts[shard], ref_subkeys(self.sample_key, shard))


# --- the comparisons -----------------------------------------------------------------------------

EDGE_SIZES = [0, 1, 2, 3, 5, 31, 32, 33, 34, 63, 64, 65, 100, 127, 128, 129, 1000, 4095, 4097,
              2**20 + 1, 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3, 2**62 - 1, 2**62]


def test_mix64_and_subkeys_are_unchanged():
    rng = np.random.default_rng(1)
    z = rng.integers(0, 2**63, 5000, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, 5000, dtype=np.uint64)
    assert np.array_equal(mix64(z), ref_mix64(z))
    for key in (0, 1, 2**63, 2**64 - 1, int(rng.integers(0, 2**63))):
        idx = rng.integers(0, 2**40, 3000)
        assert np.array_equal(subkeys(key, idx), ref_subkeys(key, idx))


def test_permute_is_unchanged_one_size_and_key():
    rng = np.random.default_rng(2)
    for n in EDGE_SIZES:
        for key in (0, 5, 2**64 - 1, int(rng.integers(0, 2**64, dtype=np.uint64))):
            x = np.arange(n) if n <= 5000 else rng.integers(0, n, 5000)
            assert np.array_equal(permute(x, n, key), ref_permute(x, n, key)), (n, key)
            if n:  # one element; a 2-D shape; numpy scalars
                assert permute(x[:1], n, np.uint64(key)).tolist() == ref_permute(x[:1], n, key).tolist()
                two = x[: (len(x) // 2) * 2].reshape(2, -1)
                assert np.array_equal(permute(two, np.int64(n), key), ref_permute(two, n, key))


def test_permute_is_unchanged_per_element_sizes_and_keys():
    rng = np.random.default_rng(3)
    for trial in range(40):
        m = int(rng.integers(1, 3000))
        pick = rng.integers(0, 4)
        if pick == 0:  # tiny sizes only (the ranks)
            n = rng.integers(0, 33, m)
        elif pick == 1:  # mixed tiny and network, a few bit lengths
            n = rng.choice(np.array([0, 1, 2, 7, 32, 33, 40, 64, 65, 1000, 5000]), m)
        elif pick == 2:
            n = rng.integers(33, 2**rng.integers(7, 62), m)
        else:
            n = np.full(m, int(rng.integers(33, 10**6)))
        x = (rng.random(m) * n).astype(np.int64)
        keys = rng.integers(0, 2**64, m, dtype=np.uint64) if trial % 3 else np.uint64(trial)
        assert np.array_equal(permute(x, n, keys), ref_permute(x, n, keys)), trial
    # broadcasting: one size, keys per element; keys per row of a 2-D x
    x = np.arange(40).reshape(4, 10)
    k = np.arange(4, dtype=np.uint64)[:, None]
    assert np.array_equal(permute(x, 40, k), ref_permute(x, 40, k))
    assert np.array_equal(permute(x % 7, 7, k), ref_permute(x % 7, 7, k))


def _cases(rng: np.random.Generator, count: int):
    """(sizes, seed, epoch, window): tiny shards (rounds and shards of <= 32: the ranks), empty
    shards, window 1, windows beyond the largest shard, many shards, a few large among tiny."""
    for c in range(count):
        kind = c % 6
        if kind == 0:
            sizes = rng.integers(0, 12, int(rng.integers(1, 9)))
        elif kind == 1:
            sizes = rng.integers(0, 60, int(rng.integers(1, 40)))
        elif kind == 2:
            sizes = rng.integers(100, 400, int(rng.integers(1, 30)))
        elif kind == 3:  # a few large among many tiny and empty
            sizes = np.where(rng.random(int(rng.integers(5, 80))) < 0.1, rng.integers(200, 3000, 1)[0],
                             rng.integers(0, 5, 1)[0])
        elif kind == 4:  # equal shards
            sizes = np.full(int(rng.integers(1, 50)), int(rng.integers(1, 300)))
        else:
            sizes = rng.integers(0, 2000, int(rng.integers(1, 12)))
        if sizes.sum() == 0:
            sizes[0] = 1
        window = int(rng.choice([1, 1, 2, 3, 4, 4, 7, 9, 16, 64, 10**6]))
        yield tuple(int(v) for v in sizes), int(rng.integers(0, 2**40)), int(rng.integers(0, 6)), window


def _positions(rng: np.random.Generator, total: int):
    """Whole epochs, increasing runs and gaps (a stream's strided blocks), ranks' strides, random
    orders with repeats, reversed, wrapped padding, 2-D, one position, none."""
    everything = np.arange(total, dtype=np.int64)
    yield everything
    a = int(rng.integers(0, total))
    yield everything[a:a + int(rng.integers(1, 9000))]
    yield everything[int(rng.integers(0, 4))::int(rng.integers(2, 9))]
    blocks = (np.arange(0, total, 96)[::3, None] + np.arange(32)[None, :]).ravel()
    yield blocks[blocks < total]
    yield rng.integers(0, total, int(rng.integers(1, 3000)))
    yield everything[::-1]
    yield (np.arange(total - 5, total + 40) % total)
    yield np.array([a])
    yield np.zeros(0, np.int64)
    if total >= 6:
        yield everything[: (total // 6) * 6].reshape(-1, 6)


def test_order_2_is_unchanged_against_the_frozen_copy():
    rng = np.random.default_rng(4)
    for sizes, seed, epoch, window in _cases(rng, 240):
        new, old = WindowOrder(sizes, seed, epoch, True, window), RefWindowOrder(sizes, seed, epoch, True, window)
        for positions in _positions(rng, sum(sizes)):
            got, want = new.at(positions), old.at(positions)
            assert got.shape == want.shape and got.dtype == want.dtype
            assert np.array_equal(got, want), (sizes, seed, epoch, window, positions[:10])


def test_unshuffled_and_empty_orders_are_unchanged():
    for sizes, shuffle in [((3, 0, 5), False), ((0, 0), True), ((0,), False), ((4,), True), ((1,), True)]:
        new, old = WindowOrder(sizes, 1, 0, shuffle, 4), RefWindowOrder(sizes, 1, 0, shuffle, 4)
        positions = np.arange(sum(sizes))
        assert np.array_equal(new.at(positions), old.at(positions))


@pytest.mark.parametrize(("cells", "positions"), [(1, 1 << 18), (5, 7), (64, 100), (1 << 22, 1)])
def test_groups_of_rounds_give_the_same_ids(monkeypatch, cells, positions):
    # a handful of rounds or positions per group (a round alone past the limit), also when the
    # positions are unordered or far apart
    monkeypatch.setattr(window_module, "_CELLS", cells)
    monkeypatch.setattr(window_module, "_POSITIONS", positions)
    rng = np.random.default_rng(cells)
    for sizes, seed, epoch, window in _cases(rng, 30):
        new, old = WindowOrder(sizes, seed, epoch, True, window), RefWindowOrder(sizes, seed, epoch, True, window)
        for positions in _positions(rng, sum(sizes)):
            assert np.array_equal(new.at(positions), old.at(positions)), (sizes, window)


def test_a_plan_far_into_a_large_epoch_is_unchanged():
    # 10^10 samples: a batch's positions deep in the epoch, strided ranks, blocks far apart
    sizes = (10**6,) * 10**4
    new, old = WindowOrder(sizes, 7, 3, True, 4), RefWindowOrder(sizes, 7, 3, True, 4)
    start = 123_456_789 * 32
    for positions in (np.arange(start, start + 8192), np.arange(start + 1, start + 8 * 8192, 8),
                      np.array([5, 10**10 - 1, 4 * 10**9, 17]), np.arange(10**10 - 500, 10**10)):
        assert np.array_equal(new.at(positions), old.at(positions))
    wide = (10**6,) * 300 + (3,) * 50  # a window over every shard: rounds of ~350 places
    new, old = WindowOrder(wide, 1, 0, True, 10**9), RefWindowOrder(wide, 1, 0, True, 10**9)
    for positions in (np.arange(10**8, 10**8 + 8192), np.arange(sum(wide) - 3000, sum(wide))):
        assert np.array_equal(new.at(positions), old.at(positions))


def test_plan_batches_are_unchanged():
    # the plan's chunks (world 3, padded and dropped) against the frozen order at their positions
    sizes = (150, 0, 149, 7, 160, 145, 1, 152) * 4
    for drop_last in (False, True):
        plan = Plan("ds", sizes, 32, world_size=3, rank=2, shuffle=True, seed=9, window=4, drop_last=drop_last,
                    order=2)
        old = RefWindowOrder(sizes, 9, 1, True, 4)
        positions = np.arange(plan.rank, plan._used_positions(), plan.world_size) % plan.num_samples
        want = old.at(positions)
        got = np.concatenate(list(plan.batches(1)))
        assert np.array_equal(got, want[: len(got)])


def test_whole_tables_and_groups_match_the_frozen_permute():
    from gdsload.plan.permute import permutation_tables, permute_grouped

    rng = np.random.default_rng(5)
    for trial in range(30):  # sizes of one and of several bit lengths, tiny, one, empty; few and many entries
        g = int(rng.integers(1, 40))
        n = rng.choice(np.array([0, 1, 2, 5, 32, 33, 64, 65, 100, 129, 255, 256, 257, 1000, 3000, 9000]), g)
        if trial % 3 == 0:
            n = np.full(g, int(rng.integers(33, 5000)))
        key = rng.integers(0, 2**64, g, dtype=np.uint64)
        offset, table = permutation_tables(n, key)
        for k in range(g):
            if n[k]:
                whole = np.arange(n[k])
                assert np.array_equal(table[offset[k] + whole], ref_permute(whole, int(n[k]), key[k])), (n[k], trial)
        nz = np.flatnonzero(n)
        if not len(nz):
            continue
        index = rng.choice(nz, 2000)  # elements of given groups, any order
        x = (rng.random(2000) * n[index]).astype(np.int64)
        want = ref_permute(x, n[index], key[index])
        assert np.array_equal(permute_grouped(x, n, key, index=index), want)
        order = np.argsort(index, kind="stable")  # the same elements as runs of groups
        counts = np.bincount(index, minlength=g)
        assert np.array_equal(permute_grouped(x[order], n, key, counts=counts), want[order])
