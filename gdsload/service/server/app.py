"""The feed server as a whole: `create_server(roots, config=None, **kwargs) -> (FeedServer, port)`
builds the gRPC server, the servicer (`gdsload.service.server.servicer`), health checking, metrics
and the bulk port from one `ServerConfig`; `FeedServer` starts it and shuts it down gracefully
(health NOT_SERVING, open streams end at a batch boundary, then the gRPC server stops after at
most `grace_s`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from typing import Any

from gdsload.errors import GdsloadError, require

require("grpc", extra="serve", purpose="the feed server (gdsload serve)")
require("grpc_health", extra="serve", purpose="the feed server's health service")

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gdsload.service.protocol.auth import interceptors as auth_interceptors
from gdsload.service.protocol.config import ServerConfig, bind_host, server_options, unix_path
from gdsload.service.protocol.request import offers_bulk
from gdsload.service.server.bulk import BulkListener
from gdsload.service.server.catalog import Catalog
from gdsload.service.server.logs import LOGGER, event
from gdsload.service.server.metrics import Metrics
from gdsload.service.server.servicer import SERVICE_NAME, FeedServicer
from gdsload.v1 import feed_pb2 as pb


def _add_feed(servicer: FeedServicer, server: grpc.Server) -> None:
    """Register the Feed service as the generated `add_FeedServicer_to_server` does, except that
    StreamBatches yields chunks already serialized by `wire.encode_frames` (one copy of the data
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
    off), `servicer` the Feed implementation, `health` the grpc.health.v1 servicer, `config` its
    `ServerConfig`.
    """

    def __init__(self, grpc_server: grpc.Server, servicer: FeedServicer, health_servicer: Any, metrics: Metrics,
                 *, port: int, address: str, logger: logging.Logger):
        self.grpc_server = grpc_server
        self.servicer = servicer
        self.config: ServerConfig = servicer.config
        self.health = health_servicer
        self.metrics = metrics
        self.port = port
        self.address = address
        self.metrics_port = self.config.metrics_port
        self.grace_s = self.config.grace_s
        self.log = logger
        self._started = False
        self._stopped = threading.Event()
        self._shutdown_lock = threading.Lock()

    def start(self) -> FeedServer:
        if self.metrics_port is not None:  # first: a port in use fails before anything is served
            where = self.config.metrics_host()
            try:
                self.metrics_port = self.metrics.serve(self.metrics_port, bind_host(where))
            except OSError as exc:
                self.grpc_server.stop(None)  # releases the feed's bound port
                raise GdsloadError(f"cannot serve metrics on {where}:{self.metrics_port} "
                                   f"(--metrics-port {self.metrics_port}): {exc.strerror or exc}") from None
        self.grpc_server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._started = True
        L = self.config.limits
        event(self.log, "server_start", address=self.address, port=self.port,
              datasets=self.servicer.catalog.names(), metrics_port=self.metrics_port,
              max_message_bytes=L.max_message_bytes, max_streams=L.max_streams)
        return self

    def shutdown(self, grace_s: float | None = None) -> bool:
        """Graceful stop: NOT_SERVING, refuse new streams, let open streams end at a batch boundary
        (at most `grace_s`), stop gRPC. Returns True when every stream ended within the grace."""
        grace = self.grace_s if grace_s is None else grace_s
        with self._shutdown_lock:
            if self._stopped.is_set():
                return True
            t0 = time.monotonic()
            self._drain()
            open_streams = self.servicer.active_streams()
            event(self.log, "shutdown_begin", open_streams=open_streams, grace_s=grace)
            drained = self.servicer.wait_idle(grace)
            left = max(0.0, grace - (time.monotonic() - t0))
            # What is still open now is not a stream (health watches, unary calls): short grace.
            stop_grace = min(left, 1.0)
            self.grpc_server.stop(stop_grace).wait(stop_grace + 5.0)
            self._close()
            # the calls gRPC cancelled end their loaders (a stream's thread closes its loader)
            ended = self.servicer.wait_idle(5.0)
            event(self.log, "shutdown_done", level=logging.INFO if ended else logging.WARNING, drained=drained,
                  open_streams=open_streams, still_open=self.servicer.active_streams(),
                  seconds=round(time.monotonic() - t0, 3))
            return drained

    def stop(self, grace: float | None) -> threading.Event:
        """gRPC's abrupt stop (in-flight calls are cancelled after `grace`)."""
        self._drain()
        ev = self.grpc_server.stop(grace)

        def done() -> None:
            ev.wait()
            self._close()

        threading.Thread(target=done, daemon=True).start()
        return ev

    def _drain(self) -> None:
        self.health.enter_graceful_shutdown()
        self.servicer.drain()

    def _close(self) -> None:
        """After gRPC stopped: the servicer's parts, then metrics; `wait_for_termination` returns."""
        self.servicer.close()
        self.metrics.close()
        self._stopped.set()

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


def create_server(roots: Sequence[str], config: ServerConfig | None = None, *,
                  logger: logging.Logger | None = None, **kwargs: Any) -> tuple[FeedServer, int]:
    """A feed server for every dataset below `roots`, bound to `address` (port 0: any free port).

    Returns `(server, port)`; call `server.start()`. The settings are a `ServerConfig` (`config`),
    or its fields as keyword arguments (on top of `config` when both are given), checked once:
    `address` (HOST:PORT, `unix:PATH`). `token`: require `authorization: Bearer TOKEN`. `tls`: serve
    TLS (mutual TLS when `tls.client_ca` is set). `limits` (or just `max_message_bytes`): see
    `Limits`. `keepalive`: see `Keepalive`. `metrics_port`: serve Prometheus metrics there (0: any
    port; None: off), on `metrics_address` (default: the host of `address`, so a loopback feed does
    not expose its metrics to the network). `workers`/`prefetch`/`decode_threads`: per stream, as
    in `DataLoader` (>= 1). `grace_s`: how long `shutdown()` waits for open streams.
    `cache_dir`/`cache_limit`: the shard cache for roots that are URLs, as in `gdsload.Dataset`.
    `decode_pool`: decode the images of every stream in one pool of this many workers (default
    2), each pipeline with as many DALI threads as the server has cores, taken by the streams in
    turn (`gdsload.service.server.pool`); 0: a pipeline of `decode_threads` threads per stream.
    `share_window`, `share_hold_s`: share groups (`BatchRequest.share`, `gdsload.service.server.share`):
    batches each shared producer keeps for its subscribers (>= 1), and how long it waits for a
    subscriber that holds a full window before that one is detached to a producer of its own.
    `bulk`: offer clients the side connection for batch bytes (`gdsload.service.server.bulk`; never
    with `tls`) on `bulk_port` of the listen host (0: any free port). `logger`: where the JSON-lines
    events go (default: the "gdsload.service" logger).
    Invalid settings raise `GdsloadError` naming them (as the `gdsload serve` flags).
    """
    config = ServerConfig.build(config, **kwargs)
    log = logger or logging.getLogger(LOGGER)
    catalog = Catalog(roots, cache_dir=config.cache_dir, cache_limit=config.cache_limit)
    metrics = Metrics()
    servicer = FeedServicer(catalog, config, metrics, logger=log, decode_pool=_decode_pool(config, metrics))
    server = _grpc_server(config, servicer, metrics, log)
    health_servicer = health.HealthServicer(
        experimental_non_blocking=True,
        experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gdsload-health"),
    )
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = _bind(server, config)
    if offers_bulk(wanted=config.bulk, tls=config.tls is not None, address=config.address):
        servicer.bulk = _bulk_listener(server, config)
    address = config.address if config.unix else f"{config.listen()[0]}:{port}"
    return FeedServer(server, servicer, health_servicer, metrics, port=port, address=address, logger=log), port


def _decode_pool(config: ServerConfig, metrics: Metrics) -> Any:
    """The server's decode pool (`decode_pool` workers, a DALI thread per core each), or None."""
    if not config.decode_pool:
        return None
    from gdsload.service.server.pool import DecodePool

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return DecodePool(workers=config.decode_pool, threads=cores, metrics=metrics)


def _grpc_server(config: ServerConfig, servicer: FeedServicer, metrics: Metrics, log: logging.Logger) -> grpc.Server:
    """The gRPC server with the Feed service (and the token check, when the server has a token)."""

    def rejected(method: str, reason: str) -> None:
        metrics.errors.labels("UNAUTHENTICATED").inc()
        event(log, "call_failed", level=logging.WARNING, method=method, code="UNAUTHENTICATED", message=reason)

    interceptors = auth_interceptors(config.token, on_reject=rejected)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.limits.max_streams + 8, thread_name_prefix="gdsload-feed"),
        interceptors=interceptors, options=server_options(config.limits, config.keepalive),
    )
    _add_feed(servicer, server)
    return server


def _bind(server: grpc.Server, config: ServerConfig) -> int:
    """Bind `config.address` (TLS when configured); the bound port, or `GdsloadError` saying why not."""
    tls = config.tls
    try:
        if tls is not None:
            creds = grpc.ssl_server_credentials(
                [(tls.private_key, tls.cert_chain)], root_certificates=tls.client_ca,
                require_client_auth=tls.client_ca is not None,
            )
            port = server.add_secure_port(config.address, creds)
        else:
            port = server.add_insecure_port(config.address)
    except RuntimeError:
        port = 0
    if not port:
        problem = "gRPC refused the socket path" if config.unix else _bind_problem(*config.listen())
        raise GdsloadError(f"cannot listen on {config.address}: {problem}")
    return port


def _bulk_listener(server: grpc.Server, config: ServerConfig) -> BulkListener:
    """The bulk port: `PATH.bulk` beside a unix socket, else `bulk_port` on the listen host."""
    caps = dict(max_pending=config.limits.max_pending_connections, ticket_s=config.limits.bulk_ticket_s)
    host = config.listen()[0]
    path = unix_path(config.address) if config.unix else None
    try:
        if path is not None:
            return BulkListener(unix_path=path, **caps)
        return BulkListener(bind_host(host), config.bulk_port, **caps)
    except OSError as exc:
        server.stop(None)
        where = f"{path}.bulk" if path is not None else f"{host}:{config.bulk_port}"
        raise GdsloadError(f"cannot listen for bulk connections on {where}: {exc.strerror or exc} "
                           "(--no-bulk serves without them)") from None
