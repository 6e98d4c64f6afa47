"""A local store's pending file (what shards are written through): O_DIRECT from an aligned
staging buffer where the filesystem takes it, buffered where it does not; the same bytes either
way, whatever the sizes of the pieces and however the tail falls against the 4 KiB blocks."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from gdsload.io import store as store_mod


def pieces(rng: np.random.Generator, total: int) -> list[bytes]:
    out, n = [], 0
    while n < total:
        k = int(min(total - n, rng.choice([1, 511, 512, 4095, 4096, 70_001, 3 << 20])))
        out.append(rng.bytes(k))
        n += k
    return out


@pytest.mark.parametrize("total", [0, 1, 4096, 4097, store_mod.DIRECT_BYTES, 2 * store_mod.DIRECT_BYTES + 123])
def test_pending_file_holds_exactly_what_was_written(tmp_path, total):
    rng = np.random.default_rng(total)
    data = pieces(rng, total)
    store = store_mod.open_store(tmp_path)
    f = store.create("x.tar")
    for i, p in enumerate(data):  # bytes, memoryviews and bytearrays, as the shard writer gives them
        f.write(memoryview(p) if i % 3 == 1 else bytearray(p) if i % 3 == 2 else p)
    assert not (tmp_path / "x.tar").exists()  # nothing under the final name before commit
    f.commit()
    assert (tmp_path / "x.tar").read_bytes() == b"".join(data)
    assert os.listdir(tmp_path) == ["x.tar"]


def test_a_filesystem_without_o_direct_gets_a_buffered_file(tmp_path, monkeypatch):
    """tmpfs before Linux 6.6 (and some network filesystems) refuse O_DIRECT at open with EINVAL."""
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open

    def open_without_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_without_direct)
    f = store_mod.open_store(tmp_path).create("y.tar")
    assert not f._direct
    data = pieces(np.random.default_rng(1), store_mod.DIRECT_BYTES + 5)
    for p in data:
        f.write(p)
    f.commit()
    assert (tmp_path / "y.tar").read_bytes() == b"".join(data)


def test_abort_leaves_nothing(tmp_path):
    f = store_mod.open_store(tmp_path).create("z.tar")
    f.write(b"a" * (store_mod.DIRECT_BYTES + 10))
    f.abort()
    assert os.listdir(tmp_path) == []
