"""FsspecBackend specifics: retries with backoff on transient errors only, other protocols."""

from __future__ import annotations

import numpy as np
import pytest

from gdsload.errors import GdsloadError
from gdsload.io import Extent
from gdsload.io.fsspec_backend import FsspecBackend, _is_transient


class _Status(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


@pytest.mark.parametrize(
    "exc,transient",
    [
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (OSError("network unreachable"), True),
        (_Status(503), True),
        (_Status(429), True),
        (_Status(404), False),
        (_Status(416), False),
        (FileNotFoundError(), False),
        (PermissionError(), False),
        (GdsloadError("short"), False),
        (ValueError(), False),
    ],
)
def test_only_transient_errors_are_retried(exc, transient):
    assert _is_transient(exc) is transient


@pytest.fixture
def http_file(http_server, io_root):
    pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp (add it to the test extra)")
    data = np.random.default_rng(11).integers(0, 256, 50_000, dtype=np.uint8)
    (io_root / "retry.bin").write_bytes(data.tobytes())
    yield f"http://127.0.0.1:{http_server.server_address[1]}/retry.bin", data
    http_server.fail_next = 0


def test_transient_http_errors_are_retried_then_succeed(http_server, http_file):
    url, data = http_file
    http_server.fail_next = 2  # two 503s, then the real answer
    with FsspecBackend(retries=3, backoff_s=0.001) as b:
        out = np.zeros(300, np.uint8)
        assert b.read([Extent(url, 1000, 300)], out, [0]).result(timeout=10) == 300
        assert b.stats()["reads"] == 3
    np.testing.assert_array_equal(out, data[1000:1300])


def test_retries_give_up_with_a_clear_error(http_server, http_file):
    url, _ = http_file
    http_server.fail_next = 100
    with FsspecBackend(retries=2, backoff_s=0.001) as b:
        with pytest.raises(GdsloadError, match=r"retry\.bin.*after 3 attempt"):
            b.read([Extent(url, 0, 10)], np.zeros(10, np.uint8), [0]).result(timeout=10)
        assert b.stats()["reads"] == 3


def test_a_missing_url_is_not_retried(http_file):
    url, _ = http_file
    with FsspecBackend(retries=3, backoff_s=1.0) as b:  # a retry would take seconds
        with pytest.raises(GdsloadError, match="no such file"):
            b.read([Extent(url + ".nope", 0, 10)], np.zeros(10, np.uint8), [0]).result(timeout=5)
        assert b.stats()["reads"] == 1


def test_memory_filesystem_urls_work():
    import fsspec

    data = bytes(range(256)) * 40
    fsspec.filesystem("memory").pipe_file("/gdsload-io-test/x.bin", data)
    with FsspecBackend() as b:
        out = np.zeros(20, np.uint8)
        ext = [Extent("memory://gdsload-io-test/x.bin", 5, 10), Extent("memory://gdsload-io-test/x.bin", 300, 10)]
        assert b.read(ext, out, [0, 10]).result(timeout=10) == 20
    np.testing.assert_array_equal(out, np.frombuffer(data[5:15] + data[300:310], np.uint8))
