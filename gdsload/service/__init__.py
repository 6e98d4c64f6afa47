"""The remote feed: `gdsload serve` (server) and `RemoteLoader` (client), over gRPC.

Three packages (DESIGN.md "Service"; `tests/test_layers.py` enforces who imports whom):

| package | what | its reading order |
| --- | --- | --- |
| `protocol/` | what both ends agree on: requests and their rules, batches as messages, the bulk connection's framing, statuses, auth, limits | `gdsload.service.protocol` |
| `client/` | `RemoteLoader`: plan, cursor and output as the local loader's; receivers over one server or striped over many (a pure schedule) | `gdsload.service.client` |
| `server/` | `create_server`: a thin servicer over one stream loop; loader, stored and shared batches as sources; one memory budget; one loader pool | `gdsload.service.server` |

The client never imports the server nor the server the client; the protocol imports neither.
`status.py` and `config.py` here re-export `protocol.status` and `protocol.config` for the names
users import (`RemoteError`, `Limits`, `TlsConfig`, `Keepalive`). The contract is
`proto/gdsload/v1/feed.proto`; the generated code is `gdsload/v1/`. Importing this package costs
nothing; grpc (the `serve` extra) is imported by the modules that need it.
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
