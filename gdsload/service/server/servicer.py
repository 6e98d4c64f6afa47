"""The feed's servicer: `FeedServicer` (ListDatasets, GetServerInfo, StreamBatches).

Each StreamBatches call runs the local `gdsload.DataLoader` itself (CPU, NumPy output, no copy)
for the requested (dataset, seed, epoch, shuffle, window, drop_last, batch size, rank, world size,
fields, payload, transform), positioned with `load_state_dict` at the requested start, and streams
its batches as chunks. Remote batches are therefore the local batches, byte for byte and in the
same order, by construction. The server keeps nothing per job between calls: the client sends its
cursor with every request, so a restarted server, or another one, continues any job.

Concurrency: one gRPC worker thread per stream (up to `Limits.max_streams`, more get UNAVAILABLE),
each with its own loader (`workers` reader threads, a ring of `prefetch + 1` batches); the opened
datasets are shared (see `gdsload.service.server.catalog`), and so is image decoding: the loaders of all
decoding streams hand their batches to one `gdsload.service.server.pool.DecodePool` (`decode_pool`
workers, default 2, DALI pipelines with a thread per core, streams served in turn) instead of each
building a pipeline of its own (`decode_pool=0`, `gdsload serve --no-decode-pool`). Reading stays
per stream.

Sharing: a request with `BatchRequest.share` is served by `gdsload.service.server.share.ShareHub`:
requests that agree on everything but their position, under one share name and the same
credentials, take the batches of one loader (read and decoded once, serialized once, the same
bytes sent to each), each from its own cursor; without a share name nothing of that runs.

Memory: each stream reserves, before its loader allocates anything, an upper bound of what it will
hold (`FeedServicer.stream_memory`: the ring's slots as the loader sizes them,
`BatchLayout.slot_nbytes`, its batches' own staging buffers, the decoder's output and
intermediate buffers, two chunks in gRPC) against one server-wide budget,
`Limits.max_memory_bytes`. A stream that does not fit next to the open ones is refused with
UNAVAILABLE (the client retries later or elsewhere), one larger than the whole budget with
RESOURCE_EXHAUSTED. A client that stops reading stalls its stream inside that reservation: gRPC's
sync server waits for each chunk to be sent, which happens only within the client's HTTP/2
flow-control window, so the rest of what is in flight lives in the client and the kernel.

Shutdown (`FeedServer.shutdown`, SIGTERM under `gdsload serve`): health turns NOT_SERVING, new
streams are refused with UNAVAILABLE, open streams end at the next batch boundary (status OK, so
their clients resume elsewhere or after the restart with nothing lost), then the gRPC server stops
after at most `grace_s`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import numpy as np

from gdsload._version import __version__
from gdsload.decode.image import DecodeError
from gdsload.errors import FormatError, GdsloadError, require

require("grpc", extra="serve", purpose="the feed server (gdsload serve)")
require("grpc_health", extra="serve", purpose="the feed server's health service")

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gdsload.loader.dataloader import DataLoader
from gdsload.service.protocol import mixwire, request, wire
from gdsload.service.protocol.auth import TokenInterceptor
from gdsload.service.server.bulk import BulkListener, BulkSink, ClientGone
from gdsload.service.protocol.framing import WAIT_S as BULK_WAIT_S
from gdsload.service.protocol.framing import offer_message
from gdsload.service.server.catalog import Catalog
from gdsload.service.protocol.config import (
    MIN_CHUNK_BYTES,
    PROTOCOL_VERSION,
    Keepalive,
    Limits,
    TlsConfig,
    bind_host,
    check_tls,
    server_options,
    split_address,
    unix_path,
)
from gdsload.service.server.logs import LOGGER, event
from gdsload.service.server.metrics import Metrics
from gdsload.service.server.share import ShareHub, request_key
from gdsload.service.server.stored import StoredBatches
from gdsload.service.protocol.status import (
    BadRequest,
    DatasetChanged,
    OverLimit,
    Unavailable,
    abort,
    to_status,
)
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc

SERVICE_NAME = "gdsload.v1.Feed"
_SKIP_REMEDY = ("set BatchRequest.on_error = ON_ERROR_SKIP to leave corrupt samples out "
                "(BatchHeader.skipped_keys names them)")
#: Decoder buffers of a decoding stream, in output batches: DALI's output and the decoded,
#: resized images before the crop (an upper bound for the usual source sizes).
_DECODE_BUFFERS = 2
#: Fixed bytes of a stream (reader threads, I/O backend, allocator slack), and more for one that
#: decodes (DALI's pipeline and thread pool): measured 40-50 MB RSS for a decoding stream of 8 to
#: 64 images at 224 px on the CPU, over what its ring and buffers take.
STREAM_OVERHEAD_BYTES = 8 << 20
DECODER_OVERHEAD_BYTES = 64 << 20
#: Header bytes per sample of a serialized batch (its key, source name and framing), an estimate
#: for share windows; a window holds no more than it reserved whatever the keys (gdsload.service.server.share).
KEY_BYTES = 256


def _cut(text: str, limit: int = 64) -> str:
    """A client-sent id as echoed in a message: ids are short, anything longer is cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _decode_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:
        return False


def _media_available() -> bool:
    import importlib.util

    return _decode_available() and importlib.util.find_spec("av") is not None


def _media_memory(media: dict[str, Any], req: pb.BatchRequest, prefetch: int) -> int:
    """Ring bytes of decoded video/audio fields (outputs and their frame/length columns) for a
    stream; a video without a size is bounded by its max_pixels (or 4K)."""
    per_sample = 0
    for t in media.values():
        if t.kind == "video":
            hw = None if t.size is not None else (1, t.max_pixels or 3840 * 2160)
            per_sample += int(np.prod(t.output_shape(hw))) * np.dtype(t.dtype).itemsize + 8 * t.frames * t.clips
        else:
            per_sample += int(np.prod(t.output_shape())) * 4 + 8
    return (prefetch + 1) * per_sample * req.batch_size


def _peer(context: grpc.ServicerContext) -> str:
    try:
        return context.peer()
    except Exception:
        return "?"


class FeedServicer(pb_grpc.FeedServicer):
    """The Feed service. Errors go through `gdsload.service.protocol.status` (the one mapping)."""

    def __init__(self, catalog: Catalog, limits: Limits, metrics: Metrics, *, workers: int = 2,
                 prefetch: int = 2, decode_threads: int = 2, logger: logging.Logger | None = None,
                 decode_pool: Any = None, share_window: int = 4, share_hold_s: float = 0.5):
        self.catalog = catalog
        self.limits = limits
        self.metrics = metrics
        self.workers = workers
        self.prefetch = prefetch
        self.decode_threads = decode_threads
        self.pool = decode_pool  # gdsload.service.server.pool.DecodePool, or None: a pipeline per stream
        self.log = logger or logging.getLogger(LOGGER)
        self.draining = threading.Event()
        self._lock = threading.Lock()
        self._active = 0
        self._reserved = 0  # bytes of limits.max_memory_bytes held by open streams (and parked loaders)
        # (key, loader, memory, parked at): loaders of finished streams kept for the next stream of
        # the same request (a striping client asks for one block of batches per stream)
        self._warm: list[tuple] = []
        self.warm_loaders = 8
        self.warm_hits = 0
        self._idle = threading.Condition(self._lock)
        # streams with BatchRequest.share: one producer per share group (gdsload.service.server.share)
        self.share = ShareHub(self, window=share_window, hold_s=share_hold_s, skip_remedy=_SKIP_REMEDY)
        self.bulk: BulkListener | None = None  # the side connections (BatchRequest.bulk); None: not offered

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

    # -- unary calls -----------------------------------------------------------------------------
    def _info(self, name: str) -> pb.DatasetInfo:
        ds = self.catalog.dataset(name)
        return pb.DatasetInfo(
            name=name, dataset_id=ds.dataset_id, num_samples=len(ds), shard_sizes=ds.shard_sizes,
            fields=dict(ds.shards.fields), manifest_json=_manifest_text(ds),
            field_names=list(ds.shards.fields),
        )

    @_unary
    def ListDatasets(self, request: pb.ListDatasetsRequest, context) -> pb.ListDatasetsResponse:
        if request.name:
            return pb.ListDatasetsResponse(datasets=[self._info(request.name)])
        infos = []
        for name in self.catalog.names(rescan=True):
            try:
                infos.append(self._info(name))
            except FormatError as exc:  # one broken dataset does not hide the others
                event(self.log, "dataset_unreadable", level=logging.WARNING, dataset=name, message=str(exc))
        return pb.ListDatasetsResponse(datasets=infos)

    @_unary
    def GetServerInfo(self, request: pb.GetServerInfoRequest, context) -> pb.ServerInfo:
        L = self.limits
        with self._lock:  # parked loaders are not open streams (and give way to any new one)
            active, reserved = self._active, self._reserved - sum(w[2] for w in self._warm)
        return pb.ServerInfo(
            version=__version__, protocol_version=PROTOCOL_VERSION,
            max_message_bytes=L.max_message_bytes, max_batch_size=L.max_batch_size,
            max_batch_bytes=L.max_batch_bytes, max_image_side=L.max_image_side,
            max_streams=L.max_streams, active_streams=active, decode_available=_decode_available(),
            decode_device="cpu", num_datasets=len(self.catalog.names()),
            media_available=_media_available(),
            max_memory_bytes=L.max_memory_bytes, memory_in_use_bytes=reserved, serves_block_stride=True,
        )

    # -- streams ---------------------------------------------------------------------------------
    def active_streams(self) -> int:
        with self._lock:
            return self._active

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no stream is open (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def StreamBatches(self, request: pb.BatchRequest, context) -> Iterator[bytes]:
        sink = None
        try:
            if request.bulk and self.bulk is not None:  # the batches go on a side connection
                sink = yield from self._bulk_sink(context)
                if sink is None:
                    return  # the call ended while the client connected
            if request.share:  # a share group's subscriber; without a share name, as before
                yield from self.share.stream(request, context, sink)
            else:
                yield from self._stream(request, context, sink)
            if sink is not None:
                sink.finish()  # the end marker; the connection waits for the client's next stream
        except ClientGone:
            return  # the client left (or the call ended) while its batches were being written
        except Exception as exc:
            self._fail(context, "StreamBatches", exc)
        finally:
            if sink is not None:
                sink.close()

    def _bulk_sink(self, context) -> Iterator[bytes]:
        """Offer the bulk connection (`gdsload.service.server.bulk`) and wait for the client to take it."""
        ticket, slot = self.bulk.expect()
        try:
            yield offer_message(ticket, self.bulk.port)
        except GeneratorExit:  # the call ended before the client connected
            self.bulk.withdraw(ticket)
            raise
        sink = self.bulk.connection(ticket, slot, cancelled=lambda: not context.is_active())
        if sink is None:
            if not context.is_active():
                return None
            raise Unavailable(f"the client did not open the bulk connection within {BULK_WAIT_S:g} s "
                              "(a firewall between it and the server's bulk port?)")
        self.metrics.bulk_streams.inc()
        if not context.add_callback(sink.shutdown):  # a call that ends breaks a blocked write
            sink.shutdown()
        return sink

    def _open_loader(self, req: pb.BatchRequest) -> tuple[DataLoader, dict[str, Any]]:
        """Validate the request against the limits and build the loader positioned at its start."""
        L = self.limits
        opts = request.to_options(req, max_image_side=L.max_image_side)  # the loader's options, checked
        payload = "decoded" if opts.decode else "raw"
        if req.batch_size > L.max_batch_size:
            raise OverLimit(f"batch_size {req.batch_size} is over the server's limit of "
                            f"{L.max_batch_size} samples per batch")
        if req.block_stride > 1 and (not req.block_batches or req.share):
            raise BadRequest("block_stride needs block_batches >= 1 and no share name, got block_batches "
                             f"{req.block_batches} and share {_cut(req.share)!r}")
        if req.max_chunk_bytes and req.max_chunk_bytes < MIN_CHUNK_BYTES:
            raise BadRequest(f"max_chunk_bytes must be 0 (server default) or >= {MIN_CHUNK_BYTES}, "
                             f"got {req.max_chunk_bytes}")
        fields = list(req.fields)
        if req.HasField("mix"):  # a gdsload.Mix of served datasets; req.dataset becomes its label
            dataset = mixwire.open_mix(self.catalog, req)
        else:
            dataset = self.catalog.dataset(req.dataset, fields)
        if req.dataset_id and req.dataset_id != dataset.dataset_id:
            raise DatasetChanged(
                f"dataset {req.dataset!r} on this server has id {dataset.dataset_id}, the client "
                f"planned with {_cut(req.dataset_id)} (BatchRequest.dataset_id): the dataset was "
                f"rewritten; start from a fresh state"
            )
        transform = opts.transform
        if payload == "decoded":
            images = [f for f in dataset.fields if dataset.shards.fields.get(f) == "image"]
            if len(images) > 1:
                raise BadRequest(
                    f"dataset {req.dataset!r} has the image fields {images} and PAYLOAD_DECODED "
                    f"decodes one: name it (and the other fields wanted) in BatchRequest.fields, "
                    f"or send PAYLOAD_RAW for the encoded bytes"
                )
        media: dict[str, Any] = {}
        if req.media:  # video/audio decoded here (issue 30): gdsload.service.protocol.mediawire
            if payload != "decoded":
                raise BadRequest("BatchRequest.media is set but payload is PAYLOAD_RAW: send PAYLOAD_DECODED")
            from gdsload.service.protocol import mediawire

            media = mediawire.from_specs(req.media, {f: dataset.shards.fields.get(f, "") for f in dataset.fields})
        # building a mix's epoch order takes memory too (gdsload.plan.mix); refused before anything is built
        order_memory = self._mix_order_memory(dataset, req) if req.HasField("mix") else 0
        if media:
            images = [f for f in dataset.fields if dataset.shards.fields.get(f) == "image"]
            transform = {**media, **({images[0]: transform} if images and transform is not None else {})}
        key = _warm_key(req, dataset.dataset_id)
        loader, parked = self._take_warm(key)  # a loader of an earlier stream of the same request, if parked
        reused = loader is not None
        if loader is None:
            loader = DataLoader(  # allocates nothing until iterated
                dataset, **{**request.loader_kwargs(opts), "transform": transform},
                num_workers=self.workers, prefetch_factor=self.prefetch, pin_memory=False, io="auto",
                decode_threads=self.decode_threads,
            )
        memory = parked  # what a parked loader holds reserved (the same figure: same request)
        try:
            memory = self.stream_memory(loader, req) + order_memory
            # the plan's batches from the start, beside the loader's: they name skipped samples;
            # checking start_position here names the request's field in the message
            planned = loader.plan.batches(req.epoch, req.start_position)
            loader.load_state_dict(loader.plan.state(req.epoch, req.start_position))
            steps = None
            if req.block_stride > 1:  # blocks b, b + stride, ... of the epoch (one stream per server of a stripe)
                first = req.start_position // loader.plan.global_batch
                steps = stride_steps(first, len(loader.plan), req.block_batches, req.block_stride, req.max_batches)
                every = list(planned)
                planned = iter([every[s - first] for s in steps])
        except Exception:
            loader.close()
            if reused:
                self._release(memory)
            raise
        batch_bytes = self.batch_wire_bytes(req, dataset.fields, opts.transform, _media_memory(media, req, 0)
                                            if media else 0) if req.share else 0  # a share window's unit
        return loader, {"payload": payload, "max_chunk_bytes": self.chunk_bytes(req), "memory": memory,
                        "planned": planned, "steps": steps, "key": key, "reused": reused, "batch_bytes": batch_bytes}

    def chunk_bytes(self, req: pb.BatchRequest) -> int:
        """The largest chunk this server sends for `req` (max_chunk_bytes, at most the message limit)."""
        L = self.limits
        return min(req.max_chunk_bytes or L.max_message_bytes, L.max_message_bytes)

    # -- warm loaders: a striping client opens a stream per block of batches ---------------------------
    def _take_warm(self, key: tuple) -> tuple[DataLoader | None, int]:
        """A parked loader built for the same request (all but the position) and the memory it
        holds reserved, or (None, 0). It keeps its reservation while parked, so the caller does
        not reserve again."""
        self._evict_warm(stale_only=True)
        with self._lock:
            for i in range(len(self._warm) - 1, -1, -1):
                if self._warm[i][0] == key:
                    self.warm_hits += 1
                    _, loader, memory, _ = self._warm.pop(i)
                    return loader, memory
        return None, 0

    def _park(self, key: tuple, loader: DataLoader, memory: int) -> None:
        """Keep a loader whose stream ended well for the next stream of the same request, for
        `WARM_S` at most, `self.warm_loaders` of them (oldest closed first)."""
        with self._lock:
            self._warm.append((key, loader, memory, time.monotonic()))
        self._evict_warm(keep=self.warm_loaders)

    def _evict_warm(self, *, keep: int | None = None, need: int = 0, stale_only: bool = False) -> None:
        """Close parked loaders: those parked over `WARM_S` ago, those beyond `keep`, or the oldest
        until `need` more bytes fit in the memory budget; their reservations are released."""
        out = []
        with self._lock:
            now = time.monotonic()
            while self._warm and (now - self._warm[0][3] > WARM_S
                                  or (keep is not None and len(self._warm) > keep)
                                  or (not stale_only and need and self._reserved + need > self.limits.max_memory_bytes)):
                out.append(self._warm.pop(0))
        for _, loader, memory, _ in out:
            loader.close()
            self._release(memory)

    def _release(self, memory: int) -> None:
        with self._idle:
            self._reserved -= memory
            self._idle.notify_all()

    def close_warm(self) -> None:
        self._evict_warm(keep=0)

    def _mix_order_memory(self, mix, req: pb.BatchRequest) -> int:
        """The bytes building the mix's epoch order takes, refused (RESOURCE_EXHAUSTED) when over
        the whole budget, before anything is built; the stream reserves them with its ring."""
        from gdsload.plan.mix import check_order_memory, order_nbytes
        from gdsload.plan.plan import PlanError

        G = req.batch_size * (req.world_size or 1)
        try:
            check_order_memory(mix.spec, G, self.limits.max_memory_bytes,
                               "the server's memory budget (--max-memory)")
        except PlanError as exc:
            raise OverLimit(f"mix {req.dataset!r}: {exc}") from None
        return order_nbytes(mix.spec, G)

    def stream_memory(self, loader: DataLoader, req: pb.BatchRequest) -> int:
        """Upper bound of the bytes a stream of `loader` (built for `req`, not iterated yet) holds,
        checking `max_batch_bytes` on the way.

        The ring slot is the loader's own figure, `BatchLayout.slot_nbytes` (the one slot size
        computation: the loader's memory check and autotune use it too), times `prefetch + 1`
        slots. A loader that decodes nothing gives each batch its own staging buffer
        (`gdsload.ring.staging.StagingPool`: at least 4 MiB, a quarter over the batch's staged
        bytes), at most one per slot and the batch being sent; labels the index holds are not
        staged (one staged label buffer is within `STREAM_OVERHEAD_BYTES`). A decoding stream
        adds `_DECODE_BUFFERS` output batches inside DALI and `DECODER_OVERHEAD_BYTES` (also with
        the decode pool: each decoding stream reserves a pipeline's share, so the pool, at most
        one pipeline per attached stream, stays within the reservations), every stream
        `STREAM_OVERHEAD_BYTES`; gRPC holds at most two chunks of `max_message_bytes` (the one
        being built and the one it has accepted but not yet sent, waiting for the client's
        flow-control window).
        """
        from gdsload.loader.gather import round_up

        layout = loader.batch_layout()
        B = layout.rows
        body = image = staged = 0
        spec, host = layout.slot_fields(on_device=False, direct=False)
        for name, (shape, dtype) in {**spec, **host}.items():
            if name != "__staging__":  # batch tensors: .npy rows, decoded images and media, labels
                body += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        for fp in layout.fields:
            if fp.kind == "image":
                image += int(np.prod(layout.transform.output_shape())) * np.dtype(layout.transform.dtype).itemsize
            elif fp.kind not in ("tensor", "label", "video", "audio"):  # sent as they were read
                body += B * fp.max_nbytes
                staged += B * round_up(fp.max_nbytes)
        if body > self.limits.max_batch_bytes:
            raise OverLimit(
                f"a batch of {B} samples of {req.dataset!r} can take up to {body} bytes "
                f"({body // max(1, B)} per sample), over the server's limit of {self.limits.max_batch_bytes} "
                f"bytes per batch; lower batch_size"
            )
        slots = self.prefetch + 1
        memory = slots * layout.slot_nbytes()[1]
        if layout.own_staging and staged:
            memory += (slots + 1) * max(staged + staged // 4, 4 << 20)
        if image:
            memory += _DECODE_BUFFERS * B * image + DECODER_OVERHEAD_BYTES
        media = {fp.name: fp.media for fp in layout.fields if fp.media is not None}
        if media:  # decoding buffers of audio (issue 46): gdsload.service.protocol.mediawire.decode_nbytes
            from gdsload.service.protocol import mediawire

            memory += mediawire.decode_nbytes(media, B)
        return memory + STREAM_OVERHEAD_BYTES + 2 * self.limits.max_message_bytes

    def _sample_bytes(self, req: pb.BatchRequest, fields: Sequence[str], transform) -> tuple[int, int, int]:
        """Per sample, at most: the bytes of its outputs, of its staged members, of its image."""
        from gdsload.format.manifest import field_kind

        sizes = mixwire.max_member_nbytes(self.catalog, req)
        per_sample = staging = image = 0
        for f in fields:
            kind = field_kind(f)
            if transform is not None and kind == "image":
                c, h, w = transform.output_shape()
                image = c * h * w * np.dtype(transform.dtype).itemsize
                per_sample += image
            else:
                per_sample += sizes.get(f, 0) + 8  # labels become int64
            if kind != "tensor":
                staging += -(-sizes.get(f, 0) // 64) * 64
        return per_sample, staging, image

    def batch_wire_bytes(self, req: pb.BatchRequest, fields: Sequence[str], transform, media_nbytes: int = 0) -> int:
        """Upper bound of one batch of `req` serialized as chunks (what a share window holds per
        batch): the body from the index's largest members (`media_nbytes`: decoded video/audio of
        one batch), `KEY_BYTES` of keys and names per sample, and each chunk's framing."""
        from gdsload.service.protocol.config import CHUNK_OVERHEAD_BYTES

        body = self._sample_bytes(req, fields, transform)[0] * req.batch_size + media_nbytes
        chunks = body // max(1, self.chunk_bytes(req) - CHUNK_OVERHEAD_BYTES) + 2
        return body + req.batch_size * KEY_BYTES + 64 * (len(fields) + 1) + chunks * CHUNK_OVERHEAD_BYTES

    def _reserve(self, memory: int) -> None:
        """Reserve `memory` bytes of the budget for something that is not a stream (a share group's
        producer: its loader and window), as `_enter` does for a stream."""
        budget = self.limits.max_memory_bytes
        self._make_room(memory)
        if memory > budget:
            raise OverLimit(f"a shared producer of this request holds up to {memory} bytes (its loader and "
                            f"window of batches), over the server's memory budget of {budget} bytes "
                            f"(--max-memory); lower batch_size or gdsload serve --share-window")
        if self.draining.is_set():
            raise Unavailable("the server is shutting down; retry on another server or after the restart")
        with self._lock:
            if self._reserved + memory > budget:
                raise Unavailable(
                    f"the server's memory budget is in use ({self._reserved} of {budget} bytes held by "
                    f"{self._active} streams), a shared producer needs {memory}; retry later or on another server"
                )
            self._reserved += memory

    def _make_room(self, memory: int) -> None:
        """Close idle share producers, then parked loaders, while `memory` more does not fit."""
        if self._reserved + memory > self.limits.max_memory_bytes:
            self.share.evict_idle()
        if self._warm:
            self._evict_warm(need=memory)  # parked loaders make room for a new stream

    def _enter(self, dataset: str, memory: int, *, reserved: bool = False) -> None:
        """Count a stream in and reserve its `memory` (unless its warm loader holds it: `reserved`)."""
        budget = self.limits.max_memory_bytes
        if reserved:
            memory = 0
        else:
            self._make_room(memory)
        if memory > budget:
            raise OverLimit(
                f"a stream of this request holds up to {memory} bytes (ring of {self.prefetch + 1} "
                f"batches and buffers), over the server's memory budget of {budget} bytes "
                f"(--max-memory); lower batch_size"
            )
        if self.draining.is_set():
            raise Unavailable("the server is shutting down; retry on another server or after the restart")
        with self._lock:
            if self._active >= self.limits.max_streams:
                raise Unavailable(f"the server is at capacity ({self.limits.max_streams} streams); retry later")
            if self._reserved + memory > budget:
                raise Unavailable(
                    f"the server's memory budget is in use ({self._reserved} of {budget} bytes held by "
                    f"{self._active} streams, this one needs {memory}); retry later or on another server"
                )
            self._active += 1
            self._reserved += memory
        self.metrics.consumers.labels(dataset).inc()
        self.metrics.streams.labels(dataset).inc()

    def _leave(self, dataset: str, memory: int) -> None:
        self.metrics.consumers.labels(dataset).dec()
        with self._idle:
            self._active -= 1
            self._reserved -= memory
            self._idle.notify_all()

    @staticmethod
    def _left_out(dataset, ids: np.ndarray, keys: Sequence[str]) -> list[str]:
        """Keys of the samples `ids` (one batch of the plan) that are not in `keys` (the batch the
        loader made, without its skipped samples), in batch order."""
        from collections import Counter

        shards = dataset.shards
        have = Counter(keys)
        out = []
        for gid in ids.tolist():
            s, j = shards.locate(gid)
            key = shards.index(s).key(j)
            if have[key]:
                have[key] -= 1
            else:
                out.append(key)
        return out

    def _stream(self, req: pb.BatchRequest, context, sink: BulkSink | None = None) -> Iterator[bytes]:
        # Validate first (cheap: the loader allocates and reads only when iterated), so metrics are
        # labelled with served dataset names only.
        loader, opts = self._open_loader(req)
        memory = opts["memory"]
        try:
            self._enter(req.dataset, memory, reserved=opts["reused"])
        except BaseException:
            loader.close()
            if opts["reused"]:
                self._release(memory)
            raise
        t0 = time.perf_counter()
        sent_batches = sent_bytes = 0
        outcome = "ok"
        pooled = None
        it = stored = None
        try:
            payload = opts["payload"]
            plan = loader.plan
            G = plan.global_batch
            step = req.start_position // G
            planned = opts["planned"]
            event(self.log, "stream_start", peer=_peer(context), dataset=req.dataset, payload=payload,
                  epoch=req.epoch, start_position=req.start_position, rank=loader.plan.rank,
                  world_size=loader.plan.world_size, batch_size=req.batch_size)
            if payload == "decoded" and self.pool is not None:
                pooled = self.pool.attach(loader, req.dataset)
            steps = opts["steps"]
            # raw members sent from the page cache, unread (gdsload.service.server.stored), else the loader's batches
            stored = StoredBatches.open(loader, req) if sink is not None else None
            if stored is not None:
                self.metrics.stored_streams.inc()
            elif steps is None:
                it = loader.iter_batches(req.max_batches or None)  # nothing read past the stream's end
            else:  # the stripe's blocks of this server, read ahead across the gaps
                # (no steps: a start at or past the stripe's last block, an empty stream; a
                # generator, which `close()`s in `finally` as the loader's iterator does)
                it = loader.iter_batches(steps=steps) if steps else (b for b in ())
            if steps is not None:
                steps = iter(steps)
            m_batches = self.metrics.batches.labels(req.dataset, payload)
            m_samples = self.metrics.samples.labels(req.dataset, payload)
            m_bytes = self.metrics.bytes.labels(req.dataset, payload)
            m_read = self.metrics.read_s.labels(payload)
            m_send = self.metrics.send_s.labels(payload)
            while True:
                if self.draining.is_set():
                    outcome = "drained"
                    return  # at a batch boundary: the client resumes from its cursor
                if not context.is_active():
                    outcome = "cancelled"
                    return
                if req.max_batches and sent_batches >= req.max_batches:
                    return
                t_read = time.perf_counter()
                try:
                    if stored is not None:
                        ids = next(planned)
                        batch = stored.batch(ids)
                    else:
                        batch = next(it)
                        ids = next(planned)
                except StopIteration:
                    return
                except DecodeError as exc:  # word the remedy in protocol terms
                    raise DecodeError(exc.reason, remedy=_SKIP_REMEDY) from exc
                m_read.observe(time.perf_counter() - t_read)
                if steps is not None:
                    step = next(steps)
                keys = batch[wire.KEY]
                skipped = self._left_out(loader.dataset, ids, keys) if len(keys) < len(ids) else []
                t_send = time.perf_counter()
                nbytes = wire.body_nbytes(batch)
                frames = wire.encode_frames(batch, epoch=req.epoch, step=step, position=(step + 1) * G,
                                            max_chunk_bytes=opts["max_chunk_bytes"],
                                            skipped_keys=skipped, end_position=plan.end_position)
                if sink is not None:
                    sink.send(frames)  # from the batch's memory, before the loader reuses it
                else:
                    yield from (b"".join(pieces) for pieces in frames)
                m_send.observe(time.perf_counter() - t_send)
                step += 1
                sent_batches += 1
                sent_bytes += nbytes
                m_batches.inc()
                m_samples.inc(len(batch[wire.KEY]))
                m_bytes.inc(nbytes)
        except (GeneratorExit, ClientGone):
            outcome = "cancelled"
            raise
        except Exception as exc:
            outcome = to_status(exc)[0].name
            raise
        finally:
            if pooled is not None:
                pooled.detach()
            # A stream that ended well or was cancelled (a striping client's hedged copy, a
            # consumer that left) leaves a loader as usable as a `for` loop left with `break`:
            # parked, a slow server's next block does not pay for a new one (which could make it
            # too slow ever to deliver a batch before being overtaken again).
            if (outcome in ("ok", "cancelled") and self.warm_loaders and not self.draining.is_set()
                    and (it is not None or stored is not None)):
                if it is not None:
                    it.close()  # its readers stop; the ring, backends and threads stay for the next stream
                self._park(opts["key"], loader, memory)
                self._leave(req.dataset, 0)
            else:
                loader.close()
                self._leave(req.dataset, memory)
            el = time.perf_counter() - t0
            event(self.log, "stream_end", peer=_peer(context), dataset=req.dataset, outcome=outcome,
                  batches=sent_batches, bytes=sent_bytes, seconds=round(el, 3),
                  mb_per_s=round(sent_bytes / el / 1e6, 1) if el > 0 else None,
                  decode_queue_s=round(pooled.queue_s, 3) if pooled is not None else None)



#: How long a parked loader waits for the next stream of its request before it is closed.
WARM_S = 10.0


def stride_steps(first: int, num_steps: int, block: int, stride: int, limit: int = 0) -> list[int]:
    """The steps of a `BatchRequest.block_stride` stream: from `first` to the end of its block of
    `block` steps, then every `stride`-th block after it, at most `limit` steps (0: no limit)."""
    steps: list[int] = []
    b, step = first // block, first
    while step < num_steps and (not limit or len(steps) < limit):
        end = min((b + 1) * block, num_steps)
        steps.extend(range(step, end)[: (limit - len(steps)) if limit else None])
        b += stride
        step = b * block
    return steps


def _warm_key(req: pb.BatchRequest, dataset_id: str) -> tuple:
    """What a loader is built from: the request without its position, epoch, stream limits and
    transport (what a share group's producers of one request have in common too)."""
    return (dataset_id, request_key(req, epoch=False))


def _manifest_text(ds) -> str:
    import json

    return json.dumps(ds.shards.manifest, sort_keys=True)
