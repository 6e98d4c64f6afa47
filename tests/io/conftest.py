"""Fixtures for the I/O tests: a real local HTTP server with Range support, and one `IOCase` per
backend available on this host, so that a single conformance suite runs against all of them."""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gdsload.io.base import Backend

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class RangeRequestHandler(BaseHTTPRequestHandler):
    """GET/HEAD of files under `server.root`, honouring one `Range: bytes=a-b` (RFC 9110).

    `server.fail_next` > 0 answers that many requests with 503 (to test retries);
    `server.requests` counts GETs.
    """

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, *, body: bool) -> None:
        server: Any = self.server
        if body:
            with server.lock:
                server.requests += 1
                failing = server.fail_next > 0
                server.fail_next -= failing
            if failing:
                self._reply(HTTPStatus.SERVICE_UNAVAILABLE, b"try again", body=True)
                return
        path = (server.root / self.path.lstrip("/").split("?")[0]).resolve()
        if server.root not in path.parents or not path.is_file():
            self._reply(HTTPStatus.NOT_FOUND, b"not found", body=body)
            return
        data = path.read_bytes()
        size = len(data)
        spec = self.headers.get("Range")
        if spec is None:
            self._reply(HTTPStatus.OK, data, body=body)
            return
        m = _RANGE.match(spec.strip())
        if not m or m.groups() == ("", ""):
            self._reply(HTTPStatus.BAD_REQUEST, b"bad range", body=body)
            return
        first, last = m.groups()
        if first == "":  # suffix range: the last N bytes
            start, stop = max(0, size - int(last)), size
        else:
            start, stop = int(first), size if last == "" else min(int(last) + 1, size)
        if start >= size:
            self._reply(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, b"", body=body,
                        headers={"Content-Range": f"bytes */{size}"})
            return
        self._reply(HTTPStatus.PARTIAL_CONTENT, data[start:stop], body=body,
                    headers={"Content-Range": f"bytes {start}-{stop - 1}/{size}"})

    def _reply(self, status: HTTPStatus, payload: bytes, *, body: bool,
               headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Accept-Ranges", "bytes")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(payload)


@pytest.fixture(scope="session")
def io_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("io").resolve()


@pytest.fixture(scope="session")
def http_server(io_root: Path) -> Iterator[ThreadingHTTPServer]:
    """A real HTTP server on 127.0.0.1 (port 0) serving `io_root` in a thread."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), RangeRequestHandler)
    server.daemon_threads = True
    server.root = io_root  # type: ignore[attr-defined]
    server.fail_next = 0  # type: ignore[attr-defined]
    server.requests = 0  # type: ignore[attr-defined]
    server.lock = threading.Lock()  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


_names = itertools.count()


@dataclass
class IOCase:
    """How to drive one backend: build it, name a local file for it, allocate and inspect `out`."""

    id: str
    root: Path
    open: Callable[[], Backend]
    url: Callable[[Path], str]
    alloc: Callable[[int], Any]
    to_numpy: Callable[[Any], np.ndarray]

    def write(self, data: bytes | np.ndarray) -> tuple[Path, str]:
        """Write `data` to a fresh file under `root`; returns (local path, path for the backend)."""
        path = self.root / f"f{next(_names)}.bin"
        path.write_bytes(bytes(data))
        return path, self.url(path)

    def filled(self, nbytes: int, value: int) -> Any:
        out = self.alloc(nbytes)
        out[...] = value
        return out


CASES = [
    "posix",
    "posix-odirect",
    "fsspec-file",
    "fsspec-http",
    pytest.param("kvikio-numpy", marks=pytest.mark.gds),
    pytest.param("kvikio-cupy", marks=pytest.mark.gds),
]


@pytest.fixture(scope="module", params=CASES)
def case(request: pytest.FixtureRequest, io_root: Path) -> IOCase:
    kind = request.param
    host = dict(alloc=lambda n: np.empty(n, dtype=np.uint8), to_numpy=np.asarray)
    if kind.startswith("posix"):
        from gdsload.io.posix import PosixBackend

        return IOCase(kind, io_root, lambda: PosixBackend(o_direct=kind == "posix-odirect"), str, **host)
    if kind == "fsspec-file":
        from gdsload.io.fsspec_backend import FsspecBackend

        return IOCase(kind, io_root, lambda: FsspecBackend(backoff_s=0.01), lambda p: f"file://{p}", **host)
    if kind == "fsspec-http":
        pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp (add it to the test extra)")
        from gdsload.io.fsspec_backend import FsspecBackend

        server = request.getfixturevalue("http_server")
        base = f"http://127.0.0.1:{server.server_address[1]}"
        return IOCase(kind, io_root, lambda: FsspecBackend(backoff_s=0.01),
                      lambda p: f"{base}/{p.relative_to(io_root)}", **host)
    from gdsload.io.kvikio_backend import KvikioBackend

    if kind == "kvikio-numpy":
        return IOCase(kind, io_root, KvikioBackend, str, **host)
    import cupy

    return IOCase(kind, io_root, KvikioBackend, str, lambda n: cupy.empty(n, dtype=cupy.uint8), cupy.asnumpy)


@pytest.fixture(scope="module")
def backend(case: IOCase) -> Iterator[Backend]:
    """One backend per case, shared by the tests of a module (Hypothesis needs no per-test state)."""
    b = case.open()
    yield b
    b.close()
