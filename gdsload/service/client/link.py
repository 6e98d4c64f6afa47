"""How a `RemoteLoader` reaches its servers: channels (one per address and process), the call
metadata, deadlines and the retry policy (`Link`, `Attempts`), and the addresses themselves
(`Addresses`: a fixed list, `unix:` paths, or `dns:///NAME:PORT` resolved here into one channel per
address and resolved again every `resolve_interval_s`).

Nothing here refers to a loader or an epoch, so a thread holding a `Link` keeps neither alive.
"""

from __future__ import annotations

import functools
import random
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gdsload.errors import GdsloadError, require
from gdsload.host.forksafe import ProcessLocal

require("grpc", extra="serve", purpose="the remote feed (RemoteLoader)")

import grpc

from gdsload.ring.staging import StagingPool
from gdsload.service.protocol import status, wire
from gdsload.service.client.bulk import BulkCall, IdleConnections, bulk_target
from gdsload.service.client.options import Connection, RetryPolicy
from gdsload.service.protocol.auth import metadata
from gdsload.service.protocol.config import bind_host, dns_rest
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc


#: Free receive buffers a loader keeps (`_Channels.bodies`).
BODIES_KEPT = 8


class _FeedStub(pb_grpc.FeedStub):
    """The generated stub, but StreamBatches yields `(BatchChunk without data, data view)` from
    `wire.split_chunk` (protobuf would copy every chunk's data twice), and takes the batches from
    the server's bulk connection when `bulk_target` is set and the server offers one
    (`gdsload.service.server.bulk`)."""

    def __init__(self, channel: grpc.Channel, bulk_target: tuple[int, str] | None = None,
                 bodies: StagingPool | None = None):
        super().__init__(channel)
        del self.StreamBatches  # the generated callable (an instance attribute): the method below instead
        self._stream_batches = channel.unary_stream(
            "/gdsload.v1.Feed/StreamBatches", request_serializer=pb.BatchRequest.SerializeToString,
            response_deserializer=wire.split_chunk, _registered_method=True)
        self.bulk_target = bulk_target
        self.bulk_refused: str | None = None  # why this address's bulk port could not be reached
        self.idle = IdleConnections()  # bulk connections between streams
        self.bodies = bodies  # where received batch bodies go (`_Channels.bodies`)

    def StreamBatches(self, request: pb.BatchRequest, **kw: Any) -> Any:
        start = functools.partial(self._stream_batches, **kw)
        if self.bulk_target is None or self.bulk_refused is not None:
            return start(request)
        return BulkCall(start, request, self.bulk_target, on_refused=self._refused, idle=self.idle,
                        bodies=self.bodies)

    def _refused(self, why: str) -> None:
        self.bulk_refused = why  # asked without bulk from now on


class _Channels:
    """One channel per address, in the process that made this object (`Link` makes one per
    process: the parent's channels, threads and sockets belong to the parent). `tls`: the PEM
    bytes (root certificates, private key, certificate chain) or None; the credentials are made
    here, since grpc's cannot be pickled."""

    def __init__(self, tls: tuple[bytes | None, bytes | None, bytes | None] | None, options: list[tuple[str, Any]],
                 bulk: bool = True):
        self._bulk = bulk and tls is None  # the bulk connection is plaintext: never beside TLS
        self._credentials = None
        if tls is not None:
            root, key, chain = tls
            self._credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key,
                                                             certificate_chain=chain)
        self._options = options
        # Received batch bodies, reused once the consumer let go of a batch (every array of it
        # gone): a fresh multi-MB buffer per batch had its pages cleared by the kernel at first
        # touch, 68% of a client's CPU receiving float32 decoded batches on the 2-core VM
        # (`perf`; clear_page_erms). `keep`: free buffers kept, for the batches in flight.
        self.bodies = StagingPool(keep=BODIES_KEPT)
        self._stubs: dict[str, tuple[grpc.Channel, _FeedStub]] = {}
        self._lock = threading.Lock()

    def stub(self, address: str, tls_name: str | None = None) -> _FeedStub:
        """The stub of `address`; `tls_name`: the name its TLS certificate is checked against when
        it is not the address itself (an address resolved from a `dns:///` name), unless the
        loader's `tls_server_name` overrides it for every address."""
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                options = self._options
                if (self._credentials is not None and tls_name
                        and not any(k == "grpc.ssl_target_name_override" for k, _ in options)):
                    options = [*options, ("grpc.ssl_target_name_override", tls_name)]
                if self._credentials is not None:
                    channel = grpc.secure_channel(address, self._credentials, options=options)
                else:
                    channel = grpc.insecure_channel(address, options=options)
                entry = (channel, _FeedStub(channel, bulk_target(address) if self._bulk else None, self.bodies))
                self._stubs[address] = entry
            return entry[1]

    def drop(self, address: str) -> None:
        """Close the channel of an address that left (a `dns:///` name no longer resolves to it)."""
        with self._lock:
            entry = self._stubs.pop(address, None)
        if entry is not None:
            entry[0].close()
            entry[1].idle.close()

    def close(self) -> None:
        with self._lock:
            for channel, stub in self._stubs.values():
                channel.close()
                stub.idle.close()
            self._stubs = {}



# -- addresses -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint:
    """One server to open a channel to: `target` as grpc takes it ("10.0.0.7:50051", "[::1]:50051",
    "unix:/run/feed.sock"), `tls_name` the host its certificate is checked against when that is
    not the target (addresses resolved from a `dns:///` name), `source` the address it came from."""

    target: str
    tls_name: str | None = None
    source: str = ""


def check_address(address: str) -> None:
    """Refuse what is neither `HOST:PORT`, `[IPv6]:PORT`, `unix:PATH` nor `dns:///HOST:PORT`."""
    if not isinstance(address, str) or not address:
        raise GdsloadError(f"an address must be a non-empty string, got {address!r}")
    if address.startswith("unix:"):
        if not address[len("unix:"):].lstrip("/"):
            raise GdsloadError(f"address {address!r}: a unix: address needs a socket path (unix:/run/feed.sock)")
        return
    if address.startswith("unix-abstract:"):
        return
    host, sep, port = dns_rest(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise GdsloadError(f"address {address!r} must be HOST:PORT, [IPv6]:PORT, unix:PATH or "
                           f"dns:///HOST:PORT (e.g. 127.0.0.1:50051, dns:///feed.ns.svc:50051)")


def check_addresses(address: str | Sequence[str]) -> list[str]:
    """`RemoteLoader(address=...)` as a list of addresses, each checked (`check_address`)."""
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses or not all(isinstance(a, str) and a for a in addresses):
        raise GdsloadError(f"address must be 'HOST:PORT' or a non-empty list of them, got {address!r}")
    for a in addresses:
        check_address(a)
    return addresses


def is_dns(address: str) -> bool:
    return address.startswith("dns:")


def resolve(address: str) -> list[Endpoint]:
    """The endpoints of one address: itself, or for `dns:///HOST:PORT` one per address the system
    resolver returns for HOST (IPv4 and IPv6, in the resolver's order, without repeats). Raises
    OSError when the name does not resolve."""
    if not is_dns(address):
        return [Endpoint(address, None, address)]
    host, _, port = dns_rest(address).rpartition(":")
    name = bind_host(host)
    out: list[Endpoint] = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM):
        ip = sockaddr[0]
        target = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        ep = Endpoint(target, name, address)
        if ep not in out:
            out.append(ep)
    return out


class EndedEarly(Exception):
    """A stream ended early without an error status (e.g. a draining server)."""



class Link(ProcessLocal):
    """How a loader reaches its servers, shared by the loader and its receiver threads: channels,
    addresses and the one in use, call metadata, deadlines and the retry policy.

    It refers to no loader and no epoch, so a thread holding it keeps neither alive. Its
    channels, lock and random generator are per process (`ProcessLocal`; the loader checks).
    """

    _PROCESS_LOCAL = ("channels", "_lock", "_rng", "servers", "probed")

    def __init__(self, addresses: list[str], index: int, connection: Connection, retry: RetryPolicy, *,
                 dataset: Any, resolve_names: bool = False):
        self.addresses = addresses
        self.index = index  # the address in use (unary calls, an unstriped stream)
        self.connection = connection
        self.retry = retry
        self.channel_args = connection.channel_args()  # (reads the PEM files: a bad path fails here)
        self.metadata = metadata(connection.token)
        self.dataset = dataset  # (named in errors)
        self.deadline_s = connection.deadline_s
        self.stream_deadline_s = connection.stream_deadline_s
        self.retry_timeout_s = retry.retry_timeout_s
        self.max_retries = retry.max_retries
        self.reconnects = 0
        self.resolve_names = resolve_names  # dns:/// resolved here (striping) rather than by grpc
        self._start_process()

    def _init_process_local(self) -> None:
        self.channels = _Channels(*self.channel_args)
        self._lock = threading.Lock()
        self._rng = random.Random()
        self.servers: dict[str, dict[str, Any]] = {}  # per address: stats()["servers"]
        # dataset id -> {address: serves block_stride}: the servers whose probe said they serve the
        # dataset id a loader planned with; a later pass of that plan starts them without one
        # (`stripe.schedule.Schedule`, `known`; a pass takes a copy: another pass's threads add)
        self.probed: dict[str, dict[str, bool]] = {}

    def enter_process(self) -> None:
        """In a forked child, leave the parent's channels and locks alone and start afresh."""
        self._check_process()

    def dataset_info(self, name: str) -> pb.DatasetInfo:
        """The servers' `DatasetInfo` of the dataset served as `name` (`ListDatasets`)."""
        resp = self.unary("ListDatasets", pb.ListDatasetsRequest(name=name))
        if len(resp.datasets) != 1:
            raise GdsloadError(f"the server answered {len(resp.datasets)} datasets for {name!r}")
        return resp.datasets[0]

    def bump(self, address: str, **add: float) -> None:
        """Add to the counters of `address` (batches, bytes, wait_s, failures, stalls, duplicates,
        pauses, paused_s; `paused_reason` and `paused_at` are marked)."""
        with self._lock:
            row = self.servers.get(address)
            if row is None:
                row = self.servers[address] = {"batches": 0, "bytes": 0, "in_flight": 0, "wait_s": 0.0,
                                               "failures": 0, "stalls": 0, "duplicates": 0, "state": "new",
                                               "pauses": 0, "paused_s": 0.0, "paused_reason": "", "paused_at": None}
            for key, value in add.items():
                row[key] += value

    def mark(self, address: str, **values: Any) -> None:
        """Set fields of the row of `address` (state, in_flight)."""
        self.bump(address)
        with self._lock:
            self.servers[address].update(values)

    def server_stats(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {a: dict(row) for a, row in self.servers.items()}

    def address(self) -> str:
        with self._lock:
            return self.addresses[self.index]

    def failover(self, failed: str) -> None:
        """Move to the next address (unless another thread already moved away from `failed`)."""
        with self._lock:
            if self.addresses[self.index] == failed:
                self.index = (self.index + 1) % len(self.addresses)
            self.reconnects += 1

    def reconnect(self) -> None:
        """Count a new stream to the same address after one broke."""
        with self._lock:
            self.reconnects += 1

    def backoff(self, failures: int) -> float:
        """The wait after `failures` in a row (`RetryPolicy.backoff`, with this process's jitter)."""
        with self._lock:
            jitter = self._rng.random()
        return self.retry.backoff(failures, jitter)

    def gave_up(self, attempts: Attempts, last_error: str, address: str, *, resume: bool) -> status.RemoteError:
        """The error that ends a spent retry budget: what was tried, the last error, what to do."""
        limit = f"retry_timeout_s={self.retry_timeout_s:g}"
        if self.max_retries is not None:
            limit += f", max_retries={self.max_retries}"
        advice = (" Nothing was lost: the loader's state_dict() is at the last batch it handed out; "
                  "to resume, pass it to load_state_dict() of this or a new RemoteLoader once a server "
                  "is back, and iterate again." if resume else "")
        return status.RemoteError(
            f"gave up on dataset {self.dataset!r} after {attempts.failures} attempts in "
            f"{attempts.elapsed():.1f} s without an answer ({limit}; addresses {self.addresses}); last "
            f"error: {last_error}.{advice} Raise retry_timeout_s to wait longer for a restart.",
            code="UNAVAILABLE", address=address)

    def corrupt_everywhere(self, err: grpc.RpcError, address: str) -> status.RemoteError:
        """The DATA_LOSS error raised once every address answered it."""
        exc = status.from_rpc_error(err, address)
        if len(self.addresses) > 1:
            exc.add_note(f"every address ({', '.join(self.addresses)}) answered DATA_LOSS for this batch")
        return exc

    def unary(self, method: str, request: Any) -> Any:
        """One unary call, retried and failed over as the retry policy says."""
        self._check_process()
        attempts = Attempts(self)
        corrupt: set[str] = set()
        turn = 0
        while True:
            address = self.address()
            target, tls_name = address, None
            if self.resolve_names and is_dns(address):  # as the striped receiver resolves it
                why = f"{address} resolves to no address"
                try:
                    eps = resolve(address)
                except OSError as exc:
                    eps, why = [], f"cannot resolve {address}: {exc}"
                if not eps:
                    attempts.fail()
                    if attempts.spent():
                        raise self.gave_up(attempts, why, address, resume=False) from None
                    time.sleep(attempts.delay())
                    continue
                ep = eps[turn % len(eps)]
                target, tls_name = ep.target, ep.tls_name
            try:
                call = getattr(self.channels.stub(target, tls_name), method)
                return call(request, timeout=self.deadline_s, metadata=self.metadata)
            except grpc.RpcError as err:
                turn += 1
                self.bump(target, failures=1)
                if status.is_elsewhere(err):
                    corrupt.add(address)
                    if corrupt.issuperset(self.addresses):
                        raise self.corrupt_everywhere(err, address) from None
                    self.failover(address)
                    continue
                if not status.is_retryable(err):
                    raise status.from_rpc_error(err, address) from None
                attempts.fail()
                if attempts.spent():
                    raise self.gave_up(attempts, str(status.from_rpc_error(err, address)), address,
                                       resume=False) from None
                self.failover(address)
                time.sleep(attempts.delay())



class Attempts:
    """A run of failed attempts with nothing received in between: the retry budget. It is spent
    once `retry_timeout_s` passed since the first failure, or (when set) after `max_retries`
    retries; `delay()` never sleeps past the budget's end. `now`: a `time.monotonic()` reading
    (the striping schedule passes its own; default: the clock)."""

    def __init__(self, link: Link):
        self.link = link
        self.failures = 0
        self.since = 0.0

    def fail(self, now: float | None = None) -> None:
        if self.failures == 0:
            self.since = time.monotonic() if now is None else now
        self.failures += 1

    def reset(self) -> None:
        self.failures = 0

    def elapsed(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.since if self.failures else 0.0

    def spent(self, now: float | None = None) -> bool:
        L = self.link
        return bool(self.failures) and (self.elapsed(now) >= L.retry_timeout_s
                                        or (L.max_retries is not None and self.failures > L.max_retries))

    def delay(self) -> float:
        return max(0.0, min(self.link.backoff(self.failures), self.link.retry_timeout_s - self.elapsed()))
