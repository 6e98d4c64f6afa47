"""KvikioBackend logic on any host, against a stand-in `kvikio` module with the KvikIO 26.10 surface
this backend uses (`CuFile(path, "r").pread(buf, size, file_offset).get()`,
`defaults.is_compat_mode_preferred()`, `defaults.set()`, `cufile_driver.get("is_gds_available")`).
The real library runs in the conformance suite on GPU hosts (`gds` marker)."""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

from gdsload.errors import FormatError
from gdsload.io import Extent
from gdsload.io.kvikio_backend import KvikioBackend


class _Done:
    def __init__(self, n: int) -> None:
        self._n = n

    def get(self) -> int:
        return self._n


def install_fake_kvikio(monkeypatch, *, compat: bool, gds, settings: dict | None = None) -> list:
    """Put a stand-in kvikio in sys.modules; returns the list of (offset, size) preads issued."""
    preads: list[tuple[int, int]] = []

    class CuFile:
        def __init__(self, path: str, flags: str = "r") -> None:
            self._fd = os.open(path, os.O_RDONLY)

        def pread(self, buf, size=None, file_offset=0, task_size=None):
            preads.append((file_offset, size))
            return _Done(os.preadv(self._fd, [memoryview(buf)[:size]], file_offset))

        def close(self) -> None:
            os.close(self._fd)

    def driver_get(key: str):
        if isinstance(gds, Exception):
            raise gds
        return {"is_gds_available": gds}[key]

    store = settings if settings is not None else {}
    defaults = types.ModuleType("kvikio.defaults")
    defaults.is_compat_mode_preferred = lambda: compat
    defaults.set = lambda key, value: store.__setitem__(key, value)
    driver = types.ModuleType("kvikio.cufile_driver")
    driver.get = driver_get
    kvikio = types.ModuleType("kvikio")
    kvikio.CuFile, kvikio.defaults, kvikio.cufile_driver = CuFile, defaults, driver
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    monkeypatch.setitem(sys.modules, "kvikio.cufile_driver", driver)
    return preads


@pytest.mark.parametrize(
    "compat,gds,name",
    [
        (False, True, "kvikio-gds"),
        (False, False, "kvikio-compat"),  # libcufile loads, but cuFile itself has no GDS
        (True, True, "kvikio-compat"),
        (False, RuntimeError("cuFile not available"), "kvikio-compat"),
    ],
)
def test_name_says_whether_gds_is_really_used(monkeypatch, compat, gds, name):
    install_fake_kvikio(monkeypatch, compat=compat, gds=gds)
    with KvikioBackend() as b:
        assert b.name == name and b.device_capable


def test_threads_sets_kvikio_thread_pool(monkeypatch):
    settings: dict = {}
    install_fake_kvikio(monkeypatch, compat=True, gds=False, settings=settings)
    KvikioBackend(threads=16).close()
    assert settings == {"num_threads": 16}


@pytest.fixture
def shard(tmp_path):
    data = np.random.default_rng(2).integers(0, 256, 40_000, dtype=np.uint8)
    path = tmp_path / "s.tar"
    path.write_bytes(data.tobytes())
    return str(path), data


def test_only_file_and_buffer_adjacent_extents_share_a_pread(monkeypatch, shard):
    path, data = shard
    preads = install_fake_kvikio(monkeypatch, compat=True, gds=False)
    # 0-4096 and 4096-8192 are adjacent in file and out; 8192.. lands elsewhere in out;
    # 20000.. follows a gap in the file (no device scratch for gaps).
    picks = [(0, 4096, 0), (4096, 4096, 4096), (8192, 100, 9000), (20_000, 500, 8192)]
    out = np.zeros(10_000, np.uint8)
    with KvikioBackend() as b:
        total = b.read([Extent(path, o, n) for o, n, _ in picks], out, [d for *_, d in picks]).result(10)
        assert total == sum(n for _, n, _ in picks)
        assert sorted(preads) == [(0, 8192), (8192, 100), (20_000, 500)]
        assert b.stats() == {"reads": 3, "bytes_read": total, "bytes_transferred": total}
    for o, n, d in picks:
        np.testing.assert_array_equal(out[d : d + n], data[o : o + n])


def test_past_eof_is_a_format_error_before_any_read(monkeypatch, shard):
    path, _ = shard
    preads = install_fake_kvikio(monkeypatch, compat=True, gds=False)
    with KvikioBackend() as b:
        with pytest.raises(FormatError, match=r"s\.tar.*offset 39990.*40000 bytes"):
            b.read([Extent(path, 39_990, 20)], np.zeros(20, np.uint8), [0]).result(10)
    assert preads == []
