"""Errors and gRPC status codes, in one place: exceptions -> codes on the server, codes -> exceptions
and the retry decision on the client.

Server side, every handler (and the auth interceptor) funnels what it raises through `to_status`:

| raised                                                          | status              |
| --------------------------------------------------------------- | ------------------- |
| `UnknownDataset`                                                | NOT_FOUND           |
| `BadRequest`, `PlanError`/`StateError`, other `GdsloadError`    | INVALID_ARGUMENT    |
| `OverLimit`                                                     | RESOURCE_EXHAUSTED  |
| `DatasetChanged`, `MissingDependencyError`                      | FAILED_PRECONDITION |
| `FormatError`, `DecodeError`, `CorruptDataError` (corrupt data) | DATA_LOSS           |
| `StorageError` (an I/O error, a shard that cannot be opened)    | UNAVAILABLE         |
| `Unavailable` (at capacity, shutting down)                      | UNAVAILABLE         |
| `Unauthenticated`                                               | UNAUTHENTICATED     |
| `PermissionDenied` (a priority over the caller's limit)         | PERMISSION_DENIED   |
| anything else (a bug; logged with its traceback)                | INTERNAL            |

A storage fault is this server's problem, not the request's: a transient one (`StorageError`:
EIO, a vanished shard, a network file system gone) is UNAVAILABLE, so clients retry and fail over;
a corrupt copy (`CorruptDataError`, a shard shorter than its index) is DATA_LOSS.

Client side, `RETRYABLE` are the codes of a broken or refused connection or of a server that cannot
serve now; the loader reconnects (with backoff, failing over to the next address) and resumes from
its cursor. `ELSEWHERE` (DATA_LOSS) is not retried on the same server, but another address may hold
an intact copy: the loader tries each of its other addresses once, and raises when all of them
answered it. Every other code is raised as a `RemoteError` carrying the code and the server's message.
A batch sent as stored (`gdsload.service.server.stored`) is CRC32-checked on the client instead of the
server: one that fails is a `CorruptCopy`, which the receivers take for its server's DATA_LOSS.
"""

from __future__ import annotations

from typing import NoReturn

from gdsload.errors import DecodeError, ServiceError, UnknownDataset, BadRequest, OverLimit, DatasetChanged, Unavailable, Unauthenticated, PermissionDenied, RemoteError  # noqa: F401 (re-exported: defined in errors.py)
from gdsload.errors import CorruptDataError, FormatError, GdsloadError, MissingDependencyError, StorageError, require

require("grpc", extra="serve", purpose="the remote feed (gdsload serve, RemoteLoader)")

import grpc


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnknownDataset, grpc.StatusCode.NOT_FOUND),
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (OverLimit, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DatasetChanged, grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (MissingDependencyError, grpc.StatusCode.FAILED_PRECONDITION),
    (FormatError, grpc.StatusCode.DATA_LOSS),
)

RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
})
"""Codes after which the client reconnects and resumes. INTERNAL and UNKNOWN are included because
gRPC reports a connection reset mid-stream with them; the retry budget bounds a real server bug."""

ELSEWHERE = frozenset({grpc.StatusCode.DATA_LOSS})
"""Codes after which the client tries its other addresses once each (this server's copy of the data
is corrupt; another server's may be intact), never the same server again for that batch."""


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message for an exception raised while serving a call."""
    if isinstance(exc, DecodeError):
        return grpc.StatusCode.DATA_LOSS, str(exc)
    if isinstance(exc, StorageError):
        return (grpc.StatusCode.UNAVAILABLE if exc.transient else grpc.StatusCode.DATA_LOSS), str(exc)
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    if isinstance(exc, GdsloadError):  # PlanError, StateError, unknown fields, ...
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}: {exc}); see the server log"


#: Longest status message sent, in UTF-8 bytes. gRPC sends it percent-encoded in the trailing
#: metadata, which clients cap (8 KiB by default); a longer one would replace the real status
#: with a metadata-size error.
MAX_DETAILS_BYTES = 2000


def shown(value: object, limit: int = 200) -> str:
    """`repr(value)` for a message, cut to about `limit` characters: requests echo client-sent
    values (a dataset name of 100 KB) and the message must still fit `MAX_DETAILS_BYTES`."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def abort(context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with the status `to_status` gives for `exc` (raises, as `context.abort` does);
    the message is cut to `MAX_DETAILS_BYTES`."""
    code, message = to_status(exc)
    data = message.encode()
    if len(data) > MAX_DETAILS_BYTES:
        message = data[: MAX_DETAILS_BYTES - 4].decode(errors="ignore") + " ..."
    context.abort(code, message)
    raise AssertionError("unreachable: grpc's context.abort raises")  # pragma: no cover


class CorruptCopy(CorruptDataError, grpc.RpcError):
    """(Client) a received batch whose members fail their CRC32 check (`wire.decode_body`): the
    server's copy of a shard is corrupt, as if it had answered DATA_LOSS (`is_elsewhere`)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DATA_LOSS

    def details(self) -> str:
        return str(self)


def is_retryable(err: grpc.RpcError) -> bool:
    code = err.code() if hasattr(err, "code") else None
    return code in RETRYABLE


def is_elsewhere(err: grpc.RpcError) -> bool:
    """True for the codes of `ELSEWHERE`: worth asking another address, not this one again."""
    code = err.code() if hasattr(err, "code") else None
    return code in ELSEWHERE


def from_rpc_error(err: grpc.RpcError, address: str | None = None) -> RemoteError:
    """A `RemoteError` with the code and the server's message (the message is the useful part)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    name = code.name if code is not None else "UNKNOWN"
    where = f" from {address}" if address else ""
    return RemoteError(f"{name}{where}: {details}", code=name, address=address)
