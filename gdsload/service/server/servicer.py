"""The feed's servicer: `FeedServicer` (ListDatasets, GetServerInfo, StreamBatches), thin.

Each StreamBatches call runs the local `gdsload.DataLoader` itself (CPU, NumPy output, no copy)
for the requested (dataset, seed, epoch, shuffle, window, drop_last, batch size, rank, world size,
fields, payload, transform), positioned with `load_state_dict` at the requested start, and streams
its batches as chunks. Remote batches are therefore the local batches, byte for byte and in the
same order, by construction. The server keeps nothing per job between calls: the client sends its
cursor with every request, so a restarted server, or another one, continues any job.

A call is three steps, each in its own module: its transport (`transport.open_transport`: gRPC,
or the bulk connection), its source (`sources.open_source`: the request checked, its memory
reserved against the server's one `admission.Budget`, a loader taken from the `loaders.LoaderPool`
or built, or a share group joined, `share`), and the one stream loop (`stream.serve`, whose
docstring is the stream's lifecycle contract). Errors become statuses in one place,
`gdsload.service.protocol.status`.

Concurrency: one gRPC worker thread per stream (up to `Limits.max_streams`, more get UNAVAILABLE),
each with its own loader (`workers` reader threads, a ring of `prefetch + 1` batches); the opened
datasets are shared (`catalog`), and so is image decoding: the loaders of all decoding streams
hand their batches to one `pool.DecodePool` (`decode_pool` workers, default 2) instead of each
building a pipeline of its own (`decode_pool=0`, `gdsload serve --no-decode-pool`). Reading stays
per stream.

Memory: each stream reserves, before its loader allocates anything, an upper bound of what it will
hold (`estimate.stream_bytes`) against `Limits.max_memory_bytes`; a stream that does not fit next
to the open ones is refused with UNAVAILABLE (the client retries later or elsewhere), one larger
than the whole budget with RESOURCE_EXHAUSTED. A client that stops reading stalls its stream inside
that reservation: gRPC's sync server waits for each chunk to be sent, which happens only within
the client's HTTP/2 flow-control window, so the rest of what is in flight lives in the client and
the kernel.

Priorities (issue 49, `priority.Arbiter`): a request's priority is checked against its caller's
limit first (`auth.Clients.check_priority`: PERMISSION_DENIED; a server without tokens trusts
it), then its stream takes turns with the others at each batch boundary (`stream.serve`'s turn):
its job is the caller's identity with `BatchRequest.job`, its share group (if any) its group.

Shutdown (`close`, after `FeedServer.shutdown` or `stop`): health turns NOT_SERVING and `draining`
is set (new streams are refused with UNAVAILABLE, open streams end at the next batch boundary with
OK), then the share groups, parked loaders, bulk port and decode pool are closed, once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from gdsload._version import __version__
from gdsload.errors import FormatError, require

require("grpc", extra="serve", purpose="the feed server (gdsload serve)")

import grpc

from gdsload.service.protocol.auth import Clients
from gdsload.service.protocol.config import PROTOCOL_VERSION, ServerConfig
from gdsload.service.protocol.request import SERVED_ORDERS
from gdsload.service.protocol.status import abort, to_status
from gdsload.service.server import estimate
from gdsload.service.server.admission import Budget
from gdsload.service.server.catalog import Catalog
from gdsload.service.server.loaders import LoaderPool, Loaders, Settings
from gdsload.service.server.logs import LOGGER, event
from gdsload.service.server.metrics import Metrics
from gdsload.service.server.priority import Arbiter
from gdsload.service.server.share import ShareHub, identity
from gdsload.service.server.sources import LoaderSource, open_source
from gdsload.service.server.stream import Meter, serve
from gdsload.service.server.transport import open_transport
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc

SERVICE_NAME = "gdsload.v1.Feed"


def _available(*modules: str) -> bool:
    import importlib.util

    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except ModuleNotFoundError:
        return False


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _peer(context: grpc.ServicerContext) -> str:
    try:
        return context.peer()
    except Exception:
        return "?"


class FeedServicer(pb_grpc.FeedServicer):
    """The Feed service over its runtime parts: `budget` (memory and streams), `loaders` (where a
    stream's loader comes from) and `warm` (the `LoaderPool`), `share` (the share groups), `pool`
    (the decode pool, or None), `bulk` (the bulk port, or None: set by `create_server`)."""

    def __init__(self, catalog: Catalog, config: ServerConfig, metrics: Metrics, *,
                 logger: logging.Logger | None = None, decode_pool: Any = None):
        self.catalog, self.config, self.metrics = catalog, config, metrics
        self.limits = L = config.limits
        self.log = logger or logging.getLogger(LOGGER)
        self.pool = decode_pool  # gdsload.service.server.pool.DecodePool, or None: a pipeline per loader
        self.bulk: Any = None  # the side connections (BatchRequest.bulk); None: not offered
        self.budget = Budget(L.max_memory_bytes, L.max_streams)
        self.draining = self.budget.draining
        self.warm = LoaderPool(self.budget)
        settings = Settings(config.workers, config.prefetch, config.decode_threads)
        self.loaders = Loaders(catalog, L, self.budget, self.warm, settings, decode_pool)
        self.share = ShareHub(
            self.budget, lambda r: LoaderSource(self.loaders.open(r), self.warm, r, whole_epoch=True),
            metrics=metrics, chunk=lambda r: estimate.chunk_bytes(r, L), claim=self.loaders.claim,
            log=self.log, window=config.share_window, hold_s=config.share_hold_s)
        self.budget.on_short(self.share.evict_idle)  # idle windows first, then parked loaders
        self.budget.on_short(self.warm.evict)
        self.clients = Clients.of(config.token)  # None: a trusted network (every priority allowed)
        self.arbiter = Arbiter(config.batch_slots or _cores(), metrics)
        self.asking = threading.local()  # the priority of the request reserving in this thread
        self.budget.on_short(self._room_for_priority)  # last: lower streams' loaders, then evicted

    # -- the one place where exceptions become statuses ----------------------------------------
    def _fail(self, context: grpc.ServicerContext, method: str, exc: Exception) -> None:
        code, message = to_status(exc)
        self.metrics.errors.labels(code.name).inc()
        internal = code == grpc.StatusCode.INTERNAL
        event(self.log, "call_failed", level=logging.ERROR if internal else logging.WARNING,
              exc_info=exc if internal else None, method=method, code=code.name, message=message,
              peer=_peer(context))
        abort(context, exc)

    @staticmethod
    def _unary(method):
        @functools.wraps(method)
        def wrapper(self, request, context):
            try:
                return method(self, request, context)
            except Exception as exc:
                self._fail(context, method.__name__, exc)

        return wrapper

    # -- the calls --------------------------------------------------------------------------------
    @_unary
    def ListDatasets(self, request: pb.ListDatasetsRequest, context) -> pb.ListDatasetsResponse:
        if request.name:
            return pb.ListDatasetsResponse(datasets=[dataset_info(self.catalog, request.name)])
        infos = []
        for name in self.catalog.names(rescan=True):
            try:
                infos.append(dataset_info(self.catalog, name))
            except FormatError as exc:  # one broken dataset does not hide the others
                event(self.log, "dataset_unreadable", level=logging.WARNING, dataset=name, message=str(exc))
        return pb.ListDatasetsResponse(datasets=infos)

    @_unary
    def GetServerInfo(self, request: pb.GetServerInfoRequest, context) -> pb.ServerInfo:
        L = self.limits
        in_use = max(0, self.budget.reserved - self.warm.parked_nbytes())  # parked loaders are not open streams
        return pb.ServerInfo(
            version=__version__, protocol_version=PROTOCOL_VERSION,
            max_message_bytes=L.max_message_bytes, max_batch_size=L.max_batch_size,
            max_batch_bytes=L.max_batch_bytes, max_image_side=L.max_image_side,
            max_streams=L.max_streams, active_streams=self.budget.streams,
            decode_available=_available("nvidia.dali"), decode_device="cpu",
            num_datasets=len(self.catalog.names()), media_available=_available("nvidia.dali", "av"),
            max_memory_bytes=L.max_memory_bytes, memory_in_use_bytes=in_use, serves_block_stride=True,
            orders=SERVED_ORDERS, priorities=self.arbiter.usage(), serves_windows=True,
        )

    def StreamBatches(self, request: pb.BatchRequest, context) -> Iterator[bytes]:
        try:
            transport = yield from open_transport(request, context, self.bulk, self.metrics)
            if transport is None:
                return  # the call ended while the client connected
            try:
                if self.clients is not None:
                    self.clients.check_priority(request.priority, context.invocation_metadata() or (),
                                                context.auth_context() or {})
                self.asking.priority = request.priority
                try:
                    source = open_source(request, loaders=self.loaders, hub=self.share, context=context,
                                         bulk=transport.bulk, log=self.log, metrics=self.metrics)
                finally:
                    self.asking.priority = None
            except BaseException:
                transport.close()
                raise
            turn = self.turn(request, context, source, transport)
            yield from serve(source, transport, Meter(self.metrics, self.log, source, _peer(context)),
                             draining=self.draining, turn=turn)
        except Exception as exc:
            self._fail(context, "StreamBatches", exc)

    def turn(self, request: pb.BatchRequest, context: grpc.ServicerContext, source: Any, transport: Any) -> Any:
        """The stream's place in the arbiter: its job (the caller and `BatchRequest.job`; no job: a
        job of its own), priority and share group (`share.SharedSource.key`); whether its client
        reads (`transport.BulkFrames.full`; gRPC cannot tell)."""
        job = (identity(context), request.job) if request.job else ("stream", id(source))
        turn = self.arbiter.enter(job, request.priority, getattr(source, "key", None),
                                  notices=request.understands_pause)
        turn.release = getattr(source, "suspend", None)
        turn.full = getattr(transport, "full", None)
        context.add_callback(turn.wake)  # the call's end wakes a waiting turn at once
        if hasattr(source, "rank"):  # its loader's decoding, in the turn's order (`pool.DecodePool`)
            source.rank(turn)
        return turn

    def _room_for_priority(self, need: int) -> None:
        """(The budget's last room maker) memory for a stream of priority p that does not fit: the
        loaders of streams below p waiting for their turn are parked and evicted (they go on, from
        their next step, when memory returns: `sources.LoaderSource.suspend`)."""
        priority = getattr(self.asking, "priority", None)
        if priority is not None and self.arbiter.release_below(priority, need):
            self.warm.evict(need)

    # -- state and shutdown ------------------------------------------------------------------------
    def active_streams(self) -> int:
        return self.budget.streams

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no stream is open (True) or `timeout_s` passed (False)."""
        return self.budget.wait_idle(timeout_s)

    @property
    def warm_hits(self) -> int:
        """Streams that took a parked loader (`LoaderPool.hits`)."""
        return self.warm.hits

    @property
    def warm_loaders(self) -> int:
        """Loaders kept parked at most (`LoaderPool.keep`; 0: none)."""
        return self.warm.keep

    @warm_loaders.setter
    def warm_loaders(self, keep: int) -> None:
        self.warm.keep = keep

    def drain(self) -> None:
        """Streams end at their next batch boundary; waiting turns look now."""
        self.draining.set()
        self.arbiter.wake_all()

    def close(self) -> None:
        """Close the runtime parts (the streams ended, or gRPC cancelled them): share groups,
        parked loaders, the bulk port, the decode pool (queued batches fail; its pipelines go now,
        not at exit)."""
        self.drain()
        self.share.close()
        self.warm.close()
        if self.bulk is not None:
            self.bulk.close()
        if self.pool is not None:
            self.pool.close()


def dataset_info(catalog: Catalog, name: str) -> pb.DatasetInfo:
    ds = catalog.dataset(name)
    return pb.DatasetInfo(
        name=name, dataset_id=ds.dataset_id, num_samples=len(ds), shard_sizes=ds.shard_sizes,
        fields=dict(ds.shards.fields), manifest_json=json.dumps(ds.shards.manifest, sort_keys=True),
        field_names=list(ds.shards.fields),
    )
