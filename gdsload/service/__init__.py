"""The remote feed: `gdsload serve` (server) and `RemoteLoader` (client), over gRPC.

| module | one line |
| --- | --- |
| `server.py` | `create_server(roots, ...) -> (server, port)`: streams a `DataLoader`'s batches |
| `client.py` | `RemoteLoader`: the local loader's batches over gRPC (the facade: arguments, plan, cursor) |
| `link.py` | how a loader reaches its servers: addresses (`dns:///`, `unix:`), channels, retry policy |
| `receiver.py` | the receiving threads of an epoch (one server, or striped over several) and its iterator |
| `wire.py` | batch <-> chunks under the message limit; transform <-> spec |
| `catalog.py` | datasets below the roots, opened once and shared by every stream |
| `status.py` | exceptions <-> gRPC status codes (the one mapping), retryable codes |
| `auth.py` | bearer-token server interceptor, client metadata |
| `config.py` | limits, keepalive, TLS; the gRPC options both ends set |
| `metrics.py` | Prometheus metrics of a server |
| `logs.py` | JSON-lines logs |
| `cli.py` | `gdsload serve` |

The contract is `proto/gdsload/v1/feed.proto`; the generated code is `gdsload/v1/`. Importing this
package costs nothing; grpc (the `serve` extra) is imported by the modules that need it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RemoteLoader", "create_server"]


def __getattr__(name: str) -> Any:
    if name == "RemoteLoader":
        from gdsload.service.client.loader import RemoteLoader

        return RemoteLoader
    if name == "create_server":
        from gdsload.service.server import create_server

        return create_server
    raise AttributeError(f"module 'gdsload.service' has no attribute {name!r}")
