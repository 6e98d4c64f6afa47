"""`gdsload.format.crc.first_mismatch`: the one check of many members of a buffer against their
CRC32s (the loader's staged members, the feed client's members sent as stored)."""

from __future__ import annotations

import zlib

import numpy as np

from gdsload.format.crc import first_mismatch


def _members(rng: np.random.Generator) -> tuple[memoryview, np.ndarray, np.ndarray, np.ndarray]:
    """Seven members in two back-to-back runs with a 100-byte gap between them, and one empty."""
    sizes = np.array([5000, 17, 0, 9000, 300, 6000, 1], np.int64)
    pos = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=pos[1:])
    pos[4:] += 100
    buf = bytearray(rng.integers(0, 256, int(pos[-1] + sizes[-1]), np.uint8).tobytes())
    crcs = np.array([zlib.crc32(buf[a : a + n]) for a, n in zip(pos, sizes)], np.int64)
    return memoryview(buf), pos, sizes, crcs


def test_every_member_as_expected_is_none():
    buf, pos, sizes, crcs = _members(np.random.default_rng(0))
    assert first_mismatch(buf, pos, sizes, crcs) is None
    buf[int(pos[3] + sizes[3]) + 50] ^= 0xFF  # a byte of the gap between the runs: no member's
    assert first_mismatch(buf, pos, sizes, crcs) is None


def test_a_changed_byte_names_the_first_member_that_differs_and_counts_them():
    buf, pos, sizes, crcs = _members(np.random.default_rng(1))
    buf[int(pos[5]) + 10] ^= 0x01  # in the second run
    assert first_mismatch(buf, pos, sizes, crcs) == (5, zlib.crc32(buf[pos[5] : pos[5] + sizes[5]]), 1)
    buf[int(pos[1]) + 16] ^= 0x80  # and in the first
    k, got, count = first_mismatch(buf, pos, sizes, crcs)
    assert (k, got, count) == (1, zlib.crc32(buf[pos[1] : pos[1] + sizes[1]]), 2)


def test_a_wrong_expected_crc_of_an_empty_member_is_found():
    buf, pos, sizes, crcs = _members(np.random.default_rng(2))
    crcs[2] = 1  # an empty member's CRC32 is 0
    assert first_mismatch(buf, pos, sizes, crcs) == (2, 0, 1)
