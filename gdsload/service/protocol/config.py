"""Limits, keepalive and TLS of the feed, a server's whole configuration (`ServerConfig`), and the
gRPC channel/server options they become.

Every gRPC option the service relies on is set here, explicitly, for both ends, so that the two
agree: the server sends messages of at most `Limits.max_message_bytes` and the client accepts at
least that much; the client pings no more often than the server permits (a client pinging faster
than `grpc.http2.min_recv_ping_interval_without_data_ms` gets a GOAWAY "too_many_pings").
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
                raise GdsloadError(f"{_named(name)} must be >= 1, got {value!r}")
        t = self.bulk_ticket_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise GdsloadError(f"Limits.bulk_ticket_s must be a finite number of seconds > 0, got {t!r}")
        if self.max_message_bytes < MIN_CHUNK_BYTES + CHUNK_OVERHEAD_BYTES:
            raise GdsloadError(
                f"{_named('max_message_bytes')} must be >= "
                f"{MIN_CHUNK_BYTES + CHUNK_OVERHEAD_BYTES}, got {self.max_message_bytes}"
            )


#: The `gdsload serve` flag of each `Limits` field that has one (its messages name both).
_FLAGS = {"max_message_bytes": "--max-message-bytes", "max_batch_size": "--max-batch-size",
          "max_batch_bytes": "--max-batch-bytes", "max_streams": "--max-streams",
          "max_memory_bytes": "--max-memory", "max_pending_connections": "--max-pending-connections"}


def _named(name: str) -> str:
    """How a message names a limit: "Limits.max_streams: --max-streams" (an integer >= 1)."""
    flag = _FLAGS.get(name)
    return f"Limits.{name}: {flag}" if flag else f"Limits.{name}"


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


def tls_from_files(cert: str | Path | None, key: str | Path | None,
                   client_ca: str | Path | None = None) -> TlsConfig | None:
    """A server's TLS from `--tls-cert`, `--tls-key` and `--tls-client-ca` (None: none of them):
    the certificate and key go together, and mutual TLS needs both."""
    from gdsload.errors import GdsloadError

    if bool(cert) != bool(key):
        raise GdsloadError("--tls-cert and --tls-key go together")
    if client_ca and not cert:
        raise GdsloadError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    return TlsConfig.from_files(cert, key, client_ca) if cert else None


def _count(value: object, name: str, least: int) -> None:
    from gdsload.errors import GdsloadError

    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise GdsloadError(f"{name} must be an integer >= {least}, got {value!r}")


def _port(value: object, name: str, listen: int, address: str, what: str) -> None:
    from gdsload.errors import GdsloadError

    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise GdsloadError(f"{name} must be a port in 0..65535, got {value!r}")
    if value and value == listen:
        raise GdsloadError(f"{name} {value} is the port of --listen {address}: give {what} a port of its own")


@dataclass(frozen=True)
class ServerConfig:
    """Everything a feed server is configured with, declared and checked once (`__post_init__`:
    a bad value is a `GdsloadError` naming its `gdsload serve` flag). `gdsload serve` builds one
    from its flags, `create_server(roots, config)` takes one (or builds it from its keyword
    arguments, the same names). The fields are those arguments (`create_server` describes each).
    """

    address: str = "127.0.0.1:0"
    token: Any = None  # a bearer token, or `auth.Clients` (one line per client: issue 49), or None
    tls: TlsConfig | None = None
    limits: Limits = field(default_factory=Limits)
    keepalive: Keepalive = field(default_factory=Keepalive)
    metrics_port: int | None = None
    metrics_address: str | None = None  # None: the host of `address`
    workers: int = 2
    prefetch: int = 2
    decode_threads: int = 2
    grace_s: float = 10.0
    cache_dir: str | bool | None = None
    cache_limit: int | str = "50GB"
    decode_pool: int = 2
    share_window: int = 4
    share_hold_s: float = 0.5
    bulk: bool = True
    bulk_port: int = 0
    batch_slots: int = 0  # batches made at once (gdsload.service.server.priority); 0: the cores

    def __post_init__(self) -> None:
        from gdsload.errors import GdsloadError

        port = self.listen()[1]
        for flag, value in (("--workers", self.workers), ("--prefetch", self.prefetch),
                            ("--decode-threads", self.decode_threads), ("--share-window", self.share_window)):
            _count(value, flag, 1)
        _count(self.decode_pool, "--decode-pool", 0)
        _count(self.batch_slots, "--batch-slots", 0)
        if not (isinstance(self.grace_s, (int, float)) and self.grace_s >= 0):  # also refuses NaN
            raise GdsloadError(f"--grace must be >= 0 seconds, got {self.grace_s!r}")
        h = self.share_hold_s
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not (0 <= h and math.isfinite(h)):
            raise GdsloadError(f"--share-hold must be >= 0 seconds, got {h!r}")
        if self.metrics_port is not None:
            _port(self.metrics_port, "--metrics-port", port, self.address, "metrics")
        _port(self.bulk_port, "--bulk-port", port, self.address, "it")
        if not isinstance(self.limits, Limits):
            raise GdsloadError(f"limits must be a gdsload.service.config.Limits, got {type(self.limits).__name__}")
        if self.tls is not None:
            check_tls(self.tls)

    def metrics_host(self) -> str:
        """Where metrics bind: `metrics_address`, else the host of `address` (so a loopback feed
        does not expose its metrics to the network)."""
        return self.listen()[0] if self.metrics_address is None else self.metrics_address

    @property
    def unix(self) -> bool:
        """Listening on a unix socket (`unix:PATH`)."""
        return self.address.startswith("unix:")

    def listen(self) -> tuple[str, int]:
        """(host, port) of `address`; a unix socket's are ("127.0.0.1", 0), what metrics bind to."""
        from gdsload.errors import GdsloadError

        if not self.unix:
            return split_address(self.address, "--listen")
        if not unix_path(self.address):
            raise GdsloadError(f"--listen {self.address!r}: a unix: address needs a socket path "
                               "(unix:/run/feed.sock)")
        return "127.0.0.1", 0

    @classmethod
    def build(cls, config: ServerConfig | None = None, **kwargs: object) -> ServerConfig:
        """`config` (None: the defaults) with `kwargs` replacing its fields, checked once;
        `max_message_bytes` replaces that field of `limits`; `limits`/`keepalive` None: as they are."""
        from dataclasses import replace

        unknown = sorted(set(kwargs) - set(cls.__dataclass_fields__) - {"max_message_bytes"})
        if unknown:
            raise TypeError(f"unknown server settings {unknown}: the settings are "
                            f"{sorted(cls.__dataclass_fields__)} and max_message_bytes")
        mmb = kwargs.pop("max_message_bytes", None)
        for name in ("limits", "keepalive"):
            if kwargs.get(name, 0) is None:
                del kwargs[name]
        if mmb is not None:
            limits = kwargs.get("limits") or (config.limits if config is not None else Limits())
            kwargs["limits"] = replace(limits, max_message_bytes=mmb)
        if config is None:
            return cls(**kwargs)
        return replace(config, **kwargs) if kwargs else config


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
