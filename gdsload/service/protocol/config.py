"""Limits, keepalive and TLS of the feed, and the gRPC channel/server options they become.

Every gRPC option the service relies on is set here, explicitly, for both ends, so that the two
agree: the server sends messages of at most `Limits.max_message_bytes` and the client accepts at
least that much; the client pings no more often than the server permits (a client pinging faster
than `grpc.http2.min_recv_ping_interval_without_data_ms` gets a GOAWAY "too_many_pings").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20

#: Version of the gdsload.v1 protocol this code speaks (ServerInfo.protocol_version).
PROTOCOL_VERSION = 1

#: Bytes a chunk needs besides its data (tags, lengths, step/position/epoch varints): a generous
#: bound, so that header + data + this never exceeds the message limit.
CHUNK_OVERHEAD_BYTES = 256

#: Smallest `max_chunk_bytes` a client may ask for (a chunk must carry some data).
MIN_CHUNK_BYTES = 4096


@dataclass(frozen=True)
class Limits:
    """What one server accepts. Requests over a limit fail with RESOURCE_EXHAUSTED naming it.

    `max_message_bytes`: the largest gRPC message sent (every BatchChunk fits in it; 4 MiB is
    gRPC's customary default). `max_request_bytes`: the largest message received (requests are
    small). `max_batch_size`: samples per batch. `max_batch_bytes`: the largest batch body the
    server builds (an upper bound from the index, checked before any read). `max_image_side`:
    the largest decoded image side (transform size and resize), in pixels. `max_streams`:
    concurrent StreamBatches calls (more get UNAVAILABLE, a retryable "at capacity").
    `max_memory_bytes`: the memory budget of all open streams together (each stream reserves an
    upper bound of what its loader holds: ring slots, decoder buffers, the chunk being sent); a
    stream that does not fit next to the open ones gets UNAVAILABLE, one larger than the whole
    budget RESOURCE_EXHAUSTED. None: `default_max_memory()` (half the machine's memory).
    `max_pending_connections`: bulk connections (`gdsload.service.server.bulk`) accepted that have not
    presented a ticket yet; one more is closed as it is accepted. `bulk_ticket_s`: the seconds a
    bulk connection has for its whole ticket (not per read).
    """

    max_message_bytes: int = 4 * MiB
    max_request_bytes: int = 1 * MiB
    max_batch_size: int = 65536
    max_batch_bytes: int = 1 << 30
    max_image_side: int = 4096
    max_streams: int = 64
    max_memory_bytes: int | None = None
    max_pending_connections: int = 64
    bulk_ticket_s: float = 5.0

    def __post_init__(self) -> None:
        from gdsload.errors import GdsloadError

        if self.max_memory_bytes is None:
            object.__setattr__(self, "max_memory_bytes", default_max_memory())
        for name in ("max_message_bytes", "max_request_bytes", "max_batch_size", "max_batch_bytes",
                     "max_image_side", "max_streams", "max_memory_bytes", "max_pending_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GdsloadError(f"Limits.{name} must be a positive integer, got {value!r}")
        t = self.bulk_ticket_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise GdsloadError(f"Limits.bulk_ticket_s must be a finite number of seconds > 0, got {t!r}")
        if self.max_message_bytes < MIN_CHUNK_BYTES + CHUNK_OVERHEAD_BYTES:
            raise GdsloadError(
                f"Limits.max_message_bytes must be at least "
                f"{MIN_CHUNK_BYTES + CHUNK_OVERHEAD_BYTES}, got {self.max_message_bytes}"
            )


def split_address(address: str, what: str = "--listen") -> tuple[str, int]:
    """`HOST:PORT` (or `[IPv6]:PORT`) as (host, port), refusing what gRPC would misread: no host,
    a port that is not a number, or one outside 0..65535 (gRPC wraps 99999 to 34463 silently)."""
    from gdsload.errors import GdsloadError

    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise GdsloadError(f"{what} {address!r} must be HOST:PORT (e.g. 127.0.0.1:50051, [::]:50051)")
    if not 0 <= int(port) <= 65535:
        raise GdsloadError(f"{what} {address!r}: port {int(port)} is outside 0..65535")
    return host, int(port)


def dns_rest(address: str) -> str:
    """`HOST:PORT` of a `dns:[//AUTHORITY]/HOST:PORT` address (the authority, a DNS server, is not
    used); any other address as it is."""
    if not address.startswith("dns:"):
        return address
    rest = address[len("dns:"):]
    return rest[2:].partition("/")[2] if rest.startswith("//") else rest


def unix_path(address: str) -> str:
    """The socket path of a `unix:PATH` address (`unix:///run/x` and `unix:/run/x` alike)."""
    path = address[len("unix:"):]
    return "/" + path.lstrip("/") if path.startswith("//") else path


def bind_host(host: str) -> str:
    """A host as sockets take it: `[::1]` -> `::1`."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def machine_memory_bytes() -> int:
    """Memory this process may use: the physical RAM, or the cgroup limit when lower (a container)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def default_max_memory() -> int:
    """Default server-wide memory budget for streams: half of `machine_memory_bytes()`, leaving
    the rest to the page cache (which serves the shards), the process and the rest of the host."""
    return machine_memory_bytes() // 2


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 keepalive, both ends. Times in milliseconds.

    The client pings every `time_ms` and drops a connection whose ping is not answered in
    `timeout_ms` (a dead server is noticed in about 40 s even without traffic); the server accepts
    pings as often as every `min_ping_interval_ms` and pings idle clients itself.
    """

    time_ms: int = 30_000
    timeout_ms: int = 10_000
    min_ping_interval_ms: int = 10_000


@dataclass(frozen=True)
class TlsConfig:
    """Server TLS: PEM certificate chain and private key; `client_ca` turns on mutual TLS."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> TlsConfig:
        return cls(read_pem(cert, "--tls-cert"), read_pem(key, "--tls-key"),
                   read_pem(client_ca, "--tls-client-ca") if client_ca else None)


def read_pem(value: str | Path | bytes, what: str) -> bytes:
    """PEM bytes given as bytes or a file path; a clear error for a missing or empty file."""
    from gdsload.errors import GdsloadError

    if isinstance(value, bytes):
        return value
    try:
        data = Path(value).read_bytes()
    except OSError as exc:
        raise GdsloadError(f"{what}: cannot read {value}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise GdsloadError(f"{what}: {value} is not a PEM file (no '-----BEGIN' line)")
    return data


def check_tls(tls: TlsConfig) -> None:
    """Refuse a certificate chain or private key that OpenSSL cannot use, or a key that is not the
    certificate's, naming the problem (gRPC only says that it cannot bind). The PEM data go
    through files in a private temporary folder because `ssl` loads certificates from files."""
    import ssl
    import tempfile

    from gdsload.errors import GdsloadError

    with tempfile.TemporaryDirectory(prefix="gdsload-tls-") as tmp:  # mode 0700
        cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert.write_bytes(tls.cert_chain)
        key.touch(mode=0o600)
        key.write_bytes(tls.private_key)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=b"")
        except ssl.SSLError as exc:
            reason = exc.reason or str(exc)
            if "KEY_VALUES_MISMATCH" in str(exc):
                raise GdsloadError("--tls-key is not the private key of --tls-cert (OpenSSL: key values "
                                   "mismatch); give the key the certificate was issued for") from None
            raise GdsloadError(f"--tls-cert/--tls-key cannot be used: {reason} (OpenSSL: {exc}); "
                               "give a PEM certificate chain and its unencrypted PEM private key") from None
        if tls.client_ca is not None:
            ca = Path(tmp, "ca.pem")
            ca.write_bytes(tls.client_ca)
            try:
                ssl.create_default_context(cafile=str(ca))
            except ssl.SSLError as exc:
                raise GdsloadError(f"--tls-client-ca cannot be used: {exc.reason or exc}") from None


def server_options(limits: Limits, keepalive: Keepalive) -> list[tuple[str, int]]:
    """gRPC server options. `grpc.so_reuseport` is off so that a second server on a port in use
    fails to bind instead of silently sharing it."""
    return [
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.max_receive_message_length", limits.max_request_bytes),
        ("grpc.keepalive_time_ms", keepalive.time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", keepalive.min_ping_interval_ms),
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive.min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]


def channel_options(max_message_bytes: int, keepalive: Keepalive) -> list[tuple[str, int]]:
    """gRPC client channel options. The reconnect backoff is short (0.1 s to 2 s) because the
    loader does its own retries with backoff; a channel stuck in a long backoff would make a
    restarted server look dead for up to two minutes."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", 1 * MiB),
        ("grpc.keepalive_time_ms", keepalive.time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.enable_retries", 0),
    ]
