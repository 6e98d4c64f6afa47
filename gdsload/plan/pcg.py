"""NumPy's `PCG64(SeedSequence(entropy)).random_raw(n)`, word for word, without importing
`numpy.random` for a few words.

Order 2 (`gdsload.plan.window`) draws one raw word per shard, plus two, once per epoch. Importing
`numpy.random` for them costs more than the rest of the first batch's plan (it loads its eight
extension modules and `secrets`, `hmac`, `random`: 9-14 ms of the constructor-to-first-batch path
under `-X importtime` on the 2-core VM, issue 55; neither torch nor DALI imports it). Up to
`PURE_WORDS` words are computed here in Python integers, exactly as NumPy 1.17+ defines them
(`SeedSequence`'s hash mix with pool size 4, then PCG64 XSL-RR 128/64 seeded with four words of
its state); more than that go to `numpy.random` as before, where the import is amortised.
`tests/loader/test_first_batch_path.py` checks the two agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["PURE_WORDS", "raw_words", "seed_state"]

PURE_WORDS = 4096  # more words than this: numpy.random (about 1 us per word here)

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_M128 = (1 << 128) - 1
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_POOL = 4
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645


def _words32(entropy: Sequence[int]) -> list[int]:
    """A sequence of integers >= 0 as SeedSequence reads it: each as its 32-bit words, low first
    (0 is one word)."""
    out: list[int] = []
    for v in entropy:
        v = int(v)
        if v < 0:
            raise ValueError(f"entropy must be integers >= 0, got {v}")
        if v == 0:
            out.append(0)
        while v > 0:
            out.append(v & _M32)
            v >>= 32
    return out


def _pool(entropy: Sequence[int]) -> list[int]:
    words = _words32(entropy)
    h = _INIT_A

    def hashmix(value: int) -> int:
        nonlocal h
        value ^= h
        h = (h * _MULT_A) & _M32
        value = (value * h) & _M32
        return value ^ (value >> 16)

    def mix(x: int, y: int) -> int:
        r = (_MIX_L * x - _MIX_R * y) & _M32
        return r ^ (r >> 16)

    pool = [hashmix(words[i] if i < len(words) else 0) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(_POOL, len(words)):
        for dst in range(_POOL):
            pool[dst] = mix(pool[dst], hashmix(words[src]))
    return pool


def seed_state(entropy: Sequence[int], n_words: int) -> list[int]:
    """`SeedSequence(entropy).generate_state(n_words, np.uint64)` as Python ints."""
    pool = _pool(entropy)
    h = _INIT_B
    w32 = []
    for i in range(2 * n_words):
        v = pool[i % _POOL] ^ h
        h = (h * _MULT_B) & _M32
        v = (v * h) & _M32
        w32.append(v ^ (v >> 16))
    return [w32[2 * i] | (w32[2 * i + 1] << 32) for i in range(n_words)]


def raw_words(entropy: Sequence[int], n: int) -> np.ndarray:
    """`np.random.PCG64(np.random.SeedSequence(entropy)).random_raw(n)`: uint64[n]."""
    if n > PURE_WORDS:
        return np.random.PCG64(np.random.SeedSequence(list(entropy))).random_raw(n)
    s0, s1, i0, i1 = seed_state(entropy, 4)
    inc = ((((i0 << 64) | i1) << 1) | 1) & _M128
    # srandom: state 0, one step (the state becomes `inc`), the seed added, one more step
    state = (((inc + ((s0 << 64) | s1)) & _M128) * _PCG_MULT + inc) & _M128
    out = []
    for _ in range(n):
        state = (state * _PCG_MULT + inc) & _M128
        x = ((state >> 64) ^ state) & _M64
        rot = state >> 122
        out.append(((x >> rot) | (x << (64 - rot))) & _M64)
    return np.array(out, dtype=np.uint64)
