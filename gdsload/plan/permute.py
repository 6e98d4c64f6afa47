"""Keyed bijections of ``0..n-1`` evaluated only where asked: the shuffles of order 2.

`permute(x, n, key)` sends each ``x`` in ``[0, n)`` to ``pi(x)``, where ``pi`` is a permutation of
``[0, n)`` chosen by the 64-bit `key`; ``x``, ``n`` and ``key`` are arrays (broadcast together), so
one call evaluates many permutations of different sizes at once. Nothing of size ``n`` is built:
cost and memory are those of a few arrays the size of ``x``.

Construction (fixed: it is part of order 2, `gdsload.plan.plan`): an alternating Feistel network
on ``b`` bits, ``b`` the bit length of ``n - 1`` (so ``2**b < 2n``), split into a high part of
``ceil(b/2)`` bits and a low part of ``floor(b/2)``; `ROUNDS` rounds, even ones XOR the high part
with ``F_i(low)``, odd ones the low part with ``F_i(high)``, where ``F_i(v)`` is the top bits of
``((v ^ k_i) * M1 ^ ((v ^ k_i) * M1 >> 32)) * M2`` (64-bit wrapping multiplies by odd constants;
``k_i`` = splitmix64's finaliser of ``key + (i + 1) * 0x9E3779B97F4A7C15``). Each round is
invertible whatever ``F``, so the network is a bijection of ``[0, 2**b)``; a value that lands at
``n`` or beyond is sent through it again (cycle walking) until it lands below ``n``, which
restricts it to a bijection of ``[0, n)`` (fewer than 2 passes on average). Up to `SMALL`
elements, where so few round functions exist that a Feistel network is far from uniform (4 to 8
elements: 10-60 times the chi-square of a uniform draw), ``pi(x)`` is instead the rank of
``h(x)`` among ``h(0..n-1)`` (ties by index), ``h(j)`` splitmix64's finaliser of
``mix(key) ^ (j + 1) * 0xD1B54A32D192ED03``: a permutation as uniform as the hash. Only wrapping
uint64 arithmetic: the result depends on nothing but (x, n, key), never on NumPy's random
generators. ``n <= 1`` is the identity.

Evaluation (free to change, the values may not: `tests/plan/test_order2_frozen.py` holds the
algorithm as first written and compares): `permute_grouped` takes per-group sizes and keys and a
group per element, so what depends only on ``(n, key)`` (the six round keys, bit lengths, shifts,
masks, a small permutation's whole table) is computed once per group and gathered; order 2 asks
with groups of rounds and of shards. In the network ``F_i``'s top-bits shift already leaves fewer
bits than the part it XORs (both parts have 3 bits or more past `SMALL`), so no mask is applied
per round, and the rounds run in place.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ROUNDS", "mix64", "permutation_tables", "permute", "permute_grouped", "subkeys", "table_sizes"]

ROUNDS = 6
SMALL = 32  # up to this many elements, ranks of hashes instead of the network
_SMALL_STEP = np.uint64(0xD1B54A32D192ED03)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_STEPS = [np.uint64((i + 1) * int(_GOLDEN) % 2**64) for i in range(ROUNDS)]  # round i's key offset
_HASH_STEPS = (np.arange(SMALL, dtype=np.uint64) + np.uint64(1)) * _SMALL_STEP  # _ranks' (j + 1) * step
_ONES = np.uint64(2**64 - 1)
_STEP_COLUMN = np.array(_STEPS, np.uint64)[:, None]
_M1_INT, _M2_INT, _MASK64 = int(_M1), int(_M2), 2**64 - 1
_FEW = 8  # cycle walks left to this many elements: finished one by one in Python integers
_ONE_PASS = 8192  # whole tables up to this many entries: one network pass (few entries: calls cost)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on a uint64 array (a bijection of 64-bit words)."""
    z = np.asarray(z, dtype=np.uint64)
    t = z >> np.uint64(30)
    t ^= z
    t *= _M1
    z = t >> np.uint64(27)
    z ^= t
    z *= _M2
    t = z >> np.uint64(31)
    t ^= z
    return t


def subkeys(key: int | np.uint64 | np.ndarray, index: np.ndarray) -> np.ndarray:
    """Independent-looking 64-bit keys, one per `index` (int64 >= 0), derived from `key` (one
    key, or one per index)."""
    index = np.asarray(index, dtype=np.int64).astype(np.uint64)
    key = np.asarray(key).astype(np.uint64)
    index *= _GOLDEN
    index += key
    z = mix64(index)
    z ^= key
    return mix64(z)


def _bit_length(v: np.ndarray) -> np.ndarray:
    """Exact bit lengths of int64 values (0 for those <= 0; no float rounding)."""
    v = np.maximum(v, 0)
    if not len(v) or int(v.max()) < 2**53:  # exact in a double: its exponent
        return np.frexp(v.astype(np.float64))[1].astype(np.int64)
    bits = np.zeros(v.shape, np.int64)
    for s in (32, 16, 8, 4, 2, 1):
        big = v >= (1 << s)
        bits += big * s
        v = np.where(big, v >> s, v)
    return bits + (v > 0)


def table_sizes(n: np.ndarray) -> np.ndarray:
    """Entries of `permutation_tables` per group of `n` elements: ``2**b`` past `SMALL` (the
    network's domain, walked through), else ``n``."""
    n = np.asarray(n, np.int64)
    return np.where(n > SMALL, np.left_shift(1, _bit_length(n - 1)), np.maximum(n, 0))


def permutation_tables(n: np.ndarray, key: np.ndarray, size: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Whole permutations, one per group (`n` int64 and `key` uint64 per group; `size`, their
    `table_sizes` if known): ``(offset, table)`` with ``table[offset[g] + x] == permute(x, n[g],
    key[g])`` for ``x < n[g]``. A group past `SMALL` costs ``2**b < 2n`` network evaluations, one
    pass, its cycle walks then followed in the table: the cheaper way where most of a group's
    elements are asked (no pass per walk step over the few still walking)."""
    n, key = np.asarray(n, np.int64), np.asarray(key).astype(np.uint64)
    size = table_sizes(n) if size is None else size
    big, small, one = n > SMALL, (n > 1) & (n <= SMALL), n == 1
    if big.all():
        return _network_tables(n, key, size)
    offset = np.zeros(len(n), np.int64)
    parts = []  # the network's groups first, then the ranks', then the ones
    start = 0
    for kind in (big, small, one):
        which = np.flatnonzero(kind)
        if not len(which):
            continue
        if kind is big:
            local, table = _network_tables(n[which], key[which], size[which])
            offset[which] = start + local
        else:
            ends = np.cumsum(size[which])
            offset[which] = start + ends - size[which]
            table = _rank_tables(n[which], key[which]) if kind is small else np.zeros(len(which), np.int64)
        parts.append(table)
        start += len(table)
    table = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return offset, table


def _rank_tables(n: np.ndarray, key: np.ndarray) -> np.ndarray:
    """The permutations of 2..`SMALL` elements, whole and end to end: ranks of ``h(j)`` (module
    docstring; a stable sort breaks ties by index)."""
    h = mix64(mix64(key)[:, None] ^ _HASH_STEPS[None, :])
    inside = np.arange(SMALL)[None, :] < n[:, None]
    h[~inside] = _ONES
    order = np.argsort(h, axis=1, kind="stable")
    ranks = np.empty(order.shape, np.int64)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(SMALL, dtype=np.int64), order.shape), axis=1)
    return ranks[inside]


def _network_tables(n: np.ndarray, key: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(offset, table)``: the network on all ``2**b`` values of each group (past `SMALL`),
    each value below ``n`` then followed through the table until it lands below ``n`` (the cycle
    walk), group ``g``'s at ``offset[g]``. A bit length with at least half `_ONE_PASS` entries is
    a block of its own, a row per group (the keys broadcast along rows: less memory traffic than
    spreading them); the others go in one pass together, the keys spread per entry (one pass:
    its 50 calls once)."""
    bits = _bit_length(n - 1)
    total = int(size.sum())
    if total <= _ONE_PASS:
        return np.cumsum(size) - size, _one_pass(n, key, size, bits)
    lengths = sorted(set(bits.tolist()))
    blocks = [b for b in lengths if int((bits == b).sum()) << b >= _ONE_PASS // 2]
    if len(blocks) == 1 and len(lengths) == 1:
        return np.cumsum(size) - size, _block(n, key, blocks[0])
    offset = np.empty(len(n), np.int64)
    parts, start = [], 0
    rest = np.ones(len(n), bool)
    for b in blocks:
        which = bits == b
        rest &= ~which
        rows = np.flatnonzero(which)
        offset[rows] = start + (np.arange(len(rows), dtype=np.int64) << b)
        parts.append(_block(n[rows], key[rows], b))
        start += len(rows) << b
    rows = np.flatnonzero(rest)
    if len(rows):
        ends = np.cumsum(size[rows])
        offset[rows] = start + ends - size[rows]
        parts.append(_one_pass(n[rows], key[rows], size[rows], bits[rows]))
    return offset, np.concatenate(parts)


def _one_pass(n: np.ndarray, key: np.ndarray, size: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """`_network_tables` of groups of any bit lengths in one pass, keys and shifts per entry."""
    keys, shape = _network_keys(bits, key)
    total = int(size.sum())
    first = np.repeat(np.cumsum(size) - size, size)
    local = np.arange(total, dtype=np.int64)
    local -= first
    if np.ndim(shape[0]):
        shape = [np.repeat(a, size) for a in shape]
    value = _feistel(local.astype(np.uint64), [np.repeat(k, size) for k in keys], *shape).view(np.int64)
    limit = np.repeat(n, size)
    at = np.flatnonzero((value >= limit) & (local < limit))  # the walks, by entry
    return _walk(value, at, first[at], limit[at])


def _block(n: np.ndarray, key: np.ndarray, b: int) -> np.ndarray:
    """`_network_tables` of groups of bit length `b`: a row of ``2**b`` entries each."""
    keys, _ = _network_keys(np.full(len(n), b), key)
    lw, hi = np.uint64(b >> 1), np.uint64((b + 1) >> 1)
    local = np.arange(1 << b, dtype=np.uint64)
    block = np.empty((len(n), 1 << b), np.uint64)
    block[:] = local
    value = _feistel(block, [k[:, None] for k in keys], lw, (np.uint64(1) << lw) - np.uint64(1),
                     np.uint64(64) - hi, np.uint64(64) - lw).view(np.int64)
    limit = n[:, None]
    at = np.flatnonzero((value >= limit) & (local.view(np.int64) < limit))
    return _walk(value.ravel(), at, (at >> b) << b, limit.ravel()[at >> b])


def _walk(value: np.ndarray, at: np.ndarray, row_start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """`value` (a table of groups end to end, each entry's network value) with the entries
    `at` (of groups starting at `row_start`, of `stop` elements) followed through the table
    until they land below `stop`: array steps while many walk, then one by one."""
    walked = value.copy()
    while len(at) > 2 * _FEW:
        again = value[row_start + walked[at]]
        walked[at] = again
        keep = again >= stop
        at, row_start, stop = at[keep], row_start[keep], stop[keep]
    for e, first, limit in zip(at.tolist(), row_start.tolist(), stop.tolist()):
        v = int(walked[e])
        while v >= limit:
            v = int(value[first + v])
        walked[e] = v
    return walked


def _network_keys(bits: np.ndarray, key: np.ndarray, used: np.ndarray | None = None) -> tuple[list[np.ndarray], list[Any]]:
    """The six round keys per group (bit lengths `bits`, keys `key`), and ``low, lo_mask,
    hi_shift, lo_shift`` per group (numpy scalars when all the groups `used` (None: all) have
    one bit length)."""
    every = mix64(_STEP_COLUMN ^ mix64(key)[None, :])  # a row per round: contiguous keys
    keys = list(every)
    these = bits if used is None else bits[used]
    if len(these) and these.min() == these.max():  # one bit length: shifts and masks are scalars
        b = int(these[0])
        high, low = np.uint64((b + 1) >> 1), np.uint64(b >> 1)
        return keys, [low, (np.uint64(1) << low) - np.uint64(1), np.uint64(64) - high, np.uint64(64) - low]
    high, low = ((bits + 1) >> 1).astype(np.uint64), (bits >> 1).astype(np.uint64)
    return keys, [low, (np.uint64(1) << low) - np.uint64(1), np.uint64(64) - high, np.uint64(64) - low]


class _Groups:
    """Which group each of `m` elements belongs to: ``index`` (an intp array), or runs of equal
    groups in order (``counts`` per group: element arrays by `np.repeat`), or, with neither, one
    group per element (``G == m``), or one group for all (``G == 1``: values broadcast)."""

    def __init__(self, m: int, size: int, index: np.ndarray | None = None, counts: np.ndarray | None = None):
        self.m, self.size, self.counts, self._index = m, size, counts, index

    @property
    def index(self) -> np.ndarray:
        if self._index is None:
            self._index = (np.zeros(self.m, np.intp) if self.size == 1 and self.counts is None
                           else np.repeat(np.arange(self.size), self.counts if self.counts is not None else 1))
        return self._index

    def expand(self, a: np.ndarray, sel: np.ndarray | None = None) -> Any:
        """The per-group values `a` per element (of `sel` only, when given)."""
        if self.size == 1 and self._index is None and self.counts is None:
            return a[0]
        if sel is None:
            if self.counts is not None:
                return np.repeat(a, self.counts)
            return a if self._index is None else a[self._index]
        return a[sel] if self._index is None and self.counts is None else a[self.index[sel]]


def permute(x: np.ndarray, n: np.ndarray | int, key: np.ndarray | int) -> np.ndarray:
    """``pi_key(x)`` for the permutation ``pi_key`` of ``[0, n)`` (module docstring); int64.

    `x` must lie in ``[0, n)`` (not checked here: callers compute it); `n` up to ``2**62``.
    """
    x = np.asarray(x, np.int64)
    n, key = np.asarray(n, np.int64), np.asarray(key).astype(np.uint64)
    if n.ndim == 0 and key.ndim == 0:  # one permutation for all
        return permute_grouped(x.ravel(), n.reshape(1), key.reshape(1)).reshape(x.shape)
    x, n, key = np.broadcast_arrays(x, n, key)
    return permute_grouped(x.ravel(), n.ravel(), key.ravel()).reshape(x.shape)


def permute_grouped(x: np.ndarray, n: np.ndarray, key: np.ndarray, *, index: np.ndarray | None = None,
                    counts: np.ndarray | None = None) -> np.ndarray:
    """`permute` of the int64 elements `x` (one dimension), element ``e`` in the permutation of
    group ``g``: size ``n[g]``, key ``key[g]``. The groups: ``g = index[e]``; or `counts`, runs of
    ``counts[g]`` elements of group ``g`` in order; or neither, ``g = e`` (``len(n) == len(x)``)
    or, with one group, every element in it. A new int64 array."""
    n = np.asarray(n, np.int64)
    key = np.asarray(key).astype(np.uint64)
    groups = _Groups(len(x), len(n), index, counts)
    big = n > SMALL
    if big.all():
        return _network(x, n, key, groups, None)
    out = np.array(x, np.int64)
    small = (n > 1) & ~big
    if small.any():
        _small(out, x, n, key, groups, small)
    if big.any():
        sel = np.flatnonzero(groups.expand(big)) if groups.size > 1 else np.arange(len(x))
        out[sel] = _network(x[sel], n, key, groups, sel)
    return out


def _small(out: np.ndarray, x: np.ndarray, n: np.ndarray, key: np.ndarray, groups: _Groups,
           small: np.ndarray) -> None:
    """``pi(x)`` for the elements of groups of 2..`SMALL` elements, into `out`: each such group's
    whole permutation (`_rank_tables`), then one gather."""
    which = np.flatnonzero(small)
    start = np.zeros(len(n), np.int64)
    start[which] = np.cumsum(n[which]) - n[which]
    flat = _rank_tables(n[which], key[which])
    sel = (np.flatnonzero(groups.expand(small)) if groups.size > 1 or groups.counts is not None
           else np.arange(len(x)))
    out[sel] = flat[groups.expand(start, sel) + x[sel]]


def _network(x: np.ndarray, n: np.ndarray, key: np.ndarray, groups: _Groups,
             sel: np.ndarray | None) -> np.ndarray:
    """``pi(x)`` by the Feistel network and cycle walking, for elements `sel` of `groups` (all:
    None) whose groups have more than `SMALL` elements; per-group values gathered per element."""
    keys, shape = _network_keys(_bit_length(n - 1), key, np.flatnonzero(n > SMALL) if len(n) > 1 else None)
    uniform = all(np.ndim(a) == 0 for a in shape)

    def per_element(at: np.ndarray | None) -> tuple[list[Any], list[Any]]:
        ks = [groups.expand(k, at) for k in keys]
        return ks, shape if uniform else [groups.expand(a, at) for a in shape]

    limit = n.astype(np.uint64)
    ks, sh = per_element(sel)
    value = _feistel(np.array(x, np.uint64), ks, *sh)
    bad = np.flatnonzero(value >= groups.expand(limit, sel))
    while len(bad) > _FEW:  # cycle walking: through the network again until below n
        at = bad if sel is None else sel[bad]
        ks, sh = per_element(at)
        again = _feistel(value[bad], ks, *sh)
        value[bad] = again
        bad = bad[again >= groups.expand(limit, at)]
    if len(bad):  # the last few one by one (an array pass costs some 50 calls whatever its size)
        at = bad if sel is None else sel[bad]
        ks, sh = per_element(at)
        ks = [np.broadcast_to(k, at.shape).tolist() for k in ks]
        sh = [np.broadcast_to(a, at.shape).tolist() for a in sh]
        stop = np.broadcast_to(groups.expand(limit, at), at.shape).tolist()
        for e, v in enumerate(value[bad].tolist()):
            keys_e, shape_e = [k[e] for k in ks], [a[e] for a in sh]
            while v >= stop[e]:
                v = _feistel_one(v, keys_e, *shape_e)
            value[bad[e]] = v
    return value.view(np.int64)


def _feistel_one(x: int, keys: list[int], low: int, lo_mask: int, hi_shift: int, lo_shift: int) -> int:
    """`_feistel` of one value in Python integers (64-bit wrapping made explicit)."""
    h, lo = x >> low, x & lo_mask
    for i, k in enumerate(keys):
        z = (((lo if i % 2 == 0 else h) ^ k) * _M1_INT) & _MASK64
        z = ((z ^ (z >> 32)) * _M2_INT) & _MASK64
        if i % 2 == 0:
            h ^= z >> hi_shift
        else:
            lo ^= z >> lo_shift
    return (h << low) | lo


def _feistel(x: np.ndarray, keys: list[Any], low: Any, lo_mask: Any, hi_shift: Any, lo_shift: Any) -> np.ndarray:
    """The network on uint64 `x` (consumed): even rounds ``high ^= F_i(low)``, odd ones
    ``low ^= F_i(high)``, ``F_i(v)`` the top bits of ``((v ^ k_i) * M1 ^ (... >> 32)) * M2``."""
    h = np.right_shift(x, low)
    lo = np.bitwise_and(x, lo_mask, out=x)
    t, u = np.empty_like(h), np.empty_like(h)
    s32 = np.uint64(32)
    for i, k in enumerate(keys):
        src, dst, shift = (lo, h, hi_shift) if i % 2 == 0 else (h, lo, lo_shift)
        np.bitwise_xor(src, k, out=t)
        np.multiply(t, _M1, out=t)
        np.right_shift(t, s32, out=u)
        np.bitwise_xor(t, u, out=t)
        np.multiply(t, _M2, out=t)
        np.right_shift(t, shift, out=t)
        np.bitwise_xor(dst, t, out=dst)
    np.left_shift(h, low, out=h)
    return np.bitwise_or(h, lo, out=h)
