"""`gdsload serve` refuses bad flags at start-up (exit 1, one line naming the flag) instead of
listening on a wrapped port or failing every stream later; metrics bind the listen host; a TLS
key that is not the certificate's is named as such."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import urllib.request

import pytest
from feedkit import free_port

from gdsload.errors import GdsloadError
from gdsload.service.server import create_server


def _serve(roots, *args, timeout=60):
    """`python -m gdsload.service ROOT ARGS...`, expected to exit by itself (killed after `timeout`)."""
    proc = subprocess.Popen([sys.executable, "-m", "gdsload.service", str(roots), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"`serve {' '.join(args)}` did not exit at start-up (it served): {err[-500:]}")
    return proc.returncode, err.strip().splitlines()[-1] if err.strip() else ""


def test_bad_flags_exit_1_naming_the_flag(roots):
    port = free_port()
    cases = [
        (["--listen", "127.0.0.1:99999"], "--listen", "99999"),
        (["--listen", "127.0.0.1"], "--listen", "HOST:PORT"),
        (["--listen", f"127.0.0.1:{port}", "--workers", "0"], "--workers", "0"),
        (["--listen", f"127.0.0.1:{port}", "--prefetch", "-1"], "--prefetch", "-1"),
        (["--listen", f"127.0.0.1:{port}", "--decode-threads", "0"], "--decode-threads", "0"),
        (["--listen", f"127.0.0.1:{port}", "--max-streams", "0"], "--max-streams", "0"),
        (["--listen", f"127.0.0.1:{port}", "--max-message-bytes", "100"], "--max-message-bytes", "100"),
        (["--listen", f"127.0.0.1:{port}", "--grace", "-1"], "--grace", "-1"),
        (["--listen", f"127.0.0.1:{port}", "--metrics-port", "70000"], "--metrics-port", "70000"),
        (["--listen", f"127.0.0.1:{port}", "--metrics-port", str(port)], "--metrics-port", str(port)),
        (["--listen", f"127.0.0.1:{port}", "--max-memory", "lots"], "--max-memory", "lots"),
        (["--listen", f"127.0.0.1:{port}", "--log-level", "LOUD"], "--log-level", "LOUD"),
    ]
    for args, flag, value in cases:
        code, line = _serve(roots, *args)
        assert code == 1 and flag in line and value in line and "Traceback" not in line, (args, code, line)


def test_metrics_port_in_use_exits_1_naming_it(roots):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        code, line = _serve(roots, "--listen", f"127.0.0.1:{free_port()}", "--metrics-port", str(taken))
    assert code == 1 and f"--metrics-port {taken}" in line and "Errno" not in line, line


def test_create_server_validates_its_arguments(roots):
    for kw, words in [({"address": "127.0.0.1:65536"}, "65536"), ({"workers": 0}, "--workers"),
                      ({"address": "127.0.0.1:5000", "metrics_port": 5000}, "--metrics-port 5000")]:
        with pytest.raises(GdsloadError, match=words):
            create_server([str(roots)], **kw)


def test_metrics_bind_the_listen_host_by_default(roots):
    """Bound to 127.0.0.1, the exporter refuses 127.0.0.2 (another loopback address); bound to
    0.0.0.0, as before, it answered there, that is on every interface."""
    srv, _ = create_server([str(roots)], address="127.0.0.1:0", token="t", metrics_port=0)
    srv.start()
    try:
        port = srv.metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b"gdsload_feed" in r.read()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
    finally:
        srv.shutdown(grace_s=1)
    srv, _ = create_server([str(roots)], address="127.0.0.1:0", metrics_port=0, metrics_address="0.0.0.0")
    srv.start()
    try:
        socket.create_connection(("127.0.0.2", srv.metrics_port), timeout=5).close()  # explicit: all
    finally:
        srv.shutdown(grace_s=1)


def test_help_says_where_metrics_bind():
    out = subprocess.run([sys.executable, "-m", "gdsload.service", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "host of --listen" in " ".join(out.split())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_key_of_another_certificate_is_named(roots, tmp_path):
    from gdsload.service.protocol.config import TlsConfig

    for name in ("a", "b"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
                        "-subj", f"/CN={name}"], cwd=tmp_path, check=True, capture_output=True)
    tls = TlsConfig.from_files(tmp_path / "a.pem", tmp_path / "b.key")
    with pytest.raises(GdsloadError) as e:
        create_server([str(roots)], address=f"127.0.0.1:{free_port()}", tls=tls)
    assert "--tls-key" in str(e.value) and "not the private key" in str(e.value)
    assert "in use" not in str(e.value)
    code, line = _serve(roots, "--listen", f"127.0.0.1:{free_port()}", "--tls-cert", str(tmp_path / "a.pem"),
                        "--tls-key", str(tmp_path / "b.key"))
    assert code == 1 and "not the private key" in line, line
    good = TlsConfig.from_files(tmp_path / "a.pem", tmp_path / "a.key")
    srv, port = create_server([str(roots)], tls=good)
    assert port > 0
    srv.stop(None)


def test_port_in_use_says_so(roots):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(GdsloadError, match="in use"):
            create_server([str(roots)], address=f"127.0.0.1:{busy.getsockname()[1]}")
