"""Bearer-token authentication: a server interceptor, and the metadata a client sends.

Every Feed call must carry `authorization: Bearer TOKEN` when the server has a token (the scheme
in any case, as in HTTP); anything else ends the call with UNAUTHENTICATED before the handler runs. The grpc.health.v1 service is
exempt, so that load balancers and orchestrators (which cannot send the token) can probe the
server; health says nothing but SERVING or NOT_SERVING. Tokens are compared in constant time. A
token is a secret: send it over TLS when the network is not trusted.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path

import grpc

from gdsload.errors import GdsloadError
from gdsload.service.protocol.status import Unauthenticated, abort

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

    def __init__(self, token: str, on_reject: Callable[[str, str], None] | None = None):
        if not token:
            raise GdsloadError("the server token must not be empty")
        self._expected = token.encode()
        self._on_reject = on_reject

    def _accepts(self, value: object) -> bool:
        """`Bearer TOKEN`, the scheme in any case (RFC 9110: auth schemes are case-insensitive),
        the token compared in constant time."""
        scheme, _, token = str(value).strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected)

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
