"""The feed server: `gdsload serve`, `create_server(roots, config=None, **kwargs) -> (FeedServer, port)`.

Reading order for one batch, from a `StreamBatches` call to the bytes on the wire:
1. `app.py`: `create_server` (from one `protocol.config.ServerConfig`) and `FeedServer` (gRPC
   server, health, metrics, bulk port, graceful shutdown).
2. `servicer.py`: `FeedServicer.StreamBatches`, a few lines: open the transport, open the source,
   run the stream loop; every error becomes the call's status in one place.
3. `transport.py`: the batches' way out: inside the gRPC call, or on the bulk connection (`bulk.py`,
   after the offer and the client's ticket).
4. `sources.py`: `open_source` checks the request (`protocol.request`: limits, combination rules)
   and picks the source: a share group (`share.py`), the batches as stored (`stored.py`), or the
   loader's (`LoaderSource`, where a batch becomes its chunks: `wire.encode_frames`).
5. `loaders.py`: the source's loader, `Loaders.open`: its dataset from `catalog.py`, taken from the
   `LoaderPool` or built (decoding through `pool.py`'s shared pipelines), its memory reserved
   (`admission.py`'s `Budget`, sized by `estimate.py`), positioned at the request's start.
6. `stream.py`: `serve(source, transport, meter)`, the one loop: next batch, send, count; its
   docstring is the stream's lifecycle (what happens to the loader, the reservations and the bulk
   connection on ok, cancel, drain and error). At each batch boundary the stream takes its turn in
   `priority.py`'s `Arbiter` (priorities, equal seconds per job, pauses; counted in `levels.py`).
7. `share.py`, `window.py`: a share group's producer (itself a `LoaderSource`) and its window.
8. `metrics.py`, `logs.py`: Prometheus metrics and JSON-lines logs.
"""

from gdsload.service.server.app import FeedServer, create_server

__all__ = ["FeedServer", "create_server"]
