"""A fault-injecting HTTP proxy in front of moto's S3 server, for tests of what a flaky cloud does.

`FaultProxy(upstream)` listens on loopback port 0 and forwards every request to `upstream`
(`http://host:port`) as it is, returning the response as it is, except for the faults switched on:

- `corrupt[key] = n`: the next `n` GET responses of an object whose path ends with `key` come
  back with one byte of the body flipped (same length, same headers: the checksum header then
  disagrees with the body, as for a bit flipped in transit);
- `down = True`: every connection is closed at once without an answer (a store that drops
  connections); `go_down()` closes the listening socket (connections refused: a store that is
  down), `come_back()` listens on the same port again;
- `delay_s`: sleep this long before answering each GET of an object (slow downloads).

`requests` counts the GETs answered per path. The proxy runs in threads of the test process, so a
child process reaches it through its URL (`AWS_ENDPOINT_URL`).
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class FaultProxy:
    def __init__(self, upstream: str):
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.corrupt: dict[str, int] = {}
        self.down = False
        self.delay_s = 0.0
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                if proxy.down:
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    status, reason, rheaders = resp.status, resp.reason, resp.getheaders()
                finally:
                    conn.close()
                path = urlsplit(self.path).path
                if self.command == "GET" and status in (200, 206):
                    with proxy._lock:
                        proxy.requests[path] += 1
                        hit = next((k for k, left in proxy.corrupt.items() if left > 0 and path.endswith(k)), None)
                        if hit is not None:
                            proxy.corrupt[hit] -= 1
                    if proxy.delay_s and "." in path.rsplit("/", 1)[-1]:
                        time.sleep(proxy.delay_s)
                    if hit is not None and data:
                        b = bytearray(data)
                        b[len(b) // 2] ^= 0x01
                        data = bytes(b)
                self.send_response_only(status, reason)
                for k, v in rheaders:
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self._handler = Handler
        self._listen(0)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _listen(self, port: int) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="fault-proxy")
        self._thread.start()
        self.listening = True

    def go_down(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.listening = False

    def come_back(self) -> None:
        self._listen(int(self.url.rsplit(":", 1)[1]))

    def close(self) -> None:
        if self.listening:
            self.go_down()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class routed_through:
    """Within: this process's new S3 filesystems (and children started inside) use `proxy`
    instead of moto directly; s3fs's cached instances are dropped on the way in and out."""

    def __init__(self, proxy: FaultProxy):
        self.proxy = proxy

    def __enter__(self) -> FaultProxy:
        import s3fs

        self.old = os.environ.get("AWS_ENDPOINT_URL")
        os.environ["AWS_ENDPOINT_URL"] = self.proxy.url
        s3fs.S3FileSystem.clear_instance_cache()
        return self.proxy

    def __exit__(self, *exc: object) -> None:
        import s3fs

        if self.old is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = self.old
        s3fs.S3FileSystem.clear_instance_cache()
