"""`gdsload.io.table`: array-form read requests, read by POSIX's own `read_table` (one `preadv` per
coalesced group) and by any backend through `Extent`s; real files, a sentinel-filled `out`."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gdsload.errors import CorruptDataError, GdsloadError
from gdsload.io.posix import PosixBackend
from gdsload.io.table import ExtentTable, group_table, read_table

PAD = 0xA5


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes() for _ in range(2)]
    paths = []
    for i, d in enumerate(data):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(d)
        paths.append(str(p))
    return tuple(paths), data


def _table(paths, rows):
    cols = np.asarray(rows, np.int64).reshape(-1, 4).T
    return ExtentTable(paths, *cols)


def _expected(data, rows, size):
    out = np.full(size, PAD, np.uint8)
    for f, o, n, d in rows:
        out[d : d + n] = np.frombuffer(data[f][o : o + n], np.uint8)
    return out


# rows: (file, offset, nbytes, out offset); unordered, a gap-coalesced pair, a file-and-out
# contiguous pair, a zero-length row, two files
ROWS = [(1, 5000, 700, 0), (0, 100, 50, 800), (0, 160, 40, 900), (0, 200, 30, 940),
        (1, 0, 0, 2000), (0, 250_000, 49_000, 3000), (1, 299_000, 1000, 60_000)]


def test_posix_read_table_writes_exactly_the_rows(files):
    paths, data = files
    out = np.full(70_000, PAD, np.uint8)
    with PosixBackend(threads=1, max_gap=64) as b:
        got = b.read_table(_table(paths, ROWS), out).result()
        reads = b.stats()["reads"]
    assert got == sum(n for _, _, n, _ in ROWS)
    np.testing.assert_array_equal(out, _expected(data, ROWS, len(out)))
    # file 0: [100,150) +gap 10+ [160,200)[200,230) one read, 250000 another; file 1: two
    assert reads == 4


def test_fallback_through_read_matches(files):
    paths, data = files

    from gdsload.io.base import PooledBackend

    class ExtentOnly(PooledBackend):  # a backend with its own `read` only (as KvikIO and fsspec)
        def __init__(self, inner):
            super().__init__(1)
            self.inner = inner

        def read(self, extents, out, outs):
            return self.inner.read(extents, out, outs)

    out = np.full(70_000, PAD, np.uint8)
    with PosixBackend(threads=2) as b:
        assert read_table(ExtentOnly(b), _table(paths, ROWS), out).result() == sum(n for _, _, n, _ in ROWS)
    np.testing.assert_array_equal(out, _expected(data, ROWS, len(out)))


def test_group_table_breaks():
    t = _table(("a", "b"), [(0, 0, 10, 0), (0, 10, 10, 0), (0, 30, 5, 0), (1, 35, 5, 0), (0, 15, 2, 0)])
    order, starts = group_table(t, max_gap=10)
    # sorted: (0,0) (0,10) | (0,15: overlaps the one before) | (0,30: 13 bytes after) | (1,35)
    assert order.tolist() == [0, 1, 4, 2, 3]
    assert starts.tolist() == [0, 2, 3, 4, 5]


def test_out_of_bounds_and_bad_out_are_refused(files):
    paths, _ = files
    out = np.zeros(100, np.uint8)
    with PosixBackend(threads=1) as b:
        with pytest.raises(GdsloadError, match="does not fit in out of 100 bytes"):
            b.read_table(_table(paths, [(0, 0, 50, 60)]), out)
        with pytest.raises(GdsloadError, match="writeable 1-D"):
            b.read_table(_table(paths, [(0, 0, 5, 0)]), np.zeros(100, np.float32))
        with pytest.raises(GdsloadError, match="outside its 2 paths"):
            b.read_table(_table(paths, [(2, 0, 5, 0)]), out)


def test_short_file_is_corrupt_data(files, tmp_path):
    paths, data = files
    os.truncate(paths[0], 1000)
    with PosixBackend(threads=1) as b:
        f = b.read_table(_table(paths, [(0, 900, 200, 0)]), np.zeros(300, np.uint8))
        with pytest.raises(CorruptDataError, match="wanted 200 bytes at offset 900"):
            f.result()
