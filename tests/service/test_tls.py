"""TLS and mutual TLS, with certificates made by the openssl command (skipped without it)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from gdsload.service.client import RemoteLoader
from gdsload.service.protocol.config import TlsConfig
from gdsload.service.server import create_server
from gdsload.service.protocol.status import RemoteError

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=gdsload test CA", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={'localhost' if name == 'server' else 'trainer'}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf", cwd=d)
    return d


def _serve(roots, tls):
    srv, port = create_server([str(roots)], tls=tls)
    srv.start()
    return srv, f"127.0.0.1:{port}"  # the certificate names IP:127.0.0.1 too


def test_tls(roots, pki):
    srv, address = _serve(roots, TlsConfig.from_files(pki / "server.pem", pki / "server.key"))
    try:
        ok = RemoteLoader(address, dataset="feats", batch_size=64, tls_ca=pki / "ca.pem", output="numpy")
        assert sum(len(b["__key__"]) for b in ok) == 256
        # the bulk connection is plaintext: a TLS server never offers it, its batches stay inside TLS
        assert srv.servicer.bulk is None
        assert not srv.metrics.registry.get_sample_value("gdsload_feed_bulk_streams_total")
        plain = RemoteLoader(address, dataset="feats", max_retries=0, deadline_s=1)
        with pytest.raises(RemoteError):
            len(plain)
    finally:
        srv.shutdown(grace_s=1)


def test_mutual_tls(roots, pki):
    tls = TlsConfig.from_files(pki / "server.pem", pki / "server.key", client_ca=pki / "ca.pem")
    srv, address = _serve(roots, tls)
    try:
        ok = RemoteLoader(address, dataset="feats", batch_size=64, tls_ca=pki / "ca.pem",
                          tls_cert=pki / "client.pem", tls_key=pki / "client.key", output="numpy")
        assert len(ok) == 4 and sum(len(b["__key__"]) for b in ok) == 256
        no_cert = RemoteLoader(address, dataset="feats", tls_ca=pki / "ca.pem", max_retries=0, deadline_s=3)
        with pytest.raises(RemoteError) as e:
            len(no_cert)
        assert e.value.code == "UNAVAILABLE"
    finally:
        srv.shutdown(grace_s=1)


def test_dns_name_is_what_tls_checks(roots, pki):
    """A `dns:///localhost:PORT` loader connects to the addresses localhost resolves to and checks
    the certificate against "localhost": a certificate naming only that name is accepted, while the
    same server reached as 127.0.0.1 is refused (the check is real)."""
    d = pki
    (d / "dns.cnf").write_text("subjectAltName=DNS:localhost\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "dns.key",
             "-out", "dns.csr", "-subj", "/CN=localhost", cwd=d)
    _openssl("x509", "-req", "-in", "dns.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "dns.pem", "-days", "2", "-extfile", "dns.cnf", cwd=d)
    srv, address = _serve(roots, TlsConfig.from_files(d / "dns.pem", d / "dns.key"))
    port = address.rpartition(":")[2]
    try:
        ok = RemoteLoader(f"dns:///localhost:{port}", dataset="feats", batch_size=64, tls_ca=d / "ca.pem",
                          output="numpy", backoff_s=0.02, max_backoff_s=0.2)
        assert sum(len(b["__key__"]) for b in ok) == 256
        assert ok.stats()["servers"][address]["batches"] == 4
        by_ip = RemoteLoader(address, dataset="feats", tls_ca=d / "ca.pem", max_retries=0, deadline_s=2)
        with pytest.raises(RemoteError):
            len(by_ip)
    finally:
        srv.shutdown(grace_s=1)
