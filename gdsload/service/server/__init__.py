"""The feed server: `gdsload serve`, `create_server(roots, ...) -> (FeedServer, port)`.

Reading order for one batch, from a `StreamBatches` call to the bytes on the wire:
1. `app.py`: `create_server` and `FeedServer` (gRPC server, health, metrics, bulk port, shutdown).
2. `servicer.py`: `FeedServicer`: the request checked (`gdsload.service.protocol.request`), its
   memory reserved against the server's budget, a loader opened or reused, the stream run.
3. `stored.py`: raw batches sent as stored members (`sendfile`), when the request allows it.
4. `share.py`: `ShareHub`, one producer for the jobs of a share group.
5. `pool.py`: `DecodePool`, the DALI pipelines shared by the decoding streams.
6. `catalog.py`: the datasets below the roots, opened once and shared by every stream.
7. `bulk.py`: the server's end of the bulk connection (`BulkListener`, `BulkSink`).
8. `metrics.py`, `logs.py`: Prometheus metrics and JSON-lines logs.
"""

from gdsload.service.server.app import FeedServer, create_server

__all__ = ["FeedServer", "create_server"]
