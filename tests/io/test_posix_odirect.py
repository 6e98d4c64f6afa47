"""PosixBackend specifics: O_DIRECT (real, and refused by the filesystem), partial reads, gaps."""

from __future__ import annotations

import errno
import fcntl
import os

import numpy as np
import pytest

from gdsload.errors import FormatError
from gdsload.io import Extent
from gdsload.io.posix import PosixBackend


@pytest.fixture
def shard(tmp_path):
    data = np.random.default_rng(5).integers(0, 256, 3 * 4096 + 100, dtype=np.uint8)
    path = tmp_path / "shard.tar"
    path.write_bytes(data.tobytes())
    return str(path), data


EXTENTS = [(5000, 100), (1, 4999), (5100, 3091), (8191, 2), (12_000, 388)]  # unaligned on purpose
OVERLAPPING = [(0, 5000), (4000, 4096), (4096, 4096), (0, 12_388)]


def read(backend, path, picks):
    offsets = np.concatenate([[0], np.cumsum([n for _, n in picks])[:-1]]).astype(int).tolist()
    out = np.zeros(sum(n for _, n in picks), np.uint8)
    backend.read([Extent(path, o, n) for o, n in picks], out, offsets).result(timeout=10)
    return out


def expected(data, picks):
    return np.concatenate([data[o : o + n] for o, n in picks])


def test_o_direct_reads_unaligned_extents_through_an_aligned_bounce_buffer(shard):
    path, data = shard
    with PosixBackend(o_direct=True, direct_chunk=4096) as b:
        np.testing.assert_array_equal(read(b, path, EXTENTS), expected(data, EXTENTS))
        if b.name != "posix-odirect":
            pytest.skip("this filesystem refuses O_DIRECT")
        fd, direct = b._fds[path]
        assert direct and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        # One group spanning the whole file, read a page (direct_chunk) at a time up to EOF.
        assert b.stats()["reads"] == 4
        np.testing.assert_array_equal(read(b, path, OVERLAPPING), expected(data, OVERLAPPING))


def test_o_direct_reports_eof_like_buffered_reads(shard):
    path, _ = shard
    with PosixBackend(o_direct=True, direct_chunk=4096) as b:
        with pytest.raises(FormatError, match=r"wanted 200 bytes at offset 12200 .*got 188.*12388 bytes"):
            read(b, path, [(12_200, 200)])


def test_o_direct_refused_at_open_falls_back_to_buffered_and_says_so(shard, monkeypatch):
    path, data = shard
    real_open = os.open

    def refusing_open(p, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    with PosixBackend(o_direct=True) as b:
        assert b.name == "posix-odirect"  # not known before the first open
        np.testing.assert_array_equal(read(b, path, EXTENTS), expected(data, EXTENTS))
        assert b.name == "posix"


def test_o_direct_refused_at_read_falls_back_to_buffered_and_says_so(shard, monkeypatch):
    path, data = shard
    real_preadv = os.preadv

    def refusing_preadv(fd, bufs, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", refusing_preadv)
    with PosixBackend(o_direct=True) as b:
        np.testing.assert_array_equal(read(b, path, EXTENTS), expected(data, EXTENTS))
        assert b.name == "posix"
        np.testing.assert_array_equal(read(b, path, EXTENTS), expected(data, EXTENTS))


def test_partial_preadv_results_are_continued(shard, monkeypatch):
    path, data = shard
    real_preadv = os.preadv

    def stingy_preadv(fd, bufs, offset):  # the kernel may return fewer bytes than asked
        budget, parts = 100, []
        for buf in bufs:
            take = memoryview(buf)[:budget]
            parts.append(take)
            budget -= len(take)
            if not budget:
                break
        return real_preadv(fd, parts, offset)

    monkeypatch.setattr(os, "preadv", stingy_preadv)
    picks = [(0, 50), (60, 70), (4000, 1000)]  # one group with gaps (max_gap 64 KiB)
    with PosixBackend() as b:
        np.testing.assert_array_equal(read(b, path, picks), expected(data, picks))
        stats = b.stats()
    assert stats["reads"] == -(-5000 // 100)  # the group spans 5000 bytes
    assert stats["bytes_read"] == 1120 and stats["bytes_transferred"] == 5000


def test_gaps_up_to_max_gap_cost_no_extra_read(shard):
    path, data = shard
    picks = [(0, 100), (100 + 1000, 100), (1200 + 5000, 100)]
    for max_gap, reads in ((5000, 1), (1000, 2), (999, 3), (0, 3)):
        with PosixBackend(max_gap=max_gap) as b:
            np.testing.assert_array_equal(read(b, path, picks), expected(data, picks))
            assert b.stats()["reads"] == reads, max_gap
