"""`gdsload serve ROOT... --listen HOST:PORT`: run a feed server until SIGTERM or Ctrl-C.

On SIGTERM/SIGINT: health turns NOT_SERVING, open streams end at a batch boundary (clients resume
elsewhere or after the restart), the server stops within `--grace` seconds, exit status 0. Logs are
JSON lines on stderr. `gdsload/cli/__init__.py` registers the command with `add_serve_parser`.
"""

from __future__ import annotations

import argparse
import signal
import threading


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    s = subparsers.add_parser(
        "serve", help="serve datasets to RemoteLoader clients over gRPC",
        description="Serve every dataset (a folder with manifest.json, named by its path below the "
        "root) under the given roots over gRPC (gdsload.v1.Feed, grpc.health.v1).")
    configure_serve_parser(s)
    return s


def configure_serve_parser(s: argparse.ArgumentParser) -> None:
    from gdsload.service.protocol.config import Limits

    d = Limits()
    s.add_argument("roots", nargs="+", metavar="ROOT", help="folders holding datasets, or URLs of datasets")
    s.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="shard cache for URL roots (default: ~/.cache/gdsload/shards; 'none': read ranges)")
    from gdsload.sizes import argparse_size as parse_size

    s.add_argument("--cache-limit", metavar="SIZE", type=parse_size, default="50GB",
                   help="shard cache size limit (default 50GB)")
    s.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT",
                   help="address to listen on (default 127.0.0.1:50051; 0.0.0.0:PORT for all interfaces; "
                        "unix:PATH for clients on this host)")
    s.add_argument("--token-file", metavar="PATH",
                   help="require 'authorization: Bearer TOKEN' (token in PATH); or one line per client, 'NAME "
                        "TOKEN HIGHEST_PRIORITY' (TOKEN may be tls:IDENTITY, a mutual-TLS client): a request "
                        "over its client's priority is refused. Without it every asked priority is trusted")
    s.add_argument("--batch-slots", type=int, default=0, metavar="N",
                   help="batches made at once, taken by priority (RemoteLoader(priority=...)) and shared "
                        "equally among the jobs of a priority (default 0: one per core)")
    s.add_argument("--tls-cert", metavar="PEM", help="server certificate chain (TLS)")
    s.add_argument("--tls-key", metavar="PEM", help="server private key (TLS)")
    s.add_argument("--tls-client-ca", metavar="PEM", help="CA of client certificates: mutual TLS")
    s.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on this port (not the --listen port)")
    s.add_argument("--metrics-address", metavar="HOST",
                   help="metrics bind address (default: the host of --listen, so a loopback feed keeps "
                        "its metrics on loopback; 0.0.0.0 for all interfaces)")
    s.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help=f"largest message sent; batches are chunked below it (default {d.max_message_bytes})")
    s.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="largest batch_size accepted")
    s.add_argument("--max-batch-bytes", type=int, default=d.max_batch_bytes, help="largest batch body, bytes")
    s.add_argument("--max-streams", type=int, default=d.max_streams, help="concurrent streams (more: UNAVAILABLE)")
    s.add_argument("--max-memory", metavar="SIZE",
                   help="memory budget of all open streams together, e.g. 8GiB (default: half of this "
                        "machine's memory, or of its cgroup limit); a stream that does not fit waits "
                        "(UNAVAILABLE, its client retries)")
    s.add_argument("--workers", type=int, default=2, help="reader threads per stream (default 2)")
    s.add_argument("--prefetch", type=int, default=2, help="batches prefetched per reader thread (default 2)")
    s.add_argument("--decode-threads", type=int, default=2,
                   help="DALI threads per stream with --no-decode-pool (default 2)")
    s.add_argument("--decode-pool", type=int, default=2, metavar="N",
                   help="decode every stream's images in one pool of N workers, each pipeline with as many "
                        "DALI threads as the server has cores, streams served in turn (default 2; 0: as "
                        "--no-decode-pool)")
    s.add_argument("--no-decode-pool", dest="decode_pool", action="store_const", const=0,
                   help="no shared pool: each decoding stream builds a DALI pipeline of --decode-threads")
    s.add_argument("--share-window", type=int, default=4, metavar="N",
                   help="batches a share group's producer keeps for its jobs (RemoteLoader(share=...); default 4)")
    s.add_argument("--share-hold", type=float, default=0.5, metavar="SECONDS",
                   help="how long a share group waits for a job that holds its full window before that "
                        "job gets a producer of its own (default 0.5)")
    s.add_argument("--no-bulk", dest="bulk", action="store_false",
                   help="send batches only inside the gRPC stream; by default a client may take them on a "
                        "side connection (a TCP port chosen at start, on the --listen host; PATH.bulk for "
                        "unix:PATH), which costs a third of the CPU per byte. Never offered with TLS")
    s.add_argument("--bulk-port", type=int, default=0, metavar="PORT",
                   help="the TCP port of the bulk connections, on the --listen host (default 0: any free "
                        "port; fix it where a firewall or NetworkPolicy must let it through)")
    s.add_argument("--max-pending-connections", type=int, default=d.max_pending_connections, metavar="N",
                   help="bulk connections that have not presented their ticket yet, at most; more are "
                        f"closed as they are accepted (default {d.max_pending_connections}; each has "
                        f"{d.bulk_ticket_s:g} s for its whole ticket)")
    s.add_argument("--grace", type=float, default=10.0, help="seconds to drain on SIGTERM (default 10)")
    s.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    s.set_defaults(func=cmd_serve)


def warm_up() -> None:
    """Import what the first stream would (the loader imports torch when installed, seconds), so
    that the server reports SERVING only once it can answer promptly."""
    import importlib.util

    import gdsload.loader.dataloader  # noqa: F401

    if importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401


def cmd_serve(args: argparse.Namespace) -> int:
    from gdsload.errors import GdsloadError
    from gdsload.host.malloc import keep_large_blocks
    from gdsload.service.protocol.auth import read_clients
    from gdsload.service.protocol.config import Limits, ServerConfig, tls_from_files
    from gdsload.service.server import create_server
    from gdsload.service.server.logs import configure, event

    try:
        log = configure(level=args.log_level)
    except ValueError:
        raise GdsloadError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {args.log_level!r}") from None
    max_memory = None
    if args.max_memory is not None:
        from gdsload.sizes import argparse_size as parse_size

        try:
            max_memory = parse_size(args.max_memory)
        except argparse.ArgumentTypeError as exc:
            raise GdsloadError(f"--max-memory: {exc}") from None
    # every value is checked once, where it is declared (Limits, ServerConfig), naming its flag
    config = ServerConfig(
        address=args.listen, token=read_clients(args.token_file) if args.token_file else None,
        tls=tls_from_files(args.tls_cert, args.tls_key, args.tls_client_ca),
        limits=Limits(max_message_bytes=args.max_message_bytes, max_batch_size=args.max_batch_size,
                      max_batch_bytes=args.max_batch_bytes, max_streams=args.max_streams,
                      max_memory_bytes=max_memory, max_pending_connections=args.max_pending_connections),
        metrics_port=args.metrics_port, metrics_address=args.metrics_address, workers=args.workers,
        prefetch=args.prefetch, decode_threads=args.decode_threads, decode_pool=args.decode_pool,
        share_window=args.share_window, share_hold_s=args.share_hold, bulk=args.bulk, bulk_port=args.bulk_port,
        batch_slots=args.batch_slots,
        grace_s=args.grace, cache_dir=False if args.cache_dir == "none" else args.cache_dir,
        cache_limit=args.cache_limit,
    )
    server, _ = create_server(args.roots, config, logger=log)
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, frame) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    keep_large_blocks()  # messages of megabytes: no page faults per message (gdsload.host.malloc)
    warm_up()
    server.start()
    while not stop.wait(0.5):
        pass
    event(log, "signal", signal=received[0] if received else None)
    server.shutdown()
    return 0
