"""The `RemoteLoader` options that are not the local loader's, in frozen groups:
`RetryPolicy` (how long and how often to retry), `Connection` (credentials, TLS, deadlines,
message size, keepalive, the bulk connection) and `stripe.policy.StripePolicy` (how to stripe).

Each validates itself (`__post_init__`), naming the option, and is what `RemoteLoader` holds
(`loader.retry`, `loader.connection`, `loader.striping`). A loader takes a group as an object
(`retry=RetryPolicy(retry_timeout_s=600)`) or its fields as keywords, as before
(`retry_timeout_s=600`); `group` refuses both at once for one field.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gdsload.errors import ConfigError
from gdsload.service.protocol.config import Keepalive, MiB, channel_options, read_pem

Pem = bytes | str | Path | None


def _seconds(owner: Any, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not _real(value) or not value > 0:
            raise ConfigError(f"{name} must be > 0 seconds, got {value!r}")
        object.__setattr__(owner, name, float(value))


@dataclass(frozen=True)
class RetryPolicy:
    """A loader keeps retrying (reconnecting, failing over) for `retry_timeout_s` without a batch
    or an answer, and with `max_retries` also gives up after that many consecutive failed attempts
    (None: the time only); it waits `backoff_s` after a first failure, doubling to `max_backoff_s`,
    with jitter (`backoff`)."""

    retry_timeout_s: float = 120.0
    max_retries: int | None = None
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        _seconds(self, "retry_timeout_s", "backoff_s", "max_backoff_s")
        n = self.max_retries
        if n is not None and (not _real(n) or not n >= 0 or math.isinf(n)):
            raise ConfigError(f"max_retries must be None or >= 0, got {n!r}")
        if n is not None:
            object.__setattr__(self, "max_retries", int(n))

    def backoff(self, failures: int, jitter: float) -> float:
        """The wait after `failures` in a row; `jitter` in [0, 1) takes it down to half."""
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** max(0, failures - 1))
        return delay * (0.5 + 0.5 * jitter)


@dataclass(frozen=True)
class Connection:
    """How a loader talks to its servers. `token`: bearer token; `tls`: TLS with the system roots;
    `tls_ca`: CA bundle (PEM bytes or a path; implies TLS); `tls_cert`/`tls_key`: client
    certificate for mutual TLS; `tls_server_name`: the name checked in the server certificate;
    `deadline_s`: deadline of unary calls and the longest wait for a stream's next message;
    `stream_deadline_s`: gRPC deadline of one stream (then it is resumed); `max_message_bytes`:
    the largest message accepted; `keepalive`: HTTP/2 keepalive (default `Keepalive()`); `bulk`:
    take batches on the server's bulk connection when it offers one (never with TLS)."""

    token: str | None = None
    tls: bool = False
    tls_ca: Pem = None
    tls_cert: Pem = None
    tls_key: Pem = None
    tls_server_name: str | None = None
    deadline_s: float = 30.0
    stream_deadline_s: float = 3600.0
    max_message_bytes: int = 64 * MiB
    keepalive: Keepalive | None = None
    bulk: bool = True

    def __post_init__(self) -> None:
        _seconds(self, "deadline_s", "stream_deadline_s")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("mutual TLS needs both tls_cert and tls_key")
        n = self.max_message_bytes
        if not _real(n) or not n > 0 or math.isinf(n):
            raise ConfigError(f"max_message_bytes must be a number of bytes > 0, got {n!r}")
        object.__setattr__(self, "max_message_bytes", int(n))

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert or self.tls_key)

    def channel_args(self) -> tuple[tuple[bytes | None, ...] | None, list[tuple[str, Any]], bool]:
        """What `link.Link` makes its channels from: the PEM bytes (read here; grpc's credentials
        do not pickle) or None, the channel options, and whether to use the bulk connection."""
        pems = None
        if self.uses_tls:
            pems = (read_pem(self.tls_ca, "tls_ca") if self.tls_ca else None,
                    read_pem(self.tls_key, "tls_key") if self.tls_key else None,
                    read_pem(self.tls_cert, "tls_cert") if self.tls_cert else None)
        options: list[tuple[str, Any]] = channel_options(self.max_message_bytes, self.keepalive or Keepalive())
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return pems, options, bool(self.bulk)


def group(cls: type, given: Any, keywords: dict[str, Any], name: str) -> Any:
    """The option group `cls` of a loader: `given` (an instance, or None), else `cls` made of the
    loader's keywords for its fields (those of `keywords` named as a field; the others keep their
    defaults). A keyword whose value is not its default beside a `given` object is refused,
    naming both places."""
    defaults = {f.name: f.default for f in fields(cls) if f.name in keywords}
    values = {k: keywords[k] for k in defaults}
    if given is None:
        return cls(**values)
    if not isinstance(given, cls):
        raise ConfigError(f"{name} must be a {cls.__module__}.{cls.__name__}, got {given!r}")
    clash = [k for k, v in values.items() if not _same(v, defaults[k])]
    if clash:
        one = len(clash) == 1
        raise ConfigError(f"{', '.join(clash)}: given as {'a keyword' if one else 'keywords'} and in "
                          f"{name}={cls.__name__}(...) too; set {'it' if one else 'them'} in one place")
    return given


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # (an array, say: not the default)
        return False


def _real(value: Any) -> bool:
    """A number of the real line (NumPy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
