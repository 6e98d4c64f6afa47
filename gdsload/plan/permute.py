"""Keyed bijections of ``0..n-1`` evaluated only where asked: the shuffles of order 2.

`permute(x, n, key)` sends each ``x`` in ``[0, n)`` to ``pi(x)``, where ``pi`` is a permutation of
``[0, n)`` chosen by the 64-bit `key`; ``x``, ``n`` and ``key`` are arrays (broadcast together), so
one call evaluates many permutations of different sizes at once. Nothing of size ``n`` is built:
cost and memory are those of a few arrays the size of ``x``.

Construction (fixed: it is part of order 2, `gdsload.plan.plan`): a balanced Feistel network on
``2h`` bits, ``h`` the smallest with ``4**h >= n`` (``h >= 1``), `ROUNDS` rounds; round ``i``
maps halves ``(L, R)`` to ``(R, L ^ F_i(R))`` with ``F_i(R)`` the low ``h`` bits of splitmix64's
finaliser of ``R ^ k_i`` (``k_i`` the finaliser of ``key + (i + 1) * 0x9E3779B97F4A7C15``). A
Feistel network is a bijection of ``[0, 4**h)`` whatever ``F``; a value that lands at ``n`` or
beyond is sent through the network again (cycle walking) until it lands below ``n``, which
restricts it to a bijection of ``[0, n)``. Since ``4**h < 4n``, a value walks fewer than 4 times
on average. Only wrapping uint64 arithmetic: the result depends on nothing but (x, n, key), never
on NumPy's random generators. ``n <= 1`` is the identity.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROUNDS", "mix64", "permute"]

ROUNDS = 6
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


def _feistel(x: np.ndarray, h: np.ndarray, keys: list[np.ndarray]) -> np.ndarray:
    hu = h.astype(np.uint64)
    mask = (np.uint64(1) << hu) - np.uint64(1)
    left, right = x >> hu, x & mask
    for k in keys:
        left, right = right, left ^ (mix64(right ^ k) & mask)
    return (left << hu) | right


def permute(x: np.ndarray, n: np.ndarray | int, key: np.ndarray | int) -> np.ndarray:
    """``pi_key(x)`` for the permutation ``pi_key`` of ``[0, n)`` (module docstring); int64.

    `x` must lie in ``[0, n)`` (not checked here: callers compute it); `n` up to ``2**62``.
    """
    x, n, key = np.broadcast_arrays(np.asarray(x, np.int64), np.asarray(n, np.int64),
                                    np.asarray(key).astype(np.uint64))
    shape = x.shape
    x, n, key = x.ravel(), n.ravel(), key.ravel()
    out = x.copy()
    todo = np.flatnonzero(n > 1)
    if not len(todo):
        return out.reshape(shape)
    h = np.maximum((_bit_length(n[todo] - 1) + 1) // 2, 1)
    keys = [mix64(key[todo] + np.uint64((i + 1) * int(_GOLDEN) % 2**64)) for i in range(ROUNDS)]
    value = _feistel(x[todo].astype(np.uint64), h, keys)
    limit = n[todo].astype(np.uint64)
    while True:
        walk = np.flatnonzero(value >= limit)
        if not len(walk):
            break
        value[walk] = _feistel(value[walk], h[walk], [k[walk] for k in keys])
    out[todo] = value.astype(np.int64)
    return out.reshape(shape)
