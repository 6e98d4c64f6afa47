"""The feed server as a whole: `create_server(roots, ...) -> (FeedServer, port)` builds the gRPC
server, the servicer (`gdsload.service.server.servicer`), health checking, metrics and the bulk
port; `FeedServer` starts it and shuts it down gracefully (health NOT_SERVING, open streams end at
a batch boundary, then the gRPC server stops after at most `grace_s`)."""

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

from gdsload.service.server.servicer import SERVICE_NAME, FeedServicer


def _add_feed(servicer: FeedServicer, server: grpc.Server) -> None:
    """Register the Feed service as the generated `add_FeedServicer_to_server` does, except that
    StreamBatches yields chunks already serialized by `wire.encode_batch` (one copy of the data
    instead of three), so its response serializer is the identity."""
    handlers = {
        "ListDatasets": grpc.unary_unary_rpc_method_handler(
            servicer.ListDatasets, request_deserializer=pb.ListDatasetsRequest.FromString,
            response_serializer=pb.ListDatasetsResponse.SerializeToString),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo, request_deserializer=pb.GetServerInfoRequest.FromString,
            response_serializer=pb.ServerInfo.SerializeToString),
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            servicer.StreamBatches, request_deserializer=pb.BatchRequest.FromString,
            response_serializer=bytes),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class FeedServer:
    """A feed server: `start()`, `shutdown()` (graceful), `stop(grace)`, `wait_for_termination()`.

    Made by `create_server`; `port` is the bound port, `metrics_port` the Prometheus port (None when
    off), `servicer` the Feed implementation, `health` the grpc.health.v1 servicer.
    """

    def __init__(self, grpc_server: grpc.Server, servicer: FeedServicer, health_servicer,
                 metrics: Metrics, *, port: int, address: str, metrics_port: int | None,
                 metrics_address: str, grace_s: float, logger: logging.Logger):
        self.grpc_server = grpc_server
        self.servicer = servicer
        self.health = health_servicer
        self.metrics = metrics
        self.port = port
        self.address = address
        self.metrics_port = metrics_port
        self._metrics_address = metrics_address
        self.grace_s = grace_s
        self.log = logger
        self._started = False
        self._stopped = threading.Event()
        self._shutdown_lock = threading.Lock()

    def start(self) -> FeedServer:
        if self.metrics_port is not None:  # first: a port in use fails before anything is served
            try:
                self.metrics_port = self.metrics.serve(self.metrics_port, bind_host(self._metrics_address))
            except OSError as exc:
                self.grpc_server.stop(None)  # releases the feed's bound port
                raise GdsloadError(
                    f"cannot serve metrics on {self._metrics_address}:{self.metrics_port} "
                    f"(--metrics-port {self.metrics_port}): {exc.strerror or exc}"
                ) from None
        self.grpc_server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._started = True
        event(self.log, "server_start", address=self.address, port=self.port,
              datasets=self.servicer.catalog.names(), metrics_port=self.metrics_port,
              max_message_bytes=self.servicer.limits.max_message_bytes,
              max_streams=self.servicer.limits.max_streams)
        return self

    def shutdown(self, grace_s: float | None = None) -> bool:
        """Graceful stop: NOT_SERVING, refuse new streams, let open streams end at a batch boundary
        (at most `grace_s`), stop gRPC. Returns True when every stream ended within the grace."""
        grace = self.grace_s if grace_s is None else grace_s
        with self._shutdown_lock:
            if self._stopped.is_set():
                return True
            t0 = time.monotonic()
            self.health.enter_graceful_shutdown()
            self.servicer.draining.set()
            open_streams = self.servicer.active_streams()
            event(self.log, "shutdown_begin", open_streams=open_streams, grace_s=grace)
            drained = self.servicer.wait_idle(grace)
            left = max(0.0, grace - (time.monotonic() - t0))
            # What is still open now is not a stream (health watches, unary calls): short grace.
            stop_grace = min(left, 1.0)
            self.grpc_server.stop(stop_grace).wait(stop_grace + 5.0)
            self.servicer.share.close()
            self.servicer.close_warm()
            if self.servicer.bulk is not None:
                self.servicer.bulk.close()
            if self.servicer.pool is not None:  # queued batches fail; its pipelines go now, not at exit
                self.servicer.pool.close()
            # the calls gRPC cancelled end their loaders (a stream's thread closes its loader)
            ended = self.servicer.wait_idle(5.0)
            self.metrics.close()
            self._stopped.set()
            event(self.log, "shutdown_done", level=logging.INFO if ended else logging.WARNING, drained=drained,
                  open_streams=open_streams, still_open=self.servicer.active_streams(),
                  seconds=round(time.monotonic() - t0, 3))
            return drained

    def stop(self, grace: float | None) -> threading.Event:
        """gRPC's abrupt stop (in-flight calls are cancelled after `grace`)."""
        self.health.enter_graceful_shutdown()
        self.servicer.draining.set()
        ev = self.grpc_server.stop(grace)

        def done() -> None:
            ev.wait()
            self.servicer.share.close()
            self.servicer.close_warm()
            if self.servicer.bulk is not None:
                self.servicer.bulk.close()
            if self.servicer.pool is not None:
                self.servicer.pool.close()
            self.metrics.close()
            self._stopped.set()

        threading.Thread(target=done, daemon=True).start()
        return ev

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def __enter__(self) -> FeedServer:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _bind_problem(host: str, port: int) -> str:
    """Why gRPC could not bind (it says only that it failed): try the same bind with a socket."""
    import socket

    try:
        infos = socket.getaddrinfo(bind_host(host) or None, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r} ({exc.strerror})"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(addr)
        except OSError as exc:
            return exc.strerror or str(exc)
    return "gRPC refused the address"


def create_server(
    roots: Sequence[str],
    *,
    address: str = "127.0.0.1:0",
    token: str | None = None,
    tls: TlsConfig | None = None,
    limits: Limits | None = None,
    max_message_bytes: int | None = None,
    keepalive: Keepalive | None = None,
    metrics_port: int | None = None,
    metrics_address: str | None = None,
    workers: int = 2,
    prefetch: int = 2,
    decode_threads: int = 2,
    grace_s: float = 10.0,
    logger: logging.Logger | None = None,
    cache_dir: str | bool | None = None,
    cache_limit: int | str = "50GB",
    decode_pool: int = 2,
    share_window: int = 4,
    share_hold_s: float = 0.5,
    bulk: bool = True,
    bulk_port: int = 0,
) -> tuple[FeedServer, int]:
    """A feed server for every dataset below `roots`, bound to `address` (port 0: any free port).

    Returns `(server, port)`; call `server.start()`. `token`: require `authorization: Bearer
    TOKEN`. `tls`: serve TLS (mutual TLS when `tls.client_ca` is set). `limits` (or just
    `max_message_bytes`): see `Limits`. `metrics_port`: serve Prometheus metrics there (0: any
    port; None: off), on `metrics_address` (default: the host of `address`, so a loopback feed
    does not expose its metrics to the network). `workers`/`prefetch`/`decode_threads`: per
    stream, as in `DataLoader` (>= 1). `grace_s`: how long `shutdown()` waits for open streams.
    `cache_dir`/`cache_limit`: the shard cache for roots that are URLs, as in `gdsload.Dataset`.
    `decode_pool`: decode the images of every stream in one pool of this many workers (default
    2), each pipeline with as many DALI threads as the server has cores, taken by the streams in
    turn (`gdsload.service.server.pool`); 0: a pipeline of `decode_threads` threads per stream.
    `share_window`, `share_hold_s`: share groups (`BatchRequest.share`, `gdsload.service.server.share`):
    batches each shared producer keeps for its subscribers (>= 1), and how long it waits for a
    subscriber that holds a full window before that one is detached to a producer of its own.
    `bulk`: offer clients the side connection for batch bytes (`gdsload.service.server.bulk`; never
    with `tls`) on `bulk_port` of the listen host (0: any free port).
    Invalid arguments raise `GdsloadError` naming them (as the `gdsload serve` flags).
    """
    unix = address.startswith("unix:")
    if unix:  # a unix socket for clients on this host (RemoteLoader("unix:PATH")): no port, no TCP
        path = unix_path(address)
        if not path:
            raise GdsloadError(f"--listen {address!r}: a unix: address needs a socket path (unix:/run/feed.sock)")
        host, listen_port = "127.0.0.1", 0  # what metrics bind to by default
    else:
        host, listen_port = split_address(address, "--listen")
    for name, value in (("--workers", workers), ("--prefetch", prefetch), ("--decode-threads", decode_threads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GdsloadError(f"{name} must be an integer >= 1, got {value!r}")
    if not grace_s >= 0:  # also refuses NaN
        raise GdsloadError(f"--grace must be >= 0 seconds, got {grace_s!r}")
    if metrics_port is not None:
        if isinstance(metrics_port, bool) or not isinstance(metrics_port, int) or not 0 <= metrics_port <= 65535:
            raise GdsloadError(f"--metrics-port must be a port in 0..65535, got {metrics_port!r}")
        if metrics_port and metrics_port == listen_port:
            raise GdsloadError(f"--metrics-port {metrics_port} is the port of --listen {address}: "
                               "give metrics a port of their own")
    metrics_address = host if metrics_address is None else metrics_address
    if tls is not None:
        check_tls(tls)
    limits = limits or Limits()
    if max_message_bytes is not None:
        from dataclasses import replace

        limits = replace(limits, max_message_bytes=max_message_bytes)
    log = logger or logging.getLogger(LOGGER)
    catalog = Catalog(roots, cache_dir=cache_dir, cache_limit=cache_limit)
    metrics = Metrics()
    if isinstance(share_window, bool) or not isinstance(share_window, int) or share_window < 1:
        raise GdsloadError(f"--share-window must be an integer >= 1 (batches), got {share_window!r}")
    if not (isinstance(share_hold_s, (int, float)) and 0 <= share_hold_s < float("inf")):
        raise GdsloadError(f"--share-hold must be >= 0 seconds, got {share_hold_s!r}")
    if isinstance(bulk_port, bool) or not isinstance(bulk_port, int) or not 0 <= bulk_port <= 65535:
        raise GdsloadError(f"--bulk-port must be a port in 0..65535, got {bulk_port!r}")
    if bulk_port and bulk_port == listen_port:
        raise GdsloadError(f"--bulk-port {bulk_port} is the port of --listen {address}: give it a port of its own")
    if isinstance(decode_pool, bool) or not isinstance(decode_pool, int) or decode_pool < 0:
        raise GdsloadError(f"--decode-pool must be an integer >= 0, got {decode_pool!r}")
    pool = None
    if decode_pool:
        import os

        from gdsload.service.server.pool import DecodePool

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        pool = DecodePool(workers=decode_pool, threads=cores, metrics=metrics)
    servicer = FeedServicer(catalog, limits, metrics, workers=workers, prefetch=prefetch,
                            decode_threads=decode_threads, logger=log, decode_pool=pool,
                            share_window=share_window, share_hold_s=float(share_hold_s))

    def rejected(method: str, reason: str) -> None:
        metrics.errors.labels("UNAUTHENTICATED").inc()
        event(log, "call_failed", level=logging.WARNING, method=method, code="UNAUTHENTICATED",
              message=reason)

    interceptors = [TokenInterceptor(token, on_reject=rejected)] if token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=limits.max_streams + 8, thread_name_prefix="gdsload-feed"),
        interceptors=interceptors, options=server_options(limits, keepalive or Keepalive()),
    )
    _add_feed(servicer, server)
    health_servicer = health.HealthServicer(
        experimental_non_blocking=True,
        experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gdsload-health"),
    )
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        if tls is not None:
            creds = grpc.ssl_server_credentials(
                [(tls.private_key, tls.cert_chain)], root_certificates=tls.client_ca,
                require_client_auth=tls.client_ca is not None,
            )
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if not port:
        problem = "gRPC refused the socket path" if unix else _bind_problem(host, listen_port)
        raise GdsloadError(f"cannot listen on {address}: {problem}")
    if bulk and tls is None and not address.startswith("unix-abstract:"):
        try:
            caps = dict(max_pending=limits.max_pending_connections, ticket_s=limits.bulk_ticket_s)
            servicer.bulk = (BulkListener(unix_path=path, **caps) if unix
                             else BulkListener(bind_host(host), bulk_port, **caps))
        except OSError as exc:
            server.stop(None)
            where = f"{path}.bulk" if unix else f"{host}:{bulk_port}"
            raise GdsloadError(f"cannot listen for bulk connections on {where}: {exc.strerror or exc} "
                               "(--no-bulk serves without them)") from None
    fs = FeedServer(server, servicer, health_servicer, metrics, port=port,
                    address=address if unix else f"{host}:{port}",
                    metrics_port=metrics_port, metrics_address=metrics_address, grace_s=grace_s,
                    logger=log)
    return fs, port
