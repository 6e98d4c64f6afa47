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
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROUNDS", "mix64", "permute"]

ROUNDS = 6
SMALL = 32  # up to this many elements, ranks of hashes instead of the network
_SMALL_STEP = np.uint64(0xD1B54A32D192ED03)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on a uint64 array (a bijection of 64-bit words)."""
    z = np.asarray(z, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def subkeys(key: int | np.uint64, index: np.ndarray) -> np.ndarray:
    """Independent-looking 64-bit keys, one per `index` (int64 >= 0), derived from `key`."""
    index = np.asarray(index, dtype=np.int64).astype(np.uint64)
    return mix64(mix64(index * _GOLDEN + np.uint64(key)) ^ np.uint64(key))


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
    h = mix64(base[:, None] ^ ((j + np.uint64(1)) * _SMALL_STEP)[None, :])
    h = np.where(j[None, :] < n[:, None].astype(np.uint64), h, np.uint64(2**64 - 1))
    mine = h[np.arange(len(x)), x][:, None]
    before = (h < mine) | ((h == mine) & (j[None, :] < x[:, None].astype(np.uint64)))
    return before.sum(axis=1).astype(np.int64)


def permute(x: np.ndarray, n: np.ndarray | int, key: np.ndarray | int) -> np.ndarray:
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
        out[small] = _ranks(x[small], n[small], mix64(key[small]))
    todo = np.flatnonzero(n > SMALL)
    if not len(todo):
        return out.reshape(shape)
    bits = _bit_length(n[todo] - 1).astype(np.uint64)
    high = (bits + np.uint64(1)) >> np.uint64(1)
    low = bits >> np.uint64(1)
    base = mix64(key[todo])
    keys = [mix64(base ^ np.uint64((i + 1) * int(_GOLDEN) % 2**64)) for i in range(ROUNDS)]
    value = _feistel(x[todo].astype(np.uint64), high, low, keys)
    limit = n[todo].astype(np.uint64)
    while True:
        walk = np.flatnonzero(value >= limit)
        if not len(walk):
            break
        value[walk] = _feistel(value[walk], high[walk], low[walk], [k[walk] for k in keys])
    out[todo] = value.astype(np.int64)
    return out.reshape(shape)
