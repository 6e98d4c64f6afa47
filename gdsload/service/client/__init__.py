"""The client of the feed: `RemoteLoader`, the local loader's batches pulled from feed servers.

Reading order for one batch, from `iter(loader)` to the training loop:
1. `loader.py`: `RemoteLoader`, the facade: options, plan, cursor, output conversion.
2. `receiver.py`: `_RemoteEpoch`, the pass the training loop holds (it moves the cursor), over a
   `_Receiver` (one server at a time, failing over) or a `_StripedReceiver` (blocks of the
   batch sequence over several servers, reassembled in plan order).
3. `link.py`: how the receivers reach their servers: addresses (`dns:///`, `unix:`), channels,
   the retry budget.
4. `bulk.py`: the client's end of the bulk connection (`BulkCall`, read like a gRPC call).

The client never imports the server (`gdsload.service.server`), the local pipeline
(`gdsload.loader`) or the I/O backends (`gdsload.io`): `tests/test_layers.py`.
"""

from gdsload.service.client.loader import RemoteLoader

__all__ = ["RemoteLoader"]
