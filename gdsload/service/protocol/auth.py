"""Bearer-token authentication: a server interceptor, and the metadata a client sends.

Every Feed call must carry `authorization: Bearer TOKEN` when the server has a token (the scheme
in any case, as in HTTP); anything else ends the call with UNAUTHENTICATED before the handler runs. The grpc.health.v1 service is
exempt, so that load balancers and orchestrators (which cannot send the token) can probe the
server; health says nothing but SERVING or NOT_SERVING. Tokens are compared in constant time. A
token is a secret: send it over TLS when the network is not trusted.

Clients and priorities (issue 49): the token file (`read_clients`) holds either one token (the
file of before: every caller with it may ask priority 0 at most) or one line per client,
``NAME TOKEN HIGHEST_PRIORITY`` (blank lines and lines starting with ``#`` ignored), where TOKEN
is a bearer token or ``tls:IDENTITY``, a mutual-TLS client whose certificate's common name or a
subject alternative name is IDENTITY. `Clients.check_priority` finds a call's client (its token
first, then its certificate); a caller matched by nothing (a TLS client not listed) may ask
priority 0 at most. A server without a token file trusts every asked priority (a trusted network).
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gdsload.errors import GdsloadError
from gdsload.service.protocol.status import PermissionDenied, Unauthenticated, abort

HEADER = "authorization"
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def read_token(path: str | Path) -> str:
    """The token in a file (surrounding whitespace removed); a clear error if missing or empty."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise GdsloadError(f"--token-file: cannot read {path}: {exc.strerror or exc}") from None
    if not token or any(c.isspace() for c in token):
        raise GdsloadError(f"--token-file: {path} must hold one token (no spaces), not "
                           f"{'nothing' if not token else 'several words'}")
    return token


TLS_PREFIX = "tls:"


@dataclass(frozen=True)
class Client:
    """One line of the token file: `name`, its `secret` (a bearer token or ``tls:IDENTITY``) and
    the highest priority it may ask."""

    name: str
    secret: str
    max_priority: int

    @property
    def tls(self) -> str | None:
        return self.secret[len(TLS_PREFIX):] if self.secret.startswith(TLS_PREFIX) else None


class Clients:
    """The clients a server knows (`read_clients`): their tokens and priority limits."""

    def __init__(self, clients: Sequence[Client]):
        self.clients = tuple(clients)
        names = [c.name for c in self.clients]
        secrets = [c.secret for c in self.clients]
        if not self.clients or len(set(names)) < len(names) or len(set(secrets)) < len(secrets):
            raise GdsloadError("--token-file: each client needs a name and a token of its own (a name or a "
                               "token appears twice, or the file lists no client)")

    @classmethod
    def of(cls, token: str | Clients | None) -> Clients | None:
        """The clients of a server's `token` setting: one token (priority 0 at most), or as given."""
        if token is None or isinstance(token, Clients):
            return token
        return cls([Client("token", token, 0)])

    def tokens(self) -> list[str]:
        """The bearer tokens (the clients that are not TLS identities)."""
        return [c.secret for c in self.clients if c.tls is None]

    def find(self, metadata: Sequence[tuple[str, Any]], auth_context: dict[str, Any]) -> Client | None:
        """The client of a call: by its bearer token, else by its TLS client certificate."""
        sent = [_token_of(v) for k, v in metadata if k == HEADER]
        for c in self.clients:
            if c.tls is None and any(hmac.compare_digest(t.encode(), c.secret.encode()) for t in sent):
                return c
        names = {bytes(v).decode(errors="replace") for key in ("x509_common_name", "x509_subject_alternative_name")
                 for v in auth_context.get(key, ())}
        return next((c for c in self.clients if c.tls is not None and c.tls in names), None)

    def check_priority(self, priority: int, metadata: Sequence[tuple[str, Any]], auth_context: dict[str, Any]) -> None:
        """Refuse (`PermissionDenied`) a priority over the caller's limit, naming the limit."""
        c = self.find(metadata, auth_context)
        limit = c.max_priority if c is not None else 0
        if priority > limit:
            who = f"client {c.name!r}" if c is not None else "a caller not listed in the server's token file"
            raise PermissionDenied(f"BatchRequest.priority {priority} is over the limit of {who}, which may ask "
                                   f"priority {limit} at most (the server's --token-file); ask for <= {limit}")


def _token_of(value: object) -> str:
    scheme, _, token = str(value).strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def read_clients(path: str | Path) -> str | Clients:
    """The token file: one token (the format of before: a `str`, priority 0 at most), or one line
    per client, ``NAME TOKEN HIGHEST_PRIORITY`` (`Clients`). A clear error names a bad line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise GdsloadError(f"--token-file: cannot read {path}: {exc.strerror or exc}") from None
    lines = [(i, line.split()) for i, line in enumerate(text.splitlines(), 1)
             if line.strip() and not line.strip().startswith("#")]
    if len(lines) == 1 and len(lines[0][1]) == 1:
        return read_token(path)
    clients = []
    for i, words in lines:
        if len(words) != 3 or not re.fullmatch(r"-?[0-9]{1,9}", words[2]):
            raise GdsloadError(f"--token-file: {path} line {i} must be 'NAME TOKEN HIGHEST_PRIORITY' (TOKEN a "
                               f"bearer token or tls:IDENTITY, the priority an integer), got {len(words)} words")
        clients.append(Client(words[0], words[1], int(words[2])))
    return Clients(clients)


def interceptors(token: str | Clients | None, on_reject: Callable[[str, str], None] | None = None) -> list:
    """The server's interceptors for its `token` setting: a token check when it has bearer tokens."""
    clients = Clients.of(token)
    tokens = clients.tokens() if clients is not None else []
    return [TokenInterceptor(tokens, on_reject=on_reject)] if tokens else []


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata for a client: the bearer token, or nothing."""
    return ((HEADER, f"Bearer {token}"),) if token else ()


def _deny(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that fails with UNAUTHENTICATED."""

    def refuse(request_or_iterator, context):
        abort(context, Unauthenticated(reason))

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)


class TokenInterceptor(grpc.ServerInterceptor):
    """Checks the bearer token of every call but health checks. `on_reject(method, reason)` is
    told of each refusal (metrics, logs)."""

    def __init__(self, token: str | Sequence[str], on_reject: Callable[[str, str], None] | None = None):
        tokens = [token] if isinstance(token, str) else list(token)
        if not tokens or not all(tokens):
            raise GdsloadError("the server token must not be empty")
        self._expected = [t.encode() for t in tokens]
        self._on_reject = on_reject

    def _accepts(self, value: object) -> bool:
        """`Bearer TOKEN`, the scheme in any case (RFC 9110: auth schemes are case-insensitive),
        the token compared in constant time with each the server has."""
        scheme, _, token = str(value).strip().partition(" ")
        sent = token.strip().encode()
        return scheme.lower() == "bearer" and sum(hmac.compare_digest(sent, t) for t in self._expected) > 0

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(EXEMPT_PREFIXES):
            return continuation(handler_call_details)
        sent = [v for k, v in (handler_call_details.invocation_metadata or ()) if k == HEADER]
        if len(sent) == 1 and self._accepts(sent[0]):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        reason = ("this server needs a bearer token: send the call metadata "
                  "'authorization: Bearer TOKEN'") if not sent else "the bearer token is wrong"
        if self._on_reject is not None:
            self._on_reject(method, reason)
        return _deny(handler, reason)
